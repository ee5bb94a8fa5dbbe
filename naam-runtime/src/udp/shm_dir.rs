//! A server's shared-memory directory as naam-server owns it: one server per directory (an
//! advisory lock held for the process's life), a header saying which layout the regions there
//! have and whether the last server to use them stopped cleanly, and the list of what this
//! start created, so that a failed start removes exactly that and nothing another start made.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::deploy_error::DeployError;

/// The shared-memory file of `app`'s region `name` in `shm_dir`.
pub(crate) fn region_file(shm_dir: &Path, app: u32, name: &str) -> PathBuf {
    shm_dir.join(format!("app{app}-{name}.region"))
}

/// The shared-memory file of `app`'s write journal in `shm_dir`.
pub(crate) fn journal_file(shm_dir: &Path, app: u32) -> PathBuf {
    shm_dir.join(format!("app{app}.journal"))
}

/// The lock file naam-server holds in its directory (its pid inside).
pub const LOCK_FILE: &str = ".naam-server.lock";
/// The header of the regions in a directory.
pub const HEADER_FILE: &str = "regions.json";
/// Layout version of [`RegionsHeader`] and of the region and journal files it describes.
pub const REGIONS_FORMAT: u32 = 1;

/// Whether the last server over a directory's regions stopped cleanly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RegionsState {
    /// A server is using them (or died using them: nobody holds the lock).
    Serving,
    /// The last server stopped cleanly.
    Stopped,
}

/// `regions.json`: which layout the regions in the directory have.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionsHeader {
    /// [`REGIONS_FORMAT`] of the server that made them.
    pub format: u32,
    /// The layout's hash ([`layout_hash`]), hex.
    pub layout: String,
    /// The layout in words, for the error a changed one gets.
    pub apps: Vec<String>,
    /// Whether their last server stopped cleanly.
    pub state: RegionsState,
    /// The pid of the server that wrote this.
    pub pid: u32,
}

/// The directory, locked for this process (see the module documentation). Dropping it
/// removes the lock file and releases the lock.
#[derive(Debug)]
pub struct ShmDir {
    path: PathBuf,
    lock: Option<File>,
    /// Files this start made (removed if it fails), in the order made.
    created: Vec<PathBuf>,
    /// The same files, to find one at once: a server of 10,000 apps makes 40,000, and
    /// searching the list for each took most of a 58 s start.
    created_set: std::collections::HashSet<PathBuf>,
    /// Whether this start made the directory itself.
    created_dir: bool,
}

