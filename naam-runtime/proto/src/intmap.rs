//! Hash maps keyed by integers that are already well distributed or not chosen by whoever sends
//! the datagrams (random rkeys and session ids, FNV handler ids, app ids, a client's own request
//! ids and handler keys, the addresses a process itself sends to or binds): one multiply per
//! integer instead of SipHash on every message. A peer may look up any key
//! (a session id in a datagram's header), but never chooses the keys stored, so it cannot
//! crowd a table's buckets. Iteration order follows the keys alone, the same in every run.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A multiplicative hasher for integer keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        // A product's high bits mix every bit of the key, its low bits only the key's low
        // bits; the table picks a bucket by the low bits of the hash (and a tag by its top 7),
        // so the high bits are turned down. Keys alike in their low bits (session ids, whose
        // low byte is a loop's route) then still spread over every bucket.
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the product's high bits mix every input bit.
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(n as u64);
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(n as u64);
    }

    // Also what a fieldless enum's derived `Hash` writes (its discriminant, as `isize`), and a
    // slice's length: one multiply instead of one per byte.
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` with [`IntHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// A `HashSet` with [`IntHasher`].
pub type IntSet<K> = HashSet<K, BuildHasherDefault<IntHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    fn bucket_bits(key: u64, bits: u32) -> u64 {
        BuildHasherDefault::<IntHasher>::default().hash_one(key) & ((1 << bits) - 1)
    }

    /// Keys that differ only above their low byte (one loop's session ids, all with one
    /// route) still reach most buckets of a small table, and sequential ids every bucket.
    #[test]
    fn keys_alike_in_their_low_bits_spread_over_the_buckets() {
        let same_route: std::collections::HashSet<u64> =
            (0..256u64).map(|k| bucket_bits(k << 8 | 0x42, 8)).collect();
        assert!(
            same_route.len() > 140,
            "{} of 256 buckets",
            same_route.len()
        );
        let sequential: std::collections::HashSet<u64> =
            (0..64u64).map(|k| bucket_bits(k, 6)).collect();
        assert!(sequential.len() > 36, "{} of 64 buckets", sequential.len());
    }
}
