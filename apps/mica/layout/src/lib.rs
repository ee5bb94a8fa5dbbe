//! MICA's layout in NAAM regions, shared by the eBPF handlers and the host library (one source of
//! truth, like `naam_ebpf::abi` for the runtime ABI).
//!
//! Three regions per table:
//! - **meta** (`META_SIZE` bytes): the log tail (the number of the next item to write) and the
//!   table geometry;
//! - **index**: `buckets` buckets of [`BUCKET_SIZE`] bytes: a version word (odd while a writer
//!   holds the bucket) and [`SLOTS`] slots of `tag:16 | (item + 1):48` (0 = empty);
//! - **log**: a ring of `log_items` fixed-size items. Item `n` (a virtual, ever-growing number)
//!   lives at `(n % log_items) * item_size`: `[front version][keyhash][key len:u32, value len:u32]
//!   [key][value][back version]`, both versions `n + 1`. Writing item `n` overwrites (evicts) item
//!   `n - log_items`: MICA's lossy log.
//!
//! Handler args (little-endian) for every operation: [`Args`] then the key, then the value.
#![no_std]
#![deny(missing_docs)]

/// Slots per bucket.
pub const SLOTS: usize = 15;
/// Bytes per bucket: version word + slots.
pub const BUCKET_SIZE: usize = 8 + 8 * SLOTS;
/// Offset of slot `i` in a bucket.
pub const fn slot_offset(i: usize) -> usize {
    8 + 8 * i
}

/// Meta region: offset of the tail word.
pub const META_TAIL: usize = 0;
/// Meta region: offset of the bucket count.
pub const META_BUCKETS: usize = 8;
/// Meta region: offset of the log's item count.
pub const META_LOG_ITEMS: usize = 16;
/// Meta region: offset of the item size.
pub const META_ITEM_SIZE: usize = 24;
/// Meta region: offset of the key capacity.
pub const META_KEY_CAP: usize = 32;
/// Meta region: offset of the value capacity.
pub const META_VALUE_CAP: usize = 40;
/// Meta region size.
pub const META_SIZE: usize = 48;

/// Item: front version.
pub const ITEM_FRONT: usize = 0;
/// Item: key hash.
pub const ITEM_KEYHASH: usize = 8;
/// Item: key length (u32).
pub const ITEM_KEY_LEN: usize = 16;
/// Item: value length (u32).
pub const ITEM_VALUE_LEN: usize = 20;
/// Item: first key byte.
pub const ITEM_KEY: usize = 24;
/// Item header size (before the key).
pub const ITEM_HEADER: usize = 24;

/// Rounds up to a multiple of 8.
pub const fn round8(n: usize) -> usize {
    (n + 7) & !7
}

/// Size of an item for the given capacities: header, key, value, back version.
pub const fn item_size(key_cap: usize, value_cap: usize) -> usize {
    ITEM_HEADER + round8(key_cap) + round8(value_cap) + 8
}

/// Offset of the value inside an item.
pub const fn item_value(key_cap: usize) -> usize {
    ITEM_KEY + round8(key_cap)
}

/// Offset of the back version inside an item.
pub const fn item_back(item_size: usize) -> usize {
    item_size - 8
}

/// The 16-bit tag of a key hash (never 0, so a slot with a tag is never empty).
pub const fn tag(keyhash: u64) -> u64 {
    let t = keyhash >> 48;
    if t == 0 {
        1
    } else {
        t
    }
}

/// A slot word for item `n` with `tag`.
pub const fn slot(tag: u64, item: u64) -> u64 {
    (tag << 48) | ((item + 1) & ITEM_MASK)
}

/// Mask of the item part of a slot (item number + 1).
pub const ITEM_MASK: u64 = (1 << 48) - 1;

/// The bucket of a key hash (`buckets` is a power of two).
pub const fn bucket_of(keyhash: u64, buckets: u64) -> u64 {
    (keyhash ^ (keyhash >> 32)) & (buckets - 1)
}

/// Seed of the key hash (`naam_ebpf::hash::hash64`).
pub const HASH_SEED: u64 = 0x4d49_4341; // "MICA"

/// Handler args: a fixed part, then the key, then the value. `KEYHASH..KEY` mirrors the item's
/// `ITEM_KEYHASH..ITEM_KEY`, so a write stores header and key with one copy.
pub mod args {
    /// rkey of the meta region.
    pub const RKEY_META: usize = 0;
    /// rkey of the index region.
    pub const RKEY_INDEX: usize = 8;
    /// rkey of the log region.
    pub const RKEY_LOG: usize = 16;
    /// Offset of the key's bucket in the index.
    pub const BUCKET_OFFSET: usize = 24;
    /// Items in the log (readers use it to place candidates; writers read the meta region).
    pub const LOG_ITEMS: usize = 32;
    /// Item size (u32).
    pub const ITEM_SIZE: usize = 40;
    /// Key capacity (u32).
    pub const KEY_CAP: usize = 44;
    /// The key's hash.
    pub const KEYHASH: usize = 48;
    /// Key length (u32).
    pub const KEY_LEN: usize = 56;
    /// Value length (u32).
    pub const VALUE_LEN: usize = 60;
    /// First key byte; the value follows the key.
    pub const KEY: usize = 64;
}

const _: () = {
    assert!(args::KEY_LEN - args::KEYHASH == ITEM_KEY_LEN - ITEM_KEYHASH);
    assert!(args::VALUE_LEN - args::KEYHASH == ITEM_VALUE_LEN - ITEM_KEYHASH);
    assert!(args::KEY - args::KEYHASH == ITEM_KEY - ITEM_KEYHASH);
};

/// RMW args: the value part of the args is `[field offset: u32][patch]`; the new value is the old
/// one with `patch` written at the offset (YCSB-F updates one field of a record).
pub const RMW_OFFSET_SIZE: usize = 4;

/// Reply of GET: first byte.
pub mod reply {
    /// The key was not found (or was evicted).
    pub const MISS: u8 = 0;
    /// Found: the value follows.
    pub const HIT: u8 = 1;
}

/// Handler error codes (added to `naam_ebpf::abi::error_code::APP_BASE`).
pub mod error {
    /// Key or value longer than the table's capacity, or malformed args.
    pub const TOO_LARGE: u32 = 1;
    /// UPDATE or DELETE of a key that is not in the table.
    pub const NOT_FOUND: u32 = 2;
    /// The bucket is locked by another writer: retry.
    pub const BUSY: u32 = 3;
    /// INCR of a value that is not a decimal 64-bit integer, or a sum that overflows one.
    pub const NOT_INTEGER: u32 = 4;
    /// Each code with its name (a handler returns `Fault::app(code)`).
    pub const NAMED: [(u32, &str); 4] = [
        (TOO_LARGE, "mica:too-large"),
        (NOT_FOUND, "mica:not-found"),
        (BUSY, "mica:busy"),
        (NOT_INTEGER, "mica:not-an-integer"),
    ];
}

/// Most candidate items a GET examines (tag matches in one bucket).
pub const MAX_CANDIDATES: usize = 8;
/// Most candidate items a write examines (its step also holds meta, bucket and log target).
pub const MAX_WRITE_CANDIDATES: usize = 5;
