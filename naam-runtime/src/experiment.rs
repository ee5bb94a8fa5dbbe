//! The congestion-shift experiment on a live in-process cluster: closed-loop clients issue read
//! messages while host congestion starts and stops; placement fractions are sampled every
//! millisecond and the times to move 90% of traffic off the host, and back, are measured on the
//! wall clock. Used by `naam demo` and the benchmarks. Results are labelled `inproc`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use naam_ebpf::abi::Descriptor;
use serde::Serialize;

use crate::cluster::Cluster;
use crate::placement::Placement;

/// Settings of a shift run.
#[derive(Clone, Debug, Serialize)]
pub struct ShiftConfig {
    /// Whole run.
    pub duration: Duration,
    /// Congestion window `(start, end)` from the run's start.
    pub congestion: (Duration, Duration),
    /// Extra busy time per host message while congested (a capacity limit), nanoseconds.
    pub host_extra_ns: u64,
    /// Closed-loop client threads.
    pub clients: usize,
    /// Sampling interval of placement fractions.
    pub sample: Duration,
}

impl Default for ShiftConfig {
    fn default() -> Self {
        ShiftConfig {
            duration: Duration::from_secs(3),
            congestion: (Duration::from_secs(1), Duration::from_secs(2)),
            host_extra_ns: 200_000,
            clients: 1,
            sample: Duration::from_millis(1),
        }
    }
}

/// One sample: operations completed per placement since the previous sample.
#[derive(Clone, Debug, Serialize)]
pub struct ShiftSample {
    /// Time since the run's start, seconds.
    pub t: f64,
    /// Operations per placement in the interval (index [`Placement::index`]).
    pub ops: [u64; 3],
}

impl ShiftSample {
    /// Fraction of the interval's operations at `p`.
    pub fn share(&self, p: Placement) -> Option<f64> {
        let total: u64 = self.ops.iter().sum();
        (total > 0).then(|| self.ops[p.index()] as f64 / total as f64)
    }
}

/// Outcome of a shift run.
#[derive(Clone, Debug, Serialize)]
pub struct ShiftResult {
    /// Mode (`inproc`).
    pub mode: &'static str,
    /// Policy name.
    pub policy: String,
    /// Settings.
    pub config: ShiftConfig,
    /// Samples.
    pub samples: Vec<ShiftSample>,
    /// Time from congestion onset until at most 10% of traffic stays on the host, ms.
    pub moved_ms: Option<f64>,
    /// Time from congestion end until at least 90% of traffic is back on the host, ms.
    pub back_ms: Option<f64>,
    /// Total operations.
    pub ops: u64,
}

/// The first time at or after `from` where each of `hold` consecutive samples (that saw any
/// operation) has a host share meeting `pred`, in milliseconds after `from`. Samples are judged
/// one by one: pooling operations would let many fast operations after a shift hide the few slow
/// ones before it.
fn first_time(
    samples: &[ShiftSample],
    from: f64,
    hold: usize,
    pred: impl Fn(f64) -> bool,
) -> Option<f64> {
    let idx: Vec<usize> = (0..samples.len())
        .filter(|&i| samples[i].t >= from)
        .collect();
    for k in 0..idx.len() {
        let window = idx.get(k..k + hold)?;
        let shares: Vec<f64> = window
            .iter()
            .filter_map(|&i| samples[i].share(Placement::Host))
            .collect();
        if !shares.is_empty() && shares.iter().all(|&h| pred(h)) {
            // The window starts where the sample before it ended.
            let start = if idx[k] == 0 {
                0.0
            } else {
                samples[idx[k] - 1].t
            };
            return Some((start - from).max(0.0) * 1e3);
        }
    }
    None
}

/// Runs the experiment: `make_call` issues one read message on a client and is called in a
/// closed loop by every client thread.
pub fn run_shift<F>(cluster: &Cluster, config: &ShiftConfig, make_call: F) -> ShiftResult
where
    F: Fn(&mut crate::cluster::Client) + Send + Sync + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let make_call = Arc::new(make_call);
    let threads: Vec<_> = (0..config.clients)
        .map(|_| {
            let (stop, f) = (stop.clone(), make_call.clone());
            let mut client = cluster.client();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    f(&mut client);
                }
            })
        })
        .collect();
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut last = cluster.metrics().ops();
    let mut congested = false;
    let mut next = start + config.sample;
    while start.elapsed() < config.duration {
        let t = start.elapsed();
        if !congested && t >= config.congestion.0 && t < config.congestion.1 {
            cluster.congestion().limit_host(config.host_extra_ns);
            congested = true;
        } else if congested && t >= config.congestion.1 {
            cluster.congestion().clear();
            congested = false;
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next += config.sample;
        let ops = cluster.metrics().ops();
        samples.push(ShiftSample {
            t: start.elapsed().as_secs_f64(),
            ops: [0, 1, 2].map(|i| ops[i] - last[i]),
        });
        last = ops;
    }
    stop.store(true, Ordering::Relaxed);
    cluster.congestion().clear();
    for t in threads {
        let _ = t.join();
    }
    let hold = 5;
    let onset = config.congestion.0.as_secs_f64();
    let end = config.congestion.1.as_secs_f64();
    let moved_ms = first_time(&samples, onset, hold, |h| h <= 0.1);
    let back_ms = first_time(&samples, end, hold, |h| h >= 0.9);
    let ops = samples.iter().map(|s| s.ops.iter().sum::<u64>()).sum();
    ShiftResult {
        mode: "inproc",
        policy: cluster.policy_name().to_string(),
        config: config.clone(),
        samples,
        moved_ms,
        back_ms,
        ops,
    }
}

/// A read call on `descs` for `make_call` closures.
pub fn read_call(
    app: u32,
    handler: u32,
    args: Vec<u8>,
    descs: Vec<Descriptor>,
) -> impl Fn(&mut crate::cluster::Client) + Send + Sync {
    move |client| {
        let _ = client.call(app, handler, &args, &descs);
    }
}
