//! # naam-btree
//!
//! A Cell-style B+tree (a B-link tree of fixed-size nodes) as a NAAM application: layout
//! ([`layout`]), handlers compiled from Rust to eBPF (`apps/btree/handlers`), a client that caches
//! the root and detects a stale one ([`BTreeClient`], one call at a time; [`BTreePipeline`], many
//! operations in flight over a [`Pipeline`] transport), and a native reference implementation of
//! the same tree ([`reference::NativeBTree`]). Keys and values are `u64`; [`layout::NO_KEY`] is reserved.
//!
//! Lookups and scans descend one node per step at any placement (at the client each step is one
//! READ, as in Cell). Inserts and updates run at the write owner: they split full nodes on the
//! way down, one split per write batch (the client sends the write again), so every batch is
//! small and every reader sees either the old or the new node by its versions.
#![deny(missing_docs)]

#[cfg(feature = "host")]
use std::sync::Arc;

use naam_btree_layout as l;
use naam_ebpf::abi::{error_code::APP_BASE, Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::handler_id;
use naam_proto::intmap::IntMap;
use naam_proto::transport::{ClientError, Pipeline, Transport};
use naam_proto::wire::{Reply, ReplyView, Status};
#[cfg(feature = "host")]
use naam_proto::Placement;
#[cfg(feature = "host")]
use naam_runtime::cluster::{AppSpec, Cluster, RegionSpec};
#[cfg(feature = "host")]
use naam_runtime::vm::{LoadError, LoadedObject};
#[cfg(feature = "host")]
use naam_runtime::HandlerSpec;
#[cfg(feature = "host")]
use naam_runtime::ALL_RIGHTS;

pub use naam_btree_layout as layout;

pub mod reference;

/// Handler names.
pub mod handlers {
    /// Point lookup of one key: replies `[found: u8][value: u64]` (value 0 when not found).
    pub const GET: &str = "btree_get";
    /// Range scan from a start key, in key order: replies `[more: u8]` then `(key, value)` pairs;
    /// `more = 1` means the client continues after the last key returned.
    pub const SCAN: &str = "btree_scan";
    /// Insert/replace and update.
    pub const PUT: &str = "btree_put";
    /// Current root.
    pub const ROOT: &str = "btree_root";
}

/// Region names.
pub mod regions {
    /// The [`crate::layout::META_SIZE`]-byte meta region (all rights): root id, write version,
    /// next free node id, node size and node count.
    pub const META: &str = "btree-meta";
    /// `max_nodes` nodes of `node_size` bytes, node `id` at `id * node_size` (read and write);
    /// node 0 starts as the empty root leaf.
    pub const NODES: &str = "btree-nodes";
}

/// Errors of the B-tree library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BTreeError {
    /// `NO_KEY` is not a key.
    #[error("key {0:#x} is reserved")]
    ReservedKey(u64),
    /// The configuration is not usable.
    #[error("invalid B-tree configuration: {0}")]
    Config(String),
    /// The tree has no free node left.
    #[error("the tree is full ({0} nodes)")]
    Full(u64),
    /// The server answered with an error.
    #[error("{op}: server replied {status:?} (code {code}, {}): {message}", error_name(*.code))]
    Server {
        /// The client call that failed: `get`, `scan`, `insert`, `update` or `root`.
        op: &'static str,
        /// The reply's status; `Ok` when the reply itself was unusable (a short `root` reply, an
        /// unknown write outcome).
        status: Status,
        /// The reply's code: for `HandlerError` the handler's error code ([`error_name`] names it),
        /// else a detail code.
        code: u32,
        /// The reply's payload as text (lossy UTF-8): the server's or the handler's error message.
        message: String,
    },
    /// The fabric failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Loading the handlers failed.
    #[cfg(feature = "host")]
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Concurrent writers or splits won every attempt.
    #[error("{0}: gave up after {1} attempts")]
    Contended(&'static str, u32),
}

/// The name of an error code this app's handlers return (`mica:not-found`), else the SDK's
/// (`out-of-bounds`, `app(7)`).
pub fn error_name(code: u32) -> String {
    let app = code.wrapping_sub(naam_ebpf::abi::error_code::APP_BASE);
    match l::error::NAMED.iter().find(|(c, _)| *c == app) {
        Some((_, name)) if code >= naam_ebpf::abi::error_code::APP_BASE => (*name).to_string(),
        _ => naam_ebpf::abi::error_code::Describe(code).to_string(),
    }
}

/// Tree geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BTreeConfig {
    /// Node size in bytes (multiple of 8, 128 to 2048; default 1024).
    pub node_size: usize,
    /// Nodes the region holds.
    pub max_nodes: u64,
}

impl BTreeConfig {
    /// 1 KiB nodes, room for about `keys` keys (leaves half full after splits, plus inner nodes).
    pub fn for_keys(keys: u64) -> Self {
        Self::with_node_size(keys, 1024)
    }

    /// About how many keys the nodes hold (the inverse of [`BTreeConfig::with_node_size`]:
    /// leaves half full).
    pub fn keys(&self) -> u64 {
        let per_leaf = (l::capacity(self.node_size) / 2).max(1) as u64;
        self.max_nodes.saturating_sub(16) / 2 * per_leaf
    }

