//! Hardware profiles: the constants a simulation runs with (links, switch, host cores, the
//! SmartNIC's Arm cores and DMA, clients, steering periods), read from TOML. The profiles this
//! project ships live in `bench/profiles/`, each constant with its source; a user writes one
//! for their own hardware (README, "Simulating your hardware").

use serde::{Deserialize, Serialize};

/// The profiles shipped with naam-bench, by name.
const BUILT_IN: &[(&str, &str)] = &[(
    "bluefield2-100g",
    include_str!("../../profiles/bluefield2-100g.toml"),
)];

/// Why a profile could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// Neither a built-in name nor a readable file.
    #[error("no profile {name:?}: built in are {known}; or give a TOML file's path")]
    Unknown {
        /// What was asked for.
        name: String,
        /// The built-in names.
        known: String,
    },
    /// The file could not be read.
    #[error("reading profile {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML does not describe a profile.
    #[error("profile {path}: {message}")]
    Invalid {
        /// The file (or built-in name).
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// Every link of the rack (each node has one, full duplex, to the switch).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LinkProfile {
    /// Gigabits per second each way.
    pub bandwidth_gbps: f64,
    /// One way, cable and PHYs, nanoseconds.
    pub propagation_ns: u64,
    /// Largest Ethernet payload (IP packet), bytes.
    pub mtu: usize,
    /// Probability that a frame is lost, each way.
    pub loss: f64,
}

/// The top-of-rack switch.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SwitchProfile {
    /// Port to port, nanoseconds (beyond the frames' serialisation on the links).
    pub latency_ns: u64,
}

/// The server's host cores.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostProfile {
    /// Cores serving receive loops (one loop each, run to completion).
    pub cores: usize,
    /// Nanoseconds per eBPF instruction a handler executes (ALU operations and jumps).
    pub ns_per_insn: f64,
    /// Nanoseconds per load, store or atomic instruction.
    pub ns_per_memory_insn: f64,
    /// Nanoseconds per helper call beyond its instruction (the helper's own work).
    pub ns_per_helper: f64,
    /// Nanoseconds per message beyond its handler (receive, open, decode, dispatch, seal, send).
    pub per_message_ns: u64,
    /// Picoseconds per byte of arguments and reply copied.
    pub ps_per_byte: u64,
    /// Nanoseconds per segment a step reads from memory.
    pub access_ns: u64,
    /// Messages each core's receive ring holds; more are dropped.
    pub rx_ring: usize,
    /// How long an idle core (or client) polls before it sleeps, nanoseconds (naam's loops
    /// poll a moment after their last message, yielding the processor to others with work).
    pub spin_ns: u64,
    /// What a sleeping core (or client) takes to wake when a message comes, nanoseconds.
    pub wakeup_ns: u64,
}

/// The SmartNIC's Arm cores and their DMA to host memory.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NicProfile {
    /// Arm cores serving naam-nic's receive loops.
    pub cores: usize,
    /// Nanoseconds per eBPF instruction (ALU operations and jumps).
    pub ns_per_insn: f64,
    /// Nanoseconds per load, store or atomic instruction.
    pub ns_per_memory_insn: f64,
    /// Nanoseconds per helper call beyond its instruction.
    pub ns_per_helper: f64,
    /// Nanoseconds per message beyond its handler.
    pub per_message_ns: u64,
    /// Picoseconds per byte of arguments and reply copied.
    pub ps_per_byte: u64,
    /// Picoseconds per byte a DMA read moves.
    pub dma_ps_per_byte: u64,
    /// Nanoseconds a DMA read takes before its first byte (PCIe round trip).
    pub dma_access_ns: u64,
    /// DMA reads of up to 256 bytes the card's DMA engine completes per second, shared by
    /// every Arm core (an Arm core's read waits while the engine is busy); 0: no shared
    /// engine (each core's DMA is its own, as the emulation's on this machine).
    pub dma_reads_per_s: f64,
    /// Nanoseconds the card's RDMA engine takes to answer a client's one-sided READ once the
    /// request is in: reading host memory across PCIe (the Client placement's data path).
    pub rdma_read_ns: u64,
    /// One-sided READs the card answers per second; 0: no limit.
    pub rdma_reads_per_s: f64,
    /// The card's eSwitch steers requests to the Arm cores by the steering weights before
    /// the host's loops see them (naam's XDP eSwitch, or the card's flow rules); `false`:
    /// every request reaches the host's loops, which forward the NIC's share (naam-server's
    /// user-space switch).
    pub eswitch: bool,
    /// Nanoseconds a message between the host's cores and the Arm cores takes (through the
    /// eSwitch and PCIe, never the rack's links).
    pub host_hop_ns: u64,
    /// Messages each core's receive ring holds; more are dropped.
    pub rx_ring: usize,
    /// How long an idle core (or client) polls before it sleeps, nanoseconds (naam's loops
    /// poll a moment after their last message, yielding the processor to others with work).
    pub spin_ns: u64,
    /// What a sleeping core (or client) takes to wake when a message comes, nanoseconds.
    pub wakeup_ns: u64,
}

