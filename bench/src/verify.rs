//! `naam-bench verify`: a correctness run against a deployment. Every client thread owns a set
//! of keys, writes versioned values to them and checks that every read returns exactly the last
//! value it wrote (it is the only writer of its keys). Lost retransmitted writes, duplicated
//! writes applied late, torn or stale reads all show up as wrong answers. Runs over any
//! placement while the test harness kills processes or drops packets.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use naam_btree::BTreeClient;
use naam_mica::MicaClient;
use naam_runtime::udp::client::UdpClient;
use naam_runtime::Placement;
use serde::Serialize;

use crate::driver::{App, UdpSetup};
use crate::ycsb::Rng;

/// What a verify run found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyResult {
    /// Mode label.
    pub mode: String,
    /// Operations completed.
    pub ops: u64,
    /// Reads that returned a value other than the last one written.
    pub wrong: u64,
    /// Calls that failed (timeouts, error replies).
    pub errors: u64,
    /// Reads of an acknowledged key that found nothing. MICA is lossy only when its log wraps,
    /// which a verify run's few keys never cause: the CLI counts these as failures.
    pub misses: u64,
    /// Operations per second.
    pub throughput: f64,
    /// Fraction of messages per placement (Client, Nic, Host).
    pub placement_fractions: [f64; 3],
    /// The first few problems, described.
    pub problems: Vec<String>,
}

fn value(t: u64, i: u64, version: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    for w in [t, i, version] {
        v.extend_from_slice(&w.to_le_bytes());
    }
    v.resize(len.max(24), (version % 251) as u8);
    v
}

/// Runs `threads` verifying clients for `duration` (or `ops` operations per thread, whichever
/// ends first); `run` separates the keys of different invocations.
pub fn run(
    setup: &UdpSetup,
    app: App,
    threads: usize,
    ops: u64,
    duration: Duration,
    run: u64,
) -> anyhow::Result<VerifyResult> {
    let failed = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<anyhow::Result<VerifyResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads as u64)
            .map(|t| {
                let failed = &failed;
                s.spawn(move || -> anyhow::Result<VerifyResult> {
                    let client = setup.connect()?;
                    let r = match app {
                        App::Mica => mica_thread(setup, client, t, ops, duration, run),
                        App::Btree => btree_thread(setup, client, t, ops, duration, run),
                    };
                    if r.as_ref().map_or(true, |r| r.wrong > 0) {
                        failed.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a verify thread panicked")))
            })
            .collect()
    });
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    let mut total = VerifyResult {
        mode: naam_runtime::udp::MODE.into(),
        ..VerifyResult::default()
    };
    for r in results {
        let r = r?;
        total.ops += r.ops;
        total.wrong += r.wrong;
        total.errors += r.errors;
        total.misses += r.misses;
        total.problems.extend(r.problems);
    }
    total.problems.truncate(10);
    total.throughput = total.ops as f64 / secs;
    let snap = setup.metrics.snapshot();
    total.placement_fractions = [0, 1, 2].map(|i| snap.fraction(Placement::ALL[i]));
    Ok(total)
}

/// Keys per thread.
const KEYS: u64 = 64;

fn note(r: &mut VerifyResult, what: String) {
    if r.problems.len() < 10 {
        r.problems.push(what);
    }
}