    /// Nodes of `node_size` bytes, room for about `keys` keys: at least `keys` as
    /// [`BTreeConfig::keys`] counts them.
    pub fn with_node_size(keys: u64, node_size: usize) -> Self {
        let per_leaf = (l::capacity(node_size) / 2).max(1) as u64;
        BTreeConfig {
            node_size,
            max_nodes: keys.div_ceil(per_leaf).saturating_mul(2).saturating_add(16),
        }
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), BTreeError> {
        if !(128..=2048).contains(&self.node_size) || !self.node_size.is_multiple_of(8) {
            return Err(BTreeError::Config(format!(
                "node size {} is not a multiple of 8 in 128..=2048",
                self.node_size
            )));
        }
        if self.max_nodes < 3
            || (self.max_nodes as u128) * self.node_size as u128 > u32::MAX as u128
        {
            return Err(BTreeError::Config(format!(
                "{} nodes is out of range",
                self.max_nodes
            )));
        }
        Ok(())
    }

    /// The meta region's initial contents.
    pub fn meta(&self) -> Vec<u8> {
        let mut m = vec![0u8; l::META_SIZE];
        let mut put = |at: usize, v: u64| m[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put(l::META_ROOT, 0);
        put(l::META_WVERSION, 0);
        put(l::META_NEXT_NODE, 1);
        put(l::META_NODE_SIZE, self.node_size as u64);
        put(l::META_MAX_NODES, self.max_nodes);
        m
    }

    /// The nodes region's initial contents: node 0 is an empty root leaf.
    pub fn nodes(&self) -> Vec<u8> {
        let mut n = vec![0u8; self.max_nodes as usize * self.node_size];
        write_empty_root(&mut n[..self.node_size]);
        n
    }
}

/// Formats `node` as an empty root leaf.
pub fn write_empty_root(node: &mut [u8]) {
    let size = node.len();
    let mut put = |at: usize, v: u64| node[at..at + 8].copy_from_slice(&v.to_le_bytes());
    put(l::NODE_FRONT, 2);
    put(l::NODE_HEADER, l::header(0, 0, l::FLAG_ROOT));
    put(l::NODE_HIGH, l::NO_KEY);
    put(l::NODE_SIBLING, l::NO_NODE);
    put(l::NODE_LEFT, 0);
    put(l::node_back(size), 2);
}

/// The B-tree's handler object (eBPF), built from `handlers/` with this crate (build.rs) and
/// carried by every binary that links it: running it needs no toolchain.
#[cfg(feature = "host")]
pub const HANDLERS_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/btree.o"));

/// Loads the embedded [`HANDLERS_OBJECT`]: its ELF, relocations and programs are checked here,
/// and each handler is verified when a cluster installs it ([`app_spec`]).
#[cfg(feature = "host")]
pub fn handlers() -> Result<LoadedObject, BTreeError> {
    Ok(naam_runtime::vm::load(HANDLERS_OBJECT)?)
}

/// Checks the regions of a tree that outlived its server (meta and nodes, as [`app_spec`]
/// lists them) against `config` before a server serves them again: the meta holds `config`'s
/// geometry and a root below its next free node; every node in use is whole (equal versions
/// at both ends: the write journal undoes a batch a crash cut, so none is torn) and holds no
/// more entries than fit; the root says it is one. Returns the nodes in use.
#[cfg(feature = "host")]
pub fn check_regions(
    config: &BTreeConfig,
    meta: &naam_runtime::RegionMemory,
    nodes: &naam_runtime::RegionMemory,
) -> Result<u64, String> {
    let word = |m: &naam_runtime::RegionMemory, at: usize, what: &str| {
        m.load_u64(at as u64)
            .map_err(|e| format!("{what} at {at}: {e}"))
    };
    for (at, want, what) in [
        (l::META_NODE_SIZE, config.node_size as u64, "node size"),
        (l::META_MAX_NODES, config.max_nodes, "node count"),
    ] {
        let have = word(meta, at, "meta")?;
        if have != want {
            return Err(format!("the meta's {what} is {have}, the config's {want}"));
        }
    }
    let root = word(meta, l::META_ROOT, "meta")?;
    let next = word(meta, l::META_NEXT_NODE, "meta")?;
    if next > config.max_nodes || root >= next {
        return Err(format!(
            "root {root} and next free node {next} do not fit {} nodes",
            config.max_nodes
        ));
    }
    let cap = l::capacity(config.node_size) as u64;
    for id in 0..next {
        let base = id as usize * config.node_size;
        let front = word(nodes, base + l::NODE_FRONT, "node")?;
        let back = word(nodes, base + l::node_back(config.node_size), "node")?;
        if front != back {
            return Err(format!("node {id} is torn (versions {front} and {back})"));
        }
        let header = word(nodes, base + l::NODE_HEADER, "node")?;
        if l::count(header) > cap {
            return Err(format!(
                "node {id} holds {} entries, more than its {cap}",
                l::count(header)
            ));
        }
        if id == root && l::flags(header) & l::FLAG_ROOT == 0 {
            return Err(format!("the root, node {id}, is not marked as one"));
        }
    }
    Ok(next)
}

/// The app a cluster installs for a tree.
#[cfg(feature = "host")]
pub fn app_spec(
    app: u32,
    config: &BTreeConfig,
    object: Arc<LoadedObject>,
    owner: Placement,
) -> Result<AppSpec, BTreeError> {
    config.validate()?;
    Ok(AppSpec {
        id: app,
        name: "btree".into(),
        owner,
        regions: vec![
            RegionSpec {
                name: regions::META.into(),
                access: ALL_RIGHTS,
                contents: config.meta(),
            },
            RegionSpec {
                name: regions::NODES.into(),
                access: ACCESS_READ | ACCESS_WRITE,
                contents: config.nodes(),
            },
        ],
        object,
        handlers: vec![
            HandlerSpec::read(handlers::GET),
            HandlerSpec::read(handlers::SCAN),
            HandlerSpec::read(handlers::ROOT),
            HandlerSpec::write(handlers::PUT),
        ],
    })
}

/// What a client needs to address one tree.
#[derive(Clone, Copy, Debug)]
pub struct BTreeHandle {
    /// App id.
    pub app: u32,
    /// The tree's geometry, which must equal the server's: the client addresses nodes by
    /// `node_size` (over UDP it comes from the manifest's `params`).
    pub config: BTreeConfig,
    /// rkey of the meta region.
    pub rkey_meta: u64,
    /// rkey of the nodes region.
    pub rkey_nodes: u64,
}

impl BTreeHandle {
    /// The handle of tree `app`, looking each region's rkey up by name.
    pub fn with_keys(
        app: u32,
        config: BTreeConfig,
        key: impl Fn(&str) -> Option<u64>,
    ) -> Option<Self> {
        Some(BTreeHandle {
            app,
            config,
            rkey_meta: key(regions::META)?,
            rkey_nodes: key(regions::NODES)?,
        })
    }

