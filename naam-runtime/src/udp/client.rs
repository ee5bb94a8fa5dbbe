//! The client side of the UDP fabric: a [`Transport`] that sends active messages to
//! `naam-server` and runs read handlers itself (Client placement) with one-sided READs served
//! by the NIC's agent. It follows the server's steering weights, which it refreshes every few
//! milliseconds while reporting what it measured.
//!
//! The protocol is [`ClientEndpoint`]'s (sessions and their renewal after a server restart,
//! request ids, retransmission, liveness); this module is its driver ([`Conn`]: a socket, a
//! clock, one short loop) and the client's choices (where to run, weights, metrics). A server
//! silent for longer than [`UdpConfig::liveness`] makes every call fail with
//! [`ClientError::ServerGone`].

use crate::intmap::{IntMap, IntSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use naam_ebpf::abi::{Descriptor, ACCESS_READ};
use naam_proto::endpoint::{
    ClientConfig, ClientEndpoint, ClientEvent, ConnectError, ExchangeError, InProcess,
};
use naam_proto::Nanos;

use super::socket::Socket;
use crate::cluster::run_at_client;
use crate::executor::ClientPath;
use crate::metrics::MetricsShard;
use crate::Metrics;
use crate::{Clock, SystemClock};
use crate::{HandlerSpec, Registry};
use naam_proto::control::{object_hash, Control, DeployHandler, DeployReport, Manifest};
use naam_proto::limits;
use naam_proto::onesided;
use naam_proto::session::{self, Credential};
use naam_proto::steering::Selector;
use naam_proto::steering::{Ewma, HandlerKey, LoadTracker, Weights};
use naam_proto::step::HandlerKind;
use naam_proto::step::{FetchError, Limits, OneSided};
use naam_proto::transport::ClientError;
use naam_proto::transport::Transport;
use naam_proto::wire::{flags, Reply, ReplyView, Request, Status};
use naam_proto::Placement;
use naam_vm::VerifierConfig;
use naam_vm::Vm;

/// Manifest pages a client fetches at most (tens of thousands of apps).
const MAX_MANIFEST_PAGES: u32 = 4096;

/// Weight queries a client sends per refresh interval at most.
const QUERIES_PER_REFRESH: usize = 16;

/// Client settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct UdpConfig {
    /// `naam-server`'s address.
    pub server: SocketAddr,
    /// Datagram size (1472 fits a 1500-byte MTU; up to 8972 with jumbo frames; the default
    /// is [`super::datagram_for`] the server's address).
    pub datagram: usize,
    /// Retransmission timeout until a round trip is measured; then each path's estimate
    /// (RFC 6298) within `min_rto` and `max_rto`. Two resends wait it again, then it doubles
    /// on every one, back to it whenever the path answers another request.
    pub rto: Duration,
    /// The least retransmission timeout.
    pub min_rto: Duration,
    /// The largest retransmission timeout.
    pub max_rto: Duration,
    /// Sends per request before giving up (the first one included).
    pub attempts: u32,
    /// How often the steering weights are refreshed.
    pub refresh: Duration,
    /// How long the first contact may take.
    pub connect_timeout: Duration,
    /// Pin every read to one placement (baselines); `None` follows the weights.
    pub pin: Option<Placement>,
    /// The tenant the client authenticates as: an app's name (the session may use every app
    /// configured with the same credential), or [`session::OPERATOR_TENANT`].
    pub tenant: String,
    /// The tenant's credential.
    pub credential: Credential,
    /// How long the server may stay silent before every call fails with
    /// [`ClientError::ServerGone`].
    pub liveness: Duration,
    /// Datagram authentication: always on, but for a loopback measurement of its cost
    /// ([`session::Authentication`]); it must match the server's.
    pub authentication: session::Authentication,
    /// Fraction of received datagrams the client's socket drops on purpose (fault injection;
    /// see [`super::socket::INJECT_LOSS_ENV`]). `None`: none.
    pub inject_loss: Option<f64>,
    /// Send through this in-process network instead of the kernel's UDP (a deployment in one
    /// process, see [`super::MemoryNet`]); `None`: a UDP socket.
    pub network: Option<super::MemoryNet>,
    /// With a `network`: hand requests to a server endpoint bound in it as they are, in
    /// this thread, with no encoding, envelope or datagram (one address space); its answer
    /// comes back from the call when the server runs the request at once, as a datagram
    /// otherwise. The handshake, control messages and one-sided reads stay datagrams, and
    /// the server admits such a request as one in a datagram of the session. Off: every
    /// request is a datagram, as over UDP.
    pub in_process: bool,
}

impl UdpConfig {
    /// Defaults for `server`, authenticating as `tenant` with `credential`.
    pub fn new(server: SocketAddr, tenant: &str, credential: Credential) -> UdpConfig {
        UdpConfig {
            server,
            datagram: super::datagram_for(server),
            rto: Duration::from_millis(20),
            min_rto: Duration::from_micros(50),
            max_rto: Duration::from_secs(1),
            attempts: 8,
            refresh: Duration::from_millis(5),
            connect_timeout: Duration::from_secs(2),
            pin: None,
            tenant: tenant.to_string(),
            credential,
            liveness: Duration::from_secs(10),
            authentication: session::Authentication::On,
            inject_loss: None,
            network: None,
            in_process: false,
        }
    }
}

/// Why a UDP client could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UdpError {
    /// A socket operation failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The server did not answer the hello.
    #[error("no answer from naam-server at {server} within {waited:?} (is it running, and is the address reachable from this namespace?)")]
    NoServer {
        /// Address tried.
        server: SocketAddr,
        /// How long the handshake went unanswered before the client gave up (about
        /// [`UdpConfig::connect_timeout`]).
        waited: Duration,
    },
    /// The server refused.
    #[error("naam-server at {server} refused: {message}")]
    Refused {
        /// The server's address, as configured ([`UdpConfig::server`]).
        server: SocketAddr,
        /// Why: the server's `Error` message, or what the client found wrong (address scope,
        /// welcome, manifest pages).
        message: String,
    },
    /// The server serves no such app.
    #[error("naam-server serves no app {0}")]
    UnknownApp(u32),
    /// The client's handler object is not the server's.
    #[error("app {app}: the handler object here (hash {local:#x}) differs from the server's ({server:#x}); rebuild both from the same source")]
    ObjectMismatch {
        /// The app [`UdpClient::install_handlers`] was asked to install handlers for.
        app: u32,
        /// [`object_hash`] of the object bytes the caller passed in.
        local: u64,
        /// The manifest's `object_hash` for the app: the hash of the object the server loaded.
        server: u64,
    },
    /// The handlers could not be loaded or verified.
    #[error("loading app {0}'s handlers: {1}")]
    Handlers(u32, String),
}

