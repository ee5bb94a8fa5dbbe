//! `naam-bench experiment deploys`: what deploying at run time costs, over the UDP fabric.
//!
//! One deployment in this process on loopback (naam-server's and naam-nic's drivers on their
//! own threads, sessions authenticated, deploys allowed with naam-server's default quotas)
//! serves two MICA tables, each its own tenant's. Two measurements:
//!
//! - **Deploy to first answer**: tenant `deployer` deploys MICA's five handlers into its table
//!   (`UdpClient::deploy`: the object uploaded in chunks, verified and built by the server's
//!   deployer thread on the tiered engine) and then calls `mica_get`; the time from the start
//!   of the upload to that answer. Each deploy asks for a budget of its own, but a budget is
//!   a run-time value, in neither the code's key nor the verified program's: the same object
//!   deployed again shares its verified program and compiled code with the handlers it
//!   replaces, and what each deploy does anew is the upload, the executables (the
//!   interpreter's decoding), the swap and the manifest. A new object is verified, and its
//!   code compiled in the background, on top of that.
//! - **The other tenant's tail while one deploys in a loop**: tenant `quiet` runs closed-loop
//!   GETs over its loaded table; phases alternate between undisturbed and with `deployer`
//!   deploying back to back, as fast as the server's deploy rate for a tenant allows, and
//!   each phase's p50/p99/p99.9 are reported with
//!   the ratio to the undisturbed phases.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use hdrhistogram::Histogram;
use naam_mica::{MicaClient, MicaConfig};
use naam_runtime::cluster::ClusterConfig;
use naam_runtime::proto::control::DeployHandler;
use naam_runtime::proto::session::{Authentication, Credential};
use naam_runtime::proto::{EngineKind, Placement};
use naam_runtime::udp::{self, UdpClient};
use serde_json::json;

use crate::deployment::{DeploymentPlan, InProcessDeployment};
use crate::driver::UdpSetup;

/// Settings of the measurement.
#[derive(Clone, Debug)]
pub struct DeploysConfig {
    /// Deploys timed to their first answer.
    pub deploys: u32,
    /// Rounds of the tail measurement; each runs one undisturbed and one disturbed phase.
    pub rounds: u32,
    /// Length of each phase, seconds.
    pub seconds: f64,
    /// Records in the quiet tenant's table.
    pub records: u64,
    /// Deploys a tenant may make a second on the server; the timed deploys are spaced by its
    /// inverse.
    pub rate: f64,
}

const DEPLOYER: u32 = 1;
const QUIET: u32 = 2;

/// MICA's handlers, as its app spec makes them: `mica_get` a read, the rest writes.
fn mica_handlers() -> Vec<DeployHandler> {
    let h = |name: &str, write| DeployHandler {
        name: name.into(),
        write,
    };
    use naam_mica::handlers as n;
    vec![
        h(n::GET, false),
        h(n::PUT, true),
        h(n::UPDATE, true),
        h(n::DELETE, true),
        h(n::RMW, true),
    ]
}

fn mica_app(
    id: u32,
    records: u64,
    object: &Arc<naam_runtime::vm::LoadedObject>,
    credential: &Credential,
) -> anyhow::Result<udp::HostApp> {
    let mc = MicaConfig::sized(records.saturating_mul(2).max(1024), 32, 128);
    Ok(udp::HostApp {
        spec: naam_mica::app_spec(id, &mc, object.clone(), Placement::Host)?,
        kind: "mica".into(),
        params: serde_json::to_value(mc)?,
        object_bytes: naam_mica::HANDLERS_OBJECT.to_vec(),
        client_writes: false,
        credential: Some(credential.clone()),
    })
}

/// A MICA client of table `app` for tenant `tenant`.
fn mica_client(
    d: &InProcessDeployment,
    tenant: &str,
    credential: &Credential,
    app: u32,
) -> anyhow::Result<MicaClient<UdpClient>> {
    let c = UdpClient::connect(&d.client_config_as(tenant, credential))?;
    let a = c
        .manifest()
        .app(app)
        .with_context(|| format!("no app {app} in {tenant}'s session"))?
        .clone();
    Ok(MicaClient::new(c, UdpSetup::mica_of(&a)?))
}

