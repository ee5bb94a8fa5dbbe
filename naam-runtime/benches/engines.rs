//! Per-invocation cost of handlers under the checked interpreter, the rbpf JIT, and the same
//! logic compiled as native Rust (the SDK accessors run natively on a `Context` too).
//!
//! Run: `cargo bench -p naam-runtime --bench engines`. Handlers are built from
//! `examples/handlers` by the real pipeline first (needs scripts/setup.sh).

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use naam_ebpf::abi::{Context, Segment, ACCESS_READ};
use naam_ebpf::{hash, Fault, Return};
use naam_pipeline::BuildOptions;
use naam_proto::step::{Grant, Invocation};
use naam_proto::EngineKind;
use naam_runtime::pipeline::build;
use naam_vm::Vm;
use naam_vm::{Executable, LoadedObject, VerifierConfig};

fn examples() -> LoadedObject {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut opts = BuildOptions::new(repo.join("examples/handlers"));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("handlers");
    opts.target_dir = Some(dir.clone());
    opts.out = Some(dir.join("bench-examples.o"));
    build(&opts)
        .expect("building examples/handlers (run scripts/setup.sh first)")
        .loaded
}

/// `add`, natively: the handler's body over a native Context.
fn native_add(ctx: &mut Context) -> Result<Return, Fault> {
    let a = ctx.arg_u64(0)?;
    let b = ctx.arg_u64(8)?;
    ctx.reply_u64(a.wrapping_add(b))?;
    Ok(Return::Done)
}

/// `hash1k`, natively: the same bounds-checked word reads and mixing.
fn native_hash1k(ctx: &mut Context) -> Result<Return, Fault> {
    let seed = ctx.arg_u64(0)?;
    let seg = ctx.segment(0)?;
    let len = seg.len();
    if len % 8 != 0 || len > 1024 {
        return Err(Fault::app(1));
    }
    let mut h = hash::start(len as u64, seed);
    for i in 0..len / 8 {
        h = hash::mix(h, seg.read_u64(i * 8)?);
    }
    ctx.reply_u64(hash::finish(h))?;
    Ok(Return::Done)
}

fn bench(c: &mut Criterion) {
    let obj = examples();
    let exe = |name: &str, engine| {
        Executable::new(obj.get(name).unwrap(), engine, &VerifierConfig::default()).unwrap()
    };
    let args: Vec<u8> = [5u64, 7].iter().flat_map(|w| w.to_le_bytes()).collect();
    let data: Vec<u8> = (0..1024u32).map(|i| (i * 31 % 251) as u8).collect();
    let seed = 42u64.to_le_bytes();

    let mut g = c.benchmark_group("add");
    for engine in [EngineKind::Interp, EngineKind::Jit] {
        let e = exe("add", engine);
        let mut vm = Vm::new();
        let inv = Invocation {
            args: &args,
            ..Invocation::default()
        };
        g.bench_function(engine.name(), |b| {
            b.iter(|| vm.run(&e, black_box(&inv)).unwrap())
        });
    }
    let mut ctx = Box::new(Context::new());
    ctx.args[..16].copy_from_slice(&args);
    ctx.args_len = 16;
    g.bench_function("native", |b| {
        b.iter(|| {
            ctx.reply_len = 0;
            native_add(black_box(&mut ctx)).unwrap()
        })
    });
    g.finish();

    let mut g = c.benchmark_group("hash1k");
    g.throughput(Throughput::Bytes(1024));
    for engine in [EngineKind::Interp, EngineKind::Jit] {
        let e = exe("hash1k", engine);
        let mut vm = Vm::new();
        let inv = Invocation {
            args: &seed,
            segments: &[Grant::read(&data)],
            ..Invocation::default()
        };
        g.bench_function(engine.name(), |b| {
            b.iter(|| vm.run(&e, black_box(&inv)).unwrap())
        });
    }
    let mut ctx = Box::new(Context::new());
    ctx.args[..8].copy_from_slice(&seed);
    ctx.args_len = 8;
    ctx.segment_count = 1;
    ctx.segments[0] = Segment {
        addr: data.as_ptr() as u64,
        len: 1024,
        access: ACCESS_READ,
    };
    g.bench_function("native", |b| {
        b.iter(|| {
            ctx.reply_len = 0;
            native_hash1k(black_box(&mut ctx)).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
