//! Where naam-bench finds the credentials of the UDP fabric: a directory of `<tenant>.key`
//! files as `naam-server keygen --out DIR/<tenant>.key` writes them (`mica.key`, `btree.key`,
//! `naam-operator.key`), named by `--keys DIR` (default `keys`).

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::Context as _;
use naam_runtime::session::Credential;

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// Sets the key directory (once, from the command line).
pub fn set_dir(dir: PathBuf) {
    let _ = DIR.set(dir);
}

/// The credential of `tenant`.
pub fn credential(tenant: &str) -> anyhow::Result<Credential> {
    let dir = DIR.get().cloned().unwrap_or_else(|| PathBuf::from("keys"));
    let path = dir.join(format!("{tenant}.key"));
    Credential::load(&path).with_context(|| {
        format!(
            "the credential of tenant {tenant} (make it with `naam-server keygen --out {}` and \
             name it in the server's config; --keys DIR says where naam-bench looks)",
            path.display()
        )
    })
}
