//! Datagram framing, IO-free: splitting a wire message into MTU-sized
//! fragments, reassembling them with bounded memory, and the retransmission timers a client keeps
//! per outstanding request. Sockets live in a thin driver; everything here takes time as an
//! argument so the simulator and tests drive it with a virtual clock.
//!
//! Fragment header (little-endian):
//! ```text
//!  0 u32 magic "NAAM"        4 u8 version (1)       5 u8 fragment index   6 u8 fragment count
//!  7 u8  route               8 u64 message id      16 u16 message length  18 u16 fragment offset
//! 20 u16 fragment length    22 u16 reserved (0)
//! 24 fragment bytes
//! ```
//!
//! The route ([`ROUTE`]) names the receive loop of a sharded server that takes every
//! fragment of the message ([`crate::shard`]): its session's, or 0 for none. It is a hint for
//! delivery only; nothing is trusted on it.

use crate::arena::ByteArena;
use crate::intmap::IntMap;
use std::collections::HashMap;
use std::hash::Hash;

use bytes::{BufMut, Bytes};
use smallvec::SmallVec;

use crate::limits::MAX_MESSAGE;
use crate::Nanos;

/// Magic number opening every fragment ("NAAM" in little-endian byte order).
pub const MAGIC: u32 = u32::from_le_bytes(*b"NAAM");
/// Framing version (of the fragment header; messages inside carry [`crate::kind::VERSION`]).
pub const VERSION: u8 = 1;
/// Bytes of the header before each fragment's data.
pub const HEADER: usize = 24;
/// Most fragments one message may have.
pub const MAX_FRAGMENTS: usize = 64;
/// Smallest datagram payload the framing accepts (IPv4's minimum reassembly size less headers).
pub const MIN_DATAGRAM: usize = 512;
/// Offset of the route byte in the fragment header (a kernel filter reads it there).
pub const ROUTE: usize = 7;

/// Why a datagram or a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Shorter than the header or than the length it declares.
    #[error("truncated fragment: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes required.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Not a NAAM datagram.
    #[error("bad magic {0:#010x}: not a NAAM datagram")]
    Magic(u32),
    /// Unknown framing version.
    #[error("unsupported framing version {0} (expected {VERSION})")]
    Version(u8),
    /// A header field out of range or inconsistent with the others.
    #[error("invalid fragment header: {0}")]
    Header(&'static str),
    /// A message over [`MAX_MESSAGE`].
    #[error("message of {0} bytes is over the limit of {MAX_MESSAGE}")]
    TooLarge(usize),
    /// A datagram size too small to carry fragments.
    #[error("datagram size {0} is under the minimum of {MIN_DATAGRAM}")]
    DatagramTooSmall(usize),
}

/// One decoded fragment; `data` is a slice of the received datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fragment {
    /// Message id (the request id for requests and replies).
    pub message: u64,
    /// Index of this fragment.
    pub index: u8,
    /// Fragments in the message.
    pub count: u8,
    /// Length of the whole message.
    pub total: u16,
    /// Where `data` starts in the message.
    pub offset: u16,
    /// The receive loop it was routed to ([`crate::shard`]); 0: none.
    pub route: u8,
    /// This fragment's part of the message: bytes `offset..offset + data.len()`.
    pub data: Bytes,
}

impl Fragment {
    /// Decodes and checks one datagram.
    pub fn decode(datagram: Bytes) -> Result<Fragment, FrameError> {
        if datagram.len() < HEADER {
            return Err(FrameError::Truncated {
                need: HEADER,
                have: datagram.len(),
            });
        }
        let RawHeader {
            magic,
            version,
            index,
            count,
            route,
            message,
            total,
            offset,
            len,
            reserved,
        } = RawHeader::read(&datagram);
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        if reserved != 0 {
            return Err(FrameError::Header("reserved bytes are not zero"));
        }
        if count == 0 || count as usize > MAX_FRAGMENTS || index >= count {
            return Err(FrameError::Header("fragment index or count out of range"));
        }
        if total as usize > MAX_MESSAGE {
            return Err(FrameError::TooLarge(total as usize));
        }
        if offset as usize + len as usize > total as usize {
            return Err(FrameError::Header("fragment extends past the message"));
        }
        if len == 0 && total != 0 {
            return Err(FrameError::Header("empty fragment of a non-empty message"));
        }
        // Fragments are equal-sized chunks in index order, the last one ending the message.
        let last = index + 1 == count;
        if last && offset as usize + len as usize != total as usize {
            return Err(FrameError::Header(
                "the last fragment does not end the message",
            ));
        }
        if !last && offset as usize != index as usize * len as usize {
            return Err(FrameError::Header("fragment offset is not index x length"));
        }
        // (`n.is_multiple_of(0)` holds only for 0: the first fragment starts the message.)
        if !(offset as usize).is_multiple_of(index as usize) {
            return Err(FrameError::Header("fragment offset is not index x length"));
        }
        let need = HEADER + len as usize;
        if datagram.len() != need {
            return Err(if datagram.len() < need {
                FrameError::Truncated {
                    need,
                    have: datagram.len(),
                }
            } else {
                FrameError::Header("datagram longer than its fragment")
            });
        }
        // The data is what is left of the datagram (no reference counted for a slice).
        let mut data = datagram;
        bytes::Buf::advance(&mut data, HEADER);
        Ok(Fragment {
            message,
            index,
            count,
            total,
            offset,
            route,
            data,
        })
    }
}

