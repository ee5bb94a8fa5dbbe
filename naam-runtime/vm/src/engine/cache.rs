//! The code cache: compiled handlers keyed by what their code depends on, shared in memory by
//! every executable of the same program (many apps' instances of one handler), and kept
//! across restarts in a [`CodeStore`] when the process gives one.
//!
//! A key ([`CodeKey`]) is the SHA-256 of the verified program (instructions, function
//! starts, read-only data layout), the engine's code-generation version
//! ([`CODEGEN_VERSION`]), the target and its settings (the code generator's ISA flags, so
//! code for another CPU's features never matches) and the executable's entry convention and
//! helper set. A stored entry is the code sealed with HMAC-SHA-256 under the cache's secret
//! ([`seal_entry`], [`open_entry`]): an entry that is truncated, corrupted, written for
//! another key or by another secret is refused, counted in [`CacheStats::rejected`] and
//! recompiled, never run. Which bytes to trust is decided here, without IO; a store only
//! moves them (naam-runtime's directory store is one).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use ring::{digest, hmac};

use crate::jit::{self, Compiled, HostCode, JitError, Target};
use crate::loader::Program;

use super::{ExecOptions, Prepared};

/// The version of the code the JIT generates for a program: part of every key, raised with
/// any change to translation, the ISA settings or the machine state's layout, so that code an
/// older build stored is never taken for this one's.
pub const CODEGEN_VERSION: u32 = 1;

/// What a stored entry starts with.
const ENTRY_MAGIC: &[u8; 8] = b"NAAMJIT\x01";
/// Magic, key, entry offset, function count, code length.
const ENTRY_HEADER: usize = 8 + 32 + 8 + 8 + 8;
/// HMAC-SHA-256 tag.
const ENTRY_TAG: usize = 32;
/// The most code one entry may hold (a handler of the verifier's largest size compiles to
/// far less).
pub const MAX_ENTRY_CODE: usize = 16 << 20;

/// Identifies compiled code: the SHA-256 of everything the code depends on.
pub type CodeKey = [u8; 32];

/// Where compiled code is kept across restarts (a directory, in naam-runtime). It moves
/// bytes only: the cache seals what it stores and checks what it loads.
pub trait CodeStore: Send + Sync + fmt::Debug {
    /// The entry stored under `key`, if any (a read that fails is `None`).
    fn load(&self, key: &CodeKey) -> Option<Vec<u8>>;
    /// Stores `entry` under `key`, replacing what was there (a write that fails is dropped:
    /// the next start compiles again).
    fn store(&self, key: &CodeKey, entry: &[u8]);
}

/// What the cache did since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Code found in memory (another executable of the same program holds it).
    pub memory_hits: u64,
    /// Code loaded from the store, its seal checked.
    pub store_hits: u64,
    /// Programs compiled.
    pub compiled: u64,
    /// Stored entries refused (corrupted, truncated, another key's or another secret's) and
    /// compiled again.
    pub rejected: u64,
}

/// Compiled code shared by executables, and optionally kept in a [`CodeStore`].
pub struct CodeCache {
    memory: Mutex<HashMap<CodeKey, Weak<HostCode>>>,
    /// A lock per key being loaded or compiled: a second build of the same program waits for
    /// the first and takes its code (two apps deploying one handler compile it once).
    inflight: Mutex<HashMap<CodeKey, Arc<Mutex<()>>>>,
    /// Verified programs and their analyses, by [`prepared_key`], while an executable holds
    /// them.
    prepared: Mutex<HashMap<CodeKey, Weak<Prepared>>>,
    store: Option<(Arc<dyn CodeStore>, hmac::Key)>,
    memory_hits: AtomicU64,
    store_hits: AtomicU64,
    compiled: AtomicU64,
    rejected: AtomicU64,
}

impl fmt::Debug for CodeCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CodeCache")
            .field("store", &self.store.as_ref().map(|(s, _)| s))
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for CodeCache {
    fn default() -> Self {
        CodeCache::in_memory()
    }
}

