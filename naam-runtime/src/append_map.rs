//! A map that only grows, read without a lock while it grows: the per-app state and the
//! regions of a cluster, to which a deploy adds apps at run time while every thread looks
//! them up on each message.
//!
//! Open addressing over a table sized once (at least twice the entries it may hold, so a
//! probe ends soon); an entry, once in, stays at its slot for the map's life, so a reader
//! holds a plain reference to it. Inserts are serialized by a lock; a reader loads each slot
//! it probes once, with acquire ordering (`OnceLock::get`), and stops at the first empty
//! one. A reader racing an insert finds the entry or not, as if it had looked just before.
//! Keys are integers the server chose (app ids, random rkeys), spread by a multiply.

use std::sync::{Mutex, OnceLock};

/// An integer key of an [`AppendMap`].
pub(crate) trait AppendKey: Copy + Eq {
    /// The key as 64 bits, for hashing.
    fn bits(self) -> u64;
}

impl AppendKey for u32 {
    fn bits(self) -> u64 {
        self as u64
    }
}

impl AppendKey for u64 {
    fn bits(self) -> u64 {
        self
    }
}

/// Why an insert failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum AppendError {
    /// The key is in the map already (its entry is unchanged).
    #[error("the key is taken")]
    Taken,
    /// The map holds as many entries as it was made for.
    #[error("the map is full ({capacity} entries)")]
    Full {
        /// Entries it was made for.
        capacity: usize,
    },
}

/// A map from integer keys to values that entries are added to and never taken from (see
/// the module's doc).
pub(crate) struct AppendMap<K, V> {
    slots: Box<[OnceLock<(K, V)>]>,
    /// `slots.len() - 1` (a power of two less one).
    mask: usize,
    /// Entries it may hold.
    capacity: usize,
    /// Entries it holds; written under the lock only.
    len: Mutex<usize>,
}

impl<K: AppendKey, V> AppendMap<K, V> {
    /// A map for up to `capacity` entries (its table has at least twice as many slots).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let slots = capacity.saturating_mul(2).max(8).next_power_of_two();
        AppendMap {
            slots: (0..slots).map(|_| OnceLock::new()).collect(),
            mask: slots - 1,
            capacity,
            len: Mutex::new(0),
        }
    }

    /// The slot a probe for `key` starts at.
    #[inline]
    fn home(&self, key: K) -> usize {
        // Fibonacci hashing: the product's high bits mix every bit of the key.
        (key.bits().wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & self.mask
    }

    /// The value of `key`.
    #[inline]
    pub(crate) fn get(&self, key: K) -> Option<&V> {
        let mut i = self.home(key);
        loop {
            match self.slots[i].get() {
                None => return None,
                Some((k, v)) if *k == key => return Some(v),
                Some(_) => i = (i + 1) & self.mask,
            }
        }
    }

    /// Whether `key` has a value.
    pub(crate) fn contains_key(&self, key: K) -> bool {
        self.get(key).is_some()
    }

    /// Adds `key` with `value`; visible to every reader once this returns. When the key is
    /// taken or the map is full, `value` comes back with the reason.
    pub(crate) fn insert(&self, key: K, value: V) -> Result<&V, (AppendError, V)> {
        let mut len = self.len.lock().unwrap_or_else(|e| e.into_inner());
        if self.contains_key(key) {
            return Err((AppendError::Taken, value));
        }
        if *len >= self.capacity {
            let capacity = self.capacity;
            return Err((AppendError::Full { capacity }, value));
        }
        let mut i = self.home(key);
        // Fewer entries than half the slots: an empty one comes soon. Inserts are serialized,
        // so the first empty slot of the probe is still empty here.
        while self.slots[i].get().is_some() {
            i = (i + 1) & self.mask;
        }
        let _ = self.slots[i].set((key, value));
        *len += 1;
        match self.slots[i].get() {
            Some((_, v)) => Ok(v),
            None => unreachable!("a slot set under the lock is set"),
        }
    }

    /// Entries it holds.
    pub(crate) fn len(&self) -> usize {
        *self.len.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether it holds none.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries it may hold.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Every entry, in slot order (not the order of inserts); an entry inserted during the
    /// walk may or may not be seen.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (K, &V)> {
        self.slots
            .iter()
            .filter_map(|s| s.get().map(|(k, v)| (*k, v)))
    }

    /// Every value, as [`AppendMap::iter`].
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }
}

