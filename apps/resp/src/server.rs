//! The front's driver: one thread, one poll loop over a listening socket and its connections
//! (non-blocking, `mio`), run to completion in rounds. A round reads what every ready
//! connection sent, cuts out up to [`FrontConfig::max_pipeline`] commands from each, runs all
//! their ops as one batch on the store (so one round's requests from many clients are in
//! flight together), then writes every answer. Everything a connection decides is
//! [`Connection`]'s; this module only moves bytes.
//!
//! A connection that sends bytes that are not RESP is answered with the error and closed;
//! one that does not read its answers is not read from until it does (its output is bounded
//! by [`FrontConfig::max_output`]); neither touches the others.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use crate::codec::parse_command;
use crate::front::{Connection, FrontConfig};
use crate::store::{Op, Store};

const LISTENER: Token = Token(usize::MAX);

/// How long the loop sleeps in the kernel at most, so that it sees the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// Bytes read from a socket at a time.
const READ_CHUNK: usize = 64 << 10;

/// The most a closing connection's peer may send after its answer before the connection is
/// closed regardless.
const LINGER_BYTES: usize = 16 << 20;

/// What a front served, for its log line at the end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// Connections accepted.
    pub connections: u64,
    /// Commands taken.
    pub commands: u64,
    /// Connections closed for bytes that were not RESP.
    pub protocol_errors: u64,
    /// Rounds run.
    pub rounds: u64,
}

struct Client<T> {
    stream: TcpStream,
    conn: Connection<T>,
    input: BytesMut,
    output: Vec<u8>,
    /// How much of `output` is sent.
    sent: usize,
    /// The peer closed its side (or the socket failed): close once answered.
    gone: bool,
    /// Registered for writability (output is waiting on the kernel).
    writing: bool,
    /// The write side is shut (a closing connection, answered).
    shut: bool,
    /// Bytes read and dropped since the connection began closing.
    discarded: usize,
    /// Reading stopped at a limit (input or unsent output full) with the socket perhaps not
    /// drained: read again once the limit clears, since the kernel (edge-triggered) says
    /// nothing more about bytes it already holds.
    paused: bool,
}

