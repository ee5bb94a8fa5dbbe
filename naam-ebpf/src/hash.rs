//! The 64-bit hash shared by handlers (inline or through the `hash64` helper), the runtime and
//! native reference implementations, so that every placement computes identical key hashes.
//!
//! It is a word-at-a-time multiply-xorshift hash with a SplitMix64 finaliser: a few ALU
//! instructions per 8 bytes, no tables, and no loops that cannot be unrolled, so it compiles to
//! compact eBPF.

/// Multiplier (the 64-bit golden ratio).
pub const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// Absorbs one 64-bit word into the running state.
#[inline(always)]
pub const fn mix(h: u64, word: u64) -> u64 {
    let x = (h ^ word).wrapping_mul(K);
    x ^ (x >> 29)
}

/// The initial state for `len` bytes under `seed`.
#[inline(always)]
pub const fn start(len: u64, seed: u64) -> u64 {
    seed ^ len.wrapping_mul(K)
}

/// First multiplier of the finaliser.
pub const FINISH_M1: u64 = 0xbf58_476d_1ce4_e5b9;
/// Second multiplier of the finaliser.
pub const FINISH_M2: u64 = 0x94d0_49bb_1331_11eb;

/// Final avalanche (SplitMix64's finaliser).
#[inline(always)]
pub const fn finish(h: u64) -> u64 {
    let mut z = h;
    z = (z ^ (z >> 30)).wrapping_mul(FINISH_M1);
    z = (z ^ (z >> 27)).wrapping_mul(FINISH_M2);
    z ^ (z >> 31)
}

/// Hashes `bytes` under `seed`: little-endian words, then the zero-padded tail tagged with its
/// length.
pub fn hash64(bytes: &[u8], seed: u64) -> u64 {
    let mut h = start(bytes.len() as u64, seed);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = mix(h, u64::from_le_bytes(w));
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = mix(h, u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
    }
    finish(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differs_by_length_seed_and_content() {
        assert_ne!(hash64(b"", 0), hash64(b"\0", 0));
        assert_ne!(hash64(b"abc", 0), hash64(b"abc", 1));
        assert_ne!(hash64(b"abcdefgh", 0), hash64(b"abcdefgi", 0));
        assert_eq!(hash64(b"user1234", 7), hash64(b"user1234", 7));
    }
}
