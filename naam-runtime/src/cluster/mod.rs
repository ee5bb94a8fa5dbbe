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
//! and sends writes to the app's write owner; executors run the sans-IO
//! [`naam_proto::step::StepMachine`]; the steering thread runs naam-proto's `Controller` every
//! period and publishes its weights.
//!
//! Here: the shared state, the builder, dispatch and routing. `config` holds the settings and
//! errors, `executors` the executor and agent threads, `steer` the controller's side, `client`
//! the synchronous client and the Client placement, `async_client` the tokio client (feature
//! `async`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, Sender};
use naam_ebpf::abi::Descriptor;

use crate::append_map::AppendMap;
use crate::executor::{
    self, apply_owned, one_sided_read, run_message, ClientPath, Driven, HostPath, NicPath,
    ParkedRun, RunCost,
};
use crate::fair::{FairQueue, PushError};
use crate::intmap::IntMap;
use crate::{Clock, SystemClock};
use crate::{HandlerEntry, HandlerSpec, Registry, RegistryError};
use crate::{HandlerSlot, Metrics, MetricsShard};
use crate::{RegionMemory, RegionTable};
use naam_proto::arena::ByteArena;
use naam_proto::steering::Selector;
use naam_proto::step::HandlerKind;
use naam_proto::step::ResolveError;
use naam_proto::step::{
    DataPath, DmaModel, FetchError, Limits, MessageStart, OneSided, Outcome, StepMachine,
    WriteError,
};
use naam_proto::transport::ClientError;
use naam_proto::Nanos;
use naam_proto::Placement;
use naam_vm::LoadedObject;
use naam_vm::Vm;

mod client;
mod config;
mod deploy;
mod executors;
mod here;
mod steer;
mod weight_cell;

pub use client::{run_at_client, ClientRan};
pub use client::{AgentTransport, Client};
pub use config::*;
pub use deploy::{Deployed, DeployedHandler};
use executors::*;
pub use here::HereRunner;
use here::{LocalLoad, LocalReport, Ran, MAX_PENDING_LOCAL_REPORTS};

/// The engine a cluster thread (executor, client, run-to-completion loop) runs handlers on:
/// the VM itself, or with the `testing` feature the VM in naam-vm's cross-check wrapper,
/// which samples steps only when [`ClusterConfig::cross_check`] is set.
#[cfg(not(feature = "testing"))]
type ThreadVm = Vm;
#[cfg(feature = "testing")]
type ThreadVm = naam_vm::cross::CrossChecked;

/// A cluster thread's engine ([`ThreadVm`]) as `config` asks.
fn thread_vm(config: &ClusterConfig) -> ThreadVm {
    #[cfg(feature = "testing")]
    return naam_vm::cross::CrossChecked::new(Vm::new(), config.cross_check.clone());
    #[cfg(not(feature = "testing"))]
    {
        let _ = config;
        Vm::new()
    }
}
use steer::*;
use weight_cell::WeightCell;

#[cfg(feature = "async")]
mod async_client;
#[cfg(feature = "async")]
pub use async_client::AsyncClient;
use naam_proto::dedup::RecentAnswers;
use naam_proto::steering::{
    AppView, ClientShare, Controller, ControllerConfig, CostPolicy, CostPolicyConfig, Ewma,
    HandlerKey, HandlerLoad, HandlerView, LoadTracker, Observe, Policy, RemoteHandler, RemoteLoad,
    StaticPolicy, SteeringInputs, Weights,
};
use naam_proto::wire::{Descriptors, LoadFeedback, Reply, Request, Status};
use naam_vm::VerifierConfig;

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
    /// A message a thread started itself and that must wait out a torn-read backoff: the
    /// executor parks it (never the thread that took it in) and resumes it when due.
    parked: Option<(Box<ParkedRun>, bool)>,
    /// The handler admission routed it with: it runs on that version even if a deploy
    /// replaces the app's handlers while it waits.
    handler: Arc<HandlerEntry>,
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
    /// Held while one of the app's writes runs a step and applies its batch. The layouts'
    /// writes are optimistic against each other's *finished* batches (a CAS on a version,
    /// then stores), not against a batch still being applied: one writer at a time per app,
    /// whichever thread runs it (a client's own thread, any executor of the owner).
    writer: WriterLock,
}

/// A spin lock for one app's writes: held for one write step and its batch (a microsecond or
/// so), never across a torn-read backoff.
#[derive(Default)]
pub(super) struct WriterLock(AtomicBool);

impl WriterLock {
    /// Takes the lock, spinning briefly, then yielding the core to a holder that was
    /// preempted.
    pub(super) fn lock(&self) -> WriterGuard<'_> {
        let mut spins = 0u32;
        while self
            .0
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        WriterGuard(&self.0)
    }
}

/// Releases a [`WriterLock`] when dropped.
pub(super) struct WriterGuard<'a>(&'a AtomicBool);

impl Drop for WriterGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
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

/// One thread's view of the cluster's registry, for the paths that run a message per call
/// (a client's calls, a receive loop's messages): while nothing is deployed, finding the
/// current registry is one relaxed pointer compare, where an `ArcSwap::load` takes a debt
/// slot each time (about 6 ns a call, RESULTS "Deploys at run time"). A deploy is seen at the
/// next call; a call holds the version it found until it ends.
pub(crate) struct RegistryView {
    swap: Arc<ArcSwap<Registry>>,
    /// Taken out of the view for the length of a call ([`RegistryView::take`]).
    cache: Option<arc_swap::Cache<Arc<ArcSwap<Registry>>, Arc<Registry>>>,
}

/// A [`RegistryView`]'s cache while a call has it.
pub(crate) type RegistryCache = arc_swap::Cache<Arc<ArcSwap<Registry>>, Arc<Registry>>;

impl RegistryView {
    fn new(inner: &Inner) -> RegistryView {
        RegistryView {
            swap: inner.registry.clone(),
            cache: Some(arc_swap::Cache::new(inner.registry.clone())),
        }
    }

