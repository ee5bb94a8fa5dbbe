//! Engines and invocations.
//!
//! An [`Executable`] is a verified program bound to one engine:
//! - [`EngineKind::Interp`]: the checked interpreter ([`crate::interp`]); any verified handler;
//! - [`EngineKind::Jit`]: rbpf 0.4's x86_64 JIT, with no runtime memory checks, so only for
//!   handlers loaded as [`Trust::Trusted`] until a static memory-safety verifier exists.
//!
//! rbpf's own interpreter is not offered: it checks only where an access starts and cannot tell
//! reads from writes, so it cannot enforce read-only descriptors.
//!
//! A [`Vm`] is the per-thread execution state: the [`Context`] buffer, the interpreter stack and
//! the helper state, all reused across invocations. One step is [`Vm::run`]: fill the context
//! from an [`Invocation`], run, validate and return the [`StepOutput`].

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use naam_ebpf::abi::{
    placement, Context, Descriptor, Return, WriteOp, ABI_VERSION, ARGS_CAP, CONTEXT_SIZE, MAX_NEXT,
    MAX_SEGMENTS, MAX_WRITES, REPLY_CAP, STATE_WORDS, WRITE_DATA_CAP,
};
use serde::Serialize;

use crate::helpers::{jit_table, CurrentGuard, HelperState};
use crate::insn::{decode_all, Insn};
use crate::interp::{self, VmError, INTERP_STACK_BYTES};
use crate::loader::Program;
use crate::verifier::{verify, Verdict, VerifierConfig, Violation};

/// Default instruction budget per step for the interpreter.
pub const DEFAULT_BUDGET: u64 = 1 << 20;

/// Which engine runs a handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// The checked interpreter.
    Interp,
    /// rbpf's x86_64 JIT (trusted handlers only).
    Jit,
}

impl EngineKind {
    /// Name as printed and parsed.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Interp => "interp",
            EngineKind::Jit => "jit",
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "interp" => Ok(EngineKind::Interp),
            "jit" => Ok(EngineKind::Jit),
            other => Err(format!("unknown engine `{other}` (interp, jit)")),
        }
    }
}

/// Whether a handler's author is vouched for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trust {
    /// Only the checked interpreter may run it.
    Untrusted,
    /// Someone vouches for its memory safety: unchecked engines allowed.
    Trusted,
}

/// Why an executable could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The verifier rejected the program.
    #[error("handler `{name}` rejected by the verifier: {violation}")]
    Rejected {
        /// Handler name.
        name: String,
        /// The violation.
        violation: Violation,
    },
    /// An unchecked engine was asked for an untrusted handler.
    #[error("the {engine} engine runs only trusted handlers (no static memory-safety verifier yet); load `{name}` as trusted or use the interpreter")]
    NotTrusted {
        /// Handler name.
        name: String,
        /// Engine asked for.
        engine: EngineKind,
    },
    /// rbpf refused or failed to compile.
    #[error("the {engine} engine cannot run `{name}`: {reason}")]
    Unsupported {
        /// Handler name.
        name: String,
        /// Engine asked for.
        engine: EngineKind,
        /// Why.
        reason: String,
    },
}

/// Page-aligned memory for JIT output: writable while rbpf compiles, then read+execute only.
struct ExecMemory {
    ptr: *mut u8,
    len: usize,
}

