//! Hash maps keyed by integers that are already well distributed or not chosen by whoever sends
//! the datagrams (random rkeys and session ids, FNV handler ids, app ids, a client's own request
//! ids): one multiply per key instead of SipHash on every message. A peer may look up any key
//! (a session id in a datagram's header), but never chooses the keys stored, so it cannot
//! crowd a table's buckets. Iteration order follows the keys alone, the same in every run.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiplicative hasher for integer keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high bits, which the table uses, mix every input bit.
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` with [`IntHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;
