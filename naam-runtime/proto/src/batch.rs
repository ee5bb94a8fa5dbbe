//! Coalescing: several messages of one session in one sealed envelope, as QUIC packs frames
//! into a packet. A pipelined session's requests (or replies) that are ready together travel
//! in one datagram up to the path's size, so the kernel's per-datagram cost and the seal are
//! paid once per batch instead of once per message.
//!
//! Layout (little-endian): `VERSION`, [`crate::kind::BATCH`], `u16` count, then per message a
//! `u16` length and its bytes. A batch travels only sealed; a receiver opens the envelope
//! once and takes each message as if it had come alone.

use bytes::{BufMut, Bytes, BytesMut};

use crate::kind::{BATCH, VERSION};
use crate::limits::MAX_MESSAGE;
use crate::wire::WireError;

/// Bytes of a batch's header.
pub const HEADER: usize = 4;
/// Bytes each message adds besides its own (its length).
pub const PER_MESSAGE: usize = 2;
/// Most messages in one batch.
pub const MAX_COUNT: usize = 256;

/// The size of a batch of messages of these lengths.
pub fn encoded_len(lens: impl IntoIterator<Item = usize>) -> usize {
    HEADER + lens.into_iter().map(|l| PER_MESSAGE + l).sum::<usize>()
}

/// One batch of `parts` (each non-empty, at most `u16::MAX` bytes; at most [`MAX_COUNT`]).
pub fn encode(parts: &[&[u8]]) -> Result<Bytes, WireError> {
    if parts.is_empty() || parts.len() > MAX_COUNT {
        return Err(WireError::Invalid {
            field: "batch count",
            value: parts.len() as u64,
        });
    }
    let len = encoded_len(parts.iter().map(|p| p.len()));
    if len > MAX_MESSAGE {
        return Err(WireError::TooLarge {
            field: "batch",
            value: len,
            limit: MAX_MESSAGE,
        });
    }
    let mut b = BytesMut::with_capacity(len);
    b.put_u8(VERSION);
    b.put_u8(BATCH);
    b.put_u16_le(parts.len() as u16);
    for p in parts {
        if p.is_empty() {
            return Err(WireError::Invalid {
                field: "batched message length",
                value: 0,
            });
        }
        b.put_u16_le(p.len() as u16);
        b.put_slice(p);
    }
    Ok(b.freeze())
}

/// The messages of batch `m` (views of it, no copy), or why it is not one: wrong version or
/// kind, a count of 0 or over [`MAX_COUNT`], an empty message, lengths that run past the end,
/// or bytes left after the last message.
pub fn split(m: &Bytes) -> Result<Vec<Bytes>, WireError> {
    let truncated = || WireError::Truncated {
        need: HEADER,
        have: m.len(),
    };
    if m.len() < HEADER {
        return Err(truncated());
    }
    if m[0] != VERSION {
        return Err(WireError::Invalid {
            field: "version",
            value: m[0] as u64,
        });
    }
    if m[1] != BATCH {
        return Err(WireError::Invalid {
            field: "kind",
            value: m[1] as u64,
        });
    }
    let count = u16::from_le_bytes([m[2], m[3]]) as usize;
    if count == 0 || count > MAX_COUNT {
        return Err(WireError::Invalid {
            field: "batch count",
            value: count as u64,
        });
    }
    let mut at = HEADER;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let Some(l) = m.get(at..at + PER_MESSAGE) else {
            return Err(WireError::Truncated {
                need: at + PER_MESSAGE,
                have: m.len(),
            });
        };
        let len = u16::from_le_bytes([l[0], l[1]]) as usize;
        at += PER_MESSAGE;
        if len == 0 {
            return Err(WireError::Invalid {
                field: "batched message length",
                value: 0,
            });
        }
        if at + len > m.len() {
            return Err(WireError::Truncated {
                need: at + len,
                have: m.len(),
            });
        }
        out.push(m.slice(at..at + len));
        at += len;
    }
    if at != m.len() {
        return Err(WireError::Invalid {
            field: "bytes after the batch",
            value: (m.len() - at) as u64,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn batches_round_trip(parts in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 1..300), 1..20)) {
            let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            let b = encode(&refs).unwrap();
            prop_assert_eq!(b.len(), encoded_len(parts.iter().map(|p| p.len())));
            let got = split(&b).unwrap();
            prop_assert_eq!(got.len(), parts.len());
            for (g, p) in got.iter().zip(&parts) {
                prop_assert_eq!(&g[..], &p[..]);
            }
        }

        #[test]
        fn any_bytes_split_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let b = Bytes::from(bytes);
            if let Ok(parts) = split(&b) {
                let total: usize = parts.iter().map(|p| p.len() + PER_MESSAGE).sum();
                prop_assert_eq!(total + HEADER, b.len());
                prop_assert!(parts.iter().all(|p| !p.is_empty()));
            }
        }
    }

    #[test]
    fn empty_batches_empty_messages_and_trailing_bytes_are_refused() {
        assert!(encode(&[]).is_err());
        assert!(encode(&[b"a", b""]).is_err());
        let mut b = encode(&[b"abc"]).unwrap().to_vec();
        b.push(0);
        assert!(split(&Bytes::from(b)).is_err());
        assert!(split(&Bytes::from_static(&[VERSION, BATCH, 0, 0])).is_err());
        assert!(split(&Bytes::from_static(&[VERSION, BATCH, 1, 0, 5, 0, 1])).is_err());
    }
}
