//! The instruction model: raw 8-byte slots ([`Insn`]) and their meaning ([`Op`]).
//!
//! [`Op::decode`] is the one place that says which encodings are valid eBPF (RFC 9669, ISA v4
//! included) and what they do; the verifier, the pointer analysis, the interpreter and the JIT
//! all work from the decoded form, so they cannot disagree about an encoding.

use std::fmt;

use crate::opcode::*;

/// One raw instruction slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Insn {
    /// Opcode byte: the class in bits 0-2, the rest as the class defines (see `opcode`).
    pub op: u8,
    /// Destination register (low nibble of byte 1).
    pub dst: u8,
    /// Source register (high nibble of byte 1).
    pub src: u8,
    /// Signed 16-bit offset.
    pub off: i16,
    /// Signed 32-bit immediate.
    pub imm: i32,
}

impl Insn {
    /// Builds a slot.
    pub const fn new(op: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            op,
            dst,
            src,
            off,
            imm,
        }
    }

    /// Decodes the slot at `bytes[0..8]`.
    pub fn decode(bytes: &[u8; INSN_SIZE]) -> Insn {
        Insn {
            op: bytes[0],
            dst: bytes[1] & 0x0f,
            src: bytes[1] >> 4,
            off: i16::from_le_bytes([bytes[2], bytes[3]]),
            imm: i32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
        }
    }

    /// Encodes the slot.
    pub fn encode(&self) -> [u8; INSN_SIZE] {
        let off = self.off.to_le_bytes();
        let imm = self.imm.to_le_bytes();
        [
            self.op,
            (self.src << 4) | (self.dst & 0x0f),
            off[0],
            off[1],
            imm[0],
            imm[1],
            imm[2],
            imm[3],
        ]
    }

    /// Opcode class (low three bits).
    pub fn class(&self) -> u8 {
        self.op & CLASS_MASK
    }

    /// True for `lddw`, which occupies two slots.
    pub fn is_wide(&self) -> bool {
        self.op == LDDW
    }

    /// True for a helper call by static id (`call imm`, src 0).
    pub fn is_helper_call(&self) -> bool {
        self.op == CALL && self.src == CALL_HELPER
    }

    /// True for a bpf-to-bpf call (`call pc+imm`, src 1).
    pub fn is_local_call(&self) -> bool {
        self.op == CALL && self.src == CALL_LOCAL
    }

    /// True for `exit`.
    pub fn is_exit(&self) -> bool {
        self.op == EXIT
    }

    /// True for an unconditional jump (`ja` or `ja32`).
    pub fn is_unconditional_jump(&self) -> bool {
        self.op == JA || self.op == JA32
    }

    /// True for a jump that carries a target: `ja`, `ja32` and every conditional jump.
    pub fn is_jump(&self) -> bool {
        matches!(self.class(), CLASS_JMP | CLASS_JMP32)
            && !matches!(self.op & OP_MASK, JMP_CALL | JMP_EXIT)
            && self.op & OP_MASK < 0xe0
    }

    /// Target slot of a jump or local call at `pc` (may lie outside the program; the verifier
    /// checks). `ja32` and local calls carry their displacement in `imm`, the others in `off`.
    pub fn target(&self, pc: usize) -> i64 {
        let delta = if self.is_local_call() || self.op == JA32 {
            self.imm as i64
        } else {
            self.off as i64
        };
        pc as i64 + 1 + delta
    }

    /// The `exit` instruction.
    pub const EXIT: Insn = Insn::new(EXIT, 0, 0, 0, 0);
}

/// Decodes a bytecode buffer; a trailing partial slot is ignored (the verifier reports it).
pub fn decode_all(code: &[u8]) -> Vec<Insn> {
    code.chunks_exact(INSN_SIZE)
        .map(|c| {
            let mut b = [0u8; INSN_SIZE];
            b.copy_from_slice(c);
            Insn::decode(&b)
        })
        .collect()
}

/// Encodes instructions back into bytecode.
pub fn encode_all(insns: &[Insn]) -> Vec<u8> {
    insns.iter().flat_map(|i| i.encode()).collect()
}

