//! The YCSB driver: a load phase, then a run phase of closed-loop client threads against MICA or
//! the B-tree on the in-process cluster, with per-operation and per-placement latencies.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use naam_btree::{BTreeClient, BTreeConfig, BTreeDone, BTreeHandle, BTreePipeline};
use naam_mica::{MicaClient, MicaConfig, MicaDone, MicaHandle, MicaPipeline};
use naam_runtime::cluster::{Cluster, ClusterConfig, PolicyChoice};
use naam_runtime::proto::steering::CostPolicyConfig;
use naam_runtime::proto::transport::{Pipeline, Transport};
use naam_runtime::proto::Placement;
use naam_runtime::{Percentiles, Snapshot};
use serde::Serialize;

use crate::phase::{PipedStore, Store, StoreFactory, StoreOp};
use crate::ycsb::{KeyNaming, Op, RecordShape, Workload};

/// Which application serves the records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum App {
    /// The MICA hash table (records are values of `field_count × field_length` bytes).
    Mica,
    /// The B-tree (records are 8-byte values; scans supported).
    Btree,
}

impl App {
    /// The app kind naam-server's manifest names (and its tenant's usual name).
    pub fn kind(self) -> &'static str {
        match self {
            App::Mica => "mica",
            App::Btree => "btree",
        }
    }
}

impl std::str::FromStr for App {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mica" => Ok(App::Mica),
            "btree" => Ok(App::Btree),
            o => Err(format!("unknown app `{o}` (mica, btree)")),
        }
    }
}

/// Where reads run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementChoice {
    /// Steered by the cost policy.
    Auto,
    /// Always at one placement (writes stay at the owner, the host).
    Fixed(Placement),
}

impl PlacementChoice {
    /// The placement a client pins every request to: none when the cost policy steers.
    pub fn pin(self) -> Option<Placement> {
        match self {
            PlacementChoice::Auto => None,
            PlacementChoice::Fixed(p) => Some(p),
        }
    }
}

impl std::str::FromStr for PlacementChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PlacementChoice::Auto),
            other => other
                .parse::<Placement>()
                .map(PlacementChoice::Fixed)
                .map_err(|e| format!("{e}, or auto")),
        }
    }
}

/// A YCSB run.
#[derive(Clone, Debug, Serialize)]
pub struct YcsbConfig {
    /// The store under test: MICA, or the B-tree (workloads with scans need the B-tree).
    pub app: App,
    /// Operation mix, key distribution, scan lengths and key naming (a core workload or a
    /// property file).
    pub workload: Workload,
    /// Records loaded.
    pub records: u64,
    /// Operations in the run phase.
    pub ops: u64,
    /// Client threads.
    pub threads: usize,
    /// Operations each client thread keeps in flight (memtier's `--pipeline`; 1: one at a
    /// time, YCSB's closed loop).
    pub pipeline: usize,
    /// Placement of reads.
    pub placement: PlacementChoice,
    /// Record shape (MICA).
    pub shape: RecordShape,
    /// Random seed: the run phase uses it, the load phase `seed ^ 0x10ad`; each client thread
    /// mixes its index into the phase's seed.
    pub seed: u64,
    /// Host and NIC executor threads.
    pub executors: (usize, usize),
    /// Fabric (`inproc` or `udp`).
    pub fabric: String,
    /// The server (`udp`; with shards, the first of them).
    pub server: Option<std::net::SocketAddr>,
    /// The servers of a sharded run (`--server A,B,C`, `--cluster FILE`) and their hash
    /// slots; empty for one server.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<crate::sharded::Shard>,
    /// Phases, pacing, time limit and what is reported while running.
    pub run: RunOptions,
}

/// Which phases one command runs (YCSB's `load` and `run`, or both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phases {
    /// Load, then run (the in-process cluster needs both in one process).
    #[default]
    Both,
    /// Only insert the records (against a server that keeps them).
    Load,
    /// Only run the operations (the records were loaded before).
    Run,
}

/// How a run proceeds beyond the workload itself.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunOptions {
    /// Which YCSB phases this command runs (default: load, then run).
    pub phases: Phases,
    /// Operations per second over all threads (`target`).
    pub target_ops_per_sec: Option<f64>,
    /// Each phase stops after this many seconds (`maxexecutiontime`, `--duration`).
    pub max_execution_time_s: Option<f64>,
    /// First key number the load inserts (`insertstart`).
    pub insert_start: u64,
    /// Records the load inserts (`insertcount`; default the record count).
    pub insert_count: Option<u64>,
    /// Updates write every field (`writeallfields`).
    pub write_all_fields: bool,
    /// Status lines on stderr this often.
    #[serde(skip)]
    pub status_interval: Option<Duration>,
    /// HdrHistogram interval logs: each file's path is this prefix, the phase and the
    /// operation (`<prefix><phase>-<OP>.hdr`; `--hdr-log DIR` is the prefix `DIR/`).
    #[serde(skip)]
    pub hdr_log: Option<std::path::PathBuf>,
    /// Percentiles the report prints per operation (`hdrhistogram.percentiles`; 95 and 99).
    #[serde(skip)]
    pub percentiles: Vec<f64>,
}

/// Latency summary of one operation type.
#[derive(Clone, Debug, Serialize)]
pub struct OpSummary {
    /// The operation type these figures are for (one summary per type that ran).
    pub op: Op,
    /// Percentiles, nanoseconds.
    pub latency: Percentiles,
    /// Fastest, nanoseconds.
    pub min: u64,
    /// 95th percentile, nanoseconds.
    pub p95: u64,
    /// The report's percentiles (`hdrhistogram.percentiles`) and their values, nanoseconds.
    pub percentiles: Vec<(f64, u64)>,
    /// Operations that failed (an error, not a miss).
    pub errors: u64,
    /// Reads that found no record (a valid answer, YCSB's `Return=NOT_FOUND`).
    pub not_found: u64,
}

