//! Prints how long verification, analysis and JIT compilation take for every handler of an
//! object: `cargo run --release -p naam-vm --example compile_times -- OBJ [ROUNDS]`.
use std::time::Instant;

use naam_proto::EngineKind;
use naam_vm::{ExecOptions, Executable};

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
        "handler\tinsns\tinterp_ms\tjit_ms (median of {rounds})\tcode_bytes\tproven/hinted/scanned"
    );
    for p in &obj.programs {
        let time = |engine| {
            let mut t: Vec<f64> = (0..rounds)
                .map(|_| {
                    let start = Instant::now();
                    let exe = Executable::build(p, &ExecOptions::engine(engine)).expect("builds");
                    std::hint::black_box(&exe);
                    start.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let exe = Executable::build(p, &ExecOptions::engine(EngineKind::Interp)).expect("builds");
        let code = exe
            .compile_for(naam_vm::jit::Target::Host)
            .map(|c| c.code.len())
            .unwrap_or(0);
        let f = exe.facts();
        println!(
            "{}\t{} ({} fn)\t{:.3}\t{:.3}\t{code}\t{}/{}/{}",
            p.name,
            p.len(),
            exe.verdict().functions,
            time(EngineKind::Interp),
            time(EngineKind::Jit),
            f.proven,
            f.hinted,
            f.scanned
        );
    }
}
