//! The executor: a sans-IO state machine that runs one message's steps, and the data paths
//! that feed it segments at each placement.
//!
//! A [`StepMachine`] never touches memory or the network itself. It asks its driver for
//! segments ([`Action::Fetch`]) or for writes to be applied ([`Action::Write`]) and is resumed
//! with the result; it ends with [`Action::Complete`]. Threads, the simulator and the UDP server
//! all drive this same code. Data access lives behind [`DataPath`]:
//! - [`HostPath`]: zero-copy grants straight into region memory;
//! - [`NicPath`]: DMA-like copies into NIC-local buffers, each access charged by a [`DmaModel`];
//! - [`ClientPath`]: one-sided READs through a [`OneSided`] transport, one round trip per step.
//!
//! Segments are always granted read-only: handlers change memory only through write operations,
//! which the write owner applies in order ([`apply_writes`]), so every placement sees the same
//! semantics.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use naam_ebpf::abi::{
    write_kind, Descriptor, Return, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, STATE_WORDS,
};

use crate::clock::{Clock, Nanos};
use crate::engine::VmError;
use crate::engine::{Grant, Invocation, StepError, Vm};
use crate::placement::Placement;
use crate::region::{MemError, RegionTable, ResolveError};
use crate::registry::{HandlerEntry, HandlerKind};
use crate::wire::{Descriptors, Request, Status};

/// Bounds on one message's execution.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most steps a message may take (hop limit).
    pub max_steps: u16,
    /// Most `Retry` returns (torn optimistic reads) per message.
    pub max_retries: u16,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_steps: 32,
            max_retries: 64,
        }
    }
}

/// Longest wait between two attempts of a torn optimistic read.
pub const MAX_RETRY_BACKOFF_NS: u64 = 1_000_000;

/// One write operation, resolved against the descriptor of the segment it targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteRequest {
    /// Descriptor of the target segment (as the message granted it).
    pub target: Descriptor,
    /// `write_kind::*`.
    pub kind: u32,
    /// Offset inside the target segment.
    pub offset: u32,
    /// Bytes to store (`STORE`).
    pub data: Vec<u8>,
    /// New value (`CAS`) or addend (`FAA`).
    pub operand: u64,
    /// Expected value (`CAS`).
    pub expected: u64,
}

/// The writes of one step, applied in order by the write owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteBatch {
    /// The app of the handler that produced the writes: every target rkey must name one of
    /// this app's regions.
    pub app: u32,
    /// Request id (for deduplication).
    pub request_id: u64,
    /// Operations in order.
    pub ops: Vec<WriteRequest>,
}

/// What the driver must do next.
#[derive(Debug)]
pub enum Action {
    /// Fetch [`StepMachine::current`]'s descriptors and call [`StepMachine::step`] with the
    /// segments (the descriptors stay in the machine: no copy per step).
    Fetch,
    /// Apply these writes (at the owner) and call [`StepMachine::writes_applied`].
    Write(WriteBatch),
    /// The message is finished.
    Complete(Outcome),
}

/// How a message ended, at whichever placement ran it (the reply is built from it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Its status.
    pub status: Status,
    /// Handler error code, or a detail code.
    pub code: u32,
    /// Reply bytes (`Ok`) or an error message.
    pub payload: Bytes,
    /// Steps run.
    pub steps: u16,
    /// Interpreter instructions executed (0 under the JIT).
    pub insns: u64,
    /// Optimistic-read retries taken.
    pub retries: u16,
    /// Accounting of every step run (retries included), in order.
    pub records: Vec<StepRecord>,
}

/// Accounting of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepRecord {
    /// Instructions the interpreter executed (`None` under the JIT, which does not count).
    pub insns: Option<u64>,
    /// Handler run time, nanoseconds, measured with the injected clock.
    pub exec_ns: u64,
    /// Cost of fetching the step's segments, nanoseconds (modelled DMA, measured READ, 0).
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
            retries: 0,
            records: Vec::new(),
        }
    }
}

/// Why writes could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// The target descriptor does not resolve.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The operation falls outside its segment, or is misaligned.
    #[error("write operation {index}: {reason}")]
    Invalid {
        /// Operation index.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A compare-and-swap found another value; the operations before it were applied.
    #[error("write operation {index}: compare-and-swap expected {expected:#x}, found {found:#x}")]
    Conflict {
        /// Operation index.
        index: usize,
        /// Expected value.
        expected: u64,
        /// Value found.
        found: u64,
    },
    /// This placement is not the app's write owner.
    #[error("this placement does not own the app's writes")]
    NotOwner,
}

