//! `naam`: build, verify and run NAAM handlers.
//!
//! Exit codes: 0 success; 1 a handler was rejected, or an invocation faulted or aborted, or
//! (`call`) the message did not succeed or the server could not be reached; 2 bad usage,
//! unreadable input or a failed build.

use naam_runtime::CredentialFile as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use naam_ebpf::abi::{placement, write_kind, Return};
use naam_pipeline::{BpfCpu, BuildOptions};
use naam_proto::step::{Grant, Invocation};
use naam_proto::EngineKind;
use naam_runtime::pipeline::build;
use naam_vm::{load, Executable};
use naam_vm::{time_runs, ExecOptions, StepError, Vm, VmError, DEFAULT_BUDGET, MAX_BUDGET};
use naam_vm::{verify, VerifierConfig, DEFAULT_MAX_INSNS};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "naam",
    version = naam_runtime::version_line!(),
    about = "Build, verify and run NAAM active-message handlers"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    #[command(flatten)]
    verbosity: naam_runtime::logging::Verbosity,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a new handler crate in the new directory NAME: a `no_std` staticlib with an
    /// example handler, its own `[workspace]`, and the naam-ebpf SDK this binary carries
    /// (copied into NAME/naam-ebpf, so no source tree is needed). Then `naam build NAME`.
    New {
        /// The crate's directory (and, with `-` for `_`, its package name).
        name: PathBuf,
    },
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
        /// eBPF instruction set: v3, or v4 (sign-extending loads, signed division, bswap).
        #[arg(long, default_value = "v3")]
        cpu: BpfCpu,
    },
    /// Verify every handler of an object: one line each; exit 0 only if all pass.
    Verify {
        /// eBPF object file.
        object: PathBuf,
        /// Instruction cap.
        #[arg(long, default_value_t = DEFAULT_MAX_INSNS)]
        max_insns: usize,
    },
    /// Run one handler invocation (one step over --segment files) and print the result as
    /// JSON; with --region, run a whole message, every step, over region files.
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
        #[arg(long = "segment", conflicts_with = "regions")]
        segments: Vec<PathBuf>,
        /// Run the whole message over regions: NAME=FILE[,rkey=HEX][,access=r|rw|rwa]
        /// (repeatable; the files are read, never written).
        #[arg(long = "region")]
        regions: Vec<String>,
        /// A descriptor of the message's first step, REGION:OFFSET:LEN[:ACCESS] (with
        /// --region; repeatable).
        #[arg(long = "desc", requires = "regions")]
        descs: Vec<String>,
        /// The handler writes: its Write steps are applied (with --region).
        #[arg(long, requires = "regions")]
        write: bool,
        /// Engine: jit (memory-checked native code) or interp (the reference interpreter).
        #[arg(long, default_value = "jit")]
        engine: EngineKind,
        /// Instructions the step may run before it faults with `budget exhausted`.
        #[arg(long, default_value_t = DEFAULT_BUDGET, value_parser = clap::value_parser!(u64).range(1..=MAX_BUDGET))]
        budget: u64,
        /// Invocations to time; the result of the last one is printed.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
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
    /// Run one message on a deployment (naam-server over UDP), following its steps, and print
    /// the reply as JSON. Exit 0 when it succeeded, 1 otherwise.
    Call(CallArgs),
    /// Deploy an object's handlers into one of your apps on a running naam-server (with
    /// --region, into an app created for your tenant first), over your tenant's session;
    /// prints the verifier's report on each as JSON. Exit 0 when they serve, 1 when the
    /// server refused (the reason is printed) or could not be reached.
    Deploy(DeployArgs),
    /// Take every handler of one of your apps away on a running naam-server (its regions and
    /// data stay). Exit 0 when done, 1 when refused or unreachable.
    Undeploy(UndeployArgs),
    /// Start an in-process cluster, run binary-search lookups against it, congest the host for a
    /// while, and print placement fractions as the steering moves traffic (mode: inproc).
    Demo(DemoArgs),
    /// Run one program the way the public eBPF conformance suite drives a runtime: the program
    /// as hex on stdin, the input memory as hex in the first argument (r1 = its address, r2 =
    /// its length), r0 printed as hex. Refusals and faults go to stderr with exit code 1.
    /// Test tooling: built with the `testing` feature only.
    #[cfg(feature = "testing")]
    ConformancePlugin {
        /// Input memory, hex (absent or empty: no memory).
        memory_hex: Option<String>,
        /// Engine: jit (memory-checked native code) or interp (the reference interpreter).
        #[arg(long, default_value = "jit")]
        engine: EngineKind,
        /// Instruction set of the JIT's code: x86_64 (this host) or aarch64 (run under
        /// qemu-user).
        #[arg(long, default_value = "x86_64")]
        target: String,
    },
}

