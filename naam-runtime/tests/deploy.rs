//! Handlers deployed at run time into a running cluster: new handlers answer at once, a
//! handler the verifier rejects changes nothing, an undeploy leaves the app's regions, and
//! calls made while deploys swap the registry are all answered.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::words;
use naam_proto::handler_id;
use naam_proto::wire::Status;
use naam_proto::{EngineKind, Placement};
use naam_runtime::cluster::{Cluster, ClusterConfig, ClusterError};
use naam_runtime::{HandlerSpec, RegistryError};
use naam_vm::{LoadedObject, Program};

const APP: u32 = 3;

fn started_with(handlers: Vec<HandlerSpec>) -> Cluster {
    let mut app = common::examples_app(APP);
    app.handlers = handlers;
    Cluster::builder()
        .config(ClusterConfig::functional())
        .app(app)
        .build()
        .unwrap()
}

fn call_add(c: &Cluster) -> naam_proto::wire::Reply {
    c.client()
        .call_at(
            Placement::Host,
            APP,
            handler_id("add"),
            &words(&[2, 3]),
            &[],
        )
        .unwrap()
}

fn add_status(c: &Cluster) -> Status {
    call_add(c).status
}

#[test]
fn a_deployed_handler_answers_and_an_undeployed_one_is_gone() {
    let c = started_with(vec![HandlerSpec::read("bsearch")]);
    assert_eq!(add_status(&c), Status::UnknownHandler);
    assert_eq!(c.registry().version(), 0);
    let before = c.registry();
    let object = common::examples().1.clone();
    let d = c
        .deploy(
            APP,
            &object,
            &[
                HandlerSpec::read("add").engine(EngineKind::Tiered),
                HandlerSpec::read("bsearch"),
            ],
        )
        .unwrap();
    assert_eq!((d.app, d.version), (APP, 1));
    let names: Vec<&str> = d.handlers.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["add", "bsearch"]);
    let add = &d.handlers[0];
    assert!(add.insns > 0 && add.code_bytes == add.insns * 8, "{add:?}");
    assert_eq!(add.engine, EngineKind::Tiered);
    let r = call_add(&c);
    assert_eq!((r.status, &r.payload[..]), (Status::Ok, &words(&[5])[..]));
    // A snapshot taken before the deploy is the registry it was: calls holding it finish on it.
    assert!(before.handler(APP, handler_id("add")).is_err());
    assert_eq!(c.registry().app(APP).unwrap().version, 1);

    let u = c.undeploy(APP).unwrap();
    assert_eq!((u.version, u.handlers.len()), (2, 0));
    assert_eq!(add_status(&c), Status::UnknownHandler);
    // The app and its regions stay, for the next deploy.
    assert!(c.region_key(APP, "data").is_some());
    assert_eq!(c.deployed(APP), Some(Vec::new()));
    assert!(matches!(c.undeploy(99), Err(ClusterError::UnknownApp(99))));
}

