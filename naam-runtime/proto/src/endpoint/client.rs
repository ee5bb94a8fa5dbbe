//! The client's endpoint: one session with `naam-server` and every exchange in it.
//!
//! An *exchange* is a message that expects one answer of a known kind with the same id: a
//! request (answered by a reply), a one-sided operation (by a completion, from the NIC's
//! agent) or a control query (by a control answer). Each is resent on its own exponential
//! timer, as a new packet of the session, until it is answered or out of attempts; a request's
//! resends carry [`flags::RETRY`] so that the owner answers a retried write from its dedup
//! table. Answers that match nothing outstanding are late duplicates and are dropped; control
//! messages that answer no exchange (weights after a fire-and-forget query) surface as
//! [`ClientEvent::Control`].
//!
//! Sessions: the endpoint says hello, answers the challenge and opens the welcome, which is
//! sealed in the new session. A server that restarted answers a sealed message with an
//! authenticated [`Control::Stale`]; the endpoint then sets up a new session by itself and
//! resends what was outstanding, once. A server silent for longer than
//! [`ClientConfig::liveness`] fails every new exchange with [`ExchangeError::ServerGone`].

use crate::arena::ByteArena;
use crate::intmap::{IntMap, IntSet};
use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use naam_ebpf::abi::Descriptor;

use super::server::{coalesce, Inner, Outgoing};
use super::Transmit;
use crate::control::Control;
use crate::entropy::Entropy;
use crate::frame::{Retransmit, RttEstimator, Timeout};
use crate::kind::MessageKind;
use crate::onesided::{Op, Operation};
use crate::session::{
    peek_sealed, Authentication, ClientHandshake, Credential, Sealer, Sender, SessionKey,
    HELLO_PADDING,
};
use crate::wire::{flags, request_id, Request, WireError};
use crate::Nanos;

const MS: Nanos = 1_000_000;

/// Sends of each handshake message before the handshake gives up.
const HANDSHAKE_SENDS: u32 = 6;

/// Sends to the same peer after an unanswered exchange whose answers make it count as lost.
const LOSS_THRESHOLD: u64 = 3;

/// Exchanges answered after a resend that are remembered, so that a late duplicate answer
/// shows the resend was spurious.
const RESENDS_REMEMBERED: usize = 64;

/// Handlers learnt to be answered out of order that are remembered (beyond it, the set starts
/// over: it is a cache, not a record).
const REORDERING_HANDLERS: usize = 4096;

/// A client endpoint's settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClientConfig {
    /// `naam-server`'s address.
    pub server: SocketAddr,
    /// The tenant the client authenticates as: an app's name, the operator, or the NIC.
    pub tenant: String,
    /// The tenant's secret: it makes the handshake proof and the session key, and is never sent.
    pub credential: Credential,
    /// Retransmission timeout before the first round trip is measured; after, each path's
    /// timeout is its smoothed round trip plus four variations (RFC 6298), within `min_rto`
    /// and `max_rto`. Two resends wait it again, then it doubles on every resend, back to
    /// it whenever the path answers another exchange ([`crate::frame::FLAT_RESENDS`]).
    pub rto: Nanos,
    /// The least retransmission timeout (the estimate never goes below it).
    pub min_rto: Nanos,
    /// The largest retransmission timeout, and the longest wait between two resends.
    pub max_rto: Nanos,
    /// Sends per exchange before giving up (the first one included).
    pub attempts: u32,
    /// How long each step of a handshake (hello, then auth) waits for its answer: six sends
    /// within it, the interval doubling from a 63rd of it (so that one step survives heavy
    /// loss: at 20% each way, all six are lost 0.2% of the time, three 4.7%).
    pub connect_timeout: Nanos,
    /// How long the server may stay silent before new exchanges fail with
    /// [`ExchangeError::ServerGone`].
    pub liveness: Nanos,
    /// Datagram authentication (must match the server's).
    pub authentication: Authentication,
    /// Handshake nonces are drawn from it.
    pub entropy: Entropy,
}

impl ClientConfig {
    /// Defaults for `server`, authenticating as `tenant` with `credential`: 20 ms timeout
    /// until a round trip is measured, then the estimate within 50 µs to 1 s, 8 attempts (and
    /// never giving up sooner than 20 ms doubling 8 times would), 2 s to connect, 10 s of
    /// silence tolerated.
    pub fn new(
        server: SocketAddr,
        tenant: &str,
        credential: Credential,
        entropy: Entropy,
    ) -> ClientConfig {
        ClientConfig {
            server,
            tenant: tenant.to_string(),
            credential,
            rto: 20 * MS,
            min_rto: 50_000,
            max_rto: 1_000 * MS,
            attempts: 8,
            connect_timeout: 2_000 * MS,
            liveness: 10_000 * MS,
            authentication: Authentication::On,
            entropy,
        }
    }
}

