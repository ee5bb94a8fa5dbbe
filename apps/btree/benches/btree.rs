//! B-tree lookups and inserts: the native reference, the NAAM execution path at Host without a
//! fabric (step machine + Host data path + JIT, in the caller's thread), and in-process lookups
//! pinned to each placement (mode inproc; NIC and one-sided RDMA emulated). 100,000 keys in
//! 1 KiB nodes (a three-level tree).
//!
//! Run: `cargo bench -p naam-btree --bench btree`.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use naam_btree::reference::NativeBTree;
use naam_btree::{app_spec, handlers, BTreeClient, BTreeConfig, BTreeHandle};
use naam_proto::Placement;
use naam_runtime::cluster::{Cluster, ClusterConfig};
use naam_runtime::{Direct, Pinned};

const KEYS: u64 = 100_000;

fn bench(c: &mut Criterion) {
    let object = Arc::new(handlers().expect("loading the embedded handler object"));
    let config = BTreeConfig::for_keys(KEYS * 2);
    let key = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 1;

    let mut native = NativeBTree::new(config);
    let spec = app_spec(1, &config, object, Placement::Host).unwrap();
    let direct = Direct::new(std::slice::from_ref(&spec)).unwrap();
    let handle = BTreeHandle::with_keys(1, config, |n| direct.region_key(1, n)).unwrap();
    let mut naam = BTreeClient::new(direct, handle);
    let cluster = Cluster::builder()
        .config(ClusterConfig::default())
        .app(spec)
        .build()
        .unwrap();
    let ch = BTreeHandle::from_cluster(&cluster, 1, config).unwrap();
    let mut loader = BTreeClient::new(cluster.client(), ch);
    for i in 0..KEYS {
        native.insert(key(i), i);
        naam.insert(key(i), i).unwrap();
        loader.insert(key(i), i).unwrap();
    }
    println!(
        "tree: {} levels, {} nodes",
        native.height(),
        native.nodes_used()
    );
    naam.refresh_root().unwrap();

    let mut g = c.benchmark_group("btree_lookup_1k_nodes");
    let mut i = 0u64;
    g.bench_function("native", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            native.get(key(i)).unwrap()
        })
    });
    g.bench_function("naam_host_direct_jit", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            naam.get(key(i)).unwrap().unwrap()
        })
    });
    for p in Placement::ALL {
        let mut t = BTreeClient::new(
            Pinned {
                client: cluster.client(),
                placement: p,
            },
            ch,
        );
        t.refresh_root().unwrap();
        g.bench_function(format!("inproc_{p}"), |b| {
            b.iter(|| {
                i = (i + 7919) % KEYS;
                t.get(key(i)).unwrap().unwrap()
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("btree_update_1k_nodes");
    g.bench_function("native", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            native.update(key(i), i + 1)
        })
    });
    g.bench_function("naam_host_direct_jit", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            naam.update(key(i), i + 1).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
