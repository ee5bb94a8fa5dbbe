//! Pointer analysis: for every load, store and atomic operation, either a proof that it stays
//! inside one grant with the right it needs ([`Check::Proven`]: engines skip the check), or a
//! guess of the grant it most likely targets ([`Check::Hint`]: engines compare against that
//! grant first and scan the others only when it misses), or nothing ([`Check::Scan`]).
//!
//! It is an abstract interpretation over each function's control-flow graph, joined across
//! call sites. Values are constants, pointers into the current stack frame with a known or
//! unknown offset, pointers into a grant slot, or the length of a grant. A pointer's base is
//! *proven* only when it comes from something the engines guarantee: `r1` on entry (the entry
//! memory), `r10` (the frame), an `lddw` the loader resolved into read-only data, or a segment
//! address or length loaded from the context's read-only segment table (which the runtime
//! fills from the grants themselves, and which no handler can write). Conditional jumps that
//! compare a segment's length with a constant teach a minimum length on each edge (the SDK's
//! own bounds checks do exactly that), which proves constant-offset reads of the segment.
//! Stack slots keep values across spills, and every store the analysis cannot place forgets
//! them, as do calls and helpers that may write the stack (a copy whose destination is
//! proven inside another grant does not).
//!
//! Soundness matters only for `Proven`: hints and scans never change what an access does, only
//! how fast the engines find its grant.

use std::collections::VecDeque;

use naam_ebpf::abi::{MAX_SEGMENTS, STACK_SIZE};

use crate::helpers::{HelperSet, HelperWrites};
use crate::insn::{AluOp, Cond, Op, Operand, Width, FRAME_POINTER};
use crate::loader::Program;
use crate::memory::slot;
use crate::semantics;
use crate::verifier::Checked;

/// How an engine checks one memory access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Statically inside its grant with the needed right: no check.
    Proven,
    /// Check the grant in this slot first, then the others.
    Hint(u8),
    /// No idea: check every grant.
    Scan,
}

/// What the engines guarantee about the memory `r1` points at on entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EntryAssumptions {
    /// Its length, when known at compile time (a handler's context).
    pub len: Option<u64>,
    /// Where its writable part (slot [`slot::ENTRY_OUT`]) begins; the bytes before are
    /// read-only (slot [`slot::ENTRY`]). `None`: all of it is one writable grant (raw runs).
    pub output_at: Option<u64>,
    /// 8-byte fields of the read-only part that hold the start of another grant (a handler
    /// context's segment addresses).
    pub pointer_fields: Vec<(u64, usize)>,
    /// 4-byte fields of the read-only part that hold the length of another grant (a handler
    /// context's segment lengths).
    pub length_fields: Vec<(u64, usize)>,
}

impl EntryAssumptions {
    /// A NAAM handler step: `r1` is the [`naam_ebpf::abi::Context`], whose input part
    /// (header, segment table, args) is read-only.
    pub fn handler_context() -> EntryAssumptions {
        use naam_ebpf::abi::{Context, Segment, CONTEXT_INPUT_SIZE, CONTEXT_SIZE};
        use std::mem::{offset_of, size_of};
        let field = |f: usize, i: usize| {
            (offset_of!(Context, segments) + i * size_of::<Segment>() + f) as u64
        };
        EntryAssumptions {
            len: Some(CONTEXT_SIZE as u64),
            output_at: Some(CONTEXT_INPUT_SIZE as u64),
            pointer_fields: (0..MAX_SEGMENTS)
                .map(|i| (field(offset_of!(Segment, addr), i), slot::SEGMENT + i))
                .collect(),
            length_fields: (0..MAX_SEGMENTS)
                .map(|i| (field(offset_of!(Segment, len), i), slot::SEGMENT + i))
                .collect(),
        }
    }

    /// A raw run (the conformance suite): `r1` points at memory of a run-time length.
    pub fn raw_memory() -> EntryAssumptions {
        EntryAssumptions::default()
    }
}

/// What the pointer analysis decided for every memory access: proven, hinted at a grant
/// slot, or left to a scan of every grant.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// Per slot: how to check the access there (`Scan` for slots without one).
    pub checks: Vec<Check>,
    /// Accesses proven inside their grant, which run with no check.
    pub proven: usize,
    /// Accesses with a hint.
    pub hinted: usize,
    /// Accesses with neither.
    pub scanned: usize,
    /// The helpers the program was analysed against (what a helper id means).
    pub helpers: HelperSet,
}

impl Facts {
    /// The check for the access at `pc`.
    pub fn check(&self, pc: usize) -> Check {
        self.checks.get(pc).copied().unwrap_or(Check::Scan)
    }

