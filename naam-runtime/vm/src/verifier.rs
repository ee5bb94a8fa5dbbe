//! The verifier: a pure check of linked bytecode before any engine sees it.
//!
//! Rules (each rejection names the instruction index and the rule):
//! - `size`: the program is empty, truncated, or exceeds the instruction cap;
//! - `opcode`, `register`, `immediate`: every slot decodes ([`Op::decode`]: the whole RFC 9669
//!   ISA, v4 included; no legacy packet loads, map references or kfuncs; r10 never written);
//! - `jump`: targets inside the program, never into the middle of an `lddw`, never out of the
//!   jump's own function;
//! - `helper`: static helper calls only to the whitelist;
//! - `call`: local calls land on an instruction, and the call kind is supported;
//! - `stack`: accesses through r10 with a constant offset stay within the 512-byte frame;
//! - `fallthrough`: every function ends in `exit` or an unconditional jump.
//!
//! Loops and recursion are allowed: both engines meter a per-step instruction budget (checked
//! at every backward jump and every call) and bound the call depth, so every run ends. Memory
//! safety is not the verifier's job either: the engines check every access they cannot prove,
//! and [`crate::analysis`] proves what it can.

use std::collections::BTreeSet;
use std::fmt;

use naam_ebpf::abi::STACK_SIZE;
use serde::Serialize;

use crate::helpers::HelperSet;
use crate::insn::{decode_all, DecodeRule, Insn, Op, FRAME_POINTER};
use crate::loader::Program;
use crate::opcode::INSN_SIZE;

/// Default instruction cap.
pub const DEFAULT_MAX_INSNS: usize = 16 * 1024;

/// The rule a program broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Rule {
    /// Empty program, truncated bytecode, or over the instruction cap.
    Size,
    /// Unknown or unsupported opcode.
    Opcode,
    /// Bad register number, or a write to r10.
    Register,
    /// Bad immediate or offset field, or a malformed `lddw`.
    Immediate,
    /// Jump target outside the program, inside an `lddw`, or outside the jump's function.
    Jump,
    /// Helper not on the whitelist.
    Helper,
    /// Bad local call target, or an unsupported call kind.
    Call,
    /// Constant stack access outside the frame.
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
            Rule::Helper => "helper",
            Rule::Call => "call",
            Rule::Stack => "stack",
            Rule::Fallthrough => "fallthrough",
        }
    }
}

/// A rejection: the instruction, the rule and a human-readable reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[non_exhaustive]
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

/// What the verifier accepts: at most `max_insns` slots, calling only `helpers`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct VerifierConfig {
    /// Maximum number of instruction slots.
    pub max_insns: usize,
    /// Helper ids a handler may call.
    pub helpers: BTreeSet<u32>,
}

impl Default for VerifierConfig {
    fn default() -> Self {
        VerifierConfig::for_helpers(HelperSet::Naam)
    }
}

impl VerifierConfig {
    /// The default cap, with every helper of `set` whitelisted.
    pub fn for_helpers(set: HelperSet) -> Self {
        VerifierConfig {
            max_insns: DEFAULT_MAX_INSNS,
            helpers: set.ids(),
        }
    }
}

/// What a passing program looks like, for reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Slots in the linked program (`lddw` counts two).
    pub insns: usize,
    /// Function count (entry included).
    pub functions: usize,
    /// Distinct helpers called by static id.
    pub helpers: Vec<u32>,
    /// Backward jumps (loops are metered by the instruction budget).
    pub backward_jumps: usize,
    /// Whether some function can call itself, directly or not (bounded by the call depth).
    pub recursive: bool,
}

/// The verified structure engines compile from.
#[derive(Clone, Debug)]
pub struct Checked {
    /// The linked program's raw slots, indexed like `ops`.
    pub insns: Vec<Insn>,
    /// Decoded instruction at each slot (`None` for the second slot of `lddw`).
    pub ops: Vec<Option<Op>>,
    /// Function bodies `[start, end)`, sorted; the entry is the first.
    pub functions: Vec<(usize, usize)>,
    /// The summary of the passing program (size, functions, helpers, loops), for reports.
    pub verdict: Verdict,
}

impl Checked {
    /// Index in [`Checked::functions`] of the function starting at `start`.
    pub fn function_at(&self, start: usize) -> Option<usize> {
        self.functions.binary_search_by_key(&start, |f| f.0).ok()
    }
}

fn violation(index: usize, rule: Rule, reason: impl Into<String>) -> Violation {
    Violation {
        index,
        rule,
        reason: reason.into(),
    }
}

/// Checks `program` against every rule.
pub fn verify(program: &Program, config: &VerifierConfig) -> Result<Verdict, Violation> {
    check(program, config).map(|c| c.verdict)
}

