//! Handlers written in Rust, built by the pipeline, run on both engines.

mod common;

use common::{examples, words, Rng};
use naam_ebpf::abi::{abort_code, error_code, write_kind, Return, ACCESS_READ};
use naam_proto::step::{Grant, Invocation};
use naam_proto::EngineKind;
use naam_vm::{ExecOptions, StepError, Vm, VmError};
use naam_vm::{Executable, VerifierConfig};

fn exe(name: &str, engine: EngineKind) -> Executable {
    let program = examples().1.get(name).unwrap();
    Executable::new(program, engine, &VerifierConfig::default()).unwrap()
}

fn both(name: &str) -> [Executable; 2] {
    [exe(name, EngineKind::Interp), exe(name, EngineKind::Jit)]
}

/// Runs one step and returns (return, reply).
fn run(
    e: &Executable,
    args: &[u8],
    segments: &[&[u8]],
) -> Result<(Option<Return>, Vec<u8>), StepError> {
    let mut vm = Vm::new();
    let grants: Vec<Grant> = segments.iter().map(|s| Grant::read(s)).collect();
    let inv = Invocation {
        args,
        segments: &grants,
        ..Invocation::default()
    };
    let out = vm.run(e, &inv)?;
    Ok((out.ret, vm.reply().to_vec()))
}

fn fletcher(ws: &[u64]) -> (u64, u64) {
    let (mut a, mut b) = (0u64, 0u64);
    for w in ws {
        a = a.wrapping_add(*w);
        b = b.wrapping_add(a);
    }
    (a, b)
}

#[test]
fn checksum_over_a_segment() {
    let mut rng = Rng(1);
    for e in both("checksum") {
        for n in [0usize, 1, 7, 64, 128] {
            let ws: Vec<u64> = (0..n).map(|_| rng.next()).collect();
            let (ret, reply) = run(&e, &[], &[&words(&ws)]).unwrap();
            let (a, b) = fletcher(&ws);
            assert_eq!(ret, Some(Return::Done), "{} n={n}", e.engine());
            assert_eq!(reply, words(&[a, b]), "{} n={n}", e.engine());
        }
        // Longer than 1 KiB, or not whole words: the handler's own error.
        let (ret, _) = run(&e, &[], &[&vec![0u8; 1032]]).unwrap();
        assert_eq!(ret, Some(Return::Error(error_code::APP_BASE + 1)));
        let (ret, _) = run(&e, &[], &[&[1, 2, 3]]).unwrap();
        assert_eq!(ret, Some(Return::Error(error_code::APP_BASE + 1)));
        // No segment at all.
        let (ret, _) = run(&e, &[], &[]).unwrap();
        assert_eq!(ret, Some(Return::Error(error_code::NO_SEGMENT)));
    }
}

/// A tiered handler runs on the interpreter until its JIT code is ready, then on the JIT: the
/// same replies and instruction counts on both sides of the switch.
#[test]
fn a_tiered_handler_answers_alike_across_its_switch() {
    let mut rng = Rng(3);
    let ws: Vec<u64> = (0..64).map(|_| rng.next()).collect();
    let segment = words(&ws);
    let interp = exe("checksum", EngineKind::Interp);
    let tiered = exe("checksum", EngineKind::Tiered);
    let steps = |e: &Executable| {
        let mut vm = Vm::new();
        let grants = [Grant::read(&segment)];
        let inv = Invocation {
            segments: &grants,
            ..Invocation::default()
        };
        let out = vm.run(e, &inv).unwrap();
        (out.ret, out.insns, vm.reply().to_vec())
    };
    let want = steps(&interp);
    let before = (tiered.running_engine(), steps(&tiered));
    assert!(tiered.wait_for_jit(std::time::Duration::from_secs(60)));
    let after = (tiered.running_engine(), steps(&tiered));
    assert_eq!(before.1, want, "on {}", before.0);
    assert_eq!(after, (EngineKind::Jit, want));
}

#[test]
fn hash1k_matches_the_native_hash() {
    let mut rng = Rng(2);
    for e in both("hash1k") {
        for n in [0usize, 3, 128] {
            let data = words(&(0..n).map(|_| rng.next()).collect::<Vec<_>>());
            let seed = rng.next();
            let (ret, reply) = run(&e, &seed.to_le_bytes(), &[&data]).unwrap();
            assert_eq!(ret, Some(Return::Done));
            assert_eq!(reply, naam_ebpf::hash::hash64(&data, seed).to_le_bytes());
        }
    }
}

