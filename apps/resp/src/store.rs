//! What the front asks of the store behind it: key-value operations in batches, each op
//! carrying the tenant it runs for and, when an earlier op of the same connection touches the
//! same key, the op it must follow. [`MemoryStore`] is the reference the tests compare the
//! NAAM store with.

use std::collections::HashMap;

use bytes::Bytes;

/// One key-value operation of a batch.
#[derive(Clone, Debug)]
pub struct Op<T> {
    /// The tenant it runs for.
    pub tenant: T,
    /// What it does.
    pub kind: OpKind,
    /// The key.
    pub key: Bytes,
    /// The value (puts and updates).
    pub value: Bytes,
    /// The index (in the batch) of an op that must finish before this one starts: an earlier
    /// command of the same connection on the same key.
    pub after: Option<u32>,
    /// What it came to; [`Outcome::Pending`] until the store has run it.
    pub outcome: Outcome,
}

/// An operation's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Read the value.
    Get,
    /// Insert or replace.
    Put,
    /// Replace only if present.
    Update,
    /// Remove.
    Delete,
    /// Add to the decimal integer the key holds (absent: 0), atomically.
    IncrBy(i64),
    /// Up to this many keys in order, from the op's key (a decimal integer) on: `SCAN` on a
    /// B-tree tenant.
    Scan(usize),
}

/// What an op came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not run yet.
    Pending,
    /// A get: the value, or `None`.
    Got(Option<Bytes>),
    /// A put, update or delete: whether the key existed before.
    Wrote(bool),
    /// An increment: the new value.
    Counted(i64),
    /// A scan: the keys and values found, in key order.
    Scanned(Vec<(Bytes, Bytes)>),
    /// Failed; the text is the RESP error's (without the leading `-`).
    Failed(String),
}

/// The largest key and value a tenant's table holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyLimits {
    /// Bytes.
    pub key_cap: usize,
    /// Bytes.
    pub value_cap: usize,
}

/// Why `AUTH` failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// Unknown user or wrong password (Redis's text: clients recognise it).
    #[error("WRONGPASS invalid username-password pair or user is disabled.")]
    WrongPass,
    /// The store could not set the session up for another reason.
    #[error("ERR {0}")]
    Unavailable(String),
}

/// A key-value store the front runs its batches on.
pub trait Store {
    /// Who a connection runs as.
    type Tenant: Copy + Eq + std::fmt::Debug;

    /// The tenant of a connection that has not authenticated, when connections need not.
    fn default_tenant(&self) -> Option<Self::Tenant>;

    /// The tenant `user` (the default user's when `None`) with `password`.
    fn authenticate(
        &mut self,
        user: Option<&[u8]>,
        password: &[u8],
    ) -> Result<Self::Tenant, AuthError>;

    /// The largest key and value `tenant`'s table holds.
    fn key_limits(&self, tenant: Self::Tenant) -> KeyLimits;

    /// Runs every op of `ops` and sets its outcome: those with an `after` once that op has
    /// finished, all others in any order or together.
    fn run(&mut self, ops: &mut [Op<Self::Tenant>]);

    /// Lines for `INFO` about the store as `tenant` may see it (`key:value`, CRLF-separated,
    /// no section header): nothing of other tenants.
    fn info(&self, tenant: Option<Self::Tenant>) -> String;
}

/// Parses a value as Redis's counters are: a decimal 64-bit integer with no spaces.
pub fn parse_counter(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v)
        .ok()
        .filter(|t| !t.is_empty() && !t.starts_with('+') && t.len() <= 20)
        .and_then(|t| t.parse().ok())
}

/// The error text of an increment over a value that is not an integer, or that overflows.
pub const NOT_AN_INTEGER: &str = "ERR value is not an integer or out of range";

/// A store in a hash map, one per tenant: the reference model.
#[derive(Debug, Default)]
pub struct MemoryStore {
    /// Tenant names and passwords; empty: every connection is tenant 0 with no AUTH.
    pub users: Vec<(String, String)>,
    /// Each tenant's keys.
    pub data: HashMap<(usize, Bytes), Bytes>,
    /// Limits of every tenant's table.
    pub limits: Option<KeyLimits>,
}

impl Store for MemoryStore {
    type Tenant = usize;

    fn default_tenant(&self) -> Option<usize> {
        self.users.is_empty().then_some(0)
    }

    fn authenticate(&mut self, user: Option<&[u8]>, password: &[u8]) -> Result<usize, AuthError> {
        let user = user.unwrap_or(b"default");
        self.users
            .iter()
            .position(|(u, p)| u.as_bytes() == user && p.as_bytes() == password)
            .ok_or(AuthError::WrongPass)
    }

    fn key_limits(&self, _: usize) -> KeyLimits {
        self.limits.unwrap_or(KeyLimits {
            key_cap: 1 << 16,
            value_cap: 1 << 20,
        })
    }

    fn run(&mut self, ops: &mut [Op<usize>]) {
        // In order: every `after` points backwards, so order honours it.
        for op in ops.iter_mut() {
            let k = (op.tenant, op.key.clone());
            op.outcome = match op.kind {
                OpKind::Get => Outcome::Got(self.data.get(&k).cloned()),
                OpKind::Put => Outcome::Wrote(self.data.insert(k, op.value.clone()).is_some()),
                OpKind::Update => match self.data.get_mut(&k) {
                    Some(v) => {
                        *v = op.value.clone();
                        Outcome::Wrote(true)
                    }
                    None => Outcome::Wrote(false),
                },
                OpKind::Delete => Outcome::Wrote(self.data.remove(&k).is_some()),
                OpKind::Scan(count) => {
                    // As a B-tree scans: the keys that are decimal integers, in numeric order.
                    let number = |b: &[u8]| std::str::from_utf8(b).ok()?.parse::<u64>().ok();
                    let from = number(&op.key).unwrap_or(u64::MAX);
                    let mut keys: Vec<(u64, Bytes, Bytes)> = self
                        .data
                        .iter()
                        .filter(|((t, _), _)| *t == op.tenant)
                        .filter_map(|((_, k), v)| Some((number(k)?, k.clone(), v.clone())))
                        .filter(|(n, _, _)| *n >= from)
                        .collect();
                    keys.sort();
                    keys.truncate(count);
                    Outcome::Scanned(keys.into_iter().map(|(_, k, v)| (k, v)).collect())
                }
                OpKind::IncrBy(by) => {
                    let old = match self.data.get(&k) {
                        Some(v) => parse_counter(v),
                        None => Some(0),
                    };
                    match old.and_then(|o| o.checked_add(by)) {
                        Some(n) => {
                            self.data.insert(k, Bytes::from(n.to_string()));
                            Outcome::Counted(n)
                        }
                        None => Outcome::Failed(NOT_AN_INTEGER.into()),
                    }
                }
            };
        }
    }

    fn info(&self, tenant: Option<usize>) -> String {
        let keys = self.data.keys().filter(|(t, _)| Some(*t) == tenant).count();
        format!("store:memory\r\nkeys:{keys}\r\n")
    }
}
