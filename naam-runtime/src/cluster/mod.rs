//! The in-process cluster (`inproc` mode): host executor threads, NIC executor threads, the
//! one-sided agent and a steering controller in one process, joined by bounded crossbeam queues.
//! It is the embedded default that the demo and benchmarks run and that tests use.
//!
//! NIC cores, DMA and RDMA are emulated here: NIC executors are ordinary threads on this
//! machine's cores that copy data through [`NicPath`] and, when [`NicModel::emulate_costs`] is
//! set, busy-wait the modelled DMA time and the Arm-core slowdown; the one-sided agent is a
//! thread that serves READs from region memory. Everything the cluster reports is labelled
//! `inproc`.
//!
//! Roles, as on real hardware: the client picks Client vs server for each read message from the
//! steering weights; the switch ([`Cluster::route`]) splits server messages between Host and NIC
//! and sends writes to the app's write owner; executors run the sans-IO [`StepMachine`] through
//! [`run_message`]; the controller samples load every period and publishes new weights.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, Sender};
use naam_ebpf::abi::Descriptor;

use crate::clock::{Clock, Nanos, SystemClock};
use crate::engine::Vm;
use crate::executor::{
    self, apply_writes, one_sided_read, run_message, ClientPath, DataPath, DmaModel, Driven,
    FetchError, HostPath, Limits, NicPath, OneSided, Outcome, ParkedRun, RunCost, WriteError,
};
use crate::fair::{FairQueue, PushError};
use crate::loader::LoadedObject;
use crate::metrics::Metrics;
use crate::placement::Placement;
use crate::region::{RegionMemory, RegionTable, ResolveError};
use crate::registry::{HandlerEntry, HandlerKind, HandlerSpec, Registry, RegistryError};
pub use crate::steering::Selector;

#[cfg(feature = "async")]
mod async_client;
use crate::steering::{
    AppView, ClientShare, Controller, ControllerConfig, CostPolicy, CostPolicyConfig, Ewma,
    HandlerKey, HandlerLoad, HandlerView, LoadTracker, Observe, Policy, RemoteLoad, StaticPolicy,
    SteeringInputs, Weights,
};
use crate::verifier::VerifierConfig;
use crate::wire::{Descriptors, LoadFeedback, Reply, Request, Status, WireError};
#[cfg(feature = "async")]
pub use async_client::AsyncClient;
use naam_proto::dedup::RecentAnswers;

/// A region to register for an app.
#[derive(Clone, Debug)]
pub struct RegionSpec {
    /// Name (clients look the rkey up by it).
    pub name: String,
    /// `ACCESS_*` rights.
    pub access: u32,
    /// Initial contents (its length is the region size).
    pub contents: Vec<u8>,
}

/// An app to install.
#[derive(Clone, Debug)]
pub struct AppSpec {
    /// App id.
    pub id: u32,
    /// Name.
    pub name: String,
    /// Placement applying its writes (Host or Nic).
    pub owner: Placement,
    /// Its regions.
    pub regions: Vec<RegionSpec>,
    /// The object holding its handlers.
    pub object: Arc<LoadedObject>,
    /// Handlers to register from the object.
    pub handlers: Vec<HandlerSpec>,
}

impl AppSpec {
    /// Every handler of the app on `engine` (the JIT is the default).
    pub fn with_engine(mut self, engine: crate::engine::EngineKind) -> Self {
        for h in &mut self.handlers {
            h.engine = engine;
        }
        self
    }

    /// Every handler of the app with an instruction budget of `budget` per step.
    pub fn with_budget(mut self, budget: u64) -> Self {
        for h in &mut self.handlers {
            h.budget = budget;
        }
        self
    }
}

/// Which steering policy the cluster runs.
#[derive(Clone, Copy, Debug)]
pub enum PolicyChoice {
    /// The cost policy.
    Auto(CostPolicyConfig),
    /// Always one placement (reads); writes at their owner.
    Always(Placement),
}

impl PolicyChoice {
    fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyChoice::Auto(c) => Box::new(CostPolicy::new(c)),
            PolicyChoice::Always(p) => Box::new(StaticPolicy(p)),
        }
    }
}

/// How NIC cores are emulated.
#[derive(Clone, Copy, Debug)]
pub struct NicModel {
    /// DMA cost per access.
    pub dma: DmaModel,
    /// Handler run time on a NIC core relative to a host core (BlueField-2's Arm A72 cores at
    /// 2.0–2.75 GHz against a server x86 core: about 2×, a model, not a measurement).
    pub core_slowdown: f64,
    /// Busy-wait the modelled costs so wall-clock figures include them.
    pub emulate_costs: bool,
}

impl Default for NicModel {
    fn default() -> Self {
        NicModel {
            dma: DmaModel::default(),
            core_slowdown: 2.0,
            emulate_costs: true,
        }
    }
}

/// Cluster settings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Host executor threads.
    pub host_executors: usize,
    /// NIC executor threads.
    pub nic_executors: usize,
    /// Capacity of each executor queue (back-pressure beyond it).
    pub queue_capacity: usize,
    /// Steering policy.
    pub policy: PolicyChoice,
    /// NIC emulation.
    pub nic: NicModel,
    /// Per-message bounds.
    pub limits: Limits,
    /// Steering decision period.
    pub steering_period: Duration,
    /// How long a client waits for a reply.
    pub client_timeout: Duration,
    /// Verifier settings for handlers.
    pub verifier: VerifierConfig,
    /// The NIC placement (executors and one-sided agent) runs in another process
    /// (`naam-nic`): reads routed to it come back from [`Cluster::dispatch`] for the caller to
    /// forward, its load arrives through [`Cluster::absorb_remote_load`], and it counts as down
    /// when its reports stop for [`REMOTE_SILENCE`].
    pub remote_nic: bool,
    /// Run the steering controller (off in a NIC process, which reports its load instead).
    pub controller: bool,
    /// Clients reach this cluster over a fabric (naam-server): what they report of their own
    /// executions is unproven and describes them alone, so the controller decides only the
    /// split between Host and NIC, and each client's Client share is decided from its own
    /// reports ([`Cluster::client_weights`]). In-process clients share one view instead.
    pub remote_clients: bool,
    /// How long an idle executor polls its queue before it parks. Parking costs a wake-up of
    /// several microseconds on the next message; polling costs the core. 20 µs suits the
    /// in-process cluster, whose many emulated threads share few cores; a server process whose
    /// host executors have cores to themselves polls longer.
    pub executor_poll: Duration,
    /// Replay sampled steps of every executor and client VM as aarch64 code under qemu and
    /// record differences (tests of the aarch64 JIT over real workloads; off by default).
    pub cross_check: Option<Arc<crate::cross::CrossCheck>>,
    /// What one app may spend per period before its new messages are refused `Busy`: bounds
    /// the harm one tenant's torn records or retry storms do to the others.
    pub tenant_budget: TenantBudget,
}

/// How long a remote NIC may stay silent before the controller takes it out of the weights.
pub const REMOTE_SILENCE: Duration = Duration::from_millis(30);

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            host_executors: 1,
            nic_executors: 1,
            queue_capacity: 4096,
            policy: PolicyChoice::Auto(CostPolicyConfig::default()),
            nic: NicModel::default(),
            limits: Limits::default(),
            steering_period: Duration::from_millis(1),
            client_timeout: Duration::from_secs(5),
            verifier: VerifierConfig::default(),
            remote_nic: false,
            controller: true,
            remote_clients: false,
            executor_poll: POLL_BEFORE_BLOCKING,
            cross_check: None,
            tenant_budget: TenantBudget::default(),
        }
    }
}

