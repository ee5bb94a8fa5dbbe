//! Every core workload runs end to end on the in-process cluster, with no failed operation; the
//! CLI rejects what it cannot run with a clear message and exit code.

mod common;

use std::process::Command;

use naam_bench::driver::{run_inproc, App, PlacementChoice, YcsbConfig};
use naam_bench::ycsb::Op;
use naam_runtime::proto::Placement;

fn cfg(app: App, w: char, placement: PlacementChoice) -> YcsbConfig {
    common::small_run(app, w, placement, "inproc")
}

#[test]
fn every_workload_runs_without_errors() {
    let runs = [
        (App::Mica, 'a'),
        (App::Mica, 'b'),
        (App::Mica, 'c'),
        (App::Mica, 'd'),
        (App::Mica, 'f'),
        (App::Btree, 'a'),
        (App::Btree, 'e'),
    ];
    for (app, w) in runs {
        let r = run_inproc(&cfg(app, w, PlacementChoice::Auto), &|_, _| {}).unwrap();
        let done = naam_bench::driver::completed(&r.ops);
        let errors: u64 = r.ops.iter().map(|o| o.errors).sum();
        assert_eq!((done, errors), (1500, 0), "{app:?} {w}");
        assert!(r.throughput > 0.0 && r.load_throughput > 0.0);
        if w == 'e' {
            assert!(r
                .ops
                .iter()
                .any(|o| o.op == Op::Scan && o.latency.count > 0));
        }
    }
}

#[test]
fn pinned_placements_carry_the_reads() {
    for p in Placement::ALL {
        let r = run_inproc(&cfg(App::Mica, 'c', PlacementChoice::Fixed(p)), &|_, _| {}).unwrap();
        assert!(
            r.placement_fractions[p.index()] > 0.99,
            "{p}: {:?}",
            r.placement_fractions
        );
    }
}

#[test]
fn cli_errors_are_clear() {
    let bin = env!("CARGO_BIN_EXE_naam-bench");
    let out = Command::new(bin)
        .args(["ycsb", "--workload", "z"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown workload"));
    let out = Command::new(bin)
        .args([
            "ycsb",
            "--app",
            "mica",
            "--workload",
            "e",
            "--records",
            "10",
            "--ops",
            "10",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use --app btree"));
    let out = Command::new(bin)
        .args([
            "keys",
            "--dist",
            "uniform",
            "--records",
            "100",
            "--draws",
            "1000",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    // RDMA reads without RDMA: said before any packet is sent.
    let out = Command::new(bin)
        .args(["ycsb", "--fabric", "rdma", "--server", "127.0.0.1:9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("built without RDMA verbs") || err.contains("no RDMA device"),
        "{err}"
    );
    // Experiments take the udp fabric only with a server, and no unknown fabric.
    for (args, needle) in [
        (&["experiment", "shift", "--fabric", "udp"][..], "--server"),
        (
            &["experiment", "shift", "--fabric", "tcp"][..],
            "unknown fabric",
        ),
    ] {
        let out = Command::new(bin).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(needle),
            "{args:?}"
        );
    }
    let out = Command::new(bin)
        .args(["experiment", "scale", "--counts", "0,8", "--out"])
        .arg(std::env::temp_dir().join("naam-bench-cli-test"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 1"));
}

#[test]
fn memcached_baseline_runs_the_same_workloads() {
    if Command::new("memcached").arg("-h").output().is_err() {
        eprintln!("SKIPPED memcached_baseline_runs_the_same_workloads: memcached is not installed (scripts/setup.sh installs it)");
        return;
    }
    // One command at a time, and pipelined: a window of 8 refilled in halves, and an odd one
    // (7: halves of 4 and 3). Every operation is counted once, none fails.
    for (w, pipeline) in [('a', 1), ('b', 1), ('c', 1), ('b', 8), ('f', 7)] {
        let mut c = cfg(App::Mica, w, PlacementChoice::Auto);
        c.pipeline = pipeline;
        let r = naam_bench::memcached::run_memcached(&c, 1, &|_, _| {}).unwrap();
        let done = naam_bench::driver::completed(&r.ops);
        let errors: u64 = r.ops.iter().map(|o| o.errors).sum();
        assert_eq!(
            (done, errors),
            (1500, 0),
            "memcached {w}, pipeline {pipeline}"
        );
        assert_eq!(r.misses, 0, "every loaded record is there");
    }
    // No server outlives its run.
    let left = Command::new("pgrep")
        .arg("-x")
        .arg("memcached")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "memcached left running: {}",
        String::from_utf8_lossy(&left)
    );
}

/// Counts of zero, a `--json` path that cannot be written and a closed stdout: a clear error
/// and a non-zero exit before any work, never a panic.
#[test]
fn bad_numbers_and_outputs_are_refused_before_any_work() {
    let bin = env!("CARGO_BIN_EXE_naam-bench");
    for args in [
        &["ycsb", "--field-count", "0"][..],
        &["ycsb", "--field-length", "0"],
        &["ycsb", "--ops", "0"],
        &["ycsb", "--records", "0"],
        &["ycsb", "--threads", "0"],
        &["ycsb", "--host-executors", "0"],
        &["ycsb", "--nic-executors", "0"],
        &["keys", "--draws", "0"],
        &["keys", "--records", "0"],
        &["verify", "--server", "127.0.0.1:9", "--ops", "0"],
        &["experiment", "auth-cost", "--rounds", "0"],
        &["compare-memcached", "--memcached-threads", "0"],
    ] {
        let started = std::time::Instant::now();
        let out = Command::new(bin).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("invalid value '0'"), "{args:?}: {err}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{args:?}"
        );
    }
    let out = Command::new(bin)
        .args(["ycsb", "--json", "/nonexistent/x.json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("/nonexistent does not exist"), "{err}");
    // `naam-bench ycsb | head`: the reader is gone; the process dies of SIGPIPE, no panic.
    let mut child = Command::new(bin)
        .args(["ycsb", "--records", "50", "--ops", "50"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{err}");
}
