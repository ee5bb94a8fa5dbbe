//! The client side of the UDP fabric: a [`Transport`] that sends active messages to
//! `naam-server` with request ids, timeouts and retransmission, and runs read handlers itself
//! (Client placement) with one-sided READs served by the NIC's agent. It follows the server's
//! steering weights, which it refreshes every few milliseconds while reporting what it measured.
//!
//! Everything after the handshake travels sealed in the client's session
//! ([`crate::session`]); a server that restarted says so with an authenticated notice and the
//! client sets up a new session by itself. A server silent for longer than
//! [`UdpConfig::liveness`] makes every call fail with [`ClientError::ServerGone`].

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use naam_ebpf::abi::{Descriptor, ACCESS_READ};

use super::control::{object_hash, Control, Manifest, KIND_CONTROL};
use super::socket::{Socket, DEFAULT_DATAGRAM};
use crate::clock::SystemClock;
use crate::cluster::{run_at_client, ClientError};
use crate::engine::Vm;
use crate::executor::{ClientPath, FetchError, Limits, OneSided};
use crate::metrics::Metrics;
use crate::onesided::{self, KIND_COMPLETION};
use crate::placement::Placement;
use crate::registry::{HandlerKind, HandlerSpec, Registry};
use crate::session::{
    self, peek_sealed, ClientHandshake, Credential, Sealer, Sender, SessionKey, KIND_SEALED,
};
use crate::steering::Selector;
use crate::steering::{Ewma, HandlerKey, LoadTracker, Weights};
use crate::transport::Transport;
use crate::verifier::VerifierConfig;
use crate::wire::{flags, peek_kind, Reply, Request, Status, KIND_REPLY};
use naam_proto::frame::{Retransmit, Timeout};

/// Manifest pages a client fetches at most (tens of thousands of apps).
const MAX_MANIFEST_PAGES: u32 = 4096;

/// Weight queries a client sends per refresh interval at most.
const QUERIES_PER_REFRESH: usize = 16;

/// Client settings.
#[derive(Clone, Debug)]
pub struct UdpConfig {
    /// `naam-server`'s address.
    pub server: SocketAddr,
    /// Datagram size (1472 fits a 1500-byte MTU; up to 8972 with jumbo frames).
    pub datagram: usize,
    /// First retransmission timeout; it doubles on every retry.
    pub rto: Duration,
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
}

impl UdpConfig {
    /// Defaults for `server`, authenticating as `tenant` with `credential`.
    pub fn new(server: SocketAddr, tenant: &str, credential: Credential) -> UdpConfig {
        UdpConfig {
            server,
            datagram: DEFAULT_DATAGRAM,
            rto: Duration::from_millis(20),
            attempts: 8,
            refresh: Duration::from_millis(5),
            connect_timeout: Duration::from_secs(2),
            pin: None,
            tenant: tenant.to_string(),
            credential,
            liveness: Duration::from_secs(10),
            authentication: session::Authentication::On,
            inject_loss: None,
        }
    }
}

/// Why a UDP client could not start.
#[derive(Debug, thiserror::Error)]
pub enum UdpError {
    /// A socket operation failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The server did not answer the hello.
    #[error("no answer from naam-server at {server} within {waited:?} (is it running, and is the address reachable from this namespace?)")]
    NoServer {
        /// Address tried.
        server: SocketAddr,
        /// How long.
        waited: Duration,
    },
    /// The server refused.
    #[error("naam-server at {server} refused: {message}")]
    Refused {
        /// Address.
        server: SocketAddr,
        /// Its message.
        message: String,
    },
    /// The server serves no such app.
    #[error("naam-server serves no app {0}")]
    UnknownApp(u32),
    /// The client's handler object is not the server's.
    #[error("app {app}: the handler object here (hash {local:#x}) differs from the server's ({server:#x}); rebuild both from the same source")]
    ObjectMismatch {
        /// App.
        app: u32,
        /// Local hash.
        local: u64,
        /// Server's hash.
        server: u64,
    },
    /// The handlers could not be loaded or verified.
    #[error("loading app {0}'s handlers: {1}")]
    Handlers(u32, String),
}

/// Why an exchange got no answer.
#[derive(Debug)]
enum Exchange {
    Timeout(Duration),
    Io(std::io::Error),
    /// The server does not know the session any more (authenticated notice): handshake again.
    Stale,
}

