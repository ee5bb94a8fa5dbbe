//! The NIC side of the UDP fabric: `naam-nic`'s driver loop, on the NIC's own cores. The
//! protocol (pairing, announced client sessions, their checks, one-sided operations, load
//! reports, remapping after a server restart) is [`NicEndpoint`]'s; this module gives it
//! datagrams, sends what it asks for, logs its events, and implements its [`NicBackend`] over
//! the NIC executors (which reply to clients directly) and the mapped server regions.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::inline::{InlineEndpoint, InlineGroup};
use super::memnet::{MemoryNet, ServedPort};
use super::server::{run_loops, LoopStop, Replies};
use super::socket::{Sender, Socket};
use super::telemetry::LoopCounters;
use crate::cluster::Cluster;
use crate::onesided;
use crate::{Clock, SystemClock};
use naam_proto::control::Manifest;
use naam_proto::endpoint::Channel;
use naam_proto::endpoint::{NicBackend, NicConfig, NicEndpoint, NicEvent, Routed};
use naam_proto::onesided::{Completion, Operation};
use naam_proto::session::Credential;
use naam_proto::steering::{RemoteLoad, Selector};
use naam_proto::wire::{Reply, Request};
use naam_proto::Placement;
use std::sync::Arc;

use naam_proto::endpoint::{NicStats, Transmit};
use naam_proto::Nanos;

/// How the NIC driver behaves.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NicOptions {
    /// The server's address (pairing and load reports go there).
    pub server: SocketAddr,
    /// The address the NIC advertises to clients and the switch.
    pub advertise: SocketAddr,
    /// Load report period.
    pub report_every: Duration,
    /// How long SIGTERM waits for queued work.
    pub drain: Duration,
    /// The pairing secret naam-server's config names.
    pub pairing: Credential,
    /// Datagram authentication: on, except in a loopback measurement of its cost
    /// ([`naam_proto::session::Authentication`]); it must match the server's.
    pub authentication: naam_proto::session::Authentication,
    /// Where replies and counters are recorded for `--metrics`.
    pub telemetry: std::sync::Arc<super::telemetry::Telemetry>,
    /// The host's shared-memory directory, whose manifest is read again when the server
    /// announces a deploy ([`super::redeploy_nic`]); `None`: the NIC serves the handlers it
    /// started with, and the server keeps deployed apps' requests at the host.
    pub shm_dir: Option<std::path::PathBuf>,
}
impl NicOptions {
    /// A NIC that pairs with the server at `server` using `pairing` and advertises
    /// `advertise`, with authentication on, a load report every millisecond, a 2 s drain and
    /// fresh telemetry; set the other fields to change those.
    pub fn new(server: SocketAddr, advertise: SocketAddr, pairing: Credential) -> NicOptions {
        NicOptions {
            server,
            advertise,
            report_every: Duration::from_millis(1),
            drain: Duration::from_secs(2),
            pairing,
            authentication: naam_proto::session::Authentication::On,
            telemetry: Default::default(),
            shm_dir: None,
        }
    }
}

/// The NIC's executors and the manifest they were built from.
pub struct NicCluster {
    /// The executors, with the server's regions mapped.
    pub cluster: Arc<Cluster>,
    /// The manifest (its epoch says which server start it belongs to).
    pub manifest: Manifest,
}

/// The executors of the server start the NIC serves, shared by its receive loops: the first
/// loop maps a restarted server's regions and puts the new executors here; the others take
/// them up on their next request.
struct Executors {
    epoch: AtomicU64,
    current: RwLock<Arc<Cluster>>,
}

/// One receive loop's side of the NIC endpoint: the shared executors (as this loop last
/// took them up), whose replies go out from this loop's socket.
struct NicHost<R> {
    executors: Arc<Executors>,
    cluster: Arc<Cluster>,
    epoch: u64,
    replies: Replies,
    /// How to map a restarted server's regions: the first loop's.
    remap: Option<R>,
    /// The first loop's: how it takes up deploys.
    redeploy: Option<Redeploys>,
}

/// How the first NIC loop takes up the host's deploys.
struct Redeploys {
    /// The manifest the executors' handlers come from.
    served: Manifest,
    /// The host's directory, whose manifest is read again after a deploy.
    shm_dir: Option<std::path::PathBuf>,
    /// The deploy being taken up, if any: the manifest it serves when done.
    job: Option<crossbeam_channel::Receiver<Result<Manifest, String>>>,
    /// The thread that takes deploys up, started with the first one.
    worker: Option<DeployWorker>,
}

