//! The thin IO layer of the UDP fabric: a socket that sends whole messages as fragments in one
//! `sendmmsg` and receives datagrams in batches with `recvmmsg`, reassembling them into messages.
//! A socket bound in a [`MemoryNet`] moves the same fragments through memory instead of the
//! kernel; nothing above the datagram differs.

use std::io;
use std::mem::MaybeUninit;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

use bytes::Bytes;

use naam_proto::arena::ByteArena;
use naam_proto::endpoint::Transmit;
use naam_proto::frame::{fragment_routed_in, Fragment, Fragments, Pushed, Reassembler};
use naam_proto::limits::MAX_MESSAGE;
use naam_proto::Nanos;
use std::cell::RefCell;

use super::memnet::{MemoryNet, MemoryPort};

/// Datagrams one `recvmmsg` call takes at most.
pub const RECV_BATCH: usize = 32;
/// Largest datagram accepted (a jumbo frame's payload).
pub const MAX_DATAGRAM: usize = 9000;
/// Default datagram size: fits a 1500-byte Ethernet MTU with IPv4 and UDP headers.
pub const DEFAULT_DATAGRAM: usize = 1472;
/// Datagram size on loopback, whose MTU is 64 KiB: a jumbo frame's payload, so that a
/// session's coalesced messages travel several to a datagram.
pub const LOOPBACK_DATAGRAM: usize = 8972;

/// The datagram size for a path to or from `addr` when none is configured: loopback's, or
/// one that fits Ethernet.
pub fn datagram_for(addr: SocketAddr) -> usize {
    if addr.ip().is_loopback() {
        LOOPBACK_DATAGRAM
    } else {
        DEFAULT_DATAGRAM
    }
}

pub(super) fn sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match ss.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: &libc::sockaddr_in = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let s: &libc::sockaddr_in6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                s.sin6_addr.s6_addr.into(),
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Counters of one socket.
#[derive(Clone, Copy, Debug, Default)]
pub struct SocketStats {
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams received.
    pub received: u64,
    /// Datagrams that were not NAAM fragments or were inconsistent.
    pub malformed: u64,
    /// Fragments dropped because reassembly memory was full.
    pub dropped: u64,
    /// `sendmmsg` errors (peer unreachable, buffer full).
    pub send_errors: u64,
    /// Datagrams dropped on purpose by the loss injector.
    pub injected_losses: u64,
}

impl SocketStats {
    /// The counters as `(name, help, value)`, for metrics.
    pub fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            ("datagrams_sent", "Datagrams sent.", self.sent),
            ("datagrams_received", "Datagrams received.", self.received),
            (
                "datagrams_malformed",
                "Datagrams that were not NAAM fragments or were inconsistent.",
                self.malformed,
            ),
            (
                "fragments_dropped",
                "Fragments dropped because reassembly memory was full.",
                self.dropped,
            ),
            ("send_errors", "Sends the kernel refused.", self.send_errors),
            (
                "injected_losses",
                "Datagrams dropped on purpose by the loss injector.",
                self.injected_losses,
            ),
        ]
    }
}

/// Environment variable with a fraction of received datagrams to drop (`0.01` = 1%): loss
/// injection for tests on kernels without `sch_netem` (where `tc netem` cannot run). The
/// binaries read it ([`injected_loss_from_env`]) and give it to their sockets
/// ([`Socket::inject_loss`]); nothing below the binaries reads the environment.
pub const INJECT_LOSS_ENV: &str = "NAAM_INJECT_LOSS";

/// Parses a loss fraction: a number in (0, 1].
pub fn parse_loss(text: &str) -> Result<f64, String> {
    let p: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if p > 0.0 && p <= 1.0 {
        Ok(p)
    } else {
        Err(format!("{p} is not a fraction in (0, 1]"))
    }
}

/// The loss fraction [`INJECT_LOSS_ENV`] asks for: `None` when it is unset, an error naming
/// the variable when its value is not a fraction in (0, 1] (a typo must not silently mean "no
/// loss" in a fault-injection run).
pub fn injected_loss_from_env() -> Result<Option<f64>, String> {
    match std::env::var(INJECT_LOSS_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(format!("{INJECT_LOSS_ENV}: {e}")),
        Ok(v) => parse_loss(&v)
            .map(Some)
            .map_err(|e| format!("{INJECT_LOSS_ENV}: {e}")),
    }
}

/// Drops a fraction of datagrams (xorshift64; not for anything but fault injection).
#[derive(Debug, Clone, Copy)]
struct LossInjector {
    threshold: u64,
    state: u64,
}

impl LossInjector {
    fn new(p: f64) -> LossInjector {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        LossInjector {
            threshold: (p.clamp(0.0, 1.0) * u64::MAX as f64) as u64,
            state: seed,
        }
    }

    fn drop_next(&mut self) -> bool {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state <= self.threshold
    }
}

/// A datagram size within what the framing needs and what a jumbo frame carries.
fn clamp_datagram(datagram: usize) -> usize {
    datagram.clamp(naam_proto::frame::MIN_DATAGRAM, MAX_DATAGRAM)
}

/// Where a socket's datagrams go.
enum Link {
    /// The kernel's UDP.
    Kernel(UdpSocket),
    /// A port of an in-process [`MemoryNet`].
    Memory(MemoryPort),
}

