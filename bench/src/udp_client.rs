//! How naam-bench's UDP clients are set up: where the credentials are (a directory of
//! `<tenant>.key` files as `naam-server keygen --out DIR/<tenant>.key` writes them:
//! `mica.key`, `btree.key`, `naam-operator.key`; `--keys DIR`), and how long a silent server
//! is waited for before the run fails (`--liveness SECONDS`).

use naam_runtime::CredentialFile as _;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context as _;
use naam_runtime::proto::session::Credential;

static DIR: OnceLock<PathBuf> = OnceLock::new();
static LIVENESS: OnceLock<Duration> = OnceLock::new();

/// The default liveness bound: a run fails this long after its server fell silent.
pub const DEFAULT_LIVENESS: Duration = Duration::from_secs(10);

/// Sets the liveness bound (once, from the command line).
pub fn set_liveness(d: Duration) {
    let _ = LIVENESS.set(d);
}

/// A client config for `server`, authenticating as `tenant`, with the liveness bound.
pub fn config(
    server: std::net::SocketAddr,
    tenant: &str,
) -> anyhow::Result<naam_runtime::udp::UdpConfig> {
    let mut c = naam_runtime::udp::UdpConfig::new(server, tenant, credential(tenant)?);
    c.liveness = *LIVENESS.get().unwrap_or(&DEFAULT_LIVENESS);
    c.inject_loss = naam_runtime::udp::injected_loss_from_env().map_err(anyhow::Error::msg)?;
    Ok(c)
}

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
