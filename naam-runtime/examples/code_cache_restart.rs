//! A restart with a warm code cache: builds N distinct handlers (the B-tree's and MICA's
//! handlers from OBJECTS, then random verified programs from naam-vm's generator) on the JIT
//! into an empty `code_cache` directory, then again as a restarted server would (a new cache
//! over the same directory), and prints both times.
//!
//! `cargo run --release -p naam-runtime --example code_cache_restart -- N [OBJECT...]`
use std::sync::Arc;
use std::time::Instant;

use naam_proto::EngineKind;
use naam_vm::{CodeCache, Executable, Program};
use naam_vm_testing::gen::{self, Choices, GenConfig};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let mut programs: Vec<(Program, naam_vm::ExecOptions)> = Vec::new();
    for path in args {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let obj = naam_vm::load(&bytes).unwrap_or_else(|e| panic!("{path}: {e}"));
        for p in obj.programs {
            programs.push((p, naam_vm::ExecOptions::engine(EngineKind::Jit)));
        }
    }
    let real = programs.len();
    let mut seed = 0u64;
    while programs.len() < n {
        seed += 1;
        let bytes = gen::seeded_bytes(seed, 1500);
        let g = gen::generate(&mut Choices::new(&bytes), &GenConfig::default());
        programs.push((g.program, gen::options(EngineKind::Jit)));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let cache_dir = dir.path().join("code-cache");
    let build_all = |cache: &Arc<CodeCache>| {
        let start = Instant::now();
        let exes: Vec<Executable> = programs
            .iter()
            .map(|(p, o)| {
                let mut o = o.clone();
                o.code_cache = cache.clone();
                Executable::build(p, &o).expect("builds")
            })
            .collect();
        (start.elapsed(), exes)
    };
    let cold = naam_runtime::code_cache::open_dir(&cache_dir).expect("code cache");
    let (cold_time, exes) = build_all(&cold);
    drop(exes);
    let warm = naam_runtime::code_cache::open_dir(&cache_dir).expect("code cache");
    let (warm_time, _exes) = build_all(&warm);
    let insns: usize = programs.iter().map(|(p, _)| p.len()).sum();
    println!(
        "{n} handlers ({real} from objects, {} generated; {insns} instructions in all)",
        n - real
    );
    println!(
        "cold (compiled): {:.3} s, {:?}",
        cold_time.as_secs_f64(),
        cold.stats()
    );
    println!(
        "warm (restart):  {:.3} s, {:?}",
        warm_time.as_secs_f64(),
        warm.stats()
    );
}