    /// Takes the cache out for a call (two pointer moves, no reference count touched), so
    /// that the call may borrow all of its owner beside the registry; [`RegistryView::put`]
    /// puts it back. A nested call meanwhile loads the registry itself.
    #[inline(always)]
    fn take(&mut self) -> Option<RegistryCache> {
        self.cache.take()
    }

    #[inline(always)]
    fn put(&mut self, cache: Option<RegistryCache>) {
        if cache.is_some() {
            self.cache = cache;
        }
    }

    /// Runs `f` on `owner` with the current registry (see [`RegistryView::take`]).
    /// Inlined: what `f` makes is built where its caller keeps it, not copied out of a frame
    /// of this one.
    #[inline(always)]
    fn with<O, R>(
        owner: &mut O,
        field: impl Fn(&mut O) -> &mut RegistryView,
        f: impl FnOnce(&mut O, &Registry) -> R,
    ) -> R {
        let view = field(owner);
        match view.take() {
            Some(mut cache) => {
                let r = f(owner, cache.load());
                field(owner).put(Some(cache));
                r
            }
            None => {
                let registry = view.swap.load_full();
                f(owner, &registry)
            }
        }
    }
}

struct Inner {
    config: ClusterConfig,
    clock: Arc<dyn Clock>,
    regions: Arc<RegionTable>,
    /// Every app and handler, swapped whole by a deploy ([`Cluster::deploy`]); a reader
    /// holds the version it loaded until its call finishes.
    registry: Arc<ArcSwap<Registry>>,
    /// Serializes deploys and app creations (each makes the next registry from the current
    /// one), with what an app created at run time gets its memory and journal from.
    deploying: Mutex<Backings>,
    /// Executor queues per placement, fair between apps ([`FairQueue`]).
    queues: [Option<Arc<FairQueue<Job>>>; 3],
    agent: Sender<AgentJob>,
    trackers: [Mutex<LoadTracker>; 3],
    /// Reports of the threads that run messages themselves, waiting for the steering to
    /// apply them before its next decision ([`Inner::hand_over`]).
    local_reports: Mutex<Vec<LocalReport>>,
    /// The reports [`Inner::apply_local_reports`] took from `local_reports`, applied outside
    /// that lock (capacity kept: applying allocates nothing).
    applying_reports: Mutex<Vec<LocalReport>>,
    /// Applied reports, their vectors kept for the next flushes ([`Inner::spare_report`]).
    spare_reports: Mutex<Vec<LocalReport>>,
    /// Reports handed over and not yet back among the spares: while there are, a flush that
    /// finds no spare waits for one rather than making a report ([`LocalLoad::flush`]).
    reports_out: AtomicUsize,
    /// The steering thread, and whether it sleeps out an idle period, from which a handed
    /// over report wakes it.
    steering: std::sync::OnceLock<std::thread::Thread>,
    steering_asleep: AtomicBool,
    /// The handlers whose weights changed since the eSwitch last took them
    /// ([`Cluster::take_weight_changes`]); kept only once someone takes them.
    weight_changes: Mutex<WeightChanges>,
    /// Per handler that ran here or at the NIC (never a key a client names): the cell its
    /// weights are published in. The lock guards the map only: the steering writes it when a
    /// handler gets its first weights, and clients keep the cells they read.
    weights: RwLock<IntMap<HandlerKey, Arc<WeightCell>>>,
    /// With remote clients: the signals of each handler's latest decision, and the inputs it
    /// was decided with, from which each client's own Client share is decided.
    signals: RwLock<(SteeringInputs, IntMap<HandlerKey, HandlerLoad>)>,
    /// Every app's state beside its registry entry, those of the start and those created at
    /// run time ([`Cluster::create_app`]); an app's state is in before its handlers are
    /// published, so a message the registry admits finds it.
    apps: AppendMap<u32, AppState>,
    client_rtt: Mutex<Ewma>,
    metrics: Metrics,
    congestion: CongestionInjector,
    shutdown: AtomicBool,
    next_client: AtomicU32,
    policy_name: String,
    remote_nic_up: AtomicBool,
    remote_nic_seen: AtomicU64,
    /// The registry version whose handlers the remote NIC serves (its load reports say):
    /// no read of an app deployed later is forwarded to it.
    remote_nic_version: AtomicU64,
    /// The controller of a simulated cluster, which decides when [`Cluster::steer`] is
    /// called (no steering thread).
    driven: Mutex<Option<Controller>>,
}

/// What the cluster keeps of one app beside its registry entry.
struct AppState {
    owner: Owner,
    /// The undo journal its owner's write batches are applied under, when its regions
    /// outlive the process ([`crate::journal`]).
    journal: Option<crate::journal::WriteJournal>,
    /// Answers of its recent writes, by (origin, request id).
    dedup: Mutex<DedupTable>,
    /// What it spent of [`ClusterConfig::tenant_budget`] this period.
    spent: AppBudget,
    /// Its regions' rkeys by name, in its spec's order.
    region_keys: Vec<(String, u64)>,
}

impl AppState {
    fn new(
        spec: &AppSpec,
        region_keys: Vec<(String, u64)>,
        journal: Option<crate::journal::WriteJournal>,
    ) -> AppState {
        AppState {
            owner: Owner {
                placement: AtomicU8::new(spec.owner.abi() as u8),
                draining: AtomicBool::new(false),
                inflight: AtomicU32::new(0),
                epoch: AtomicU64::new(0),
                writer: WriterLock::default(),
            },
            journal,
            dedup: Mutex::new(DedupTable::default()),
            spent: AppBudget::default(),
            region_keys,
        }
    }
}

/// Where an app created at run time gets its regions' memory and its journal: the builder's
/// backings, kept.
struct Backings {
    regions: RegionBacking,
    journals: Option<JournalBacking>,
}

/// One app's spending of its [`TenantBudget`] in the current period. Spending is added
/// under the lock (callers on a hot path add in batches); whether the app is refused is one
/// atomic read.
#[derive(Default)]
struct AppBudget {
    spent: Mutex<Spent>,
    /// Until when (clock time) the app is refused, and for which budget: 0 none, 1 retries,
    /// 2 steps.
    refused_until: AtomicU64,
    refused_for: AtomicU8,
}

