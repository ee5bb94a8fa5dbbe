//! `naam-bench ycsb [load|run] -P FILE [-p key=value]... [flags]`: YCSB's command-line
//! interface. Properties are read in YCSB's order (the core workload defaults, `--workload
//! LETTER`'s shipped file, each `-P` file, each `-p`) and NAAM's flags override them; every
//! value is checked before anything starts.

use std::path::PathBuf;

use crate::driver::{App, Phases, PlacementChoice, RunOptions, YcsbConfig};
use crate::properties::{Properties, Settings};
use crate::ycsb::CORE_FILES;

/// The arguments of `naam-bench ycsb`.
#[derive(clap::Args, Debug)]
pub struct YcsbArgs {
    /// `load` (insert the records), `run` (the operations, against records loaded before), or
    /// neither: both, as one command (the only choice for the in-process cluster).
    #[arg(value_parser = ["load", "run"])]
    pub phase: Option<String>,
    /// A YCSB workload property file (`workloads/workloadb`); repeatable, later files win.
    #[arg(short = 'P', value_name = "FILE")]
    pub property_files: Vec<PathBuf>,
    /// One property, `key=value` (after the files); repeatable.
    #[arg(short = 'p', value_name = "KEY=VALUE")]
    pub properties: Vec<String>,
    /// Application: mica or btree.
    #[arg(long, default_value = "mica")]
    pub app: App,
    /// A shipped core workload, a to f (`-P workloads/workload<LETTER>`); default b when no
    /// `-P` is given.
    #[arg(long)]
    pub workload: Option<char>,
    /// Records (`recordcount`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub records: Option<u64>,
    /// Operations of the run phase (`operationcount`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub ops: Option<u64>,
    /// Client threads (`threadcount`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub threads: Option<u64>,
    /// Operations each client thread keeps in flight (`naam.pipeline`; memtier's name; 1:
    /// one at a time, YCSB's closed loop).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub pipeline: Option<u64>,
    /// Run for this many seconds (`maxexecutiontime`); without --ops the operation count is
    /// then unlimited.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Operations per second over all threads (`target`).
    #[arg(long)]
    pub target: Option<f64>,
    /// Fields per record (`fieldcount`; MICA only).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub field_count: Option<u64>,
    /// Bytes per field (`fieldlength`; MICA only).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub field_length: Option<u64>,
    /// Where reads run: auto, host, nic or client.
    #[arg(long, default_value = "auto")]
    pub placement: PlacementChoice,
    /// Fabric: inproc (one process), inproc-endpoints (one process running naam-server's and
    /// naam-nic's drivers and UDP clients over an in-memory datagram network: every message
    /// through the protocol's endpoints, without the kernel), udp (naam-server at --server),
    /// or rdma (as udp, with the Client placement's one-sided READs over RDMA verbs; needs the
    /// `verbs` feature and an RDMA device).
    #[arg(long, default_value = "inproc")]
    pub fabric: String,
    /// naam-server's address (with --fabric udp or rdma). Several, comma-separated
    /// (`A,B,C`): the records are sharded over them by Redis Cluster hash slot, the slots
    /// split as `redis-cli --cluster create` splits them, in the order given.
    #[arg(value_parser = naam_runtime::addr::parse, long, value_delimiter = ',')]
    pub server: Vec<std::net::SocketAddr>,
    /// A cluster file (naam-server's `resp_cluster`): the records sharded over its nodes'
    /// `naam` addresses by the slots it gives them (with --fabric udp or rdma; not with
    /// --server).
    #[arg(long, value_name = "FILE", conflicts_with = "server")]
    pub cluster: Option<PathBuf>,
    /// Host executor threads (in-process cluster).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub host_executors: u64,
    /// NIC executor threads (in-process cluster).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub nic_executors: u64,
    /// Random seed for key and operation draws (the load phase uses one derived from it).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write HdrHistogram interval logs (`<phase>-<OP>.hdr`) into this directory.
    #[arg(long, value_name = "DIR")]
    pub hdr_log: Option<PathBuf>,
}

