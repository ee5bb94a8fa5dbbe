//! Arbitrary bytes as a request or a reply: decode must return an error or a message that
//! re-encodes to the same bytes.
#![no_main]
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use naam_proto::wire::{Reply, Request};

fuzz_target!(|data: &[u8]| {
    let buf = Bytes::copy_from_slice(data);
    if let Ok(r) = Request::decode(buf.clone()) {
        assert_eq!(r.to_bytes().unwrap(), buf);
    }
    if let Ok(r) = Reply::decode(buf.clone()) {
        assert_eq!(r.to_bytes().unwrap(), buf);
    }
});
