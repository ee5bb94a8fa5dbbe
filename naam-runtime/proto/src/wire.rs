//! The wire codec for active messages and replies: pure, zero-copy on decode (args and reply
//! payloads are `Bytes` slices of the received buffer), strict on every field.
//!
//! Request (all integers little-endian):
//! ```text
//!  0 u8  version (1)        1 u8  kind (1 = request)    2 u16 flags
//!  4 u32 app                8 u32 handler id           12 u16 steps already run (hops)
//! 14 u8  state words (≤ 8) 15 u8  descriptors (≤ 8)    16 u64 request id
//! 24 u16 args length       26 u16 partial reply length 28 u32 reserved (0)
//! 32 args | state words × 8 | descriptors × 24 (rkey u64, offset u64, len u32, access u32)
//!    | partial reply bytes (a continuation carries the reply built so far)
//! ```
//! Reply:
//! ```text
//!  0 u8  version (1)        1 u8  kind (2 = reply)      2 u16 status
//!  4 u32 app                8 u32 code (handler error code or detail)
//! 12 u16 steps run         14 u8  placement            15 u8  reserved (0)
//! 16 u64 request id        24 u32 payload length       28 u32 reserved (0)
//! 32 load feedback: u32 queue depth, u16 utilisation ‰, u16 reserved, u64 queueing delay ns,
//!    u64 service ns
//! 56 payload
//! ```

use bytes::{Buf, BufMut, Bytes, BytesMut};
use naam_ebpf::abi::{Descriptor, ACCESS_MASK, ARGS_CAP, MAX_NEXT, REPLY_CAP, STATE_WORDS};
use serde::Serialize;

use crate::fields::Fields;
use crate::kind::{REPLY as KIND_REPLY, REQUEST as KIND_REQUEST, VERSION};
use crate::limits::{DESCRIPTOR_SIZE, REPLY_HEADER, REQUEST_HEADER};
use crate::Placement;

/// Where a request's flags (a little-endian `u16`), app and handler ids (`u32`s) lie in its
/// header, as [`Request::encode`] writes it.
const FLAGS_AT: usize = 2;
const APP_AT: usize = 4;
const HANDLER_AT: usize = 8;

/// Bits of [`Request::flags`]; a request with a bit outside [`flags::ALL`] does not decode.
pub mod flags {
    /// The handler may return `Write`: the message goes to the app's write owner.
    pub const WRITE: u16 = 1;
    /// A retransmission of an earlier request id (writes are deduplicated).
    pub const RETRY: u16 = 2;
    /// Run at the host (a placement baseline: the switch does not steer it; the XDP eSwitch
    /// reads it too).
    pub const PIN_HOST: u16 = naam_ebpf::eswitch::FLAG_PIN_HOST;
    /// Run at the NIC (a placement baseline: the switch does not steer it).
    pub const PIN_NIC: u16 = naam_ebpf::eswitch::FLAG_PIN_NIC;
    /// Every defined flag.
    pub const ALL: u16 = WRITE | RETRY | PIN_HOST | PIN_NIC;
}

/// Why bytes are not a valid message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the header or the lengths it declares.
    #[error("truncated message: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes required.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// Trailing bytes after the declared contents.
    #[error("message is {actual} bytes but its header declares {expected}")]
    LengthMismatch {
        /// Declared length.
        expected: usize,
        /// Actual length.
        actual: usize,
    },
    /// A version byte other than [`VERSION`].
    #[error("unsupported wire version {0} (expected {VERSION})")]
    Version(u8),
    /// Unknown or unexpected kind.
    #[error("unexpected message kind {0}")]
    Kind(u8),
    /// A count or length over its cap.
    #[error("{field} is {value}, over the limit of {limit}")]
    TooLarge {
        /// Field name.
        field: &'static str,
        /// Value found.
        value: usize,
        /// The limit it is over (a wire constant such as `ARGS_CAP` or `MAX_NEXT`).
        limit: usize,
    },
    /// Unknown flag bits, reserved bits set, or an invalid enumeration value.
    #[error("invalid {field}: {value:#x}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// Value found.
        value: u64,
    },
}

/// Up to [`MAX_NEXT`] descriptors, stored inline. Two lists are equal when they hold the
/// same descriptors (what an [`Descriptors::assign`] of a shorter list left behind its end
/// does not count).
#[derive(Clone, Copy, Debug, Default)]
pub struct Descriptors {
    items: [Descriptor; MAX_NEXT],
    len: u8,
}

impl Descriptors {
    /// An empty list.
    pub const fn new() -> Self {
        Descriptors {
            items: [Descriptor {
                rkey: 0,
                offset: 0,
                len: 0,
                access: 0,
            }; MAX_NEXT],
            len: 0,
        }
    }

    /// From a slice; [`WireError::TooLarge`] when it holds more than [`MAX_NEXT`].
    pub fn from_slice(ds: &[Descriptor]) -> Result<Self, WireError> {
        if ds.len() > MAX_NEXT {
            return Err(WireError::TooLarge {
                field: "descriptor count",
                value: ds.len(),
                limit: MAX_NEXT,
            });
        }
        let mut d = Descriptors::new();
        d.items[..ds.len()].copy_from_slice(ds);
        d.len = ds.len() as u8;
        Ok(d)
    }

