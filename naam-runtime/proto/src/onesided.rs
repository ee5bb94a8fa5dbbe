//! Emulated one-sided RDMA over a datagram fabric: the codec of READ / WRITE / CAS / FAA
//! operations and their completions. The agent that executes them against registered memory
//! lives with the memory, in naam-runtime.
//!
//! Operation (little-endian):
//! ```text
//!  0 u8 version (1)   1 u8 kind (3)   2 u8 op (1 READ, 2 WRITE, 3 CAS, 4 FAA)   3 u8 n
//!  4 u32 app          8 u64 operation id
//! 16 READ:  n × (rkey u64, offset u64, len u32, reserved u32), 1 ≤ n ≤ 8
//!    WRITE: rkey u64, offset u64, len u32, reserved u32, then len bytes        (n = 1)
//!    CAS:   rkey u64, offset u64, expected u64, new u64                        (n = 1)
//!    FAA:   rkey u64, offset u64, add u64                                      (n = 1)
//! ```
//! Completion:
//! ```text
//!  0 u8 version (1)   1 u8 kind (4)   2 u16 status (wire::Status)   4 u32 app
//!  8 u64 operation id                16 u32 data length   20 u32 reserved (0)
//! 24 data: READ the n ranges back to back; CAS / FAA the old value (u64); WRITE nothing;
//!    an error: its message
//! ```

use bytes::{Buf, BufMut, Bytes, BytesMut};
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE, MAX_NEXT};

use crate::kind::{ONE_SIDED_COMPLETION as KIND_COMPLETION, ONE_SIDED_OP as KIND_OP, VERSION};
use crate::limits::MAX_TRANSFER;
use crate::wire::{check_exact, header, Status, WireError};
/// Bytes of an operation's fixed header (version, kind, op, count, app, id); ranges follow.
pub const HEADER: usize = 16;
/// Bytes of a completion's fixed header, through its reserved word; the data follows.
pub const COMPLETION_HEADER: usize = 24;

/// One one-sided operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Reads each range (one step's segments in one round trip).
    Read(Vec<Descriptor>),
    /// Writes `data` at `offset` of `rkey`.
    Write {
        /// rkey of the target region (it must grant write access).
        rkey: u64,
        /// Byte offset in the region where `data` starts.
        offset: u64,
        /// The bytes to store, at most [`crate::limits::MAX_TRANSFER`].
        data: Bytes,
    },
    /// 64-bit compare-and-swap.
    Cas {
        /// rkey of the target region (it must grant atomic access).
        rkey: u64,
        /// Offset (8-byte aligned).
        offset: u64,
        /// Value the little-endian `u64` at `offset` must hold for the swap to happen.
        expected: u64,
        /// Stored in its place on a match; the completion carries the old value either way.
        new: u64,
    },
    /// 64-bit fetch-and-add.
    Faa {
        /// rkey of the target region (it must grant atomic access).
        rkey: u64,
        /// Offset (8-byte aligned).
        offset: u64,
        /// Added, wrapping, to the little-endian `u64` at `offset`; the completion carries the
        /// old value.
        add: u64,
    },
}

impl Op {
    /// True for operations that change memory (they are deduplicated by id at the agent).
    pub fn mutates(&self) -> bool {
        !matches!(self, Op::Read(_))
    }

    /// Every region the operation touches, with the right it needs there.
    pub fn targets(&self) -> Vec<(u64, u32)> {
        match self {
            Op::Read(ds) => ds.iter().map(|d| (d.rkey, ACCESS_READ)).collect(),
            Op::Write { rkey, .. } => vec![(*rkey, ACCESS_WRITE)],
            Op::Cas { rkey, .. } | Op::Faa { rkey, .. } => vec![(*rkey, ACCESS_ATOMIC)],
        }
    }

    fn code(&self) -> u8 {
        match self {
            Op::Read(_) => 1,
            Op::Write { .. } => 2,
            Op::Cas { .. } => 3,
            Op::Faa { .. } => 4,
        }
    }
}

/// An operation with its addressing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    /// App whose regions it targets.
    pub app: u32,
    /// Operation id (matches the completion; retransmissions reuse it).
    pub id: u64,
    /// What to do, and on which ranges of the app's regions.
    pub op: Op,
}

/// The answer to one operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The app of the operation it answers, echoed back.
    pub app: u32,
    /// Id of the operation it answers, echoed back, so the answer to a retransmission matches too.
    pub id: u64,
    /// Outcome (`Ok`, `BadKey`, `OutOfRange`, `AccessDenied`, `Malformed`, `Unavailable`).
    pub status: Status,
    /// Data or error message.
    pub data: Bytes,
}

