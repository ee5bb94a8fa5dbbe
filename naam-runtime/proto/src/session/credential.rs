//! Credentials: a tenant's (or the NIC's, or the operator's) 256-bit secret, its file text, and
//! the MACs derived from it.

use super::{
    hmac_with, HandshakeNonces, HmacSha256, Mac, Path, PathBuf, SessionKey, COOKIE_LEN,
    CREDENTIAL_LEN, RESET_TOKEN_LEN,
};
use crate::entropy::Entropy;

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
        /// Its permission bits (`mode & 0o777`); any of `0o077` set is refused.
        mode: u32,
    },
    /// The random source failed.
    #[error(transparent)]
    Random(#[from] crate::entropy::EntropyError),
}

/// A tenant's secret (or the NIC's pairing secret, or the operator's). It never leaves the
/// process that holds it, and its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential(pub(super) [u8; CREDENTIAL_LEN]);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credential(tag {:08x})", self.tag())
    }
}

impl Credential {
    /// A new random credential, from `entropy` (the OS's, but in simulations and tests).
    pub fn generate(entropy: &Entropy) -> Result<Credential, CredentialError> {
        Ok(Credential(entropy.array()?))
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

    pub(super) fn mac(&self) -> HmacSha256 {
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

    pub(super) fn proof_mac(
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
