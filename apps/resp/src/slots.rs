//! Redis Cluster's key space, with no IO: the hash slot of a key (CRC16/XMODEM of the key, or
//! of its `{hash tag}`, mod 16,384), a static map of which node serves which slots, and the
//! `CLUSTER SLOTS` / `SHARDS` / `NODES` / `INFO` answers and `MOVED` redirections that
//! cluster-aware clients route by.
//!
//! Membership is static: the map comes from a config file, every node is a primary, and
//! slots never move while the nodes run (resharding is out of scope; see the README).

use std::net::SocketAddr;

use crate::codec::Frame;

/// Slots in Redis Cluster's key space.
pub const SLOTS: u16 = 16_384;

/// CRC16/XMODEM's value for each byte value, built at compile time (one lookup per byte of a
/// key: naam-bench routes every operation by it, the front checks every key's slot).
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), the checksum Redis Cluster hashes keys
/// with.
pub fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// The slot ranges `redis-cli --cluster create` gives `nodes` primaries: 16,384 / `nodes`
/// slots each (rounded to the nearest slot, the last node up to 16,383), in node order. For 3
/// nodes: 0-5460, 5461-10922, 10923-16383. `nodes` is at least 1 and at most [`SLOTS`].
pub fn even_ranges(nodes: usize) -> Vec<(u16, u16)> {
    let nodes = nodes.clamp(1, usize::from(SLOTS));
    let per_node = f64::from(SLOTS) / nodes as f64;
    let mut out = Vec::with_capacity(nodes);
    let (mut first, mut cursor) = (0u16, 0f64);
    for i in 0..nodes {
        let mut last = (cursor + per_node - 1.0).round() as u16;
        if last >= SLOTS || i == nodes - 1 {
            last = SLOTS - 1;
        }
        last = last.max(first);
        out.push((first, last));
        first = last + 1;
        cursor += per_node;
    }
    out
}

/// The slot of `key`: of its hash tag when it has one (the bytes between its first `{` and
/// the first `}` after it, if they are not empty), else of the whole key.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = memchr::memchr(b'{', key).and_then(|open| {
        let rest = &key[open + 1..];
        memchr::memchr(b'}', rest)
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS
}

/// One node of the map: a naam-server's RESP address and the slots it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Its 40-character node id (what `CLUSTER NODES` and `SHARDS` name it by).
    pub id: String,
    /// The address clients send RESP to.
    pub addr: SocketAddr,
    /// Its slot ranges, inclusive at both ends.
    pub ranges: Vec<(u16, u16)>,
}

/// Why a cluster map is not one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// A range that is not `A-B` or `A` with A ≤ B < 16,384.
    #[error("node {node}: slot range {range:?} is not A-B with 0 <= A <= B <= 16383")]
    BadRange {
        /// The node's address.
        node: SocketAddr,
        /// The range as written.
        range: String,
    },
    /// A slot two nodes claim.
    #[error("slot {slot} is served by both {first} and {second}")]
    Overlap {
        /// The slot.
        slot: u16,
        /// One claimant.
        first: SocketAddr,
        /// The other.
        second: SocketAddr,
    },
    /// A slot no node serves: Redis Cluster clients refuse a map with holes.
    #[error("slot {slot} is served by no node (every slot 0-16383 needs one)")]
    Uncovered {
        /// The first such slot.
        slot: u16,
    },
    /// Two nodes on one address, or an id that is not 40 hexadecimal digits.
    #[error("node {node}: {why}")]
    BadNode {
        /// The node's address.
        node: SocketAddr,
        /// What is wrong.
        why: String,
    },
    /// This node's address is not in the map.
    #[error("this server's RESP address {addr} is not one of the cluster's nodes")]
    NotAMember {
        /// The address looked for.
        addr: SocketAddr,
    },
}

