//! Steering: load signals per placement and the policies that turn them into per-(app, handler)
//! weights over placements. Everything here is pure and takes time as an argument, so the
//! threaded cluster, the UDP server and the virtual-time simulator run the same decisions.
//!
//! The cost policy estimates, for each placement a handler may use, its expected completion time
//! `queueing delay + service time (+ steps × one-sided RTT at the client)`, moves the traffic to
//! the cheapest placement, and keeps a small probe share on the others so their signals stay
//! fresh (that is how traffic comes back when congestion ends). Hysteresis: a move happens only
//! when the challenger is cheaper by a margin for several consecutive decisions.

use std::collections::HashMap;

use serde::Serialize;

use crate::placement::Placement;
use crate::Nanos;

mod controller;
pub use controller::{
    AppView, Controller, ControllerConfig, Decisions, HandlerView, Observe, Selector,
    DECISION_BUDGET,
};

/// Exponentially weighted moving average.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ewma {
    value: f64,
    samples: u64,
}

impl Ewma {
    /// Smoothing factor for new samples.
    pub const ALPHA: f64 = 0.25;

    /// Adds a sample.
    pub fn add(&mut self, x: f64) {
        self.value = if self.samples == 0 {
            x
        } else {
            self.value + Self::ALPHA * (x - self.value)
        };
        self.samples += 1;
    }

    /// Adds a sample clipped to [`Ewma::CLIP`] times the current average: one scheduler hiccup
    /// cannot make a healthy placement look many times slower, while a sustained change still
    /// gets through (each clipped sample raises the average by up to 1.75x). Samples below the
    /// average count double, so a recovered placement needs few probes to look recovered.
    pub fn add_clipped(&mut self, x: f64) {
        match self.get() {
            Some(v) if v > 0.0 && x < v => {
                self.value = v + 2.0 * Self::ALPHA * (x - v);
                self.samples += 1;
            }
            Some(v) if v > 0.0 => self.add(x.min(v * Self::CLIP)),
            _ => self.add(x),
        }
    }

    /// How far above the average a sample may count.
    pub const CLIP: f64 = 4.0;

    /// Multiplies the average by `factor` (time passing without samples).
    pub fn decay(&mut self, factor: f64) {
        self.value *= factor;
    }

    /// The average, if any sample was seen.
    pub fn get(&self) -> Option<f64> {
        (self.samples > 0).then_some(self.value)
    }

    /// Samples seen.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Replaces the average with `x` (a value averaged elsewhere, e.g. by a remote placement).
    pub fn set(&mut self, x: f64) {
        self.value = x;
        self.samples = self.samples.max(1);
    }
}

/// One handler's figures in a [`RemoteLoad`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RemoteHandler {
    /// App.
    pub app: u32,
    /// Handler.
    pub handler: u32,
    /// Service-time average, nanoseconds.
    pub service_ns: f64,
    /// Steps average.
    pub steps: f64,
    /// Messages completed since the last report.
    pub completions: u64,
}

/// What a placement running in another process (a NIC's executor) reports to the steering
/// controller every period: the tracker's signals, averaged where they were measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RemoteLoad {
    /// Executors behind the placement.
    pub executors: u32,
    /// Messages queued at the end of the period.
    pub queue_depth: u32,
    /// Queueing-delay average, nanoseconds.
    pub queue_delay_ns: f64,
    /// Executor time spent since the last report, nanoseconds.
    pub busy_ns: u64,
    /// Messages dequeued since the last report.
    pub dequeues: u64,
    /// Handlers that completed messages since the last report.
    pub handlers: Vec<RemoteHandler>,
}

/// Identifies a handler of an app.
pub type HandlerKey = (u32, u32);

/// Load of one placement as the controller sees it after a period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PlacementLoad {
    /// Messages waiting.
    pub queue_depth: u32,
    /// Queueing-delay EWMA, nanoseconds.
    pub queue_delay_ns: f64,
    /// Busy fraction of the executors over the last period (0..=1).
    pub utilisation: f64,
    /// Whether the placement can take messages at all (its executors are up).
    pub available: bool,
    /// Service-time average over every handler that ran here, nanoseconds (`None`: nothing
    /// ran yet). The ratio between placements is the prior for a handler never measured at one.
    pub mean_service_ns: Option<f64>,
}

/// Per-handler signals.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HandlerLoad {
    /// Service-time EWMA per placement (index [`Placement::index`]), nanoseconds.
    pub service_ns: [Option<f64>; 3],
    /// Average steps per message.
    pub steps: f64,
    /// Whether the handler only reads (may run at the client).
    pub read_only: bool,
    /// The app's write owner (where a write handler must run).
    pub owner: Option<Placement>,
}