impl Operation {
    /// Encodes the operation.
    pub fn to_bytes(&self) -> Result<Bytes, WireError> {
        let mut b = BytesMut::with_capacity(HEADER + 32);
        let n = match &self.op {
            Op::Read(ds) => {
                if ds.is_empty() || ds.len() > MAX_NEXT {
                    return Err(WireError::Invalid {
                        field: "read ranges",
                        value: ds.len() as u64,
                    });
                }
                let total: u64 = ds.iter().map(|d| d.len as u64).sum();
                if total > MAX_TRANSFER as u64 {
                    return Err(WireError::TooLarge {
                        field: "read length",
                        value: total as usize,
                        limit: MAX_TRANSFER,
                    });
                }
                ds.len() as u8
            }
            Op::Write { data, .. } if data.len() > MAX_TRANSFER => {
                return Err(WireError::TooLarge {
                    field: "write length",
                    value: data.len(),
                    limit: MAX_TRANSFER,
                })
            }
            _ => 1,
        };
        b.put_u8(VERSION);
        b.put_u8(KIND_OP);
        b.put_u8(self.op.code());
        b.put_u8(n);
        b.put_u32_le(self.app);
        b.put_u64_le(self.id);
        match &self.op {
            Op::Read(ds) => {
                for d in ds {
                    b.put_u64_le(d.rkey);
                    b.put_u64_le(d.offset);
                    b.put_u32_le(d.len);
                    b.put_u32_le(0);
                }
            }
            Op::Write { rkey, offset, data } => {
                b.put_u64_le(*rkey);
                b.put_u64_le(*offset);
                b.put_u32_le(data.len() as u32);
                b.put_u32_le(0);
                b.put_slice(data);
            }
            Op::Cas {
                rkey,
                offset,
                expected,
                new,
            } => {
                b.put_u64_le(*rkey);
                b.put_u64_le(*offset);
                b.put_u64_le(*expected);
                b.put_u64_le(*new);
            }
            Op::Faa { rkey, offset, add } => {
                b.put_u64_le(*rkey);
                b.put_u64_le(*offset);
                b.put_u64_le(*add);
            }
        }
        Ok(b.freeze())
    }

    /// Decodes an operation, strictly (exact length, zero reserved fields, limits).
    pub fn decode(buf: Bytes) -> Result<Operation, WireError> {
        let have = buf.len();
        header(&buf, HEADER, KIND_OP)?;
        // The operands follow the header: read on through the whole message.
        let mut h = &buf[2..];
        let code = h.get_u8();
        let n = h.get_u8() as usize;
        let app = h.get_u32_le();
        let id = h.get_u64_le();
        let need = |len: usize| check_exact(have, HEADER + len);
        let single = || {
            if n == 1 {
                Ok(())
            } else {
                Err(WireError::Invalid {
                    field: "operation count",
                    value: n as u64,
                })
            }
        };
        let op = match code {
            1 => {
                if n == 0 || n > MAX_NEXT {
                    return Err(WireError::Invalid {
                        field: "read ranges",
                        value: n as u64,
                    });
                }
                need(n * 24)?;
                let mut ds = Vec::with_capacity(n);
                let mut total = 0u64;
                for _ in 0..n {
                    let rkey = h.get_u64_le();
                    let offset = h.get_u64_le();
                    let len = h.get_u32_le();
                    zero_reserved(h.get_u32_le())?;
                    total += len as u64;
                    ds.push(Descriptor {
                        rkey,
                        offset,
                        len,
                        access: ACCESS_READ,
                    });
                }
                if total > MAX_TRANSFER as u64 {
                    return Err(WireError::TooLarge {
                        field: "read length",
                        value: total as usize,
                        limit: MAX_TRANSFER,
                    });
                }
                Op::Read(ds)
            }
            2 => {
                single()?;
                if have < HEADER + 24 {
                    return Err(WireError::Truncated {
                        need: HEADER + 24,
                        have,
                    });
                }
                let rkey = h.get_u64_le();
                let offset = h.get_u64_le();
                let len = h.get_u32_le() as usize;
                zero_reserved(h.get_u32_le())?;
                if len > MAX_TRANSFER {
                    return Err(WireError::TooLarge {
                        field: "write length",
                        value: len,
                        limit: MAX_TRANSFER,
                    });
                }
                need(24 + len)?;
                Op::Write {
                    rkey,
                    offset,
                    data: buf.slice(HEADER + 24..),
                }
            }
            3 => {
                single()?;
                need(32)?;
                Op::Cas {
                    rkey: h.get_u64_le(),
                    offset: h.get_u64_le(),
                    expected: h.get_u64_le(),
                    new: h.get_u64_le(),
                }
            }
            4 => {
                single()?;
                need(24)?;
                Op::Faa {
                    rkey: h.get_u64_le(),
                    offset: h.get_u64_le(),
                    add: h.get_u64_le(),
                }
            }
            other => {
                return Err(WireError::Invalid {
                    field: "one-sided op",
                    value: other as u64,
                })
            }
        };
        Ok(Operation { app, id, op })
    }
}

