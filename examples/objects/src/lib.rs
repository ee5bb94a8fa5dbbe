//! The example handlers (`examples/handlers`: `add`, `bsearch`, `checksum`, ...) as an eBPF
//! object, built when this crate is built. Binaries that demonstrate or measure the engines carry
//! it, so they run without the source tree or a toolchain; loading it checks it.

/// The eBPF object built from `examples/handlers`.
pub const HANDLERS_OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/examples.o"));
