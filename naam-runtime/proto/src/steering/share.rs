//! A remote client's own view of the Client placement ([`ClientShare`]).

use super::{
    CostPolicy, CostPolicyConfig, Ewma, HandlerKey, HandlerLoad, LoadTracker, Policy, RemoteLoad,
    SteeringInputs, Weights,
};
use crate::Nanos;
use crate::Placement;

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
