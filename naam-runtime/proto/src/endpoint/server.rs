//! The server's endpoint: the gatekeeper (handshakes, sealed sessions, stale notices, the
//! amplification limit), the control plane (manifest pages, per-session weights, NIC pairing
//! and load reports, operator commands) and the user-space switch (a request goes to a host
//! executor or, sealed in the NIC's session, to the paired `naam-nic`).
//!
//! The executors are not here: they belong to a [`HostBackend`], which queues a request and
//! sends its reply from its own thread, sealed on the request's [`Channel`]. Everything the
//! endpoint itself answers (refusals, control answers, forwards) comes out of
//! [`ServerEndpoint::poll_transmit`].

use crate::arena::ByteArena;
use crate::intmap::IntMap;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;

use super::directory::{PairedNic, SessionDirectory, TenantSession};
use super::Transmit;
use crate::control::{
    self, AppManifest, Control, HandlerWeights, Manifest, ManifestError, QpEndpoint, RdmaRegion,
    SwitchCounters,
};
use crate::entropy::Entropy;
use crate::kind::MessageKind;
use crate::onesided::{Completion, Operation};
use crate::session::{
    grant_app, within_amplification, CookieJar, Gatekeeper, HandshakeNonces, Role, SealError,
    Sealer, TenantEntry,
};
use crate::shard::Shard;
use crate::steering::{ClientShare, RemoteLoad, Selector, Weights};
use crate::wire::{LoadFeedback, Reply, Request, Status};
use crate::{frame, limits, Nanos, Placement};

/// Of the NIC's load reports that show it behind the newest manifest, every this many tells
/// it again ([`Control::ManifestChanged`]): a report comes every millisecond or so while the
/// NIC works, and taking up a deploy takes about that long.
const NUDGE_NIC_EVERY: u64 = 50;

/// How long an upload for a deploy is kept with no chunk or deploy naming it.
const UPLOAD_IDLE: Nanos = 60_000_000_000;

/// How often sessions and per-session views are expired.
const EXPIRY_PERIOD: Nanos = 1_000_000_000;

/// Requests handed in ([`ServerEndpoint::request_in_process`]) whose switch decisions a loop
/// keeps before it publishes its counts to the other loops; it publishes on every timeout
/// too, so a query answered by another loop sees them that late at most. Published per
/// request, the directory's cold line cost about 5 ns of every call.
const PUBLISH_HANDED_IN_EVERY: u32 = 64;

/// Where the answers of one session go: its address, sealed with its key.
#[derive(Clone, Debug)]
pub struct Channel {
    /// The address the session was set up from; nothing of the session goes elsewhere.
    pub to: SocketAddr,
    /// Seals in the session, as the server (or as the NIC, on the NIC's copy).
    pub sealer: Arc<Sealer>,
}

impl Channel {
    /// `bytes` sealed in this session, addressed to its peer.
    pub fn transmit(&self, id: u64, bytes: &[u8]) -> Transmit {
        Transmit::new(self.to, id, self.sealer.seal(bytes))
    }

    /// Reply `r` sealed in this session (a reply that does not encode goes out empty: the
    /// client's retransmission repairs it).
    pub fn reply(&self, r: &Reply) -> Transmit {
        self.transmit(r.request_id, &r.to_bytes().unwrap_or_default())
    }
}

/// A message for a session's peer, not yet sealed: messages for the same peer and session
/// that are ready together are coalesced into one envelope ([`crate::batch`]).
#[derive(Clone, Debug)]
pub(super) struct Outgoing {
    pub(super) to: SocketAddr,
    /// The session it is sealed in; `None` for the endpoint's own session (a client's one
    /// session, which [`coalesce`] is given), so that queueing a message takes no reference
    /// on its sealer.
    pub(super) sealer: Option<Arc<Sealer>>,
    pub(super) id: u64,
    pub(super) inner: Inner,
    /// [`Transmit::route`] of the envelope it goes in.
    pub(super) route: Option<u8>,
}

/// An outgoing message: encoded, or a reply encoded only when it is sealed, straight into its
/// envelope (a reply that goes alone, the usual case, is then copied once, not twice).
#[derive(Clone, Debug)]
pub(super) enum Inner {
    /// Encoded already (a control message, a forward, a client's request).
    Encoded(Bytes),
    /// A reply whose payload fits the wire's limit (checked when it was queued).
    Reply(Reply),
}

impl Inner {
    /// `r`, to be encoded when sealed; a reply that cannot be encoded goes out empty (the
    /// client's retransmission repairs it), as [`Channel::reply`] sends it.
    pub(super) fn reply(r: Reply) -> Inner {
        match r.payload.len() <= naam_ebpf::abi::REPLY_CAP {
            true => Inner::Reply(r),
            false => Inner::Encoded(Bytes::new()),
        }
    }

    /// Its encoded length.
    fn len(&self) -> usize {
        match self {
            Inner::Encoded(b) => b.len(),
            Inner::Reply(r) => crate::limits::REPLY_HEADER + r.payload.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends its encoding to `b`.
    fn write(&self, b: &mut BytesMut) {
        match self {
            Inner::Encoded(m) => b.put_slice(m),
            // Cannot fail: the payload was checked when the reply was queued.
            Inner::Reply(r) => {
                let _ = r.encode(b);
            }
        }
    }

    /// Its encoding, borrowed where it is already encoded.
    fn encoded(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            Inner::Encoded(m) => std::borrow::Cow::Borrowed(&m[..]),
            Inner::Reply(_) => {
                let mut b = BytesMut::with_capacity(self.len());
                self.write(&mut b);
                std::borrow::Cow::Owned(Vec::from(b))
            }
        }
    }
}

/// Seals `out` into transmits: every message for the same peer, sealer and route is
/// coalesced, in order, into batches whose sealed size stays within `limit` bytes (a message
/// over it goes alone, to be fragmented); the first message's id names each batch. Returns
/// how many batches of several messages were made. `out` is left empty with its capacity,
/// so an endpoint's outbox is allocated once; the envelopes are written in `arena`'s chunks.
/// `own` seals the messages queued for the endpoint's own session (sealer `None`); without
/// it they are dropped (the session is gone).
pub(super) fn coalesce(
    out: &mut Vec<Outgoing>,
    limit: usize,
    into: &mut VecDeque<Transmit>,
    arena: &mut ByteArena,
    own: Option<&Arc<Sealer>>,
) -> u64 {
    use crate::limits::{MAX_MESSAGE, SEAL_OVERHEAD};
    let budget = limit.min(MAX_MESSAGE).saturating_sub(SEAL_OVERHEAD);
    let sealer_of = |o: &Outgoing| o.sealer_in(own).map(Arc::as_ptr);
    let together = |a: &Outgoing, b: &Outgoing| {
        a.to == b.to && a.route == b.route && sealer_of(a) == sealer_of(b)
    };
    // The usual case, one message or one session's window: a single group, in place.
    let batches = match out.first() {
        Some(first) if out.iter().all(|o| together(first, o)) => {
            coalesce_group(out, budget, limit, into, arena, own)
        }
        Some(_) => {
            // Groups in order of first appearance; within a group, arrival order.
            let mut groups: Vec<Vec<Outgoing>> = Vec::new();
            for o in out.drain(..) {
                match groups.iter_mut().find(|g| together(&g[0], &o)) {
                    Some(g) => g.push(o),
                    None => groups.push(vec![o]),
                }
            }
            groups
                .iter()
                .map(|g| coalesce_group(g, budget, limit, into, arena, own))
                .sum()
        }
        None => 0,
    };
    out.clear();
    batches
}

/// [`coalesce`] of messages that all go to one peer, sealer and route: as many as fit in
/// `budget` bytes per envelope.
fn coalesce_group(
    g: &[Outgoing],
    budget: usize,
    limit: usize,
    into: &mut VecDeque<Transmit>,
    arena: &mut ByteArena,
    own: Option<&Arc<Sealer>>,
) -> u64 {
    let Some(sealer) = g.first().and_then(|o| o.sealer_in(own)) else {
        return 0;
    };
    let mut batches = 0;
    let mut i = 0;
    while i < g.len() {
        // As many as fit from i (an empty message, which a batch cannot hold, goes alone).
        let mut j = i + 1;
        let mut size = crate::batch::encoded_len([g[i].inner.len()]);
        while !g[i].inner.is_empty()
            && j < g.len()
            && j - i < crate::batch::MAX_COUNT
            && !g[j].inner.is_empty()
            && size + crate::batch::PER_MESSAGE + g[j].inner.len() <= budget
        {
            size += crate::batch::PER_MESSAGE + g[j].inner.len();
            j += 1;
        }
        let first = &g[i];
        let batched = (j - i > 1)
            .then(|| {
                let encoded: Vec<_> = g[i..j].iter().map(|o| o.inner.encoded()).collect();
                let parts: Vec<&[u8]> = encoded.iter().map(|e| &e[..]).collect();
                crate::batch::encode(&parts).ok()
            })
            .flatten();
        let next = match batched {
            Some(b) => {
                batches += 1;
                into.push_back(
                    first.transmit(sealer, arena, limit, b.len(), |out| out.put_slice(&b)),
                );
                j
            }
            None => {
                into.push_back(
                    first.transmit(sealer, arena, limit, first.inner.len(), |out| {
                        first.inner.write(out)
                    }),
                );
                i + 1
            }
        };
        i = next;
    }
    batches
}

impl Outgoing {
    /// The sealer of its session: its own, else `own` (the endpoint's session, for a
    /// message that names none); `None` when that session is gone.
    fn sealer_in<'a>(&'a self, own: Option<&'a Arc<Sealer>>) -> Option<&'a Arc<Sealer>> {
        self.sealer.as_ref().or(own)
    }

    /// What `write` appends (about `len` bytes: this message, or a batch it leads) sealed by
    /// `sealer` (its session's) for this message's peer, in a chunk of `arena`. When the
    /// envelope fits in `limit` bytes (a datagram's payload) it is written behind its
    /// fragment header, framed as the one datagram that carries it ([`Transmit::framed`]).
    fn transmit(
        &self,
        sealer: &Sealer,
        arena: &mut ByteArena,
        limit: usize,
        len: usize,
        write: impl FnOnce(&mut BytesMut),
    ) -> Transmit {
        use crate::frame::{lone_header, HEADER};
        let mut lone = false;
        let datagram = arena.write(HEADER + limits::SEAL_OVERHEAD + len, |b| {
            b.put_slice(&[0; HEADER]);
            if !sealer.seal_into(b, write) {
                return;
            }
            let sealed = &b[HEADER..];
            // The route `route_of` reads from the envelope: its session's.
            let route = self
                .route
                .unwrap_or_else(|| crate::shard::route_of_session(sealer.key().session()));
            if let Some(h) = lone_header(self.id, sealed.len(), route) {
                lone = sealed.len() <= limit;
                b[..HEADER].copy_from_slice(&h);
            }
        });
        // Empty when the session's packet numbers are spent: the peer drops it.
        Transmit::behind_header(self.to, self.id, self.route, datagram, lone)
    }
}

/// What a [`HostBackend`] did with a request.
#[derive(Debug)]
#[non_exhaustive]
pub enum Routed {
    /// Run already, to completion, by the thread that took it in (no hand-off): its reply
    /// is in the slot the caller passed (`out`), for the endpoint to send.
    Answered,
    /// Queued at an executor of this placement; its reply goes out on the channel.
    Queued(Placement),
    /// Steered to the NIC in another process: the endpoint forwards it.
    Remote(Box<Request>),
    /// Refused: the endpoint sends this reply.
    Refused(Reply),
}

impl Inadmissible {
    /// The reply to send, once counted into the endpoint's `malformed` or `refused` tally.
    pub(super) fn counted(self, malformed: &mut u64, refused: &mut u64) -> Reply {
        match self {
            Inadmissible::Malformed(r) => {
                *malformed += 1;
                r
            }
            Inadmissible::Refused(r) => {
                *refused += 1;
                r
            }
        }
    }
}

/// A switch ahead of the server (the XDP eSwitch) that already split server-bound messages
/// between host and NIC: what arrives at the endpoint is for the host.
pub trait SwitchHandle: Send + Sync {
    /// What it is, for logs and answers.
    fn describe(&self) -> String;
    /// Messages it left for the host or steered to the NIC so far, or why they cannot be read.
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
        remote: &QpEndpoint,
    ) -> Result<(QpEndpoint, Vec<RdmaRegion>), String>;
}

