//! Policies: how load signals become weights. [`StaticPolicy`] pins (baselines);
//! [`CostPolicy`] minimises expected completion time with hysteresis and probes.

use std::collections::HashMap;

use serde::Serialize;

use super::{HandlerKey, HandlerLoad, SteeringInputs, Weights};
use crate::Nanos;
use crate::Placement;

/// How load signals become weights: [`crate::steering::Controller::tick`] asks it for every
/// decided handler's weights, and for the write owner of every app that has one.
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
#[non_exhaustive]
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
    /// Smallest probe share: it binds only above `probes_per_second / min_probe` messages a
    /// second (4 M by default), so that every rate a node reaches gets the probes per second
    /// asked, not more (a probe to a slower placement costs its client that placement's
    /// latency).
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
            min_probe: 0.00005,
        }
    }
}

/// Owner moves are costly (a drain): they need a larger margin, a longer streak, and an
/// absolute gain: microsecond differences between two uncongested placements are noise.
const OWNER_MARGIN: f64 = 1.0;
pub(super) const OWNER_CONFIRM: u32 = 5;
const OWNER_MIN_GAIN_NS: f64 = 50_000.0;

/// Smallest fraction of the slower placement's share one decision moves: where two
/// placements' completion times cross over and over (both loaded past what either carries
/// alone), the moves shrink to this.
const MIN_STEP: f64 = 1.0 / 64.0;

/// What a move in the direction of the last one multiplies the step by: less than a
/// reversal divides it (2), so that a split that keeps crossing over settles.
const STEP_GROWTH: f64 = 1.5;

/// A handler's split between placements, and how it last moved.
#[derive(Clone, Copy, Debug)]
struct Split {
    /// The share of each placement before probes ([`Placement::index`] order; sums to 1).
    share: [f64; 3],
    /// The challenger of the last decision (the placement cheaper by the margin than the
    /// dearest one still carrying traffic), and for how many decisions in a row it was.
    challenger: Option<(Placement, Placement)>,
    streak: u32,
    /// The last move (from, to) and the fraction of `from`'s share the next move takes:
    /// grown while moves go the same way, halved when one reverses the last (the split
    /// then settles where the placements' completion times meet, instead of flipping all
    /// traffic back and forth each time the side it left looks cheaper).
    last: Option<(Placement, Placement)>,
    step: f64,
}

impl Split {
    fn all(p: Placement) -> Split {
        Split {
            share: Weights::all(p).0,
            challenger: None,
            streak: 0,
            last: None,
            step: 1.0,
        }
    }

    /// Moves the step's fraction of `from`'s share to `to`.
    fn shift(&mut self, from: Placement, to: Placement) {
        self.step = match self.last {
            Some(l) if l == (to, from) => (self.step / 2.0).max(MIN_STEP),
            Some(l) if l == (from, to) => (self.step * STEP_GROWTH).min(1.0),
            _ => self.step,
        };
        let moved = self.share[from.index()] * self.step;
        // A remainder below the smallest step goes whole: a share does not dwindle forever.
        let moved = if self.share[from.index()] - moved < MIN_STEP / 4.0 {
            self.share[from.index()]
        } else {
            moved
        };
        self.share[from.index()] -= moved;
        self.share[to.index()] += moved;
        self.last = Some((from, to));
    }
}

/// Minimises expected completion time, with hysteresis and probes: traffic moves from the
/// dearest placement that carries some to the cheapest once the cheapest has been cheaper by
/// the margin for `confirm` decisions, all of it at first, and by halved steps each time the
/// direction reverses (two placements that are both loaded share the load).
#[derive(Debug, Default)]
pub struct CostPolicy {
    config: CostPolicyConfig,
    state: HashMap<HandlerKey, Split>,
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
        // A server placement is guessed from the server's own measurements when there are
        // any: a client's figure is its own machine's (and, from a remote client, only its
        // report), and a flattering one would make the unmeasured NIC look cheaper than the
        // client that reported it.
        let cheapest_of = |qs: &[Placement]| {
            qs.iter()
                .filter_map(|&q| h.service_ns[q.index()].map(|t| (q, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
        };
        let cheapest = (p != Placement::Client)
            .then(|| cheapest_of(&[Placement::Nic, Placement::Host]))
            .flatten()
            .or_else(|| cheapest_of(&Placement::ALL));
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
            // At the client, each step's READs; at a server placement, its queue and what its
            // receive loop spends on the message besides the handler.
            let extra = if p == Placement::Client {
                h.steps.max(1.0) * inputs.client_rtt_ns
            } else {
                load.queue_delay_ns + load.loop_ns
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
        let split = self.state.entry(key).or_insert(Split::all(best));
        // A placement that became unusable gives its share to the cheapest at once.
        for p in Placement::ALL {
            if ect[p.index()].is_none() && split.share[p.index()] > 0.0 {
                let s = split.share[p.index()];
                split.share[p.index()] = 0.0;
                split.share[best.index()] += s;
            }
        }
        // The dearest placement that still carries traffic is the one to relieve.
        let dearest = Placement::ALL
            .into_iter()
            .filter(|&p| split.share[p.index()] > 0.0)
            .filter_map(|p| ect[p.index()].map(|t| (p, t)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        match dearest {
            Some((from, from_t)) if from != best && best_t * (1.0 + cfg.margin) < from_t => {
                if split.challenger == Some((from, best)) {
                    split.streak += 1;
                } else {
                    split.challenger = Some((from, best));
                    split.streak = 1;
                }
                if split.streak >= cfg.confirm {
                    split.shift(from, best);
                    // The next move waits until the signals have shown this one's effect.
                    split.streak = 0;
                }
            }
            _ => {
                split.challenger = None;
                split.streak = 0;
            }
        }
        let usable: Vec<Placement> = Placement::ALL
            .into_iter()
            .filter(|&p| ect[p.index()].is_some())
            .collect();
        let probe = if inputs.total_rate > 0.0 {
            (cfg.probes_per_second / inputs.total_rate).clamp(cfg.min_probe, cfg.probe)
        } else {
            cfg.probe
        };
        // Every usable placement keeps a probe's share, so its signals stay fresh; the rest
        // follows the split.
        let probes = probe * usable.len().saturating_sub(1) as f64;
        let mut w = [0.0; 3];
        for &p in &usable {
            let share = split.share[p.index()];
            w[p.index()] = share * (1.0 - probes - probe) + probe;
        }
        let sum: f64 = w.iter().sum();
        if sum > 0.0 {
            for x in &mut w {
                *x /= sum;
            }
        }
        Weights(w)
    }
}