/// Everything a policy decides from.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SteeringInputs {
    /// Per placement (index [`Placement::index`]).
    pub placements: [PlacementLoad; 3],
    /// One-sided READ round trip seen by clients, nanoseconds.
    pub client_rtt_ns: f64,
    /// Messages per second over the last period, every handler and placement (0 if unknown).
    pub total_rate: f64,
}

/// Fractions of a handler's messages per placement (index [`Placement::index`]); they sum to 1.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Weights(pub [f64; 3]);

impl Weights {
    /// Everything at `p`.
    pub fn all(p: Placement) -> Weights {
        let mut w = [0.0; 3];
        w[p.index()] = 1.0;
        Weights(w)
    }

    /// The weight of `p`.
    pub fn of(&self, p: Placement) -> f64 {
        self.0[p.index()]
    }

    /// The placement with the largest weight.
    pub fn major(&self) -> Placement {
        let mut best = Placement::Host;
        for p in Placement::ALL {
            if self.of(p) > self.of(best) {
                best = p;
            }
        }
        best
    }
}

/// A steering policy.
pub trait Policy: Send {
    /// Name, for reports.
    fn name(&self) -> String;
    /// Weights for `key` at time `now`.
    fn decide(
        &mut self,
        key: HandlerKey,
        handler: &HandlerLoad,
        inputs: &SteeringInputs,
        now: Nanos,
    ) -> Weights;
    /// Where `app`'s writes should be applied, given the loads of all its handlers; the caller
    /// moves the owner (with a draining handoff) when this differs from `current`. Default: stay.
    fn owner(
        &mut self,
        app: u32,
        current: Placement,
        handlers: &[HandlerLoad],
        inputs: &SteeringInputs,
        now: Nanos,
    ) -> Placement {
        let _ = (app, handlers, inputs, now);
        current
    }
}

/// Always one placement: the baselines. Write handlers still go to their owner. A static policy
/// ignores load and availability by design; that is what it is a baseline for.
#[derive(Clone, Copy, Debug)]
pub struct StaticPolicy(pub Placement);

impl Policy for StaticPolicy {
    fn name(&self) -> String {
        format!("always-{}", self.0)
    }

    fn decide(
        &mut self,
        _: HandlerKey,
        handler: &HandlerLoad,
        _: &SteeringInputs,
        _: Nanos,
    ) -> Weights {
        match (handler.read_only, handler.owner) {
            (false, Some(owner)) => Weights::all(owner),
            _ => Weights::all(self.0),
        }
    }
}

/// Settings of the cost policy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CostPolicyConfig {
    /// A challenger must be cheaper than the incumbent by this fraction.
    pub margin: f64,
    /// ...for this many consecutive decisions.
    pub confirm: u32,
    /// Share kept on every other usable placement, so its signals stay fresh.
    pub probe: f64,
    /// Service-time guess for a placement never measured, relative to the cheapest measured one.
    pub unknown_factor: f64,
    /// Probes per second each other placement should get, shared by every handler: the probe
    /// share is this divided by the total message rate, between `min_probe` and `probe`. Fresh
    /// estimates need a few hundred probes a second, not a fixed share of every handler's
    /// traffic (with a thousand apps, per-handler shares would make probes the tail).
    pub probes_per_second: f64,
    /// Smallest probe share.
    pub min_probe: f64,
}

impl Default for CostPolicyConfig {
    fn default() -> Self {
        CostPolicyConfig {
            margin: 0.2,
            confirm: 2,
            probe: 0.02,
            unknown_factor: 1.5,
            probes_per_second: 200.0,
            min_probe: 0.0005,
        }
    }
}

/// Owner moves are costly (a drain): they need a larger margin, a longer streak, and an
/// absolute gain: microsecond differences between two uncongested placements are noise.
const OWNER_MARGIN: f64 = 1.0;
const OWNER_CONFIRM: u32 = 5;
const OWNER_MIN_GAIN_NS: f64 = 50_000.0;

#[derive(Clone, Copy, Debug)]
struct Incumbent {
    placement: Placement,
    challenger: Option<Placement>,
    streak: u32,
}

/// Minimises expected completion time, with hysteresis and probes.
#[derive(Debug, Default)]
pub struct CostPolicy {
    config: CostPolicyConfig,
    state: HashMap<HandlerKey, Incumbent>,
    owners: HashMap<u32, (Placement, u32)>,
}

