//! Executables and the per-thread VM that runs them.
//!
//! An [`Executable`] is a verified, analysed program bound to one engine:
//! - [`EngineKind::Jit`] (the default): native code from [`crate::jit`], memory-checked;
//! - [`EngineKind::Interp`]: the reference interpreter ([`crate::interp`]).
//!
//! Both run any verified handler, trusted or not, with the same results, the same faults and
//! the same instruction counts. A [`Vm`] is the per-thread state both engines run against: the
//! [`Context`] buffer, the eBPF stack and the [`VmCtx`] (grants, helpers, budget, fault,
//! trace), all reused across invocations. One handler step is [`Vm::run`]; a raw run over a
//! memory buffer (the conformance suite's convention) is [`Vm::run_raw`]. With the `testing`
//! feature, the same step as plain bytes for an engine in another process (`Image`,
//! `Vm::image_step`) and the aarch64 cross-check of sampled steps are in `image`.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use naam_ebpf::abi::{
    Context, Descriptor, Return, WriteOp, ABI_VERSION, ARGS_CAP, CONTEXT_INPUT_SIZE, CONTEXT_SIZE,
    MAX_NEXT, MAX_SEGMENTS, MAX_WRITES, REPLY_CAP, STATE_WORDS, WRITE_DATA_CAP,
};

use crate::analysis::{analyze, EntryAssumptions, Facts};
use crate::helpers::HelperSet;
use crate::interp::{self, InterpCode};
use crate::jit::{self, HostCode, JitError, Target};
use crate::loader::Program;
use crate::memory::{fault, slot, FaultRecord, GrantSlot, VmCtx, MAX_CALL_DEPTH, STACK_BYTES};
use crate::verifier::{check, Checked, Verdict, VerifierConfig, Violation};

/// Default instruction budget per step: about a millisecond of interpreted work, and far more
/// than any MICA or B-tree step needs (a few hundred instructions).
pub const DEFAULT_BUDGET: u64 = 1 << 20;

/// The largest budget a configuration may ask for: about a second of interpreted work, the
/// most one step may hold an executor (and every other tenant queued behind it).
pub const MAX_BUDGET: u64 = 1 << 30;

use naam_proto::EngineKind;

mod cache;
#[cfg(feature = "testing")]
mod image;
mod tiers;

pub use cache::{
    code_key, open_entry, seal_entry, CacheStats, CodeCache, CodeKey, CodeStore, CODEGEN_VERSION,
    MAX_ENTRY_CODE,
};
#[cfg(feature = "testing")]
pub use image::{Fixup, Image, ImageRegion};
pub use tiers::lowest_priority;
use tiers::TierUp;

/// What `r1` points at when an executable starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Entry {
    /// A NAAM handler step: the [`Context`] ([`Vm::run`]).
    #[default]
    Context,
    /// A raw run: caller-provided memory, with its length in `r2` ([`Vm::run_raw`]).
    Memory,
}

impl Entry {
    /// What the analysis may assume of the entry memory.
    pub fn assumptions(self) -> EntryAssumptions {
        match self {
            Entry::Context => EntryAssumptions::handler_context(),
            Entry::Memory => EntryAssumptions::raw_memory(),
        }
    }
}

/// How to build an executable.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ExecOptions {
    /// Interpreter or memory-checked JIT (the default); both give the same results and faults.
    pub engine: EngineKind,
    /// Instructions per invocation before it faults with `budget exhausted`.
    pub budget: u64,
    /// Verifier settings (instruction cap, helper whitelist).
    pub verifier: VerifierConfig,
    /// The helpers the program calls.
    pub helpers: HelperSet,
    /// What `r1` points at.
    pub entry: Entry,
    /// Where compiled code is shared and kept ([`CodeCache::process`] unless set).
    pub code_cache: std::sync::Arc<CodeCache>,
}

impl ExecOptions {
    /// `engine` with an instruction budget of `budget`, the default verifier settings, NAAM's
    /// helpers and the message context as `r1`.
    pub fn new(engine: EngineKind, budget: u64) -> ExecOptions {
        ExecOptions {
            engine,
            budget,
            ..ExecOptions::default()
        }
    }
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            engine: EngineKind::Jit,
            budget: DEFAULT_BUDGET,
            verifier: VerifierConfig::default(),
            helpers: HelperSet::Naam,
            entry: Entry::Context,
            code_cache: CodeCache::process(),
        }
    }
}

impl ExecOptions {
    /// Defaults with another engine.
    pub fn engine(engine: EngineKind) -> Self {
        ExecOptions {
            engine,
            ..ExecOptions::default()
        }
    }

    /// The conformance suite's setup: raw memory and its one helper.
    pub fn conformance(engine: EngineKind) -> Self {
        ExecOptions {
            engine,
            verifier: VerifierConfig::for_helpers(HelperSet::Conformance),
            helpers: HelperSet::Conformance,
            entry: Entry::Memory,
            ..ExecOptions::default()
        }
    }
}

/// Why an executable could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The verifier rejected the program.
    #[error("handler `{name}` rejected by the verifier: {violation}")]
    Rejected {
        /// [`Program::name`]: the handler's section name without `naam/`.
        name: String,
        /// The rule broken, with the slot and the reason.
        violation: Violation,
    },
    /// The JIT could not compile it.
    #[error("the jit cannot compile `{name}`: {source}")]
    Jit {
        /// [`Program::name`]: the handler's section name without `naam/`.
        name: String,
        /// The compiler's error. The target ISA is set up once per process, so an ISA error
        /// repeats for every handler.
        source: JitError,
    },
}

/// Why an invocation stopped abnormally. Both engines report identical values for the same
/// program and input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VmError {
    /// A load, store or atomic operation outside the memory the invocation may use.
    #[error(
        "insn {pc}: {kind} of {len} bytes at {addr:#x} {}",
        out_of_bounds_reason(kind)
    )]
    OutOfBounds {
        /// Slot index of the faulting instruction.
        pc: usize,
        /// "load", "store" or "atomic".
        kind: &'static str,
        /// First byte the access would touch (base register plus offset).
        addr: u64,
        /// Access size in bytes: 1, 2, 4 or 8.
        len: u64,
    },
    /// An atomic operation at an address that is not a multiple of its size.
    #[error("insn {pc}: atomic operation of {len} bytes at misaligned address {addr:#x}")]
    Misaligned {
        /// Slot index of the atomic instruction.
        pc: usize,
        /// The address the atomic targeted (base register plus offset): not a multiple of `len`.
        addr: u64,
        /// Bytes the atomic operates on: 4 or 8.
        len: u64,
    },
    /// The handler called the abort helper (a panic, or an explicit abort).
    #[error("handler aborted with code {code}{}", if *.code == naam_ebpf::abi::abort_code::PANIC { " (panic)" } else { "" })]
    Aborted {
        /// The code the handler passed to abort (`abort_code::PANIC` for a panic).
        code: u64,
    },
    /// The instruction budget ran out.
    #[error("budget exhausted: the step ran more than {limit} instructions (a loop that does not end, or a budget too small for the app)")]
    Budget {
        /// The instruction budget per invocation ([`Executable::budget`]).
        limit: u64,
    },
    /// Local calls nested deeper than the stack has frames.
    #[error("insn {pc}: calls nested deeper than {MAX_CALL_DEPTH} frames")]
    CallDepth {
        /// Slot index of the call that would nest too deep.
        pc: usize,
    },
    /// A call to a helper id nobody implements.
    #[error("insn {pc}: unknown helper {id}")]
    UnknownHelper {
        /// Slot index of the call.
        pc: usize,
        /// The helper id called (static, or read from `callx`'s register).
        id: u64,
    },
    /// The engine itself failed (an aarch64 run could not start, for example).
    #[error("engine failure: {0}")]
    Engine(String),
}

