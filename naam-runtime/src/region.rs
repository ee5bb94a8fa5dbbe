//! Registered memory: regions with random 64-bit rkeys and access rights, and the resolution of
//! descriptors against them.
//!
//! Region memory is shared memory in the RDMA sense: executors, the one-sided agent and the
//! write owner access it concurrently through raw pointers, and readers protect themselves with
//! versions (seqlock style, DESIGN.md section 6). 64-bit atomics (CAS, FAA, version words) go
//! through `AtomicU64` and need 8-byte alignment.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::append_map::{AppendError, AppendMap};
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_MASK, ACCESS_READ, ACCESS_WRITE};

/// 8-byte aligned, fixed-size memory shared by every placement of one server: heap memory in
/// one process (an anonymous mapping on huge pages when large), or a shared file mapping
/// (`/dev/shm`) that a separate NIC process maps too.
pub struct RegionMemory {
    storage: Storage,
    len: usize,
}

enum Storage {
    Heap(Box<[AtomicU64]>),
    /// A private anonymous mapping of `words` words, advised to the kernel for transparent
    /// huge pages; unmapped on drop.
    Anonymous {
        ptr: *mut AtomicU64,
        words: usize,
    },
    /// A `MAP_SHARED` mapping of `words` words; unmapped on drop.
    Mapped {
        ptr: *mut AtomicU64,
        words: usize,
    },
    /// The `words` words of another region's memory, which `_region` keeps alive
    /// ([`RegionMemory::view_of`]).
    View {
        ptr: *const AtomicU64,
        words: usize,
        _region: Arc<Region>,
    },
}

// The mapping is plain memory accessed only through atomics, like the heap variant.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::Mapped { ptr, words } | Storage::Anonymous { ptr, words } = *self {
            if words > 0 {
                // SAFETY: `ptr` came from mmap with this length (rounded up to whole pages,
                // as munmap rounds it) and is unmapped once.
                unsafe { libc::munmap(ptr.cast(), words * 8) };
            }
        }
    }
}

/// Why shared region memory could not be created or mapped.
#[derive(Debug, thiserror::Error)]
#[error("shared region memory {path}: {source}")]
#[non_exhaustive]
pub struct ShmError {
    /// The shared file being created or mapped (normally under `/dev/shm`).
    pub path: std::path::PathBuf,
    /// What failed.
    #[source]
    pub source: std::io::Error,
}

impl std::fmt::Debug for RegionMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegionMemory({} bytes)", self.len)
    }
}

use naam_proto::step::{MemError, ResolveError};

/// Size of an x86-64 (and default aarch64) huge page: regions this large are mapped apart.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// A zero-filled private mapping of `bytes` starting on a huge-page boundary (the kernel backs
/// only aligned 2 MiB ranges with huge pages), advised for huge pages; `None` when the kernel
/// refuses the mapping. The advice is only a hint: without huge pages it is plain memory.
fn map_anonymous(bytes: usize) -> Option<*mut AtomicU64> {
    // SAFETY: sysconf reads a constant of the system.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())?;
    let bytes = bytes.checked_next_multiple_of(page)?;
    let reserved = bytes.checked_add(HUGE_PAGE)?;
    // SAFETY: a fresh anonymous private mapping; the kernel picks the address.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserved,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let head = start - ptr as usize;
    // SAFETY: the slack before `start` and after `start + bytes` lies inside the mapping
    // just made (page-aligned: `ptr` and `bytes` are), and nothing refers to it.
    unsafe {
        if head > 0 {
            libc::munmap(ptr, head);
        }
        let tail = reserved - head - bytes;
        if tail > 0 {
            libc::munmap((start + bytes) as *mut libc::c_void, tail);
        }
        // Advice on our own mapping; failure (no THP support) changes nothing.
        libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
    }
    Some(start as *mut AtomicU64)
}