/// The host side a [`ServerEndpoint`] steers into: its executors, registry and steering
/// state (the in-process cluster, in `naam-server`; a model in tests).
pub trait HostBackend {
    /// Steers `req` (with `sel`, the switch's round-robin memory, unless `forced` pins it) and
    /// queues it at a host executor, whose reply goes out sealed on `reply_to`; or hands it
    /// back to forward to the NIC, or refuses it. A backend that queues it keeps a clone of
    /// `reply_to`; one that answers at once ([`Routed::Answered`]) needs none, and writes
    /// the reply into `out` (whatever was there is written over), where the caller keeps it.
    ///
    /// `req` is borrowed: a backend takes it (leaving [`Request::taken`]) only to keep it
    /// (queued, or handed back), so that one answered at once stays with its caller, unmoved,
    /// its buffers free to be written again (a client in process builds its next call in it).
    fn dispatch(
        &mut self,
        req: &mut Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        reply_to: &Channel,
        out: &mut Reply,
    ) -> Routed;
    /// A fresh client id for a new session (the top 24 bits of its request ids).
    fn next_client_id(&mut self) -> u32;
    /// Whether the paired NIC is up (its load reports are fresh).
    fn nic_up(&self) -> bool;
    /// Takes in the paired NIC's load report.
    fn nic_load(&mut self, load: &RemoteLoad);
    /// The paired NIC said goodbye.
    fn nic_gone(&mut self);
    /// `app`'s handler ids, if it exists.
    fn handlers(&self, app: u32) -> Option<Vec<u32>>;
    /// Whether `app` has handler `handler`.
    fn has_handler(&self, app: u32, handler: u32) -> bool;
    /// A new per-session view of the Client placement, if clients may run handlers.
    fn client_share(&self) -> Option<ClientShare>;
    /// The weights of `(app, handler)`: the controller's, or for a session with a
    /// `share`, its own Client share and the controller's split of the rest.
    fn weights(&self, app: u32, handler: u32, share: Option<&mut ClientShare>) -> Weights;
    /// Slows the host executors by `extra_ns` per message (`None`: back to normal).
    fn congest(&mut self, extra_ns: Option<u64>);
    /// A switch in front of the server, if any.
    fn switch(&self) -> Option<&dyn SwitchHandle>;
    /// The RDMA verbs side, if the server has a device.
    fn verbs(&self) -> Option<&dyn VerbsAcceptor>;
    /// Carries out a tenant's deploy or undeploy, which the endpoint has checked (the
    /// session's tenant has the app; an install's object came whole, with the hash its
    /// deploy names). `Some`: the answer, now; `None`: the backend answers later, sealed on
    /// `reply_to` with request id [`DeployJob::id`] (building code is no work for a receive
    /// loop). A retransmitted deploy comes again with the same id, and must be answered as
    /// the first was. By default deploys are refused.
    fn deploy(&mut self, job: DeployJob, reply_to: &Channel) -> Option<Control> {
        let _ = (job, reply_to);
        Some(Control::Error {
            message: "this server takes no deploys: its handlers come from its config".into(),
        })
    }
    /// The paired NIC serves the handlers of [`Manifest::version`] `version` (from its load
    /// report): an app deployed later must not be forwarded to it.
    fn nic_manifest(&mut self, version: u64) {
        let _ = version;
    }
}

/// A tenant's deploy or undeploy ([`Control::Deploy`], [`Control::Undeploy`]), checked by the
/// endpoint, for its [`HostBackend::deploy`] to carry out.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DeployJob {
    /// The tenant whose session asked.
    pub tenant: String,
    /// Every app the tenant has (its quotas count over them all).
    pub tenant_apps: Vec<u32>,
    /// The session that asked: with `id`, what names the request (two sessions of one
    /// tenant number their requests alike).
    pub session: u64,
    /// The request id its answer goes out with; a retransmission carries the same.
    pub id: u64,
    /// The app it changes (one of `tenant_apps`).
    pub app: u32,
    /// What it does.
    pub change: DeployChange,
}

/// What a [`DeployJob`] does to its app.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum DeployChange {
    /// Make `handlers` of `object` the app's handlers (those it had and this does not name
    /// go).
    Install {
        /// The object's bytes, uploaded whole ([`Control::DeployChunk`]).
        object: Bytes,
        /// The handlers to install.
        handlers: Vec<control::DeployHandler>,
        /// Their engine, if the tenant named one.
        engine: Option<crate::EngineKind>,
        /// Their budget per step, if the tenant named one.
        budget: Option<u64>,
    },
    /// Take every handler of the app away (its regions and data stay).
    Remove,
    /// Create an app for the tenant ([`Control::CreateApp`]), whose name and regions the
    /// endpoint checked for form; [`DeployJob::app`] is 0, the backend picks the id.
    Create {
        /// The new app's name.
        name: String,
        /// Its regions, zeroed.
        regions: Vec<control::NewRegion>,
    },
}

/// An object a tenant is uploading for a deploy ([`Control::DeployChunk`]): one per tenant
/// per receive loop, at most [`limits::MAX_DEPLOY_OBJECT`] bytes.
#[derive(Debug)]
struct Upload {
    app: u32,
    total: u32,
    /// The whole object's hash, as its chunks name it.
    hash: u64,
    bytes: Vec<u8>,
    /// `bytes`, frozen once whole (a retransmitted deploy takes it again).
    whole: Option<Bytes>,
    /// When a chunk last came: an upload left alone for [`UPLOAD_IDLE`] is dropped.
    touched: Nanos,
}

impl Upload {
    /// The bytes held, from offset 0.
    fn held(&self) -> &[u8] {
        self.whole.as_deref().unwrap_or(&self.bytes)
    }
}

/// A server endpoint's settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ServerConfig {
    /// What is served (each tenant sees its own apps).
    pub manifest: Manifest,
    /// The credentials sessions are set up with: every app's, the operator's, the NIC's.
    pub tenants: Vec<TenantEntry>,
    /// Datagram authentication (on, but for a loopback measurement of its cost).
    pub authentication: crate::session::Authentication,
    /// Whether [`Control::Congest`] may slow the host down (experiments; operator only).
    pub congestion_control: bool,
    /// Requests one session may have waiting to run: its in-flight credit (the window its
    /// client keeps). More are answered `Busy` at once.
    pub session_credit: u32,
    /// Requests all sessions of one tenant may have waiting together: its sessions share one
    /// fair share however many it opens. More are answered `Busy` at once. (Per receive loop:
    /// each loop admits its own sessions.)
    pub tenant_credit: u32,
    /// The receive loop this endpoint is ([`crate::shard`]): the sessions it sets up route
    /// to it.
    pub shard: Shard,
    /// What it shares with the server's other receive loops; every loop's config holds the
    /// same one.
    pub directory: Arc<SessionDirectory>,
    /// Server nonces and session ids are drawn from it.
    pub entropy: Entropy,
    /// Deploys and undeploys one tenant may make a second (as many in a burst; per receive
    /// loop, as the credits are): building code is the server's work, and a tenant deploying
    /// in a loop must not take it from the others' requests.
    pub deploys_per_second: f64,
}

impl ServerConfig {
    /// Serves `manifest` to sessions of `tenants`, authenticated, without congestion control,
    /// with the default credits ([`limits::SESSION_CREDIT`], [`limits::TENANT_CREDIT`]).
    pub fn new(manifest: Manifest, tenants: Vec<TenantEntry>, entropy: Entropy) -> ServerConfig {
        ServerConfig {
            manifest,
            tenants,
            authentication: crate::session::Authentication::On,
            congestion_control: false,
            session_credit: limits::SESSION_CREDIT,
            tenant_credit: limits::TENANT_CREDIT,
            shard: Shard::SOLE,
            directory: SessionDirectory::new(),
            entropy,
            deploys_per_second: limits::DEPLOYS_PER_SECOND,
        }
    }
}

/// How a waiting request reaches the NIC, should the switch send it there.
enum ForwardAs {
    /// The client's sealed datagram, which the NIC opens itself.
    Sealed(Bytes),
    /// Its own bytes, vouched for by the server: it came in a batch, the rest of which is not
    /// the NIC's.
    Member(Bytes),
    /// Handed in by a client in this process ([`ServerEndpoint::request_in_process`]): it has
    /// no bytes, and is encoded, as a member vouched for, only if it is forwarded.
    InProcess,
}

/// What became of a request a client in this process handed in
/// ([`ServerEndpoint::request_in_process`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum InProcess {
    /// Run here to completion, or refused: the reply is in the caller's slot (`out`),
    /// sealed for no one.
    Answered,
    /// Queued at an executor, forwarded to the NIC, or behind other work's turns: its answer
    /// comes on the session as a datagram, as the answer to one sent would.
    Pending,
    /// Dropped, as a datagram of the session would be now (a session muted for ignoring
    /// `Busy`): nothing answers it.
    Dropped,
}

use crate::limits::{
    FLOOD_FACTOR, FLOOD_MIN_REFUSALS, FLOOD_MUTE, FLOOD_WINDOW, STRANGER_BURST,
    STRANGER_BURST_PER_IP, STRANGER_IPS, STRANGER_RATE, STRANGER_RATE_PER_IP,
};

/// A session answered `Busy` beyond its credit: how many refusals in the current window, and
/// until when its datagrams are dropped unopened.
#[derive(Clone, Copy, Debug, Default)]
struct Flood {
    since: Nanos,
    refusals: u32,
    muted_until: Nanos,
}

/// A token bucket: `rate` tokens a second, at most `burst` saved.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Nanos,
}

impl Bucket {
    fn full(burst: f64, now: Nanos) -> Bucket {
        Bucket {
            tokens: burst,
            at: now,
        }
    }

