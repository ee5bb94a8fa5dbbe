//! What several test files share.

use naam_bench::driver::{App, PlacementChoice, YcsbConfig};
use naam_bench::ycsb::{RecordShape, Workload};

/// A small run of core workload `w` on `fabric`: 300 records of four 16-byte fields, 1,500
/// operations by two client threads, one host and one NIC executor, seed 7.
pub(crate) fn small_run(app: App, w: char, placement: PlacementChoice, fabric: &str) -> YcsbConfig {
    YcsbConfig {
        app,
        workload: Workload::core(w).unwrap(),
        records: 300,
        ops: 1500,
        threads: 2,
        pipeline: 1,
        placement,
        shape: RecordShape {
            field_count: 4,
            field_length: 16,
        },
        seed: 7,
        executors: (1, 1),
        fabric: fabric.into(),
        server: None,
        shards: Vec::new(),
        run: Default::default(),
    }
}
