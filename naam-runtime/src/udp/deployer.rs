//! naam-server's deployer: the thread that carries out tenants' deploys and undeploys
//! ([`naam_proto::endpoint::DeployJob`]), so that no receive loop verifies or builds code.
//!
//! A job the endpoint checked (the tenant has the app; the object came whole, with its hash)
//! is checked here against the tenant's quotas, built and published with
//! [`Cluster::deploy`], and the manifest is published to every receive loop (clients see its
//! version with their next weights); the object was written to the shared-memory directory
//! before (atomically, by rename: named by its app and content, it harms nothing if the
//! deploy fails). The answer, the verifier's report or the reason for a refusal, goes out
//! sealed on the tenant's session from this thread at once. Only then are the app's older
//! objects taken away, the new `manifest.json` written and the paired NIC told to read it
//! again ([`Control::ManifestChanged`]): that is for the NIC and the next start, and doing it
//! first kept a tenant waiting about 0.2 ms a deploy (bench/RESULTS.md, "Deploy to first
//! answer after idle"). The host keeps the app's requests until the NIC reports that
//! version.
//!
//! Each app's deployed handlers are also recorded beside the regions
//! (`deployed-app<id>.json`), which outlive the server: the next start serves them again
//! ([`restore_deploys`]), as it serves the regions' data again. The record is written right
//! after the answer: a server that dies in between (a fraction of a millisecond) starts
//! again without that deploy, and the tenant's next call finds the handlers it had before.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::{bounded, Receiver, Sender as JobSender, TrySendError};

use super::created::{clear_leftovers, created_path, created_records, CreatedRecord};
use super::socket::Sender;
use super::telemetry::{LoopCounters, Telemetry};
use crate::cluster::{Cluster, Deployed};
use crate::HandlerSpec;
use naam_proto::control::{
    object_hash, AppManifest, Control, DeployReport, HandlerManifest, Manifest, NewRegion,
};
use naam_proto::endpoint::{AppGrant, Channel, DeployChange, DeployJob, SessionDirectory};
use naam_proto::step::HandlerKind;
use naam_proto::EngineKind;
use serde::{Deserialize, Serialize};

/// Jobs waiting for the deployer; more are refused at once (`retry`).
const QUEUED_DEPLOYS: usize = 16;

/// What an app's last deploy left, as recorded beside the regions for the next start.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeployRecord {
    /// The deployed object's file, and its [`object_hash`] (none after an undeploy).
    object: Option<(String, u64)>,
    /// The handlers it made callable (none after an undeploy).
    handlers: Vec<HandlerManifest>,
}

/// The record of `app`'s deploys in `shm_dir`.
fn record_path(shm_dir: &Path, app: u32) -> PathBuf {
    shm_dir.join(format!("deployed-app{app}.json"))
}

/// Serves again, on a server start, the handlers that tenants deployed into its apps before
/// (the records in `shm_dir`), updating `manifest` to match and writing it there. A record of
/// an app the config no longer has, of an object that is gone or changed, or of handlers the
/// verifier now rejects is removed, and that app keeps the config's handlers. Returns what
/// was done, one line each, for the log.
pub fn restore_deploys(
    cluster: &Cluster,
    manifest: &mut Manifest,
    shm_dir: &Path,
) -> Result<Vec<String>, super::DeployError> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(shm_dir) else {
        return Ok(done);
    };
    let mut records: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = name.strip_prefix("deployed-app")?.strip_suffix(".json")?;
            Some((id.parse().ok()?, e.path()))
        })
        .collect();
    records.sort();
    for (app, path) in records {
        match restore_one(cluster, manifest, app, &path) {
            Ok(line) => done.push(line),
            Err(why) => {
                let _ = std::fs::remove_file(&path);
                done.push(format!(
                    "app {app}: its deploy is not served again, the config's handlers are: {why}"
                ));
            }
        }
    }
    if !done.is_empty() {
        let mpath = shm_dir.join(super::MANIFEST_FILE);
        let bytes =
            serde_json::to_vec_pretty(manifest).map_err(|e| super::DeployError::Manifest {
                path: mpath.clone(),
                message: e.to_string(),
            })?;
        write_atomically(&mpath, &bytes).map_err(|message| super::DeployError::Manifest {
            path: mpath,
            message,
        })?;
    }
    Ok(done)
}

