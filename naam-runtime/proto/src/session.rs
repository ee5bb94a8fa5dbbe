//! Sessions of the UDP fabric, IO-free: tenant credentials, the handshake that proves a peer
//! holds one (and that it owns its address), the sealed envelope every later datagram travels
//! in, replay windows, and the server's table of sessions with their scope. naam-runtime's UDP
//! drivers call into it; time is always an argument, and the only call out of the process is
//! for randomness (key material, nonces, session ids). Credential files are read and written by
//! the drivers (naam-runtime's `CredentialFile`).
//!
//! Handshake (control messages: naam-runtime's `udp::control::Control`):
//! ```text
//! client → server  Hello     { tenant, client nonce }                          unsealed, padded
//! server → client  Challenge { server nonce, issued, cookie }                  unsealed, small
//! client → server  Auth      { tenant, both nonces, issued, cookie, proof }    unsealed
//! server → client  Welcome   { session, epoch, scoped manifest, ... }          sealed
//! ```
//! The cookie is a MAC of the peer's address and both nonces under a key only the server knows,
//! so an `Auth` that carries a valid one proves the peer receives datagrams at its address:
//! until then nothing sent to it is larger than [`AMPLIFICATION`] times what it sent. The
//! proof is a MAC of the tenant, both nonces and the cookie under the tenant's credential; the
//! session key is derived from the same inputs and the session id, so both nonces are fresh
//! for every session and nothing secret crosses the network.
//!
//! Sealed envelope (kind [`KIND_SEALED`], little-endian):
//! ```text
//!  0 u8 version (1)   1 u8 kind (7)   2 u8 sender (0 client, 1 server, 2 NIC)   3 u8 0
//!  4 u32 tenant tag (names the credential without revealing it)
//!  8 u64 session id  16 u64 packet number (per sender, never reused)
//! 24 the inner message (request, reply, control, one-sided operation or completion)
//! end-16 HMAC-SHA-256 of everything before it under the session key, first 16 bytes
//! ```
//! A receiver drops datagrams whose tag does not verify, whose packet number it has seen
//! (a [`ReplayWindow`] per session), or that come from another address than the session's.
//! A server that does not know a session (it restarted) answers [`StaleNotice`] carrying a
//! reset token only the credential's holder can compute, so the client handshakes again at
//! once and a stranger cannot forge the notice.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::ChaCha20Poly1305;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::kind::VERSION;
use crate::Nanos;

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA-256 keyed with `key`.
fn hmac_with(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length")
}

pub use crate::kind::SEALED as KIND_SEALED;
pub use crate::limits::{SEAL_OVERHEAD, SEAL_TAG as TAG_LEN};
/// Bytes of the sealed envelope before the inner message (the XDP eSwitch reads it).
pub const SEAL_HEADER: usize = naam_ebpf::eswitch::SEAL_HEADER;
/// Bytes of a credential (a 256-bit secret).
pub const CREDENTIAL_LEN: usize = 32;
/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an address-validation cookie.
pub const COOKIE_LEN: usize = 16;
/// Bytes of a reset token.
pub const RESET_TOKEN_LEN: usize = 16;
/// Until a peer has proved its address, nothing sent to it is larger than this many times
/// what it sent (QUIC's limit).
pub const AMPLIFICATION: usize = 3;
/// Bytes a client pads its hello to, so that the challenge is far inside the limit.
pub const HELLO_PADDING: usize = 256;
/// How long a cookie stays valid, nanoseconds.
pub const COOKIE_LIFETIME: Nanos = 10_000_000_000;
/// Packets behind the newest one a replay window still accepts (reordering tolerated).
pub const REPLAY_WINDOW: u64 = 1024;
/// The tenant name a naam-nic pairs under (its credential is the pairing secret).
pub const NIC_TENANT: &str = "naam-nic";
/// The tenant name of the operator (congestion experiments, switch counters).
pub const OPERATOR_TENANT: &str = "naam-operator";

/// Who sealed a message. A receiver accepts only the senders its side talks to, so a message
/// cannot be reflected back to its sender as if the other side had sent it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Sender {
    /// A client (or naam-nic on its pairing session).
    Client = 0,
    /// naam-server.
    Server = 1,
    /// naam-nic answering a client.
    Nic = 2,
}

impl Sender {
    fn from_u8(v: u8) -> Option<Sender> {
        match v {
            0 => Some(Sender::Client),
            1 => Some(Sender::Server),
            2 => Some(Sender::Nic),
            _ => None,
        }
    }
}

