//! The RDMA verbs backend (feature `verbs`). Runs where an RDMA device exists: two RC queue
//! pairs on it connected to each other, then READ, WRITE, compare-and-swap, fetch-and-add, SEND
//! and RECV, the server side registering NAAM regions, and a UDP client whose Client placement
//! reads the server's regions over RDMA. Where none exists (this machine:
//! no RDMA NIC, no kernel InfiniBand), the tests check the clear error and say they skipped.
#![cfg(feature = "verbs")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use naam_proto::control::RdmaRemote as Remote;
use naam_runtime::verbs::{devices, Device, MemoryRegion, Peers, QueuePair, VerbsError};
use naam_runtime::{RegionMemory, RegionTable, ALL_RIGHTS};

fn device() -> Option<Arc<Device>> {
    match Device::open(None) {
        Ok(d) => Some(d),
        Err(e @ VerbsError::NoDevice) => {
            assert!(e.to_string().contains("no RDMA device"), "{e}");
            eprintln!("SKIPPED: {e}");
            None
        }
        Err(e) => panic!("opening the RDMA device: {e}"),
    }
}

#[test]
fn devices_are_listed_and_a_missing_one_is_named() {
    let all = devices().expect("ibv_get_device_list");
    match Device::open(Some("naam-no-such-device")) {
        Err(VerbsError::UnknownDevice(name, _)) => assert_eq!(name, "naam-no-such-device"),
        Err(VerbsError::NoDevice) => assert!(all.is_empty()),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("opened a device that does not exist"),
    }
}

#[test]
fn one_sided_and_two_sided_operations_on_a_loopback_pair() {
    let Some(dev) = device() else { return };
    let t = Duration::from_secs(5);
    let mut mem = vec![0u64; 64];
    let mr =
        unsafe { MemoryRegion::register(&dev, mem.as_mut_ptr().cast(), 512, ALL_RIGHTS) }.unwrap();
    let (a, b) = (
        QueuePair::create(&dev).unwrap(),
        QueuePair::create(&dev).unwrap(),
    );
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    // The NIC writes behind the compiler's back: read words volatile.
    let word = |i: usize| unsafe { std::ptr::read_volatile((mr.addr() as *const u64).add(i)) };
    let remote = |off: u64| Remote {
        addr: mr.addr() + off,
        rkey: mr.rkey(),
    };
    // WRITE words 0..2 to 16..18, READ them back into 32..34.
    unsafe {
        std::ptr::write_volatile(mem.as_mut_ptr(), 7);
        std::ptr::write_volatile(mem.as_mut_ptr().add(1), 9);
    }
    a.write(1, &mr, 0, 16, remote(128)).unwrap();
    dev.wait(1, t).unwrap();
    a.read(2, &mr, 256, 16, remote(128)).unwrap();
    dev.wait(2, t).unwrap();
    assert_eq!((word(16), word(17), word(32), word(33)), (7, 9, 7, 9));
    // CAS word 40 from 0 to 5, then FAA 3: old values land in words 48 and 49.
    a.compare_swap(3, &mr, 384, remote(320), 0, 5).unwrap();
    dev.wait(3, t).unwrap();
    a.fetch_add(4, &mr, 392, remote(320), 3).unwrap();
    dev.wait(4, t).unwrap();
    assert_eq!((word(40), word(48), word(49)), (8, 0, 5));
    // SEND words 0..2 into a RECV posted at word 56.
    b.recv(5, &mr, 448, 16).unwrap();
    a.send(6, &mr, 0, 16).unwrap();
    let done = dev.wait(6, t).unwrap();
    if !done.iter().any(|c| c.wr_id == 5) {
        dev.wait(5, t).unwrap();
    }
    assert_eq!((word(56), word(57)), (7, 9));
}

#[test]
fn the_server_side_registers_regions_and_connects_peers() {
    let Some(dev) = device() else { return };
    let table = RegionTable::new();
    let r = table
        .register(1, "data", ALL_RIGHTS, RegionMemory::from_bytes(&[42u8; 64]))
        .unwrap();
    let peers = Peers::new(dev.clone(), Arc::new(table), &|_, _| ALL_RIGHTS).unwrap();
    let regions = peers.regions();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].naam_rkey, r.rkey);
    let client = QueuePair::create(&dev).unwrap();
    let ours = peers
        .accept("127.0.0.1:1".parse().unwrap(), &client.endpoint())
        .unwrap();
    client.connect(&ours).unwrap();
    let mut buf = vec![0u64; 8];
    let mr = unsafe { MemoryRegion::register(&dev, buf.as_mut_ptr().cast(), 64, 0) }.unwrap();
    client.read(1, &mr, 0, 8, regions[0].remote).unwrap();
    dev.wait(1, Duration::from_secs(5)).unwrap();
    let got = unsafe { std::ptr::read_volatile(mr.addr() as *const u64) };
    assert_eq!(got, u64::from_le_bytes([42; 8]));
}

#[test]
fn a_client_placement_reads_the_server_over_rdma() {
    use common::{examples, rd, words};
    use naam_proto::handler_id;
    use naam_proto::transport::Transport;
    use naam_proto::wire::Status;
    use naam_proto::Placement;
    use naam_runtime::cluster::ClusterConfig;
    use naam_runtime::udp::{UdpClient, UdpConfig};

    let Some(dev) = device() else { return };
    const APP: u32 = 3;
    let shm = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(&examples().0).unwrap();
    let d = dev.clone();
    let host = common::udp_host(
        shm.path(),
        &[APP],
        ClusterConfig::default(),
        false,
        false,
        |c| {
            let read = |_, _| naam_ebpf::abi::ACCESS_READ;
            Some(Arc::new(Peers::new(d, c.regions().clone(), &read).unwrap()) as _)
        },
    );
    let mut cfg = UdpConfig::new(host.addr, common::TENANT, common::tenant_key());
    cfg.pin = Some(Placement::Client);
    let mut c = UdpClient::connect(&cfg).unwrap();
    c.install_handlers(APP, &bytes).unwrap();
    c.use_rdma(&dev).unwrap();
    assert!(c.uses_rdma());
    let sorted = c.manifest().app(APP).unwrap().region_key("sorted").unwrap();
    // No naam-nic runs: the answer comes from RDMA READs of the host's memory.
    let r = c
        .call(
            APP,
            handler_id("bsearch"),
            &words(&[400]),
            &[rd(sorted, 0, 4096)],
        )
        .unwrap();
    assert_eq!((r.status, r.placement), (Status::Ok, Placement::Client));
    assert_eq!(&r.payload[..8], &100u64.to_le_bytes()[..]);
    // Checked before anything is posted: an unknown rkey, a range past the region.
    common::check_descriptor_refusals(&mut c, APP, sorted);
}
