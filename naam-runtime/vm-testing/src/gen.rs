//! Differential testing: random verifiable programs built from raw bytes, and the check that
//! both engines (and, under qemu, aarch64 code) agree on them.
//!
//! [`generate`] turns any byte string into a program that passes the verifier: every ALU32 and
//! ALU64 operation (division by zero and `MIN / -1` included), ISA v4 forms, constants, counted
//! and endless loops, forward jumps, local calls and recursion, loads, stores and atomics on
//! the stack and on the run's memory (in bounds, out of bounds, misaligned, through wild
//! pointers) and helper calls. [`check`] runs it on the interpreter and on the JIT over the
//! same VM and memory, and compares `r0` or the fault, the instruction count, the memory, the
//! stack and the trace. The cargo-fuzz target `differential`, the property tests and the
//! aarch64 tests all use these two functions.

use naam_proto::EngineKind;
use naam_vm::insn::{encode_all, Insn};
use naam_vm::opcode::*;
use naam_vm::HelperSet;
use naam_vm::Program;
use naam_vm::VerifierConfig;
use naam_vm::{Entry, ExecOptions, Executable, StepError, Vm, VmError};

/// Reads decisions from fuzzer bytes; past the end every decision is 0, so every input is a
/// (short) program.
#[derive(Clone, Debug)]
pub struct Choices<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Choices<'a> {
    /// Decisions from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Choices { data, pos: 0 }
    }

    /// True when every byte was used.
    pub fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }

    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    fn u64(&mut self) -> u64 {
        self.u32() as u64 | (self.u32() as u64) << 32
    }

    /// A value in `0..n` (`n > 0`).
    fn below(&mut self, n: u32) -> u32 {
        if n <= 256 {
            self.byte() as u32 % n
        } else {
            self.u32() % n
        }
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u32) as usize]
    }

    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }
}

/// What generated programs may contain.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct GenConfig {
    /// Statements per function (each becomes one to a dozen instructions).
    pub statements: usize,
    /// Bytes of the run's memory.
    pub memory_len: usize,
    /// Loads, stores, atomics and helper calls.
    pub memory: bool,
    /// Local calls (and recursion).
    pub calls: bool,
    /// ISA v4 forms.
    pub v4: bool,
    /// Loops that never end (the budget stops them).
    pub endless_loops: bool,
    /// Never let an address reach a value the program can observe (r0, memory, the trace):
    /// needed when the other side maps memory elsewhere (aarch64 under qemu).
    pub no_address_leaks: bool,
    /// Only what rbpf 0.4's interpreter implements with the same meaning: ALU (no remainder
    /// of a 32-bit division by a register that may be zero, no division by a constant zero),
    /// constants and forward jumps.
    pub rbpf_subset: bool,
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig {
            statements: 24,
            memory_len: 64,
            memory: true,
            calls: true,
            v4: true,
            endless_loops: true,
            no_address_leaks: false,
            rbpf_subset: false,
        }
    }
}

impl GenConfig {
    /// Programs rbpf 0.4's interpreter runs with the same meaning.
    pub fn rbpf() -> Self {
        GenConfig {
            memory: false,
            calls: false,
            v4: false,
            endless_loops: false,
            no_address_leaks: true,
            rbpf_subset: true,
            ..GenConfig::default()
        }
    }

    /// Programs whose observable results do not depend on where memory is mapped.
    pub fn position_independent() -> Self {
        GenConfig {
            no_address_leaks: true,
            ..GenConfig::default()
        }
    }
}

/// A generated program and the initial contents of its memory.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The program (raw memory entry: `r1` = memory, `r2` = its length).
    pub program: Program,
    /// Initial contents of the run's memory (what `r1` points at).
    pub memory: Vec<u8>,
}

/// One unresolved piece of a function.
#[derive(Clone, Copy, Debug)]
enum Item {
    Insn(Insn),
    /// A jump with a label target (`op` is a conditional jump, `ja` or `ja32`).
    Jump {
        insn: Insn,
        label: usize,
    },
    Label(usize),
    /// A local call to function `f`.
    Call(usize),
}

/// Registers statements may overwrite (r6 holds the memory address, r7 its length, r9 is the
/// loop counter).
const SCRATCH: [u8; 7] = [0, 1, 2, 3, 4, 5, 8];
const LOOP_COUNTER: u8 = 9;
const MEM_BASE: u8 = 6;
const MEM_LEN: u8 = 7;

