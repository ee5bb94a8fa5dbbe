//! The executor: the drivers of naam-proto's step machine, and the data paths that feed it
//! segments at each placement.
//!
//! The [`StepMachine`] (naam-proto) owns a message's rules and never touches memory, an engine
//! or a clock. This module drives it: [`start`], [`resume`] and [`run_message`] fetch through a
//! [`DataPath`], run the steps on naam-vm's [`Vm`] (those after a `Continue` in the same
//! engine entry, the data path called between them; timed with the injected [`Clock`]) and
//! apply writes at the owner ([`apply_writes`]). The data paths:
//! - [`HostPath`]: zero-copy grants straight into region memory;
//! - [`NicPath`]: DMA-like copies into NIC-local buffers, each access charged by a [`DmaModel`];
//! - [`ClientPath`]: one-sided READs through a [`OneSided`] transport, one round trip per step.
//!
//! Segments are always granted read-only: handlers change memory only through write operations,
//! which the write owner applies in order ([`apply_writes`]), so every placement sees the same
//! semantics.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use naam_ebpf::abi::{write_kind, Descriptor, WriteOp, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};

use naam_proto::step::{
    Action, DataPath, DmaModel, FetchError, Fetched, InPlace, Limits, MessageStart, OneSided,
    Outcome, StepMachine, WriteBatch, WriteError,
};

use crate::region::Region;
use crate::Clock;
use crate::HandlerEntry;
use crate::RegionTable;
use naam_proto::step::{Grant, Invocation, StepResult};
use naam_proto::step::{MemError, ResolveError};
use naam_proto::wire::Request;
use naam_proto::Nanos;
use naam_proto::Placement;
use naam_vm::{Executable, HandlerEngine, NextStep, Vm};

