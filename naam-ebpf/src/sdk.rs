//! Safe accessors over the [`Context`], helper wrappers and the [`handler!`] macro.
//!
//! Every accessor checks bounds and access rights before it touches memory and returns a
//! [`Fault`] instead of panicking, so handler code compiles to straight-line eBPF with forward
//! branches only.

use crate::abi::{
    error_code, helper, write_kind, Context, Descriptor, Return, Segment, WriteOp, ACCESS_ATOMIC,
    ACCESS_READ, ACCESS_WRITE, ARGS_CAP, MAX_NEXT, MAX_SEGMENTS, MAX_WRITES, REPLY_CAP,
    STATE_WORDS, WRITE_DATA_CAP,
};

/// A handler failure, returned to the caller as [`Return::Error`] with this code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault(pub u32);

impl Fault {
    /// A segment access fell outside the segment.
    pub const OUT_OF_BOUNDS: Fault = Fault(error_code::OUT_OF_BOUNDS);
    /// The segment was not fetched.
    pub const NO_SEGMENT: Fault = Fault(error_code::NO_SEGMENT);
    /// An argument read fell outside the inline args.
    pub const BAD_ARGS: Fault = Fault(error_code::BAD_ARGS);
    /// The reply buffer is full.
    pub const REPLY_FULL: Fault = Fault(error_code::REPLY_FULL);
    /// Too many next-step descriptors.
    pub const NEXT_FULL: Fault = Fault(error_code::NEXT_FULL);
    /// Too many write operations, or no room for their bytes.
    pub const WRITES_FULL: Fault = Fault(error_code::WRITES_FULL);
    /// The segment lacks the right the operation needs.
    pub const ACCESS: Fault = Fault(error_code::ACCESS);
    /// A memory helper refused its arguments.
    pub const HELPER_FAULT: Fault = Fault(error_code::HELPER_FAULT);
    /// A state word index was out of range.
    pub const BAD_STATE: Fault = Fault(error_code::BAD_STATE);
    /// An optimistic read saw a concurrent write.
    pub const TORN_READ: Fault = Fault(error_code::TORN_READ);

    /// An application-defined fault: code `APP_BASE + n`.
    #[inline(always)]
    pub const fn app(n: u32) -> Fault {
        Fault(error_code::APP_BASE.wrapping_add(n))
    }

    /// The error code carried in [`Return::Error`].
    #[inline(always)]
    pub const fn code(self) -> u32 {
        self.0
    }
}

/// Result of handler code.
pub type StepResult = Result<Return, Fault>;

// Helpers are calls to constant addresses: LLVM's BPF backend lowers a call through a constant
// pointer to `call <id>`. They must never run natively, so every wrapper is only reachable from
// handler code.
macro_rules! helper_fn {
    ($id:expr, fn($($arg:ty),*) -> $ret:ty) => {{
        // SAFETY: only ever executed as eBPF, where the address is a helper id.
        let f: extern "C" fn($($arg),*) -> $ret = unsafe { core::mem::transmute($id as usize) };
        f
    }};
}

/// Stops the invocation with an abort error carrying `code`. Never returns.
#[inline(always)]
pub fn abort(code: u64) -> ! {
    helper_fn!(helper::ABORT, fn(u64) -> !)(code)
}

/// Records `value` in the invocation's trace (shown by `naam run`).
#[inline(always)]
pub fn trace(value: u64) {
    helper_fn!(helper::TRACE, fn(u64) -> u64)(value);
}

/// The `memcpy` helper's raw result: 0, or [`helper::ERR_FAULT`].
#[inline(always)]
pub fn raw_copy(dst: u64, src: u64, len: u64) -> u64 {
    helper_fn!(helper::MEMCPY, fn(u64, u64, u64) -> u64)(dst, src, len)
}

/// The `memset` helper's raw result: 0, or [`helper::ERR_FAULT`].
#[inline(always)]
pub fn raw_fill(dst: u64, byte: u8, len: u64) -> u64 {
    helper_fn!(helper::MEMSET, fn(u64, u64, u64) -> u64)(dst, byte as u64, len)
}

