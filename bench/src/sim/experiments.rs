//! The paper's experiments at hardware scale, in the simulator (`naam-bench sim capacity |
//! placements | shift | scale`), and beyond one server (`servers`). Each writes `sim-<name>.json` (its profile, seed, command and
//! every point) and a chart beside it; every figure is a model output for the profile's
//! hardware, labelled `sim:<profile>`.

use std::path::PathBuf;

use serde::Serialize;

use super::{run, Congestion, Profile, SimConfig, SimReport};
use crate::driver::App;
use crate::plot::{self, Chart, Series};
use naam_runtime::proto::{Nanos, Placement};

/// What every experiment is run with.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The hardware.
    pub profile: Profile,
    /// The seed of every run (each point's runs use it).
    pub seed: u64,
    /// Where the JSON and the charts go.
    pub out: PathBuf,
    /// The command line, recorded in the JSON.
    pub command: String,
    /// Smaller sweeps and shorter windows (a smoke run, as CI's).
    pub quick: bool,
}

/// One run of an experiment, summarised.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// What varied, by name.
    pub label: String,
    /// The varied value.
    pub x: f64,
    /// Operations per second.
    pub throughput_ops: f64,
    /// Median latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Busy fraction of the host's cores and of the NIC's.
    pub host_busy: f64,
    /// See `host_busy`.
    pub nic_busy: f64,
    /// Operations answered by each placement (client, NIC, host).
    pub placed: [u64; 3],
    /// Operations that failed.
    pub failed: u64,
}

/// A chart's series of `points`' throughput, in M ops/s.
fn throughput_series(label: &str, points: &[Point]) -> Series {
    Series {
        label: label.into(),
        points: points
            .iter()
            .map(|p| (p.x, p.throughput_ops / 1e6))
            .collect(),
    }
}

impl Point {
    fn of(label: &str, x: f64, r: &SimReport) -> Point {
        Point {
            label: label.into(),
            x,
            throughput_ops: r.throughput_ops,
            p50_us: r.latency.p50_us,
            p99_us: r.latency.p99_us,
            host_busy: r.host_busy,
            nic_busy: r.nic_busy,
            placed: r.placed,
            failed: r.failed,
        }
    }
}

/// An experiment's record.
#[derive(Debug, Serialize)]
pub struct Record<T: Serialize> {
    /// `sim:<profile>`.
    pub mode: String,
    /// The experiment.
    pub experiment: &'static str,
    /// The profile, whole.
    pub profile: Profile,
    /// The seed.
    pub seed: u64,
    /// The command that made it.
    pub command: String,
    /// What it found.
    pub results: T,
}

fn write<T: Serialize>(setup: &Setup, name: &'static str, results: T) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&setup.out)?;
    let path = setup.out.join(format!("sim-{name}.json"));
    let record = Record {
        mode: format!("sim:{}", setup.profile.name),
        experiment: name,
        profile: setup.profile.clone(),
        seed: setup.seed,
        command: setup.command.clone(),
        results,
    };
    std::fs::write(&path, serde_json::to_string_pretty(&record)? + "\n")?;
    Ok(path)
}

fn base(setup: &Setup, clients: usize) -> SimConfig {
    let mut c = SimConfig::new(setup.profile.clone(), setup.seed, clients);
    c.records = if setup.quick { 2_000 } else { 100_000 };
    c.warmup_ns = if setup.quick { 2_000_000 } else { 10_000_000 };
    c.measure_ns = if setup.quick { 5_000_000 } else { 50_000_000 };
    c
}

fn chart_path(setup: &Setup, name: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&setup.out)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", setup.out.display()))?;
    Ok(setup.out.join(format!("sim-{name}.svg")))
}

/// Offload capacity: MICA's YCSB-B and the B-tree's lookups (YCSB-C) served by the NIC's cores
/// alone, over more and more closed-loop clients; the peak is the capacity.
#[derive(Debug, Serialize)]
pub struct Capacity {
    /// MICA, YCSB-B, reads pinned to the NIC.
    pub mica: Vec<Point>,
    /// The B-tree, YCSB-C (lookups), pinned to the NIC.
    pub btree: Vec<Point>,
    /// The highest throughput of each.
    pub mica_peak_ops: f64,
    /// See `mica_peak_ops`.
    pub btree_peak_ops: f64,
}

