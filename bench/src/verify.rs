//! `naam-bench verify`: a correctness run against a deployment. Every client thread owns a set
//! of keys, writes versioned values to them and checks that every read returns exactly the last
//! value it wrote (it is the only writer of its keys). Lost retransmitted writes, duplicated
//! writes applied late, torn or stale reads all show up as wrong answers. Runs over any
//! placement while the test harness kills processes or drops packets.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use naam_btree::BTreeClient;
use naam_mica::MicaClient;
use naam_runtime::proto::Placement;
use naam_runtime::udp::UdpClient;
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
                        App::Mica => {
                            let handle = setup.mica()?;
                            let len = handle.config.value_cap.min(100);
                            let m = MicaClient::new(client, handle);
                            let seed = run ^ (t + 1).wrapping_mul(0x9e37_79b9);
                            let mut c = MicaChecked { m, t, run, len };
                            check(&mut c, seed, ops, duration)
                        }
                        App::Btree => {
                            let b = BTreeClient::new(client, setup.btree()?);
                            let seed = run ^ (t + 7).wrapping_mul(0x9e37_79b9);
                            check(&mut BTreeChecked { b, t, run }, seed, ops, duration)
                        }
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

/// One app as a verify thread drives it: versioned writes and reads of the thread's own keys.
trait Checked {
    /// Whether an acknowledged key may vanish (MICA's log may wrap; a B-tree never loses one).
    const LOSSY: bool;
    /// Key `i` as problems name it.
    fn name(&self, i: u64) -> String;
    /// Writes version `v` of key `i` (`first`: never written before). `Ok(false)`: the store
    /// says the key is missing.
    fn write(&mut self, i: u64, v: u64, first: bool) -> anyhow::Result<bool>;
    /// Reads key `i`: `None` when absent, else the version it holds, or `Err` describing
    /// contents that are no version this thread wrote.
    fn read(&mut self, i: u64) -> anyhow::Result<Option<Result<u64, String>>>;
}

/// A MICA table's keys and values for thread `t` of run `run`.
struct MicaChecked {
    m: MicaClient<UdpClient>,
    t: u64,
    run: u64,
    len: usize,
}

impl Checked for MicaChecked {
    const LOSSY: bool = true;
    fn name(&self, i: u64) -> String {
        // Short enough for any key capacity of 16 bytes or more.
        format!("v{:08x}{:x}-{i:x}", self.run as u32, self.t)
    }
    fn write(&mut self, i: u64, v: u64, _first: bool) -> anyhow::Result<bool> {
        // `put` answers whether the key existed before; either way it now holds `v`.
        let (k, val) = (self.name(i), value(self.t, i, v, self.len));
        self.m.put(k.as_bytes(), &val)?;
        Ok(true)
    }
    fn read(&mut self, i: u64) -> anyhow::Result<Option<Result<u64, String>>> {
        let Some(got) = self.m.get(self.name(i).as_bytes())? else {
            return Ok(None);
        };
        let v = got
            .get(16..24)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes);
        Ok(Some(match v {
            Some(v) if got == value(self.t, i, v, self.len) => Ok(v),
            _ => Err(format!("{} bytes that are no version written", got.len())),
        }))
    }
}

/// A B-tree's keys and values for thread `t` of run `run`.
struct BTreeChecked {
    b: BTreeClient<UdpClient>,
    t: u64,
    run: u64,
}

impl BTreeChecked {
    /// Keys of this run and thread: distinct, spread over the key space.
    fn key(&self, i: u64) -> u64 {
        naam_ebpf::hash::finish(self.run ^ (self.t << 32) ^ i) | 1
    }
    fn val(&self, i: u64, v: u64) -> u64 {
        (self.t << 48) ^ (i << 32) ^ v
    }
}

impl Checked for BTreeChecked {
    const LOSSY: bool = false;
    fn name(&self, i: u64) -> String {
        format!("{:#x}", self.key(i))
    }
    fn write(&mut self, i: u64, v: u64, first: bool) -> anyhow::Result<bool> {
        let (k, val) = (self.key(i), self.val(i, v));
        Ok(if first {
            self.b.insert(k, val).map(|_| true)?
        } else {
            self.b.update(k, val)?
        })
    }
    fn read(&mut self, i: u64) -> anyhow::Result<Option<Result<u64, String>>> {
        let Some(got) = self.b.get(self.key(i))? else {
            return Ok(None);
        };
        let v = got & 0xffff_ffff;
        Ok(Some(if got == self.val(i, v) {
            Ok(v)
        } else {
            Err(format!("{got:#x}, no version written"))
        }))
    }
}

/// The verify loop of one thread: random keys of its own, one write in ten (and the first
/// touch of a key), every read checked against the last acknowledged write.
/// Runs the check; fails at once when the server is gone (past the client's liveness bound).
fn check<C: Checked>(
    c: &mut C,
    seed: u64,
    ops: u64,
    duration: Duration,
) -> anyhow::Result<VerifyResult> {
    let mut r = VerifyResult::default();
    let mut versions = vec![0u64; KEYS as usize];
    let mut rng = Rng::new(seed);
    let start = Instant::now();
    while r.ops < ops && start.elapsed() < duration {
        let i = rng.range(0, KEYS - 1);
        let known = versions[i as usize];
        let write = known == 0 || rng.range(0, 9) == 0;
        r.ops += 1;
        if write {
            let v = known.wrapping_add(1).max(1);
            match c.write(i, v, known == 0) {
                Ok(true) => versions[i as usize] = v,
                Ok(false) => {
                    r.errors += 1;
                    note(&mut r, format!("write {} v{v}: key missing", c.name(i)));
                }
                Err(e) if crate::phase::server_gone(&e) => return Err(e),
                Err(e) => {
                    // The write may or may not have happened: the next read may see either.
                    r.errors += 1;
                    note(&mut r, format!("write {} v{v}: {e}", c.name(i)));
                    versions[i as usize] = u64::MAX;
                }
            }
            continue;
        }
        match c.read(i) {
            // After an unanswered write, accept whatever version the key holds now.
            Ok(Some(Ok(v))) if known == u64::MAX => versions[i as usize] = v,
            Ok(Some(Ok(v))) if v == known => {}
            Ok(Some(got)) => {
                r.wrong += 1;
                let got = got.map_or_else(|e| e, |v| format!("v{v}"));
                note(
                    &mut r,
                    format!("get {}: want v{known}, got {got}", c.name(i)),
                );
            }
            Ok(None) => {
                if C::LOSSY {
                    r.misses += 1;
                } else {
                    r.wrong += 1;
                }
                note(
                    &mut r,
                    format!(
                        "get {}: acknowledged key not found (want v{known})",
                        c.name(i)
                    ),
                );
            }
            Err(e) if crate::phase::server_gone(&e) => return Err(e),
            Err(e) => {
                r.errors += 1;
                note(&mut r, format!("get {}: {e}", c.name(i)));
            }
        }
    }
    Ok(r)
}
