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

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};

/// Mode label of everything measured over a [`MemoryNet`].
pub const MEMORY_MODE: &str = "inproc-endpoints (one process; the UDP fabric's endpoints, \
drivers and framing over an in-memory datagram network; NIC cores, DMA and one-sided RDMA \
emulated)";

/// Datagrams a port's queue holds before new ones are dropped: about what a 4 MiB socket
/// buffer holds of 1472-byte datagrams.
pub const PORT_QUEUE: usize = 4096;

/// First port given to a socket bound to port 0 (the IANA dynamic range).
const EPHEMERAL_FIRST: u16 = 49152;

type Datagram = (SocketAddr, Bytes);

#[derive(Default)]
struct Ports {
    bound: HashMap<SocketAddr, Sender<Datagram>>,
    next_ephemeral: u16,
}

/// An in-process datagram network (see the module documentation). Clones share the network.
#[derive(Clone, Default)]
pub struct MemoryNet {
    ports: Arc<Mutex<Ports>>,
}

impl std::fmt::Debug for MemoryNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bound = self.lock().bound.len();
        f.debug_struct("MemoryNet").field("bound", &bound).finish()
    }
}

/// A bound port: its address and its queue. Dropping it closes the port.
pub(crate) struct MemoryPort {
    addr: SocketAddr,
    queue: Receiver<Datagram>,
    net: MemoryNet,
}

impl MemoryNet {
    /// An empty network.
    pub fn new() -> MemoryNet {
        MemoryNet::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ports> {
        // The map stays consistent under any panic (every change is one insert or remove).
        self.ports.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Binds `addr`. An unspecified IP (`0.0.0.0`, `::`) binds the loopback address of its
    /// family, port 0 the next free port of the dynamic range; a bound address is refused.
    pub(crate) fn bind(&self, addr: SocketAddr) -> io::Result<MemoryPort> {
        let ip = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let mut ports = self.lock();
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
        let (tx, rx) = bounded(PORT_QUEUE);
        ports.bound.insert(addr, tx);
        Ok(MemoryPort {
            addr,
            queue: rx,
            net: self.clone(),
        })
    }

    /// Delivers `datagram` from `from` to `to`'s queue; false when nobody has bound `to` or
    /// its queue is full (the datagram is dropped, as UDP drops it).
    pub(crate) fn send(&self, from: SocketAddr, to: SocketAddr, datagram: Bytes) -> bool {
        let Some(port) = self.lock().bound.get(&to).cloned() else {
            return false;
        };
        match port.try_send((from, datagram)) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
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

    /// Waits up to `timeout` for a datagram, then takes up to `max` in all without waiting.
    pub(crate) fn recv(&self, timeout: Duration, max: usize) -> Vec<Datagram> {
        let mut out = Vec::new();
        match self.queue.recv_timeout(timeout) {
            Ok(d) => out.push(d),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return out,
        }
        while out.len() < max {
            match self.queue.try_recv() {
                Ok(d) => out.push(d),
                Err(_) => break,
            }
        }
        out
    }
}

impl Drop for MemoryPort {
    fn drop(&mut self) {
        self.net.lock().bound.remove(&self.addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("literal address")
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
        let got = server.recv(Duration::from_millis(10), 8);
        assert_eq!(got, vec![(c1.addr(), Bytes::from_static(b"hi"))]);
        // Nobody at the address: dropped.
        assert!(!net.send(c1.addr(), a("10.0.0.9:1"), Bytes::from_static(b"x")));
        // A closed port drops, and its address can be bound again.
        drop(server);
        assert!(!net.send(c1.addr(), a("10.0.0.1:7000"), Bytes::from_static(b"x")));
        let again = net.bind(a("10.0.0.1:7000")).unwrap();
        assert!(again.recv(Duration::from_millis(1), 8).is_empty());
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
            let got = port.recv(Duration::from_millis(1), 1000);
            if got.is_empty() {
                break;
            }
            taken += got.len();
        }
        assert_eq!(taken, PORT_QUEUE);
    }
}
