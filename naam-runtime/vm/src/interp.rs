//! The reference interpreter: the semantics every other engine is tested against.
//!
//! A verified program is lowered once into flat slots ([`InterpCode`]): one dispatch per
//! instruction, immediates pre-extended, jump targets absolute, and for every memory access
//! the analysis' decision (skip the check when proven, else try the hinted grant first).
//! Every access it cannot skip is checked against the grant table ([`VmCtx::allows`]); a miss
//! records a fault and stops the run. The instruction budget is metered exactly as the JIT
//! meters it: every instruction counts, and the count is compared with the budget at every
//! taken backward jump and every local call.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use naam_ebpf::abi::STACK_SIZE;
use naam_proto::step::InsnMix;

use crate::analysis::{Check, Facts};
use crate::insn::{AluOp, AtomicOp, Cond, Op, Operand, Width};
use crate::memory::{fault, HelperFn, VmCtx, HELPER_SLOTS};
use crate::semantics::{self, imm64};
use crate::verifier::Checked;

use crate::memory::MAX_CALL_DEPTH;

/// `hint` value of a proven access (no check).
const PROVEN: u8 = 0xfe;
/// `hint` value of an access with no hint (scan every grant).
const SCAN: u8 = 0xff;

/// Flat instruction kinds: one per (operation, width, operand form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum K {
    Add64R,
    Add64I,
    Sub64R,
    Sub64I,
    Mul64R,
    Mul64I,
    Div64R,
    Div64I,
    Sdiv64R,
    Sdiv64I,
    Mod64R,
    Mod64I,
    Smod64R,
    Smod64I,
    Or64R,
    Or64I,
    And64R,
    And64I,
    Xor64R,
    Xor64I,
    Lsh64R,
    Lsh64I,
    Rsh64R,
    Rsh64I,
    Arsh64R,
    Arsh64I,
    Add32R,
    Add32I,
    Sub32R,
    Sub32I,
    Mul32R,
    Mul32I,
    Div32R,
    Div32I,
    Sdiv32R,
    Sdiv32I,
    Mod32R,
    Mod32I,
    Smod32R,
    Smod32I,
    Or32R,
    Or32I,
    And32R,
    And32I,
    Xor32R,
    Xor32I,
    Lsh32R,
    Lsh32I,
    Rsh32R,
    Rsh32I,
    Arsh32R,
    Arsh32I,
    JEq64R,
    JEq64I,
    JGt64R,
    JGt64I,
    JGe64R,
    JGe64I,
    JSet64R,
    JSet64I,
    JNe64R,
    JNe64I,
    JSgt64R,
    JSgt64I,
    JSge64R,
    JSge64I,
    JLt64R,
    JLt64I,
    JLe64R,
    JLe64I,
    JSlt64R,
    JSlt64I,
    JSle64R,
    JSle64I,
    JEq32R,
    JEq32I,
    JGt32R,
    JGt32I,
    JGe32R,
    JGe32I,
    JSet32R,
    JSet32I,
    JNe32R,
    JNe32I,
    JSgt32R,
    JSgt32I,
    JSge32R,
    JSge32I,
    JLt32R,
    JLt32I,
    JLe32R,
    JLe32I,
    JSlt32R,
    JSlt32I,
    JSle32R,
    JSle32I,
    Neg64,
    Neg32,
    Mov64R,
    Mov64I,
    Mov32R,
    Mov32I,
    MovSx64,
    MovSx32,
    EndLe,
    EndSwap,
    Lddw,
    LdxB,
    LdxH,
    LdxW,
    LdxDw,
    LdxSb,
    LdxSh,
    LdxSw,
    StB,
    StH,
    StW,
    StDw,
    StxB,
    StxH,
    StxW,
    StxDw,
    Atomic32,
    Atomic64,
    Ja,
    CallHelper,
    CallReg,
    CallLocal,
    Exit,
    /// The second slot of `lddw` (never executed).
    Tail,
}

