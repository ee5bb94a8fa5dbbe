//! The `udp` fabric: NAAM between processes over real datagrams (loopback, or veth pairs
//! between network namespaces). One-sided RDMA is emulated by an agent in the NIC process;
//! everything reported over this fabric is labelled `udp`.
//!
//! - [`socket`]: the thin IO layer (`sendmmsg` / `recvmmsg`, fragmentation and reassembly);
//! - [`control`]: manifest, hello, weights, NIC load reports, forwarded requests (IO-free);
//! - [`server`]: `naam-server`'s driver, the host executors behind the user-space switch;
//! - [`nic`]: `naam-nic`'s driver, the NIC executors and the one-sided agent;
//! - [`client`]: [`client::UdpClient`], a [`crate::transport::Transport`];
//! - [`signal`]: SIGTERM/SIGINT as a stop flag, for draining.

pub mod client;
pub mod control;
pub mod deploy;
pub mod nic;
pub mod server;
pub mod signal;
pub mod socket;

/// Mode label of everything measured over this fabric.
pub const MODE: &str =
    "udp (separate processes over UDP; NIC cores, DMA and one-sided RDMA emulated)";
