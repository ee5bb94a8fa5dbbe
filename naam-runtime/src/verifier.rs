//! Verifier gate v1: a pure, structural check of linked bytecode before any engine sees it.
//!
//! Rules (each rejection names the instruction index and the rule):
//! - `size`: the program is empty or exceeds the instruction cap;
//! - `opcode`: only the v3 ISA subset both engines implement (no legacy packet loads, no
//!   atomics, no v4 signed-offset forms);
//! - `register`: registers r0–r10 only, and r10 (the frame pointer) is never written;
//! - `immediate`: no constant division by zero, shifts within the operand width, byte swaps of
//!   16/32/64 bits, well-formed `lddw` second slots;
//! - `jump`: targets inside the program and never into the middle of an `lddw`;
//! - `backward-jump`: no jump closes a loop (bounded execution: loops must be unrolled or split
//!   into continuation steps). Backward jumps that do not close a cycle are accepted: LLVM's
//!   block placement emits them towards shared exit blocks, and they cannot repeat work;
//! - `helper`: helper calls only to the whitelist;
//! - `call`: local calls land on a function start, and the call graph has no cycles;
//! - `stack`: accesses through r10 stay within the 512-byte frame;
//! - `fallthrough`: every function ends in `exit` or an unconditional jump.

use std::collections::BTreeSet;
use std::fmt;

use naam_ebpf::abi::{helper, STACK_SIZE};
use rbpf::ebpf;
use serde::Serialize;

use crate::insn::{decode_all, Insn, INSN_SIZE};
use crate::loader::Program;

/// Default instruction cap.
pub const DEFAULT_MAX_INSNS: usize = 16 * 1024;

/// The rule a program broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    /// Empty program, truncated bytecode, or over the instruction cap.
    Size,
    /// Unknown or unsupported opcode.
    Opcode,
    /// Bad register number, or a write to r10.
    Register,
    /// Bad immediate or malformed `lddw`.
    Immediate,
    /// Jump target outside the program or inside an `lddw`.
    Jump,
    /// A jump that goes backwards.
    BackwardJump,
    /// Helper not on the whitelist.
    Helper,
    /// Bad local call target, or recursion.
    Call,
    /// Stack access outside the frame.
    Stack,
    /// A function that can run off its end.
    Fallthrough,
}

impl Rule {
    /// The rule's name as printed.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Size => "size",
            Rule::Opcode => "opcode",
            Rule::Register => "register",
            Rule::Immediate => "immediate",
            Rule::Jump => "jump",
            Rule::BackwardJump => "backward-jump",
            Rule::Helper => "helper",
            Rule::Call => "call",
            Rule::Stack => "stack",
            Rule::Fallthrough => "fallthrough",
        }
    }
}

/// A rejection: the instruction, the rule and a human-readable reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
pub struct Violation {
    /// Instruction index (slot) in the linked program.
    pub index: usize,
    /// The rule broken.
    pub rule: Rule,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "insn {}: {}: {}",
            self.index,
            self.rule.name(),
            self.reason
        )
    }
}

/// Verifier settings.
#[derive(Clone, Debug)]
pub struct VerifierConfig {
    /// Maximum number of instruction slots.
    pub max_insns: usize,
    /// Helper ids a handler may call.
    pub helpers: BTreeSet<u32>,
}

impl Default for VerifierConfig {
    fn default() -> Self {
        VerifierConfig {
            max_insns: DEFAULT_MAX_INSNS,
            helpers: helper::ALL.into_iter().collect(),
        }
    }
}

/// What a passing program looks like, for reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Instruction slots.
    pub insns: usize,
    /// Function count (entry included).
    pub functions: usize,
    /// Distinct helpers called.
    pub helpers: Vec<u32>,
}

fn violation(index: usize, rule: Rule, reason: impl Into<String>) -> Violation {
    Violation {
        index,
        rule,
        reason: reason.into(),
    }
}

/// Size in bytes of a load or store opcode's access.
fn access_size(op: u8) -> usize {
    match op & 0x18 {
        ebpf::BPF_W => 4,
        ebpf::BPF_H => 2,
        ebpf::BPF_B => 1,
        _ => 8,
    }
}