    /// Replaces the list with `ds` in place (only `ds` is copied); [`WireError::TooLarge`],
    /// and the list unchanged, when it holds more than [`MAX_NEXT`].
    #[inline]
    pub fn assign(&mut self, ds: &[Descriptor]) -> Result<(), WireError> {
        if ds.len() > MAX_NEXT {
            return Err(WireError::TooLarge {
                field: "descriptor count",
                value: ds.len(),
                limit: MAX_NEXT,
            });
        }
        // One descriptor at a time: a step names a few (MICA's GET one or two), and a
        // `memcpy` call cost more than the copy.
        for (item, d) in self.items.iter_mut().zip(ds) {
            *item = *d;
        }
        self.len = ds.len() as u8;
        Ok(())
    }

    /// Appends; `false` when full.
    pub fn push(&mut self, d: Descriptor) -> bool {
        if (self.len as usize) < MAX_NEXT {
            self.items[self.len as usize] = d;
            self.len += 1;
            true
        } else {
            false
        }
    }

    /// The descriptors held, in push order (at most [`MAX_NEXT`]).
    #[inline]
    pub fn as_slice(&self) -> &[Descriptor] {
        &self.items[..self.len as usize]
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl PartialEq for Descriptors {
    fn eq(&self, other: &Descriptors) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Descriptors {}

/// An active message: a handler of an app to run over the descriptors' ranges; a
/// continuation also carries the state words and reply bytes of the steps run so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// App whose handler runs; the descriptors' rkeys must name this app's regions.
    pub app: u32,
    /// Handler id (see [`crate::handler_id`]).
    pub handler: u32,
    /// Request id, unique per client.
    pub request_id: u64,
    /// [`flags`] bits.
    pub flags: u16,
    /// Steps already run (a continuation resumes after them).
    pub steps: u16,
    /// Inline args (at most `ARGS_CAP` bytes), handed unchanged to every step.
    pub args: Bytes,
    /// State words (trailing zero words are not sent).
    pub state: [u64; STATE_WORDS],
    /// Descriptors for the next step.
    pub descriptors: Descriptors,
    /// Reply bytes built by earlier steps.
    pub partial_reply: Bytes,
    /// The session the request arrived in (0 for in-process callers). Not on the wire: the
    /// driver sets it after checking the seal, and writes are deduplicated per (origin,
    /// request id), so one client cannot answer for another's ids.
    pub origin: u64,
    /// Handed over by a client in the server's own process (`ServerEndpoint::
    /// request_in_process`), never in a datagram. Not on the wire, false when decoded: such a
    /// request exists once and is never sent again (its client waits, it does not resend), so
    /// a write of it takes no deduplication entry, whose insert and eviction were most of the
    /// hash-table share of a RESP front's writes (bench/RESULTS.md).
    pub handed_in: bool,
}

impl Default for Request {
    /// [`Request::taken`], so that a request is taken from where it lies with
    /// `std::mem::take`.
    fn default() -> Request {
        Request::taken()
    }
}

impl Request {
    /// What is left where a request was taken from (`std::mem::take`): app 0, nothing in
    /// it, allocating nothing.
    pub fn taken() -> Request {
        Request::new(0, 0, 0, Bytes::new(), Descriptors::new())
    }

    /// A fresh request (step 0, no state, no partial reply).
    pub fn new(
        app: u32,
        handler: u32,
        request_id: u64,
        args: Bytes,
        descriptors: Descriptors,
    ) -> Self {
        Request {
            app,
            handler,
            request_id,
            flags: 0,
            steps: 0,
            args,
            state: [0; STATE_WORDS],
            descriptors,
            partial_reply: Bytes::new(),
            origin: 0,
            handed_in: false,
        }
    }

    fn state_words(&self) -> usize {
        self.state
            .iter()
            .rposition(|&w| w != 0)
            .map_or(0, |i| i + 1)
    }

    /// The request a client call makes: `args` and `descs` for `handler` of `app`, request id
    /// `id`, checked against the wire limits. Its args get an allocation of their own; a
    /// caller that makes many requests builds each in the last ([`Request::refill_call`]).
    pub fn for_call(
        app: u32,
        handler: u32,
        id: u64,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Request, WireError> {
        Request::check_call(args, descs)?;
        let descriptors = Descriptors::from_slice(descs)?;
        Ok(Request::new(
            app,
            handler,
            id,
            Bytes::copy_from_slice(args),
            descriptors,
        ))
    }

    /// Makes this request the fresh call [`Request::for_call`] would make, in place, for a
    /// caller that builds each call in the request of its last one. The args' buffer is
    /// written again when nothing else holds it and it is of their length: no allocation, no
    /// reference counted (keys of one length, as most of a workload's are). Else the args get
    /// a buffer of exactly their length, for the calls after: `Bytes` keeps a buffer with room
    /// to spare behind a shared header, which it would allocate at every call. A call that
    /// does not pass the checks leaves the request as it was.
    pub fn refill_call(
        &mut self,
        (app, handler, id): (u32, u32, u64),
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<(), WireError> {
        Request::check_call(args, descs)?;
        self.descriptors.assign(descs)?;
        self.args = match std::mem::take(&mut self.args).try_into_mut() {
            Ok(mut buf) if buf.capacity() == args.len() => {
                buf.clear();
                buf.extend_from_slice(args);
                buf.freeze()
            }
            _ => Bytes::from(args.to_vec()),
        };
        self.app = app;
        self.handler = handler;
        self.request_id = id;
        self.flags = 0;
        self.steps = 0;
        self.state = [0; STATE_WORDS];
        self.partial_reply = Bytes::new();
        self.origin = 0;
        self.handed_in = false;
        Ok(())
    }

    /// Checks what a fresh call would carry, as [`Request::validate`] would, without building
    /// the request (callers that run the message where they are): the args fit, the
    /// descriptors fit and ask for known rights.
    pub fn check_call(args: &[u8], descs: &[Descriptor]) -> Result<(), WireError> {
        check_len("args length", args.len(), ARGS_CAP)?;
        check_len("descriptor count", descs.len(), MAX_NEXT)?;
        for d in descs {
            check_access(d.access)?;
        }
        Ok(())
    }

    /// The placement a `PIN_*` flag asks for (host wins if both are set).
    pub fn pinned(&self) -> Option<Placement> {
        if self.flags & flags::PIN_HOST != 0 {
            Some(Placement::Host)
        } else if self.flags & flags::PIN_NIC != 0 {
            Some(Placement::Nic)
        } else {
            None
        }
    }

    /// The (app, handler) encoded request `encoded` calls, read without decoding it; `None`
    /// if it is not a request.
    pub fn peek_handler(encoded: &[u8]) -> Option<(u32, u32)> {
        header(encoded, REQUEST_HEADER, KIND_REQUEST).ok()?;
        let e = encoded;
        let u32_at = |i: usize| u32::from_le_bytes([e[i], e[i + 1], e[i + 2], e[i + 3]]);
        Some((u32_at(APP_AT), u32_at(HANDLER_AT)))
    }

    /// A copy of encoded request `encoded` with `flag` set as well (a resend marked
    /// [`flags::RETRY`] without decoding and encoding the request again); `None` if it is not a
    /// request.
    pub fn with_flag(encoded: &[u8], flag: u16) -> Option<Bytes> {
        header(encoded, REQUEST_HEADER, KIND_REQUEST).ok()?;
        let old = u16::from_le_bytes([encoded[FLAGS_AT], encoded[FLAGS_AT + 1]]);
        let mut b = BytesMut::from(encoded);
        b[FLAGS_AT..FLAGS_AT + 2].copy_from_slice(&(old | flag).to_le_bytes());
        Some(b.freeze())
    }

    /// Encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        REQUEST_HEADER
            + self.args.len()
            + 8 * self.state_words()
            + DESCRIPTOR_SIZE * self.descriptors.len()
            + self.partial_reply.len()
    }

    /// Checks the limits that encoding relies on.
    pub fn validate(&self) -> Result<(), WireError> {
        check_len("args length", self.args.len(), ARGS_CAP)?;
        check_len("partial reply length", self.partial_reply.len(), REPLY_CAP)?;
        if self.flags & !flags::ALL != 0 {
            return Err(WireError::Invalid {
                field: "flags",
                value: self.flags as u64,
            });
        }
        for d in self.descriptors.as_slice() {
            check_access(d.access)?;
        }
        Ok(())
    }

    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut BytesMut) -> Result<(), WireError> {
        self.validate()?;
        let words = self.state_words();
        out.reserve(self.encoded_len());
        let mut header = Fields::<REQUEST_HEADER>::new();
        header
            .u8(VERSION)
            .u8(KIND_REQUEST)
            .u16(self.flags)
            .u32(self.app)
            .u32(self.handler)
            .u16(self.steps)
            .u8(words as u8)
            .u8(self.descriptors.len() as u8)
            .u64(self.request_id)
            .u16(self.args.len() as u16)
            .u16(self.partial_reply.len() as u16)
            .u32(0);
        header.put_into(out);
        out.put_slice(&self.args);
        let mut tail = Fields::<{ 8 * STATE_WORDS + DESCRIPTOR_SIZE * MAX_NEXT }>::new();
        for w in &self.state[..words] {
            tail.u64(*w);
        }
        for d in self.descriptors.as_slice() {
            tail.u64(d.rkey).u64(d.offset).u32(d.len).u32(d.access);
        }
        out.put_slice(tail.as_slice());
        out.put_slice(&self.partial_reply);
        Ok(())
    }

    /// The encoding as one buffer.
    pub fn to_bytes(&self) -> Result<Bytes, WireError> {
        let mut b = BytesMut::with_capacity(self.encoded_len());
        self.encode(&mut b)?;
        Ok(b.freeze())
    }

    /// Decodes a request; `args` and `partial_reply` share `buf`'s storage.
    pub fn decode(buf: Bytes) -> Result<Request, WireError> {
        let have = buf.len();
        let mut h = header(&buf, REQUEST_HEADER, KIND_REQUEST)?;
        let flag_bits = h.get_u16_le();
        if flag_bits & !flags::ALL != 0 {
            return Err(WireError::Invalid {
                field: "flags",
                value: flag_bits as u64,
            });
        }
        let app = h.get_u32_le();
        let handler = h.get_u32_le();
        let steps = h.get_u16_le();
        let words = h.get_u8() as usize;
        let ndesc = h.get_u8() as usize;
        let request_id = h.get_u64_le();
        let args_len = h.get_u16_le() as usize;
        let reply_len = h.get_u16_le() as usize;
        let reserved = h.get_u32_le();
        if reserved != 0 {
            return Err(WireError::Invalid {
                field: "reserved",
                value: reserved as u64,
            });
        }
        check_len("state words", words, STATE_WORDS)?;
        check_len("descriptor count", ndesc, MAX_NEXT)?;
        check_len("args length", args_len, ARGS_CAP)?;
        check_len("partial reply length", reply_len, REPLY_CAP)?;
        let expected = REQUEST_HEADER + args_len + 8 * words + DESCRIPTOR_SIZE * ndesc + reply_len;
        check_exact(have, expected)?;
        let mut at = REQUEST_HEADER + args_len;
        let mut body = &buf[at..];
        let mut state = [0u64; STATE_WORDS];
        for w in state.iter_mut().take(words) {
            *w = body.get_u64_le();
        }
        // Canonical form: trailing zero words are never sent, so one message has one encoding.
        if words > 0 && state[words - 1] == 0 {
            return Err(WireError::Invalid {
                field: "state words (trailing zero word)",
                value: words as u64,
            });
        }
        let mut descriptors = Descriptors::new();
        for _ in 0..ndesc {
            let d = Descriptor {
                rkey: body.get_u64_le(),
                offset: body.get_u64_le(),
                len: body.get_u32_le(),
                access: body.get_u32_le(),
            };
            check_access(d.access)?;
            descriptors.push(d);
        }
        at += 8 * words + DESCRIPTOR_SIZE * ndesc;
        let partial_reply = buf.slice(at..at + reply_len);
        // The args are what is left of `buf` (no reference counted for a slice of it).
        let mut args = buf;
        args.truncate(REQUEST_HEADER + args_len);
        args.advance(REQUEST_HEADER);
        Ok(Request {
            app,
            handler,
            request_id,
            flags: flag_bits,
            steps,
            args,
            state,
            descriptors,
            partial_reply,
            origin: 0,
            handed_in: false,
        })
    }
}

fn check_len(field: &'static str, value: usize, limit: usize) -> Result<(), WireError> {
    if value > limit {
        Err(WireError::TooLarge {
            field,
            value,
            limit,
        })
    } else {
        Ok(())
    }
}

fn check_access(access: u32) -> Result<(), WireError> {
    if access == 0 || access & !ACCESS_MASK != 0 {
        return Err(WireError::Invalid {
            field: "descriptor access",
            value: access as u64,
        });
    }
    Ok(())
}

/// The fixed header of `size` bytes, after checking the version and that the kind is `want`;
/// the returned slice starts after those two bytes. Every codec of this crate opens its
/// message with it.
pub fn header(buf: &[u8], size: usize, want: u8) -> Result<&[u8], WireError> {
    let have = buf.len();
    if have < size {
        return Err(WireError::Truncated { need: size, have });
    }
    if buf[0] != VERSION {
        return Err(WireError::Version(buf[0]));
    }
    if buf[1] != want {
        return Err(WireError::Kind(buf[1]));
    }
    Ok(&buf[2..size])
}

/// A message must be exactly as long as its header declares.
pub fn check_exact(have: usize, expected: usize) -> Result<(), WireError> {
    if have < expected {
        return Err(WireError::Truncated {
            need: expected,
            have,
        });
    }
    if have > expected {
        return Err(WireError::LengthMismatch {
            expected,
            actual: have,
        });
    }
    Ok(())
}

/// How a request ended, as its reply (or a one-sided completion) says; a `u16` on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u16)]
pub enum Status {
    /// The handler completed; the payload is its reply.
    Ok = 0,
    /// The handler returned `Error(code)`.
    HandlerError = 1,
    /// No such app.
    UnknownApp = 2,
    /// No such handler in the app.
    UnknownHandler = 3,
    /// A descriptor names an rkey that does not exist or belongs to another app.
    BadKey = 4,
    /// A descriptor's range runs past its region.
    OutOfRange = 5,
    /// A descriptor asks for rights its region does not grant.
    AccessDenied = 6,
    /// The request bytes were malformed.
    Malformed = 7,
    /// A queue was full: retry later (back-pressure).
    Busy = 8,
    /// More steps than the hop limit.
    HopLimit = 9,
    /// The handler aborted (panic or explicit abort).
    Aborted = 10,
    /// The handler faulted (out-of-bounds access, budget, invalid output).
    Fault = 11,
    /// A write reached a placement that is not the app's write owner.
    NotOwner = 12,
    /// The placement cannot run this handler (writes at the client).
    PlacementRefused = 13,
    /// The step asked for something the runtime refuses (bad write op, too many retries).
    Refused = 14,
    /// The server is shutting down or a peer is gone.
    Unavailable = 15,
    /// A compare-and-swap in the write batch failed; the operations before it were applied.
    Conflict = 16,
    /// The message did not come in a session the receiver knows: handshake first.
    NoSession = 17,
}

impl Status {
    /// The status's name wherever people or tools read it (JSON, metrics' `status` label,
    /// logs): kebab-case, `ok`, `handler-error`, as JSON serializes it.
    pub fn name(self) -> &'static str {
        use Status::*;
        match self {
            Ok => "ok",
            HandlerError => "handler-error",
            UnknownApp => "unknown-app",
            UnknownHandler => "unknown-handler",
            BadKey => "bad-key",
            OutOfRange => "out-of-range",
            AccessDenied => "access-denied",
            Malformed => "malformed",
            Busy => "busy",
            HopLimit => "hop-limit",
            Aborted => "aborted",
            Fault => "fault",
            NotOwner => "not-owner",
            PlacementRefused => "placement-refused",
            Refused => "refused",
            Unavailable => "unavailable",
            Conflict => "conflict",
            NoSession => "no-session",
        }
    }

    /// From the wire value.
    pub fn from_u16(v: u16) -> Option<Status> {
        use Status::*;
        Some(match v {
            0 => Ok,
            1 => HandlerError,
            2 => UnknownApp,
            3 => UnknownHandler,
            4 => BadKey,
            5 => OutOfRange,
            6 => AccessDenied,
            7 => Malformed,
            8 => Busy,
            9 => HopLimit,
            10 => Aborted,
            11 => Fault,
            12 => NotOwner,
            13 => PlacementRefused,
            14 => Refused,
            15 => Unavailable,
            16 => Conflict,
            17 => NoSession,
            _ => return None,
        })
    }
}

/// Load feedback piggybacked on every reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LoadFeedback {
    /// Messages queued at the placement when this one finished.
    pub queue_depth: u32,
    /// Utilisation of the placement's executors, in thousandths.
    pub utilisation_permille: u16,
    /// Queueing-delay EWMA at the placement, nanoseconds.
    pub queue_delay_ns: u64,
    /// Service time of this message, nanoseconds.
    pub service_ns: u64,
}