    /// The handle of tree `app` in an in-process cluster.
    #[cfg(feature = "host")]
    pub fn from_cluster(cluster: &Cluster, app: u32, config: BTreeConfig) -> Option<Self> {
        Self::with_keys(app, config, |n| cluster.region_key(app, n))
    }
}

/// Most attempts an operation makes (splits, conflicts, stale roots, full queues).
pub const MAX_ATTEMPTS: u32 = 10_000;

/// What a write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    /// A new key.
    Inserted,
    /// An existing key's value changed.
    Replaced,
}

/// A B-tree client over any [`Transport`]; caches the root.
pub struct BTreeClient<T: Transport> {
    transport: T,
    handle: BTreeHandle,
    root: u64,
    ids: [u32; 4],
    /// Root refreshes made (stale roots detected).
    pub root_refreshes: u64,
}

fn code_is(code: u32, e: u32) -> bool {
    code == APP_BASE + e
}

impl<T: Transport> BTreeClient<T> {
    /// A client of `handle` over `transport`, starting from root node 0 (refreshed on demand).
    pub fn new(transport: T, handle: BTreeHandle) -> Self {
        BTreeClient {
            transport,
            handle,
            root: 0,
            ids: [handlers::GET, handlers::SCAN, handlers::PUT, handlers::ROOT].map(handler_id),
            root_refreshes: 0,
        }
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut T {
        &mut self.transport
    }

    fn root_desc(&self) -> Descriptor {
        let s = self.handle.config.node_size as u64;
        Descriptor {
            rkey: self.handle.rkey_nodes,
            offset: self.root * s,
            len: s as u32,
            access: ACCESS_READ,
        }
    }

    fn reader_args(&self, key: u64, extra: u64) -> [u8; 32] {
        let mut a = [0u8; 32];
        a[0..8].copy_from_slice(&self.handle.rkey_nodes.to_le_bytes());
        a[8..16].copy_from_slice(&(self.handle.config.node_size as u64).to_le_bytes());
        a[16..24].copy_from_slice(&key.to_le_bytes());
        a[24..32].copy_from_slice(&extra.to_le_bytes());
        a
    }

    /// Reads the current root id from meta.
    pub fn refresh_root(&mut self) -> Result<u64, BTreeError> {
        let d = Descriptor {
            rkey: self.handle.rkey_meta,
            offset: 0,
            len: l::META_SIZE as u32,
            access: ACCESS_READ,
        };
        let r = self
            .transport
            .call(self.handle.app, self.ids[3], &[], &[d])?;
        if r.status != Status::Ok || r.payload.len() < 8 {
            return Err(server_error("root", r.view()));
        }
        self.root = u64::from_le_bytes(r.payload[..8].try_into().expect("8 bytes"));
        self.root_refreshes += 1;
        Ok(self.root)
    }

    /// Sends a read, refreshing the root when the cached one is stale, and returns `read` of
    /// the payload of its `Ok` answer, read where the transport holds it
    /// ([`Transport::call_with`]).
    fn read_with<R>(
        &mut self,
        op: &'static str,
        id: u32,
        args: &[u8],
        mut read: impl FnMut(&[u8]) -> R,
    ) -> Result<R, BTreeError> {
        for attempt in 1..=MAX_ATTEMPTS {
            let root = self.root_desc();
            let answered = self
                .transport
                .call_with(self.handle.app, id, args, &[root], |r| {
                    read_attempt(op, r, &mut read)
                });
            match answered {
                Ok(ReadAttempt::Done(r)) => return Ok(r),
                Ok(ReadAttempt::StaleRoot) => {
                    self.refresh_root()?;
                }
                Ok(ReadAttempt::Again) | Err(ClientError::Busy(_)) => {
                    self.transport.backoff(attempt)
                }
                Ok(ReadAttempt::Failed(e)) => return Err(e),
                Err(e) => return Err(e.into()),
            }
        }
        Err(BTreeError::Contended(op, MAX_ATTEMPTS))
    }

    fn check_key(key: u64) -> Result<(), BTreeError> {
        if key == l::NO_KEY {
            Err(BTreeError::ReservedKey(key))
        } else {
            Ok(())
        }
    }

    /// The value of `key`.
    pub fn get(&mut self, key: u64) -> Result<Option<u64>, BTreeError> {
        Self::check_key(key)?;
        let args = self.reader_args(key, 0);
        self.read_with("get", self.ids[0], &args, looked_up)?
    }

    /// Up to `max` `(key, value)` pairs with keys at or above `start`, in key order. A scan
    /// longer than one message may visit continues from the last key returned.
    pub fn scan(&mut self, start: u64, max: usize) -> Result<Vec<(u64, u64)>, BTreeError> {
        Self::check_key(start)?;
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(max);
        let mut from = start;
        while out.len() < max {
            let args = self.reader_args(from, (max - out.len()) as u64);
            let before = out.len();
            let more = self.read_with("scan", self.ids[1], &args, |payload| {
                out.truncate(before);
                scanned(payload, &mut out)
            })??;
            match scan_continues(&out, before, more) {
                Some(next) => from = next,
                None => break,
            }
        }
        Ok(out)
    }

    /// The args of a write of `key` = `value` (of an update: only if `key` is there).
    fn write_args(&self, key: u64, value: u64, update_only: bool) -> [u8; l::args::WRITE_SIZE] {
        let h = self.handle;
        let mut args = [0u8; l::args::WRITE_SIZE];
        args[0..8].copy_from_slice(&h.rkey_nodes.to_le_bytes());
        args[8..16].copy_from_slice(&(h.config.node_size as u64).to_le_bytes());
        args[16..24].copy_from_slice(&key.to_le_bytes());
        args[24..32].copy_from_slice(&value.to_le_bytes());
        args[32..40].copy_from_slice(&h.rkey_meta.to_le_bytes());
        args[40..48].copy_from_slice(&(update_only as u64).to_le_bytes());
        args
    }

    /// What a write names: the meta region, which it may change atomically.
    fn meta_desc(&self) -> Descriptor {
        Descriptor {
            rkey: self.handle.rkey_meta,
            offset: 0,
            len: l::META_SIZE as u32,
            access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
        }
    }

    fn write(
        &mut self,
        op: &'static str,
        key: u64,
        value: u64,
        update_only: bool,
    ) -> Result<Option<Written>, BTreeError> {
        Self::check_key(key)?;
        let h = self.handle;
        let args = self.write_args(key, value, update_only);
        let meta = self.meta_desc();
        for attempt in 1..=MAX_ATTEMPTS {
            let answered = self
                .transport
                .call_with(h.app, self.ids[2], &args, &[meta], |r| {
                    write_attempt(op, h.config.max_nodes, r)
                });
            match answered {
                Ok(WriteAttempt::Done(w)) => return Ok(w),
                Ok(WriteAttempt::Split) => continue,
                Ok(WriteAttempt::Again) | Err(ClientError::Busy(_)) => {
                    self.transport.backoff(attempt)
                }
                Ok(WriteAttempt::Failed(e)) => return Err(e),
                Err(e) => return Err(e.into()),
            }
        }
        Err(BTreeError::Contended(op, MAX_ATTEMPTS))
    }

    /// Inserts or replaces.
    pub fn insert(&mut self, key: u64, value: u64) -> Result<Written, BTreeError> {
        Ok(self
            .write("insert", key, value, false)?
            .expect("upserts always write"))
    }

    /// Replaces the value of an existing key; false (and no change) if absent.
    pub fn update(&mut self, key: u64, value: u64) -> Result<bool, BTreeError> {
        Ok(self.write("update", key, value, true)?.is_some())
    }
}

/// What a pipelined B-tree operation came to.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BTreeDone {
    /// A get: the value, or `None` when the tree does not hold the key.
    Got(Option<u64>),
    /// An insert (`Some`: what it did) or an update (`None`: the key was absent, nothing
    /// changed).
    Written(Option<Written>),
    /// A scan: the pairs, in key order.
    Scanned(Vec<(u64, u64)>),
}