/// A UDP socket carrying NAAM messages.
pub struct Socket {
    link: Link,
    datagram: usize,
    bufs: Option<Box<RecvBuffers>>,
    inbound: Inbound,
    /// Where datagrams from the kernel are copied: a chunk is written again once the
    /// messages cut from it are dropped, with no allocation per datagram (a message kept for
    /// long keeps its chunk: [`ByteArena`]).
    arena: ByteArena,
    /// The datagrams of one receive, before they are taken in (kept for its capacity).
    raw: Vec<(SocketAddr, Bytes)>,
}

/// What a receiver does with each datagram: loss injection, fragment decoding, reassembly, and
/// the counters of all three. A [`Socket`] has one, and so does a service bound in a
/// [`MemoryNet`], which takes its datagrams without a socket. A socket keeps its send counters
/// in the same [`SocketStats`], so that one copy describes the whole socket.
pub(crate) struct Inbound {
    reassembler: Reassembler<SocketAddr>,
    stats: SocketStats,
    epoch: std::time::Instant,
    loss: Option<LossInjector>,
}

impl Inbound {
    pub(crate) fn new() -> Inbound {
        Inbound {
            reassembler: Reassembler::new(4096, 16 << 20, 200_000_000),
            stats: SocketStats::default(),
            epoch: std::time::Instant::now(),
            loss: None,
        }
    }

    /// The message `datagram` from `peer` completes, if it completes one.
    pub(crate) fn take(&mut self, peer: SocketAddr, datagram: Bytes) -> Option<Bytes> {
        self.stats.received += 1;
        if self.loss.as_mut().is_some_and(LossInjector::drop_next) {
            self.stats.injected_losses += 1;
            return None;
        }
        let f = match Fragment::decode(datagram) {
            Ok(f) => f,
            Err(_) => {
                self.stats.malformed += 1;
                return None;
            }
        };
        // A message in one datagram completes at once: only fragments need the time.
        let now = if f.count == 1 {
            0
        } else {
            self.epoch.elapsed().as_nanos() as u64
        };
        match self.reassembler.push(peer, f, now) {
            Pushed::Complete(m) => Some(m),
            Pushed::Pending | Pushed::Duplicate => None,
            Pushed::Conflict => {
                self.stats.malformed += 1;
                None
            }
            Pushed::Full => {
                self.stats.dropped += 1;
                None
            }
        }
    }

    /// Forgets messages whose fragments stopped coming.
    pub(crate) fn expire(&mut self) {
        if self.reassembler.pending() > 0 {
            self.reassembler
                .expire(self.epoch.elapsed().as_nanos() as u64);
        }
    }
}

impl Socket {
    /// Binds `addr`; messages go out in datagrams of at most `datagram` bytes.
    pub fn bind(addr: SocketAddr, datagram: usize) -> io::Result<Socket> {
        let sock = UdpSocket::bind(addr)?;
        Ok(Self::from_socket(sock, datagram))
    }

    /// Wraps a bound socket.
    pub fn from_socket(sock: UdpSocket, datagram: usize) -> Socket {
        // Bigger kernel buffers absorb bursts of many clients (best effort: capped by sysctl).
        let size: libc::c_int = 4 << 20;
        for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
            // SAFETY: a valid socket, option and int-sized value.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
        Socket::new(Link::Kernel(sock), datagram)
    }

    /// Binds `addr` in the in-process network `net` (an unspecified IP binds its family's
    /// loopback address, port 0 a free dynamic port).
    pub fn bind_memory(net: &MemoryNet, addr: SocketAddr, datagram: usize) -> io::Result<Socket> {
        Ok(Socket::new(Link::Memory(net.bind(addr)?), datagram))
    }

    fn new(link: Link, datagram: usize) -> Socket {
        // Only the kernel's recvmmsg writes into buffers of ours.
        let bufs = match link {
            Link::Kernel(_) => Some(Box::new(RecvBuffers::new())),
            Link::Memory(_) => None,
        };
        Socket {
            link,
            datagram: clamp_datagram(datagram),
            bufs,
            inbound: Inbound::new(),
            arena: ByteArena::default(),
            raw: Vec::new(),
        }
    }

    /// Whether this socket is a port of an in-process [`MemoryNet`], not a kernel socket.
    pub fn in_memory(&self) -> bool {
        matches!(self.link, Link::Memory(_))
    }

    /// Drops this fraction of received datagrams from now on (`None`: none), for fault
    /// injection where the kernel has no `netem`; counted in `injected_losses`.
    pub fn inject_loss(&mut self, fraction: Option<f64>) {
        self.inbound.loss = fraction.filter(|&p| p > 0.0).map(LossInjector::new);
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match &self.link {
            Link::Kernel(sock) => sock.local_addr(),
            Link::Memory(port) => Ok(port.addr()),
        }
    }

    /// A handle that can send from other threads (executors send their replies directly).
    pub fn sender(&self) -> io::Result<Sender> {
        let link = match &self.link {
            Link::Kernel(sock) => SendLink::Kernel(sock.try_clone()?),
            Link::Memory(port) => SendLink::Memory {
                net: port.net().clone(),
                from: port.addr(),
            },
        };
        Ok(Sender {
            link,
            datagram: self.datagram,
        })
    }

    /// The largest datagram it sends.
    pub fn datagram(&self) -> usize {
        self.datagram
    }

    /// A copy of this socket's datagram counters, counted since it was created.
    pub fn stats(&self) -> SocketStats {
        self.inbound.stats
    }

    /// Sends `message` (id `id`) to `peer`, fragmented, in one system call.
    pub fn send(&mut self, peer: SocketAddr, id: u64, message: &[u8]) -> io::Result<()> {
        let route = naam_proto::shard::route_of(message);
        self.send_routed(peer, id, route, message)
    }

