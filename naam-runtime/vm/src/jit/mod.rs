//! The JIT: verified eBPF to native code through Cranelift, for the host (x86-64 here) and,
//! by cross-compilation, for aarch64 (BlueField-2's Arm A72 cores).
//!
//! Every eBPF function becomes one native function `(ctx, fp, r1..r5) -> (r0, status)`; a
//! small entry function `(ctx, r1, r2) -> r0` calls the first. The machine state the code
//! needs lives in the [`VmCtx`](crate::memory::VmCtx) it is given, never in constants, so the same code runs in any
//! process that builds a context (the aarch64 harness does, in C).
//!
//! What the generated code guarantees, with the interpreter's exact semantics:
//! - **Memory**: an access the analysis proved is emitted bare; any other is compared inline
//!   with the hinted grant's limit (one subtraction, one comparison) and, on a miss, checked
//!   against every grant by `memory::check_slow`, called through a trampoline that clobbers
//!   no register (so a loop keeps its values in registers around the cold call). A refused access records the fault
//!   and returns; no access the grants do not allow ever executes, so a bad handler gets a
//!   fault, never a signal. Atomics also require natural alignment.
//! - **Budget**: fuel, as wasm engines meter it, charged per path rather than per block: a
//!   register starts at the budget minus what was already executed; the instructions of the
//!   blocks since it was last updated are a compile-time count carried along single edges, and
//!   subtracted only at an edge into a block several edges reach, at a backward jump, a call or
//!   an exit (so a loop whose body is a chain of blocks pays one subtraction and one test per
//!   iteration). Every taken backward jump and every local call checks the fuel is not
//!   negative, so the count (budget minus fuel) matches the interpreter's at every check.
//! - **Calls**: local calls get their own 512-byte frame; a call whose frame would fall below
//!   the stack limit faults. Helpers are called through the context's table.
//! - **Arithmetic**: division and remainder by zero and `MIN / -1` never trap; 32-bit results
//!   are zero-extended (rbpf's JIT got the 32-bit move wrong; this one is tested against the
//!   interpreter on every operation).
//!
//! Here: targets, compilation and the module's signatures; `translate` turns one eBPF function
//! into Cranelift IR, `exec` maps host code executable ([`HostCode`]).

use std::time::{Duration, Instant};

use cranelift_codegen::control::ControlPlane;
use cranelift_codegen::ir::{
    types, AbiParam, ExtFuncData, ExternalName, FuncRef, Function, InstBuilder, Signature,
    UserExternalName, UserFuncName,
};
use cranelift_codegen::isa::{CallConv, OwnedTargetIsa, TargetFrontendConfig};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::{binemit::Reloc, Context, FinalizedRelocTarget};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};

use crate::analysis::Facts;
use crate::insn::Op;
use crate::loader::Program;
use crate::verifier::Checked;

mod exec;
mod translate;

pub use exec::{EntryFn, ExecMemory, HostCode};
use translate::Translator;

/// Instruction sets the JIT emits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// The machine this process runs on.
    Host,
    /// AArch64 (Armv8.0-A, no LSE atomics: what BlueField-2's Cortex-A72 cores implement).
    Aarch64,
}

impl Target {
    /// Name as printed and parsed.
    pub fn name(self) -> &'static str {
        match self {
            Target::Host => "host",
            Target::Aarch64 => "aarch64",
        }
    }
}

/// Why compilation failed.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JitError {
    /// The target ISA is unavailable in this build.
    #[error("no code generator for {target}: {reason}")]
    Isa {
        /// Target asked for.
        target: &'static str,
        /// Cranelift's message (a setting or target it could not set up), or that code for
        /// another target cannot be mapped in this process.
        reason: String,
    },
    /// Cranelift refused the generated function (a bug in the translation).
    #[error("function {function} (at insn {start}): code generation failed: {reason}")]
    Codegen {
        /// Index of the eBPF function (0 is the entry).
        function: usize,
        /// Slot of its first instruction.
        start: usize,
        /// Cranelift's message.
        reason: String,
    },
    /// A relocation the linker does not know.
    #[error("unsupported relocation {0}")]
    Relocation(String),
    /// Executable memory could not be prepared.
    #[error("executable memory: {0}")]
    Memory(String),
}

/// Machine code for a whole program, laid out and linked, not yet executable.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The code, position-independent.
    pub code: Vec<u8>,
    /// Offset of the entry function `(ctx, r1, r2) -> r0`.
    pub entry: usize,
    /// Native functions (eBPF functions plus the entry).
    pub functions: usize,
    /// Time spent in translation and code generation.
    pub compile_time: Duration,
    /// The target it was compiled for.
    pub target: Target,
}