/// What became of a request handed to the server endpoint in this process.
enum HandedIn {
    /// Answered in the call: its reply is in the caller's slot; when it came.
    Answered(Nanos),
    /// Taken, to be answered as a datagram to the exchange of this id.
    Later(u64),
}

/// The longest the driver blocks in one receive, so that it notices due timers promptly.
const MAX_WAIT: Duration = Duration::from_millis(1);

/// How long a waiting client polls its socket before it sleeps.
const CLIENT_SPIN: Duration = Duration::from_micros(100);

/// The UDP driver of a [`ClientEndpoint`]: its socket, its clock, and what the client does
/// with the endpoint's events. Every protocol decision (sessions, ids, retransmission,
/// matching answers) is the endpoint's.
pub(crate) struct Conn {
    socket: Socket,
    endpoint: ClientEndpoint,
    clock: SystemClock,
    /// The latest reading of `clock` ([`Conn::stamp`]): when the call being served began,
    /// or when the driver last took messages in. Sends and the receive's timer bound use it
    /// rather than reading the counter again (a read costs 15-20 ns in a VM, and a call used
    /// to make six); it is at most one round of the driver old.
    now: Nanos,
    /// Control messages that answered no exchange (weights after a refresh).
    inbox: Vec<Control>,
    /// Answers and failures of exchanges no one was waiting for by name.
    answers: Vec<ClientEvent>,
    /// When to poll before sleeping (after a send, while answers come back soon).
    poller: super::socket::Poller,
    rtt: Ewma,
    /// One-sided READs over a direct path (RDMA verbs: `use_rdma`) instead of the agent.
    direct_reads: Option<Box<dyn OneSided + Send>>,
    /// The messages of one receive (kept for its capacity).
    received: Vec<(SocketAddr, Bytes)>,
    /// The network whose server endpoint takes this client's requests as they are
    /// ([`UdpConfig::in_process`]), and the way to that endpoint in it.
    in_process: Option<(super::MemoryNet, super::memnet::ServiceRoute)>,
}

impl Conn {
    /// Whether one-sided READs have somewhere to go: RDMA, or the NIC's agent.
    fn one_sided_up(&self) -> bool {
        self.direct_reads.is_some() || self.endpoint.agent().is_some()
    }

    /// Reads the clock and keeps the reading as [`Conn::now`].
    fn stamp(&mut self) -> Nanos {
        self.now = self.clock.now();
        self.now
    }

    /// Sends what the endpoint asks for.
    fn flush(&mut self) -> std::io::Result<()> {
        let mut sent = false;
        while let Some(t) = self.endpoint.poll_transmit() {
            self.socket.send_transmit(t)?;
            sent = true;
        }
        if sent {
            self.poller.served(self.now);
        }
        Ok(())
    }

    /// The driver loop: sends, receives and fires timers until `until` takes an event
    /// (`Ok`; it gives back, as `Err`, one it does not take). Answers it does not take (other
    /// exchanges of a pipelined client) are kept for [`Conn::take_answers`].
    fn drive<T>(
        &mut self,
        mut until: impl FnMut(ClientEvent) -> Result<T, ClientEvent>,
    ) -> std::io::Result<T> {
        loop {
            self.flush()?;
            while let Some(event) = self.endpoint.poll_event() {
                match event {
                    ClientEvent::Control(c) => self.inbox.push(*c),
                    event => match until(event) {
                        Ok(t) => return Ok(t),
                        Err(event) => self.answers.push(event),
                    },
                }
            }
            self.turn(MAX_WAIT)?;
        }
    }

    /// One round of the driver: receives for up to `wait` (less when a timer is due sooner),
    /// then fires the timers that are due.
    fn turn(&mut self, wait: Duration) -> std::io::Result<()> {
        // The timers are bounded from the latest reading: at most one driver round old, so a
        // due timer fires that much late at worst, against a retransmission floor of tens of
        // microseconds.
        let now = self.now;
        let wait = self
            .endpoint
            .poll_timeout()
            .map_or(wait, |d| Duration::from_nanos(d.saturating_sub(now)))
            .min(wait);
        // Poll a moment before sleeping when answers have been coming back that soon: the
        // answer to a request just sent comes within a round trip, and the server need not
        // wake this thread to deliver it. When they come later (a busy server, many clients),
        // sleep at once and leave the cores to the server.
        let spin = self.poller.spin();
        let mut got = std::mem::take(&mut self.received);
        self.socket.recv_into(spin.min(wait), wait, &mut got)?;
        // One reading for the whole batch and the timers after it: they were all taken in at
        // this moment.
        let now = self.stamp();
        self.poller.arrived(now, !got.is_empty());
        for (from, m) in got.drain(..) {
            self.endpoint.handle(now, from, m);
        }
        self.received = got;
        self.endpoint.handle_timeout(now);
        Ok(())
    }

    /// Answers and failures that arrived for exchanges nobody waits for by name, and those
    /// the endpoint has ready now; control messages go to the inbox.
    fn take_answers(&mut self) -> Vec<ClientEvent> {
        while let Some(event) = self.endpoint.poll_event() {
            match event {
                ClientEvent::Control(c) => self.inbox.push(*c),
                event => self.answers.push(event),
            }
        }
        std::mem::take(&mut self.answers)
    }

    /// Sets up a session and returns the server's welcome.
    fn connect(&mut self) -> Result<Control, UdpError> {
        let now = self.stamp();
        self.endpoint.connect(now);
        let r = self.drive(|event| match event {
            ClientEvent::Connected(welcome) => Ok(Ok(*welcome)),
            ClientEvent::ConnectFailed(e) => Ok(Err(e)),
            other => Err(other),
        })?;
        r.map_err(|e| match e {
            ConnectError::NoServer { server, waited_ns } => UdpError::NoServer {
                server,
                waited: Duration::from_nanos(waited_ns),
            },
            ConnectError::Refused { server, message } => UdpError::Refused { server, message },
            other => UdpError::Refused {
                server: self.endpoint.server(),
                message: other.to_string(),
            },
        })
    }