#[test]
fn a_handler_the_verifier_rejects_changes_nothing_and_says_which() {
    let c = started_with(vec![HandlerSpec::read("add")]);
    // `ja +100` past the end, then `exit`.
    let mut code = vec![0x05, 0, 100, 0, 0, 0, 0, 0];
    code.extend_from_slice(&[0x95, 0, 0, 0, 0, 0, 0, 0]);
    let mut object: LoadedObject = common::examples().1.clone();
    object
        .programs
        .push(Program::from_bytecode("wild_jump", code));
    let e = c
        .deploy(
            APP,
            &object,
            &[HandlerSpec::read("bsearch"), HandlerSpec::read("wild_jump")],
        )
        .unwrap_err();
    match &e {
        ClusterError::Registry(RegistryError::Handler { name, .. }) => {
            assert_eq!(name, "wild_jump")
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("wild_jump"), "{e}");
    // Neither handler of the refused deploy was published; the old one still answers.
    assert_eq!(c.registry().version(), 0);
    assert_eq!(add_status(&c), Status::Ok);
    assert!(c.registry().handler(APP, handler_id("bsearch")).is_err());
    // A name the object does not have is refused the same way.
    let e = c
        .deploy(APP, &object, &[HandlerSpec::read("nonexistent")])
        .unwrap_err();
    assert!(e.to_string().contains("nonexistent"), "{e}");
    assert!(matches!(
        c.deploy(77, &object, &[HandlerSpec::read("add")]),
        Err(ClusterError::UnknownApp(77))
    ));
}

#[test]
fn calls_made_while_deploys_swap_the_registry_are_all_answered() {
    let c = Arc::new(started_with(vec![HandlerSpec::read("add")]));
    let stop = Arc::new(AtomicBool::new(false));
    let caller = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut client = c.client();
            let mut calls = 0u64;
            while !stop.load(Ordering::Relaxed) || calls < 100 {
                for p in [Placement::Host, Placement::Nic, Placement::Client] {
                    let r = client
                        .call_at(p, APP, handler_id("add"), &words(&[calls, 1]), &[])
                        .unwrap();
                    assert_eq!(r.status, Status::Ok, "call {calls} at {p}");
                    assert_eq!(&r.payload[..], &words(&[calls + 1])[..]);
                }
                calls += 1;
            }
            calls
        })
    };
    let object = common::examples().1.clone();
    for i in 0..50u64 {
        let engine = [EngineKind::Interp, EngineKind::Jit, EngineKind::Tiered][i as usize % 3];
        let d = c
            .deploy(APP, &object, &[HandlerSpec::read("add").engine(engine)])
            .unwrap();
        assert_eq!(d.version, i + 1);
    }
    stop.store(true, Ordering::Relaxed);
    assert!(caller.join().unwrap() >= 100);
}

#[test]
fn a_recorded_deploy_is_served_again_and_a_record_that_cannot_be_is_dropped() {
    use naam_runtime::udp;
    let shm = tempfile::tempdir().expect("tempdir");
    let (path, _) = common::examples();
    let bytes = std::fs::read(path).expect("the examples object");
    let mut app = common::examples_app(APP);
    app.handlers = vec![HandlerSpec::read("bsearch")];
    let host = udp::HostApp {
        spec: app,
        kind: "object".into(),
        params: serde_json::Value::Null,
        object_bytes: bytes.clone(),
        client_writes: false,
        credential: None,
    };
    let (cluster, mut manifest) =
        udp::start_host(vec![host], ClusterConfig::functional(), shm.path()).expect("a host");
    // What the deployer would have recorded: `add` from a deployed copy of the object; and a
    // record of an app this config does not have.
    let object = shm.path().join(format!("object-app{APP}-test.o"));
    std::fs::write(&object, &bytes).expect("the deployed object");
    let record = serde_json::json!({
        "object": [object.display().to_string(), naam_proto::control::object_hash(&bytes)],
        "handlers": [{ "name": "add", "id": handler_id("add"), "write": false,
                       "engine": "interp", "budget": 1000 }],
    });
    std::fs::write(
        shm.path().join(format!("deployed-app{APP}.json")),
        record.to_string(),
    )
    .expect("a record");
    std::fs::write(shm.path().join("deployed-app77.json"), record.to_string()).expect("a record");
    let lines = udp::restore_deploys(&cluster, &mut manifest, shm.path()).expect("restored");
    assert!(
        lines.iter().any(|l| l.contains("served again")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("app 77") && l.contains("no such app")),
        "{lines:?}"
    );
    assert!(!shm.path().join("deployed-app77.json").exists());
    assert_eq!(
        add_status(&cluster),
        Status::Ok,
        "the recorded handler serves"
    );
    let a = manifest.app(APP).expect("the app");
    assert_eq!(a.handlers.len(), 1);
    assert_eq!(a.object, object.display().to_string());
    assert_eq!(manifest.version, cluster.registry().version());
    // The manifest in the directory says the same, for the NIC.
    let written = udp::read_manifest(shm.path()).expect("the manifest");
    assert_eq!(written.app(APP).map(|a| a.handlers.len()), Some(1));
    // New regions forget the deploys and their objects.
    udp::forget_deploys(shm.path());
    assert!(!shm.path().join(format!("deployed-app{APP}.json")).exists());
    assert!(!object.exists());
}
