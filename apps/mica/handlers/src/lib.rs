//! MICA's handlers: GET in two steps (bucket, then candidate items) at any placement; PUT,
//! UPDATE and DELETE at the write owner, as ordered write batches guarded by compare-and-swap.
//! The layout is `naam_mica_layout`'s.
//!
//! Candidate items and free slots are walked with plain loops: the verifier accepts loops and
//! the step's instruction budget bounds them, so little is unrolled by hand (the handlers are a
//! fifth of their unrolled size, which the JIT compiles that much faster). The exception is
//! the tag scan of a bucket's slots ([`tagged_slots`]), which every GET and every write runs.
#![no_std]

use naam_ebpf::abi::{ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_ebpf::{handler, Context, Descriptor, Fault, Return, SegmentRef, StepResult};
use naam_mica_layout as l;
use naam_mica_layout::args as a;

const RW: u32 = ACCESS_READ | ACCESS_WRITE;
const RWA: u32 = RW | ACCESS_ATOMIC;

/// The key of the request, checked against the args.
struct Key {
    hash: u64,
    len: usize,
    value_len: usize,
}

#[inline(always)]
fn key_of(ctx: &Context) -> Result<Key, Fault> {
    let hash = ctx.arg_u64(a::KEYHASH)?;
    let len = ctx.arg_u32(a::KEY_LEN)? as usize;
    let value_len = ctx.arg_u32(a::VALUE_LEN)? as usize;
    if len == 0 {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    // Key and value must lie inside the args.
    ctx.arg_range(a::KEY, len + value_len)?;
    Ok(Key { hash, len, value_len })
}

/// The slots of `bucket` whose word carries `tag`, in slot order: slot indices packed four
/// bits each (the `k`-th found in bits `4k..4k + 4`, read back by [`found_slot`]), and how
/// many. Tags are never 0, so a slot carrying one is not empty.
///
/// Unrolled, the one exception to the plain loops of this file: once the bucket's length is
/// checked, every slot read is at a constant offset, which the engines prove in bounds, and
/// no loop runs per slot (no fuel, no induction variables held across its body). As a loop,
/// this walk was 40% of a compiled GET's instructions (bench/RESULTS.md, twelfth session).
#[inline(always)]
fn tagged_slots(bucket: &SegmentRef, tag: u64) -> Result<(u64, usize), Fault> {
    const _: () = assert!(l::SLOTS == 15, "one scan!() entry per slot");
    bucket.checked(0, l::BUCKET_SIZE, ACCESS_READ)?;
    let mut found = 0u64;
    let mut count = 0usize;
    macro_rules! scan {
        ($($slot:literal)*) => {$(
            if bucket.read_u64(l::slot_offset($slot))? >> 48 == tag {
                found |= ($slot as u64).wrapping_shl(4 * count as u32);
                count += 1;
            }
        )*};
    }
    scan!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14);
    Ok((found, count))
}

/// The slot [`tagged_slots`] found `k`-th.
#[inline(always)]
fn found_slot(found: u64, k: usize) -> usize {
    (found.wrapping_shr(4 * k as u32) & 0xf) as usize
}

/// Whether `seg` starts with a valid copy of item `expected` (its version) holding `key`. Reads
/// the front version, the header and the key; the caller checks the back version last.
#[inline(always)]
fn same_key(ctx: &Context, seg: &SegmentRef, expected: u64, key: &Key) -> Result<bool, Fault> {
    if seg.read_u64(l::ITEM_FRONT)? != expected
        || seg.read_u64(l::ITEM_KEYHASH)? != key.hash
        || seg.read_u32(l::ITEM_KEY_LEN)? as usize != key.len
    {
        return Ok(false);
    }
    let mine = ctx.arg_range(a::KEY, key.len)?;
    let theirs = seg.checked(l::ITEM_KEY, key.len, ACCESS_READ)?;
    Ok(naam_ebpf::compare(theirs, mine, key.len as u64)? == core::cmp::Ordering::Equal)
}

/// GET, step 1: if candidate `k` (segment `k`, its expected version in state word `k`) holds
/// the key, replies `[HIT][value]` and returns true.
#[inline(always)]
fn reply_if_holds(ctx: &mut Context, k: usize, key: &Key, key_cap: usize, back: usize) -> Result<bool, Fault> {
    let seg = ctx.segment(k)?;
    let expected = ctx.state(k)?;
    if !same_key(ctx, &seg, expected, key)? {
        return Ok(false);
    }
    let len = seg.read_u32(l::ITEM_VALUE_LEN)? as usize;
    ctx.reply_u8(l::reply::HIT)?;
    ctx.reply_from_segment(&seg, l::item_value(key_cap), len)?;
    // Versions at both ends: a writer overwriting this item stored the back one first, so a
    // copy that overlapped it ends with a different back version.
    seg.validate(back, expected)?;
    Ok(true)
}

handler! {
    /// GET. Step 0 reads the key's bucket and asks for every item whose tag matches; step 1
    /// finds the item holding the key and replies `[HIT][value]`, or `[MISS]`. A bucket held by
    /// a writer or a torn item retries the step.
    fn mica_get(ctx) {
        let key = key_of(ctx)?;
        if ctx.step == 0 {
            let bucket = ctx.segment(0)?;
            let version = bucket.read_u64(0)?;
            if version & 1 == 1 {
                return Err(Fault::TORN_READ);
            }
            let tag = l::tag(key.hash);
            let log_items = ctx.arg_u64(a::LOG_ITEMS)?;
            let item_size = ctx.arg_u32(a::ITEM_SIZE)? as u64;
            let rkey_log = ctx.arg_u64(a::RKEY_LOG)?;
            if log_items == 0 {
                return Err(Fault::app(l::error::TOO_LARGE));
            }
            let (found, count) = tagged_slots(&bucket, tag)?;
            let count = count.min(l::MAX_CANDIDATES);
            // Asks for the item of the `k`-th tagged slot, the `n`-th asked for; returns how
            // many are asked for then.
            let ask = |ctx: &mut Context, k: usize, n: usize| -> Result<usize, Fault> {
                let w = bucket.read_u64(l::slot_offset(found_slot(found, k)))?;
                // Read again: a writer may have changed it since (the version check below
                // then fails the step).
                if w >> 48 != tag {
                    return Ok(n);
                }
                let item = (w & l::ITEM_MASK) - 1;
                ctx.push_next(Descriptor {
                    rkey: rkey_log,
                    offset: (item % log_items) * item_size,
                    len: item_size as u32,
                    access: ACCESS_READ,
                })?;
                ctx.set_state(n, item + 1)?;
                Ok(n + 1)
            };
            // The first apart, as in step 1: its queue entry and state word are then at
            // constant places. Written out at each of the four places that do it: one generic
            // helper taking the body as a closure let LLVM fold the first call back into the
            // loop (callgrind: a GET's 2,330 instructions became 2,647).
            let mut n = if count > 0 { ask(ctx, 0, 0)? } else { 0 };
            for k in 1..count {
                n = ask(ctx, k, n)?;
            }
            bucket.validate(0, version)?;
            if n == 0 {
                ctx.reply_u8(l::reply::MISS)?;
                return Ok(Return::Done);
            }
            return Ok(Return::Continue);
        }
        let key_cap = ctx.arg_u32(a::KEY_CAP)? as usize;
        let back = l::item_back(ctx.arg_u32(a::ITEM_SIZE)? as usize);
        let count = (ctx.segment_count as usize).min(l::MAX_CANDIDATES);
        // The first candidate apart (a GET nearly always has exactly one): at a constant
        // segment index its reads are at known places, which the engines prove in bounds.
        if count > 0 && reply_if_holds(ctx, 0, &key, key_cap, back)? {
            return Ok(Return::Done);
        }
        for k in 1..count {
            if reply_if_holds(ctx, k, &key, key_cap, back)? {
                return Ok(Return::Done);
            }
        }
        ctx.reply_u8(l::reply::MISS)?;
        Ok(Return::Done)
    }
}

/// The table geometry, read from the meta region (writers trust the server, not the args).
struct Geometry {
    tail: u64,
    log_items: u64,
    item_size: u64,
    key_cap: usize,
}

#[inline(always)]
fn geometry(ctx: &Context, meta: &SegmentRef, key: &Key, extra: usize) -> Result<Geometry, Fault> {
    let g = Geometry {
        tail: meta.read_u64(l::META_TAIL)?,
        log_items: meta.read_u64(l::META_LOG_ITEMS)?,
        item_size: meta.read_u64(l::META_ITEM_SIZE)?,
        key_cap: meta.read_u64(l::META_KEY_CAP)? as usize,
    };
    let value_cap = meta.read_u64(l::META_VALUE_CAP)? as usize;
    let buckets = meta.read_u64(l::META_BUCKETS)?;
    if key.len > g.key_cap || key.value_len > value_cap + extra || g.log_items == 0 || buckets == 0 {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    // The bucket the client named must be the key's: a wrong one would hide the key.
    let bucket_offset = ctx.arg_u64(a::BUCKET_OFFSET)?;
    if bucket_offset != l::bucket_of(key.hash, buckets) * l::BUCKET_SIZE as u64 {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    Ok(g)
}

/// Step 0 of a write: read meta and bucket, ask for them again (writable), for the log slot the
/// tail names, and for the live items whose tag matches (state: tail, bucket version, candidates
/// as `slot << 56 | version`).
#[inline(always)]
fn write_step0(ctx: &mut Context, key: &Key, with_target: bool, extra: usize) -> StepResult {
    let meta = ctx.segment(0)?;
    let bucket = ctx.segment(1)?;
    let g = geometry(ctx, &meta, key, extra)?;
    let version = bucket.read_u64(0)?;
    if version & 1 == 1 {
        return Err(Fault::TORN_READ);
    }
    // Before any write to the context: the engines prove the scan's reads only while they
    // still know where the bucket is, and a write they cannot place makes them forget.
    let tag = l::tag(key.hash);
    let (found, count) = tagged_slots(&bucket, tag)?;
    let rkey_log = ctx.arg_u64(a::RKEY_LOG)?;
    ctx.push_next(Descriptor { rkey: ctx.arg_u64(a::RKEY_META)?, offset: 0, len: l::META_SIZE as u32, access: RWA })?;
    ctx.push_next(Descriptor {
        rkey: ctx.arg_u64(a::RKEY_INDEX)?,
        offset: ctx.arg_u64(a::BUCKET_OFFSET)?,
        len: l::BUCKET_SIZE as u32,
        access: RWA,
    })?;
    if with_target {
        ctx.push_next(Descriptor {
            rkey: rkey_log,
            offset: (g.tail % g.log_items) * g.item_size,
            len: g.item_size as u32,
            access: RW,
        })?;
    }
    ctx.set_state(0, g.tail)?;
    ctx.set_state(1, version)?;
    // Asks for the live item of the `k`-th tagged slot, the `n`-th asked for; returns how many
    // are asked for then.
    let ask = |ctx: &mut Context, k: usize, n: usize| -> Result<usize, Fault> {
        let i = found_slot(found, k);
        let w = bucket.read_u64(l::slot_offset(i))?;
        // Read again: a writer that changed it since fails step 1's version swap.
        if w >> 48 != tag || n >= l::MAX_WRITE_CANDIDATES {
            return Ok(n);
        }
        let item = (w & l::ITEM_MASK) - 1;
        // Items the log has already overwritten cannot hold the key.
        if item + g.log_items <= g.tail {
            return Ok(n);
        }
        ctx.push_next(Descriptor {
            rkey: rkey_log,
            offset: (item % g.log_items) * g.item_size,
            len: g.item_size as u32,
            access: ACCESS_READ,
        })?;
        ctx.set_state(2 + n, ((i as u64) << 56) | (item + 1))?;
        Ok(n + 1)
    };
    // The first apart, as in step 1: its queue entry and state word are at constant places.
    let mut n = if count > 0 { ask(ctx, 0, 0)? } else { 0 };
    for k in 1..count {
        n = ask(ctx, k, n)?;
    }
    Ok(Return::Continue)
}

/// Step 1 of a write: the candidate (segments from `first`) that holds the key, as its
/// segment index and its bucket slot.
#[inline(always)]
fn find_slot(ctx: &Context, key: &Key, first: usize, item_size: u64) -> Result<Option<(usize, usize)>, Fault> {
    let back = l::item_back(item_size as usize);
    // Bounded by the candidates fetched (a run-time count, so the loop stays a loop), the
    // first apart: at a constant segment index its reads are proven in bounds, and a write
    // of an existing key nearly always has exactly one candidate.
    let fetched = (ctx.segment_count as usize).saturating_sub(first).min(l::MAX_WRITE_CANDIDATES);
    let holds = |ctx: &Context, k: usize| -> Result<Option<(usize, usize)>, Fault> {
        let seg = ctx.segment(first + k)?;
        let s = ctx.state(2 + k)?;
        let expected = s & ((1 << 56) - 1);
        let found = same_key(ctx, &seg, expected, key)? && seg.read_u64(back)? == expected;
        Ok(found.then_some((first + k, (s >> 56) as usize)))
    };
    if fetched > 0 {
        if let Some(found) = holds(ctx, 0)? {
            return Ok(Some(found));
        }
    }
    for k in 1..fetched {
        if let Some(found) = holds(ctx, k)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// The bucket slot a new key takes: a free one (empty, or naming an item the log overwrote),
/// else the oldest item's.
#[inline(always)]
fn slot_for_new(bucket: &SegmentRef, tail: u64, log_items: u64) -> Result<usize, Fault> {
    let mut free = 99usize;
    let mut oldest = 0usize;
    let mut oldest_item = u64::MAX;
    for i in 0..l::SLOTS {
        let w = bucket.read_u64(l::slot_offset(i))?;
        let item = (w & l::ITEM_MASK).wrapping_sub(1);
        if free == 99 && (w == 0 || item + log_items <= tail) {
            free = i;
        }
        if w != 0 && item < oldest_item {
            oldest_item = item;
            oldest = i;
        }
    }
    Ok(if free != 99 { free } else { oldest })
}

/// The value at `seg[at..at + len]` as a decimal 64-bit integer (an optional `-`, then 1 to
/// 19 digits, as Redis's counters are), else [`l::error::NOT_INTEGER`].
#[inline(always)]
fn parse_counter(seg: &SegmentRef, at: usize, len: usize) -> Result<i64, Fault> {
    let bad = Fault::app(l::error::NOT_INTEGER);
    if len == 0 || len > 20 {
        return Err(bad);
    }
    let negative = seg.read_u8(at)? == b'-';
    let first = usize::from(negative);
    if first == len {
        return Err(bad);
    }
    // Accumulated negative, so that i64::MIN parses.
    let mut v: i64 = 0;
    for i in first..len {
        let d = seg.read_u8(at + i)?;
        if !d.is_ascii_digit() {
            return Err(bad);
        }
        // Overflow checked by hand: `checked_mul` is a 128-bit multiply, which eBPF lacks.
        let d = i64::from(d - b'0');
        if v < i64::MIN / 10 {
            return Err(bad);
        }
        let tens = v.wrapping_mul(10);
        if tens < i64::MIN + d {
            return Err(bad);
        }
        v = tens - d;
    }
    if negative {
        Ok(v)
    } else {
        v.checked_neg().ok_or(bad)
    }
}

/// `v` in decimal into the little-endian bytes of `w0`, `w1`, `w2` (at most 20 characters);
/// returns how many characters. Built in registers, and out through references: a returned
/// array is a large return, which eBPF lacks.
#[inline(always)]
fn counter_words(v: i64, w0: &mut u64, w1: &mut u64, w2: &mut u64) -> usize {
    let negative = v < 0;
    let mut m = v.unsigned_abs();
    let mut digits = 1usize;
    let mut probe = m;
    while probe >= 10 {
        probe /= 10;
        digits += 1;
    }
    let n = digits + usize::from(negative);
    let mut put = |i: usize, c: u8| {
        let bits = u64::from(c) << (8 * (i % 8));
        match i / 8 {
            0 => *w0 |= bits,
            1 => *w1 |= bits,
            _ => *w2 |= bits,
        }
    };
    if negative {
        put(0, b'-');
    }
    let mut i = n;
    while i > usize::from(negative) {
        i -= 1;
        put(i, b'0' + (m % 10) as u8);
        m /= 10;
    }
    n
}

/// INCR, step 1: the key's value as a decimal integer (0 if the key is absent) plus the
/// signed delta in the args' value, written back as a new item at the tail in one write batch
/// at the owner; replies the new value (little-endian i64). A value that is not an integer, or
/// a sum that overflows, is [`l::error::NOT_INTEGER`] and changes nothing.
#[inline(always)]
fn incr_item(ctx: &mut Context, key: &Key) -> StepResult {
    let meta = ctx.segment(0)?;
    let bucket = ctx.segment(1)?;
    let g = geometry(ctx, &meta, key, 0)?;
    let value_cap = meta.read_u64(l::META_VALUE_CAP)? as usize;
    if key.value_len != 8 {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    let delta = ctx.arg_u64(a::KEY + key.len)? as i64;
    let tail = ctx.state(0)?;
    let version = ctx.state(1)?;
    let (old, slot) = match find_slot(ctx, key, 3, g.item_size)? {
        Some((seg, slot)) => {
            let item = ctx.segment(seg)?;
            let len = item.read_u32(l::ITEM_VALUE_LEN)? as usize;
            (parse_counter(&item, l::item_value(g.key_cap), len)?, slot)
        }
        None => (0, slot_for_new(&bucket, tail, g.log_items)?),
    };
    let new = old.checked_add(delta).ok_or(Fault::app(l::error::NOT_INTEGER))?;
    let (mut w0, mut w1, mut w2) = (0u64, 0u64, 0u64);
    let n = counter_words(new, &mut w0, &mut w1, &mut w2);
    if n > value_cap {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    ctx.begin_writes();
    let version_at = ctx.stage_u64(tail + 1)?;
    let slot_at = ctx.stage_u64(l::slot(l::tag(key.hash), tail))?;
    let unlocked_at = ctx.stage_u64(version + 2)?;
    let hash_at = ctx.stage_u64(key.hash)?;
    let lens_at = ctx.stage_u64(key.len as u64 | ((n as u64) << 32))?;
    let digits_at = ctx.stage_u64(w0)?;
    ctx.stage_u64(w1)?;
    ctx.stage_u64(w2)?;
    let key_at = ctx.stage(ctx.arg_range(a::KEY, key.len)?, key.len as u32)?;
    ctx.push_cas(0, l::META_TAIL as u32, tail, tail + 1)?;
    ctx.push_cas(1, 0, version, version + 1)?;
    ctx.push_staged(2, l::item_back(g.item_size as usize) as u32, version_at, 8)?;
    ctx.push_staged(2, l::ITEM_KEYHASH as u32, hash_at, 8)?;
    ctx.push_staged(2, l::ITEM_KEY_LEN as u32, lens_at, 8)?;
    ctx.push_staged(2, l::ITEM_KEY as u32, key_at, key.len as u32)?;
    ctx.push_staged(2, l::item_value(g.key_cap) as u32, digits_at, n as u32)?;
    ctx.push_staged(2, l::ITEM_FRONT as u32, version_at, 8)?;
    ctx.push_staged(1, l::slot_offset(slot) as u32, slot_at, 8)?;
    ctx.push_staged(1, 0, unlocked_at, 8)?;
    ctx.reply_u64(new as u64)?;
    Ok(Return::Write)
}

/// PUT or UPDATE, step 1: append the item at the tail and publish it in the bucket.
#[inline(always)]
fn write_item(ctx: &mut Context, key: &Key, update_only: bool) -> StepResult {
    let meta = ctx.segment(0)?;
    let bucket = ctx.segment(1)?;
    let g = geometry(ctx, &meta, key, 0)?;
    let tail = ctx.state(0)?;
    let version = ctx.state(1)?;
    let found = find_slot(ctx, key, 3, g.item_size)?.map(|(_, slot)| slot);
    if update_only && found.is_none() {
        return Err(Fault::app(l::error::NOT_FOUND));
    }
    let slot = match found {
        Some(s) => s,
        None => slot_for_new(&bucket, tail, g.log_items)?,
    };
    let item_version = tail + 1;
    // Claim the log slot, then lock the bucket: a lost race on either is a Conflict reply and
    // the client retries; a claimed slot never written is a harmless hole in the log.
    ctx.begin_writes();
    // Staged before anything is queued: the words first, the item's bytes (their length known
    // only at run time) last, so that every staged offset and the copy's destination are
    // constants, which the engines prove; the copy then leaves them the handler's spilled
    // pointers, and the queue's entries stay proven too. One copy stages header, key and
    // value (the args hold them in the item's order); the back and front versions share a
    // word.
    let version_at = ctx.stage_u64(item_version)?;
    let slot_at = ctx.stage_u64(l::slot(l::tag(key.hash), tail))?;
    let unlocked_at = ctx.stage_u64(version + 2)?;
    let head = 16 + key.len;
    let item_len = head + key.value_len;
    let item_at = ctx.stage(ctx.arg_range(a::KEYHASH, item_len)?, item_len as u32)?;
    ctx.push_cas(0, l::META_TAIL as u32, tail, tail + 1)?;
    ctx.push_cas(1, 0, version, version + 1)?;
    // A versioned update: the back version first, the front one last.
    ctx.push_staged(2, l::item_back(g.item_size as usize) as u32, version_at, 8)?;
    ctx.push_staged(2, l::ITEM_KEYHASH as u32, item_at, head as u32)?;
    ctx.push_staged(2, l::item_value(g.key_cap) as u32, item_at + head as u32, key.value_len as u32)?;
    ctx.push_staged(2, l::ITEM_FRONT as u32, version_at, 8)?;
    ctx.push_staged(1, l::slot_offset(slot) as u32, slot_at, 8)?;
    ctx.push_staged(1, 0, unlocked_at, 8)?;
    ctx.reply_u8(found.is_some() as u8)?;
    Ok(Return::Write)
}

/// Step 1 of RMW: the key's current item, patched, becomes a new item at the tail; the reply is
/// the old value. Args value part: `[offset: u32][patch]`.
#[inline(always)]
fn rmw_item(ctx: &mut Context, key: &Key) -> StepResult {
    let meta = ctx.segment(0)?;
    let g = geometry(ctx, &meta, key, l::RMW_OFFSET_SIZE)?;
    let tail = ctx.state(0)?;
    let version = ctx.state(1)?;
    let back = l::item_back(g.item_size as usize);
    // Which candidate holds the key (segments from 3), and its slot.
    let found = find_slot(ctx, key, 3, g.item_size)?;
    let Some((old_seg, slot)) = found else {
        return Err(Fault::app(l::error::NOT_FOUND));
    };
    let old = ctx.segment(old_seg)?;
    let old_len = old.read_u32(l::ITEM_VALUE_LEN)? as usize;
    let value_off = l::item_value(g.key_cap);
    // The patch: offset, then bytes, inside the old value.
    let patch_at = a::KEY + key.len;
    if key.value_len < l::RMW_OFFSET_SIZE {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    let field = ctx.arg_u32(patch_at)? as usize;
    let patch_len = key.value_len - l::RMW_OFFSET_SIZE;
    if field + patch_len > old_len {
        return Err(Fault::app(l::error::TOO_LARGE));
    }
    let item_version = tail + 1;
    ctx.begin_writes();
    ctx.push_cas(0, l::META_TAIL as u32, tail, tail + 1)?;
    ctx.push_cas(1, 0, version, version + 1)?;
    ctx.begin_versioned_write(2, back as u32, item_version)?;
    // Header and key: the old item's, with its value length.
    ctx.push_store(2, l::ITEM_KEYHASH as u32, old.checked(l::ITEM_KEYHASH, 16 + key.len, naam_ebpf::abi::ACCESS_READ)?, (16 + key.len) as u32)?;
    // Value: old bytes around the patch.
    if old_len > 0 {
        ctx.push_store(2, value_off as u32, old.checked(value_off, old_len, naam_ebpf::abi::ACCESS_READ)?, old_len as u32)?;
    }
    if patch_len > 0 {
        ctx.push_store(
            2,
            (value_off + field) as u32,
            ctx.arg_range(patch_at + l::RMW_OFFSET_SIZE, patch_len)?,
            patch_len as u32,
        )?;
    }
    ctx.end_versioned_write(2, l::ITEM_FRONT as u32, item_version)?;
    ctx.push_store_u64(1, l::slot_offset(slot) as u32, l::slot(l::tag(key.hash), tail))?;
    ctx.push_store_u64(1, 0, version + 2)?;
    ctx.reply_from_segment(&old, value_off, old_len)?;
    Ok(Return::Write)
}

handler! {
    /// RMW (YCSB-F): writes the key's value with a field patched, in one write batch at the
    /// owner, and replies the old value; NOT_FOUND if the key is absent.
    fn mica_rmw(ctx) {
        let key = key_of(ctx)?;
        if ctx.step == 0 {
            return write_step0(ctx, &key, true, l::RMW_OFFSET_SIZE);
        }
        rmw_item(ctx, &key)
    }
}

handler! {
    /// PUT (insert or replace). Replies 1 if the key existed, 0 if it is new.
    fn mica_put(ctx) {
        let key = key_of(ctx)?;
        if ctx.step == 0 {
            return write_step0(ctx, &key, true, 0);
        }
        write_item(ctx, &key, false)
    }
}

handler! {
    /// UPDATE (replace an existing key only; NOT_FOUND otherwise).
    fn mica_update(ctx) {
        let key = key_of(ctx)?;
        if ctx.step == 0 {
            return write_step0(ctx, &key, true, 0);
        }
        write_item(ctx, &key, true)
    }
}

handler! {
    /// DELETE. Replies 1 and clears the key's slot if it exists, 0 otherwise.
    fn mica_delete(ctx) {
        let key = key_of(ctx)?;
        if ctx.step == 0 {
            return write_step0(ctx, &key, false, 0);
        }
        let meta = ctx.segment(0)?;
        let g = geometry(ctx, &meta, &key, 0)?;
        let version = ctx.state(1)?;
        match find_slot(ctx, &key, 2, g.item_size)? {
            Some((_, slot)) => {
                ctx.begin_writes();
                ctx.push_cas(1, 0, version, version + 1)?;
                ctx.push_store_u64(1, l::slot_offset(slot) as u32, 0)?;
                ctx.push_store_u64(1, 0, version + 2)?;
                ctx.reply_u8(1)?;
                Ok(Return::Write)
            }
            None => {
                ctx.reply_u8(0)?;
                Ok(Return::Done)
            }
        }
    }
}

handler! {
    /// INCR (Redis's INCR/INCRBY/DECR/DECRBY): adds the args' value (a little-endian i64) to
    /// the key's decimal value, 0 if absent, in one write batch at the owner; replies the new
    /// value. Atomic as every write is: a writer that changed the bucket since step 0 fails
    /// the batch's compare-and-swap and the client retries.
    fn mica_incr(ctx) {
        let key = key_of(ctx)?;
        if ctx.step == 0 {
            return write_step0(ctx, &key, true, 0);
        }
        incr_item(ctx, &key)
    }
}
