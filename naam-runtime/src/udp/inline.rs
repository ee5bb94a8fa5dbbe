//! An endpoint bound as a [`Service`] of a [`MemoryNet`]: the one place that says how an
//! inline endpoint is driven. naam-server's and naam-nic's endpoints use it
//! ([`super::serve_host_inline`], [`super::serve_nic_inline`]).
//!
//! A datagram is handled under the endpoint's lock, in the sending thread. What the endpoint
//! asks to send goes out after the lock is released: a datagram to another service must not be
//! delivered while this one is held (the server forwards to the NIC, the NIC reports to the
//! server). The port's timer thread fires `handle_timeout` and publishes the endpoint's
//! counters for `--metrics`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use naam_proto::endpoint::Transmit;
use naam_proto::Nanos;

use super::memnet::{MemoryNet, ServedPort, Service};
use super::socket::{Inbound, Sender, DEFAULT_DATAGRAM};
use super::telemetry::Telemetry;
use crate::{Clock, SystemClock};

/// What an inline service needs of the endpoint it drives.
pub(crate) trait InlineEndpoint: Send + 'static {
    fn handle(&mut self, now: Nanos, from: SocketAddr, msg: Bytes);
    fn handle_timeout(&mut self, now: Nanos);
    fn poll_timeout(&self) -> Option<Nanos>;
    fn poll_transmit(&mut self) -> Option<Transmit>;
    /// Takes what the endpoint reports besides datagrams (to log it).
    fn report_events(&mut self) {}
    /// The endpoint's counters as `(name, help, value)`.
    fn counters(&self) -> Vec<(&'static str, &'static str, u64)>;
    /// Refuses new work from now on.
    fn start_drain(&mut self);
    /// Whether every request the executors took has been answered.
    fn idle(&self) -> bool;
}

/// An endpoint bound inline (see the module documentation).
pub(crate) struct Inline<E> {
    state: Mutex<State<E>>,
    clock: SystemClock,
    sender: Sender,
    telemetry: Arc<Telemetry>,
    publish_every: Nanos,
}

/// What is held under the lock: the endpoint, its receive step (fragments, reassembly) and
/// when its counters are next published.
struct State<E> {
    endpoint: E,
    inbound: Inbound,
    next_publish: Nanos,
}