/// Checks `program` and returns its verified structure.
pub fn check(program: &Program, config: &VerifierConfig) -> Result<Checked, Violation> {
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

    // Decode every slot; the second slots of `lddw` stay `None` (never executed).
    let mut ops: Vec<Option<Op>> = vec![None; n];
    let mut pc = 0;
    while pc < n {
        let op = Op::decode(&insns, pc).map_err(|e| {
            let rule = match e.rule {
                DecodeRule::Opcode => Rule::Opcode,
                DecodeRule::Register => Rule::Register,
                DecodeRule::Immediate => Rule::Immediate,
                DecodeRule::Call => Rule::Call,
            };
            violation(pc, rule, e.reason)
        })?;
        ops[pc] = Some(op);
        pc += op.slots();
    }
    let is_insn = |t: i64| t >= 0 && (t as usize) < n && ops[t as usize].is_some();

    // Function starts: the entry, the loader's list, and every local call target.
    let mut starts: BTreeSet<usize> = program
        .functions
        .iter()
        .copied()
        .filter(|&f| f < n && ops[f].is_some())
        .collect();
    starts.insert(0);
    let mut helpers_used = BTreeSet::new();
    let mut calls: Vec<(usize, usize)> = Vec::new();
    let mut backward_jumps = 0;
    for (pc, op) in ops.iter().enumerate() {
        let Some(op) = op else { continue };
        match *op {
            Op::Ja { target } | Op::Jump { target, .. } => {
                if !(target >= 0 && (target as usize) < n) {
                    return Err(violation(
                        pc,
                        Rule::Jump,
                        format!("jump target {target} is outside 0..{n}"),
                    ));
                }
                if !is_insn(target) {
                    return Err(violation(
                        pc,
                        Rule::Jump,
                        format!("jump into the middle of `lddw` at {target}"),
                    ));
                }
                if target as usize <= pc {
                    backward_jumps += 1;
                }
            }
            Op::CallLocal { target } => {
                if !is_insn(target) {
                    return Err(violation(
                        pc,
                        Rule::Call,
                        format!("call target {target} is not an instruction of the program"),
                    ));
                }
                starts.insert(target as usize);
                calls.push((pc, target as usize));
            }
            Op::CallHelper { id } => {
                if !config.helpers.contains(&id) {
                    return Err(violation(
                        pc,
                        Rule::Helper,
                        format!("helper {id} is not on the whitelist"),
                    ));
                }
                helpers_used.insert(id);
            }
            Op::Load {
                base, off, size, ..
            } => check_stack(pc, base, off, size)?,
            Op::Store {
                base, off, size, ..
            }
            | Op::Atomic {
                base, off, size, ..
            } => check_stack(pc, base, off, size)?,
            _ => {}
        }
    }

    // Function bodies run from each start to the next; each ends without falling through,
    // and its jumps stay inside it.
    let starts: Vec<usize> = starts.into_iter().collect();
    let mut functions = Vec::with_capacity(starts.len());
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(n);
        let last = (start..end)
            .rev()
            .find(|&pc| ops[pc].is_some())
            .unwrap_or(start);
        match ops[last] {
            Some(op) if op.ends_block() => {}
            _ => {
                return Err(violation(
                    last,
                    Rule::Fallthrough,
                    format!("function starting at insn {start} can run past its end"),
                ))
            }
        }
        for (pc, op) in ops.iter().enumerate().take(end).skip(start) {
            if let Some(Op::Ja { target } | Op::Jump { target, .. }) = *op {
                let t = target as usize;
                if t < start || t >= end {
                    return Err(violation(
                        pc,
                        Rule::Jump,
                        format!("jump to {t} leaves its function ({start}..{end})"),
                    ));
                }
            }
        }
        functions.push((start, end));
    }

    let function_of = |pc: usize| match starts.binary_search(&pc) {
        Ok(k) => k,
        Err(k) => k.saturating_sub(1),
    };
    let edges: Vec<(usize, usize)> = calls
        .iter()
        .map(|&(pc, callee)| (function_of(pc), function_of(callee)))
        .collect();
    let recursive = has_cycle(starts.len(), &edges);

    Ok(Checked {
        insns,
        ops,
        verdict: Verdict {
            insns: n,
            functions: functions.len(),
            helpers: helpers_used.into_iter().collect(),
            backward_jumps,
            recursive,
        },
        functions,
    })
}

/// True when the call graph over `nodes` functions has a cycle.
fn has_cycle(nodes: usize, edges: &[(usize, usize)]) -> bool {
    // Kahn's algorithm: a graph is acyclic iff repeatedly removing nodes without incoming
    // edges removes them all.
    let mut indegree = vec![0usize; nodes];
    for &(_, to) in edges {
        indegree[to] += 1;
    }
    let mut ready: Vec<usize> = (0..nodes).filter(|&v| indegree[v] == 0).collect();
    let mut removed = 0;
    while let Some(v) = ready.pop() {
        removed += 1;
        for &(from, to) in edges {
            if from == v {
                indegree[to] -= 1;
                if indegree[to] == 0 {
                    ready.push(to);
                }
            }
        }
    }
    removed < nodes
}

