//! # naam-mica
//!
//! The MICA key-value store (Lim et al., NSDI'14) as a NAAM application: a lossy index of
//! buckets and a circular log of items in registered regions ([`layout`]), handlers compiled from
//! Rust to eBPF (`apps/mica/handlers`), a client library over any [`Transport`], and a native
//! reference implementation of the same table ([`reference::NativeMica`]).
//!
//! GET runs anywhere (two steps: bucket, then items; versions at both ends of every item detect
//! torn reads, which retry). PUT, UPDATE and DELETE run at the app's write owner as ordered write
//! batches: compare-and-swap on the log tail and on the bucket version serialise writers, and a
//! lost race is a `Conflict` reply that the client retries. Writing item `n` evicts item
//! `n - log_items`: MICA's lossy log.
#![deny(missing_docs)]

#[cfg(feature = "host")]
use std::sync::Arc;

use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::handler_id;
use naam_proto::transport::{ClientError, Pipeline, Transport};
use naam_proto::wire::{ReplyView, Status};
#[cfg(feature = "host")]
use naam_proto::Placement;
#[cfg(feature = "host")]
use naam_runtime::cluster::{AppSpec, Cluster, RegionSpec};
#[cfg(feature = "host")]
use naam_runtime::vm::{LoadError, LoadedObject};
#[cfg(feature = "host")]
use naam_runtime::HandlerSpec;
#[cfg(feature = "host")]
use naam_runtime::{ALL_RIGHTS, READ_WRITE};

pub use naam_mica_layout as layout;
use naam_mica_layout as l;

pub mod reference;

/// Handler names.
pub mod handlers {
    /// GET.
    pub const GET: &str = "mica_get";
    /// PUT (insert or replace).
    pub const PUT: &str = "mica_put";
    /// UPDATE (existing keys only).
    pub const UPDATE: &str = "mica_update";
    /// DELETE.
    pub const DELETE: &str = "mica_delete";
    /// RMW: patch a field of the value, return the old value.
    pub const RMW: &str = "mica_rmw";
    /// INCR: add to the value as a decimal integer (absent: 0), return the new one.
    pub const INCR: &str = "mica_incr";
}

/// Errors of the MICA library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MicaError {
    /// A key or value over the table's capacity, or an empty key.
    #[error("key of {key} bytes or value of {value} bytes does not fit (capacities {key_cap} and {value_cap}; keys must not be empty)")]
    TooLarge {
        /// Length of the key given, bytes (an empty key is refused too).
        key: usize,
        /// Length of the value given, bytes (for `rmw_field`, its 4-byte field offset included).
        value: usize,
        /// The table's largest key, bytes ([`MicaConfig::key_cap`]).
        key_cap: usize,
        /// The table's largest value, bytes ([`MicaConfig::value_cap`]); `rmw_field` may exceed it
        /// by its field offset.
        value_cap: usize,
    },
    /// The configuration is not usable.
    #[error("invalid MICA configuration: {0}")]
    Config(String),
    /// The server answered with an error.
    #[error("{op}: server replied {status:?} (code {code}, {}): {message}", error_name(*.code))]
    Server {
        /// The client call that failed: `get`, `put`, `update`, `delete` or `rmw`.
        op: &'static str,
        /// The reply's status: never `Ok`, nor `Conflict` or `Busy`, which the client retries.
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
    /// A conflicting writer won every retry.
    #[error("{0}: gave up after {1} conflicting attempts")]
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

/// Table geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MicaConfig {
    /// Buckets in the index (a power of two).
    pub buckets: u64,
    /// Items in the circular log.
    pub log_items: u64,
    /// Largest key, bytes.
    pub key_cap: usize,
    /// Largest value, bytes.
    pub value_cap: usize,
}

impl MicaConfig {
    /// 8-byte keys and values.
    pub fn preset_8_8(items: u64) -> Self {
        Self::sized(items, 8, 8)
    }

    /// 16-byte keys, 64-byte values.
    pub fn preset_16_64(items: u64) -> Self {
        Self::sized(items, 16, 64)
    }

    /// YCSB records: keys `user` + up to 20 digits, values of 10 fields × 100 bytes.
    pub fn preset_ycsb(items: u64) -> Self {
        Self::sized(items, 24, 1000)
    }

    /// A table for about `items` live items: about 4 items per bucket on average (of 15 slots)
    /// and a log twice as large as the live set, so eviction only trims old versions.
    pub fn sized(items: u64, key_cap: usize, value_cap: usize) -> Self {
        let buckets = (items.max(1) / 4).max(1).next_power_of_two();
        MicaConfig {
            buckets,
            log_items: (items * 2).max(16),
            key_cap,
            value_cap,
        }
    }

    /// Live items the table is sized for (the inverse of [`MicaConfig::sized`]: half the log,
    /// so that writes do not wrap it onto live items).
    pub fn items(&self) -> u64 {
        self.log_items / 2
    }