impl RegionMemory {
    /// `len` zero bytes.
    ///
    /// A region of [`HUGE_PAGE`] or more is its own anonymous mapping, advised for transparent
    /// huge pages (`MADV_HUGEPAGE`), as MICA and RDMA deployments register huge-page memory: a
    /// handler's accesses are scattered over the region, and a direct MICA GET measured a
    /// fifth to a third faster, and steadier, on huge pages (bench/RESULTS.md, ninth session; kernels
    /// in `madvise` mode give them only where advised). Smaller regions, or a kernel that
    /// refuses the mapping, use the heap.
    pub fn zeroed(len: usize) -> RegionMemory {
        let words = len.div_ceil(8);
        if len >= HUGE_PAGE {
            if let Some(ptr) = len.checked_next_multiple_of(8).and_then(map_anonymous) {
                return RegionMemory {
                    storage: Storage::Anonymous { ptr, words },
                    len,
                };
            }
        }
        RegionMemory {
            storage: Storage::Heap((0..words).map(|_| AtomicU64::new(0)).collect()),
            len,
        }
    }

    /// Creates the file `path` (normally under `/dev/shm`) anew, filled with `contents`, and
    /// maps it shared: another process that [`map_shared`]s the same file sees every write, as
    /// a NIC sees host memory through DMA. The file is built under a temporary name and
    /// renamed into place, never truncated: a NIC still mapping the previous file (the server
    /// restarted) keeps valid memory until it maps the new one, instead of a SIGBUS.
    ///
    /// [`map_shared`]: RegionMemory::map_shared
    pub fn create_shared(
        path: &std::path::Path,
        contents: &[u8],
    ) -> Result<RegionMemory, ShmError> {
        let err = |source| ShmError {
            path: path.to_path_buf(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(err)?;
        let made = (|| {
            file.set_len(contents.len().div_ceil(8) as u64 * 8)?;
            let m = Self::map_file(&file, contents.len())?;
            m.write(0, contents).expect("fits by construction");
            std::fs::rename(&tmp, path)?;
            Ok(m)
        })();
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        made.map_err(err)
    }

    /// Maps the existing shared file `path` of `len` bytes (made by [`create_shared`]).
    ///
    /// [`create_shared`]: RegionMemory::create_shared
    pub fn map_shared(path: &std::path::Path, len: usize) -> Result<RegionMemory, ShmError> {
        let err = |source| ShmError {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(err)?;
        let have = file.metadata().map_err(err)?.len();
        if have < len.div_ceil(8) as u64 * 8 {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the file has {have} bytes, the region needs {len}"),
            )));
        }
        Self::map_file(&file, len).map_err(err)
    }

    fn map_file(file: &std::fs::File, len: usize) -> std::io::Result<RegionMemory> {
        use std::os::fd::AsRawFd;
        let words = len.div_ceil(8);
        if words == 0 {
            return Ok(RegionMemory::zeroed(0));
        }
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                words * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(RegionMemory {
            storage: Storage::Mapped {
                ptr: ptr.cast(),
                words,
            },
            len,
        })
    }

