//! How a YCSB result is shown: YCSB's own text (`[OVERALL], RunTime(ms), ...` and per operation
//! `[READ], 99thPercentileLatency(us), ...`), NAAM's per-placement section after it in the same
//! shape, and JSON whose field names carry their units, with names instead of ids.

use std::fmt::Write as _;

use naam_runtime::proto::Placement;
use naam_runtime::Percentiles;
use serde_json::{json, Value};

use crate::driver::{App, OpSummary, PhaseSummary, YcsbResult};

fn us(ns: u64) -> u64 {
    ns / 1000
}

fn us_f(ns: f64) -> f64 {
    (ns / 1000.0 * 100.0).round() / 100.0
}

/// The text report ([`text`]) as YCSB's `JSONArrayMeasurementsExporter` writes it: one array
/// of `{"metric", "measurement", "value"}`, numbers as numbers.
pub fn json_array(text: &str) -> Value {
    let rows: Vec<Value> = text
        .lines()
        .filter_map(|l| {
            let (metric, rest) = l.strip_prefix('[')?.split_once("], ")?;
            let (measurement, value) = rest.split_once(", ")?;
            let value = value
                .parse::<u64>()
                .map(Value::from)
                .or_else(|_| value.parse::<f64>().map(Value::from))
                .unwrap_or_else(|_| Value::from(value));
            Some(json!({ "metric": metric, "measurement": measurement, "value": value }))
        })
        .collect();
    Value::Array(rows)
}

