//! What naam-server and naam-nic show operators while they run: per (app, handler, placement)
//! message counts by status and service-time histograms, recorded by the drivers as replies
//! leave, the drivers' counters, executor queue depths and steering weights, rendered in
//! Prometheus' text exposition format; and the small HTTP endpoint (`--metrics ADDR`) that
//! serves it. Rendering is pure; the endpoint is a thin thread over a `TcpListener` that
//! treats every request as hostile (bounded, timed out, GET /metrics only).

use naam_proto::EngineKind;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use naam_proto::intmap::IntMap;
use naam_proto::wire::Status;
use naam_proto::Placement;

/// Upper bounds of the latency histogram buckets, microseconds (then `+Inf`).
pub const LATENCY_BUCKETS_US: [u64; 14] = [
    5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 50_000, 100_000, 1_000_000,
];

/// Most distinct (app, handler, placement) series kept (each recording shard keeps its
/// share, [`SHARDS`] of them in all); later ones are counted in
/// `naam_series_dropped_total` (a hostile client cannot grow a server's memory through names
/// it makes up: only installed handlers are ever dispatched, this is a second fence).
pub const MAX_SERIES: usize = 16_384;

type SeriesKey = (u32, u32, Placement);

#[derive(Clone, Default)]
struct Series {
    by_status: Vec<(Status, u64)>,
    latency: LatencyBuckets,
    sum_ns: u128,
}

impl Series {
    /// Adds `other`'s counts (the same series, recorded in another shard).
    fn absorb(&mut self, other: &Series) {
        for &(status, n) in &other.by_status {
            self.count(status, n);
        }
        for (mine, theirs) in self.latency.counts.iter_mut().zip(other.latency.counts) {
            *mine += theirs;
        }
        self.sum_ns += other.sum_ns;
    }

    /// One more message ended with `status` after `service_ns` in this process.
    fn add(&mut self, status: Status, service_ns: u64) {
        self.count(status, 1);
        let v = service_ns.clamp(1, crate::MAX_LATENCY_NS);
        self.latency.record(v);
        self.sum_ns += u128::from(v);
    }

    /// Counts `n` more messages ended with `status`.
    fn count(&mut self, status: Status, n: u64) {
        match self.by_status.iter_mut().find(|(st, _)| *st == status) {
            Some((_, m)) => *m += n,
            None => self.by_status.push((status, n)),
        }
    }
}

/// Shards the series are recorded in: each thread records into one of its own (chosen when
/// it first records), so that the threads that answer requests (a loop per core, client
/// threads running an inline server) never wait for one another's lock nor pass its cache
/// line around; a scrape merges them.
const SHARDS: usize = 8;

/// One shard, alone on its cache lines.
#[derive(Default)]
#[repr(align(128))]
struct SeriesShard(Mutex<IntMap<SeriesKey, Series>>);

/// This thread's shard index (see [`SHARDS`]).
fn shard_of_thread() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: Cell<Option<usize>> = const { Cell::new(None) };
    }
    SLOT.with(|slot| match slot.get() {
        Some(i) => i,
        None => {
            let i = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
            slot.set(Some(i));
            i
        }
    })
}

/// Service times counted in the exposition's buckets themselves: exact at every bound (a
/// general histogram's buckets straddle them), and a record per reply is a search of
/// fourteen bounds and one increment in a line or two of memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct LatencyBuckets {
    /// `[i]`: times over bound `i - 1` and at most bound `i` (`LATENCY_BUCKETS_US`); the last,
    /// times over every bound.
    counts: [u64; LATENCY_BUCKETS_US.len() + 1],
}

/// [`LATENCY_BUCKETS_US`] in nanoseconds, the unit replies are timed in.
const LATENCY_BUCKETS_NS: [u64; LATENCY_BUCKETS_US.len()] = {
    let mut ns = [0; LATENCY_BUCKETS_US.len()];
    let mut i = 0;
    while i < ns.len() {
        ns[i] = LATENCY_BUCKETS_US[i] * 1000;
        i += 1;
    }
    ns
};

impl LatencyBuckets {
    fn record(&mut self, ns: u64) {
        // The bounds under `ns`, all fourteen compared (no branch to mispredict, no multiply):
        // the index of its bucket, as a search of the sorted bounds would find it.
        let i = LATENCY_BUCKETS_NS.iter().filter(|&&b| b < ns).count();
        self.counts[i] += 1;
    }