/// Runs `m`'s current step of `exe` on `vm` over `grants` (which cost `fetch_ns` to fetch)
/// with the message's `args`, and returns the machine's next action. No clock is read: the
/// driver times the whole message once.
pub fn run_step<E: HandlerEngine>(
    m: &mut StepMachine,
    vm: &mut E,
    exe: &Executable,
    args: &[u8],
    grants: &[Grant<'_>],
    fetch_ns: u64,
) -> Action {
    let result = vm.run_step(exe, &m.invocation(args, grants));
    m.stepped(result, fetch_ns)
}

/// What applies a step's write batch where this thread owns the app's writes, or refuses it
/// ([`WriteError::NotOwner`]). Besides the batch it gets the step's segments when the data path
/// granted region memory in place ([`DataPath::segments_in_place`]); [`apply_owned`] uses them.
pub type ApplyWrites<'a> =
    dyn FnMut(&WriteBatch<'_>, Option<InPlace<'_>>) -> Result<(), WriteError> + 'a;

/// Applies `batch` as the write owner: at the addresses of `in_place` (the segments of the
/// step that made it, from a path that grants region memory in place) when given, else each
/// target resolved in `regions`.
pub fn apply_owned(
    regions: &RegionTable,
    batch: &WriteBatch<'_>,
    in_place: Option<InPlace<'_>>,
) -> Result<(), WriteError> {
    match in_place {
        Some(segments) => apply_writes_in_place(batch, segments),
        None => apply_writes(regions, batch),
    }
}

/// The rights a write operation of `kind` needs in its target descriptor.
fn rights_for(kind: u32) -> u32 {
    match kind {
        write_kind::STORE => ACCESS_WRITE,
        _ => ACCESS_WRITE | ACCESS_ATOMIC,
    }
}

/// [`apply_writes`] at the addresses the step's segments were granted at, without resolving
/// each target again: the same rights checked (the path resolved every descriptor with the
/// rights it names, so a descriptor's write right is the region's), the same stores in the
/// same order. `in_place` must be the segments of the step that made `batch`, as drive
/// passes them: a write naming a missing segment, or one of another length, is refused, but
/// another step's segments of the same lengths would take the writes to the wrong places
/// (inside region memory still: nothing outside a grant is ever written).
pub fn apply_writes_in_place(
    batch: &WriteBatch<'_>,
    in_place: InPlace<'_>,
) -> Result<(), WriteError> {
    let segments = in_place.segments();
    for (index, op) in batch.ops.iter().enumerate() {
        // The operations a handler queues: a store of whole words or an aligned atomic,
        // inside a segment granted for its target, with the rights it needs. Every test
        // here is one `apply_op` makes (in its order, all of them passing); anything else,
        // a refusal included, goes to `apply_op`, which says why.
        let s = op.segment as usize;
        if let (Some(target), Some(seg)) = (batch.targets.get(s), segments.get(s)) {
            let len = op.len as usize;
            let fits = seg.len() == target.len as usize && op.offset as usize + len <= seg.len();
            let addr = seg.addr() + op.offset as u64;
            match op.kind {
                write_kind::STORE
                    if fits
                        && target.access & ACCESS_WRITE != 0
                        && (addr | len as u64).is_multiple_of(8) =>
                {
                    let from = op.data_offset as usize;
                    if let Some(bytes) = batch.data.get(from..from + len) {
                        // SAFETY: `[addr, addr + len)` lies inside the segment's grant,
                        // which `InPlace::new`'s caller vouched is region memory, mapped
                        // while `in_place` lives and only ever accessed atomically; `addr`
                        // is a word's.
                        unsafe { store_words(addr, bytes) };
                        fence(Ordering::Release);
                        continue;
                    }
                }
                write_kind::CAS | write_kind::FAA
                    if fits
                        && len == 8
                        && target.access & (ACCESS_WRITE | ACCESS_ATOMIC)
                            == ACCESS_WRITE | ACCESS_ATOMIC
                        && target
                            .offset
                            .wrapping_add(op.offset as u64)
                            .is_multiple_of(8) =>
                {
                    // SAFETY: as above: an aligned word inside the grant (the region
                    // starts on a word, so region offsets and addresses agree modulo 8).
                    let word = unsafe { &*(addr as *const AtomicU64) };
                    apply_atomic(index, op, word)?;
                    fence(Ordering::Release);
                    continue;
                }
                _ => {}
            }
        }
        apply_op(batch, index, op, |index, op, target, len| {
            locate_in_place(segments, index, op, target, len)
        })?;
    }
    Ok(())
}

/// Where `len` bytes of `op` lie in its segment's grant among `segments`: the words of the
/// segment and the byte of them the write starts at, or why the grant does not hold it.
fn locate_in_place<'m>(
    segments: &'m [Grant<'m>],
    index: usize,
    op: &WriteOp,
    target: &Descriptor,
    len: usize,
) -> Result<(&'m [AtomicU64], usize), WriteError> {
    let invalid = |reason: String| WriteError::Invalid { index, reason };
    let seg = match segments.get(op.segment as usize) {
        Some(g) if g.len() == target.len as usize => g,
        _ => {
            return Err(invalid(format!(
                "segment {} is not the target's grant",
                op.segment
            )))
        }
    };
    // The step machine checked that the write lies inside its segment.
    let end = op.offset as usize + len;
    if end > seg.len() {
        return Err(invalid(format!(
            "the write runs past its segment ({end} > {})",
            seg.len()
        )));
    }
    // The segment's words: region memory is whole 8-aligned words, so widening the
    // range to word boundaries stays inside its region.
    let first = seg.addr() & !7;
    let words = (seg.addr() + seg.len() as u64 - first).div_ceil(8) as usize;
    // SAFETY: `InPlace::new`'s caller vouched that the grant is region memory, mapped
    // while the segments live and only ever accessed atomically.
    let words = unsafe { std::slice::from_raw_parts(first as *const AtomicU64, words) };
    Ok((words, (seg.addr() - first) as usize + op.offset as usize))
}

/// Stores `src`, whole words, at `addr`: one release store per word.
///
/// # Safety
/// `addr` must be 8-aligned and `[addr, addr + src.len())` region memory that only atomics
/// access, mapped for the call; `src.len()` must be a multiple of 8.
#[inline]
unsafe fn store_words(addr: u64, src: &[u8]) {
    // SAFETY: the caller vouched for the words.
    let words = unsafe { std::slice::from_raw_parts(addr as *const AtomicU64, src.len() / 8) };
    crate::region::store_whole_words(words, src);
}