/// The `memcmp` helper's raw result: a `CMP_*` value, or [`helper::ERR_FAULT`].
#[inline(always)]
pub fn raw_compare(a: u64, b: u64, len: u64) -> u64 {
    helper_fn!(helper::MEMCMP, fn(u64, u64, u64) -> u64)(a, b, len)
}

/// Copies `len` bytes from `src` to `dst` through the bounded `memcpy` helper, which checks that
/// both ranges are memory the handler may use (and the destination writable).
#[inline(always)]
pub fn copy(dst: u64, src: u64, len: u64) -> Result<(), Fault> {
    match raw_copy(dst, src, len) {
        0 => Ok(()),
        _ => Err(Fault::HELPER_FAULT),
    }
}

/// Compares `len` bytes at `a` and `b`: `Ordering` as the helper's `CMP_*` values.
#[inline(always)]
pub fn compare(a: u64, b: u64, len: u64) -> Result<core::cmp::Ordering, Fault> {
    match raw_compare(a, b, len) {
        helper::CMP_EQUAL => Ok(core::cmp::Ordering::Equal),
        helper::CMP_LESS => Ok(core::cmp::Ordering::Less),
        helper::CMP_GREATER => Ok(core::cmp::Ordering::Greater),
        _ => Err(Fault::HELPER_FAULT),
    }
}

/// Fills `len` bytes at `dst` with `byte` through the bounded `memset` helper.
#[inline(always)]
pub fn fill(dst: u64, byte: u8, len: u64) -> Result<(), Fault> {
    match raw_fill(dst, byte, len) {
        0 => Ok(()),
        _ => Err(Fault::HELPER_FAULT),
    }
}

/// [`crate::hash::hash64`] over `len` bytes at `ptr`, computed by the runtime.
#[inline(always)]
pub fn hash_bytes(ptr: u64, len: u64, seed: u64) -> u64 {
    helper_fn!(helper::HASH64, fn(u64, u64, u64) -> u64)(ptr, len, seed)
}

/// An integer at any alignment (volatile accesses need a type whose alignment the address has).
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct Unaligned<T: Copy>(T);

/// A fetched segment: a bounds- and rights-checked view of `len` bytes.
#[derive(Clone, Copy, Debug)]
pub struct SegmentRef {
    addr: u64,
    len: u32,
    access: u32,
}

macro_rules! segment_int_access {
    ($($read:ident, $write:ident, $t:ty;)*) => {$(
        /// Reads a little-endian integer at byte offset `off`.
        #[inline(always)]
        pub fn $read(&self, off: usize) -> Result<$t, Fault> {
            let addr = self.checked(off, core::mem::size_of::<$t>(), ACCESS_READ)?;
            // SAFETY: `checked` proved [addr, addr + size) lies inside the readable segment.
            // Volatile: reads of shared region memory must happen, once each, in program order
            // (versions before and after the data they guard). Packed: any alignment.
            let v = unsafe { core::ptr::read_volatile(addr as *const Unaligned<$t>) }.0;
            Ok(<$t>::from_le(v))
        }

        /// Writes a little-endian integer at byte offset `off` (needs the write right).
        #[inline(always)]
        pub fn $write(&self, off: usize, value: $t) -> Result<(), Fault> {
            let addr = self.checked(off, core::mem::size_of::<$t>(), ACCESS_WRITE)?;
            // SAFETY: `checked` proved [addr, addr + size) lies inside the writable segment.
            unsafe { core::ptr::write_volatile(addr as *mut Unaligned<$t>, Unaligned(value.to_le())) }
            Ok(())
        }
    )*};
}

impl SegmentRef {
    /// Length in bytes.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when the segment holds no bytes.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `ACCESS_*` bits granted for this segment.
    #[inline(always)]
    pub fn access(&self) -> u32 {
        self.access
    }

    /// Address of byte `off`, after checking `[off, off + size)` and the `need` right.
    #[inline(always)]
    pub fn checked(&self, off: usize, size: usize, need: u32) -> Result<u64, Fault> {
        if self.access & need != need {
            return Err(Fault::ACCESS);
        }
        match off.checked_add(size) {
            Some(end) if end <= self.len as usize => Ok(self.addr + off as u64),
            _ => Err(Fault::OUT_OF_BOUNDS),
        }
    }

    segment_int_access! {
        read_u8, write_u8, u8;
        read_u16, write_u16, u16;
        read_u32, write_u32, u32;
        read_u64, write_u64, u64;
    }

