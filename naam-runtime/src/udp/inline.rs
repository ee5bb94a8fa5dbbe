//! An endpoint bound as a [`Service`] of a [`MemoryNet`]: the one place that says how an
//! inline endpoint is driven. naam-server's and naam-nic's endpoints use it
//! ([`super::serve_host_inline`], [`super::serve_nic_inline`]).
//!
//! A datagram is handled under the endpoint's lock, in the sending thread. What the endpoint
//! asks to send goes out after the lock is released: a datagram to another service must not be
//! delivered while this one is held (the server forwards to the NIC, the NIC reports to the
//! server). The port's timer thread fires `handle_timeout` and publishes the endpoint's
//! counters for `--metrics`.
//!
//! A driver with several receive loops binds one endpoint per loop on one address
//! ([`InlineGroup`]), as its sockets share one address in an `SO_REUSEPORT` group: each
//! datagram goes to the loop its route names, the way the group's route filter sends it
//! ([`super::bind_group`]), so client threads whose sessions belong to different loops take
//! different locks.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use naam_proto::endpoint::{InProcess, Transmit};
use naam_proto::wire::{Reply, Request};
use naam_proto::Nanos;

use super::memnet::{MemoryNet, ServedPort, Service, TimerWake};
use super::socket::{Inbound, Sender, DEFAULT_DATAGRAM};
use super::telemetry::{LoopCounters, Telemetry};

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
    /// Takes request `req` of session `sid` from a client in this process (see
    /// [`Service::request_in_process`]), a reply answered at once written into `out`; an
    /// endpoint that takes none leaves it with the caller (`None`).
    fn request_in_process(
        &mut self,
        _now: Nanos,
        _sid: u64,
        _req: &mut Request,
        _out: &mut Reply,
    ) -> Option<InProcess> {
        None
    }
}

/// An endpoint bound inline (see the module documentation).
pub(crate) struct Inline<E> {
    state: Mutex<State<E>>,
    clock: SystemClock,
    sender: Sender,
    telemetry: Arc<Telemetry>,
    /// This endpoint's slot among its group's counters, published summed.
    counters: LoopCounters,
    publish_every: Nanos,
}

/// What is held under the lock: the endpoint, its receive step (fragments, reassembly) and
/// when its counters are next published.
struct State<E> {
    endpoint: E,
    inbound: Inbound,
    next_publish: Nanos,
    /// When the timer thread wakes for this endpoint by itself, as its last tick left it
    /// (0 before the first: the thread ticks as it starts). Read and written under the lock,
    /// so a message that arms a sooner timer sees either the tick before it, and wakes the
    /// thread, or the tick after it, which sees that timer.
    timer_wakes_at: Nanos,
}

impl<E: InlineEndpoint> Inline<E> {
    /// Binds the endpoint `make` builds at `addr` in `net` (port 0: a free one). `make` gets
    /// the address bound, a sender from it for the executors' replies, and the clock's now.
    #[cfg(test)]
    pub(crate) fn bind(
        net: &MemoryNet,
        addr: SocketAddr,
        telemetry: Arc<Telemetry>,
        publish_every: Duration,
        make: impl FnOnce(SocketAddr, Sender, Nanos) -> std::io::Result<E>,
    ) -> std::io::Result<(ServedPort, Arc<Inline<E>>)> {
        let mut make = Some(make);
        let (port, group) =
            InlineGroup::bind(net, addr, 1, telemetry, publish_every, |_, a, s, n| {
                let make = make.take().ok_or_else(|| {
                    std::io::Error::other("a group of one loop makes one endpoint")
                })?;
                make(a, s, n)
            })?;
        let sole = group.members[0].clone();
        Ok((port, sole))
    }

