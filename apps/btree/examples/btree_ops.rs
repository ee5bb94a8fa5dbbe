//! Runs N direct B-tree operations of one kind (the criterion bench's setup: 100,000 keys in
//! 1 KiB nodes, keys visited with the bench's stride), for counting instructions per
//! operation: run it under `valgrind --tool=callgrind` with two counts and divide the
//! difference of the totals by the difference of the counts (the setup cancels out).
//!
//! `cargo run --release -p naam-btree --example btree_ops -- lookup|update|native-lookup|native-update N`

use std::process::ExitCode;
use std::sync::Arc;

use naam_btree::reference::NativeBTree;
use naam_btree::{app_spec, handlers, BTreeClient, BTreeConfig, BTreeHandle};
use naam_proto::Placement;
use naam_runtime::Direct;

const KEYS: u64 = 100_000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, count) = match args.as_slice() {
        [mode, n] => match n.parse::<u64>() {
            Ok(n) => (mode.as_str(), n),
            Err(e) => return usage(&format!("count {n:?}: {e}")),
        },
        _ => return usage("two arguments expected"),
    };
    if !["lookup", "update", "native-lookup", "native-update"].contains(&mode) {
        return usage(&format!("unknown operation {mode:?}"));
    }
    match run(mode, count) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("btree_ops: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!("btree_ops: {why}\nusage: btree_ops lookup|update|native-lookup|native-update COUNT");
    ExitCode::from(2)
}

fn run(mode: &str, count: u64) -> Result<(), Box<dyn std::error::Error>> {
    let object = Arc::new(handlers()?);
    let config = BTreeConfig::for_keys(KEYS * 2);
    let key = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 1;
    let spec = app_spec(1, &config, object, Placement::Host)?;
    let direct = Direct::new(std::slice::from_ref(&spec))?;
    let handle = BTreeHandle::with_keys(1, config, |n| direct.region_key(1, n))
        .ok_or("a region of the app is missing from the direct transport")?;
    let mut naam = BTreeClient::new(direct, handle);
    let mut native = NativeBTree::new(config);
    for i in 0..KEYS {
        naam.insert(key(i), i)?;
        native.insert(key(i), i);
    }
    naam.refresh_root()?;
    let mut i = 0;
    for _ in 0..count {
        i = (i + 7919) % KEYS;
        match mode {
            "lookup" => {
                std::hint::black_box(naam.get(key(i))?);
            }
            "update" => {
                std::hint::black_box(naam.update(key(i), i + 1)?);
            }
            "native-lookup" => {
                std::hint::black_box(native.get(key(i)));
            }
            _ => {
                std::hint::black_box(native.update(key(i), i + 1));
            }
        }
    }
    Ok(())
}
