//! The RESP front: any bytes a client sends, cut at any point, are commands, an error that
//! closes the connection, or a wait for more; every command gets exactly one answer, which is
//! itself well-formed RESP. No panic, and nothing reserved past the limits.
#![no_main]
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use naam_resp::codec::{parse_command, parse_frame, Limits};
use naam_resp::front::{Connection, FrontConfig};
use naam_resp::store::{MemoryStore, Store};

fuzz_target!(|data: &[u8]| {
    let _ = parse_frame(data, &Limits::default());
    let front = FrontConfig {
        limits: Limits {
            max_bulk: 4096,
            max_args: 64,
            max_inline: 1024,
            max_depth: 8,
        },
        ..FrontConfig::default()
    };
    let mut store = MemoryStore::default();
    let mut conn = Connection::new(1, store.default_tenant());
    let (mut out, mut ops, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
    let mut at = 0;
    let mut commands = 0;
    while at < data.len() && !conn.closing() {
        match parse_command(&data[at..], &front.limits, &mut ranges) {
            Ok(Some(n)) => {
                let frame = Bytes::copy_from_slice(&data[at..at + n]);
                let args: Vec<Bytes> = ranges.iter().map(|r| frame.slice(r.clone())).collect();
                if !args.is_empty() {
                    commands += 1;
                }
                conn.command(&front, 0, &args, &mut store, &mut ops, &mut out);
                at += n;
            }
            Ok(None) => break,
            Err(e) => {
                conn.protocol_error(&e, &mut out);
                commands += 1;
            }
        }
    }
    store.run(&mut ops);
    conn.finish(&ops, &mut out);
    // Exactly one well-formed answer per command (QUIT's +OK included).
    let mut answers = 0;
    let mut rest = &out[..];
    while let Some((_, n)) = parse_frame(rest, &Limits::default()).expect("answers are RESP") {
        answers += 1;
        rest = &rest[n..];
    }
    assert!(rest.is_empty(), "a partial answer");
    assert_eq!(answers, commands);
});
