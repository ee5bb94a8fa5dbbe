//! The `--metrics` endpoint's request routing: any bytes a peer sends get a route, no panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = naam_runtime::udp::route(data);
});
