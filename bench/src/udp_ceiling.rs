//! `naam-bench experiment udp-ceiling`: what this machine's kernel UDP path allows, measured
//! with no NAAM code in it. A raw echo server (one thread: batched `recvmmsg`, one reply
//! datagram per request sent with one `sendmmsg` per batch) answers client threads that keep
//! `depth` requests in flight each, at the sizes a YCSB-B operation has (a small request, a
//! reply of about a kilobyte). Both sides poll a moment before they sleep, as NAAM's drivers
//! do, so the figure is the best the path gives at each point, and NAAM's over UDP can be read
//! against it ("at least 70% of the raw echo at the same sizes, threads and depth").

use std::io;
use std::mem::MaybeUninit;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;

/// How the ceiling is measured.
#[derive(Clone, Debug)]
pub struct CeilingConfig {
    /// Client thread counts to measure.
    pub threads: Vec<usize>,
    /// Requests in flight per client thread.
    pub depths: Vec<usize>,
    /// Bytes of each request datagram.
    pub request: usize,
    /// Bytes of each reply datagram.
    pub reply: usize,
    /// How long each point runs.
    pub seconds: f64,
}

impl Default for CeilingConfig {
    fn default() -> Self {
        CeilingConfig {
            threads: vec![1, 2, 4],
            depths: vec![1, 8, 32],
            // A YCSB-B read: its request with a 16-byte key, a reply with a 1,000-byte record;
            // both with NAAM's framing and sealing, so that the two carry the same bytes.
            request: 160,
            reply: 1100,
            seconds: 1.0,
        }
    }
}

/// One measured point.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CeilingPoint {
    /// Client threads.
    pub threads: usize,
    /// Requests in flight per thread.
    pub depth: usize,
    /// Round trips per second, all threads together.
    pub round_trips_per_sec: f64,
    /// The echo server's CPU time per round trip, microseconds.
    pub server_cpu_us_per_round_trip: f64,
    /// Requests sent again because their reply did not come within 20 ms.
    pub resent: u64,
}

const BATCH: usize = 32;
/// How long a thread that just received something polls before it sleeps.
const POLL: Duration = Duration::from_micros(50);

fn tune(sock: &UdpSocket) {
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
}

fn to_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let SocketAddr::V4(a) = addr else {
        return (ss, 0);
    };
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
    (
        ss,
        std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
    )
}

/// Receives up to [`BATCH`] datagrams into `bufs` (`flags`: `MSG_DONTWAIT` or
/// `MSG_WAITFORONE`); returns how many and who sent each.
fn recv_many(
    sock: &UdpSocket,
    bufs: &mut [Vec<u8>],
    from: &mut [MaybeUninit<libc::sockaddr_storage>],
    flags: libc::c_int,
) -> io::Result<usize> {
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .zip(from.iter_mut())
        .map(|(iov, a)| {
            // SAFETY: all-zero is a valid msghdr.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_name = a.as_mut_ptr().cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_iov = iov;
            h.msg_iovlen = 1;
            libc::mmsghdr {
                msg_hdr: h,
                msg_len: 0,
            }
        })
        .collect();
    // SAFETY: valid headers pointing at live buffers and address storage.
    let n = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            msgs.as_mut_ptr(),
            msgs.len() as libc::c_uint,
            flags,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted => {
                Ok(0)
            }
            _ => Err(e),
        };
    }
    Ok(n as usize)
}

/// Sends `payload` to each of `to` in one `sendmmsg` (as many calls as the kernel needs).
fn send_many(
    sock: &UdpSocket,
    to: &mut [(libc::sockaddr_storage, libc::socklen_t)],
    payload: &[u8],
) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    let mut msgs: Vec<libc::mmsghdr> = to
        .iter_mut()
        .map(|(ss, len)| {
            // SAFETY: all-zero is a valid msghdr.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_name = (ss as *mut libc::sockaddr_storage).cast();
            h.msg_namelen = *len;
            h.msg_iov = &mut iov;
            h.msg_iovlen = 1;
            libc::mmsghdr {
                msg_hdr: h,
                msg_len: 0,
            }
        })
        .collect();
    let mut sent = 0;
    while sent < msgs.len() {
        // SAFETY: valid headers pointing at a live buffer and addresses.
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
    Ok(())
}

/// Receives a batch: polls (yielding the core) for up to `poll`, then blocks up to the
/// socket's timeout.
fn recv_polling(
    sock: &UdpSocket,
    bufs: &mut [Vec<u8>],
    from: &mut [MaybeUninit<libc::sockaddr_storage>],
    poll: Duration,
) -> io::Result<usize> {
    let start = Instant::now();
    while start.elapsed() < poll {
        let n = recv_many(sock, bufs, from, libc::MSG_DONTWAIT)?;
        if n > 0 {
            return Ok(n);
        }
        std::thread::yield_now();
    }
    recv_many(sock, bufs, from, libc::MSG_WAITFORONE)
}

/// This thread's CPU time so far.
fn thread_cpu() -> Duration {
    // SAFETY: a zeroed rusage is valid; RUSAGE_THREAD (1) fills it for the calling thread.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(1, &mut u) };
    let t = |v: libc::timeval| Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000);
    t(u.ru_utime) + t(u.ru_stime)
}

