//! Every experiment runs end to end from the CLI (small sizes) and leaves its JSON and SVG
//! (auth-cost: its JSON).

use std::path::Path;
use std::process::Command;

fn run(name: &str, out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_naam-bench"))
        .args(["experiment", name, "--seconds", "0.3", "--ops", "2000"])
        .args([
            "--counts",
            "1,4",
            "--rates",
            "2000,5000",
            "--extra-us",
            "50",
            "--rounds",
            "1",
            "--records",
            "1000",
        ])
        .arg("--out")
        .arg(out)
        .output()
        .expect("naam-bench runs")
}

#[test]
fn every_experiment_writes_json_and_a_chart() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("experiments");
    let _ = std::fs::remove_dir_all(&out);
    let expect: [(&str, &[&str]); 7] = [
        (
            "shift",
            &["shift.json", "shift-fractions.svg", "shift-p99.svg"],
        ),
        ("capacity", &["capacity.json", "capacity.svg"]),
        ("scale", &["scale.json", "scale.svg"]),
        ("engines", &["engines.json", "engines.svg"]),
        ("placements", &["placements.json", "placements.svg"]),
        (
            "placements-congested",
            &["placements-congested.json", "placements-congested.svg"],
        ),
        ("auth-cost", &["auth-cost.json"]),
    ];
    for (name, files) in expect {
        let o = run(name, &out);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for f in files {
            let p = out.join(f);
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{name}: {f}: {e}"));
            assert!(!bytes.is_empty(), "{name}: {f} is empty");
            if f.ends_with(".json") {
                let v: serde_json::Value = serde_json::from_slice(&bytes).expect("valid JSON");
                assert!(
                    v["command"].is_string(),
                    "{name}: the JSON names its command"
                );
                assert!(v["mode"].is_string(), "{name}: the JSON names its mode");
            } else {
                assert!(String::from_utf8_lossy(&bytes).contains("<svg"));
                // Every chart is also a PNG.
                let png = std::fs::read(p.with_extension("png"))
                    .unwrap_or_else(|e| panic!("{name}: {f} as PNG: {e}"));
                assert_eq!(&png[..4], b"\x89PNG", "{name}: {f}");
            }
        }
    }
}

#[test]
fn an_unknown_experiment_is_a_clear_usage_error() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("experiments-unknown");
    let o = run("warp-drive", &out);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown experiment"));
}
