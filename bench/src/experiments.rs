//! The paper's experiments, on the in-process cluster or on a UDP deployment (`naam-server`
//! with `naam-nic` beside it). Each writes JSON (with the command and the mode) and an SVG
//! chart into an output directory. In both modes NIC cores, DMA and one-sided RDMA are
//! emulated on this machine; no figure is a hardware figure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use hdrhistogram::Histogram;
use naam_mica::{MicaClient, MicaConfig, MicaHandle};
use naam_runtime::cluster::{AppSpec, Cluster, ClusterConfig, PolicyChoice};
use naam_runtime::experiment::{run_shift, run_shift_on, ShiftConfig, ShiftResult, ShiftTarget};
use naam_runtime::proto::control::Control;
use naam_runtime::proto::steering::CostPolicyConfig;
use naam_runtime::proto::step::{Grant, Invocation};
use naam_runtime::proto::transport::Transport;
use naam_runtime::proto::EngineKind;
use naam_runtime::proto::Placement;
use naam_runtime::udp::UdpClient;
use naam_runtime::vm::Vm;
use naam_runtime::vm::{Executable, LoadedObject, VerifierConfig};
use naam_runtime::HandlerSpec;
use naam_runtime::Percentiles;
use serde::Serialize;
use serde_json::json;

use crate::driver::{
    run_inproc, run_udp, App, PlacementChoice, UdpSetup, YcsbConfig, YcsbResult, INPROC_MODE,
};
use crate::plot::{bars, lines, Chart, Series};
use crate::ycsb::{key_name, RecordShape, Rng, Workload};

pub(crate) fn write_json(
    dir: &Path,
    name: &str,
    value: &serde_json::Value,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(value)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

pub(crate) fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn mica_object() -> anyhow::Result<Arc<LoadedObject>> {
    Ok(Arc::new(
        naam_mica::handlers().context("loading MICA's embedded handlers")?,
    ))
}

/// Where an experiment runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fabric {
    /// The in-process cluster: host executors, emulated NIC executors and clients in one
    /// process.
    Inproc,
    /// A UDP deployment: `naam-server` at this address with `naam-nic` beside it (the
    /// testbed), and this process as the client.
    Udp(SocketAddr),
}

impl Fabric {
    /// The fabric a command line names: `inproc`, or `udp` with naam-server's address.
    pub fn parse(name: &str, server: Option<SocketAddr>) -> Result<Fabric, String> {
        match (name, server) {
            ("inproc", None) => Ok(Fabric::Inproc),
            ("udp", Some(a)) => Ok(Fabric::Udp(a)),
            ("inproc", Some(_)) => Err("--server needs --fabric udp".into()),
            ("udp", None) => Err("--fabric udp needs --server ADDR (naam-server)".into()),
            _ => Err(format!("unknown fabric `{name}` (inproc, udp)")),
        }
    }

    /// Mode label of the results.
    pub fn mode(&self) -> &'static str {
        match self {
            Fabric::Inproc => INPROC_MODE,
            Fabric::Udp(_) => naam_runtime::udp::MODE,
        }
    }

    /// Short name for chart titles.
    pub fn name(&self) -> &'static str {
        match self {
            Fabric::Inproc => "inproc",
            Fabric::Udp(_) => "udp",
        }
    }

    /// `cfg` run on this fabric.
    fn ycsb(&self, cfg: YcsbConfig) -> anyhow::Result<YcsbResult> {
        match *self {
            Fabric::Inproc => run_inproc(&cfg, &|_, _| {}),
            Fabric::Udp(server) => {
                let cfg = YcsbConfig {
                    fabric: "udp".into(),
                    server: Some(server),
                    shards: Vec::new(),
                    ..cfg
                };
                run_udp(&cfg, server, &|_, _| {})
            }
        }
    }
}

/// An operator's hold on naam-server's congestion control (the server must allow it). The
/// congestion is cleared when this is dropped, so a failed run never leaves the host slowed.
struct UdpCongestion {
    operator: Mutex<UdpClient>,
    server: SocketAddr,
}

impl UdpCongestion {
    fn connect(server: SocketAddr) -> anyhow::Result<UdpCongestion> {
        let tenant = naam_runtime::proto::session::OPERATOR_TENANT;
        let operator = UdpClient::connect(&crate::udp_client::config(server, tenant)?)
            .with_context(|| format!("connecting to naam-server at {server}"))?;
        Ok(UdpCongestion {
            operator: Mutex::new(operator),
            server,
        })
    }

