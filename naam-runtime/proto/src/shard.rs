//! Sessions sharded over a server's receive loops (one socket and one run-to-completion loop
//! per core, as MICA partitions by core): which loop owns a session, and the *route* every
//! datagram carries so that the kernel delivers it to that loop without a hand-off.
//!
//! A session's route is the low byte of its id, never 0; the server draws the ids of loop
//! `index` of `count` so that `route % count == index`. Every fragment of a sealed message
//! carries its session's route in its frame header ([`crate::frame::ROUTE`]); handshakes and
//! other unsealed messages carry 0, "no route". A driver with several loops has the kernel
//! read that byte (a classic BPF program on an `SO_REUSEPORT` group: the socket with index
//! `route % count`, and the kernel's own hash of the addresses for route 0, which keeps one
//! client's handshake on one loop). The hash would put two clients on one loop half the
//! time, so the server chooses instead: its `Challenge` names a route, taken in turn over the
//! loops ([`crate::endpoint::SessionDirectory`]), and the client's `Auth` carries it in its
//! control header ([`crate::control::CONTROL_ROUTE`]), so the session is set up, and stays,
//! on that loop.

use crate::limits::MAX_LOOPS;
use crate::session::peek_sealed;

/// One receive loop's share of a server's sessions: loop `index` of `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    index: u8,
    count: u8,
}

/// A shard that cannot be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// Zero loops, or more than [`MAX_LOOPS`].
    #[error("{0} receive loops: between 1 and {MAX_LOOPS}")]
    Count(usize),
    /// An index past the count.
    #[error("loop {index} of {count} does not exist")]
    Index {
        /// The index asked for.
        index: usize,
        /// The loops there are.
        count: usize,
    },
}

impl Shard {
    /// The only loop of a server that has one.
    pub const SOLE: Shard = Shard { index: 0, count: 1 };

    /// Loop `index` of `count`.
    pub fn new(index: usize, count: usize) -> Result<Shard, ShardError> {
        if count == 0 || count > MAX_LOOPS {
            return Err(ShardError::Count(count));
        }
        if index >= count {
            return Err(ShardError::Index { index, count });
        }
        Ok(Shard {
            index: index as u8,
            count: count as u8,
        })
    }

    /// Every loop of a `count`-loop server, in index order.
    pub fn all(count: usize) -> Result<Vec<Shard>, ShardError> {
        if count == 0 || count > MAX_LOOPS {
            return Err(ShardError::Count(count));
        }
        Ok((0..count)
            .map(|i| Shard {
                index: i as u8,
                count: count as u8,
            })
            .collect())
    }

    /// This loop's index.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// How many loops the server has.
    pub fn count(&self) -> usize {
        self.count as usize
    }

    /// Whether session `id` is this loop's.
    pub fn owns(&self, id: u64) -> bool {
        loop_of_route(route_of_session(id), self.count()) == Some(self.index())
    }

    /// The smallest route to this loop: what a `Challenge` names to send an `Auth` here.
    pub fn route(&self) -> u8 {
        if self.index == 0 {
            self.count
        } else {
            self.index
        }
    }

    /// A session id of this loop made from a random draw: the draw's upper 56 bits, and a low
    /// byte (the route) drawn from the draw's low byte among the nonzero bytes that fall to
    /// this loop.
    pub fn session_id(&self, draw: u64) -> u64 {
        let count = self.count as u64;
        let first = self.route() as u64;
        let choices = (255 - first) / count + 1;
        let low = first + count * ((draw & 0xff) % choices);
        (draw & !0xff) | low
    }
}

/// The route of session `id`: its low byte.
pub fn route_of_session(id: u64) -> u8 {
    id as u8
}

/// The loop of `count` that route `route` goes to; `None` for route 0 (no route: the kernel's
/// hash decides).
pub fn loop_of_route(route: u8, count: usize) -> Option<usize> {
    (route != 0 && count > 0).then(|| route as usize % count)
}

/// The route of a message about to be framed: its session's, when it is a sealed envelope;
/// the route in its header, when it is a control message (an `Auth`, routed by its
/// challenge); else 0.
pub fn route_of(message: &[u8]) -> u8 {
    use crate::control::{CONTROL_HEADER, CONTROL_ROUTE};
    match peek_sealed(message) {
        Ok(h) => route_of_session(h.session),
        Err(_) => crate::wire::header(message, CONTROL_HEADER, crate::kind::CONTROL)
            .map_or(0, |_| message[CONTROL_ROUTE]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bad_shards_are_refused() {
        assert_eq!(Shard::new(0, 0), Err(ShardError::Count(0)));
        assert_eq!(
            Shard::new(0, MAX_LOOPS + 1),
            Err(ShardError::Count(MAX_LOOPS + 1))
        );
        assert_eq!(
            Shard::new(3, 3),
            Err(ShardError::Index { index: 3, count: 3 })
        );
        assert_eq!(Shard::all(0), Err(ShardError::Count(0)));
        assert_eq!(Shard::all(3).unwrap().len(), 3);
    }

    proptest! {
        /// Every id a loop draws is routed back to it, and never has route 0.
        #[test]
        fn drawn_ids_route_to_their_loop(draw in any::<u64>(), count in 1..=MAX_LOOPS, pick in any::<usize>()) {
            let shard = Shard::new(pick % count, count).unwrap();
            let id = shard.session_id(draw);
            prop_assert_ne!(route_of_session(id), 0);
            prop_assert_eq!(id >> 8, draw >> 8);
            prop_assert!(shard.owns(id));
            prop_assert_eq!(loop_of_route(route_of_session(id), count), Some(shard.index()));
            for other in Shard::all(count).unwrap() {
                prop_assert_eq!(other.owns(id), other == shard);
            }
        }
    }

    #[test]
    fn every_route_of_a_loop_can_be_drawn() {
        for count in [1usize, 2, 3, 7, MAX_LOOPS] {
            for shard in Shard::all(count).unwrap() {
                let routes: std::collections::BTreeSet<u8> = (0..=255u64)
                    .map(|d| route_of_session(shard.session_id(d)))
                    .collect();
                let want: std::collections::BTreeSet<u8> = (1..=255u8)
                    .filter(|r| *r as usize % count == shard.index())
                    .collect();
                assert_eq!(routes, want, "loop {} of {count}", shard.index());
            }
        }
    }

    #[test]
    fn sealed_messages_and_routed_control_messages_have_a_route() {
        let key = crate::session::SessionKey::new(0x1234_5678_9abc_de42, 7, [1; 32]);
        let sealed = key.seal(crate::session::Sender::Client, 1, b"inner");
        assert_eq!(route_of(&sealed), 0x42);
        assert_eq!(route_of(b"\x01\x01not sealed at all"), 0);
        assert_eq!(route_of(&[]), 0);
        let hello = crate::control::Control::Hello {
            tenant: "t".into(),
            nonce: [0; crate::session::NONCE_LEN],
        };
        assert_eq!(route_of(&hello.to_bytes(3)), 0);
        assert_eq!(route_of(&hello.to_routed_bytes(3, 0x17)), 0x17);
        // A short message with a control header's first bytes has none.
        assert_eq!(route_of(&hello.to_routed_bytes(3, 0x17)[..8]), 0);
    }

    #[test]
    fn a_loops_route_reaches_it() {
        for count in 1..=MAX_LOOPS {
            for shard in Shard::all(count).unwrap() {
                assert_ne!(shard.route(), 0);
                assert_eq!(loop_of_route(shard.route(), count), Some(shard.index()));
            }
        }
    }
}
