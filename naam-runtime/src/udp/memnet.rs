//! An in-process datagram network: the UDP fabric with memory in place of the kernel.
//!
//! A [`MemoryNet`] holds ports that sockets bind and close as they would UDP ports
//! ([`super::Socket::bind_memory`]). A datagram to an address nobody has bound is dropped, and
//! so is one to a port whose queue is full, as a full socket buffer would drop it. Everything
//! above the datagram is the UDP fabric's own code: fragmentation and reassembly, the
//! endpoints, the drivers of naam-server, naam-nic and the client. So an in-process
//! deployment over it runs exactly what a deployment over UDP runs, without a network (it works
//! in a namespace with no interface at all) and without the kernel's cost. Figures measured
//! over it are labelled [`MEMORY_MODE`].
//!
//! A port is either a queue, which a socket's owner reads as it would read a UDP socket, or a
//! [`Service`], which takes each datagram in the sending thread, run to completion, as a
//! kernel-bypass stack would. The server's and the NIC's endpoints are bound as services
//! ([`super::serve_host_inline`], [`super::serve_nic_inline`]), so a request costs no hand-off
//! to a driver thread: the client's thread opens it in the server endpoint and queues it at an
//! executor, and the executor's reply goes to the client's queue. What a service sends while it
//! is delivering is delivered after it returns (one thread never holds two services at once,
//! and a chain of answers is a loop, not a recursion).
//!
//! A client may also hand a request to the server's endpoint as it is, with no encoding,
//! envelope or datagram ([`MemoryNet::request_in_process`], `UdpConfig::in_process`): one
//! address space needs no wire, as it needs no seal. The endpoint admits it as it admits a
//! request in a datagram of the same session, and what it cannot answer at once is answered
//! on the session as a datagram.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, Sender, TryRecvError, TrySendError};
use naam_proto::endpoint::InProcess;
use naam_proto::intmap::IntMap;
use naam_proto::wire::{Reply, Request};
use naam_proto::Nanos;

/// Mode label of everything measured over a [`MemoryNet`].
pub const MEMORY_MODE: &str = "inproc-endpoints (one process; the UDP fabric's endpoints and \
drivers over an in-memory datagram network, requests handed to the server endpoint in the \
client's thread without encoding; NIC cores, DMA and one-sided RDMA emulated)";

/// Datagrams a port's queue holds before new ones are dropped: about what a 4 MiB socket
/// buffer holds of 1472-byte datagrams.
pub const PORT_QUEUE: usize = 4096;

/// First port given to a socket bound to port 0 (the IANA dynamic range).
const EPHEMERAL_FIRST: u16 = 49152;

/// How long a reader polls its queue before it blocks: a parked thread takes microseconds to
/// wake, longer than a whole exchange through an in-process server (the in-process cluster's
/// clients poll as long, for the same reason).
const POLL_BEFORE_BLOCKING: Duration = Duration::from_micros(20);

/// The longest a service's timer thread sleeps. One that has no [`TimerWake`] sleeps this
/// long at most, so that it notices a timer armed while it slept and that it was stopped.
const MAX_TIMER_SLEEP: Duration = Duration::from_millis(1);

/// The longest the timer thread of a service with a [`TimerWake`] sleeps: it is woken for
/// a timer armed sooner and when it is stopped, so this bounds only what the service does
/// on its ticks without a timer of its own (expiring partial reassemblies).
const MAX_WOKEN_TIMER_SLEEP: Duration = Duration::from_millis(20);

/// How a service wakes its port's timer thread for a timer that came due sooner than the
/// thread sleeps for. The thread sleeps, parked, until the service's next timer; whatever
/// arms an earlier one (a datagram or a request taken in another thread) wakes it. The
/// service decides when: it knows, under its own lock, when the thread last said it would
/// wake. A thread that woke every millisecond instead, two per in-process deployment, took
/// the endpoint's lock and a core from the threads serving messages two thousand times a
/// second.
#[derive(Debug, Default)]
pub(crate) struct TimerWake {
    thread: std::sync::OnceLock<std::thread::Thread>,
}

