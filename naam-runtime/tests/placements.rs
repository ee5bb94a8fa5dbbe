//! The same messages give the same replies at Client, Nic and Host; multi-step handlers work at
//! every placement; bad descriptors and unknown handlers are error replies.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::{examples, words};
use naam_ebpf::abi::{Descriptor, ACCESS_READ, ACCESS_WRITE};
use naam_proto::handler_id;
use naam_proto::step::{DataPath, DmaModel, InPlace, Limits, OneSided, Outcome, WriteError};
use naam_proto::wire::{Descriptors, Request, Status};
use naam_proto::Placement;
use naam_runtime::executor::{
    apply_owned, one_sided_read, run_message, ClientPath, HostPath, NicPath,
};
use naam_runtime::{HandlerSpec, Registry};
use naam_runtime::{RegionMemory, RegionTable, READ_ONLY, READ_WRITE};
use naam_vm::VerifierConfig;
use naam_vm::Vm;

/// In-process one-sided agent: READs straight from the region table.
struct Agent(Arc<RegionTable>);
impl OneSided for Agent {
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, naam_proto::step::FetchError> {
        one_sided_read(&self.0, app, descs, bufs)?;
        Ok(0)
    }
}

struct World {
    regions: Arc<RegionTable>,
    registry: Registry,
    sorted: u64,
    data: u64,
    other_app_key: u64,
}

const APP: u32 = 7;

fn world() -> World {
    let regions = RegionTable::new();
    let sorted = regions
        .register(
            APP,
            "sorted",
            READ_ONLY,
            RegionMemory::from_bytes(&words(&(0..256u64).map(|i| i * 2).collect::<Vec<_>>())),
        )
        .unwrap()
        .rkey;
    let data = regions
        .register(
            APP,
            "data",
            READ_WRITE,
            RegionMemory::from_bytes(&words(&[24, 1000, 0, 42, 0, 0, 0, 0])),
        )
        .unwrap()
        .rkey;
    let other_app_key = regions
        .register(APP + 1, "other", READ_WRITE, RegionMemory::zeroed(64))
        .unwrap()
        .rkey;
    let mut registry = Registry::new();
    registry.add_app(APP, "test", Placement::Host).unwrap();
    let specs: Vec<HandlerSpec> = [
        "add", "checksum", "bsearch", "two_step", "hash1k", "panics", "oob_read",
    ]
    .into_iter()
    .map(HandlerSpec::read)
    .chain([HandlerSpec::write("store")])
    .collect();
    registry
        .add_handlers(APP, &examples().1, &specs, &VerifierConfig::default())
        .unwrap();
    World {
        regions: Arc::new(regions),
        registry,
        sorted,
        data,
        other_app_key,
    }
}

fn req(handler: &str, args: Vec<u8>, descs: &[Descriptor]) -> Request {
    Request::new(
        APP,
        handler_id(handler),
        1,
        Bytes::from(args),
        Descriptors::from_slice(descs).unwrap(),
    )
}

fn d(rkey: u64, offset: u64, len: u32) -> Descriptor {
    Descriptor {
        rkey,
        offset,
        len,
        access: ACCESS_READ,
    }
}

fn run_at(w: &World, placement: Placement, r: &Request) -> Outcome {
    let handler = match w.registry.handler(r.app, r.handler) {
        Ok(h) => h.clone(),
        Err(e) => return Outcome::error(Status::UnknownHandler, 0, e.to_string(), 0),
    };
    let mut vm = Vm::new();
    let limits = Limits::default();
    // At the host, through the segments granted in place (what naam-server does).
    let owner = |batch: &naam_proto::step::WriteBatch<'_>,
                 in_place: Option<InPlace<'_>>|
     -> Result<(), WriteError> {
        if placement == Placement::Host {
            apply_owned(&w.regions, batch, in_place)
        } else {
            Err(WriteError::NotOwner)
        }
    };
    fn go<P: DataPath>(
        r: &Request,
        h: Arc<naam_runtime::HandlerEntry>,
        p: &mut P,
        vm: &mut Vm,
        l: Limits,
        o: impl FnMut(&naam_proto::step::WriteBatch<'_>, Option<InPlace<'_>>) -> Result<(), WriteError>,
    ) -> Outcome {
        run_message(r, &h, p, vm, l, &naam_runtime::SystemClock::new(), o).0
    }
    match placement {
        Placement::Host => go(
            r,
            handler,
            &mut HostPath::new(w.regions.clone()),
            &mut vm,
            limits,
            owner,
        ),
        Placement::Nic => go(
            r,
            handler,
            &mut NicPath::new(w.regions.clone(), DmaModel::default()),
            &mut vm,
            limits,
            owner,
        ),
        Placement::Client => go(
            r,
            handler,
            &mut ClientPath::new(Agent(w.regions.clone())),
            &mut vm,
            limits,
            owner,
        ),
    }
}

fn same_everywhere(w: &World, r: &Request) -> Outcome {
    let host = run_at(w, Placement::Host, r);
    for p in [Placement::Nic, Placement::Client] {
        let c = run_at(w, p, r);
        assert_eq!(
            (c.status, c.code, &c.payload, c.steps),
            (host.status, host.code, &host.payload, host.steps),
            "{p} vs host for {r:?}"
        );
    }
    host
}

