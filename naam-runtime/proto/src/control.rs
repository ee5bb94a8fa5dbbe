//! Control-plane messages of the datagram fabric, IO-free: the session handshake, the manifest a
//! server shows a session (its own apps, handlers, regions, rkeys and client rights), weight
//! queries, the NIC's pairing, session announcements and load reports, and the header of
//! requests the switch forwards to the NIC.
//!
//! Control message: `0 u8 version, 1 u8 kind (5), 2 u8 route, 3 u8 0, 4 u32 0, 8 u64 id, 16
//! JSON body`. The route is 0 but in an `Auth`, which carries the route its `Challenge` named:
//! the framing copies it into every fragment ([`crate::shard::route_of`]), so the kernel hands
//! the `Auth` to the receive loop the server chose for the new session.
//! Only `Hello`, `Challenge`, `Auth` and `Stale` travel unsealed; everything else is sealed in
//! a session ([`crate::session`]).
//! Forwarded request: `0 u8 version, 1 u8 kind (6), 2 u16 0, 4 u32 0, 8 the client's sealed
//! request as it arrived`; it travels sealed in the NIC's pairing session, and the NIC checks
//! the client's seal itself and answers only the client session's address.

use std::net::SocketAddr;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::kind::VERSION;
use crate::session::{COOKIE_LEN, NONCE_LEN, RESET_TOKEN_LEN};
use crate::steering::RemoteLoad;
use crate::wire::{header, WireError};

use crate::kind::{CONTROL as KIND_CONTROL, FORWARD as KIND_FORWARD};
/// Bytes before a control message's JSON body (version, kind, route, reserved zeros, id).
pub const CONTROL_HEADER: usize = 16;
/// Offset of the route byte in a control message's header.
pub const CONTROL_ROUTE: usize = 2;
/// Bytes before the client's sealed request in a forwarded message (version, kind, zeros).
pub const FORWARD_HEADER: usize = 8;

/// A handler as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerManifest {
    /// Section name in the object.
    pub name: String,
    /// Id on the wire.
    pub id: u32,
    /// Read-only (may run at the client) or a write (at the owner).
    pub write: bool,
    /// The engine the server runs it on (the NIC and clients use the same).
    pub engine: crate::EngineKind,
    /// Instructions per step before `budget exhausted`.
    pub budget: u64,
}

/// A region as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionManifest {
    /// Name from the app's spec (`mica-log`, an object app's configured name): what
    /// [`AppManifest::region_key`] and the NIC look the region up by.
    pub name: String,
    /// The key descriptors and one-sided operations name it by (never 0); naam-server derives it
    /// from the tenant's credential, so it survives restarts.
    pub rkey: u64,
    /// `ACCESS_*` rights handlers have on it.
    pub access: u32,
    /// `ACCESS_*` rights a client's one-sided operations have on it: read-only unless the
    /// app's config opts into client one-sided writes.
    #[serde(default)]
    pub client_access: u32,
    /// Size in bytes.
    pub len: u64,
    /// The shared-memory file backing it (the NIC maps it; clients ignore it).
    pub path: Option<String>,
}

/// One app a server serves, as the manifest lists it: its id, handlers, regions and the
/// hash of its handler object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppManifest {
    /// App id requests carry; unique among the server's apps.
    pub id: u32,
    /// Name from its spec (`mica`, `btree`, an object app's configured name); instances share
    /// it, so look apps up by id.
    pub name: String,
    /// Application kind (`mica`, `btree`, or `object` for a plain eBPF object).
    pub kind: String,
    /// Kind-specific parameters (the table geometry a client needs).
    pub params: serde_json::Value,
    /// Path of the handler object (an eBPF ELF) the server loaded.
    pub object: String,
    /// [`object_hash`] of the object's bytes, so a client can check it runs the same handlers.
    pub object_hash: u64,
    /// Every handler the server registered for it; clients take handler ids and read/write
    /// kinds from here.
    pub handlers: Vec<HandlerManifest>,
    /// Its regions; in a session's copy ([`Manifest::scoped`]) `access` holds the client's
    /// rights and `path` is `None`.
    pub regions: Vec<RegionManifest>,
}

impl AppManifest {
    /// The rkey of region `name`.
    pub fn region_key(&self, name: &str) -> Option<u64> {
        self.regions.iter().find(|r| r.name == name).map(|r| r.rkey)
    }
}

/// What a server serves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The served apps in config order; a session is shown only its own ([`Manifest::scoped`]),
    /// a page at a time ([`Manifest::pages`]).
    pub apps: Vec<AppManifest>,
    /// The mode label (`udp`: NIC cores, DMA and one-sided RDMA emulated).
    pub mode: String,
    /// Name of the server's steering policy (empty when the field is absent).
    #[serde(default)]
    pub policy: String,
    /// The server start this manifest belongs to (random per start): a NIC holding an older
    /// one must map the regions anew.
    #[serde(default)]
    pub epoch: u64,
    /// Bumped by every deploy and undeploy in this start (0 as it started): a client or NIC
    /// holding an older one asks for the manifest again.
    #[serde(default)]
    pub version: u64,
}

