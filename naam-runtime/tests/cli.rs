//! The `naam` CLI contract: `build`, `verify` and `run` as later tooling relies on them.

mod common;

use std::process::Command;

use common::{examples, repo};
use serde_json::Value;

fn naam(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_naam"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn obj() -> String {
    examples().0.display().to_string()
}

#[test]
fn verify_prints_one_line_per_handler() {
    let (code, out, _) = naam(&["verify", &obj()]);
    assert_eq!(code, 0, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), examples().1.programs.len());
    for line in lines {
        let cols: Vec<&str> = line.split('\t').collect();
        assert_eq!(cols.len(), 4, "{line}");
        assert!(cols[1].ends_with(" insns") && cols[2] == "ok", "{line}");
    }
    // A rejected handler: exit 1, with the instruction and the rule.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("legacy.o");
    std::fs::write(&bad, legacy_packet_load_object()).unwrap();
    let (code, out, _) = naam(&["verify", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        out.starts_with("legacy\t")
            && out.contains("\trejected\tinsn 1: opcode:")
            && out.contains("legacy packet loads"),
        "{out}"
    );
}

/// An eBPF object whose one handler, `legacy`, uses a legacy packet load (`ldabsw`), which
/// the verifier refuses.
fn legacy_packet_load_object() -> Vec<u8> {
    let code = [
        0xb7u8, 0, 0, 0, 0, 0, 0, 0, // r0 = 0
        0x20, 0, 0, 0, 0, 0, 0, 0, // ldabsw 0
        0x95, 0, 0, 0, 0, 0, 0, 0, // exit
    ];
    common::elf_object(&[("naam/legacy", &code)])
}

