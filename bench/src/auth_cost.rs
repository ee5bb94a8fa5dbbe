//! What authentication costs: MICA YCSB-B over the UDP fabric with sessions as deployed,
//! against the same build with datagram authentication off, in one run.
//!
//! Each run starts a whole deployment in this process on loopback (naam-server's driver and
//! naam-nic's driver on their own threads, the NIC over the host's own regions, credentials
//! made for the run), loads the records and runs the workload, then stops it. Rounds alternate the
//! order of the two modes (on/off, then off/on) so drift on the machine falls on both alike.
//! Authentication can be turned off only on loopback ([`Authentication::check_scope`]), and
//! nothing but this measurement does it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use naam_runtime::cluster::ClusterConfig;
use naam_runtime::proto::session::{Authentication, Credential};
use naam_runtime::proto::Placement;
use naam_runtime::udp;
use serde_json::json;

use crate::deployment::{DeploymentPlan, InProcessDeployment};
use crate::driver::{run_udp_with, App, PlacementChoice, YcsbConfig, YcsbResult};
use crate::ycsb::{RecordShape, Workload};

/// Settings of the measurement.
#[derive(Clone, Debug)]
pub struct AuthCostConfig {
    /// Records loaded (MICA's table is sized for them).
    pub records: u64,
    /// Operations per run.
    pub ops: u64,
    /// Client threads.
    pub threads: usize,
    /// Rounds; each runs both modes once.
    pub rounds: u32,
}

/// MICA sized for `records` as app 1 of tenant `mica`, on loopback with datagram
/// authentication `auth`.
pub(crate) fn start(
    shm: PathBuf,
    records: u64,
    built: &(Arc<naam_runtime::vm::LoadedObject>, Vec<u8>),
    tenant: &Credential,
    auth: Authentication,
) -> anyhow::Result<InProcessDeployment> {
    let mc = naam_mica::MicaConfig::sized(records.saturating_mul(2).max(1024), 32, 1024);
    let app = udp::HostApp {
        spec: naam_mica::app_spec(1, &mc, built.0.clone(), Placement::Host)?,
        kind: "mica".into(),
        params: serde_json::to_value(mc)?,
        object_bytes: built.1.clone(),
        client_writes: false,
        credential: Some(tenant.clone()),
    };
    let plan = DeploymentPlan {
        app,
        tenant: "mica".into(),
        credential: tenant.clone(),
        // As naam-server runs it by default.
        host: {
            let mut config = ClusterConfig::default();
            config.executor_poll = udp::SERVER_EXECUTOR_POLL;
            config
        },
        nic: ClusterConfig::default(),
        authentication: auth,
        congestion_control: false,
        network: None,
        others: Vec::new(),
        deploys: None,
    };
    InProcessDeployment::start(shm, plan)
}

fn label(a: Authentication) -> &'static str {
    match a {
        Authentication::On => "on",
        _ => "off",
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Runs the measurement; writes `auth-cost.json` into `out` and returns its document.
pub fn auth_cost(out: &Path, c: &AuthCostConfig) -> anyhow::Result<serde_json::Value> {
    if c.rounds == 0 || c.ops == 0 || c.records == 0 || c.threads == 0 {
        bail!("auth-cost needs at least one round, operation, record and thread");
    }
    let loaded = naam_mica::handlers().context("loading MICA's embedded handlers")?;
    let built = (Arc::new(loaded), naam_mica::HANDLERS_OBJECT.to_vec());
    let tenant = Credential::generate(&naam_runtime::entropy::os())?;
    let mut runs = Vec::new();
    for round in 0..c.rounds {
        let order = if round % 2 == 0 {
            [Authentication::On, Authentication::OffForMeasurement]
        } else {
            [Authentication::OffForMeasurement, Authentication::On]
        };
        for auth in order {
            let shm = crate::deployment::shm_dir(&format!(
                "naam-auth-cost-{}-{round}-{}",
                std::process::id(),
                label(auth)
            ));
            let d = start(shm, c.records, &built, &tenant, auth)?;
            let client = d.client_config();
            let r = {
                let cfg = YcsbConfig {
                    app: App::Mica,
                    workload: Workload::core('b').expect("workload b"),
                    records: c.records,
                    ops: c.ops,
                    threads: c.threads,
                    pipeline: 1,
                    placement: PlacementChoice::Auto,
                    shape: RecordShape::default(),
                    seed: 42 + round as u64,
                    executors: (1, 1),
                    fabric: "udp".into(),
                    server: Some(d.server),
                    shards: Vec::new(),
                    run: Default::default(),
                };
                run_udp_with(&cfg, client, &|_, _| {})
            };
            d.stop();
            let r: YcsbResult =
                r.with_context(|| format!("round {round}, authentication {}", label(auth)))?;
            eprintln!(
                "naam-bench: auth-cost round {round} authentication {:>3}: {:.0} ops/s, p99 {:.1} us",
                label(auth),
                r.throughput,
                r.all.p99 as f64 / 1e3
            );
            runs.push((round, auth, r));
        }
    }
    let summary = |a: Authentication| {
        let of: Vec<&YcsbResult> = runs.iter().filter(|x| x.1 == a).map(|x| &x.2).collect();
        (
            median(of.iter().map(|r| r.throughput).collect()),
            median(of.iter().map(|r| r.all.p99 as f64 / 1e3).collect()),
        )
    };
    let (on_ops, on_p99) = summary(Authentication::On);
    let (off_ops, off_p99) = summary(Authentication::OffForMeasurement);
    let loss = if off_ops > 0.0 {
        100.0 * (off_ops - on_ops) / off_ops
    } else {
        0.0
    };
    let p99_change = if off_p99 > 0.0 {
        100.0 * (on_p99 - off_p99) / off_p99
    } else {
        0.0
    };
    let doc = json!({
        "experiment": "auth-cost",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "mode": "udp on loopback, one process (naam-server's and naam-nic's drivers on threads; NIC cores and DMA emulated)",
        "workload": "YCSB-B on MICA, placement auto",
        "records": c.records,
        "ops_per_run": c.ops,
        "threads": c.threads,
        "rounds": c.rounds,
        "authentication_on": { "median_ops_per_s": on_ops, "median_p99_us": on_p99 },
        "authentication_off": { "median_ops_per_s": off_ops, "median_p99_us": off_p99 },
        "throughput_loss_percent": loss,
        "p99_change_percent": p99_change,
        "runs": runs.iter().map(|(round, a, r)| json!({
            "round": round,
            "authentication": label(*a),
            "ops_per_s": r.throughput,
            "p50_us": r.all.p50 as f64 / 1e3,
            "p99_us": r.all.p99 as f64 / 1e3,
            "placement_fractions": r.placement_fractions,
        })).collect::<Vec<_>>(),
    });
    let path = out.join("auth-cost.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(doc)
}
