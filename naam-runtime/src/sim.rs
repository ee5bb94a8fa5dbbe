//! A deterministic virtual-time simulator of one server's placements under a steady stream of
//! read messages. It drives the real steering code (the [`Controller`] that the cluster and
//! naam-server run, its [`LoadTracker`]s, any [`Policy`], the clients' [`Selector`]) with a
//! virtual clock: arrivals, FIFO queues at Host and NIC executors, client execution with
//! one-sided round trips, a congestion window that slows host executors, and a steering period.
//! Figures from it are labelled `sim`; they are model outputs, not measurements.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use serde::Serialize;

use naam_proto::steering::{
    AppView, Controller, ControllerConfig, HandlerKey, HandlerView, LoadTracker, Observe, Policy,
    Selector, Weights,
};
use naam_proto::Nanos;
use naam_proto::Placement;

/// Key of the one handler simulated: app 1, handler 1.
pub const SIM_KEY: HandlerKey = (1, 1);

/// What to simulate.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct SimConfig {
    /// Virtual run time.
    pub duration_ns: Nanos,
    /// One message every this many nanoseconds.
    pub arrival_interval_ns: Nanos,
    /// Host executor threads.
    pub host_executors: u32,
    /// NIC executor threads.
    pub nic_executors: u32,
    /// Service time per message at each placement (index [`Placement::index`]), nanoseconds.
    pub service_ns: [Nanos; 3],
    /// Steps per message (each a one-sided round trip at the client).
    pub steps: u16,
    /// One-sided READ round trip, nanoseconds.
    pub client_rtt_ns: Nanos,
    /// Virtual time between two controller ticks, nanoseconds.
    pub period_ns: Nanos,
    /// Host congestion: `(start, end, slowdown)`: host service time × slowdown inside the window.
    pub congestion: Option<(Nanos, Nanos, f64)>,
    /// Width of the reporting buckets.
    pub bucket_ns: Nanos,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            duration_ns: 200_000_000,
            arrival_interval_ns: 2_000,
            host_executors: 2,
            nic_executors: 4,
            service_ns: [1_500, 3_000, 1_000],
            steps: 2,
            client_rtt_ns: 5_000,
            period_ns: 1_000_000,
            congestion: Some((50_000_000, 120_000_000, 10.0)),
            bucket_ns: 1_000_000,
        }
    }
}

/// Messages started per placement within one bucket.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Bucket {
    /// Bucket start, virtual nanoseconds since the run began.
    pub start_ns: Nanos,
    /// Messages per placement (index [`Placement::index`]).
    pub placed: [u64; 3],
    /// Mean completion time of messages that arrived in the bucket, nanoseconds.
    pub mean_latency_ns: f64,
}

impl Bucket {
    /// Fraction of the bucket's messages at `p`.
    pub fn share(&self, p: Placement) -> f64 {
        let total: u64 = self.placed.iter().sum();
        if total == 0 {
            0.0
        } else {
            self.placed[p.index()] as f64 / total as f64
        }
    }
}

/// The outcome of a run.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    /// The configuration the run used, copied into its result.
    pub config: SimConfig,
    /// [`Policy::name`] of the policy that steered.
    pub policy: String,
    /// Per-bucket placement counts.
    pub buckets: Vec<Bucket>,
    /// Weights after every steering decision.
    pub weights: Vec<(Nanos, Weights)>,
}

impl SimResult {
    /// First bucket start at or after `from` from which `hold` consecutive buckets all have a
    /// share of `p` that satisfies `pred`; `None` if never.
    pub fn first_time_share(
        &self,
        p: Placement,
        from: Nanos,
        hold: usize,
        pred: impl Fn(f64) -> bool,
    ) -> Option<Nanos> {
        let idx: Vec<usize> = (0..self.buckets.len())
            .filter(|&i| self.buckets[i].start_ns >= from)
            .collect();
        idx.iter().enumerate().find_map(|(k, &i)| {
            let window = idx.get(k..k + hold)?;
            window
                .iter()
                .all(|&j| pred(self.buckets[j].share(p)))
                .then_some(self.buckets[i].start_ns)
        })
    }

    /// [`SimResult::first_time_share`] with share at most `limit`.
    pub fn first_time_share_at_most(
        &self,
        p: Placement,
        limit: f64,
        from: Nanos,
        hold: usize,
    ) -> Option<Nanos> {
        self.first_time_share(p, from, hold, |s| s <= limit)
    }