/// A fragment header's fields as they lie, unchecked: what [`header`] writes.
struct RawHeader {
    magic: u32,
    version: u8,
    index: u8,
    count: u8,
    route: u8,
    message: u64,
    total: u16,
    offset: u16,
    len: u16,
    reserved: u16,
}

impl RawHeader {
    /// The header at the start of `d`, which is at least [`HEADER`] bytes long.
    fn read(d: &[u8]) -> RawHeader {
        let u16_at = |i: usize| u16::from_le_bytes([d[i], d[i + 1]]);
        let mut message = [0u8; 8];
        message.copy_from_slice(&d[8..16]);
        RawHeader {
            magic: u32::from_le_bytes([d[0], d[1], d[2], d[3]]),
            version: d[4],
            index: d[5],
            count: d[6],
            route: d[ROUTE],
            message: u64::from_le_bytes(message),
            total: u16_at(16),
            offset: u16_at(18),
            len: u16_at(20),
            reserved: u16_at(22),
        }
    }
}

/// Where one fragment of a message lies: its header and the range of the message it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The fragment's header, to send before `range` of the message.
    pub header: [u8; HEADER],
    /// The bytes of the message it carries.
    pub range: std::ops::Range<usize>,
}

/// The fragments of a `len`-byte message with id `message` in datagrams of at most
/// `datagram` bytes, each routed to `route` ([`crate::shard::route_of`]), as headers and
/// ranges (a driver sends each header and range with one scatter-gather entry each, copying
/// nothing).
pub fn pieces(
    message: u64,
    len: usize,
    datagram: usize,
    route: u8,
) -> Result<impl Iterator<Item = Piece>, FrameError> {
    if len > MAX_MESSAGE {
        return Err(FrameError::TooLarge(len));
    }
    if datagram < MIN_DATAGRAM {
        return Err(FrameError::DatagramTooSmall(datagram));
    }
    let chunk = datagram - HEADER;
    let count = len.div_ceil(chunk).max(1);
    if count > MAX_FRAGMENTS {
        return Err(FrameError::TooLarge(len));
    }
    Ok((0..count).map(move |index| {
        let start = index * chunk;
        let end = (start + chunk).min(len);
        Piece {
            header: header(message, index as u8, count as u8, route, len, start..end),
            range: start..end,
        }
    }))
}

/// The header of fragment `index` of `count` of a `len`-byte message, carrying `range` of it.
/// `len` is at most [`MAX_MESSAGE`].
fn header(
    message: u64,
    index: u8,
    count: u8,
    route: u8,
    len: usize,
    range: std::ops::Range<usize>,
) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = VERSION;
    h[5] = index;
    h[6] = count;
    h[ROUTE] = route;
    h[8..16].copy_from_slice(&message.to_le_bytes());
    h[16..18].copy_from_slice(&(len as u16).to_le_bytes());
    h[18..20].copy_from_slice(&(range.start as u16).to_le_bytes());
    h[20..22].copy_from_slice(&(range.len() as u16).to_le_bytes());
    h
}

/// The message id and route of `datagram` when it is a whole message alone in one datagram
/// whose header says so (one fragment of one, at offset 0, carrying the rest of the
/// datagram); `None` otherwise. A cheap check of a datagram an endpoint framed
/// ([`lone_header`]), not a validation of one received.
pub fn lone_frame(datagram: &[u8]) -> Option<(u64, u8)> {
    let h = RawHeader::read(datagram.get(..HEADER)?);
    let len = datagram.len() - HEADER;
    let lone = h.index == 0
        && h.count == 1
        && h.total as usize == len
        && h.offset == 0
        && h.len as usize == len;
    lone.then_some((h.message, h.route))
}

/// The header of a message that travels alone in one datagram ([`fragment`] of a message
/// that fits gives this header and the message), for an endpoint that writes the message
/// straight after it; `None` when `len` is over [`MAX_MESSAGE`].
pub fn lone_header(message: u64, len: usize, route: u8) -> Option<[u8; HEADER]> {
    (len <= MAX_MESSAGE).then(|| header(message, 0, 1, route, len, 0..len))
}

/// A message's datagrams, in order: one, for all but the largest messages, held without a
/// heap allocation.
pub type Fragments = SmallVec<[Bytes; 1]>;

/// Splits `message` into datagrams of at most `datagram` bytes each, routed to its session's
/// receive loop ([`crate::shard::route_of`]).
pub fn fragment(message: u64, bytes: &[u8], datagram: usize) -> Result<Fragments, FrameError> {
    fragment_routed(message, bytes, datagram, crate::shard::route_of(bytes))
}