    /// Facts of `checked` before any analysis: every access scans the grants (what a tiered
    /// handler's interpreter runs with until the background analysis is done; correct for any
    /// verified program, only slower).
    pub fn unanalysed(checked: &Checked, helpers: HelperSet) -> Facts {
        let scanned = checked
            .ops
            .iter()
            .filter(|op| {
                matches!(
                    op,
                    Some(Op::Load { .. } | Op::Store { .. } | Op::Atomic { .. })
                )
            })
            .count();
        Facts {
            checks: Vec::new(),
            proven: 0,
            hinted: 0,
            scanned,
            helpers,
        }
    }
}

/// Abstract value of a register or a stack slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    Unknown,
    Const(u64),
    /// `r10` of the current function plus an offset.
    Frame(Option<i64>),
    /// An address inside grant `slot` plus an offset (from the slot's start).
    Ptr {
        slot: u8,
        off: Option<i64>,
        proven: bool,
    },
    /// Exactly the length of grant `slot` (below 2^32).
    Len(u8),
}

impl Val {
    fn join(self, other: Val) -> Val {
        use Val::*;
        if self == other {
            return self;
        }
        match (self, other) {
            (Frame(_), Frame(_)) => Frame(None),
            (
                Ptr {
                    slot: a,
                    off: x,
                    proven: p,
                },
                Ptr {
                    slot: b,
                    off: y,
                    proven: q,
                },
            ) if a == b => Ptr {
                slot: a,
                off: if x == y { x } else { None },
                proven: p && q,
            },
            _ => Unknown,
        }
    }

    /// The value plus a constant.
    fn offset(self, c: i64) -> Val {
        match self {
            Val::Const(v) => Val::Const(v.wrapping_add(c as u64)),
            // Offsets this far from the frame are never proven anything: bounding them keeps
            // every later addition exact (an offset near 2^63 once wrapped into a proof).
            Val::Frame(o) => Val::Frame(
                o.and_then(|o| o.checked_add(c))
                    .filter(|o| o.unsigned_abs() <= FRAME_OFFSET_BOUND),
            ),
            Val::Ptr { slot, off, proven } => Val::Ptr {
                slot,
                off: off.and_then(|o| o.checked_add(c)),
                proven,
            },
            Val::Unknown | Val::Len(_) => Val::Unknown,
        }
    }

    /// The value plus something unknown (keeps the base as a hint).
    fn smear(self) -> Val {
        match self {
            Val::Frame(_) => Val::Frame(None),
            Val::Ptr { slot, proven, .. } => Val::Ptr {
                slot,
                off: None,
                proven,
            },
            _ => Val::Unknown,
        }
    }

    /// As seen from another function: a frame pointer becomes a stack hint.
    fn across_call(self) -> Val {
        match self {
            Val::Frame(_) => Val::Ptr {
                slot: slot::STACK as u8,
                off: None,
                proven: false,
            },
            v => v,
        }
    }
}

const FRAME_SLOTS: usize = STACK_SIZE / 8;

/// The largest frame offset the analysis tracks exactly; beyond it a frame pointer's offset is
/// unknown (it still hints the stack).
const FRAME_OFFSET_BOUND: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
struct State {
    regs: [Val; 11],
    slots: [Val; FRAME_SLOTS],
    /// Known minimum length of each segment, learned from comparisons.
    min_len: [u64; MAX_SEGMENTS],
}

impl State {
    fn function_entry(args: [Val; 5]) -> State {
        let mut regs = [Val::Const(0); 11];
        regs[1..6].copy_from_slice(&args);
        regs[FRAME_POINTER as usize] = Val::Frame(Some(0));
        State {
            regs,
            slots: [Val::Unknown; FRAME_SLOTS],
            min_len: [0; MAX_SEGMENTS],
        }
    }

    /// Joins `other` in; true when something changed.
    fn join_from(&mut self, other: &State) -> bool {
        let mut changed = false;
        for (a, b) in self
            .regs
            .iter_mut()
            .chain(self.slots.iter_mut())
            .zip(other.regs.iter().chain(other.slots.iter()))
        {
            let j = a.join(*b);
            if j != *a {
                *a = j;
                changed = true;
            }
        }
        for (a, b) in self.min_len.iter_mut().zip(other.min_len) {
            if b < *a {
                *a = b;
                changed = true;
            }
        }
        changed
    }

