//! The reference meaning of every eBPF computation that is not a memory access or a jump
//! (RFC 9669 section 4): the interpreter calls these functions with constant operations so
//! they inline into its dispatch arms, and the JIT's tests use them as the oracle.
//!
//! Corner cases, which the conformance suite checks:
//! - unsigned and signed division by zero give 0; remainder by zero leaves the dividend;
//! - `MIN / -1` gives `MIN` and `MIN % -1` gives 0 (no trap);
//! - shift amounts are masked to the operand width;
//! - every 32-bit result, including a remainder by zero and a 32-bit move, is zero-extended.

use crate::insn::{AluOp, AtomicOp, Width};

/// `a <op> b` at `width`; for 32-bit operations only the low halves are read and the result is
/// zero-extended.
#[inline(always)]
pub fn alu(width: Width, op: AluOp, a: u64, b: u64) -> u64 {
    match width {
        Width::W64 => alu64(op, a, b),
        Width::W32 => alu32(op, a as u32, b as u32) as u64,
    }
}

#[inline(always)]
fn alu64(op: AluOp, a: u64, b: u64) -> u64 {
    match op {
        AluOp::Add => a.wrapping_add(b),
        AluOp::Sub => a.wrapping_sub(b),
        AluOp::Mul => a.wrapping_mul(b),
        AluOp::Div => a.checked_div(b).unwrap_or(0),
        AluOp::Sdiv => {
            if b == 0 {
                0
            } else {
                (a as i64).wrapping_div(b as i64) as u64
            }
        }
        AluOp::Mod => {
            if b == 0 {
                a
            } else {
                a % b
            }
        }
        AluOp::Smod => {
            if b == 0 {
                a
            } else {
                (a as i64).wrapping_rem(b as i64) as u64
            }
        }
        AluOp::Or => a | b,
        AluOp::And => a & b,
        AluOp::Xor => a ^ b,
        AluOp::Lsh => a.wrapping_shl(b as u32),
        AluOp::Rsh => a.wrapping_shr(b as u32),
        AluOp::Arsh => (a as i64).wrapping_shr(b as u32) as u64,
    }
}

#[inline(always)]
fn alu32(op: AluOp, a: u32, b: u32) -> u32 {
    match op {
        AluOp::Add => a.wrapping_add(b),
        AluOp::Sub => a.wrapping_sub(b),
        AluOp::Mul => a.wrapping_mul(b),
        AluOp::Div => a.checked_div(b).unwrap_or(0),
        AluOp::Sdiv => {
            if b == 0 {
                0
            } else {
                (a as i32).wrapping_div(b as i32) as u32
            }
        }
        AluOp::Mod => {
            if b == 0 {
                a
            } else {
                a % b
            }
        }
        AluOp::Smod => {
            if b == 0 {
                a
            } else {
                (a as i32).wrapping_rem(b as i32) as u32
            }
        }
        AluOp::Or => a | b,
        AluOp::And => a & b,
        AluOp::Xor => a ^ b,
        AluOp::Lsh => a.wrapping_shl(b),
        AluOp::Rsh => a.wrapping_shr(b),
        AluOp::Arsh => (a as i32).wrapping_shr(b) as u32,
    }
}

/// The second operand of an immediate-form operation: the immediate sign-extended to 64 bits
/// (32-bit operations then read its low half).
#[inline(always)]
pub const fn imm64(imm: i32) -> u64 {
    imm as i64 as u64
}

/// `-a` at `width`.
#[inline(always)]
pub fn neg(width: Width, a: u64) -> u64 {
    match width {
        Width::W64 => a.wrapping_neg(),
        Width::W32 => (a as u32).wrapping_neg() as u64,
    }
}

/// A move at `width` (a 32-bit move zero-extends).
#[inline(always)]
pub fn mov(width: Width, a: u64) -> u64 {
    match width {
        Width::W64 => a,
        Width::W32 => a as u32 as u64,
    }
}

/// A sign-extending move of the low `bits` of `a`, at `width`.
#[inline(always)]
pub fn movsx(width: Width, bits: u8, a: u64) -> u64 {
    let v = sign_extend(bits, a);
    mov(width, v)
}

/// Sign-extends the low `bits` (8, 16 or 32) of `a` to 64 bits.
#[inline(always)]
pub fn sign_extend(bits: u8, a: u64) -> u64 {
    match bits {
        8 => a as i8 as i64 as u64,
        16 => a as i16 as i64 as u64,
        32 => a as i32 as i64 as u64,
        _ => a,
    }
}

/// Byte-order conversion: keep the low `bits` zero-extended, reversing their bytes if `swap`.
#[inline(always)]
pub fn end(bits: u8, swap: bool, a: u64) -> u64 {
    match (bits, swap) {
        (16, false) => a as u16 as u64,
        (32, false) => a as u32 as u64,
        (16, true) => (a as u16).swap_bytes() as u64,
        (32, true) => (a as u32).swap_bytes() as u64,
        (_, false) => a,
        (_, true) => a.swap_bytes(),
    }
}

/// The value an atomic read-modify-write stores, given the old memory value and the operand
/// (`Cmpxchg` is handled by its caller: it stores `operand` only when `old == r0`).
#[inline(always)]
pub fn atomic_new(op: AtomicOp, old: u64, operand: u64) -> u64 {
    match op {
        AtomicOp::Add => old.wrapping_add(operand),
        AtomicOp::Or => old | operand,
        AtomicOp::And => old & operand,
        AtomicOp::Xor => old ^ operand,
        AtomicOp::Xchg | AtomicOp::Cmpxchg => operand,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn division_corner_cases() {
        use AluOp::*;
        use Width::*;
        assert_eq!(alu(W64, Div, 7, 0), 0);
        assert_eq!(alu(W64, Mod, 7, 0), 7);
        assert_eq!(alu(W32, Mod, 0x1_0000_0007, 0), 7, "zero-extended");
        assert_eq!(alu(W64, Sdiv, i64::MIN as u64, u64::MAX), i64::MIN as u64);
        assert_eq!(alu(W64, Smod, i64::MIN as u64, u64::MAX), 0);
        assert_eq!(
            alu(W32, Sdiv, i32::MIN as u32 as u64, u32::MAX as u64),
            0x8000_0000
        );
        assert_eq!(alu(W64, Smod, (-7i64) as u64, 2), (-1i64) as u64);
        assert_eq!(alu(W32, Smod, (-7i32) as u32 as u64, 2), 0xffff_ffff);
        assert_eq!(alu(W64, Lsh, 1, 65), 2, "masked");
        assert_eq!(alu(W32, Lsh, 1, 33), 2, "masked");
        assert_eq!(mov(W32, 0xdead_beef_1122_3344), 0x1122_3344);
        assert_eq!(movsx(W32, 8, 0x80), 0xffff_ff80);
        assert_eq!(movsx(W64, 16, 0x8000), 0xffff_ffff_ffff_8000);
        assert_eq!(end(16, true, 0x1122_3344), 0x4433);
        assert_eq!(end(32, false, u64::MAX), 0xffff_ffff);
    }
}