#[derive(clap::Args)]
struct CallArgs {
    /// naam-server's address.
    #[arg(value_parser = naam_runtime::addr::parse, long)]
    server: std::net::SocketAddr,
    /// The app, by name (or id).
    #[arg(long)]
    app: String,
    /// The handler, by name.
    #[arg(long)]
    handler: String,
    /// Inline args, hex.
    #[arg(long, conflicts_with = "args_file")]
    args_hex: Option<String>,
    /// A file whose bytes are the inline args.
    #[arg(long)]
    args_file: Option<PathBuf>,
    /// A descriptor, REGION:OFFSET:LEN[:ACCESS] (REGION a name of the app's regions or an
    /// rkey; ACCESS r, rw or rwa; default r); repeatable.
    #[arg(long = "desc")]
    descs: Vec<String>,
    /// Where it runs: auto (the server's steering), host, nic or client.
    #[arg(long, default_value = "auto")]
    placement: String,
    /// The tenant to authenticate as (default: the app's name).
    #[arg(long)]
    tenant: Option<String>,
    /// The tenant's credential file (default: keys/<tenant>.key).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Seconds the server may stay silent before the call fails.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// The app's handler object, for the Client placement (which runs the handler here); it
    /// must be the object the server loaded (default: the server's file, if readable here).
    #[arg(long)]
    object: Option<PathBuf>,
}

/// Where a deploy goes, and as whom.
#[derive(clap::Args)]
struct SessionArgs {
    /// naam-server's address.
    #[arg(value_parser = naam_runtime::addr::parse, long)]
    server: std::net::SocketAddr,
    /// The app, by name (or id): one of your tenant's.
    #[arg(long)]
    app: String,
    /// The tenant to authenticate as (default: the app's name).
    #[arg(long)]
    tenant: Option<String>,
    /// The tenant's credential file (default: keys/<tenant>.key).
    #[arg(long, alias = "key")]
    credential: Option<PathBuf>,
    /// Seconds the server may stay silent before the command fails.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
}

#[derive(clap::Args)]
struct DeployArgs {
    #[command(flatten)]
    session: SessionArgs,
    /// The eBPF object (`naam build`'s output).
    object: PathBuf,
    /// A handler to install as a read (it may run at the client, the NIC or the host);
    /// repeatable. Without --read and --write: every handler of the object the app has
    /// now, each as the kind it has.
    #[arg(long = "read")]
    reads: Vec<String>,
    /// A handler to install as a write (it runs at the app's owner); repeatable.
    #[arg(long = "write")]
    writes: Vec<String>,
    /// Engine: tiered, jit or interp (default: the server's, tiered unless configured).
    #[arg(long)]
    engine: Option<EngineKind>,
    /// Instructions a step may run (default: the handler's budget now, else the server's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_BUDGET))]
    budget: Option<u64>,
    /// A region of the app, NAME:BYTES[:ACCESS] (access r, w, a combined; default rw);
    /// repeatable. With --region, the app is created for --tenant if the tenant has no app
    /// of that name (zeroed regions), and kept, data and all, if it has one with these
    /// regions.
    #[arg(long = "region", value_parser = parse_new_region)]
    regions: Vec<naam_proto::control::NewRegion>,
}

/// `--region NAME:BYTES[:ACCESS]` of `naam deploy`.
fn parse_new_region(text: &str) -> Result<naam_proto::control::NewRegion, String> {
    let mut parts = text.split(':');
    let (name, len, access) = (parts.next(), parts.next(), parts.next());
    if parts.next().is_some() {
        return Err("give NAME:BYTES[:ACCESS]".into());
    }
    let name = name.unwrap_or_default();
    naam_proto::control::check_created_name("a region", name)?;
    let len: u64 = len
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .ok_or_else(|| format!("{text}: BYTES is a size in bytes, at least 1"))?;
    let access = match access {
        None => naam_ebpf::abi::ACCESS_READ | naam_ebpf::abi::ACCESS_WRITE,
        Some(a) => naam_runtime::invoke::parse_access(a).map_err(|e| e.to_string())?,
    };
    Ok(naam_proto::control::NewRegion {
        name: name.to_string(),
        len,
        access,
    })
}