const IMM32: [i32; 14] = [
    0,
    1,
    -1,
    2,
    7,
    31,
    32,
    63,
    64,
    0x7fff_ffff,
    i32::MIN,
    0x1234_5678,
    -2,
    255,
];

const IMM64: [u64; 8] = [
    0,
    1,
    u64::MAX,
    i64::MIN as u64,
    i64::MAX as u64,
    0xdead_beef_1122_3344,
    0x8000_0000,
    0xffff_ffff,
];

struct Builder<'c, 'd> {
    c: &'c mut Choices<'d>,
    cfg: GenConfig,
    items: Vec<Item>,
    labels: usize,
    function: usize,
    functions: usize,
    in_loop: bool,
}

fn alu_op(code: u8, width_class: u8, src_x: bool) -> u8 {
    width_class | code | if src_x { SRC_X } else { SRC_K }
}

impl Builder<'_, '_> {
    fn emit(&mut self, insn: Insn) {
        self.items.push(Item::Insn(insn));
    }

    fn label(&mut self) -> usize {
        self.labels += 1;
        self.labels - 1
    }

    fn scratch(&mut self) -> u8 {
        self.c.pick(&SCRATCH)
    }

    /// A source register: scratch registers, and (unless addresses must not leak) r6, r7, r9
    /// and r10.
    fn source(&mut self) -> u8 {
        if self.cfg.rbpf_subset {
            // rbpf sets no r2 (our length in r7) and has its own stack: values only.
            let regs = [0, 1, 2, 3, 4, 5, 8, LOOP_COUNTER];
            self.c.pick(&regs)
        } else if self.cfg.no_address_leaks {
            // r7 is a length, r9 a counter: not addresses.
            let regs = [0, 1, 2, 3, 4, 5, 8, MEM_LEN, LOOP_COUNTER];
            self.c.pick(&regs)
        } else {
            self.c.below(11) as u8
        }
    }

    fn imm(&mut self) -> i32 {
        if self.c.chance(70) {
            self.c.pick(&IMM32)
        } else {
            self.c.u32() as i32
        }
    }

    fn statement(&mut self, depth: u32) {
        let memory = self.cfg.memory;
        let weight = self.c.below(100);
        match weight {
            0..=34 => self.alu(),
            35..=42 => self.moves(),
            43..=46 => {
                let dst = self.scratch();
                let v = if self.c.chance(60) {
                    self.c.pick(&IMM64)
                } else {
                    self.c.u64()
                };
                self.emit(Insn::new(LDDW, dst, 0, 0, v as u32 as i32));
                self.emit(Insn::new(0, 0, 0, 0, (v >> 32) as u32 as i32));
            }
            47..=58 if memory => self.load_store(),
            59..=63 if memory => self.atomic(),
            64..=71 if depth < 3 => self.if_block(depth),
            72..=76 if depth < 3 && !self.in_loop && !self.cfg.rbpf_subset => {
                self.counted_loop(depth)
            }
            77 if self.cfg.endless_loops && depth < 3 => {
                let l = self.label();
                self.items.push(Item::Label(l));
                self.alu();
                self.items.push(Item::Jump {
                    insn: Insn::new(JA, 0, 0, 0, 0),
                    label: l,
                });
            }
            78..=82 if self.cfg.calls && self.functions > 1 => self.call(),
            83..=89 if memory => self.helper(),
            90 if depth > 0 => self.emit(Insn::EXIT),
            _ => self.alu(),
        }
    }

    fn alu(&mut self) {
        let w = if self.c.chance(50) {
            CLASS_ALU64
        } else {
            CLASS_ALU
        };
        let ops = [
            ALU_ADD, ALU_SUB, ALU_MUL, ALU_DIV, ALU_OR, ALU_AND, ALU_LSH, ALU_RSH, ALU_MOD,
            ALU_XOR, ALU_ARSH,
        ];
        let op = self.c.pick(&ops);
        let dst = self.scratch();
        let src_x = self.c.chance(50);
        let signed = self.cfg.v4 && matches!(op, ALU_DIV | ALU_MOD) && self.c.chance(40);
        if src_x {
            let src = self.source();
            if self.cfg.rbpf_subset && op == ALU_MOD && w == CLASS_ALU {
                // rbpf leaves the upper half of a 32-bit remainder by zero; keep to immediates.
                self.emit(Insn::new(alu_op(op, w, false), dst, 0, 0, 7));
                return;
            }
            self.emit(Insn::new(alu_op(op, w, true), dst, src, signed as i16, 0));
        } else {
            let mut imm = self.imm();
            if self.cfg.rbpf_subset && matches!(op, ALU_DIV | ALU_MOD) && imm == 0 {
                imm = 3;
            }
            if self.cfg.rbpf_subset && matches!(op, ALU_LSH | ALU_RSH | ALU_ARSH) {
                // rbpf's verifier refuses shift immediates outside the width.
                imm = imm.rem_euclid(if w == CLASS_ALU64 { 64 } else { 32 });
            }
            self.emit(Insn::new(alu_op(op, w, false), dst, 0, signed as i16, imm));
        }
    }