/// Runs [`Capacity`].
pub fn capacity(setup: &Setup) -> anyhow::Result<(PathBuf, Capacity)> {
    let clients: &[usize] = if setup.quick {
        &[4, 16]
    } else {
        &[8, 16, 32, 64, 128, 256]
    };
    let sweep = |app: App, workload: char| -> anyhow::Result<Vec<Point>> {
        let mut points = Vec::new();
        for &n in clients {
            let mut c = base(setup, n);
            c.app = app;
            c.workload = workload;
            c.pin = Some(Placement::Nic);
            let r = run(&c)?;
            eprintln!(
                "capacity: {} {n} clients: {:.0} ops/s, p99 {:.1} us",
                app.kind(),
                r.throughput_ops,
                r.latency.p99_us
            );
            points.push(Point::of("clients", n as f64, &r));
        }
        Ok(points)
    };
    let mica = sweep(App::Mica, 'b')?;
    let btree = sweep(App::Btree, 'c')?;
    let peak = |p: &[Point]| p.iter().map(|p| p.throughput_ops).fold(0.0, f64::max);
    let results = Capacity {
        mica_peak_ops: peak(&mica),
        btree_peak_ops: peak(&btree),
        mica,
        btree,
    };
    let series = vec![
        throughput_series("MICA YCSB-B at the NIC", &results.mica),
        throughput_series("B-tree lookups at the NIC", &results.btree),
    ];
    let title = format!("Offload capacity (sim:{})", setup.profile.name);
    plot::lines(
        &chart_path(setup, "capacity")?,
        &Chart {
            title: &title,
            x_label: "closed-loop clients",
            y_label: "M ops/s",
            log_y: false,
            windows: Vec::new(),
        },
        &series,
    )?;
    Ok((write(setup, "capacity", &results)?, results))
}

/// Placements over offered load: MICA YCSB-B with every read at the host, at the NIC, at
/// the clients (one-sided READs), or where the steering sends it.
#[derive(Debug, Serialize)]
pub struct Placements {
    /// One sweep per placement (`host`, `nic`, `client`, `auto`).
    pub sweeps: Vec<(String, Vec<Point>)>,
}

/// Runs [`Placements`].
pub fn placements(setup: &Setup) -> anyhow::Result<(PathBuf, Placements)> {
    let loads: &[f64] = if setup.quick {
        &[0.5e6, 2e6]
    } else {
        &[0.25e6, 0.5e6, 1e6, 2e6, 3e6, 4e6, 5e6]
    };
    let clients = if setup.quick { 16 } else { 128 };
    let mut sweeps = Vec::new();
    for (name, pin) in [
        ("host", Some(Placement::Host)),
        ("nic", Some(Placement::Nic)),
        ("client", Some(Placement::Client)),
        ("auto", None),
    ] {
        let mut points = Vec::new();
        for &load in loads {
            let mut c = base(setup, clients);
            c.pin = pin;
            c.window = 4;
            c.target_per_client = Some(load / clients as f64);
            let r = run(&c)?;
            eprintln!(
                "placements: {name} at {load:.0}/s: {:.0} ops/s, p99 {:.1} us",
                r.throughput_ops, r.latency.p99_us
            );
            points.push(Point::of("offered ops/s", load, &r));
        }
        sweeps.push((name.to_string(), points));
    }
    let results = Placements { sweeps };
    let series: Vec<Series> = results
        .sweeps
        .iter()
        .map(|(name, pts)| Series {
            label: format!("{name}: p99"),
            points: pts.iter().map(|p| (p.x / 1e6, p.p99_us)).collect(),
        })
        .collect();
    let title = format!("Placements over offered load (sim:{})", setup.profile.name);
    plot::lines(
        &chart_path(setup, "placements")?,
        &Chart {
            title: &title,
            x_label: "offered load, M ops/s",
            y_label: "p99 latency, us",
            log_y: true,
            windows: Vec::new(),
        },
        &series,
    )?;
    Ok((write(setup, "placements", &results)?, results))
}

/// Shift: the host congested for one second under MICA YCSB-B steered automatically.
#[derive(Debug, Serialize)]
pub struct Shift {
    /// The run, whole (its timeline has the share of each placement per millisecond).
    pub run: SimReport,
    /// Milliseconds from the congestion's start until 90% of a bucket's operations ran off
    /// the host (`None`: never).
    pub off_ms: Option<f64>,
    /// Milliseconds from its end until the host ran at least 90% of its share before it.
    pub back_ms: Option<f64>,
}