/// Checks `program` against every rule.
pub fn verify(program: &Program, config: &VerifierConfig) -> Result<Verdict, Violation> {
    if !program.code.len().is_multiple_of(INSN_SIZE) {
        return Err(violation(
            program.code.len() / INSN_SIZE,
            Rule::Size,
            format!(
                "truncated bytecode: {} bytes is not a multiple of 8",
                program.code.len()
            ),
        ));
    }
    let insns = decode_all(&program.code);
    let n = insns.len();
    if n == 0 {
        return Err(violation(0, Rule::Size, "empty program"));
    }
    if n > config.max_insns {
        return Err(violation(
            config.max_insns,
            Rule::Size,
            format!("{n} instructions exceed the cap of {}", config.max_insns),
        ));
    }

    // Second slots of lddw: never executed, never jumped into.
    let mut wide_tail = vec![false; n];
    let mut pc = 0;
    while pc < n {
        if insns[pc].is_wide() {
            if pc + 1 >= n {
                return Err(violation(
                    pc,
                    Rule::Immediate,
                    "`lddw` without its second slot",
                ));
            }
            wide_tail[pc + 1] = true;
            pc += 2;
        } else {
            pc += 1;
        }
    }

    // Function starts come from the loader; a hand-built program may list nonsense.
    let mut functions: BTreeSet<usize> = program
        .functions
        .iter()
        .copied()
        .filter(|&f| f < n && !wide_tail[f])
        .collect();
    functions.insert(0);
    let mut helpers_used = BTreeSet::new();
    let mut calls: Vec<(usize, usize)> = Vec::new(); // (caller pc, callee start)

    for (pc, insn) in insns.iter().enumerate() {
        if wide_tail[pc] {
            let ok = insn.op == 0 && insn.dst == 0 && insn.src == 0 && insn.off == 0;
            if !ok {
                return Err(violation(
                    pc,
                    Rule::Immediate,
                    "malformed second slot of `lddw`",
                ));
            }
            continue;
        }
        check_insn(pc, insn, config, &mut helpers_used)?;
        if insn.is_jump() {
            let t = insn.target(pc);
            if t < 0 || t as usize >= n {
                return Err(violation(
                    pc,
                    Rule::Jump,
                    format!("jump target {t} is outside 0..{n}"),
                ));
            }
            if wide_tail[t as usize] {
                return Err(violation(
                    pc,
                    Rule::Jump,
                    format!("jump into the middle of `lddw` at {t}"),
                ));
            }
        }
        if insn.is_local_call() {
            let t = insn.target(pc);
            if t < 0 || t as usize >= n || wide_tail[t as usize] {
                return Err(violation(
                    pc,
                    Rule::Call,
                    format!("call target {t} is outside the program"),
                ));
            }
            functions.insert(t as usize);
            calls.push((pc, t as usize));
        }
    }

    // Function bodies: from each start to the next. Each must end without falling through.
    let starts: Vec<usize> = functions.iter().copied().collect();
    let function_of = |pc: usize| -> usize {
        match starts.binary_search(&pc) {
            Ok(k) => starts[k],
            Err(k) => starts[k.saturating_sub(1)],
        }
    };
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(n);
        let mut last = end - 1;
        if last > start && wide_tail[last] {
            last -= 1;
        }
        let li = insns[last];
        if !(li.is_exit() || li.op == ebpf::JA) {
            return Err(violation(
                last,
                Rule::Fallthrough,
                format!("function starting at insn {start} can run past its end"),
            ));
        }
        // Jumps stay inside their function.
        for pc in start..end {
            let insn = insns[pc];
            if !wide_tail[pc] && insn.is_jump() {
                let t = insn.target(pc) as usize;
                if t < start || t >= end {
                    return Err(violation(
                        pc,
                        Rule::Jump,
                        format!("jump to {t} leaves its function ({start}..{end})"),
                    ));
                }
            }
        }
    }

    // Control flow inside every function must be acyclic (bounded execution).
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(n);
        if let Some((pc, t)) = find_loop(&insns, &wide_tail, start, end) {
            return Err(violation(
                pc,
                Rule::BackwardJump,
                format!(
                    "jump to insn {t} goes backwards and closes a loop (loops are not allowed: \
                     unroll them or split the work into Continue steps)"
                ),
            ));
        }
    }

    // Call graph must be acyclic (no recursion).
    let mut edges: Vec<(usize, usize)> = calls
        .iter()
        .map(|&(pc, callee)| (function_of(pc), callee))
        .collect();
    edges.sort_unstable();
    edges.dedup();
    if let Some(pc) = find_cycle(&starts, &edges, &calls, &function_of) {
        return Err(violation(
            pc,
            Rule::Call,
            "recursive call (the call graph must be acyclic)",
        ));
    }

    Ok(Verdict {
        insns: n,
        functions: starts.len(),
        helpers: helpers_used.into_iter().collect(),
    })
}

