//! The simulated deployment and its event loop: clients (each a `ClientEndpoint` under its
//! app's own pipelined client library), naam-server's receive loops (one `ServerEndpoint` per host
//! core over the host cluster) and naam-nic's (one `NicEndpoint` per Arm core over the NIC
//! cluster), joined by the [`Rack`]. Events are kept in time order, ties broken by the order
//! they were scheduled, so a run replays exactly.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;

use anyhow::Context as _;
use bytes::Bytes;
use hdrhistogram::Histogram;
use serde::Serialize;

use naam_runtime::cluster::{run_at_client, Cluster, ClusterConfig, Simulated};
use naam_runtime::executor::ClientPath;
use naam_runtime::proto::endpoint::{
    ClientConfig, ClientEndpoint, ClientEvent, NicConfig, NicEndpoint, ServerConfig,
    ServerEndpoint, SessionDirectory, Transmit,
};
use naam_runtime::proto::entropy::Entropy;
use naam_runtime::proto::session::{self, CookieJar, Credential};
use naam_runtime::proto::shard::{self, Shard};
use naam_runtime::proto::step::HandlerKind;
use naam_runtime::proto::transport::ClientError;
use naam_runtime::proto::wire::{flags, Reply};
use naam_runtime::proto::{Nanos, Placement};
use naam_runtime::udp::{self, HostRegions};
use naam_runtime::VirtualClock;

use super::apps::{Pipe, SimApp};
use super::backends::{ClientIo, SimHost, SimNic, SimReads, SimTransport};
use super::net::Rack;
use super::{client_insn_ns, CostModel, EngineQueue, Profile};
use crate::driver::App;
use crate::ycsb::{KeyChooser, Op, RecordShape, Rng, Workload};

/// What to simulate.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct SimConfig {
    /// The hardware.
    pub profile: Profile,
    /// Every random draw comes from it.
    pub seed: u64,
    /// Records loaded before the run (YCSB's `recordcount`).
    pub records: u64,
    /// Client machines (each one YCSB client thread with its own session).
    pub clients: usize,
    /// Operations each client keeps outstanding.
    pub window: usize,
    /// Each client's target, operations per second (YCSB's `-target` split over threads);
    /// `None`: as fast as its window allows.
    pub target_per_client: Option<f64>,
    /// The app every tenant runs.
    pub app: App,
    /// Apps (tenants) served, each with its own regions and handlers; clients are spread over
    /// them in turn, records evenly.
    pub apps: usize,
    /// The core workload's letter (`a`..`f`; MICA runs those without scans).
    pub workload: char,
    /// Virtual time before measuring (sessions, pairing, steering settling).
    pub warmup_ns: Nanos,
    /// Virtual time measured.
    pub measure_ns: Nanos,
    /// Reads pinned to a placement (a placement baseline, as `ycsb --placement`: Client runs
    /// them at the clients over one-sided READs); `None`: the steering decides between host
    /// and NIC.
    pub pin: Option<Placement>,
    /// The host congested (each message `extra_ns` slower) from `from_ns` to `to_ns` after
    /// the measured window starts, as `naam-bench experiment congestion` does over UDP.
    pub congestion: Option<Congestion>,
    /// Width of the report's timeline buckets; `None`: no timeline.
    pub bucket_ns: Option<Nanos>,
    /// Servers behind the switch, each with its SmartNIC; every client has a session with
    /// each, and a record lives on the server its key's hash names.
    pub servers: usize,
    /// The loops report what each message waited in their receive ring to the steering
    /// ([`naam_runtime::cluster::HereRunner::received`]). The deployment's loops do not yet (a
    /// socket hides its queue), so by default neither do the simulation's.
    pub loop_waits: bool,
}

/// A window of host congestion ([`SimConfig::congestion`]).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Congestion {
    /// Start, after the measured window's start.
    pub from_ns: Nanos,
    /// End, after the measured window's start.
    pub to_ns: Nanos,
    /// Extra service time of every host message meanwhile.
    pub extra_ns: Nanos,
}

/// Operations finished in one bucket of the measured window.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Bucket {
    /// Its start, milliseconds after the measured window's.
    pub start_ms: f64,
    /// Operations answered by each placement ([`Placement::index`] order).
    pub placed: [u64; 3],
    /// Their mean latency, microseconds.
    pub mean_us: f64,
}

impl SimConfig {
    /// YCSB-B on MICA with `clients` closed-loop clients of window 1, 10,000 records, 10 ms of
    /// warm-up and 50 ms measured.
    pub fn new(profile: Profile, seed: u64, clients: usize) -> SimConfig {
        SimConfig {
            profile,
            seed,
            records: 10_000,
            clients,
            window: 1,
            target_per_client: None,
            app: App::Mica,
            apps: 1,
            workload: 'b',
            warmup_ns: 10_000_000,
            measure_ns: 50_000_000,
            pin: None,
            congestion: None,
            bucket_ns: None,
            servers: 1,
            loop_waits: false,
        }
    }
}

/// Latency percentiles, microseconds.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Latency {
    /// Operations measured.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
}

/// What a run gave: deterministic for its configuration and seed (no wall-clock figure).
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// `sim:<profile>`: a model of that hardware, not a measurement.
    pub mode: String,
    /// What ran.
    pub config: SimConfig,
    /// Operations completed per virtual second in the measured window.
    pub throughput_ops: f64,
    /// Every operation's latency.
    pub latency: Latency,
    /// Reads'.
    pub read_latency: Latency,
    /// Updates'.
    pub update_latency: Latency,
    /// Operations answered by each placement ([`Placement::index`] order: client, NIC, host).
    pub placed: [u64; 3],
    /// Operations that failed.
    pub failed: u64,
    /// Busy fraction of the host cores and of the NIC cores over the measured window.
    pub host_busy: f64,
    /// See `host_busy`.
    pub nic_busy: f64,
    /// Messages the host cores and the NIC cores took in over the measured window (requests,
    /// forwards, control and load reports; a datagram may carry several).
    pub host_messages: u64,
    /// See `host_messages`.
    pub nic_messages: u64,
    /// Messages a full receive ring dropped (the whole run).
    pub rx_drops: u64,
    /// The clients' exchanges over the whole run: first sends, resends at a timeout, resends
    /// on later answers (a loss found early), and resends found needless.
    pub client_sent: u64,
    /// See `client_sent`.
    pub client_resends: u64,
    /// See `client_sent`.
    pub client_early_resends: u64,
    /// See `client_sent`.
    pub client_spurious_resends: u64,
    /// Frames on the links, and frames lost.
    pub frames: u64,
    /// See `frames`.
    pub lost_frames: u64,
    /// One-sided READs the clients made (the Client placement), and of those lost on the
    /// links and posted again.
    pub one_sided_reads: u64,
    /// See `one_sided_reads`.
    pub lost_reads: u64,
    /// Events simulated.
    pub events: u64,
    /// Per bucket of [`SimConfig::bucket_ns`] (empty without).
    pub timeline: Vec<Bucket>,
}

/// Where an event happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Client(usize),
    /// A receive loop of a naam-server (a host core), numbered across the servers: server
    /// `i / host.cores`, loop `i % host.cores`.
    Host(usize),
    /// A receive loop of a naam-nic (an Arm core), numbered likewise.
    Nic(usize),
}

