//! The store behind the front: each tenant's MICA table on a naam-server, every op an active
//! message through a [`UdpClient`] session of that tenant (the server's steering places it at
//! the host, on the NIC or at this client, as it does any request). A tenant authenticates
//! with its NAAM credential: `AUTH <tenant> <64 hex digits>`; the server's handshake is the
//! check, so the front holds no secrets of its own. Sessions are kept per (tenant,
//! credential) and shared by that tenant's connections.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use naam_btree::{BTreeConfig, BTreeDone, BTreeError, BTreeHandle, BTreePipeline};
use naam_mica::{MicaConfig, MicaDone, MicaError, MicaHandle, MicaPipeline};
use naam_runtime::proto::control::{object_hash, AppManifest};
use naam_runtime::proto::session::{Credential, CREDENTIAL_LEN};
use naam_runtime::proto::transport::ClientError;
use naam_runtime::udp::{UdpClient, UdpConfig, UdpError};

use crate::store::{AuthError, KeyLimits, Op, OpKind, Outcome, Store};

/// Where the store's sessions go, and the tenant that needs no `AUTH`.
#[derive(Clone, Debug)]
pub struct NaamStoreConfig {
    /// The naam-servers: one, or a cluster's, each serving the slots `route` gives it.
    pub servers: Vec<SocketAddr>,
    /// Which server (an index of `servers`) serves each of the 16,384 slots; `None` with a
    /// single server.
    pub route: Option<Vec<u16>>,
    /// The tenant (and its credential) of connections that do not authenticate; `None`:
    /// every connection must `AUTH`.
    pub default_tenant: Option<(String, Credential)>,
    /// Each session's settings, from [`UdpConfig::new`] (the default sets [`MIN_RTO`]); a
    /// hook for tests and drivers.
    pub tune: fn(&mut UdpConfig),
    /// Reach the servers through this in-process network instead of UDP, requests handed to
    /// the server endpoint bound there as they are ([`UdpConfig::in_process`]): naam-server's
    /// own front, with `resp_path = "inline"`.
    pub network: Option<naam_runtime::udp::MemoryNet>,
}

/// The least retransmission timeout of the store's sessions. A round of the front puts up
/// to a window of requests in flight at once, and on a loaded host their answers come back
/// spread over milliseconds: with UdpClient's floor of 50 µs the estimate followed the fast
/// answers, the slow ones were sent again, the copies took the session past its credit, and
/// the server muted it for flooding (redis-benchmark -P 16 -c 50: 7.5% resends, stalls of
/// 1 s). Measured on this 2-vCPU VM (bench/RESULTS.md): a 2 ms floor still resent 0.1%,
/// 10 ms none. Loopback and a data-centre network lose almost nothing, so a lost datagram
/// waiting 10 ms costs little.
pub const MIN_RTO: Duration = Duration::from_millis(10);

fn default_tuning(c: &mut UdpConfig) {
    c.min_rto = MIN_RTO;
}

impl NaamStoreConfig {
    /// Sessions to the naam-server at `server`, every connection authenticating.
    pub fn new(server: SocketAddr) -> Self {
        NaamStoreConfig {
            servers: vec![server],
            route: None,
            default_tenant: None,
            tune: default_tuning,
            network: None,
        }
    }

    /// Sessions to every naam-server of a cluster (their UDP addresses, in the map's node
    /// order), each key's op sent to the server of its slot.
    pub fn cluster(servers: Vec<SocketAddr>, map: &crate::slots::ClusterMap) -> Self {
        let index: Vec<u16> = (0..crate::slots::SLOTS)
            .map(|slot| map.owner_index(slot) as u16)
            .collect();
        NaamStoreConfig {
            servers,
            route: Some(index),
            default_tenant: None,
            tune: default_tuning,
            network: None,
        }
    }
}

/// A tenant's table: a MICA hash table (every command but `SCAN`) or a B-tree (decimal keys
/// and values: `GET`, `SET`, `MGET`, `MSET`, `EXISTS`, `SCAN`).
enum Table {
    Mica(MicaPipeline<UdpClient>),
    BTree(BTreePipeline<UdpClient>),
}