impl OpSummary {
    /// The summary of `s`, with `percentiles` (none given: YCSB's 95 and 99).
    fn of(op: Op, s: &crate::phase::OpStats, percentiles: &[f64]) -> OpSummary {
        let h = &s.latency;
        let percentiles = if percentiles.is_empty() {
            &[95.0, 99.0][..]
        } else {
            percentiles
        };
        OpSummary {
            op,
            latency: Percentiles::of(h),
            min: if h.is_empty() { 0 } else { h.min() },
            p95: h.value_at_quantile(0.95),
            percentiles: percentiles
                .iter()
                .map(|&q| (q, h.value_at_quantile(q / 100.0)))
                .collect(),
            errors: s.errors,
            not_found: s.not_found,
        }
    }
}

/// A phase's totals.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseSummary {
    /// Wall time, seconds.
    pub seconds: f64,
    /// Successful operations per second.
    pub throughput: f64,
    /// Per operation type (those that ran).
    pub ops: Vec<OpSummary>,
    /// Whether the time limit ended the phase.
    pub timed_out: bool,
    /// Whether an interrupt ended the phase ([`crate::phase::stop_on`]).
    pub interrupted: bool,
}

/// The outcome of a run.
#[derive(Clone, Debug, Serialize)]
pub struct YcsbResult {
    /// Mode label.
    pub mode: String,
    /// A copy of the settings the run used.
    pub config: YcsbConfig,
    /// The load phase, if this command ran one.
    pub load: Option<PhaseSummary>,
    /// Whether this command ran the run phase (else the run fields are empty).
    pub ran: bool,
    /// Whether the time limit ended the run phase.
    pub timed_out: bool,
    /// Whether an interrupt ended the run (in either phase; a load phase interrupted runs
    /// nothing after it).
    pub interrupted: bool,
    /// Load phase: records per second (0 without a load phase).
    pub load_throughput: f64,
    /// Run phase: operations per second.
    pub throughput: f64,
    /// Run phase wall time, seconds.
    pub seconds: f64,
    /// Per operation type.
    pub ops: Vec<OpSummary>,
    /// Per placement (messages, from the cluster's metrics over the run phase).
    pub placements: Snapshot,
    /// Fraction of messages per placement.
    pub placement_fractions: [f64; 3],
    /// Reads that found no record (MICA is lossy when the log wraps).
    pub misses: u64,
    /// Latency of every operation of the run phase together.
    pub all: Percentiles,
    /// Over a network fabric: exchanges the clients sent, resent, and were answered twice,
    /// over the run phase.
    pub transport: naam_runtime::TransportCounts,
}

/// Operations of the run phase that succeeded, each once: `ops` counts a read-modify-write
/// under `READ` and `UPDATE` too, as YCSB reports workload F.
pub fn completed(ops: &[OpSummary]) -> u64 {
    let all: u64 = ops.iter().map(|o| o.latency.count).sum();
    let rmw: u64 = ops
        .iter()
        .filter(|o| o.op == Op::Rmw)
        .map(|o| o.latency.count)
        .sum();
    all - 2 * rmw
}

/// Latency of every operation of `r`'s run phase together.
pub fn overall(r: &YcsbResult) -> Percentiles {
    r.all
}

/// A [`PipedStore`] as a [`Store`]: each of its operations run alone is started and waited
/// for; the driver keeps several in flight through [`Store::piped`].
struct Piped<S>(S);

impl<S: PipedStore> Piped<S> {
    /// Starts `op` and waits for it alone.
    fn alone(&mut self, op: StoreOp) -> anyhow::Result<bool> {
        self.0.start(u64::MAX, op)?;
        loop {
            for (tag, r) in self.0.finished(true) {
                if tag == u64::MAX {
                    return r;
                }
            }
        }
    }
}

impl<S: PipedStore> Store for Piped<S> {
    fn read(&mut self, n: u64) -> anyhow::Result<bool> {
        self.alone(StoreOp::Read(n))
    }
    fn update(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        self.alone(StoreOp::Update(n, field, bytes.to_vec()))
            .map(|_| ())
    }
    fn insert(&mut self, n: u64, record: &[u8]) -> anyhow::Result<()> {
        self.alone(StoreOp::Insert(n, record.to_vec())).map(|_| ())
    }
    fn scan(&mut self, n: u64, len: usize) -> anyhow::Result<usize> {
        // A pipelined store says only that a scan ran (1), not how many records it found.
        self.alone(StoreOp::Scan(n, len)).map(usize::from)
    }
    fn rmw(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        self.alone(StoreOp::Rmw(n, field, bytes.to_vec()))
            .map(|_| ())
    }
    fn run(&mut self, op: StoreOp) -> anyhow::Result<bool> {
        self.alone(op)
    }
    fn piped(&mut self) -> Option<&mut dyn PipedStore> {
        Some(&mut self.0)
    }
}

/// MICA with operations in flight together over a [`Pipeline`] transport.
struct MicaPipeStore<T: Pipeline> {
    m: MicaPipeline<T>,
    field_length: usize,
    naming: KeyNaming,
    key: String,
    /// Read-modify-writes whose read is in flight: the write to start when it finishes.
    rmw: std::collections::HashMap<u64, (u64, usize, Vec<u8>)>,
}

impl<T: Pipeline> MicaPipeStore<T> {
    fn new(m: MicaPipeline<T>, field_length: usize, naming: KeyNaming) -> Self {
        MicaPipeStore {
            m,
            field_length,
            naming,
            key: String::new(),
            rmw: std::collections::HashMap::new(),
        }
    }
}