    /// Times of at most bound `i`'s microseconds (Prometheus' cumulative `le` bucket).
    fn at_most(&self, i: usize) -> u64 {
        self.counts[..=i].iter().sum()
    }

    fn len(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Replies recorded before they reach a [`Telemetry`]: those that one thread answers itself
/// (a receive loop running requests to completion, or the inline endpoint a client's thread
/// serves), kept by that thread and handed over every [`PendingSeries::HANDED_EVERY`]
/// replies, when its loop goes idle, when the inline endpoint's timers fire and before the
/// thread's counters are published, so that a reply costs no lock (two locked instructions,
/// after the reply's copy, per operation before). A scrape sees them at most that late.
#[derive(Default)]
pub(crate) struct PendingSeries {
    /// A list, not a map: a thread answers a few handlers at a time, and finding one of
    /// them in a list costs less than hashing its key (at most `HANDED_EVERY` of them).
    series: Vec<(SeriesKey, Series)>,
    recorded: u32,
}

impl PendingSeries {
    /// Replies kept before they are handed over, at most.
    pub(crate) const HANDED_EVERY: u32 = 64;

    /// [`Telemetry::record`], kept here until the next [`PendingSeries::hand_to`].
    pub(crate) fn record(
        &mut self,
        telemetry: &Telemetry,
        key: (u32, u32, Placement),
        status: Status,
        service_ns: u64,
    ) {
        tracing::trace!(
            app = key.0,
            handler = format_args!("{:#x}", key.1),
            placement = key.2.name(),
            status = status.name(),
            service_ns,
            "answered"
        );
        let s = match self.series.iter().position(|(k, _)| *k == key) {
            Some(i) => &mut self.series[i].1,
            None => {
                self.series.push((key, Series::default()));
                let last = self.series.len() - 1;
                &mut self.series[last].1
            }
        };
        s.add(status, service_ns);
        self.recorded += 1;
        if self.recorded >= Self::HANDED_EVERY {
            self.hand_to(telemetry);
        }
    }

    /// Hands what was kept to `telemetry`.
    pub(crate) fn hand_to(&mut self, telemetry: &Telemetry) {
        if self.recorded == 0 {
            return;
        }
        self.recorded = 0;
        telemetry.absorb(&mut self.series);
    }
}

/// Live measurements of a driver.
#[derive(Default)]
pub struct Telemetry {
    // Recorded by the threads that answer as replies leave, each into its shard; merged when
    // read. Keyed by installed apps and handlers only (see `MAX_SERIES`), so an integer hash
    // does: no SipHash per reply.
    series: [SeriesShard; SHARDS],
    dropped: std::sync::atomic::AtomicU64,
    counters: Mutex<Vec<(&'static str, &'static str, u64)>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let series = self.merged().len();
        f.debug_struct("Telemetry")
            .field("series", &series)
            .finish()
    }
}

/// Counters as `(name, help, value)`.
type Counters = Vec<(&'static str, &'static str, u64)>;

/// Where the receive loops publish their counters: each its own slot; the published series
/// are the sums.
pub(crate) struct LoopCounters {
    index: usize,
    all: Arc<Mutex<Vec<Counters>>>,
}

impl LoopCounters {
    /// The slots of `loops` loops, in loop order.
    pub(crate) fn group(loops: usize) -> Vec<LoopCounters> {
        let all = Arc::new(Mutex::new(vec![Vec::new(); loops]));
        (0..loops)
            .map(|index| LoopCounters {
                index,
                all: all.clone(),
            })
            .collect()
    }

