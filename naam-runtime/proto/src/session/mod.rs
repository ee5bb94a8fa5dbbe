//! Sessions of the UDP fabric, IO-free: tenant credentials, the handshake that proves a peer
//! holds one (and that it owns its address), the sealed envelope every later datagram travels
//! in, replay windows, and the server's table of sessions with their scope. naam-runtime's UDP
//! drivers call into it; time and randomness are always arguments (nonces, session ids and
//! keys come from the [`crate::entropy::Entropy`] the driver passes). Credential files are read and written by
//! the drivers (naam-runtime's `CredentialFile`).
//!
//! Handshake (control messages: `crate::control::Control`):
//! ```text
//! client → server  Hello     { tenant, client nonce }                          unsealed, padded
//! server → client  Challenge { route, server nonce, issued, cookie }           unsealed, small
//! client → server  Auth      { tenant, both nonces, issued, cookie, proof }    unsealed, routed
//! server → client  Welcome   { session, epoch, scoped manifest, ... }          sealed
//! ```
//! The cookie is a MAC of the peer's address and both nonces under a key only the server knows,
//! so an `Auth` that carries a valid one proves the peer receives datagrams at its address:
//! until then nothing sent to it is larger than [`AMPLIFICATION`] times what it sent. The
//! proof is a MAC of the tenant, both nonces and the cookie under the tenant's credential; the
//! session key is derived from the same inputs and the session id, so both nonces are fresh
//! for every session and nothing secret crosses the network.
//!
//! Sealed envelope (kind [`crate::kind::SEALED`], little-endian):
//! ```text
//!  0 u8 version (1)   1 u8 kind (7)   2 u8 sender (0 client, 1 server, 2 NIC)   3 u8 0
//!  4 u32 tenant tag (names the credential without revealing it)
//!  8 u64 session id  16 u64 packet number (per sender, never reused)
//! 24 the inner message (request, reply, control, one-sided operation or completion): its
//!    first 24 bytes in the clear, the rest encrypted
//! end-16 AES-256-GCM tag over everything before it (the header and the clear bytes as
//!    associated data), under a key derived from the session's secret, with the sender and
//!    packet number as the nonce
//! ```
//! A receiver drops datagrams whose tag does not verify, whose packet number it has seen
//! (a [`ReplayWindow`] per session), or that come from another address than the session's.
//! A server that does not know a session (it restarted) answers [`crate::control::Control::Stale`] carrying a
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

mod credential;
mod gatekeeper;
mod handshake;
mod seal;

pub use credential::*;
pub use gatekeeper::*;
pub use handshake::*;
pub use seal::*;

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA-256 keyed with `key`.
fn hmac_with(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length")
}

