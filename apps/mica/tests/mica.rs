//! MICA on NAAM: equivalence with a HashMap and with the native reference at every placement,
//! concurrent readers and a writer, steering mid-run, and bad input.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use naam_ebpf::abi::{Descriptor, ACCESS_READ};
use naam_mica::reference::NativeMica;
use naam_mica::{app_spec, handlers, MicaClient, MicaConfig, MicaError, MicaHandle};
use naam_proto::handler_id;
use naam_proto::transport::{Returned, Transport};
use naam_proto::wire::Status;
use naam_proto::Placement;
use naam_runtime::cluster::{Cluster, ClusterConfig, PolicyChoice};
use naam_runtime::vm::LoadedObject;
use naam_runtime::{Direct, Pinned};
use proptest::prelude::*;

const APP: u32 = 5;

fn object() -> Arc<LoadedObject> {
    static OBJ: OnceLock<Arc<LoadedObject>> = OnceLock::new();
    OBJ.get_or_init(|| Arc::new(handlers().expect("loading the embedded handler object")))
        .clone()
}

fn cluster_with(config: MicaConfig, cluster: ClusterConfig) -> Cluster {
    Cluster::builder()
        .config(cluster)
        .app(app_spec(APP, &config, object(), Placement::Host).unwrap())
        .build()
        .unwrap()
}

fn pinned(c: &Cluster, config: MicaConfig, p: Placement) -> MicaClient<Pinned> {
    let handle = MicaHandle::from_cluster(c, APP, config).unwrap();
    MicaClient::new(
        Pinned {
            client: c.client(),
            placement: p,
        },
        handle,
    )
}