    /// Ends an optimistic read of a versioned object: `front_version` (read before the data)
    /// must equal the version word at `back_off` (read after it). A writer stores the back
    /// version first and the front version last ([`Context::begin_versioned_write`],
    /// [`Context::end_versioned_write`]), so any overlap with a write shows as a mismatch. A
    /// mismatch is [`Fault::TORN_READ`], which [`handler!`] turns into `Return::Retry`: the step
    /// runs again over freshly fetched segments.
    #[inline(always)]
    pub fn validate(&self, back_off: usize, front_version: u64) -> Result<(), Fault> {
        if self.read_u64(back_off)? == front_version {
            Ok(())
        } else {
            Err(Fault::TORN_READ)
        }
    }

    /// Copies `dst.len()` bytes at `off` into `dst` (one bounded copy).
    #[inline(always)]
    pub fn read_bytes(&self, off: usize, dst: &mut [u8]) -> Result<(), Fault> {
        let src = self.checked(off, dst.len(), ACCESS_READ)?;
        copy(dst.as_mut_ptr() as u64, src, dst.len() as u64)
    }

    /// Copies `src` to byte offset `off` (needs the write right; one bounded copy).
    #[inline(always)]
    pub fn write_bytes(&self, off: usize, src: &[u8]) -> Result<(), Fault> {
        let dst = self.checked(off, src.len(), ACCESS_WRITE)?;
        copy(dst, src.as_ptr() as u64, src.len() as u64)
    }

    /// Hashes `len` bytes at `off` with [`crate::hash::hash64`].
    #[inline(always)]
    pub fn hash(&self, off: usize, len: usize, seed: u64) -> Result<u64, Fault> {
        let addr = self.checked(off, len, ACCESS_READ)?;
        Ok(hash_bytes(addr, len as u64, seed))
    }

    /// Compares `len` bytes at `off` with `len` bytes at `other_off` of `other`.
    #[inline(always)]
    pub fn compare(
        &self,
        off: usize,
        other: &SegmentRef,
        other_off: usize,
        len: usize,
    ) -> Result<core::cmp::Ordering, Fault> {
        let a = self.checked(off, len, ACCESS_READ)?;
        let b = other.checked(other_off, len, ACCESS_READ)?;
        compare(a, b, len as u64)
    }
}

impl Context {
    /// The inline argument bytes.
    #[inline(always)]
    pub fn args(&self) -> &[u8] {
        let n = (self.args_len as usize).min(ARGS_CAP);
        self.args.get(..n).unwrap_or(&[])
    }

    /// Address of args byte `off` after checking `[off, off + size)` against `args_len`.
    #[inline(always)]
    fn arg_addr(&self, off: usize, size: usize) -> Result<*const u8, Fault> {
        let n = (self.args_len as usize).min(ARGS_CAP);
        match off.checked_add(size) {
            Some(end) if end <= n => Ok(self.args.as_ptr().wrapping_add(off)),
            _ => Err(Fault::BAD_ARGS),
        }
    }

    /// Reads a little-endian `u64` from the inline args at byte offset `off`.
    #[inline(always)]
    pub fn arg_u64(&self, off: usize) -> Result<u64, Fault> {
        let p = self.arg_addr(off, 8)?;
        // SAFETY: `arg_addr` proved the 8 bytes lie inside `args`.
        Ok(u64::from_le(unsafe {
            core::ptr::read_unaligned(p as *const u64)
        }))
    }

    /// Reads a little-endian `u32` from the inline args at byte offset `off`.
    #[inline(always)]
    pub fn arg_u32(&self, off: usize) -> Result<u32, Fault> {
        let p = self.arg_addr(off, 4)?;
        // SAFETY: `arg_addr` proved the 4 bytes lie inside `args`.
        Ok(u32::from_le(unsafe {
            core::ptr::read_unaligned(p as *const u32)
        }))
    }

    /// Address of `len` argument bytes at `off`, for the memory helpers.
    #[inline(always)]
    pub fn arg_range(&self, off: usize, len: usize) -> Result<u64, Fault> {
        Ok(self.arg_addr(off, len)? as u64)
    }

