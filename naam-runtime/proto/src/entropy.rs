//! The protocol's randomness, injected: handshake nonces, session ids, cookie keys, the NIC's
//! first packet numbers and new credentials all come from an [`Entropy`] the driver passes in
//! (as quinn-proto takes its `rng_seed`). naam-proto never reads the operating system's random
//! source itself: naam-runtime's drivers pass the OS's (`naam_runtime::entropy::os`), a
//! simulation or a test passes [`Entropy::seeded`], and then every byte an endpoint sends is a
//! function of its inputs, replayable bit for bit.

use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// A source of random bytes.
pub trait EntropySource: Send + Sync {
    /// Fills `out` with random bytes.
    fn fill(&self, out: &mut [u8]) -> Result<(), EntropyError>;
    /// What the source is, for `Debug` ("os", "seeded 42").
    fn describe(&self) -> String;
}

/// The random source failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no randomness: {0}")]
pub struct EntropyError(pub String);

/// A shared handle to a random source; clones draw from the same one.
#[derive(Clone)]
pub struct Entropy(Arc<dyn EntropySource>);

impl std::fmt::Debug for Entropy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Entropy({})", self.0.describe())
    }
}

impl Entropy {
    /// Draws from `source`.
    pub fn new(source: impl EntropySource + 'static) -> Entropy {
        Entropy(Arc::new(source))
    }

    /// A deterministic stream from `seed` (SHA-256 of the seed and a block counter): the same
    /// seed gives the same bytes in the same order. For simulations and tests only: anyone who
    /// knows the seed knows every nonce and session id.
    pub fn seeded(seed: u64) -> Entropy {
        Entropy::new(Seeded {
            seed,
            state: Mutex::new(SeededState {
                block: 0,
                buf: [0; 32],
                used: 32,
            }),
        })
    }

    /// Another deterministic stream, seeded by a draw from this one (one per endpoint of a
    /// simulation, so that one endpoint's draws do not shift with another's).
    pub fn fork(&self) -> Result<Entropy, EntropyError> {
        Ok(Entropy::seeded(self.u64()?))
    }

    /// Fills `out`.
    pub fn fill(&self, out: &mut [u8]) -> Result<(), EntropyError> {
        self.0.fill(out)
    }

    /// A random 64-bit value.
    pub fn u64(&self) -> Result<u64, EntropyError> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// A random 64-bit value, never 0.
    pub fn nonzero_u64(&self) -> Result<u64, EntropyError> {
        loop {
            let v = self.u64()?;
            if v != 0 {
                return Ok(v);
            }
        }
    }

    /// `N` random bytes.
    pub fn array<const N: usize>(&self) -> Result<[u8; N], EntropyError> {
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Ok(b)
    }
}

struct Seeded {
    seed: u64,
    state: Mutex<SeededState>,
}

struct SeededState {
    block: u64,
    buf: [u8; 32],
    /// Bytes of `buf` already handed out.
    used: usize,
}

impl EntropySource for Seeded {
    fn fill(&self, out: &mut [u8]) -> Result<(), EntropyError> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| EntropyError("a seeded stream's lock was poisoned".into()))?;
        for byte in out {
            if s.used == s.buf.len() {
                let mut h = Sha256::new();
                h.update(b"naam seeded entropy v1");
                h.update(self.seed.to_le_bytes());
                h.update(s.block.to_le_bytes());
                s.buf = h.finalize().into();
                s.block += 1;
                s.used = 0;
            }
            *byte = s.buf[s.used];
            s.used += 1;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("seeded {}", self.seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_bytes_however_they_are_drawn() {
        let a = Entropy::seeded(7);
        let mut whole = [0u8; 100];
        a.fill(&mut whole).unwrap();
        let b = Entropy::seeded(7);
        let mut pieces = [0u8; 100];
        let (x, rest) = pieces.split_at_mut(3);
        b.fill(x).unwrap();
        let (y, z) = rest.split_at_mut(40);
        b.fill(y).unwrap();
        b.fill(z).unwrap();
        assert_eq!(whole, pieces);
        assert_ne!(Entropy::seeded(8).array::<32>().unwrap(), whole[..32]);
    }

    #[test]
    fn clones_share_one_stream_and_forks_are_their_own() {
        let a = Entropy::seeded(1);
        let b = a.clone();
        assert_ne!(a.u64().unwrap(), b.u64().unwrap());
        let f1 = Entropy::seeded(1).fork().unwrap();
        let f2 = Entropy::seeded(1).fork().unwrap();
        assert_eq!(f1.u64().unwrap(), f2.u64().unwrap());
        assert_eq!(format!("{:?}", Entropy::seeded(3)), "Entropy(seeded 3)");
    }
}
