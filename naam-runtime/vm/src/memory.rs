//! The machine state one invocation runs against, shared by the interpreter, the helpers and
//! JIT-compiled code: the eBPF stack, the grant table (every byte a handler may touch, with its
//! rights), the helper table, the instruction budget, the fault record and the trace.
//!
//! [`VmCtx`] is `#[repr(C)]` because compiled code reads it at fixed offsets ([`layout`]) and
//! the aarch64 test harness, written in C, builds one from a header generated from the same
//! offsets ([`c_header`]). There is exactly one definition of "may this access happen":
//! [`VmCtx::allows`], whose per-size limits the JIT compares against inline.

use std::fmt::Write as _;

use naam_ebpf::abi::MAX_SEGMENTS;

/// Slots in the grant table (a power of two: compiled code masks slot indices with it).
pub const MAX_GRANTS: usize = 32;
const _: () = assert!(MAX_GRANTS.is_power_of_two() && MAX_GRANTS <= 256);

/// Fixed meanings of grant-table slots.
pub mod slot {
    use super::*;
    /// The memory `r1` points at on entry: the read-only input part of a handler step's
    /// [`naam_ebpf::abi::Context`] (header, segment table, args), or the whole (writable)
    /// memory of a raw run (the conformance suite).
    pub const ENTRY: usize = 0;
    /// The writable output part of a handler step's context, right after its input part
    /// (empty in raw runs).
    pub const ENTRY_OUT: usize = 1;
    /// The eBPF stack (every call frame).
    pub const STACK: usize = 2;
    /// Segment `i` of a handler step is slot `SEGMENT + i`.
    pub const SEGMENT: usize = 3;
    /// Read-only data section `k` of the program is slot `RODATA + k`.
    pub const RODATA: usize = SEGMENT + MAX_SEGMENTS;
    /// How many read-only data sections one program may reference.
    pub const MAX_RODATA: usize = MAX_GRANTS - RODATA;
}

/// Entries in the helper table; helper ids are indices into it.
pub const HELPER_SLOTS: usize = 64;

/// Call frames (the entry's included) a run may use.
pub const MAX_CALL_DEPTH: usize = 8;
/// Bytes of eBPF stack a run needs: one frame per call level.
pub const STACK_BYTES: usize = naam_ebpf::abi::STACK_SIZE * MAX_CALL_DEPTH;

/// Values the trace helper keeps per invocation.
pub const TRACE_CAP: usize = 64;

/// Entries of [`VmCtx::sites`]: an access at slot `pc` remembers its grant in entry
/// `pc % SITE_HINTS` (two sites that share an entry only cost each other hits).
pub const SITE_HINTS: usize = 512;

/// Bits of the slow-path check's `kind` argument below the site: the access kind
/// ([`access`]). Above them, `site + 1` of the access (0: none).
pub const SITE_SHIFT: u64 = 8;

/// Index of an access size in [`GrantSlot::read_lim`] and [`GrantSlot::write_lim`].
#[inline(always)]
pub const fn size_index(size: u64) -> usize {
    size.trailing_zeros() as usize & 3
}

/// One granted range of memory.
///
/// The limits turn a bounds-and-rights check into one unsigned comparison: an access of
/// `size` bytes at `addr` is allowed iff `addr - start < lim[size_index(size)]` (wrapping
/// subtraction), where `lim` is `len - size + 1` when the right is granted and `len >= size`,
/// and 0 (nothing passes) otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrantSlot {
    /// Address of the first granted byte (kept even when the slot is empty).
    pub start: u64,
    /// Length in bytes (0: the slot is empty).
    pub len: u64,
    /// 1 when stores are allowed.
    pub writable: u64,
    /// Padding to keep the limit arrays 32-byte aligned in the slot.
    pub reserved: u64,
    /// Load limits for 1, 2, 4 and 8-byte accesses.
    pub read_lim: [u64; 4],
    /// Store limits for 1, 2, 4 and 8-byte accesses.
    pub write_lim: [u64; 4],
}

