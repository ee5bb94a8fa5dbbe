//! Bad input never crashes: malformed ELF, truncated bytecode, unknown helpers, oversized
//! programs, missing sections, hostile bytecode and forbidden stores each get a clear error.

mod common;

use naam_ebpf::abi::{Context, CONTEXT_SIZE};
use naam_proto::step::{Grant, Invocation};
use naam_proto::EngineKind;
use naam_vm::insn::{encode_all, Insn};
use naam_vm::{load, verify, Executable, LoadError, Program, Rule, VerifierConfig};
use naam_vm::{ExecOptions, StepError, Vm, VmError};
use proptest::prelude::*;
use rbpf::ebpf;

use common::elf_object as elf;
use object::write::Object as WObject;
use object::{Architecture, BinaryFormat, Endianness, SectionKind};

fn insn(op: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn::new(op, dst, src, off, imm)
}

fn ret0() -> Vec<u8> {
    encode_all(&[insn(ebpf::MOV64_IMM, 0, 0, 0, 0), Insn::EXIT])
}

#[test]
fn malformed_elf_is_a_clear_error() {
    for bytes in [
        &b""[..],
        b"\x7fELF",
        b"hello world, not an object",
        &[0u8; 64],
    ] {
        let err = load(bytes).unwrap_err();
        assert!(matches!(err, LoadError::Malformed(_)), "{err}");
        assert!(err.to_string().starts_with("malformed ELF"));
    }
    // A valid ELF for another machine.
    let mut obj = WObject::new(BinaryFormat::Elf, Architecture::X86_64, Endianness::Little);
    obj.add_section(Vec::new(), b"naam/x".to_vec(), SectionKind::Text);
    let err = load(&obj.write().unwrap()).unwrap_err();
    assert!(matches!(err, LoadError::NotBpf(_)), "{err}");
}

#[test]
fn truncated_bytecode_is_a_clear_error() {
    let mut code = ret0();
    code.truncate(13);
    let err = load(&elf(&[("naam/cut", &code)])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "section `naam/cut`: truncated bytecode (13 bytes is not a multiple of 8)"
    );
}

#[test]
fn missing_section_is_a_clear_error() {
    let err = load(&elf(&[(".text", &ret0())])).unwrap_err();
    assert!(matches!(err, LoadError::NoHandlers), "{err}");
    assert!(err.to_string().contains("naam/<name>"));
    // And asking for a handler that is not there names the ones that are.
    let obj = load(&elf(&[("naam/present", &ret0())])).unwrap();
    let err = obj.get("absent").unwrap_err();
    assert_eq!(
        err.to_string(),
        "no handler named `absent` (the object has: present)"
    );
    // An empty name is not a handler name.
    assert!(matches!(
        load(&elf(&[("naam/", &ret0())])),
        Err(LoadError::BadName(_))
    ));
}

#[test]
fn unknown_helper_is_rejected_with_its_index() {
    let code = encode_all(&[
        insn(ebpf::MOV64_IMM, 1, 0, 0, 0),
        insn(ebpf::CALL, 0, 0, 0, 4242),
        Insn::EXIT,
    ]);
    let obj = load(&elf(&[("naam/h", &code)])).unwrap();
    let v = verify(obj.get("h").unwrap(), &VerifierConfig::default()).unwrap_err();
    assert_eq!((v.index, v.rule), (1, Rule::Helper));
    assert_eq!(
        v.to_string(),
        "insn 1: helper: helper 4242 is not on the whitelist"
    );
}

#[test]
fn oversized_program_is_rejected() {
    let mut insns = vec![insn(ebpf::MOV64_IMM, 0, 0, 0, 0); 20_000];
    insns.push(Insn::EXIT);
    let obj = load(&elf(&[("naam/big", &encode_all(&insns))])).unwrap();
    let v = verify(obj.get("big").unwrap(), &VerifierConfig::default()).unwrap_err();
    assert_eq!(v.rule, Rule::Size);
    assert!(
        v.reason
            .contains("20001 instructions exceed the cap of 16384"),
        "{v}"
    );
}