impl CodeCache {
    /// A cache in memory only.
    pub fn in_memory() -> CodeCache {
        CodeCache {
            memory: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
            store: None,
            memory_hits: AtomicU64::new(0),
            store_hits: AtomicU64::new(0),
            compiled: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// A cache that also keeps code in `store`, sealed under `secret` (the store's own,
    /// kept beside it by whoever made it: entries sealed under another secret are refused).
    pub fn with_store(store: Arc<dyn CodeStore>, secret: &[u8; 32]) -> CodeCache {
        CodeCache {
            store: Some((store, hmac::Key::new(hmac::HMAC_SHA256, secret))),
            ..CodeCache::in_memory()
        }
    }

    /// The process's cache (memory only), which executables use unless their options name
    /// another.
    pub fn process() -> Arc<CodeCache> {
        static PROCESS: OnceLock<Arc<CodeCache>> = OnceLock::new();
        PROCESS
            .get_or_init(|| Arc::new(CodeCache::in_memory()))
            .clone()
    }

    /// What it did so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            memory_hits: self.memory_hits.load(Ordering::Relaxed),
            store_hits: self.store_hits.load(Ordering::Relaxed),
            compiled: self.compiled.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }

    /// The live [`Prepared`] under `key` if an executable holds one (then `fresh`, which the
    /// caller verified and analysed itself, is dropped), else `fresh`, now shared.
    pub(super) fn share_prepared(&self, key: CodeKey, fresh: Prepared) -> Arc<Prepared> {
        let mut m = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = m.get(&key).and_then(Weak::upgrade) {
            return p;
        }
        let p = Arc::new(fresh);
        insert_live(&mut m, key, &p);
        p
    }

    /// The live [`Prepared`] under `key`, if an executable holds one.
    pub(super) fn live_prepared(&self, key: &CodeKey) -> Option<Arc<Prepared>> {
        let m = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        m.get(key).and_then(Weak::upgrade)
    }

    /// Code held in memory under `key` (another executable of the same program has it).
    pub(super) fn in_memory_code(&self, key: &CodeKey) -> Option<Arc<HostCode>> {
        let code = self.memory.lock().ok()?.get(key).and_then(Weak::upgrade)?;
        self.memory_hits.fetch_add(1, Ordering::Relaxed);
        Some(code)
    }

    /// The host code of `prepared` under `key`: from memory, else from the store (its seal
    /// checked), else compiled (and stored).
    pub(super) fn host_code(
        &self,
        key: &CodeKey,
        prepared: &Prepared,
    ) -> Result<Arc<HostCode>, JitError> {
        if let Some(code) = self.in_memory_code(key) {
            return Ok(code);
        }
        let turn = self
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(*key)
            .or_default()
            .clone();
        let result = {
            let _mine = turn.lock().unwrap_or_else(|e| e.into_inner());
            match self.in_memory_code(key) {
                Some(code) => Ok(code),
                None => self.load_or_compile(key, prepared),
            }
        };
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        // The last one out removes the key's lock (the map holds one reference, `turn` one).
        if inflight.get(key).is_some_and(|t| Arc::strong_count(t) <= 2) {
            inflight.remove(key);
        }
        result
    }

    fn load_or_compile(&self, key: &CodeKey, p: &Prepared) -> Result<Arc<HostCode>, JitError> {
        let loaded = self.store.as_ref().and_then(|(store, secret)| {
            let entry = store.load(key)?;
            match open_entry(secret, key, &entry) {
                Some(compiled) => Some(compiled),
                None => {
                    self.rejected.fetch_add(1, Ordering::Relaxed);
                    None
                }
            }
        });
        let code = match loaded {
            Some(compiled) => {
                self.store_hits.fetch_add(1, Ordering::Relaxed);
                Arc::new(HostCode::new(&compiled)?)
            }
            None => {
                let compiled = jit::compile(&p.checked, &p.program, &p.facts, Target::Host)?;
                self.compiled.fetch_add(1, Ordering::Relaxed);
                if let Some((store, secret)) = &self.store {
                    store.store(key, &seal_entry(secret, key, &compiled));
                }
                Arc::new(HostCode::new(&compiled)?)
            }
        };
        if let Ok(mut m) = self.memory.lock() {
            insert_live(&mut m, *key, &code);
        }
        Ok(code)
    }
}

/// Inserts a weak reference to `value` under `key`, first dropping the entries whose value
/// died when the map would grow: one sweep per doubling, not per insert (thousands of
/// distinct handlers would otherwise make every build walk the whole map).
fn insert_live<T>(m: &mut HashMap<CodeKey, Weak<T>>, key: CodeKey, value: &Arc<T>) {
    if m.len() == m.capacity() {
        m.retain(|_, w| w.strong_count() > 0);
    }
    m.insert(key, Arc::downgrade(value));
}

/// The key of `program`'s host code built with `options`: see the module documentation.
pub fn code_key(program: &Program, options: &ExecOptions) -> Result<CodeKey, JitError> {
    let mut h = digest::Context::new(&digest::SHA256);
    h.update(b"naam-vm code\0");
    h.update(&CODEGEN_VERSION.to_le_bytes());
    h.update(jit::target_fingerprint(Target::Host)?.as_bytes());
    h.update(&[0, options.entry as u8, options.helpers as u8]);
    h.update(&(program.code.len() as u64).to_le_bytes());
    h.update(&program.code);
    h.update(&(program.functions.len() as u64).to_le_bytes());
    for f in &program.functions {
        h.update(&(*f as u64).to_le_bytes());
    }
    h.update(&(program.rodata.len() as u64).to_le_bytes());
    for r in &program.rodata {
        h.update(&(r.len() as u64).to_le_bytes());
    }
    h.update(&(program.rodata_refs.len() as u64).to_le_bytes());
    for r in &program.rodata_refs {
        for x in [r.pc as u64, r.index as u64, r.offset] {
            h.update(&x.to_le_bytes());
        }
    }
    let mut key = [0u8; 32];
    key.copy_from_slice(h.finish().as_ref());
    Ok(key)
}

/// The key under which executables share a verified program and its analysis: its code key
/// (`code`), and what the code does not depend on but the program and the verifier's verdict
/// do: the name, the read-only data's bytes and the verifier's settings.
pub(super) fn prepared_key(
    code: &CodeKey,
    program: &Program,
    options: &ExecOptions,
    analysed: bool,
) -> CodeKey {
    let mut h = digest::Context::new(&digest::SHA256);
    // A tiered handler's first preparation carries no analysis: it is never shared with
    // (nor compiled for) an executable that needs one.
    h.update(if analysed {
        b"naam-vm prepared\0"
    } else {
        b"naam-vm unanalysed\0"
    });
    h.update(code);
    h.update(&(program.name.len() as u64).to_le_bytes());
    h.update(program.name.as_bytes());
    for r in &program.rodata {
        h.update(&(r.len() as u64).to_le_bytes());
        h.update(r.bytes());
    }
    h.update(format!("{:?}", options.verifier).as_bytes());
    let mut key = [0u8; 32];
    key.copy_from_slice(h.finish().as_ref());
    key
}

/// `compiled` as a stored entry under `key`, sealed with `secret`.
pub fn seal_entry(secret: &hmac::Key, key: &CodeKey, compiled: &Compiled) -> Vec<u8> {
    let mut e = Vec::with_capacity(ENTRY_HEADER + compiled.code.len() + ENTRY_TAG);
    e.extend_from_slice(ENTRY_MAGIC);
    e.extend_from_slice(key);
    e.extend_from_slice(&(compiled.entry as u64).to_le_bytes());
    e.extend_from_slice(&(compiled.functions as u64).to_le_bytes());
    e.extend_from_slice(&(compiled.code.len() as u64).to_le_bytes());
    e.extend_from_slice(&compiled.code);
    let tag = hmac::sign(secret, &e);
    e.extend_from_slice(tag.as_ref());
    e
}

/// The code of a stored entry, if it is whole, is `key`'s and carries `secret`'s seal.
pub fn open_entry(secret: &hmac::Key, key: &CodeKey, entry: &[u8]) -> Option<Compiled> {
    if entry.len() < ENTRY_HEADER + ENTRY_TAG {
        return None;
    }
    let (body, tag) = entry.split_at(entry.len() - ENTRY_TAG);
    hmac::verify(secret, body, tag).ok()?;
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&body[at..at + 8]);
        u64::from_le_bytes(b)
    };
    if &body[..8] != ENTRY_MAGIC || &body[8..40] != key {
        return None;
    }
    let (entry_at, functions, len) = (u64_at(40), u64_at(48), u64_at(56));
    let code = &body[ENTRY_HEADER..];
    if len as usize != code.len() || code.len() > MAX_ENTRY_CODE || entry_at >= len {
        return None;
    }
    Some(Compiled {
        code: code.to_vec(),
        entry: entry_at as usize,
        functions: functions as usize,
        compile_time: std::time::Duration::ZERO,
        target: Target::Host,
    })
}