/// What a table's op came to, whichever the table.
enum Done {
    Mica(Result<MicaDone, MicaError>),
    BTree(Result<BTreeDone, BTreeError>),
}

impl Table {
    fn in_flight(&self) -> usize {
        match self {
            Table::Mica(t) => t.in_flight(),
            Table::BTree(t) => t.in_flight(),
        }
    }

    fn window(&self) -> usize {
        match self {
            Table::Mica(t) => t.window(),
            Table::BTree(t) => t.window(),
        }
    }

    fn transport_counts(&self) -> naam_runtime::TransportCounts {
        match self {
            Table::Mica(t) => t.transport_ref().transport_counts(),
            Table::BTree(t) => t.transport_ref().transport_counts(),
        }
    }

    fn poll(&mut self, block: bool) -> Vec<(u64, Done)> {
        match self {
            Table::Mica(t) => t
                .poll(block)
                .into_iter()
                .map(|(k, r)| (k, Done::Mica(r)))
                .collect(),
            Table::BTree(t) => t
                .poll(block)
                .into_iter()
                .map(|(k, r)| (k, Done::BTree(r)))
                .collect(),
        }
    }

    /// Starts `op` under `tag`; when it cannot start, its outcome and whether the server is
    /// gone.
    fn start(&mut self, tag: u64, op: &Op<usize>) -> Result<(), (Outcome, bool)> {
        match self {
            Table::Mica(t) => match op.kind {
                OpKind::Get => t.get(tag, &op.key),
                OpKind::Put => t.put(tag, &op.key, &op.value),
                OpKind::Update => t.update(tag, &op.key, &op.value),
                OpKind::Delete => t.delete(tag, &op.key),
                OpKind::IncrBy(by) => t.incr_by(tag, &op.key, by),
                OpKind::Scan(_) => return Err((Outcome::Failed(SCAN_ON_MICA.into()), false)),
            }
            .map_err(|e| (failed(&e), is_gone(&e))),
            Table::BTree(t) => {
                let refused = |why: &str| (Outcome::Failed(why.into()), false);
                let key = decimal(&op.key).ok_or_else(|| refused(BTREE_KEYS))?;
                let value = || decimal(&op.value).ok_or_else(|| refused(BTREE_KEYS));
                match op.kind {
                    OpKind::Get => t.get(tag, key),
                    OpKind::Put => t.insert(tag, key, value()?),
                    OpKind::Update => t.update(tag, key, value()?),
                    OpKind::Scan(n) => t.scan(tag, key, n),
                    OpKind::Delete | OpKind::IncrBy(_) => return Err(refused(NOT_ON_BTREE)),
                }
                .map_err(|e| {
                    let gone = matches!(e, BTreeError::Client(ClientError::ServerGone { .. }));
                    (Outcome::Failed(format!("ERR naam: {e}")), gone)
                })
            }
        }
    }
}

/// What `done` says of the op (and whether the server is gone).
fn outcome_of(done: Done) -> (Outcome, bool) {
    match done {
        Done::Mica(Ok(d)) => (
            match d {
                MicaDone::Got(v) => Outcome::Got(v),
                MicaDone::Put(existed)
                | MicaDone::Updated(existed)
                | MicaDone::Deleted(existed) => Outcome::Wrote(existed),
                MicaDone::Counted(Some(n)) => Outcome::Counted(n),
                MicaDone::Counted(None) => Outcome::Failed(crate::store::NOT_AN_INTEGER.into()),
                other => Outcome::Failed(format!("ERR naam: unexpected answer {other:?}")),
            },
            false,
        ),
        Done::Mica(Err(e)) => (failed(&e), is_gone(&e)),
        Done::BTree(Ok(d)) => (
            match d {
                BTreeDone::Got(v) => Outcome::Got(v.map(bytes_of)),
                BTreeDone::Written(w) => Outcome::Wrote(w == Some(naam_btree::Written::Replaced)),
                BTreeDone::Scanned(pairs) => Outcome::Scanned(
                    pairs
                        .into_iter()
                        .map(|(k, v)| (bytes_of(k), bytes_of(v)))
                        .collect(),
                ),
                other => Outcome::Failed(format!("ERR naam: unexpected answer {other:?}")),
            },
            false,
        ),
        Done::BTree(Err(e)) => {
            let gone = matches!(e, BTreeError::Client(ClientError::ServerGone { .. }));
            (Outcome::Failed(format!("ERR naam: {e}")), gone)
        }
    }
}