impl Manifest {
    /// The app with id `id`; `None` also when a session's scoped copy leaves it out.
    pub fn app(&self, id: u32) -> Option<&AppManifest> {
        self.apps.iter().find(|a| a.id == id)
    }

    /// The first app of `kind`.
    pub fn app_of_kind(&self, kind: &str) -> Option<&AppManifest> {
        self.apps.iter().find(|a| a.kind == kind)
    }

    /// What a session of `apps` is shown: those apps only, each region with the rights
    /// clients have on it, and no server file paths.
    pub fn scoped(&self, apps: &[u32]) -> Manifest {
        let mut wanted = apps.to_vec();
        wanted.sort_unstable();
        Manifest {
            apps: self
                .apps
                .iter()
                .filter(|a| wanted.binary_search(&a.id).is_ok())
                .map(|a| AppManifest {
                    object: std::path::Path::new(&a.object)
                        .file_name()
                        .map(|f| f.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    regions: a
                        .regions
                        .iter()
                        .map(|r| RegionManifest {
                            access: r.client_access,
                            path: None,
                            ..r.clone()
                        })
                        .collect(),
                    ..a.clone()
                })
                .collect(),
            ..self.clone()
        }
    }

    /// Every app of `kind`, in manifest order.
    pub fn apps_of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a AppManifest> {
        self.apps.iter().filter(move |a| a.kind == kind)
    }

    /// Splits the apps into pages, each small enough for one control message: a server with
    /// many apps (the scale experiment registers hundreds) cannot send its manifest at once.
    /// An app whose own entry is over the budget is an error, found when the server starts
    /// rather than as a client's silent timeout.
    pub fn pages(&self) -> Result<Vec<Vec<AppManifest>>, ManifestError> {
        let mut pages = vec![Vec::new()];
        let mut used = 0;
        for a in &self.apps {
            let size = serde_json::to_vec(a).map_or(usize::MAX, |v| v.len()) + 1;
            if size > MANIFEST_PAGE_BUDGET {
                return Err(ManifestError::AppTooLarge {
                    app: a.id,
                    size,
                    budget: MANIFEST_PAGE_BUDGET,
                });
            }
            if used + size > MANIFEST_PAGE_BUDGET {
                pages.push(Vec::new());
                used = 0;
            }
            used += size;
            pages.last_mut().expect("one page at least").push(a.clone());
        }
        Ok(pages)
    }
}

/// The most extra busy time per host message [`Control::Congest`] may ask for: beyond it an
/// operator's typo would stall every executor.
pub const MAX_CONGESTION_NS: u64 = 10_000_000;

/// Bytes of app entries one manifest page carries: a control message's limit less its header
/// and room for the envelope (client id, agent address, mode, page numbers).
pub const MANIFEST_PAGE_BUDGET: usize = crate::limits::MAX_MESSAGE - CONTROL_HEADER - 512;

/// Why a manifest cannot be published.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// One app's entry does not fit a control message.
    #[error("app {app}'s manifest entry is {size} bytes, over the {budget} one control message carries (fewer handlers or regions, or shorter names)")]
    AppTooLarge {
        /// The app whose entry does not fit.
        app: u32,
        /// Bytes of its JSON entry, plus one.
        size: usize,
        /// [`MANIFEST_PAGE_BUDGET`], in bytes.
        budget: usize,
    },
}

/// A handler a deploy names ([`Control::Deploy`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeployHandler {
    /// Its name in the object (section `naam/<name>`).
    pub name: String,
    /// A write (runs at the app's owner) rather than a read.
    #[serde(default)]
    pub write: bool,
}

/// A region an app created at run time starts with ([`Control::CreateApp`]): zeroed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewRegion {
    /// Its name (descriptors' rkeys are looked up by it); 1 to
    /// [`crate::limits::MAX_CREATED_NAME`] letters, digits, `-` and `_`.
    pub name: String,
    /// Its size in bytes (at least 1; the tenant's region quota bounds it).
    pub len: u64,
    /// `ACCESS_*` rights its handlers get on it (other bits are refused).
    pub access: u32,
}

/// Whether `name` may name an app or region a tenant creates: 1 to
/// [`crate::limits::MAX_CREATED_NAME`] ASCII letters, digits, `-` and `_` (the server
/// makes file names of it), else why not.
pub fn check_created_name(what: &str, name: &str) -> Result<(), String> {
    let fits = !name.is_empty() && name.len() <= crate::limits::MAX_CREATED_NAME;
    let plain = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if fits && plain {
        Ok(())
    } else {
        Err(format!(
            "{what} name {:?}: names are 1 to {} ASCII letters, digits, '-' and '_'",
            name.chars().take(80).collect::<String>(),
            crate::limits::MAX_CREATED_NAME
        ))
    }
}

