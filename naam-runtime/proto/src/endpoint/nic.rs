//! The NIC's endpoint (`naam-nic`'s protocol): pairing with the server through the pairing
//! secret (a session of tenant [`NIC_TENANT`], retried until it answers), the client sessions
//! the server announces (each key unwrapped with the pairing session's), checking every
//! client message's seal, replay window, scope and one-sided rights, serving one-sided
//! operations (mutations answered once: retransmissions get the first answer), steering
//! requests to the NIC executors, and reporting the NIC's load every period.
//!
//! When the server restarts (a welcome of a new epoch) the endpoint asks its [`NicBackend`]
//! to map the new regions, and forgets the old sessions, with no manual step.
//!
//! A NIC with several receive loops (one per core, on one address: the kernel hands each
//! datagram to the loop its route names, as naam-server's loops) runs one endpoint per loop:
//! the first is made with [`NicEndpoint::new`], the others with [`NicEndpoint::another_loop`].
//! They share the pairing (its key and replay window) and the announced client sessions (each
//! with its own replay window), and nothing else on a request's path. A session's own
//! datagrams reach its route's loop, and so do the server's forwards of its requests and its
//! announcement: sealed in the pairing session, they carry the client session's route
//! ([`crate::endpoint::Transmit::route`]), so the forwards of many sessions spread over the
//! loops, and each loop opens its own (only the pairing's replay window is taken under a lock,
//! whose 1,024 packets absorb the reordering between loops). The server's other messages
//! reach the loop the pairing session's route names. The first loop retries pairing and
//! remaps; any loop reports load when a report is due.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use bytes::Bytes;
use serde::Serialize;

use super::server::{admit, error_reply, Channel, Routed};
use super::Transmit;
use crate::control::{self, Control, Manifest};
use crate::dedup::RecentAnswers;
use crate::entropy::Entropy;
use crate::kind::MessageKind;
use crate::onesided::{Completion, Operation};
use crate::session::{
    peek_sealed, Authentication, ClientHandshake, Credential, ReplayWindow, Sealer, Sender,
    SessionKey, HELLO_PADDING, NIC_TENANT, NONCE_LEN,
};
use crate::steering::{RemoteLoad, Selector};
use crate::wire::{Reply, Request, Status};
use crate::{Nanos, Placement};

/// Sessions the NIC holds at most (the server's own limit is per tenant).
const MAX_SESSIONS: usize = 1 << 16;
/// How often a pairing message is resent while unanswered, and how often the server is asked
/// about one unknown session at most.
const PAIRING_RETRY: Nanos = 100_000_000;

/// How often an idle NIC reports (a heartbeat: the server takes a NIC silent for
/// [`crate::limits::NIC_SILENCE`] out of the weights, and a restarted server learns of the NIC
/// by its next report). Reports of work come every `report_every`; a NIC with nothing to say
/// would otherwise wake itself and the server a thousand times a second.
const IDLE_REPORT_EVERY: Nanos = crate::limits::NIC_IDLE_REPORT;
/// How often mapping a restarted server's regions is retried (its manifest may still be
/// being written).
const REMAP_RETRY: Nanos = 10_000_000;

/// The NIC's executors and memory, as its endpoint uses them.
pub trait NicBackend {
    /// Queues `req` at a NIC executor (its reply goes out sealed on `reply_to`), or refuses;
    /// a reply run at once ([`Routed::Answered`]) is written into `out`.
    fn dispatch(
        &mut self,
        req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        reply_to: Channel,
        out: &mut Reply,
    ) -> Routed;
    /// Performs one-sided operation `op` (already checked against the session's grants).
    fn one_sided(&mut self, op: &Operation) -> Completion;
    /// The NIC's load since the last report.
    fn load_report(&mut self) -> RemoteLoad;
    /// Maps the regions of the server start `epoch` and returns its manifest; an error (or
    /// an older manifest) means "not yet": the endpoint asks again on its next timeout.
    fn remap(&mut self, epoch: u64) -> Result<Manifest, String>;
    /// Serves the handlers of the server's manifest [`Manifest::version`] `version` or newer
    /// (a deploy changed them: the manifest file is read again) and returns the version now
    /// served; an error, or an older version, means "not yet": the endpoint tries again on
    /// its next timeout. By default a NIC cannot, and serves what it started with.
    fn redeploy(&mut self, version: u64) -> Result<u64, String> {
        Err(format!(
            "this NIC cannot take up manifest version {version}: it serves the handlers it started with"
        ))
    }
}

