//! Deploys at run time against real `naam-server` and `naam-nic` processes on loopback: a
//! tenant deploys a new object's handlers into its own app with `naam deploy` and they answer
//! at the host and, once it has read the new manifest, at the NIC; `naam undeploy` takes them
//! away and the app's data stays. Deploying into another tenant's app, past the tenant's
//! quota, or a handler the verifier rejects, is refused with the reason and changes nothing;
//! the other tenant's calls are answered throughout.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::deployment::{key_a, key_b, Deployment, A, B};
use common::words;
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::control::{Control, DeployHandler};
use naam_proto::handler_id;
use naam_proto::session::Credential;
use naam_proto::transport::Transport;
use naam_proto::wire::Status;
use naam_proto::Placement;
use naam_runtime::udp::{UdpClient, UdpConfig, UdpError};

/// A session of tenant `a` or `b` with its own credential, pinned to `pin` if given.
fn client(server: SocketAddr, tenant: &str, pin: Option<Placement>) -> UdpClient {
    let key = if tenant == "a" { key_a() } else { key_b() };
    UdpClient::connect(&session_config(server, tenant, key, pin)).expect("a session")
}

/// A session of tenant `tenant` (a hello naming it) with credential `key`.
fn session_as(server: SocketAddr, tenant: &str, key: Credential) -> UdpClient {
    UdpClient::connect(&session_config(server, tenant, key, None)).expect("a session")
}

/// The config of a session of `tenant` with `key`, pinned to `pin` if given, retransmitting
/// after 10 ms.
fn session_config(
    server: SocketAddr,
    tenant: &str,
    key: Credential,
    pin: Option<Placement>,
) -> UdpConfig {
    let mut cfg = UdpConfig::new(server, tenant, key);
    cfg.pin = pin;
    cfg.rto = Duration::from_millis(10);
    cfg
}