/// The verifier's report on one deployed handler ([`Control::Deployed`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployReport {
    /// Its name.
    pub name: String,
    /// Its wire id.
    pub id: u32,
    /// A write.
    pub write: bool,
    /// The engine it runs on.
    pub engine: crate::EngineKind,
    /// Instructions per step before `budget exhausted`.
    pub budget: u64,
    /// Instruction slots in the linked program.
    pub insns: usize,
    /// Functions, the entry included.
    pub functions: usize,
    /// Distinct helpers it calls.
    pub helpers: usize,
    /// Backward jumps (loops, metered by the budget).
    pub backward_jumps: usize,
    /// Memory accesses proved in bounds, hinted, and checked at run time.
    pub accesses: [usize; 3],
    /// Microseconds from the deploy's start until it could answer.
    pub build_us: u64,
}

/// One handler's weights.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HandlerWeights {
    /// Handler id ([`crate::handler_id`] of its name).
    pub handler: u32,
    /// Fractions per placement (Client, Nic, Host).
    pub weights: [f64; 3],
}

/// How an RDMA queue pair is reached: exchanged over this control channel before connecting
/// (the `verbs` backend; no librdmacm).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port GID (RoCE addressing).
    pub gid: [u8; 16],
}

/// Remote memory as RDMA names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRemote {
    /// Address of the region's first byte in the server's registration: RDMA work requests
    /// add offsets to it.
    pub addr: u64,
    /// Remote key of the RDMA registration.
    pub rkey: u32,
}

/// A NAAM region registered for RDMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegion {
    /// The app that owns the region; a client uses it only for that app's descriptors.
    pub app: u32,
    /// The NAAM rkey descriptors use.
    pub naam_rkey: u64,
    /// Where RDMA finds it.
    pub remote: RdmaRemote,
    /// Size in bytes.
    pub len: u64,
    /// The `ACCESS_*` rights NAAM grants on it (RDMA registers every region for remote access;
    /// a client checks these before it posts).
    pub access: u32,
}

