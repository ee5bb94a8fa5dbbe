//! The tiered engine and the code cache: a handler gives the same results, faults and
//! instruction counts on the interpreter before its switch and on the JIT after it; compiled
//! code is shared, kept in a store, and checked before it is run (a corrupted, truncated,
//! misplaced or foreign entry is refused and compiled again).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use naam_proto::EngineKind;
use naam_vm::{code_key, CodeCache, CodeKey, CodeStore, Executable, Vm};
use naam_vm_testing::gen::{self, Buffer, Choices, GenConfig, Generated};

/// A store in memory, as a test fake of naam-runtime's directory.
#[derive(Debug, Default)]
struct MemoryStore(Mutex<HashMap<CodeKey, Vec<u8>>>);

impl CodeStore for MemoryStore {
    fn load(&self, key: &CodeKey) -> Option<Vec<u8>> {
        self.0.lock().unwrap().get(key).cloned()
    }
    fn store(&self, key: &CodeKey, entry: &[u8]) {
        self.0.lock().unwrap().insert(*key, entry.to_vec());
    }
}

impl MemoryStore {
    fn entry(&self, key: &CodeKey) -> Vec<u8> {
        self.0.lock().unwrap()[key].clone()
    }
    fn put(&self, key: &CodeKey, entry: Vec<u8>) {
        self.0.lock().unwrap().insert(*key, entry);
    }
}

fn generated(seed: u64) -> Generated {
    gen::generate(
        &mut Choices::new(&gen::seeded_bytes(seed, 1500)),
        &GenConfig::default(),
    )
}

fn build(g: &Generated, engine: EngineKind, cache: &Arc<CodeCache>) -> Executable {
    let mut options = gen::options(engine);
    options.code_cache = cache.clone();
    Executable::build(&g.program, &options).expect("a generated program builds")
}

/// Runs `exe` over the program's memory and compares with the interpreter's outcome.
fn agrees(vm: &mut Vm, g: &Generated, exe: &Executable, what: &str) {
    let mut buffer = Buffer::new(g.memory.len());
    let cache = Arc::new(CodeCache::in_memory());
    let want = gen::run(
        vm,
        &build(g, EngineKind::Interp, &cache),
        &g.memory,
        &mut buffer,
    );
    let got = gen::run(vm, exe, &g.memory, &mut buffer);
    if let Err(d) = gen::compare(&want, &got) {
        panic!("{what}: {d}");
    }
}

#[test]
fn a_tiered_handler_answers_alike_before_and_after_its_switch() {
    let mut started_interpreted = 0;
    let cases = 40;
    for seed in 0..cases {
        let g = generated(seed);
        // A cache of its own: no other executable holds this program's code.
        let cache = Arc::new(CodeCache::in_memory());
        let tiered = build(&g, EngineKind::Tiered, &cache);
        assert_eq!(tiered.engine(), EngineKind::Tiered);
        // Compiling takes milliseconds; the build returned as soon as it was verified.
        if tiered.running_engine() == EngineKind::Interp {
            started_interpreted += 1;
        }
        let mut vm = Vm::new();
        agrees(
            &mut vm,
            &g,
            &tiered,
            &format!("seed {seed}, before the switch"),
        );
        assert!(
            tiered.wait_for_jit(Duration::from_secs(60)),
            "seed {seed}: no JIT code: {:?}",
            tiered.jit_failure()
        );
        assert_eq!(tiered.running_engine(), EngineKind::Jit);
        assert!(tiered.jit_ready_after().is_some());
        agrees(
            &mut vm,
            &g,
            &tiered,
            &format!("seed {seed}, after the switch"),
        );
        assert_eq!(cache.stats().compiled, 1, "seed {seed}");
    }
    assert!(
        started_interpreted >= cases - 2,
        "only {started_interpreted} of {cases} tiered builds were served by the interpreter first"
    );
}

#[test]
fn a_tiered_handler_whose_code_is_in_memory_is_compiled_at_once() {
    let g = generated(7);
    let cache = Arc::new(CodeCache::in_memory());
    let jit = build(&g, EngineKind::Jit, &cache);
    let tiered = build(&g, EngineKind::Tiered, &cache);
    assert_eq!(tiered.running_engine(), EngineKind::Jit);
    assert_eq!(cache.stats().compiled, 1);
    assert_eq!(cache.stats().memory_hits, 1);
    drop(jit);
}

