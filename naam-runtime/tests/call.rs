//! `naam call` runs one message on a deployment (real naam-server and naam-nic processes) and
//! prints its reply; `naam run --region` runs a whole message locally over region files.

mod common;

use naam_runtime::CredentialFile as _;
use std::process::Command;

use common::deployment::{key_a, Deployment};
use serde_json::Value;

fn naam(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_naam"))
        .args(args)
        .output()
        .expect("naam runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn call_runs_a_message_on_a_deployment() {
    let Some(d) = Deployment::processes("naam call") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("a.key");
    key_a().write_new(&key).unwrap();
    let server = d.server().to_string();
    let call = |extra: &[&str]| {
        let mut args = vec![
            "call",
            "--server",
            &server,
            "--app",
            "a",
            "--key",
            key.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        naam(&args)
    };
    let too_long = "00".repeat(20_000);
    // add(5, 7) on the host, then pinned to the NIC.
    let five_seven = "05000000000000000700000000000000";
    let (code, out, err) = call(&["--handler", "add", "--args-hex", five_seven]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["reply_hex"], "0c00000000000000");
    let (code, out, err) = call(&[
        "--handler",
        "add",
        "--args-hex",
        five_seven,
        "--placement",
        "nic",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["placement"],
        "nic"
    );
    // A descriptor by region name: bsearch over the (zeroed) sorted region finds key 0.
    let args = dir.path().join("key.bin");
    std::fs::write(&args, 0u64.to_le_bytes()).unwrap();
    let (code, out, err) = call(&[
        "--handler",
        "bsearch",
        "--args-file",
        args.to_str().unwrap(),
        "--desc",
        "sorted:0:64",
    ]);
    assert_eq!(code, 0, "{err}: {out}");
    // Without its segment: the handler's error, by name, and exit 1.
    let (code, out, _) = call(&["--handler", "bsearch", "--args-hex", "0000000000000000"]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "handler-error");
    assert_eq!(v["code_name"], "no-segment");
    // Bad input: named, exit 2, nothing sent.
    for (extra, needle) in [
        (&["--handler", "nope"][..], "has no handler `nope`"),
        (
            &["--handler", "add", "--desc", "missing:0:8"],
            "no region `missing`",
        ),
        (&["--handler", "add", "--args-hex", "zz"], "not valid hex"),
        (
            &["--handler", "add", "--placement", "moon"],
            "--placement moon",
        ),
        // Arguments past the wire's limit (20,000 bytes).
        (
            &["--handler", "add", "--args-hex", &too_long],
            "args length",
        ),
    ] {
        let (code, _, err) = call(extra);
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
    // Tenant a's session does not see app b: said as for an app that does not exist.
    let (code, _, err) = naam(&[
        "call",
        "--server",
        &server,
        "--app",
        "b",
        "--tenant",
        "a",
        "--handler",
        "add",
        "--key",
        key.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no app `b`"), "{err}");
    let (code, _, err) = naam(&[
        "call",
        "--server",
        &server,
        "--app",
        "a",
        "--handler",
        "add",
        "--key",
        "/nonexistent.key",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent.key"), "{err}");
    // An app with no key file here: the app is named, and how to name another tenant.
    let (code, _, err) = naam(&[
        "call",
        "--server",
        &server,
        "--app",
        "nosuchapp",
        "--handler",
        "add",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("app `nosuchapp`") && err.contains("--tenant"),
        "{err}"
    );
    // A host name where an address goes.
    let by_name = format!("localhost:{}", d.server().port());
    let (code, out, err) = naam(&[
        "call",
        "--server",
        &by_name,
        "--app",
        "a",
        "--key",
        key.to_str().unwrap(),
        "--handler",
        "add",
        "--args-hex",
        five_seven,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["status"], "ok");
}

#[test]
fn run_follows_every_step_over_region_files() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.bin");
    // Step 0 reads (p = 24, 1000) and asks for the word at 24 of region 0xabcd; step 1 adds it.
    std::fs::write(&data, common::words(&[24, 1000, 0, 5])).unwrap();
    let object = common::examples().0.to_str().unwrap().to_string();
    let region = format!("data={},rkey=0xabcd", data.display());
    let (code, out, err) = naam(&[
        "run",
        &object,
        "--handler",
        "two_step",
        "--args-hex",
        "cdab000000000000",
        "--region",
        &region,
        "--desc",
        "data:0:16",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["steps"], 2);
    assert_eq!(v["reply_hex"], hex::encode(1005u64.to_le_bytes()));
    assert_eq!(v["regions"][0]["rkey"], "0xabcd");
    // A region spec or descriptor that does not parse, and --desc without --region.
    for (args, needle) in [
        (vec!["--region", "data"], "no `=`"),
        (
            vec!["--region", &region, "--desc", "other:0:8"],
            "no region `other`",
        ),
        (vec!["--desc", "data:0:8"], "--region"),
    ] {
        let mut all = vec!["run", &object, "--handler", "two_step"];
        all.extend(args.iter().copied());
        let (code, _, err) = naam(&all);
        assert_eq!(code, 2, "{all:?}: {err}");
        assert!(err.contains(needle), "{all:?}: {err}");
    }
}