/// [`fragment`], every fragment carrying `route` (a message routed as another session than
/// the one it is sealed in: [`crate::endpoint::Transmit::route`]). The fragments share one
/// allocation.
pub fn fragment_routed(
    message: u64,
    bytes: &[u8],
    datagram: usize,
    route: u8,
) -> Result<Fragments, FrameError> {
    let count = bytes.len().div_ceil(datagram.saturating_sub(HEADER).max(1));
    let mut arena = ByteArena::with_chunk(bytes.len() + HEADER * count.max(1));
    fragment_routed_in(&mut arena, message, bytes, datagram, route)
}

/// [`fragment_routed`] into `arena`'s chunks: a driver that sends each message's fragments
/// before it makes the next one's writes them with no allocation.
pub fn fragment_routed_in(
    arena: &mut ByteArena,
    message: u64,
    bytes: &[u8],
    datagram: usize,
    route: u8,
) -> Result<Fragments, FrameError> {
    Ok(pieces(message, bytes.len(), datagram, route)?
        .map(|p| {
            arena.write(HEADER + p.range.len(), |b| {
                b.put_slice(&p.header);
                b.put_slice(&bytes[p.range]);
            })
        })
        .collect())
}

/// A message being reassembled.
#[derive(Debug)]
struct Partial {
    buf: Vec<u8>,
    /// Every fragment but the last is this long.
    chunk: usize,
    count: u8,
    seen: u64,
    started: Nanos,
}

/// What [`Reassembler::push`] did with a fragment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pushed {
    /// The last missing fragment arrived: the whole message, reassembled.
    Complete(Bytes),
    /// Stored; more fragments are needed.
    Pending,
    /// A fragment already received (a retransmission): ignored.
    Duplicate,
    /// Inconsistent with the fragments received before it (another message under the same id,
    /// or overlapping bytes that differ): the partial message is dropped.
    Conflict,
    /// Too many partial messages or bytes: dropped (the sender retransmits).
    Full,
}

/// Reassembles fragments into messages, per `(peer, message id)`, within fixed memory bounds;
/// partial messages older than the timeout are dropped by [`Reassembler::expire`].
#[derive(Debug)]
pub struct Reassembler<P: Eq + Hash + Copy> {
    partial: HashMap<(P, u64), Partial>,
    bytes: usize,
    max_partial: usize,
    max_bytes: usize,
    timeout: Nanos,
}

impl<P: Eq + Hash + Copy> Reassembler<P> {
    /// A reassembler holding at most `max_partial` partial messages and `max_bytes` of them;
    /// partial messages older than `timeout` nanoseconds are dropped.
    pub fn new(max_partial: usize, max_bytes: usize, timeout: Nanos) -> Self {
        Reassembler {
            partial: HashMap::new(),
            bytes: 0,
            max_partial,
            max_bytes,
            timeout,
        }
    }

    /// Partial messages held.
    pub fn pending(&self) -> usize {
        self.partial.len()
    }

    /// Adds a fragment from `peer` received at `now`.
    pub fn push(&mut self, peer: P, f: Fragment, now: Nanos) -> Pushed {
        if f.count == 1 {
            return Pushed::Complete(f.data);
        }
        let key = (peer, f.message);
        if !self.partial.contains_key(&key) {
            if self.partial.len() >= self.max_partial
                || self.bytes + f.total as usize > self.max_bytes
            {
                return Pushed::Full;
            }
            let chunk = if f.index + 1 == f.count {
                f.offset as usize / f.index.max(1) as usize
            } else {
                f.data.len()
            };
            // The chunk must make exactly `count` fragments of `total` bytes.
            let fits = chunk > 0
                && (f.count as usize - 1) * chunk < f.total as usize
                && f.total as usize <= f.count as usize * chunk;
            if !fits {
                return Pushed::Conflict;
            }
            self.bytes += f.total as usize;
            self.partial.insert(
                key,
                Partial {
                    buf: vec![0; f.total as usize],
                    chunk,
                    count: f.count,
                    seen: 0,
                    started: now,
                },
            );
        }
        let Some(p) = self.partial.get_mut(&key) else {
            return Pushed::Full;
        };
        let (start, end) = (f.offset as usize, f.offset as usize + f.data.len());
        let last = f.index + 1 == f.count;
        let placed =
            f.offset as usize == f.index as usize * p.chunk && (last || f.data.len() == p.chunk);
        if p.count != f.count || p.buf.len() != f.total as usize || !placed {
            self.drop_partial(key);
            return Pushed::Conflict;
        }
        let bit = 1u64 << f.index;
        if p.seen & bit != 0 {
            return if p.buf[start..end] == f.data[..] {
                Pushed::Duplicate
            } else {
                self.drop_partial(key);
                Pushed::Conflict
            };
        }
        p.buf[start..end].copy_from_slice(&f.data);
        p.seen |= bit;
        let all = if p.count as usize == 64 {
            u64::MAX
        } else {
            (1u64 << p.count) - 1
        };
        if p.seen == all {
            let done = self.partial.remove(&key).map(|p| p.buf).unwrap_or_default();
            self.bytes -= done.len();
            return Pushed::Complete(Bytes::from(done));
        }
        Pushed::Pending
    }

