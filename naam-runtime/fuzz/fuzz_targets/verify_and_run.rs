//! Arbitrary bytecode: whatever passes the verifier runs on both engines without touching
//! memory outside its grants, and both engines agree on the result.
#![no_main]
use libfuzzer_sys::fuzz_target;
use naam_proto::step::{Grant, Invocation};
use naam_proto::EngineKind;
use naam_vm::{ExecOptions, Vm};
use naam_vm::{Executable, Program};

fuzz_target!(|data: &[u8]| {
    let code = data[..data.len() - data.len() % 8].to_vec();
    let p = Program::from_bytecode("fuzz", code);
    let build = |engine| Executable::build(&p, &ExecOptions::new(engine, 100_000));
    let (Ok(interp), Ok(jit)) = (build(EngineKind::Interp), build(EngineKind::Jit)) else {
        return;
    };
    let seg = [0x5au8; 64];
    let inv = Invocation {
        args: &[1, 2, 3, 4],
        segments: &[Grant::read(&seg)],
        ..Invocation::default()
    };
    let mut vm = Vm::new();
    let a = vm.run(&interp, &inv).map(|o| (o.return_code, o.insns));
    let b = vm.run(&jit, &inv).map(|o| (o.return_code, o.insns));
    assert_eq!(a, b);
    assert_eq!(seg, [0x5au8; 64]);
});
