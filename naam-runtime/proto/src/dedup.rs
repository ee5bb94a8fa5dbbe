//! Deduplication of retransmitted mutations: the answers to the most recent requests, by
//! (origin session, request id), in bounded memory. A retransmission of a write or of a
//! mutating one-sided operation gets the first answer instead of being applied twice; one
//! session's ids never match another's because the session is part of the key.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// The table's hasher: foldhash, seeded per process. Every write looks its key up and
/// inserts it; with std's SipHash that was 9% of a RESP front's time under redis-benchmark
/// SETs (bench/RESULTS.md). The seed keeps a client that picks its request ids from making
/// them collide.
type Hasher = foldhash::fast::RandomState;

/// How many answers a server or NIC keeps per table by default: a retransmission arrives
/// within a few round trips, long before 65,536 newer mutations have.
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// The answers to the last `capacity` distinct keys; the oldest key is forgotten first.
/// Replacing a key's answer (a pending write that completed) keeps its age.
#[derive(Clone, Debug)]
pub struct RecentAnswers<K, V> {
    answers: HashMap<K, V, Hasher>,
    order: VecDeque<K>,
    capacity: usize,
}

impl<K: Eq + Hash + Copy, V> Default for RecentAnswers<K, V> {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

impl<K: Eq + Hash + Copy, V> RecentAnswers<K, V> {
    /// An empty table keeping at most `capacity` answers (at least one).
    pub fn new(capacity: usize) -> Self {
        RecentAnswers {
            answers: HashMap::with_hasher(Hasher::default()),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// The answer recorded for `key`, if it is still remembered.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.answers.get(key)
    }

    /// Records `answer` for `key`, forgetting the oldest key when over capacity.
    pub fn insert(&mut self, key: K, answer: V) {
        if self.answers.insert(key, answer).is_none() {
            self.order.push_back(key);
            if self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.answers.remove(&old);
                }
            }
        }
    }

    /// Forgets everything (a new server epoch: old ids mean nothing any more).
    pub fn clear(&mut self) {
        self.answers.clear();
        self.order.clear();
    }

    /// Answers remembered, never more than the capacity it was made with.
    pub fn len(&self) -> usize {
        self.answers.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_replaced_answer_keeps_its_age() {
        let mut t = RecentAnswers::new(2);
        t.insert((1, 1), "pending");
        t.insert((1, 2), "other");
        t.insert((1, 1), "done");
        assert_eq!(t.get(&(1, 1)), Some(&"done"));
        t.insert((1, 3), "newest");
        assert_eq!(t.get(&(1, 1)), None, "the oldest key went first");
        assert_eq!(t.len(), 2);
        t.clear();
        assert!(t.is_empty());
    }

    proptest! {
        /// Against a naive model (a list in age order): the same answers, bounded memory.
        #[test]
        fn matches_a_naive_model(
            capacity in 1usize..16,
            keys in proptest::collection::vec((0u64..4, 0u64..32), 0..200),
        ) {
            let mut t = RecentAnswers::new(capacity);
            let mut model: Vec<((u64, u64), usize)> = Vec::new();
            for (i, k) in keys.iter().enumerate() {
                t.insert(*k, i);
                match model.iter_mut().find(|(mk, _)| mk == k) {
                    Some(entry) => entry.1 = i,
                    None => {
                        model.push((*k, i));
                        if model.len() > capacity {
                            model.remove(0);
                        }
                    }
                }
                prop_assert!(t.len() <= capacity);
                prop_assert_eq!(t.len(), model.len());
                for (mk, v) in &model {
                    prop_assert_eq!(t.get(mk), Some(v));
                }
                prop_assert_eq!(t.get(k), Some(&i));
            }
        }
    }
}