impl ExecMemory {
    fn new(len: usize) -> Result<ExecMemory, String> {
        let page = 4096;
        let len = len.div_ceil(page) * page;
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap of {len} bytes for JIT code failed"));
        }
        Ok(ExecMemory {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The whole region as a mutable slice for rbpf to write code into.
    ///
    /// # Safety
    /// The slice must not outlive `self` (the rbpf VM holding it is dropped first).
    unsafe fn as_static_mut(&mut self) -> &'static mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn seal(&mut self) -> Result<(), String> {
        // SAFETY: the region is our own mapping of `len` bytes.
        let rc =
            unsafe { libc::mprotect(self.ptr.cast(), self.len, libc::PROT_READ | libc::PROT_EXEC) };
        if rc != 0 {
            return Err("mprotect(PROT_READ | PROT_EXEC) of JIT code failed".into());
        }
        Ok(())
    }
}

impl Drop for ExecMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping, after the VM that used it was dropped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// rbpf JIT bound to bytecode and code memory the executable owns.
struct RbpfVm {
    // Field order matters: the VM borrows both the bytecode and the code memory, so it drops
    // first; `Executable` drops `rbpf` before `_code`.
    vm: rbpf::EbpfVmRaw<'static>,
    _exec: ExecMemory,
}

/// Upper bound on x86_64 bytes rbpf emits per eBPF instruction, plus prologue room.
fn jit_code_size(insns: usize) -> usize {
    insns * 64 + 16 * 1024
}

// SAFETY: after construction the VM is only read: the JIT code and helper table are immutable,
// and helpers reach per-call state through a thread-local, so concurrent calls are independent.
unsafe impl Send for RbpfVm {}
// SAFETY: as above; `execute_program*` take `&self` and keep no per-call state in the VM.
unsafe impl Sync for RbpfVm {}

/// A verified handler bound to an engine.
pub struct Executable {
    rbpf: Option<RbpfVm>,
    name: String,
    engine: EngineKind,
    verdict: Verdict,
    insns: Vec<Insn>,
    program: Program,
    /// Bytecode the rbpf VM borrows; kept alive (and unmoved) for it.
    _code: Box<[u8]>,
}

impl fmt::Debug for Executable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executable")
            .field("name", &self.name)
            .field("engine", &self.engine)
            .field("insns", &self.insns.len())
            .finish()
    }
}

/// True when rbpf's JIT runs `program` as the interpreter does: its local calls keep the
/// caller's frame pointer, so a called function that uses the stack would overwrite the caller's.
pub fn jit_compatible(program: &Program) -> Result<(), String> {
    let insns = decode_all(&program.code);
    let mut starts = program.functions.clone();
    starts.sort_unstable();
    for (k, &start) in starts.iter().enumerate().filter(|(_, &s)| s != 0) {
        let end = starts
            .get(k + 1)
            .copied()
            .unwrap_or(insns.len())
            .min(insns.len());
        if let Some(pc) = (start..end).find(|&pc| insns[pc].src == 10 || insns[pc].dst == 10) {
            return Err(format!(
                "insn {pc}: a called function uses the stack, which rbpf's JIT does not give its own frame"
            ));
        }
    }
    Ok(())
}

impl Executable {
    /// Verifies `program` and prepares it for `engine`.
    pub fn new(
        program: &Program,
        engine: EngineKind,
        trust: Trust,
        config: &VerifierConfig,
    ) -> Result<Executable, EngineError> {
        let verdict = verify(program, config).map_err(|violation| EngineError::Rejected {
            name: program.name.clone(),
            violation,
        })?;
        if engine != EngineKind::Interp && trust != Trust::Trusted {
            return Err(EngineError::NotTrusted {
                name: program.name.clone(),
                engine,
            });
        }
        let code: Box<[u8]> = program.code.clone().into_boxed_slice();
        let unsupported = |reason: String| EngineError::Unsupported {
            name: program.name.clone(),
            engine,
            reason,
        };
        let rbpf = match engine {
            EngineKind::Interp => None,
            EngineKind::Jit => {
                if !cfg!(target_arch = "x86_64") {
                    return Err(unsupported("rbpf's JIT emits x86_64 code only".into()));
                }
                jit_compatible(program).map_err(&unsupported)?;
                // SAFETY: `code` is a heap allocation owned by the same Executable and never
                // mutated; `rbpf` is declared first so it drops before `code`.
                let bytes: &'static [u8] =
                    unsafe { std::slice::from_raw_parts(code.as_ptr(), code.len()) };
                let mut vm =
                    rbpf::EbpfVmRaw::new(Some(bytes)).map_err(|e| unsupported(format!("{e:?}")))?;
                for (id, f) in jit_table() {
                    vm.register_helper(id, f)
                        .map_err(|e| unsupported(format!("{e:?}")))?;
                }
                let mut exec =
                    ExecMemory::new(jit_code_size(program.len())).map_err(&unsupported)?;
                // SAFETY: `exec` moves into the same RbpfVm as `vm`, which drops first.
                vm.set_jit_exec_memory(unsafe { exec.as_static_mut() })
                    .map_err(|e| unsupported(format!("{e:?}")))?;
                // rbpf asserts (panics) when code does not fit; that must not take the process down.
                let compiled =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vm.jit_compile()));
                match compiled {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(unsupported(format!("{e:?}"))),
                    Err(_) => return Err(unsupported("rbpf's JIT compiler panicked".into())),
                }
                exec.seal().map_err(&unsupported)?;
                Some(RbpfVm { vm, _exec: exec })
            }
        };
        Ok(Executable {
            rbpf,
            name: program.name.clone(),
            engine,
            verdict,
            insns: decode_all(&program.code),
            program: program.clone(),
            _code: code,
        })
    }

    /// Handler name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The engine that runs it.
    pub fn engine(&self) -> EngineKind {
        self.engine
    }

    /// The verifier's verdict.
    pub fn verdict(&self) -> &Verdict {
        &self.verdict
    }

    /// The linked program.
    pub fn program(&self) -> &Program {
        &self.program
    }
}

