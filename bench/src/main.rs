//! `naam-bench`: YCSB and key-distribution runs. Exit codes: 0 success, 1 a run failed,
//! 2 bad usage.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use naam_bench::driver::{run_inproc, run_udp, App, PlacementChoice, YcsbConfig, YcsbResult};
use naam_bench::ycsb::{Distribution, KeyChooser, RecordShape, Rng, Workload};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "naam-bench",
    version = naam_runtime::version_line!(),
    about = "YCSB on NAAM (MICA, B-tree) and key distributions"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    /// Directory of credentials for the udp fabric (`<tenant>.key`, as `naam-server keygen`
    /// writes them); default: $NAAM_KEYS, else `keys`.
    #[arg(long, global = true)]
    keys: Option<std::path::PathBuf>,
    /// With the udp fabric: how long naam-server may stay silent before the run fails
    /// (exit 1), seconds.
    #[arg(long, global = true, default_value_t = 10.0)]
    liveness: f64,
    #[command(flatten)]
    verbosity: naam_runtime::logging::Verbosity,
}

#[derive(Subcommand)]
enum Cmd {
    /// Shows naam-server's switch (XDP eSwitch or user-space) and its per-destination counters;
    /// optionally pins the NIC share of every read handler in the eSwitch's map.
    Switch {
        /// naam-server's address.
        #[arg(value_parser = naam_runtime::addr::parse, long)]
        server: std::net::SocketAddr,
        /// Pin the NIC share, per mille (0..=1000).
        #[arg(long)]
        pin_nic_permille: Option<u32>,
        /// Return to the steering weights.
        #[arg(long)]
        unpin: bool,
    },
    /// Checks a deployment's answers: each client thread writes versioned values to its own
    /// keys and every read must return the last one written. Exit 1 on any wrong answer or
    /// failed call.
    Verify {
        /// Application: mica or btree.
        #[arg(long, default_value = "mica")]
        app: App,
        /// naam-server's address.
        #[arg(value_parser = naam_runtime::addr::parse, long)]
        server: std::net::SocketAddr,
        /// Where reads run: auto, host, nic or client.
        #[arg(long, default_value = "auto")]
        placement: PlacementChoice,
        /// Client threads.
        #[arg(long, default_value_t = 2, value_parser = positive_usize())]
        threads: usize,
        /// Operations per thread at most.
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
        ops: u64,
        /// Seconds at most.
        #[arg(long, default_value_t = 30.0)]
        seconds: f64,
        /// Failed calls tolerated (timeouts while a peer restarts); wrong answers never are.
        #[arg(long, default_value_t = 0)]
        max_errors: u64,
    },
    /// The discrete-event simulator: the real endpoints, steering and handlers in virtual time
    /// on a hardware profile's links and cores (figures labelled `sim:<profile>`: a model,
    /// not a measurement).
    Sim {
        #[command(subcommand)]
        what: SimCmd,
    },
    /// YCSB: `ycsb [load|run] -P workloads/workloadb [-p key=value]...`; prints YCSB's output
    /// (status lines every 10 s on stderr), then NAAM's per-placement lines.
    Ycsb(naam_bench::ycsb_cli::YcsbArgs),
    /// YCSB A, B and C on NAAM MICA (in-process) and on memcached (loopback), in one run.
    CompareMemcached {
        /// Workloads (of a, b, c).
        #[arg(long, default_value = "a,b,c", value_delimiter = ',')]
        workloads: Vec<char>,
        /// Records to load.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        records: u64,
        /// Operations per workload.
        #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
        ops: u64,
        /// Client threads.
        #[arg(long, default_value_t = 1, value_parser = positive_usize())]
        threads: usize,
        /// Operations each client thread keeps in flight, on every system compared (NAAM over
        /// UDP pipelines messages in its session; memcached pipelines commands on its
        /// connection).
        #[arg(long, default_value_t = 1, value_parser = positive_usize())]
        pipeline: usize,
        /// memcached worker threads.
        #[arg(long, default_value_t = 1, value_parser = positive_usize())]
        memcached_threads: usize,
        /// Also run NAAM over UDP against naam-server at this address (its config must serve a
        /// MICA app sized for the records).
        #[arg(value_parser = naam_runtime::addr::parse, long)]
        server: Option<std::net::SocketAddr>,
        /// Random seed for key and operation draws, shared by the NAAM and memcached runs.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Write the results here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Run one of the paper's experiments; writes NAME.json and SVG charts into --out.
    Experiment {
        /// shift, capacity, scale, engines, placements, placements-congested, auth-cost, udp-ceiling
        /// or deploys (--ops deploys timed, --rounds, --seconds per phase, --records).
        name: String,
        /// Output directory.
        #[arg(long, default_value = "bench/out")]
        out: PathBuf,
        /// Run time for time-based experiments, seconds.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Operations per measurement.
        #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..))]
        ops: u64,
        /// Extra busy microseconds per host message while congested.
        #[arg(long, default_value_t = 200)]
        extra_us: u64,
        /// Emulated NIC executors (capacity).
        #[arg(long, default_value_t = 1, value_parser = positive_usize())]
        nic_executors: usize,
        /// App counts (scale).
        #[arg(long, value_delimiter = ',', default_value = "1,8,64,256,1024")]
        counts: Vec<u32>,
        /// Offered loads in ops/s (placements).
        #[arg(long, value_delimiter = ',', default_value = "5000,20000,50000,100000")]
        rates: Vec<u64>,
        /// Fabric: inproc (one process) or udp (naam-server at --server, which must allow
        /// congestion control for shift and placements-congested).
        #[arg(long, default_value = "inproc")]
        fabric: String,
        /// naam-server's address (with --fabric udp).
        #[arg(value_parser = naam_runtime::addr::parse, long)]
        server: Option<std::net::SocketAddr>,
        /// Rounds (auth-cost: each runs both modes once, in alternating order).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
        rounds: u32,
        /// Records loaded (auth-cost).
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        records: u64,
        /// Client threads (auth-cost).
        #[arg(long, default_value_t = 1, value_parser = positive_usize())]
        threads: usize,
        /// Deploys a tenant may make a second on the experiment's server (deploys); the timed
        /// deploys are spaced by its inverse.
        #[arg(long, default_value_t = naam_runtime::proto::limits::DEPLOYS_PER_SECOND)]
        deploy_rate: f64,
    },
    /// Print a core workload file this binary carries (`workloads/workload<LETTER>`), to edit
    /// and pass with -P: `naam-bench workload a > workloada`.
    Workload {
        /// a to f.
        letter: char,
    },
    /// Draw key numbers from a distribution and write per-key counts.
    Keys {
        /// scrambled-zipfian, zipfian, uniform or latest.
        #[arg(long, default_value = "scrambled-zipfian")]
        dist: Distribution,
        /// Number of keys to draw from (key numbers 0 to records - 1).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        records: u64,
        /// Key numbers drawn in all.
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
        draws: u64,
        /// Random seed (the same seed gives the same counts).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Write the counts here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

impl Cmd {
    /// The `--json` file the command writes at its end, if any.
    fn json_out(&self) -> Option<&std::path::Path> {
        match self {
            Cmd::Ycsb(naam_bench::ycsb_cli::YcsbArgs { json, .. })
            | Cmd::CompareMemcached { json, .. }
            | Cmd::Keys { json, .. } => json.as_deref(),
            _ => None,
        }
    }
}

/// Refuses a `--json` path whose directory does not exist, before the run rather than after.
fn check_json_out(path: &std::path::Path) -> Result<(), String> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if path.is_dir() {
        return Err(format!("--json {} is a directory", path.display()));
    }
    if !dir.is_dir() {
        return Err(format!(
            "--json {}: the directory {} does not exist",
            path.display(),
            dir.display()
        ));
    }
    Ok(())
}

/// Parses a count that must be at least 1 (clap refuses 0 with exit 2 before any work).
fn positive_usize() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

/// What every simulated experiment takes.
#[derive(clap::Args)]
struct SimExperimentArgs {
    /// A built-in profile (bluefield2-100g) or a profile file (TOML).
    #[arg(long, default_value = "bluefield2-100g")]
    profile: String,
    /// Every random draw comes from it.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory (sim-NAME.json and charts).
    #[arg(long, default_value = "bench/out")]
    out: PathBuf,
    /// Smaller sweeps and shorter windows (a smoke run).
    #[arg(long)]
    quick: bool,
}

#[derive(Subcommand)]
enum SimCmd {
    /// Offload capacity: MICA YCSB-B and B-tree lookups served by the NIC's cores alone.
    Capacity(SimExperimentArgs),
    /// Host, NIC and steered placements over offered load (MICA YCSB-B).
    Placements(SimExperimentArgs),
    /// The host congested for one second: how fast the steering moves reads off it and back.
    Shift(SimExperimentArgs),
    /// 1 to 1,024 apps (tenants) under one offered load: latency as apps grow.
    Scale(SimExperimentArgs),
    /// 1 to 8 servers behind one switch (32 clients each, records spread by key hash).
    Servers(SimExperimentArgs),
    /// Measures this machine's constants (the JIT, copies, loopback UDP, the endpoints) and
    /// writes them as a profile (`--profile FILE` then simulates this machine).
    Calibrate {
        /// Where the profile goes.
        #[arg(long, default_value = "bench/profiles/this-machine.toml")]
        out: PathBuf,
        /// Fewer samples (a smoke run).
        #[arg(long)]
        quick: bool,
    },
    /// One YCSB run on MICA: loads the records, warms up, measures; prints the report as JSON
    /// (the same bytes for the same arguments and seed).
    Run {
        /// A built-in profile (bluefield2-100g) or a profile file (TOML).
        #[arg(long, default_value = "bluefield2-100g")]
        profile: String,
        /// Every random draw comes from it.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Client machines (one YCSB thread and session each).
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=60_000))]
        clients: u64,
        /// Operations each client keeps outstanding.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
        window: u64,
        /// Records loaded first.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
        records: u64,
        /// Target operations per second over all clients (YCSB's -target); none: closed loop.
        #[arg(long)]
        target: Option<f64>,
        /// Core workload (a, b, c, d or f).
        #[arg(long, default_value = "b")]
        workload: char,
        /// Application every tenant runs: mica or btree.
        #[arg(long, default_value = "mica")]
        app: App,
        /// Apps (tenants), each with its regions and handlers; clients spread over them.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=60_000))]
        apps: u64,
        /// Virtual milliseconds measured.
        #[arg(long, default_value_t = 50.0)]
        measure_ms: f64,
        /// Virtual milliseconds of warm-up after the load.
        #[arg(long, default_value_t = 10.0)]
        warmup_ms: f64,
        /// Where reads run: auto (the steering), host, nic or client.
        #[arg(long, default_value = "auto")]
        placement: PlacementChoice,
        /// Servers behind the switch, each with its SmartNIC; records spread by key hash.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        servers: u64,
        /// The loops report their receive queues' delay to the steering (which the deployment's
        /// loops do not yet: see RESULTS, "The simulator").
        #[arg(long)]
        loop_waits: bool,
        /// Also write the report here.
        #[arg(long)]
        json_out: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    // Die quietly of SIGPIPE, as command-line tools do, when the reader of stdout goes away
    // (`naam-bench ycsb | head`), instead of panicking in `println!`.
    // SAFETY: called first thing in main, before any thread exists; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // A YCSB command line as YCSB spells it (`-load`, `-threads 4`) reads as NAAM's.
    let (args, notes) = naam_bench::ycsb_cli::with_ycsb_spellings(std::env::args_os());
    let cli = Cli::parse_from(args);
    for n in notes {
        eprintln!("naam-bench: note: {n}");
    }
    naam_runtime::logging::init(cli.verbosity, tracing::level_filters::LevelFilter::WARN);
    if !(cli.liveness.is_finite() && (0.1..=3600.0).contains(&cli.liveness)) {
        eprintln!("naam-bench: error: --liveness must be 0.1 to 3600 seconds");
        return ExitCode::from(2);
    }
    if let Some(Err(e)) = cli.command.json_out().map(check_json_out) {
        eprintln!("naam-bench: error: {e}");
        return ExitCode::from(2);
    }
    naam_bench::udp_client::set_liveness(std::time::Duration::from_secs_f64(cli.liveness));
    naam_bench::udp_client::set_dir(
        cli.keys
            .or_else(|| std::env::var_os("NAAM_KEYS").map(Into::into))
            .unwrap_or_else(|| "keys".into()),
    );
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("naam-bench: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn sim_setup(a: SimExperimentArgs) -> Result<naam_bench::sim::experiments::Setup, ExitCode> {
    let profile = naam_bench::sim::Profile::load(&a.profile).map_err(|e| {
        eprintln!("naam-bench: error: {e}");
        ExitCode::from(2)
    })?;
    Ok(naam_bench::sim::experiments::Setup {
        profile,
        seed: a.seed,
        out: a.out,
        command: command_line(),
        quick: a.quick,
    })
}

fn sim(what: SimCmd) -> anyhow::Result<ExitCode> {
    use naam_bench::sim::experiments;
    let experiment = |a: SimExperimentArgs,
                      f: &dyn Fn(&experiments::Setup) -> anyhow::Result<PathBuf>|
     -> anyhow::Result<ExitCode> {
        let setup = match sim_setup(a) {
            Ok(s) => s,
            Err(code) => return Ok(code),
        };
        let path = f(&setup)?;
        println!("{}", path.display());
        Ok(ExitCode::SUCCESS)
    };
    match what {
        SimCmd::Capacity(a) => experiment(a, &|s| Ok(experiments::capacity(s)?.0)),
        SimCmd::Placements(a) => experiment(a, &|s| Ok(experiments::placements(s)?.0)),
        SimCmd::Shift(a) => experiment(a, &|s| Ok(experiments::shift(s)?.0)),
        SimCmd::Scale(a) => experiment(a, &|s| Ok(experiments::scale(s)?.0)),
        SimCmd::Servers(a) => experiment(a, &|s| Ok(experiments::servers(s)?.0)),
        SimCmd::Calibrate { out, quick } => {
            let c = naam_bench::sim::calibrate::measure(quick)?;
            let when = format!(
                "{} s after 1970, {}",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                command_line()
            );
            let text = naam_bench::sim::calibrate::profile_text(&c, &when);
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
            }
            std::fs::write(&out, &text)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
            println!("{}", serde_json::to_string_pretty(&c)?);
            eprintln!("naam-bench: wrote {}", out.display());
            Ok(ExitCode::SUCCESS)
        }
        SimCmd::Run {
            profile,
            seed,
            clients,
            window,
            records,
            target,
            workload,
            app,
            apps,
            measure_ms,
            warmup_ms,
            placement,
            servers,
            loop_waits,
            json_out,
        } => {
            let bad = |name: &str| {
                anyhow::anyhow!(
                    "--{name} must be a positive number of milliseconds, at most 60,000"
                )
            };
            let ms = |v: f64, name: &str| -> anyhow::Result<u64> {
                if v.is_finite() && v > 0.0 && v <= 60_000.0 {
                    Ok((v * 1e6) as u64)
                } else {
                    Err(bad(name))
                }
            };
            let (measure_ns, warmup_ns) =
                match (ms(measure_ms, "measure-ms"), ms(warmup_ms, "warmup-ms")) {
                    (Ok(m), Ok(w)) => (m, w),
                    (Err(e), _) | (_, Err(e)) => {
                        eprintln!("naam-bench: error: {e}");
                        return Ok(ExitCode::from(2));
                    }
                };
            if let Some(t) = target {
                if !(t.is_finite() && t > 0.0) {
                    eprintln!("naam-bench: error: --target must be a positive rate");
                    return Ok(ExitCode::from(2));
                }
            }
            match naam_bench::ycsb::Workload::core(workload) {
                Some(w) if !w.has_scans() => {}
                Some(_) => {
                    eprintln!("naam-bench: error: --workload {workload} scans, which the simulation's clients do not issue yet: use a, b, c, d or f");
                    return Ok(ExitCode::from(2));
                }
                None => {
                    eprintln!("naam-bench: error: --workload must be a core workload's letter (a, b, c, d or f), not {workload:?}");
                    return Ok(ExitCode::from(2));
                }
            }
            let profile = match naam_bench::sim::Profile::load(&profile) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("naam-bench: error: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            let mut cfg = naam_bench::sim::SimConfig::new(profile, seed, clients as usize);
            cfg.window = window as usize;
            cfg.records = records;
            cfg.target_per_client = target.map(|t| t / clients as f64);
            cfg.workload = workload;
            cfg.app = app;
            if apps > clients {
                eprintln!("naam-bench: error: --apps ({apps}) must not exceed --clients ({clients}): each app needs a client");
                return Ok(ExitCode::from(2));
            }
            cfg.apps = apps as usize;
            cfg.measure_ns = measure_ns;
            cfg.warmup_ns = warmup_ns;
            cfg.servers = servers as usize;
            cfg.loop_waits = loop_waits;
            cfg.pin = placement.pin();
            let started = std::time::Instant::now();
            let report = naam_bench::sim::run(&cfg)?;
            let wall = started.elapsed().as_secs_f64();
            let json = serde_json::to_string_pretty(&report)?;
            println!("{json}");
            if let Some(path) = json_out {
                std::fs::write(&path, format!("{json}\n"))
                    .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            }
            eprintln!(
                "naam-bench: simulated {} events in {wall:.1} s of this machine ({:.0} events/s)",
                report.events,
                report.events as f64 / wall.max(1e-9)
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn run(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Sim { what } => sim(what),
        Cmd::Switch {
            server,
            pin_nic_permille,
            unpin,
        } => {
            use naam_runtime::proto::control::Control;
            let mut c = naam_runtime::udp::UdpClient::connect(&naam_bench::udp_client::config(
                server,
                naam_runtime::proto::session::OPERATOR_TENANT,
            )?)?;
            let answer = c.control(&Control::QuerySwitch {
                pin: pin_nic_permille,
                unpin,
            })?;
            println!("{}", serde_json::to_string(&answer)?);
            Ok(match answer {
                Control::Switch { .. } => ExitCode::SUCCESS,
                _ => ExitCode::from(1),
            })
        }
        Cmd::Verify {
            app,
            server,
            placement,
            threads,
            ops,
            seconds,
            max_errors,
        } => {
            let pin = placement.pin();
            let setup = naam_bench::driver::UdpSetup::new(app, server, pin)?;
            let mut seed = [0u8; 8];
            getrandom::fill(&mut seed).map_err(|e| anyhow::anyhow!("random seed: {e}"))?;
            let r = naam_bench::verify::run(
                &setup,
                app,
                threads.max(1),
                ops,
                std::time::Duration::from_secs_f64(seconds.max(0.0)),
                u64::from_le_bytes(seed),
            )?;
            println!(
                "{}",
                serde_json::to_string(&json!({ "command": command_line(), "result": r }))?
            );
            Ok(if r.wrong == 0 && r.misses == 0 && r.errors <= max_errors {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Ycsb(args) => {
            let planned = match naam_bench::ycsb_cli::plan(&args) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("naam-bench: error: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            for w in &planned.warnings {
                eprintln!("naam-bench: warning: {w}");
            }
            // An exportfile that cannot be written is refused before the run, not after it.
            if let (Some(path), _) = &planned.export {
                if let Err(e) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                {
                    eprintln!("naam-bench: error: exportfile {}: {e}", path.display());
                    return Ok(ExitCode::from(2));
                }
            }
            let cfg = planned.config.clone();
            // Ctrl-C (or SIGTERM) ends the phase as its time limit would: the summary so far
            // is printed, the JSON and HDR logs written, and the exit code is 130.
            naam_bench::phase::stop_on(naam_runtime::udp::stop_flag());
            let result = match cfg.server {
                Some(_) if !cfg.shards.is_empty() => {
                    naam_bench::driver::run_udp_sharded(&cfg, &|_, _| {})?
                }
                Some(addr) => run_udp(&cfg, addr, &|_, _| {})?,
                None if cfg.fabric == "inproc-endpoints" => {
                    naam_bench::driver::run_inproc_endpoints(&cfg, &|_, _| {})?
                }
                None => run_inproc(&cfg, &|_, _| {})?,
            };
            let report = naam_bench::report::text(&result);
            match &planned.export {
                (None, naam_bench::properties::Exporter::Text) => print!("{report}"),
                (None, naam_bench::properties::Exporter::JsonArray) => println!(
                    "{}",
                    serde_json::to_string_pretty(&naam_bench::report::json_array(&report))?
                ),
                (Some(path), exporter) => {
                    let bytes = match exporter {
                        naam_bench::properties::Exporter::Text => report.into_bytes(),
                        naam_bench::properties::Exporter::JsonArray => {
                            serde_json::to_vec_pretty(&naam_bench::report::json_array(&report))?
                        }
                    };
                    std::fs::write(path, bytes)
                        .with_context(|| format!("exportfile {}", path.display()))?;
                }
            }
            if let Some(path) = args.json {
                let names = naam_bench::driver::handler_names(cfg.app);
                let doc = naam_bench::report::json(&result, &command_line(), &names);
                std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let errors: u64 = result
                .ops
                .iter()
                .chain(result.load.iter().flat_map(|l| l.ops.iter()))
                .map(|o| o.errors)
                .sum();
            Ok(if result.interrupted {
                ExitCode::from(130)
            } else if errors == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Experiment {
            name,
            out,
            seconds,
            ops,
            extra_us,
            nic_executors,
            counts,
            rates,
            fabric,
            server,
            rounds,
            records,
            threads,
            deploy_rate,
        } => {
            use naam_bench::experiments as x;
            let f = match x::Fabric::parse(&fabric, server) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("naam-bench: error: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            let doc = match name.as_str() {
                "shift" => x::shift(&out, f, seconds, extra_us)?,
                "capacity" => x::capacity(&out, f, ops, nic_executors)?,
                "scale" => x::scale(&out, f, &counts, ops)?,
                "engines" => {
                    if f != x::Fabric::Inproc {
                        eprintln!(
                            "naam-bench: note: engines times the eBPF engines in this process; \
                             it sends no messages, so --fabric does not apply"
                        );
                    }
                    x::engines(&out, ops.max(1000))?
                }
                "placements" => x::placements(&out, f, &rates, (seconds / 6.0).max(0.2), None)?,
                "udp-ceiling" => {
                    if f != x::Fabric::Inproc {
                        eprintln!(
                            "naam-bench: note: udp-ceiling measures a raw UDP echo on loopback \
                             (no NAAM code), so --fabric and --server do not apply"
                        );
                    }
                    let c = naam_bench::udp_ceiling::CeilingConfig {
                        seconds: seconds.clamp(0.2, 60.0),
                        ..Default::default()
                    };
                    naam_bench::udp_ceiling::udp_ceiling(&out, &c)?
                }
                "auth-cost" => {
                    if f != x::Fabric::Inproc {
                        eprintln!(
                            "naam-bench: note: auth-cost starts its own deployments on loopback \
                             (authentication can be turned off nowhere else), so --fabric and \
                             --server do not apply"
                        );
                    }
                    let c = naam_bench::auth_cost::AuthCostConfig {
                        records,
                        ops,
                        threads,
                        rounds,
                    };
                    naam_bench::auth_cost::auth_cost(&out, &c)?
                }
                "placements-congested" => {
                    x::placements(&out, f, &rates, (seconds / 6.0).max(0.2), Some(extra_us))?
                }
                "deploys" => {
                    if f != x::Fabric::Inproc {
                        eprintln!(
                            "naam-bench: note: deploys starts its own deployment on loopback \
                             (two tenants, deploys allowed), so --fabric and --server do not \
                             apply"
                        );
                    }
                    let c = naam_bench::deploys::DeploysConfig {
                        deploys: (ops.min(1000)) as u32,
                        rounds,
                        seconds,
                        records,
                        rate: deploy_rate,
                    };
                    naam_bench::deploys::deploys(&out, &c)?
                }
                other => {
                    eprintln!("naam-bench: error: unknown experiment `{other}` (shift, capacity, scale, engines, placements, placements-congested, auth-cost, udp-ceiling, deploys)");
                    return Ok(ExitCode::from(2));
                }
            };
            let mut summary = doc.clone();
            if let Some(o) = summary.as_object_mut() {
                for big in ["fractions_10ms", "p99_us_10ms", "ops", "runs", "rows"] {
                    o.remove(big);
                }
            }
            println!("{}", serde_json::to_string_pretty(&summary)?);
            let charts = if name == "auth-cost" {
                ""
            } else {
                " and its SVG chart(s)"
            };
            println!("wrote {}/{name}.json{charts}", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::CompareMemcached {
            workloads,
            records,
            ops,
            threads,
            pipeline,
            memcached_threads,
            server,
            seed,
            json,
        } => {
            let mut rows = Vec::new();
            println!("mode: NAAM MICA inproc (emulated NIC and RDMA){} vs memcached over loopback TCP, same driver",
                server.map_or(String::new(), |a| format!(", NAAM MICA over UDP to naam-server at {a}")));
            let udp_head = if server.is_some() {
                format!(" {:>12} {:>9} {:>9}", "udp ops/s", "p50 us", "p99 us")
            } else {
                String::new()
            };
            println!(
                "{:<9} {:>12} {:>9} {:>9}{udp_head} {:>15} {:>9} {:>9}",
                "workload", "naam ops/s", "p50 us", "p99 us", "memcached ops/s", "p50 us", "p99 us"
            );
            for w in workloads {
                let Some(wl) = Workload::core(w).filter(|_| matches!(w, 'a' | 'b' | 'c')) else {
                    eprintln!("naam-bench: error: the memcached comparison covers workloads a, b and c, not `{w}`");
                    return Ok(ExitCode::from(2));
                };
                let cfg = YcsbConfig {
                    app: App::Mica,
                    workload: wl,
                    records,
                    ops,
                    threads,
                    pipeline,
                    placement: PlacementChoice::Auto,
                    shape: RecordShape::default(),
                    seed,
                    executors: (1, 1),
                    fabric: "inproc".into(),
                    server: None,
                    shards: Vec::new(),
                    run: Default::default(),
                };
                let naam = run_inproc(&cfg, &|_, _| {})?;
                let udp = match server {
                    Some(addr) => {
                        let ucfg = YcsbConfig {
                            fabric: "udp".into(),
                            server: Some(addr),
                            ..cfg.clone()
                        };
                        Some(run_udp(&ucfg, addr, &|_, _| {})?)
                    }
                    None => None,
                };
                let mc = naam_bench::memcached::run_memcached(&cfg, memcached_threads, &|_, _| {})?;
                // Latency of all operations of the run together.
                let all = |r: &YcsbResult| naam_bench::driver::overall(r);
                let (a, b) = (all(&naam), all(&mc));
                let udp_cols = udp.as_ref().map_or(String::new(), |u| {
                    let c = all(u);
                    format!(" {:>12.0} {:>9} {:>9}", u.throughput, us(c.p50), us(c.p99))
                });
                println!(
                    "{:<9} {:>12.0} {:>9} {:>9}{udp_cols} {:>15.0} {:>9} {:>9}",
                    format!("YCSB-{}", w.to_ascii_uppercase()),
                    naam.throughput,
                    us(a.p50),
                    us(a.p99),
                    mc.throughput,
                    us(b.p50),
                    us(b.p99)
                );
                rows.push(json!({ "workload": w, "naam": naam, "naam_udp": udp, "memcached": mc }));
            }
            if let Some(path) = json {
                let doc = json!({ "command": command_line(), "runs": rows });
                std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Workload { letter } => {
            match naam_bench::ycsb::CORE_FILES
                .iter()
                .find(|(l, _)| *l == letter.to_ascii_lowercase())
            {
                Some((_, text)) => {
                    print!("{text}");
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!("naam-bench: error: unknown workload `{letter}` (a-f)");
                    Ok(ExitCode::from(2))
                }
            }
        }
        Cmd::Keys {
            dist,
            records,
            draws,
            seed,
            json,
        } => {
            if records == 0 {
                eprintln!("naam-bench: error: --records must be at least 1");
                return Ok(ExitCode::from(2));
            }
            let mut rng = Rng::new(seed);
            let mut chooser = KeyChooser::new(dist, records);
            let mut counts = vec![0u64; records as usize];
            for _ in 0..draws {
                counts[chooser.next(&mut rng) as usize] += 1;
            }
            let mut order: Vec<usize> = (0..counts.len()).collect();
            order.sort_by(|&a, &b| counts[b].cmp(&counts[a]));
            let top: u64 = order
                .iter()
                .take((records as usize / 100).max(1))
                .map(|&i| counts[i])
                .sum();
            println!(
                "{dist:?} over {records} records, {draws} draws: hottest key {} ({:.2}%), hottest 1% of keys {:.1}% of draws, {} keys never drawn",
                order[0],
                100.0 * counts[order[0]] as f64 / draws as f64,
                100.0 * top as f64 / draws as f64,
                counts.iter().filter(|&&c| c == 0).count()
            );
            if let Some(path) = json {
                let doc = json!({ "command": command_line(), "dist": dist, "records": records, "draws": draws, "seed": seed, "counts": counts });
                std::fs::write(&path, serde_json::to_vec(&doc)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn us(ns: u64) -> String {
    format!("{:.1}", ns as f64 / 1e3)
}