#[test]
fn run_prints_the_contract_fields() {
    for engine in ["interp", "jit"] {
        let (code, out, err) = naam(&[
            "run",
            &obj(),
            "--handler",
            "add",
            "--args-hex",
            "05000000000000000700000000000000",
            "--engine",
            engine,
            "--repeat",
            "1000",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["status"], "done");
        assert_eq!(v["return_code"], 0);
        assert_eq!(v["reply_hex"], "0c00000000000000");
        assert_eq!(v["next"], Value::Array(vec![]));
        assert_eq!(v["engine"], engine);
        assert!(v["ns_per_invocation"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn error_codes_are_named() {
    // checksum refuses a segment whose length is not a multiple of 8: Fault::app(1).
    let dir = tempfile::tempdir().unwrap();
    let seg = dir.path().join("odd.bin");
    std::fs::write(&seg, [1u8, 2, 3]).unwrap();
    let (code, out, err) = naam(&[
        "run",
        &obj(),
        "--handler",
        "checksum",
        "--segment",
        seg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "error");
    assert_eq!(v["error_code"], 4097);
    assert_eq!(v["error_name"], "app(1)");
    // Asking for a segment that was not fetched: the SDK's own code, by name.
    let (_, out, _) = naam(&["run", &obj(), "--handler", "checksum"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["error_name"], "no-segment");
    use naam_ebpf::abi::error_code::{name, Describe, NAMED};
    for (code, n) in NAMED {
        assert_eq!(name(code), Some(n));
    }
    assert_eq!(Describe(12).to_string(), "unassigned(12)");
}

#[test]
fn run_reports_continue_with_descriptors_and_segments() {
    let dir = tempfile::tempdir().unwrap();
    let seg = dir.path().join("seg.bin");
    std::fs::write(&seg, common::words(&[24, 1000])).unwrap();
    let (code, out, _) = naam(&[
        "run",
        &obj(),
        "--handler",
        "two_step",
        "--args-hex",
        "cdab000000000000",
        "--segment",
        seg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "continue");
    assert_eq!(v["return_code"], 1);
    assert_eq!(v["next"][0]["rkey"], 0xabcd);
    assert_eq!(v["next"][0]["offset"], 24);
    assert_eq!(v["state"][0], 1000);
}

#[test]
fn run_errors_are_clear() {
    // A panic: clean abort, exit 1.
    let (code, out, _) = naam(&[
        "run",
        &obj(),
        "--handler",
        "panics",
        "--args-hex",
        "0700000000000000",
    ]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "aborted");
    assert!(v["error"].as_str().unwrap().contains("panic"));
    // Zero invocations to time: a usage error, not a silent run.
    let (code, _, err) = naam(&["run", &obj(), "--handler", "add", "--repeat", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid value '0'"), "{err}");
    // Out-of-bounds read: fault, exit 1.
    let dir = tempfile::tempdir().unwrap();
    let seg = dir.path().join("seg.bin");
    std::fs::write(&seg, [0u8; 8]).unwrap();
    let (code, out, _) = naam(&[
        "run",
        &obj(),
        "--handler",
        "oob_read",
        // 2^40 bytes past the segment's end: no grant lies there, whatever the heap's layout
        // (4 KiB past it once landed inside the context, which the step may read).
        "--args-hex",
        "0000000000010000",
        "--segment",
        seg.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("\"status\":\"fault\"") && out.contains("is outside every grant"),
        "{out}"
    );
    // Unknown handler: exit 2, naming the ones present.
    let (code, _, err) = naam(&["run", &obj(), "--handler", "nope"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("no handler named `nope`") && err.contains("checksum"),
        "{err}"
    );
    // Not an object file.
    let junk = dir.path().join("junk.o");
    std::fs::write(&junk, b"junk").unwrap();
    let (code, _, err) = naam(&["verify", junk.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("malformed ELF"), "{err}");
    // Bad hex.
    let (code, _, err) = naam(&["run", &obj(), "--handler", "add", "--args-hex", "zz"]);
    assert_eq!(code, 2);
    assert!(err.contains("--args-hex"), "{err}");
}

#[test]
fn build_writes_an_object_and_explains_a_missing_linker() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("ex.o");
    let target = common::handler_target_dir();
    let crate_dir = repo().join("examples/handlers");
    let (code, out, err) = naam(&[
        "build",
        crate_dir.to_str().unwrap(),
        "-o",
        out_path.to_str().unwrap(),
        "--target-dir",
        target.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("wrote ") && out.contains("checksum"),
        "{out}"
    );
    assert!(naam_vm::load(&std::fs::read(&out_path).unwrap()).is_ok());

    let out = Command::new(env!("CARGO_BIN_EXE_naam"))
        .args(["build", crate_dir.to_str().unwrap()])
        .env(naam_pipeline::BPF_LINKER_ENV, "/nonexistent/bpf-linker")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bpf-linker not found") && err.contains("scripts/setup.sh"),
        "{err}"
    );
}

/// The user's guide's first steps from an empty directory: `naam new` writes a crate that
/// needs no source tree, which builds, verifies and runs; a directory that exists is refused.
#[test]
fn a_new_crate_builds_verifies_and_runs_from_an_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    let crate_dir = dir.path().join("my-handlers");
    let c = crate_dir.to_str().unwrap();
    let (code, out, err) = naam(&["new", c]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("naam build"), "{out}");
    let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
    assert!(manifest.contains("[workspace]") && manifest.contains("path = \"naam-ebpf\""));
    let (code, _, err) = naam(&["new", c]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("exists already"), "{err}");
    let object = dir.path().join("my.o");
    let o = object.to_str().unwrap();
    let (code, out, err) = naam(&["build", c, "-o", o]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("sum_first"), "{out}");
    let (code, out, _) = naam(&["verify", o]);
    assert_eq!(code, 0);
    assert!(out.contains("sum_first") && out.contains("\tok\t"), "{out}");
    let data = dir.path().join("data.bin");
    std::fs::write(&data, [1u64.to_le_bytes(), 2u64.to_le_bytes()].concat()).unwrap();
    let (code, out, err) = naam(&[
        "run",
        o,
        "--handler",
        "sum_first",
        "--args-hex",
        "0200000000000000",
        "--segment",
        data.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["reply_hex"], "0300000000000000", "{v}");
}

#[test]
fn c_handlers_from_clang_load_and_run() {
    use naam_ebpf::abi::Context;
    use std::mem::offset_of;
    // The offsets hard-coded in the C file.
    assert_eq!(offset_of!(Context, args_len), 24);
    assert_eq!(offset_of!(Context, reply_len), 2208);
    assert_eq!(offset_of!(Context, args), 160);
    assert_eq!(offset_of!(Context, reply), 3120);
    let clang = ["clang-22", "clang"]
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok());
    let Some(clang) = clang else {
        eprintln!("SKIPPED c_handlers_from_clang_load_and_run: no clang (scripts/setup.sh installs clang-22)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("c.o");
    let src = repo().join("naam-runtime/tests/fixtures/c_handler.c");
    let st = Command::new(clang)
        .args(["-O2", "-target", "bpf", "-c"])
        .arg(&src)
        .arg("-o")
        .arg(&out_path)
        .status()
        .unwrap();
    assert!(st.success());
    let (code, out, _) = naam(&["verify", out_path.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("triple_plus_one\t"));
    for engine in ["interp", "jit"] {
        let (code, out, _) = naam(&[
            "run",
            out_path.to_str().unwrap(),
            "--handler",
            "triple_plus_one",
            "--args-hex",
            "0500000000000000",
            "--engine",
            engine,
        ]);
        assert_eq!(code, 0);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["reply_hex"], "1000000000000000");
        assert_eq!(v["trace"][0], 5);
    }
}

/// Hostile handlers through `naam run`, on both engines: a clean fault (or a rejection) and exit
/// code 1, never a signal.
#[test]
fn hostile_handlers_fault_cleanly_with_exit_code_1() {
    let dir = tempfile::tempdir().unwrap();
    let seg = dir.path().join("seg.bin");
    std::fs::write(&seg, [0u8; 64]).unwrap();
    let seg = seg.to_str().unwrap();
    // An address of this test process's own memory: somewhere a real process keeps data.
    let here = &seg as *const _ as u64;
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "wild_write",
            hex::encode(common::words(&[here, 0x41])),
            "store of 8 bytes",
        ),
        (
            "wild_write",
            hex::encode(common::words(&[0, 0x41])),
            "store of 8 bytes at 0x0",
        ),
        (
            "oob_read",
            hex::encode(common::words(&[1 << 40])),
            "load of 8 bytes",
        ),
        ("spin", String::new(), "budget exhausted"),
        (
            "recurse",
            hex::encode(common::words(&[100_000])),
            "calls nested deeper",
        ),
    ];
    for engine in ["interp", "jit"] {
        for (handler, args, want) in &cases {
            let (code, out, _) = naam(&[
                "run",
                &obj(),
                "--handler",
                handler,
                "--args-hex",
                args,
                "--segment",
                seg,
                "--engine",
                engine,
            ]);
            assert_eq!(code, 1, "{handler} on {engine}: {out}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["status"], "fault", "{handler} on {engine}: {out}");
            assert!(
                v["error"].as_str().unwrap().contains(want),
                "{handler} on {engine}: {out}"
            );
        }
        // A small budget stops a long loop the default budget lets finish.
        let (code, out, _) = naam(&[
            "run",
            &obj(),
            "--handler",
            "sum_words",
            "--segment",
            seg,
            "--engine",
            engine,
            "--budget",
            "20",
        ]);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("budget exhausted"), "{out}");
        // A program over the instruction cap is rejected before any engine sees it.
        let big = dir.path().join("big.o");
        std::fs::write(&big, oversized_object()).unwrap();
        let (code, out, _) = naam(&[
            "run",
            big.to_str().unwrap(),
            "--handler",
            "big",
            "--engine",
            engine,
        ]);
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains("\"status\":\"rejected\"") && out.contains("exceed the cap"),
            "{out}"
        );
    }
}

/// An object whose one handler, `big`, is 20,000 instructions long (over the 16 Ki cap).
fn oversized_object() -> Vec<u8> {
    let mut code = Vec::new();
    for _ in 0..20_000 {
        code.extend_from_slice(&[0x07, 0, 0, 0, 1, 0, 0, 0]); // r0 += 1
    }
    code.extend_from_slice(&[0x95, 0, 0, 0, 0, 0, 0, 0]); // exit
    common::elf_object(&[("naam/big", &code)])
}

/// A write handler run as a read one: the refusal says what to declare, as text (never hex
/// in `reply_hex`); with `--write` it runs. A right the region lacks is named as `r`/`rw`.
#[test]
fn a_write_handler_needs_declaring_and_errors_read_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.bin");
    std::fs::write(&data, [0u8; 32]).unwrap();
    let region = format!("data={},access=rwa", data.display());
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            &*obj(),
            "--handler",
            "store",
            "--args-hex",
            "0700000000000000",
            "--region",
            &region,
            "--desc",
            "data:0:32:rw",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        naam(&refs)
    };
    let (code, out, err) = run(&[]);
    assert_eq!(code, 1, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "refused", "{v}");
    let message = v["message"].as_str().unwrap();
    assert!(
        message.contains("write = true") && message.contains("--write"),
        "{message}"
    );
    assert!(v.get("reply_hex").is_none(), "runtime errors are text: {v}");
    let (code, out, err) = run(&["--write"]);
    assert_eq!(code, 0, "{err}{out}");
    // Writing through a read-only descriptor: the rights are named.
    let region_r = format!("data={},access=r", data.display());
    let (_, out, _) = naam(&[
        "run",
        &obj(),
        "--handler",
        "store",
        "--args-hex",
        "0700000000000000",
        "--region",
        &region_r,
        "--desc",
        "data:0:32:rw",
        "--write",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "access-denied", "{v}");
    assert_eq!(
        v["message"], "descriptor asks for access rw, region grants r",
        "{v}"
    );
}