impl ClusterConfig {
    /// The defaults with the NIC's modelled costs not busy-waited: runs that check answers,
    /// not wall-clock figures (the model still steers).
    pub fn functional() -> Self {
        ClusterConfig {
            nic: NicModel {
                emulate_costs: false,
                ..NicModel::default()
            },
            ..ClusterConfig::default()
        }
    }
}

/// Why a cluster could not be built or an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Registering an app or handler failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A thread could not be started.
    #[error("starting thread {0}: {1}")]
    Thread(String, std::io::Error),
    /// Unknown app.
    #[error("no app {0}")]
    UnknownApp(u32),
    /// The owner handoff did not drain in time.
    #[error("write owner handoff of app {0} did not drain in-flight writes within {1:?}")]
    HandoffTimeout(u32, Duration),
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Region memory could not be provided.
    #[error("region {region} of app {app}: {message}")]
    Region {
        /// App.
        app: u32,
        /// Region name.
        region: String,
        /// What failed.
        message: String,
    },
}

/// Torn-read retries and steps one app may spend per period at this cluster's executors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantBudget {
    /// Length of a period.
    pub period: Duration,
    /// Torn-read retries per period; past it, the app's retrying messages fail `Refused`
    /// and its new messages are refused `Busy` until the period ends.
    pub retries: u64,
    /// Steps per period (retries included); past it, new messages are refused `Busy`.
    pub steps: u64,
}

impl Default for TenantBudget {
    /// 2,000 retries and 4 million steps per 100 ms: far above what a healthy app needs (torn
    /// reads are rare: 20,000 retries a second is 1% of the paper's MICA rate; 4 M steps per
    /// 100 ms is 20 times that rate), far below what starves the executors.
    fn default() -> Self {
        TenantBudget {
            period: Duration::from_millis(100),
            retries: 2_000,
            steps: 4_000_000,
        }
    }
}

/// What one app spent in the current period.
#[derive(Debug, Default)]
struct Spent {
    since: Nanos,
    retries: u64,
    steps: u64,
}

/// Why a client call produced no reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The placement's queue is full: back-pressure, try again later.
    #[error("the {0} queue is full (back-pressure); retry later")]
    Busy(Placement),
    /// No reply within the timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The cluster is shutting down.
    #[error("the cluster is shut down")]
    Shutdown,
    /// The request does not fit the wire format.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The server has answered nothing for longer than the client's liveness bound.
    #[error("the server has not answered for {silent:?} (over the liveness bound of {bound:?}): it is down or unreachable")]
    ServerGone {
        /// How long it has been silent.
        silent: Duration,
        /// The bound.
        bound: Duration,
    },
    /// The session could not be set up again (after the server restarted or forgot it).
    #[error("setting up a session again: {0}")]
    Session(String),
}

enum ReplySink {
    Sync(Sender<Reply>),
    #[cfg(feature = "async")]
    Async(tokio::sync::oneshot::Sender<Reply>),
    /// A fabric driver's callback (sends the reply back over the network).
    Func(Box<dyn FnOnce(Reply) + Send>),
}

impl ReplySink {
    fn send(self, r: Reply) {
        // A caller that gave up (timeout, dropped future) is not an error for the executor.
        match self {
            ReplySink::Sync(s) => {
                let _ = s.try_send(r);
            }
            #[cfg(feature = "async")]
            ReplySink::Async(s) => {
                let _ = s.send(r);
            }
            ReplySink::Func(f) => f(r),
        }
    }
}

struct Job {
    req: Request,
    enqueued: Nanos,
    sink: ReplySink,
}

type AgentResult = Result<Vec<Vec<u8>>, ResolveError>;

enum AgentSink {
    Sync(Sender<AgentResult>),
    #[cfg(feature = "async")]
    Async(tokio::sync::oneshot::Sender<AgentResult>),
}

struct AgentJob {
    app: u32,
    descs: Descriptors,
    bufs: Vec<Vec<u8>>,
    sink: AgentSink,
}

/// Write ownership of one app.
struct Owner {
    placement: AtomicU8,
    draining: AtomicBool,
    inflight: AtomicU32,
    epoch: AtomicU64,
}

enum Dedup {
    Pending,
    Done(Outcome),
}

/// Answers to one app's writes by (origin session, request id).
type DedupTable = RecentAnswers<(u64, u64), Dedup>;

/// Takes host executor capacity away, for experiments.
#[derive(Default)]
pub struct CongestionInjector {
    host_extra_ns: AtomicU64,
    hog_stop: Arc<AtomicBool>,
    hogs: Mutex<Vec<JoinHandle<()>>>,
}

/// How long a waiting thread polls before it blocks: a parked thread costs microseconds to
/// wake, more than a whole in-process round trip.
const POLL_BEFORE_BLOCKING: Duration = Duration::from_micros(20);

/// Receives from `rx`, polling for [`POLL_BEFORE_BLOCKING`] before blocking up to `timeout`.
fn recv_polling<T>(
    rx: &Receiver<T>,
    timeout: Duration,
) -> Result<T, crossbeam_channel::RecvTimeoutError> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                return Err(crossbeam_channel::RecvTimeoutError::Disconnected)
            }
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        let waited = start.elapsed();
        if waited >= POLL_BEFORE_BLOCKING {
            return rx.recv_timeout(timeout.saturating_sub(waited));
        }
        std::hint::spin_loop();
    }
}

fn spin_for(ns: u64) {
    if ns == 0 {
        return;
    }
    let t = Instant::now();
    while (t.elapsed().as_nanos() as u64) < ns {
        std::hint::spin_loop();
    }
}

impl CongestionInjector {
    /// Capacity limit: every host executor spends `ns` extra (busy) per message.
    pub fn limit_host(&self, extra_ns_per_message: u64) {
        self.host_extra_ns
            .store(extra_ns_per_message, Ordering::SeqCst);
    }

    /// Starts `threads` CPU hogs that compete with every thread for cores until [`clear`].
    ///
    /// [`clear`]: CongestionInjector::clear
    pub fn start_cpu_hogs(&self, threads: usize) {
        self.hog_stop.store(false, Ordering::SeqCst);
        let mut hogs = self.hogs.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..threads {
            let stop = self.hog_stop.clone();
            hogs.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            }));
        }
    }

    /// Ends every injected congestion.
    pub fn clear(&self) {
        self.host_extra_ns.store(0, Ordering::SeqCst);
        self.hog_stop.store(true, Ordering::SeqCst);
        let hogs = std::mem::take(&mut *self.hogs.lock().unwrap_or_else(|e| e.into_inner()));
        for h in hogs {
            let _ = h.join();
        }
    }

    /// Extra nanoseconds per host message currently injected.
    pub fn host_extra_ns(&self) -> u64 {
        self.host_extra_ns.load(Ordering::SeqCst)
    }
}

struct Inner {
    config: ClusterConfig,
    clock: Arc<dyn Clock>,
    regions: Arc<RegionTable>,
    registry: Registry,
    region_keys: HashMap<(u32, String), u64>,
    /// Executor queues per placement, fair between apps ([`FairQueue`]).
    queues: [Option<Arc<FairQueue<Job>>>; 3],
    agent: Sender<AgentJob>,
    trackers: [Mutex<LoadTracker>; 3],
    weights: RwLock<HashMap<HandlerKey, Weights>>,
    /// With remote clients: the signals of each handler's latest decision, and the inputs it
    /// was decided with, from which each client's own Client share is decided.
    signals: RwLock<(SteeringInputs, HashMap<HandlerKey, HandlerLoad>)>,
    owners: HashMap<u32, Owner>,
    dedup: HashMap<u32, Mutex<DedupTable>>,
    /// Per app: what it spent of [`ClusterConfig::tenant_budget`] this period.
    spent: HashMap<u32, Mutex<Spent>>,
    client_rtt: Mutex<Ewma>,
    metrics: Metrics,
    congestion: CongestionInjector,
    shutdown: AtomicBool,
    next_client: AtomicU32,
    policy_name: String,
    remote_nic_up: AtomicBool,
    remote_nic_seen: AtomicU64,
}