/// What the NIC's deploy thread is given: the host's directory, the executors' cluster, the
/// manifest they serve, and where the manifest they serve next goes.
type DeployTask = (
    std::path::PathBuf,
    Arc<Cluster>,
    Manifest,
    crossbeam_channel::Sender<Result<Manifest, String>>,
);

/// The one thread of the lowest priority that takes up the host's deploys, for as long as
/// its loop lives. It used to be a thread per deploy: a new thread starts at the ordinary
/// priority, the scheduler ran it ahead of a request's thread that woke just before, and it
/// went on past lowering its own priority (bench/RESULTS.md, "Deploy to first answer after
/// idle").
struct DeployWorker(crossbeam_channel::Sender<DeployTask>);

impl DeployWorker {
    fn start() -> std::io::Result<DeployWorker> {
        let (tx, rx) = crossbeam_channel::unbounded::<DeployTask>();
        std::thread::Builder::new()
            .name("naam-nic-deploy".into())
            .spawn(move || {
                naam_vm::lowest_priority();
                for (dir, cluster, served, done) in rx {
                    // The executors are shared by every loop: a deploy into their cluster
                    // is seen by all. A result nobody waits for any more (a remap came
                    // meanwhile) is dropped.
                    let r = super::redeploy_nic(&dir, &cluster, &served).map_err(|e| e.to_string());
                    let _ = done.send(r);
                }
            })?;
        Ok(DeployWorker(tx))
    }
}

impl<R> NicHost<R> {
    fn new(
        start: NicCluster,
        replies: Replies,
        remap: R,
        shm_dir: Option<std::path::PathBuf>,
    ) -> NicHost<R> {
        let epoch = start.manifest.epoch;
        let redeploy = Some(Redeploys {
            served: start.manifest.clone(),
            shm_dir,
            job: None,
            worker: None,
        });
        NicHost {
            executors: Arc::new(Executors {
                epoch: AtomicU64::new(epoch),
                current: RwLock::new(start.cluster.clone()),
            }),
            cluster: start.cluster,
            epoch,
            replies,
            remap: Some(remap),
            redeploy,
        }
    }

    /// Another loop's side, over the same executors, replying with `replies`.
    fn another_loop<S>(&self, replies: Replies) -> NicHost<S> {
        NicHost {
            executors: self.executors.clone(),
            cluster: self.cluster.clone(),
            epoch: self.epoch,
            replies,
            remap: None,
            redeploy: None,
        }
    }

    /// The current executors, taken up anew after a remap.
    fn cluster(&mut self) -> &Cluster {
        let epoch = self.executors.epoch.load(Ordering::Acquire);
        if epoch != self.epoch {
            self.cluster = self
                .executors
                .current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            self.epoch = epoch;
        }
        &self.cluster
    }
}

impl<R: FnMut(u64) -> Result<NicCluster, String>> NicBackend for NicHost<R> {
    fn dispatch(
        &mut self,
        mut req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        reply_to: Channel,
        out: &mut Reply,
    ) -> Routed {
        self.cluster();
        self.replies
            .dispatch(&self.cluster, None, &mut req, sel, forced, &reply_to, out)
    }

    fn one_sided(&mut self, op: &Operation) -> Completion {
        onesided::execute(self.cluster().regions(), op)
    }

    fn load_report(&mut self) -> RemoteLoad {
        self.cluster().take_load_report(Placement::Nic)
    }

    fn remap(&mut self, epoch: u64) -> Result<Manifest, String> {
        let remap = self
            .remap
            .as_mut()
            .ok_or("only the first receive loop maps a restarted server's regions")?;
        let c = remap(epoch)?;
        let manifest = c.manifest.clone();
        if manifest.epoch == epoch {
            // The old executors stop when the last loop lets go of their cluster.
            *self
                .executors
                .current
                .write()
                .unwrap_or_else(|e| e.into_inner()) = c.cluster.clone();
            self.executors.epoch.store(epoch, Ordering::Release);
            self.cluster = c.cluster;
            self.epoch = epoch;
            if let Some(r) = &mut self.redeploy {
                // A deploy being taken up belongs to the old start: its result is dropped.
                r.job = None;
                r.served = manifest.clone();
            }
        }
        Ok(manifest)
    }