#[test]
fn a_tiered_handler_is_analysed_in_the_background_and_ends_with_the_jit_s_facts() {
    for seed in 0..10 {
        let g = generated(100 + seed);
        let cache = Arc::new(CodeCache::in_memory());
        let tiered = build(&g, EngineKind::Tiered, &cache);
        assert!(tiered.wait_for_jit(Duration::from_secs(30)), "seed {seed}");
        let jit = build(&g, EngineKind::Jit, &Arc::new(CodeCache::in_memory()));
        let (t, j) = (tiered.facts(), jit.facts());
        assert_eq!(
            (t.proven, t.hinted, t.scanned, &t.checks),
            (j.proven, j.hinted, j.scanned, &j.checks),
            "seed {seed}: the background analysis is the JIT build's"
        );
        // The JIT code compiled in the background is the one a JIT build makes.
        assert_eq!(cache.stats().compiled, 1, "seed {seed}");
    }
}

#[test]
fn stored_code_serves_a_restart_and_a_bad_entry_is_compiled_again() {
    let store = Arc::new(MemoryStore::default());
    let secret = [7u8; 32];
    let g = generated(11);
    let key = code_key(&g.program, &gen::options(EngineKind::Jit)).unwrap();
    let mut vm = Vm::new();

    // First start: compiled and stored.
    let first = Arc::new(CodeCache::with_store(store.clone(), &secret));
    agrees(
        &mut vm,
        &g,
        &build(&g, EngineKind::Jit, &first),
        "first start",
    );
    assert_eq!((first.stats().compiled, first.stats().store_hits), (1, 0));
    let good = store.entry(&key);

    // A restart (a new cache over the same store): loaded, not compiled.
    let restart = Arc::new(CodeCache::with_store(store.clone(), &secret));
    agrees(
        &mut vm,
        &g,
        &build(&g, EngineKind::Jit, &restart),
        "restart",
    );
    assert_eq!(restart.stats().compiled, 0);
    assert_eq!(restart.stats().store_hits, 1);

    // Each bad entry is refused, compiled again and replaced by a good one.
    let other = generated(12);
    let other_key = code_key(&other.program, &gen::options(EngineKind::Jit)).unwrap();
    assert_ne!(key, other_key);
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x01;
    let truncated = good[..good.len() - 1].to_vec();
    let other_entry = {
        let c = Arc::new(CodeCache::with_store(store.clone(), &secret));
        let _ = build(&other, EngineKind::Jit, &c);
        store.entry(&other_key)
    };
    let foreign = {
        let s = Arc::new(MemoryStore::default());
        let c = Arc::new(CodeCache::with_store(s.clone(), &[9u8; 32]));
        let _ = build(&g, EngineKind::Jit, &c);
        s.entry(&key)
    };
    for (what, bad) in [
        ("a flipped bit", flipped),
        ("a truncated entry", truncated),
        ("another program's entry under this key", other_entry),
        ("an entry sealed under another secret", foreign),
        ("an empty entry", Vec::new()),
    ] {
        store.put(&key, bad);
        let cache = Arc::new(CodeCache::with_store(store.clone(), &secret));
        agrees(&mut vm, &g, &build(&g, EngineKind::Jit, &cache), what);
        let s = cache.stats();
        assert_eq!((s.rejected, s.compiled, s.store_hits), (1, 1, 0), "{what}");
        assert_eq!(store.entry(&key), good, "{what}: the good entry is back");
    }
}

#[test]
fn a_tiered_restart_loads_its_code_from_the_store() {
    let store = Arc::new(MemoryStore::default());
    let secret = [3u8; 32];
    let g = generated(21);
    let warm = Arc::new(CodeCache::with_store(store.clone(), &secret));
    let _ = build(&g, EngineKind::Jit, &warm);
    let restart = Arc::new(CodeCache::with_store(store.clone(), &secret));
    let tiered = build(&g, EngineKind::Tiered, &restart);
    assert!(tiered.wait_for_jit(Duration::from_secs(60)));
    assert_eq!(restart.stats().store_hits, 1);
    assert_eq!(restart.stats().compiled, 0);
    let mut vm = Vm::new();
    agrees(&mut vm, &g, &tiered, "tiered from the store");
}

#[test]
fn the_key_names_everything_the_code_depends_on() {
    let g = generated(5);
    let base = gen::options(EngineKind::Jit);
    let key = code_key(&g.program, &base).unwrap();
    assert_eq!(key, code_key(&g.program, &base).unwrap());
    let mut entry = base.clone();
    entry.entry = naam_vm::Entry::Context;
    assert_ne!(key, code_key(&g.program, &entry).unwrap());
    let mut helpers = base.clone();
    helpers.helpers = naam_vm::HelperSet::Conformance;
    assert_ne!(key, code_key(&g.program, &helpers).unwrap());
    let mut program = g.program.clone();
    let last = program.code.len() - 8;
    program.code[last + 4] ^= 1;
    assert_ne!(key, code_key(&program, &base).unwrap());
}
