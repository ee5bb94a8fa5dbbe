//! YCSB over several naam-servers (`--server A,B,C` or `--cluster FILE`): every operation goes
//! to the server that owns its key's Redis Cluster hash slot, the slot a RESP client's
//! `CLUSTER SLOTS` routing picks for the same key. This module owns the slot map of a run and
//! the store that splits one client thread's operations over one store per server.
//!
//! The key a slot is taken of is the key as the RESP front spells it: a MICA record's YCSB
//! name (`user…`), a B-tree record's number in decimal. So records loaded by naam-bench are
//! where `redis-cli -c GET user…` finds them on a cluster whose nodes hold the same slots.
//! A scan spans every server: it runs on each, and the records found are the first `len` of
//! their union (counted, as a single server's scans are).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use naam_resp::slots::{derived_id, even_ranges, key_slot, ClusterMap, MapError, Node, SLOTS};
use serde::Serialize;

use crate::driver::App;
use crate::phase::{PipedStore, Store, StoreOp};
use crate::ycsb::KeyNaming;

/// One server of a sharded run and the slots it owns (inclusive ranges).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Shard {
    /// naam-server's UDP address.
    pub server: SocketAddr,
    /// Its slot ranges, inclusive at both ends.
    pub slots: Vec<(u16, u16)>,
}

/// The shards of `servers` with the slots `redis-cli --cluster create` would give them, in the
/// order given. Refuses an empty list and a server named twice.
pub fn even_shards(servers: &[SocketAddr]) -> anyhow::Result<Vec<Shard>> {
    if servers.is_empty() {
        bail!("--server: no address");
    }
    if servers.len() > usize::from(SLOTS) {
        bail!(
            "--server: {} servers, more than the {SLOTS} slots",
            servers.len()
        );
    }
    if let Some((i, a)) = first_repeat(servers) {
        bail!("--server: {a} is named twice (position {})", i + 1);
    }
    Ok(servers
        .iter()
        .zip(even_ranges(servers.len()))
        .map(|(&server, range)| Shard {
            server,
            slots: vec![range],
        })
        .collect())
}

/// The first address of `servers` that an earlier one repeats, with its position.
fn first_repeat(servers: &[SocketAddr]) -> Option<(usize, SocketAddr)> {
    servers
        .iter()
        .enumerate()
        .find(|(i, a)| servers[..*i].contains(a))
        .map(|(i, &a)| (i, a))
}

/// The shards of a cluster file (naam-server's `resp_cluster`, naam-resp's `--cluster`): each
/// node's `naam` address with its slots, checked as naam-server checks the file (every slot
/// owned exactly once).
pub fn cluster_file_shards(path: &Path) -> anyhow::Result<Vec<Shard>> {
    let file = naam_resp::cluster_file::ClusterFile::load(path)?;
    let nodes = file.nodes(path)?;
    let first = nodes
        .first()
        .map(|n| n.addr)
        .with_context(|| format!("cluster file {}: no [[node]]", path.display()))?;
    // The map's checks (coverage, overlaps, ids); the map itself is of RESP addresses.
    ClusterMap::new(nodes.clone(), first)
        .with_context(|| format!("cluster file {}", path.display()))?;
    let servers: Vec<SocketAddr> = file.node.iter().map(|n| n.naam).collect();
    if let Some((_, dup)) = first_repeat(&servers) {
        bail!(
            "cluster file {}: naam address {dup} is given to two nodes",
            path.display()
        );
    }
    Ok(nodes
        .into_iter()
        .zip(servers)
        .map(|(n, server)| Shard {
            server,
            slots: n.ranges,
        })
        .collect())
}

/// Which shard owns each slot, and how a record's key is spelt for its slot.
#[derive(Clone, Debug)]
pub struct SlotRoute {
    /// The shards as a cluster map (node `i` is shard `i`), checked as naam-server checks one.
    map: ClusterMap,
    app: App,
    naming: KeyNaming,
}