    /// True when the memory is a shared file mapping.
    pub fn is_shared(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// Another handle on `region`'s memory, which it keeps alive: a second cluster in the
    /// same process (an in-process naam-nic) sees the host's memory as a NIC sees it through
    /// DMA, with no shared file between them, and on the host's own pages: huge ones where
    /// the host has them, where a file on `/dev/shm` gets huge pages only from a kernel that
    /// gives them to shared memory (`shmem_enabled`, `never` by default).
    pub fn view_of(region: &Arc<Region>) -> RegionMemory {
        let words = region.mem.words();
        RegionMemory {
            storage: Storage::View {
                ptr: words.as_ptr(),
                words: words.len(),
                _region: region.clone(),
            },
            len: region.mem.len,
        }
    }

    /// The memory as words, each only ever accessed atomically.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        match &self.storage {
            Storage::Heap(w) => w,
            // SAFETY: the mapping is page-aligned, `words` words long and lives as long as self.
            Storage::Mapped { ptr, words } | Storage::Anonymous { ptr, words } => unsafe {
                std::slice::from_raw_parts(*ptr, *words)
            },
            // SAFETY: the words of `_region`'s memory, which the view keeps alive.
            Storage::View { ptr, words, .. } => unsafe { std::slice::from_raw_parts(*ptr, *words) },
        }
    }

    /// Heap memory holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> RegionMemory {
        let m = RegionMemory::zeroed(bytes.len());
        m.write(0, bytes).expect("fits by construction");
        m
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.words().as_ptr() as u64
    }

    /// Checks `[offset, offset + len)` and returns its start address.
    pub fn range(&self, offset: u64, len: u64) -> Result<u64, MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(self.addr() + offset),
            _ => Err(MemError::OutOfRange {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies `dst.len()` bytes at `offset` into `dst` (a DMA or RDMA READ).
    ///
    /// The copy loads whole words in ascending address order with acquire ordering, so a reader
    /// that finds equal versions at both ends of an object saw no concurrent write (writers
    /// store the back version first and the front version last). `memcpy` promises no order.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemError> {
        self.range(offset, dst.len() as u64)?;
        let mut at = offset as usize;
        let mut out = 0;
        while out < dst.len() {
            let word = self.words()[at / 8].load(Ordering::Acquire).to_le_bytes();
            let from = at % 8;
            let n = (8 - from).min(dst.len() - out);
            dst[out..out + n].copy_from_slice(&word[from..from + n]);
            out += n;
            at += n;
        }
        Ok(())
    }

    /// Copies `src` to `offset` (a DMA or RDMA WRITE), word by word in ascending order; partial
    /// words at the edges are merged atomically.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), MemError> {
        self.range(offset, src.len() as u64)?;
        store_bytes(self.words(), offset as usize, src);
        Ok(())
    }

    fn word(&self, offset: u64) -> Result<&AtomicU64, MemError> {
        if !offset.is_multiple_of(8) {
            return Err(MemError::Misaligned(offset));
        }
        self.range(offset, 8)?;
        Ok(&self.words()[(offset / 8) as usize])
    }

    /// Atomic 64-bit load (acquire).
    pub fn load_u64(&self, offset: u64) -> Result<u64, MemError> {
        Ok(u64::from_le(self.word(offset)?.load(Ordering::Acquire)))
    }

    /// Atomic 64-bit compare-and-swap; returns the previous value.
    pub fn cas(&self, offset: u64, expected: u64, new: u64) -> Result<u64, MemError> {
        Ok(cas_word(self.word(offset)?, expected, new))
    }

    /// Atomic 64-bit fetch-and-add; returns the previous value.
    pub fn faa(&self, offset: u64, add: u64) -> Result<u64, MemError> {
        Ok(faa_word(self.word(offset)?, add))
    }

    /// A copy of the whole region (tests, snapshots).
    pub fn snapshot(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.read(0, &mut v).expect("whole region");
        v
    }
}