/// A B-tree's key or value as RESP carries it: a decimal u64.
fn decimal(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b)
        .ok()
        .filter(|t| !t.starts_with('+'))
        .and_then(|t| t.parse().ok())
}

fn bytes_of(n: u64) -> Bytes {
    Bytes::from(n.to_string())
}

const SCAN_ON_MICA: &str = "ERR SCAN is not supported on a MICA table: a hash table has no key order (a B-tree tenant's table has)";
const BTREE_KEYS: &str = "ERR this tenant's table is a B-tree: its keys and values are decimal integers below 18446744073709551615";
const NOT_ON_BTREE: &str = "ERR DEL, INCR, INCRBY, DECR and DECRBY are not supported on a B-tree: its handlers look up, scan, insert and update";

fn is_gone(e: &MicaError) -> bool {
    matches!(e, MicaError::Client(ClientError::ServerGone { .. }))
}

/// One session: a tenant's table on one naam-server.
struct Session {
    table: Table,
    limits: KeyLimits,
    app: u32,
    server: SocketAddr,
    tenant: String,
    credential: Credential,
    /// The server stopped answering (or restarted and forgot the session): ops fail at once
    /// until a new session is made, tried at the first round after this moment.
    gone: Option<Instant>,
}

/// How long a session whose server went silent waits between attempts to make a new one.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// An authenticated tenant: its sessions, one per server.
struct Tenant {
    name: String,
    credential: [u8; CREDENTIAL_LEN],
    sessions: Vec<usize>,
    limits: KeyLimits,
    /// Its ops answered, and those that failed, since it authenticated (its `INFO`).
    ran: u64,
    failed: u64,
}

/// The NAAM store: one [`MicaPipeline`] per authenticated tenant and server.
pub struct NaamStore {
    config: NaamStoreConfig,
    sessions: Vec<Session>,
    tenants: Vec<Tenant>,
    default: Option<usize>,
}

impl std::fmt::Debug for NaamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NaamStore")
            .field("servers", &self.config.servers)
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

/// The app a tenant's session uses: the MICA table or B-tree named after the tenant, else its
/// first MICA table, else its first B-tree.
fn table_of<'m>(apps: &'m [AppManifest], tenant: &str) -> Option<&'m AppManifest> {
    let tables = || {
        apps.iter()
            .filter(|a| a.kind == "mica" || a.kind == "btree")
    };
    tables()
        .find(|a| a.name == tenant)
        .or_else(|| tables().find(|a| a.kind == "mica"))
        .or_else(|| tables().next())
}

impl NaamStore {
    /// A store whose sessions go to `config.servers`; the default tenant's sessions (if
    /// any) are opened now, so that a wrong default credential fails at start, not at the
    /// first command.
    pub fn new(config: NaamStoreConfig) -> Result<NaamStore, AuthError> {
        let mut s = NaamStore {
            config,
            sessions: Vec::new(),
            tenants: Vec::new(),
            default: None,
        };
        if let Some((tenant, credential)) = s.config.default_tenant.clone() {
            s.default = Some(s.open(&tenant, credential)?);
        }
        Ok(s)
    }

