//! The undo journal of one app's write batches, kept beside its regions in shared memory, so
//! that a server killed in the middle of a batch (`kill -9`) restarts over regions that hold
//! no half-applied batch.
//!
//! Before the write owner applies a batch, the journal copies what the batch will overwrite
//! (each operation's target bytes, as they are) into its own shared file, then marks itself
//! active; after the batch it marks itself idle. Region memory lives in files that outlive the
//! process (`/dev/shm`), and stores reach them in program order (one release store per word,
//! [`crate::executor`]), so after a crash the regions hold a prefix of at most one batch. A
//! journal opened over them finds itself active and copies the saved bytes back, newest
//! first: the regions are as they were before the batch, which no client was told had
//! succeeded (its reply is sent after the batch). Readers never need the journal: they
//! already retry what a writer tears (versions at both ends of every object).
//!
//! A batch is at most [`MAX_WRITES`] operations over at most [`WRITE_DATA_CAP`] staged bytes
//! each, so a journal of [`JOURNAL_SIZE`] bytes always holds one. Power loss is not covered:
//! `/dev/shm` does not survive it either.

use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex};

use naam_ebpf::abi::{write_kind, MAX_WRITES, WRITE_DATA_CAP};
use naam_proto::step::{WriteBatch, WriteError};

use crate::region::{Region, RegionMemory};

/// First word of a journal file: "NAAMUNDO".
const MAGIC: u64 = u64::from_le_bytes(*b"NAAMUNDO");
/// Layout version of the journal file.
pub const JOURNAL_FORMAT: u64 = 2;

const AT_MAGIC: u64 = 0;
const AT_FORMAT: u64 = 8;
/// 0: idle; else the number of the batch being applied.
const AT_ACTIVE: u64 = 16;
/// Entries saved for the active batch.
const AT_ENTRIES: u64 = 24;
/// Where the first entry starts.
const HEADER: usize = 64;
/// An entry: region slot, first word (its index in the region), word count, then the saved
/// words: every word the operation's bytes touch, whole (a region is whole words, and only
/// its write owner, which holds the journal, changes them during a batch).
const ENTRY_HEADER: usize = 24;

/// Bytes of a journal file: its header and one batch of the largest size the ABI allows.
/// An operation's words may start and end inside a word: one more word than its bytes fill.
pub const JOURNAL_SIZE: usize = HEADER + MAX_WRITES * (ENTRY_HEADER + WRITE_DATA_CAP + 16);

/// Why a journal could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// The memory is too small to be a journal.
    #[error("a journal needs {need} bytes, the file has {have}")]
    TooSmall {
        /// Bytes a journal takes ([`JOURNAL_SIZE`]).
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// The file is not a journal of this format (another program's, or a later version).
    #[error(
        "not a NAAM write journal of format {JOURNAL_FORMAT} (magic {magic:#x}, format {format})"
    )]
    Format {
        /// The first word found.
        magic: u64,
        /// The format word found.
        format: u64,
    },
    /// An entry of the unfinished batch does not fit the app's regions: the journal was
    /// written over another layout, or damaged. Nothing was restored.
    #[error("entry {index} of the unfinished batch {batch}: {reason}")]
    Entry {
        /// The batch's number.
        batch: u64,
        /// The entry's index.
        index: u64,
        /// What does not fit.
        reason: String,
    },
}

/// What opening a journal found and undid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RolledBack {
    /// The number of the batch that was being applied when the process stopped.
    pub batch: u64,
    /// Operations whose targets were restored.
    pub entries: u64,
}

/// One app's journal (see the module documentation).
pub struct WriteJournal {
    inner: Mutex<State>,
}

struct State {
    mem: RegionMemory,
    /// The app's regions in slot order (the app's spec order, the same at every start).
    regions: Vec<Arc<Region>>,
    next_batch: u64,
}

impl std::fmt::Debug for WriteJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteJournal").finish_non_exhaustive()
    }
}

impl WriteJournal {
    /// Prepares `mem` (zeroed, [`JOURNAL_SIZE`] bytes or more) as a new, idle journal for the
    /// app whose regions are `regions`, in slot order.
    pub fn create(mem: RegionMemory, regions: Vec<Arc<Region>>) -> Result<Self, JournalError> {
        check_size(&mem)?;
        write_word(&mem, AT_ACTIVE, 0);
        write_word(&mem, AT_ENTRIES, 0);
        write_word(&mem, AT_FORMAT, JOURNAL_FORMAT);
        write_word(&mem, AT_MAGIC, MAGIC);
        Ok(Self::over(mem, regions, 1))
    }