    /// Bytes per log item.
    pub fn item_size(&self) -> usize {
        l::item_size(self.key_cap, self.value_cap)
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), MicaError> {
        if !self.buckets.is_power_of_two() {
            return Err(MicaError::Config(format!(
                "{} buckets is not a power of two",
                self.buckets
            )));
        }
        if self.log_items == 0 || self.log_items >= 1 << 40 {
            return Err(MicaError::Config(format!(
                "{} log items is out of range",
                self.log_items
            )));
        }
        if self.key_cap == 0
            || self.key_cap + self.value_cap + l::args::KEY > naam_ebpf::abi::ARGS_CAP
        {
            return Err(MicaError::Config(format!(
                "keys of {} and values of {} bytes do not fit in a message's {} bytes of args",
                self.key_cap,
                self.value_cap,
                naam_ebpf::abi::ARGS_CAP
            )));
        }
        if self.item_size() + l::ITEM_HEADER > naam_ebpf::abi::WRITE_DATA_CAP {
            return Err(MicaError::Config("items larger than a write batch".into()));
        }
        let bytes = (self.buckets as u128) * l::BUCKET_SIZE as u128
            + (self.log_items as u128) * self.item_size() as u128;
        if bytes > u32::MAX as u128 * 4 {
            return Err(MicaError::Config(format!(
                "{bytes} bytes of regions is too large"
            )));
        }
        Ok(())
    }

    /// The meta region's initial contents.
    pub fn meta(&self) -> Vec<u8> {
        let mut m = vec![0u8; l::META_SIZE];
        let mut put = |at: usize, v: u64| m[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put(l::META_TAIL, 0);
        put(l::META_BUCKETS, self.buckets);
        put(l::META_LOG_ITEMS, self.log_items);
        put(l::META_ITEM_SIZE, self.item_size() as u64);
        put(l::META_KEY_CAP, self.key_cap as u64);
        put(l::META_VALUE_CAP, self.value_cap as u64);
        m
    }

    /// The key hash MICA uses for `key`.
    pub fn keyhash(key: &[u8]) -> u64 {
        naam_ebpf::hash::hash64(key, l::HASH_SEED)
    }
}

/// Region names of a MICA app.
pub mod regions {
    /// Meta (tail, geometry).
    pub const META: &str = "mica-meta";
    /// Index (buckets).
    pub const INDEX: &str = "mica-index";
    /// Log (items).
    pub const LOG: &str = "mica-log";
}

/// The MICA's handler object (eBPF), built from `handlers/` with this crate (build.rs) and
/// carried by every binary that links it: running it needs no toolchain.
#[cfg(feature = "host")]
pub const HANDLERS_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/mica.o"));

/// Loads the embedded [`HANDLERS_OBJECT`]: its ELF, relocations and programs are checked here,
/// and each handler is verified when a cluster installs it ([`app_spec`]).
#[cfg(feature = "host")]
pub fn handlers() -> Result<LoadedObject, MicaError> {
    Ok(naam_runtime::vm::load(HANDLERS_OBJECT)?)
}

/// The app a cluster installs for a MICA table: its regions and handlers (GET read-only, the
/// others writes at `owner`), on the JIT with the default budget ([`AppSpec::with_engine`] and
/// [`AppSpec::with_budget`] change them).
#[cfg(feature = "host")]
pub fn app_spec(
    app: u32,
    config: &MicaConfig,
    object: Arc<LoadedObject>,
    owner: Placement,
) -> Result<AppSpec, MicaError> {
    config.validate()?;
    Ok(AppSpec {
        id: app,
        name: "mica".into(),
        owner,
        regions: vec![
            RegionSpec {
                name: regions::META.into(),
                access: ALL_RIGHTS,
                contents: config.meta(),
            },
            RegionSpec {
                name: regions::INDEX.into(),
                access: ALL_RIGHTS,
                contents: vec![0u8; config.buckets as usize * l::BUCKET_SIZE],
            },
            RegionSpec {
                name: regions::LOG.into(),
                access: READ_WRITE,
                contents: vec![0u8; config.log_items as usize * config.item_size()],
            },
        ],
        object,
        handlers: vec![
            HandlerSpec::read(handlers::GET),
            HandlerSpec::write(handlers::PUT),
            HandlerSpec::write(handlers::UPDATE),
            HandlerSpec::write(handlers::DELETE),
            HandlerSpec::write(handlers::RMW),
            HandlerSpec::write(handlers::INCR),
        ],
    })
}

/// What [`check_regions`] found in a table's regions.
#[cfg(feature = "host")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableCheck {
    /// The log's tail: items written so far.
    pub tail: u64,
    /// Slots naming an item still in the log (the live items, and superseded copies a
    /// bucket still names).
    pub live: u64,
}