/// Operand width of an ALU operation or a jump comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Width {
    /// The low 32 bits; ALU results are zero-extended into the register.
    W32,
    /// All 64 bits.
    W64,
}

/// Second operand of an ALU operation, a comparison or a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// A register, r0 to r10.
    Reg(u8),
    /// The immediate (sign-extended to 64 bits for 64-bit operations).
    Imm(i32),
}

/// Binary ALU operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AluOp {
    /// Wrapping addition.
    Add,
    /// Wrapping subtraction.
    Sub,
    /// Wrapping multiplication.
    Mul,
    /// Unsigned division; by zero gives 0.
    Div,
    /// Signed division (ISA v4); by zero gives 0, `MIN / -1` gives `MIN`.
    Sdiv,
    /// Unsigned remainder; by zero leaves the dividend.
    Mod,
    /// Signed remainder (ISA v4), with the dividend's sign; by zero leaves the dividend.
    Smod,
    /// Bitwise or.
    Or,
    /// Bitwise and.
    And,
    /// Bitwise exclusive or.
    Xor,
    /// Left shift; the amount is masked to the width (`& 31` or `& 63`).
    Lsh,
    /// Logical right shift, masked amount.
    Rsh,
    /// Arithmetic right shift, masked amount.
    Arsh,
}

/// Conditions of conditional jumps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cond {
    /// `==`.
    Eq,
    /// `>` unsigned.
    Gt,
    /// `>=` unsigned.
    Ge,
    /// `dst & src != 0`.
    Set,
    /// `!=`.
    Ne,
    /// `>` signed.
    Sgt,
    /// `>=` signed.
    Sge,
    /// `<` unsigned.
    Lt,
    /// `<=` unsigned.
    Le,
    /// `<` signed.
    Slt,
    /// `<=` signed.
    Sle,
}

impl Cond {
    /// Evaluates the condition on `a` and `b` at `width`.
    #[inline(always)]
    pub fn holds(self, width: Width, a: u64, b: u64) -> bool {
        match width {
            Width::W64 => self.holds64(a, b),
            Width::W32 => self.holds32(a as u32, b as u32),
        }
    }

    #[inline(always)]
    fn holds64(self, a: u64, b: u64) -> bool {
        match self {
            Cond::Eq => a == b,
            Cond::Gt => a > b,
            Cond::Ge => a >= b,
            Cond::Set => a & b != 0,
            Cond::Ne => a != b,
            Cond::Sgt => (a as i64) > b as i64,
            Cond::Sge => (a as i64) >= b as i64,
            Cond::Lt => a < b,
            Cond::Le => a <= b,
            Cond::Slt => (a as i64) < b as i64,
            Cond::Sle => (a as i64) <= b as i64,
        }
    }

    #[inline(always)]
    fn holds32(self, a: u32, b: u32) -> bool {
        match self {
            Cond::Eq => a == b,
            Cond::Gt => a > b,
            Cond::Ge => a >= b,
            Cond::Set => a & b != 0,
            Cond::Ne => a != b,
            Cond::Sgt => (a as i32) > b as i32,
            Cond::Sge => (a as i32) >= b as i32,
            Cond::Lt => a < b,
            Cond::Le => a <= b,
            Cond::Slt => (a as i32) < b as i32,
            Cond::Sle => (a as i32) <= b as i32,
        }
    }
}

/// Read-modify-write operations of atomic instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AtomicOp {
    /// `*p += src`.
    Add,
    /// `*p |= src`.
    Or,
    /// `*p &= src`.
    And,
    /// `*p ^= src`.
    Xor,
    /// `src = xchg(*p, src)`.
    Xchg,
    /// `r0 = cmpxchg(*p, r0, src)`.
    Cmpxchg,
}