    fn moves(&mut self) {
        let dst = self.scratch();
        match self.c.below(if self.cfg.v4 { 6 } else { 4 }) {
            0 => {
                let src = self.source();
                let w = self.c.pick(&[CLASS_ALU, CLASS_ALU64]);
                self.emit(Insn::new(w | ALU_MOV | SRC_X, dst, src, 0, 0));
            }
            1 => {
                let imm = self.imm();
                let w = self.c.pick(&[CLASS_ALU, CLASS_ALU64]);
                self.emit(Insn::new(w | ALU_MOV | SRC_K, dst, 0, 0, imm));
            }
            2 => {
                let w = self.c.pick(&[CLASS_ALU, CLASS_ALU64]);
                self.emit(Insn::new(w | ALU_NEG, dst, 0, 0, 0));
            }
            3 => {
                let bits = self.c.pick(&[16, 32, 64]);
                let src = self.c.pick(&[END_TO_LE, END_TO_BE]);
                self.emit(Insn::new(CLASS_ALU | ALU_END | src, dst, 0, 0, bits));
            }
            4 => {
                let bits = self.c.pick(&[16, 32, 64]);
                self.emit(Insn::new(CLASS_ALU64 | ALU_END, dst, 0, 0, bits));
            }
            _ => {
                let src = self.source();
                let (w, bits) = self.c.pick(&[
                    (CLASS_ALU64, 8),
                    (CLASS_ALU64, 16),
                    (CLASS_ALU64, 32),
                    (CLASS_ALU, 8),
                    (CLASS_ALU, 16),
                ]);
                self.emit(Insn::new(w | ALU_MOV | SRC_X, dst, src, bits, 0));
            }
        }
    }

    /// An offset around the memory: mostly inside, sometimes just outside.
    fn mem_offset(&mut self, size: i64) -> i16 {
        let len = self.cfg.memory_len as i64;
        let off = match self.c.below(10) {
            0 => -(self.c.below(16) as i64) - 1,
            1 => len - size + 1 + self.c.below(16) as i64,
            _ => self.c.below((len - size + 1).max(1) as u32) as i64,
        };
        off as i16
    }

    fn stack_offset(&mut self, size: i64, aligned: bool) -> i16 {
        let slots = 512 / size;
        let k = self.c.below(slots as u32) as i64 + 1;
        let mut off = -k * size;
        if !aligned {
            off += self.c.below(size as u32) as i64;
            off = off.min(-size);
        }
        off as i16
    }

    fn load_store(&mut self) {
        let size_field = self.c.pick(&[SIZE_B, SIZE_H, SIZE_W, SIZE_DW]);
        let size = size_bytes(size_field) as i64;
        // Where: the stack, the memory, or a wild register.
        let (base, off) = match self.c.below(10) {
            0..=3 => {
                let aligned = self.c.chance(70);
                (10, self.stack_offset(size, aligned))
            }
            4..=8 => (MEM_BASE, self.mem_offset(size)),
            _ => {
                let r = self.scratch();
                (r, self.c.below(64) as i16 - 32)
            }
        };
        match self.c.below(3) {
            0 => {
                let dst = self.scratch();
                let sx = self.cfg.v4 && size < 8 && self.c.chance(30);
                let mode = if sx { MODE_MEMSX } else { MODE_MEM };
                self.emit(Insn::new(CLASS_LDX | mode | size_field, dst, base, off, 0));
            }
            1 => {
                let src = self.source();
                self.emit(Insn::new(
                    CLASS_STX | MODE_MEM | size_field,
                    base,
                    src,
                    off,
                    0,
                ));
            }
            _ => {
                let imm = self.imm();
                self.emit(Insn::new(
                    CLASS_ST | MODE_MEM | size_field,
                    base,
                    0,
                    off,
                    imm,
                ));
            }
        }
    }