#[derive(clap::Args)]
struct UndeployArgs {
    #[command(flatten)]
    session: SessionArgs,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Handler object with `bsearch` (default: the example handlers this binary carries).
    #[arg(long)]
    object: Option<PathBuf>,
    /// Run time, seconds.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Congestion start, seconds.
    #[arg(long, default_value_t = 1.0)]
    congestion_start: f64,
    /// Congestion end, seconds.
    #[arg(long, default_value_t = 2.0)]
    congestion_end: f64,
    /// Extra busy microseconds per host message while congested.
    #[arg(long, default_value_t = 200)]
    extra_us: u64,
    /// Closed-loop client threads.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// Steering policy: auto, host, nic or client.
    #[arg(long, default_value = "auto")]
    policy: String,
    /// Host executor threads.
    #[arg(long, default_value_t = 1)]
    host_executors: usize,
    /// NIC executor threads.
    #[arg(long, default_value_t = 1)]
    nic_executors: usize,
    /// Print interval, milliseconds.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Write the full result as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    naam_runtime::logging::init(cli.verbosity, tracing::level_filters::LevelFilter::WARN);
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("naam: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// The SDK's sources, as this binary was built with them: `naam new` writes them out.
const NAAM_EBPF_FILES: [(&str, &str); 5] = [
    ("src/lib.rs", include_str!("../../../naam-ebpf/src/lib.rs")),
    ("src/abi.rs", include_str!("../../../naam-ebpf/src/abi.rs")),
    ("src/sdk.rs", include_str!("../../../naam-ebpf/src/sdk.rs")),
    (
        "src/hash.rs",
        include_str!("../../../naam-ebpf/src/hash.rs"),
    ),
    (
        "src/eswitch.rs",
        include_str!("../../../naam-ebpf/src/eswitch.rs"),
    ),
];

/// The example handler a new crate starts with (the README's).
const NEW_HANDLER: &str = r#"#![no_std]
use naam_ebpf::{handler, Fault, Return};

handler! {
    /// Sums the first `arg0` little-endian words of segment 0 (a loop over a run-time count).
    fn sum_first(ctx) {
        let n = ctx.arg_u64(0)? as usize;
        let seg = ctx.segment(0)?;
        if n * 8 > seg.len() {
            return Err(Fault::app(1)); // error code app(1) = 4097
        }
        let mut sum = 0u64;
        for i in 0..n {
            sum = sum.wrapping_add(seg.read_u64(i * 8)?); // bounds- and rights-checked
        }
        ctx.reply_u64(sum)?;
        Ok(Return::Done)
    }
}
"#;

/// `naam new NAME` (see [`Cmd::New`]): refuses a directory that exists (exit 2).
fn new_crate(dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    let package = dir
        .file_name()
        .map(|n| n.to_string_lossy().replace('_', "-"))
        .filter(|n| {
            !n.is_empty()
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && n.starts_with(|c: char| c.is_ascii_alphabetic())
        });
    let Some(package) = package else {
        eprintln!(
            "naam: error: {}: a crate name starts with a letter and has letters, digits, - and _",
            dir.display()
        );
        return Ok(ExitCode::from(2));
    };
    if dir.exists() {
        eprintln!("naam: error: {} exists already", dir.display());
        return Ok(ExitCode::from(2));
    }
    let sdk_version = env!("CARGO_PKG_VERSION");
    let manifest = format!(
        "[package]\nname = \"{package}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n\
         [lib]\ncrate-type = [\"staticlib\"]\n\n\
         [dependencies]\n# The SDK naam {sdk_version} carries, copied here by `naam new`.\n\
         naam-ebpf = {{ path = \"naam-ebpf\", features = [\"handler\"] }}\n\n\
         [profile.release]\noverflow-checks = false   # optional, for speed; `naam build` always aborts on panic\n\n\
         # A workspace of its own: builds the same inside any other.\n[workspace]\n"
    );
    let sdk_manifest = format!(
        "[package]\nname = \"naam-ebpf\"\nversion = \"{sdk_version}\"\nedition = \"2021\"\n\n\
         [lib]\ndoctest = false\n\n[features]\nhandler = []\n"
    );
    let mut files = vec![
        (dir.join("Cargo.toml"), manifest),
        (dir.join("src/lib.rs"), NEW_HANDLER.to_string()),
        (dir.join("naam-ebpf/Cargo.toml"), sdk_manifest),
    ];
    for (path, text) in NAAM_EBPF_FILES {
        files.push((dir.join("naam-ebpf").join(path), text.to_string()));
    }
    for (path, text) in &files {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    println!(
        "wrote {} (handler sum_first); next: naam build {} -o {package}.o",
        dir.display(),
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn dispatch(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Demo(args) => demo(args),
        Cmd::Call(args) => call(args),
        Cmd::Deploy(args) => deploy(args),
        Cmd::Undeploy(args) => undeploy(args),
        Cmd::New { name } => new_crate(&name),
        #[cfg(feature = "testing")]
        Cmd::ConformancePlugin {
            memory_hex,
            engine,
            target,
        } => conformance_plugin(memory_hex.as_deref(), engine, &target),
        Cmd::Build {
            crate_dir,
            out,
            target_dir,
            cpu,
        } => {
            let mut opts = BuildOptions::new(&crate_dir);
            opts.out = out;
            opts.target_dir = target_dir;
            opts.cpu = cpu;
            let built =
                build(&opts).with_context(|| format!("building {}", crate_dir.display()))?;
            for w in &built.linker_warnings {
                eprintln!("bpf-linker: {w}");
            }
            println!(
                "wrote {} (handlers: {})",
                built.object.display(),
                built.handler_names().join(", ")
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Verify { object, max_insns } => {
            let bytes =
                std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
            let loaded = load(&bytes).with_context(|| format!("loading {}", object.display()))?;
            let mut config = VerifierConfig::default();
            config.max_insns = max_insns;
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
            regions,
            descs,
            write,
            engine,
            budget,
            repeat,
            step,
            state,
            max_insns,
        } => {
            let bytes =
                std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
            let loaded = load(&bytes).with_context(|| format!("loading {}", object.display()))?;
            let program = loaded.get(&handler)?;
            if !regions.is_empty() {
                let args = hex::decode(args_hex.trim()).context("--args-hex is not valid hex")?;
                return run_message(
                    loaded.clone(),
                    &handler,
                    write,
                    engine,
                    budget,
                    &args,
                    &regions,
                    &descs,
                );
            }
            let mut options = ExecOptions::new(engine, budget);
            options.verifier.max_insns = max_insns;
            let exe = match Executable::build(program, &options) {
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
            let grants: Vec<Grant> = data.iter().map(|d| Grant::read(d)).collect();
            let inv = Invocation {
                step,
                placement: placement::STANDALONE,
                args: &args,
                state: words,
                segments: &grants,
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

/// `naam run --region`: the whole message on a local one-app cluster.
#[allow(clippy::too_many_arguments)]
fn run_message(
    object: naam_vm::LoadedObject,
    handler: &str,
    write: bool,
    engine: EngineKind,
    budget: u64,
    args: &[u8],
    regions: &[String],
    descs: &[String],
) -> anyhow::Result<ExitCode> {
    use naam_runtime::invoke::{parse_region, reply_json, run_local, LocalMessage};
    let mut files = Vec::new();
    for spec in regions {
        let r = parse_region(spec)?;
        let bytes = std::fs::read(&r.file)
            .with_context(|| format!("reading region file {}", r.file.display()))?;
        if bytes.is_empty() {
            bail!("region {}: {} is empty", r.name, r.file.display());
        }
        files.push((r, bytes));
    }
    let (reply, rkeys) = run_local(LocalMessage {
        object: std::sync::Arc::new(object),
        handler,
        write,
        engine,
        budget,
        regions: files,
        args,
        descriptors: descs,
    })?;
    let mut v = reply_json(&reply);
    v["mode"] = json!("standalone message (in-process cluster, host placement)");
    v["handler"] = json!(handler);
    v["engine"] = json!(engine.name());
    v["regions"] = json!(rkeys
        .iter()
        .map(|(name, rkey, len)| json!({ "name": name, "rkey": format!("{rkey:#x}"), "len": len }))
        .collect::<Vec<_>>());
    println!("{v}");
    // As for one step: a handler's own error is an answer; a fault or a refusal is not.
    let ok = matches!(
        reply.status,
        naam_proto::wire::Status::Ok | naam_proto::wire::Status::HandlerError
    );
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A session as `a` names it, and the app it names (created first with `regions`, if
/// any); `Err`: the exit code, the error printed.
fn deploy_session(
    a: &SessionArgs,
    regions: &[naam_proto::control::NewRegion],
) -> Result<
    (
        naam_runtime::udp::UdpClient,
        naam_proto::control::AppManifest,
    ),
    ExitCode,
> {
    use naam_runtime::udp::{UdpClient, UdpConfig};
    let fail = |code: u8, m: String| {
        eprintln!("naam: error: {m}");
        ExitCode::from(code)
    };
    if !(a.timeout.is_finite() && (0.1..=3600.0).contains(&a.timeout)) {
        return Err(fail(2, "--timeout must be 0.1 to 3600 seconds".into()));
    }
    if !regions.is_empty() && a.tenant.is_none() {
        return Err(fail(
            2,
            "--region creates the app for a tenant: name it with --tenant".into(),
        ));
    }
    let tenant = a.tenant.clone().unwrap_or_else(|| a.app.clone());
    let key_path = a
        .credential
        .clone()
        .unwrap_or_else(|| PathBuf::from("keys").join(format!("{tenant}.key")));
    let credential = naam_proto::session::Credential::load(&key_path).map_err(|e| {
        fail(
            2,
            format!(
                "no credential for tenant {tenant} at {}: {e}",
                key_path.display()
            ),
        )
    })?;
    let mut config = UdpConfig::new(a.server, &tenant, credential);
    config.liveness = std::time::Duration::from_secs_f64(a.timeout);
    let mut client = UdpClient::connect(&config).map_err(|e| {
        fail(
            1,
            format!("connecting to naam-server at {} as {tenant}: {e}", a.server),
        )
    })?;
    if !regions.is_empty() {
        if let Err(e) = client.create_app(&a.app, regions.to_vec()) {
            return Err(fail(1, format!("creating app {}: {e}", a.app)));
        }
    }
    let app = find_app(&client, a, &tenant)?;
    Ok((client, app))
}

/// The app `a` names in `client`'s session of `tenant`; `Err`: exit 1, the error printed.
fn find_app(
    client: &naam_runtime::udp::UdpClient,
    a: &SessionArgs,
    tenant: &str,
) -> Result<naam_proto::control::AppManifest, ExitCode> {
    let fail = |code: u8, m: String| {
        eprintln!("naam: error: {m}");
        ExitCode::from(code)
    };
    let manifest = client.manifest();
    let Some(app) = manifest
        .apps
        .iter()
        .find(|x| x.name == a.app || x.id.to_string() == a.app)
        .cloned()
    else {
        let names: Vec<&str> = manifest.apps.iter().map(|x| x.name.as_str()).collect();
        return Err(fail(
            1,
            format!(
                "no app `{}` in {tenant}'s session: a tenant deploys only into its own apps \
                 (it has: {})",
                a.app,
                names.join(", ")
            ),
        ));
    };
    Ok(app)
}

/// Prints what a deploy or undeploy made, as JSON.
fn print_deployment(app: &str, d: &naam_runtime::udp::Deployment) {
    let handlers: Vec<_> = d
        .handlers
        .iter()
        .map(|h| {
            json!({
                "name": h.name,
                "id": format!("{:#010x}", h.id),
                "kind": if h.write { "write" } else { "read" },
                "engine": h.engine.name(),
                "budget": h.budget,
                "insns": h.insns,
                "functions": h.functions,
                "helpers": h.helpers,
                "backward_jumps": h.backward_jumps,
                "accesses": {
                    "proven": h.accesses[0],
                    "hinted": h.accesses[1],
                    "checked": h.accesses[2],
                },
                "build_us": h.build_us,
            })
        })
        .collect();
    let out = json!({
        "app": app,
        "id": d.app,
        "version": d.version,
        "handlers": handlers,
    });
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
}

/// `naam deploy` (see [`Cmd::Deploy`]).
fn deploy(a: DeployArgs) -> anyhow::Result<ExitCode> {
    use naam_proto::control::DeployHandler;
    let bytes = match std::fs::read(&a.object) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("naam: error: {}: {e}", a.object.display());
            return Ok(ExitCode::from(2));
        }
    };
    let object = match load(&bytes) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("naam: error: {}: {e}", a.object.display());
            return Ok(ExitCode::from(2));
        }
    };
    let (mut client, app) = match deploy_session(&a.session, &a.regions) {
        Ok(x) => x,
        Err(code) => return Ok(code),
    };
    let in_object: Vec<&str> = object.programs.iter().map(|p| p.name.as_str()).collect();
    let mut handlers: Vec<DeployHandler> = Vec::new();
    for (names, write) in [(&a.reads, false), (&a.writes, true)] {
        for n in names {
            if !in_object.contains(&n.as_str()) {
                eprintln!(
                    "naam: error: {} has no handler `{n}` (it has: {})",
                    a.object.display(),
                    in_object.join(", ")
                );
                return Ok(ExitCode::from(2));
            }
            handlers.push(DeployHandler {
                name: n.clone(),
                write,
            });
        }
    }
    if handlers.is_empty() {
        // Every handler of the object the app has now, as the kind it has.
        handlers = app
            .handlers
            .iter()
            .filter(|h| in_object.contains(&h.name.as_str()))
            .map(|h| DeployHandler {
                name: h.name.clone(),
                write: h.write,
            })
            .collect();
        if handlers.is_empty() {
            eprintln!(
                "naam: error: app {} has none of {}'s handlers ({}): name them with --read \
                 and --write",
                app.name,
                a.object.display(),
                in_object.join(", ")
            );
            return Ok(ExitCode::from(2));
        }
    }
    match client.deploy(app.id, &bytes, handlers, a.engine, a.budget) {
        Ok(d) => {
            print_deployment(&app.name, &d);
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("naam: error: deploying into app {}: {e}", app.name);
            Ok(ExitCode::from(1))
        }
    }
}

/// `naam undeploy` (see [`Cmd::Undeploy`]).
fn undeploy(a: UndeployArgs) -> anyhow::Result<ExitCode> {
    let (mut client, app) = match deploy_session(&a.session, &[]) {
        Ok(x) => x,
        Err(code) => return Ok(code),
    };
    match client.undeploy(app.id) {
        Ok(d) => {
            print_deployment(&app.name, &d);
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("naam: error: undeploying app {}: {e}", app.name);
            Ok(ExitCode::from(1))
        }
    }
}

/// `naam call`: one message on a deployment.
fn call(a: CallArgs) -> anyhow::Result<ExitCode> {
    use naam_proto::transport::Transport;
    use naam_runtime::invoke::{parse_descriptor, reply_json};
    use naam_runtime::udp::{UdpClient, UdpConfig};
    let usage = |m: String| -> anyhow::Result<ExitCode> {
        eprintln!("naam: error: {m}");
        Ok(ExitCode::from(2))
    };
    if !(a.timeout.is_finite() && (0.1..=3600.0).contains(&a.timeout)) {
        return usage("--timeout must be 0.1 to 3600 seconds".into());
    }
    let pin = match a.placement.as_str() {
        "auto" => None,
        p => match p.parse::<naam_proto::Placement>() {
            Ok(p) => Some(p),
            Err(e) => return usage(format!("--placement {p}: {e}, or auto")),
        },
    };
    let args = match (&a.args_hex, &a.args_file) {
        (Some(h), _) => match hex::decode(h.trim()) {
            Ok(b) => b,
            Err(e) => return usage(format!("--args-hex is not valid hex: {e}")),
        },
        (None, Some(f)) => match std::fs::read(f) {
            Ok(b) => b,
            Err(e) => return usage(format!("--args-file {}: {e}", f.display())),
        },
        (None, None) => Vec::new(),
    };
    let tenant = a.tenant.clone().unwrap_or_else(|| a.app.clone());
    let key_path = a
        .key
        .clone()
        .unwrap_or_else(|| PathBuf::from("keys").join(format!("{tenant}.key")));
    // Arguments past the wire's limit are bad input, refused before any work.
    if let Err(e) = naam_proto::wire::Request::check_call(&args, &[]) {
        return usage(format!("--args: {e}"));
    }
    let credential = match naam_proto::session::Credential::load(&key_path) {
        Ok(c) => c,
        Err(e) => {
            return usage(format!(
                "app `{}`: no credential to authenticate as its tenant {tenant} ({e}). naam \
                 call authenticates as the app's tenant: --tenant NAME and --key FILE name \
                 another; if the server serves no app `{}`, check --app",
                a.app, a.app
            ))
        }
    };
    let mut config = UdpConfig::new(a.server, &tenant, credential);
    config.pin = pin;
    config.inject_loss = match naam_runtime::udp::injected_loss_from_env() {
        Ok(loss) => loss,
        Err(e) => return usage(e),
    };
    config.liveness = std::time::Duration::from_secs_f64(a.timeout);
    let failed = |m: String| -> anyhow::Result<ExitCode> {
        eprintln!("naam: error: {m}");
        Ok(ExitCode::from(1))
    };
    let mut client = match UdpClient::connect(&config) {
        Ok(c) => c,
        Err(e) => {
            return failed(format!(
                "connecting to naam-server at {} as {tenant}: {e}",
                a.server
            ))
        }
    };
    let manifest = client.manifest().clone();
    let Some(app) = manifest
        .apps
        .iter()
        .find(|x| x.name == a.app || x.id.to_string() == a.app)
    else {
        return usage(format!(
            "no app `{}` in {tenant}'s session (it may use: {})",
            a.app,
            app_names(&manifest.apps)
        ));
    };
    if !app.handlers.iter().any(|h| h.name == a.handler) {
        let names: Vec<&str> = app.handlers.iter().map(|h| h.name.as_str()).collect();
        return usage(format!(
            "app {} has no handler `{}` (it has: {})",
            app.name,
            a.handler,
            names.join(", ")
        ));
    }
    let rkey_of = |name: &str| app.region_key(name);
    let mut descs = Vec::new();
    for d in &a.descs {
        match parse_descriptor(d, &rkey_of) {
            Ok(d) => descs.push(d),
            Err(e) => return usage(e.to_string()),
        }
    }
    // The Client placement runs the handler here: it needs the server's object, which this
    // machine can read only beside the server.
    let same = |b: &Vec<u8>| naam_proto::control::object_hash(b) == app.object_hash;
    let object = match &a.object {
        Some(path) => match std::fs::read(path) {
            Ok(b) if same(&b) => Some(b),
            Ok(_) => {
                return usage(format!(
                    "--object {}: not the object naam-server loaded for {}",
                    path.display(),
                    app.name
                ))
            }
            Err(e) => return usage(format!("--object {}: {e}", path.display())),
        },
        None => std::fs::read(&app.object).ok().filter(same),
    };
    match (&object, pin) {
        (Some(bytes), _) => client
            .install_handlers(app.id, bytes)
            .context("installing the server's handlers for the Client placement")?,
        (None, Some(naam_proto::Placement::Client)) => {
            return usage(format!(
                "--placement client runs the handler here: give its object with --object FILE \
                 (the server's, {}, is not readable here)",
                app.object
            ))
        }
        (None, _) => {}
    }
    let reply = match client.call(app.id, naam_proto::handler_id(&a.handler), &args, &descs) {
        Ok(r) => r,
        Err(e) => return failed(format!("calling {}/{}: {e}", app.name, a.handler)),
    };
    let mut v = reply_json(&reply);
    v["app"] = json!(app.name);
    v["handler"] = json!(a.handler);
    println!("{v}");
    Ok(if reply.status == naam_proto::wire::Status::Ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    use naam_proto::handler_id;
    use naam_proto::steering::CostPolicyConfig;
    use naam_proto::Placement;
    use naam_runtime::cluster::{AppSpec, Cluster, ClusterConfig, PolicyChoice, RegionSpec};
    use naam_runtime::experiment::{read_call, run_shift, ShiftConfig};
    use naam_runtime::HandlerSpec;
    use std::time::Duration;

    if !(args.seconds > 0.0
        && args.congestion_start <= args.congestion_end
        && args.congestion_end <= args.seconds)
    {
        bail!("need 0 <= --congestion-start <= --congestion-end <= --seconds");
    }
    let policy = match args.policy.as_str() {
        "auto" => PolicyChoice::Auto(CostPolicyConfig::default()),
        other => PolicyChoice::Always(other.parse::<Placement>().map_err(anyhow::Error::msg)?),
    };
    let loaded = match &args.object {
        Some(object) => {
            let bytes =
                std::fs::read(object).with_context(|| format!("reading {}", object.display()))?;
            load(&bytes).with_context(|| format!("loading {}", object.display()))?
        }
        None => load(naam_examples::HANDLERS_OBJECT)
            .context("loading the example handlers this binary carries")?,
    };
    const APP: u32 = 1;
    const N: u64 = 4_096;
    let sorted: Vec<u8> = (0..N).flat_map(|i| (i * 2).to_le_bytes()).collect();
    let mut config = ClusterConfig::default();
    config.host_executors = args.host_executors;
    config.nic_executors = args.nic_executors;
    config.policy = policy;
    let cluster = Cluster::builder()
        .config(config)
        .app(AppSpec {
            id: APP,
            name: "demo".into(),
            owner: Placement::Host,
            regions: vec![RegionSpec {
                name: "sorted".into(),
                access: naam_runtime::READ_ONLY,
                contents: sorted,
            }],
            object: std::sync::Arc::new(loaded),
            handlers: vec![HandlerSpec::read("bsearch")],
        })
        .build()?;
    let rkey = cluster.region_key(APP, "sorted").context("region")?;
    let desc = naam_ebpf::abi::Descriptor {
        rkey,
        offset: 0,
        len: (N * 8) as u32,
        access: naam_ebpf::abi::ACCESS_READ,
    };
    let mut shift = ShiftConfig::default();
    shift.duration = Duration::from_secs_f64(args.seconds);
    shift.congestion = (
        Duration::from_secs_f64(args.congestion_start),
        Duration::from_secs_f64(args.congestion_end),
    );
    shift.host_extra_ns = args.extra_us * 1000;
    shift.clients = args.clients;
    shift.sample = Duration::from_millis(1);
    println!(
        "mode: inproc (one process; NIC cores, DMA and one-sided RDMA are emulated, not hardware)\n\
         policy: {}; host congested +{} us/message from {:.1}s to {:.1}s; {} client thread(s); bsearch over {N} keys",
        cluster.policy_name(), args.extra_us, args.congestion_start, args.congestion_end, args.clients
    );
    let result = run_shift(
        &cluster,
        &shift,
        read_call(
            APP,
            handler_id("bsearch"),
            12_345u64.to_le_bytes().to_vec(),
            vec![desc],
        ),
    );
    println!(
        "{:>7}  {:>7} {:>7} {:>7}  {:>10}",
        "t (s)", "client", "nic", "host", "ops/s"
    );
    let per = (args.interval_ms.max(1)) as usize;
    for chunk in result.samples.chunks(per) {
        let mut ops = [0u64; 3];
        for s in chunk {
            for (sum, n) in ops.iter_mut().zip(s.ops) {
                *sum += n;
            }
        }
        let total: u64 = ops.iter().sum();
        let pct = |i: usize| {
            if total == 0 {
                0.0
            } else {
                100.0 * ops[i] as f64 / total as f64
            }
        };
        let t = chunk.last().map_or(0.0, |s| s.t);
        let secs = chunk.len() as f64 * shift.sample.as_secs_f64();
        let marker = if t > args.congestion_start && t <= args.congestion_end + 1e-9 {
            "  congested"
        } else {
            ""
        };
        println!(
            "{t:>7.2}  {:>6.1}% {:>6.1}% {:>6.1}%  {:>10.0}{marker}",
            pct(0),
            pct(1),
            pct(2),
            total as f64 / secs
        );
    }
    let ms = |v: Option<f64>| v.map_or("never".to_string(), |x| format!("{x:.1} ms"));
    println!(
        "steering: 90% of traffic off the host {} after congestion onset; back on the host {} after it ended",
        ms(result.moved_ms),
        ms(result.back_ms)
    );
    let snap = cluster.metrics().snapshot();
    for p in Placement::ALL {
        let q = snap.placement[p.index()];
        if q.count > 0 {
            println!(
                "latency at {p}: p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us ({} ops)",
                q.p50 as f64 / 1e3,
                q.p99 as f64 / 1e3,
                q.p999 as f64 / 1e3,
                q.count
            );
        }
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "result": result,
            "latency": snap,
            "weights_timeline": cluster.metrics().timeline(),
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    cluster.shutdown();
    Ok(ExitCode::SUCCESS)
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
    result: Result<naam_vm::StepOutput, StepError>,
    ns: f64,
) -> (serde_json::Value, ExitCode) {
    let base = json!({ "handler": exe.name(), "engine": exe.engine().name(), "mode": "standalone", "ns_per_invocation": ns,
        "compile_ns": exe.compile_time().as_nanos() as u64, "budget": exe.budget() });
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
        v["error_name"] = json!(naam_ebpf::abi::error_code::Describe(code).to_string());
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
        .map(|d| json!({ "rkey": d.rkey, "offset": d.offset, "len": d.len, "access": naam_ebpf::abi::Rights(d.access).to_string() }))
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

#[cfg(feature = "testing")]
/// The conformance-suite plugin: exit 0 with r0 on stdout, 1 when the program is refused or
/// faults, 2 for bad usage.
fn conformance_plugin(
    memory_hex: Option<&str>,
    engine: EngineKind,
    target: &str,
) -> anyhow::Result<ExitCode> {
    use naam_vm::jit::Target;
    use naam_vm::Program;
    use std::io::Read as _;
    let target = match target {
        "x86_64" | "x86-64" | "host" => Target::Host,
        "aarch64" | "arm64" => Target::Aarch64,
        other => bail!("unknown target `{other}` (x86_64, aarch64)"),
    };
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading the program from stdin")?;
    let hex_of = |s: &str, what: &str| -> anyhow::Result<Vec<u8>> {
        let clean: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        hex::decode(&clean).with_context(|| format!("{what} is not valid hex"))
    };
    let code = hex_of(&text, "the program")?;
    let memory = hex_of(memory_hex.unwrap_or(""), "the memory argument")?;
    let program = Program::from_bytecode("conformance", code);
    let options = ExecOptions::conformance(engine);
    let outcome = match target {
        Target::Host => naam_vm::conformance::run_host(&program, &options, &memory),
        Target::Aarch64 => naam_vm::conformance::run_aarch64(&program, &options, &memory),
    };
    match outcome {
        Ok(r0) => {
            println!("{r0:x}");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("naam conformance-plugin: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

/// The apps a session may use, for an error message: each name once with its ids (instances
/// of one app share a name), the first 8 ids of a name and a count of the rest.
fn app_names(apps: &[naam_runtime::proto::control::AppManifest]) -> String {
    let mut by_name: Vec<(&str, Vec<u32>)> = Vec::new();
    for a in apps {
        match by_name.iter_mut().find(|(n, _)| *n == a.name) {
            Some((_, ids)) => ids.push(a.id),
            None => by_name.push((a.name.as_str(), vec![a.id])),
        }
    }
    by_name
        .iter()
        .map(|(name, ids)| {
            let shown: Vec<String> = ids.iter().take(8).map(u32::to_string).collect();
            let more = match ids.len().saturating_sub(8) {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            format!("{name} (id {}{more})", shown.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}
