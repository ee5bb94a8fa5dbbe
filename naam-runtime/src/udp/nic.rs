//! The NIC side of the UDP fabric: the driver loop of `naam-nic`. It runs on the NIC's own
//! cores: forwarded (or switch-redirected) requests go to the NIC executors, which reply to the
//! client directly; one-sided operations are served by this loop itself, the one-sided agent
//! (never by host executor threads); and every period it reports its load to the server.
//!
//! The NIC pairs with naam-server through its pairing secret (a session of tenant
//! [`session::NIC_TENANT`]). The server announces every client session to it with the session
//! key encrypted under the pairing session, so the NIC checks each client's seal, scope and
//! one-sided rights itself and answers only the session's own address; forwarded requests are
//! taken only in the pairing session. When the server restarts (a new epoch) the NIC pairs
//! again, maps the new regions and forgets the old sessions, with no manual step.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::control::{self, Control, Manifest, KIND_CONTROL, KIND_FORWARD};
use super::server::{malformed, Channel, Replies};
use super::socket::Socket;
use crate::cluster::{Cluster, Dispatch};
use crate::onesided::{self, KIND_OP};
use crate::placement::Placement;
use crate::session::{
    self, peek_sealed, ClientHandshake, Credential, ReplayWindow, Sealer, Sender, SessionKey,
    KIND_SEALED,
};
use crate::steering::Selector;
use crate::wire::{peek_kind, Request, Status, KIND_REQUEST};
use naam_proto::dedup::RecentAnswers;

/// Counters of a NIC driver.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct NicStats {
    /// Requests run by the NIC executors.
    pub executed: u64,
    /// One-sided operations served.
    pub one_sided: u64,
    /// Retransmitted one-sided writes answered from the duplicate cache.
    pub duplicates: u64,
    /// Messages that did not decode.
    pub malformed: u64,
    /// Requests refused (busy, shutting down, outside the session's scope or rights).
    pub refused: u64,
    /// Messages dropped unopened: not sealed, a bad tag, a replay, another address, a
    /// forward from anyone but the paired server.
    pub unauthenticated: u64,
    /// Pairings with the server (more than one: the server restarted).
    pub pairings: u64,
}

/// How the NIC driver behaves.
#[derive(Clone, Debug)]
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
    /// ([`crate::session::Authentication`]); it must match the server's.
    pub authentication: crate::session::Authentication,
    /// Where replies and counters are recorded for `--metrics`.
    pub telemetry: std::sync::Arc<super::telemetry::Telemetry>,
}

impl NicStats {
    /// The counters as `(name, help, value)` for [`super::telemetry::Telemetry`].
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
                "refused",
                "Requests refused (busy, shutting down, out of scope).",
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

/// The NIC's executors and the manifest they were built from.
pub struct NicCluster {
    /// The executors, with the server's regions mapped.
    pub cluster: Arc<Cluster>,
    /// The manifest (its epoch says which server start it belongs to).
    pub manifest: Manifest,
}

/// A client session the server announced.
struct ClientSession {
    key: Arc<SessionKey>,
    ch: Channel,
    apps: Vec<u32>,
    window: ReplayWindow,
}

/// Where pairing stands.
enum Pairing {
    /// Not started, or a handshake could not be made (no randomness): retried on the tick.
    Idle,
    /// Hello sent (or to be sent).
    Hello { hs: ClientHandshake, id: u64 },
    /// Auth sent: waiting for the welcome.
    Auth {
        hs: ClientHandshake,
        id: u64,
        server_nonce: [u8; 32],
        auth: Bytes,
    },
    /// Paired in server epoch `epoch`.
    Paired {
        key: Arc<SessionKey>,
        sealer: Arc<Sealer>,
        window: ReplayWindow,
        epoch: u64,
    },
}

/// Sessions the NIC holds at most (the server's own limit is per tenant).
const MAX_SESSIONS: usize = 1 << 16;
/// How often a pairing message is resent while unanswered.
const PAIRING_RETRY: Duration = Duration::from_millis(100);

struct Nic<'a> {
    current: NicCluster,
    /// `(app, rkey)` → the rights clients have there.
    grants: HashMap<(u32, u64), u32>,
    options: &'a NicOptions,
    replies: Replies,
    stats: NicStats,
    sel: Selector,
    /// Answers to mutating one-sided operations by (session, operation id).
    dup: RecentAnswers<(u64, u64), Bytes>,
    sessions: HashMap<u64, ClientSession>,
    /// Sessions asked about, and when.
    asked: HashMap<u64, Instant>,
    pairing: Pairing,
    last_pairing_send: Instant,
    next_id: u64,
    draining: bool,
}

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

