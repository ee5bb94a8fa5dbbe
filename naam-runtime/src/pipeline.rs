//! The handler build pipeline with NAAM's load check.
//!
//! [`naam_pipeline`] turns a handler crate into an eBPF object (cargo, then bpf-linker; it is a
//! separate crate so build scripts can embed objects without building the engines); [`build`]
//! also loads the object, so `naam build` never writes an object NAAM would refuse.

use std::path::PathBuf;

use naam_pipeline::{build_object, BuildError, BuildOptions};

use naam_vm::{LoadError, LoadedObject};

/// Why [`build`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The crate did not build into an eBPF object.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The object was built but does not load as NAAM handlers; it was removed.
    #[error("the built object does not load: {0}")]
    Load(#[from] LoadError),
}

/// A built and loaded object.
#[derive(Clone, Debug)]
pub struct BuildOutput {
    /// Path of the eBPF object.
    pub object: PathBuf,
    /// The object as loaded (the build checks that it loads; callers need not read it again).
    pub loaded: LoadedObject,
    /// Warnings bpf-linker printed, each distinct line once.
    pub linker_warnings: Vec<String>,
}

impl BuildOutput {
    /// Names of the handlers in the object.
    pub fn handler_names(&self) -> Vec<&str> {
        self.loaded
            .programs
            .iter()
            .map(|p| p.name.as_str())
            .collect()
    }
}

/// Builds the handler crate described by `opts` into an eBPF object and loads it. An object
/// that does not load is removed: a failed build leaves nothing behind.
pub fn build(opts: &BuildOptions) -> Result<BuildOutput, PipelineError> {
    let raw = build_object(opts)?;
    match naam_vm::load(&raw.bytes) {
        Ok(loaded) => Ok(BuildOutput {
            loaded,
            object: raw.object,
            linker_warnings: raw.linker_warnings,
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&raw.object);
            Err(PipelineError::Load(e))
        }
    }
}