fn mica_thread(
    setup: &UdpSetup,
    client: UdpClient,
    t: u64,
    ops: u64,
    duration: Duration,
    run: u64,
) -> anyhow::Result<VerifyResult> {
    let handle = setup.mica()?;
    let len = handle.config.value_cap.min(100);
    let mut m = MicaClient::new(client, handle);
    let mut r = VerifyResult::default();
    let mut versions = vec![0u64; KEYS as usize];
    // Short enough for any key capacity of 16 bytes or more.
    let key = |i: u64| format!("v{:08x}{t:x}-{i:x}", run as u32);
    let mut rng = Rng::new(run ^ (t + 1).wrapping_mul(0x9e37_79b9));
    let start = Instant::now();
    while r.ops < ops && start.elapsed() < duration {
        let i = rng.range(0, KEYS - 1);
        let k = key(i);
        let write = versions[i as usize] == 0 || rng.range(0, 9) == 0;
        r.ops += 1;
        if write {
            let v = versions[i as usize] + 1;
            // `put` answers whether the key existed before; either way it now holds `v`.
            match m.put(k.as_bytes(), &value(t, i, v, len)) {
                Ok(_) => versions[i as usize] = v,
                Err(e) => {
                    // The write may or may not have happened: the next read may see either.
                    r.errors += 1;
                    note(&mut r, format!("put {k} v{v}: {e}"));
                    versions[i as usize] = u64::MAX;
                }
            }
            continue;
        }
        let want = versions[i as usize];
        match m.get(k.as_bytes()) {
            Ok(Some(got)) => {
                if want == u64::MAX {
                    // After an unanswered write, accept whatever version the key holds now.
                    versions[i as usize] = got
                        .get(16..24)
                        .and_then(|b| b.try_into().ok())
                        .map_or(u64::MAX, u64::from_le_bytes);
                } else if got != value(t, i, want, len) {
                    r.wrong += 1;
                    let gv = got
                        .get(16..24)
                        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
                    note(
                        &mut r,
                        format!("get {k}: want v{want}, got v{gv:?} ({} bytes)", got.len()),
                    );
                }
            }
            Ok(None) => {
                r.misses += 1;
                note(
                    &mut r,
                    format!("get {k}: acknowledged key not found (want v{want})"),
                );
            }
            Err(e) => {
                r.errors += 1;
                note(&mut r, format!("get {k}: {e}"));
            }
        }
    }
    Ok(r)
}

fn btree_thread(
    setup: &UdpSetup,
    client: UdpClient,
    t: u64,
    ops: u64,
    duration: Duration,
    run: u64,
) -> anyhow::Result<VerifyResult> {
    let handle = setup.btree()?;
    let mut b = BTreeClient::new(client, handle);
    let mut r = VerifyResult::default();
    let mut versions = vec![0u64; KEYS as usize];
    // Keys of this run and thread: distinct, spread over the key space.
    let key = |i: u64| naam_ebpf::hash::finish(run ^ (t << 32) ^ i) | 1;
    let val = |i: u64, v: u64| (t << 48) ^ (i << 32) ^ v;
    let mut rng = Rng::new(run ^ (t + 7).wrapping_mul(0x9e37_79b9));
    let start = Instant::now();
    while r.ops < ops && start.elapsed() < duration {
        let i = rng.range(0, KEYS - 1);
        let k = key(i);
        let write = versions[i as usize] == 0 || rng.range(0, 9) == 0;
        r.ops += 1;
        if write {
            let v = versions[i as usize].wrapping_add(1).max(1);
            let res = if versions[i as usize] == 0 {
                b.insert(k, val(i, v)).map(|_| true)
            } else {
                b.update(k, val(i, v))
            };
            match res {
                Ok(true) => versions[i as usize] = v,
                Ok(false) => {
                    r.errors += 1;
                    note(&mut r, format!("update {k:#x} v{v}: key missing"));
                }
                Err(e) => {
                    r.errors += 1;
                    note(&mut r, format!("write {k:#x} v{v}: {e}"));
                    versions[i as usize] = u64::MAX;
                }
            }
            continue;
        }
        let want = versions[i as usize];
        match b.get(k) {
            Ok(Some(got)) => {
                if want == u64::MAX {
                    versions[i as usize] = got & 0xffff_ffff;
                } else if got != val(i, want) {
                    r.wrong += 1;
                    note(
                        &mut r,
                        format!("get {k:#x}: want {:#x}, got {got:#x}", val(i, want)),
                    );
                }
            }
            Ok(None) => {
                r.wrong += 1;
                note(&mut r, format!("get {k:#x}: written key not found"));
            }
            Err(e) => {
                r.errors += 1;
                note(&mut r, format!("get {k:#x}: {e}"));
            }
        }
    }
    Ok(r)
}
