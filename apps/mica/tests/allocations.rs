//! No allocation per message on the paths that run a message where its data is: direct
//! execution and the in-process cluster's run to completion (the main job's reads and
//! writes). A counting allocator counts the test thread's own allocations; every path is
//! warmed up first, so buffers that grow once (the step machine's reply buffer, write batch
//! vectors, load reports) have grown. What outlives a message (a write's answer, kept for
//! deduplication; a request's args) is copied into shared chunks, which cost an allocation
//! per chunk, not per message.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use naam_mica::{app_spec, handlers, MicaClient, MicaConfig, MicaHandle};
use naam_proto::transport::Transport;
use naam_proto::Placement;
use naam_runtime::cluster::{Cluster, ClusterConfig, PolicyChoice};
use naam_runtime::Direct;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator unchanged; the counter is a
// thread-local cell that needs no allocation of its own.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(|n| n.get())
}

const APP: u32 = 3;
const KEYS: usize = 256;
const MESSAGES: usize = 2_000;

fn key(i: usize) -> [u8; 16] {
    let mut k = *b"user000000000000";
    let digits = format!("{i:012}");
    k[4..].copy_from_slice(digits.as_bytes());
    k
}

/// Runs `MESSAGES` GETs (read handler) and `MESSAGES` UPDATEs (write handler) through
/// `client`, after a warm-up of the same, and returns the allocations each batch made.
fn count<T: Transport>(client: &mut MicaClient<T>) -> (u64, u64) {
    let keys: Vec<[u8; 16]> = (0..KEYS).map(key).collect();
    let value = [7u8; 64];
    for k in &keys {
        client.put(k, &value).unwrap();
    }
    let mut sink = [0u8; 64];
    let mut run = |client: &mut MicaClient<T>, writes: bool| {
        let before = allocations();
        for i in 0..MESSAGES {
            let k = &keys[(i * 7919) % KEYS];
            if writes {
                assert!(client.update(k, &value).unwrap());
            } else {
                let hit = client.get_with(k, |v| sink[..v.len()].copy_from_slice(v));
                assert!(hit.unwrap().is_some());
            }
        }
        allocations() - before
    };
    run(client, false);
    run(client, true);
    (run(client, false), run(client, true))
}

fn config() -> MicaConfig {
    MicaConfig::preset_16_64(4_096)
}

#[test]
fn direct_execution_allocates_nothing_per_message() {
    let object = Arc::new(handlers().unwrap());
    let spec = app_spec(APP, &config(), object, Placement::Host).unwrap();
    let direct = Direct::new(std::slice::from_ref(&spec)).unwrap();
    let handle = MicaHandle::with_keys(APP, config(), |n| direct.region_key(APP, n)).unwrap();
    let mut client = MicaClient::new(direct, handle);
    let (gets, updates) = count(&mut client);
    assert_eq!(gets, 0, "{MESSAGES} GETs allocated {gets} times");
    assert_eq!(updates, 0, "{MESSAGES} UPDATEs allocated {updates} times");
}

/// A cluster whose steering keeps every read at the host (so a client runs it to completion
/// in its own thread), serving the MICA table, and the table's handle.
fn host_only_cluster() -> (Cluster, MicaHandle) {
    let object = Arc::new(handlers().unwrap());
    let mut host_only = ClusterConfig::default();
    host_only.policy = PolicyChoice::Always(Placement::Host);
    let cluster = Cluster::builder()
        .config(host_only)
        .app(app_spec(APP, &config(), object, Placement::Host).unwrap())
        .build()
        .unwrap();
    let handle = MicaHandle::from_cluster(&cluster, APP, config()).unwrap();
    (cluster, handle)
}

#[test]
fn run_to_completion_in_the_cluster_allocates_nothing_per_message() {
    let (cluster, handle) = host_only_cluster();
    let mut client = MicaClient::new(cluster.client(), handle);
    let (gets, updates) = count(&mut client);
    assert_eq!(gets, 0, "{MESSAGES} GETs allocated {gets} times");
    // The deduplication table keeps every write's answer for a while: their chunks, and the
    // table itself, grow now and then.
    assert!(
        updates <= MESSAGES as u64 / 100,
        "{MESSAGES} UPDATEs allocated {updates} times"
    );
}

/// Pipelined, as the RESP front and YCSB's `--pipeline` run: `WINDOW` operations in flight
/// and their answers held until the next poll. Each operation's args are kept for its
/// resubmission and each read's payload outlives the next message: kept in recycled buffers
/// and shared chunks, they cost an allocation now and then, not one per message.
#[test]
fn pipelined_operations_in_the_cluster_allocate_less_than_once_per_message() {
    use naam_mica::MicaPipeline;
    use naam_proto::transport::Immediate;
    const WINDOW: usize = 16;
    let (cluster, handle) = host_only_cluster();
    let mut pipe = MicaPipeline::new(Immediate::new(cluster.client()), handle);
    let keys: Vec<[u8; 16]> = (0..KEYS).map(key).collect();
    let value = [7u8; 64];
    let run = |pipe: &mut MicaPipeline<_>, writes: bool| {
        let before = allocations();
        let mut i = 0;
        while i < MESSAGES {
            for j in 0..WINDOW {
                let k = &keys[((i + j) * 7919) % KEYS];
                let tag = (i + j) as u64;
                if writes {
                    pipe.put(tag, k, &value).unwrap();
                } else {
                    pipe.get(tag, k).unwrap();
                }
            }
            let mut answered = 0;
            while answered < WINDOW {
                for (_, done) in pipe.poll(true) {
                    done.unwrap();
                    answered += 1;
                }
            }
            i += WINDOW;
        }
        allocations() - before
    };
    run(&mut pipe, true);
    run(&mut pipe, false);
    let (puts, gets) = (run(&mut pipe, true), run(&mut pipe, false));
    // Per poll round, a few (the answers' vectors); per message, none.
    let rounds = (MESSAGES / WINDOW) as u64;
    assert!(
        gets <= 3 * rounds,
        "{MESSAGES} pipelined GETs allocated {gets} times ({rounds} rounds)"
    );
    assert!(
        puts <= 3 * rounds + MESSAGES as u64 / 50,
        "{MESSAGES} pipelined PUTs allocated {puts} times ({rounds} rounds)"
    );
}