impl<T: Pipeline> PipedStore for MicaPipeStore<T> {
    fn start(&mut self, tag: u64, op: StoreOp) -> anyhow::Result<()> {
        let fl = self.field_length;
        match op {
            StoreOp::Read(n) => {
                self.naming.name_into(n, &mut self.key);
                self.m.get(tag, self.key.as_bytes())?;
            }
            StoreOp::Update(n, field, bytes) => {
                self.naming.name_into(n, &mut self.key);
                self.m
                    .rmw_field(tag, self.key.as_bytes(), (field * fl) as u32, &bytes)?;
            }
            StoreOp::Rmw(n, field, bytes) => {
                self.naming.name_into(n, &mut self.key);
                self.m.get(tag, self.key.as_bytes())?;
                self.rmw.insert(tag, (n, field, bytes));
            }
            StoreOp::Insert(n, record) => {
                self.naming.name_into(n, &mut self.key);
                self.m.put(tag, self.key.as_bytes(), &record)?;
            }
            StoreOp::Scan(..) => {
                bail!("MICA is a hash table and has no scans: run workload E with --app btree")
            }
        }
        Ok(())
    }

    fn finished(&mut self, block: bool) -> Vec<(u64, anyhow::Result<bool>)> {
        let mut out = Vec::new();
        for (tag, r) in self.m.poll(block) {
            match (self.rmw.remove(&tag), r) {
                // The read half of a read-modify-write: now the write.
                (Some((n, field, bytes)), Ok(_)) => {
                    self.naming.name_into(n, &mut self.key);
                    let off = (field * self.field_length) as u32;
                    if let Err(e) = self.m.rmw_field(tag, self.key.as_bytes(), off, &bytes) {
                        out.push((tag, Err(e.into())));
                    }
                }
                (_, Ok(MicaDone::Got(v))) => out.push((tag, Ok(v.is_some()))),
                (_, Ok(MicaDone::Patched(v))) => out.push((tag, Ok(v.is_some()))),
                (_, Ok(_)) => out.push((tag, Ok(true))),
                (_, Err(e)) => out.push((tag, Err(e.into()))),
            }
        }
        out
    }

    fn in_flight(&self) -> usize {
        self.m.in_flight()
    }
}

struct MicaStore<T: Transport> {
    m: MicaClient<T>,
    field_length: usize,
    naming: KeyNaming,
    /// The last key named (reused: no allocation per operation).
    key: String,
}

impl<T: Transport> MicaStore<T> {
    fn new(m: MicaClient<T>, field_length: usize, naming: KeyNaming) -> Self {
        MicaStore {
            m,
            field_length,
            naming,
            key: String::new(),
        }
    }
}

impl<T: Transport> Store for MicaStore<T> {
    fn read(&mut self, n: u64) -> anyhow::Result<bool> {
        self.naming.name_into(n, &mut self.key);
        // YCSB reads the record's fields; the value is looked at where the reply holds it.
        Ok(self
            .m
            .get_with(self.key.as_bytes(), |v| std::hint::black_box(v).len())?
            .is_some())
    }
    fn update(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        // YCSB updates one field (writeallfields=false): patch it at the owner.
        self.m.rmw_field(
            self.naming.name(n).as_bytes(),
            (field * self.field_length) as u32,
            bytes,
        )?;
        Ok(())
    }
    fn insert(&mut self, n: u64, record: &[u8]) -> anyhow::Result<()> {
        self.m.put(self.naming.name(n).as_bytes(), record)?;
        Ok(())
    }
    fn scan(&mut self, _: u64, _: usize) -> anyhow::Result<usize> {
        bail!("MICA is a hash table and has no scans: run workload E with --app btree")
    }
    fn rmw(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        // Read the record, then modify one field of it at the owner (one message each).
        let key = self.naming.name(n);
        self.m.get(key.as_bytes())?;
        self.m
            .rmw_field(key.as_bytes(), (field * self.field_length) as u32, bytes)?;
        Ok(())
    }
}

struct BTreeStore<T: Transport> {
    t: BTreeClient<T>,
    naming: KeyNaming,
}

fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = bytes.len().min(8);
    w[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(w)
}

impl<T: Transport> Store for BTreeStore<T> {
    fn read(&mut self, n: u64) -> anyhow::Result<bool> {
        Ok(self.t.get(self.naming.number(n))?.is_some())
    }
    fn update(&mut self, n: u64, _: usize, bytes: &[u8]) -> anyhow::Result<()> {
        self.t.update(self.naming.number(n), word(bytes))?;
        Ok(())
    }
    fn insert(&mut self, n: u64, record: &[u8]) -> anyhow::Result<()> {
        self.t.insert(self.naming.number(n), word(record))?;
        Ok(())
    }
    fn scan(&mut self, n: u64, len: usize) -> anyhow::Result<usize> {
        Ok(self.t.scan(self.naming.number(n), len)?.len())
    }
    fn rmw(&mut self, n: u64, _: usize, bytes: &[u8]) -> anyhow::Result<()> {
        let k = self.naming.number(n);
        let old = self.t.get(k)?.unwrap_or(0);
        self.t.update(k, old ^ word(bytes))?;
        Ok(())
    }
}

/// The B-tree with operations in flight together over a [`Pipeline`] transport: the same
/// operations as [`BTreeStore`]'s, a read-modify-write's write started when its read comes
/// back.
struct BTreePipeStore<T: Pipeline> {
    t: BTreePipeline<T>,
    naming: KeyNaming,
    /// Read-modify-writes whose read is in flight: their key and the bytes to fold in.
    rmw: std::collections::HashMap<u64, (u64, Vec<u8>)>,
}

impl<T: Pipeline> BTreePipeStore<T> {
    fn new(t: BTreePipeline<T>, naming: KeyNaming) -> Self {
        BTreePipeStore {
            t,
            naming,
            rmw: Default::default(),
        }
    }
}

