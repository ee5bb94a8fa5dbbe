//! The public eBPF conformance suite (`../shared/conformance`, 313 programs), run in-process
//! on the interpreter and on the host JIT. Every test must pass: there is no list of expected
//! failures. (`naam-runtime`'s CLI tests run the same suite through `naam
//! conformance-plugin`, and on aarch64 code under qemu.)

use naam_proto::EngineKind;
use naam_vm::opcode::INSN_SIZE;
use naam_vm::{conformance, ExecOptions, Program};

struct Case {
    name: String,
    code: Vec<u8>,
    mem: Vec<u8>,
    result: u64,
}

fn cases() -> Vec<Case> {
    let path = conformance::suite_dir().join("tests.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "the conformance suite is expected at {} ({e}); set NAAM_CONFORMANCE_DIR",
            path.display()
        )
    });
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            Case {
                name: v["name"].as_str().expect("name").to_string(),
                code: hex::decode(v["code_hex"].as_str().expect("code")).expect("hex"),
                mem: hex::decode(v["mem_hex"].as_str().expect("mem")).expect("hex"),
                result: v["result"].as_u64().expect("result"),
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Where {
    Host(EngineKind),
    Aarch64,
}

fn run(case: &Case, at: Where) -> Result<u64, String> {
    assert_eq!(case.code.len() % INSN_SIZE, 0);
    let program = Program::from_bytecode(&case.name, case.code.clone());
    match at {
        Where::Host(engine) => {
            conformance::run_host(&program, &ExecOptions::conformance(engine), &case.mem)
        }
        Where::Aarch64 => conformance::run_aarch64(
            &program,
            &ExecOptions::conformance(EngineKind::Jit),
            &case.mem,
        ),
    }
}

fn check(at: Where) {
    let cases = cases();
    assert_eq!(cases.len(), 313, "the suite has 313 tests");
    let mut failures = Vec::new();
    for c in &cases {
        match run(c, at) {
            Ok(r0) if r0 == c.result => {}
            Ok(r0) => failures.push(format!(
                "{}: r0 = {r0:#x}, expected {:#x}",
                c.name, c.result
            )),
            Err(e) => failures.push(format!("{}: {e}", c.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{at:?}: {} of {} conformance tests failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn conformance_interpreter() {
    check(Where::Host(EngineKind::Interp));
}

#[test]
fn conformance_jit_host() {
    check(Where::Host(EngineKind::Jit));
}

/// aarch64 code under qemu-user. Skips, saying why, only outside CI when the cross compiler
/// or qemu is missing; in CI (`CI` set) a missing tool fails the test.
#[test]
fn conformance_jit_aarch64() {
    if !naam_vm::cross::available_or_skip("the aarch64 conformance run") {
        return;
    }
    check(Where::Aarch64);
}