    /// Opens the journal in `mem` over the app's `regions` (slot order): a batch it finds
    /// unfinished is undone first, and reported.
    pub fn open(
        mem: RegionMemory,
        regions: Vec<Arc<Region>>,
    ) -> Result<(Self, Option<RolledBack>), JournalError> {
        check_size(&mem)?;
        let (magic, format) = (read_word(&mem, AT_MAGIC), read_word(&mem, AT_FORMAT));
        if magic != MAGIC || format != JOURNAL_FORMAT {
            return Err(JournalError::Format { magic, format });
        }
        let batch = read_word(&mem, AT_ACTIVE);
        let rolled = if batch == 0 {
            None
        } else {
            let entries = read_word(&mem, AT_ENTRIES);
            undo(&mem, &regions, batch, entries)?;
            write_word(&mem, AT_ACTIVE, 0);
            Some(RolledBack { batch, entries })
        };
        Ok((Self::over(mem, regions, batch + 1), rolled))
    }

    fn over(mem: RegionMemory, regions: Vec<Arc<Region>>, next_batch: u64) -> Self {
        WriteJournal {
            inner: Mutex::new(State {
                mem,
                regions,
                next_batch: next_batch.max(1),
            }),
        }
    }

    /// Applies `batch` with `apply` under the journal: what its operations will overwrite is
    /// saved first. An operation the journal cannot place (a target that is not one of the
    /// app's regions, a range outside it) ends what is saved: `apply` refuses it, and stops
    /// there, before anything after it is written.
    pub fn apply(
        &self,
        batch: &WriteBatch<'_>,
        apply: impl FnOnce() -> Result<(), WriteError>,
    ) -> Result<(), WriteError> {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.begin(batch)?;
        let applied = apply();
        s.end();
        applied
    }
}

