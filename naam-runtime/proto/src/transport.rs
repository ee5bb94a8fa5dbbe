//! What application client libraries send messages through: the [`Transport`] trait (any
//! fabric that carries a request and returns its reply) and [`ClientError`]. A library written
//! against these alone (MICA's and the B-tree's clients, with their `host` feature off) works
//! over every fabric: the in-process cluster, the UDP client, direct execution, or a
//! simulator, each of which also decides how a retry waits ([`Transport::backoff`]).

use std::time::Duration;

use naam_ebpf::abi::Descriptor;

use crate::wire::{Reply, ReplyView, WireError};
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

    /// [`Transport::call`], with the reply handed to `read` in place rather than returned: a
    /// fabric that holds the reply in a buffer of its own (direct execution, where it stays in
    /// the machine the message ran in) lends it for the length of `read`, with no payload split
    /// off, reference counted, or copied for deduplication. The default calls
    /// [`Transport::call`] and lends its reply.
    fn call_with<R>(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
        read: impl FnOnce(ReplyView<'_>) -> R,
    ) -> Result<R, ClientError>
    where
        Self: Sized,
    {
        let reply = self.call(app, handler, args, descs)?;
        Ok(read(reply.view()))
    }

    /// Waits before retry number `attempt` of a message the fabric answered `Busy` or
    /// `Conflict` (another writer won a race, a queue was full). How is the fabric's choice:
    /// threads yield and sleep, a simulator advances its virtual clock.
    fn backoff(&mut self, attempt: u32);
}

/// `T` with its replies always returned: `T`'s own [`Transport::call`] and
/// [`Transport::backoff`], and the trait's default [`Transport::call_with`] (which lends the
/// returned reply) whatever `T` overrides. For differential tests of a fabric's `call_with`
/// against its `call`.
pub struct Returned<T>(pub T);

impl<T: Transport> Transport for Returned<T> {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.0.call(app, handler, args, descs)
    }

    fn backoff(&mut self, attempt: u32) {
        self.0.backoff(attempt)
    }
}

/// A [`Transport`] that keeps several messages in flight: [`Pipeline::submit`] sends and
/// returns at once with a token, [`Pipeline::poll`] hands back the replies that have come, in
/// whatever order they came. A fabric that runs messages where they are (in process) answers
/// each at once; one over the network keeps up to [`Pipeline::window`] outstanding.
pub trait Pipeline: Transport {
    /// Sends `handler` of `app` with `args` and `descs` without waiting; returns the token its
    /// answer will carry. [`ClientError::Busy`] when [`Pipeline::window`] are outstanding.
    fn submit(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<u64, ClientError>;

    /// The answers that have come since the last poll, each with its token: a reply, or why
    /// there is none. With `block`, waits (a while, not forever) for at least one when any is
    /// outstanding and none has come.
    fn poll(&mut self, block: bool) -> Vec<(u64, Result<Reply, ClientError>)>;

    /// Messages submitted and not yet handed back by [`Pipeline::poll`].
    fn in_flight(&self) -> usize;

    /// The most messages this transport keeps outstanding at once.
    fn window(&self) -> usize;
}

/// A [`Transport`] whose every call completes before it returns, as a [`Pipeline`]: each
/// submission runs at once and its answer waits for the next poll.
#[derive(Debug)]
pub struct Immediate<T> {
    inner: T,
    next: u64,
    done: Vec<(u64, Result<Reply, ClientError>)>,
}

impl<T: Transport> Immediate<T> {
    /// Pipelines over `inner`.
    pub fn new(inner: T) -> Self {
        Immediate {
            inner,
            next: 0,
            done: Vec::new(),
        }
    }

    /// The transport underneath.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: Transport> Transport for Immediate<T> {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.inner.call(app, handler, args, descs)
    }

    fn backoff(&mut self, attempt: u32) {
        self.inner.backoff(attempt)
    }
}

/// Runs operations `0..n` through a pipelined client `c`, as many in flight as `room` allows:
/// `start(c, i)` starts operation `i` tagged `i`, `poll(c)` hands back finished ones by tag
/// (waiting a while for one), and `done(i, answer)` takes each answer. The first error ends
/// the run (operations still in flight are left to the client). `c` has nothing else in
/// flight: an answer with another tag is not one of these and is dropped. The multi-gets of
/// the MICA and B-tree pipelines.
pub fn in_flight_together<C, D, E>(
    c: &mut C,
    n: usize,
    room: impl Fn(&C) -> bool,
    mut start: impl FnMut(&mut C, u64) -> Result<(), E>,
    mut poll: impl FnMut(&mut C) -> Vec<(u64, Result<D, E>)>,
    mut done: impl FnMut(u64, D),
) -> Result<(), E> {
    let mut next = 0;
    let mut left = n;
    while left > 0 {
        while next < n && room(c) {
            start(c, next as u64)?;
            next += 1;
        }
        for (tag, answer) in poll(c) {
            if tag >= next as u64 {
                continue;
            }
            left = left.saturating_sub(1);
            done(tag, answer?);
        }
    }
    Ok(())
}

impl<T: Transport> Pipeline for Immediate<T> {
    fn submit(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<u64, ClientError> {
        self.next += 1;
        let r = self.inner.call(app, handler, args, descs);
        self.done.push((self.next, r));
        Ok(self.next)
    }

    fn poll(&mut self, _block: bool) -> Vec<(u64, Result<Reply, ClientError>)> {
        // The next round's vector at this round's size: one allocation, not one per doubling.
        let room = self.done.len();
        std::mem::replace(&mut self.done, Vec::with_capacity(room))
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn window(&self) -> usize {
        usize::MAX
    }
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

#[cfg(test)]
mod tests {
    use super::in_flight_together;

    /// A client whose operations finish in reverse order, two per poll, within a window of
    /// three; it also hands back an answer no run started (tag 99) on its first poll.
    #[derive(Default)]
    struct Reversing {
        flying: Vec<u64>,
        polls: usize,
        most_in_flight: usize,
    }

    impl Reversing {
        fn poll(&mut self) -> Vec<(u64, Result<u64, String>)> {
            self.polls += 1;
            let mut out: Vec<_> = (0..2)
                .filter_map(|_| self.flying.pop())
                .map(|t| {
                    (
                        t,
                        if t == 7 {
                            Err(format!("op {t}"))
                        } else {
                            Ok(t * 10)
                        },
                    )
                })
                .collect();
            if self.polls == 1 {
                out.push((99, Ok(0)));
            }
            out
        }
    }

    #[test]
    fn every_operation_runs_within_the_window_and_the_first_error_ends_the_run() {
        let mut c = Reversing::default();
        let mut got = vec![None; 6];
        let r = in_flight_together(
            &mut c,
            6,
            |c| c.flying.len() < 3,
            |c, i| {
                c.flying.push(i);
                c.most_in_flight = c.most_in_flight.max(c.flying.len());
                Ok(())
            },
            |c| c.poll(),
            |i, v| got[i as usize] = Some(v),
        );
        assert_eq!(r, Ok(()));
        assert_eq!(got, (0..6).map(|i| Some(i * 10)).collect::<Vec<_>>());
        assert_eq!(c.most_in_flight, 3);

        let mut c = Reversing::default();
        let r = in_flight_together(
            &mut c,
            9,
            |c| c.flying.len() < 3,
            |c, i| {
                c.flying.push(i);
                Ok(())
            },
            |c| c.poll(),
            |_, _| {},
        );
        assert_eq!(r, Err("op 7".to_string()));
    }
}
