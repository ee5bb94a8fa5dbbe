//! One YCSB phase (load or run) on client threads: pacing to a target rate, a time limit,
//! per-operation histograms, YCSB's status lines every interval and HdrHistogram interval logs.
//! The stores come from the caller through the [`Store`] interface defined here; this module
//! owns the loop, that interface and the measurements.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use crossbeam_utils::CachePadded;
use hdrhistogram::Histogram;

use crate::ycsb::{KeyChooser, Op, RecordShape, Rng, Workload};
use naam_runtime::{Clock, SystemClock};

/// Whether `e` says the server has been silent past the client's liveness bound: the run
/// stops at once and fails, rather than fail every remaining operation.
pub(crate) fn server_gone(e: &anyhow::Error) -> bool {
    use naam_runtime::proto::transport::ClientError;
    e.chain().any(|c| {
        let client = c
            .downcast_ref::<ClientError>()
            .or_else(|| match c.downcast_ref::<naam_mica::MicaError>() {
                Some(naam_mica::MicaError::Client(ce)) => Some(ce),
                _ => None,
            })
            .or_else(|| match c.downcast_ref::<naam_btree::BTreeError>() {
                Some(naam_btree::BTreeError::Client(ce)) => Some(ce),
                _ => None,
            });
        matches!(client, Some(ClientError::ServerGone { .. }))
    })
}

/// One thread's view of the store.
pub(crate) trait Store {
    fn read(&mut self, n: u64) -> anyhow::Result<bool>;
    fn update(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()>;
    fn insert(&mut self, n: u64, record: &[u8]) -> anyhow::Result<()>;
    fn scan(&mut self, n: u64, len: usize) -> anyhow::Result<usize>;
    fn rmw(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()>;

    /// Runs `op` now; `Ok(false)`: a read (or read-modify-write) that found no record.
    fn run(&mut self, op: StoreOp) -> anyhow::Result<bool> {
        match op {
            StoreOp::Read(n) => self.read(n),
            StoreOp::Update(n, field, bytes) => self.update(n, field, &bytes).map(|()| true),
            StoreOp::Rmw(n, field, bytes) => self.rmw(n, field, &bytes).map(|()| true),
            StoreOp::Insert(n, record) => self.insert(n, &record).map(|()| true),
            StoreOp::Scan(n, len) => self.scan(n, len).map(|_| true),
        }
    }

    /// The store's pipelined side, when it keeps several operations in flight.
    fn piped(&mut self) -> Option<&mut dyn PipedStore> {
        None
    }
}

/// One YCSB operation as the driver drew it.
#[derive(Clone, Debug)]
pub(crate) enum StoreOp {
    /// Read the record of key number `.0`.
    Read(u64),
    /// Write `.2` over field `.1` (or the whole record) of key `.0`.
    Update(u64, usize, Vec<u8>),
    /// Read, then write `.2` over field `.1` of key `.0` (YCSB's read-modify-write).
    Rmw(u64, usize, Vec<u8>),
    /// Insert record `.1` as key `.0`.
    Insert(u64, Vec<u8>),
    /// Scan `.1` records from key `.0`.
    Scan(u64, usize),
}

/// A store that keeps operations in flight (`--pipeline`): each started with a tag, handed
/// back by tag when it finishes.
pub(crate) trait PipedStore {
    /// Starts `op`, tagged `tag`.
    fn start(&mut self, tag: u64, op: StoreOp) -> anyhow::Result<()>;
    /// Operations that finished, by tag (`Ok(false)`: found no record); with `block`, waits
    /// a while for one when any is in flight.
    fn finished(&mut self, block: bool) -> Vec<(u64, anyhow::Result<bool>)>;
    /// Operations started and not yet handed back.
    fn in_flight(&self) -> usize;
}

/// Makes one store per client thread.
pub(crate) type StoreFactory = Arc<dyn Fn() -> anyhow::Result<Box<dyn Store + Send>> + Send + Sync>;

/// Which phase a loop runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseKind {
    /// Inserts key numbers `start..start + count`, split across threads.
    Load {
        /// First key number.
        start: u64,
        /// Records to insert.
        count: u64,
    },
    /// The workload's operation mix.
    Run,
}

impl PhaseKind {
    /// `load` or `run`.
    pub fn name(self) -> &'static str {
        match self {
            PhaseKind::Load { .. } => "load",
            PhaseKind::Run => "run",
        }
    }
}

