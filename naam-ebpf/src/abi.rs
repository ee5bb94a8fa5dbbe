//! The handler ABI: the one source of truth for every constant and `#[repr(C)]` struct shared
//! by eBPF handlers and the runtime.
//!
//! A handler is invoked with `r1` pointing at a [`Context`]. The runtime fills the inputs
//! (header words, inline args, state words, fetched segments), the handler fills the outputs
//! (reply bytes, next-step descriptors, write operations, state words) and returns a
//! [`Return`] code in `r0`. All integers are little-endian; every struct has a fixed layout
//! that is checked by compile-time assertions at the bottom of this file.

/// Version of this ABI; stored in [`Context::abi_version`] by the runtime.
pub const ABI_VERSION: u32 = 2;

/// Prefix of the ELF section that holds a handler: `naam/<name>`.
pub const SECTION_PREFIX: &str = "naam/";

/// Capacity of the inline argument bytes (a write carries its value inline: YCSB records are
/// 10 x 100 bytes).
pub const ARGS_CAP: usize = 2048;
/// Number of 64-bit state words carried across the steps of one message.
pub const STATE_WORDS: usize = 8;
/// Maximum number of segments fetched for one step.
pub const MAX_SEGMENTS: usize = 8;
/// Maximum number of descriptors a step may request for the next step.
pub const MAX_NEXT: usize = 8;
/// Capacity of the reply buffer (it persists across the steps of one message).
pub const REPLY_CAP: usize = 4096;
/// Maximum number of write operations one step may emit (a B-tree node split needs about 14).
pub const MAX_WRITES: usize = 16;
/// Capacity of the staging buffer that holds the bytes of `STORE` write operations (a split
/// moves half a node and shifts a parent).
pub const WRITE_DATA_CAP: usize = 4096;
/// eBPF stack size available to a handler, in bytes.
pub const STACK_SIZE: usize = 512;

/// Access right: the segment may be read.
pub const ACCESS_READ: u32 = 1;
/// Access right: the segment may be written.
pub const ACCESS_WRITE: u32 = 2;
/// Access right: the segment may be the target of atomic operations (CAS, FAA).
pub const ACCESS_ATOMIC: u32 = 4;
/// All defined access bits.
pub const ACCESS_MASK: u32 = ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC;

/// `ACCESS_*` bits as configs and command lines write them: `r`, `rw`, `rwa` (`-` for none;
/// bits no right has follow in hex, `r+0x10`).
pub struct Rights(pub u32);

impl core::fmt::Display for Rights {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut any = false;
        for (bit, letter) in [
            (ACCESS_READ, "r"),
            (ACCESS_WRITE, "w"),
            (ACCESS_ATOMIC, "a"),
        ] {
            if self.0 & bit != 0 {
                f.write_str(letter)?;
                any = true;
            }
        }
        let other = self.0 & !ACCESS_MASK;
        match (any, other) {
            (false, 0) => f.write_str("-"),
            (_, 0) => Ok(()),
            (true, o) => write!(f, "+{o:#x}"),
            (false, o) => write!(f, "{o:#x}"),
        }
    }
}

/// Where a step runs; stored in [`Context::placement`] for information only.
pub mod placement {
    /// On the client, over data fetched by one-sided READs.
    pub const CLIENT: u32 = 0;
    /// On SmartNIC cores, over data reached by DMA.
    pub const NIC: u32 = 1;
    /// On server host cores, over region memory directly.
    pub const HOST: u32 = 2;
    /// A standalone invocation (the `naam run` command, tests).
    pub const STANDALONE: u32 = 3;
}

/// Helper ids: a handler calls helper `N` with the eBPF instruction `call N`.
pub mod helper {
    /// `abort(code) -> !`: stop the invocation with an abort error.
    pub const ABORT: u32 = 1;
    /// `trace(value) -> 0`: record a value in the invocation's trace.
    pub const TRACE: u32 = 2;
    /// `memcpy(dst, src, len) -> 0 | error`: bounded copy (overlap allowed) between memory the
    /// handler may access.
    pub const MEMCPY: u32 = 3;
    /// `memcmp(a, b, len) -> 0 | 1 | 2 | error`: equal, a < b, a > b.
    pub const MEMCMP: u32 = 4;
    /// `hash64(ptr, len, seed) -> hash`: [`crate::hash::hash64`] over readable memory.
    pub const HASH64: u32 = 5;
    /// `memset(dst, byte, len) -> 0 | error`: bounded fill of writable memory.
    pub const MEMSET: u32 = 6;
    /// Every helper id the runtime implements, in id order.
    pub const ALL: [u32; 6] = [ABORT, TRACE, MEMCPY, MEMCMP, HASH64, MEMSET];

