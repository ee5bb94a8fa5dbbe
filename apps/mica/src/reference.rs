//! A native implementation of exactly the table the handlers maintain: same layout, same
//! candidate limits, same free-slot and eviction choices. Tests compare the NAAM table with it
//! operation by operation, evictions included; benchmarks use it as the native baseline.

use naam_mica_layout as l;

use crate::MicaConfig;

/// MICA in plain memory.
pub struct NativeMica {
    config: MicaConfig,
    tail: u64,
    index: Vec<u64>,
    log: Vec<u8>,
    item_size: usize,
}

const WORDS_PER_BUCKET: usize = l::BUCKET_SIZE / 8;

impl NativeMica {
    /// An empty table.
    pub fn new(config: MicaConfig) -> Self {
        NativeMica {
            config,
            tail: 0,
            index: vec![0; config.buckets as usize * WORDS_PER_BUCKET],
            log: vec![0; config.log_items as usize * config.item_size()],
            item_size: config.item_size(),
        }
    }

    fn bucket(&self, hash: u64) -> usize {
        l::bucket_of(hash, self.config.buckets) as usize * WORDS_PER_BUCKET
    }

    fn item(&self, n: u64) -> &[u8] {
        let at = (n % self.config.log_items) as usize * self.item_size;
        &self.log[at..at + self.item_size]
    }

    fn word(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }

    fn holds(&self, n: u64, hash: u64, key: &[u8]) -> bool {
        let it = self.item(n);
        let klen = u32::from_le_bytes(
            it[l::ITEM_KEY_LEN..l::ITEM_KEY_LEN + 4]
                .try_into()
                .expect("4 bytes"),
        ) as usize;
        Self::word(it, l::ITEM_FRONT) == n + 1
            && Self::word(it, l::item_back(self.item_size)) == n + 1
            && Self::word(it, l::ITEM_KEYHASH) == hash
            && klen == key.len()
            && &it[l::ITEM_KEY..l::ITEM_KEY + klen] == key
    }

    /// Slots (index, item) whose tag matches, in slot order; writers skip overwritten items.
    fn candidates(&self, hash: u64, live_only: bool, limit: usize) -> Vec<(usize, u64)> {
        let b = self.bucket(hash);
        let tag = l::tag(hash);
        (0..l::SLOTS)
            .filter_map(|i| {
                let w = self.index[b + 1 + i];
                (w != 0 && w >> 48 == tag).then(|| (i, (w & l::ITEM_MASK) - 1))
            })
            .filter(|&(_, n)| !live_only || n + self.config.log_items > self.tail)
            .take(limit)
            .collect()
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let hash = MicaConfig::keyhash(key);
        for (_, n) in self.candidates(hash, false, l::MAX_CANDIDATES) {
            if self.holds(n, hash, key) {
                let it = self.item(n);
                let vlen = u32::from_le_bytes(
                    it[l::ITEM_VALUE_LEN..l::ITEM_VALUE_LEN + 4]
                        .try_into()
                        .expect("4 bytes"),
                ) as usize;
                let v = l::item_value(self.config.key_cap);
                return Some(it[v..v + vlen].to_vec());
            }
        }
        None
    }

    fn find(&self, hash: u64, key: &[u8]) -> Option<usize> {
        self.candidates(hash, true, l::MAX_WRITE_CANDIDATES)
            .into_iter()
            .find(|&(_, n)| self.holds(n, hash, key))
            .map(|(i, _)| i)
    }

    fn write(&mut self, key: &[u8], value: &[u8], update_only: bool) -> bool {
        let hash = MicaConfig::keyhash(key);
        let found = self.find(hash, key);
        if update_only && found.is_none() {
            return false;
        }
        let b = self.bucket(hash);
        let slot = found.unwrap_or_else(|| {
            let mut free = None;
            let (mut oldest, mut oldest_item) = (0, u64::MAX);
            for i in 0..l::SLOTS {
                let w = self.index[b + 1 + i];
                let n = (w & l::ITEM_MASK).wrapping_sub(1);
                if free.is_none() && (w == 0 || n.wrapping_add(self.config.log_items) <= self.tail)
                {
                    free = Some(i);
                }
                if w != 0 && n < oldest_item {
                    oldest_item = n;
                    oldest = i;
                }
            }
            free.unwrap_or(oldest)
        });
        let t = self.tail;
        let at = (t % self.config.log_items) as usize * self.item_size;
        let it = &mut self.log[at..at + self.item_size];
        let back = l::item_back(self.item_size);
        it[back..back + 8].copy_from_slice(&(t + 1).to_le_bytes());
        it[l::ITEM_KEYHASH..l::ITEM_KEYHASH + 8].copy_from_slice(&hash.to_le_bytes());
        it[l::ITEM_KEY_LEN..l::ITEM_KEY_LEN + 4].copy_from_slice(&(key.len() as u32).to_le_bytes());
        it[l::ITEM_VALUE_LEN..l::ITEM_VALUE_LEN + 4]
            .copy_from_slice(&(value.len() as u32).to_le_bytes());
        it[l::ITEM_KEY..l::ITEM_KEY + key.len()].copy_from_slice(key);
        let v = l::item_value(self.config.key_cap);
        it[v..v + value.len()].copy_from_slice(value);
        it[l::ITEM_FRONT..l::ITEM_FRONT + 8].copy_from_slice(&(t + 1).to_le_bytes());
        self.index[b + 1 + slot] = l::slot(l::tag(hash), t);
        self.index[b] += 2;
        self.tail = t + 1;
        found.is_some()
    }

    /// Inserts or replaces; returns whether the key existed.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> bool {
        self.write(key, value, false)
    }

    /// Replaces an existing key's value; false if absent.
    pub fn update(&mut self, key: &[u8], value: &[u8]) -> bool {
        self.write(key, value, true)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&mut self, key: &[u8]) -> bool {
        let hash = MicaConfig::keyhash(key);
        match self.find(hash, key) {
            Some(slot) => {
                let b = self.bucket(hash);
                self.index[b + 1 + slot] = 0;
                self.index[b] += 2;
                true
            }
            None => false,
        }
    }

    /// Items written so far (the log tail).
    pub fn tail(&self) -> u64 {
        self.tail
    }
}
