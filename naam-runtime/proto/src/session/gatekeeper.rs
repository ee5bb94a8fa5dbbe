//! The server's side of sessions: address cookies, the amplification limit, tenants and
//! their roles, and the [`Gatekeeper`] that runs handshakes and opens sealed datagrams.

use super::{
    hmac_with, peek_sealed, Arc, Authentication, Bytes, Credential, CredentialError,
    HandshakeNonces, HashMap, HmacSha256, Mac, Nanos, ReplayWindow, SealError, Sealer, Sender,
    SocketAddr, AMPLIFICATION, COOKIE_LEN, COOKIE_LIFETIME, NIC_TENANT, NONCE_LEN, OPERATOR_TENANT,
    RESET_TOKEN_LEN,
};
use crate::entropy::Entropy;
use crate::intmap::IntMap;

/// Issues and checks address-validation cookies (stateless: a MAC under a key of this
/// server process; the receive loops of one server share it, cloned).
#[derive(Clone)]
pub struct CookieJar {
    pub(super) key: HmacSha256,
}

impl CookieJar {
    /// A jar with a fresh random key from `entropy`.
    pub fn new(entropy: &Entropy) -> Result<CookieJar, CredentialError> {
        Ok(CookieJar::with_key(entropy.array()?))
    }

    /// A jar with a given key (tests).
    pub fn with_key(key: [u8; 32]) -> CookieJar {
        CookieJar {
            key: hmac_with(&key),
        }
    }

    pub(super) fn mac(&self, peer: SocketAddr, n: &HandshakeNonces, issued: Nanos) -> HmacSha256 {
        let mut m = self.key.clone();
        m.update(b"naam cookie v1");
        let ip = match peer.ip() {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            std::net::IpAddr::V6(v6) => v6,
        };
        m.update(&ip.octets());
        m.update(&peer.port().to_le_bytes());
        m.update(&n.client);
        m.update(&n.server);
        m.update(&issued.to_le_bytes());
        m
    }

    /// The cookie for `peer` and these nonces, issued at `issued`.
    pub fn issue(&self, peer: SocketAddr, n: &HandshakeNonces, issued: Nanos) -> [u8; 16] {
        let out = self.mac(peer, n, issued).finalize().into_bytes();
        let mut c = [0u8; COOKIE_LEN];
        c.copy_from_slice(&out[..COOKIE_LEN]);
        c
    }

    /// Whether `cookie` was issued to `peer` for these nonces at `issued`, and is still valid
    /// at `now`.
    pub fn check(
        &self,
        peer: SocketAddr,
        n: &HandshakeNonces,
        issued: Nanos,
        cookie: &[u8; COOKIE_LEN],
        now: Nanos,
    ) -> bool {
        if issued > now || now - issued > COOKIE_LIFETIME {
            return false;
        }
        self.mac(peer, n, issued)
            .verify_truncated_left(cookie)
            .is_ok()
    }
}

/// Whether an answer of `answer` bytes may go to a peer that has not proved its address and
/// sent `received` bytes (whole datagrams, headers included).
pub fn within_amplification(received: usize, answer: usize) -> bool {
    answer <= AMPLIFICATION * received
}

/// What a session may do.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// A tenant: its apps, and nothing else.
    Tenant {
        /// The tenant's name (the app it named in its hello).
        name: String,
        /// The apps sharing its credential, ascending (searched by halves on every
        /// message).
        apps: Vec<u32>,
    },
    /// The operator: congestion experiments and switch counters, no app data.
    Operator,
    /// The paired naam-nic.
    Nic,
}

impl Role {
    /// Whether the session may use app `app`.
    pub fn may_use(&self, app: u32) -> bool {
        matches!(self, Role::Tenant { apps, .. } if apps.binary_search(&app).is_ok())
    }
}

/// One credential the server accepts, and the role a session proving it gets.
#[derive(Clone, Debug)]
pub struct TenantEntry {
    /// The name a hello gives.
    pub name: String,
    /// The secret a handshake's proof must be made with to get this entry's role.
    pub credential: Credential,
    /// What a session proving this credential may do.
    pub role: Role,
}