    fn atomic(&mut self) {
        let size_field = self.c.pick(&[SIZE_W, SIZE_DW]);
        let size = size_bytes(size_field) as i64;
        let aligned = self.c.chance(85);
        let (base, off) = if self.c.chance(50) {
            (10, self.stack_offset(size, aligned))
        } else {
            let mut off = self.mem_offset(size) as i64;
            if aligned {
                off -= off.rem_euclid(size);
            }
            (MEM_BASE, off as i16)
        };
        let op = self.c.pick(&[
            ATOMIC_ADD,
            ATOMIC_OR,
            ATOMIC_AND,
            ATOMIC_XOR,
            ATOMIC_ADD | ATOMIC_FETCH,
            ATOMIC_OR | ATOMIC_FETCH,
            ATOMIC_AND | ATOMIC_FETCH,
            ATOMIC_XOR | ATOMIC_FETCH,
            ATOMIC_XCHG,
            ATOMIC_CMPXCHG,
        ]);
        let src = self.scratch();
        self.emit(Insn::new(
            CLASS_STX | MODE_ATOMIC | size_field,
            base,
            src,
            off,
            op,
        ));
    }

    fn cond_jump(&mut self, label: usize) {
        let conds = [
            JMP_JEQ, JMP_JGT, JMP_JGE, JMP_JSET, JMP_JNE, JMP_JSGT, JMP_JSGE, JMP_JLT, JMP_JLE,
            JMP_JSLT, JMP_JSLE,
        ];
        let cond = self.c.pick(&conds);
        let class = self.c.pick(&[CLASS_JMP, CLASS_JMP32]);
        let dst = self.source();
        let insn = if self.c.chance(50) {
            let src = self.source();
            Insn::new(class | cond | SRC_X, dst, src, 0, 0)
        } else {
            Insn::new(class | cond | SRC_K, dst, 0, 0, self.imm())
        };
        self.items.push(Item::Jump { insn, label });
    }

    fn if_block(&mut self, depth: u32) {
        let end = self.label();
        if self.cfg.v4 && self.c.chance(15) {
            self.items.push(Item::Jump {
                insn: Insn::new(JA32, 0, 0, 0, 0),
                label: end,
            });
        } else {
            self.cond_jump(end);
        }
        for _ in 0..=self.c.below(3) {
            self.statement(depth + 1);
        }
        self.items.push(Item::Label(end));
    }

    fn counted_loop(&mut self, depth: u32) {
        let n = self.c.below(8) as i32 + 1;
        self.emit(Insn::new(
            CLASS_ALU64 | ALU_MOV | SRC_K,
            LOOP_COUNTER,
            0,
            0,
            n,
        ));
        let top = self.label();
        self.items.push(Item::Label(top));
        self.in_loop = true;
        for _ in 0..=self.c.below(3) {
            self.statement(depth + 1);
        }
        self.in_loop = false;
        self.emit(Insn::new(
            CLASS_ALU64 | ALU_SUB | SRC_K,
            LOOP_COUNTER,
            0,
            0,
            1,
        ));
        self.items.push(Item::Jump {
            insn: Insn::new(CLASS_JMP | JMP_JNE | SRC_K, LOOP_COUNTER, 0, 0, 0),
            label: top,
        });
    }

    fn call(&mut self) {
        // Callees get the memory in r1 and r2; recursion is possible (the call-depth limit
        // ends it).
        let target = 1 + self.c.below(self.functions as u32 - 1) as usize;
        if target <= self.function && !self.c.chance(30) {
            return self.alu();
        }
        self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 1, MEM_BASE, 0, 0));
        self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 2, MEM_LEN, 0, 0));
        let v = self.imm();
        self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, v));
        self.items.push(Item::Call(target));
    }

    fn pointer_into(&mut self, reg: u8) {
        // reg = an address in the stack or the memory (or, rarely, wild).
        match self.c.below(8) {
            0..=3 => {
                let off = self.stack_offset(8, true) as i32;
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, reg, 10, 0, 0));
                self.emit(Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, reg, 0, 0, off));
            }
            4..=6 => {
                let off = self.mem_offset(1) as i32;
                self.emit(Insn::new(
                    CLASS_ALU64 | ALU_MOV | SRC_X,
                    reg,
                    MEM_BASE,
                    0,
                    0,
                ));
                self.emit(Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, reg, 0, 0, off));
            }
            _ => {
                let v = self.imm();
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, reg, 0, 0, v));
            }
        }
    }

    fn helper(&mut self) {
        use naam_ebpf::abi::helper as h;
        let id = self.c.pick(&[
            h::TRACE,
            h::MEMCPY,
            h::MEMCMP,
            h::HASH64,
            h::MEMSET,
            h::ABORT,
        ]);
        if id == h::ABORT && !self.c.chance(10) {
            return self.alu();
        }
        let len = self.c.pick(&[0, 1, 7, 8, 16, 33, 64, 100, 600]);
        match id {
            h::TRACE => {
                let v = self.scratch();
                if v != 1 {
                    self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 1, v, 0, 0));
                }
            }
            h::MEMCPY | h::MEMCMP => {
                self.pointer_into(1);
                self.pointer_into(2);
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, len));
            }
            h::HASH64 => {
                self.pointer_into(1);
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 2, 0, 0, len));
                let seed = self.imm();
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, seed));
            }
            h::MEMSET => {
                self.pointer_into(1);
                let byte = self.imm();
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 2, 0, 0, byte));
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, len));
            }
            _ => {
                let code = self.imm();
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 1, 0, 0, code));
            }
        }
        self.emit(Insn::new(CALL, 0, CALL_HELPER, 0, id as i32));
        if self.cfg.no_address_leaks {
            // Helpers keep r1-r5: forget the addresses they were given.
            for r in 1..=5 {
                self.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, r, 0, 0, 0));
            }
        }
    }
}

