//! A Cell-style B+tree in NAAM regions: a B-link tree (Lehman and Yao) of fixed-size nodes, so
//! readers at any placement descend without locks and survive concurrent splits by moving right.
//! Shared by the eBPF handlers and the host library (one source of truth).
//!
//! Two regions per tree:
//! - **meta** ([`META_SIZE`] bytes): root node id, write version (every write batch starts with a
//!   compare-and-swap on it), next free node id, node size, node capacity;
//! - **nodes**: node `id` at `id * node_size`. A node: `[front version][header][high key]
//!   [right sibling][leftmost child][(key, value) × cap][back version]`. The header packs the
//!   level (0 = leaf), the entry count and flags ([`FLAG_ROOT`]). A node holds keys below its high
//!   key; a key at or above it lives to the right. In a leaf the values are the values; in an
//!   internal node, entry `i` names the child for keys from `key[i]` up to `key[i + 1]` and the
//!   leftmost child holds keys below `key[0]`.
//!
//! Writers store a node's back version first and its front version last; readers check that both
//! ends agree, so a node copied while being written retries.
#![no_std]
#![deny(missing_docs)]

/// Meta: root node id.
pub const META_ROOT: usize = 0;
/// Meta: write version.
pub const META_WVERSION: usize = 8;
/// Meta: next free node id.
pub const META_NEXT_NODE: usize = 16;
/// Meta: node size in bytes.
pub const META_NODE_SIZE: usize = 24;
/// Meta: number of nodes the region holds.
pub const META_MAX_NODES: usize = 32;
/// Meta region size.
pub const META_SIZE: usize = 40;

/// Node: front version.
pub const NODE_FRONT: usize = 0;
/// Node: header word (`level | count << 16 | flags << 32`).
pub const NODE_HEADER: usize = 8;
/// Node: high key (exclusive upper bound; [`NO_KEY`] = unbounded).
pub const NODE_HIGH: usize = 16;
/// Node: right sibling id ([`NO_NODE`] = none).
pub const NODE_SIBLING: usize = 24;
/// Node: leftmost child (internal nodes).
pub const NODE_LEFT: usize = 32;
/// Node: first entry.
pub const NODE_ENTRIES: usize = 40;
/// Bytes per entry: key and value.
pub const ENTRY_SIZE: usize = 16;

/// The root flag.
pub const FLAG_ROOT: u64 = 1;
/// "No node" (a leaf's missing sibling).
pub const NO_NODE: u64 = u64::MAX;
/// "No key": the unbounded high key. Not a valid key.
pub const NO_KEY: u64 = u64::MAX;

/// Entries a node of `node_size` bytes holds.
pub const fn capacity(node_size: usize) -> usize {
    (node_size - NODE_ENTRIES - 8) / ENTRY_SIZE
}

/// `a < b` (unsigned) as 0 or 1, computed without a branch: the borrow out of `a - b`
/// (Hacker's Delight, section 2-13). eBPF has no compare-into-register instruction, so a
/// comparison used as a value would otherwise become a conditional jump.
#[inline(always)]
pub const fn below(a: u64, b: u64) -> u64 {
    ((!a & b) | (!(a ^ b) & a.wrapping_sub(b))) >> 63
}

/// The first of `count` ascending keys that is at least `key` (`count` if none is), where
/// `key_at(i)` reads key `i`: the search the handlers and the native tree share.
///
/// Branch-free: each halving moves the base by a mask rather than a jump, so a search costs no
/// mispredicted branches (a branchy binary search mispredicts about half its comparisons on
/// random keys), and every node of one count takes the same number of halvings.
#[inline(always)]
pub fn lower_bound<E>(
    count: usize,
    key: u64,
    mut key_at: impl FnMut(usize) -> Result<u64, E>,
) -> Result<usize, E> {
    if count == 0 {
        return Ok(0);
    }
    // The answer lies in [base, base + len].
    let (mut base, mut len) = (0usize, count);
    while len > 1 {
        let half = len / 2;
        let step = below(key_at(base + half)?, key).wrapping_neg() as usize;
        base += half & step;
        len -= half;
    }
    Ok(base + below(key_at(base)?, key) as usize)
}

/// Offset of entry `i`.
pub const fn entry(i: usize) -> usize {
    NODE_ENTRIES + ENTRY_SIZE * i
}

/// Offset of the back version.
pub const fn node_back(node_size: usize) -> usize {
    node_size - 8
}

/// Packs a header word.
pub const fn header(level: u64, count: u64, flags: u64) -> u64 {
    (level & 0xffff) | (count & 0xffff) << 16 | flags << 32
}

/// Level of a header word.
pub const fn level(h: u64) -> u64 {
    h & 0xffff
}

/// Entry count of a header word.
pub const fn count(h: u64) -> u64 {
    (h >> 16) & 0xffff
}