/// Why a handshake did not give a session.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// No answer within the connect timeout.
    #[error("no answer from naam-server at {server} within {waited_ns} ns")]
    NoServer {
        /// The address tried.
        server: SocketAddr,
        /// How long the handshake waited.
        waited_ns: Nanos,
    },
    /// The server refused, or the handshake could not start.
    #[error("naam-server at {server} refused: {message}")]
    Refused {
        /// The server's address ([`ClientConfig::server`]).
        server: SocketAddr,
        /// The server's refusal text, or the local reason: authentication turned off for a
        /// server not on loopback, a handshake that could not be set up, or an unexpected answer.
        message: String,
    },
}

/// Why an exchange ended without its answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// Every attempt went unanswered.
    #[error("no answer after {waited_ns} ns")]
    TimedOut {
        /// From the first send to giving up.
        waited_ns: Nanos,
    },
    /// The server has been silent for longer than the liveness bound.
    #[error("the server has been silent for {silent_ns} ns (bound {bound_ns} ns)")]
    ServerGone {
        /// Nanoseconds since the server or its NIC last sent something that authenticated (or
        /// since the session was set up).
        silent_ns: Nanos,
        /// [`ClientConfig::liveness`].
        bound_ns: Nanos,
    },
    /// The session was lost and could not be set up again.
    #[error("session: {0}")]
    Session(String),
    /// One-sided operations have nowhere to go: the server reports no NIC agent.
    #[error("no one-sided agent: the server reports no naam-nic")]
    NoAgent,
    /// The message could not be encoded.
    #[error("encoding: {0}")]
    Encode(#[from] WireError),
}

/// What happened, for the driver (taken with [`ClientEndpoint::poll_event`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ClientEvent {
    /// A session is set up; the server's welcome (manifest page 0, client id, agent).
    /// Boxed, as [`ClientEvent::Control`]: an event moves a few times on its way to the
    /// driver, and every answer would otherwise be as large as the largest control message.
    Connected(Box<Control>),
    /// A handshake failed.
    ConnectFailed(ConnectError),
    /// Exchange `id` was answered with `message` (a reply, a completion or a control
    /// message, unsealed).
    Answered {
        /// The id that [`ClientEndpoint::request`], `read` or `query` returned.
        id: u64,
        /// The answer's inner message, unsealed but not decoded.
        message: Bytes,
    },
    /// Exchange `id` ended without an answer.
    Failed {
        /// The id that [`ClientEndpoint::request`], `read` or `query` returned.
        id: u64,
        /// Why it ended. The exchange is forgotten: a late reply or completion for `id` is
        /// dropped.
        error: ExchangeError,
    },
    /// A control message in the session that answers no exchange (weights, errors).
    Control(Box<Control>),
}

/// One outstanding exchange.
#[derive(Debug)]
struct Exchange {
    to: SocketAddr,
    want: MessageKind,
    /// The message's first send (unsealed). A request's resends are copies of it with RETRY
    /// set, made only when a resend happens (most exchanges are answered the first time).
    first: Bytes,
    started: Nanos,
    /// Whether this exchange already lived through a session renewal.
    renewed: bool,
    /// The endpoint's send counter at this exchange's latest send.
    sent_seq: u64,
    /// When it was last sent.
    sent_at: Nanos,
    /// Its latest resend, if any: early (on others' answers) or at its timeout.
    resent: Option<Resent>,
}

/// Why an exchange was last sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resent {
    /// Later sends were answered first (a loss found early).
    Early,
    /// Its timer fired.
    Timeout,
}

/// An exchange answered after a resend: if its answer comes twice, the resend was not needed.
#[derive(Clone, Copy, Debug)]
struct AnsweredResend {
    id: u64,
    handler: Option<(u32, u32)>,
    why: Resent,
}

impl Exchange {
    /// The (app, handler) a request exchange calls.
    fn handler(&self) -> Option<(u32, u32)> {
        Request::peek_handler(&self.first)
    }
}

#[derive(Debug)]
enum Handshake {
    /// Hello sent, waiting for the challenge.
    Hello {
        hs: ClientHandshake,
        id: u64,
        hello: Bytes,
        started: Nanos,
    },
    /// Auth sent, waiting for the sealed welcome.
    Auth {
        hs: ClientHandshake,
        id: u64,
        auth: Bytes,
        server_nonce: [u8; crate::session::NONCE_LEN],
        started: Nanos,
    },
}

impl Handshake {
    fn id(&self) -> u64 {
        match self {
            Handshake::Hello { id, .. } | Handshake::Auth { id, .. } => *id,
        }
    }
}

#[derive(Debug)]
struct Session {
    key: Arc<SessionKey>,
    sealer: Arc<Sealer>,
}