/// Binds the front's listening socket (at start, so that a port in use is an error then).
pub fn bind(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves `listener` with `store` until `stop` is set.
pub fn serve<S: Store>(
    listener: std::net::TcpListener,
    front: &FrontConfig,
    store: &mut S,
    stop: &AtomicBool,
) -> io::Result<ServeStats> {
    listener.set_nonblocking(true)?;
    let mut listener = TcpListener::from_std(listener);
    let mut poll = Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut events = Events::with_capacity(1024);
    let mut clients: Vec<Option<Client<S::Tenant>>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut stats = ServeStats::default();
    // Connections with bytes to parse (or answers to write) this round.
    let mut active: Vec<usize> = Vec::new();
    let mut queued: Vec<bool> = Vec::new();
    // Connections whose input still holds commands past their round's share.
    let mut leftover: Vec<usize> = Vec::new();
    // Per active connection: whether it stopped with commands still in its input.
    let mut more: Vec<bool> = Vec::new();
    let mut ops: Vec<Op<S::Tenant>> = Vec::new();
    let mut ranges: Vec<Range<usize>> = Vec::new();
    let mut args: Vec<Bytes> = Vec::new();
    let mut next_id: u64 = 1;
    let mut scratch = vec![0u8; READ_CHUNK];
    while !stop.load(Ordering::Relaxed) {
        let timeout = if leftover.is_empty() {
            TICK
        } else {
            Duration::ZERO
        };
        match poll.poll(&mut events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        active.clear();
        for i in leftover.drain(..) {
            push_active(&mut active, &mut queued, i);
        }
        for ev in events.iter() {
            if ev.token() == LISTENER {
                accept_all(
                    &listener,
                    &poll,
                    &mut clients,
                    &mut free,
                    &mut next_id,
                    store,
                    &mut stats,
                );
                continue;
            }
            let i = ev.token().0;
            let Some(Some(c)) = clients.get_mut(i) else {
                continue;
            };
            if ev.is_writable() {
                flush(c);
            }
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                fill(c, front, &mut scratch);
            }
            push_active(&mut active, &mut queued, i);
        }
        stats.rounds += 1;
        let round = stats.rounds;
        ops.clear();
        more.clear();
        for &i in &active {
            let Some(Some(c)) = clients.get_mut(i) else {
                more.push(false);
                continue;
            };
            if c.paused {
                fill(c, front, &mut scratch);
            }
            more.push(take_commands(
                c,
                front,
                round,
                store,
                &mut ops,
                &mut ranges,
                &mut args,
                &mut stats,
            ));
        }
        store.run(&mut ops);
        for (&i, &more) in active.iter().zip(&more) {
            queued[i] = false;
            let Some(Some(c)) = clients.get_mut(i) else {
                continue;
            };
            c.conn.finish(&ops, &mut c.output);
            flush(c);
            let done = c.sent == c.output.len();
            if done && c.conn.closing() && !c.gone && c.discarded < LINGER_BYTES {
                // Answered (QUIT, or the error that ends a protocol violation): the write side
                // closes after the answer, and what the client still sends is read and dropped
                // until it closes too. Closing at once, with its bytes unread, would reset the
                // connection, and a reset can drop the answer before the client reads it.
                if !c.shut {
                    let _ = c.stream.shutdown(std::net::Shutdown::Write);
                    c.shut = true;
                }
                continue;
            }
            if done && (c.conn.closing() || (c.gone && !more)) {
                let mut c = clients[i].take().expect("checked above");
                let _ = poll.registry().deregister(&mut c.stream);
                free.push(i);
                continue;
            }
            let want_write = !done;
            if want_write != c.writing {
                let interest = if want_write {
                    Interest::READABLE | Interest::WRITABLE
                } else {
                    Interest::READABLE
                };
                if poll
                    .registry()
                    .reregister(&mut c.stream, Token(i), interest)
                    .is_err()
                {
                    c.gone = true;
                }
                c.writing = want_write;
            }
            // Commands left for the next round (its share was taken, or its output is full
            // until the client reads): the next round parses on without waiting for the
            // socket, unless only the client's reading can unblock it.
            if more && c.output.len() - c.sent < front.max_output {
                leftover.push(i);
            }
        }
    }
    Ok(stats)
}

fn push_active(active: &mut Vec<usize>, queued: &mut Vec<bool>, i: usize) {
    if queued.len() <= i {
        queued.resize(i + 1, false);
    }
    if !queued[i] {
        queued[i] = true;
        active.push(i);
    }
}

fn accept_all<S: Store>(
    listener: &TcpListener,
    poll: &Poll,
    clients: &mut Vec<Option<Client<S::Tenant>>>,
    free: &mut Vec<usize>,
    next_id: &mut u64,
    store: &S,
    stats: &mut ServeStats,
) {
    loop {
        let (mut stream, _) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => {
                // Out of descriptors, or the peer gave up before we took it: the others go on.
                tracing::warn!("RESP accept: {e}");
                return;
            }
        };
        let _ = stream.set_nodelay(true);
        let i = free.pop().unwrap_or_else(|| {
            clients.push(None);
            clients.len() - 1
        });
        if poll
            .registry()
            .register(&mut stream, Token(i), Interest::READABLE)
            .is_err()
        {
            free.push(i);
            continue;
        }
        stats.connections += 1;
        clients[i] = Some(Client {
            stream,
            conn: Connection::new(*next_id, store.default_tenant()),
            input: BytesMut::new(),
            output: Vec::new(),
            sent: 0,
            gone: false,
            writing: false,
            paused: false,
            shut: false,
            discarded: 0,
        });
        *next_id += 1;
    }
}

