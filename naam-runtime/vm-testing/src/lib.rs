//! Test tooling for NAAM's eBPF engine, kept out of the production crate: the generator of
//! random verifiable programs and the differential check of the interpreter against the JIT
//! ([`gen`]), used by naam-vm's tests, the fuzz target `differential` and the code cache's
//! restart example. Nothing in a server or client build links it.

pub mod gen;
