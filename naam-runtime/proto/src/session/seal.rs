//! Sealed envelopes: session keys, sealing and opening, the key wrap for the paired NIC, and
//! replay windows.

use super::{
    hmac_with, Aead, Arc, AtomicU64, BufMut, Bytes, BytesMut, ChaCha20Poly1305, HmacSha256, Mac,
    Ordering, Payload, Sender, SocketAddr, KIND_SEALED, NONCE_LEN, REPLAY_WINDOW, SEAL_CLEAR,
    SEAL_HEADER, SEAL_OVERHEAD, TAG_LEN, VERSION,
};
use crate::fields::Fields;

/// The two fresh nonces of one handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeNonces {
    /// The client's, sent in its hello.
    pub client: [u8; NONCE_LEN],
    /// The server's, sent in its challenge.
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
        /// The session id the replayed message names.
        session: u64,
        /// The packet number, already accepted or too far behind the newest.
        packet: u64,
    },
    /// The session belongs to another address.
    #[error("session {session:#x} belongs to {owner}, not {from}")]
    WrongPeer {
        /// The session id the message names.
        session: u64,
        /// The address the session was set up from.
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
    /// [`Credential::tag`] of the session's credential, as the sender claims it.
    pub tenant_tag: u32,
    /// The session id the sender names.
    pub session: u64,
    /// The sender's packet number (from 1, never reused), for the receiver's replay window.
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
/// Sessions are set up the same way in every mode, and replay windows run in every mode; the
/// modes differ in whether each datagram is encrypted and tagged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Authentication {
    /// Every datagram sealed with AES-256-GCM (always, in every deployment over a network).
    #[default]
    On,
    /// No tag computed or checked: a loopback measurement's baseline only
    /// (`naam-bench experiment auth-cost`). Drivers refuse it on anything but loopback,
    /// and naam-server and naam-nic offer no way to ask for it.
    OffForMeasurement,
    /// No tag and no encryption, because no datagram leaves the process: every endpoint of
    /// the deployment is bound in one in-memory network (`--fabric inproc-endpoints`), which
    /// nothing outside the process can read or write. Drivers refuse it on a real socket
    /// ([`Authentication::check_fabric`]).
    InProcess,
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

    /// [`Authentication::check_scope`] for a driver bound at or sending to `addr`, which
    /// also refuses [`Authentication::InProcess`] unless the driver's socket is in an
    /// in-memory network (`in_memory`).
    pub fn check_fabric(self, addr: SocketAddr, in_memory: bool) -> Result<(), String> {
        if self == Authentication::InProcess && !in_memory {
            return Err(format!(
                "datagrams go unsealed only inside one process's in-memory network ({addr} \
                 is a real socket)"
            ));
        }
        self.check_scope(addr)
    }

    /// Whether datagrams are encrypted and tagged.
    pub fn seals(self) -> bool {
        self == Authentication::On
    }
}

/// The key of one session, with its id and tenant tag: seals and opens its messages.
///
/// A message is sealed with AES-256-GCM under a key derived from the session's secret (an
/// HMAC of it, so the secret serves no two algorithms): the envelope header and the first
/// [`SEAL_CLEAR`] bytes of the message are authenticated in the clear, the rest is encrypted,
/// and the 16-byte tag ends the datagram. The nonce is the sender and its packet number, which
/// a sender never reuses under one key (a sealer numbers its packets once; the NIC, which may
/// learn a session's key again after it restarts, starts its numbers at random).
pub struct SessionKey {
    pub(super) id: u64,
    pub(super) tenant_tag: u32,
    pub(super) raw: [u8; 32],
    pub(super) mac: HmacSha256,
    pub(super) aead: ring::aead::LessSafeKey,
    pub(super) authentication: Authentication,
}

/// The nonce of packet `packet` from `sender`: unique under a session's key, since each
/// sender numbers its packets without repeating.
fn nonce(sender: Sender, packet: u64) -> ring::aead::Nonce {
    let mut n = [0u8; 12];
    n[0] = sender as u8;
    n[4..].copy_from_slice(&packet.to_le_bytes());
    ring::aead::Nonce::assume_unique_for_key(n)
}