/// A control message: a JSON body after [`CONTROL_HEADER`] bytes. Only `Hello`, `Challenge`,
/// `Auth` and `Stale` travel unsealed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Control {
    /// Client → server, unsealed: a handshake for `tenant` (an app's name, [`NIC_TENANT`] or
    /// [`OPERATOR_TENANT`]). Padded with white space to [`crate::session::HELLO_PADDING`].
    ///
    /// [`NIC_TENANT`]: crate::session::NIC_TENANT
    /// [`OPERATOR_TENANT`]: crate::session::OPERATOR_TENANT
    Hello {
        /// Whose credential the client holds.
        tenant: String,
        /// The client's fresh nonce.
        #[serde(with = "crate::session::hex_bytes")]
        nonce: [u8; NONCE_LEN],
    },
    /// Server → client, unsealed: the server's nonce and a cookie proving the address.
    Challenge {
        /// The route the client's `Auth` travels with: the receive loop that will hold the
        /// session, chosen in turn over the server's loops ([`crate::shard`]); 0, the loop
        /// the kernel's hash picks. Not trusted: any loop can set a session up.
        #[serde(default)]
        route: u8,
        /// The server's fresh nonce.
        #[serde(with = "crate::session::hex_bytes")]
        nonce: [u8; NONCE_LEN],
        /// When the cookie was issued (server time, ns).
        issued: u64,
        /// The cookie, to be sent back.
        #[serde(with = "crate::session::hex_bytes")]
        cookie: [u8; COOKIE_LEN],
    },
    /// Client → server, unsealed: the proof that the client holds `tenant`'s credential.
    Auth {
        /// The tenant named in the hello.
        tenant: String,
        /// The client's nonce, as the hello carried it.
        #[serde(with = "crate::session::hex_bytes")]
        client_nonce: [u8; NONCE_LEN],
        /// The server's nonce, from the challenge.
        #[serde(with = "crate::session::hex_bytes")]
        server_nonce: [u8; NONCE_LEN],
        /// The challenge's `issued`, echoed: the cookie is checked against it and expires after
        /// [`crate::session::COOKIE_LIFETIME`].
        issued: u64,
        /// The challenge's cookie, echoed unchanged (it proves the client's address).
        #[serde(with = "crate::session::hex_bytes")]
        cookie: [u8; COOKIE_LEN],
        /// MAC under the credential of the tenant, both nonces and the cookie.
        #[serde(with = "crate::session::hex_bytes")]
        proof: [u8; 32],
    },
    /// Server → client, unsealed: the session this datagram named is not known here (the
    /// server restarted, or forgot an idle session): handshake again.
    Stale {
        /// Id of the session the datagram named.
        session: u64,
        /// The server's current epoch (random per start; see [`Manifest::epoch`]).
        epoch: u64,
        /// The credential's reset token for the session, so the notice cannot be forged.
        #[serde(with = "crate::session::hex_bytes")]
        token: [u8; RESET_TOKEN_LEN],
    },
    /// Server → client, sealed in the new session: the manifest's first page (this session's
    /// apps only), a client id, and where the one-sided agent listens.
    Welcome {
        /// Id of the session just set up; every later sealed datagram names it.
        session: u64,
        /// The server start it belongs to.
        epoch: u64,
        /// Top 24 bits of the client's request ids.
        client_id: u32,
        /// What is served: the apps of page 0 (see [`Manifest::pages`]).
        manifest: Manifest,
        /// Pages in the whole manifest; the client asks for the others with
        /// [`Control::QueryManifest`].
        pages: u32,
        /// The NIC's one-sided agent, when a NIC is up.
        agent: Option<SocketAddr>,
        /// The session's in-flight credit: requests it may have outstanding at once (more
        /// are answered `Busy`). 0 from a server that grants none in particular.
        #[serde(default)]
        window: u32,
    },
    /// Client → server: page `page` of the manifest.
    QueryManifest {
        /// Page number (0 is the welcome's).
        page: u32,
    },
    /// Server → client: one page of the manifest.
    ManifestPage {
        /// The page's number, as [`Control::QueryManifest`] asked for it.
        page: u32,
        /// Pages in all.
        pages: u32,
        /// The apps on this page, out of those the session's tenant may use.
        apps: Vec<AppManifest>,
        /// The [`Manifest::version`] the page belongs to: pages of two versions do not make
        /// one manifest (a deploy came between them), and the client asks again.
        #[serde(default)]
        version: u64,
    },
    /// Client → server: current weights of `app`'s handlers; carries what the client measured
    /// running handlers itself since its last query.
    QueryWeights {
        /// The app whose handlers' weights to send; one the session may use, else the answer is an
        /// `Error`.
        app: u32,
        /// Client-side executions since the last query.
        client: Option<RemoteLoad>,
        /// One-sided READ round trip the client sees, nanoseconds.
        rtt_ns: Option<f64>,
    },
    /// Server → client: the weights.
    Weights {
        /// The app the query named.
        app: u32,
        /// Every handler of the app with its fractions per placement, for this session.
        handlers: Vec<HandlerWeights>,
        /// The one-sided agent, when a NIC is up.
        agent: Option<SocketAddr>,
        /// The manifest's [`Manifest::version`] now: a client holding an older one asks for
        /// its pages again (a deploy changed handlers).
        #[serde(default)]
        manifest: u64,
    },
    /// NIC → server: load since the last report (also its registration and heartbeat).
    NicLoad {
        /// Where the NIC takes forwarded requests and one-sided operations.
        agent: SocketAddr,
        /// Queue, busy time and per-handler service times the NIC measured since its last report.
        load: RemoteLoad,
        /// The [`Manifest::version`] whose handlers the NIC serves: the server forwards it no
        /// message of an app deployed after it.
        #[serde(default)]
        manifest: u64,
    },
    /// Server → NIC: the manifest file changed (a deploy): read it again, build the apps
    /// whose handlers changed, and report `version` in the next load report.
    ManifestChanged {
        /// The new [`Manifest::version`].
        version: u64,
    },
    /// Tenant → server: bytes `offset..` of the object a later [`Control::Deploy`] into
    /// `app` installs (`total` bytes in all, at most [`crate::limits::MAX_DEPLOY_OBJECT`];
    /// at most [`crate::limits::DEPLOY_CHUNK`] per message). Offset 0 starts a new upload.
    DeployChunk {
        /// The app it is for; one the session's tenant has.
        app: u32,
        /// The object's whole length.
        total: u32,
        /// [`object_hash`] of the whole object: an upload of another object (same length,
        /// same first bytes or not) starts anew at offset 0.
        object_hash: u64,
        /// Where these bytes go; the upload takes chunks in order (a repeated one is
        /// answered again).
        offset: u32,
        /// The bytes.
        #[serde(with = "hex_chunk")]
        bytes: Vec<u8>,
    },
    /// Server → tenant: the bytes of the upload held so far.
    DeployReceived {
        /// The app the upload is for.
        app: u32,
        /// Bytes held, from offset 0.
        received: u32,
    },
    /// Tenant → server: verify and install the uploaded object's `handlers` as `app`'s
    /// handlers (those it had and this does not name are taken away); the answer is
    /// [`Control::Deployed`] or an `Error` with the verifier's reason. Calls in flight finish
    /// on the handlers they started on.
    Deploy {
        /// The app; one the session's tenant has.
        app: u32,
        /// [`object_hash`] of the uploaded object, which must be whole.
        object_hash: u64,
        /// The handlers to install.
        handlers: Vec<DeployHandler>,
        /// Their engine (the server's default for deploys, `tiered`, when absent).
        #[serde(default)]
        engine: Option<crate::EngineKind>,
        /// Their instruction budget per step (the app's configured one when absent).
        #[serde(default)]
        budget: Option<u64>,
    },
    /// Server → tenant: the handlers now serving, with the verifier's report on each.
    Deployed {
        /// The app.
        app: u32,
        /// The [`Manifest::version`] that serves them.
        version: u64,
        /// One report per handler (none after an undeploy).
        handlers: Vec<DeployReport>,
    },
    /// Tenant → server: take every handler of `app` away (its regions and data stay); the
    /// answer is [`Control::Deployed`] with no handlers.
    Undeploy {
        /// The app; one the session's tenant has.
        app: u32,
    },
    /// Tenant → server: create app `name` for the session's tenant, with `regions` (zeroed)
    /// and no handlers (a [`Control::Deploy`] into it installs them), within the tenant's
    /// quotas on apps and region bytes. The answer is [`Control::AppCreated`] (also when the
    /// tenant has an app of that name with the same regions already: its regions and data
    /// are kept) or an `Error` with the reason. The session's tenant, and every session of
    /// its credential, may use the app from the answer on.
    CreateApp {
        /// The app's name: free on the server (no other app has it), and the name a hello
        /// may give to authenticate as its tenant.
        name: String,
        /// Its regions, at most [`crate::limits::MAX_CREATED_APP_REGIONS`].
        regions: Vec<NewRegion>,
    },
    /// Server → tenant: the app exists, with this id, in [`Manifest::version`] `version`.
    AppCreated {
        /// Its id.
        app: u32,
        /// Its name.
        name: String,
        /// The manifest version that has it.
        version: u64,
    },
    /// NIC → server: draining, stop forwarding.
    NicBye,
    /// Server → NIC: a client session the NIC must check and answer by itself.
    SessionOpen {
        /// Id of the client session.
        session: u64,
        /// Its tenant tag ([`crate::session::Credential::tag`]), for the NIC's copy of the key.
        tenant_tag: u32,
        /// The client's address (answers go there only).
        peer: SocketAddr,
        /// The apps it may use, ascending. On the wire as runs of consecutive ids
        /// ([`app_runs`]), so that a tenant of thousands of apps (the instances of one
        /// `[[app]]` are consecutive) fits in one control message.
        #[serde(with = "app_runs")]
        apps: Vec<u32>,
        /// Its key, encrypted under the pairing session ([`crate::session::SessionKey::wrap`]).
        #[serde(with = "crate::session::hex_vec")]
        key: Vec<u8>,
    },
    /// NIC → server: a client used session `session`, which the NIC does not know.
    QuerySession {
        /// The session id the client's datagram named.
        session: u64,
    },
    /// Server → NIC: session `session` is gone (or never was).
    SessionClosed {
        /// Id of the session the NIC should forget.
        session: u64,
    },
    /// Operator → server: the switch's counters, after pinning the NIC share of every read
    /// handler (`pin`, per mille) or returning it to the weights (`unpin`), if asked.
    QuerySwitch {
        /// Pin the NIC share.
        pin: Option<u32>,
        /// Return to the steering weights.
        unpin: bool,
    },
    /// Server → operator: the switch and its counters.
    Switch {
        /// Which switch steers (XDP or user-space).
        switch: String,
        /// The steering switch's counters (the XDP eSwitch's own, else the same as `userspace`).
        counters: SwitchCounters,
        /// What the user-space switch queued at the host or forwarded to the NIC.
        userspace: SwitchCounters,
    },
    /// Operator → server: take host executor capacity away (every host message spends
    /// `extra_ns` more, busy) or give it back (`None`), for congestion experiments. Refused
    /// unless the server was started allowing it, and above [`MAX_CONGESTION_NS`].
    Congest {
        /// Extra busy time per host message, nanoseconds; `None` clears it.
        extra_ns: Option<u64>,
    },
    /// Server → operator: the congestion now in force.
    Congestion {
        /// Extra busy time per host message, nanoseconds (`None`: none).
        extra_ns: Option<u64>,
    },
    /// Client → server: connect my queue pair (one per peer, shared by all apps).
    VerbsConnect {
        /// The client's queue pair, for the server to connect one of its own to.
        endpoint: QpEndpoint,
    },
    /// Server → client: the server's queue pair and its regions.
    VerbsAccept {
        /// The server's queue pair, connected to the client's.
        endpoint: QpEndpoint,
        /// Every region, by NAAM rkey.
        regions: Vec<RdmaRegion>,
    },
    /// Any direction: a refusal.
    Error {
        /// The reason, in words for people and logs; the message's control id (0 when the
        /// refused message did not decode) says which request it answers.
        message: String,
    },
}

