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

/// A read descriptor of `len` bytes at `offset` of region `rkey`.
fn rd(rkey: u64, offset: u64, len: u32) -> naam_ebpf::abi::Descriptor {
    naam_ebpf::abi::Descriptor {
        rkey,
        offset,
        len,
        access: naam_ebpf::abi::ACCESS_READ,
    }
}

#[test]
fn an_app_created_while_the_cluster_serves_runs_at_every_placement_on_its_own_regions() {
    use naam_ebpf::abi::{ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
    const NEW: u32 = 40;
    let c = started_with(vec![HandlerSpec::read("two_step")]);
    let theirs = c.region_key(APP, "data").unwrap();
    assert!(c.region_key(NEW, "data").is_none());
    let mut client = c.client();
    assert_eq!(
        client
            .call(NEW, handler_id("add"), &[], &[])
            .unwrap()
            .status,
        Status::UnknownApp
    );
    let mut spec = common::examples_app(NEW);
    spec.name = "created".into();
    spec.handlers = vec![
        HandlerSpec::read("two_step").engine(EngineKind::Tiered),
        HandlerSpec::write("counter_add"),
    ];
    let d = c.create_app(&spec).unwrap();
    assert_eq!((d.app, d.version, d.handlers.len()), (NEW, 1, 2));
    assert_eq!(c.registry().app(NEW).unwrap().name, "created");
    let data = c.region_key(NEW, "data").unwrap();
    assert_ne!(data, theirs);
    for p in Placement::ALL {
        let r = client
            .call_at(
                p,
                NEW,
                handler_id("two_step"),
                &words(&[data]),
                &[rd(data, 0, 16)],
            )
            .unwrap();
        assert_eq!((r.status, r.steps), (Status::Ok, 2), "{p}");
        assert_eq!(&r.payload[..], &words(&[1042])[..], "{p}");
        // The other app's region is not the new app's to name, at any placement.
        let r = client
            .call_at(
                p,
                NEW,
                handler_id("two_step"),
                &words(&[theirs]),
                &[rd(theirs, 0, 16)],
            )
            .unwrap();
        assert_eq!(r.status, Status::BadKey, "{p}");
    }
    // Its writes are owned, deduplicated and applied to its own memory only.
    let w = naam_ebpf::abi::Descriptor {
        rkey: data,
        offset: 16,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    for _ in 0..3 {
        let r = client
            .call(NEW, handler_id("counter_add"), &words(&[5]), &[w])
            .unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    let counter = |app| {
        u64::from_le_bytes(
            c.region_snapshot(app, "data").unwrap()[16..24]
                .try_into()
                .unwrap(),
        )
    };
    assert_eq!((counter(NEW), counter(APP)), (15, 0));
    assert_eq!(c.owner(NEW), Some(Placement::Host));
    assert!(c.app_accounts().iter().any(|a| a.app == NEW));
    // The app that was there answers as before.
    let r = client
        .call(
            APP,
            handler_id("two_step"),
            &words(&[theirs]),
            &[rd(theirs, 0, 16)],
        )
        .unwrap();
    assert_eq!(r.status, Status::Ok);
}

#[test]
fn an_app_that_cannot_be_created_changes_nothing_and_says_why() {
    let mut config = ClusterConfig::functional();
    config.run_time_apps = 2;
    let mut app = common::examples_app(APP);
    app.handlers = vec![HandlerSpec::read("add")];
    let c = Cluster::builder().config(config).app(app).build().unwrap();
    let spec = |id| {
        let mut s = common::examples_app(id);
        s.handlers = vec![HandlerSpec::read("add")];
        s
    };
    // Its id taken.
    assert!(matches!(
        c.create_app(&spec(APP)),
        Err(ClusterError::AppExists(APP))
    ));
    // A handler the verifier rejects: no app, no regions.
    let mut bad = spec(50);
    let mut object: LoadedObject = common::examples().1.clone();
    object.programs.push(Program::from_bytecode(
        "wild_jump",
        [[0x05, 0, 100, 0, 0, 0, 0, 0], [0x95, 0, 0, 0, 0, 0, 0, 0]].concat(),
    ));
    bad.object = Arc::new(object);
    bad.handlers.push(HandlerSpec::read("wild_jump"));
    let e = c.create_app(&bad).unwrap_err();
    assert!(e.to_string().contains("wild_jump"), "{e}");
    assert!(c.registry().app(50).is_none() && c.region_key(50, "data").is_none());
    assert_eq!(c.regions().len(), 2);
    // Two regions of one name.
    let mut twice = spec(51);
    twice.regions.push(twice.regions[0].clone());
    let e = c.create_app(&twice).unwrap_err();
    assert!(e.to_string().contains("sorted"), "{e}");
    // Too many regions.
    let mut many = spec(52);
    many.regions = (0..=naam_proto::limits::MAX_CREATED_APP_REGIONS)
        .map(|i| naam_runtime::cluster::RegionSpec {
            name: format!("r{i}"),
            ..many.regions[0].clone()
        })
        .collect();
    assert!(matches!(
        c.create_app(&many),
        Err(ClusterError::NoRoom { app: 52, .. })
    ));
    assert_eq!(c.regions().len(), 2);
    // Room for two apps: the third is refused, and the two answer.
    c.create_app(&spec(60)).unwrap();
    c.create_app(&spec(61)).unwrap();
    let e = c.create_app(&spec(62)).unwrap_err();
    assert!(matches!(e, ClusterError::NoRoom { app: 62, .. }), "{e}");
    assert!(e.to_string().contains("room"), "{e}");
    let mut client = c.client();
    for app in [APP, 60, 61] {
        let r = client
            .call(app, handler_id("add"), &words(&[2, 3]), &[])
            .unwrap();
        assert_eq!(r.status, Status::Ok, "app {app}");
    }
    assert_eq!(
        client.call(62, handler_id("add"), &[], &[]).unwrap().status,
        Status::UnknownApp
    );
}

#[test]
fn calls_to_every_app_are_answered_while_apps_are_created() {
    // 60 apps: within the default room for apps created at run time.
    let c = Arc::new(started_with(vec![HandlerSpec::read("add")]));
    let stop = Arc::new(AtomicBool::new(false));
    let created = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let caller = {
        let (c, stop, created) = (c.clone(), stop.clone(), created.clone());
        std::thread::spawn(move || {
            let mut client = c.client();
            let mut calls = 0u64;
            while !stop.load(Ordering::Acquire) || calls < 100 {
                // Every app created so far answers, at every placement.
                let n = created.load(Ordering::Acquire);
                for app in std::iter::once(APP).chain((0..n).map(|i| 100 + i)) {
                    let p = Placement::ALL[calls as usize % 3];
                    let r = client
                        .call_at(p, app, handler_id("add"), &words(&[calls, 1]), &[])
                        .unwrap();
                    assert_eq!(r.status, Status::Ok, "app {app} at {p}");
                    assert_eq!(&r.payload[..], &words(&[calls + 1])[..]);
                }
                calls += 1;
            }
            calls
        })
    };
    for i in 0..60u32 {
        let mut spec = common::examples_app(100 + i);
        spec.handlers = vec![HandlerSpec::read("add").engine(EngineKind::Interp)];
        c.create_app(&spec).unwrap();
        created.store(i + 1, Ordering::Release);
    }
    stop.store(true, Ordering::Release);
    assert!(caller.join().unwrap() >= 100);
    assert_eq!(c.registry().apps().count(), 61);
}
