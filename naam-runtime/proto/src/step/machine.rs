//! [`StepMachine`]: one message's steps at one placement, and what it asks of its driver.

use bytes::{Bytes, BytesMut};
use naam_ebpf::abi::{write_kind, Descriptor, Return, WriteOp, ACCESS_MASK, STATE_WORDS};

use super::engine::{Engine, Grant, InsnMix, Invocation, StepFault, StepResult};
use super::error::{FetchError, WriteError};
use crate::arena::ByteArena;
use crate::wire::{Descriptors, ReplyView, Request, Status};
use crate::Placement;

/// Whether a handler only reads, or may return `Write`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandlerKind {
    /// Reads only: may run at any placement, including the client.
    Read,
    /// May write: runs at the app's write owner only.
    Write,
}

/// Bounds on one message's execution.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Limits {
    /// Most steps a message may take over its whole life (hop limit).
    pub max_steps: u16,
    /// Most `Retry` returns (torn optimistic reads) per message at one placement.
    pub max_retries: u16,
}

impl Default for Limits {
    fn default() -> Self {
        Limits::new(32, 64)
    }
}

impl Limits {
    /// At most `max_steps` steps per message and `max_retries` torn-read retries at one
    /// placement.
    pub fn new(max_steps: u16, max_retries: u16) -> Limits {
        Limits {
            max_steps,
            max_retries,
        }
    }
}

/// Longest wait between two attempts of a torn optimistic read.
pub const MAX_RETRY_BACKOFF_NS: u64 = 1_000_000;

/// How much a kept reply buffer grows by at once: sixteen replies of a kilobyte, a
/// pipeline's window of MICA values.
const REPLY_CHUNK: usize = 16 << 10;

/// The writes of one step, applied in order by the write owner: the operations as the handler
/// queued them, read where the engine left them (no copy), the descriptors of the step's
/// segments they name by index, and the staged bytes. The machine checked each operation
/// before it said [`Action::Write`] (target index, range, data, kind); the owner checks them
/// again as it applies them, and [`WriteBatch::target`] and [`WriteBatch::bytes`] answer for
/// any batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteBatch<'a> {
    /// The app of the handler that produced the writes: every target rkey must name one of
    /// this app's regions.
    pub app: u32,
    /// Request id (the owner's deduplication key, with the session).
    pub request_id: u64,
    /// Operations in order, as the handler's context holds them: `segment` indexes
    /// [`WriteBatch::targets`] (and the step's grants, on a path that grants in place), a
    /// `STORE`'s `data_offset` indexes [`WriteBatch::data`].
    pub ops: &'a [WriteOp],
    /// Descriptors of the step's segments, in order, as the message granted them.
    pub targets: &'a [Descriptor],
    /// The step's staged bytes, which the `STORE`s name ranges of (one buffer for the whole
    /// batch, not one per operation).
    pub data: &'a [u8],
}

impl<'a> WriteBatch<'a> {
    /// The bytes a `STORE` writes (empty for an atomic, or an operation of another batch
    /// whose range does not fit this one).
    pub fn bytes(&self, op: &WriteOp) -> &'a [u8] {
        if op.kind != write_kind::STORE {
            return &[];
        }
        let at = op.data_offset as usize;
        self.data.get(at..at + op.len as usize).unwrap_or(&[])
    }

    /// The descriptor of the segment `op` writes to (`None` for an index past the step's
    /// segments, which no batch the machine made holds).
    pub fn target(&self, op: &WriteOp) -> Option<&'a Descriptor> {
        self.targets.get(op.segment as usize)
    }
}

/// What the driver must do next. Only a word: what the action acts on stays where it is (the
/// descriptors and outcome in the machine, the write batch in the engine), so no driver copies
/// it through the stack at every step
/// (an action that carried the batch or the outcome was copied twice per step, each copy
/// stalling on the stores that had just built it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Fetch [`StepMachine::current`]'s descriptors, run the engine over them with
    /// [`StepMachine::invocation`] and hand the result to [`StepMachine::stepped`] (the
    /// descriptors stay in the machine: no copy per step). Wait out
    /// [`StepMachine::retry_backoff_ns`] first, if any.
    Fetch,
    /// Apply [`StepMachine::writes`] of the engine's last step (at the owner) and call
    /// [`StepMachine::writes_applied`].
    Write,
    /// The message is finished: take its [`StepMachine::outcome`].
    Complete,
}

