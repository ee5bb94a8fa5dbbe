//! Generates `naam_vm.h` (the machine-state layout, from the same Rust definitions compiled
//! code uses) and cross-compiles the aarch64 harness (`harness/aarch64.c`) with
//! `aarch64-linux-gnu-gcc` when it is installed (`scripts/setup.sh` installs it). Without the
//! cross compiler, naam-vm still builds; running aarch64 code then reports why it cannot.

use std::path::PathBuf;
use std::process::Command;

#[allow(dead_code, unreachable_pub)] // the library's modules, private in this script
#[path = "src/memory.rs"]
mod memory;

#[allow(dead_code, unreachable_pub)] // the library's modules, private in this script
#[path = "src/helpers.rs"]
mod helpers;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(naam_aarch64_harness)");
    println!("cargo::rerun-if-changed=harness/aarch64.c");
    println!("cargo::rerun-if-changed=src/memory.rs");
    println!("cargo::rerun-if-changed=src/helpers.rs");
    println!("cargo::rerun-if-env-changed=NAAM_AARCH64_CC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("naam_vm.h"), memory::c_header()).expect("writing naam_vm.h");
    let cc = std::env::var("NAAM_AARCH64_CC").unwrap_or_else(|_| "aarch64-linux-gnu-gcc".into());
    let exe = out.join("naam-aarch64-harness");
    let result = Command::new(&cc)
        .args([
            "-static",
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
        ])
        .arg(&out)
        .arg("harness/aarch64.c")
        .arg("-o")
        .arg(&exe)
        .output();
    match result {
        Ok(o) if o.status.success() => {
            println!("cargo::rustc-cfg=naam_aarch64_harness");
            println!("cargo::rustc-env=NAAM_AARCH64_HARNESS={}", exe.display());
        }
        // Our own C failed to compile: that is a bug to see, not a missing tool.
        Ok(o) => panic!(
            "{cc} failed on harness/aarch64.c:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            println!("cargo::rustc-env=NAAM_AARCH64_HARNESS_MISSING={cc} could not run ({e})")
        }
    }
}
