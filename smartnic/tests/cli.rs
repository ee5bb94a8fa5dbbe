//! naam-nic's refusals: started before (or without) a server, or against a corrupt manifest,
//! it says what is wrong and exits 1 without serving; bad usage exits 2.

use naam_runtime::CredentialFile as _;
use std::process::Command;

fn nic(shm: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let keys = tempfile::tempdir().unwrap();
    let pairing = keys.path().join("naam-nic.key");
    naam_runtime::proto::session::Credential::generate(&naam_runtime::entropy::os())
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

/// A pairing secret the server refuses every time: naam-nic stops after a bounded number of
/// refusals and names the config key to check (exit 2), instead of retrying for ever.
#[test]
fn a_pairing_secret_the_server_refuses_stops_naam_nic_naming_nic_pairing() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for k in ["mica", "nic", "wrong"] {
        naam_runtime::proto::session::Credential::generate(&naam_runtime::entropy::os())
            .unwrap()
            .write_new(&d.join(format!("{k}.key")))
            .unwrap();
    }
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    std::fs::write(
        d.join("s.toml"),
        format!(
            "listen = \"{addr}\"\nshm_dir = \"shm\"\nnic_pairing = \"nic.key\"\n\
             [[app]]\nkind = \"mica\"\nid = 1\ncredential = \"mica.key\"\nitems = 100\n"
        ),
    )
    .unwrap();
    let server_bin =
        std::path::Path::new(env!("CARGO_BIN_EXE_naam-nic")).with_file_name("naam-server");
    if !server_bin.is_file() {
        eprintln!("skipped: no naam-server beside naam-nic (cargo build --workspace --bins)");
        return;
    }
    let server_log = d.join("server.log");
    let mut server = Command::new(server_bin)
        .args(["--config", "s.toml"])
        .current_dir(d)
        .stderr(std::fs::File::create(&server_log).unwrap())
        .spawn()
        .unwrap();
    // Wait for the manifest: the server has started.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !d.join("shm/manifest.json").exists() {
        assert!(Instant::now() < deadline, "naam-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = d.join("nic.log");
    let mut nic = Command::new(env!("CARGO_BIN_EXE_naam-nic"))
        .args([
            "run",
            "--server",
            &addr.to_string(),
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--shm-dir")
        .arg(d.join("shm"))
        .arg("--pairing")
        .arg(d.join("wrong.key"))
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Bounded: naam-nic is refused within a second or two. It once went on running after
    // its tenth refusal: the loop that counted them stopped, its sibling receive loop did not.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = nic.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() >= deadline {
            let _ = nic.kill();
            let _ = nic.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = server.kill();
    let _ = server.wait();
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    let Some(status) = status else {
        let server = std::fs::read_to_string(&server_log).unwrap_or_default();
        panic!("naam-nic still running after 20 s:\n{err}\nnaam-server:\n{server}");
    };
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("nic_pairing") && err.contains("refused pairing"),
        "{err}"
    );
}
