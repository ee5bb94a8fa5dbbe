//! # naam-vm
//!
//! NAAM's eBPF engine, apart from any fabric, cluster or CLI (as aya-obj stands apart from
//! aya):
//! - [`opcode`], [`insn`]: the ISA of RFC 9669 (v4 included) and its one decoder;
//! - the loader ([`load`]): eBPF ELF objects to linked handler [`Program`]s;
//! - the verifier ([`verify`]): structural rules every program must pass;
//! - [`analysis`]: the pointer analysis that proves accesses safe or hints their grant;
//! - [`memory`]: the grant table and machine state both engines and the helpers share;
//! - [`interp`]: the reference interpreter; [`jit`]: the memory-checked Cranelift JIT for
//!   x86-64 and aarch64; [`semantics`]: the arithmetic both follow;
//! - the helpers handlers call ([`HelperSet`]);
//! - the engine: [`Executable`]s and the per-thread [`Vm`], on the interpreter, the JIT or
//!   both in tiers; the [`CodeCache`] of compiled code;
//! - [`cross`]: aarch64 code run under qemu-user; [`conformance`]: the conformance suite's
//!   plugin convention. Random programs and the differential check are test tooling, in
//!   the naam-vm-testing crate.
//!
//! A module is public when its name is part of what its items mean (`jit::Target`,
//! `interp::run`); the engine, loader, verifier and helpers live at the crate root.
//!
//! Everything is IO-free apart from mapping executable memory for JIT code, the tiered
//! engine's one compiler thread and [`cross`],
//! which starts qemu.
#![deny(missing_docs)]

pub mod analysis;
#[cfg(feature = "testing")]
pub mod conformance;
#[cfg(feature = "testing")]
pub mod cross;
mod engine;
mod helpers;
pub mod insn;
pub mod interp;
pub mod jit;
mod loader;
pub mod memory;
pub mod opcode;
pub mod semantics;
mod verifier;

pub use engine::{
    code_key, lowest_priority, open_entry, seal_entry, time_runs, CacheStats, CodeCache, CodeKey,
    CodeStore, EngineError, Entry, ExecOptions, Executable, HandlerEngine, NextStep, RawOutput,
    StepError, StepOutput, Vm, VmError, CODEGEN_VERSION, DEFAULT_BUDGET, MAX_BUDGET,
    MAX_ENTRY_CODE,
};
#[cfg(feature = "testing")]
pub use engine::{Fixup, Image, ImageRegion};
pub use helpers::{Helper, HelperSet, HelperWrites};
pub use loader::{load, LoadError, LoadedObject, Program, Rodata, RodataRef};
pub use verifier::{
    check, verify, Checked, Rule, Verdict, VerifierConfig, Violation, DEFAULT_MAX_INSNS,
};