#[derive(Debug)]
enum Event {
    /// A message arrived whole at `to`'s receive queue.
    Arrive {
        to: Node,
        from: SocketAddr,
        msg: Bytes,
    },
    /// A core finished the message it took: what it sent goes out, the next is taken.
    Done(Node),
    /// An endpoint's timer, valid while its generation is the armed one.
    Timer(Node, u64),
    /// A rate-limited client may issue again.
    Issue(usize),
    /// A steering period ended.
    Steer,
    /// The host's congestion starts (`Some(extra ns)`) or ends.
    Congest(Option<Nanos>),
    /// A sleeping core (or client) is awake.
    Woken(Node),
    /// A core (or client) stops polling, if this is still its current spin.
    SpinEnd(Node, u64),
    /// A poller's processor, yielded, goes to the core waiting longest.
    Yielded,
    /// Client `.0`'s read `.1`, run at the Client placement, posts its next one-sided READ
    /// (or ends, when it has none left).
    ReadStep(usize, u64),
}

struct Scheduled {
    at: Nanos,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// The future, in time order.
#[derive(Default)]
struct Agenda {
    heap: BinaryHeap<Reverse<Scheduled>>,
    seq: u64,
    popped: u64,
}

impl Agenda {
    fn at(&mut self, at: Nanos, event: Event) {
        self.seq += 1;
        self.heap.push(Reverse(Scheduled {
            at,
            seq: self.seq,
            event,
        }));
    }

    fn next(&mut self) -> Option<(Nanos, Event)> {
        let Reverse(s) = self.heap.pop()?;
        self.popped += 1;
        Some((s.at, s.event))
    }
}

/// Whether a core (or a client) polls after its last message, is waking, or sleeps: naam's
/// loops poll a moment ([`super::profile::HostProfile::spin_ns`]), yielding their processor to
/// any other thread with work, then sleep; a message that finds one asleep waits for its
/// wake-up.
#[derive(Debug, Default)]
struct Wake {
    spinning: bool,
    /// Tells a stale [`Event::SpinEnd`] from the current one.
    spin_gen: u64,
    waking: bool,
    /// Awake (just woken, or waiting for a processor): the next start needs no wake-up.
    awake: bool,
    /// Polling on a processor it holds (shared processors): its next work starts at once,
    /// and whoever else needs a processor takes this one once the poller yields.
    holds_cpu: bool,
    /// How long it polls before it sleeps: the deployment's own adaptive poller (three times
    /// the recent gap between its work and the next datagram, up to the profile's
    /// `spin_ns`); `None`: it never polls.
    poller: Option<naam_runtime::udp::Poller>,
    /// In its receive (between finishing its work and the next datagram or timeout).
    receiving: bool,
}

impl Wake {
    /// The wake state of a node that polls at most `spin_ns` (never, at 0).
    fn polling_up_to(spin_ns: Nanos) -> Wake {
        Wake {
            poller: (spin_ns > 0)
                .then(|| naam_runtime::udp::Poller::new(std::time::Duration::from_nanos(spin_ns))),
            ..Wake::default()
        }
    }

    /// It finished its work at `now` and goes back to its receive: how long it polls.
    fn idle(&mut self, now: Nanos) -> Nanos {
        self.receiving = true;
        self.poller.as_mut().map_or(0, |p| {
            p.served(now);
            p.spin().as_nanos() as Nanos
        })
    }

    /// Its receive returned at `now`, with a datagram (`got`) or at a timeout.
    fn returned(&mut self, now: Nanos, got: bool) {
        if std::mem::take(&mut self.receiving) {
            if let Some(p) = &mut self.poller {
                p.arrived(now, got);
            }
        }
    }
}

/// A core with its receive queue, and the timer its endpoint asked for.
struct Core<E> {
    endpoint: E,
    /// Messages in the receive ring, with when each arrived.
    queue: VecDeque<(SocketAddr, Bytes, Nanos)>,
    busy: bool,
    /// What the message being served sends, when it is done.
    outbox: Vec<Transmit>,
    timer: (Option<Nanos>, u64),
    busy_ns: u64,
    /// Messages taken in during the measured window.
    messages: u64,
    wake: Wake,
}

impl<E> Core<E> {
    fn new(endpoint: E, wake: Wake) -> Core<E> {
        Core {
            endpoint,
            queue: VecDeque::new(),
            busy: false,
            outbox: Vec::new(),
            timer: (None, 0),
            busy_ns: 0,
            messages: 0,
            wake,
        }
    }

    /// Puts a message in the receive ring, which holds `ring`: whether the core is idle (to be
    /// started), or `None` when the ring was full and the message is dropped.
    fn take_in(&mut self, ring: usize, from: SocketAddr, msg: Bytes, now: Nanos) -> Option<bool> {
        if self.queue.len() >= ring {
            return None;
        }
        self.queue.push_back((from, msg, now));
        Some(!self.busy)
    }
}

/// One client machine: its endpoint, MICA's pipeline over it, and its workload.
/// A client's session with one server, and its app's pipeline over it.
struct Conn {
    endpoint: ClientEndpoint,
    io: Rc<RefCell<ClientIo>>,
    pipe: Pipe,
    /// Exchange id → the pipeline's token.
    exchanges: naam_runtime::proto::intmap::IntMap<u64, u64>,
    connected: bool,
    /// One-sided READs of this server's memory (the Client placement).
    reads: ClientPath<SimReads>,
}

/// A read run at the Client placement, its READs being timed: the reply its handler made, and
/// what is left of its steps.
struct ClientRead {
    /// The server whose memory it reads.
    server: usize,
    /// The pipeline's token.
    token: u64,
    reply: Reply,
    /// Bytes of each READ still to make.
    reads: VecDeque<u64>,
    /// The client's processor per step (its handler's instructions, spread over the steps).
    step_ns: Nanos,
}

struct SimClient {
    addr: SocketAddr,
    /// One per server.
    conns: Vec<Conn>,
    /// Operation tag → (issued at, is a read).
    issued: naam_runtime::proto::intmap::IntMap<u64, (Nanos, bool)>,
    next_tag: u64,
    /// Records still to load (the load phase), then `None`.
    loading: Option<std::ops::Range<u64>>,
    rng: Rng,
    keys: KeyChooser,
    /// Earliest time the next operation may go (a target rate).
    next_issue: Nanos,
    /// The time an [`Event::Issue`] is scheduled for, if one is.
    issue_armed: Option<Nanos>,
    /// Messages waiting for the client's processor (shared processors only), and whether one
    /// is being sent.
    sending: VecDeque<Transmit>,
    send_busy: bool,
    wake: Wake,
    /// Messages that found the client asleep, taken in when it has woken.
    inbox: Vec<(SocketAddr, Bytes)>,
    /// Without shared processors: polling for answers until then (after its last send).
    spin_until: Nanos,
    timer: (Option<Nanos>, u64),
    /// The engine that runs the client's own handlers (the Client placement).
    vm: naam_runtime::vm::Vm,
    /// Reads run here whose READs are being timed, by run number.
    local_reads: naam_runtime::proto::intmap::IntMap<u64, ClientRead>,
    next_read: u64,
    /// The placement of a local read that just ended, for the next progress to count.
    local_placed: Option<Placement>,
}

struct World {
    cfg: SimConfig,
    clock: Arc<VirtualClock>,
    agenda: Agenda,
    rack: Rack,
    net_rng: Rng,
    /// Per server: its address, its NIC's, and its host cluster.
    server_addrs: Vec<SocketAddr>,
    nic_addrs: Vec<SocketAddr>,
    host_clusters: Vec<Arc<Cluster>>,
    /// Every server's loops, server after server.
    hosts: Vec<Core<ServerEndpoint<SimHost>>>,
    nics: Vec<Core<NicEndpoint<SimNic>>>,
    clients: Vec<SimClient>,
    workload: Workload,
    shape: RecordShape,
    measure_from: Nanos,
    end: Nanos,
    all: Histogram<u64>,
    reads: Histogram<u64>,
    updates: Histogram<u64>,
    placed: [u64; 3],
    failed: u64,
    completed: u64,
    loaded: u64,
    /// Messages dropped because a core's receive ring was full.
    rx_drops: u64,
    /// The timeline's buckets, and the latency sum of each.
    timeline: Vec<(Bucket, u64)>,
    /// Shared processors free, and the cores waiting for one, in order.
    free_cpus: Option<usize>,
    cpu_waiting: VecDeque<Node>,
    /// Pollers holding a processor, in the order they began to poll, and how many of them
    /// are yielding theirs to a waiting core right now.
    cpu_pollers: VecDeque<Node>,
    yielding: usize,
    /// Each server's card's RDMA engine (one-sided READs of the Client placement).
    rdma: Vec<EngineQueue>,
    /// Each server's eSwitch map: the NIC's share (per mille) of each read handler, by
    /// steering key, as naam-server writes it from the weights every steering period.
    eswitch: Vec<std::collections::HashMap<u64, u32>>,
    /// One-sided READs the clients made, and READs whose frame was lost (and re-sent).
    one_sided_reads: u64,
    lost_reads: u64,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static bounds")
}

fn latency(h: &Histogram<u64>) -> Latency {
    let us = |ns: u64| ns as f64 / 1_000.0;
    Latency {
        count: h.len(),
        mean_us: if h.is_empty() {
            0.0
        } else {
            h.mean() / 1_000.0
        },
        p50_us: us(h.value_at_quantile(0.5)),
        p99_us: us(h.value_at_quantile(0.99)),
        p999_us: us(h.value_at_quantile(0.999)),
    }
}

fn client_addr(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 1, (i / 250) as u8, (i % 250 + 1) as u8], 5000))
}

