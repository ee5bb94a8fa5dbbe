//! MICA GET and PUT: the native reference, the NAAM execution path at Host without a fabric
//! (step machine + Host data path + JIT, in the caller's thread), and in-process round trips
//! pinned to each placement (mode inproc; NIC and one-sided RDMA emulated).
//!
//! Run: `cargo bench -p naam-mica --bench mica`.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use naam_mica::reference::NativeMica;
use naam_mica::{app_spec, handlers, MicaClient, MicaConfig, MicaHandle};
use naam_proto::Placement;
use naam_runtime::cluster::{Cluster, ClusterConfig};
use naam_runtime::{Direct, Pinned};

const KEYS: usize = 10_000;

fn key(i: usize) -> Vec<u8> {
    format!("user{:012}", i).into_bytes()
}

fn bench(c: &mut Criterion) {
    let object = Arc::new(handlers().expect("loading the embedded handler object"));
    let config = MicaConfig::preset_16_64(100_000);
    let value = vec![7u8; 64];
    let keys: Vec<Vec<u8>> = (0..KEYS).map(key).collect();

    let mut native = NativeMica::new(config);
    let spec = app_spec(1, &config, object.clone(), Placement::Host).unwrap();
    let direct = Direct::new(std::slice::from_ref(&spec)).unwrap();
    let handle = MicaHandle::with_keys(1, config, |n| direct.region_key(1, n)).unwrap();
    let mut naam = MicaClient::new(direct, handle);
    let cluster = Cluster::builder()
        .config(ClusterConfig::default())
        .app(spec)
        .build()
        .unwrap();
    let ch = MicaHandle::from_cluster(&cluster, 1, config).unwrap();
    let mut loader = MicaClient::new(cluster.client(), ch);
    for k in &keys {
        native.put(k, &value);
        naam.put(k, &value).unwrap();
        loader.put(k, &value).unwrap();
    }

    let mut g = c.benchmark_group("mica_get_16_64");
    let mut i = 0usize;
    g.bench_function("native", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            native.get(&keys[i]).unwrap()
        })
    });
    g.bench_function("naam_host_direct_jit", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            naam.get(&keys[i]).unwrap().unwrap()
        })
    });
    for p in Placement::ALL {
        let mut m = MicaClient::new(
            Pinned {
                client: cluster.client(),
                placement: p,
            },
            ch,
        );
        g.bench_function(format!("inproc_{p}"), |b| {
            b.iter(|| {
                i = (i + 7919) % KEYS;
                m.get(&keys[i]).unwrap().unwrap()
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("mica_put_16_64");
    g.bench_function("native", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            native.put(&keys[i], &value)
        })
    });
    g.bench_function("naam_host_direct_jit", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            naam.put(&keys[i], &value).unwrap()
        })
    });
    let mut m = MicaClient::new(cluster.client(), ch);
    g.bench_function("inproc_owner_host", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            m.put(&keys[i], &value).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