#[test]
fn identical_replies_at_every_placement() {
    let w = world();
    let c = same_everywhere(&w, &req("add", words(&[40, 2]), &[]));
    assert_eq!((c.status, &c.payload[..]), (Status::Ok, &words(&[42])[..]));
    for key in [0u64, 7, 100, 510, 511, 9999] {
        let c = same_everywhere(&w, &req("bsearch", words(&[key]), &[d(w.sorted, 0, 2048)]));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(c.payload[..8], key.div_ceil(2).min(256).to_le_bytes());
    }
    let c = same_everywhere(&w, &req("checksum", vec![], &[d(w.sorted, 0, 1024)]));
    assert_eq!(c.status, Status::Ok);
    let c = same_everywhere(&w, &req("hash1k", words(&[5]), &[d(w.sorted, 8, 512)]));
    let mut bytes = vec![0u8; 512];
    w.regions
        .get(APP, w.sorted)
        .unwrap()
        .mem
        .read(8, &mut bytes)
        .unwrap();
    assert_eq!(
        c.payload[..],
        naam_ebpf::hash::hash64(&bytes, 5).to_le_bytes()
    );
}

#[test]
fn multi_step_handler_at_every_placement() {
    let w = world();
    let c = same_everywhere(&w, &req("two_step", words(&[w.data]), &[d(w.data, 0, 16)]));
    assert_eq!(
        (c.status, c.steps, &c.payload[..]),
        (Status::Ok, 2, &words(&[1042])[..])
    );
}

#[test]
fn hop_limit_stops_continuations() {
    let w = world();
    let mut r = req("two_step", words(&[w.data]), &[d(w.data, 0, 16)]);
    r.steps = 32;
    let c = same_everywhere(&w, &r);
    assert_eq!(c.status, Status::HopLimit);
}

#[test]
fn bad_descriptors_are_error_replies() {
    let w = world();
    let cases = [
        (d(0xdead_beef, 0, 8), Status::BadKey),
        (d(w.other_app_key, 0, 8), Status::BadKey),
        (d(w.sorted, 2040, 16), Status::OutOfRange),
        (d(w.sorted, u64::MAX - 3, 8), Status::OutOfRange),
        (
            Descriptor {
                rkey: w.sorted,
                offset: 0,
                len: 8,
                access: ACCESS_READ | ACCESS_WRITE,
            },
            Status::AccessDenied,
        ),
    ];
    for (desc, status) in cases {
        let c = same_everywhere(&w, &req("checksum", vec![], &[desc]));
        assert_eq!(
            c.status,
            status,
            "{desc:?}: {}",
            String::from_utf8_lossy(&c.payload)
        );
    }
    // A descriptor produced by a handler's Continue is checked the same way: two_step follows a
    // pointer into region `arg0`; point it at another app's region.
    let c = same_everywhere(
        &w,
        &req("two_step", words(&[w.other_app_key]), &[d(w.data, 0, 16)]),
    );
    assert_eq!(c.status, Status::BadKey);
    // Unknown handler.
    let mut r = req("add", vec![], &[]);
    r.handler = 12345;
    assert_eq!(
        run_at(&w, Placement::Host, &r).status,
        Status::UnknownHandler
    );
    // Handler faults and aborts are replies too, and the world keeps serving.
    let c = same_everywhere(&w, &req("panics", words(&[7]), &[]));
    assert_eq!(c.status, Status::Aborted);
    assert_eq!(
        same_everywhere(&w, &req("add", words(&[1, 1]), &[])).status,
        Status::Ok
    );
}

#[test]
fn writes_only_at_the_owner_and_only_with_write_rights() {
    let w = world();
    let rw = Descriptor {
        rkey: w.data,
        offset: 32,
        len: 32,
        access: ACCESS_READ | ACCESS_WRITE,
    };
    // The client refuses write handlers; the NIC is not the owner here.
    assert_eq!(
        run_at(&w, Placement::Client, &req("store", words(&[77]), &[rw])).status,
        Status::PlacementRefused
    );
    assert_eq!(
        run_at(&w, Placement::Nic, &req("store", words(&[77]), &[rw])).status,
        Status::NotOwner
    );
    let c = run_at(&w, Placement::Host, &req("store", words(&[77]), &[rw]));
    assert_eq!(
        c.status,
        Status::Ok,
        "{}",
        String::from_utf8_lossy(&c.payload)
    );
    assert_eq!(
        w.regions
            .get(APP, w.data)
            .unwrap()
            .mem
            .load_u64(32)
            .unwrap(),
        77
    );
    // A read-only descriptor cannot carry a write; a read-only region cannot be written.
    let ro = d(w.data, 32, 32);
    let c = run_at(&w, Placement::Host, &req("store", words(&[5]), &[ro]));
    assert_eq!(c.status, Status::Refused);
    let sorted_rw = Descriptor {
        rkey: w.sorted,
        offset: 0,
        len: 32,
        access: ACCESS_READ | ACCESS_WRITE,
    };
    assert_eq!(
        run_at(
            &w,
            Placement::Host,
            &req("store", words(&[5]), &[sorted_rw])
        )
        .status,
        Status::AccessDenied
    );
    assert_eq!(
        w.regions
            .get(APP, w.data)
            .unwrap()
            .mem
            .load_u64(32)
            .unwrap(),
        77,
        "nothing written"
    );
}
