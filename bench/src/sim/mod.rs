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

use std::sync::Mutex;

use naam_runtime::cluster::{RunFacts, ServiceModel};
use naam_runtime::proto::step::InsnMix;
use naam_runtime::proto::{Nanos, Placement};
use naam_runtime::{Clock, VirtualClock};

/// A unit of hardware that serves one operation after another at a rate (a card's DMA
/// engine, its RDMA engine): an operation waits while the engine is busy with earlier ones.
/// Its latency overlaps the next operations' (the engine is pipelined); only its occupancy
/// queues.
#[derive(Clone, Debug)]
pub(crate) struct EngineQueue {
    /// Occupancy of one operation, nanoseconds (`1 / rate`); 0: no limit.
    per_op_ns: f64,
    /// When the engine is next free.
    free_at: f64,
}

impl EngineQueue {
    /// An engine of `per_second` operations (0: unlimited).
    pub(crate) fn new(per_second: f64) -> EngineQueue {
        EngineQueue {
            per_op_ns: if per_second > 0.0 {
                1e9 / per_second
            } else {
                0.0
            },
            free_at: 0.0,
        }
    }

    /// `ops` operations arriving at `at`, holding the engine `extra_ns` beyond their rate's
    /// occupancy: how long they wait for it.
    pub(crate) fn take(&mut self, at: Nanos, ops: u64, extra_ns: f64) -> Nanos {
        if self.per_op_ns == 0.0 || ops == 0 {
            return 0;
        }
        let start = self.free_at.max(at as f64);
        self.free_at = start + ops as f64 * self.per_op_ns + extra_ns;
        (start - at as f64).round() as Nanos
    }
}

/// Nanoseconds of the instructions `insns` (of which `mix` are memory accesses and helper
/// calls) at a processor's costs.
fn insn_ns(insns: u64, mix: InsnMix, (alu, memory, helper): (f64, f64, f64)) -> f64 {
    let rest = insns.saturating_sub(mix.memory);
    rest as f64 * alu + mix.memory as f64 * memory + mix.helpers as f64 * helper
}

/// Bytes a DMA read moves within its rate's figure (smartnic-bench gives the rate for reads
/// of 16-256 B; a larger read holds the engine for its bytes beyond).
const DMA_RATED_BYTES: u64 = 256;

/// One server's costs, as its clusters ask for them: what one message kept a core of its
/// placement busy, from what its handler did there. The server's DMA engine is shared by its
/// Arm cores: a message's DMA reads wait while it serves others (the simulation's clock says
/// when each asks).
#[derive(Debug)]
pub struct CostModel {
    host: profile::HostProfile,
    nic: profile::NicProfile,
    clock: std::sync::Arc<VirtualClock>,
    dma: Mutex<EngineQueue>,
}

impl CostModel {
    /// The costs of `profile` on `clock` (the simulation's).
    pub fn new(profile: &Profile, clock: std::sync::Arc<VirtualClock>) -> CostModel {
        CostModel {
            host: profile.host.clone(),
            nic: profile.nic.clone(),
            clock,
            dma: Mutex::new(EngineQueue::new(profile.nic.dma_reads_per_s)),
        }
    }

    /// How long a NIC message's `fetches` DMA reads, which move their bytes in `transfer_ns`
    /// (the modelled fetch time beyond each read's latency), wait for the engine now.
    fn dma_wait(&self, fetches: u64, transfer_ns: u64) -> Nanos {
        let rated = (fetches * DMA_RATED_BYTES) as f64 * self.nic.dma_ps_per_byte as f64 / 1e3;
        let beyond = (transfer_ns as f64 - rated).max(0.0);
        let mut dma = self.dma.lock().unwrap_or_else(|e| e.into_inner());
        dma.take(self.clock.now(), fetches, beyond)
    }
}