impl Control {
    /// The message's name, for refusals and logs (never its contents: they may hold secrets).
    pub fn name(&self) -> &'static str {
        match self {
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
            Control::ManifestChanged { .. } => "manifest-changed",
            Control::DeployChunk { .. } => "deploy-chunk",
            Control::DeployReceived { .. } => "deploy-received",
            Control::Deploy { .. } => "deploy",
            Control::Deployed { .. } => "deployed",
            Control::Undeploy { .. } => "undeploy",
            Control::CreateApp { .. } => "create-app",
            Control::AppCreated { .. } => "app-created",
            Control::Error { .. } => "error",
        }
    }

    /// Encodes the message with id `id`.
    pub fn to_bytes(&self, id: u64) -> Bytes {
        self.to_routed_bytes(id, 0)
    }

    /// Encodes the message with id `id` and route `route` (an `Auth`: its challenge's).
    pub fn to_routed_bytes(&self, id: u64, route: u8) -> Bytes {
        let body = serde_json::to_vec(self).unwrap_or_default();
        let mut b = BytesMut::with_capacity(CONTROL_HEADER + body.len());
        b.put_u8(VERSION);
        b.put_u8(KIND_CONTROL);
        b.put_u8(route);
        b.put_u8(0);
        b.put_u32_le(0);
        b.put_u64_le(id);
        b.put_slice(&body);
        b.freeze()
    }

    /// Decodes a control message and its id (the route only picked a receive loop).
    pub fn decode(buf: &[u8]) -> Result<(u64, Control), WireError> {
        let id = Control::request_id(buf)?;
        let c = serde_json::from_slice(&buf[CONTROL_HEADER..]).map_err(|_| WireError::Invalid {
            field: "control body",
            value: (buf.len() - CONTROL_HEADER) as u64,
        })?;
        Ok((id, c))
    }
}