impl WriteError {
    /// The reply status for this error.
    pub fn status(&self) -> Status {
        match self {
            WriteError::Resolve(e) => resolve_status(e),
            WriteError::Invalid { .. } => Status::Refused,
            WriteError::Conflict { .. } => Status::Conflict,
            WriteError::NotOwner => Status::NotOwner,
        }
    }
}

/// Why a step's segments could not be fetched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// A descriptor does not resolve.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The data source did not answer (one-sided agent down, timeout).
    #[error("data source unavailable: {0}")]
    Unavailable(String),
    /// A remote agent refused the access (its status and message).
    #[error("the one-sided agent refused the access ({status:?}): {message}")]
    Refused {
        /// The agent's status.
        status: Status,
        /// The agent's error text, or why its answer was unusable (malformed, wrong length).
        message: String,
    },
}

impl FetchError {
    /// The reply status for this error.
    pub fn status(&self) -> Status {
        match self {
            FetchError::Resolve(e) => resolve_status(e),
            FetchError::Unavailable(_) => Status::Unavailable,
            FetchError::Refused { status, .. } => *status,
        }
    }
}

/// The reply status for a descriptor that does not resolve.
pub fn resolve_status(e: &ResolveError) -> Status {
    match e {
        ResolveError::BadKey(_) => Status::BadKey,
        ResolveError::OutOfRange(_) => Status::OutOfRange,
        ResolveError::AccessDenied { .. } => Status::AccessDenied,
    }
}

/// One message in flight at one placement.
#[derive(Debug)]
pub struct StepMachine {
    handler: Arc<HandlerEntry>,
    placement: Placement,
    request_id: u64,
    args: Bytes,
    state: [u64; STATE_WORDS],
    reply: Vec<u8>,
    current: Descriptors,
    steps: u16,
    retries: u16,
    insns: u64,
    limits: Limits,
    records: Vec<StepRecord>,
}

impl StepMachine {
    /// Starts `req` at `placement`; the first action fetches the request's descriptors.
    pub fn start(
        req: &Request,
        handler: Arc<HandlerEntry>,
        placement: Placement,
        limits: Limits,
    ) -> (StepMachine, Action) {
        let mut m = StepMachine {
            placement,
            request_id: req.request_id,
            args: req.args.clone(),
            state: req.state,
            reply: req.partial_reply.to_vec(),
            current: req.descriptors,
            steps: req.steps,
            retries: 0,
            insns: 0,
            limits,
            records: Vec::new(),
            handler,
        };
        let action = if placement == Placement::Client && m.handler.kind == HandlerKind::Write {
            m.fail(
                Status::PlacementRefused,
                "write handlers run at the write owner, not at the client",
            )
        } else if m.steps >= m.limits.max_steps {
            m.fail(
                Status::HopLimit,
                format!("hop limit of {} steps reached", m.limits.max_steps),
            )
        } else {
            Action::Fetch
        };
        (m, action)
    }

    /// The handler.
    pub fn handler(&self) -> &Arc<HandlerEntry> {
        &self.handler
    }

    /// Descriptors of the step being fetched or run.
    pub fn current(&self) -> &Descriptors {
        &self.current
    }

    /// Steps run so far.
    pub fn steps(&self) -> u16 {
        self.steps
    }

    /// How long the driver should wait before fetching again after a torn read: doubling from
    /// 1 µs per retry, capped at [`MAX_RETRY_BACKOFF_NS`]. A writer preempted in the middle of
    /// an update keeps an object torn for a whole scheduler slice; readers that retry at once
    /// would spend their budget in microseconds.
    pub fn retry_backoff_ns(&self) -> Option<u64> {
        (self.retries > 0)
            .then(|| (1_000u64 << (self.retries - 1).min(20)).min(MAX_RETRY_BACKOFF_NS))
    }

    fn fail(&mut self, status: Status, message: impl Into<String>) -> Action {
        let mut c = Outcome::error(status, 0, message, self.steps);
        c.insns = self.insns;
        c.retries = self.retries;
        c.records = std::mem::take(&mut self.records);
        Action::Complete(c)
    }

    /// The message ends: the reply and the records move into the completion.
    fn complete(&mut self, status: Status, code: u32) -> Action {
        Action::Complete(Outcome {
            status,
            code,
            payload: Bytes::from(std::mem::take(&mut self.reply)),
            steps: self.steps,
            insns: self.insns,
            retries: self.retries,
            records: std::mem::take(&mut self.records),
        })
    }