/// The command line with YCSB's own spellings after `ycsb` taken as NAAM's (a copied YCSB
/// command line runs): `-load` and `-t` (the phase), `-threads N`, `-target N`, `-s` (status
/// lines, which NAAM always prints) and `-db CLASS` (NAAM is the store; dropped, and said so
/// in the returned notes). Everything else is left as it is, for clap.
pub fn with_ycsb_spellings(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> (Vec<std::ffi::OsString>, Vec<String>) {
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let mut in_ycsb = false;
    let mut it = args.into_iter().peekable();
    while let Some(a) = it.next() {
        if !in_ycsb {
            in_ycsb = a == "ycsb";
            out.push(a);
            continue;
        }
        match a.to_str() {
            Some("-load") => out.push("load".into()),
            Some("-t") => out.push("run".into()),
            Some("-threads") => out.push("--threads".into()),
            Some("-target") => out.push("--target".into()),
            Some("-s") => {}
            Some("-db") => {
                if let Some(class) = it.next() {
                    notes.push(format!(
                        "-db {}: ignored (NAAM runs its own store: --app mica or btree)",
                        class.to_string_lossy()
                    ));
                }
            }
            _ => out.push(a),
        }
    }
    (out, notes)
}

/// A checked run and what the user should hear about it first.
#[derive(Debug)]
pub struct Planned {
    /// The run.
    pub config: YcsbConfig,
    /// Where the report goes instead of stdout (`exportfile`), and in which form (`exporter`).
    pub export: (Option<PathBuf>, crate::properties::Exporter),
    /// Warnings (unknown keys, settings without effect).
    pub warnings: Vec<String>,
}

/// Reads the property files and flags of `args` into a checked run. Errors are usage errors
/// (exit 2): nothing has started.
pub fn plan(args: &YcsbArgs) -> Result<Planned, String> {
    let mut props = Properties::default();
    let letter = match (args.workload, args.property_files.is_empty()) {
        (Some(l), _) => Some(l),
        (None, true) => Some('b'),
        (None, false) => None,
    };
    let mut name = String::new();
    if let Some(l) = letter {
        let text = CORE_FILES
            .iter()
            .find(|(c, _)| *c == l.to_ascii_lowercase())
            .map(|(_, t)| *t)
            .ok_or_else(|| format!("unknown workload `{l}` (a-f)"))?;
        props
            .merge_text(text, &format!("workload{l}"))
            .map_err(|e| e.to_string())?;
        name = l.to_ascii_lowercase().to_string();
    }
    for file in &args.property_files {
        let text =
            std::fs::read_to_string(file).map_err(|e| format!("-P {}: {e}", file.display()))?;
        props
            .merge_text(&text, &file.display().to_string())
            .map_err(|e| e.to_string())?;
        name = file.file_name().map_or_else(
            || file.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
    }
    // Keys the user set on the command line (flags or -p), as opposed to a file.
    let mut explicit: Vec<&str> = Vec::new();
    for pair in &args.properties {
        props.set_pair(pair).map_err(|e| e.to_string())?;
        if let Some((k, _)) = pair.split_once('=') {
            explicit.push(k.trim());
        }
    }
    let mut flag = |key: &'static str, value: Option<String>| {
        if let Some(v) = value {
            props.set(key, v);
            explicit.push(key);
        }
    };
    flag("recordcount", args.records.map(|n| n.to_string()));
    flag("operationcount", args.ops.map(|n| n.to_string()));
    flag("threadcount", args.threads.map(|n| n.to_string()));
    flag("naam.pipeline", args.pipeline.map(|n| n.to_string()));
    flag("fieldcount", args.field_count.map(|n| n.to_string()));
    flag("fieldlength", args.field_length.map(|n| n.to_string()));
    flag("target", args.target.map(|t| t.to_string()));
    if let Some(d) = args.duration {
        if !(d.is_finite() && d > 0.0 && d <= 1e9) {
            return Err(format!("--duration {d}: a number of seconds above 0"));
        }
        props.set("maxexecutiontime", d);
        if args.ops.is_none() {
            props.set("operationcount", 0);
        }
    }
    let settings = Settings::from_properties(&props).map_err(|e| e.to_string())?;
    let mut warnings = settings.warnings.clone();
    if args.app == App::Btree {
        let shape_keys = ["fieldcount", "fieldlength"];
        if let Some(k) = explicit.iter().find(|k| shape_keys.contains(k)) {
            return Err(format!(
                "{k}: the B-tree stores 8-byte values (it is an index from key to word); \
                 record shapes apply to --app mica"
            ));
        }
        if shape_keys.iter().any(|k| props.get(k).is_some()) {
            warnings.push(
                "the workload file's fieldcount/fieldlength do not apply to the B-tree, which \
                 stores 8-byte values"
                    .into(),
            );
        }
    }
    if settings.workload.has_scans() && args.app == App::Mica {
        return Err(format!(
            "workload {name} scans (scanproportion > 0); MICA is a hash table: use --app btree"
        ));
    }
    let phases = match args.phase.as_deref() {
        Some("load") => Phases::Load,
        Some("run") => Phases::Run,
        _ => Phases::Both,
    };
    let shards = match (&args.cluster, args.server.len()) {
        (Some(path), _) => {
            crate::sharded::cluster_file_shards(path).map_err(|e| format!("--cluster: {e:#}"))?
        }
        (None, 0 | 1) => Vec::new(),
        (None, _) => crate::sharded::even_shards(&args.server).map_err(|e| e.to_string())?,
    };
    let server = shards
        .first()
        .map(|s| s.server)
        .or(args.server.first().copied());
    if args.cluster.is_some() && args.fabric.as_str() == "inproc" {
        return Err("--cluster shards over naam-servers: give --fabric udp (or rdma)".into());
    }
    if phases != Phases::Both && server.is_none() {
        return Err(format!(
            "`ycsb {}` alone needs a server that keeps the records between commands (--fabric \
             udp --server ADDR); the in-process cluster lives for one command: omit the phase \
             to load and run",
            args.phase.as_deref().unwrap_or("")
        ));
    }
    let checked_fabric =
        match (args.fabric.as_str(), server) {
            ("rdma", _) => "udp",
            // One process like inproc: it starts its own deployment.
            ("inproc-endpoints", None) => "inproc",
            ("inproc-endpoints", Some(_)) => return Err(
                "--fabric inproc-endpoints starts its own deployment in this process; --server \
                 is for --fabric udp or rdma"
                    .into(),
            ),
            ("inproc" | "udp", _) => args.fabric.as_str(),
            (other, _) => {
                return Err(format!(
                    "unknown fabric `{other}` (inproc, inproc-endpoints, udp, rdma)"
                ))
            }
        };
    crate::experiments::Fabric::parse(checked_fabric, server).map_err(|e| e.to_string())?;
    let mut workload = settings.workload;
    workload.name = name;
    let config = YcsbConfig {
        app: args.app,
        workload,
        records: settings.record_count,
        ops: settings.operation_count.unwrap_or(u64::MAX),
        threads: settings.threads,
        pipeline: settings.pipeline,
        placement: args.placement,
        shape: settings.shape,
        seed: args.seed,
        executors: (args.host_executors as usize, args.nic_executors as usize),
        fabric: args.fabric.clone(),
        server,
        shards,
        run: RunOptions {
            phases,
            target_ops_per_sec: settings.target_ops_per_sec,
            max_execution_time_s: settings.max_execution_time.map(|d| d.as_secs_f64()),
            insert_start: settings.insert_start,
            insert_count: Some(settings.insert_count),
            write_all_fields: settings.write_all_fields,
            status_interval: Some(settings.status_interval),
            // `--hdr-log DIR` wins over YCSB's hdrhistogram.output.path (a prefix).
            hdr_log: args
                .hdr_log
                .as_ref()
                .map(|d| d.join(""))
                .or(settings.measurement.hdr_output.clone()),
            percentiles: settings.measurement.percentiles.clone(),
        },
    };
    Ok(Planned {
        config,
        export: (
            settings.measurement.export_file.clone(),
            settings.measurement.exporter,
        ),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::with_ycsb_spellings;

    fn spelled(line: &str) -> (Vec<String>, Vec<String>) {
        let (args, notes) = with_ycsb_spellings(line.split_whitespace().map(Into::into));
        let args = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        (args, notes)
    }

    #[test]
    fn a_copied_ycsb_command_line_reads_as_naams() {
        let (args, notes) = spelled(
            "naam-bench ycsb -load -db site.ycsb.BasicDB -s -threads 4 -target 1000 \
             -P workloads/workloada -p recordcount=10",
        );
        assert_eq!(
            args.join(" "),
            "naam-bench ycsb load --threads 4 --target 1000 -P workloads/workloada -p recordcount=10"
        );
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(spelled("naam-bench ycsb -t -P w").0[2], "run");
        // Only after `ycsb`: another command's arguments are left alone.
        assert_eq!(spelled("naam-bench verify -t").0[2], "-t");
    }
}
