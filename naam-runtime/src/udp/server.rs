//! The host side of the UDP fabric: `naam-server`'s driver loop. The protocol (sessions, the
//! control plane, the user-space switch) is [`naam_proto::endpoint::ServerEndpoint`]; this
//! module gives it datagrams in batches, sends what it asks for, and implements its
//! [`HostBackend`] over the in-process [`Cluster`], whose executor threads send their replies
//! themselves, sealed on the request's channel.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::deployer::DeployQueue;
use super::inline::{InlineEndpoint, InlineGroup};
use super::memnet::{MemoryNet, ServedPort};
use super::socket::{Poller, Sender, Socket};
use super::telemetry::{LoopCounters, PendingSeries};
use crate::cluster::{Cluster, HereRunner};
use crate::{Clock, SystemClock};
use naam_proto::control::{Control, Manifest};
use naam_proto::endpoint::{
    DeployJob, HostBackend, InProcess, Routed, ServerConfig, ServerEndpoint, SessionDirectory,
};
use naam_proto::session::{self, CookieJar, TenantEntry};
use naam_proto::shard::Shard;
use naam_proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_proto::wire::{Reply, Request};
use naam_proto::Placement;

use naam_proto::endpoint::{Channel, ServerStats, SwitchHandle, Transmit, VerbsAcceptor};
use naam_proto::Nanos;

/// How the server driver behaves.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServerOptions {
    /// The manifest handed to clients.
    pub manifest: Manifest,
    /// How long SIGTERM waits for queued work to finish.
    pub drain: Duration,
    /// A switch in front of this driver; `None`: this driver is the (user-space) switch.
    pub switch: Option<Arc<dyn SwitchHandle>>,
    /// The RDMA verbs side, when the server has a device.
    pub verbs: Option<Arc<dyn VerbsAcceptor>>,
    /// Whether [`naam_proto::control::Control::Congest`] may slow the host executors down
    /// (experiments on a testbed; only the operator's session may ask even then).
    pub congestion_control: bool,
    /// The credentials sessions are set up with ([`session::tenant_entries`]): every app's,
    /// the operator's and the NIC's pairing secret.
    pub tenants: Vec<TenantEntry>,
    /// Datagram authentication: on, except in a loopback measurement of its cost
    /// ([`session::Authentication`]).
    pub authentication: session::Authentication,
    /// Where replies and counters are recorded for `--metrics`.
    pub telemetry: Arc<super::telemetry::Telemetry>,
    /// Tenants' deploys at run time, within these quotas; `None`: refused (the handlers are
    /// the config's).
    pub deploy: Option<super::deployer::DeployPolicy>,
}

impl ServerOptions {
    /// A server that hands clients `manifest` and admits `tenants`, with authentication on,
    /// no switch in front of it, no verbs side, no congestion control, a 2 s drain and fresh
    /// telemetry; set the other fields to change those.
    pub fn new(manifest: Manifest, tenants: Vec<TenantEntry>) -> ServerOptions {
        ServerOptions {
            manifest,
            drain: Duration::from_secs(2),
            switch: None,
            verbs: None,
            congestion_control: false,
            tenants,
            authentication: session::Authentication::On,
            telemetry: Default::default(),
            deploy: None,
        }
    }
}

/// How a driver's executors answer: a queued request's reply goes out on `sender` from the
/// executor's thread, and counts as in flight until then (SIGTERM drains until none is).
pub(crate) struct Replies {
    sender: Arc<Sender>,
    inflight: Arc<AtomicU64>,
    telemetry: Arc<super::telemetry::Telemetry>,
    /// Times each request's service for the telemetry (the time-stamp counter where it can:
    /// `Instant` costs a `clock_gettime` in a VM, twice per request).
    clock: SystemClock,
    /// The replies of requests this thread ran itself, until they are handed to the
    /// telemetry ([`Replies::hand_over`]).
    pending: PendingSeries,
}

impl Replies {
    pub(crate) fn new(sender: Sender, telemetry: Arc<super::telemetry::Telemetry>) -> Replies {
        Replies {
            sender: Arc::new(sender),
            inflight: Arc::new(AtomicU64::new(0)),
            telemetry,
            clock: SystemClock::new(),
            pending: PendingSeries::default(),
        }
    }

