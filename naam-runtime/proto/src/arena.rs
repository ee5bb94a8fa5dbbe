//! Byte strings written into shared chunks instead of an allocation each: small ones that
//! outlive the call that made them (a write's answer kept for deduplication, a request's args
//! handed to another thread), and messages on their way out (encodings, envelopes,
//! fragments), which are dropped before long, so that their chunk is taken back and written
//! again.

use bytes::{Bytes, BytesMut};

/// Size of one chunk: sixteen of the largest reply a handler can make, so that a chunk is
/// allocated once per sixteen copies at worst (YCSB's answers of a kilobyte fill one per 64).
const CHUNK: usize = 16 * naam_ebpf::abi::REPLY_CAP;

/// Copies byte strings into shared chunks. Each copy is a [`Bytes`] that shares its chunk;
/// the chunk is freed with its last copy, and while this arena still writes into it, it is
/// taken back whole once every copy is dropped. So copies that are dropped before the next
/// ones are made reuse the same memory, with no allocation each. A copy that is kept keeps its
/// whole chunk: copies kept together cost about their own length, but one kept out of many
/// (a value received and cached for long) holds a chunk of its own, and whoever keeps such
/// strings for long copies them out.
///
/// Slicing or cloning what it made only counts a reference (the chunk is shared already),
/// where a `Bytes` made from a `Vec` allocates its shared header at its first clone.
#[derive(Debug)]
pub struct ByteArena {
    free: BytesMut,
    chunk: usize,
}

impl Default for ByteArena {
    fn default() -> ByteArena {
        ByteArena::with_chunk(CHUNK)
    }
}

impl ByteArena {
    /// An arena that allocates chunks of `chunk` bytes (or of one string, when it is longer).
    pub fn with_chunk(chunk: usize) -> ByteArena {
        ByteArena {
            free: BytesMut::new(),
            chunk,
        }
    }

    /// A copy of `bytes`, sharing a chunk with the other copies made here.
    pub fn copy(&mut self, bytes: &[u8]) -> Bytes {
        self.write(bytes.len(), |b| b.extend_from_slice(bytes))
    }

    /// What `write` appends to an empty buffer with room for at least `len` bytes, sharing a
    /// chunk with the other strings made here (`write` may append more than `len`: the
    /// buffer grows, into an allocation of its own if it must).
    pub fn write(&mut self, len: usize, write: impl FnOnce(&mut BytesMut)) -> Bytes {
        // Whatever a `write` that panicked left behind.
        self.free.clear();
        // Back to the chunk's start when nothing else holds it (the strings made before were
        // dropped): the memory written last is the likeliest still in cache.
        let _ = self.free.try_reclaim(self.free.capacity() + 1);
        if self.free.capacity() < len {
            // Takes the chunk back if nothing holds it any more, else starts a new one.
            self.free.reserve(self.chunk.max(len));
        }
        // The rest of the chunk is split off before the string is written, not after: the
        // split counts a reference with a locked instruction, which waits for every store
        // before it, and after a kilobyte's copy that wait cost more than the copy did.
        let rest = self.free.split_off(len);
        write(&mut self.free);
        std::mem::replace(&mut self.free, rest).freeze()
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

    #[test]
    fn a_string_dropped_before_the_next_write_gives_its_memory_back_at_once() {
        let mut a = ByteArena::default();
        let first = a.write(100, |b| b.extend_from_slice(&[1u8; 100]));
        let at = first.as_ptr();
        drop(first);
        let second = a.write(100, |b| b.extend_from_slice(&[2u8; 100]));
        assert_eq!(second.as_ptr(), at, "written where the dropped one was");
        // Held, it is not written over.
        let third = a.write(100, |b| b.extend_from_slice(&[3u8; 100]));
        assert_ne!(third.as_ptr(), at);
        assert_eq!(&second[..], &[2u8; 100][..]);
    }

    #[test]
    fn a_write_past_its_estimate_is_whole_and_spares_its_neighbours() {
        let mut a = ByteArena::with_chunk(64);
        let before = a.copy(&[1u8; 40]);
        let long = a.write(4, |b| b.extend_from_slice(&[2u8; 100]));
        let after = a.copy(&[3u8; 10]);
        assert_eq!(&before[..], &[1u8; 40][..]);
        assert_eq!(&long[..], &[2u8; 100][..]);
        assert_eq!(&after[..], &[3u8; 10][..]);
    }

    #[test]
    fn clones_and_slices_of_its_strings_share_their_chunk() {
        let mut a = ByteArena::default();
        let s = a.write(8, |b| b.extend_from_slice(b"abcdefgh"));
        let part = s.slice(2..5);
        assert_eq!(&part[..], b"cde");
        assert_eq!(part.as_ptr(), s[2..].as_ptr(), "sliced in place");
        assert_eq!(s.clone().as_ptr(), s.as_ptr());
    }
}