/// The Cranelift ISA for `target`, built once per process (CPU feature detection and settings
/// do not change while it runs).
pub fn isa(target: Target) -> Result<OwnedTargetIsa, JitError> {
    use std::sync::OnceLock;
    static HOST: OnceLock<Result<OwnedTargetIsa, String>> = OnceLock::new();
    static AARCH64: OnceLock<Result<OwnedTargetIsa, String>> = OnceLock::new();
    let cell = match target {
        Target::Host => &HOST,
        Target::Aarch64 => &AARCH64,
    };
    cell.get_or_init(|| build_isa(target).map_err(|e| e.to_string()))
        .clone()
        .map_err(|reason| JitError::Isa {
            target: target.name(),
            reason,
        })
}

/// What code for `target` depends on besides the program: the triple, the shared settings
/// and the ISA's flags (the CPU features detected on the host). Part of every code cache key,
/// so code compiled for another CPU's features or other settings never matches.
pub fn target_fingerprint(target: Target) -> Result<&'static str, JitError> {
    use std::sync::OnceLock;
    static HOST: OnceLock<Result<String, JitError>> = OnceLock::new();
    static AARCH64: OnceLock<Result<String, JitError>> = OnceLock::new();
    let cell = match target {
        Target::Host => &HOST,
        Target::Aarch64 => &AARCH64,
    };
    // Computed once: the ISA does not change while the process runs, and every build asks.
    match cell.get_or_init(|| {
        use std::fmt::Write;
        let isa = isa(target)?;
        let mut s = format!("{}\n{}", isa.triple(), isa.flags());
        for v in isa.isa_flags() {
            let _ = write!(s, "\n{v}");
        }
        Ok(s)
    }) {
        Ok(s) => Ok(s.as_str()),
        Err(e) => Err(e.clone()),
    }
}

fn build_isa(target: Target) -> Result<OwnedTargetIsa, JitError> {
    let err = |reason: String| JitError::Isa {
        target: target.name(),
        reason,
    };
    let mut flags = settings::builder();
    flags
        .set("opt_level", "speed")
        .map_err(|e| err(e.to_string()))?;
    // Frames are small and bounded; no stack probes, no unwind tables (nothing unwinds
    // through generated code: helpers return, faults are return values).
    flags
        .set("regalloc_algorithm", "backtracking")
        .map_err(|e| err(e.to_string()))?;
    flags
        .set("enable_probestack", "false")
        .map_err(|e| err(e.to_string()))?;
    flags
        .set("unwind_info", "false")
        .map_err(|e| err(e.to_string()))?;
    flags
        .set(
            "enable_verifier",
            if cfg!(debug_assertions) {
                "true"
            } else {
                "false"
            },
        )
        .map_err(|e| err(e.to_string()))?;
    let builder = match target {
        Target::Host => cranelift_native::builder().map_err(|e| err(e.to_string()))?,
        Target::Aarch64 => cranelift_codegen::isa::lookup_by_name("aarch64-unknown-linux-gnu")
            .map_err(|e| err(e.to_string()))?,
    };
    builder
        .finish(settings::Flags::new(flags))
        .map_err(|e| err(e.to_string()))
}

