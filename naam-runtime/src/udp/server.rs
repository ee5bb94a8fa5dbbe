//! The host side of the UDP fabric: the driver loop of `naam-server`. It receives messages in
//! batches, acts as the user-space switch (reads routed to the NIC are forwarded to `naam-nic`,
//! which answers the client directly; everything else is queued at the host executors, whose
//! threads send the replies), answers control queries, and takes in the NIC's load reports.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::control::{self, AppManifest, Control, HandlerWeights, Manifest, KIND_CONTROL};
use super::socket::Socket;
use crate::clock::{Clock, Nanos, SystemClock};
use crate::cluster::{Cluster, Dispatch};
use crate::onesided::{self, KIND_OP};
use crate::placement::Placement;
use crate::session::{
    self, CookieJar, Gatekeeper, HandshakeNonces, Role, SealError, Sealer, TenantEntry, KIND_SEALED,
};
use crate::steering::RemoteLoad;
use crate::steering::Selector;
use crate::wire::{peek_kind, LoadFeedback, Reply, Request, Status, KIND_REQUEST};
use naam_proto::frame;

/// Counters of a server driver.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ServerStats {
    /// Requests queued at host executors.
    pub host: u64,
    /// Requests forwarded to the NIC.
    pub forwarded: u64,
    /// Requests refused by the switch (unknown handler, busy, shutting down).
    pub refused: u64,
    /// Messages that did not decode.
    pub malformed: u64,
    /// Control messages answered.
    pub control: u64,
    /// Sessions set up.
    pub sessions: u64,
    /// Messages dropped unopened: a bad tag, a replay, another address, or sent outside a
    /// session.
    pub unauthenticated: u64,
    /// Answers to peers that had not proved their address left unsent because they were over
    /// the amplification limit.
    pub amplification_drops: u64,
}

pub use super::control::SwitchCounters;

/// A switch ahead of this driver (the XDP eSwitch) that already split server-bound messages
/// between host and NIC: what arrives here is for the host.
pub trait SwitchHandle: Send + Sync {
    /// What it is, for logs and answers.
    fn describe(&self) -> String;
    /// Its counters.
    fn counters(&self) -> Result<SwitchCounters, String>;
    /// Pins the NIC share of every read handler (per mille), or returns to the weights.
    fn pin_nic_share(&self, permille: Option<u32>);
}

/// The RDMA side of a server (the `verbs` backend): connects one queue pair per peer.
pub trait VerbsAcceptor: Send + Sync {
    /// Connects a queue pair to `peer`'s `remote` endpoint; returns ours and the regions.
    fn accept(
        &self,
        peer: SocketAddr,
        remote: &super::control::QpEndpoint,
    ) -> Result<(super::control::QpEndpoint, Vec<super::control::RdmaRegion>), String>;
}

/// How the server driver behaves.
#[derive(Clone)]
pub struct ServerOptions {
    /// The manifest handed to clients.
    pub manifest: Manifest,
    /// How long SIGTERM waits for queued work to finish.
    pub drain: Duration,
    /// A switch in front of this driver; `None`: this driver is the (user-space) switch.
    pub switch: Option<Arc<dyn SwitchHandle>>,
    /// The RDMA verbs side, when the server has a device.
    pub verbs: Option<Arc<dyn VerbsAcceptor>>,
    /// Whether [`Control::Congest`] may slow the host executors down (experiments on a
    /// testbed; only the operator's session may ask even then).
    pub congestion_control: bool,
    /// The credentials sessions are set up with ([`session::tenant_entries`]): every app's,
    /// the operator's and the NIC's pairing secret.
    pub tenants: Vec<TenantEntry>,
    /// Datagram authentication: on, except in a loopback measurement of its cost
    /// ([`session::Authentication`]).
    pub authentication: session::Authentication,
    /// Where replies and counters are recorded for `--metrics`.
    pub telemetry: Arc<super::telemetry::Telemetry>,
}