impl TimerWake {
    /// Wakes the timer thread (once it runs).
    pub(crate) fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

type Datagram = (SocketAddr, Bytes);

/// What serves a port in the sending thread (see the module documentation). A service that
/// answers holds its own [`super::Sender`] into the network.
pub(crate) trait Service: Send + Sync {
    /// Takes one datagram from `from`, in the sender's thread.
    fn deliver(&self, from: SocketAddr, datagram: Bytes);
    /// Fires the timers that are due and says how long until the next one (`None`: none
    /// armed). Called from the port's timer thread.
    fn tick(&self) -> Option<Duration>;
    /// Takes request `req` of session `sid` from a client in this process, handed over as
    /// it is (see [`naam_proto::endpoint::ServerEndpoint::request_in_process`]), at `now`
    /// on [`crate::SystemClock::of_process`] (the caller's reading), a reply answered at once
    /// written into `out` ([`InProcess::Answered`]); `None`, the request left with the
    /// caller, when this service takes datagrams only, or holds no such session.
    fn request_in_process(
        &self,
        _now: Nanos,
        _sid: u64,
        _req: &mut Request,
        _out: &mut Reply,
    ) -> Option<InProcess> {
        None
    }
    /// How this service wakes its timer thread for a timer armed sooner than the thread
    /// sleeps for; `None`: the thread wakes every [`MAX_TIMER_SLEEP`] to look.
    fn timer_wake(&self) -> Option<&TimerWake> {
        None
    }
}

#[derive(Clone)]
enum Port {
    Queue(Sender<Datagram>),
    Service(Arc<dyn Service>),
}

#[derive(Default)]
struct Ports {
    bound: IntMap<SocketAddr, Port>,
    next_ephemeral: u16,
}

/// What the clones of a [`MemoryNet`] share.
struct Shared {
    ports: RwLock<Ports>,
    /// Changed, under the write lock, by every bind and close: what each thread's [`ROUTES`]
    /// compares its entries with.
    generation: AtomicU64,
}

impl Default for Shared {
    fn default() -> Shared {
        Shared {
            ports: RwLock::default(),
            generation: AtomicU64::new(next_generation()),
        }
    }
}

/// Generations come from one count for the whole process, so that no two networks ever
/// share one: not even a network allocated where a dropped one was, whose address a thread's
/// [`ROUTES`] may still hold.
fn next_generation() -> u64 {
    static GENERATIONS: AtomicU64 = AtomicU64::new(1);
    GENERATIONS.fetch_add(1, Ordering::Relaxed)
}

/// A port this thread sent to, as it was bound in generation `generation` of the network
/// at `net` (its shared state's address).
struct Route {
    net: usize,
    generation: u64,
    to: SocketAddr,
    port: Rc<Port>,
}

/// The most ports a thread remembers (a client sends to a server and its NIC; a server's
/// thread to a few clients at a time); the oldest is forgotten first.
const ROUTES_KEPT: usize = 8;

thread_local! {
    /// The ports this thread sent to lately, so that a send in a generation already seen
    /// takes neither the network's lock nor a reference on the port's service: neither
    /// writes memory another core's sends read (with two client threads both did, on every
    /// datagram). An entry of an older generation is looked up again, and dropped; an entry
    /// keeps its port's queue or service alive until then, or until the thread ends.
    static ROUTES: RefCell<Vec<Route>> = const { RefCell::new(Vec::new()) };
}

/// An in-process datagram network (see the module documentation). Clones share the network.
#[derive(Clone, Default)]
pub struct MemoryNet {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemoryNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bound = self.read().bound.len();
        f.debug_struct("MemoryNet").field("bound", &bound).finish()
    }
}

/// A bound port: its address and its queue. Dropping it closes the port.
pub(crate) struct MemoryPort {
    addr: SocketAddr,
    queue: Receiver<Datagram>,
    net: MemoryNet,
}

