//! Prints how long verification, analysis and JIT compilation take for every handler of an
//! object: `cargo run --release -p naam-vm --example compile_times -- OBJ [ROUNDS]`. Also the
//! tiered engine's times (until the interpreter serves the handler, and until its JIT code is
//! ready) and a JIT build whose code a store already holds (a restart with a warm code cache).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use naam_proto::EngineKind;
use naam_vm::{CodeCache, CodeKey, CodeStore, ExecOptions, Executable};

/// A code store in memory (naam-runtime keeps one in a directory).
#[derive(Debug, Default)]
struct MemoryStore(Mutex<HashMap<CodeKey, Vec<u8>>>);

impl CodeStore for MemoryStore {
    fn load(&self, key: &CodeKey) -> Option<Vec<u8>> {
        self.0.lock().ok()?.get(key).cloned()
    }
    fn store(&self, key: &CodeKey, entry: &[u8]) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(*key, entry.to_vec());
        }
    }
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: compile_times OBJ [ROUNDS]");
        std::process::exit(2);
    };
    let rounds: usize = args.next().and_then(|r| r.parse().ok()).unwrap_or(5);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        eprintln!("reading {path}: {e}");
        std::process::exit(2)
    });
    let obj = naam_vm::load(&bytes).unwrap_or_else(|e| {
        eprintln!("loading {path}: {e}");
        std::process::exit(2)
    });
    println!(
        "handler\tinsns\tinterp_ms\tjit_ms (median of {rounds})\ttiered_serving_ms\ttiered_jit_ready_ms\twarm_cache_ms\tcode_bytes\tproven/hinted/scanned"
    );
    let store = Arc::new(MemoryStore::default());
    let secret = [1u8; 32];
    for p in &obj.programs {
        let time = |engine| {
            let t: Vec<f64> = (0..rounds)
                .map(|_| {
                    let start = Instant::now();
                    let exe = Executable::build(p, &ExecOptions::engine(engine)).expect("builds");
                    std::hint::black_box(&exe);
                    start.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            median(t)
        };
        // Each round with a cache of its own, so nothing is found in memory.
        let fresh = |engine, cache: Arc<CodeCache>| {
            let mut o = ExecOptions::engine(engine);
            o.code_cache = cache;
            Executable::build(p, &o).expect("builds")
        };
        let (mut serving, mut ready) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let start = Instant::now();
            let exe = fresh(EngineKind::Tiered, Arc::new(CodeCache::in_memory()));
            serving.push(start.elapsed().as_secs_f64() * 1e3);
            exe.wait_for_jit(Duration::from_secs(60));
            ready.push(
                exe.jit_ready_after()
                    .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
            );
        }
        drop(fresh(
            EngineKind::Jit,
            Arc::new(CodeCache::with_store(store.clone(), &secret)),
        ));
        let warm = median(
            (0..rounds)
                .map(|_| {
                    let cache = Arc::new(CodeCache::with_store(store.clone(), &secret));
                    let start = Instant::now();
                    let exe = fresh(EngineKind::Jit, cache.clone());
                    let t = start.elapsed().as_secs_f64() * 1e3;
                    assert_eq!(cache.stats().store_hits, 1);
                    drop(exe);
                    t
                })
                .collect(),
        );
        let exe = Executable::build(p, &ExecOptions::engine(EngineKind::Interp)).expect("builds");
        let code = exe
            .compile_for(naam_vm::jit::Target::Host)
            .map(|c| c.code.len())
            .unwrap_or(0);
        let f = exe.facts();
        println!(
            "{}\t{} ({} fn)\t{:.3}\t{:.3}\t{:.3}\t{:.3}\t{:.3}\t{code}\t{}/{}/{}",
            p.name,
            p.len(),
            exe.verdict().functions,
            time(EngineKind::Interp),
            time(EngineKind::Jit),
            median(serving),
            median(ready),
            warm,
            f.proven,
            f.hinted,
            f.scanned
        );
    }
}