/// A session set up with the server.
struct ClientSession {
    key: Arc<SessionKey>,
    sealer: Sealer,
}

/// The socket, ids, session and retransmission state one client uses for everything.
pub struct Conn {
    socket: Socket,
    server: SocketAddr,
    agent: Option<SocketAddr>,
    client_id: u32,
    seq: u64,
    rto: Duration,
    attempts: u32,
    epoch: Instant,
    inbox: Vec<Control>,
    rtt: Ewma,
    tenant: String,
    credential: Credential,
    session: Option<ClientSession>,
    /// When an authenticated message last arrived (from the server or the NIC).
    last_heard: Instant,
    liveness: Duration,
    /// How long a handshake may take.
    connect_timeout: Duration,
    authentication: session::Authentication,
    /// One-sided READs over a direct path (RDMA verbs: `use_rdma`) instead of the agent.
    direct_reads: Option<Box<dyn OneSided + Send>>,
}

/// What [`Conn::exchange_with`] asks of each arriving message: `Some` ends the exchange.
type Accept<'a> = dyn FnMut(&mut Conn, Incoming) -> Option<Result<Bytes, Exchange>> + 'a;

/// An arriving datagram, classified once its seal (if any) is checked.
enum Incoming {
    /// The inner message of a datagram sealed in this client's session by the server or NIC.
    Sealed(Bytes),
    /// A sealed datagram while there is no session yet (a welcome).
    Unopened(Bytes),
    /// An authenticated notice that the server does not know the session.
    Stale,
    /// An unsealed control message (handshake answers; trusted for nothing else).
    Unsealed(u64, Control),
    /// Anything else: forged, replayed from elsewhere, or late.
    Drop,
}

/// The id a reply, completion or control message of kind `kind` answers.
fn answered_id(kind: u8, m: &[u8]) -> Option<u64> {
    naam_proto::peek::message_id(m)
        .filter(|(k, _)| k.byte() == kind)
        .map(|(_, id)| id)
}

impl Conn {
    /// Whether one-sided READs have somewhere to go: RDMA, or the NIC's agent.
    fn one_sided_up(&self) -> bool {
        self.direct_reads.is_some() || self.agent.is_some()
    }