/// Parses a slot range as configs write it: `"0-5460"` or `"5461"`.
pub fn parse_range(node: SocketAddr, text: &str) -> Result<(u16, u16), MapError> {
    let bad = || MapError::BadRange {
        node,
        range: text.to_string(),
    };
    let (a, b) = match text.split_once('-') {
        Some((a, b)) => (a.trim(), b.trim()),
        None => (text.trim(), text.trim()),
    };
    let a: u16 = a.parse().map_err(|_| bad())?;
    let b: u16 = b.parse().map_err(|_| bad())?;
    if a > b || b >= SLOTS {
        return Err(bad());
    }
    Ok((a, b))
}

/// A stable node id for `addr` when the config gives none: 40 hex digits of a hash of it, so
/// every node of a cluster derives the same ids from the same config.
pub fn derived_id(addr: SocketAddr) -> String {
    // FNV-1a over the address text, spread over five 64-bit words: an id, not a secret.
    let text = addr.to_string();
    let mut out = String::with_capacity(40);
    for round in 0u64..5 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for b in text.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        out.push_str(&format!("{:08x}", (h >> 16) as u32));
    }
    out
}

/// Which node serves each slot, and which node this one is.
#[derive(Clone, Debug)]
pub struct ClusterMap {
    nodes: Vec<Node>,
    owner: Vec<u16>,
    me: usize,
}