/// Why a credential could not be read, written or made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CredentialError {
    /// The file could not be read or written.
    #[error("credential file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The contents are not 64 hexadecimal digits.
    #[error("credential file {path}: expected {} hexadecimal digits (as `naam-server keygen` writes), found {found}", 2 * CREDENTIAL_LEN)]
    Format {
        /// The file.
        path: PathBuf,
        /// What was found instead.
        found: String,
    },
    /// Group or others may read the file.
    #[error("credential file {path} is readable by group or others (mode {mode:o}): run `chmod 600 {path}`")]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
    },
    /// The system's random source failed.
    #[error("no randomness from the operating system: {0}")]
    Random(String),
}

/// Fills `out` from the operating system's random source.
pub fn random_bytes(out: &mut [u8]) -> Result<(), CredentialError> {
    getrandom::fill(out).map_err(|e| CredentialError::Random(e.to_string()))
}

/// A fresh random 64-bit value, never 0.
pub fn random_u64() -> Result<u64, CredentialError> {
    loop {
        let mut b = [0u8; 8];
        random_bytes(&mut b)?;
        let v = u64::from_le_bytes(b);
        if v != 0 {
            return Ok(v);
        }
    }
}

/// A tenant's secret (or the NIC's pairing secret, or the operator's). It never leaves the
/// process that holds it, and its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential([u8; CREDENTIAL_LEN]);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credential(tag {:08x})", self.tag())
    }
}

impl Credential {
    /// A new random credential.
    pub fn generate() -> Result<Credential, CredentialError> {
        let mut b = [0u8; CREDENTIAL_LEN];
        random_bytes(&mut b)?;
        Ok(Credential(b))
    }

    /// A credential from its raw bytes (tests and key stores).
    pub fn from_bytes(bytes: [u8; CREDENTIAL_LEN]) -> Credential {
        Credential(bytes)
    }

    /// Parses the file format: 64 hexadecimal digits, surrounding white space ignored.
    pub fn parse(text: &str, path: &Path) -> Result<Credential, CredentialError> {
        let t = text.trim();
        let mut b = [0u8; CREDENTIAL_LEN];
        match hex::decode_to_slice(t, &mut b) {
            Ok(()) => Ok(Credential(b)),
            Err(_) => Err(CredentialError::Format {
                path: path.to_path_buf(),
                found: if t.len() > 80 {
                    format!("{} characters", t.len())
                } else {
                    format!("{t:?}")
                },
            }),
        }
    }

    /// The credential file's text: 64 hexadecimal digits and a newline. Drivers write it to
    /// a file only its owner may read (naam-runtime's `CredentialFile::write_new`).
    pub fn file_text(&self) -> String {
        format!("{}\n", hex::encode(self.0))
    }

    fn mac(&self) -> HmacSha256 {
        hmac_with(&self.0)
    }

    /// A public 32-bit name of the credential (a MAC of a constant under it): sealed messages
    /// carry it so a restarted server can find the credential of a session it forgot.
    pub fn tag(&self) -> u32 {
        let mut m = self.mac();
        m.update(b"naam tenant tag v1");
        let out = m.finalize().into_bytes();
        u32::from_le_bytes([out[0], out[1], out[2], out[3]])
    }

    fn proof_mac(
        &self,
        tenant: &str,
        n: &HandshakeNonces,
        cookie: &[u8; COOKIE_LEN],
    ) -> HmacSha256 {
        let mut m = self.mac();
        m.update(b"naam auth v1");
        m.update(&(tenant.len() as u32).to_le_bytes());
        m.update(tenant.as_bytes());
        m.update(&n.client);
        m.update(&n.server);
        m.update(cookie);
        m
    }

    /// The handshake proof: shows the holder of this credential took part in the handshake
    /// with these nonces and cookie, for `tenant`.
    pub fn proof(&self, tenant: &str, n: &HandshakeNonces, cookie: &[u8; COOKIE_LEN]) -> [u8; 32] {
        self.proof_mac(tenant, n, cookie)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a handshake proof in constant time.
    pub fn check_proof(
        &self,
        tenant: &str,
        n: &HandshakeNonces,
        cookie: &[u8; COOKIE_LEN],
        proof: &[u8; 32],
    ) -> bool {
        self.proof_mac(tenant, n, cookie)
            .verify_slice(proof)
            .is_ok()
    }

    /// The key of session `session` set up with nonces `n`.
    pub fn session_key(&self, session: u64, n: &HandshakeNonces) -> SessionKey {
        let mut m = self.mac();
        m.update(b"naam session key v1");
        m.update(&session.to_le_bytes());
        m.update(&n.client);
        m.update(&n.server);
        SessionKey::new(session, self.tag(), m.finalize().into_bytes().into())
    }

    /// The rkey of region `region` of app `app`: derived from the credential, so it stays the
    /// same across server restarts (clients keep working without re-reading the manifest)
    /// and is still unguessable to anyone without the credential. Never 0.
    pub fn region_key(&self, app: u32, region: &str) -> u64 {
        let mut m = self.mac();
        m.update(b"naam region key v1");
        m.update(&app.to_le_bytes());
        m.update(region.as_bytes());
        let out = m.finalize().into_bytes();
        u64::from_le_bytes(out[..8].try_into().expect("8 bytes")).max(1)
    }

    /// The token that authenticates a "no such session" notice for `session`: only this
    /// credential's holders (the client, and a server configured with it) can compute it.
    pub fn reset_token(&self, session: u64) -> [u8; RESET_TOKEN_LEN] {
        let mut m = self.mac();
        m.update(b"naam reset v1");
        m.update(&session.to_le_bytes());
        let out = m.finalize().into_bytes();
        let mut t = [0u8; RESET_TOKEN_LEN];
        t.copy_from_slice(&out[..RESET_TOKEN_LEN]);
        t
    }
}

/// The two fresh nonces of one handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeNonces {
    /// The client's.
    pub client: [u8; NONCE_LEN],
    /// The server's.
    pub server: [u8; NONCE_LEN],
}

