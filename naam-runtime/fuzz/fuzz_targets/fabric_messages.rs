//! Arbitrary bytes as every message the UDP fabric's processes accept from the network: a
//! one-sided operation (decoded, then executed by the agent against real regions), a one-sided
//! completion, a control message, a forwarded request (either form), a batch of coalesced
//! messages, a sealed envelope. Nothing may panic;
//! the agent's answer must always encode, and no input opens under a key it was not sealed
//! with.
#![no_main]
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use naam_proto::control::{unforward, unforward_any, Control};
use naam_proto::onesided::{Completion, Operation};
use naam_runtime::onesided::execute;
use naam_runtime::{RegionMemory, RegionTable, ALL_RIGHTS, READ_ONLY};

fuzz_target!(|data: &[u8]| {
    let t = RegionTable::new();
    // Small rkeys, so that mutated inputs reach real regions, not only the bad-key path.
    let fresh = "a fresh table takes keys 1 and 2";
    t.register_with_key(1, 1, "rw", ALL_RIGHTS, RegionMemory::zeroed(256))
        .expect(fresh);
    t.register_with_key(2, 1, "ro", READ_ONLY, RegionMemory::zeroed(64))
        .expect(fresh);
    let b = Bytes::copy_from_slice(data);
    if let Ok(req) = Operation::decode(b.clone()) {
        let c = execute(&t, &req);
        let _ = Completion::decode(c.to_bytes()).expect("the agent's answer decodes");
    }
    let _ = Completion::decode(b.clone());
    let _ = Control::decode(data);
    let _ = unforward(&b);
    let _ = unforward_any(&b);
    if let Ok(parts) = naam_proto::batch::split(&b) {
        assert!(parts.iter().all(|p| !p.is_empty()), "a batch of empty messages");
    }
    let _ = naam_proto::session::peek_sealed(data);
    let key = naam_proto::session::SessionKey::new(1, 1, [7; 32]);
    assert!(key.open(&b).is_err(), "a forgery opened");
});