    /// Takes a token if there is one.
    fn take(&mut self, now: Nanos, rate: f64, burst: f64) -> bool {
        let dt = now.saturating_sub(self.at) as f64 / 1e9;
        self.tokens = (self.tokens + dt * rate).min(burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Rate limits on what strangers make the server do before any authentication.
#[derive(Debug)]
struct Strangers {
    all: Bucket,
    by_ip: HashMap<std::net::IpAddr, Bucket>,
}

impl Strangers {
    fn new(now: Nanos) -> Strangers {
        Strangers {
            all: Bucket::full(STRANGER_BURST, now),
            by_ip: HashMap::new(),
        }
    }

    /// Whether a datagram from `peer` without a session may be looked at now.
    fn admit(&mut self, peer: SocketAddr, now: Nanos) -> bool {
        if self.by_ip.len() >= STRANGER_IPS && !self.by_ip.contains_key(&peer.ip()) {
            self.by_ip.clear();
        }
        let ip = self
            .by_ip
            .entry(peer.ip())
            .or_insert_with(|| Bucket::full(STRANGER_BURST_PER_IP, now));
        ip.take(now, STRANGER_RATE_PER_IP, STRANGER_BURST_PER_IP)
            && self.all.take(now, STRANGER_RATE, STRANGER_BURST)
    }
}

/// A request admitted and waiting for its turn.
struct Waiting {
    sid: u64,
    req: Request,
    ch: Channel,
    forward: ForwardAs,
}

/// What waits for its tenant's turn.
// Both kinds sit in the same queues, one after the other; boxing the larger would cost an
// allocation per request on the hot path to save queue slots that are few (the credits).
#[allow(clippy::large_enum_variant)]
enum Work {
    /// A sealed datagram of a known session, taken in at `at` and not yet opened: opening it
    /// (and splitting its batch) is work done for its tenant, in its tenant's turn.
    Sealed {
        sid: u64,
        peer: SocketAddr,
        msg: Bytes,
        at: Nanos,
    },
    /// A request admitted from an opened datagram.
    Request(Waiting),
}

impl Work {
    fn sid(&self) -> u64 {
        match self {
            Work::Sealed { sid, .. } => *sid,
            Work::Request(w) => w.sid,
        }
    }
}

/// Work waiting to run, per tenant, served round robin: a tenant's turn opens one of its
/// datagrams or runs one of its requests (its sessions in arrival order), so a tenant that
/// floods waits behind every other tenant's next datagram, and the credits bound what any of
/// them holds. Another tenant's request therefore waits about one of the flood's, not for the
/// flood's datagrams to be opened first.
#[derive(Default)]
struct Turns {
    /// Per tenant (its credential's tag, from the server's configuration): its waiting work;
    /// empty for a tenant whose turn has no work.
    queues: IntMap<u32, VecDeque<Work>>,
    /// Tenants with work waiting, in turn order.
    ring: VecDeque<u32>,
    /// Per session: its datagrams and requests waiting.
    per_session: IntMap<u64, u32>,
}

impl Turns {
    fn waiting(&self, tenant: u32, sid: u64) -> (u32, u32) {
        (
            self.queues.get(&tenant).map_or(0, |q| q.len() as u32),
            self.per_session.get(&sid).copied().unwrap_or(0),
        )
    }

    fn push(&mut self, tenant: u32, w: Work) {
        *self.per_session.entry(w.sid()).or_default() += 1;
        let q = self.queues.entry(tenant).or_default();
        if q.is_empty() {
            self.ring.push_back(tenant);
        }
        q.push_back(w);
    }

    fn pop(&mut self) -> Option<Work> {
        let tenant = self.ring.pop_front()?;
        let q = self.queues.get_mut(&tenant)?;
        let w = q.pop_front()?;
        // An emptied queue stays (one per configured tenant at most), so the next request
        // does not allocate it again.
        if !q.is_empty() {
            self.ring.push_back(tenant);
        }
        if let Some(n) = self.per_session.get_mut(&w.sid()) {
            *n -= 1;
            if *n == 0 {
                self.per_session.remove(&w.sid());
            }
        }
        Some(w)
    }

    fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

/// Counters of a server endpoint.
#[derive(Clone, Copy, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct ServerStats {
    /// Requests run at the host (inline, or queued at its executors).
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
    /// Requests answered `Busy` because their session or tenant was over its credit (also
    /// counted in `refused`).
    pub over_credit: u64,
    /// Datagrams sent that carried a batch of several messages.
    pub batches: u64,
    /// Datagrams dropped unopened because their session kept sending far past its credit
    /// after being answered `Busy` (it is muted for a while).
    pub flood_drops: u64,
    /// Datagrams from peers without a session dropped over the strangers' rate limit.
    pub stranger_drops: u64,
    /// Control messages over [`limits::MUTED_CONTROL_BYTES`] dropped unread because their
    /// tenant was still to wait out a deploy-rate refusal (it uploaded anyway).
    pub deploy_flood_drops: u64,
}

impl std::ops::AddAssign for ServerStats {
    /// Adds another receive loop's counters.
    fn add_assign(&mut self, o: ServerStats) {
        let ServerStats {
            host,
            forwarded,
            refused,
            malformed,
            control,
            sessions,
            unauthenticated,
            amplification_drops,
            over_credit,
            batches,
            flood_drops,
            stranger_drops,
            deploy_flood_drops,
        } = o;
        self.host += host;
        self.forwarded += forwarded;
        self.refused += refused;
        self.malformed += malformed;
        self.control += control;
        self.sessions += sessions;
        self.unauthenticated += unauthenticated;
        self.amplification_drops += amplification_drops;
        self.over_credit += over_credit;
        self.batches += batches;
        self.flood_drops += flood_drops;
        self.stranger_drops += stranger_drops;
        self.deploy_flood_drops += deploy_flood_drops;
    }
}

/// A session's role as logs name it: the tenant's name, `operator` or `nic`.
fn role_name(role: &Role) -> &str {
    match role {
        Role::Tenant { name, .. } => name,
        Role::Operator => "operator",
        Role::Nic => "nic",
    }
}

impl ServerStats {
    /// The counters as `(name, help, value)`, for metrics.
    pub fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            (
                "host_queued",
                "Requests run at the host (inline or queued at its executors).",
                self.host,
            ),
            (
                "forwarded_to_nic",
                "Requests forwarded to the NIC.",
                self.forwarded,
            ),
            (
                "requests_not_run",
                "Requests answered with an error before any handler ran (unknown app or \
                 handler, busy, shutting down); not the status \"refused\" of \
                 naam_messages_total, which a run the runtime stopped gets.",
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
            (
                "over_credit",
                "Requests answered Busy over their session's or tenant's credit.",
                self.over_credit,
            ),
            (
                "batches_sent",
                "Sealed datagrams that carried several messages of one session.",
                self.batches,
            ),
            (
                "flood_drops",
                "Datagrams of sessions ignoring Busy, dropped unopened.",
                self.flood_drops,
            ),
            (
                "stranger_drops",
                "Datagrams without a session dropped over the strangers' rate limit.",
                self.stranger_drops,
            ),
            (
                "deploy_flood_drops",
                "Large control messages (upload chunks) dropped unread while their tenant was \
                 still to wait out a deploy-rate refusal.",
                self.deploy_flood_drops,
            ),
        ]
    }
}

/// A reply with status `status` and `why` as its payload, answering `req`.
pub fn error_reply(req: &Request, status: Status, placement: Placement, why: String) -> Reply {
    error_reply_for(req.app, req.request_id, req.steps, status, placement, why)
}

/// [`error_reply`] to request `request_id` of `app`, after `steps` steps: for a caller that
/// handed the request on and kept only what its answer echoes.
pub fn error_reply_for(
    app: u32,
    request_id: u64,
    steps: u16,
    status: Status,
    placement: Placement,
    why: String,
) -> Reply {
    Reply {
        app,
        request_id,
        status,
        code: 0,
        steps,
        placement,
        load: LoadFeedback::default(),
        payload: Bytes::from(why.into_bytes()),
    }
}

/// A malformed-request reply (request id 0 when it could not be read).
pub fn malformed(app: u32, id: u64, placement: Placement, why: String) -> Reply {
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

/// Why a request that arrived sealed in a session is not run: it did not decode, or it was
/// refused; either way the reply to send.
pub(super) enum Inadmissible {
    /// It did not decode (the reply names request id 0).
    Malformed(Reply),
    /// Out of the session's scope, or the endpoint is shutting down.
    Refused(Reply),
}

/// Decodes request `inner` of session `sid` (its origin from now on) and admits it at
/// `placement`: only for an app the session `may_use` (any other is answered as an app that
/// does not exist, so a session learns nothing of others'), and not while `draining` (`who` is
/// shutting down). The server and NIC endpoints admit requests the same way.
pub(super) fn admit(
    inner: Bytes,
    sid: u64,
    may_use: impl Fn(u32) -> bool,
    draining: bool,
    who: &str,
    placement: Placement,
) -> Result<Request, Inadmissible> {
    let mut req = Request::decode(inner)
        .map_err(|e| Inadmissible::Malformed(malformed(0, 0, placement, e.to_string())))?;
    req.origin = sid;
    match refusal(&req, may_use(req.app), draining, who, placement) {
        Some(r) => Err(Inadmissible::Refused(r)),
        None => Ok(req),
    }
}

/// The refusal of a decoded `req`: of an app the session may not use (answered as an app
/// that does not exist), or while `draining`; `None` when it is admitted.
fn refusal(
    req: &Request,
    may_use: bool,
    draining: bool,
    who: &str,
    placement: Placement,
) -> Option<Reply> {
    if !may_use {
        let why = format!("no app {} in this session", req.app);
        return Some(error_reply(req, Status::UnknownApp, placement, why));
    }
    if draining {
        let why = format!("{who} is shutting down");
        return Some(error_reply(req, Status::Unavailable, placement, why));
    }
    None
}

/// The longest time a load report may state (a minute), nanoseconds.
const MAX_REPORTED_NS: f64 = 60e9;

/// Whether a client's load report is within the ranges a real client produces: no negative,
/// infinite or absurd figures (a report moves steering only within them).
pub fn plausible_load(r: &RemoteLoad) -> bool {
    let ok_ns = |x: f64| x.is_finite() && (0.0..=MAX_REPORTED_NS).contains(&x);
    r.executors <= 1024
        && r.handlers.len() <= 4096
        && ok_ns(r.queue_delay_ns)
        && ok_ns(r.loop_ns)
        && r.handlers.iter().all(|h| {
            ok_ns(h.service_ns) && h.steps.is_finite() && (0.0..=1024.0).contains(&h.steps)
        })
}

/// Each tenant's manifest pages of `manifest` (each sees its own apps).
fn tenant_pages(
    tenants: &[TenantEntry],
    manifest: &Manifest,
) -> Result<HashMap<String, Vec<Vec<AppManifest>>>, ManifestError> {
    let mut pages = HashMap::new();
    for t in tenants {
        if let Role::Tenant { name, apps } = &t.role {
            pages.insert(name.clone(), manifest.scoped(apps).pages()?);
        }
    }
    Ok(pages)
}

/// Whether a deploy's handler names fit [`limits::MAX_HANDLER_NAME`] (and are not empty).
fn handler_names_fit(handlers: &[control::DeployHandler]) -> Result<(), String> {
    match handlers
        .iter()
        .find(|h| h.name.is_empty() || h.name.len() > limits::MAX_HANDLER_NAME)
    {
        Some(h) => Err(format!(
            "a handler name of {} bytes: names are 1 to {} bytes",
            h.name.len(),
            limits::MAX_HANDLER_NAME
        )),
        None => Ok(()),
    }
}

/// Whether a [`Control::CreateApp`]'s name and regions are well formed (the backend checks
/// quotas and whether the name is free); else why not.
fn new_app_fits(name: &str, regions: &[control::NewRegion]) -> Result<(), String> {
    control::check_created_name("an app", name)?;
    if regions.is_empty() || regions.len() > limits::MAX_CREATED_APP_REGIONS {
        return Err(format!(
            "{} regions: an app created at run time has 1 to {}",
            regions.len(),
            limits::MAX_CREATED_APP_REGIONS
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for r in regions {
        control::check_created_name("a region", &r.name)?;
        if !seen.insert(r.name.as_str()) {
            return Err(format!("two regions are named {}", r.name));
        }
        if r.len == 0 {
            return Err(format!(
                "region {} of 0 bytes: a region has at least 1",
                r.name
            ));
        }
        if r.access & !naam_ebpf::abi::ACCESS_MASK != 0 || r.access == 0 {
            return Err(format!(
                "region {}'s access {:#x}: give read ({:#x}), write ({:#x}) or both",
                r.name,
                r.access,
                naam_ebpf::abi::ACCESS_READ,
                naam_ebpf::abi::ACCESS_WRITE
            ));
        }
    }
    Ok(())
}

/// The refusal of a change to an app the session's tenant does not have.
fn not_yours(app: u32) -> Control {
    Control::Error {
        message: format!("app {app} is not this tenant's: a tenant deploys only into its own apps"),
    }
}

/// Bytes of a whole datagram carrying a `message`-byte message in one fragment.
fn datagram_len(message: usize) -> usize {
    frame::HEADER + message
}

/// The server's endpoint over host side `B`. See the module documentation.
pub struct ServerEndpoint<B> {
    backend: B,
    config: ServerConfig,
    gate: Gatekeeper,
    /// Manifest pages per tenant name (each tenant sees its own apps).
    pages: HashMap<String, Vec<Vec<AppManifest>>>,
    head: Manifest,
    /// [`Manifest::version`] `pages` were made from: the directory's newer one is taken up
    /// on the next look ([`ServerEndpoint::refresh_pages`]).
    pages_version: u64,
    /// Objects tenants are uploading for deploys, by tenant name.
    uploads: HashMap<String, Upload>,
    /// [`super::AppGrant`]s of the directory taken up so far.
    grants_seen: usize,
    /// NIC load reports in a row that showed an older manifest than the newest.
    nic_behind_reports: u64,
    /// Tenants refused for their deploy rate, until when: their control messages over
    /// [`limits::MUTED_CONTROL_BYTES`] are dropped unread until then.
    deploys_muted: HashMap<String, Nanos>,
    stats: ServerStats,
    switch: Selector,
    draining: bool,
    /// Per session: its own view of the Client placement, fed by its own load reports.
    shares: IntMap<u64, ClientShare>,
    next_expiry: Nanos,
    transmits: VecDeque<Transmit>,
    /// Admitted requests waiting for [`ServerEndpoint::run`].
    turns: Turns,
    /// Inside [`ServerEndpoint::handle_alone`] with nothing waiting: work is done as it is
    /// taken in, not queued for a turn it would get next anyway.
    at_once: bool,
    /// Messages for sessions' peers, sealed (and coalesced) when transmitted.
    outbox: Vec<Outgoing>,
    /// Where envelopes are written: once a driver has sent them, their chunk is written
    /// again, with no allocation per message.
    arena: ByteArena,
    /// Sessions refused beyond their credit lately (flooders are muted for a while).
    floods: IntMap<u64, Flood>,
    /// What strangers may still make the server do.
    strangers: Strangers,
    /// The most bytes one sealed datagram may carry (the driver's datagram, less framing).
    datagram_payload: usize,
    /// The channel of the session whose request was last handed in by a client in this
    /// process ([`ServerEndpoint::request_in_process`]), kept for its next one.
    in_process_channel: Option<(u64, Channel)>,
    /// Requests handed in since the switch counts were last published (see
    /// [`PUBLISH_HANDED_IN_EVERY`]).
    unpublished_handed_in: u32,
}

impl<B: HostBackend> ServerEndpoint<B> {
    /// An endpoint serving `config` over `backend`, issuing cookies from `cookies`.
    pub fn new(
        config: ServerConfig,
        backend: B,
        cookies: CookieJar,
        now: Nanos,
    ) -> Result<ServerEndpoint<B>, ManifestError> {
        let pages = tenant_pages(&config.tenants, &config.manifest)?;
        let gate = Gatekeeper::new(
            config.manifest.epoch,
            config.tenants.clone(),
            cookies,
            config.entropy.clone(),
        )
        .with_authentication(config.authentication)
        .with_shard(config.shard);
        Ok(ServerEndpoint {
            backend,
            gate,
            pages,
            head: Manifest {
                apps: Vec::new(),
                ..config.manifest.clone()
            },
            pages_version: config.manifest.version,
            uploads: HashMap::new(),
            grants_seen: 0,
            nic_behind_reports: 0,
            deploys_muted: HashMap::new(),
            config,
            stats: ServerStats::default(),
            switch: Selector::default(),
            draining: false,
            shares: IntMap::default(),
            next_expiry: now + EXPIRY_PERIOD,
            transmits: VecDeque::new(),
            turns: Turns::default(),
            at_once: false,
            outbox: Vec::new(),
            arena: ByteArena::default(),
            floods: IntMap::default(),
            strangers: Strangers::new(now),
            datagram_payload: frame::MIN_DATAGRAM - frame::HEADER,
            in_process_channel: None,
            unpublished_handed_in: 0,
        })
    }

    /// Sets how many bytes one datagram's payload may hold (the driver's datagram size less
    /// its framing): answers that are ready together for one session are coalesced up to it.
    pub fn set_datagram_payload(&mut self, bytes: usize) {
        self.datagram_payload = bytes;
    }

    /// Runs (or queues, or forwards) up to `max` admitted requests, tenants taking turns;
    /// returns how many. A driver calls it after taking in a batch of datagrams, and again
    /// while [`ServerEndpoint::has_waiting`].
    pub fn run(&mut self, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            match self.turns.pop() {
                Some(w) => self.work(w),
                None => break,
            }
            n += 1;
        }
        if n > 0 {
            self.publish_switched();
        }
        n
    }

    /// [`ServerEndpoint::handle`] of a datagram that came alone (an endpoint bound inline in
    /// the sender's thread; a receive loop's batch of one). When no other work waits, it is
    /// opened and its requests are dispatched as they are taken in: the turns would give them
    /// the next turns anyway, and skipping the queue saves moving each request in and out of
    /// it twice. When work waits, the datagram queues behind it as [`ServerEndpoint::handle`]
    /// queues it, for the driver's next [`ServerEndpoint::run`], which it bounds as it bounds
    /// any other.
    pub fn handle_alone(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        self.at_once = self.turns.is_empty();
        let before = (self.stats.host, self.stats.forwarded);
        self.handle(now, peer, msg);
        self.at_once = false;
        if (self.stats.host, self.stats.forwarded) != before {
            self.publish_switched();
        }
    }

    /// Whether work taken in now has its turn at once: inside
    /// [`ServerEndpoint::handle_alone`], with nothing waiting.
    fn turn_is_now(&self) -> bool {
        self.at_once && self.turns.is_empty()
    }

    /// Does one item whose turn came: opens a datagram, or dispatches a request.
    fn work(&mut self, w: Work) {
        match w {
            Work::Request(Waiting {
                sid,
                req,
                ch,
                forward,
            }) => self.dispatch(sid, req, ch, forward),
            Work::Sealed { peer, msg, at, .. } => self.sealed(at, peer, msg),
        }
    }

    /// Tells the other receive loops what this one's switch did.
    fn publish_switched(&mut self) {
        self.unpublished_handed_in = 0;
        let (index, s) = (self.config.shard.index(), &self.stats);
        self.config.directory.publish(index, s.host, s.forwarded);
    }

    /// Whether admitted requests wait for [`ServerEndpoint::run`].
    pub fn has_waiting(&self) -> bool {
        !self.turns.is_empty()
    }

    /// The host backend: executors, registry and steering state.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The host side, to change.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The counters so far.
    pub fn stats(&self) -> ServerStats {
        self.stats
    }

    /// Sessions set up and not expired.
    pub fn sessions(&self) -> usize {
        self.gate.len()
    }

    /// From now on, new requests are refused with `Unavailable` (queued ones finish).
    pub fn start_drain(&mut self) {
        self.draining = true;
    }

    /// The next datagram to send. Answers waiting for the same session are coalesced into
    /// one envelope as far as a datagram holds them.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if !self.outbox.is_empty() {
            // Every message names its session's sealer: the server has none of its own.
            self.stats.batches += coalesce(
                &mut self.outbox,
                self.datagram_payload,
                &mut self.transmits,
                &mut self.arena,
                None,
            );
        }
        self.transmits.pop_front()
    }

    /// Queues `inner` for `ch`'s peer, to be sealed in its session (and coalesced).
    fn send_on(&mut self, ch: &Channel, id: u64, inner: Bytes) {
        self.queue_on(ch, id, Inner::Encoded(inner));
    }

    fn queue_on(&mut self, ch: &Channel, id: u64, inner: Inner) {
        self.queue_into(ch.clone(), id, inner);
    }

    /// [`ServerEndpoint::queue_on`] of a channel that is not used again: its sealer moves
    /// into the outgoing message instead of being shared once more.
    fn queue_into(&mut self, ch: Channel, id: u64, inner: Inner) {
        self.outbox.push(Outgoing {
            to: ch.to,
            sealer: Some(ch.sealer),
            id,
            inner,
            route: None,
        });
    }

    /// Queues reply `r` for `ch`'s peer (a reply that does not encode goes out empty: the
    /// client's retransmission repairs it).
    fn reply_on(&mut self, ch: &Channel, r: Reply) {
        self.queue_on(ch, r.request_id, Inner::reply(r));
    }

    /// [`ServerEndpoint::reply_on`] of a channel that is not used again (see
    /// [`ServerEndpoint::queue_into`]).
    fn reply_into(&mut self, ch: Channel, r: Reply) {
        self.queue_into(ch, r.request_id, Inner::reply(r));
    }

    /// When [`ServerEndpoint::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        Some(self.next_expiry)
    }

    /// Expires idle sessions and their views of the Client placement.
    pub fn handle_timeout(&mut self, now: Nanos) {
        if self.unpublished_handed_in > 0 {
            self.publish_switched();
        }
        if now < self.next_expiry {
            return;
        }
        self.next_expiry = now + EXPIRY_PERIOD;
        // Uploads nobody finished or deployed lately go (a megabyte each at most).
        self.uploads
            .retain(|_, u| now.saturating_sub(u.touched) < UPLOAD_IDLE);
        let before = self.gate.len();
        self.gate.expire(now);
        if self.gate.len() < before {
            tracing::debug!(
                expired = before - self.gate.len(),
                left = self.gate.len(),
                "sessions closed after their idle limit"
            );
        }
        let (gate, shard, directory) = (&self.gate, self.config.shard, &self.config.directory);
        self.shares.retain(|sid, _| gate.session(*sid).is_some());
        if self
            .in_process_channel
            .as_ref()
            .is_some_and(|(sid, _)| gate.session(*sid).is_none())
        {
            self.in_process_channel = None;
        }
        // This loop's sessions that are gone (expired, evicted) leave the directory.
        directory.retain_tenants(|id| shard.owns(id), |id| gate.session(id).is_some());
        if let Some(nic) = directory.nic() {
            if shard.owns(nic.session) && gate.session(nic.session).is_none() {
                directory.unpair(nic.session);
            }
        }
        self.floods
            .retain(|_, f| now < f.muted_until || now.saturating_sub(f.since) <= FLOOD_WINDOW);
    }

    /// Takes in a datagram from `peer`.
    pub fn handle(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        let kind = MessageKind::peek(&msg);
        if kind != Some(MessageKind::Sealed) && !self.strangers.admit(peer, now) {
            // Handshakes and strays beyond the strangers' rate: dropped before any work.
            self.stats.stranger_drops += 1;
            return;
        }
        match kind {
            Some(MessageKind::Sealed) => self.take_sealed(now, peer, msg),
            Some(MessageKind::Control) => self.unsealed_control(now, peer, &msg),
            Some(MessageKind::Request) => {
                self.stats.unauthenticated += 1;
                let id = Request::decode(msg.clone()).map_or(0, |r| r.request_id);
                let r = Reply {
                    status: Status::NoSession,
                    ..malformed(0, id, Placement::Host, "no session: handshake first".into())
                };
                self.send_unproven(peer, msg.len(), id, r.to_bytes().unwrap_or_default());
            }
            Some(MessageKind::OneSidedOp) => {
                self.stats.unauthenticated += 1;
                if let Ok(op) = Operation::decode(msg.clone()) {
                    let c = Completion::error(
                        op.app,
                        op.id,
                        Status::NoSession,
                        "no session: handshake first",
                    );
                    self.send_unproven(peer, msg.len(), op.id, c.to_bytes());
                }
            }
            _ => self.stats.malformed += 1,
        }
    }

    fn push(&mut self, t: Transmit) {
        self.transmits.push_back(t);
    }

    /// Sends an unsealed answer to a peer that has not proved its address, if it is within
    /// the amplification limit of what the peer sent.
    fn send_unproven(&mut self, peer: SocketAddr, received: usize, id: u64, bytes: Bytes) {
        if within_amplification(datagram_len(received), datagram_len(bytes.len())) {
            self.push(Transmit::new(peer, id, bytes));
        } else {
            self.stats.amplification_drops += 1;
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
                // Under the request's id when its header was whole, so the sender matches it.
                let id = Control::request_id(msg).unwrap_or(0);
                self.send_unproven(peer, msg.len(), id, m.to_bytes(id));
                return;
            }
        };
        let answer = match c {
            Control::Hello { nonce, .. } => match self.gate.challenge(now, peer, nonce) {
                Ok((server, cookie)) => Control::Challenge {
                    route: self.new_session_route(),
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
                // A tenant's app created meanwhile is in the session from its start.
                self.take_up_grants();
                let before = self.gate.len();
                match self
                    .gate
                    .authenticate(now, peer, &tenant, &n, issued, &cookie, &proof)
                {
                    Ok(s) => {
                        let (sid, role, sealer) = (s.id, s.role.clone(), s.sealer.clone());
                        if self.gate.len() > before {
                            self.stats.sessions += 1;
                            tracing::debug!(
                                session = format_args!("{sid:#x}"),
                                %peer,
                                role = role_name(&role),
                                "session opened"
                            );
                            if let Role::Tenant { apps, .. } = &*role {
                                let t = TenantSession {
                                    peer,
                                    apps: apps.clone(),
                                    key: sealer.key().clone(),
                                };
                                self.config.directory.open(sid, t);
                            }
                            self.announce(sid);
                        }
                        self.welcome(id, sid, &role, Channel { to: peer, sealer });
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(%peer, tenant = %tenant, "handshake refused: {e}");
                        Control::Error {
                            message: e.to_string(),
                        }
                    }
                }
            }
            _ => {
                self.stats.unauthenticated += 1;
                Control::Error {
                    message: "no session: handshake first".into(),
                }
            }
        };
        self.send_unproven(peer, msg.len(), id, answer.to_bytes(id));
    }

    /// The route a challenged client's `Auth` takes: to the server's loops in turn, so that
    /// sessions spread evenly (the kernel's hash of the addresses puts two clients on one of
    /// two loops half the time). None with a single loop.
    fn new_session_route(&self) -> u8 {
        let count = self.config.shard.count();
        if count < 2 {
            return 0;
        }
        let index = self.config.directory.next_session_loop(count);
        Shard::new(index, count).map_or(0, |s| s.route())
    }

    /// What this endpoint shares with the server's other receive loops (a deployer
    /// publishes manifests there).
    pub fn directory(&self) -> &Arc<SessionDirectory> {
        &self.config.directory
    }

    /// The welcome of a new session: its first manifest page.
    fn welcome(&mut self, id: u64, session: u64, role: &Role, ch: Channel) {
        self.refresh_pages();
        let (apps, pages) = match role {
            Role::Tenant { name, .. } => match self.pages.get(name) {
                Some(p) => (p.first().cloned().unwrap_or_default(), p.len() as u32),
                None => (Vec::new(), 1),
            },
            _ => (Vec::new(), 1),
        };
        let w = Control::Welcome {
            session,
            epoch: self.gate.epoch(),
            client_id: self.backend.next_client_id(),
            manifest: Manifest {
                apps,
                ..self.head.clone()
            },
            pages,
            agent: self.agent(),
            window: self.config.session_credit,
        };
        self.send_on(&ch, id, w.to_bytes(id));
    }

    /// The paired NIC, while it is up.
    fn live_nic(&self) -> Option<PairedNic> {
        self.config
            .directory
            .nic()
            .filter(|_| self.backend.nic_up())
    }

    /// The NIC's one-sided agent, while the NIC is up.
    fn agent(&self) -> Option<SocketAddr> {
        self.live_nic().map(|n| n.agent)
    }

    /// The NIC's channel, when one is paired (its session may be another loop's).
    fn nic_channel(&self) -> Option<Channel> {
        self.config.directory.nic().map(|n| n.channel)
    }

    /// Tells the paired NIC about tenant session `sid`, whichever loop holds it (or that it
    /// is gone, or never was a tenant's).
    fn announce(&mut self, sid: u64) {
        let Some(nic) = self.nic_channel() else {
            return;
        };
        let m = match self.config.directory.tenant(sid) {
            Some(t) => Control::SessionOpen {
                session: sid,
                tenant_tag: t.key.tenant_tag(),
                peer: t.peer,
                apps: t.apps,
                key: t.key.wrap(nic.sealer.key()),
            },
            None => Control::SessionClosed { session: sid },
        };
        // Routed as the session, as its forwards are: the NIC loop that takes them knows it.
        let t = Transmit {
            route: Some(crate::shard::route_of_session(sid)),
            ..nic.transmit(0, &m.to_bytes(0))
        };
        self.push(t);
    }

    /// A sealed datagram: one of a known session within its credits waits, unopened, for its
    /// tenant's turn; any other is opened at once (an unknown session gets its stale notice,
    /// a session over its credit its `Busy` answers, which count towards muting it).
    fn take_sealed(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        let Ok(h) = crate::session::peek_sealed(&msg) else {
            return self.sealed(now, peer, msg);
        };
        if self.drop_if_muted(now, h.session) {
            return;
        }
        let Some(tenant) = self
            .gate
            .session(h.session)
            .map(|s| s.sealer.key().tenant_tag())
        else {
            return self.sealed(now, peer, msg);
        };
        let (by_tenant, by_session) = self.turns.waiting(tenant, h.session);
        if by_session >= self.config.session_credit || by_tenant >= self.config.tenant_credit {
            return self.sealed(now, peer, msg);
        }
        if self.turn_is_now() {
            // Opened at once (see `ServerEndpoint::handle_alone`), never built into a `Work`:
            // that enum is as large as a waiting request, and moving it cost more than the
            // opening's own bookkeeping.
            self.sealed(now, peer, msg);
        } else {
            let w = Work::Sealed {
                sid: h.session,
                peer,
                msg,
                at: now,
            };
            self.turns.push(tenant, w);
        }
    }

    /// Whether session `sid` is muted for flooding at `now`; its datagram is then counted as
    /// dropped.
    fn drop_if_muted(&mut self, now: Nanos, sid: u64) -> bool {
        let muted = self.floods.get(&sid).is_some_and(|f| now < f.muted_until);
        if muted {
            self.stats.flood_drops += 1;
        }
        muted
    }

    /// Opens `msg`, a sealed datagram from `peer`, and takes the messages inside. The
    /// datagram is taken by value: a request forwarded to the NIC goes as it came, and one
    /// answered here drops it, with no reference taken for the rare forward.
    fn sealed(&mut self, now: Nanos, peer: SocketAddr, msg: Bytes) {
        // A session that ignores Busy is not heard for a while: its datagrams are dropped
        // before they cost an opening (only an authenticated flood mutes a session).
        if let Ok(h) = crate::session::peek_sealed(&msg) {
            if self.drop_if_muted(now, h.session) {
                return;
            }
        }
        let (sid, sealer, inner) = match self.gate.open(now, peer, &msg) {
            Ok(o) => (o.session.id, o.session.sealer.clone(), o.inner),
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
                    self.send_unproven(peer, msg.len(), 0, m.to_bytes(0));
                }
                return;
            }
            Err(_) => {
                self.stats.unauthenticated += 1;
                return;
            }
        };
        let ch = Channel { to: peer, sealer };
        if MessageKind::peek(&inner) == Some(MessageKind::Batch) {
            // Several messages in one envelope: each is taken as if it came alone.
            match crate::batch::split(&inner) {
                Ok(members) => {
                    for m in members {
                        let forward = ForwardAs::Member(m.clone());
                        self.session_message(now, sid, ch.clone(), m, forward);
                    }
                }
                Err(_) => self.stats.malformed += 1,
            }
            return;
        }
        self.session_message(now, sid, ch, inner, ForwardAs::Sealed(msg));
    }

