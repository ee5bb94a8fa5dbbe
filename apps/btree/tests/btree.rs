//! The B-tree on NAAM: equivalence with `BTreeMap` and with the native reference at every
//! placement (small nodes, so splits and deep trees happen early), readers racing a writer that
//! splits nodes, stale roots, steering mid-run, and bad input.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use naam_btree::reference::NativeBTree;
use naam_btree::{
    app_spec, handlers, BTreeClient, BTreeConfig, BTreeDone, BTreeError, BTreeHandle,
    BTreePipeline, Written,
};
use naam_ebpf::abi::{Descriptor, ACCESS_READ};
use naam_proto::handler_id;
use naam_proto::transport::{ClientError, Pipeline, Returned};
use naam_proto::wire::Status;
use naam_proto::Placement;
use naam_runtime::cluster::{Cluster, ClusterConfig, PolicyChoice};
use naam_runtime::vm::LoadedObject;
use naam_runtime::{Direct, Pinned};
use proptest::prelude::*;

const APP: u32 = 9;

fn object() -> Arc<LoadedObject> {
    static OBJ: OnceLock<Arc<LoadedObject>> = OnceLock::new();
    OBJ.get_or_init(|| Arc::new(handlers().expect("loading the embedded handler object")))
        .clone()
}

fn cluster_with(config: BTreeConfig, cc: ClusterConfig) -> Cluster {
    Cluster::builder()
        .config(cc)
        .app(app_spec(APP, &config, object(), Placement::Host).unwrap())
        .build()
        .unwrap()
}

fn pinned(c: &Cluster, config: BTreeConfig, p: Placement) -> BTreeClient<Pinned> {
    let h = BTreeHandle::from_cluster(c, APP, config).unwrap();
    BTreeClient::new(
        Pinned {
            client: c.client(),
            placement: p,
        },
        h,
    )
}