/// Compiles a verified program for `target`.
pub fn compile(
    checked: &Checked,
    program: &Program,
    facts: &Facts,
    target: Target,
) -> Result<Compiled, JitError> {
    let started = Instant::now();
    let isa = isa(target)?;
    let call_conv = isa.default_call_conv();
    let nf = checked.functions.len();
    // When nothing calls the entry function back (the usual case), it takes the entry
    // signature itself; otherwise a small wrapper does, after every function.
    let entry_called = checked
        .ops
        .iter()
        .any(|op| matches!(op, Some(Op::CallLocal { target }) if *target as usize == checked.functions[0].0));
    let functions = if entry_called { nf + 1 } else { nf };
    // Last, the slow-path check's trampoline (see `build_check_trampoline`).
    let trampoline = functions;
    let total = functions + 1;
    let reachable = reachable_functions(checked);
    // Cranelift's scratch state is reused from one compilation to the next on a thread.
    thread_local! {
        static SCRATCH: std::cell::RefCell<Option<(FunctionBuilderContext, Context)>> =
            const { std::cell::RefCell::new(None) };
    }
    let (mut fctx, mut ctx) = SCRATCH
        .with(|s| s.borrow_mut().take())
        .unwrap_or_else(|| (FunctionBuilderContext::new(), Context::new()));
    let mut bodies: Vec<(Vec<u8>, Vec<PendingReloc>)> = Vec::with_capacity(total);
    for f in 0..total {
        if reachable.get(f) == Some(&false) {
            // Never called (the rest of a linked `.text` section): no code.
            bodies.push((Vec::new(), Vec::new()));
            continue;
        }
        let entry_abi = f == nf || (f == 0 && !entry_called);
        let signature = if f == trampoline {
            trampoline_signature()
        } else if entry_abi {
            entry_signature(call_conv)
        } else {
            function_signature(call_conv)
        };
        let mut func = Function::with_name_signature(UserFuncName::user(0, f as u32), signature);
        {
            let builder = FunctionBuilder::new(&mut func, &mut fctx);
            if f < nf {
                let t = Translator::new(
                    builder,
                    checked,
                    program,
                    facts,
                    (f, trampoline),
                    call_conv,
                    entry_abi,
                );
                t.translate(isa.frontend_config());
            } else if f == trampoline {
                build_check_trampoline(builder, call_conv, isa.frontend_config());
            } else {
                build_entry(builder, call_conv, isa.frontend_config());
            }
        }
        ctx.clear();
        ctx.func = func;
        let start = checked.functions.get(f).map_or(0, |x| x.0);
        let compiled = ctx
            .compile(&*isa, &mut ControlPlane::default())
            .map_err(|e| JitError::Codegen {
                function: f,
                start,
                reason: format!("{:?}", e.inner),
            })?;
        let code = compiled.code_buffer().to_vec();
        let mut raw = Vec::new();
        for r in compiled.buffer.relocs() {
            let FinalizedRelocTarget::ExternalName(ExternalName::User(name)) = &r.target else {
                return Err(JitError::Relocation(format!(
                    "{:?} to {:?}",
                    r.kind, r.target
                )));
            };
            raw.push((r.offset as usize, r.kind, *name, r.addend));
        }
        let names = ctx.func.params.user_named_funcs();
        let relocs = raw
            .into_iter()
            .map(|(offset, kind, name, addend)| PendingReloc {
                offset,
                kind,
                callee: names[name].index as usize,
                addend,
            })
            .collect();
        bodies.push((code, relocs));
    }
    // Lay the functions out one after the other, 16-byte aligned, then link the calls.
    let mut code = Vec::new();
    let mut starts = Vec::with_capacity(bodies.len());
    for (body, _) in &bodies {
        while code.len() % 16 != 0 {
            code.push(0);
        }
        starts.push(code.len());
        code.extend_from_slice(body);
    }
    for (f, (_, relocs)) in bodies.iter().enumerate() {
        for r in relocs {
            let at = starts[f] + r.offset;
            let target_addr = starts[r.callee] as i64;
            let delta = target_addr - at as i64 + r.addend;
            match r.kind {
                Reloc::X86CallPCRel4 | Reloc::X86PCRel4 => {
                    let v = i32::try_from(delta)
                        .map_err(|_| JitError::Relocation("call too far".into()))?;
                    code[at..at + 4].copy_from_slice(&v.to_le_bytes());
                }
                Reloc::Arm64Call => {
                    if delta % 4 != 0 || !(-(1i64 << 27)..(1i64 << 27)).contains(&delta) {
                        return Err(JitError::Relocation("aarch64 call out of range".into()));
                    }
                    let mut insn =
                        u32::from_le_bytes([code[at], code[at + 1], code[at + 2], code[at + 3]]);
                    insn = (insn & 0xfc00_0000) | (((delta >> 2) as u32) & 0x03ff_ffff);
                    code[at..at + 4].copy_from_slice(&insn.to_le_bytes());
                }
                other => return Err(JitError::Relocation(format!("{other:?}"))),
            }
        }
    }
    ctx.clear();
    SCRATCH.with(|s| *s.borrow_mut() = Some((fctx, ctx)));
    Ok(Compiled {
        entry: starts[if entry_called { nf } else { 0 }],
        code,
        functions,
        compile_time: started.elapsed(),
        target,
    })
}

/// Which functions the entry can reach through local calls.
fn reachable_functions(checked: &Checked) -> Vec<bool> {
    let mut seen = vec![false; checked.functions.len()];
    let mut work = vec![0usize];
    seen[0] = true;
    while let Some(f) = work.pop() {
        let (start, end) = checked.functions[f];
        for op in checked.ops[start..end].iter().flatten() {
            if let Op::CallLocal { target } = op {
                if let Some(callee) = checked.function_at(*target as usize) {
                    if !seen[callee] {
                        seen[callee] = true;
                        work.push(callee);
                    }
                }
            }
        }
    }
    seen
}

