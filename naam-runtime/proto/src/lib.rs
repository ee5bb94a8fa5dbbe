//! # naam-proto
//!
//! NAAM's protocol core, free of IO: nothing here starts a thread, opens a socket, sleeps or
//! reads a clock. Time is always an argument ([`Nanos`]), so the same code runs under the
//! in-process cluster's threads, under the UDP drivers of `naam-server`, `naam-nic` and the
//! clients, and under a deterministic virtual-time simulator.
//!
//! What it owns:
//! - [`kind`]: the one table of message kinds and the wire version;
//! - [`limits`]: the size limits every codec and driver shares;
//! - [`wire`]: active-message requests and replies, statuses, load feedback;
//! - [`onesided`]: emulated one-sided RDMA operations and their completions;
//! - [`control`]: control messages (handshake, manifest, weights, pairing, load reports) and
//!   the header of requests forwarded to the NIC;
//! - [`endpoint`]: the client's and the server's state machines (sessions, retransmission,
//!   the control plane, the user-space switch), driven by datagrams and explicit time;
//! - [`entropy`]: the randomness every endpoint draws from, passed in by its driver;
//! - [`arena`]: byte strings copied into shared chunks, for what outlives its call;
//! - [`dedup`]: answers to recent mutations, so retransmissions are not applied twice;
//! - [`frame`]: datagram framing (fragments, bounded reassembly, retransmission timers);
//! - [`session`]: credentials, the handshake, sealed envelopes, replay windows, sessions;
//! - [`shard`]: sessions sharded over a server's receive loops, and the route that takes a
//!   datagram to its session's loop;
//! - [`peek`]: a message's kind and id read without decoding it (matching answers);
//! - [`Placement`]: where a message's steps run (client, NIC, host);
//! - [`steering`]: load signals and the policies that turn them into weights;
//! - [`step`]: the step machine (one message's steps at one placement) and the traits its
//!   drivers implement: the engine, the data paths, the one-sided READ transport;
//! - [`transport`]: what application client libraries call through ([`transport::Transport`]).
#![deny(missing_docs)]

pub mod arena;
pub mod batch;
pub mod control;
pub mod dedup;
pub mod endpoint;
mod engine_kind;
pub mod entropy;
mod fields;
pub mod frame;
pub mod intmap;
pub mod kind;
pub mod limits;
pub mod onesided;
pub mod peek;
mod placement;
pub mod session;
pub mod shard;
pub mod steering;
pub mod step;
pub mod transport;
pub mod wire;

pub use engine_kind::EngineKind;
pub use placement::Placement;

/// Nanoseconds since some epoch chosen by whoever drives the protocol (a monotonic clock in a
/// driver, zero in a simulation). Every time argument in this crate is one of these.
pub type Nanos = u64;

/// The stable 32-bit id of the handler named `name` (FNV-1a over its bytes): clients and
/// servers in different processes agree on it without a lookup.
pub fn handler_id(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::handler_id;

    #[test]
    fn handler_ids_are_fnv1a() {
        assert_eq!(handler_id(""), 0x811c9dc5);
        assert_eq!(handler_id("a"), 0xe40c292c);
        assert_ne!(handler_id("get"), handler_id("put"));
    }
}