/// How a message ended, at whichever placement ran it (the reply is built from it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// How it ended: `Ok`, or the error that `code` and `payload` detail.
    pub status: Status,
    /// The handler's error code (`HandlerError`), abort code (`Aborted`), or 0.
    pub code: u32,
    /// Reply bytes (`Ok`) or an error message.
    pub payload: Bytes,
    /// Steps run over the message's life (earlier placements' included).
    pub steps: u16,
    /// Interpreter instructions executed here (0 under the JIT).
    pub insns: u64,
    /// Of those, the classes an engine counts apart ([`InsnMix`]; zeros under the JIT).
    pub mix: InsnMix,
    /// Optimistic-read retries taken here.
    pub retries: u16,
    /// Engine runs here: steps, retried steps and a faulted step included.
    pub runs: u16,
    /// What fetching the data of every run here cost, nanoseconds (modelled DMA, measured
    /// READs, 0 at the host), as the driver reported it.
    pub fetch_ns: u64,
}

impl Outcome {
    /// An error completion with a message.
    pub fn error(status: Status, code: u32, message: impl Into<String>, steps: u16) -> Outcome {
        Outcome {
            status,
            code,
            payload: Bytes::from(message.into().into_bytes()),
            steps,
            insns: 0,
            mix: InsnMix::default(),
            retries: 0,
            runs: 0,
            fetch_ns: 0,
        }
    }
}

/// Where a message starts at a placement, borrowed from whatever carries it (a decoded
/// [`Request`], or a local caller's own buffers: nothing is copied but the reply so far).
#[derive(Clone, Copy, Debug)]
pub struct MessageStart<'a> {
    /// The request id (the write owner's deduplication key, with the session).
    pub request_id: u64,
    /// Steps already run by earlier placements.
    pub steps: u16,
    /// State words as earlier steps left them (borrowed: a message that starts here passes
    /// [`MessageStart::NO_STATE`], and its caller builds no 64-byte array to copy).
    pub state: &'a [u64; STATE_WORDS],
    /// Reply bytes built by earlier steps.
    pub partial_reply: &'a [u8],
    /// Descriptors of the first step here (at most `MAX_NEXT`; more are refused).
    pub descriptors: &'a [Descriptor],
}

impl MessageStart<'_> {
    /// The state words of a message that no step has run yet.
    pub const NO_STATE: &'static [u64; STATE_WORDS] = &[0; STATE_WORDS];
}

impl<'a> From<&'a Request> for MessageStart<'a> {
    fn from(req: &'a Request) -> Self {
        MessageStart {
            request_id: req.request_id,
            steps: req.steps,
            state: &req.state,
            partial_reply: &req.partial_reply,
            descriptors: req.descriptors.as_slice(),
        }
    }
}

/// One message in flight at one placement. It holds no copy of the message's args: the
/// driver keeps them (in the request, or the caller's buffer) and lends them to every
/// [`StepMachine::invocation`].
#[derive(Debug)]
pub struct StepMachine {
    app: u32,
    kind: HandlerKind,
    placement: Placement,
    request_id: u64,
    state: [u64; STATE_WORDS],
    /// The reply so far. In a machine that runs one message after another
    /// ([`StepMachine::restart`]), its capacity stays for the next message (see
    /// [`StepMachine::take_reply`]).
    reply: BytesMut,
    /// Whether `reply` stays with the machine (split at completion) rather than moving out.
    keep_buffer: bool,
    /// Where the answers of writes are copied (they are kept for deduplication).
    kept: ByteArena,
    /// How the message ended, once it has: the status and code of its
    /// [`StepMachine::outcome`] (whose payload is `reply`, or the error message put there).
    ended: (Status, u32),
    current: Descriptors,
    steps: u16,
    retries: u16,
    insns: u64,
    mix: InsnMix,
    limits: Limits,
    runs: u16,
    fetch_ns: u64,
}