/// Forgets the deploys recorded in `shm_dir`, and their objects (a start with new regions:
/// what was deployed into the old ones goes with them).
pub fn forget_deploys(shm_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(shm_dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let record = name.starts_with("deployed-app") && name.ends_with(".json");
        let object = name.starts_with("object-app") && name.ends_with(".o");
        if record || object {
            let _ = std::fs::remove_file(e.path());
        }
    }
    super::created::forget_created(shm_dir);
}

/// [`restore_deploys`] of one record.
fn restore_one(
    cluster: &Cluster,
    manifest: &mut Manifest,
    app: u32,
    path: &Path,
) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let record: DeployRecord =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let a = manifest
        .apps
        .iter_mut()
        .find(|a| a.id == app)
        .ok_or("the config has no such app any more")?;
    let deployed = match &record.object {
        None => cluster.undeploy(app).map_err(|e| e.to_string())?,
        Some((object, hash)) => {
            let bytes = std::fs::read(object).map_err(|e| format!("{object}: {e}"))?;
            if object_hash(&bytes) != *hash {
                return Err(format!("{object} changed since it was deployed"));
            }
            let loaded = naam_vm::load(&bytes).map_err(|e| format!("{object}: {e}"))?;
            let specs: Vec<HandlerSpec> =
                record.handlers.iter().map(super::deploy::spec_of).collect();
            let d = cluster
                .deploy(app, &loaded, &specs)
                .map_err(|e| e.to_string())?;
            a.object = object.clone();
            a.object_hash = *hash;
            d
        }
    };
    a.handlers = record.handlers;
    manifest.version = deployed.version;
    Ok(format!(
        "app {app}: {} deployed handler(s) served again",
        deployed.handlers.len()
    ))
}

/// Answers kept per tenant for retransmitted deploys.
const ANSWERS_KEPT: usize = 8;

/// A deploy's (session, request id) and its encoded answer.
type Answered = ((u64, u64), Bytes);

/// What a tenant may deploy, and how, on one server (naam-server's `[deploy]` config).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct DeployPolicy {
    /// Where the host's regions, objects and manifest are (the NIC reads them there).
    pub shm_dir: PathBuf,
    /// The most handlers one tenant may have, over all its apps.
    pub max_handlers: usize,
    /// The most bytes of handler bytecode one tenant may have, over all its apps.
    pub max_code_bytes: usize,
    /// The largest instruction budget per step a deploy may ask for.
    pub max_budget: u64,
    /// The engine of a deploy that names none (tiered: the interpreter answers at once).
    pub engine: EngineKind,
    /// The budget of a handler whose deploy names none and that the app did not have.
    pub budget: u64,
    /// Deploys and undeploys one tenant may make a second (as many in a burst).
    pub deploys_per_second: f64,
    /// Apps one tenant may create while the server runs ([`Control::CreateApp`]); 0: none.
    pub max_apps: usize,
    /// Bytes of regions one tenant's created apps may have together.
    pub max_region_bytes: u64,
}

impl DeployPolicy {
    /// Deploys into `shm_dir`'s manifest with the default quotas: 64 handlers and 1 MiB of
    /// code per tenant, budgets up to 1,000,000 instructions (100,000 by default), on the
    /// tiered engine, at most [`naam_proto::limits::DEPLOYS_PER_SECOND`] a second; no app
    /// created by a tenant (64 MiB of regions once `max_apps` allows some).
    pub fn new(shm_dir: PathBuf) -> DeployPolicy {
        DeployPolicy {
            shm_dir,
            max_handlers: 64,
            max_code_bytes: 1 << 20,
            max_budget: 1_000_000,
            engine: EngineKind::Tiered,
            budget: 100_000,
            deploys_per_second: naam_proto::limits::DEPLOYS_PER_SECOND,
            max_apps: 0,
            max_region_bytes: 64 << 20,
        }
    }
}

/// A job with where its answer goes.
struct Queued {
    job: DeployJob,
    channel: Channel,
    sender: Arc<Sender>,
}

/// The receive loops' side of the deployer: they queue jobs here.
#[derive(Clone)]
pub(crate) struct DeployQueue(JobSender<Queued>);