/// Where the encrypted part of a sealed message of `len` bytes (tag excluded) starts.
fn clear_end(len: usize) -> usize {
    len.min(SEAL_HEADER + SEAL_CLEAR)
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionKey(session {:#x})", self.id)
    }
}

impl SessionKey {
    /// The key of session `id` from its 32 raw bytes.
    pub fn new(id: u64, tenant_tag: u32, raw: [u8; 32]) -> SessionKey {
        let mac = hmac_with(&raw);
        let mut m = mac.clone();
        m.update(b"naam datagram sealing v2: aes-256-gcm");
        let sealing = m.finalize().into_bytes();
        let aead = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &sealing)
                .expect("AES-256-GCM takes a 32-byte key"),
        );
        SessionKey {
            id,
            tenant_tag,
            raw,
            mac,
            aead,
            authentication: Authentication::On,
        }
    }

    /// The same key sealing and opening with `authentication` (see [`Authentication`]).
    pub fn with_authentication(mut self, authentication: Authentication) -> SessionKey {
        self.authentication = authentication;
        self
    }

    /// The session id (random and never 0, chosen by the server's gatekeeper).
    pub fn session(&self) -> u64 {
        self.id
    }

    /// [`Credential::tag`] of the session's credential; every envelope it seals carries it.
    pub fn tenant_tag(&self) -> u32 {
        self.tenant_tag
    }

    /// Seals `inner` as packet `packet` from `sender`.
    pub fn seal(&self, sender: Sender, packet: u64, inner: &[u8]) -> Bytes {
        self.seal_with(sender, packet, inner.len(), |b| b.put_slice(inner))
    }

    /// [`SessionKey::seal`] of the inner message `write` appends, about `len` bytes (the
    /// buffer's first capacity): a message encoded straight into its envelope, not encoded
    /// apart and then copied in.
    pub fn seal_with(
        &self,
        sender: Sender,
        packet: u64,
        len: usize,
        write: impl FnOnce(&mut BytesMut),
    ) -> Bytes {
        let mut b = BytesMut::with_capacity(SEAL_OVERHEAD + len);
        self.seal_into(&mut b, sender, packet, write);
        b.freeze()
    }

    /// Appends to `b` the envelope of the inner message `write` appends, sealed as packet
    /// `packet` from `sender` ([`SessionKey::seal_with`] into a buffer the caller owns).
    pub fn seal_into(
        &self,
        b: &mut BytesMut,
        sender: Sender,
        packet: u64,
        write: impl FnOnce(&mut BytesMut),
    ) {
        let start = b.len();
        let mut header = Fields::<SEAL_HEADER>::new();
        header
            .u8(VERSION)
            .u8(KIND_SEALED)
            .u8(sender as u8)
            .u8(0)
            .u32(self.tenant_tag)
            .u64(self.id)
            .u64(packet);
        header.put_into(b);
        write(b);
        if !self.authentication.seals() {
            b.put_slice(&[0; TAG_LEN]);
            return;
        }
        let written = b.len() - start;
        let (clear, secret) = b[start..].split_at_mut(clear_end(written));
        let tag = self
            .aead
            .seal_in_place_separate_tag(
                nonce(sender, packet),
                ring::aead::Aad::from(&*clear),
                secret,
            )
            .expect("AES-GCM seals any message the framing carries");
        b.put_slice(tag.as_ref());
    }

    /// Checks the tag of a sealed message of this session, decrypts it and returns its header
    /// and inner message. Replays are the caller's [`ReplayWindow`]'s to catch. `sealed` is
    /// left as it was: the message is decrypted in a copy.
    pub fn open(&self, sealed: &Bytes) -> Result<(SealedHeader, Bytes), SealError> {
        self.open_owned(sealed.clone())
    }

    /// [`SessionKey::open`] of a message its caller needs no more: decrypted where it lies
    /// when nothing else holds it (a datagram just received), in a copy otherwise.
    pub fn open_owned(&self, sealed: Bytes) -> Result<(SealedHeader, Bytes), SealError> {
        let h = peek_sealed(&sealed)?;
        if h.session != self.id {
            return Err(SealError::UnknownSession {
                session: h.session,
                tenant_tag: h.tenant_tag,
            });
        }
        // The tag names the session's tenant: another tenant's, sealed by whoever holds this
        // session's key, is refused as a tag that does not verify (in every mode, sealed or
        // not).
        if h.tenant_tag != self.tenant_tag {
            return Err(SealError::BadTag(h.session));
        }
        let end = sealed.len() - TAG_LEN;
        if !self.authentication.seals() {
            // The inner message is what is left of `sealed` (no reference counted for a
            // slice).
            let mut inner = sealed;
            inner.truncate(end);
            bytes::Buf::advance(&mut inner, SEAL_HEADER);
            return Ok((h, inner));
        }
        let tag =
            ring::aead::Tag::try_from(&sealed[end..]).map_err(|_| SealError::BadTag(h.session))?;
        let mut buf = match sealed.try_into_mut() {
            Ok(mut unique) => {
                unique.truncate(end);
                unique
            }
            Err(shared) => BytesMut::from(&shared[..end]),
        };
        let clear = clear_end(end);
        let (aad, secret) = buf.split_at_mut(clear);
        self.aead
            .open_in_place_separate_tag(
                nonce(h.sender, h.packet),
                ring::aead::Aad::from(&*aad),
                tag,
                secret,
                0..,
            )
            .map_err(|_| SealError::BadTag(h.session))?;
        Ok((h, buf.freeze().slice(SEAL_HEADER..)))
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

    pub(super) fn wrapping_cipher(&self) -> ChaCha20Poly1305 {
        let mut m = self.mac.clone();
        m.update(b"naam key wrapping v1");
        let k = m.finalize().into_bytes();
        <ChaCha20Poly1305 as chacha20poly1305::KeyInit>::new(&k)
    }
}

