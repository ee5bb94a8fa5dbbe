//! naam-nic's refusals: started before (or without) a server, or against a corrupt manifest,
//! it says what is wrong and exits 1 without serving; bad usage exits 2.

use naam_runtime::CredentialFile as _;
use std::process::Command;

fn nic(shm: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let keys = tempfile::tempdir().unwrap();
    let pairing = keys.path().join("naam-nic.key");
    naam_runtime::proto::session::Credential::generate()
        .unwrap()
        .write_new(&pairing)
        .unwrap();
    Command::new(env!("CARGO_BIN_EXE_naam-nic"))
        .args(["run", "--server", "127.0.0.1:9", "--listen", "127.0.0.1:0"])
        .arg("--shm-dir")
        .arg(shm)
        .arg("--pairing")
        .arg(&pairing)
        .args(extra)
        .output()
        .expect("running naam-nic")
}

#[test]
fn a_missing_or_public_pairing_secret_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k.key");
    std::fs::write(&key, "00".repeat(32)).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    for pairing in [dir.path().join("none.key"), key] {
        let out = Command::new(env!("CARGO_BIN_EXE_naam-nic"))
            .args(["run", "--server", "127.0.0.1:9", "--listen", "127.0.0.1:0"])
            .arg("--pairing")
            .arg(&pairing)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("credential file"), "{err}");
    }
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

#[test]
fn a_bad_loss_injection_value_is_refused_before_any_work() {
    let out = Command::new(env!("CARGO_BIN_EXE_naam-nic"))
        .args(["run", "--server", "127.0.0.1:9", "--listen", "127.0.0.1:0"])
        .args([
            "--shm-dir",
            "/nonexistent/shm",
            "--pairing",
            "/nonexistent/k.key",
        ])
        .env("NAAM_INJECT_LOSS", "2")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NAAM_INJECT_LOSS"), "{err}");
    assert!(!err.contains("/nonexistent"), "did work first: {err}");
}

#[test]
fn receive_loops_out_of_range_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["0", "65", "-1", "many"] {
        let flag = format!("--receive-loops={bad}");
        let out = nic(dir.path(), &[&flag, "--wait", "0"]);
        assert_eq!(out.status.code(), Some(2), "--receive-loops {bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--receive-loops"), "{bad}: {err}");
    }
}