    /// One message of session `sid` (alone in its envelope, or one of a batch). The
    /// session's role is read where a message needs it, not carried along.
    fn session_message(
        &mut self,
        now: Nanos,
        sid: u64,
        ch: Channel,
        inner: Bytes,
        forward: ForwardAs,
    ) {
        match MessageKind::peek(&inner) {
            Some(MessageKind::Request) => self.request(now, sid, ch, inner, forward),
            Some(MessageKind::Control) => {
                // Apps created for the tenant meanwhile are in its role first.
                self.take_up_grants();
                // The session was opened just before (no message of its own closes it).
                match self.gate.session(sid).map(|s| s.role.clone()) {
                    Some(role) => self.control(now, sid, &role, ch, &inner),
                    None => self.stats.malformed += 1,
                }
            }
            Some(MessageKind::OneSidedOp) => {
                // One-sided operations are the NIC's job, never the host cores'.
                self.stats.refused += 1;
                if let Ok(op) = Operation::decode(inner) {
                    let c = Completion::error(
                        op.app,
                        op.id,
                        Status::Unavailable,
                        "one-sided operations are served by the NIC's agent (naam-nic), \
                         not by the host",
                    );
                    self.send_on(&ch, op.id, c.to_bytes());
                }
            }
            _ => self.stats.malformed += 1,
        }
    }