    /// Opens `tenant`'s sessions on every server.
    fn open(&mut self, tenant: &str, credential: Credential) -> Result<usize, AuthError> {
        let mut sessions = Vec::new();
        for server in self.config.servers.clone() {
            sessions.push(self.open_one(server, tenant, &credential)?);
        }
        let limits = KeyLimits {
            key_cap: sessions
                .iter()
                .map(|&i| self.sessions[i].limits.key_cap)
                .min()
                .unwrap_or(0),
            value_cap: sessions
                .iter()
                .map(|&i| self.sessions[i].limits.value_cap)
                .min()
                .unwrap_or(0),
        };
        self.tenants.push(Tenant {
            name: tenant.to_string(),
            credential: secret_bytes(&credential),
            sessions,
            limits,
            ran: 0,
            failed: 0,
        });
        Ok(self.tenants.len() - 1)
    }

    fn open_one(
        &mut self,
        server: SocketAddr,
        tenant: &str,
        credential: &Credential,
    ) -> Result<usize, AuthError> {
        let session = self.connect(server, tenant, credential)?;
        self.sessions.push(session);
        Ok(self.sessions.len() - 1)
    }

    /// A new session of `tenant` with the naam-server at `server`.
    fn connect(
        &self,
        server: SocketAddr,
        tenant: &str,
        credential: &Credential,
    ) -> Result<Session, AuthError> {
        let mut udp = UdpConfig::new(server, tenant, credential.clone());
        (self.config.tune)(&mut udp);
        if let Some(net) = &self.config.network {
            udp.network = Some(net.clone());
            udp.in_process = true;
            // In the server's own process the data is here: a read steered to the Client
            // placement would only be a one-sided read handed to the agent thread and back
            // (under redis-benchmark -P 16 -c 8 the steering sent reads there in some runs,
            // at half the throughput).
            udp.pin = Some(naam_runtime::proto::Placement::Host);
        }
        let mut client = UdpClient::connect(&udp).map_err(|e| match e {
            UdpError::Refused { message, .. } if message.contains("authentication failed") => {
                tracing::debug!("AUTH {tenant}: naam-server {server} refused: {message}");
                AuthError::WrongPass
            }
            other => {
                AuthError::Unavailable(format!("no session with naam-server {server}: {other}"))
            }
        })?;
        let served = table_of(&client.manifest().apps, tenant)
            .ok_or_else(|| {
                AuthError::Unavailable(format!(
                    "tenant {tenant} has no MICA table or B-tree on naam-server {server}"
                ))
            })?
            .clone();
        let params = |e: serde_json::Error| {
            AuthError::Unavailable(format!(
                "app {}: the server's {} parameters: {e}",
                served.id, served.kind
            ))
        };
        let no_regions = || {
            AuthError::Unavailable(format!(
                "app {}: regions missing from the manifest",
                served.id
            ))
        };
        let (carried, kind) = match served.kind.as_str() {
            "mica" => (naam_mica::HANDLERS_OBJECT, "MICA"),
            _ => (naam_btree::HANDLERS_OBJECT, "B-tree"),
        };
        // The Client placement runs the handlers here: this build's, if they are the server's.
        if object_hash(carried) != served.object_hash {
            return Err(AuthError::Unavailable(format!(
                "naam-server {server}'s {kind} handlers (object hash {:016x}) are not this build's: run a build of the same source",
                served.object_hash
            )));
        }
        client
            .install_handlers(served.id, carried)
            .map_err(|e| AuthError::Unavailable(e.to_string()))?;
        let (table, limits) = if served.kind == "mica" {
            let config: MicaConfig =
                serde_json::from_value(served.params.clone()).map_err(params)?;
            let handle = MicaHandle::with_keys(served.id, config, |n| served.region_key(n))
                .ok_or_else(no_regions)?;
            let limits = KeyLimits {
                key_cap: config.key_cap,
                value_cap: config.value_cap,
            };
            (Table::Mica(MicaPipeline::new(client, handle)), limits)
        } else {
            let config: BTreeConfig =
                serde_json::from_value(served.params.clone()).map_err(params)?;
            let handle = BTreeHandle::with_keys(served.id, config, |n| served.region_key(n))
                .ok_or_else(no_regions)?;
            // Decimal u64s: at most 20 digits.
            let limits = KeyLimits {
                key_cap: 20,
                value_cap: 20,
            };
            (Table::BTree(BTreePipeline::new(client, handle)), limits)
        };
        tracing::info!(
            "AUTH {tenant}: session with naam-server {server} ({kind} app {})",
            served.id
        );
        Ok(Session {
            table,
            limits,
            app: served.id,
            server,
            tenant: tenant.to_string(),
            credential: credential.clone(),
            gone: None,
        })
    }

