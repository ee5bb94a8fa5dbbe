//! Metrics: end-to-end latency histograms per placement and per handler, operation counts per
//! placement and status, and the timeline of placement weights that benchmarks read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;
use serde::Serialize;

use naam_proto::intmap::IntMap;
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

/// Cluster metrics, shared by every thread. Recording goes to a shard: a caller on a hot
/// path records into its own [`MetricsShard`] (no lock another thread takes, no shared
/// counter), others into the shared one; readers merge every shard.
pub struct Metrics {
    shared: Arc<Mutex<Shard>>,
    shards: Arc<Mutex<Vec<Arc<Mutex<Shard>>>>>,
    /// What clients over a fabric sent: exchanges, resends, duplicate answers (added when
    /// each client ends).
    transport: Mutex<TransportCounts>,
    timeline: Mutex<Vec<WeightSample>>,
    timeline_cap: usize,
}

/// Exchanges that clients over a network fabric sent, resent and were answered twice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TransportCounts {
    /// Exchanges sent (first sends).
    pub sent: u64,
    /// Resends (after a timeout, or a loss found by later answers).
    pub resends: u64,
    /// Answers to exchanges already answered: resends that were not needed.
    pub duplicates: u64,
    /// Of the resends, those made on later answers (a loss found early), not at a timeout.
    pub early_resends: u64,
}

/// One shard's histograms and counts.
struct Shard {
    /// Per placement, made when the first latency there is recorded: about 220 KB each, and
    /// a client thread (a thousand apps' clients in `experiment scale`) often uses one.
    placement: [Option<Histogram<u64>>; 3],
    /// Each handler's place in `handlers`.
    slot: IntMap<HandlerKey, u32>,
    /// Per-handler histograms, by slot: a caller that keeps a handler's slot
    /// ([`MetricsShard::slot`]) records with no map lookup. Never shrunk (a reset empties
    /// each histogram), so a kept slot stays valid for the shard's life.
    handlers: Vec<(HandlerKey, Histogram<u32>)>,
    ops: [u64; 3],
    errors: HashMap<Status, u64>,
}

impl Shard {
    fn new() -> Shard {
        Shard {
            placement: [None, None, None],
            slot: IntMap::default(),
            handlers: Vec::new(),
            ops: [0; 3],
            errors: HashMap::new(),
        }
    }

    /// The slot of `key`'s histogram, made empty the first time.
    fn slot_of(&mut self, key: HandlerKey) -> u32 {
        let next = self.handlers.len() as u32;
        let slot = *self.slot.entry(key).or_insert(next);
        if slot == next {
            self.handlers.push((key, handler_histogram()));
        }
        slot
    }

    #[inline]
    fn record(&mut self, placement: Placement, key: HandlerKey, latency_ns: u64, status: Status) {
        let slot = self.slot_of(key);
        self.record_at(placement, slot, latency_ns, status);
    }

    /// [`Shard::record`] into the histogram at `slot` (from [`Shard::slot_of`]).
    #[inline]
    fn record_at(&mut self, placement: Placement, slot: u32, latency_ns: u64, status: Status) {
        let v = latency_ns.clamp(1, MAX_LATENCY_NS);
        self.ops[placement.index()] += 1;
        let _ = self.placement[placement.index()]
            .get_or_insert_with(histogram)
            .record(v);
        if let Some((_, h)) = self.handlers.get_mut(slot as usize) {
            let _ = h.record(v);
        }
        if status != Status::Ok {
            *self.errors.entry(status).or_default() += 1;
        }
    }

    /// Adds `other`'s histograms and counts into this one.
    fn absorb(&mut self, other: &Shard) {
        for i in 0..3 {
            if let Some(h) = &other.placement[i] {
                let _ = self.placement[i].get_or_insert_with(histogram).add(h);
            }
            self.ops[i] += other.ops[i];
        }
        for (k, h) in &other.handlers {
            if h.is_empty() {
                continue;
            }
            let slot = self.slot_of(*k) as usize;
            let _ = self.handlers[slot].1.add(h);
        }
        for (s, n) in &other.errors {
            *self.errors.entry(*s).or_default() += n;
        }
    }

    fn reset(&mut self) {
        for h in self.placement.iter_mut().flatten() {
            h.reset();
        }
        self.ops = [0; 3];
        for (_, h) in &mut self.handlers {
            h.reset();
        }
        self.errors.clear();
    }
}

fn lock(s: &Mutex<Shard>) -> std::sync::MutexGuard<'_, Shard> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// A handler's place in one [`MetricsShard`] ([`MetricsShard::slot`]); meaningless in
/// another (recorded there into whichever handler holds that place, or into none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandlerSlot(u32);

/// A recorder of its own into a [`Metrics`]: what it records shows in the metrics' readings
/// at once, but its lock is taken by nobody else on the hot path. Made by
/// [`Metrics::shard`]; dropping it folds what it holds into the shared shard.
pub struct MetricsShard {
    shard: Arc<Mutex<Shard>>,
    shared: Arc<Mutex<Shard>>,
    shards: Arc<Mutex<Vec<Arc<Mutex<Shard>>>>>,
}

impl MetricsShard {
    /// Records one completed operation.
    #[inline]
    pub fn record(&self, placement: Placement, key: HandlerKey, latency_ns: u64, status: Status) {
        lock(&self.shard).record(placement, key, latency_ns, status);
    }

