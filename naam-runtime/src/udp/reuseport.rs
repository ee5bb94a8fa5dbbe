//! Several sockets on one address, one per receive loop (`SO_REUSEPORT`), and the kernel
//! filter that hands each datagram to its session's loop: a classic BPF program on the group
//! reads the route byte of the fragment header ([`naam_proto::frame::ROUTE`]) and picks the
//! socket `route % loops`; for route 0 (handshakes) it declines, and the kernel picks by its
//! hash of the addresses, so one client's handshake stays on one loop
//! ([`naam_proto::shard`]). Nothing is trusted on the route: a wrong one only reaches a loop
//! that does not know the session and drops the datagram.
//!
//! `SO_REUSEPORT` would let a second server of the same user join the group and take a share
//! of the traffic; so the address is first bound alone, which fails while anything holds it,
//! and the group is made on it right after (a window of a few microseconds).

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use naam_proto::limits::MAX_LOOPS;

use super::socket::{sockaddr, Socket};

/// The receive loops a driver runs when none are configured: one per core this process may
/// run on, at most [`MAX_LOOPS`] (naam-server's and naam-nic's default, and the in-process
/// deployment's).
pub fn default_receive_loops() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_LOOPS)
}

/// Binds `loops` sockets to `addr` in one `SO_REUSEPORT` group with the route filter, in
/// loop order (socket `i` takes the sessions of [`naam_proto::shard::Shard`] `i`); `addr`
/// with port 0 takes a free port for all of them. One loop binds one plain socket.
pub fn bind_group(addr: SocketAddr, datagram: usize, loops: usize) -> io::Result<Vec<Socket>> {
    if loops == 0 || loops > MAX_LOOPS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{loops} receive loops: between 1 and {MAX_LOOPS}"),
        ));
    }
    if loops == 1 {
        return Ok(vec![Socket::bind(addr, datagram)?]);
    }
    // Bound alone first: an address in use (another server's group included) fails here,
    // as a single socket's bind would.
    let bound = UdpSocket::bind(addr)?.local_addr()?;
    let mut socks = vec![reuseport_socket(bound)?];
    for _ in 1..loops {
        socks.push(reuseport_socket(bound)?);
    }
    attach_route_filter(&socks[0], loops)?;
    Ok(socks
        .into_iter()
        .map(|s| Socket::from_socket(s, datagram))
        .collect())
}

/// A UDP socket with `SO_REUSEPORT`, bound to `addr`.
fn reuseport_socket(addr: SocketAddr) -> io::Result<UdpSocket> {
    let family = match addr {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: a plain socket(2) call; the descriptor is owned at once.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    set_option(&fd, libc::SO_REUSEPORT, &one)?;
    let (storage, len) = sockaddr(&addr);
    // SAFETY: `storage` holds a valid address of `len` bytes for the socket's family.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&storage as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UdpSocket::from(fd))
}

fn set_option<T>(fd: &impl AsRawFd, option: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a live `T` of the size passed.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The route filter for a group of `loops` sockets, as classic BPF over the UDP payload: the
/// route byte, 0 → decline (an index past the group: the kernel's hash decides), else
/// `route % loops`.
pub(crate) fn route_filter(loops: usize) -> [libc::sock_filter; 5] {
    const LD_B_ABS: u16 = (libc::BPF_LD | libc::BPF_B | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const MOD_K: u16 = (libc::BPF_ALU | libc::BPF_MOD | libc::BPF_K) as u16;
    const RET_A: u16 = (libc::BPF_RET | libc::BPF_A) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let insn = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    [
        insn(LD_B_ABS, 0, 0, naam_proto::frame::ROUTE as u32),
        // Route 0: jump over the next two to the decline.
        insn(JEQ_K, 2, 0, 0),
        insn(MOD_K, 0, 0, loops as u32),
        insn(RET_A, 0, 0, 0),
        insn(RET_K, 0, 0, u32::MAX),
    ]
}

/// Attaches [`route_filter`] to the group `sock` belongs to.
fn attach_route_filter(sock: &UdpSocket, loops: usize) -> io::Result<()> {
    let mut filter = route_filter(loops);
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    set_option(sock, libc::SO_ATTACH_REUSEPORT_CBPF, &prog)
}

#[cfg(test)]
mod tests {
    use super::*;
    use naam_proto::frame::{pieces, HEADER};
    use std::time::Duration;

    /// What the kernel's classic BPF interpreter computes for these five instructions, for
    /// a payload whose route byte is `route`.
    fn run(filter: &[libc::sock_filter; 5], route: u8) -> u32 {
        assert_eq!(filter[0].k as usize, naam_proto::frame::ROUTE);
        if route as u32 == filter[1].k {
            return filter[4].k;
        }
        route as u32 % filter[2].k
    }

    #[test]
    fn the_filter_sends_each_route_to_its_loop_and_declines_none() {
        for loops in [2usize, 3, 8] {
            let f = route_filter(loops);
            assert_eq!(run(&f, 0), u32::MAX);
            for route in 1..=255u8 {
                let want = naam_proto::shard::loop_of_route(route, loops).unwrap();
                assert_eq!(run(&f, route) as usize, want);
            }
        }
    }

    #[test]
    fn the_kernel_delivers_each_route_to_its_loop() {
        let loops = 3;
        let mut group = bind_group("127.0.0.1:0".parse().unwrap(), 1472, loops).unwrap();
        let to = group[0].local_addr().unwrap();
        assert!(group.iter().all(|s| s.local_addr().unwrap() == to));
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        for route in 1..=30u8 {
            let p = pieces(route as u64, 4, 1472, route)
                .unwrap()
                .next()
                .unwrap();
            let mut d = p.header.to_vec();
            d.extend_from_slice(b"ping");
            assert_eq!(d.len(), HEADER + 4);
            tx.send_to(&d, to).unwrap();
        }
        for (i, s) in group.iter_mut().enumerate() {
            let mut got = Vec::new();
            while got.len() < 10 {
                let batch = s.recv(Duration::from_millis(500)).unwrap();
                if batch.is_empty() {
                    break;
                }
                got.extend(batch.into_iter().map(|(_, m)| m));
            }
            assert_eq!(got.len(), 10, "loop {i} took its ten routes");
        }
    }

    #[test]
    fn an_address_in_use_is_refused_not_shared() {
        let group = bind_group("127.0.0.1:0".parse().unwrap(), 1472, 2).unwrap();
        let taken = group[0].local_addr().unwrap();
        let refused = |a: SocketAddr| bind_group(a, 1472, 2).err().map(|e| e.kind());
        assert_eq!(refused(taken), Some(io::ErrorKind::AddrInUse));
        let plain = UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(
            refused(plain.local_addr().unwrap()),
            Some(io::ErrorKind::AddrInUse)
        );
    }

    #[test]
    fn bad_loop_counts_are_refused() {
        let a: SocketAddr = "127.0.0.1:0".parse().unwrap();
        for loops in [0, MAX_LOOPS + 1] {
            let e = bind_group(a, 1472, loops).err().map(|e| e.kind());
            assert_eq!(e, Some(io::ErrorKind::InvalidInput));
        }
    }
}