impl ServerStats {
    /// The counters as `(name, help, value)` for [`super::telemetry::Telemetry`].
    pub fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            (
                "host_queued",
                "Requests queued at host executors.",
                self.host,
            ),
            (
                "forwarded_to_nic",
                "Requests forwarded to the NIC.",
                self.forwarded,
            ),
            (
                "refused",
                "Requests refused (unknown handler, busy, shutting down).",
                self.refused,
            ),
            ("malformed", "Messages that did not decode.", self.malformed),
            ("control", "Control messages answered.", self.control),
            ("sessions", "Sessions set up.", self.sessions),
            (
                "unauthenticated",
                "Messages dropped unopened (bad tag, replay, no session).",
                self.unauthenticated,
            ),
            (
                "amplification_drops",
                "Answers to unproven peers left unsent.",
                self.amplification_drops,
            ),
        ]
    }
}

/// A malformed-request reply (request id 0 when it could not be read).
pub(crate) fn malformed(app: u32, id: u64, placement: Placement, why: String) -> Reply {
    Reply {
        app,
        request_id: id,
        status: Status::Malformed,
        code: 0,
        steps: 0,
        placement,
        load: LoadFeedback::default(),
        payload: Bytes::from(why.into_bytes()),
    }
}

/// Where the answers of one session go: its address, sealed with its key.
#[derive(Clone, Debug)]
pub(crate) struct Channel {
    pub(crate) to: SocketAddr,
    pub(crate) sealer: Arc<Sealer>,
}

/// How a driver answers requests: replies go out on `sender`, and every request queued at an
/// executor counts as in flight until its reply is sent (SIGTERM drains until none is).
pub(crate) struct Replies {
    sender: Arc<super::socket::Sender>,
    inflight: Arc<AtomicU64>,
    telemetry: Arc<super::telemetry::Telemetry>,
}

impl Replies {
    pub(crate) fn new(
        sender: super::socket::Sender,
        telemetry: Arc<super::telemetry::Telemetry>,
    ) -> Replies {
        Replies {
            sender: Arc::new(sender),
            inflight: Arc::new(AtomicU64::new(0)),
            telemetry,
        }
    }

    /// Sends `r` on `ch` (a lost reply is the client's retransmission to repair).
    pub(crate) fn reply(&self, ch: &Channel, r: &Reply) {
        self.sealed(ch, r.request_id, &r.to_bytes().unwrap_or_default());
    }

    /// Seals `bytes` in `ch`'s session and sends them to its address.
    pub(crate) fn sealed(&self, ch: &Channel, id: u64, bytes: &[u8]) {
        let _ = self.sender.send(ch.to, id, &ch.sealer.seal(bytes));
    }

    /// Sends raw message bytes (forwarded requests, control answers, completions).
    pub(crate) fn send_bytes(&self, to: SocketAddr, id: u64, bytes: &[u8]) {
        let _ = self.sender.send(to, id, bytes);
    }

    /// Dispatches `req` on `cluster`; a queued request's reply goes out sealed on `ch` from
    /// the executor.
    pub(crate) fn dispatch(
        &self,
        cluster: &Cluster,
        req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        ch: Channel,
    ) -> Dispatch {
        let (s, n, t) = (
            self.sender.clone(),
            self.inflight.clone(),
            self.telemetry.clone(),
        );
        n.fetch_add(1, Ordering::SeqCst);
        let (app, handler, arrived) = (req.app, req.handler, Instant::now());
        let d = cluster.dispatch(req, sel, forced, move |r: Reply| {
            if let Ok(b) = r.to_bytes() {
                let _ = s.send(ch.to, r.request_id, &ch.sealer.seal(&b));
            }
            let service = arrived.elapsed().as_nanos() as u64;
            t.record(app, handler, r.placement, r.status, service);
            n.fetch_sub(1, Ordering::SeqCst);
        });
        if !matches!(d, Dispatch::Queued(_)) {
            self.inflight.fetch_sub(1, Ordering::SeqCst);
        }
        d
    }

    /// Whether every queued request has been answered.
    pub(crate) fn idle(&self) -> bool {
        self.inflight.load(Ordering::SeqCst) == 0
    }
}

/// The longest time a load report may state (a minute), nanoseconds.
const MAX_REPORTED_NS: f64 = 60e9;

/// Whether a client's load report is within the ranges a real client produces: no negative,
/// infinite or absurd figures (a report moves steering only within them).
pub(crate) fn plausible_load(r: &RemoteLoad) -> bool {
    let ok_ns = |x: f64| x.is_finite() && (0.0..=MAX_REPORTED_NS).contains(&x);
    r.executors <= 1024
        && r.handlers.len() <= 4096
        && ok_ns(r.queue_delay_ns)
        && r.handlers.iter().all(|h| {
            ok_ns(h.service_ns) && h.steps.is_finite() && (0.0..=1024.0).contains(&h.steps)
        })
}