/// What a phase loop needs besides its stores.
pub struct PhasePlan<'a> {
    /// Load or run.
    pub kind: PhaseKind,
    /// Operations in all (run), or ignored (load: the key range).
    pub ops: u64,
    /// Client threads.
    pub threads: usize,
    /// Workload (the run's mix; key naming for both).
    pub workload: &'a Workload,
    /// Records present before the run (the key chooser's range).
    pub records: u64,
    /// Record shape.
    pub shape: RecordShape,
    /// Updates write every field.
    pub write_all_fields: bool,
    /// Random seed of the phase; each client thread seeds its generator from it and its index.
    pub seed: u64,
    /// Operations per second over all threads.
    pub target_ops_per_sec: Option<f64>,
    /// Stop after this long.
    pub max_execution_time: Option<Duration>,
    /// Print a status line this often (stderr).
    pub status_interval: Option<Duration>,
    /// Write HdrHistogram interval logs into this directory.
    pub hdr_log: Option<&'a Path>,
    /// Operations each client thread keeps in flight (1: one at a time).
    pub pipeline: usize,
}

/// One operation type's histogram and outcome counts over a phase.
#[derive(Clone, Debug)]
pub struct OpStats {
    /// Latencies of successful operations, nanoseconds.
    pub latency: Histogram<u64>,
    /// Reads (and read-modify-writes) that found no record.
    pub not_found: u64,
    /// Operations that failed.
    pub errors: u64,
}

/// Every operation type's statistics, in [`Op::ALL`] order.
pub type PerOp = Vec<(Op, OpStats)>;

/// The outcome of a phase.
pub struct PhaseOutcome {
    /// Per operation type, in [`Op::ALL`] order.
    pub ops: PerOp,
    /// Wall time from the first operation to the last thread's end.
    pub seconds: f64,
    /// Whether the time limit ended it.
    pub timed_out: bool,
    /// Whether an interrupt (SIGINT, SIGTERM: [`stop_on`]) ended it.
    pub interrupted: bool,
}

/// The flag that ends phases early when set (a signal handler's), once given.
static STOP: std::sync::OnceLock<&'static AtomicBool> = std::sync::OnceLock::new();

/// Ends every phase early, as its time limit would, once `flag` is set (naam-bench gives
/// the flag its SIGINT and SIGTERM handler sets): what ran is reported.
pub fn stop_on(flag: &'static AtomicBool) {
    let _ = STOP.set(flag);
}

/// Whether [`stop_on`]'s flag is set.
pub fn stop_asked() -> bool {
    STOP.get().is_some_and(|f| f.load(Ordering::Relaxed))
}

/// Latency histogram bounds: 1 ns to 60 s, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

fn empty_stats() -> PerOp {
    Op::ALL
        .iter()
        .map(|&op| {
            (
                op,
                OpStats {
                    latency: histogram(),
                    not_found: 0,
                    errors: 0,
                },
            )
        })
        .collect()
}

/// Holds a thread to `rate` operations per second from `start` (YCSB's throttle: the i-th
/// operation is not issued before `start + i / rate`).
struct Pacer {
    start: Instant,
    per_op: Option<Duration>,
}