    /// Admits request `inner` of session `sid` and queues it for its tenant's turn: beyond
    /// the session's or the tenant's credit it is answered `Busy` at once (admission), so a
    /// flood costs the server a refusal per datagram, never a run.
    fn request(&mut self, now: Nanos, sid: u64, ch: Channel, inner: Bytes, forward: ForwardAs) {
        let gate = &self.gate;
        let admitted = admit(
            inner,
            sid,
            // The session was opened just before; were it gone, it could use nothing.
            |app| gate.session(sid).is_some_and(|s| s.role.may_use(app)),
            self.draining,
            "the server",
            Placement::Host,
        );
        let req = match admitted {
            Ok(req) => req,
            Err(no) => {
                let r = no.counted(&mut self.stats.malformed, &mut self.stats.refused);
                self.reply_on(&ch, r);
                return;
            }
        };
        let tenant = ch.sealer.key().tenant_tag();
        if let Some(r) = self.over_credit(now, sid, tenant, &req) {
            self.reply_on(&ch, r);
            return;
        }
        if self.turn_is_now() {
            // Its turn is now: dispatched without moving the request into a turn and out
            // again.
            self.dispatch(sid, req, ch, forward);
        } else {
            let w = Work::Request(Waiting {
                sid,
                req,
                ch,
                forward,
            });
            self.turns.push(tenant, w);
        }
    }

