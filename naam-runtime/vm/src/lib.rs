//! # naam-vm
//!
//! NAAM's eBPF engine, apart from any fabric, cluster or CLI (as aya-obj stands apart from
//! aya):
//! - [`opcode`], [`insn`]: the ISA of RFC 9669 (v4 included) and its one decoder;
//! - [`loader`]: eBPF ELF objects to linked handler programs;
//! - [`verifier`]: structural rules every program must pass;
//! - [`analysis`]: the pointer analysis that proves accesses safe or hints their grant;
//! - [`memory`]: the grant table and machine state both engines and the helpers share;
//! - [`interp`]: the reference interpreter; [`jit`]: the memory-checked Cranelift JIT for
//!   x86-64 and aarch64; [`semantics`]: the arithmetic both follow;
//! - [`helpers`]: the helpers handlers call;
//! - [`engine`]: executables and the per-thread [`Vm`];
//! - [`cross`]: aarch64 code run under qemu-user; [`conformance`]: the conformance suite's
//!   plugin convention; [`gen`]: random programs and the differential check.
//!
//! Everything is IO-free apart from mapping executable memory for JIT code and [`cross`],
//! which starts qemu.
#![deny(missing_docs)]

pub mod analysis;
pub mod conformance;
pub mod cross;
pub mod engine;
pub mod gen;
pub mod helpers;
pub mod insn;
pub mod interp;
pub mod jit;
pub mod loader;
pub mod memory;
pub mod opcode;
pub mod semantics;
pub mod verifier;

pub use engine::{
    EngineError, EngineKind, Entry, ExecOptions, Executable, Grant, Invocation, RawOutput,
    StepError, StepOutput, Vm, VmError, DEFAULT_BUDGET, MAX_BUDGET,
};
pub use helpers::HelperSet;
pub use jit::Target;
pub use loader::{load, LoadError, LoadedObject, Program};
pub use verifier::{verify, Rule, Verdict, VerifierConfig, Violation};
