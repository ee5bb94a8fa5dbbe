//! `naam-server` refuses bad configs and bad handler objects with a clear message and its
//! documented exit codes (2: config or usage, 1: runtime failure), and never starts serving.

use std::process::Command;

fn server(config: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("naam-server.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_naam-server"))
        .arg("--config")
        .arg(&path)
        .arg("--shm-dir")
        .arg(dir.path().join("shm"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_missing_or_wrong_config_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_naam-server"))
        .args(["--config", "/nonexistent/naam-server.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("reading /nonexistent"));
    let (code, err) = server("listen = \"127.0.0.1:0\"\n[[app]]\nkind = \"mica\"\nid = 1\n");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("items"), "{err}");
}

#[test]
fn hostile_handler_objects_are_refused_before_serving() {
    let dir = tempfile::tempdir().unwrap();
    // Not an ELF at all, and an ELF that is not eBPF.
    let garbage = dir.path().join("garbage.o");
    std::fs::write(&garbage, b"\x7fELF but not really an object").unwrap();
    let host_binary = env!("CARGO_BIN_EXE_naam-server");
    for object in [garbage.to_str().unwrap(), host_binary] {
        let (code, err) = server(&format!(
            "listen = \"127.0.0.1:0\"\n[[app]]\nkind = \"object\"\nid = 3\nname = \"x\"\n\
             object = \"{object}\"\nhandlers = [{{ name = \"get\" }}]\n"
        ));
        assert_eq!(code, 1, "{object}: {err}");
        assert!(
            err.contains("naam-server: error: loading"),
            "{object}: {err}"
        );
        assert!(!err.contains("serving"), "{err}");
    }
}