/// Flags of a header word.
pub const fn flags(h: u64) -> u64 {
    h >> 32
}

/// Handler args.
pub mod args {
    /// rkey of the nodes region.
    pub const RKEY_NODES: usize = 0;
    /// Node size (u64).
    pub const NODE_SIZE: usize = 8;
    /// The key (lookups, scans: the first key; writes: the key).
    pub const KEY: usize = 16;
    /// Writes: the value, right after the key (so key and value form one entry). Scans: the
    /// most entries to return.
    pub const VALUE: usize = 24;
    /// Writes: rkey of the meta region.
    pub const RKEY_META: usize = 32;
    /// Writes: 0 upsert, 1 update only.
    pub const MODE: usize = 40;
    /// Size of the writes' args.
    pub const WRITE_SIZE: usize = 48;
}

/// Leaves one scan message visits at most (the hop limit bounds a message's steps; a longer scan
/// continues in another message from the last key returned).
pub const SCAN_LEAVES_PER_MESSAGE: u64 = 16;

/// Replies of writes (first byte).
pub mod reply {
    /// A new key was inserted.
    pub const INSERTED: u8 = 0;
    /// An existing key's value was replaced.
    pub const REPLACED: u8 = 1;
    /// A full node on the way was split; send the write again.
    pub const SPLIT: u8 = 2;
}

/// Handler error codes (added to `naam_ebpf::abi::error_code::APP_BASE`).
pub mod error {
    /// The node the client started from is no longer the root: refresh it from meta.
    pub const STALE_ROOT: u32 = 1;
    /// UPDATE of a key that is not in the tree.
    pub const NOT_FOUND: u32 = 2;
    /// No free nodes left.
    pub const FULL: u32 = 3;
    /// The key is [`super::NO_KEY`], or the args do not match the tree.
    pub const BAD_ARGS: u32 = 4;
    /// The tree changed under a write's descent: send it again.
    pub const RESTART: u32 = 5;
    /// Each code with its name (a handler returns `Fault::app(code)`).
    pub const NAMED: [(u32, &str); 5] = [
        (STALE_ROOT, "btree:stale-root"),
        (NOT_FOUND, "btree:not-found"),
        (FULL, "btree:full"),
        (BAD_ARGS, "btree:bad-args"),
        (RESTART, "btree:restart"),
    ];
}

/// Write descent segments: meta and the node; a split's step adds two spare nodes, then the parent.
pub mod seg {
    /// The whole meta region (read, write, atomic): target of every write batch's
    /// compare-and-swap on the write version and of its root and next-node stores.
    pub const META: u32 = 0;
    /// The current node.
    pub const NODE: u32 = 1;
    /// Where a split puts the new right sibling (named only in a split's step: a descent's
    /// steps name meta and the node alone).
    pub const SPARE: u32 = 2;
    /// Where a root split puts the new root (a split's step only).
    pub const SPARE_ROOT: u32 = 3;
    /// The parent (a split's step only; absent at the root).
    pub const PARENT: u32 = 4;
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use proptest::prelude::*;

    use super::{below, lower_bound};

    proptest! {
        #[test]
        fn below_is_unsigned_less_than(a in any::<u64>(), b in any::<u64>(), near in 0u64..3) {
            prop_assert_eq!(below(a, b) == 1, a < b);
            let c = a.wrapping_add(near);
            prop_assert_eq!(below(a, c) == 1, a < c);
            prop_assert_eq!(below(c, a) == 1, c < a);
        }

        /// The branch-free search answers as the standard library's partition point, for any
        /// count (empty included), duplicate keys and keys at either end of the range.
        #[test]
        fn lower_bound_is_the_partition_point(
            mut keys in proptest::collection::vec(prop_oneof![any::<u64>(), 0u64..40, Just(u64::MAX)], 0..130),
            probe in prop_oneof![any::<u64>(), 0u64..41, Just(0), Just(u64::MAX)],
        ) {
            keys.sort_unstable();
            let found: Result<usize, ()> = lower_bound(keys.len(), probe, |i| Ok(keys[i]));
            prop_assert_eq!(found, Ok(keys.partition_point(|&k| k < probe)));
            for (i, &k) in keys.iter().enumerate() {
                let at: Result<usize, ()> = lower_bound(keys.len(), k, |j| Ok(keys[j]));
                prop_assert_eq!(at, Ok(keys.partition_point(|&x| x < k)), "key {} at {}", k, i);
            }
        }

        /// A read that fails stops the search with its error.
        #[test]
        fn a_failed_read_is_the_answer(count in 1usize..64, bad in 0usize..64) {
            let keys: Vec<u64> = (0..count as u64).map(|k| k * 2).collect();
            let found = lower_bound(count, 31, |i| if i == bad { Err(i) } else { Ok(keys[i]) });
            if let Err(i) = found {
                prop_assert_eq!(i, bad);
            }
        }
    }
}
