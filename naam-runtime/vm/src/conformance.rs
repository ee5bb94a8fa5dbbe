//! Running one program the way the public eBPF conformance suite drives a runtime (the
//! plugin convention of `bpf_conformance`): `r1` points at the input memory, `r2` holds its
//! length, helper 5 returns its argument, and the result is `r0`. Used by `naam
//! conformance-plugin` and by the tests that run the whole suite.

use std::path::PathBuf;

use crate::engine::{ExecOptions, Executable, Vm};
use crate::jit::Target;
use crate::loader::Program;

/// Where the suite's `tests.jsonl` lives: `$NAAM_CONFORMANCE_DIR`, else `shared/conformance`
/// beside this repository (where CI finds it).
pub fn suite_dir() -> PathBuf {
    match std::env::var_os("NAAM_CONFORMANCE_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/conformance"),
    }
}

/// Runs `program` over a copy of `memory` in this process.
pub fn run_host(program: &Program, options: &ExecOptions, memory: &[u8]) -> Result<u64, String> {
    let exe = Executable::build(program, options).map_err(|e| e.to_string())?;
    let mut vm = Vm::new();
    // 8-byte aligned storage, as a caller's buffer would be (atomics need natural alignment).
    let mut words = vec![0u64; memory.len().div_ceil(8)];
    // SAFETY: the u64 buffer holds at least `memory.len()` bytes.
    let mem =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), memory.len()) };
    mem.copy_from_slice(memory);
    vm.run_raw(&exe, mem)
        .map(|o| o.r0)
        .map_err(|e| e.to_string())
}

/// Compiles `program` to aarch64 and runs it over a copy of `memory` under qemu-user.
pub fn run_aarch64(program: &Program, options: &ExecOptions, memory: &[u8]) -> Result<u64, String> {
    if options.engine != naam_proto::EngineKind::Jit {
        return Err(
            "the interpreter runs on the host only: use --engine jit with --target aarch64".into(),
        );
    }
    // The interpreter executable carries the verified program; only its aarch64 code runs.
    let host = ExecOptions {
        engine: naam_proto::EngineKind::Interp,
        ..options.clone()
    };
    let exe = Executable::build(program, &host).map_err(|e| e.to_string())?;
    let compiled = exe
        .compile_for(Target::Aarch64)
        .map_err(|e| e.to_string())?;
    let mut words = vec![0u64; memory.len().div_ceil(8)];
    // SAFETY: the u64 buffer holds at least `memory.len()` bytes.
    let mem =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), memory.len()) };
    mem.copy_from_slice(memory);
    let mut vm = Vm::new();
    let image = vm.image_raw(&exe, mem).map_err(|e| e.to_string())?;
    let out = crate::cross::run(&compiled, &image).map_err(|e| e.to_string())?;
    out.result(options.budget).map_err(|e| e.to_string())
}