#[derive(Clone, Debug)]
enum Op {
    Put(u8, Vec<u8>),
    Get(u8),
    Update(u8, Vec<u8>),
    Delete(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u8..24;
    let value = proptest::collection::vec(any::<u8>(), 0..=64);
    prop_oneof![
        3 => (key.clone(), value.clone()).prop_map(|(k, v)| Op::Put(k, v)),
        4 => key.clone().prop_map(Op::Get),
        2 => (key.clone(), value).prop_map(|(k, v)| Op::Update(k, v)),
        1 => key.prop_map(Op::Delete),
    ]
}

fn key(k: u8) -> Vec<u8> {
    format!("key-{k:03}").into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// With room for everything (no eviction), MICA behaves as a map at every placement.
    #[test]
    fn behaves_as_a_hashmap_at_every_placement(ops in proptest::collection::vec(op(), 1..80)) {
        let config = MicaConfig::preset_16_64(256);
        let c = cluster_with(config, ClusterConfig::functional());
        for p in Placement::ALL {
            // Each placement reads the same table after the same writes.
            let mut m = pinned(&c, config, p);
            let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
            // Start from what the previous placement left.
            for k in 0..24u8 {
                if let Some(v) = pinned(&c, config, Placement::Host).get(&key(k)).unwrap() {
                    model.insert(key(k), v);
                }
            }
            for op in &ops {
                match op {
                    Op::Put(k, v) => prop_assert_eq!(m.put(&key(*k), v).unwrap(), model.insert(key(*k), v.clone()).is_some()),
                    Op::Get(k) => prop_assert_eq!(m.get(&key(*k)).unwrap(), model.get(&key(*k)).cloned(), "{} {:?}", p, op),
                    Op::Update(k, v) => {
                        let had = model.contains_key(&key(*k));
                        prop_assert_eq!(m.update(&key(*k), v).unwrap(), had);
                        if had { model.insert(key(*k), v.clone()); }
                    }
                    Op::Delete(k) => prop_assert_eq!(m.delete(&key(*k)).unwrap(), model.remove(&key(*k)).is_some()),
                }
            }
        }
    }
}

fn direct(config: MicaConfig) -> Direct {
    Direct::new(&[app_spec(APP, &config, object(), Placement::Host).unwrap()]).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Direct execution lends each reply in place, in the machine the message ran in; a
    /// transport that returns replies (here Direct's own `call`) lends its reply instead.
    /// Both behave as a map, errors included (an update of an absent key).
    #[test]
    fn replies_read_in_place_answer_as_returned_replies_do(ops in proptest::collection::vec(op(), 1..80)) {
        let config = MicaConfig::preset_16_64(256);
        let in_place = direct(config);
        let handle = MicaHandle::with_keys(APP, config, |n| in_place.region_key(APP, n)).unwrap();
        let mut in_place = MicaClient::new(in_place, handle);
        let returned = direct(config);
        let handle = MicaHandle::with_keys(APP, config, |n| returned.region_key(APP, n)).unwrap();
        let mut returned = MicaClient::new(Returned(returned), handle);
        let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        for op in &ops {
            match op {
                Op::Put(k, v) => {
                    let had = model.insert(key(*k), v.clone()).is_some();
                    prop_assert_eq!(in_place.put(&key(*k), v).unwrap(), had);
                    prop_assert_eq!(returned.put(&key(*k), v).unwrap(), had);
                }
                Op::Get(k) => {
                    let want = model.get(&key(*k)).cloned();
                    prop_assert_eq!(in_place.get(&key(*k)).unwrap(), want.clone(), "{:?}", op);
                    prop_assert_eq!(returned.get(&key(*k)).unwrap(), want, "{:?}", op);
                }
                Op::Update(k, v) => {
                    let had = model.contains_key(&key(*k));
                    prop_assert_eq!(in_place.update(&key(*k), v).unwrap(), had);
                    prop_assert_eq!(returned.update(&key(*k), v).unwrap(), had);
                    if had { model.insert(key(*k), v.clone()); }
                }
                Op::Delete(k) => {
                    let had = model.remove(&key(*k)).is_some();
                    prop_assert_eq!(in_place.delete(&key(*k)).unwrap(), had);
                    prop_assert_eq!(returned.delete(&key(*k)).unwrap(), had);
                }
            }
        }
    }
}

/// A handler the app does not have is an error read in place as it is returned.
#[test]
fn an_unknown_handler_reads_in_place_as_it_returns() {
    let config = MicaConfig::preset_16_64(256);
    let mut d = direct(config);
    let returned = d.call(APP, 0xdead, &[], &[]).unwrap();
    let read = d
        .call_with(APP, 0xdead, &[], &[], |r| {
            (r.status, r.code, r.payload.to_vec())
        })
        .unwrap();
    assert_eq!(returned.status, Status::UnknownHandler);
    assert_eq!(
        read,
        (returned.status, returned.code, returned.payload.to_vec())
    );
}

/// Direct remembers the handler its last message named: messages that name PUT, GET, a
/// handler the app does not have, then GET again are each answered by what they name.
#[test]
fn handlers_named_in_turn_each_answer_for_themselves() {
    let config = MicaConfig::preset_16_64(256);
    let d = direct(config);
    let handle = MicaHandle::with_keys(APP, config, |n| d.region_key(APP, n)).unwrap();
    let mut m = MicaClient::new(d, handle);
    assert!(!m.put(b"k", b"v1").unwrap());
    assert_eq!(m.get(b"k").unwrap(), Some(b"v1".to_vec()));
    let unknown = m.transport().call(APP, 0xdead, &[], &[]).unwrap();
    assert_eq!(unknown.status, Status::UnknownHandler);
    assert_eq!(m.get(b"k").unwrap(), Some(b"v1".to_vec()));
    assert!(m.update(b"k", b"v2").unwrap());
    let unknown = m.transport().call(APP + 1, 0xdead, &[], &[]).unwrap();
    assert_eq!(unknown.status, Status::UnknownHandler);
    assert_eq!(m.get(b"k").unwrap(), Some(b"v2".to_vec()));
}

#[test]
fn matches_the_native_reference_through_evictions() {
    // A tiny table: 16 log items and 4 buckets, so the log wraps every 16 writes and buckets fill.
    let config = MicaConfig {
        buckets: 4,
        log_items: 16,
        key_cap: 8,
        value_cap: 8,
    };
    let c = cluster_with(config, ClusterConfig::functional());
    let mut native = NativeMica::new(config);
    let mut clients: Vec<_> = Placement::ALL
        .iter()
        .map(|&p| pinned(&c, config, p))
        .collect();
    let mut rng = 0x1234_5678u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rng >> 33
    };
    for i in 0..1500 {
        let k = format!("k{}", next() % 40).into_bytes();
        let v = (next() as u32).to_le_bytes().to_vec();
        let m = &mut clients[i % 3];
        match next() % 4 {
            0 => assert_eq!(m.put(&k, &v).unwrap(), native.put(&k, &v), "put {i}"),
            1 => assert_eq!(
                m.update(&k, &v).unwrap(),
                native.update(&k, &v),
                "update {i}"
            ),
            2 => assert_eq!(m.delete(&k).unwrap(), native.delete(&k), "delete {i}"),
            _ => assert_eq!(
                m.get(&k).unwrap(),
                native.get(&k),
                "get {i} at {}",
                Placement::ALL[i % 3]
            ),
        }
    }
    assert!(
        native.tail() > 3 * config.log_items,
        "the log wrapped several times"
    );
}

