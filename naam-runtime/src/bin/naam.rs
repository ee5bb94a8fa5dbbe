//! `naam`: build, verify and run NAAM handlers.
//!
//! Exit codes: 0 success; 1 a handler was rejected, or an invocation faulted or aborted;
//! 2 bad usage, unreadable input or a failed build.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use naam_ebpf::abi::{placement, write_kind, Return};
use naam_runtime::engine::{time_runs, Grant, Invocation, StepError, Vm};
use naam_runtime::interp::VmError;
use naam_runtime::pipeline::{build, BuildOptions};
use naam_runtime::verifier::{verify, VerifierConfig, DEFAULT_MAX_INSNS};
use naam_runtime::{load, EngineKind, Executable, Trust};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "naam",
    version,
    about = "Build, verify and run NAAM active-message handlers"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build a Rust handler crate into an eBPF object (host staticlib + bpf-linker).
    Build {
        /// Directory of the handler crate.
        crate_dir: PathBuf,
        /// Output object file.
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Cargo target directory (default: <crate>/target).
        #[arg(long)]
        target_dir: Option<PathBuf>,
    },
    /// Verify every handler of an object: one line each; exit 0 only if all pass.
    Verify {
        /// eBPF object file.
        object: PathBuf,
        /// Instruction cap.
        #[arg(long, default_value_t = DEFAULT_MAX_INSNS)]
        max_insns: usize,
    },
    /// Run one handler invocation and print the result as JSON.
    Run {
        /// eBPF object file.
        object: PathBuf,
        /// Handler name.
        #[arg(long)]
        handler: String,
        /// Inline args, hex.
        #[arg(long, default_value = "")]
        args_hex: String,
        /// A file whose bytes become the next segment (read-only); repeatable.
        #[arg(long = "segment")]
        segments: Vec<PathBuf>,
        /// Engine: interp (checked) or jit (you vouch for the handler).
        #[arg(long, default_value = "interp")]
        engine: EngineKind,
        /// Invocations to time; the result of the last one is printed.
        #[arg(long, default_value_t = 1)]
        repeat: u64,
        /// Step index to present to the handler.
        #[arg(long, default_value_t = 0)]
        step: u32,
        /// State words (comma-separated, decimal or 0x-hex).
        #[arg(long, value_delimiter = ',')]
        state: Vec<String>,
        /// Instruction cap for the verifier.
        #[arg(long, default_value_t = DEFAULT_MAX_INSNS)]
        max_insns: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("naam: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn dispatch(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Build {
            crate_dir,
            out,
            target_dir,
        } => {
            let mut opts = BuildOptions::new(&crate_dir);
            opts.out = out;
            opts.target_dir = target_dir;
            let built =
                build(&opts).with_context(|| format!("building {}", crate_dir.display()))?;
            for w in &built.linker_warnings {
                eprintln!("bpf-linker: {w}");
            }
            println!(
                "wrote {} (handlers: {})",
                built.object.display(),
                built.handlers.join(", ")
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Verify { object, max_insns } => {
            let bytes =
                std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
            let loaded = load(&bytes).with_context(|| format!("loading {}", object.display()))?;
            let config = VerifierConfig {
                max_insns,
                ..VerifierConfig::default()
            };
            let mut all_ok = true;
            for p in &loaded.programs {
                match verify(p, &config) {
                    Ok(v) => println!("{}\t{} insns\tok\t-", p.name, v.insns),
                    Err(violation) => {
                        all_ok = false;
                        println!("{}\t{} insns\trejected\t{violation}", p.name, p.len());
                    }
                }
            }
            Ok(if all_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Run {
            object,
            handler,
            args_hex,
            segments,
            engine,
            repeat,
            step,
            state,
            max_insns,
        } => {
            let bytes =
                std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
            let loaded = load(&bytes).with_context(|| format!("loading {}", object.display()))?;
            let program = loaded.get(&handler)?;
            let trust = if engine == EngineKind::Jit {
                Trust::Trusted
            } else {
                Trust::Untrusted
            };
            let config = VerifierConfig {
                max_insns,
                ..VerifierConfig::default()
            };
            let exe = match Executable::new(program, engine, trust, &config) {
                Ok(exe) => exe,
                Err(e) => {
                    println!(
                        "{}",
                        json!({ "status": "rejected", "error": e.to_string(), "engine": engine.name() })
                    );
                    return Ok(ExitCode::from(1));
                }
            };
            let args = hex::decode(args_hex.trim()).context("--args-hex is not valid hex")?;
            let mut words = [0u64; naam_ebpf::abi::STATE_WORDS];
            if state.len() > words.len() {
                bail!("at most {} state words", words.len());
            }
            for (w, s) in words.iter_mut().zip(&state) {
                *w = parse_u64(s).with_context(|| format!("bad state word `{s}`"))?;
            }
            let data: Vec<Vec<u8>> = segments
                .iter()
                .map(|p| {
                    std::fs::read(p).with_context(|| format!("reading segment {}", p.display()))
                })
                .collect::<Result<_, _>>()?;
            let inv = Invocation {
                step,
                placement: placement::STANDALONE,
                args: &args,
                state: words,
                segments: data.iter().map(|d| Grant::read(d)).collect(),
                ..Invocation::default()
            };
            let mut vm = Vm::new();
            let (result, ns) = time_runs(&mut vm, &exe, &inv, repeat);
            let (report, code) = report(&vm, &exe, result, ns);
            println!("{report}");
            Ok(code)
        }
    }
}

fn parse_u64(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    Ok(match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16)?,
        None => s.parse()?,
    })
}

fn report(
    vm: &Vm,
    exe: &Executable,
    result: Result<naam_runtime::StepOutput, StepError>,
    ns: f64,
) -> (serde_json::Value, ExitCode) {
    let base = json!({ "handler": exe.name(), "engine": exe.engine().name(), "mode": "standalone", "ns_per_invocation": ns });
    let mut v = base;
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            let status = match &e {
                StepError::Vm(VmError::Aborted { .. }) => "aborted",
                StepError::BadInput(_) => "bad-input",
                _ => "fault",
            };
            v["status"] = json!(status);
            v["error"] = json!(e.to_string());
            v["return_code"] = serde_json::Value::Null;
            return (v, ExitCode::from(1));
        }
    };
    let status = match out.ret {
        Some(Return::Done) => "done",
        Some(Return::Continue) => "continue",
        Some(Return::Write) => "write",
        Some(Return::Retry) => "retry",
        Some(Return::Error(_)) => "error",
        None => "invalid-return",
    };
    v["status"] = json!(status);
    v["return_code"] = json!(out.return_code);
    if let Some(Return::Error(code)) = out.ret {
        v["error_code"] = json!(code);
    }
    if out.ret.is_none() {
        v["error"] = json!(format!(
            "r0 = {:#x} is not a valid return (kind {} unknown or code too large)",
            out.return_code,
            out.return_code & 0xff
        ));
    }
    v["reply_hex"] = json!(hex::encode(vm.reply()));
    v["next"] = json!(vm
        .next()
        .iter()
        .map(|d| json!({ "rkey": d.rkey, "offset": d.offset, "len": d.len, "access": d.access }))
        .collect::<Vec<_>>());
    let data = vm.write_data();
    v["writes"] = json!(vm
        .writes()
        .iter()
        .map(|w| {
            let kind = match w.kind {
                write_kind::STORE => "store",
                write_kind::CAS => "cas",
                write_kind::FAA => "faa",
                _ => "invalid",
            };
            let bytes = data
                .get(w.data_offset as usize..(w.data_offset as usize).saturating_add(w.len as usize))
                .map(hex::encode);
            json!({ "kind": kind, "segment": w.segment, "offset": w.offset, "len": w.len,
                    "data_hex": if w.kind == write_kind::STORE { json!(bytes) } else { serde_json::Value::Null },
                    "operand": w.operand, "expected": w.expected })
        })
        .collect::<Vec<_>>());
    v["state"] = json!(vm.state());
    v["trace"] = json!(out.trace);
    v["insns"] = json!(out.insns);
    // A handler's own error code is a valid answer; only an undecodable r0 is a failure.
    (
        v,
        if out.ret.is_some() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        },
    )
}
