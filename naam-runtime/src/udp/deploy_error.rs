//! Why starting a deployment failed, and the exit code each cause means: one type for the
//! host's and the NIC's starts and for the shared-memory directory they use
//! ([`super::shm_dir`]), kept apart so that neither depends on the other for it.

use std::path::PathBuf;

use crate::cluster::ClusterError;

/// Why a deployment could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeployError {
    /// The cluster refused the apps or configuration.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Another server holds the directory.
    #[error("{}: in use by another naam-server{} (one server per shm_dir: give this one another `shm_dir`)", dir.display(), pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// The holder's pid, as its lock file says.
        pid: Option<u32>,
    },
    /// The directory holds regions of another layout than the config's.
    #[error("{}: the regions there were made for another layout ({found}); the config now asks for {wanted}. Start with --reset-regions to discard them (their data is lost), or give this config another shm_dir", dir.display())]
    LayoutChanged {
        /// The directory.
        dir: PathBuf,
        /// What the regions there are (from their header).
        found: String,
        /// What the config asks for.
        wanted: String,
    },
    /// Re-attached regions failed their app's consistency check.
    #[error("{}: app {app}'s regions fail their check: {message}. Start with --reset-regions to discard them", dir.display())]
    Inconsistent {
        /// The directory.
        dir: PathBuf,
        /// The app.
        app: u32,
        /// What the check found.
        message: String,
    },
    /// A snapshot could not be taken or restored.
    #[error("{}: {message}", path.display())]
    Snapshot {
        /// The directory at fault.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The manifest is not valid.
    #[error("{path}: invalid manifest: {message}")]
    Manifest {
        /// The file.
        path: PathBuf,
        /// The cause as text: a JSON, handler-object loading or OS RNG error, or a handler
        /// object that changed since the host loaded it.
        message: String,
    },
}

impl DeployError {
    /// The process exit code this error means (0 ok, 1 runtime failure, 2 bad input or
    /// config, as every binary uses them): a directory another server holds, regions of
    /// another layout or failing their check, and apps the cluster refuses (a handler that does
    /// not verify, a bad setting) are 2; files, memory and threads that fail are 1.
    pub fn exit_code(&self) -> u8 {
        match self {
            DeployError::Locked { .. }
            | DeployError::LayoutChanged { .. }
            | DeployError::Inconsistent { .. }
            | DeployError::Snapshot { .. } => 2,
            DeployError::Cluster(
                ClusterError::Registry(_) | ClusterError::Config(_) | ClusterError::UnknownApp(_),
            ) => 2,
            _ => 1,
        }
    }
}
