//! Helper functions callable from handlers, and the memory map they (and the interpreter) check
//! every address against.
//!
//! Helpers are pure functions of a [`HelperState`]; the interpreter passes its state directly,
//! the JIT reaches it through a thread-local set for the duration of one invocation (rbpf calls
//! helpers as plain `fn` pointers).

use std::cell::Cell;

use naam_ebpf::abi::helper;
use naam_ebpf::hash::hash64;

/// One range of memory a handler may touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemRange {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Whether stores are allowed.
    pub writable: bool,
}

/// The exact set of memory an invocation may use: context, stack, granted segments, read-only
/// data. Small (a handful of ranges), so lookups are a linear scan.
#[derive(Clone, Debug, Default)]
pub struct MemoryMap {
    ranges: Vec<MemRange>,
}

impl MemoryMap {
    /// Removes every range.
    pub fn clear(&mut self) {
        self.ranges.clear();
    }

    /// Adds `[start, start + len)`.
    pub fn add(&mut self, start: u64, len: usize, writable: bool) {
        if len > 0 {
            self.ranges.push(MemRange {
                start,
                end: start.saturating_add(len as u64),
                writable,
            });
        }
    }

    /// True when `[addr, addr + len)` lies inside one range that allows the access.
    #[inline]
    pub fn allows(&self, addr: u64, len: u64, write: bool) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        self.ranges
            .iter()
            .any(|r| r.start <= addr && end <= r.end && (r.writable || !write))
    }

    /// The ranges.
    pub fn ranges(&self) -> &[MemRange] {
        &self.ranges
    }
}

/// Per-invocation helper state: the memory map, the trace and the abort flag.
#[derive(Debug, Default)]
pub struct HelperState {
    /// Memory the helpers may read and write on the handler's behalf.
    pub mem: MemoryMap,
    /// Values recorded by the trace helper.
    pub trace: Vec<u64>,
    /// Abort code, once the abort helper ran.
    pub abort: Option<u64>,
}

/// Maximum trace entries kept per invocation.
pub const TRACE_CAP: usize = 64;

/// What a helper call produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelperResult {
    /// Continue with this value in r0.
    Value(u64),
    /// Stop the invocation: the handler aborted.
    Abort(u64),
    /// No helper has this id.
    Unknown,
}

impl HelperState {
    /// Resets for a new invocation (keeps allocations).
    pub fn reset(&mut self) {
        self.mem.clear();
        self.trace.clear();
        self.abort = None;
    }

    /// Runs helper `id` with arguments `a`.
    pub fn call(&mut self, id: u32, a: [u64; 5]) -> HelperResult {
        use HelperResult::Value;
        match id {
            helper::ABORT => {
                self.abort = Some(a[0]);
                HelperResult::Abort(a[0])
            }
            helper::TRACE => {
                if self.trace.len() < TRACE_CAP {
                    self.trace.push(a[0]);
                }
                Value(0)
            }
            helper::MEMCPY => {
                let (dst, src, len) = (a[0], a[1], a[2]);
                if len > helper::MAX_LEN
                    || !self.mem.allows(src, len, false)
                    || !self.mem.allows(dst, len, true)
                {
                    return Value(helper::ERR_FAULT);
                }
                // SAFETY: both ranges were checked against the invocation's memory map; `copy`
                // allows overlap.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
                Value(0)
            }
            helper::MEMSET => {
                let (dst, byte, len) = (a[0], a[1] as u8, a[2]);
                if len > helper::MAX_LEN || !self.mem.allows(dst, len, true) {
                    return Value(helper::ERR_FAULT);
                }
                // SAFETY: the range was checked against the memory map as writable.
                unsafe { std::ptr::write_bytes(dst as *mut u8, byte, len as usize) };
                Value(0)
            }
            helper::MEMCMP => {
                let (x, y, len) = (a[0], a[1], a[2]);
                match (self.slice(x, len), self.slice(y, len)) {
                    (Some(p), Some(q)) => Value(match p.cmp(q) {
                        std::cmp::Ordering::Equal => helper::CMP_EQUAL,
                        std::cmp::Ordering::Less => helper::CMP_LESS,
                        std::cmp::Ordering::Greater => helper::CMP_GREATER,
                    }),
                    _ => Value(helper::ERR_FAULT),
                }
            }
            helper::HASH64 => match self.slice(a[0], a[1]) {
                Some(bytes) => Value(hash64(bytes, a[2])),
                None => Value(helper::ERR_FAULT),
            },
            _ => HelperResult::Unknown,
        }
    }

    fn slice(&self, addr: u64, len: u64) -> Option<&[u8]> {
        if len > helper::MAX_LEN || !self.mem.allows(addr, len, false) {
            return None;
        }
        // SAFETY: the range is readable memory of this invocation, alive for its duration.
        Some(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) })
    }
}

thread_local! {
    static CURRENT: Cell<*mut HelperState> = const { Cell::new(std::ptr::null_mut()) };
}