impl StepMachine {
    /// Starts the message `start` describes, whose handler belongs to `app` and is of `kind`,
    /// at `placement`. The first action fetches its descriptors, unless the message cannot run
    /// here at all.
    #[inline]
    pub fn start(
        start: MessageStart<'_>,
        app: u32,
        kind: HandlerKind,
        placement: Placement,
        limits: Limits,
    ) -> (StepMachine, Action) {
        let mut m = StepMachine::unused();
        let action = m.restart(start, app, kind, placement, limits);
        // The reply moves out at the end: nothing is kept for a next message.
        m.keep_buffer = false;
        (m, action)
    }

    /// A machine with no message, for a driver that runs its messages one after another in
    /// the same machine ([`StepMachine::restart`]).
    pub fn unused() -> StepMachine {
        StepMachine {
            app: 0,
            kind: HandlerKind::Read,
            placement: Placement::Host,
            request_id: 0,
            state: [0; STATE_WORDS],
            reply: BytesMut::new(),
            keep_buffer: true,
            kept: ByteArena::default(),
            ended: (Status::Ok, 0),
            current: Descriptors::new(),
            steps: 0,
            retries: 0,
            insns: 0,
            mix: InsnMix::default(),
            limits: Limits::default(),
            runs: 0,
            fetch_ns: 0,
        }
    }

    /// [`StepMachine::start`] in this machine, whatever it ran before: nothing is moved, and
    /// its buffers are kept. A read's payload is split off the reply buffer (sharing its
    /// allocation): once the payload of one message is dropped, the next reuses the same
    /// memory. A write's answer, which its owner keeps for deduplication, is copied into the
    /// machine's arena instead (its write batches are read where the engine left them). A driver
    /// that consumes each reply before its next message allocates nothing per message once
    /// the buffers have grown.
    #[inline]
    pub fn restart(
        &mut self,
        start: MessageStart<'_>,
        app: u32,
        kind: HandlerKind,
        placement: Placement,
        limits: Limits,
    ) -> Action {
        // Payloads split off the reply buffer share its allocation; a reply that does not fit
        // what is left takes the whole allocation back if every earlier payload was dropped,
        // else starts a new one ([`StepMachine::reserve_reply`]).
        self.reply.clear();
        self.keep_buffer = true;
        // A message that starts here has replied nothing yet: no `memcpy` call for no bytes.
        if !start.partial_reply.is_empty() {
            self.reserve_reply(start.partial_reply.len());
            self.reply.extend_from_slice(start.partial_reply);
        }
        self.app = app;
        self.kind = kind;
        self.placement = placement;
        self.request_id = start.request_id;
        self.state = *start.state;
        self.steps = start.steps;
        self.retries = 0;
        self.insns = 0;
        self.mix = InsnMix::default();
        self.limits = limits;
        self.runs = 0;
        self.fetch_ns = 0;
        if self.current.assign(start.descriptors).is_err() {
            self.fail(Status::Refused, "more descriptors than a step may fetch")
        } else if placement == Placement::Client && kind == HandlerKind::Write {
            self.fail(
                Status::PlacementRefused,
                "write handlers run at the write owner, not at the client",
            )
        } else if self.steps >= self.limits.max_steps {
            self.fail(
                Status::HopLimit,
                format!("hop limit of {} steps reached", self.limits.max_steps),
            )
        } else {
            Action::Fetch
        }
    }

    /// The app whose regions the descriptors name.
    pub fn app(&self) -> u32 {
        self.app
    }

    /// Id of the request being run, as it arrived (also its write batches' dedup key).
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Descriptors of the step being fetched or run.
    #[inline]
    pub fn current(&self) -> &Descriptors {
        &self.current
    }

