//! The eBPF instruction set of RFC 9669, as numbers: instruction classes, size and mode fields,
//! source bits, ALU and jump operations, atomic operations, byte-swap widths and call kinds.
//! Every other module (loader, verifier, analysis, both engines, the test assembler) names
//! opcodes through these constants and never spells a raw byte.
//!
//! An opcode byte is `class` (bits 0-2) plus, for ALU and jump classes, `source` (bit 3) and
//! `operation` (bits 4-7); for load and store classes, `size` (bits 3-4) and `mode` (bits 5-7).

/// Size of one instruction slot in bytes.
pub const INSN_SIZE: usize = 8;

/// Mask of the class bits.
pub const CLASS_MASK: u8 = 0x07;
/// Immediate loads (`lddw`) and the legacy packet loads.
pub const CLASS_LD: u8 = 0x00;
/// Loads from memory into a register.
pub const CLASS_LDX: u8 = 0x01;
/// Stores of an immediate.
pub const CLASS_ST: u8 = 0x02;
/// Stores of a register, and atomic operations.
pub const CLASS_STX: u8 = 0x03;
/// 32-bit arithmetic: results are zero-extended into the 64-bit register.
pub const CLASS_ALU: u8 = 0x04;
/// 64-bit jumps, calls and exit.
pub const CLASS_JMP: u8 = 0x05;
/// 32-bit jumps: conditions compare the operands' low 32 bits.
pub const CLASS_JMP32: u8 = 0x06;
/// 64-bit arithmetic.
pub const CLASS_ALU64: u8 = 0x07;

/// Mask of the source bit (ALU and jump classes).
pub const SOURCE_MASK: u8 = 0x08;
/// The operand is the immediate.
pub const SRC_K: u8 = 0x00;
/// The operand is the source register.
pub const SRC_X: u8 = 0x08;

/// Mask of the operation bits (ALU and jump classes).
pub const OP_MASK: u8 = 0xf0;

/// ALU operation: `dst += src`.
pub const ALU_ADD: u8 = 0x00;
/// ALU operation: `dst -= src`.
pub const ALU_SUB: u8 = 0x10;
/// ALU operation: `dst *= src`.
pub const ALU_MUL: u8 = 0x20;
/// ALU operation: `dst /= src` (unsigned with offset 0, signed with offset 1).
pub const ALU_DIV: u8 = 0x30;
/// ALU operation: `dst |= src`.
pub const ALU_OR: u8 = 0x40;
/// ALU operation: `dst &= src`.
pub const ALU_AND: u8 = 0x50;
/// ALU operation: `dst <<= src` (shift amount masked to the operand width).
pub const ALU_LSH: u8 = 0x60;
/// ALU operation: `dst >>= src`, logical.
pub const ALU_RSH: u8 = 0x70;
/// ALU operation: `dst = -dst`.
pub const ALU_NEG: u8 = 0x80;
/// ALU operation: `dst %= src` (unsigned with offset 0, signed with offset 1).
pub const ALU_MOD: u8 = 0x90;
/// ALU operation: `dst ^= src`.
pub const ALU_XOR: u8 = 0xa0;
/// ALU operation: `dst = src` (with offset 8, 16 or 32: sign-extending move, ISA v4).
pub const ALU_MOV: u8 = 0xb0;
/// ALU operation: `dst >>= src`, arithmetic.
pub const ALU_ARSH: u8 = 0xc0;
/// ALU operation: byte-order conversion (`le`/`be` in class ALU, `bswap` in class ALU64).
pub const ALU_END: u8 = 0xd0;

/// `le` / `bswap` source bit value: to little-endian (class ALU) or unconditional (ALU64).
pub const END_TO_LE: u8 = 0x00;
/// `be` source bit value: to big-endian (class ALU).
pub const END_TO_BE: u8 = 0x08;