    /// Hands the replies this thread recorded to the telemetry (its timers fired, or it
    /// goes idle).
    pub(crate) fn hand_over(&mut self) {
        self.pending.hand_to(&self.telemetry);
    }

    /// Dispatches `req` on `cluster`: a request for `runner`'s placement runs here, on the
    /// calling thread (its reply is the endpoint's to send; `req` stays where it is); a
    /// queued request (taken from `req`) has its reply go out sealed on `ch` from the
    /// executor; the reply of one run here is written into `out`. (The endpoint's
    /// dispatch, with the cluster and runner it goes to: the arguments are the layers'.)
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dispatch(
        &mut self,
        cluster: &Cluster,
        runner: Option<&mut HereRunner>,
        req: &mut Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        ch: &Channel,
        out: &mut Reply,
    ) -> Routed {
        let clock = self.clock;
        let (app, handler) = (req.app, req.handler);
        // Made only for a request that waits at an executor: counted in flight until its
        // reply is sent, or until the job is dropped unanswered. Its service time runs from
        // here to its reply; one run here is timed by its runner, which reads the clock
        // anyway (two reads fewer per message on the run-to-completion path).
        let on_reply = || {
            let arrived = clock.now();
            let (s, t, ch) = (self.sender.clone(), self.telemetry.clone(), ch.clone());
            let in_flight = InFlight::count(&self.inflight);
            move |r: Reply| {
                if let Ok(b) = r.to_bytes() {
                    let _ = s.send(ch.to, r.request_id, &ch.sealer.seal(&b));
                }
                let service = clock.now().saturating_sub(arrived);
                t.record(app, handler, r.placement, r.status, service);
                drop(in_flight);
            }
        };
        let d = match runner {
            Some(runner) => cluster.dispatch_here(runner, req, sel, forced, on_reply, out),
            None => cluster.dispatch(std::mem::take(req), sel, forced, on_reply()),
        };
        if let Routed::Answered = d {
            let key = (app, handler, out.placement);
            self.pending
                .record(&self.telemetry, key, out.status, out.load.service_ns);
        }
        d
    }

    /// Whether every queued request has been answered.
    pub(crate) fn idle(&self) -> bool {
        self.inflight.load(Ordering::SeqCst) == 0
    }
}

/// One request counted in [`Replies`]' in-flight count, until this is dropped.
struct InFlight(Arc<AtomicU64>);