impl Inner {
    /// Adds to `app`'s spending in the current period (a new period starts afresh).
    fn spend(&self, app: u32, retries: u64, steps: u64) {
        if let Some(m) = self.spent.get(&app) {
            let now = self.clock.now();
            let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
            if now.saturating_sub(s.since) >= self.config.tenant_budget.period.as_nanos() as u64 {
                *s = Spent {
                    since: now,
                    ..Spent::default()
                };
            }
            s.retries += retries;
            s.steps += steps;
        }
    }

    /// Which of `app`'s budgets is spent for the rest of the period, if one is.
    fn over_budget(&self, app: u32) -> Option<&'static str> {
        let m = self.spent.get(&app)?;
        let s = m.lock().unwrap_or_else(|e| e.into_inner());
        let b = self.config.tenant_budget;
        if self.clock.now().saturating_sub(s.since) >= b.period.as_nanos() as u64 {
            return None;
        }
        if s.retries >= b.retries {
            Some("torn-read retries")
        } else if s.steps >= b.steps {
            Some("steps")
        } else {
            None
        }
    }

    fn owner_of(&self, app: u32) -> Option<Placement> {
        self.owners
            .get(&app)
            .and_then(|o| Placement::from_abi(o.placement.load(Ordering::SeqCst) as u32))
    }

    fn weights(&self, key: HandlerKey) -> Weights {
        self.weights
            .read()
            .ok()
            .and_then(|w| w.get(&key).copied())
            .unwrap_or(Weights::all(Placement::Host))
    }

    /// Whether `p` can take server messages: a local queue, or a remote NIC that reports.
    fn available(&self, p: Placement) -> bool {
        self.queues[p.index()].is_some()
            || (p == Placement::Nic
                && self.config.remote_nic
                && self.remote_nic_up.load(Ordering::SeqCst))
    }

    /// Whether the one-sided agent clients read from is up.
    fn agent_available(&self) -> bool {
        !self.config.remote_nic || self.remote_nic_up.load(Ordering::SeqCst)
    }

    fn lock_tracker(&self, p: Placement) -> std::sync::MutexGuard<'_, LoadTracker> {
        self.trackers[p.index()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// A running in-process cluster. Dropping it shuts it down.
pub struct Cluster {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

/// Provides the memory of one region of an app: `(memory, rkey)`; `None` picks a fresh random
/// rkey.
pub type RegionBackingFn =
    dyn FnMut(u32, &RegionSpec) -> Result<(RegionMemory, Option<u64>), ClusterError>;

/// A boxed [`RegionBackingFn`].
pub type RegionBacking = Box<RegionBackingFn>;

/// Builds a [`Cluster`].
#[derive(Default)]
pub struct ClusterBuilder {
    config: ClusterConfig,
    apps: Vec<AppSpec>,
    clock: Option<Arc<dyn Clock>>,
    backing: Option<RegionBacking>,
}

impl ClusterBuilder {
    /// Defaults: one host and one NIC executor, the cost policy, a 1 ms steering period.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: ClusterConfig) -> Self {
        self.config = config;
        self
    }

    /// Adds an app.
    pub fn app(mut self, app: AppSpec) -> Self {
        self.apps.push(app);
        self
    }

    /// Host executor threads.
    pub fn host_executors(mut self, n: usize) -> Self {
        self.config.host_executors = n;
        self
    }

    /// NIC executor threads.
    pub fn nic_executors(mut self, n: usize) -> Self {
        self.config.nic_executors = n;
        self
    }

    /// Steering policy.
    pub fn policy(mut self, p: PolicyChoice) -> Self {
        self.config.policy = p;
        self
    }

    /// Executor queue capacity.
    pub fn queue_capacity(mut self, n: usize) -> Self {
        self.config.queue_capacity = n;
        self
    }

    /// NIC emulation model.
    pub fn nic_model(mut self, m: NicModel) -> Self {
        self.config.nic = m;
        self
    }

    /// Uses `clock` instead of the OS clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Takes region memory from `backing` (shared memory for a NIC process) instead of the heap.
    pub fn region_backing(mut self, backing: RegionBacking) -> Self {
        self.backing = Some(backing);
        self
    }

    /// Registers everything and starts the threads.
    pub fn build(self) -> Result<Cluster, ClusterError> {
        let config = self.config;
        if config.queue_capacity == 0 {
            return Err(ClusterError::Config(
                "queue capacity must be at least 1".into(),
            ));
        }
        let clock = self.clock.unwrap_or_else(|| Arc::new(SystemClock::new()));
        let mut backing = self.backing.unwrap_or_else(|| {
            Box::new(|_, r: &RegionSpec| Ok((RegionMemory::from_bytes(&r.contents), None)))
        });
        let Installed {
            regions,
            registry,
            region_keys,
        } = install_with(&self.apps, &config.verifier, &mut *backing)?;
        if config.remote_nic && self.apps.iter().any(|a| a.owner == Placement::Nic) {
            return Err(ClusterError::Config(
                "with a remote NIC, writes are owned by the host (owner = host)".into(),
            ));
        }
        let mut owners = HashMap::new();
        let mut dedup = HashMap::new();
        let mut spent = HashMap::new();
        for app in &self.apps {
            owners.insert(
                app.id,
                Owner {
                    placement: AtomicU8::new(app.owner.abi() as u8),
                    draining: AtomicBool::new(false),
                    inflight: AtomicU32::new(0),
                    epoch: AtomicU64::new(0),
                },
            );
            dedup.insert(app.id, Mutex::new(DedupTable::default()));
            spent.insert(app.id, Mutex::new(Spent::default()));
        }
        let now = clock.now();
        let host_q = Arc::new(FairQueue::new(config.queue_capacity));
        let nic_q = Arc::new(FairQueue::new(config.queue_capacity));
        let (agent_tx, agent_rx) = bounded::<AgentJob>(config.queue_capacity);
        let policy = config.policy.build();
        let policy_name = policy.name();
        let inner = Arc::new(Inner {
            trackers: [
                Mutex::new(LoadTracker::new(1, now)),
                Mutex::new(LoadTracker::new(config.nic_executors as u32, now)),
                Mutex::new(LoadTracker::new(config.host_executors as u32, now)),
            ],
            queues: [
                None,
                (config.nic_executors > 0).then(|| nic_q.clone()),
                (config.host_executors > 0).then(|| host_q.clone()),
            ],
            config,
            clock,
            regions: Arc::new(regions),
            registry,
            region_keys,
            agent: agent_tx,
            weights: RwLock::new(HashMap::new()),
            signals: RwLock::new((SteeringInputs::default(), HashMap::new())),
            owners,
            dedup,
            spent,
            client_rtt: Mutex::new(Ewma::default()),
            metrics: Metrics::default(),
            congestion: CongestionInjector::default(),
            shutdown: AtomicBool::new(false),
            next_client: AtomicU32::new(1),
            policy_name,
            remote_nic_up: AtomicBool::new(false),
            remote_nic_seen: AtomicU64::new(0),
        });
        // First decision with no measurements.
        let mut controller = Controller::new(
            policy,
            ControllerConfig::new()
                .remote_clients(inner.config.remote_clients)
                .remote_nic(inner.config.remote_nic),
            now,
        );
        decide_all(&inner, &mut controller, true);
        let mut threads = Vec::new();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(f)
                .map_err(|e| ClusterError::Thread(name, e))
        };
        for i in 0..inner.config.host_executors {
            let (inner2, rx) = (inner.clone(), host_q.clone());
            threads.push(spawn(
                format!("naam-host-{i}"),
                Box::new(move || executor_loop(inner2, rx, Placement::Host)),
            )?);
        }
        for i in 0..inner.config.nic_executors {
            let (inner2, rx) = (inner.clone(), nic_q.clone());
            threads.push(spawn(
                format!("naam-nic-{i}"),
                Box::new(move || executor_loop(inner2, rx, Placement::Nic)),
            )?);
        }
        let inner2 = inner.clone();
        threads.push(spawn(
            "naam-one-sided-agent".into(),
            Box::new(move || agent_loop(inner2, agent_rx)),
        )?);
        if inner.config.controller {
            let inner2 = inner.clone();
            threads.push(spawn(
                "naam-steering".into(),
                Box::new(move || controller_loop(inner2, controller)),
            )?);
        }
        Ok(Cluster { inner, threads })
    }
}