fn out_of_bounds_reason(kind: &str) -> &'static str {
    match kind {
        "load" => "is outside every grant of the step (context, stack, segments, read-only data)",
        "store" => "is outside the step's writable memory (context, stack, segments granted with the write right)",
        _ => "is refused: atomics need writable memory (the stack, the context, segments granted with the write right), and no such grant covers it",
    }
}

impl VmError {
    /// The error a fault record describes (`None` when there is no fault).
    pub fn from_record(r: &FaultRecord, budget: u64) -> Option<VmError> {
        let pc = r.pc as usize;
        Some(match r.kind {
            fault::NONE => return None,
            fault::LOAD | fault::STORE | fault::ATOMIC => VmError::OutOfBounds {
                pc,
                kind: match r.kind {
                    fault::LOAD => "load",
                    fault::STORE => "store",
                    _ => "atomic",
                },
                addr: r.addr,
                len: r.len,
            },
            fault::MISALIGNED => VmError::Misaligned {
                pc,
                addr: r.addr,
                len: r.len,
            },
            fault::BUDGET => VmError::Budget { limit: budget },
            fault::CALL_DEPTH => VmError::CallDepth { pc },
            fault::UNKNOWN_HELPER => VmError::UnknownHelper { pc, id: r.addr },
            fault::ABORT => VmError::Aborted { code: r.addr },
            other => VmError::Engine(format!("unknown fault kind {other}")),
        })
    }

    /// A short kind name, for reports and differential comparisons.
    pub fn kind(&self) -> &'static str {
        match self {
            VmError::OutOfBounds { .. } => "out-of-bounds",
            VmError::Misaligned { .. } => "misaligned",
            VmError::Aborted { .. } => "aborted",
            VmError::Budget { .. } => "budget",
            VmError::CallDepth { .. } => "call-depth",
            VmError::UnknownHelper { .. } => "unknown-helper",
            VmError::Engine(_) => "engine",
        }
    }
}

enum Code {
    Interp(InterpCode),
    Jit(std::sync::Arc<HostCode>),
    Tiered(std::sync::Arc<TierUp>),
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// What executables of one program share: the program (its read-only data, which their
/// grants point into), the verifier's structure and the analysis. Shared through the
/// [`CodeCache`] only once the new build has verified and analysed the program itself: a
/// program is never trusted for having been seen before.
pub(crate) struct Prepared {
    pub(crate) checked: Checked,
    pub(crate) facts: Facts,
    pub(crate) program: Program,
}

/// Why [`Executable::prepare`] failed.
enum PrepareError {
    /// The verifier refused the program.
    Rejected(Violation),
    /// The program's code key could not be made.
    Key(crate::jit::JitError),
}

/// A verified handler bound to an engine.
pub struct Executable {
    id: u64,
    name: String,
    engine: EngineKind,
    /// The verified program and its analysis, shared by every executable of the same program
    /// (a thousand instances of one app hold one copy, not a thousand: 31–49 KB each for
    /// MICA's handlers).
    prepared: std::sync::Arc<Prepared>,
    options: ExecOptions,
    helper_table: Box<[u64; crate::memory::HELPER_SLOTS]>,
    rodata: Vec<GrantSlot>,
    code: Code,
    compile_time: Duration,
}

impl fmt::Debug for Executable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executable")
            .field("name", &self.name)
            .field("engine", &self.engine)
            .field("insns", &self.prepared.checked.verdict.insns)
            .finish()
    }
}

impl Executable {
    /// Verifies `program` as a handler and prepares it for `engine` with the default budget.
    pub fn new(
        program: &Program,
        engine: EngineKind,
        config: &VerifierConfig,
    ) -> Result<Executable, EngineError> {
        Executable::build(
            program,
            &ExecOptions {
                engine,
                verifier: config.clone(),
                ..ExecOptions::default()
            },
        )
    }

    /// Verifies, analyses and compiles `program`. When another live executable on the same
    /// code cache holds the same program verified and analysed under the same settings (its
    /// [`cache::prepared_key`] covers every input of the verdict and the analysis), its
    /// verdict and analysis are taken instead of being made again: 10,000 instances of one
    /// app verify each handler once.
    pub fn build(program: &Program, options: &ExecOptions) -> Result<Executable, EngineError> {
        let started = Instant::now();
        // A tiered handler serves on the interpreter as soon as it is verified: the analysis
        // (most of a build's time) runs in the background with the compile, and until then
        // every access scans the grants.
        let analysed = options.engine != EngineKind::Tiered;
        let jit_err = |source| EngineError::Jit {
            name: program.name.clone(),
            source,
        };
        let known = code_key(program, options).ok().and_then(|key| {
            let prepared = options
                .code_cache
                .live_prepared(&cache::prepared_key(&key, program, options, analysed))?;
            Some((key, prepared))
        });
        let (key, prepared) = match known {
            Some(known) => known,
            None => Executable::prepare(program, options, analysed).map_err(|e| match e {
                PrepareError::Rejected(violation) => EngineError::Rejected {
                    name: program.name.clone(),
                    violation,
                },
                PrepareError::Key(source) => jit_err(source),
            })?,
        };
        let (checked, facts) = (&prepared.checked, &prepared.facts);
        let code = match options.engine {
            EngineKind::Interp => Code::Interp(InterpCode::new(checked, facts)),
            EngineKind::Jit => Code::Jit(
                options
                    .code_cache
                    .host_code(&key, &prepared)
                    .map_err(jit_err)?,
            ),
            EngineKind::Tiered => {
                let (entry, helpers) = (options.entry.assumptions(), options.helpers);
                let analysed_key = cache::prepared_key(&key, program, options, true);
                let cache = options.code_cache.clone();
                let unanalysed = prepared.clone();
                let analyse = Box::new(move || {
                    let p = &unanalysed;
                    let facts = analyze(&p.checked, &p.program, &entry, helpers);
                    cache.share_prepared(
                        analysed_key,
                        Prepared {
                            checked: p.checked.clone(),
                            facts,
                            program: p.program.clone(),
                        },
                    )
                });
                Code::Tiered(TierUp::start(
                    key,
                    InterpCode::new(checked, facts),
                    analyse,
                    &options.code_cache,
                    started,
                ))
            }
        };
        // The grants point into the shared program's read-only data, which lives as long as
        // this executable holds it.
        let rodata = prepared
            .program
            .rodata
            .iter()
            .map(|r| GrantSlot::new(r.addr(), r.len() as u64, false))
            .collect();
        Ok(Executable {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name: program.name.clone(),
            engine: options.engine,
            prepared,
            helper_table: Box::new(options.helpers.table(&options.verifier.helpers)),
            rodata,
            options: options.clone(),
            code,
            compile_time: started.elapsed(),
        })
    }

