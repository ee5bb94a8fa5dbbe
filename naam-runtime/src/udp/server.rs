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

use super::control::{self, Control, HandlerWeights, Manifest, KIND_CONTROL};
use super::socket::Socket;
use crate::cluster::{Cluster, Dispatch, Selector};
use crate::onesided::{self, KIND_OP};
use crate::placement::Placement;
use crate::wire::{peek_kind, LoadFeedback, Reply, Request, Status, KIND_REQUEST};

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
}

/// Packet counters of a switch in front of the server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct SwitchCounters {
    /// Messages left for the host executors.
    pub host: u64,
    /// Messages steered to the NIC.
    pub nic: u64,
    /// Multi-fragment messages (always left for the host).
    pub fragmented: u64,
}

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
    /// testbed); off, it is refused: anyone who reaches the port could otherwise do it.
    pub congestion_control: bool,
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

/// How a driver answers requests: replies go out on `sender`, and every request queued at an
/// executor counts as in flight until its reply is sent (SIGTERM drains until none is).
pub(crate) struct Replies {
    sender: Arc<super::socket::Sender>,
    inflight: Arc<AtomicU64>,
}

impl Replies {
    pub(crate) fn new(sender: super::socket::Sender) -> Replies {
        Replies {
            sender: Arc::new(sender),
            inflight: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Sends `r` to `to` (a lost reply is the client's retransmission to repair).
    pub(crate) fn send(&self, to: SocketAddr, r: &Reply) {
        let _ = self
            .sender
            .send(to, r.request_id, &r.to_bytes().unwrap_or_default());
    }

    /// Sends raw message bytes (forwarded requests, control answers, completions).
    pub(crate) fn send_bytes(&self, to: SocketAddr, id: u64, bytes: &[u8]) {
        let _ = self.sender.send(to, id, bytes);
    }

    /// Dispatches `req` on `cluster`; a queued request's reply goes to `to` from the executor.
    pub(crate) fn dispatch(
        &self,
        cluster: &Cluster,
        req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        to: SocketAddr,
    ) -> Dispatch {
        let (s, n) = (self.sender.clone(), self.inflight.clone());
        n.fetch_add(1, Ordering::SeqCst);
        let d = cluster.dispatch(req, sel, forced, move |r: Reply| {
            if let Ok(b) = r.to_bytes() {
                let _ = s.send(to, r.request_id, &b);
            }
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

/// Runs the host driver on `socket` until `stop` is set, then drains: new requests get
/// `Unavailable` while queued ones finish (at most `options.drain`).
pub fn serve_host(
    cluster: Arc<Cluster>,
    mut socket: Socket,
    options: ServerOptions,
    stop: &AtomicBool,
) -> std::io::Result<ServerStats> {
    let pages = options
        .manifest
        .pages()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let page_count = pages.len() as u32;
    let head = Manifest {
        apps: Vec::new(),
        ..options.manifest.clone()
    };
    let replies = Replies::new(socket.sender()?);
    let local = socket.local_addr()?.ip();
    // The NIC runs beside the host (its Arm cores, or here its process): only a peer on this
    // machine may register as the NIC, or anyone could have reads forwarded to them.
    let nic_allowed = |peer: &SocketAddr| peer.ip() == local || peer.ip().is_loopback();
    let mut stats = ServerStats::default();
    let mut nic: Option<SocketAddr> = None;
    let mut switch = Selector::default();
    let mut drain_deadline: Option<Instant> = None;
    loop {
        if stop.load(Ordering::SeqCst) && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
        }
        if let Some(d) = drain_deadline {
            if replies.idle() || Instant::now() >= d {
                return Ok(stats);
            }
        }
        for (peer, msg) in socket.recv(Duration::from_millis(1))? {
            match peek_kind(&msg) {
                Some(KIND_REQUEST) => {
                    let req = match Request::decode(msg.clone()) {
                        Ok(r) => r,
                        Err(e) => {
                            stats.malformed += 1;
                            replies.send(peer, &malformed(0, 0, Placement::Host, e.to_string()));
                            continue;
                        }
                    };
                    let id = req.request_id;
                    // Behind an eSwitch, what reaches the host's port was steered here.
                    let pinned = req
                        .pinned()
                        .or(options.switch.as_ref().map(|_| Placement::Host));
                    if drain_deadline.is_some() {
                        stats.refused += 1;
                        let r = crate::cluster::error_reply(
                            &req,
                            Status::Unavailable,
                            Placement::Host,
                            "the server is shutting down".into(),
                        );
                        replies.send(peer, &r);
                        continue;
                    }
                    match replies.dispatch(&cluster, req, &mut switch, pinned, peer) {
                        Dispatch::Queued(_) => stats.host += 1,
                        Dispatch::Remote(req) => match nic.filter(|_| cluster.remote_nic_up()) {
                            Some(to) => {
                                stats.forwarded += 1;
                                replies.send_bytes(to, id, &control::forward(peer, &msg));
                            }
                            None => {
                                stats.refused += 1;
                                let r = crate::cluster::error_reply(
                                    &req,
                                    Status::Unavailable,
                                    Placement::Nic,
                                    "the NIC is down".into(),
                                );
                                replies.send(peer, &r);
                            }
                        },
                        Dispatch::Refused(r) => {
                            stats.refused += 1;
                            replies.send(peer, &r);
                        }
                    }
                }
                Some(KIND_CONTROL) => {
                    stats.control += 1;
                    let (id, c) = match Control::decode(&msg) {
                        Ok(x) => x,
                        Err(e) => {
                            stats.malformed += 1;
                            let m = Control::Error {
                                message: format!("malformed control message: {e}"),
                            };
                            replies.send_bytes(peer, 0, &m.to_bytes(0));
                            continue;
                        }
                    };
                    let agent = nic.filter(|_| cluster.remote_nic_up());
                    if let Control::QueryWeights {
                        client: Some(load),
                        rtt_ns,
                        ..
                    } = &c
                    {
                        cluster.absorb_client_load(load, *rtt_ns);
                    }
                    let answer = match c {
                        Control::Hello => Some(Control::Welcome {
                            client_id: cluster.next_client_id(),
                            manifest: Manifest {
                                apps: pages[0].clone(),
                                ..head.clone()
                            },
                            pages: page_count,
                            agent,
                        }),
                        Control::QueryManifest { page } => Some(match pages.get(page as usize) {
                            Some(apps) => Control::ManifestPage {
                                page,
                                pages: page_count,
                                apps: apps.clone(),
                            },
                            None => Control::Error {
                                message: format!("no manifest page {page}: there are {page_count}"),
                            },
                        }),
                        Control::QueryWeights { app, .. } => match cluster.registry().app(app) {
                            Some(a) => Some(Control::Weights {
                                app,
                                handlers: a
                                    .handlers
                                    .values()
                                    .map(|h| HandlerWeights {
                                        handler: h.id,
                                        weights: cluster.weights(app, h.id).0,
                                    })
                                    .collect(),
                                agent,
                            }),
                            None => Some(Control::Error {
                                message: format!("no app {app}"),
                            }),
                        },
                        Control::NicLoad { .. } | Control::NicBye if !nic_allowed(&peer) => {
                            Some(Control::Error {
                                message: format!(
                                    "{peer} may not register as the NIC: it must run on this \
                                     server's address ({local})"
                                ),
                            })
                        }
                        Control::NicLoad { agent, load } => {
                            // The NIC names its address; an unspecified IP means "as seen".
                            let mut at = agent;
                            if at.ip().is_unspecified() {
                                at.set_ip(peer.ip());
                            }
                            nic = Some(at);
                            cluster.absorb_remote_load(&load);
                            None
                        }
                        Control::NicBye => {
                            cluster.remote_nic_down();
                            None
                        }
                        Control::Congest { extra_ns } => Some(if !options.congestion_control {
                            Control::Error {
                                message: "this server does not allow congestion control \
                                          (set allow_congestion_control = true in its config \
                                          to run congestion experiments)"
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
                                Some(ns) => cluster.congestion().limit_host(ns),
                                None => cluster.congestion().clear(),
                            }
                            Control::Congestion { extra_ns }
                        }),
                        Control::VerbsConnect { endpoint } => Some(match &options.verbs {
                            Some(v) => match v.accept(peer, &endpoint) {
                                Ok((endpoint, regions)) => {
                                    Control::VerbsAccept { endpoint, regions }
                                }
                                Err(e) => Control::Error {
                                    message: format!("connecting a queue pair: {e}"),
                                },
                            },
                            None => Control::Error {
                                message: "this server has no RDMA device (built without the \
                                          verbs feature, or none found): use the udp fabric"
                                    .into(),
                            },
                        }),
                        Control::QuerySwitch { pin, unpin } => {
                            let change = match (pin, unpin) {
                                (Some(p), _) => Some(Some(p)),
                                (None, true) => Some(None),
                                (None, false) => None,
                            };
                            let userspace = SwitchCounters {
                                host: stats.host,
                                nic: stats.forwarded,
                                fragmented: 0,
                            };
                            Some(match &options.switch {
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
                                    message: "no XDP eSwitch is attached: the user-space switch \
                                              follows the steering weights"
                                        .into(),
                                },
                                None => Control::Switch {
                                    switch: "user-space switch in naam-server".into(),
                                    counters: userspace,
                                    userspace,
                                },
                            })
                        }
                        other => Some(Control::Error {
                            message: format!("unexpected control message {other:?}"),
                        }),
                    };
                    if let Some(a) = answer {
                        replies.send_bytes(peer, id, &a.to_bytes(id));
                    }
                }
                Some(KIND_OP) => {
                    // One-sided operations are the NIC's job, never the host cores'.
                    stats.refused += 1;
                    if let Ok(op) = onesided::Request::decode(msg.clone()) {
                        let c = onesided::Completion::error(
                            op.app,
                            op.id,
                            Status::Unavailable,
                            "one-sided operations are served by the NIC's agent (naam-nic), \
                             not by the host",
                        );
                        replies.send_bytes(peer, op.id, &c.to_bytes());
                    }
                }
                _ => stats.malformed += 1,
            }
        }
    }
}