impl GrantSlot {
    /// An empty slot: nothing passes.
    pub const EMPTY: GrantSlot = GrantSlot {
        start: 0,
        len: 0,
        writable: 0,
        reserved: 0,
        read_lim: [0; 4],
        write_lim: [0; 4],
    };

    /// A slot granting `len` readable bytes at `start`, writable too if `writable`.
    #[inline]
    pub fn new(start: u64, len: u64, writable: bool) -> GrantSlot {
        GrantSlot::with_rights(start, len, true, writable)
    }

    /// A slot granting `len` bytes at `start` with the given rights. An empty slot keeps its
    /// start (compiled code takes read-only data's address from it, even when empty).
    #[inline]
    pub fn with_rights(start: u64, len: u64, readable: bool, writable: bool) -> GrantSlot {
        // A range that wraps the address space grants nothing.
        if len == 0 || start.checked_add(len).is_none() {
            return GrantSlot {
                start,
                ..GrantSlot::EMPTY
            };
        }
        let lim = |size: u64| if len >= size { len - size + 1 } else { 0 };
        let all = [lim(1), lim(2), lim(4), lim(8)];
        GrantSlot {
            start,
            len,
            writable: writable as u64,
            reserved: 0,
            read_lim: if readable { all } else { [0; 4] },
            write_lim: if writable { all } else { [0; 4] },
        }
    }

    /// Whether this slot is what [`GrantSlot::with_rights`] makes of the same arguments, for a
    /// range that is not empty (an empty or wrapping range is never taken for the same): a
    /// few words compared instead of the slot computed and stored again.
    #[inline(always)]
    pub fn grants(&self, start: u64, len: u64, readable: bool, writable: bool) -> bool {
        // The 1-byte load limit is the length when loads are allowed, else 0.
        self.start == start
            && self.len == len
            && len != 0
            && self.writable == writable as u64
            && (self.read_lim[0] != 0) == readable
    }

    /// True when an access of `size` (1, 2, 4 or 8) bytes at `addr` lies inside with the right.
    #[inline(always)]
    pub fn allows_small(&self, addr: u64, size: u64, write: bool) -> bool {
        let lim = if write {
            self.write_lim[size_index(size)]
        } else {
            self.read_lim[size_index(size)]
        };
        addr.wrapping_sub(self.start) < lim
    }

    /// True when `[addr, addr + len)` lies inside with the right (any length; helpers).
    pub fn allows_range(&self, addr: u64, len: u64, write: bool) -> bool {
        // The 1-byte limit is zero exactly when the right is missing (or the slot is empty).
        let right = if write {
            self.write_lim[0]
        } else {
            self.read_lim[0]
        };
        if right == 0 {
            return false;
        }
        let off = addr.wrapping_sub(self.start);
        off < self.len && len <= self.len - off
    }
}

/// Kinds of faults, as stored in [`FaultRecord::kind`].
pub mod fault {
    /// No fault.
    pub const NONE: u64 = 0;
    /// A load outside the grants.
    pub const LOAD: u64 = 1;
    /// A store outside the writable grants.
    pub const STORE: u64 = 2;
    /// An atomic operation outside the writable grants.
    pub const ATOMIC: u64 = 3;
    /// An atomic operation at an address that is not a multiple of its size.
    pub const MISALIGNED: u64 = 4;
    /// The instruction budget ran out (at a backward jump or a call).
    pub const BUDGET: u64 = 5;
    /// A local call would nest deeper than the stack has frames.
    pub const CALL_DEPTH: u64 = 6;
    /// A call to a helper id that is not installed (`addr` holds the id).
    pub const UNKNOWN_HELPER: u64 = 7;
    /// The abort helper ran (`addr` holds the code).
    pub const ABORT: u64 = 8;
}