    /// Where `key`'s latencies go in this shard: a caller that keeps it
    /// ([`MetricsShard::record_at`]) skips the lookup of the handler's histogram, a cache miss
    /// or two when it calls many handlers in turn (10,000 apps round robin).
    pub fn slot(&self, key: HandlerKey) -> HandlerSlot {
        HandlerSlot(lock(&self.shard).slot_of(key))
    }

    /// [`MetricsShard::record`] of a handler by its `slot` from this shard.
    #[inline]
    pub fn record_at(
        &self,
        placement: Placement,
        slot: HandlerSlot,
        latency_ns: u64,
        status: Status,
    ) {
        lock(&self.shard).record_at(placement, slot.0, latency_ns, status);
    }
}

impl Drop for MetricsShard {
    fn drop(&mut self) {
        let mut shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        shards.retain(|s| !Arc::ptr_eq(s, &self.shard));
        lock(&self.shared).absorb(&lock(&self.shard));
    }
}

impl std::fmt::Debug for MetricsShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsShard").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(1 << 20)
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("ops", &self.ops()).finish()
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
        let shared = Arc::new(Mutex::new(Shard::new()));
        Metrics {
            shards: Arc::new(Mutex::new(vec![shared.clone()])),
            shared,
            transport: Mutex::new(TransportCounts::default()),
            timeline: Mutex::new(Vec::new()),
            timeline_cap,
        }
    }

    /// A recorder of its own (one per client thread).
    pub fn shard(&self) -> MetricsShard {
        let shard = Arc::new(Mutex::new(Shard::new()));
        self.shards
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(shard.clone());
        MetricsShard {
            shard,
            shared: self.shared.clone(),
            shards: self.shards.clone(),
        }
    }

    /// Records one completed operation (into the shared shard; a hot path uses
    /// [`Metrics::shard`]).
    pub fn record(&self, placement: Placement, key: HandlerKey, latency_ns: u64, status: Status) {
        lock(&self.shared).record(placement, key, latency_ns, status);
    }

    /// Every shard merged into one.
    fn merged(&self) -> Shard {
        let shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        let mut all = Shard::new();
        for s in shards.iter() {
            all.absorb(&lock(s));
        }
        all
    }

    /// Adds what one client sent, resent and got twice.
    pub fn add_transport(&self, c: TransportCounts) {
        let mut t = self.transport.lock().unwrap_or_else(|p| p.into_inner());
        t.sent += c.sent;
        t.resends += c.resends;
        t.duplicates += c.duplicates;
        t.early_resends += c.early_resends;
    }

    /// What the clients that ended sent, resent and got twice.
    pub fn transport(&self) -> TransportCounts {
        *self.transport.lock().unwrap_or_else(|p| p.into_inner())
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
        let shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        let mut ops = [0; 3];
        for s in shards.iter() {
            let s = lock(s);
            for (sum, n) in ops.iter_mut().zip(s.ops) {
                *sum += n;
            }
        }
        ops
    }

    /// A copy of the metrics now: percentiles, counts and error tallies (shards read one at a
    /// time, so not an atomic cut).
    pub fn snapshot(&self) -> Snapshot {
        let all = self.merged();
        let placement = [0, 1, 2].map(|i| {
            all.placement[i]
                .as_ref()
                .map_or_else(Percentiles::default, Percentiles::of)
        });
        let mut handlers: Vec<_> = all
            .handlers
            .iter()
            .filter(|(_, h)| !h.is_empty())
            .map(|(k, h)| (*k, Percentiles::of(h)))
            .collect();
        handlers.sort_by_key(|(k, _)| *k);
        let mut errors: Vec<_> = all.errors.iter().map(|(s, n)| (*s, *n)).collect();
        errors.sort_by_key(|(s, _)| *s as u16);
        Snapshot {
            placement,
            ops: all.ops,
            handlers,
            errors,
        }
    }

    /// Clears histograms and counts (not the timeline).
    pub fn reset(&self) {
        *self.transport.lock().unwrap_or_else(|p| p.into_inner()) = TransportCounts::default();
        let shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        for s in shards.iter() {
            lock(s).reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_of(snap: &Snapshot, key: HandlerKey) -> u64 {
        snap.handlers
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, p)| p.count)
    }

    /// A kept slot records into its handler's histogram as a record by key does, stays valid
    /// across a reset (which lists no emptied handler), and what a dropped shard held
    /// reaches the shared one.
    #[test]
    fn a_kept_slot_records_as_its_key_does_across_resets() {
        let m = Metrics::default();
        let shard = m.shard();
        let (a, b) = ((1, 7), (2, 7));
        let slot_a = shard.slot(a);
        assert_eq!(shard.slot(a), slot_a, "one slot per handler");
        assert_ne!(shard.slot(b), slot_a);
        for i in 0..10 {
            shard.record_at(Placement::Host, slot_a, 1_000 + i, Status::Ok);
            shard.record(Placement::Nic, a, 2_000, Status::Ok);
        }
        shard.record(Placement::Host, b, 50, Status::Busy);
        let snap = m.snapshot();
        assert_eq!((count_of(&snap, a), count_of(&snap, b)), (20, 1));
        assert_eq!(snap.ops[Placement::Host.index()], 11);
        assert_eq!(snap.errors, vec![(Status::Busy, 1)]);

        m.reset();
        let snap = m.snapshot();
        assert!(snap.handlers.is_empty(), "{:?}", snap.handlers);
        shard.record_at(Placement::Host, slot_a, 3_000, Status::Ok);
        drop(shard);
        let snap = m.snapshot();
        assert_eq!((count_of(&snap, a), count_of(&snap, b)), (1, 0));
        assert!(snap.handlers[0].1.max >= 3_000);
    }
}