    /// The fetch failed: the message ends with the matching error.
    pub fn fetch_failed(&mut self, e: &FetchError) -> Action {
        self.fail(e.status(), e.to_string())
    }

    /// Runs one step over `segments` (in the order of [`StepMachine::current`]), which cost
    /// `fetch_ns` to fetch; the handler's run time is measured with `clock`.
    pub fn step(
        &mut self,
        vm: &mut Vm,
        segments: &[Grant<'_>],
        clock: &dyn Clock,
        fetch_ns: u64,
    ) -> Action {
        let inv = Invocation {
            app: self.handler.app,
            request_id: self.request_id,
            step: self.steps as u32,
            placement: self.placement.abi(),
            args: &self.args,
            state: self.state,
            reply: &self.reply,
            segments,
        };
        let started = clock.now();
        let result = vm.run(&self.handler.exe, &inv);
        self.records.push(StepRecord {
            insns: result.as_ref().ok().and_then(|o| o.insns),
            exec_ns: clock.now().saturating_sub(started),
            fetch_ns,
        });
        let out = match result {
            Ok(out) => out,
            Err(StepError::Vm(VmError::Aborted { code })) => {
                let mut c = Outcome::error(
                    Status::Aborted,
                    code as u32,
                    format!("handler aborted with code {code}"),
                    self.steps,
                );
                c.insns = self.insns;
                c.records = std::mem::take(&mut self.records);
                return Action::Complete(c);
            }
            Err(e @ StepError::BadInput(_)) => return self.fail(Status::Refused, e.to_string()),
            Err(e) => return self.fail(Status::Fault, e.to_string()),
        };
        self.insns += out.insns.unwrap_or(0);
        self.steps += 1;
        // A step that asks to be retried saw inconsistent data: whatever it wrote into the
        // reply or the state words is discarded with it.
        if out.ret != Some(Return::Retry) {
            self.reply.clear();
            self.reply.extend_from_slice(vm.reply());
            self.state = vm.state();
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
                match Descriptors::from_slice(vm.next()) {
                    Ok(next)
                        if next.as_slice().iter().all(|d| {
                            d.access != 0 && d.access & !naam_ebpf::abi::ACCESS_MASK == 0
                        }) =>
                    {
                        self.current = next;
                        Action::Fetch
                    }
                    _ => self.fail(Status::Refused, "Continue with invalid next descriptors"),
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
                if self.handler.kind != HandlerKind::Write {
                    return self.fail(Status::Refused, "a read handler returned Write");
                }
                match self.write_batch(vm) {
                    Ok(batch) => Action::Write(batch),
                    Err(why) => self.fail(Status::Refused, why),
                }
            }
            None => self.fail(
                Status::Fault,
                format!("handler returned invalid r0 {:#x}", out.return_code),
            ),
        }
    }

    fn write_batch(&self, vm: &Vm) -> Result<WriteBatch, String> {
        let data = vm.write_data();
        let mut ops = Vec::with_capacity(vm.writes().len());
        for (i, w) in vm.writes().iter().enumerate() {
            let target = *self
                .current
                .as_slice()
                .get(w.segment as usize)
                .ok_or_else(|| {
                    format!(
                        "write {i} targets segment {} of {}",
                        w.segment,
                        self.current.len()
                    )
                })?;
            let end = w.offset as u64 + w.len as u64;
            if end > target.len as u64 {
                return Err(format!(
                    "write {i} runs past its segment ({end} > {})",
                    target.len
                ));
            }
            let op = match w.kind {
                write_kind::STORE => {
                    let bytes = data
                        .get(w.data_offset as usize..w.data_offset as usize + w.len as usize)
                        .ok_or_else(|| format!("write {i}: data outside the staging buffer"))?;
                    WriteRequest {
                        target,
                        kind: w.kind,
                        offset: w.offset,
                        data: bytes.to_vec(),
                        operand: 0,
                        expected: 0,
                    }
                }
                write_kind::CAS | write_kind::FAA => {
                    if w.len != 8 {
                        return Err(format!("write {i}: atomics are 8 bytes"));
                    }
                    WriteRequest {
                        target,
                        kind: w.kind,
                        offset: w.offset,
                        data: Vec::new(),
                        operand: w.operand,
                        expected: w.expected,
                    }
                }
                k => return Err(format!("write {i}: unknown kind {k}")),
            };
            ops.push(op);
        }
        Ok(WriteBatch {
            app: self.handler.app,
            request_id: self.request_id,
            ops,
        })
    }

    /// The writes were applied (or not): the message completes.
    pub fn writes_applied(&mut self, result: Result<(), WriteError>) -> Action {
        match result {
            Ok(()) => self.complete(Status::Ok, 0),
            Err(e) => self.fail(e.status(), e.to_string()),
        }
    }
}

/// Applies `batch` to `regions` in order, each operation visible before the next (release
/// fences), as the write owner must.
pub fn apply_writes(regions: &RegionTable, batch: &WriteBatch) -> Result<(), WriteError> {
    for (index, op) in batch.ops.iter().enumerate() {
        let need = match op.kind {
            write_kind::STORE => ACCESS_WRITE,
            _ => ACCESS_WRITE | ACCESS_ATOMIC,
        };
        if op.target.access & need != need {
            return Err(WriteError::Invalid {
                index,
                reason: format!(
                    "the descriptor grants {:#x}, the write needs {need:#x}",
                    op.target.access
                ),
            });
        }
        let resolved = regions.resolve(batch.app, &op.target)?;
        let at = resolved.offset + op.offset as u64;
        let mem = &resolved.region.mem;
        let invalid = |e: MemError| WriteError::Invalid {
            index,
            reason: e.to_string(),
        };
        match op.kind {
            write_kind::STORE => mem.write(at, &op.data).map_err(invalid)?,
            write_kind::CAS => {
                let found = mem.cas(at, op.expected, op.operand).map_err(invalid)?;
                if found != op.expected {
                    return Err(WriteError::Conflict {
                        index,
                        expected: op.expected,
                        found,
                    });
                }
            }
            write_kind::FAA => {
                mem.faa(at, op.operand).map_err(invalid)?;
            }
            k => {
                return Err(WriteError::Invalid {
                    index,
                    reason: format!("unknown kind {k}"),
                })
            }
        }
        fence(Ordering::Release);
    }
    Ok(())
}

/// Segments fetched for one step, and what fetching them cost in the model.
pub struct Fetched<'a> {
    /// One grant per descriptor, in order (borrowed from the path's reused buffer).
    pub grants: &'a [Grant<'a>],
    /// Modelled cost of the fetch, nanoseconds (0 for direct memory).
    pub cost_ns: u64,
}