    /// Sends what an endpoint asked for: the datagram it framed, or [`Socket::send`] with
    /// the transmit's route. Taken by value: in memory, its datagram is handed on as it is.
    pub fn send_transmit(&mut self, t: Transmit) -> io::Result<()> {
        let r = self.outlet().send_transmit(self.datagram, t);
        self.count_sent(r)
    }

    fn send_routed(
        &mut self,
        peer: SocketAddr,
        id: u64,
        route: u8,
        message: &[u8],
    ) -> io::Result<()> {
        let r = self.outlet().send(self.datagram, peer, id, route, message);
        self.count_sent(r)
    }

    /// Where this socket's sends go.
    fn outlet(&self) -> Outlet<'_> {
        match &self.link {
            Link::Kernel(sock) => Outlet::Kernel(sock),
            Link::Memory(port) => Outlet::Memory {
                net: port.net(),
                from: port.addr(),
            },
        }
    }

    /// Counts a send's datagrams, or its failure.
    fn count_sent(&mut self, r: io::Result<usize>) -> io::Result<()> {
        match &r {
            Ok(n) => self.inbound.stats.sent += *n as u64,
            Err(_) => self.inbound.stats.send_errors += 1,
        }
        r.map(|_| ())
    }

    /// Sends every transmit of `batch`, fragmented, in as few system calls as the kernel
    /// allows (one `sendmmsg` for a whole loop's answers), and leaves `batch` empty with its
    /// capacity; returns how many messages could not be sent (each is counted in
    /// `send_errors`).
    pub fn send_batch(&mut self, batch: &mut Vec<Transmit>) -> usize {
        let failed = match &self.link {
            Link::Kernel(sock) => {
                let (sent, failed) = send_messages(sock, self.datagram, batch);
                batch.clear();
                self.inbound.stats.sent += sent as u64;
                failed
            }
            Link::Memory(port) => {
                let outlet = Outlet::Memory {
                    net: port.net(),
                    from: port.addr(),
                };
                let mut failed = 0;
                for t in batch.drain(..) {
                    match outlet.send_transmit(self.datagram, t) {
                        Ok(n) => self.inbound.stats.sent += n as u64,
                        Err(_) => failed += 1,
                    }
                }
                failed
            }
        };
        self.inbound.stats.send_errors += failed as u64;
        failed
    }

    /// Waits up to `timeout` for datagrams and returns the messages they complete, with their
    /// senders. Foreign or inconsistent datagrams are counted and dropped.
    pub fn recv(&mut self, timeout: Duration) -> io::Result<Vec<(SocketAddr, Bytes)>> {
        let mut out = Vec::new();
        self.recv_into(Duration::ZERO, timeout, &mut out)?;
        Ok(out)
    }

    /// The datagrams already waiting, without blocking (the messages they complete).
    pub fn try_recv(&mut self) -> io::Result<Vec<(SocketAddr, Bytes)>> {
        let mut out = Vec::new();
        self.try_recv_into(&mut out)?;
        Ok(out)
    }

    /// [`Socket::try_recv`], the messages appended to `out` (a driver's, reused).
    pub fn try_recv_into(&mut self, out: &mut Vec<(SocketAddr, Bytes)>) -> io::Result<()> {
        self.receive(None, out)
    }

    /// [`Socket::recv`], polling the socket without sleeping for up to `spin` first: a peer
    /// that answers within `spin` finds this thread awake, so neither side pays the kernel's
    /// wake-up (in a VM, the dearest part of a loopback round trip). Then it blocks for the
    /// rest of `timeout`.
    pub fn recv_polling(
        &mut self,
        spin: Duration,
        timeout: Duration,
    ) -> io::Result<Vec<(SocketAddr, Bytes)>> {
        let mut out = Vec::new();
        self.recv_into(spin, timeout, &mut out)?;
        Ok(out)
    }

    /// [`Socket::recv_polling`], the messages appended to `out` (a driver's, reused).
    pub fn recv_into(
        &mut self,
        spin: Duration,
        timeout: Duration,
        out: &mut Vec<(SocketAddr, Bytes)>,
    ) -> io::Result<()> {
        self.receive(Some((spin, timeout.max(Duration::from_micros(1)))), out)
    }

    /// Receives what is waiting or, with `wait` = (spin, timeout), what comes within it
    /// ([`Socket::recv_polling`]), and appends the messages it completes to `out`.
    fn receive(
        &mut self,
        wait: Option<(Duration, Duration)>,
        out: &mut Vec<(SocketAddr, Bytes)>,
    ) -> io::Result<()> {
        let mut raw = std::mem::take(&mut self.raw);
        match (&self.link, &mut self.bufs) {
            (Link::Kernel(sock), Some(b)) => {
                let mut take =
                    |raw: &mut Vec<_>| b.recv_into(sock, libc::MSG_DONTWAIT, &mut self.arena, raw);
                match wait {
                    None => take(&mut raw)?,
                    Some((spin, timeout)) => {
                        if !spin.is_zero() {
                            let start = std::time::Instant::now();
                            loop {
                                take(&mut raw)?;
                                if !raw.is_empty() || start.elapsed() >= spin {
                                    break;
                                }
                                // Another thread that can run (a client, an executor, on a
                                // machine with fewer cores than busy threads) gets the core
                                // meanwhile.
                                std::thread::yield_now();
                            }
                        }
                        if raw.is_empty() && wait_readable(sock, timeout.saturating_sub(spin))? {
                            take(&mut raw)?;
                        }
                    }
                }
            }
            (Link::Memory(port), _) => {
                let timeout = wait.map_or(Duration::ZERO, |(_, timeout)| timeout);
                port.recv_into(timeout, RECV_BATCH, &mut raw);
            }
            (Link::Kernel(_), None) => {}
        }
        self.take_in(&mut raw, out);
        self.raw = raw;
        Ok(())
    }

    /// Takes in the datagrams of `raw` (leaving it empty) and appends the messages they
    /// complete to `out`.
    fn take_in(&mut self, raw: &mut Vec<(SocketAddr, Bytes)>, out: &mut Vec<(SocketAddr, Bytes)>) {
        for (peer, d) in raw.drain(..) {
            if let Some(m) = self.inbound.take(peer, d) {
                out.push((peer, m));
            }
        }
        self.inbound.expire();
    }
}