/// Why a sealed message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// Too short to be sealed, or not a sealed message.
    #[error("not a sealed message ({0})")]
    Malformed(&'static str),
    /// No session with this id.
    #[error("no session {session:#x}")]
    UnknownSession {
        /// The session id the message names.
        session: u64,
        /// The tenant tag it carries.
        tenant_tag: u32,
    },
    /// The tag does not verify under the session's key.
    #[error("the authentication tag of a message for session {0:#x} does not verify")]
    BadTag(u64),
    /// A packet number already seen, or too far behind the newest.
    #[error("packet {packet} of session {session:#x} is a replay")]
    Replay {
        /// Session.
        session: u64,
        /// Packet number.
        packet: u64,
    },
    /// The session belongs to another address.
    #[error("session {session:#x} belongs to {owner}, not {from}")]
    WrongPeer {
        /// Session.
        session: u64,
        /// Its address.
        owner: SocketAddr,
        /// Where the message came from.
        from: SocketAddr,
    },
    /// A sender this side does not accept.
    #[error("a message sealed by {0:?} is not accepted here")]
    WrongSender(Sender),
}

/// The header of a sealed message, read before its tag is checked (so it is not yet trusted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SealedHeader {
    /// Who sealed it.
    pub sender: Sender,
    /// The tenant tag.
    pub tenant_tag: u32,
    /// The session.
    pub session: u64,
    /// The packet number.
    pub packet: u64,
}

/// Reads the header of a sealed message.
pub fn peek_sealed(buf: &[u8]) -> Result<SealedHeader, SealError> {
    if buf.len() < SEAL_OVERHEAD {
        return Err(SealError::Malformed("shorter than the envelope"));
    }
    if buf[0] != VERSION || buf[1] != KIND_SEALED {
        return Err(SealError::Malformed("wrong version or kind"));
    }
    let sender = Sender::from_u8(buf[2]).ok_or(SealError::Malformed("unknown sender"))?;
    if buf[3] != 0 {
        return Err(SealError::Malformed("reserved byte is not zero"));
    }
    let u64_at = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
    Ok(SealedHeader {
        sender,
        tenant_tag: u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes")),
        session: u64_at(8),
        packet: u64_at(16),
    })
}

/// Whether sealed datagrams carry and need a real authentication tag.
///
/// `Off` exists for one purpose: measuring what authentication costs, against the same build
/// (`naam-bench experiment auth-cost`). Sessions are still set up and replay windows still
/// run; only the tag is neither computed nor checked. Drivers refuse it on anything but
/// loopback, and naam-server and naam-nic offer no way to ask for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Authentication {
    /// HMAC-SHA-256 on every datagram (always, in every deployment).
    #[default]
    On,
    /// No tag computed or checked: a loopback measurement's baseline only.
    OffForMeasurement,
}

impl Authentication {
    /// Refuses [`Authentication::OffForMeasurement`] unless `addr` is a loopback address.
    pub fn check_scope(self, addr: SocketAddr) -> Result<(), String> {
        if self == Authentication::OffForMeasurement && !addr.ip().is_loopback() {
            return Err(format!(
                "authentication can be turned off only on loopback, to measure its cost \
                 ({addr} is not loopback)"
            ));
        }
        Ok(())
    }
}

/// The keyed MAC of one session, with its id and tenant tag: seals and opens its messages.
pub struct SessionKey {
    id: u64,
    tenant_tag: u32,
    raw: [u8; 32],
    mac: HmacSha256,
    authentication: Authentication,
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionKey(session {:#x})", self.id)
    }
}

impl SessionKey {
    /// The key of session `id` from its 32 raw bytes.
    pub fn new(id: u64, tenant_tag: u32, raw: [u8; 32]) -> SessionKey {
        SessionKey {
            id,
            tenant_tag,
            raw,
            mac: hmac_with(&raw),
            authentication: Authentication::On,
        }
    }