/// The answer to one request, from the placement that finished it, with that placement's
/// load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// App of the request it answers, echoed back.
    pub app: u32,
    /// Request id it answers.
    pub request_id: u64,
    /// How the call ended (a `u16` on the wire): `Ok`, or the kind of error, which `code`
    /// details.
    pub status: Status,
    /// Handler error code or detail.
    pub code: u32,
    /// Steps run over the message's life, at every placement it visited.
    pub steps: u16,
    /// Where it ran.
    pub placement: Placement,
    /// Load at that placement.
    pub load: LoadFeedback,
    /// Reply bytes (status `Ok`) or an error message.
    pub payload: Bytes,
}

/// How a call ended, read in place: the fields of a [`Reply`] a client library acts on, with
/// the payload borrowed from wherever the fabric holds it (a reply's buffer, or the machine the
/// message ran in). What [`crate::transport::Transport::call_with`] hands its reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyView<'a> {
    /// How the call ended: `Ok`, or the kind of error, which `code` details.
    pub status: Status,
    /// Handler error code or detail.
    pub code: u32,
    /// Steps run over the message's life, at every placement it visited.
    pub steps: u16,
    /// Where it ran.
    pub placement: Placement,
    /// Reply bytes (status `Ok`) or an error message.
    pub payload: &'a [u8],
}

