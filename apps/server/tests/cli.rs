//! `naam-server` refuses bad configs and bad handler objects with a clear message and its
//! documented exit codes (2: config, handler objects or usage; 1: runtime failure), and never
//! starts serving.

use naam_runtime::CredentialFile as _;
use std::process::Command;

fn server(config: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("naam-server.toml");
    std::fs::write(&path, config).unwrap();
    naam_runtime::proto::session::Credential::generate(&naam_runtime::entropy::os())
        .unwrap()
        .write_new(&dir.path().join("k.key"))
        .unwrap();
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
    // Sizes out of range, a missing or public credential: config errors, never an abort.
    let app = "[[app]]\nkind = \"object\"\nid = 3\nname = \"x\"\ncredential = \"k.key\"\n\
               object = \"x.o\"\nhandlers = [{ name = \"get\" }]\n";
    for (config, needle) in [
        (
            format!("listen = \"127.0.0.1:0\"\n{app}regions = [{{ name = \"r\", size = 1099511627776, access = \"r\" }}]\n"),
            "size 1099511627776",
        ),
        (
            format!("listen = \"127.0.0.1:0\"\n{app}regions = [{{ name = \"r\", size = 0, access = \"r\" }}]\n"),
            "size 0",
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[app]]\nkind = \"mica\"\nid = 1\nitems = 0\ncredential = \"k.key\"\n".into(),
            "items",
        ),
        (
            format!("listen = \"127.0.0.1:0\"\ndatagram = 100\n{app}"),
            "datagram must be",
        ),
        (
            "listen = \"127.0.0.1:0\"\n[[app]]\nkind = \"mica\"\nid = 1\nitems = 10\ncredential = \"none.key\"\n".into(),
            "none.key",
        ),
        // A code cache that is a file, not a directory.
        (
            "listen = \"127.0.0.1:0\"\ncode_cache = \"k.key\"\n[[app]]\nkind = \"mica\"\nid = 1\nitems = 10\ncredential = \"k.key\"\n".into(),
            "code cache",
        ),
    ] {
        let (code, err) = server(&config);
        assert_eq!(code, 2, "{config}: {err}");
        assert!(err.contains(needle), "{config}: {err}");
    }
}

#[test]
fn keygen_writes_a_private_credential_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.key");
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_naam-server"))
            .args(["keygen", "--out"])
            .arg(&out)
            .output()
            .unwrap()
    };
    assert_eq!(run().status.code(), Some(0));
    let c = naam_runtime::proto::session::Credential::load(&out).unwrap();
    let again = run();
    assert_eq!(again.status.code(), Some(2), "never replaces a credential");
    assert_eq!(
        naam_runtime::proto::session::Credential::load(&out).unwrap(),
        c
    );
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
             credential = \"k.key\"\nobject = \"{object}\"\nhandlers = [{{ name = \"get\" }}]\n"
        ));
        assert_eq!(code, 2, "{object}: {err}");
        assert!(
            err.contains("naam-server: error: ") && err.contains(": loading"),
            "{object}: {err}"
        );
        assert!(!err.contains("serving"), "{err}");
    }
}

#[test]
fn a_bad_loss_injection_value_is_refused_before_any_work() {
    let out = Command::new(env!("CARGO_BIN_EXE_naam-server"))
        .args(["--config", "/nonexistent/naam-server.toml"])
        .env("NAAM_INJECT_LOSS", "lots")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NAAM_INJECT_LOSS"), "{err}");
    assert!(!err.contains("/nonexistent"), "did work first: {err}");
}