/// Apps installed on a server: their regions, handlers, and rkeys by (app, region name).
pub struct Installed {
    /// Every region.
    pub regions: RegionTable,
    /// Every app and handler.
    pub registry: Registry,
    /// rkey of each (app, region name).
    pub region_keys: HashMap<(u32, String), u64>,
}

/// Registers `apps`: verifies and loads their handlers, registers their regions under fresh
/// rkeys.
pub fn install(apps: &[AppSpec], verifier: &VerifierConfig) -> Result<Installed, ClusterError> {
    install_with(apps, verifier, &mut |_, r| {
        Ok((RegionMemory::from_bytes(&r.contents), None))
    })
}

/// [`install`] with region memory (and optionally rkeys) from `backing`.
pub fn install_with(
    apps: &[AppSpec],
    verifier: &VerifierConfig,
    backing: &mut RegionBackingFn,
) -> Result<Installed, ClusterError> {
    let mut regions = RegionTable::new();
    let mut registry = Registry::new();
    let mut region_keys = HashMap::new();
    for app in apps {
        registry.add_app(app.id, &app.name, app.owner)?;
        registry.add_handlers(app.id, &app.object, &app.handlers, verifier)?;
        for r in &app.regions {
            let (mem, key) = backing(app.id, r)?;
            let region = match key {
                None => regions.register(app.id, &r.name, r.access, mem),
                Some(k) => regions
                    .register_with_key(k, app.id, &r.name, r.access, mem)
                    .ok_or_else(|| ClusterError::Region {
                        app: app.id,
                        region: r.name.clone(),
                        message: format!("rkey {k:#x} is 0 or already in use"),
                    })?,
            };
            region_keys.insert((app.id, r.name.clone()), region.rkey);
        }
    }
    Ok(Installed {
        regions,
        registry,
        region_keys,
    })
}

pub(crate) fn reply_for(
    req: &Request,
    c: &Outcome,
    placement: Placement,
    load: LoadFeedback,
) -> Reply {
    Reply {
        app: req.app,
        request_id: req.request_id,
        status: c.status,
        code: c.code,
        steps: c.steps,
        placement,
        load,
        payload: c.payload.clone(),
    }
}

pub(crate) fn error_reply(
    req: &Request,
    status: Status,
    placement: Placement,
    message: String,
) -> Reply {
    Reply {
        app: req.app,
        request_id: req.request_id,
        status,
        code: 0,
        steps: req.steps,
        placement,
        load: LoadFeedback::default(),
        payload: Bytes::from(message.into_bytes()),
    }
}

/// What serving a message left: an answer, or a message parked for a torn-read retry.
enum Served {
    /// The completion and the modelled fetch cost.
    Done(Outcome, u64),
    /// Waiting for its backoff; `write`: it holds its dedup entry and owner count.
    Parked { run: Box<ParkedRun>, write: bool },
}

/// Runs `req` on `path` until it completes or parks: reads anywhere, writes only at the owner
/// and once per (origin, request id).
fn serve<P: DataPath>(inner: &Inner, req: &Request, path: &mut P, vm: &mut Vm) -> Served {
    let placement = path.placement();
    let handler = match inner.registry.handler(req.app, req.handler) {
        Ok(h) => h.clone(),
        Err(e) => {
            let status = match e {
                crate::registry::LookupError::UnknownApp(_) => Status::UnknownApp,
                _ => Status::UnknownHandler,
            };
            return Served::Done(Outcome::error(status, 0, e.to_string(), req.steps), 0);
        }
    };
    let (limits, clock) = (inner.config.limits, inner.clock.as_ref());
    if handler.kind == HandlerKind::Read {
        let driven = executor::start(req, handler, path, vm, limits, clock, &mut |_| {
            Err(WriteError::NotOwner)
        });
        return served(inner, req, driven, false);
    }
    // Writes: only at the owner, once per (origin, request id).
    let refused = |c: Outcome| {
        release_owner(inner, req.app);
        Served::Done(c, 0)
    };
    if inner.owner_of(req.app) != Some(placement) {
        return refused(Outcome::error(
            Status::NotOwner,
            0,
            format!("{placement} does not own app {}'s writes", req.app),
            req.steps,
        ));
    }
    {
        let mut t = inner.dedup[&req.app]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let key = (req.origin, req.request_id);
        match t.get(&key) {
            Some(Dedup::Done(c)) => return refused(c.clone()),
            Some(Dedup::Pending) => {
                return refused(Outcome::error(
                    Status::Busy,
                    0,
                    "a write with this request id is in progress",
                    req.steps,
                ))
            }
            None => t.insert(key, Dedup::Pending),
        }
    }
    let regions = inner.regions.clone();
    let driven = executor::start(req, handler, path, vm, limits, clock, &mut |batch| {
        apply_writes(&regions, batch)
    });
    served(inner, req, driven, true)
}

/// Resumes a parked message, its backoff served. An app past its retry budget gets no more
/// retries: the message fails at once.
fn resume_served<P: DataPath>(
    inner: &Inner,
    req: &Request,
    run: Box<ParkedRun>,
    write: bool,
    path: &mut P,
    vm: &mut Vm,
) -> Served {
    if inner.over_budget(req.app) == Some("torn-read retries") {
        let c = Outcome::error(
            Status::Refused,
            0,
            format!(
                "app {} spent its torn-read retry budget for this period",
                req.app
            ),
            req.steps,
        );
        return served(inner, req, Driven::Done(c, RunCost::default()), write);
    }
    let clock = inner.clock.as_ref();
    let driven = if write {
        let regions = inner.regions.clone();
        executor::resume(run, path, vm, clock, &mut |batch| {
            apply_writes(&regions, batch)
        })
    } else {
        executor::resume(run, path, vm, clock, &mut |_| Err(WriteError::NotOwner))
    };
    served(inner, req, driven, write)
}

/// Books a driven message: a parked one counts a retry against its app; a finished write
/// records its answer for deduplication and leaves its owner's in-flight count.
fn served(inner: &Inner, req: &Request, driven: Driven, write: bool) -> Served {
    match driven {
        Driven::Parked(run) => {
            inner.spend(req.app, 1, 1);
            Served::Parked { run, write }
        }
        Driven::Done(c, cost) => {
            inner.spend(req.app, 0, c.steps as u64);
            if write {
                let mut t = inner.dedup[&req.app]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                t.insert((req.origin, req.request_id), Dedup::Done(c.clone()));
                drop(t);
                release_owner(inner, req.app);
            }
            Served::Done(c, cost.fetch_ns)
        }
    }
}