    /// [`SimResult::first_time_share`] with share at least `limit`.
    pub fn first_time_share_at_least(
        &self,
        p: Placement,
        limit: f64,
        from: Nanos,
        hold: usize,
    ) -> Option<Nanos> {
        self.first_time_share(p, from, hold, |s| s >= limit)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    // Order matters for ties: finish work before new arrivals, decide last.
    Done {
        placement: usize,
        arrived: Nanos,
        service: Nanos,
    },
    Arrival,
    Tick,
}

struct Station {
    queue: VecDeque<Nanos>,
    busy: u32,
    executors: u32,
}

/// The simulated server as the controller observes it.
struct Observed<'a> {
    trackers: &'a mut [LoadTracker; 3],
    stations: &'a [Station; 3],
}

impl Observe for Observed<'_> {
    fn with_tracker<R>(&mut self, p: Placement, f: impl FnOnce(&mut LoadTracker) -> R) -> R {
        f(&mut self.trackers[p.index()])
    }

    fn queued(&self, p: Placement) -> Option<(u32, u32)> {
        let st = &self.stations[p.index()];
        (p != Placement::Client).then_some((st.queue.len() as u32, st.executors))
    }

    fn available(&self, _: Placement) -> bool {
        true
    }

    fn client_rtt_ns(&self) -> Option<f64> {
        None
    }

    fn apps(&self, wanted: &dyn Fn(u32) -> bool) -> Vec<AppView> {
        if !wanted(SIM_KEY.0) {
            return Vec::new();
        }
        vec![AppView {
            id: SIM_KEY.0,
            owner: Some(Placement::Host),
            handlers: vec![HandlerView {
                id: SIM_KEY.1,
                read_only: true,
            }],
        }]
    }
}