    fn redeploy(&mut self, version: u64) -> Result<u64, String> {
        self.cluster();
        let cluster = self.cluster.clone();
        let Some(r) = &mut self.redeploy else {
            return Err("only the first receive loop takes up deploys".into());
        };
        let Some(dir) = r.shm_dir.clone() else {
            return Err(format!(
                "manifest version {version} announced, but this NIC was started without the \
                 host's shared-memory directory: it serves the handlers it started with"
            ));
        };
        // Building handlers is no work for the loop that serves everyone's requests: a
        // thread of the lowest priority does it, and the endpoint asks again until it is
        // done (an older version than asked for means "not yet").
        if let Some(job) = r.job.take() {
            match job.try_recv() {
                Err(crossbeam_channel::TryRecvError::Empty) => {
                    r.job = Some(job);
                    return Ok(r.served.version);
                }
                Ok(Ok(m)) => r.served = m,
                Ok(Err(e)) => return Err(e),
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    // Asked again, the next deploy starts the thread anew.
                    r.worker = None;
                    return Err("the thread taking up a deploy panicked".into());
                }
            }
            if r.served.version >= version {
                return Ok(r.served.version);
            }
        }
        let worker = match r.worker.take() {
            Some(w) => w,
            None => DeployWorker::start()
                .map_err(|e| format!("starting a thread to take up deploys: {e}"))?,
        };
        let (done, job) = crossbeam_channel::bounded(1);
        if worker
            .0
            .send((dir, cluster, r.served.clone(), done))
            .is_err()
        {
            // Forgotten: the next deploy starts the thread anew.
            return Err("the thread taking up deploys has stopped".into());
        }
        r.worker = Some(worker);
        r.job = Some(job);
        Ok(r.served.version)
    }
}

/// Logs what the endpoint reports.
fn log(event: NicEvent, server: SocketAddr) {
    match event {
        NicEvent::Paired { epoch } => {
            tracing::info!("paired with naam-server at {server} (epoch {epoch:#x})")
        }
        NicEvent::PairingFailed(e) => tracing::warn!("pairing: {e}"),
        NicEvent::Refused(m) => tracing::warn!("the server refused pairing: {m}"),
        NicEvent::Unpaired => {
            tracing::info!("the server does not know this NIC any more: pairing again")
        }
        NicEvent::Remapped { epoch } => {
            tracing::info!("the server restarted (epoch {epoch:#x}): regions mapped anew")
        }
        NicEvent::RemapFailed(e) => {
            tracing::error!("mapping the restarted server's regions: {e}")
        }
        NicEvent::Redeployed { version } => {
            tracing::info!("serving the handlers of manifest version {version}")
        }
        NicEvent::RedeployFailed(e) => {
            tracing::warn!("taking up a deploy (retried; the host serves the app meanwhile): {e}")
        }
        other => tracing::info!("{other:?}"),
    }
}

/// naam-nic's endpoint over `start`, whose executors send replies with `replies`, for a driver
/// bound at `local`.
fn nic_endpoint<R: FnMut(u64) -> Result<NicCluster, String>>(
    start: NicCluster,
    replies: Sender,
    options: &NicOptions,
    local: SocketAddr,
    in_memory: bool,
    now: Nanos,
    remap: R,
) -> std::io::Result<NicEndpoint<NicHost<R>>> {
    options
        .authentication
        .check_fabric(local, in_memory)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut config = NicConfig::new(
        options.server,
        options.advertise,
        options.pairing.clone(),
        crate::entropy::os(),
    );
    config.authentication = options.authentication;
    config.report_every = options.report_every.as_nanos() as u64;
    let manifest = start.manifest.clone();
    let host = NicHost::new(
        start,
        Replies::new(replies, options.telemetry.clone()),
        remap,
        options.shm_dir.clone(),
    );
    Ok(NicEndpoint::new(config, host, &manifest, now))
}

/// Runs the NIC driver until `stop` is set; then says goodbye to the server (which stops
/// forwarding) and drains queued work. `remap` maps the regions of a restarted server's
/// manifest for epoch `epoch`.
pub fn serve_nic(
    start: NicCluster,
    socket: Socket,
    options: NicOptions,
    stop: &AtomicBool,
    remap: &mut dyn FnMut(u64) -> Result<NicCluster, String>,
) -> std::io::Result<NicStats> {
    serve_nic_loops(start, vec![socket], options, stop, remap)
}