    /// Segment `i` of this step.
    #[inline(always)]
    pub fn segment(&self, i: usize) -> Result<SegmentRef, Fault> {
        if i >= (self.segment_count as usize).min(MAX_SEGMENTS) {
            return Err(Fault::NO_SEGMENT);
        }
        match self.segments.get(i) {
            Some(Segment { addr, len, access }) => Ok(SegmentRef {
                addr: *addr,
                len: *len,
                access: *access,
            }),
            None => Err(Fault::NO_SEGMENT),
        }
    }

    /// State word `i`.
    #[inline(always)]
    pub fn state(&self, i: usize) -> Result<u64, Fault> {
        self.state.get(i).copied().ok_or(Fault::BAD_STATE)
    }

    /// Sets state word `i` (carried to the next step).
    #[inline(always)]
    pub fn set_state(&mut self, i: usize, value: u64) -> Result<(), Fault> {
        match self.state.get_mut(i) {
            Some(w) => {
                *w = value;
                Ok(())
            }
            None => Err(Fault::BAD_STATE),
        }
    }

    /// Checks room for `size` more reply bytes and returns the offset to write at.
    #[inline(always)]
    fn reply_room(&self, size: usize) -> Result<usize, Fault> {
        let at = self.reply_len as usize;
        match at.checked_add(size) {
            Some(end) if end <= REPLY_CAP => Ok(at),
            _ => Err(Fault::REPLY_FULL),
        }
    }

    /// Appends a little-endian `u64` to the reply.
    #[inline(always)]
    pub fn reply_u64(&mut self, value: u64) -> Result<(), Fault> {
        let at = self.reply_room(8)?;
        // SAFETY: `reply_room` proved [at, at + 8) lies inside `reply`.
        unsafe {
            core::ptr::write_unaligned(self.reply.as_mut_ptr().add(at) as *mut u64, value.to_le())
        };
        self.reply_len += 8;
        Ok(())
    }

    /// Appends one byte to the reply.
    #[inline(always)]
    pub fn reply_u8(&mut self, value: u8) -> Result<(), Fault> {
        let at = self.reply_room(1)?;
        // SAFETY: `reply_room` proved `at` lies inside `reply`.
        unsafe { *self.reply.as_mut_ptr().add(at) = value };
        self.reply_len += 1;
        Ok(())
    }

    /// Appends `len` bytes at `off` of `seg` to the reply (one bounded copy).
    #[inline(always)]
    pub fn reply_from_segment(
        &mut self,
        seg: &SegmentRef,
        off: usize,
        len: usize,
    ) -> Result<(), Fault> {
        let src = seg.checked(off, len, ACCESS_READ)?;
        let at = self.reply_room(len)?;
        copy(self.reply.as_mut_ptr() as u64 + at as u64, src, len as u64)?;
        self.reply_len += len as u32;
        Ok(())
    }

    /// Asks for `desc` to be fetched for the next step.
    #[inline(always)]
    pub fn push_next(&mut self, desc: Descriptor) -> Result<(), Fault> {
        let n = self.next_count as usize;
        match self.next.get_mut(n) {
            Some(slot) if n < MAX_NEXT => {
                *slot = desc;
                self.next_count += 1;
                Ok(())
            }
            _ => Err(Fault::NEXT_FULL),
        }
    }

    // Stored as five aligned words. Assigned whole, the op's zero fields (reserved, and
    // operand and expected for a store) became one 20-byte `memset` at offset 20, which the
    // BPF back end cannot expand inline at that alignment: a helper call per queued write
    // (six in a MICA PUT, 25 in a B-tree insert). Volatile, so LLVM does not merge the zero
    // words back into that call.
    #[inline(always)]
    fn push_write(&mut self, op: WriteOp) -> Result<(), Fault> {
        let n = self.write_count as usize;
        match self.writes.get_mut(n) {
            Some(slot) if n < MAX_WRITES => {
                let words = [
                    pair(op.kind, op.segment),
                    pair(op.offset, op.len),
                    pair(op.data_offset, op.reserved),
                    op.operand,
                    op.expected,
                ];
                let at = slot as *mut WriteOp as *mut u64;
                for (i, w) in words.into_iter().enumerate() {
                    // SAFETY: `WriteOp` is `repr(C)`, 40 bytes and 8-aligned (asserted below
                    // with its fields' offsets): word `i` of the slot lies inside it, aligned.
                    unsafe { core::ptr::write_volatile(at.add(i), w) };
                }
                self.write_count += 1;
                Ok(())
            }
            _ => Err(Fault::WRITES_FULL),
        }
    }