impl InFlight {
    fn count(inflight: &Arc<AtomicU64>) -> InFlight {
        inflight.fetch_add(1, Ordering::SeqCst);
        InFlight(inflight.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The server endpoint's host side: the cluster's executors, registry and steering, with
/// the switch and RDMA side `naam-server` attached.
struct ClusterHost {
    cluster: Arc<Cluster>,
    /// Runs host requests on the driver's own thread (run to completion); `None`: every
    /// request is queued at the host executors.
    runner: Option<HereRunner>,
    replies: Replies,
    switch: Option<Arc<dyn SwitchHandle>>,
    verbs: Option<Arc<dyn VerbsAcceptor>>,
    /// Where tenants' deploys go; `None`: refused.
    deploys: Option<DeployQueue>,
}

impl ClusterHost {
    /// Hands what the driver's own runs measured to the steering now.
    fn flush_load(&mut self) {
        if let Some(r) = &mut self.runner {
            r.flush(&self.cluster);
        }
        self.replies.hand_over();
    }
}

impl HostBackend for ClusterHost {
    fn dispatch(
        &mut self,
        req: &mut Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        reply_to: &Channel,
        out: &mut Reply,
    ) -> Routed {
        self.replies.dispatch(
            &self.cluster,
            self.runner.as_mut(),
            req,
            sel,
            forced,
            reply_to,
            out,
        )
    }

    fn next_client_id(&mut self) -> u32 {
        self.cluster.next_client_id()
    }

    fn nic_up(&self) -> bool {
        self.cluster.remote_nic_up()
    }

    fn nic_load(&mut self, load: &RemoteLoad) {
        self.cluster.absorb_remote_load(load);
    }

    fn nic_gone(&mut self) {
        self.cluster.remote_nic_down();
    }

    fn handlers(&self, app: u32) -> Option<Vec<u32>> {
        let registry = self.cluster.registry();
        let a = registry.app(app)?;
        Some(a.handlers.values().map(|h| h.id).collect())
    }

    fn has_handler(&self, app: u32, handler: u32) -> bool {
        self.cluster.registry().handler(app, handler).is_ok()
    }

    fn client_share(&self) -> Option<ClientShare> {
        self.cluster.client_share()
    }

    fn weights(&self, app: u32, handler: u32, share: Option<&mut ClientShare>) -> Weights {
        match share {
            Some(s) => self.cluster.client_weights(s, app, handler),
            None => self.cluster.weights(app, handler),
        }
    }

    fn congest(&mut self, extra_ns: Option<u64>) {
        match extra_ns {
            Some(ns) => self.cluster.congestion().limit_host(ns),
            None => self.cluster.congestion().clear(),
        }
    }

    fn switch(&self) -> Option<&dyn SwitchHandle> {
        self.switch.as_deref()
    }

    fn verbs(&self) -> Option<&dyn VerbsAcceptor> {
        self.verbs.as_deref()
    }

    fn deploy(&mut self, job: DeployJob, reply_to: &Channel) -> Option<Control> {
        match &self.deploys {
            Some(q) => q.submit(job, reply_to, &self.replies.sender),
            None => Some(Control::Error {
                message: "this server takes no deploys (its config has no [deploy] section): \
                          its handlers are the config's"
                    .into(),
            }),
        }
    }

    fn nic_manifest(&mut self, version: u64) {
        self.cluster.set_remote_nic_version(version);
    }
}

/// What one receive loop of naam-server is, among its loops: its shard of the sessions, and
/// what all of them share (the session directory, the cookie key, the clock: a handshake's
/// cookie, issued by one loop, is checked by the loop its `Auth` is routed to).
struct LoopPlace {
    shard: Shard,
    /// Where tenants' deploys go, when the server takes them.
    deploys: Option<DeployQueue>,
    directory: Arc<SessionDirectory>,
    cookies: CookieJar,
    clock: SystemClock,
}

fn invalid(e: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
}

/// naam-server's endpoint over `cluster`, whose executors send replies with `replies`, for a
/// driver bound at `local`, as receive loop `place`.
fn host_endpoint(
    cluster: Arc<Cluster>,
    replies: Sender,
    options: &ServerOptions,
    local: SocketAddr,
    in_memory: bool,
    now: Nanos,
    place: LoopPlace,
) -> std::io::Result<ServerEndpoint<ClusterHost>> {
    options
        .authentication
        .check_fabric(local, in_memory)
        .map_err(invalid)?;
    // Answers are coalesced, and framed, up to the datagrams the replies go out in.
    let payload = replies.datagram() - naam_proto::frame::HEADER;
    let host = ClusterHost {
        runner: Some(cluster.here_runner(Placement::Host)),
        cluster,
        replies: Replies::new(replies, options.telemetry.clone()),
        switch: options.switch.clone(),
        verbs: options.verbs.clone(),
        deploys: place.deploys.clone(),
    };
    let mut config = ServerConfig::new(
        options.manifest.clone(),
        options.tenants.clone(),
        crate::entropy::os(),
    );
    config.authentication = options.authentication;
    config.congestion_control = options.congestion_control;
    if let Some(d) = &options.deploy {
        config.deploys_per_second = d.deploys_per_second;
    }
    config.shard = place.shard;
    config.directory = place.directory;
    // The requests waiting for their turn are the host's queue: its capacity bounds the
    // credits.
    let capacity = host.cluster.config().queue_capacity.min(u32::MAX as usize) as u32;
    config.session_credit = config.session_credit.min(capacity).max(1);
    config.tenant_credit = config.tenant_credit.min(capacity).max(1);
    let mut endpoint = ServerEndpoint::new(config, host, place.cookies, now)
        .map_err(|e| invalid(e.to_string()))?;
    endpoint.set_datagram_payload(payload);
    Ok(endpoint)
}

/// Runs the host driver on `socket` until `stop` is set, then drains: new requests get
/// `Unavailable` while queued ones finish (at most `options.drain`). Only sessions set up
/// with one of `options.tenants`' credentials are served.
pub fn serve_host(
    cluster: Arc<Cluster>,
    socket: Socket,
    options: ServerOptions,
    stop: &AtomicBool,
) -> std::io::Result<ServerStats> {
    serve_host_loops(cluster, vec![socket], options, stop)
}

/// Runs one host driver loop per socket of `sockets`, each on a thread of its own (the first
/// on the caller's), until `stop` is set, then drains them (see [`serve_host`]). The sockets
/// are a [`super::bind_group`] on one address: loop `i` sets up and serves the sessions of
/// shard `i`, which the kernel routes to socket `i`; the loops share the cluster, the paired
/// NIC, the cookie key and the clock, and nothing else on a request's path. Returns every
/// loop's counters, summed.
pub fn serve_host_loops(
    cluster: Arc<Cluster>,
    sockets: Vec<Socket>,
    options: ServerOptions,
    stop: &AtomicBool,
) -> std::io::Result<ServerStats> {
    let shards = Shard::all(sockets.len()).map_err(|e| invalid(e.to_string()))?;
    let directory = SessionDirectory::new();
    let cookies = CookieJar::new(&crate::entropy::os()).map_err(|e| invalid(e.to_string()))?;
    let clock = SystemClock::new();
    let mut counters = LoopCounters::group(sockets.len() + 1);
    // The last slot is the deployer's.
    let deployer_counters = counters
        .pop()
        .expect("one slot per loop and the deployer's");
    let deployer = match &options.deploy {
        Some(policy) => Some(super::deployer::spawn(
            cluster.clone(),
            policy.clone(),
            directory.clone(),
            options.telemetry.clone(),
            deployer_counters,
        )?),
        None => None,
    };
    let deploys = deployer.as_ref().map(|(q, _)| q.clone());
    let run = |((socket, shard), counters): ((Socket, Shard), LoopCounters), stop: &LoopStop| {
        let place = LoopPlace {
            deploys: deploys.clone(),
            shard,
            directory: directory.clone(),
            cookies: cookies.clone(),
            clock,
        };
        run_host_loop(cluster.clone(), socket, &options, stop, place, counters)
    };
    let mut work = sockets.into_iter().zip(shards).zip(counters);
    let first = work
        .next()
        .ok_or_else(|| invalid("no socket to serve on".into()))?;
    let others: Vec<_> = work.map(|w| move |stop: &LoopStop| run(w, stop)).collect();
    let result = run_loops("naam-loop", stop, |stop| run(first, stop), others);
    // The loops are gone, and their queues with them: the deployer finishes the job it is on.
    drop(deploys);
    if let Some((q, thread)) = deployer {
        drop(q);
        let _ = thread.join();
    }
    result
}

/// When a group of receive loops stops: at the caller's flag, or as soon as one loop of the
/// group fails (returns an error or panics). Without the second, a loop that stops with an
/// error (a NIC the server keeps refusing, a socket gone) would leave its siblings serving
/// until somebody set the caller's flag, and the process would neither serve nor exit.
pub(crate) struct LoopStop<'a> {
    caller: &'a AtomicBool,
    failed: AtomicBool,
}

impl<'a> LoopStop<'a> {
    pub(crate) fn new(caller: &'a AtomicBool) -> Self {
        LoopStop {
            caller,
            failed: AtomicBool::new(false),
        }
    }

    /// The loops are to drain and return.
    pub(crate) fn is_set(&self) -> bool {
        self.caller.load(Ordering::SeqCst) || self.failed.load(Ordering::SeqCst)
    }
}

/// Sets the group's `failed` unless disarmed: dropped by an error's return or by a panic's
/// unwinding alike.
struct FailGuard<'s, 'a> {
    stop: &'s LoopStop<'a>,
    armed: bool,
}

impl Drop for FailGuard<'_, '_> {
    fn drop(&mut self) {
        if self.armed {
            self.stop.failed.store(true, Ordering::SeqCst);
        }
    }
}

/// Runs `run(stop)`, marking the group failed if it does not return `Ok`.
fn run_guarded<S>(
    stop: &LoopStop<'_>,
    run: impl FnOnce(&LoopStop<'_>) -> std::io::Result<S>,
) -> std::io::Result<S> {
    let mut guard = FailGuard { stop, armed: true };
    let out = run(stop);
    guard.armed = out.is_err();
    out
}

/// Runs `first` on the calling thread and each of `others` on a thread of its own (named
/// `{name}-{i}`, `i` from 1), until all return; their counters, summed. The loops stop at
/// `stop` or when any of them fails ([`LoopStop`]); then the first error (the calling
/// thread's loop first, then the others in order) is the group's.
pub(crate) fn run_loops<S: std::ops::AddAssign + Send>(
    name: &str,
    stop: &AtomicBool,
    first: impl FnOnce(&LoopStop<'_>) -> std::io::Result<S>,
    others: Vec<impl FnOnce(&LoopStop<'_>) -> std::io::Result<S> + Send>,
) -> std::io::Result<S> {
    let stop = LoopStop::new(stop);
    let stop = &stop;
    std::thread::scope(|scope| {
        let mut threads = Vec::with_capacity(others.len());
        for (i, run) in others.into_iter().enumerate() {
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{}", i + 1))
                .spawn_scoped(scope, move || run_guarded(stop, run));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // The loops already started stop (and are joined as the scope ends).
                    stop.failed.store(true, Ordering::SeqCst);
                    return Err(e);
                }
            }
        }
        let mut total = run_guarded(stop, first);
        for t in threads {
            let joined = t
                .join()
                .map_err(|_| std::io::Error::other(format!("{name}: a receive loop panicked")))
                .and_then(|r| r);
            total = match (total, joined) {
                (Ok(mut sum), Ok(s)) => {
                    sum += s;
                    Ok(sum)
                }
                (Err(e), _) | (Ok(_), Err(e)) => Err(e),
            };
        }
        total
    })
}

/// One receive loop of naam-server (see [`serve_host_loops`]).
fn run_host_loop(
    cluster: Arc<Cluster>,
    mut socket: Socket,
    options: &ServerOptions,
    stop: &LoopStop,
    place: LoopPlace,
    counters: LoopCounters,
) -> std::io::Result<ServerStats> {
    let clock = place.clock;
    let local = socket.local_addr()?;
    let mut endpoint = host_endpoint(
        cluster,
        socket.sender()?,
        options,
        local,
        socket.in_memory(),
        clock.now(),
        place,
    )?;
    let mut drain_deadline: Option<Instant> = None;
    let mut next_publish = Instant::now();
    let mut out: Vec<Transmit> = Vec::new();
    // The messages of one receive (reused, as `out` is).
    let mut batch = Vec::new();
    let mut poller = Poller::new(SERVER_SPIN);
    loop {
        if stop.is_set() && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
            endpoint.start_drain();
        }
        if let Some(d) = drain_deadline {
            if endpoint.backend().replies.idle() || Instant::now() >= d {
                endpoint.backend_mut().flush_load();
                return Ok(endpoint.stats());
            }
        }
        if Instant::now() >= next_publish {
            next_publish = Instant::now() + Duration::from_secs(1);
            endpoint.backend_mut().replies.hand_over();
            let mut mine = endpoint.stats().counters();
            mine.extend(socket.stats().counters());
            counters.publish(&options.telemetry, mine);
        }
        // Block until a datagram or the next timer: an idle server wakes a few times a
        // second, not a thousand. With requests waiting, only look for new datagrams.
        let now = clock.now();
        let wait = endpoint
            .poll_timeout()
            .map_or(IDLE_WAIT, |t| Duration::from_nanos(t.saturating_sub(now)))
            .clamp(Duration::from_micros(1), IDLE_WAIT);
        if endpoint.has_waiting() {
            // A look at what is there, no wait: it tells the poller nothing about gaps.
            socket.try_recv_into(&mut batch)?;
        } else {
            socket.recv_into(poller.spin(), wait, &mut batch)?;
            poller.arrived(clock.now(), !batch.is_empty());
        }
        if batch.is_empty() {
            // Nothing came: what the loop ran reaches the steering now, not at the next busy
            // moment.
            endpoint.backend_mut().flush_load();
        }
        // A whole batch is taken in, then every answer goes out together. A full batch means a
        // backlog: the socket is drained (within bounds) before anything runs, so that
        // admission sees every tenant's datagrams, refuses what is over credit at once, and a
        // flood cannot hide another tenant's request behind it in the kernel's queue.
        let mut full = batch.len() >= super::socket::RECV_BATCH;
        let alone = batch.len() == 1;
        for (peer, msg) in batch.drain(..) {
            if alone {
                // Nothing came with it to take turns with: it runs as it is taken in (when
                // nothing waits from before either), as the turns would run it next.
                endpoint.handle_alone(clock.now(), peer, msg);
            } else {
                endpoint.handle(clock.now(), peer, msg);
            }
        }
        let mut drained = 0;
        while full && drained < MAX_DRAIN {
            socket.try_recv_into(&mut batch)?;
            full = batch.len() >= super::socket::RECV_BATCH;
            drained += 1;
            for (peer, msg) in batch.drain(..) {
                endpoint.handle(clock.now(), peer, msg);
            }
        }
        // The admitted requests run, tenants taking turns, for a short while; what is left (a
        // flood) waits for the next round, after the datagrams that came meanwhile had their
        // say: another tenant's request waits one round at most, not a flood's worth.
        let round = Instant::now();
        while endpoint.run(RUN_STEP) > 0 && round.elapsed() < RUN_ROUND {}
        endpoint.handle_timeout(clock.now());
        while let Some(t) = endpoint.poll_transmit() {
            out.push(t);
        }
        if !out.is_empty() {
            socket.send_batch(&mut out);
        }
        poller.served(clock.now());
    }
}

/// Requests a driver loop runs between two looks at the clock.
const RUN_STEP: usize = 4;

/// How long a driver loop runs admitted requests before it looks at its socket again: short,
/// so that new arrivals (another tenant's next request) join the turns soon.
const RUN_ROUND: Duration = Duration::from_micros(20);

/// Extra receive batches a loop takes in before it runs anything, when its socket has a
/// backlog.
const MAX_DRAIN: usize = 16;

/// The most a busy server loop polls before it sleeps. A closed-loop client on loopback sends
/// its next request 15-30 us after its answer left; a loop that sleeps instead pays a wake-up
/// on every request (20 us: 25 K ops/s for one client at pipeline 1 instead of 75 K, and
/// spurious resends once the wake-ups outlast the probe timeout; bench/RESULTS.md).
const SERVER_SPIN: Duration = Duration::from_micros(50);

/// The longest an idle driver loop blocks before it looks at its stop flag, timers and
/// counters again.
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// naam-server's endpoint bound as a service of a [`MemoryNet`] ([`serve_host_inline`]): a
/// datagram to it is handled in the sending thread, so a client's request reaches the host
/// executors with no hand-off to a driver thread. Dropping it closes the port at once;
/// [`InlineServer::stop`] drains first.
pub struct InlineServer {
    port: ServedPort,
    service: Arc<InlineGroup<ServerEndpoint<ClusterHost>>>,
    drain: Duration,
}

impl InlineEndpoint for ServerEndpoint<ClusterHost> {
    fn handle(&mut self, now: Nanos, from: SocketAddr, msg: Bytes) {
        // One datagram at a time in a MemoryNet: its request, if admitted, runs at once.
        self.handle_alone(now, from, msg);
        self.run(usize::MAX);
    }
    fn handle_timeout(&mut self, now: Nanos) {
        ServerEndpoint::handle_timeout(self, now);
        self.backend_mut().replies.hand_over();
    }
    fn poll_timeout(&self) -> Option<Nanos> {
        ServerEndpoint::poll_timeout(self)
    }
    fn poll_transmit(&mut self) -> Option<Transmit> {
        ServerEndpoint::poll_transmit(self)
    }
    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        self.stats().counters()
    }
    fn start_drain(&mut self) {
        ServerEndpoint::start_drain(self)
    }
    fn idle(&self) -> bool {
        self.backend().replies.idle()
    }
    fn request_in_process(
        &mut self,
        now: Nanos,
        sid: u64,
        req: &mut Request,
        out: &mut Reply,
    ) -> Option<InProcess> {
        let answer = ServerEndpoint::request_in_process(self, now, sid, req, out);
        // Whatever waits its turn (nothing, between datagrams) runs now, as after one.
        if self.has_waiting() {
            self.run(usize::MAX);
        }
        answer
    }
}

/// Binds naam-server's endpoints over `cluster` at `addr` in `net` as an inline service (see
/// [`InlineServer`]), one per receive loop as [`serve_host_loops`] runs them: `loops`
/// endpoints, each with its shard of the sessions, sharing the cluster, the cookie key and the
/// clock. `addr` with port 0 takes a free port.
pub fn serve_host_inline(
    cluster: Arc<Cluster>,
    net: &MemoryNet,
    addr: SocketAddr,
    options: ServerOptions,
    loops: usize,
) -> std::io::Result<InlineServer> {
    let publish_every = Duration::from_secs(1);
    let shards = Shard::all(loops).map_err(|e| invalid(e.to_string()))?;
    let directory = SessionDirectory::new();
    let cookies = CookieJar::new(&crate::entropy::os()).map_err(|e| invalid(e.to_string()))?;
    let clock = SystemClock::new();
    let (port, service) = InlineGroup::bind(
        net,
        addr,
        loops,
        options.telemetry.clone(),
        publish_every,
        |i, local, replies, now| {
            // Deploys are taken by socket servers (naam-server); an inline one refuses them.
            let place = LoopPlace {
                deploys: None,
                shard: shards[i],
                directory: directory.clone(),
                cookies: cookies.clone(),
                clock,
            };
            host_endpoint(cluster.clone(), replies, &options, local, true, now, place)
        },
    )?;
    Ok(InlineServer {
        port,
        service,
        drain: options.drain,
    })
}

impl InlineServer {
    /// The address clients send to.
    pub fn addr(&self) -> SocketAddr {
        self.port.addr()
    }