/// A percentile as YCSB's report names it: `95th`, `99th`, `1st`, `99.9`.
fn ordinal(q: f64) -> String {
    if q.fract() != 0.0 {
        return format!("{q}");
    }
    let n = q as u64;
    let suffix = match (n % 10, n % 100) {
        (1, r) if r != 11 => "st",
        (2, r) if r != 12 => "nd",
        (3, r) if r != 13 => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// YCSB's block for one phase: `[OVERALL]` then each operation's lines.
fn phase_text(out: &mut String, seconds: f64, throughput: f64, ops: &[OpSummary]) {
    let _ = writeln!(
        out,
        "[OVERALL], RunTime(ms), {}",
        (seconds * 1000.0).round() as u64
    );
    let _ = writeln!(out, "[OVERALL], Throughput(ops/sec), {throughput:.2}");
    for o in ops {
        let name = o.op.ycsb_name();
        let l = &o.latency;
        let succeeded = l.count;
        let _ = writeln!(out, "[{name}], Operations, {}", succeeded + o.errors);
        let _ = writeln!(out, "[{name}], AverageLatency(us), {:.2}", us_f(l.mean));
        let _ = writeln!(out, "[{name}], MinLatency(us), {}", us(o.min));
        let _ = writeln!(out, "[{name}], MaxLatency(us), {}", us(l.max));
        for &(q, ns) in &o.percentiles {
            let _ = writeln!(
                out,
                "[{name}], {}PercentileLatency(us), {}",
                ordinal(q),
                us(ns)
            );
        }
        let _ = writeln!(
            out,
            "[{name}], Return=OK, {}",
            succeeded - o.not_found.min(succeeded)
        );
        if o.not_found > 0 {
            let _ = writeln!(out, "[{name}], Return=NOT_FOUND, {}", o.not_found);
        }
        if o.errors > 0 {
            let _ = writeln!(out, "[{name}], Return=ERROR, {}", o.errors);
        }
    }
}

/// The text a command prints on stdout: YCSB's lines for the phase it measured (the run phase,
/// or the load phase of `load`), then `[NAAM]` lines: mode, phases, and per placement its
/// messages, share and latencies.
pub fn text(r: &YcsbResult) -> String {
    let mut out = String::new();
    if r.ran {
        phase_text(&mut out, r.seconds, r.throughput, &r.ops);
    } else if let Some(l) = &r.load {
        phase_text(&mut out, l.seconds, l.throughput, &l.ops);
    }
    let c = &r.config;
    let _ = writeln!(out, "[NAAM], Mode, {}", r.mode);
    let _ = writeln!(
        out,
        "[NAAM], Workload, {} on {} ({} records of {}; {} client thread(s); reads at {})",
        c.workload.name,
        c.app.kind(),
        c.records,
        match c.app {
            App::Mica => format!("{} B", c.shape.len()),
            App::Btree => "8-byte values".to_string(),
        },
        c.threads,
        match c.placement {
            crate::driver::PlacementChoice::Auto => "auto".to_string(),
            crate::driver::PlacementChoice::Fixed(p) => p.name().to_string(),
        }
    );
    if let (true, Some(l)) = (r.ran, &r.load) {
        let _ = writeln!(
            out,
            "[NAAM], LoadRunTime(ms), {}",
            (l.seconds * 1000.0).round() as u64
        );
        let _ = writeln!(
            out,
            "[NAAM], LoadThroughput(records/sec), {:.2}",
            l.throughput
        );
    }
    if r.timed_out || r.load.as_ref().is_some_and(|l| l.timed_out) {
        let _ = writeln!(out, "[NAAM], StoppedBy, maxexecutiontime");
    }
    if r.interrupted {
        let _ = writeln!(out, "[NAAM], StoppedBy, interrupt");
    }
    if r.ran {
        for p in Placement::ALL {
            let q = r.placements.placement[p.index()];
            let tag = format!("NAAM-{}", p.name().to_ascii_uppercase());
            let _ = writeln!(out, "[{tag}], Messages, {}", r.placements.ops[p.index()]);
            let _ = writeln!(
                out,
                "[{tag}], Share(%), {:.1}",
                100.0 * r.placement_fractions[p.index()]
            );
            if q.count > 0 {
                let _ = writeln!(out, "[{tag}], AverageLatency(us), {:.2}", us_f(q.mean));
                let _ = writeln!(out, "[{tag}], 50thPercentileLatency(us), {}", us(q.p50));
                let _ = writeln!(out, "[{tag}], 99thPercentileLatency(us), {}", us(q.p99));
                let _ = writeln!(out, "[{tag}], 99.9thPercentileLatency(us), {}", us(q.p999));
            }
        }
        for (status, n) in &r.placements.errors {
            let _ = writeln!(out, "[NAAM-ERRORS], {status:?}, {n}");
        }
        let t = r.transport;
        if t.sent > 0 {
            let _ = writeln!(out, "[NAAM-UDP], Exchanges, {}", t.sent);
            let _ = writeln!(out, "[NAAM-UDP], Resends, {}", t.resends);
            let _ = writeln!(out, "[NAAM-UDP], EarlyResends, {}", t.early_resends);
            let _ = writeln!(out, "[NAAM-UDP], DuplicateAnswers, {}", t.duplicates);
        }
    }
    out
}

fn latency_json(p: &Percentiles) -> Value {
    json!({
        "count": p.count,
        "average_us": us_f(p.mean),
        "p50_us": us(p.p50),
        "p99_us": us(p.p99),
        "p999_us": us(p.p999),
        "max_us": us(p.max),
    })
}

fn ops_json(ops: &[OpSummary]) -> Value {
    Value::Array(
        ops.iter()
            .map(|o| {
                json!({
                    "operation": o.op.ycsb_name(),
                    "operations": o.latency.count + o.errors,
                    "return_ok": o.latency.count - o.not_found.min(o.latency.count),
                    "return_not_found": o.not_found,
                    "return_error": o.errors,
                    "average_latency_us": us_f(o.latency.mean),
                    "min_latency_us": us(o.min),
                    "max_latency_us": us(o.latency.max),
                    "p50_latency_us": us(o.latency.p50),
                    "p95_latency_us": us(o.p95),
                    "p99_latency_us": us(o.latency.p99),
                    "p999_latency_us": us(o.latency.p999),
                })
            })
            .collect(),
    )
}

fn phase_json(p: &PhaseSummary) -> Value {
    json!({
        "run_time_ms": (p.seconds * 1000.0).round() as u64,
        "throughput_ops_per_sec": p.throughput,
        "stopped_by_time_limit": p.timed_out,
        "stopped_by_interrupt": p.interrupted,
        "operations": ops_json(&p.ops),
    })
}

/// The JSON document of `--json`: units in every name, placements and handlers by name.
/// `handler_names` maps the handler ids of the app's object to their names.
pub fn json(r: &YcsbResult, command: &str, handler_names: &[(u32, String)]) -> Value {
    let c = &r.config;
    let workload = &c.workload;
    let mix: serde_json::Map<String, Value> = workload
        .mix
        .iter()
        .map(|(op, p)| (format!("{}_proportion", op.name()), json!(p)))
        .collect();
    let name_of = |id: u32| {
        handler_names
            .iter()
            .find(|(h, _)| *h == id)
            .map_or_else(|| format!("handler-{id:#010x}"), |(_, n)| n.clone())
    };
    let run = r.ran.then(|| {
        json!({
            "run_time_ms": (r.seconds * 1000.0).round() as u64,
            "throughput_ops_per_sec": r.throughput,
            "stopped_by_time_limit": r.timed_out,
            "stopped_by_interrupt": r.interrupted,
            "operations": ops_json(&r.ops),
            "all_operations_latency": latency_json(&r.all),
            "placements": Placement::ALL.iter().map(|p| json!({
                "placement": p.name(),
                "messages": r.placements.ops[p.index()],
                "share_percent": 100.0 * r.placement_fractions[p.index()],
                "latency": latency_json(&r.placements.placement[p.index()]),
            })).collect::<Vec<_>>(),
            "handlers": r.placements.handlers.iter().map(|(key, p)| json!({
                "app": c.app.kind(),
                "handler": name_of(key.1),
                "latency": latency_json(p),
            })).collect::<Vec<_>>(),
            "errors_by_status": r.placements.errors.iter()
                .map(|(s, n)| (format!("{s:?}"), json!(n)))
                .collect::<serde_json::Map<_, _>>(),
        })
    });
    json!({
        "command": command,
        "mode": r.mode,
        "config": {
            "app": c.app.kind(),
            "workload": workload.name,
            "mix": mix,
            "request_distribution": workload.distribution,
            "insert_order": if workload.naming.ordered { "ordered" } else { "hashed" },
            "record_count": c.records,
            "operation_count": c.ops,
            "field_count": c.shape.field_count,
            "field_length_bytes": c.shape.field_length,
            "threads": c.threads,
            "placement": match c.placement {
                crate::driver::PlacementChoice::Auto => "auto".to_string(),
                crate::driver::PlacementChoice::Fixed(p) => p.name().to_string(),
            },
            "fabric": c.fabric,
            "server": c.server.map(|s| s.to_string()),
            "shards": c.shards,
            "host_executors": c.executors.0,
            "nic_executors": c.executors.1,
            "seed": c.seed,
            "phases": c.run.phases,
            "target_ops_per_sec": c.run.target_ops_per_sec,
            "max_execution_time_s": c.run.max_execution_time_s,
        },
        "load": r.load.as_ref().map(phase_json),
        "run": run,
    })
}