    /// What a conditional jump teaches about segment lengths on one of its edges.
    fn refine(&mut self, cond: Cond, a: Val, b: Val, taken: bool) {
        // Normalise to `Len(slot) <rel> c`.
        let (slot, c, rel) = match (a, b) {
            (Val::Len(s), Val::Const(c)) => (s, c, cond),
            (Val::Const(c), Val::Len(s)) => (
                s,
                c,
                match cond {
                    Cond::Lt => Cond::Gt,
                    Cond::Le => Cond::Ge,
                    Cond::Gt => Cond::Lt,
                    Cond::Ge => Cond::Le,
                    other => other,
                },
            ),
            _ => return,
        };
        let rel = if taken {
            rel
        } else {
            match rel {
                Cond::Lt => Cond::Ge,
                Cond::Le => Cond::Gt,
                Cond::Gt => Cond::Le,
                Cond::Ge => Cond::Lt,
                Cond::Eq => Cond::Ne,
                Cond::Ne => Cond::Eq,
                _ => return,
            }
        };
        let at_least = match rel {
            Cond::Ge | Cond::Eq => c,
            Cond::Gt => c.saturating_add(1),
            _ => return,
        };
        let Some(k) = (slot as usize)
            .checked_sub(slot::SEGMENT)
            .filter(|&k| k < MAX_SEGMENTS)
        else {
            return;
        };
        self.min_len[k] = self.min_len[k].max(at_least);
    }

    fn forget_stack(&mut self) {
        self.slots = [Val::Unknown; FRAME_SLOTS];
    }
}

/// A value as a 32-bit comparison sees it (lengths are below 2^32 already).
fn truncate32(v: Val) -> Val {
    match v {
        Val::Const(c) => Val::Const(c as u32 as u64),
        Val::Len(_) => v,
        _ => Val::Unknown,
    }
}

/// The frame slot holding bytes `[k, k + 8)` relative to `r10`, when `k` is an aligned
/// in-frame offset.
fn frame_slot(k: i64) -> Option<usize> {
    (k >= -(STACK_SIZE as i64) && k <= -8 && k % 8 == 0)
        .then(|| ((k + STACK_SIZE as i64) / 8) as usize)
}

struct Analyzer<'a> {
    checked: &'a Checked,
    program: &'a Program,
    entry: &'a EntryAssumptions,
    helpers: HelperSet,
}