    /// Verifies and (if `analysed`) analyses `program`, then shares the result on the code
    /// cache under its key.
    fn prepare(
        program: &Program,
        options: &ExecOptions,
        analysed: bool,
    ) -> Result<(CodeKey, std::sync::Arc<Prepared>), PrepareError> {
        let checked = check(program, &options.verifier).map_err(PrepareError::Rejected)?;
        let facts = if analysed {
            analyze(
                &checked,
                program,
                &options.entry.assumptions(),
                options.helpers,
            )
        } else {
            Facts::unanalysed(&checked, options.helpers)
        };
        let key = code_key(program, options).map_err(PrepareError::Key)?;
        let prepared = options.code_cache.share_prepared(
            cache::prepared_key(&key, program, options, analysed),
            Prepared {
                checked,
                facts,
                program: program.clone(),
            },
        );
        Ok((key, prepared))
    }

    /// Handler name: its section name without `naam/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The engine that runs it.
    pub fn engine(&self) -> EngineKind {
        self.engine
    }

    /// The verifier's summary of the program (size, functions, helpers, loops).
    pub fn verdict(&self) -> &Verdict {
        &self.prepared.checked.verdict
    }

    /// Compiles the same verified program for `target` (aarch64 code for the harness, or host
    /// code to inspect), whatever engine this executable runs on.
    pub fn compile_for(&self, target: Target) -> Result<jit::Compiled, EngineError> {
        let p = self.analysed();
        jit::compile(&p.checked, &p.program, &p.facts, target).map_err(|source| EngineError::Jit {
            name: self.name.clone(),
            source,
        })
    }

    /// The analysis: how many accesses were proven, hinted or left to a scan. A tiered
    /// handler's is the background analysis' once done; until then every access scans.
    pub fn facts(&self) -> &Facts {
        &self.analysed().facts
    }

    /// The preparation with the program's analysis: a tiered handler's from the background
    /// once done, else the one it was built with.
    fn analysed(&self) -> &Prepared {
        match &self.code {
            Code::Tiered(t) => t.analysed().unwrap_or(&self.prepared),
            _ => &self.prepared,
        }
    }

    /// The linked program.
    pub fn program(&self) -> &Program {
        &self.prepared.program
    }

    /// The instruction budget per invocation.
    pub fn budget(&self) -> u64 {
        self.options.budget
    }

    /// The options it was built with.
    pub fn options(&self) -> &ExecOptions {
        &self.options
    }

    /// Verification, analysis and compilation time (for a tiered handler, until the
    /// interpreter could serve it).
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// The engine its next step runs on: the configured one, or for a tiered handler the
    /// interpreter until its JIT code is ready, then the JIT.
    pub fn running_engine(&self) -> EngineKind {
        match &self.code {
            Code::Interp(_) => EngineKind::Interp,
            Code::Jit(_) => EngineKind::Jit,
            Code::Tiered(t) if t.jit().is_some() => EngineKind::Jit,
            Code::Tiered(_) => EngineKind::Interp,
        }
    }

    /// For a tiered handler, the time from the start of its build to its JIT code being
    /// ready (`None`: not yet, or not tiered).
    pub fn jit_ready_after(&self) -> Option<Duration> {
        match &self.code {
            Code::Tiered(t) => t.ready_after(),
            _ => None,
        }
    }

    /// For a tiered handler whose background compilation failed, why (it stays on the
    /// interpreter, which runs every verified handler).
    pub fn jit_failure(&self) -> Option<&str> {
        match &self.code {
            Code::Tiered(t) => t.failure(),
            _ => None,
        }
    }

    /// Waits up to `timeout` for a tiered handler's JIT code; whether it is ready (true at
    /// once for the other engines' handlers, which never switch).
    pub fn wait_for_jit(&self, timeout: Duration) -> bool {
        match &self.code {
            Code::Tiered(t) => t.wait(timeout),
            _ => true,
        }
    }
}

use naam_proto::step::{Grant, Invocation};

/// The engine's grant for `g`: read and write rights as the descriptor asked (atomics need the
/// write right). Inlined (into the drivers, where the step is inlined): returned through the
/// stack, its 96 bytes were reloaded right after being stored, a store-forwarding stall that
/// took half of a step's engine time.
#[inline]
fn grant_slot(g: &Grant<'_>) -> GrantSlot {
    let (readable, writable) = rights(g);
    GrantSlot::with_rights(g.addr(), g.len() as u64, readable, writable)
}

/// Whether `slot` is what [`grant_slot`] makes of `g`.
#[inline(always)]
fn same_grant(slot: &GrantSlot, g: &Grant<'_>) -> bool {
    let (readable, writable) = rights(g);
    slot.grants(g.addr(), g.len() as u64, readable, writable)
}

/// The slot rights of `g`: loads with the read right, stores with the write right (atomics
/// need it too).
#[inline(always)]
fn rights(g: &Grant<'_>) -> (bool, bool) {
    (
        g.access() & naam_ebpf::abi::ACCESS_READ != 0,
        g.access() & naam_ebpf::abi::ACCESS_WRITE != 0,
    )
}

/// Why a step failed before, during or after the handler ran.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The invocation does not fit the ABI.
    #[error("invalid invocation: {0}")]
    BadInput(String),
    /// The engine stopped the handler.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The handler left output fields the ABI does not allow.
    #[error("handler output is invalid: {0}")]
    BadOutput(String),
}

/// What one step produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepOutput {
    /// r0 as the handler left it at `exit`, before decoding.
    pub return_code: u64,
    /// Decoded r0, if it is a valid [`Return`].
    pub ret: Option<Return>,
    /// Instructions executed (both engines count identically).
    pub insns: Option<u64>,
    /// Values traced by the handler.
    pub trace: Vec<u64>,
}

/// What a raw run produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawOutput {
    /// r0 at the entry function's `exit`.
    pub r0: u64,
    /// Instructions executed (both engines count identically).
    pub insns: u64,
}

/// Per-thread execution state, reused across invocations.
pub struct Vm {
    vmctx: Box<VmCtx>,
    ctx: Box<Context>,
    last_app: Option<u32>,
    installed: u64,
    /// Segment grant slots the last step filled.
    segments_installed: usize,
    /// Entries of the context's segment table that may be non-zero: everything past a step's
    /// own segments must be zero, since the analysis trusts the table.
    ctx_segments_used: usize,
    /// The entry grant currently covers the context (not a raw run's memory).
    entry_is_context: bool,
    /// The message whose step ran last ended it normally, leaving its args, state words and
    /// reply in the context: `(app, request id, step)`. Cleared by anything else that runs.
    resident: Option<(u32, u64, u32)>,
    /// The message whose step [`Vm::begin_steps`] installed: `(app, request id)`.
    begun: Option<(u32, u64)>,
    /// The last run's instruction classes, when the interpreter ran it.
    mix: Option<naam_proto::step::InsnMix>,
}