    /// The same key sealing and opening with `authentication` (see [`Authentication`]).
    pub fn with_authentication(mut self, authentication: Authentication) -> SessionKey {
        self.authentication = authentication;
        self
    }

    /// The session id.
    pub fn session(&self) -> u64 {
        self.id
    }

    /// The tenant tag.
    pub fn tenant_tag(&self) -> u32 {
        self.tenant_tag
    }

    /// Seals `inner` as packet `packet` from `sender`.
    pub fn seal(&self, sender: Sender, packet: u64, inner: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(SEAL_OVERHEAD + inner.len());
        b.put_u8(VERSION);
        b.put_u8(KIND_SEALED);
        b.put_u8(sender as u8);
        b.put_u8(0);
        b.put_u32_le(self.tenant_tag);
        b.put_u64_le(self.id);
        b.put_u64_le(packet);
        b.put_slice(inner);
        if self.authentication == Authentication::OffForMeasurement {
            b.put_slice(&[0; TAG_LEN]);
            return b.freeze();
        }
        let mut m = self.mac.clone();
        m.update(&b);
        let tag = m.finalize().into_bytes();
        b.put_slice(&tag[..TAG_LEN]);
        b.freeze()
    }

    /// Checks the tag of a sealed message of this session and returns its header and inner
    /// message (a slice of `sealed`). Replays are the caller's [`ReplayWindow`]'s to catch.
    pub fn open(&self, sealed: &Bytes) -> Result<(SealedHeader, Bytes), SealError> {
        let h = peek_sealed(sealed)?;
        if h.session != self.id {
            return Err(SealError::UnknownSession {
                session: h.session,
                tenant_tag: h.tenant_tag,
            });
        }
        let end = sealed.len() - TAG_LEN;
        if self.authentication == Authentication::On {
            let mut m = self.mac.clone();
            m.update(&sealed[..end]);
            m.verify_truncated_left(&sealed[end..])
                .map_err(|_| SealError::BadTag(h.session))?;
        }
        Ok((h, sealed.slice(SEAL_HEADER..end)))
    }

    /// Encrypts this key for the paired NIC under `pairing` (the NIC's own session key):
    /// ChaCha20-Poly1305, the nonce and associated data bound to this session's id and tag.
    pub fn wrap(&self, pairing: &SessionKey) -> Vec<u8> {
        let aead = pairing.wrapping_cipher();
        let nonce = wrap_nonce(self.id);
        aead.encrypt(
            (&nonce).into(),
            Payload {
                msg: &self.raw,
                aad: &wrap_aad(self.id, self.tenant_tag),
            },
        )
        .expect("ChaCha20-Poly1305 encrypts 32 bytes")
    }

    /// The key [`SessionKey::wrap`] encrypted, if `wrapped` was made under `pairing` for
    /// session `id` of tenant `tenant_tag`.
    pub fn unwrap(
        pairing: &SessionKey,
        id: u64,
        tenant_tag: u32,
        wrapped: &[u8],
    ) -> Option<SessionKey> {
        let aead = pairing.wrapping_cipher();
        let nonce = wrap_nonce(id);
        let raw = aead
            .decrypt(
                (&nonce).into(),
                Payload {
                    msg: wrapped,
                    aad: &wrap_aad(id, tenant_tag),
                },
            )
            .ok()?;
        let raw: [u8; 32] = raw.try_into().ok()?;
        Some(SessionKey::new(id, tenant_tag, raw))
    }

    fn wrapping_cipher(&self) -> ChaCha20Poly1305 {
        let mut m = self.mac.clone();
        m.update(b"naam key wrapping v1");
        let k = m.finalize().into_bytes();
        <ChaCha20Poly1305 as chacha20poly1305::KeyInit>::new(&k)
    }
}

fn wrap_nonce(id: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&id.to_le_bytes());
    n
}

fn wrap_aad(id: u64, tag: u32) -> [u8; 12] {
    let mut a = [0u8; 12];
    a[..8].copy_from_slice(&id.to_le_bytes());
    a[8..].copy_from_slice(&tag.to_le_bytes());
    a
}

/// The sending half of a session: its key and the next packet number. Shared by the threads
/// that answer on the session (host executors send replies themselves).
#[derive(Debug)]
pub struct Sealer {
    key: Arc<SessionKey>,
    sender: Sender,
    next: AtomicU64,
}

impl Sealer {
    /// Seals for `key` as `sender`, numbering packets from 1.
    pub fn new(key: Arc<SessionKey>, sender: Sender) -> Sealer {
        Sealer {
            key,
            sender,
            next: AtomicU64::new(1),
        }
    }

    /// Seals `inner` as the next packet.
    pub fn seal(&self, inner: &[u8]) -> Bytes {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.key.seal(self.sender, n, inner)
    }