/// One pipelined operation and where it stands.
#[derive(Debug)]
enum PipedOp {
    Get {
        key: u64,
    },
    Write {
        op: &'static str,
        key: u64,
        value: u64,
        update_only: bool,
    },
    /// A scan of up to `max` pairs, `got` so far; its next message asks from `from`.
    Scan {
        max: usize,
        from: u64,
        got: Vec<(u64, u64)>,
    },
}

impl PipedOp {
    fn name(&self) -> &'static str {
        match self {
            PipedOp::Get { .. } => "get",
            PipedOp::Write { op, .. } => op,
            PipedOp::Scan { .. } => "scan",
        }
    }
}

/// An operation and the attempts it has made.
#[derive(Debug)]
struct Piped {
    tag: u64,
    op: PipedOp,
    attempt: u32,
}

/// B-tree operations in flight together over a [`Pipeline`]: a client thread keeps many
/// requests outstanding (YCSB's `--pipeline`, a multi-get) instead of one, with the answers of
/// [`BTreeClient`]'s calls. Each operation carries the caller's tag and is sent again on its
/// own: after a split, a conflict or a full queue at once, and, when the cached root went
/// stale, once the root has been read again (one root read for every reader that met it). A
/// scan longer than one message goes on from its last key, in flight like the rest.
pub struct BTreePipeline<T: Pipeline> {
    client: BTreeClient<T>,
    /// By transport token.
    flying: IntMap<u64, Piped>,
    /// Operations the transport had no room for: sent first at the next poll.
    waiting: std::collections::VecDeque<Piped>,
    /// Readers that met a stale root, waiting for the root read in flight.
    stale: Vec<Piped>,
    /// The token of the root read in flight.
    root_read: Option<u64>,
    /// A root read is owed: the window had no room for it when a reader met a stale root.
    root_wanted: bool,
}