/// A client's endpoint. See the module documentation.
#[derive(Debug)]
pub struct ClientEndpoint {
    config: ClientConfig,
    session: Option<Session>,
    handshake: Option<Handshake>,
    /// The handshake's timers (its own schedule: three tries within the connect timeout).
    handshake_timer: Retransmit,
    client_id: u32,
    seq: u64,
    agent: Option<SocketAddr>,
    exchanges: IntMap<u64, Exchange>,
    timers: Retransmit,
    /// Exchanges waiting for a session (set up, or set up again after a restart).
    parked: Vec<u64>,
    /// When the server was last heard from, or when the client, idle after an answered
    /// exchange, asked again ([`ClientEndpoint::resume`]): the liveness bound measures silence
    /// while asked.
    last_heard: Nanos,
    /// When an exchange last failed (given up after its attempts).
    last_failed: Nanos,
    transmits: VecDeque<Transmit>,
    events: VecDeque<ClientEvent>,
    /// Round trips per destination (the server, the NIC's agent).
    paths: IntMap<SocketAddr, RttEstimator>,
    /// Requests the server may have outstanding from this session (its welcome's grant).
    window: u32,
    stats: ClientStats,
    /// Messages of the session not yet sealed: those for the same peer that are ready
    /// together are coalesced into one envelope when transmitted.
    outbox: Vec<Outgoing>,
    /// Where requests are encoded and envelopes written: once an exchange is answered and
    /// its datagrams sent, their chunk is written again, with no allocation per message.
    arena: ByteArena,
    /// Exchange sends so far (first sends and resends), numbering them.
    send_seq: u64,
    /// The most bytes one sealed datagram may carry (the driver's datagram, less framing).
    datagram_payload: usize,
    /// Exchanges answered after a resend, oldest first.
    answered_resends: VecDeque<AnsweredResend>,
    /// Handlers whose answers legitimately overtake others' (a write queued for its owner,
    /// while reads run at once), learnt from a spurious early resend: their exchanges are
    /// declared lost by their probe timeout only, never by later answers.
    reordering: IntSet<(u32, u32)>,
}

/// Counters of a client endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientStats {
    /// Exchanges sent (first sends).
    pub sent: u64,
    /// Resends after a timeout.
    pub resends: u64,
    /// Answers to exchanges already answered or given up on: a resend that was not needed
    /// (its first send had been answered) shows here.
    pub duplicates: u64,
    /// Of the resends, those made on later answers (a loss found early), not at a timeout.
    pub early_resends: u64,
    /// Resends found not needed (the first send's answer came too); one made early teaches
    /// the endpoint that its handler is answered out of order.
    pub spurious_resends: u64,
}

/// The id a message of kind `kind` carries.
fn answered_id(kind: MessageKind, m: &[u8]) -> Option<u64> {
    crate::peek::message_id(m)
        .filter(|(k, _)| *k == kind)
        .map(|(_, id)| id)
}

impl ClientEndpoint {
    /// An endpoint with no session yet; [`ClientEndpoint::connect`] starts one.
    pub fn new(config: ClientConfig, now: Nanos) -> ClientEndpoint {
        let handshake_rto = (config.connect_timeout / ((1 << HANDSHAKE_SENDS) - 1)).max(MS);
        ClientEndpoint {
            timers: Retransmit::new(config.rto, config.attempts.max(1))
                .with_patience(
                    config
                        .rto
                        .saturating_mul((1u64 << config.attempts.clamp(1, 20)) - 1),
                )
                .with_max_backoff(config.max_rto)
                .with_flat_resends(crate::frame::FLAT_RESENDS),
            handshake_timer: Retransmit::new(handshake_rto, HANDSHAKE_SENDS),
            config,
            session: None,
            handshake: None,
            client_id: 0,
            seq: 0,
            agent: None,
            exchanges: IntMap::default(),
            parked: Vec::new(),
            last_heard: now,
            last_failed: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            paths: IntMap::default(),
            window: crate::limits::SESSION_CREDIT,
            stats: ClientStats::default(),
            outbox: Vec::new(),
            arena: ByteArena::default(),
            send_seq: 0,
            datagram_payload: crate::frame::MIN_DATAGRAM - crate::frame::HEADER,
            answered_resends: VecDeque::new(),
            reordering: IntSet::default(),
        }
    }

    /// Sets how many bytes one datagram's payload may hold (the driver's datagram size less
    /// its framing): messages of the session that are ready together are coalesced up to it.
    pub fn set_datagram_payload(&mut self, bytes: usize) {
        self.datagram_payload = bytes;
    }