/// Makes `state` the helper state of JIT-compiled code on this thread until the guard drops.
pub(crate) struct CurrentGuard {
    previous: *mut HelperState,
}

impl CurrentGuard {
    pub(crate) fn install(state: &mut HelperState) -> CurrentGuard {
        let previous = CURRENT.with(|c| c.replace(state as *mut HelperState));
        CurrentGuard { previous }
    }
}

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// Runs helper `id` for JIT-compiled code, against the thread's current state.
fn jit_dispatch(id: u32, a: [u64; 5]) -> u64 {
    CURRENT.with(|cur| {
        let p = cur.get();
        if p.is_null() {
            return helper::ERR_FAULT;
        }
        // SAFETY: set by `CurrentGuard` to a state that outlives the JIT call on this thread.
        let state = unsafe { &mut *p };
        match state.call(id, a) {
            HelperResult::Value(v) => v,
            HelperResult::Abort(_) => helper::ABORT_R0,
            HelperResult::Unknown => helper::ERR_FAULT,
        }
    })
}

/// rbpf's JIT calls helpers with the SysV argument registers but with the stack 8 bytes off the
/// 16-byte alignment the ABI requires, so helpers that spill SSE values or allocate would fault.
/// Each helper is therefore entered through a naked trampoline that realigns the stack and then
/// calls the real (SysV) function.
macro_rules! jit_helpers {
    ($($id:path => $tramp:ident, $body:ident;)*) => {
        $(
            extern "sysv64" fn $body(a: u64, b: u64, c: u64, d: u64, e: u64) -> u64 {
                jit_dispatch($id, [a, b, c, d, e])
            }

            #[unsafe(naked)]
            extern "sysv64" fn $tramp(_a: u64, _b: u64, _c: u64, _d: u64, _e: u64) -> u64 {
                core::arch::naked_asm!(
                    "push rbp",
                    "mov rbp, rsp",
                    "and rsp, -16",
                    "call {body}",
                    "mov rsp, rbp",
                    "pop rbp",
                    "ret",
                    body = sym $body,
                )
            }
        )*

        /// rbpf helper table: (id, trampoline) for every helper.
        pub(crate) fn jit_table() -> Vec<(u32, rbpf::Helper)> {
            vec![$(
                (
                    $id,
                    // SAFETY: rbpf's JIT calls helpers with the SysV convention (rdi, rsi, rdx,
                    // rcx, r8 -> rax), which is the trampoline's declared ABI; rbpf's own
                    // interpreter, which would use the Rust ABI, is never given this table.
                    unsafe {
                        std::mem::transmute::<extern "sysv64" fn(u64, u64, u64, u64, u64) -> u64, rbpf::Helper>(
                            $tramp,
                        )
                    },
                ),
            )*]
        }
    };
}

#[cfg(target_arch = "x86_64")]
jit_helpers! {
    helper::ABORT => tramp_abort, jit_abort;
    helper::TRACE => tramp_trace, jit_trace;
    helper::MEMCPY => tramp_memcpy, jit_memcpy;
    helper::MEMCMP => tramp_memcmp, jit_memcmp;
    helper::HASH64 => tramp_hash64, jit_hash64;
    helper::MEMSET => tramp_memset, jit_memset;
}

/// rbpf's JIT emits x86_64 only: elsewhere there is no JIT and no helper table.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn jit_table() -> Vec<(u32, rbpf::Helper)> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_is_exact() {
        let buf = [0u8; 16];
        let mut m = MemoryMap::default();
        m.add(buf.as_ptr() as u64, 16, false);
        let a = buf.as_ptr() as u64;
        assert!(m.allows(a, 16, false));
        assert!(m.allows(a + 8, 8, false));
        assert!(
            !m.allows(a + 9, 8, false),
            "an access may not run past the end"
        );
        assert!(!m.allows(a, 1, true), "read-only");
        assert!(!m.allows(u64::MAX, 2, false));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_helper_has_a_jit_trampoline() {
        let ids: Vec<u32> = jit_table().iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, helper::ALL);
    }

    #[test]
    fn memcpy_checks_both_ranges() {
        let src = [7u8; 8];
        let mut dst = [0u8; 8];
        let mut s = HelperState::default();
        s.mem.add(src.as_ptr() as u64, 8, false);
        s.mem.add(dst.as_mut_ptr() as u64, 8, true);
        let (d, r) = (dst.as_mut_ptr() as u64, src.as_ptr() as u64);
        assert_eq!(
            s.call(helper::MEMCPY, [d, r, 8, 0, 0]),
            HelperResult::Value(0)
        );
        assert_eq!(dst, [7u8; 8]);
        assert_eq!(
            s.call(helper::MEMCPY, [r, d, 8, 0, 0]),
            HelperResult::Value(helper::ERR_FAULT)
        );
        assert_eq!(
            s.call(helper::MEMCPY, [d, r, 9, 0, 0]),
            HelperResult::Value(helper::ERR_FAULT)
        );
        assert_eq!(s.call(99, [0; 5]), HelperResult::Unknown);
    }
}
