//! One RESP connection's state, with no IO: it takes the connection's commands one by one,
//! answers at once what needs no data (`PING`, `HELLO`, `CLUSTER SLOTS`, errors...), turns the
//! rest into ops of the round's batch, and once the store has run the batch writes every
//! answer, in the order the commands came.
//!
//! Within a round a connection's commands on one key are chained (each op names the earlier
//! one it follows), so that a pipelined `SET k` then `GET k` reads what it wrote, as a single
//! Redis server guarantees; ops on different keys, and other connections' ops, run together.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use crate::codec::{header, Frame, Limits, ProtocolError};
use crate::command::{self, ClientCommand, ClusterCommand, Command, CommandQuery, SetCondition};
use crate::slots::{key_slot, ClusterMap};
use crate::store::{Op, OpKind, Outcome, Store};

/// What the front is set to.
#[derive(Clone, Debug)]
pub struct FrontConfig {
    /// Request limits.
    pub limits: Limits,
    /// Commands a connection may have waiting in one round; the rest waits in its input
    /// buffer (and then in the kernel's) until the next round.
    pub max_pipeline: usize,
    /// Bytes of answers a connection may have unsent before it is read no further until
    /// the client takes them.
    pub max_output: usize,
    /// The cluster map when the front is one node of several; `None`: a standalone server.
    pub cluster: Option<ClusterMap>,
    /// What `INFO` calls this process (`naam-server`, `naam-resp`).
    pub process: &'static str,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            limits: Limits::default(),
            max_pipeline: 1024,
            max_output: 4 << 20,
            cluster: None,
            process: "naam-resp",
        }
    }
}

/// The version the front reports itself as (`INFO`, `HELLO`): the Redis release whose
/// commands it answers, so that clients pick that dialect.
pub const REDIS_VERSION: &str = "7.0.0";

/// How an answer is made from the ops it waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Get,
    Set,
    SetIfExists,
    Del,
    Exists,
    MGet,
    MSet,
    Incr,
    Scan,
}

#[derive(Debug)]
enum Awaiting {
    Ready(Vec<u8>),
    Ops {
        first: u32,
        count: u32,
        shape: Shape,
    },
}

/// One client connection.
#[derive(Debug)]
pub struct Connection<T> {
    /// Its id (`CLIENT ID`, `HELLO`).
    pub id: u64,
    resp3: bool,
    tenant: Option<T>,
    name: Option<Bytes>,
    closing: bool,
    queue: VecDeque<Awaiting>,
    /// The last op of this round on each key, and the round it is of (foldhash: every op
    /// hashes its key here).
    last_op: HashMap<Bytes, u32, foldhash::fast::RandomState>,
    round: u64,
}

impl<T: Copy + Eq + std::fmt::Debug> Connection<T> {
    /// A new connection; it runs as `tenant` until it authenticates (`None`: it must).
    pub fn new(id: u64, tenant: Option<T>) -> Self {
        Connection {
            id,
            resp3: false,
            tenant,
            name: None,
            closing: false,
            queue: VecDeque::new(),
            last_op: HashMap::default(),
            round: u64::MAX,
        }
    }

    /// Whether the connection is to be closed once its answers are sent (`QUIT`, a protocol
    /// error).
    pub fn closing(&self) -> bool {
        self.closing
    }