struct PendingReloc {
    offset: usize,
    kind: Reloc,
    callee: usize,
    addend: i64,
}

fn function_signature(call_conv: CallConv) -> Signature {
    let mut sig = Signature::new(call_conv);
    for _ in 0..7 {
        sig.params.push(AbiParam::new(types::I64));
    }
    sig.returns.push(AbiParam::new(types::I64));
    sig.returns.push(AbiParam::new(types::I64));
    sig
}

/// `(ctx, r1, r2) -> r0`: the frame pointer is the top of the context's own stack.
fn entry_signature(call_conv: CallConv) -> Signature {
    let mut sig = Signature::new(call_conv);
    for _ in 0..3 {
        sig.params.push(AbiParam::new(types::I64));
    }
    sig.returns.push(AbiParam::new(types::I64));
    sig
}

fn helper_signature(call_conv: CallConv) -> Signature {
    let mut sig = Signature::new(call_conv);
    for _ in 0..6 {
        sig.params.push(AbiParam::new(types::I64));
    }
    sig.returns.push(AbiParam::new(types::I64));
    sig
}

fn check_signature(call_conv: CallConv) -> Signature {
    let mut sig = Signature::new(call_conv);
    for _ in 0..5 {
        sig.params.push(AbiParam::new(types::I64));
    }
    sig.returns.push(AbiParam::new(types::I64));
    sig
}

/// The check trampoline's signature `(ctx, addr, size, kind, pc)`: nothing returned (a
/// refused access is in the context's fault record), no register clobbered.
fn trampoline_signature() -> Signature {
    let mut sig = Signature::new(CallConv::PreserveAll);
    for _ in 0..5 {
        sig.params.push(AbiParam::new(types::I64));
    }
    sig
}

/// A call to the check trampoline (function `index`), colocated.
fn import_trampoline(builder: &mut FunctionBuilder, index: usize) -> FuncRef {
    let name = builder
        .func
        .declare_imported_user_function(UserExternalName::new(0, index as u32));
    let signature = builder.import_signature(trampoline_signature());
    builder.import_function(ExtFuncData {
        name: ExternalName::user(name),
        signature,
        colocated: true,
        patchable: false,
    })
}

/// The trampoline to the slow-path check: it calls the context's `check` with the platform's
/// convention and saves every register that call may clobber. Inline checks call it when
/// they miss: a cold call that clobbers nothing leaves the hot loop's values in registers
/// (with the platform's convention every value live across the call must sit in one of its
/// few callee-saved registers or on the stack, and a loop spills on every iteration).
fn build_check_trampoline(
    mut b: FunctionBuilder,
    call_conv: CallConv,
    config: TargetFrontendConfig,
) {
    let block = b.create_block();
    b.append_block_params_for_function_params(block);
    b.switch_to_block(block);
    b.seal_block(block);
    let p = b.block_params(block).to_vec();
    let f = b.ins().load(
        types::I64,
        translate::fixed(),
        p[0],
        crate::memory::layout::CHECK as i32,
    );
    let sig = b.import_signature(check_signature(call_conv));
    b.ins().call_indirect(sig, f, &p);
    b.ins().return_(&[]);
    b.seal_all_blocks();
    b.finalize(config);
}

/// A call to function `index` of this program, colocated (linked by [`compile`]).
fn import_function(builder: &mut FunctionBuilder, index: usize, call_conv: CallConv) -> FuncRef {
    let name = builder
        .func
        .declare_imported_user_function(UserExternalName::new(0, index as u32));
    let signature = builder.import_signature(function_signature(call_conv));
    builder.import_function(ExtFuncData {
        name: ExternalName::user(name),
        signature,
        colocated: true,
        patchable: false,
    })
}

/// The entry function: `(ctx, r1, r2) -> r0`, calling function 0 with the context's stack top as
/// its frame pointer and `r3..r5 = 0`.
fn build_entry(mut b: FunctionBuilder, call_conv: CallConv, config: TargetFrontendConfig) {
    let block = b.create_block();
    b.append_block_params_for_function_params(block);
    b.switch_to_block(block);
    b.seal_block(block);
    let p = b.block_params(block).to_vec();
    let zero = b.ins().iconst(types::I64, 0);
    let f0 = import_function(&mut b, 0, call_conv);
    let fp = b
        .ins()
        .iadd_imm_s(p[0], crate::memory::layout::STACK_TOP as i64);
    let call = b.ins().call(f0, &[p[0], fp, p[1], p[2], zero, zero, zero]);
    let r0 = b.inst_results(call)[0];
    b.ins().return_(&[r0]);
    b.seal_all_blocks();
    b.finalize(config);
}
