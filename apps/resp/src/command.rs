//! The commands the front speaks: one table ([`COMMANDS`]) that both the parser's arity checks
//! and `COMMAND`'s answer come from, and the parse of a request's arguments into a typed
//! [`Command`], with Redis's own error texts for what does not parse.

use bytes::Bytes;

use crate::codec::Frame;

/// One command the front knows: Redis's `COMMAND` fields for it.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Lower-case name.
    pub name: &'static str,
    /// Arguments with the name: `n` exactly, or `-n` at least n.
    pub arity: i64,
    /// Redis's flags (`write`, `readonly`, `fast`, ...).
    pub flags: &'static [&'static str],
    /// Position of the first key (0: none).
    pub first_key: i64,
    /// Position of the last key (-1: the last argument).
    pub last_key: i64,
    /// Step between keys.
    pub step: i64,
}

const fn spec(
    name: &'static str,
    arity: i64,
    flags: &'static [&'static str],
    keys: (i64, i64, i64),
) -> Spec {
    Spec {
        name,
        arity,
        flags,
        first_key: keys.0,
        last_key: keys.1,
        step: keys.2,
    }
}

const NO_KEYS: (i64, i64, i64) = (0, 0, 0);
const ONE_KEY: (i64, i64, i64) = (1, 1, 1);
const ALL_KEYS: (i64, i64, i64) = (1, -1, 1);

/// Every command the front answers, and what `COMMAND` says of each.
pub const COMMANDS: &[Spec] = &[
    spec("get", 2, &["readonly", "fast"], ONE_KEY),
    spec("set", -3, &["write", "denyoom"], ONE_KEY),
    spec("del", -2, &["write"], ALL_KEYS),
    spec("exists", -2, &["readonly", "fast"], ALL_KEYS),
    spec("mget", -2, &["readonly", "fast"], ALL_KEYS),
    spec("mset", -3, &["write", "denyoom"], (1, -1, 2)),
    spec("incr", 2, &["write", "denyoom", "fast"], ONE_KEY),
    spec("incrby", 3, &["write", "denyoom", "fast"], ONE_KEY),
    spec("decr", 2, &["write", "denyoom", "fast"], ONE_KEY),
    spec("decrby", 3, &["write", "denyoom", "fast"], ONE_KEY),
    spec("ping", -1, &["fast", "stale"], NO_KEYS),
    spec("echo", 2, &["fast"], NO_KEYS),
    spec("info", -1, &["loading", "stale"], NO_KEYS),
    spec("command", -1, &["loading", "stale"], NO_KEYS),
    spec("client", -2, &["loading", "stale"], NO_KEYS),
    spec(
        "auth",
        -2,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        NO_KEYS,
    ),
    spec(
        "hello",
        -1,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        NO_KEYS,
    ),
    spec(
        "quit",
        -1,
        &["loading", "stale", "fast", "no_auth"],
        NO_KEYS,
    ),
    spec("select", 2, &["loading", "stale", "fast"], NO_KEYS),
    spec("cluster", -2, &["stale"], NO_KEYS),
    spec("config", -2, &["admin", "loading", "stale"], NO_KEYS),
    spec("readonly", 1, &["loading", "stale", "fast"], NO_KEYS),
    spec("readwrite", 1, &["loading", "stale", "fast"], NO_KEYS),
    spec("dbsize", 1, &["readonly", "fast"], NO_KEYS),
    spec("scan", -2, &["readonly"], NO_KEYS),
];

/// The most keys one `SCAN` returns (its `COUNT`, at most this).
pub const MAX_SCAN_COUNT: usize = 1000;

/// The spec of the command named `name` (any case).
pub fn lookup(name: &[u8]) -> Option<&'static Spec> {
    COMMANDS
        .iter()
        .find(|s| s.name.as_bytes().eq_ignore_ascii_case(name))
}

impl Spec {
    /// This command's entry in `COMMAND`'s answer (Redis 7's ten fields).
    pub fn info(&self) -> Frame {
        Frame::Array(vec![
            Frame::bulk(self.name),
            Frame::Integer(self.arity),
            Frame::Set(
                self.flags
                    .iter()
                    .map(|f| Frame::Simple(Bytes::from_static(f.as_bytes())))
                    .collect(),
            ),
            Frame::Integer(self.first_key),
            Frame::Integer(self.last_key),
            Frame::Integer(self.step),
            Frame::Set(Vec::new()),
            Frame::Set(Vec::new()),
            Frame::Array(Vec::new()),
            Frame::Array(Vec::new()),
        ])
    }