impl Completion {
    /// An error completion for operation `id` of `app`.
    pub fn error(app: u32, id: u64, status: Status, message: impl Into<String>) -> Completion {
        Completion {
            app,
            id,
            status,
            data: Bytes::from(message.into().into_bytes()),
        }
    }

    /// Encodes the completion.
    pub fn to_bytes(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(COMPLETION_HEADER + self.data.len());
        b.put_u8(VERSION);
        b.put_u8(KIND_COMPLETION);
        b.put_u16_le(self.status as u16);
        b.put_u32_le(self.app);
        b.put_u64_le(self.id);
        b.put_u32_le(self.data.len() as u32);
        b.put_u32_le(0);
        b.put_slice(&self.data);
        b.freeze()
    }

    /// Decodes a completion; `data` shares `buf`'s storage.
    pub fn decode(buf: Bytes) -> Result<Completion, WireError> {
        let have = buf.len();
        let mut h = header(&buf, COMPLETION_HEADER, KIND_COMPLETION)?;
        let raw = h.get_u16_le();
        let status = Status::from_u16(raw).ok_or(WireError::Invalid {
            field: "status",
            value: raw as u64,
        })?;
        let app = h.get_u32_le();
        let id = h.get_u64_le();
        let len = h.get_u32_le() as usize;
        zero_reserved(h.get_u32_le())?;
        if COMPLETION_HEADER + len != have {
            return Err(WireError::LengthMismatch {
                expected: COMPLETION_HEADER + len,
                actual: have,
            });
        }
        Ok(Completion {
            app,
            id,
            status,
            data: buf.slice(COMPLETION_HEADER..),
        })
    }
}

/// Reserved fields must be zero, so that they can carry meaning in a later version.
fn zero_reserved(v: u32) -> Result<(), WireError> {
    if v == 0 {
        Ok(())
    } else {
        Err(WireError::Invalid {
            field: "reserved",
            value: v as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read(rkey: u64, offset: u64, len: u32) -> Descriptor {
        Descriptor {
            rkey,
            offset,
            len,
            access: ACCESS_READ,
        }
    }

    #[test]
    fn every_operation_round_trips() {
        let ops = [
            Op::Read(vec![read(9, 0, 8), read(9, 16, 4)]),
            Op::Write {
                rkey: 9,
                offset: 8,
                data: Bytes::from_static(b"abcd"),
            },
            Op::Cas {
                rkey: 9,
                offset: 0,
                expected: 1,
                new: 2,
            },
            Op::Faa {
                rkey: 9,
                offset: 0,
                add: 5,
            },
        ];
        for (i, op) in ops.into_iter().enumerate() {
            let req = Operation {
                app: 4,
                id: i as u64,
                op,
            };
            let back = Operation::decode(req.to_bytes().unwrap()).unwrap();
            assert_eq!(back, req);
        }
        let c = Completion::error(4, 7, Status::BadKey, "no such key");
        assert_eq!(Completion::decode(c.to_bytes()).unwrap(), c);
    }

    #[test]
    fn oversized_operations_are_refused_by_the_encoder() {
        let big = Operation {
            app: 1,
            id: 1,
            op: Op::Write {
                rkey: 1,
                offset: 0,
                data: Bytes::from(vec![0u8; MAX_TRANSFER + 1]),
            },
        };
        assert!(big.to_bytes().is_err());
        let none = Operation {
            app: 1,
            id: 1,
            op: Op::Read(vec![]),
        };
        assert!(none.to_bytes().is_err());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Operation::decode(Bytes::from(bytes.clone()));
            let _ = Completion::decode(Bytes::from(bytes));
        }
    }
}