/// The credentials a server accepts: one entry per app (a session proving an app's
/// credential may use every app configured with the same credential), plus the operator's and
/// the NIC's pairing secret when configured.
pub fn tenant_entries(
    apps: &[(u32, String, Credential)],
    operator: Option<Credential>,
    nic: Option<Credential>,
) -> Vec<TenantEntry> {
    // Each credential's apps, ascending, found by sorting once: a server of 10,000 instances
    // of one app under one credential searched all apps for each (10^8 comparisons) and
    // gave each instance an entry of its own holding all 10,000 ids (400 MB).
    let mut owned: Vec<([u8; super::CREDENTIAL_LEN], u32)> =
        apps.iter().map(|(id, _, c)| (c.0, *id)).collect();
    owned.sort_unstable();
    owned.dedup();
    let apps_of = |c: &Credential| -> Vec<u32> {
        let start = owned.partition_point(|(k, _)| *k < c.0);
        owned[start..]
            .iter()
            .take_while(|(k, _)| *k == c.0)
            .map(|(_, id)| *id)
            .collect()
    };
    let mut out: Vec<TenantEntry> = Vec::new();
    let mut seen: std::collections::HashSet<(&str, [u8; super::CREDENTIAL_LEN])> =
        std::collections::HashSet::new();
    for (_, name, c) in apps {
        // One entry per name and credential: instances of an app share both.
        if seen.insert((name.as_str(), c.0)) {
            out.push(TenantEntry {
                name: name.clone(),
                credential: c.clone(),
                role: Role::Tenant {
                    name: name.clone(),
                    apps: apps_of(c),
                },
            });
        }
    }
    if let Some(c) = operator {
        out.push(TenantEntry {
            name: OPERATOR_TENANT.into(),
            credential: c,
            role: Role::Operator,
        });
    }
    if let Some(c) = nic {
        out.push(TenantEntry {
            name: NIC_TENANT.into(),
            credential: c,
            role: Role::Nic,
        });
    }
    out
}

/// Gives app `app`, created at run time for the tenant named `owner` and named `name`, to
/// every entry of `owner`'s credential (the apps sharing a credential are one tenant's), and
/// adds an entry named `name` with that credential, so that a hello may name it as the
/// config's apps are named. Returns the names of the entries whose apps grew (none: `owner`
/// is no tenant here, or has the app already).
pub fn grant_app(entries: &mut Vec<TenantEntry>, owner: &str, app: u32, name: &str) -> Vec<String> {
    let Some(credential) = entries
        .iter()
        .find(|e| e.name == owner && matches!(e.role, Role::Tenant { .. }))
        .map(|e| e.credential.clone())
    else {
        return Vec::new();
    };
    let mut grown = Vec::new();
    let mut apps_now = Vec::new();
    for e in entries.iter_mut() {
        if let Role::Tenant { name: n, apps } = &mut e.role {
            if e.credential.0 != credential.0 {
                continue;
            }
            if let Err(at) = apps.binary_search(&app) {
                apps.insert(at, app);
                grown.push(n.clone());
            }
            apps_now = apps.clone();
        }
    }
    if !grown.is_empty() && !entries.iter().any(|e| e.name == name) {
        entries.push(TenantEntry {
            name: name.to_string(),
            credential,
            role: Role::Tenant {
                name: name.to_string(),
                apps: apps_now,
            },
        });
        grown.push(name.to_string());
    }
    grown
}

/// A session the server knows.
#[derive(Debug)]
pub struct Session {
    /// Its id: random and never 0, drawn when its `Auth` checked.
    pub id: u64,
    /// What it may do.
    pub role: Arc<Role>,
    /// The address it was set up from; answers go only there.
    pub peer: SocketAddr,
    /// Sealing of answers (server side).
    pub sealer: Arc<Sealer>,
    /// When it last sent an authenticated message.
    pub last_seen: Nanos,
    pub(super) window: ReplayWindow,
    pub(super) server_nonce: [u8; NONCE_LEN],
}

/// Why a handshake step was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// No tenant of this name (said the same way as a wrong proof, so names are not probed).
    #[error("authentication failed")]
    Failed,
    /// The cookie is not this peer's, or too old: start again with a hello.
    #[error("the cookie is invalid or expired: send a new hello")]
    Cookie,
    /// Too many sessions.
    #[error(
        "too many sessions for this tenant ({0}): close some, or wait for idle ones to expire"
    )]
    Full(usize),
    /// The operating system's random source failed.
    #[error("no randomness: {0}")]
    Random(String),
}

/// Limits of a [`Gatekeeper`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct SessionLimits {
    /// Sessions per tenant at most in one receive loop (the oldest idle one is evicted first).
    pub per_tenant: usize,
    /// Sessions idle this long are forgotten, nanoseconds.
    pub idle: Nanos,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            per_tenant: 4096,
            idle: 600_000_000_000,
        }
    }
}

/// The server's side of sessions: the credentials it accepts, the sessions it set up, the
/// cookies it issues. Pure: the driver passes `now` and the peer's address.
pub struct Gatekeeper {
    pub(super) epoch: u64,
    pub(super) tenants: Vec<TenantEntry>,
    pub(super) cookies: CookieJar,
    pub(super) sessions: IntMap<u64, Session>,
    pub(super) by_nonce: HashMap<[u8; NONCE_LEN], u64>,
    pub(super) limits: SessionLimits,
    pub(super) authentication: Authentication,
    /// The receive loop it keeps sessions for: the ids it draws route to it.
    pub(super) shard: crate::shard::Shard,
    /// Server nonces and session ids are drawn from it.
    pub(super) entropy: Entropy,
}

