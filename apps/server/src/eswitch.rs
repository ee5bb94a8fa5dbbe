//! The XDP eSwitch on the server's interface: the embedded `smartnic/eswitch-xdp` program
//! (built with the handler pipeline when naam-server is built), loaded and attached with aya, and keeps its steering map in line with the
//! steering controller's weights. Without the privilege to attach XDP, naam-server runs its
//! user-space switch instead and says so.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aya::maps::{Array, HashMap as BpfHashMap, PerCpuArray};
use aya::programs::{Xdp, XdpMode};
use naam_ebpf::eswitch as abi;
use naam_runtime::cluster::Cluster;
use naam_runtime::proto::control::SwitchCounters;
use naam_runtime::proto::endpoint::SwitchHandle;

/// Why the eSwitch could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EswitchError {
    /// The kernel refused the program or the attachment.
    #[error("{0}")]
    Kernel(String),
}

#[derive(Clone, Copy)]
#[repr(transparent)]
struct PodConfig(abi::Config);
// SAFETY: a repr(C) struct of plain integers, no padding (u16, u16, u32).
unsafe impl aya::Pod for PodConfig {}

struct Maps {
    steer: BpfHashMap<aya::maps::MapData, u64, u32>,
    counters: PerCpuArray<aya::maps::MapData, u64>,
    installed: HashMap<u64, u32>,
    /// The cluster's [`Cluster::eswitch_epoch`] and the pin at the last sync: while both
    /// stay, a sync writes only the handlers whose weights changed.
    synced: Option<((u64, bool, u64), Option<u32>)>,
    /// Entries the map refused (full: it holds [`abi::STEER_ENTRIES`]; or out of memory),
    /// with the share each should have: tried again, [`RETRIES_PER_SYNC`] a sync, until the
    /// map takes them. Logged once.
    retry: HashMap<u64, u32>,
    warned: bool,
}

/// Refused entries a sync tries again at most: a full map costs a few system calls a
/// millisecond, not one per handler past its size.
const RETRIES_PER_SYNC: usize = 64;

impl Maps {
    /// Writes `key`'s share unless the map holds it already; a refusal is kept for retry.
    fn write(&mut self, key: u64, share: u32) {
        if self.installed.get(&key) == Some(&share) {
            self.retry.remove(&key);
            return;
        }
        match self.steer.insert(key, share, 0) {
            Ok(()) => {
                self.installed.insert(key, share);
                self.retry.remove(&key);
            }
            Err(e) => {
                if !self.warned {
                    self.warned = true;
                    tracing::warn!(
                        "the XDP eSwitch's steering map refused an entry ({e}): it holds {} \
                         read handlers; until it takes them, reads of the refused ones follow \
                         their old entry, or the host if they have none",
                        abi::STEER_ENTRIES
                    );
                }
                self.retry.insert(key, share);
            }
        }
    }
}

/// An attached XDP eSwitch.
pub struct Eswitch {
    interface: String,
    mode: &'static str,
    maps: Mutex<Maps>,
    pinned: Mutex<Option<u32>>,
    // Detaches the program when dropped.
    _ebpf: Mutex<aya::Ebpf>,
}

fn kernel(what: &str) -> impl Fn(&dyn std::fmt::Display) -> EswitchError + '_ {
    move |e| EswitchError::Kernel(format!("{what}: {e}"))
}

/// The XDP program (`smartnic/eswitch-xdp`), built to eBPF with this crate (build.rs) and carried
/// by the binary; the kernel verifies it when [`Eswitch::attach`] loads it.
pub const OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/naam-eswitch.o"));

