//! The steering controller: once per period it closes every placement's load period, turns
//! what the driver observed into [`SteeringInputs`] one way for everyone, and asks the policy
//! for each handler's weights and each app's write owner. The in-process cluster, naam-server
//! and the virtual-time simulator all call [`Controller::tick`]; they differ only in how they
//! answer [`Observe`] (locks around shared trackers, or plain fields).

use super::{HandlerKey, HandlerLoad, LoadTracker, Policy, SteeringInputs, Weights};
use crate::Nanos;
use crate::Placement;

/// Most apps one non-full tick decides: with more active apps, ticks take them round robin, so
/// a thousand apps are each decided every few periods instead of one core's worth of work per
/// period.
pub const DECISION_BUDGET: usize = 256;

/// One handler as the controller needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandlerView {
    /// Its id within the app.
    pub id: u32,
    /// Whether it only reads (so it may run at the client).
    pub read_only: bool,
}

/// One app as the controller needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppView {
    /// App id: the first half of every [`HandlerKey`] decided for it.
    pub id: u32,
    /// Where its writes are applied now (`None`: it has no write owner).
    pub owner: Option<Placement>,
    /// Every handler of the app: each gets weights, and the owner is decided from all of them.
    pub handlers: Vec<HandlerView>,
}

/// What the controller asks of the driver that runs it. Trackers are reached through a closure
/// so that a threaded driver can lock each one briefly instead of all of them for a whole tick.
pub trait Observe {
    /// Runs `f` on placement `p`'s load tracker.
    fn with_tracker<R>(&mut self, p: Placement, f: impl FnOnce(&mut LoadTracker) -> R) -> R;
    /// Messages queued at `p` right now and how many executors serve that queue, if the driver
    /// holds the queue (a placement in another process reports its own delay instead).
    fn queued(&self, p: Placement) -> Option<(u32, u32)>;
    /// Whether `p` can take messages now.
    fn available(&self, p: Placement) -> bool;
    /// The one-sided round trip clients see, nanoseconds, if measured.
    fn client_rtt_ns(&self) -> Option<f64>;
    /// The apps of `ids` that exist, in that order, or every app (`None`, in any order).
    /// Called every tick with at most [`DECISION_BUDGET`] ids: a driver looks each one up
    /// rather than walking its apps, which may be thousands.
    fn apps(&self, ids: Option<&[u32]>) -> Vec<AppView>;
}

/// Settings of a [`Controller`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct ControllerConfig {
    /// Clients run in other processes and decide their own Client share from the signals this
    /// controller publishes ([`Decisions::client_signals`]); the shared weights then split only
    /// between NIC and host.
    pub remote_clients: bool,
    /// The NIC runs in another process and cannot own writes: an owner move to it is never
    /// proposed.
    pub remote_nic: bool,
    /// The one-sided round trip assumed before clients measured one, nanoseconds.
    pub default_client_rtt_ns: f64,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            remote_clients: false,
            remote_nic: false,
            default_client_rtt_ns: 5_000.0,
        }
    }
}

impl ControllerConfig {
    /// The defaults: clients and NIC in the same process as the controller.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`ControllerConfig::remote_clients`].
    pub fn remote_clients(mut self, yes: bool) -> Self {
        self.remote_clients = yes;
        self
    }

    /// Sets [`ControllerConfig::remote_nic`].
    pub fn remote_nic(mut self, yes: bool) -> Self {
        self.remote_nic = yes;
        self
    }

    /// Sets [`ControllerConfig::default_client_rtt_ns`].
    pub fn default_client_rtt_ns(mut self, ns: f64) -> Self {
        self.default_client_rtt_ns = ns;
        self
    }
}