/// Checks the regions of a table that outlived its server (meta, index and log, as
/// [`app_spec`] lists them) against `config` before a server serves them again: the meta
/// holds `config`'s geometry; no bucket is locked (an odd version: a writer died holding it,
/// which the write journal's undo rules out); every slot names an item below the tail, and
/// each it names that the log still holds is whole (both versions its number + 1: writers
/// publish an item in its bucket only after its front version). Reads every bucket and the
/// ends of every item a slot names.
#[cfg(feature = "host")]
pub fn check_regions(
    config: &MicaConfig,
    meta: &naam_runtime::RegionMemory,
    index: &naam_runtime::RegionMemory,
    log: &naam_runtime::RegionMemory,
) -> Result<TableCheck, String> {
    let word = |m: &naam_runtime::RegionMemory, at: usize, what: &str| {
        m.load_u64(at as u64)
            .map_err(|e| format!("{what} at {at}: {e}"))
    };
    let expect = [
        (l::META_BUCKETS, config.buckets, "bucket count"),
        (l::META_LOG_ITEMS, config.log_items, "log items"),
        (l::META_ITEM_SIZE, config.item_size() as u64, "item size"),
        (l::META_KEY_CAP, config.key_cap as u64, "key capacity"),
        (l::META_VALUE_CAP, config.value_cap as u64, "value capacity"),
    ];
    for (at, want, what) in expect {
        let have = word(meta, at, "meta")?;
        if have != want {
            return Err(format!("the meta's {what} is {have}, the config's {want}"));
        }
    }
    let tail = word(meta, l::META_TAIL, "meta")?;
    let item_size = config.item_size();
    let mut live = 0;
    for b in 0..config.buckets as usize {
        let at = b * l::BUCKET_SIZE;
        let version = word(index, at, "bucket")?;
        if version & 1 == 1 {
            return Err(format!("bucket {b} is locked (version {version})"));
        }
        for i in 0..l::SLOTS {
            let w = word(index, at + l::slot_offset(i), "slot")?;
            if w == 0 {
                continue;
            }
            let item = (w & l::ITEM_MASK).wrapping_sub(1);
            if item >= tail {
                return Err(format!(
                    "bucket {b} slot {i} names item {item}, at or past the tail {tail}"
                ));
            }
            if item + config.log_items <= tail {
                continue; // evicted: the lossy log wrote over it
            }
            let base = (item % config.log_items) as usize * item_size;
            let front = word(log, base + l::ITEM_FRONT, "item")?;
            let back = word(log, base + l::item_back(item_size), "item")?;
            if front != item + 1 || back != item + 1 {
                return Err(format!(
                    "bucket {b} slot {i} names item {item}, whose versions are {front} and {back}"
                ));
            }
            live += 1;
        }
    }
    Ok(TableCheck { tail, live })
}

/// What a client needs to address one MICA table.
#[derive(Clone, Copy, Debug)]
pub struct MicaHandle {
    /// App id.
    pub app: u32,
    /// The table's geometry, which must equal the server's: the client computes bucket offsets
    /// and item sizes from it (over UDP it comes from the manifest's `params`).
    pub config: MicaConfig,
    /// rkey of the meta region.
    pub rkey_meta: u64,
    /// rkey of the index region.
    pub rkey_index: u64,
    /// rkey of the log region.
    pub rkey_log: u64,
}

impl MicaHandle {
    /// The handle of table `app` in an in-process cluster.
    #[cfg(feature = "host")]
    pub fn from_cluster(cluster: &Cluster, app: u32, config: MicaConfig) -> Option<MicaHandle> {
        Self::with_keys(app, config, |name| cluster.region_key(app, name))
    }

    /// The handle of table `app`, looking each region's rkey up by name.
    pub fn with_keys(
        app: u32,
        config: MicaConfig,
        key: impl Fn(&str) -> Option<u64>,
    ) -> Option<MicaHandle> {
        Some(MicaHandle {
            app,
            config,
            rkey_meta: key(regions::META)?,
            rkey_index: key(regions::INDEX)?,
            rkey_log: key(regions::LOG)?,
        })
    }
}

/// Most attempts a write makes when other writers win its compare-and-swap, or queues are full.
pub const MAX_ATTEMPTS: u32 = 10_000;

/// What one answer to a MICA call comes to.
enum Attempt<R> {
    /// Answered for good: what the caller reads from it.
    Done(R),
    /// Nothing was applied (another writer won a compare-and-swap, the bucket was locked, a
    /// queue was full or an owner hand-off was draining): try again.
    Again,
    /// The server refused the call.
    Failed(MicaError),
}

impl<R> Attempt<R> {
    fn map<S>(self, f: impl FnOnce(R) -> S) -> Attempt<S> {
        match self {
            Attempt::Done(r) => Attempt::Done(f(r)),
            Attempt::Again => Attempt::Again,
            Attempt::Failed(e) => Attempt::Failed(e),
        }
    }
}

/// Judges the answer `reply` to the operation `op`: its payload when it is `Ok`.
#[inline]
fn judge<'a>(op: &'static str, reply: ReplyView<'a>) -> Attempt<&'a [u8]> {
    match reply.status {
        Status::Ok => Attempt::Done(reply.payload),
        Status::Conflict | Status::Busy => Attempt::Again,
        status => Attempt::Failed(MicaError::Server {
            op,
            status,
            code: reply.code,
            message: String::from_utf8_lossy(reply.payload).into_owned(),
        }),
    }
}

/// A MICA client over any [`Transport`].
pub struct MicaClient<T: Transport> {
    transport: T,
    handle: MicaHandle,
    args: Vec<u8>,
    /// The descriptors of the message being sent, next to its args.
    descs: [Descriptor; 2],
    ids: [u32; 6],
}