impl Default for Vm {
    fn default() -> Self {
        Vm::new()
    }
}

impl Vm {
    /// A VM with a zeroed stack and a fresh context, bound to no app yet.
    pub fn new() -> Vm {
        let mut vm = Vm {
            vmctx: Box::default(),
            ctx: Box::new(Context::new()),
            last_app: None,
            installed: 0,
            segments_installed: 0,
            ctx_segments_used: 0,
            entry_is_context: false,
            resident: None,
            begun: None,
            mix: None,
        };
        let stack_base = vm.vmctx.stack.as_ptr() as u64;
        vm.vmctx.grants[slot::STACK] = GrantSlot::new(stack_base, STACK_BYTES as u64, true);
        vm.vmctx.stack_limit = stack_base;
        vm
    }

    #[inline]
    fn stack_top(&self) -> u64 {
        self.vmctx.stack.as_ptr() as u64 + STACK_BYTES as u64
    }

    /// The context as the last step left it.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Makes `exe`'s helpers, read-only data and budget current.
    #[inline]
    fn install(&mut self, exe: &Executable) {
        if self.installed != exe.id {
            self.install_new(exe);
        }
    }

    #[cold]
    fn install_new(&mut self, exe: &Executable) {
        self.installed = exe.id;
        let v = &mut *self.vmctx;
        v.helpers = *exe.helper_table;
        // Fuel (budget minus executed) must stay a signed 64-bit value.
        v.budget = exe.options.budget.min(i64::MAX as u64 / 2);
        for k in 0..slot::MAX_RODATA {
            v.grants[slot::RODATA + k] = exe.rodata.get(k).copied().unwrap_or(GrantSlot::EMPTY);
        }
    }

    /// Why `inv` does not fit the ABI (the slow path of [`Vm::prepare`]'s one test).
    #[cold]
    fn bad_invocation(inv: &Invocation<'_>) -> StepError {
        StepError::BadInput(if inv.args.len() > ARGS_CAP {
            format!(
                "{} bytes of args exceed the {ARGS_CAP}-byte capacity",
                inv.args.len()
            )
        } else if inv.segments.len() > MAX_SEGMENTS {
            format!(
                "{} segments exceed the maximum of {MAX_SEGMENTS}",
                inv.segments.len()
            )
        } else if inv.reply.len() > REPLY_CAP {
            "reply exceeds its capacity".into()
        } else {
            let len = inv.segments.iter().map(|g| g.len()).max().unwrap_or(0);
            format!("segment of {len} bytes is too large")
        })
    }

    /// A different tenant must not see what the previous one left in the context or on the
    /// stack.
    #[cold]
    fn switch_tenant(&mut self, app: u32) {
        *self.ctx = Context::new();
        self.vmctx.stack.fill(0);
        self.last_app = Some(app);
    }

    // Forced (through `set_up_step`, used by both `step` and `begin_steps`): out of line, its
    // call cost more than the two inlined copies.
    #[inline(always)]
    fn prepare(&mut self, inv: &Invocation<'_>) -> Result<(), StepError> {
        if inv.args.len() > ARGS_CAP
            || inv.segments.len() > MAX_SEGMENTS
            || inv.reply.len() > REPLY_CAP
            || inv.segments.iter().any(|g| g.len() > u32::MAX as usize)
        {
            return Err(Self::bad_invocation(inv));
        }
        if self.last_app != Some(inv.app) {
            self.switch_tenant(inv.app);
        }
        // The previous step of this very message ran last and ended normally: its args,
        // state and reply are in place (the args in the read-only part, which no handler
        // writes), so only what changes per step is written. Checked here, not trusted.
        let resident = inv.resident
            && inv.step > 0
            && self.resident == Some((inv.app, inv.request_id, inv.step - 1))
            && self.ctx.args_len as usize == inv.args.len()
            && self.ctx.reply_len as usize == inv.reply.len();
        self.resident = None;
        self.begun = None;
        let c = &mut *self.ctx;
        c.abi_version = ABI_VERSION;
        c.step = inv.step;
        c.app = inv.app;
        c.placement = inv.placement;
        c.request_id = inv.request_id;
        if !resident {
            c.args_len = inv.args.len() as u32;
            copy_args(c, inv.args);
            c.state = inv.state;
        }
        if !resident {
            c.reply_len = inv.reply.len() as u32;
            if !inv.reply.is_empty() {
                c.reply[..inv.reply.len()].copy_from_slice(inv.reply);
            }
        }
        c.next_count = 0;
        c.write_count = 0;
        c.write_data_len = 0;

        if !self.entry_is_context {
            self.grant_context();
        }
        self.install_segments(inv.segments);
        Ok(())
    }