    /// The `Busy` answer to `req` of session `sid` (of `tenant`) when the session or the tenant
    /// has as many requests waiting as its credit (admission: a flood costs a refusal, never a
    /// run); counted.
    fn over_credit(&mut self, now: Nanos, sid: u64, tenant: u32, req: &Request) -> Option<Reply> {
        let (by_tenant, by_session) = self.turns.waiting(tenant, sid);
        if by_session < self.config.session_credit && by_tenant < self.config.tenant_credit {
            return None;
        }
        self.stats.refused += 1;
        self.stats.over_credit += 1;
        self.refused_over_credit(sid, now);
        let why = if by_session >= self.config.session_credit {
            format!("the session has {by_session} requests waiting, its credit: retry later")
        } else {
            format!("the tenant has {by_tenant} requests waiting, its credit: retry later")
        };
        Some(error_reply(req, Status::Busy, Placement::Host, why))
    }

    /// Takes request `req` of session `sid` from a client in this process, which hands it
    /// over as it is, with no envelope and no encoding (one address space: what a seal and a
    /// codec would guard, the process guards). It is admitted as a request in a datagram of
    /// that session would be (the session's apps only, validity, credit, the tenants'
    /// turns, a muted session's silence) and, when its turn is now, dispatched at once; the
    /// reply of a run here (or a refusal) is written into `out`, the caller's slot
    /// ([`InProcess::Answered`]). Whatever is answered later (queued,
    /// forwarded, behind other work) is answered on the session as a datagram. `now` is the
    /// time on this endpoint's clock (the caller's own reading, when the two share a clock).
    /// The request is taken from where it lies (leaving [`Request::taken`]) only when it is
    /// kept: queued here or at an executor, parked, or forwarded. One answered at once stays
    /// with the caller as it was handed in (a `Request` is 360 bytes: passed by value through
    /// each layer it was copied at each), and the caller may build its next call in it, its
    /// args' buffer included. A session this endpoint does not hold (expired, or the server
    /// restarted) leaves it with the caller (`None`), to send as a datagram, which sets up a
    /// session again.
    pub fn request_in_process(
        &mut self,
        now: Nanos,
        sid: u64,
        req: &mut Request,
        out: &mut Reply,
    ) -> Option<InProcess> {
        let session = self.gate.heard_from(sid, now)?;
        let may_use = session.role.may_use(req.app);
        // The session's channel as the last request handed in left it: made again (its
        // sealer's count taken and given back, two locked instructions) only for another
        // session.
        let ch = match self.in_process_channel.take() {
            Some((s, ch)) if s == sid => ch,
            _ => Channel {
                to: session.peer,
                sealer: session.sealer.clone(),
            },
        };
        let answer = self.take_in_process(now, sid, may_use, &ch, req, out);
        self.in_process_channel = Some((sid, ch));
        Some(answer)
    }

    /// [`ServerEndpoint::request_in_process`] of a session that is held, on its channel;
    /// `may_use`: whether the session may use the request's app.
    fn take_in_process(
        &mut self,
        now: Nanos,
        sid: u64,
        may_use: bool,
        ch: &Channel,
        req: &mut Request,
        out: &mut Reply,
    ) -> InProcess {
        if self.drop_if_muted(now, sid) {
            return InProcess::Dropped;
        }
        req.origin = sid;
        req.handed_in = true;
        let refused = if let Err(e) = req.validate() {
            self.stats.malformed += 1;
            Some(malformed(
                req.app,
                req.request_id,
                Placement::Host,
                e.to_string(),
            ))
        } else {
            match refusal(req, may_use, self.draining, "the server", Placement::Host) {
                Some(r) => {
                    self.stats.refused += 1;
                    Some(r)
                }
                None => self.over_credit(now, sid, ch.sealer.key().tenant_tag(), req),
            }
        };
        if let Some(r) = refused {
            *out = r;
            return InProcess::Answered;
        }
        if !self.turns.is_empty() {
            let tenant = ch.sealer.key().tenant_tag();
            let w = Work::Request(Waiting {
                sid,
                req: std::mem::take(req),
                ch: ch.clone(),
                forward: ForwardAs::InProcess,
            });
            self.turns.push(tenant, w);
            return InProcess::Pending;
        }
        let answered = self.route(sid, req, ch, ForwardAs::InProcess, out);
        self.unpublished_handed_in += 1;
        if self.unpublished_handed_in >= PUBLISH_HANDED_IN_EVERY {
            self.publish_switched();
        }
        if answered {
            InProcess::Answered
        } else {
            InProcess::Pending
        }
    }

    /// Counts a refusal of session `sid` over its credit; one that keeps sending long past it
    /// (more than [`FLOOD_FACTOR`] times its credit, and [`FLOOD_MIN_REFUSALS`], refused
    /// within [`FLOOD_WINDOW`], so it ignores `Busy`) is muted for [`FLOOD_MUTE`].
    fn refused_over_credit(&mut self, sid: u64, now: Nanos) {
        let f = self.floods.entry(sid).or_default();
        if now.saturating_sub(f.since) > FLOOD_WINDOW {
            f.since = now;
            f.refusals = 0;
        }
        f.refusals += 1;
        let limit = FLOOD_FACTOR
            .saturating_mul(self.config.session_credit)
            .max(FLOOD_MIN_REFUSALS);
        if f.refusals > limit {
            f.muted_until = now + FLOOD_MUTE;
            f.refusals = 0;
        }
    }

    /// Runs a request whose turn came: the switch places it at the host (run or queued by the
    /// backend) or forwards it to the NIC.
    fn dispatch(&mut self, sid: u64, mut req: Request, ch: Channel, forward: ForwardAs) {
        let mut out = Reply::unanswered();
        if self.route(sid, &mut req, &ch, forward, &mut out) {
            self.reply_into(ch, out);
        }
    }

    /// [`ServerEndpoint::dispatch`] but for the reply to send now (run here, or refused),
    /// which it writes into `out` rather than sends: true when it did.
    fn route(
        &mut self,
        sid: u64,
        req: &mut Request,
        ch: &Channel,
        forward: ForwardAs,
        out: &mut Reply,
    ) -> bool {
        // Behind an eSwitch, what reaches the host's port was steered here.
        let pinned = req
            .pinned()
            .or(self.backend.switch().map(|_| Placement::Host));
        let id = req.request_id;
        match self
            .backend
            .dispatch(req, &mut self.switch, pinned, ch, out)
        {
            Routed::Answered => {
                self.stats.host += 1;
                true
            }
            Routed::Queued(_) => {
                self.stats.host += 1;
                false
            }
            Routed::Remote(req) => match self.live_nic() {
                Some(PairedNic {
                    channel: nic,
                    agent,
                    ..
                }) => {
                    let f = match &forward {
                        ForwardAs::Sealed(sealed) => control::forward(sealed),
                        ForwardAs::Member(bytes) => control::forward_member(sid, bytes),
                        ForwardAs::InProcess => match req.to_bytes() {
                            Ok(bytes) => control::forward_member(sid, &bytes),
                            Err(e) => {
                                self.stats.malformed += 1;
                                let why = e.to_string();
                                *out = malformed(req.app, id, Placement::Host, why);
                                return true;
                            }
                        },
                    };
                    self.stats.forwarded += 1;
                    // Routed as the client session it belongs to: see `Transmit::route`.
                    self.outbox.push(Outgoing {
                        to: agent,
                        sealer: Some(nic.sealer.clone()),
                        id,
                        inner: Inner::Encoded(f),
                        route: Some(crate::shard::route_of_session(sid)),
                    });
                    false
                }
                None => {
                    self.stats.refused += 1;
                    let why = "the NIC is down".to_string();
                    *out = error_reply(&req, Status::Unavailable, Placement::Nic, why);
                    true
                }
            },
            Routed::Refused(r) => {
                self.stats.refused += 1;
                *out = r;
                true
            }
        }
    }

    /// Takes up the apps created for tenants since the last look ([`super::AppGrant`]): the
    /// credentials and this loop's sessions of their owners get them, the NIC is told of
    /// each session anew, and the tenants' manifest pages are made again. One atomic load
    /// when there is none.
    fn take_up_grants(&mut self) {
        let grants = self.config.directory.grants_after(self.grants_seen);
        if grants.is_empty() {
            return;
        }
        self.grants_seen += grants.len();
        for g in grants {
            grant_app(&mut self.config.tenants, &g.owner, g.app, &g.name);
            for sid in self.gate.grant(&g.owner, g.app, &g.name) {
                if let Some(Role::Tenant { apps, .. }) =
                    self.gate.session(sid).map(|s| (*s.role).clone())
                {
                    self.config.directory.set_tenant_apps(sid, apps);
                    self.announce(sid);
                }
            }
        }
        let newest = self.config.directory.manifest_newer_than(0);
        let m = newest.unwrap_or_else(|| Arc::new(self.config.manifest.clone()));
        if self.make_pages(&m) {
            self.pages_version = m.version;
        }
    }

    /// Makes every tenant's manifest pages from `m` (and the head the pages go out with);
    /// `false`, with the old pages kept and the error logged, when `m` cannot be paged.
    fn make_pages(&mut self, m: &Manifest) -> bool {
        match tenant_pages(&self.config.tenants, m) {
            Ok(pages) => {
                self.pages = pages;
                self.head = Manifest {
                    apps: Vec::new(),
                    ..m.clone()
                };
                true
            }
            Err(e) => {
                tracing::error!(
                    version = m.version,
                    "a published manifest cannot be paged, the previous one is served: {e}"
                );
                false
            }
        }
    }