/// Jump operation: unconditional (`ja`; in class JMP32, `ja32` with the offset in `imm`).
pub const JMP_JA: u8 = 0x00;
/// Jump if equal.
pub const JMP_JEQ: u8 = 0x10;
/// Jump if greater, unsigned.
pub const JMP_JGT: u8 = 0x20;
/// Jump if greater or equal, unsigned.
pub const JMP_JGE: u8 = 0x30;
/// Jump if `dst & src != 0`.
pub const JMP_JSET: u8 = 0x40;
/// Jump if not equal.
pub const JMP_JNE: u8 = 0x50;
/// Jump if greater, signed.
pub const JMP_JSGT: u8 = 0x60;
/// Jump if greater or equal, signed.
pub const JMP_JSGE: u8 = 0x70;
/// Call: a helper (`src` 0), a local function (`src` 1), or a helper by register (`callx`).
pub const JMP_CALL: u8 = 0x80;
/// Return from the current function.
pub const JMP_EXIT: u8 = 0x90;
/// Jump if less, unsigned.
pub const JMP_JLT: u8 = 0xa0;
/// Jump if less or equal, unsigned.
pub const JMP_JLE: u8 = 0xb0;
/// Jump if less, signed.
pub const JMP_JSLT: u8 = 0xc0;
/// Jump if less or equal, signed.
pub const JMP_JSLE: u8 = 0xd0;

/// `src` field of a call to a helper by static id.
pub const CALL_HELPER: u8 = 0;
/// `src` field of a call to a local (bpf-to-bpf) function at `pc + 1 + imm`.
pub const CALL_LOCAL: u8 = 1;
/// `src` field of a call to a helper by BTF id (kfunc): not supported.
pub const CALL_KFUNC: u8 = 2;

/// Mask of the size bits (load and store classes).
pub const SIZE_MASK: u8 = 0x18;
/// 4 bytes.
pub const SIZE_W: u8 = 0x00;
/// 2 bytes.
pub const SIZE_H: u8 = 0x08;
/// 1 byte.
pub const SIZE_B: u8 = 0x10;
/// 8 bytes.
pub const SIZE_DW: u8 = 0x18;

/// Mask of the mode bits (load and store classes).
pub const MODE_MASK: u8 = 0xe0;
/// `lddw`: a 64-bit immediate over two slots.
pub const MODE_IMM: u8 = 0x00;
/// Legacy packet load, absolute: not supported.
pub const MODE_ABS: u8 = 0x20;
/// Legacy packet load, indirect: not supported.
pub const MODE_IND: u8 = 0x40;
/// Plain memory access.
pub const MODE_MEM: u8 = 0x60;
/// Sign-extending load (ISA v4).
pub const MODE_MEMSX: u8 = 0x80;
/// Atomic operation (class STX only).
pub const MODE_ATOMIC: u8 = 0xc0;

/// Atomic operation (in `imm`): add.
pub const ATOMIC_ADD: i32 = 0x00;
/// Atomic operation: or.
pub const ATOMIC_OR: i32 = 0x40;
/// Atomic operation: and.
pub const ATOMIC_AND: i32 = 0x50;
/// Atomic operation: xor.
pub const ATOMIC_XOR: i32 = 0xa0;
/// Flag on an atomic operation: the old value is returned in `src`.
pub const ATOMIC_FETCH: i32 = 0x01;
/// Atomic exchange (always fetches).
pub const ATOMIC_XCHG: i32 = 0xe0 | ATOMIC_FETCH;
/// Atomic compare-and-exchange against `r0` (always fetches into `r0`).
pub const ATOMIC_CMPXCHG: i32 = 0xf0 | ATOMIC_FETCH;

/// `lddw`: a 64-bit immediate load over two slots.
pub const LDDW: u8 = CLASS_LD | SIZE_DW | MODE_IMM;
/// `exit`: return from the current function with `r0`.
pub const EXIT: u8 = CLASS_JMP | JMP_EXIT;
/// `call` (helper or local).
pub const CALL: u8 = CLASS_JMP | JMP_CALL;
/// `callx` (helper id in the `dst` register).
pub const CALLX: u8 = CLASS_JMP | JMP_CALL | SRC_X;
/// `ja` (16-bit offset).
pub const JA: u8 = CLASS_JMP | JMP_JA;
/// `ja32` / `gotol` (32-bit offset in `imm`).
pub const JA32: u8 = CLASS_JMP32 | JMP_JA;

/// Bytes accessed by a load or store with this size field.
pub const fn size_bytes(size: u8) -> u64 {
    match size & SIZE_MASK {
        SIZE_W => 4,
        SIZE_H => 2,
        SIZE_B => 1,
        _ => 8,
    }
}

/// The size field for an access of `bytes` (1, 2, 4 or 8).
pub const fn size_field(bytes: u64) -> u8 {
    match bytes {
        1 => SIZE_B,
        2 => SIZE_H,
        4 => SIZE_W,
        _ => SIZE_DW,
    }
}