/// Compare-and-swap of the little-endian value in `w`; returns the value found.
pub(crate) fn cas_word(w: &AtomicU64, expected: u64, new: u64) -> u64 {
    u64::from_le(
        match w.compare_exchange(
            expected.to_le(),
            new.to_le(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(v) | Err(v) => v,
        },
    )
}

/// Fetch-and-add on `w`; returns the previous value.
pub(crate) fn faa_word(w: &AtomicU64, add: u64) -> u64 {
    // Little-endian host: the stored word is the value itself.
    w.fetch_add(add, Ordering::AcqRel)
}

/// Copies `src` to byte `at` of `words`, word by word in ascending order, each whole word one
/// release store; partial words at the edges are merged atomically. `at + src.len()` must lie
/// inside `words`.
pub(crate) fn store_bytes(words: &[AtomicU64], at: usize, src: &[u8]) {
    let mut at = at;
    let mut src = src;
    // A partial first word, merged into what it held.
    let from = at % 8;
    if from != 0 && !src.is_empty() {
        let n = (8 - from).min(src.len());
        merge_into(&words[at / 8], from, &src[..n]);
        src = &src[n..];
        at += n;
    }
    // Whole words: one release store each, indexed once for the run.
    let whole = src.len() / 8;
    let (body, tail) = src.split_at(whole * 8);
    let first = at / 8;
    store_whole_words(&words[first..first + whole], body);
    if !tail.is_empty() {
        merge_into(&words[first + whole], 0, tail);
    }
}

/// Stores `src`, whole little-endian words, into `words` (as many), in ascending order: one
/// release store per word.
#[inline]
pub(crate) fn store_whole_words(words: &[AtomicU64], src: &[u8]) {
    for (w, chunk) in words.iter().zip(src.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        w.store(u64::from_le_bytes(b), Ordering::Release);
    }
}

/// Stores `bytes` into `word` from byte `from` on (little-endian), keeping its other bytes:
/// one release read-modify-write, so a concurrent store to those bytes is not lost.
fn merge_into(word: &AtomicU64, from: usize, bytes: &[u8]) {
    let mut mask = [0u8; 8];
    let mut bits = [0u8; 8];
    mask[from..from + bytes.len()].fill(0xff);
    bits[from..from + bytes.len()].copy_from_slice(bytes);
    let (mask, bits) = (u64::from_le_bytes(mask), u64::from_le_bytes(bits));
    let _ = word.fetch_update(Ordering::Release, Ordering::Relaxed, |old| {
        Some((old & !mask) | bits)
    });
}

/// A registered region: memory that one app's descriptors and one-sided operations name by
/// rkey.
#[derive(Debug)]
pub struct Region {
    /// The capability naming it: never 0 and unique in its table (random unless given).
    pub rkey: u64,
    /// Owning app: only its descriptors resolve to this region.
    pub app: u32,
    /// Name from the app's spec (`mica-log`), by which clients look the rkey up.
    pub name: String,
    /// `ACCESS_*` rights it grants.
    pub access: u32,
    /// The memory: heap, or a shared file mapping that a NIC process maps too.
    pub mem: RegionMemory,
}

/// A descriptor checked against its region.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The region the descriptor's rkey names, kept alive for the access.
    pub region: Arc<Region>,
    /// Offset inside it.
    pub offset: u64,
    /// Length in bytes; `offset..offset + len` lies inside the region (checked on resolving).
    pub len: u32,
    /// Rights the descriptor asked for (granted).
    pub access: u32,
}

impl Resolved {
    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.region.mem.addr() + self.offset
    }
}

/// Every region of one server, by rkey. Regions are added while it serves (an app created
/// at run time, [`crate::cluster::Cluster::create_app`]) and never taken away: a reader
/// looks a key up without a lock ([`AppendMap`]), and a region stays as long as the table.
#[derive(Debug)]
pub struct RegionTable {
    by_key: AppendMap<u64, Arc<Region>>,
}

impl Default for RegionTable {
    /// A table for [`RegionTable::DEFAULT_CAPACITY`] regions.
    fn default() -> Self {
        RegionTable::with_capacity(RegionTable::DEFAULT_CAPACITY)
    }
}

/// Why a region could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The rkey asked for is 0 or another region's.
    #[error("rkey {0:#x} is 0 or already in use")]
    KeyInUse(u64),
    /// The table holds as many regions as it was made for.
    #[error("the region table is full ({capacity} regions)")]
    Full {
        /// Regions it was made for.
        capacity: usize,
    },
}

/// A random rkey, never 0 (the caller checks it is not in use).
fn random_rkey() -> u64 {
    loop {
        let mut b = [0u8; 8];
        // A failing OS RNG is not recoverable for a capability system.
        getrandom::fill(&mut b).expect("the OS random number generator failed");
        let k = u64::from_ne_bytes(b);
        if k != 0 {
            return k;
        }
    }
}