impl ClusterMap {
    /// Checks `nodes` (ranges within 0-16383, every slot served exactly once, distinct
    /// addresses and ids) and finds `me` among them by its RESP address.
    pub fn new(nodes: Vec<Node>, me: SocketAddr) -> Result<ClusterMap, MapError> {
        const NONE: u16 = u16::MAX;
        let mut owner = vec![NONE; SLOTS as usize];
        for (i, n) in nodes.iter().enumerate() {
            if n.id.len() != 40 || !n.id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(MapError::BadNode {
                    node: n.addr,
                    why: format!("id {:?} is not 40 hexadecimal digits", n.id),
                });
            }
            if let Some(other) = nodes[..i].iter().find(|o| o.addr == n.addr || o.id == n.id) {
                return Err(MapError::BadNode {
                    node: n.addr,
                    why: format!("same address or id as node {}", other.addr),
                });
            }
            for &(a, b) in &n.ranges {
                if a > b || b >= SLOTS {
                    return Err(MapError::BadRange {
                        node: n.addr,
                        range: format!("{a}-{b}"),
                    });
                }
                for s in a..=b {
                    let o = &mut owner[s as usize];
                    if *o != NONE {
                        return Err(MapError::Overlap {
                            slot: s,
                            first: nodes[*o as usize].addr,
                            second: n.addr,
                        });
                    }
                    *o = i as u16;
                }
            }
        }
        if let Some(slot) = owner.iter().position(|&o| o == NONE) {
            return Err(MapError::Uncovered { slot: slot as u16 });
        }
        let me = nodes
            .iter()
            .position(|n| n.addr == me)
            .ok_or(MapError::NotAMember { addr: me })?;
        Ok(ClusterMap { nodes, owner, me })
    }

    /// The nodes, in config order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node serving `slot`.
    pub fn owner(&self, slot: u16) -> &Node {
        &self.nodes[self.owner[usize::from(slot % SLOTS)] as usize]
    }

    /// The position in [`ClusterMap::nodes`] of the node serving `slot`.
    pub fn owner_index(&self, slot: u16) -> usize {
        usize::from(self.owner[usize::from(slot % SLOTS)])
    }

    /// Whether this node serves `slot`.
    pub fn is_mine(&self, slot: u16) -> bool {
        usize::from(self.owner[usize::from(slot % SLOTS)]) == self.me
    }

    /// This node.
    pub fn me(&self) -> &Node {
        &self.nodes[self.me]
    }

    /// The `-MOVED` error for `slot` (without the leading `-`).
    pub fn moved(&self, slot: u16) -> String {
        format!("MOVED {slot} {}", self.owner(slot).addr)
    }

    /// `CLUSTER SLOTS`: per range, its first and last slot and its node (ip, port, id).
    pub fn slots_reply(&self) -> Frame {
        let mut ranges: Vec<(u16, u16, &Node)> = self
            .nodes
            .iter()
            .flat_map(|n| n.ranges.iter().map(move |&(a, b)| (a, b, n)))
            .collect();
        ranges.sort_by_key(|r| r.0);
        Frame::Array(
            ranges
                .into_iter()
                .map(|(a, b, n)| {
                    Frame::Array(vec![
                        Frame::Integer(i64::from(a)),
                        Frame::Integer(i64::from(b)),
                        Frame::Array(vec![
                            Frame::bulk(n.addr.ip().to_string()),
                            Frame::Integer(i64::from(n.addr.port())),
                            Frame::bulk(&n.id),
                        ]),
                    ])
                })
                .collect(),
        )
    }

    /// `CLUSTER SHARDS`: per node (each a shard of one primary), its slots and itself.
    /// `map` makes the maps RESP3 maps; in RESP2 they are flat arrays, as Redis sends them.
    pub fn shards_reply(&self, map: bool) -> Frame {
        let pairs = |p: Vec<(&str, Frame)>| {
            if map {
                Frame::Map(p.into_iter().map(|(k, v)| (Frame::bulk(k), v)).collect())
            } else {
                Frame::Array(
                    p.into_iter()
                        .flat_map(|(k, v)| [Frame::bulk(k), v])
                        .collect(),
                )
            }
        };
        Frame::Array(
            self.nodes
                .iter()
                .map(|n| {
                    let slots = n
                        .ranges
                        .iter()
                        .flat_map(|&(a, b)| {
                            [Frame::Integer(i64::from(a)), Frame::Integer(i64::from(b))]
                        })
                        .collect();
                    let node = pairs(vec![
                        ("id", Frame::bulk(&n.id)),
                        ("port", Frame::Integer(i64::from(n.addr.port()))),
                        ("ip", Frame::bulk(n.addr.ip().to_string())),
                        ("endpoint", Frame::bulk(n.addr.ip().to_string())),
                        ("role", Frame::bulk("master")),
                        ("replication-offset", Frame::Integer(0)),
                        ("health", Frame::bulk("online")),
                    ]);
                    pairs(vec![
                        ("slots", Frame::Array(slots)),
                        ("nodes", Frame::Array(vec![node])),
                    ])
                })
                .collect(),
        )
    }

    /// `CLUSTER NODES`: Redis's text, one line per node.
    pub fn nodes_text(&self) -> String {
        let mut out = String::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let flags = if i == self.me {
                "myself,master"
            } else {
                "master"
            };
            let bus = u32::from(n.addr.port()) + 10_000;
            out.push_str(&format!(
                "{} {}:{}@{} {} - 0 0 {} connected",
                n.id,
                n.addr.ip(),
                n.addr.port(),
                bus,
                flags,
                i + 1
            ));
            for &(a, b) in &n.ranges {
                if a == b {
                    out.push_str(&format!(" {a}"));
                } else {
                    out.push_str(&format!(" {a}-{b}"));
                }
            }
            out.push('\n');
        }
        out
    }

    /// `CLUSTER INFO`.
    pub fn info_text(&self) -> String {
        let n = self.nodes.len();
        format!(
            "cluster_enabled:1\r\ncluster_state:ok\r\ncluster_slots_assigned:{SLOTS}\r\n\
             cluster_slots_ok:{SLOTS}\r\ncluster_slots_pfail:0\r\ncluster_slots_fail:0\r\n\
             cluster_known_nodes:{n}\r\ncluster_size:{n}\r\ncluster_current_epoch:{n}\r\n\
             cluster_my_epoch:{}\r\n",
            self.me + 1
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn three() -> Vec<Node> {
        [
            (7001, (0, 5460)),
            (7002, (5461, 10922)),
            (7003, (10923, 16383)),
        ]
        .into_iter()
        .map(|(p, r)| Node {
            id: derived_id(addr(p)),
            addr: addr(p),
            ranges: vec![r],
        })
        .collect()
    }

    #[test]
    fn slots_agree_with_redis_cluster() {
        // The reference values of Redis Cluster's specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // The table-driven CRC against the bitwise definition.
        let bitwise = |bytes: &[u8]| {
            let mut crc: u16 = 0;
            for &b in bytes {
                crc ^= u16::from(b) << 8;
                for _ in 0..8 {
                    crc = if crc & 0x8000 != 0 {
                        (crc << 1) ^ 0x1021
                    } else {
                        crc << 1
                    };
                }
            }
            crc
        };
        for key in [&b""[..], b"a", b"user6284781860667377211", &[0xff; 40]] {
            assert_eq!(crc16(key), bitwise(key), "{key:?}");
        }
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
    }

    #[test]
    fn even_ranges_are_redis_clis_and_cover_every_slot_once() {
        // What `redis-cli --cluster create` assigns three and five primaries.
        assert_eq!(
            even_ranges(3),
            vec![(0, 5460), (5461, 10922), (10923, 16383)]
        );
        assert_eq!(
            even_ranges(5),
            vec![
                (0, 3276),
                (3277, 6553),
                (6554, 9829),
                (9830, 13106),
                (13107, 16383)
            ]
        );
        assert_eq!(even_ranges(1), vec![(0, 16383)]);
        for n in [2, 7, 100, 16_383, 16_384] {
            let r = even_ranges(n);
            assert_eq!(r.len(), n);
            assert_eq!(r[0].0, 0);
            assert_eq!(r[n - 1].1, SLOTS - 1);
            assert!(r
                .windows(2)
                .all(|w| w[1].0 == w[0].1 + 1 && w[0].0 <= w[0].1));
        }
    }

    #[test]
    fn a_map_covers_every_slot_once() {
        let m = ClusterMap::new(three(), addr(7002)).unwrap();
        assert!(m.is_mine(5461) && !m.is_mine(5460));
        assert_eq!(m.moved(12182), "MOVED 12182 127.0.0.1:7003");
        assert!(m.nodes_text().contains("myself,master"));
        let mut holes = three();
        holes[2].ranges = vec![(10924, 16383)];
        assert_eq!(
            ClusterMap::new(holes, addr(7001)).unwrap_err(),
            MapError::Uncovered { slot: 10923 }
        );
        let mut overlap = three();
        overlap[1].ranges = vec![(5460, 10922)];
        assert!(matches!(
            ClusterMap::new(overlap, addr(7001)),
            Err(MapError::Overlap { slot: 5460, .. })
        ));
        assert!(matches!(
            ClusterMap::new(three(), addr(9)),
            Err(MapError::NotAMember { .. })
        ));
        // A range built in code, not parsed, is checked too: refused, never an index panic.
        let mut beyond = three();
        beyond[2].ranges = vec![(10923, 16384)];
        assert!(matches!(
            ClusterMap::new(beyond, addr(7001)),
            Err(MapError::BadRange { .. })
        ));
        assert!(parse_range(addr(1), "5-4").is_err());
        assert!(parse_range(addr(1), "0-16384").is_err());
        assert_eq!(parse_range(addr(1), "7").unwrap(), (7, 7));
    }

    proptest! {
        #[test]
        fn a_hash_tag_decides_the_slot(tag in "[a-z0-9]{1,12}", a in "[a-z:]{0,8}", b in "[a-z:]{0,8}") {
            let key = format!("{a}{{{tag}}}{b}");
            prop_assert_eq!(key_slot(key.as_bytes()), key_slot(tag.as_bytes()));
        }
    }
}