/// What one instruction does. Jump and call targets are absolute slot indices (they may lie
/// outside the program until the verifier has checked them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `dst = dst <op> src` at `width`.
    Alu {
        /// Operand width.
        width: Width,
        /// The binary operation; division and remainder by zero do not trap (see [`AluOp`]).
        op: AluOp,
        /// Destination (and first operand).
        dst: u8,
        /// Second operand.
        src: Operand,
    },
    /// `dst = -dst` at `width`.
    Neg {
        /// Operand width.
        width: Width,
        /// Register negated in place (r0 to r9).
        dst: u8,
    },
    /// `dst = src` at `width` (a 32-bit move zero-extends).
    Mov {
        /// Operand width.
        width: Width,
        /// Destination register (r0 to r9: r10 is read-only).
        dst: u8,
        /// Register or immediate copied (an immediate is sign-extended at `W64`).
        src: Operand,
    },
    /// `dst = sign_extend(low bits of src)` at `width` (ISA v4).
    MovSx {
        /// Result width (a 32-bit result is zero-extended).
        width: Width,
        /// Destination register (r0 to r9).
        dst: u8,
        /// Register whose low `bits` are sign-extended.
        src: u8,
        /// 8, 16 or 32.
        bits: u8,
    },
    /// Byte order: keep the low `bits` and zero-extend (`le`), or reverse them (`be`, `bswap`).
    End {
        /// Register converted in place (r0 to r9).
        dst: u8,
        /// 16, 32 or 64.
        bits: u8,
        /// Reverse the bytes (on this little-endian machine model: `be` and `bswap`).
        swap: bool,
    },
    /// `dst = imm` (64 bits, two slots).
    Lddw {
        /// Destination register (r0 to r9).
        dst: u8,
        /// The 64-bit value: low half from the first slot's `imm`, high half from the second's.
        imm: u64,
    },
    /// `dst = *(size *)(base + off)`, zero- or sign-extended.
    Load {
        /// Register loaded into (r0 to r9).
        dst: u8,
        /// Address register.
        base: u8,
        /// Signed byte offset added to the address in `base`.
        off: i16,
        /// Bytes: 1, 2, 4 or 8.
        size: u8,
        /// Sign-extend (ISA v4 `ldxs*`).
        signed: bool,
    },
    /// `*(size *)(base + off) = value`.
    Store {
        /// Address register.
        base: u8,
        /// Signed byte offset added to the address in `base`.
        off: i16,
        /// Bytes: 1, 2, 4 or 8.
        size: u8,
        /// Stored value (truncated to `size`).
        value: Operand,
    },
    /// An atomic read-modify-write of 4 or 8 bytes at `base + off`.
    Atomic {
        /// Address register.
        base: u8,
        /// Signed byte offset added to the address in `base`.
        off: i16,
        /// Bytes: 4 or 8.
        size: u8,
        /// The read-modify-write; `Xchg` and `Cmpxchg` always have `fetch` set.
        op: AtomicOp,
        /// The old value is written back into `src` (into `r0` for `Cmpxchg`).
        fetch: bool,
        /// Register holding the operand: `src` in the [`AtomicOp`] formulas.
        src: u8,
    },
    /// Unconditional jump (`ja`, or `ja32` with its displacement in `imm`).
    Ja {
        /// Absolute slot index jumped to.
        target: i64,
    },
    /// Conditional jump.
    Jump {
        /// Comparison width (`W32`: `jmp32`, which compares the low halves).
        width: Width,
        /// How `dst` is compared with `src`; the jump is taken when it holds.
        cond: Cond,
        /// Register on the left of `cond`.
        dst: u8,
        /// Register or immediate on the right of `cond`.
        src: Operand,
        /// Target slot when the condition holds.
        target: i64,
    },
    /// Call a helper by static id.
    CallHelper {
        /// Helper id; the verifier accepts only ids on its whitelist.
        id: u32,
    },
    /// Call the helper whose id is in a register (`callx`).
    CallReg {
        /// Register holding the id.
        reg: u8,
    },
    /// Call a local function.
    CallLocal {
        /// Slot of the function's first instruction.
        target: i64,
    },
    /// Return from the current function (`r0` is the result).
    Exit,
}