use crate::kind::SEALED as KIND_SEALED;
use crate::limits::{SEAL_CLEAR, SEAL_OVERHEAD, SEAL_TAG as TAG_LEN};
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
            crate::entropy::Entropy::seeded(9),
        )
    }

    /// Instances of one app under one credential make one entry whose apps are every
    /// instance, ascending (what `may_use` searches by halves); another credential's apps
    /// stay apart.
    #[test]
    fn tenant_entries_group_apps_by_credential() {
        let mut apps: Vec<(u32, String, Credential)> = (0..10_000u32)
            .rev()
            .map(|i| (1000 + i, "mica".to_string(), cred(1)))
            .collect();
        apps.push((2, "btree".into(), cred(2)));
        apps.push((1, "mica".into(), cred(1)));
        let entries = tenant_entries(&apps, None, None);
        assert_eq!(entries.len(), 2);
        let Role::Tenant { apps: mica, .. } = &entries[0].role else {
            panic!("a tenant");
        };
        let want: Vec<u32> = std::iter::once(1).chain(1000..11_000).collect();
        assert_eq!(mica, &want);
        assert!(entries[0].role.may_use(1) && entries[0].role.may_use(10_999));
        assert!(!entries[0].role.may_use(2) && !entries[0].role.may_use(11_000));
        assert!(entries[1].role.may_use(2) && !entries[1].role.may_use(1));
    }

    /// An app created for a tenant goes to its credential's entries and to the sessions it
    /// opened before, under its own name too; no other tenant's entry or session gets it.
    #[test]
    fn a_granted_app_reaches_its_owner_and_its_sessions_and_nobody_else() {
        let mut g = gate();
        let (mica, _) = handshake(&mut g, "mica", cred(1), 1_000);
        let (btree, _) = handshake(&mut g, "btree", cred(2), 1_000);
        assert!(!g.session(mica).unwrap().role.may_use(7));
        assert_eq!(g.grant("mica", 7, "mine"), vec![mica]);
        assert!(g.session(mica).unwrap().role.may_use(7));
        assert!(g.session(mica).unwrap().role.may_use(1), "its apps stay");
        assert!(!g.session(btree).unwrap().role.may_use(7));
        // A hello may name the new app, with the owner's credential only.
        let (as_mine, _) = handshake(&mut g, "mine", cred(1), 2_000);
        let role = g.session(as_mine).unwrap().role.clone();
        assert!(role.may_use(7) && role.may_use(1) && !role.may_use(2));
        // Granted again, or to a tenant that is not here: nothing changes.
        assert!(g.grant("mica", 7, "mine").is_empty());
        assert!(g.grant("nobody", 8, "x").is_empty());
        assert!(!g.session(mica).unwrap().role.may_use(8));
        let mut entries = g.tenants.clone();
        assert!(grant_app(&mut entries, "btree", 9, "mica").contains(&"btree".to_string()));
        // A name taken already gets no second entry (the first keeps its credential).
        assert_eq!(entries.iter().filter(|e| e.name == "mica").count(), 1);
    }

    /// Runs a whole handshake; returns the session id and the client's key.
    fn handshake(g: &mut Gatekeeper, tenant: &str, c: Credential, now: Nanos) -> (u64, SessionKey) {
        // A stream per handshake: two in one test never share a client nonce.
        static NEXT: AtomicU64 = AtomicU64::new(100);
        let entropy = crate::entropy::Entropy::seeded(NEXT.fetch_add(1, Ordering::Relaxed));
        let hs = ClientHandshake::new(tenant, c, &entropy).unwrap();
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

    /// A sealed message nothing else holds is decrypted where it lies; one still held
    /// elsewhere is decrypted in a copy and stays sealed for its other holder.
    #[test]
    fn a_message_held_once_is_opened_in_place_and_a_shared_one_in_a_copy() {
        let key = SessionKey::new(5, 1, [3; 32]);
        let payload = vec![0x5a; 1200];
        // Received as a datagram is: a copy of its bytes, then a slice of the frame's data.
        let framed = Bytes::copy_from_slice(
            &[&[0u8; 22][..], &key.seal(Sender::Server, 7, &payload)].concat(),
        );
        let sealed = framed.slice(22..);
        drop(framed);
        let at = sealed.as_ptr() as usize;
        let (_, inner) = key.open_owned(sealed).unwrap();
        assert_eq!(&inner[..], &payload[..]);
        assert_eq!(
            inner.as_ptr() as usize,
            at + SEAL_HEADER,
            "decrypted in place"
        );

        let sealed = key.seal(Sender::Server, 8, &payload);
        let kept = sealed.clone();
        let (_, inner) = key.open_owned(sealed).unwrap();
        assert_eq!(&inner[..], &payload[..]);
        assert_eq!(
            key.open(&kept).unwrap().1,
            inner,
            "the other holder's copy is still sealed"
        );
    }

    #[test]
    fn a_wrong_credential_or_a_forged_cookie_gets_no_session() {
        let mut g = gate();
        let hs =
            ClientHandshake::new("mica", cred(2), &crate::entropy::Entropy::seeded(1)).unwrap();
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
        let hs =
            ClientHandshake::new("btree", cred(2), &crate::entropy::Entropy::seeded(2)).unwrap();
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
        // The session's own key, with another tenant's tag in the header: refused, though
        // the seal itself verifies.
        let own = g.session(id).unwrap().sealer.key().raw;
        let retagged = SessionKey::new(id, cred(2).tag(), own);
        assert_eq!(
            g.open(1, peer(), &retagged.seal(Sender::Client, 9, b"x"))
                .unwrap_err(),
            SealError::BadTag(id)
        );
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
    fn sealing_encrypts_past_the_clear_prefix_and_binds_every_byte() {
        let k = SessionKey::new(7, 1, [9; 32]);
        let inner: Vec<u8> = (0..200u8).collect();
        let sealed = k.seal(Sender::Server, 3, &inner);
        assert_eq!(sealed.len(), SEAL_OVERHEAD + inner.len());
        // The prefix a switch steers by is in the clear; the rest is not.
        let body = &sealed[SEAL_HEADER..sealed.len() - TAG_LEN];
        assert_eq!(&body[..SEAL_CLEAR], &inner[..SEAL_CLEAR]);
        assert_ne!(&body[SEAL_CLEAR..], &inner[SEAL_CLEAR..]);
        assert_eq!(&k.open(&sealed).unwrap().1[..], &inner[..]);
        // A change anywhere (header, clear prefix, ciphertext, tag) is refused.
        for at in [
            2,
            20,
            SEAL_HEADER + 3,
            SEAL_HEADER + SEAL_CLEAR + 5,
            sealed.len() - 1,
        ] {
            let mut bad = sealed.to_vec();
            bad[at] ^= 0x40;
            assert!(k.open(&Bytes::from(bad)).is_err(), "byte {at} changed");
        }
        // Another sender's or another packet's nonce does not open it.
        let mut other = sealed.to_vec();
        other[16] ^= 1;
        assert!(k.open(&Bytes::from(other)).is_err());
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
        assert_ne!(c.reset_token(42), cred(2).reset_token(42));
        // A tag no tenant has gets an answer of the same form, which proves nothing and
        // confirms nothing: a guessed tag and a random one are answered alike.
        let stranger = cred(3);
        let decoy = g.reset_token(42, stranger.tag()).expect("answered");
        assert_ne!(decoy, stranger.reset_token(42));
        assert_ne!(decoy, c.reset_token(42));
        assert_eq!(
            g.reset_token(42, stranger.tag()),
            Some(decoy),
            "the same each time"
        );
        assert_ne!(g.reset_token(43, stranger.tag()), Some(decoy));
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
    fn in_process_sessions_seal_nothing_and_only_inside_an_in_memory_network() {
        let on = SessionKey::new(7, 1, [9; 32]);
        let inproc = SessionKey::new(7, 1, [9; 32]).with_authentication(Authentication::InProcess);
        let sealed = inproc.seal(Sender::Server, 1, b"reply");
        assert_eq!(&sealed[SEAL_HEADER..sealed.len() - TAG_LEN], b"reply");
        assert_eq!(
            inproc.open(&sealed).unwrap().1,
            Bytes::from_static(b"reply")
        );
        // A sealing key never accepts an unsealed datagram.
        assert!(matches!(on.open(&sealed), Err(SealError::BadTag(7))));
        let loopback: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let network: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        for addr in [loopback, network] {
            assert!(Authentication::InProcess.check_fabric(addr, true).is_ok());
            let e = Authentication::InProcess
                .check_fabric(addr, false)
                .unwrap_err();
            assert!(e.contains("in-memory network"), "{e}");
            assert!(Authentication::On.check_fabric(addr, false).is_ok());
        }
        assert!(Authentication::OffForMeasurement
            .check_fabric(network, true)
            .is_err());
        assert!(Authentication::On.seals() && !Authentication::InProcess.seals());
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
        let c = Credential::generate(&crate::entropy::Entropy::seeded(3)).unwrap();
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