    /// Human-readable helper name for an id, if the id is known.
    pub const fn name(id: u32) -> Option<&'static str> {
        match id {
            ABORT => Some("abort"),
            TRACE => Some("trace"),
            MEMCPY => Some("memcpy"),
            MEMCMP => Some("memcmp"),
            HASH64 => Some("hash64"),
            MEMSET => Some("memset"),
            _ => None,
        }
    }

    /// Largest length a single `memcpy`, `memcmp` or `hash64` call accepts.
    pub const MAX_LEN: u64 = 64 * 1024;
    /// Value a memory helper returns when its arguments name memory the handler may not use.
    pub const ERR_FAULT: u64 = u64::MAX;
    /// Value the abort helper leaves in `r0`; the runtime reports the abort, not this value.
    pub const ABORT_R0: u64 = 0xdead_0000_0000_0000;
    /// `memcmp` result: the ranges are equal.
    pub const CMP_EQUAL: u64 = 0;
    /// `memcmp` result: the first range sorts first.
    pub const CMP_LESS: u64 = 1;
    /// `memcmp` result: the first range sorts last.
    pub const CMP_GREATER: u64 = 2;
}

/// Abort codes passed to the abort helper by the SDK.
pub mod abort_code {
    /// The handler panicked (the SDK panic handler calls abort with this code).
    pub const PANIC: u64 = 1;
    /// A memory builtin (`memcpy`, `memset`, ...) was refused by its helper.
    pub const MEMORY_BUILTIN: u64 = 2;
}

/// Error codes the SDK returns in [`Return::Error`]; applications use codes from
/// [`error_code::APP_BASE`] upwards.
pub mod error_code {
    /// A segment access fell outside the segment.
    pub const OUT_OF_BOUNDS: u32 = 1;
    /// The handler asked for a segment that was not fetched.
    pub const NO_SEGMENT: u32 = 2;
    /// An argument read fell outside the inline args.
    pub const BAD_ARGS: u32 = 3;
    /// The reply buffer is full.
    pub const REPLY_FULL: u32 = 4;
    /// Too many next-step descriptors.
    pub const NEXT_FULL: u32 = 5;
    /// Too many write operations, or the write staging buffer is full.
    pub const WRITES_FULL: u32 = 6;
    /// The segment lacks the access right the operation needs.
    pub const ACCESS: u32 = 7;
    /// A memory helper refused its arguments.
    pub const HELPER_FAULT: u32 = 8;
    /// A state word index was out of range.
    pub const BAD_STATE: u32 = 9;
    /// An optimistic read saw a concurrent write and must be retried.
    pub const TORN_READ: u32 = 10;
    /// First code available to applications.
    pub const APP_BASE: u32 = 0x1000;

    /// Every SDK code with its name, as tools print it and the README lists it.
    pub const NAMED: [(u32, &str); 10] = [
        (OUT_OF_BOUNDS, "out-of-bounds"),
        (NO_SEGMENT, "no-segment"),
        (BAD_ARGS, "bad-args"),
        (REPLY_FULL, "reply-full"),
        (NEXT_FULL, "next-full"),
        (WRITES_FULL, "writes-full"),
        (ACCESS, "access"),
        (HELPER_FAULT, "helper-fault"),
        (BAD_STATE, "bad-state"),
        (TORN_READ, "torn-read"),
    ];

    /// The name of an SDK code (`None` for application codes and unassigned ones).
    pub const fn name(code: u32) -> Option<&'static str> {
        let mut i = 0;
        while i < NAMED.len() {
            if NAMED[i].0 == code {
                return Some(NAMED[i].1);
            }
            i += 1;
        }
        None
    }

    /// What a code means, for people: `out-of-bounds`, `app(1)` for `APP_BASE + 1` (a handler's
    /// `Fault::app(1)`), or `unassigned(12)`.
    pub struct Describe(pub u32);

    impl core::fmt::Display for Describe {
        fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
            match name(self.0) {
                Some(n) => f.write_str(n),
                None if self.0 >= APP_BASE => write!(f, "app({})", self.0 - APP_BASE),
                None => write!(f, "unassigned({})", self.0),
            }
        }
    }
}