/// Runs one NIC receive loop per socket of `sockets` (a [`super::bind_group`] on one
/// address: the kernel hands each session's datagrams to the loop of its route), each on a
/// thread of its own (the first on the caller's), until `stop` is set, then drains them (see
/// [`serve_nic`]). The loops share the executors, the pairing and the announced sessions;
/// the first retries pairing and calls `remap`. Returns every loop's counters, summed.
pub fn serve_nic_loops(
    start: NicCluster,
    sockets: Vec<Socket>,
    options: NicOptions,
    stop: &AtomicBool,
    remap: &mut dyn FnMut(u64) -> Result<NicCluster, String>,
) -> std::io::Result<NicStats> {
    let clock = SystemClock::new();
    let mut sockets = sockets.into_iter();
    let first_socket = sockets
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no socket"))?;
    let local = first_socket.local_addr()?;
    let first = nic_endpoint(
        start,
        first_socket.sender()?,
        &options,
        local,
        first_socket.in_memory(),
        clock.now(),
        remap,
    )?;
    let mut counters = LoopCounters::group(sockets.len() + 1).into_iter();
    let first_counters = counters.next().expect("one slot per loop");
    let options = &options;
    let others = sockets
        .zip(counters)
        .map(|(socket, counters)| {
            let replies = Replies::new(socket.sender()?, options.telemetry.clone());
            let host: NicHost<fn(u64) -> Result<NicCluster, String>> =
                first.backend().another_loop(replies);
            let endpoint = first.another_loop(host);
            Ok(move |stop: &LoopStop| run_nic_loop(endpoint, socket, options, stop, counters))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    run_loops(
        "naam-nic-loop",
        stop,
        |stop| run_nic_loop(first, first_socket, options, stop, first_counters),
        others,
    )
}

/// One receive loop of naam-nic (see [`serve_nic_loops`]).
fn run_nic_loop<R: FnMut(u64) -> Result<NicCluster, String>>(
    mut nic: NicEndpoint<NicHost<R>>,
    mut socket: Socket,
    options: &NicOptions,
    stop: &LoopStop,
    counters: LoopCounters,
) -> std::io::Result<NicStats> {
    let clock = SystemClock::new();
    let sender = socket.sender()?;
    let mut drain_deadline: Option<Instant> = None;
    let mut next_publish = Instant::now();
    // Refusals of pairing since the last success: a wrong secret is refused every time.
    let mut refusals = 0u32;
    loop {
        if stop.is_set() && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
            nic.start_drain();
        }
        nic.handle_timeout(clock.now());
        while let Some(t) = nic.poll_transmit() {
            let _ = sender.send_transmit(t);
        }
        while let Some(e) = nic.poll_event() {
            match &e {
                NicEvent::Refused(_) => refusals += 1,
                NicEvent::Paired { .. } => refusals = 0,
                _ => {}
            }
            log(e, options.server);
        }
        if refusals >= naam_proto::limits::NIC_PAIRING_REFUSALS {
            return Err(pairing_refused(options.server, refusals));
        }
        if let Some(d) = drain_deadline {
            if nic.backend().replies.idle() || Instant::now() >= d {
                return Ok(nic.stats());
            }
        }
        if Instant::now() >= next_publish {
            next_publish = Instant::now() + options.report_every.max(PUBLISH_EVERY);
            counters.publish(&options.telemetry, nic.stats().counters());
        }
        let now = clock.now();
        let wait = nic
            .poll_timeout()
            .map_or(IDLE_WAIT, |d| Duration::from_nanos(d.saturating_sub(now)))
            .min(IDLE_WAIT);
        for (peer, msg) in socket.recv(wait)? {
            nic.handle(clock.now(), peer, msg);
            while let Some(t) = nic.poll_transmit() {
                let _ = sender.send_transmit(t);
            }
        }
    }
}

/// The error a NIC whose pairing the server keeps refusing stops with
/// ([`std::io::ErrorKind::PermissionDenied`]: naam-nic exits 2, a configuration error).
fn pairing_refused(server: SocketAddr, times: u32) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "naam-server at {server} refused pairing {times} times in a row: the --pairing \
             file must hold the credential naam-server's config names as `nic_pairing`"
        ),
    )
}