fn alu_kind(width: Width, op: AluOp, imm: bool) -> K {
    match (width, op, imm) {
        (Width::W64, AluOp::Add, false) => K::Add64R,
        (Width::W64, AluOp::Add, true) => K::Add64I,
        (Width::W64, AluOp::Sub, false) => K::Sub64R,
        (Width::W64, AluOp::Sub, true) => K::Sub64I,
        (Width::W64, AluOp::Mul, false) => K::Mul64R,
        (Width::W64, AluOp::Mul, true) => K::Mul64I,
        (Width::W64, AluOp::Div, false) => K::Div64R,
        (Width::W64, AluOp::Div, true) => K::Div64I,
        (Width::W64, AluOp::Sdiv, false) => K::Sdiv64R,
        (Width::W64, AluOp::Sdiv, true) => K::Sdiv64I,
        (Width::W64, AluOp::Mod, false) => K::Mod64R,
        (Width::W64, AluOp::Mod, true) => K::Mod64I,
        (Width::W64, AluOp::Smod, false) => K::Smod64R,
        (Width::W64, AluOp::Smod, true) => K::Smod64I,
        (Width::W64, AluOp::Or, false) => K::Or64R,
        (Width::W64, AluOp::Or, true) => K::Or64I,
        (Width::W64, AluOp::And, false) => K::And64R,
        (Width::W64, AluOp::And, true) => K::And64I,
        (Width::W64, AluOp::Xor, false) => K::Xor64R,
        (Width::W64, AluOp::Xor, true) => K::Xor64I,
        (Width::W64, AluOp::Lsh, false) => K::Lsh64R,
        (Width::W64, AluOp::Lsh, true) => K::Lsh64I,
        (Width::W64, AluOp::Rsh, false) => K::Rsh64R,
        (Width::W64, AluOp::Rsh, true) => K::Rsh64I,
        (Width::W64, AluOp::Arsh, false) => K::Arsh64R,
        (Width::W64, AluOp::Arsh, true) => K::Arsh64I,
        (Width::W32, AluOp::Add, false) => K::Add32R,
        (Width::W32, AluOp::Add, true) => K::Add32I,
        (Width::W32, AluOp::Sub, false) => K::Sub32R,
        (Width::W32, AluOp::Sub, true) => K::Sub32I,
        (Width::W32, AluOp::Mul, false) => K::Mul32R,
        (Width::W32, AluOp::Mul, true) => K::Mul32I,
        (Width::W32, AluOp::Div, false) => K::Div32R,
        (Width::W32, AluOp::Div, true) => K::Div32I,
        (Width::W32, AluOp::Sdiv, false) => K::Sdiv32R,
        (Width::W32, AluOp::Sdiv, true) => K::Sdiv32I,
        (Width::W32, AluOp::Mod, false) => K::Mod32R,
        (Width::W32, AluOp::Mod, true) => K::Mod32I,
        (Width::W32, AluOp::Smod, false) => K::Smod32R,
        (Width::W32, AluOp::Smod, true) => K::Smod32I,
        (Width::W32, AluOp::Or, false) => K::Or32R,
        (Width::W32, AluOp::Or, true) => K::Or32I,
        (Width::W32, AluOp::And, false) => K::And32R,
        (Width::W32, AluOp::And, true) => K::And32I,
        (Width::W32, AluOp::Xor, false) => K::Xor32R,
        (Width::W32, AluOp::Xor, true) => K::Xor32I,
        (Width::W32, AluOp::Lsh, false) => K::Lsh32R,
        (Width::W32, AluOp::Lsh, true) => K::Lsh32I,
        (Width::W32, AluOp::Rsh, false) => K::Rsh32R,
        (Width::W32, AluOp::Rsh, true) => K::Rsh32I,
        (Width::W32, AluOp::Arsh, false) => K::Arsh32R,
        (Width::W32, AluOp::Arsh, true) => K::Arsh32I,
    }
}