impl Pacer {
    fn wait(&self, i: u64) {
        if let Some(per_op) = self.per_op {
            let due = self.start + per_op.mul_f64(i as f64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
    }
}

/// Runs one phase. `progress` hears the operations done so far.
pub(crate) fn run_phase(
    plan: &PhasePlan<'_>,
    make: &StoreFactory,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<PhaseOutcome> {
    let threads = plan.threads.max(1) as u64;
    let total = match plan.kind {
        PhaseKind::Load { count, .. } => count,
        PhaseKind::Run => plan.ops,
    };
    let per_thread = total.div_ceil(threads);
    // A count to estimate completion against: none for a run bounded by time alone.
    let counted = (total != u64::MAX).then_some(total);
    // Each thread writes its own per operation: padded, so that no two threads' statistics
    // share a cache line (they did, and the lock's line bounced between the cores).
    let intervals: Vec<CachePadded<Mutex<PerOp>>> = (0..threads)
        .map(|_| CachePadded::new(Mutex::new(empty_stats())))
        .collect();
    let done = AtomicU64::new(0);
    let next_insert = AtomicU64::new(plan.records);
    let failed = AtomicBool::new(false);
    let timed_out = AtomicBool::new(false);
    let gone = Mutex::new(None::<String>);
    let start = Instant::now();
    let deadline = plan.max_execution_time.map(|d| start + d);
    let per_op = plan
        .target_ops_per_sec
        .and_then(|t| Duration::try_from_secs_f64(threads as f64 / t).ok());
    let mut log = IntervalLog::new(plan.kind.name(), start, plan.hdr_log);
    let (results, end) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (done, next_insert, failed, timed_out, gone) =
                    (&done, &next_insert, &failed, &timed_out, &gone);
                let interval = &intervals[t as usize];
                let make = make.clone();
                let first = t * per_thread;
                let count = per_thread.min(total.saturating_sub(first));
                s.spawn(move || -> (PerOp, Instant) {
                    let mut stats = empty_stats();
                    let mut store = match make() {
                        Ok(s) => s,
                        Err(e) => {
                            eprintln!("naam-bench: a client could not start: {e:#}");
                            failed.store(true, Ordering::Relaxed);
                            return (stats, Instant::now());
                        }
                    };
                    let wl = plan.workload;
                    let shape = plan.shape;
                    let mut rng = Rng::new(plan.seed ^ (t + 1).wrapping_mul(0x9e37_79b9));
                    let mut keys = KeyChooser::new(wl.distribution, plan.records.max(1));
                    let mut scan_zipf = None;
                    let pacer = Pacer {
                        start: Instant::now(),
                        per_op,
                    };
                    // Latencies by the runtime's clock (the time-stamp counter where it is
                    // invariant): a third of the cost of two `Instant` reads per operation.
                    let clock = SystemClock::new();
                    // Operations not yet added to the shared count (one shared write per
                    // batch, not per operation: the count is only read for progress).
                    let mut unreported = 0u64;
                    // With a pipeline, up to `depth` operations are in flight: tag -> (its
                    // type's slot, when it started).
                    let depth = plan.pipeline.max(1);
                    let piped = depth > 1 && store.piped().is_some();
                    // Operations started since the store last sent (every `finished` sends).
                    // A window refilled after a batch of answers goes out in two halves: the
                    // first travels and is served while the second is prepared, so client and
                    // server overlap instead of taking turns (memtier and redis-benchmark keep
                    // their windows full the same way, a request per answer).
                    let mut unsent = 0usize;
                    let send_every = depth.div_ceil(2);
                    let mut flying: naam_runtime::proto::intmap::IntMap<u64, (usize, u64)> =
                        Default::default();
                    let mut stop = false;
                    let finish = |slot: usize,
                                  r: anyhow::Result<bool>,
                                  ns: u64,
                                  stats: &mut PerOp|
                     -> bool {
                        let mut shared = interval.lock().unwrap_or_else(|p| p.into_inner());
                        let counted_as = counted_as(slot);
                        match r {
                            Ok(found) => {
                                for &at in counted_as {
                                    let _ = stats[at].1.latency.record(ns);
                                    let _ = shared[at].1.latency.record(ns);
                                    if !found {
                                        stats[at].1.not_found += 1;
                                        shared[at].1.not_found += 1;
                                    }
                                }
                                false
                            }
                            Err(e) => {
                                for &at in counted_as {
                                    stats[at].1.errors += 1;
                                    shared[at].1.errors += 1;
                                }
                                if server_gone(&e) {
                                    *gone.lock().unwrap_or_else(|p| p.into_inner()) =
                                        Some(format!("{e:#}"));
                                    failed.store(true, Ordering::Relaxed);
                                    return true;
                                }
                                if stats[slot].1.errors == 1 {
                                    eprintln!("naam-bench: {} failed: {e:#}", Op::ALL[slot].name());
                                }
                                false
                            }
                        }
                    };
                    for i in 0..count {
                        if stop || failed.load(Ordering::Relaxed) {
                            break;
                        }
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            timed_out.store(true, Ordering::Relaxed);
                            break;
                        }
                        if stop_asked() {
                            break;
                        }
                        pacer.wait(i);
                        let op = match plan.kind {
                            PhaseKind::Load { .. } => Op::Insert,
                            PhaseKind::Run => wl.next_op(&mut rng),
                        };
                        let sop = match (plan.kind, op) {
                            (PhaseKind::Load { start, .. }, _) => {
                                StoreOp::Insert(start + first + i, shape.record(&mut rng))
                            }
                            (_, Op::Read) => {
                                keys.set_records(next_insert.load(Ordering::Relaxed));
                                StoreOp::Read(keys.next(&mut rng))
                            }
                            (_, Op::Update) | (_, Op::Rmw) => {
                                keys.set_records(next_insert.load(Ordering::Relaxed));
                                let n = keys.next(&mut rng);
                                let (field, bytes) = if plan.write_all_fields {
                                    (0, shape.record(&mut rng))
                                } else {
                                    let f = rng.range(0, shape.field_count as u64 - 1) as usize;
                                    (f, shape.bytes(&mut rng, shape.field_length))
                                };
                                if op == Op::Update {
                                    StoreOp::Update(n, field, bytes)
                                } else {
                                    StoreOp::Rmw(n, field, bytes)
                                }
                            }
                            (_, Op::Insert) => {
                                let n = next_insert.fetch_add(1, Ordering::Relaxed);
                                StoreOp::Insert(n, shape.record(&mut rng))
                            }
                            (_, Op::Scan) => {
                                keys.set_records(next_insert.load(Ordering::Relaxed));
                                let len = wl.scan_length(&mut rng, &mut scan_zipf) as usize;
                                StoreOp::Scan(keys.next(&mut rng), len)
                            }
                        };
                        let slot = Op::ALL.iter().position(|&o| o == op).expect("known op");
                        let began = clock.now();
                        match store.piped().filter(|_| piped) {
                            Some(p) => {
                                // Wait for room in the window, then keep it full.
                                while p.in_flight() >= depth && !stop {
                                    unsent = 0;
                                    for (tag, r) in p.finished(true) {
                                        if let Some((slot, began)) = flying.remove(&tag) {
                                            let ns = clock.now().saturating_sub(began).max(1);
                                            stop |= finish(slot, r, ns, &mut stats);
                                        }
                                    }
                                }
                                match p.start(i, sop) {
                                    Ok(()) => {
                                        flying.insert(i, (slot, began));
                                        unsent += 1;
                                    }
                                    Err(e) => stop |= finish(slot, Err(e), 1, &mut stats),
                                }
                                // Paced, each operation goes out at once; otherwise they go
                                // out together, half a window at a time (coalesced).
                                if per_op.is_some() || unsent >= send_every {
                                    unsent = 0;
                                    for (tag, r) in p.finished(false) {
                                        if let Some((slot, began)) = flying.remove(&tag) {
                                            let ns = clock.now().saturating_sub(began).max(1);
                                            stop |= finish(slot, r, ns, &mut stats);
                                        }
                                    }
                                }
                            }
                            None => {
                                let r = store.run(sop);
                                let ns = clock.now().saturating_sub(began).max(1);
                                stop |= finish(slot, r, ns, &mut stats);
                            }
                        }
                        unreported += 1;
                        if unreported == 64 {
                            done.fetch_add(unreported, Ordering::Relaxed);
                            unreported = 0;
                        }
                    }
                    // What is still in flight finishes (or fails) before the thread ends.
                    if let Some(p) = store.piped() {
                        let give_up = Instant::now() + Duration::from_secs(30);
                        while !flying.is_empty() && Instant::now() < give_up {
                            for (tag, r) in p.finished(true) {
                                if let Some((slot, began)) = flying.remove(&tag) {
                                    let ns = clock.now().saturating_sub(began).max(1);
                                    finish(slot, r, ns, &mut stats);
                                }
                            }
                        }
                    }
                    done.fetch_add(unreported, Ordering::Relaxed);
                    (stats, Instant::now())
                })
            })
            .collect();
        // Status lines and interval logs while the threads run.
        let mut last_status = start;
        let mut last_done = 0u64;
        let status_every = plan.status_interval;
        let log_every = plan
            .hdr_log
            .map(|_| status_every.unwrap_or(Duration::from_secs(1)));
        let mut last_log = start;
        while handles.iter().any(|h| !h.is_finished()) {
            std::thread::sleep(Duration::from_millis(50));
            let now = Instant::now();
            let n = done.load(Ordering::Relaxed);
            progress(n.min(total), total);
            let status_due = status_every.is_some_and(|every| now - last_status >= every);
            let log_due = log_every.is_some_and(|every| now - last_log >= every);
            if status_due || log_due {
                let merged = take_interval(&intervals);
                if status_due {
                    eprintln!(
                        "{}",
                        status_line(
                            now - start,
                            n,
                            n - last_done,
                            now - last_status,
                            counted,
                            &merged
                        )
                    );
                    last_status = now;
                    last_done = n;
                }
                if plan.hdr_log.is_some() {
                    log.push(last_log, now, &merged);
                    last_log = now;
                }
            }
        }
        let results: Vec<(PerOp, Instant)> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| (empty_stats(), Instant::now())))
            .collect();
        // When the last thread finished, not when this loop next looked (it sleeps 50 ms): a
        // short phase's rate is its own.
        let end = results
            .iter()
            .map(|(_, e)| *e)
            .max()
            .unwrap_or_else(Instant::now)
            .max(last_status);
        // The last, partial interval.
        let merged = take_interval(&intervals);
        if let Some(every) = status_every {
            let n = done.load(Ordering::Relaxed);
            if end - last_status >= every / 10 || last_status == start {
                eprintln!(
                    "{}",
                    status_line(
                        end - start,
                        n,
                        n - last_done,
                        end - last_status,
                        counted,
                        &merged
                    )
                );
            }
        }
        if plan.hdr_log.is_some() {
            log.push(last_log, end, &merged);
        }
        (results, end)
    });
    log.finish()?;
    if let Some(why) = gone.into_inner().unwrap_or_else(|p| p.into_inner()) {
        anyhow::bail!("the {} phase stopped: {why}", plan.kind.name());
    }
    if failed.load(Ordering::Relaxed) {
        anyhow::bail!(
            "a client thread could not start; the {} phase is incomplete",
            plan.kind.name()
        );
    }
    let last = results.iter().map(|(_, e)| *e).max().unwrap_or(end);
    tracing::debug!(
        phase = plan.kind.name(),
        threads,
        seconds = last.duration_since(start).as_secs_f64(),
        "phase finished"
    );
    let mut ops = empty_stats();
    for (stats, _) in results {
        for (slot, (_, s)) in ops.iter_mut().zip(stats) {
            slot.1.latency.add(&s.latency).expect("same bounds");
            slot.1.not_found += s.not_found;
            slot.1.errors += s.errors;
        }
    }
    progress(total, total);
    Ok(PhaseOutcome {
        ops,
        seconds: last.duration_since(start).as_secs_f64().max(1e-9),
        timed_out: timed_out.load(Ordering::Relaxed),
        interrupted: stop_asked(),
    })
}