impl DeployQueue {
    /// Queues `job`, to be answered on `channel` from `sender`'s socket; `Some`: the refusal
    /// to answer now (the deployer is busy or gone).
    pub(crate) fn submit(
        &self,
        job: DeployJob,
        channel: &Channel,
        sender: &Arc<Sender>,
    ) -> Option<Control> {
        let q = Queued {
            job,
            channel: channel.clone(),
            sender: sender.clone(),
        };
        match self.0.try_send(q) {
            Ok(()) => None,
            Err(TrySendError::Full(_)) => Some(Control::Error {
                message: format!("{QUEUED_DEPLOYS} deploys are waiting: retry in a moment"),
            }),
            Err(TrySendError::Disconnected(_)) => Some(Control::Error {
                message: "this server is stopping: it takes no deploys".into(),
            }),
        }
    }
}

/// Starts the deployer thread over `cluster`, writing to `policy.shm_dir`'s manifest,
/// publishing to `directory`'s loops and counting into `counters`. It ends when every
/// [`DeployQueue`] is dropped (the loops stopped).
pub(crate) fn spawn(
    cluster: Arc<Cluster>,
    policy: DeployPolicy,
    directory: Arc<SessionDirectory>,
    telemetry: Arc<Telemetry>,
    counters: LoopCounters,
) -> std::io::Result<(DeployQueue, JoinHandle<()>)> {
    let manifest = super::read_manifest(&policy.shm_dir)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let (tx, rx) = bounded(QUEUED_DEPLOYS);
    let mut d = Deployer {
        cluster,
        policy,
        directory,
        manifest,
        answered: HashMap::new(),
        created: Vec::new(),
        counts: DeployCounts::default(),
    };
    d.created = created_records(&d.policy.shm_dir)
        .into_iter()
        .filter_map(|(_, r)| r.ok())
        .collect();
    let handle = std::thread::Builder::new()
        .name("naam-deployer".into())
        .spawn(move || d.run(rx, &telemetry, &counters))?;
    Ok((DeployQueue(tx), handle))
}

/// Counted for `--metrics`.
#[derive(Default)]
struct DeployCounts {
    deploys: u64,
    undeploys: u64,
    refused: u64,
    build_us: u64,
    created: u64,
}

struct Deployer {
    cluster: Arc<Cluster>,
    policy: DeployPolicy,
    directory: Arc<SessionDirectory>,
    /// The manifest as last written.
    manifest: Manifest,
    /// Per tenant, its last [`ANSWERS_KEPT`] answers by (session, request id): a
    /// retransmission gets its answer again rather than a second deploy, whichever of the
    /// tenant's sessions deployed since.
    answered: HashMap<String, std::collections::VecDeque<Answered>>,
    /// Apps tenants created, as recorded in the shared-memory directory (restored ones
    /// included, and any a start could not restore: their ids are not given again).
    created: Vec<CreatedRecord>,
    counts: DeployCounts,
}