/// Runs [`Shift`].
pub fn shift(setup: &Setup) -> anyhow::Result<(PathBuf, Shift)> {
    let (from, to): (Nanos, Nanos) = if setup.quick {
        (10_000_000, 40_000_000)
    } else {
        (200_000_000, 1_200_000_000)
    };
    let clients = if setup.quick { 16 } else { 128 };
    let mut c = base(setup, clients);
    c.measure_ns = to + from + if setup.quick { 20_000_000 } else { 300_000_000 };
    c.window = 4;
    c.target_per_client = Some(1e6 / clients as f64);
    c.bucket_ns = Some(1_000_000);
    c.congestion = Some(Congestion {
        from_ns: from,
        to_ns: to,
        extra_ns: 20_000,
    });
    let r = run(&c)?;
    let share = |b: &super::Bucket| {
        let n: u64 = b.placed.iter().sum();
        (n > 0).then(|| b.placed[Placement::Host.index()] as f64 / n as f64)
    };
    let ms = |ns: Nanos| ns as f64 / 1e6;
    let before: Vec<f64> = r
        .timeline
        .iter()
        .filter(|b| b.start_ms < ms(from))
        .filter_map(share)
        .collect();
    let before = before.iter().sum::<f64>() / before.len().max(1) as f64;
    let off_ms = r
        .timeline
        .iter()
        .filter(|b| b.start_ms >= ms(from) && b.start_ms < ms(to))
        .find(|b| share(b).is_some_and(|s| s <= 0.1))
        .map(|b| b.start_ms + 1.0 - ms(from));
    let back_ms = r
        .timeline
        .iter()
        .filter(|b| b.start_ms >= ms(to))
        .find(|b| share(b).is_some_and(|s| s >= 0.9 * before))
        .map(|b| b.start_ms + 1.0 - ms(to));
    eprintln!("shift: 90% off the host after {off_ms:?} ms, back after {back_ms:?} ms");
    let series = [Placement::Host, Placement::Nic]
        .into_iter()
        .map(|p| Series {
            label: format!("{p}"),
            points: r
                .timeline
                .iter()
                .map(|b| (b.start_ms, b.placed[p.index()] as f64 * 1e3 / 1e6))
                .collect(),
        })
        .collect::<Vec<_>>();
    let title = format!("Shift off a congested host (sim:{})", setup.profile.name);
    plot::lines(
        &chart_path(setup, "shift")?,
        &Chart {
            title: &title,
            x_label: "ms",
            y_label: "M ops/s answered",
            log_y: false,
            windows: vec![(ms(from), ms(to), "host congested".into())],
        },
        &series,
    )?;
    let results = Shift {
        run: r,
        off_ms,
        back_ms,
    };
    Ok((write(setup, "shift", &results)?, results))
}

/// Offload scale: 1 to 1,024 apps (tenants), one client each at least, under one offered
/// load; latency as the apps grow.
#[derive(Debug, Serialize)]
pub struct Scale {
    /// One point per app count.
    pub points: Vec<Point>,
}

/// Runs [`Scale`].
pub fn scale(setup: &Setup) -> anyhow::Result<(PathBuf, Scale)> {
    let apps: &[usize] = if setup.quick {
        &[1, 8]
    } else {
        &[1, 8, 64, 256, 1024]
    };
    let mut points = Vec::new();
    for &n in apps {
        let clients = n.max(64);
        let mut c = base(setup, clients);
        c.apps = n;
        c.records = (n as u64 * 100).max(c.records.min(10_000));
        c.target_per_client = Some(1e6 / clients as f64);
        let r = run(&c)?;
        eprintln!(
            "scale: {n} apps: {:.0} ops/s, p50 {:.1} us, p99 {:.1} us",
            r.throughput_ops, r.latency.p50_us, r.latency.p99_us
        );
        points.push(Point::of("apps", n as f64, &r));
    }
    let results = Scale { points };
    let series = vec![
        Series {
            label: "p50".into(),
            points: results.points.iter().map(|p| (p.x, p.p50_us)).collect(),
        },
        Series {
            label: "p99".into(),
            points: results.points.iter().map(|p| (p.x, p.p99_us)).collect(),
        },
    ];
    let title = format!("Offload scale (sim:{})", setup.profile.name);
    plot::lines(
        &chart_path(setup, "scale")?,
        &Chart {
            title: &title,
            x_label: "apps (tenants)",
            y_label: "latency, us",
            log_y: false,
            windows: Vec::new(),
        },
        &series,
    )?;
    Ok((write(setup, "scale", &results)?, results))
}

/// Beyond one server: N servers, each with its SmartNIC, behind one switch, records spread by
/// key hash, 32 clients a server (256 at 8), MICA YCSB-B steered.
#[derive(Debug, Serialize)]
pub struct Servers {
    /// One point per server count.
    pub points: Vec<Point>,
}

/// Runs [`Servers`].
pub fn servers(setup: &Setup) -> anyhow::Result<(PathBuf, Servers)> {
    let counts: &[usize] = if setup.quick { &[1, 2] } else { &[1, 2, 4, 8] };
    let mut points = Vec::new();
    for &n in counts {
        let clients = 32 * n;
        let mut c = base(setup, clients);
        c.servers = n;
        c.window = 4;
        c.records = if setup.quick { 1_000 } else { 20_000 } * n as u64;
        c.measure_ns = if setup.quick { 3_000_000 } else { 20_000_000 };
        let r = run(&c)?;
        eprintln!(
            "servers: {n} servers, {clients} clients: {:.0} ops/s, p50 {:.1} us, p99 {:.1} us",
            r.throughput_ops, r.latency.p50_us, r.latency.p99_us
        );
        points.push(Point::of("servers", n as f64, &r));
    }
    let results = Servers { points };
    let series = vec![throughput_series("throughput", &results.points)];
    let title = format!("Servers behind one switch (sim:{})", setup.profile.name);
    plot::lines(
        &chart_path(setup, "servers")?,
        &Chart {
            title: &title,
            x_label: "servers (32 clients each)",
            y_label: "M ops/s",
            log_y: false,
            windows: Vec::new(),
        },
        &series,
    )?;
    Ok((write(setup, "servers", &results)?, results))
}
