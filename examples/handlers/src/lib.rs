//! Example NAAM handlers, used by the runtime's tests, benchmarks and the README. Loops are
//! plain Rust loops: the verifier accepts them and the step's instruction budget bounds them.
#![no_std]

use naam_ebpf::abi::{ACCESS_READ, MAX_SEGMENTS};
use naam_ebpf::{handler, hash, Descriptor, Fault, Return};

/// Largest segment `checksum` and `hash1k` accept: 128 words.
const MAX_WORDS: usize = 128;

handler! {
    /// Replies with `arg0 + arg1`: the smallest useful handler (fixed invocation cost).
    fn add(ctx) {
        let a = ctx.arg_u64(0)?;
        let b = ctx.arg_u64(8)?;
        ctx.reply_u64(a.wrapping_add(b))?;
        Ok(Return::Done)
    }
}

handler! {
    /// Fletcher-style checksum over segment 0, whose length must be a multiple of 8 and at most
    /// 1 KiB: replies `a` then `b` where `a = Σ wᵢ` and `b = Σ a` (wrapping, little-endian words).
    fn checksum(ctx) {
        let seg = ctx.segment(0)?;
        let len = seg.len();
        if len % 8 != 0 || len > MAX_WORDS * 8 {
            return Err(Fault::app(1));
        }
        let (mut a, mut b) = (0u64, 0u64);
        for i in 0..len / 8 {
            a = a.wrapping_add(seg.read_u64(i * 8)?);
            b = b.wrapping_add(a);
        }
        ctx.reply_u64(a)?;
        ctx.reply_u64(b)?;
        Ok(Return::Done)
    }
}

handler! {
    /// `naam_ebpf::hash::hash64(segment 0, seed = arg0)` computed in eBPF, for segments whose
    /// length is a multiple of 8 and at most 1 KiB (the "1 KB hash" benchmark handler).
    fn hash1k(ctx) {
        let seed = ctx.arg_u64(0)?;
        let seg = ctx.segment(0)?;
        let len = seg.len();
        if len % 8 != 0 || len > MAX_WORDS * 8 {
            return Err(Fault::app(1));
        }
        let mut h = hash::start(len as u64, seed);
        for i in 0..len / 8 {
            h = hash::mix(h, seg.read_u64(i * 8)?);
        }
        ctx.reply_u64(hash::finish(h))?;
        Ok(Return::Done)
    }
}

