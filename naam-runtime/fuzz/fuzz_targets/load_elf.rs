//! Arbitrary bytes as an object file: the loader and verifier must return errors, never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use naam_vm::{load, verify, VerifierConfig};

fuzz_target!(|data: &[u8]| {
    if let Ok(obj) = load(data) {
        for p in &obj.programs {
            let _ = verify(p, &VerifierConfig::default());
        }
    }
});