/// Adaptive polling for a driver loop: after serving, it polls its socket for a little while
/// before it sleeps, when datagrams have been coming back that soon (clients at depth 1 send
/// again within a round trip, and then neither side pays the kernel's wake-up); at lower rates
/// it sleeps at once, so an idle loop costs nothing.
///
/// A gap measured across a sleep includes the loop's own wake-up, so a loop that sleeps
/// measures gaps longer than they are, and once the measured gap passes the window it would
/// sleep for good even where datagrams come well within it (a wake-up of 40 µs and peers
/// answering in 15 µs do that to a 50 µs window). So while it sleeps it now and then polls the
/// whole window anyway (a probe): a datagram caught awake gives the true gap; a probe that
/// catches nothing makes the next one twice as rare (up to [`Poller::MAX_PROBE_EVERY`]
/// sleeps), so a loop whose peers really are slow spends a vanishing share of its time
/// probing.
/// (The simulator's loops and clients poll with it too, on its virtual clock.)
#[derive(Clone, Debug)]
pub struct Poller {
    /// When the loop last finished serving (or sending), on the loop's clock.
    served_at: Option<Nanos>,
    /// Smoothed time from finishing to the next datagram, nanoseconds.
    gap_ns: f64,
    /// The most it polls before it sleeps.
    max_spin: Duration,
    /// `max_spin` in nanoseconds, as the gap is kept (converted once: a `u128` to `f64` is a
    /// library call, and this is read on every receive).
    max_spin_ns: f64,
    /// Sleeps between two probes, now.
    probe_every: u32,
    /// Sleeps since the last probe.
    slept: u32,
    /// The receive after the last [`Poller::served`] is a probe.
    probing: bool,
}

impl Poller {
    /// Sleeps between probes after a probe that caught a datagram (or at the start).
    pub const FIRST_PROBE_EVERY: u32 = 8;
    /// The most sleeps between two probes.
    pub const MAX_PROBE_EVERY: u32 = 1024;

    /// A poller that polls at most `max_spin` at a time.
    pub fn new(max_spin: Duration) -> Poller {
        Poller {
            served_at: None,
            gap_ns: 0.0,
            max_spin,
            max_spin_ns: max_spin.as_nanos() as f64,
            probe_every: Self::FIRST_PROBE_EVERY,
            slept: 0,
            probing: false,
        }
    }

    /// How long to poll before sleeping now: three times the usual gap, when that is short
    /// (the whole window, on a probe).
    pub fn spin(&self) -> Duration {
        if self.served_at.is_none() {
            return Duration::ZERO;
        }
        if self.probing {
            return self.max_spin;
        }
        if self.gap_ns >= self.max_spin_ns {
            return Duration::ZERO;
        }
        Duration::from_nanos((3.0 * self.gap_ns) as u64 + 5_000).min(self.max_spin)
    }

    /// A receive that waited (polling, then asleep) returned at `now`; `got`: with
    /// datagrams. (A receive that only looked at what was already there says nothing about
    /// gaps: do not report it.)
    pub fn arrived(&mut self, now: Nanos, got: bool) {
        let Some(at) = self.served_at.take() else {
            return;
        };
        let gap = now.saturating_sub(at) as f64;
        if std::mem::take(&mut self.probing) {
            if got && gap <= self.max_spin_ns {
                // Caught awake: the gap as it is, with no wake-up in it.
                self.probe_every = Self::FIRST_PROBE_EVERY;
                self.gap_ns = 0.75 * self.gap_ns + 0.25 * gap;
            } else {
                self.probe_every = (self.probe_every * 2).min(Self::MAX_PROBE_EVERY);
            }
            return;
        }
        // A receive that came back empty waited the whole time: the gap is at least that.
        let gap = if got {
            gap
        } else {
            gap.max(2.0 * self.max_spin_ns)
        };
        self.gap_ns = 0.75 * self.gap_ns + 0.25 * gap;
    }

    /// The loop finished serving what it received, at `now`.
    pub fn served(&mut self, now: Nanos) {
        self.served_at = Some(now);
        // It is about to sleep at once: count the sleep, and probe when one is due.
        if !self.probing && self.gap_ns >= self.max_spin_ns {
            self.slept += 1;
            if self.slept >= self.probe_every {
                self.slept = 0;
                self.probing = true;
            }
        }
    }
}

/// Where a [`Sender`]'s datagrams go.
enum SendLink {
    Kernel(UdpSocket),
    Memory { net: MemoryNet, from: SocketAddr },
}

/// A cloned socket handle that sends messages.
pub struct Sender {
    link: SendLink,
    datagram: usize,
}

impl Sender {
    /// A sender from `from` in `net` (a service bound there sends with one), in datagrams of at
    /// most `datagram` bytes.
    pub(crate) fn memory(net: &MemoryNet, from: SocketAddr, datagram: usize) -> Sender {
        Sender {
            link: SendLink::Memory {
                net: net.clone(),
                from,
            },
            datagram: clamp_datagram(datagram),
        }
    }