/// A session of `tenant` with `key` to a server just started again: tried until it
/// answers, for at most 20 s.
fn reconnect(server: SocketAddr, tenant: &str, key: Credential) -> UdpClient {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut cfg = session_config(server, tenant, key.clone(), None);
        cfg.liveness = Duration::from_millis(500);
        match UdpClient::connect(&cfg) {
            Ok(c) => return c,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the server did not come back: {e}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Calls `call` (which checks its answer and says where it ran) until the NIC runs it,
/// for at most 10 s; until then the host must have run it.
fn until_the_nic_serves(what: &str, mut call: impl FnMut() -> Placement) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let placement = call();
        if placement == Placement::Nic {
            return;
        }
        assert_eq!(placement, Placement::Host);
        assert!(Instant::now() < deadline, "the NIC never served {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `naam ARGS` in the deployment's directory (where `a.key` and `b.key` are).
fn naam(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_naam"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("naam runs")
}

/// The counter at offset 0 of `app`'s region `data`, read with a deployed `sum_words`:
/// where the read ran, and the value.
fn read_counter(c: &mut UdpClient, app: u32, data: u64) -> (Placement, u64) {
    let r = c
        .call(app, handler_id("sum_words"), &[], &[common::rd(data, 0, 8)])
        .expect("an answer");
    assert_eq!(r.status, Status::Ok, "{r:?}");
    let v = u64::from_le_bytes(r.payload[..8].try_into().expect("eight bytes"));
    (r.placement, v)
}

/// Adds `by` to the counter at offset 0 of `app`'s region `data` with a deployed
/// `counter_add`.
fn counter_add(c: &mut UdpClient, app: u32, data: u64, by: u64) {
    let counter = Descriptor {
        rkey: data,
        offset: 0,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    let r = c
        .call(app, handler_id("counter_add"), &words(&[by]), &[counter])
        .expect("an answer");
    assert_eq!(r.status, Status::Ok, "{r:?}");
}

/// The names of `app`'s handlers in `c`'s manifest.
fn handler_names(c: &UdpClient, app: u32) -> Vec<String> {
    c.manifest()
        .app(app)
        .expect("the app")
        .handlers
        .iter()
        .map(|h| h.name.clone())
        .collect()
}

/// One GET of naam-server's `/metrics`.
fn scrape(addr: SocketAddr) -> String {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).expect("the metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: naam\r\n\r\n")
        .expect("a request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("an answer");
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `add(x, y)` on `app` at `c`'s placement: its status, where it ran, and its result.
fn add(c: &mut UdpClient, app: u32, x: u64, y: u64) -> (Status, Placement, Option<u64>) {
    let r = c
        .call(app, handler_id("add"), &words(&[x, y]), &[])
        .expect("an answer");
    let v = (r.payload.len() >= 8)
        .then(|| u64::from_le_bytes(r.payload[..8].try_into().expect("eight bytes")));
    (r.status, r.placement, v)
}

#[test]
fn a_tenant_deploys_and_undeploys_its_own_handlers_and_nobody_elses() {
    let Some(d) = Deployment::processes("deploys") else {
        return;
    };
    let dir = d.dir().expect("processes have a directory").to_path_buf();
    let server = d.server().to_string();
    let object = common::examples().0.clone();
    let object = object.to_str().expect("a UTF-8 path");
    let mut b = client(d.server(), "b", None);
    assert_eq!(add(&mut b, B, 2, 3).0, Status::Ok);

    // Tenant a replaces its six handlers with two: `add` as a read, `counter_add` as a write.
    let out = naam(
        &dir,
        &[
            "deploy",
            "--server",
            &server,
            "--app",
            "a",
            "--credential",
            "a.key",
            "--read",
            "add",
            "--write",
            "counter_add",
            object,
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(report["id"], A);
    assert!(
        report["version"].as_u64().expect("a version") >= 1,
        "{report}"
    );
    let names: Vec<&str> = report["handlers"]
        .as_array()
        .expect("handlers")
        .iter()
        .map(|h| h["name"].as_str().expect("a name"))
        .collect();
    assert_eq!(names, ["add", "counter_add"]);
    assert_eq!(report["handlers"][1]["kind"], "write");
    assert!(report["handlers"][0]["insns"].as_u64().expect("insns") > 0);

    // A new session sees the new handlers; the ones not named are gone.
    let mut a = client(d.server(), "a", None);
    assert_eq!(handler_names(&a, A), ["add", "counter_add"]);
    assert_eq!(
        add(&mut a, A, 40, 2),
        (Status::Ok, Placement::Host, Some(42))
    );
    let r = a
        .call(A, handler_id("bsearch"), &words(&[4]), &[])
        .expect("an answer");
    assert_eq!(r.status, Status::UnknownHandler);

    // The NIC reads the new manifest and serves the deployed handler too.
    // Until it does, the host serves the app's reads (the NIC's old handlers would not be
    // the deployed ones).
    let mut at_nic = client(d.server(), "a", Some(Placement::Nic));
    until_the_nic_serves("the deployed handler", || {
        let (status, placement, v) = add(&mut at_nic, A, 1, 2);
        assert_eq!((status, v), (Status::Ok, Some(3)));
        placement
    });

    // Into another tenant's app: refused by the server, nothing changes.
    let bytes = std::fs::read(object).expect("the object");
    let add_only = vec![DeployHandler {
        name: "add".into(),
        write: false,
    }];
    match a.deploy(B, &bytes, add_only.clone(), None, None) {
        Err(UdpError::Refused { message, .. }) => {
            assert!(message.contains("not this tenant's"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let out = naam(
        &dir,
        &[
            "deploy",
            "--server",
            &server,
            "--app",
            "b",
            "--tenant",
            "a",
            "--credential",
            "a.key",
            "--read",
            "add",
            object,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("only into its own apps"),
        "{}",
        text(&out.stderr)
    );
    let b_handlers = client(d.server(), "b", None)
        .manifest()
        .app(B)
        .expect("app b")
        .handlers
        .len();
    assert_eq!(b_handlers, 6, "b's handlers are as its config made them");
    assert_eq!(add(&mut b, B, 2, 3).0, Status::Ok);

    // Past the quota (8 handlers per tenant): refused with the figures.
    let nine: Vec<DeployHandler> = [
        "add",
        "checksum",
        "hash1k",
        "bsearch",
        "two_step",
        "vget",
        "sum_words",
        "walk",
        "reverse16",
    ]
    .iter()
    .map(|n| DeployHandler {
        name: n.to_string(),
        write: false,
    })
    .collect();
    match a.deploy(A, &bytes, nine, None, None) {
        Err(UdpError::Refused { message, .. }) => {
            assert!(message.contains("over quota"), "{message}");
            assert!(message.contains("9 handlers"), "{message}");
        }
        other => panic!("{other:?}"),
    }

    // A handler the verifier rejects (a jump past the end): refused, naming it.
    let mut wild = vec![0x05, 0, 100, 0, 0, 0, 0, 0];
    wild.extend_from_slice(&[0x95, 0, 0, 0, 0, 0, 0, 0]);
    let rejected = common::elf_object(&[("naam/wild_jump", &wild)]);
    let path = dir.join("wild.o");
    std::fs::write(&path, &rejected).expect("write the object");
    let out = naam(
        &dir,
        &[
            "deploy",
            "--server",
            &server,
            "--app",
            "a",
            "--credential",
            "a.key",
            "--read",
            "wild_jump",
            path.to_str().expect("a UTF-8 path"),
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("wild_jump"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        add(&mut a, A, 5, 6).0,
        Status::Ok,
        "the deployed handlers stay"
    );

    // Undeploy: the handlers go, the data stays.
    let data = a
        .manifest()
        .app(A)
        .and_then(|m| m.region_key("data"))
        .expect("app a's data region");
    counter_add(&mut a, A, data, 7);
    let out = naam(
        &dir,
        &[
            "undeploy",
            "--server",
            &server,
            "--app",
            "a",
            "--credential",
            "a.key",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(report["handlers"].as_array().map(Vec::len), Some(0));
    assert_eq!(add(&mut a, A, 1, 1).0, Status::UnknownHandler);
    // Deployed again, the counter has the value it had.
    let sum_words = DeployHandler {
        name: "sum_words".into(),
        write: false,
    };
    let again = a
        .deploy(A, &bytes, vec![sum_words], None, None)
        .expect("deployed again");
    assert_eq!(again.handlers.len(), 1);
    assert_eq!(
        read_counter(&mut a, A, data).1,
        7,
        "the region kept its counter across the undeploy"
    );
    // The NIC takes this deploy up too: its deploy thread, which took up the first, serves
    // every later one.
    let mut at_nic = client(d.server(), "a", Some(Placement::Nic));
    until_the_nic_serves("the handler deployed again", || {
        let (placement, v) = read_counter(&mut at_nic, A, data);
        assert_eq!(v, 7);
        placement
    });
    // Deployed objects are the app's own files (another tenant's deploy cannot write over
    // them), and only the one its manifest names is kept.
    let mine: Vec<String> = std::fs::read_dir(dir.join("shm"))
        .expect("the shared-memory directory")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("object-app{A}-")))
        .collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    // Tenant b was served all along.
    assert_eq!(add(&mut b, B, 2, 3), (Status::Ok, Placement::Host, Some(5)));

    // The deploys are in the server's metrics.
    if let Some((metrics, _)) = d.metrics() {
        let body = scrape(metrics);
        assert!(
            body.contains("naam_deploys_total{role=\"server\"} 2"),
            "{body}"
        );
        assert!(
            body.contains("naam_undeploys_total{role=\"server\"} 1"),
            "{body}"
        );
        assert!(
            body.contains("naam_deploys_refused_total{role=\"server\"} 2"),
            "{body}"
        );
    }

    // A server killed and started again serves the deployed handler again, over the data
    // the regions kept; the NIC takes it up from the new manifest.
    let mut d = d;
    d.restart_server();
    let mut a = reconnect(d.server(), "a", key_a());
    let names = handler_names(&a, A);
    assert_eq!(
        names,
        ["sum_words"],
        "the deploy is served after the restart"
    );
    assert_eq!(read_counter(&mut a, A, data).1, 7, "and its data");
    assert_eq!(add(&mut a, A, 1, 1).0, Status::UnknownHandler);
}

fn refusal(r: Result<u32, UdpError>) -> String {
    match r {
        Err(UdpError::Refused { message, .. }) => message,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_tenant_creates_an_app_deploys_into_it_and_it_outlives_a_restart() {
    use naam_proto::control::NewRegion;
    let Some(d) = Deployment::processes("created_apps") else {
        return;
    };
    let dir = d.dir().expect("processes have a directory").to_path_buf();
    let server = d.server().to_string();
    let object = common::examples().0.clone();
    let object = object.to_str().expect("a UTF-8 path");
    let mut b = client(d.server(), "b", None);
    // A session of tenant a opened before its app exists: the app is given to it too.
    let mut before = client(d.server(), "a", None);

    // `naam deploy --region` creates app `mine` for tenant a, then deploys into it.
    let create_mine = [
        "deploy",
        "--server",
        &server,
        "--app",
        "mine",
        "--tenant",
        "a",
        "--credential",
        "a.key",
        "--region",
        "data:64:rwa",
        "--read",
        "sum_words",
        "--write",
        "counter_add",
        object,
    ];
    let out = naam(&dir, &create_mine);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let mine = report["id"].as_u64().expect("an id") as u32;
    assert!(mine != A && mine != B, "{report}");
    assert_eq!(report["handlers"].as_array().map(Vec::len), Some(2));

    // Tenant a's new sessions have it, named as the config's apps are.
    let mut a = client(d.server(), "a", None);
    let data = a
        .manifest()
        .app(mine)
        .and_then(|m| m.region_key("data"))
        .expect("the created app's region");
    counter_add(&mut a, mine, data, 5);
    assert_eq!(read_counter(&mut a, mine, data), (Placement::Host, 5));
    let mut as_mine = session_as(d.server(), "mine", key_a());
    assert_eq!(read_counter(&mut as_mine, mine, data).1, 5);
    // So does the session opened before it was created, once it asks for the manifest.
    match before.control(&Control::QueryManifest { page: 0 }) {
        Ok(Control::ManifestPage { apps, .. }) => {
            assert!(apps.iter().any(|x| x.id == mine), "{apps:?}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(read_counter(&mut before, mine, data).1, 5);
    // The NIC maps the new region and serves the app's reads over the same bytes.
    let mut at_nic = client(d.server(), "a", Some(Placement::Nic));
    until_the_nic_serves("the created app", || {
        let (placement, v) = read_counter(&mut at_nic, mine, data);
        assert_eq!(v, 5);
        placement
    });

    // Tenant b can neither deploy into it nor take its name; its own calls are served.
    let out = naam(
        &dir,
        &[
            "deploy",
            "--server",
            &server,
            "--app",
            "mine",
            "--tenant",
            "b",
            "--credential",
            "b.key",
            "--read",
            "add",
            object,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("only into its own apps"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        b.manifest().app(mine).is_none(),
        "b's session has no such app"
    );
    let bytes = std::fs::read(object).expect("the object");
    let add_only = vec![DeployHandler {
        name: "add".into(),
        write: false,
    }];
    match b.deploy(mine, &bytes, add_only, None, None) {
        Err(UdpError::Refused { message, .. }) => {
            assert!(message.contains("not this tenant's"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let region = |name: &str, len: u64| NewRegion {
        name: name.into(),
        len,
        access: ACCESS_READ,
    };
    let m = refusal(b.create_app("mine", vec![region("data", 64)]));
    assert!(m.contains("taken"), "{m}");
    let m = refusal(b.create_app("a", vec![region("data", 64)]));
    assert!(m.contains("taken"), "a config app's name: {m}");
    let m = refusal(b.create_app("naam-nic", vec![region("data", 64)]));
    assert!(m.contains("taken"), "a role's name: {m}");
    // Names that would be paths, empty regions, wild rights: refused for their form.
    let m = refusal(b.create_app("../etc", vec![region("data", 64)]));
    assert!(m.contains("names are 1 to"), "{m}");
    let m = refusal(b.create_app("ok", vec![region("x/y", 64)]));
    assert!(m.contains("names are 1 to"), "{m}");
    let m = refusal(b.create_app("ok", vec![region("data", 0)]));
    assert!(m.contains("0 bytes"), "{m}");
    let m = refusal(b.create_app("ok", Vec::new()));
    assert!(m.contains("0 regions"), "{m}");
    let wild = NewRegion {
        access: 0x80,
        ..region("data", 64)
    };
    let m = refusal(b.create_app("ok", vec![wild]));
    assert!(m.contains("access"), "{m}");
    // Past the region-bytes quota (64 KiB per tenant) and the apps quota (two).
    let m = refusal(b.create_app("big", vec![region("data", 65_537)]));
    assert!(m.contains("over quota") && m.contains("65537 bytes"), "{m}");
    assert!(a.create_app("second", vec![region("data", 64)]).is_ok());
    let m = refusal(a.create_app("third", vec![region("data", 64)]));
    assert!(
        m.contains("over quota") && m.contains("created 2 apps"),
        "{m}"
    );
    assert_eq!(add(&mut b, B, 2, 3), (Status::Ok, Placement::Host, Some(5)));

    // A handler the verifier rejects, deployed into the new app: refused, naming it, and
    // the app's handlers stay.
    let mut jump = vec![0x05, 0, 100, 0, 0, 0, 0, 0];
    jump.extend_from_slice(&[0x95, 0, 0, 0, 0, 0, 0, 0]);
    let path = dir.join("wild.o");
    std::fs::write(&path, common::elf_object(&[("naam/wild_jump", &jump)])).expect("write");
    let out = naam(
        &dir,
        &[
            "deploy",
            "--server",
            &server,
            "--app",
            "mine",
            "--tenant",
            "a",
            "--credential",
            "a.key",
            "--read",
            "wild_jump",
            path.to_str().expect("a UTF-8 path"),
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("wild_jump"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(read_counter(&mut a, mine, data).1, 5);

    // The same command again keeps the app and its data, and deploys again.
    let out = naam(&dir, &create_mine);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(again["id"], mine);
    assert_eq!(read_counter(&mut a, mine, data).1, 5);
    // Asked for with other regions: refused, the app kept as it is.
    let m = refusal(a.create_app("mine", vec![region("data", 128)]));
    assert!(m.contains("other regions"), "{m}");

    if let Some((metrics, _)) = d.metrics() {
        let body = scrape(metrics);
        assert!(
            body.contains("naam_apps_created_total{role=\"server\"} 2"),
            "{body}"
        );
    }

    // A server killed and started again has the app, its handlers and its data; the ids
    // it gives are new ones.
    let mut d = d;
    d.restart_server();
    let mut a = reconnect(d.server(), "mine", key_a());
    let mut names = handler_names(&a, mine);
    names.sort();
    assert_eq!(names, ["counter_add", "sum_words"]);
    assert_eq!(
        a.manifest().app(mine).and_then(|m| m.region_key("data")),
        Some(data),
        "the same rkey"
    );
    counter_add(&mut a, mine, data, 1);
    assert_eq!(read_counter(&mut a, mine, data), (Placement::Host, 6));
    let m = refusal(a.create_app("third", vec![region("data", 64)]));
    assert!(
        m.contains("created 2 apps"),
        "the quota counts restored apps: {m}"
    );
}