/// Builds a program from `c`'s decisions.
pub fn generate(c: &mut Choices<'_>, cfg: &GenConfig) -> Generated {
    let functions = if cfg.calls {
        1 + c.below(3) as usize
    } else {
        1
    };
    let mut bodies: Vec<Vec<Item>> = Vec::with_capacity(functions);
    for f in 0..functions {
        let mut b = Builder {
            c: &mut *c,
            cfg: *cfg,
            items: Vec::new(),
            labels: 0,
            function: f,
            functions,
            in_loop: false,
        };
        // Every function keeps the memory address in r6 and its length in r7.
        b.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, MEM_BASE, 1, 0, 0));
        b.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, MEM_LEN, 2, 0, 0));
        if cfg.no_address_leaks {
            // r1 holds an address, and r2 a length another runtime may not pass.
            b.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 1, 0, 0, 0));
            b.emit(Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 2, 0, 0, 0));
        }
        let n = 1 + b.c.below(cfg.statements.max(1) as u32) as usize;
        for _ in 0..n {
            b.statement(0);
        }
        b.emit(Insn::EXIT);
        bodies.push(b.items);
    }
    // Lay the functions out and resolve labels and calls.
    let slots = |item: &Item| match item {
        Item::Insn(_) | Item::Jump { .. } | Item::Call(_) => 1,
        Item::Label(_) => 0,
    };
    let mut starts = Vec::with_capacity(functions);
    let mut at = 0usize;
    for body in &bodies {
        starts.push(at);
        at += body.iter().map(slots).sum::<usize>();
    }
    let mut insns: Vec<Insn> = Vec::with_capacity(at);
    for (f, body) in bodies.iter().enumerate() {
        let mut label_at = std::collections::HashMap::new();
        let mut pc = starts[f];
        for item in body {
            if let Item::Label(l) = item {
                label_at.insert(*l, pc);
            }
            pc += slots(item);
        }
        for item in body {
            let pc = insns.len();
            match *item {
                Item::Insn(i) => insns.push(i),
                Item::Label(_) => {}
                Item::Jump { mut insn, label } => {
                    let delta = label_at[&label] as i64 - (pc as i64 + 1);
                    if insn.op == JA32 {
                        insn.imm = delta as i32;
                    } else {
                        insn.off = delta as i16;
                    }
                    insns.push(insn);
                }
                Item::Call(target) => {
                    let delta = starts[target] as i64 - (pc as i64 + 1);
                    insns.push(Insn::new(CALL, 0, CALL_LOCAL, 0, delta as i32));
                }
            }
        }
    }
    let memory = (0..cfg.memory_len).map(|_| c.byte()).collect();
    let mut program = Program::from_bytecode("generated", encode_all(&insns));
    program.functions = starts;
    Generated { program, memory }
}

/// `n` pseudo-random bytes from `seed` (xorshift64*): the choices a test or an example draws
/// a program from ([`Choices::new`]), the same for the same seed on every machine.
pub fn seeded_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Instruction budget of differential runs: small, so endless loops end quickly.
pub const BUDGET: u64 = 20_000;

