//! A native implementation of the same B-link tree: same node layout, same descent, the same
//! proactive splits (one per attempt, restarting from the root). Benchmarks use it as the native
//! baseline; tests compare the NAAM tree's contents with it and with `BTreeMap`.

use naam_btree_layout as l;

use crate::{write_empty_root, BTreeConfig, Written};

/// The tree in plain memory.
pub struct NativeBTree {
    size: usize,
    nodes: Vec<u8>,
    root: u64,
    next: u64,
    max: u64,
}

impl NativeBTree {
    /// An empty tree.
    pub fn new(config: BTreeConfig) -> Self {
        let mut nodes = vec![0u8; config.max_nodes as usize * config.node_size];
        write_empty_root(&mut nodes[..config.node_size]);
        NativeBTree {
            size: config.node_size,
            nodes,
            root: 0,
            next: 1,
            max: config.max_nodes,
        }
    }

    fn word(&self, id: u64, off: usize) -> u64 {
        let at = id as usize * self.size + off;
        u64::from_le_bytes(self.nodes[at..at + 8].try_into().expect("8 bytes"))
    }

    fn set(&mut self, id: u64, off: usize, v: u64) {
        let at = id as usize * self.size + off;
        self.nodes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    fn count(&self, id: u64) -> usize {
        l::count(self.word(id, l::NODE_HEADER)) as usize
    }

    fn key(&self, id: u64, i: usize) -> u64 {
        self.word(id, l::entry(i))
    }

    fn lower_bound(&self, id: u64, key: u64) -> usize {
        let found: Result<usize, core::convert::Infallible> =
            l::lower_bound(self.count(id), key, |i| Ok(self.key(id, i)));
        match found {
            Ok(i) => i,
        }
    }

    fn child_for(&self, id: u64, key: u64) -> u64 {
        let i = self.lower_bound(id, key + 1);
        if i == 0 {
            self.word(id, l::NODE_LEFT)
        } else {
            self.word(id, l::entry(i - 1) + 8)
        }
    }

    /// The leaf that holds `key`.
    fn leaf(&self, key: u64) -> u64 {
        let mut id = self.root;
        loop {
            if key >= self.word(id, l::NODE_HIGH) {
                id = self.word(id, l::NODE_SIBLING);
            } else if l::level(self.word(id, l::NODE_HEADER)) > 0 {
                id = self.child_for(id, key);
            } else {
                return id;
            }
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: u64) -> Option<u64> {
        let id = self.leaf(key);
        let p = self.lower_bound(id, key);
        (p < self.count(id) && self.key(id, p) == key).then(|| self.word(id, l::entry(p) + 8))
    }

    /// Up to `max` pairs at or above `start`.
    pub fn scan(&self, start: u64, max: usize) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut id = self.leaf(start);
        let mut from = self.lower_bound(id, start);
        loop {
            for i in from..self.count(id) {
                if out.len() == max {
                    return out;
                }
                out.push((self.key(id, i), self.word(id, l::entry(i) + 8)));
            }
            let sib = self.word(id, l::NODE_SIBLING);
            if sib == l::NO_NODE || out.len() == max {
                return out;
            }
            id = sib;
            from = 0;
        }
    }

    fn copy_within(&mut self, from: (u64, usize), to: (u64, usize), len: usize) {
        let f = from.0 as usize * self.size + from.1;
        let t = to.0 as usize * self.size + to.1;
        self.nodes.copy_within(f..f + len, t);
    }

    fn split(&mut self, id: u64, parent: Option<u64>) {
        let cap = l::capacity(self.size);
        let mid = cap / 2;
        let header = self.word(id, l::NODE_HEADER);
        let level = l::level(header);
        let sep = self.key(id, mid);
        let (first, new_left) = if level == 0 {
            (mid, 0)
        } else {
            (mid + 1, self.word(id, l::entry(mid) + 8))
        };
        let moved = cap - first;
        let new = self.next;
        self.set(new, l::NODE_HEADER, l::header(level, moved as u64, 0));
        self.set(new, l::NODE_HIGH, self.word(id, l::NODE_HIGH));
        self.set(new, l::NODE_SIBLING, self.word(id, l::NODE_SIBLING));
        self.set(new, l::NODE_LEFT, new_left);
        self.copy_within(
            (id, l::entry(first)),
            (new, l::NODE_ENTRIES),
            moved * l::ENTRY_SIZE,
        );
        self.set(id, l::NODE_HEADER, l::header(level, mid as u64, 0));
        self.set(id, l::NODE_HIGH, sep);
        self.set(id, l::NODE_SIBLING, new);
        match parent {
            None => {
                let root = new + 1;
                self.set(root, l::NODE_HEADER, l::header(level + 1, 1, l::FLAG_ROOT));
                self.set(root, l::NODE_HIGH, l::NO_KEY);
                self.set(root, l::NODE_SIBLING, l::NO_NODE);
                self.set(root, l::NODE_LEFT, id);
                self.set(root, l::entry(0), sep);
                self.set(root, l::entry(0) + 8, new);
                self.root = root;
                self.next += 2;
            }
            Some(p) => {
                let pc = self.count(p);
                let q = self.lower_bound(p, sep);
                self.copy_within(
                    (p, l::entry(q)),
                    (p, l::entry(q + 1)),
                    (pc - q) * l::ENTRY_SIZE,
                );
                self.set(p, l::entry(q), sep);
                self.set(p, l::entry(q) + 8, new);
                let ph = self.word(p, l::NODE_HEADER);
                self.set(
                    p,
                    l::NODE_HEADER,
                    l::header(l::level(ph), pc as u64 + 1, l::flags(ph)),
                );
                self.next += 1;
            }
        }
    }

    fn write(&mut self, key: u64, value: u64, update_only: bool) -> Option<Written> {
        let cap = l::capacity(self.size);
        'attempt: loop {
            assert!(self.next + 2 <= self.max, "native tree full");
            let (mut id, mut parent) = (self.root, None);
            loop {
                if self.count(id) >= cap {
                    self.split(id, parent);
                    continue 'attempt;
                }
                if l::level(self.word(id, l::NODE_HEADER)) > 0 {
                    parent = Some(id);
                    id = self.child_for(id, key);
                    continue;
                }
                let n = self.count(id);
                let p = self.lower_bound(id, key);
                if p < n && self.key(id, p) == key {
                    self.set(id, l::entry(p) + 8, value);
                    return Some(Written::Replaced);
                }
                if update_only {
                    return None;
                }
                self.copy_within(
                    (id, l::entry(p)),
                    (id, l::entry(p + 1)),
                    (n - p) * l::ENTRY_SIZE,
                );
                self.set(id, l::entry(p), key);
                self.set(id, l::entry(p) + 8, value);
                let h = self.word(id, l::NODE_HEADER);
                self.set(id, l::NODE_HEADER, l::header(0, n as u64 + 1, l::flags(h)));
                return Some(Written::Inserted);
            }
        }
    }

    /// Inserts or replaces.
    pub fn insert(&mut self, key: u64, value: u64) -> Written {
        self.write(key, value, false).expect("upserts always write")
    }

    /// Replaces an existing key's value; false if absent.
    pub fn update(&mut self, key: u64, value: u64) -> bool {
        self.write(key, value, true).is_some()
    }

    /// Nodes in use.
    pub fn nodes_used(&self) -> u64 {
        self.next
    }

    /// Height (levels).
    pub fn height(&self) -> u64 {
        l::level(self.word(self.root, l::NODE_HEADER)) + 1
    }
}