/// The slots of [`Op::ALL`] an operation in slot `slot` is counted in: its own, and for a
/// read-modify-write also `READ` and `UPDATE`, as YCSB counts workload F (it measures the
/// read and the update of an RMW apart; NAAM runs both in one message, whose time stands for
/// each).
fn counted_as(slot: usize) -> &'static [usize] {
    const READ: usize = 0;
    const UPDATE: usize = 1;
    const RMW: usize = 4;
    const _: () = assert!(
        matches!(Op::ALL[READ], Op::Read)
            && matches!(Op::ALL[UPDATE], Op::Update)
            && matches!(Op::ALL[RMW], Op::Rmw)
    );
    const SLOTS: [[usize; 1]; 5] = [[0], [1], [2], [3], [4]];
    match slot {
        RMW => &[RMW, READ, UPDATE],
        s if s < SLOTS.len() => &SLOTS[s],
        _ => &[],
    }
}

/// Takes every thread's interval statistics, leaving them empty.
fn take_interval(intervals: &[CachePadded<Mutex<PerOp>>]) -> PerOp {
    let mut merged = empty_stats();
    for m in intervals {
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        for (slot, (_, t)) in merged.iter_mut().zip(s.iter_mut()) {
            slot.1.latency.add(&t.latency).expect("same bounds");
            slot.1.not_found += t.not_found;
            slot.1.errors += t.errors;
            t.latency.reset();
            t.not_found = 0;
            t.errors = 0;
        }
    }
    merged
}