impl Control {
    /// The request id of control message `buf`, read from its header alone: a message whose
    /// body does not decode is answered under the id its sender will look for.
    pub fn request_id(buf: &[u8]) -> Result<u64, WireError> {
        header(buf, CONTROL_HEADER, KIND_CONTROL)?;
        if buf[CONTROL_ROUTE + 1..8].iter().any(|&b| b != 0) {
            return Err(WireError::Invalid {
                field: "reserved",
                value: 0,
            });
        }
        Ok(u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes")))
    }
}

/// Serde of a set of app ids as `[first, count]` runs of consecutive ids: 10,000 instances
/// of one app are one run. Reading refuses more than [`crate::limits::MAX_SESSION_APPS`] ids
/// in all, and gives them ascending without repeats.
pub mod app_runs {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Writes `ids` (in any order, repeats allowed) as ascending runs.
    pub fn serialize<S: Serializer>(ids: &[u32], s: S) -> Result<S::Ok, S::Error> {
        runs(ids).serialize(s)
    }

    /// The ascending `[first, count]` runs of `ids`.
    pub fn runs(ids: &[u32]) -> Vec<[u32; 2]> {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut runs: Vec<[u32; 2]> = Vec::new();
        for id in sorted {
            match runs.last_mut() {
                Some([first, count]) if u64::from(*first) + u64::from(*count) == u64::from(id) => {
                    *count += 1
                }
                _ => runs.push([id, 1]),
            }
        }
        runs
    }

    /// Reads runs back into ascending ids.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let runs = Vec::<[u32; 2]>::deserialize(d)?;
        ids(&runs).map_err(serde::de::Error::custom)
    }

    /// The ids of `runs`, ascending without repeats; an error for more than
    /// [`crate::limits::MAX_SESSION_APPS`] ids or a run past `u32::MAX`.
    pub fn ids(runs: &[[u32; 2]]) -> Result<Vec<u32>, String> {
        let mut total = 0u64;
        for &[first, count] in runs {
            if u64::from(first) + u64::from(count) > u64::from(u32::MAX) + 1 {
                return Err(format!(
                    "the run of {count} ids from {first} passes u32::MAX"
                ));
            }
            total += u64::from(count);
            if total > crate::limits::MAX_SESSION_APPS as u64 {
                return Err(format!("over {} app ids", crate::limits::MAX_SESSION_APPS));
            }
        }
        let mut out: Vec<u32> = runs
            .iter()
            .flat_map(|&[first, count]| (0..count).map(move |i| first + i))
            .collect();
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }
}

/// A deploy chunk's bytes as hex, at most [`crate::limits::DEPLOY_CHUNK`] of them.
mod hex_chunk {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(b))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = <&str>::deserialize(d)?;
        if s.len() > 2 * crate::limits::DEPLOY_CHUNK {
            return Err(serde::de::Error::custom(format_args!(
                "a deploy chunk carries at most {} bytes",
                crate::limits::DEPLOY_CHUNK
            )));
        }
        hex::decode(s).map_err(serde::de::Error::custom)
    }
}

/// Wraps a client's sealed request for the NIC.
pub fn forward(sealed_request: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(FORWARD_HEADER + sealed_request.len());
    b.put_u8(VERSION);
    b.put_u8(KIND_FORWARD);
    b.put_u16_le(0);
    b.put_u32_le(0);
    b.put_slice(sealed_request);
    b.freeze()
}

/// The form byte of a forward of one request that arrived in a client's batch.
const FORWARD_MEMBER: u8 = 1;

/// Wraps one request of session `session` that arrived in a batch (already opened and
/// admitted by the server) for the NIC: the batch's other messages are not the NIC's, so the
/// server vouches for this one inside their pairing session.
pub fn forward_member(session: u64, request: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(FORWARD_HEADER + 8 + request.len());
    b.put_u8(VERSION);
    b.put_u8(KIND_FORWARD);
    b.put_u8(FORWARD_MEMBER);
    b.put_u8(0);
    b.put_u32_le(0);
    b.put_u64_le(session);
    b.put_slice(request);
    b.freeze()
}

/// What a forward carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forwarded {
    /// The client's sealed datagram, for the NIC to open itself ([`forward`]).
    Sealed(Bytes),
    /// One request of session `session`, opened by the server ([`forward_member`]).
    Member {
        /// The session the request arrived in.
        session: u64,
        /// The request's bytes.
        request: Bytes,
    },
}

/// Unwraps a forwarded request: the client's sealed request.
pub fn unforward(buf: &Bytes) -> Result<Bytes, WireError> {
    match unforward_any(buf)? {
        Forwarded::Sealed(b) => Ok(b),
        Forwarded::Member { .. } => Err(WireError::Invalid {
            field: "forward form",
            value: FORWARD_MEMBER as u64,
        }),
    }
}