/// The client [`client_addr`] gave `addr`, if it gave one.
fn client_index(addr: SocketAddr) -> Option<usize> {
    match addr {
        SocketAddr::V4(a) if a.port() == 5000 && a.ip().octets()[..2] == [10, 1] => {
            let o = a.ip().octets();
            (o[3] >= 1).then(|| o[2] as usize * 250 + o[3] as usize - 1)
        }
        _ => None,
    }
}

/// Runs `cfg`.
pub fn run(cfg: &SimConfig) -> anyhow::Result<SimReport> {
    anyhow::ensure!(cfg.clients >= 1, "at least one client");
    anyhow::ensure!(cfg.clients <= 60_000, "at most 60,000 clients");
    anyhow::ensure!(cfg.window >= 1, "a window of at least 1");
    anyhow::ensure!(cfg.records >= 1, "at least one record");
    anyhow::ensure!(
        (1..=64).contains(&cfg.servers),
        "1 to 64 servers, not {}",
        cfg.servers
    );
    anyhow::ensure!(
        (1..=cfg.clients).contains(&cfg.apps),
        "1 to {} apps (at least one client each), not {}",
        cfg.clients,
        cfg.apps
    );
    let workload = Workload::core(cfg.workload)
        .with_context(|| format!("no core workload {:?} (a to f)", cfg.workload))?;
    anyhow::ensure!(
        !workload.has_scans(),
        "workload {} scans: the simulation's clients do not issue scans yet",
        cfg.workload
    );
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "naam-sim-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let out = World::build(cfg, workload, &dir).and_then(|mut w| w.run());
    udp::cleanup(&dir);
    out
}