/// YCSB's status line: `<date> <n> sec: <ops> operations; <rate> current ops/sec; [READ:
/// Count=.., Max=.., Min=.., Avg=.., 90=.., 99=.., 99.9=.., 99.99=..] ...` (latencies in us).
pub fn status_line(
    elapsed: Duration,
    ops: u64,
    interval_ops: u64,
    interval: Duration,
    total: Option<u64>,
    stats: &[(Op, OpStats)],
) -> String {
    let rate = interval_ops as f64 / interval.as_secs_f64().max(1e-9);
    let mut line = format!(
        "{} {} sec: {ops} operations; {rate:.1} current ops/sec;",
        utc_now(),
        elapsed.as_secs()
    );
    // YCSB's estimate: the rest at the rate so far.
    if let Some(total) = total.filter(|&t| ops > 0 && ops < t) {
        let left = elapsed.as_secs_f64() * (total - ops) as f64 / ops as f64;
        line.push_str(&format!(
            " est completion in {}",
            remaining_words(left as u64)
        ));
    }
    for (op, s) in stats {
        let h = &s.latency;
        if h.is_empty() {
            continue;
        }
        let us = |ns: u64| ns / 1000;
        line.push_str(&format!(
            " [{}: Count={}, Max={}, Min={}, Avg={:.2}, 90={}, 99={}, 99.9={}, 99.99={}]",
            op.ycsb_name(),
            h.len(),
            us(h.max()),
            us(h.min()),
            h.mean() / 1000.0,
            us(h.value_at_quantile(0.90)),
            us(h.value_at_quantile(0.99)),
            us(h.value_at_quantile(0.999)),
            us(h.value_at_quantile(0.9999)),
        ));
    }
    line
}