    fn arity_ok(&self, n: usize) -> bool {
        let n = n as i64;
        if self.arity >= 0 {
            n == self.arity
        } else {
            n >= -self.arity
        }
    }
}

/// `SET`'s condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetCondition {
    /// Always.
    Always,
    /// `XX`: only if the key exists (MICA's update handler).
    Exists,
}

/// `CLUSTER`'s subcommands.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClusterCommand {
    /// `CLUSTER SLOTS`.
    Slots,
    /// `CLUSTER SHARDS`.
    Shards,
    /// `CLUSTER NODES`.
    Nodes,
    /// `CLUSTER INFO`.
    Info,
    /// `CLUSTER MYID`.
    MyId,
    /// `CLUSTER KEYSLOT key`.
    KeySlot(Bytes),
}

/// `CLIENT`'s subcommands.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientCommand {
    /// `CLIENT SETNAME name`.
    SetName(Bytes),
    /// `CLIENT GETNAME`.
    GetName,
    /// `CLIENT ID`.
    Id,
    /// `CLIENT SETINFO ...` (library names clients announce): accepted.
    SetInfo,
}

/// A parsed command.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// `GET key`.
    Get(Bytes),
    /// `SET key value [XX]`.
    Set {
        /// The key.
        key: Bytes,
        /// The value.
        value: Bytes,
        /// `XX` or not.
        condition: SetCondition,
    },
    /// `DEL key...`.
    Del(Vec<Bytes>),
    /// `EXISTS key...`.
    Exists(Vec<Bytes>),
    /// `MGET key...`.
    MGet(Vec<Bytes>),
    /// `MSET key value...`.
    MSet(Vec<(Bytes, Bytes)>),
    /// `INCR`, `INCRBY`, `DECR`, `DECRBY`: the key and the signed step.
    IncrBy(Bytes, i64),
    /// `PING [message]`.
    Ping(Option<Bytes>),
    /// `ECHO message`.
    Echo(Bytes),
    /// `INFO [section]`.
    Info,
    /// `COMMAND`, `COMMAND COUNT`, `COMMAND INFO name...`, `COMMAND DOCS ...`.
    CommandInfo(CommandQuery),
    /// `CLIENT ...`.
    Client(ClientCommand),
    /// `AUTH [user] password`.
    Auth {
        /// The user (a tenant's name), or the default user's.
        user: Option<Bytes>,
        /// The password (the tenant's credential, 64 hexadecimal digits).
        password: Bytes,
    },
    /// `HELLO [protover [AUTH user password] [SETNAME name]]`.
    Hello {
        /// The protocol version asked for.
        protocol: Option<i64>,
        /// `AUTH user password`.
        auth: Option<(Bytes, Bytes)>,
        /// `SETNAME name`.
        name: Option<Bytes>,
    },
    /// `QUIT`.
    Quit,
    /// `SELECT db` (only 0 exists).
    Select(i64),
    /// `CLUSTER ...`.
    Cluster(ClusterCommand),
    /// `CONFIG GET pattern...`: answered with no parameters (redis-benchmark asks).
    ConfigGet,
    /// `READONLY` / `READWRITE` (cluster clients' replica reads): accepted, no effect.
    ReadMode,
    /// `DBSIZE`: the table's live items are not counted; answered by the error.
    DbSize,
    /// `SCAN cursor [MATCH *] [COUNT n]`: keys in order from `cursor` (a B-tree tenant).
    Scan {
        /// The key to start at.
        cursor: u64,
        /// How many keys at most.
        count: usize,
    },
}

/// What `COMMAND` is asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandQuery {
    /// Every command.
    All,
    /// How many.
    Count,
    /// These commands (by name).
    Info(Vec<Bytes>),
    /// Their documentation: none is kept, an empty answer.
    Docs,
}

/// Why a command was refused, with Redis's text for it (the `-` line's contents).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// No such command.
    #[error("ERR unknown command '{name}', with args beginning with: {args}")]
    Unknown {
        /// The name sent (printable, cut).
        name: String,
        /// The first arguments (printable, cut).
        args: String,
    },
    /// Wrong number of arguments.
    #[error("ERR wrong number of arguments for '{name}' command")]
    Arity {
        /// The command.
        name: &'static str,
    },
    /// An option that does not parse.
    #[error("ERR syntax error")]
    Syntax,
    /// A number that is not a 64-bit integer.
    #[error("ERR value is not an integer or out of range")]
    NotAnInteger,
    /// An option this store cannot honour (MICA keeps no expiry, and has no insert-if-absent).
    #[error("ERR {what} is not supported: {why}")]
    Unsupported {
        /// The option or command.
        what: String,
        /// Why.
        why: &'static str,
    },
    /// An unknown subcommand.
    #[error("ERR unknown subcommand '{sub}'. Try {command} HELP.")]
    UnknownSubcommand {
        /// The command.
        command: &'static str,
        /// The subcommand sent (printable, cut).
        sub: String,
    },
}