/// A NIC endpoint's settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NicConfig {
    /// naam-server's address.
    pub server: SocketAddr,
    /// Where this NIC takes forwarded requests and one-sided operations (an unspecified IP:
    /// as the server sees it).
    pub advertise: SocketAddr,
    /// The credential naam-nic pairs with, as tenant [`crate::session::NIC_TENANT`]; the
    /// server must be configured with the same one.
    pub pairing: Credential,
    /// Datagram authentication (must match the server's).
    pub authentication: Authentication,
    /// How often the NIC reports its load.
    pub report_every: Nanos,
    /// Handshake nonces and the first packet number of each client session are drawn from it.
    pub entropy: Entropy,
}

impl NicConfig {
    /// Pairs with `server` using `pairing`, advertising `advertise`, reporting every 5 ms.
    pub fn new(
        server: SocketAddr,
        advertise: SocketAddr,
        pairing: Credential,
        entropy: Entropy,
    ) -> NicConfig {
        NicConfig {
            server,
            advertise,
            pairing,
            authentication: Authentication::On,
            report_every: 5_000_000,
            entropy,
        }
    }
}

/// Counters of a NIC endpoint.
#[derive(Clone, Copy, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct NicStats {
    /// Requests queued at the NIC executors.
    pub executed: u64,
    /// One-sided operations served.
    pub one_sided: u64,
    /// Retransmitted one-sided writes answered from the duplicate cache.
    pub duplicates: u64,
    /// Messages that did not decode.
    pub malformed: u64,
    /// Requests and operations refused (busy, shutting down, out of scope).
    pub refused: u64,
    /// Messages dropped unopened.
    pub unauthenticated: u64,
    /// Pairings with the server.
    pub pairings: u64,
}

impl std::ops::AddAssign for NicStats {
    /// Adds another receive loop's counters.
    fn add_assign(&mut self, o: NicStats) {
        let NicStats {
            executed,
            one_sided,
            duplicates,
            malformed,
            refused,
            unauthenticated,
            pairings,
        } = o;
        self.executed += executed;
        self.one_sided += one_sided;
        self.duplicates += duplicates;
        self.malformed += malformed;
        self.refused += refused;
        self.unauthenticated += unauthenticated;
        self.pairings += pairings;
    }
}

impl NicStats {
    /// The counters as `(name, help, value)`, for metrics.
    pub fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            (
                "executed",
                "Requests run by the NIC executors.",
                self.executed,
            ),
            ("one_sided", "One-sided operations served.", self.one_sided),
            (
                "duplicates",
                "Retransmitted one-sided writes answered from the cache.",
                self.duplicates,
            ),
            ("malformed", "Messages that did not decode.", self.malformed),
            (
                "requests_not_run",
                "Requests answered with an error before any handler ran (busy, shutting down, \
                 out of scope); not the status \"refused\" of naam_messages_total, which a \
                 run the runtime stopped gets.",
                self.refused,
            ),
            (
                "unauthenticated",
                "Messages dropped unopened.",
                self.unauthenticated,
            ),
            ("pairings", "Pairings with the server.", self.pairings),
        ]
    }
}

/// What happened, for the driver's log (taken with [`NicEndpoint::poll_event`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NicEvent {
    /// Paired with the server start `epoch`.
    Paired {
        /// The server start's epoch, as its welcome gave it.
        epoch: u64,
    },
    /// A pairing could not start (no randomness); retried.
    PairingFailed(String),
    /// The server refused pairing.
    Refused(String),
    /// The server forgot this NIC: pairing again.
    Unpaired,
    /// The server restarted: its regions are mapped anew.
    Remapped {
        /// The restarted server's epoch, whose regions are now mapped.
        epoch: u64,
    },
    /// Mapping the restarted server's regions failed (retried).
    RemapFailed(String),
    /// The handlers of a deploy are served (the load reports say so, and the server
    /// forwards the deployed app's requests again).
    Redeployed {
        /// The manifest version now served.
        version: u64,
    },
    /// Taking up a deploy's handlers failed (retried; meanwhile the server serves the app
    /// itself).
    RedeployFailed(String),
}

/// A client session the server announced.
struct ClientSession {
    key: Arc<SessionKey>,
    ch: Channel,
    /// The apps it may use, ascending (as [`Control::SessionOpen`] decodes them).
    apps: Vec<u32>,
    /// Taken by the loop of the session's route: its own datagrams and the server's forwards
    /// of them reach that loop (a route rewritten on the way reaches another loop, which
    /// shares this window, so a replay is still refused).
    /// Shared with the entry that replaces this one when the session's apps grow (an app
    /// created for its tenant), so that no datagram is taken twice across the change.
    window: Arc<Mutex<ReplayWindow>>,
}

/// Where pairing stands.
enum Pairing {
    /// Not started, or a handshake could not be made (no randomness): retried.
    Idle,
    /// Hello sent.
    Hello { hs: ClientHandshake, id: u64 },
    /// Auth sent: waiting for the welcome.
    Auth {
        hs: ClientHandshake,
        id: u64,
        server_nonce: [u8; NONCE_LEN],
        auth: Bytes,
    },
    /// Paired in server start `epoch`.
    Paired {
        key: Arc<SessionKey>,
        sealer: Arc<Sealer>,
        window: ReplayWindow,
        epoch: u64,
    },
}