/// A time left as YCSB's status lines word it: days and hours, hours and minutes under a
/// day, seconds only under a minute (`1 minute`, `2 hours 5 minutes`, `40 seconds`).
pub fn remaining_words(secs: u64) -> String {
    let unit = |n: u64, one: &str| format!("{n} {one}{}", if n == 1 { "" } else { "s" });
    let (days, hours, minutes) = (secs / 86_400, secs % 86_400 / 3_600, secs % 3_600 / 60);
    let mut parts = Vec::new();
    if days > 0 {
        parts.push(unit(days, "day"));
    }
    if hours > 0 {
        parts.push(unit(hours, "hour"));
    }
    if days == 0 && minutes > 0 {
        parts.push(unit(minutes, "minute"));
    }
    if parts.is_empty() {
        parts.push(unit(secs, "second"));
    }
    parts.join(" ")
}

/// `YYYY-MM-DD HH:MM:SS:mmm` in UTC, YCSB's status-line clock.
pub fn utc_now() -> String {
    let since = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}:{:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// HdrHistogram interval logs of one phase, one file per operation type
/// (`<prefix><phase>-<OP>.hdr`), in the format YCSB's `hdrhistogram` measurement writes (Java's
/// `HistogramLogWriter`: a format-version line, the start time, a column legend, then one line
/// per interval: start and length in seconds, the interval's maximum in seconds, and the
/// interval's histogram, deflate-compressed V2 encoding in base64), latencies in
/// microseconds. Each interval is appended as the run goes and flushed, so a run cut short
/// leaves what it measured.
struct IntervalLog {
    phase: &'static str,
    /// Each file is this, the phase and the operation (`<prefix><phase>-<OP>.hdr`).
    prefix: Option<PathBuf>,
    start: Instant,
    start_wall: SystemTime,
    /// Per operation slot, its file once it has a first interval.
    files: Vec<Option<std::io::BufWriter<std::fs::File>>>,
    /// The first write error (reported when the phase ends; the run goes on).
    failed: Option<anyhow::Error>,
}

impl IntervalLog {
    fn new(phase: &'static str, start: Instant, prefix: Option<&Path>) -> IntervalLog {
        IntervalLog {
            phase,
            prefix: prefix.map(Path::to_path_buf),
            start,
            start_wall: SystemTime::now(),
            files: (0..Op::ALL.len()).map(|_| None).collect(),
            failed: None,
        }
    }

    /// Appends the interval `[from, to)`'s histograms.
    fn push(&mut self, from: Instant, to: Instant, stats: &PerOp) {
        if self.prefix.is_none() || self.failed.is_some() {
            return;
        }
        if let Err(e) = self.append(from, to, stats) {
            self.failed = Some(e);
        }
    }

    fn append(&mut self, from: Instant, to: Instant, stats: &PerOp) -> anyhow::Result<()> {
        use base64::Engine as _;
        use hdrhistogram::serialization::{Serializer as _, V2DeflateSerializer};
        use std::io::Write as _;
        let Some(prefix) = self.prefix.clone() else {
            return Ok(());
        };
        let at = from.saturating_duration_since(self.start).as_secs_f64();
        let length = to.saturating_duration_since(from).as_secs_f64();
        for (slot, (op, s)) in stats.iter().enumerate() {
            if s.latency.is_empty() {
                continue;
            }
            let mut name = prefix.clone().into_os_string();
            name.push(format!("{}-{}.hdr", self.phase, op.ycsb_name()));
            let path = PathBuf::from(name);
            if self.files[slot].is_none() {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
                let mut f = std::io::BufWriter::new(
                    std::fs::File::create(&path)
                        .with_context(|| format!("creating {}", path.display()))?,
                );
                let started = self
                    .start_wall
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64();
                writeln!(
                    f,
                    "#[naam-bench {} phase, {} latencies in microseconds]",
                    self.phase,
                    op.ycsb_name()
                )?;
                writeln!(f, "#[Histogram log format version 1.3]")?;
                writeln!(
                    f,
                    "#[StartTime: {started:.3} (seconds since epoch), {}]",
                    utc_now()
                )?;
                writeln!(
                    f,
                    "\"StartTimestamp\",\"Interval_Length\",\"Interval_Max\",\"Interval_Compressed_Histogram\""
                )?;
                self.files[slot] = Some(f);
            }
            let mut us = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            for v in s.latency.iter_recorded() {
                let value = (v.value_iterated_to() / 1000).clamp(1, 60_000_000);
                us.record_n(value, v.count_at_value())
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
            }
            let mut encoded = Vec::new();
            V2DeflateSerializer::new()
                .serialize(&us, &mut encoded)
                .map_err(|e| {
                    anyhow::anyhow!("encoding an interval of {}: {e:?}", path.display())
                })?;
            let f = self.files[slot].as_mut().expect("opened above");
            writeln!(
                f,
                "{at:.3},{length:.3},{:.6},{}",
                us.max() as f64 / 1e6,
                base64::engine::general_purpose::STANDARD.encode(&encoded)
            )?;
            f.flush()
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// Ends the logs: any write error the phase met.
    fn finish(self) -> anyhow::Result<()> {
        match self.failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_have_ycsb_shape() {
        let mut stats = empty_stats();
        stats[0].1.latency.record(12_000).unwrap();
        stats[0].1.latency.record(30_000).unwrap();
        let line = status_line(
            Duration::from_secs(10),
            2,
            2,
            Duration::from_secs(10),
            None,
            &stats,
        );
        let (date, rest) = line.split_at(23);
        assert_eq!(date.len(), 23, "{line}");
        assert!(
            date.starts_with("20") && date.as_bytes()[10] == b' ',
            "{line}"
        );
        assert!(
            rest.starts_with(
                " 10 sec: 2 operations; 0.2 current ops/sec; [READ: Count=2, Max=30, Min=12,"
            ),
            "{line}"
        );
        assert!(!line.contains("UPDATE"), "{line}");
        let line = status_line(
            Duration::from_secs(10),
            100,
            100,
            Duration::from_secs(10),
            Some(700),
            &stats,
        );
        assert!(
            line.contains("current ops/sec; est completion in 1 minute ["),
            "{line}"
        );
    }

    #[test]
    fn time_left_is_worded_as_ycsb_words_it() {
        assert_eq!(remaining_words(40), "40 seconds");
        assert_eq!(remaining_words(1), "1 second");
        assert_eq!(remaining_words(60), "1 minute");
        assert_eq!(remaining_words(7_500), "2 hours 5 minutes");
        assert_eq!(remaining_words(90_061), "1 day 1 hour");
    }
}