/// A segment granted to one step: `len` bytes at `addr` with `ACCESS_*` rights.
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
            access: naam_ebpf::abi::ACCESS_READ,
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

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty grant.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The inputs of one step.
#[derive(Clone, Debug, Default)]
pub struct Invocation<'a> {
    /// Application id.
    pub app: u32,
    /// Request id.
    pub request_id: u64,
    /// Step index.
    pub step: u32,
    /// Placement, one of `naam_ebpf::abi::placement`.
    pub placement: u32,
    /// Inline args (at most `ARGS_CAP` bytes).
    pub args: &'a [u8],
    /// State words from the previous step.
    pub state: [u64; STATE_WORDS],
    /// Reply bytes accumulated by earlier steps.
    pub reply: &'a [u8],
    /// Segments fetched for this step.
    pub segments: &'a [Grant<'a>],
}

/// Why a step failed before, during or after the handler ran.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// Raw r0.
    pub return_code: u64,
    /// Decoded r0, if it is a valid [`Return`].
    pub ret: Option<Return>,
    /// Instructions executed (interpreter only).
    pub insns: Option<u64>,
    /// Values traced by the handler.
    pub trace: Vec<u64>,
}

/// Per-thread execution state, reused across invocations.
pub struct Vm {
    ctx: Box<Context>,
    stack: Box<[u8]>,
    helpers: HelperState,
    last_app: Option<u32>,
    budget: u64,
}

impl Default for Vm {
    fn default() -> Self {
        Vm::new()
    }
}

impl Vm {
    /// A VM with the default instruction budget.
    pub fn new() -> Vm {
        Vm {
            ctx: Box::new(Context::new()),
            stack: vec![0u8; INTERP_STACK_BYTES].into_boxed_slice(),
            helpers: HelperState::default(),
            last_app: None,
            budget: DEFAULT_BUDGET,
        }
    }

    /// Sets the interpreter's instruction budget per step.
    pub fn set_budget(&mut self, budget: u64) {
        self.budget = budget;
    }

    /// The context as the last step left it.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    fn prepare(&mut self, inv: &Invocation<'_>) -> Result<(), StepError> {
        if inv.args.len() > ARGS_CAP {
            return Err(StepError::BadInput(format!(
                "{} bytes of args exceed the {ARGS_CAP}-byte capacity",
                inv.args.len()
            )));
        }
        if inv.segments.len() > MAX_SEGMENTS {
            return Err(StepError::BadInput(format!(
                "{} segments exceed the maximum of {MAX_SEGMENTS}",
                inv.segments.len()
            )));
        }
        if inv.reply.len() > REPLY_CAP {
            return Err(StepError::BadInput("reply exceeds its capacity".into()));
        }
        if let Some(g) = inv.segments.iter().find(|g| g.len > u32::MAX as usize) {
            return Err(StepError::BadInput(format!(
                "segment of {} bytes is too large",
                g.len
            )));
        }
        // A different tenant must not see what the previous one left in the context.
        if self.last_app != Some(inv.app) {
            *self.ctx = Context::new();
            self.last_app = Some(inv.app);
        }
        let c = &mut *self.ctx;
        c.abi_version = ABI_VERSION;
        c.step = inv.step;
        c.app = inv.app;
        c.placement = inv.placement;
        c.request_id = inv.request_id;
        c.args_len = inv.args.len() as u32;
        c.args[..inv.args.len()].copy_from_slice(inv.args);
        c.state = inv.state;
        c.segment_count = inv.segments.len() as u32;
        for (slot, g) in c.segments.iter_mut().zip(inv.segments) {
            *slot = naam_ebpf::Segment {
                addr: g.addr,
                len: g.len as u32,
                access: g.access,
            };
        }
        c.reply_len = inv.reply.len() as u32;
        c.reply[..inv.reply.len()].copy_from_slice(inv.reply);
        c.next_count = 0;
        c.write_count = 0;
        c.write_data_len = 0;