/// Where and why an invocation stopped abnormally.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultRecord {
    /// One of [`fault`].
    pub kind: u64,
    /// Slot index of the faulting instruction (0 for an abort).
    pub pc: u64,
    /// Address accessed, helper id or abort code.
    pub addr: u64,
    /// Access size in bytes (0 for faults that are not memory accesses).
    pub len: u64,
}

/// Access kinds passed to the slow-path check.
pub mod access {
    /// A load: needs the read right.
    pub const LOAD: u64 = 0;
    /// A store: needs the write right.
    pub const STORE: u64 = 1;
    /// An atomic read-modify-write: needs the write right, like a store.
    pub const ATOMIC: u64 = 2;
    /// Added to a kind: only find the grant (and remember it for the site); a miss is not a
    /// fault. Inline helper code probes before it falls back to the helper itself.
    pub const PROBE: u64 = 0x80;
}

/// A helper as compiled code and the interpreter call it: the context, then `r1`..`r5`;
/// the result goes to `r0`. A helper that stops the invocation sets [`VmCtx::fault`].
pub type HelperFn = extern "C" fn(*mut VmCtx, u64, u64, u64, u64, u64) -> u64;

/// The slow-path access check compiled code calls when its inline check misses: `(ctx, addr,
/// size, access kind, pc) -> 1` when some grant allows the access, else it records the fault
/// and returns 0.
pub type CheckFn = extern "C" fn(*mut VmCtx, u64, u64, u64, u64) -> u64;

/// Per-invocation machine state.
#[repr(C)]
#[derive(Clone, Debug)]
pub struct VmCtx {
    /// The eBPF stack, every call frame (8-byte words: atomics on the stack need natural
    /// alignment). It lives here, at a fixed offset from the state compiled code is handed,
    /// so that the entry function's frame pointer is that pointer plus a constant
    /// ([`layout::STACK_TOP`]): its stack accesses address the state directly and no
    /// register is held for `r10` across the whole function. It comes first: its top frame
    /// (where handlers keep their spills) then ends where the grant table begins and shares no
    /// address modulo 4 KiB with the table's 3 KiB, whereas placed last it fell on the table's
    /// first slots modulo 4 KiB, where loads of the grants could wait on in-flight spills (4K
    /// aliasing). A build with the stack last measured slower, though not every such build did
    /// (bench/RESULTS.md, twelfth session).
    pub stack: [u64; STACK_BYTES / 8],
    /// Every range the invocation may touch; see [`slot`].
    pub grants: [GrantSlot; MAX_GRANTS],
    /// Helper entry points by id ([`HelperFn`] addresses; 0 = not installed).
    pub helpers: [u64; HELPER_SLOTS],
    /// Address of the [`CheckFn`] compiled code calls when its inline check misses.
    pub check: u64,
    /// Instructions allowed per invocation.
    pub budget: u64,
    /// Instructions executed so far (exact at backward jumps, calls and the final exit).
    pub executed: u64,
    /// Lowest address a call frame may start at: a call whose new frame would begin below
    /// it nests too deep.
    pub stack_limit: u64,
    /// Set when the invocation stops abnormally.
    pub fault: FaultRecord,
    /// Valid entries of `trace`.
    pub trace_len: u64,
    /// Values recorded by the trace helper.
    pub trace: [u64; TRACE_CAP],
    /// Per access site whose grant the analysis could not prove: the grant slot that last
    /// allowed it (written by the slow path, `check_slow`). Compiled code tries that slot
    /// inline before it calls the slow path, so a handler that walks a run-time number of
    /// segments finds each in one comparison instead of a scan of every grant. Compiled code
    /// masks the value to a slot index ([`MAX_GRANTS`] is a power of two): whatever it
    /// holds, the check reads a real slot.
    pub sites: [u8; SITE_HINTS],
}

// `to_bytes` and the C header assume no padding: `sites` ends on a word boundary.
const _: () = assert!(SITE_HINTS.is_multiple_of(8));

