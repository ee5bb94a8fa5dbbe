//! `naam-bench sim`: a discrete-event simulation, in virtual time, of clients, a rack's links and
//! switch, a server's host cores and its SmartNIC's Arm cores, driving the code the deployment
//! runs: naam-proto's `ClientEndpoint`, `ServerEndpoint` and `NicEndpoint` exchanging their real
//! (sealed) messages, the server's switch and steering `Controller` (naam-runtime's cluster, on
//! the simulation's clock), the `StepMachine` and data paths, and MICA's real handlers executed
//! by naam-vm. Nothing of the protocol or of the steering is written again here: this module
//! only decides *when* things happen.
//!
//! Time: one virtual clock ([`naam_runtime::VirtualClock`]) that moves from event to event and
//! never while a handler runs. A core that takes in a message is busy for what the message cost
//! there: the profile's per-message cost plus the handler's service time, which the cluster
//! asks of the [`CostModel`] from what the handler actually executed (instructions, steps,
//! bytes, modelled DMA). Every random draw (nonces, session ids, keys, loss, the workload)
//! comes from one seed, so a run is a function of its configuration and seed: the same JSON,
//! byte for byte.
//!
//! Figures from here are model outputs for the hardware a [`Profile`] describes, labelled
//! `sim:<profile>`; they are not measurements.

mod apps;
mod backends;
pub mod calibrate;
pub mod experiments;
pub mod net;
pub mod profile;
mod world;

pub use profile::Profile;
pub use world::{run, Bucket, Congestion, Latency, SimConfig, SimReport};

use naam_runtime::cluster::{RunFacts, ServiceModel};
use naam_runtime::proto::{Nanos, Placement};

/// The profile's costs, as the cluster asks for them: what one message kept a core of its
/// placement busy, from what its handler did there.
#[derive(Clone, Debug)]
pub struct CostModel {
    host: profile::HostProfile,
    nic: profile::NicProfile,
}

impl CostModel {
    /// The costs of `profile`.
    pub fn new(profile: &Profile) -> CostModel {
        CostModel {
            host: profile.host.clone(),
            nic: profile.nic.clone(),
        }
    }
}

impl ServiceModel for CostModel {
    fn service_ns(&self, placement: Placement, run: &RunFacts) -> Nanos {
        let bytes = (run.args_bytes + run.reply_bytes) as f64;
        let ns = match placement {
            Placement::Nic => {
                run.insns as f64 * self.nic.ns_per_insn
                    + bytes * self.nic.ps_per_byte as f64 / 1_000.0
                    + run.fetch_ns as f64
            }
            _ => {
                run.insns as f64 * self.host.ns_per_insn
                    + bytes * self.host.ps_per_byte as f64 / 1_000.0
                    + run.runs as f64 * self.host.access_ns as f64
                    + run.fetch_ns as f64
            }
        };
        ns.round() as Nanos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nic_costs_what_the_profile_says_more_than_the_host() {
        let m = CostModel::new(&Profile::load("bluefield2-100g").unwrap());
        let run = RunFacts {
            insns: 1_000,
            runs: 2,
            steps: 2,
            fetch_ns: 0,
            args_bytes: 24,
            reply_bytes: 1_000,
        };
        let host = m.service_ns(Placement::Host, &run);
        let nic = m.service_ns(
            Placement::Nic,
            &RunFacts {
                fetch_ns: 2_000,
                ..run
            },
        );
        // 1,000 x 0.5 + 1,024 x 0.1 + 2 x 90 = 782 ns; 1,000 x 0.775 + 1,024 x 0.155 + 2,000.
        assert_eq!(host, 782);
        assert_eq!(nic, 2_934);
    }
}