/// What one tick decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decisions {
    /// The inputs the policy decided from (with remote clients, the Client placement shows as
    /// unavailable here: it is decided per client).
    pub inputs: SteeringInputs,
    /// New weights per handler decided this tick (the driver publishes those that changed).
    pub weights: Vec<(HandlerKey, Weights)>,
    /// Apps whose write owner should move, and where to.
    pub owner_moves: Vec<(u32, Placement)>,
    /// With remote clients: the inputs with the Client placement as the agent sees it, and each
    /// decided handler's signals, from which each client derives its own Client share.
    pub client_signals: Option<(SteeringInputs, Vec<(HandlerKey, HandlerLoad)>)>,
}

/// The steering controller of one server.
pub struct Controller {
    policy: Box<dyn Policy>,
    config: ControllerConfig,
    last_tick: Nanos,
    cursor: usize,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("policy", &self.policy.name())
            .field("config", &self.config)
            .field("last_tick", &self.last_tick)
            .finish()
    }
}

impl Controller {
    /// A controller running `policy`, whose first period starts at `now`.
    pub fn new(policy: Box<dyn Policy>, config: ControllerConfig, now: Nanos) -> Self {
        Controller {
            policy,
            config,
            last_tick: now,
            cursor: 0,
        }
    }

    /// The policy's name, for reports.
    pub fn policy_name(&self) -> String {
        self.policy.name()
    }

    /// Closes the period ending at `now` and decides. A `full` tick decides every app (at
    /// start-up, so that every handler has weights); otherwise only apps whose handlers
    /// completed messages this period, at most [`DECISION_BUDGET`] of them.
    pub fn tick(&mut self, now: Nanos, observe: &mut impl Observe, full: bool) -> Decisions {
        let mut inputs = SteeringInputs {
            client_rtt_ns: observe
                .client_rtt_ns()
                .unwrap_or(self.config.default_client_rtt_ns),
            ..SteeringInputs::default()
        };
        let period = now.saturating_sub(self.last_tick).max(1) as f64 / 1e9;
        self.last_tick = now;
        // The apps that completed messages this period: a list sorted below, not a hashed set
        // (at hundreds of active apps the hashing was a steering thread's largest cost).
        let mut active: Vec<u32> = Vec::new();
        let mut completions: u64 = 0;
        for p in Placement::ALL {
            let queued = observe.queued(p);
            let (load, touched) = observe.with_tracker(p, |t| {
                let mut load = t.sample(now);
                if let Some((depth, executors)) = queued {
                    // Little's law on what is queued right now: a stalled queue shows at once,
                    // not only when its messages finally get served.
                    load.queue_depth = depth;
                    load.queue_delay_ns = load.queue_delay_ns.max(
                        depth as f64 * t.overall_service().unwrap_or(0.0) / executors.max(1) as f64,
                    );
                }
                (load, t.take_touched())
            });
            inputs.placements[p.index()] = load;
            inputs.placements[p.index()].available = observe.available(p);
            for (key, n) in touched {
                active.push(key.0);
                completions += n;
            }
        }
        inputs.total_rate = completions as f64 / period;
        let client_inputs = self.config.remote_clients.then(|| inputs.clone());
        if self.config.remote_clients {
            inputs.placements[Placement::Client.index()].available = false;
        }
        let apps = if full {
            observe.apps(None)
        } else {
            // Sorted, so that a run in virtual time decides in the same order every time.
            let mut ids = active;
            ids.sort_unstable();
            ids.dedup();
            if ids.len() > DECISION_BUDGET {
                let start = self.cursor % ids.len();
                self.cursor = self.cursor.wrapping_add(DECISION_BUDGET);
                ids.rotate_left(start);
                ids.truncate(DECISION_BUDGET);
            }
            observe.apps(Some(&ids))
        };
        let keys: Vec<(HandlerKey, bool)> = apps
            .iter()
            .flat_map(|a| a.handlers.iter().map(|h| ((a.id, h.id), h.read_only)))
            .collect();
        let mut service = vec![[None; 3]; keys.len()];
        let mut steps = vec![1.0f64; keys.len()];
        for p in Placement::ALL {
            observe.with_tracker(p, |t| {
                for (i, (k, _)) in keys.iter().enumerate() {
                    service[i][p.index()] = t.service(*k);
                    if let Some(s) = t.steps(*k) {
                        steps[i] = steps[i].max(s);
                    }
                }
            });
        }
        let mut decisions = Decisions {
            weights: Vec::with_capacity(keys.len()),
            ..Decisions::default()
        };
        let mut signals = Vec::new();
        let mut i = 0;
        for app in &apps {
            let mut loads = Vec::with_capacity(app.handlers.len());
            for _ in &app.handlers {
                let (key, read_only) = keys[i];
                let handler = HandlerLoad {
                    service_ns: service[i],
                    steps: steps[i],
                    read_only,
                    owner: app.owner,
                };
                let w = self.policy.decide(key, &handler, &inputs, now);
                decisions.weights.push((key, w));
                if self.config.remote_clients {
                    signals.push((key, handler.clone()));
                }
                loads.push(handler);
                i += 1;
            }
            if let Some(current) = app.owner {
                let want = self.policy.owner(app.id, current, &loads, &inputs, now);
                let possible = !(want == Placement::Nic && self.config.remote_nic);
                if want != current && possible {
                    decisions.owner_moves.push((app.id, want));
                }
            }
        }
        decisions.client_signals = client_inputs.map(|c| (c, signals));
        decisions.inputs = inputs;
        decisions
    }
}