impl<K: AppendKey + std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for AppendMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: AppendKey, V> Default for AppendMap<K, V> {
    /// An empty map for 8 entries.
    fn default() -> Self {
        AppendMap::with_capacity(8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_full_map_and_a_taken_key_refuse_and_keep_what_they_hold() {
        let m = AppendMap::<u32, &str>::with_capacity(2);
        assert_eq!(m.insert(7, "a"), Ok(&"a"));
        assert_eq!(m.insert(7, "b"), Err((AppendError::Taken, "b")));
        assert_eq!(m.insert(9, "c"), Ok(&"c"));
        assert_eq!(
            m.insert(11, "d"),
            Err((AppendError::Full { capacity: 2 }, "d"))
        );
        assert_eq!(
            (m.get(7), m.get(9), m.get(11)),
            (Some(&"a"), Some(&"c"), None)
        );
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn readers_see_every_entry_once_it_is_in_while_the_map_grows() {
        let m = Arc::new(AppendMap::<u64, u64>::with_capacity(20_000));
        let done = Arc::new(AtomicBool::new(false));
        let reading = Arc::new(AtomicBool::new(false));
        let reader = {
            let (m, done, reading) = (m.clone(), done.clone(), reading.clone());
            std::thread::spawn(move || {
                reading.store(true, Ordering::Release);
                let mut passes = 0u64;
                loop {
                    let last = done.load(Ordering::Acquire);
                    // Keys go in ascending: once a key is in, every smaller one is.
                    let n = m.len() as u64;
                    for k in (0..n).step_by(97) {
                        assert_eq!(m.get(k << 20), Some(&(k * 3)), "key {k} of {n}");
                    }
                    passes += 1;
                    if last {
                        return passes;
                    }
                }
            })
        };
        // The inserts start once the reader reads, so that the two overlap.
        while !reading.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        for k in 0..20_000u64 {
            assert!(m.insert(k << 20, k * 3).is_ok());
        }
        done.store(true, Ordering::Release);
        assert!(reader.join().unwrap() >= 1);
        assert_eq!(m.iter().count(), 20_000);
    }

    proptest! {
        /// The same answers as a HashMap fed the same inserts, for keys alike in their low
        /// bits or in their high bits as well as random ones.
        #[test]
        fn agrees_with_a_hash_map(
            keys in prop::collection::vec(prop_oneof![
                any::<u64>(),
                (0u64..64).prop_map(|k| k << 40),
                0u64..64,
            ], 0..200),
            capacity in 1usize..150,
        ) {
            let m = AppendMap::<u64, usize>::with_capacity(capacity);
            let mut model = HashMap::new();
            for (i, &k) in keys.iter().enumerate() {
                let expect = if model.contains_key(&k) {
                    Err(AppendError::Taken)
                } else if model.len() >= capacity {
                    Err(AppendError::Full { capacity })
                } else {
                    model.insert(k, i);
                    Ok(i)
                };
                prop_assert_eq!(m.insert(k, i).copied().map_err(|(e, _)| e), expect);
            }
            for &k in &keys {
                prop_assert_eq!(m.get(k), model.get(&k));
            }
            prop_assert_eq!(m.len(), model.len());
            let mut seen: Vec<(u64, usize)> = m.iter().map(|(k, v)| (k, *v)).collect();
            let mut want: Vec<(u64, usize)> = model.into_iter().collect();
            seen.sort();
            want.sort();
            prop_assert_eq!(seen, want);
        }
    }
}