/// Which structural rule a decoding failure breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeRule {
    /// Unknown or unsupported opcode.
    Opcode,
    /// Bad register number, or a write to r10.
    Register,
    /// Bad immediate or offset field, or a malformed `lddw`.
    Immediate,
    /// A call kind the runtime does not support.
    Call,
}

/// Why a slot does not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DecodeError {
    /// The rule broken.
    pub rule: DecodeRule,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

fn err(rule: DecodeRule, reason: impl Into<String>) -> DecodeError {
    DecodeError {
        rule,
        reason: reason.into(),
    }
}

/// Highest register number (r10, the read-only frame pointer).
pub const FRAME_POINTER: u8 = 10;

impl Op {
    /// Decodes the instruction at `pc` (reading the second slot of `lddw`).
    pub fn decode(insns: &[Insn], pc: usize) -> Result<Op, DecodeError> {
        let insn = insns[pc];
        let bad_op = |why: &str| {
            err(
                DecodeRule::Opcode,
                format!("opcode {:#04x}: {why}", insn.op),
            )
        };
        if insn.dst > FRAME_POINTER || insn.src > FRAME_POINTER {
            return Err(err(
                DecodeRule::Register,
                format!("register r{} / r{} does not exist", insn.dst, insn.src),
            ));
        }
        let writes_dst = |op: Op| -> Result<Op, DecodeError> {
            if insn.dst == FRAME_POINTER {
                Err(err(
                    DecodeRule::Register,
                    "r10 (the frame pointer) is read-only",
                ))
            } else {
                Ok(op)
            }
        };
        let operand = if insn.op & SOURCE_MASK == SRC_X {
            Operand::Reg(insn.src)
        } else {
            Operand::Imm(insn.imm)
        };
        match insn.class() {
            CLASS_ALU | CLASS_ALU64 => {
                let width = if insn.class() == CLASS_ALU64 {
                    Width::W64
                } else {
                    Width::W32
                };
                let dst = insn.dst;
                let plain = |op: AluOp| -> Result<Op, DecodeError> {
                    if insn.off != 0 {
                        return Err(bad_op("nonzero offset on an ALU operation"));
                    }
                    writes_dst(Op::Alu {
                        width,
                        op,
                        dst,
                        src: operand,
                    })
                };
                let signed = |unsigned: AluOp, signed: AluOp| -> Result<Op, DecodeError> {
                    let op = match insn.off {
                        0 => unsigned,
                        1 => signed,
                        o => {
                            return Err(err(
                                DecodeRule::Immediate,
                                format!(
                                    "division offset {o} is neither 0 (unsigned) nor 1 (signed)"
                                ),
                            ))
                        }
                    };
                    writes_dst(Op::Alu {
                        width,
                        op,
                        dst,
                        src: operand,
                    })
                };
                match insn.op & OP_MASK {
                    ALU_ADD => plain(AluOp::Add),
                    ALU_SUB => plain(AluOp::Sub),
                    ALU_MUL => plain(AluOp::Mul),
                    ALU_OR => plain(AluOp::Or),
                    ALU_AND => plain(AluOp::And),
                    ALU_XOR => plain(AluOp::Xor),
                    ALU_LSH => plain(AluOp::Lsh),
                    ALU_RSH => plain(AluOp::Rsh),
                    ALU_ARSH => plain(AluOp::Arsh),
                    ALU_DIV => signed(AluOp::Div, AluOp::Sdiv),
                    ALU_MOD => signed(AluOp::Mod, AluOp::Smod),
                    ALU_NEG => {
                        if insn.op & SOURCE_MASK != SRC_K || insn.off != 0 {
                            return Err(bad_op("`neg` takes no source and no offset"));
                        }
                        writes_dst(Op::Neg { width, dst })
                    }
                    ALU_MOV => match (operand, insn.off) {
                        (_, 0) => writes_dst(Op::Mov {
                            width,
                            dst,
                            src: operand,
                        }),
                        (Operand::Reg(src), bits @ (8 | 16 | 32))
                            if !(width == Width::W32 && bits == 32) =>
                        {
                            writes_dst(Op::MovSx {
                                width,
                                dst,
                                src,
                                bits: bits as u8,
                            })
                        }
                        (_, o) => Err(err(
                            DecodeRule::Immediate,
                            format!("move offset {o} is not a sign-extension width for this move"),
                        )),
                    },
                    ALU_END => {
                        if !matches!(insn.imm, 16 | 32 | 64) {
                            return Err(err(
                                DecodeRule::Immediate,
                                format!("byte swap width {} is not 16, 32 or 64", insn.imm),
                            ));
                        }
                        let swap = match (width, insn.op & SOURCE_MASK) {
                            (Width::W32, END_TO_LE) => false,
                            (Width::W32, _) => true,
                            (Width::W64, END_TO_LE) => true,
                            (Width::W64, _) => {
                                return Err(bad_op("`bswap` has no source bit"));
                            }
                        };
                        writes_dst(Op::End {
                            dst,
                            bits: insn.imm as u8,
                            swap,
                        })
                    }
                    _ => Err(bad_op("unknown ALU operation")),
                }
            }
            CLASS_LD => {
                if insn.op != LDDW {
                    return Err(bad_op(
                        "legacy packet loads (ld_abs, ld_ind) are not supported",
                    ));
                }
                if insn.src != 0 {
                    return Err(err(
                        DecodeRule::Immediate,
                        format!(
                            "`lddw` with source {} (a map or BTF reference) is not supported",
                            insn.src
                        ),
                    ));
                }
                let Some(hi) = insns.get(pc + 1) else {
                    return Err(err(DecodeRule::Immediate, "`lddw` without its second slot"));
                };
                if hi.op != 0 || hi.dst != 0 || hi.src != 0 || hi.off != 0 {
                    return Err(err(
                        DecodeRule::Immediate,
                        "malformed second slot of `lddw`",
                    ));
                }
                writes_dst(Op::Lddw {
                    dst: insn.dst,
                    imm: (insn.imm as u32 as u64) | ((hi.imm as u32 as u64) << 32),
                })
            }
            CLASS_LDX => {
                let size = size_bytes(insn.op) as u8;
                let signed = match insn.op & MODE_MASK {
                    MODE_MEM => false,
                    MODE_MEMSX if size < 8 => true,
                    MODE_MEMSX => return Err(bad_op("an 8-byte load cannot sign-extend")),
                    _ => return Err(bad_op("unknown load mode")),
                };
                writes_dst(Op::Load {
                    dst: insn.dst,
                    base: insn.src,
                    off: insn.off,
                    size,
                    signed,
                })
            }
            CLASS_ST => {
                if insn.op & MODE_MASK != MODE_MEM {
                    return Err(bad_op("only plain stores of an immediate exist"));
                }
                Ok(Op::Store {
                    base: insn.dst,
                    off: insn.off,
                    size: size_bytes(insn.op) as u8,
                    value: Operand::Imm(insn.imm),
                })
            }
            CLASS_STX => {
                let size = size_bytes(insn.op) as u8;
                match insn.op & MODE_MASK {
                    MODE_MEM => Ok(Op::Store {
                        base: insn.dst,
                        off: insn.off,
                        size,
                        value: Operand::Reg(insn.src),
                    }),
                    MODE_ATOMIC => {
                        if size != 4 && size != 8 {
                            return Err(bad_op("atomic operations are 4 or 8 bytes wide"));
                        }
                        let (op, fetch) = match insn.imm {
                            ATOMIC_ADD => (AtomicOp::Add, false),
                            ATOMIC_OR => (AtomicOp::Or, false),
                            ATOMIC_AND => (AtomicOp::And, false),
                            ATOMIC_XOR => (AtomicOp::Xor, false),
                            x if x == ATOMIC_ADD | ATOMIC_FETCH => (AtomicOp::Add, true),
                            x if x == ATOMIC_OR | ATOMIC_FETCH => (AtomicOp::Or, true),
                            x if x == ATOMIC_AND | ATOMIC_FETCH => (AtomicOp::And, true),
                            x if x == ATOMIC_XOR | ATOMIC_FETCH => (AtomicOp::Xor, true),
                            ATOMIC_XCHG => (AtomicOp::Xchg, true),
                            ATOMIC_CMPXCHG => (AtomicOp::Cmpxchg, true),
                            other => {
                                return Err(err(
                                    DecodeRule::Immediate,
                                    format!("unknown atomic operation {other:#x}"),
                                ))
                            }
                        };
                        if fetch && op != AtomicOp::Cmpxchg && insn.src == FRAME_POINTER {
                            return Err(err(
                                DecodeRule::Register,
                                "r10 (the frame pointer) is read-only",
                            ));
                        }
                        Ok(Op::Atomic {
                            base: insn.dst,
                            off: insn.off,
                            size,
                            op,
                            fetch,
                            src: insn.src,
                        })
                    }
                    _ => Err(bad_op("unknown store mode")),
                }
            }
            CLASS_JMP | CLASS_JMP32 => {
                let width = if insn.class() == CLASS_JMP {
                    Width::W64
                } else {
                    Width::W32
                };
                let target = insn.target(pc);
                let cond = |cond: Cond| {
                    Ok(Op::Jump {
                        width,
                        cond,
                        dst: insn.dst,
                        src: operand,
                        target,
                    })
                };
                match insn.op & OP_MASK {
                    JMP_JA => {
                        if insn.op & SOURCE_MASK != SRC_K {
                            return Err(bad_op("`ja` takes no source register"));
                        }
                        Ok(Op::Ja { target })
                    }
                    JMP_JEQ => cond(Cond::Eq),
                    JMP_JGT => cond(Cond::Gt),
                    JMP_JGE => cond(Cond::Ge),
                    JMP_JSET => cond(Cond::Set),
                    JMP_JNE => cond(Cond::Ne),
                    JMP_JSGT => cond(Cond::Sgt),
                    JMP_JSGE => cond(Cond::Sge),
                    JMP_JLT => cond(Cond::Lt),
                    JMP_JLE => cond(Cond::Le),
                    JMP_JSLT => cond(Cond::Slt),
                    JMP_JSLE => cond(Cond::Sle),
                    JMP_CALL if width == Width::W64 => {
                        if insn.op & SOURCE_MASK == SRC_X {
                            return Ok(Op::CallReg { reg: insn.dst });
                        }
                        match insn.src {
                            CALL_HELPER => Ok(Op::CallHelper {
                                id: insn.imm as u32,
                            }),
                            CALL_LOCAL => Ok(Op::CallLocal { target }),
                            s => Err(err(
                                DecodeRule::Call,
                                format!(
                                    "call kind {s} ({}) is not supported",
                                    if s == CALL_KFUNC {
                                        "kfunc by BTF id"
                                    } else {
                                        "unknown"
                                    }
                                ),
                            )),
                        }
                    }
                    JMP_EXIT if width == Width::W64 && insn.op & SOURCE_MASK == SRC_K => {
                        Ok(Op::Exit)
                    }
                    _ => Err(bad_op("unknown jump operation")),
                }
            }
            _ => Err(bad_op("unknown class")),
        }
    }