/// A `CAS` or `FAA` operation on `word`: a `CAS` that finds another value is a conflict.
#[inline]
fn apply_atomic(index: usize, op: &WriteOp, word: &AtomicU64) -> Result<(), WriteError> {
    if op.kind == write_kind::CAS {
        let found = crate::region::cas_word(word, op.expected, op.operand);
        if found != op.expected {
            return Err(WriteError::Conflict {
                index,
                expected: op.expected,
                found,
            });
        }
    } else {
        crate::region::faa_word(word, op.operand);
    }
    Ok(())
}

/// Applies `batch` to `regions` in order, each operation visible before the next (release
/// fences), as the write owner must.
pub fn apply_writes(regions: &RegionTable, batch: &WriteBatch<'_>) -> Result<(), WriteError> {
    // The target resolved last: a batch's operations come in runs on one segment (MICA's
    // PUT: three on the bucket, four on the item), resolved once per run.
    let mut resolved: Option<(&Descriptor, &Region)> = None;
    let mut locate = |index, op: &WriteOp, target, len| {
        let region = match resolved {
            Some((last, region)) if last == target => region,
            _ => {
                let (region, _) = regions.resolve_in(batch.app, target)?;
                resolved = Some((target, region));
                region
            }
        };
        // Inside the region: `resolve_in` checked the target's offset.
        let at = target.offset + op.offset as u64;
        region
            .mem
            .range(at, len as u64)
            .map_err(|e| WriteError::Invalid {
                index,
                reason: e.to_string(),
            })?;
        Ok((region.mem.words(), at as usize))
    };
    for (index, op) in batch.ops.iter().enumerate() {
        apply_op(batch, index, op, &mut locate)?;
    }
    Ok(())
}