/// A port bound to a [`Service`], with the thread that fires its timers. Dropping it closes the
/// port and stops the thread.
pub(crate) struct ServedPort {
    addr: SocketAddr,
    net: MemoryNet,
    stop: Arc<AtomicBool>,
    timers: Option<JoinHandle<()>>,
}

/// Datagrams for services, sent while this thread was delivering to one.
type Pending = VecDeque<(Rc<Port>, SocketAddr, Bytes)>;

thread_local! {
    /// Whether this thread is inside a service's `deliver`.
    static DELIVERING: Cell<bool> = const { Cell::new(false) };
    /// What services sent while this thread delivered, in order (kept for its capacity: a
    /// delivery makes no queue of its own, and most send nothing).
    static PENDING: RefCell<Pending> = const { RefCell::new(VecDeque::new()) };
}

/// Ends this thread's delivery, even when a service panicked (what it left queued goes too).
struct DeliveryGuard;

impl Drop for DeliveryGuard {
    fn drop(&mut self) {
        DELIVERING.with(|d| d.set(false));
        PENDING.with(|p| p.borrow_mut().clear());
    }
}

impl MemoryNet {
    /// An empty network.
    pub fn new() -> MemoryNet {
        MemoryNet::default()
    }

    // The map stays consistent under any panic (every change is one insert or remove).
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Ports> {
        self.shared
            .ports
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Ports> {
        self.shared
            .ports
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts `port` at `addr` in `ports` (the write lock held), a new generation.
    fn insert(&self, ports: &mut Ports, addr: SocketAddr, port: Port) {
        ports.bound.insert(addr, port);
        self.new_generation();
    }

    /// Closes the port at `addr`, a new generation.
    fn unbind(&self, addr: SocketAddr) {
        let mut ports = self.write();
        ports.bound.remove(&addr);
        self.new_generation();
    }

    /// Starts a new generation (the write lock held): every thread's [`ROUTES`] entries of
    /// this network are looked up again.
    fn new_generation(&self) {
        self.shared
            .generation
            .store(next_generation(), Ordering::Release);
    }

    /// The port bound at `to`, from this thread's [`ROUTES`] when it looked it up in the
    /// network's current generation.
    fn port(&self, to: SocketAddr) -> Option<Rc<Port>> {
        let net = Arc::as_ptr(&self.shared) as usize;
        // Read before the lock below: an entry is never newer than the generation it names.
        let generation = self.shared.generation.load(Ordering::Acquire);
        let known = ROUTES.with(|r| {
            let r = r.borrow();
            r.iter()
                .find(|e| e.net == net && e.to == to && e.generation == generation)
                .map(|e| e.port.clone())
        });
        if known.is_some() {
            return known;
        }
        let port = Rc::new(self.read().bound.get(&to)?.clone());
        ROUTES.with(|r| {
            let mut r = r.borrow_mut();
            r.retain(|e| e.net != net || (e.generation == generation && e.to != to));
            if r.len() >= ROUTES_KEPT {
                r.remove(0);
            }
            r.push(Route {
                net,
                generation,
                to,
                port: port.clone(),
            });
        });
        Some(port)
    }

    /// Claims `addr` for `port`. An unspecified IP (`0.0.0.0`, `::`) binds the loopback
    /// address of its family, port 0 the next free port of the dynamic range; a bound address
    /// is refused.
    fn claim(&self, addr: SocketAddr, port: Port) -> io::Result<SocketAddr> {
        let mut ports = self.write();
        let addr = Self::free(&mut ports, addr)?;
        self.insert(&mut ports, addr, port);
        Ok(addr)
    }

    /// The address `addr` binds, if it is free (see [`MemoryNet::claim`]).
    fn free(ports: &mut Ports, addr: SocketAddr) -> io::Result<SocketAddr> {
        let ip = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let addr = if addr.port() != 0 {
            SocketAddr::new(ip, addr.port())
        } else {
            let span = u16::MAX - EPHEMERAL_FIRST + 1;
            let free = (0..span).find_map(|i| {
                let port = EPHEMERAL_FIRST + (ports.next_ephemeral.wrapping_add(i) % span);
                let a = SocketAddr::new(ip, port);
                (!ports.bound.contains_key(&a)).then_some((i, a))
            });
            let Some((i, a)) = free else {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("every dynamic port of {ip} is bound"),
                ));
            };
            ports.next_ephemeral = ports.next_ephemeral.wrapping_add(i + 1) % span;
            a
        };
        if ports.bound.contains_key(&addr) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{addr} is already bound"),
            ));
        }
        Ok(addr)
    }

    /// Binds `addr` to a queue (see [`MemoryNet::claim`] for unspecified addresses).
    pub(crate) fn bind(&self, addr: SocketAddr) -> io::Result<MemoryPort> {
        let (tx, rx) = bounded(PORT_QUEUE);
        let addr = self.claim(addr, Port::Queue(tx))?;
        Ok(MemoryPort {
            addr,
            queue: rx,
            net: self.clone(),
        })
    }

    /// Binds `addr` to the service `make` builds for the address bound, and starts the thread
    /// that fires its timers.
    pub(crate) fn serve<S: Service + 'static>(
        &self,
        addr: SocketAddr,
        make: impl FnOnce(SocketAddr) -> io::Result<Arc<S>>,
    ) -> io::Result<(ServedPort, Arc<S>)> {
        let (addr, made) = {
            let mut ports = self.write();
            let addr = Self::free(&mut ports, addr)?;
            let made = make(addr)?;
            self.insert(&mut ports, addr, Port::Service(made.clone()));
            (addr, made)
        };
        let service: Arc<dyn Service> = made.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let timers = std::thread::Builder::new()
            .name(format!("naam-timers-{addr}"))
            .spawn(move || {
                let cap = match service.timer_wake() {
                    Some(w) => {
                        let _ = w.thread.set(std::thread::current());
                        MAX_WOKEN_TIMER_SLEEP
                    }
                    None => MAX_TIMER_SLEEP,
                };
                while !halt.load(Ordering::Acquire) {
                    let wait = service.tick().unwrap_or(cap);
                    // Parked: an unpark since the tick (a timer armed sooner, or the stop)
                    // makes this return at once.
                    std::thread::park_timeout(wait.min(cap));
                }
            });
        match timers {
            Ok(t) => Ok((
                ServedPort {
                    addr,
                    net: self.clone(),
                    stop,
                    timers: Some(t),
                },
                made,
            )),
            Err(e) => {
                self.unbind(addr);
                Err(e)
            }
        }
    }

    /// Delivers `datagram` from `from` to `to`; false when nobody has bound `to` or its queue is
    /// full (the datagram is dropped, as UDP drops it). A service takes it in this thread, or
    /// after the service this thread is delivering to returns.
    pub(crate) fn send(&self, from: SocketAddr, to: SocketAddr, datagram: Bytes) -> bool {
        let Some(port) = self.port(to) else {
            return false;
        };
        if let Port::Queue(q) = &*port {
            return match q.try_send((from, datagram)) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            };
        }
        // Inside another delivery: queue it for that delivery's loop. Otherwise this thread
        // starts one.
        if DELIVERING.with(Cell::get) {
            PENDING.with(|p| p.borrow_mut().push_back((port, from, datagram)));
        } else {
            delivering(|| port.deliver(from, datagram));
        }
        true
    }
}