    /// The endpoint `make` builds for `local`, with a sender from it and its counters' slot.
    fn new(
        net: &MemoryNet,
        local: SocketAddr,
        clock: SystemClock,
        telemetry: Arc<Telemetry>,
        counters: LoopCounters,
        publish_every: Duration,
        make: impl FnOnce(SocketAddr, Sender, Nanos) -> std::io::Result<E>,
    ) -> std::io::Result<Inline<E>> {
        let replies = Sender::memory(net, local, DEFAULT_DATAGRAM);
        let endpoint = make(local, replies, clock.now())?;
        Ok(Inline {
            state: Mutex::new(State {
                endpoint,
                inbound: Inbound::new(),
                next_publish: 0,
                timer_wakes_at: 0,
            }),
            clock,
            sender: Sender::memory(net, local, DEFAULT_DATAGRAM),
            telemetry,
            counters,
            publish_every: publish_every.as_nanos() as Nanos,
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
    /// released. With `timers` (not the timer thread itself), wakes the timer thread when `f`
    /// armed a timer sooner than the thread wakes by itself.
    fn with<T>(&self, timers: Option<&TimerWake>, f: impl FnOnce(&mut State<E>) -> T) -> T {
        let mut s = self.lock();
        let t = f(&mut s);
        s.endpoint.report_events();
        // Woken once the lock is released (the thread takes it first thing).
        let wake = timers.filter(|_| {
            s.endpoint
                .poll_timeout()
                .is_some_and(|at| at < s.timer_wakes_at)
        });
        // Nothing to send (a request handed in and answered in the call): done. The first
        // transmit apart: a lone answer, the usual case for a datagram, allocates no vector.
        let Some(first) = s.endpoint.poll_transmit() else {
            drop(s);
            if let Some(timers) = wake {
                timers.wake();
            }
            return t;
        };
        let rest: Vec<Transmit> = std::iter::from_fn(|| s.endpoint.poll_transmit()).collect();
        drop(s);
        if let Some(timers) = wake {
            timers.wake();
        }
        for t in std::iter::once(first).chain(rest) {
            let _ = self.sender.send_transmit(t);
        }
        t
    }

    /// Takes one datagram from `from` (see [`Inline::with`] for `timers`).
    fn deliver(&self, timers: &TimerWake, from: SocketAddr, datagram: Bytes) {
        let now = self.clock.now();
        self.with(Some(timers), |s| {
            if let Some(msg) = s.inbound.take(from, datagram) {
                s.endpoint.handle(now, from, msg);
            }
        });
    }

    /// Fires the timers that are due and publishes the counters when that is due; returns
    /// when either is next due (the timer thread wakes for this endpoint then, or sooner).
    fn tick(&self) -> Nanos {
        let now = self.clock.now();
        self.with(None, |s| {
            s.endpoint.handle_timeout(now);
            s.inbound.expire();
            if now >= s.next_publish {
                s.next_publish = now + self.publish_every;
                self.counters
                    .publish(&self.telemetry, s.endpoint.counters());
            }
            let next = s
                .endpoint
                .poll_timeout()
                .map_or(s.next_publish, |t| t.min(s.next_publish));
            s.timer_wakes_at = next;
            next
        })
    }
}

/// One inline endpoint per receive loop, bound to one address (see the module
/// documentation): loop `i` serves the sessions of shard `i`.
pub(crate) struct InlineGroup<E> {
    members: Vec<Arc<Inline<E>>>,
    /// The member each route goes to ([`naam_proto::shard::loop_of_route`] for every route,
    /// worked out once: a division per message otherwise); route 0 has none.
    by_route: Box<[usize; 256]>,
    /// The members' clock (the process's), on which their timers are due.
    clock: SystemClock,
    /// How the port's timer thread, which fires every member's timers, is woken.
    wake: TimerWake,
}

impl<E: InlineEndpoint> InlineGroup<E> {
    /// Binds `loops` endpoints at `addr` in `net` (port 0: a free one); `make` builds loop
    /// `i`'s from its index, the address bound, a sender from it and the clock's now. Their
    /// counters are published summed.
    pub(crate) fn bind(
        net: &MemoryNet,
        addr: SocketAddr,
        loops: usize,
        telemetry: Arc<Telemetry>,
        publish_every: Duration,
        mut make: impl FnMut(usize, SocketAddr, Sender, Nanos) -> std::io::Result<E>,
    ) -> std::io::Result<(ServedPort, Arc<InlineGroup<E>>)> {
        // The process's clock: a client in the process hands requests in with its reading.
        let clock = SystemClock::of_process();
        net.serve(addr, |local| {
            let members = LoopCounters::group(loops)
                .into_iter()
                .enumerate()
                .map(|(i, counters)| {
                    let (t, every) = (telemetry.clone(), publish_every);
                    let make = |a, s, n| make(i, a, s, n);
                    Inline::new(net, local, clock, t, counters, every, make).map(Arc::new)
                })
                .collect::<std::io::Result<Vec<_>>>()?;
            if members.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "an inline group needs a loop",
                ));
            }
            let mut by_route = Box::new([0; 256]);
            for (route, member) in by_route.iter_mut().enumerate() {
                *member = naam_proto::shard::loop_of_route(route as u8, members.len()).unwrap_or(0);
            }
            Ok(Arc::new(InlineGroup {
                members,
                by_route,
                clock,
                wake: TimerWake::default(),
            }))
        })
    }

