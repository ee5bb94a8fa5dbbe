//! YCSB over an in-process deployment on an in-memory datagram network
//! (`--fabric inproc-endpoints`): naam-server's and naam-nic's endpoints bound inline in the
//! network and `UdpClient`s in one process, every message through the client, server and NIC
//! endpoints. It needs no network:
//! CI runs this file again in a namespace without one (`unshare -n`, scripts/test.sh).

mod common;

use naam_bench::driver::{run_inproc_endpoints, App, PlacementChoice, YcsbConfig};
use naam_runtime::proto::Placement;
use naam_runtime::udp::MEMORY_MODE;

fn cfg(app: App, w: char, placement: PlacementChoice) -> YcsbConfig {
    common::small_run(app, w, placement, "inproc-endpoints")
}

#[test]
fn workloads_run_through_the_endpoints_without_errors() {
    for (app, w) in [(App::Mica, 'a'), (App::Mica, 'b'), (App::Btree, 'c')] {
        let r = run_inproc_endpoints(&cfg(app, w, PlacementChoice::Auto), &|_, _| {}).unwrap();
        let done = naam_bench::driver::completed(&r.ops);
        let errors: u64 = r.ops.iter().map(|o| o.errors).sum();
        assert_eq!((done, errors), (1500, 0), "{app:?} {w}");
        assert_eq!(r.mode, MEMORY_MODE);
    }
}

#[test]
fn every_placement_serves_reads_through_the_endpoints() {
    // Host: the server endpoint's switch keeps it; NIC: forwarded to the NIC endpoint; Client:
    // the client runs the handler over one-sided reads from the NIC's agent.
    for p in Placement::ALL {
        let r = run_inproc_endpoints(&cfg(App::Mica, 'c', PlacementChoice::Fixed(p)), &|_, _| {})
            .unwrap();
        let errors: u64 = r.ops.iter().map(|o| o.errors).sum();
        assert_eq!(errors, 0, "{p}");
        assert!(
            r.placement_fractions[p.index()] > 0.99,
            "{p}: {:?}",
            r.placement_fractions
        );
    }
}

#[test]
fn pipelined_sessions_run_every_operation_kind_through_the_endpoints() {
    // Eight operations in flight per client thread: MICA's pipeline, and the B-tree's with
    // updates (A), lookups (C), scans and inserts (E) and read-modify-writes (F). Every
    // operation is answered once, none fails.
    for (app, w) in [
        (App::Mica, 'b'),
        (App::Mica, 'f'),
        (App::Btree, 'a'),
        (App::Btree, 'c'),
        (App::Btree, 'e'),
        (App::Btree, 'f'),
    ] {
        let mut c = cfg(app, w, PlacementChoice::Auto);
        c.pipeline = 8;
        let r = run_inproc_endpoints(&c, &|_, _| {}).unwrap();
        let done = naam_bench::driver::completed(&r.ops);
        let errors: u64 = r.ops.iter().map(|o| o.errors).sum();
        assert_eq!((done, errors), (1500, 0), "{app:?} {w}, pipeline 8");
    }
}

/// A client in the server's process lends each reply where the server wrote it
/// (`UdpClient::call_with`); one that returns its replies (`Returned`: `UdpClient::call`) must
/// read the same table the same way, errors included (an update or delete of an absent key).
/// Two clients of one MICA table, each op's effect checked through both against a model.
#[test]
fn replies_lent_in_place_read_as_returned_replies_do() {
    use std::collections::HashMap;

    use naam_bench::deployment::{shm_dir, DeploymentPlan, InProcessDeployment};
    use naam_bench::driver::UdpSetup;
    use naam_mica::{MicaClient, MicaConfig};
    use naam_runtime::cluster::ClusterConfig;
    use naam_runtime::proto::session::{Authentication, Credential};
    use naam_runtime::proto::transport::Returned;
    use naam_runtime::udp::{HostApp, MemoryNet};

    let mc = MicaConfig::preset_16_64(1024);
    let loaded = std::sync::Arc::new(naam_mica::handlers().unwrap());
    let credential = Credential::generate(&naam_runtime::entropy::os()).unwrap();
    let plan = DeploymentPlan {
        app: HostApp {
            spec: naam_mica::app_spec(1, &mc, loaded, Placement::Host).unwrap(),
            kind: "mica".into(),
            params: serde_json::to_value(mc).unwrap(),
            object_bytes: naam_mica::HANDLERS_OBJECT.to_vec(),
            client_writes: false,
            credential: Some(credential.clone()),
        },
        tenant: "mica".into(),
        credential,
        host: ClusterConfig::default(),
        nic: ClusterConfig::default(),
        authentication: Authentication::InProcess,
        congestion_control: false,
        network: Some(MemoryNet::new()),
        others: Vec::new(),
        deploys: None,
    };
    let shm = shm_dir(&format!("naam-bench-lent-replies-{}", std::process::id()));
    let d = InProcessDeployment::start(shm, plan).unwrap();
    let mut config = d.client_config();
    config.pin = Some(Placement::Host);
    let setup = UdpSetup::with_config(App::Mica, config).unwrap();
    let mut lent = MicaClient::new(setup.connect().unwrap(), setup.mica().unwrap());
    let mut returned = MicaClient::new(Returned(setup.connect().unwrap()), setup.mica().unwrap());

    let key = |k: u32| format!("key-{k:012}").into_bytes();
    let value = |k: u32, round: u32| vec![(k + round) as u8; 64];
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    // A fixed walk over 40 keys: puts, updates, deletes and gets, each written through one
    // client in turn and read back through both.
    let mut x: u32 = 12345;
    for round in 0..600u32 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let k = (x >> 8) % 40;
        let (writer, other) = if round % 2 == 0 { (0, 1) } else { (1, 0) };
        let (kk, v) = (key(k), value(k, round));
        match (x >> 4) % 4 {
            0 => {
                let had = model.insert(kk.clone(), v.clone()).is_some();
                let put = if writer == 0 {
                    lent.put(&kk, &v)
                } else {
                    returned.put(&kk, &v)
                };
                assert_eq!(put.unwrap(), had, "round {round}: put");
            }
            1 => {
                let had = model.contains_key(&kk);
                let updated = if writer == 0 {
                    lent.update(&kk, &v)
                } else {
                    returned.update(&kk, &v)
                };
                assert_eq!(updated.unwrap(), had, "round {round}: update");
                if had {
                    model.insert(kk.clone(), v);
                }
            }
            2 => {
                let had = model.remove(&kk).is_some();
                let deleted = if writer == 0 {
                    lent.delete(&kk)
                } else {
                    returned.delete(&kk)
                };
                assert_eq!(deleted.unwrap(), had, "round {round}: delete");
            }
            _ => {}
        }
        let want = model.get(&kk).cloned();
        for reader in [writer, other] {
            let got = if reader == 0 {
                lent.get(&kk)
            } else {
                returned.get(&kk)
            };
            assert_eq!(
                got.unwrap(),
                want,
                "round {round}: get through client {reader}"
            );
        }
    }
    drop((lent, returned));
    d.stop();
}