#[test]
fn binary_search_over_a_sorted_array() {
    let sorted: Vec<u64> = (0..1000u64).map(|i| i * 3 + 10).collect();
    let seg = words(&sorted);
    for e in both("bsearch") {
        for key in [0u64, 10, 11, 13, 1500, 3007, 3009, u64::MAX] {
            let (ret, reply) = run(&e, &key.to_le_bytes(), &[&seg]).unwrap();
            let lo = sorted.partition_point(|&x| x < key) as u64;
            let found = sorted.binary_search(&key).is_ok() as u64;
            assert_eq!(ret, Some(Return::Done));
            assert_eq!(reply, words(&[lo, found]), "{} key={key}", e.engine());
        }
        // Empty array.
        let (_, reply) = run(&e, &5u64.to_le_bytes(), &[&[]]).unwrap();
        assert_eq!(reply, words(&[0, 0]));
    }
}

#[test]
fn two_step_handler_continues() {
    let region = words(&[0, 0, 0, 42]); // the word at offset 24 is 42
    for e in both("two_step") {
        let mut vm = Vm::new();
        let first = words(&[24, 1000]); // pointer 24, and 1000 for state 0
        let rkey = 0xabcdu64.to_le_bytes();
        let inv = Invocation {
            args: &rkey,
            segments: &[Grant::read(&first)],
            ..Invocation::default()
        };
        let out = vm.run(&e, &inv).unwrap();
        assert_eq!(out.ret, Some(Return::Continue));
        assert_eq!(out.trace, vec![24]);
        let next = vm.next().to_vec();
        assert_eq!(next.len(), 1);
        assert_eq!(
            (next[0].rkey, next[0].offset, next[0].len, next[0].access),
            (0xabcd, 24, 8, ACCESS_READ)
        );
        // Step 1 over the fetched descriptor, with the state carried over.
        let d = next[0];
        let fetched = &region[d.offset as usize..(d.offset + d.len as u64) as usize];
        let inv = Invocation {
            step: 1,
            args: &rkey,
            state: vm.state(),
            segments: &[Grant::read(fetched)],
            ..Invocation::default()
        };
        let out = vm.run(&e, &inv).unwrap();
        assert_eq!(out.ret, Some(Return::Done));
        assert_eq!(vm.reply(), 1042u64.to_le_bytes());
    }
}

#[test]
fn panics_become_clean_aborts() {
    for e in both("panics") {
        let (ret, reply) = run(&e, &4u64.to_le_bytes(), &[]).unwrap();
        assert_eq!(
            (ret, reply),
            (Some(Return::Done), 25u64.to_le_bytes().to_vec())
        );
        for arg in [7u64, 0] {
            // 7: explicit panic!; 0: division by zero.
            let err = run(&e, &arg.to_le_bytes(), &[]).unwrap_err();
            assert_eq!(
                err,
                StepError::Vm(VmError::Aborted {
                    code: abort_code::PANIC
                }),
                "{} arg={arg}",
                e.engine()
            );
            assert!(err.to_string().contains("panic"));
        }
        // The VM keeps working after an abort.
        let (ret, _) = run(&e, &5u64.to_le_bytes(), &[]).unwrap();
        assert_eq!(ret, Some(Return::Done));
    }
}

#[test]
fn out_of_bounds_reads_fault_on_both_engines() {
    let seg = [0u8; 16];
    for e in both("oob_read") {
        for distance in [0u64, 1, 8, 4096, 1 << 40, u64::MAX - 100] {
            match run(&e, &distance.to_le_bytes(), &[&seg]) {
                Err(StepError::Vm(VmError::OutOfBounds { kind, .. })) => assert_eq!(kind, "load"),
                other => panic!(
                    "{} distance {distance}: expected an out-of-bounds error, got {other:?}",
                    e.engine()
                ),
            }
        }
        // Distance -8 lands inside the segment: allowed.
        let (ret, _) = run(&e, &(-8i64 as u64).to_le_bytes(), &[&seg]).unwrap();
        assert_eq!(ret, Some(Return::Done));
    }
}