    /// The key.
    pub fn key(&self) -> &Arc<SessionKey> {
        &self.key
    }
}

/// The packet numbers of one session a receiver has accepted: the newest, and a bitmap of the
/// [`REPLAY_WINDOW`] before it.
#[derive(Clone, Debug, Default)]
pub struct ReplayWindow {
    top: u64,
    seen: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl ReplayWindow {
    /// Accepts `packet` once; refuses packet 0, repeats, and packets the window has passed.
    pub fn accept(&mut self, packet: u64) -> bool {
        if packet == 0 {
            return false;
        }
        if packet > self.top {
            let shift = packet - self.top;
            if shift >= REPLAY_WINDOW {
                self.seen = Default::default();
            } else {
                for _ in 0..shift {
                    self.top += 1;
                    self.clear(self.top);
                }
            }
            self.top = packet;
            self.set(packet);
            return true;
        }
        if self.top - packet >= REPLAY_WINDOW || self.get(packet) {
            return false;
        }
        self.set(packet);
        true
    }

    fn slot(p: u64) -> (usize, u64) {
        let i = p % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    fn get(&self, p: u64) -> bool {
        let (w, b) = Self::slot(p);
        self.seen[w] & b != 0
    }

    fn set(&mut self, p: u64) {
        let (w, b) = Self::slot(p);
        self.seen[w] |= b;
    }

    fn clear(&mut self, p: u64) {
        let (w, b) = Self::slot(p);
        self.seen[w] &= !b;
    }
}

/// Issues and checks address-validation cookies (stateless: a MAC under a key of this
/// server process).
pub struct CookieJar {
    key: HmacSha256,
}

impl CookieJar {
    /// A jar with a fresh random key.
    pub fn new() -> Result<CookieJar, CredentialError> {
        let mut k = [0u8; 32];
        random_bytes(&mut k)?;
        Ok(CookieJar::with_key(k))
    }

    /// A jar with a given key (tests).
    pub fn with_key(key: [u8; 32]) -> CookieJar {
        CookieJar {
            key: hmac_with(&key),
        }
    }

    fn mac(&self, peer: SocketAddr, n: &HandshakeNonces, issued: Nanos) -> HmacSha256 {
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
        /// The apps sharing its credential.
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
        matches!(self, Role::Tenant { apps, .. } if apps.contains(&app))
    }
}

/// One credential the server accepts, and the role a session proving it gets.
#[derive(Clone, Debug)]
pub struct TenantEntry {
    /// The name a hello gives.
    pub name: String,
    /// The credential.
    pub credential: Credential,
    /// The role.
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
    let mut out: Vec<TenantEntry> = apps
        .iter()
        .map(|(_, name, c)| TenantEntry {
            name: name.clone(),
            credential: c.clone(),
            role: Role::Tenant {
                name: name.clone(),
                apps: apps
                    .iter()
                    .filter(|(_, _, other)| other == c)
                    .map(|(id, _, _)| *id)
                    .collect(),
            },
        })
        .collect();
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

/// A session the server knows.
#[derive(Debug)]
pub struct Session {
    /// Its id.
    pub id: u64,
    /// What it may do.
    pub role: Arc<Role>,
    /// The address it was set up from; answers go only there.
    pub peer: SocketAddr,
    /// Sealing of answers (server side).
    pub sealer: Arc<Sealer>,
    /// When it last sent an authenticated message.
    pub last_seen: Nanos,
    window: ReplayWindow,
    server_nonce: [u8; NONCE_LEN],
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
pub struct SessionLimits {
    /// Sessions per tenant at most (the oldest idle one is evicted first).
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
    epoch: u64,
    tenants: Vec<TenantEntry>,
    cookies: CookieJar,
    sessions: HashMap<u64, Session>,
    by_nonce: HashMap<[u8; NONCE_LEN], u64>,
    limits: SessionLimits,
    authentication: Authentication,
}

/// What [`Gatekeeper::open`] found in a sealed message.
#[derive(Debug)]
pub struct Opened<'a> {
    /// The session.
    pub session: &'a Session,
    /// The inner message.
    pub inner: Bytes,
}

impl Gatekeeper {
    /// A gatekeeper for `tenants`, in server epoch `epoch` (random per start).
    pub fn new(epoch: u64, tenants: Vec<TenantEntry>, cookies: CookieJar) -> Gatekeeper {
        Gatekeeper {
            epoch,
            tenants,
            cookies,
            sessions: HashMap::new(),
            by_nonce: HashMap::new(),
            limits: SessionLimits::default(),
            authentication: Authentication::On,
        }
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

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// The session `id`.
    pub fn session(&self, id: u64) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// Every session.
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
        let mut server = [0u8; NONCE_LEN];
        random_bytes(&mut server).map_err(|e| HandshakeError::Random(e.to_string()))?;
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
            let id = random_u64().map_err(|e| HandshakeError::Random(e.to_string()))?;
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
    fn make_room(&mut self, role: &Arc<Role>, now: Nanos) -> Result<(), HandshakeError> {
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

    fn remove(&mut self, id: u64) {
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

    /// The reset token for a session this server does not know, if a credential it holds has
    /// `tenant_tag` (a stranger's guess gets nothing).
    pub fn reset_token(&self, session: u64, tenant_tag: u32) -> Option<[u8; RESET_TOKEN_LEN]> {
        if self.sessions.contains_key(&session) {
            return None;
        }
        self.tenants
            .iter()
            .find(|t| t.credential.tag() == tenant_tag)
            .map(|t| t.credential.reset_token(session))
    }
}

/// The client's half of a handshake: its nonce, then the session it was given.
#[derive(Debug)]
pub struct ClientHandshake {
    tenant: String,
    credential: Credential,
    nonce: [u8; NONCE_LEN],
}

impl ClientHandshake {
    /// Starts a handshake as `tenant` with a fresh nonce.
    pub fn new(tenant: &str, credential: Credential) -> Result<ClientHandshake, CredentialError> {
        let mut nonce = [0u8; NONCE_LEN];
        random_bytes(&mut nonce)?;
        Ok(ClientHandshake {
            tenant: tenant.to_string(),
            credential,
            nonce,
        })
    }

    /// The tenant name.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The client nonce.
    pub fn nonce(&self) -> [u8; NONCE_LEN] {
        self.nonce
    }

    /// The credential.
    pub fn credential(&self) -> &Credential {
        &self.credential
    }

    /// The proof for a challenge of `server_nonce` with `cookie`.
    pub fn proof(&self, server_nonce: [u8; NONCE_LEN], cookie: &[u8; COOKIE_LEN]) -> [u8; 32] {
        self.credential
            .proof(&self.tenant, &self.nonces(server_nonce), cookie)
    }

    fn nonces(&self, server: [u8; NONCE_LEN]) -> HandshakeNonces {
        HandshakeNonces {
            client: self.nonce,
            server,
        }
    }

    /// The key of session `session` answered to the challenge of `server_nonce`.
    pub fn session_key(&self, session: u64, server_nonce: [u8; NONCE_LEN]) -> SessionKey {
        self.credential
            .session_key(session, &self.nonces(server_nonce))
    }
}

/// Serde of fixed-size byte arrays as hexadecimal strings (handshake fields in JSON).
pub mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the bytes as hex.
    pub fn serialize<S: Serializer, const N: usize>(b: &[u8; N], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(b))
    }

    /// Reads exactly `N` bytes of hex.
    pub fn deserialize<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<[u8; N], D::Error> {
        let s = <&str>::deserialize(d)?;
        let mut out = [0u8; N];
        hex::decode_to_slice(s, &mut out).map_err(serde::de::Error::custom)?;
        Ok(out)
    }
}

/// Serde of variable-length bytes as hexadecimal strings.
pub mod hex_vec {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the bytes as hex.
    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(b))
    }

    /// Reads hex bytes (at most 256).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = <&str>::deserialize(d)?;
        if s.len() > 512 {
            return Err(serde::de::Error::custom("over 256 bytes"));
        }
        hex::decode(s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cred(b: u8) -> Credential {
        Credential::from_bytes([b; 32])
    }

    fn peer() -> SocketAddr {
        "10.0.0.7:4000".parse().unwrap()
    }

    fn gate() -> Gatekeeper {
        Gatekeeper::new(
            9,
            vec![
                TenantEntry {
                    name: "mica".into(),
                    credential: cred(1),
                    role: Role::Tenant {
                        name: "mica".into(),
                        apps: vec![1],
                    },
                },
                TenantEntry {
                    name: "btree".into(),
                    credential: cred(2),
                    role: Role::Tenant {
                        name: "btree".into(),
                        apps: vec![2],
                    },
                },
            ],
            CookieJar::with_key([7; 32]),
        )
    }

    /// Runs a whole handshake; returns the session id and the client's key.
    fn handshake(g: &mut Gatekeeper, tenant: &str, c: Credential, now: Nanos) -> (u64, SessionKey) {
        let hs = ClientHandshake::new(tenant, c).unwrap();
        let (sn, cookie) = g.challenge(now, peer(), hs.nonce()).unwrap();
        let n = HandshakeNonces {
            client: hs.nonce(),
            server: sn,
        };
        let proof = hs.proof(sn, &cookie);
        let id = g
            .authenticate(now, peer(), tenant, &n, now, &cookie, &proof)
            .unwrap()
            .id;
        (id, hs.session_key(id, sn))
    }

    #[test]
    fn a_handshake_gives_both_sides_one_key() {
        let mut g = gate();
        let (id, key) = handshake(&mut g, "mica", cred(1), 5);
        let m = key.seal(Sender::Client, 1, b"hello");
        let o = g.open(6, peer(), &m).unwrap();
        assert_eq!(&o.inner[..], b"hello");
        assert!(o.session.role.may_use(1) && !o.session.role.may_use(2));
        // The answer the server seals opens at the client.
        let a = g.session(id).unwrap().sealer.seal(b"answer");
        let (h, inner) = key.open(&a).unwrap();
        assert_eq!((h.sender, &inner[..]), (Sender::Server, &b"answer"[..]));
    }

    #[test]
    fn a_wrong_credential_or_a_forged_cookie_gets_no_session() {
        let mut g = gate();
        let hs = ClientHandshake::new("mica", cred(2)).unwrap();
        let (sn, cookie) = g.challenge(0, peer(), hs.nonce()).unwrap();
        let n = HandshakeNonces {
            client: hs.nonce(),
            server: sn,
        };
        let proof = hs.proof(sn, &cookie);
        let e = g.authenticate(0, peer(), "mica", &n, 0, &cookie, &proof);
        assert_eq!(e.unwrap_err(), HandshakeError::Failed);
        assert_eq!(
            g.authenticate(0, peer(), "nobody", &n, 0, &cookie, &proof)
                .unwrap_err(),
            HandshakeError::Failed
        );
        // The cookie is bound to the address, the nonces and its time.
        let other: SocketAddr = "10.0.0.8:4000".parse().unwrap();
        assert_eq!(
            g.authenticate(0, other, "mica", &n, 0, &cookie, &proof)
                .unwrap_err(),
            HandshakeError::Cookie
        );
        assert_eq!(
            g.authenticate(COOKIE_LIFETIME + 1, peer(), "mica", &n, 0, &cookie, &proof)
                .unwrap_err(),
            HandshakeError::Cookie
        );
        assert!(g.is_empty());
    }

    #[test]
    fn a_retransmitted_auth_finds_the_same_session() {
        let mut g = gate();
        let hs = ClientHandshake::new("btree", cred(2)).unwrap();
        let (sn, cookie) = g.challenge(0, peer(), hs.nonce()).unwrap();
        let n = HandshakeNonces {
            client: hs.nonce(),
            server: sn,
        };
        let proof = hs.proof(sn, &cookie);
        let a = g
            .authenticate(1, peer(), "btree", &n, 0, &cookie, &proof)
            .unwrap()
            .id;
        let b = g
            .authenticate(2, peer(), "btree", &n, 0, &cookie, &proof)
            .unwrap()
            .id;
        assert_eq!(a, b);
        assert_eq!(g.len(), 1);
    }

    #[test]
    fn tampering_replays_other_addresses_and_reflection_are_refused() {
        let mut g = gate();
        let (id, key) = handshake(&mut g, "mica", cred(1), 0);
        let m = key.seal(Sender::Client, 7, b"put key=1");
        let mut bad = m.to_vec();
        bad[SEAL_HEADER] ^= 1;
        assert_eq!(
            g.open(1, peer(), &Bytes::from(bad)).unwrap_err(),
            SealError::BadTag(id)
        );
        let other: SocketAddr = "10.9.9.9:1".parse().unwrap();
        assert!(matches!(
            g.open(1, other, &m).unwrap_err(),
            SealError::WrongPeer { .. }
        ));
        g.open(1, peer(), &m).unwrap();
        assert!(matches!(
            g.open(1, peer(), &m).unwrap_err(),
            SealError::Replay { packet: 7, .. }
        ));
        // The server's own answer sent back to it is not a client's message.
        let echo = g.session(id).unwrap().sealer.seal(b"x");
        assert!(matches!(
            g.open(1, peer(), &echo).unwrap_err(),
            SealError::WrongSender(Sender::Server)
        ));
        // Another tenant's key cannot speak for this session.
        let (_, other_key) = handshake(&mut g, "btree", cred(2), 0);
        let forged = SessionKey::new(id, other_key.tenant_tag(), other_key.raw);
        assert_eq!(
            g.open(1, peer(), &forged.seal(Sender::Client, 8, b"x"))
                .unwrap_err(),
            SealError::BadTag(id)
        );
    }

    #[test]
    fn stale_notices_are_authenticated_by_the_credential() {
        let g = gate();
        let c = cred(1);
        assert_eq!(
            g.reset_token(42, c.tag()),
            Some(c.reset_token(42)),
            "a restarted server proves the notice with the tenant's credential"
        );
        assert_eq!(g.reset_token(42, cred(3).tag()), None);
        assert_ne!(c.reset_token(42), cred(2).reset_token(42));
    }

    #[test]
    fn authentication_is_off_only_where_asked_and_only_on_loopback() {
        let on = SessionKey::new(7, 1, [9; 32]);
        let off =
            SessionKey::new(7, 1, [9; 32]).with_authentication(Authentication::OffForMeasurement);
        let sealed_off = off.seal(Sender::Client, 1, b"hello");
        assert_eq!(&sealed_off[sealed_off.len() - TAG_LEN..], &[0; TAG_LEN]);
        // A key with authentication on never opens an untagged datagram...
        assert!(matches!(on.open(&sealed_off), Err(SealError::BadTag(7))));
        // ...and the measurement's key opens both (it checks nothing).
        let sealed_on = on.seal(Sender::Client, 2, b"hello");
        assert_eq!(
            off.open(&sealed_on).unwrap().1,
            Bytes::from_static(b"hello")
        );
        let loopback: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let network: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        assert!(Authentication::OffForMeasurement
            .check_scope(loopback)
            .is_ok());
        let e = Authentication::OffForMeasurement
            .check_scope(network)
            .unwrap_err();
        assert!(e.contains("only on loopback"), "{e}");
        assert!(Authentication::On.check_scope(network).is_ok());
    }

    #[test]
    fn wrapped_keys_open_only_under_their_pairing_and_session() {
        let pairing = SessionKey::new(1, 0, [3; 32]);
        let k = SessionKey::new(77, 5, [9; 32]);
        let w = k.wrap(&pairing);
        let back = SessionKey::unwrap(&pairing, 77, 5, &w).unwrap();
        assert_eq!(back.raw, k.raw);
        assert!(SessionKey::unwrap(&pairing, 78, 5, &w).is_none());
        assert!(SessionKey::unwrap(&pairing, 77, 6, &w).is_none());
        assert!(SessionKey::unwrap(&SessionKey::new(1, 0, [4; 32]), 77, 5, &w).is_none());
    }

    #[test]
    fn sessions_per_tenant_are_bounded_and_idle_ones_expire() {
        let mut g = gate().with_limits(SessionLimits {
            per_tenant: 2,
            idle: 100,
        });
        let (a, _) = handshake(&mut g, "mica", cred(1), 0);
        let (b, _) = handshake(&mut g, "mica", cred(1), 1);
        let (c, _) = handshake(&mut g, "mica", cred(1), 2);
        let (d, _) = handshake(&mut g, "btree", cred(2), 2);
        assert!(g.session(a).is_none(), "the oldest of the full tenant went");
        assert!(g.session(b).is_some() && g.session(c).is_some() && g.session(d).is_some());
        g.expire(102);
        assert!(g.session(b).is_none() && g.session(c).is_some());
    }

    #[test]
    fn the_replay_window_slides() {
        let mut w = ReplayWindow::default();
        assert!(!w.accept(0));
        assert!(w.accept(5));
        assert!(w.accept(3));
        assert!(!w.accept(3) && !w.accept(5));
        assert!(w.accept(5 + REPLAY_WINDOW));
        assert!(!w.accept(5), "behind the window");
        assert!(w.accept(6), "just inside the window");
        assert!(w.accept(100_000));
        assert!(!w.accept(100_000 - REPLAY_WINDOW));
        assert!(w.accept(100_000 - REPLAY_WINDOW + 1));
    }

    #[test]
    fn credential_text_is_strict_and_debug_hides_it() {
        let c = Credential::generate().unwrap();
        let p = Path::new("t.key");
        assert_eq!(Credential::parse(&c.file_text(), p).unwrap(), c);
        assert!(matches!(
            Credential::parse("abc", p),
            Err(CredentialError::Format { .. })
        ));
        assert!(!format!("{c:?}").contains(&hex::encode(c.0)));
    }

    proptest! {
        #[test]
        fn opening_never_panics_and_never_accepts_a_forgery(
            bytes in proptest::collection::vec(any::<u8>(), 0..120),
            packet in 1u64..u64::MAX,
        ) {
            let key = SessionKey::new(5, 1, [8; 32]);
            let _ = peek_sealed(&bytes);
            let mut m = bytes.clone();
            if m.len() >= SEAL_OVERHEAD {
                m[0] = VERSION;
                m[1] = KIND_SEALED;
                m[8..16].copy_from_slice(&5u64.to_le_bytes());
            }
            prop_assert!(key.open(&Bytes::from(m)).is_err());
            let sealed = key.seal(Sender::Client, packet, &bytes);
            let (h, inner) = key.open(&sealed).unwrap();
            prop_assert_eq!(h.packet, packet);
            prop_assert_eq!(&inner[..], &bytes[..]);
        }

        #[test]
        fn a_window_accepts_each_packet_at_most_once(ps in proptest::collection::vec(1u64..3000, 1..400)) {
            let mut w = ReplayWindow::default();
            let mut accepted = std::collections::HashSet::new();
            for p in ps {
                if w.accept(p) {
                    prop_assert!(accepted.insert(p));
                }
            }
        }
    }
}
