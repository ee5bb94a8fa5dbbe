//! The one-sided agent: executes emulated one-sided RDMA operations against a region table,
//! checking rkey, rights and bounds as an RNIC checks a memory key. The operations' codec is
//! naam-proto's [`naam_proto::onesided`].

use bytes::Bytes;
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};

use naam_proto::onesided::*;
use naam_proto::wire::Status;

use crate::RegionTable;
use naam_proto::step::resolve_status;

/// Runs one operation against `regions` as the NIC's agent would: the rkey must name a region
/// of `req.app` granting the right the operation needs (READ: read, WRITE: write, CAS/FAA:
/// atomic) and the range must lie inside it. Never panics on any input.
pub fn execute(regions: &RegionTable, req: &Operation) -> Completion {
    let fail = |status: Status, msg: String| {
        tracing::debug!(
            app = req.app,
            id = req.id,
            status = status.name(),
            "one-sided operation refused: {msg}"
        );
        Completion::error(req.app, req.id, status, msg)
    };
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
                    return fail(e.status(), e.to_string());
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
                Err(e) => fail(e.status(), e.to_string()),
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
                Err(e) => fail(e.status(), e.to_string()),
            }
        }
        Op::Faa { rkey, offset, add } => {
            let r = match check(*rkey, *offset, 8, ACCESS_ATOMIC) {
                Ok(r) => r,
                Err(c) => return c,
            };
            match r.region.mem.faa(r.offset, *add) {
                Ok(old) => ok(Bytes::copy_from_slice(&old.to_le_bytes())),
                Err(e) => fail(e.status(), e.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RegionMemory, ALL_RIGHTS, READ_ONLY};
    use proptest::prelude::*;

    fn table() -> (RegionTable, u64, u64) {
        let t = RegionTable::new();
        let rw = t
            .register(1, "rw", ALL_RIGHTS, RegionMemory::zeroed(64))
            .unwrap()
            .rkey;
        let ro = t
            .register(1, "ro", READ_ONLY, RegionMemory::from_bytes(&[7u8; 16]))
            .unwrap()
            .rkey;
        (t, rw, ro)
    }

    fn run(t: &RegionTable, op: Op) -> Completion {
        let req = Operation { app: 1, id: 9, op };
        let bytes = req.to_bytes().unwrap();
        let back = Operation::decode(bytes).unwrap();
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
            &Operation {
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

    proptest! {
        #[test]
        fn mutated_operations_decode_or_fail_cleanly(
            at in 0usize..64, value in any::<u8>(), len in 0u32..64, offset in 0u64..64
        ) {
            let (t, rw, _) = table();
            let mut b = Operation { app: 1, id: 3, op: Op::Read(vec![read(rw, offset, len)]) }
                .to_bytes().unwrap().to_vec();
            let i = at % b.len();
            b[i] = value;
            if let Ok(req) = Operation::decode(Bytes::from(b)) {
                let _ = execute(&t, &req);
            }
        }
    }
}