    /// Slots the instruction occupies (2 for `lddw`).
    pub fn slots(&self) -> usize {
        match self {
            Op::Lddw { .. } => 2,
            _ => 1,
        }
    }

    /// True when control never continues with the next slot.
    pub fn ends_block(&self) -> bool {
        matches!(self, Op::Ja { .. } | Op::Exit)
    }
}

/// Decodes every instruction of `insns`; the second slot of `lddw` decodes as `None`.
pub fn decode_program(insns: &[Insn]) -> Result<Vec<Option<Op>>, (usize, DecodeError)> {
    let mut out = vec![None; insns.len()];
    let mut pc = 0;
    while pc < insns.len() {
        let op = Op::decode(insns, pc).map_err(|e| (pc, e))?;
        out[pc] = Some(op);
        pc += op.slots();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn encode_decode_round_trip(op: u8, dst in 0u8..16, src in 0u8..16, off: i16, imm: i32) {
            let i = Insn { op, dst, src, off, imm };
            prop_assert_eq!(Insn::decode(&i.encode()), i);
        }

        /// Decoding never panics, whatever the bytes.
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let insns = decode_all(&bytes);
            for pc in 0..insns.len() {
                let _ = Op::decode(&insns, pc);
            }
        }
    }

    #[test]
    fn targets() {
        let ja = Insn::new(JA, 0, 0, -1, 0);
        assert!(ja.is_jump());
        assert_eq!(ja.target(5), 5);
        let ja32 = Insn::new(JA32, 0, 0, 0, -3);
        assert!(ja32.is_jump() && ja32.is_unconditional_jump());
        assert_eq!(ja32.target(5), 3);
        let call = Insn::new(CALL, 0, CALL_LOCAL, 0, 3);
        assert!(call.is_local_call() && !call.is_jump());
        assert_eq!(call.target(2), 6);
    }

    #[test]
    fn v4_encodings_decode() {
        // sdiv64 r1, r2
        let i = [Insn::new(CLASS_ALU64 | ALU_DIV | SRC_X, 1, 2, 1, 0)];
        assert!(matches!(
            Op::decode(&i, 0),
            Ok(Op::Alu {
                op: AluOp::Sdiv,
                ..
            })
        ));
        // movsx r1, w2 (16 bits)
        let i = [Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 1, 2, 16, 0)];
        assert!(matches!(Op::decode(&i, 0), Ok(Op::MovSx { bits: 16, .. })));
        // a 32-bit move cannot sign-extend 32 bits
        let i = [Insn::new(CLASS_ALU | ALU_MOV | SRC_X, 1, 2, 32, 0)];
        assert!(Op::decode(&i, 0).is_err());
        // bswap64
        let i = [Insn::new(CLASS_ALU64 | ALU_END, 1, 0, 0, 64)];
        assert_eq!(
            Op::decode(&i, 0),
            Ok(Op::End {
                dst: 1,
                bits: 64,
                swap: true
            })
        );
        // ldxsw
        let i = [Insn::new(CLASS_LDX | MODE_MEMSX | SIZE_W, 1, 2, 4, 0)];
        assert!(matches!(
            Op::decode(&i, 0),
            Ok(Op::Load {
                signed: true,
                size: 4,
                ..
            })
        ));
        // lock cmpxchg
        let i = [Insn::new(
            CLASS_STX | MODE_ATOMIC | SIZE_DW,
            10,
            1,
            -8,
            ATOMIC_CMPXCHG,
        )];
        assert!(matches!(
            Op::decode(&i, 0),
            Ok(Op::Atomic {
                op: AtomicOp::Cmpxchg,
                ..
            })
        ));
        // callx r2
        let i = [Insn::new(CALLX, 2, 0, 0, 0)];
        assert_eq!(Op::decode(&i, 0), Ok(Op::CallReg { reg: 2 }));
    }

    #[test]
    fn refusals_name_the_rule() {
        let r10 = [Insn::new(CLASS_ALU64 | ALU_MOV, 10, 0, 0, 0)];
        assert_eq!(Op::decode(&r10, 0).unwrap_err().rule, DecodeRule::Register);
        let abs = [Insn::new(CLASS_LD | MODE_ABS | SIZE_W, 0, 0, 0, 0)];
        assert_eq!(Op::decode(&abs, 0).unwrap_err().rule, DecodeRule::Opcode);
        let kfunc = [Insn::new(CALL, 0, CALL_KFUNC, 0, 0)];
        assert_eq!(Op::decode(&kfunc, 0).unwrap_err().rule, DecodeRule::Call);
        let lone = [Insn::new(LDDW, 0, 0, 0, 0)];
        assert_eq!(
            Op::decode(&lone, 0).unwrap_err().rule,
            DecodeRule::Immediate
        );
    }
}