/// Weight changes at most kept for [`Cluster::take_weight_changes`] between two takes.
pub const MAX_KEPT_WEIGHT_CHANGES: usize = 65_536;

/// The weight changes kept for [`Cluster::take_weight_changes`].
#[derive(Default)]
struct WeightChanges {
    /// Someone takes them: until then nothing is kept.
    kept: bool,
    keys: Vec<HandlerKey>,
    /// More than [`MAX_KEPT_WEIGHT_CHANGES`] came since the last take.
    overflowed: bool,
}

impl WeightChanges {
    fn changed(&mut self, key: HandlerKey) {
        if !self.kept || self.overflowed {
            return;
        }
        if self.keys.len() < MAX_KEPT_WEIGHT_CHANGES {
            self.keys.push(key);
        } else {
            self.keys.clear();
            self.overflowed = true;
        }
    }
}

impl Inner {
    /// Adds to `app`'s spending in the current period (a new period starts afresh).
    fn spend(&self, app: u32, retries: u64, steps: u64) {
        self.spend_at(app, None, retries, steps);
    }

    /// [`Inner::spend`], with `cpu` = (placement, handler nanoseconds) added to the app's
    /// accounting under the same lock.
    fn spend_at(&self, app: u32, cpu: Option<(Placement, Nanos)>, retries: u64, steps: u64) {
        self.spend_then(self.clock.now(), app, cpu, retries, steps);
    }

    /// [`Inner::spend_at`] for spending measured at `now` (a report applied later counts in
    /// the period it was made in, or the current one if that has ended since).
    fn spend_then(
        &self,
        now: Nanos,
        app: u32,
        cpu: Option<(Placement, Nanos)>,
        retries: u64,
        steps: u64,
    ) {
        if let Some(b) = self.budget(app) {
            let budget = self.config.tenant_budget;
            let period = budget.period.as_nanos() as u64;
            let mut s = b.spent.lock().unwrap_or_else(|e| e.into_inner());
            if now.saturating_sub(s.since) >= period {
                *s = Spent {
                    since: now,
                    totals: s.totals,
                    ..Spent::default()
                };
            }
            if let Some((p, ns)) = cpu {
                s.totals.cpu_ns[p.index()] = s.totals.cpu_ns[p.index()].saturating_add(ns);
            }
            s.retries += retries;
            s.steps += steps;
            let refused = if s.retries >= budget.retries {
                1
            } else if s.steps >= budget.steps {
                2
            } else {
                0
            };
            if refused != 0 {
                let until = s.since.saturating_add(period);
                // Counted once a period: the first spending past the budget.
                if b.refused_until.swap(until, Ordering::AcqRel) != until {
                    match refused {
                        1 => s.totals.retries_exhausted += 1,
                        _ => s.totals.steps_exhausted += 1,
                    }
                }
                b.refused_for.store(refused, Ordering::Relaxed);
            }
        }
    }

    /// Every app's accounting so far.
    fn app_accounts(&self) -> Vec<AppAccount> {
        self.apply_local_reports();
        let mut v: Vec<AppAccount> = self
            .apps
            .iter()
            .map(|(app, a)| AppAccount {
                app,
                ..a.spent
                    .spent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .totals
            })
            .collect();
        v.sort_by_key(|a| a.app);
        v
    }