    /// Records this loop's counters and publishes every loop's, summed by name.
    pub(crate) fn publish(&self, telemetry: &Telemetry, mine: Counters) {
        let mut all = self.all.lock().unwrap_or_else(|e| e.into_inner());
        all[self.index] = mine;
        let mut sum: Counters = Vec::new();
        for (name, help, value) in all.iter().flatten() {
            match sum.iter_mut().find(|(n, _, _)| n == name) {
                Some(s) => s.2 += value,
                None => sum.push((name, help, *value)),
            }
        }
        drop(all);
        telemetry.publish_counters(sum);
    }
}

impl Telemetry {
    /// Records a message of `app`'s `handler` that ended at `placement` with `status` after
    /// `service_ns` in this process (queueing and execution).
    pub fn record(
        &self,
        app: u32,
        handler: u32,
        placement: Placement,
        status: Status,
        service_ns: u64,
    ) {
        tracing::trace!(
            app,
            handler = format_args!("{handler:#x}"),
            placement = placement.name(),
            status = status.name(),
            service_ns,
            "answered"
        );
        let Ok(mut m) = self.series[shard_of_thread()].0.lock() else {
            return;
        };
        let key = (app, handler, placement);
        // Each shard holds its share of the bound: the merged series stay within it.
        let full = m.len() >= MAX_SERIES / SHARDS;
        let s = match m.entry(key) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(_) if full => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Entry::Vacant(v) => v.insert(Series {
                by_status: Vec::new(),
                latency: LatencyBuckets::default(),
                sum_ns: 0,
            }),
        };
        s.add(status, service_ns);
    }

    /// Adds the series a thread recorded on its own ([`PendingSeries`]) to its shard, within
    /// the bound of [`MAX_SERIES`], and empties them.
    fn absorb(&self, pending: &mut Vec<(SeriesKey, Series)>) {
        let Ok(mut m) = self.series[shard_of_thread()].0.lock() else {
            return;
        };
        for (key, s) in pending.drain(..) {
            let full = m.len() >= MAX_SERIES / SHARDS;
            match m.entry(key) {
                Entry::Occupied(o) => o.into_mut().absorb(&s),
                Entry::Vacant(_) if full => {
                    let n = s.by_status.iter().map(|&(_, n)| n).sum::<u64>();
                    self.dropped.fetch_add(n, Ordering::Relaxed);
                }
                Entry::Vacant(v) => {
                    v.insert(s);
                }
            }
        }
    }

    /// Every shard's series, summed.
    fn merged(&self) -> IntMap<SeriesKey, Series> {
        let mut all: IntMap<SeriesKey, Series> = IntMap::default();
        for shard in &self.series {
            let Ok(m) = shard.0.lock() else {
                continue;
            };
            for (k, s) in m.iter() {
                all.entry(*k).or_default().absorb(s);
            }
        }
        all
    }

    /// Publishes the driver's counters: `(name, help, value)`; names become
    /// `naam_<name>_total`.
    pub fn publish_counters(&self, counters: Vec<(&'static str, &'static str, u64)>) {
        if let Ok(mut c) = self.counters.lock() {
            *c = counters;
        }
    }