/// A write of `app` left its executor: the owner's in-flight count goes down.
fn release_owner(inner: &Inner, app: u32) {
    if let Some(o) = inner.owners.get(&app) {
        o.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A message parked at an executor, with what its reply needs.
struct ParkedJob {
    job: Job,
    run: Box<ParkedRun>,
    write: bool,
    /// Executor time spent on it so far (its service time excludes the backoffs).
    busy: Nanos,
    /// Modelled fetch cost so far.
    fetch_ns: u64,
}

fn executor_loop(inner: Arc<Inner>, rx: Arc<FairQueue<Job>>, placement: Placement) {
    let mut last_done: Nanos = 0;
    let mut vm = Vm::new();
    vm.set_cross_check(inner.config.cross_check.clone());
    let mut host = HostPath::new(inner.regions.clone());
    let mut nic = NicPath::new(inner.regions.clone(), inner.config.nic.dma);
    // Messages waiting out a torn-read backoff: never slept on, the executor serves others.
    let mut parked: Vec<ParkedJob> = Vec::new();
    // Due retries and queued messages take turns: retries never hold up the queue by more
    // than one step each, and a full queue never starves the retries.
    let mut retry_turn = false;
    loop {
        let now = inner.clock.now();
        retry_turn = !retry_turn;
        let due = parked
            .iter()
            .enumerate()
            .filter(|(_, p)| p.run.resume_at <= now)
            .min_by_key(|(_, p)| p.run.resume_at)
            .map(|(i, _)| i)
            .filter(|_| retry_turn || rx.is_empty());
        let (job, resumed) = match due {
            Some(i) => {
                let p = parked.swap_remove(i);
                (p.job, Some((p.run, p.write, p.busy, p.fetch_ns)))
            }
            None => {
                // Sleep no longer than until the next parked message is due.
                let next = parked.iter().map(|p| p.run.resume_at).min();
                let wait = next.map_or(Duration::from_millis(20), |t| {
                    Duration::from_nanos(t.saturating_sub(now)).min(Duration::from_millis(20))
                });
                let poll = inner.config.executor_poll.min(wait);
                match rx.pop_timeout(wait, poll) {
                    Some((_, j)) => (j, None),
                    None => {
                        if inner.shutdown.load(Ordering::SeqCst) {
                            rx.close();
                            let queued = rx.drain().into_iter().map(|(_, j)| j);
                            for job in parked.drain(..).map(|p| p.job).chain(queued) {
                                job.sink.send(error_reply(
                                    &job.req,
                                    Status::Unavailable,
                                    placement,
                                    "the cluster is shutting down".into(),
                                ));
                            }
                            return;
                        }
                        continue;
                    }
                }
            }
        };
        if inner.shutdown.load(Ordering::SeqCst) {
            job.sink.send(error_reply(
                &job.req,
                Status::Unavailable,
                placement,
                "the cluster is shutting down".into(),
            ));
            continue;
        }
        let start = inner.clock.now();
        if resumed.is_none() {
            let depth = rx.len() as u32;
            // Queueing delay is time spent behind other work. A message that arrived while this
            // executor was idle waited only for it to wake up, an artefact of emulating
            // executors as threads that park (real ones busy-poll); counting it would make
            // every idle placement look congested to its probes.
            let waited = if job.enqueued >= last_done {
                0
            } else {
                start.saturating_sub(job.enqueued)
            };
            inner.lock_tracker(placement).dequeued(waited, depth);
            if placement == Placement::Host {
                let extra = inner.congestion.host_extra_ns();
                spin_for(extra);
                inner.lock_tracker(placement).stolen(extra);
            }
        }
        let begin = inner.clock.now();
        let (busy_before, fetched_before) = resumed.as_ref().map_or((0, 0), |r| (r.2, r.3));
        let outcome = match (placement, resumed) {
            (Placement::Nic, None) => serve(&inner, &job.req, &mut nic, &mut vm),
            (Placement::Nic, Some((run, write, ..))) => {
                resume_served(&inner, &job.req, run, write, &mut nic, &mut vm)
            }
            (_, None) => serve(&inner, &job.req, &mut host, &mut vm),
            (_, Some((run, write, ..))) => {
                resume_served(&inner, &job.req, run, write, &mut host, &mut vm)
            }
        };
        let fetch_total = match &outcome {
            Served::Done(_, f) => *f,
            Served::Parked { run, .. } => run.fetch_ns(),
        };
        if placement == Placement::Nic && inner.config.nic.emulate_costs {
            let run = inner.clock.now().saturating_sub(begin);
            let slower = (run as f64 * (inner.config.nic.core_slowdown - 1.0).max(0.0)) as u64;
            spin_for(fetch_total.saturating_sub(fetched_before) + slower);
        }
        // Service time runs from dequeue: time taken away from the executor (a hog, a capacity
        // limit) is time this message spent at this placement; backoffs are not.
        let busy = busy_before + inner.clock.now().saturating_sub(start);
        let c = match outcome {
            Served::Parked { run, write } => {
                parked.push(ParkedJob {
                    job,
                    run,
                    write,
                    busy,
                    fetch_ns: fetch_total,
                });
                continue;
            }
            Served::Done(c, _) => c,
        };
        rx.record(job.req.app, busy);
        let load = {
            let mut t = inner.lock_tracker(placement);
            t.completed((job.req.app, job.req.handler), busy, c.steps);
            LoadFeedback {
                queue_depth: rx.len() as u32,
                utilisation_permille: (t.last_utilisation() * 1000.0).round() as u16,
                queue_delay_ns: t.queue_delay_ns() as u64,
                service_ns: busy,
            }
        };
        last_done = inner.clock.now();
        job.sink.send(reply_for(&job.req, &c, placement, load));
    }
}

fn agent_loop(inner: Arc<Inner>, rx: Receiver<AgentJob>) {
    loop {
        let mut job = match recv_polling(&rx, Duration::from_millis(20)) {
            Ok(j) => j,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if inner.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                continue;
            }
            Err(_) => return,
        };
        let n = job.descs.len();
        job.bufs.resize_with(n.max(job.bufs.len()), Vec::new);
        let r = one_sided_read(
            &inner.regions,
            job.app,
            job.descs.as_slice(),
            &mut job.bufs[..n],
        )
        .map(|()| job.bufs);
        match job.sink {
            AgentSink::Sync(s) => {
                let _ = s.try_send(r);
            }
            #[cfg(feature = "async")]
            AgentSink::Async(s) => {
                let _ = s.send(r);
            }
        }
    }
}

/// The cluster as the steering [`Controller`] observes it: trackers behind their locks, the
/// executors' queues, the registry's apps and their current owners.
struct Observed<'a>(&'a Inner);

impl Observe for Observed<'_> {
    fn with_tracker<R>(&mut self, p: Placement, f: impl FnOnce(&mut LoadTracker) -> R) -> R {
        f(&mut self.0.lock_tracker(p))
    }

    fn queued(&self, p: Placement) -> Option<(u32, u32)> {
        let executors = match p {
            Placement::Host => self.0.config.host_executors,
            _ => self.0.config.nic_executors,
        };
        self.0.queues[p.index()]
            .as_ref()
            .map(|q| (q.len() as u32, executors as u32))
    }

    fn available(&self, p: Placement) -> bool {
        match p {
            Placement::Client => self.0.agent_available(),
            _ => self.0.available(p),
        }
    }

    fn client_rtt_ns(&self) -> Option<f64> {
        self.0.client_rtt.lock().ok().and_then(|e| e.get())
    }

    fn apps(&self) -> Vec<AppView> {
        self.0
            .registry
            .apps()
            .map(|a| AppView {
                id: a.id,
                owner: self.0.owner_of(a.id),
                handlers: a
                    .handlers
                    .values()
                    .map(|h| HandlerView {
                        id: h.id,
                        read_only: h.kind == HandlerKind::Read,
                    })
                    .collect(),
            })
            .collect()
    }
}

