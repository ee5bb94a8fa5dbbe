//! What the receive loops of one server share ([`crate::shard`]): the paired NIC (its
//! session lives in one loop, and every loop forwards to it), the tenant sessions of every
//! loop (the NIC is told about them, and asks about them, through the NIC's loop), each
//! loop's switch counters (an operator's query sums them), and whose turn it is to take the
//! next new session.
//!
//! Everything here changes rarely (a session set up or forgotten, a NIC pairing) or is a
//! counter one loop writes and others read; a request's path reads the NIC's channel under a
//! short lock, and only when it forwards.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::server::Channel;
use super::Transmit;
use crate::control::Manifest;
use crate::limits::MAX_LOOPS;
use crate::session::SessionKey;

/// The NIC a server is paired with.
#[derive(Clone, Debug)]
pub(super) struct PairedNic {
    /// Its session with the server.
    pub(super) session: u64,
    /// Where it takes forwarded requests and one-sided operations.
    pub(super) agent: SocketAddr,
    /// Its session's address and sealer (shared by every loop: one packet-number space).
    pub(super) channel: Channel,
}

/// A tenant session, as the NIC is told about it.
#[derive(Clone, Debug)]
pub(super) struct TenantSession {
    pub(super) peer: SocketAddr,
    pub(super) apps: Vec<u32>,
    pub(super) key: Arc<SessionKey>,
}

#[derive(Default)]
struct Shared {
    nic: Option<PairedNic>,
    tenants: HashMap<u64, TenantSession>,
    /// The manifest a deploy published last (`None`: the one each loop started with).
    manifest: Option<Arc<Manifest>>,
    /// Each tenant's deploy tokens, over every loop.
    deploy_tokens: HashMap<String, DeployTokens>,
    /// Apps created at run time, in order: each loop takes up those it has not seen.
    grants: Vec<AppGrant>,
}

/// An app created at run time for a tenant ([`SessionDirectory::grant`]): every loop gives it
/// to the tenant's credential, its sessions included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppGrant {
    /// The tenant it was created for (the name its session's hello gave).
    pub owner: String,
    /// The app's id.
    pub app: u32,
    /// The app's name (a hello may name it from now on).
    pub name: String,
}

/// One tenant's deploy tokens ([`SessionDirectory::take_deploy_token`]).
struct DeployTokens {
    tokens: f64,
    /// When they were last counted.
    at: crate::Nanos,
    /// The (session, request id) of the last deploy that took one.
    last: Option<(u64, u64)>,
}

/// One loop's switch counters.
#[derive(Default)]
struct LoopCounters {
    host: AtomicU64,
    forwarded: AtomicU64,
}

/// What the receive loops of one server share. A single-loop server has one of its own; a
/// driver with several loops gives each loop's [`super::ServerConfig`] the same one.
pub struct SessionDirectory {
    shared: Mutex<Shared>,
    counters: Box<[LoopCounters]>,
    /// Handshakes challenged so far: the next new session goes to loop `this % count`.
    challenged: AtomicUsize,
    /// How many [`AppGrant`]s there are: a loop compares it with those it took up without
    /// taking the lock.
    grants: AtomicUsize,
    /// [`Manifest::version`] of the manifest published last: a loop compares it with its own
    /// pages' on the paths that hand out manifest versions, without taking the lock.
    manifest_version: AtomicU64,
}

impl Default for SessionDirectory {
    fn default() -> Self {
        SessionDirectory {
            shared: Mutex::default(),
            counters: (0..MAX_LOOPS).map(|_| LoopCounters::default()).collect(),
            challenged: AtomicUsize::new(0),
            grants: AtomicUsize::new(0),
            manifest_version: AtomicU64::new(0),
        }
    }
}

impl std::fmt::Debug for SessionDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("SessionDirectory")
            .field("nic", &s.nic.as_ref().map(|n| (n.session, n.agent)))
            .field("tenant_sessions", &s.tenants.len())
            .finish()
    }
}