/// 128-byte nodes: 5 entries each, so a few dozen keys make a three-level tree.
fn small() -> BTreeConfig {
    BTreeConfig {
        node_size: 128,
        max_nodes: 4096,
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u64, u64),
    Update(u64, u64),
    Get(u64),
    Scan(u64, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u64..200;
    prop_oneof![
        4 => (key.clone(), any::<u64>()).prop_map(|(k, v)| Op::Insert(k * 3, v)),
        1 => (key.clone(), any::<u64>()).prop_map(|(k, v)| Op::Update(k * 3, v)),
        3 => key.clone().prop_map(|k| Op::Get(k * 3)),
        1 => (key, 0usize..40).prop_map(|(k, n)| Op::Scan(k * 3, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn behaves_as_a_btreemap_at_every_placement(ops in proptest::collection::vec(op(), 1..120)) {
        let config = small();
        let c = cluster_with(config, ClusterConfig::functional());
        let mut model = BTreeMap::new();
        let mut clients: Vec<_> = Placement::ALL.iter().map(|&p| pinned(&c, config, p)).collect();
        for (i, op) in ops.iter().enumerate() {
            let t = &mut clients[i % 3];
            match *op {
                Op::Insert(k, v) => {
                    let w = t.insert(k, v).unwrap();
                    prop_assert_eq!(w == Written::Replaced, model.insert(k, v).is_some());
                }
                Op::Update(k, v) => {
                    let had = model.contains_key(&k);
                    prop_assert_eq!(t.update(k, v).unwrap(), had);
                    if had { model.insert(k, v); }
                }
                Op::Get(k) => prop_assert_eq!(t.get(k).unwrap(), model.get(&k).copied(), "get {} at {}", k, Placement::ALL[i % 3]),
                Op::Scan(k, n) => {
                    let want: Vec<(u64, u64)> = model.range(k..).take(n).map(|(a, b)| (*a, *b)).collect();
                    prop_assert_eq!(t.scan(k, n).unwrap(), want, "scan {} {} at {}", k, n, Placement::ALL[i % 3]);
                }
            }
        }
        // Every placement sees the whole tree the same way.
        let all: Vec<(u64, u64)> = model.iter().map(|(a, b)| (*a, *b)).collect();
        for t in &mut clients {
            prop_assert_eq!(t.scan(0, 256).unwrap(), all.iter().take(256).copied().collect::<Vec<_>>());
        }
    }
}

fn direct(config: BTreeConfig) -> (Direct, BTreeHandle) {
    let d = Direct::new(&[app_spec(APP, &config, object(), Placement::Host).unwrap()]).unwrap();
    let handle = BTreeHandle::with_keys(APP, config, |n| d.region_key(APP, n)).unwrap();
    (d, handle)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    /// Direct execution lends each reply in place; a transport that returns replies lends
    /// its reply instead. Both behave as a map through splits, misses and scans.
    #[test]
    fn replies_read_in_place_answer_as_returned_replies_do(ops in proptest::collection::vec(op(), 1..120)) {
        let config = small();
        let (d, handle) = direct(config);
        let mut in_place = BTreeClient::new(d, handle);
        let (d, handle) = direct(config);
        let mut returned = BTreeClient::new(Returned(d), handle);
        let mut model = BTreeMap::new();
        for op in &ops {
            match *op {
                Op::Insert(k, v) => {
                    let had = model.insert(k, v).is_some();
                    prop_assert_eq!(in_place.insert(k, v).unwrap() == Written::Replaced, had);
                    prop_assert_eq!(returned.insert(k, v).unwrap() == Written::Replaced, had);
                }
                Op::Update(k, v) => {
                    let had = model.contains_key(&k);
                    prop_assert_eq!(in_place.update(k, v).unwrap(), had);
                    prop_assert_eq!(returned.update(k, v).unwrap(), had);
                    if had { model.insert(k, v); }
                }
                Op::Get(k) => {
                    prop_assert_eq!(in_place.get(k).unwrap(), model.get(&k).copied());
                    prop_assert_eq!(returned.get(k).unwrap(), model.get(&k).copied());
                }
                Op::Scan(k, n) => {
                    let want: Vec<(u64, u64)> = model.range(k..).take(n).map(|(a, b)| (*a, *b)).collect();
                    prop_assert_eq!(in_place.scan(k, n).unwrap(), want.clone());
                    prop_assert_eq!(returned.scan(k, n).unwrap(), want);
                }
            }
        }
    }
}

#[test]
fn matches_the_native_reference_and_grows_deep() {
    let config = small();
    let c = cluster_with(config, ClusterConfig::functional());
    let mut native = NativeBTree::new(config);
    let mut t = pinned(&c, config, Placement::Host);
    let mut x = 88172645463325252u64;
    for i in 0..1500u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = x % 5000;
        assert_eq!(t.insert(k, i).unwrap(), native.insert(k, i), "insert {k}");
    }
    assert!(native.height() >= 4, "height {}", native.height());
    for k in 0..5000 {
        assert_eq!(t.get(k).unwrap(), native.get(k), "get {k}");
    }
    for start in [0u64, 1, 777, 2500, 4990] {
        assert_eq!(
            t.scan(start, 100).unwrap(),
            native.scan(start, 100),
            "scan {start}"
        );
    }
}

#[test]
fn stale_roots_are_detected_and_refreshed() {
    let config = small();
    let c = cluster_with(config, ClusterConfig::functional());
    let mut reader = pinned(&c, config, Placement::Client);
    assert_eq!(reader.get(1).unwrap(), None); // caches root 0, the current root
    let mut writer = pinned(&c, config, Placement::Host);
    for k in 0..200 {
        writer.insert(k, k * 10).unwrap();
    }
    // The cached root 0 has been split long ago: the reader notices and refreshes.
    assert_eq!(reader.get(150).unwrap(), Some(1500));
    assert!(reader.root_refreshes >= 1);
}

fn value_for(key: u64, seq: u64) -> u64 {
    (seq << 32) | (naam_ebpf::hash::hash64(&(key ^ seq << 20).to_le_bytes(), 3) & 0xffff_ffff)
}

fn check(key: u64, v: u64) -> u64 {
    let seq = v >> 32;
    assert_eq!(v, value_for(key, seq), "torn or foreign value for {key}");
    seq
}

/// Writers in several threads (more than there are cores) insert into one tree at once: each
/// write is optimistic (a CAS on the tree's write version), so every one of them lands, and
/// none gives up.
#[test]
fn concurrent_writers_all_land() {
    let config = BTreeConfig {
        node_size: 256,
        max_nodes: 16_384,
    };
    let c = Arc::new(cluster_with(config, ClusterConfig::functional()));
    const WRITERS: u64 = 6;
    const EACH: u64 = 1_500;
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                let mut w = pinned(&c, config, Placement::Host);
                for i in 0..EACH {
                    let k = (i * WRITERS + t) * 7 + 1;
                    w.insert(k, value_for(k, t)).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let mut r = pinned(&c, config, Placement::Host);
    for t in 0..WRITERS {
        for i in 0..EACH {
            let k = (i * WRITERS + t) * 7 + 1;
            assert_eq!(r.get(k).unwrap(), Some(value_for(k, t)), "key {k}");
        }
    }
}

#[test]
fn readers_race_a_splitting_writer_at_every_placement() {
    let config = BTreeConfig {
        node_size: 256,
        max_nodes: 8192,
    };
    let c = Arc::new(cluster_with(config, ClusterConfig::functional()));
    let mut w = pinned(&c, config, Placement::Host);
    for k in 0..50 {
        w.insert(k * 1000, value_for(k * 1000, 0)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut w = pinned(&c, config, Placement::Host);
            let mut seq = 1u64;
            while !stop.load(Ordering::Relaxed) {
                // New keys between the old ones split leaves and inner nodes; old keys change.
                let k = if seq.is_multiple_of(3) {
                    (seq % 50) * 1000
                } else {
                    (seq * 7919) % 50_000 + 1
                };
                w.insert(k, value_for(k, seq)).unwrap();
                seq += 1;
            }
            seq
        })
    };
    let readers: Vec<_> = Placement::ALL
        .into_iter()
        .map(|p| {
            let (c, stop) = (c.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut r = pinned(&c, config, p);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let k = (n % 50) * 1000;
                    let v = r.get(k).unwrap().expect("old keys are never removed");
                    check(k, v);
                    if n.is_multiple_of(10) {
                        let s = r.scan(k, 20).unwrap();
                        assert!(
                            s.windows(2).all(|w| w[0].0 < w[1].0),
                            "{p}: scans are ordered"
                        );
                        for (key, v) in s {
                            check(key, v);
                        }
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    let reads: Vec<u64> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    assert!(writes > 200, "writer made progress: {writes}");
    assert!(
        reads.iter().all(|&n| n > 20),
        "every placement read: {reads:?}"
    );
}

#[test]
fn steering_moves_readers_mid_run_and_loses_nothing() {
    let config = BTreeConfig::for_keys(20_000);
    let mut cc = ClusterConfig::default();
    cc.policy = PolicyChoice::Auto(Default::default());
    let c = Arc::new(cluster_with(config, cc));
    let h = BTreeHandle::from_cluster(&c, APP, config).unwrap();
    let mut w = BTreeClient::new(c.client(), h);
    for k in 0..2000 {
        w.insert(k, value_for(k, 0)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut r = BTreeClient::new(c.client(), h);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = n * 37 % 2000;
                check(k, r.get(k).unwrap().expect("present"));
                n += 1;
            }
            n
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    c.congestion().limit_host(200_000);
    // Writes go on at the owner while reads move. The read handler's own steering weight shows
    // the move (operation counts would mix in the writes, which must stay at the owner).
    let get = handler_id(naam_btree::handlers::GET);
    let mut moved = false;
    for k in 2000..2300 {
        w.insert(k, value_for(k, 0)).unwrap();
        moved |= c.weights(APP, get).of(Placement::Host) <= 0.1;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !moved && std::time::Instant::now() < deadline {
        moved = c.weights(APP, get).of(Placement::Host) <= 0.1;
        std::thread::sleep(Duration::from_millis(1));
    }
    c.congestion().clear();
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 50);
    assert!(moved, "lookups moved off the congested host");
    for k in 0..2300 {
        check(k, w.get(k).unwrap().expect("nothing lost"));
    }
}

#[test]
fn bad_input_is_refused_and_the_tree_stays_intact() {
    let config = BTreeConfig {
        node_size: 128,
        max_nodes: 8,
    };
    let c = cluster_with(config, ClusterConfig::functional());
    let h = BTreeHandle::from_cluster(&c, APP, config).unwrap();
    let mut t = pinned(&c, config, Placement::Host);
    t.insert(10, 100).unwrap();
    // The reserved key.
    assert!(matches!(
        t.insert(u64::MAX, 1),
        Err(BTreeError::ReservedKey(_))
    ));
    assert!(matches!(t.get(u64::MAX), Err(BTreeError::ReservedKey(_))));
    // A scan past the end is empty, not an error.
    assert_eq!(t.scan(1_000_000, 10).unwrap(), vec![]);
    // Fill the tiny tree until it has no free node: a clear error, and what is in it stays.
    let mut inserted = vec![10u64];
    let full = (0..1000u64)
        .map(|k| k * 2 + 11)
        .find_map(|k| match t.insert(k, k) {
            Ok(_) => {
                inserted.push(k);
                None
            }
            Err(e) => Some(e),
        });
    assert!(matches!(full, Some(BTreeError::Full(8))), "{full:?}");
    // Forged messages: a start node past the region, another app's rkey, a node size that does
    // not match the tree.
    let mut raw = c.client();
    let get = handler_id(naam_btree::handlers::GET);
    let mut args = [0u8; 32];
    args[0..8].copy_from_slice(&h.rkey_nodes.to_le_bytes());
    args[8..16].copy_from_slice(&128u64.to_le_bytes());
    args[16..24].copy_from_slice(&10u64.to_le_bytes());
    let past = Descriptor {
        rkey: h.rkey_nodes,
        offset: 8 * 128,
        len: 128,
        access: ACCESS_READ,
    };
    assert_eq!(
        raw.call(APP, get, &args, &[past]).unwrap().status,
        Status::OutOfRange
    );
    let forged = Descriptor {
        rkey: 0xf00d,
        offset: 0,
        len: 128,
        access: ACCESS_READ,
    };
    assert_eq!(
        raw.call(APP, get, &args, &[forged]).unwrap().status,
        Status::BadKey
    );
    args[8..16].copy_from_slice(&100u64.to_le_bytes());
    let root = Descriptor {
        rkey: h.rkey_nodes,
        offset: 0,
        len: 128,
        access: ACCESS_READ,
    };
    assert_eq!(
        raw.call(APP, get, &args, &[root]).unwrap().status,
        Status::HandlerError
    );
    // Intact: every key that went in is still there.
    for k in inserted {
        assert_eq!(
            t.get(k).unwrap(),
            Some(if k == 10 { 100 } else { k }),
            "{k}"
        );
    }
}

/// Every B-tree handler compiles to aarch64, and real steps (descents, splits, scans) at every
/// placement, replayed as that aarch64 code under qemu-user, compute exactly what the JIT
/// computed on this host.
#[test]
fn aarch64_code_computes_what_the_host_computes() {
    let bytes = naam_runtime::vm::cross::compile_object(&object()).unwrap();
    assert!(bytes > 0);
    if !naam_runtime::vm::cross::available_or_skip("the aarch64 replay") {
        return;
    }
    let check = naam_runtime::vm::cross::CrossCheck::new(1);
    let config = small();
    let c = cluster_with(config, {
        let mut config = ClusterConfig::functional();
        config.cross_check = Some(check.clone());
        config
    });
    let mut native = NativeBTree::new(config);
    let mut t = pinned(&c, config, Placement::Host);
    for i in 0..40u64 {
        let k = i * 37 % 101;
        assert_eq!(t.insert(k, i).unwrap(), native.insert(k, i), "insert {k}");
    }
    assert!(native.height() >= 2, "the inserts split nodes");
    for p in Placement::ALL {
        let mut r = pinned(&c, config, p);
        for k in (0..101).step_by(9) {
            assert_eq!(r.get(k).unwrap(), native.get(k), "get {k} at {p}");
        }
        assert_eq!(r.scan(20, 8).unwrap(), native.scan(20, 8), "scan at {p}");
    }
    c.shutdown();
    assert!(check.problems().is_empty(), "{:#?}", check.problems());
    assert!(
        check.compared() > 80,
        "only {} steps compared",
        check.compared()
    );
}

/// A [`Pipeline`] over a transport that answers at once, which keeps at most `window` answers
/// outstanding (refusing more with `Busy`, as a network transport does when its window is
/// full) and hands back one answer per poll, so that answers and new submissions interleave;
/// it also refuses the next `refuse` submissions, however empty its window.
struct Narrow<T: naam_proto::transport::Transport> {
    inner: T,
    window: usize,
    refuse: usize,
    next: u64,
    answers: std::collections::VecDeque<(u64, Result<naam_proto::wire::Reply, ClientError>)>,
}

impl<T: naam_proto::transport::Transport> Narrow<T> {
    fn new(inner: T, window: usize) -> Self {
        Narrow {
            inner,
            window,
            refuse: 0,
            next: 0,
            answers: Default::default(),
        }
    }
}

impl<T: naam_proto::transport::Transport> naam_proto::transport::Transport for Narrow<T> {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<naam_proto::wire::Reply, ClientError> {
        self.inner.call(app, handler, args, descs)
    }

    fn backoff(&mut self, attempt: u32) {
        self.inner.backoff(attempt)
    }
}

impl<T: naam_proto::transport::Transport> Pipeline for Narrow<T> {
    fn submit(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<u64, ClientError> {
        if self.answers.len() >= self.window || self.refuse > 0 {
            self.refuse = self.refuse.saturating_sub(1);
            return Err(ClientError::Busy(Placement::Host));
        }
        self.next += 1;
        let r = self.inner.call(app, handler, args, descs);
        self.answers.push_back((self.next, r));
        Ok(self.next)
    }

    fn poll(&mut self, _block: bool) -> Vec<(u64, Result<naam_proto::wire::Reply, ClientError>)> {
        self.answers.pop_front().into_iter().collect()
    }

    fn in_flight(&self) -> usize {
        self.answers.len()
    }

    fn window(&self) -> usize {
        self.window
    }
}

/// Starts one operation on a pipeline.
type Start<T> = Box<dyn FnOnce(&mut BTreePipeline<T>) -> Result<(), BTreeError>>;

/// Runs `ops` (each starts its operation with its tag) through `p` keeping as many in flight
/// as its window holds; the answers by tag.
fn run_piped<T: Pipeline>(
    p: &mut BTreePipeline<T>,
    ops: Vec<Start<T>>,
) -> BTreeMap<u64, BTreeDone> {
    let total = ops.len();
    let mut ops = ops.into_iter();
    let mut done = BTreeMap::new();
    let mut started = 0;
    while done.len() < total {
        while started < total && p.in_flight() < p.window() {
            (ops.next().expect("one left"))(p).expect("started");
            started += 1;
        }
        for (tag, r) in p.poll(true) {
            assert!(
                done.insert(tag, r.expect("answered")).is_none(),
                "tag {tag} twice"
            );
        }
    }
    assert_eq!(p.in_flight(), 0);
    done
}

/// The pipelined client through windows of one, three and unbounded, reads at the Client
/// placement (a descent of one-sided READs) and writes at the owner: inserts that split nodes
/// as they go, updates of present and absent keys, a multi-get and scans give the answers a
/// `BTreeMap` gives.
#[test]
fn a_pipeline_answers_as_a_btreemap_does_in_any_window() {
    let config = small();
    for window in [1usize, 3, usize::MAX] {
        let c = cluster_with(config, ClusterConfig::functional());
        let h = BTreeHandle::from_cluster(&c, APP, config).unwrap();
        let transport = Pinned {
            client: c.client(),
            placement: Placement::Client,
        };
        let mut p = BTreePipeline::new(Narrow::new(transport, window), h);
        let mut model = BTreeMap::new();
        type Op = Start<Narrow<Pinned>>;
        let keys: Vec<u64> = (0..120u64).map(|i| i * 37 % 127).collect();
        let inserts: Vec<Op> = keys
            .iter()
            .enumerate()
            .map(|(tag, &k)| {
                Box::new(move |p: &mut BTreePipeline<_>| p.insert(tag as u64, k, k * 10)) as Op
            })
            .collect();
        for (tag, d) in run_piped(&mut p, inserts) {
            assert_eq!(
                d,
                BTreeDone::Written(Some(Written::Inserted)),
                "insert {tag}"
            );
            model.insert(keys[tag as usize], keys[tag as usize] * 10);
        }
        // Updates of every fifth key in 0..130: present ones change, absent ones do not.
        let targets: Vec<u64> = (0..130u64).step_by(5).collect();
        let updates: Vec<Op> = targets
            .iter()
            .enumerate()
            .map(|(tag, &k)| {
                Box::new(move |p: &mut BTreePipeline<_>| p.update(tag as u64, k, k + 1)) as Op
            })
            .collect();
        for (tag, d) in run_piped(&mut p, updates) {
            let k = targets[tag as usize];
            let present = model.contains_key(&k);
            let expected = present.then_some(Written::Replaced);
            assert_eq!(d, BTreeDone::Written(expected), "update {k}");
            if present {
                model.insert(k, k + 1);
            }
        }
        let all: Vec<u64> = (0..140).collect();
        let got = p.multi_get(&all).unwrap();
        for (k, v) in all.iter().zip(&got) {
            assert_eq!(v.as_ref(), model.get(k), "get {k} (window {window})");
        }
        let starts = [0u64, 17, 60, 126, 500];
        let scans: Vec<Op> = starts
            .iter()
            .enumerate()
            .map(|(tag, &s)| {
                Box::new(move |p: &mut BTreePipeline<_>| p.scan(tag as u64, s, 40)) as Op
            })
            .collect();
        for (tag, d) in run_piped(&mut p, scans) {
            let s = starts[tag as usize];
            let expected: Vec<(u64, u64)> =
                model.range(s..).take(40).map(|(k, v)| (*k, *v)).collect();
            assert_eq!(
                d,
                BTreeDone::Scanned(expected),
                "scan from {s} (window {window})"
            );
        }
        assert!(matches!(
            p.get(0, naam_btree::layout::NO_KEY),
            Err(BTreeError::ReservedKey(_))
        ));
        assert!(p.scan(0, 1, 0).is_err(), "a scan of nothing is refused");
        c.shutdown();
    }
}

/// Readers in flight that meet a stale root wait for one root read, then go again from the new
/// root, even when the window has no room for that read at once.
#[test]
fn pipelined_readers_share_one_root_read_when_the_root_went_stale() {
    let config = small();
    let c = cluster_with(config, ClusterConfig::functional());
    let h = BTreeHandle::from_cluster(&c, APP, config).unwrap();
    let transport = Pinned {
        client: c.client(),
        placement: Placement::Client,
    };
    let mut p = BTreePipeline::new(Narrow::new(transport, 2), h);
    assert_eq!(p.multi_get(&[1]).unwrap(), vec![None]); // root 0, the current root
    let mut writer = pinned(&c, config, Placement::Host);
    for k in 0..200 {
        writer.insert(k, k * 10).unwrap();
    }
    let keys: Vec<u64> = (0..220).step_by(11).collect();
    let got = p.multi_get(&keys).unwrap();
    let expected: Vec<Option<u64>> = keys.iter().map(|&k| (k < 200).then_some(k * 10)).collect();
    assert_eq!(got, expected);
    assert_eq!(
        p.root_refreshes(),
        1,
        "one root read for the readers that met the stale root"
    );
    // The root splits again; this time the root read finds no room at first, and goes at the
    // next poll.
    for k in 200..600 {
        writer.insert(k, k * 10).unwrap();
    }
    p.get(7, 550).unwrap();
    p.transport().refuse = 1;
    let mut answers = Vec::new();
    while answers.is_empty() {
        answers = p.poll(true);
    }
    assert!(
        matches!(&answers[..], [(7, Ok(BTreeDone::Got(Some(5500))))]),
        "{answers:?}"
    );
    assert_eq!(p.root_refreshes(), 2);
    assert_eq!(p.in_flight(), 0);
    c.shutdown();
}

proptest! {
    /// A tree sized for `keys` keys holds them, as `keys()` counts, and not many more.
    #[test]
    fn a_tree_sized_for_some_keys_holds_them(keys in 0u64..50_000_000, size in prop::sample::select(vec![128usize, 256, 1024, 2048])) {
        let c = BTreeConfig::with_node_size(keys, size);
        let per_leaf = (naam_btree::layout::capacity(size) / 2).max(1) as u64;
        prop_assert!(c.keys() >= keys, "{} < {keys}", c.keys());
        prop_assert!(c.keys() < keys + per_leaf);
    }
}