    /// Drops partial messages started more than the timeout before `now`; returns how many.
    pub fn expire(&mut self, now: Nanos) -> usize {
        let timeout = self.timeout;
        let stale: Vec<_> = self
            .partial
            .iter()
            .filter(|(_, p)| now.saturating_sub(p.started) > timeout)
            .map(|(k, _)| *k)
            .collect();
        for k in &stale {
            self.drop_partial(*k);
        }
        stale.len()
    }

    fn drop_partial(&mut self, key: (P, u64)) {
        if let Some(p) = self.partial.remove(&key) {
            self.bytes -= p.buf.len();
        }
    }
}

/// What to do about an outstanding request whose timer fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    /// Send it again (attempt number, from 2).
    Resend(u32),
    /// Out of attempts: fail the call.
    GiveUp,
}

/// Round-trip time of one path, smoothed as RFC 6298 (and QUIC, RFC 9002) estimate it: the
/// first sample sets the mean and half of it as the variation; later ones move them by 1/8
/// and 1/4. The retransmission timeout is the mean plus four variations, within bounds.
#[derive(Clone, Copy, Debug)]
pub struct RttEstimator {
    srtt: Option<f64>,
    rttvar: f64,
    initial: Nanos,
    min: Nanos,
    max: Nanos,
    /// Doublings of the timeout since the last sample (RFC 6298, 5.5-5.7): each timeout on
    /// the path doubles the timeout of every exchange sent on it afterwards, until an
    /// exchange sent once is answered. Without it, a path whose round trip grew past its
    /// timeout (a server's queue under overload) resends every exchange, Karn's rule leaves
    /// it no sample to learn the new round trip from, and the resends keep the queue long.
    backoff: u32,
}

impl RttEstimator {
    /// An estimator whose timeout is `initial` until the first sample, and never leaves
    /// `min..=max` after.
    pub fn new(initial: Nanos, min: Nanos, max: Nanos) -> RttEstimator {
        let max = max.max(1);
        RttEstimator {
            srtt: None,
            rttvar: 0.0,
            initial: initial.clamp(1, max),
            min: min.clamp(1, max),
            max,
            backoff: 0,
        }
    }

    /// An exchange on the path timed out: later exchanges wait twice as long, until a
    /// sample comes.
    pub fn timed_out(&mut self) {
        self.backoff = (self.backoff + 1).min(MAX_PATH_BACKOFF);
    }

    /// Takes in one round trip's time (of an exchange sent once: Karn's rule, a resent one
    /// says nothing about which send was answered).
    pub fn sample(&mut self, rtt: Nanos) {
        self.backoff = 0;
        let r = rtt as f64;
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2.0;
            }
            Some(srtt) => {
                self.rttvar = 0.75 * self.rttvar + 0.25 * (srtt - r).abs();
                self.srtt = Some(0.875 * srtt + 0.125 * r);
            }
        }
    }

    /// The smoothed round trip, once sampled.
    pub fn smoothed(&self) -> Option<Nanos> {
        self.srtt.map(|s| s as Nanos)
    }

    /// The retransmission timeout now.
    pub fn rto(&self) -> Nanos {
        let base = match self.srtt {
            None => self.initial,
            Some(srtt) => ((srtt + 4.0 * self.rttvar) as Nanos).clamp(self.min, self.max),
        };
        base.saturating_mul(1 << self.backoff)
            .min(self.max.max(base))
    }
}

/// Most doublings of a path's timeout ([`RttEstimator::timed_out`]); the timeout never
/// exceeds the estimator's `max` anyway.
const MAX_PATH_BACKOFF: u32 = 16;

/// One outstanding exchange's timer.
#[derive(Clone, Copy, Debug)]
struct Timer {
    /// When it fires next.
    deadline: Nanos,
    /// Sends so far.
    attempt: u32,
    /// When it was first sent.
    sent_at: Nanos,
    /// When it was last sent.
    last_sent: Nanos,
    /// The timeout of the first send; the resends past the flat ones, with no progress in
    /// between, double it.
    rto: Nanos,
    /// Resends since the path last showed progress: the wait after a send is `rto` doubled
    /// this many times (exponential backoff).
    doublings: u32,
}

/// Resends since the path last showed progress that wait no longer than the first send, for
/// a client's exchanges ([`Retransmit::with_flat_resends`]): only later ones double the wait.
/// A lone request under random loss (nothing else in flight shows the path alive) otherwise
/// pays the doubling's whole series: at 20% loss each way a send fails 36% of the time, and
/// the expected wait after a first loss, 1 + 2(0.36) + 4(0.36)^2 + ... timeouts, is 3.6 of
/// them; with two flat resends it is 1.8. A dead peer gets two more datagrams per exchange
/// before the backoff starts.
pub const FLAT_RESENDS: u32 = 2;

impl Timer {
    /// One more send at `now`: the next wait is the first timeout for the first `flat`
    /// resends since the path's last progress, then twice the last, at most `max_backoff`.
    fn resent(&mut self, now: Nanos, flat: u32, max_backoff: Nanos) {
        self.attempt += 1;
        self.doublings += 1;
        self.last_sent = now;
        let doublings = self.doublings.saturating_sub(flat);
        let backoff = self
            .rto
            .saturating_mul(1 << doublings.min(20))
            .min(max_backoff);
        self.deadline = now.saturating_add(backoff);
    }