impl SessionDirectory {
    /// An empty directory, to share.
    pub fn new() -> Arc<SessionDirectory> {
        Arc::new(SessionDirectory::default())
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A loop that panicked holding it left nothing half-done worth refusing over.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The paired NIC.
    pub(super) fn nic(&self) -> Option<PairedNic> {
        self.lock().nic.clone()
    }

    /// Pairs the NIC of session `session`; returns whether it is a new pairing.
    pub(super) fn pair(&self, nic: PairedNic) -> bool {
        let mut s = self.lock();
        let fresh = s.nic.as_ref().map(|n| n.session) != Some(nic.session);
        s.nic = Some(nic);
        fresh
    }

    /// Whether `session` is the paired NIC's.
    pub(super) fn is_nic(&self, session: u64) -> bool {
        self.lock()
            .nic
            .as_ref()
            .is_some_and(|n| n.session == session)
    }

    /// Forgets the NIC of `session` (its session is gone).
    pub(super) fn unpair(&self, session: u64) {
        let mut s = self.lock();
        if s.nic.as_ref().is_some_and(|n| n.session == session) {
            s.nic = None;
        }
    }

    /// Records tenant session `id`.
    pub(super) fn open(&self, id: u64, t: TenantSession) {
        self.lock().tenants.insert(id, t);
    }

    /// Tenant session `id`, if some loop holds it.
    pub(super) fn tenant(&self, id: u64) -> Option<TenantSession> {
        self.lock().tenants.get(&id).cloned()
    }

    /// Every tenant session's id.
    pub(super) fn tenant_ids(&self) -> Vec<u64> {
        self.lock().tenants.keys().copied().collect()
    }

    /// Forgets the tenant sessions `owned` says are one loop's, unless `alive` still holds
    /// them.
    pub(super) fn retain_tenants(&self, owned: impl Fn(u64) -> bool, alive: impl Fn(u64) -> bool) {
        self.lock()
            .tenants
            .retain(|id, _| !owned(*id) || alive(*id));
    }

    /// The loop of `count` that sets up the next new session: each in turn, whichever loop
    /// the handshake reached (see [`crate::shard`]).
    pub(super) fn next_session_loop(&self, count: usize) -> usize {
        self.challenged.fetch_add(1, Ordering::Relaxed) % count.max(1)
    }

    /// Publishes loop `index`'s switch counters.
    pub(super) fn publish(&self, index: usize, host: u64, forwarded: u64) {
        if let Some(c) = self.counters.get(index) {
            c.host.store(host, Ordering::Relaxed);
            c.forwarded.store(forwarded, Ordering::Relaxed);
        }
    }

    /// Requests run at the host and forwarded to the NIC, over every loop.
    pub(super) fn switched(&self) -> (u64, u64) {
        self.counters.iter().fold((0, 0), |(h, f), c| {
            (
                h + c.host.load(Ordering::Relaxed),
                f + c.forwarded.load(Ordering::Relaxed),
            )
        })
    }

    /// Publishes `manifest` (a deploy changed handlers) to every loop: each serves its
    /// tenants' pages from it from their next look, and hands out its version with weights.
    /// An older version than the one published is ignored (two deployers never race, but a
    /// late publish must not undo a newer one).
    pub fn publish_manifest(&self, manifest: Manifest) {
        let mut s = self.lock();
        let version = manifest.version;
        if s.manifest.as_ref().is_some_and(|m| m.version >= version) {
            return;
        }
        s.manifest = Some(Arc::new(manifest));
        self.manifest_version.store(version, Ordering::Release);
    }

    /// [`Manifest::version`] of the newest published manifest (0 before any).
    pub fn manifest_version(&self) -> u64 {
        self.manifest_version.load(Ordering::Acquire)
    }

    /// The newest published manifest, if newer than `version`.
    pub(super) fn manifest_newer_than(&self, version: u64) -> Option<Arc<Manifest>> {
        if self.manifest_version() <= version {
            return None;
        }
        self.lock().manifest.clone().filter(|m| m.version > version)
    }

    /// Gives app `grant.app` to its owner's credential in every loop, from each loop's next
    /// control message or handshake on (publish the manifest that has the app first).
    pub fn grant(&self, grant: AppGrant) {
        let mut s = self.lock();
        s.grants.push(grant);
        self.grants.store(s.grants.len(), Ordering::Release);
    }

    /// The grants after the first `seen`; empty (and no lock taken) when there are none.
    pub(super) fn grants_after(&self, seen: usize) -> Vec<AppGrant> {
        if self.grants.load(Ordering::Acquire) <= seen {
            return Vec::new();
        }
        self.lock().grants.get(seen..).unwrap_or_default().to_vec()
    }

    /// Sets the apps tenant session `id` may use, as the NIC is told (a grant grew them).
    pub(super) fn set_tenant_apps(&self, id: u64, apps: Vec<u32>) {
        if let Some(t) = self.lock().tenants.get_mut(&id) {
            t.apps = apps;
        }
    }

    /// Control message `bytes` (request id `id`) sealed in the paired NIC's session, to send
    /// from any thread; `None` while no NIC is paired.
    pub fn to_nic(&self, id: u64, bytes: &[u8]) -> Option<Transmit> {
        self.nic().map(|n| n.channel.transmit(id, bytes))
    }

    /// Takes one of `tenant`'s deploy tokens (`rate` a second, as many in a burst) for its
    /// session `session`'s request `id`: a retransmission of the deploy that took the last
    /// one takes none. `Err`: the seconds until a token is there.
    pub(super) fn take_deploy_token(
        &self,
        tenant: &str,
        session: u64,
        id: u64,
        now: crate::Nanos,
        rate: f64,
    ) -> Result<(), f64> {
        let burst = rate.max(1.0);
        let mut s = self.lock();
        let t = s
            .deploy_tokens
            .entry(tenant.to_string())
            .or_insert(DeployTokens {
                tokens: burst,
                at: now,
                last: None,
            });
        if t.last == Some((session, id)) {
            return Ok(());
        }
        let dt = now.saturating_sub(t.at) as f64 / 1e9;
        t.tokens = (t.tokens + dt * rate).min(burst);
        t.at = now;
        if t.tokens >= 1.0 {
            t.tokens -= 1.0;
            t.last = Some((session, id));
            Ok(())
        } else if rate > 0.0 {
            Err((1.0 - t.tokens) / rate)
        } else {
            Err(f64::INFINITY)
        }
    }
}
