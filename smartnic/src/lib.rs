//! # naam-smartnic
//!
//! The SmartNIC side of a NAAM deployment: `naam-nic` runs the NIC executors and the one-sided
//! agent. On a BlueField-2 it runs on the DPU's Arm cores; here it is a process on the same
//! machine that maps the host's regions through shared memory and models the Arm cores and the
//! PCIe DMA with [`NicModel`] (see `smartnic/README.md` for the model and what is emulated).
#![deny(missing_docs)]

use naam_runtime::cluster::NicModel;
use naam_runtime::executor::DmaModel;

/// The emulation model of BlueField-2 Arm A72 cores and their DMA to host memory.
///
/// - Cores: 8 Arm Cortex-A72 at 2.0–2.75 GHz. A handler runs about 2× slower than on a
///   server x86 core (lower clock, narrower core, the interpreter instead of the x86 JIT):
///   `core_slowdown` = 2.0, applied by busy-waiting the extra time after each message.
/// - DMA: every fetch of host memory is one PCIe round trip, about 1 µs for a small read
///   across PCIe Gen4, plus ~10 GB/s per engine (100 ps per byte).
///
/// These are published-figure models, not measurements: nothing here ran on a BlueField-2.
pub fn bluefield2_model(core_slowdown: f64, dma_access_ns: u64, emulate: bool) -> NicModel {
    NicModel {
        dma: DmaModel {
            access_ns: dma_access_ns,
            ps_per_byte: 100,
        },
        core_slowdown,
        emulate_costs: emulate,
    }
}
