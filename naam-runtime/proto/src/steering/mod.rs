//! Steering: load signals per placement and the policies that turn them into per-(app, handler)
//! weights over placements. Everything here is pure and takes time as an argument, so the
//! threaded cluster, the UDP server and the virtual-time simulator run the same decisions.
//!
//! The cost policy estimates, for each placement a handler may use, its expected completion time
//! `queueing delay + service time (+ steps × one-sided RTT at the client)`, moves the traffic to
//! the cheapest placement, and keeps a small probe share on the others so their signals stay
//! fresh (that is how traffic comes back when congestion ends). Hysteresis: a move happens only
//! when the challenger is cheaper by a margin for several consecutive decisions.
//!
//! Here: the signals and the types every part shares (`Ewma`, `RemoteLoad`, `PlacementLoad`,
//! `HandlerLoad`, `SteeringInputs`, `Weights`). Beside it: `tracker` (executor events into one
//! placement's signals), `policy` (`StaticPolicy`, `CostPolicy`), `share` (a remote client's
//! own Client share) and `controller` (the periodic `Controller::tick` and the `Selector`).

use serde::Serialize;

use crate::Placement;

mod controller;
mod policy;
mod share;
mod tracker;
pub use controller::{
    AppView, Controller, ControllerConfig, Decisions, HandlerView, Observe, Selector,
    DECISION_BUDGET,
};
pub use policy::{CostPolicy, CostPolicyConfig, Policy, StaticPolicy};
pub use share::ClientShare;
pub use tracker::LoadTracker;

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

    /// Samples added so far, clipped ones included ([`Ewma::set`] makes it at least 1).
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
    /// The app id; a server keeps a client's figures only for the apps its session may use.
    pub app: u32,
    /// The handler id (`handler_id` of its name); unknown handlers are dropped on receipt.
    pub handler: u32,
    /// Service-time average, nanoseconds.
    pub service_ns: f64,
    /// Steps-per-message average at the reporting placement (1.0 when never measured).
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
    /// What the placement's run-to-completion receive loops spend on a message beyond its
    /// handler (taking it in, opening, sealing and sending its answer), average in
    /// nanoseconds; 0 where nothing measured it. (Absent from older reports.)
    #[serde(default)]
    pub loop_ns: f64,
}

/// Identifies a handler of an app.
pub type HandlerKey = (u32, u32);

/// Load of one placement as the controller sees it after a period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PlacementLoad {
    /// Messages queued: the driver's live count when it holds the queue, else the last one seen
    /// or reported.
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
    /// A receive loop's own work per message here beyond the handler, nanoseconds (0: not
    /// measured, or messages run on executors): part of what a message sent here costs, and
    /// where the protocol's work is dearer than the handler's (Arm cores), most of it.
    pub loop_ns: f64,
}