    /// Steps run so far, over the message's life.
    pub fn steps(&self) -> u16 {
        self.steps
    }

    /// Interpreter instructions executed so far at this placement (0 under the JIT).
    pub fn insns(&self) -> u64 {
        self.insns
    }

    /// Optimistic-read retries taken so far at this placement.
    #[inline]
    pub fn retries(&self) -> u16 {
        self.retries
    }

    /// How long the driver should wait before fetching again after a torn read: doubling from
    /// 1 µs per retry, capped at [`MAX_RETRY_BACKOFF_NS`]. A writer preempted in the middle of
    /// an update keeps an object torn for a whole scheduler slice; readers that retry at once
    /// would spend their budget in microseconds.
    #[inline]
    pub fn retry_backoff_ns(&self) -> Option<u64> {
        (self.retries > 0)
            .then(|| (1_000u64 << (self.retries - 1).min(20)).min(MAX_RETRY_BACKOFF_NS))
    }

    /// The engine's input for the current step over `segments` (fetched in the order of
    /// [`StepMachine::current`]), with the message's `args` (the same bytes every step).
    pub fn invocation<'a>(&'a self, args: &'a [u8], segments: &'a [Grant<'a>]) -> Invocation<'a> {
        Invocation {
            app: self.app,
            request_id: self.request_id,
            step: self.steps as u32,
            placement: self.placement.abi(),
            args,
            state: self.state,
            reply: &self.reply,
            segments,
            resident: false,
        }
    }

    fn fail(&mut self, status: Status, message: impl Into<String>) -> Action {
        self.fail_with_code(status, 0, message)
    }

    /// The message ends in an error: its message replaces whatever reply was built.
    #[cold]
    fn fail_with_code(&mut self, status: Status, code: u32, message: impl Into<String>) -> Action {
        self.reply.clear();
        self.reply.extend_from_slice(message.into().as_bytes());
        self.complete(status, code)
    }

    /// The message ends with `status` and `code`; [`StepMachine::outcome`] takes the rest.
    #[inline]
    fn complete(&mut self, status: Status, code: u32) -> Action {
        self.ended = (status, code);
        Action::Complete
    }

    /// How the message ended, once an action said [`Action::Complete`]: the reply (or error
    /// message) moves out as the payload, so call it once per message.
    #[inline]
    pub fn outcome(&mut self) -> Outcome {
        Outcome {
            status: self.ended.0,
            code: self.ended.1,
            payload: self.take_reply(),
            steps: self.steps,
            insns: self.insns,
            mix: self.mix,
            retries: self.retries,
            runs: self.runs,
            fetch_ns: self.fetch_ns,
        }
    }

    /// How the message ended, once an action said [`Action::Complete`], read in place: the
    /// reply (or error message) stays in the machine's buffer until its next
    /// [`StepMachine::restart`]. For a caller that runs its messages one after another in one
    /// machine and reads each reply before the next (direct execution), instead of
    /// [`StepMachine::outcome`]: nothing is split off the buffer, and a write's answer is not
    /// copied aside for deduplication (no one will ask for it again).
    #[inline]
    pub fn ended(&self) -> ReplyView<'_> {
        ReplyView {
            status: self.ended.0,
            code: self.ended.1,
            steps: self.steps,
            placement: self.placement,
            payload: &self.reply,
        }
    }

    /// The batch to apply, once an action said [`Action::Write`]: the writes `engine` holds
    /// from the step it ran last (the one [`StepMachine::stepped`] checked), read in place.
    pub fn writes<'a, E: Engine + ?Sized>(&'a self, engine: &'a E) -> WriteBatch<'a> {
        let (ops, data) = engine.queued_writes();
        WriteBatch {
            app: self.app,
            request_id: self.request_id,
            ops,
            targets: self.current.as_slice(),
            data,
        }
    }

