//! Helper functions handlers call with `call <id>`, and the helper sets an executable can be
//! built against.
//!
//! Every helper is an `extern "C"` function of the [`VmCtx`] and five argument registers
//! ([`HelperFn`]), so the interpreter and JIT-compiled code call the very same functions
//! through the context's helper table. Memory helpers check every range against the grants
//! ([`VmCtx::allows_range`]) and return [`helper::ERR_FAULT`] instead of touching memory the
//! handler may not use; the abort helper records a fault that ends the invocation.

use std::collections::BTreeSet;

use naam_ebpf::abi::helper;
use naam_ebpf::hash::hash64;

use crate::memory::{fault, HelperFn, VmCtx, HELPER_SLOTS, TRACE_CAP};

/// One helper: its id, name, entry point and what the pointer analysis must assume of it.
#[derive(Clone, Copy, Debug)]
pub struct Helper {
    /// The id handlers call it by.
    pub id: u32,
    /// Name, for reports.
    pub name: &'static str,
    /// Entry point, called with the context, then `r1` to `r5` ([`HelperFn`]).
    pub func: HelperFn,
    /// What it may store into, which the pointer analysis must assume changed.
    pub writes: HelperWrites,
}

/// What memory a helper may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HelperWrites {
    /// None.
    Nothing,
    /// Only `[r1, r1 + len)`, a range it checks lies inside one writable grant: when `r1`
    /// lies inside a grant other than the stack, the stack is untouched (no grant overlaps
    /// the stack); otherwise the stack may have changed.
    AtR1,
}

/// Which helpers an executable may call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HelperSet {
    /// The NAAM handler ABI ([`naam_ebpf::abi::helper`]).
    #[default]
    Naam,
    /// The public eBPF conformance suite's single helper: id 5, which returns its argument.
    Conformance,
}

/// The conformance suite's helper id.
pub(crate) const CONFORMANCE_UNWIND: u32 = 5;

const NAAM: [Helper; 6] = [
    Helper {
        id: helper::ABORT,
        name: "abort",
        func: abort,
        writes: HelperWrites::Nothing,
    },
    Helper {
        id: helper::TRACE,
        name: "trace",
        func: trace,
        writes: HelperWrites::Nothing,
    },
    Helper {
        id: helper::MEMCPY,
        name: "memcpy",
        func: memcpy,
        writes: HelperWrites::AtR1,
    },
    Helper {
        id: helper::MEMCMP,
        name: "memcmp",
        func: memcmp,
        writes: HelperWrites::Nothing,
    },
    Helper {
        id: helper::HASH64,
        name: "hash64",
        func: hash,
        writes: HelperWrites::Nothing,
    },
    Helper {
        id: helper::MEMSET,
        name: "memset",
        func: memset,
        writes: HelperWrites::AtR1,
    },
];

const CONFORMANCE: [Helper; 1] = [Helper {
    id: CONFORMANCE_UNWIND,
    name: "unwind",
    func: unwind,
    writes: HelperWrites::Nothing,
}];

impl HelperSet {
    /// The helpers of the set.
    pub fn helpers(self) -> &'static [Helper] {
        match self {
            HelperSet::Naam => &NAAM,
            HelperSet::Conformance => &CONFORMANCE,
        }
    }

    /// The helper with `id`, if the set has it.
    pub fn get(self, id: u32) -> Option<&'static Helper> {
        self.helpers().iter().find(|h| h.id == id)
    }

    /// Every id of the set.
    pub fn ids(self) -> BTreeSet<u32> {
        self.helpers().iter().map(|h| h.id).collect()
    }

    /// The helper table for a [`VmCtx`], holding only the ids in `allowed`.
    pub fn table(self, allowed: &BTreeSet<u32>) -> [u64; HELPER_SLOTS] {
        let mut t = [0u64; HELPER_SLOTS];
        for h in self.helpers() {
            if let Some(slot) = t.get_mut(h.id as usize) {
                if allowed.contains(&h.id) {
                    *slot = h.func as usize as u64;
                }
            }
        }
        t
    }
}

/// # Safety (all helpers)
/// Called by the engines with the context of the running invocation, alive for the call.
fn ctx<'a>(p: *mut VmCtx) -> &'a mut VmCtx {
    // SAFETY: see above; engines never pass anything else.
    unsafe { &mut *p }
}

extern "C" fn abort(c: *mut VmCtx, code: u64, _: u64, _: u64, _: u64, _: u64) -> u64 {
    ctx(c).set_fault(fault::ABORT, 0, code, 0);
    helper::ABORT_R0
}

extern "C" fn trace(c: *mut VmCtx, value: u64, _: u64, _: u64, _: u64, _: u64) -> u64 {
    let c = ctx(c);
    if (c.trace_len as usize) < TRACE_CAP {
        c.trace[c.trace_len as usize] = value;
        c.trace_len += 1;
    }
    0
}