impl ShmDir {
    /// Takes `path` for this process: made (owner only) when missing; locked, or
    /// [`DeployError::Locked`] naming the pid of the server that holds it.
    pub fn lock(path: &Path) -> Result<ShmDir, DeployError> {
        let file_err = |p: &Path| {
            let p = p.to_path_buf();
            move |source| DeployError::File { path: p, source }
        };
        let created_dir = !path.exists();
        if created_dir {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(file_err(path))?;
        }
        let mut dir = ShmDir {
            path: path.to_path_buf(),
            lock: None,
            created: Vec::new(),
            created_set: Default::default(),
            created_dir,
        };
        let lock_path = path.join(LOCK_FILE);
        // A holder that stops removes the file while it holds the lock: whoever locked the
        // old file then finds it gone and tries again on the new one. A holder that was
        // killed keeps the lock until its last thread has exited, which for a large server
        // (regions to unmap) can be a while after its main thread shows as a zombie: while
        // the pid in the file is gone or a zombie, the lock is waited for (a bounded time).
        let patience = std::time::Instant::now() + HOLDER_EXIT_WAIT;
        for _ in 0..100_000 {
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&lock_path)
                .map_err(file_err(&lock_path))?;
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    return Err(DeployError::File {
                        path: lock_path,
                        source: e,
                    });
                }
                let mut text = String::new();
                let _ = f.read_to_string(&mut text);
                let pid: Option<u32> = text.trim().parse().ok();
                if pid.is_some_and(exiting) && std::time::Instant::now() < patience {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    continue;
                }
                return Err(DeployError::Locked {
                    dir: path.to_path_buf(),
                    pid,
                });
            }
            if !same_file(&f, &lock_path) {
                continue;
            }
            f.set_len(0).map_err(file_err(&lock_path))?;
            writeln!(f, "{}", std::process::id()).map_err(file_err(&lock_path))?;
            dir.lock = Some(f);
            return Ok(dir);
        }
        Err(DeployError::Locked {
            dir: path.to_path_buf(),
            pid: None,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Notes that this start made `file` (removed should the start fail).
    pub(crate) fn made(&mut self, file: PathBuf) {
        if self.created_set.insert(file.clone()) {
            self.created.push(file);
        }
    }

    /// The header of the regions found here, if any: `Err` when it cannot be read as one.
    pub fn header(&self) -> Result<Option<RegionsHeader>, DeployError> {
        let path = self.path.join(HEADER_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| DeployError::Manifest {
                        path,
                        message: format!("not a regions header: {e}"),
                    })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(DeployError::File { path, source }),
        }
    }

    /// Writes the header (whole, then renamed into place).
    pub fn write_header(&mut self, header: &RegionsHeader) -> Result<(), DeployError> {
        let path = self.path.join(HEADER_FILE);
        if !path.exists() {
            self.made(path.clone());
        }
        let json = serde_json::to_vec_pretty(header).map_err(|e| DeployError::Manifest {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let tmp = self.path.join(".regions.json.tmp");
        std::fs::write(&tmp, json).map_err(|source| DeployError::File {
            path: tmp.clone(),
            source,
        })?;
        std::fs::rename(&tmp, &path).map_err(|source| DeployError::File { path, source })
    }

    /// The region, journal and header files of an earlier start, found here.
    pub fn region_files(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name == HEADER_FILE
                    || (name.starts_with("app")
                        && (name.ends_with(".region") || name.ends_with(".journal")))
            })
            .map(|e| e.path())
            .collect();
        found.sort();
        found
    }

    /// Copies the regions here (their files, journals and header, as they are) into the new
    /// directory `out`, for a server elsewhere to start from ([`ShmDir::restore_from`]). The
    /// caller holds this directory's lock, so no server writes them meanwhile. Returns the
    /// files copied.
    pub fn snapshot_to(&self, out: &Path) -> Result<usize, DeployError> {
        let files = self.region_files();
        if !files.iter().any(|f| f.ends_with(HEADER_FILE)) {
            return Err(DeployError::Snapshot {
                path: self.path.clone(),
                message: "holds no regions to snapshot".into(),
            });
        }
        if out.exists() {
            return Err(DeployError::Snapshot {
                path: out.to_path_buf(),
                message: "exists already: a snapshot goes into a new directory".into(),
            });
        }
        std::fs::create_dir_all(out).map_err(|source| DeployError::File {
            path: out.to_path_buf(),
            source,
        })?;
        for f in &files {
            let to = out.join(f.file_name().unwrap_or_default());
            std::fs::copy(f, &to).map_err(|source| DeployError::File { path: to, source })?;
        }
        Ok(files.len())
    }

    /// Copies a snapshot's regions ([`ShmDir::snapshot_to`]) here, where there must be none
    /// (discard them first); a start then takes them up as its own. Returns the files copied.
    pub fn restore_from(&mut self, snapshot: &Path) -> Result<usize, DeployError> {
        if !self.region_files().is_empty() {
            return Err(DeployError::Snapshot {
                path: self.path.clone(),
                message: "holds regions already: start with --reset-regions to discard them, \
                          or restore into another shm_dir"
                    .into(),
            });
        }
        let from = ShmDir {
            path: snapshot.to_path_buf(),
            lock: None,
            created: Vec::new(),
            created_set: Default::default(),
            created_dir: false,
        };
        let files = from.region_files();
        if !files.iter().any(|f| f.ends_with(HEADER_FILE)) {
            return Err(DeployError::Snapshot {
                path: snapshot.to_path_buf(),
                message: format!("is not a snapshot: no {HEADER_FILE}"),
            });
        }
        for f in &files {
            let to = self.path.join(f.file_name().unwrap_or_default());
            self.made(to.clone());
            std::fs::copy(f, &to).map_err(|source| DeployError::File { path: to, source })?;
        }
        Ok(files.len())
    }

    /// Removes what this start made, newest first, then the directory if this start made it
    /// and nothing else is in it (a failed start leaves nothing behind).
    pub fn remove_made(&mut self) {
        self.created_set.clear();
        for f in self.created.drain(..).rev() {
            let _ = std::fs::remove_file(f);
        }
        if self.created_dir {
            self.release();
            let _ = std::fs::remove_dir(&self.path);
        }
    }

    /// Forgets what this start made: it succeeded, and those files are the deployment's now.
    pub(crate) fn keep_made(&mut self) {
        self.created.clear();
        self.created_set.clear();
        self.created_dir = false;
    }

    /// Removes the lock file and releases the lock.
    fn release(&mut self) {
        if let Some(f) = self.lock.take() {
            let _ = std::fs::remove_file(self.path.join(LOCK_FILE));
            drop(f);
        }
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        self.release();
    }
}