fn jump_kind(width: Width, cond: Cond, imm: bool) -> K {
    match (width, cond, imm) {
        (Width::W64, Cond::Eq, false) => K::JEq64R,
        (Width::W64, Cond::Eq, true) => K::JEq64I,
        (Width::W64, Cond::Gt, false) => K::JGt64R,
        (Width::W64, Cond::Gt, true) => K::JGt64I,
        (Width::W64, Cond::Ge, false) => K::JGe64R,
        (Width::W64, Cond::Ge, true) => K::JGe64I,
        (Width::W64, Cond::Set, false) => K::JSet64R,
        (Width::W64, Cond::Set, true) => K::JSet64I,
        (Width::W64, Cond::Ne, false) => K::JNe64R,
        (Width::W64, Cond::Ne, true) => K::JNe64I,
        (Width::W64, Cond::Sgt, false) => K::JSgt64R,
        (Width::W64, Cond::Sgt, true) => K::JSgt64I,
        (Width::W64, Cond::Sge, false) => K::JSge64R,
        (Width::W64, Cond::Sge, true) => K::JSge64I,
        (Width::W64, Cond::Lt, false) => K::JLt64R,
        (Width::W64, Cond::Lt, true) => K::JLt64I,
        (Width::W64, Cond::Le, false) => K::JLe64R,
        (Width::W64, Cond::Le, true) => K::JLe64I,
        (Width::W64, Cond::Slt, false) => K::JSlt64R,
        (Width::W64, Cond::Slt, true) => K::JSlt64I,
        (Width::W64, Cond::Sle, false) => K::JSle64R,
        (Width::W64, Cond::Sle, true) => K::JSle64I,
        (Width::W32, Cond::Eq, false) => K::JEq32R,
        (Width::W32, Cond::Eq, true) => K::JEq32I,
        (Width::W32, Cond::Gt, false) => K::JGt32R,
        (Width::W32, Cond::Gt, true) => K::JGt32I,
        (Width::W32, Cond::Ge, false) => K::JGe32R,
        (Width::W32, Cond::Ge, true) => K::JGe32I,
        (Width::W32, Cond::Set, false) => K::JSet32R,
        (Width::W32, Cond::Set, true) => K::JSet32I,
        (Width::W32, Cond::Ne, false) => K::JNe32R,
        (Width::W32, Cond::Ne, true) => K::JNe32I,
        (Width::W32, Cond::Sgt, false) => K::JSgt32R,
        (Width::W32, Cond::Sgt, true) => K::JSgt32I,
        (Width::W32, Cond::Sge, false) => K::JSge32R,
        (Width::W32, Cond::Sge, true) => K::JSge32I,
        (Width::W32, Cond::Lt, false) => K::JLt32R,
        (Width::W32, Cond::Lt, true) => K::JLt32I,
        (Width::W32, Cond::Le, false) => K::JLe32R,
        (Width::W32, Cond::Le, true) => K::JLe32I,
        (Width::W32, Cond::Slt, false) => K::JSlt32R,
        (Width::W32, Cond::Slt, true) => K::JSlt32I,
        (Width::W32, Cond::Sle, false) => K::JSle32R,
        (Width::W32, Cond::Sle, true) => K::JSle32I,
    }
}

/// One lowered instruction.
#[derive(Clone, Copy, Debug)]
struct Slot {
    k: K,
    dst: u8,
    src: u8,
    /// Grant slot to check first, [`PROVEN`] or [`SCAN`].
    hint: u8,
    /// Sign-extension or swap width; atomic operation code; the fetch flag in bit 7.
    aux: u8,
    /// Immediate, ready for the operation (sign-extended to 64 bits, or the `lddw` constant).
    imm: u64,
    /// Memory displacement, or the absolute target of a jump or local call.
    off: i64,
}

/// A verified program lowered for the interpreter.
#[derive(Clone, Debug)]
pub struct InterpCode {
    slots: Vec<Slot>,
}

fn atomic_code(op: AtomicOp) -> u8 {
    match op {
        AtomicOp::Add => 0,
        AtomicOp::Or => 1,
        AtomicOp::And => 2,
        AtomicOp::Xor => 3,
        AtomicOp::Xchg => 4,
        AtomicOp::Cmpxchg => 5,
    }
}

fn atomic_op(code: u8) -> AtomicOp {
    match code & 0x7f {
        0 => AtomicOp::Add,
        1 => AtomicOp::Or,
        2 => AtomicOp::And,
        3 => AtomicOp::Xor,
        4 => AtomicOp::Xchg,
        _ => AtomicOp::Cmpxchg,
    }
}

