//! In-process cluster round trips: one client thread, a trivial handler (`add`) on the JIT,
//! pinned to each placement. Mode: inproc (NIC and one-sided RDMA emulated).
//!
//! Run: `cargo bench -p naam-runtime --bench cluster`.

use std::path::Path;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use naam_pipeline::BuildOptions;
use naam_proto::handler_id;
use naam_proto::Placement;
use naam_runtime::cluster::{AppSpec, Cluster, ClusterConfig, NicModel, RegionSpec};
use naam_runtime::pipeline::build;
use naam_runtime::HandlerSpec;
use naam_vm::load;

fn bench(c: &mut Criterion) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("handlers");
    let mut opts = BuildOptions::new(repo.join("examples/handlers"));
    opts.target_dir = Some(dir.clone());
    opts.out = Some(dir.join("bench-cluster.o"));
    let object = load(
        &std::fs::read(
            build(&opts)
                .expect("build handlers (scripts/setup.sh)")
                .object,
        )
        .unwrap(),
    )
    .unwrap();
    let mut config = ClusterConfig::default();
    config.nic = {
        let mut nic = NicModel::default();
        nic.emulate_costs = true;
        nic
    };
    let cluster = Cluster::builder()
        .config(config)
        .app(AppSpec {
            id: 1,
            name: "bench".into(),
            owner: Placement::Host,
            regions: vec![RegionSpec {
                name: "r".into(),
                access: naam_runtime::READ_ONLY,
                contents: vec![0; 64],
            }],
            object: Arc::new(object),
            handlers: vec![HandlerSpec::read("add")],
        })
        .build()
        .unwrap();
    let args: Vec<u8> = [5u64, 7].iter().flat_map(|w| w.to_le_bytes()).collect();
    let add = handler_id("add");
    let mut g = c.benchmark_group("inproc_round_trip_add_jit");
    for p in Placement::ALL {
        let mut client = cluster.client();
        g.bench_function(p.name(), |b| {
            b.iter(|| client.call_at(p, 1, add, &args, &[]).unwrap())
        });
    }
    g.finish();
    // Median from the cluster's own histogram, per placement, for RESULTS.md.
    let snap = cluster.metrics().snapshot();
    for p in Placement::ALL {
        let q = snap.placement[p.index()];
        println!(
            "hdr {p}: p50 {} ns, p99 {} ns over {} calls",
            q.p50, q.p99, q.count
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