/// How often a NIC loop publishes its counters for `--metrics` at most.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// The longest the NIC's loop sleeps with nothing due: how soon it notices `stop`. The
/// endpoint's timers (an idle NIC's heartbeat report, a pairing retry) wake it sooner.
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// How an inline NIC maps a restarted server's regions (see [`serve_nic`]'s `remap`).
pub type Remap = Box<dyn FnMut(u64) -> Result<NicCluster, String> + Send>;

/// naam-nic's endpoint bound as a service of a [`MemoryNet`] ([`serve_nic_inline`]): a
/// datagram to it (a forwarded request, a one-sided operation) is handled in the sending
/// thread. Dropping it closes the port at once; [`InlineNic::stop`] says goodbye to the
/// server and drains first.
pub struct InlineNic {
    port: ServedPort,
    service: Arc<InlineGroup<NicInline>>,
    drain: Duration,
}

/// The NIC endpoint as an inline service drives it, with the server's address its events are
/// logged with.
struct NicInline {
    endpoint: NicEndpoint<NicHost<Remap>>,
    server: SocketAddr,
}

impl InlineEndpoint for NicInline {
    fn handle(&mut self, now: Nanos, from: SocketAddr, msg: Bytes) {
        self.endpoint.handle(now, from, msg)
    }
    fn handle_timeout(&mut self, now: Nanos) {
        self.endpoint.handle_timeout(now)
    }
    fn poll_timeout(&self) -> Option<Nanos> {
        self.endpoint.poll_timeout()
    }
    fn poll_transmit(&mut self) -> Option<Transmit> {
        self.endpoint.poll_transmit()
    }
    fn report_events(&mut self) {
        while let Some(e) = self.endpoint.poll_event() {
            log(e, self.server);
        }
    }
    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        self.endpoint.stats().counters()
    }
    fn start_drain(&mut self) {
        self.endpoint.start_drain()
    }
    fn idle(&self) -> bool {
        self.endpoint.backend().replies.idle()
    }
}

/// Binds naam-nic's endpoint over `start` at `addr` in `net` as an inline service (see
/// [`InlineNic`]); it advertises the address it is bound at (`options.advertise` is not
/// used: an in-memory network has no address translation) and starts pairing with
/// `options.server` at once.
pub fn serve_nic_inline(
    start: NicCluster,
    net: &MemoryNet,
    addr: SocketAddr,
    mut options: NicOptions,
    remap: Remap,
) -> std::io::Result<InlineNic> {
    // Counters published as the socket loops publish them: a publication every report
    // (a millisecond) woke the timer thread, and took the endpoint's lock, a thousand times a
    // second for figures scraped every few seconds.
    let (telemetry, publish_every) = (
        options.telemetry.clone(),
        options.report_every.max(PUBLISH_EVERY),
    );
    // One loop: naam-nic's further loops are made from its first endpoint
    // (`NicEndpoint::another_loop`), which an inline group does not do yet.
    let mut once = Some((start, remap));
    let (port, service) = InlineGroup::bind(
        net,
        addr,
        1,
        telemetry,
        publish_every,
        |_, local, replies, now| {
            let (start, remap) = once
                .take()
                .ok_or_else(|| std::io::Error::other("naam-nic inline runs one loop"))?;
            options.advertise = local;
            Ok(NicInline {
                endpoint: nic_endpoint(start, replies, &options, local, true, now, remap)?,
                server: options.server,
            })
        },
    )?;
    Ok(InlineNic {
        port,
        service,
        drain: options.drain,
    })
}

impl InlineNic {
    /// The address forwarded requests and one-sided operations come to.
    pub fn addr(&self) -> SocketAddr {
        self.port.addr()
    }

    /// Whether the NIC is paired with the server.
    pub fn is_paired(&self) -> bool {
        let paired = self.service.read(|n| n.endpoint.is_paired());
        !paired.is_empty() && paired.into_iter().all(|p| p)
    }

    /// The endpoint's counters so far.
    pub fn stats(&self) -> NicStats {
        let mut sum = NicStats::default();
        for s in self.service.read(|n| n.endpoint.stats()) {
            sum += s;
        }
        sum
    }

    /// Says goodbye to the server, refuses new work, waits (at most the drain time of its
    /// [`NicOptions`]) until queued work is answered, then closes the port.
    pub fn stop(self) -> NicStats {
        self.service.drain(self.drain);
        self.stats()
    }
}