/// `b` as printable text, at most 64 characters of it (for error messages).
pub fn printable(b: &[u8]) -> String {
    let mut s: String = b
        .iter()
        .take(64)
        .flat_map(|&c| std::ascii::escape_default(c))
        .map(char::from)
        .collect();
    if b.len() > 64 {
        s.push_str("...");
    }
    s
}

fn int(b: &[u8]) -> Result<i64, CommandError> {
    std::str::from_utf8(b)
        .ok()
        .filter(|t| !t.starts_with('+'))
        .and_then(|t| t.parse().ok())
        .ok_or(CommandError::NotAnInteger)
}

fn is(b: &[u8], word: &str) -> bool {
    b.eq_ignore_ascii_case(word.as_bytes())
}

/// Parses `args` (the name first) into a command.
pub fn parse(args: &[Bytes]) -> Result<Command, CommandError> {
    let Some(name) = args.first() else {
        return Err(CommandError::Syntax);
    };
    let Some(spec) = lookup(name) else {
        let shown: Vec<String> = args[1..]
            .iter()
            .take(4)
            .map(|a| format!("'{}' ", printable(a)))
            .collect();
        return Err(CommandError::Unknown {
            name: printable(name),
            args: shown.concat(),
        });
    };
    if !spec.arity_ok(args.len()) {
        return Err(CommandError::Arity { name: spec.name });
    }
    let rest = &args[1..];
    let unsupported = |what: &str, why| CommandError::Unsupported {
        what: what.to_string(),
        why,
    };
    Ok(match spec.name {
        "get" => Command::Get(rest[0].clone()),
        "set" => {
            let mut condition = SetCondition::Always;
            for opt in &rest[2..] {
                if is(opt, "XX") {
                    condition = SetCondition::Exists;
                } else if is(opt, "NX") {
                    return Err(unsupported(
                        "SET NX",
                        "MICA has no insert-if-absent handler",
                    ));
                } else if ["EX", "PX", "EXAT", "PXAT", "KEEPTTL"]
                    .iter()
                    .any(|w| is(opt, w))
                {
                    return Err(unsupported(
                        &format!("SET {}", printable(opt).to_uppercase()),
                        "keys do not expire in MICA",
                    ));
                } else if is(opt, "GET") {
                    return Err(unsupported(
                        "SET GET",
                        "MICA's put does not return the old value",
                    ));
                } else {
                    return Err(CommandError::Syntax);
                }
            }
            Command::Set {
                key: rest[0].clone(),
                value: rest[1].clone(),
                condition,
            }
        }
        "del" => Command::Del(rest.to_vec()),
        "exists" => Command::Exists(rest.to_vec()),
        "mget" => Command::MGet(rest.to_vec()),
        "mset" => {
            if !rest.len().is_multiple_of(2) {
                return Err(CommandError::Arity { name: "mset" });
            }
            Command::MSet(
                rest.chunks_exact(2)
                    .map(|p| (p[0].clone(), p[1].clone()))
                    .collect(),
            )
        }
        "incr" => Command::IncrBy(rest[0].clone(), 1),
        "decr" => Command::IncrBy(rest[0].clone(), -1),
        "incrby" => Command::IncrBy(rest[0].clone(), int(&rest[1])?),
        "decrby" => {
            let by = int(&rest[1])?;
            Command::IncrBy(
                rest[0].clone(),
                by.checked_neg().ok_or(CommandError::NotAnInteger)?,
            )
        }
        "ping" => match rest {
            [] => Command::Ping(None),
            [m] => Command::Ping(Some(m.clone())),
            _ => return Err(CommandError::Arity { name: "ping" }),
        },
        "echo" => Command::Echo(rest[0].clone()),
        "info" => Command::Info,
        "command" => Command::CommandInfo(match rest.first() {
            None => CommandQuery::All,
            Some(s) if is(s, "COUNT") => CommandQuery::Count,
            Some(s) if is(s, "INFO") => CommandQuery::Info(rest[1..].to_vec()),
            Some(s) if is(s, "DOCS") => CommandQuery::Docs,
            Some(s) => {
                return Err(CommandError::UnknownSubcommand {
                    command: "COMMAND",
                    sub: printable(s),
                })
            }
        }),
        "client" => {
            let sub = &rest[0];
            Command::Client(if is(sub, "SETNAME") && rest.len() == 2 {
                if rest[1].iter().any(|&c| c <= b' ' || c > b'~') {
                    return Err(CommandError::Unsupported {
                        what: "Client names with spaces, newlines or special characters".into(),
                        why: "Redis refuses them too",
                    });
                }
                ClientCommand::SetName(rest[1].clone())
            } else if is(sub, "GETNAME") && rest.len() == 1 {
                ClientCommand::GetName
            } else if is(sub, "ID") && rest.len() == 1 {
                ClientCommand::Id
            } else if is(sub, "SETINFO") && rest.len() == 3 {
                ClientCommand::SetInfo
            } else if ["SETNAME", "GETNAME", "ID", "SETINFO"]
                .iter()
                .any(|w| is(sub, w))
            {
                return Err(CommandError::Arity { name: "client" });
            } else {
                return Err(CommandError::UnknownSubcommand {
                    command: "CLIENT",
                    sub: printable(sub),
                });
            })
        }
        "auth" => match rest {
            [password] => Command::Auth {
                user: None,
                password: password.clone(),
            },
            [user, password] => Command::Auth {
                user: Some(user.clone()),
                password: password.clone(),
            },
            _ => return Err(CommandError::Syntax),
        },
        "hello" => {
            let mut protocol = None;
            let (mut auth, mut name) = (None, None);
            let mut i = 0;
            if let Some(v) = rest.first() {
                protocol = Some(int(v).map_err(|_| CommandError::Unsupported {
                    what: "Protocol version".into(),
                    why: "it is not an integer or out of range",
                })?);
                i = 1;
            }
            while i < rest.len() {
                if is(&rest[i], "AUTH") && rest.len() > i + 2 {
                    auth = Some((rest[i + 1].clone(), rest[i + 2].clone()));
                    i += 3;
                } else if is(&rest[i], "SETNAME") && rest.len() > i + 1 {
                    name = Some(rest[i + 1].clone());
                    i += 2;
                } else {
                    return Err(CommandError::Syntax);
                }
            }
            Command::Hello {
                protocol,
                auth,
                name,
            }
        }
        "quit" => Command::Quit,
        "select" => Command::Select(int(&rest[0])?),
        "cluster" => {
            let sub = &rest[0];
            let only = |c: ClusterCommand| {
                if rest.len() == 1 {
                    Ok(c)
                } else {
                    Err(CommandError::Arity { name: "cluster" })
                }
            };
            Command::Cluster(if is(sub, "SLOTS") {
                only(ClusterCommand::Slots)?
            } else if is(sub, "SHARDS") {
                only(ClusterCommand::Shards)?
            } else if is(sub, "NODES") {
                only(ClusterCommand::Nodes)?
            } else if is(sub, "INFO") {
                only(ClusterCommand::Info)?
            } else if is(sub, "MYID") {
                only(ClusterCommand::MyId)?
            } else if is(sub, "KEYSLOT") && rest.len() == 2 {
                ClusterCommand::KeySlot(rest[1].clone())
            } else {
                return Err(CommandError::UnknownSubcommand {
                    command: "CLUSTER",
                    sub: printable(sub),
                });
            })
        }
        "config" => {
            if is(&rest[0], "GET") {
                Command::ConfigGet
            } else {
                return Err(CommandError::UnknownSubcommand {
                    command: "CONFIG",
                    sub: printable(&rest[0]),
                });
            }
        }
        "readonly" | "readwrite" => Command::ReadMode,
        "dbsize" => Command::DbSize,
        "scan" => {
            let cursor = std::str::from_utf8(&rest[0])
                .ok()
                .and_then(|t| t.parse::<u64>().ok())
                .ok_or(CommandError::Unsupported {
                    what: "A cursor that is not a decimal integer".into(),
                    why: "SCAN's cursor is the B-tree key to go on from",
                })?;
            let mut count = 10usize;
            let mut i = 1;
            while i < rest.len() {
                let Some(v) = rest.get(i + 1) else {
                    return Err(CommandError::Syntax);
                };
                if is(&rest[i], "COUNT") {
                    let n = int(v)?;
                    if n < 1 {
                        return Err(CommandError::Syntax);
                    }
                    count = (n as usize).min(MAX_SCAN_COUNT);
                } else if is(&rest[i], "MATCH") {
                    if &v[..] != b"*" {
                        return Err(CommandError::Unsupported {
                            what: "SCAN MATCH with a pattern".into(),
                            why: "only MATCH * is taken: a B-tree's keys are integers in order",
                        });
                    }
                } else if is(&rest[i], "TYPE") {
                    if !is(v, "string") {
                        return Err(CommandError::Unsupported {
                            what: "SCAN TYPE other than string".into(),
                            why: "every key is a string",
                        });
                    }
                } else {
                    return Err(CommandError::Syntax);
                }
                i += 2;
            }
            Command::Scan { cursor, count }
        }
        other => {
            // The table has a name the match does not: a bug here, answered as unknown.
            return Err(CommandError::Unknown {
                name: other.to_string(),
                args: String::new(),
            });
        }
    })
}

