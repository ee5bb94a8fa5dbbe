//! Runs N direct operations of one kind on the criterion benches' setup (MICA: 10,000 keys of
//! 16 bytes, 64-byte values, `MicaConfig::preset_16_64(100_000)`; the B-tree: 100,000 keys in
//! 1 KiB nodes; keys visited with the benches' stride), NAAM's or the native reference's, for
//! counting instructions per operation: run it under `valgrind --tool=callgrind` with two
//! counts and divide the difference of the totals by the difference of the counts (the
//! setup cancels out).
//!
//! `cargo run --release -p naam-bench --example direct_ops -- OPERATION N`

use std::process::ExitCode;
use std::sync::Arc;

use naam_btree::reference::NativeBTree;
use naam_btree::{BTreeClient, BTreeConfig, BTreeHandle};
use naam_mica::reference::NativeMica;
use naam_mica::{MicaClient, MicaConfig, MicaHandle};
use naam_runtime::proto::Placement;
use naam_runtime::Direct;

const OPERATIONS: [&str; 8] = [
    "mica-get",
    "mica-put",
    "mica-native-get",
    "mica-native-put",
    "btree-lookup",
    "btree-update",
    "btree-native-lookup",
    "btree-native-update",
];

type Failure = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (op, count) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(why) => return usage(&why),
    };
    let ran = match op.split_once('-') {
        Some(("mica", op)) => mica(op, count),
        _ => btree(&op["btree-".len()..], count),
    };
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("direct_ops: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The operation and the count the arguments name, or why they name none.
fn parse(args: &[String]) -> Result<(&str, u64), String> {
    match args {
        [op, n] if OPERATIONS.contains(&op.as_str()) => match n.parse::<u64>() {
            Ok(n) => Ok((op.as_str(), n)),
            Err(e) => Err(format!("count {n:?}: {e}")),
        },
        [op, _] => Err(format!("unknown operation {op:?}")),
        _ => Err("two arguments expected".into()),
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!(
        "direct_ops: {why}\nusage: direct_ops OPERATION COUNT, OPERATION one of {}",
        OPERATIONS.join(", ")
    );
    ExitCode::from(2)
}

fn missing_region() -> Failure {
    "a region of the app is missing from the direct transport".into()
}

fn mica(op: &str, count: u64) -> Result<(), Failure> {
    const KEYS: usize = 10_000;
    let object = Arc::new(naam_mica::handlers()?);
    let config = MicaConfig::preset_16_64(100_000);
    let value = vec![7u8; 64];
    let keys: Vec<Vec<u8>> = (0..KEYS)
        .map(|i| format!("user{i:012}").into_bytes())
        .collect();
    let spec = naam_mica::app_spec(1, &config, object, Placement::Host)?;
    let direct = Direct::new(std::slice::from_ref(&spec))?;
    let handle =
        MicaHandle::with_keys(1, config, |n| direct.region_key(1, n)).ok_or_else(missing_region)?;
    let mut naam = MicaClient::new(direct, handle);
    let mut native = NativeMica::new(config);
    for k in &keys {
        naam.put(k, &value)?;
        native.put(k, &value);
    }
    let mut i = 0;
    for _ in 0..count {
        i = (i + 7919) % KEYS;
        let key = &keys[i];
        match op {
            "get" => drop(std::hint::black_box(naam.get(key)?)),
            "put" => drop(std::hint::black_box(naam.put(key, &value)?)),
            "native-get" => drop(std::hint::black_box(native.get(key))),
            _ => drop(std::hint::black_box(native.put(key, &value))),
        }
    }
    Ok(())
}

fn btree(op: &str, count: u64) -> Result<(), Failure> {
    const KEYS: u64 = 100_000;
    let object = Arc::new(naam_btree::handlers()?);
    let config = BTreeConfig::for_keys(KEYS * 2);
    let key = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 1;
    let spec = naam_btree::app_spec(1, &config, object, Placement::Host)?;
    let direct = Direct::new(std::slice::from_ref(&spec))?;
    let handle = BTreeHandle::with_keys(1, config, |n| direct.region_key(1, n))
        .ok_or_else(missing_region)?;
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
        match op {
            "lookup" => drop(std::hint::black_box(naam.get(key(i))?)),
            "update" => drop(std::hint::black_box(naam.update(key(i), i + 1)?)),
            "native-lookup" => drop(std::hint::black_box(native.get(key(i)))),
            _ => drop(std::hint::black_box(native.update(key(i), i + 1))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> Result<(String, u64), String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        parse(&args).map(|(op, n)| (op.to_string(), n))
    }

    /// Every operation is named as listed; a count is a whole number of operations.
    #[test]
    fn operations_and_counts_are_read_as_given() {
        for op in OPERATIONS {
            assert_eq!(parsed(&[op, "10000"]), Ok((op.to_string(), 10_000)));
        }
    }

    /// Bad arguments are refused with the reason, before anything is set up.
    #[test]
    fn bad_arguments_are_refused_with_a_reason() {
        let refused = |args: &[&str], why: &str| {
            let e = parsed(args).expect_err("refused");
            assert!(e.contains(why), "{args:?}: {e}");
        };
        refused(&["mica-delete", "10"], "unknown operation \"mica-delete\"");
        refused(&["mica-get", "ten"], "count \"ten\"");
        refused(&["mica-get", "-1"], "count \"-1\"");
        refused(&["mica-get", "18446744073709551616"], "count");
        refused(&["mica-get"], "two arguments expected");
        refused(&["mica-get", "1", "2"], "two arguments expected");
        refused(&[], "two arguments expected");
    }
}