impl Nic<'_> {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn start_pairing(&mut self) {
        match ClientHandshake::new(session::NIC_TENANT, self.options.pairing.clone()) {
            Ok(hs) => {
                let id = self.id();
                self.pairing = Pairing::Hello { hs, id };
                self.send_pairing();
            }
            Err(e) => {
                tracing::warn!("pairing: {e}");
                self.pairing = Pairing::Idle;
                self.last_pairing_send = Instant::now();
            }
        }
    }

    fn send_pairing(&mut self) {
        self.last_pairing_send = Instant::now();
        let server = self.options.server;
        match &self.pairing {
            Pairing::Hello { hs, id } => {
                let mut b = Control::Hello {
                    tenant: hs.tenant().to_string(),
                    nonce: hs.nonce(),
                }
                .to_bytes(*id)
                .to_vec();
                b.resize(b.len().max(session::HELLO_PADDING), b' ');
                self.replies.send_bytes(server, *id, &b);
            }
            Pairing::Auth { id, auth, .. } => self.replies.send_bytes(server, *id, auth),
            Pairing::Paired { .. } | Pairing::Idle => {}
        }
    }

    /// The pairing channel, when paired with the epoch the executors were built for.
    fn server_channel(&self) -> Option<Channel> {
        match &self.pairing {
            Pairing::Paired { sealer, epoch, .. } if *epoch == self.current.manifest.epoch => {
                Some(Channel {
                    to: self.options.server,
                    sealer: sealer.clone(),
                })
            }
            _ => None,
        }
    }

    fn tick(&mut self, remap: &mut dyn FnMut(u64) -> Result<NicCluster, String>) {
        match &self.pairing {
            Pairing::Paired { epoch, .. } if *epoch != self.current.manifest.epoch => {
                // The server restarted: map its new regions (its manifest may still be
                // being written; try again next tick).
                let epoch = *epoch;
                match remap(epoch) {
                    Ok(c) if c.manifest.epoch == epoch => {
                        self.grants = grants_of(&c.manifest);
                        let old = std::mem::replace(&mut self.current, c);
                        drop(old);
                        self.sessions.clear();
                        self.asked.clear();
                        self.dup.clear();
                        tracing::info!(
                            "the server restarted (epoch {epoch:#x}): regions mapped anew"
                        );
                    }
                    Ok(_) => {}
                    Err(e) => tracing::error!("mapping the restarted server's regions: {e}"),
                }
            }
            Pairing::Paired { .. } => {}
            _ if self.last_pairing_send.elapsed() >= PAIRING_RETRY => {
                if let Pairing::Hello { .. } = self.pairing {
                    self.send_pairing();
                } else {
                    // An unanswered auth may have an expired cookie: start again.
                    self.start_pairing();
                }
            }
            _ => {}
        }
    }

    fn report(&mut self) {
        if let Some(ch) = self.server_channel() {
            let id = self.id();
            let m = Control::NicLoad {
                agent: self.options.advertise,
                load: self.current.cluster.take_load_report(Placement::Nic),
            };
            self.replies.sealed(&ch, id, &m.to_bytes(id));
        }
    }

    fn handle(&mut self, peer: SocketAddr, msg: Bytes) {
        match peek_kind(&msg) {
            Some(KIND_SEALED) => self.sealed(peer, msg),
            Some(KIND_CONTROL) if peer == self.options.server => self.pairing_control(&msg),
            Some(KIND_CONTROL) | Some(KIND_REQUEST) | Some(KIND_OP) | Some(KIND_FORWARD) => {
                self.stats.unauthenticated += 1
            }
            _ => self.stats.malformed += 1,
        }
    }

    /// Unsealed messages from the server: the challenge, refusals, and a stale notice.
    fn pairing_control(&mut self, msg: &Bytes) {
        let Ok((id, c)) = Control::decode(msg) else {
            self.stats.malformed += 1;
            return;
        };
        match (c, &self.pairing) {
            (
                Control::Challenge {
                    nonce,
                    issued,
                    cookie,
                },
                Pairing::Hello { id: want, .. },
            ) if id == *want => {
                let Pairing::Hello { hs, .. } = std::mem::replace(&mut self.pairing, Pairing::Idle)
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
                .to_bytes(id);
                self.pairing = Pairing::Auth {
                    hs,
                    id,
                    server_nonce: nonce,
                    auth,
                };
                self.send_pairing();
            }
            (Control::Error { message }, Pairing::Hello { id: want, .. })
            | (Control::Error { message }, Pairing::Auth { id: want, .. })
                if id == *want =>
            {
                tracing::warn!("the server refused pairing: {message}");
            }
            (Control::Stale { session, token, .. }, Pairing::Paired { key, .. })
                if key.session() == session
                    && self.options.pairing.reset_token(session) == token =>
            {
                tracing::info!("the server does not know this NIC any more: pairing again");
                self.start_pairing();
            }
            _ => self.stats.unauthenticated += 1,
        }
    }

    fn sealed(&mut self, peer: SocketAddr, msg: Bytes) {
        let Ok(h) = peek_sealed(&msg) else {
            self.stats.malformed += 1;
            return;
        };
        match h.sender {
            Sender::Server if peer == self.options.server => self.server_message(msg),
            Sender::Client => self.client_message(peer, msg),
            _ => self.stats.unauthenticated += 1,
        }
    }

    /// A sealed message from the server: the welcome, session announcements, forwards.
    fn server_message(&mut self, msg: Bytes) {
        if let Pairing::Auth {
            hs,
            id,
            server_nonce,
            ..
        } = &self.pairing
        {
            let Ok(h) = peek_sealed(&msg) else { return };
            let key = hs
                .session_key(h.session, *server_nonce)
                .with_authentication(self.options.authentication);
            let Ok((_, inner)) = key.open(&msg) else {
                self.stats.unauthenticated += 1;
                return;
            };
            if let Ok((got, Control::Welcome { epoch, .. })) = Control::decode(&inner) {
                if got == *id {
                    let key = Arc::new(key);
                    let mut window = ReplayWindow::default();
                    window.accept(h.packet);
                    self.pairing = Pairing::Paired {
                        sealer: Arc::new(Sealer::new(key.clone(), Sender::Client)),
                        key,
                        window,
                        epoch,
                    };
                    self.stats.pairings += 1;
                    self.sessions.clear();
                    tracing::info!(
                        "paired with naam-server at {} (epoch {epoch:#x})",
                        self.options.server
                    );
                }
            }
            return;
        }
        let Pairing::Paired { key, window, .. } = &mut self.pairing else {
            return;
        };
        let inner = match key.open(&msg) {
            Ok((h, inner)) if window.accept(h.packet) => inner,
            _ => {
                self.stats.unauthenticated += 1;
                return;
            }
        };
        let pairing_key = key.clone();
        match peek_kind(&inner) {
            Some(KIND_FORWARD) => match control::unforward(&inner) {
                Ok(client) => self.client_message_checked(client, true),
                Err(_) => self.stats.malformed += 1,
            },
            Some(KIND_CONTROL) => match Control::decode(&inner) {
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
                    let Some(k) = SessionKey::unwrap(&pairing_key, session, tenant_tag, &key)
                        .map(|k| k.with_authentication(self.options.authentication))
                    else {
                        self.stats.unauthenticated += 1;
                        return;
                    };
                    if self.sessions.len() >= MAX_SESSIONS && !self.sessions.contains_key(&session)
                    {
                        // The server's idle expiry is the bound that matters; forget any one.
                        if let Some(&old) = self.sessions.keys().next() {
                            self.sessions.remove(&old);
                        }
                    }
                    let k = Arc::new(k);
                    self.sessions.entry(session).or_insert(ClientSession {
                        ch: Channel {
                            to: peer,
                            sealer: Arc::new(Sealer::new(k.clone(), Sender::Nic)),
                        },
                        key: k,
                        apps,
                        window: ReplayWindow::default(),
                    });
                }
                Ok((_, Control::SessionClosed { session })) => {
                    self.sessions.remove(&session);
                }
                Ok(_) => {}
                Err(_) => self.stats.malformed += 1,
            },
            _ => self.stats.malformed += 1,
        }
    }

    fn client_message(&mut self, peer: SocketAddr, msg: Bytes) {
        // Straight from a client (the eSwitch's path, one-sided operations): the datagram
        // must come from the session's own address.
        let Ok(h) = peek_sealed(&msg) else { return };
        if let Some(s) = self.sessions.get(&h.session) {
            if s.ch.to != peer {
                self.stats.unauthenticated += 1;
                return;
            }
        }
        self.client_message_checked(msg, false)
    }

    fn client_message_checked(&mut self, msg: Bytes, forwarded: bool) {
        let Ok(h) = peek_sealed(&msg) else {
            self.stats.malformed += 1;
            return;
        };
        if h.sender != Sender::Client {
            self.stats.unauthenticated += 1;
            return;
        }
        let Some(s) = self.sessions.get_mut(&h.session) else {
            self.stats.unauthenticated += 1;
            self.ask_about(h.session);
            return;
        };
        let inner = match s.key.open(&msg) {
            Ok((h, inner)) if s.window.accept(h.packet) => inner,
            _ => {
                self.stats.unauthenticated += 1;
                return;
            }
        };
        let (sid, ch, apps) = (h.session, s.ch.clone(), s.apps.clone());
        match peek_kind(&inner) {
            Some(KIND_REQUEST) => self.request(sid, &ch, &apps, inner),
            Some(KIND_OP) if !forwarded => self.one_sided(sid, &ch, &apps, inner),
            _ => self.stats.malformed += 1,
        }
    }

    /// Asks the server about an unknown session (at most every 100 ms per session).
    fn ask_about(&mut self, session: u64) {
        let Some(ch) = self.server_channel() else {
            return;
        };
        if self
            .asked
            .get(&session)
            .is_some_and(|t| t.elapsed() < PAIRING_RETRY)
        {
            return;
        }
        if self.asked.len() >= MAX_SESSIONS {
            self.asked.clear();
        }
        self.asked.insert(session, Instant::now());
        let id = self.id();
        self.replies
            .sealed(&ch, id, &Control::QuerySession { session }.to_bytes(id));
    }

    fn request(&mut self, sid: u64, ch: &Channel, apps: &[u32], inner: Bytes) {
        let mut req = match Request::decode(inner) {
            Ok(r) => r,
            Err(e) => {
                self.stats.malformed += 1;
                self.replies
                    .reply(ch, &malformed(0, 0, Placement::Nic, e.to_string()));
                return;
            }
        };
        req.origin = sid;
        let refuse =
            |status, why: String| crate::cluster::error_reply(&req, status, Placement::Nic, why);
        if !apps.contains(&req.app) {
            self.stats.refused += 1;
            let r = refuse(
                Status::UnknownApp,
                format!("no app {} in this session", req.app),
            );
            self.replies.reply(ch, &r);
            return;
        }
        if self.draining {
            self.stats.refused += 1;
            let r = refuse(Status::Unavailable, "the NIC is shutting down".into());
            self.replies.reply(ch, &r);
            return;
        }
        let cluster = self.current.cluster.clone();
        match self.replies.dispatch(
            &cluster,
            req,
            &mut self.sel,
            Some(Placement::Nic),
            ch.clone(),
        ) {
            Dispatch::Queued(_) => self.stats.executed += 1,
            Dispatch::Remote(req) => {
                self.stats.refused += 1;
                let r = crate::cluster::error_reply(
                    &req,
                    Status::Unavailable,
                    Placement::Nic,
                    "this NIC has no executors".into(),
                );
                self.replies.reply(ch, &r);
            }
            Dispatch::Refused(r) => {
                self.stats.refused += 1;
                self.replies.reply(ch, &r);
            }
        }
    }

    fn one_sided(&mut self, sid: u64, ch: &Channel, apps: &[u32], inner: Bytes) {
        let op = match onesided::Operation::decode(inner) {
            Ok(op) => op,
            Err(e) => {
                self.stats.malformed += 1;
                let c = onesided::Completion::error(0, 0, Status::Malformed, e.to_string());
                self.replies.sealed(ch, 0, &c.to_bytes());
                return;
            }
        };
        let deny = |status, why: String| onesided::Completion::error(op.app, op.id, status, why);
        // The session's grants, not only the rkey: its own apps, with the rights the app
        // grants to clients.
        let refusal = if !apps.contains(&op.app) {
            Some(deny(
                Status::UnknownApp,
                format!("no app {} in this session", op.app),
            ))
        } else {
            op.op.targets().into_iter().find_map(|(rkey, need)| {
                match self.grants.get(&(op.app, rkey)) {
                    None => Some(deny(
                        Status::BadKey,
                        format!("no region with rkey {rkey:#x} in app {}", op.app),
                    )),
                    Some(have) if have & need != need => Some(deny(
                        Status::AccessDenied,
                        format!(
                            "clients have rights {have:#x} on this region, the operation needs \
                             {need:#x} (the app's config grants clients no one-sided writes)"
                        ),
                    )),
                    Some(_) => None,
                }
            })
        };
        if let Some(c) = refusal {
            self.stats.refused += 1;
            self.replies.sealed(ch, op.id, &c.to_bytes());
            return;
        }
        let key = (sid, op.id);
        if op.op.mutates() {
            if let Some(answer) = self.dup.get(&key) {
                self.stats.duplicates += 1;
                let a = answer.clone();
                self.replies.sealed(ch, op.id, &a);
                return;
            }
        }
        self.stats.one_sided += 1;
        let answer = onesided::execute(self.current.cluster.regions(), &op).to_bytes();
        self.replies.sealed(ch, op.id, &answer);
        if op.op.mutates() {
            self.dup.insert(key, answer);
        }
    }
}

