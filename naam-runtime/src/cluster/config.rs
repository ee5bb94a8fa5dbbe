//! The cluster's configuration: apps and their regions, policies, the NIC model, tenant
//! budgets, and the errors of building a cluster and of calling it.

use super::{
    Arc, Clock, CostPolicy, CostPolicyConfig, DmaModel, Duration, HandlerSpec, Limits,
    LoadedObject, Nanos, Placement, Policy, RegistryError, StaticPolicy, VerifierConfig,
    POLL_BEFORE_BLOCKING,
};

/// A region to register for an app.
#[derive(Clone, Debug)]
pub struct RegionSpec {
    /// Name (clients look the rkey up by it).
    pub name: String,
    /// `ACCESS_*` rights handlers get on it (bits outside `ACCESS_MASK` are dropped).
    pub access: u32,
    /// Initial contents (its length is the region size).
    pub contents: Vec<u8>,
}

/// An app to install: its id, write owner, regions, and the handlers to verify from its
/// object.
#[derive(Clone, Debug)]
pub struct AppSpec {
    /// Id messages name the app by; unique within the cluster (a repeat is refused).
    pub id: u32,
    /// Name the registry and manifest show; need not be unique (every MICA table is `mica`).
    pub name: String,
    /// Placement applying its writes (Host or Nic).
    pub owner: Placement,
    /// Its regions, each under a fresh random rkey unless the region backing gives one.
    pub regions: Vec<RegionSpec>,
    /// The object holding its handlers.
    pub object: Arc<LoadedObject>,
    /// Handlers to register from the object.
    pub handlers: Vec<HandlerSpec>,
}

impl AppSpec {
    /// Every handler of the app on `engine` (the JIT is the default).
    pub fn with_engine(mut self, engine: naam_proto::EngineKind) -> Self {
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
#[non_exhaustive]
pub enum PolicyChoice {
    /// The cost policy (expected completion time, with hysteresis and probes).
    Auto(CostPolicyConfig),
    /// Always one placement (reads); writes at their owner.
    Always(Placement),
}

impl PolicyChoice {
    pub(super) fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyChoice::Auto(c) => Box::new(CostPolicy::new(c)),
            PolicyChoice::Always(p) => Box::new(StaticPolicy(p)),
        }
    }
}

/// How NIC cores are emulated.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
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

/// Cluster settings; the defaults are one host and one NIC executor, the cost policy and a
/// 1 ms steering period.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClusterConfig {
    /// Host executor threads.
    pub host_executors: usize,
    /// NIC executor threads.
    pub nic_executors: usize,
    /// Capacity of each executor queue (back-pressure beyond it).
    pub queue_capacity: usize,
    /// Steering policy the controller runs every `steering_period`.
    pub policy: PolicyChoice,
    /// How NIC cores are emulated: DMA cost model, core slowdown, busy-waiting.
    pub nic: NicModel,
    /// Per-message bounds: the hop limit and torn-read retries.
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
    /// record differences (tests of the aarch64 JIT over real workloads; off by default):
    /// with the `testing` feature, each thread's VM is wrapped in naam-vm's
    /// `cross::CrossChecked`.
    #[cfg(feature = "testing")]
    pub cross_check: Option<Arc<naam_vm::cross::CrossCheck>>,
    /// Where the handlers' compiled code is shared and kept (naam-server's `code_cache =
    /// DIR`: [`crate::code_cache::open_dir`]); the process's cache in memory by default.
    pub code_cache: Arc<naam_vm::CodeCache>,
    /// What one app may spend per period before its new messages are refused `Busy`: bounds
    /// the harm one tenant's torn records or retry storms do to the others.
    pub tenant_budget: TenantBudget,
    /// Run inside a discrete-event simulation (`naam-sim`); `None`: on this machine's clock.
    pub simulated: Option<Simulated>,
    /// Apps [`super::Cluster::create_app`] may add while the cluster serves, beyond those it
    /// starts with, each with up to [`naam_proto::limits::MAX_CREATED_APP_REGIONS`] regions: the tables of
    /// per-app state and regions are sized for them at the start (read without a lock, they
    /// never grow).
    pub run_time_apps: usize,
}