    /// Waits for exchange `id`'s answer.
    fn wait(&mut self, id: Result<u64, ExchangeError>) -> Result<Bytes, ClientError> {
        let id = id.map_err(|e| self.client_error(e))?;
        let r = self
            .drive(|event| match event {
                ClientEvent::Answered { id: i, message } if i == id => Ok(Ok(message)),
                ClientEvent::Failed { id: i, error } if i == id => Ok(Err(error)),
                other => Err(other),
            })
            .map_err(|_| ClientError::Shutdown)?;
        r.map_err(|e| self.client_error(e))
    }

    /// A failed exchange as callers see it: a timeout past the liveness bound means the
    /// server is gone.
    fn client_error(&self, e: ExchangeError) -> ClientError {
        let gone = |silent_ns, bound_ns| ClientError::ServerGone {
            silent: Duration::from_nanos(silent_ns),
            bound: Duration::from_nanos(bound_ns),
        };
        match e {
            ExchangeError::TimedOut { waited_ns } => {
                match self.endpoint.check_alive(self.clock.now()) {
                    Err(ExchangeError::ServerGone {
                        silent_ns,
                        bound_ns,
                    }) => gone(silent_ns, bound_ns),
                    _ => ClientError::Timeout(Duration::from_nanos(waited_ns)),
                }
            }
            ExchangeError::ServerGone {
                silent_ns,
                bound_ns,
            } => gone(silent_ns, bound_ns),
            ExchangeError::Encode(w) => ClientError::Wire(w),
            other => ClientError::Session(other.to_string()),
        }
    }

    /// Hands `req` to the server endpoint in this process ([`UdpConfig::in_process`]) at
    /// `start`: when its reply came (written into `out`), or the id of the exchange its
    /// answer will come to as a datagram; `None`, the request left where it is, when it must
    /// go as a datagram (not [`UdpConfig::in_process`], no session yet, none the server
    /// holds, or no such endpoint).
    fn hand_in(
        &mut self,
        start: Nanos,
        req: &mut Request,
        out: &mut Reply,
    ) -> Result<Option<HandedIn>, ClientError> {
        // Taken out for the call and put back: cloning it would count a reference per call.
        let Some(mut link) = self.in_process.take() else {
            return Ok(None);
        };
        let handed = self.hand_in_over(&mut link, start, req, out);
        self.in_process = Some(link);
        handed
    }

    /// [`Conn::hand_in`] over `link`, the network and the way to its server endpoint.
    fn hand_in_over(
        &mut self,
        (net, route): &mut (super::MemoryNet, super::memnet::ServiceRoute),
        start: Nanos,
        req: &mut Request,
        out: &mut Reply,
    ) -> Result<Option<HandedIn>, ClientError> {
        let sid = match self.endpoint.request_in_process(start, req) {
            Ok(Some(sid)) => sid,
            Ok(None) => return Ok(None),
            Err(e) => return Err(self.client_error(e)),
        };
        let id = req.request_id;
        let Some(answer) = net.request_in_process(route, start, sid, req, out) else {
            return Ok(None);
        };
        self.endpoint.answered_in_process(start);
        Ok(Some(match answer {
            InProcess::Answered => HandedIn::Answered(self.stamp()),
            // Its answer comes as a datagram (or, dropped for a muted session, never: the
            // wait times out as a dropped datagram's would).
            _ => HandedIn::Later(self.endpoint.expect_in_process(start, id)),
        }))
    }

    /// [`Conn::hand_in`] of a call that waits for its answer (written into `out`): when it
    /// came.
    fn call_in_process(
        &mut self,
        start: Nanos,
        req: &mut Request,
        out: &mut Reply,
    ) -> Result<Option<Nanos>, ClientError> {
        match self.hand_in(start, req, out)? {
            None => Ok(None),
            Some(HandedIn::Answered(end)) => Ok(Some(end)),
            Some(HandedIn::Later(id)) => {
                let m = self.wait(Ok(id))?;
                *out = Reply::decode(m)?;
                Ok(Some(self.now))
            }
        }
    }

    /// Sends control query `message` to the server in the session and waits for the answer.
    fn ask(&mut self, message: &Control) -> Result<Bytes, ClientError> {
        let now = self.stamp();
        let id = self.endpoint.query(now, message);
        self.wait(id)
    }
}

impl OneSided for Conn {
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, FetchError> {
        if let Some(d) = descs.iter().find(|d| d.access & ACCESS_READ == 0) {
            return Err(FetchError::Resolve(
                naam_proto::step::ResolveError::AccessDenied {
                    need: ACCESS_READ,
                    have: d.access,
                },
            ));
        }
        if let Some(direct) = &mut self.direct_reads {
            let rtt = direct.read(app, descs, bufs)?;
            self.rtt.add(rtt as f64);
            return Ok(rtt);
        }
        let agent = self.endpoint.agent().ok_or_else(|| {
            FetchError::Unavailable("no one-sided agent: the server reports no naam-nic".into())
        })?;
        let start = Instant::now();
        let now = self.stamp();
        let id = self.endpoint.read(now, app, descs);
        let m = self
            .wait(id)
            .map_err(|e| FetchError::Unavailable(format!("the one-sided agent at {agent}: {e}")))?;
        let c = onesided::Completion::decode(m).map_err(|e| FetchError::Refused {
            status: Status::Malformed,
            message: e.to_string(),
        })?;
        if c.status != Status::Ok {
            return Err(FetchError::Refused {
                status: c.status,
                message: String::from_utf8_lossy(&c.data).into_owned(),
            });
        }
        let total: usize = descs.iter().map(|d| d.len as usize).sum();
        if c.data.len() != total {
            return Err(FetchError::Refused {
                status: Status::Malformed,
                message: format!("READ returned {} bytes for {total}", c.data.len()),
            });
        }
        let mut at = 0;
        for (d, b) in descs.iter().zip(bufs.iter_mut()) {
            let n = d.len as usize;
            b.clear();
            b.extend_from_slice(&c.data[at..at + n]);
            at += n;
        }
        let rtt = start.elapsed().as_nanos() as u64;
        self.rtt.add(rtt as f64);
        Ok(rtt)
    }
}

/// What a deploy or undeploy made ([`UdpClient::deploy`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Deployment {
    /// The app.
    pub app: u32,
    /// The server's manifest version that serves it.
    pub version: u64,
    /// The verifier's report on each handler installed (none after an undeploy).
    pub handlers: Vec<DeployReport>,
}

/// Read or write, per handler of `apps`, as the manifest says.
fn handler_kinds(apps: &[naam_proto::control::AppManifest]) -> IntMap<HandlerKey, HandlerKind> {
    let mut kinds = IntMap::default();
    for a in apps {
        for h in &a.handlers {
            let k = if h.write {
                HandlerKind::Write
            } else {
                HandlerKind::Read
            };
            kinds.insert((a.id, h.id), k);
        }
    }
    kinds
}