/// One steering period: the controller decides, this publishes what changed and moves owners.
fn decide_all(inner: &Inner, controller: &mut Controller, full: bool) {
    let now = inner.clock.now();
    if inner.config.remote_nic
        && inner.remote_nic_up.load(Ordering::SeqCst)
        && now.saturating_sub(inner.remote_nic_seen.load(Ordering::SeqCst))
            > REMOTE_SILENCE.as_nanos() as u64
    {
        inner.remote_nic_up.store(false, Ordering::SeqCst);
    }
    let decisions = controller.tick(now, &mut Observed(inner), full);
    // Clients read the weights on every message: take the write lock only for real changes.
    let changed: Vec<_> = {
        let table = inner.weights.read().unwrap_or_else(|e| e.into_inner());
        decisions
            .weights
            .into_iter()
            .filter(|(k, w)| table.get(k) != Some(w))
            .collect()
    };
    if !changed.is_empty() {
        let mut table = inner.weights.write().unwrap_or_else(|e| e.into_inner());
        for (key, w) in changed {
            inner.metrics.record_weights(now, key, w);
            table.insert(key, w);
        }
    }
    if let Some((client_inputs, handlers)) = decisions.client_signals {
        let mut signals = inner.signals.write().unwrap_or_else(|e| e.into_inner());
        signals.0 = client_inputs;
        signals.1.extend(handlers);
    }
    for (app, to) in decisions.owner_moves {
        // A handoff that cannot drain in time is abandoned; a later decision may try again.
        let _ = move_owner(inner, app, to, OWNER_DRAIN_TIMEOUT);
    }
}

/// How long the controller waits for an owner handoff to drain.
const OWNER_DRAIN_TIMEOUT: Duration = Duration::from_millis(200);