/// A segment fetched for the current step: `len` bytes at address `addr`, with access rights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    /// Address of the first byte, in the executor's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// `ACCESS_*` bits.
    pub access: u32,
}

/// An RDMA-like data descriptor: `len` bytes at `offset` in the region named by `rkey`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// Region key (a capability, like an RDMA rkey).
    pub rkey: u64,
    /// Byte offset inside the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// `ACCESS_*` bits the step needs.
    pub access: u32,
}

/// Kinds of [`WriteOp`].
pub mod write_kind {
    /// Copy `len` bytes from `write_data[data_offset..]` to `segment[offset..]`.
    pub const STORE: u32 = 1;
    /// 64-bit compare-and-swap at `segment[offset]`: if it equals `expected`, store `operand`.
    pub const CAS: u32 = 2;
    /// 64-bit fetch-and-add of `operand` at `segment[offset]`.
    pub const FAA: u32 = 3;
}

/// A write the executor applies, in order, after a step returns [`Return::Write`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteOp {
    /// One of [`write_kind`].
    pub kind: u32,
    /// Index of the target segment of this step.
    pub segment: u32,
    /// Byte offset inside the target segment.
    pub offset: u32,
    /// Length in bytes (`STORE`); 8 for `CAS` and `FAA`.
    pub len: u32,
    /// Offset of the source bytes in [`Context::write_data`] (`STORE`).
    pub data_offset: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// New value (`CAS`) or addend (`FAA`).
    pub operand: u64,
    /// Expected value (`CAS`).
    pub expected: u64,
}

/// The invocation context a handler receives in `r1`.
///
/// Two parts, each one grant of the step: the **inputs** (`abi_version` to `args`, the first
/// [`CONTEXT_INPUT_SIZE`] bytes) are read-only to the handler, so the segment table it reads is
/// the one the runtime granted; the **outputs** (`reply_len` to `write_data`) are writable.
/// (ABI version 2 put every input first; version 1 interleaved them.)
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Context {
    /// [`ABI_VERSION`].
    pub abi_version: u32,
    /// Index of this step within the message (0 for the first).
    pub step: u32,
    /// Application id.
    pub app: u32,
    /// One of [`placement`].
    pub placement: u32,
    /// Request id of the message.
    pub request_id: u64,
    /// Number of valid bytes in `args`.
    pub args_len: u32,
    /// Number of valid entries in `segments`.
    pub segment_count: u32,
    /// Segments fetched for this step, in the order of the descriptors.
    pub segments: [Segment; MAX_SEGMENTS],
    /// Inline argument bytes.
    pub args: [u8; ARGS_CAP],
    /// Number of valid bytes in `reply` (input and output: the reply accumulates across steps).
    pub reply_len: u32,
    /// Output: number of valid entries in `next`.
    pub next_count: u32,
    /// Output: number of valid entries in `writes`.
    pub write_count: u32,
    /// Output: number of valid bytes in `write_data`.
    pub write_data_len: u32,
    /// State words carried from one step to the next.
    pub state: [u64; STATE_WORDS],
    /// Output: descriptors to fetch for the next step (with [`Return::Continue`]).
    pub next: [Descriptor; MAX_NEXT],
    /// Output: write operations (with [`Return::Write`]).
    pub writes: [WriteOp; MAX_WRITES],
    /// Reply bytes.
    pub reply: [u8; REPLY_CAP],
    /// Staging bytes for `STORE` write operations.
    pub write_data: [u8; WRITE_DATA_CAP],
}