/// A client of `naam-server` over UDP. One call at a time; make one per thread.
pub struct UdpClient {
    path: ClientPath<Conn>,
    manifest: Manifest,
    registry: Registry,
    kinds: IntMap<HandlerKey, HandlerKind>,
    vm: Vm,
    clock: SystemClock,
    limits: Limits,
    weights: IntMap<HandlerKey, Weights>,
    selectors: IntMap<HandlerKey, Selector>,
    refresh: Duration,
    /// When the weights are next refreshed, on [`UdpClient::clock`] (0: at the next call).
    next_refresh: Nanos,
    apps_used: IntSet<u32>,
    /// `apps_used` in first-use order, and where the next refresh starts in it.
    refresh_order: Vec<u32>,
    refresh_cursor: usize,
    agent_down_until: Option<Instant>,
    tracker: LoadTracker,
    /// Where calls are recorded: a shard of the metrics of this client's own (another
    /// client thread's never takes its lock), and the metrics, for the transport's counts.
    metrics: Option<(Arc<Metrics>, MetricsShard)>,
    pin: Option<Placement>,
    /// Submitted messages not yet answered: their handler and when they were sent.
    pending: IntMap<u64, (HandlerKey, Nanos)>,
    /// Answers ready for the next poll (messages the client ran itself, failures).
    ready: Vec<(u64, Result<Reply, ClientError>)>,
    /// The request the last call was built in, for the next to be built in
    /// ([`Request::refill_call`]): one the server in this process answered at once is left
    /// here as it was handed in, its args' buffer ready to be written again; one that was
    /// sent as a datagram was only encoded. Boxed, so that taking it out for a call and
    /// putting it back moves a pointer, not 360 bytes.
    spare: Option<Box<Request>>,
    /// Where the reply of the call under way is written, by the server in this process or
    /// by the decoder ([`Reply::unanswered`] between calls): read in place, not moved out
    /// of each layer it crosses.
    answer: Reply,
}

impl UdpClient {
    /// Says hello to the server and learns what it serves.
    pub fn connect(config: &UdpConfig) -> Result<UdpClient, UdpError> {
        let bind: SocketAddr = if config.server.is_ipv4() {
            "0.0.0.0:0".parse().expect("literal")
        } else {
            "[::]:0".parse().expect("literal")
        };
        config
            .authentication
            .check_fabric(config.server, config.network.is_some())
            .map_err(|message| UdpError::Refused {
                server: config.server,
                message,
            })?;
        let mut socket = match &config.network {
            Some(net) => Socket::bind_memory(net, bind, config.datagram)?,
            None => Socket::bind(bind, config.datagram)?,
        };
        socket.inject_loss(config.inject_loss);
        // The process's clock, which a server endpoint in the process reads too: a request
        // handed to it in process carries this client's reading.
        let clock = SystemClock::of_process();
        let mut endpoint_config = ClientConfig::new(
            config.server,
            &config.tenant,
            config.credential.clone(),
            crate::entropy::os(),
        );
        endpoint_config.rto = config.rto.as_nanos() as Nanos;
        endpoint_config.min_rto = config.min_rto.as_nanos() as Nanos;
        endpoint_config.max_rto = config.max_rto.as_nanos() as Nanos;
        endpoint_config.attempts = config.attempts.max(1);
        endpoint_config.connect_timeout = config.connect_timeout.as_nanos() as Nanos;
        endpoint_config.liveness = config.liveness.as_nanos() as Nanos;
        endpoint_config.authentication = config.authentication;
        let now = clock.now();
        let mut endpoint = ClientEndpoint::new(endpoint_config, now);
        endpoint.set_datagram_payload(socket.datagram() - naam_proto::frame::HEADER);
        let mut conn = Conn {
            socket,
            endpoint,
            clock,
            now,
            inbox: Vec::new(),
            answers: Vec::new(),
            poller: super::socket::Poller::new(CLIENT_SPIN),
            rtt: Ewma::default(),
            direct_reads: None,
            received: Vec::new(),
            in_process: config
                .network
                .clone()
                .filter(|_| config.in_process)
                .map(|net| (net, super::memnet::ServiceRoute::new(config.server))),
        };
        let refused = |message: String| UdpError::Refused {
            server: config.server,
            message,
        };
        let (mut manifest, pages) = match conn.connect()? {
            Control::Welcome {
                manifest, pages, ..
            } => (manifest, pages),
            other => return Err(refused(format!("unexpected welcome {other:?}"))),
        };
        // A large manifest comes in pages after the welcome (a bounded number of them: the
        // count is the server's word).
        if pages > MAX_MANIFEST_PAGES {
            return Err(refused(format!(
                "a manifest of {pages} pages (at most {MAX_MANIFEST_PAGES})"
            )));
        }
        for page in 1..pages {
            let m = conn
                .ask(&Control::QueryManifest { page })
                .map_err(|e| refused(format!("manifest page {page}: {e}")))?;
            match Control::decode(&m) {
                Ok((_, Control::ManifestPage { page: p, apps, .. })) if p == page => {
                    manifest.apps.extend(apps)
                }
                Ok((_, Control::Error { message })) => return Err(refused(message)),
                other => {
                    return Err(refused(format!(
                        "unexpected answer to manifest page {page}: {other:?}"
                    )))
                }
            }
        }
        let kinds = handler_kinds(&manifest.apps);
        Ok(UdpClient {
            path: ClientPath::new(conn),
            manifest,
            registry: Registry::new(),
            kinds,
            vm: Vm::new(),
            // The connection's clock: a call's start and its answer's arrival are read on
            // one clock, whichever of the two read them.
            clock,
            limits: Limits::default(),
            weights: IntMap::default(),
            selectors: IntMap::default(),
            refresh: config.refresh,
            next_refresh: 0,
            apps_used: IntSet::default(),
            refresh_order: Vec::new(),
            refresh_cursor: 0,
            agent_down_until: None,
            tracker: LoadTracker::new(1, now),
            metrics: None,
            pin: config.pin,
            pending: IntMap::default(),
            ready: Vec::new(),
            spare: None,
            answer: Reply::unanswered(),
        })
    }