    /// Whether answers wait for the store.
    pub fn awaiting(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Its protocol: 2 or 3.
    pub fn protocol(&self) -> u8 {
        if self.resp3 {
            3
        } else {
            2
        }
    }

    fn reply(&mut self, out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) {
        if self.queue.is_empty() {
            write(out)
        } else {
            let mut b = Vec::new();
            write(&mut b);
            self.queue.push_back(Awaiting::Ready(b));
        }
    }

    fn error(&mut self, out: &mut Vec<u8>, text: &str) {
        self.reply(out, |o| error_line(o, text));
    }

    fn frame(&mut self, out: &mut Vec<u8>, f: &Frame) {
        self.reply(out, |o| f.encode(o));
    }

    /// The bytes were not RESP: the error is answered after everything before it, and the
    /// connection closes.
    pub fn protocol_error(&mut self, e: &ProtocolError, out: &mut Vec<u8>) {
        self.error(out, &format!("ERR {e}"));
        self.closing = true;
    }

    /// Takes one command (`args`, its name first) in round `round`: answers it into `out`
    /// now, or adds its ops to `ops` and answers it at [`Connection::finish`].
    pub fn command<S: Store<Tenant = T>>(
        &mut self,
        front: &FrontConfig,
        round: u64,
        args: &[Bytes],
        store: &mut S,
        ops: &mut Vec<Op<T>>,
        out: &mut Vec<u8>,
    ) {
        if self.round != round {
            self.round = round;
            self.last_op.clear();
        }
        if args.is_empty() {
            return;
        }
        let cmd = match command::parse(args) {
            Ok(c) => c,
            Err(e) => return self.error(out, &e.to_string()),
        };
        if self.tenant.is_none()
            && !matches!(
                cmd,
                Command::Auth { .. } | Command::Hello { .. } | Command::Quit
            )
        {
            return self.error(out, "NOAUTH Authentication required.");
        }
        let keys = cmd.keys();
        if let (Some(map), Some(first)) = (&front.cluster, keys.first()) {
            let slot = key_slot(first);
            if keys.iter().any(|k| key_slot(k) != slot) {
                return self.error(out, "CROSSSLOT Keys in request don't hash to the same slot");
            }
            if !map.is_mine(slot) {
                return self.error(out, &map.moved(slot));
            }
        }
        match cmd {
            Command::Get(k) => self.data(
                store,
                ops,
                out,
                Shape::Get,
                vec![(OpKind::Get, k, Bytes::new())],
            ),
            Command::Set {
                key,
                value,
                condition,
            } => {
                let (kind, shape) = match condition {
                    SetCondition::Always => (OpKind::Put, Shape::Set),
                    SetCondition::Exists => (OpKind::Update, Shape::SetIfExists),
                };
                self.data(store, ops, out, shape, vec![(kind, key, value)])
            }
            Command::Del(ks) => self.data(store, ops, out, Shape::Del, each(OpKind::Delete, ks)),
            Command::Exists(ks) => self.data(store, ops, out, Shape::Exists, each(OpKind::Get, ks)),
            Command::MGet(ks) => self.data(store, ops, out, Shape::MGet, each(OpKind::Get, ks)),
            Command::MSet(pairs) => {
                let v = pairs
                    .into_iter()
                    .map(|(k, v)| (OpKind::Put, k, v))
                    .collect();
                self.data(store, ops, out, Shape::MSet, v)
            }
            Command::IncrBy(k, by) => self.data(
                store,
                ops,
                out,
                Shape::Incr,
                vec![(OpKind::IncrBy(by), k, Bytes::new())],
            ),
            Command::Ping(None) => self.reply(out, |o| o.extend_from_slice(b"+PONG\r\n")),
            Command::Ping(Some(m)) | Command::Echo(m) => self.frame(out, &Frame::Bulk(m)),
            Command::Info => {
                let text = info_text(front, store, self);
                self.frame(out, &Frame::Bulk(text.into()))
            }
            Command::CommandInfo(q) => {
                let f = match q {
                    CommandQuery::All => {
                        Frame::Array(command::COMMANDS.iter().map(|s| s.info()).collect())
                    }
                    CommandQuery::Count => Frame::Integer(command::COMMANDS.len() as i64),
                    CommandQuery::Info(names) => Frame::Array(
                        names
                            .iter()
                            .map(|n| command::lookup(n).map(|s| s.info()).unwrap_or(self.null()))
                            .collect(),
                    ),
                    CommandQuery::Docs => self.map(Vec::new()),
                };
                self.frame(out, &f)
            }
            Command::Client(c) => match c {
                ClientCommand::SetName(n) => {
                    self.name = (!n.is_empty()).then_some(n);
                    self.ok(out)
                }
                ClientCommand::GetName => {
                    let f = self.name.clone().map(Frame::Bulk).unwrap_or(self.null());
                    self.frame(out, &f)
                }
                ClientCommand::Id => self.frame(out, &Frame::Integer(self.id as i64)),
                ClientCommand::SetInfo => self.ok(out),
            },
            Command::Auth { user, password } => {
                match store.authenticate(user.as_deref(), &password) {
                    Ok(t) => {
                        self.tenant = Some(t);
                        self.ok(out)
                    }
                    Err(e) => self.error(out, &e.to_string()),
                }
            }
            Command::Hello {
                protocol,
                auth,
                name,
            } => {
                let resp3 = match protocol {
                    None => self.resp3,
                    Some(2) => false,
                    Some(3) => true,
                    Some(_) => return self.error(out, "NOPROTO unsupported protocol version"),
                };
                if let Some((user, password)) = auth {
                    match store.authenticate(Some(&user), &password) {
                        Ok(t) => self.tenant = Some(t),
                        Err(e) => return self.error(out, &e.to_string()),
                    }
                }
                if self.tenant.is_none() {
                    return self.error(
                        out,
                        "NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time",
                    );
                }
                self.resp3 = resp3;
                if let Some(n) = name {
                    self.name = (!n.is_empty()).then_some(n);
                }
                let mode = if front.cluster.is_some() {
                    "cluster"
                } else {
                    "standalone"
                };
                let f = self.map(vec![
                    ("server", Frame::bulk("redis")),
                    ("version", Frame::bulk(REDIS_VERSION)),
                    ("proto", Frame::Integer(i64::from(self.protocol()))),
                    ("id", Frame::Integer(self.id as i64)),
                    ("mode", Frame::bulk(mode)),
                    ("role", Frame::bulk("master")),
                    ("modules", Frame::Array(Vec::new())),
                ]);
                self.frame(out, &f)
            }
            Command::Quit => {
                self.ok(out);
                self.closing = true;
            }
            Command::Select(0) => self.ok(out),
            Command::Select(_) => self.error(out, "ERR DB index is out of range"),
            Command::Cluster(c) => {
                let Some(map) = &front.cluster else {
                    return self.error(out, "ERR This instance has cluster support disabled");
                };
                let f = match c {
                    ClusterCommand::Slots => map.slots_reply(),
                    ClusterCommand::Shards => map.shards_reply(self.resp3),
                    ClusterCommand::Nodes => Frame::bulk(map.nodes_text()),
                    ClusterCommand::Info => Frame::bulk(map.info_text()),
                    ClusterCommand::MyId => Frame::bulk(&map.me().id),
                    ClusterCommand::KeySlot(k) => Frame::Integer(i64::from(key_slot(&k))),
                };
                self.frame(out, &f)
            }
            Command::ConfigGet => {
                let f = self.map(Vec::new());
                self.frame(out, &f)
            }
            Command::ReadMode => self.ok(out),
            Command::Scan { cursor, count } => {
                // In a cluster a node's SCAN covers its own keys, as in Redis Cluster: clients
                // scan each node.
                let start = Bytes::from(cursor.to_string());
                self.data(
                    store,
                    ops,
                    out,
                    Shape::Scan,
                    vec![(OpKind::Scan(count), start, Bytes::new())],
                )
            }
            Command::DbSize => self.error(
                out,
                "ERR DBSIZE is not supported: MICA's table does not count its live keys",
            ),
        }
    }

    fn ok(&mut self, out: &mut Vec<u8>) {
        self.reply(out, |o| o.extend_from_slice(b"+OK\r\n"))
    }

    fn null(&self) -> Frame {
        if self.resp3 {
            Frame::Null
        } else {
            Frame::NullBulk
        }
    }

    fn map(&self, pairs: Vec<(&str, Frame)>) -> Frame {
        if self.resp3 {
            Frame::Map(
                pairs
                    .into_iter()
                    .map(|(k, v)| (Frame::bulk(k), v))
                    .collect(),
            )
        } else {
            Frame::Array(
                pairs
                    .into_iter()
                    .flat_map(|(k, v)| [Frame::bulk(k), v])
                    .collect(),
            )
        }
    }

    /// Checks the ops' sizes against the tenant's table, then queues them (chained to this
    /// round's earlier ops on the same keys) and the answer that waits for them.
    fn data<S: Store<Tenant = T>>(
        &mut self,
        store: &mut S,
        ops: &mut Vec<Op<T>>,
        out: &mut Vec<u8>,
        shape: Shape,
        wanted: Vec<(OpKind, Bytes, Bytes)>,
    ) {
        let Some(tenant) = self.tenant else {
            return self.error(out, "NOAUTH Authentication required.");
        };
        let limits = store.key_limits(tenant);
        for (_, k, v) in wanted.iter().filter(|w| !matches!(w.0, OpKind::Scan(_))) {
            if k.is_empty() || k.len() > limits.key_cap {
                return self.error(
                    out,
                    &format!(
                        "ERR key of {} bytes: this table holds keys of 1 to {} bytes",
                        k.len(),
                        limits.key_cap
                    ),
                );
            }
            if v.len() > limits.value_cap {
                return self.error(
                    out,
                    &format!(
                        "ERR value of {} bytes is over this table's {} bytes",
                        v.len(),
                        limits.value_cap
                    ),
                );
            }
        }
        let first = ops.len() as u32;
        let count = wanted.len() as u32;
        for (kind, key, value) in wanted {
            let at = ops.len() as u32;
            let after = self.last_op.insert(key.clone(), at);
            ops.push(Op {
                tenant,
                kind,
                key,
                value,
                after,
                outcome: Outcome::Pending,
            });
        }
        self.queue.push_back(Awaiting::Ops {
            first,
            count,
            shape,
        });
    }

    /// Writes every waiting answer into `out`, in order, from the outcomes of `ops` (the
    /// round's batch, run).
    pub fn finish(&mut self, ops: &[Op<T>], out: &mut Vec<u8>) {
        while let Some(a) = self.queue.pop_front() {
            match a {
                Awaiting::Ready(b) => out.extend_from_slice(&b),
                Awaiting::Ops {
                    first,
                    count,
                    shape,
                } => {
                    let ops = &ops[first as usize..(first + count) as usize];
                    self.answer(shape, ops, out)
                }
            }
        }
    }

    fn answer(&self, shape: Shape, ops: &[Op<T>], out: &mut Vec<u8>) {
        if shape != Shape::MGet {
            if let Some(e) = ops.iter().find_map(|o| match &o.outcome {
                Outcome::Failed(e) => Some(e),
                _ => None,
            }) {
                return error_line(out, e);
            }
        }
        if ops.iter().any(|o| o.outcome == Outcome::Pending) {
            return error_line(out, "ERR the store did not run this command");
        }
        let bulk = |out: &mut Vec<u8>, v: &Option<Bytes>| match v {
            Some(v) => {
                header(out, b'$', v.len() as i64);
                out.extend_from_slice(v);
                out.extend_from_slice(b"\r\n");
            }
            None => self.null().encode(out),
        };
        match shape {
            Shape::Get => match &ops[0].outcome {
                Outcome::Got(v) => bulk(out, v),
                _ => error_line(out, "ERR the store answered a get with no value"),
            },
            Shape::Set | Shape::MSet => out.extend_from_slice(b"+OK\r\n"),
            Shape::SetIfExists => match ops[0].outcome {
                Outcome::Wrote(true) => out.extend_from_slice(b"+OK\r\n"),
                _ => self.null().encode(out),
            },
            Shape::Del => {
                let n = ops
                    .iter()
                    .filter(|o| o.outcome == Outcome::Wrote(true))
                    .count();
                header(out, b':', n as i64)
            }
            Shape::Exists => {
                let n = ops
                    .iter()
                    .filter(|o| matches!(o.outcome, Outcome::Got(Some(_))))
                    .count();
                header(out, b':', n as i64)
            }
            Shape::MGet => {
                header(out, b'*', ops.len() as i64);
                for o in ops {
                    match &o.outcome {
                        Outcome::Got(v) => bulk(out, v),
                        // Redis's MGET answers nil for what it cannot read as a string.
                        _ => self.null().encode(out),
                    }
                }
            }
            Shape::Scan => match &ops[0].outcome {
                Outcome::Scanned(pairs) => {
                    // The next cursor: the key after the last one found, 0 when the scan is done
                    // (fewer keys than asked for).
                    let asked = match ops[0].kind {
                        OpKind::Scan(n) => n,
                        _ => 0,
                    };
                    let next = match pairs.last() {
                        Some((k, _)) if pairs.len() >= asked => std::str::from_utf8(k)
                            .ok()
                            .and_then(|t| t.parse::<u64>().ok())
                            .and_then(|k| k.checked_add(1))
                            .unwrap_or(0),
                        _ => 0,
                    };
                    header(out, b'*', 2);
                    let cursor = next.to_string();
                    header(out, b'$', cursor.len() as i64);
                    out.extend_from_slice(cursor.as_bytes());
                    out.extend_from_slice(b"\r\n");
                    header(out, b'*', pairs.len() as i64);
                    for (k, _) in pairs {
                        header(out, b'$', k.len() as i64);
                        out.extend_from_slice(k);
                        out.extend_from_slice(b"\r\n");
                    }
                }
                _ => error_line(out, "ERR the store answered a scan with no keys"),
            },
            Shape::Incr => match ops[0].outcome {
                Outcome::Counted(n) => header(out, b':', n),
                _ => error_line(out, "ERR the store answered an increment with no number"),
            },
        }
    }
}

fn each(kind: OpKind, keys: Vec<Bytes>) -> Vec<(OpKind, Bytes, Bytes)> {
    keys.into_iter().map(|k| (kind, k, Bytes::new())).collect()
}

/// Appends `-text` and CRLF; a CR or LF inside would end the line early, so they become
/// spaces.
pub fn error_line(out: &mut Vec<u8>, text: &str) {
    out.push(b'-');
    out.extend(
        text.bytes()
            .map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
    out.extend_from_slice(b"\r\n");
}

fn info_text<T: Copy + Eq + std::fmt::Debug, S: Store<Tenant = T>>(
    front: &FrontConfig,
    store: &S,
    conn: &Connection<T>,
) -> String {
    let mode = if front.cluster.is_some() {
        "cluster"
    } else {
        "standalone"
    };
    format!(
        "# Server\r\nredis_version:{REDIS_VERSION}\r\nredis_mode:{mode}\r\nnaam_version:{}\r\nprocess:{}\r\n\
         \r\n# Clients\r\nclient_id:{}\r\nprotocol:{}\r\n\
         \r\n# Cluster\r\ncluster_enabled:{}\r\n\
         \r\n# Store\r\n{}",
        env!("CARGO_PKG_VERSION"),
        front.process,
        conn.id,
        conn.protocol(),
        u8::from(front.cluster.is_some()),
        store.info(conn.tenant),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{parse_command, parse_frame};
    use crate::store::MemoryStore;

    /// Feeds `input` to a connection round by round (one round per call) and returns the
    /// answers as frames.
    fn session(store: &mut MemoryStore, front: &FrontConfig, rounds: &[&[u8]]) -> Vec<Frame> {
        let mut c = Connection::new(1, store.default_tenant());
        let mut out = Vec::new();
        for (round, input) in rounds.iter().enumerate() {
            let mut ops = Vec::new();
            let mut at = 0;
            let mut ranges = Vec::new();
            while let Some(n) = parse_command(&input[at..], &front.limits, &mut ranges).unwrap() {
                let buf = Bytes::copy_from_slice(&input[at..at + n]);
                let args: Vec<Bytes> = ranges.iter().map(|r| buf.slice(r.clone())).collect();
                c.command(front, round as u64, &args, store, &mut ops, &mut out);
                at += n;
            }
            store.run(&mut ops);
            c.finish(&ops, &mut out);
        }
        let mut frames = Vec::new();
        let mut at = 0;
        while let Some((f, n)) = parse_frame(&out[at..], &Limits::default()).unwrap() {
            frames.push(f);
            at += n;
        }
        assert_eq!(at, out.len());
        frames
    }

    fn cmds(lines: &[&[&str]]) -> Vec<u8> {
        let mut out = Vec::new();
        for l in lines {
            Frame::Array(l.iter().map(Frame::bulk).collect()).encode(&mut out);
        }
        out
    }

    #[test]
    fn a_pipeline_is_answered_in_order_and_reads_its_own_writes() {
        let mut store = MemoryStore::default();
        let front = FrontConfig::default();
        let input = cmds(&[
            &["PING"],
            &["SET", "k", "v1"],
            &["GET", "k"],
            &["ECHO", "x"],
            &["SET", "k", "v2", "XX"],
            &["SET", "other", "o", "XX"],
            &["MGET", "k", "nope", "other"],
            &["INCRBY", "n", "5"],
            &["DECR", "n"],
            &["INCR", "k"],
            &["EXISTS", "k", "n", "nope"],
            &["DEL", "k", "nope"],
            &["GET", "k"],
        ]);
        let got = session(&mut store, &front, &[&input]);
        let bulk = Frame::bulk;
        assert_eq!(
            got,
            vec![
                Frame::Simple("PONG".into()),
                Frame::Simple("OK".into()),
                bulk("v1"),
                bulk("x"),
                Frame::Simple("OK".into()),
                Frame::NullBulk,
                Frame::Array(vec![bulk("v2"), Frame::NullBulk, Frame::NullBulk]),
                Frame::Integer(5),
                Frame::Integer(4),
                Frame::Error("ERR value is not an integer or out of range".into()),
                Frame::Integer(2),
                Frame::Integer(1),
                Frame::NullBulk,
            ]
        );
    }

    #[test]
    fn scan_walks_the_keys_in_order_with_the_next_key_as_its_cursor() {
        let mut store = MemoryStore::default();
        let front = FrontConfig::default();
        let input = cmds(&[
            &["MSET", "5", "50", "1", "10", "3", "30", "x", "y"],
            &["SCAN", "0", "COUNT", "2"],
            &["SCAN", "4", "COUNT", "2", "MATCH", "*"],
            &["SCAN", "0", "MATCH", "user:*"],
            &["SCAN", "nope"],
        ]);
        let got = session(&mut store, &front, &[&input]);
        let keys = |ks: &[&str]| Frame::Array(ks.iter().map(Frame::bulk).collect());
        assert_eq!(
            got[1],
            Frame::Array(vec![Frame::bulk("4"), keys(&["1", "3"])])
        );
        assert_eq!(got[2], Frame::Array(vec![Frame::bulk("0"), keys(&["5"])]));
        assert!(got[3]
            .as_bytes()
            .unwrap()
            .starts_with(b"ERR SCAN MATCH with a pattern"));
        assert!(matches!(&got[4], Frame::Error(_)));
    }

    #[test]
    fn auth_is_required_when_the_store_has_users_and_refused_with_wrongpass() {
        let mut store = MemoryStore {
            users: vec![("alice".into(), "secret".into())],
            ..Default::default()
        };
        let front = FrontConfig::default();
        let input = cmds(&[
            &["GET", "k"],
            &["AUTH", "alice", "wrong"],
            &["HELLO", "3"],
            &["HELLO", "3", "AUTH", "alice", "secret"],
            &["GET", "k"],
            &["HELLO", "4"],
        ]);
        let got = session(&mut store, &front, &[&input]);
        assert_eq!(
            got[0],
            Frame::Error("NOAUTH Authentication required.".into())
        );
        assert!(got[1].as_bytes().unwrap().starts_with(b"WRONGPASS"));
        assert!(got[2].as_bytes().unwrap().starts_with(b"NOAUTH"));
        assert!(matches!(&got[3], Frame::Map(p) if p.len() == 7));
        assert_eq!(got[4], Frame::Null, "RESP3 after HELLO 3");
        assert_eq!(
            got[5],
            Frame::Error("NOPROTO unsupported protocol version".into())
        );
    }

    #[test]
    fn oversized_keys_and_values_are_refused_with_the_tables_limits() {
        let mut store = MemoryStore {
            limits: Some(crate::store::KeyLimits {
                key_cap: 4,
                value_cap: 8,
            }),
            ..Default::default()
        };
        let input = cmds(&[
            &["SET", "longkey", "v"],
            &["SET", "k", "123456789"],
            &["GET", ""],
        ]);
        let got = session(&mut store, &FrontConfig::default(), &[&input]);
        assert!(got.iter().all(|f| matches!(f, Frame::Error(_))), "{got:?}");
        assert!(store.data.is_empty());
    }

    #[test]
    fn a_cluster_node_redirects_keys_it_does_not_serve_and_refuses_cross_slot_commands() {
        use crate::slots::{derived_id, Node};
        let addr = |p| std::net::SocketAddr::from(([127, 0, 0, 1], p));
        let nodes = vec![
            Node {
                id: derived_id(addr(1)),
                addr: addr(1),
                ranges: vec![(0, 8191)],
            },
            Node {
                id: derived_id(addr(2)),
                addr: addr(2),
                ranges: vec![(8192, 16383)],
            },
        ];
        let front = FrontConfig {
            cluster: Some(ClusterMap::new(nodes, addr(1)).unwrap()),
            ..Default::default()
        };
        let mut store = MemoryStore::default();
        // "bar" is slot 5061 (here), "foo" 12182 (there).
        let input = cmds(&[
            &["SET", "bar", "1"],
            &["GET", "foo"],
            &["MGET", "bar", "foo"],
            &["MGET", "{bar}a", "{bar}b"],
            &["CLUSTER", "KEYSLOT", "foo"],
        ]);
        let got = session(&mut store, &front, &[&input]);
        assert_eq!(got[0], Frame::Simple("OK".into()));
        assert_eq!(got[1], Frame::Error("MOVED 12182 127.0.0.1:2".into()));
        assert!(got[2].as_bytes().unwrap().starts_with(b"CROSSSLOT"));
        assert_eq!(got[3], Frame::Array(vec![Frame::NullBulk, Frame::NullBulk]));
        assert_eq!(got[4], Frame::Integer(12182));
        let standalone = session(
            &mut store,
            &FrontConfig::default(),
            &[&cmds(&[&["CLUSTER", "SLOTS"]])],
        );
        assert!(standalone[0]
            .as_bytes()
            .unwrap()
            .starts_with(b"ERR This instance has cluster support disabled"));
    }

    proptest::proptest! {
        /// Any bytes: every command gets exactly one well-formed answer, a protocol error
        /// one more, and nothing panics (the fuzz target `resp` runs the same check).
        #[test]
        fn any_bytes_get_one_well_formed_answer_per_command(
            data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            words in proptest::collection::vec(
                proptest::sample::select(vec!["GET", "SET", "MGET", "MSET", "DEL", "PING", "HELLO", "AUTH", "QUIT", "CLUSTER", "COMMAND", "INCR", "k", "v", "3", "XX"]),
                0..12,
            ),
        ) {
            // Half the cases are commands of known words, so the front is reached.
            let mut input = cmds(&[&words]);
            input.extend_from_slice(&data);
            let front = FrontConfig::default();
            let mut store = MemoryStore::default();
            let mut c = Connection::new(1, store.default_tenant());
            let (mut out, mut ops, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
            let (mut at, mut commands) = (0, 0);
            while at < input.len() && !c.closing() {
                match parse_command(&input[at..], &front.limits, &mut ranges) {
                    Ok(Some(n)) => {
                        let buf = Bytes::copy_from_slice(&input[at..at + n]);
                        let args: Vec<Bytes> = ranges.iter().map(|r| buf.slice(r.clone())).collect();
                        commands += usize::from(!args.is_empty());
                        c.command(&front, 0, &args, &mut store, &mut ops, &mut out);
                        at += n;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        c.protocol_error(&e, &mut out);
                        commands += 1;
                    }
                }
            }
            store.run(&mut ops);
            c.finish(&ops, &mut out);
            let mut answers = 0;
            let mut rest = &out[..];
            while let Some((_, n)) = parse_frame(rest, &Limits::default()).unwrap() {
                answers += 1;
                rest = &rest[n..];
            }
            proptest::prop_assert!(rest.is_empty());
            proptest::prop_assert_eq!(answers, commands);
        }
    }

    #[test]
    fn a_protocol_error_is_answered_after_what_came_before_and_closes() {
        let mut store = MemoryStore::default();
        let front = FrontConfig::default();
        let mut c = Connection::new(1, Some(0usize));
        let mut out = Vec::new();
        let mut ops = Vec::new();
        let args: Vec<Bytes> = vec!["SET".into(), "k".into(), "v".into()];
        c.command(&front, 0, &args, &mut store, &mut ops, &mut out);
        c.protocol_error(&ProtocolError::BadInline, &mut out);
        assert!(out.is_empty(), "waits behind the SET");
        store.run(&mut ops);
        c.finish(&ops, &mut out);
        assert!(out.starts_with(b"+OK\r\n-ERR Protocol error"));
        assert!(c.closing());
    }
}