impl Default for VmCtx {
    fn default() -> Self {
        VmCtx {
            stack: [0; STACK_BYTES / 8],
            grants: [GrantSlot::EMPTY; MAX_GRANTS],
            helpers: [0; HELPER_SLOTS],
            check: check_slow as CheckFn as usize as u64,
            budget: 0,
            executed: 0,
            stack_limit: 0,
            fault: FaultRecord::default(),
            trace_len: 0,
            trace: [0; TRACE_CAP],
            sites: [slot::ENTRY as u8; SITE_HINTS],
        }
    }
}

impl VmCtx {
    /// The state as bytes, in its C layout.
    pub fn to_bytes(&self) -> Vec<u8> {
        // SAFETY: `VmCtx` is `repr(C)` plain data (integers only), without padding between
        // its u64-aligned fields.
        unsafe { std::slice::from_raw_parts((self as *const VmCtx).cast::<u8>(), layout::SIZE) }
            .to_vec()
    }

    /// The state from bytes in its C layout (`None` when the length is wrong).
    pub fn from_bytes(bytes: &[u8]) -> Option<VmCtx> {
        if bytes.len() != layout::SIZE {
            return None;
        }
        let mut c = VmCtx::default();
        // SAFETY: every bit pattern is a valid `VmCtx` (integers only); lengths match.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (&mut c as *mut VmCtx).cast::<u8>(),
                layout::SIZE,
            )
        };
        Some(c)
    }

    /// True when some grant allows an access of `size` (1, 2, 4 or 8) bytes at `addr`; `hint`
    /// is the slot to try first.
    #[inline(always)]
    pub fn allows(&self, hint: usize, addr: u64, size: u64, write: bool) -> bool {
        if let Some(g) = self.grants.get(hint) {
            if g.allows_small(addr, size, write) {
                return true;
            }
        }
        self.grants
            .iter()
            .any(|g| g.allows_small(addr, size, write))
    }

    /// True when some grant allows `[addr, addr + len)` (any length). Empty ranges are
    /// allowed anywhere: nothing is touched.
    pub fn allows_range(&self, addr: u64, len: u64, write: bool) -> bool {
        len == 0 || self.grants.iter().any(|g| g.allows_range(addr, len, write))
    }

    /// Records a fault (the first one wins).
    #[inline]
    pub fn set_fault(&mut self, kind: u64, pc: u64, addr: u64, len: u64) {
        if self.fault.kind == fault::NONE {
            self.fault = FaultRecord {
                kind,
                pc,
                addr,
                len,
            };
        }
    }

    /// Clears the per-invocation outputs: fault, count and trace (a record with kind
    /// [`fault::NONE`] is empty whatever its other fields hold).
    #[inline]
    pub fn reset_run(&mut self) {
        self.fault.kind = fault::NONE;
        self.executed = 0;
        self.trace_len = 0;
    }
}

/// The slow-path check ([`CheckFn`]) for compiled code.
pub(crate) extern "C" fn check_slow(
    ctx: *mut VmCtx,
    addr: u64,
    size: u64,
    kind: u64,
    pc: u64,
) -> u64 {
    // SAFETY: compiled code passes the context it was entered with, alive for the call.
    let ctx = unsafe { &mut *ctx };
    let site = (kind >> SITE_SHIFT) as usize;
    let probe = kind & access::PROBE != 0;
    let kind = kind & ((1 << SITE_SHIFT) - 1) & !access::PROBE;
    let write = kind != access::LOAD;
    if let Some(i) = ctx
        .grants
        .iter()
        .position(|g| g.allows_small(addr, size, write))
    {
        if let Some(cell) = site.checked_sub(1).and_then(|s| ctx.sites.get_mut(s)) {
            *cell = i as u8;
        }
        return 1;
    }
    if probe {
        return 0;
    }
    let fault_kind = match kind {
        access::LOAD => fault::LOAD,
        access::STORE => fault::STORE,
        _ => fault::ATOMIC,
    };
    ctx.set_fault(fault_kind, pc, addr, size);
    0
}