/// The options differential runs build executables with: raw memory, the NAAM helpers.
pub fn options(engine: EngineKind) -> ExecOptions {
    let mut o = ExecOptions::new(engine, BUDGET);
    o.verifier = VerifierConfig::for_helpers(HelperSet::Naam);
    o.helpers = HelperSet::Naam;
    o.entry = Entry::Memory;
    o
}

/// Everything observable about one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// `r0`, or the fault.
    pub result: Result<u64, VmError>,
    /// Instructions executed (runs that ended normally).
    pub insns: Option<u64>,
    /// The memory afterwards.
    pub memory: Vec<u8>,
    /// The eBPF stack afterwards.
    pub stack: Vec<u8>,
    /// Values the trace helper recorded, in order (at most `TRACE_CAP`).
    pub trace: Vec<u64>,
}

/// An 8-byte aligned buffer for a run's memory (atomics need natural alignment); reusing one
/// for several runs keeps addresses, which programs may observe, identical.
#[derive(Debug)]
pub struct Buffer {
    words: Vec<u64>,
    len: usize,
}

impl Buffer {
    /// A buffer of `len` bytes.
    pub fn new(len: usize) -> Buffer {
        Buffer {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    /// The buffer's `len` bytes, 8-byte aligned, at the same address on every call.
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the u64 storage holds at least `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// Runs `exe` on `vm` over `buffer` filled with `memory` (the stack is cleared first).
pub fn run(vm: &mut Vm, exe: &Executable, memory: &[u8], buffer: &mut Buffer) -> Observed {
    let mem = buffer.bytes();
    mem.copy_from_slice(memory);
    vm.clear_stack();
    let (result, insns) = match vm.run_raw(exe, mem) {
        Ok(o) => (Ok(o.r0), Some(o.insns)),
        Err(StepError::Vm(e)) => (Err(e), None),
        Err(e) => (Err(VmError::Engine(e.to_string())), None),
    };
    Observed {
        result,
        insns,
        memory: mem.to_vec(),
        stack: vm.stack_bytes(),
        trace: vm.trace().to_vec(),
    }
}

/// What differs between two outcomes, if anything.
pub fn compare(a: &Observed, b: &Observed) -> Result<(), String> {
    let mut diffs = Vec::new();
    if a.result != b.result {
        diffs.push(format!("result {:?} vs {:?}", a.result, b.result));
    }
    if a.insns != b.insns {
        diffs.push(format!("instruction count {:?} vs {:?}", a.insns, b.insns));
    }
    if a.memory != b.memory {
        diffs.push(format!("memory {:02x?} vs {:02x?}", a.memory, b.memory));
    }
    if a.stack != b.stack {
        let first = a.stack.iter().zip(&b.stack).position(|(x, y)| x != y);
        diffs.push(format!("stack differs from byte {first:?}"));
    }
    if a.trace != b.trace {
        diffs.push(format!("trace {:?} vs {:?}", a.trace, b.trace));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(diffs.join("; "))
    }
}

/// Runs a generated program on the interpreter and the JIT (one VM, so the stack and the
/// memory have the same addresses) and compares everything observable. `Ok(None)` when the
/// verifier refuses the program (a generator bug, reported by the tests), `Ok(Some(outcome))`
/// when both engines agree.
pub fn check(g: &Generated) -> Result<Option<Observed>, String> {
    let Ok(interp) = Executable::build(&g.program, &options(EngineKind::Interp)) else {
        return Ok(None);
    };
    let jit = Executable::build(&g.program, &options(EngineKind::Jit))
        .map_err(|e| format!("the JIT refused a verified program: {e}"))?;
    let mut vm = Vm::new();
    let mut buffer = Buffer::new(g.memory.len());
    let a = run(&mut vm, &interp, &g.memory, &mut buffer);
    let b = run(&mut vm, &jit, &g.memory, &mut buffer);
    compare(&a, &b).map_err(|d| format!("interp vs jit: {d}"))?;
    Ok(Some(a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use naam_vm::check as verify_structure;

    /// Every byte string makes a program the verifier accepts.
    #[test]
    fn generated_programs_verify() {
        let mut seed = 0x1234_5678_u64;
        for _ in 0..300 {
            let bytes: Vec<u8> = (0..600)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            for cfg in [
                GenConfig::default(),
                GenConfig::rbpf(),
                GenConfig::position_independent(),
            ] {
                let g = generate(&mut Choices::new(&bytes), &cfg);
                if let Err(v) = verify_structure(&g.program, &VerifierConfig::default()) {
                    panic!("{v}\n{:?}", naam_vm::insn::decode_all(&g.program.code));
                }
            }
        }
    }
}
