//! Endpoints: the protocol's state machines, in quinn-proto's manner. An endpoint never
//! touches a socket or a clock. Its driver hands it what arrived
//! (`handle(now, from, datagram)`), sends what it asks for ([`Transmit`]s from
//! `poll_transmit()`), and wakes it when its earliest timer is due (`poll_timeout()`, then
//! `handle_timeout(now)`). The same endpoint therefore runs under the UDP drivers, and under
//! the virtual-time network of the tests, where loss, duplication, reordering and delay are
//! parameters and no test sleeps.
//!
//! - [`ClientEndpoint`]: a client's session with `naam-server` (the handshake, renewal after
//!   a server restart, liveness), its request ids, and retransmission of every exchange
//!   (requests, one-sided operations, control queries).
//! - [`ServerEndpoint`]: the server's gatekeeper, its control plane and the user-space
//!   switch, over a [`HostBackend`] that owns the executors; one per receive loop of a
//!   server, its loops sharing a [`SessionDirectory`] (the paired NIC, every loop's tenant
//!   sessions).
//! - [`NicEndpoint`]: `naam-nic`'s pairing with the server, the client sessions it is told
//!   about, one-sided operations, and requests for the NIC executors ([`NicBackend`]).

mod client;
mod directory;
mod nic;
mod server;

pub use client::{ClientConfig, ClientEndpoint, ClientEvent, ConnectError, ExchangeError};
pub use directory::SessionDirectory;
pub use nic::{NicBackend, NicConfig, NicEndpoint, NicEvent, NicStats};
pub use server::{
    error_reply, error_reply_for, malformed, plausible_load, Channel, HostBackend, Routed,
    ServerConfig, ServerEndpoint, ServerStats, SwitchHandle, VerbsAcceptor,
};

use std::net::SocketAddr;

use bytes::Bytes;

/// A datagram an endpoint wants sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// Destination: the server, the NIC's one-sided agent, a session's client, or a peer in the
    /// middle of a handshake.
    pub to: SocketAddr,
    /// The id of the message inside, so that a driver which fragments can name the fragments
    /// (0 when none applies).
    pub id: u64,
    /// The whole message (sealed, unless it is part of a handshake).
    pub bytes: Bytes,
    /// The route its fragments carry when it is not the one its bytes name
    /// ([`crate::shard::route_of`]): the server's messages to the NIC about one client session
    /// (forwards of its requests, its announcement) are sealed in the pairing session but carry
    /// that client session's route, so that the NIC's receive loop which serves the session's
    /// own datagrams takes them too, in order, and the forwards of many sessions spread over
    /// the NIC's loops instead of all reaching the pairing session's. `None` for the rest.
    pub route: Option<u8>,
    /// The one datagram that carries the whole message, when the endpoint wrote it so: a
    /// fragment header, then `bytes` (which is a slice of it). Endpoints frame what they seal
    /// when it fits their datagram, so that a driver sends it without a copy; a driver takes
    /// it through [`Transmit::framed`], which checks that it still matches.
    pub datagram: Option<Bytes>,
}

impl Transmit {
    /// The route its fragments carry: [`Transmit::route`] when set, else its bytes' own.
    pub fn frame_route(&self) -> u8 {
        self.route
            .unwrap_or_else(|| crate::shard::route_of(&self.bytes))
    }

    /// [`Transmit::datagram`], when it is at most `limit` bytes and frames this transmit as
    /// it is (its id, route and bytes: a caller may have changed them after the endpoint made
    /// it); `None` tells the driver to fragment [`Transmit::bytes`] itself.
    pub fn framed(&self, limit: usize) -> Option<&Bytes> {
        let d = self.datagram.as_ref()?;
        let carries_bytes = d.len() <= limit
            && d.get(crate::frame::HEADER..)
                .is_some_and(|m| m.as_ptr() == self.bytes.as_ptr() && m.len() == self.bytes.len());
        let names_it = || crate::frame::lone_frame(d) == Some((self.id, self.frame_route()));
        (carries_bytes && names_it()).then_some(d)
    }
}