fn check_stack(pc: usize, base: u8, off: i16, size: u8) -> Result<(), Violation> {
    if base != FRAME_POINTER {
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
    use crate::opcode::*;

    fn prog(insns: &[Insn]) -> Program {
        Program::from_bytecode("t", encode_all(insns))
    }
    fn i(op: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn::new(op, dst, src, off, imm)
    }
    const MOV64_IMM: u8 = CLASS_ALU64 | ALU_MOV | SRC_K;
    const ADD64_IMM: u8 = CLASS_ALU64 | ALU_ADD | SRC_K;
    const JNE_IMM: u8 = CLASS_JMP | JMP_JNE | SRC_K;
    const JEQ_IMM: u8 = CLASS_JMP | JMP_JEQ | SRC_K;
    const STXDW: u8 = CLASS_STX | MODE_MEM | SIZE_DW;

    fn rule_of(p: &Program) -> Rule {
        verify(p, &VerifierConfig::default()).unwrap_err().rule
    }

    #[test]
    fn accepts_minimal() {
        let p = prog(&[i(MOV64_IMM, 0, 0, 0, 1), Insn::EXIT]);
        assert_eq!(verify(&p, &VerifierConfig::default()).unwrap().insns, 2);
    }

    #[test]
    fn rejections_name_index_and_rule() {
        let v = verify(
            &prog(&[i(0xff, 0, 0, 0, 0), Insn::EXIT]),
            &VerifierConfig::default(),
        )
        .unwrap_err();
        assert_eq!((v.index, v.rule), (0, Rule::Opcode));
        assert!(v.to_string().starts_with("insn 0: opcode:"), "{v}");
        assert_eq!(
            rule_of(&prog(&[i(MOV64_IMM, 10, 0, 0, 0), Insn::EXIT])),
            Rule::Register
        );
        assert_eq!(
            rule_of(&prog(&[i(MOV64_IMM, 11, 0, 0, 0), Insn::EXIT])),
            Rule::Register
        );
        assert_eq!(
            rule_of(&prog(&[i(CALL, 0, 0, 0, 999), Insn::EXIT])),
            Rule::Helper
        );
        assert_eq!(rule_of(&prog(&[i(JA, 0, 0, 5, 0), Insn::EXIT])), Rule::Jump);
        assert_eq!(
            rule_of(&prog(&[i(STXDW, 10, 1, -520, 0), Insn::EXIT])),
            Rule::Stack
        );
        assert_eq!(
            rule_of(&prog(&[i(STXDW, 10, 1, -4, 0), Insn::EXIT])),
            Rule::Stack
        );
        assert_eq!(
            rule_of(&prog(&[i(MOV64_IMM, 0, 0, 0, 0)])),
            Rule::Fallthrough
        );
        assert_eq!(rule_of(&prog(&[])), Rule::Size);
        assert_eq!(
            rule_of(&prog(&[i(CALL, 0, 2, 0, 0), Insn::EXIT])),
            Rule::Call
        );
    }

    #[test]
    fn loops_and_recursion_verify() {
        // 0: r0 = 0; 1: r0 += 1; 2: if r0 != 10 goto 1; 3: exit
        let l = prog(&[
            i(MOV64_IMM, 0, 0, 0, 0),
            i(ADD64_IMM, 0, 0, 0, 1),
            i(JNE_IMM, 0, 0, -2, 10),
            Insn::EXIT,
        ]);
        let v = verify(&l, &VerifierConfig::default()).unwrap();
        assert_eq!(v.backward_jumps, 1);
        assert!(!v.recursive);
        // A jump to itself is a loop too.
        assert!(verify(
            &prog(&[i(JA, 0, 0, -1, 0), Insn::EXIT]),
            &VerifierConfig::default()
        )
        .is_ok());
        // Recursion: entry calls f at 2, f calls itself.
        let rec = prog(&[
            i(CALL, 0, CALL_LOCAL, 0, 1),
            Insn::EXIT,
            i(CALL, 0, CALL_LOCAL, 0, -1),
            Insn::EXIT,
        ]);
        let v = verify(&rec, &VerifierConfig::default()).unwrap();
        assert!(v.recursive);
        assert_eq!(v.functions, 2);
    }

    #[test]
    fn jumps_may_not_leave_their_function() {
        // entry 0..3 calls f at 3; f jumps back into the entry.
        let mut p = prog(&[
            i(CALL, 0, CALL_LOCAL, 0, 2),
            i(MOV64_IMM, 0, 0, 0, 0),
            Insn::EXIT,
            i(JEQ_IMM, 1, 0, -3, 0),
            Insn::EXIT,
        ]);
        p.functions = vec![0, 3];
        let v = verify(&p, &VerifierConfig::default()).unwrap_err();
        assert_eq!((v.index, v.rule), (3, Rule::Jump));
        assert!(v.reason.contains("leaves its function"), "{v}");
    }

    #[test]
    fn instruction_cap() {
        let mut body = vec![i(MOV64_IMM, 0, 0, 0, 0); 10];
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