impl RegionTable {
    /// Regions a table from [`RegionTable::new`] holds.
    pub const DEFAULT_CAPACITY: usize = 1024;

    /// An empty table for [`RegionTable::DEFAULT_CAPACITY`] regions.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table for up to `capacity` regions.
    pub fn with_capacity(capacity: usize) -> Self {
        RegionTable {
            by_key: AppendMap::with_capacity(capacity),
        }
    }

    /// Regions it may hold.
    pub fn capacity(&self) -> usize {
        self.by_key.capacity()
    }

    /// Regions it holds.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Registers `mem` for `app` with `access` rights under a fresh random rkey.
    pub fn register(
        &self,
        app: u32,
        name: &str,
        access: u32,
        mem: RegionMemory,
    ) -> Result<Arc<Region>, RegisterError> {
        let mut region = Region {
            rkey: random_rkey(),
            app,
            name: name.to_string(),
            access: access & ACCESS_MASK,
            mem,
        };
        loop {
            let rkey = region.rkey;
            match self.by_key.insert(rkey, Arc::new(region)) {
                Ok(r) => return Ok(r.clone()),
                // Another region's key (one chance in 2^64 a region): draw again.
                Err((AppendError::Taken, back)) => match Arc::into_inner(back) {
                    Some(r) => region = r,
                    None => unreachable!("an Arc just made has no other owner"),
                },
                Err((AppendError::Full { capacity }, _)) => {
                    return Err(RegisterError::Full { capacity })
                }
            }
            region.rkey = random_rkey();
        }
    }

    /// Registers `mem` under a given `rkey` (a NIC process mirroring the server's table).
    pub fn register_with_key(
        &self,
        rkey: u64,
        app: u32,
        name: &str,
        access: u32,
        mem: RegionMemory,
    ) -> Result<Arc<Region>, RegisterError> {
        if rkey == 0 {
            return Err(RegisterError::KeyInUse(rkey));
        }
        let region = Arc::new(Region {
            rkey,
            app,
            name: name.to_string(),
            access: access & ACCESS_MASK,
            mem,
        });
        match self.by_key.insert(rkey, region) {
            Ok(r) => Ok(r.clone()),
            Err((AppendError::Full { capacity }, _)) => Err(RegisterError::Full { capacity }),
            Err(_) => Err(RegisterError::KeyInUse(rkey)),
        }
    }

    /// The region named `rkey`, if it belongs to `app`.
    #[inline]
    pub fn get(&self, app: u32, rkey: u64) -> Option<&Arc<Region>> {
        self.by_key.get(rkey).filter(|r| r.app == app)
    }

    /// Whether some region has `rkey`.
    pub fn contains_key(&self, rkey: u64) -> bool {
        self.by_key.contains_key(rkey)
    }

    /// Every app's regions, in no particular order.
    pub fn regions(&self) -> impl Iterator<Item = &Arc<Region>> {
        self.by_key.values()
    }

    /// The region `d` names for `app` and the start address of its range, checked as
    /// [`RegionTable::resolve`] checks it, without taking a reference on the region: the
    /// address stays valid as long as this table does.
    pub fn resolve_in(&self, app: u32, d: &Descriptor) -> Result<(&Region, u64), ResolveError> {
        let region = self.get(app, d.rkey).ok_or(ResolveError::BadKey(d.rkey))?;
        if d.access == 0 || d.access & !region.access != 0 {
            return Err(ResolveError::AccessDenied {
                need: d.access,
                have: region.access,
            });
        }
        let addr = region
            .mem
            .range(d.offset, d.len as u64)
            .map_err(ResolveError::OutOfRange)?;
        Ok((region, addr))
    }