impl Reply {
    /// A slot that a reply answered at once is written into ([`crate::endpoint::Routed`]):
    /// no answer yet, so `Unavailable` with no payload, from app 0 at the host. The layers a
    /// request handed in crosses write its reply where the caller keeps it instead of
    /// returning it: a reply is about 90 bytes, and moved out of each layer it was copied at
    /// each, in wide loads of what narrow stores had just written (which stalled).
    pub fn unanswered() -> Reply {
        Reply {
            app: 0,
            request_id: 0,
            status: Status::Unavailable,
            code: 0,
            steps: 0,
            placement: Placement::Host,
            load: LoadFeedback::default(),
            payload: Bytes::new(),
        }
    }

    /// The reply as a [`ReplyView`] of its own payload.
    pub fn view(&self) -> ReplyView<'_> {
        ReplyView {
            status: self.status,
            code: self.code,
            steps: self.steps,
            placement: self.placement,
            payload: &self.payload,
        }
    }

    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut BytesMut) -> Result<(), WireError> {
        check_len("payload length", self.payload.len(), REPLY_CAP)?;
        out.reserve(REPLY_HEADER + self.payload.len());
        let mut header = Fields::<REPLY_HEADER>::new();
        header
            .u8(VERSION)
            .u8(KIND_REPLY)
            .u16(self.status as u16)
            .u32(self.app)
            .u32(self.code)
            .u16(self.steps)
            .u8(self.placement.abi() as u8)
            .u8(0)
            .u64(self.request_id)
            .u32(self.payload.len() as u32)
            .u32(0)
            .u32(self.load.queue_depth)
            .u16(self.load.utilisation_permille)
            .u16(0)
            .u64(self.load.queue_delay_ns)
            .u64(self.load.service_ns);
        header.put_into(out);
        out.put_slice(&self.payload);
        Ok(())
    }

    /// The encoding as one buffer.
    pub fn to_bytes(&self) -> Result<Bytes, WireError> {
        let mut b = BytesMut::with_capacity(REPLY_HEADER + self.payload.len());
        self.encode(&mut b)?;
        Ok(b.freeze())
    }

    /// Decodes a reply; the payload shares `buf`'s storage.
    pub fn decode(buf: Bytes) -> Result<Reply, WireError> {
        let have = buf.len();
        let mut h = header(&buf, REPLY_HEADER, KIND_REPLY)?;
        let raw_status = h.get_u16_le();
        let status = Status::from_u16(raw_status).ok_or(WireError::Invalid {
            field: "status",
            value: raw_status as u64,
        })?;
        let app = h.get_u32_le();
        let code = h.get_u32_le();
        let steps = h.get_u16_le();
        let raw_placement = h.get_u8();
        let placement = Placement::from_abi(raw_placement as u32).ok_or(WireError::Invalid {
            field: "placement",
            value: raw_placement as u64,
        })?;
        let r0 = h.get_u8();
        let request_id = h.get_u64_le();
        let payload_len = h.get_u32_le() as usize;
        let r1 = h.get_u32_le();
        let queue_depth = h.get_u32_le();
        let utilisation_permille = h.get_u16_le();
        let r2 = h.get_u16_le();
        let queue_delay_ns = h.get_u64_le();
        let service_ns = h.get_u64_le();
        if r0 != 0 || r1 != 0 || r2 != 0 {
            return Err(WireError::Invalid {
                field: "reserved",
                value: (r0 as u64) | (r1 as u64) << 8 | (r2 as u64) << 40,
            });
        }
        check_len("payload length", payload_len, REPLY_CAP)?;
        let expected = REPLY_HEADER + payload_len;
        check_exact(have, expected)?;
        Ok(Reply {
            app,
            request_id,
            status,
            code,
            steps,
            placement,
            load: LoadFeedback {
                queue_depth,
                utilisation_permille,
                queue_delay_ns,
                service_ns,
            },
            payload: {
                // The payload is what is left of `buf` (no reference counted for a slice).
                let mut payload = buf;
                payload.advance(REPLY_HEADER);
                payload
            },
        })
    }
}

