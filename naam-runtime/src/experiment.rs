//! The congestion-shift experiment on a live system: closed-loop clients issue read messages
//! while host congestion starts and stops; placement fractions are sampled every millisecond
//! and the times to move 90% of traffic off the host, and back, are measured on the wall clock.
//! The system is a [`ShiftTarget`]: the in-process [`Cluster`] (`naam demo`, the benchmarks),
//! or a deployment over UDP driven from `naam-bench`. Results carry the target's mode label.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use naam_ebpf::abi::Descriptor;
use serde::Serialize;

use crate::cluster::Cluster;
use naam_proto::Placement;

/// Settings of a shift run.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct ShiftConfig {
    /// Length of the whole run, on the wall clock.
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
    /// Mode: where it ran and what was emulated.
    pub mode: String,
    /// The steering policy's name ([`ShiftTarget::policy`]).
    pub policy: String,
    /// A copy of the settings the run used.
    pub config: ShiftConfig,
    /// Operations per placement in each sampling interval (`config.sample`), in time order.
    pub samples: Vec<ShiftSample>,
    /// Time from congestion onset until at most 10% of traffic stays on the host, ms.
    pub moved_ms: Option<f64>,
    /// Time from congestion end until at least 90% of traffic is back on the host, ms.
    pub back_ms: Option<f64>,
    /// Operations counted over all samples, every placement.
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

/// A system a shift run drives: it counts where operations ran and can congest its host.
pub trait ShiftTarget {
    /// Why congesting failed.
    type Error;
    /// Operations completed so far, per placement (index [`Placement::index`]).
    fn ops(&self) -> [u64; 3];
    /// Takes host capacity away (`Some(extra ns per message)`) or gives it back (`None`).
    fn congest(&self, extra_ns: Option<u64>) -> Result<(), Self::Error>;
    /// The steering policy's name.
    fn policy(&self) -> String;
    /// Mode label of the results.
    fn mode(&self) -> String;
}

impl ShiftTarget for Cluster {
    type Error = std::convert::Infallible;
    fn ops(&self) -> [u64; 3] {
        self.metrics().ops()
    }
    fn congest(&self, extra_ns: Option<u64>) -> Result<(), Self::Error> {
        match extra_ns {
            Some(ns) => self.congestion().limit_host(ns),
            None => self.congestion().clear(),
        }
        Ok(())
    }
    fn policy(&self) -> String {
        self.policy_name().to_string()
    }
    fn mode(&self) -> String {
        "inproc".into()
    }
}

/// Runs the experiment on an in-process cluster: `make_call` issues one read message on a
/// client and is called in a closed loop by every client thread.
pub fn run_shift<F>(cluster: &Cluster, config: &ShiftConfig, make_call: F) -> ShiftResult
where
    F: Fn(&mut crate::cluster::Client) + Send + Sync + 'static,
{
    let make_call = Arc::new(make_call);
    let workers = (0..config.clients)
        .map(|_| {
            let (f, mut client) = (make_call.clone(), cluster.client());
            move || f(&mut client)
        })
        .collect();
    match run_shift_on(cluster, config, workers) {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// Runs the experiment on `target`: each of `workers` runs on its own thread, called in a
/// closed loop (one read message per call), while this thread congests the host on schedule
/// and samples the placement counts. Host congestion is cleared on every exit.
pub fn run_shift_on<T, W>(
    target: &T,
    config: &ShiftConfig,
    workers: Vec<W>,
) -> Result<ShiftResult, T::Error>
where
    T: ShiftTarget + ?Sized,
    W: FnMut() + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = workers
        .into_iter()
        .map(|mut work| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    work();
                }
            })
        })
        .collect();
    let sampled = sample_shift(target, config);
    stop.store(true, Ordering::Relaxed);
    let cleared = target.congest(None);
    for t in threads {
        let _ = t.join();
    }
    let samples = sampled?;
    cleared?;
    let hold = 5;
    let onset = config.congestion.0.as_secs_f64();
    let end = config.congestion.1.as_secs_f64();
    let moved_ms = first_time(&samples, onset, hold, |h| h <= 0.1);
    let back_ms = first_time(&samples, end, hold, |h| h >= 0.9);
    let ops = samples.iter().map(|s| s.ops.iter().sum::<u64>()).sum();
    Ok(ShiftResult {
        mode: target.mode(),
        policy: target.policy(),
        config: config.clone(),
        samples,
        moved_ms,
        back_ms,
        ops,
    })
}

/// The sampling loop of a shift run: congestion on and off on schedule, counts every interval.
fn sample_shift<T: ShiftTarget + ?Sized>(
    target: &T,
    config: &ShiftConfig,
) -> Result<Vec<ShiftSample>, T::Error> {
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut last = target.ops();
    let mut congested = false;
    let mut next = start + config.sample;
    while start.elapsed() < config.duration {
        let t = start.elapsed();
        if !congested && t >= config.congestion.0 && t < config.congestion.1 {
            target.congest(Some(config.host_extra_ns))?;
            congested = true;
        } else if congested && t >= config.congestion.1 {
            target.congest(None)?;
            congested = false;
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next += config.sample;
        let ops = target.ops();
        samples.push(ShiftSample {
            t: start.elapsed().as_secs_f64(),
            ops: [0, 1, 2].map(|i| ops[i].saturating_sub(last[i])),
        });
        last = ops;
    }
    Ok(samples)
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