impl SlotRoute {
    /// The route of `shards` (every slot owned by exactly one of them) for `app`'s keys named
    /// by `naming`.
    pub fn new(shards: &[Shard], app: App, naming: KeyNaming) -> anyhow::Result<SlotRoute> {
        let nodes = shards
            .iter()
            .map(|s| Node {
                id: derived_id(s.server),
                addr: s.server,
                ranges: s.slots.clone(),
            })
            .collect();
        let me = shards
            .first()
            .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |s| s.server);
        let map = ClusterMap::new(nodes, me).map_err(|e| match e {
            MapError::Uncovered { slot } => anyhow::anyhow!("slot {slot} is owned by no server"),
            MapError::Overlap {
                slot,
                first,
                second,
            } => anyhow::anyhow!("slot {slot} is owned by both {first} and {second}"),
            MapError::BadRange { node, range } => {
                anyhow::anyhow!("{node}: slot range {range} is not within 0-16383")
            }
            other => anyhow::Error::new(other),
        })?;
        Ok(SlotRoute { map, app, naming })
    }

    /// The shard of record number `n`; `key` is scratch space for its spelling.
    pub fn shard_of(&self, n: u64, key: &mut String) -> usize {
        match self.app {
            App::Mica => self.naming.name_into(n, key),
            App::Btree => {
                use std::fmt::Write;
                key.clear();
                let _ = write!(key, "{}", self.naming.number(n));
            }
        }
        self.map.owner_index(key_slot(key.as_bytes()))
    }

    /// How many of the record numbers `0..records` each of the `shards` shards owns.
    pub fn counts(&self, shards: usize, records: u64) -> Vec<u64> {
        let mut counts = vec![0u64; shards];
        let mut key = String::new();
        for n in 0..records {
            counts[self.shard_of(n, &mut key)] += 1;
        }
        counts
    }
}

/// One client thread's store over every shard: each operation on its key's shard's store, a
/// scan on all of them.
pub(crate) struct ShardedStore {
    shards: Vec<Box<dyn Store + Send>>,
    route: Arc<SlotRoute>,
    key: String,
    /// Scans in flight on several shards, by tag: parts still out, and the first error.
    scans: HashMap<u64, (usize, Option<anyhow::Error>)>,
    /// Operations each shard was given and has not handed back (scans count once per shard).
    out: Vec<usize>,
    /// Where the next poll starts, so no shard's answers wait behind another's.
    next: usize,
}

impl ShardedStore {
    /// The store over `shards` (one store per server, in the route's shard order).
    pub(crate) fn new(shards: Vec<Box<dyn Store + Send>>, route: Arc<SlotRoute>) -> Self {
        let n = shards.len();
        ShardedStore {
            shards,
            route,
            key: String::new(),
            scans: HashMap::new(),
            out: vec![0; n],
            next: 0,
        }
    }

    fn shard(&mut self, n: u64) -> usize {
        self.route.shard_of(n, &mut self.key)
    }

    fn piped_shard(&mut self, i: usize) -> anyhow::Result<&mut dyn PipedStore> {
        self.shards[i]
            .piped()
            .context("a sharded pipelined run needs a pipelined store on every server")
    }
}

impl Store for ShardedStore {
    fn read(&mut self, n: u64) -> anyhow::Result<bool> {
        let i = self.shard(n);
        self.shards[i].read(n)
    }
    fn update(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        let i = self.shard(n);
        self.shards[i].update(n, field, bytes)
    }
    fn insert(&mut self, n: u64, record: &[u8]) -> anyhow::Result<()> {
        let i = self.shard(n);
        self.shards[i].insert(n, record)
    }
    fn scan(&mut self, n: u64, len: usize) -> anyhow::Result<usize> {
        // Each shard's first `len` records from the start key; the union's first `len` are
        // `len` of them if the shards found that many together.
        let mut found = 0usize;
        for s in &mut self.shards {
            found = found.saturating_add(s.scan(n, len)?);
        }
        Ok(found.min(len))
    }
    fn rmw(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        let i = self.shard(n);
        self.shards[i].rmw(n, field, bytes)
    }
    fn piped(&mut self) -> Option<&mut dyn PipedStore> {
        if self.shards.iter_mut().all(|s| s.piped().is_some()) {
            Some(self)
        } else {
            None
        }
    }
}