/// Operation `index` of `batch`, `op`: checks its target, rights, kind and alignment, asks
/// `locate` for the memory of its `len` bytes in its target (the words they lie in and the
/// byte of them they start at, or a refusal) and stores, swaps or adds there, visible before
/// any later operation (a release fence).
fn apply_op<'b, 'm>(
    batch: &WriteBatch<'b>,
    index: usize,
    op: &WriteOp,
    mut locate: impl FnMut(
        usize,
        &WriteOp,
        &'b Descriptor,
        usize,
    ) -> Result<(&'m [AtomicU64], usize), WriteError>,
) -> Result<(), WriteError> {
    let invalid = |reason: String| WriteError::Invalid { index, reason };
    let Some(target) = batch.target(op) else {
        return Err(invalid(format!(
            "segment {} is not one of the step's {}",
            op.segment,
            batch.targets.len()
        )));
    };
    let need = rights_for(op.kind);
    if target.access & need != need {
        return Err(invalid(format!(
            "the descriptor grants {}, the write needs {}",
            naam_ebpf::abi::Rights(target.access),
            naam_ebpf::abi::Rights(need)
        )));
    }
    match op.kind {
        write_kind::STORE => {
            let bytes = batch.bytes(op);
            let (words, at) = locate(index, op, target, bytes.len())?;
            crate::region::store_bytes(words, at, bytes);
        }
        write_kind::CAS | write_kind::FAA => {
            // Named by its offset in the region; a region starts on a word, so its
            // offsets and its addresses agree modulo 8. Wrapping: the target is not
            // checked yet, and only the remainder counts.
            let in_region = target.offset.wrapping_add(op.offset as u64);
            if !in_region.is_multiple_of(8) {
                return Err(invalid(MemError::Misaligned(in_region).to_string()));
            }
            let (words, at) = locate(index, op, target, 8)?;
            apply_atomic(index, op, &words[at / 8])?;
        }
        k => return Err(invalid(format!("unknown kind {k}"))),
    }
    fence(Ordering::Release);
    Ok(())
}

/// Host cores: descriptors resolve to zero-copy, read-only views of region memory.
pub struct HostPath {
    regions: Arc<RegionTable>,
    grants: Vec<Grant<'static>>,
    /// The regions resolved last, most recent first: a step names the same few regions
    /// message after message (MICA's index and log, the B-tree's nodes), so most descriptors
    /// resolve here without a lookup in the table.
    recent: [CachedRegion; RECENT_REGIONS],
}

/// How many resolved regions a [`HostPath`] remembers.
const RECENT_REGIONS: usize = 4;

/// One region as a [`HostPath`] resolved it: what a descriptor is checked against.
#[derive(Clone, Copy, Default)]
struct CachedRegion {
    app: u32,
    /// 0: an empty entry (no region has rkey 0).
    rkey: u64,
    base: u64,
    size: u64,
    access: u32,
}

impl CachedRegion {
    /// The start of `d`'s range if it lies inside this region with rights it has.
    #[inline]
    fn check(&self, d: &Descriptor) -> Option<u64> {
        let end = d.offset.checked_add(d.len as u64)?;
        (d.access != 0 && d.access & !self.access == 0 && end <= self.size)
            .then_some(self.base + d.offset)
    }
}

impl HostPath {
    /// A host path over `regions`.
    pub fn new(regions: Arc<RegionTable>) -> Self {
        HostPath {
            regions,
            grants: Vec::with_capacity(naam_ebpf::abi::MAX_SEGMENTS),
            recent: [CachedRegion::default(); RECENT_REGIONS],
        }
    }

    /// The start address of `d`'s range for `app`: from a recently resolved region when it
    /// is one (the same checks), from the table otherwise.
    #[inline]
    fn resolve(&mut self, app: u32, d: &Descriptor) -> Result<u64, ResolveError> {
        if let Some(c) = self
            .recent
            .iter()
            .find(|c| c.rkey == d.rkey && c.app == app && c.rkey != 0)
        {
            if let Some(addr) = c.check(d) {
                return Ok(addr);
            }
        }
        let (region, addr) = self.regions.resolve_in(app, d)?;
        let entry = CachedRegion {
            app,
            rkey: region.rkey,
            base: region.mem.addr(),
            size: region.mem.len() as u64,
            access: region.access,
        };
        if !self.recent.iter().any(|c| c.rkey == entry.rkey) {
            self.recent.rotate_right(1);
            self.recent[0] = entry;
        }
        Ok(addr)
    }
}

/// Cache lines of a segment the host path prefetches when it grants it: enough for a MICA
/// bucket or item, or a B-tree node's header and first entries. Sixteen (a whole 1 KiB node)
/// measured slower than four: lines a search never reads compete for the cache.
const PREFETCH_LINES: u64 = 4;

/// Starts loading the first lines of the segment at `addr` (`len` bytes) into the cache. A
/// step's segments are named before the handler runs: on the host their cache misses then
/// overlap the step machine's and the engine's work up to the handler's first load, instead
/// of following it, which is what a DMA engine gives the NIC's cores. A hint, never an
/// access: it cannot fault, whatever the address.
#[inline(always)]
fn prefetch_segment(addr: u64, len: u32) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = addr.saturating_add(len as u64);
        let mut line = addr & !63;
        for _ in 0..PREFETCH_LINES {
            if line >= end {
                break;
            }
            // SAFETY: PREFETCHT0 is a hint that never faults and changes no architectural state.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, len, PREFETCH_LINES);
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

    // Inlined into `drive` (forced: drive fetches at two places, before the first step and
    // between steps in the engine's entry): its result, returned through the stack, was
    // reloaded at once and stalled on store forwarding.
    #[inline(always)]
    fn fetch(&mut self, app: u32, descs: &[Descriptor]) -> Result<Fetched<'_>, FetchError> {
        self.grants.clear();
        for d in descs {
            let addr = self.resolve(app, d)?;
            // A segment named without the read right is a write's target only (a B-tree
            // split's spare node): nothing will load it.
            if d.access & ACCESS_READ != 0 {
                prefetch_segment(addr, d.len);
            }
            // SAFETY: the resolved range lies inside a region that `self.regions` keeps alive for
            // the whole step; it is granted read-only.
            self.grants
                .push(unsafe { Grant::raw(addr, d.len as usize, ACCESS_READ) });
        }
        Ok(Fetched {
            grants: &self.grants,
            cost_ns: 0,
        })
    }

    fn segments_in_place(&self) -> Option<InPlace<'_>> {
        // SAFETY: every grant is the range `fetch` resolved its descriptor to, with the
        // rights it names, inside a region of `self.regions` (word-aligned memory that every
        // placement accesses only atomically), which this path keeps mapped.
        Some(unsafe { InPlace::new(&self.grants) })
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

    /// The one-sided READ transport, to look at.
    pub fn transport_ref(&self) -> &T {
        &self.transport
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

/// How [`drive`] stopped.
enum Stopped {
    /// The message finished: the machine holds how ([`StepMachine::outcome`],
    /// [`StepMachine::ended`]).
    Done,
    /// A torn read must wait until this clock time before the step is fetched again.
    Backoff(Nanos),
}

/// Runs a machine from `action` until it completes or a torn-read retry must wait. Never
/// sleeps: the wait is the caller's (a parked message on an executor, a sleep on a client's
/// own thread). `waited`: the pending retry's backoff has already been served. The steps
/// that follow a `Continue` run inside the engine's entry ([`Vm::run_steps`], fetched by
/// [`InEntry`]); drive's loop takes over at a write, a torn-read retry or the end. The
/// machine stays in place and the message's args are lent from the caller, so a message
/// whose data is local costs no allocation, no copy of its args and no clock read between
/// steps.
#[allow(clippy::too_many_arguments)]
fn drive<P: DataPath, E: HandlerEngine>(
    m: &mut StepMachine,
    exe: &Executable,
    args: &[u8],
    mut action: Action,
    cost: &mut RunCost,
    mut waited: bool,
    path: &mut P,
    vm: &mut E,
    clock: &dyn Clock,
    apply: &mut ApplyWrites<'_>,
) -> Stopped {
    let app = m.app();
    // Whether the engine's last run was this message's previous step.
    let mut continuing = false;
    loop {
        action = match action {
            Action::Complete => return Stopped::Done,
            Action::Fetch => {
                if let Some(ns) = m.retry_backoff_ns().filter(|_| !waited) {
                    return Stopped::Backoff(clock.now().saturating_add(ns));
                }
                waited = false;
                match path.fetch(app, m.current().as_slice()) {
                    Ok(f) => {
                        cost.fetch_ns += f.cost_ns;
                        cost.fetches += 1;
                        let fetch_ns = f.cost_ns;
                        let inv = Invocation {
                            resident: continuing,
                            ..m.invocation(args, f.grants)
                        };
                        let next = match vm.begin_steps(exe, &inv) {
                            // The steps after this one run in the same entry, fetched by
                            // `InEntry` between them.
                            Ok(true) => {
                                let mut between = InEntry {
                                    m,
                                    path,
                                    cost,
                                    app,
                                    fetch_ns,
                                    taken: None,
                                };
                                let result = vm.run_steps(exe, &mut between);
                                let (taken, fetch_ns) = (between.taken, between.fetch_ns);
                                match taken {
                                    Some(action) => action,
                                    None => m.stepped(result, fetch_ns),
                                }
                            }
                            Ok(false) => {
                                let result = vm.run_step(exe, &inv);
                                m.stepped(result, fetch_ns)
                            }
                            Err(fault) => m.stepped(Err(fault), fetch_ns),
                        };
                        continuing = matches!(next, Action::Fetch) && m.retries() == 0;
                        next
                    }
                    Err(e) => m.fetch_failed(&e),
                }
            }
            Action::Write => {
                let r = apply(&m.writes(vm), path.segments_in_place());
                m.writes_applied(r)
            }
        };
    }
}

/// What drive runs between two steps of one engine entry ([`Vm::run_steps`]): the machine
/// takes the step that returned `Continue`, and the data path fetches the next step's
/// segments, as drive's own loop would, without leaving the engine. A step whose next action
/// is not a fetch (the message ends, fails or writes), a pending retry's backoff, or a fetch
/// that fails ends the entry; the action the machine gave is then kept in `taken`, for drive
/// to act on instead of handing the machine that step again.
struct InEntry<'a, P: DataPath> {
    m: &'a mut StepMachine,
    path: &'a mut P,
    cost: &'a mut RunCost,
    app: u32,
    /// What the fetch that fed the step now running cost.
    fetch_ns: u64,
    taken: Option<Action>,
}

impl<P: DataPath> NextStep for InEntry<'_, P> {
    #[inline]
    fn next(&mut self, done: StepResult<'_>) -> Option<&[Grant<'_>]> {
        let action = self.m.stepped(Ok(done), self.fetch_ns);
        if action != Action::Fetch || self.m.retry_backoff_ns().is_some() {
            self.taken = Some(action);
            return None;
        }
        match self.path.fetch(self.app, self.m.current().as_slice()) {
            Ok(f) => {
                self.cost.fetch_ns += f.cost_ns;
                self.cost.fetches += 1;
                self.fetch_ns = f.cost_ns;
                Some(f.grants)
            }
            Err(e) => {
                self.taken = Some(self.m.fetch_failed(&e));
                None
            }
        }
    }
}

