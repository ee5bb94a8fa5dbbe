//! Small byte strings that outlive the call that made them (a write's answer kept for
//! deduplication, a request's args handed to another thread), copied without an allocation
//! each.

use bytes::{Bytes, BytesMut};

/// Size of one chunk: sixteen of the largest reply a handler can make, so that a chunk is
/// allocated once per sixteen copies at worst (YCSB's answers of a kilobyte fill one per 64).
const CHUNK: usize = 16 * naam_ebpf::abi::REPLY_CAP;

/// Copies byte strings into shared chunks. Each copy is a [`Bytes`] that shares its chunk;
/// the chunk is freed with its last copy, and while this arena still writes into it, it is
/// taken back whole once every copy is dropped. So copies that are dropped before the next
/// ones are made reuse the same memory, and copies that are kept cost their own length plus
/// at most one partly used chunk, not an allocation each.
#[derive(Debug, Default)]
pub struct ByteArena {
    free: BytesMut,
}

impl ByteArena {
    /// A copy of `bytes`, sharing a chunk with the other copies made here.
    pub fn copy(&mut self, bytes: &[u8]) -> Bytes {
        if self.free.capacity() < bytes.len() {
            // Takes the chunk back if nothing holds it any more, else starts a new one.
            self.free.reserve(CHUNK.max(bytes.len()));
        }
        self.free.extend_from_slice(bytes);
        self.free.split().freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_equal_and_independent() {
        let mut a = ByteArena::default();
        let one = a.copy(b"first");
        let two = a.copy(b"second");
        assert_eq!(&one[..], b"first");
        assert_eq!(&two[..], b"second");
        drop(one);
        let three = a.copy(&[9u8; 100]);
        assert_eq!(&two[..], b"second");
        assert_eq!(&three[..], &[9u8; 100][..]);
        assert!(a.copy(&[]).is_empty());
    }

    #[test]
    fn dropped_copies_give_their_chunk_back() {
        let mut a = ByteArena::default();
        let first = a.copy(&[1u8; 64]);
        let base = first.as_ptr();
        drop(first);
        // Fill past one chunk, dropping each copy: the chunk comes back whole.
        for i in 0..(2 * CHUNK / 64) {
            let c = a.copy(&[i as u8; 64]);
            assert!(c.iter().all(|&b| b == i as u8));
        }
        let again = a.copy(&[2u8; 64]);
        let offset = (again.as_ptr() as usize).wrapping_sub(base as usize);
        assert!(offset < CHUNK, "a new chunk was allocated");
    }

    #[test]
    fn kept_copies_stay_intact_across_chunks() {
        let mut a = ByteArena::default();
        let kept: Vec<Bytes> = (0..500u32)
            .map(|i| a.copy(&i.to_le_bytes().repeat(10)))
            .collect();
        for (i, k) in kept.iter().enumerate() {
            assert_eq!(&k[..], &(i as u32).to_le_bytes().repeat(10)[..]);
        }
        let big = a.copy(&vec![5u8; CHUNK + 1]);
        assert_eq!(big.len(), CHUNK + 1);
    }
}