impl PipedStore for ShardedStore {
    fn start(&mut self, tag: u64, op: StoreOp) -> anyhow::Result<()> {
        let n = match &op {
            StoreOp::Scan(..) => {
                // On every shard under the same tag (each shard has its own tags).
                let parts = self.shards.len();
                for i in 0..parts {
                    self.piped_shard(i)?.start(tag, op.clone())?;
                    self.out[i] += 1;
                }
                self.scans.insert(tag, (parts, None));
                return Ok(());
            }
            StoreOp::Read(n)
            | StoreOp::Update(n, ..)
            | StoreOp::Rmw(n, ..)
            | StoreOp::Insert(n, _) => *n,
        };
        let i = self.shard(n);
        self.piped_shard(i)?.start(tag, op)?;
        self.out[i] += 1;
        Ok(())
    }

    fn finished(&mut self, block: bool) -> Vec<(u64, anyhow::Result<bool>)> {
        // Block only when one shard has anything out: waiting on one would hold back the
        // answers the others already have.
        let busy = self.out.iter().filter(|&&o| o > 0).count();
        let shards = self.shards.len();
        let mut out = Vec::new();
        for k in 0..shards {
            let i = (self.next + k) % shards;
            if self.out[i] == 0 {
                continue;
            }
            let done = match self.piped_shard(i) {
                Ok(p) => p.finished(block && busy == 1),
                Err(_) => continue,
            };
            self.out[i] -= done.len().min(self.out[i]);
            for (tag, r) in done {
                match self.scans.get_mut(&tag) {
                    Some((parts, first_error)) => {
                        *parts -= 1;
                        if let Err(e) = r {
                            first_error.get_or_insert(e);
                        }
                        if *parts == 0 {
                            let (_, e) = self.scans.remove(&tag).unwrap_or((0, None));
                            out.push((tag, e.map_or(Ok(true), Err)));
                        }
                    }
                    None => out.push((tag, r)),
                }
            }
        }
        self.next = (self.next + 1) % shards.max(1);
        out
    }