    /// Every host message spends `extra_ns` more (`None`: back to full capacity).
    fn set(&self, extra_ns: Option<u64>) -> anyhow::Result<()> {
        let mut op = self
            .operator
            .lock()
            .map_err(|_| anyhow::anyhow!("the operator client panicked"))?;
        match op.control(&Control::Congest { extra_ns })? {
            Control::Congestion { extra_ns: now } if now == extra_ns => Ok(()),
            Control::Error { message } => bail!("naam-server at {}: {message}", self.server),
            other => bail!(
                "naam-server at {}: unexpected answer to congest: {other:?}",
                self.server
            ),
        }
    }
}

impl Drop for UdpCongestion {
    fn drop(&mut self) {
        let _ = self.set(None);
    }
}

/// A shift run's view of a UDP deployment: placements as the clients saw them in their
/// replies, congestion through naam-server's control channel.
struct UdpShift<'a> {
    metrics: &'a naam_runtime::Metrics,
    congestion: &'a UdpCongestion,
    policy: String,
}

impl ShiftTarget for UdpShift<'_> {
    type Error = anyhow::Error;
    fn ops(&self) -> [u64; 3] {
        self.metrics.ops()
    }
    fn congest(&self, extra_ns: Option<u64>) -> anyhow::Result<()> {
        self.congestion.set(extra_ns)
    }
    fn policy(&self) -> String {
        self.policy.clone()
    }
    fn mode(&self) -> String {
        naam_runtime::udp::MODE.into()
    }
}

/// Puts records `0..records` (16-byte keys, 4 × 16-byte fields) into a MICA table.
fn load_mica<T: Transport>(m: &mut MicaClient<T>, records: u64) -> anyhow::Result<()> {
    let mut rng = Rng::new(1);
    let shape = RecordShape {
        field_count: 4,
        field_length: 16,
    };
    for n in 0..records {
        m.put(key16(n).as_bytes(), &shape.record(&mut rng))?;
    }
    Ok(())
}

/// A cluster with one loaded MICA table (16-byte keys, 64-byte values) and its handle.
fn mica_cluster(
    records: u64,
    config: ClusterConfig,
    object: Arc<LoadedObject>,
) -> anyhow::Result<(Arc<Cluster>, MicaHandle)> {
    let mc = MicaConfig::preset_16_64(records);
    let spec = naam_mica::app_spec(1, &mc, object, Placement::Host)?;
    let cluster = Arc::new(Cluster::builder().config(config).app(spec).build()?);
    let handle = MicaHandle::from_cluster(&cluster, 1, mc).context("MICA regions")?;
    load_mica(&mut MicaClient::new(cluster.client(), handle), records)?;
    Ok((cluster, handle))
}

/// The MICA table naam-server at `server` serves, loaded with `records` records (none: left
/// as it is); clients pinned to `pin` (or following the weights).
fn udp_mica(
    server: SocketAddr,
    pin: Option<Placement>,
    records: u64,
) -> anyhow::Result<(UdpSetup, MicaHandle)> {
    let setup = UdpSetup::new(App::Mica, server, pin)?;
    let handle = setup.mica()?;
    if records > 0 {
        load_mica(&mut MicaClient::new(setup.connect()?, handle), records)?;
    }
    Ok((setup, handle))
}

/// A 16-byte key for key number `n`.
fn key16(n: u64) -> String {
    let k = key_name(n);
    k[..16.min(k.len())].to_string()
}

/// Latency samples of a run: (seconds since its start, nanoseconds).
type Latencies = Arc<Mutex<Vec<(f64, u64)>>>;

/// One timed GET of a shift run's closed loop.
fn shift_get<T: Transport>(
    m: &mut MicaClient<T>,
    n: u64,
    records: u64,
    start: Instant,
    lat: &Latencies,
) {
    let t0 = Instant::now();
    let _ = m.get(key16(n * 7919 % records).as_bytes());
    if let Ok(mut v) = lat.lock() {
        v.push((
            t0.duration_since(start).as_secs_f64(),
            t0.elapsed().as_nanos() as u64,
        ));
    }
}

