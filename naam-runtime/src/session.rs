//! Sessions: the IO-free core is naam-proto's [`naam_proto::session`]; this
//! module adds what touches the file system, credential files ([`CredentialFile`]).

use std::path::Path;

use naam_proto::session::*;

/// Reading and writing credential files: 64 hexadecimal digits, readable by the owner only.
pub trait CredentialFile: Sized {
    /// Reads a credential file, refusing one that group or others may read.
    fn load(path: &Path) -> Result<Self, CredentialError>;
    /// Writes a new credential file readable by its owner only; refuses to replace one.
    fn write_new(&self, path: &Path) -> Result<(), CredentialError>;
}

impl CredentialFile for Credential {
    fn load(path: &Path) -> Result<Credential, CredentialError> {
        let io = |source| CredentialError::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(CredentialError::Permissions {
                    path: path.to_path_buf(),
                    mode,
                });
            }
        }
        #[cfg(not(unix))]
        let _ = meta;
        let text = std::fs::read_to_string(path).map_err(io)?;
        Credential::parse(&text, path)
    }

    fn write_new(&self, path: &Path) -> Result<(), CredentialError> {
        use std::io::Write;
        let io = |source| CredentialError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        let mut f = o.open(path).map_err(io)?;
        f.write_all(self.file_text().as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_files_are_private_and_strict() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.key");
        let c = Credential::generate(&crate::entropy::os()).unwrap();
        c.write_new(&p).unwrap();
        assert_eq!(Credential::load(&p).unwrap(), c);
        assert!(c.write_new(&p).is_err(), "never overwrites");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert!(matches!(
                Credential::load(&p),
                Err(CredentialError::Permissions { .. })
            ));
        }
        std::fs::write(dir.path().join("bad.key"), "abc").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let bad = dir.path().join("bad.key");
            std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600)).unwrap();
            assert!(matches!(
                Credential::load(&bad),
                Err(CredentialError::Format { .. })
            ));
        }
    }
}