    /// The path answered something else: the wait since the last send falls back to `rto`.
    fn progressed(&mut self) {
        if self.doublings > 0 {
            self.doublings = 0;
            self.deadline = self.deadline.min(self.last_sent.saturating_add(self.rto));
        }
    }
}

/// Retransmission timers for a client's outstanding requests: each starts at the timeout its
/// path's [`RttEstimator`] gives when it is sent and, past the flat resends
/// ([`Retransmit::with_flat_resends`]), doubles per resend, for a fixed number of attempts.
/// Writes are safe to resend because the server suppresses duplicates by request id.
///
/// The doubling is for a path that has gone quiet (a dead or congested peer), not for one
/// that drops a datagram here and there: as QUIC resets its probe timeout's backoff on every
/// acknowledgement (RFC 9002, 6.2.1), an answer on a path ([`Retransmit::progressed`]) takes
/// its other exchanges' waits back to their first timeout. Under random loss an exchange lost
/// twice then waits one timeout again, not four.
#[derive(Debug)]
pub struct Retransmit {
    initial: Nanos,
    max_attempts: u32,
    /// No exchange is given up on sooner than this after its first send, however many
    /// attempts it took (short estimated timeouts must not shorten the patience).
    patience: Nanos,
    /// The longest wait between two sends.
    max_backoff: Nanos,
    outstanding: IntMap<u64, Timer>,
    /// Whether a timer may have backed off since [`Retransmit::progressed`] last looked: an
    /// answer then costs no walk over the timers when none has.
    backed_off: bool,
    /// Resends since the last progress that wait the first timeout again before the
    /// doubling starts.
    flat: u32,
}

impl Retransmit {
    /// Timers starting at `initial` nanoseconds (unless a send says otherwise), doubling per
    /// attempt, `max_attempts` sends in all.
    pub fn new(initial: Nanos, max_attempts: u32) -> Self {
        Retransmit {
            initial: initial.max(1),
            max_attempts: max_attempts.max(1),
            patience: 0,
            max_backoff: Nanos::MAX,
            outstanding: IntMap::default(),
            backed_off: false,
            flat: 0,
        }
    }

    /// Gives up on an exchange only once `patience` has passed since its first send (it is
    /// resent meanwhile, past its attempts if need be, at most every longest backoff).
    pub fn with_patience(mut self, patience: Nanos) -> Self {
        self.patience = patience;
        self
    }

    /// Waits at most `max` between two sends.
    pub fn with_max_backoff(mut self, max: Nanos) -> Self {
        self.max_backoff = max.max(1);
        self
    }

    /// The first `flat` resends since the path's last progress wait the first timeout again
    /// ([`FLAT_RESENDS`] for a client's exchanges); 0 (the default): every resend doubles
    /// the wait, as a handshake's schedule, fixed to fit its budget, needs.
    pub fn with_flat_resends(mut self, flat: u32) -> Self {
        self.flat = flat;
        self
    }

    /// Request `id` was sent for the first time at `now`, with the initial timeout.
    pub fn sent(&mut self, id: u64, now: Nanos) {
        self.sent_with(id, now, self.initial);
    }

    /// Request `id` was sent for the first time at `now`; its first timeout is `rto`.
    pub fn sent_with(&mut self, id: u64, now: Nanos, rto: Nanos) {
        let rto = rto.max(1);
        self.outstanding.insert(
            id,
            Timer {
                deadline: now.saturating_add(rto),
                attempt: 1,
                sent_at: now,
                last_sent: now,
                rto,
                doublings: 0,
            },
        );
    }

    /// An answer came on a path: the outstanding exchanges `on_path` picks (by id) had their
    /// backoff reset; one whose first timeout since its last send has already passed fires at
    /// the next [`Retransmit::poll`].
    pub fn progressed(&mut self, mut on_path: impl FnMut(u64) -> bool) {
        if !self.backed_off {
            return;
        }
        let mut still = false;
        for (&id, t) in self.outstanding.iter_mut() {
            if t.doublings > 0 && on_path(id) {
                t.progressed();
            }
            still |= t.doublings > 0;
        }
        self.backed_off = still;
    }

    /// The reply to `id` arrived; returns whether it was outstanding (false: a late duplicate).
    pub fn answered(&mut self, id: u64) -> bool {
        self.outstanding.remove(&id).is_some()
    }

    /// The reply to `id` arrived at `now`: `None` for a late duplicate, else `Some` of its
    /// round trip when it was sent only once (a sample for the path's estimator).
    pub fn answered_at(&mut self, id: u64, now: Nanos) -> Option<Option<Nanos>> {
        let t = self.outstanding.remove(&id)?;
        Some((t.attempt == 1).then(|| now.saturating_sub(t.sent_at)))
    }