/// Byte offsets of the [`VmCtx`] fields compiled code uses.
pub mod layout {
    use super::*;
    use std::mem::offset_of;

    /// Size of one grant slot.
    pub const GRANT_SIZE: usize = std::mem::size_of::<GrantSlot>();
    /// Offset of the grant table.
    pub const GRANTS: usize = offset_of!(VmCtx, grants);
    /// Offset of `start` within a slot.
    pub const GRANT_START: usize = offset_of!(GrantSlot, start);
    /// Offset of `len` within a slot.
    pub const GRANT_LEN: usize = offset_of!(GrantSlot, len);
    /// Offset of `read_lim` within a slot.
    pub const GRANT_READ_LIM: usize = offset_of!(GrantSlot, read_lim);
    /// Offset of `write_lim` within a slot.
    pub const GRANT_WRITE_LIM: usize = offset_of!(GrantSlot, write_lim);
    /// Offset of the helper table.
    pub const HELPERS: usize = offset_of!(VmCtx, helpers);
    /// Offset of the slow-path check.
    pub const CHECK: usize = offset_of!(VmCtx, check);
    /// Offset of the budget.
    pub const BUDGET: usize = offset_of!(VmCtx, budget);
    /// Offset of the executed count.
    pub const EXECUTED: usize = offset_of!(VmCtx, executed);
    /// Offset of the stack limit.
    pub const STACK_LIMIT: usize = offset_of!(VmCtx, stack_limit);
    /// Offset of the fault record.
    pub const FAULT: usize = offset_of!(VmCtx, fault);
    /// Offset of the trace length.
    pub const TRACE_LEN: usize = offset_of!(VmCtx, trace_len);
    /// Offset of the trace.
    pub const TRACE: usize = offset_of!(VmCtx, trace);
    /// Offset of the per-site grant memory.
    pub const SITES: usize = offset_of!(VmCtx, sites);
    /// Size of the whole context.
    pub const SIZE: usize = std::mem::size_of::<VmCtx>();
    /// Offset of the stack.
    pub const STACK: usize = offset_of!(VmCtx, stack);
    /// Offset of the top of the stack: the entry function's frame pointer.
    pub const STACK_TOP: usize = STACK + STACK_BYTES;

    /// Offset of the limit compiled code compares against for an access to `slot`.
    pub const fn limit(slot: usize, size: u64, write: bool) -> usize {
        GRANTS
            + slot * GRANT_SIZE
            + if write {
                GRANT_WRITE_LIM
            } else {
                GRANT_READ_LIM
            }
            + size_index(size) * 8
    }

    /// Offset of `start` of `slot`.
    pub const fn start(slot: usize) -> usize {
        GRANTS + slot * GRANT_SIZE + GRANT_START
    }
}

/// First word of a harness input (`NAAMX002` little-endian): see `harness/aarch64.c`. The
/// version changes with the input's format (002: no frame pointer, the stack in region 0).
pub const HARNESS_MAGIC: u64 = u64::from_le_bytes(*b"NAAMX002");