/// Successors of `pc` inside the function `[start, end)`.
fn successors(
    insns: &[Insn],
    wide_tail: &[bool],
    pc: usize,
    (start, end): (usize, usize),
) -> [Option<usize>; 2] {
    let insn = insns[pc];
    let step = if insn.is_wide() { 2 } else { 1 };
    let next = (pc + step < end).then_some(pc + step);
    if insn.is_exit() {
        return [None, None];
    }
    if insn.is_jump() {
        let t = insn.target(pc);
        let t = (t >= start as i64 && (t as usize) < end && !wide_tail[t as usize])
            .then_some(t as usize);
        return if insn.op == ebpf::JA {
            [t, None]
        } else {
            [next, t]
        };
    }
    [next, None]
}

/// Finds a loop reachable from `start`: returns the backward jump that closes it and its target.
fn find_loop(
    insns: &[Insn],
    wide_tail: &[bool],
    start: usize,
    end: usize,
) -> Option<(usize, usize)> {
    // Iterative DFS; `on_path` marks nodes on the current path, whose order `path` keeps.
    let mut state = vec![0u8; end - start]; // 0 new, 1 on path, 2 done
    let mut path: Vec<(usize, usize)> = vec![(start, 0)];
    state[0] = 1;
    while let Some(&mut (pc, ref mut k)) = path.last_mut() {
        let succ = successors(insns, wide_tail, pc, (start, end));
        if *k >= succ.len() {
            state[pc - start] = 2;
            path.pop();
            continue;
        }
        let next = succ[*k];
        *k += 1;
        let Some(s) = next else { continue };
        match state[s - start] {
            0 => {
                state[s - start] = 1;
                path.push((s, 0));
            }
            1 => {
                // The cycle is the path from `s` to `pc`, closed by pc -> s. Some edge on it goes
                // backwards in address order: report that jump.
                let from = path.iter().position(|&(p, _)| p == s).unwrap_or(0);
                let cycle: Vec<usize> = path[from..].iter().map(|&(p, _)| p).collect();
                for (i, &p) in cycle.iter().enumerate() {
                    let to = cycle.get(i + 1).copied().unwrap_or(s);
                    if to <= p {
                        return Some((p, to));
                    }
                }
                return Some((pc, s));
            }
            _ => {}
        }
    }
    None
}

