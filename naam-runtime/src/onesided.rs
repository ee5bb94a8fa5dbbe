//! Emulated one-sided RDMA over a datagram fabric, IO-free: the codec of READ / WRITE / CAS /
//! FAA operations and their completions, and the agent's execution of one operation against a
//! region table (rkey, rights and bounds checked, as an RNIC checks a memory key).
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

use crate::executor::resolve_status;
use crate::region::{MemError, RegionTable};
use crate::wire::{check_exact, header, Status, WireError, VERSION};

/// Kind byte of a one-sided operation.
pub const KIND_OP: u8 = 3;
/// Kind byte of a one-sided completion.
pub const KIND_COMPLETION: u8 = 4;
/// Header size of both.
pub const HEADER: usize = 16;
/// Completion header size.
pub const COMPLETION_HEADER: usize = 24;
/// Most bytes one READ or WRITE moves (fits the datagram fabric's 8 KiB message).
pub const MAX_TRANSFER: usize = 7 * 1024;

/// One one-sided operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Reads each range (one step's segments in one round trip).
    Read(Vec<Descriptor>),
    /// Writes `data` at `offset` of `rkey`.
    Write {
        /// Region.
        rkey: u64,
        /// Offset.
        offset: u64,
        /// Bytes.
        data: Bytes,
    },
    /// 64-bit compare-and-swap.
    Cas {
        /// Region.
        rkey: u64,
        /// Offset (8-byte aligned).
        offset: u64,
        /// Expected value.
        expected: u64,
        /// New value.
        new: u64,
    },
    /// 64-bit fetch-and-add.
    Faa {
        /// Region.
        rkey: u64,
        /// Offset (8-byte aligned).
        offset: u64,
        /// Addend.
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
pub struct Request {
    /// App whose regions it targets.
    pub app: u32,
    /// Operation id (matches the completion; retransmissions reuse it).
    pub id: u64,
    /// The operation.
    pub op: Op,
}

/// The answer to one operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// App.
    pub app: u32,
    /// Operation id.
    pub id: u64,
    /// Outcome (`Ok`, `BadKey`, `OutOfRange`, `AccessDenied`, `Malformed`, `Unavailable`).
    pub status: Status,
    /// Data or error message.
    pub data: Bytes,
}