/// A C header describing [`VmCtx`] for the aarch64 test harness, generated from the same
/// layout compiled code uses (so the two cannot drift apart).
pub fn c_header() -> String {
    let mut h = String::new();
    let _ = writeln!(
        h,
        "/* Generated by naam_vm::memory::c_header(); do not edit. */"
    );
    let _ = writeln!(h, "#include <stdint.h>");
    use naam_ebpf::abi::helper as h;
    let consts: [(&str, u64); 39] = [
        ("NAAM_MAX_GRANTS", MAX_GRANTS as u64),
        ("NAAM_SITE_HINTS", SITE_HINTS as u64),
        ("NAAM_SITE_SHIFT", SITE_SHIFT),
        ("NAAM_SLOT_MASK", (MAX_GRANTS - 1) as u64),
        ("NAAM_GRANT_SIZE", layout::GRANT_SIZE as u64),
        ("NAAM_HELPER_SLOTS", HELPER_SLOTS as u64),
        ("NAAM_TRACE_CAP", TRACE_CAP as u64),
        ("NAAM_STACK_BYTES", STACK_BYTES as u64),
        ("NAAM_SLOT_ENTRY", slot::ENTRY as u64),
        ("NAAM_SLOT_ENTRY_OUT", slot::ENTRY_OUT as u64),
        ("NAAM_SLOT_STACK", slot::STACK as u64),
        ("NAAM_SLOT_SEGMENT", slot::SEGMENT as u64),
        ("NAAM_SLOT_RODATA", slot::RODATA as u64),
        ("NAAM_FAULT_LOAD", fault::LOAD),
        ("NAAM_FAULT_STORE", fault::STORE),
        ("NAAM_FAULT_ATOMIC", fault::ATOMIC),
        ("NAAM_FAULT_ABORT", fault::ABORT),
        ("NAAM_ACCESS_LOAD", access::LOAD),
        ("NAAM_ACCESS_STORE", access::STORE),
        ("NAAM_ACCESS_PROBE", access::PROBE),
        ("NAAM_HELPER_MAX_LEN", naam_ebpf::abi::helper::MAX_LEN),
        ("NAAM_HELPER_ERR_FAULT", naam_ebpf::abi::helper::ERR_FAULT),
        ("NAAM_HELPER_ABORT_R0", naam_ebpf::abi::helper::ABORT_R0),
        ("NAAM_CMP_EQUAL", naam_ebpf::abi::helper::CMP_EQUAL),
        ("NAAM_CMP_LESS", naam_ebpf::abi::helper::CMP_LESS),
        ("NAAM_CMP_GREATER", naam_ebpf::abi::helper::CMP_GREATER),
        ("NAAM_VMCTX_SIZE", layout::SIZE as u64),
        ("NAAM_FAULT_UNKNOWN_HELPER", fault::UNKNOWN_HELPER),
        ("NAAM_HELPER_ID_ABORT", h::ABORT as u64),
        ("NAAM_HELPER_ID_TRACE", h::TRACE as u64),
        ("NAAM_HELPER_ID_MEMCPY", h::MEMCPY as u64),
        ("NAAM_HELPER_ID_MEMCMP", h::MEMCMP as u64),
        ("NAAM_HELPER_ID_HASH64", h::HASH64 as u64),
        ("NAAM_HELPER_ID_MEMSET", h::MEMSET as u64),
        (
            "NAAM_HELPER_ID_UNWIND",
            crate::helpers::CONFORMANCE_UNWIND as u64,
        ),
        ("NAAM_HASH_K", naam_ebpf::hash::K),
        ("NAAM_HASH_M1", naam_ebpf::hash::FINISH_M1),
        ("NAAM_HASH_M2", naam_ebpf::hash::FINISH_M2),
        ("NAAM_HARNESS_MAGIC", HARNESS_MAGIC),
    ];
    for (name, value) in consts {
        let _ = writeln!(h, "#define {name} {value}ULL");
    }
    let _ = writeln!(
        h,
        "typedef struct {{ uint64_t start, len, writable, reserved, read_lim[4], write_lim[4]; }} naam_grant;"
    );
    let _ = writeln!(
        h,
        "typedef struct {{ uint64_t kind, pc, addr, len; }} naam_fault;"
    );
    let _ = writeln!(h, "typedef struct naam_vmctx {{");
    let _ = writeln!(h, "  uint64_t stack[NAAM_STACK_BYTES / 8];");
    let _ = writeln!(h, "  naam_grant grants[NAAM_MAX_GRANTS];");
    let _ = writeln!(h, "  uint64_t helpers[NAAM_HELPER_SLOTS];");
    let _ = writeln!(
        h,
        "  uint64_t check, budget, executed, stack_limit;\n  naam_fault fault;\n  uint64_t trace_len;\n  uint64_t trace[NAAM_TRACE_CAP];\n  uint8_t sites[NAAM_SITE_HINTS];"
    );
    let _ = writeln!(h, "}} naam_vmctx;");
    for (field, off) in [
        ("helpers", layout::HELPERS),
        ("check", layout::CHECK),
        ("budget", layout::BUDGET),
        ("executed", layout::EXECUTED),
        ("stack_limit", layout::STACK_LIMIT),
        ("fault", layout::FAULT),
        ("trace_len", layout::TRACE_LEN),
        ("trace", layout::TRACE),
        ("sites", layout::SITES),
        ("stack", layout::STACK),
    ] {
        let _ = writeln!(
            h,
            "_Static_assert(__builtin_offsetof(naam_vmctx, {field}) == {off}, \"layout of {field}\");"
        );
    }
    let _ = writeln!(
        h,
        "_Static_assert(sizeof(naam_vmctx) == {}, \"size of naam_vmctx\");",
        layout::SIZE
    );
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn limits_are_exact() {
        let g = GrantSlot::new(1000, 16, false);
        assert!(g.allows_small(1000, 8, false));
        assert!(g.allows_small(1008, 8, false));
        assert!(
            !g.allows_small(1009, 8, false),
            "an access may not run past the end"
        );
        assert!(!g.allows_small(999, 1, false));
        assert!(!g.allows_small(1000, 1, true), "read-only");
        let tiny = GrantSlot::new(1000, 3, true);
        assert!(tiny.allows_small(1000, 2, true));
        assert!(
            !tiny.allows_small(1000, 4, false),
            "4 bytes do not fit in 3"
        );
        assert_eq!(
            GrantSlot::new(u64::MAX - 2, 8, true).len,
            0,
            "wraps: nothing"
        );
        assert!(!GrantSlot::new(u64::MAX - 2, 8, true).allows_small(u64::MAX - 2, 1, false));
        let write_only = GrantSlot::with_rights(1000, 16, false, true);
        assert!(!write_only.allows_small(1000, 8, false), "no read right");
        assert!(write_only.allows_small(1000, 8, true));
    }

    proptest! {
        /// The one-comparison form agrees with the obvious definition for every address.
        #[test]
        fn small_check_matches_definition(start in prop_oneof![0u64..1 << 40, u64::MAX - 80..=u64::MAX], len in 0u64..64, addr_delta in -80i64..80, size_k in 0usize..4, write: bool, readable: bool, writable: bool) {
            let size = 1u64 << size_k;
            let g = GrantSlot::with_rights(start, len, readable, writable);
            let addr = start.wrapping_add(addr_delta as u64);
            let expect = start.checked_add(len).is_some()
                && addr >= start
                && addr.checked_add(size).is_some_and(|end| end <= start + len)
                && if write { writable } else { readable };
            prop_assert_eq!(g.allows_small(addr, size, write), expect);
            prop_assert_eq!(g.allows_range(addr, size, write), expect);
        }

        /// `grants` recognises exactly the slot `with_rights` made of the same arguments (a
        /// range that neither is empty nor wraps), and no slot made of others.
        #[test]
        fn grants_recognises_the_slot_it_was_made_as(start in prop_oneof![0u64..1 << 40, u64::MAX - 80..=u64::MAX], len in 0u64..64, readable: bool, writable: bool, other_start in 0u64..4, other_len in 0u64..4, other_readable: bool, other_writable: bool) {
            let g = GrantSlot::with_rights(start, len, readable, writable);
            let real = len != 0 && start.checked_add(len).is_some();
            prop_assert_eq!(g.grants(start, len, readable, writable), real);
            let other = (start ^ other_start, len ^ other_len, other_readable, other_writable);
            if other != (start, len, readable, writable) {
                prop_assert!(!g.grants(other.0, other.1, other.2, other.3));
            }
        }
    }

    #[test]
    fn header_mentions_every_field() {
        let h = c_header();
        assert!(h.contains("naam_vmctx"));
        assert!(h.contains(&format!("== {}", layout::SIZE)));
    }
}
