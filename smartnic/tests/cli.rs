//! naam-nic's refusals: started before (or without) a server, or against a corrupt manifest,
//! it says what is wrong and exits 1 without serving; bad usage exits 2.

use std::process::Command;

fn nic(shm: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_naam-nic"))
        .args(["run", "--server", "127.0.0.1:9", "--listen", "127.0.0.1:0"])
        .arg("--shm-dir")
        .arg(shm)
        .args(extra)
        .output()
        .expect("running naam-nic")
}

#[test]
fn no_manifest_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = nic(dir.path(), &["--wait", "0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no manifest in"), "{err}");
    assert!(err.contains("is naam-server running"), "{err}");
}

#[test]
fn a_corrupt_manifest_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("manifest.json"), b"{ not json").unwrap();
    let out = nic(dir.path(), &["--wait", "0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid manifest"), "{err}");
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_naam-nic"))
        .args([
            "eswitch-rules",
            "--host-ip",
            "10.0.0.1",
            "--nic-permille",
            "1001",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most 1000"));
}
