//! Arbitrary bytecode: whatever passes the verifier runs on the checked interpreter without
//! touching memory outside its grants.
#![no_main]
use libfuzzer_sys::fuzz_target;
use naam_runtime::engine::{Grant, Invocation, Vm};
use naam_runtime::{EngineKind, Executable, Program, Trust, VerifierConfig};

fuzz_target!(|data: &[u8]| {
    let code = data[..data.len() - data.len() % 8].to_vec();
    let p = Program::from_bytecode("fuzz", code);
    if let Ok(exe) = Executable::new(&p, EngineKind::Interp, Trust::Untrusted, &VerifierConfig::default()) {
        let seg = [0x5au8; 64];
        let inv = Invocation { args: &[1, 2, 3, 4], segments: &[Grant::read(&seg)], ..Invocation::default() };
        let mut vm = Vm::new();
        vm.set_budget(100_000);
        let _ = vm.run(&exe, &inv);
        assert_eq!(seg, [0x5au8; 64]);
    }
});
