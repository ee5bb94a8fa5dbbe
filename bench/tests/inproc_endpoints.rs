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
        let done: u64 = r.ops.iter().map(|o| o.latency.count).sum();
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
        let done: u64 = r.ops.iter().map(|o| o.latency.count).sum();
        let errors: u64 = r.ops.iter().map(|o| o.errors).sum();
        assert_eq!((done, errors), (1500, 0), "{app:?} {w}, pipeline 8");
    }
}