    /// Puts `segments` (at most [`MAX_SEGMENTS`], each under 4 GiB: checked by the callers)
    /// in the context's segment table and in their grant slots, and empties the entries and
    /// slots an earlier step used past them: no stale addresses (the analysis trusts the
    /// table, and their grants are gone).
    #[inline(always)]
    fn install_segments(&mut self, segments: &[Grant<'_>]) {
        let c = &mut *self.ctx;
        c.segment_count = segments.len() as u32;
        for (slot, g) in c.segments.iter_mut().zip(segments) {
            *slot = naam_ebpf::Segment {
                addr: g.addr(),
                len: g.len() as u32,
                access: g.access(),
            };
        }
        let used = self.ctx_segments_used.max(segments.len());
        for slot in &mut c.segments[segments.len()..used] {
            *slot = naam_ebpf::Segment::default();
        }
        self.ctx_segments_used = segments.len();
        let v = &mut *self.vmctx;
        for (i, g) in segments.iter().enumerate() {
            let installed = &mut v.grants[slot::SEGMENT + i];
            // The grant the step before had here (a write's meta and bucket, a B-tree's
            // meta, step after step): already in place, nothing to compute or store.
            if i < self.segments_installed && same_grant(installed, g) {
                continue;
            }
            *installed = grant_slot(g);
        }
        for i in segments.len()..self.segments_installed {
            v.grants[slot::SEGMENT + i] = GrantSlot::EMPTY;
        }
        self.segments_installed = segments.len();
    }

    /// Grants the context: inputs read-only, outputs writable (a handler cannot forge its
    /// segment table).
    #[cold]
    fn grant_context(&mut self) {
        let ctx_addr = &mut *self.ctx as *mut Context as u64;
        let v = &mut *self.vmctx;
        v.grants[slot::ENTRY] = GrantSlot::new(ctx_addr, CONTEXT_INPUT_SIZE as u64, false);
        v.grants[slot::ENTRY_OUT] = GrantSlot::new(
            ctx_addr + CONTEXT_INPUT_SIZE as u64,
            (CONTEXT_SIZE - CONTEXT_INPUT_SIZE) as u64,
            true,
        );
        self.entry_is_context = true;
    }

    /// Runs the engine with `r1`, `r2`; returns r0 or the fault.
    #[inline]
    fn execute(&mut self, exe: &Executable, r1: u64, r2: u64) -> Result<u64, VmError> {
        self.vmctx.reset_run();
        let r0 = match &exe.code {
            Code::Interp(code) => self.interpret(code, r1, r2),
            Code::Jit(code) => self.run_native(code, r1, r2),
            // One acquire load decides: the JIT's code once the background thread published
            // it, the interpreter before.
            Code::Tiered(t) => match t.jit() {
                Some(code) => self.run_native(code, r1, r2),
                None => self.interpret(t.interp(), r1, r2),
            },
        };
        match r0 {
            Some(r0) => Ok(r0),
            None => Err(self.fault(exe)),
        }
    }

    #[inline(always)]
    fn interpret(&mut self, code: &InterpCode, r1: u64, r2: u64) -> Option<u64> {
        let fp = self.stack_top();
        let mix = self.mix.insert(naam_proto::step::InsnMix::default());
        interp::run(code, &mut self.vmctx, mix, (r1, r2, fp))
    }

    #[inline(always)]
    fn run_native(&mut self, code: &HostCode, r1: u64, r2: u64) -> Option<u64> {
        self.mix = None;
        // Compiled code finds the stack in the context itself.
        let r0 = (code.entry())(&mut *self.vmctx as *mut VmCtx, r1, r2);
        (self.vmctx.fault.kind == fault::NONE).then_some(r0)
    }

    #[cold]
    fn fault(&self, exe: &Executable) -> VmError {
        VmError::from_record(&self.vmctx.fault, exe.options.budget)
            .unwrap_or_else(|| VmError::Engine("stopped without a fault record".into()))
    }

    /// Runs one step of the handler `exe` over `inv`.
    pub fn run(&mut self, exe: &Executable, inv: &Invocation<'_>) -> Result<StepOutput, StepError> {
        self.run_step(exe, inv)
    }

    /// One step: r0, with the outputs left in the context (checked against their
    /// capacities). A step that ends normally leaves its message resident for the next.
    #[inline]
    fn step(&mut self, exe: &Executable, inv: &Invocation<'_>) -> Result<u64, StepError> {
        self.set_up_step(exe, inv)?;
        let ctx_addr = &mut *self.ctx as *mut Context as u64;
        let r0 = self.execute(exe, ctx_addr, CONTEXT_SIZE as u64)?;
        self.check_output()?;
        self.resident = Some((inv.app, inv.request_id, inv.step));
        Ok(r0)
    }

    /// Everything before a handler step runs: `exe` is a handler, `inv` fits the ABI and is
    /// in the context and its grants, `exe`'s helpers, budget and read-only data installed.
    #[inline(always)]
    fn set_up_step(&mut self, exe: &Executable, inv: &Invocation<'_>) -> Result<(), StepError> {
        expect_entry(exe, Entry::Context)?;
        self.prepare(inv)?;
        self.install(exe);
        Ok(())
    }

    /// The first half of a run of steps in one entry ([`Vm::run_steps`]): checks and
    /// installs the step of `inv` (its args, state and segments, as [`Vm::run`] would) but
    /// runs nothing, so the caller's borrows behind `inv` (its data path's grants) end
    /// before the steps run. Always `true`: a VM runs steps in one entry
    /// ([`HandlerEngine::begin_steps`]).
    #[inline(always)]
    pub fn begin_steps(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<bool, naam_proto::step::StepFault> {
        self.set_up_step(exe, inv).map_err(step_fault)?;
        self.begun = Some((inv.app, inv.request_id));
        Ok(true)
    }

    /// Runs the step [`Vm::begin_steps`] installed and, each time a step returns `Continue`
    /// and `next` hands over the segments of the step after it, that step too, in the same
    /// entry: no driver, machine or data path call between steps but `next`'s, and the args,
    /// state words and reply stay in place. Each step has its own instruction budget and is
    /// checked as one run alone is. Returns the result of the last step run (one `next` has
    /// not taken).
    #[inline(always)]
    pub fn run_steps(
        &mut self,
        exe: &Executable,
        next: &mut dyn NextStep,
    ) -> Result<naam_proto::step::StepResult<'_>, naam_proto::step::StepFault> {
        let Some((app, request_id)) = self.begun.take() else {
            return Err(naam_proto::step::StepFault::BadInput(
                "run_steps without begin_steps".into(),
            ));
        };
        let ctx_addr = &mut *self.ctx as *mut Context as u64;
        loop {
            let r0 = self
                .execute(exe, ctx_addr, CONTEXT_SIZE as u64)
                .map_err(|e| step_fault(e.into()))?;
            self.check_output().map_err(step_fault)?;
            if Return::decode(r0) == Some(Return::Continue) {
                if let Some(segments) = next.next(self.step_result(r0)) {
                    if segments.len() > MAX_SEGMENTS
                        || segments.iter().any(|g| g.len() > u32::MAX as usize)
                    {
                        return Err(naam_proto::step::StepFault::BadInput(format!(
                            "{} segments handed over for the next step (at most {MAX_SEGMENTS}, \
                             each under 4 GiB)",
                            segments.len()
                        )));
                    }
                    self.install_segments(segments);
                    let c = &mut *self.ctx;
                    c.step = c.step.wrapping_add(1);
                    c.next_count = 0;
                    c.write_count = 0;
                    c.write_data_len = 0;
                    continue;
                }
            }
            self.resident = Some((app, request_id, self.ctx.step));
            return Ok(self.step_result(r0));
        }
    }

    /// The step machine's view of the step that ended with `r0`: its outputs borrowed from
    /// the context.
    #[inline(always)]
    pub(crate) fn step_result(&self, r0: u64) -> naam_proto::step::StepResult<'_> {
        let c = &*self.ctx;
        naam_proto::step::StepResult {
            return_code: r0,
            ret: Return::decode(r0),
            insns: Some(self.vmctx.executed),
            mix: self.mix,
            reply: &c.reply[..c.reply_len as usize],
            state: &c.state,
            next: &c.next[..c.next_count as usize],
            writes: &c.writes[..c.write_count as usize],
            write_data: &c.write_data[..c.write_data_len as usize],
        }
    }

