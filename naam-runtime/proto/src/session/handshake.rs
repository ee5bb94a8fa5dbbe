//! The client's side of the handshake.

use super::{Credential, CredentialError, HandshakeNonces, SessionKey, COOKIE_LEN, NONCE_LEN};
use crate::entropy::Entropy;

/// The client's half of a handshake: its nonce, then the session it was given.
#[derive(Debug)]
pub struct ClientHandshake {
    pub(super) tenant: String,
    pub(super) credential: Credential,
    pub(super) nonce: [u8; NONCE_LEN],
}

impl ClientHandshake {
    /// Starts a handshake as `tenant` with a fresh nonce from `entropy`.
    pub fn new(
        tenant: &str,
        credential: Credential,
        entropy: &Entropy,
    ) -> Result<ClientHandshake, CredentialError> {
        let nonce = entropy.array::<NONCE_LEN>()?;
        Ok(ClientHandshake {
            tenant: tenant.to_string(),
            credential,
            nonce,
        })
    }

    /// The tenant name the hello and the `Auth` carry.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The client nonce, fresh for this handshake (the hello carries it).
    pub fn nonce(&self) -> [u8; NONCE_LEN] {
        self.nonce
    }

    /// The credential the proof and the session key are derived from.
    pub fn credential(&self) -> &Credential {
        &self.credential
    }

    /// The proof for a challenge of `server_nonce` with `cookie`.
    pub fn proof(&self, server_nonce: [u8; NONCE_LEN], cookie: &[u8; COOKIE_LEN]) -> [u8; 32] {
        self.credential
            .proof(&self.tenant, &self.nonces(server_nonce), cookie)
    }

    pub(super) fn nonces(&self, server: [u8; NONCE_LEN]) -> HandshakeNonces {
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