    /// Makes new sessions for those whose server went silent, once their wait is over; a
    /// table of another geometry (the server restarted with another config) is taken as the
    /// server now serves it.
    fn reconnect_gone(&mut self) {
        let now = Instant::now();
        for i in 0..self.sessions.len() {
            let s = &self.sessions[i];
            let Some(at) = s.gone else { continue };
            if now < at {
                continue;
            }
            let (server, tenant, credential) = (s.server, s.tenant.clone(), s.credential.clone());
            match self.connect(server, &tenant, &credential) {
                Ok(new) => {
                    tracing::info!("{tenant}: a new session with naam-server {server}");
                    self.sessions[i] = new;
                }
                Err(e) => {
                    tracing::warn!("{tenant}: naam-server {server} still unreachable: {e}");
                    self.sessions[i].gone = Some(now + RECONNECT_EVERY);
                }
            }
        }
    }

    /// The session `tenant`'s op on `key` goes to.
    fn session_of(&self, tenant: usize, key: &[u8]) -> usize {
        let t = &self.tenants[tenant];
        match &self.config.route {
            None => t.sessions[0],
            Some(route) => t.sessions[usize::from(route[usize::from(crate::slots::key_slot(key))])],
        }
    }
}

fn failed(e: &MicaError) -> Outcome {
    Outcome::Failed(match e {
        MicaError::TooLarge { .. } => format!("ERR {e}"),
        other => format!("ERR naam: {other}"),
    })
}

impl Store for NaamStore {
    type Tenant = usize;

    fn default_tenant(&self) -> Option<usize> {
        self.default
    }

    fn authenticate(&mut self, user: Option<&[u8]>, password: &[u8]) -> Result<usize, AuthError> {
        let tenant = match user {
            Some(u) => std::str::from_utf8(u)
                .map_err(|_| AuthError::WrongPass)?
                .to_string(),
            None => match self.default.map(|d| self.tenants[d].name.clone()) {
                Some(t) => t,
                None => return Err(AuthError::WrongPass),
            },
        };
        let mut bytes = [0u8; CREDENTIAL_LEN];
        hex::decode_to_slice(password, &mut bytes).map_err(|_| AuthError::WrongPass)?;
        // The same secret again: the sessions it opened. Compared in full, so that a wrong
        // password for a known tenant opens nothing.
        if let Some(i) = self
            .tenants
            .iter()
            .position(|t| t.name == tenant && constant_eq(&t.credential, &bytes))
        {
            return Ok(i);
        }
        self.open(&tenant, Credential::from_bytes(bytes))
    }

    fn key_limits(&self, tenant: usize) -> KeyLimits {
        self.tenants[tenant].limits
    }