    /// Starts the step's write batch: anything queued before is dropped. Called once before
    /// the first write, after any helper call (a key comparison), it tells the compiler the
    /// queue is empty, which it cannot know after a call: the batch's entries are then
    /// stored at constant offsets, which the engines prove in bounds.
    #[inline(always)]
    pub fn begin_writes(&mut self) {
        self.write_count = 0;
        self.write_data_len = 0;
    }

    /// Copies `len` bytes from `src` (memory the handler may read) into the step's write data
    /// and returns where they start there, for [`Context::push_staged`] to name (whole or in
    /// parts). Staging is apart from queueing so that a handler can stage its fixed-size
    /// values first and a copy of run-time length last: every staged offset is then a
    /// constant, and so is the copy's destination, which the engines prove.
    #[inline(always)]
    pub fn stage(&mut self, src: u64, len: u32) -> Result<u32, Fault> {
        let at = self.write_data_len as usize;
        match at.checked_add(len as usize) {
            Some(end) if end <= WRITE_DATA_CAP => {}
            _ => return Err(Fault::WRITES_FULL),
        }
        let queued = self.write_count;
        copy(
            self.write_data.as_mut_ptr() as u64 + at as u64,
            src,
            len as u64,
        )?;
        // The helper wrote inside `write_data` only, but the compiler must assume a call
        // changed every field: stored again, the counts stay known to it (constants, when
        // they were), and the queue's next entries stay at constant offsets.
        self.write_count = queued;
        self.write_data_len = at as u32 + len;
        Ok(at as u32)
    }

    /// Stages a little-endian `u64` in the step's write data (as [`Context::stage`]) and
    /// returns where.
    #[inline(always)]
    pub fn stage_u64(&mut self, value: u64) -> Result<u32, Fault> {
        let at = self.write_data_len as usize;
        match at.checked_add(8) {
            Some(end) if end <= WRITE_DATA_CAP => {}
            _ => return Err(Fault::WRITES_FULL),
        }
        // SAFETY: checked above that [at, at + 8) lies inside `write_data`.
        unsafe {
            core::ptr::write_unaligned(
                self.write_data.as_mut_ptr().add(at) as *mut u64,
                value.to_le(),
            )
        };
        self.write_data_len = at as u32 + 8;
        Ok(at as u32)
    }

    /// Queues a store of the `len` staged bytes at `data_offset` (from [`Context::stage`] or
    /// [`Context::stage_u64`]) to `segment[offset..]`; applied in order when the step returns
    /// [`Return::Write`]. A range outside what was staged gets the whole batch refused.
    #[inline(always)]
    pub fn push_staged(
        &mut self,
        segment: u32,
        offset: u32,
        data_offset: u32,
        len: u32,
    ) -> Result<(), Fault> {
        self.push_write(WriteOp {
            kind: write_kind::STORE,
            segment,
            offset,
            len,
            data_offset,
            reserved: 0,
            operand: 0,
            expected: 0,
        })
    }

    /// Queues a store of `len` bytes read from `src` (memory the handler may read) to
    /// `segment[offset..]`; applied in order when the step returns [`Return::Write`].
    #[inline(always)]
    pub fn push_store(
        &mut self,
        segment: u32,
        offset: u32,
        src: u64,
        len: u32,
    ) -> Result<(), Fault> {
        let at = self.stage(src, len)?;
        self.push_staged(segment, offset, at, len)
    }

    /// Queues a store of a little-endian `u64` to `segment[offset..]`.
    #[inline(always)]
    pub fn push_store_u64(&mut self, segment: u32, offset: u32, value: u64) -> Result<(), Fault> {
        let at = self.stage_u64(value)?;
        self.push_staged(segment, offset, at, 8)
    }

    /// First write of a versioned update: the back version word of the object becomes
    /// `version` (see [`SegmentRef::validate`]).
    #[inline(always)]
    pub fn begin_versioned_write(
        &mut self,
        segment: u32,
        back_offset: u32,
        version: u64,
    ) -> Result<(), Fault> {
        self.push_store_u64(segment, back_offset, version)
    }