/// Bytecode that loads segment 0's address from the context and stores through it.
fn store_through_segment0() -> Program {
    let addr_off = std::mem::offset_of!(Context, segments) as i16;
    Program::from_bytecode(
        "poke",
        encode_all(&[
            insn(ebpf::LD_DW_REG, 2, 1, addr_off, 0),
            insn(ebpf::ST_DW_IMM, 2, 0, 0, 7),
            insn(ebpf::MOV64_IMM, 0, 0, 0, 0),
            Insn::EXIT,
        ]),
    )
}

fn both(p: &Program) -> [Executable; 2] {
    [EngineKind::Interp, EngineKind::Jit]
        .map(|e| Executable::new(p, e, &VerifierConfig::default()).unwrap())
}

#[test]
fn stores_to_read_only_segments_are_refused() {
    for exe in both(&store_through_segment0()) {
        stores_to_read_only_segments_are_refused_on(&exe);
    }
}

fn stores_to_read_only_segments_are_refused_on(exe: &Executable) {
    let mut vm = Vm::new();
    let seg = [0u8; 8];
    let inv = Invocation {
        segments: &[Grant::read(&seg)],
        ..Invocation::default()
    };
    let err = vm.run(exe, &inv).unwrap_err();
    assert!(
        matches!(
            err,
            StepError::Vm(VmError::OutOfBounds { kind: "store", .. })
        ),
        "{err}"
    );
    assert_eq!(seg, [0u8; 8], "memory untouched");
    // With the write right the same store lands.
    let mut seg = [0u8; 8];
    let inv = Invocation {
        segments: &[Grant::with_access(
            &mut seg,
            naam_ebpf::abi::ACCESS_READ | naam_ebpf::abi::ACCESS_WRITE,
        )],
        ..Invocation::default()
    };
    vm.run(exe, &inv).unwrap();
    assert_eq!(seg, 7u64.to_le_bytes());
}

#[test]
fn invocation_limits_are_checked() {
    let exe = Executable::new(
        &Program::from_bytecode("r", ret0()),
        EngineKind::Jit,
        &VerifierConfig::default(),
    )
    .unwrap();
    let mut vm = Vm::new();
    let big = vec![0u8; naam_ebpf::abi::ARGS_CAP + 1];
    let err = vm
        .run(
            &exe,
            &Invocation {
                args: &big,
                ..Invocation::default()
            },
        )
        .unwrap_err();
    assert!(matches!(err, StepError::BadInput(_)), "{err}");
    let seg = [0u8; 1];
    let nine = vec![Grant::read(&seg); 9];
    let err = vm
        .run(
            &exe,
            &Invocation {
                segments: &nine,
                ..Invocation::default()
            },
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("9 segments exceed the maximum of 8"),
        "{err}"
    );
    // Still serving.
    assert!(vm.run(&exe, &Invocation::default()).is_ok());
}

fn with_budget(p: &Program, engine: EngineKind, budget: u64) -> Executable {
    Executable::build(p, &ExecOptions::new(engine, budget)).unwrap()
}

#[test]
fn instruction_budget_stops_loops() {
    // r0 += 1; goto -2: never ends.
    let p = Program::from_bytecode(
        "spin",
        encode_all(&[
            insn(ebpf::ADD64_IMM, 0, 0, 0, 1),
            insn(ebpf::JA, 0, 0, -2, 0),
            Insn::EXIT,
        ]),
    );
    for engine in [EngineKind::Interp, EngineKind::Jit] {
        let exe = with_budget(&p, engine, 1000);
        let mut vm = Vm::new();
        let err = vm.run(&exe, &Invocation::default()).unwrap_err();
        assert_eq!(
            err,
            StepError::Vm(VmError::Budget { limit: 1000 }),
            "{engine}"
        );
        assert!(err.to_string().contains("budget exhausted"), "{err}");
        // The VM keeps serving.
        let ok = with_budget(&Program::from_bytecode("r", ret0()), engine, 1000);
        assert!(vm.run(&ok, &Invocation::default()).is_ok());
    }
}

