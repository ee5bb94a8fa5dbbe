//! The one table of message kinds. Every NAAM message (inside its datagram framing) starts with
//! a version byte and a kind byte; this module is the only place either value is defined.
//! Kinds the XDP eSwitch reads on the wire (requests, sealed envelopes) come from naam-ebpf's
//! `eswitch` ABI, so the kernel program and the runtime cannot disagree.

/// Version byte of every message this crate encodes (requests, replies, one-sided operations,
/// completions, control, forwards, sealed envelopes).
pub const VERSION: u8 = 1;

/// Kind byte of an active-message request.
pub const REQUEST: u8 = naam_ebpf::eswitch::KIND_REQUEST;
/// Kind byte of a reply to a request.
pub const REPLY: u8 = 2;
/// Kind byte of an emulated one-sided RDMA operation (client → NIC agent).
pub const ONE_SIDED_OP: u8 = 3;
/// Kind byte of a one-sided operation's completion (NIC agent → client).
pub const ONE_SIDED_COMPLETION: u8 = 4;
/// Kind byte of a control message (manifest, hello, weights, load reports, pairing).
pub const CONTROL: u8 = 5;
/// Kind byte of a message the server forwards to its paired NIC inside their session.
pub const FORWARD: u8 = 6;
/// Kind byte of a sealed (authenticated) envelope around any other message.
pub const SEALED: u8 = naam_ebpf::eswitch::KIND_SEALED;
/// Kind byte of several messages of one session travelling together in one sealed envelope.
pub const BATCH: u8 = 8;

/// A message kind, decoded from its byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MessageKind {
    /// An active-message request ([`REQUEST`], [`crate::wire::Request`]).
    Request,
    /// A reply to a request ([`REPLY`], [`crate::wire::Reply`]).
    Reply,
    /// An emulated one-sided RDMA operation, client → NIC agent
    /// ([`crate::onesided::Operation`]).
    OneSidedOp,
    /// A one-sided operation's completion, NIC agent → client
    /// ([`crate::onesided::Completion`]).
    OneSidedCompletion,
    /// A control message ([`crate::control::Control`]): handshake, manifest, weights, pairing.
    Control,
    /// A client's sealed request that the server forwards to its paired NIC
    /// ([`crate::control::forward`]).
    Forward,
    /// An authenticated envelope around a message of any other kind
    /// ([`crate::session::SessionKey::seal`]).
    Sealed,
    /// Several messages of one session coalesced in one envelope ([`crate::batch`]).
    Batch,
}

impl MessageKind {
    /// Every kind, in byte order.
    pub const ALL: [MessageKind; 8] = [
        MessageKind::Request,
        MessageKind::Reply,
        MessageKind::OneSidedOp,
        MessageKind::OneSidedCompletion,
        MessageKind::Control,
        MessageKind::Forward,
        MessageKind::Sealed,
        MessageKind::Batch,
    ];

    /// The kind's byte on the wire.
    pub const fn byte(self) -> u8 {
        match self {
            MessageKind::Request => REQUEST,
            MessageKind::Reply => REPLY,
            MessageKind::OneSidedOp => ONE_SIDED_OP,
            MessageKind::OneSidedCompletion => ONE_SIDED_COMPLETION,
            MessageKind::Control => CONTROL,
            MessageKind::Forward => FORWARD,
            MessageKind::Sealed => SEALED,
            MessageKind::Batch => BATCH,
        }
    }

    /// The kind a byte names, if any.
    pub fn from_byte(b: u8) -> Option<MessageKind> {
        MessageKind::ALL.into_iter().find(|k| k.byte() == b)
    }

    /// The kind of an encoded message (its second byte), if it has one this crate knows.
    pub fn peek(message: &[u8]) -> Option<MessageKind> {
        message.get(1).copied().and_then(MessageKind::from_byte)
    }

    /// A short name for logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            MessageKind::Request => "request",
            MessageKind::Reply => "reply",
            MessageKind::OneSidedOp => "one-sided-op",
            MessageKind::OneSidedCompletion => "one-sided-completion",
            MessageKind::Control => "control",
            MessageKind::Forward => "forward",
            MessageKind::Sealed => "sealed",
            MessageKind::Batch => "batch",
        }
    }
}

impl std::fmt::Display for MessageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_bytes_are_distinct_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for k in MessageKind::ALL {
            assert!(seen.insert(k.byte()), "{k} shares its byte");
            assert_eq!(MessageKind::from_byte(k.byte()), Some(k));
        }
        assert_eq!(MessageKind::from_byte(0), None);
        assert_eq!(MessageKind::peek(&[VERSION]), None);
        assert_eq!(
            MessageKind::peek(&[VERSION, CONTROL]),
            Some(MessageKind::Control)
        );
    }
}