handler! {
    /// Binary search for `arg0` in segment 0, a sorted array of little-endian `u64`.
    /// Replies the lower-bound index and 1 if the key was found, else 0.
    fn bsearch(ctx) {
        let key = ctx.arg_u64(0)?;
        let seg = ctx.segment(0)?;
        let n = seg.len() / 8;
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if seg.read_u64(mid * 8)? < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let found = lo < n && seg.read_u64(lo * 8)? == key;
        ctx.reply_u64(lo as u64)?;
        ctx.reply_u64(found as u64)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Two steps. Step 0 reads a pointer word `p` from segment 0, keeps the word at offset 8 in
    /// state 0 and asks for 8 bytes at offset `p` of region `arg0` (`Continue`). Step 1 replies
    /// `state0 + word`.
    fn two_step(ctx) {
        let seg = ctx.segment(0)?;
        if ctx.step == 0 {
            let p = seg.read_u64(0)?;
            ctx.set_state(0, seg.read_u64(8)?)?;
            let rkey = ctx.arg_u64(0)?;
            ctx.push_next(Descriptor { rkey, offset: p, len: 8, access: ACCESS_READ })?;
            naam_ebpf::trace(p);
            return Ok(Return::Continue);
        }
        let v = ctx.state(0)?.wrapping_add(seg.read_u64(0)?);
        ctx.reply_u64(v)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Panics when `arg0` is 7 (a clean abort), otherwise replies `100 / arg0` (dividing by zero
    /// panics too).
    fn panics(ctx) {
        let x = ctx.arg_u64(0)?;
        if x == 7 {
            panic!("seven is not allowed");
        }
        ctx.reply_u64(100 / x)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Reads past the end of segment 0 through a raw pointer: the interpreter must stop it.
    fn oob_read(ctx) {
        let seg = ctx.segment(0)?;
        let addr = ctx.segments[0].addr + seg.len() as u64 + ctx.arg_u64(0)?;
        // SAFETY: deliberately unsound; this handler exists to prove the interpreter's checks.
        let v = unsafe { core::ptr::read_volatile(addr as *const u64) };
        ctx.reply_u64(v)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Stores `arg0` in both version words of the record in segment 0 (offsets 0 and 24, see
    /// `vget`), so the record stays consistent and readers never see it torn; replies the
    /// number of segments seen (a `Write` step).
    fn store(ctx) {
        let v = ctx.arg_u64(0)?;
        ctx.push_store_u64(0, 0, v)?;
        ctx.push_store_u64(0, REC_BACK as u32, v)?;
        ctx.reply_u64(ctx.segment_count.min(MAX_SEGMENTS as u32) as u64)?;
        Ok(Return::Write)
    }
}

handler! {
    /// Copies the 16 bytes at offset `arg0` of segment 0 onto the stack, then replies them
    /// reversed (byte-range reads and the stack through the copy helper).
    fn reverse16(ctx) {
        let off = ctx.arg_u64(0)? as usize;
        let mut buf = [0u8; 16];
        ctx.segment(0)?.read_bytes(off, &mut buf)?;
        let lo = u64::from_le_bytes([buf[8], buf[9], buf[10], buf[11], buf[12], buf[13], buf[14], buf[15]]);
        let hi = u64::from_le_bytes([buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7]]);
        ctx.reply_u64(lo.swap_bytes())?;
        ctx.reply_u64(hi.swap_bytes())?;
        Ok(Return::Done)
    }
}

handler! {
    /// Adds `arg0` to the word at offset 0 of segment 0 with a fetch-and-add write (not
    /// idempotent: deduplication of retried writes is visible through it).
    fn counter_add(ctx) {
        let v = ctx.arg_u64(0)?;
        ctx.push_faa(0, 0, v)?;
        ctx.reply_u64(v)?;
        Ok(Return::Write)
    }
}

/// Versioned record: `[front version][a][b = !a][back version]`, 32 bytes.
const REC_A: usize = 8;
const REC_B: usize = 16;
const REC_BACK: usize = 24;

handler! {
    /// Optimistic read of a versioned record: replies `a` and `b`; a torn read retries.
    fn vget(ctx) {
        let seg = ctx.segment(0)?;
        let v = seg.read_u64(0)?;
        let a = seg.read_u64(REC_A)?;
        let b = seg.read_u64(REC_B)?;
        seg.validate(REC_BACK, v)?;
        ctx.reply_u64(a)?;
        ctx.reply_u64(b)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Versioned update at the owner: `a = arg0`, `b = !arg0`, both versions bumped.
    fn vput(ctx) {
        let seg = ctx.segment(0)?;
        let v = seg.read_u64(0)?.wrapping_add(1);
        let a = ctx.arg_u64(0)?;
        ctx.begin_versioned_write(0, REC_BACK as u32, v)?;
        ctx.push_store_u64(0, REC_A as u32, a)?;
        ctx.push_store_u64(0, REC_B as u32, !a)?;
        ctx.end_versioned_write(0, 0, v)?;
        Ok(Return::Write)
    }
}

handler! {
    /// Sums the little-endian words of segment 0 with a plain `for` over its run-time length:
    /// loops verify, and the step's instruction budget bounds them.
    fn sum_words(ctx) {
        let seg = ctx.segment(0)?;
        let mut sum = 0u64;
        for i in 0..seg.len() / 8 {
            sum = sum.wrapping_add(seg.read_u64(i * 8)?);
        }
        ctx.reply_u64(sum)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Follows links through segment 0 (the word at offset `p` is the next offset) from
    /// offset 0 until a zero link, and replies the number of hops: a loop whose trip count
    /// depends on the data. A cyclic list never ends; the budget stops it.
    fn walk(ctx) {
        let seg = ctx.segment(0)?;
        let mut at = 0usize;
        let mut hops = 0u64;
        loop {
            let next = seg.read_u64(at)? as usize;
            if next == 0 {
                break;
            }
            at = next;
            hops += 1;
        }
        ctx.reply_u64(hops)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Hostile: stores `arg1` at the absolute address `arg0`. Both engines refuse the store
    /// unless the address lies in memory the step was granted with the write right.
    fn wild_write(ctx) {
        let addr = ctx.arg_u64(0)?;
        let value = ctx.arg_u64(8)?;
        // SAFETY: deliberately unsound; this handler exists to prove the engines' checks.
        unsafe { core::ptr::write_volatile(addr as *mut u64, value) };
        ctx.reply_u64(1)?;
        Ok(Return::Done)
    }
}

handler! {
    /// Hostile: never returns. The instruction budget ends the step.
    fn spin(_ctx) {
        #[allow(clippy::empty_loop)]
        loop {}
    }
}

/// Recursion with a frame that cannot be optimised away: each level keeps four words on its
/// own stack frame and passes them down.
#[inline(never)]
fn nest(n: u64, above: &mut [u64; 4]) -> u64 {
    let mut mine = [n; 4];
    if n == 0 {
        return above[0];
    }
    let below = nest(n - 1, &mut mine);
    // SAFETY: a read of our own local; volatile keeps `mine` on this frame across the call.
    let kept = unsafe { core::ptr::read_volatile(&mine[(n % 4) as usize]) };
    below.wrapping_add(above[(n % 4) as usize]).wrapping_add(kept)
}

handler! {
    /// Recurses `arg0` levels deep (each level uses its own stack frame) and replies a sum over
    /// the frames. Beyond the call-depth limit both engines stop it with a clean fault.
    fn recurse(ctx) {
        let n = ctx.arg_u64(0)?;
        let mut top = [1u64; 4];
        ctx.reply_u64(nest(n, &mut top))?;
        Ok(Return::Done)
    }
}