/// Starts `req` at `at` and drives it until it completes or parks for a torn-read retry.
pub fn start<P: DataPath, E: HandlerEngine>(
    req: &Request,
    handler: &Arc<HandlerEntry>,
    at: Place<'_, P, E>,
    apply: &mut ApplyWrites<'_>,
) -> Driven {
    start_message(MessageStart::from(req), &req.args, handler, at, apply)
}

/// Where a message runs: its data path, the engine, the limits and the clock (read only to
/// schedule a torn-read retry).
pub struct Place<'a, P: DataPath, E: HandlerEngine = Vm> {
    /// How the placement reaches the message's data.
    pub path: &'a mut P,
    /// The engine state of this thread.
    pub vm: &'a mut E,
    /// Hop and retry limits.
    pub limits: Limits,
    /// When a parked retry may resume is this clock's time.
    pub clock: &'a dyn Clock,
    /// A machine the caller runs its messages in, one after another
    /// ([`StepMachine::restart`]); `None`, a new one per message. A caller that drops each
    /// reply before its next message then allocates nothing per message.
    pub machine: Option<&'a mut StepMachine>,
}

/// Starts the message `msg` (args `args`, borrowed for its whole run) and drives it until it
/// completes or parks for a torn-read retry: [`start`] without a [`Request`], for callers that
/// run their own messages where the data is.
// Inlined into its callers, as `finish` is, so the outcome that drive returns is read field
// by field where it is used rather than copied whole into a `Driven` (16-byte loads of what
// 8-byte stores had just built stall on store forwarding).
#[inline(always)]
pub fn start_message<P: DataPath, E: HandlerEngine>(
    msg: MessageStart<'_>,
    args: &[u8],
    handler: &Arc<HandlerEntry>,
    at: Place<'_, P, E>,
    apply: &mut ApplyWrites<'_>,
) -> Driven {
    let (placement, limits) = (at.path.placement(), at.limits);
    let (app, kind) = (handler.app, handler.kind);
    let mut fresh;
    let (m, action) = match at.machine {
        Some(m) => {
            let action = m.restart(msg, app, kind, placement, limits);
            (m, action)
        }
        None => {
            let action;
            (fresh, action) = StepMachine::start(msg, app, kind, placement, limits);
            (&mut fresh, action)
        }
    };
    let mut cost = RunCost::default();
    let stopped = drive(
        m,
        &handler.exe,
        args,
        action,
        &mut cost,
        false,
        at.path,
        at.vm,
        at.clock,
        apply,
    );
    finish(stopped, m, handler, cost)
}