impl Eswitch {
    /// Loads `object` and attaches it to `interface`: NAAM requests to `server_port` may be
    /// steered to `nic_port`.
    pub fn attach(
        object: &[u8],
        interface: &str,
        server_port: u16,
        nic_port: u16,
    ) -> Result<Eswitch, EswitchError> {
        let mut ebpf = aya::Ebpf::load(object).map_err(|e| kernel("loading the object")(&e))?;
        let prog: &mut Xdp = ebpf
            .program_mut(abi::PROGRAM)
            .ok_or_else(|| EswitchError::Kernel(format!("no program {}", abi::PROGRAM)))?
            .try_into()
            .map_err(|e| kernel("not an XDP program")(&e))?;
        prog.load().map_err(|e| kernel("the kernel verifier")(&e))?;
        // Native XDP when the driver has it (veth does), generic otherwise.
        let mode = match prog.attach(interface, XdpMode::Driver) {
            Ok(_) => "native",
            Err(_) => {
                prog.attach(interface, XdpMode::Skb)
                    .map_err(|e| kernel(&format!("attaching to {interface}"))(&e))?;
                "generic"
            }
        };
        let mut config: Array<_, PodConfig> = Array::try_from(
            ebpf.map_mut(abi::CONFIG_MAP)
                .ok_or_else(|| EswitchError::Kernel("no config map".into()))?,
        )
        .map_err(|e| kernel("config map")(&e))?;
        config
            .set(
                0,
                PodConfig(abi::Config {
                    server_port,
                    nic_port,
                    enabled: 1,
                }),
                0,
            )
            .map_err(|e| kernel("writing the config")(&e))?;
        let steer = BpfHashMap::try_from(
            ebpf.take_map(abi::STEER_MAP)
                .ok_or_else(|| EswitchError::Kernel("no steering map".into()))?,
        )
        .map_err(|e| kernel("steering map")(&e))?;
        let counters = PerCpuArray::try_from(
            ebpf.take_map(abi::COUNTERS_MAP)
                .ok_or_else(|| EswitchError::Kernel("no counters map".into()))?,
        )
        .map_err(|e| kernel("counters map")(&e))?;
        Ok(Eswitch {
            interface: interface.to_string(),
            mode,
            maps: Mutex::new(Maps {
                steer,
                counters,
                installed: HashMap::new(),
                synced: None,
                retry: HashMap::new(),
                warned: false,
            }),
            pinned: Mutex::new(None),
            _ebpf: Mutex::new(ebpf),
        })
    }

    /// Writes the NIC share of every read handler from the controller's weights (0 when the
    /// NIC is down); an operator pin overrides the weights but never a dead NIC.
    ///
    /// Each sync costs what changed: every share only when the registry, the NIC's state or
    /// the pin moved (or too many weights changed to list), else the handlers whose weights
    /// the steering changed. (It walked every app each millisecond before: at 10,000 apps
    /// that kept a core busy on an idle server.)
    pub fn sync(&self, cluster: &Cluster) {
        let pinned = *self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let state = (cluster.eswitch_epoch(), pinned);
        let changed = cluster.take_weight_changes();
        let shares = match changed {
            Some(keys) if maps.synced == Some(state) => {
                if keys.is_empty() && maps.retry.is_empty() {
                    return;
                }
                cluster.eswitch_shares_of(&keys, pinned)
            }
            _ => cluster.eswitch_shares(pinned),
        };
        maps.synced = Some(state);
        for (key, share) in shares {
            maps.write(key, share);
        }
        // After the fresh shares, so that each retry carries its handler's latest share.
        let retries: Vec<(u64, u32)> = maps
            .retry
            .iter()
            .take(RETRIES_PER_SYNC)
            .map(|(k, v)| (*k, *v))
            .collect();
        for (key, share) in retries {
            maps.write(key, share);
        }
    }

    /// Keeps the map in line with `cluster` every `period` until `stop`.
    pub fn run_sync(self: Arc<Self>, cluster: Arc<Cluster>, period: Duration, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            self.sync(&cluster);
            std::thread::sleep(period);
        }
    }
}

impl SwitchHandle for Eswitch {
    fn describe(&self) -> String {
        format!("XDP eSwitch ({} mode) on {}", self.mode, self.interface)
    }

    fn counters(&self) -> Result<SwitchCounters, String> {
        let maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        let sum = |i: u32| -> Result<u64, String> {
            Ok(maps
                .counters
                .get(&i, 0)
                .map_err(|e| e.to_string())?
                .iter()
                .sum())
        };
        Ok(SwitchCounters {
            host: sum(abi::COUNTER_HOST)?,
            nic: sum(abi::COUNTER_NIC)?,
            fragmented: sum(abi::COUNTER_FRAGMENTED)?,
        })
    }

    fn pin_nic_share(&self, permille: Option<u32>) {
        *self.pinned.lock().unwrap_or_else(|e| e.into_inner()) = permille;
    }
}