/// The pairing and when the first loop last sent a pairing message.
struct Link {
    pairing: Pairing,
    last_pairing_send: Nanos,
    /// The last report said the NIC was idle (nothing queued, nothing run since the one
    /// before), and when it was sent.
    reported_idle: Option<Nanos>,
}

/// The server start the executors' regions belong to, and what the server announced for it.
struct Mapped {
    epoch: u64,
    /// `(app, rkey)` → the rights clients have there.
    grants: HashMap<(u32, u64), u32>,
    sessions: HashMap<u64, Arc<ClientSession>>,
}

/// What every receive loop of one NIC shares.
struct NicShared {
    link: Mutex<Link>,
    mapped: RwLock<Mapped>,
    /// When a load report is next due, whichever loop sends it.
    next_report: AtomicU64,
    /// The newest [`Manifest::version`] the server announced ([`Control::ManifestChanged`]).
    manifest_wanted: AtomicU64,
    /// The manifest version whose handlers the executors serve (load reports carry it).
    manifest_served: AtomicU64,
}

impl NicShared {
    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mapped(&self) -> RwLockReadGuard<'_, Mapped> {
        self.mapped.read().unwrap_or_else(|e| e.into_inner())
    }

    fn mapped_mut(&self) -> RwLockWriteGuard<'_, Mapped> {
        self.mapped.write().unwrap_or_else(|e| e.into_inner())
    }

    fn session(&self, id: u64) -> Option<Arc<ClientSession>> {
        self.mapped().sessions.get(&id).cloned()
    }
}

/// `(app, rkey)` → the rights clients have there.
fn grants_of(m: &Manifest) -> HashMap<(u32, u64), u32> {
    m.apps
        .iter()
        .flat_map(|a| {
            a.regions
                .iter()
                .map(move |r| ((a.id, r.rkey), r.client_access))
        })
        .collect()
}

/// The NIC's endpoint over NIC side `B`, for one receive loop. See the module documentation.
pub struct NicEndpoint<B> {
    backend: B,
    config: NicConfig,
    shared: Arc<NicShared>,
    /// The first loop: it retries pairing and maps a restarted server's regions.
    first: bool,
    /// The epoch of the regions when this loop last looked: its duplicate answers and its
    /// questions about sessions belong to it.
    seen_epoch: u64,
    stats: NicStats,
    sel: Selector,
    /// Answers to mutating one-sided operations by (session, operation id). A session's
    /// operations reach its route's loop only.
    dup: RecentAnswers<(u64, u64), Bytes>,
    /// Sessions asked about, and when.
    asked: HashMap<u64, Nanos>,
    next_remap: Nanos,
    /// When taking up a deploy is next tried (the first loop).
    next_redeploy: Nanos,
    next_id: u64,
    draining: bool,
    transmits: VecDeque<Transmit>,
    events: VecDeque<NicEvent>,
}

impl<B: NicBackend> NicEndpoint<B> {
    /// The first (or only) loop's endpoint, for executors built from `manifest`; it starts
    /// pairing at once.
    pub fn new(config: NicConfig, backend: B, manifest: &Manifest, now: Nanos) -> NicEndpoint<B> {
        let shared = Arc::new(NicShared {
            link: Mutex::new(Link {
                pairing: Pairing::Idle,
                last_pairing_send: now,
                reported_idle: None,
            }),
            mapped: RwLock::new(Mapped {
                epoch: manifest.epoch,
                grants: grants_of(manifest),
                sessions: HashMap::new(),
            }),
            next_report: AtomicU64::new(now),
            manifest_wanted: AtomicU64::new(manifest.version),
            manifest_served: AtomicU64::new(manifest.version),
        });
        let mut nic = NicEndpoint::member(config, backend, shared, true);
        nic.start_pairing(now);
        nic
    }

    /// The endpoint of another receive loop of this NIC, on the same address, over
    /// `backend` (the same executors, replying from that loop's socket). It shares this
    /// one's pairing and sessions.
    pub fn another_loop<C: NicBackend>(&self, backend: C) -> NicEndpoint<C> {
        NicEndpoint::member(self.config.clone(), backend, self.shared.clone(), false)
    }