    /// Checks `d` for `app`: key, app, rights, bounds.
    pub fn resolve(&self, app: u32, d: &Descriptor) -> Result<Resolved, ResolveError> {
        let region = self.get(app, d.rkey).ok_or(ResolveError::BadKey(d.rkey))?;
        if d.access == 0 || d.access & !region.access != 0 {
            return Err(ResolveError::AccessDenied {
                need: d.access,
                have: region.access,
            });
        }
        region
            .mem
            .range(d.offset, d.len as u64)
            .map_err(ResolveError::OutOfRange)?;
        Ok(Resolved {
            region: region.clone(),
            offset: d.offset,
            len: d.len,
            access: d.access,
        })
    }
}

/// Rights of a read-only region.
pub const READ_ONLY: u32 = ACCESS_READ;
/// Rights of a region that readers read and the owner writes.
pub const READ_WRITE: u32 = ACCESS_READ | ACCESS_WRITE;
/// Every right: read, write and atomic.
pub const ALL_RIGHTS: u32 = ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC;

#[cfg(test)]
mod tests {
    use super::*;

    fn d(rkey: u64, offset: u64, len: u32, access: u32) -> Descriptor {
        Descriptor {
            rkey,
            offset,
            len,
            access,
        }
    }

    #[test]
    fn resolution_checks_key_app_rights_and_bounds() {
        let t = RegionTable::new();
        let a = t
            .register(1, "a", READ_ONLY, RegionMemory::zeroed(64))
            .unwrap();
        let b = t
            .register(2, "b", ALL_RIGHTS, RegionMemory::zeroed(64))
            .unwrap();
        assert_ne!(a.rkey, b.rkey);
        assert!(t.resolve(1, &d(a.rkey, 0, 64, ACCESS_READ)).is_ok());
        assert_eq!(
            t.resolve(1, &d(12345, 0, 8, ACCESS_READ)).unwrap_err(),
            ResolveError::BadKey(12345)
        );
        assert_eq!(
            t.resolve(1, &d(b.rkey, 0, 8, ACCESS_READ)).unwrap_err(),
            ResolveError::BadKey(b.rkey),
            "another app's key"
        );
        assert!(matches!(
            t.resolve(1, &d(a.rkey, 60, 8, ACCESS_READ)),
            Err(ResolveError::OutOfRange(_))
        ));
        assert!(matches!(
            t.resolve(1, &d(a.rkey, u64::MAX, 8, ACCESS_READ)),
            Err(ResolveError::OutOfRange(_))
        ));
        assert!(matches!(
            t.resolve(1, &d(a.rkey, 0, 8, ACCESS_WRITE)),
            Err(ResolveError::AccessDenied { .. })
        ));
        assert!(t.resolve(2, &d(b.rkey, 8, 8, ALL_RIGHTS)).is_ok());
    }

    #[test]
    fn unaligned_reads_and_writes() {
        let m = RegionMemory::from_bytes(&(0u8..40).collect::<Vec<_>>());
        let mut out = [0u8; 13];
        m.read(3, &mut out).unwrap();
        assert_eq!(out.to_vec(), (3u8..16).collect::<Vec<_>>());
        m.write(5, &[0xaa; 11]).unwrap();
        let snap = m.snapshot();
        assert_eq!(&snap[..5], &[0, 1, 2, 3, 4]);
        assert_eq!(&snap[5..16], &[0xaa; 11]);
        assert_eq!(&snap[16..18], &[16, 17]);
        assert_eq!(
            m.read(35, &mut [0u8; 6]),
            Err(MemError::OutOfRange {
                offset: 35,
                len: 6,
                size: 40
            })
        );
    }

    proptest::proptest! {
        /// Writes at any offset and length (partial words at either end, none, or a
        /// sub-word write inside one word, up to a region end that is not a whole word) leave
        /// exactly what a byte array would hold.
        #[test]
        fn writes_match_a_byte_array(
            ops in proptest::collection::vec((0usize..64, proptest::collection::vec(proptest::num::u8::ANY, 0..40)), 1..20)
        ) {
            let m = RegionMemory::zeroed(93);
            let mut model = vec![0u8; 93];
            for (at, bytes) in &ops {
                let fits = at + bytes.len() <= model.len();
                proptest::prop_assert_eq!(m.write(*at as u64, bytes).is_ok(), fits);
                if fits {
                    model[*at..at + bytes.len()].copy_from_slice(bytes);
                }
            }
            proptest::prop_assert_eq!(m.snapshot(), model);
        }
    }