    /// Last write of a versioned update: the front version word becomes `version`.
    #[inline(always)]
    pub fn end_versioned_write(
        &mut self,
        segment: u32,
        front_offset: u32,
        version: u64,
    ) -> Result<(), Fault> {
        self.push_store_u64(segment, front_offset, version)
    }

    /// Queues a 64-bit compare-and-swap at `segment[offset]`.
    #[inline(always)]
    pub fn push_cas(
        &mut self,
        segment: u32,
        offset: u32,
        expected: u64,
        new: u64,
    ) -> Result<(), Fault> {
        self.push_write(WriteOp {
            kind: write_kind::CAS,
            segment,
            offset,
            len: 8,
            data_offset: 0,
            reserved: 0,
            operand: new,
            expected,
        })
    }

    /// Queues a 64-bit fetch-and-add at `segment[offset]`.
    #[inline(always)]
    pub fn push_faa(&mut self, segment: u32, offset: u32, add: u64) -> Result<(), Fault> {
        self.push_write(WriteOp {
            kind: write_kind::FAA,
            segment,
            offset,
            len: 8,
            data_offset: 0,
            reserved: 0,
            operand: add,
            expected: 0,
        })
    }
}

// `push_write` stores a `WriteOp` as these five aligned words.
const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<WriteOp>() == 40 && align_of::<WriteOp>() == 8);
    assert!(offset_of!(WriteOp, kind) == 0 && offset_of!(WriteOp, segment) == 4);
    assert!(offset_of!(WriteOp, offset) == 8 && offset_of!(WriteOp, len) == 12);
    assert!(offset_of!(WriteOp, data_offset) == 16 && offset_of!(WriteOp, reserved) == 20);
    assert!(offset_of!(WriteOp, operand) == 24 && offset_of!(WriteOp, expected) == 32);
};

/// The word two 32-bit fields `low` (first in memory) and `high` make in a `repr(C)` struct.
#[inline(always)]
const fn pair(low: u32, high: u32) -> u64 {
    if cfg!(target_endian = "little") {
        low as u64 | (high as u64) << 32
    } else {
        (low as u64) << 32 | high as u64
    }
}

/// True when `access` grants every right in `need`.
#[inline(always)]
pub const fn grants(access: u32, need: u32) -> bool {
    access & need == need
}

/// Rights a descriptor needs for atomic operations.
pub const ATOMIC_RIGHTS: u32 = ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC;

/// Number of state words (re-exported for handler code).
pub const STATE_LEN: usize = STATE_WORDS;

