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

/// The repository's root.
fn repo() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
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
    // YCSB's measurement type is read (not named unknown); status lines have YCSB's shape.
    assert!(!stderr.contains("measurementtype"), "{stderr}");
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

/// YCSB's own command-line spellings, its measurement properties and its HdrHistogram logs:
/// a copied YCSB command line runs; `hdrhistogram.percentiles`, `exportfile` and the JSON
/// array exporter are honoured; the interval logs are in microseconds, in the format
/// HdrHistogram's reference Python reader (PyPI `hdrhistogram`, installed by
/// scripts/setup.sh into target/pytools) reads; workload F counts a read-modify-write under
/// READ and UPDATE as well, as YCSB does.
#[test]
fn ycsb_spellings_measurements_and_logs_are_ycsbs() {
    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("export.json");
    let prefix = format!("{}/hdr-", dir.path().display());
    let out = naam_bench(&[
        "ycsb",
        "-db",
        "site.ycsb.BasicDB",
        "-s",
        "-threads",
        "2",
        "-P",
        "workloads/workloadf",
        "-p",
        "recordcount=300",
        "-p",
        "operationcount=4000",
        "-p",
        "measurementtype=hdrhistogram",
        "-p",
        "hdrhistogram.fileoutput=true",
        "-p",
        &format!("hdrhistogram.output.path={prefix}"),
        "-p",
        "hdrhistogram.percentiles=50,99.9",
        "-p",
        "exporter=site.ycsb.measurements.exporter.JSONArrayMeasurementsExporter",
        "-p",
        &format!("exportfile={}", export.display()),
        "-p",
        "table=usertable",
        "-p",
        "histogram.buckets=1000",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(out.stdout.is_empty(), "the report went to the exportfile");
    assert!(
        stderr.contains("-db site.ycsb.BasicDB: ignored"),
        "{stderr}"
    );
    assert!(
        stderr.contains("ignored (not supported): histogram.buckets, table"),
        "{stderr}"
    );
    let rows: serde_json::Value = serde_json::from_slice(&std::fs::read(&export).unwrap()).unwrap();
    let value = |metric: &str, measurement: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["metric"] == metric && r["measurement"] == measurement)
            .map(|r| r["value"].clone())
    };
    for m in ["50thPercentileLatency(us)", "99.9PercentileLatency(us)"] {
        assert!(value("READ", m).is_some(), "{m}: {rows}");
    }
    assert!(
        value("READ", "95thPercentileLatency(us)").is_none(),
        "{rows}"
    );
    let count = |op: &str| value(op, "Operations").unwrap().as_u64().unwrap();
    assert_eq!(count("READ"), 4000, "every operation of workload F reads");
    assert_eq!(count("UPDATE"), count("READ-MODIFY-WRITE"));
    // The logs, as YCSB writes them, read by the reference reader.
    let log = dir.path().join("hdr-run-READ.hdr");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("#[Histogram log format version 1.3]")
            && text.contains("\"StartTimestamp\",\"Interval_Length\",\"Interval_Max\""),
        "{text}"
    );
    let python = repo().join("target/pytools/bin/python");
    if !python.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI reads the logs with HdrHistogram's Python reader: scripts/setup.sh installs it"
        );
        eprintln!(
            "skipped the Python reader: no {} (scripts/setup.sh)",
            python.display()
        );
        return;
    }
    let script = "import sys\n\
        from hdrh.log import HistogramLogReader\n\
        from hdrh.histogram import HdrHistogram\n\
        r = HistogramLogReader(sys.argv[1], HdrHistogram(1, 60000000, 3))\n\
        n = total = top = 0\n\
        while True:\n\
        \x20   h = r.get_next_interval_histogram()\n\
        \x20   if h is None: break\n\
        \x20   n += 1; total += h.get_total_count(); top = max(top, h.get_max_value())\n\
        print(n, total, top)\n";
    let out = std::process::Command::new(&python)
        .args(["-c", script])
        .arg(&log)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Vec<u64> = said
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(v[0] >= 1, "{said}");
    assert_eq!(v[1], count("READ"), "every read is in the log: {said}");
    // Microseconds: no YCSB read on this machine takes a second.
    assert!(v[2] > 0 && v[2] < 1_000_000, "{said}");
}

/// Ctrl-C mid-run: the summary so far on stdout, the JSON and the HDR logs written, exit 130.
#[test]
fn an_interrupted_run_reports_what_it_measured_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let hdr = dir.path().join("hdr");
    let child = Command::new(env!("CARGO_BIN_EXE_naam-bench"))
        .args(["ycsb", "-P", "workloads/workloadb", "-p", "recordcount=300"])
        .args(["--duration", "60", "--json"])
        .arg(&json)
        .arg("--hdr-log")
        .arg(&hdr)
        .current_dir(repo())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(2));
    // SAFETY: signalling the child started above, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(130),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("[NAAM], StoppedBy, interrupt"), "{stdout}");
    let runtime: u64 = metric(&stdout, "OVERALL", "RunTime(ms)")
        .unwrap()
        .parse()
        .unwrap();
    assert!(runtime < 30_000, "{stdout}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["run"]["stopped_by_interrupt"], true, "{doc}");
    assert!(hdr.join("run-READ.hdr").is_file());
}

/// A property file with every key YCSB's `workload_template` sets, at its values (the file
/// itself is YCSB's, not shipped here), runs unchanged: the keys that change nothing here are
/// named once as ignored, none is refused.
#[test]
fn a_file_with_the_template_s_keys_runs_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("workload_template");
    let keys = [
        "workload=com.yahoo.ycsb.workloads.CoreWorkload",
        "recordcount=1000000",
        "operationcount=3000000",
        "insertstart=0",
        "fieldcount=10",
        "fieldlength=100",
        "readallfields=true",
        "writeallfields=false",
        "fieldlengthdistribution=constant",
        "readproportion=0.95",
        "updateproportion=0.05",
        "insertproportion=0",
        "readmodifywriteproportion=0",
        "scanproportion=0",
        "maxscanlength=1000",
        "scanlengthdistribution=uniform",
        "insertorder=hashed",
        "requestdistribution=zipfian",
        "hotspotdatafraction=0.2",
        "hotspotopnfraction=0.8",
        "table=usertable",
        "measurementtype=histogram",
        "histogram.buckets=1000",
        "timeseries.granularity=1000",
    ];
    std::fs::write(&file, keys.join("\n")).unwrap();
    // The template's sizes, scaled down for a test on the command line, as a user would.
    let out = naam_bench(&[
        "ycsb",
        "-P",
        file.to_str().unwrap(),
        "-p",
        "recordcount=500",
        "-p",
        "operationcount=2000",
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "ignored (not supported): histogram.buckets, hotspotdatafraction, \
             hotspotopnfraction, table, timeseries.granularity"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("unknown property"), "{stderr}");
    assert!(metric(&stdout, "READ", "Operations").is_some(), "{stdout}");
}
