//! Runs N direct MICA operations of one kind (the criterion bench's setup: 10,000 keys of 16
//! bytes, 64-byte values, `MicaConfig::preset_16_64(100_000)`, keys visited with the bench's
//! stride), for counting instructions per operation: run it under
//! `valgrind --tool=callgrind` with two counts and divide the difference of the totals by
//! the difference of the counts (the setup cancels out).
//!
//! `cargo run --release -p naam-mica --example mica_ops -- get|put|native-get|native-put N`

use std::process::ExitCode;
use std::sync::Arc;

use naam_mica::reference::NativeMica;
use naam_mica::{app_spec, handlers, MicaClient, MicaConfig, MicaHandle};
use naam_proto::Placement;
use naam_runtime::Direct;

const KEYS: usize = 10_000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, count) = match args.as_slice() {
        [mode, n] => match n.parse::<u64>() {
            Ok(n) => (mode.as_str(), n),
            Err(e) => return usage(&format!("count {n:?}: {e}")),
        },
        _ => return usage("two arguments expected"),
    };
    if !["get", "put", "native-get", "native-put"].contains(&mode) {
        return usage(&format!("unknown operation {mode:?}"));
    }
    match run(mode, count) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mica_ops: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!("mica_ops: {why}\nusage: mica_ops get|put|native-get|native-put COUNT");
    ExitCode::from(2)
}

fn run(mode: &str, count: u64) -> Result<(), Box<dyn std::error::Error>> {
    let object = Arc::new(handlers()?);
    let config = MicaConfig::preset_16_64(100_000);
    let value = vec![7u8; 64];
    let keys: Vec<Vec<u8>> = (0..KEYS)
        .map(|i| format!("user{i:012}").into_bytes())
        .collect();
    let spec = app_spec(1, &config, object, Placement::Host)?;
    let direct = Direct::new(std::slice::from_ref(&spec))?;
    let handle = MicaHandle::with_keys(1, config, |n| direct.region_key(1, n))
        .ok_or("a region of the app is missing from the direct transport")?;
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
        match mode {
            "get" => {
                std::hint::black_box(naam.get(key)?);
            }
            "put" => {
                std::hint::black_box(naam.put(key, &value)?);
            }
            "native-get" => {
                std::hint::black_box(native.get(key));
            }
            _ => {
                std::hint::black_box(native.put(key, &value));
            }
        }
    }
    Ok(())
}