impl State {
    /// Saves what `batch` will overwrite and marks the journal active: each operation's
    /// words copied word by word from the region into the journal (no buffer between), then
    /// one release fence, the count, and the active mark.
    fn begin(&mut self, batch: &WriteBatch<'_>) -> Result<(), WriteError> {
        let State {
            mem,
            regions,
            next_batch,
        } = self;
        let journal = mem.words();
        let mut at = HEADER / 8;
        let mut entries = 0u64;
        for op in batch.ops {
            let Some(target) = batch.targets.get(op.segment as usize) else {
                break;
            };
            let len = match op.kind {
                write_kind::STORE => u64::from(op.len),
                _ => 8,
            };
            let Some(offset) = target.offset.checked_add(u64::from(op.offset)) else {
                break;
            };
            let Some(slot) = regions.iter().position(|r| r.rkey == target.rkey) else {
                break;
            };
            let region = &regions[slot].mem;
            let Some(end) = offset
                .checked_add(len)
                .filter(|&e| e <= region.len() as u64)
            else {
                break;
            };
            let (first, last) = ((offset / 8) as usize, end.div_ceil(8) as usize);
            let count = last - first;
            if at + ENTRY_HEADER / 8 + count > journal.len() {
                // Cannot happen within the ABI's limits (JOURNAL_SIZE); refused rather than
                // applied unprotected.
                return Err(WriteError::Invalid {
                    index: entries as usize,
                    reason: format!(
                        "the batch saves more than the journal's {} bytes",
                        mem.len()
                    ),
                });
            }
            let header = [slot as u64, first as u64, count as u64];
            for (w, v) in journal[at..at + 3].iter().zip(header) {
                w.store(v, Ordering::Relaxed);
            }
            let saved = &journal[at + 3..at + 3 + count];
            for (to, from) in saved.iter().zip(&region.words()[first..last]) {
                to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            at += 3 + count;
            entries += 1;
        }
        // Entries first, then the count, then active: a journal found active holds them all.
        fence(Ordering::Release);
        journal[AT_ENTRIES as usize / 8].store(entries, Ordering::Release);
        journal[AT_ACTIVE as usize / 8].store(*next_batch, Ordering::Release);
        Ok(())
    }

    /// Marks the journal idle: the batch is applied (or refused where it stopped).
    fn end(&mut self) {
        write_word(&self.mem, AT_ACTIVE, 0);
        self.next_batch += 1;
    }
}

fn check_size(mem: &RegionMemory) -> Result<(), JournalError> {
    if mem.len() < JOURNAL_SIZE {
        return Err(JournalError::TooSmall {
            need: JOURNAL_SIZE,
            have: mem.len(),
        });
    }
    Ok(())
}

fn read_word(mem: &RegionMemory, at: u64) -> u64 {
    mem.load_u64(at).expect("inside the journal's header")
}

fn write_word(mem: &RegionMemory, at: u64, v: u64) {
    mem.write(at, &v.to_le_bytes())
        .expect("inside the journal's header");
}

/// Restores the `entries` saved for batch `batch`, newest first; checks them all before it
/// writes any.
fn undo(
    mem: &RegionMemory,
    regions: &[Arc<Region>],
    batch: u64,
    entries: u64,
) -> Result<(), JournalError> {
    let bad = |index: u64, reason: String| JournalError::Entry {
        batch,
        index,
        reason,
    };
    let journal = mem.words();
    let mut found = Vec::new();
    let mut at = HEADER / 8;
    for index in 0..entries {
        let Some(header) = journal.get(at..at + 3) else {
            return Err(bad(index, "past the journal's end".into()));
        };
        let [slot, first, count] = [0, 1, 2].map(|i| header[i].load(Ordering::Acquire));
        let region = regions
            .get(slot as usize)
            .ok_or_else(|| bad(index, format!("region slot {slot} of {}", regions.len())))?;
        let body = at + 3;
        let words = usize::try_from(count).unwrap_or(usize::MAX);
        if body.saturating_add(words) > journal.len() {
            return Err(bad(
                index,
                format!("{count} words run past the journal's end"),
            ));
        }
        let first = usize::try_from(first).unwrap_or(usize::MAX);
        if first.saturating_add(words) > region.mem.words().len() {
            return Err(bad(
                index,
                format!(
                    "{count} words at word {first} outside region {} ({} bytes)",
                    region.name,
                    region.mem.len()
                ),
            ));
        }
        found.push((slot as usize, first, body, words));
        at = body + words;
    }
    for &(slot, first, body, words) in found.iter().rev() {
        let target = &regions[slot].mem.words()[first..first + words];
        for (to, from) in target.iter().zip(&journal[body..body + words]) {
            to.store(from.load(Ordering::Acquire), Ordering::Release);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use naam_ebpf::abi::{Descriptor, WriteOp, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
    use proptest::prelude::*;

    fn region(rkey: u64, len: usize) -> Arc<Region> {
        let t = crate::RegionTable::new();
        t.register_with_key(
            rkey,
            1,
            &format!("r{rkey}"),
            ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
            RegionMemory::zeroed(len),
        )
        .expect("a fresh rkey")
    }

    /// Applies the first `stop` operations of `batch` as the owner would (stores and adds).
    fn apply_prefix(regions: &[Arc<Region>], batch: &WriteBatch<'_>, stop: usize) {
        for op in batch.ops.iter().take(stop) {
            let t = batch.targets[op.segment as usize];
            let r = regions.iter().find(|r| r.rkey == t.rkey).expect("a region");
            let at = t.offset + u64::from(op.offset);
            match op.kind {
                write_kind::STORE => r.mem.write(at, batch.bytes(op)).expect("inside"),
                _ => {
                    r.mem.faa(at, op.operand).expect("inside");
                }
            }
        }
    }

    fn journal_of(j: WriteJournal) -> RegionMemory {
        j.inner.into_inner().expect("not poisoned").mem
    }

    proptest! {
        /// A batch cut after any number of its operations (the process killed) is undone when
        /// the journal is opened again, overlapping targets and atomics included; a finished
        /// one is left as applied.
        #[test]
        fn a_batch_cut_anywhere_is_undone(
            before in proptest::collection::vec(any::<u8>(), 256),
            data in proptest::collection::vec(any::<u8>(), 64),
            ops in proptest::collection::vec((0u32..2, 0u32..11, 1u32..5, 0u32..4, any::<bool>()), 1..MAX_WRITES),
            cut in 0usize..=MAX_WRITES,
            finish in any::<bool>(),
        ) {
            let regions = vec![region(11, 128), region(12, 128)];
            regions[0].mem.write(0, &before[..128]).expect("inside");
            regions[1].mem.write(0, &before[128..]).expect("inside");
            let targets = [
                Descriptor { rkey: 11, offset: 0, len: 128, access: ACCESS_WRITE | ACCESS_ATOMIC },
                Descriptor { rkey: 12, offset: 8, len: 120, access: ACCESS_WRITE | ACCESS_ATOMIC },
            ];
            let ops: Vec<WriteOp> = ops
                .iter()
                .map(|&(segment, word, words, from, atomic)| WriteOp {
                    kind: if atomic { write_kind::FAA } else { write_kind::STORE },
                    segment,
                    // Stores may start inside a word; atomics are aligned.
                    offset: word * 8 + if atomic { 0 } else { from },
                    len: if atomic { 8 } else { words * 8 },
                    data_offset: from * 8,
                    operand: 3,
                    ..WriteOp::default()
                })
                .collect();
            let batch = WriteBatch { app: 1, request_id: 9, ops: &ops, targets: &targets, data: &data };
            let j = WriteJournal::create(RegionMemory::zeroed(JOURNAL_SIZE), regions.clone())
                .expect("a journal");
            let cut = cut.min(ops.len());
            let snapshot = |r: &Arc<Region>| r.mem.snapshot();
            {
                let mut s = j.inner.lock().expect("not poisoned");
                s.begin(&batch).expect("fits");
                apply_prefix(&regions, &batch, if finish { ops.len() } else { cut });
                if finish {
                    s.end();
                }
            }
            let after: Vec<_> = regions.iter().map(snapshot).collect();
            let (_, rolled) = WriteJournal::open(journal_of(j), regions.clone()).expect("opens");
            if finish {
                prop_assert_eq!(rolled, None);
                prop_assert_eq!(regions.iter().map(snapshot).collect::<Vec<_>>(), after);
            } else {
                prop_assert_eq!(rolled, Some(RolledBack { batch: 1, entries: ops.len() as u64 }));
                prop_assert_eq!(&snapshot(&regions[0])[..], &before[..128]);
                prop_assert_eq!(&snapshot(&regions[1])[..], &before[128..]);
            }
        }
    }

    #[test]
    fn a_finished_or_refused_batch_leaves_the_journal_idle() {
        let regions = vec![region(5, 64)];
        let j = WriteJournal::create(RegionMemory::zeroed(JOURNAL_SIZE), regions.clone())
            .expect("a journal");
        let ops = [WriteOp {
            kind: write_kind::STORE,
            len: 8,
            ..WriteOp::default()
        }];
        let targets = [Descriptor {
            rkey: 5,
            offset: 0,
            len: 64,
            access: ACCESS_WRITE,
        }];
        let batch = WriteBatch {
            app: 1,
            request_id: 1,
            ops: &ops,
            targets: &targets,
            data: &[7; 8],
        };
        let refused = j.apply(&batch, || Err(WriteError::NotOwner));
        assert!(matches!(refused, Err(WriteError::NotOwner)));
        j.apply(&batch, || {
            apply_prefix(&regions, &batch, 1);
            Ok(())
        })
        .expect("applied");
        assert_eq!(
            regions[0].mem.load_u64(0).expect("inside"),
            0x0707_0707_0707_0707
        );
        let mem = journal_of(j);
        assert_eq!(read_word(&mem, AT_ACTIVE), 0);
        let (j, rolled) = WriteJournal::open(mem, regions).expect("opens");
        assert_eq!(rolled, None);
        assert_eq!(j.inner.lock().expect("not poisoned").next_batch, 1);
    }

    #[test]
    fn a_foreign_file_is_refused() {
        let mem = RegionMemory::zeroed(JOURNAL_SIZE);
        mem.write(0, b"notajrnl").expect("inside");
        assert!(matches!(
            WriteJournal::open(mem, Vec::new()),
            Err(JournalError::Format { .. })
        ));
        assert!(matches!(
            WriteJournal::create(RegionMemory::zeroed(64), Vec::new()),
            Err(JournalError::TooSmall { .. })
        ));
    }

    #[test]
    fn an_entry_outside_the_regions_restores_nothing() {
        let regions = vec![region(5, 64)];
        regions[0].mem.write(0, &[1; 64]).expect("inside");
        let j = WriteJournal::create(RegionMemory::zeroed(JOURNAL_SIZE), regions.clone())
            .expect("a journal");
        let mem = journal_of(j);
        // Two entries (slot, first word, words, then the words): a good one, then one naming
        // a slot the app does not have.
        for (at, v) in [
            (64, 0),
            (72, 0),
            (80, 1),
            (88, 0),
            (96, 3),
            (104, 0),
            (112, 1),
        ] {
            write_word(&mem, at, v);
        }
        write_word(&mem, AT_ENTRIES, 2);
        write_word(&mem, AT_ACTIVE, 4);
        let e = WriteJournal::open(mem, regions.clone()).expect_err("refused");
        assert!(
            e.to_string().contains("entry 1 of the unfinished batch 4"),
            "{e}"
        );
        assert_eq!(regions[0].mem.snapshot(), vec![1; 64]);
    }
}