impl<T: Pipeline> BTreePipeline<T> {
    /// A pipeline of the tree `handle` over `transport`, starting from root node 0.
    pub fn new(transport: T, handle: BTreeHandle) -> Self {
        BTreePipeline {
            client: BTreeClient::new(transport, handle),
            flying: Default::default(),
            waiting: Default::default(),
            stale: Vec::new(),
            root_read: None,
            root_wanted: false,
        }
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut T {
        &mut self.client.transport
    }

    /// The transport, to read.
    pub fn transport_ref(&self) -> &T {
        &self.client.transport
    }

    /// Root refreshes made (stale roots detected).
    pub fn root_refreshes(&self) -> u64 {
        self.client.root_refreshes
    }

    /// Operations started and not yet handed back.
    pub fn in_flight(&self) -> usize {
        self.flying.len() + self.waiting.len() + self.stale.len()
    }

    /// The most operations the transport keeps outstanding (a root read takes one of them
    /// while it is in flight; what does not fit waits for the next poll).
    pub fn window(&self) -> usize {
        self.client.transport.window()
    }

    /// Starts a lookup of `key`; its answer will carry `tag`.
    pub fn get(&mut self, tag: u64, key: u64) -> Result<(), BTreeError> {
        BTreeClient::<T>::check_key(key)?;
        self.start(tag, PipedOp::Get { key })
    }

    /// Starts an insert (or replacement) of `key` = `value`.
    pub fn insert(&mut self, tag: u64, key: u64, value: u64) -> Result<(), BTreeError> {
        self.start_write(tag, "insert", key, value, false)
    }

    /// Starts an update of `key` to `value`, which changes nothing when `key` is absent.
    pub fn update(&mut self, tag: u64, key: u64, value: u64) -> Result<(), BTreeError> {
        self.start_write(tag, "update", key, value, true)
    }

    /// Starts a scan of up to `max` pairs with keys at or above `start`.
    pub fn scan(&mut self, tag: u64, start: u64, max: usize) -> Result<(), BTreeError> {
        BTreeClient::<T>::check_key(start)?;
        if max == 0 {
            return Err(BTreeError::Config("a scan of no pairs".into()));
        }
        let op = PipedOp::Scan {
            max,
            from: start,
            got: Vec::with_capacity(max.min(1024)),
        };
        self.start(tag, op)
    }

    fn start_write(
        &mut self,
        tag: u64,
        op: &'static str,
        key: u64,
        value: u64,
        update_only: bool,
    ) -> Result<(), BTreeError> {
        BTreeClient::<T>::check_key(key)?;
        let op = PipedOp::Write {
            op,
            key,
            value,
            update_only,
        };
        self.start(tag, op)
    }

    fn start(&mut self, tag: u64, op: PipedOp) -> Result<(), BTreeError> {
        self.submit(Piped {
            tag,
            op,
            attempt: 1,
        })
        .map_err(|(_, e)| e)
    }

    /// Sends `p`'s next message; with no room in the transport's window it waits for the next
    /// poll. A failure hands `p`'s tag back with the error.
    fn submit(&mut self, p: Piped) -> Result<(), (u64, BTreeError)> {
        let c = &mut self.client;
        let (app, ids) = (c.handle.app, c.ids);
        // Each kind's args on the stack: nothing allocated per message.
        let submitted = match &p.op {
            PipedOp::Get { key } => {
                let (args, root) = (c.reader_args(*key, 0), c.root_desc());
                c.transport.submit(app, ids[0], &args, &[root])
            }
            PipedOp::Scan { max, from, got } => {
                let left = (max - got.len()) as u64;
                let (args, root) = (c.reader_args(*from, left), c.root_desc());
                c.transport.submit(app, ids[1], &args, &[root])
            }
            PipedOp::Write {
                key,
                value,
                update_only,
                ..
            } => {
                let (args, meta) = (c.write_args(*key, *value, *update_only), c.meta_desc());
                c.transport.submit(app, ids[2], &args, &[meta])
            }
        };
        match submitted {
            Ok(token) => {
                self.flying.insert(token, p);
                Ok(())
            }
            Err(ClientError::Busy(_)) => {
                self.waiting.push_back(p);
                Ok(())
            }
            Err(e) => Err((p.tag, e.into())),
        }
    }

    /// Sends `p` again, unless it has made all its attempts.
    fn again(&mut self, mut p: Piped, out: &mut Vec<(u64, Result<BTreeDone, BTreeError>)>) {
        if p.attempt >= MAX_ATTEMPTS {
            out.push((p.tag, Err(BTreeError::Contended(p.op.name(), MAX_ATTEMPTS))));
            return;
        }
        p.attempt += 1;
        if let Err((tag, e)) = self.submit(p) {
            out.push((tag, Err(e)));
        }
    }

    /// Reads the root again, unless a root read is in flight already; with no room in the
    /// window, at the next poll.
    fn read_root(&mut self) -> Result<(), ClientError> {
        if self.root_read.is_some() {
            return Ok(());
        }
        let d = Descriptor {
            rkey: self.client.handle.rkey_meta,
            offset: 0,
            len: l::META_SIZE as u32,
            access: ACCESS_READ,
        };
        let c = &mut self.client;
        match c.transport.submit(c.handle.app, c.ids[3], &[], &[d]) {
            Ok(token) => {
                self.root_read = Some(token);
                self.root_wanted = false;
                Ok(())
            }
            Err(ClientError::Busy(_)) => {
                self.root_wanted = true;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// The root read's answer: the readers that waited for it go again (from the new root), or
    /// fail with it.
    fn root_answered(
        &mut self,
        answer: Result<Reply, ClientError>,
        out: &mut Vec<(u64, Result<BTreeDone, BTreeError>)>,
    ) {
        self.root_read = None;
        let answer = match answer {
            // The window was full: read it again.
            Err(ClientError::Busy(_)) => match self.read_root() {
                Ok(()) => return,
                Err(e) => Err(e),
            },
            other => other,
        };
        let stale = std::mem::take(&mut self.stale);
        match answer {
            Ok(r) if r.status == Status::Ok && r.payload.len() >= 8 => {
                self.client.root = u64::from_le_bytes(r.payload[..8].try_into().expect("8 bytes"));
                self.client.root_refreshes += 1;
                for p in stale {
                    self.again(p, out);
                }
            }
            // Every reader that waited fails as `refresh_root` would have failed it.
            Ok(r) => out.extend(
                stale
                    .into_iter()
                    .map(|p| (p.tag, Err(server_error("root", r.view())))),
            ),
            Err(e) => out.extend(stale.into_iter().map(|p| (p.tag, Err(e.clone().into())))),
        }
    }

    /// What answer `answer` to `p` does: finishes it, sends its next message, or parks it for
    /// the root read.
    fn answered(
        &mut self,
        mut p: Piped,
        answer: Result<Reply, ClientError>,
        out: &mut Vec<(u64, Result<BTreeDone, BTreeError>)>,
    ) {
        let r = match answer {
            Ok(r) => r,
            // The transport's window was full when it went: send it again.
            Err(ClientError::Busy(_)) => return self.again(p, out),
            Err(e) => return out.push((p.tag, Err(e.into()))),
        };
        let op = p.op.name();
        let read = match &mut p.op {
            PipedOp::Write { .. } => {
                match write_attempt(op, self.client.handle.config.max_nodes, r.view()) {
                    WriteAttempt::Done(w) => out.push((p.tag, Ok(BTreeDone::Written(w)))),
                    WriteAttempt::Split | WriteAttempt::Again => self.again(p, out),
                    WriteAttempt::Failed(e) => out.push((p.tag, Err(e))),
                }
                return;
            }
            PipedOp::Get { .. } => read_attempt(op, r.view(), |payload| {
                looked_up(payload).map(|v| Some(BTreeDone::Got(v)))
            }),
            PipedOp::Scan { max, from, got } => read_attempt(op, r.view(), |payload| {
                let before = got.len();
                let more = scanned(payload, got)?;
                got.truncate(*max);
                Ok(match scan_continues(got, before, more) {
                    Some(next) if got.len() < *max => {
                        *from = next;
                        None
                    }
                    _ => Some(BTreeDone::Scanned(std::mem::take(got))),
                })
            }),
        };
        match read {
            ReadAttempt::Done(Ok(Some(done))) => out.push((p.tag, Ok(done))),
            // A scan's next message.
            ReadAttempt::Done(Ok(None)) => {
                p.attempt = 0;
                self.again(p, out)
            }
            ReadAttempt::Done(Err(e)) | ReadAttempt::Failed(e) => out.push((p.tag, Err(e))),
            ReadAttempt::Again => self.again(p, out),
            ReadAttempt::StaleRoot => match self.read_root() {
                Ok(()) => self.stale.push(p),
                Err(e) => out.push((p.tag, Err(e.into()))),
            },
        }
    }

    /// The operations that finished since the last poll, by tag; with `block`, waits a while
    /// for one when any is in flight.
    pub fn poll(&mut self, block: bool) -> Vec<(u64, Result<BTreeDone, BTreeError>)> {
        let mut out = Vec::new();
        loop {
            // What had no room goes first, as far as the window now allows.
            for _ in 0..self.waiting.len() {
                let Some(p) = self.waiting.pop_front() else {
                    break;
                };
                if let Err((tag, e)) = self.submit(p) {
                    out.push((tag, Err(e)));
                }
            }
            if self.root_wanted {
                if let Err(e) = self.read_root() {
                    let stale = std::mem::take(&mut self.stale);
                    out.extend(stale.into_iter().map(|p| (p.tag, Err(e.clone().into()))));
                    self.root_wanted = false;
                }
            }
            let outstanding = !self.flying.is_empty() || self.root_read.is_some();
            for (token, answer) in self.client.transport.poll(block && outstanding) {
                if self.root_read == Some(token) {
                    self.root_answered(answer, &mut out);
                } else if let Some(p) = self.flying.remove(&token) {
                    self.answered(p, answer, &mut out);
                }
            }
            let outstanding = !self.flying.is_empty() || self.root_read.is_some();
            if !out.is_empty() || !block || !outstanding {
                return out;
            }
        }
    }

    /// The values of `keys` (a multi-get): every lookup in flight together, within the
    /// transport's window. Nothing else may be in flight on this pipeline meanwhile.
    pub fn multi_get(&mut self, keys: &[u64]) -> Result<Vec<Option<u64>>, BTreeError> {
        let mut values = vec![None; keys.len()];
        naam_proto::transport::in_flight_together(
            self,
            keys.len(),
            |p| p.in_flight() < p.window(),
            |p, i| p.get(i, keys[i as usize]),
            |p| p.poll(true),
            |i, done| {
                if let BTreeDone::Got(v) = done {
                    values[i as usize] = v;
                }
            },
        )?;
        Ok(values)
    }
}

fn server_error(op: &'static str, r: ReplyView<'_>) -> BTreeError {
    BTreeError::Server {
        op,
        status: r.status,
        code: r.code,
        message: String::from_utf8_lossy(r.payload).into_owned(),
    }
}

/// What answer `r` to read `op` comes to; `read` is handed the payload of an `Ok`.
fn read_attempt<R>(
    op: &'static str,
    r: ReplyView<'_>,
    read: impl FnOnce(&[u8]) -> R,
) -> ReadAttempt<R> {
    match r.status {
        Status::Ok => ReadAttempt::Done(read(r.payload)),
        Status::HandlerError if code_is(r.code, l::error::STALE_ROOT) => ReadAttempt::StaleRoot,
        Status::Busy => ReadAttempt::Again,
        _ => ReadAttempt::Failed(server_error(op, r)),
    }
}

/// What answer `r` to write `op` comes to, in a tree of `max_nodes` nodes.
fn write_attempt(op: &'static str, max_nodes: u64, r: ReplyView<'_>) -> WriteAttempt {
    match (r.status, r.payload.first().copied()) {
        (Status::Ok, Some(l::reply::SPLIT)) => WriteAttempt::Split,
        (Status::Ok, Some(l::reply::INSERTED)) => WriteAttempt::Done(Some(Written::Inserted)),
        (Status::Ok, Some(l::reply::REPLACED)) => WriteAttempt::Done(Some(Written::Replaced)),
        (Status::HandlerError, _) if code_is(r.code, l::error::NOT_FOUND) => {
            WriteAttempt::Done(None)
        }
        (Status::HandlerError, _) if code_is(r.code, l::error::FULL) => {
            WriteAttempt::Failed(BTreeError::Full(max_nodes))
        }
        (Status::HandlerError, _) if code_is(r.code, l::error::RESTART) => WriteAttempt::Again,
        (Status::Conflict | Status::Busy, _) => WriteAttempt::Again,
        _ => WriteAttempt::Failed(server_error(op, r)),
    }
}

/// A lookup's payload, `[found: u8][value: u64]`: the value, if found.
fn looked_up(payload: &[u8]) -> Result<Option<u64>, BTreeError> {
    match (payload.first(), payload.get(1..9)) {
        (Some(&found), Some(value)) => {
            Ok((found == 1)
                .then(|| u64::from_le_bytes(value.try_into().expect("a slice of 8 bytes"))))
        }
        _ => Err(BTreeError::Config("short lookup reply".into())),
    }
}

/// A scan message's payload, `[more: u8]` then `(key, value)` pairs: appends the pairs to
/// `out` and returns `more`.
fn scanned(payload: &[u8], out: &mut Vec<(u64, u64)>) -> Result<u8, BTreeError> {
    let Some((&more, pairs)) = payload.split_first() else {
        return Err(BTreeError::Config("empty scan reply".into()));
    };
    out.extend(pairs.chunks_exact(16).map(|c| {
        (
            u64::from_le_bytes(c[..8].try_into().expect("8")),
            u64::from_le_bytes(c[8..].try_into().expect("8")),
        )
    }));
    Ok(more)
}

/// Where a scan goes on after a message that took `out` from `before` pairs, given its `more`:
/// after the last key, but only if the message made progress (a message that returned nothing
/// would be asked the same question again); `None` when it is done.
fn scan_continues(out: &[(u64, u64)], before: usize, more: u8) -> Option<u64> {
    match out.last() {
        Some(&(last, _)) if more == 1 && out.len() > before && last < l::NO_KEY - 1 => {
            Some(last + 1)
        }
        _ => None,
    }
}

/// What one answer to a read comes to.
enum ReadAttempt<R> {
    /// `Ok`: what the caller read from it.
    Done(R),
    /// The cached root is no longer the root: refresh it and send again.
    StaleRoot,
    /// A queue was full: send again after a backoff.
    Again,
    /// The server refused the read.
    Failed(BTreeError),
}

/// What one answer to a write comes to.
enum WriteAttempt {
    /// Written (or, for an update, the key was absent).
    Done(Option<Written>),
    /// The handler split a full node on the way: send again, nothing else changed.
    Split,
    /// Another writer got there first, a latch was held or a queue was full: back off and
    /// send again.
    Again,
    /// The tree is full or the server refused the write.
    Failed(BTreeError),
}

#[cfg(test)]
mod tests {
    //! The pipelined client over a scripted [`Pipeline`]: answers a server could send, however
    //! odd, end every operation.
    use super::*;
    use naam_proto::wire::LoadFeedback;
    use naam_proto::Placement;
    use std::collections::VecDeque;

    /// Answers each submission with the next scripted `(status, code, payload)`, at once.
    struct Scripted {
        script: VecDeque<(Status, u32, Vec<u8>)>,
        answers: Vec<(u64, Result<Reply, ClientError>)>,
        handlers: Vec<u32>,
        next: u64,
    }

    impl Transport for Scripted {
        fn call(
            &mut self,
            _: u32,
            _: u32,
            _: &[u8],
            _: &[Descriptor],
        ) -> Result<Reply, ClientError> {
            unreachable!("the pipeline only submits")
        }

        fn backoff(&mut self, _: u32) {}
    }

    impl Pipeline for Scripted {
        fn submit(
            &mut self,
            app: u32,
            handler: u32,
            _: &[u8],
            _: &[Descriptor],
        ) -> Result<u64, ClientError> {
            let (status, code, payload) = self.script.pop_front().expect("scripted");
            self.next += 1;
            self.handlers.push(handler);
            let reply = Reply {
                app,
                request_id: self.next,
                status,
                code,
                steps: 1,
                placement: Placement::Host,
                load: LoadFeedback::default(),
                payload: payload.into(),
            };
            self.answers.push((self.next, Ok(reply)));
            Ok(self.next)
        }

        fn poll(&mut self, _: bool) -> Vec<(u64, Result<Reply, ClientError>)> {
            std::mem::take(&mut self.answers)
        }

        fn in_flight(&self) -> usize {
            self.answers.len()
        }

        fn window(&self) -> usize {
            8
        }
    }

    fn pipeline(script: Vec<(Status, u32, Vec<u8>)>) -> BTreePipeline<Scripted> {
        let handle = BTreeHandle {
            app: 1,
            config: BTreeConfig::for_keys(1000),
            rkey_meta: 5,
            rkey_nodes: 6,
        };
        let t = Scripted {
            script: script.into(),
            answers: Vec::new(),
            handlers: Vec::new(),
            next: 0,
        };
        BTreePipeline::new(t, handle)
    }

    fn pairs(more: u8, keys: &[u64]) -> Vec<u8> {
        let mut p = vec![more];
        for k in keys {
            p.extend_from_slice(&k.to_le_bytes());
            p.extend_from_slice(&(k * 2).to_le_bytes());
        }
        p
    }

    fn finish(p: &mut BTreePipeline<Scripted>) -> Vec<(u64, Result<BTreeDone, BTreeError>)> {
        let mut out = Vec::new();
        while p.in_flight() > 0 {
            out.extend(p.poll(true));
        }
        out
    }

    #[test]
    fn a_scan_goes_on_while_it_makes_progress_and_stops_when_it_does_not() {
        // Two messages with pairs, then one that says "more" but brings nothing new.
        let mut p = pipeline(vec![
            (Status::Ok, 0, pairs(1, &[3, 4])),
            (Status::Ok, 0, pairs(1, &[5])),
            (Status::Ok, 0, pairs(1, &[])),
        ]);
        p.scan(1, 3, 10).unwrap();
        let out = finish(&mut p);
        assert!(
            matches!(&out[..], [(1, Ok(BTreeDone::Scanned(v)))] if v == &[(3, 6), (4, 8), (5, 10)]),
            "{out:?}"
        );
        assert_eq!(p.transport().handlers.len(), 3);
    }

    #[test]
    fn a_scan_answered_with_more_pairs_than_asked_keeps_what_it_asked_for() {
        let mut p = pipeline(vec![(Status::Ok, 0, pairs(1, &[1, 2, 3, 4, 5]))]);
        p.scan(9, 1, 2).unwrap();
        let out = finish(&mut p);
        assert!(
            matches!(&out[..], [(9, Ok(BTreeDone::Scanned(v)))] if v == &[(1, 2), (2, 4)]),
            "{out:?}"
        );
    }

    #[test]
    fn short_answers_and_a_short_root_fail_the_operations_they_answer() {
        let stale = (
            Status::HandlerError,
            APP_BASE + l::error::STALE_ROOT,
            vec![],
        );
        let mut p = pipeline(vec![
            // A lookup answered with one byte.
            (Status::Ok, 0, vec![1]),
            // Two readers meet a stale root; the root read answers three bytes.
            stale.clone(),
            stale,
            (Status::Ok, 0, vec![0, 0, 0]),
            // A write answered with an unknown outcome.
            (Status::Ok, 0, vec![99]),
            // An empty scan answer.
            (Status::Ok, 0, vec![]),
        ]);
        p.get(1, 10).unwrap();
        p.get(2, 11).unwrap();
        p.get(3, 12).unwrap();
        let mut out = finish(&mut p);
        p.insert(4, 13, 1).unwrap();
        p.scan(5, 14, 3).unwrap();
        out.extend(finish(&mut p));
        out.sort_by_key(|(tag, _)| *tag);
        let tags: Vec<u64> = out.iter().map(|(t, _)| *t).collect();
        assert_eq!(tags, vec![1, 2, 3, 4, 5], "{out:?}");
        assert!(out.iter().all(|(_, r)| r.is_err()), "{out:?}");
        assert!(matches!(
            out[1].1,
            Err(BTreeError::Server { op: "root", .. })
        ));
        assert_eq!(p.root_refreshes(), 0);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn splits_and_conflicts_are_sent_again_until_written() {
        let mut p = pipeline(vec![
            (Status::Ok, 0, vec![l::reply::SPLIT]),
            (Status::Conflict, 0, vec![]),
            (Status::HandlerError, APP_BASE + l::error::RESTART, vec![]),
            (Status::Ok, 0, vec![l::reply::REPLACED]),
            (Status::HandlerError, APP_BASE + l::error::NOT_FOUND, vec![]),
        ]);
        p.insert(1, 7, 70).unwrap();
        let out = finish(&mut p);
        assert!(
            matches!(
                &out[..],
                [(1, Ok(BTreeDone::Written(Some(Written::Replaced))))]
            ),
            "{out:?}"
        );
        p.update(2, 8, 80).unwrap();
        let out = finish(&mut p);
        assert!(
            matches!(&out[..], [(2, Ok(BTreeDone::Written(None)))]),
            "{out:?}"
        );
        assert_eq!(p.transport().handlers.len(), 5);
    }
}
