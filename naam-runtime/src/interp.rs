//! The checked eBPF interpreter: the engine for untrusted handlers.
//!
//! rbpf 0.4's interpreter checks only where an access *starts* against its allowed ranges and
//! cannot tell reads from writes, so it cannot enforce read-only descriptors. This interpreter
//! checks every byte of every access against the invocation's [`MemoryMap`] (context, stack,
//! granted segments with their rights, read-only data), counts instructions against a budget,
//! stops at the abort helper, and allocates nothing per invocation. Arithmetic follows rbpf's
//! semantics exactly (division by zero yields 0, modulo by zero keeps the destination), so the
//! JIT and the interpreter agree.

use naam_ebpf::abi::STACK_SIZE;
use rbpf::ebpf;

use crate::helpers::{HelperResult, HelperState};
use crate::insn::Insn;

/// Maximum depth of bpf-to-bpf calls (as rbpf).
pub const MAX_CALL_DEPTH: usize = ebpf::MAX_CALL_DEPTH;
/// Bytes of stack the interpreter needs: one frame per call level.
pub const INTERP_STACK_BYTES: usize = STACK_SIZE * MAX_CALL_DEPTH;

/// Why an invocation stopped abnormally.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VmError {
    /// A load or store outside the memory the invocation may use.
    #[error("insn {pc}: {kind} of {len} bytes at {addr:#x} is outside the context, stack and granted segments")]
    OutOfBounds {
        /// Instruction index.
        pc: usize,
        /// "load" or "store".
        kind: &'static str,
        /// Address accessed.
        addr: u64,
        /// Access size.
        len: u64,
    },
    /// The handler called the abort helper (a panic, or an explicit abort).
    #[error("handler aborted with code {code}{}", if *.code == naam_ebpf::abi::abort_code::PANIC { " (panic)" } else { "" })]
    Aborted {
        /// The abort code.
        code: u64,
    },
    /// The instruction budget ran out.
    #[error("instruction budget of {limit} exhausted")]
    Budget {
        /// The budget.
        limit: u64,
    },
    /// Calls nested deeper than [`MAX_CALL_DEPTH`].
    #[error("insn {pc}: calls nested deeper than {MAX_CALL_DEPTH}")]
    CallDepth {
        /// Instruction index.
        pc: usize,
    },
    /// A call to a helper id nobody implements.
    #[error("insn {pc}: unknown helper {id}")]
    UnknownHelper {
        /// Instruction index.
        pc: usize,
        /// Helper id.
        id: u32,
    },
    /// An instruction the interpreter does not implement (unverified code).
    #[error("insn {pc}: invalid instruction (opcode {op:#04x})")]
    InvalidInstruction {
        /// Instruction index.
        pc: usize,
        /// Opcode.
        op: u8,
    },
    /// Control left the program (unverified code).
    #[error("control left the program at insn {pc}")]
    FellOff {
        /// Instruction index reached.
        pc: usize,
    },
    /// The JIT engine could not run (engine-level failure).
    #[error("engine failure: {0}")]
    Engine(String),
}

/// A normal end of execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    /// Value of r0 at the final `exit`.
    pub r0: u64,
    /// Instructions executed.
    pub insns: u64,
}

struct Frame {
    saved: [u64; 4],
    return_pc: usize,
}