    fn run_step(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<StepOutput, StepError> {
        let r0 = self.step(exe, inv)?;
        Ok(StepOutput {
            return_code: r0,
            ret: Return::decode(r0),
            insns: Some(self.vmctx.executed),
            trace: if self.vmctx.trace_len == 0 {
                Vec::new()
            } else {
                self.trace().to_vec()
            },
        })
    }

    /// Runs `exe` over raw memory: `r1` = `memory`'s address (writable), `r2` = its length.
    pub fn run_raw(&mut self, exe: &Executable, memory: &mut [u8]) -> Result<RawOutput, StepError> {
        expect_entry(exe, Entry::Memory)?;
        self.install(exe);
        self.last_app = None;
        self.resident = None;
        self.begun = None;
        for i in 0..self.segments_installed {
            self.vmctx.grants[slot::SEGMENT + i] = GrantSlot::EMPTY;
        }
        self.segments_installed = 0;
        let addr = memory.as_mut_ptr() as u64;
        self.entry_is_context = false;
        self.vmctx.grants[slot::ENTRY] = GrantSlot::new(addr, memory.len() as u64, true);
        self.vmctx.grants[slot::ENTRY_OUT] = GrantSlot::EMPTY;
        let result = self.execute(exe, addr, memory.len() as u64);
        // The buffer is only borrowed for this call.
        self.vmctx.grants[slot::ENTRY] = GrantSlot::EMPTY;
        let r0 = result?;
        Ok(RawOutput {
            r0,
            insns: self.vmctx.executed,
        })
    }

    /// The eBPF stack as the last run left it.
    pub fn stack_bytes(&self) -> Vec<u8> {
        self.vmctx
            .stack
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .collect()
    }

    /// Zeroes the eBPF stack (differential tests start both engines from the same bytes).
    pub fn clear_stack(&mut self) {
        self.vmctx.stack.fill(0);
    }

    #[inline]
    fn check_output(&self) -> Result<(), StepError> {
        let c = &*self.ctx;
        // Four separate loads and branches (all predictable), not `|`: LLVM merged those
        // into one 16-byte load of the four counts the handler had just stored one by one,
        // and that load stalled on store forwarding (a quarter of the step's engine time).
        if c.reply_len as usize > REPLY_CAP
            || c.next_count as usize > MAX_NEXT
            || c.write_count as usize > MAX_WRITES
            || c.write_data_len as usize > WRITE_DATA_CAP
        {
            return Err(self.bad_output());
        }
        Ok(())
    }

    #[cold]
    fn bad_output(&self) -> StepError {
        let c = &*self.ctx;
        StepError::BadOutput(if c.reply_len as usize > REPLY_CAP {
            format!("reply_len {} exceeds {REPLY_CAP}", c.reply_len)
        } else if c.next_count as usize > MAX_NEXT {
            format!("next_count {} exceeds {MAX_NEXT}", c.next_count)
        } else if c.write_count as usize > MAX_WRITES {
            format!("write_count {} exceeds {MAX_WRITES}", c.write_count)
        } else {
            format!(
                "write_data_len {} exceeds {WRITE_DATA_CAP}",
                c.write_data_len
            )
        })
    }

    /// Values traced by the last run.
    pub fn trace(&self) -> &[u64] {
        &self.vmctx.trace[..(self.vmctx.trace_len as usize).min(self.vmctx.trace.len())]
    }

    /// Reply bytes after the last step.
    pub fn reply(&self) -> &[u8] {
        &self.ctx.reply[..(self.ctx.reply_len as usize).min(REPLY_CAP)]
    }

    /// Next-step descriptors after the last step.
    pub fn next(&self) -> &[Descriptor] {
        &self.ctx.next[..(self.ctx.next_count as usize).min(MAX_NEXT)]
    }

    /// Write operations after the last step.
    pub fn writes(&self) -> &[WriteOp] {
        &self.ctx.writes[..(self.ctx.write_count as usize).min(MAX_WRITES)]
    }

    /// Staged write bytes after the last step.
    pub fn write_data(&self) -> &[u8] {
        &self.ctx.write_data[..(self.ctx.write_data_len as usize).min(WRITE_DATA_CAP)]
    }

    /// State words after the last step.
    pub fn state(&self) -> [u64; STATE_WORDS] {
        self.ctx.state
    }
}

/// The step machine's view of the engine: a step's output borrowed from the context, and a
/// failure turned into the fault the machine replies with. No trace or output copy is made:
/// the machine reads what it needs in place.
impl naam_proto::step::Engine for Vm {
    type Program = Executable;

    // Inlined into the drivers (another crate): the step's result then stays in registers
    // rather than going through memory, where its reload stalled on store forwarding. Forced,
    // as the machine's `stepped`.
    #[inline(always)]
    fn run_step(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<naam_proto::step::StepResult<'_>, naam_proto::step::StepFault> {
        let r0 = self.step(exe, inv).map_err(step_fault)?;
        Ok(self.step_result(r0))
    }