impl<T: Pipeline> PipedStore for BTreePipeStore<T> {
    fn start(&mut self, tag: u64, op: StoreOp) -> anyhow::Result<()> {
        match op {
            StoreOp::Read(n) => self.t.get(tag, self.naming.number(n))?,
            StoreOp::Update(n, _, bytes) => {
                self.t.update(tag, self.naming.number(n), word(&bytes))?
            }
            StoreOp::Insert(n, record) => {
                self.t.insert(tag, self.naming.number(n), word(&record))?
            }
            StoreOp::Scan(n, len) => self.t.scan(tag, self.naming.number(n), len)?,
            StoreOp::Rmw(n, _, bytes) => {
                let k = self.naming.number(n);
                self.t.get(tag, k)?;
                self.rmw.insert(tag, (k, bytes));
            }
        }
        Ok(())
    }

    fn finished(&mut self, block: bool) -> Vec<(u64, anyhow::Result<bool>)> {
        let mut out = Vec::new();
        for (tag, r) in self.t.poll(block) {
            match (self.rmw.remove(&tag), r) {
                // The read half of a read-modify-write: now the write, as `BTreeStore::rmw`.
                (Some((k, bytes)), Ok(BTreeDone::Got(old))) => {
                    if let Err(e) = self.t.update(tag, k, old.unwrap_or(0) ^ word(&bytes)) {
                        out.push((tag, Err(e.into())));
                    }
                }
                (_, Ok(BTreeDone::Got(v))) => out.push((tag, Ok(v.is_some()))),
                (_, Ok(BTreeDone::Written(w))) => out.push((tag, Ok(w.is_some()))),
                (_, Ok(_)) => out.push((tag, Ok(true))),
                (_, Err(e)) => out.push((tag, Err(e.into()))),
            }
        }
        out
    }

    fn in_flight(&self) -> usize {
        self.t.in_flight()
    }
}

/// Handlers built once per process.
struct Objects {
    mica: Option<Arc<naam_runtime::vm::LoadedObject>>,
    btree: Option<Arc<naam_runtime::vm::LoadedObject>>,
}

fn objects(app: App) -> anyhow::Result<Objects> {
    Ok(match app {
        App::Mica => Objects {
            mica: Some(Arc::new(
                naam_mica::handlers().context("loading MICA's embedded handlers")?,
            )),
            btree: None,
        },
        App::Btree => Objects {
            mica: None,
            btree: Some(Arc::new(
                naam_btree::handlers().context("loading the B-tree's embedded handlers")?,
            )),
        },
    })
}

const APP_ID: u32 = 1;

/// The in-process cluster `cfg` runs on: its executors and steering policy. Both in-process
/// fabrics use it (`--fabric inproc-endpoints` splits it into naam-server's and naam-nic's).
fn cluster_config(cfg: &YcsbConfig) -> ClusterConfig {
    let policy = match cfg.placement {
        PlacementChoice::Auto => PolicyChoice::Auto(CostPolicyConfig::default()),
        PlacementChoice::Fixed(p) => PolicyChoice::Always(p),
    };
    let mut config = ClusterConfig::default();
    config.host_executors = cfg.executors.0;
    config.nic_executors = cfg.executors.1;
    config.policy = policy;
    config
}

/// MICA's table for `cfg` (room for everything the run writes).
fn mica_config(cfg: &YcsbConfig) -> MicaConfig {
    MicaConfig::sized(capacity(cfg), 24, cfg.shape.len())
}

/// The B-tree for `cfg` (room for every key the run inserts).
fn btree_config(cfg: &YcsbConfig) -> BTreeConfig {
    BTreeConfig::for_keys(capacity(cfg))
}

fn setup(cfg: &YcsbConfig) -> anyhow::Result<(Arc<Cluster>, StoreFactory)> {
    let cc = cluster_config(cfg);
    let objs = objects(cfg.app)?;
    let naming = cfg.workload.naming;
    match cfg.app {
        App::Mica => {
            let mc = mica_config(cfg);
            let spec =
                naam_mica::app_spec(APP_ID, &mc, objs.mica.expect("built"), Placement::Host)?;
            let cluster = Arc::new(Cluster::builder().config(cc).app(spec).build()?);
            let handle = MicaHandle::from_cluster(&cluster, APP_ID, mc).context("MICA regions")?;
            let fl = cfg.shape.field_length;
            let c = cluster.clone();
            let make: StoreFactory = Arc::new(move || {
                Ok(Box::new(MicaStore::new(
                    MicaClient::new(c.client(), handle),
                    fl,
                    naming,
                )) as Box<dyn Store + Send>)
            });
            Ok((cluster, make))
        }
        App::Btree => {
            let bc = btree_config(cfg);
            let spec =
                naam_btree::app_spec(APP_ID, &bc, objs.btree.expect("built"), Placement::Host)?;
            let cluster = Arc::new(Cluster::builder().config(cc).app(spec).build()?);
            let handle =
                BTreeHandle::from_cluster(&cluster, APP_ID, bc).context("B-tree regions")?;
            let c = cluster.clone();
            let make: StoreFactory = Arc::new(move || {
                Ok(Box::new(BTreeStore {
                    t: BTreeClient::new(c.client(), handle),
                    naming,
                }) as Box<dyn Store + Send>)
            });
            Ok((cluster, make))
        }
    }
}

/// Items a run's store is sized for in process: the records loaded plus the items its writes
/// may add (10% over the expected number; with no operation count, as many again as the
/// records). MICA's log takes a new item for every write, so sizing for them keeps the log
/// from wrapping onto live records, up to four times the records plus 100,000 (a longer run
/// wraps it, and MICA, a cache, evicts its oldest items); the B-tree takes a key for every
/// insert only.
pub fn capacity(cfg: &YcsbConfig) -> u64 {
    let inserted = records_needed(cfg);
    let written = needed(cfg, |op| matches!(op, Op::Insert | Op::Update | Op::Rmw));
    match cfg.app {
        App::Mica => written.min(inserted.saturating_mul(4).saturating_add(100_000)),
        App::Btree => inserted,
    }
}

