//! The simulator replays: the same configuration and seed give the same report, byte for byte
//! (every random draw of the endpoints, the network and the workload is seeded), and another
//! seed gives another run. Bad arguments are refused with exit 2 before anything runs.

use std::process::Command;

use naam_bench::sim::{run, Profile, SimConfig};

fn small(seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(Profile::load("bluefield2-100g").unwrap(), seed, 3);
    cfg.records = 300;
    cfg.window = 2;
    cfg.warmup_ns = 2_000_000;
    cfg.measure_ns = 5_000_000;
    cfg
}

#[test]
fn the_same_seed_gives_byte_identical_json_and_another_seed_another_run() {
    let a = serde_json::to_string(&run(&small(7)).unwrap()).unwrap();
    let b = serde_json::to_string(&run(&small(7)).unwrap()).unwrap();
    assert_eq!(a, b, "two runs of one seed differ");
    let c = serde_json::to_string(&run(&small(8)).unwrap()).unwrap();
    assert_ne!(a, c, "another seed ran the same");
    let r: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert!(r["throughput_ops"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["mode"], "sim:bluefield2-100g");
}

#[test]
fn the_cli_refuses_bad_arguments_with_exit_2() {
    let bin = env!("CARGO_BIN_EXE_naam-bench");
    for args in [
        vec!["--profile", "no-such-profile"],
        vec!["--measure-ms", "0"],
        vec!["--measure-ms", "nan"],
        vec!["--target", "-5"],
        vec!["--clients", "0"],
        vec!["--clients", "2", "--apps", "3"],
        vec!["--placement", "everywhere"],
        vec!["--servers", "0"],
        vec!["--workload", "e"],
        vec!["--workload", "z"],
    ] {
        let out = Command::new(bin)
            .args(["sim", "run"])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
}

/// Past its capacity a closed loop only waits longer: twice the clients that saturate the
/// NIC's cores get the same throughput, with few resends. (Before the path's timeout backed
/// off on timeouts, RFC 6298 5.5-5.7, every exchange timed out there, Karn's rule left no
/// sample to learn the longer round trip from, and throughput fell to a quarter.)
#[test]
fn overload_does_not_collapse_into_resends() {
    let mut base = Profile::load("bluefield2-100g").unwrap();
    base.nic.cores = 2;
    let at = |clients: usize| {
        let mut cfg = SimConfig::new(base.clone(), 3, clients);
        cfg.records = 500;
        cfg.pin = Some(naam_runtime::proto::Placement::Nic);
        cfg.warmup_ns = 2_000_000;
        cfg.measure_ns = 5_000_000;
        run(&cfg).unwrap()
    };
    let saturated = at(16);
    let twice = at(32);
    assert!(
        twice.throughput_ops >= 0.9 * saturated.throughput_ops,
        "{} against {}",
        twice.throughput_ops,
        saturated.throughput_ops
    );
    // Each client times out a few times while its path's timeout doubles past the queue's
    // round trip (about six each here, straight to the NIC through the eSwitch); the collapse
    // resent more than it sent.
    assert!(
        twice.client_resends * 10 <= twice.client_sent,
        "{} resends of {} sent",
        twice.client_resends,
        twice.client_sent
    );
}

/// Records spread over two servers by key hash: every operation is answered, and two servers'
/// cores carry more than one's.
#[test]
fn two_servers_share_the_records_and_the_load() {
    let mut base = Profile::load("bluefield2-100g").unwrap();
    base.host.cores = 1;
    base.nic.cores = 1;
    let at = |servers: usize| {
        let mut cfg = SimConfig::new(base.clone(), 4, 8);
        cfg.servers = servers;
        cfg.records = 400;
        cfg.window = 4;
        cfg.warmup_ns = 2_000_000;
        cfg.measure_ns = 5_000_000;
        run(&cfg).unwrap()
    };
    let one = at(1);
    let two = at(2);
    assert_eq!((one.failed, two.failed), (0, 0));
    assert!(
        two.throughput_ops >= 1.5 * one.throughput_ops,
        "{} against {}",
        two.throughput_ops,
        one.throughput_ops
    );
}

/// Reads pinned to the Client placement run at the clients over one-sided READs (MICA's GET
/// fetches at least twice: its bucket, then its item), each one through the rack and the
/// card's RDMA engine: lost frames are posted again and nothing fails, and the engine's rate
/// bounds the reads.
#[test]
fn client_placed_reads_go_through_the_cards_rdma_engine() {
    let at = |loss: f64, rdma_reads_per_s: f64| {
        let mut p = Profile::load("bluefield2-100g").unwrap();
        p.link.loss = loss;
        p.nic.rdma_reads_per_s = rdma_reads_per_s;
        let mut cfg = SimConfig::new(p, 5, 8);
        cfg.records = 400;
        cfg.window = 4;
        cfg.pin = Some(naam_runtime::proto::Placement::Client);
        cfg.warmup_ns = 2_000_000;
        cfg.measure_ns = 5_000_000;
        run(&cfg).unwrap()
    };
    let r = at(0.0, 50e6);
    assert_eq!(r.failed, 0);
    let [client, nic, host] = r.placed;
    assert!(client > 10 * host && nic == 0, "{:?}", r.placed);
    assert!(
        r.one_sided_reads >= 2 * client,
        "{} READs",
        r.one_sided_reads
    );
    let lossy = at(0.01, 50e6);
    assert_eq!(lossy.failed, 0);
    assert!(lossy.lost_reads > 0);
    // 200 K READs/s of at least two per GET: at most about 100 K reads a second get through.
    let slow = at(0.0, 200e3);
    assert!(
        slow.placed[0] as f64 / 0.005 < 110e3,
        "{:?} in 5 ms",
        slow.placed
    );
}

/// The host congested for 30 ms: reads move to the NIC's cores through the card's eSwitch and
/// come back once it ends. (They never came back while the host's loops steered again what
/// the eSwitch had left them, and while the eSwitch's per-mille share rounded the policy's
/// probes of the host away: the host's congested service time was never measured again.)
#[test]
fn reads_leave_a_congested_host_and_come_back() {
    let mut cfg = SimConfig::new(Profile::load("bluefield2-100g").unwrap(), 9, 16);
    cfg.records = 2_000;
    cfg.window = 4;
    cfg.target_per_client = Some(1e6 / 16.0);
    cfg.warmup_ns = 5_000_000;
    cfg.measure_ns = 80_000_000;
    cfg.bucket_ns = Some(1_000_000);
    cfg.congestion = Some(naam_bench::sim::Congestion {
        from_ns: 10_000_000,
        to_ns: 40_000_000,
        extra_ns: 20_000,
    });
    let r = run(&cfg).unwrap();
    let host_share = |from: usize, to: usize| {
        let (host, all) = r.timeline[from..to].iter().fold((0, 0), |(h, a), b| {
            (h + b.placed[2], a + b.placed.iter().sum::<u64>())
        });
        host as f64 / all.max(1) as f64
    };
    assert!(host_share(0, 10) > 0.9, "before: {}", host_share(0, 10));
    assert!(
        host_share(20, 40) < 0.2,
        "congested: {}",
        host_share(20, 40)
    );
    assert!(host_share(60, 80) > 0.9, "after: {}", host_share(60, 80));
}