#[test]
fn straight_line_code_overshoots_the_budget_by_at_most_its_length() {
    // The budget is checked at backward jumps and calls (as fuel is in wasm engines): code
    // without either is bounded by the instruction cap instead, and both engines count it.
    let mut insns = vec![insn(ebpf::ADD64_IMM, 0, 0, 0, 1); 5000];
    insns.push(Insn::EXIT);
    let p = Program::from_bytecode("long", encode_all(&insns));
    for engine in [EngineKind::Interp, EngineKind::Jit] {
        let out = Vm::new()
            .run(&with_budget(&p, engine, 1000), &Invocation::default())
            .unwrap();
        assert_eq!((out.return_code, out.insns), (5000, Some(5001)), "{engine}");
    }
}

#[test]
fn handler_output_fields_are_validated() {
    // Sets next_count to 99 and returns Done.
    let off = std::mem::offset_of!(Context, next_count) as i16;
    let p = Program::from_bytecode(
        "liar",
        encode_all(&[
            insn(ebpf::ST_W_IMM, 1, 0, off, 99),
            insn(ebpf::MOV64_IMM, 0, 0, 0, 0),
            Insn::EXIT,
        ]),
    );
    for exe in both(&p) {
        let err = Vm::new().run(&exe, &Invocation::default()).unwrap_err();
        assert!(matches!(err, StepError::BadOutput(_)), "{err}");
    }
    assert_eq!(CONTEXT_SIZE % 8, 0);
}

const VALID_OPS: &[u8] = &[
    ebpf::MOV64_IMM,
    ebpf::MOV64_REG,
    ebpf::ADD64_IMM,
    ebpf::ADD64_REG,
    ebpf::SUB64_REG,
    ebpf::MUL64_REG,
    ebpf::DIV64_REG,
    ebpf::MOD64_REG,
    ebpf::LSH64_REG,
    ebpf::ARSH64_REG,
    ebpf::ADD32_REG,
    ebpf::DIV32_REG,
    ebpf::MOD32_IMM,
    ebpf::NEG64,
    ebpf::LD_B_REG,
    ebpf::LD_DW_REG,
    ebpf::LD_W_REG,
    ebpf::ST_DW_REG,
    ebpf::ST_B_IMM,
    ebpf::ST_W_REG,
    ebpf::JEQ_IMM,
    ebpf::JGT_REG,
    ebpf::JSLT_IMM32,
    ebpf::JA,
    ebpf::CALL,
    ebpf::EXIT,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Arbitrary bytes never panic the loader.
    #[test]
    fn loader_survives_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = load(&bytes);
    }

    /// Random mutations of a valid object never panic the loader or the verifier.
    #[test]
    fn loader_survives_mutated_objects(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut bytes = elf(&[("naam/a", &ret0()), (".text", &ret0())]);
        for (at, b) in flips {
            let n = bytes.len();
            bytes[at % n] = b;
        }
        if let Ok(obj) = load(&bytes) {
            for p in &obj.programs {
                let _ = verify(p, &VerifierConfig::default());
            }
        }
    }

    /// Random programs built from valid opcodes (forward jumps, loads and stores through any
    /// register, helper calls) never escape the interpreter's memory map or crash it.
    #[test]
    fn hostile_bytecode_is_contained(
        code in proptest::collection::vec(
            (proptest::sample::select(VALID_OPS), 0u8..11, 0u8..11, -16i16..24, any::<i32>()),
            1..60,
        )
    ) {
        let mut insns: Vec<Insn> = code.into_iter().map(|(op, dst, src, off, imm)| {
            let imm = if op == ebpf::CALL { (imm as u32 % 7) as i32 } else { imm };
            insn(op, dst, if op == ebpf::CALL { 0 } else { src }, off, imm)
        }).collect();
        insns.push(Insn::EXIT);
        let bytes = encode_all(&insns);
        let p = Program::from_bytecode("fuzz", bytes);
        if verify(&p, &VerifierConfig::default()).is_ok() {
            let seg = [0xabu8; 32];
            let inv = Invocation { args: &[1, 2, 3], segments: &[Grant::read(&seg)], ..Invocation::default() };
            let [interp, jit] = both(&p).map(|exe| {
                let mut vm = Vm::new();
                vm.run(&exe, &inv).map(|o| (o.return_code, o.insns))
            });
            prop_assert_eq!(seg, [0xabu8; 32]);
            prop_assert_eq!(interp, jit);
        }
    }
}