impl World {
    fn build(cfg: &SimConfig, workload: Workload, dir: &std::path::Path) -> anyhow::Result<World> {
        let p = &cfg.profile;
        let entropy = Entropy::seeded(cfg.seed);
        let clock = Arc::new(VirtualClock::new(0));
        let shape = RecordShape::default();
        let pairing = Credential::generate(&entropy)?;
        // What one server holds of `records` spread by hash, with room for the spread's
        // unevenness.
        let servers = cfg.servers as u64;
        let per_server = |records: u64| match servers {
            1 => records,
            n => records.div_ceil(n) * 5 / 4 + 100,
        };
        // The records are spread over the apps; each app's over its clients.
        let mut apps = Vec::new();
        let mut host_apps = Vec::new();
        for a in 0..cfg.apps {
            let records = cfg.records / cfg.apps as u64
                + u64::from((a as u64) < cfg.records % cfg.apps as u64);
            let credential = Credential::generate(&entropy)?;
            let (app, host) = SimApp::new(
                cfg.app,
                a as u32 + 1,
                (records, per_server(records)),
                &shape,
                credential,
            )?;
            apps.push(app);
            host_apps.push(host);
        }
        let entries: Vec<_> = apps
            .iter()
            .map(|a| (a.id, a.tenant.clone(), a.credential.clone()))
            .collect();
        let tenants = session::tenant_entries(&entries, None, Some(pairing.clone()));
        let dma =
            naam_runtime::proto::step::DmaModel::new(p.nic.dma_access_ns, p.nic.dma_ps_per_byte);
        let (mut server_addrs, mut nic_addrs, mut host_clusters) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut hosts, mut nics) = (Vec::new(), Vec::new());
        for server in 0..cfg.servers {
            let dir = dir.join(format!("server{server}"));
            // Each server's costs, with its own card's DMA engine.
            let simulated = Simulated {
                clock: clock.clone(),
                service: Arc::new(CostModel::new(p, clock.clone())),
            };
            let mut host_config = ClusterConfig::functional();
            // The simulated cores (the cluster starts no thread for them).
            host_config.host_executors = p.host.cores;
            host_config.nic_executors = 0;
            host_config.steering_period = std::time::Duration::from_nanos(p.steering.period_ns);
            host_config.simulated = Some(simulated.clone());
            // Every server serves every app (its share of the records).
            let served = if server == 0 {
                std::mem::take(&mut host_apps)
            } else {
                apps.iter()
                    .map(|a| {
                        SimApp::new(
                            cfg.app,
                            a.id,
                            (a.records, per_server(a.records)),
                            &shape,
                            a.credential.clone(),
                        )
                        .map(|(_, h)| h)
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?
            };
            let (host_cluster, manifest) =
                udp::start_host_with(served, host_config, &dir, HostRegions::InProcess)?;
            let mut nic_config = ClusterConfig::functional();
            nic_config.host_executors = 0;
            nic_config.nic_executors = p.nic.cores;
            nic_config.nic.dma = dma;
            nic_config.simulated = Some(simulated.clone());
            let (nic_cluster, nic_manifest) =
                udp::start_nic_in_process(&dir, nic_config, &host_cluster)?;
            let octet = |n: usize| (n & 0xff) as u8;
            let server_addr = SocketAddr::from(([10, 0, octet(server), 1], 7000));
            let nic_addr = SocketAddr::from(([10, 0, octet(server), 2], 7000));
            let directory = SessionDirectory::new();
            let cookies = CookieJar::new(&entropy)?;
            let shards = Shard::all(p.host.cores).map_err(|e| anyhow::anyhow!("{e}"))?;
            for s in shards {
                let mut config =
                    ServerConfig::new(manifest.clone(), tenants.clone(), entropy.fork()?);
                config.shard = s;
                config.directory = directory.clone();
                let backend = SimHost {
                    runner: host_cluster.here_runner(Placement::Host),
                    cluster: host_cluster.clone(),
                    busy_ns: 0,
                    stranded: 0,
                    eswitch: p.nic.eswitch.then_some(super::backends::SimSwitch),
                };
                let ep = ServerEndpoint::new(config, backend, cookies.clone(), 0)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                hosts.push(Core::new(ep, Wake::polling_up_to(p.host.spin_ns)));
            }
            let mut nic_config =
                NicConfig::new(server_addr, nic_addr, pairing.clone(), entropy.fork()?);
            nic_config.report_every = p.steering.report_every_ns;
            let sim_nic = || SimNic {
                runner: nic_cluster.here_runner(Placement::Nic),
                cluster: nic_cluster.clone(),
                busy_ns: 0,
                stranded: 0,
                dma,
            };
            let first = NicEndpoint::new(nic_config, sim_nic(), &nic_manifest, 0);
            let others: Vec<_> = (1..p.nic.cores)
                .map(|_| {
                    Core::new(
                        first.another_loop(sim_nic()),
                        Wake::polling_up_to(p.nic.spin_ns),
                    )
                })
                .collect();
            nics.push(Core::new(first, Wake::polling_up_to(p.nic.spin_ns)));
            nics.extend(others);
            server_addrs.push(server_addr);
            nic_addrs.push(nic_addr);
            host_clusters.push(host_cluster);
        }
        let mut rng = Rng::new(entropy.u64()?);
        let mut clients = Vec::new();
        for i in 0..cfg.clients {
            // Client i serves app i mod apps, as its (i / apps)-th of `mine` clients.
            let a = &apps[i % cfg.apps];
            let mine = (cfg.clients - i % cfg.apps).div_ceil(cfg.apps) as u64;
            let nth = (i / cfg.apps) as u64;
            let per = a.records.div_ceil(mine);
            let mut conns = Vec::new();
            for (server, &to) in server_addrs.iter().enumerate() {
                let endpoint = ClientEndpoint::new(
                    ClientConfig::new(to, &a.tenant, a.credential.clone(), entropy.fork()?),
                    0,
                );
                let io = Rc::new(RefCell::new(ClientIo {
                    window: cfg.window,
                    ..ClientIo::default()
                }));
                conns.push(Conn {
                    endpoint,
                    pipe: a.pipe(&host_clusters[server], SimTransport(io.clone()))?,
                    io,
                    exchanges: Default::default(),
                    connected: false,
                    reads: ClientPath::new(SimReads {
                        regions: host_clusters[server].regions().clone(),
                        reads: Vec::new(),
                    }),
                });
            }
            let lo = (nth * per).min(a.records);
            let hi = ((nth + 1) * per).min(a.records);
            clients.push(SimClient {
                addr: client_addr(i),
                conns,
                issued: Default::default(),
                next_tag: 0,
                loading: Some(lo..hi),
                rng: Rng::new(rng.next_u64()),
                keys: KeyChooser::new(workload.distribution, a.records.max(1)),
                next_issue: 0,
                issue_armed: None,
                sending: VecDeque::new(),
                send_busy: false,
                wake: Wake::polling_up_to(p.client.spin_ns),
                inbox: Vec::new(),
                spin_until: 0,
                timer: (None, 0),
                vm: naam_runtime::vm::Vm::new(),
                local_reads: Default::default(),
                next_read: 0,
                local_placed: None,
            });
        }
        let rack = Rack::new(p, cfg.clients + cfg.servers);
        Ok(World {
            cfg: cfg.clone(),
            clock,
            agenda: Agenda::default(),
            rack,
            net_rng: Rng::new(rng.next_u64()),
            server_addrs,
            nic_addrs,
            host_clusters,
            hosts,
            nics,
            clients,
            workload,
            shape,
            measure_from: Nanos::MAX,
            end: Nanos::MAX,
            all: histogram(),
            reads: histogram(),
            updates: histogram(),
            placed: [0; 3],
            failed: 0,
            completed: 0,
            loaded: 0,
            rx_drops: 0,
            timeline: Vec::new(),
            free_cpus: cfg.profile.machine.shared_cpus,
            cpu_waiting: VecDeque::new(),
            cpu_pollers: VecDeque::new(),
            yielding: 0,
            rdma: (0..cfg.servers)
                .map(|_| EngineQueue::new(p.nic.rdma_reads_per_s))
                .collect(),
            one_sided_reads: 0,
            lost_reads: 0,
            eswitch: vec![Default::default(); cfg.servers],
        })
    }

    fn run(&mut self) -> anyhow::Result<SimReport> {
        for i in 0..self.nics.len() {
            self.rearm(Node::Nic(i), 0);
        }
        // Every NIC loop's first timeout starts the pairing; clients connect once it has.
        self.agenda
            .at(self.cfg.profile.steering.period_ns, Event::Steer);
        for i in 0..self.clients.len() {
            for c in &mut self.clients[i].conns {
                c.endpoint.connect(0);
            }
            self.flush_client(i, 0);
        }
        // Load, then warm up, then measure.
        let load_deadline = 60_000_000_000u64;
        while let Some((at, event)) = self.agenda.next() {
            if at > self.end {
                break;
            }
            anyhow::ensure!(
                self.measure_from != Nanos::MAX || at < load_deadline,
                "the load phase did not finish in {} s of virtual time ({} of {} records; \
                 {} of {} clients connected; {} events)",
                load_deadline / 1_000_000_000,
                self.loaded,
                self.cfg.records,
                self.clients
                    .iter()
                    .filter(|c| c.conns.iter().all(|c| c.connected))
                    .count(),
                self.clients.len(),
                self.agenda.popped,
            );
            self.clock.set(at);
            self.handle(at, event);
            if self.measure_from == Nanos::MAX && self.loaded >= self.cfg.records {
                self.measure_from = at + self.cfg.warmup_ns;
                self.end = self.measure_from + self.cfg.measure_ns;
                for c in &mut self.clients {
                    c.loading = None;
                    // A paced client starts at a random phase of its interval, as YCSB's
                    // threads do: started together, every client would send in the same
                    // instant of each interval, and their bursts, not the load, would set
                    // the latency.
                    if let Some(rate) = self.cfg.target_per_client {
                        let gap = (1e9 / rate) as Nanos;
                        c.next_issue = at + (c.rng.next_f64() * gap as f64) as Nanos;
                    }
                }
                if let Some(c) = self.cfg.congestion {
                    self.agenda.at(
                        self.measure_from + c.from_ns,
                        Event::Congest(Some(c.extra_ns)),
                    );
                    self.agenda
                        .at(self.measure_from + c.to_ns, Event::Congest(None));
                }
                for i in 0..self.clients.len() {
                    self.issue(i, at);
                    self.flush_client(i, at);
                }
            }
        }
        let stranded: u64 = self
            .hosts
            .iter()
            .map(|h| h.endpoint.backend().stranded)
            .sum::<u64>()
            + self
                .nics
                .iter()
                .map(|n| n.endpoint.backend().stranded)
                .sum::<u64>();
        anyhow::ensure!(
            stranded == 0,
            "{stranded} messages were queued at executors the simulation does not have"
        );
        let window = self.cfg.measure_ns as f64;
        let busy = |b: &[u64]| b.iter().sum::<u64>() as f64 / (window * b.len() as f64);
        let host_busy: Vec<u64> = self.hosts.iter().map(|h| h.busy_ns).collect();
        let nic_busy: Vec<u64> = self.nics.iter().map(|n| n.busy_ns).collect();
        Ok(SimReport {
            mode: format!("sim:{}", self.cfg.profile.name),
            config: self.cfg.clone(),
            throughput_ops: self.completed as f64 * 1e9 / window,
            latency: latency(&self.all),
            read_latency: latency(&self.reads),
            update_latency: latency(&self.updates),
            placed: self.placed,
            failed: self.failed,
            host_busy: busy(&host_busy),
            nic_busy: busy(&nic_busy),
            host_messages: self.hosts.iter().map(|h| h.messages).sum(),
            nic_messages: self.nics.iter().map(|n| n.messages).sum(),
            rx_drops: self.rx_drops,
            client_sent: self.client_stat(|e| e.stats().sent),
            client_resends: self.client_stat(|e| e.stats().resends),
            client_early_resends: self.client_stat(|e| e.stats().early_resends),
            client_spurious_resends: self.client_stat(|e| e.stats().spurious_resends),
            frames: self.rack.frames,
            lost_frames: self.rack.lost_frames,
            one_sided_reads: self.one_sided_reads,
            lost_reads: self.lost_reads,
            events: self.agenda.popped,
            timeline: self
                .timeline
                .iter()
                .map(|(b, sum)| Bucket {
                    mean_us: match b.placed.iter().sum::<u64>() {
                        0 => 0.0,
                        n => *sum as f64 / n as f64 / 1_000.0,
                    },
                    ..b.clone()
                })
                .collect(),
        })
    }

    /// A client endpoint counter summed over every client's sessions.
    fn client_stat(&self, f: impl Fn(&ClientEndpoint) -> u64) -> u64 {
        self.clients
            .iter()
            .flat_map(|c| c.conns.iter())
            .map(|c| f(&c.endpoint))
            .sum()
    }

    /// The server a datagram from `from` comes from (its naam-server or its naam-nic).
    fn server_of_addr(&self, from: SocketAddr) -> Option<usize> {
        self.server_addrs
            .iter()
            .position(|&a| a == from)
            .or_else(|| self.nic_addrs.iter().position(|&a| a == from))
    }

    fn measuring(&self, now: Nanos) -> bool {
        now >= self.measure_from && now < self.end
    }

    fn handle(&mut self, now: Nanos, event: Event) {
        match event {
            Event::Arrive { to, from, msg } => match to {
                Node::Client(i) => {
                    let shared = self.free_cpus.is_some();
                    let wakeup = self.cfg.profile.client.wakeup_ns;
                    let c = &mut self.clients[i];
                    let polling = if shared {
                        c.wake.spinning || c.send_busy
                    } else {
                        now <= c.spin_until
                    };
                    if polling || wakeup == 0 {
                        c.wake.returned(now, true);
                        if let Some(s) = self.server_of_addr(from) {
                            self.clients[i].conns[s].endpoint.handle(now, from, msg);
                        }
                        self.client_progress(i, now);
                    } else {
                        c.inbox.push((from, msg));
                        if !c.wake.waking {
                            c.wake.waking = true;
                            self.agenda.at(now + wakeup, Event::Woken(to));
                        }
                    }
                }
                Node::Host(i) => {
                    let ring = self.cfg.profile.host.rx_ring;
                    match self.hosts[i].take_in(ring, from, msg, now) {
                        None => self.rx_drops += 1,
                        Some(idle) if idle => self.serve(to, now),
                        Some(_) => {}
                    }
                }
                Node::Nic(i) => {
                    let ring = self.cfg.profile.nic.rx_ring;
                    match self.nics[i].take_in(ring, from, msg, now) {
                        None => self.rx_drops += 1,
                        Some(idle) if idle => self.serve(to, now),
                        Some(_) => {}
                    }
                }
            },
            Event::Done(node) => {
                let out = match node {
                    Node::Host(i) => {
                        self.hosts[i].busy = false;
                        std::mem::take(&mut self.hosts[i].outbox)
                    }
                    Node::Nic(i) => {
                        self.nics[i].busy = false;
                        std::mem::take(&mut self.nics[i].outbox)
                    }
                    Node::Client(i) => {
                        let c = &mut self.clients[i];
                        c.send_busy = false;
                        c.sending.pop_front().into_iter().collect()
                    }
                };
                let from = self.addr_of(node);
                for t in out {
                    self.depart(now, node, from, t);
                }
                if !matches!(node, Node::Client(_)) {
                    self.rearm(node, now);
                }
                if self.ready(node) {
                    // More work: the core goes on with the processor it has.
                    self.start(node, now);
                } else {
                    // It polls a while (yielding its processor to whoever else has work, as
                    // naam's loops do), then sleeps. With shared processors it polls on the
                    // one it has, which a core with work takes once the poller yields.
                    let spin = self.idle_poll_ns(node, now);
                    let shared = self.free_cpus.is_some();
                    if spin > 0 {
                        let w = self.wake_mut(node);
                        w.spinning = true;
                        w.spin_gen += 1;
                        w.holds_cpu = shared;
                        let generation = w.spin_gen;
                        self.agenda.at(now + spin, Event::SpinEnd(node, generation));
                    }
                    if spin > 0 && shared {
                        self.cpu_pollers.push_back(node);
                        self.preempt_pollers(now);
                    } else {
                        self.release_cpu(now);
                    }
                }
            }
            Event::SpinEnd(node, generation) => {
                let w = self.wake_mut(node);
                if w.spinning && w.spin_gen == generation {
                    w.spinning = false;
                    if std::mem::take(&mut w.holds_cpu) {
                        // It sleeps: its processor is free.
                        self.cpu_pollers.retain(|&n| n != node);
                        self.release_cpu(now);
                    }
                }
            }
            Event::Yielded => {
                self.yielding -= 1;
                self.release_cpu(now);
            }
            Event::Woken(node) => {
                let w = self.wake_mut(node);
                w.waking = false;
                w.awake = true;
                if let Node::Client(i) = node {
                    let c = &mut self.clients[i];
                    // Awake: its receive returned with what woke it.
                    c.wake.returned(now, true);
                    for (from, msg) in std::mem::take(&mut c.inbox) {
                        if let Some(s) = self.server_of_addr(from) {
                            self.clients[i].conns[s].endpoint.handle(now, from, msg);
                        }
                    }
                    self.client_progress(i, now);
                    self.clients[i].wake.awake = false;
                } else {
                    self.serve(node, now);
                }
            }
            Event::Timer(node, generation) => self.timer(node, generation, now),
            Event::ReadStep(i, run) => self.read_step(i, run, now),
            Event::Issue(i) => {
                self.issue(i, now);
                self.flush_client(i, now);
            }
            Event::Congest(extra) => {
                for c in &self.host_clusters {
                    match extra {
                        Some(ns) => c.congestion().limit_host(ns),
                        None => c.congestion().clear(),
                    }
                }
            }
            Event::Steer => {
                for c in &self.host_clusters {
                    c.steer();
                }
                if self.cfg.profile.nic.eswitch {
                    self.sync_eswitch();
                }
                // The clusters log their own shifts (RUST_LOG=naam_runtime=debug).
                self.agenda
                    .at(now + self.cfg.profile.steering.period_ns, Event::Steer);
            }
        }
    }

    fn addr_of(&self, node: Node) -> SocketAddr {
        match node {
            Node::Client(i) => self.clients[i].addr,
            Node::Host(i) => self.server_addrs[i / self.cfg.profile.host.cores],
            Node::Nic(i) => self.nic_addrs[i / self.cfg.profile.nic.cores],
        }
    }

    /// Whether `node` has work and its core is free.
    fn ready(&self, node: Node) -> bool {
        match node {
            Node::Host(i) => !self.hosts[i].busy && !self.hosts[i].queue.is_empty(),
            Node::Nic(i) => !self.nics[i].busy && !self.nics[i].queue.is_empty(),
            Node::Client(i) => !self.clients[i].send_busy && !self.clients[i].sending.is_empty(),
        }
    }

    /// Idle `node`'s receive came back empty at a timer and it receives again: it polls for
    /// its poller's new window (none, after a receive that waited that long), or sleeps.
    fn repoll(&mut self, node: Node, now: Nanos) {
        let spin = self.wake_mut(node).idle(now);
        let w = self.wake_mut(node);
        if !w.spinning {
            return;
        }
        w.spin_gen += 1;
        if spin > 0 {
            let generation = w.spin_gen;
            self.agenda.at(now + spin, Event::SpinEnd(node, generation));
            return;
        }
        w.spinning = false;
        if std::mem::take(&mut w.holds_cpu) {
            self.cpu_pollers.retain(|&n| n != node);
            self.release_cpu(now);
        }
    }

    /// `node` finished its work at `now` and goes back to its receive: how long it polls
    /// there before it sleeps (its poller's window).
    fn idle_poll_ns(&mut self, node: Node, now: Nanos) -> Nanos {
        // Without shared processors a client's polling is timed from its sends.
        if matches!(node, Node::Client(_)) && self.free_cpus.is_none() {
            return 0;
        }
        self.wake_mut(node).idle(now)
    }

    fn wakeup_ns(&self, node: Node) -> Nanos {
        let p = &self.cfg.profile;
        match node {
            Node::Host(_) => p.host.wakeup_ns,
            Node::Nic(_) => p.nic.wakeup_ns,
            Node::Client(_) => p.client.wakeup_ns,
        }
    }

    fn wake_mut(&mut self, node: Node) -> &mut Wake {
        match node {
            Node::Host(i) => &mut self.hosts[i].wake,
            Node::Nic(i) => &mut self.nics[i].wake,
            Node::Client(i) => &mut self.clients[i].wake,
        }
    }

    /// Cores wait for a processor while pollers hold some: as many pollers as there are
    /// waiting cores (beyond those already yielding) give theirs up after one poll, the
    /// profile's `yield_ns` (a receive that finds nothing and a `sched_yield`), and go on
    /// polling without one: a message for them then waits for a processor like any work.
    fn preempt_pollers(&mut self, now: Nanos) {
        while self.cpu_waiting.len() > self.yielding {
            let Some(poller) = self.cpu_pollers.pop_front() else {
                break;
            };
            self.wake_mut(poller).holds_cpu = false;
            self.yielding += 1;
            let at = now + self.cfg.profile.machine.yield_ns;
            self.agenda.at(at, Event::Yielded);
        }
    }

    /// A processor is free again (with shared processors): it goes to whoever waited longest.
    fn release_cpu(&mut self, now: Nanos) {
        if let Some(free) = &mut self.free_cpus {
            *free += 1;
        }
        while self.free_cpus.is_some_and(|f| f > 0) {
            let Some(next) = self.cpu_waiting.pop_front() else {
                break;
            };
            self.serve(next, now);
        }
    }

    /// Starts `node`'s next piece of work if it has one and is idle: at once if it polls
    /// (with the processor it holds), after its wake-up if it sleeps, and with shared
    /// processors once one is free.
    fn serve(&mut self, node: Node, now: Nanos) {
        if !self.ready(node) {
            return;
        }
        let wakeup = self.wakeup_ns(node);
        let w = self.wake_mut(node);
        if !w.waking && (w.spinning || w.awake) {
            // Its receive returned with the message (at once while polling, or now that it
            // has woken).
            w.returned(now, true);
        }
        if w.spinning {
            // Polling: it sees the message at once (it still needs a processor, unless it
            // polls on one it holds).
            w.spinning = false;
            w.spin_gen += 1;
            w.awake = true;
            if std::mem::take(&mut w.holds_cpu) {
                w.awake = false;
                self.cpu_pollers.retain(|&n| n != node);
                self.start(node, now);
                return;
            }
        }
        if w.waking {
            return;
        }
        // A client's send follows its own taking in of an answer: it is awake.
        let client_awake = matches!(node, Node::Client(_));
        if !w.awake && !client_awake && wakeup > 0 {
            w.waking = true;
            self.agenda.at(now + wakeup, Event::Woken(node));
            return;
        }
        w.awake = true;
        if let Some(free) = self.free_cpus {
            if free == 0 {
                if !self.cpu_waiting.contains(&node) {
                    self.cpu_waiting.push_back(node);
                }
                self.preempt_pollers(now);
                return;
            } else {
                self.free_cpus = Some(free - 1);
            }
        }
        self.wake_mut(node).awake = false;
        self.start(node, now);
    }

    /// Runs `node`'s next piece of work on the processor it has: a message through its
    /// endpoint, or a client's send.
    fn start(&mut self, node: Node, now: Nanos) {
        let p = &self.cfg.profile;
        let loop_waits = self.cfg.loop_waits;
        let measuring = self.measuring(now);
        let cost = match node {
            Node::Host(i) => {
                let c = &mut self.hosts[i];
                let Some((from, msg, arrived)) = c.queue.pop_front() else {
                    return;
                };
                // What it waited in the ring is the loop's queueing, for the steering.
                if loop_waits {
                    c.endpoint
                        .backend_mut()
                        .runner
                        .received(now.saturating_sub(arrived));
                }
                c.endpoint.handle(now, from, msg);
                c.endpoint.run(usize::MAX);
                let backend = c.endpoint.backend_mut();
                backend.runner.loop_worked(p.host.per_message_ns);
                let cost = p.host.per_message_ns + std::mem::take(&mut backend.busy_ns);
                while let Some(t) = c.endpoint.poll_transmit() {
                    c.outbox.push(t);
                }
                c.busy = true;
                if measuring {
                    c.busy_ns += cost;
                    c.messages += 1;
                }
                cost
            }
            Node::Nic(i) => {
                let c = &mut self.nics[i];
                let Some((from, msg, arrived)) = c.queue.pop_front() else {
                    return;
                };
                if loop_waits {
                    c.endpoint
                        .backend_mut()
                        .runner
                        .received(now.saturating_sub(arrived));
                }
                c.endpoint.handle(now, from, msg);
                let backend = c.endpoint.backend_mut();
                backend.runner.loop_worked(p.nic.per_message_ns);
                let cost = p.nic.per_message_ns + std::mem::take(&mut backend.busy_ns);
                while let Some(t) = c.endpoint.poll_transmit() {
                    c.outbox.push(t);
                }
                while c.endpoint.poll_event().is_some() {}
                c.busy = true;
                if measuring {
                    c.busy_ns += cost;
                    c.messages += 1;
                }
                cost
            }
            Node::Client(i) => {
                self.clients[i].send_busy = true;
                p.client.per_message_ns
            }
        };
        self.agenda.at(now + cost.max(1), Event::Done(node));
    }

    /// Sends `t` from `node`: at once, but for a client sharing processors, whose message
    /// waits for one (its cost is the client's per-message cost).
    fn send(&mut self, now: Nanos, node: Node, from: SocketAddr, t: Transmit) {
        match node {
            Node::Client(i) if self.free_cpus.is_some() => {
                self.clients[i].sending.push_back(t);
                self.serve(node, now);
            }
            Node::Client(i) => {
                let leave = now + self.cfg.profile.client.per_message_ns;
                let spin = self.clients[i].wake.idle(leave);
                self.clients[i].spin_until = leave + spin;
                self.depart(leave, node, from, t);
            }
            _ => self.depart(now, node, from, t),
        }
    }

    /// Puts `t` (sent by `node`, from `from`) on the wire at `now`.
    fn depart(&mut self, now: Nanos, node: Node, from: SocketAddr, t: Transmit) {
        let route = t.frame_route();
        let msg = t.message();
        let hop = self.cfg.profile.nic.host_hop_ns;
        let (host_cores, nic_cores) = (self.cfg.profile.host.cores, self.cfg.profile.nic.cores);
        let to = if let Some(s) = self.server_addrs.iter().position(|&a| a == t.to) {
            let nic_share = |key: u64| self.eswitch[s].get(&key).copied();
            let to_nic = matches!(node, Node::Client(_))
                && self.cfg.profile.nic.eswitch
                && naam_ebpf::eswitch::steers_to_nic(
                    &msg,
                    self.rack.fragments(msg.len()),
                    nic_share,
                );
            if to_nic {
                // The card's eSwitch takes it to the Arm core that serves its session.
                let i = shard::loop_of_route(route, nic_cores).unwrap_or(0);
                Node::Nic(s * nic_cores + i)
            } else {
                let i = shard::loop_of_route(route, host_cores).unwrap_or(0);
                Node::Host(s * host_cores + i)
            }
        } else if let Some(s) = self.nic_addrs.iter().position(|&a| a == t.to) {
            let i = shard::loop_of_route(route, nic_cores).unwrap_or(0);
            Node::Nic(s * nic_cores + i)
        } else {
            match client_index(t.to).filter(|&i| i < self.clients.len()) {
                Some(i) => Node::Client(i),
                None => return,
            }
        };
        // Rack ports: each server's (its host and its SmartNIC share the card's), then the
        // clients'.
        let servers = self.server_addrs.len();
        let port = |n: Node| match n {
            Node::Client(i) => servers + i,
            Node::Host(i) => i / host_cores,
            Node::Nic(i) => i / nic_cores,
        };
        let at = match (node, to) {
            // Host and Arm cores of one card: their messages cross its eSwitch and PCIe.
            (Node::Host(_) | Node::Nic(_), Node::Host(_) | Node::Nic(_))
                if port(node) == port(to) =>
            {
                Some(now + hop)
            }
            _ => self
                .rack
                .send(now, port(node), port(to), msg.len(), &mut self.net_rng),
        };
        if let Some(at) = at {
            self.agenda.at(at, Event::Arrive { to, from, msg });
        }
    }

    /// Writes every server's eSwitch map from its steering weights, as naam-server writes its
    /// XDP map ([`Cluster::eswitch_shares`]).
    fn sync_eswitch(&mut self) {
        for (map, cluster) in self.eswitch.iter_mut().zip(&self.host_clusters) {
            map.clear();
            map.extend(cluster.eswitch_shares(None));
        }
    }

    /// Arms `node`'s timer at what its endpoint asks for, if that changed.
    fn rearm(&mut self, node: Node, now: Nanos) {
        let (want, timer) = match node {
            Node::Client(i) => {
                let c = &mut self.clients[i];
                let want = c
                    .conns
                    .iter()
                    .filter_map(|c| c.endpoint.poll_timeout())
                    .min();
                (want, &mut c.timer)
            }
            Node::Host(i) => {
                let c = &mut self.hosts[i];
                (c.endpoint.poll_timeout(), &mut c.timer)
            }
            Node::Nic(i) => {
                let c = &mut self.nics[i];
                (c.endpoint.poll_timeout(), &mut c.timer)
            }
        };
        if want == timer.0 {
            return;
        }
        timer.1 += 1;
        timer.0 = want;
        let generation = timer.1;
        if let Some(at) = want {
            self.agenda.at(at.max(now), Event::Timer(node, generation));
        }
    }

    fn timer(&mut self, node: Node, generation: u64, now: Nanos) {
        let from = self.addr_of(node);
        let mut out = Vec::new();
        match node {
            Node::Client(i) => {
                let c = &mut self.clients[i];
                if c.timer.1 != generation {
                    return;
                }
                c.timer.0 = None;
                for c in &mut c.conns {
                    if c.endpoint.poll_timeout().is_some_and(|t| t <= now) {
                        c.endpoint.handle_timeout(now);
                    }
                }
                self.client_progress(i, now);
                return;
            }
            Node::Host(i) => {
                let c = &mut self.hosts[i];
                if c.timer.1 != generation {
                    return;
                }
                c.timer.0 = None;
                // A sleeping loop's receive returns empty at its timer, as the deployment's
                // does (a polling one polls on: its window does not end at a timer).
                let idle = !c.busy && c.queue.is_empty() && !c.wake.spinning;
                if idle {
                    c.wake.returned(now, false);
                }
                c.endpoint.handle_timeout(now);
                while let Some(t) = c.endpoint.poll_transmit() {
                    out.push(t);
                }
                if idle {
                    self.repoll(node, now);
                }
            }
            Node::Nic(i) => {
                let c = &mut self.nics[i];
                if c.timer.1 != generation {
                    return;
                }
                c.timer.0 = None;
                c.endpoint.handle_timeout(now);
                while let Some(t) = c.endpoint.poll_transmit() {
                    out.push(t);
                }
                while c.endpoint.poll_event().is_some() {}
            }
        }
        for t in out {
            self.send(now, node, from, t);
        }
        self.rearm(node, now);
    }

    /// Takes in client `i`'s events, hands its pipeline the answers, records what finished,
    /// issues what its window and target allow, and sends.
    fn client_progress(&mut self, i: usize, now: Nanos) {
        let measuring = self.measuring(now);
        let c = &mut self.clients[i];
        // Placements of the replies that finish an operation issued in the measured window
        // (a resubmitted attempt's reply is counted when it is the last).
        let mut last_placement = c.local_placed.take();
        let mut finished = Vec::new();
        for conn in &mut c.conns {
            while let Some(e) = conn.endpoint.poll_event() {
                match e {
                    ClientEvent::Connected(_) => conn.connected = true,
                    ClientEvent::Answered { id, message } => {
                        if let Some(token) = conn.exchanges.remove(&id) {
                            let reply = Reply::decode(message).map_err(ClientError::from);
                            if let Ok(r) = &reply {
                                last_placement = Some(r.placement);
                            }
                            conn.io.borrow_mut().answers.push((token, reply));
                        }
                    }
                    ClientEvent::Failed { id, error } => {
                        if let Some(token) = conn.exchanges.remove(&id) {
                            conn.io
                                .borrow_mut()
                                .answers
                                .push((token, Err(ClientError::Session(error.to_string()))));
                        }
                    }
                    ClientEvent::ConnectFailed(_) => {
                        // It tries again on its own timer.
                        conn.endpoint.connect(now);
                    }
                    _ => {}
                }
            }
            finished.extend(conn.pipe.poll());
        }
        for (tag, result) in finished {
            let Some((issued, read)) = c.issued.remove(&tag) else {
                continue;
            };
            match result {
                Ok(_) => {
                    if c.loading.is_some() {
                        self.loaded += 1;
                    } else if measuring && issued >= self.measure_from {
                        let ns = now.saturating_sub(issued).max(1);
                        self.completed += 1;
                        if let Some(p) = last_placement {
                            self.placed[p.index()] += 1;
                            if let Some(width) = self.cfg.bucket_ns {
                                let at = ((now - self.measure_from) / width.max(1)) as usize;
                                while self.timeline.len() <= at {
                                    let start_ms =
                                        (self.timeline.len() as u64 * width) as f64 / 1e6;
                                    self.timeline.push((
                                        Bucket {
                                            start_ms,
                                            ..Bucket::default()
                                        },
                                        0,
                                    ));
                                }
                                self.timeline[at].0.placed[p.index()] += 1;
                                self.timeline[at].1 += ns;
                            }
                        }
                        let _ = self.all.record(ns);
                        let _ = if read {
                            self.reads.record(ns)
                        } else {
                            self.updates.record(ns)
                        };
                    }
                }
                Err(e) => {
                    tracing::debug!(client = i, op = tag, at = now, "operation failed: {e}");
                    if measuring {
                        self.failed += 1;
                    }
                }
            }
        }
        self.issue(i, now);
        self.flush_client(i, now);
    }

    /// Starts client `i`'s next operations: the records it loads, or the workload's mix.
    fn issue(&mut self, i: usize, now: Nanos) {
        let servers = self.server_addrs.len() as u64;
        let server_of = |n: u64| (crate::ycsb::fnvhash64(n) % servers) as usize;
        let c = &mut self.clients[i];
        if !c.conns.iter().all(|c| c.connected) || self.end == Nanos::MAX && c.loading.is_none() {
            return;
        }
        let naming = &self.workload.naming;
        while c.conns.iter().map(|c| c.pipe.in_flight()).sum::<usize>() < self.cfg.window {
            if let Some(range) = &mut c.loading {
                let Some(n) = range.next() else {
                    return;
                };
                c.next_tag += 1;
                c.issued.insert(c.next_tag, (now, false));
                if c.conns[server_of(n)]
                    .pipe
                    .write(c.next_tag, n, naming, &self.shape, &mut c.rng)
                    .is_err()
                {
                    c.issued.remove(&c.next_tag);
                    return;
                }
                continue;
            }
            if now < c.next_issue {
                // It sleeps until the operation is due (YCSB's throttle), and wakes a wake-up
                // late. One wake-up per due time: every answer calls here, and each would
                // add one.
                if c.issue_armed != Some(c.next_issue) {
                    c.issue_armed = Some(c.next_issue);
                    let late = self.cfg.profile.client.wakeup_ns;
                    self.agenda.at(c.next_issue + late, Event::Issue(i));
                }
                return;
            }
            if let Some(rate) = self.cfg.target_per_client {
                // The i-th operation is due at start + i / rate: one that went late leaves
                // the next no later (YCSB's throttle catches up).
                c.next_issue += (1e9 / rate) as Nanos;
            }
            let n = c.keys.next(&mut c.rng);
            c.next_tag += 1;
            let tag = c.next_tag;
            let conn = &mut c.conns[server_of(n)];
            let sent = match self.workload.next_op(&mut c.rng) {
                Op::Read => {
                    c.issued.insert(tag, (now, true));
                    conn.pipe.read(tag, n, naming)
                }
                _ => {
                    c.issued.insert(tag, (now, false));
                    conn.pipe.write(tag, n, naming, &self.shape, &mut c.rng)
                }
            };
            if sent.is_err() {
                c.issued.remove(&tag);
                return;
            }
        }
    }

    /// Hands client `i`'s submissions to its endpoints and sends what they have; a read pinned
    /// to the Client placement runs here instead, its READs timed by [`Event::ReadStep`].
    fn flush_client(&mut self, i: usize, now: Nanos) {
        let registry = self.host_clusters[0].registry();
        let limits = self.host_clusters[0].config().limits;
        let pin = self.cfg.pin;
        let client_profile = &self.cfg.profile.client;
        let c = &mut self.clients[i];
        let mut out = Vec::new();
        let mut local = Vec::new();
        for (server, conn) in c.conns.iter_mut().enumerate() {
            let submitted = std::mem::take(&mut conn.io.borrow_mut().submitted);
            for (token, mut req) in submitted {
                let read = registry
                    .handler(req.app, req.handler)
                    .is_ok_and(|h| h.kind == HandlerKind::Read);
                match pin {
                    Some(Placement::Host) if read => req.flags |= flags::PIN_HOST,
                    Some(Placement::Nic) if read => req.flags |= flags::PIN_NIC,
                    Some(Placement::Client) if read => {
                        let (reply, ran) = run_at_client(
                            &req,
                            &registry,
                            &mut conn.reads,
                            &mut c.vm,
                            limits,
                            self.clock.as_ref(),
                        );
                        let reads: VecDeque<u64> = conn.reads.transport().reads.drain(..).collect();
                        let cpu = ran.map_or(0, |r| client_insn_ns(client_profile, r.insns, r.mix));
                        c.next_read += 1;
                        let step_ns = cpu / reads.len().max(1) as Nanos;
                        c.local_reads.insert(
                            c.next_read,
                            ClientRead {
                                server,
                                token,
                                reply,
                                reads,
                                step_ns,
                            },
                        );
                        local.push(c.next_read);
                        continue;
                    }
                    _ => {}
                }
                match conn.endpoint.request(now, &mut req) {
                    Ok(id) => {
                        conn.exchanges.insert(id, token);
                    }
                    Err(e) => conn
                        .io
                        .borrow_mut()
                        .answers
                        .push((token, Err(ClientError::Session(e.to_string())))),
                }
            }
            while let Some(t) = conn.endpoint.poll_transmit() {
                out.push(t);
            }
        }
        let from = c.addr;
        for t in out {
            self.send(now, Node::Client(i), from, t);
        }
        for run in local {
            self.agenda.at(now, Event::ReadStep(i, run));
        }
        self.rearm(Node::Client(i), now);
    }

    /// Client `i`'s local read `run` is ready for its next READ: the client posts it, it
    /// crosses the rack to the server's card, waits for the card's RDMA engine, which reads
    /// host memory and answers across the rack; the client's handler then runs the step and
    /// the next READ follows. With none left, the reply goes to the client's pipeline.
    fn read_step(&mut self, i: usize, run: u64, now: Nanos) {
        let p = &self.cfg.profile;
        let servers = self.server_addrs.len();
        let c = &mut self.clients[i];
        let Some(r) = c.local_reads.get_mut(&run) else {
            return;
        };
        let Some(bytes) = r.reads.pop_front() else {
            let Some(r) = c.local_reads.remove(&run) else {
                return;
            };
            c.conns[r.server]
                .io
                .borrow_mut()
                .answers
                .push((r.token, Ok(r.reply)));
            c.local_placed = Some(Placement::Client);
            self.client_progress(i, now);
            return;
        };
        self.one_sided_reads += 1;
        let (server, step_ns) = (r.server, r.step_ns);
        let client_port = servers + i;
        let posted = now + p.client.read_post_ns;
        let answered = self
            .rack
            .send(
                posted,
                client_port,
                server,
                READ_REQUEST_BYTES,
                &mut self.net_rng,
            )
            .and_then(|at| {
                let wait = self.rdma[server].take(at, 1, 0.0);
                let leave = at + wait + p.nic.rdma_read_ns;
                self.rack.send(
                    leave,
                    server,
                    client_port,
                    READ_RESPONSE_BYTES + bytes as usize,
                    &mut self.net_rng,
                )
            });
        match answered {
            Some(at) => self.agenda.at(at + step_ns, Event::ReadStep(i, run)),
            None => {
                // A lost frame: the READ is posted again after the queue pair's timeout.
                self.lost_reads += 1;
                if let Some(r) = self.clients[i].local_reads.get_mut(&run) {
                    r.reads.push_front(bytes);
                }
                self.agenda
                    .at(posted + READ_RETRY_NS, Event::ReadStep(i, run));
            }
        }
    }
}

/// A one-sided READ request on the wire beyond the rack's frame headers (RoCEv2's BTH and
/// RETH: 28 bytes, the rack counting Ethernet, IP and UDP).
const READ_REQUEST_BYTES: usize = 28;
/// A READ response's transport headers beyond its data (BTH, AETH).
const READ_RESPONSE_BYTES: usize = 16;
/// How long a client waits before it posts a READ whose frame was lost again: an RC queue
/// pair's local ACK timeout (assumed at its common setting, about 1 ms: 4.096 us x 2^8).
const READ_RETRY_NS: Nanos = 1_048_576;