    /// Exchange `id`, found lost before its timeout, is sent again now: counted as an attempt
    /// and its timer rearmed as a timeout would have. False (nothing to do) for one that is not
    /// outstanding, or out of attempts (its timer decides then).
    pub fn resent_early(&mut self, id: u64, now: Nanos) -> bool {
        let Some(t) = self.outstanding.get_mut(&id) else {
            return false;
        };
        if t.attempt >= self.max_attempts {
            return false;
        }
        t.resent(now, self.flat, self.max_backoff);
        self.backed_off = true;
        true
    }

    /// Requests with a timer: sent, and neither answered nor given up on.
    pub fn len(&self) -> usize {
        self.outstanding.len()
    }

    /// Whether nothing is outstanding.
    pub fn is_empty(&self) -> bool {
        self.outstanding.is_empty()
    }

    /// The earliest deadline, for the driver's poll timeout.
    pub fn next_deadline(&self) -> Option<Nanos> {
        self.outstanding.values().map(|t| t.deadline).min()
    }

    /// Timers that fired by `now`: each is rearmed (resend) or removed (give up).
    pub fn poll(&mut self, now: Nanos) -> Vec<(u64, Timeout)> {
        let mut out = Vec::new();
        let mut done = Vec::new();
        for (&id, t) in self.outstanding.iter_mut() {
            if t.deadline > now {
                continue;
            }
            if t.attempt >= self.max_attempts && now.saturating_sub(t.sent_at) >= self.patience {
                done.push(id);
                out.push((id, Timeout::GiveUp));
            } else {
                // Resent until the attempts are used and the patience is spent.
                t.resent(now, self.flat, self.max_backoff);
                self.backed_off = true;
                out.push((id, Timeout::Resend(t.attempt)));
            }
        }
        for id in done {
            self.outstanding.remove(&id);
        }
        out.sort_unstable_by_key(|(id, _)| *id);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn timeouts_double_the_paths_timeout_until_a_sample_comes() {
        let mut e = RttEstimator::new(20_000_000, 50_000, 1_000_000);
        for _ in 0..200 {
            e.sample(60_000);
        }
        assert_eq!(e.rto(), 60_000);
        e.timed_out();
        assert_eq!(e.rto(), 120_000, "one timeout: twice the timeout");
        e.timed_out();
        assert_eq!(e.rto(), 240_000);
        for _ in 0..40 {
            e.timed_out();
        }
        assert_eq!(e.rto(), 1_000_000, "never past the largest");
        e.sample(200_000);
        assert!(
            e.rto() < 240_000,
            "a sample (an exchange sent once) ends the backoff: {}",
            e.rto()
        );
    }

    #[test]
    fn the_timeout_follows_the_round_trips_within_its_bounds() {
        let mut e = RttEstimator::new(20_000_000, 50_000, 1_000_000_000);
        assert_eq!(
            e.rto(),
            20_000_000,
            "before any sample: the initial timeout"
        );
        e.sample(100_000);
        // First sample: srtt = r, rttvar = r / 2: rto = r + 4 r / 2.
        assert_eq!((e.smoothed(), e.rto()), (Some(100_000), 300_000));
        for _ in 0..200 {
            e.sample(100_000);
        }
        assert_eq!(
            e.rto(),
            100_000,
            "steady round trips: the variation dies out"
        );
        for _ in 0..200 {
            e.sample(10_000);
        }
        assert_eq!(e.rto(), 50_000, "never below the floor");
        e.sample(10_000_000_000);
        assert_eq!(e.rto(), 1_000_000_000, "never above the ceiling");
    }

    #[test]
    fn an_exchange_is_resent_until_its_patience_is_spent() {
        let mut r = Retransmit::new(1_000, 3)
            .with_patience(100_000)
            .with_max_backoff(8_000);
        r.sent_with(7, 0, 1_000);
        let mut resends = 0;
        let now = loop {
            let now = r.next_deadline().expect("armed");
            match r.poll(now).first() {
                Some((7, Timeout::Resend(_))) => resends += 1,
                Some((7, Timeout::GiveUp)) => break now,
                other => panic!("{other:?}"),
            }
        };
        assert!(now >= 100_000, "given up only after its patience: {now}");
        assert!(resends > 3, "resent past its attempts meanwhile: {resends}");
        // Found lost early: one more attempt, rearmed; not for one that is not outstanding.
        r.sent_with(8, now, 1_000);
        assert!(r.resent_early(8, now + 10));
        assert!(!r.resent_early(9, now + 10));
        assert_eq!(
            r.answered_at(8, now + 20),
            Some(None),
            "a resent exchange gives no sample"
        );
    }

    fn reassemble(frags: Vec<Bytes>) -> Option<Bytes> {
        let mut r = Reassembler::<u8>::new(8, 1 << 20, 1_000);
        let mut out = None;
        for d in frags {
            if let Pushed::Complete(b) = r.push(0, Fragment::decode(d).expect("valid"), 0) {
                out = Some(b);
            }
        }
        out
    }

    proptest! {
        #[test]
        fn any_order_and_duplicates_reassemble(
            msg in proptest::collection::vec(any::<u8>(), 0..MAX_MESSAGE),
            mtu in MIN_DATAGRAM..9000usize,
            seed in any::<u64>(),
        ) {
            let mut frags = fragment(7, &msg, mtu).unwrap();
            prop_assert!(frags.iter().all(|f| f.len() <= mtu));
            // Shuffle deterministically and duplicate the first fragment.
            let n = frags.len();
            for i in (1..n).rev() {
                frags.swap(i, (seed.wrapping_mul(i as u64 + 1) >> 7) as usize % (i + 1));
            }
            let first = frags[0].clone();
            frags.insert(n / 2, first);
            let got = reassemble(frags.into_vec());
            prop_assert_eq!(got.as_deref(), Some(&msg[..]));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = lone_frame(&bytes);
            let _ = Fragment::decode(Bytes::from(bytes));
        }

        /// A message framed alone is the one fragment `fragment` makes of it, and
        /// `lone_frame` names it; a message in several fragments is not framed alone.
        #[test]
        fn a_lone_frame_is_the_single_fragment_and_says_what_it_carries(
            len in 0..3000usize,
            id in any::<u64>(),
            route in any::<u8>(),
        ) {
            let msg = vec![5u8; len];
            let frags = fragment_routed(id, &msg, 1500, route).unwrap();
            let header = lone_header(id, len, route).unwrap();
            if frags.len() == 1 {
                prop_assert_eq!(&frags[0][..HEADER], &header[..]);
                prop_assert_eq!(lone_frame(&frags[0]), Some((id, route)));
            } else {
                prop_assert!(frags.iter().all(|f| lone_frame(f).is_none()));
            }
        }
    }

    #[test]
    fn bad_datagrams_are_refused_with_reasons() {
        let good = fragment(1, b"hello", 1500).unwrap().remove(0);
        assert!(Fragment::decode(good.clone()).is_ok());
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut v = good.to_vec();
            f(&mut v);
            Fragment::decode(Bytes::from(v)).unwrap_err()
        };
        assert!(matches!(bad(&|v| v[0] = b'X'), FrameError::Magic(_)));
        assert_eq!(bad(&|v| v[4] = 9), FrameError::Version(9));
        assert!(matches!(bad(&|v| v[5] = 1), FrameError::Header(_)));
        assert!(matches!(bad(&|v| v[22] = 1), FrameError::Header(_)));
        // Any route is a valid route: it only picks a receive loop.
        let mut routed = good.to_vec();
        routed[ROUTE] = 0xa5;
        assert_eq!(Fragment::decode(Bytes::from(routed)).unwrap().route, 0xa5);
        assert!(matches!(
            bad(&|v| v.truncate(HEADER + 2)),
            FrameError::Truncated { .. }
        ));
        assert!(matches!(bad(&|v| v.push(0)), FrameError::Header(_)));
        // A lone fragment must be the whole message.
        assert!(matches!(
            bad(&|v| v[18..20].copy_from_slice(&1u16.to_le_bytes())),
            FrameError::Header(_)
        ));
        // Forged offsets in a fragmented message.
        let two = fragment(3, &[7u8; 1000], 600).unwrap();
        let mut v = two[0].to_vec();
        v[18..20].copy_from_slice(&4u16.to_le_bytes());
        assert!(Fragment::decode(Bytes::from(v)).is_err());
        let mut v = two[1].to_vec();
        v[18..20].copy_from_slice(&(1000u16 - 3).to_le_bytes());
        v[20..22].copy_from_slice(&3u16.to_le_bytes());
        v.truncate(HEADER + 3);
        let f = Fragment::decode(Bytes::from(v)).unwrap();
        let mut r = Reassembler::<u8>::new(4, 1 << 20, 1_000);
        // A 997-byte chunk is a valid split on its own, but not with the real first fragment.
        assert_eq!(r.push(0, f, 0), Pushed::Pending);
        let first = Fragment::decode(two[0].clone()).unwrap();
        assert_eq!(r.push(0, first, 0), Pushed::Conflict);
        assert_eq!(r.pending(), 0);
        assert!(matches!(
            bad(&|v| v[16..18].copy_from_slice(&9000u16.to_le_bytes())),
            FrameError::TooLarge(9000)
        ));
        assert!(matches!(
            Fragment::decode(Bytes::from_static(b"short")),
            Err(FrameError::Truncated { .. })
        ));
        assert_eq!(
            fragment(1, &[0; MAX_MESSAGE + 1], 1500),
            Err(FrameError::TooLarge(MAX_MESSAGE + 1))
        );
        assert_eq!(
            fragment(1, b"x", 100),
            Err(FrameError::DatagramTooSmall(100))
        );
    }