/// Smooth weighted round robin over placements: the memory of past picks with which a client,
/// a switch or a simulator follows weights exactly over any window.
#[derive(Default, Clone, Copy, Debug)]
pub struct Selector {
    credit: [f64; 3],
}

impl Selector {
    /// The next placement among the `allowed` ones with positive weight (`None`: none is).
    pub fn pick(&mut self, w: &Weights, allowed: impl Fn(Placement) -> bool) -> Option<Placement> {
        let mut best: Option<Placement> = None;
        for p in Placement::ALL {
            if w.of(p) > 0.0 && allowed(p) {
                self.credit[p.index()] += w.of(p);
                if best.is_none_or(|b| self.credit[p.index()] > self.credit[b.index()]) {
                    best = Some(p);
                }
            }
        }
        let b = best?;
        let total: f64 = Placement::ALL
            .into_iter()
            .filter(|&p| w.of(p) > 0.0 && allowed(p))
            .map(|p| w.of(p))
            .sum();
        self.credit[b.index()] -= total;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::steering::{CostPolicy, CostPolicyConfig, StaticPolicy};
    use std::collections::HashSet;

    /// A driver with plain fields: what the simulator and these tests use.
    struct Fields {
        trackers: [LoadTracker; 3],
        queued: [Option<(u32, u32)>; 3],
        apps: Vec<AppView>,
    }

    impl Observe for Fields {
        fn with_tracker<R>(&mut self, p: Placement, f: impl FnOnce(&mut LoadTracker) -> R) -> R {
            f(&mut self.trackers[p.index()])
        }
        fn queued(&self, p: Placement) -> Option<(u32, u32)> {
            self.queued[p.index()]
        }
        fn available(&self, _: Placement) -> bool {
            true
        }
        fn client_rtt_ns(&self) -> Option<f64> {
            None
        }
        fn apps(&self, ids: Option<&[u32]>) -> Vec<AppView> {
            match ids {
                Some(ids) => ids
                    .iter()
                    .filter_map(|id| self.apps.iter().find(|a| a.id == *id).cloned())
                    .collect(),
                None => self.apps.clone(),
            }
        }
    }

    fn fields(apps: u32) -> Fields {
        Fields {
            trackers: [
                LoadTracker::new(1, 0),
                LoadTracker::new(1, 0),
                LoadTracker::new(2, 0),
            ],
            queued: [None, Some((0, 1)), Some((0, 2))],
            apps: (1..=apps)
                .map(|id| AppView {
                    id,
                    owner: Some(Placement::Host),
                    handlers: vec![
                        HandlerView {
                            id: 1,
                            read_only: true,
                        },
                        HandlerView {
                            id: 2,
                            read_only: false,
                        },
                    ],
                })
                .collect(),
        }
    }

    #[test]
    fn a_full_tick_decides_every_handler_and_writes_follow_their_owner() {
        let mut f = fields(3);
        let mut c = Controller::new(
            Box::new(StaticPolicy(Placement::Nic)),
            ControllerConfig::default(),
            0,
        );
        let d = c.tick(1_000_000, &mut f, true);
        assert_eq!(d.weights.len(), 6);
        for (key, w) in &d.weights {
            let want = if key.1 == 1 {
                Placement::Nic
            } else {
                Placement::Host
            };
            assert_eq!(*w, Weights::all(want), "{key:?}");
        }
        // Nothing ran: a later, non-full tick decides nothing.
        assert!(c.tick(2_000_000, &mut f, false).weights.is_empty());
    }

    #[test]
    fn a_stalled_queue_shows_through_littles_law() {
        let mut f = fields(1);
        f.trackers[Placement::Host.index()].completed((1, 1), 10_000, 1);
        f.queued[Placement::Host.index()] = Some((100, 2));
        let mut c = Controller::new(
            Box::new(CostPolicy::new(CostPolicyConfig::default())),
            ControllerConfig::default(),
            0,
        );
        let d = c.tick(1_000_000, &mut f, false);
        let host = d.inputs.placements[Placement::Host.index()];
        assert_eq!(host.queue_depth, 100);
        assert_eq!(host.queue_delay_ns, 100.0 * 10_000.0 / 2.0);
        assert_eq!(d.inputs.total_rate, 1.0 / 1e-3);
        assert_eq!(d.weights.len(), 2, "app 1 was active");
    }

    #[test]
    fn ticks_past_the_budget_take_apps_round_robin() {
        let n = DECISION_BUDGET as u32 + 100;
        let mut f = fields(n);
        let mut c = Controller::new(
            Box::new(StaticPolicy(Placement::Host)),
            ControllerConfig::default(),
            0,
        );
        let mut decided = HashSet::new();
        for tick in 1..=2u64 {
            for app in 1..=n {
                f.trackers[2].completed((app, 1), 1_000, 1);
            }
            let d = c.tick(tick * 1_000_000, &mut f, false);
            let apps: HashSet<u32> = d.weights.iter().map(|(k, _)| k.0).collect();
            assert_eq!(apps.len(), DECISION_BUDGET);
            decided.extend(apps);
        }
        assert_eq!(decided.len(), n as usize, "two ticks cover every app");
    }

    #[test]
    fn remote_clients_get_signals_and_the_shared_weights_leave_the_client_out() {
        let mut f = fields(1);
        let mut c = Controller::new(
            Box::new(CostPolicy::new(CostPolicyConfig::default())),
            ControllerConfig::new()
                .remote_clients(true)
                .remote_nic(true),
            0,
        );
        let d = c.tick(1_000_000, &mut f, true);
        assert!(!d.inputs.placements[Placement::Client.index()].available);
        let (inputs, signals) = d.client_signals.expect("signals for remote clients");
        assert!(inputs.placements[Placement::Client.index()].available);
        assert_eq!(signals.len(), 2);
        for (_, w) in &d.weights {
            assert_eq!(w.of(Placement::Client), 0.0);
        }
    }

    #[test]
    fn the_selector_follows_weights_exactly() {
        let mut s = Selector::default();
        let w = Weights([0.25, 0.25, 0.5]);
        let mut n = [0; 3];
        for _ in 0..400 {
            n[s.pick(&w, |_| true).unwrap().index()] += 1;
        }
        assert_eq!(n, [100, 100, 200]);
        assert_eq!(s.pick(&w, |p| p == Placement::Nic), Some(Placement::Nic));
        assert_eq!(s.pick(&Weights::all(Placement::Host), |_| false), None);
    }
}