/// Runs `code` with `r1 = ctx`. `stack` must be [`INTERP_STACK_BYTES`] long and already be part
/// of `state.mem` (writable), as must the context and every granted segment.
pub fn run(
    code: &[Insn],
    ctx: u64,
    stack: &mut [u8],
    state: &mut HelperState,
    budget: u64,
) -> Result<Exit, VmError> {
    debug_assert!(stack.len() >= INTERP_STACK_BYTES);
    let stack_top = stack.as_mut_ptr() as u64 + INTERP_STACK_BYTES as u64;
    let mut reg = [0u64; 11];
    reg[1] = ctx;
    reg[10] = stack_top;
    let mut frames: [Frame; MAX_CALL_DEPTH] = std::array::from_fn(|_| Frame {
        saved: [0; 4],
        return_pc: 0,
    });
    let mut depth = 0usize;
    let mut pc = 0usize;
    let mut executed = 0u64;

    macro_rules! load {
        ($t:ty, $addr:expr, $at:expr) => {{
            let addr: u64 = $addr;
            let len = std::mem::size_of::<$t>() as u64;
            if !state.mem.allows(addr, len, false) {
                return Err(VmError::OutOfBounds {
                    pc: $at,
                    kind: "load",
                    addr,
                    len,
                });
            }
            // SAFETY: the memory map proved [addr, addr + len) is readable memory of this call.
            unsafe { std::ptr::read_unaligned(addr as *const $t) as u64 }
        }};
    }
    macro_rules! store {
        ($t:ty, $addr:expr, $val:expr, $at:expr) => {{
            let addr: u64 = $addr;
            let len = std::mem::size_of::<$t>() as u64;
            if !state.mem.allows(addr, len, true) {
                return Err(VmError::OutOfBounds {
                    pc: $at,
                    kind: "store",
                    addr,
                    len,
                });
            }
            // SAFETY: the memory map proved [addr, addr + len) is writable memory of this call.
            unsafe { std::ptr::write_unaligned(addr as *mut $t, $val as $t) }
        }};
    }

    loop {
        let Some(&insn) = code.get(pc) else {
            return Err(VmError::FellOff { pc });
        };
        executed += 1;
        if executed > budget {
            return Err(VmError::Budget { limit: budget });
        }
        let at = pc;
        pc += 1;
        let dst = insn.dst as usize;
        let src = insn.src as usize;
        if dst > 10 || src > 10 {
            return Err(VmError::InvalidInstruction {
                pc: at,
                op: insn.op,
            });
        }
        let imm = insn.imm as i64 as u64;
        let imm32 = insn.imm as u32;
        let off = insn.off as i64 as u64;
        let jump = |cond: bool, pc: &mut usize| {
            if cond {
                *pc = (*pc as i64 + insn.off as i64) as usize;
            }
        };
        match insn.op {
            // Loads and stores.
            ebpf::LD_DW_IMM => {
                let Some(hi) = code.get(pc) else {
                    return Err(VmError::FellOff { pc });
                };
                reg[dst] = (imm32 as u64) | ((hi.imm as u32 as u64) << 32);
                pc += 1;
            }
            ebpf::LD_B_REG => reg[dst] = load!(u8, reg[src].wrapping_add(off), at),
            ebpf::LD_H_REG => reg[dst] = load!(u16, reg[src].wrapping_add(off), at),
            ebpf::LD_W_REG => reg[dst] = load!(u32, reg[src].wrapping_add(off), at),
            ebpf::LD_DW_REG => reg[dst] = load!(u64, reg[src].wrapping_add(off), at),
            ebpf::ST_B_IMM => store!(u8, reg[dst].wrapping_add(off), imm, at),
            ebpf::ST_H_IMM => store!(u16, reg[dst].wrapping_add(off), imm, at),
            ebpf::ST_W_IMM => store!(u32, reg[dst].wrapping_add(off), imm, at),
            ebpf::ST_DW_IMM => store!(u64, reg[dst].wrapping_add(off), imm, at),
            ebpf::ST_B_REG => store!(u8, reg[dst].wrapping_add(off), reg[src], at),
            ebpf::ST_H_REG => store!(u16, reg[dst].wrapping_add(off), reg[src], at),
            ebpf::ST_W_REG => store!(u32, reg[dst].wrapping_add(off), reg[src], at),
            ebpf::ST_DW_REG => store!(u64, reg[dst].wrapping_add(off), reg[src], at),

            // 32-bit ALU: results are zero-extended.
            ebpf::ADD32_IMM => reg[dst] = (reg[dst] as u32).wrapping_add(imm32) as u64,
            ebpf::ADD32_REG => reg[dst] = (reg[dst] as u32).wrapping_add(reg[src] as u32) as u64,
            ebpf::SUB32_IMM => reg[dst] = (reg[dst] as u32).wrapping_sub(imm32) as u64,
            ebpf::SUB32_REG => reg[dst] = (reg[dst] as u32).wrapping_sub(reg[src] as u32) as u64,
            ebpf::MUL32_IMM => reg[dst] = (reg[dst] as u32).wrapping_mul(imm32) as u64,
            ebpf::MUL32_REG => reg[dst] = (reg[dst] as u32).wrapping_mul(reg[src] as u32) as u64,
            ebpf::DIV32_IMM | ebpf::DIV32_REG => {
                let s = if insn.op == ebpf::DIV32_IMM {
                    imm32
                } else {
                    reg[src] as u32
                };
                reg[dst] = (reg[dst] as u32).checked_div(s).unwrap_or(0) as u64;
            }
            ebpf::MOD32_IMM | ebpf::MOD32_REG => {
                let s = if insn.op == ebpf::MOD32_IMM {
                    imm32
                } else {
                    reg[src] as u32
                };
                if s != 0 {
                    reg[dst] = (reg[dst] as u32 % s) as u64;
                }
            }
            ebpf::OR32_IMM => reg[dst] = (reg[dst] as u32 | imm32) as u64,
            ebpf::OR32_REG => reg[dst] = (reg[dst] as u32 | reg[src] as u32) as u64,
            ebpf::AND32_IMM => reg[dst] = (reg[dst] as u32 & imm32) as u64,
            ebpf::AND32_REG => reg[dst] = (reg[dst] as u32 & reg[src] as u32) as u64,
            ebpf::XOR32_IMM => reg[dst] = (reg[dst] as u32 ^ imm32) as u64,
            ebpf::XOR32_REG => reg[dst] = (reg[dst] as u32 ^ reg[src] as u32) as u64,
            ebpf::LSH32_IMM => reg[dst] = (reg[dst] as u32).wrapping_shl(imm32) as u64,
            ebpf::LSH32_REG => reg[dst] = (reg[dst] as u32).wrapping_shl(reg[src] as u32) as u64,
            ebpf::RSH32_IMM => reg[dst] = (reg[dst] as u32).wrapping_shr(imm32) as u64,
            ebpf::RSH32_REG => reg[dst] = (reg[dst] as u32).wrapping_shr(reg[src] as u32) as u64,
            ebpf::ARSH32_IMM => reg[dst] = (reg[dst] as i32).wrapping_shr(imm32) as u32 as u64,
            ebpf::ARSH32_REG => {
                reg[dst] = (reg[dst] as i32).wrapping_shr(reg[src] as u32) as u32 as u64
            }
            ebpf::NEG32 => reg[dst] = (reg[dst] as i32).wrapping_neg() as u32 as u64,
            ebpf::MOV32_IMM => reg[dst] = imm32 as u64,
            ebpf::MOV32_REG => reg[dst] = reg[src] as u32 as u64,
            ebpf::LE => {
                reg[dst] = match insn.imm {
                    16 => reg[dst] as u16 as u64,
                    32 => reg[dst] as u32 as u64,
                    64 => reg[dst],
                    _ => {
                        return Err(VmError::InvalidInstruction {
                            pc: at,
                            op: insn.op,
                        })
                    }
                }
            }
            ebpf::BE => {
                reg[dst] = match insn.imm {
                    16 => (reg[dst] as u16).swap_bytes() as u64,
                    32 => (reg[dst] as u32).swap_bytes() as u64,
                    64 => reg[dst].swap_bytes(),
                    _ => {
                        return Err(VmError::InvalidInstruction {
                            pc: at,
                            op: insn.op,
                        })
                    }
                }
            }

            // 64-bit ALU.
            ebpf::ADD64_IMM => reg[dst] = reg[dst].wrapping_add(imm),
            ebpf::ADD64_REG => reg[dst] = reg[dst].wrapping_add(reg[src]),
            ebpf::SUB64_IMM => reg[dst] = reg[dst].wrapping_sub(imm),
            ebpf::SUB64_REG => reg[dst] = reg[dst].wrapping_sub(reg[src]),
            ebpf::MUL64_IMM => reg[dst] = reg[dst].wrapping_mul(imm),
            ebpf::MUL64_REG => reg[dst] = reg[dst].wrapping_mul(reg[src]),
            ebpf::DIV64_IMM | ebpf::DIV64_REG => {
                let s = if insn.op == ebpf::DIV64_IMM {
                    imm
                } else {
                    reg[src]
                };
                reg[dst] = reg[dst].checked_div(s).unwrap_or(0);
            }
            ebpf::MOD64_IMM | ebpf::MOD64_REG => {
                let s = if insn.op == ebpf::MOD64_IMM {
                    imm
                } else {
                    reg[src]
                };
                if s != 0 {
                    reg[dst] %= s;
                }
            }
            ebpf::OR64_IMM => reg[dst] |= imm,
            ebpf::OR64_REG => reg[dst] |= reg[src],
            ebpf::AND64_IMM => reg[dst] &= imm,
            ebpf::AND64_REG => reg[dst] &= reg[src],
            ebpf::XOR64_IMM => reg[dst] ^= imm,
            ebpf::XOR64_REG => reg[dst] ^= reg[src],
            ebpf::LSH64_IMM => reg[dst] = reg[dst].wrapping_shl(imm as u32),
            ebpf::LSH64_REG => reg[dst] = reg[dst].wrapping_shl(reg[src] as u32),
            ebpf::RSH64_IMM => reg[dst] = reg[dst].wrapping_shr(imm as u32),
            ebpf::RSH64_REG => reg[dst] = reg[dst].wrapping_shr(reg[src] as u32),
            ebpf::ARSH64_IMM => reg[dst] = (reg[dst] as i64).wrapping_shr(imm as u32) as u64,
            ebpf::ARSH64_REG => reg[dst] = (reg[dst] as i64).wrapping_shr(reg[src] as u32) as u64,
            ebpf::NEG64 => reg[dst] = (reg[dst] as i64).wrapping_neg() as u64,
            ebpf::MOV64_IMM => reg[dst] = imm,
            ebpf::MOV64_REG => reg[dst] = reg[src],

            // Jumps (offsets relative to the next instruction).
            ebpf::JA => jump(true, &mut pc),
            ebpf::JEQ_IMM => jump(reg[dst] == imm, &mut pc),
            ebpf::JEQ_REG => jump(reg[dst] == reg[src], &mut pc),
            ebpf::JGT_IMM => jump(reg[dst] > imm, &mut pc),
            ebpf::JGT_REG => jump(reg[dst] > reg[src], &mut pc),
            ebpf::JGE_IMM => jump(reg[dst] >= imm, &mut pc),
            ebpf::JGE_REG => jump(reg[dst] >= reg[src], &mut pc),
            ebpf::JLT_IMM => jump(reg[dst] < imm, &mut pc),
            ebpf::JLT_REG => jump(reg[dst] < reg[src], &mut pc),
            ebpf::JLE_IMM => jump(reg[dst] <= imm, &mut pc),
            ebpf::JLE_REG => jump(reg[dst] <= reg[src], &mut pc),
            ebpf::JSET_IMM => jump(reg[dst] & imm != 0, &mut pc),
            ebpf::JSET_REG => jump(reg[dst] & reg[src] != 0, &mut pc),
            ebpf::JNE_IMM => jump(reg[dst] != imm, &mut pc),
            ebpf::JNE_REG => jump(reg[dst] != reg[src], &mut pc),
            ebpf::JSGT_IMM => jump(reg[dst] as i64 > imm as i64, &mut pc),
            ebpf::JSGT_REG => jump(reg[dst] as i64 > reg[src] as i64, &mut pc),
            ebpf::JSGE_IMM => jump(reg[dst] as i64 >= imm as i64, &mut pc),
            ebpf::JSGE_REG => jump(reg[dst] as i64 >= reg[src] as i64, &mut pc),
            ebpf::JSLT_IMM => jump((reg[dst] as i64) < imm as i64, &mut pc),
            ebpf::JSLT_REG => jump((reg[dst] as i64) < reg[src] as i64, &mut pc),
            ebpf::JSLE_IMM => jump(reg[dst] as i64 <= imm as i64, &mut pc),
            ebpf::JSLE_REG => jump(reg[dst] as i64 <= reg[src] as i64, &mut pc),

            ebpf::JEQ_IMM32 => jump(reg[dst] as u32 == imm32, &mut pc),
            ebpf::JEQ_REG32 => jump(reg[dst] as u32 == reg[src] as u32, &mut pc),
            ebpf::JGT_IMM32 => jump(reg[dst] as u32 > imm32, &mut pc),
            ebpf::JGT_REG32 => jump(reg[dst] as u32 > reg[src] as u32, &mut pc),
            ebpf::JGE_IMM32 => jump(reg[dst] as u32 >= imm32, &mut pc),
            ebpf::JGE_REG32 => jump(reg[dst] as u32 >= reg[src] as u32, &mut pc),
            ebpf::JLT_IMM32 => jump((reg[dst] as u32) < imm32, &mut pc),
            ebpf::JLT_REG32 => jump((reg[dst] as u32) < reg[src] as u32, &mut pc),
            ebpf::JLE_IMM32 => jump(reg[dst] as u32 <= imm32, &mut pc),
            ebpf::JLE_REG32 => jump(reg[dst] as u32 <= reg[src] as u32, &mut pc),
            ebpf::JSET_IMM32 => jump(reg[dst] as u32 & imm32 != 0, &mut pc),
            ebpf::JSET_REG32 => jump(reg[dst] as u32 & reg[src] as u32 != 0, &mut pc),
            ebpf::JNE_IMM32 => jump(reg[dst] as u32 != imm32, &mut pc),
            ebpf::JNE_REG32 => jump(reg[dst] as u32 != reg[src] as u32, &mut pc),
            ebpf::JSGT_IMM32 => jump(reg[dst] as i32 > insn.imm, &mut pc),
            ebpf::JSGT_REG32 => jump(reg[dst] as i32 > reg[src] as i32, &mut pc),
            ebpf::JSGE_IMM32 => jump(reg[dst] as i32 >= insn.imm, &mut pc),
            ebpf::JSGE_REG32 => jump(reg[dst] as i32 >= reg[src] as i32, &mut pc),
            ebpf::JSLT_IMM32 => jump((reg[dst] as i32) < insn.imm, &mut pc),
            ebpf::JSLT_REG32 => jump((reg[dst] as i32) < reg[src] as i32, &mut pc),
            ebpf::JSLE_IMM32 => jump(reg[dst] as i32 <= insn.imm, &mut pc),
            ebpf::JSLE_REG32 => jump(reg[dst] as i32 <= reg[src] as i32, &mut pc),

            ebpf::CALL => match insn.src {
                0 => {
                    let id = insn.imm as u32;
                    match state.call(id, [reg[1], reg[2], reg[3], reg[4], reg[5]]) {
                        HelperResult::Value(v) => reg[0] = v,
                        HelperResult::Abort(code) => return Err(VmError::Aborted { code }),
                        HelperResult::Unknown => return Err(VmError::UnknownHelper { pc: at, id }),
                    }
                }
                1 => {
                    if depth + 1 >= MAX_CALL_DEPTH {
                        return Err(VmError::CallDepth { pc: at });
                    }
                    frames[depth] = Frame {
                        saved: [reg[6], reg[7], reg[8], reg[9]],
                        return_pc: pc,
                    };
                    depth += 1;
                    reg[10] = stack_top - (STACK_SIZE * depth) as u64;
                    pc = (pc as i64 + insn.imm as i64) as usize;
                }
                _ => {
                    return Err(VmError::InvalidInstruction {
                        pc: at,
                        op: insn.op,
                    })
                }
            },
            ebpf::EXIT => {
                if depth == 0 {
                    return Ok(Exit {
                        r0: reg[0],
                        insns: executed,
                    });
                }
                depth -= 1;
                let f = &frames[depth];
                reg[6..10].copy_from_slice(&f.saved);
                reg[10] = stack_top - (STACK_SIZE * depth) as u64;
                pc = f.return_pc;
            }
            op => return Err(VmError::InvalidInstruction { pc: at, op }),
        }
    }
}