#[test]
fn write_step_reports_its_operations() {
    for e in both("store") {
        let mut vm = Vm::new();
        let seg = [0u8; 32];
        let v = 0x1122334455667788u64.to_le_bytes();
        let inv = Invocation {
            args: &v,
            segments: &[Grant::read(&seg)],
            ..Invocation::default()
        };
        let out = vm.run(&e, &inv).unwrap();
        assert_eq!(out.ret, Some(Return::Write));
        // Both version words of the record.
        for (w, offset) in vm.writes().iter().zip([0, 24]) {
            assert_eq!(
                (w.kind, w.segment, w.offset, w.len),
                (write_kind::STORE, 0, offset, 8)
            );
            assert_eq!(&vm.write_data()[w.data_offset as usize..][..8], &v);
        }
        assert_eq!(vm.writes().len(), 2);
        assert_eq!(vm.reply(), 1u64.to_le_bytes());
    }
}

#[test]
fn interpreter_and_jit_agree_on_random_inputs() {
    let mut rng = Rng(3);
    let cases: &[(&str, usize, usize)] = &[
        ("add", 16, 0),
        ("checksum", 0, 1024),
        ("hash1k", 8, 1024),
        ("bsearch", 8, 800),
        ("two_step", 8, 16),
        ("store", 8, 32),
        ("panics", 8, 0),
        ("sum_words", 0, 512),
        ("walk", 0, 64),
        ("recurse", 1, 0),
        ("reverse16", 1, 32),
    ];
    for &(name, args_len, seg_len) in cases {
        let [interp, jit] = both(name);
        for round in 0..50 {
            let args: Vec<u8> = (0..args_len).map(|_| rng.next() as u8).collect();
            let mut seg: Vec<u8> = (0..seg_len).map(|_| rng.next() as u8).collect();
            if name == "bsearch" {
                let mut ws: Vec<u64> = seg
                    .chunks(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                ws.sort_unstable();
                seg = words(&ws);
            }
            let segs: Vec<&[u8]> = if seg_len > 0 { vec![&seg] } else { vec![] };
            let a = run(&interp, &args, &segs);
            let b = run(&jit, &args, &segs);
            assert_eq!(a, b, "{name} round {round}");
        }
    }
}

#[test]
fn loops_over_run_time_lengths_verify_and_run() {
    let mut rng = Rng(11);
    for e in both("sum_words") {
        assert!(e.verdict().backward_jumps > 0, "a real loop, not unrolled");
        for n in [0usize, 1, 7, 100, 4096] {
            let ws: Vec<u64> = (0..n).map(|_| rng.next()).collect();
            let sum = ws.iter().fold(0u64, |a, w| a.wrapping_add(*w));
            let (ret, reply) = run(&e, &[], &[&words(&ws)]).unwrap();
            assert_eq!(
                (ret, reply),
                (Some(Return::Done), words(&[sum])),
                "{} n={n}",
                e.engine()
            );
        }
    }
    // A data-dependent loop: a linked list of 5 hops, then a cycle the budget stops.
    let list = words(&[8, 16, 24, 32, 40, 0]);
    let cycle = words(&[8, 0x10, 8]);
    for e in both("walk") {
        let (ret, reply) = run(&e, &[], &[&list]).unwrap();
        assert_eq!(
            (ret, reply),
            (Some(Return::Done), words(&[5])),
            "{}",
            e.engine()
        );
        let err = run(&e, &[], &[&cycle]).unwrap_err();
        assert_eq!(
            err,
            StepError::Vm(VmError::Budget {
                limit: naam_vm::DEFAULT_BUDGET
            }),
            "{}",
            e.engine()
        );
    }
}

#[test]
fn hostile_handlers_get_clean_faults_on_both_engines() {
    let mut victim = [0u8; 64];
    let victim_addr = victim.as_mut_ptr() as u64;
    for e in both("wild_write") {
        // A write to memory the step was not granted (this process's own, a null pointer,
        // the top of the address space, kernel space): a fault, never a signal.
        for addr in [victim_addr, 0, 8, u64::MAX - 7, 0xffff_8000_0000_0000] {
            let args: Vec<u8> = [addr, 0x4141]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect();
            match run(&e, &args, &[]) {
                Err(StepError::Vm(VmError::OutOfBounds {
                    kind: "store",
                    addr: a,
                    len: 8,
                    ..
                })) => {
                    assert_eq!(a, addr)
                }
                other => panic!("{} addr {addr:#x}: {other:?}", e.engine()),
            }
        }
    }
    assert_eq!(victim, [0u8; 64], "nothing was written");
    for e in both("spin") {
        let err = run(&e, &[], &[]).unwrap_err();
        assert!(
            matches!(err, StepError::Vm(VmError::Budget { .. })),
            "{err}"
        );
    }
    for e in both("recurse") {
        // Shallow recursion works (each level has its own frame)...
        let (ret, _) = run(&e, &3u64.to_le_bytes(), &[]).unwrap();
        assert_eq!(ret, Some(Return::Done), "{}", e.engine());
        // ...deep recursion stops at the frame limit.
        let err = run(&e, &1000u64.to_le_bytes(), &[]).unwrap_err();
        assert!(
            matches!(err, StepError::Vm(VmError::CallDepth { .. })),
            "{} {err}",
            e.engine()
        );
    }
    // Small budgets are per executable, and both engines count alike.
    let program = examples().1.get("sum_words").unwrap();
    let data = words(&[1; 1000]);
    for engine in [EngineKind::Interp, EngineKind::Jit] {
        let small = Executable::build(program, &ExecOptions::new(engine, 500)).unwrap();
        let err = run(&small, &[], &[&data]).unwrap_err();
        assert_eq!(
            err,
            StepError::Vm(VmError::Budget { limit: 500 }),
            "{engine}"
        );
    }
}

#[test]
fn undefined_symbols_fail_the_build_and_leave_no_object() {
    let object = common::handler_target_dir().join("undefined.o");
    let _ = std::fs::remove_file(&object);
    let err =
        common::build_crate("naam-runtime/tests/fixtures/undefined", "undefined").unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("undefined symbols") && msg.contains("naam_fixture_not_defined_anywhere"),
        "{msg}"
    );
    assert!(
        !object.exists(),
        "a failed build wrote {}",
        object.display()
    );
    assert!(!object.with_extension("o.partial").exists());
}