/// Moves `app`'s write ownership to `to`: new writes get `Busy` while in-flight writes at the
/// old owner drain; then the owner changes and the epoch advances.
fn move_owner(
    inner: &Inner,
    app: u32,
    to: Placement,
    timeout: Duration,
) -> Result<u64, ClusterError> {
    if to == Placement::Client {
        return Err(ClusterError::Config("the client cannot own writes".into()));
    }
    if to == Placement::Nic && inner.config.remote_nic {
        // naam-nic serves forwarded reads and one-sided operations; writes stay at the host.
        return Err(ClusterError::Config(
            "the NIC runs in another process and cannot own writes".into(),
        ));
    }
    let o = inner
        .owners
        .get(&app)
        .ok_or(ClusterError::UnknownApp(app))?;
    o.draining.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + timeout;
    while o.inflight.load(Ordering::SeqCst) > 0 {
        if Instant::now() > deadline {
            o.draining.store(false, Ordering::SeqCst);
            return Err(ClusterError::HandoffTimeout(app, timeout));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    o.placement.store(to.abi() as u8, Ordering::SeqCst);
    let epoch = o.epoch.fetch_add(1, Ordering::SeqCst) + 1;
    o.draining.store(false, Ordering::SeqCst);
    Ok(epoch)
}

fn controller_loop(inner: Arc<Inner>, mut controller: Controller) {
    while !inner.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(inner.config.steering_period);
        decide_all(&inner, &mut controller, false);
    }
}

impl Cluster {
    /// A new builder.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::new()
    }

    /// The rkey of `app`'s region `name`.
    pub fn region_key(&self, app: u32, name: &str) -> Option<u64> {
        self.inner
            .region_keys
            .get(&(app, name.to_string()))
            .copied()
    }

    /// A copy of region memory (tests, inspection).
    pub fn region_snapshot(&self, app: u32, name: &str) -> Option<Vec<u8>> {
        let key = self.region_key(app, name)?;
        self.inner.regions.get(app, key).map(|r| r.mem.snapshot())
    }

    /// A synchronous client.
    pub fn client(&self) -> Client {
        let id = self.inner.next_client.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = bounded(64);
        Client {
            transport: ClientPath::new(AgentTransport::new(self.inner.clone())),
            inner: self.inner.clone(),
            id,
            seq: 0,
            tx,
            rx,
            vm: {
                let mut vm = Vm::new();
                vm.set_cross_check(self.inner.config.cross_check.clone());
                vm
            },
            selectors: HashMap::new(),
        }
    }

    /// Metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The congestion injector.
    pub fn congestion(&self) -> &CongestionInjector {
        &self.inner.congestion
    }

    /// Current weights of a handler.
    pub fn weights(&self, app: u32, handler: u32) -> Weights {
        self.inner.weights((app, handler))
    }

    /// A fresh view for one remote client's own Client share, when the policy steers by cost
    /// (`None` for static policies: every client follows [`Cluster::weights`]).
    pub fn client_share(&self) -> Option<ClientShare> {
        match self.inner.config.policy {
            PolicyChoice::Auto(c) if self.inner.config.remote_clients => Some(ClientShare::new(c)),
            _ => None,
        }
    }

    /// The weights of `app`'s `handler` for the remote client whose view is `share`: its own
    /// Client share, the rest split between Host and NIC as [`Cluster::weights`] splits it.
    pub fn client_weights(&self, share: &mut ClientShare, app: u32, handler: u32) -> Weights {
        let key = (app, handler);
        let server = self.inner.weights(key);
        let signals = self.inner.signals.read().unwrap_or_else(|e| e.into_inner());
        match signals.1.get(&key) {
            Some(h) => share.weights(key, &server, h, &signals.0, self.inner.clock.now()),
            None => server,
        }
    }

    /// Name of the steering policy.
    pub fn policy_name(&self) -> &str {
        &self.inner.policy_name
    }

    /// The app's current write owner.
    pub fn owner(&self, app: u32) -> Option<Placement> {
        self.inner.owner_of(app)
    }

    /// Moves `app`'s write ownership to `to`: new writes wait (Busy) while in-flight writes at
    /// the old owner drain, then the owner changes and the epoch advances.
    pub fn move_owner(
        &self,
        app: u32,
        to: Placement,
        timeout: Duration,
    ) -> Result<u64, ClusterError> {
        move_owner(&self.inner, app, to, timeout)
    }

    /// The switch's choice for a server-bound message, without sending it: writes go to the
    /// owner, reads split between Host and NIC by the weights.
    pub fn route(&self, req: &Request) -> Result<Placement, Status> {
        route(&self.inner, req, &mut Selector::default()).map(|(p, _)| p)
    }

    /// Submits raw request bytes as a NIC would receive them, and waits for the reply. Malformed
    /// bytes get a `Malformed` reply (request id 0 when it cannot be read).
    pub fn submit_bytes(&self, bytes: Bytes) -> Reply {
        match Request::decode(bytes) {
            Ok(req) => {
                let mut sel = Selector::default();
                let (tx, rx) = bounded(1);
                match submit(
                    &self.inner,
                    req.clone(),
                    &mut sel,
                    None,
                    ReplySink::Sync(tx),
                ) {
                    Ok(p) => rx
                        .recv_timeout(self.inner.config.client_timeout)
                        .unwrap_or_else(|_| {
                            error_reply(&req, Status::Unavailable, p, "no reply".into())
                        }),
                    Err(r) => r.reply(&req),
                }
            }
            Err(e) => Reply {
                app: 0,
                request_id: 0,
                status: Status::Malformed,
                code: 0,
                steps: 0,
                placement: Placement::Nic,
                load: LoadFeedback::default(),
                payload: Bytes::from(e.to_string().into_bytes()),
            },
        }
    }

    /// Routes `req` like the switch and queues it at a local executor; the reply goes to
    /// `on_reply` (from the executor's thread). `forced` pins a read to a placement; `sel` is the
    /// caller's round-robin memory. A read routed to a NIC in another process comes back as
    /// [`Dispatch::Remote`] for the caller to forward.
    pub fn dispatch(
        &self,
        req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        on_reply: impl FnOnce(Reply) + Send + 'static,
    ) -> Dispatch {
        let keep = req.clone();
        match submit(
            &self.inner,
            req,
            sel,
            forced,
            ReplySink::Func(Box::new(on_reply)),
        ) {
            Ok(p) => Dispatch::Queued(p),
            Err(Refusal::Remote(r)) => Dispatch::Remote(r),
            Err(refusal) => Dispatch::Refused(refusal.reply(&keep)),
        }
    }

    /// A fresh client id (the top 24 bits of the request ids a client makes, so that ids of
    /// different clients never collide in write deduplication).
    pub fn next_client_id(&self) -> u32 {
        self.inner.next_client.fetch_add(1, Ordering::SeqCst) & 0xff_ffff
    }

    /// Every app and handler.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// Every region.
    pub fn regions(&self) -> &Arc<RegionTable> {
        &self.inner.regions
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.inner.config
    }

    /// Messages waiting at this process's executors of `p` (`None`: no executors of `p` here).
    pub fn queue_depth(&self, p: Placement) -> Option<usize> {
        self.inner.queues[p.index()].as_ref().map(|q| q.len())
    }

    /// The load report of local placement `p` since the last call (a NIC process sends it to
    /// the server's controller).
    pub fn take_load_report(&self, p: Placement) -> RemoteLoad {
        let depth = self.inner.queues[p.index()]
            .as_ref()
            .map_or(0, |q| q.len() as u32);
        let mut r = self.inner.lock_tracker(p).report();
        r.queue_depth = depth;
        r
    }

    /// Takes in a remote NIC's report: the NIC counts as up until it is silent for
    /// [`REMOTE_SILENCE`].
    pub fn absorb_remote_load(&self, r: &RemoteLoad) {
        self.inner.lock_tracker(Placement::Nic).absorb(r);
        self.inner
            .remote_nic_seen
            .store(self.inner.clock.now(), Ordering::SeqCst);
        self.inner.remote_nic_up.store(true, Ordering::SeqCst);
    }

    /// Marks the remote NIC down at once (it said goodbye, or its address failed).
    pub fn remote_nic_down(&self) {
        self.inner.remote_nic_up.store(false, Ordering::SeqCst);
    }

    /// Whether the remote NIC is up.
    pub fn remote_nic_up(&self) -> bool {
        self.inner.remote_nic_up.load(Ordering::SeqCst)
    }

    /// Stops every thread; queued messages get `Unavailable`.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.congestion.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What [`Cluster::dispatch`] did with a message.
#[derive(Debug)]
pub enum Dispatch {
    /// Queued at a local executor of this placement; the reply goes to the callback.
    Queued(Placement),
    /// Routed to the NIC in another process: forward it there.
    Remote(Box<Request>),
    /// Refused: send this error reply.
    Refused(Reply),
}

/// Where a server-bound message goes, and its handler's kind; no side effects.
fn route(
    inner: &Inner,
    req: &Request,
    sel: &mut Selector,
) -> Result<(Placement, HandlerKind), Status> {
    let handler = inner
        .registry
        .handler(req.app, req.handler)
        .map_err(|e| match e {
            crate::registry::LookupError::UnknownApp(_) => Status::UnknownApp,
            _ => Status::UnknownHandler,
        })?;
    if handler.kind == HandlerKind::Write {
        let owner = inner.owner_of(req.app).ok_or(Status::UnknownApp)?;
        return Ok((owner, HandlerKind::Write));
    }
    let w = inner.weights((req.app, req.handler));
    sel.pick(&w, |p| p != Placement::Client && inner.available(p))
        .map(|p| (p, HandlerKind::Read))
        .ok_or(Status::Unavailable)
}

/// Why a message did not enter a server queue.
enum Refusal {
    /// The switch refused it (unknown handler, handoff in progress, no placement).
    Status(Status),
    /// The queue refused it (full, shut down).
    Client(ClientError),
    /// Routed to a NIC in another process: the fabric driver forwards it.
    Remote(Box<Request>),
    /// The app spent this period's budget of `.0`.
    Budget(&'static str),
}

impl Refusal {
    fn reply(self, req: &Request) -> Reply {
        match self {
            Refusal::Status(s) => {
                error_reply(req, s, Placement::Host, format!("not routed: {s:?}"))
            }
            Refusal::Client(e) => {
                let status = match e {
                    ClientError::Busy(_) => Status::Busy,
                    _ => Status::Unavailable,
                };
                error_reply(req, status, Placement::Host, e.to_string())
            }
            Refusal::Remote(_) => error_reply(
                req,
                Status::Unavailable,
                Placement::Nic,
                "the NIC runs in another process and this caller cannot forward".into(),
            ),
            Refusal::Budget(what) => error_reply(
                req,
                Status::Busy,
                Placement::Host,
                format!(
                    "app {} spent its {what} budget for this period: retry later",
                    req.app
                ),
            ),
        }
    }
}

/// Routes `req` and puts it in its queue: the one way into a server queue. A write is counted in
/// flight at its owner from here until its executor finishes it (an owner handoff waits for the
/// count to drain); every failure path takes the count back. `forced` pins a read to a placement.
fn submit(
    inner: &Inner,
    req: Request,
    sel: &mut Selector,
    forced: Option<Placement>,
    sink: ReplySink,
) -> Result<Placement, Refusal> {
    let (routed, kind) = route(inner, &req, sel).map_err(Refusal::Status)?;
    let p = match (kind, forced) {
        (HandlerKind::Read, Some(p)) => p,
        _ => routed,
    };
    let app = req.app;
    let write = kind == HandlerKind::Write;
    if let Some(what) = inner.over_budget(app) {
        return Err(Refusal::Budget(what));
    }
    if p == Placement::Nic && inner.queues[p.index()].is_none() && inner.config.remote_nic {
        if write {
            return Err(Refusal::Status(Status::NotOwner));
        }
        return Err(Refusal::Remote(Box::new(req)));
    }
    if write {
        let o = inner
            .owners
            .get(&app)
            .ok_or(Refusal::Status(Status::UnknownApp))?;
        if o.draining.load(Ordering::SeqCst) {
            return Err(Refusal::Status(Status::Busy));
        }
        o.inflight.fetch_add(1, Ordering::SeqCst);
        // Re-check: a handoff that started in between must see this write, or we back off.
        // The owner may also have changed between routing and counting.
        if o.draining.load(Ordering::SeqCst) || inner.owner_of(app) != Some(p) {
            o.inflight.fetch_sub(1, Ordering::SeqCst);
            return Err(Refusal::Status(Status::Busy));
        }
    }
    let result = enqueue(inner, p, req, sink);
    if result.is_err() && write {
        release_owner(inner, app);
    }
    result.map(|()| p).map_err(Refusal::Client)
}

fn enqueue(inner: &Inner, p: Placement, req: Request, sink: ReplySink) -> Result<(), ClientError> {
    let Some(q) = &inner.queues[p.index()] else {
        return Err(ClientError::Shutdown);
    };
    if inner.shutdown.load(Ordering::SeqCst) {
        return Err(ClientError::Shutdown);
    }
    let app = req.app;
    let job = Job {
        req,
        enqueued: inner.clock.now(),
        sink,
    };
    match q.push(app, job) {
        Ok(None) => Ok(()),
        Ok(Some((_, out))) => {
            // A longer backlog of another app made room: its newest message is refused.
            if inner
                .registry
                .handler(out.req.app, out.req.handler)
                .is_ok_and(|h| h.kind == HandlerKind::Write)
            {
                release_owner(inner, out.req.app);
            }
            let why = format!(
                "the {p} queue is full and app {} holds the longest backlog: retry later",
                out.req.app
            );
            out.sink.send(error_reply(&out.req, Status::Busy, p, why));
            Ok(())
        }
        Err(PushError::Full(_)) => Err(ClientError::Busy(p)),
        Err(PushError::Closed(_)) => Err(ClientError::Shutdown),
    }
}

/// The in-process one-sided transport: READs served by the agent thread.
pub struct AgentTransport {
    inner: Arc<Inner>,
    tx: Sender<AgentResult>,
    rx: Receiver<AgentResult>,
}

impl AgentTransport {
    fn new(inner: Arc<Inner>) -> Self {
        let (tx, rx) = bounded(1);
        AgentTransport { inner, tx, rx }
    }
}

impl OneSided for AgentTransport {
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, FetchError> {
        // A late answer to a READ that timed out must not be taken for this one.
        while self.rx.try_recv().is_ok() {}
        let start = Instant::now();
        let job = AgentJob {
            app,
            descs: Descriptors::from_slice(descs).unwrap_or_default(),
            bufs: bufs.iter_mut().map(std::mem::take).collect(),
            sink: AgentSink::Sync(self.tx.clone()),
        };
        let unavailable = || FetchError::Unavailable("the one-sided agent did not answer".into());
        if self
            .inner
            .agent
            .send_timeout(job, self.inner.config.client_timeout)
            .is_err()
        {
            return Err(unavailable());
        }
        let got = recv_polling(&self.rx, self.inner.config.client_timeout)
            .map_err(|_| unavailable())??;
        for (dst, src) in bufs.iter_mut().zip(got) {
            *dst = src;
        }
        let rtt = start.elapsed().as_nanos() as u64;
        if let Ok(mut e) = self.inner.client_rtt.lock() {
            e.add(rtt as f64);
        }
        Ok(rtt)
    }
}

/// A synchronous client of the in-process cluster (one call at a time).
pub struct Client {
    inner: Arc<Inner>,
    id: u32,
    seq: u64,
    tx: Sender<Reply>,
    rx: Receiver<Reply>,
    vm: Vm,
    transport: ClientPath<AgentTransport>,
    selectors: HashMap<HandlerKey, Selector>,
}

impl Client {
    fn next_id(&mut self) -> u64 {
        self.seq += 1;
        crate::wire::request_id(self.id, self.seq)
    }

    /// Sends one message, placed by the steering weights; waits for the reply.
    pub fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.call_with(None, app, handler, args, descs)
    }

    /// Sends one message to `placement` (reads only for the client; writes always go to the
    /// owner), bypassing steering.
    pub fn call_at(
        &mut self,
        placement: Placement,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.call_with(Some(placement), app, handler, args, descs)
    }

    /// Sends a prepared request (its request id is replaced by a fresh one unless it is a retry).
    pub fn send(
        &mut self,
        placement: Option<Placement>,
        mut req: Request,
    ) -> Result<Reply, ClientError> {
        if req.flags & crate::wire::flags::RETRY == 0 {
            req.request_id = self.next_id();
        }
        req.validate()?;
        let key = (req.app, req.handler);
        let is_read = self
            .inner
            .registry
            .handler(req.app, req.handler)
            .is_ok_and(|h| h.kind == HandlerKind::Read);
        let start = Instant::now();
        let weights = self.inner.weights(key);
        let sel = self.selectors.entry(key).or_default();
        // The client decides Client vs server for reads, with one weighted pick; a server pick is
        // passed on to the switch as the placement. Writes always go to the owner.
        let choice = match placement {
            Some(p) => Some(p),
            None if is_read => sel.pick(&weights, |p| {
                (p == Placement::Client && self.inner.agent_available())
                    || self.inner.queues[p.index()].is_some()
            }),
            None => None,
        };
        let reply = if is_read && choice == Some(Placement::Client) {
            self.run_locally(&req)
        } else {
            let sink = ReplySink::Sync(self.tx.clone());
            match submit(&self.inner, req.clone(), sel, choice, sink) {
                Err(Refusal::Client(e)) => return Err(e),
                Err(refusal) => refusal.reply(&req),
                Ok(_) => {
                    let deadline = Instant::now() + self.inner.config.client_timeout;
                    loop {
                        let left = deadline.saturating_duration_since(Instant::now());
                        match recv_polling(&self.rx, left) {
                            Ok(r) if r.request_id == req.request_id => break r,
                            Ok(_) => continue, // a late reply to an earlier, timed-out call
                            Err(_) => {
                                return Err(ClientError::Timeout(self.inner.config.client_timeout))
                            }
                        }
                    }
                }
            }
        };
        self.inner.metrics.record(
            reply.placement,
            key,
            start.elapsed().as_nanos() as u64,
            reply.status,
        );
        Ok(reply)
    }

    fn call_with(
        &mut self,
        placement: Option<Placement>,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.send(placement, Request::for_call(app, handler, 0, args, descs)?)
    }

    fn run_locally(&mut self, req: &Request) -> Reply {
        let (reply, ran) = run_at_client(
            req,
            &self.inner.registry,
            &mut self.transport,
            &mut self.vm,
            self.inner.config.limits,
            self.inner.clock.as_ref(),
        );
        if let Some((service, steps)) = ran {
            self.inner.lock_tracker(Placement::Client).completed(
                (req.app, req.handler),
                service,
                steps,
            );
        }
        reply
    }
}

/// Runs read `req` at the Client placement over `path` (every step's data by one-sided READ).
/// Returns the reply, with the client-side service time (run time less fetch time) as its load
/// feedback, and `(service, steps)` when the handler ran, for the caller's load tracker.
pub(crate) fn run_at_client<T: OneSided>(
    req: &Request,
    registry: &Registry,
    path: &mut ClientPath<T>,
    vm: &mut Vm,
    limits: Limits,
    clock: &dyn Clock,
) -> (Reply, Option<(u64, u16)>) {
    let handler: Arc<HandlerEntry> = match registry.handler(req.app, req.handler) {
        Ok(h) => h.clone(),
        Err(e) => {
            let r = error_reply(
                req,
                Status::UnknownHandler,
                Placement::Client,
                e.to_string(),
            );
            return (r, None);
        }
    };
    let begin = clock.now();
    let (c, cost) = run_message(req, handler, path, vm, limits, clock, |_| {
        Err(WriteError::NotOwner)
    });
    let service = clock
        .now()
        .saturating_sub(begin)
        .saturating_sub(cost.fetch_ns);
    let reply = reply_for(
        req,
        &c,
        Placement::Client,
        LoadFeedback {
            service_ns: service,
            ..LoadFeedback::default()
        },
    );
    (reply, Some((service, c.steps)))
}
