//! What a driver reads from an encoded message before (or instead of) decoding it: its kind
//! and the id it answers, so that a reply can be matched to its request without a full
//! decode. The offsets are those of each format's header (see [`crate::wire`],
//! [`crate::onesided`], [`crate::control`]); they are named here once.

use crate::kind::{self, MessageKind};

/// Offset of the request id in a request and in a reply.
pub const REQUEST_ID_AT: usize = naam_ebpf::eswitch::REQ_ID;
/// Offset of the operation id in a one-sided operation and its completion.
pub const OPERATION_ID_AT: usize = 8;
/// Offset of the id in a control message.
pub const CONTROL_ID_AT: usize = 8;

/// The id a message carries: a request's or reply's request id, a one-sided operation's or
/// completion's operation id, a control message's id. `None` for other kinds (forwards and
/// sealed envelopes carry no id of their own), for an unknown kind, a wrong version, or a
/// message too short to hold one.
pub fn message_id(message: &[u8]) -> Option<(MessageKind, u64)> {
    if message.first() != Some(&kind::VERSION) {
        return None;
    }
    let k = MessageKind::peek(message)?;
    let at = match k {
        MessageKind::Request | MessageKind::Reply => REQUEST_ID_AT,
        MessageKind::OneSidedOp | MessageKind::OneSidedCompletion => OPERATION_ID_AT,
        MessageKind::Control => CONTROL_ID_AT,
        _ => return None,
    };
    let b: [u8; 8] = message.get(at..at + 8)?.try_into().ok()?;
    Some((k, u64::from_le_bytes(b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Control;
    use crate::onesided::{Completion, Op, Operation};
    use crate::wire::{Descriptors, Reply, Request, Status};
    use bytes::Bytes;

    #[test]
    fn ids_are_read_where_the_encoders_write_them() {
        let req = Request::new(
            1,
            2,
            0x1122_3344_5566_7788,
            Bytes::new(),
            Descriptors::new(),
        );
        let bytes = req.to_bytes().unwrap();
        assert_eq!(
            message_id(&bytes),
            Some((MessageKind::Request, 0x1122_3344_5566_7788))
        );
        let reply = Reply {
            app: 1,
            request_id: req.request_id,
            status: Status::Busy,
            code: 0,
            steps: 0,
            placement: crate::Placement::Host,
            load: crate::wire::LoadFeedback::default(),
            payload: Bytes::new(),
        };
        let mut b = bytes::BytesMut::new();
        reply.encode(&mut b).unwrap();
        assert_eq!(
            message_id(&b),
            Some((MessageKind::Reply, 0x1122_3344_5566_7788))
        );
        let op = Operation {
            app: 1,
            id: 77,
            op: Op::Faa {
                rkey: 1,
                offset: 0,
                add: 1,
            },
        };
        assert_eq!(
            message_id(&op.to_bytes().unwrap()),
            Some((MessageKind::OneSidedOp, 77))
        );
        let c = Completion::error(1, 78, Status::BadKey, "no");
        assert_eq!(
            message_id(&c.to_bytes()),
            Some((MessageKind::OneSidedCompletion, 78))
        );
        let ctl = Control::Error {
            message: "x".into(),
        };
        assert_eq!(
            message_id(&ctl.to_bytes(79)),
            Some((MessageKind::Control, 79))
        );
        assert_eq!(message_id(&bytes[..10]), None);
        assert_eq!(message_id(&[9, 1, 0, 0]), None);
    }
}