    /// The Prometheus text exposition of everything recorded, plus `cluster`'s queue depths
    /// and steering weights; `role` (`server`, `nic`) labels every series.
    pub fn render(&self, role: &str, cluster: &Cluster) -> String {
        let mut out = String::new();
        let names = handler_names(cluster);
        let name = |app: u32, h: u32| -> (String, String) {
            names
                .get(&(app, h))
                .cloned()
                .unwrap_or_else(|| (app.to_string(), format!("{h:#010x}")))
        };
        let _ = writeln!(
            out,
            "# HELP naam_up Whether the {role} is serving (always 1 when scraped)."
        );
        let _ = writeln!(out, "# TYPE naam_up gauge");
        let _ = writeln!(out, "naam_up{{role=\"{role}\"}} 1");
        let series = {
            let mut v: Vec<_> = self
                .merged()
                .into_iter()
                .map(|(k, s)| (k, s.by_status, s.latency, s.sum_ns))
                .collect();
            v.sort_by_key(|(k, ..)| (k.0, k.1, k.2.index()));
            v
        };
        let _ = writeln!(
            out,
            "# HELP naam_messages_total Messages answered, by app, handler, placement and status."
        );
        let _ = writeln!(out, "# TYPE naam_messages_total counter");
        for ((app, h, p), by_status, _, _) in &series {
            let (app_name, handler) = name(*app, *h);
            for (status, n) in by_status {
                let _ = writeln!(
                    out,
                    "naam_messages_total{{role=\"{role}\",app=\"{}\",handler=\"{}\",placement=\"{}\",status=\"{}\"}} {n}",
                    escape(&app_name),
                    escape(&handler),
                    p.name(),
                    status_name(*status)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP naam_service_seconds Time from arrival to reply in this process, by app, handler and placement."
        );
        let _ = writeln!(out, "# TYPE naam_service_seconds histogram");
        for ((app, h, p), _, latency, sum_ns) in &series {
            let (app_name, handler) = name(*app, *h);
            let labels = format!(
                "role=\"{role}\",app=\"{}\",handler=\"{}\",placement=\"{}\"",
                escape(&app_name),
                escape(&handler),
                p.name()
            );
            for (i, bound) in LATENCY_BUCKETS_US.into_iter().enumerate() {
                let n = latency.at_most(i);
                let _ = writeln!(
                    out,
                    "naam_service_seconds_bucket{{{labels},le=\"{}\"}} {n}",
                    bound as f64 / 1e6
                );
            }
            let _ = writeln!(
                out,
                "naam_service_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                latency.len()
            );
            let _ = writeln!(
                out,
                "naam_service_seconds_sum{{{labels}}} {}",
                *sum_ns as f64 / 1e9
            );
            let _ = writeln!(
                out,
                "naam_service_seconds_count{{{labels}}} {}",
                latency.len()
            );
        }
        let _ = writeln!(
            out,
            "# HELP naam_queue_depth Messages waiting at this process's executors, by placement."
        );
        let _ = writeln!(out, "# TYPE naam_queue_depth gauge");
        for p in Placement::ALL {
            if let Some(depth) = cluster.queue_depth(p) {
                let _ = writeln!(
                    out,
                    "naam_queue_depth{{role=\"{role}\",placement=\"{}\"}} {depth}",
                    p.name()
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP naam_steering_weight Share of a handler's messages steering sends to each placement."
        );
        let _ = writeln!(out, "# TYPE naam_steering_weight gauge");
        let mut keys: Vec<_> = names.keys().copied().collect();
        keys.sort_unstable();
        for (app, h) in keys {
            let (app_name, handler) = name(app, h);
            let w = cluster.weights(app, h);
            for p in Placement::ALL {
                let _ = writeln!(
                    out,
                    "naam_steering_weight{{role=\"{role}\",app=\"{}\",handler=\"{}\",placement=\"{}\"}} {}",
                    escape(&app_name),
                    escape(&handler),
                    p.name(),
                    w.of(p)
                );
            }
        }
        render_engines(&mut out, role, cluster);
        render_accounts(&mut out, role, cluster);
        let counters = self.counters.lock().map(|c| c.clone()).unwrap_or_default();
        for (counter, help, value) in counters {
            let _ = writeln!(out, "# HELP naam_{counter}_total {help}");
            let _ = writeln!(out, "# TYPE naam_{counter}_total counter");
            let _ = writeln!(out, "naam_{counter}_total{{role=\"{role}\"}} {value}");
        }
        let _ = writeln!(
            out,
            "# HELP naam_series_dropped_total Messages not recorded because the series limit was reached."
        );
        let _ = writeln!(out, "# TYPE naam_series_dropped_total counter");
        let _ = writeln!(
            out,
            "naam_series_dropped_total{{role=\"{role}\"}} {}",
            self.dropped.load(Ordering::Relaxed)
        );
        out
    }
}

/// Each handler's engine (which one runs its next step, how long it took to be served and,
/// tiered, until its JIT code was ready) and the code cache's counters.
fn render_engines(out: &mut String, role: &str, cluster: &Cluster) {
    let registry = cluster.registry();
    let mut handlers: Vec<_> = registry
        .apps()
        .flat_map(|a| a.handlers.values().map(move |h| (a, h)))
        .collect();
    handlers.sort_by_key(|(a, h)| (a.id, h.id));
    let labels = |a: &crate::registry::AppEntry, h: &crate::registry::HandlerEntry| {
        format!(
            "role=\"{role}\",app=\"{}\",handler=\"{}\"",
            escape(&a.name),
            escape(&h.name)
        )
    };
    let _ = writeln!(
        out,
        "# HELP naam_handler_engine Which engine runs a handler's next step (1 for the engine that does), by its configured engine."
    );
    let _ = writeln!(out, "# TYPE naam_handler_engine gauge");
    for (a, h) in &handlers {
        let running = h.exe.running_engine();
        for e in [EngineKind::Interp, EngineKind::Jit] {
            let _ = writeln!(
                out,
                "naam_handler_engine{{{},configured=\"{}\",engine=\"{}\"}} {}",
                labels(a, h),
                h.exe.engine().name(),
                e.name(),
                u8::from(running == e)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP naam_handler_build_seconds Time to verify, analyse and prepare a handler until it could be served."
    );
    let _ = writeln!(out, "# TYPE naam_handler_build_seconds gauge");
    for (a, h) in &handlers {
        let _ = writeln!(
            out,
            "naam_handler_build_seconds{{{}}} {:.6}",
            labels(a, h),
            h.exe.compile_time().as_secs_f64()
        );
    }
    let _ = writeln!(
        out,
        "# HELP naam_handler_jit_ready_seconds A tiered handler's time from its build's start to its JIT code (absent until ready)."
    );
    let _ = writeln!(out, "# TYPE naam_handler_jit_ready_seconds gauge");
    for (a, h) in &handlers {
        if let Some(d) = h.exe.jit_ready_after() {
            let _ = writeln!(
                out,
                "naam_handler_jit_ready_seconds{{{}}} {:.6}",
                labels(a, h),
                d.as_secs_f64()
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP naam_handler_jit_failed A tiered handler whose background compilation failed (it stays on the interpreter)."
    );
    let _ = writeln!(out, "# TYPE naam_handler_jit_failed gauge");
    for (a, h) in &handlers {
        if h.exe.jit_failure().is_some() {
            let _ = writeln!(out, "naam_handler_jit_failed{{{}}} 1", labels(a, h));
        }
    }
    let stats = cluster.config().code_cache.stats();
    for (name, help, value) in [
        (
            "code_cache_memory_hits",
            "Handlers whose compiled code another executable of the same program held in memory.",
            stats.memory_hits,
        ),
        (
            "code_cache_store_hits",
            "Handlers whose compiled code was loaded from the code cache's directory, its seal checked.",
            stats.store_hits,
        ),
        ("code_cache_compiled", "Handlers compiled.", stats.compiled),
        (
            "code_cache_rejected",
            "Stored entries refused (corrupted, truncated, another key's or another secret's) and compiled again.",
            stats.rejected,
        ),
    ] {
        let _ = writeln!(out, "# HELP naam_{name}_total {help}");
        let _ = writeln!(out, "# TYPE naam_{name}_total counter");
        let _ = writeln!(out, "naam_{name}_total{{role=\"{role}\"}} {value}");
    }
}

/// Each app's handler time per placement and its exhausted tenant budgets.
fn render_accounts(out: &mut String, role: &str, cluster: &Cluster) {
    let accounts = cluster.app_accounts();
    let app_name = |id: u32| {
        cluster
            .registry()
            .app(id)
            .map_or_else(|| id.to_string(), |a| a.name.clone())
    };
    let _ = writeln!(
        out,
        "# HELP naam_app_cpu_seconds_total Handler time an app's messages took in this process, by placement."
    );
    let _ = writeln!(out, "# TYPE naam_app_cpu_seconds_total counter");
    for a in &accounts {
        for p in Placement::ALL {
            let ns = a.cpu_ns[p.index()];
            if ns > 0 {
                let _ = writeln!(
                    out,
                    "naam_app_cpu_seconds_total{{role=\"{role}\",app=\"{}\",placement=\"{}\"}} {:.9}",
                    escape(&app_name(a.app)),
                    p.name(),
                    ns as f64 / 1e9
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "# HELP naam_app_budget_exhausted_total Periods in which an app spent a tenant budget (steps, or torn-read retries) and was refused for the rest of the period."
    );
    let _ = writeln!(out, "# TYPE naam_app_budget_exhausted_total counter");
    for a in &accounts {
        for (budget, n) in [
            ("steps", a.steps_exhausted),
            ("retries", a.retries_exhausted),
        ] {
            let _ = writeln!(
                out,
                "naam_app_budget_exhausted_total{{role=\"{role}\",app=\"{}\",budget=\"{budget}\"}} {n}",
                escape(&app_name(a.app))
            );
        }
    }
}

/// `(app, handler id) -> (app name, handler name)` of every installed handler.
fn handler_names(cluster: &Cluster) -> HashMap<(u32, u32), (String, String)> {
    let mut names = HashMap::new();
    for app in cluster.registry().apps() {
        for h in app.handlers.values() {
            names.insert((app.id, h.id), (app.name.clone(), h.name.clone()));
        }
    }
    names
}

/// A status as a label value (`ok`, `handler-error`): [`Status::name`], as JSON and logs
/// name it.
fn status_name(s: Status) -> &'static str {
    s.name()
}

/// Escapes a label value (backslash, quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Longest request head the endpoint reads.
const MAX_REQUEST: usize = 8 * 1024;
/// How long a connection may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves `render()` at `GET /metrics` on `listener` until `stop` is set: one connection at a
/// time, each bounded in size and time; anything else gets 404 or 405.
pub fn serve_metrics(
    listener: TcpListener,
    stop: &AtomicBool,
    render: &(dyn Fn() -> String + Sync),
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = answer(stream, render);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!("metrics endpoint: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    Ok(())
}

fn answer(mut stream: TcpStream, render: &(dyn Fn() -> String + Sync)) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let started = Instant::now();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() > MAX_REQUEST || started.elapsed() > REQUEST_TIMEOUT {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "request too large\n",
            );
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    match route(&head) {
        Route::Metrics => respond(
            &mut stream,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &render(),
        ),
        Route::NotFound => respond(&mut stream, "404 Not Found", "text/plain", "try /metrics\n"),
        Route::NotAllowed => respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET /metrics\n",
        ),
    }
}

/// What the endpoint does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /metrics` (a query string is ignored).
    Metrics,
    /// `GET` of another path.
    NotFound,
    /// Any other method, or no request line.
    NotAllowed,
}

/// Routes a request by its first line (any bytes: the peer is untrusted).
pub fn route(head: &[u8]) -> Route {
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => Route::Metrics,
        ("GET", _) => Route::NotFound,
        _ => Route::NotAllowed,
    }
}

fn respond(stream: &mut TcpStream, status: &str, kind: &str, body: &str) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

/// Binds `addr` and serves `render` on a thread named `metrics` until `stop` is set; returns
/// the bound address (port 0 picks one).
pub fn spawn_metrics(
    addr: SocketAddr,
    stop: &'static AtomicBool,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            if let Err(e) = serve_metrics(listener, stop, render.as_ref()) {
                tracing::warn!("metrics endpoint stopped: {e}");
            }
        })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_are_snake_case_and_labels_are_escaped() {
        assert_eq!(status_name(Status::Ok), "ok");
        assert_eq!(status_name(Status::HandlerError), "handler-error");
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn series_recorded_by_several_threads_are_read_summed() {
        let t = Telemetry::default();
        std::thread::scope(|s| {
            for i in 0..(SHARDS as u64 + 3) {
                let t = &t;
                s.spawn(move || {
                    t.record(1, 7, Placement::Host, Status::Ok, 3_000 + i);
                    t.record(1, 7, Placement::Host, Status::Busy, 20_000);
                    t.record(2, 9, Placement::Nic, Status::Ok, 1);
                });
            }
        });
        let all = t.merged();
        let threads = SHARDS as u64 + 3;
        let s = &all[&(1, 7, Placement::Host)];
        let count = |st| s.by_status.iter().find(|(x, _)| *x == st).map(|(_, n)| *n);
        assert_eq!(count(Status::Ok), Some(threads));
        assert_eq!(count(Status::Busy), Some(threads));
        assert_eq!(s.latency.len(), 2 * threads);
        assert_eq!(
            s.latency.at_most(0),
            threads,
            "the 3 µs times, at most 5 µs"
        );
        let sum: u128 = (0..threads).map(|i| 3_000 + i as u128 + 20_000).sum();
        assert_eq!(s.sum_ns, sum);
        assert_eq!(all[&(2, 9, Placement::Nic)].latency.len(), threads);
        assert_eq!(all.len(), 2);
    }

    #[test]
    fn replies_kept_by_a_thread_reach_the_telemetry_when_handed_over_or_enough() {
        let t = Telemetry::default();
        let mut p = PendingSeries::default();
        let key = (1, 7, Placement::Host);
        p.record(&t, key, Status::Ok, 3_000);
        p.record(&t, key, Status::Busy, 20_000);
        assert!(t.merged().is_empty(), "kept until handed over");
        p.hand_to(&t);
        let all = t.merged();
        let s = &all[&key];
        assert_eq!(s.latency.len(), 2);
        assert_eq!(s.sum_ns, 23_000);
        // The next ones are counted on top, and handed over by themselves once there are
        // enough of them.
        for _ in 0..PendingSeries::HANDED_EVERY {
            p.record(&t, key, Status::Ok, 1);
        }
        let all = t.merged();
        let ok = all[&key].by_status.iter().find(|(st, _)| *st == Status::Ok);
        assert_eq!(
            ok.map(|(_, n)| *n),
            Some(1 + u64::from(PendingSeries::HANDED_EVERY))
        );
        p.hand_to(&t);
        assert_eq!(
            t.merged()[&key].latency.len(),
            2 + u64::from(PendingSeries::HANDED_EVERY)
        );
    }

    #[test]
    fn service_times_land_in_the_bucket_of_the_first_bound_they_do_not_exceed() {
        let mut b = LatencyBuckets::default();
        // At a bound: in it (Prometheus' `le`); a nanosecond over: in the next.
        b.record(5_000);
        b.record(5_001);
        b.record(1);
        b.record(1_000_000_000);
        b.record(1_000_000_001);
        b.record(u64::MAX);
        assert_eq!(b.at_most(0), 2, "1 ns and 5 µs are at most 5 µs");
        assert_eq!(b.at_most(1), 3, "5.001 µs is at most 10 µs");
        let last = LATENCY_BUCKETS_US.len() - 1;
        assert_eq!(b.at_most(last), 4, "one second is at most the last bound");
        assert_eq!(
            b.len(),
            6,
            "what exceeds every bound is counted in +Inf only"
        );
    }

    proptest::proptest! {
        #[test]
        fn cumulative_buckets_never_decrease_and_end_at_the_count(times in proptest::collection::vec(0u64..2_000_000_000, 0..200)) {
            let mut b = LatencyBuckets::default();
            for &t in &times {
                b.record(t);
            }
            let cumulative: Vec<u64> = (0..LATENCY_BUCKETS_US.len()).map(|i| b.at_most(i)).collect();
            proptest::prop_assert!(cumulative.windows(2).all(|w| w[0] <= w[1]));
            for (i, &us) in LATENCY_BUCKETS_US.iter().enumerate() {
                let want = times.iter().filter(|&&t| t <= us * 1000).count() as u64;
                proptest::prop_assert_eq!(cumulative[i], want);
            }
            proptest::prop_assert_eq!(b.len(), times.len() as u64);
        }

        #[test]
        fn any_request_bytes_get_a_route(head in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = route(&head);
        }
    }

    #[test]
    fn routes() {
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.1\r\n"), Route::Metrics);
        assert_eq!(route(b"GET /other HTTP/1.1\r\n"), Route::NotFound);
        assert_eq!(route(b"DELETE /metrics HTTP/1.1\r\n"), Route::NotAllowed);
        assert_eq!(route(b""), Route::NotAllowed);
        assert_eq!(route(&[0xff, 0xfe, b'\n']), Route::NotAllowed);
    }

    #[test]
    fn the_endpoint_answers_metrics_and_refuses_the_rest() {
        static STOP: AtomicBool = AtomicBool::new(false);
        let addr = spawn_metrics(
            "127.0.0.1:0".parse().unwrap(),
            &STOP,
            Arc::new(|| "naam_up 1\n".to_string()),
        )
        .unwrap();
        let get = |req: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(req).unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let ok = get(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            ok.starts_with("HTTP/1.1 200 OK") && ok.ends_with("naam_up 1\n"),
            "{ok}"
        );
        assert!(get(b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        assert!(get(&[b'A'; 20_000]).starts_with("HTTP/1.1 431"));
        // A silent client is dropped after the timeout; the endpoint keeps serving.
        let _idle = TcpStream::connect(addr).unwrap();
        assert!(get(b"GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200"));
        STOP.store(true, Ordering::SeqCst);
    }
}