/// The clients' machines.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientProfile {
    /// Nanoseconds per message a client sends or takes in.
    pub per_message_ns: u64,
    /// Nanoseconds per eBPF instruction of a handler the client runs itself (the Client
    /// placement), ALU operations and jumps.
    pub ns_per_insn: f64,
    /// Nanoseconds per load, store or atomic instruction there.
    pub ns_per_memory_insn: f64,
    /// Nanoseconds per helper call there, beyond its instruction.
    pub ns_per_helper: f64,
    /// Nanoseconds of the client's processor per one-sided READ: posting the request and
    /// taking in its completion.
    pub read_post_ns: u64,
    /// How long an idle core (or client) polls before it sleeps, nanoseconds (naam's loops
    /// poll a moment after their last message, yielding the processor to others with work).
    pub spin_ns: u64,
    /// What a sleeping core (or client) takes to wake when a message comes, nanoseconds.
    pub wakeup_ns: u64,
}

/// Steering and reporting periods.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SteeringProfile {
    /// The controller's period, nanoseconds.
    pub period_ns: u64,
    /// How often the NIC reports its load, nanoseconds.
    pub report_every_ns: u64,
}

/// Where the roles run when they share one machine's processors.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MachineProfile {
    /// `Some(n)`: the clients, the host's loops and the NIC's loops all run on one machine's
    /// `n` processors (this-machine: naam-server, naam-nic and the YCSB client on one VM), each
    /// piece of work waiting for a free one; `None`: every core is its own (the rack).
    pub shared_cpus: Option<usize>,
    /// With shared processors, what a polling thread takes to give its processor to one with
    /// work: one poll (a receive that finds nothing) and a `sched_yield`, nanoseconds. A
    /// poller holds its processor until then.
    #[serde(default)]
    pub yield_ns: u64,
}

/// A whole profile.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Its name (reports carry it).
    pub name: String,
    /// What hardware it describes.
    pub description: String,
    /// The links.
    pub link: LinkProfile,
    /// The switch.
    pub switch: SwitchProfile,
    /// The host cores.
    pub host: HostProfile,
    /// The SmartNIC.
    pub nic: NicProfile,
    /// The clients.
    pub client: ClientProfile,
    /// Steering.
    pub steering: SteeringProfile,
    /// Shared processors (none in a rack).
    #[serde(default)]
    pub machine: MachineProfile,
}

impl Profile {
    /// A built-in profile by name, or a TOML file by path.
    pub fn load(name_or_path: &str) -> Result<Profile, ProfileError> {
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name_or_path) {
            return Profile::parse(text, name_or_path);
        }
        let path = std::path::Path::new(name_or_path);
        if !path.is_file() {
            return Err(ProfileError::Unknown {
                name: name_or_path.into(),
                known: BUILT_IN
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: name_or_path.into(),
            source,
        })?;
        Profile::parse(&text, name_or_path)
    }