/// How a placement reaches the data a step needs.
pub trait DataPath {
    /// The placement this path serves.
    fn placement(&self) -> Placement;
    /// Resolves and fetches `descs` of `app`.
    fn fetch(&mut self, app: u32, descs: &[Descriptor]) -> Result<Fetched<'_>, FetchError>;
}

/// Host cores: descriptors resolve to zero-copy, read-only views of region memory.
pub struct HostPath {
    regions: Arc<RegionTable>,
    grants: Vec<Grant<'static>>,
}

impl HostPath {
    /// A host path over `regions`.
    pub fn new(regions: Arc<RegionTable>) -> Self {
        HostPath {
            regions,
            grants: Vec::new(),
        }
    }
}

/// Refills `grants` with read-only views of `buffers` (the NIC's and the client's local copies).
fn grant_buffers<'a>(
    grants: &'a mut Vec<Grant<'static>>,
    buffers: &'a [Vec<u8>],
) -> &'a [Grant<'a>] {
    grants.clear();
    for b in buffers {
        // SAFETY: the buffers are borrowed, unmodified, for as long as the returned grants.
        grants.push(unsafe { Grant::raw(b.as_ptr() as u64, b.len(), ACCESS_READ) });
    }
    grants
}

impl DataPath for HostPath {
    fn placement(&self) -> Placement {
        Placement::Host
    }

    fn fetch(&mut self, app: u32, descs: &[Descriptor]) -> Result<Fetched<'_>, FetchError> {
        self.grants.clear();
        for d in descs {
            let r = self.regions.resolve(app, d)?;
            // SAFETY: the resolved range lies inside a region that `self.regions` keeps alive for
            // the whole step; it is granted read-only.
            self.grants
                .push(unsafe { Grant::raw(r.addr(), r.len as usize, ACCESS_READ) });
        }
        Ok(Fetched {
            grants: &self.grants,
            cost_ns: 0,
        })
    }
}

/// Cost model of a DMA access from NIC cores to host memory: a fixed PCIe round trip plus a
/// per-byte transfer time. Defaults follow published BlueField-2 figures (about 1 µs for a
/// small DMA read across PCIe Gen4, about 10 GB/s sustained per engine); they are a model, not a
/// measurement on this machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DmaModel {
    /// Fixed cost of one access, nanoseconds.
    pub access_ns: u64,
    /// Transfer cost, picoseconds per byte.
    pub ps_per_byte: u64,
}