    /// The loop that takes a datagram from `from`: the one its route names, or for route 0
    /// (a handshake, unsealed) one chosen by the sender's address, so a client's handshake
    /// stays on one loop (as the kernel's hash keeps it in an `SO_REUSEPORT` group).
    fn member(&self, from: SocketAddr, datagram: &[u8]) -> &Inline<E> {
        let n = self.members.len();
        let i = match datagram.get(naam_proto::frame::ROUTE).copied().unwrap_or(0) {
            0 => {
                use std::hash::BuildHasher;
                let hasher =
                    std::hash::BuildHasherDefault::<naam_proto::intmap::IntHasher>::default();
                (hasher.hash_one(from) % n as u64) as usize
            }
            route => self.by_route[route as usize],
        };
        &self.members[i]
    }

    /// Reads every loop's endpoint, in loop order.
    pub(crate) fn read<T>(&self, f: impl Fn(&E) -> T) -> Vec<T> {
        self.members.iter().map(|m| m.read(&f)).collect()
    }

    /// Refuses new work on every loop, then waits, at most `drain`, until every queued
    /// request has been answered.
    pub(crate) fn drain(&self, drain: Duration) {
        for m in &self.members {
            m.with(Some(&self.wake), |s| s.endpoint.start_drain());
        }
        let deadline = Instant::now() + drain;
        while !self.read(E::idle).into_iter().all(|idle| idle) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl<E: InlineEndpoint> Service for InlineGroup<E> {
    fn deliver(&self, from: SocketAddr, datagram: Bytes) {
        self.member(from, &datagram)
            .deliver(&self.wake, from, datagram);
    }

    fn tick(&self) -> Option<Duration> {
        let next = self.members.iter().map(|m| m.tick()).min();
        let now = self.clock.now();
        next.map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }

    fn timer_wake(&self) -> Option<&TimerWake> {
        Some(&self.wake)
    }

    /// Goes to the loop that holds the session, as its datagrams would (their route is the
    /// session's).
    fn request_in_process(
        &self,
        now: Nanos,
        sid: u64,
        req: &mut Request,
        out: &mut Reply,
    ) -> Option<InProcess> {
        let route = naam_proto::shard::route_of_session(sid);
        // Route 0 (none) goes to the first member, as the table says.
        let i = self.by_route[route as usize];
        // `now` is on the process's clock, which the group's endpoints read too.
        self.members[i].with(Some(&self.wake), |s| {
            s.endpoint.request_in_process(now, sid, req, out)
        })
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
            self.out.push_back(Transmit::new(from, 1, msg));
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
    fn a_group_sends_each_route_to_its_loop_and_a_handshake_by_its_sender() {
        use naam_proto::frame::fragment_routed;
        let net = MemoryNet::new();
        let loops = 3;
        let (port, group) = InlineGroup::bind(
            &net,
            "10.0.0.1:7000".parse().unwrap(),
            loops,
            Arc::default(),
            Duration::from_secs(1),
            |_, _, _, _| Ok(Echo::default()),
        )
        .unwrap();
        let to = port.addr();
        let from: SocketAddr = "10.0.0.2:5000".parse().unwrap();
        for route in 1..=u8::MAX {
            let d = fragment_routed(u64::from(route), &[route], DEFAULT_DATAGRAM, route).unwrap();
            assert!(net.send(from, to, d[0].clone()));
        }
        let got = group.read(|e| e.got.iter().map(|(_, m)| m[0]).collect::<Vec<u8>>());
        for (i, routes) in got.iter().enumerate() {
            assert!(!routes.is_empty(), "loop {i} got nothing");
            assert!(
                routes.iter().all(|&r| r as usize % loops == i),
                "loop {i} got routes {routes:?}"
            );
        }
        // Route 0 (a handshake): every datagram of one sender to one loop.
        let before: Vec<usize> = group.read(|e| e.got.len());
        for n in 0..5u64 {
            let d = fragment_routed(100 + n, b"hello", DEFAULT_DATAGRAM, 0).unwrap();
            assert!(net.send(from, to, d[0].clone()));
        }
        let grew: Vec<usize> = group
            .read(|e| e.got.len())
            .iter()
            .zip(&before)
            .map(|(a, b)| a - b)
            .collect();
        assert_eq!(grew.iter().sum::<usize>(), 5);
        assert_eq!(grew.iter().filter(|&&n| n > 0).count(), 1, "{grew:?}");
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