impl<E: InlineEndpoint> Inline<E> {
    /// Binds the endpoint `make` builds at `addr` in `net` (port 0: a free one). `make` gets
    /// the address bound, a sender from it for the executors' replies, and the clock's now.
    pub(crate) fn bind(
        net: &MemoryNet,
        addr: SocketAddr,
        telemetry: Arc<Telemetry>,
        publish_every: Duration,
        make: impl FnOnce(SocketAddr, Sender, Nanos) -> std::io::Result<E>,
    ) -> std::io::Result<(ServedPort, Arc<Inline<E>>)> {
        let clock = SystemClock::new();
        net.serve(addr, |local| {
            let replies = Sender::memory(net, local, DEFAULT_DATAGRAM);
            let endpoint = make(local, replies, clock.now())?;
            Ok(Arc::new(Inline {
                state: Mutex::new(State {
                    endpoint,
                    inbound: Inbound::new(),
                    next_publish: 0,
                }),
                clock,
                sender: Sender::memory(net, local, DEFAULT_DATAGRAM),
                telemetry,
                publish_every: publish_every.as_nanos() as Nanos,
            }))
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<E>> {
        // The endpoint's state is consistent between calls; a panic inside one (a bug) must
        // not take every later peer down with it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads the endpoint.
    pub(crate) fn read<T>(&self, f: impl FnOnce(&E) -> T) -> T {
        f(&self.lock().endpoint)
    }

    /// Runs `f` on what the lock holds, then sends what the endpoint asked for with the lock
    /// released.
    fn with<T>(&self, f: impl FnOnce(&mut State<E>) -> T) -> T {
        // The first transmit apart: a lone answer, the usual case, allocates no vector.
        let (t, first, rest): (T, Option<Transmit>, Vec<Transmit>) = {
            let mut s = self.lock();
            let t = f(&mut s);
            s.endpoint.report_events();
            let first = s.endpoint.poll_transmit();
            let rest = match first {
                Some(_) => std::iter::from_fn(|| s.endpoint.poll_transmit()).collect(),
                None => Vec::new(),
            };
            (t, first, rest)
        };
        for t in first.into_iter().chain(rest) {
            let _ = self.sender.send_transmit(t);
        }
        t
    }

    /// Refuses new work, then waits, at most `drain`, until every queued request has been
    /// answered.
    pub(crate) fn drain(&self, drain: Duration) {
        self.with(|s| s.endpoint.start_drain());
        let deadline = Instant::now() + drain;
        while !self.read(E::idle) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl<E: InlineEndpoint> Service for Inline<E> {
    fn deliver(&self, from: SocketAddr, datagram: Bytes) {
        let now = self.clock.now();
        self.with(|s| {
            if let Some(msg) = s.inbound.take(from, datagram) {
                s.endpoint.handle(now, from, msg);
            }
        });
    }

    fn tick(&self) -> Option<Duration> {
        let now = self.clock.now();
        let next = self.with(|s| {
            s.endpoint.handle_timeout(now);
            s.inbound.expire();
            if now >= s.next_publish {
                s.next_publish = now + self.publish_every;
                self.telemetry.publish_counters(s.endpoint.counters());
            }
            s.endpoint.poll_timeout()
        });
        next.map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::udp::Socket;
    use naam_proto::frame::fragment;

    /// Records every message it is handed and echoes it to its sender.
    #[derive(Default)]
    struct Echo {
        got: Vec<(SocketAddr, Bytes)>,
        out: VecDeque<Transmit>,
    }

    impl InlineEndpoint for Echo {
        fn handle(&mut self, _now: Nanos, from: SocketAddr, msg: Bytes) {
            self.got.push((from, msg.clone()));
            self.out.push_back(Transmit {
                to: from,
                id: 1,
                bytes: msg,
                route: None,
                datagram: None,
            });
        }
        fn handle_timeout(&mut self, _now: Nanos) {}
        fn poll_timeout(&self) -> Option<Nanos> {
            None
        }
        fn poll_transmit(&mut self) -> Option<Transmit> {
            self.out.pop_front()
        }
        fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
            Vec::new()
        }
        fn start_drain(&mut self) {}
        fn idle(&self) -> bool {
            true
        }
    }

    #[test]
    fn hostile_datagrams_never_reach_the_endpoint_and_the_service_keeps_serving() {
        let net = MemoryNet::new();
        let at: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let (port, svc) = Inline::bind(
            &net,
            at,
            Arc::default(),
            Duration::from_secs(1),
            |_, _, _| Ok(Echo::default()),
        )
        .unwrap();
        let mut client =
            Socket::bind_memory(&net, "10.0.0.2:0".parse().unwrap(), DEFAULT_DATAGRAM).unwrap();
        let me = client.local_addr().unwrap();
        let first_of_two = fragment(9, &[7u8; 3000], DEFAULT_DATAGRAM).unwrap()[0].clone();
        let real = fragment(3, b"hi", DEFAULT_DATAGRAM).unwrap()[0].clone();
        for garbage in [
            Bytes::from_static(b"not a NAAM datagram"),
            Bytes::new(),
            real.slice(..10), // a truncated fragment header
            first_of_two,     // half a message: never completes
            Bytes::from(vec![0xff; 9000]),
        ] {
            assert!(net.send(me, port.addr(), garbage), "the port takes it");
        }
        assert!(
            svc.read(|e| e.got.is_empty()),
            "garbage reached the endpoint"
        );
        // The service still serves: a whole message is handled and answered.
        client.send(port.addr(), 5, b"hello").unwrap();
        assert_eq!(
            svc.read(|e| e.got.clone()),
            vec![(me, Bytes::from_static(b"hello"))]
        );
        let back = client.recv(Duration::from_secs(1)).unwrap();
        assert_eq!(back, vec![(port.addr(), Bytes::from_static(b"hello"))]);
    }
}