    #[test]
    fn reassembly_is_bounded_and_expires() {
        let msg = vec![1u8; 3000];
        let mut r = Reassembler::<u8>::new(2, 1 << 20, 1_000);
        for id in 0..3u64 {
            let f = Fragment::decode(fragment(id, &msg, 1500).unwrap().remove(0)).unwrap();
            let want = if id < 2 {
                Pushed::Pending
            } else {
                Pushed::Full
            };
            assert_eq!(r.push(9, f, 0), want);
        }
        assert_eq!(r.expire(500), 0);
        assert_eq!(r.expire(2_000), 2);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn conflicting_fragments_drop_the_message() {
        let a = fragment(5, &[1u8; 3000], 1500).unwrap();
        let b = fragment(5, &[2u8; 3000], 1500).unwrap();
        let mut r = Reassembler::<u8>::new(4, 1 << 20, 1_000);
        assert_eq!(
            r.push(0, Fragment::decode(a[0].clone()).unwrap(), 0),
            Pushed::Pending
        );
        assert_eq!(
            r.push(0, Fragment::decode(b[0].clone()).unwrap(), 0),
            Pushed::Conflict
        );
        assert_eq!(r.pending(), 0);
        // The same id from another peer is another message.
        assert_eq!(
            r.push(1, Fragment::decode(b[0].clone()).unwrap(), 0),
            Pushed::Pending
        );
    }

    #[test]
    fn retransmission_backs_off_then_gives_up() {
        let mut t = Retransmit::new(100, 3);
        t.sent(1, 0);
        t.sent(2, 50);
        assert_eq!(t.next_deadline(), Some(100));
        assert!(t.poll(99).is_empty());
        assert_eq!(t.poll(100), vec![(1, Timeout::Resend(2))]);
        assert!(t.answered(2));
        assert!(!t.answered(2), "a late duplicate reply is not outstanding");
        // The second resend waits twice as long; after the third send's 400 ns, give up.
        assert_eq!(t.poll(300), vec![(1, Timeout::Resend(3))]);
        assert!(t.poll(699).is_empty());
        assert_eq!(t.poll(700), vec![(1, Timeout::GiveUp)]);
        assert!(t.is_empty());
    }

    #[test]
    fn flat_resends_wait_the_first_timeout_before_the_backoff() {
        let mut t = Retransmit::new(100, 3).with_flat_resends(FLAT_RESENDS);
        t.sent(1, 0);
        assert_eq!(t.poll(100), vec![(1, Timeout::Resend(2))]);
        // The first resends wait the first timeout again; after the third send's 100 ns,
        // give up.
        assert!(t.poll(199).is_empty());
        assert_eq!(t.poll(200), vec![(1, Timeout::Resend(3))]);
        assert!(t.poll(299).is_empty());
        assert_eq!(t.poll(300), vec![(1, Timeout::GiveUp)]);
        assert!(t.is_empty());
    }

    /// When each send of one exchange times out, for a path that never answers.
    fn resend_times(t: &mut Retransmit, until: Nanos) -> Vec<Nanos> {
        let mut at = Vec::new();
        while let Some(d) = t.next_deadline().filter(|&d| d <= until) {
            if t.poll(d)
                .iter()
                .any(|(_, o)| matches!(o, Timeout::Resend(_)))
            {
                at.push(d);
            }
        }
        at
    }

    #[test]
    fn a_silent_path_is_resent_to_flat_then_doubling_within_the_longest_backoff() {
        let mut t = Retransmit::new(100, 9)
            .with_max_backoff(1_000)
            .with_flat_resends(FLAT_RESENDS);
        t.sent(1, 0);
        // FLAT_RESENDS (2) resends wait one timeout, then 200, 400, 800, and 1,000 at most.
        assert_eq!(FLAT_RESENDS, 2);
        assert_eq!(
            resend_times(&mut t, 10_000),
            vec![100, 200, 300, 500, 900, 1_700, 2_700, 3_700]
        );
    }

    #[test]
    fn an_answer_on_the_path_takes_the_others_back_to_their_first_timeout() {
        let mut t = Retransmit::new(100, 9).with_flat_resends(FLAT_RESENDS);
        for id in 1..=3 {
            t.sent(id, 0);
        }
        // All three are lost four times running: resent at 100, 200, 300 and 500, and their
        // next wait is 400.
        for now in [100, 200, 300, 500] {
            assert_eq!(t.poll(now).len(), 3);
        }
        assert_eq!(t.next_deadline(), Some(900));
        // Exchange 2 is answered at 550: its path delivers. Exchange 1 (on it) falls back to
        // 100 after its last send, then the flat resends again; exchange 3 (on another path)
        // keeps its backoff.
        assert!(t.answered(2));
        t.progressed(|id| id == 1);
        assert_eq!(t.poll(599), vec![]);
        assert_eq!(t.poll(600), vec![(1, Timeout::Resend(6))]);
        assert_eq!(t.poll(700), vec![(1, Timeout::Resend(7))]);
        assert_eq!(t.poll(800), vec![(1, Timeout::Resend(8))]);
        assert_eq!(t.poll(900), vec![(3, Timeout::Resend(6))]);
        assert_eq!(t.next_deadline(), Some(1_000));
    }

    #[test]
    fn progress_leaves_a_timer_that_never_backed_off_alone() {
        let mut t = Retransmit::new(100, 3);
        t.sent(1, 0);
        t.progressed(|_| true);
        assert_eq!(t.next_deadline(), Some(100));
        assert_eq!(t.poll(100), vec![(1, Timeout::Resend(2))]);
        t.progressed(|_| true);
        assert_eq!(t.next_deadline(), Some(200));
    }
}