/// How long a start waits for the lock of a holder that is exiting ([`exiting`]).
const HOLDER_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether process `pid` is exiting or gone as this process sees it: no `/proc/PID`, or its
/// main thread a zombie (its other threads may still hold its files).
fn exiting(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's closing parenthesis.
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_none_or(|state| state == 'Z' || state == 'X'),
        Err(_) => true,
    }
}

/// Whether `f` is still the file at `path` (not removed or replaced since it was opened).
fn same_file(f: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The hash of a layout described by `apps` (one line per app, see [`describe_layout`]).
pub(crate) fn layout_hash(apps: &[String]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(format!("naam regions format {REGIONS_FORMAT}\n"));
    for a in apps {
        h.update(a.as_bytes());
        h.update(b"\n");
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One line describing app `id`'s layout: its kind, its parameters and its regions' names,
/// sizes and rights (what region files of an earlier start must match to be used again).
pub(crate) fn describe_layout(
    id: u32,
    kind: &str,
    params: &serde_json::Value,
    regions: &[(String, u64, u32)],
) -> String {
    let regions: Vec<String> = regions
        .iter()
        .map(|(name, len, access)| format!("{name}:{len}:{access:#x}"))
        .collect();
    format!("app {id} {kind} {params} [{}]", regions.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("shm");
        let first = ShmDir::lock(&dir).expect("locked");
        match ShmDir::lock(&dir) {
            Err(DeployError::Locked { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("not refused: {other:?}"),
        }
        drop(first);
        assert!(
            !dir.join(LOCK_FILE).exists(),
            "the lock file goes with its holder"
        );
        let again = ShmDir::lock(&dir).expect("free again");
        drop(again);
    }

    #[test]
    fn a_live_holder_is_not_exiting_and_a_missing_one_is() {
        assert!(!exiting(std::process::id()));
        assert!(exiting(u32::MAX));
    }

    #[test]
    fn a_failed_start_removes_what_it_made_and_only_that() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("shm");
        let mut d = ShmDir::lock(&dir).expect("locked");
        std::fs::write(dir.join("app1-x.region"), b"x").expect("write");
        d.made(dir.join("app1-x.region"));
        d.remove_made();
        drop(d);
        assert!(!dir.exists(), "a directory it made goes too");
        // A directory it did not make stays, with what others put there.
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("keep"), b"k").expect("write");
        let mut d = ShmDir::lock(&dir).expect("locked");
        std::fs::write(dir.join("app1-y.region"), b"y").expect("write");
        d.made(dir.join("app1-y.region"));
        d.remove_made();
        drop(d);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["keep"]);
    }

    #[test]
    fn a_snapshot_goes_to_a_new_directory_and_back_into_an_empty_one() {
        let base = tempfile::tempdir().expect("tempdir");
        let mut d = ShmDir::lock(&base.path().join("a")).expect("locked");
        assert!(
            d.snapshot_to(&base.path().join("none")).is_err(),
            "nothing to copy"
        );
        d.write_header(&RegionsHeader {
            format: REGIONS_FORMAT,
            layout: "x".into(),
            apps: Vec::new(),
            state: RegionsState::Stopped,
            pid: 1,
        })
        .expect("header");
        std::fs::write(base.path().join("a/app1-r.region"), b"data").expect("region");
        std::fs::write(base.path().join("a/manifest.json"), b"{}").expect("manifest");
        let snap = base.path().join("snap");
        assert_eq!(d.snapshot_to(&snap).expect("copied"), 2);
        assert!(
            d.snapshot_to(&snap).is_err(),
            "never into an existing directory"
        );
        assert!(!snap.join("manifest.json").exists(), "regions only");
        assert!(d.restore_from(&snap).is_err(), "not over regions");
        let mut b = ShmDir::lock(&base.path().join("b")).expect("locked");
        assert_eq!(b.restore_from(&snap).expect("restored"), 2);
        assert_eq!(
            std::fs::read(base.path().join("b/app1-r.region")).expect("copied"),
            b"data"
        );
        assert!(
            b.restore_from(&base.path().join("a")).is_err(),
            "b has regions now"
        );
    }

    #[test]
    fn layouts_differ_by_any_size_or_right() {
        let a = describe_layout(
            1,
            "mica",
            &serde_json::json!({"buckets": 4}),
            &[("index".into(), 64, 3)],
        );
        let b = describe_layout(
            1,
            "mica",
            &serde_json::json!({"buckets": 4}),
            &[("index".into(), 72, 3)],
        );
        let c = describe_layout(
            1,
            "mica",
            &serde_json::json!({"buckets": 8}),
            &[("index".into(), 64, 3)],
        );
        let h = |l: &str| layout_hash(&[l.to_string()]);
        assert_ne!(h(&a), h(&b));
        assert_ne!(h(&a), h(&c));
        assert_eq!(h(&a), h(&a.clone()));
    }
}