/// Runs `f` as this thread's outermost delivery: what services send meanwhile is queued and
/// delivered after it returns, in order, until nothing more is sent. `None` (and `f` not
/// run) when this thread is inside a delivery already.
fn delivering<T>(f: impl FnOnce() -> T) -> Option<T> {
    if DELIVERING.with(|d| d.replace(true)) {
        return None;
    }
    let _guard = DeliveryGuard;
    let t = f();
    while let Some((p, from, d)) = PENDING.with(|p| p.borrow_mut().pop_front()) {
        p.deliver(from, d);
    }
    Some(t)
}

/// A client's way to the service bound at one address, for the requests it hands in
/// ([`MemoryNet::request_in_process`]): the service is looked up again only when the
/// network's bindings changed (a server restarted), so a request costs one atomic read to
/// find it, not a search of this thread's routes and a reference taken and given back.
pub(crate) struct ServiceRoute {
    to: SocketAddr,
    /// The service, and the generation of the network it was bound in.
    found: Option<(u64, Arc<dyn Service>)>,
}

impl ServiceRoute {
    /// The way to the service at `to` (looked up at its first use).
    pub(crate) fn new(to: SocketAddr) -> ServiceRoute {
        ServiceRoute { to, found: None }
    }
}

impl MemoryNet {
    /// The service `route` leads to, looked up again when the bindings changed since.
    fn service<'r>(&self, route: &'r mut ServiceRoute) -> Option<&'r Arc<dyn Service>> {
        let generation = self.shared.generation.load(Ordering::Acquire);
        if route.found.as_ref().is_none_or(|(g, _)| *g != generation) {
            route.found = match self.read().bound.get(&route.to) {
                Some(Port::Service(s)) => Some((generation, s.clone())),
                _ => None,
            };
        }
        route.found.as_ref().map(|(_, s)| s)
    }

    /// Hands request `req` of session `sid` to the service `route` leads to, in this
    /// thread, as [`MemoryNet::send`] hands it a datagram: what the service sends meanwhile
    /// is delivered after it returns; a reply answered at once is written into `out`. `None`,
    /// the request left with the caller, when there is no service that takes requests so,
    /// or when this thread is inside another delivery (a service never calls into another
    /// while it delivers).
    pub(crate) fn request_in_process(
        &self,
        route: &mut ServiceRoute,
        now: Nanos,
        sid: u64,
        req: &mut Request,
        out: &mut Reply,
    ) -> Option<InProcess> {
        let service = self.service(route)?;
        delivering(|| service.request_in_process(now, sid, req, out)).flatten()
    }
}

