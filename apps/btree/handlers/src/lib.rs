//! The B-link tree's handlers: lookup and scan descend one node per step at any placement;
//! writes descend at the owner (meta and one node per step), split full nodes on the way (one
//! split per write batch, in a step of its own that fetches the node again with the spares
//! and the parent) and insert or replace in the leaf. The layout is `naam_btree_layout`'s.
//!
//! Searches inside a node are plain loops (the verifier accepts loops; the step's instruction
//! budget bounds them).
#![no_std]

use naam_btree_layout as l;
use naam_btree_layout::{args as a, seg};
use naam_ebpf::abi::{ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_ebpf::{handler, Context, Descriptor, Fault, Return, SegmentRef, StepResult};

const RW: u32 = ACCESS_READ | ACCESS_WRITE;
const RWA: u32 = RW | ACCESS_ATOMIC;
/// Largest node supported: 2 KiB (125 entries; 7 halvings search them).
const MAX_NODE_SIZE: u64 = 2048;

/// A node's fixed fields, read from the front of its segment.
struct Node {
    seg: SegmentRef,
    version: u64,
    header: u64,
    high: u64,
    sibling: u64,
    left: u64,
    count: usize,
}

#[inline(always)]
fn read_node(seg: SegmentRef) -> Result<Node, Fault> {
    let version = seg.read_u64(l::NODE_FRONT)?;
    let header = seg.read_u64(l::NODE_HEADER)?;
    Ok(Node {
        version,
        header,
        high: seg.read_u64(l::NODE_HIGH)?,
        sibling: seg.read_u64(l::NODE_SIBLING)?,
        left: seg.read_u64(l::NODE_LEFT)?,
        count: l::count(header) as usize,
        seg,
    })
}

/// First entry whose key is at least `key` (among `count`).
#[inline(always)]
fn lower_bound(seg: &SegmentRef, count: usize, key: u64) -> Result<usize, Fault> {
    l::lower_bound(count, key, |i| seg.read_u64(l::entry(i)))
}

/// The child of an internal node that covers `key`.
#[inline(always)]
fn child_for(n: &Node, key: u64) -> Result<u64, Fault> {
    // key < NO_KEY, so key + 1 does not overflow: the first entry above key.
    let i = lower_bound(&n.seg, n.count, key + 1)?;
    if i == 0 {
        Ok(n.left)
    } else {
        n.seg.read_u64(l::entry(i - 1) + 8)
    }
}

#[inline(always)]
fn node_desc(rkey: u64, id: u64, size: u64, access: u32) -> Descriptor {
    Descriptor { rkey, offset: id * size, len: size as u32, access }
}

/// A read handler's step toward `key`'s leaf: past a concurrent split to the right sibling,
/// or down to the covering child, after checking the node was not written while copied.
/// `true`: the next node is queued; `false`: `n` is the leaf that holds `key`.
#[inline(always)]
fn read_toward(ctx: &mut Context, n: &Node, key: u64, size: u64, rkey: u64) -> Result<bool, Fault> {
    let next = if key >= n.high {
        n.sibling
    } else if l::level(n.header) > 0 {
        child_for(n, key)?
    } else {
        return Ok(false);
    };
    n.seg.validate(l::node_back(size as usize), n.version)?;
    ctx.push_next(node_desc(rkey, next, size, ACCESS_READ))?;
    Ok(true)
}

/// Reader args: the key (never NO_KEY) and a usable node size.
#[inline(always)]
fn reader_args(ctx: &Context) -> Result<(u64, u64, u64), Fault> {
    let key = ctx.arg_u64(a::KEY)?;
    let size = ctx.arg_u64(a::NODE_SIZE)?;
    if key == l::NO_KEY || !(64..=MAX_NODE_SIZE).contains(&size) || size % 8 != 0 {
        return Err(Fault::app(l::error::BAD_ARGS));
    }
    Ok((key, size, ctx.arg_u64(a::RKEY_NODES)?))
}

handler! {
    /// Lookup: one node per step. Replies `[found][value]`. Moves right past a concurrent split;
    /// a node copied while being written retries; a start node that is no longer the root is
    /// STALE_ROOT.
    fn btree_get(ctx) {
        let (key, size, rkey) = reader_args(ctx)?;
        let n = read_node(ctx.segment(0)?)?;
        if ctx.step == 0 && l::flags(n.header) & l::FLAG_ROOT == 0 {
            return Err(Fault::app(l::error::STALE_ROOT));
        }
        if read_toward(ctx, &n, key, size, rkey)? {
            return Ok(Return::Continue);
        }
        let back = l::node_back(size as usize);
        let p = lower_bound(&n.seg, n.count, key)?;
        let found = p < n.count && n.seg.read_u64(l::entry(p))? == key;
        let value = if found { n.seg.read_u64(l::entry(p) + 8)? } else { 0 };
        n.seg.validate(back, n.version)?;
        ctx.reply_u8(found as u8)?;
        ctx.reply_u64(value)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Scan: descends to the leaf of the start key, then follows leaf links, replying
    /// `[more]` and up to `args.VALUE` `(key, value)` pairs with keys at or above the start key,
    /// in key order. After `SCAN_LEAVES_PER_MESSAGE` leaves it stops with `more = 1`: the client
    /// continues after the last key. State 0: pairs replied; state 1: 1 once on the leaf chain;
    /// state 2: leaves visited.
    fn btree_scan(ctx) {
        let (key, size, rkey) = reader_args(ctx)?;
        let max = ctx.arg_u64(a::VALUE)?.min(((naam_ebpf::abi::REPLY_CAP - 1) / l::ENTRY_SIZE) as u64);
        if ctx.reply_len == 0 {
            ctx.reply_u8(0)?;
        }
        let n = read_node(ctx.segment(0)?)?;
        let on_chain = ctx.state(1)? == 1;
        if ctx.step == 0 && l::flags(n.header) & l::FLAG_ROOT == 0 {
            return Err(Fault::app(l::error::STALE_ROOT));
        }
        if !on_chain && read_toward(ctx, &n, key, size, rkey)? {
            return Ok(Return::Continue);
        }
        let back = l::node_back(size as usize);
        let start = if on_chain { 0 } else { lower_bound(&n.seg, n.count, key)? };
        let done = ctx.state(0)?;
        let take = ((n.count - start.min(n.count)) as u64).min(max - done.min(max));
        if take > 0 {
            ctx.reply_from_segment(&n.seg, l::entry(start), take as usize * l::ENTRY_SIZE)?;
        }
        n.seg.validate(back, n.version)?;
        let leaves = ctx.state(2)? + 1;
        ctx.set_state(0, done + take)?;
        ctx.set_state(1, 1)?;
        ctx.set_state(2, leaves)?;
        if done + take < max && n.sibling != l::NO_NODE {
            if leaves >= l::SCAN_LEAVES_PER_MESSAGE {
                ctx.reply[0] = 1;
                return Ok(Return::Done);
            }
            ctx.push_next(node_desc(rkey, n.sibling, size, ACCESS_READ))?;
            return Ok(Return::Continue);
        }
        Ok(Return::Done)
    }
}

/// Address of `len` bytes at `off` of `seg` (a source for a write).
#[inline(always)]
fn src(seg: &SegmentRef, off: usize, len: usize) -> Result<u64, Fault> {
    seg.checked(off, len, ACCESS_READ)
}

/// Write descent, step 0: read meta, then fetch the root with two spare nodes for splits.
#[inline(always)]
fn write_start(ctx: &mut Context) -> StepResult {
    let meta = ctx.segment(seg::META as usize)?;
    let key = ctx.arg_u64(a::KEY)?;
    let size = meta.read_u64(l::META_NODE_SIZE)?;
    if key == l::NO_KEY || size != ctx.arg_u64(a::NODE_SIZE)? || size > MAX_NODE_SIZE {
        return Err(Fault::app(l::error::BAD_ARGS));
    }
    let next = meta.read_u64(l::META_NEXT_NODE)?;
    if next + 2 > meta.read_u64(l::META_MAX_NODES)? {
        return Err(Fault::app(l::error::FULL));
    }
    let root = meta.read_u64(l::META_ROOT)?;
    ctx.set_state(0, meta.read_u64(l::META_WVERSION)?)?;
    ctx.set_state(1, next)?;
    ctx.set_state(2, l::NO_NODE)?;
    ctx.set_state(3, root)?;
    descend(ctx, root, size)
}

/// Asks for the next write step's segments: meta and `node`. Only a step that finds its node
/// full asks for more ([`ask_split`]): naming the spares and the parent at every level made
/// every step of every write resolve, check and map three segments it almost never uses.
#[inline(always)]
fn descend(ctx: &mut Context, node: u64, size: u64) -> StepResult {
    let rkey = ctx.arg_u64(a::RKEY_NODES)?;
    ctx.push_next(Descriptor { rkey: ctx.arg_u64(a::RKEY_META)?, offset: 0, len: l::META_SIZE as u32, access: RWA })?;
    ctx.push_next(node_desc(rkey, node, size, RW))?;
    Ok(Return::Continue)
}

/// For a step that found `node` full: asks for it again with what a split writes, the spares
/// (only written, never read: no read right), then the parent unless `node` is the root.
#[inline(always)]
fn ask_split(ctx: &mut Context, node: u64, size: u64, next: u64, parent: Option<u64>) -> StepResult {
    let rkey = ctx.arg_u64(a::RKEY_NODES)?;
    ctx.push_next(Descriptor { rkey: ctx.arg_u64(a::RKEY_META)?, offset: 0, len: l::META_SIZE as u32, access: RWA })?;
    ctx.push_next(node_desc(rkey, node, size, RW))?;
    ctx.push_next(node_desc(rkey, next, size, ACCESS_WRITE))?;
    ctx.push_next(node_desc(rkey, next + 1, size, ACCESS_WRITE))?;
    if let Some(p) = parent {
        ctx.push_next(node_desc(rkey, p, size, RW))?;
    }
    Ok(Return::Continue)
}

/// Splits the full node `n`: its upper half moves to a new right sibling (the spare), and the
/// separator goes into the parent, or into a new root (the second spare) when `n` is the root.
#[inline(always)]
fn split(ctx: &mut Context, n: &Node, size: usize, wv: u64, next: u64, node_id: u64) -> StepResult {
    let cap = l::capacity(size);
    let mid = cap / 2;
    let level = l::level(n.header);
    let sep = n.seg.read_u64(l::entry(mid))?;
    // A leaf keeps its separator in the new node; an internal node moves it up.
    let (first, new_left) = if level == 0 { (mid, 0) } else { (mid + 1, n.seg.read_u64(l::entry(mid) + 8)?) };
    let moved = cap - first;
    let is_root = l::flags(n.header) & l::FLAG_ROOT != 0;
    let has_parent = ctx.segment_count as usize > seg::PARENT as usize;
    if !is_root && !has_parent {
        return Err(Fault::app(l::error::RESTART));
    }
    let back = l::node_back(size) as u32;
    let new_version = wv + 1;
    ctx.begin_writes();
    ctx.push_cas(seg::META, l::META_WVERSION as u32, wv, wv + 1)?;
    // The new right sibling.
    let new_head: [u64; 4] = [l::header(level, moved as u64, 0), n.high, n.sibling, new_left];
    ctx.begin_versioned_write(seg::SPARE, back, new_version)?;
    ctx.push_store(seg::SPARE, l::NODE_HEADER as u32, new_head.as_ptr() as u64, 32)?;
    if moved > 0 {
        let from = src(&n.seg, l::entry(first), moved * l::ENTRY_SIZE)?;
        ctx.push_store(seg::SPARE, l::NODE_ENTRIES as u32, from, (moved * l::ENTRY_SIZE) as u32)?;
    }
    ctx.end_versioned_write(seg::SPARE, l::NODE_FRONT as u32, new_version)?;
    // The old node keeps the lower half and links to the new one.
    let old_head: [u64; 3] = [l::header(level, mid as u64, 0), sep, next];
    ctx.begin_versioned_write(seg::NODE, back, n.version + 1)?;
    ctx.push_store(seg::NODE, l::NODE_HEADER as u32, old_head.as_ptr() as u64, 24)?;
    ctx.end_versioned_write(seg::NODE, l::NODE_FRONT as u32, n.version + 1)?;
    let entry: [u64; 2] = [sep, next];
    if is_root {
        let root_id = next + 1;
        let root_head: [u64; 4] = [l::header(level + 1, 1, l::FLAG_ROOT), l::NO_KEY, l::NO_NODE, node_id];
        ctx.begin_versioned_write(seg::SPARE_ROOT, back, new_version)?;
        ctx.push_store(seg::SPARE_ROOT, l::NODE_HEADER as u32, root_head.as_ptr() as u64, 32)?;
        ctx.push_store(seg::SPARE_ROOT, l::entry(0) as u32, entry.as_ptr() as u64, 16)?;
        ctx.end_versioned_write(seg::SPARE_ROOT, l::NODE_FRONT as u32, new_version)?;
        ctx.push_store_u64(seg::META, l::META_ROOT as u32, root_id)?;
        ctx.push_store_u64(seg::META, l::META_NEXT_NODE as u32, next + 2)?;
    } else {
        let p = read_node(ctx.segment(seg::PARENT as usize)?)?;
        p.seg.validate(back as usize, p.version)?;
        if p.count >= cap {
            return Err(Fault::app(l::error::RESTART));
        }
        let q = lower_bound(&p.seg, p.count, sep)?;
        ctx.begin_versioned_write(seg::PARENT, back, p.version + 1)?;
        if q < p.count {
            let from = src(&p.seg, l::entry(q), (p.count - q) * l::ENTRY_SIZE)?;
            ctx.push_store(seg::PARENT, l::entry(q + 1) as u32, from, ((p.count - q) * l::ENTRY_SIZE) as u32)?;
        }
        ctx.push_store(seg::PARENT, l::entry(q) as u32, entry.as_ptr() as u64, 16)?;
        ctx.push_store_u64(
            seg::PARENT,
            l::NODE_HEADER as u32,
            l::header(l::level(p.header), p.count as u64 + 1, l::flags(p.header)),
        )?;
        ctx.end_versioned_write(seg::PARENT, l::NODE_FRONT as u32, p.version + 1)?;
        ctx.push_store_u64(seg::META, l::META_NEXT_NODE as u32, next + 1)?;
    }
    ctx.reply_u8(l::reply::SPLIT)?;
    Ok(Return::Write)
}

/// A write step below the meta: split, insert or replace, or descend.
#[inline(always)]
fn write_step(ctx: &mut Context) -> StepResult {
    let key = ctx.arg_u64(a::KEY)?;
    let update_only = ctx.arg_u64(a::MODE)? == 1;
    let meta = ctx.segment(seg::META as usize)?;
    let size = meta.read_u64(l::META_NODE_SIZE)? as usize;
    let (wv, next, node_id) = (ctx.state(0)?, ctx.state(1)?, ctx.state(3)?);
    let n = read_node(ctx.segment(seg::NODE as usize)?)?;
    n.seg.validate(l::node_back(size), n.version)?;
    if key >= n.high {
        // A split moved the key right after this write read the parent: start again.
        return Err(Fault::app(l::error::RESTART));
    }
    if n.count >= l::capacity(size) {
        // The spares come only with a step that asked for them.
        if ctx.segment_count as usize <= seg::SPARE_ROOT as usize {
            let parent = ctx.state(2)?;
            return ask_split(ctx, node_id, size as u64, next, (parent != l::NO_NODE).then_some(parent));
        }
        return split(ctx, &n, size, wv, next, node_id);
    }
    if l::level(n.header) > 0 {
        let child = child_for(&n, key)?;
        ctx.set_state(2, node_id)?;
        ctx.set_state(3, child)?;
        return descend(ctx, child, size as u64);
    }
    let p = lower_bound(&n.seg, n.count, key)?;
    let exists = p < n.count && n.seg.read_u64(l::entry(p))? == key;
    if !exists && update_only {
        return Err(Fault::app(l::error::NOT_FOUND));
    }
    let back = l::node_back(size) as u32;
    ctx.begin_writes();
    // Staged before anything is queued: words at constant offsets first, the entries an
    // insert moves (their length known only at run time) last, so that the one copy's
    // destination is a constant the engines prove and the queue's entries stay proven after
    // it. The back and front versions share a word.
    let version_at = ctx.stage_u64(n.version + 1)?;
    ctx.push_cas(seg::META, l::META_WVERSION as u32, wv, wv + 1)?;
    if exists {
        let value_at = ctx.stage_u64(ctx.arg_u64(a::VALUE)?)?;
        ctx.push_staged(seg::NODE, back, version_at, 8)?;
        ctx.push_staged(seg::NODE, (l::entry(p) + 8) as u32, value_at, 8)?;
    } else {
        let header_at = ctx.stage_u64(l::header(0, n.count as u64 + 1, l::flags(n.header)))?;
        // The new entry, its key then its value, as the args hold them.
        let key_at = ctx.stage_u64(ctx.arg_u64(a::KEY)?)?;
        ctx.stage_u64(ctx.arg_u64(a::VALUE)?)?;
        let moved = (n.count - p) * l::ENTRY_SIZE;
        let moved_at = if p < n.count { Some(ctx.stage(src(&n.seg, l::entry(p), moved)?, moved as u32)?) } else { None };
        ctx.push_staged(seg::NODE, back, version_at, 8)?;
        if let Some(at) = moved_at {
            ctx.push_staged(seg::NODE, l::entry(p + 1) as u32, at, moved as u32)?;
        }
        ctx.push_staged(seg::NODE, l::entry(p) as u32, key_at, 16)?;
        ctx.push_staged(seg::NODE, l::NODE_HEADER as u32, header_at, 8)?;
    }
    ctx.push_staged(seg::NODE, l::NODE_FRONT as u32, version_at, 8)?;
    ctx.reply_u8(if exists { l::reply::REPLACED } else { l::reply::INSERTED })?;
    Ok(Return::Write)
}

handler! {
    /// Insert or replace (args MODE 0), or update an existing key only (MODE 1), at the owner.
    fn btree_put(ctx) {
        if ctx.step == 0 {
            return write_start(ctx);
        }
        write_step(ctx)
    }
}

handler! {
    /// The current root id, read from meta (clients refresh a stale cached root with it).
    fn btree_root(ctx) {
        let meta = ctx.segment(0)?;
        ctx.reply_u64(meta.read_u64(l::META_ROOT)?)?;
        Ok(Return::Done)
    }
}