    /// The most bytes one of its datagrams carries.
    pub fn datagram(&self) -> usize {
        self.datagram
    }

    /// Sends `message` (id `id`) to `peer`, fragmented, in one system call.
    pub fn send(&self, peer: SocketAddr, id: u64, message: &[u8]) -> io::Result<()> {
        self.send_routed(peer, id, naam_proto::shard::route_of(message), message)
    }

    /// Sends what an endpoint asked for: the datagram it framed, or [`Sender::send`] with
    /// the transmit's route (see [`Socket::send_transmit`]).
    pub fn send_transmit(&self, t: Transmit) -> io::Result<()> {
        self.outlet().send_transmit(self.datagram, t).map(|_| ())
    }

    fn send_routed(&self, peer: SocketAddr, id: u64, route: u8, message: &[u8]) -> io::Result<()> {
        self.outlet()
            .send(self.datagram, peer, id, route, message)
            .map(|_| ())
    }

    /// Where this handle's sends go.
    fn outlet(&self) -> Outlet<'_> {
        match &self.link {
            SendLink::Kernel(sock) => Outlet::Kernel(sock),
            SendLink::Memory { net, from } => Outlet::Memory { net, from: *from },
        }
    }
}

thread_local! {
    /// Where this thread writes the fragments it sends. The kernel is done with them when
    /// the send returns, and a receiver in memory soon after, so the same chunk is written
    /// again rather than a buffer allocated per datagram.
    static FRAGMENTS: RefCell<ByteArena> = RefCell::new(ByteArena::default());
}

/// Where one send's fragments go, borrowed from a [`Socket`] or a [`Sender`].
#[derive(Clone, Copy)]
enum Outlet<'a> {
    Kernel(&'a UdpSocket),
    Memory {
        net: &'a MemoryNet,
        from: SocketAddr,
    },
}

impl Outlet<'_> {
    /// Sends `message` (id `id`) to `peer` in fragments of at most `datagram` bytes, each
    /// carrying `route`; returns how many went out (one in-memory datagram nobody receives is
    /// dropped silently, as UDP drops it).
    fn send(
        self,
        datagram: usize,
        peer: SocketAddr,
        id: u64,
        route: u8,
        message: &[u8],
    ) -> io::Result<usize> {
        if message.len() > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("message of {} bytes over {MAX_MESSAGE}", message.len()),
            ));
        }
        // Made before anything is sent: a delivery in memory may send again from this
        // thread, into the same arena.
        let frags = FRAGMENTS
            .with(|a| fragment_routed_in(&mut a.borrow_mut(), id, message, datagram, route))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        self.send_datagrams(peer, frags)
    }

    /// Sends what an endpoint asked for: the one datagram it framed, when that fits
    /// `datagram` bytes ([`Transmit::framed`]), else its bytes in fragments.
    fn send_transmit(self, datagram: usize, t: Transmit) -> io::Result<usize> {
        let to = t.to;
        match t.into_framed(datagram) {
            // Moved on, not cloned: no reference count taken and given back per send.
            Ok(d) => self.send_datagrams(to, Fragments::from_buf([d])),
            Err(t) => self.send(datagram, t.to, t.id, t.frame_route(), t.bytes()),
        }
    }

    /// Sends `frags` to `peer` as they are; returns how many went out.
    fn send_datagrams(self, peer: SocketAddr, frags: Fragments) -> io::Result<usize> {
        match self {
            Outlet::Kernel(sock) => send_fragments(sock, peer, &frags),
            Outlet::Memory { net, from } => {
                let n = frags.len();
                for f in frags {
                    net.send(from, peer, f);
                }
                Ok(n)
            }
        }
    }
}

/// One datagram's header for `sendmmsg` / `recvmmsg`: the peer address and one buffer. The
/// pointers must outlive the system call.
fn mmsghdr(
    name: *mut libc::sockaddr_storage,
    namelen: libc::socklen_t,
    iov: &mut libc::iovec,
) -> libc::mmsghdr {
    // SAFETY: all-zero is a valid msghdr.
    let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
    h.msg_name = name.cast();
    h.msg_namelen = namelen;
    h.msg_iov = iov;
    h.msg_iovlen = 1;
    libc::mmsghdr {
        msg_hdr: h,
        msg_len: 0,
    }
}

