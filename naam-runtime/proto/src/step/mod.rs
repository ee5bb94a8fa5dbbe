//! The step machine: one message's life at one placement, apart from the engine that runs its
//! handler and from the memory that feeds it.
//!
//! A [`StepMachine`] asks its driver for a step's segments ([`Action::Fetch`]), is handed what
//! the engine made of them ([`StepMachine::stepped`]), asks for writes to be applied at the
//! app's write owner ([`Action::Write`]) and ends with [`Action::Complete`]. It owns the rules
//! every placement shares: write handlers run only at the owner, the hop limit, the budget of
//! optimistic-read retries and their backoff, and the checks on a step's output (next
//! descriptors, write operations against the segments they target). It never reads memory,
//! runs code or reads a clock: the in-process executors, the UDP server and NIC, the clients
//! and the simulator all drive this one machine.
//!
//! Beside it are the traits its drivers implement:
//! - [`Engine`]: runs one step of a handler over granted segments (naam-vm's `Vm`);
//! - [`DataPath`]: how a placement reaches a step's data (host memory, NIC DMA, the client's
//!   one-sided READs), and [`OneSided`], the READ transport under the client's path.

mod engine;
mod error;
mod machine;
mod path;

pub use engine::{Engine, Grant, InsnMix, Invocation, StepFault, StepResult};
pub use error::{resolve_status, FetchError, MemError, ResolveError, WriteError};
pub use machine::{
    Action, HandlerKind, Limits, MessageStart, Outcome, StepMachine, WriteBatch,
    MAX_RETRY_BACKOFF_NS,
};
pub use path::{DataPath, DmaModel, Fetched, InPlace, OneSided};
