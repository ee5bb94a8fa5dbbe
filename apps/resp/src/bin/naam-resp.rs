//! `naam-resp`: a RESP server that is a NAAM client, run beside an application. Redis clients
//! connect to it on loopback; it sends each command as an active message to the naam-server
//! that serves the key (one server, or a cluster's by hash slot), and the steering may run a
//! read here, at the client, with one-sided reads. Exit codes: 0 clean stop, 1 runtime
//! failure, 2 bad usage or config.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use naam_resp::cluster_file::ClusterFile;
use naam_resp::front::FrontConfig;
use naam_resp::naam::{NaamStore, NaamStoreConfig};
use naam_runtime::proto::session::Credential;
use naam_runtime::CredentialFile as _;

/// A RESP (Redis protocol) gateway to NAAM.
#[derive(Parser)]
#[command(name = "naam-resp", version = naam_runtime::version_line!())]
struct Args {
    /// Where Redis clients connect.
    #[arg(long, value_parser = naam_runtime::addr::parse, default_value = "127.0.0.1:6380")]
    listen: SocketAddr,
    /// naam-server's UDP address (one server; see --cluster for several).
    #[arg(long, value_parser = naam_runtime::addr::parse, required_unless_present = "cluster", conflicts_with = "cluster")]
    server: Option<SocketAddr>,
    /// A cluster file (the naam-servers and their slots): each key goes to its slot's server.
    #[arg(long, value_name = "FILE")]
    cluster: Option<PathBuf>,
    /// The tenant connections run as without AUTH (with --credential); absent, every
    /// connection must `AUTH <tenant> <credential hex>`.
    #[arg(long, requires = "credential")]
    tenant: Option<String>,
    /// The tenant's credential file.
    #[arg(long, requires = "tenant")]
    credential: Option<PathBuf>,
    /// Commands a connection may have waiting per round.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_pipeline: u32,
    /// The largest bulk string a client may send, bytes.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u32).range(16..=(64 << 20)))]
    max_bulk: u32,
    #[command(flatten)]
    verbosity: naam_runtime::logging::Verbosity,
}

fn main() -> ExitCode {
    let args = Args::parse();
    naam_runtime::logging::init(args.verbosity, tracing::level_filters::LevelFilter::INFO);
    let mut store_config = match (&args.server, &args.cluster) {
        (Some(s), _) => NaamStoreConfig::new(*s),
        (None, Some(path)) => {
            let routed = ClusterFile::load(path).and_then(|f| {
                // The gateway is no node of the map: it routes as the first node sees it.
                let first = f.node.first().map(|n| n.resp).unwrap_or(args.listen);
                let map = f.map_for(first, path)?;
                Ok(NaamStoreConfig::cluster(
                    f.node.iter().map(|n| n.naam).collect(),
                    &map,
                ))
            });
            match routed {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("naam-resp: error: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        (None, None) => {
            eprintln!("naam-resp: error: --server ADDR or --cluster FILE is required");
            return ExitCode::from(2);
        }
    };
    if let (Some(tenant), Some(path)) = (&args.tenant, &args.credential) {
        match Credential::load(path) {
            Ok(c) => store_config.default_tenant = Some((tenant.clone(), c)),
            Err(e) => {
                eprintln!("naam-resp: error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let listener = match naam_resp::server::bind(args.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("naam-resp: error: listening on {}: {e}", args.listen);
            return ExitCode::from(2);
        }
    };
    let mut store = match NaamStore::new(store_config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("naam-resp: error: the --tenant session: {e}");
            return ExitCode::from(1);
        }
    };
    let mut front = FrontConfig {
        max_pipeline: args.max_pipeline as usize,
        process: "naam-resp",
        ..FrontConfig::default()
    };
    front.limits.max_bulk = args.max_bulk as usize;
    let stop = naam_runtime::udp::stop_flag();
    tracing::info!("RESP on {} ({})", args.listen, naam_runtime::udp::MODE);
    match naam_resp::server::serve(listener, &front, &mut store, stop) {
        Ok(stats) => {
            tracing::info!("stopped; {stats:?}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("naam-resp: error: {e}");
            ExitCode::from(1)
        }
    }
}