impl InterpCode {
    /// Lowers a verified program, using the analysis' check decisions.
    pub fn new(checked: &Checked, facts: &Facts) -> InterpCode {
        let slots = checked
            .ops
            .iter()
            .enumerate()
            .map(|(pc, op)| match op {
                Some(op) => lower(*op, facts.check(pc)),
                None => Slot {
                    k: K::Tail,
                    dst: 0,
                    src: 0,
                    hint: SCAN,
                    aux: 0,
                    imm: 0,
                    off: 0,
                },
            })
            .collect();
        InterpCode { slots }
    }

    /// Slots, one per slot of the verified program (`lddw`'s second included).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True for an empty program (never verified).
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

fn lower(op: Op, check: Check) -> Slot {
    let hint = match check {
        Check::Proven => PROVEN,
        Check::Hint(h) => h,
        Check::Scan => SCAN,
    };
    let mut s = Slot {
        k: K::Exit,
        dst: 0,
        src: 0,
        hint,
        aux: 0,
        imm: 0,
        off: 0,
    };
    let operand = |s: &mut Slot, v: Operand| -> bool {
        match v {
            Operand::Reg(r) => {
                s.src = r;
                false
            }
            Operand::Imm(i) => {
                s.imm = imm64(i);
                true
            }
        }
    };
    match op {
        Op::Alu {
            width,
            op,
            dst,
            src,
        } => {
            s.dst = dst;
            let imm = operand(&mut s, src);
            s.k = alu_kind(width, op, imm);
        }
        Op::Neg { width, dst } => {
            s.dst = dst;
            s.k = if width == Width::W64 {
                K::Neg64
            } else {
                K::Neg32
            };
        }
        Op::Mov { width, dst, src } => {
            s.dst = dst;
            let imm = operand(&mut s, src);
            s.k = match (width, imm) {
                (Width::W64, false) => K::Mov64R,
                (Width::W64, true) => K::Mov64I,
                (Width::W32, false) => K::Mov32R,
                (Width::W32, true) => K::Mov32I,
            };
        }
        Op::MovSx {
            width,
            dst,
            src,
            bits,
        } => {
            s.dst = dst;
            s.src = src;
            s.aux = bits;
            s.k = if width == Width::W64 {
                K::MovSx64
            } else {
                K::MovSx32
            };
        }
        Op::End { dst, bits, swap } => {
            s.dst = dst;
            s.aux = bits;
            s.k = if swap { K::EndSwap } else { K::EndLe };
        }
        Op::Lddw { dst, imm } => {
            s.dst = dst;
            s.imm = imm;
            s.k = K::Lddw;
        }
        Op::Load {
            dst,
            base,
            off,
            size,
            signed,
        } => {
            s.dst = dst;
            s.src = base;
            s.off = off as i64;
            s.k = match (size, signed) {
                (1, false) => K::LdxB,
                (2, false) => K::LdxH,
                (4, false) => K::LdxW,
                (1, true) => K::LdxSb,
                (2, true) => K::LdxSh,
                (4, true) => K::LdxSw,
                _ => K::LdxDw,
            };
        }
        Op::Store {
            base,
            off,
            size,
            value,
        } => {
            s.dst = base;
            s.off = off as i64;
            let imm = operand(&mut s, value);
            s.k = match (size, imm) {
                (1, true) => K::StB,
                (2, true) => K::StH,
                (4, true) => K::StW,
                (_, true) => K::StDw,
                (1, false) => K::StxB,
                (2, false) => K::StxH,
                (4, false) => K::StxW,
                (_, false) => K::StxDw,
            };
        }
        Op::Atomic {
            base,
            off,
            size,
            op,
            fetch,
            src,
        } => {
            s.dst = base;
            s.src = src;
            s.off = off as i64;
            s.aux = atomic_code(op) | if fetch { 0x80 } else { 0 };
            s.k = if size == 8 { K::Atomic64 } else { K::Atomic32 };
        }
        Op::Ja { target } => {
            s.off = target;
            s.k = K::Ja;
        }
        Op::Jump {
            width,
            cond,
            dst,
            src,
            target,
        } => {
            s.dst = dst;
            s.off = target;
            let imm = operand(&mut s, src);
            s.k = jump_kind(width, cond, imm);
        }
        Op::CallHelper { id } => {
            s.imm = id as u64;
            s.k = K::CallHelper;
        }
        Op::CallReg { reg } => {
            s.dst = reg;
            s.k = K::CallReg;
        }
        Op::CallLocal { target } => {
            s.off = target;
            s.k = K::CallLocal;
        }
        Op::Exit => s.k = K::Exit,
    }
    s
}

struct Frame {
    saved: [u64; 4],
    return_pc: usize,
    fp: u64,
}

/// Calls helper `id` from the context's table; `None` when no helper has that id.
#[inline]
fn helper(ctx: &VmCtx, id: u64) -> Option<HelperFn> {
    let addr = *ctx
        .helpers
        .get(usize::try_from(id).ok().filter(|&i| i < HELPER_SLOTS)?)?;
    if addr == 0 {
        return None;
    }
    // SAFETY: the table holds only addresses of `HelperFn`s (see `HelperSet::table`).
    Some(unsafe { std::mem::transmute::<usize, HelperFn>(addr as usize) })
}

/// Runs `code` with `r1`, `r2` and the frame pointer `fp` (the top of the entry frame).
/// Returns `r0`, or `None` after recording a fault in `ctx.fault`. The count of executed
/// instructions is left in `ctx.executed`.
///
/// `mix` is left with the counts of the classes a cost model prices apart (memory accesses,
/// helper calls), exact as the total is.
pub fn run(
    code: &InterpCode,
    ctx: &mut VmCtx,
    mix: &mut InsnMix,
    (r1, r2, fp): (u64, u64, u64),
) -> Option<u64> {
    let slots = &code.slots[..];
    // 16 registers so that `& 15` proves every index in bounds; r11..r15 are never used.
    let mut r = [0u64; 16];
    r[1] = r1;
    r[2] = r2;
    r[10] = fp;
    let mut frames: [Frame; MAX_CALL_DEPTH] = std::array::from_fn(|_| Frame {
        saved: [0; 4],
        return_pc: 0,
        fp: 0,
    });
    let mut depth = 0usize;
    let mut fp = fp;
    let mut pc = 0usize;
    let mut executed = 0u64;
    let (mut memory, mut helpers) = (0u64, 0u64);
    let budget = ctx.budget;

    macro_rules! fail {
        ($kind:expr, $addr:expr, $len:expr) => {{
            ctx.executed = executed;
            *mix = InsnMix { memory, helpers };
            ctx.set_fault($kind, pc as u64, $addr, $len);
            return None;
        }};
    }
    loop {
        let Some(&s) = slots.get(pc) else {
            // Verified code never leaves the program; stop cleanly if it somehow did.
            fail!(fault::LOAD, pc as u64, 0);
        };
        executed += 1;
        let d = (s.dst & 15) as usize;
        let sr = (s.src & 15) as usize;
        macro_rules! alu {
            ($w:ident, $op:ident, R) => {
                r[d] = semantics::alu(Width::$w, AluOp::$op, r[d], r[sr])
            };
            ($w:ident, $op:ident, I) => {
                r[d] = semantics::alu(Width::$w, AluOp::$op, r[d], s.imm)
            };
        }
        macro_rules! goto {
            ($taken:expr) => {{
                if $taken {
                    let target = s.off as usize;
                    if target <= pc && executed > budget {
                        fail!(fault::BUDGET, 0, 0);
                    }
                    pc = target;
                    continue;
                }
            }};
        }
        macro_rules! jump {
            ($w:ident, $c:ident, R) => {
                goto!(Cond::$c.holds(Width::$w, r[d], r[sr]))
            };
            ($w:ident, $c:ident, I) => {
                goto!(Cond::$c.holds(Width::$w, r[d], s.imm))
            };
        }
        macro_rules! check {
            ($addr:expr, $size:expr, $write:expr, $kind:expr) => {{
                let addr: u64 = $addr;
                memory += 1;
                if s.hint != PROVEN && !ctx.allows(s.hint as usize, addr, $size, $write) {
                    fail!($kind, addr, $size);
                }
                addr
            }};
        }
        macro_rules! load {
            ($t:ty) => {{
                let addr = check!(
                    r[sr].wrapping_add(s.off as u64),
                    std::mem::size_of::<$t>() as u64,
                    false,
                    fault::LOAD
                );
                // SAFETY: a grant of this run covers [addr, addr + size) for reading.
                unsafe { std::ptr::read_unaligned(addr as *const $t) }
            }};
        }
        macro_rules! store {
            ($t:ty, $v:expr) => {{
                let addr = check!(
                    r[d].wrapping_add(s.off as u64),
                    std::mem::size_of::<$t>() as u64,
                    true,
                    fault::STORE
                );
                // SAFETY: a grant of this run covers [addr, addr + size) for writing.
                unsafe { std::ptr::write_unaligned(addr as *mut $t, $v as $t) }
            }};
        }
        match s.k {
            K::Add64R => alu!(W64, Add, R),
            K::Add64I => alu!(W64, Add, I),
            K::Sub64R => alu!(W64, Sub, R),
            K::Sub64I => alu!(W64, Sub, I),
            K::Mul64R => alu!(W64, Mul, R),
            K::Mul64I => alu!(W64, Mul, I),
            K::Div64R => alu!(W64, Div, R),
            K::Div64I => alu!(W64, Div, I),
            K::Sdiv64R => alu!(W64, Sdiv, R),
            K::Sdiv64I => alu!(W64, Sdiv, I),
            K::Mod64R => alu!(W64, Mod, R),
            K::Mod64I => alu!(W64, Mod, I),
            K::Smod64R => alu!(W64, Smod, R),
            K::Smod64I => alu!(W64, Smod, I),
            K::Or64R => alu!(W64, Or, R),
            K::Or64I => alu!(W64, Or, I),
            K::And64R => alu!(W64, And, R),
            K::And64I => alu!(W64, And, I),
            K::Xor64R => alu!(W64, Xor, R),
            K::Xor64I => alu!(W64, Xor, I),
            K::Lsh64R => alu!(W64, Lsh, R),
            K::Lsh64I => alu!(W64, Lsh, I),
            K::Rsh64R => alu!(W64, Rsh, R),
            K::Rsh64I => alu!(W64, Rsh, I),
            K::Arsh64R => alu!(W64, Arsh, R),
            K::Arsh64I => alu!(W64, Arsh, I),
            K::Add32R => alu!(W32, Add, R),
            K::Add32I => alu!(W32, Add, I),
            K::Sub32R => alu!(W32, Sub, R),
            K::Sub32I => alu!(W32, Sub, I),
            K::Mul32R => alu!(W32, Mul, R),
            K::Mul32I => alu!(W32, Mul, I),
            K::Div32R => alu!(W32, Div, R),
            K::Div32I => alu!(W32, Div, I),
            K::Sdiv32R => alu!(W32, Sdiv, R),
            K::Sdiv32I => alu!(W32, Sdiv, I),
            K::Mod32R => alu!(W32, Mod, R),
            K::Mod32I => alu!(W32, Mod, I),
            K::Smod32R => alu!(W32, Smod, R),
            K::Smod32I => alu!(W32, Smod, I),
            K::Or32R => alu!(W32, Or, R),
            K::Or32I => alu!(W32, Or, I),
            K::And32R => alu!(W32, And, R),
            K::And32I => alu!(W32, And, I),
            K::Xor32R => alu!(W32, Xor, R),
            K::Xor32I => alu!(W32, Xor, I),
            K::Lsh32R => alu!(W32, Lsh, R),
            K::Lsh32I => alu!(W32, Lsh, I),
            K::Rsh32R => alu!(W32, Rsh, R),
            K::Rsh32I => alu!(W32, Rsh, I),
            K::Arsh32R => alu!(W32, Arsh, R),
            K::Arsh32I => alu!(W32, Arsh, I),
            K::JEq64R => jump!(W64, Eq, R),
            K::JEq64I => jump!(W64, Eq, I),
            K::JGt64R => jump!(W64, Gt, R),
            K::JGt64I => jump!(W64, Gt, I),
            K::JGe64R => jump!(W64, Ge, R),
            K::JGe64I => jump!(W64, Ge, I),
            K::JSet64R => jump!(W64, Set, R),
            K::JSet64I => jump!(W64, Set, I),
            K::JNe64R => jump!(W64, Ne, R),
            K::JNe64I => jump!(W64, Ne, I),
            K::JSgt64R => jump!(W64, Sgt, R),
            K::JSgt64I => jump!(W64, Sgt, I),
            K::JSge64R => jump!(W64, Sge, R),
            K::JSge64I => jump!(W64, Sge, I),
            K::JLt64R => jump!(W64, Lt, R),
            K::JLt64I => jump!(W64, Lt, I),
            K::JLe64R => jump!(W64, Le, R),
            K::JLe64I => jump!(W64, Le, I),
            K::JSlt64R => jump!(W64, Slt, R),
            K::JSlt64I => jump!(W64, Slt, I),
            K::JSle64R => jump!(W64, Sle, R),
            K::JSle64I => jump!(W64, Sle, I),
            K::JEq32R => jump!(W32, Eq, R),
            K::JEq32I => jump!(W32, Eq, I),
            K::JGt32R => jump!(W32, Gt, R),
            K::JGt32I => jump!(W32, Gt, I),
            K::JGe32R => jump!(W32, Ge, R),
            K::JGe32I => jump!(W32, Ge, I),
            K::JSet32R => jump!(W32, Set, R),
            K::JSet32I => jump!(W32, Set, I),
            K::JNe32R => jump!(W32, Ne, R),
            K::JNe32I => jump!(W32, Ne, I),
            K::JSgt32R => jump!(W32, Sgt, R),
            K::JSgt32I => jump!(W32, Sgt, I),
            K::JSge32R => jump!(W32, Sge, R),
            K::JSge32I => jump!(W32, Sge, I),
            K::JLt32R => jump!(W32, Lt, R),
            K::JLt32I => jump!(W32, Lt, I),
            K::JLe32R => jump!(W32, Le, R),
            K::JLe32I => jump!(W32, Le, I),
            K::JSlt32R => jump!(W32, Slt, R),
            K::JSlt32I => jump!(W32, Slt, I),
            K::JSle32R => jump!(W32, Sle, R),
            K::JSle32I => jump!(W32, Sle, I),
            K::Neg64 => r[d] = semantics::neg(Width::W64, r[d]),
            K::Neg32 => r[d] = semantics::neg(Width::W32, r[d]),
            K::Mov64R => r[d] = r[sr],
            K::Mov64I => r[d] = s.imm,
            K::Mov32R => r[d] = r[sr] as u32 as u64,
            K::Mov32I => r[d] = s.imm as u32 as u64,
            K::MovSx64 => r[d] = semantics::movsx(Width::W64, s.aux, r[sr]),
            K::MovSx32 => r[d] = semantics::movsx(Width::W32, s.aux, r[sr]),
            K::EndLe => r[d] = semantics::end(s.aux, false, r[d]),
            K::EndSwap => r[d] = semantics::end(s.aux, true, r[d]),
            K::Lddw => {
                r[d] = s.imm;
                pc += 2;
                continue;
            }
            K::LdxB => r[d] = load!(u8) as u64,
            K::LdxH => r[d] = load!(u16) as u64,
            K::LdxW => r[d] = load!(u32) as u64,
            K::LdxDw => r[d] = load!(u64),
            K::LdxSb => r[d] = load!(i8) as i64 as u64,
            K::LdxSh => r[d] = load!(i16) as i64 as u64,
            K::LdxSw => r[d] = load!(i32) as i64 as u64,
            K::StB => store!(u8, s.imm),
            K::StH => store!(u16, s.imm),
            K::StW => store!(u32, s.imm),
            K::StDw => store!(u64, s.imm),
            K::StxB => store!(u8, r[sr]),
            K::StxH => store!(u16, r[sr]),
            K::StxW => store!(u32, r[sr]),
            K::StxDw => store!(u64, r[sr]),
            K::Atomic32 | K::Atomic64 => {
                let size = if s.k == K::Atomic64 { 8u64 } else { 4 };
                let addr = check!(r[d].wrapping_add(s.off as u64), size, true, fault::ATOMIC);
                if addr % size != 0 {
                    fail!(fault::MISALIGNED, addr, size);
                }
                let op = atomic_op(s.aux);
                let operand = r[sr];
                let old = if size == 8 {
                    // SAFETY: a writable grant covers the 8 aligned bytes at `addr`.
                    let a = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
                    match op {
                        AtomicOp::Add => a.fetch_add(operand, Ordering::SeqCst),
                        AtomicOp::Or => a.fetch_or(operand, Ordering::SeqCst),
                        AtomicOp::And => a.fetch_and(operand, Ordering::SeqCst),
                        AtomicOp::Xor => a.fetch_xor(operand, Ordering::SeqCst),
                        AtomicOp::Xchg => a.swap(operand, Ordering::SeqCst),
                        AtomicOp::Cmpxchg => a
                            .compare_exchange(r[0], operand, Ordering::SeqCst, Ordering::SeqCst)
                            .unwrap_or_else(|v| v),
                    }
                } else {
                    // SAFETY: a writable grant covers the 4 aligned bytes at `addr`.
                    let a = unsafe { AtomicU32::from_ptr(addr as *mut u32) };
                    let v = operand as u32;
                    (match op {
                        AtomicOp::Add => a.fetch_add(v, Ordering::SeqCst),
                        AtomicOp::Or => a.fetch_or(v, Ordering::SeqCst),
                        AtomicOp::And => a.fetch_and(v, Ordering::SeqCst),
                        AtomicOp::Xor => a.fetch_xor(v, Ordering::SeqCst),
                        AtomicOp::Xchg => a.swap(v, Ordering::SeqCst),
                        AtomicOp::Cmpxchg => a
                            .compare_exchange(r[0] as u32, v, Ordering::SeqCst, Ordering::SeqCst)
                            .unwrap_or_else(|v| v),
                    }) as u64
                };
                if s.aux & 0x80 != 0 {
                    if op == AtomicOp::Cmpxchg {
                        r[0] = old;
                    } else {
                        r[sr] = old;
                    }
                }
            }
            K::Ja => goto!(true),
            K::CallHelper | K::CallReg => {
                let id = if s.k == K::CallHelper { s.imm } else { r[d] };
                helpers += 1;
                let Some(f) = helper(ctx, id) else {
                    fail!(fault::UNKNOWN_HELPER, id, 0);
                };
                r[0] = f(ctx as *mut VmCtx, r[1], r[2], r[3], r[4], r[5]);
                if ctx.fault.kind != fault::NONE {
                    ctx.executed = executed;
                    *mix = InsnMix { memory, helpers };
                    return None;
                }
            }
            K::CallLocal => {
                if executed > budget {
                    fail!(fault::BUDGET, 0, 0);
                }
                let callee_fp = fp.wrapping_sub(STACK_SIZE as u64);
                if depth + 1 >= MAX_CALL_DEPTH
                    || callee_fp.wrapping_sub(STACK_SIZE as u64) < ctx.stack_limit
                {
                    fail!(fault::CALL_DEPTH, 0, 0);
                }
                frames[depth] = Frame {
                    saved: [r[6], r[7], r[8], r[9]],
                    return_pc: pc + 1,
                    fp,
                };
                depth += 1;
                fp = callee_fp;
                r[0] = 0;
                r[6..10].fill(0);
                r[10] = fp;
                pc = s.off as usize;
                continue;
            }
            K::Exit => {
                if depth == 0 {
                    ctx.executed = executed;
                    *mix = InsnMix { memory, helpers };
                    return Some(r[0]);
                }
                depth -= 1;
                let f = &frames[depth];
                r[6..10].copy_from_slice(&f.saved);
                r[1..6].fill(0);
                fp = f.fp;
                r[10] = fp;
                pc = f.return_pc;
                continue;
            }
            K::Tail => fail!(fault::LOAD, pc as u64, 0),
        }
        pc += 1;
    }
}
