//! Example NAAM handlers, used by the runtime's tests, benchmarks and the README.
#![no_std]
// seq! unrolls with literal indices, so `0 * 8` and `1 * 8` appear by construction.
#![allow(clippy::erasing_op, clippy::identity_op)]

use naam_ebpf::abi::{ACCESS_READ, MAX_SEGMENTS};
use naam_ebpf::{handler, hash, Descriptor, Fault, Return};
use seq_macro::seq;

/// Largest segment `checksum` and `hash1k` accept: 128 words, fully unrolled.
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
        seq!(I in 0..128 {
            if I * 8 < len {
                a = a.wrapping_add(seg.read_u64(I * 8)?);
                b = b.wrapping_add(a);
            }
        });
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
        seq!(I in 0..128 {
            if I * 8 < len {
                h = hash::mix(h, seg.read_u64(I * 8)?);
            }
        });
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
        // 32 halvings cover any segment (at most 2^32 bytes).
        seq!(_ in 0..32 {
            if lo < hi {
                let mid = lo + (hi - lo) / 2;
                if seg.read_u64(mid * 8)? < key {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
        });
        // The last halving's update of `hi` is never read; say so rather than silence the lint.
        let _ = hi;
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
    /// Stores `arg0` at offset 0 of segment 0 and replies the number of segments seen
    /// (a `Write` step).
    fn store(ctx) {
        let v = ctx.arg_u64(0)?;
        ctx.push_store_u64(0, 0, v)?;
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