    #[inline]
    fn queued_writes(&self) -> (&[WriteOp], &[u8]) {
        (self.writes(), self.write_data())
    }
}

/// What the drivers run handlers on: the step machine's [`naam_proto::step::Engine`], and
/// a run of steps in one entry. [`Vm`] is the one the runtime runs; a test wraps it to
/// observe or replay steps (naam-vm's `cross::CrossChecked`), and the drivers, generic over
/// this, run either unchanged.
pub trait HandlerEngine: naam_proto::step::Engine<Program = Executable> {
    /// Installs the step of `inv` without running it, for [`HandlerEngine::run_steps`];
    /// `false`: this engine runs every step alone ([`naam_proto::step::Engine::run_step`])
    /// and installed nothing.
    fn begin_steps(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<bool, naam_proto::step::StepFault>;

    /// Runs the step [`HandlerEngine::begin_steps`] installed, and those `next` hands over
    /// after it ([`Vm::run_steps`]).
    fn run_steps(
        &mut self,
        exe: &Executable,
        next: &mut dyn NextStep,
    ) -> Result<naam_proto::step::StepResult<'_>, naam_proto::step::StepFault>;
}

impl HandlerEngine for Vm {
    #[inline(always)]
    fn begin_steps(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<bool, naam_proto::step::StepFault> {
        Vm::begin_steps(self, exe, inv)
    }

    #[inline(always)]
    fn run_steps(
        &mut self,
        exe: &Executable,
        next: &mut dyn NextStep,
    ) -> Result<naam_proto::step::StepResult<'_>, naam_proto::step::StepFault> {
        Vm::run_steps(self, exe, next)
    }
}

/// A failed step as the step machine replies to it.
pub(crate) fn step_fault(e: StepError) -> naam_proto::step::StepFault {
    use naam_proto::step::StepFault;
    match e {
        StepError::Vm(VmError::Aborted { code }) => StepFault::Aborted { code },
        e @ StepError::BadInput(_) => StepFault::BadInput(e.to_string()),
        e => StepFault::Fault(e.to_string()),
    }
}

/// Between two steps of one entry into the engine ([`Vm::run_steps`]): the driver takes the
/// step that just returned `Continue` and, when it can fetch the next step's data at once,
/// hands over its segments, so the next step runs without leaving the engine.
pub trait NextStep {
    /// Takes `done` (a step that returned `Continue`, checked) for the driver's machine. The
    /// segments of the step after it, which then runs in the same entry; or `None`, and the
    /// entry ends with `done`, which the driver has then already taken.
    fn next(&mut self, done: naam_proto::step::StepResult<'_>) -> Option<&[Grant<'_>]>;
}

/// Refuses to run `exe` as the other kind of run than it was built for.
#[inline]
fn expect_entry(exe: &Executable, entry: Entry) -> Result<(), StepError> {
    if exe.options.entry == entry {
        return Ok(());
    }
    let (built, asked) = match entry {
        Entry::Context => ("raw memory runs", "handler steps"),
        Entry::Memory => ("handler steps", "raw memory runs"),
    };
    Err(StepError::BadInput(format!(
        "`{}` was built for {built}, not {asked}",
        exe.name
    )))
}

/// Time one step `repeat` times; returns (last output, mean nanoseconds per invocation).
pub fn time_runs(
    vm: &mut Vm,
    exe: &Executable,
    inv: &Invocation<'_>,
    repeat: u64,
) -> (Result<StepOutput, StepError>, f64) {
    let repeat = repeat.max(1);
    let start = Instant::now();
    let mut last = vm.run(exe, inv);
    for _ in 1..repeat {
        last = vm.run(exe, inv);
    }
    let ns = start.elapsed().as_nanos() as f64 / repeat as f64;
    (last, ns)
}

// `copy_args` stores whole aligned words into the context's args.
const _: () =
    assert!(std::mem::align_of::<Context>() >= 8 && std::mem::offset_of!(Context, args) % 8 == 0);

/// Bytes of a message's args copied in word stores ([`copy_args`]): the fixed fields handlers
/// read first (MICA's and the B-tree's headers, and their keys) lie in them.
const FORWARDED_ARGS: usize = 128;

/// Copies `args` (at most `ARGS_CAP` bytes) into the context's args, the first
/// [`FORWARDED_ARGS`] bytes in 8-byte stores. A handler's first loads read these bytes back,
/// 4 or 8 at a time: from memcpy's 64-byte vector stores the processor cannot forward them,
/// and each such load waited for the copy to reach the cache (the hottest instruction of a
/// direct MICA GET, 3.5% of its samples). Volatile, so the loop stays stores of words, not a
/// call to memcpy again.
#[inline]
fn copy_args(c: &mut Context, args: &[u8]) {
    let dst = &mut c.args[..args.len()];
    let words = args.len().min(FORWARDED_ARGS) / 8;
    let to = dst.as_mut_ptr().cast::<u64>();
    for (i, w) in args[..words * 8].chunks_exact(8).enumerate() {
        let word = u64::from_ne_bytes(w.try_into().expect("8 bytes"));
        // SAFETY: word `i` lies inside `dst` (`words * 8 <= dst.len()`), and is aligned: the
        // context is, and so is its args field (asserted above).
        unsafe { to.add(i).write_volatile(word) };
    }
    dst[words * 8..].copy_from_slice(&args[words * 8..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiled code takes the top of the context's own stack as its frame pointer; the
    /// interpreter is handed the same address, and the stack grant covers exactly that stack.
    #[test]
    fn the_frame_pointer_is_the_top_of_the_context_s_stack() {
        let vm = Vm::new();
        let state = &*vm.vmctx as *const VmCtx as u64;
        let grant = &vm.vmctx.grants[slot::STACK];
        assert_eq!(grant.start, state + crate::memory::layout::STACK as u64);
        assert_eq!(grant.len, STACK_BYTES as u64);
        assert_eq!(
            vm.stack_top(),
            state + crate::memory::layout::STACK_TOP as u64
        );
        assert_eq!(vm.vmctx.stack_limit, grant.start);
    }

    /// Args of every length up to past the word-copied part arrive byte for byte.
    #[test]
    fn args_copied_in_words_arrive_whole() {
        let src: Vec<u8> = (0..FORWARDED_ARGS as u32 + 40)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        for len in 0..src.len() {
            let mut ctx = Box::new(Context::new());
            copy_args(&mut ctx, &src[..len]);
            assert_eq!(&ctx.args[..len], &src[..len], "length {len}");
            assert!(ctx.args[len..].iter().all(|&b| b == 0), "length {len}");
        }
    }

    fn program(insns: &[crate::insn::Insn]) -> Program {
        Program::from_bytecode("t", crate::insn::encode_all(insns))
    }

    #[test]
    fn a_program_verified_under_the_same_settings_is_not_verified_again_and_others_are() {
        use crate::insn::Insn;
        use crate::opcode::*;
        let p = program(&[
            Insn::new(CLASS_ALU64 | ALU_MOV, 0, 0, 0, 7),
            Insn::new(CLASS_ALU64 | ALU_ADD, 0, 0, 0, 1),
            Insn::EXIT,
        ]);
        let cache = std::sync::Arc::new(CodeCache::in_memory());
        for engine in [EngineKind::Interp, EngineKind::Tiered, EngineKind::Jit] {
            let options = ExecOptions {
                code_cache: cache.clone(),
                ..ExecOptions::new(engine, DEFAULT_BUDGET)
            };
            let first = Executable::build(&p, &options).unwrap();
            let again = Executable::build(&p, &options).unwrap();
            // One verified program, shared: the second build took it.
            assert!(std::ptr::eq(first.program(), again.program()), "{engine:?}");
            // Settings the verdict depends on are part of the key: a stricter verifier
            // verifies anew, and refuses.
            let strict = ExecOptions {
                verifier: VerifierConfig {
                    max_insns: 2,
                    ..VerifierConfig::default()
                },
                ..options.clone()
            };
            assert!(matches!(
                Executable::build(&p, &strict),
                Err(EngineError::Rejected { .. })
            ));
            // As is another program of the same length.
            let mut other = p.clone();
            other.code[4] = 8;
            let o = Executable::build(&other, &options).unwrap();
            assert!(!std::ptr::eq(first.program(), o.program()));
            let mut vm = Vm::new();
            let mut mem = [0u8; 8];
            let raw = Executable::build(&other, &ExecOptions::conformance(engine)).unwrap();
            assert_eq!(vm.run_raw(&raw, &mut mem).unwrap().r0, 9, "{engine:?}");
        }
    }

    /// A step that stores byte 0 of its segment 0 in state word `step` and continues until
    /// step 2, which ends the message: eleven instructions per step.
    fn continuing_handler(engine: EngineKind, budget: u64) -> Executable {
        use crate::insn::Insn;
        use crate::opcode::*;
        use std::mem::offset_of;
        let step = offset_of!(Context, step) as i16;
        let seg0 = (offset_of!(Context, segments) + offset_of!(naam_ebpf::Segment, addr)) as i16;
        let state = offset_of!(Context, state) as i16;
        let insns = [
            Insn::new(CLASS_LDX | SIZE_W | MODE_MEM, 2, 1, step, 0),
            Insn::new(CLASS_LDX | SIZE_DW | MODE_MEM, 3, 1, seg0, 0),
            Insn::new(CLASS_LDX | SIZE_B | MODE_MEM, 4, 3, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_MOV | SRC_X, 5, 2, 0, 0),
            Insn::new(CLASS_ALU64 | ALU_LSH, 5, 0, 0, 3),
            Insn::new(CLASS_ALU64 | ALU_ADD | SRC_X, 5, 1, 0, 0),
            Insn::new(CLASS_STX | SIZE_DW | MODE_MEM, 5, 4, state, 0),
            Insn::new(CLASS_ALU64 | ALU_MOV, 0, 0, 0, Return::Done.encode() as i32),
            Insn::new(CLASS_JMP | JMP_JGE, 2, 0, 1, 2),
            Insn::new(
                CLASS_ALU64 | ALU_MOV,
                0,
                0,
                0,
                Return::Continue.encode() as i32,
            ),
            Insn::EXIT,
        ];
        Executable::build(&program(&insns), &ExecOptions::new(engine, budget)).unwrap()
    }

    /// Hands over `segments[k]` for step `k + 1` while it has them, and records what it took.
    struct Handover<'a> {
        segments: Vec<Vec<Grant<'a>>>,
        taken: Vec<(u32, Option<Return>, u64)>,
    }

    impl NextStep for Handover<'_> {
        fn next(&mut self, done: naam_proto::step::StepResult<'_>) -> Option<&[Grant<'_>]> {
            let k = self.taken.len();
            self.taken.push((k as u32, done.ret, done.state[k]));
            self.segments.get(k).map(|g| &g[..])
        }
    }

    /// Steps handed over between runs run in the same entry, each over its own segments with
    /// its own budget; the entry ends with the step the driver did not take.
    #[test]
    fn the_steps_after_a_continue_run_in_the_same_entry() {
        let bytes = [[10u8; 8], [11u8; 8], [12u8; 8]];
        for engine in [EngineKind::Interp, EngineKind::Jit] {
            // Eleven instructions a step, three steps: only a budget per step lets them run.
            let exe = continuing_handler(engine, 16);
            let first = [Grant::read(&bytes[0])];
            let inv = Invocation {
                app: 3,
                request_id: 9,
                segments: &first,
                ..Invocation::default()
            };
            let mut vm = Vm::new();
            assert!(vm.begin_steps(&exe, &inv).unwrap());
            let mut next = Handover {
                segments: vec![vec![Grant::read(&bytes[1])], vec![Grant::read(&bytes[2])]],
                taken: Vec::new(),
            };
            let last = vm.run_steps(&exe, &mut next).unwrap();
            assert_eq!(last.ret, Some(Return::Done), "{engine:?}");
            assert_eq!(&last.state[..3], &[10, 11, 12], "{engine:?}");
            assert_eq!(
                next.taken,
                vec![
                    (0, Some(Return::Continue), 10),
                    (1, Some(Return::Continue), 11)
                ]
            );
            assert_eq!(vm.context().step, 2);

            // The driver takes the first step and stops: the entry ends with it.
            assert!(vm.begin_steps(&exe, &inv).unwrap());
            let mut stop = Handover {
                segments: Vec::new(),
                taken: Vec::new(),
            };
            let only = vm.run_steps(&exe, &mut stop).unwrap();
            assert_eq!(only.ret, Some(Return::Continue), "{engine:?}");
            assert_eq!(stop.taken.len(), 1);
            assert_eq!(vm.context().step, 0);

            // A step handed no segment finds none: the previous step's grant is gone, and
            // reading at the address it had faults.
            assert!(vm.begin_steps(&exe, &inv).unwrap());
            let mut none = Handover {
                segments: vec![Vec::new()],
                taken: Vec::new(),
            };
            let err = vm.run_steps(&exe, &mut none).map(|r| r.ret).unwrap_err();
            assert!(
                matches!(err, naam_proto::step::StepFault::Fault(_)),
                "{engine:?}: {err:?}"
            );

            // More segments than a step may have are refused, not installed.
            assert!(vm.begin_steps(&exe, &inv).unwrap());
            let mut too_many = Handover {
                segments: vec![vec![Grant::read(&bytes[1]); MAX_SEGMENTS + 1]],
                taken: Vec::new(),
            };
            let err = vm
                .run_steps(&exe, &mut too_many)
                .map(|r| r.ret)
                .unwrap_err();
            assert!(
                matches!(&err, naam_proto::step::StepFault::BadInput(m) if m.contains("segments")),
                "{engine:?}: {err:?}"
            );

            // Without a step begun, nothing runs.
            assert!(vm.run_steps(&exe, &mut none).is_err());
        }
    }

    /// A step's grant slots are what its segments make of them, whatever the step before had
    /// there: the same range (kept as it was), the same range with other rights, or another
    /// length (both made again).
    #[test]
    fn a_step_s_grants_follow_its_segments_whatever_the_step_before_had() {
        use crate::insn::Insn;
        use crate::opcode::*;
        use naam_ebpf::abi::{ACCESS_READ, ACCESS_WRITE};
        let ret = program(&[Insn::new(CLASS_ALU64 | ALU_MOV, 0, 0, 0, 0), Insn::EXIT]);
        let step = Executable::new(&ret, EngineKind::Jit, &VerifierConfig::default()).unwrap();
        let mut vm = Vm::new();
        let seg = [7u8; 64];
        let addr = seg.as_ptr() as u64;
        let steps = [
            (64, ACCESS_READ),
            (64, ACCESS_READ),
            (64, ACCESS_READ | ACCESS_WRITE),
            (64, ACCESS_READ),
            (32, ACCESS_READ),
            (32, 0),
            (32, ACCESS_READ),
            (0, ACCESS_READ),
            (64, ACCESS_READ),
        ];
        for (len, access) in steps {
            // SAFETY: a range of `seg`, which outlives the step; nothing writes through it.
            let grant = [unsafe { Grant::raw(addr, len, access) }];
            let inv = Invocation {
                segments: &grant,
                ..Invocation::default()
            };
            vm.run(&step, &inv).unwrap();
            assert_eq!(
                vm.vmctx.grants[slot::SEGMENT],
                GrantSlot::with_rights(
                    addr,
                    len as u64,
                    access & ACCESS_READ != 0,
                    access & ACCESS_WRITE != 0
                ),
                "{len} bytes, access {access:#x}"
            );
        }
    }

    /// A raw run between two steps must not leave the second step a segment table entry whose
    /// grant is gone (the analysis trusts the table).
    #[test]
    fn the_segment_table_never_keeps_stale_entries() {
        use crate::insn::Insn;
        use crate::opcode::*;
        let ret = program(&[Insn::new(CLASS_ALU64 | ALU_MOV, 0, 0, 0, 0), Insn::EXIT]);
        let step = Executable::new(&ret, EngineKind::Jit, &VerifierConfig::default()).unwrap();
        let raw = Executable::build(&ret, &ExecOptions::conformance(EngineKind::Jit)).unwrap();
        let mut vm = Vm::new();
        let seg = [7u8; 64];
        let four = [Grant::read(&seg); 4];
        let inv = Invocation {
            segments: &four,
            ..Invocation::default()
        };
        vm.run(&step, &inv).unwrap();
        let mut mem = [0u8; 8];
        vm.image_raw(&raw, &mem).unwrap();
        vm.run_raw(&raw, &mut mem).unwrap();
        let one = Invocation {
            segments: &four[..1],
            ..Invocation::default()
        };
        vm.run(&step, &one).unwrap();
        for s in &vm.context().segments[1..] {
            assert_eq!(*s, naam_ebpf::Segment::default());
        }
    }
}