    fn control(&mut self, now: Nanos, sid: u64, role: &Role, ch: Channel, inner: &Bytes) {
        if self.deploy_muted(now, role, inner.len()) {
            self.stats.deploy_flood_drops += 1;
            return;
        }
        self.stats.control += 1;
        let (id, c) = match Control::decode(inner) {
            Ok(x) => x,
            Err(e) => {
                self.stats.malformed += 1;
                let m = Control::Error {
                    message: format!("malformed control message: {e}"),
                };
                let id = Control::request_id(inner).unwrap_or(0);
                self.send_on(&ch, id, m.to_bytes(id));
                return;
            }
        };
        let refused = |what: &str| Control::Error {
            message: format!("{what} is not allowed in this session"),
        };
        let answer = match (c, role) {
            (Control::QueryManifest { page }, Role::Tenant { name, .. }) => {
                self.refresh_pages();
                let pages = self.pages.get(name).map_or(&[][..], |p| &p[..]);
                let count = pages.len() as u32;
                Some(match pages.get(page as usize) {
                    Some(apps) => Control::ManifestPage {
                        page,
                        pages: count,
                        apps: apps.clone(),
                        version: self.pages_version,
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
            (
                Control::NicLoad {
                    agent,
                    load,
                    manifest,
                },
                Role::Nic,
            ) => {
                // The NIC names its address; an unspecified IP means "as seen".
                let mut at = agent;
                if at.ip().is_unspecified() {
                    at.set_ip(ch.to.ip());
                }
                let fresh = self.config.directory.pair(PairedNic {
                    session: sid,
                    agent: at,
                    channel: ch.clone(),
                });
                self.backend.nic_load(&load);
                self.backend.nic_manifest(manifest);
                let newest = self.config.directory.manifest_version();
                if manifest < newest {
                    // The deployer's announcement may have been lost: said again, now and
                    // then, while the NIC's reports show it behind.
                    self.nic_behind_reports += 1;
                    if self.nic_behind_reports % NUDGE_NIC_EVERY == 1 {
                        let m = Control::ManifestChanged { version: newest };
                        self.send_on(&ch, 0, m.to_bytes(0));
                    }
                } else {
                    self.nic_behind_reports = 0;
                }
                if fresh {
                    tracing::info!(
                        session = format_args!("{sid:#x}"),
                        agent = %at,
                        "naam-nic paired; its agent serves one-sided operations"
                    );
                    // A newly paired NIC learns every tenant session at once, every loop's.
                    for s in self.config.directory.tenant_ids() {
                        self.announce(s);
                    }
                }
                None
            }
            (Control::NicBye, Role::Nic) => {
                if self.config.directory.is_nic(sid) {
                    tracing::info!("naam-nic said goodbye: its share goes to the host");
                    self.backend.nic_gone();
                }
                None
            }
            (Control::QuerySession { session }, Role::Nic) => {
                self.announce(session);
                None
            }
            (
                Control::DeployChunk {
                    app,
                    total,
                    object_hash,
                    offset,
                    bytes,
                },
                Role::Tenant { name, .. },
            ) => Some(self.deploy_chunk(now, name, role, (app, total, object_hash), offset, bytes)),
            (
                Control::Deploy {
                    app,
                    object_hash,
                    handlers,
                    engine,
                    budget,
                },
                Role::Tenant { name, apps },
            ) => {
                let checked = self
                    .deploy_allowed(now, name, sid, id)
                    .and_then(|()| handler_names_fit(&handlers))
                    .and_then(|()| self.uploaded(name, role, app, object_hash, handlers.len()));
                match checked {
                    Ok(object) => {
                        let change = DeployChange::Install {
                            object,
                            handlers,
                            engine,
                            budget,
                        };
                        self.deploy_job(sid, (name, apps), id, app, change, &ch)
                    }
                    Err(message) => Some(Control::Error { message }),
                }
            }
            (Control::Undeploy { app }, Role::Tenant { name, apps }) => {
                match self.deploy_allowed(now, name, sid, id) {
                    Err(message) => Some(Control::Error { message }),
                    Ok(()) if role.may_use(app) => {
                        self.deploy_job(sid, (name, apps), id, app, DeployChange::Remove, &ch)
                    }
                    Ok(()) => Some(not_yours(app)),
                }
            }
            (
                Control::CreateApp {
                    name: app_name,
                    regions,
                },
                Role::Tenant { name, apps },
            ) => {
                let checked = self
                    .deploy_allowed(now, name, sid, id)
                    .and_then(|()| new_app_fits(&app_name, &regions))
                    .and_then(|()| self.name_free_for(name, &app_name));
                match checked {
                    Ok(()) => {
                        let change = DeployChange::Create {
                            name: app_name,
                            regions,
                        };
                        self.deploy_job(sid, (name, apps), id, 0, change, &ch)
                    }
                    Err(message) => Some(Control::Error { message }),
                }
            }
            (Control::Congest { extra_ns }, Role::Operator) => Some(self.congest(extra_ns)),
            (Control::QuerySwitch { pin, unpin }, Role::Operator) => {
                Some(self.query_switch(pin, unpin))
            }
            (Control::VerbsConnect { endpoint }, Role::Tenant { .. }) => {
                Some(match self.backend.verbs() {
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
                | Control::QuerySwitch { .. }
                | Control::DeployChunk { .. }
                | Control::Deploy { .. }
                | Control::Undeploy { .. }
                | Control::CreateApp { .. }),
                _,
            ) => Some(refused(c.name())),
            (other, _) => Some(Control::Error {
                message: format!("unexpected control message {}", other.name()),
            }),
        };
        if let Some(a) = answer {
            self.send_on(&ch, id, a.to_bytes(id));
        }
    }

    /// `app`'s weights for session `sid`, after taking in the session's own load report: a
    /// report moves only its own session's Client share ([`ClientShare`]).
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
        let Some(handler_ids) = self.backend.handlers(app) else {
            return Control::Error {
                message: format!("no app {app}"),
            };
        };
        let mut share = match self.shares.remove(&sid) {
            Some(s) => Some(s),
            None => self.backend.client_share(),
        };
        if let (Some(share), Some(mut load)) = (share.as_mut(), client) {
            // Only the session's own apps' handlers that exist: a report cannot grow the view
            // past what the session may run.
            let backend = &self.backend;
            load.handlers
                .retain(|h| role.may_use(h.app) && backend.has_handler(h.app, h.handler));
            share.absorb(&load, rtt_ns);
        }
        let handlers = handler_ids
            .into_iter()
            .map(|h| HandlerWeights {
                handler: h,
                weights: self.backend.weights(app, h, share.as_mut()).0,
            })
            .collect();
        if let Some(s) = share {
            self.shares.insert(sid, s);
        }
        Control::Weights {
            app,
            handlers,
            agent: self.agent(),
            manifest: self
                .pages_version
                .max(self.config.directory.manifest_version()),
        }
    }

    /// Takes up the manifest a deploy published, if newer than the one this loop's pages
    /// were made from. One that cannot be paged leaves the old pages (the deployer checks a
    /// deploy's pages before it publishes; this is the last guard).
    fn refresh_pages(&mut self) {
        let Some(m) = self
            .config
            .directory
            .manifest_newer_than(self.pages_version)
        else {
            return;
        };
        self.make_pages(&m);
        self.pages_version = m.version;
    }

    /// Hands tenant `tenant` (with its apps)'s checked `change` of `app`, asked for by
    /// session `sid` as request `id`, to the backend; its answer now, if it has one.
    fn deploy_job(
        &mut self,
        sid: u64,
        tenant: (&str, &[u32]),
        id: u64,
        app: u32,
        change: DeployChange,
        ch: &Channel,
    ) -> Option<Control> {
        let job = DeployJob {
            tenant: tenant.0.to_string(),
            tenant_apps: tenant.1.to_vec(),
            session: sid,
            id,
            app,
            change,
        };
        self.backend.deploy(job, ch)
    }

    /// Whether tenant `tenant` may give a new app the name `app_name`: no other credential's
    /// hello names it (a tenant's own created app's name is its own), and it is not a role's
    /// reserved name; else why not.
    fn name_free_for(&self, tenant: &str, app_name: &str) -> Result<(), String> {
        use crate::session::{NIC_TENANT, OPERATOR_TENANT};
        let mine = self
            .config
            .tenants
            .iter()
            .find(|t| t.name == tenant)
            .map(|t| &t.credential);
        let clash = self
            .config
            .tenants
            .iter()
            .any(|t| t.name == app_name && Some(&t.credential) != mine);
        if clash || app_name == NIC_TENANT || app_name == OPERATOR_TENANT {
            Err(format!("the app name {app_name} is taken"))
        } else {
            Ok(())
        }
    }

    /// Takes one of tenant `tenant`'s deploy tokens ([`ServerConfig::deploys_per_second`],
    /// counted over every loop) for session `sid`'s deploy of request id `id` (a
    /// retransmission of the last one takes none); `Err`: the refusal, saying when to retry.
    fn deploy_allowed(
        &mut self,
        now: Nanos,
        tenant: &str,
        sid: u64,
        id: u64,
    ) -> Result<(), String> {
        let rate = self.config.deploys_per_second;
        let wait = match self
            .config
            .directory
            .take_deploy_token(tenant, sid, id, now, rate)
        {
            Ok(()) => return Ok(()),
            Err(wait) => wait,
        };
        // Until the wait is over, this tenant's uploads are not read (see `deploy_muted`).
        let until = now.saturating_add((wait * 1e9).min(u64::MAX as f64) as u64);
        self.deploys_muted.insert(tenant.to_string(), until);
        Err(format!(
            "tenant {tenant} deploys at most {rate} times a second here: retry in {} ms",
            (wait * 1e3).ceil()
        ))
    }

    /// Whether a control message of `len` bytes from a session of `role` is dropped unread:
    /// its tenant was refused for its deploy rate and the wait is not over, and the message
    /// is larger than anything but an upload ([`limits::MUTED_CONTROL_BYTES`]). Costs one
    /// emptiness check while no tenant is muted.
    fn deploy_muted(&mut self, now: Nanos, role: &Role, len: usize) -> bool {
        if self.deploys_muted.is_empty() || len <= limits::MUTED_CONTROL_BYTES {
            return false;
        }
        let Role::Tenant { name, .. } = role else {
            return false;
        };
        match self.deploys_muted.get(name.as_str()) {
            Some(&until) if now < until => true,
            Some(_) => {
                self.deploys_muted.remove(name.as_str());
                false
            }
            None => false,
        }
    }

    /// Takes in bytes of tenant `tenant`'s upload for `app` ([`Control::DeployChunk`]).
    /// `object`: the app it is for, the object's length and its [`control::object_hash`].
    fn deploy_chunk(
        &mut self,
        now: Nanos,
        tenant: &str,
        role: &Role,
        object: (u32, u32, u64),
        offset: u32,
        bytes: Vec<u8>,
    ) -> Control {
        let (app, total, hash) = object;
        if !role.may_use(app) {
            return not_yours(app);
        }
        let error = |message: String| Control::Error { message };
        if total as usize > limits::MAX_DEPLOY_OBJECT || total == 0 {
            return error(format!(
                "an object of {total} bytes: a deploy uploads 1 to {} bytes",
                limits::MAX_DEPLOY_OBJECT
            ));
        }
        let end = offset as u64 + bytes.len() as u64;
        if end > total as u64 {
            return error(format!(
                "bytes {offset}..{end} run past the object's {total} bytes"
            ));
        }
        if offset == 0 {
            // A new upload, unless it is the first chunk again: whatever was being uploaded
            // goes.
            let repeat = self.uploads.get(tenant).is_some_and(|u| {
                u.app == app
                    && u.total == total
                    && u.hash == hash
                    && u.held().get(..bytes.len()) == Some(&bytes[..])
            });
            if !repeat {
                self.uploads.insert(
                    tenant.to_string(),
                    Upload {
                        app,
                        total,
                        hash,
                        bytes: Vec::new(),
                        whole: None,
                        touched: now,
                    },
                );
            }
        }
        let Some(u) = self.uploads.get_mut(tenant) else {
            return error(format!(
                "no upload in progress for app {app}: start at offset 0"
            ));
        };
        u.touched = now;
        if u.app != app || u.total != total || u.hash != hash {
            return error(format!(
                "an upload for app {} of {} bytes is in progress: start again at offset 0",
                u.app, u.total
            ));
        }
        let held = u.held().len() as u64;
        if end <= held {
            // A retransmitted chunk: answered again.
        } else if offset as u64 == held {
            u.bytes.extend_from_slice(&bytes);
            if u.bytes.len() == total as usize {
                u.whole = Some(Bytes::from(std::mem::take(&mut u.bytes)));
            }
        } else {
            return error(format!(
                "bytes from {offset}: the upload holds {held} bytes, send from there"
            ));
        }
        Control::DeployReceived {
            app,
            received: u.held().len() as u32,
        }
    }

    /// The whole object tenant `tenant` uploaded for `app`, if its hash is `hash`; else why
    /// not.
    fn uploaded(
        &self,
        tenant: &str,
        role: &Role,
        app: u32,
        hash: u64,
        handlers: usize,
    ) -> Result<Bytes, String> {
        if !role.may_use(app) {
            return Err(format!(
                "app {app} is not this tenant's: a tenant deploys only into its own apps"
            ));
        }
        if handlers > limits::MAX_DEPLOY_HANDLERS {
            return Err(format!(
                "{handlers} handlers in one deploy: at most {}",
                limits::MAX_DEPLOY_HANDLERS
            ));
        }
        let u = self
            .uploads
            .get(tenant)
            .filter(|u| u.app == app)
            .ok_or_else(|| format!("no object uploaded for app {app}: upload it first"))?;
        let whole = u.whole.as_ref().ok_or_else(|| {
            format!(
                "the object for app {app} is not whole: {} of {} bytes uploaded",
                u.bytes.len(),
                u.total
            )
        })?;
        let got = control::object_hash(whole);
        if got != hash {
            return Err(format!(
                "the uploaded object's hash is {got:#x}, the deploy names {hash:#x}"
            ));
        }
        Ok(whole.clone())
    }

    fn congest(&mut self, extra_ns: Option<u64>) -> Control {
        if !self.config.congestion_control {
            Control::Error {
                message: "this server does not allow congestion control (set \
                          allow_congestion_control = true in its config to run congestion \
                          experiments)"
                    .into(),
            }
        } else if let Some(ns) = extra_ns.filter(|ns| *ns > control::MAX_CONGESTION_NS) {
            Control::Error {
                message: format!(
                    "congestion of {ns} ns per message is over the limit of {} ns",
                    control::MAX_CONGESTION_NS
                ),
            }
        } else {
            self.backend.congest(extra_ns);
            Control::Congestion { extra_ns }
        }
    }

    fn query_switch(&mut self, pin: Option<u32>, unpin: bool) -> Control {
        let change = match (pin, unpin) {
            (Some(p), _) => Some(Some(p)),
            (None, true) => Some(None),
            (None, false) => None,
        };
        self.publish_switched();
        let (host, nic) = self.config.directory.switched();
        let userspace = SwitchCounters {
            host,
            nic,
            fragmented: 0,
        };
        match self.backend.switch() {
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

#[cfg(test)]
mod coalescing_tests {
    use super::*;
    use crate::session::{Sender, SessionKey};

    #[test]
    fn replies_encoded_in_their_envelope_open_as_the_replies() {
        let key = Arc::new(SessionKey::new(5, 1, [3; 32]));
        let sealer = Arc::new(Sealer::new(key.clone(), Sender::Server));
        let to: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let reply = |id: u64, n: usize| Reply {
            app: 1,
            request_id: id,
            status: Status::Ok,
            code: 7,
            steps: 2,
            placement: Placement::Host,
            load: LoadFeedback {
                queue_depth: 3,
                utilisation_permille: 500,
                queue_delay_ns: 11,
                service_ns: 13,
            },
            payload: Bytes::from(vec![id as u8; n]),
        };
        let outgoing = |inner: Inner, id: u64| Outgoing {
            to,
            sealer: Some(sealer.clone()),
            id,
            inner,
            route: None,
        };
        let mut t = VecDeque::new();
        // Alone: encoded straight into the envelope.
        let mut out = vec![outgoing(Inner::reply(reply(1, 1000)), 1)];
        coalesce(&mut out, 8948, &mut t, &mut ByteArena::default(), None);
        let opened = key.open(&t[0].message()).unwrap().1;
        assert_eq!(Reply::decode(opened).unwrap(), reply(1, 1000));
        // In a batch with a message encoded before.
        let mut out = vec![
            outgoing(Inner::reply(reply(2, 10)), 2),
            outgoing(Inner::Encoded(reply(3, 20).to_bytes().unwrap()), 3),
        ];
        assert_eq!(
            coalesce(&mut out, 8948, &mut t, &mut ByteArena::default(), None),
            1
        );
        let opened = key.open(&t[1].message()).unwrap().1;
        let parts = crate::batch::split(&opened).unwrap();
        assert_eq!(Reply::decode(parts[0].clone()).unwrap(), reply(2, 10));
        assert_eq!(Reply::decode(parts[1].clone()).unwrap(), reply(3, 20));
        // A payload over the wire's limit goes out empty, as an eager encoding did.
        let over = reply(4, naam_ebpf::abi::REPLY_CAP + 1);
        assert!(over.to_bytes().is_err());
        assert!(Inner::reply(over).is_empty());
    }

    #[test]
    fn an_envelope_that_fits_a_datagram_is_framed_as_the_one_fragment_a_driver_would_make() {
        let key = Arc::new(SessionKey::new(5, 1, [3; 32]));
        let sealer = Arc::new(Sealer::new(key.clone(), Sender::Server));
        let to: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let outgoing = |n: usize, id: u64, route: Option<u8>| Outgoing {
            to,
            sealer: Some(sealer.clone()),
            id,
            inner: Inner::Encoded(Bytes::from(vec![7u8; n])),
            route,
        };
        let limit = 1448;
        let mut t = VecDeque::new();
        let mut arena = ByteArena::default();
        let mut out = vec![outgoing(1000, 41, None), outgoing(5000, 42, Some(9))];
        coalesce(&mut out, limit, &mut t, &mut arena, None);
        let (fits, over) = (&t[0], &t[1]);
        let d = fits.framed(limit + frame::HEADER).expect("framed");
        let want = frame::fragment(41, fits.bytes(), limit + frame::HEADER).unwrap();
        assert_eq!(want.len(), 1);
        assert_eq!(d, &want[0], "the driver's own fragment, byte for byte");
        let f = frame::Fragment::decode(d.clone()).unwrap();
        assert_eq!(
            (f.message, f.count, f.data.clone()),
            (41, 1, fits.message())
        );
        assert_eq!(key.open(&fits.message()).unwrap().1, vec![7u8; 1000]);
        // Too big for one datagram: the driver fragments it.
        assert!(over.framed(usize::MAX).is_none());
        // A datagram the driver's is smaller than, or a transmit changed after it was made,
        // is not sent as framed.
        assert!(fits.framed(d.len() - 1).is_none());
        let rerouted = Transmit {
            route: Some(3),
            ..fits.clone()
        };
        assert!(rerouted.framed(usize::MAX).is_none());
        let renamed = Transmit {
            id: 40,
            ..fits.clone()
        };
        assert!(renamed.framed(usize::MAX).is_none());
    }

    #[test]
    fn one_session_s_window_is_coalesced_in_order_and_the_outbox_keeps_its_capacity() {
        let key = Arc::new(SessionKey::new(5, 1, [3; 32]));
        let sealer = Arc::new(Sealer::new(key.clone(), Sender::Server));
        let to: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut out: Vec<Outgoing> = (0..3u64)
            .map(|i| Outgoing {
                to,
                sealer: Some(sealer.clone()),
                id: 10 + i,
                inner: Inner::Encoded(Bytes::from(vec![i as u8 + 1; 100])),
                route: None,
            })
            .collect();
        let capacity = out.capacity();
        let mut t = VecDeque::new();
        assert_eq!(
            coalesce(&mut out, 8948, &mut t, &mut ByteArena::default(), None),
            1,
            "one batch of three"
        );
        assert!(out.is_empty());
        assert_eq!(
            out.capacity(),
            capacity,
            "the outbox is reused, not reallocated"
        );
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].id, 10, "the first message names the batch");
        let parts = crate::batch::split(&key.open(&t[0].message()).unwrap().1).unwrap();
        let firsts: Vec<u8> = parts.iter().map(|p| p[0]).collect();
        assert_eq!(firsts, vec![1, 2, 3]);
        // A lone message goes as itself, not as a batch of one.
        out.push(Outgoing {
            to,
            sealer: Some(sealer),
            id: 20,
            inner: Inner::Encoded(Bytes::from_static(b"alone")),
            route: None,
        });
        assert_eq!(
            coalesce(&mut out, 8948, &mut t, &mut ByteArena::default(), None),
            0
        );
        assert_eq!(&key.open(&t[1].message()).unwrap().1[..], b"alone");
    }

    #[test]
    fn answers_for_one_session_share_datagrams_up_to_the_limit() {
        let key = Arc::new(SessionKey::new(5, 1, [3; 32]));
        let sealer = Arc::new(Sealer::new(key.clone(), Sender::Server));
        let other = Arc::new(Sealer::new(key.clone(), Sender::Server));
        let to: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut out: Vec<Outgoing> = (0..10u64)
            .map(|i| Outgoing {
                to,
                sealer: Some(if i == 4 {
                    other.clone()
                } else {
                    sealer.clone()
                }),
                id: i,
                inner: Inner::Encoded(Bytes::from(vec![i as u8 + 1; 1000])),
                route: None,
            })
            .collect();
        let mut t = VecDeque::new();
        coalesce(&mut out, 8948, &mut t, &mut ByteArena::default(), None);
        // Nine for one sealer: eight in the first datagram (4 + 8 x 1,002 bytes fit in
        // 8,152; nine do not), one in the next; the other sealer's one alone.
        assert_eq!(
            t.len(),
            3,
            "{:?}",
            t.iter().map(|t| t.bytes().len()).collect::<Vec<_>>()
        );
        let opened = key.open(&t[0].message()).unwrap().1;
        let parts = crate::batch::split(&opened).unwrap();
        assert_eq!(parts.len(), 8);
        assert_eq!(
            parts[4][0], 6,
            "arrival order kept, the other sealer's skipped"
        );
        assert_eq!(key.open(&t[1].message()).unwrap().1.len(), 1000);
    }
}