/// What a drive that stopped leaves its caller: the outcome, or the message parked. A parked
/// message takes `machine` along and leaves a new one in its place; a finished one moves
/// nothing (the machine is a few hundred bytes).
#[inline(always)]
fn finish(
    stopped: Stopped,
    machine: &mut StepMachine,
    handler: &Arc<HandlerEntry>,
    cost: RunCost,
) -> Driven {
    match stopped {
        Stopped::Done => Driven::Done(machine.outcome(), cost),
        Stopped::Backoff(resume_at) => Driven::Parked(Box::new(ParkedRun {
            machine: std::mem::replace(machine, StepMachine::unused()),
            handler: handler.clone(),
            cost,
            resume_at,
        })),
    }
}

/// Resumes a parked message (its backoff served) until it completes or parks again; `args`
/// are the message's, as it started with them.
pub fn resume<P: DataPath, E: HandlerEngine>(
    parked: Box<ParkedRun>,
    args: &[u8],
    path: &mut P,
    vm: &mut E,
    clock: &dyn Clock,
    apply: &mut ApplyWrites<'_>,
) -> Driven {
    let ParkedRun {
        mut machine,
        handler,
        mut cost,
        ..
    } = *parked;
    let stopped = drive(
        &mut machine,
        &handler.exe,
        args,
        Action::Fetch,
        &mut cost,
        true,
        path,
        vm,
        clock,
        apply,
    );
    finish(stopped, &mut machine, &handler, cost)
}