    /// Parses and checks a profile's TOML text (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<Profile, ProfileError> {
        let invalid = |message: String| ProfileError::Invalid {
            path: origin.into(),
            message,
        };
        let p: Profile = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let positive = [
            ("link.bandwidth_gbps", p.link.bandwidth_gbps),
            ("host.ns_per_insn", p.host.ns_per_insn),
            ("nic.ns_per_insn", p.nic.ns_per_insn),
            ("client.ns_per_insn", p.client.ns_per_insn),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(format!(
                    "{name} must be a positive number, not {v}"
                )));
            }
        }
        let not_negative = [
            ("host.ns_per_memory_insn", p.host.ns_per_memory_insn),
            ("host.ns_per_helper", p.host.ns_per_helper),
            ("nic.ns_per_memory_insn", p.nic.ns_per_memory_insn),
            ("nic.ns_per_helper", p.nic.ns_per_helper),
            ("nic.dma_reads_per_s", p.nic.dma_reads_per_s),
            ("nic.rdma_reads_per_s", p.nic.rdma_reads_per_s),
            ("client.ns_per_memory_insn", p.client.ns_per_memory_insn),
            ("client.ns_per_helper", p.client.ns_per_helper),
        ];
        for (name, v) in not_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(format!(
                    "{name} must be a number of at least 0, not {v}"
                )));
            }
        }
        if !(0.0..1.0).contains(&p.link.loss) {
            return Err(invalid(format!(
                "link.loss must be in [0, 1), not {}",
                p.link.loss
            )));
        }
        if p.link.mtu < 576 || p.link.mtu > 65_535 {
            return Err(invalid(format!(
                "link.mtu must be 576..=65535, not {}",
                p.link.mtu
            )));
        }
        for (name, n) in [
            ("host.rx_ring", p.host.rx_ring),
            ("nic.rx_ring", p.nic.rx_ring),
        ] {
            if n == 0 {
                return Err(invalid(format!("{name} must be at least 1")));
            }
        }
        for (name, n) in [("host.cores", p.host.cores), ("nic.cores", p.nic.cores)] {
            if n == 0 || n > naam_runtime::proto::limits::MAX_LOOPS {
                return Err(invalid(format!(
                    "{name} must be 1..={}, not {n}",
                    naam_runtime::proto::limits::MAX_LOOPS
                )));
            }
        }
        if p.machine.shared_cpus == Some(0) {
            return Err(invalid("machine.shared_cpus must be at least 1".into()));
        }
        if p.steering.period_ns == 0 || p.steering.report_every_ns == 0 {
            return Err(invalid("steering periods must be above 0".into()));
        }
        Ok(p)
    }

    /// The built-in profiles' names.
    pub fn built_in() -> impl Iterator<Item = &'static str> {
        BUILT_IN.iter().map(|(n, _)| *n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_profile_parses() {
        for name in Profile::built_in() {
            let p = Profile::load(name).unwrap();
            assert_eq!(p.name, name);
        }
    }

    #[test]
    fn bad_profiles_are_refused_naming_the_field() {
        let good = BUILT_IN[0].1;
        let e = Profile::parse(&good.replace("cores = 8", "cores = 0"), "x").unwrap_err();
        assert!(e.to_string().contains("host.cores"), "{e}");
        let e = Profile::parse(&good.replace("loss = 0.0", "loss = 1.5"), "x").unwrap_err();
        assert!(e.to_string().contains("link.loss"), "{e}");
        let e = Profile::parse(
            &good.replace("dma_reads_per_s = 10500000.0", "dma_reads_per_s = -1.0"),
            "x",
        )
        .unwrap_err();
        assert!(e.to_string().contains("nic.dma_reads_per_s"), "{e}");
        let e = Profile::parse(&good.replace("eswitch = true", "eswitch = 1"), "x").unwrap_err();
        assert!(e.to_string().contains("eswitch"), "{e}");
        let e = Profile::parse(&format!("{good}\nsurprise = 1\n"), "x").unwrap_err();
        assert!(e.to_string().contains("surprise"), "{e}");
        let e = Profile::load("no-such-profile").unwrap_err();
        assert!(e.to_string().contains("bluefield2-100g"), "{e}");
    }
}