    /// Which of `app`'s budgets is spent for the rest of the period, if one is. An app never
    /// refused costs one atomic read and no clock read (every message admitted asks).
    fn over_budget(&self, app: u32) -> Option<&'static str> {
        let b = self.budget(app)?;
        if b.refused_until.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.over_budget_at(app, self.clock.now())
    }

    /// [`Inner::over_budget`] at clock time `now` (one atomic read when nothing is spent).
    fn over_budget_at(&self, app: u32, now: Nanos) -> Option<&'static str> {
        let b = self.budget(app)?;
        if now >= b.refused_until.load(Ordering::Acquire) {
            return None;
        }
        match b.refused_for.load(Ordering::Relaxed) {
            1 => Some("torn-read retries"),
            2 => Some("steps"),
            _ => None,
        }
    }

    /// `app`'s write ownership.
    #[inline]
    fn owner(&self, app: u32) -> Option<&Owner> {
        self.apps.get(app).map(|a| &a.owner)
    }

    /// `app`'s undo journal, when its regions outlive the process.
    #[inline]
    fn journal(&self, app: u32) -> Option<&crate::journal::WriteJournal> {
        self.apps.get(app).and_then(|a| a.journal.as_ref())
    }

    /// `app`'s answers of recent writes.
    #[inline]
    fn dedup(&self, app: u32) -> Option<&Mutex<DedupTable>> {
        self.apps.get(app).map(|a| &a.dedup)
    }

    /// `app`'s spending this period.
    #[inline]
    fn budget(&self, app: u32) -> Option<&AppBudget> {
        self.apps.get(app).map(|a| &a.spent)
    }

    fn owner_of(&self, app: u32) -> Option<Placement> {
        self.owner(app)
            .and_then(|o| Placement::from_abi(o.placement.load(Ordering::SeqCst) as u32))
    }

    fn weights(&self, key: HandlerKey) -> Weights {
        self.weight_cell(key)
            .map_or(Weights::all(Placement::Host), |c| c.load())
    }

    /// The cell `key`'s weights are published in, once the steering has decided them.
    fn weight_cell(&self, key: HandlerKey) -> Option<Arc<WeightCell>> {
        self.weights.read().ok().and_then(|w| w.get(&key).cloned())
    }

    /// Whether `p` can take server messages: a local queue, or a remote NIC that reports.
    fn available(&self, p: Placement) -> bool {
        self.queues[p.index()].is_some()
            || (p == Placement::Nic
                && self.config.remote_nic
                && self.remote_nic_up.load(Ordering::SeqCst))
    }

    /// Whether the remote NIC serves `app`'s handlers as `registry` has them (it reported
    /// their version or a newer one). One atomic load while no deploy is ahead of the NIC.
    fn remote_nic_current(&self, registry: &Registry, app: u32) -> bool {
        let served = self.remote_nic_version.load(Ordering::Acquire);
        registry.version() <= served || registry.app(app).is_some_and(|a| a.version <= served)
    }

    /// Whether the one-sided agent clients read from is up.
    fn agent_available(&self) -> bool {
        !self.config.remote_nic || self.remote_nic_up.load(Ordering::SeqCst)
    }

    /// Leaves `report` for the steering to apply, or applies it now when no steering runs or
    /// [`MAX_PENDING_LOCAL_REPORTS`] already wait (a steering that falls behind slows the
    /// reporters rather than holding their reports without bound).
    fn hand_over(&self, report: LocalReport) {
        if self.config.controller {
            let mut pending = self.local_reports.lock().unwrap_or_else(|e| e.into_inner());
            if pending.len() < MAX_PENDING_LOCAL_REPORTS {
                pending.push(report);
                self.reports_out.fetch_add(1, Ordering::AcqRel);
                drop(pending);
                if self.steering_asleep.swap(false, Ordering::SeqCst) {
                    if let Some(t) = self.steering.get() {
                        t.unpark();
                    }
                }
                return;
            }
        }
        report.apply(self);
        self.keep_spare(report);
    }

    /// Whether reports wait for the steering.
    fn local_reports_waiting(&self) -> bool {
        !self
            .local_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Applies the reports [`Inner::hand_over`] left: the steering's first step each period.
    fn apply_local_reports(&self) {
        // Moved to the applier's list, so that reporters can hand over while these apply and
        // neither list allocates; counted out until they are spares again.
        let mut applying = self
            .applying_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        applying.extend(
            self.local_reports
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..),
        );
        if applying.is_empty() {
            return;
        }
        for r in applying.iter() {
            r.apply(self);
        }
        let returned = applying.len();
        {
            let mut spare = self.spare_reports.lock().unwrap_or_else(|e| e.into_inner());
            for r in applying.drain(..) {
                if spare.len() < MAX_PENDING_LOCAL_REPORTS {
                    spare.push(r);
                }
            }
        }
        self.reports_out.fetch_sub(returned, Ordering::AcqRel);
    }

    /// Keeps an applied report's vectors for the next flush.
    fn keep_spare(&self, report: LocalReport) {
        let mut spare = self.spare_reports.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < MAX_PENDING_LOCAL_REPORTS {
            spare.push(report);
        }
    }

    /// Reports handed over to the steering and not yet back among the spares.
    fn reports_out(&self) -> usize {
        self.reports_out.load(Ordering::Acquire)
    }

    /// An applied report to fill again, if one is kept.
    fn spare_report(&self) -> Option<LocalReport> {
        self.spare_reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
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
    dyn FnMut(u32, &RegionSpec) -> Result<(RegionMemory, Option<u64>), ClusterError> + Send;

/// A boxed [`RegionBackingFn`]; without one, a builder backs each region with heap memory
/// holding its `contents`.
pub type RegionBacking = Box<RegionBackingFn>;

/// Provides the undo journal of one app's write batches, given the app's regions in the
/// order of its spec; `None`: its writes are applied unjournaled (memory that dies with the
/// process needs none).
pub type JournalBackingFn = dyn FnMut(
        u32,
        Vec<Arc<crate::Region>>,
    ) -> Result<Option<crate::journal::WriteJournal>, ClusterError>
    + Send;

/// A boxed [`JournalBackingFn`].
pub type JournalBacking = Box<JournalBackingFn>;

/// Builds a [`Cluster`].
#[derive(Default)]
pub struct ClusterBuilder {
    config: ClusterConfig,
    apps: Vec<AppSpec>,
    clock: Option<Arc<dyn Clock>>,
    backing: Option<RegionBacking>,
    journals: Option<JournalBacking>,
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

    /// Sets [`ClusterConfig::policy`].
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

    /// Applies each app's write batches under the journal `journals` gives it (regions that
    /// outlive the process: see [`crate::journal`]).
    pub fn write_journals(mut self, journals: JournalBacking) -> Self {
        self.journals = Some(journals);
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
        let clock = match &config.simulated {
            Some(s) => s.clock.clone(),
            None => self.clock.unwrap_or_else(|| Arc::new(SystemClock::new())),
        };
        let mut backing = self.backing.unwrap_or_else(|| {
            Box::new(|_, r: &RegionSpec| Ok((RegionMemory::from_bytes(&r.contents), None)))
        });
        let spare_regions = config
            .run_time_apps
            .saturating_mul(naam_proto::limits::MAX_CREATED_APP_REGIONS);
        let Installed {
            regions,
            registry,
            region_keys,
        } = install_with(
            &self.apps,
            &config.verifier,
            &config.code_cache,
            &mut *backing,
            spare_regions,
        )?;
        if config.remote_nic && self.apps.iter().any(|a| a.owner == Placement::Nic) {
            return Err(ClusterError::Config(
                "with a remote NIC, writes are owned by the host (owner = host)".into(),
            ));
        }
        let mut journal_backing = self.journals;
        let apps = AppendMap::with_capacity(self.apps.len().saturating_add(config.run_time_apps));
        for app in &self.apps {
            let keys: Vec<(String, u64)> = app
                .regions
                .iter()
                .filter_map(|r| {
                    Some((r.name.clone(), *region_keys.get(&(app.id, r.name.clone()))?))
                })
                .collect();
            let journal = match &mut journal_backing {
                Some(backing) => {
                    let mine = keys
                        .iter()
                        .filter_map(|&(_, k)| regions.get(app.id, k).cloned())
                        .collect();
                    backing(app.id, mine)?
                }
                None => None,
            };
            // Ids are unique: the registry refused a repeat.
            if apps
                .insert(app.id, AppState::new(app, keys, journal))
                .is_err()
            {
                return Err(ClusterError::Registry(RegistryError::DuplicateApp(app.id)));
            }
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
            local_reports: Mutex::new(Vec::with_capacity(MAX_PENDING_LOCAL_REPORTS)),
            applying_reports: Mutex::new(Vec::with_capacity(MAX_PENDING_LOCAL_REPORTS)),
            spare_reports: Mutex::new(Vec::with_capacity(MAX_PENDING_LOCAL_REPORTS)),
            reports_out: AtomicUsize::new(0),
            steering: std::sync::OnceLock::new(),
            steering_asleep: AtomicBool::new(false),
            weight_changes: Mutex::new(WeightChanges::default()),
            queues: [
                None,
                (config.nic_executors > 0).then(|| nic_q.clone()),
                (config.host_executors > 0).then(|| host_q.clone()),
            ],
            config,
            clock,
            regions: Arc::new(regions),
            registry: Arc::new(ArcSwap::from_pointee(registry)),
            deploying: Mutex::new(Backings {
                regions: backing,
                journals: journal_backing,
            }),
            agent: agent_tx,
            weights: RwLock::new(IntMap::default()),
            signals: RwLock::new((SteeringInputs::default(), IntMap::default())),
            apps,
            client_rtt: Mutex::new(Ewma::default()),
            metrics: Metrics::default(),
            congestion: CongestionInjector::default(),
            shutdown: AtomicBool::new(false),
            next_client: AtomicU32::new(1),
            policy_name,
            remote_nic_up: AtomicBool::new(false),
            remote_nic_seen: AtomicU64::new(0),
            remote_nic_version: AtomicU64::new(0),
            driven: Mutex::new(None),
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
        // A simulated cluster's executors are the simulator's cores: it starts no thread.
        let threaded = inner.config.simulated.is_none();
        for i in (0..inner.config.host_executors).filter(|_| threaded) {
            let (inner2, rx) = (inner.clone(), host_q.clone());
            threads.push(spawn(
                format!("naam-host-{i}"),
                Box::new(move || executor_loop(inner2, rx, Placement::Host)),
            )?);
        }
        for i in (0..inner.config.nic_executors).filter(|_| threaded) {
            let (inner2, rx) = (inner.clone(), nic_q.clone());
            threads.push(spawn(
                format!("naam-nic-{i}"),
                Box::new(move || executor_loop(inner2, rx, Placement::Nic)),
            )?);
        }
        if threaded {
            let inner2 = inner.clone();
            threads.push(spawn(
                "naam-one-sided-agent".into(),
                Box::new(move || agent_loop(inner2, agent_rx)),
            )?);
        }
        if inner.config.controller && inner.config.simulated.is_some() {
            *inner.driven.lock().unwrap_or_else(|e| e.into_inner()) = Some(controller);
        } else if inner.config.controller {
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
    /// Every registered region, by rkey.
    pub regions: RegionTable,
    /// Every app and handler.
    pub registry: Registry,
    /// rkey of each (app, region name).
    pub region_keys: HashMap<(u32, String), u64>,
}

/// Registers `apps`: verifies and loads their handlers, registers their regions under fresh
/// rkeys.
pub fn install(apps: &[AppSpec], verifier: &VerifierConfig) -> Result<Installed, ClusterError> {
    install_with(
        apps,
        verifier,
        &naam_vm::CodeCache::process(),
        &mut |_, r| Ok((RegionMemory::from_bytes(&r.contents), None)),
        0,
    )
}

/// [`install`] with region memory (and optionally rkeys) from `backing`, in a region table
/// with room for `spare_regions` more.
pub fn install_with(
    apps: &[AppSpec],
    verifier: &VerifierConfig,
    code_cache: &Arc<naam_vm::CodeCache>,
    backing: &mut RegionBackingFn,
    spare_regions: usize,
) -> Result<Installed, ClusterError> {
    let start: usize = apps.iter().map(|a| a.regions.len()).sum();
    let regions = RegionTable::with_capacity(start.saturating_add(spare_regions));
    let mut registry = Registry::with_code_cache(code_cache.clone());
    let mut region_keys = HashMap::new();
    for app in apps {
        registry.add_app(app.id, &app.name, app.owner)?;
        registry.add_handlers(app.id, &app.object, &app.handlers, verifier)?;
        for r in &app.regions {
            let backed = backing(app.id, r)?;
            let region = register_region(&regions, app.id, r, backed)?;
            region_keys.insert((app.id, r.name.clone()), region.rkey);
        }
    }
    Ok(Installed {
        regions,
        registry,
        region_keys,
    })
}

/// Registers region `r` of `app` in `regions`, with the memory (and rkey, if one is asked
/// for) its backing gave.
fn register_region(
    regions: &RegionTable,
    app: u32,
    r: &RegionSpec,
    (mem, key): (RegionMemory, Option<u64>),
) -> Result<Arc<crate::Region>, ClusterError> {
    match key {
        None => regions.register(app, &r.name, r.access, mem),
        Some(k) => regions.register_with_key(k, app, &r.name, r.access, mem),
    }
    .map_err(|e| ClusterError::Region {
        app,
        region: r.name.clone(),
        message: e.to_string(),
    })
}

/// The reply to `req` that outcome `c` makes; its payload is moved in, not shared again.
pub(crate) fn reply_for(
    req: &Request,
    c: Outcome,
    placement: Placement,
    load: LoadFeedback,
) -> Reply {
    let mut r = Reply::unanswered();
    write_reply_for(&mut r, req, c, placement, load);
    r
}

/// [`reply_for`], written over `out` field by field where it lies (a reply built apart and
/// moved in is copied, in wide loads of what narrow stores had just written).
#[inline(always)]
pub(crate) fn write_reply_for(
    out: &mut Reply,
    req: &Request,
    c: Outcome,
    placement: Placement,
    load: LoadFeedback,
) {
    out.app = req.app;
    out.request_id = req.request_id;
    out.status = c.status;
    out.code = c.code;
    out.steps = c.steps;
    out.placement = placement;
    out.load = load;
    out.payload = c.payload;
}

pub(crate) use naam_proto::endpoint::error_reply;
use naam_proto::endpoint::error_reply_for;
use naam_proto::endpoint::Routed;

impl Cluster {
    /// A new builder.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::new()
    }

    /// The rkey of `app`'s region `name`.
    pub fn region_key(&self, app: u32, name: &str) -> Option<u64> {
        let a = self.inner.apps.get(app)?;
        a.region_keys
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, k)| k)
    }

    /// A copy of region memory (tests, inspection).
    pub fn region_snapshot(&self, app: u32, name: &str) -> Option<Vec<u8>> {
        let key = self.region_key(app, name)?;
        self.inner.regions.get(app, key).map(|r| r.mem.snapshot())
    }

    /// Latencies and operation counts of calls made through this cluster's in-process clients
    /// (remote clients' calls are not recorded), and the timeline of steering decisions.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Takes host executor capacity away for experiments, and gives it back.
    pub fn congestion(&self) -> &CongestionInjector {
        &self.inner.congestion
    }

    /// Current weights of a handler.
    pub fn weights(&self, app: u32, handler: u32) -> Weights {
        self.inner.weights((app, handler))
    }

    /// What an eSwitch ahead of the host steers to the NIC, per read handler: its steering
    /// key ([`naam_ebpf::eswitch::steer_key`]) and the NIC's per-mille share from the weights
    /// ([`Weights::nic_permille`]), or `pinned` (an operator's pin, at most 1000); 0 for every
    /// handler while the NIC is down (a pin never sends work to a dead NIC). naam-server's
    /// XDP map and the simulator's eSwitch are both written from it.
    pub fn eswitch_shares(&self, pinned: Option<u32>) -> Vec<(u64, u32)> {
        let up = self.remote_nic_up();
        let registry = self.registry();
        registry
            .apps()
            .flat_map(|app| app.handlers.values())
            .filter_map(|h| self.eswitch_share_of(&registry, h, up, pinned))
            .collect()
    }

    /// [`Cluster::eswitch_shares`] of the handlers of `keys` only (those that exist and read).
    pub fn eswitch_shares_of(&self, keys: &[HandlerKey], pinned: Option<u32>) -> Vec<(u64, u32)> {
        let up = self.remote_nic_up();
        let registry = self.registry();
        keys.iter()
            .filter_map(|&(app, handler)| registry.handler(app, handler).ok())
            .filter_map(|h| self.eswitch_share_of(&registry, h, up, pinned))
            .collect()
    }

    /// One read handler's eSwitch entry (`None` for a write).
    fn eswitch_share_of(
        &self,
        registry: &Registry,
        h: &HandlerEntry,
        up: bool,
        pinned: Option<u32>,
    ) -> Option<(u64, u32)> {
        if h.kind != HandlerKind::Read {
            return None;
        }
        // The NIC runs an app's handlers only once it serves their version.
        let current = self.inner.remote_nic_current(registry, h.app);
        let share = match (up && current, pinned) {
            (false, _) => 0,
            (true, Some(p)) => p.min(1000),
            (true, None) => self.weights(h.app, h.id).nic_permille(),
        };
        Some((naam_ebpf::eswitch::steer_key(h.app, h.id), share))
    }

    /// What every eSwitch share depends on besides its handler's weights: the registry's
    /// version, whether the NIC is up, and the registry version it serves. While this stays
    /// the same, the shares that can have moved are those of
    /// [`Cluster::take_weight_changes`].
    pub fn eswitch_epoch(&self) -> (u64, bool, u64) {
        (
            self.registry().version(),
            self.remote_nic_up(),
            self.inner.remote_nic_version.load(Ordering::Acquire),
        )
    }

    /// The handlers whose weights changed since the last call, or `None` when they are not
    /// known (the first call, which starts the keeping, or more than
    /// [`MAX_KEPT_WEIGHT_CHANGES`] changes since the last): the caller then reads every
    /// share. One taker at a time (naam-server's eSwitch).
    pub fn take_weight_changes(&self) -> Option<Vec<HandlerKey>> {
        let mut c = self
            .inner
            .weight_changes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let known = c.kept && !c.overflowed;
        c.kept = true;
        c.overflowed = false;
        let keys = std::mem::take(&mut c.keys);
        known.then_some(keys)
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
        let registry = self.inner.registry.load();
        route(&self.inner, &registry, req, &mut Selector::default(), None).map(|(p, _)| p)
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
    /// [`Routed::Remote`] for the caller to forward.
    pub fn dispatch(
        &self,
        req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        on_reply: impl FnOnce(Reply) + Send + 'static,
    ) -> Routed {
        let echo = Echo::of(&req);
        match submit(
            &self.inner,
            req,
            sel,
            forced,
            ReplySink::Func(Box::new(on_reply)),
        ) {
            Ok(p) => Routed::Queued(p),
            Err(Refusal::Remote(r)) => Routed::Remote(r),
            Err(refusal) => Routed::Refused(refusal.reply_to(echo)),
        }
    }

    /// [`Cluster::dispatch`] for a thread that is itself one of `runner`'s placement's cores
    /// (naam-server's receive loop for the host, naam-nic's for the NIC): a message routed
    /// there runs at once on this thread, to completion, and its reply is written into `out`
    /// ([`Routed::Answered`]) with no hand-off; a message routed elsewhere is queued or handed
    /// back for forwarding as `dispatch` does, its reply going to the callback `on_reply`
    /// makes. `on_reply` is called only for a message that waits at an executor: one
    /// answered here pays nothing for a callback it would never use. `req` is taken (leaving
    /// [`Request::taken`]) only when it is kept: queued, parked or handed back; one run here
    /// stays where it is.
    pub fn dispatch_here<F: FnOnce(Reply) + Send + 'static>(
        &self,
        runner: &mut HereRunner,
        req: &mut Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        on_reply: impl FnOnce() -> F,
        out: &mut Reply,
    ) -> Routed {
        RegistryView::with(
            runner,
            |r| &mut r.registry,
            |runner, registry| {
                self.dispatch_with(runner, registry, req, sel, forced, on_reply, out)
            },
        )
    }

    /// [`Cluster::dispatch_here`] on the registry version `registry`.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_with<F: FnOnce(Reply) + Send + 'static>(
        &self,
        runner: &mut HereRunner,
        registry: &Registry,
        req: &mut Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        on_reply: impl FnOnce() -> F,
        out: &mut Reply,
    ) -> Routed {
        let inner = &*self.inner;
        let echo = Echo::of(req);
        match admit_here(inner, registry, req, sel, forced, Some(runner.placement)) {
            Ok(Admitted::Remote) => Routed::Remote(Box::new(std::mem::take(req))),
            Ok(Admitted::Here(p, _, handler)) => match runner.run(inner, req, handler, out) {
                Ran::Answered => Routed::Answered,
                Ran::Parked(run, write) => {
                    // A torn read waits at an executor, not on the thread that serves
                    // everyone's datagrams.
                    let job = Job {
                        req: std::mem::take(req),
                        enqueued: inner.clock.now(),
                        sink: ReplySink::Func(Box::new(on_reply())),
                        parked: Some((run, write)),
                        handler: handler.clone(),
                    };
                    park_at(inner, p, job)
                }
            },
            Ok(Admitted::Queue(p, write, handler)) => {
                let app = req.app;
                match enqueue(
                    inner,
                    p,
                    std::mem::take(req),
                    ReplySink::Func(Box::new(on_reply())),
                    handler.clone(),
                ) {
                    Ok(()) => Routed::Queued(p),
                    Err(e) => {
                        if write {
                            release_owner(inner, app);
                        }
                        Routed::Refused(Refusal::Client(e).reply_to(echo))
                    }
                }
            }
            Err(refusal) => Routed::Refused(refusal.reply_to(echo)),
        }
    }

    /// One steering decision now, for a simulated cluster ([`ClusterConfig::simulated`]),
    /// whose simulator calls this every steering period of virtual time. Returns whether
    /// anything ran or waited during the period; false, doing nothing, for a cluster whose
    /// controller has a thread of its own or that runs none.
    pub fn steer(&self) -> bool {
        let mut driven = self.inner.driven.lock().unwrap_or_else(|e| e.into_inner());
        match driven.as_mut() {
            Some(controller) => decide_all(&self.inner, controller, false),
            None => false,
        }
    }

    /// A runner for a thread that serves this cluster's `placement` itself
    /// ([`Cluster::dispatch_here`]).
    pub fn here_runner(&self, placement: Placement) -> HereRunner {
        HereRunner::new(&self.inner, placement)
    }

    /// A fresh client id (the top 24 bits of the request ids a client makes, so that ids of
    /// different clients never collide in write deduplication).
    pub fn next_client_id(&self) -> u32 {
        self.inner.next_client.fetch_add(1, Ordering::SeqCst) & 0xff_ffff
    }

    /// Every app's accounting since the cluster started: handler time per placement in this
    /// process, and the periods in which it spent a tenant budget.
    pub fn app_accounts(&self) -> Vec<AppAccount> {
        self.inner.app_accounts()
    }

    /// Every app and handler, as the latest deploy left them: a snapshot, which a deploy
    /// after this call does not change.
    pub fn registry(&self) -> arc_swap::Guard<Arc<Registry>> {
        self.inner.registry.load()
    }

    /// The table of every app's regions, by rkey.
    pub fn regions(&self) -> &Arc<RegionTable> {
        &self.inner.regions
    }

    /// The configuration the cluster was built with.
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

    /// The remote NIC serves the handlers of registry version `version` (its load report's
    /// manifest version): reads of an app deployed after it stay at the host until it
    /// catches up.
    pub fn set_remote_nic_version(&self, version: u64) {
        self.inner
            .remote_nic_version
            .store(version, Ordering::Release);
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
        // What the steering did not take before it stopped still counts in the accounts.
        self.inner.apply_local_reports();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where a server-bound message goes, and its handler's kind; no side effects. A read
/// `forced` to a placement goes there (the caller pinned it).
fn route<'a>(
    inner: &Inner,
    registry: &'a Registry,
    req: &Request,
    sel: &mut Selector,
    forced: Option<Placement>,
) -> Result<(Placement, &'a Arc<HandlerEntry>), Status> {
    let handler = registry
        .handler(req.app, req.handler)
        .map_err(|e| match e {
            crate::LookupError::UnknownApp(_) => Status::UnknownApp,
            _ => Status::UnknownHandler,
        })?;
    if handler.kind == HandlerKind::Write {
        let owner = inner.owner_of(req.app).ok_or(Status::UnknownApp)?;
        return Ok((owner, handler));
    }
    // A remote NIC still on handlers older than this app's runs none of its reads.
    let nic_ok = |p: Placement| {
        p != Placement::Nic
            || !inner.config.remote_nic
            || inner.remote_nic_current(registry, req.app)
    };
    if let Some(p) = forced {
        // A read pinned where it runs: the weights (a lock and a lookup) would not be used.
        return Ok((if nic_ok(p) { p } else { Placement::Host }, handler));
    }
    let w = inner.weights((req.app, req.handler));
    sel.pick(&w, |p| {
        p != Placement::Client && inner.available(p) && nic_ok(p)
    })
    .map(|p| (p, handler))
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

/// What a refusal's reply echoes of its request: kept by a caller that hands the request on,
/// in place of a copy of it.
#[derive(Clone, Copy, Debug)]
struct Echo {
    app: u32,
    request_id: u64,
    steps: u16,
}

impl Echo {
    fn of(req: &Request) -> Echo {
        Echo {
            app: req.app,
            request_id: req.request_id,
            steps: req.steps,
        }
    }
}

impl Refusal {
    fn reply(self, req: &Request) -> Reply {
        self.reply_to(Echo::of(req))
    }

    /// The reply to the request `to` echoes.
    fn reply_to(self, to: Echo) -> Reply {
        let answer = |status, placement, why| {
            error_reply_for(to.app, to.request_id, to.steps, status, placement, why)
        };
        match self {
            Refusal::Status(s) => answer(s, Placement::Host, format!("not routed: {s:?}")),
            Refusal::Client(e) => {
                let status = match e {
                    ClientError::Busy(_) => Status::Busy,
                    _ => Status::Unavailable,
                };
                answer(status, Placement::Host, e.to_string())
            }
            Refusal::Remote(_) => answer(
                Status::Unavailable,
                Placement::Nic,
                "the NIC runs in another process and this caller cannot forward".into(),
            ),
            Refusal::Budget(what) => answer(
                Status::Busy,
                Placement::Host,
                format!(
                    "app {} spent its {what} budget for this period: retry later",
                    to.app
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
    let registry = inner.registry.load();
    match admit_here(inner, &registry, &req, sel, forced, None)? {
        Admitted::Remote => Err(Refusal::Remote(Box::new(req))),
        // Without a placement of its own, the caller runs nothing: "here" is a queue.
        Admitted::Here(p, write, handler) | Admitted::Queue(p, write, handler) => {
            let app = req.app;
            let result = enqueue(inner, p, req, sink, handler.clone());
            if result.is_err() && write {
                release_owner(inner, app);
            }
            result.map(|()| p).map_err(Refusal::Client)
        }
    }
}

/// Where an admitted message runs.
enum Admitted<'a> {
    /// Here, at placement `.0`, the caller's; `.1`: a write, counted in flight at its owner
    /// (its run releases it); `.2`: its handler, as routing found it (the run looks it up
    /// no more).
    Here(Placement, bool, &'a Arc<HandlerEntry>),
    /// Queued at placement `.0`'s executors; `.1`: a write, counted in flight at its owner;
    /// `.2`: its handler, which the executor runs whatever deploy comes in between.
    Queue(Placement, bool, &'a Arc<HandlerEntry>),
    /// A read routed to a NIC in another process: the fabric driver forwards it.
    Remote,
}

/// Routes `req` and admits it: the app's budget, a write's owner (counted in flight from here
/// until its run finishes; an owner handoff waits for the count to drain), a read steered to
/// a NIC in another process. It runs here when it is routed to `here`, whose executors are
/// the caller; otherwise it is for a queue. The request stays with the caller (it is large:
/// admission reads it, and moving it in and back out cost two copies per message).
fn admit_here<'a>(
    inner: &Inner,
    registry: &'a Registry,
    req: &Request,
    sel: &mut Selector,
    forced: Option<Placement>,
    here: Option<Placement>,
) -> Result<Admitted<'a>, Refusal> {
    // A read `forced` somewhere is routed there; a write always goes to its owner.
    let (p, handler) = route(inner, registry, req, sel, forced).map_err(Refusal::Status)?;
    let app = req.app;
    let write = handler.kind == HandlerKind::Write;
    if let Some(what) = inner.over_budget(app) {
        return Err(Refusal::Budget(what));
    }
    if p == Placement::Nic && inner.queues[p.index()].is_none() && inner.config.remote_nic {
        if write {
            return Err(Refusal::Status(Status::NotOwner));
        }
        return Ok(Admitted::Remote);
    }
    if write {
        let o = inner
            .owner(app)
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
    if here == Some(p) && inner.queues[p.index()].is_some() {
        Ok(Admitted::Here(p, write, handler))
    } else {
        Ok(Admitted::Queue(p, write, handler))
    }
}

/// Hands a message parked for a torn-read retry to `p`'s executors, which resume it when due;
/// a queue that cannot take it answers it `Busy` at once.
fn park_at(inner: &Inner, p: Placement, job: Job) -> Routed {
    match enqueue_job(inner, p, job) {
        Ok(()) => Routed::Queued(p),
        Err(refused) => {
            let (e, job) = *refused;
            refuse_queued(inner, job, p, e.to_string());
            Routed::Queued(p)
        }
    }
}

fn enqueue(
    inner: &Inner,
    p: Placement,
    req: Request,
    sink: ReplySink,
    handler: Arc<HandlerEntry>,
) -> Result<(), ClientError> {
    let job = Job {
        req,
        enqueued: inner.clock.now(),
        sink,
        parked: None,
        handler,
    };
    enqueue_job(inner, p, job).map_err(|refused| refused.0)
}

/// Puts `job` in `p`'s fair queue; a full queue may make room by refusing the newest message
/// of the app with the longest backlog. Hands the job back with the reason when it cannot
/// wait there.
fn enqueue_job(inner: &Inner, p: Placement, job: Job) -> Result<(), Box<(ClientError, Job)>> {
    let Some(q) = &inner.queues[p.index()] else {
        return Err(Box::new((ClientError::Shutdown, job)));
    };
    if inner.shutdown.load(Ordering::SeqCst) {
        return Err(Box::new((ClientError::Shutdown, job)));
    }
    match q.push(job.req.app, job) {
        Ok(None) => Ok(()),
        Ok(Some((_, out))) => {
            // A longer backlog of another app made room: its newest message is refused.
            let why = format!(
                "the {p} queue is full and app {} holds the longest backlog: retry later",
                out.req.app
            );
            refuse_queued(inner, out, p, why);
            Ok(())
        }
        Err(PushError::Full(job)) => Err(Box::new((ClientError::Busy(p), job))),
        Err(PushError::Closed(job)) => Err(Box::new((ClientError::Shutdown, job))),
    }
}

/// Answers a queued message that will not run with `Busy`: a write leaves its owner, and a
/// write parked mid-run also records the answer for its request id.
fn refuse_queued(inner: &Inner, job: Job, p: Placement, why: String) {
    let reply = error_reply(&job.req, Status::Busy, p, why);
    match job.parked {
        Some((_, write)) => {
            let c = Outcome::error(
                Status::Busy,
                0,
                String::from_utf8_lossy(&reply.payload),
                job.req.steps,
            );
            inner.spend(job.req.app, 0, job.req.steps as u64);
            let _ = served(inner, &job.req, Driven::Done(c, RunCost::default()), write);
        }
        None => {
            if job.handler.kind == HandlerKind::Write {
                release_owner(inner, job.req.app);
            }
        }
    }
    job.sink.send(reply);
}