/// Congestion shift: MICA GETs while host congestion starts and stops; placement fractions and
/// p99 every 10 ms; time to move 90% off the host and back. Over UDP the fractions are what
/// the clients' replies report, and naam-server must allow congestion control.
pub fn shift(
    out: &Path,
    fabric: Fabric,
    seconds: f64,
    extra_us: u64,
) -> anyhow::Result<serde_json::Value> {
    let records = 4096;
    let lat: Latencies = Arc::new(Mutex::new(Vec::with_capacity(1 << 20)));
    let counter = Arc::new(AtomicU64::new(0));
    let mut cfg = ShiftConfig::default();
    cfg.duration = Duration::from_secs_f64(seconds);
    cfg.congestion = (
        Duration::from_secs_f64(seconds / 3.0),
        Duration::from_secs_f64(2.0 * seconds / 3.0),
    );
    cfg.host_extra_ns = extra_us * 1000;
    cfg.clients = 1;
    cfg.sample = Duration::from_millis(1);
    let result: ShiftResult = match fabric {
        Fabric::Inproc => {
            let object = mica_object()?;
            let (cluster, handle) = mica_cluster(records, ClusterConfig::default(), object)?;
            let start = Instant::now();
            let lat = lat.clone();
            let call = move |client: &mut naam_runtime::cluster::Client| {
                let n = counter.fetch_add(1, Ordering::Relaxed);
                shift_get(
                    &mut MicaClient::new(&mut *client, handle),
                    n,
                    records,
                    start,
                    &lat,
                );
            };
            run_shift(&cluster, &cfg, call)
        }
        Fabric::Udp(server) => {
            let (setup, handle) = udp_mica(server, None, records)?;
            let congestion = UdpCongestion::connect(server)?;
            // Refused before the run, not in the middle of it, when the server forbids it.
            congestion.set(None)?;
            let start = Instant::now();
            let workers = (0..cfg.clients)
                .map(|_| {
                    let mut m = MicaClient::new(setup.connect()?, handle);
                    let (lat, counter) = (lat.clone(), counter.clone());
                    Ok(move || {
                        let n = counter.fetch_add(1, Ordering::Relaxed);
                        shift_get(&mut m, n, records, start, &lat);
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let view = UdpShift {
                metrics: &setup.metrics,
                congestion: &congestion,
                policy: setup.manifest.policy.clone(),
            };
            run_shift_on(&view, &cfg, workers)?
        }
    };
    // p99 per 10 ms window (the run's clock started a little before run_shift's).
    let lat = lat.lock().map(|v| v.clone()).unwrap_or_default();
    let window = 0.010;
    let mut p99 = Vec::new();
    let mut i = 0;
    while i < lat.len() {
        let w = (lat[i].0 / window).floor();
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
        while i < lat.len() && (lat[i].0 / window).floor() == w {
            let _ = h.record(lat[i].1.max(1));
            i += 1;
        }
        p99.push(((w + 0.5) * window, h.value_at_quantile(0.99) as f64 / 1e3));
    }
    let windows = vec![(
        cfg.congestion.0.as_secs_f64(),
        cfg.congestion.1.as_secs_f64(),
        "host congested".to_string(),
    )];
    // Fractions per 10 ms.
    let mut fr: [Vec<(f64, f64)>; 3] = Default::default();
    for chunk in result.samples.chunks(10) {
        let mut ops = [0u64; 3];
        for s in chunk {
            for (sum, n) in ops.iter_mut().zip(s.ops) {
                *sum += n;
            }
        }
        let total: u64 = ops.iter().sum();
        if total > 0 {
            let t = chunk.last().map_or(0.0, |s| s.t);
            for p in 0..3 {
                fr[p].push((t, 100.0 * ops[p] as f64 / total as f64));
            }
        }
    }
    let series: Vec<Series> = Placement::ALL
        .iter()
        .map(|p| Series {
            label: p.name().to_string(),
            points: fr[p.index()].clone(),
        })
        .collect();
    lines(
        &out.join("shift-fractions.svg"),
        &Chart {
            title: &format!(
                "Congestion shift: MICA GET placement ({}, emulated NIC)",
                fabric.name()
            ),
            x_label: "time (s)",
            y_label: "% of operations",
            log_y: false,
            windows: windows.clone(),
        },
        &series,
    )?;
    lines(
        &out.join("shift-p99.svg"),
        &Chart {
            title: &format!(
                "Congestion shift: MICA GET p99 per 10 ms ({})",
                fabric.name()
            ),
            x_label: "time (s)",
            y_label: "p99 (us)",
            log_y: true,
            windows,
        },
        &[Series {
            label: "p99".into(),
            points: p99.clone(),
        }],
    )?;
    let doc = json!({
        "command": command_line(), "mode": fabric.mode(), "experiment": "congestion-shift",
        "policy": result.policy, "moved_ms": result.moved_ms, "back_ms": result.back_ms,
        "config": {
            "duration_s": cfg.duration.as_secs_f64(),
            "congestion_start_s": cfg.congestion.0.as_secs_f64(),
            "congestion_end_s": cfg.congestion.1.as_secs_f64(),
            "host_extra_ns": cfg.host_extra_ns,
            "clients": cfg.clients,
            "sample_ms": cfg.sample.as_secs_f64() * 1e3,
        },
        "fractions_10ms": Placement::ALL.iter().map(|p| json!({ "placement": p, "points": fr[p.index()] })).collect::<Vec<_>>(),
        "p99_us_10ms": p99, "ops": result.ops,
    });
    write_json(out, "shift", &doc)?;
    Ok(doc)
}

/// Offload capacity: YCSB-B on MICA and lookups (YCSB-C) on the B-tree pinned to the NIC, with
/// more client threads until throughput stops growing. Over UDP the NIC executors are the ones
/// `naam-nic` was started with, and `nic_executors` is not used.
pub fn capacity(
    out: &Path,
    fabric: Fabric,
    ops: u64,
    nic_executors: usize,
) -> anyhow::Result<serde_json::Value> {
    let nic_label = match fabric {
        Fabric::Inproc => format!("{nic_executors} emulated NIC executor(s)"),
        Fabric::Udp(_) => "naam-nic's emulated NIC executors".to_string(),
    };
    let mut rows = Vec::new();
    let mut series = Vec::new();
    for (app, w, label) in [
        (App::Mica, 'b', "MICA YCSB-B"),
        (App::Btree, 'c', "B-tree lookups"),
    ] {
        let mut points = Vec::new();
        for threads in [1usize, 2, 4, 8] {
            let cfg = YcsbConfig {
                app,
                workload: Workload::core(w).expect("core"),
                records: 10_000,
                ops,
                threads,
                placement: PlacementChoice::Fixed(Placement::Nic),
                pipeline: 1,
                shape: RecordShape::default(),
                seed: 5,
                executors: (1, nic_executors),
                fabric: "inproc".into(),
                server: None,
                shards: Vec::new(),
                run: Default::default(),
            };
            let r = fabric.ycsb(cfg)?;
            points.push((threads as f64, r.throughput));
            rows.push(json!({ "app": label, "threads": threads, "throughput": r.throughput, "all": r.all, "placement_fractions": r.placement_fractions }));
        }
        series.push(Series {
            label: label.to_string(),
            points,
        });
    }
    lines(
        &out.join("capacity.svg"),
        &Chart {
            title: &format!(
                "Offload capacity at the NIC placement ({nic_label}, {})",
                fabric.name()
            ),
            x_label: "client threads",
            y_label: "ops/s",
            log_y: false,
            windows: vec![],
        },
        &series,
    )?;
    let best: Vec<_> = series
        .iter()
        .map(|s| json!({ "app": s.label, "max_ops_per_s": s.points.iter().map(|p| p.1).fold(0.0, f64::max) }))
        .collect();
    let nic_executors = (fabric == Fabric::Inproc).then_some(nic_executors);
    let doc = json!({ "command": command_line(), "mode": fabric.mode(), "experiment": "offload-capacity", "nic_executors": nic_executors, "max": best, "runs": rows });
    write_json(out, "capacity", &doc)?;
    Ok(doc)
}

/// Runs per app count in [`scale`]; the median run (by p99) is reported.
const SCALE_REPETITIONS: usize = 3;

/// Offload scale: 1..=1024 apps, each a MICA table, registered and active at once; one client
/// sends GETs round robin over every app; p50 and p99 against the app count. In process, each
/// count builds a cluster of that many apps; over UDP naam-server registers its MICA apps once
/// (`instances` in its config) and each count makes the first `n` of them active.
pub fn scale(
    out: &Path,
    fabric: Fabric,
    counts: &[u32],
    ops: u64,
) -> anyhow::Result<serde_json::Value> {
    if counts.contains(&0) {
        bail!("--counts: every app count must be at least 1");
    }
    let mut rows = Vec::new();
    let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
    /// What the counts run against.
    enum On {
        Inproc(Arc<LoadedObject>),
        Udp(Box<(UdpSetup, Vec<MicaHandle>)>),
    }
    let on = match fabric {
        Fabric::Inproc => On::Inproc(mica_object()?),
        Fabric::Udp(server) => {
            let setup = UdpSetup::new(App::Mica, server, None)?;
            // The largest group of like tables (the `instances` of one [[app]]), not a mix
            // of a big YCSB table with small ones.
            let mut groups: Vec<Vec<&naam_runtime::proto::control::AppManifest>> = Vec::new();
            for a in setup.manifest.apps_of_kind("mica") {
                match groups.iter_mut().find(|g| g[0].params == a.params) {
                    Some(g) => g.push(a),
                    None => groups.push(vec![a]),
                }
            }
            groups.sort_by_key(|g| std::cmp::Reverse(g.len()));
            let apps = groups
                .first()
                .map(|g| g.iter().map(|a| UdpSetup::mica_of(a)).collect())
                .unwrap_or(Ok(Vec::new()))?;
            let most = counts.iter().copied().max().unwrap_or(0) as usize;
            if apps.len() < most {
                bail!(
                    "naam-server at {server} serves {} like MICA app(s); the largest count asked \
                     for is {most} (give an [[app]] instances = {most}, or NAAM_SCALE_APPS={most} \
                     scripts/testbed.sh up)",
                    apps.len()
                );
            }
            On::Udp(Box::new((setup, apps)))
        }
    };
    for &n in counts {
        let row = match &on {
            On::Udp(udp) => {
                let (setup, apps) = &**udp;
                let setup_start = Instant::now();
                let ids: Vec<u32> = apps[..n as usize].iter().map(|h| h.app).collect();
                let mut client = setup.connect_apps(&ids)?;
                let setup_s = setup_start.elapsed().as_secs_f64();
                let handles = &apps[..n as usize];
                let (q, mut row) = scale_runs(ops, n, &setup.metrics, |op, app, key| {
                    op.run(&mut MicaClient::new(&mut client, handles[app]), key)
                })?;
                row["client_setup_s"] = json!(setup_s);
                row["registered"] = json!(apps.len());
                (q, row)
            }
            On::Inproc(object) => {
                let mc = MicaConfig::preset_8_8(32);
                let apps: Vec<AppSpec> = (1..=n)
                    .map(|id| {
                        let mut spec =
                            naam_mica::app_spec(id, &mc, object.clone(), Placement::Host)?;
                        // Reads and puts only: registering 2 handlers per app keeps setup short.
                        spec.handlers = vec![
                            HandlerSpec::read(naam_mica::handlers::GET),
                            HandlerSpec::write(naam_mica::handlers::PUT),
                        ];
                        Ok(spec)
                    })
                    .collect::<anyhow::Result<_>>()?;
                let setup = Instant::now();
                let mut b = Cluster::builder().config(ClusterConfig::default());
                for a in apps {
                    b = b.app(a);
                }
                let cluster = b.build()?;
                let setup_s = setup.elapsed().as_secs_f64();
                let handles = (1..=n)
                    .map(|id| MicaHandle::from_cluster(&cluster, id, mc).context("regions"))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                // One client for every app, as over UDP: what grows with the count is the
                // server's side (tables, handlers, steering state), not N clients' own state.
                let mut client = cluster.client();
                let (q, mut row) = scale_runs(ops, n, cluster.metrics(), |op, app, key| {
                    op.run(&mut MicaClient::new(&mut client, handles[app]), key)
                })?;
                row["setup_s"] = json!(setup_s);
                (q, row)
            }
        };
        p50s.push((n as f64, row.0.p50 as f64 / 1e3));
        p99s.push((n as f64, row.0.p99 as f64 / 1e3));
        rows.push(row.1);
    }
    lines(
        &out.join("scale.svg"),
        &Chart {
            title: &format!(
                "Offload scale: MICA GET latency vs active apps ({})",
                fabric.name()
            ),
            x_label: "apps registered and active",
            y_label: "latency (us)",
            log_y: true,
            windows: vec![],
        },
        &[
            Series {
                label: "p50".into(),
                points: p50s,
            },
            Series {
                label: "p99".into(),
                points: p99s.clone(),
            },
        ],
    )?;
    let ratio = match (p99s.first(), p99s.last()) {
        (Some(a), Some(b)) if a.1 > 0.0 => Some(b.1 / a.1),
        _ => None,
    };
    let doc = json!({ "command": command_line(), "mode": fabric.mode(), "experiment": "offload-scale", "p99_ratio_last_to_first": ratio, "runs": rows });
    write_json(out, "scale", &doc)?;
    Ok(doc)
}

/// What [`scale`] does to one key of one app.
#[derive(Clone, Copy)]
enum ScaleOp {
    Put,
    Get,
}

impl ScaleOp {
    /// Puts key `key` (an 8-byte key and value) or gets it.
    fn run<T: Transport>(self, m: &mut MicaClient<T>, key: u64) -> anyhow::Result<()> {
        let k = key.to_le_bytes();
        match self {
            ScaleOp::Put => m.put(&k, &k).map(|_| ())?,
            ScaleOp::Get => m.get(&k).map(|_| ())?,
        }
        Ok(())
    }
}

/// One count of [`scale`]: 8 keys put into each of `n` apps, then [`SCALE_REPETITIONS`] runs
/// of `ops` GETs round robin over them (`call(op, app index, key)`); the median run by p99 and
/// its JSON row. On 2 vCPUs a single run's p99 is bimodal (a descheduled executor thread costs
/// tens of microseconds), hence the median of several.
fn scale_runs(
    ops: u64,
    n: u32,
    metrics: &naam_runtime::Metrics,
    mut call: impl FnMut(ScaleOp, usize, u64) -> anyhow::Result<()>,
) -> anyhow::Result<(Percentiles, serde_json::Value)> {
    for app in 0..n as usize {
        for k in 0..8u64 {
            call(ScaleOp::Put, app, k)?;
        }
    }
    std::thread::sleep(Duration::from_millis(20));
    let mut reps = Vec::with_capacity(SCALE_REPETITIONS);
    for _ in 0..SCALE_REPETITIONS {
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
        metrics.reset();
        let start = Instant::now();
        for i in 0..ops {
            let t0 = Instant::now();
            call(ScaleOp::Get, (i % n as u64) as usize, i % 8)?;
            let _ = h.record(t0.elapsed().as_nanos() as u64);
        }
        let secs = start.elapsed().as_secs_f64();
        reps.push((Percentiles::of(&h), ops as f64 / secs, metrics.snapshot()));
    }
    reps.sort_by_key(|(q, _, _)| q.p99);
    let p99_runs: Vec<u64> = reps.iter().map(|(q, _, _)| q.p99).collect();
    let (q, ops_per_s, placed) = &reps[reps.len() / 2];
    let by_placement: serde_json::Map<String, serde_json::Value> = Placement::ALL
        .iter()
        .map(|p| {
            let i = p.index();
            let v = json!({ "ops": placed.ops[i], "latency": placed.placement[i] });
            (p.to_string(), v)
        })
        .collect();
    let row = json!({
        "apps": n, "latency": q, "ops_per_s": ops_per_s,
        "repetitions": SCALE_REPETITIONS, "p99_ns_each_run": p99_runs,
        "placements": by_placement,
    });
    Ok((*q, row))
}

/// Median nanoseconds per call of `f` over 9 batches of `iters / 9` calls (this machine's
/// timings are noisy; the median of batches steadies them).
fn median_ns(iters: u64, mut f: impl FnMut()) -> f64 {
    let batch = (iters / 9).max(1);
    let mut v: Vec<f64> = (0..9)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..batch {
                f();
            }
            t.elapsed().as_nanos() as f64 / batch as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Verification, analysis and compilation time of every handler of `obj`, per engine: the
/// median of 9 builds, in milliseconds.
fn compile_times(app: &str, obj: &LoadedObject) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    for p in &obj.programs {
        let ms = |engine| -> anyhow::Result<f64> {
            let mut v = Vec::new();
            for _ in 0..9 {
                let t = Instant::now();
                let exe = Executable::new(p, engine, &VerifierConfig::default())?;
                v.push(t.elapsed().as_secs_f64() * 1e3);
                drop(exe);
            }
            v.sort_by(f64::total_cmp);
            Ok(v[v.len() / 2])
        };
        let (jit, interp) = (ms(EngineKind::Jit)?, ms(EngineKind::Interp)?);
        rows.push(json!({ "app": app, "handler": p.name, "insns": p.len(),
            "jit_ms": jit, "interp_ms": interp }));
    }
    Ok(rows)
}

/// Engines: nanoseconds per invocation of example handlers under the interpreter and the JIT,
/// beside the same logic in native Rust where it exists, and how long every example, MICA and
/// B-tree handler takes to verify and compile.
pub fn engines(out: &Path, iters: u64) -> anyhow::Result<serde_json::Value> {
    let obj = naam_runtime::vm::load(naam_examples::HANDLERS_OBJECT)
        .context("loading the example handlers this binary carries")?;
    let args16: Vec<u8> = [5u64, 7].iter().flat_map(|w| w.to_le_bytes()).collect();
    let data: Vec<u8> = (0..1024u32).map(|i| (i * 31 % 251) as u8).collect();
    let sorted: Vec<u8> = (0..128u64).flat_map(|i| (i * 3).to_le_bytes()).collect();
    let key = 300u64.to_le_bytes();
    /// A handler, its args and its segments.
    type Case<'a> = (&'a str, &'a [u8], Vec<&'a [u8]>);
    let cases: Vec<Case> = vec![
        ("add", &args16, vec![]),
        ("bsearch", &key, vec![&sorted]),
        ("checksum", &[], vec![&data]),
        ("hash1k", &key, vec![&data]),
    ];
    #[derive(Serialize)]
    struct Row {
        handler: String,
        engine: String,
        ns: f64,
    }
    let mut rows = Vec::new();
    let mut series: Vec<Series> = ["interp", "jit", "native"]
        .iter()
        .map(|l| Series {
            label: l.to_string(),
            points: vec![],
        })
        .collect();
    for (x, (name, args, segs)) in cases.iter().enumerate() {
        for (si, engine) in [EngineKind::Interp, EngineKind::Jit]
            .into_iter()
            .enumerate()
        {
            let exe = Executable::new(obj.get(name)?, engine, &VerifierConfig::default())?;
            let grants: Vec<Grant> = segs.iter().map(|s| Grant::read(s)).collect();
            let inv = Invocation {
                args,
                segments: &grants,
                ..Invocation::default()
            };
            let mut vm = Vm::new();
            let ns = median_ns(iters, || {
                let _ = std::hint::black_box(vm.run(&exe, &inv));
            });
            series[si].points.push((x as f64, ns));
            rows.push(Row {
                handler: name.to_string(),
                engine: engine.name().into(),
                ns,
            });
        }
        // Native: the same logic compiled natively (hash and checksum; add is trivially ~1 ns).
        let mut acc = 0u64;
        let ns = median_ns(iters, || {
            acc = acc.wrapping_add(match *name {
                "hash1k" => naam_ebpf::hash::hash64(std::hint::black_box(&data), 300),
                "checksum" => data.chunks_exact(8).fold(0u64, |a, c| {
                    a.wrapping_add(u64::from_le_bytes(c.try_into().expect("8")))
                }),
                "bsearch" => sorted
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
                    .collect::<Vec<_>>()
                    .partition_point(|&v| v < 300) as u64,
                _ => std::hint::black_box(5u64) + 7,
            });
        });
        std::hint::black_box(acc);
        series[2].points.push((x as f64, ns));
        rows.push(Row {
            handler: name.to_string(),
            engine: "native".into(),
            ns,
        });
    }
    let categories: Vec<String> = cases.iter().map(|(n, ..)| n.to_string()).collect();
    bars(
        &out.join("engines.svg"),
        &Chart {
            title: "Engines: ns per invocation (median)",
            x_label: "handler",
            y_label: "ns per invocation",
            log_y: true,
            windows: vec![],
        },
        &categories,
        &series,
    )?;
    let mut compile = compile_times("examples", &obj)?;
    compile.extend(compile_times("mica", mica_object()?.as_ref())?);
    let btree = naam_btree::handlers().context("loading the B-tree's embedded handlers")?;
    compile.extend(compile_times("btree", &btree)?);
    let doc = json!({ "command": command_line(), "mode": "standalone (one process, no fabric)", "experiment": "engines", "iterations": iters, "rows": rows,
        "compile": compile,
        "note": "native bsearch collects the array into a Vec each call; the criterion bench compares like for like (cargo bench -p naam-runtime --bench engines)" });
    write_json(out, "engines", &doc)?;
    Ok(doc)
}

/// Blocks until `deadline`: sleeps while it is far away, spins for the last stretch. A plain
/// sleep overshoots by the timer slack (about 50 us on Linux), which an open-loop latency
/// measured from the scheduled send time would count as the system's.
fn wait_until(deadline: Instant) {
    const SPIN: Duration = Duration::from_micros(200);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > SPIN {
            std::thread::sleep(left - SPIN);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// MICA GETs offered at each of `rates` for `seconds` (open loop); per rate: the rate, the
/// throughput achieved, and latency from each scheduled send time.
fn open_loop<T: Transport>(
    m: &mut MicaClient<T>,
    rates: &[u64],
    seconds: f64,
    records: u64,
) -> anyhow::Result<Vec<(u64, f64, Percentiles)>> {
    let mut out = Vec::new();
    for &rate in rates {
        std::thread::sleep(Duration::from_millis(30));
        let interval = Duration::from_secs_f64(1.0 / rate as f64);
        let n = (rate as f64 * seconds) as u64;
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
        let start = Instant::now();
        for i in 0..n {
            let scheduled = start + interval * i as u32;
            wait_until(scheduled);
            m.get(key16(i * 7919 % records).as_bytes())?;
            let _ = h.record(scheduled.elapsed().as_nanos() as u64);
        }
        let achieved = n as f64 / start.elapsed().as_secs_f64();
        out.push((rate, achieved, Percentiles::of(&h)));
    }
    Ok(out)
}

/// Placement comparison: MICA GETs offered at fixed rates (open loop) under always-Host,
/// always-NIC, always-Client and auto; achieved throughput and p99 (from the scheduled send
/// time, so queueing behind a late send counts). Over UDP the always-* baselines pin every
/// read, auto follows naam-server's weights, and `extra_us` needs congestion control allowed.
pub fn placements(
    out: &Path,
    fabric: Fabric,
    rates: &[u64],
    seconds: f64,
    extra_us: Option<u64>,
) -> anyhow::Result<serde_json::Value> {
    let records = 4096u64;
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let policies = [
        ("always-host", Some(Placement::Host)),
        ("always-nic", Some(Placement::Nic)),
        ("always-client", Some(Placement::Client)),
        ("auto", None),
    ];
    /// What the policies run against.
    enum On {
        Inproc(Arc<LoadedObject>),
        Udp(SocketAddr),
    }
    let on = match fabric {
        Fabric::Inproc => On::Inproc(mica_object()?),
        Fabric::Udp(server) => On::Udp(server),
    };
    // Over UDP the server's host stays congested for the whole comparison (cleared on drop).
    let congestion = match (fabric, extra_us) {
        (Fabric::Udp(server), Some(us)) => {
            let c = UdpCongestion::connect(server)?;
            c.set(Some(us * 1000))?;
            Some(c)
        }
        _ => None,
    };
    let mut server_policy = None;
    for (name, pin) in policies {
        let runs = match &on {
            On::Udp(server) => {
                let server = *server;
                // One table serves every policy: load it the first time only.
                let load = if server_policy.is_none() { records } else { 0 };
                let (setup, handle) = udp_mica(server, pin, load)?;
                server_policy = Some(setup.manifest.policy.clone());
                open_loop(
                    &mut MicaClient::new(setup.connect()?, handle),
                    rates,
                    seconds,
                    records,
                )?
            }
            On::Inproc(object) => {
                let policy = match pin {
                    Some(p) => PolicyChoice::Always(p),
                    None => PolicyChoice::Auto(CostPolicyConfig::default()),
                };
                let mut config = ClusterConfig::default();
                config.policy = policy;
                let (cluster, handle) = mica_cluster(records, config, object.clone())?;
                if let Some(us) = extra_us {
                    cluster.congestion().limit_host(us * 1000);
                }
                open_loop(
                    &mut MicaClient::new(cluster.client(), handle),
                    rates,
                    seconds,
                    records,
                )?
            }
        };
        let mut points = Vec::new();
        for (rate, achieved, q) in runs {
            points.push((rate as f64, q.p99 as f64 / 1e3));
            rows.push(
                json!({ "policy": name, "offered": rate, "achieved": achieved, "latency": q }),
            );
        }
        series.push(Series {
            label: name.to_string(),
            points,
        });
    }
    drop(congestion);
    let f = fabric.name();
    let title = match extra_us {
        Some(us) => format!(
            "Placement comparison: MICA GET p99 vs offered load, host congested +{us} us/msg ({f})"
        ),
        None => format!("Placement comparison: MICA GET p99 vs offered load ({f})"),
    };
    let file = if extra_us.is_some() {
        "placements-congested"
    } else {
        "placements"
    };
    lines(
        &out.join(format!("{file}.svg")),
        &Chart {
            title: &title,
            x_label: "offered load (ops/s)",
            y_label: "p99 from scheduled send (us)",
            log_y: true,
            windows: vec![],
        },
        &series,
    )?;
    let doc = json!({ "command": command_line(), "mode": fabric.mode(), "experiment": "placement-comparison", "host_extra_us": extra_us, "server_policy": server_policy, "runs": rows });
    write_json(out, file, &doc)?;
    Ok(doc)
}