/// One deploy of MICA's handlers into `app` with instruction budget `budget`: the server's
/// report of its slowest handler's build, microseconds.
fn deploy_once(m: &mut MicaClient<UdpClient>, budget: u64) -> anyhow::Result<u64> {
    let d = m.transport().deploy(
        DEPLOYER,
        naam_mica::HANDLERS_OBJECT,
        mica_handlers(),
        Some(EngineKind::Tiered),
        Some(budget),
    )?;
    Ok(d.handlers.iter().map(|h| h.build_us).max().unwrap_or(0))
}

/// The wait a refusal over the deploy rate names ("retry in N ms").
fn retry_after(refusal: &str) -> Option<Duration> {
    let (_, rest) = refusal.split_once("retry in ")?;
    let ms: f64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_secs_f64((ms.max(1.0)) / 1e3))
}

fn quantiles(h: &Histogram<u64>) -> serde_json::Value {
    json!({
        "ops": h.len(),
        "p50_us": h.value_at_quantile(0.5) as f64 / 1e3,
        "p99_us": h.value_at_quantile(0.99) as f64 / 1e3,
        "p999_us": h.value_at_quantile(0.999) as f64 / 1e3,
        "max_us": h.max() as f64 / 1e3,
    })
}

/// Closed-loop GETs of the quiet tenant for `seconds`: their latencies, nanoseconds.
fn quiet_phase(
    m: &mut MicaClient<UdpClient>,
    records: u64,
    seconds: f64,
) -> anyhow::Result<Histogram<u64>> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut k = 0u64;
    while Instant::now() < end {
        k = (k + 7919) % records;
        let key = format!("user{k:012}");
        let t = Instant::now();
        m.get(key.as_bytes())?;
        h.record((t.elapsed().as_nanos() as u64).max(1))?;
    }
    Ok(h)
}

/// Runs the measurement; writes `deploys.json` into `out` and returns its document.
pub fn deploys(out: &Path, c: &DeploysConfig) -> anyhow::Result<serde_json::Value> {
    if c.deploys == 0
        || c.rounds == 0
        || c.records == 0
        || !c.seconds.is_finite()
        || c.seconds <= 0.0
    {
        bail!("deploys needs at least one deploy, round and record, and a positive --seconds");
    }
    if !(c.rate.is_finite() && (0.01..=10_000.0).contains(&c.rate)) {
        bail!("--deploy-rate must be 0.01 to 10000 deploys a second");
    }
    let object = Arc::new(naam_mica::handlers().context("loading MICA's embedded handlers")?);
    let entropy = naam_runtime::entropy::os();
    let (deployer_key, quiet_key) = (
        Credential::generate(&entropy)?,
        Credential::generate(&entropy)?,
    );
    let mut host = ClusterConfig::default();
    host.executor_poll = udp::SERVER_EXECUTOR_POLL;
    let plan = DeploymentPlan {
        app: mica_app(DEPLOYER, 1024, &object, &deployer_key)?,
        tenant: "deployer".into(),
        credential: deployer_key.clone(),
        host,
        nic: ClusterConfig::default(),
        authentication: Authentication::On,
        congestion_control: false,
        network: None,
        others: vec![(
            mica_app(QUIET, c.records, &object, &quiet_key)?,
            "quiet".into(),
            quiet_key.clone(),
        )],
        deploys: Some(c.rate),
    };
    let shm = crate::deployment::shm_dir(&format!("naam-deploys-{}", std::process::id()));
    let d = InProcessDeployment::start(shm, plan)?;
    let result = measure(&d, c, &deployer_key, &quiet_key);
    d.stop();
    let doc = result?;
    crate::experiments::write_json(out, "deploys", &doc)?;
    Ok(doc)
}

