//! Why a step's data could not be fetched or its writes applied, and the reply status of each.

use crate::wire::Status;

/// Why a region operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemError {
    /// The range runs past the region.
    #[error("range {offset}+{len} runs past the region's {size} bytes")]
    OutOfRange {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Region size.
        size: usize,
    },
    /// A 64-bit atomic at an offset that is not a multiple of 8.
    #[error("atomic operation at offset {0} is not 8-byte aligned")]
    Misaligned(u64),
}

impl MemError {
    /// The reply status for this error.
    pub fn status(&self) -> Status {
        match self {
            MemError::OutOfRange { .. } => Status::OutOfRange,
            MemError::Misaligned(_) => Status::Refused,
        }
    }
}

/// Why a descriptor does not resolve. Each maps to an error reply, never a memory access.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// Unknown rkey, or one that belongs to another app (indistinguishable by design).
    #[error("rkey {0:#018x} names no region of this app")]
    BadKey(u64),
    /// The range runs past the region.
    #[error("descriptor range runs past its region: {0}")]
    OutOfRange(MemError),
    /// Rights the region does not grant.
    #[error("descriptor asks for access {}, region grants {}", naam_ebpf::abi::Rights(*need), naam_ebpf::abi::Rights(*have))]
    AccessDenied {
        /// Rights asked for.
        need: u32,
        /// `ACCESS_*` rights the region grants.
        have: u32,
    },
}

/// The reply status for a descriptor that does not resolve.
pub fn resolve_status(e: &ResolveError) -> Status {
    match e {
        ResolveError::BadKey(_) => Status::BadKey,
        ResolveError::OutOfRange(_) => Status::OutOfRange,
        ResolveError::AccessDenied { .. } => Status::AccessDenied,
    }
}

/// Why writes could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The target descriptor does not resolve.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The operation falls outside its segment, or is misaligned.
    #[error("write operation {index}: {reason}")]
    Invalid {
        /// Index of the operation in its batch.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A compare-and-swap found another value; the operations before it were applied.
    #[error("write operation {index}: compare-and-swap expected {expected:#x}, found {found:#x}")]
    Conflict {
        /// Index of the operation in its batch.
        index: usize,
        /// Value the handler expected.
        expected: u64,
        /// Value found in memory.
        found: u64,
    },
    /// This placement is not the app's write owner.
    #[error("this placement does not own the app's writes")]
    NotOwner,
}

impl WriteError {
    /// The reply status for this error.
    pub fn status(&self) -> Status {
        match self {
            WriteError::Resolve(e) => resolve_status(e),
            WriteError::Invalid { .. } => Status::Refused,
            WriteError::Conflict { .. } => Status::Conflict,
            WriteError::NotOwner => Status::NotOwner,
        }
    }
}

/// Why a step's segments could not be fetched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// A descriptor does not resolve.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The data source did not answer (one-sided agent down, timeout).
    #[error("data source unavailable: {0}")]
    Unavailable(String),
    /// A remote agent refused the access (its status and message).
    #[error("the one-sided agent refused the access ({status:?}): {message}")]
    Refused {
        /// The status of the agent's completion.
        status: Status,
        /// The agent's error text, or why its answer was unusable (malformed, wrong length).
        message: String,
    },
}

impl FetchError {
    /// The reply status for this error.
    pub fn status(&self) -> Status {
        match self {
            FetchError::Resolve(e) => resolve_status(e),
            FetchError::Unavailable(_) => Status::Unavailable,
            FetchError::Refused { status, .. } => *status,
        }
    }
}