/// Unwraps a forward of either form.
pub fn unforward_any(buf: &Bytes) -> Result<Forwarded, WireError> {
    header(buf, FORWARD_HEADER, KIND_FORWARD)?;
    if buf[3..8].iter().any(|&b| b != 0) {
        return Err(WireError::Invalid {
            field: "reserved",
            value: 0,
        });
    }
    match buf[2] {
        0 => Ok(Forwarded::Sealed(buf.slice(FORWARD_HEADER..))),
        FORWARD_MEMBER => {
            let Some(id) = buf.get(FORWARD_HEADER..FORWARD_HEADER + 8) else {
                return Err(WireError::Truncated {
                    need: FORWARD_HEADER + 8,
                    have: buf.len(),
                });
            };
            Ok(Forwarded::Member {
                session: u64::from_le_bytes(id.try_into().expect("8 bytes")),
                request: buf.slice(FORWARD_HEADER + 8..),
            })
        }
        form => Err(WireError::Invalid {
            field: "forward form",
            value: form as u64,
        }),
    }
}

/// The manifest's hash of an object's bytes (the handlers' own `hash64`, seed 0).
pub fn object_hash(bytes: &[u8]) -> u64 {
    naam_ebpf::hash::hash64(bytes, 0)
}

/// Packet counters of a switch in front of the server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SwitchCounters {
    /// Messages left for the host executors.
    pub host: u64,
    /// Messages steered to the NIC.
    pub nic: u64,
    /// Multi-fragment messages (always left for the host).
    pub fragmented: u64,
}

