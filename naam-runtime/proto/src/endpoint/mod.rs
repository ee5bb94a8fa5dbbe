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
pub use directory::{AppGrant, SessionDirectory};
pub use nic::{NicBackend, NicConfig, NicEndpoint, NicEvent, NicStats};
pub use server::{
    error_reply, error_reply_for, malformed, plausible_load, Channel, DeployChange, DeployJob,
    HostBackend, InProcess, Routed, ServerConfig, ServerEndpoint, ServerStats, SwitchHandle,
    VerbsAcceptor,
};

use std::net::SocketAddr;

use bytes::Bytes;

/// A datagram an endpoint wants sent.
///
/// It holds its message once: alone, or behind the fragment header of the one datagram that
/// carries it when the endpoint framed it so ([`Transmit::framed`]). Either way the message is
/// one view of one buffer, so a transmit costs no reference count of its own: the buffer's
/// was taken when it was written, and is given back when the driver is done with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// Destination: the server, the NIC's one-sided agent, a session's client, or a peer in the
    /// middle of a handshake.
    pub to: SocketAddr,
    /// The id of the message inside, so that a driver which fragments can name the fragments
    /// (0 when none applies).
    pub id: u64,
    /// The route its fragments carry when it is not the one its bytes name
    /// ([`crate::shard::route_of`]): the server's messages to the NIC about one client session
    /// (forwards of its requests, its announcement) are sealed in the pairing session but carry
    /// that client session's route, so that the NIC's receive loop which serves the session's
    /// own datagrams takes them too, in order, and the forwards of many sessions spread over
    /// the NIC's loops instead of all reaching the pairing session's. `None` for the rest.
    pub route: Option<u8>,
    /// The message (sealed, unless it is part of a handshake), from `start` on.
    buf: Bytes,
    /// Where the message starts in `buf`: 0, or [`crate::frame::HEADER`] when the endpoint
    /// wrote it behind room for a fragment header.
    start: usize,
    /// Whether `buf` is the one datagram that carries the whole message (its header written).
    lone: bool,
}

impl Transmit {
    /// `bytes` for `to`, unframed: the driver fragments it.
    pub fn new(to: SocketAddr, id: u64, bytes: Bytes) -> Transmit {
        Transmit {
            to,
            id,
            route: None,
            buf: bytes,
            start: 0,
            lone: false,
        }
    }

    /// A message written behind room for a fragment header: `buf` holds the header's room,
    /// then the message; `lone` when the header is written, so that `buf` is the one datagram
    /// that carries the message.
    pub(crate) fn behind_header(
        to: SocketAddr,
        id: u64,
        route: Option<u8>,
        buf: Bytes,
        lone: bool,
    ) -> Transmit {
        let start = crate::frame::HEADER.min(buf.len());
        Transmit {
            to,
            id,
            route,
            buf,
            start,
            lone,
        }
    }

    /// The whole message.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    /// The whole message, as its own `Bytes` (a reference to the buffer, counted).
    pub fn message(&self) -> Bytes {
        self.buf.slice(self.start..)
    }

    /// The whole message, moved out (no reference counted).
    pub fn into_message(self) -> Bytes {
        let mut b = self.buf;
        bytes::Buf::advance(&mut b, self.start);
        b
    }

    /// The route its fragments carry: [`Transmit::route`] when set, else its bytes' own.
    pub fn frame_route(&self) -> u8 {
        self.route
            .unwrap_or_else(|| crate::shard::route_of(self.bytes()))
    }

    /// The one datagram that carries the whole message, when the endpoint wrote it so, it is
    /// at most `limit` bytes and it frames this transmit as it is (its id and route: a caller
    /// may have changed them after the endpoint made it); `None` tells the driver to fragment
    /// [`Transmit::bytes`] itself.
    pub fn framed(&self, limit: usize) -> Option<&Bytes> {
        let names_it =
            || crate::frame::lone_frame(&self.buf) == Some((self.id, self.frame_route()));
        (self.lone && self.buf.len() <= limit && names_it()).then_some(&self.buf)
    }

    /// [`Transmit::framed`], moved out; the transmit back when it is not framed for `limit`.
    pub fn into_framed(self, limit: usize) -> Result<Bytes, Transmit> {
        match self.framed(limit).is_some() {
            true => Ok(self.buf),
            false => Err(self),
        }
    }
}
