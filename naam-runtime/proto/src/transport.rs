//! What application client libraries send messages through: the [`Transport`] trait (any
//! fabric that carries a request and returns its reply) and [`ClientError`]. A library written
//! against these alone (MICA's and the B-tree's clients, with their `host` feature off) works
//! over every fabric: the in-process cluster, the UDP client, direct execution, or a
//! simulator, each of which also decides how a retry waits ([`Transport::backoff`]).

use std::time::Duration;

use naam_ebpf::abi::Descriptor;

use crate::wire::{Reply, WireError};
use crate::Placement;

/// Why a client call produced no reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The placement's queue is full: back-pressure, try again later.
    #[error("the {0} queue is full (back-pressure); retry later")]
    Busy(Placement),
    /// No reply within the timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The cluster is shutting down.
    #[error("the cluster is shut down")]
    Shutdown,
    /// The request does not fit the wire format.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The server has answered nothing for longer than the client's liveness bound.
    #[error("the server has not answered for {silent:?} (over the liveness bound of {bound:?}): it is down or unreachable")]
    ServerGone {
        /// How long it has been silent.
        silent: Duration,
        /// The client's liveness bound, which `silent` is over.
        bound: Duration,
    },
    /// The session could not be set up again (after the server restarted or forgot it).
    #[error("setting up a session again: {0}")]
    Session(String),
}

/// Sends one active message and returns its reply.
pub trait Transport {
    /// Sends `handler` of `app` with `args` and `descs`, placed by the fabric's steering.
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError>;

    /// Waits before retry number `attempt` of a message the fabric answered `Busy` or
    /// `Conflict` (another writer won a race, a queue was full). How is the fabric's choice:
    /// threads yield and sleep, a simulator advances its virtual clock.
    fn backoff(&mut self, attempt: u32);
}

impl<T: Transport + ?Sized> Transport for &mut T {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        (**self).call(app, handler, args, descs)
    }

    fn backoff(&mut self, attempt: u32) {
        (**self).backoff(attempt)
    }
}