/// What [`Gatekeeper::open`] found in a sealed message.
#[derive(Debug)]
pub struct Opened<'a> {
    /// The session the envelope named; its tag, sender, peer and packet number checked.
    pub session: &'a Session,
    /// The inner message, unsealed but not decoded.
    pub inner: Bytes,
}

impl Gatekeeper {
    /// A gatekeeper for `tenants`, in server epoch `epoch` (random per start), drawing its
    /// server nonces and session ids from `entropy`.
    pub fn new(
        epoch: u64,
        tenants: Vec<TenantEntry>,
        cookies: CookieJar,
        entropy: Entropy,
    ) -> Gatekeeper {
        let mut tenants = tenants;
        for t in &mut tenants {
            // `Role::may_use` searches by halves: whatever the caller built, keep it
            // ascending and without repeats.
            if let Role::Tenant { apps, .. } = &mut t.role {
                apps.sort_unstable();
                apps.dedup();
            }
        }
        Gatekeeper {
            entropy,
            epoch,
            tenants,
            cookies,
            sessions: IntMap::default(),
            by_nonce: HashMap::new(),
            limits: SessionLimits::default(),
            authentication: Authentication::On,
            shard: crate::shard::Shard::SOLE,
        }
    }

    /// [`grant_app`] on this gatekeeper's credentials, and on the roles of the sessions it
    /// set up for them: those sessions may use the app from now on. Returns the ids of the
    /// sessions whose apps grew.
    pub fn grant(&mut self, owner: &str, app: u32, name: &str) -> Vec<u64> {
        let grown = grant_app(&mut self.tenants, owner, app, name);
        let mut changed = Vec::new();
        for (id, s) in self.sessions.iter_mut() {
            let Role::Tenant { name: n, apps } = &*s.role else {
                continue;
            };
            if !grown.contains(n) {
                continue;
            }
            if let Err(at) = apps.binary_search(&app) {
                let mut apps = apps.clone();
                apps.insert(at, app);
                s.role = Arc::new(Role::Tenant {
                    name: n.clone(),
                    apps,
                });
                changed.push(*id);
            }
        }
        changed
    }

    /// Keeps the sessions of receive loop `shard`: every id it draws routes there
    /// ([`crate::shard`]).
    pub fn with_shard(mut self, shard: crate::shard::Shard) -> Gatekeeper {
        self.shard = shard;
        self
    }

    /// Seals and opens the sessions it sets up with `authentication` (see [`Authentication`]).
    pub fn with_authentication(mut self, authentication: Authentication) -> Gatekeeper {
        self.authentication = authentication;
        self
    }

    /// Sets the limits.
    pub fn with_limits(mut self, limits: SessionLimits) -> Gatekeeper {
        self.limits = limits;
        self
    }

    /// This server start's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Sessions held, every tenant's (idle ones until [`Gatekeeper::expire`] runs).
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// The session with id `id`, unless it expired, was evicted or never was.
    pub fn session(&self, id: u64) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// Session `id`, heard from at `now` by a path with no envelope to open (a client in
    /// the same process hands its requests in): it stays as live as one whose datagrams open.
    pub fn heard_from(&mut self, id: u64, now: Nanos) -> Option<&Session> {
        let s = self.sessions.get_mut(&id)?;
        s.last_seen = s.last_seen.max(now);
        Some(s)
    }

    /// Every session held, in no particular order.
    pub fn sessions(&self) -> impl Iterator<Item = &Session> {
        self.sessions.values()
    }

    /// Answers a hello: a fresh server nonce and the cookie for `peer`.
    pub fn challenge(
        &self,
        now: Nanos,
        peer: SocketAddr,
        client_nonce: [u8; NONCE_LEN],
    ) -> Result<([u8; NONCE_LEN], [u8; COOKIE_LEN]), HandshakeError> {
        let server = self
            .entropy
            .array::<NONCE_LEN>()
            .map_err(|e| HandshakeError::Random(e.to_string()))?;
        let n = HandshakeNonces {
            client: client_nonce,
            server,
        };
        Ok((server, self.cookies.issue(peer, &n, now)))
    }