impl ServiceModel for CostModel {
    fn service_ns(&self, placement: Placement, run: &RunFacts) -> Nanos {
        let bytes = (run.args_bytes + run.reply_bytes) as f64;
        let ns = match placement {
            Placement::Nic => {
                let n = &self.nic;
                let fetches = run.runs as u64;
                let transfer = run.fetch_ns.saturating_sub(fetches * n.dma_access_ns);
                insn_ns(
                    run.insns,
                    run.mix,
                    (n.ns_per_insn, n.ns_per_memory_insn, n.ns_per_helper),
                ) + bytes * n.ps_per_byte as f64 / 1_000.0
                    + run.fetch_ns as f64
                    + self.dma_wait(fetches, transfer) as f64
            }
            _ => {
                let h = &self.host;
                insn_ns(
                    run.insns,
                    run.mix,
                    (h.ns_per_insn, h.ns_per_memory_insn, h.ns_per_helper),
                ) + bytes * h.ps_per_byte as f64 / 1_000.0
                    + run.runs as f64 * h.access_ns as f64
                    + run.fetch_ns as f64
            }
        };
        ns.round() as Nanos
    }
}

/// Nanoseconds of a client's processor for a handler it ran itself (the Client placement).
pub(crate) fn client_insn_ns(c: &profile::ClientProfile, insns: u64, mix: InsnMix) -> Nanos {
    insn_ns(
        insns,
        mix,
        (c.ns_per_insn, c.ns_per_memory_insn, c.ns_per_helper),
    )
    .round() as Nanos
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        let clock = std::sync::Arc::new(VirtualClock::new(0));
        CostModel::new(&Profile::load("bluefield2-100g").unwrap(), clock)
    }

    #[test]
    fn the_nic_costs_what_the_profile_says_more_than_the_host() {
        let m = model();
        let run = RunFacts {
            insns: 1_000,
            mix: InsnMix {
                memory: 200,
                helpers: 2,
            },
            runs: 2,
            steps: 2,
            fetch_ns: 0,
            args_bytes: 24,
            reply_bytes: 1_000,
        };
        let host = m.service_ns(Placement::Host, &run);
        // 800 x 0.5 + 200 x 0.5 + 2 x 10 + 1,024 x 0.1 + 2 x 90 = 802 ns.
        assert_eq!(host, 802);
        let nic = m.service_ns(
            Placement::Nic,
            &RunFacts {
                fetch_ns: 2_000 + 2 * 100 * 67 / 1_000,
                ..run
            },
        );
        // 800 x 0.775 + 200 x 0.88 + 2 x 15.5 + 1,024 x 0.155 + the fetches' 2,013; the
        // engine was idle.
        assert_eq!(nic, 620 + 176 + 31 + 159 + 2_013);
    }

    #[test]
    fn dma_reads_queue_for_the_cards_engine() {
        let m = model();
        let run = RunFacts {
            insns: 100,
            runs: 1,
            steps: 1,
            fetch_ns: 1_000,
            ..RunFacts::default()
        };
        let alone = m.service_ns(Placement::Nic, &run);
        // At the same instant a second core's read waits for the first's 1 / 10.5 M s.
        let queued = m.service_ns(Placement::Nic, &run);
        assert_eq!(queued - alone, 95);
        // A large read holds the engine for its bytes beyond 256: 1 KB is 6.9 M reads/s.
        let m = model();
        let big = RunFacts {
            fetch_ns: 1_000 + 1_024 * 67 / 1_000,
            ..run
        };
        m.service_ns(Placement::Nic, &big);
        let after = m.service_ns(Placement::Nic, &run) - alone;
        assert_eq!(after, 95 + (1_024 - 256) * 67 / 1_000);
    }

    #[test]
    fn an_unlimited_engine_never_queues() {
        let mut e = EngineQueue::new(0.0);
        assert_eq!(e.take(10, 5, 1_000.0), 0);
        let mut e = EngineQueue::new(1e9);
        assert_eq!(e.take(0, 3, 0.0), 0);
        assert_eq!(e.take(0, 1, 0.0), 3);
        assert_eq!(e.take(100, 1, 0.0), 0);
    }
}