impl Port {
    /// Hands `datagram` to a service in this thread; a queue's datagrams are never delivered
    /// here (`send` queues them).
    fn deliver(&self, from: SocketAddr, datagram: Bytes) {
        if let Port::Service(s) = self {
            s.deliver(from, datagram);
        }
    }
}

impl MemoryPort {
    /// The bound address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The network the port is bound in.
    pub(crate) fn net(&self) -> &MemoryNet {
        &self.net
    }

    /// Waits up to `timeout` for a datagram (polling for [`POLL_BEFORE_BLOCKING`] before it
    /// blocks), then takes up to `max` in all without waiting, appended to `out`.
    pub(crate) fn recv_into(&self, timeout: Duration, max: usize, out: &mut Vec<Datagram>) {
        // The clock is read only once there is something to wait for.
        let mut start = None;
        let first = loop {
            match self.queue.try_recv() {
                Ok(d) => break Some(d),
                Err(TryRecvError::Disconnected) => break None,
                Err(TryRecvError::Empty) => {}
            }
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if waited >= timeout {
                break None;
            }
            if waited >= POLL_BEFORE_BLOCKING {
                break self.queue.recv_timeout(timeout - waited).ok();
            }
            std::hint::spin_loop();
        };
        let Some(d) = first else {
            return;
        };
        out.push(d);
        for _ in 1..max {
            match self.queue.try_recv() {
                Ok(d) => out.push(d),
                Err(_) => break,
            }
        }
    }
}

impl Drop for MemoryPort {
    fn drop(&mut self) {
        self.net.unbind(self.addr);
    }
}

impl ServedPort {
    /// The bound address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ServedPort {
    fn drop(&mut self) {
        self.net.unbind(self.addr);
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.timers.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("literal address")
    }

