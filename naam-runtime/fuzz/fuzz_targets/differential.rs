//! Differential fuzzing of the two engines: the input's bytes choose a random verifiable
//! program (all ALU32/ALU64 operations, ISA v4, loops, calls and recursion, loads, stores and
//! atomics in and out of bounds, helpers; see `naam_vm_testing::gen`), which must produce the same r0
//! or fault, instruction count, memory, stack and trace on the interpreter and on the JIT.
//! `cargo +nightly fuzz run differential -- -runs=10000000` (bench/RESULTS.md has the record).
#![no_main]
use libfuzzer_sys::fuzz_target;
use naam_vm_testing::gen::{self, Choices, GenConfig};

fuzz_target!(|data: &[u8]| {
    let g = gen::generate(&mut Choices::new(data), &GenConfig::default());
    match gen::check(&g) {
        Ok(Some(_)) => {}
        Ok(None) => panic!("the generator made an unverifiable program"),
        Err(divergence) => panic!(
            "{divergence}\nprogram: {:?}",
            naam_vm::insn::decode_all(&g.program.code)
        ),
    }
});