    /// The reply as a payload. A machine that keeps its buffer splits a read's reply off it
    /// (no allocation) but copies a write's into an arena of its own: the write owner keeps
    /// that answer for deduplication, and a kept payload would pin the reply buffer.
    fn take_reply(&mut self) -> Bytes {
        match (self.keep_buffer, self.kind) {
            (true, HandlerKind::Read) => self.reply.split().freeze(),
            (true, HandlerKind::Write) => self.kept.copy(&self.reply),
            (false, _) => std::mem::take(&mut self.reply).freeze(),
        }
    }

    /// Room for a reply of `len` bytes in the (empty) reply buffer. A kept buffer grows by
    /// [`REPLY_CHUNK`]s: the reads' payloads split off it share one allocation until every
    /// one of them is dropped, where growing by what one reply needs made each payload that
    /// was still held (pipelined answers waiting for their poll) an allocation of its own.
    #[inline]
    fn reserve_reply(&mut self, len: usize) {
        if self.keep_buffer && self.reply.capacity() < len {
            self.reply.reserve(REPLY_CHUNK.max(len));
        }
    }

    /// The fetch failed: the message ends with the matching error.
    pub fn fetch_failed(&mut self, e: &FetchError) -> Action {
        self.fail(e.status(), e.to_string())
    }

    /// The engine ran the current step (its segments cost `fetch_ns` to fetch): the machine
    /// takes the step's output and says what comes next. A step that faulted ends the message;
    /// one that asked to be retried (a torn optimistic read) leaves the reply and state as they
    /// were. Nothing here reads a clock: a driver times the whole message, once.
    // Inlined into the drivers (another crate), for the same reason as the engine's run_step:
    // the action it returns no longer makes a round trip through the stack. Forced: it is
    // large enough that the hint alone left it out of line in the host path's drive.
    #[inline(always)]
    pub fn stepped(&mut self, result: Result<StepResult<'_>, StepFault>, fetch_ns: u64) -> Action {
        self.runs = self.runs.saturating_add(1);
        self.fetch_ns = self.fetch_ns.saturating_add(fetch_ns);
        // Borrowed, not moved out of the result: the move copied the engine's output in
        // 16-byte loads across the 8-byte stores that had just built it, and stalled.
        let out = match &result {
            Ok(out) => out,
            Err(e @ StepFault::Aborted { code }) => {
                return self.fail_with_code(Status::Aborted, *code as u32, e.to_string())
            }
            Err(e @ StepFault::BadInput(_)) => return self.fail(Status::Refused, e.to_string()),
            Err(e) => return self.fail(Status::Fault, e.to_string()),
        };
        self.insns += out.insns.unwrap_or(0);
        if let Some(mix) = out.mix {
            self.mix = self.mix.plus(mix);
        }
        self.steps += 1;
        // A step that asks to be retried saw inconsistent data: whatever it wrote into the
        // reply or the state words is discarded with it.
        if out.ret != Some(Return::Retry) {
            // Most steps before the last reply nothing: no copy (a call into `memcpy` even
            // for no bytes) when there was and is nothing.
            if !(out.reply.is_empty() && self.reply.is_empty()) {
                self.reply.clear();
                self.reserve_reply(out.reply.len());
                self.reply.extend_from_slice(out.reply);
            }
            self.state = *out.state;
        }
        match out.ret {
            Some(Return::Done) => self.complete(Status::Ok, 0),
            Some(Return::Error(code)) => self.complete(Status::HandlerError, code),
            Some(Return::Continue) => {
                if self.steps >= self.limits.max_steps {
                    return self.fail(
                        Status::HopLimit,
                        format!("hop limit of {} steps reached", self.limits.max_steps),
                    );
                }
                let valid = out
                    .next
                    .iter()
                    .all(|d| d.access != 0 && d.access & !ACCESS_MASK == 0);
                if valid && self.current.assign(out.next).is_ok() {
                    Action::Fetch
                } else {
                    self.fail(Status::Refused, "Continue with invalid next descriptors")
                }
            }
            Some(Return::Retry) => {
                self.retries += 1;
                if self.retries > self.limits.max_retries {
                    return self.fail(
                        Status::Refused,
                        format!(
                            "more than {} optimistic-read retries",
                            self.limits.max_retries
                        ),
                    );
                }
                // Same step, same descriptors, fresh data.
                self.steps -= 1;
                Action::Fetch
            }
            Some(Return::Write) => {
                if self.kind != HandlerKind::Write {
                    return self.fail(
                        Status::Refused,
                        "a read handler returned Write: declare the handler a write handler \
                         (`write = true` in naam-server's config, `HandlerSpec::write`, \
                         `naam run --write`)",
                    );
                }
                match check_writes(self.current.as_slice(), out) {
                    Ok(()) => Action::Write,
                    Err(why) => self.fail(Status::Refused, why),
                }
            }
            None => self.fail(
                Status::Fault,
                format!("handler returned invalid r0 {:#x}", out.return_code),
            ),
        }
    }

