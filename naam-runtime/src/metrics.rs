//! Metrics: end-to-end latency histograms per placement and per handler, operation counts per
//! placement and status, and the timeline of placement weights that benchmarks read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use hdrhistogram::Histogram;
use serde::Serialize;

use naam_proto::steering::{HandlerKey, Weights};
use naam_proto::wire::Status;
use naam_proto::Nanos;
use naam_proto::Placement;

/// Largest latency recorded, nanoseconds (longer ones are clamped).
pub const MAX_LATENCY_NS: u64 = 60_000_000_000;

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid bounds")
}

/// Per-handler histograms: two significant digits and 32-bit counts (about 13 KiB each instead
/// of 200 KiB), so a thousand apps' handlers stay cheap to keep and warm to record into.
fn handler_histogram() -> Histogram<u32> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 2).expect("valid bounds")
}

/// One point of the weights timeline.
#[derive(Clone, Debug, Serialize)]
pub struct WeightSample {
    /// When (cluster clock).
    pub at_ns: Nanos,
    /// The app of the handler the weights are for (the first half of its `HandlerKey`).
    pub app: u32,
    /// Handler id (the second half of its `HandlerKey`).
    pub handler: u32,
    /// Weights the controller decided for the handler at `at_ns`.
    pub weights: Weights,
}

/// Latency percentiles, nanoseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    /// Number of latencies in the histogram.
    pub count: u64,
    /// 50th percentile (median), rounded up to the histogram's precision.
    pub p50: u64,
    /// 99th percentile, rounded up to the histogram's precision.
    pub p99: u64,
    /// 99.9th percentile, rounded up to the histogram's precision.
    pub p999: u64,
    /// Largest latency recorded, rounded up to the histogram's precision.
    pub max: u64,
    /// Mean latency, each sample counted at the middle of its histogram bucket (0.0 when
    /// empty).
    pub mean: f64,
}

impl Percentiles {
    /// Percentiles of `h`.
    pub fn of<C: hdrhistogram::Counter>(h: &Histogram<C>) -> Percentiles {
        Percentiles {
            count: h.len(),
            p50: h.value_at_quantile(0.5),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
            mean: h.mean(),
        }
    }
}

/// Cluster metrics, shared by every thread.
pub struct Metrics {
    placement: [Mutex<Histogram<u64>>; 3],
    handler: Mutex<HashMap<HandlerKey, Histogram<u32>>>,
    ops: [AtomicU64; 3],
    errors: Mutex<HashMap<Status, u64>>,
    timeline: Mutex<Vec<WeightSample>>,
    timeline_cap: usize,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(1 << 20)
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("ops", &self.ops).finish()
    }
}

/// A copy of the metrics at one moment.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    /// Latency per placement (index [`Placement::index`]).
    pub placement: [Percentiles; 3],
    /// Operations completed per placement.
    pub ops: [u64; 3],
    /// Latency per (app, handler).
    pub handlers: Vec<(HandlerKey, Percentiles)>,
    /// Error replies by status.
    pub errors: Vec<(Status, u64)>,
}

impl Snapshot {
    /// Fraction of operations at `p`.
    pub fn fraction(&self, p: Placement) -> f64 {
        let total: u64 = self.ops.iter().sum();
        if total == 0 {
            0.0
        } else {
            self.ops[p.index()] as f64 / total as f64
        }
    }
}

impl Metrics {
    /// Metrics keeping at most `timeline_cap` weight samples.
    pub fn new(timeline_cap: usize) -> Self {
        Metrics {
            placement: [
                Mutex::new(histogram()),
                Mutex::new(histogram()),
                Mutex::new(histogram()),
            ],
            handler: Mutex::new(HashMap::new()),
            ops: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
            errors: Mutex::new(HashMap::new()),
            timeline: Mutex::new(Vec::new()),
            timeline_cap,
        }
    }

    /// Records one completed operation.
    pub fn record(&self, placement: Placement, key: HandlerKey, latency_ns: u64, status: Status) {
        let v = latency_ns.clamp(1, MAX_LATENCY_NS);
        self.ops[placement.index()].fetch_add(1, Ordering::Relaxed);
        if let Ok(mut h) = self.placement[placement.index()].lock() {
            let _ = h.record(v);
        }
        if let Ok(mut m) = self.handler.lock() {
            let _ = m.entry(key).or_insert_with(handler_histogram).record(v);
        }
        if status != Status::Ok {
            if let Ok(mut e) = self.errors.lock() {
                *e.entry(status).or_default() += 1;
            }
        }
    }

    /// Records a steering decision.
    pub fn record_weights(&self, at_ns: Nanos, key: HandlerKey, weights: Weights) {
        if let Ok(mut t) = self.timeline.lock() {
            if t.len() < self.timeline_cap {
                t.push(WeightSample {
                    at_ns,
                    app: key.0,
                    handler: key.1,
                    weights,
                });
            }
        }
    }

    /// A copy of the weights timeline, oldest first; samples past the cap given to
    /// [`Metrics::new`] were dropped.
    pub fn timeline(&self) -> Vec<WeightSample> {
        self.timeline.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Operations per placement so far.
    pub fn ops(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.ops[i].load(Ordering::Relaxed))
    }

    /// A copy of the metrics now: percentiles, counts and error tallies (locks taken one at a
    /// time, so not an atomic cut).
    pub fn snapshot(&self) -> Snapshot {
        let placement = [0, 1, 2].map(|i| {
            self.placement[i]
                .lock()
                .map(|h| Percentiles::of(&h))
                .unwrap_or_default()
        });
        let mut handlers: Vec<_> = self
            .handler
            .lock()
            .map(|m| m.iter().map(|(k, h)| (*k, Percentiles::of(h))).collect())
            .unwrap_or_default();
        handlers.sort_by_key(|(k, _)| *k);
        let mut errors: Vec<_> = self
            .errors
            .lock()
            .map(|e| e.iter().map(|(s, n)| (*s, *n)).collect())
            .unwrap_or_default();
        errors.sort_by_key(|(s, _)| *s as u16);
        Snapshot {
            placement,
            ops: self.ops(),
            handlers,
            errors,
        }
    }

    /// Clears histograms and counts (not the timeline).
    pub fn reset(&self) {
        for i in 0..3 {
            self.ops[i].store(0, Ordering::Relaxed);
            if let Ok(mut h) = self.placement[i].lock() {
                h.reset();
            }
        }
        if let Ok(mut m) = self.handler.lock() {
            m.clear();
        }
        if let Ok(mut e) = self.errors.lock() {
            e.clear();
        }
    }
}