/// Sends `frags` to `peer` in as few `sendmmsg` calls as the kernel allows.
fn send_fragments(sock: &UdpSocket, peer: SocketAddr, frags: &[Bytes]) -> io::Result<usize> {
    let (mut ss, sslen) = sockaddr(&peer);
    let mut iovs: Vec<libc::iovec> = frags
        .iter()
        .map(|f| libc::iovec {
            iov_base: f.as_ptr() as *mut libc::c_void,
            iov_len: f.len(),
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .map(|iov| mmsghdr(&mut ss, sslen, iov))
        .collect();
    let mut sent = 0;
    while sent < msgs.len() {
        // SAFETY: `msgs[sent..]` are valid headers pointing at live buffers.
        let n = unsafe {
            libc::sendmmsg(
                sock.as_raw_fd(),
                msgs[sent..].as_mut_ptr(),
                (msgs.len() - sent) as libc::c_uint,
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(sent)
}

/// Sends `batch` in datagrams of at most `datagram` bytes: each
/// fragment is its header and a slice of its message, gathered by the kernel (nothing is
/// copied), and every fragment of the batch goes out in as few `sendmmsg` calls as it takes.
/// Returns the datagrams sent and the messages that could not be (too large, or refused by
/// the kernel).
fn send_messages(sock: &UdpSocket, datagram: usize, batch: &[Transmit]) -> (usize, usize) {
    let mut failed = 0;
    let mut addrs: Vec<(libc::sockaddr_storage, libc::socklen_t)> = Vec::new();
    // Per fragment: its message's index in `batch`, its header and its range.
    let mut frags: Vec<(usize, naam_proto::frame::Piece)> = Vec::new();
    for (m, t) in batch.iter().enumerate() {
        match naam_proto::frame::pieces(t.id, t.bytes().len(), datagram, t.frame_route()) {
            Ok(pieces) => frags.extend(pieces.map(|p| (m, p))),
            Err(_) => failed += 1,
        }
        addrs.push(sockaddr(&t.to));
    }
    let mut iovs: Vec<[libc::iovec; 2]> = frags
        .iter()
        .map(|(m, p)| {
            let bytes = batch[*m].bytes();
            [
                libc::iovec {
                    iov_base: p.header.as_ptr() as *mut libc::c_void,
                    iov_len: p.header.len(),
                },
                libc::iovec {
                    iov_base: bytes[p.range.clone()].as_ptr() as *mut libc::c_void,
                    iov_len: p.range.len(),
                },
            ]
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .zip(&frags)
        .map(|(iov, (m, _))| {
            let (ss, len) = &mut addrs[*m];
            let mut h = mmsghdr(ss, *len, &mut iov[0]);
            h.msg_hdr.msg_iovlen = 2;
            h
        })
        .collect();
    let mut sent = 0;
    while sent < msgs.len() {
        // SAFETY: `msgs[sent..]` are valid headers pointing at live iovecs, headers, message
        // bytes and addresses, all borrowed for the call.
        let n = unsafe {
            libc::sendmmsg(
                sock.as_raw_fd(),
                msgs[sent..].as_mut_ptr(),
                (msgs.len() - sent).min(1024) as libc::c_uint,
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // This datagram is refused (a peer unreachable, a full buffer): count its
            // message as failed and go on with the rest.
            failed += 1;
            sent += 1;
            continue;
        }
        sent += n as usize;
    }
    (sent.saturating_sub(failed), failed)
}

/// Waits until `sock` has a datagram or `timeout` passes; `true` when it has one. `ppoll`'s
/// timer has the kernel's high resolution, where a socket's receive timeout is rounded up to
/// scheduler ticks (milliseconds): a retransmission due in 80 us must not wait 4 ms.
fn wait_readable(sock: &UdpSocket, timeout: Duration) -> io::Result<bool> {
    // The default timer slack lets a wake-up come 50 us late; a driver thread asks for 1 us,
    // once.
    thread_local! {
        static SLACK_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    SLACK_SET.with(|set| {
        if !set.get() {
            // SAFETY: PR_SET_TIMERSLACK takes a nanosecond count; it changes only this thread.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
            set.set(true);
        }
    });
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd and a valid timespec, both live for the call; no signal mask.
    let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(n > 0)
}

/// What one `recvmmsg` fills: [`RECV_BATCH`] datagram buffers with their address storage,
/// scatter entries and message headers, allocated and linked once per socket and reused by
/// every receive (a polling loop receives thousands of times a second, most of them empty).
pub(crate) struct RecvBuffers {
    bufs: Vec<[u8; MAX_DATAGRAM]>,
    addrs: Vec<MaybeUninit<libc::sockaddr_storage>>,
    iovs: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
    /// Headers the last receive filled: the kernel wrote their address lengths, which the
    /// next receive resets. The others are as [`RecvBuffers::new`] made them (the kernel
    /// reads scatter entries and never writes them).
    filled: usize,
}

// SAFETY: the raw pointers in `iovs` and `msgs` point into the heap buffers of the same
// struct (`bufs`, `addrs`, `iovs`), which are never reallocated or shared, so they stay valid
// wherever the struct moves.
unsafe impl Send for RecvBuffers {}

/// The size of the address storage each header names.
const ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;

impl RecvBuffers {
    fn new() -> RecvBuffers {
        let iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let mut b = RecvBuffers {
            bufs: vec![[0u8; MAX_DATAGRAM]; RECV_BATCH],
            addrs: vec![MaybeUninit::zeroed(); RECV_BATCH],
            iovs: vec![iov; RECV_BATCH],
            // SAFETY: all-zero is a valid mmsghdr.
            msgs: vec![unsafe { std::mem::zeroed() }; RECV_BATCH],
            filled: 0,
        };
        for i in 0..RECV_BATCH {
            b.iovs[i] = libc::iovec {
                iov_base: b.bufs[i].as_mut_ptr().cast(),
                iov_len: MAX_DATAGRAM,
            };
            b.msgs[i] = mmsghdr(b.addrs[i].as_mut_ptr(), ADDR_LEN, &mut b.iovs[i]);
        }
        b
    }

    /// One `recvmmsg` with `flags` (`MSG_DONTWAIT`: it does not block): each datagram
    /// received is copied into `arena` and appended to `out` with its sender.
    fn recv_into(
        &mut self,
        sock: &UdpSocket,
        flags: libc::c_int,
        arena: &mut ByteArena,
        out: &mut Vec<(SocketAddr, Bytes)>,
    ) -> io::Result<()> {
        let n = self.msgs.len();
        for m in &mut self.msgs[..self.filled] {
            m.msg_hdr.msg_namelen = ADDR_LEN;
            m.msg_len = 0;
        }
        self.filled = 0;
        // SAFETY: `msgs` are valid headers pointing at this struct's live buffers and address
        // storage (linked in `new`), which nothing else touches during the call.
        let got = unsafe {
            libc::recvmmsg(
                sock.as_raw_fd(),
                self.msgs.as_mut_ptr(),
                n as libc::c_uint,
                flags,
                std::ptr::null_mut(),
            )
        };
        if got < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock
                | io::ErrorKind::TimedOut
                | io::ErrorKind::Interrupted => Ok(()),
                // An ICMP error from an earlier send surfaces here on Linux; not this socket's
                // fault.
                io::ErrorKind::ConnectionRefused => Ok(()),
                _ => Err(e),
            };
        }
        self.filled = got as usize;
        let received = self.msgs.iter().zip(&self.addrs).zip(&self.bufs);
        for ((m, a), buf) in received.take(self.filled) {
            // SAFETY: the kernel filled the address of every returned message.
            let ss = unsafe { a.assume_init_ref() };
            if let Some(peer) = from_sockaddr(ss) {
                let len = (m.msg_len as usize).min(MAX_DATAGRAM);
                out.push((peer, arena.copy(&buf[..len])));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives `p` for `rounds` receives against peers whose next datagram comes `gap_ns`
    /// after the loop served, a sleeping loop seeing it `wake_ns` later; returns how many of
    /// the last `tail` receives polled, and how many receives were probes.
    fn drive_poller(
        p: &mut Poller,
        gap_ns: Nanos,
        wake_ns: Nanos,
        rounds: usize,
        tail: usize,
    ) -> (usize, usize) {
        let (mut now, mut polled, mut probes) = (0, 0, 0);
        for round in 0..rounds {
            p.served(now);
            let spin = p.spin().as_nanos() as Nanos;
            probes += usize::from(p.probing);
            let arrival = now + gap_ns;
            now = if spin >= gap_ns {
                arrival
            } else {
                arrival + wake_ns
            };
            if spin > 0 && round >= rounds - tail {
                polled += 1;
            }
            p.arrived(now, true);
            now += 5_000;
        }
        (polled, probes)
    }

    #[test]
    fn a_loop_that_measured_its_own_wake_ups_polls_again() {
        // Peers answer 15 us after the loop served; its wake-ups take 40 us, so every gap it
        // measures across a sleep is 55 us, past the 50 us window. One empty receive puts it
        // to sleep; without probes it would never poll again.
        let mut p = Poller::new(Duration::from_micros(50));
        p.served(0);
        p.arrived(1_000_000, false);
        let (polled, _) = drive_poller(&mut p, 15_000, 40_000, 400, 100);
        assert_eq!(polled, 100, "the loop went back to polling and stayed");
    }

    #[test]
    fn a_loop_with_slow_peers_probes_ever_more_rarely() {
        // Datagrams come 200 us apart: sleeping is right, and the probes back off.
        let mut p = Poller::new(Duration::from_micros(50));
        let (polled, probes) = drive_poller(&mut p, 200_000, 20_000, 20_000, 10_000);
        // 8, 16, ... 1,024 sleeps apart, then every 1,024th: 25 probes, 1.25 ms of polling
        // in 4 s.
        assert!(probes <= 30, "{probes} probes in 20,000 sleeps");
        assert!(polled <= 10, "{polled} of the last 10,000 receives polled");
    }

    #[test]
    fn loss_fractions_are_checked_and_a_full_loss_drops_everything() {
        assert_eq!(parse_loss("0.01"), Ok(0.01));
        assert_eq!(parse_loss(" 1 "), Ok(1.0));
        for bad in ["0", "-0.5", "1.5", "abc", "", "NaN"] {
            assert!(parse_loss(bad).is_err(), "{bad:?} accepted");
        }
        let mut a = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
        let mut b = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
        b.inject_loss(Some(1.0));
        let to = b.local_addr().unwrap();
        for id in 1..=5u64 {
            a.send(to, id, b"lost").unwrap();
        }
        let mut got = Vec::new();
        for _ in 0..20 {
            got.extend(b.recv(Duration::from_millis(5)).unwrap());
        }
        assert!(got.is_empty());
        assert_eq!(b.stats().injected_losses, 5);
        b.inject_loss(None);
        a.send(to, 6, b"kept").unwrap();
        for _ in 0..100 {
            got.extend(b.recv(Duration::from_millis(10)).unwrap());
            if !got.is_empty() {
                break;
            }
        }
        assert_eq!(got.len(), 1);
    }

    /// A transmit's route, when it has one, is what every fragment's header carries, sent
    /// alone, from a cloned sender or in a batch; without one, its bytes' own (0 for bytes
    /// that are not sealed).
    #[test]
    fn every_fragment_carries_the_transmit_s_route() {
        let mut a = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
        let raw = UdpSocket::bind("127.0.0.1:0").unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let to = raw.local_addr().unwrap();
        let t = |id: u64, len: usize, route: Option<u8>| {
            let mut t = Transmit::new(to, id, Bytes::from(vec![9u8; len]));
            t.route = route;
            t
        };
        a.send_transmit(t(1, 3000, Some(0x2b))).unwrap();
        a.sender()
            .unwrap()
            .send_transmit(t(2, 10, Some(7)))
            .unwrap();
        assert_eq!(
            a.send_batch(&mut vec![t(3, 2000, Some(5)), t(4, 10, None)]),
            0
        );
        // 3,000 bytes in three fragments, 10 in one, 2,000 in two, 10 in one.
        let mut routes: Vec<(u64, u8)> = Vec::new();
        let mut buf = [0u8; 2048];
        while routes.len() < 7 {
            let n = raw.recv(&mut buf).expect("every fragment arrives");
            let f = Fragment::decode(Bytes::copy_from_slice(&buf[..n])).expect("a fragment");
            routes.push((f.message, f.route));
        }
        routes.sort();
        let expected = [
            (1, 0x2b),
            (1, 0x2b),
            (1, 0x2b),
            (2, 7),
            (3, 5),
            (3, 5),
            (4, 0),
        ];
        assert_eq!(routes, expected);
    }

    /// Sends messages of every size from `a` to `b` and checks each arrives whole, once.
    fn every_size_crosses(mut a: Socket, mut b: Socket) {
        let to = b.local_addr().unwrap();
        for (id, len) in [
            (1u64, 0usize),
            (2, 10),
            (3, 576),
            (4, 5000),
            (5, MAX_MESSAGE),
        ] {
            let msg: Vec<u8> = (0..len).map(|i| (i * 7 + id as usize) as u8).collect();
            a.send(to, id, &msg).unwrap();
            let mut got = Vec::new();
            for _ in 0..100 {
                got.extend(b.recv(Duration::from_millis(10)).unwrap());
                if !got.is_empty() {
                    break;
                }
            }
            assert_eq!(got.len(), 1, "message {id}");
            assert_eq!(got[0].0, a.local_addr().unwrap());
            assert_eq!(&got[0].1[..], &msg[..]);
        }
        assert!(a.send(to, 9, &vec![0u8; MAX_MESSAGE + 1]).is_err());
        // A reply from another thread through a cloned sender.
        let sender = b.sender().unwrap();
        let back = a.local_addr().unwrap();
        std::thread::spawn(move || sender.send(back, 10, b"from a thread").unwrap())
            .join()
            .unwrap();
        let mut got = Vec::new();
        for _ in 0..100 {
            got.extend(a.recv(Duration::from_millis(10)).unwrap());
            if !got.is_empty() {
                break;
            }
        }
        assert_eq!(got, vec![(to, Bytes::from_static(b"from a thread"))]);
    }

    #[test]
    fn messages_of_every_size_cross_a_socket_pair() {
        every_size_crosses(
            Socket::bind("127.0.0.1:0".parse().unwrap(), 600).unwrap(),
            Socket::bind("127.0.0.1:0".parse().unwrap(), 600).unwrap(),
        );
    }

    /// The receive headers are linked once and reused: batches of different sizes (a full
    /// one among them) from two senders, with empty receives between them, each come back with
    /// the right sender, length and bytes.
    #[test]
    fn reused_receive_headers_report_each_batch_as_it_came() {
        let senders = [
            UdpSocket::bind("127.0.0.1:0").unwrap(),
            UdpSocket::bind("127.0.0.1:0").unwrap(),
        ];
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = rx.local_addr().unwrap();
        let mut bufs = RecvBuffers::new();
        let mut arena = ByteArena::default();
        for (count, from) in [(3usize, 0usize), (RECV_BATCH, 1), (1, 0), (5, 1)] {
            for i in 0..count {
                senders[from].send_to(&vec![i as u8; 10 + i], to).unwrap();
            }
            let mut got = Vec::new();
            for _ in 0..200 {
                bufs.recv_into(&rx, libc::MSG_DONTWAIT, &mut arena, &mut got)
                    .unwrap();
                if got.len() >= count {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let want = senders[from].local_addr().unwrap();
            assert_eq!(got.len(), count);
            for (i, (peer, bytes)) in got.iter().enumerate() {
                assert_eq!(*peer, want, "batch of {count}, datagram {i}");
                assert_eq!(&bytes[..], &vec![i as u8; 10 + i][..]);
            }
            let mut more = Vec::new();
            bufs.recv_into(&rx, libc::MSG_DONTWAIT, &mut arena, &mut more)
                .unwrap();
            assert!(more.is_empty());
        }
    }

    #[test]
    fn messages_of_every_size_cross_an_in_memory_pair() {
        let net = MemoryNet::new();
        every_size_crosses(
            Socket::bind_memory(&net, "0.0.0.0:0".parse().unwrap(), 600).unwrap(),
            Socket::bind_memory(&net, "10.1.0.1:7000".parse().unwrap(), 600).unwrap(),
        );
    }

    #[test]
    fn in_memory_sockets_lose_what_they_are_told_to() {
        let net = MemoryNet::new();
        let mut a = Socket::bind_memory(&net, "0.0.0.0:0".parse().unwrap(), 1472).unwrap();
        let mut b = Socket::bind_memory(&net, "0.0.0.0:0".parse().unwrap(), 1472).unwrap();
        b.inject_loss(Some(1.0));
        let to = b.local_addr().unwrap();
        for id in 1..=5u64 {
            a.send(to, id, b"lost").unwrap();
        }
        assert!(b.recv(Duration::from_millis(5)).unwrap().is_empty());
        assert_eq!(b.stats().injected_losses, 5);
        // A message to an address nobody bound is dropped without an error, as over UDP.
        a.send("10.9.9.9:1".parse().unwrap(), 6, b"nobody").unwrap();
    }

    #[test]
    fn foreign_datagrams_are_counted_and_dropped() {
        let raw = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut b = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
        raw.send_to(b"GET / HTTP/1.0\r\n", b.local_addr().unwrap())
            .unwrap();
        let mut seen = 0;
        for _ in 0..100 {
            assert!(b.recv(Duration::from_millis(5)).unwrap().is_empty());
            seen = b.stats().malformed;
            if seen > 0 {
                break;
            }
        }
        assert_eq!(seen, 1);
    }
}