    /// Queues `inner` for `to`, to be sealed in the session (and coalesced) when transmitted;
    /// nothing goes without a session.
    fn send_sealed(&mut self, to: SocketAddr, id: u64, inner: Bytes) {
        if self.session.is_some() {
            // Sealed in the session when it is sent ([`ClientEndpoint::poll_transmit`]).
            self.outbox.push(Outgoing {
                to,
                sealer: None,
                id,
                inner: Inner::Encoded(inner),
                route: None,
            });
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> ClientStats {
        self.stats
    }

    /// Requests this session may have outstanding at once: what the server granted in its
    /// welcome (the default credit until then, or from a server that grants none).
    pub fn window(&self) -> u32 {
        self.window
    }

    /// The smoothed round trip to the server, once measured.
    pub fn rtt(&self) -> Option<Nanos> {
        self.paths
            .get(&self.config.server)
            .and_then(RttEstimator::smoothed)
    }

    /// The path to `to`'s estimator.
    fn path(&mut self, to: SocketAddr) -> &mut RttEstimator {
        let (rto, min, max) = (self.config.rto, self.config.min_rto, self.config.max_rto);
        self.paths
            .entry(to)
            .or_insert_with(|| RttEstimator::new(rto, min, max))
    }

    /// Starts a handshake (dropping any session): hello now, the rest as answers arrive. Its
    /// end is a [`ClientEvent::Connected`] or [`ClientEvent::ConnectFailed`].
    pub fn connect(&mut self, now: Nanos) {
        // What was queued in the session goes out sealed in it, as if polled before.
        self.seal_outbox();
        self.session = None;
        let server = self.config.server;
        if let Some(h) = self.handshake.take() {
            self.handshake_timer.answered(h.id());
        }
        if let Err(message) = self.config.authentication.check_scope(server) {
            self.connect_failed(ConnectError::Refused { server, message });
            return;
        }
        let hs = match ClientHandshake::new(
            &self.config.tenant,
            self.config.credential.clone(),
            &self.config.entropy,
        ) {
            Ok(hs) => hs,
            Err(e) => {
                let message = e.to_string();
                self.connect_failed(ConnectError::Refused { server, message });
                return;
            }
        };
        let id = self.next_id();
        let mut hello = Control::Hello {
            tenant: self.config.tenant.clone(),
            nonce: hs.nonce(),
        }
        .to_bytes(id)
        .to_vec();
        // Padded, so the challenge is far inside the server's amplification limit.
        if hello.len() < HELLO_PADDING {
            hello.resize(HELLO_PADDING, b' ');
        }
        let hello = Bytes::from(hello);
        self.push(server, id, hello.clone());
        self.handshake_timer.sent(id, now);
        self.handshake = Some(Handshake::Hello {
            hs,
            id,
            hello,
            started: now,
        });
    }

    /// Whether a session is set up.
    pub fn is_connected(&self) -> bool {
        self.session.is_some()
    }

    /// The server's address.
    pub fn server(&self) -> SocketAddr {
        self.config.server
    }

    /// The NIC's one-sided agent, as the server last reported it.
    pub fn agent(&self) -> Option<SocketAddr> {
        self.agent
    }

    /// Takes the server's latest word on the agent (from a weights answer).
    pub fn set_agent(&mut self, agent: Option<SocketAddr>) {
        self.agent = agent;
    }

    /// A fresh request id (top bits: the client id the welcome gave).
    pub fn next_id(&mut self) -> u64 {
        self.seq += 1;
        request_id(self.client_id, self.seq)
    }

    /// Exchanges outstanding (sent or waiting for a session).
    pub fn outstanding(&self) -> usize {
        self.exchanges.len()
    }

    /// Before a new exchange: a client that had none outstanding, and whose last exchange
    /// was answered, was idle, and a server asked nothing was not silent. Without this a
    /// client idle for longer than the liveness bound (a gateway overnight) failed its next
    /// call with `ServerGone` although the server was well. After an exchange that failed,
    /// the silence goes on counting, so calls to a dead server still fail fast.
    fn resume(&mut self, now: Nanos) {
        // After a failure the server stays suspect: its silence goes on counting.
        if self.exchanges.is_empty()
            && self.parked.is_empty()
            && self.last_failed <= self.last_heard
        {
            self.last_heard = now;
        }
    }

    /// Fails fast once the server has been silent for longer than the liveness bound.
    pub fn check_alive(&self, now: Nanos) -> Result<(), ExchangeError> {
        let silent_ns = now.saturating_sub(self.last_heard);
        if silent_ns > self.config.liveness {
            return Err(ExchangeError::ServerGone {
                silent_ns,
                bound_ns: self.config.liveness,
            });
        }
        Ok(())
    }

    /// Sends request `req` to the server under a fresh id (returned, and set in `req`); its
    /// answer is a reply. The request is encoded where it lies: a `Request` is 360 bytes, and
    /// taken by value it was copied in and out with a call to `memcpy` each way.
    pub fn request(&mut self, now: Nanos, req: &mut Request) -> Result<u64, ExchangeError> {
        self.resume(now);
        self.check_alive(now)?;
        req.request_id = self.next_id();
        let mut encoded = Ok(());
        let first = self
            .arena
            .write(req.encoded_len(), |b| encoded = req.encode(b));
        encoded?;
        let (server, id) = (self.config.server, req.request_id);
        Ok(self.start(now, server, id, MessageKind::Reply, first))
    }

    /// For a server endpoint in this process, which takes requests handed over as they are
    /// (see `ServerEndpoint::request_in_process`): gives `req` a fresh id and returns the
    /// session to hand it in under; `None` while no session is up (then send it with
    /// [`ClientEndpoint::request`], which sets one up).
    pub fn request_in_process(
        &mut self,
        now: Nanos,
        req: &mut Request,
    ) -> Result<Option<u64>, ExchangeError> {
        self.resume(now);
        self.check_alive(now)?;
        let Some(session) = &self.session else {
            return Ok(None);
        };
        let sid = session.key.session();
        req.request_id = self.next_id();
        Ok(Some(sid))
    }

    /// The server in this process answered a request handed in at `now`: it is alive.
    pub fn answered_in_process(&mut self, now: Nanos) {
        self.last_heard = self.last_heard.max(now);
    }

    /// The server in this process took request `id`, handed in at `now`, without answering
    /// yet: its answer comes as a datagram of the session, and this waits for it as for an
    /// exchange sent then. There is nothing to send again (the handing over loses nothing),
    /// so a timeout fails it once its attempts are spent, as a lost datagram's would.
    pub fn expect_in_process(&mut self, now: Nanos, id: u64) -> u64 {
        // An exchange with no message: started as any other, and never sent.
        let server = self.config.server;
        self.start(now, server, id, MessageKind::Reply, Bytes::new())
    }

    /// Sends a one-sided READ of `descs` (of `app`'s regions) to the NIC's agent; its answer
    /// is a completion carrying the bytes.
    pub fn read(
        &mut self,
        now: Nanos,
        app: u32,
        descs: &[Descriptor],
    ) -> Result<u64, ExchangeError> {
        self.resume(now);
        self.check_alive(now)?;
        let agent = self.agent.ok_or(ExchangeError::NoAgent)?;
        let id = self.next_id();
        let bytes = Operation {
            app,
            id,
            op: Op::Read(descs.to_vec()),
        }
        .to_bytes()?;
        Ok(self.start(now, agent, id, MessageKind::OneSidedCompletion, bytes))
    }

    /// Sends control query `message` to the server; its answer is a control message.
    pub fn query(&mut self, now: Nanos, message: &Control) -> Result<u64, ExchangeError> {
        self.resume(now);
        self.check_alive(now)?;
        let id = self.next_id();
        let server = self.config.server;
        let bytes = message.to_bytes(id);
        Ok(self.start(now, server, id, MessageKind::Control, bytes))
    }

    /// Sends control message `message` to the server once, expecting nothing in particular:
    /// whatever it answers arrives as [`ClientEvent::Control`]. Nothing is sent without a
    /// session.
    pub fn notify(&mut self, message: &Control) {
        if self.session.is_none() {
            return;
        }
        let id = self.next_id();
        let server = self.config.server;
        self.send_sealed(server, id, message.to_bytes(id));
    }

    /// Seals `inner` in the session (unchanged without one). For tools and tests that send
    /// hostile or replayed messages.
    pub fn seal(&self, inner: &[u8]) -> Bytes {
        match &self.session {
            Some(s) => s.sealer.seal(inner),
            None => Bytes::copy_from_slice(inner),
        }
    }

    /// The inner message of `datagram` if it is sealed in this session by the server or its
    /// NIC (tools and tests; [`ClientEndpoint::handle`] is the protocol's way in).
    pub fn open(&self, datagram: &Bytes) -> Option<Bytes> {
        self.open_owned(datagram.clone())
    }

    /// [`ClientEndpoint::open`] of a datagram nothing else needs: decrypted where it lies.
    fn open_owned(&self, datagram: Bytes) -> Option<Bytes> {
        let s = self.session.as_ref()?;
        match s.key.open_owned(datagram) {
            Ok((h, inner)) if matches!(h.sender, Sender::Server | Sender::Nic) => Some(inner),
            _ => None,
        }
    }

    /// Takes in a datagram from `from`.
    pub fn handle(&mut self, now: Nanos, from: SocketAddr, datagram: Bytes) {
        let _ = from; // Sessions, not addresses, say who sent what.
        match MessageKind::peek(&datagram) {
            Some(MessageKind::Sealed) if self.session.is_some() => {
                if let Some(inner) = self.open_owned(datagram) {
                    self.last_heard = now;
                    self.sealed(now, inner);
                }
            }
            Some(MessageKind::Sealed) => self.welcome(now, &datagram),
            Some(MessageKind::Control) => match Control::decode(&datagram) {
                Ok((_, Control::Stale { session, token, .. })) => {
                    let ours = self.session.as_ref().is_some_and(|s| {
                        s.key.session() == session
                            && self.config.credential.reset_token(session) == token
                    });
                    if ours {
                        self.last_heard = now;
                        self.renew(now);
                    }
                }
                Ok((id, c)) => self.unsealed(now, id, c),
                Err(_) => {}
            },
            _ => {}
        }
    }

    /// The next datagram to send. Messages of the session waiting for the same peer are
    /// coalesced into one envelope as far as a datagram holds them.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.seal_outbox();
        self.transmits.pop_front()
    }

    /// Seals what waits in the outbox, coalesced, in the session it was queued in (the
    /// current one: a new handshake seals the outbox before it drops the session).
    fn seal_outbox(&mut self) {
        if !self.outbox.is_empty() {
            coalesce(
                &mut self.outbox,
                self.datagram_payload,
                &mut self.transmits,
                &mut self.arena,
                self.session.as_ref().map(|s| &s.sealer),
            );
        }
    }

    /// The oldest event not yet taken, if any.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// When [`ClientEndpoint::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        match (
            self.timers.next_deadline(),
            self.handshake_timer.next_deadline(),
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Resends what is due and gives up on what is out of attempts.
    pub fn handle_timeout(&mut self, now: Nanos) {
        for (id, t) in self.handshake_timer.poll(now) {
            let Some(h) = &self.handshake else { continue };
            if h.id() != id {
                continue;
            }
            match (t, h) {
                (Timeout::Resend(_), Handshake::Hello { hello: m, .. })
                | (Timeout::Resend(_), Handshake::Auth { auth: m, .. }) => {
                    let m = m.clone();
                    self.push(self.config.server, id, m);
                }
                (
                    Timeout::GiveUp,
                    Handshake::Hello { started, .. } | Handshake::Auth { started, .. },
                ) => {
                    let waited_ns = now.saturating_sub(*started);
                    self.handshake = None;
                    let server = self.config.server;
                    self.connect_failed(ConnectError::NoServer { server, waited_ns });
                }
            }
        }
        for (id, t) in self.timers.poll(now) {
            let Some(x) = self.exchanges.get(&id) else {
                continue;
            };
            match t {
                Timeout::Resend(_) => {
                    let to = x.to;
                    if let Some(x) = self.exchanges.get_mut(&id) {
                        x.resent = Some(Resent::Timeout);
                    }
                    self.path(to).timed_out();
                    self.resend(now, id);
                }
                Timeout::GiveUp => {
                    let waited_ns = now.saturating_sub(x.started);
                    self.last_failed = now;
                    self.fail(id, ExchangeError::TimedOut { waited_ns });
                }
            }
        }
    }

    /// Sends exchange `id` again at `now` (its timer was rearmed by whoever decided to).
    fn resend(&mut self, now: Nanos, id: u64) {
        let Some(x) = self.exchanges.get(&id) else {
            return;
        };
        if x.first.is_empty() {
            // Handed to a server in this process ([`ClientEndpoint::expect_in_process`]):
            // nothing was lost, nothing to send again; its timer runs out.
            return;
        }
        self.stats.resends += 1;
        // A request's resend says so (the owner answers a retried write from its dedup
        // table); anything else goes again as it was.
        let again = Request::with_flag(&x.first, flags::RETRY);
        let (to, m) = (x.to, again.unwrap_or_else(|| x.first.clone()));
        self.send_sealed(to, id, m);
        self.send_seq += 1;
        let seq = self.send_seq;
        if let Some(x) = self.exchanges.get_mut(&id) {
            x.sent_seq = seq;
            x.sent_at = now;
        }
    }

    /// An answer came for a send numbered `answered_seq` on the path to `to`: an exchange to
    /// the same peer sent [`LOSS_THRESHOLD`] or more sends before it, unanswered for longer
    /// than a round trip and a bit (9/8, QUIC's time threshold), was most likely lost, so it
    /// is sent again now rather than at its timeout (QUIC's packet threshold).
    fn detect_losses(&mut self, now: Nanos, to: SocketAddr, answered_seq: u64) {
        let Some(srtt) = self.paths.get(&to).and_then(RttEstimator::smoothed) else {
            return;
        };
        let late = srtt.saturating_mul(9) / 8;
        let lost: Vec<u64> = self
            .exchanges
            .iter()
            .filter(|(_, x)| {
                x.to == to
                    && x.sent_seq != 0
                    && x.sent_seq + LOSS_THRESHOLD <= answered_seq
                    && now.saturating_sub(x.sent_at) > late
                    && !x.handler().is_some_and(|h| self.reordering.contains(&h))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if self.timers.resent_early(id, now) {
                if let Some(x) = self.exchanges.get_mut(&id) {
                    x.resent = Some(Resent::Early);
                }
                self.stats.early_resends += 1;
                self.resend(now, id);
            }
        }
    }

    /// A second answer to exchange `id` came: if `id` was resent, its first send had not
    /// been lost. Resent early, it was overtaken, and its handler is left to its probe
    /// timeout from now on; resent at its timeout, the path paused longer than the timeout
    /// allowed, and it is only counted.
    fn spurious_resend(&mut self, id: u64) {
        let Some(at) = self.answered_resends.iter().position(|r| r.id == id) else {
            return;
        };
        let Some(r) = self.answered_resends.remove(at) else {
            return;
        };
        self.stats.spurious_resends += 1;
        match (r.why, r.handler) {
            (Resent::Early, Some(handler)) => {
                if self.reordering.len() >= REORDERING_HANDLERS {
                    self.reordering.clear();
                }
                self.reordering.insert(handler);
            }
            (Resent::Early, None) => {}
            // A pause longer than the timeout (a descheduled loop on shared cores). Raising
            // the timeout's floor on these (Eifel, RFC 4015) cut them fourfold here but halved
            // throughput under injected loss (bench/RESULTS.md, "Data path"): losses cost
            // more than the odd needless resend of a read or a deduplicated write.
            (Resent::Timeout, _) => {}
        }
    }

    fn push(&mut self, to: SocketAddr, id: u64, bytes: Bytes) {
        self.transmits.push_back(Transmit::new(to, id, bytes));
    }

    fn fail(&mut self, id: u64, error: ExchangeError) {
        self.exchanges.remove(&id);
        self.timers.answered(id);
        self.events.push_back(ClientEvent::Failed { id, error });
    }

    /// Records exchange `id` and sends it, or parks it until there is a session.
    fn start(
        &mut self,
        now: Nanos,
        to: SocketAddr,
        id: u64,
        want: MessageKind,
        first: Bytes,
    ) -> u64 {
        self.exchanges.insert(
            id,
            Exchange {
                to,
                want,
                first,
                started: now,
                renewed: false,
                sent_seq: 0,
                sent_at: now,
                resent: None,
            },
        );
        if self.session.is_some() {
            self.send_exchange(now, id);
        } else {
            self.parked.push(id);
            if self.handshake.is_none() {
                self.connect(now);
            }
        }
        id
    }

    fn send_exchange(&mut self, now: Nanos, id: u64) {
        // One lookup: the exchange is stamped with its send before the message is queued.
        let seq = self.send_seq + 1;
        let Some(x) = self.exchanges.get_mut(&id) else {
            return;
        };
        x.sent_seq = seq;
        x.sent_at = now;
        let (to, first) = (x.to, x.first.clone());
        self.send_seq = seq;
        // An exchange with no message was handed to a server in this process
        // ([`ClientEndpoint::expect_in_process`]): timed as if sent, nothing to send.
        if !first.is_empty() {
            self.send_sealed(to, id, first);
        }
        let rto = self.path(to).rto();
        self.timers.sent_with(id, now, rto);
        self.stats.sent += 1;
    }

    /// A message sealed in the session: an answer, a control message, a late duplicate, or
    /// a batch of those.
    fn sealed(&mut self, now: Nanos, inner: Bytes) {
        let Some(kind) = MessageKind::peek(&inner) else {
            return;
        };
        if kind == MessageKind::Batch {
            if let Ok(members) = crate::batch::split(&inner) {
                for m in members {
                    // Batches do not nest.
                    if MessageKind::peek(&m) != Some(MessageKind::Batch) {
                        self.sealed(now, m);
                    }
                }
            }
            return;
        }
        if let Some(id) = answered_id(kind, &inner) {
            let answered = match self.exchanges.entry(id) {
                Entry::Occupied(e) if e.get().want == kind => Some(e.remove()),
                _ => None,
            };
            if let Some(x) = answered {
                if let Some(Some(rtt)) = self.timers.answered_at(id, now) {
                    self.path(x.to).sample(rtt);
                }
                // The path delivers: its other exchanges' waits fall back to their
                // first timeout (RFC 9002's backoff reset on an acknowledgement).
                let (exchanges, to) = (&self.exchanges, x.to);
                self.timers
                    .progressed(|id| exchanges.get(&id).is_some_and(|e| e.to == to));
                if let Some(why) = x.resent {
                    if self.answered_resends.len() >= RESENDS_REMEMBERED {
                        self.answered_resends.pop_front();
                    }
                    self.answered_resends.push_back(AnsweredResend {
                        id,
                        handler: x.handler(),
                        why,
                    });
                }
                if !self.exchanges.is_empty() {
                    self.detect_losses(now, x.to, x.sent_seq);
                }
                self.events
                    .push_back(ClientEvent::Answered { id, message: inner });
                return;
            }
            if kind != MessageKind::Control {
                self.stats.duplicates += 1;
                self.spurious_resend(id);
            }
        }
        if kind == MessageKind::Control {
            if let Ok((_, c)) = Control::decode(&inner) {
                self.events.push_back(ClientEvent::Control(Box::new(c)));
            }
        }
        // Anything else answers an exchange given up on, or answered already.
    }

    /// An unsealed control message: only handshake answers are taken (and trusted for nothing
    /// else).
    fn unsealed(&mut self, now: Nanos, id: u64, c: Control) {
        let server = self.config.server;
        match (&self.handshake, c) {
            (
                Some(Handshake::Hello { id: hid, .. }),
                Control::Challenge {
                    route,
                    nonce,
                    issued,
                    cookie,
                },
            ) if *hid == id => {
                let Some(Handshake::Hello { hs, started, .. }) = self.handshake.take() else {
                    return;
                };
                self.handshake_timer.answered(id);
                let auth_id = self.next_id();
                let auth = Control::Auth {
                    tenant: self.config.tenant.clone(),
                    client_nonce: hs.nonce(),
                    server_nonce: nonce,
                    issued,
                    cookie,
                    proof: hs.proof(nonce, &cookie),
                }
                // To the receive loop the server chose for the session.
                .to_routed_bytes(auth_id, route);
                self.push(server, auth_id, auth.clone());
                self.handshake_timer.sent(auth_id, now);
                self.handshake = Some(Handshake::Auth {
                    hs,
                    id: auth_id,
                    auth,
                    server_nonce: nonce,
                    started,
                });
            }
            (Some(h), Control::Error { message }) if h.id() == id => {
                self.handshake_timer.answered(id);
                self.handshake = None;
                self.connect_failed(ConnectError::Refused { server, message });
            }
            _ => {}
        }
    }

    /// A sealed datagram while there is no session: the welcome, sealed in the new session
    /// (whose key follows from its id, the nonces and the credential).
    fn welcome(&mut self, now: Nanos, datagram: &Bytes) {
        let Some(Handshake::Auth {
            hs,
            id,
            server_nonce,
            ..
        }) = &self.handshake
        else {
            return;
        };
        let Ok(h) = peek_sealed(datagram) else {
            return;
        };
        if h.sender != Sender::Server {
            return;
        }
        let key = hs
            .session_key(h.session, *server_nonce)
            .with_authentication(self.config.authentication);
        let Ok((_, inner)) = key.open(datagram) else {
            return;
        };
        if answered_id(MessageKind::Control, &inner) != Some(*id) {
            return;
        }
        let id = *id;
        let server = self.config.server;
        let welcome = match Control::decode(&inner) {
            Ok((_, w @ Control::Welcome { .. })) => w,
            Ok((_, Control::Error { message })) => {
                self.handshake_timer.answered(id);
                self.handshake = None;
                self.connect_failed(ConnectError::Refused { server, message });
                return;
            }
            other => {
                self.handshake_timer.answered(id);
                self.handshake = None;
                let message = format!("unexpected answer to auth: {other:?}");
                self.connect_failed(ConnectError::Refused { server, message });
                return;
            }
        };
        self.handshake_timer.answered(id);
        self.handshake = None;
        let key = Arc::new(key);
        self.session = Some(Session {
            sealer: Arc::new(Sealer::new(key.clone(), Sender::Client)),
            key,
        });
        self.last_heard = now;
        if let Control::Welcome {
            client_id,
            agent,
            window,
            ..
        } = &welcome
        {
            self.client_id = *client_id;
            self.agent = *agent;
            if *window > 0 {
                self.window = *window;
            }
        }
        self.events
            .push_back(ClientEvent::Connected(Box::new(welcome)));
        for id in std::mem::take(&mut self.parked) {
            self.send_exchange(now, id);
        }
    }

    /// The server does not know the session (it restarted): set up a new one and resend what
    /// is outstanding, once per exchange.
    fn renew(&mut self, now: Nanos) {
        let ids: Vec<u64> = self.exchanges.keys().copied().collect();
        for id in ids {
            self.timers.answered(id);
            let again = self.exchanges.get_mut(&id).is_some_and(|x| {
                let first = !x.renewed;
                x.renewed = true;
                first
            });
            if again {
                if !self.parked.contains(&id) {
                    self.parked.push(id);
                }
            } else {
                self.parked.retain(|p| *p != id);
                let message = "the server forgot the new session at once".to_string();
                self.fail(id, ExchangeError::Session(message));
            }
        }
        self.connect(now);
    }

    fn connect_failed(&mut self, error: ConnectError) {
        for id in std::mem::take(&mut self.parked) {
            self.fail(id, ExchangeError::Session(error.to_string()));
        }
        self.events.push_back(ClientEvent::ConnectFailed(error));
    }
}