    /// A region of a huge page or more is its own mapping on a huge-page boundary, zeroed,
    /// usable to its last byte (the length need not be a multiple of a page), and private.
    #[test]
    fn a_large_region_is_its_own_huge_page_aligned_mapping() {
        let len = HUGE_PAGE + 4096 + 13;
        let m = RegionMemory::zeroed(len);
        assert!(matches!(m.storage, Storage::Anonymous { .. }));
        assert_eq!(m.addr() % HUGE_PAGE as u64, 0);
        assert!(!m.is_shared());
        assert_eq!(m.len(), len);
        let mut tail = [1u8; 13];
        m.read((len - 13) as u64, &mut tail).unwrap();
        assert_eq!(tail, [0; 13]);
        m.write((len - 5) as u64, &[9; 5]).unwrap();
        m.write(0, &[7; 8]).unwrap();
        assert_eq!(m.cas(HUGE_PAGE as u64, 0, 3).unwrap(), 0);
        assert_eq!(m.load_u64(HUGE_PAGE as u64).unwrap(), 3);
        let copy = m.snapshot();
        assert_eq!((copy[0], copy[len - 1], copy[len - 6]), (7, 9, 0));
        assert!(matches!(
            RegionMemory::zeroed(HUGE_PAGE - 8).storage,
            Storage::Heap(_)
        ));
    }

    /// A view of another table's region (an in-process NIC's) reads and changes the same
    /// words, under its own table's rkey, and keeps the memory alive after the first table
    /// is gone.
    #[test]
    fn a_view_shares_its_regions_memory_and_keeps_it_alive() {
        let len = HUGE_PAGE + 24;
        let host = RegionTable::new();
        let region = host
            .register(
                1,
                "log",
                ACCESS_READ | ACCESS_WRITE,
                RegionMemory::zeroed(len),
            )
            .unwrap();
        let nic = RegionTable::new();
        let seen = nic
            .register_with_key(
                region.rkey,
                1,
                "log",
                ACCESS_READ,
                RegionMemory::view_of(&region),
            )
            .unwrap();
        assert_eq!((seen.mem.len(), seen.mem.addr()), (len, region.mem.addr()));
        region.mem.write(len as u64 - 8, &[5; 8]).unwrap();
        assert_eq!(
            seen.mem.load_u64(len as u64 - 8).unwrap(),
            0x0505_0505_0505_0505
        );
        assert_eq!(seen.mem.cas(0, 0, 7).unwrap(), 0);
        assert_eq!(region.mem.load_u64(0).unwrap(), 7);
        drop((host, region));
        assert_eq!(seen.mem.load_u64(0).unwrap(), 7);
        let mut tail = [0u8; 8];
        seen.mem.read(len as u64 - 8, &mut tail).unwrap();
        assert_eq!(tail, [5; 8]);
    }

    #[test]
    fn atomics() {
        let m = RegionMemory::zeroed(16);
        assert_eq!(m.faa(8, 5).unwrap(), 0);
        assert_eq!(m.cas(8, 5, 9).unwrap(), 5);
        assert_eq!(
            m.cas(8, 5, 11).unwrap(),
            9,
            "failed CAS returns the current value"
        );
        assert_eq!(m.load_u64(8).unwrap(), 9);
        assert_eq!(m.cas(4, 0, 1), Err(MemError::Misaligned(4)));
        assert!(matches!(m.faa(16, 1), Err(MemError::OutOfRange { .. })));
        let mut out = [0u8; 8];
        m.read(8, &mut out).unwrap();
        assert_eq!(u64::from_le_bytes(out), 9);
    }
}