impl Context {
    /// A zeroed context with the ABI version set.
    pub const fn new() -> Self {
        Self {
            abi_version: ABI_VERSION,
            step: 0,
            app: 0,
            placement: 0,
            request_id: 0,
            args_len: 0,
            segment_count: 0,
            reply_len: 0,
            next_count: 0,
            write_count: 0,
            write_data_len: 0,
            state: [0; STATE_WORDS],
            segments: [Segment {
                addr: 0,
                len: 0,
                access: 0,
            }; MAX_SEGMENTS],
            next: [Descriptor {
                rkey: 0,
                offset: 0,
                len: 0,
                access: 0,
            }; MAX_NEXT],
            writes: [WriteOp {
                kind: 0,
                segment: 0,
                offset: 0,
                len: 0,
                data_offset: 0,
                reserved: 0,
                operand: 0,
                expected: 0,
            }; MAX_WRITES],
            args: [0; ARGS_CAP],
            reply: [0; REPLY_CAP],
            write_data: [0; WRITE_DATA_CAP],
        }
    }
}

impl Default for Context {
    fn default() -> Self {
        Self::new()
    }
}

/// Size of [`Context`] in bytes.
pub const CONTEXT_SIZE: usize = core::mem::size_of::<Context>();

/// Size of the context's read-only input part (`abi_version` to `args`); the writable
/// outputs follow it.
pub const CONTEXT_INPUT_SIZE: usize = core::mem::offset_of!(Context, reply_len);

/// Kind bits (low 8 bits) of an encoded [`Return`].
pub mod return_kind {
    /// The message is complete; the reply is `reply[..reply_len]`.
    pub const DONE: u64 = 0;
    /// Fetch `next[..next_count]` and run the handler again.
    pub const CONTINUE: u64 = 1;
    /// Apply `writes[..write_count]` in order, then complete like `DONE`.
    pub const WRITE: u64 = 2;
    /// Run this step again over freshly fetched segments (a torn optimistic read).
    pub const RETRY: u64 = 3;
    /// The handler failed with the error code in bits 8..40.
    pub const ERROR: u64 = 4;
}

/// What a step asks the executor to do next; encoded into `r0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Return {
    /// The message is complete.
    Done,
    /// Fetch the next descriptors and run again.
    Continue,
    /// Apply the write operations, then complete.
    Write,
    /// Re-fetch the same descriptors and run this step again.
    Retry,
    /// Fail with an error code.
    Error(u32),
}

impl Return {
    /// The `r0` encoding: kind in bits 0..8, error code in bits 8..40.
    #[inline(always)]
    pub const fn encode(self) -> u64 {
        match self {
            Return::Done => return_kind::DONE,
            Return::Continue => return_kind::CONTINUE,
            Return::Write => return_kind::WRITE,
            Return::Retry => return_kind::RETRY,
            Return::Error(code) => ((code as u64) << 8) | return_kind::ERROR,
        }
    }

    /// Decodes `r0`; `None` for values no handler built with this ABI returns.
    pub const fn decode(r0: u64) -> Option<Return> {
        let code = r0 >> 8;
        match r0 & 0xff {
            return_kind::DONE if code == 0 => Some(Return::Done),
            return_kind::CONTINUE if code == 0 => Some(Return::Continue),
            return_kind::WRITE if code == 0 => Some(Return::Write),
            return_kind::RETRY if code == 0 => Some(Return::Retry),
            return_kind::ERROR if code <= u32::MAX as u64 => Some(Return::Error(code as u32)),
            _ => None,
        }
    }
}

// Layout checks: the runtime and handlers must agree byte for byte.
const _: () = {
    assert!(core::mem::size_of::<Segment>() == 16);
    assert!(core::mem::size_of::<Descriptor>() == 24);
    assert!(core::mem::size_of::<WriteOp>() == 40);
    assert!(core::mem::offset_of!(Context, segments) == 32);
    assert!(core::mem::offset_of!(Context, args) == 32 + 16 * MAX_SEGMENTS);
    assert!(CONTEXT_INPUT_SIZE == 32 + 16 * MAX_SEGMENTS + ARGS_CAP);
    assert!(CONTEXT_INPUT_SIZE.is_multiple_of(8));
    assert!(core::mem::offset_of!(Context, state) == CONTEXT_INPUT_SIZE + 16);
    assert!(CONTEXT_SIZE.is_multiple_of(8));
    assert!(
        CONTEXT_SIZE
            == 48 + 64 + 128 + 192 + 40 * MAX_WRITES + ARGS_CAP + REPLY_CAP + WRITE_DATA_CAP
    );
};