/// A value that proves it was written whole: a sequence number and a checksum of key and number.
fn value_for(key: &[u8], seq: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len.max(16)];
    v[..8].copy_from_slice(&seq.to_le_bytes());
    let mut input = key.to_vec();
    input.extend_from_slice(&seq.to_le_bytes());
    let sum = naam_ebpf::hash::hash64(&input, 7);
    v[8..16].copy_from_slice(&sum.to_le_bytes());
    for (i, b) in v[16..].iter_mut().enumerate() {
        *b = (sum >> (8 * (i % 8))) as u8;
    }
    v
}

fn check_value(key: &[u8], v: &[u8], len: usize) -> u64 {
    assert_eq!(v.len(), len.max(16), "length");
    let seq = u64::from_le_bytes(v[..8].try_into().unwrap());
    assert_eq!(
        v,
        value_for(key, seq, len),
        "torn or foreign value for {}",
        String::from_utf8_lossy(key)
    );
    seq
}

/// Writers in more threads than there are cores rewrite their own keys at once, in an index of
/// 16 buckets (so their writes meet in buckets all the time) over a log that never wraps: the
/// owner runs one write of the app at a time, whichever thread brings it, so every key ends
/// with its last value.
#[test]
fn concurrent_writers_lose_nothing() {
    let config = MicaConfig {
        buckets: 16,
        log_items: 16_384,
        ..MicaConfig::preset_16_64(64)
    };
    let c = Arc::new(cluster_with(config, ClusterConfig::functional()));
    const WRITERS: usize = 6;
    const KEYS: usize = 8;
    const ROUNDS: u64 = 300;
    let name = |t: usize, i: usize| format!("w{t}-{i}").into_bytes();
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                let mut w = pinned(&c, config, Placement::Host);
                for seq in 1..=ROUNDS {
                    for i in 0..KEYS {
                        let k = name(t, i);
                        w.put(&k, &value_for(&k, seq, 24)).unwrap();
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let mut r = pinned(&c, config, Placement::Host);
    for t in 0..WRITERS {
        for i in 0..KEYS {
            let k = name(t, i);
            let v = r.get(&k).unwrap().unwrap_or_else(|| {
                panic!("{} was acknowledged and lost", String::from_utf8_lossy(&k))
            });
            assert_eq!(
                check_value(&k, &v, 24),
                ROUNDS,
                "{}",
                String::from_utf8_lossy(&k)
            );
        }
    }
}

#[test]
fn readers_at_every_placement_never_see_torn_values() {
    let config = MicaConfig::preset_16_64(64 * 1024);
    let c = Arc::new(cluster_with(config, ClusterConfig::functional()));
    let keys: Vec<Vec<u8>> = (0..64)
        .map(|k| format!("user{k:08}").into_bytes())
        .collect();
    let mut w = pinned(&c, config, Placement::Host);
    for k in &keys {
        w.put(k, &value_for(k, 0, 64)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, stop, keys) = (c.clone(), stop.clone(), keys.clone());
        std::thread::spawn(move || {
            let mut w = pinned(&c, config, Placement::Host);
            let mut seq = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let k = &keys[(seq % 64) as usize];
                w.put(k, &value_for(k, seq, 64)).unwrap();
                seq += 1;
            }
            seq
        })
    };
    let readers: Vec<_> = Placement::ALL
        .into_iter()
        .map(|p| {
            let (c, stop, keys) = (c.clone(), stop.clone(), keys.clone());
            std::thread::spawn(move || {
                let mut r = pinned(&c, config, p);
                let mut reads = 0u64;
                let mut last = vec![0u64; 64];
                while !stop.load(Ordering::Relaxed) {
                    let i = (reads * 7919 % 64) as usize;
                    let v = r
                        .get(&keys[i])
                        .unwrap()
                        .expect("no key is ever evicted here");
                    let seq = check_value(&keys[i], &v, 64);
                    assert!(seq >= last[i], "{p}: values of one key go forward");
                    last[i] = seq;
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    let reads: Vec<u64> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    assert!(writes > 100, "writer made progress: {writes}");
    assert!(
        reads.iter().all(|&n| n > 50),
        "every placement read: {reads:?}"
    );
}

#[test]
fn steering_moves_readers_mid_run_and_loses_nothing() {
    let config = MicaConfig::preset_16_64(4096);
    let mut cc = ClusterConfig::default();
    cc.policy = PolicyChoice::Auto(Default::default());
    let c = Arc::new(cluster_with(config, cc));
    let handle = MicaHandle::from_cluster(&c, APP, config).unwrap();
    let keys: Vec<Vec<u8>> = (0..200)
        .map(|k| format!("user{k:08}").into_bytes())
        .collect();
    let last_written = Arc::new(Mutex::new(HashMap::new()));
    let mut m = MicaClient::new(c.client(), handle);
    for k in &keys {
        m.put(k, &value_for(k, 0, 64)).unwrap();
        last_written.lock().unwrap().insert(k.clone(), 0u64);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, stop, keys, last) = (c.clone(), stop.clone(), keys.clone(), last_written.clone());
        std::thread::spawn(move || {
            let mut w = MicaClient::new(c.client(), handle);
            let mut seq = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let k = &keys[(seq * 13 % 200) as usize];
                w.put(k, &value_for(k, seq, 64)).unwrap();
                last.lock().unwrap().insert(k.clone(), seq);
                seq += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let reader = {
        let (c, stop, keys) = (c.clone(), stop.clone(), keys.clone());
        std::thread::spawn(move || {
            let mut r = MicaClient::new(c.client(), handle);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = &keys[(n * 31 % 200) as usize];
                let v = r.get(k).unwrap().expect("present");
                check_value(k, &v, 64);
                n += 1;
            }
            n
        })
    };
    std::thread::sleep(Duration::from_millis(150));
    c.congestion().limit_host(200_000);
    // The GET handler's own steering weight shows the move (operation counts would mix in the
    // writer's PUTs, which must stay at the owner).
    let get = handler_id(naam_mica::handlers::GET);
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    let mut moved = false;
    while !moved && std::time::Instant::now() < deadline {
        moved = c.weights(APP, get).of(Placement::Host) <= 0.1;
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(100));
    c.congestion().clear();
    std::thread::sleep(Duration::from_millis(150));
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let reads = reader.join().unwrap();
    assert!(reads > 100);
    assert!(moved, "GETs moved off the congested host");
    // Nothing was lost: every key holds the last value written to it.
    let mut check = MicaClient::new(c.client(), handle);
    for (k, seq) in last_written.lock().unwrap().iter() {
        let v = check.get(k).unwrap().expect("present");
        assert_eq!(
            check_value(k, &v, 64),
            *seq,
            "{}",
            String::from_utf8_lossy(k)
        );
    }
}

#[test]
fn bad_input_is_refused_and_the_table_stays_intact() {
    let config = MicaConfig::preset_8_8(256);
    let c = cluster_with(config, ClusterConfig::functional());
    let handle = MicaHandle::from_cluster(&c, APP, config).unwrap();
    let mut m = pinned(&c, config, Placement::Host);
    m.put(b"alpha", b"one").unwrap();
    // Oversized keys and values: refused by the client before sending.
    assert!(matches!(
        m.put(b"much-too-long-key", b"x"),
        Err(MicaError::TooLarge { .. })
    ));
    assert!(matches!(
        m.put(b"k", b"value too long"),
        Err(MicaError::TooLarge { .. })
    ));
    assert!(matches!(m.get(b""), Err(MicaError::TooLarge { .. })));
    // The same, forged past the client: the handler refuses (args out of range, lengths over
    // the table's capacity).
    let mut raw = c.client();
    let put = handler_id(naam_mica::handlers::PUT);
    let get = handler_id(naam_mica::handlers::GET);
    let mut args = vec![0u8; 64];
    args[0..8].copy_from_slice(&handle.rkey_meta.to_le_bytes());
    args[8..16].copy_from_slice(&handle.rkey_index.to_le_bytes());
    args[16..24].copy_from_slice(&handle.rkey_log.to_le_bytes());
    args[56..60].copy_from_slice(&1000u32.to_le_bytes()); // key length beyond the args
    let rwa =
        naam_ebpf::abi::ACCESS_READ | naam_ebpf::abi::ACCESS_WRITE | naam_ebpf::abi::ACCESS_ATOMIC;
    let meta = Descriptor {
        rkey: handle.rkey_meta,
        offset: 0,
        len: 48,
        access: rwa,
    };
    let bucket0 = Descriptor {
        rkey: handle.rkey_index,
        offset: 0,
        len: 128,
        access: rwa,
    };
    let r = raw.call(APP, put, &args, &[meta, bucket0]).unwrap();
    assert_eq!(r.status, Status::HandlerError);
    // A key that fits the args but not the table.
    let mut long = args.clone();
    long[56..60].copy_from_slice(&20u32.to_le_bytes());
    long.extend_from_slice(&[b'x'; 20]);
    assert_eq!(
        raw.call(APP, put, &long, &[meta, bucket0]).unwrap().status,
        Status::HandlerError
    );
    // A PUT naming the wrong bucket for its key is refused (it would hide the key).
    let mut wrong = args.clone();
    wrong[56..60].copy_from_slice(&5u32.to_le_bytes());
    wrong.extend_from_slice(b"alpha");
    let h = MicaConfig::keyhash(b"alpha");
    wrong[48..56].copy_from_slice(&h.to_le_bytes());
    let right = naam_mica::layout::bucket_of(h, config.buckets) * 128;
    let other = (right + 128) % (config.buckets * 128);
    wrong[24..32].copy_from_slice(&other.to_le_bytes());
    let b = Descriptor {
        rkey: handle.rkey_index,
        offset: other,
        len: 128,
        access: rwa,
    };
    assert_eq!(
        raw.call(APP, put, &wrong, &[meta, b]).unwrap().status,
        Status::HandlerError
    );
    // Forged descriptors: a bucket past the index, a key of another region, a write right the
    // log does not grant.
    let mut gargs = wrong.clone();
    gargs[24..32].copy_from_slice(&right.to_le_bytes());
    let past = Descriptor {
        rkey: handle.rkey_index,
        offset: config.buckets * 128,
        len: 128,
        access: ACCESS_READ,
    };
    assert_eq!(
        raw.call(APP, get, &gargs, &[past]).unwrap().status,
        Status::OutOfRange
    );
    let forged = Descriptor {
        rkey: 0x5eed,
        offset: 0,
        len: 128,
        access: ACCESS_READ,
    };
    assert_eq!(
        raw.call(APP, get, &gargs, &[forged]).unwrap().status,
        Status::BadKey
    );
    let log_atomic = Descriptor {
        rkey: handle.rkey_log,
        offset: 0,
        len: 32,
        access: rwa,
    };
    assert_eq!(
        raw.call(APP, put, &gargs, &[meta, log_atomic])
            .unwrap()
            .status,
        Status::AccessDenied
    );
    // Intact.
    assert_eq!(m.get(b"alpha").unwrap().as_deref(), Some(&b"one"[..]));
    assert!(!m.put(b"beta", b"two").unwrap(), "beta is new");
    assert_eq!(m.get(b"beta").unwrap().as_deref(), Some(&b"two"[..]));
}

#[test]
fn rmw_reads_modifies_and_writes() {
    let config = MicaConfig::preset_8_8(64);
    let c = cluster_with(config, ClusterConfig::functional());
    let mut m = pinned(&c, config, Placement::Nic);
    assert_eq!(m.rmw(b"n", |v| v.to_vec()).unwrap(), None);
    m.put(b"n", &1u64.to_le_bytes()).unwrap();
    let bump = |v: &[u8]| {
        (u64::from_le_bytes(v.try_into().unwrap()) + 1)
            .to_le_bytes()
            .to_vec()
    };
    for _ in 0..10 {
        m.rmw(b"n", bump).unwrap();
    }
    assert_eq!(m.get(b"n").unwrap(), Some(11u64.to_le_bytes().to_vec()));
}

#[test]
fn rmw_handler_patches_a_field_atomically_at_the_owner() {
    let config = MicaConfig::preset_ycsb(256);
    let c = cluster_with(config, ClusterConfig::functional());
    let mut m = pinned(&c, config, Placement::Client);
    // A YCSB record: 10 fields of 100 bytes.
    let record: Vec<u8> = (0..10u8).flat_map(|f| vec![b'a' + f; 100]).collect();
    m.put(b"user42", &record).unwrap();
    let old = m
        .rmw_field(b"user42", 300, &[b'Z'; 100])
        .unwrap()
        .expect("present");
    assert_eq!(old, record, "the reply is the value before the patch");
    let mut want = record.clone();
    want[300..400].fill(b'Z');
    assert_eq!(m.get(b"user42").unwrap(), Some(want));
    assert_eq!(m.rmw_field(b"nobody", 0, b"x").unwrap(), None);
    // A patch running past the value is refused; nothing changes.
    assert!(matches!(
        m.rmw_field(b"user42", 950, &[b'Q'; 100]),
        Err(MicaError::Server {
            status: Status::HandlerError,
            ..
        })
    ));
    assert_eq!(m.get(b"user42").unwrap().unwrap()[950..], record[950..]);
}

/// Increments from four threads at once, some sharing a bucket with other keys' writes: none
/// is lost (each is one write batch at the owner, retried when another writer won its
/// compare-and-swap), and each thread's answers only grow.
#[test]
fn concurrent_increments_are_never_lost() {
    let config = MicaConfig::preset_16_64(256);
    let c = cluster_with(config, ClusterConfig::functional());
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let mut m = pinned(&c, config, Placement::Host);
            std::thread::spawn(move || {
                let mut last = i64::MIN;
                for i in 0..200u32 {
                    let n = m.incr_by(b"hits", 1).unwrap().expect("an integer");
                    assert!(n > last, "thread {t}: {n} after {last}");
                    last = n;
                    m.put(&[b'k', t, (i % 7) as u8], b"noise").unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut m = pinned(&c, config, Placement::Host);
    assert_eq!(m.get(b"hits").unwrap().as_deref(), Some(&b"800"[..]));
}

/// Every MICA handler compiles to aarch64 (BlueField-2's Cortex-A72), and real steps of a
/// workload at every placement, replayed as that aarch64 code under qemu-user, compute exactly
/// what the JIT computed on this host (r0, instruction count, reply, next descriptors, writes).
#[test]
fn aarch64_code_computes_what_the_host_computes() {
    let bytes = naam_runtime::vm::cross::compile_object(&object()).unwrap();
    assert!(bytes > 0);
    if !naam_runtime::vm::cross::available_or_skip("the aarch64 replay") {
        return;
    }
    let check = naam_runtime::vm::cross::CrossCheck::new(1);
    let config = MicaConfig {
        buckets: 4,
        log_items: 16,
        key_cap: 8,
        value_cap: 8,
    };
    let c = cluster_with(config, {
        let mut config = ClusterConfig::functional();
        config.cross_check = Some(check.clone());
        config
    });
    let mut native = NativeMica::new(config);
    let mut clients: Vec<_> = Placement::ALL
        .iter()
        .map(|&p| pinned(&c, config, p))
        .collect();
    for i in 0..45u64 {
        let k = format!("k{}", i * 7 % 11).into_bytes();
        let v = (i as u32).wrapping_mul(2654435761).to_le_bytes().to_vec();
        let m = &mut clients[i as usize % 3];
        match i % 4 {
            0 | 1 => assert_eq!(m.put(&k, &v).unwrap(), native.put(&k, &v), "put {i}"),
            2 => assert_eq!(
                m.update(&k, &v).unwrap(),
                native.update(&k, &v),
                "update {i}"
            ),
            _ => assert_eq!(m.get(&k).unwrap(), native.get(&k), "get {i}"),
        }
    }
    c.shutdown();
    assert!(check.problems().is_empty(), "{:#?}", check.problems());
    assert!(
        check.compared() > 60,
        "only {} steps compared",
        check.compared()
    );
}

#[test]
fn error_codes_have_names() {
    use naam_ebpf::abi::error_code::{APP_BASE, OUT_OF_BOUNDS};
    assert_eq!(naam_mica::error_name(APP_BASE + 2), "mica:not-found");
    assert_eq!(naam_mica::error_name(APP_BASE + 9), "app(9)");
    assert_eq!(naam_mica::error_name(OUT_OF_BOUNDS), "out-of-bounds");
}

/// The pipelined client: puts, a multi-get of present and absent keys, and field patches, all
/// in flight together; the same answers as one at a time.
#[test]
fn a_pipeline_and_a_multi_get_answer_as_single_calls_do() {
    use naam_mica::{MicaDone, MicaPipeline};
    use naam_proto::transport::Immediate;
    let config = MicaConfig::preset_16_64(1_000);
    let c = cluster_with(config, ClusterConfig::functional());
    let handle = MicaHandle::from_cluster(&c, APP, config).unwrap();
    let mut p = MicaPipeline::new(Immediate::new(c.client()), handle);
    for k in 0..40u8 {
        p.put(k as u64, &key(k), &value_for(&key(k), 1, 32))
            .unwrap();
    }
    let mut done = 0;
    while done < 40 {
        for (tag, r) in p.poll(true) {
            assert_eq!(r.unwrap(), MicaDone::Put(false), "key {tag} is new");
            done += 1;
        }
    }
    let keys: Vec<Vec<u8>> = (0..50u8).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let values = p.multi_get(&refs).unwrap();
    for (i, (k, v)) in keys.iter().zip(&values).enumerate() {
        if i < 40 {
            assert_eq!(v.as_deref(), Some(&value_for(k, 1, 32)[..]));
        } else {
            assert_eq!(*v, None, "absent key");
        }
    }
    p.rmw_field(7, &key(3), 0, b"PATCH").unwrap();
    let got = p.poll(true);
    assert!(
        matches!(&got[..], [(7, Ok(MicaDone::Patched(Some(_))))]),
        "{got:?}"
    );
    let values = p.multi_get(&[&key(3)]).unwrap();
    assert_eq!(&values[0].as_deref().unwrap()[..5], b"PATCH");
    // Updates and deletes of present and absent keys (the RESP front's SET XX and DEL).
    p.update(1, &key(4), b"new").unwrap();
    p.update(2, &key(45), b"new").unwrap();
    p.delete(3, &key(5)).unwrap();
    p.delete(4, &key(46)).unwrap();
    let mut got = Vec::new();
    while got.len() < 4 {
        got.extend(p.poll(true).into_iter().map(|(t, r)| (t, r.unwrap())));
    }
    got.sort_by_key(|g| g.0);
    assert_eq!(
        got,
        vec![
            (1, MicaDone::Updated(true)),
            (2, MicaDone::Updated(false)),
            (3, MicaDone::Deleted(true)),
            (4, MicaDone::Deleted(false)),
        ]
    );
    // Increments: an absent key counts from 0, an integer value is added to, a value that
    // is not an integer and an overflow change nothing.
    let one = |p: &mut MicaPipeline<_>, tag: u64, k: &[u8], by: i64| {
        p.incr_by(tag, k, by).unwrap();
        let got = p.poll(true);
        assert_eq!(got.len(), 1, "{got:?}");
        let (t, r) = got.into_iter().next().unwrap();
        assert_eq!(t, tag);
        r.unwrap()
    };
    assert_eq!(one(&mut p, 5, b"n", 5), MicaDone::Counted(Some(5)));
    assert_eq!(one(&mut p, 6, b"n", -12), MicaDone::Counted(Some(-7)));
    assert_eq!(
        one(&mut p, 7, &key(4), 1),
        MicaDone::Counted(None),
        "not an integer"
    );
    p.put(8, b"big", i64::MAX.to_string().as_bytes()).unwrap();
    p.poll(true);
    assert_eq!(
        one(&mut p, 9, b"big", 1),
        MicaDone::Counted(None),
        "overflow"
    );
    assert_eq!(
        one(&mut p, 10, b"big", i64::MIN),
        MicaDone::Counted(Some(-1))
    );
    assert_eq!(
        one(&mut p, 11, b"min", i64::MIN),
        MicaDone::Counted(Some(i64::MIN))
    );
    assert_eq!(
        one(&mut p, 12, b"min", 0),
        MicaDone::Counted(Some(i64::MIN)),
        "i64::MIN parses"
    );
    let values = p.multi_get(&[&key(4), &key(5), &key(45), b"n"]).unwrap();
    assert_eq!(values[3].as_deref(), Some(&b"-7"[..]));
    assert_eq!(values[0].as_deref(), Some(&b"new"[..]));
    assert_eq!((values[1].clone(), values[2].clone()), (None, None));
    assert_eq!(p.in_flight(), 0);
}
