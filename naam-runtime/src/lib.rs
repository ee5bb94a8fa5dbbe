//! # naam-runtime
//!
//! The NAAM runtime. This crate owns the handler toolchain and execution core:
//! - [`pipeline`]: `naam build`, Rust handler crate → eBPF object (host staticlib with
//!   linker-plugin LTO, then bpf-linker);
//! - [`loader`]: ELF parsing and linking of `naam/<name>` handlers;
//! - [`verifier`]: the structural verifier gate;
//! - [`interp`], [`engine`]: the checked interpreter, rbpf's JIT, and per-thread [`engine::Vm`]s;
//! - [`helpers`]: helper functions and the memory map they check against.
//!
//! Everything except [`pipeline`] is IO-free: bytes in, decisions out.
#![deny(missing_docs)]

pub mod clock;
pub mod cluster;
pub mod datagram;
pub mod engine;
pub mod executor;
pub mod experiment;
pub mod helpers;
pub mod insn;
pub mod interp;
pub mod intmap;
pub mod loader;
pub mod metrics;
pub mod onesided;
pub mod pipeline;
pub mod placement;
pub mod region;
pub mod registry;
pub mod sim;
pub mod steering;
pub mod transport;
pub mod udp;
#[cfg(feature = "verbs")]
pub mod verbs;
pub mod verifier;
pub mod wire;

pub use engine::{EngineKind, Executable, Grant, Invocation, StepError, StepOutput, Trust, Vm};
pub use loader::{load, LoadError, LoadedObject, Program};
pub use placement::Placement;
pub use verifier::{verify, Rule, VerifierConfig, Violation};