    fn member(
        config: NicConfig,
        backend: B,
        shared: Arc<NicShared>,
        first: bool,
    ) -> NicEndpoint<B> {
        let seen_epoch = shared.mapped().epoch;
        NicEndpoint {
            backend,
            config,
            shared,
            first,
            seen_epoch,
            stats: NicStats::default(),
            sel: Selector::default(),
            dup: RecentAnswers::default(),
            asked: HashMap::new(),
            next_remap: 0,
            next_redeploy: 0,
            next_id: 0,
            draining: false,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// The NIC backend: its executors and mapped memory.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The NIC side, to change.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The counters so far.
    pub fn stats(&self) -> NicStats {
        self.stats
    }

    /// Whether the NIC is paired with the server start its regions belong to.
    pub fn is_paired(&self) -> bool {
        self.server_channel().is_some()
    }

    /// Client sessions the server announced and the NIC holds (every loop's).
    pub fn sessions(&self) -> usize {
        self.shared.mapped().sessions.len()
    }

    /// Refuses new requests on this loop; the first loop also says goodbye to the server (it
    /// stops forwarding). Reports stop.
    pub fn start_drain(&mut self) {
        if self.draining {
            return;
        }
        self.draining = true;
        if self.first {
            if let Some(ch) = self.server_channel() {
                self.push(ch.transmit(0, &Control::NicBye.to_bytes(0)));
            }
        }
    }

    /// The next datagram to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The oldest event not yet taken, if any.
    pub fn poll_event(&mut self) -> Option<NicEvent> {
        self.events.pop_front()
    }

    /// When [`NicEndpoint::handle_timeout`] is next due. Only the first loop has timers: the
    /// others report when a report falls due while they work.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        if !self.first {
            return None;
        }
        let pairing = {
            let mapped = self.shared.mapped().epoch;
            let link = self.shared.link();
            let behind = self.shared.manifest_wanted.load(Ordering::Acquire)
                > self.shared.manifest_served.load(Ordering::Acquire);
            match &link.pairing {
                Pairing::Paired { epoch, .. } if *epoch == mapped && behind => {
                    Some(self.next_redeploy)
                }
                Pairing::Paired { epoch, .. } if *epoch == mapped => None,
                Pairing::Paired { .. } => Some(self.next_remap),
                _ => Some(link.last_pairing_send + PAIRING_RETRY),
            }
        };
        let report = (!self.draining).then(|| self.shared.next_report.load(Ordering::Relaxed));
        match (pairing, report) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Retries pairing, maps a restarted server's regions (the first loop), and reports load
    /// when due (any loop).
    pub fn handle_timeout(&mut self, now: Nanos) {
        if self.first {
            self.tick(now);
        }
        if !self.draining && now >= self.shared.next_report.load(Ordering::Relaxed) {
            self.report(now);
        }
    }

    /// Work came in: the next report is due within a period, however idle the NIC was.
    fn work_arrived(&mut self, now: Nanos) {
        self.shared.next_report.fetch_min(
            now.saturating_add(self.config.report_every),
            Ordering::Relaxed,
        );
    }

    /// Takes in a datagram from `peer`.
    pub fn handle(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        self.see_epoch();
        match MessageKind::peek(&msg) {
            Some(MessageKind::Sealed) => self.sealed(now, peer, msg),
            Some(MessageKind::Control) if peer == self.config.server => {
                self.pairing_control(now, &msg)
            }
            Some(
                MessageKind::Control
                | MessageKind::Request
                | MessageKind::OneSidedOp
                | MessageKind::Forward,
            ) => self.stats.unauthenticated += 1,
            _ => self.stats.malformed += 1,
        }
    }

    /// Forgets what belonged to the regions of an earlier server start, once this loop
    /// notices that they were mapped anew.
    fn see_epoch(&mut self) {
        let epoch = self.shared.mapped().epoch;
        if epoch != self.seen_epoch {
            self.seen_epoch = epoch;
            self.asked.clear();
            self.dup.clear();
        }
    }

    fn push(&mut self, t: Transmit) {
        self.transmits.push_back(t);
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn start_pairing(&mut self, now: Nanos) {
        let id = self.id();
        let shared = self.shared.clone();
        let mut link = shared.link();
        link.last_pairing_send = now;
        match ClientHandshake::new(
            NIC_TENANT,
            self.config.pairing.clone(),
            &self.config.entropy,
        ) {
            Ok(hs) => {
                link.pairing = Pairing::Hello { hs, id };
                drop(link);
                self.send_pairing(now);
            }
            Err(e) => {
                link.pairing = Pairing::Idle;
                drop(link);
                self.events
                    .push_back(NicEvent::PairingFailed(e.to_string()));
            }
        }
    }

    fn send_pairing(&mut self, now: Nanos) {
        let server = self.config.server;
        let shared = self.shared.clone();
        let mut link = shared.link();
        link.last_pairing_send = now;
        let (id, bytes) = match &link.pairing {
            Pairing::Hello { hs, id } => {
                let mut b = Control::Hello {
                    tenant: hs.tenant().to_string(),
                    nonce: hs.nonce(),
                }
                .to_bytes(*id)
                .to_vec();
                b.resize(b.len().max(HELLO_PADDING), b' ');
                (*id, Bytes::from(b))
            }
            Pairing::Auth { id, auth, .. } => (*id, auth.clone()),
            Pairing::Paired { .. } | Pairing::Idle => return,
        };
        drop(link);
        self.push(Transmit::new(server, id, bytes));
    }

    /// The pairing channel, when paired with the server start the executors were built for.
    fn server_channel(&self) -> Option<Channel> {
        let mapped = self.shared.mapped().epoch;
        match &self.shared.link().pairing {
            Pairing::Paired { sealer, epoch, .. } if *epoch == mapped => Some(Channel {
                to: self.config.server,
                sealer: sealer.clone(),
            }),
            _ => None,
        }
    }

    /// The first loop's timers: pairing retries, and the remap after a server restart.
    fn tick(&mut self, now: Nanos) {
        let mapped = self.shared.mapped().epoch;
        let shared = self.shared.clone();
        let link = shared.link();
        match &link.pairing {
            Pairing::Paired { epoch, .. } if *epoch != mapped => {
                // The server restarted: map its new regions (its manifest may still be
                // being written; try again on the next timeout).
                let epoch = *epoch;
                drop(link);
                if now < self.next_remap {
                    return;
                }
                self.next_remap = now + REMAP_RETRY;
                match self.backend.remap(epoch) {
                    Ok(m) if m.epoch == epoch => {
                        self.shared
                            .manifest_served
                            .store(m.version, Ordering::Release);
                        self.shared
                            .manifest_wanted
                            .store(m.version, Ordering::Release);
                        *self.shared.mapped_mut() = Mapped {
                            epoch,
                            grants: grants_of(&m),
                            sessions: HashMap::new(),
                        };
                        self.see_epoch();
                        self.events.push_back(NicEvent::Remapped { epoch });
                    }
                    Ok(_) => {}
                    Err(e) => self.events.push_back(NicEvent::RemapFailed(e)),
                }
            }
            Pairing::Paired { .. } => {
                drop(link);
                self.take_up_deploys(now);
            }
            _ if now >= link.last_pairing_send + PAIRING_RETRY => {
                let hello = matches!(link.pairing, Pairing::Hello { .. });
                drop(link);
                if hello {
                    self.send_pairing(now);
                } else {
                    // An unanswered auth may have an expired cookie: start again.
                    self.start_pairing(now);
                }
            }
            _ => {}
        }
    }

    /// Serves the handlers of the newest manifest the server announced, when behind it (the
    /// first loop; a failure is tried again after [`REMAP_RETRY`]). The next load report goes
    /// out at once, so that the server forwards the deployed app again soon.
    fn take_up_deploys(&mut self, now: Nanos) {
        let wanted = self.shared.manifest_wanted.load(Ordering::Acquire);
        if wanted <= self.shared.manifest_served.load(Ordering::Acquire) || now < self.next_redeploy
        {
            return;
        }
        self.next_redeploy = now + REMAP_RETRY;
        match self.backend.redeploy(wanted) {
            Ok(v) => {
                self.shared.manifest_served.fetch_max(v, Ordering::AcqRel);
                if v >= wanted {
                    self.shared.next_report.store(now, Ordering::Relaxed);
                    self.shared.link().reported_idle = None;
                    self.events.push_back(NicEvent::Redeployed { version: v });
                }
            }
            Err(e) => self.events.push_back(NicEvent::RedeployFailed(e)),
        }
    }

    /// Reports the load since the last report, and schedules the next: a period away after
    /// work, [`IDLE_REPORT_EVERY`] once an idle report has gone out. Idle reports in between
    /// are skipped (they would say nothing: the counters are since the last report).
    fn report(&mut self, now: Nanos) {
        let Some(ch) = self.server_channel() else {
            self.shared
                .next_report
                .store(now + self.config.report_every, Ordering::Relaxed);
            return;
        };
        // One loop reports at a time; a loop that finds the report already sent leaves it.
        let shared = self.shared.clone();
        let mut link = shared.link();
        if now < shared.next_report.load(Ordering::Relaxed) {
            return;
        }
        let load = self.backend.load_report();
        let idle = load.queue_depth == 0
            && load.dequeues == 0
            && load.busy_ns == 0
            && load.handlers.is_empty();
        let send = match (idle, link.reported_idle) {
            (true, Some(at)) if now < at.saturating_add(IDLE_REPORT_EVERY) => false,
            _ => {
                link.reported_idle = idle.then_some(now);
                true
            }
        };
        let next = match link.reported_idle {
            Some(at) => at.saturating_add(IDLE_REPORT_EVERY),
            None => now + self.config.report_every,
        };
        shared.next_report.store(next, Ordering::Relaxed);
        drop(link);
        if send {
            let id = self.id();
            let m = Control::NicLoad {
                agent: self.config.advertise,
                load,
                manifest: self.shared.manifest_served.load(Ordering::Acquire),
            };
            self.push(ch.transmit(id, &m.to_bytes(id)));
        }
    }

    /// Unsealed messages from the server: the challenge, refusals, and a stale notice.
    fn pairing_control(&mut self, now: Nanos, msg: &Bytes) {
        let Ok((id, c)) = Control::decode(msg) else {
            self.stats.malformed += 1;
            return;
        };
        let shared = self.shared.clone();
        let mut link = shared.link();
        match (c, &link.pairing) {
            (
                Control::Challenge {
                    route,
                    nonce,
                    issued,
                    cookie,
                },
                Pairing::Hello { id: want, .. },
            ) if id == *want => {
                let Pairing::Hello { hs, .. } = std::mem::replace(&mut link.pairing, Pairing::Idle)
                else {
                    return;
                };
                let id = self.id();
                let auth = Control::Auth {
                    tenant: hs.tenant().to_string(),
                    client_nonce: hs.nonce(),
                    server_nonce: nonce,
                    issued,
                    cookie,
                    proof: hs.proof(nonce, &cookie),
                }
                .to_routed_bytes(id, route);
                link.pairing = Pairing::Auth {
                    hs,
                    id,
                    server_nonce: nonce,
                    auth,
                };
                drop(link);
                self.send_pairing(now);
            }
            (Control::Error { message }, Pairing::Hello { id: want, .. })
            | (Control::Error { message }, Pairing::Auth { id: want, .. })
                if id == *want =>
            {
                drop(link);
                self.events.push_back(NicEvent::Refused(message));
            }
            (Control::Stale { session, token, .. }, Pairing::Paired { key, .. })
                if key.session() == session
                    && self.config.pairing.reset_token(session) == token =>
            {
                drop(link);
                self.events.push_back(NicEvent::Unpaired);
                self.start_pairing(now);
            }
            _ => self.stats.unauthenticated += 1,
        }
    }

    fn sealed(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        let Ok(h) = peek_sealed(&msg) else {
            self.stats.malformed += 1;
            return;
        };
        match h.sender {
            Sender::Server if peer == self.config.server => {
                self.work_arrived(now);
                self.server_message(now, msg)
            }
            Sender::Client => {
                self.work_arrived(now);
                self.client_message(now, msg, Some(peer))
            }
            _ => self.stats.unauthenticated += 1,
        }
    }

    /// A sealed message from the server: the welcome, session announcements, forwards.
    fn server_message(&mut self, now: Nanos, msg: Bytes) {
        let shared = self.shared.clone();
        let mut link = shared.link();
        if let Pairing::Auth {
            hs,
            id,
            server_nonce,
            ..
        } = &link.pairing
        {
            let Ok(h) = peek_sealed(&msg) else { return };
            let key = hs
                .session_key(h.session, *server_nonce)
                .with_authentication(self.config.authentication);
            let Ok((_, inner)) = key.open(&msg) else {
                self.stats.unauthenticated += 1;
                return;
            };
            if let Ok((got, Control::Welcome { epoch, .. })) = Control::decode(&inner) {
                if got == *id {
                    let key = Arc::new(key);
                    let mut window = ReplayWindow::default();
                    window.accept(h.packet);
                    link.pairing = Pairing::Paired {
                        sealer: Arc::new(Sealer::new(key.clone(), Sender::Client)),
                        key,
                        window,
                        epoch,
                    };
                    drop(link);
                    self.stats.pairings += 1;
                    self.shared.mapped_mut().sessions.clear();
                    self.events.push_back(NicEvent::Paired { epoch });
                    // A restarted server's regions are mapped at once (by the first loop: the
                    // others leave it to its next timer).
                    if self.first {
                        self.tick(now);
                    }
                }
            }
            return;
        }
        let Pairing::Paired { key, .. } = &link.pairing else {
            return;
        };
        let pairing_key = key.clone();
        drop(link);
        // Opened outside the lock: the server's forwards reach every loop (each its client
        // sessions'), and only the replay window is theirs to share.
        let Ok((h, inner)) = pairing_key.open(&msg) else {
            self.stats.unauthenticated += 1;
            return;
        };
        let accepted = match &mut self.shared.link().pairing {
            // The same pairing still (not one a restarted server made meanwhile).
            Pairing::Paired { key, window, .. } if Arc::ptr_eq(key, &pairing_key) => {
                window.accept(h.packet)
            }
            _ => false,
        };
        if !accepted {
            self.stats.unauthenticated += 1;
            return;
        }
        if MessageKind::peek(&inner) == Some(MessageKind::Batch) {
            // Several forwards (or announcements) the server had ready together.
            match crate::batch::split(&inner) {
                Ok(members) => {
                    for m in members {
                        // Batches do not nest.
                        if MessageKind::peek(&m) == Some(MessageKind::Batch) {
                            self.stats.malformed += 1;
                        } else {
                            self.server_member(now, &pairing_key, m);
                        }
                    }
                }
                Err(_) => self.stats.malformed += 1,
            }
            return;
        }
        self.server_member(now, &pairing_key, inner);
    }

    /// One message of the server's, opened (alone in its envelope, or one of a batch).
    fn server_member(&mut self, now: Nanos, pairing_key: &Arc<SessionKey>, inner: Bytes) {
        match MessageKind::peek(&inner) {
            Some(MessageKind::Forward) => match control::unforward_any(&inner) {
                Ok(control::Forwarded::Sealed(client)) => self.client_message(now, client, None),
                // One request of a client's batch, opened and admitted by the server.
                Ok(control::Forwarded::Member { session, request }) => {
                    match self.shared.session(session) {
                        Some(s) => {
                            if MessageKind::peek(&request) == Some(MessageKind::Request) {
                                self.request(session, &s.ch, &s.apps, request);
                            } else {
                                self.stats.malformed += 1;
                            }
                        }
                        None => {
                            self.stats.unauthenticated += 1;
                            self.ask_about(now, session);
                        }
                    }
                }
                Err(_) => self.stats.malformed += 1,
            },
            Some(MessageKind::Control) => match Control::decode(&inner) {
                Ok((
                    _,
                    Control::SessionOpen {
                        session,
                        tenant_tag,
                        peer,
                        apps,
                        key,
                    },
                )) => {
                    self.asked.remove(&session);
                    let Some(k) = SessionKey::unwrap(pairing_key, session, tenant_tag, &key)
                        .map(|k| k.with_authentication(self.config.authentication))
                    else {
                        self.stats.unauthenticated += 1;
                        return;
                    };
                    let k = Arc::new(k);
                    // This NIC may have sealed under this very key before it restarted: its
                    // packet numbers start at random in [2^61, 2^62), where two starts come
                    // within reach of each other with negligible probability.
                    let Ok(first) = self.config.entropy.u64() else {
                        return;
                    };
                    let first = (first >> 2) | (1 << 61);
                    let mut mapped = self.shared.mapped_mut();
                    let sessions = &mut mapped.sessions;
                    if sessions.len() >= MAX_SESSIONS && !sessions.contains_key(&session) {
                        // The server's idle expiry is the bound that matters; forget any one.
                        if let Some(&old) = sessions.keys().next() {
                            sessions.remove(&old);
                        }
                    }
                    match sessions.get(&session) {
                        // Told again with other apps (an app created for its tenant): the
                        // same session, sealer and replay window, with its apps now.
                        Some(known) if known.apps != apps => {
                            let grown = Arc::new(ClientSession {
                                ch: known.ch.clone(),
                                key: known.key.clone(),
                                apps,
                                window: known.window.clone(),
                            });
                            sessions.insert(session, grown);
                        }
                        Some(_) => {}
                        None => {
                            sessions.insert(
                                session,
                                Arc::new(ClientSession {
                                    ch: Channel {
                                        to: peer,
                                        sealer: Arc::new(Sealer::numbering_from(
                                            k.clone(),
                                            Sender::Nic,
                                            first,
                                        )),
                                    },
                                    key: k,
                                    apps,
                                    window: Arc::new(Mutex::new(ReplayWindow::default())),
                                }),
                            );
                        }
                    }
                }
                Ok((_, Control::SessionClosed { session })) => {
                    self.shared.mapped_mut().sessions.remove(&session);
                }
                Ok((_, Control::ManifestChanged { version })) => {
                    self.shared
                        .manifest_wanted
                        .fetch_max(version, Ordering::AcqRel);
                    if self.first {
                        self.take_up_deploys(now);
                    }
                }
                Ok(_) => {}
                Err(_) => self.stats.malformed += 1,
            },
            _ => self.stats.malformed += 1,
        }
    }

    /// A client's sealed message: `from` its address when it came straight from the client
    /// (the eSwitch's path, one-sided operations: it must be the session's own address),
    /// `None` when the server forwarded it (a one-sided operation inside is then malformed:
    /// the server forwards requests only).
    fn client_message(&mut self, now: Nanos, msg: Bytes, from: Option<SocketAddr>) {
        let Ok(h) = peek_sealed(&msg) else {
            self.stats.malformed += 1;
            return;
        };
        if h.sender != Sender::Client {
            self.stats.unauthenticated += 1;
            return;
        }
        let Some(s) = self.shared.session(h.session) else {
            self.stats.unauthenticated += 1;
            self.ask_about(now, h.session);
            return;
        };
        if from.is_some_and(|peer| peer != s.ch.to) {
            self.stats.unauthenticated += 1;
            return;
        }
        let opened = s.key.open(&msg).ok().filter(|(h, _)| {
            s.window
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .accept(h.packet)
        });
        let Some((_, inner)) = opened else {
            self.stats.unauthenticated += 1;
            return;
        };
        let sid = h.session;
        let members = match MessageKind::peek(&inner) {
            Some(MessageKind::Batch) => match crate::batch::split(&inner) {
                Ok(m) => m,
                Err(_) => {
                    self.stats.malformed += 1;
                    return;
                }
            },
            _ => vec![inner],
        };
        for m in members {
            match MessageKind::peek(&m) {
                Some(MessageKind::Request) => self.request(sid, &s.ch, &s.apps, m),
                Some(MessageKind::OneSidedOp) if from.is_some() => {
                    self.one_sided(sid, &s.ch, &s.apps, m)
                }
                _ => self.stats.malformed += 1,
            }
        }
    }

    /// Asks the server about an unknown session (at most every 100 ms per session).
    fn ask_about(&mut self, now: Nanos, session: u64) {
        let Some(ch) = self.server_channel() else {
            return;
        };
        if self
            .asked
            .get(&session)
            .is_some_and(|t| now.saturating_sub(*t) < PAIRING_RETRY)
        {
            return;
        }
        if self.asked.len() >= MAX_SESSIONS {
            self.asked.clear();
        }
        self.asked.insert(session, now);
        let id = self.id();
        self.push(ch.transmit(id, &Control::QuerySession { session }.to_bytes(id)));
    }

    fn request(&mut self, sid: u64, ch: &Channel, apps: &[u32], inner: Bytes) {
        let admitted = admit(
            inner,
            sid,
            |app| apps.binary_search(&app).is_ok(),
            self.draining,
            "the NIC",
            Placement::Nic,
        );
        let req = match admitted {
            Ok(req) => req,
            Err(no) => {
                let r = no.counted(&mut self.stats.malformed, &mut self.stats.refused);
                self.push(ch.reply(&r));
                return;
            }
        };
        let mut out = Reply::unanswered();
        match self.backend.dispatch(
            req,
            &mut self.sel,
            Some(Placement::Nic),
            ch.clone(),
            &mut out,
        ) {
            Routed::Answered => {
                self.stats.executed += 1;
                self.push(ch.reply(&out));
            }
            Routed::Queued(_) => self.stats.executed += 1,
            Routed::Remote(req) => {
                self.stats.refused += 1;
                let why = "this NIC has no executors".to_string();
                let r = error_reply(&req, Status::Unavailable, Placement::Nic, why);
                self.push(ch.reply(&r));
            }
            Routed::Refused(r) => {
                self.stats.refused += 1;
                self.push(ch.reply(&r));
            }
        }
    }

    fn one_sided(&mut self, sid: u64, ch: &Channel, apps: &[u32], inner: Bytes) {
        let op = match Operation::decode(inner) {
            Ok(op) => op,
            Err(e) => {
                self.stats.malformed += 1;
                let c = Completion::error(0, 0, Status::Malformed, e.to_string());
                self.push(ch.transmit(0, &c.to_bytes()));
                return;
            }
        };
        let deny = |status, why: String| Completion::error(op.app, op.id, status, why);
        // The session's grants, not only the rkey: its own apps, with the rights the app
        // grants to clients.
        let mapped = self.shared.mapped();
        let grants = &mapped.grants;
        let refusal = if apps.binary_search(&op.app).is_err() {
            Some(deny(
                Status::UnknownApp,
                format!("no app {} in this session", op.app),
            ))
        } else {
            op.op
                .targets()
                .into_iter()
                .find_map(|(rkey, need)| match grants.get(&(op.app, rkey)) {
                    None => Some(deny(
                        Status::BadKey,
                        format!("no region with rkey {rkey:#x} in app {}", op.app),
                    )),
                    Some(have) if have & need != need => Some(deny(
                        Status::AccessDenied,
                        format!(
                            "clients have rights {} on this region, the operation needs {} \
                             (the app's config grants clients no one-sided writes: \
                             client_writes = true)",
                            naam_ebpf::abi::Rights(*have),
                            naam_ebpf::abi::Rights(need)
                        ),
                    )),
                    Some(_) => None,
                })
        };
        drop(mapped);
        if let Some(c) = refusal {
            self.stats.refused += 1;
            self.push(ch.transmit(op.id, &c.to_bytes()));
            return;
        }
        let key = (sid, op.id);
        if op.op.mutates() {
            if let Some(answer) = self.dup.get(&key) {
                self.stats.duplicates += 1;
                let t = ch.transmit(op.id, answer);
                self.push(t);
                return;
            }
        }
        self.stats.one_sided += 1;
        let answer = self.backend.one_sided(&op).to_bytes();
        self.push(ch.transmit(op.id, &answer));
        if op.op.mutates() {
            self.dup.insert(key, answer);
        }
    }
}