#[cfg(test)]
mod tests {
    /// Names of created apps and regions become file names: only plain ones pass.
    #[test]
    fn created_names_are_plain_and_short() {
        for ok in [
            "mine",
            "a-b_c9",
            &"x".repeat(crate::limits::MAX_CREATED_NAME),
        ] {
            assert!(super::check_created_name("an app", ok).is_ok(), "{ok}");
        }
        let long = "x".repeat(crate::limits::MAX_CREATED_NAME + 1);
        for bad in ["", "../etc", "a/b", "a b", "é", ".", long.as_str()] {
            let e = super::check_created_name("an app", bad).unwrap_err();
            assert!(e.contains("names are 1 to"), "{bad}: {e}");
        }
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn control_messages_round_trip() {
        let m = Control::Weights {
            app: 3,
            handlers: vec![HandlerWeights {
                handler: 9,
                weights: [0.25, 0.25, 0.5],
            }],
            agent: Some("10.0.0.1:7002".parse().unwrap()),
            manifest: 4,
        };
        let b = m.to_bytes(77);
        assert_eq!(Control::decode(&b).unwrap(), (77, m));
        assert!(Control::decode(&b[..10]).is_err());
        let mut bad = b.to_vec();
        bad[20] = b'!';
        assert!(Control::decode(&bad).is_err());
        // A body that does not decode still has its header's request id, to answer under.
        assert_eq!(Control::request_id(&bad), Ok(77));
        assert!(Control::request_id(&b[..10]).is_err());
        let mut reserved = b.to_vec();
        reserved[CONTROL_ROUTE + 1] = 1;
        assert!(Control::request_id(&reserved).is_err());
    }

    #[test]
    fn forwarded_requests_round_trip() {
        let f = forward(b"sealed request bytes");
        assert_eq!(&unforward(&f).unwrap()[..], b"sealed request bytes");
        assert!(unforward(&Bytes::from_static(b"short")).is_err());
        let m = forward_member(0x77, b"request");
        assert_eq!(
            unforward_any(&m).unwrap(),
            Forwarded::Member {
                session: 0x77,
                request: Bytes::from_static(b"request")
            }
        );
        assert!(unforward(&m).is_err(), "a member is not a sealed forward");
        let mut bad = m.to_vec();
        bad[2] = 9;
        assert!(unforward_any(&Bytes::from(bad)).is_err());
    }

    #[test]
    fn handshake_messages_round_trip_and_stay_small() {
        let h = Control::Hello {
            tenant: "mica".into(),
            nonce: [7; NONCE_LEN],
        };
        let b = h.to_bytes(1);
        assert_eq!(Control::decode(&b).unwrap(), (1, h.clone()));
        let c = Control::Challenge {
            route: u8::MAX,
            nonce: [1; NONCE_LEN],
            issued: u64::MAX,
            cookie: [2; COOKIE_LEN],
        };
        let cb = c.to_bytes(u64::MAX);
        assert_eq!(Control::decode(&cb).unwrap().1, c);
        // A challenge from a server that names no route reads as route 0.
        let plain = String::from_utf8(cb[CONTROL_HEADER..].to_vec()).unwrap();
        let plain = plain
            .replace(",\"route\":255", "")
            .replace("\"route\":255,", "");
        let mut old = cb[..CONTROL_HEADER].to_vec();
        old.extend_from_slice(plain.as_bytes());
        assert!(matches!(
            Control::decode(&old).unwrap().1,
            Control::Challenge { route: 0, .. }
        ));
        // A routed message decodes as itself; the other reserved bytes stay zero.
        let routed = h.to_routed_bytes(9, 0xa5);
        assert_eq!(routed[CONTROL_ROUTE], 0xa5);
        assert_eq!(Control::decode(&routed).unwrap().1, h);
        let mut bad_reserved = routed.to_vec();
        bad_reserved[CONTROL_ROUTE + 1] = 1;
        assert!(Control::decode(&bad_reserved).is_err());
        // A challenge is smaller than the padded hello it answers: far inside the limit.
        assert!(cb.len() < crate::session::HELLO_PADDING);
        let mut bad = b.to_vec();
        let at = bad.len() - 3;
        bad[at] = b'x';
        assert!(Control::decode(&bad).is_err(), "hex nonces are checked");
    }

    fn app(id: u32, regions: usize) -> AppManifest {
        AppManifest {
            id,
            name: format!("app-{id}"),
            kind: "object".into(),
            params: serde_json::Value::Null,
            object: "/tmp/x.o".into(),
            object_hash: 1,
            handlers: vec![],
            regions: (0..regions)
                .map(|r| RegionManifest {
                    name: format!("region-{r}"),
                    rkey: r as u64,
                    access: 1,
                    client_access: 1,
                    len: 4096,
                    path: Some(format!("/dev/shm/naam/app{id}-region-{r}.region")),
                })
                .collect(),
        }
    }

    #[test]
    fn manifests_are_paged_to_fit_control_messages() {
        let m = Manifest {
            apps: (1..=300).map(|id| app(id, 3)).collect(),
            mode: "udp".into(),
            policy: "cost-based steering with a long policy name".into(),
            epoch: u64::MAX,
            version: u64::MAX,
        };
        let pages = m.pages().unwrap();
        assert!(pages.len() > 1);
        let flat: Vec<_> = pages.iter().flatten().cloned().collect();
        assert_eq!(flat, m.apps);
        for (i, p) in pages.iter().enumerate() {
            let c = Control::ManifestPage {
                page: i as u32,
                pages: pages.len() as u32,
                apps: p.clone(),
                version: u64::MAX,
            };
            assert!(c.to_bytes(1).len() <= crate::limits::MAX_MESSAGE);
            let w = Control::Welcome {
                session: u64::MAX,
                epoch: u64::MAX,
                client_id: u32::MAX,
                manifest: Manifest {
                    apps: p.clone(),
                    ..m.clone()
                },
                pages: u32::MAX,
                window: u32::MAX,
                agent: Some("[fe80::1:2:3:4]:65535".parse().unwrap()),
            };
            assert!(w.to_bytes(1).len() <= crate::limits::MAX_MESSAGE);
        }
        assert_eq!(Manifest::default().pages().unwrap(), vec![vec![]]);
        let huge = Manifest {
            apps: vec![app(7, 200)],
            ..Manifest::default()
        };
        assert!(matches!(
            huge.pages(),
            Err(ManifestError::AppTooLarge { app: 7, .. })
        ));
    }

    /// A tenant of 10,001 consecutive apps and a few others: one control message.
    #[test]
    fn a_session_of_ten_thousand_apps_fits_one_message() {
        let apps: Vec<u32> = (1000..11_001).chain([1, 7, 9]).collect();
        let m = Control::SessionOpen {
            session: 5,
            tenant_tag: 9,
            peer: "10.0.0.2:4000".parse().unwrap(),
            apps: apps.clone(),
            key: vec![0xab; 48],
        };
        let bytes = m.to_bytes(3);
        assert!(bytes.len() < 300, "{} bytes", bytes.len());
        let Ok((3, Control::SessionOpen { apps: back, .. })) = Control::decode(&bytes) else {
            panic!("no session-open back");
        };
        let mut want = apps;
        want.sort_unstable();
        assert_eq!(back, want);
    }

    #[test]
    fn app_runs_refuse_too_many_ids_and_runs_past_the_last_id() {
        use crate::limits::MAX_SESSION_APPS;
        assert!(app_runs::ids(&[[0, MAX_SESSION_APPS as u32]]).is_ok());
        assert!(app_runs::ids(&[[0, MAX_SESSION_APPS as u32 + 1]]).is_err());
        assert!(app_runs::ids(&[[0, 60_000], [100_000, 6_000]]).is_err());
        assert!(app_runs::ids(&[[u32::MAX, 1]]).is_ok());
        assert!(app_runs::ids(&[[u32::MAX, 2]]).is_err());
        assert_eq!(app_runs::ids(&[[5, 2], [4, 3]]), Ok(vec![4, 5, 6]));
    }

    proptest! {
        #[test]
        fn app_runs_give_back_the_set(ids in proptest::collection::vec(any::<u32>(), 0..200)) {
            let mut want = ids.clone();
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(app_runs::ids(&app_runs::runs(&ids)), Ok(want));
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Control::decode(&bytes);
            let _ = unforward_any(&Bytes::from(bytes.clone()));
            let _ = unforward(&Bytes::from(bytes));
        }
    }
}