impl<T: Transport> MicaClient<T> {
    /// A client of the table `handle` over `transport`.
    pub fn new(transport: T, handle: MicaHandle) -> Self {
        MicaClient {
            transport,
            handle,
            args: Vec::with_capacity(
                l::args::KEY + handle.config.key_cap + handle.config.value_cap,
            ),
            descs: [Descriptor {
                rkey: 0,
                offset: 0,
                len: 0,
                access: 0,
            }; 2],
            ids: [
                handlers::GET,
                handlers::PUT,
                handlers::UPDATE,
                handlers::DELETE,
                handlers::RMW,
                handlers::INCR,
            ]
            .map(handler_id),
        }
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Checks sizes; `extra` is what the operation adds to the value (RMW's field offset).
    fn check(&self, key: &[u8], value: &[u8], extra: usize) -> Result<(), MicaError> {
        let c = &self.handle.config;
        if key.is_empty() || key.len() > c.key_cap || value.len() > c.value_cap + extra {
            return Err(MicaError::TooLarge {
                key: key.len(),
                value: value.len(),
                key_cap: c.key_cap,
                value_cap: c.value_cap,
            });
        }
        Ok(())
    }

    fn fill_args(&mut self, key: &[u8], value: &[u8]) -> u64 {
        let h = &self.handle;
        let hash = MicaConfig::keyhash(key);
        let bucket = l::bucket_of(hash, h.config.buckets) * l::BUCKET_SIZE as u64;
        // The fixed part built in place, then appended in one copy: a dozen appends of a few
        // bytes each checked the vector's capacity a dozen times.
        let mut fixed = [0u8; l::args::KEY];
        let mut put = |at: usize, bytes: &[u8]| fixed[at..at + bytes.len()].copy_from_slice(bytes);
        put(l::args::RKEY_META, &h.rkey_meta.to_le_bytes());
        put(l::args::RKEY_INDEX, &h.rkey_index.to_le_bytes());
        put(l::args::RKEY_LOG, &h.rkey_log.to_le_bytes());
        put(l::args::BUCKET_OFFSET, &bucket.to_le_bytes());
        put(l::args::LOG_ITEMS, &h.config.log_items.to_le_bytes());
        put(
            l::args::ITEM_SIZE,
            &(h.config.item_size() as u32).to_le_bytes(),
        );
        put(l::args::KEY_CAP, &(h.config.key_cap as u32).to_le_bytes());
        put(l::args::KEYHASH, &hash.to_le_bytes());
        put(l::args::KEY_LEN, &(key.len() as u32).to_le_bytes());
        put(l::args::VALUE_LEN, &(value.len() as u32).to_le_bytes());
        let a = &mut self.args;
        a.clear();
        a.reserve(fixed.len() + key.len() + value.len());
        a.extend_from_slice(&fixed);
        a.extend_from_slice(key);
        a.extend_from_slice(value);
        bucket
    }

    /// Builds the args of handler `id` on `key` and `value` into `self.args` and the
    /// descriptors it names into `self.descs` (writes: meta and bucket, writable; reads: the
    /// bucket), and returns how many it names. Left in place rather than returned: returned,
    /// they were copied back at once in 16-byte loads across the narrower stores that had
    /// just built them, and stalled on store forwarding.
    fn prepare(
        &mut self,
        id: u32,
        key: &[u8],
        value: &[u8],
        write: bool,
    ) -> Result<usize, MicaError> {
        let extra = if id == self.ids[4] {
            l::RMW_OFFSET_SIZE
        } else {
            0
        };
        self.check(key, value, extra)?;
        let bucket = self.fill_args(key, value);
        let h = self.handle;
        let rwa = ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC;
        let bucket_read = Descriptor {
            rkey: h.rkey_index,
            offset: bucket,
            len: l::BUCKET_SIZE as u32,
            access: ACCESS_READ,
        };
        let (descs, n) = if write {
            (
                [
                    Descriptor {
                        rkey: h.rkey_meta,
                        offset: 0,
                        len: l::META_SIZE as u32,
                        access: rwa,
                    },
                    Descriptor {
                        rkey: h.rkey_index,
                        offset: bucket,
                        len: l::BUCKET_SIZE as u32,
                        access: rwa,
                    },
                ],
                2,
            )
        } else {
            ([bucket_read, bucket_read], 1)
        };
        self.descs = descs;
        Ok(n)
    }

    /// Sends handler `id` on `key` and `value` until it is answered for good, and returns the
    /// reply (a view of its datagram over UDP: [`MicaClient::get_bytes`]).
    fn send(
        &mut self,
        op: &'static str,
        id: u32,
        key: &[u8],
        value: &[u8],
        write: bool,
    ) -> Result<naam_proto::wire::Reply, MicaError> {
        self.attempts(op, id, (key, value, write), |t, args, descs| {
            t.call(args.0, args.1, args.2, descs).map(|reply| {
                // The verdict first (it borrows the reply), then the reply itself moves out.
                let verdict = judge(op, reply.view()).map(|_| ());
                verdict.map(|()| reply)
            })
        })
    }

    /// Sends handler `id` on `key` and `value` until it is answered for good, and returns
    /// `read` of the payload of the `Ok` answer, read where the transport holds it
    /// ([`Transport::call_with`]): over direct execution, in the machine it ran in.
    fn send_with<R>(
        &mut self,
        op: &'static str,
        id: u32,
        key: &[u8],
        value: &[u8],
        write: bool,
        mut read: impl FnMut(&[u8]) -> R,
    ) -> Result<R, MicaError> {
        self.attempts(op, id, (key, value, write), |t, args, descs| {
            t.call_with(args.0, args.1, args.2, descs, |reply| {
                judge(op, reply).map(&mut read)
            })
        })
    }

    /// Builds handler `id`'s message on `key`, `value` (a write's or not) and makes `once`
    /// send it (given the transport, `(app, handler, args)` and the descriptors) until an
    /// answer ends it, backing off before each retry.
    #[inline(always)]
    fn attempts<R>(
        &mut self,
        op: &'static str,
        id: u32,
        (key, value, write): (&[u8], &[u8], bool),
        mut once: impl FnMut(
            &mut T,
            (u32, u32, &[u8]),
            &[Descriptor],
        ) -> Result<Attempt<R>, ClientError>,
    ) -> Result<R, MicaError> {
        let n = self.prepare(id, key, value, write)?;
        let app = self.handle.app;
        for attempt in 1..=MAX_ATTEMPTS {
            match once(&mut self.transport, (app, id, &self.args), &self.descs[..n]) {
                Ok(Attempt::Done(r)) => return Ok(r),
                Ok(Attempt::Failed(e)) => return Err(e),
                Ok(Attempt::Again) | Err(ClientError::Busy(_)) => self.transport.backoff(attempt),
                Err(e) => return Err(e.into()),
            }
        }
        Err(MicaError::Contended(op, MAX_ATTEMPTS))
    }

    /// The value of `key`, if the table holds it.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, MicaError> {
        // Copied straight out of the reply: a view of it first would turn the reply's buffer
        // into a shared one (an allocation) only to copy from it.
        self.get_with(key, <[u8]>::to_vec)
    }

    /// The value of `key`, if the table holds it, as a view of the reply (no copy).
    pub fn get_bytes(&mut self, key: &[u8]) -> Result<Option<bytes::Bytes>, MicaError> {
        let r = self.send("get", self.ids[0], key, &[], false)?;
        Ok(match r.payload.first() {
            Some(&l::reply::HIT) => Some(r.payload.slice(1..)),
            _ => None,
        })
    }

    /// `f` of the value of `key` if the table holds it, read in place in the reply.
    pub fn get_with<R>(
        &mut self,
        key: &[u8],
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, MicaError> {
        // Read once: the answer that ends the call is the only one read.
        let mut f = Some(f);
        self.send_with(
            "get",
            self.ids[0],
            key,
            &[],
            false,
            |payload| match payload.split_first() {
                Some((&l::reply::HIT, value)) => f.take().map(|f| f(value)),
                _ => None,
            },
        )
    }

    /// Inserts or replaces; returns whether the key existed.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<bool, MicaError> {
        self.send_with("put", self.ids[1], key, value, true, |payload| {
            payload.first() == Some(&1)
        })
    }

    /// Replaces the value of an existing key; returns false (and changes nothing) if absent.
    pub fn update(&mut self, key: &[u8], value: &[u8]) -> Result<bool, MicaError> {
        match self.send_with("update", self.ids[2], key, value, true, |_| ()) {
            Ok(_) => Ok(true),
            Err(MicaError::Server {
                status: Status::HandlerError,
                code,
                ..
            }) if code == naam_ebpf::abi::error_code::APP_BASE + l::error::NOT_FOUND => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, MicaError> {
        self.send_with("delete", self.ids[3], key, &[], true, |payload| {
            payload.first() == Some(&1)
        })
    }

    /// Read-modify-write at the owner in one message (YCSB-F): writes `patch` over the value's
    /// bytes from `field`, and returns the old value, or `None` if the key is absent.
    pub fn rmw_field(
        &mut self,
        key: &[u8],
        field: u32,
        patch: &[u8],
    ) -> Result<Option<Vec<u8>>, MicaError> {
        let mut value = Vec::with_capacity(l::RMW_OFFSET_SIZE + patch.len());
        value.extend_from_slice(&field.to_le_bytes());
        value.extend_from_slice(patch);
        match self.send_with("rmw", self.ids[4], key, &value, true, <[u8]>::to_vec) {
            Ok(old) => Ok(Some(old)),
            Err(MicaError::Server {
                status: Status::HandlerError,
                code,
                ..
            }) if code == naam_ebpf::abi::error_code::APP_BASE + l::error::NOT_FOUND => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Adds `delta` to the value of `key` read as a decimal integer (0 if absent), at the
    /// owner in one message, and returns the new value; `None` when the value is not an
    /// integer or the sum overflows (nothing changes then).
    pub fn incr_by(&mut self, key: &[u8], delta: i64) -> Result<Option<i64>, MicaError> {
        match self.send_with("incr", self.ids[5], key, &delta.to_le_bytes(), true, |p| {
            p.get(..8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        }) {
            Ok(v) => Ok(v),
            Err(MicaError::Server {
                status: Status::HandlerError,
                code,
                ..
            }) if code == naam_ebpf::abi::error_code::APP_BASE + l::error::NOT_INTEGER => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Read-modify-write with any function, on the client: reads the value, applies `f`, writes
    /// the result back (two messages, not atomic); returns the new value, or `None` if absent.
    pub fn rmw(
        &mut self,
        key: &[u8],
        f: impl FnOnce(&[u8]) -> Vec<u8>,
    ) -> Result<Option<Vec<u8>>, MicaError> {
        let Some(old) = self.get(key)? else {
            return Ok(None);
        };
        let new = f(&old);
        self.put(key, &new)?;
        Ok(Some(new))
    }
}

/// What a pipelined MICA operation came to.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MicaDone {
    /// A get: the value (a view of the reply), or `None` when the table does not hold the key.
    Got(Option<bytes::Bytes>),
    /// A put: whether the key existed.
    Put(bool),
    /// An `rmw_field`: the old value, or `None` when the key is absent.
    Patched(Option<bytes::Bytes>),
    /// An update: whether the key existed (and so was replaced).
    Updated(bool),
    /// A delete: whether the key existed.
    Deleted(bool),
    /// An increment: the new value, or `None` when the value is not an integer or the sum
    /// overflows (nothing changed).
    Counted(Option<i64>),
}

/// One operation in flight.
struct InFlight {
    tag: u64,
    op: &'static str,
    handler: u32,
    args: Vec<u8>,
    descs: [Descriptor; 2],
    n_descs: usize,
    attempt: u32,
}

/// MICA operations in flight together over a [`Pipeline`]: a client thread keeps many
/// requests outstanding (YCSB's `--pipeline`, a multi-get) instead of one. Each operation is
/// submitted at once, carries the caller's tag, and is resubmitted on its own when the server
/// answers `Busy` or `Conflict`.
pub struct MicaPipeline<T: Pipeline> {
    client: MicaClient<T>,
    flying: naam_proto::intmap::IntMap<u64, InFlight>,
    /// Args buffers of finished operations, for the next ones: an operation keeps its args
    /// for a resubmission, and a fresh copy each was an allocation per operation.
    spare_args: Vec<Vec<u8>>,
}

/// Args buffers a pipeline keeps for reuse at most (about a window's).
const SPARE_ARGS: usize = 256;

impl<T: Pipeline> MicaPipeline<T> {
    /// A pipeline of the table `handle` over `transport`.
    pub fn new(transport: T, handle: MicaHandle) -> Self {
        MicaPipeline {
            client: MicaClient::new(transport, handle),
            flying: Default::default(),
            spare_args: Vec::new(),
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

    /// Operations submitted and not yet handed back.
    pub fn in_flight(&self) -> usize {
        self.flying.len()
    }

    /// The most operations the transport keeps outstanding.
    pub fn window(&self) -> usize {
        self.client.transport.window()
    }

    /// Starts a get of `key`; its answer will carry `tag`.
    pub fn get(&mut self, tag: u64, key: &[u8]) -> Result<(), MicaError> {
        let id = self.client.ids[0];
        self.start(tag, "get", id, key, &[], false)
    }

    /// Starts a put of `key` = `value`.
    pub fn put(&mut self, tag: u64, key: &[u8], value: &[u8]) -> Result<(), MicaError> {
        let id = self.client.ids[1];
        self.start(tag, "put", id, key, value, true)
    }

    /// Starts an update of `key` to `value`: replaces it if the table holds it, changes
    /// nothing otherwise.
    pub fn update(&mut self, tag: u64, key: &[u8], value: &[u8]) -> Result<(), MicaError> {
        let id = self.client.ids[2];
        self.start(tag, "update", id, key, value, true)
    }

    /// Starts a delete of `key`.
    pub fn delete(&mut self, tag: u64, key: &[u8]) -> Result<(), MicaError> {
        let id = self.client.ids[3];
        self.start(tag, "delete", id, key, &[], true)
    }

    /// Starts an increment of `key` by `delta` ([`MicaClient::incr_by`]).
    pub fn incr_by(&mut self, tag: u64, key: &[u8], delta: i64) -> Result<(), MicaError> {
        let id = self.client.ids[5];
        self.start(tag, "incr", id, key, &delta.to_le_bytes(), true)
    }

    /// Starts a read-modify-write of `key` (YCSB's update of one field): `patch` over the
    /// value's bytes from `field`.
    pub fn rmw_field(
        &mut self,
        tag: u64,
        key: &[u8],
        field: u32,
        patch: &[u8],
    ) -> Result<(), MicaError> {
        let mut value = Vec::with_capacity(l::RMW_OFFSET_SIZE + patch.len());
        value.extend_from_slice(&field.to_le_bytes());
        value.extend_from_slice(patch);
        let id = self.client.ids[4];
        self.start(tag, "rmw", id, key, &value, true)
    }

    fn start(
        &mut self,
        tag: u64,
        op: &'static str,
        handler: u32,
        key: &[u8],
        value: &[u8],
        write: bool,
    ) -> Result<(), MicaError> {
        let n_descs = self.client.prepare(handler, key, value, write)?;
        let descs = self.client.descs;
        // The args just built go with the operation; the next are built in a spare buffer
        // (`prepare` clears it first).
        let spare = self.spare_args.pop().unwrap_or_default();
        let f = InFlight {
            tag,
            op,
            handler,
            args: std::mem::replace(&mut self.client.args, spare),
            descs,
            n_descs,
            attempt: 1,
        };
        self.submit(f)
    }

    fn submit(&mut self, f: InFlight) -> Result<(), MicaError> {
        let app = self.client.handle.app;
        let token = self
            .client
            .transport
            .submit(app, f.handler, &f.args, &f.descs[..f.n_descs])?;
        self.flying.insert(token, f);
        Ok(())
    }

    /// Keeps `args` (cleared) for a later operation's args.
    fn spare(&mut self, mut args: Vec<u8>) {
        if self.spare_args.len() < SPARE_ARGS {
            args.clear();
            self.spare_args.push(args);
        }
    }

    /// The operations that finished since the last poll, by tag; with `block`, waits a while
    /// for one when any is in flight. Operations the server answered `Busy` or `Conflict` are
    /// resubmitted (up to [`MAX_ATTEMPTS`]) and show up later.
    pub fn poll(&mut self, block: bool) -> Vec<(u64, Result<MicaDone, MicaError>)> {
        let mut out = Vec::new();
        let mut block = block;
        loop {
            let answers = self.client.transport.poll(block);
            // One allocation for the round's answers, not one per doubling.
            out.reserve(answers.len());
            for (token, result) in answers {
                let Some(mut f) = self.flying.remove(&token) else {
                    continue;
                };
                // Back among the spares unless the operation is resubmitted (which takes it
                // back from here).
                let args = std::mem::take(&mut f.args);
                let tag = f.tag;
                let again = match result {
                    Ok(r)
                        if matches!(r.status, Status::Conflict | Status::Busy)
                            && f.attempt < MAX_ATTEMPTS =>
                    {
                        InFlight {
                            attempt: f.attempt + 1,
                            args,
                            ..f
                        }
                    }
                    // The window was full when it was resubmitted: try on the next poll.
                    Err(ClientError::Busy(_)) => InFlight { args, ..f },
                    other => {
                        self.spare(args);
                        out.push((tag, answer(f.op, other)));
                        continue;
                    }
                };
                if let Err(e) = self.submit(again) {
                    out.push((tag, Err(e)));
                }
            }
            if !out.is_empty() || !block || self.flying.is_empty() {
                return out;
            }
            block = true;
        }
    }

    /// The values of `keys` (a multi-get): every get in flight together, within the
    /// transport's window. Nothing else may be in flight on this pipeline meanwhile.
    pub fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<bytes::Bytes>>, MicaError> {
        let mut values = vec![None; keys.len()];
        naam_proto::transport::in_flight_together(
            self,
            keys.len(),
            |p| p.in_flight() < p.window(),
            |p, i| p.get(i, keys[i as usize]),
            |p| p.poll(true),
            |i, done| {
                if let MicaDone::Got(v) = done {
                    values[i as usize] = v;
                }
            },
        )?;
        Ok(values)
    }
}

/// What operation `op` came to, answered `result` for good (not to be resubmitted).
fn answer(
    op: &'static str,
    result: Result<naam_proto::wire::Reply, ClientError>,
) -> Result<MicaDone, MicaError> {
    use naam_ebpf::abi::error_code::APP_BASE;
    match result {
        Ok(r) if r.status == Status::Ok => Ok(done(op, r.payload)),
        Ok(r) if matches!(r.status, Status::Conflict | Status::Busy) => {
            Err(MicaError::Contended(op, MAX_ATTEMPTS))
        }
        Ok(r)
            if r.status == Status::HandlerError
                && r.code == APP_BASE + l::error::NOT_FOUND
                && matches!(op, "rmw" | "update") =>
        {
            Ok(if op == "rmw" {
                MicaDone::Patched(None)
            } else {
                MicaDone::Updated(false)
            })
        }
        Ok(r)
            if r.status == Status::HandlerError
                && r.code == APP_BASE + l::error::NOT_INTEGER
                && op == "incr" =>
        {
            Ok(MicaDone::Counted(None))
        }
        Ok(r) => Err(MicaError::Server {
            op,
            status: r.status,
            code: r.code,
            message: String::from_utf8_lossy(&r.payload).into_owned(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// What a successful reply to operation `op` says.
fn done(op: &str, payload: bytes::Bytes) -> MicaDone {
    match op {
        "get" => MicaDone::Got(match payload.first() {
            Some(&l::reply::HIT) => Some(payload.slice(1..)),
            _ => None,
        }),
        "put" => MicaDone::Put(payload.first() == Some(&1)),
        "update" => MicaDone::Updated(true),
        "delete" => MicaDone::Deleted(payload.first() == Some(&1)),
        "incr" => MicaDone::Counted(
            payload
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .map(i64::from_le_bytes),
        ),
        _ => MicaDone::Patched(Some(payload)),
    }
}

#[cfg(test)]
mod tests {
    //! The client library over a scripted [`Transport`]: no runtime, no server.
    use super::*;
    use naam_proto::wire::{LoadFeedback, Reply};
    use naam_proto::Placement;

    /// Answers each call with the next scripted status (payload `HIT, b"v"`), counting
    /// backoffs.
    struct Scripted {
        replies: Vec<Result<Status, ClientError>>,
        calls: Vec<(u32, usize)>,
        args: Vec<Vec<u8>>,
        backoffs: Vec<u32>,
    }

    impl Transport for Scripted {
        fn call(
            &mut self,
            app: u32,
            handler: u32,
            args: &[u8],
            descs: &[Descriptor],
        ) -> Result<Reply, ClientError> {
            self.calls.push((handler, descs.len()));
            self.args.push(args.to_vec());
            let status = self.replies.remove(0)?;
            Ok(Reply {
                app,
                request_id: 0,
                status,
                code: 0,
                steps: 2,
                placement: Placement::Host,
                load: LoadFeedback::default(),
                payload: bytes::Bytes::from_static(&[l::reply::HIT, b'v']),
            })
        }

        fn backoff(&mut self, attempt: u32) {
            self.backoffs.push(attempt);
        }
    }

    fn client(replies: Vec<Result<Status, ClientError>>) -> MicaClient<Scripted> {
        let handle = MicaHandle::with_keys(1, MicaConfig::preset_8_8(1024), |_| Some(7))
            .expect("every region named");
        let t = Scripted {
            replies,
            calls: Vec::new(),
            args: Vec::new(),
            backoffs: Vec::new(),
        };
        MicaClient::new(t, handle)
    }

    /// A pipeline over the scripted transport, answering each submission at once.
    fn pipeline(
        replies: Vec<Result<Status, ClientError>>,
    ) -> MicaPipeline<naam_proto::transport::Immediate<Scripted>> {
        let c = client(replies);
        MicaPipeline::new(naam_proto::transport::Immediate::new(c.transport), c.handle)
    }

    /// Polls until `p` hands back an answer.
    fn answered<T: Pipeline>(p: &mut MicaPipeline<T>) -> (u64, Result<MicaDone, MicaError>) {
        loop {
            if let Some(a) = p.poll(true).pop() {
                return a;
            }
        }
    }

    #[test]
    fn a_pipeline_resubmits_busy_and_conflict_with_the_same_args_until_attempts_run_out() {
        let mut p = pipeline(vec![
            Ok(Status::Conflict),
            Ok(Status::Busy),
            Err(ClientError::Busy(Placement::Host)),
            Ok(Status::Ok),
            Ok(Status::Ok),
        ]);
        p.get(7, b"key").unwrap();
        let (tag, done) = answered(&mut p);
        assert_eq!(tag, 7);
        assert!(matches!(done, Ok(MicaDone::Got(Some(_)))), "{done:?}");
        // The next operation's args are built in a recycled buffer, its own.
        p.put(8, b"other", b"value").unwrap();
        let (tag, done) = answered(&mut p);
        assert_eq!(tag, 8);
        assert!(done.is_ok(), "{done:?}");
        let t = p.transport().get_mut();
        assert_eq!(t.args.len(), 5);
        assert!(
            t.args[..4].iter().all(|a| a == &t.args[0]),
            "one get's args, resent"
        );
        assert_ne!(t.args[4], t.args[0]);
        assert!(t.args[4].ends_with(b"othervalue"));

        let mut p = pipeline(vec![Ok(Status::Conflict); MAX_ATTEMPTS as usize]);
        p.get(9, b"key").unwrap();
        let (_, done) = answered(&mut p);
        assert!(
            matches!(done, Err(MicaError::Contended("get", MAX_ATTEMPTS))),
            "{done:?}"
        );
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn busy_and_conflict_are_retried_through_the_transports_backoff() {
        let mut c = client(vec![
            Err(ClientError::Busy(Placement::Host)),
            Ok(Status::Conflict),
            Ok(Status::Ok),
        ]);
        assert_eq!(c.get(b"key").expect("answered"), Some(b"v".to_vec()));
        let t = c.transport();
        assert_eq!(t.backoffs, vec![1, 2]);
        // GET names the bucket alone, read-only, to the GET handler.
        assert!(t
            .calls
            .iter()
            .all(|&(h, n)| h == handler_id(handlers::GET) && n == 1));
    }

    #[test]
    fn a_server_error_and_a_dead_fabric_are_errors_not_retries() {
        let mut c = client(vec![Ok(Status::AccessDenied)]);
        assert!(matches!(
            c.get(b"key"),
            Err(MicaError::Server {
                status: Status::AccessDenied,
                ..
            })
        ));
        let mut c = client(vec![Err(ClientError::Shutdown)]);
        assert!(matches!(
            c.put(b"key", b"value"),
            Err(MicaError::Client(ClientError::Shutdown))
        ));
        assert!(c.transport().backoffs.is_empty());
    }
}