/// The host driver's state between datagrams.
struct Host<'a> {
    cluster: Arc<Cluster>,
    options: &'a ServerOptions,
    replies: Replies,
    gate: Gatekeeper,
    /// Manifest pages per tenant name (each tenant sees its own apps).
    pages: std::collections::HashMap<String, Vec<Vec<AppManifest>>>,
    head: Manifest,
    stats: ServerStats,
    /// The paired NIC: its session and where it takes forwarded requests.
    nic: Option<(u64, SocketAddr)>,
    switch: Selector,
    draining: bool,
    /// Per session: its own view of the Client placement, fed by its own load reports.
    shares: std::collections::HashMap<u64, crate::steering::ClientShare>,
}

/// Bytes of a whole datagram carrying a `message`-byte message in one fragment.
fn datagram_len(message: usize) -> usize {
    frame::HEADER + message
}

impl Host<'_> {
    /// Sends an unsealed answer to a peer that has not proved its address, if it is within
    /// the amplification limit of what the peer sent.
    fn send_unproven(&mut self, peer: SocketAddr, received: usize, id: u64, bytes: &[u8]) {
        if session::within_amplification(datagram_len(received), datagram_len(bytes.len())) {
            self.replies.send_bytes(peer, id, bytes);
        } else {
            self.stats.amplification_drops += 1;
        }
    }

    fn handle(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        match peek_kind(&msg) {
            Some(KIND_SEALED) => self.sealed(now, peer, &msg),
            Some(KIND_CONTROL) => self.unsealed_control(now, peer, &msg),
            Some(KIND_REQUEST) => {
                self.stats.unauthenticated += 1;
                let id = Request::decode(msg.clone()).map_or(0, |r| r.request_id);
                let r = Reply {
                    status: Status::NoSession,
                    ..malformed(0, id, Placement::Host, "no session: handshake first".into())
                };
                self.send_unproven(peer, msg.len(), id, &r.to_bytes().unwrap_or_default());
            }
            Some(KIND_OP) => {
                self.stats.unauthenticated += 1;
                if let Ok(op) = onesided::Operation::decode(msg.clone()) {
                    let c = onesided::Completion::error(
                        op.app,
                        op.id,
                        Status::NoSession,
                        "no session: handshake first",
                    );
                    self.send_unproven(peer, msg.len(), op.id, &c.to_bytes());
                }
            }
            _ => self.stats.malformed += 1,
        }
    }

    /// Hello and Auth: the only control messages taken outside a session.
    fn unsealed_control(&mut self, now: Nanos, peer: SocketAddr, msg: &Bytes) {
        self.stats.control += 1;
        let (id, c) = match Control::decode(msg) {
            Ok(x) => x,
            Err(e) => {
                self.stats.malformed += 1;
                let m = Control::Error {
                    message: format!("malformed control message: {e}"),
                };
                self.send_unproven(peer, msg.len(), 0, &m.to_bytes(0));
                return;
            }
        };
        let answer = match c {
            Control::Hello { nonce, .. } => match self.gate.challenge(now, peer, nonce) {
                Ok((server, cookie)) => Control::Challenge {
                    nonce: server,
                    issued: now,
                    cookie,
                },
                Err(e) => Control::Error {
                    message: e.to_string(),
                },
            },
            Control::Auth {
                tenant,
                client_nonce,
                server_nonce,
                issued,
                cookie,
                proof,
            } => {
                let n = HandshakeNonces {
                    client: client_nonce,
                    server: server_nonce,
                };
                let before = self.gate.len();
                match self
                    .gate
                    .authenticate(now, peer, &tenant, &n, issued, &cookie, &proof)
                {
                    Ok(s) => {
                        let (sid, role, sealer) = (s.id, s.role.clone(), s.sealer.clone());
                        if self.gate.len() > before {
                            self.stats.sessions += 1;
                            self.announce(sid);
                        }
                        self.welcome(id, sid, &role, Channel { to: peer, sealer });
                        return;
                    }
                    Err(e) => Control::Error {
                        message: e.to_string(),
                    },
                }
            }
            _ => {
                self.stats.unauthenticated += 1;
                Control::Error {
                    message: "no session: handshake first".into(),
                }
            }
        };
        self.send_unproven(peer, msg.len(), id, &answer.to_bytes(id));
    }

    /// The welcome of a new session: its first manifest page.
    fn welcome(&mut self, id: u64, session: u64, role: &Role, ch: Channel) {
        let (apps, pages) = match role {
            Role::Tenant { name, .. } => match self.pages.get(name) {
                Some(p) => (p[0].clone(), p.len() as u32),
                None => (Vec::new(), 1),
            },
            _ => (Vec::new(), 1),
        };
        let w = Control::Welcome {
            session,
            epoch: self.gate.epoch(),
            client_id: self.cluster.next_client_id(),
            manifest: Manifest {
                apps,
                ..self.head.clone()
            },
            pages,
            agent: self.agent(),
        };
        self.replies.sealed(&ch, id, &w.to_bytes(id));
    }

    fn agent(&self) -> Option<SocketAddr> {
        self.nic
            .filter(|_| self.cluster.remote_nic_up())
            .map(|(_, a)| a)
    }

    /// The NIC's channel, when one is paired.
    fn nic_channel(&self) -> Option<Channel> {
        let (sid, _) = self.nic?;
        let s = self.gate.session(sid)?;
        Some(Channel {
            to: s.peer,
            sealer: s.sealer.clone(),
        })
    }

    /// Tells the paired NIC about tenant session `sid` (or that it is gone).
    fn announce(&mut self, sid: u64) {
        let Some(nic) = self.nic_channel() else {
            return;
        };
        let m = match self.gate.session(sid) {
            Some(s) => match &*s.role {
                Role::Tenant { apps, .. } => Control::SessionOpen {
                    session: sid,
                    tenant_tag: s.sealer.key().tenant_tag(),
                    peer: s.peer,
                    apps: apps.clone(),
                    key: s.sealer.key().wrap(nic.sealer.key()),
                },
                _ => Control::SessionClosed { session: sid },
            },
            None => Control::SessionClosed { session: sid },
        };
        self.replies.sealed(&nic, 0, &m.to_bytes(0));
    }

    fn sealed(&mut self, now: Nanos, peer: SocketAddr, msg: &Bytes) {
        let (sid, role, sealer, inner) = match self.gate.open(now, peer, msg) {
            Ok(o) => (
                o.session.id,
                o.session.role.clone(),
                o.session.sealer.clone(),
                o.inner,
            ),
            Err(SealError::UnknownSession {
                session,
                tenant_tag,
            }) => {
                self.stats.unauthenticated += 1;
                if let Some(token) = self.gate.reset_token(session, tenant_tag) {
                    let m = Control::Stale {
                        session,
                        epoch: self.gate.epoch(),
                        token,
                    };
                    self.send_unproven(peer, msg.len(), 0, &m.to_bytes(0));
                }
                return;
            }
            Err(_) => {
                self.stats.unauthenticated += 1;
                return;
            }
        };
        let ch = Channel { to: peer, sealer };
        match peek_kind(&inner) {
            Some(KIND_REQUEST) => self.request(sid, &role, ch, inner, msg),
            Some(KIND_CONTROL) => self.control(sid, &role, ch, &inner),
            Some(KIND_OP) => {
                // One-sided operations are the NIC's job, never the host cores'.
                self.stats.refused += 1;
                if let Ok(op) = onesided::Operation::decode(inner) {
                    let c = onesided::Completion::error(
                        op.app,
                        op.id,
                        Status::Unavailable,
                        "one-sided operations are served by the NIC's agent (naam-nic), \
                         not by the host",
                    );
                    self.replies.sealed(&ch, op.id, &c.to_bytes());
                }
            }
            _ => self.stats.malformed += 1,
        }
    }

    fn request(&mut self, sid: u64, role: &Role, ch: Channel, inner: Bytes, sealed: &Bytes) {
        let mut req = match Request::decode(inner) {
            Ok(r) => r,
            Err(e) => {
                self.stats.malformed += 1;
                self.replies
                    .reply(&ch, &malformed(0, 0, Placement::Host, e.to_string()));
                return;
            }
        };
        req.origin = sid;
        let refuse = |status, at, why: String| crate::cluster::error_reply(&req, status, at, why);
        if !role.may_use(req.app) {
            // Said as for an app that does not exist: a session learns nothing of others'.
            self.stats.refused += 1;
            let r = refuse(
                Status::UnknownApp,
                Placement::Host,
                format!("no app {} in this session", req.app),
            );
            self.replies.reply(&ch, &r);
            return;
        }
        if self.draining {
            self.stats.refused += 1;
            let r = refuse(
                Status::Unavailable,
                Placement::Host,
                "the server is shutting down".into(),
            );
            self.replies.reply(&ch, &r);
            return;
        }
        // Behind an eSwitch, what reaches the host's port was steered here.
        let pinned = req
            .pinned()
            .or(self.options.switch.as_ref().map(|_| Placement::Host));
        let id = req.request_id;
        match self
            .replies
            .dispatch(&self.cluster, req, &mut self.switch, pinned, ch.clone())
        {
            Dispatch::Queued(_) => self.stats.host += 1,
            Dispatch::Remote(req) => match self.nic_channel().filter(|_| self.agent().is_some()) {
                Some(nic) => {
                    self.stats.forwarded += 1;
                    let to = self.agent().unwrap_or(nic.to);
                    let _ = self.replies.sender.send(
                        to,
                        id,
                        &nic.sealer.seal(&control::forward(sealed)),
                    );
                }
                None => {
                    self.stats.refused += 1;
                    let r = crate::cluster::error_reply(
                        &req,
                        Status::Unavailable,
                        Placement::Nic,
                        "the NIC is down".into(),
                    );
                    self.replies.reply(&ch, &r);
                }
            },
            Dispatch::Refused(r) => {
                self.stats.refused += 1;
                self.replies.reply(&ch, &r);
            }
        }
    }

    fn control(&mut self, sid: u64, role: &Role, ch: Channel, inner: &Bytes) {
        self.stats.control += 1;
        let (id, c) = match Control::decode(inner) {
            Ok(x) => x,
            Err(e) => {
                self.stats.malformed += 1;
                let m = Control::Error {
                    message: format!("malformed control message: {e}"),
                };
                self.replies.sealed(&ch, 0, &m.to_bytes(0));
                return;
            }
        };
        let refused = |what: &str| Control::Error {
            message: format!("{what} is not allowed in this session"),
        };
        let answer = match (c, role) {
            (Control::QueryManifest { page }, Role::Tenant { name, .. }) => {
                let pages = self.pages.get(name).map_or(&[][..], |p| &p[..]);
                let count = pages.len() as u32;
                Some(match pages.get(page as usize) {
                    Some(apps) => Control::ManifestPage {
                        page,
                        pages: count,
                        apps: apps.clone(),
                    },
                    None => Control::Error {
                        message: format!("no manifest page {page}: there are {count}"),
                    },
                })
            }
            (
                Control::QueryWeights {
                    app,
                    client,
                    rtt_ns,
                },
                Role::Tenant { .. },
            ) => Some(self.weights(sid, role, app, client, rtt_ns)),
            (Control::NicLoad { agent, load }, Role::Nic) => {
                // The NIC names its address; an unspecified IP means "as seen".
                let mut at = agent;
                if at.ip().is_unspecified() {
                    at.set_ip(ch.to.ip());
                }
                let fresh = self.nic.map(|(s, _)| s) != Some(sid);
                self.nic = Some((sid, at));
                self.cluster.absorb_remote_load(&load);
                if fresh {
                    // A newly paired NIC learns every tenant session at once.
                    let ids: Vec<u64> = self
                        .gate
                        .sessions()
                        .filter(|s| matches!(*s.role, Role::Tenant { .. }))
                        .map(|s| s.id)
                        .collect();
                    for s in ids {
                        self.announce(s);
                    }
                }
                None
            }
            (Control::NicBye, Role::Nic) => {
                if self.nic.map(|(s, _)| s) == Some(sid) {
                    self.cluster.remote_nic_down();
                }
                None
            }
            (Control::QuerySession { session }, Role::Nic) => {
                self.announce(session);
                None
            }
            (Control::Congest { extra_ns }, Role::Operator) => Some(self.congest(extra_ns)),
            (Control::QuerySwitch { pin, unpin }, Role::Operator) => {
                Some(self.query_switch(pin, unpin))
            }
            (Control::VerbsConnect { endpoint }, Role::Tenant { .. }) => {
                Some(match &self.options.verbs {
                    Some(v) => match v.accept(ch.to, &endpoint) {
                        Ok((endpoint, mut regions)) => {
                            regions.retain(|r| role.may_use(r.app));
                            Control::VerbsAccept { endpoint, regions }
                        }
                        Err(e) => Control::Error {
                            message: format!("connecting a queue pair: {e}"),
                        },
                    },
                    None => Control::Error {
                        message: "this server has no RDMA device (built without the verbs \
                                  feature, or none found): use the udp fabric"
                            .into(),
                    },
                })
            }
            (
                c @ (Control::QueryManifest { .. }
                | Control::QueryWeights { .. }
                | Control::VerbsConnect { .. }
                | Control::NicLoad { .. }
                | Control::NicBye
                | Control::QuerySession { .. }
                | Control::Congest { .. }
                | Control::QuerySwitch { .. }),
                _,
            ) => Some(refused(control_name(&c))),
            (other, _) => Some(Control::Error {
                message: format!("unexpected control message {}", control_name(&other)),
            }),
        };
        if let Some(a) = answer {
            self.replies.sealed(&ch, id, &a.to_bytes(id));
        }
    }

    /// `app`'s weights for session `sid`, after taking in the session's own load report: a
    /// report moves only its own session's Client share ([`crate::steering::ClientShare`]).
    fn weights(
        &mut self,
        sid: u64,
        role: &Role,
        app: u32,
        client: Option<RemoteLoad>,
        rtt_ns: Option<f64>,
    ) -> Control {
        if !role.may_use(app) {
            return Control::Error {
                message: format!("no app {app} in this session"),
            };
        }
        let rtt_ok = rtt_ns.is_none_or(|x| x.is_finite() && (0.0..=MAX_REPORTED_NS).contains(&x));
        if client.as_ref().is_some_and(|l| !plausible_load(l)) || !rtt_ok {
            return Control::Error {
                message: "the load report is out of range (negative, infinite or absurd \
                          figures): ignored"
                    .into(),
            };
        }
        let Some(a) = self.cluster.registry().app(app) else {
            return Control::Error {
                message: format!("no app {app}"),
            };
        };
        let mut share = match self.shares.remove(&sid) {
            Some(s) => Some(s),
            None => self.cluster.client_share(),
        };
        if let (Some(share), Some(mut load)) = (share.as_mut(), client) {
            // Only the session's own apps' handlers that exist: a report cannot grow the view
            // past what the session may run.
            let registry = self.cluster.registry();
            load.handlers
                .retain(|h| role.may_use(h.app) && registry.handler(h.app, h.handler).is_ok());
            share.absorb(&load, rtt_ns);
        }
        let handlers = a
            .handlers
            .values()
            .map(|h| HandlerWeights {
                handler: h.id,
                weights: match share.as_mut() {
                    Some(s) => self.cluster.client_weights(s, app, h.id).0,
                    None => self.cluster.weights(app, h.id).0,
                },
            })
            .collect();
        if let Some(s) = share {
            self.shares.insert(sid, s);
        }
        Control::Weights {
            app,
            handlers,
            agent: self.agent(),
        }
    }

    fn congest(&self, extra_ns: Option<u64>) -> Control {
        if !self.options.congestion_control {
            Control::Error {
                message: "this server does not allow congestion control (set \
                          allow_congestion_control = true in its config to run congestion \
                          experiments)"
                    .into(),
            }
        } else if extra_ns.is_some_and(|ns| ns > control::MAX_CONGESTION_NS) {
            Control::Error {
                message: format!(
                    "congestion of {} ns per message is over the limit of {} ns",
                    extra_ns.unwrap_or_default(),
                    control::MAX_CONGESTION_NS
                ),
            }
        } else {
            match extra_ns {
                Some(ns) => self.cluster.congestion().limit_host(ns),
                None => self.cluster.congestion().clear(),
            }
            Control::Congestion { extra_ns }
        }
    }

    fn query_switch(&self, pin: Option<u32>, unpin: bool) -> Control {
        let change = match (pin, unpin) {
            (Some(p), _) => Some(Some(p)),
            (None, true) => Some(None),
            (None, false) => None,
        };
        let userspace = SwitchCounters {
            host: self.stats.host,
            nic: self.stats.forwarded,
            fragmented: 0,
        };
        match &self.options.switch {
            Some(sw) => {
                if let Some(p) = change {
                    sw.pin_nic_share(p);
                }
                match sw.counters() {
                    Ok(c) => Control::Switch {
                        switch: sw.describe(),
                        counters: c,
                        userspace,
                    },
                    Err(e) => Control::Error {
                        message: format!("reading the switch counters: {e}"),
                    },
                }
            }
            None if change.is_some() => Control::Error {
                message: "no XDP eSwitch is attached: the user-space switch follows the \
                          steering weights"
                    .into(),
            },
            None => Control::Switch {
                switch: "user-space switch in naam-server".into(),
                counters: userspace,
                userspace,
            },
        }
    }
}