/// Runs the simulation with `policy`.
pub fn simulate(config: &SimConfig, policy: Box<dyn Policy>) -> SimResult {
    let c = config;
    let policy_name = policy.name();
    let controller_config = ControllerConfig::new().default_client_rtt_ns(c.client_rtt_ns as f64);
    let mut controller = Controller::new(policy, controller_config, 0);
    let mut events: BinaryHeap<Reverse<(Nanos, Event)>> = BinaryHeap::new();
    events.push(Reverse((0, Event::Arrival)));
    events.push(Reverse((c.period_ns, Event::Tick)));
    let mut stations = [
        Station {
            queue: VecDeque::new(),
            busy: 0,
            executors: u32::MAX,
        },
        Station {
            queue: VecDeque::new(),
            busy: 0,
            executors: c.nic_executors,
        },
        Station {
            queue: VecDeque::new(),
            busy: 0,
            executors: c.host_executors,
        },
    ];
    let mut trackers = [
        LoadTracker::new(1, 0),
        LoadTracker::new(c.nic_executors, 0),
        LoadTracker::new(c.host_executors, 0),
    ];
    let mut weights = Weights::all(Placement::Host);
    let mut selector = Selector::default();
    let nbuckets = c.duration_ns.div_ceil(c.bucket_ns) as usize;
    let mut buckets: Vec<Bucket> = (0..nbuckets)
        .map(|i| Bucket {
            start_ns: i as u64 * c.bucket_ns,
            ..Bucket::default()
        })
        .collect();
    let mut latency_sum = vec![0f64; nbuckets];
    let mut latency_n = vec![0u64; nbuckets];
    let mut timeline = Vec::new();

    let service_at = |p: Placement, now: Nanos| -> Nanos {
        let base = c.service_ns[p.index()];
        match (p, c.congestion) {
            (Placement::Host, Some((s, e, slow))) if now >= s && now < e => {
                (base as f64 * slow) as Nanos
            }
            _ => base,
        }
    };

    while let Some(Reverse((now, ev))) = events.pop() {
        if now >= c.duration_ns {
            break;
        }
        match ev {
            Event::Arrival => {
                let p = selector.pick(&weights, |_| true).unwrap_or(Placement::Host);
                buckets[(now / c.bucket_ns) as usize].placed[p.index()] += 1;
                let st = &mut stations[p.index()];
                if p == Placement::Client {
                    let service = service_at(p, now);
                    let latency = service + c.steps as u64 * c.client_rtt_ns;
                    events.push(Reverse((
                        now + latency,
                        Event::Done {
                            placement: 0,
                            arrived: now,
                            service,
                        },
                    )));
                } else if st.busy < st.executors {
                    st.busy += 1;
                    trackers[p.index()].dequeued(0, st.queue.len() as u32);
                    let service = service_at(p, now);
                    events.push(Reverse((
                        now + service,
                        Event::Done {
                            placement: p.index(),
                            arrived: now,
                            service,
                        },
                    )));
                } else {
                    st.queue.push_back(now);
                }
                events.push(Reverse((now + c.arrival_interval_ns, Event::Arrival)));
            }
            Event::Done {
                placement,
                arrived,
                service,
            } => {
                trackers[placement].completed(SIM_KEY, service, c.steps);
                let b = (arrived / c.bucket_ns) as usize;
                latency_sum[b] += (now - arrived) as f64;
                latency_n[b] += 1;
                if placement != 0 {
                    let st = &mut stations[placement];
                    if let Some(enq) = st.queue.pop_front() {
                        trackers[placement].dequeued(now - enq, st.queue.len() as u32);
                        let p = Placement::ALL[placement];
                        let service = service_at(p, now);
                        events.push(Reverse((
                            now + service,
                            Event::Done {
                                placement,
                                arrived: enq,
                                service,
                            },
                        )));
                    } else {
                        st.busy -= 1;
                    }
                }
            }
            Event::Tick => {
                let mut observed = Observed {
                    trackers: &mut trackers,
                    stations: &stations,
                };
                // The one app is decided every period, active or not (a full tick).
                let decided = controller.tick(now, &mut observed, true);
                if let Some(&(_, w)) = decided.weights.iter().find(|(k, _)| *k == SIM_KEY) {
                    weights = w;
                }
                timeline.push((now, weights));
                events.push(Reverse((now + c.period_ns, Event::Tick)));
            }
        }
    }
    for (i, b) in buckets.iter_mut().enumerate() {
        b.mean_latency_ns = if latency_n[i] > 0 {
            latency_sum[i] / latency_n[i] as f64
        } else {
            0.0
        };
    }
    SimResult {
        config: c.clone(),
        policy: policy_name,
        buckets,
        weights: timeline,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use naam_proto::steering::{CostPolicy, CostPolicyConfig, StaticPolicy};

    #[test]
    fn congestion_moves_reads_off_the_host_within_10ms_and_back() {
        let cfg = SimConfig::default();
        let (onset, end, _) = cfg.congestion.unwrap();
        let r = simulate(&cfg, Box::new(CostPolicy::new(CostPolicyConfig::default())));
        // Before congestion the host is the cheapest placement.
        let before = r
            .first_time_share_at_least(Placement::Host, 0.9, 10_000_000, 30)
            .expect("host carries traffic");
        assert!(before < onset);
        // At least 90% off the host within 10 ms of virtual time, and it stays off.
        let moved = r
            .first_time_share_at_most(Placement::Host, 0.1, onset, 20)
            .expect("traffic moved");
        assert!(
            moved - onset <= 10_000_000,
            "moved after {} ms",
            (moved - onset) as f64 / 1e6
        );
        // Back on the host after the congestion ends.
        let back = r
            .first_time_share_at_least(Placement::Host, 0.9, end, 20)
            .expect("traffic came back");
        eprintln!(
            "sim: 90% off the host {:.1} ms after onset, back {:.1} ms after the end",
            (moved - onset) as f64 / 1e6,
            (back - end) as f64 / 1e6
        );
        assert!(
            back - end <= 30_000_000,
            "back after {} ms",
            (back - end) as f64 / 1e6
        );
    }

    #[test]
    fn deterministic() {
        let cfg = SimConfig {
            duration_ns: 60_000_000,
            ..SimConfig::default()
        };
        let a = simulate(&cfg, Box::new(CostPolicy::new(CostPolicyConfig::default())));
        let b = simulate(&cfg, Box::new(CostPolicy::new(CostPolicyConfig::default())));
        assert_eq!(a.buckets, b.buckets);
    }

    #[test]
    fn static_host_suffers_where_auto_does_not() {
        let cfg = SimConfig {
            duration_ns: 100_000_000,
            ..SimConfig::default()
        };
        let auto = simulate(&cfg, Box::new(CostPolicy::new(CostPolicyConfig::default())));
        let host = simulate(&cfg, Box::new(StaticPolicy(Placement::Host)));
        let late = |r: &SimResult| {
            r.buckets[60..90]
                .iter()
                .map(|b| b.mean_latency_ns)
                .sum::<f64>()
                / 30.0
        };
        assert!(
            late(&host) > 10.0 * late(&auto),
            "static host {} vs auto {}",
            late(&host),
            late(&auto)
        );
    }
}
