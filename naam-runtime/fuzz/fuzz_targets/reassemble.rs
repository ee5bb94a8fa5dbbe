//! Arbitrary datagrams from a few peers into one reassembler: decoding and reassembly must
//! never panic, never exceed their memory bounds, and only complete messages of the declared
//! length.
#![no_main]
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use naam_proto::frame::{Fragment, Pushed, Reassembler};
use naam_proto::limits::MAX_MESSAGE;

fuzz_target!(|data: &[u8]| {
    let mut r = Reassembler::<u8>::new(4, 4 * MAX_MESSAGE, 1_000);
    // Each record: peer byte, length byte, then that many bytes of datagram.
    let mut rest = data;
    let mut now = 0;
    while rest.len() >= 2 {
        let (peer, len) = (rest[0] % 3, rest[1] as usize * 4);
        rest = &rest[2..];
        let take = len.min(rest.len());
        let d = Bytes::copy_from_slice(&rest[..take]);
        rest = &rest[take..];
        now += 100;
        if let Ok(f) = Fragment::decode(d) {
            let total = f.total as usize;
            if let Pushed::Complete(m) = r.push(peer, f, now) {
                assert_eq!(m.len(), total);
            }
        }
        assert!(r.pending() <= 4);
        r.expire(now);
    }
});