pub(super) fn wrap_nonce(id: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&id.to_le_bytes());
    n
}

pub(super) fn wrap_aad(id: u64, tag: u32) -> [u8; 12] {
    let mut a = [0u8; 12];
    a[..8].copy_from_slice(&id.to_le_bytes());
    a[8..].copy_from_slice(&tag.to_le_bytes());
    a
}

/// The sending half of a session: its key and the next packet number. Shared by the threads
/// that answer on the session (host executors send replies themselves).
#[derive(Debug)]
pub struct Sealer {
    pub(super) key: Arc<SessionKey>,
    pub(super) sender: Sender,
    pub(super) next: AtomicU64,
}

impl Sealer {
    /// Seals for `key` as `sender`, numbering packets from 1: for a key this sealer is the
    /// first and only one of `sender` to use (a fresh session's).
    pub fn new(key: Arc<SessionKey>, sender: Sender) -> Sealer {
        Sealer::numbering_from(key, sender, 1)
    }

    /// Seals for `key` as `sender`, numbering packets from `first` (at least 1). A sender
    /// that may seal under the same key again after a restart (the NIC, which the server
    /// tells every session's key when they pair) starts at a random number, so that no
    /// nonce repeats.
    pub fn numbering_from(key: Arc<SessionKey>, sender: Sender, first: u64) -> Sealer {
        Sealer {
            key,
            sender,
            next: AtomicU64::new(first.max(1)),
        }
    }

    /// Seals `inner` as the next packet.
    pub fn seal(&self, inner: &[u8]) -> Bytes {
        match self.next_packet() {
            Some(n) => self
                .key
                .seal_with(self.sender, n, inner.len(), |b| b.put_slice(inner)),
            None => Bytes::new(),
        }
    }

    /// Appends to `b` the envelope of the inner message `write` appends, sealed as the next
    /// packet ([`SessionKey::seal_into`]); appends nothing and returns false once the packet
    /// numbers are spent.
    pub fn seal_into(&self, b: &mut BytesMut, write: impl FnOnce(&mut BytesMut)) -> bool {
        match self.next_packet() {
            Some(n) => {
                self.key.seal_into(b, self.sender, n, write);
                true
            }
            None => false,
        }
    }

    /// The number of the next packet, `None` once they are spent: a packet number is never
    /// reused, so past the last one nothing is sealed (an empty answer, which the peer
    /// drops).
    fn next_packet(&self) -> Option<u64> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        if n == u64::MAX {
            self.next.store(u64::MAX, Ordering::Relaxed);
            return None;
        }
        Some(n)
    }

    /// The key of the session it seals for.
    pub fn key(&self) -> &Arc<SessionKey> {
        &self.key
    }
}

/// The packet numbers of one session a receiver has accepted: the newest, and a bitmap of the
/// [`REPLAY_WINDOW`] before it.
#[derive(Clone, Debug, Default)]
pub struct ReplayWindow {
    pub(super) top: u64,
    pub(super) seen: [u64; (REPLAY_WINDOW / 64) as usize],
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

    pub(super) fn slot(p: u64) -> (usize, u64) {
        let i = p % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    pub(super) fn get(&self, p: u64) -> bool {
        let (w, b) = Self::slot(p);
        self.seen[w] & b != 0
    }

    pub(super) fn set(&mut self, p: u64) {
        let (w, b) = Self::slot(p);
        self.seen[w] |= b;
    }

    pub(super) fn clear(&mut self, p: u64) {
        let (w, b) = Self::slot(p);
        self.seen[w] &= !b;
    }
}