#[test]
fn objects_load_from_misaligned_bytes() {
    let bytes = std::fs::read(&examples().0).unwrap();
    let mut shifted = vec![0u8; bytes.len() + 1];
    shifted[1..].copy_from_slice(&bytes);
    let loaded = naam_vm::load(&shifted[1..]).unwrap();
    assert_eq!(loaded.programs.len(), examples().1.programs.len());
}

#[test]
fn a_crate_without_panic_abort_builds_and_a_large_stack_is_named_once() {
    let built = common::build_output("naam-runtime/tests/fixtures/unwinding", "unwinding")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(built.handler_names(), ["byte_sum", "triple"]);
    // The same crate with a 2 KiB local: one error naming the function, no kernel advice.
    let dir = tempfile::tempdir().unwrap();
    let src = common::repo().join("naam-runtime/tests/fixtures/unwinding");
    for f in ["Cargo.toml", "Cargo.lock", "src/lib.rs"] {
        let to = dir.path().join(f);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src.join(f), &to).unwrap();
    }
    let manifest = dir.path().join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let naam_ebpf = common::repo().join("naam-ebpf");
    std::fs::write(
        &manifest,
        text.replace("../../../../naam-ebpf", naam_ebpf.to_str().unwrap()),
    )
    .unwrap();
    let lib = dir.path().join("src/lib.rs");
    let text = std::fs::read_to_string(&lib).unwrap();
    std::fs::write(&lib, text.replace("#[cfg(any())]\n", "")).unwrap();
    let mut opts = naam_pipeline::BuildOptions::new(dir.path());
    opts.target_dir = Some(common::handler_target_dir().join("big-stack"));
    let out = dir.path().join("big.o");
    opts.out = Some(out.clone());
    let err = naam_runtime::pipeline::build(&opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("big_stack need more than 512 bytes"), "{err}");
    assert!(!err.contains("per-cpu array map"), "{err}");
    assert_eq!(err.matches("big_stack").count(), 1, "{err}");
    assert!(!out.exists());
}

#[test]
fn every_example_handler_runs_on_the_jit() {
    for p in &examples().1.programs {
        let e = Executable::new(p, EngineKind::Jit, &VerifierConfig::default());
        assert!(e.is_ok(), "{}: {:?}", p.name, e.err());
    }
}

#[test]
fn byte_range_reads_go_through_the_stack() {
    let data: Vec<u8> = (0u8..32).collect();
    for e in both("reverse16") {
        let (ret, reply) = run(&e, &8u64.to_le_bytes(), &[&data]).unwrap();
        assert_eq!(ret, Some(Return::Done), "{}", e.engine());
        let want: Vec<u8> = (8u8..24).rev().collect();
        assert_eq!(reply, want, "{}", e.engine());
        // Past the end: the SDK's bounds check, not a memory access.
        let (ret, _) = run(&e, &20u64.to_le_bytes(), &[&data]).unwrap();
        assert_eq!(ret, Some(Return::Error(error_code::OUT_OF_BOUNDS)));
    }
}

