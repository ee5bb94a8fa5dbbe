//! `naam-server --config FILE`: serves the config's apps over the UDP fabric until SIGTERM, then
//! drains in-flight work. `naam-server keygen --out FILE` writes a new credential (a tenant's,
//! the NIC's pairing secret, or the operator's), readable by its owner only. Exit codes: 0
//! clean stop, 1 runtime failure, 2 bad config or usage.

use naam_runtime::CredentialFile as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use naam_runtime::cluster::ClusterConfig;
use naam_runtime::udp;
use naam_server::eswitch::{self, Eswitch};
use naam_server::Config;
use std::sync::Arc;

/// The host side of a NAAM deployment over UDP.
#[derive(Parser)]
#[command(
    name = "naam-server",
    version = naam_runtime::version_line!(),
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// The config file (TOML; see apps/server/naam-server.example.toml).
    #[arg(long, required = true)]
    config: Option<PathBuf>,
    /// Overrides the config's listen address.
    #[arg(value_parser = naam_runtime::addr::parse, long)]
    listen: Option<std::net::SocketAddr>,
    /// Overrides the config's shared-memory directory.
    #[arg(long)]
    shm_dir: Option<PathBuf>,
    /// Discards the regions an earlier start left in the shared-memory directory (their data
    /// is lost) and starts empty. Without it, regions of the config's layout are used again,
    /// data and all, and regions of another layout are refused.
    #[arg(long, conflicts_with = "from_snapshot")]
    reset_regions: bool,
    /// Starts from the regions of a snapshot (`naam-server snapshot`), copied into the
    /// shared-memory directory, which must hold none; their layout must be the config's.
    #[arg(long, value_name = "DIR")]
    from_snapshot: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (messages per app, handler and
    /// placement, errors by status, queue depths, steering weights, service-time histograms).
    #[arg(value_parser = naam_runtime::addr::parse, long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    #[command(flatten)]
    verbosity: naam_runtime::logging::Verbosity,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Copies the regions a stopped naam-server left in the config's shared-memory directory
    /// (data, journals and header) into the new directory OUT, for a server elsewhere to start
    /// from (`naam-server --config FILE --from-snapshot OUT`). Refused while a server runs
    /// over the directory.
    Snapshot {
        /// The config file whose `shm_dir` holds the regions.
        #[arg(long)]
        config: PathBuf,
        /// Overrides the config's shared-memory directory.
        #[arg(long)]
        shm_dir: Option<PathBuf>,
        /// Where the snapshot goes (a new directory).
        #[arg(long)]
        out: PathBuf,
    },
    /// Writes a new random credential to FILE (mode 0600; an existing file is never replaced).
    Keygen {
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    naam_runtime::logging::init(args.verbosity, tracing::level_filters::LevelFilter::INFO);
    if let Some(Command::Keygen { out }) = &args.command {
        // `keygen --out keys/mica.key` as the example config names it: make `keys/` (owner
        // only) when it is missing.
        if let Some(parent) = out
            .parent()
            .filter(|p| !p.as_os_str().is_empty() && !p.exists())
        {
            use std::os::unix::fs::DirBuilderExt;
            if let Err(e) = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
            {
                eprintln!("naam-server: error: creating {}: {e}", parent.display());
                return ExitCode::from(2);
            }
        }
        return match naam_runtime::proto::session::Credential::generate(&naam_runtime::entropy::os())
            .and_then(|c| c.write_new(out))
        {
            Ok(()) => {
                eprintln!("naam-server: wrote a new credential to {}", out.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("naam-server: error: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(Command::Snapshot {
        config,
        shm_dir,
        out,
    }) = &args.command
    {
        let dir = match (shm_dir, Config::load(config)) {
            (Some(d), _) => d.clone(),
            (None, Ok(c)) => c.shm_dir,
            (None, Err(e)) => {
                eprintln!("naam-server: error: {e}");
                return ExitCode::from(2);
            }
        };
        return match udp::snapshot(&dir, out) {
            Ok(n) => {
                eprintln!(
                    "naam-server: copied {n} files of the regions in {} to {}",
                    dir.display(),
                    out.display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("naam-server: error: {e}");
                ExitCode::from(e.exit_code())
            }
        };
    }
    // Read before any work (a bad value is a usage error), given to the socket once bound.
    let inject_loss = match naam_runtime::udp::injected_loss_from_env() {
        Ok(loss) => loss,
        Err(e) => {
            eprintln!("naam-server: error: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(path) = &args.config else {
        eprintln!("naam-server: error: --config FILE is required");
        return ExitCode::from(2);
    };
    let mut config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("naam-server: error: {e}");
            return ExitCode::from(2);
        }
    };
    // A cluster file that is not a map of every slot, or that does not name this node, is
    // a config error (the front reads it again when it starts).
    if let (Some(file), Some(me)) = (&config.resp_cluster, config.resp_listen) {
        if let Err(e) =
            naam_resp::cluster_file::ClusterFile::load(file).and_then(|f| f.map_for(me, file))
        {
            eprintln!("naam-server: error: {}: resp_cluster: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    let tenants = match config.tenants() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("naam-server: error: {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    // A code cache directory that cannot be used (another user's, open to others, not a
    // directory) is a config error, found before any work.
    let code_cache = match config
        .code_cache
        .as_deref()
        .map(naam_runtime::code_cache::open_dir)
    {
        None => None,
        Some(Ok(cache)) => Some(cache),
        Some(Err(e)) => {
            eprintln!("naam-server: error: {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    if let Some(l) = args.listen {
        config.listen = l;
    }
    if let Some(d) = args.shm_dir {
        config.shm_dir = d;
    }
    // Handler objects are part of the config: one that does not build, load or verify, or a
    // region that cannot be allocated, is a config error.
    let mut apps = Vec::new();
    for a in &config.apps {
        match a.build() {
            Ok(built) => apps.extend(built),
            Err(e) => {
                eprintln!("naam-server: error: {}: {e:#}", path.display());
                return ExitCode::from(2);
            }
        }
    }
    // Region rkeys follow from the tenants' credentials: the same after a restart.
    for a in &mut apps {
        a.credential = tenants
            .iter()
            .find(|t| t.role.may_use(a.spec.id))
            .map(|t| t.credential.clone());
    }
    let start = match (&args.from_snapshot, args.reset_regions) {
        (Some(from), _) => udp::RegionStart::FromSnapshot(from.clone()),
        (None, true) => udp::RegionStart::Reset,
        (None, false) => udp::RegionStart::Reattach,
    };
    match run(
        &config,
        apps,
        tenants,
        code_cache,
        args.metrics,
        inject_loss,
        start,
    ) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("naam-server: error: {e:#}");
            // A config the deployment cannot start from (a directory another server holds,
            // regions of another layout, a handler that does not verify) is bad input.
            let code = e
                .downcast_ref::<udp::DeployError>()
                .map_or(1, udp::DeployError::exit_code);
            ExitCode::from(code)
        }
    }
}

/// Attaches the XDP eSwitch if the config asks for one; any failure leaves the user-space switch
/// in charge, and says why.
fn attach_eswitch(
    config: &Config,
    cluster: &Arc<naam_runtime::cluster::Cluster>,
    stop: &'static std::sync::atomic::AtomicBool,
) -> Option<Arc<Eswitch>> {
    let iface = config.xdp_interface.as_ref()?;
    let nic_port = config.nic_port?;
    let attached = Eswitch::attach(eswitch::OBJECT, iface, config.listen.port(), nic_port);
    match attached {
        Ok(sw) => {
            let sw = Arc::new(sw);
            tracing::info!(
                "{} attached; NIC messages go to port {nic_port}",
                naam_runtime::proto::endpoint::SwitchHandle::describe(sw.as_ref())
            );
            let (s, c) = (sw.clone(), cluster.clone());
            std::thread::Builder::new()
                .name("naam-eswitch-sync".into())
                .spawn(move || s.run_sync(c, Duration::from_millis(1), stop))
                .ok()?;
            Some(sw)
        }
        Err(e) => {
            tracing::warn!(
                "XDP eSwitch not attached on {iface} ({e}); the user-space switch in \
                 naam-server steers instead"
            );
            None
        }
    }
}

/// The RDMA verbs side, when built with it and a device exists (otherwise it says why not).
#[cfg(feature = "verbs")]
fn verbs_side(
    cluster: &Arc<naam_runtime::cluster::Cluster>,
    manifest: &naam_runtime::proto::control::Manifest,
) -> Option<Arc<dyn naam_runtime::proto::endpoint::VerbsAcceptor>> {
    use naam_runtime::verbs::{Device, Peers};
    // Registered for the rights clients have: remote writes and atomics only where the app
    // opts into client one-sided writes.
    let client_access = |app: u32, rkey: u64| {
        manifest
            .app(app)
            .and_then(|a| a.regions.iter().find(|r| r.rkey == rkey))
            .map_or(0, |r| r.client_access)
    };
    match Device::open(None).and_then(|d| Peers::new(d, cluster.regions().clone(), &client_access))
    {
        Ok(p) => {
            tracing::info!(
                "RDMA verbs: regions registered; peers connect over the control channel"
            );
            Some(Arc::new(p))
        }
        Err(e) => {
            tracing::warn!("RDMA verbs not available: {e}");
            None
        }
    }
}

/// Built without the `verbs` feature: no RDMA side.
#[cfg(not(feature = "verbs"))]
fn verbs_side(
    _: &Arc<naam_runtime::cluster::Cluster>,
    _: &naam_runtime::proto::control::Manifest,
) -> Option<Arc<dyn naam_runtime::proto::endpoint::VerbsAcceptor>> {
    None
}

/// What starts the RESP front on `resp_listen`: its socket, bound, and its cluster map (if
/// the config names a cluster file), checked; started (given the stop flag and, for
/// `resp_path = "inline"`, the in-process network its server endpoint is bound in), a thread
/// serving until `stop`.
type RespStart = Box<
    dyn FnOnce(
        &'static std::sync::atomic::AtomicBool,
        Option<(udp::MemoryNet, std::net::SocketAddr)>,
    ) -> std::io::Result<
        std::thread::JoinHandle<std::io::Result<naam_resp::server::ServeStats>>,
    >,
>;

/// Binds the RESP front's socket and reads its cluster file. Its store is a NAAM client of
/// this server: of its own UDP address (`udp`), so every command is an active message that the
/// switch places like any other request, or of an endpoint in this process.
fn resp_front(
    config: &Config,
    addr: std::net::SocketAddr,
    udp: std::net::SocketAddr,
) -> anyhow::Result<RespStart> {
    let listener = naam_resp::server::bind(addr).with_context(|| format!("resp_listen {addr}"))?;
    let bound = listener.local_addr()?;
    let mut front = naam_resp::front::FrontConfig {
        process: "naam-server",
        ..Default::default()
    };
    if let Some(path) = &config.resp_cluster {
        let map = naam_resp::cluster_file::ClusterFile::load(path)
            .and_then(|f| f.map_for(addr, path))
            .context("resp_cluster")?;
        front.cluster = Some(map);
    }
    // The server's own address as a client reaches it.
    let server = match udp.ip() {
        ip if ip.is_unspecified() => {
            std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), udp.port())
        }
        _ => udp,
    };
    tracing::info!(
        "RESP on tcp://{bound} ({}), commands {}",
        if front.cluster.is_some() {
            "a cluster node"
        } else {
            "standalone"
        },
        match config.resp_path {
            naam_server::RespPath::Udp => format!("to naam-server {server} over UDP"),
            naam_server::RespPath::Inline => "run inline in the front's thread".to_string(),
        }
    );
    Ok(Box::new(move |stop, inline| {
        std::thread::Builder::new()
            .name("naam-resp".into())
            .spawn(move || {
                let mut store_config = naam_resp::naam::NaamStoreConfig::new(server);
                if let Some((net, at)) = inline {
                    store_config = naam_resp::naam::NaamStoreConfig::new(at);
                    store_config.network = Some(net);
                }
                let mut store = naam_resp::naam::NaamStore::new(store_config)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                naam_resp::server::serve(listener, &front, &mut store, stop)
            })
    }))
}

fn run(
    config: &Config,
    apps: Vec<naam_runtime::udp::HostApp>,
    mut tenants: Vec<naam_runtime::proto::session::TenantEntry>,
    code_cache: Option<Arc<naam_runtime::vm::CodeCache>>,
    metrics: Option<std::net::SocketAddr>,
    inject_loss: Option<f64>,
    start: udp::RegionStart,
) -> anyhow::Result<()> {
    let stop = udp::stop_flag();
    let mut cc = ClusterConfig::default();
    cc.host_executors = config.host_executors;
    cc.queue_capacity = config.queue_capacity;
    cc.policy = config.policy()?;
    cc.executor_poll = Duration::from_micros(config.executor_poll_us);
    if let Some(cache) = code_cache {
        cc.code_cache = cache;
    }
    // Room for the apps tenants may create, and for those they created before.
    cc.run_time_apps = match &config.deploy {
        Some(d) => d
            .max_created_apps
            .max(udp::created_app_count(&config.shm_dir)),
        None => 0,
    };
    let mut sockets = udp::bind_group(config.listen, config.datagram_size(), config.loops())
        .with_context(|| format!("binding {}", config.listen))?;
    for s in &mut sockets {
        s.inject_loss(inject_loss);
    }
    let listening = sockets[0].local_addr()?;
    // Bound now, so that a RESP port in use is an error before any region exists.
    let resp = match config.resp_listen {
        Some(addr) => Some(resp_front(config, addr, listening)?),
        None => None,
    };
    // Bound before the regions exist, so that a port in use leaves nothing behind; it
    // renders the cluster once there is one.
    let telemetry = Arc::new(naam_runtime::udp::Telemetry::default());
    let serving: Arc<std::sync::OnceLock<Arc<naam_runtime::cluster::Cluster>>> = Arc::default();
    if let Some(addr) = metrics {
        let (t, c) = (telemetry.clone(), serving.clone());
        let render = move || c.get().map(|c| t.render("server", c)).unwrap_or_default();
        let bound = naam_runtime::udp::spawn_metrics(addr, stop, Arc::new(render))
            .with_context(|| format!("--metrics {addr}"))?;
        tracing::info!("metrics at http://{bound}/metrics");
    }
    let host = udp::start_host_persistent(
        apps,
        cc,
        &config.shm_dir,
        start,
        &naam_server::check_regions,
    )?;
    match &host.started {
        udp::Started::Fresh { discarded: 0 } => {
            tracing::info!("new regions in {}", config.shm_dir.display())
        }
        udp::Started::Fresh { discarded } => tracing::warn!(
            "--reset-regions: discarded {discarded} files of the regions in {}; new regions",
            config.shm_dir.display()
        ),
        udp::Started::Reattached { clean, rolled_back } => tracing::info!(
            "re-attached the regions in {} ({}; {} unfinished write batch(es) undone)",
            config.shm_dir.display(),
            if *clean {
                "the last server stopped cleanly"
            } else {
                "the last server did not stop cleanly"
            },
            rolled_back.len()
        ),
        _ => {}
    }
    let (cluster, mut manifest) = (host.cluster.clone(), host.manifest.clone());
    if config.deploy.is_some() {
        if matches!(host.started, udp::Started::Fresh { .. }) {
            // New regions: what was deployed into the old ones goes with them.
            udp::forget_deploys(&config.shm_dir);
        }
        for line in
            udp::restore_created_apps(&cluster, &mut manifest, &mut tenants, &config.shm_dir)
        {
            tracing::info!("{line}");
        }
        for line in udp::restore_deploys(&cluster, &mut manifest, &config.shm_dir)? {
            tracing::info!("{line}");
        }
    }
    let _ = serving.set(cluster.clone());
    let switch = attach_eswitch(config, &cluster, stop);
    let verbs = verbs_side(&cluster, &manifest);
    tracing::info!(
        "serving {} app(s) on udp://{} with {} receive loop(s) ({}); regions and manifest in {}; policy {}; epoch {:#x}",
        manifest.apps.len(),
        listening,
        sockets.len(),
        naam_runtime::udp::MODE,
        config.shm_dir.display(),
        cluster.policy_name(),
        manifest.epoch
    );
    let mut options = udp::ServerOptions::new(manifest, tenants);
    options.switch = switch
        .clone()
        .map(|s| s as Arc<dyn naam_runtime::proto::endpoint::SwitchHandle>);
    options.verbs = verbs;
    options.congestion_control = config.allow_congestion_control;
    options.telemetry = telemetry;
    options.deploy = config.deploy.as_ref().map(|d| d.policy(&config.shm_dir));
    // `resp_path = "inline"`: one more endpoint over the same cluster and tenants, bound in an
    // in-process network, which the front's sessions hand their requests to.
    let inline = match (&resp, config.resp_path) {
        (Some(_), naam_server::RespPath::Inline) => {
            let net = udp::MemoryNet::new();
            let mut o = options.clone();
            o.deploy = None;
            o.telemetry = Arc::default();
            let at = std::net::SocketAddr::from(([127, 0, 0, 1], 6379));
            let server = udp::serve_host_inline(cluster.clone(), &net, at, o, 1)?;
            let addr = server.addr();
            Some((server, net, addr))
        }
        _ => None,
    };
    let resp = resp
        .map(|start| start(stop, inline.as_ref().map(|(_, n, a)| (n.clone(), *a))))
        .transpose()?;
    let stats = udp::serve_host_loops(cluster, sockets, options, stop)?;
    if let Some(thread) = resp {
        match thread.join() {
            Ok(Ok(s)) => tracing::info!("RESP front stopped; {s:?}"),
            Ok(Err(e)) => tracing::error!("RESP front: {e}"),
            Err(_) => tracing::error!("RESP front: its thread panicked"),
        }
    }
    if let Some((server, _, _)) = inline {
        server.stop();
    }
    host.stop()?;
    tracing::info!(
        "regions kept in {} for the next start (--reset-regions discards them)",
        config.shm_dir.display()
    );
    tracing::info!(
        "stopped; {}",
        serde_json::to_string(&stats).unwrap_or_default()
    );
    Ok(())
}