impl Command {
    /// The keys the command touches (for cluster slot checks).
    pub fn keys(&self) -> Vec<&Bytes> {
        match self {
            Command::Get(k) | Command::Set { key: k, .. } | Command::IncrBy(k, _) => vec![k],
            Command::Del(ks) | Command::Exists(ks) | Command::MGet(ks) => ks.iter().collect(),
            Command::MSet(pairs) => pairs.iter().map(|(k, _)| k).collect(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(words: &[&str]) -> Result<Command, CommandError> {
        let args: Vec<Bytes> = words
            .iter()
            .map(|w| Bytes::copy_from_slice(w.as_bytes()))
            .collect();
        parse(&args)
    }

    #[test]
    fn commands_parse_in_any_case_and_refuse_with_redis_texts() {
        assert_eq!(cmd(&["gEt", "k"]).unwrap(), Command::Get("k".into()));
        assert_eq!(
            cmd(&["GET"]).unwrap_err().to_string(),
            "ERR wrong number of arguments for 'get' command"
        );
        assert_eq!(
            cmd(&["FLUSHALL", "x"]).unwrap_err().to_string(),
            "ERR unknown command 'FLUSHALL', with args beginning with: 'x' "
        );
        assert!(matches!(
            cmd(&["SET", "k", "v", "XX"]).unwrap(),
            Command::Set {
                condition: SetCondition::Exists,
                ..
            }
        ));
        assert!(cmd(&["SET", "k", "v", "EX", "10"])
            .unwrap_err()
            .to_string()
            .contains("do not expire"));
        assert!(cmd(&["SET", "k", "v", "NX"])
            .unwrap_err()
            .to_string()
            .contains("insert-if-absent"));
        assert_eq!(cmd(&["SET", "k", "v", "ZZ"]), Err(CommandError::Syntax));
        assert_eq!(cmd(&["INCRBY", "k", "x"]), Err(CommandError::NotAnInteger));
        assert_eq!(
            cmd(&["DECRBY", "k", &i64::MIN.to_string()]),
            Err(CommandError::NotAnInteger)
        );
        assert_eq!(
            cmd(&["MSET", "a", "1", "b"]),
            Err(CommandError::Arity { name: "mset" })
        );
        assert_eq!(
            cmd(&["HELLO", "3", "AUTH", "u", "p", "SETNAME", "n"]).unwrap(),
            Command::Hello {
                protocol: Some(3),
                auth: Some(("u".into(), "p".into())),
                name: Some("n".into())
            }
        );
        assert_eq!(cmd(&["HELLO", "3", "AUTH", "u"]), Err(CommandError::Syntax));
        assert!(cmd(&["CLUSTER", "FAILOVER"]).is_err());
        assert_eq!(
            cmd(&["MSET", "a", "1", "b", "2"]).unwrap().keys(),
            vec![&Bytes::from("a"), &Bytes::from("b")]
        );
    }

    #[test]
    fn every_command_in_the_table_parses_with_its_least_arguments() {
        for s in COMMANDS {
            let n = s.arity.unsigned_abs() as usize;
            let mut words = vec![s.name.to_string()];
            let filler = match s.name {
                "client" => vec!["ID"],
                "cluster" => vec!["INFO"],
                "config" => vec!["GET", "x"],
                _ => vec!["1", "1"],
            };
            words.extend(
                filler
                    .iter()
                    .take(n.saturating_sub(1))
                    .map(|w| w.to_string()),
            );
            let refs: Vec<&str> = words.iter().map(String::as_str).collect();
            assert!(cmd(&refs).is_ok(), "{refs:?}: {:?}", cmd(&refs));
        }
    }
}