    /// Checks an `Auth` and sets up (or, for a retransmitted one, finds) its session.
    #[allow(clippy::too_many_arguments)]
    pub fn authenticate(
        &mut self,
        now: Nanos,
        peer: SocketAddr,
        tenant: &str,
        n: &HandshakeNonces,
        issued: Nanos,
        cookie: &[u8; COOKIE_LEN],
        proof: &[u8; 32],
    ) -> Result<&Session, HandshakeError> {
        if !self.cookies.check(peer, n, issued, cookie, now) {
            return Err(HandshakeError::Cookie);
        }
        let entry = self
            .tenants
            .iter()
            .find(|t| t.name == tenant)
            .ok_or(HandshakeError::Failed)?;
        if !entry.credential.check_proof(tenant, n, cookie, proof) {
            return Err(HandshakeError::Failed);
        }
        if let Some(id) = self.by_nonce.get(&n.server).copied() {
            if self.sessions.contains_key(&id) {
                return Ok(&self.sessions[&id]);
            }
        }
        let (role, credential) = (Arc::new(entry.role.clone()), entry.credential.clone());
        self.make_room(&role, now)?;
        let id = loop {
            let draw = self
                .entropy
                .nonzero_u64()
                .map_err(|e| HandshakeError::Random(e.to_string()))?;
            let id = self.shard.session_id(draw);
            if !self.sessions.contains_key(&id) {
                break id;
            }
        };
        let key = Arc::new(
            credential
                .session_key(id, n)
                .with_authentication(self.authentication),
        );
        self.by_nonce.insert(n.server, id);
        self.sessions.insert(
            id,
            Session {
                id,
                role,
                peer,
                sealer: Arc::new(Sealer::new(key, Sender::Server)),
                last_seen: now,
                window: ReplayWindow::default(),
                server_nonce: n.server,
            },
        );
        Ok(&self.sessions[&id])
    }

    /// Evicts the least recently seen session of `role`'s tenant when it is at its limit.
    pub(super) fn make_room(&mut self, role: &Arc<Role>, now: Nanos) -> Result<(), HandshakeError> {
        self.expire(now);
        let same = |s: &Session| *s.role == **role;
        let count = self.sessions.values().filter(|s| same(s)).count();
        if count < self.limits.per_tenant {
            return Ok(());
        }
        let oldest = self
            .sessions
            .values()
            .filter(|s| same(s))
            .min_by_key(|s| s.last_seen)
            .map(|s| s.id);
        match oldest {
            Some(id) => {
                self.remove(id);
                Ok(())
            }
            None => Err(HandshakeError::Full(self.limits.per_tenant)),
        }
    }

    pub(super) fn remove(&mut self, id: u64) {
        if let Some(s) = self.sessions.remove(&id) {
            self.by_nonce.remove(&s.server_nonce);
        }
    }

    /// Forgets sessions idle for longer than the limit.
    pub fn expire(&mut self, now: Nanos) {
        let idle = self.limits.idle;
        let old: Vec<u64> = self
            .sessions
            .values()
            .filter(|s| now.saturating_sub(s.last_seen) > idle)
            .map(|s| s.id)
            .collect();
        for id in old {
            self.remove(id);
        }
    }

    /// Opens a sealed message from `peer`: the tag, the sender, the address and the replay
    /// window are checked.
    pub fn open(
        &mut self,
        now: Nanos,
        peer: SocketAddr,
        sealed: &Bytes,
    ) -> Result<Opened<'_>, SealError> {
        let h = peek_sealed(sealed)?;
        let Some(s) = self.sessions.get_mut(&h.session) else {
            return Err(SealError::UnknownSession {
                session: h.session,
                tenant_tag: h.tenant_tag,
            });
        };
        if h.sender != Sender::Client {
            return Err(SealError::WrongSender(h.sender));
        }
        let (_, inner) = s.sealer.key().open(sealed)?;
        if s.peer != peer {
            return Err(SealError::WrongPeer {
                session: s.id,
                owner: s.peer,
                from: peer,
            });
        }
        if !s.window.accept(h.packet) {
            return Err(SealError::Replay {
                session: s.id,
                packet: h.packet,
            });
        }
        s.last_seen = now;
        Ok(Opened { session: s, inner })
    }

    /// The token of the "no such session" notice for `session`, which this server does not
    /// know (`None` if it does): the real one when a credential it holds has `tenant_tag`,
    /// which that tenant's clients check; else a decoy, a MAC under this process's cookie key
    /// that no one without the key can tell from a real token. A stranger gets the same
    /// answer whatever tag it guesses, so the answer confirms no tenant's tag.
    pub fn reset_token(&self, session: u64, tenant_tag: u32) -> Option<[u8; RESET_TOKEN_LEN]> {
        if self.sessions.contains_key(&session) {
            return None;
        }
        let real = self
            .tenants
            .iter()
            .find(|t| t.credential.tag() == tenant_tag)
            .map(|t| t.credential.reset_token(session));
        Some(real.unwrap_or_else(|| {
            let mut m = self.cookies.key.clone();
            m.update(b"naam reset decoy v1");
            m.update(&session.to_le_bytes());
            m.update(&tenant_tag.to_le_bytes());
            let out = m.finalize().into_bytes();
            let mut t = [0u8; RESET_TOKEN_LEN];
            t.copy_from_slice(&out[..RESET_TOKEN_LEN]);
            t
        }))
    }
}
