//! The executor: the drivers of naam-proto's step machine, and the data paths that feed it
//! segments at each placement.
//!
//! The [`StepMachine`] (naam-proto) owns a message's rules and never touches memory, an engine
//! or a clock. This module drives it: [`start`], [`resume`] and [`run_message`] fetch through a
//! [`DataPath`], run each step on naam-vm's [`Vm`] ([`run_step`], timed with the injected
//! [`Clock`]) and apply writes at the owner ([`apply_writes`]). The data paths:
//! - [`HostPath`]: zero-copy grants straight into region memory;
//! - [`NicPath`]: DMA-like copies into NIC-local buffers, each access charged by a [`DmaModel`];
//! - [`ClientPath`]: one-sided READs through a [`OneSided`] transport, one round trip per step.
//!
//! Segments are always granted read-only: handlers change memory only through write operations,
//! which the write owner applies in order ([`apply_writes`]), so every placement sees the same
//! semantics.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use naam_ebpf::abi::{write_kind, Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::step::Engine;

use naam_proto::step::{
    Action, DataPath, DmaModel, FetchError, Fetched, Limits, OneSided, Outcome, StepMachine,
    WriteBatch, WriteError,
};

use crate::Clock;
use crate::HandlerEntry;
use crate::RegionTable;
use naam_proto::step::Grant;
use naam_proto::step::{MemError, ResolveError};
use naam_proto::wire::Request;
use naam_proto::Nanos;
use naam_proto::Placement;
use naam_vm::{Executable, Vm};

/// Runs `m`'s current step of `exe` on `vm` over `grants` (which cost `fetch_ns` to fetch),
/// timing the handler with `clock`, and returns the machine's next action.
pub fn run_step(
    m: &mut StepMachine,
    vm: &mut Vm,
    exe: &Executable,
    grants: &[Grant<'_>],
    clock: &dyn Clock,
    fetch_ns: u64,
) -> Action {
    let started = clock.now();
    let result = vm.run_step(exe, &m.invocation(grants));
    let exec_ns = clock.now().saturating_sub(started);
    m.stepped(result, fetch_ns, exec_ns)
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

    /// The one-sided READ transport the path fetches through.
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
    handler: Arc<HandlerEntry>,
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
            .field("request_id", &self.machine.request_id())
            .field("retries", &self.machine.retries())
            .field("resume_at", &self.resume_at)
            .finish()
    }
}

/// What [`start`] or [`resume`] left.
#[derive(Debug)]
pub enum Driven {
    /// The message finished: its outcome, and what fetching its data cost here.
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
    handler: Arc<HandlerEntry>,
    mut action: Action,
    mut cost: RunCost,
    mut waited: bool,
    path: &mut P,
    vm: &mut Vm,
    clock: &dyn Clock,
    apply: &mut dyn FnMut(&WriteBatch) -> Result<(), WriteError>,
) -> Driven {
    let app = m.app();
    loop {
        action = match action {
            Action::Complete(c) => return Driven::Done(c, cost),
            Action::Fetch => {
                if let Some(ns) = m.retry_backoff_ns().filter(|_| !waited) {
                    return Driven::Parked(Box::new(ParkedRun {
                        machine: m,
                        handler,
                        cost,
                        resume_at: clock.now().saturating_add(ns),
                    }));
                }
                waited = false;
                match path.fetch(app, m.current().as_slice()) {
                    Ok(f) => {
                        cost.fetch_ns += f.cost_ns;
                        cost.fetches += 1;
                        run_step(&mut m, vm, &handler.exe, f.grants, clock, f.cost_ns)
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
    let (m, action) = StepMachine::start(req, handler.app, handler.kind, path.placement(), limits);
    drive(
        m,
        handler,
        action,
        RunCost::default(),
        false,
        path,
        vm,
        clock,
        apply,
    )
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
        parked.handler,
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
