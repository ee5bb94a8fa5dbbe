//! The public eBPF conformance suite (`../shared/conformance`, 313 programs) through `naam
//! conformance-plugin`, exactly as the suite's own runner drives a plugin: the program as hex
//! on stdin, the memory as hex in the first argument, r0 as hex on stdout. It runs on the
//! interpreter, on x86-64 JIT code and on aarch64 JIT code under qemu-user.
//!
//! Tests expected to fail, with the reason for each: none.
const EXPECTED_FAILURES: &[(&str, &str)] = &[];

use std::io::Write as _;
use std::process::{Command, Stdio};

struct Case {
    name: String,
    code_hex: String,
    mem_hex: String,
    result: u64,
}

fn suite() -> Vec<Case> {
    let dir = naam_vm::conformance::suite_dir();
    let path = dir.join("tests.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "the conformance suite is expected at {} ({e}); set NAAM_CONFORMANCE_DIR",
            path.display()
        )
    });
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Case {
                name: v["name"].as_str().unwrap().into(),
                code_hex: v["code_hex"].as_str().unwrap().into(),
                mem_hex: v["mem_hex"].as_str().unwrap().into(),
                result: v["result"].as_u64().unwrap(),
            }
        })
        .collect()
}

/// Runs one case through the plugin; `Err` describes a failure.
fn plugin(case: &Case, engine: &str, target: &str) -> Result<(), String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_naam"));
    cmd.args(["conformance-plugin", "--engine", engine, "--target", target]);
    if !case.mem_hex.is_empty() {
        cmd.arg(&case.mem_hex);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(case.code_hex.as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "exit {:?}: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let r0 = u64::from_str_radix(text.trim(), 16).map_err(|e| format!("output `{text}`: {e}"))?;
    if r0 != case.result {
        return Err(format!("r0 = {r0:#x}, expected {:#x}", case.result));
    }
    Ok(())
}

fn run_suite(engine: &str, target: &str) {
    let cases = suite();
    assert_eq!(cases.len(), 313, "the suite has 313 tests");
    // Two workers: this machine has two cores.
    let failures: Vec<String> = std::thread::scope(|s| {
        let halves: Vec<_> = cases
            .chunks(cases.len().div_ceil(2))
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .filter_map(|c| {
                            plugin(c, engine, target).err().map(|e| (c.name.clone(), e))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        halves
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .filter(|(name, _)| !EXPECTED_FAILURES.iter().any(|(n, _)| n == name))
            .map(|(name, e)| format!("{name}: {e}"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{engine}/{target}: {} of 313 failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn suite_on_the_interpreter() {
    run_suite("interp", "x86_64");
}

#[test]
fn suite_on_x86_64_jit_code() {
    run_suite("jit", "x86_64");
}

#[test]
fn suite_on_aarch64_jit_code_under_qemu() {
    if !naam_vm::cross::available_or_skip("the aarch64 suite") {
        return;
    }
    run_suite("jit", "aarch64");
}

#[test]
fn plugin_refusals_are_reported_on_stderr_with_exit_1() {
    // A legacy packet load: refused by the verifier.
    let case = Case {
        name: "refused".into(),
        code_hex: "20000000000000009500000000000000".into(),
        mem_hex: String::new(),
        result: 0,
    };
    let err = plugin(&case, "jit", "x86_64").unwrap_err();
    assert!(
        err.starts_with("exit Some(1)") && err.contains("legacy packet loads"),
        "{err}"
    );
    // Bad hex: usage error, exit 2.
    let bad = Case {
        code_hex: "zz".into(),
        ..case
    };
    let err = plugin(&bad, "interp", "x86_64").unwrap_err();
    assert!(
        err.starts_with("exit Some(2)") && err.contains("not valid hex"),
        "{err}"
    );
    // The interpreter cannot run on aarch64: said so.
    let mov = Case {
        name: "mov".into(),
        code_hex: "b7000000010000009500000000000000".into(),
        mem_hex: String::new(),
        result: 1,
    };
    let err = plugin(&mov, "interp", "aarch64").unwrap_err();
    assert!(err.contains("host only"), "{err}");
}