impl Analyzer<'_> {
    fn operand(&self, s: &State, v: Operand) -> Val {
        match v {
            Operand::Reg(r) => s.regs[r as usize],
            Operand::Imm(i) => Val::Const(semantics::imm64(i)),
        }
    }

    /// Static extent and writability of a grant slot other than the entry memory, when known
    /// at compile time.
    fn extent(&self, s: &State, slot_index: u8) -> Option<(u64, bool)> {
        let k = slot_index as usize;
        if k >= slot::RODATA {
            return self
                .program
                .rodata
                .get(k - slot::RODATA)
                .map(|r| (r.len() as u64, false));
        }
        if (slot::SEGMENT..slot::SEGMENT + MAX_SEGMENTS).contains(&k) {
            // Long enough, as comparisons showed; the write right is only known at run time.
            return Some((s.min_len[k - slot::SEGMENT], false));
        }
        None
    }

    /// How to check an access of `size` bytes at offset `k` of the entry memory.
    fn decide_entry(&self, k: Option<i64>, size: u8, write: bool) -> Check {
        let (Some(k), Some(len)) = (k, self.entry.len) else {
            return Check::Hint(self.entry_hint(k, write));
        };
        let end = k.checked_add(size as i64);
        let inside = |from: i64, to: u64| k >= from && end.is_some_and(|e| e <= to as i64);
        match self.entry.output_at {
            Some(split) if inside(split as i64, len) => Check::Proven,
            Some(split) if inside(0, split) && !write => Check::Proven,
            None if inside(0, len) => Check::Proven,
            _ => Check::Hint(self.entry_hint(Some(k), write)),
        }
    }

    /// The entry slot an unproven access most likely targets.
    fn entry_hint(&self, k: Option<i64>, write: bool) -> u8 {
        match (self.entry.output_at, k) {
            (None, _) => slot::ENTRY as u8,
            (Some(split), Some(k)) if k >= split as i64 => slot::ENTRY_OUT as u8,
            (Some(_), Some(_)) => slot::ENTRY as u8,
            (Some(_), None) if write => slot::ENTRY_OUT as u8,
            (Some(_), None) => slot::ENTRY as u8,
        }
    }

    /// Whether `addr` is proven to lie inside a writable grant other than the stack: a range
    /// that starts there and lies inside one grant (as every memory helper checks) then
    /// cannot touch the stack, which no other grant overlaps.
    fn outside_stack(&self, s: &State, addr: Val) -> bool {
        matches!(addr, Val::Ptr { slot, .. } if slot != slot::STACK as u8)
            && self.decide(s, addr, 0, 1, true) == Check::Proven
    }

    /// How to check an access of `size` bytes at `base + off`.
    fn decide(&self, s: &State, base: Val, off: i16, size: u8, write: bool) -> Check {
        let off = off as i64;
        match base {
            Val::Frame(Some(o)) => {
                let inside = o.checked_add(off).is_some_and(|k| {
                    k >= -(STACK_SIZE as i64) && k.checked_add(size as i64).is_some_and(|e| e <= 0)
                });
                if inside {
                    Check::Proven
                } else {
                    Check::Hint(slot::STACK as u8)
                }
            }
            Val::Frame(None) => Check::Hint(slot::STACK as u8),
            Val::Ptr {
                slot: 0,
                off: o,
                proven: true,
            } => self.decide_entry(o.and_then(|o| o.checked_add(off)), size, write),
            Val::Ptr { slot: 0, .. } => Check::Hint(self.entry_hint(None, write)),
            Val::Ptr {
                slot: sl,
                off: Some(o),
                proven: true,
            } => match self.extent(s, sl) {
                Some((len, writable))
                    if o.checked_add(off).is_some_and(|k| {
                        k >= 0
                            && (k as u64)
                                .checked_add(size as u64)
                                .is_some_and(|e| e <= len)
                    }) && (writable || !write) =>
                {
                    Check::Proven
                }
                _ => Check::Hint(sl),
            },
            Val::Ptr { slot: sl, .. } => Check::Hint(sl),
            Val::Const(_) | Val::Unknown | Val::Len(_) => Check::Scan,
        }
    }

    /// What a load of `size` bytes at offset `k` of the entry memory yields: the start or the
    /// length of a grant when it reads one of the read-only part's pointer or length fields
    /// (trustworthy: the runtime writes them from the grants and the handler cannot).
    fn entry_field(&self, k: i64, size: u8) -> Val {
        let read_only = self
            .entry
            .output_at
            .is_some_and(|split| k >= 0 && k + size as i64 <= split as i64);
        if !read_only {
            return Val::Unknown;
        }
        let find = |fields: &[(u64, usize)]| {
            fields
                .iter()
                .find(|&&(field, _)| field as i64 == k)
                .map(|&(_, target)| target as u8)
        };
        match size {
            8 => find(&self.entry.pointer_fields).map_or(Val::Unknown, |target| Val::Ptr {
                slot: target,
                off: Some(0),
                proven: true,
            }),
            4 => find(&self.entry.length_fields).map_or(Val::Unknown, Val::Len),
            _ => Val::Unknown,
        }
    }

    /// Effect of a store of `size` bytes at `base + off` on the tracked stack.
    fn store_effect(&self, s: &mut State, base: Val, off: i16, size: u8, value: Val) {
        match base {
            Val::Frame(Some(o)) => {
                // Offsets are bounded (`FRAME_OFFSET_BOUND`), so this arithmetic is exact.
                let k = o + off as i64;
                if size == 8 {
                    if let Some(i) = frame_slot(k) {
                        s.slots[i] = value;
                        return;
                    }
                }
                // A partial store: forget every slot it overlaps. Outside the frame it cannot
                // touch this function's slots.
                let first = k.div_euclid(8);
                let last = (k + size as i64 - 1).div_euclid(8);
                for w in first..=last {
                    if let Some(i) = frame_slot(w * 8) {
                        s.slots[i] = Val::Unknown;
                    }
                }
            }
            _ => {
                if self.decide(s, base, off, size, true) != Check::Proven {
                    // A checked store may land anywhere granted, the stack included.
                    s.forget_stack();
                }
            }
        }
    }

    /// Applies the instruction at `pc` to `s`; returns the callee's argument state for local
    /// calls, and records the check decision in `checks` when given.
    fn step(&self, pc: usize, op: Op, s: &mut State, mut checks: Option<&mut Vec<Check>>) {
        let mut record = |c: Check| {
            if let Some(v) = checks.as_deref_mut() {
                v[pc] = c;
            }
        };
        match op {
            Op::Alu {
                width,
                op: alu,
                dst,
                src,
            } => {
                let a = s.regs[dst as usize];
                let b = self.operand(s, src);
                s.regs[dst as usize] = match (width, alu, a, b) {
                    (_, _, Val::Const(x), Val::Const(y)) => {
                        Val::Const(semantics::alu(width, alu, x, y))
                    }
                    (Width::W64, AluOp::Add, p, Val::Const(c))
                    | (Width::W64, AluOp::Add, Val::Const(c), p) => p.offset(c as i64),
                    (Width::W64, AluOp::Sub, p, Val::Const(c)) => {
                        p.offset((c as i64).wrapping_neg())
                    }
                    (Width::W64, AluOp::Add, p @ (Val::Frame(_) | Val::Ptr { .. }), _)
                    | (Width::W64, AluOp::Add, _, p @ (Val::Frame(_) | Val::Ptr { .. }))
                    | (
                        Width::W64,
                        AluOp::Sub,
                        p @ (Val::Frame(_) | Val::Ptr { .. }),
                        Val::Unknown,
                    ) => p.smear(),
                    _ => Val::Unknown,
                };
            }
            Op::Neg { width, dst } => {
                s.regs[dst as usize] = match s.regs[dst as usize] {
                    Val::Const(x) => Val::Const(semantics::neg(width, x)),
                    _ => Val::Unknown,
                }
            }
            Op::Mov { width, dst, src } => {
                let v = self.operand(s, src);
                s.regs[dst as usize] = match (width, v) {
                    (Width::W64, v) => v,
                    (Width::W32, Val::Const(x)) => Val::Const(semantics::mov(width, x)),
                    // A length is below 2^32: zero-extending it changes nothing.
                    (Width::W32, v @ Val::Len(_)) => v,
                    _ => Val::Unknown,
                };
            }
            Op::MovSx {
                width,
                dst,
                src,
                bits,
            } => {
                s.regs[dst as usize] = match s.regs[src as usize] {
                    Val::Const(x) => Val::Const(semantics::movsx(width, bits, x)),
                    _ => Val::Unknown,
                }
            }
            Op::End { dst, bits, swap } => {
                s.regs[dst as usize] = match s.regs[dst as usize] {
                    Val::Const(x) => Val::Const(semantics::end(bits, swap, x)),
                    _ => Val::Unknown,
                }
            }
            Op::Lddw { dst, imm } => {
                let r = self
                    .program
                    .rodata_refs
                    .binary_search_by_key(&pc, |r| r.pc)
                    .ok()
                    .map(|k| self.program.rodata_refs[k]);
                s.regs[dst as usize] = match r {
                    Some(r) => Val::Ptr {
                        slot: (slot::RODATA + r.index) as u8,
                        off: Some(r.offset as i64),
                        proven: true,
                    },
                    None => Val::Const(imm),
                };
            }
            Op::Load {
                dst,
                base,
                off,
                size,
                signed,
            } => {
                let b = s.regs[base as usize];
                record(self.decide(s, b, off, size, false));
                let v = match (b.offset(off as i64), size, signed) {
                    (Val::Frame(Some(k)), 8, false) => {
                        frame_slot(k).map_or(Val::Unknown, |i| s.slots[i])
                    }
                    (
                        Val::Ptr {
                            slot: 0,
                            off: Some(k),
                            proven: true,
                        },
                        8 | 4,
                        false,
                    ) => self.entry_field(k, size),
                    _ => Val::Unknown,
                };
                s.regs[dst as usize] = v;
            }
            Op::Store {
                base,
                off,
                size,
                value,
            } => {
                let b = s.regs[base as usize];
                record(self.decide(s, b, off, size, true));
                let v = self.operand(s, value);
                self.store_effect(s, b, off, size, if size == 8 { v } else { Val::Unknown });
            }
            Op::Atomic {
                base,
                off,
                size,
                op,
                fetch,
                src,
            } => {
                let b = s.regs[base as usize];
                record(self.decide(s, b, off, size, true));
                self.store_effect(s, b, off, size, Val::Unknown);
                if fetch {
                    let r = if op == crate::insn::AtomicOp::Cmpxchg {
                        0
                    } else {
                        src
                    };
                    s.regs[r as usize] = Val::Unknown;
                }
            }
            Op::CallHelper { id } => {
                let reaches_stack = match self.helpers.get(id).map(|h| h.writes) {
                    Some(HelperWrites::Nothing) => false,
                    // A copy into the context's output or a segment keeps the spills.
                    Some(HelperWrites::AtR1) => !self.outside_stack(s, s.regs[1]),
                    _ => true,
                };
                s.regs[0] = Val::Unknown;
                if reaches_stack {
                    s.forget_stack();
                }
            }
            Op::CallReg { .. } => {
                s.regs[0] = Val::Unknown;
                s.forget_stack();
            }
            Op::CallLocal { .. } => {
                s.regs[0] = Val::Unknown;
                for r in 1..=5 {
                    s.regs[r] = Val::Const(0);
                }
                s.forget_stack();
            }
            Op::Ja { .. } | Op::Jump { .. } | Op::Exit => {}
        }
    }
}

