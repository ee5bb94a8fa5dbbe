//! The boundary between the step machine and an eBPF engine: what one step is given
//! ([`Invocation`], [`Grant`]) and what it leaves ([`StepResult`], [`StepFault`]).

use naam_ebpf::abi::{Descriptor, Return, WriteOp, ACCESS_READ, STATE_WORDS};

/// A segment granted to one step: `len` bytes at `addr` with `ACCESS_*` rights. It is an
/// address, not a slice, because host segments are views of region memory that other
/// executors write concurrently (through atomics); the engine checks every access against it.
#[derive(Clone, Copy, Debug)]
pub struct Grant<'a> {
    addr: u64,
    len: usize,
    access: u32,
    _life: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Grant<'a> {
    /// Read-only access to `bytes`.
    pub fn read(bytes: &'a [u8]) -> Grant<'a> {
        Grant {
            addr: bytes.as_ptr() as u64,
            len: bytes.len(),
            access: ACCESS_READ,
            _life: std::marker::PhantomData,
        }
    }

    /// Access to `bytes` with `access` rights (write rights need the exclusive borrow).
    pub fn with_access(bytes: &'a mut [u8], access: u32) -> Grant<'a> {
        Grant {
            addr: bytes.as_mut_ptr() as u64,
            len: bytes.len(),
            access,
            _life: std::marker::PhantomData,
        }
    }

    /// Grants raw memory.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be valid for the access rights for the whole step, and not be
    /// accessed concurrently in a way that breaks Rust's aliasing rules for its owner.
    pub unsafe fn raw(addr: u64, len: usize, access: u32) -> Grant<'a> {
        Grant {
            addr,
            len,
            access,
            _life: std::marker::PhantomData,
        }
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty grant.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `ACCESS_*` rights (atomics need the write right).
    pub fn access(&self) -> u32 {
        self.access
    }
}

/// The inputs of one step.
#[derive(Clone, Debug, Default)]
pub struct Invocation<'a> {
    /// App of the message, copied into the handler's context (naam-vm wipes context and stack
    /// when it changes).
    pub app: u32,
    /// Id of the request being run, copied into the handler's context.
    pub request_id: u64,
    /// Step index, counted from 0 over the whole message (across placements).
    pub step: u32,
    /// Placement, one of `naam_ebpf::abi::placement`.
    pub placement: u32,
    /// Inline args (at most `ARGS_CAP` bytes).
    pub args: &'a [u8],
    /// State words from the previous step.
    pub state: [u64; STATE_WORDS],
    /// Reply bytes accumulated by earlier steps.
    pub reply: &'a [u8],
    /// Segments fetched for this step, in the order of its descriptors.
    pub segments: &'a [Grant<'a>],
    /// The engine ran this message's previous step last and nothing ran since, so the
    /// message's args, state words and reply are still where that step left them, and equal
    /// `args`, `state` and `reply`: an engine may skip copying them in. A hint only; an
    /// engine that cannot tell for itself that it is true ignores it.
    pub resident: bool,
}

/// Of the instructions a handler executed, those whose cost differs most between processors
/// (a simulation's cost model prices them apart; the rest are ALU operations and jumps).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsnMix {
    /// Loads, stores and atomics.
    pub memory: u64,
    /// Helper calls (each also counts as one instruction).
    pub helpers: u64,
}

impl InsnMix {
    /// Both counts of `self` and `other`, added.
    pub fn plus(self, other: InsnMix) -> InsnMix {
        InsnMix {
            memory: self.memory.saturating_add(other.memory),
            helpers: self.helpers.saturating_add(other.helpers),
        }
    }
}

/// What a finished step left in the engine, borrowed from it until it runs again.
#[derive(Clone, Copy, Debug)]
pub struct StepResult<'a> {
    /// r0 as the handler left it at `exit`, before decoding into a [`Return`].
    pub return_code: u64,
    /// Decoded r0, if it is a valid [`Return`].
    pub ret: Option<Return>,
    /// Instructions executed, where the engine counts them.
    pub insns: Option<u64>,
    /// Of those, the classes a cost model prices apart, where the engine counts them (the
    /// interpreter does; the JIT meters the total only).
    pub mix: Option<InsnMix>,
    /// The reply as the step left it (earlier steps' bytes included).
    pub reply: &'a [u8],
    /// State words for the next step.
    pub state: &'a [u64; STATE_WORDS],
    /// Descriptors of the next step (`Continue`).
    pub next: &'a [Descriptor],
    /// Write operations (`Write`), whose `data_offset` index [`StepResult::write_data`].
    pub writes: &'a [WriteOp],
    /// Bytes staged for `STORE` operations.
    pub write_data: &'a [u8],
}

/// Why an engine could not finish a step. Each ends the message with an error reply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StepFault {
    /// The handler called the abort helper.
    #[error("handler aborted with code {code}")]
    Aborted {
        /// The abort code (the reply carries its low 32 bits).
        code: u64,
    },
    /// The invocation does not fit the ABI (the request's fault, not the handler's).
    #[error("{0}")]
    BadInput(String),
    /// The engine stopped the handler (memory fault, budget, bad output, ...).
    #[error("{0}")]
    Fault(String),
}

/// An eBPF engine as the step machine's drivers use it: one step of `program` over an
/// invocation. naam-vm's `Vm` implements it; tests implement it with scripted steps.
pub trait Engine {
    /// What the engine runs (naam-vm's `Executable`).
    type Program: ?Sized;

    /// Runs one step of `program`.
    fn run_step(
        &mut self,
        program: &Self::Program,
        inv: &Invocation<'_>,
    ) -> Result<StepResult<'_>, StepFault>;

    /// The write operations and staged bytes of the step run last (what its
    /// [`StepResult::writes`] and [`StepResult::write_data`] were), still in the engine: the
    /// write owner applies them from there ([`crate::step::StepMachine::writes`]).
    fn queued_writes(&self) -> (&[WriteOp], &[u8]);
}