/// Drives `req` to completion on `path`, waiting out torn-read backoffs on this thread (the
/// synchronous driver of the client and tests; executors park instead, see [`start`]).
/// `apply` applies write batches when this placement owns the app's writes.
pub fn run_message<P: DataPath, E: HandlerEngine>(
    req: &Request,
    handler: &Arc<HandlerEntry>,
    path: &mut P,
    vm: &mut E,
    limits: Limits,
    clock: &dyn Clock,
    apply: impl FnMut(&WriteBatch<'_>, Option<InPlace<'_>>) -> Result<(), WriteError>,
) -> (Outcome, RunCost) {
    run_message_parts(
        MessageStart::from(req),
        &req.args,
        handler,
        Place {
            path,
            vm,
            limits,
            clock,
            machine: None,
        },
        apply,
    )
}

/// Runs the message `msg` (args `args`) to its end in `machine`, waiting out torn-read
/// backoffs on this thread, and leaves how it ended in the machine, to be read in place with
/// [`StepMachine::ended`] before the machine's next message. For callers that own their
/// machine and read each reply before sending the next (direct execution): no outcome is
/// built, no payload split off the machine's buffer.
#[inline]
#[allow(clippy::too_many_arguments)]
pub fn run_in_place<P: DataPath, E: HandlerEngine>(
    msg: MessageStart<'_>,
    args: &[u8],
    handler: &HandlerEntry,
    path: &mut P,
    vm: &mut E,
    limits: Limits,
    clock: &dyn Clock,
    machine: &mut StepMachine,
    mut apply: impl FnMut(&WriteBatch<'_>, Option<InPlace<'_>>) -> Result<(), WriteError>,
) -> RunCost {
    let action = machine.restart(msg, handler.app, handler.kind, path.placement(), limits);
    let mut cost = RunCost::default();
    let (mut action, mut waited) = (action, false);
    loop {
        match drive(
            machine,
            &handler.exe,
            args,
            action,
            &mut cost,
            waited,
            path,
            vm,
            clock,
            &mut apply,
        ) {
            Stopped::Done => return cost,
            Stopped::Backoff(resume_at) => {
                clock.wait_until(resume_at);
                (action, waited) = (Action::Fetch, true);
            }
        }
    }
}

