//! YCSB's interface: workload property files, `-p` overrides, YCSB's text output and status
//! lines, HdrHistogram interval logs, labelled JSON, time limits and target rates, and the
//! errors every bad value gets before anything runs.

use std::path::Path;
use std::process::{Command, Output};

fn naam_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_naam-bench"))
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .output()
        .expect("naam-bench runs")
}

/// The value of a YCSB output line `[SECTION], Metric, value`.
fn metric(stdout: &str, section: &str, name: &str) -> Option<String> {
    let prefix = format!("[{section}], {name}, ");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
}

#[test]
fn workload_files_give_ycsb_output_status_lines_hdr_logs_and_labelled_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let hdr = dir.path().join("hdr");
    let out = naam_bench(&[
        "ycsb",
        "-P",
        "workloads/workloada",
        "-p",
        "recordcount=300",
        "-p",
        "operationcount=2000",
        "-p",
        "status.interval=0.05",
        "-p",
        "measurementtype=hdrhistogram",
        "--json",
        json.to_str().unwrap(),
        "--hdr-log",
        hdr.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    // YCSB's lines, in YCSB's order, then NAAM's.
    let runtime: u64 = metric(&stdout, "OVERALL", "RunTime(ms)")
        .unwrap()
        .parse()
        .unwrap();
    assert!(runtime > 0, "{stdout}");
    assert!(metric(&stdout, "OVERALL", "Throughput(ops/sec)").is_some());
    for op in ["READ", "UPDATE"] {
        for m in [
            "Operations",
            "AverageLatency(us)",
            "MinLatency(us)",
            "MaxLatency(us)",
            "95thPercentileLatency(us)",
            "99thPercentileLatency(us)",
            "Return=OK",
        ] {
            assert!(metric(&stdout, op, m).is_some(), "[{op}], {m}: {stdout}");
        }
    }
    let ops: u64 = ["READ", "UPDATE"]
        .iter()
        .map(|op| {
            metric(&stdout, op, "Operations")
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(ops, 2000);
    assert!(stdout.find("[OVERALL]").unwrap() < stdout.find("[NAAM]").unwrap());
    assert!(
        metric(&stdout, "NAAM-HOST", "Share(%)").is_some(),
        "{stdout}"
    );
    // Unknown keys are named; status lines have YCSB's shape.
    assert!(
        stderr.contains("unknown property `measurementtype`"),
        "{stderr}"
    );
    let status: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains(" sec: ") && l.contains("current ops/sec;"))
        .collect();
    assert!(
        status.iter().any(|l| l.contains("[INSERT: Count=")),
        "{stderr}"
    );
    assert!(
        status.iter().any(|l| l.contains("[READ: Count=")),
        "{stderr}"
    );
    // HdrHistogram interval logs, one per operation type, readable by the log format's reader.
    for name in ["load-INSERT.hdr", "run-READ.hdr", "run-UPDATE.hdr"] {
        let bytes = std::fs::read(hdr.join(name)).unwrap();
        let intervals: Vec<_> =
            hdrhistogram::serialization::interval_log::IntervalLogIterator::new(&bytes)
                .filter_map(|e| match e {
                    Ok(hdrhistogram::serialization::interval_log::LogEntry::Interval(i)) => {
                        Some(i.tag().map(|t| t.as_str().to_string()))
                    }
                    _ => None,
                })
                .collect();
        assert!(!intervals.is_empty(), "{name}");
    }
    // JSON: units in names, names not ids, labelled placements.
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let run = &doc["run"];
    assert!(run["throughput_ops_per_sec"].as_f64().unwrap() > 0.0);
    assert!(run["run_time_ms"].as_u64().is_some());
    let placements: Vec<&str> = run["placements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["placement"].as_str().unwrap())
        .collect();
    assert_eq!(placements, ["client", "nic", "host"]);
    let handlers: Vec<&str> = run["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["handler"].as_str().unwrap())
        .collect();
    assert!(handlers.contains(&"mica_get"), "{handlers:?}");
    assert_eq!(doc["config"]["app"], "mica");
    assert_eq!(doc["config"]["field_length_bytes"], 100);
    assert_eq!(run["operations"][0]["operation"], "READ");
    assert!(run["operations"][0]["p99_latency_us"].as_u64().is_some());
    let text = std::fs::read_to_string(&json).unwrap();
    assert!(
        !text.contains("\"nanos\"") && !text.contains("Fixed("),
        "{text}"
    );
}

#[test]
fn every_shipped_workload_file_runs() {
    for (letter, app) in [
        ('a', "mica"),
        ('b', "mica"),
        ('c', "mica"),
        ('d', "mica"),
        ('e', "btree"),
        ('f', "mica"),
    ] {
        let file = format!("workloads/workload{letter}");
        let out = naam_bench(&[
            "ycsb",
            "-P",
            &file,
            "--app",
            app,
            "-p",
            "recordcount=200",
            "-p",
            "operationcount=300",
        ]);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_time_limit_and_a_target_rate_bound_the_run() {
    // --duration without --ops: run until the time is up.
    let out = naam_bench(&["ycsb", "--records", "100", "--duration", "0.5"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        metric(&stdout, "NAAM", "StoppedBy").as_deref(),
        Some("maxexecutiontime"),
        "{stdout}"
    );
    let ms: u64 = metric(&stdout, "OVERALL", "RunTime(ms)")
        .unwrap()
        .parse()
        .unwrap();
    assert!((400..10_000).contains(&ms), "{ms} ms");
    // 200 operations at 500 per second take at least 0.4 s.
    let out = naam_bench(&[
        "ycsb",
        "--records",
        "100",
        "--ops",
        "200",
        "--target",
        "500",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let ms: u64 = metric(&stdout, "OVERALL", "RunTime(ms)")
        .unwrap()
        .parse()
        .unwrap();
    assert!(ms >= 380, "{ms} ms at a target of 500 ops/s");
}

#[test]
fn bad_properties_and_phases_are_refused_before_any_work() {
    for (args, needle) in [
        (
            &["ycsb", "-P", "/nonexistent/workload"][..],
            "/nonexistent/workload",
        ),
        (&["ycsb", "-p", "recordcount=0"], "recordcount=0"),
        (&["ycsb", "-p", "readproportion=2"], "readproportion=2"),
        (&["ycsb", "-p", "requestdistribution=hotspot"], "hotspot"),
        (&["ycsb", "-p", "novalue"], "novalue"),
        (&["ycsb", "--duration=-1"], "--duration"),
        (&["ycsb", "--duration", "0"], "--duration"),
        (&["ycsb", "--workload", "z"], "unknown workload"),
        (&["ycsb", "run"], "needs a server"),
        (&["ycsb", "load", "--records", "10"], "needs a server"),
        (
            &["ycsb", "--app", "btree", "--field-length", "5000"],
            "B-tree stores 8-byte values",
        ),
        (
            &["ycsb", "--app", "btree", "-p", "fieldcount=3"],
            "B-tree stores 8-byte values",
        ),
        (&["ycsb", "-P", "workloads/workloade"], "use --app btree"),
        (&["ycsb", "--pipeline", "0"], "--pipeline"),
        (&["ycsb", "--pipeline=-3"], "--pipeline"),
        (&["ycsb", "-p", "naam.pipeline=0"], "naam.pipeline"),
        (&["ycsb", "-p", "naam.pipeline=5000"], "at most 1024"),
        (&["compare-memcached", "--pipeline", "0"], "--pipeline"),
        (
            &["ycsb", "--fabric", "bogus"],
            "unknown fabric `bogus` (inproc, inproc-endpoints, udp, rdma)",
        ),
        (
            &[
                "ycsb",
                "--fabric",
                "inproc-endpoints",
                "--server",
                "127.0.0.1:7000",
            ],
            "starts its own deployment",
        ),
    ] {
        let started = std::time::Instant::now();
        let out = naam_bench(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }
}

#[test]
fn logs_follow_rust_log_and_flags_and_version_names_the_commit() {
    let bin = env!("CARGO_BIN_EXE_naam-bench");
    let run = |env: Option<&str>, args: &[&str]| {
        let mut c = Command::new(bin);
        c.args(args).env_remove("RUST_LOG");
        if let Some(v) = env {
            c.env("RUST_LOG", v);
        }
        c.output().unwrap()
    };
    let small = ["ycsb", "--records", "10", "--ops", "10"];
    let quiet = run(None, &small);
    assert!(quiet.status.success());
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("DEBUG"));
    let debug = run(Some("naam_bench=debug"), &small);
    assert!(String::from_utf8_lossy(&debug.stderr).contains("DEBUG naam_bench::phase"));
    let mut vv = vec!["-vv"];
    vv.extend(small);
    assert!(String::from_utf8_lossy(&run(None, &vv).stderr).contains("DEBUG"));
    let bad = run(Some("naam_bench=loud["), &small);
    assert!(bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("RUST_LOG ignored"));
    let both = run(None, &["-q", "-v", "ycsb"]);
    assert_eq!(both.status.code(), Some(2));
    let version = String::from_utf8_lossy(&run(None, &["--version"]).stdout).into_owned();
    let commit = version
        .split("(git ")
        .nth(1)
        .and_then(|r| r.strip_suffix(")\n"))
        .unwrap_or_else(|| panic!("{version}"));
    let hex = commit.trim_end_matches("-dirty");
    assert!(
        hex == "unknown" || (hex.len() == 12 && hex.chars().all(|c| c.is_ascii_hexdigit())),
        "{version}"
    );
}