fn measure(
    d: &InProcessDeployment,
    c: &DeploysConfig,
    deployer_key: &Credential,
    quiet_key: &Credential,
) -> anyhow::Result<serde_json::Value> {
    let mut quiet = mica_client(d, "quiet", quiet_key, QUIET)?;
    for k in 0..c.records {
        quiet.put(format!("user{k:012}").as_bytes(), &[7u8; 100])?;
    }
    let mut deployer = mica_client(d, "deployer", deployer_key, DEPLOYER)?;
    // A distinct budget per deploy: each deploy changes the handlers (a run-time value; the
    // verified program and the code are shared with the handlers replaced).
    let budgets = Arc::new(AtomicU64::new(200_000));
    let next_budget = |b: &AtomicU64| b.fetch_add(1, Ordering::Relaxed);

    // Deploy to first answer.
    let mut firsts = Vec::new();
    for _ in 0..c.deploys {
        // Spaced within the server's deploy rate.
        std::thread::sleep(Duration::from_secs_f64(1.0 / c.rate));
        let start = Instant::now();
        deployer
            .transport()
            .upload(DEPLOYER, naam_mica::HANDLERS_OBJECT)?;
        let uploaded = start.elapsed();
        let d = deployer.transport().deploy_uploaded(
            DEPLOYER,
            naam_runtime::proto::control::object_hash(naam_mica::HANDLERS_OBJECT),
            mica_handlers(),
            Some(EngineKind::Tiered),
            Some(next_budget(&budgets)),
        )?;
        let build_us = d.handlers.iter().map(|h| h.build_us).max().unwrap_or(0);
        let deployed = start.elapsed();
        deployer.get(b"user000000000001")?;
        let first = start.elapsed();
        firsts.push((first, deployed, uploaded, build_us));
    }
    let us = |d: Duration| d.as_nanos() as f64 / 1e3;
    let mut totals: Vec<f64> = firsts.iter().map(|f| us(f.0)).collect();
    totals.sort_by(f64::total_cmp);
    let median = totals[totals.len() / 2];
    eprintln!(
        "naam-bench: deploys: deploy to first answer median {median:.0} us, max {:.0} us over {} deploys",
        totals.last().copied().unwrap_or(0.0),
        totals.len()
    );

    // The quiet tenant's tail, undisturbed and while the deployer deploys in a loop.
    let mut phases = Vec::new();
    let mut undisturbed = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut disturbed = undisturbed.clone();
    let mut deploys_during = 0u64;
    for round in 0..c.rounds {
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for loud in order {
            let stop = Arc::new(AtomicBool::new(false));
            let looping = loud.then(|| {
                let (stop, budgets) = (stop.clone(), budgets.clone());
                let mut m = mica_client(d, "deployer", deployer_key, DEPLOYER);
                std::thread::spawn(move || -> anyhow::Result<u64> {
                    let m = m.as_mut().map_err(|e| anyhow::anyhow!("{e}"))?;
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        // As fast as the server's deploy rate allows: a refusal says when to
                        // try again.
                        match deploy_once(m, budgets.fetch_add(1, Ordering::Relaxed)) {
                            Ok(_) => n += 1,
                            Err(e) => match retry_after(&e.to_string()) {
                                Some(wait) => std::thread::sleep(wait),
                                None => return Err(e),
                            },
                        }
                    }
                    Ok(n)
                })
            });
            let h = quiet_phase(&mut quiet, c.records, c.seconds)?;
            stop.store(true, Ordering::Relaxed);
            let n = match looping {
                Some(t) => t
                    .join()
                    .map_err(|_| anyhow::anyhow!("the deploying thread panicked"))??,
                None => 0,
            };
            deploys_during += n;
            eprintln!(
                "naam-bench: deploys round {round} {}: p99 {:.1} us over {} GETs{}",
                if loud {
                    "while deploying"
                } else {
                    "undisturbed"
                },
                h.value_at_quantile(0.99) as f64 / 1e3,
                h.len(),
                if loud {
                    format!(", {n} deploys")
                } else {
                    String::new()
                }
            );
            if loud {
                disturbed.add(&h)?;
            } else {
                undisturbed.add(&h)?;
            }
            let mut q = quantiles(&h);
            q["round"] = json!(round);
            q["deploying"] = json!(loud);
            q["deploys"] = json!(n);
            phases.push(q);
        }
    }
    let ratio = disturbed.value_at_quantile(0.99) as f64
        / (undisturbed.value_at_quantile(0.99).max(1)) as f64;
    Ok(json!({
        "experiment": "deploys",
        "mode": udp::MODE,
        "command": crate::experiments::command_line(),
        "object_bytes": naam_mica::HANDLERS_OBJECT.len(),
        "deploys_per_second_allowed": c.rate,
        "deploy_to_first_answer": firsts.iter().map(|(f, dep, up, b)| json!({
            "first_answer_us": us(*f),
            "deployed_us": us(*dep),
            "uploaded_us": us(*up),
            "deploy_request_to_first_answer_us": us(f.saturating_sub(*up)),
            "slowest_build_us": b,
        })).collect::<Vec<_>>(),
        "deploy_to_first_answer_median_us": median,
        "quiet_undisturbed": quantiles(&undisturbed),
        "quiet_while_deploying": quantiles(&disturbed),
        "deploys_while_measuring": deploys_during,
        "p99_ratio": ratio,
        "phases": phases,
    }))
}