/// Runs the analysis over a verified program.
pub fn analyze(
    checked: &Checked,
    program: &Program,
    entry: &EntryAssumptions,
    helpers: HelperSet,
) -> Facts {
    let a = Analyzer {
        checked,
        program,
        entry,
        helpers,
    };
    let nf = checked.functions.len();
    let mut entry_states: Vec<Option<State>> = vec![None; nf];
    let r1 = Val::Ptr {
        slot: slot::ENTRY as u8,
        off: Some(0),
        proven: true,
    };
    let r2 = entry.len.map_or(Val::Unknown, Val::Const);
    entry_states[0] = Some(State::function_entry([
        r1,
        r2,
        Val::Const(0),
        Val::Const(0),
        Val::Const(0),
    ]));
    // Functions nobody calls are still compiled: assume nothing of their arguments.
    let called: std::collections::BTreeSet<usize> = checked
        .ops
        .iter()
        .filter_map(|op| match op {
            Some(Op::CallLocal { target }) => checked.function_at(*target as usize),
            _ => None,
        })
        .collect();
    for (f, st) in entry_states.iter_mut().enumerate().skip(1) {
        if !called.contains(&f) {
            *st = Some(State::function_entry([Val::Unknown; 5]));
        }
    }

    // Interprocedural fixpoint: analyse dirty functions, push call-site states into callees.
    let mut block_states: Vec<Vec<(usize, State)>> = vec![Vec::new(); nf];
    let mut dirty: VecDeque<usize> = (0..nf).filter(|&f| entry_states[f].is_some()).collect();
    while let Some(f) = dirty.pop_front() {
        let Some(start_state) = entry_states[f].clone() else {
            continue;
        };
        let (states, call_sites) = a.function(f, start_state);
        block_states[f] = states;
        for (callee, args) in call_sites {
            let incoming = State::function_entry(args);
            let changed = match &mut entry_states[callee] {
                Some(st) => st.join_from(&incoming),
                slot @ None => {
                    *slot = Some(incoming);
                    true
                }
            };
            if changed && !dirty.contains(&callee) {
                dirty.push_back(callee);
            }
        }
    }

    // Final pass: record a decision at every memory access.
    let mut checks = vec![Check::Scan; checked.ops.len()];
    for (f, states) in block_states.iter().enumerate() {
        let (_, end) = checked.functions[f];
        let leaders = a.leaders(f);
        for (start, state) in states {
            let mut s = state.clone();
            let mut pc = *start;
            while pc < end {
                let Some(op) = checked.ops[pc] else { break };
                a.step(pc, op, &mut s, Some(&mut checks));
                if op.ends_block() || matches!(op, Op::Jump { .. }) {
                    break;
                }
                pc += op.slots();
                if leaders.binary_search(&pc).is_ok() {
                    break;
                }
            }
        }
    }
    let mut facts = Facts {
        checks,
        helpers: a.helpers,
        ..Facts::default()
    };
    for (pc, op) in checked.ops.iter().enumerate() {
        if matches!(
            op,
            Some(Op::Load { .. } | Op::Store { .. } | Op::Atomic { .. })
        ) {
            match facts.checks[pc] {
                Check::Proven => facts.proven += 1,
                Check::Hint(_) => facts.hinted += 1,
                Check::Scan => facts.scanned += 1,
            }
        }
    }
    facts
}