    fn run(&mut self, ops: &mut [Op<usize>]) {
        let n = ops.len();
        if n == 0 {
            return;
        }
        if self.sessions.iter().any(|s| s.gone.is_some()) {
            self.reconnect_gone();
        }
        // Ops chained behind another wait in its list until it finishes.
        let mut waiting: HashMap<u32, Vec<u32>> = HashMap::new();
        let mut ready: VecDeque<u32> = VecDeque::with_capacity(n);
        for (i, op) in ops.iter().enumerate() {
            match op.after {
                Some(a) => waiting.entry(a).or_default().push(i as u32),
                None => ready.push_back(i as u32),
            }
        }
        let mut left = n;
        let mut flying = vec![0usize; self.sessions.len()];
        let mut blocked: Vec<u32> = Vec::new();
        while left > 0 {
            // Everything ready goes out, within each session's window.
            while let Some(i) = ready.pop_front() {
                let session = self.session_of(ops[i as usize].tenant, &ops[i as usize].key);
                let op = &mut ops[i as usize];
                let s = &mut self.sessions[session];
                if s.gone.is_some() {
                    op.outcome = Outcome::Failed(format!(
                        "ERR naam: naam-server {} is not answering; a new session is tried every {}s",
                        s.server,
                        RECONNECT_EVERY.as_secs()
                    ));
                    self.tenants[op.tenant].failed += 1;
                    left -= 1;
                    if let Some(next) = waiting.remove(&i) {
                        ready.extend(next);
                    }
                    continue;
                }
                if s.table.in_flight() >= s.table.window() {
                    blocked.push(i);
                    continue;
                }
                let tag = u64::from(i);
                match s.table.start(tag, op) {
                    Ok(()) => flying[session] += 1,
                    Err((outcome, gone)) => {
                        if gone {
                            s.gone.get_or_insert_with(Instant::now);
                        }
                        op.outcome = outcome;
                        self.tenants[op.tenant].failed += 1;
                        left -= 1;
                        if let Some(next) = waiting.remove(&i) {
                            ready.extend(next);
                        }
                    }
                }
            }
            ready.extend(blocked.drain(..));
            if left == 0 {
                break;
            }
            let busy: Vec<usize> = (0..flying.len()).filter(|&t| flying[t] > 0).collect();
            let block = busy.len() == 1;
            for t in busy {
                for (tag, result) in self.sessions[t].table.poll(block) {
                    let i = tag as u32;
                    let Some(op) = ops.get_mut(i as usize) else {
                        continue;
                    };
                    flying[t] -= 1;
                    left -= 1;
                    let (outcome, gone) = outcome_of(result);
                    let tenant = &mut self.tenants[op.tenant];
                    tenant.ran += 1;
                    if let Outcome::Failed(_) = outcome {
                        tenant.failed += 1;
                    }
                    if gone {
                        self.sessions[t].gone.get_or_insert_with(Instant::now);
                    }
                    op.outcome = outcome;
                    if let Some(next) = waiting.remove(&i) {
                        ready.extend(next);
                    }
                }
            }
        }
    }

    fn info(&self, tenant: Option<usize>) -> String {
        // Only the asking tenant's own sessions and counts: another tenant's name, servers or
        // traffic are not this one's to see.
        let Some(t) = tenant.and_then(|t| self.tenants.get(t)) else {
            return format!(
                "store:naam\r\nnaam_servers:{}\r\n",
                self.config.servers.len()
            );
        };
        let mut s = format!(
            "store:naam\r\nnaam_servers:{}\r\ntenant:{}\r\nops_run:{}\r\nops_failed:{}\r\n",
            self.config.servers.len(),
            t.name,
            t.ran,
            t.failed
        );
        for (k, &sid) in t.sessions.iter().enumerate() {
            let sess = &self.sessions[sid];
            let counts = sess.table.transport_counts();
            s.push_str(&format!(
                "session{k}:server={},app={},window={},sent={},resends={},duplicates={}\r\n",
                sess.server,
                sess.app,
                sess.table.window(),
                counts.sent,
                counts.resends,
                counts.duplicates
            ));
        }
        s
    }
}

/// Compares two secrets in time independent of where they differ.
fn constant_eq(a: &[u8; CREDENTIAL_LEN], b: &[u8; CREDENTIAL_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A credential's 32 bytes (from its file text: the type keeps them to itself).
fn secret_bytes(c: &Credential) -> [u8; CREDENTIAL_LEN] {
    let mut b = [0u8; CREDENTIAL_LEN];
    // The text is the credential's own hex: it always decodes.
    let _ = hex::decode_to_slice(c.file_text().trim(), &mut b);
    b
}