    /// A parked timer thread wakes when its service wakes it, long before its own wake.
    #[test]
    fn a_woken_timer_thread_wakes_at_once() {
        let wake = Arc::new(TimerWake::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let w = wake.clone();
        let sleeper = std::thread::spawn(move || {
            let _ = w.thread.set(std::thread::current());
            tx.send(()).expect("the test waits");
            let parked = Instant::now();
            std::thread::park_timeout(Duration::from_secs(60));
            parked.elapsed()
        });
        rx.recv().unwrap();
        wake.wake();
        let slept = sleeper.join().unwrap();
        assert!(slept < Duration::from_secs(30), "slept {slept:?}");
    }

    #[test]
    fn ports_bind_close_and_drop_like_udp_ports() {
        let net = MemoryNet::new();
        let server = net.bind(a("10.0.0.1:7000")).unwrap();
        assert!(net.bind(a("10.0.0.1:7000")).is_err(), "bound twice");
        let c1 = net.bind(a("0.0.0.0:0")).unwrap();
        let c2 = net.bind(a("0.0.0.0:0")).unwrap();
        assert_eq!(c1.addr().ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_ne!(c1.addr(), c2.addr());
        assert!(c1.addr().port() >= EPHEMERAL_FIRST);
        assert!(net.send(c1.addr(), server.addr(), Bytes::from_static(b"hi")));
        let mut got = Vec::new();
        server.recv_into(Duration::from_millis(10), 8, &mut got);
        assert_eq!(got, vec![(c1.addr(), Bytes::from_static(b"hi"))]);
        // Nobody at the address: dropped.
        assert!(!net.send(c1.addr(), a("10.0.0.9:1"), Bytes::from_static(b"x")));
        // A closed port drops, and its address can be bound again.
        drop(server);
        assert!(!net.send(c1.addr(), a("10.0.0.1:7000"), Bytes::from_static(b"x")));
        let again = net.bind(a("10.0.0.1:7000")).unwrap();
        got.clear();
        again.recv_into(Duration::from_millis(1), 8, &mut got);
        assert!(got.is_empty());
    }

    #[test]
    fn a_send_after_a_close_and_a_new_bind_reaches_the_new_port_only() {
        let net = MemoryNet::new();
        let client = net.bind(a("10.0.0.2:0")).unwrap();
        let server = a("10.0.0.1:7000");
        let first = net.bind(server).unwrap();
        let recv = |p: &MemoryPort| {
            let mut got = Vec::new();
            p.recv_into(Duration::from_millis(1), 8, &mut got);
            got.into_iter().map(|(_, d)| d).collect::<Vec<_>>()
        };
        // This thread now remembers the port.
        assert!(net.send(client.addr(), server, Bytes::from_static(b"one")));
        assert_eq!(recv(&first), vec![Bytes::from_static(b"one")]);
        drop(first);
        assert!(!net.send(client.addr(), server, Bytes::from_static(b"lost")));
        let second = net.bind(server).unwrap();
        assert!(net.send(client.addr(), server, Bytes::from_static(b"two")));
        assert_eq!(recv(&second), vec![Bytes::from_static(b"two")]);
        // Another network binds the same address: its own port, not the one remembered.
        let other = MemoryNet::new();
        let third = other.bind(server).unwrap();
        assert!(other.send(client.addr(), server, Bytes::from_static(b"three")));
        assert_eq!(recv(&third), vec![Bytes::from_static(b"three")]);
        assert!(recv(&second).is_empty());
        // And a network dropped and made again (perhaps at the same place in memory).
        drop((third, other));
        let again = MemoryNet::new();
        assert!(!again.send(client.addr(), server, Bytes::from_static(b"nobody")));
    }

    /// Records what it was given; answers each datagram to `answer_to`, if set, until
    /// `budget` answers are spent; counts its timer ticks.
    #[derive(Default)]
    struct Echo {
        got: Mutex<Vec<(SocketAddr, Bytes, std::thread::ThreadId)>>,
        answer_to: Mutex<Option<SocketAddr>>,
        me: Mutex<Option<SocketAddr>>,
        budget: AtomicUsize,
        inside: AtomicUsize,
        deepest: AtomicUsize,
        ticks: AtomicUsize,
        panic_on: Mutex<Option<Bytes>>,
        net: MemoryNet,
    }

    impl Service for Echo {
        fn deliver(&self, from: SocketAddr, datagram: Bytes) {
            let depth = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
            self.deepest.fetch_max(depth, Ordering::SeqCst);
            if self.panic_on.lock().unwrap().as_ref() == Some(&datagram) {
                self.inside.fetch_sub(1, Ordering::SeqCst);
                panic!("asked to");
            }
            self.got
                .lock()
                .unwrap()
                .push((from, datagram.clone(), std::thread::current().id()));
            let to = *self.answer_to.lock().unwrap();
            let me = self.me.lock().unwrap().expect("bound");
            if let Some(to) = to {
                let left = self.budget.load(Ordering::SeqCst);
                if left > 0 {
                    self.budget.store(left - 1, Ordering::SeqCst);
                    assert!(self.net.send(me, to, datagram));
                }
            }
            self.inside.fetch_sub(1, Ordering::SeqCst);
        }

        fn tick(&self) -> Option<Duration> {
            self.ticks.fetch_add(1, Ordering::SeqCst);
            Some(Duration::from_micros(100))
        }
    }

    fn echo(net: &MemoryNet, addr: &str) -> (ServedPort, Arc<Echo>) {
        net.serve(a(addr), |local| {
            let e = Echo {
                net: net.clone(),
                ..Echo::default()
            };
            *e.me.lock().unwrap() = Some(local);
            Ok(Arc::new(e))
        })
        .unwrap()
    }

    #[test]
    fn a_service_takes_each_datagram_in_the_sending_thread() {
        let net = MemoryNet::new();
        let (port, svc) = echo(&net, "10.0.0.1:0");
        assert!(port.addr().port() >= EPHEMERAL_FIRST);
        assert!(net.bind(port.addr()).is_err(), "a served address is bound");
        let from = a("10.0.0.2:5");
        assert!(net.send(from, port.addr(), Bytes::from_static(b"hi")));
        let got = svc.got.lock().unwrap().clone();
        assert_eq!(
            got,
            vec![(from, Bytes::from_static(b"hi"), std::thread::current().id())]
        );
        // From another thread, in that thread.
        let (net2, to) = (net.clone(), port.addr());
        let t = std::thread::spawn(move || {
            assert!(net2.send(from, to, Bytes::from_static(b"there")));
            std::thread::current().id()
        })
        .join()
        .unwrap();
        assert_eq!(svc.got.lock().unwrap()[1].2, t);
    }

    #[test]
    fn what_a_service_sends_while_delivering_waits_until_it_returns() {
        // Two services answering each other 100 times: a loop on the first sender's thread,
        // never one service inside another, and never a deeper stack.
        let net = MemoryNet::new();
        let (pa, a_svc) = echo(&net, "10.0.0.1:1");
        let (pb, b_svc) = echo(&net, "10.0.0.1:2");
        *a_svc.answer_to.lock().unwrap() = Some(pb.addr());
        *b_svc.answer_to.lock().unwrap() = Some(pa.addr());
        a_svc.budget.store(50, Ordering::SeqCst);
        b_svc.budget.store(50, Ordering::SeqCst);
        assert!(net.send(a("10.0.0.9:9"), pa.addr(), Bytes::from_static(b"ping")));
        assert_eq!(a_svc.got.lock().unwrap().len(), 51);
        assert_eq!(b_svc.got.lock().unwrap().len(), 50);
        assert_eq!(a_svc.deepest.load(Ordering::SeqCst), 1);
        assert_eq!(b_svc.deepest.load(Ordering::SeqCst), 1);
        // Nothing is left pending on this thread: the next send is delivered at once.
        assert!(net.send(a("10.0.0.9:9"), pb.addr(), Bytes::from_static(b"x")));
        assert_eq!(b_svc.got.lock().unwrap().len(), 51);
    }

    #[test]
    fn a_service_that_panics_leaves_the_thread_able_to_deliver() {
        let net = MemoryNet::new();
        let (port, svc) = echo(&net, "10.0.0.1:1");
        *svc.panic_on.lock().unwrap() = Some(Bytes::from_static(b"boom"));
        let to = port.addr();
        let n = net.clone();
        let r = std::panic::catch_unwind(move || {
            n.send(a("10.0.0.9:9"), to, Bytes::from_static(b"boom"))
        });
        assert!(r.is_err());
        assert!(net.send(a("10.0.0.9:9"), to, Bytes::from_static(b"fine")));
        assert_eq!(svc.got.lock().unwrap().len(), 1, "delivered at once");
    }

    #[test]
    fn a_served_port_ticks_until_dropped_then_frees_its_address() {
        let net = MemoryNet::new();
        let (port, svc) = echo(&net, "10.0.0.1:7000");
        let deadline = Instant::now() + Duration::from_secs(10);
        while svc.ticks.load(Ordering::SeqCst) < 3 {
            assert!(Instant::now() < deadline, "the timer thread never ticked");
            std::thread::sleep(Duration::from_millis(1));
        }
        let addr = port.addr();
        drop(port);
        let after = svc.ticks.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(svc.ticks.load(Ordering::SeqCst), after, "ticks after drop");
        assert!(!net.send(a("10.0.0.9:9"), addr, Bytes::from_static(b"x")));
        let again = net.bind(addr).unwrap();
        assert_eq!(again.addr(), addr);
    }

    #[test]
    fn a_full_queue_drops_new_datagrams() {
        let net = MemoryNet::new();
        let port = net.bind(a("127.0.0.1:5000")).unwrap();
        let from = a("127.0.0.1:5001");
        for _ in 0..PORT_QUEUE {
            assert!(net.send(from, port.addr(), Bytes::from_static(b".")));
        }
        assert!(!net.send(from, port.addr(), Bytes::from_static(b".")));
        let mut taken = 0;
        loop {
            let mut got = Vec::new();
            port.recv_into(Duration::from_millis(1), 1000, &mut got);
            if got.is_empty() {
                break;
            }
            taken += got.len();
        }
        assert_eq!(taken, PORT_QUEUE);
    }

    /// Takes requests handed in and answers each with its own name.
    struct Taker(&'static str);

    impl Service for Taker {
        fn deliver(&self, _from: SocketAddr, _datagram: Bytes) {}
        fn tick(&self) -> Option<Duration> {
            None
        }
        fn request_in_process(
            &self,
            _now: Nanos,
            _sid: u64,
            req: &mut Request,
            out: &mut Reply,
        ) -> Option<InProcess> {
            *out = naam_proto::endpoint::error_reply(
                req,
                naam_proto::wire::Status::Ok,
                naam_proto::Placement::Host,
                self.0.to_string(),
            );
            Some(InProcess::Answered)
        }
    }

    fn hand_in(net: &MemoryNet, route: &mut ServiceRoute) -> Option<String> {
        let mut req = Request::for_call(1, 2, 3, b"", &[]).unwrap();
        let mut out = Reply::unanswered();
        match net.request_in_process(route, 0, 7, &mut req, &mut out)? {
            InProcess::Answered => Some(String::from_utf8(out.payload.to_vec()).unwrap()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_handed_in_finds_the_service_bound_now_and_only_a_service() {
        let net = MemoryNet::new();
        let queue = net.bind(a("10.0.0.1:7000")).unwrap();
        let mut to_queue = ServiceRoute::new(queue.addr());
        assert_eq!(
            hand_in(&net, &mut to_queue),
            None,
            "a queue takes datagrams only"
        );
        let mut route = ServiceRoute::new(a("10.0.0.1:7100"));
        assert_eq!(hand_in(&net, &mut route), None, "nothing bound there");
        let first = net
            .serve(a("10.0.0.1:7100"), |_| Ok(Arc::new(Taker("first"))))
            .unwrap();
        assert_eq!(hand_in(&net, &mut route).as_deref(), Some("first"));
        assert_eq!(hand_in(&net, &mut route).as_deref(), Some("first"));
        // The server goes and another takes its address (a restart): the route finds the
        // new one, never the old.
        drop(first);
        assert_eq!(hand_in(&net, &mut route), None);
        let _second = net
            .serve(a("10.0.0.1:7100"), |_| Ok(Arc::new(Taker("second"))))
            .unwrap();
        assert_eq!(hand_in(&net, &mut route).as_deref(), Some("second"));
    }
}