/// A control message's name, for refusals (never its contents: they may hold secrets).
fn control_name(c: &Control) -> &'static str {
    match c {
        Control::Hello { .. } => "hello",
        Control::Challenge { .. } => "challenge",
        Control::Auth { .. } => "auth",
        Control::Stale { .. } => "stale",
        Control::Welcome { .. } => "welcome",
        Control::QueryManifest { .. } => "query-manifest",
        Control::ManifestPage { .. } => "manifest-page",
        Control::QueryWeights { .. } => "query-weights",
        Control::Weights { .. } => "weights",
        Control::NicLoad { .. } => "nic-load",
        Control::NicBye => "nic-bye",
        Control::SessionOpen { .. } => "session-open",
        Control::QuerySession { .. } => "query-session",
        Control::SessionClosed { .. } => "session-closed",
        Control::QuerySwitch { .. } => "query-switch",
        Control::Switch { .. } => "switch",
        Control::Congest { .. } => "congest",
        Control::Congestion { .. } => "congestion",
        Control::VerbsConnect { .. } => "verbs-connect",
        Control::VerbsAccept { .. } => "verbs-accept",
        Control::Error { .. } => "error",
    }
}

/// Runs the host driver on `socket` until `stop` is set, then drains: new requests get
/// `Unavailable` while queued ones finish (at most `options.drain`). Only sessions set up
/// with one of `options.tenants`' credentials are served.
pub fn serve_host(
    cluster: Arc<Cluster>,
    mut socket: Socket,
    options: ServerOptions,
    stop: &AtomicBool,
) -> std::io::Result<ServerStats> {
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    let mut pages = std::collections::HashMap::new();
    for t in &options.tenants {
        if let Role::Tenant { name, apps } = &t.role {
            let p = options
                .manifest
                .scoped(apps)
                .pages()
                .map_err(|e| invalid(e.to_string()))?;
            pages.insert(name.clone(), p);
        }
    }
    options
        .authentication
        .check_scope(socket.local_addr()?)
        .map_err(invalid)?;
    let cookies = CookieJar::new().map_err(|e| invalid(e.to_string()))?;
    let clock = SystemClock::new();
    let mut host = Host {
        cluster,
        options: &options,
        replies: Replies::new(socket.sender()?, options.telemetry.clone()),
        gate: Gatekeeper::new(options.manifest.epoch, options.tenants.clone(), cookies)
            .with_authentication(options.authentication),
        pages,
        head: Manifest {
            apps: Vec::new(),
            ..options.manifest.clone()
        },
        stats: ServerStats::default(),
        nic: None,
        switch: Selector::default(),
        draining: false,
        shares: std::collections::HashMap::new(),
    };
    let mut drain_deadline: Option<Instant> = None;
    let mut next_expiry = Instant::now();
    loop {
        if stop.load(Ordering::SeqCst) && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
            host.draining = true;
        }
        if let Some(d) = drain_deadline {
            if host.replies.idle() || Instant::now() >= d {
                return Ok(host.stats);
            }
        }
        if Instant::now() >= next_expiry {
            next_expiry = Instant::now() + Duration::from_secs(1);
            options.telemetry.publish_counters(host.stats.counters());
            host.gate.expire(clock.now());
            let gate = &host.gate;
            host.shares.retain(|sid, _| gate.session(*sid).is_some());
        }
        for (peer, msg) in socket.recv(Duration::from_millis(1))? {
            host.handle(clock.now(), peer, msg);
        }
    }
}