impl Analyzer<'_> {
    /// Block leaders of function `f`: its start, every jump target, and every slot after a
    /// jump.
    fn leaders(&self, f: usize) -> Vec<usize> {
        let (start, end) = self.checked.functions[f];
        let mut l = vec![start];
        for pc in start..end {
            if let Some(Op::Ja { target } | Op::Jump { target, .. }) = self.checked.ops[pc] {
                l.push(target as usize);
                if pc + 1 < end {
                    l.push(pc + 1);
                }
            }
        }
        l.sort_unstable();
        l.dedup();
        l
    }

    /// Intra-procedural fixpoint from `entry`: the entry state of every reachable block, and
    /// the argument values at every local call (callee index, r1..r5).
    #[allow(clippy::type_complexity)]
    fn function(&self, f: usize, entry: State) -> (Vec<(usize, State)>, Vec<(usize, [Val; 5])>) {
        let end = self.checked.functions[f].1;
        let leaders = self.leaders(f);
        let index = |pc: usize| leaders.binary_search(&pc).ok();
        let mut states: Vec<Option<State>> = vec![None; leaders.len()];
        states[0] = Some(entry);
        let mut work: VecDeque<usize> = VecDeque::from([0]);
        let mut queued = vec![false; leaders.len()];
        queued[0] = true;
        let mut calls: Vec<(usize, [Val; 5])> = Vec::new();
        let mut last_call_args: std::collections::HashMap<usize, [Val; 5]> = Default::default();
        while let Some(b) = work.pop_front() {
            queued[b] = false;
            let Some(mut s) = states[b].clone() else {
                continue;
            };
            let mut pc = leaders[b];
            let mut succ: Vec<(usize, State)> = Vec::new();
            loop {
                if pc >= end {
                    break;
                }
                let Some(op) = self.checked.ops[pc] else {
                    break;
                };
                if let Op::CallLocal { target } = op {
                    if let Some(callee) = self.checked.function_at(target as usize) {
                        let args: [Val; 5] = std::array::from_fn(|i| s.regs[i + 1].across_call());
                        let merged = match last_call_args.get(&pc) {
                            Some(prev) => std::array::from_fn(|i| prev[i].join(args[i])),
                            None => args,
                        };
                        last_call_args.insert(pc, merged);
                        calls.push((callee, merged));
                    }
                }
                self.step(pc, op, &mut s, None);
                match op {
                    Op::Exit => break,
                    Op::Ja { target } => {
                        succ.push((target as usize, s.clone()));
                        break;
                    }
                    Op::Jump {
                        width,
                        cond,
                        dst,
                        src,
                        target,
                    } => {
                        let a = s.regs[dst as usize];
                        let b = self.operand(&s, src);
                        let (a, b) = match width {
                            Width::W64 => (a, b),
                            // A 32-bit comparison sees the low halves: exact for lengths, and
                            // for constants once truncated.
                            Width::W32 => (truncate32(a), truncate32(b)),
                        };
                        let mut taken = s.clone();
                        taken.refine(cond, a, b, true);
                        let mut fall = s.clone();
                        fall.refine(cond, a, b, false);
                        succ.push((target as usize, taken));
                        succ.push((pc + 1, fall));
                        break;
                    }
                    _ => {}
                }
                pc += op.slots();
                if index(pc).is_some() {
                    succ.push((pc, s.clone()));
                    break;
                }
            }
            for (t, st) in succ {
                let Some(k) = index(t) else { continue };
                let changed = match &mut states[k] {
                    Some(old) => old.join_from(&st),
                    slot @ None => {
                        *slot = Some(st);
                        true
                    }
                };
                if changed && !queued[k] {
                    queued[k] = true;
                    work.push_back(k);
                }
            }
        }
        let states = leaders
            .iter()
            .zip(states)
            .filter_map(|(&l, s)| s.map(|s| (l, s)))
            .collect();
        (states, calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::insn::{encode_all, Insn};
    use crate::opcode::*;
    use crate::verifier::{check, VerifierConfig};

    fn facts(insns: &[Insn], entry: &EntryAssumptions) -> Facts {
        let p = Program::from_bytecode("t", encode_all(insns));
        let c = check(&p, &VerifierConfig::default()).unwrap();
        analyze(&c, &p, entry, HelperSet::Naam)
    }

    const STXDW: u8 = CLASS_STX | MODE_MEM | SIZE_DW;
    const LDXDW: u8 = CLASS_LDX | MODE_MEM | SIZE_DW;
    const LDXB: u8 = CLASS_LDX | MODE_MEM | SIZE_B;

    const SEGMENTS: i16 = std::mem::offset_of!(naam_ebpf::abi::Context, segments) as i16;

    #[test]
    fn frame_and_context_accesses_are_proven() {
        let f = facts(
            &[
                Insn::new(STXDW, 10, 1, -8, 0),      // spill ctx
                Insn::new(LDXDW, 2, 10, -8, 0),      // reload it: still the context
                Insn::new(LDXB, 0, 2, 40, 0),        // ctx+40: proven
                Insn::new(LDXDW, 3, 1, SEGMENTS, 0), // segments[0].addr: a segment hint
                Insn::new(LDXB, 0, 3, 5, 0),         // hinted at segment 0
                Insn::EXIT,
            ],
            &EntryAssumptions::handler_context(),
        );
        assert_eq!(f.check(0), Check::Proven);
        assert_eq!(f.check(1), Check::Proven);
        assert_eq!(f.check(2), Check::Proven);
        assert_eq!(f.check(4), Check::Hint(slot::SEGMENT as u8));
        assert_eq!((f.proven, f.hinted, f.scanned), (4, 1, 0));
    }

    const SEG0_LEN: i16 = SEGMENTS + 8;

    /// The SDK's own bounds check (`off + 8 <= len`, with a constant offset) proves the read
    /// that follows it; without the check the read is only hinted.
    #[test]
    fn length_checks_prove_constant_offset_segment_reads() {
        const LDXW: u8 = CLASS_LDX | MODE_MEM | SIZE_W;
        let f = facts(
            &[
                Insn::new(LDXDW, 2, 1, SEGMENTS, 0), // r2 = segments[0].addr
                Insn::new(LDXW, 3, 1, SEG0_LEN, 0),  // r3 = segments[0].len
                Insn::new(LDXDW, 0, 2, 16, 0),       // unchecked: hint only
                Insn::new(CLASS_JMP | JMP_JLT | SRC_K, 3, 0, 2, 24), // if len < 24 goto out
                Insn::new(LDXDW, 0, 2, 16, 0),       // [16, 24) is inside: proven
                Insn::new(LDXDW, 0, 2, 17, 0),       // [17, 25) is not
                Insn::EXIT,
            ],
            &EntryAssumptions::handler_context(),
        );
        assert_eq!(f.check(2), Check::Hint(slot::SEGMENT as u8));
        assert_eq!(f.check(4), Check::Proven);
        assert_eq!(f.check(5), Check::Hint(slot::SEGMENT as u8));
        // Stores into the read-only input part are never proven.
        let f = facts(
            &[Insn::new(STXDW, 1, 1, SEGMENTS, 0), Insn::EXIT],
            &EntryAssumptions::handler_context(),
        );
        assert_eq!(f.check(0), Check::Hint(slot::ENTRY as u8));
    }

    #[test]
    fn unknown_stores_forget_spilled_pointers() {
        let f = facts(
            &[
                Insn::new(STXDW, 10, 1, -8, 0), // spill ctx
                Insn::new(LDXDW, 4, 1, 0, 0),   // r4 = *ctx (unknown)
                Insn::new(STXDW, 4, 1, 0, 0),   // store through r4: could hit the stack
                Insn::new(LDXDW, 2, 10, -8, 0), // reload
                Insn::new(LDXB, 0, 2, 40, 0),   // no longer provable
                Insn::EXIT,
            ],
            &EntryAssumptions::handler_context(),
        );
        assert_eq!(f.check(2), Check::Scan);
        assert_eq!(f.check(4), Check::Scan);
    }

    /// A copy whose destination is proven inside the context's output leaves the spilled
    /// context pointer known; one into the stack, or to an address not proven, forgets it.
    #[test]
    fn copies_forget_spills_only_when_they_may_reach_the_stack() {
        use naam_ebpf::abi::{helper, CONTEXT_INPUT_SIZE};
        let mov_x = |d, s| Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, d, s, 0, 0);
        let add_k = |d, k| Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, d, 0, 0, k);
        let program = |dst: [Insn; 2]| {
            facts(
                &[
                    Insn::new(STXDW, 10, 1, -8, 0), // spill ctx
                    dst[0],
                    dst[1],
                    mov_x(2, 10), // source: the stack
                    add_k(2, -16),
                    Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, 8),
                    Insn::new(CALL, 0, CALL_HELPER, 0, helper::MEMCPY as i32),
                    Insn::new(LDXDW, 2, 10, -8, 0), // reload
                    Insn::new(LDXB, 0, 2, 40, 0),   // the context again?
                    Insn::EXIT,
                ],
                &EntryAssumptions::handler_context(),
            )
        };
        // Into the context's writable output: the spill survives.
        let out = program([mov_x(1, 1), add_k(1, CONTEXT_INPUT_SIZE as i32)]);
        assert_eq!(out.check(8), Check::Proven);
        // Into the stack: forgotten.
        let stack = program([mov_x(1, 10), add_k(1, -32)]);
        assert_eq!(stack.check(8), Check::Scan);
        // Into the context's read-only input (the helper refuses it, but the analysis does
        // not rely on that): forgotten.
        let input = program([mov_x(1, 1), add_k(1, 8)]);
        assert_eq!(input.check(8), Check::Scan);
        // To an address loaded from memory: forgotten.
        let unknown = program([Insn::new(LDXDW, 1, 1, 0, 0), add_k(1, 0)]);
        assert_eq!(unknown.check(8), Check::Scan);
    }

    #[test]
    fn raw_memory_is_hinted_not_proven() {
        let f = facts(
            &[Insn::new(LDXB, 0, 1, 0, 0), Insn::EXIT],
            &EntryAssumptions::raw_memory(),
        );
        assert_eq!(f.check(0), Check::Hint(slot::ENTRY as u8));
    }

    /// A frame offset near 2^63 once wrapped in the bounds arithmetic into a proof.
    #[test]
    fn huge_frame_offsets_are_never_proven() {
        let f = facts(
            &[
                Insn::new(STXDW, 10, 1, -8, 0),
                Insn::new(LDDW, 3, 0, 0, -8),
                Insn::new(0, 0, 0, 0, 0x7fff_ffff),
                Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 2, 10, 0, 0),
                Insn::new(CLASS_ALU64 | ALU_ADD | SRC_X, 2, 3, 0, 0), // r10 + (2^63 - 8)
                Insn::new(STXDW, 2, 4, 0, 0),                         // must be checked
                Insn::new(LDXDW, 5, 10, -8, 0),                       // no longer the context
                Insn::new(STXDW, 5, 6, 2208, 0),                      // so this is checked too
                Insn::EXIT,
            ],
            &EntryAssumptions::handler_context(),
        );
        assert_eq!(f.check(5), Check::Hint(slot::STACK as u8));
        assert_ne!(f.check(7), Check::Proven);
    }

    #[test]
    fn out_of_frame_arithmetic_is_checked() {
        let f = facts(
            &[
                Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 2, 10, 0, 0),
                Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, 2, 0, 0, 16),
                Insn::new(LDXDW, 0, 2, -8, 0), // r10 + 8: above the frame
                Insn::EXIT,
            ],
            &EntryAssumptions::handler_context(),
        );
        assert_eq!(f.check(2), Check::Hint(slot::STACK as u8));
    }
}