/// Bits of a request id that count a client's messages; the client's id fills the rest.
pub const REQUEST_SEQ_BITS: u32 = 40;

/// The request id of message `seq` of client `client` (client ids are 24 bits): unique per
/// client, which is what write deduplication and reply matching key on.
pub fn request_id(client: u32, seq: u64) -> u64 {
    ((client as u64) << REQUEST_SEQ_BITS) | (seq & ((1 << REQUEST_SEQ_BITS) - 1))
}

#[cfg(test)]
mod status_names {
    use super::Status;

    #[test]
    fn every_status_is_named_as_json_names_it() {
        for v in 0..=u16::MAX {
            let Some(s) = Status::from_u16(v) else {
                continue;
            };
            let json = serde_json::to_string(&s).expect("serializes");
            assert_eq!(json, format!("\"{}\"", s.name()), "{s:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use naam_ebpf::abi::ACCESS_READ;
    use proptest::prelude::*;

    fn descriptor() -> impl Strategy<Value = Descriptor> {
        (any::<u64>(), any::<u64>(), any::<u32>(), 1u32..8).prop_map(
            |(rkey, offset, len, access)| Descriptor {
                rkey,
                offset,
                len,
                access,
            },
        )
    }

    fn request() -> impl Strategy<Value = Request> {
        (
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            0u16..4,
            any::<u16>(),
            proptest::collection::vec(any::<u8>(), 0..=ARGS_CAP),
            proptest::array::uniform8(any::<u64>()),
            proptest::collection::vec(descriptor(), 0..=MAX_NEXT),
            proptest::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(
                |(app, handler, request_id, flags, steps, args, state, ds, reply)| Request {
                    app,
                    handler,
                    request_id,
                    flags,
                    steps,
                    args: Bytes::from(args),
                    state,
                    descriptors: Descriptors::from_slice(&ds).unwrap(),
                    partial_reply: Bytes::from(reply),
                    origin: 0,
                    handed_in: false,
                },
            )
    }

    fn reply() -> impl Strategy<Value = Reply> {
        (
            any::<u32>(),
            any::<u64>(),
            0u16..17,
            any::<u32>(),
            any::<u16>(),
            0usize..3,
            any::<(u32, u16, u64, u64)>(),
            proptest::collection::vec(any::<u8>(), 0..=REPLY_CAP),
        )
            .prop_map(
                |(app, request_id, status, code, steps, p, (q, u, d, s), payload)| Reply {
                    app,
                    request_id,
                    status: Status::from_u16(status).unwrap(),
                    code,
                    steps,
                    placement: Placement::ALL[p],
                    load: LoadFeedback {
                        queue_depth: q,
                        utilisation_permille: u,
                        queue_delay_ns: d,
                        service_ns: s,
                    },
                    payload: Bytes::from(payload),
                },
            )
    }

    #[test]
    fn a_refilled_call_writes_its_last_args_buffer_again_when_it_alone_holds_it() {
        let d = Descriptor {
            rkey: 7,
            offset: 8,
            len: 16,
            access: ACCESS_READ,
        };
        let mut req = Request::default();
        assert_eq!(req, Request::taken());
        req.refill_call((1, 2, 3), b"key-0001", &[d]).unwrap();
        assert_eq!(req, Request::for_call(1, 2, 3, b"key-0001", &[d]).unwrap());
        let first = req.args.as_ptr();
        // Continuation fields of an earlier run do not survive a refill.
        req.steps = 4;
        req.flags = flags::RETRY;
        req.partial_reply = Bytes::from_static(b"partial");
        req.refill_call((1, 5, 9), b"key-0002", &[]).unwrap();
        assert_eq!(req, Request::for_call(1, 5, 9, b"key-0002", &[]).unwrap());
        assert_eq!(req.args.as_ptr(), first, "the buffer was not reused");
        // Held elsewhere: never written, a new buffer instead.
        let held = req.args.clone();
        req.refill_call((1, 2, 3), b"key-0003", &[]).unwrap();
        assert_eq!(&held[..], b"key-0002");
        assert_eq!(&req.args[..], b"key-0003");
        // Another length: a buffer of that length, written again by the calls after.
        req.refill_call((1, 2, 3), b"a longer key", &[d, d])
            .unwrap();
        assert_eq!(&req.args[..], b"a longer key");
        assert_eq!(req.descriptors.as_slice(), &[d, d]);
        let longer = req.args.as_ptr();
        req.refill_call((1, 2, 3), b"another key!", &[d]).unwrap();
        assert_eq!(
            (&req.args[..], req.args.as_ptr()),
            (&b"another key!"[..], longer)
        );
        assert_eq!(
            req,
            Request::for_call(1, 2, 3, b"another key!", &[d]).unwrap()
        );
        req.refill_call((1, 2, 3), b"", &[]).unwrap();
        assert_eq!(req, Request::for_call(1, 2, 3, b"", &[]).unwrap());
        // Refused by the checks: left as it was.
        let before = req.clone();
        let too_long = vec![0u8; ARGS_CAP + 1];
        assert!(req.refill_call((9, 9, 9), &too_long, &[]).is_err());
        assert_eq!(req, before);
    }

    proptest! {
        #[test]
        fn request_round_trip(r in request()) {
            let bytes = r.to_bytes().unwrap();
            prop_assert_eq!(bytes.len(), r.encoded_len());
            prop_assert_eq!(Request::decode(bytes).unwrap(), r);
        }

        #[test]
        fn a_flag_set_in_the_encoding_is_the_request_encoded_with_it(r in request()) {
            let encoded = r.to_bytes().unwrap();
            prop_assert_eq!(Request::peek_handler(&encoded), Some((r.app, r.handler)));
            let mut retried = r.clone();
            retried.flags |= flags::RETRY;
            prop_assert_eq!(
                Request::with_flag(&encoded, flags::RETRY),
                Some(retried.to_bytes().unwrap())
            );
            // Not a request: another kind, or shorter than a request's header.
            let mut other = encoded.to_vec();
            other[1] = KIND_REPLY;
            prop_assert_eq!(Request::with_flag(&other, flags::RETRY), None);
            prop_assert_eq!(Request::peek_handler(&other), None);
            prop_assert_eq!(Request::with_flag(&encoded[..REQUEST_HEADER - 1], flags::RETRY), None);
        }

        #[test]
        fn reply_round_trip(r in reply()) {
            let bytes = r.to_bytes().unwrap();
            prop_assert_eq!(Reply::decode(bytes).unwrap(), r);
        }

        #[test]
        fn truncations_and_extensions_are_errors(r in request(), cut in any::<usize>()) {
            let bytes = r.to_bytes().unwrap();
            let n = cut % bytes.len();
            prop_assert!(Request::decode(bytes.slice(..n)).is_err());
            let mut longer = BytesMut::from(&bytes[..]);
            longer.put_u8(0);
            let is_mismatch = matches!(Request::decode(longer.freeze()), Err(WireError::LengthMismatch { .. }));
            prop_assert!(is_mismatch);
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Request::decode(Bytes::from(bytes.clone()));
            let _ = Reply::decode(Bytes::from(bytes));
        }
    }

    /// The layout pinned byte by byte (what the eSwitch program and other processes read),
    /// so an encoder and a decoder cannot drift apart together.
    #[test]
    fn encodings_keep_their_layout() {
        let mut r = Request::new(
            0x0a0b_0c0d,
            0x1112_1314,
            0x2122_2324_2526_2728,
            Bytes::from_static(b"ar"),
            Descriptors::from_slice(&[Descriptor {
                rkey: 0x3132_3334_3536_3738,
                offset: 0x4142_4344_4546_4748,
                len: 0x5152_5354,
                access: ACCESS_MASK,
            }])
            .unwrap(),
        );
        r.flags = flags::PIN_HOST;
        r.steps = 0x6162;
        r.state[0] = 0x7172_7374_7576_7778;
        r.partial_reply = Bytes::from_static(b"pr");
        let le = |v: u64, n: usize| v.to_le_bytes()[..n].to_vec();
        let want: Vec<u8> = [
            vec![VERSION, KIND_REQUEST],
            le(flags::PIN_HOST as u64, 2),
            le(0x0a0b_0c0d, 4),
            le(0x1112_1314, 4),
            le(0x6162, 2),
            vec![1, 1],
            le(0x2122_2324_2526_2728, 8),
            le(2, 2),
            le(2, 2),
            le(0, 4),
            b"ar".to_vec(),
            le(0x7172_7374_7576_7778, 8),
            le(0x3132_3334_3536_3738, 8),
            le(0x4142_4344_4546_4748, 8),
            le(0x5152_5354, 4),
            le(ACCESS_MASK as u64, 4),
            b"pr".to_vec(),
        ]
        .concat();
        assert_eq!(&r.to_bytes().unwrap()[..], &want[..]);

        let reply = Reply {
            app: 0x0a0b_0c0d,
            request_id: 0x2122_2324_2526_2728,
            status: Status::Busy,
            code: 0x1112_1314,
            steps: 0x6162,
            placement: Placement::Nic,
            load: LoadFeedback {
                queue_depth: 0x3132_3334,
                utilisation_permille: 0x4142,
                queue_delay_ns: 0x5152_5354_5556_5758,
                service_ns: 0x6162_6364_6566_6768,
            },
            payload: Bytes::from_static(b"pay"),
        };
        let want: Vec<u8> = [
            vec![VERSION, KIND_REPLY],
            le(Status::Busy as u64, 2),
            le(0x0a0b_0c0d, 4),
            le(0x1112_1314, 4),
            le(0x6162, 2),
            vec![Placement::Nic.abi() as u8, 0],
            le(0x2122_2324_2526_2728, 8),
            le(3, 4),
            le(0, 4),
            le(0x3132_3334, 4),
            le(0x4142, 2),
            le(0, 2),
            le(0x5152_5354_5556_5758, 8),
            le(0x6162_6364_6566_6768, 8),
            b"pay".to_vec(),
        ]
        .concat();
        assert_eq!(&reply.to_bytes().unwrap()[..], &want[..]);
    }

    #[test]
    fn decode_is_zero_copy() {
        let r = Request::new(1, 2, 3, Bytes::from_static(b"hello"), Descriptors::new());
        let bytes = r.to_bytes().unwrap();
        let d = Request::decode(bytes.clone()).unwrap();
        assert_eq!(d.args.as_ptr(), bytes[REQUEST_HEADER..].as_ptr());
    }

    #[test]
    fn strict_fields() {
        let r = Request::new(1, 2, 3, Bytes::new(), Descriptors::new());
        let good = r.to_bytes().unwrap().to_vec();
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            Request::decode(Bytes::from(b)).unwrap_err()
        };
        assert_eq!(bad(&|b| b[0] = 9), WireError::Version(9));
        assert_eq!(bad(&|b| b[1] = KIND_REPLY), WireError::Kind(KIND_REPLY));
        assert!(matches!(
            bad(&|b| b[2] = 0x80),
            WireError::Invalid { field: "flags", .. }
        ));
        assert!(matches!(
            bad(&|b| b[14] = 9),
            WireError::TooLarge {
                field: "state words",
                ..
            }
        ));
        assert!(matches!(
            bad(&|b| b[15] = 9),
            WireError::TooLarge {
                field: "descriptor count",
                ..
            }
        ));
        assert!(matches!(
            bad(&|b| b[28] = 1),
            WireError::Invalid {
                field: "reserved",
                ..
            }
        ));
        // One zero state word: not canonical.
        let mut b = good.clone();
        b[14] = 1;
        b.extend([0u8; 8]);
        assert!(matches!(
            Request::decode(Bytes::from(b)),
            Err(WireError::Invalid { .. })
        ));
        let mut ds = Descriptors::new();
        ds.push(Descriptor {
            rkey: 1,
            offset: 0,
            len: 8,
            access: 0,
        });
        let r = Request::new(1, 2, 3, Bytes::new(), ds);
        assert!(matches!(
            r.to_bytes(),
            Err(WireError::Invalid {
                field: "descriptor access",
                ..
            })
        ));
    }
}