    /// The writes were applied (or not): the message completes.
    #[inline]
    pub fn writes_applied(&mut self, result: Result<(), WriteError>) -> Action {
        match result {
            Ok(()) => self.complete(Status::Ok, 0),
            Err(e) => self.fail(e.status(), e.to_string()),
        }
    }
}

/// Checks each of a step's write operations against the segment it targets among `targets`
/// (the step's descriptors): the index, the range, a `STORE`'s data, an atomic's length and
/// the kind. Only reads: the batch is then read where the engine left it.
fn check_writes(targets: &[Descriptor], out: &StepResult<'_>) -> Result<(), String> {
    for (i, w) in out.writes.iter().enumerate() {
        if let Some(refusal) = write_refusal(w, targets, out.write_data.len()) {
            return Err(refusal.describe(i, w, targets));
        }
    }
    Ok(())
}

/// The first rule a queued write breaks, in the order [`check_writes`] reads them.
#[derive(Clone, Copy)]
enum WriteRefusal {
    NoSuchSegment,
    PastItsSegment,
    DataOutsideStaging,
    AtomicNotEightBytes,
    UnknownKind,
}

/// Which rule `w` breaks against the step's `targets` and its `data_len` staged bytes, if
/// any. Only a verdict: the words of a refusal are [`WriteRefusal::describe`]'s, off the path
/// of the writes that pass.
#[inline]
fn write_refusal(w: &WriteOp, targets: &[Descriptor], data_len: usize) -> Option<WriteRefusal> {
    let Some(target) = targets.get(w.segment as usize) else {
        return Some(WriteRefusal::NoSuchSegment);
    };
    if w.offset as u64 + w.len as u64 > target.len as u64 {
        return Some(WriteRefusal::PastItsSegment);
    }
    match w.kind {
        write_kind::STORE if w.data_offset as usize + w.len as usize > data_len => {
            Some(WriteRefusal::DataOutsideStaging)
        }
        write_kind::STORE => None,
        write_kind::CAS | write_kind::FAA if w.len != 8 => Some(WriteRefusal::AtomicNotEightBytes),
        write_kind::CAS | write_kind::FAA => None,
        _ => Some(WriteRefusal::UnknownKind),
    }
}

impl WriteRefusal {
    /// The refusal of write `i`, `w`, in words.
    #[cold]
    fn describe(self, i: usize, w: &WriteOp, targets: &[Descriptor]) -> String {
        let target_len = targets.get(w.segment as usize).map_or(0, |t| t.len);
        match self {
            WriteRefusal::NoSuchSegment => format!(
                "write {i} targets segment {} of {}",
                w.segment,
                targets.len()
            ),
            WriteRefusal::PastItsSegment => format!(
                "write {i} runs past its segment ({} > {target_len})",
                w.offset as u64 + w.len as u64
            ),
            WriteRefusal::DataOutsideStaging => {
                format!("write {i}: data outside the staging buffer")
            }
            WriteRefusal::AtomicNotEightBytes => format!("write {i}: atomics are 8 bytes"),
            WriteRefusal::UnknownKind => format!("write {i}: unknown kind {}", w.kind),
        }
    }
}
