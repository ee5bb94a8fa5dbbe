//! Differential tests: random verifiable programs ([`naam_vm_testing::gen`]) must behave identically on
//! the interpreter and the JIT (r0 or fault, instruction count, memory, stack, trace), on
//! aarch64 code under qemu, and, for the integer subset, on rbpf's interpreter (an
//! implementation we did not write). Each divergence class ever found has a regression test
//! below. The long run is the cargo-fuzz target `differential` (see bench/RESULTS.md).

use naam_proto::EngineKind;
use naam_vm::insn::{encode_all, Insn};
use naam_vm::opcode::*;
use naam_vm::Program;
use naam_vm_testing::gen::{self, Choices, GenConfig, Generated};

fn cases() -> u64 {
    std::env::var("NAAM_DIFF_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

#[test]
fn interpreter_and_jit_agree_on_random_programs() {
    let mut verified = 0;
    let mut faults = std::collections::BTreeMap::<&str, u64>::new();
    for seed in 0..cases() {
        let data = gen::seeded_bytes(seed, 1500);
        let g = gen::generate(&mut Choices::new(&data), &GenConfig::default());
        match gen::check(&g) {
            Ok(Some(outcome)) => {
                verified += 1;
                let kind = match &outcome.result {
                    Ok(_) => "ok",
                    Err(e) => e.kind(),
                };
                *faults.entry(kind).or_default() += 1;
            }
            Ok(None) => panic!("seed {seed}: the generator made a program the verifier refuses"),
            Err(d) => panic!(
                "seed {seed}: {d}\nprogram: {:?}",
                naam_vm::insn::decode_all(&g.program.code)
            ),
        }
    }
    eprintln!("{verified} programs agreed; outcomes: {faults:?}");
    // The generator reaches every kind of ending, so every path is compared.
    for kind in [
        "ok",
        "out-of-bounds",
        "budget",
        "call-depth",
        "misaligned",
        "aborted",
    ] {
        assert!(
            faults.get(kind).copied().unwrap_or(0) > 0,
            "no run ended `{kind}`: {faults:?}"
        );
    }
}

/// rbpf 0.4's interpreter as a third, independent oracle on the integer subset.
#[test]
fn rbpf_agrees_on_integer_programs() {
    let mut compared = 0;
    for seed in 0..cases() / 2 {
        let data = gen::seeded_bytes(seed ^ 0xabcdef, 800);
        let g = gen::generate(&mut Choices::new(&data), &GenConfig::rbpf());
        let Some(ours) = gen::check(&g).unwrap_or_else(|d| panic!("seed {seed}: {d}")) else {
            panic!("seed {seed}: unverifiable");
        };
        let Ok(r0) = ours.result else { continue };
        let mut mem = g.memory.clone();
        let vm = match rbpf::EbpfVmRaw::new(Some(&g.program.code)) {
            Ok(vm) => vm,
            Err(e) => panic!("seed {seed}: rbpf refused a program we run: {e}"),
        };
        let theirs = vm.execute_program(&mut mem);
        match theirs {
            Ok(v) => assert_eq!(
                v,
                r0,
                "seed {seed}: rbpf computes {v:#x}, we compute {r0:#x}\n{:?}",
                naam_vm::insn::decode_all(&g.program.code)
            ),
            Err(e) => panic!("seed {seed}: rbpf failed: {e}"),
        }
        compared += 1;
    }
    assert!(compared > 100, "only {compared} programs compared");
}

/// aarch64 code under qemu against the interpreter, on a sample (each run starts a process).
#[test]
fn aarch64_code_agrees_with_the_interpreter() {
    if !naam_vm::cross::available_or_skip("aarch64 differential runs") {
        return;
    }
    let samples: u64 = std::env::var("NAAM_DIFF_AARCH64_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    for seed in 0..samples {
        let data = gen::seeded_bytes(seed ^ 0x5eed, 1500);
        let g = gen::generate(&mut Choices::new(&data), &GenConfig::position_independent());
        aarch64_agrees(&g, &format!("seed {seed}"));
    }
}

fn aarch64_agrees(g: &Generated, what: &str) {
    use naam_vm::jit::Target;
    use naam_vm::{Executable, Vm};
    let interp = Executable::build(&g.program, &gen::options(EngineKind::Interp)).unwrap();
    let mut vm = Vm::new();
    let mut buffer = gen::Buffer::new(g.memory.len());
    let mut host = gen::run(&mut vm, &interp, &g.memory, &mut buffer);
    let compiled = interp.compile_for(Target::Aarch64).unwrap();
    vm.clear_stack();
    let mem = buffer.bytes();
    mem.copy_from_slice(&g.memory);
    let image = vm.image_raw(&interp, mem).unwrap();
    let out = naam_vm::cross::run(&compiled, &image).unwrap_or_else(|e| panic!("{what}: {e}"));
    // qemu maps memory elsewhere: fault addresses are translated back to the host's.
    let result = out.result_in_host_space(&image, gen::BUDGET);
    host.result = naam_vm::cross::normalize_host_fault(&image, host.result);
    let memory_after = image.slot_region[naam_vm::memory::slot::ENTRY]
        .and_then(|r| out.regions[r].clone())
        .unwrap_or_default();
    let stack_after = out.stack_bytes();
    let arm = gen::Observed {
        insns: result.is_ok().then_some(out.state.executed),
        result,
        memory: memory_after,
        stack: stack_after,
        trace: out.trace().to_vec(),
    };
    if let Err(d) = gen::compare(&host, &arm) {
        panic!(
            "{what}: interp vs aarch64: {d}\n{:?}",
            naam_vm::insn::decode_all(&g.program.code)
        );
    }
}

// ---- Regression tests: one per divergence class found. ----

fn raw(insns: &[Insn]) -> Generated {
    Generated {
        program: Program::from_bytecode("regression", encode_all(insns)),
        memory: vec![0u8; 16],
    }
}

fn agree(g: &Generated) -> Result<u64, naam_vm::VmError> {
    gen::check(g)
        .expect("engines agree")
        .expect("verifies")
        .result
}

/// rbpf 0.4's JIT compiled `w0 = w1` as a 64-bit move (the upper half survived); the
/// conformance test `mov` and the handler `pick` showed it.
#[test]
fn regression_32_bit_move_clears_the_upper_half() {
    let g = raw(&[
        Insn::new(LDDW, 1, 0, 0, 0x1122_3344),
        Insn::new(0, 0, 0, 0, 0xdead_beef_u32 as i32),
        Insn::new(CLASS_ALU | ALU_MOV | SRC_X, 0, 1, 0, 0),
        Insn::EXIT,
    ]);
    assert_eq!(agree(&g), Ok(0x1122_3344));
}

/// Division and remainder by a register holding zero, and `MIN / -1`, in both widths.
#[test]
fn regression_division_corner_cases() {
    for (class, off, op, a, b, want) in [
        (CLASS_ALU64, 0, ALU_DIV, 7i64, 0i64, 0u64),
        (CLASS_ALU64, 0, ALU_MOD, 7, 0, 7),
        (CLASS_ALU64, 1, ALU_DIV, i64::MIN, -1, i64::MIN as u64),
        (CLASS_ALU64, 1, ALU_MOD, i64::MIN, -1, 0),
        (CLASS_ALU, 1, ALU_DIV, i32::MIN as i64, -1, 0x8000_0000),
        (CLASS_ALU, 0, ALU_MOD, 0x1_0000_0007, 0, 7),
    ] {
        let g = raw(&[
            Insn::new(LDDW, 0, 0, 0, a as u32 as i32),
            Insn::new(0, 0, 0, 0, (a as u64 >> 32) as u32 as i32),
            Insn::new(LDDW, 1, 0, 0, b as u32 as i32),
            Insn::new(0, 0, 0, 0, (b as u64 >> 32) as u32 as i32),
            Insn::new(class | op | SRC_X, 0, 1, off, 0),
            Insn::EXIT,
        ]);
        assert_eq!(agree(&g), Ok(want), "{class:#x} {op:#x} {a} {b}");
    }
}

/// The JIT compares short ranges inline (no helper call) where its sites remember their
/// grants: every length either side of a word, equal or differing at each byte, with the
/// first difference either way round, and ranges that leave their grant (the helper's
/// `ERR_FAULT`), from the memory and from the stack (another grant: the first call probes,
/// the second runs inline). Both engines must give the same answers.
#[test]
fn inline_memcmp_agrees_with_the_helper() {
    use naam_ebpf::abi::helper::MEMCMP;
    const HALF: usize = 80;
    // r6 = memory; r7 = memcmp(mem + a_off, mem + b_off, len); then the stack (zeros,
    // another grant) against mem + a_off; r0 = r7 * 16 + the second answer.
    let program = |a_off: i32, b_off: i32, len: i32| {
        raw(&[
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 6, 1, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 1, 6, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, 1, 0, 0, a_off),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 2, 6, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, 2, 0, 0, b_off),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, len),
            Insn::new(CALL, 0, 0, 0, MEMCMP as i32),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 7, 0, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 1, 10, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, 1, 0, 0, -64),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 2, 6, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_ADD | SRC_K, 2, 0, 0, a_off),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_K, 3, 0, 0, len.min(64)),
            Insn::new(CALL, 0, 0, 0, MEMCMP as i32),
            Insn::new(CLASS_ALU64 | ALU_LSH | SRC_K, 7, 0, 0, 4),
            Insn::new(CLASS_ALU64 | ALU_ADD | SRC_X, 0, 7, 0, 0),
            Insn::EXIT,
        ])
    };
    let mut compared = 0;
    for len in [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 80] {
        for flip in (0..len.min(HALF)).step_by(3).map(Some).chain([None]) {
            for up in [false, true] {
                let mut g = program(0, HALF as i32, len as i32);
                g.memory = (0..2 * HALF).map(|i| (i % HALF) as u8 ^ 0x5a).collect();
                if let Some(k) = flip {
                    let at = HALF + k;
                    g.memory[at] = if up {
                        g.memory[at].wrapping_add(1)
                    } else {
                        g.memory[at].wrapping_sub(1)
                    };
                }
                agree(&g).expect("a memcmp runs to the end");
                compared += 1;
            }
        }
        // The second range runs past the memory's end: the helper's ERR_FAULT, inline too.
        let mut g = program(0, (2 * HALF - len / 2) as i32, len as i32);
        g.memory = vec![7; 2 * HALF];
        agree(&g).expect("a refused memcmp is a result, not a fault");
    }
    assert!(compared > 100);
}