/// Every example handler compiles to aarch64, and steps of every handler with inputs,
/// replayed as that aarch64 code under qemu-user, compute what the host computed.
#[test]
fn example_handlers_run_the_same_as_aarch64_code() {
    use naam_vm::cross::{CrossCheck, CrossChecked};
    let bytes = naam_vm::cross::compile_object(&examples().1).unwrap();
    assert!(bytes > 0);
    if !naam_vm::cross::available_or_skip("the aarch64 replay") {
        return;
    }
    let check = CrossCheck::new(1);
    let mut rng = Rng(5);
    let data = words(&(0..64).map(|_| rng.next()).collect::<Vec<_>>());
    let sorted = words(&(0..64u64).map(|i| i * 3).collect::<Vec<_>>());
    let list = words(&[8, 16, 24, 0]);
    /// A handler, its args and its segments.
    type Case<'a> = (&'a str, Vec<u8>, Vec<&'a [u8]>);
    let cases: &[Case] = &[
        ("add", words(&[5, 7]), vec![]),
        ("checksum", vec![], vec![&data]),
        ("hash1k", words(&[42]), vec![&data]),
        ("bsearch", words(&[90]), vec![&sorted]),
        ("sum_words", vec![], vec![&data]),
        ("walk", vec![], vec![&list]),
        ("two_step", words(&[9]), vec![&data]),
        ("store", words(&[0x1122]), vec![&data]),
        ("reverse16", words(&[8]), vec![&data]),
        ("recurse", words(&[3]), vec![]),
        ("recurse", words(&[1000]), vec![]),
        ("panics", words(&[7]), vec![]),
        ("panics", words(&[4]), vec![]),
        ("oob_read", words(&[1 << 30]), vec![&data]),
        ("wild_write", words(&[0, 1]), vec![]),
        ("spin", vec![], vec![]),
        ("vget", vec![], vec![&data]),
        ("vput", words(&[3]), vec![&data]),
        ("counter_add", words(&[2]), vec![&data]),
    ];
    for (name, args, segs) in cases {
        for e in both(name) {
            let mut vm = CrossChecked::new(Vm::new(), Some(check.clone()));
            let grants: Vec<Grant> = segs.iter().map(|s| Grant::read(s)).collect();
            let inv = Invocation {
                args,
                segments: &grants,
                ..Invocation::default()
            };
            let _ = vm.run(&e, &inv);
        }
    }
    assert!(check.problems().is_empty(), "{:#?}", check.problems());
    assert_eq!(check.compared(), 2 * cases.len() as u64);
}

/// Handlers built for ISA v4 (`--cpu v4`: sign-extending loads and moves, signed division,
/// `bswap`, `gotol`) load and run on both engines with the v3 build's answers.
#[test]
fn handlers_built_for_isa_v4_load_and_run() {
    let mut opts = naam_pipeline::BuildOptions::new(common::repo().join("examples/handlers"));
    opts.target_dir = Some(common::handler_target_dir());
    opts.out = Some(common::handler_target_dir().join("examples-v4.o"));
    opts.cpu = naam_pipeline::BpfCpu::V4;
    let v4 = naam_runtime::pipeline::build(&opts).expect("building the examples for ISA v4");
    let mut rng = Rng(17);
    let data = words(&(0..100).map(|_| rng.next()).collect::<Vec<_>>());
    // Answers, or the kind of fault (instruction indices differ between the two builds).
    let outcome = |e: &Executable, args: &[u8]| match run(e, args, &[&data]) {
        Ok(answer) => Ok(answer),
        Err(StepError::Vm(v)) => Err(v.kind()),
        Err(other) => panic!("{other}"),
    };
    for name in [
        "add",
        "checksum",
        "hash1k",
        "bsearch",
        "sum_words",
        "reverse16",
        "recurse",
        "vput",
    ] {
        for args in [words(&[11, 3]), words(&[3, 1])] {
            let want = outcome(&exe(name, EngineKind::Interp), &args);
            for engine in [EngineKind::Interp, EngineKind::Jit] {
                let p = v4.loaded.get(name).unwrap();
                let e = Executable::new(p, engine, &VerifierConfig::default()).unwrap();
                assert_eq!(outcome(&e, &args), want, "{name} v4 on {engine}");
            }
        }
    }
}
