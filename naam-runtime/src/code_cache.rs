//! The code cache on disk (`code_cache = DIR` in naam-server's config): a directory store for
//! naam-vm's [`CodeCache`], one file per compiled handler (`<sha-256 key>.code`), sealed by
//! the cache under a secret kept beside them (`secret`, 32 random bytes, mode 0600).
//!
//! What is trusted: the directory must be this user's and writable by nobody else (as ssh
//! treats `~/.ssh`), and naam-vm refuses any entry whose seal, key or length does not check,
//! so a corrupted, truncated, stale or planted file is compiled again, never run. Whoever can
//! read the secret can forge entries: it is as sensitive as the server's binary.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use naam_vm::{CodeCache, CodeKey, CodeStore, MAX_ENTRY_CODE};

/// Why the code cache's directory cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodeCacheError {
    /// A file system call failed.
    #[error("code cache {}: {source}", path.display())]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// What the system said.
        source: io::Error,
    },
    /// The directory or its secret is open to others, or not what it should be.
    #[error("code cache {}: {why}", path.display())]
    Unsafe {
        /// The directory or file.
        path: PathBuf,
        /// What is wrong (owner, mode, kind or size).
        why: String,
    },
}

/// The most bytes an entry file may have (naam-vm's largest entry and its header and seal).
const MAX_FILE: u64 = MAX_ENTRY_CODE as u64 + 4096;

/// Opens (creating it, mode 0700, and its secret) the code cache in `dir`.
pub fn open_dir(dir: &Path) -> Result<Arc<CodeCache>, CodeCacheError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CodeCacheError::Io { path, source }
    };
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) => return Err(io_err(dir)(e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    check_private(dir, &meta, true)?;
    let secret_path = dir.join("secret");
    let secret = read_or_make_secret(&secret_path)?;
    let store = DirStore {
        dir: dir.to_path_buf(),
    };
    Ok(Arc::new(CodeCache::with_store(Arc::new(store), &secret)))
}

/// Refuses what is not this user's, or is writable (a directory) or readable (a file) by
/// anyone else.
fn check_private(path: &Path, meta: &fs::Metadata, dir: bool) -> Result<(), CodeCacheError> {
    let unsafe_ = |why: String| CodeCacheError::Unsafe {
        path: path.to_path_buf(),
        why,
    };
    if dir && !meta.is_dir() {
        return Err(unsafe_("not a directory".into()));
    }
    if !dir && !meta.is_file() {
        return Err(unsafe_("not a regular file".into()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(unsafe_(format!(
            "owned by uid {}, not this process's {me}",
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    let open = if dir { mode & 0o022 } else { mode & 0o077 };
    if open != 0 {
        return Err(unsafe_(format!(
            "mode {mode:03o} lets others {} it (chmod {})",
            if dir { "write" } else { "read" },
            if dir { "700" } else { "600" }
        )));
    }
    Ok(())
}

fn read_or_make_secret(path: &Path) -> Result<[u8; 32], CodeCacheError> {
    let io_err = |source| CodeCacheError::Io {
        path: path.to_path_buf(),
        source,
    };
    let created = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    match created {
        Ok(mut f) => {
            let mut secret = [0u8; 32];
            getrandom::fill(&mut secret).map_err(|e| io_err(io::Error::other(e.to_string())))?;
            f.write_all(&secret).map_err(io_err)?;
            f.sync_all().map_err(io_err)?;
            Ok(secret)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let meta = fs::symlink_metadata(path).map_err(io_err)?;
            check_private(path, &meta, false)?;
            let bytes = fs::read(path).map_err(io_err)?;
            bytes
                .try_into()
                .map_err(|b: Vec<u8>| CodeCacheError::Unsafe {
                    path: path.to_path_buf(),
                    why: format!("{} bytes, a secret has 32", b.len()),
                })
        }
        Err(e) => Err(io_err(e)),
    }
}

/// Entries as files of one directory.
#[derive(Debug)]
struct DirStore {
    dir: PathBuf,
}

impl DirStore {
    fn path(&self, key: &CodeKey) -> PathBuf {
        self.dir.join(format!("{}.code", hex::encode(key)))
    }
}

impl CodeStore for DirStore {
    fn load(&self, key: &CodeKey) -> Option<Vec<u8>> {
        let f = fs::File::open(self.path(key)).ok()?;
        let meta = f.metadata().ok()?;
        if !meta.is_file() || meta.len() > MAX_FILE {
            return None;
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        f.take(MAX_FILE).read_to_end(&mut bytes).ok()?;
        Some(bytes)
    }

    fn store(&self, key: &CodeKey, entry: &[u8]) {
        // Written aside, then renamed over: a reader sees the old entry or the new, whole.
        let path = self.path(key);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(entry))
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            tracing::warn!(path = %path.display(), error = %e, "code cache: entry not stored");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("naam-code-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_directory_open_to_others_or_a_bad_secret_is_refused() {
        let d = scratch("modes");
        open_dir(&d).unwrap();
        assert_eq!(
            fs::metadata(&d).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let secret = fs::read(d.join("secret")).unwrap();
        assert_eq!(secret.len(), 32);
        // The same secret on the next open.
        open_dir(&d).unwrap();
        assert_eq!(fs::read(d.join("secret")).unwrap(), secret);

        fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
        let e = open_dir(&d).unwrap_err().to_string();
        assert!(e.contains("lets others write"), "{e}");
        fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();

        fs::set_permissions(d.join("secret"), fs::Permissions::from_mode(0o644)).unwrap();
        let e = open_dir(&d).unwrap_err().to_string();
        assert!(e.contains("lets others read"), "{e}");
        fs::set_permissions(d.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();

        fs::write(d.join("secret"), b"short").unwrap();
        let e = open_dir(&d).unwrap_err().to_string();
        assert!(e.contains("5 bytes"), "{e}");

        let file = scratch("file");
        fs::write(&file, b"x").unwrap();
        assert!(open_dir(&file).is_err());
        let _ = fs::remove_dir_all(&d);
        let _ = fs::remove_file(&file);
    }
}