        let h = &mut self.helpers;
        h.reset();
        h.mem.add(c as *mut Context as u64, CONTEXT_SIZE, true);
        h.mem
            .add(self.stack.as_mut_ptr() as u64, self.stack.len(), true);
        for g in inv.segments {
            h.mem
                .add(g.addr, g.len, g.access & naam_ebpf::abi::ACCESS_WRITE != 0);
        }
        Ok(())
    }

    /// Runs one step of `exe` over `inv`.
    pub fn run(&mut self, exe: &Executable, inv: &Invocation<'_>) -> Result<StepOutput, StepError> {
        self.prepare(inv)?;
        for r in &exe.program.rodata {
            self.helpers.mem.add(r.addr(), r.len(), false);
        }
        let ctx_addr = &mut *self.ctx as *mut Context as u64;
        let (r0, insns) = match &exe.rbpf {
            None => {
                let exit = interp::run(
                    &exe.insns,
                    ctx_addr,
                    &mut self.stack,
                    &mut self.helpers,
                    self.budget,
                )?;
                (exit.r0, Some(exit.insns))
            }
            Some(rv) => {
                // The JIT's stack lives on this thread's stack just below here: let the memory
                // helpers accept pointers into it.
                let marker = 0u8;
                let top = &marker as *const u8 as u64;
                self.helpers
                    .mem
                    .add(top - JIT_STACK_WINDOW as u64, JIT_STACK_WINDOW, true);
                let guard = CurrentGuard::install(&mut self.helpers);
                // SAFETY: the context outlives the call; rbpf keeps no reference to it afterwards.
                let mem: &'static mut [u8] =
                    unsafe { std::slice::from_raw_parts_mut(ctx_addr as *mut u8, CONTEXT_SIZE) };
                // SAFETY: the handler is trusted (checked in `Executable::new`) and verified.
                let result = unsafe { rv.vm.execute_program_jit(mem) };
                drop(guard);
                if let Some(code) = self.helpers.abort {
                    return Err(VmError::Aborted { code }.into());
                }
                (result.map_err(|e| VmError::Engine(format!("{e:?}")))?, None)
            }
        };
        self.check_output()?;
        Ok(StepOutput {
            return_code: r0,
            ret: Return::decode(r0),
            insns,
            trace: self.helpers.trace.clone(),
        })
    }

    fn check_output(&self) -> Result<(), StepError> {
        let c = &*self.ctx;
        let bad = |what: String| Err(StepError::BadOutput(what));
        if c.reply_len as usize > REPLY_CAP {
            return bad(format!("reply_len {} exceeds {REPLY_CAP}", c.reply_len));
        }
        if c.next_count as usize > MAX_NEXT {
            return bad(format!("next_count {} exceeds {MAX_NEXT}", c.next_count));
        }
        if c.write_count as usize > MAX_WRITES {
            return bad(format!(
                "write_count {} exceeds {MAX_WRITES}",
                c.write_count
            ));
        }
        if c.write_data_len as usize > WRITE_DATA_CAP {
            return bad(format!(
                "write_data_len {} exceeds {WRITE_DATA_CAP}",
                c.write_data_len
            ));
        }
        Ok(())
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

/// Bytes below the caller's frame in which the JIT's stack may lie (helper pointer checks).
const JIT_STACK_WINDOW: usize = 16 * 1024;

/// Placement used by standalone invocations.
pub const STANDALONE: u32 = placement::STANDALONE;

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
