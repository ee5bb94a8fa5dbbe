//! The multi-process deployment across network namespaces (`scripts/testbed.sh`): YCSB and
//! verifying clients at every placement, `kill -9` of naam-nic mid-run, and 1% packet loss.
//! Needs root, iproute2 and the workspace binaries (`cargo build --bins`, which
//! `scripts/test.sh` does); it says why when it skips.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const NAME: &str = "naamci";
const SUBNET: &str = "10.78.0";
const SERVER: &str = "10.78.0.1:7000";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo")
        .to_path_buf()
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_naam-bench"))
        .parent()
        .expect("bin dir")
        .to_path_buf()
}

fn testbed(args: &[&str], loss: Option<&str>) -> Output {
    let mut c = Command::new(repo().join("scripts/testbed.sh"));
    c.args(args)
        .env("NAAM_TESTBED", NAME)
        .env("NAAM_SUBNET", SUBNET)
        .env("NAAM_BIN_DIR", bin_dir())
        .env("NAAM_MICA_ITEMS", "50000")
        .env("NAAM_BTREE_KEYS", "50000")
        .env("NAAM_SCALE_APPS", "16")
        .env_remove("NAAM_INJECT_LOSS");
    if let Some(l) = loss {
        c.env("NAAM_INJECT_LOSS", l);
    }
    c.output().expect("running scripts/testbed.sh")
}

fn ok(o: &Output, what: &str) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{what} failed ({}):\nstdout: {out}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

fn bench(args: &[&str], loss: Option<&str>) -> Output {
    let b = bin_dir().join("naam-bench");
    let mut full = vec!["client", b.to_str().expect("utf-8 path")];
    full.extend_from_slice(args);
    testbed(&full, loss)
}

fn verify(app: &str, placement: &str, ops: &str, loss: Option<&str>) -> serde_json::Value {
    let args = vec![
        "verify",
        "--app",
        app,
        "--server",
        SERVER,
        "--placement",
        placement,
        "--threads",
        "2",
        "--ops",
        ops,
    ];
    let o = bench(&args, loss);
    let out = ok(&o, &format!("verify {app} at {placement}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("verify prints JSON");
    v["result"].clone()
}

struct Down;
impl Drop for Down {
    fn drop(&mut self) {
        let _ = testbed(&["down"], None);
    }
}

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root for network namespaces".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("needs iproute2 (ip)".into());
    }
    for b in ["naam-server", "naam-nic"] {
        if !bin_dir().join(b).exists() {
            return Some(format!(
                "{b} is not built in {} (cargo build --bins; scripts/test.sh does)",
                bin_dir().display()
            ));
        }
    }
    None
}