impl Default for DmaModel {
    fn default() -> Self {
        DmaModel {
            access_ns: 1_000,
            ps_per_byte: 100,
        }
    }
}

impl DmaModel {
    /// Modelled cost of reading `bytes` in one access.
    pub fn cost_ns(&self, bytes: u64) -> u64 {
        self.access_ns + bytes * self.ps_per_byte / 1000
    }
}

/// NIC cores: each descriptor is one DMA read into a NIC-local buffer, charged by the model.
pub struct NicPath {
    regions: Arc<RegionTable>,
    model: DmaModel,
    buffers: Vec<Vec<u8>>,
    grants: Vec<Grant<'static>>,
}

impl NicPath {
    /// A NIC path over `regions` with the DMA cost `model`.
    pub fn new(regions: Arc<RegionTable>, model: DmaModel) -> Self {
        NicPath {
            regions,
            model,
            buffers: Vec::new(),
            grants: Vec::new(),
        }
    }
}

impl DataPath for NicPath {
    fn placement(&self) -> Placement {
        Placement::Nic
    }

    fn fetch(&mut self, app: u32, descs: &[Descriptor]) -> Result<Fetched<'_>, FetchError> {
        if self.buffers.len() < descs.len() {
            self.buffers.resize_with(descs.len(), Vec::new);
        }
        let mut cost_ns = 0;
        for (d, buf) in descs.iter().zip(self.buffers.iter_mut()) {
            let r = self.regions.resolve(app, d)?;
            buf.resize(r.len as usize, 0);
            r.region
                .mem
                .read(r.offset, buf)
                .map_err(ResolveError::OutOfRange)?;
            cost_ns += self.model.cost_ns(r.len as u64);
        }
        let grants = grant_buffers(&mut self.grants, &self.buffers[..descs.len()]);
        Ok(Fetched { grants, cost_ns })
    }
}

/// A one-sided READ transport: fetch the bytes of several descriptors in one round trip.
pub trait OneSided {
    /// Reads `descs` of `app` into `bufs` (one per descriptor, resized to fit); returns the
    /// round-trip cost in nanoseconds (measured or modelled).
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, FetchError>;
}

/// The client: every step's data comes from one batched one-sided READ.
pub struct ClientPath<T: OneSided> {
    transport: T,
    buffers: Vec<Vec<u8>>,
    grants: Vec<Grant<'static>>,
}

impl<T: OneSided> ClientPath<T> {
    /// A client path over `transport`.
    pub fn new(transport: T) -> Self {
        ClientPath {
            transport,
            buffers: Vec::new(),
            grants: Vec::new(),
        }
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut T {
        &mut self.transport
    }
}

impl<T: OneSided> DataPath for ClientPath<T> {
    fn placement(&self) -> Placement {
        Placement::Client
    }

    fn fetch(&mut self, app: u32, descs: &[Descriptor]) -> Result<Fetched<'_>, FetchError> {
        if self.buffers.len() < descs.len() {
            self.buffers.resize_with(descs.len(), Vec::new);
        }
        let cost_ns = if descs.is_empty() {
            0
        } else {
            self.transport
                .read(app, descs, &mut self.buffers[..descs.len()])?
        };
        let grants = grant_buffers(&mut self.grants, &self.buffers[..descs.len()]);
        Ok(Fetched { grants, cost_ns })
    }
}

/// The one-sided agent's READ, served from the region table (the in-process agent, and the
/// server side of remote agents). READ needs the read right.
pub fn one_sided_read(
    regions: &RegionTable,
    app: u32,
    descs: &[Descriptor],
    bufs: &mut [Vec<u8>],
) -> Result<(), ResolveError> {
    for (d, buf) in descs.iter().zip(bufs.iter_mut()) {
        if d.access & ACCESS_READ == 0 {
            return Err(ResolveError::AccessDenied {
                need: ACCESS_READ,
                have: d.access,
            });
        }
        let r = regions.resolve(app, d)?;
        buf.resize(r.len as usize, 0);
        r.region
            .mem
            .read(r.offset, buf)
            .map_err(ResolveError::OutOfRange)?;
    }
    Ok(())
}

/// Accounting of one driven message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunCost {
    /// Modelled data-access cost, nanoseconds.
    pub fetch_ns: u64,
    /// Fetches made (one per step, retries included).
    pub fetches: u32,
}