/// One (app, handler)'s signals over every placement, as a policy decides from them.
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

    /// The fraction of the handler's messages sent to `p`, in 0..=1.
    pub fn of(&self, p: Placement) -> f64 {
        self.0[p.index()]
    }

    /// The NIC's share of what the server's placements take (host and NIC), per mille: what
    /// an eSwitch ahead of the host steers to the NIC (0 when the server takes nothing). A
    /// placement with any weight keeps at least one per mille: the policy's probes are often
    /// smaller than that, and rounded away they would leave the steering blind to the side
    /// it left (traffic moved off a congested host would never come back).
    pub fn nic_permille(&self) -> u32 {
        let (nic, host) = (self.of(Placement::Nic), self.of(Placement::Host));
        let server = nic + host;
        if !(server > 0.0 && server.is_finite()) {
            return 0;
        }
        let share = (nic / server * 1000.0).round().clamp(0.0, 1000.0) as u32;
        match (nic > 0.0, host > 0.0) {
            (true, true) => share.clamp(1, 999),
            _ => share,
        }
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

#[cfg(test)]
mod tests {
    use super::policy::OWNER_CONFIRM;
    use super::*;

    const KEY: HandlerKey = (1, 2);

    #[test]
    fn the_nic_share_is_of_the_servers_placements_only() {
        assert_eq!(Weights([0.5, 0.25, 0.25]).nic_permille(), 500);
        assert_eq!(Weights::all(Placement::Client).nic_permille(), 0);
        assert_eq!(Weights::all(Placement::Nic).nic_permille(), 1000);
        assert_eq!(Weights([0.0, f64::NAN, 1.0]).nic_permille(), 0);
        // Probes below a per mille are kept, either way.
        assert_eq!(Weights([0.0, 0.9998, 0.0002]).nic_permille(), 999);
        assert_eq!(Weights([0.0, 0.0002, 0.9998]).nic_permille(), 1);
    }

    fn inputs(host_delay: f64, nic_delay: f64) -> SteeringInputs {
        let up = |d| PlacementLoad {
            queue_depth: 0,
            queue_delay_ns: d,
            utilisation: 0.5,
            available: true,
            mean_service_ns: None,
            loop_ns: 0.0,
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

    /// Offered more than either placement carries alone (1.5 times each one's capacity), a
    /// policy that moves all traffic to the cheaper side flips for ever: the side it fills
    /// queues, the one it left looks idle. The split settles where both carry their part.
    #[test]
    fn load_beyond_either_placement_is_split_between_them() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let h = HandlerLoad {
            service_ns: [None, Some(1_000.0), Some(1_000.0)],
            ..handler()
        };
        let offered = 1.5;
        // Queueing delay at a load of `rho` of a placement's capacity (M/M/1, saturating).
        let delay = |rho: f64| 1_000.0 * (rho / (1.0 - rho.min(0.99))).min(200.0);
        let mut w = Weights::all(Placement::Host);
        let mut host = Vec::new();
        for i in 0..400u64 {
            let mut inp = inputs(
                delay(offered * w.of(Placement::Host)),
                delay(offered * w.of(Placement::Nic)),
            );
            inp.placements[0].available = false;
            w = p.decide(KEY, &h, &inp, i);
            host.push(w.of(Placement::Host));
        }
        let settled = &host[300..];
        for &x in settled {
            // Both below their capacity: each carries between a third and two thirds.
            assert!((0.34..0.66).contains(&x), "host share {x} of {settled:?}");
        }
    }

    /// A handler that runs faster at the NIC is still dearer there when the NIC's receive
    /// loop spends more on each message than the host's: the price is what the message
    /// costs where it runs, not the handler's part alone.
    #[test]
    fn a_placement_is_priced_with_its_loops_work() {
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let h = HandlerLoad {
            service_ns: [None, Some(800.0), Some(1_000.0)],
            ..handler()
        };
        let mut inp = inputs(0.0, 0.0);
        inp.placements[0].available = false;
        let ect = p.completion_times(&h, &inp);
        assert!(ect[Placement::Nic.index()] < ect[Placement::Host.index()]);
        inp.placements[Placement::Host.index()].loop_ns = 1_500.0;
        inp.placements[Placement::Nic.index()].loop_ns = 2_300.0;
        let ect = p.completion_times(&h, &inp);
        assert_eq!(ect[Placement::Nic.index()], Some(3_100.0));
        assert_eq!(ect[Placement::Host.index()], Some(2_500.0));
        assert_eq!(p.decide(KEY, &h, &inp, 0).major(), Placement::Host);
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

    /// An unmeasured server placement is guessed from the server's measurements, not from
    /// the client's: a client reporting 1 ns runs made the never-probed NIC a 1.5 ns guess,
    /// cheaper than the client that reported them, and kept the client at its probe share.
    #[test]
    fn a_client_s_figure_does_not_price_an_unmeasured_server_placement() {
        let mut h = handler();
        h.service_ns = [Some(1.0), None, Some(200.0)];
        let mut i = inputs(0.0, 0.0);
        i.client_rtt_ns = 1.0;
        let mut p = CostPolicy::new(CostPolicyConfig::default());
        let ect = p.completion_times(&h, &i);
        assert_eq!(ect[Placement::Nic.index()], Some(300.0));
        assert_eq!(ect[Placement::Client.index()], Some(1.0 + h.steps.max(1.0)));
        for t in 0..3 {
            p.decide(KEY, &h, &i, t);
        }
        assert_eq!(p.decide(KEY, &h, &i, 3).major(), Placement::Client);
        // Measured only at the client: the guess still has a basis.
        h.service_ns = [Some(100.0), None, None];
        assert_eq!(
            p.completion_times(&h, &i)[Placement::Host.index()],
            Some(150.0)
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
        // 100 K msg/s: 200 probes/s is a 0.2% share; 2 M msg/s (one process, two client
        // threads): 0.01%, still 200 probes/s.
        assert!((share(100_000.0) - 0.002).abs() < 1e-12);
        assert!((share(2_000_000.0) - 0.0001).abs() < 1e-12);
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