/// The most unparsed input a connection may have: one largest bulk string and its headers, and
/// a read's worth more. A command that does not fit (many large arguments) is refused.
fn query_cap(front: &FrontConfig) -> usize {
    front.limits.max_bulk + front.limits.max_inline + READ_CHUNK
}

/// Reads what the socket holds, unless the connection's input or output is already full.
/// Through `scratch` (zeroed once, shared by the loop's connections): reading into the
/// input's own spare room needed it zeroed first, 64 KiB per read (2.7% of the front's time
/// under redis-benchmark -P 16 -c 50).
fn fill<T: Copy + Eq + std::fmt::Debug>(
    c: &mut Client<T>,
    front: &FrontConfig,
    scratch: &mut [u8],
) {
    let cap = query_cap(front);
    c.paused = false;
    if c.conn.closing() {
        // Nothing more is taken: read and drop, until the peer closes or has sent too much.
        while !c.gone && c.discarded < LINGER_BYTES {
            match c.stream.read(scratch) {
                Ok(0) => c.gone = true,
                Ok(n) => c.discarded += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => c.gone = true,
            }
        }
        return;
    }
    loop {
        if c.gone {
            return;
        }
        if c.input.len() >= cap || c.output.len() - c.sent >= front.max_output {
            c.paused = true;
            return;
        }
        match c.stream.read(scratch) {
            Ok(0) => c.gone = true,
            Ok(n) => {
                c.input.extend_from_slice(&scratch[..n]);
                if n < scratch.len() {
                    return;
                }
            }
            Err(e) => match e.kind() {
                io::ErrorKind::WouldBlock => return,
                io::ErrorKind::Interrupted => {}
                _ => c.gone = true,
            },
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn take_commands<S: Store>(
    c: &mut Client<S::Tenant>,
    front: &FrontConfig,
    round: u64,
    store: &mut S,
    ops: &mut Vec<Op<S::Tenant>>,
    ranges: &mut Vec<Range<usize>>,
    args: &mut Vec<Bytes>,
    stats: &mut ServeStats,
) -> bool {
    let mut taken = 0;
    while !c.conn.closing()
        && taken < front.max_pipeline
        && c.output.len() - c.sent < front.max_output
    {
        match parse_command(&c.input, &front.limits, ranges) {
            Ok(Some(n)) => {
                let frame = c.input.split_to(n).freeze();
                args.clear();
                args.extend(ranges.iter().map(|r| frame.slice(r.clone())));
                c.conn
                    .command(front, round, args, store, ops, &mut c.output);
                taken += 1;
                stats.commands += 1;
            }
            Ok(None) if c.input.len() >= query_cap(front) => {
                stats.protocol_errors += 1;
                let e = crate::codec::ProtocolError::TooLarge {
                    what: "unfinished command",
                    len: c.input.len() as u64,
                    limit: query_cap(front),
                };
                tracing::debug!("RESP connection {}: {e}; closing it", c.conn.id);
                c.conn.protocol_error(&e, &mut c.output);
                c.input.clear();
                break;
            }
            Ok(None) => break,
            Err(e) => {
                stats.protocol_errors += 1;
                tracing::debug!("RESP connection {}: {e}; closing it", c.conn.id);
                c.conn.protocol_error(&e, &mut c.output);
                c.input.clear();
                break;
            }
        }
    }
    // Stopped at its share or at a full output, with more input: more may wait there.
    !c.conn.closing()
        && !c.input.is_empty()
        && (taken == front.max_pipeline || c.output.len() - c.sent >= front.max_output)
}

/// Writes what the kernel takes of the connection's answers.
fn flush<T>(c: &mut Client<T>) {
    while c.sent < c.output.len() {
        match c.stream.write(&c.output[c.sent..]) {
            Ok(0) => {
                c.gone = true;
                break;
            }
            Ok(n) => c.sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.gone = true;
                // Nothing more can be sent: drop it, so the connection closes.
                c.sent = c.output.len();
                break;
            }
        }
    }
    if c.sent == c.output.len() {
        c.output.clear();
        c.sent = 0;
    }
}