    fn in_flight(&self) -> usize {
        // Operations, not parts: a scan out on every shard is one.
        let parts: usize = self.out.iter().sum();
        let extra: usize = self
            .scans
            .values()
            .map(|(left, _)| left.saturating_sub(1))
            .sum();
        parts - extra.min(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn servers_get_redis_clis_slots_and_keys_their_slots_owner() {
        let shards = even_shards(&[addr(1), addr(2), addr(3)]).unwrap();
        assert_eq!(shards[1].slots, vec![(5461, 10922)]);
        assert!(even_shards(&[addr(1), addr(1)])
            .unwrap_err()
            .to_string()
            .contains("named twice"));
        assert!(even_shards(&[]).is_err());
        let route = SlotRoute::new(&shards, App::Mica, KeyNaming::default()).unwrap();
        let mut key = String::new();
        for n in 0..200 {
            let i = route.shard_of(n, &mut key);
            let slot = key_slot(KeyNaming::default().name(n).as_bytes());
            let (a, b) = shards[i].slots[0];
            assert!(
                (a..=b).contains(&slot),
                "record {n}: slot {slot} on shard {i}"
            );
        }
        // B-tree records by their number in decimal, as the RESP front spells them.
        let route = SlotRoute::new(&shards, App::Btree, KeyNaming::default()).unwrap();
        let i = route.shard_of(7, &mut key);
        assert_eq!(key, KeyNaming::default().number(7).to_string());
        let slot = key_slot(key.as_bytes());
        assert!((shards[i].slots[0].0..=shards[i].slots[0].1).contains(&slot));
        let counts = route.counts(3, 3000);
        assert_eq!(counts.iter().sum::<u64>(), 3000);
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }

    #[test]
    fn a_route_with_a_hole_or_an_overlap_is_refused() {
        let mut shards = even_shards(&[addr(1), addr(2)]).unwrap();
        shards[1].slots = vec![(8193, 16383)];
        let e = SlotRoute::new(&shards, App::Mica, KeyNaming::default()).unwrap_err();
        assert!(
            e.to_string().contains("slot 8192 is owned by no server"),
            "{e}"
        );
        shards[1].slots = vec![(8000, 16383)];
        let e = SlotRoute::new(&shards, App::Mica, KeyNaming::default()).unwrap_err();
        assert!(e.to_string().contains("owned by both"), "{e}");
        shards[1].slots = vec![(8192, 16384)];
        let e = SlotRoute::new(&shards, App::Mica, KeyNaming::default()).unwrap_err();
        assert!(e.to_string().contains("is not within 0-16383"), "{e}");
    }

    #[test]
    fn a_cluster_file_gives_its_naam_addresses_and_slots() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.toml");
        std::fs::write(
            &path,
            r#"
[[node]]
resp = "127.0.0.1:7001"
naam = "127.0.0.1:7101"
slots = ["0-99", "200-16383"]
[[node]]
resp = "127.0.0.1:7002"
naam = "127.0.0.1:7102"
slots = ["100-199"]
"#,
        )
        .unwrap();
        let shards = cluster_file_shards(&path).unwrap();
        assert_eq!(shards[0].server, addr(7101));
        assert_eq!(shards[0].slots, vec![(0, 99), (200, 16383)]);
        assert_eq!(shards[1].slots, vec![(100, 199)]);
        std::fs::write(
            &path,
            "[[node]]\nresp = \"127.0.0.1:7001\"\nnaam = \"127.0.0.1:7101\"\nslots = [\"0-99\"]\n",
        )
        .unwrap();
        let e = cluster_file_shards(&path).unwrap_err();
        assert!(format!("{e:#}").contains("served by no node"), "{e:#}");
    }

    /// A piped store that answers each operation on the next poll, recording what it got.
    struct Echo {
        started: Arc<std::sync::Mutex<Vec<(u64, String)>>>,
        pending: Vec<u64>,
        name: &'static str,
    }

    impl Store for Echo {
        fn read(&mut self, _: u64) -> anyhow::Result<bool> {
            Ok(true)
        }
        fn update(&mut self, _: u64, _: usize, _: &[u8]) -> anyhow::Result<()> {
            Ok(())
        }
        fn insert(&mut self, _: u64, _: &[u8]) -> anyhow::Result<()> {
            Ok(())
        }
        fn scan(&mut self, _: u64, len: usize) -> anyhow::Result<usize> {
            Ok(len / 2 + 1)
        }
        fn rmw(&mut self, _: u64, _: usize, _: &[u8]) -> anyhow::Result<()> {
            Ok(())
        }
        fn piped(&mut self) -> Option<&mut dyn PipedStore> {
            Some(self)
        }
    }

    impl PipedStore for Echo {
        fn start(&mut self, tag: u64, _: StoreOp) -> anyhow::Result<()> {
            self.started.lock().unwrap().push((tag, self.name.into()));
            self.pending.push(tag);
            Ok(())
        }
        fn finished(&mut self, _: bool) -> Vec<(u64, anyhow::Result<bool>)> {
            self.pending.drain(..).map(|t| (t, Ok(true))).collect()
        }
        fn in_flight(&self) -> usize {
            self.pending.len()
        }
    }

    #[test]
    fn operations_go_to_their_shard_and_a_scan_to_all_answered_once() {
        let shards = even_shards(&[addr(1), addr(2), addr(3)]).unwrap();
        let route = Arc::new(SlotRoute::new(&shards, App::Btree, KeyNaming::default()).unwrap());
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stores: Vec<Box<dyn Store + Send>> = ["a", "b", "c"]
            .into_iter()
            .map(|name| {
                Box::new(Echo {
                    started: log.clone(),
                    pending: Vec::new(),
                    name,
                }) as Box<dyn Store + Send>
            })
            .collect();
        let mut s = ShardedStore::new(stores, route.clone());
        // Alone: a scan's count is of the union, at most `len`.
        assert_eq!(s.scan(1, 10).unwrap(), 10);
        assert_eq!(s.scan(1, 1).unwrap(), 1);
        let p = s.piped().unwrap();
        for tag in 0..30u64 {
            p.start(tag, StoreOp::Read(tag)).unwrap();
        }
        p.start(99, StoreOp::Scan(5, 10)).unwrap();
        assert_eq!(p.in_flight(), 31);
        let mut done: Vec<u64> = p.finished(true).into_iter().map(|(t, _)| t).collect();
        done.sort_unstable();
        let mut want: Vec<u64> = (0..30).collect();
        want.push(99);
        assert_eq!(done, want, "every operation once, the scan once");
        assert_eq!(p.in_flight(), 0);
        let log = log.lock().unwrap();
        let mut key = String::new();
        for (tag, name) in log.iter().filter(|(t, _)| *t < 30) {
            let i = route.shard_of(*tag, &mut key);
            assert_eq!(name, ["a", "b", "c"][i], "read {tag}");
        }
        assert_eq!(log.iter().filter(|(t, _)| *t == 99).count(), 3);
    }
}