#[test]
fn deployment_across_namespaces() {
    if let Some(why) = skip_reason() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the namespace testbed, but: {why}"
        );
        eprintln!("SKIPPED deployment_across_namespaces: {why}");
        return;
    }
    let _ = testbed(&["down"], None);
    let _down = Down;
    let up = testbed(&["up"], None);
    ok(&up, "testbed up");
    ok(&testbed(&["status"], None), "testbed status");
    let log = String::from_utf8_lossy(&up.stderr).into_owned();
    assert!(
        log.contains("XDP eSwitch") && log.contains("attached"),
        "{log}"
    );

    // The XDP eSwitch: pinning its map to the NIC moves reads there, pinning it to the host
    // moves them back; its per-destination counters show it.
    let counters = |pin: &[&str]| -> serde_json::Value {
        let mut args = vec!["switch", "--server", SERVER];
        args.extend_from_slice(pin);
        let out = ok(&bench(&args, None), "naam-bench switch");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert!(v["switch"].as_str().unwrap().contains("XDP"), "{v}");
        v["counters"].clone()
    };
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    let before = counters(&["--pin-nic-permille", "1000"]);
    let r = verify("btree", "auto", "300", None);
    assert_eq!(
        (r["wrong"].as_u64(), r["errors"].as_u64()),
        (Some(0), Some(0)),
        "{r}"
    );
    let mid = counters(&["--pin-nic-permille", "0"]);
    assert!(
        n(&mid, "nic") >= n(&before, "nic") + 300,
        "reads went to the NIC: {before} -> {mid}"
    );
    let r = verify("btree", "auto", "300", None);
    assert_eq!(
        (r["wrong"].as_u64(), r["errors"].as_u64()),
        (Some(0), Some(0)),
        "{r}"
    );
    let after = counters(&["--unpin"]);
    assert_eq!(
        n(&after, "nic"),
        n(&mid, "nic"),
        "no read went to the NIC: {mid} -> {after}"
    );
    assert!(
        n(&after, "host") >= n(&mid, "host") + 300,
        "{mid} -> {after}"
    );

    // Every placement answers correctly, MICA and B-tree, from the client namespace.
    for app in ["mica", "btree"] {
        for p in ["host", "nic", "client", "auto"] {
            let r = verify(app, p, "300", None);
            assert_eq!(r["wrong"], 0, "{app} at {p}: {r}");
            assert_eq!(r["errors"], 0, "{app} at {p}: {r}");
            if p != "auto" {
                let i = ["client", "nic", "host"]
                    .iter()
                    .position(|x| *x == p)
                    .unwrap();
                assert!(
                    r["placement_fractions"][i].as_f64().unwrap() > 0.5,
                    "{app} at {p}: {r}"
                );
            }
        }
    }
    // YCSB-B on MICA and lookups (C) on the B-tree at every placement, one call at a time; and
    // MICA's sessions pipelined (windows of 8, sent in halves, and 5). Every operation is
    // answered (a run exits 1 on any failed one) and counted once.
    let one_at_a_time = [("mica", "b"), ("btree", "c")]
        .into_iter()
        .flat_map(|(app, w)| ["host", "nic", "client", "auto"].map(move |p| (app, w, p, "1")));
    let pipelined = [("mica", "b", "host", "8"), ("mica", "b", "auto", "5")];
    for (app, w, p, pipeline) in one_at_a_time.chain(pipelined) {
        let o = bench(
            &[
                "ycsb",
                "--fabric",
                "udp",
                "--server",
                SERVER,
                "--app",
                app,
                "--workload",
                w,
                "--records",
                "500",
                "--ops",
                "1000",
                "--placement",
                p,
                "--pipeline",
                pipeline,
            ],
            None,
        );
        let what = format!("ycsb {w} on {app} at {p}, pipeline {pipeline}");
        let out = ok(&o, &what);
        assert!(out.contains("udp"), "{out}");
        let counted: u64 = out
            .lines()
            .filter_map(|l| l.strip_prefix('[')?.split_once("], Operations, "))
            .filter(|(op, _)| *op != "INSERT")
            .filter_map(|(_, n)| n.trim().parse::<u64>().ok())
            .sum();
        assert_eq!(counted, 1000, "{what}:\n{out}");
    }

    // The paper's experiments over UDP, short: each labels its JSON udp; the shift moves reads
    // off the congested host; and writes still work afterwards (the host kept ownership).
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().to_str().expect("utf-8 path");
    for (name, extra) in [
        ("shift", &["--seconds", "1.5"][..]),
        (
            "placements-congested",
            &["--rates", "1000,4000", "--seconds", "1.2"][..],
        ),
        ("capacity", &["--ops", "500"][..]),
        ("scale", &["--counts", "1,16", "--ops", "1000"][..]),
    ] {
        let mut args = vec![
            "experiment",
            name,
            "--fabric",
            "udp",
            "--server",
            SERVER,
            "--out",
            out,
        ];
        args.extend_from_slice(extra);
        ok(
            &bench(&args, None),
            &format!("experiment {name} --fabric udp"),
        );
        let json = std::fs::read(dir.path().join(format!("{name}.json"))).expect(name);
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert!(
            v["mode"].as_str().unwrap().starts_with("udp"),
            "{name}: {v}"
        );
        match name {
            "shift" => assert!(v["moved_ms"].is_number(), "reads left the host: {v}"),
            "placements-congested" => assert_eq!(v["runs"].as_array().unwrap().len(), 8),
            "scale" => assert_eq!(v["runs"][1]["registered"], 16, "{v}"),
            _ => assert_eq!(v["runs"].as_array().unwrap().len(), 8),
        }
    }
    let r = verify("mica", "auto", "300", None);
    assert_eq!(
        (r["wrong"].as_u64(), r["errors"].as_u64()),
        (Some(0), Some(0)),
        "{r}"
    );

    // kill -9 of naam-nic mid-run: every request answered (retries), every answer right.
    let b = bin_dir().join("naam-bench");
    let run = Command::new(repo().join("scripts/testbed.sh"))
        .args([
            "client",
            b.to_str().unwrap(),
            "verify",
            "--server",
            SERVER,
            "--threads",
            "2",
        ])
        .args(["--ops", "100000000", "--seconds", "3"])
        .env("NAAM_TESTBED", NAME)
        .env("NAAM_SUBNET", SUBNET)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("verify");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    ok(&testbed(&["kill-nic", "KILL"], None), "kill -9 naam-nic");
    let o = run.wait_with_output().expect("verify finished");
    let out = ok(&o, "verify across kill -9 of naam-nic");
    let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(r["result"]["wrong"], 0, "{r}");
    assert_eq!(r["result"]["errors"], 0, "{r}");
    // Traffic is back at the host: nothing goes to the dead NIC or to its agent.
    let after = verify("mica", "auto", "300", None);
    assert_eq!(
        after["placement_fractions"][2].as_f64().unwrap(),
        1.0,
        "{after}"
    );

    // naam-server restarts (kill -9, then a new start with new epoch): the NIC pairs again
    // and maps the new regions by itself; reads at the NIC are answered within 5 s.
    ok(&testbed(&["start-nic"], None), "naam-nic restarted");
    let r = verify("mica", "nic", "100", None);
    assert_eq!(
        (r["wrong"].as_u64(), r["errors"].as_u64()),
        (Some(0), Some(0)),
        "{r}"
    );
    ok(
        &testbed(&["kill-server", "KILL"], None),
        "kill -9 naam-server",
    );
    ok(&testbed(&["start-server"], None), "naam-server restarted");
    let restarted = std::time::Instant::now();
    loop {
        let o = bench(
            &[
                "verify",
                "--app",
                "mica",
                "--server",
                SERVER,
                "--placement",
                "nic",
                "--threads",
                "1",
                "--ops",
                "100",
            ],
            None,
        );
        let good = o.status.success()
            && serde_json::from_slice::<serde_json::Value>(&o.stdout).is_ok_and(|v| {
                v["result"]["wrong"] == 0
                    && v["result"]["errors"] == 0
                    // Reads at the NIC (writes go to the host, their owner).
                    && v["result"]["placement_fractions"][1].as_f64() > Some(0.2)
            });
        if good {
            break;
        }
        assert!(
            restarted.elapsed() < std::time::Duration::from_secs(5),
            "the NIC did not recover within 5 s of the restart: {} {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
            String::from_utf8_lossy(&testbed(&["status"], None).stderr)
        );
    }

    // A YCSB run whose server dies fails within the liveness bound (10 s) with exit 1.
    let ycsb = Command::new(repo().join("scripts/testbed.sh"))
        .args([
            "client",
            b.to_str().unwrap(),
            "ycsb",
            "--fabric",
            "udp",
            "--server",
            SERVER,
        ])
        .args(["--app", "mica", "--workload", "b", "--records", "500"])
        .args(["--ops", "100000000", "--placement", "host"])
        .env("NAAM_TESTBED", NAME)
        .env("NAAM_SUBNET", SUBNET)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("ycsb");
    // Mid-run: the load phase is over and operations are flowing.
    std::thread::sleep(std::time::Duration::from_secs(4));
    ok(
        &testbed(&["kill-server", "KILL"], None),
        "kill -9 naam-server",
    );
    let killed = std::time::Instant::now();
    let o = ycsb.wait_with_output().expect("ycsb finished");
    let took = killed.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("has not answered"), "{err}");
    eprintln!("ycsb stopped {took:?} after its server was killed: {err}");
    assert!(
        took < std::time::Duration::from_secs(15),
        "exited {took:?} after the kill"
    );
    ok(&testbed(&["down"], None), "testbed down");

    // 1% datagram loss in every socket (this kernel has no netem; see scripts/testbed.sh).
    let loss = Some("0.01");
    ok(&testbed(&["up"], loss), "testbed up with loss");
    for app in ["mica", "btree"] {
        let r = verify(app, "auto", "1000", loss);
        assert_eq!(r["wrong"], 0, "{app} with loss: {r}");
        assert_eq!(r["errors"], 0, "{app} with loss: {r}");
    }
}