fn find_cycle(
    starts: &[usize],
    edges: &[(usize, usize)],
    calls: &[(usize, usize)],
    function_of: &dyn Fn(usize) -> usize,
) -> Option<usize> {
    // Depth-first search with colours: 0 new, 1 on the stack, 2 done.
    let mut colour: std::collections::HashMap<usize, u8> = starts.iter().map(|&s| (s, 0)).collect();
    fn dfs(
        f: usize,
        edges: &[(usize, usize)],
        colour: &mut std::collections::HashMap<usize, u8>,
    ) -> Option<(usize, usize)> {
        colour.insert(f, 1);
        for &(from, to) in edges.iter().filter(|(from, _)| *from == f) {
            match colour.get(&to).copied().unwrap_or(0) {
                1 => return Some((from, to)),
                0 => {
                    if let Some(c) = dfs(to, edges, colour) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        colour.insert(f, 2);
        None
    }
    for &s in starts {
        if colour.get(&s) == Some(&0) {
            if let Some((from, to)) = dfs(s, edges, &mut colour) {
                return calls
                    .iter()
                    .find(|&&(pc, callee)| callee == to && function_of(pc) == from)
                    .map(|&(pc, _)| pc);
            }
        }
    }
    None
}

fn check_insn(
    pc: usize,
    insn: &Insn,
    config: &VerifierConfig,
    helpers_used: &mut BTreeSet<u32>,
) -> Result<(), Violation> {
    let bad_op = |why: &str| violation(pc, Rule::Opcode, format!("opcode {:#04x}: {why}", insn.op));
    if insn.dst > 10 || insn.src > 10 {
        return Err(violation(
            pc,
            Rule::Register,
            format!("register r{} / r{} does not exist", insn.dst, insn.src),
        ));
    }
    match insn.class() {
        ebpf::BPF_ALU | ebpf::BPF_ALU64 => {
            let is64 = insn.class() == ebpf::BPF_ALU64;
            let alu_op = insn.op & 0xf0;
            let uses_reg = insn.op & ebpf::BPF_X != 0;
            if insn.off != 0 {
                return Err(bad_op(
                    "signed division and sign-extending moves (ISA v4) are not supported",
                ));
            }
            if insn.dst == 10 {
                return Err(violation(
                    pc,
                    Rule::Register,
                    "r10 (the frame pointer) is read-only",
                ));
            }
            match alu_op {
                ebpf::BPF_ADD
                | ebpf::BPF_SUB
                | ebpf::BPF_MUL
                | ebpf::BPF_OR
                | ebpf::BPF_AND
                | ebpf::BPF_XOR
                | ebpf::BPF_MOV => {}
                ebpf::BPF_DIV | ebpf::BPF_MOD => {
                    if !uses_reg && insn.imm == 0 {
                        return Err(violation(pc, Rule::Immediate, "division by constant zero"));
                    }
                }
                ebpf::BPF_LSH | ebpf::BPF_RSH | ebpf::BPF_ARSH => {
                    let width = if is64 { 64 } else { 32 };
                    if !uses_reg && !(0..width).contains(&insn.imm) {
                        return Err(violation(
                            pc,
                            Rule::Immediate,
                            format!("shift by {} is outside 0..{width}", insn.imm),
                        ));
                    }
                }
                ebpf::BPF_NEG => {
                    if uses_reg {
                        return Err(bad_op("`neg` takes no source register"));
                    }
                }
                ebpf::BPF_END => {
                    if is64 {
                        return Err(bad_op("unconditional byte swap (ISA v4) is not supported"));
                    }
                    if !matches!(insn.imm, 16 | 32 | 64) {
                        return Err(violation(
                            pc,
                            Rule::Immediate,
                            format!("byte swap width {} is not 16, 32 or 64", insn.imm),
                        ));
                    }
                }
                _ => return Err(bad_op("unknown ALU operation")),
            }
        }
        ebpf::BPF_LDX => {
            if insn.op & 0xe0 != ebpf::BPF_MEM {
                return Err(bad_op(
                    "only plain memory loads are supported (no sign-extending loads)",
                ));
            }
            if insn.dst == 10 {
                return Err(violation(
                    pc,
                    Rule::Register,
                    "r10 (the frame pointer) is read-only",
                ));
            }
            check_stack(pc, insn.src, insn.off, access_size(insn.op))?;
        }
        ebpf::BPF_ST | ebpf::BPF_STX => {
            if insn.op & 0xe0 != ebpf::BPF_MEM {
                return Err(bad_op(
                    "atomic and legacy stores are not supported (use CAS/FAA write operations)",
                ));
            }
            check_stack(pc, insn.dst, insn.off, access_size(insn.op))?;
        }
        ebpf::BPF_LD => {
            if insn.op != ebpf::LD_DW_IMM {
                return Err(bad_op("legacy packet loads are not supported"));
            }
            if insn.dst == 10 {
                return Err(violation(
                    pc,
                    Rule::Register,
                    "r10 (the frame pointer) is read-only",
                ));
            }
            if insn.src != 0 {
                return Err(violation(
                    pc,
                    Rule::Immediate,
                    format!(
                        "`lddw` with source {} (map or BTF reference) is not supported",
                        insn.src
                    ),
                ));
            }
        }
        ebpf::BPF_JMP | ebpf::BPF_JMP32 => {
            let jmp_op = insn.op & 0xf0;
            let is32 = insn.class() == ebpf::BPF_JMP32;
            match jmp_op {
                ebpf::BPF_CALL if !is32 && insn.op & ebpf::BPF_X == 0 => match insn.src {
                    0 => {
                        let id = insn.imm as u32;
                        if !config.helpers.contains(&id) {
                            return Err(violation(
                                pc,
                                Rule::Helper,
                                format!("helper {} is not on the whitelist", insn.imm),
                            ));
                        }
                        helpers_used.insert(id);
                    }
                    1 => {}
                    s => {
                        return Err(violation(
                            pc,
                            Rule::Call,
                            format!("call type {s} (kfunc or unknown) is not supported"),
                        ))
                    }
                },
                ebpf::BPF_EXIT if !is32 && insn.op & ebpf::BPF_X == 0 => {}
                ebpf::BPF_JA if !is32 && insn.op & ebpf::BPF_X == 0 => {}
                ebpf::BPF_JEQ
                | ebpf::BPF_JGT
                | ebpf::BPF_JGE
                | ebpf::BPF_JSET
                | ebpf::BPF_JNE
                | ebpf::BPF_JSGT
                | ebpf::BPF_JSGE
                | ebpf::BPF_JLT
                | ebpf::BPF_JLE
                | ebpf::BPF_JSLT
                | ebpf::BPF_JSLE => {}
                _ => return Err(bad_op("unknown jump operation")),
            }
        }
        _ => return Err(bad_op("unknown class")),
    }
    Ok(())
}

fn check_stack(pc: usize, base: u8, off: i16, size: usize) -> Result<(), Violation> {
    if base != 10 {
        return Ok(());
    }
    let start = off as i64;
    let end = start + size as i64;
    if start < -(STACK_SIZE as i64) || end > 0 {
        return Err(violation(
            pc,
            Rule::Stack,
            format!(
                "stack access [r10{start:+}, r10{end:+}) is outside the {STACK_SIZE}-byte frame"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::insn::encode_all;

    fn prog(insns: &[Insn]) -> Program {
        Program::from_bytecode("t", encode_all(insns))
    }
    fn i(op: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            op,
            dst,
            src,
            off,
            imm,
        }
    }

    fn rule_of(p: &Program) -> Rule {
        verify(p, &VerifierConfig::default()).unwrap_err().rule
    }

    #[test]
    fn accepts_minimal() {
        let p = prog(&[i(ebpf::MOV64_IMM, 0, 0, 0, 1), Insn::EXIT]);
        assert_eq!(verify(&p, &VerifierConfig::default()).unwrap().insns, 2);
    }

    #[test]
    fn rejections_name_index_and_rule() {
        let back = prog(&[
            i(ebpf::MOV64_IMM, 0, 0, 0, 1),
            i(ebpf::JA, 0, 0, -2, 0),
            Insn::EXIT,
        ]);
        let v = verify(&back, &VerifierConfig::default()).unwrap_err();
        assert_eq!((v.index, v.rule), (1, Rule::BackwardJump));
        assert!(v.to_string().starts_with("insn 1: backward-jump:"));

        assert_eq!(
            rule_of(&prog(&[i(ebpf::JA, 0, 0, -1, 0), Insn::EXIT])),
            Rule::BackwardJump
        );
        assert_eq!(
            rule_of(&prog(&[i(0xff, 0, 0, 0, 0), Insn::EXIT])),
            Rule::Opcode
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::MOV64_IMM, 10, 0, 0, 0), Insn::EXIT])),
            Rule::Register
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::MOV64_IMM, 11, 0, 0, 0), Insn::EXIT])),
            Rule::Register
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::DIV64_IMM, 0, 0, 0, 0), Insn::EXIT])),
            Rule::Immediate
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::LSH64_IMM, 0, 0, 0, 64), Insn::EXIT])),
            Rule::Immediate
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::CALL, 0, 0, 0, 999), Insn::EXIT])),
            Rule::Helper
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::JA, 0, 0, 5, 0), Insn::EXIT])),
            Rule::Jump
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::ST_DW_REG, 10, 1, -520, 0), Insn::EXIT])),
            Rule::Stack
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::ST_DW_REG, 10, 1, -4, 0), Insn::EXIT])),
            Rule::Stack
        );
        assert_eq!(
            rule_of(&prog(&[i(ebpf::MOV64_IMM, 0, 0, 0, 0)])),
            Rule::Fallthrough
        );
        assert_eq!(rule_of(&prog(&[])), Rule::Size);
        assert_eq!(
            rule_of(&prog(&[i(0xdb, 1, 2, 0, 0), Insn::EXIT])),
            Rule::Opcode
        );
        // Recursion: entry calls f at 2, f calls itself.
        let rec = prog(&[
            i(ebpf::CALL, 0, 1, 0, 1),
            Insn::EXIT,
            i(ebpf::CALL, 0, 1, 0, -1),
            Insn::EXIT,
        ]);
        assert_eq!(rule_of(&rec), Rule::Call);
    }

    #[test]
    fn backward_jump_to_an_exit_block_is_not_a_loop() {
        // 0: if r1 == 0 goto +2 (-> 3)
        // 1: r0 = 1
        // 2: exit
        // 3: if r1 != 5 goto -3 (-> 1: backwards, but 1..2 never come back)
        // 4: exit
        let p = prog(&[
            i(ebpf::JEQ_IMM, 1, 0, 2, 0),
            i(ebpf::MOV64_IMM, 0, 0, 0, 1),
            Insn::EXIT,
            i(ebpf::JNE_IMM, 1, 0, -3, 5),
            Insn::EXIT,
        ]);
        assert!(verify(&p, &VerifierConfig::default()).is_ok());
        // A real loop: 1 -> 2 -> 1.
        let l = prog(&[
            i(ebpf::MOV64_IMM, 0, 0, 0, 0),
            i(ebpf::ADD64_IMM, 0, 0, 0, 1),
            i(ebpf::JNE_IMM, 0, 0, -2, 10),
            Insn::EXIT,
        ]);
        let v = verify(&l, &VerifierConfig::default()).unwrap_err();
        assert_eq!((v.index, v.rule), (2, Rule::BackwardJump));
        assert!(v.reason.contains("insn 1"));
    }

    #[test]
    fn jumps_may_not_leave_their_function() {
        // entry 0..3 calls f at 3; f jumps back into the entry.
        let mut p = prog(&[
            i(ebpf::CALL, 0, 1, 0, 2),
            i(ebpf::MOV64_IMM, 0, 0, 0, 0),
            Insn::EXIT,
            i(ebpf::JEQ_IMM, 1, 0, -3, 0),
            Insn::EXIT,
        ]);
        p.functions = vec![0, 3];
        let v = verify(&p, &VerifierConfig::default()).unwrap_err();
        assert_eq!((v.index, v.rule), (3, Rule::Jump));
        assert!(v.reason.contains("leaves its function"), "{v}");
    }

    #[test]
    fn instruction_cap() {
        let mut body = vec![i(ebpf::MOV64_IMM, 0, 0, 0, 0); 10];
        body.push(Insn::EXIT);
        let cfg = VerifierConfig {
            max_insns: 5,
            ..VerifierConfig::default()
        };
        let v = verify(&prog(&body), &cfg).unwrap_err();
        assert_eq!(v.rule, Rule::Size);
        assert!(v.reason.contains("exceed the cap"));
    }

    #[test]
    fn truncated_bytecode() {
        let p = Program::from_bytecode("t", vec![0x95, 0, 0, 0, 0]);
        assert_eq!(rule_of(&p), Rule::Size);
    }
}
