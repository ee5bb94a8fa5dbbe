//! # naam-runtime
//!
//! The NAAM runtime: the handler build pipeline, the wire codec, regions, the step machine,
//! steering, the in-process, UDP and verbs fabrics, and the `naam` CLI.
//!
//! The protocol core (wire formats, message kinds, framing, endpoints, the step machine,
//! steering) is the IO-free `naam-proto` crate, re-exported as [`proto`]. The engine (loader,
//! verifier, analysis, interpreter, JIT, helpers) is the `naam-vm` crate, re-exported as
//! [`vm`]. Users need one dependency; each item has one path.
#![deny(missing_docs)]

pub mod addr;
mod append_map;
mod clock;
pub mod cluster;
pub mod code_cache;
pub mod entropy;
pub mod executor;
pub mod experiment;
mod fair;
pub mod journal;
use naam_proto::intmap;
pub mod invoke;
pub mod logging;
mod metrics;
pub mod onesided;
pub mod pipeline;
mod region;
mod registry;
mod session;
mod transport;
pub mod udp;
#[cfg(feature = "verbs")]
pub mod verbs;

pub use clock::{Clock, SystemClock, VirtualClock};
pub use metrics::{
    HandlerSlot, Metrics, MetricsShard, Percentiles, Snapshot, TransportCounts, WeightSample,
    MAX_LATENCY_NS,
};
pub use region::{
    Region, RegionMemory, RegionTable, RegisterError, Resolved, ShmError, ALL_RIGHTS, READ_ONLY,
    READ_WRITE,
};
pub use registry::{
    AppEntry, BuiltHandlers, HandlerEntry, HandlerSpec, LookupError, Registry, RegistryError,
};
pub use session::CredentialFile;
pub use transport::{backoff, Direct, Pinned};

/// The protocol core this runtime drives: wire formats, endpoints, the step machine, steering.
pub use naam_proto as proto;
/// The engine this runtime runs handlers on: loader, verifier, interpreter, JIT, helpers.
pub use naam_vm as vm;