impl Request {
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
    pub fn decode(buf: Bytes) -> Result<Request, WireError> {
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
        Ok(Request { app, id, op })
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

fn mem_status(e: &MemError) -> Status {
    match e {
        MemError::OutOfRange { .. } => Status::OutOfRange,
        MemError::Misaligned(_) => Status::Refused,
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

/// Runs one operation against `regions` as the NIC's agent would: the rkey must name a region
/// of `req.app` granting the right the operation needs (READ: read, WRITE: write, CAS/FAA:
/// atomic) and the range must lie inside it. Never panics on any input.
pub fn execute(regions: &RegionTable, req: &Request) -> Completion {
    let fail = |status, msg: String| Completion::error(req.app, req.id, status, msg);
    let check = |rkey: u64, offset: u64, len: u64, access: u32| {
        let d = Descriptor {
            rkey,
            offset,
            len: u32::try_from(len).unwrap_or(u32::MAX),
            access,
        };
        regions
            .resolve(req.app, &d)
            .map_err(|e| fail(resolve_status(&e), e.to_string()))
    };
    let ok = |data: Bytes| Completion {
        app: req.app,
        id: req.id,
        status: Status::Ok,
        data,
    };
    match &req.op {
        Op::Read(ds) => {
            let total: usize = ds.iter().map(|d| d.len as usize).sum();
            let mut out = vec![0u8; total];
            let mut at = 0;
            for d in ds {
                let r = match check(d.rkey, d.offset, d.len as u64, ACCESS_READ) {
                    Ok(r) => r,
                    Err(c) => return c,
                };
                let n = d.len as usize;
                if let Err(e) = r.region.mem.read(r.offset, &mut out[at..at + n]) {
                    return fail(mem_status(&e), e.to_string());
                }
                at += n;
            }
            ok(Bytes::from(out))
        }
        Op::Write { rkey, offset, data } => {
            let r = match check(*rkey, *offset, data.len() as u64, ACCESS_WRITE) {
                Ok(r) => r,
                Err(c) => return c,
            };
            match r.region.mem.write(r.offset, data) {
                Ok(()) => ok(Bytes::new()),
                Err(e) => fail(mem_status(&e), e.to_string()),
            }
        }
        Op::Cas {
            rkey,
            offset,
            expected,
            new,
        } => {
            let r = match check(*rkey, *offset, 8, ACCESS_ATOMIC) {
                Ok(r) => r,
                Err(c) => return c,
            };
            match r.region.mem.cas(r.offset, *expected, *new) {
                Ok(old) => ok(Bytes::copy_from_slice(&old.to_le_bytes())),
                Err(e) => fail(mem_status(&e), e.to_string()),
            }
        }
        Op::Faa { rkey, offset, add } => {
            let r = match check(*rkey, *offset, 8, ACCESS_ATOMIC) {
                Ok(r) => r,
                Err(c) => return c,
            };
            match r.region.mem.faa(r.offset, *add) {
                Ok(old) => ok(Bytes::copy_from_slice(&old.to_le_bytes())),
                Err(e) => fail(mem_status(&e), e.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{RegionMemory, ALL_RIGHTS, READ_ONLY};
    use proptest::prelude::*;

    fn table() -> (RegionTable, u64, u64) {
        let mut t = RegionTable::new();
        let rw = t
            .register(1, "rw", ALL_RIGHTS, RegionMemory::zeroed(64))
            .rkey;
        let ro = t
            .register(1, "ro", READ_ONLY, RegionMemory::from_bytes(&[7u8; 16]))
            .rkey;
        (t, rw, ro)
    }

    fn run(t: &RegionTable, op: Op) -> Completion {
        let req = Request { app: 1, id: 9, op };
        let bytes = req.to_bytes().unwrap();
        let back = Request::decode(bytes).unwrap();
        assert_eq!(back, req);
        let c = execute(t, &back);
        assert_eq!(Completion::decode(c.to_bytes()).unwrap(), c);
        c
    }

    fn read(rkey: u64, offset: u64, len: u32) -> Descriptor {
        Descriptor {
            rkey,
            offset,
            len,
            access: ACCESS_READ,
        }
    }

    #[test]
    fn every_operation_round_trips_and_runs() {
        let (t, rw, ro) = table();
        let w = run(
            &t,
            Op::Write {
                rkey: rw,
                offset: 3,
                data: Bytes::from_static(b"hello"),
            },
        );
        assert_eq!(w.status, Status::Ok);
        let r = run(&t, Op::Read(vec![read(rw, 3, 5), read(ro, 0, 2)]));
        assert_eq!(&r.data[..], b"hello\x07\x07");
        let c = run(
            &t,
            Op::Cas {
                rkey: rw,
                offset: 8,
                expected: 0,
                new: 5,
            },
        );
        assert_eq!(c.data[..], 0u64.to_le_bytes());
        let f = run(
            &t,
            Op::Faa {
                rkey: rw,
                offset: 8,
                add: 2,
            },
        );
        assert_eq!(f.data[..], 5u64.to_le_bytes());
        assert_eq!(t.get(1, rw).unwrap().mem.load_u64(8).unwrap(), 7);
    }

    #[test]
    fn rights_keys_and_bounds_are_enforced() {
        let (t, rw, ro) = table();
        let denied = run(
            &t,
            Op::Write {
                rkey: ro,
                offset: 0,
                data: Bytes::from_static(b"x"),
            },
        );
        assert_eq!(denied.status, Status::AccessDenied);
        let atomic = run(
            &t,
            Op::Faa {
                rkey: ro,
                offset: 0,
                add: 1,
            },
        );
        assert_eq!(atomic.status, Status::AccessDenied);
        assert_eq!(
            run(&t, Op::Read(vec![read(rw, 60, 8)])).status,
            Status::OutOfRange
        );
        assert_eq!(
            run(&t, Op::Read(vec![read(rw, u64::MAX, 8)])).status,
            Status::OutOfRange
        );
        assert_eq!(
            run(&t, Op::Read(vec![read(12345, 0, 8)])).status,
            Status::BadKey
        );
        let other_app = execute(
            &t,
            &Request {
                app: 2,
                id: 1,
                op: Op::Read(vec![read(rw, 0, 8)]),
            },
        );
        assert_eq!(other_app.status, Status::BadKey);
        let misaligned = run(
            &t,
            Op::Cas {
                rkey: rw,
                offset: 4,
                expected: 0,
                new: 1,
            },
        );
        assert_eq!(misaligned.status, Status::Refused);
        assert_eq!(ro, t.get(1, ro).unwrap().rkey);
    }

    #[test]
    fn oversized_operations_are_refused_by_the_encoder() {
        let (_, rw, _) = table();
        let big = Request {
            app: 1,
            id: 1,
            op: Op::Write {
                rkey: rw,
                offset: 0,
                data: Bytes::from(vec![0u8; MAX_TRANSFER + 1]),
            },
        };
        assert!(big.to_bytes().is_err());
        let none = Request {
            app: 1,
            id: 1,
            op: Op::Read(vec![]),
        };
        assert!(none.to_bytes().is_err());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Request::decode(Bytes::from(bytes.clone()));
            let _ = Completion::decode(Bytes::from(bytes));
        }

        #[test]
        fn mutated_operations_decode_or_fail_cleanly(
            at in 0usize..64, value in any::<u8>(), len in 0u32..64, offset in 0u64..64
        ) {
            let (t, rw, _) = table();
            let mut b = Request { app: 1, id: 3, op: Op::Read(vec![read(rw, offset, len)]) }
                .to_bytes().unwrap().to_vec();
            let i = at % b.len();
            b[i] = value;
            if let Ok(req) = Request::decode(Bytes::from(b)) {
                let _ = execute(&t, &req);
            }
        }
    }
}