/// [`run_message`] without a [`Request`]: the message `msg` with args `args`.
#[inline]
pub fn run_message_parts<P: DataPath, E: HandlerEngine>(
    msg: MessageStart<'_>,
    args: &[u8],
    handler: &Arc<HandlerEntry>,
    at: Place<'_, P, E>,
    mut apply: impl FnMut(&WriteBatch<'_>, Option<InPlace<'_>>) -> Result<(), WriteError>,
) -> (Outcome, RunCost) {
    let Place {
        path,
        vm,
        limits,
        clock,
        machine,
    } = at;
    let mut driven = start_message(
        msg,
        args,
        handler,
        Place {
            path: &mut *path,
            vm: &mut *vm,
            limits,
            clock,
            machine,
        },
        &mut apply,
    );
    loop {
        match driven {
            Driven::Done(c, cost) => return (c, cost),
            Driven::Parked(p) => {
                clock.wait_until(p.resume_at);
                driven = resume(p, args, path, vm, clock, &mut apply);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{RegionMemory, RegionTable};
    use proptest::prelude::*;

    const APP: u32 = 7;
    const RKEY: u64 = 0x5eed;
    const REGION: usize = 256;

    fn table() -> Arc<RegionTable> {
        let t = RegionTable::new();
        t.register_with_key(
            RKEY,
            APP,
            "r",
            ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
            RegionMemory::zeroed(REGION),
        )
        .expect("a fresh key");
        Arc::new(t)
    }

    fn snapshot(t: &RegionTable) -> Vec<u8> {
        t.get(APP, RKEY).expect("registered").mem.snapshot()
    }

    /// A segment: offset, length and rights (always some, within the region's). Half start
    /// on a word, as a handler's usually do.
    fn segment() -> impl Strategy<Value = Descriptor> {
        let offset = prop_oneof![(0u64..25).prop_map(|w| w * 8), 0u64..200];
        (offset, 8u32..56, 1u32..8).prop_map(|(offset, len, access)| Descriptor {
            rkey: RKEY,
            offset,
            len,
            access,
        })
    }

    /// An operation as the step machine passes them on: inside its segment. `pick` chooses
    /// the segment, `at` and `len` are scaled into it; `words` rounds both down to whole
    /// words (when that leaves a word), as handlers mostly write.
    fn op() -> impl Strategy<Value = (bool, u32, u8, u32, u32, u64, u64, Vec<u8>)> {
        (
            any::<bool>(),
            0u32..3,
            0u8..3,
            any::<u32>(),
            1u32..24,
            prop_oneof![Just(0u64), any::<u64>()],
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 24),
        )
    }

    /// A batch whose operation names a segment the step did not have is refused either way,
    /// before anything is written (a batch the machine made never holds one; a hand-made one
    /// may).
    #[test]
    fn a_write_naming_a_segment_past_the_step_s_is_refused_both_ways() {
        let target = Descriptor {
            rkey: RKEY,
            offset: 0,
            len: 16,
            access: ACCESS_READ | ACCESS_WRITE,
        };
        let batch = WriteBatch {
            app: APP,
            request_id: 1,
            ops: &[WriteOp {
                kind: write_kind::STORE,
                segment: 1,
                len: 8,
                ..WriteOp::default()
            }],
            targets: &[target],
            data: &[0xAB; 8],
        };
        let (resolved, granted) = (table(), table());
        let mut path = HostPath::new(granted.clone());
        path.fetch(APP, &[target])
            .expect("the segment lies in the region");
        for result in [
            apply_writes(&resolved, &batch),
            apply_owned(&granted, &batch, path.segments_in_place()),
        ] {
            let err = result.expect_err("segment 1 of 1").to_string();
            assert!(
                err.contains("segment 1 is not one of the step's 1"),
                "{err}"
            );
        }
        assert_eq!(snapshot(&resolved), vec![0; REGION]);
        assert_eq!(snapshot(&granted), vec![0; REGION]);
    }

    proptest! {
        /// Applied at the addresses a host path granted, a batch leaves memory and result
        /// exactly as resolving every target in the table does: rights refused, conflicts,
        /// misaligned atomics and stores at any alignment alike.
        #[test]
        fn writes_applied_in_place_match_writes_resolved_in_the_table(
            segs in proptest::collection::vec(segment(), 3),
            ops in proptest::collection::vec(op(), 1..10),
        ) {
            let (mut queued, mut data) = (Vec::new(), Vec::new());
            for (words, pick, kind, at, len, expected, operand, bytes) in ops {
                let target = segs[pick as usize];
                let kind = [write_kind::STORE, write_kind::CAS, write_kind::FAA][kind as usize];
                let mut len = if kind == write_kind::STORE { len.min(target.len) } else { 8 };
                if words && len >= 8 {
                    len &= !7;
                }
                let mut offset = at % (target.len - len + 1);
                if words {
                    offset &= !7;
                }
                let data_offset = data.len() as u32;
                if kind == write_kind::STORE {
                    data.extend_from_slice(&bytes[..len as usize]);
                }
                queued.push(WriteOp {
                    kind,
                    segment: pick,
                    offset,
                    len,
                    data_offset,
                    reserved: 0,
                    operand,
                    expected,
                });
            }
            let batch = WriteBatch {
                app: APP,
                request_id: 1,
                ops: &queued,
                targets: &segs,
                data: &data,
            };
            let (resolved, granted) = (table(), table());
            let by_table = apply_writes(&resolved, &batch);
            let mut path = HostPath::new(granted.clone());
            path.fetch(APP, &segs).expect("the segments lie in the region");
            let in_place = apply_owned(&granted, &batch, path.segments_in_place());
            prop_assert_eq!(
                by_table.map_err(|e| e.to_string()),
                in_place.map_err(|e| e.to_string())
            );
            prop_assert_eq!(snapshot(&resolved), snapshot(&granted));
        }
    }
}