    fn next_id(&mut self) -> u64 {
        self.seq += 1;
        crate::wire::request_id(self.client_id, self.seq)
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Sends control message `message` to the server in the session and waits for the answer.
    fn ask(&mut self, message: &Control) -> Result<Bytes, Exchange> {
        let id = self.next_id();
        let server = self.server;
        self.exchange(server, id, &message.to_bytes(id), None, KIND_CONTROL)
    }

    /// Seals `inner` in the session (unsealed before there is one: handshake messages).
    fn seal(&self, inner: &[u8]) -> Bytes {
        match &self.session {
            Some(s) => s.sealer.seal(inner),
            None => Bytes::copy_from_slice(inner),
        }
    }

    /// What an arriving datagram is, once its seal is checked.
    fn open(&mut self, m: &Bytes) -> Incoming {
        match peek_kind(m) {
            Some(KIND_SEALED) => {
                let Some(s) = &self.session else {
                    return Incoming::Unopened(m.clone());
                };
                match s.key.open(m) {
                    Ok((h, inner)) if matches!(h.sender, Sender::Server | Sender::Nic) => {
                        self.last_heard = Instant::now();
                        Incoming::Sealed(inner)
                    }
                    _ => Incoming::Drop,
                }
            }
            Some(KIND_CONTROL) => match Control::decode(m) {
                Ok((_, Control::Stale { session, token, .. })) => match &self.session {
                    Some(s)
                        if s.key.session() == session
                            && self.credential.reset_token(session) == token =>
                    {
                        self.last_heard = Instant::now();
                        Incoming::Stale
                    }
                    _ => Incoming::Drop,
                },
                Ok((id, c)) => Incoming::Unsealed(id, c),
                Err(_) => Incoming::Drop,
            },
            _ => Incoming::Drop,
        }
    }

    /// Sends `msg` to `to` in the session and waits for the `want`-kind message answering
    /// `id`, resending `resend` (default `msg`) on each timeout, each time as a new packet.
    /// Control answers that arrive meanwhile are kept.
    fn exchange(
        &mut self,
        to: SocketAddr,
        id: u64,
        msg: &[u8],
        resend: Option<&[u8]>,
        want: u8,
    ) -> Result<Bytes, Exchange> {
        self.exchange_with(
            to,
            id,
            &mut |c, again| c.seal(if again { resend.unwrap_or(msg) } else { msg }),
            &mut |c, incoming| match incoming {
                Incoming::Sealed(inner) => {
                    let kind = peek_kind(&inner)?;
                    if kind == want && answered_id(kind, &inner) == Some(id) {
                        return Some(Ok(inner));
                    }
                    if kind == KIND_CONTROL {
                        if let Ok((_, c2)) = Control::decode(&inner) {
                            c.inbox.push(c2);
                        }
                    }
                    // Anything else is a late answer to an earlier, given-up exchange.
                    None
                }
                Incoming::Stale => Some(Err(Exchange::Stale)),
                _ => None,
            },
        )
    }

    /// The retransmission loop: sends `make(self, resending)` to `to` until `accept` takes an
    /// arriving message (or gives up with an error), or the attempts run out.
    fn exchange_with(
        &mut self,
        to: SocketAddr,
        id: u64,
        make: &mut dyn FnMut(&mut Conn, bool) -> Bytes,
        accept: &mut Accept<'_>,
    ) -> Result<Bytes, Exchange> {
        let mut rt = Retransmit::new(self.rto.as_nanos() as u64, self.attempts);
        let started = Instant::now();
        let first = make(self, false);
        self.socket.send(to, id, &first).map_err(Exchange::Io)?;
        rt.sent(id, self.now());
        loop {
            let wait = rt
                .next_deadline()
                .map_or(0, |d| d.saturating_sub(self.now()))
                .min(1_000_000);
            for (_, m) in self
                .socket
                .recv(Duration::from_nanos(wait))
                .map_err(Exchange::Io)?
            {
                let incoming = self.open(&m);
                if let Some(r) = accept(self, incoming) {
                    return r;
                }
            }
            for (_, t) in rt.poll(self.now()) {
                match t {
                    Timeout::Resend(_) => {
                        let again = make(self, true);
                        let _ = self.socket.send(to, id, &again);
                    }
                    Timeout::GiveUp => return Err(Exchange::Timeout(started.elapsed())),
                }
            }
        }
    }

    /// Sets up a session: hello, challenge, auth, welcome. Returns the welcome.
    fn handshake(&mut self) -> Result<Control, UdpError> {
        let server = self.server;
        let refused = |message: String| UdpError::Refused { server, message };
        let hs = ClientHandshake::new(&self.tenant, self.credential.clone())
            .map_err(|e| refused(e.to_string()))?;
        self.session = None;
        // The handshake retransmits on its own schedule: three tries within the connect
        // timeout.
        let data = (self.rto, self.attempts);
        (self.rto, self.attempts) = ((self.connect_timeout / 4).max(Duration::from_millis(1)), 3);
        let r = self.handshake_steps(hs);
        (self.rto, self.attempts) = data;
        r
    }

    fn handshake_steps(&mut self, hs: ClientHandshake) -> Result<Control, UdpError> {
        let server = self.server;
        let unanswered = |e: Exchange| match e {
            Exchange::Io(e) => UdpError::Io(e),
            Exchange::Timeout(waited) => UdpError::NoServer { server, waited },
            Exchange::Stale => UdpError::Refused {
                server,
                message: "the session was forgotten during its handshake".into(),
            },
        };
        let refused = |message: String| UdpError::Refused { server, message };
        let id = self.next_id();
        let mut hello = Control::Hello {
            tenant: self.tenant.clone(),
            nonce: hs.nonce(),
        }
        .to_bytes(id)
        .to_vec();
        // Padded, so the challenge is far inside the server's amplification limit.
        if hello.len() < session::HELLO_PADDING {
            hello.resize(session::HELLO_PADDING, b' ');
        }
        let hello = Bytes::from(hello);
        let m = self.exchange_with(server, id, &mut |_, _| hello.clone(), &mut |_, incoming| {
            match incoming {
                Incoming::Unsealed(i, c @ (Control::Challenge { .. } | Control::Error { .. }))
                    if i == id =>
                {
                    Some(Ok(c.to_bytes(i)))
                }
                _ => None,
            }
        });
        let (server_nonce, issued, cookie) = match Control::decode(&m.map_err(unanswered)?) {
            Ok((
                _,
                Control::Challenge {
                    nonce,
                    issued,
                    cookie,
                },
            )) => (nonce, issued, cookie),
            Ok((_, Control::Error { message })) => return Err(refused(message)),
            other => return Err(refused(format!("unexpected answer to hello: {other:?}"))),
        };
        let id = self.next_id();
        let auth = Control::Auth {
            tenant: self.tenant.clone(),
            client_nonce: hs.nonce(),
            server_nonce,
            issued,
            cookie,
            proof: hs.proof(server_nonce, &cookie),
        }
        .to_bytes(id);
        // The welcome is sealed in the new session: its id is in the envelope, and the key
        // follows from it, the nonces and the credential.
        let mut key: Option<SessionKey> = None;
        let m = self.exchange_with(server, id, &mut |_, _| auth.clone(), &mut |c, incoming| {
            match incoming {
                Incoming::Unopened(m) => {
                    let h = peek_sealed(&m).ok()?;
                    if h.sender != Sender::Server {
                        return None;
                    }
                    let k = hs
                        .session_key(h.session, server_nonce)
                        .with_authentication(c.authentication);
                    let (_, inner) = k.open(&m).ok()?;
                    if answered_id(KIND_CONTROL, &inner) != Some(id) {
                        return None;
                    }
                    key = Some(k);
                    Some(Ok(inner))
                }
                Incoming::Unsealed(i, c @ Control::Error { .. }) if i == id => {
                    Some(Ok(c.to_bytes(i)))
                }
                _ => None,
            }
        });
        let welcome = match Control::decode(&m.map_err(unanswered)?) {
            Ok((_, w @ Control::Welcome { .. })) => w,
            Ok((_, Control::Error { message })) => return Err(refused(message)),
            other => return Err(refused(format!("unexpected answer to auth: {other:?}"))),
        };
        let key = Arc::new(key.ok_or_else(|| refused("the welcome was not sealed".into()))?);
        self.session = Some(ClientSession {
            sealer: Sealer::new(key.clone(), Sender::Client),
            key,
        });
        self.last_heard = Instant::now();
        if let Control::Welcome {
            client_id, agent, ..
        } = &welcome
        {
            self.client_id = *client_id;
            self.agent = *agent;
        }
        Ok(welcome)
    }

    /// Runs `exchange` in the session: fails fast once the server is past the liveness bound,
    /// and after an authenticated "no such session" sets up a new session and tries once more.
    fn in_session<T>(
        &mut self,
        mut exchange: impl FnMut(&mut Conn) -> Result<T, Exchange>,
    ) -> Result<T, ClientError> {
        self.check_alive()?;
        let mut renewed = false;
        loop {
            match exchange(self) {
                Ok(x) => return Ok(x),
                Err(Exchange::Stale) if !renewed => {
                    renewed = true;
                    self.handshake()
                        .map_err(|e| ClientError::Session(e.to_string()))?;
                }
                Err(Exchange::Stale) => {
                    return Err(ClientError::Session(
                        "the server forgot the new session at once".into(),
                    ))
                }
                Err(Exchange::Timeout(d)) => {
                    self.check_alive()?;
                    return Err(ClientError::Timeout(d));
                }
                Err(Exchange::Io(_)) => return Err(ClientError::Shutdown),
            }
        }
    }

    /// Fails fast once the server has been silent for longer than the liveness bound.
    fn check_alive(&self) -> Result<(), ClientError> {
        let silent = self.last_heard.elapsed();
        if silent > self.liveness {
            return Err(ClientError::ServerGone {
                silent,
                bound: self.liveness,
            });
        }
        Ok(())
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
                crate::region::ResolveError::AccessDenied {
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
        let agent = self.agent.ok_or_else(|| {
            FetchError::Unavailable("no one-sided agent: the server reports no naam-nic".into())
        })?;
        let id = self.next_id();
        let op = onesided::Operation {
            app,
            id,
            op: onesided::Op::Read(descs.to_vec()),
        };
        let bytes = op.to_bytes().map_err(|e| FetchError::Refused {
            status: Status::Refused,
            message: e.to_string(),
        })?;
        let start = Instant::now();
        let m = self
            .in_session(|c| c.exchange(agent, id, &bytes, None, KIND_COMPLETION))
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

/// A client of `naam-server` over UDP. One call at a time; make one per thread.
pub struct UdpClient {
    path: ClientPath<Conn>,
    manifest: Manifest,
    registry: Registry,
    kinds: HashMap<HandlerKey, HandlerKind>,
    vm: Vm,
    clock: SystemClock,
    limits: Limits,
    weights: HashMap<HandlerKey, Weights>,
    selectors: HashMap<HandlerKey, Selector>,
    refresh: Duration,
    last_refresh: Instant,
    apps_used: HashSet<u32>,
    /// `apps_used` in first-use order, and where the next refresh starts in it.
    refresh_order: Vec<u32>,
    refresh_cursor: usize,
    agent_down_until: Option<Instant>,
    tracker: LoadTracker,
    metrics: Option<Arc<Metrics>>,
    pin: Option<Placement>,
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
            .check_scope(config.server)
            .map_err(|message| UdpError::Refused {
                server: config.server,
                message,
            })?;
        let mut socket = Socket::bind(bind, config.datagram)?;
        socket.inject_loss(config.inject_loss);
        let mut conn = Conn {
            socket,
            server: config.server,
            agent: None,
            client_id: 0,
            seq: 0,
            rto: config.rto,
            attempts: config.attempts.max(1),
            epoch: Instant::now(),
            inbox: Vec::new(),
            rtt: Ewma::default(),
            tenant: config.tenant.clone(),
            credential: config.credential.clone(),
            session: None,
            last_heard: Instant::now(),
            liveness: config.liveness,
            connect_timeout: config.connect_timeout,
            authentication: config.authentication,
            direct_reads: None,
        };
        let server = config.server;
        let unanswered = |e: Exchange| match e {
            Exchange::Io(e) => UdpError::Io(e),
            Exchange::Timeout(waited) => UdpError::NoServer { server, waited },
            Exchange::Stale => UdpError::Refused {
                server,
                message: "the new session was forgotten at once".into(),
            },
        };
        let refused = |message: String| UdpError::Refused {
            server: config.server,
            message,
        };
        let (mut manifest, pages) = match conn.handshake()? {
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
                .map_err(unanswered)?;
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
        let mut kinds = HashMap::new();
        for a in &manifest.apps {
            for h in &a.handlers {
                let k = if h.write {
                    HandlerKind::Write
                } else {
                    HandlerKind::Read
                };
                kinds.insert((a.id, h.id), k);
            }
        }
        Ok(UdpClient {
            path: ClientPath::new(conn),
            manifest,
            registry: Registry::new(),
            kinds,
            vm: Vm::new(),
            clock: SystemClock::new(),
            limits: Limits::default(),
            weights: HashMap::new(),
            selectors: HashMap::new(),
            refresh: config.refresh,
            last_refresh: Instant::now() - config.refresh,
            apps_used: HashSet::new(),
            refresh_order: Vec::new(),
            refresh_cursor: 0,
            agent_down_until: None,
            tracker: LoadTracker::new(1, 0),
            metrics: None,
            pin: config.pin,
        })
    }

    /// What the server serves.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Records every call's latency and placement into `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
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
        let loaded =
            crate::loader::load(object).map_err(|e| UdpError::Handlers(app, e.to_string()))?;
        let specs: Vec<HandlerSpec> = a
            .handlers
            .iter()
            .filter(|h| !h.write)
            .map(|h| HandlerSpec::read(&h.name).engine(h.engine).budget(h.budget))
            .collect();
        let fail = |e: crate::registry::RegistryError| UdpError::Handlers(app, e.to_string());
        self.registry
            .add_app(app, &a.name, Placement::Host)
            .map_err(fail)?;
        self.registry
            .add_handlers(app, &loaded, &specs, &VerifierConfig::default())
            .map_err(fail)?;
        Ok(())
    }

    /// Sends a control message to the server and returns its answer (operator queries such as
    /// [`Control::QuerySwitch`]).
    pub fn control(&mut self, message: &Control) -> Result<Control, ClientError> {
        let m = self.path.transport().in_session(|c| c.ask(message))?;
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
        let sealed = conn.seal(inner);
        conn.socket.send(to, id, &sealed)?;
        Ok(sealed)
    }

    /// Sends raw bytes to `to` from this client's socket (replays, forgeries).
    pub fn send_raw(&mut self, to: SocketAddr, id: u64, bytes: &[u8]) -> std::io::Result<()> {
        self.path.transport().socket.send(to, id, bytes)
    }

    /// The inner messages of the sealed datagrams that arrive within `timeout` and open in
    /// this client's session (anything else is dropped).
    pub fn recv_sealed(&mut self, timeout: Duration) -> std::io::Result<Vec<Bytes>> {
        let conn = self.path.transport();
        let got = conn.socket.recv(timeout)?;
        Ok(got
            .into_iter()
            .filter_map(|(_, m)| match conn.open(&m) {
                Incoming::Sealed(inner) => Some(inner),
                _ => None,
            })
            .collect())
    }

    /// The server's address.
    pub fn server(&mut self) -> SocketAddr {
        self.path.transport().server
    }

    /// The one-sided agent, as last reported by the server.
    pub fn agent(&mut self) -> Option<SocketAddr> {
        self.path.transport().agent
    }

    fn refresh_weights(&mut self) {
        if self.last_refresh.elapsed() < self.refresh {
            return;
        }
        self.last_refresh = Instant::now();
        let report = self.tracker.report();
        let conn = self.path.transport();
        let rtt_ns = conn.rtt.get();
        let mut first = true;
        // A client of hundreds of apps refreshes a few per interval, round robin, so its
        // control traffic stays bounded however many apps it uses.
        let n = self.refresh_order.len().min(QUERIES_PER_REFRESH);
        for k in 0..n {
            let app = self.refresh_order[(self.refresh_cursor + k) % self.refresh_order.len()];
            let id = conn.next_id();
            let q = Control::QueryWeights {
                app,
                client: first.then(|| report.clone()),
                rtt_ns,
            };
            first = false;
            // Fire and forget: the answer is picked up by whichever exchange sees it.
            let server = conn.server;
            let sealed = conn.seal(&q.to_bytes(id));
            let _ = conn.socket.send(server, id, &sealed);
        }
        self.refresh_cursor = (self.refresh_cursor + n) % self.refresh_order.len().max(1);
    }

    fn take_inbox(&mut self) {
        let inbox = std::mem::take(&mut self.path.transport().inbox);
        for c in inbox {
            if let Control::Weights {
                app,
                handlers,
                agent,
            } = c
            {
                for h in handlers {
                    self.weights.insert((app, h.handler), Weights(h.weights));
                }
                self.path.transport().agent = agent;
            }
        }
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
        if let Some((service, steps)) = ran {
            self.tracker
                .completed((req.app, req.handler), service, steps);
        }
        reply
    }

    fn call_server(&mut self, mut req: Request) -> Result<Reply, ClientError> {
        let conn = self.path.transport();
        req.request_id = conn.next_id();
        let first = req.to_bytes()?;
        // Retransmissions say so (the owner answers a retried write from its dedup table).
        req.flags |= flags::RETRY;
        let retry = req.to_bytes()?;
        let server = conn.server;
        let m = conn.in_session(|c| {
            c.exchange(server, req.request_id, &first, Some(&retry[..]), KIND_REPLY)
        })?;
        Ok(Reply::decode(m)?)
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
        let mut req = Request::for_call(app, handler, 0, args, descs)?;
        let key = (app, handler);
        if self.apps_used.insert(app) {
            // Ask for the new app's weights first, at once.
            let at = self.refresh_cursor.min(self.refresh_order.len());
            self.refresh_order.insert(at, app);
            self.last_refresh = Instant::now() - self.refresh;
        }
        self.refresh_weights();
        self.take_inbox();
        let start = Instant::now();
        let read = self.kinds.get(&key) == Some(&HandlerKind::Read);
        let client_ok = read && self.client_ok(key);
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
        let mut reply = None;
        if choice == Some(Placement::Client) && client_ok {
            req.request_id = self.path.transport().next_id();
            let r = self.run_locally(&req);
            if r.status == Status::Unavailable && self.pin != Some(Placement::Client) {
                // The agent is gone: stop using it for a while and let the server answer.
                self.agent_down_until = Some(Instant::now() + Duration::from_millis(200));
            } else {
                reply = Some(r);
            }
        }
        let reply = match reply {
            Some(r) => r,
            None => {
                match choice {
                    Some(Placement::Host) => req.flags |= flags::PIN_HOST,
                    Some(Placement::Nic) => req.flags |= flags::PIN_NIC,
                    _ => {}
                }
                self.call_server(req)?
            }
        };
        if let Some(m) = &self.metrics {
            m.record(
                reply.placement,
                key,
                start.elapsed().as_nanos() as u64,
                reply.status,
            );
        }
        Ok(reply)
    }
}