/// A message waiting out a torn-read backoff: its machine, parked off the executor until
/// `resume_at`, so the executor serves other messages meanwhile.
pub struct ParkedRun {
    machine: StepMachine,
    cost: RunCost,
    /// When the retry may fetch again (clock time).
    pub resume_at: Nanos,
}

impl ParkedRun {
    /// Modelled fetch cost of the steps run so far.
    pub fn fetch_ns(&self) -> u64 {
        self.cost.fetch_ns
    }
}

impl std::fmt::Debug for ParkedRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkedRun")
            .field("request_id", &self.machine.request_id)
            .field("retries", &self.machine.retries)
            .field("resume_at", &self.resume_at)
            .finish()
    }
}

/// What [`drive`] left.
#[derive(Debug)]
pub enum Driven {
    /// The message finished.
    Done(Outcome, RunCost),
    /// A torn read must be retried after a backoff: resume with [`resume`].
    Parked(Box<ParkedRun>),
}

/// Runs a machine from `action` until it completes or a torn-read retry must wait. Never
/// sleeps: the wait is the caller's (a parked message on an executor, a sleep on a client's
/// own thread). `waited`: the pending retry's backoff has already been served.
#[allow(clippy::too_many_arguments)]
fn drive<P: DataPath>(
    mut m: StepMachine,
    mut action: Action,
    mut cost: RunCost,
    mut waited: bool,
    path: &mut P,
    vm: &mut Vm,
    clock: &dyn Clock,
    apply: &mut dyn FnMut(&WriteBatch) -> Result<(), WriteError>,
) -> Driven {
    let app = m.handler.app;
    loop {
        action = match action {
            Action::Complete(c) => return Driven::Done(c, cost),
            Action::Fetch => {
                if let Some(ns) = m.retry_backoff_ns().filter(|_| !waited) {
                    return Driven::Parked(Box::new(ParkedRun {
                        machine: m,
                        cost,
                        resume_at: clock.now().saturating_add(ns),
                    }));
                }
                waited = false;
                match path.fetch(app, m.current().as_slice()) {
                    Ok(f) => {
                        cost.fetch_ns += f.cost_ns;
                        cost.fetches += 1;
                        m.step(vm, f.grants, clock, f.cost_ns)
                    }
                    Err(e) => m.fetch_failed(&e),
                }
            }
            Action::Write(batch) => {
                let r = apply(&batch);
                m.writes_applied(r)
            }
        };
    }
}

/// Starts `req` on `path` and drives it until it completes or parks for a torn-read retry.
pub fn start<P: DataPath>(
    req: &Request,
    handler: Arc<HandlerEntry>,
    path: &mut P,
    vm: &mut Vm,
    limits: Limits,
    clock: &dyn Clock,
    apply: &mut dyn FnMut(&WriteBatch) -> Result<(), WriteError>,
) -> Driven {
    let (m, action) = StepMachine::start(req, handler, path.placement(), limits);
    drive(m, action, RunCost::default(), false, path, vm, clock, apply)
}

/// Resumes a parked message (its backoff served) until it completes or parks again.
pub fn resume<P: DataPath>(
    parked: Box<ParkedRun>,
    path: &mut P,
    vm: &mut Vm,
    clock: &dyn Clock,
    apply: &mut dyn FnMut(&WriteBatch) -> Result<(), WriteError>,
) -> Driven {
    drive(
        parked.machine,
        Action::Fetch,
        parked.cost,
        true,
        path,
        vm,
        clock,
        apply,
    )
}

/// Drives `req` to completion on `path`, waiting out torn-read backoffs on this thread (the
/// synchronous driver of the client and tests; executors park instead, see [`start`]).
/// `apply` applies write batches when this placement owns the app's writes.
pub fn run_message<P: DataPath>(
    req: &Request,
    handler: Arc<HandlerEntry>,
    path: &mut P,
    vm: &mut Vm,
    limits: Limits,
    clock: &dyn Clock,
    mut apply: impl FnMut(&WriteBatch) -> Result<(), WriteError>,
) -> (Outcome, RunCost) {
    let mut driven = start(req, handler, path, vm, limits, clock, &mut apply);
    loop {
        match driven {
            Driven::Done(c, cost) => return (c, cost),
            Driven::Parked(p) => {
                clock.wait_until(p.resume_at);
                driven = resume(p, path, vm, clock, &mut apply);
            }
        }
    }
}