    /// What the server serves.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Records every call's latency and placement into `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        let shard = metrics.shard();
        self.metrics = Some((metrics, shard));
        self
    }

    /// Installs `app`'s handler object (the ELF bytes) so that its read handlers can run here
    /// (Client placement). The object must be the one the server loaded.
    pub fn install_handlers(&mut self, app: u32, object: &[u8]) -> Result<(), UdpError> {
        let a = self.manifest.app(app).ok_or(UdpError::UnknownApp(app))?;
        let local = object_hash(object);
        if local != a.object_hash {
            return Err(UdpError::ObjectMismatch {
                app,
                local,
                server: a.object_hash,
            });
        }
        let loaded = naam_vm::load(object).map_err(|e| UdpError::Handlers(app, e.to_string()))?;
        let specs: Vec<HandlerSpec> = a
            .handlers
            .iter()
            .filter(|h| !h.write)
            .map(|h| HandlerSpec::read(&h.name).engine(h.engine).budget(h.budget))
            .collect();
        let fail = |e: crate::RegistryError| UdpError::Handlers(app, e.to_string());
        let built = self
            .registry
            .build_handlers(
                app,
                &loaded,
                &specs,
                &VerifierConfig::default(),
                &Default::default(),
            )
            .map_err(fail)?;
        if self.registry.app(app).is_none() {
            self.registry
                .add_app(app, &a.name, Placement::Host)
                .map_err(fail)?;
        }
        // Installed again after a deploy: the new object's handlers replace the old ones.
        self.registry = self.registry.with_handlers(app, built).map_err(fail)?;
        Ok(())
    }

    /// Deploys `handlers` of `object` (an eBPF ELF) as `app`'s handlers on the server, over
    /// this session: uploads the object in chunks, asks for the deploy, and returns the
    /// verifier's report on each handler once they answer calls. Those `app` had and
    /// `handlers` does not name are taken away. `engine` and `budget` default to the
    /// server's. The server refuses (with its reason, [`UdpError::Refused`]) an app that is
    /// not this tenant's, a deploy over the tenant's quotas and a handler the verifier
    /// rejects; nothing changes then.
    pub fn deploy(
        &mut self,
        app: u32,
        object: &[u8],
        handlers: Vec<DeployHandler>,
        engine: Option<naam_proto::EngineKind>,
        budget: Option<u64>,
    ) -> Result<Deployment, UdpError> {
        self.upload(app, object)?;
        self.deploy_uploaded(app, object_hash(object), handlers, engine, budget)
    }

    /// The first half of [`UdpClient::deploy`]: uploads `object` for a deploy into `app`
    /// (what the server holds already of it is not sent again).
    pub fn upload(&mut self, app: u32, object: &[u8]) -> Result<(), UdpError> {
        let server = self.path.transport().endpoint.server();
        let refused = |message: String| UdpError::Refused { server, message };
        let total = u32::try_from(object.len())
            .ok()
            .filter(|t| *t as usize <= limits::MAX_DEPLOY_OBJECT && *t > 0)
            .ok_or_else(|| {
                refused(format!(
                    "an object of {} bytes: a deploy uploads 1 to {} bytes",
                    object.len(),
                    limits::MAX_DEPLOY_OBJECT
                ))
            })?;
        // The server answers with what it holds: the same object uploaded before (a deploy
        // again) is whole at once, and the upload goes on from there.
        let mut offset = 0u32;
        while offset < total {
            let end = (offset as usize + limits::DEPLOY_CHUNK).min(object.len());
            let m = Control::DeployChunk {
                app,
                total,
                object_hash: object_hash(object),
                offset,
                bytes: object[offset as usize..end].to_vec(),
            };
            match self.exchange(&m)? {
                Control::DeployReceived { received, .. }
                    if received as usize >= end && received <= total =>
                {
                    offset = received;
                }
                Control::Error { message } => return Err(refused(message)),
                other => {
                    return Err(refused(format!(
                        "unexpected answer to upload bytes {offset}..{end}: {other:?}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// The second half of [`UdpClient::deploy`]: deploys the object of hash `hash` uploaded
    /// last ([`UdpClient::upload`]).
    pub fn deploy_uploaded(
        &mut self,
        app: u32,
        hash: u64,
        handlers: Vec<DeployHandler>,
        engine: Option<naam_proto::EngineKind>,
        budget: Option<u64>,
    ) -> Result<Deployment, UdpError> {
        let m = Control::Deploy {
            app,
            object_hash: hash,
            handlers,
            engine,
            budget,
        };
        self.deployed(app, &m, Some(hash))
    }

    /// Creates app `name` on the server for this session's tenant, with `regions` (zeroed)
    /// and no handlers ([`UdpClient::deploy`] installs them), and takes up the manifest that
    /// has it; returns its id. An app of that name the tenant has with the same regions is
    /// kept, data and all, and its id returned. Refused ([`UdpError::Refused`], with the
    /// server's reason) past the tenant's quotas on apps and region bytes, for a name taken
    /// by another app, and by a server that lets tenants create no apps.
    pub fn create_app(
        &mut self,
        name: &str,
        regions: Vec<naam_proto::control::NewRegion>,
    ) -> Result<u32, UdpError> {
        let server = self.path.transport().endpoint.server();
        let refused = |message: String| UdpError::Refused { server, message };
        let m = Control::CreateApp {
            name: name.to_string(),
            regions,
        };
        match self.exchange(&m)? {
            Control::AppCreated { app, version, .. } => {
                self.refresh_manifest(version.max(self.manifest.version))?;
                if self.manifest.app(app).is_none() {
                    return Err(refused(format!(
                        "app {name} was created as app {app}, but this session's manifest \
                         does not have it"
                    )));
                }
                Ok(app)
            }
            Control::Error { message } => Err(refused(message)),
            other => Err(refused(format!("unexpected answer: {other:?}"))),
        }
    }

    /// Takes every handler of `app` away on the server (its regions and data stay).
    pub fn undeploy(&mut self, app: u32) -> Result<Deployment, UdpError> {
        self.deployed(app, &Control::Undeploy { app }, None)
    }

    /// Sends deploy or undeploy `m` and takes in its answer (and the manifest it made).
    /// `hash`: the deployed object's ([`object_hash`]; `None` for an undeploy).
    fn deployed(
        &mut self,
        app: u32,
        m: &Control,
        hash: Option<u64>,
    ) -> Result<Deployment, UdpError> {
        let server = self.path.transport().endpoint.server();
        let refused = |message: String| UdpError::Refused { server, message };
        match self.exchange(m)? {
            Control::Deployed {
                app: a,
                version,
                handlers,
            } if a == app => {
                if version == self.manifest.version + 1 {
                    // Nothing else was deployed meanwhile: the answer says what changed,
                    // and the manifest is not fetched again (a round trip less).
                    self.take_up_deploy(app, version, &handlers, hash)?;
                } else {
                    self.refresh_manifest(version.max(self.manifest.version))?;
                }
                Ok(Deployment {
                    app,
                    version,
                    handlers,
                })
            }
            Control::Error { message } => Err(refused(message)),
            other => Err(refused(format!("unexpected answer: {other:?}"))),
        }
    }

    /// Records in this client's manifest what this session's deploy into `app` made
    /// (manifest version `version`, `handlers`, from an object of hash `hash`), as
    /// [`UdpClient::refresh_manifest`] would have found it.
    fn take_up_deploy(
        &mut self,
        app: u32,
        version: u64,
        handlers: &[DeployReport],
        hash: Option<u64>,
    ) -> Result<(), UdpError> {
        if let Some(a) = self.manifest.apps.iter_mut().find(|a| a.id == app) {
            a.handlers = handlers
                .iter()
                .map(|h| naam_proto::control::HandlerManifest {
                    name: h.name.clone(),
                    id: h.id,
                    write: h.write,
                    engine: h.engine,
                    budget: h.budget,
                })
                .collect();
            if let Some(hash) = hash {
                a.object_hash = hash;
            }
        }
        if self.registry.app(app).is_some() {
            // Its object changed: nothing of it runs here until installed again.
            self.registry = self
                .registry
                .with_handlers(app, Default::default())
                .map_err(|e| UdpError::Handlers(app, e.to_string()))?;
        }
        self.kinds = handler_kinds(&self.manifest.apps);
        self.manifest.version = version;
        Ok(())
    }

    /// Sends `m` and decodes its answer.
    fn exchange(&mut self, m: &Control) -> Result<Control, UdpError> {
        let server = self.path.transport().endpoint.server();
        let b = self
            .path
            .transport()
            .ask(m)
            .map_err(|e| UdpError::Refused {
                server,
                message: format!("{}: {e}", m.name()),
            })?;
        Control::decode(&b)
            .map(|(_, c)| c)
            .map_err(|e| UdpError::Refused {
                server,
                message: format!("a malformed answer to {}: {e}", m.name()),
            })
    }

    /// Sends a control message to the server and returns its answer (operator queries such as
    /// [`Control::QuerySwitch`]).
    pub fn control(&mut self, message: &Control) -> Result<Control, ClientError> {
        let m = self.path.transport().ask(message)?;
        Ok(Control::decode(&m)?.1)
    }

    /// Sends this client's one-sided READs over `reader` (the verbs backend's RDMA READs)
    /// instead of naam-nic's agent. Backends call it; this module knows none of them.
    pub fn set_direct_reads(&mut self, reader: Box<dyn OneSided + Send>) {
        self.path.transport().direct_reads = Some(reader);
    }

    /// Whether one-sided READs go over a direct path (RDMA) rather than the agent.
    pub fn uses_rdma(&mut self) -> bool {
        self.path.transport().direct_reads.is_some()
    }

    /// Sends `inner` sealed in this client's session to `to` without waiting for an answer
    /// (tools and tests: bursts, replays, hostile messages).
    pub fn send_sealed(&mut self, to: SocketAddr, id: u64, inner: &[u8]) -> std::io::Result<Bytes> {
        let conn = self.path.transport();
        let sealed = conn.endpoint.seal(inner);
        conn.socket.send(to, id, &sealed)?;
        Ok(sealed)
    }

    /// Sends raw bytes to `to` from this client's socket (replays, forgeries).
    pub fn send_raw(&mut self, to: SocketAddr, id: u64, bytes: &[u8]) -> std::io::Result<()> {
        self.path.transport().socket.send(to, id, bytes)
    }

    /// The inner messages of the sealed datagrams that arrive within `timeout` and open in
    /// this client's session, a batch's one by one (anything else is dropped).
    pub fn recv_sealed(&mut self, timeout: Duration) -> std::io::Result<Vec<Bytes>> {
        let conn = self.path.transport();
        let got = conn.socket.recv(timeout)?;
        // A batch's messages count one by one.
        Ok(got
            .into_iter()
            .filter_map(|(_, m)| conn.endpoint.open(&m))
            .flat_map(|inner| {
                if naam_proto::kind::MessageKind::peek(&inner)
                    == Some(naam_proto::kind::MessageKind::Batch)
                {
                    naam_proto::batch::split(&inner).unwrap_or_default()
                } else {
                    vec![inner]
                }
            })
            .collect())
    }

    /// The server's address.
    pub fn server(&mut self) -> SocketAddr {
        self.path.transport().endpoint.server()
    }

    /// The one-sided agent, as last reported by the server.
    pub fn agent(&mut self) -> Option<SocketAddr> {
        self.path.transport().endpoint.agent()
    }

    fn refresh_weights(&mut self, now: Nanos) {
        if now < self.next_refresh {
            return;
        }
        self.next_refresh = now.saturating_add(self.refresh.as_nanos() as Nanos);
        let report = self.tracker.report();
        let conn = self.path.transport();
        let rtt_ns = conn.rtt.get();
        let mut first = true;
        // A client of hundreds of apps refreshes a few per interval, round robin, so its
        // control traffic stays bounded however many apps it uses.
        let n = self.refresh_order.len().min(QUERIES_PER_REFRESH);
        for k in 0..n {
            let app = self.refresh_order[(self.refresh_cursor + k) % self.refresh_order.len()];
            let q = Control::QueryWeights {
                app,
                client: first.then(|| report.clone()),
                rtt_ns,
            };
            first = false;
            // Fire and forget: the answer is picked up by whichever exchange sees it.
            conn.endpoint.notify(&q);
        }
        let _ = conn.flush();
        self.refresh_cursor = (self.refresh_cursor + n) % self.refresh_order.len().max(1);
    }

    fn take_inbox(&mut self) {
        let inbox = std::mem::take(&mut self.path.transport().inbox);
        let mut newest = self.manifest.version;
        for c in inbox {
            if let Control::Weights {
                app,
                handlers,
                agent,
                manifest,
            } = c
            {
                for h in handlers {
                    self.weights.insert((app, h.handler), Weights(h.weights));
                }
                self.path.transport().endpoint.set_agent(agent);
                newest = newest.max(manifest);
            }
        }
        if newest > self.manifest.version {
            if let Err(e) = self.refresh_manifest(newest) {
                // Asked again with the next weights that show the newer version.
                tracing::warn!("taking up manifest version {newest}: {e}");
            }
        }
    }

    /// Takes up manifest version `version` or newer (a deploy changed handlers): fetches
    /// this session's pages again, takes handler kinds from them, and stops running here
    /// the handlers of any app whose object or handlers changed (until
    /// [`UdpClient::install_handlers`] installs its new object).
    fn refresh_manifest(&mut self, version: u64) -> Result<(), UdpError> {
        let server = self.path.transport().endpoint.server();
        let refused = |message: String| UdpError::Refused { server, message };
        let (mut apps, mut pages, mut page) = (Vec::new(), 1, 0);
        // The version the pages belong to: a deploy between two pages starts the fetch over
        // (a few times at most; the next weights ask again).
        let (mut of, mut restarts) = (None, 0);
        while page < pages {
            let m = self
                .path
                .transport()
                .ask(&Control::QueryManifest { page })
                .map_err(|e| refused(format!("manifest page {page}: {e}")))?;
            match Control::decode(&m) {
                Ok((
                    _,
                    Control::ManifestPage {
                        page: p,
                        pages: n,
                        apps: a,
                        version: v,
                    },
                )) if p == page && n <= MAX_MANIFEST_PAGES => {
                    if of.is_some_and(|of| of != v) {
                        restarts += 1;
                        if restarts > 3 {
                            return Err(refused(
                                "the manifest changed while its pages were fetched".into(),
                            ));
                        }
                        (apps, pages, page, of) = (Vec::new(), 1, 0, None);
                        continue;
                    }
                    of = Some(v);
                    pages = n;
                    apps.extend(a);
                }
                Ok((_, Control::Error { message })) => return Err(refused(message)),
                other => {
                    return Err(refused(format!(
                        "unexpected answer to manifest page {page}: {other:?}"
                    )))
                }
            }
            page += 1;
        }
        for a in &apps {
            let same = self
                .manifest
                .app(a.id)
                .is_some_and(|old| old.object_hash == a.object_hash && old.handlers == a.handlers);
            if !same && self.registry.app(a.id).is_some() {
                self.registry = self
                    .registry
                    .with_handlers(a.id, Default::default())
                    .map_err(|e| UdpError::Handlers(a.id, e.to_string()))?;
            }
        }
        self.kinds = handler_kinds(&apps);
        self.manifest.apps = apps;
        self.manifest.version = of.unwrap_or(0).max(version);
        Ok(())
    }

    fn client_ok(&self, key: HandlerKey) -> bool {
        self.registry.handler(key.0, key.1).is_ok()
            && self.agent_down_until.is_none_or(|t| Instant::now() >= t)
    }

    fn run_locally(&mut self, req: &Request) -> Reply {
        let (reply, ran) = run_at_client(
            req,
            &self.registry,
            &mut self.path,
            &mut self.vm,
            self.limits,
            &self.clock,
        );
        if let Some(ran) = ran {
            self.tracker
                .completed((req.app, req.handler), ran.service_ns, ran.steps);
        }
        reply
    }

    /// Sends `req` to the server over `conn` and waits for its reply, written into `out`;
    /// `start` is the connection's reading when the call began ([`Conn::stamp`]). Returns
    /// when the reply was taken in.
    fn call_server(
        conn: &mut Conn,
        req: &mut Request,
        start: Nanos,
        out: &mut Reply,
    ) -> Result<Nanos, ClientError> {
        if let Some(end) = conn.call_in_process(start, req, out)? {
            return Ok(end);
        }
        let id = conn.endpoint.request(start, req);
        let m = conn.wait(id)?;
        *out = Reply::decode(m)?;
        Ok(conn.now)
    }
}

impl UdpClient {
    /// Steers `req` (of handler `key`): runs a read here when the weights say Client and the
    /// agent is up, and returns its reply; else marks in `req` where the server should run
    /// it, for the caller to send (the request stays where it was built, not moved).
    fn place(&mut self, req: &mut Request, key: HandlerKey, now: Nanos) -> Option<Reply> {
        let (app, _) = key;
        if self.apps_used.insert(app) {
            // Ask for the new app's weights first, at once.
            let at = self.refresh_cursor.min(self.refresh_order.len());
            self.refresh_order.insert(at, app);
            self.next_refresh = 0;
        }
        self.refresh_weights(now);
        self.take_inbox();
        let read = self.kinds.get(&key) == Some(&HandlerKind::Read);
        // Only a read this client may run itself asks the registry (pinned elsewhere, none does).
        let client_ok =
            read && matches!(self.pin, None | Some(Placement::Client)) && self.client_ok(key);
        let agent_up = self.path.transport().one_sided_up();
        let choice = match self.pin {
            Some(p) if read => Some(p),
            Some(_) => None,
            None if client_ok && agent_up => {
                let w = self
                    .weights
                    .get(&key)
                    .copied()
                    .unwrap_or(Weights::all(Placement::Host));
                self.selectors
                    .entry(key)
                    .or_default()
                    .pick(&w, |_| true)
                    .filter(|&p| p == Placement::Client)
            }
            None => None,
        };
        if choice == Some(Placement::Client) && client_ok {
            req.request_id = self.path.transport().endpoint.next_id();
            let r = self.run_locally(req);
            if r.status == Status::Unavailable && self.pin != Some(Placement::Client) {
                // The agent is gone: stop using it for a while and let the server answer.
                self.agent_down_until = Some(Instant::now() + Duration::from_millis(200));
            } else {
                return Some(r);
            }
        }
        match choice {
            Some(Placement::Host) => req.flags |= flags::PIN_HOST,
            Some(Placement::Nic) => req.flags |= flags::PIN_NIC,
            _ => {}
        }
        None
    }

    /// Counts `reply` in the metrics: `start` is this client's clock's time when the call
    /// began and `end` when its reply was taken in (the clock reads the time-stamp counter
    /// where it can: `Instant` costs a `clock_gettime` in a VM).
    fn record(&self, key: HandlerKey, start: Nanos, end: Nanos, reply: &Reply) {
        if let Some((_, m)) = &self.metrics {
            m.record(
                reply.placement,
                key,
                end.saturating_sub(start),
                reply.status,
            );
        }
    }

    /// Builds the request of a call in the one the last call was built in.
    fn call_request(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Box<Request>, ClientError> {
        let mut req = self.spare.take().unwrap_or_default();
        match req.refill_call((app, handler, 0), args, descs) {
            Ok(()) => Ok(req),
            Err(e) => {
                self.spare = Some(req);
                Err(e.into())
            }
        }
    }

    /// Submits `req` of handler `key` (see [`naam_proto::transport::Pipeline::submit`]).
    fn submit_request(&mut self, req: &mut Request, key: HandlerKey) -> Result<u64, ClientError> {
        let start = self.path.transport().stamp();
        match self.place(req, key, start) {
            Some(r) => {
                self.record(key, start, self.clock.now(), &r);
                let id = r.request_id;
                self.ready.push((id, Ok(r)));
                Ok(id)
            }
            None => {
                // Handed in when the server is in this process, as in a call.
                match self
                    .path
                    .transport()
                    .hand_in(start, req, &mut self.answer)?
                {
                    Some(HandedIn::Answered(end)) => {
                        let r = std::mem::replace(&mut self.answer, Reply::unanswered());
                        self.record(key, start, end, &r);
                        let id = r.request_id;
                        self.ready.push((id, Ok(r)));
                        return Ok(id);
                    }
                    Some(HandedIn::Later(id)) => {
                        self.pending.insert(id, (key, start));
                        return Ok(id);
                    }
                    None => {}
                }
                let conn = self.path.transport();
                let id = conn
                    .endpoint
                    .request(start, req)
                    .map_err(|e| conn.client_error(e))?;
                // It goes out at the next poll, coalesced with whatever else is submitted
                // before it (a window refilled after a batch of answers travels together).
                self.pending.insert(id, (key, start));
                Ok(id)
            }
        }
    }

    /// Fails every submitted call with `Shutdown`, into `ready`: the socket is gone.
    fn fail_pending(&mut self) {
        for (id, _) in self.pending.drain() {
            self.ready.push((id, Err(ClientError::Shutdown)));
        }
    }

    /// The answers the endpoint has for submitted messages, into `ready`.
    fn collect(&mut self) {
        let conn = self.path.transport();
        let events = conn.take_answers();
        for event in events {
            let (id, result) = match event {
                ClientEvent::Answered { id, message } => {
                    (id, Reply::decode(message).map_err(ClientError::Wire))
                }
                ClientEvent::Failed { id, error } => {
                    (id, Err(self.path.transport().client_error(error)))
                }
                _ => continue,
            };
            if let Some((key, start)) = self.pending.remove(&id) {
                if let Ok(r) = &result {
                    // Taken in by the driver's latest round.
                    let end = self.path.transport().now;
                    self.record(key, start, end, r);
                }
                self.ready.push((id, result));
            }
        }
    }
}

impl UdpClient {
    /// Makes one call and leaves its reply in [`UdpClient::answer`].
    fn call_into(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<(), ClientError> {
        let mut req = self.call_request(app, handler, args, descs)?;
        let key = (app, handler);
        // The call's start is the connection's latest reading, which its sends use.
        let start = self.path.transport().stamp();
        let answered = match self.place(&mut req, key, start) {
            Some(r) => {
                self.answer = r;
                Ok(self.clock.now())
            }
            None => Self::call_server(self.path.transport(), &mut req, start, &mut self.answer),
        };
        self.spare = Some(req);
        let end = answered?;
        self.record(key, start, end, &self.answer);
        Ok(())
    }
}

impl Transport for UdpClient {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.call_into(app, handler, args, descs)?;
        Ok(std::mem::replace(&mut self.answer, Reply::unanswered()))
    }

    /// Lends `read` the reply where the call left it, then lets its payload go (it may share
    /// the server's reply buffer, which the next reply reuses only once nothing holds it).
    fn call_with<R>(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
        read: impl FnOnce(ReplyView<'_>) -> R,
    ) -> Result<R, ClientError> {
        self.call_into(app, handler, args, descs)?;
        let r = read(self.answer.view());
        self.answer.payload = Bytes::new();
        Ok(r)
    }

    fn backoff(&mut self, attempt: u32) {
        crate::backoff(attempt)
    }
}

impl naam_proto::transport::Pipeline for UdpClient {
    fn submit(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<u64, ClientError> {
        if self.pending.len() >= self.window() {
            return Err(ClientError::Busy(Placement::Host));
        }
        let mut req = self.call_request(app, handler, args, descs)?;
        let submitted = self.submit_request(&mut req, (app, handler));
        self.spare = Some(req);
        submitted
    }

    fn poll(&mut self, block: bool) -> Vec<(u64, Result<Reply, ClientError>)> {
        if self.path.transport().flush().is_err() {
            self.fail_pending();
        }
        if !block && !self.pending.is_empty() && self.path.transport().turn(Duration::ZERO).is_err()
        {
            // Without waiting, what the socket holds already: a caller polling several
            // clients in turn (a gateway's sessions with several servers) must see answers
            // without blocking on any one of them.
            self.fail_pending();
        }
        self.collect();
        if block && self.ready.is_empty() && !self.pending.is_empty() {
            // On the connection's clock, which each receive reads anyway.
            let deadline = self
                .path
                .transport()
                .stamp()
                .saturating_add(MAX_WAIT.as_nanos() as Nanos);
            while self.ready.is_empty() && !self.pending.is_empty() {
                let conn = self.path.transport();
                let left = deadline.saturating_sub(conn.now);
                if left == 0 {
                    break;
                }
                if conn
                    .flush()
                    .and_then(|_| conn.turn(Duration::from_nanos(left)))
                    .is_err()
                {
                    self.fail_pending();
                    break;
                }
                self.collect();
            }
        }
        std::mem::take(&mut self.ready)
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.ready.len()
    }

    fn window(&self) -> usize {
        self.path_window()
    }
}

impl Drop for UdpClient {
    fn drop(&mut self) {
        if let Some((m, _)) = &self.metrics {
            let s = self.path.transport_ref().endpoint.stats();
            m.add_transport(crate::TransportCounts {
                sent: s.sent,
                resends: s.resends,
                duplicates: s.duplicates,
                early_resends: s.early_resends,
            });
        }
    }
}

impl UdpClient {
    /// What this client's endpoint sent, resent and was answered twice so far.
    pub fn transport_counts(&self) -> crate::TransportCounts {
        let s = self.path.transport_ref().endpoint.stats();
        crate::TransportCounts {
            sent: s.sent,
            resends: s.resends,
            duplicates: s.duplicates,
            early_resends: s.early_resends,
        }
    }

    /// Requests the server lets this session have outstanding (its welcome's grant).
    fn path_window(&self) -> usize {
        self.path.transport_ref().endpoint.window() as usize
    }
}
