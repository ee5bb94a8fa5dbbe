//! # naam-runtime
//!
//! The NAAM runtime: the handler build pipeline, the wire codec, regions, the step machine,
//! steering, the in-process, UDP and verbs fabrics, and the `naam` CLI.
//!
//! The protocol core (wire formats, message kinds, framing, steering) is the IO-free
//! `naam-proto` crate; its modules are re-exported here ([`wire`], [`frame`], [`steering`],
//! [`placement`]). The engine (loader, verifier, analysis, interpreter, JIT, helpers) is the
//! `naam-vm` crate;
//! its modules are re-exported here under their old paths ([`engine`], [`loader`],
//! [`verifier`], [`interp`], [`jit`], [`helpers`], [`insn`]) so users need one dependency.
#![deny(missing_docs)]

pub mod clock;
pub mod cluster;
pub mod executor;
pub mod experiment;
mod fair;
mod intmap;
pub mod invoke;
pub mod logging;
pub mod metrics;
pub mod onesided;
pub mod pipeline;
pub mod region;
pub mod registry;
pub mod session;
pub mod sim;
pub mod transport;
pub mod udp;
#[cfg(feature = "verbs")]
pub mod verbs;

pub use naam_proto::{frame, placement, steering, wire, Placement};
pub use naam_vm::{
    analysis, conformance, cross, engine, helpers, insn, interp, jit, loader, memory, verifier,
};
pub use naam_vm::{load, LoadError, LoadedObject, Program};
pub use naam_vm::{verify, Rule, VerifierConfig, Violation};
pub use naam_vm::{
    EngineKind, ExecOptions, Executable, Grant, Invocation, StepError, StepOutput, Vm, VmError,
};