/// What a message that ran did, for a [`ServiceModel`] to turn into a service time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunFacts {
    /// Interpreter instructions executed (the simulator runs handlers on the interpreter,
    /// whose count is exact).
    pub insns: u64,
    /// Of those, the memory accesses and helper calls (the interpreter counts them).
    pub mix: naam_proto::step::InsnMix,
    /// Engine entries (steps, retried steps, a faulted step).
    pub runs: u16,
    /// Steps over the message's life.
    pub steps: u16,
    /// Modelled data-access time of every fetch ([`NicModel::dma`] at the NIC; 0 at the host).
    pub fetch_ns: u64,
    /// Bytes of the request's arguments.
    pub args_bytes: u32,
    /// Bytes of the reply's payload.
    pub reply_bytes: u32,
}

/// Turns what a message did at a placement into the time it kept that placement's core busy:
/// the simulator's cost model (its profile's instruction, DMA and fixed costs).
pub trait ServiceModel: Send + Sync {
    /// Nanoseconds of one core of `placement` that running the message took.
    fn service_ns(&self, placement: Placement, run: &RunFacts) -> Nanos;
}

/// A cluster inside a simulation: time is the simulator's (a virtual clock that does not move
/// while a handler runs), each message's service time comes from `service` instead of the
/// clock, and the steering controller decides only when the simulator calls
/// [`super::Cluster::steer`] (no thread of its own). Its executor counts are the simulator's
/// cores, which run messages where they arrive ([`super::Cluster::dispatch_here`]): the
/// cluster starts no executor, agent or steering thread.
#[derive(Clone)]
pub struct Simulated {
    /// The simulator's virtual clock.
    pub clock: Arc<dyn Clock>,
    /// The cost model.
    pub service: Arc<dyn ServiceModel>,
}

impl std::fmt::Debug for Simulated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Simulated { .. }")
    }
}

/// How long a remote NIC may stay silent before the controller takes it out of the weights
/// (three of an idle NIC's heartbeats).
pub const REMOTE_SILENCE: Duration = Duration::from_nanos(naam_proto::limits::NIC_SILENCE);

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
            #[cfg(feature = "testing")]
            cross_check: None,
            code_cache: naam_vm::CodeCache::process(),
            tenant_budget: TenantBudget::default(),
            simulated: None,
            run_time_apps: 64,
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
#[non_exhaustive]
pub enum ClusterError {
    /// Registering an app or handler failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A thread could not be started.
    #[error("starting thread {0}: {1}")]
    Thread(String, std::io::Error),
    /// An owner move named an app this cluster does not have.
    #[error("no app {0}")]
    UnknownApp(u32),
    /// The owner handoff did not drain in time.
    #[error("write owner handoff of app {0} did not drain in-flight writes within {1:?}")]
    HandoffTimeout(u32, Duration),
    /// Settings that cannot work together (a zero queue capacity, a client write owner, a NIC
    /// write owner with a remote NIC).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An app to create has the id of one this cluster has.
    #[error("app {0} exists already")]
    AppExists(u32),
    /// No more apps can be created ([`ClusterConfig::run_time_apps`]), or the app to create
    /// has more than [`naam_proto::limits::MAX_CREATED_APP_REGIONS`] regions.
    #[error("app {app} cannot be created: {why}")]
    NoRoom {
        /// The app.
        app: u32,
        /// Which limit it met.
        why: String,
    },
    /// Region memory could not be provided.
    #[error("region {region} of app {app}: {message}")]
    Region {
        /// The app the region belongs to ([`AppSpec::id`]).
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

/// What one app spent in the current period, and in all since the cluster started.
#[derive(Debug, Default)]
pub(super) struct Spent {
    pub(super) since: Nanos,
    pub(super) retries: u64,
    pub(super) steps: u64,
    /// Kept across periods.
    pub(super) totals: AppAccount,
}

/// One app's accounting since the cluster started ([`super::Cluster::app_accounts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AppAccount {
    /// The app.
    pub app: u32,
    /// Handler time at each placement in this process (index [`Placement::index`]),
    /// nanoseconds: what the app's messages took of the executors and loops that ran them.
    pub cpu_ns: [u64; 3],
    /// Periods in which the app spent its step budget ([`TenantBudget::steps`]) and was
    /// refused `Busy` for the rest of the period.
    pub steps_exhausted: u64,
    /// Periods in which it spent its torn-read retry budget ([`TenantBudget::retries`]).
    pub retries_exhausted: u64,
}
