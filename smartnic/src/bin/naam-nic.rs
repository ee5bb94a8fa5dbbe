//! `naam-nic run --server ADDR --listen ADDR`: the NIC executors and the one-sided agent of a
//! NAAM deployment, serving until SIGTERM (then it tells the server to stop forwarding and
//! drains). Exit codes: 0 clean stop, 1 runtime failure (no or a corrupt manifest included), 2
//! bad usage.

use naam_runtime::CredentialFile as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use naam_runtime::cluster::ClusterConfig;
use naam_runtime::udp;

/// The SmartNIC side of a NAAM deployment (emulated on this machine).
#[derive(Parser)]
#[command(name = "naam-nic", version = naam_runtime::version_line!())]
struct Args {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    verbosity: naam_runtime::logging::Verbosity,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the NIC executors and the one-sided agent.
    Run {
        /// naam-server's address (load reports go there).
        #[arg(value_parser = naam_runtime::addr::parse, long)]
        server: SocketAddr,
        /// Address to listen on for forwarded requests and one-sided operations.
        #[arg(value_parser = naam_runtime::addr::parse, long)]
        listen: SocketAddr,
        /// The server's shared-memory directory (its manifest and regions).
        #[arg(long, default_value = "/dev/shm/naam")]
        shm_dir: PathBuf,
        /// NIC executor threads (BlueField-2 has 8 Arm cores).
        #[arg(long, default_value_t = 1)]
        cores: usize,
        /// Receive loops, each with its own socket on `--listen` and its share of the
        /// sessions (1 to 64; default: one per core this process may run on).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=naam_runtime::proto::limits::MAX_LOOPS as i64))]
        receive_loops: Option<u16>,
        /// Handler slowdown of a NIC core against a host core (model).
        #[arg(long, default_value_t = 2.0)]
        core_slowdown: f64,
        /// Fixed cost of one DMA access to host memory, ns (model).
        #[arg(long, default_value_t = 1000)]
        dma_ns: u64,
        /// Do not busy-wait the modelled costs (functional runs only).
        #[arg(long)]
        no_cost_model: bool,
        /// Datagram size (default: 8972 when listening on loopback, 1472 elsewhere).
        #[arg(long)]
        datagram: Option<usize>,
        /// How long to wait for the server's manifest to appear, seconds.
        #[arg(long, default_value_t = 30)]
        wait: u64,
        /// The pairing secret naam-server's config names as `nic_pairing`.
        #[arg(long)]
        pairing: PathBuf,
        /// Serve Prometheus metrics at http://ADDR/metrics.
        #[arg(value_parser = naam_runtime::addr::parse, long, value_name = "ADDR")]
        metrics: Option<SocketAddr>,
    },
    /// Prints the BlueField-2 eSwitch rules (OVS and tc flower on the representors) that do
    /// what the XDP eSwitch does here. Nothing is installed.
    EswitchRules {
        /// The host's IP address (clients send NAAM requests to it).
        #[arg(long)]
        host_ip: std::net::Ipv4Addr,
        /// naam-server's UDP port.
        #[arg(long, default_value_t = 7000)]
        server_port: u16,
        /// naam-nic's UDP port on the Arm cores.
        #[arg(long, default_value_t = 7001)]
        nic_port: u16,
        /// Share of requests for the Arm cores, per mille (the steering controller's weight).
        #[arg(long, default_value_t = 500)]
        nic_permille: u32,
        /// OVS bridge.
        #[arg(long, default_value = "ovsbr1")]
        bridge: String,
        /// Uplink representor.
        #[arg(long, default_value = "p0")]
        uplink: String,
        /// Host PF representor.
        #[arg(long, default_value = "pf0hpf")]
        host_rep: String,
        /// Representor of the Arm-side scalable function naam-nic listens on.
        #[arg(long, default_value = "en3f0pf0sf0")]
        arm_rep: String,
        /// ovs, tc or both.
        #[arg(long, default_value = "both")]
        format: String,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    naam_runtime::logging::init(args.verbosity, tracing::level_filters::LevelFilter::INFO);
    // Read before any work (a bad value is a usage error), given to the socket once bound.
    let inject_loss = match naam_runtime::udp::injected_loss_from_env() {
        Ok(loss) => loss,
        Err(e) => {
            eprintln!("naam-nic: error: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match args.command {
        Command::EswitchRules {
            host_ip,
            server_port,
            nic_port,
            nic_permille,
            bridge,
            uplink,
            host_rep,
            arm_rep,
            format,
        } => {
            if nic_permille > 1000 {
                eprintln!("naam-nic: error: --nic-permille is at most 1000");
                return ExitCode::from(2);
            }
            let rules = naam_smartnic::EswitchRules {
                host_ip,
                server_port,
                nic_port,
                nic_permille,
                bridge,
                uplink,
                host_rep,
                arm_rep,
            };
            match format.as_str() {
                "ovs" => print!("{}", rules.ovs()),
                "tc" => print!("{}", rules.tc()),
                "both" => print!("{}\n{}", rules.ovs(), rules.tc()),
                other => {
                    eprintln!("naam-nic: error: unknown format `{other}` (ovs, tc, both)");
                    return ExitCode::from(2);
                }
            }
            Ok(())
        }
        Command::Run {
            server,
            listen,
            shm_dir,
            cores,
            receive_loops,
            core_slowdown,
            dma_ns,
            no_cost_model,
            datagram,
            wait,
            pairing,
            metrics,
        } => match naam_runtime::proto::session::Credential::load(&pairing) {
            Err(e) => {
                eprintln!("naam-nic: error: {e}");
                return ExitCode::from(2);
            }
            Ok(pairing) => run(
                pairing,
                server,
                listen,
                &shm_dir,
                cores,
                receive_loops.map_or_else(naam_runtime::udp::default_receive_loops, usize::from),
                naam_smartnic::bluefield2_model(core_slowdown, dma_ns, !no_cost_model),
                datagram,
                Duration::from_secs(wait),
                metrics,
                inject_loss,
            ),
        },
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("naam-nic: error: {e:#}");
            // A pairing secret the server keeps refusing is a configuration error (2), as a
            // manifest that does not load is; the rest fail at run time (1).
            let refused = e
                .downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied);
            let bad_manifest = e
                .downcast_ref::<udp::DeployError>()
                .is_some_and(|e| e.exit_code() == 2);
            ExitCode::from(if refused || bad_manifest { 2 } else { 1 })
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    pairing: naam_runtime::proto::session::Credential,
    server: SocketAddr,
    listen: SocketAddr,
    shm_dir: &std::path::Path,
    cores: usize,
    loops: usize,
    model: naam_runtime::cluster::NicModel,
    datagram: Option<usize>,
    wait: Duration,
    metrics: Option<SocketAddr>,
    inject_loss: Option<f64>,
) -> anyhow::Result<()> {
    let stop = udp::stop_flag();
    // The server writes the manifest when its regions exist; wait for it (it may be starting).
    let deadline = std::time::Instant::now() + wait;
    while !shm_dir.join(udp::MANIFEST_FILE).exists() {
        if std::time::Instant::now() >= deadline || stop.load(std::sync::atomic::Ordering::SeqCst) {
            anyhow::bail!(
                "no manifest in {} after {wait:?}: is naam-server running with this shm_dir?",
                shm_dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut cc = ClusterConfig::default();
    cc.nic_executors = cores.max(1);
    cc.nic = model;
    // Room for the apps tenants create on the server while this NIC runs (a restart makes
    // room for more: the apps it starts with are not counted here).
    cc.run_time_apps = 1024;
    let (cluster, manifest) = udp::start_nic(shm_dir, cc.clone())
        .with_context(|| format!("mapping the server's regions from {}", shm_dir.display()))?;
    let datagram = datagram.unwrap_or_else(|| naam_runtime::udp::datagram_for(listen));
    let mut sockets =
        udp::bind_group(listen, datagram, loops).with_context(|| format!("binding {listen}"))?;
    for s in &mut sockets {
        s.inject_loss(inject_loss);
    }
    let advertise = sockets[0].local_addr()?;
    let telemetry = std::sync::Arc::new(naam_runtime::udp::Telemetry::default());
    if let Some(addr) = metrics {
        let (t, c) = (telemetry.clone(), cluster.clone());
        let bound = naam_runtime::udp::spawn_metrics(
            addr,
            stop,
            std::sync::Arc::new(move || t.render("nic", &c)),
        )
        .with_context(|| format!("--metrics {addr}"))?;
        tracing::info!("metrics at http://{bound}/metrics");
    }
    tracing::info!(
        "{} app(s), {} core(s) (emulated Arm A72: slowdown {}x, DMA {} ns/access{}), \
         agent and executors on udp://{advertise} ({loops} receive loop(s)), reporting to {server}",
        manifest.apps.len(),
        cores.max(1),
        model.core_slowdown,
        model.dma.access_ns,
        if model.emulate_costs {
            ""
        } else {
            ", costs not emulated"
        }
    );
    let mut options = udp::NicOptions::new(server, advertise, pairing);
    options.telemetry = telemetry;
    options.shm_dir = Some(shm_dir.to_path_buf());
    let stats = udp::serve_nic_loops(
        udp::NicCluster { cluster, manifest },
        sockets,
        options,
        stop,
        &mut |_epoch| {
            udp::start_nic(shm_dir, cc.clone())
                .map(|(cluster, manifest)| udp::NicCluster { cluster, manifest })
                .map_err(|e| e.to_string())
        },
    )?;
    tracing::info!(
        "stopped; {}",
        serde_json::to_string(&stats).unwrap_or_default()
    );
    Ok(())
}