impl CostPolicy {
    /// A cost policy with `config`.
    pub fn new(config: CostPolicyConfig) -> Self {
        CostPolicy {
            config,
            owners: HashMap::new(),
            state: HashMap::new(),
        }
    }

    /// Service time of `h` at `p` where it was never measured. Placements differ mostly by a
    /// speed factor (Arm cores and DMA against host cores and loads), so the handler's cheapest
    /// measurement is scaled by the ratio of the placements' averages over every handler; with
    /// a thousand apps, each app would otherwise rediscover that the NIC is slower by being
    /// sent there. The guess is never below the measurement (probes find faster placements),
    /// and without both averages it is [`CostPolicyConfig::unknown_factor`] times it.
    fn unmeasured_service(&self, h: &HandlerLoad, inputs: &SteeringInputs, p: Placement) -> f64 {
        let cheapest = Placement::ALL
            .into_iter()
            .filter_map(|q| h.service_ns[q.index()].map(|t| (q, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((q, t)) = cheapest else {
            return 1_000.0;
        };
        let mean = |x: Placement| inputs.placements[x.index()].mean_service_ns;
        match (mean(p), mean(q)) {
            (Some(there), Some(here)) if here > 0.0 => t * (there / here).max(1.0),
            _ => t * self.config.unknown_factor,
        }
    }

    /// Expected completion time of one message at each placement (`None`: not usable).
    pub fn completion_times(&self, h: &HandlerLoad, inputs: &SteeringInputs) -> [Option<f64>; 3] {
        let mut out = [None; 3];
        for p in Placement::ALL {
            let load = &inputs.placements[p.index()];
            let usable = load.available && (h.read_only || p != Placement::Client);
            if !usable {
                continue;
            }
            let service =
                h.service_ns[p.index()].unwrap_or_else(|| self.unmeasured_service(h, inputs, p));
            let extra = if p == Placement::Client {
                h.steps.max(1.0) * inputs.client_rtt_ns
            } else {
                load.queue_delay_ns
            };
            out[p.index()] = Some(service + extra);
        }
        out
    }
}

impl Policy for CostPolicy {
    fn name(&self) -> String {
        "auto".into()
    }

    fn owner(
        &mut self,
        app: u32,
        current: Placement,
        handlers: &[HandlerLoad],
        inputs: &SteeringInputs,
        _now: Nanos,
    ) -> Placement {
        let other = if current == Placement::Host {
            Placement::Nic
        } else {
            Placement::Host
        };
        let has_writes = handlers.iter().any(|h| !h.read_only);
        if !has_writes || !inputs.placements[other.index()].available {
            self.owners.remove(&app);
            return current;
        }
        // Congestion signal per placement: the app's read handlers are probed everywhere, so
        // their completion times are measured at both server placements; writes run only at the
        // owner and would leave the other side a guess. Apps without reads fall back to writes.
        // Handlers never measured anywhere carry no signal (they would be priced alike at both
        // placements and only dilute the average, hiding a real gain): leave them out.
        let measured: Vec<&HandlerLoad> = handlers
            .iter()
            .filter(|h| h.service_ns.iter().any(Option::is_some))
            .collect();
        let reads: Vec<&HandlerLoad> = measured.iter().copied().filter(|h| h.read_only).collect();
        let basis: Vec<&HandlerLoad> = if reads.is_empty() { measured } else { reads };
        if basis.is_empty() {
            self.owners.remove(&app);
            return current;
        }
        let cost = |p: Placement| -> f64 {
            let sum: f64 = basis
                .iter()
                .map(|h| {
                    let as_read = HandlerLoad {
                        read_only: true,
                        ..(*h).clone()
                    };
                    self.completion_times(&as_read, inputs)[p.index()].unwrap_or(f64::INFINITY)
                })
                .sum();
            sum / basis.len() as f64
        };
        let (here, there) = (cost(current), cost(other));
        let streak = self.owners.entry(app).or_insert((other, 0));
        if there * (1.0 + OWNER_MARGIN) < here && here - there > OWNER_MIN_GAIN_NS {
            *streak = (other, streak.1 + 1);
            if streak.1 >= OWNER_CONFIRM {
                self.owners.remove(&app);
                return other;
            }
        } else {
            *streak = (other, 0);
        }
        current
    }

    fn decide(
        &mut self,
        key: HandlerKey,
        h: &HandlerLoad,
        inputs: &SteeringInputs,
        _now: Nanos,
    ) -> Weights {
        if !h.read_only {
            // Writes go to the owner, whatever the load.
            return Weights::all(h.owner.unwrap_or(Placement::Host));
        }
        let ect = self.completion_times(h, inputs);
        let best = Placement::ALL
            .into_iter()
            .filter_map(|p| ect[p.index()].map(|t| (p, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(b.0.index().cmp(&a.0.index())));
        let Some((best, best_t)) = best else {
            return Weights::all(Placement::Host);
        };
        let cfg = self.config;
        let inc = self.state.entry(key).or_insert(Incumbent {
            placement: best,
            challenger: None,
            streak: 0,
        });
        match ect[inc.placement.index()] {
            // The incumbent became unusable: move at once.
            None => {
                *inc = Incumbent {
                    placement: best,
                    challenger: None,
                    streak: 0,
                }
            }
            Some(inc_t) if best != inc.placement && best_t * (1.0 + cfg.margin) < inc_t => {
                if inc.challenger == Some(best) {
                    inc.streak += 1;
                } else {
                    inc.challenger = Some(best);
                    inc.streak = 1;
                }
                if inc.streak >= cfg.confirm {
                    *inc = Incumbent {
                        placement: best,
                        challenger: None,
                        streak: 0,
                    };
                }
            }
            Some(_) => {
                inc.challenger = None;
                inc.streak = 0;
            }
        }
        let mut w = [0.0; 3];
        let others: Vec<Placement> = Placement::ALL
            .into_iter()
            .filter(|&p| p != inc.placement && ect[p.index()].is_some())
            .collect();
        let probe = if inputs.total_rate > 0.0 {
            (cfg.probes_per_second / inputs.total_rate).clamp(cfg.min_probe, cfg.probe)
        } else {
            cfg.probe
        };
        let mut probes = 0.0;
        for &p in &others {
            w[p.index()] = probe;
            probes += probe;
        }
        w[inc.placement.index()] = 1.0 - probes;
        Weights(w)
    }
}

/// One remote client's own steering of the Client placement.
///
/// A client that runs handlers itself reports what they cost it (service time, steps) and its
/// one-sided round trip. Those figures describe that client only, and nothing proves them, so
/// they must not move anyone else's choices: the server keeps one `ClientShare` per session and
/// prices the Client placement for that session from its reports alone. The split of the
/// server-bound remainder between Host and NIC stays the controller's (it is what the switch
/// enforces), decided from the server's own measurements.
#[derive(Debug)]
pub struct ClientShare {
    policy: CostPolicy,
    tracker: LoadTracker,
    rtt: Ewma,
}

impl ClientShare {
    /// A client view deciding with the cost policy's `config`.
    pub fn new(config: CostPolicyConfig) -> Self {
        ClientShare {
            policy: CostPolicy::new(config),
            tracker: LoadTracker::new(1, 0),
            rtt: Ewma::default(),
        }
    }

    /// Takes in the client's own report (already range-checked by the caller) and the one-sided
    /// round trip it measured.
    pub fn absorb(&mut self, report: &RemoteLoad, rtt_ns: Option<f64>) {
        self.tracker.absorb(report);
        if let Some(rtt) = rtt_ns.filter(|x| x.is_finite() && *x > 0.0) {
            self.rtt.add(rtt);
        }
    }

    /// This client's weights for `key`: the Client share decided from its own figures against
    /// the server placements' (`handler` and `inputs`, the controller's latest signals), the rest
    /// split between Host and NIC as the controller's `server` weights split it.
    pub fn weights(
        &mut self,
        key: HandlerKey,
        server: &Weights,
        handler: &HandlerLoad,
        inputs: &SteeringInputs,
        now: Nanos,
    ) -> Weights {
        let client = Placement::Client.index();
        let mut h = handler.clone();
        h.service_ns[client] = self.tracker.service(key);
        if let Some(steps) = self.tracker.steps(key) {
            h.steps = h.steps.max(steps);
        }
        let mut own = inputs.clone();
        if let Some(rtt) = self.rtt.get() {
            own.client_rtt_ns = rtt;
        }
        own.placements[client].mean_service_ns = self.tracker.overall_service();
        let share = self.policy.decide(key, &h, &own, now).of(Placement::Client);
        let (nic, host) = (server.of(Placement::Nic), server.of(Placement::Host));
        let (nic, host) = if nic + host > 0.0 {
            (nic / (nic + host), host / (nic + host))
        } else {
            (0.0, 1.0)
        };
        let mut w = [0.0; 3];
        w[client] = share;
        w[Placement::Nic.index()] = (1.0 - share) * nic;
        w[Placement::Host.index()] = (1.0 - share) * host;
        Weights(w)
    }
}

/// Tracks one placement's load from the events its executors report.
#[derive(Clone, Debug, Default)]
pub struct LoadTracker {
    queue_delay: Ewma,
    depth: u32,
    busy_ns: u64,
    window_start: Nanos,
    executors: u32,
    available: bool,
    last_utilisation: f64,
    service: HashMap<HandlerKey, Ewma>,
    steps: HashMap<HandlerKey, Ewma>,
    completions: HashMap<HandlerKey, u64>,
    overall: Ewma,
    dequeues: u64,
}

impl LoadTracker {
    /// A tracker for `executors` executor threads, starting at `now`.
    pub fn new(executors: u32, now: Nanos) -> Self {
        LoadTracker {
            executors,
            window_start: now,
            available: executors > 0,
            ..Default::default()
        }
    }

    /// A message left the queue after waiting `waited` nanoseconds; `depth` are still queued.
    pub fn dequeued(&mut self, waited: Nanos, depth: u32) {
        // Waits are often zero, so clip against a floor of a microsecond.
        let cap = self.queue_delay.get().unwrap_or(0.0).max(1_000.0) * Ewma::CLIP;
        self.queue_delay.add((waited as f64).min(cap));
        self.dequeues += 1;
        self.depth = depth;
    }

    /// A message of `key` finished after `service` nanoseconds of executor time and `steps`.
    pub fn completed(&mut self, key: HandlerKey, service: Nanos, steps: u16) {
        self.busy_ns += service;
        self.overall.add_clipped(service as f64);
        *self.completions.entry(key).or_default() += 1;
        self.service
            .entry(key)
            .or_default()
            .add_clipped(service as f64);
        self.steps.entry(key).or_default().add(steps as f64);
    }

    /// Executor time taken away from messages (a CPU hog, a capacity limit).
    pub fn stolen(&mut self, ns: Nanos) {
        self.busy_ns += ns;
    }

    /// Marks the placement up or down.
    pub fn set_available(&mut self, up: bool) {
        self.available = up;
    }

    /// Closes the period ending at `now` and returns the placement's load.
    pub fn sample(&mut self, now: Nanos) -> PlacementLoad {
        // Queueing delay describes the present: a placement that dequeued nothing for a whole
        // period has no queue to speak of (a standing queue still shows through the
        // controller's Little's-law estimate), so its estimate decays with time instead of
        // waiting for the rare probe (sample-driven averages go stale exactly where the policy
        // stopped sending traffic).
        if self.dequeues == 0 {
            self.queue_delay.decay(0.5);
        }
        self.dequeues = 0;
        let window =
            now.saturating_sub(self.window_start).max(1) as f64 * self.executors.max(1) as f64;
        let utilisation = (self.busy_ns as f64 / window).min(1.0);
        self.last_utilisation = utilisation;
        self.busy_ns = 0;
        self.window_start = now;
        PlacementLoad {
            queue_depth: self.depth,
            queue_delay_ns: self.queue_delay.get().unwrap_or(0.0),
            utilisation,
            available: self.available,
            mean_service_ns: self.overall.get(),
        }
    }

    /// Utilisation over the last closed period (0..=1).
    pub fn last_utilisation(&self) -> f64 {
        self.last_utilisation
    }

    /// Queueing-delay EWMA, nanoseconds.
    pub fn queue_delay_ns(&self) -> f64 {
        self.queue_delay.get().unwrap_or(0.0)
    }

    /// Service-time EWMA of `key` here.
    pub fn service(&self, key: HandlerKey) -> Option<f64> {
        self.service.get(&key).and_then(Ewma::get)
    }

    /// Steps EWMA of `key` here.
    pub fn steps(&self, key: HandlerKey) -> Option<f64> {
        self.steps.get(&key).and_then(Ewma::get)
    }

    /// Service-time average over every handler here, nanoseconds.
    pub fn overall_service(&self) -> Option<f64> {
        self.overall.get()
    }

    /// Handlers that completed messages here since the last call, with how many, and forgets
    /// them.
    pub fn take_touched(&mut self) -> Vec<(HandlerKey, u64)> {
        // Drained, not replaced: the map keeps its capacity for the next period.
        self.completions.drain().collect()
    }

    /// Every handler seen here.
    pub fn handlers(&self) -> impl Iterator<Item = &HandlerKey> {
        self.service.keys()
    }

    /// The report a remote placement sends: what happened since the last report (busy time,
    /// dequeues, completions are drained), with the current averages.
    pub fn report(&mut self) -> RemoteLoad {
        let handlers = self
            .completions
            .drain()
            .map(|((app, handler), completions)| RemoteHandler {
                app,
                handler,
                service_ns: self
                    .service
                    .get(&(app, handler))
                    .and_then(Ewma::get)
                    .unwrap_or(0.0),
                steps: self
                    .steps
                    .get(&(app, handler))
                    .and_then(Ewma::get)
                    .unwrap_or(1.0),
                completions,
            })
            .collect();
        let r = RemoteLoad {
            executors: self.executors,
            queue_depth: self.depth,
            queue_delay_ns: self.queue_delay_ns(),
            busy_ns: self.busy_ns,
            dequeues: self.dequeues,
            handlers,
        };
        self.busy_ns = 0;
        self.dequeues = 0;
        r
    }

    /// Takes in a remote placement's report as if its executors had run here.
    pub fn absorb(&mut self, r: &RemoteLoad) {
        self.executors = r.executors.max(1);
        self.depth = r.queue_depth;
        if r.dequeues > 0 || self.queue_delay.get().is_none() {
            self.queue_delay.set(r.queue_delay_ns);
        }
        self.busy_ns += r.busy_ns;
        self.dequeues += r.dequeues;
        for h in &r.handlers {
            let key = (h.app, h.handler);
            if !h.service_ns.is_finite() || !h.steps.is_finite() {
                continue;
            }
            self.service.entry(key).or_default().set(h.service_ns);
            self.steps.entry(key).or_default().set(h.steps);
            self.overall.add_clipped(h.service_ns);
            *self.completions.entry(key).or_default() += h.completions;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: HandlerKey = (1, 2);

    fn inputs(host_delay: f64, nic_delay: f64) -> SteeringInputs {
        let up = |d| PlacementLoad {
            queue_depth: 0,
            queue_delay_ns: d,
            utilisation: 0.5,
            available: true,
            mean_service_ns: None,
        };
        SteeringInputs {
            placements: [up(0.0), up(nic_delay), up(host_delay)],
            client_rtt_ns: 5_000.0,
            total_rate: 0.0,
        }
    }

    fn handler() -> HandlerLoad {
        HandlerLoad {
            service_ns: [Some(1_000.0), Some(3_000.0), Some(1_000.0)],
            steps: 2.0,
            read_only: true,
            owner: Some(Placement::Host),
        }
    }

    #[test]
    fn moves_off_a_congested_placement_and_comes_back() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let h = handler();
        let w = p.decide(KEY, &h, &inputs(0.0, 0.0), 0);
        assert_eq!(w.major(), Placement::Host);
        assert!((w.0.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        // Congestion: the host's queue grows. One decision is not enough (hysteresis)...
        let congested = inputs(50_000.0, 0.0);
        assert_eq!(p.decide(KEY, &h, &congested, 1).major(), Placement::Host);
        // ...two are.
        let w = p.decide(KEY, &h, &congested, 2);
        assert_eq!(w.major(), Placement::Nic);
        assert!(
            w.of(Placement::Host) <= 0.1,
            "at least 90% off the host: {w:?}"
        );
        // Congestion ends: back to the host after confirmation.
        p.decide(KEY, &h, &inputs(0.0, 0.0), 3);
        assert_eq!(
            p.decide(KEY, &h, &inputs(0.0, 0.0), 4).major(),
            Placement::Host
        );
    }

    #[test]
    fn does_not_flap_under_noise() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let h = handler();
        // Host and NIC completion times within the margin of each other, noise alternating.
        let mut moves = 0;
        let mut last = p.decide(KEY, &h, &inputs(0.0, 0.0), 0).major();
        for i in 0..1000u64 {
            let noise = if i % 2 == 0 { 2_500.0 } else { 1_500.0 };
            let now = p.decide(KEY, &h, &inputs(noise, 0.0), i).major();
            if now != last {
                moves += 1;
                last = now;
            }
        }
        assert_eq!(
            moves, 0,
            "alternating noise inside the margin must not move traffic"
        );
    }

    #[test]
    fn writes_stay_at_the_owner_and_clients_only_read() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let mut h = handler();
        h.read_only = false;
        h.owner = Some(Placement::Nic);
        assert_eq!(
            p.decide(KEY, &h, &inputs(0.0, 1e9), 0),
            Weights::all(Placement::Nic)
        );
        let mut s = StaticPolicy(Placement::Client);
        assert_eq!(
            s.decide(KEY, &h, &inputs(0.0, 0.0), 0),
            Weights::all(Placement::Nic)
        );
    }

    /// A client's report of cheap local runs, for `KEY`.
    fn cheap_client_report() -> RemoteLoad {
        RemoteLoad {
            executors: 1,
            handlers: vec![RemoteHandler {
                app: KEY.0,
                handler: KEY.1,
                service_ns: 10.0,
                steps: 1.0,
                completions: 100,
            }],
            ..RemoteLoad::default()
        }
    }

    #[test]
    fn a_clients_report_moves_only_its_own_client_share() {
        // The server placements are congested, so a client whose own runs are cheap moves to
        // the Client placement; another client that reported nothing stays server-bound.
        let cfg = CostPolicyConfig::default();
        let (mut reporter, mut quiet) = (ClientShare::new(cfg), ClientShare::new(cfg));
        let h = HandlerLoad {
            service_ns: [None, Some(3_000.0), Some(1_000.0)],
            ..handler()
        };
        let congested = inputs(80_000.0, 60_000.0);
        let server = Weights([0.0, 0.3, 0.7]);
        reporter.absorb(&cheap_client_report(), Some(1_000.0));
        let (mut r, mut q) = (server, server);
        for t in 0..5 {
            r = reporter.weights(KEY, &server, &h, &congested, t);
            q = quiet.weights(KEY, &server, &h, &congested, t);
        }
        assert_eq!(r.major(), Placement::Client, "{r:?}");
        // The quiet client prices its Client placement without anyone else's report: the
        // unmeasured guess from the server's service time and the controller's round trip.
        let alone = ClientShare::new(cfg).weights(KEY, &server, &h, &congested, 0);
        assert_eq!(q.of(Placement::Client), alone.of(Placement::Client));
        for w in [r, q] {
            assert!((w.0.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            // The server-bound rest keeps the controller's Host:NIC split.
            let rest = w.of(Placement::Nic) + w.of(Placement::Host);
            if rest > 0.0 {
                assert!((w.of(Placement::Host) / rest - 0.7).abs() < 1e-9, "{w:?}");
            }
        }
    }

    #[test]
    fn writes_never_go_to_a_client_whatever_it_reports() {
        let mut c = ClientShare::new(CostPolicyConfig::default());
        c.absorb(&cheap_client_report(), Some(1.0));
        let w = HandlerLoad {
            read_only: false,
            ..handler()
        };
        let got = c.weights(
            KEY,
            &Weights::all(Placement::Host),
            &w,
            &inputs(1e9, 1e9),
            0,
        );
        assert_eq!(got, Weights::all(Placement::Host));
    }

    #[test]
    fn handlers_never_measured_do_not_hide_a_congested_owner() {
        // One measured read handler and many that never ran anywhere: the never-run ones are
        // no evidence either way, so the owner still leaves a host congested by 100 us.
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let mut write = handler();
        write.read_only = false;
        let never_run = HandlerLoad {
            service_ns: [None; 3],
            ..handler()
        };
        let mut app = vec![write, handler()];
        app.extend(std::iter::repeat_n(never_run, 8));
        let congested = inputs(100_000.0, 0.0);
        let last = (0..OWNER_CONFIRM as u64)
            .map(|t| p.owner(1, Placement::Host, &app, &congested, t))
            .last();
        assert_eq!(last, Some(Placement::Nic));
    }

    #[test]
    fn owner_moves_only_after_sustained_congestion() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let mut w = handler();
        w.read_only = false;
        let writes = [w];
        let calm = inputs(0.0, 0.0);
        for t in 0..20 {
            assert_eq!(
                p.owner(1, Placement::Host, &writes, &calm, t),
                Placement::Host
            );
        }
        // Relatively 3x worse but only by a few microseconds: not worth a drain.
        let busyish = inputs(5_000.0, 0.0);
        for t in 0..20 {
            assert_eq!(
                p.owner(1, Placement::Host, &writes, &busyish, t),
                Placement::Host
            );
        }
        let congested = inputs(100_000.0, 0.0);
        let moves: Vec<Placement> = (0..OWNER_CONFIRM as u64)
            .map(|t| p.owner(1, Placement::Host, &writes, &congested, t))
            .collect();
        assert!(moves[..moves.len() - 1]
            .iter()
            .all(|&m| m == Placement::Host));
        assert_eq!(*moves.last().unwrap(), Placement::Nic);
        // Static policies never move the owner.
        let mut s = StaticPolicy(Placement::Host);
        assert_eq!(
            s.owner(1, Placement::Host, &writes, &congested, 0),
            Placement::Host
        );
    }

    #[test]
    fn unavailable_placements_get_nothing() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let h = handler();
        let mut i = inputs(0.0, 0.0);
        i.placements[Placement::Host.index()].available = false;
        let w = p.decide(KEY, &h, &i, 0);
        assert_eq!(w.of(Placement::Host), 0.0);
        assert!(w.major() != Placement::Host);
    }

    #[test]
    fn tracker_utilisation() {
        let mut t = LoadTracker::new(2, 0);
        t.completed(KEY, 500_000, 1);
        t.dequeued(1_000, 3);
        let l = t.sample(1_000_000);
        assert!((l.utilisation - 0.25).abs() < 1e-9);
        assert_eq!((l.queue_depth, l.queue_delay_ns), (3, 1_000.0));
        assert_eq!(t.sample(2_000_000).utilisation, 0.0);
    }

    #[test]
    fn unmeasured_placements_are_priced_by_the_placement_speed_ratio() {
        let mut h = handler();
        h.service_ns = [None, None, Some(1_000.0)];
        // The host queue delay makes a NIC guessed at 1.5x look better...
        let mut i = inputs(5_000.0, 0.0);
        let p = CostPolicy::new(CostPolicyConfig::default());
        assert_eq!(
            p.completion_times(&h, &i)[Placement::Nic.index()],
            Some(1_500.0)
        );
        // ...but other handlers show the NIC is 30x slower than the host.
        i.placements[Placement::Host.index()].mean_service_ns = Some(2_000.0);
        i.placements[Placement::Nic.index()].mean_service_ns = Some(60_000.0);
        let ect = p.completion_times(&h, &i);
        assert_eq!(ect[Placement::Nic.index()], Some(30_000.0));
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        for t in 0..10 {
            assert_eq!(p.decide(KEY, &h, &i, t).major(), Placement::Host);
        }
        // A faster average elsewhere is not taken on trust: probes measure it.
        i.placements[Placement::Nic.index()].mean_service_ns = Some(100.0);
        assert_eq!(
            p.completion_times(&h, &i)[Placement::Nic.index()],
            Some(1_000.0)
        );
    }

    #[test]
    fn probe_share_follows_the_global_budget() {
        let cfg = CostPolicyConfig::default();
        let share = |rate: f64| {
            let mut p = CostPolicy::new(cfg);
            let mut i = inputs(0.0, 0.0);
            i.total_rate = rate;
            p.decide(KEY, &handler(), &i, 0).of(Placement::Nic)
        };
        // Unknown rate: the configured ceiling.
        assert_eq!(share(0.0), cfg.probe);
        // 100 K msg/s: 200 probes/s is a 0.2% share.
        assert!((share(100_000.0) - 0.002).abs() < 1e-12);
        // Very low and very high rates are clamped.
        assert_eq!(share(10.0), cfg.probe);
        assert_eq!(share(1e9), cfg.min_probe);
    }

    #[test]
    fn idle_queue_delay_decays_and_recovery_counts_double() {
        let mut t = LoadTracker::new(1, 0);
        t.dequeued(2_000, 1);
        assert_eq!(t.sample(1_000_000).queue_delay_ns, 2_000.0);
        // No dequeues for a period: the stale estimate halves instead of sticking.
        assert_eq!(t.sample(2_000_000).queue_delay_ns, 1_000.0);
        assert_eq!(t.sample(3_000_000).queue_delay_ns, 500.0);
        let mut e = Ewma::default();
        e.add(1_000.0);
        e.add_clipped(100_000.0);
        let high = e.get().unwrap();
        assert!(high <= 1_000.0 * (1.0 - Ewma::ALPHA) + 4_000.0 * Ewma::ALPHA + 1e-9);
        e.add_clipped(1_000.0);
        let drop = high - e.get().unwrap();
        assert!((drop - 2.0 * Ewma::ALPHA * (high - 1_000.0)).abs() < 1e-9);
    }

    #[test]
    fn touched_handlers_are_reported_once() {
        let mut t = LoadTracker::new(1, 0);
        t.completed(KEY, 1_000, 1);
        t.completed(KEY, 1_000, 1);
        t.completed((3, 4), 1_000, 1);
        let mut got = t.take_touched();
        got.sort();
        assert_eq!(got, vec![(KEY, 2), ((3, 4), 1)]);
        assert!(t.take_touched().is_empty());
        t.completed(KEY, 1_000, 1);
        assert_eq!(t.take_touched(), vec![(KEY, 1)]);
    }
}