/// Records a run puts in a store: those loaded plus the inserts it may make. A served table
/// smaller than this loses records (MICA) or fills up (the B-tree) whatever else happens.
pub fn records_needed(cfg: &YcsbConfig) -> u64 {
    needed(cfg, |op| *op == Op::Insert)
}

fn needed(cfg: &YcsbConfig, adds: impl Fn(&Op) -> bool) -> u64 {
    let insert: f64 = cfg
        .workload
        .mix
        .iter()
        .filter(|(op, _)| adds(op))
        .map(|(_, p)| *p)
        .sum();
    let loaded = cfg
        .run
        .insert_start
        .saturating_add(cfg.run.insert_count.unwrap_or(cfg.records))
        .max(cfg.records);
    let inserts = if insert == 0.0 {
        0
    } else if cfg.ops == u64::MAX {
        cfg.records
    } else {
        (cfg.ops as f64 * insert * 1.1) as u64 + 16
    };
    loaded.saturating_add(inserts)
}

/// The ids and names of the handlers `app`'s object carries (for reports that name them).
pub fn handler_names(app: App) -> Vec<(u32, String)> {
    let loaded = match app {
        App::Mica => naam_mica::handlers().ok(),
        App::Btree => naam_btree::handlers().ok(),
    };
    loaded
        .map(|o| {
            o.programs
                .iter()
                .map(|p| (naam_runtime::proto::handler_id(&p.name), p.name.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// Refuses a run that cannot work on any fabric, before anything is set up.
fn check(cfg: &YcsbConfig) -> anyhow::Result<()> {
    if cfg.workload.has_scans() && cfg.app == App::Mica {
        bail!(
            "workload {} scans; MICA is a hash table: use --app btree",
            cfg.workload.name
        );
    }
    if cfg.records == 0 || cfg.threads == 0 {
        bail!("--records and --threads must be at least 1");
    }
    if cfg.run.phases != Phases::Both && cfg.server.is_none() {
        bail!(
            "`{}` alone needs a server that keeps the records between commands (--server \
             ADDR); the in-process cluster lives for one command: omit the phase to load and \
             run",
            if cfg.run.phases == Phases::Load {
                "load"
            } else {
                "run"
            }
        );
    }
    Ok(())
}

/// Runs `cfg` on the in-process cluster; `progress` is told the operations done so far.
pub fn run_inproc(
    cfg: &YcsbConfig,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<YcsbResult> {
    check(cfg)?;
    let (cluster, make) = setup(cfg)?;
    run_phases(cfg, make, Some(cluster.metrics()), progress, INPROC_MODE)
}

/// Runs `cfg` on a deployment inside this process over an in-memory datagram network
/// (`--fabric inproc-endpoints`): naam-server's and naam-nic's endpoints bound inline in the
/// network, each client thread a `UdpClient`. Every message crosses the client, server and NIC
/// endpoints and the framing as it does over UDP, unsealed (the datagrams never leave the
/// process: `Authentication::InProcess`), with neither a network nor the kernel, and with no
/// more thread hand-offs than [`run_inproc`]'s (whose clients submit to the executors
/// directly): set against it, it measures what the protocol costs. The cluster is sized,
/// steered and staffed as `run_inproc`'s.
pub fn run_inproc_endpoints(
    cfg: &YcsbConfig,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<YcsbResult> {
    use naam_runtime::proto::session::{Authentication, Credential};
    use naam_runtime::udp::{HostApp, MemoryNet, MEMORY_MODE};
    check(cfg)?;
    // naam-server's part keeps the host executors and the policy, naam-nic's the NIC
    // executors (udp::start_host and udp::start_nic take each their share).
    let cluster = cluster_config(cfg);
    let credential = Credential::generate(&naam_runtime::entropy::os())?;
    let objs = objects(cfg.app)?;
    let app = match cfg.app {
        App::Mica => {
            let mc = mica_config(cfg);
            HostApp {
                spec: naam_mica::app_spec(APP_ID, &mc, objs.mica.expect("built"), Placement::Host)?,
                kind: "mica".into(),
                params: serde_json::to_value(mc)?,
                object_bytes: naam_mica::HANDLERS_OBJECT.to_vec(),
                client_writes: false,
                credential: Some(credential.clone()),
            }
        }
        App::Btree => {
            let bc = btree_config(cfg);
            HostApp {
                spec: naam_btree::app_spec(
                    APP_ID,
                    &bc,
                    objs.btree.expect("built"),
                    Placement::Host,
                )?,
                kind: "btree".into(),
                params: serde_json::to_value(bc)?,
                object_bytes: naam_btree::HANDLERS_OBJECT.to_vec(),
                client_writes: false,
                credential: Some(credential.clone()),
            }
        }
    };
    let plan = crate::deployment::DeploymentPlan {
        app,
        tenant: cfg.app.kind().into(),
        credential,
        host: cluster.clone(),
        nic: cluster,
        // One address space: nothing outside the process can read or forge a datagram.
        authentication: Authentication::InProcess,
        congestion_control: false,
        network: Some(MemoryNet::new()),
        others: Vec::new(),
        deploys: None,
    };
    // One directory per deployment: runs may overlap within a process (tests).
    static DEPLOYMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let shm = crate::deployment::shm_dir(&format!(
        "naam-bench-inproc-endpoints-{}-{}",
        std::process::id(),
        DEPLOYMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let d = crate::deployment::InProcessDeployment::start(shm, plan)?;
    let client = d.client_config();
    let r = run_udp_on(cfg, client, None, progress, MEMORY_MODE);
    d.stop();
    r
}

/// Runs `cfg` against `naam-server` at `server` over the UDP fabric: every client thread has its
/// own socket and follows the server's steering weights (or `cfg.placement`).
pub fn run_udp(
    cfg: &YcsbConfig,
    server: std::net::SocketAddr,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<YcsbResult> {
    check(cfg)?;
    // The device before the credential: its absence is the clearer error.
    let rdma = (cfg.fabric == "rdma").then(rdma_device).transpose()?;
    let client = crate::udp_client::config(server, cfg.app.kind())?;
    run_udp_on(cfg, client, rdma, progress, udp_mode(cfg))
}

/// Runs `cfg` over the UDP fabric with every client set up as `client` says (its server,
/// credential and settings; the placement pin comes from `cfg`).
pub fn run_udp_with(
    cfg: &YcsbConfig,
    client: naam_runtime::udp::UdpConfig,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<YcsbResult> {
    check(cfg)?;
    let rdma = (cfg.fabric == "rdma").then(rdma_device).transpose()?;
    run_udp_on(cfg, client, rdma, progress, udp_mode(cfg))
}

/// The mode label of a run over naam-server: `rdma` or `udp`.
fn udp_mode(cfg: &YcsbConfig) -> &'static str {
    if cfg.fabric == "rdma" {
        RDMA_MODE
    } else {
        naam_runtime::udp::MODE
    }
}

/// [`run_udp_with`] once `cfg` is checked and the RDMA device (`--fabric rdma`) is open;
/// results are labelled `mode`.
fn run_udp_on(
    cfg: &YcsbConfig,
    mut client: naam_runtime::udp::UdpConfig,
    rdma: Option<RdmaDevice>,
    progress: &(dyn Fn(u64, u64) + Sync),
    mode: &'static str,
) -> anyhow::Result<YcsbResult> {
    client.pin = cfg.placement.pin();
    let mut setup = UdpSetup::with_config(cfg.app, client)?;
    tracing::debug!(server = %setup.config.server, app = setup.app.id, "connected to naam-server");
    setup.rdma = rdma;
    let make = udp_store_factory(cfg, &setup, records_needed(cfg))?;
    run_phases(cfg, make, Some(&setup.metrics), progress, mode)
}

/// Runs `cfg` over the UDP fabric against every server of `cfg.shards`, each operation sent
/// to the server of its key's hash slot (see [`crate::sharded`]); one set of metrics for all.
pub fn run_udp_sharded(
    cfg: &YcsbConfig,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<YcsbResult> {
    check(cfg)?;
    let rdma = (cfg.fabric == "rdma").then(rdma_device).transpose()?;
    let route = Arc::new(crate::sharded::SlotRoute::new(
        &cfg.shards,
        cfg.app,
        cfg.workload.naming,
    )?);
    // Each server must hold the records of its slots, counted exactly.
    let per_shard = route.counts(cfg.shards.len(), records_needed(cfg));
    let metrics = Arc::new(naam_runtime::Metrics::default());
    let mut makes = Vec::with_capacity(cfg.shards.len());
    for (shard, needed) in cfg.shards.iter().zip(per_shard) {
        let mut client = crate::udp_client::config(shard.server, cfg.app.kind())?;
        client.pin = cfg.placement.pin();
        let mut setup = UdpSetup::with_config(cfg.app, client)?;
        setup.metrics = metrics.clone();
        // An `Arc` with the `verbs` feature, `Infallible` (and `Copy`) without it.
        #[allow(clippy::clone_on_copy)]
        {
            setup.rdma = rdma.clone();
        }
        makes.push(udp_store_factory(cfg, &setup, needed)?);
    }
    let make: StoreFactory = Arc::new(move || {
        let stores = makes
            .iter()
            .map(|m| m())
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(
            Box::new(crate::sharded::ShardedStore::new(stores, route.clone()))
                as Box<dyn Store + Send>,
        )
    });
    run_phases(cfg, make, Some(&metrics), progress, udp_mode(cfg))
}

/// Makes the store of each client thread of a run against `setup`'s server, after checking
/// that its table holds `needed` records.
fn udp_store_factory(
    cfg: &YcsbConfig,
    setup: &UdpSetup,
    needed: u64,
) -> anyhow::Result<StoreFactory> {
    let connect = {
        let setup = setup.clone();
        move || setup.connect()
    };
    let naming = cfg.workload.naming;
    // A table too small for the run would lose records (MICA's log wraps) or fill up (the
    // B-tree): refuse before loading anything.
    let held = setup.holds()?;
    if needed > held {
        bail!(
            "naam-server {}'s {} app {} holds about {held} items; this run needs {needed} \
             there ({} records in all plus the inserts it may make): give it `{} = {needed}` \
             or more in naam-server's config, or load fewer records",
            setup.config.server,
            cfg.app.kind(),
            setup.app.id,
            cfg.records,
            match cfg.app {
                App::Mica => "items",
                App::Btree => "keys",
            }
        );
    }
    let pipeline = cfg.pipeline;
    let make: StoreFactory = match cfg.app {
        App::Mica if pipeline > 1 => {
            let handle = setup.mica()?;
            let fl = cfg.shape.field_length;
            Arc::new(move || {
                Ok(Box::new(Piped(MicaPipeStore::new(
                    MicaPipeline::new(connect()?, handle),
                    fl,
                    naming,
                ))) as Box<dyn Store + Send>)
            })
        }
        App::Mica => {
            let handle = setup.mica()?;
            let fl = cfg.shape.field_length;
            Arc::new(move || {
                Ok(Box::new(MicaStore::new(
                    MicaClient::new(connect()?, handle),
                    fl,
                    naming,
                )) as Box<dyn Store + Send>)
            })
        }
        App::Btree if pipeline > 1 => {
            let handle = setup.btree()?;
            Arc::new(move || {
                Ok(Box::new(Piped(BTreePipeStore::new(
                    BTreePipeline::new(connect()?, handle),
                    naming,
                ))) as Box<dyn Store + Send>)
            })
        }
        App::Btree => {
            let handle = setup.btree()?;
            Arc::new(move || {
                Ok(Box::new(BTreeStore {
                    t: BTreeClient::new(connect()?, handle),
                    naming,
                }) as Box<dyn Store + Send>)
            })
        }
    };
    Ok(make)
}

/// What every UDP client thread of a run shares: the server's app, the handler object it runs,
/// the client settings and the metrics the clients record into.
#[derive(Clone)]
pub struct UdpSetup {
    /// The served app used.
    pub app: naam_runtime::proto::control::AppManifest,
    /// Everything the server serves.
    pub manifest: Arc<naam_runtime::proto::control::Manifest>,
    /// Latency and placement of every call.
    pub metrics: Arc<naam_runtime::Metrics>,
    config: naam_runtime::udp::UdpConfig,
    object: Arc<Vec<u8>>,
    /// The RDMA device clients read the server's memory through (`--fabric rdma`).
    pub rdma: Option<RdmaDevice>,
}

/// An open RDMA device (`--fabric rdma`).
#[cfg(feature = "verbs")]
pub type RdmaDevice = Arc<naam_runtime::verbs::Device>;
/// Built without the `verbs` feature there is no RDMA device to hold.
#[cfg(not(feature = "verbs"))]
pub type RdmaDevice = std::convert::Infallible;

/// Opens the RDMA device for `--fabric rdma`, or says why there is none.
pub fn rdma_device() -> anyhow::Result<RdmaDevice> {
    #[cfg(feature = "verbs")]
    {
        naam_runtime::verbs::Device::open(None).context("--fabric rdma")
    }
    #[cfg(not(feature = "verbs"))]
    {
        bail!(
            "--fabric rdma: naam-bench was built without RDMA verbs; build it with \
             `cargo build --release -p naam-bench --features verbs` (needs libibverbs-dev)"
        )
    }
}

impl UdpSetup {
    /// Asks the server at `server` what it serves and finds `app`'s handler object: the
    /// server's own file when this machine sees it (same build), else a local build, which must
    /// hash the same.
    pub fn new(
        app: App,
        server: std::net::SocketAddr,
        pin: Option<Placement>,
    ) -> anyhow::Result<UdpSetup> {
        let mut config = crate::udp_client::config(server, app.kind())?;
        config.pin = pin;
        Self::with_config(app, config)
    }

    /// As [`UdpSetup::new`], with every client set up as `config` says.
    pub fn with_config(app: App, config: naam_runtime::udp::UdpConfig) -> anyhow::Result<UdpSetup> {
        use naam_runtime::udp::UdpClient;
        let (kind, server) = (app.kind(), config.server);
        let probe = UdpClient::connect(&config)?;
        let served = probe
            .manifest()
            .app_of_kind(kind)
            .with_context(|| format!("naam-server at {server} serves no {kind} app"))?
            .clone();
        // The Client placement runs the server's handlers here: the object this binary carries
        // if it is the server's, else the server's file if this machine can read it.
        let carried = match app {
            App::Mica => naam_mica::HANDLERS_OBJECT,
            App::Btree => naam_btree::HANDLERS_OBJECT,
        };
        let hash = naam_runtime::proto::control::object_hash;
        let object = if hash(carried) == served.object_hash {
            carried.to_vec()
        } else {
            match std::fs::read(&served.object) {
                Ok(b) if hash(&b) == served.object_hash => b,
                _ => bail!(
                    "naam-server at {server} serves {kind} handlers this binary does not carry \
                     (object hash {:016x}, {} here): run a naam-bench built from the same \
                     source as the server",
                    served.object_hash,
                    format_args!("{:016x}", hash(carried)),
                ),
            }
        };
        Ok(UdpSetup {
            app: served,
            manifest: Arc::new(probe.manifest().clone()),
            metrics: Arc::new(naam_runtime::Metrics::default()),
            config,
            object: Arc::new(object),
            rdma: None,
        })
    }

    /// A connected client with the app's handlers installed.
    pub fn connect(&self) -> anyhow::Result<naam_runtime::udp::UdpClient> {
        self.connect_apps(&[self.app.id])
    }

    /// A connected client with the handlers of `apps` installed (apps of the same kind, built
    /// from the same object).
    pub fn connect_apps(&self, apps: &[u32]) -> anyhow::Result<naam_runtime::udp::UdpClient> {
        let mut c =
            naam_runtime::udp::UdpClient::connect(&self.config)?.with_metrics(self.metrics.clone());
        for &app in apps {
            c.install_handlers(app, &self.object)?;
        }
        #[cfg(feature = "verbs")]
        if let Some(dev) = &self.rdma {
            c.use_rdma(dev)
                .context("connecting an RDMA queue pair to naam-server")?;
        }
        Ok(c)
    }

    /// The MICA handle of the served table.
    pub fn mica(&self) -> anyhow::Result<MicaHandle> {
        Self::mica_of(&self.app)
    }

    /// The MICA handle of served table `app`.
    pub fn mica_of(app: &naam_runtime::proto::control::AppManifest) -> anyhow::Result<MicaHandle> {
        let mc: MicaConfig = serde_json::from_value(app.params.clone())
            .with_context(|| format!("app {}: the server's MICA parameters", app.id))?;
        MicaHandle::with_keys(app.id, mc, |n| app.region_key(n))
            .with_context(|| format!("app {}: MICA regions in the manifest", app.id))
    }

    /// About how many items the served app holds (MICA: live items; the B-tree: keys).
    pub fn holds(&self) -> anyhow::Result<u64> {
        Ok(match self.app.kind.as_str() {
            "mica" => {
                let mc: MicaConfig = serde_json::from_value(self.app.params.clone())
                    .context("the server's MICA parameters")?;
                mc.items()
            }
            _ => {
                let bc: BTreeConfig = serde_json::from_value(self.app.params.clone())
                    .context("the server's B-tree parameters")?;
                bc.keys()
            }
        })
    }

    /// The B-tree handle of the served tree.
    pub fn btree(&self) -> anyhow::Result<BTreeHandle> {
        let bc: BTreeConfig = serde_json::from_value(self.app.params.clone())
            .context("the server's B-tree parameters")?;
        BTreeHandle::with_keys(self.app.id, bc, |n| self.app.region_key(n))
            .context("B-tree regions in the manifest")
    }
}

/// Mode label of `--fabric rdma` runs.
pub const RDMA_MODE: &str = "rdma (requests over UDP to naam-server; Client-placement READs over \
                             RDMA verbs to its registered memory; NIC cores emulated by naam-nic)";

/// Mode label of in-process runs.
pub const INPROC_MODE: &str = "inproc (one process; NIC cores, DMA and one-sided RDMA emulated)";

/// Load, then run (or one of them, as `cfg.run.phases` says), with stores from `make`;
/// per-placement figures from `metrics` if given.
pub(crate) fn run_phases(
    cfg: &YcsbConfig,
    make: StoreFactory,
    metrics: Option<&naam_runtime::Metrics>,
    progress: &(dyn Fn(u64, u64) + Sync),
    mode: &str,
) -> anyhow::Result<YcsbResult> {
    use crate::phase::{run_phase, PhaseKind, PhasePlan};
    let plan = |kind| PhasePlan {
        kind,
        ops: cfg.ops,
        threads: cfg.threads,
        workload: &cfg.workload,
        records: cfg.records,
        shape: cfg.shape,
        write_all_fields: cfg.run.write_all_fields,
        seed: match kind {
            PhaseKind::Load { .. } => cfg.seed ^ 0x10ad,
            PhaseKind::Run => cfg.seed,
        },
        target_ops_per_sec: cfg.run.target_ops_per_sec,
        max_execution_time: cfg.run.max_execution_time_s.map(Duration::from_secs_f64),
        status_interval: cfg.run.status_interval,
        hdr_log: cfg.run.hdr_log.as_deref(),
        pipeline: cfg.pipeline,
    };
    let summaries = |ops: &[(Op, crate::phase::OpStats)]| -> Vec<OpSummary> {
        ops.iter()
            .filter(|(_, s)| !s.latency.is_empty() || s.errors > 0)
            .map(|(op, s)| OpSummary::of(*op, s, &cfg.run.percentiles))
            .collect()
    };
    // Operations that succeeded, each once (a read-modify-write is also counted under READ
    // and UPDATE, as YCSB reports it).
    let succeeded = |ops: &[(Op, crate::phase::OpStats)]| -> u64 {
        let all: u64 = ops.iter().map(|(_, s)| s.latency.len()).sum();
        let rmw: u64 = ops
            .iter()
            .filter(|(op, _)| *op == Op::Rmw)
            .map(|(_, s)| s.latency.len())
            .sum();
        all - 2 * rmw
    };
    let mut load = None;
    if cfg.run.phases != Phases::Run {
        let kind = PhaseKind::Load {
            start: cfg.run.insert_start,
            count: cfg.run.insert_count.unwrap_or(cfg.records),
        };
        let outcome = run_phase(&plan(kind), &make, &|_, _| {})?;
        load = Some(PhaseSummary {
            seconds: outcome.seconds,
            throughput: succeeded(&outcome.ops) as f64 / outcome.seconds,
            ops: summaries(&outcome.ops),
            timed_out: outcome.timed_out,
            interrupted: outcome.interrupted,
        });
    }
    let load_throughput = load.as_ref().map_or(0.0, |l| l.throughput);
    let empty = |load: Option<PhaseSummary>| YcsbResult {
        mode: mode.to_string(),
        config: cfg.clone(),
        interrupted: load.as_ref().is_some_and(|l| l.interrupted),
        load,
        ran: false,
        timed_out: false,
        load_throughput,
        throughput: 0.0,
        seconds: 0.0,
        ops: Vec::new(),
        placements: naam_runtime::Metrics::default().snapshot(),
        placement_fractions: [0.0; 3],
        misses: 0,
        all: Percentiles::of(&crate::phase::histogram()),
        transport: Default::default(),
    };
    if cfg.run.phases == Phases::Load || load.as_ref().is_some_and(|l| l.interrupted) {
        return Ok(empty(load));
    }
    if cfg.run.phases == Phases::Both {
        // Let steering settle on the loaded table, then measure the run phase alone.
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(m) = metrics {
        m.reset();
    }
    let outcome = run_phase(&plan(PhaseKind::Run), &make, progress)?;
    let mut every = crate::phase::histogram();
    for (_, s) in &outcome.ops {
        every.add(&s.latency).expect("same bounds");
    }
    let placements = match metrics {
        Some(m) => m.snapshot(),
        None => naam_runtime::Metrics::default().snapshot(),
    };
    let transport = metrics.map(|m| m.transport()).unwrap_or_default();
    let fractions = [0, 1, 2].map(|i| placements.fraction(Placement::ALL[i]));
    Ok(YcsbResult {
        ran: true,
        transport,
        timed_out: outcome.timed_out,
        interrupted: outcome.interrupted,
        throughput: succeeded(&outcome.ops) as f64 / outcome.seconds,
        seconds: outcome.seconds,
        ops: summaries(&outcome.ops),
        placement_fractions: fractions,
        placements,
        misses: outcome.ops.iter().map(|(_, s)| s.not_found).sum(),
        all: Percentiles::of(&every),
        ..empty(load)
    })
}