/// The echo server: answers every datagram with a `reply`-byte one until `stop`; returns its
/// CPU time.
fn echo_server(sock: UdpSocket, reply: usize, stop: Arc<AtomicBool>) -> io::Result<Duration> {
    sock.set_read_timeout(Some(Duration::from_millis(20)))?;
    let cpu0 = thread_cpu();
    let payload = vec![0x5a; reply];
    let mut bufs = vec![vec![0u8; 2048]; BATCH];
    let mut from = vec![MaybeUninit::zeroed(); BATCH];
    let mut to = Vec::with_capacity(BATCH);
    let mut busy = false;
    while !stop.load(Ordering::Relaxed) {
        let poll = if busy { POLL } else { Duration::ZERO };
        let n = recv_polling(&sock, &mut bufs, &mut from, poll)?;
        busy = n > 0;
        to.clear();
        for a in &from[..n] {
            // SAFETY: the kernel filled the address of every returned datagram.
            let ss = unsafe { a.assume_init() };
            to.push((
                ss,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            ));
        }
        if !to.is_empty() {
            send_many(&sock, &mut to, &payload)?;
        }
    }
    Ok(thread_cpu() - cpu0)
}

/// One client thread: `depth` requests in flight until `until`; returns round trips and
/// requests resent.
fn client(
    server: SocketAddr,
    depth: usize,
    request: usize,
    until: Instant,
) -> io::Result<(u64, u64)> {
    let sock = UdpSocket::bind("127.0.0.1:0")?;
    tune(&sock);
    sock.set_read_timeout(Some(Duration::from_millis(20)))?;
    let payload = vec![0xa5; request];
    let dest = to_sockaddr(server);
    let mut bufs = vec![vec![0u8; 2048]; BATCH];
    let mut from = vec![MaybeUninit::zeroed(); BATCH];
    let mut to = vec![dest; depth];
    send_many(&sock, &mut to, &payload)?;
    let (mut done, mut resent) = (0u64, 0u64);
    let mut last = Instant::now();
    while Instant::now() < until {
        let n = recv_polling(&sock, &mut bufs, &mut from, Duration::from_micros(100))?;
        if n == 0 {
            if last.elapsed() >= Duration::from_millis(20) {
                // A datagram was lost: fill the window again.
                let mut to = vec![dest; depth];
                send_many(&sock, &mut to, &payload)?;
                resent += depth as u64;
                last = Instant::now();
            }
            continue;
        }
        last = Instant::now();
        done += n as u64;
        let mut to = vec![dest; n];
        send_many(&sock, &mut to, &payload)?;
    }
    Ok((done, resent))
}

/// Measures one point.
pub fn measure(threads: usize, depth: usize, c: &CeilingConfig) -> anyhow::Result<CeilingPoint> {
    let sock = UdpSocket::bind("127.0.0.1:0").context("binding the echo server")?;
    tune(&sock);
    let server = sock.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let reply = c.reply;
    let echo = std::thread::spawn(move || echo_server(sock, reply, s2));
    // A short warm-up, then the measured interval.
    let _ = client(
        server,
        depth,
        c.request,
        Instant::now() + Duration::from_millis(100),
    );
    let total = Arc::new(AtomicU64::new(0));
    let resent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(c.seconds);
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (total, resent) = (total.clone(), resent.clone());
            let request = c.request;
            std::thread::spawn(move || -> io::Result<()> {
                let (d, r) = client(server, depth, request, until)?;
                total.fetch_add(d, Ordering::Relaxed);
                resent.fetch_add(r, Ordering::Relaxed);
                Ok(())
            })
        })
        .collect();
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
    }
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let cpu = echo
        .join()
        .map_err(|_| anyhow::anyhow!("the echo server panicked"))??;
    let n = total.load(Ordering::Relaxed);
    Ok(CeilingPoint {
        threads,
        depth,
        round_trips_per_sec: n as f64 / elapsed,
        // The server's CPU includes the warm-up (a tenth of a second at most): an upper bound.
        server_cpu_us_per_round_trip: cpu.as_secs_f64() * 1e6 / n.max(1) as f64,
        resent: resent.load(Ordering::Relaxed),
    })
}

/// Every point of `c`, printed as it is measured; the JSON document of the experiment.
pub fn udp_ceiling(out: &std::path::Path, c: &CeilingConfig) -> anyhow::Result<serde_json::Value> {
    let mut points = Vec::new();
    println!(
        "{:>7} {:>6} {:>16} {:>22} {:>7}",
        "threads", "depth", "round trips/s", "server CPU us / trip", "resent"
    );
    for &t in &c.threads {
        for &d in &c.depths {
            let p = measure(t, d, c)?;
            println!(
                "{:>7} {:>6} {:>16.0} {:>22.2} {:>7}",
                p.threads, p.depth, p.round_trips_per_sec, p.server_cpu_us_per_round_trip, p.resent
            );
            points.push(p);
        }
    }
    let doc = serde_json::json!({
        "experiment": "udp-ceiling",
        "mode": "raw UDP echo on loopback (no NAAM code): the kernel path's limit on this machine",
        "request_bytes": c.request,
        "reply_bytes": c.reply,
        "seconds_per_point": c.seconds,
        "points": points,
    });
    std::fs::write(
        out.join("udp-ceiling.json"),
        serde_json::to_vec_pretty(&doc)?,
    )?;
    Ok(doc)
}