impl Deployer {
    fn run(&mut self, rx: Receiver<Queued>, telemetry: &Telemetry, counters: &LoopCounters) {
        // At the ordinary priority: a deploy is verified in about 0.1 ms a handler (the
        // analysis and the JIT run later, at the lowest), each tenant's deploys are rate
        // limited, and at the lowest priority the receive loops' and clients' polling kept
        // this thread from running for milliseconds (bench/RESULTS.md, "Deploys at run time").
        counters.publish(telemetry, self.counters());
        for q in rx.iter() {
            let key = (q.job.session, q.job.id);
            let again = self
                .answered
                .get(&q.job.tenant)
                .and_then(|kept| kept.iter().find(|(k, _)| *k == key))
                .map(|(_, a)| a.clone());
            let mut done = None;
            let bytes = match again {
                Some(a) => a,
                None => {
                    let answer = match self.carry_out(&q.job) {
                        Ok((a, d)) => {
                            done = Some(d);
                            a
                        }
                        Err(message) => {
                            self.counts.refused += 1;
                            tracing::info!(
                                tenant = %q.job.tenant,
                                app = q.job.app,
                                "deploy refused: {message}"
                            );
                            Control::Error { message }
                        }
                    };
                    let b = answer.to_bytes(q.job.id);
                    let kept = self.answered.entry(q.job.tenant.clone()).or_default();
                    if kept.len() == ANSWERS_KEPT {
                        kept.pop_front();
                    }
                    kept.push_back((key, b.clone()));
                    b
                }
            };
            let _ = q.sender.send_transmit(q.channel.transmit(q.job.id, &bytes));
            if let Some(d) = done {
                self.write_out(&d, &q.sender);
            }
            counters.publish(telemetry, self.counters());
        }
    }

    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        let c = &self.counts;
        vec![
            (
                "deploys",
                "Deploys carried out (handlers installed).",
                c.deploys,
            ),
            ("undeploys", "Undeploys carried out.", c.undeploys),
            (
                "apps_created",
                "Apps tenants created at run time.",
                c.created,
            ),
            (
                "deploys_refused",
                "Deploys and undeploys refused (quota, verifier, files).",
                c.refused,
            ),
            (
                "deploy_build_microseconds",
                "Per deploy, its slowest handler's verification and build until it could answer, summed.",
                c.build_us,
            ),
        ]
    }

    /// Carries out `job`: its handlers serve once this returns, and the manifest the
    /// clients learn names them. The answer and what [`Deployer::write_out`] is left to
    /// write, or why not.
    fn carry_out(&mut self, job: &DeployJob) -> Result<(Control, Done), String> {
        let deployed = match &job.change {
            DeployChange::Install {
                object,
                handlers,
                engine,
                budget,
            } => {
                let specs = self.specs(job, handlers, *engine, *budget)?;
                let loaded = naam_vm::load(object).map_err(|e| format!("the object: {e}"))?;
                self.check_quota(job, &loaded, &specs)?;
                self.check_pages(job, &specs)?;
                let previous = self.app_manifest(job.app)?.object.clone();
                // Written first (named by its app and content, it harms nothing if the deploy
                // fails): once the handlers serve, the manifest can name it.
                let path = self.object_path(job.app, object);
                write_atomically(&path, object)?;
                let deployed = self
                    .cluster
                    .deploy(job.app, &loaded, &specs)
                    .map_err(|e| e.to_string())?;
                let a = self.app_manifest(job.app)?;
                a.object = path.to_string_lossy().into_owned();
                a.object_hash = object_hash(object);
                self.counts.deploys += 1;
                (deployed, Some(ObjectFile { path, previous }))
            }
            DeployChange::Remove => {
                self.app_manifest(job.app)?;
                let d = self.cluster.undeploy(job.app).map_err(|e| e.to_string())?;
                self.counts.undeploys += 1;
                (d, None)
            }
            DeployChange::Create { name, regions } => return self.create(job, name, regions),
            other => return Err(format!("this server does not know the change {other:?}")),
        };
        let (deployed, object) = deployed;
        self.publish(&deployed);
        let build = deployed
            .handlers
            .iter()
            .map(|h| h.build)
            .max()
            .unwrap_or(Duration::ZERO);
        self.counts.build_us += build.as_micros() as u64;
        tracing::info!(
            tenant = %job.tenant,
            app = job.app,
            version = deployed.version,
            handlers = deployed.handlers.len(),
            "{}",
            if deployed.handlers.is_empty() {
                "undeployed"
            } else {
                "deployed"
            }
        );
        let answer = Control::Deployed {
            app: deployed.app,
            version: deployed.version,
            handlers: deployed
                .handlers
                .iter()
                .map(|h| DeployReport {
                    name: h.name.clone(),
                    id: h.id,
                    write: h.kind == HandlerKind::Write,
                    engine: h.engine,
                    budget: h.budget,
                    insns: h.insns,
                    functions: h.functions,
                    helpers: h.helpers,
                    backward_jumps: h.backward_jumps,
                    accesses: h.accesses,
                    build_us: h.build.as_micros() as u64,
                })
                .collect(),
        };
        Ok((
            answer,
            Done {
                deployed,
                created: false,
                object,
            },
        ))
    }

    /// The specs `handlers` ask for, within the policy's budget limit.
    fn specs(
        &self,
        job: &DeployJob,
        handlers: &[naam_proto::control::DeployHandler],
        engine: Option<EngineKind>,
        budget: Option<u64>,
    ) -> Result<Vec<HandlerSpec>, String> {
        if handlers.is_empty() {
            return Err(
                "a deploy names at least one handler (undeploy takes them all away)".into(),
            );
        }
        if let Some(b) = budget.filter(|b| *b == 0 || *b > self.policy.max_budget) {
            return Err(format!(
                "a budget of {b} instructions per step: this server allows 1 to {}",
                self.policy.max_budget
            ));
        }
        let before = self.manifest.app(job.app);
        Ok(handlers
            .iter()
            .map(|h| {
                let s = super::deploy::spec_named(&h.name, h.write);
                // A handler the app had keeps its budget unless the deploy names one.
                let had = before
                    .and_then(|a| a.handlers.iter().find(|x| x.name == h.name))
                    .map(|x| x.budget.min(self.policy.max_budget));
                // A deploy asking for the JIT gets the tiered engine, which ends on the same
                // code: a compile is background work, never the deployer thread's.
                let engine = match engine.unwrap_or(self.policy.engine) {
                    EngineKind::Jit => EngineKind::Tiered,
                    e => e,
                };
                s.engine(engine)
                    .budget(budget.or(had).unwrap_or(self.policy.budget))
            })
            .collect())
    }

    /// Refuses a deploy that would take the tenant past its handlers or code quota.
    fn check_quota(
        &self,
        job: &DeployJob,
        object: &naam_vm::LoadedObject,
        specs: &[HandlerSpec],
    ) -> Result<(), String> {
        let registry = self.cluster.registry();
        let (mut handlers, mut code) = (specs.len(), 0usize);
        for s in specs {
            code += object.get(&s.name).map_err(|e| e.to_string())?.code.len();
        }
        for app in job.tenant_apps.iter().filter(|a| **a != job.app) {
            if let Some(a) = registry.app(*app) {
                handlers += a.handlers.len();
                code += a.handlers.values().map(|h| h.code_bytes()).sum::<usize>();
            }
        }
        if handlers > self.policy.max_handlers {
            return Err(format!(
                "over quota: tenant {} would have {handlers} handlers, this server allows {}",
                job.tenant, self.policy.max_handlers
            ));
        }
        if code > self.policy.max_code_bytes {
            return Err(format!(
                "over quota: tenant {} would have {code} bytes of handler code, this server \
                 allows {}",
                job.tenant, self.policy.max_code_bytes
            ));
        }
        Ok(())
    }

    fn app_manifest(&mut self, app: u32) -> Result<&mut naam_proto::control::AppManifest, String> {
        self.manifest
            .apps
            .iter_mut()
            .find(|a| a.id == app)
            .ok_or_else(|| format!("no app {app} in this server's manifest"))
    }

    /// Where `object` deployed into `app` is written beside the manifest: named by its app
    /// and its SHA-256, so that no other tenant's deploy can write over it, whatever its
    /// 64-bit `object_hash`.
    fn object_path(&self, app: u32, object: &[u8]) -> PathBuf {
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(object);
        let name = format!("{}{}.o", object_prefix(app), hex::encode(&digest[..16]));
        self.policy.shm_dir.join(name)
    }

    /// Takes away the objects deployed into `app` before `o`, but the one its manifest named
    /// until `o`'s deploy (the NIC may be taking that one up).
    fn remove_older_objects(&self, app: u32, o: &ObjectFile) {
        let prefix = object_prefix(app);
        if let Ok(entries) = std::fs::read_dir(&self.policy.shm_dir) {
            for e in entries.flatten() {
                let file = e.file_name().to_string_lossy().into_owned();
                let p = e.path();
                if file.starts_with(&prefix)
                    && file.ends_with(".o")
                    && p != o.path
                    && p.to_string_lossy() != o.previous
                {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
    }

    /// Refuses a deploy whose manifest the tenant's sessions could not be given in pages.
    fn check_pages(&self, job: &DeployJob, specs: &[HandlerSpec]) -> Result<(), String> {
        let mut next = self.manifest.clone();
        let a = next
            .apps
            .iter_mut()
            .find(|a| a.id == job.app)
            .ok_or_else(|| format!("no app {} in this server's manifest", job.app))?;
        a.handlers = specs
            .iter()
            .map(|s| HandlerManifest {
                name: s.name.clone(),
                id: naam_proto::handler_id(&s.name),
                write: s.kind == HandlerKind::Write,
                engine: s.engine,
                budget: s.budget,
            })
            .collect();
        next.scoped(&job.tenant_apps)
            .pages()
            .map(|_| ())
            .map_err(|e| format!("the app's manifest would not fit: {e}"))
    }

    /// Records `deployed` (which serves at the host already) in the manifest and publishes
    /// it to the loops: their clients learn the new handlers.
    fn publish(&mut self, deployed: &Deployed) {
        let version = deployed.version;
        if let Some(a) = self.manifest.apps.iter_mut().find(|a| a.id == deployed.app) {
            a.handlers = deployed
                .handlers
                .iter()
                .map(|h| HandlerManifest {
                    name: h.name.clone(),
                    id: h.id,
                    write: h.kind == HandlerKind::Write,
                    engine: h.engine,
                    budget: h.budget,
                })
                .collect();
        }
        self.manifest.version = version;
        self.directory.publish_manifest(self.manifest.clone());
    }

    /// After the answer: takes away the app's older objects, writes the deploy's record for
    /// the next start and the manifest, and tells the NIC (from `sender`'s socket). A
    /// manifest that cannot be written is logged: the clients have learnt the new handlers
    /// already, and the NIC, which reads the file, stays on the old ones, so the host keeps
    /// the app's requests.
    fn write_out(&mut self, done: &Done, sender: &Sender) {
        let (deployed, version) = (&done.deployed, done.deployed.version);
        if let Some(o) = &done.object {
            self.remove_older_objects(deployed.app, o);
        }
        if !done.created {
            self.record(deployed);
        }
        let written = serde_json::to_vec_pretty(&self.manifest)
            .map_err(|e| e.to_string())
            .and_then(|b| write_atomically(&self.policy.shm_dir.join(super::MANIFEST_FILE), &b));
        if let Err(e) = written {
            tracing::error!(
                version,
                app = deployed.app,
                "the manifest could not be written, so naam-nic keeps the old handlers and the \
                 host serves this app alone: {e}"
            );
            return;
        }
        if let Some(t) = self
            .directory
            .to_nic(0, &Control::ManifestChanged { version }.to_bytes(0))
        {
            // Lost, it is sent again by the loop that takes the NIC's next load reports
            // while they show an older version; the host forwards the NIC nothing of this
            // app until they show this one.
            let _ = sender.send_transmit(t);
        }
    }
}

impl Deployer {
    /// Creates app `name` with `regions` for `job`'s tenant, within its quotas: its
    /// regions made (zeroed files beside the others, which the NIC maps), the app in the
    /// cluster with no handlers, its record written, the manifest published and the app
    /// given to the tenant's credential in every loop. The tenant's app of that name with
    /// the same regions is answered as created again; any other app of that name refuses.
    fn create(
        &mut self,
        job: &DeployJob,
        name: &str,
        regions: &[NewRegion],
    ) -> Result<(Control, Done), String> {
        let version = self.manifest.version;
        if let Some(c) = self.created.iter().find(|c| c.name == name) {
            let mine = job.tenant_apps.contains(&c.app) || c.owner == job.tenant;
            return match (mine, c.regions == regions) {
                (true, true) => {
                    // Asked again (a tool run once more): the app and its data are kept.
                    let d = Deployed {
                        app: c.app,
                        version,
                        handlers: Vec::new(),
                    };
                    let answer = Control::AppCreated {
                        app: c.app,
                        name: name.to_string(),
                        version,
                    };
                    Ok((
                        answer,
                        Done {
                            deployed: d,
                            created: true,
                            object: None,
                        },
                    ))
                }
                (true, false) => Err(format!(
                    "app {name} exists with other regions ({}): its regions and data are kept",
                    describe_regions(&c.regions)
                )),
                (false, _) => Err(format!("the app name {name} is taken")),
            };
        }
        if self.manifest.apps.iter().any(|a| a.name == name) {
            return Err(format!("the app name {name} is taken"));
        }
        let owned: Vec<&CreatedRecord> = self
            .created
            .iter()
            .filter(|c| job.tenant_apps.contains(&c.app))
            .collect();
        if self.policy.max_apps == 0 {
            return Err(format!(
                "this server lets tenant {} create no apps (its [deploy] max_apps is 0)",
                job.tenant
            ));
        }
        if owned.len() >= self.policy.max_apps {
            return Err(format!(
                "over quota: tenant {} has created {} apps, this server allows {}",
                job.tenant,
                owned.len(),
                self.policy.max_apps
            ));
        }
        let bytes = owned
            .iter()
            .map(|c| c.region_bytes())
            .sum::<u64>()
            .saturating_add(
                regions
                    .iter()
                    .map(|r| r.len)
                    .fold(0u64, u64::saturating_add),
            );
        if bytes > self.policy.max_region_bytes {
            return Err(format!(
                "over quota: tenant {}'s created apps would have {bytes} bytes of regions, this \
                 server allows {}",
                job.tenant, self.policy.max_region_bytes
            ));
        }
        let app = self
            .manifest
            .apps
            .iter()
            .map(|a| a.id)
            .chain(self.created.iter().map(|c| c.app))
            .max()
            .unwrap_or(0)
            .checked_add(1)
            .ok_or("no app id is left on this server")?;
        let record = CreatedRecord {
            app,
            name: name.to_string(),
            owner: job.tenant.clone(),
            regions: regions.to_vec(),
            rkeys: Vec::new(),
        };
        let mut tenant_apps = job.tenant_apps.clone();
        tenant_apps.push(app);
        // The pages are checked before anything is made, with rkeys as long as any.
        let mut next = self.manifest.clone();
        let mut entry: AppManifest = record.manifest_entry(&self.cluster, &self.policy.shm_dir);
        for r in &mut entry.regions {
            r.rkey = u64::MAX;
        }
        next.apps.push(entry);
        next.scoped(&tenant_apps)
            .pages()
            .map_err(|e| format!("the tenant's manifest would not fit: {e}"))?;
        clear_leftovers(&self.policy.shm_dir, app);
        let deployed = self
            .cluster
            .create_app(&record.spec())
            .map_err(|e| e.to_string())?;
        let mut record = record;
        record.rkeys = regions
            .iter()
            .map(|r| {
                let k = self.cluster.region_key(app, &r.name).unwrap_or(0);
                (r.name.clone(), k)
            })
            .collect();
        // Recorded before the answer: an app a tenant was told exists outlives any restart.
        let rpath = created_path(&self.policy.shm_dir, app);
        let written = serde_json::to_vec_pretty(&record)
            .map_err(|e| e.to_string())
            .and_then(|b| write_atomically(&rpath, &b));
        if let Err(e) = written {
            tracing::error!(
                app,
                "app {name} is created but not recorded, so the next start will not have it: {e}"
            );
        }
        self.manifest
            .apps
            .push(record.manifest_entry(&self.cluster, &self.policy.shm_dir));
        self.manifest.version = deployed.version;
        self.directory.publish_manifest(self.manifest.clone());
        self.directory.grant(AppGrant {
            owner: job.tenant.clone(),
            app,
            name: name.to_string(),
        });
        self.created.push(record);
        self.counts.created += 1;
        tracing::info!(
            tenant = %job.tenant,
            app,
            version = deployed.version,
            "created app {name} ({})",
            describe_regions(regions)
        );
        let answer = Control::AppCreated {
            app,
            name: name.to_string(),
            version: deployed.version,
        };
        Ok((
            answer,
            Done {
                deployed,
                created: true,
                object: None,
            },
        ))
    }

    /// Records what `deployed` made of its app for the next start ([`restore_deploys`]); a
    /// record that cannot be written is logged (this start serves the deploy all the same).
    fn record(&self, deployed: &Deployed) {
        let Some(a) = self.manifest.app(deployed.app) else {
            return;
        };
        let record = DeployRecord {
            object: (!deployed.handlers.is_empty()).then(|| (a.object.clone(), a.object_hash)),
            handlers: a.handlers.clone(),
        };
        let path = record_path(&self.policy.shm_dir, deployed.app);
        let written = serde_json::to_vec_pretty(&record)
            .map_err(|e| e.to_string())
            .and_then(|b| write_atomically(&path, &b));
        if let Err(e) = written {
            tracing::error!(
                app = deployed.app,
                "the deploy serves now, but the next start will not serve it again: {e}"
            );
        }
    }
}

/// What a deploy leaves to do once it is answered ([`Deployer::write_out`]).
struct Done {
    deployed: Deployed,
    /// An app created (its record was written before the answer).
    created: bool,
    /// The object it wrote (none after an undeploy).
    object: Option<ObjectFile>,
}

/// A deployed object's file.
struct ObjectFile {
    path: PathBuf,
    /// The file the app's manifest named before the deploy, kept while the NIC may read it.
    previous: String,
}

/// `regions` as a person reads them: `name:len:access`, comma-separated.
fn describe_regions(regions: &[NewRegion]) -> String {
    regions
        .iter()
        .map(|r| format!("{}:{}:{}", r.name, r.len, naam_ebpf::abi::Rights(r.access)))
        .collect::<Vec<_>>()
        .join(",")
}

/// The start of the names of the objects deployed into `app`.
fn object_prefix(app: u32) -> String {
    format!("object-app{app}-")
}

/// Writes `bytes` to `path` through a temporary file renamed over it, so that a reader
/// (the NIC) sees the old file or the new one whole.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("writing {}: {e}", path.display()))
}