extern "C" fn memcpy(c: *mut VmCtx, dst: u64, src: u64, len: u64, _: u64, _: u64) -> u64 {
    let c = ctx(c);
    if len > helper::MAX_LEN || !c.allows_range(src, len, false) || !c.allows_range(dst, len, true)
    {
        return helper::ERR_FAULT;
    }
    if len > 0 {
        // SAFETY: both ranges are granted to this invocation (the destination writable);
        // `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
    }
    0
}

extern "C" fn memset(c: *mut VmCtx, dst: u64, byte: u64, len: u64, _: u64, _: u64) -> u64 {
    let c = ctx(c);
    if len > helper::MAX_LEN || !c.allows_range(dst, len, true) {
        return helper::ERR_FAULT;
    }
    if len > 0 {
        // SAFETY: the range is granted to this invocation as writable.
        unsafe { std::ptr::write_bytes(dst as *mut u8, byte as u8, len as usize) };
    }
    0
}

fn readable<'a>(c: &VmCtx, addr: u64, len: u64) -> Option<&'a [u8]> {
    if len > helper::MAX_LEN || !c.allows_range(addr, len, false) {
        return None;
    }
    if len == 0 {
        return Some(&[]);
    }
    // SAFETY: the range is granted to this invocation as readable, alive for the call.
    Some(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) })
}

extern "C" fn memcmp(c: *mut VmCtx, a: u64, b: u64, len: u64, _: u64, _: u64) -> u64 {
    let c = ctx(c);
    match (readable(c, a, len), readable(c, b, len)) {
        (Some(p), Some(q)) => match p.cmp(q) {
            std::cmp::Ordering::Equal => helper::CMP_EQUAL,
            std::cmp::Ordering::Less => helper::CMP_LESS,
            std::cmp::Ordering::Greater => helper::CMP_GREATER,
        },
        _ => helper::ERR_FAULT,
    }
}

extern "C" fn hash(c: *mut VmCtx, ptr: u64, len: u64, seed: u64, _: u64, _: u64) -> u64 {
    match readable(ctx(c), ptr, len) {
        Some(bytes) => hash64(bytes, seed),
        None => helper::ERR_FAULT,
    }
}

extern "C" fn unwind(_: *mut VmCtx, value: u64, _: u64, _: u64, _: u64, _: u64) -> u64 {
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{slot, GrantSlot};

    fn call(c: &mut VmCtx, id: u32, a: [u64; 3]) -> u64 {
        let f = HelperSet::Naam.get(id).unwrap().func;
        f(c, a[0], a[1], a[2], 0, 0)
    }

    #[test]
    fn memcpy_checks_both_ranges() {
        let src = [7u8; 8];
        let mut dst = [0u8; 8];
        let mut c = VmCtx::default();
        c.grants[slot::SEGMENT] = GrantSlot::new(src.as_ptr() as u64, 8, false);
        c.grants[slot::SEGMENT + 1] = GrantSlot::new(dst.as_mut_ptr() as u64, 8, true);
        let (d, r) = (dst.as_mut_ptr() as u64, src.as_ptr() as u64);
        assert_eq!(call(&mut c, helper::MEMCPY, [d, r, 8]), 0);
        assert_eq!(dst, [7u8; 8]);
        assert_eq!(
            call(&mut c, helper::MEMCPY, [r, d, 8]),
            helper::ERR_FAULT,
            "read-only destination"
        );
        assert_eq!(
            call(&mut c, helper::MEMCPY, [d, r, 9]),
            helper::ERR_FAULT,
            "past the end"
        );
    }

    #[test]
    fn abort_records_a_fault_and_trace_is_bounded() {
        let mut c = VmCtx::default();
        call(&mut c, helper::ABORT, [9, 0, 0]);
        assert_eq!((c.fault.kind, c.fault.addr), (fault::ABORT, 9));
        for i in 0..(TRACE_CAP as u64 + 5) {
            call(&mut c, helper::TRACE, [i, 0, 0]);
        }
        assert_eq!(c.trace_len as usize, TRACE_CAP);
    }

    #[test]
    fn tables_hold_allowed_ids_only() {
        let all = HelperSet::Naam.ids();
        assert_eq!(all.iter().copied().collect::<Vec<_>>(), helper::ALL);
        let t = HelperSet::Naam.table(&[helper::TRACE].into_iter().collect());
        assert_ne!(t[helper::TRACE as usize], 0);
        assert_eq!(t[helper::MEMCPY as usize], 0);
        assert_eq!(
            HelperSet::Conformance.ids().into_iter().collect::<Vec<_>>(),
            [5]
        );
    }
}