    /// The endpoints' counters so far, summed over the loops.
    pub fn stats(&self) -> ServerStats {
        let mut sum = ServerStats::default();
        for s in self.service.read(ServerEndpoint::stats) {
            sum += s;
        }
        sum
    }

    /// Refuses new requests with `Unavailable`, waits (at most the drain time of its
    /// [`ServerOptions`]) until the queued ones are answered, then closes the port.
    pub fn stop(self) -> ServerStats {
        self.service.drain(self.drain);
        self.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop of the group, boxed so that loops of different kinds share one list.
    type Loop = Box<dyn FnOnce(&LoopStop) -> std::io::Result<u32> + Send>;

    /// A loop that serves until the group stops.
    fn serve_until_stopped(stop: &LoopStop<'_>) -> std::io::Result<u32> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !stop.is_set() {
            assert!(Instant::now() < deadline, "the loop was never stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(1)
    }

    #[test]
    fn loops_stop_at_the_callers_flag_and_sum_their_counters() {
        let flag = AtomicBool::new(false);
        let flag = &flag;
        let others: Vec<_> = (0..2)
            .map(|_| |stop: &LoopStop| serve_until_stopped(stop))
            .collect();
        let total = run_loops(
            "t",
            flag,
            |stop| {
                flag.store(true, Ordering::SeqCst);
                serve_until_stopped(stop)
            },
            others,
        );
        assert_eq!(total.unwrap(), 3);
    }

    #[test]
    fn the_first_loop_failing_stops_the_others_and_its_error_is_the_groups() {
        let flag = AtomicBool::new(false);
        let others: Vec<_> = (0..2)
            .map(|_| |stop: &LoopStop| serve_until_stopped(stop))
            .collect();
        let err = run_loops(
            "t",
            &flag,
            |_| {
                Err::<u32, _>(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "refused",
                ))
            },
            others,
        )
        .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(
            !flag.load(Ordering::SeqCst),
            "the caller's flag is the caller's"
        );
    }

    #[test]
    fn another_loop_failing_or_panicking_stops_the_first() {
        let flag = AtomicBool::new(false);
        let failing: Vec<Loop> = vec![
            Box::new(|stop: &LoopStop| serve_until_stopped(stop)),
            Box::new(|_: &LoopStop| Err(std::io::Error::other("socket gone"))),
        ];
        let err = run_loops("t", &flag, serve_until_stopped, failing).unwrap_err();
        assert_eq!(err.to_string(), "socket gone");

        let panicking: Vec<Loop> = vec![Box::new(|_: &LoopStop| panic!("a bug in a loop"))];
        let err = run_loops("t", &flag, serve_until_stopped, panicking).unwrap_err();
        assert!(err.to_string().contains("a receive loop panicked"), "{err}");
    }
}