/// Runs the NIC driver until `stop` is set; then says goodbye to the server (which stops
/// forwarding) and drains queued work. `remap` maps the regions of a restarted server's
/// manifest for epoch `epoch`.
pub fn serve_nic(
    start: NicCluster,
    mut socket: Socket,
    options: NicOptions,
    stop: &AtomicBool,
    remap: &mut dyn FnMut(u64) -> Result<NicCluster, String>,
) -> std::io::Result<NicStats> {
    options
        .authentication
        .check_scope(socket.local_addr()?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut nic = Nic {
        grants: grants_of(&start.manifest),
        current: start,
        options: &options,
        replies: Replies::new(socket.sender()?, options.telemetry.clone()),
        stats: NicStats::default(),
        sel: Selector::default(),
        dup: RecentAnswers::default(),
        sessions: HashMap::new(),
        asked: HashMap::new(),
        pairing: Pairing::Idle,
        last_pairing_send: Instant::now(),
        next_id: 0,
        draining: false,
    };
    nic.start_pairing();
    let mut next_report = Instant::now();
    let mut drain_deadline: Option<Instant> = None;
    loop {
        if stop.load(Ordering::SeqCst) && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
            nic.draining = true;
            if let Some(ch) = nic.server_channel() {
                nic.replies.sealed(&ch, 0, &Control::NicBye.to_bytes(0));
            }
        }
        if let Some(d) = drain_deadline {
            if nic.replies.idle() || Instant::now() >= d {
                return Ok(nic.stats);
            }
        }
        nic.tick(remap);
        if drain_deadline.is_none() && Instant::now() >= next_report {
            next_report = Instant::now() + options.report_every;
            options.telemetry.publish_counters(nic.stats.counters());
            nic.report();
        }
        let wait = next_report
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(1));
        for (peer, msg) in socket.recv(wait)? {
            nic.handle(peer, msg);
        }
    }
}