/// Declares a handler: an `extern "C"` entry in ELF section `naam/<name>` that receives the
/// [`Context`] and returns an encoded [`Return`]. The body evaluates to `Result<Return, Fault>`;
/// an `Err(fault)` becomes `Return::Error(fault.code())`, except [`Fault::TORN_READ`], which
/// becomes `Return::Retry`.
///
/// ```ignore
/// naam_ebpf::handler! {
///     fn echo_len(ctx) {
///         let n = ctx.args().len() as u64;
///         ctx.reply_u64(n)?;
///         Ok(naam_ebpf::Return::Done)
///     }
/// }
/// ```
#[macro_export]
macro_rules! handler {
    ($(#[$meta:meta])* fn $name:ident($ctx:ident) $body:block) => {
        $(#[$meta])*
        #[unsafe(no_mangle)]
        #[unsafe(link_section = concat!("naam/", stringify!($name)))]
        // The entry's contract is the ABI: the runtime passes a valid context in r1.
        #[allow(clippy::not_unsafe_ptr_arg_deref)]
        pub extern "C" fn $name(ctx: *mut $crate::Context) -> u64 {
            #[inline(always)]
            fn body($ctx: &mut $crate::Context) -> $crate::StepResult $body
            // SAFETY: the runtime passes a valid, exclusively borrowed Context in r1.
            let ctx = unsafe { &mut *ctx };
            // Every step starts with no descriptors, writes or staged bytes queued (the
            // runtime's part of the ABI). Said again here, the compiler knows it: the queues
            // are then filled at constant offsets, which the engines prove in bounds, instead
            // of at indices loaded from the context, which each cost a check and made the
            // engines forget the values spilled to the stack.
            ctx.next_count = 0;
            ctx.write_count = 0;
            ctx.write_data_len = 0;
            match body(ctx) {
                Ok(ret) => ret.encode(),
                // A torn optimistic read is not an error: run the step again.
                Err($crate::Fault::TORN_READ) => $crate::Return::Retry.encode(),
                Err(fault) => $crate::Return::Error(fault.code()).encode(),
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Staged words land one after another and stores name them by offset, in any order and
    /// more than once; staging past the buffer is refused and stages nothing.
    #[test]
    fn staged_words_are_named_by_offset() {
        let mut ctx = Context::new();
        ctx.begin_writes();
        assert_eq!(ctx.stage_u64(0x0102_0304_0506_0708), Ok(0));
        assert_eq!(ctx.stage_u64(9), Ok(8));
        assert_eq!((ctx.write_count, ctx.write_data_len), (0, 16));
        ctx.push_staged(2, 40, 8, 8).unwrap();
        ctx.push_staged(2, 0, 0, 8).unwrap();
        ctx.push_staged(3, 16, 0, 8).unwrap();
        let at = |w: &WriteOp| (w.kind, w.segment, w.offset, w.data_offset, w.len);
        let writes = &ctx.writes[..ctx.write_count as usize];
        assert_eq!(
            [at(&writes[0]), at(&writes[1]), at(&writes[2])],
            [
                (write_kind::STORE, 2, 40, 8, 8),
                (write_kind::STORE, 2, 0, 0, 8),
                (write_kind::STORE, 3, 16, 0, 8)
            ]
        );
        assert_eq!(writes.len(), 3);
        assert_eq!(ctx.write_data[..8], 0x0102_0304_0506_0708u64.to_le_bytes());
        ctx.write_data_len = (WRITE_DATA_CAP - 4) as u32;
        assert_eq!(ctx.stage_u64(1), Err(Fault::WRITES_FULL));
        assert_eq!(ctx.write_data_len as usize, WRITE_DATA_CAP - 4);
    }

    /// `begin_writes` starts the batch over: what was queued before it is dropped.
    #[test]
    fn a_batch_begun_again_holds_only_what_follows() {
        let mut ctx = Context::new();
        ctx.push_cas(1, 8, 1, 2).unwrap();
        ctx.push_store_u64(2, 16, 7).unwrap();
        ctx.begin_writes();
        assert_eq!((ctx.write_count, ctx.write_data_len), (0, 0));
        ctx.push_store_u64(3, 24, 9).unwrap();
        assert_eq!((ctx.write_count, ctx.write_data_len), (1, 8));
        assert_eq!((ctx.writes[0].segment, ctx.writes[0].offset), (3, 24));
        assert_eq!(ctx.writes[0].data_offset, 0);
    }

    /// Queued writes read back field for field as the runtime reads them: the word-wise
    /// stores of `push_write` lay every field where `WriteOp`'s `repr(C)` puts it.
    #[test]
    fn queued_writes_read_back_as_the_ops_pushed() {
        // (`push_store` copies through a runtime helper, which a native test cannot call.)
        let mut ctx = Context::new();
        ctx.push_cas(1, 8, 0x1122_3344_5566_7788, u64::MAX).unwrap();
        ctx.push_store_u64(7, 0xFFFF_FFF0, 0x0102_0304_0506_0708)
            .unwrap();
        let writes = &ctx.writes[..ctx.write_count as usize];
        assert_eq!(
            writes[0],
            WriteOp {
                kind: write_kind::CAS,
                segment: 1,
                offset: 8,
                len: 8,
                data_offset: 0,
                reserved: 0,
                operand: u64::MAX,
                expected: 0x1122_3344_5566_7788,
            }
        );
        let last = writes[writes.len() - 1];
        assert_eq!(
            (
                last.kind,
                last.segment,
                last.offset,
                last.len,
                last.operand,
                last.expected
            ),
            (write_kind::STORE, 7, 0xFFFF_FFF0, 8, 0, 0)
        );
        let at = last.data_offset as usize;
        assert_eq!(
            ctx.write_data[at..at + 8],
            0x0102_0304_0506_0708u64.to_le_bytes()
        );
    }
}
