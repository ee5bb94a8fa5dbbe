//! # naam-server
//!
//! The host side of a multi-process deployment: reads a config file of apps (MICA tables,
//! B-trees, or plain eBPF objects with their regions), builds their handlers, creates their
//! regions in shared memory for `naam-nic`, and serves them over the UDP fabric
//! ([`naam_runtime::udp`]).
#![deny(missing_docs)]

use naam_runtime::CredentialFile as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use naam_ebpf::abi::{ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_runtime::cluster::{AppSpec, PolicyChoice, RegionSpec};
use naam_runtime::proto::steering::CostPolicyConfig;
use naam_runtime::proto::EngineKind;
use naam_runtime::proto::Placement;
use naam_runtime::udp::HostApp;
use naam_runtime::vm::{DEFAULT_BUDGET, MAX_BUDGET};
use naam_runtime::HandlerSpec;
use serde::Deserialize;

pub mod eswitch;

/// The config file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address to listen on (`10.77.0.1:7000`, or a host name and port, resolved at start).
    #[serde(deserialize_with = "naam_runtime::addr::deserialize")]
    pub listen: SocketAddr,
    /// Directory for shared-memory regions and the manifest (default `/dev/shm/naam`;
    /// relative to the config file).
    #[serde(default = "default_shm")]
    pub shm_dir: PathBuf,
    /// Host executor threads (they run what the receive loops queue: writes at their owner's
    /// turn, and overload).
    #[serde(default = "one")]
    pub host_executors: usize,
    /// Receive loops: sockets on the listen address in one `SO_REUSEPORT` group, each with a
    /// run-to-completion loop of its own and its shard of the sessions, routed to it by the
    /// kernel (at most [`naam_runtime::proto::limits::MAX_LOOPS`]); unset, one per core the
    /// process may run on ([`Config::loops`]).
    #[serde(default)]
    pub receive_loops: Option<usize>,
    /// Steering: `auto`, or `host` / `nic` / `client` for a static baseline.
    #[serde(default = "auto")]
    pub policy: String,
    /// Datagram size (1472 for a 1500-byte MTU, up to 8972 with jumbo frames); unset, the
    /// listen address's path decides ([`naam_runtime::udp::datagram_for`]: 8972 on loopback,
    /// 1472 elsewhere).
    #[serde(default)]
    pub datagram: Option<usize>,
    /// Executor queue capacity (back-pressure beyond it).
    #[serde(default = "queue")]
    pub queue_capacity: usize,
    /// How long an idle host executor polls before it parks, microseconds (see
    /// `ClusterConfig::executor_poll`; bench/RESULTS.md has the measurement behind 200).
    #[serde(default = "executor_poll_us")]
    pub executor_poll_us: u64,
    /// Interface to attach the XDP eSwitch to (the server's veth); absent: the user-space
    /// switch in naam-server steers.
    #[serde(default)]
    pub xdp_interface: Option<String>,
    /// naam-nic's UDP port on the listen address (where the eSwitch steers NIC messages).
    #[serde(default)]
    pub nic_port: Option<u16>,
    /// Whether operators may slow the host executors down with a `congest` control message
    /// (`naam-bench experiment ... --fabric udp`); off by default, since anyone who reaches
    /// the port could.
    #[serde(default)]
    pub allow_congestion_control: bool,
    /// File holding the pairing secret naam-nic proves (`naam-nic run --pairing FILE`);
    /// absent: no NIC may pair. Relative to the config file.
    #[serde(default)]
    pub nic_pairing: Option<PathBuf>,
    /// File holding the operator's credential (congestion experiments, switch counters);
    /// absent: no operator session. Relative to the config file.
    #[serde(default)]
    pub operator_credential: Option<PathBuf>,
    /// Directory where compiled handlers are kept across restarts (created mode 0700; it must
    /// be this user's and writable by nobody else; entries are sealed and checked before
    /// they run): a restart then maps its handlers' code instead of compiling it. Absent:
    /// compiled code is shared in memory only. Relative to the config file.
    #[serde(default)]
    pub code_cache: Option<PathBuf>,
    /// Tenants' deploys at run time (`naam deploy`), within these quotas; absent: refused,
    /// and the handlers are this config's.
    #[serde(default)]
    pub deploy: Option<DeployConfig>,
    /// Where Redis clients connect (RESP2/RESP3: redis-cli, redis-benchmark, redis-py); each
    /// connection authenticates as a tenant with `AUTH <tenant> <credential hex>` and its
    /// commands run as active messages on the tenant's MICA table (README "Redis clients").
    /// Absent: no RESP front.
    #[serde(default, deserialize_with = "optional_addr")]
    pub resp_listen: Option<SocketAddr>,
    /// The cluster file when this server is one node of a Redis Cluster of naam-servers
    /// (the nodes' addresses and hash slots; the same file on every node). Relative to the
    /// config file; needs `resp_listen`, which must be one of the file's nodes.
    #[serde(default)]
    pub resp_cluster: Option<PathBuf>,
    /// How the RESP front's commands reach the server: `udp` (default), as a client's
    /// datagrams to the listen address, so the switch places each at the host, on the NIC or
    /// at the client; or `inline`, handed to a server endpoint in this process and run in
    /// the front's thread (no datagram, no seal; no NIC placement, since naam-nic pairs with
    /// the UDP endpoints).
    #[serde(default)]
    pub resp_path: RespPath,
    /// The `[[app]]` entries: at least one, and no app id twice (instance ranges included).
    #[serde(rename = "app", default)]
    pub apps: Vec<AppConfig>,
}

/// `resp_path`: see [`Config::resp_path`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RespPath {
    /// Datagrams to the listen address, steered like any client's.
    #[default]
    Udp,
    /// Handed in to an endpoint in this process and run in the front's thread.
    Inline,
}

fn optional_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    naam_runtime::addr::deserialize(d).map(Some)
}

/// The `[deploy]` section: what one tenant may deploy into its apps while the server runs.
/// Deployed handlers outlive a restart as the regions do (`--reset-regions` forgets them).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeployConfig {
    /// The most handlers a tenant may have over all its apps (default 64).
    #[serde(default = "deploy_handlers")]
    pub max_handlers: usize,
    /// The most bytes of handler bytecode a tenant may have over all its apps (default 1 MiB).
    #[serde(default = "deploy_code")]
    pub max_code_bytes: usize,
    /// The largest instruction budget per step a deploy may ask for (default and at most
    /// the engine's maximum).
    #[serde(default = "deploy_budget")]
    pub max_budget: u64,
    /// The engine of a deploy that names none (default `tiered`: the interpreter answers
    /// as soon as the handler is verified, the JIT takes over when it is compiled).
    #[serde(default = "deploy_engine")]
    pub engine: EngineKind,
    /// Deploys and undeploys one tenant may make a second, as many in a burst (default 10):
    /// building code is the server's work, taken from nobody's requests.
    #[serde(default = "deploy_rate")]
    pub max_deploys_per_second: f64,
    /// Apps one tenant may create while the server runs (`naam deploy --region`; default
    /// 0: none).
    #[serde(default)]
    pub max_apps: usize,
    /// Bytes of regions one tenant's created apps may have together (default 64 MiB).
    #[serde(default = "deploy_region_bytes")]
    pub max_region_bytes: u64,
    /// Apps all tenants together may create in one server start (default 64): the server
    /// sizes its app and region tables for them when it starts.
    #[serde(default = "deploy_created_apps")]
    pub max_created_apps: usize,
}

/// The most `[deploy] max_region_bytes` may be: a created region is made zeroed in memory
/// before its file is written.
pub const MAX_CREATED_REGION_BYTES: u64 = 4 << 30;
/// The most `[deploy] max_created_apps` may be.
pub const MAX_CREATED_APPS: usize = 65_536;

impl DeployConfig {
    /// The deploy policy of a server whose shared-memory directory is `shm_dir`.
    pub fn policy(&self, shm_dir: &Path) -> naam_runtime::udp::DeployPolicy {
        let mut p = naam_runtime::udp::DeployPolicy::new(shm_dir.to_path_buf());
        p.max_handlers = self.max_handlers;
        p.max_code_bytes = self.max_code_bytes;
        p.max_budget = self.max_budget;
        p.engine = self.engine;
        p.budget = DEFAULT_BUDGET.min(self.max_budget);
        p.deploys_per_second = self.max_deploys_per_second;
        p.max_apps = self.max_apps;
        p.max_region_bytes = self.max_region_bytes;
        p
    }
}

fn deploy_handlers() -> usize {
    64
}
fn deploy_code() -> usize {
    1 << 20
}
fn deploy_region_bytes() -> u64 {
    64 << 20
}
fn deploy_created_apps() -> usize {
    64
}
fn deploy_budget() -> u64 {
    MAX_BUDGET
}
fn deploy_engine() -> EngineKind {
    EngineKind::Tiered
}
fn deploy_rate() -> f64 {
    naam_runtime::proto::limits::DEPLOYS_PER_SECOND
}

fn default_shm() -> PathBuf {
    PathBuf::from("/dev/shm/naam")
}
fn one() -> usize {
    1
}
fn auto() -> String {
    "auto".into()
}
fn queue() -> usize {
    4096
}
fn executor_poll_us() -> u64 {
    naam_runtime::udp::SERVER_EXECUTOR_POLL.as_micros() as u64
}

/// Checks one app's regions that an earlier start left, before naam-server serves them again
/// ([`naam_runtime::udp::start_host_persistent`]): MICA's and the B-tree's own consistency
/// checks ([`naam_mica::check_regions`], [`naam_btree::check_regions`]); an `object` app's
/// regions have no structure naam-server knows, and pass.
pub fn check_regions(
    app: u32,
    kind: &str,
    params: &serde_json::Value,
    regions: &[Arc<naam_runtime::Region>],
) -> Result<(), String> {
    let parse_err = |e: serde_json::Error| format!("app {app}'s parameters: {e}");
    let want = |n: usize| {
        if regions.len() == n {
            Ok(())
        } else {
            Err(format!("{} regions, {kind} has {n}", regions.len()))
        }
    };
    match kind {
        "mica" => {
            let c: naam_mica::MicaConfig =
                serde_json::from_value(params.clone()).map_err(parse_err)?;
            want(3)?;
            let t =
                naam_mica::check_regions(&c, &regions[0].mem, &regions[1].mem, &regions[2].mem)?;
            tracing::info!(
                "app {app} (mica): {} items written, {} slots name items in the log",
                t.tail,
                t.live
            );
            Ok(())
        }
        "btree" => {
            let c: naam_btree::BTreeConfig =
                serde_json::from_value(params.clone()).map_err(parse_err)?;
            want(2)?;
            let n = naam_btree::check_regions(&c, &regions[0].mem, &regions[1].mem)?;
            tracing::info!("app {app} (btree): {n} nodes in use");
            Ok(())
        }
        _ => Ok(()),
    }
}

/// One `[[app]]` entry; `kind` picks the variant, and `instances` may make it several apps.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum AppConfig {
    /// A MICA table.
    Mica {
        /// App id.
        id: u32,
        /// Live items it is sized for.
        items: u64,
        /// Largest key, bytes (default 24: YCSB's `user` and up to 20 digits).
        #[serde(default = "key_cap")]
        key_cap: usize,
        /// Largest value, bytes (default 1000: YCSB's 10 fields of 100 bytes).
        #[serde(default = "value_cap")]
        value_cap: usize,
        /// Independent tables with ids `id..id + instances` (offload-scale experiments).
        #[serde(default = "instance")]
        instances: u32,
        /// File holding the tenant's credential (`naam-server keygen --out FILE`); relative
        /// paths are relative to the config file.
        credential: PathBuf,
        /// The tenant name clients authenticate as (default: the app's name). Apps with the
        /// same credential form one tenant: a session may use all of them.
        #[serde(default)]
        tenant: Option<String>,
        /// Whether clients may WRITE, CAS and FAA its regions one-sided (where the regions
        /// grant it); otherwise clients only READ them one-sided.
        #[serde(default)]
        client_writes: bool,
        /// Engine for its handlers: `jit` (default), `interp`, or `tiered` (the interpreter at
        /// once, the JIT when a background thread has compiled it).
        #[serde(default)]
        engine: EngineKind,
        /// Instructions one step may run before it faults with `budget exhausted`.
        #[serde(default = "budget")]
        budget: u64,
    },
    /// A B-tree.
    Btree {
        /// App id.
        id: u32,
        /// Keys it is sized for.
        keys: u64,
        /// Node size in bytes.
        #[serde(default = "node_size")]
        node_size: usize,
        /// Independent trees with ids `id..id + instances`.
        #[serde(default = "instance")]
        instances: u32,
        /// File holding the tenant's credential (`naam-server keygen --out FILE`); relative
        /// paths are relative to the config file.
        credential: PathBuf,
        /// The tenant name clients authenticate as (default: the app's name). Apps with the
        /// same credential form one tenant: a session may use all of them.
        #[serde(default)]
        tenant: Option<String>,
        /// Whether clients may WRITE, CAS and FAA its regions one-sided (where the regions
        /// grant it); otherwise clients only READ them one-sided.
        #[serde(default)]
        client_writes: bool,
        /// Engine for its handlers: `jit` (default), `interp`, or `tiered` (the interpreter at
        /// once, the JIT when a background thread has compiled it).
        #[serde(default)]
        engine: EngineKind,
        /// Instructions one step may run before it faults with `budget exhausted`.
        #[serde(default = "budget")]
        budget: u64,
    },
    /// Handlers from an eBPF object, with zeroed regions.
    Object {
        /// App id.
        id: u32,
        /// Name the manifest shows, and the tenant name clients authenticate as unless `tenant`
        /// is set.
        name: String,
        /// The eBPF ELF.
        object: PathBuf,
        /// Which of the object's handlers to install (each is verified); the others stay unused.
        handlers: Vec<ObjectHandler>,
        /// Regions to create for the app (default none); each needs a `size`, a `file` or both.
        #[serde(default)]
        regions: Vec<ObjectRegion>,
        /// File holding the tenant's credential (`naam-server keygen --out FILE`); relative
        /// paths are relative to the config file.
        credential: PathBuf,
        /// The tenant name clients authenticate as (default: the app's name). Apps with the
        /// same credential form one tenant: a session may use all of them.
        #[serde(default)]
        tenant: Option<String>,
        /// Whether clients may WRITE, CAS and FAA its regions one-sided (where the regions
        /// grant it); otherwise clients only READ them one-sided.
        #[serde(default)]
        client_writes: bool,
        /// Engine for its handlers: `jit` (default), `interp`, or `tiered` (the interpreter at
        /// once, the JIT when a background thread has compiled it).
        #[serde(default)]
        engine: EngineKind,
        /// Instructions one step may run before it faults with `budget exhausted`.
        #[serde(default = "budget")]
        budget: u64,
    },
}

fn key_cap() -> usize {
    24
}
fn value_cap() -> usize {
    1000
}
fn node_size() -> usize {
    1024
}
fn instance() -> u32 {
    1
}
fn budget() -> u64 {
    DEFAULT_BUDGET
}

/// The most instances one `[[app]]` may ask for: room past the 10,000 apps a server is
/// measured with (`naam-bench experiment scale --fabric udp`).
pub const MAX_INSTANCES: u32 = 16_384;

/// The largest datagram the config may set (UDP's largest payload over IPv4).
pub const MAX_DATAGRAM: usize = 65_507;

/// The largest region an `object` app may ask for (64 GiB).
pub const MAX_REGION_SIZE: usize = 64 << 30;

/// The most items or keys a MICA table or B-tree may be sized for.
pub const MAX_ITEMS: u64 = 1 << 32;

/// A handler of an `object` app.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectHandler {
    /// Section name (`naam/<name>`).
    pub name: String,
    /// Whether it writes (runs at the owner).
    #[serde(default)]
    pub write: bool,
}

/// A region of an `object` app.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectRegion {
    /// Name clients look its rkey up by in the manifest; it also names the region's file in
    /// the shared-memory directory.
    pub name: String,
    /// Size in bytes (default: the file's length).
    #[serde(default)]
    pub size: Option<usize>,
    /// A file whose bytes the region starts with (relative to the config's directory); the
    /// rest of `size` is zero. Without it the region starts zeroed.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// Rights: any of `r`, `w`, `a` (atomic).
    pub access: String,
}

/// Why a config is not usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file itself could not be read: its path and the I/O error.
    #[error("reading {0}: {1}")]
    Read(PathBuf, std::io::Error),
    /// Not valid TOML for this schema.
    #[error("{0}: {1}")]
    Parse(PathBuf, String),
    /// Valid TOML, invalid meaning: the file (empty when the caller names it) and why.
    #[error("{prefix}{message}", prefix = path_prefix(.0), message = .1)]
    Invalid(PathBuf, String),
}

/// `path: `, or nothing for an empty path (an error its caller prefixes with the file).
fn path_prefix(path: &Path) -> String {
    if path.as_os_str().is_empty() {
        String::new()
    } else {
        format!("{}: ", path.display())
    }
}

impl Config {
    /// The receive loops the server runs: the configured number, else one per core it may
    /// run on (at most [`naam_runtime::proto::limits::MAX_LOOPS`]).
    pub fn loops(&self) -> usize {
        self.receive_loops
            .unwrap_or_else(naam_runtime::udp::default_receive_loops)
    }

    /// The datagram size the server sends: the configured one, else the listen address's
    /// path's.
    pub fn datagram_size(&self) -> usize {
        self.datagram
            .unwrap_or_else(|| naam_runtime::udp::datagram_for(self.listen))
    }

    /// Reads and checks `path`; credential, object and region file paths and `shm_dir` are
    /// relative to its directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.into(), e))?;
        let mut c = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse(_, m) => ConfigError::Parse(path.into(), m),
            ConfigError::Invalid(_, m) => ConfigError::Invalid(path.into(), m),
            other => other,
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        for a in &mut c.apps {
            match a {
                AppConfig::Mica { credential, .. } | AppConfig::Btree { credential, .. } => {
                    fix(credential)
                }
                AppConfig::Object {
                    credential,
                    regions,
                    object,
                    ..
                } => {
                    fix(credential);
                    fix(object);
                    regions
                        .iter_mut()
                        .filter_map(|r| r.file.as_mut())
                        .for_each(fix);
                }
            }
        }
        c.nic_pairing.iter_mut().for_each(fix);
        c.operator_credential.iter_mut().for_each(fix);
        fix(&mut c.shm_dir);
        c.code_cache.iter_mut().for_each(fix);
        c.resp_cluster.iter_mut().for_each(fix);
        Ok(c)
    }

    /// Reads every credential the config names and makes the server's tenant table: one
    /// entry per tenant name. Two tenants of one name with different credentials, or an
    /// unreadable, malformed or group-readable credential file, are config errors.
    pub fn tenants(&self) -> Result<Vec<naam_runtime::proto::session::TenantEntry>, ConfigError> {
        use naam_runtime::proto::session::{self, Credential};
        let load = |p: &Path| {
            Credential::load(p).map_err(|e| ConfigError::Invalid(PathBuf::new(), e.to_string()))
        };
        let mut apps = Vec::new();
        let mut names: std::collections::HashMap<String, Credential> = Default::default();
        for a in &self.apps {
            let (path, tenant, _) = a.access();
            let c = load(path)?;
            let name = tenant.map_or_else(|| a.default_name(), str::to_string);
            if name == session::NIC_TENANT || name == session::OPERATOR_TENANT {
                return Err(ConfigError::Invalid(
                    PathBuf::new(),
                    format!("app {}: the tenant name {name} is reserved", a.id()),
                ));
            }
            if names.get(&name).is_some_and(|other| *other != c) {
                return Err(ConfigError::Invalid(
                    PathBuf::new(),
                    format!(
                        "tenant {name} is given two different credentials: give the apps \
                         distinct `tenant` names, or one credential"
                    ),
                ));
            }
            names.insert(name.clone(), c.clone());
            for id in a.ids() {
                apps.push((id, name.clone(), c.clone()));
            }
        }
        let nic = self.nic_pairing.as_deref().map(load).transpose()?;
        let operator = self.operator_credential.as_deref().map(load).transpose()?;
        // One entry per tenant name (the first app of each names it).
        let mut entries = session::tenant_entries(&apps, operator, nic);
        let mut seen = std::collections::HashSet::new();
        entries.retain(|e| seen.insert(e.name.clone()));
        for e in &entries {
            if let session::Role::Tenant { name, apps } = &e.role {
                // A session's apps go to naam-nic in one message, which takes at most this many.
                if apps.len() > naam_runtime::proto::limits::MAX_SESSION_APPS {
                    return Err(ConfigError::Invalid(
                        PathBuf::new(),
                        format!(
                            "tenant {name}'s credential opens {} apps; a session may use at \
                             most {}: give some of them another credential",
                            apps.len(),
                            naam_runtime::proto::limits::MAX_SESSION_APPS
                        ),
                    ));
                }
            }
        }
        Ok(entries)
    }

    /// Parses and checks a config text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let c: Config =
            toml::from_str(text).map_err(|e| ConfigError::Parse(PathBuf::new(), e.to_string()))?;
        let bad = |m: String| Err(ConfigError::Invalid(PathBuf::new(), m));
        if c.apps.is_empty() {
            return bad("no [[app]] to serve".into());
        }
        if c.resp_cluster.is_some() && c.resp_listen.is_none() {
            return bad(
                "resp_cluster needs resp_listen (this node's RESP address in the cluster file)"
                    .into(),
            );
        }
        let mut ids = std::collections::HashSet::new();
        for a in &c.apps {
            let n = a.instances();
            if n == 0 || n > MAX_INSTANCES {
                return bad(format!(
                    "app {}: instances must be 1 to {MAX_INSTANCES}, not {n}",
                    a.id()
                ));
            }
            if a.id().checked_add(n - 1).is_none() {
                return bad(format!(
                    "app {}: {n} instances run past the last app id",
                    a.id()
                ));
            }
            for id in a.ids() {
                if !ids.insert(id) {
                    return bad(format!("app id {id} appears twice"));
                }
            }
            match a {
                AppConfig::Mica { items: n, .. } | AppConfig::Btree { keys: n, .. }
                    if *n == 0 || *n > MAX_ITEMS =>
                {
                    return bad(format!(
                        "app {}: items (keys) must be 1 to {MAX_ITEMS}, not {n}",
                        a.id()
                    ));
                }
                AppConfig::Object { regions, .. } => {
                    if let Some(r) = regions
                        .iter()
                        .find(|r| r.size.is_none() && r.file.is_none())
                    {
                        return bad(format!(
                            "app {}: region {} needs a size or a file",
                            a.id(),
                            r.name
                        ));
                    }
                    if let Some(r) = regions.iter().find(|r| {
                        r.size
                            .is_some_and(|size| size == 0 || size > MAX_REGION_SIZE)
                    }) {
                        return bad(format!(
                            "app {}: region {} has size {}: it must be 1 to {MAX_REGION_SIZE} bytes",
                            a.id(),
                            r.name,
                            r.size.unwrap_or(0)
                        ));
                    }
                }
                _ => {}
            }
            let (_, budget) = a.exec();
            if !(1..=MAX_BUDGET).contains(&budget) {
                return bad(format!(
                    "app {}: budget must be 1 to {MAX_BUDGET} instructions per step, not {budget}",
                    a.id()
                ));
            }
        }
        let (lo, hi) = (naam_runtime::proto::frame::MIN_DATAGRAM, MAX_DATAGRAM);
        if let Some(d) = c.datagram.filter(|d| !(lo..=hi).contains(d)) {
            return bad(format!("datagram must be {lo} to {hi} bytes, not {d}"));
        }
        if c.host_executors == 0 {
            return bad("host_executors must be at least 1".into());
        }
        let max_loops = naam_runtime::proto::limits::MAX_LOOPS;
        if let Some(n) = c.receive_loops.filter(|n| !(1..=max_loops).contains(n)) {
            return bad(format!("receive_loops must be 1 to {max_loops}, not {n}"));
        }
        if c.queue_capacity == 0 {
            return bad("queue_capacity must be at least 1".into());
        }
        c.policy()?;
        if let Some(d) = &c.deploy {
            if d.max_handlers == 0 || d.max_code_bytes == 0 {
                return bad("[deploy]: max_handlers and max_code_bytes must be at least 1".into());
            }
            if d.max_region_bytes > MAX_CREATED_REGION_BYTES {
                return bad(format!(
                    "[deploy]: max_region_bytes must be at most {MAX_CREATED_REGION_BYTES}, not {}",
                    d.max_region_bytes
                ));
            }
            if d.max_created_apps > MAX_CREATED_APPS {
                return bad(format!(
                    "[deploy]: max_created_apps must be at most {MAX_CREATED_APPS}, not {}",
                    d.max_created_apps
                ));
            }
            let r = d.max_deploys_per_second;
            if !(r.is_finite() && (0.01..=10_000.0).contains(&r)) {
                return bad(format!(
                    "[deploy]: max_deploys_per_second must be 0.01 to 10000, not {r}"
                ));
            }
            if !(1..=MAX_BUDGET).contains(&d.max_budget) {
                return bad(format!(
                    "[deploy]: max_budget must be 1 to {MAX_BUDGET} instructions per step, not {}",
                    d.max_budget
                ));
            }
        }
        if c.xdp_interface.is_some() && c.nic_port.is_none() {
            return bad(
                "xdp_interface needs nic_port (naam-nic's port on the listen address)".into(),
            );
        }
        Ok(c)
    }

    /// The steering policy.
    pub fn policy(&self) -> Result<PolicyChoice, ConfigError> {
        match self.policy.as_str() {
            "auto" => Ok(PolicyChoice::Auto(CostPolicyConfig::default())),
            p => p
                .parse::<Placement>()
                .map(PolicyChoice::Always)
                .map_err(|e| ConfigError::Invalid(PathBuf::new(), format!("policy: {e}, or auto"))),
        }
    }
}

impl AppConfig {
    /// The credential file, tenant name and client-writes switch.
    pub fn access(&self) -> (&Path, Option<&str>, bool) {
        match self {
            AppConfig::Mica {
                credential,
                tenant,
                client_writes,
                ..
            }
            | AppConfig::Btree {
                credential,
                tenant,
                client_writes,
                ..
            }
            | AppConfig::Object {
                credential,
                tenant,
                client_writes,
                ..
            } => (credential, tenant.as_deref(), *client_writes),
        }
    }

    /// The name the entry's apps get.
    pub fn default_name(&self) -> String {
        match self {
            AppConfig::Mica { .. } => "mica".into(),
            AppConfig::Btree { .. } => "btree".into(),
            AppConfig::Object { name, .. } => name.clone(),
        }
    }

    /// The app id.
    pub fn id(&self) -> u32 {
        match self {
            AppConfig::Mica { id, .. }
            | AppConfig::Btree { id, .. }
            | AppConfig::Object { id, .. } => *id,
        }
    }

    /// How many apps this entry makes.
    pub fn instances(&self) -> u32 {
        match self {
            AppConfig::Mica { instances, .. } | AppConfig::Btree { instances, .. } => *instances,
            AppConfig::Object { .. } => 1,
        }
    }

    /// The ids of the apps this entry makes.
    pub fn ids(&self) -> std::ops::Range<u32> {
        let id = self.id();
        id..id.saturating_add(self.instances())
    }

    /// The engine and instruction budget of the entry's handlers.
    pub fn exec(&self) -> (EngineKind, u64) {
        match self {
            AppConfig::Mica { engine, budget, .. }
            | AppConfig::Btree { engine, budget, .. }
            | AppConfig::Object { engine, budget, .. } => (*engine, *budget),
        }
    }

    /// Builds the apps: handlers (MICA's and the B-tree's are embedded in the binary; an object
    /// app's are read from its path; each is verified when installed) on the entry's engine and
    /// budget, regions, and what the manifest tells clients.
    pub fn build(&self) -> anyhow::Result<Vec<HostApp>> {
        let (engine, budget) = self.exec();
        Ok(self
            .build_specs()?
            .into_iter()
            .map(|mut a| {
                a.spec = a.spec.with_engine(engine).with_budget(budget);
                a
            })
            .collect())
    }

    fn build_specs(&self) -> anyhow::Result<Vec<HostApp>> {
        use anyhow::Context as _;
        match self {
            AppConfig::Mica {
                items,
                key_cap,
                value_cap,
                ..
            } => {
                let mc = naam_mica::MicaConfig::sized(*items, *key_cap, *value_cap);
                let loaded =
                    Arc::new(naam_mica::handlers().context("loading MICA's embedded handlers")?);
                let bytes = naam_mica::HANDLERS_OBJECT.to_vec();
                self.ids()
                    .map(|id| {
                        Ok(HostApp {
                            spec: naam_mica::app_spec(id, &mc, loaded.clone(), Placement::Host)?,
                            kind: "mica".into(),
                            params: serde_json::to_value(mc)?,
                            object_bytes: bytes.clone(),
                            client_writes: self.access().2,
                            credential: None,
                        })
                    })
                    .collect()
            }
            AppConfig::Btree {
                keys, node_size, ..
            } => {
                let bc = naam_btree::BTreeConfig::with_node_size(*keys, *node_size);
                let loaded = Arc::new(
                    naam_btree::handlers().context("loading the B-tree's embedded handlers")?,
                );
                let bytes = naam_btree::HANDLERS_OBJECT.to_vec();
                self.ids()
                    .map(|id| {
                        Ok(HostApp {
                            spec: naam_btree::app_spec(id, &bc, loaded.clone(), Placement::Host)?,
                            kind: "btree".into(),
                            params: serde_json::to_value(bc)?,
                            object_bytes: bytes.clone(),
                            client_writes: self.access().2,
                            credential: None,
                        })
                    })
                    .collect()
            }
            AppConfig::Object {
                id,
                name,
                object,
                handlers,
                regions,
                ..
            } => {
                let bytes = std::fs::read(object)
                    .with_context(|| format!("reading {}", object.display()))?;
                let loaded = naam_runtime::vm::load(&bytes)
                    .with_context(|| format!("loading {}", object.display()))?;
                let mut rs = Vec::new();
                for r in regions {
                    let mut access = 0;
                    for ch in r.access.chars() {
                        access |= match ch {
                            'r' => ACCESS_READ,
                            'w' => ACCESS_WRITE,
                            'a' => ACCESS_ATOMIC,
                            o => anyhow::bail!("region {}: unknown right `{o}` (r, w, a)", r.name),
                        };
                    }
                    let initial = match &r.file {
                        Some(f) => {
                            let len = std::fs::metadata(f)
                                .with_context(|| format!("region {}: {}", r.name, f.display()))?
                                .len();
                            if len > MAX_REGION_SIZE as u64 {
                                anyhow::bail!(
                                    "region {}: {} has {len} bytes, more than a region's \
                                     {MAX_REGION_SIZE}",
                                    r.name,
                                    f.display()
                                );
                            }
                            std::fs::read(f)
                                .with_context(|| format!("region {}: {}", r.name, f.display()))?
                        }
                        None => Vec::new(),
                    };
                    let size = r.size.unwrap_or(initial.len());
                    if initial.len() > size {
                        anyhow::bail!(
                            "region {}: the file has {} bytes, more than its size {size}",
                            r.name,
                            initial.len()
                        );
                    }
                    if size == 0 {
                        anyhow::bail!("region {}: the file is empty and no size is given", r.name);
                    }
                    // A size the machine cannot hold is an error, never an abort.
                    let mut contents = Vec::new();
                    contents.try_reserve_exact(size).map_err(|_| {
                        anyhow::anyhow!(
                            "region {}: {size} bytes cannot be allocated on this machine",
                            r.name
                        )
                    })?;
                    contents.extend_from_slice(&initial);
                    contents.resize(size, 0u8);
                    rs.push(RegionSpec {
                        name: r.name.clone(),
                        access,
                        contents,
                    });
                }
                Ok(vec![HostApp {
                    spec: AppSpec {
                        id: *id,
                        name: name.clone(),
                        owner: Placement::Host,
                        regions: rs,
                        object: Arc::new(loaded),
                        // Operator-supplied bytecode: verified, and every access it makes
                        // is checked by whichever engine runs it.
                        handlers: handlers
                            .iter()
                            .map(|h| {
                                if h.write {
                                    HandlerSpec::write(&h.name)
                                } else {
                                    HandlerSpec::read(&h.name)
                                }
                            })
                            .collect(),
                    },
                    kind: "object".into(),
                    params: serde_json::Value::Null,
                    object_bytes: bytes,
                    client_writes: self.access().2,
                    credential: None,
                }])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Five apps of 16,384 instances under one credential open more apps than one session's
    /// announcement to naam-nic can carry: refused, naming the tenant.
    #[test]
    fn a_credential_may_open_at_most_a_sessions_worth_of_apps() {
        let dir = std::env::temp_dir().join(format!("naam-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let key = dir.join("t.key");
        std::fs::write(&key, "11".repeat(32)).expect("key");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("mode");
        let app = |id: u32| {
            format!(
                "[[app]]\nkind = \"mica\"\nid = {id}\nitems = 32\nkey_cap = 8\nvalue_cap = 8\n\
                 tenant = \"t\"\ncredential = \"{}\"\ninstances = {MAX_INSTANCES}\n",
                key.display()
            )
        };
        let text: String = std::iter::once("listen = \"127.0.0.1:7000\"\n".to_string())
            .chain((0..5).map(|i| app(1 + i * MAX_INSTANCES)))
            .collect();
        let c = Config::parse(&text).expect("each app is valid alone");
        let e = c
            .tenants()
            .expect_err("81,920 apps for one session")
            .to_string();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(e.contains("tenant t's credential opens 81920 apps"), "{e}");
    }

    #[test]
    fn a_listen_host_name_is_resolved_and_credential_errors_name_no_empty_field() {
        let c = Config::parse(
            "listen = \"localhost:7000\"\n[[app]]\nkind = \"mica\"\nid = 1\nitems = 10\n\
             credential = \"/nonexistent/k.key\"\n",
        )
        .expect("a host name where an address goes");
        assert!(c.listen.ip().is_loopback() && c.listen.port() == 7000);
        let e = c.tenants().expect_err("no such credential").to_string();
        assert!(e.starts_with("credential file /nonexistent/k.key"), "{e}");
        let bad = Config::parse("listen = \"nowhere\"\n").expect_err("not HOST:PORT");
        assert!(bad.to_string().contains("HOST:PORT"), "{bad}");
    }

    #[test]
    fn object_regions_start_with_their_files_relative_to_the_config() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("h.o"), naam_mica::HANDLERS_OBJECT).unwrap();
        std::fs::write(dir.path().join("table.bin"), [1u8, 2, 3, 4]).unwrap();
        std::fs::write(dir.path().join("big.bin"), [9u8; 100]).unwrap();
        let config = |regions: &str| {
            let path = dir.path().join("c.toml");
            std::fs::write(
                &path,
                format!(
                    "listen = \"127.0.0.1:7000\"\n[[app]]\nkind = \"object\"\nid = 3\n\
                     credential = \"k.key\"\nname = \"x\"\nobject = \"h.o\"\n\
                     handlers = [{{ name = \"mica_get\" }}]\nregions = [{regions}]\n"
                ),
            )
            .unwrap();
            Config::load(&path)
        };
        let c = config(
            r#"{ name = "t", file = "table.bin", access = "r" },
               { name = "u", file = "table.bin", size = 16, access = "r" },
               { name = "z", size = 8, access = "rw" }"#,
        )
        .unwrap();
        let built = c.apps[0].build().unwrap();
        let regions = &built[0].spec.regions;
        assert_eq!(regions[0].contents, [1, 2, 3, 4]);
        assert_eq!(&regions[1].contents[..4], [1, 2, 3, 4]);
        assert_eq!(regions[1].contents.len(), 16);
        assert_eq!(regions[2].contents, [0; 8]);
        // A file larger than the size, a missing file, neither size nor file: refused.
        let c = config(r#"{ name = "t", file = "big.bin", size = 10, access = "r" }"#).unwrap();
        let e = c.apps[0].build().err().expect("refused").to_string();
        assert!(e.contains("more than its size 10"), "{e}");
        let c = config(r#"{ name = "t", file = "nope.bin", access = "r" }"#).unwrap();
        let e = format!("{:#}", c.apps[0].build().err().expect("refused"));
        assert!(e.contains("nope.bin"), "{e}");
        let e = config(r#"{ name = "t", access = "r" }"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a size or a file"), "{e}");
    }

    #[test]
    fn the_deploy_section_sets_the_quotas_and_refuses_what_cannot_work() {
        let base = "listen = \"127.0.0.1:7000\"\n[[app]]\nkind = \"mica\"\nid = 1\nitems = 10\n\
                    credential = \"k.key\"\n";
        let c = Config::parse(base).expect("no [deploy]");
        assert!(c.deploy.is_none(), "deploys are refused unless configured");
        let c = Config::parse(&format!(
            "{base}[deploy]\nmax_handlers = 3\nmax_deploys_per_second = 2.5\nengine = \"jit\"\n"
        ))
        .expect("a [deploy] section");
        let p = c.deploy.expect("deploys").policy(Path::new("/dev/shm/x"));
        assert_eq!((p.max_handlers, p.max_code_bytes), (3, 1 << 20));
        assert_eq!((p.deploys_per_second, p.engine), (2.5, EngineKind::Jit));
        assert_eq!(
            (p.max_apps, p.max_region_bytes),
            (0, 64 << 20),
            "no apps created by default"
        );
        let c = Config::parse(&format!(
            "{base}[deploy]\nmax_apps = 3\nmax_region_bytes = 4096\nmax_created_apps = 10\n"
        ))
        .expect("a config");
        let d = c.deploy.as_ref().expect("[deploy]");
        assert_eq!(d.max_created_apps, 10);
        let p = d.policy(Path::new("/dev/shm/x"));
        assert_eq!((p.max_apps, p.max_region_bytes), (3, 4096));
        for (bad, why) in [
            ("max_handlers = 0", "at least 1"),
            ("max_region_bytes = 4294967297", "max_region_bytes"),
            ("max_created_apps = 65537", "max_created_apps"),
            ("max_apps = -1", "max_apps"),
            ("max_budget = 0", "max_budget"),
            ("max_deploys_per_second = 0", "max_deploys_per_second"),
            ("max_deploys_per_second = nan", "max_deploys_per_second"),
            ("engine = \"fast\"", "engine"),
            ("quota = 1", "unknown field"),
        ] {
            let e = Config::parse(&format!("{base}[deploy]\n{bad}\n"))
                .expect_err(bad)
                .to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn a_full_config_parses() {
        let c = Config::parse(
            r#"
            listen = "127.0.0.1:7000"
            host_executors = 2
            policy = "nic"
            allow_congestion_control = true
            [[app]]
            kind = "mica"
            id = 1
            credential = "keys/k.key"
            items = 1000
            [[app]]
            kind = "btree"
            id = 2
            credential = "keys/k.key"
            keys = 1000
            [[app]]
            kind = "mica"
            id = 100
            credential = "keys/k.key"
            items = 32
            instances = 64
            [[app]]
            kind = "object"
            id = 3
            credential = "keys/k.key"
            name = "x"
            object = "x.o"
            handlers = [{ name = "get" }, { name = "put", write = true }]
            regions = [{ name = "data", size = 64, access = "rwa" }]
            "#,
        )
        .unwrap();
        assert_eq!(c.apps.len(), 4);
        assert_eq!(c.apps[2].ids(), 100..164);
        assert!(c.allow_congestion_control);
        assert_eq!(c.shm_dir, PathBuf::from("/dev/shm/naam"));
        assert!(matches!(
            c.policy().unwrap(),
            PolicyChoice::Always(Placement::Nic)
        ));
    }

    #[test]
    fn the_example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("naam-server.example.toml");
        let c = Config::load(&path).unwrap();
        assert!(!c.allow_congestion_control);
        assert_eq!(c.apps.len(), 2);
    }

    #[test]
    fn the_resp_keys_parse_and_a_cluster_file_needs_a_resp_address() {
        let app = "[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"\n";
        let c = Config::parse(&format!(
            "listen = \"127.0.0.1:1\"\nresp_listen = \"127.0.0.1:6379\"\nresp_path = \"inline\"\n{app}"
        ))
        .unwrap();
        assert_eq!(c.resp_listen, Some("127.0.0.1:6379".parse().unwrap()));
        assert_eq!(c.resp_path, RespPath::Inline);
        let c = Config::parse(&format!("listen = \"127.0.0.1:1\"\n{app}")).unwrap();
        assert_eq!((c.resp_listen, c.resp_path), (None, RespPath::Udp));
        for (text, needle) in [
            (
                "resp_cluster = \"c.toml\"\n",
                "resp_cluster needs resp_listen",
            ),
            ("resp_path = \"tcp\"\n", "resp_path"),
            ("resp_listen = \"nowhere\"\n", "resp_listen"),
        ] {
            let e = Config::parse(&format!("listen = \"127.0.0.1:1\"\n{text}{app}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn wrong_configs_say_what_is_wrong() {
        for (text, needle) in [
            ("listen = \"x\"", "listen"),
            ("listen = \"127.0.0.1:1\"", "no [[app]]"),
            (
                "listen = \"127.0.0.1:1\"\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"",
                "twice",
            ),
            (
                "listen = \"127.0.0.1:1\"\npolicy=\"fast\"\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"",
                "policy",
            ),
            ("listen = \"127.0.0.1:1\"\n[[app]]\nkind=\"redis\"\nid=1", "redis"),
            (
                "listen = \"127.0.0.1:1\"\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"\ninstances=4\n[[app]]\nkind=\"btree\"\nid=3\nkeys=1\ncredential=\"k\"",
                "app id 3 appears twice",
            ),
            (
                "listen = \"127.0.0.1:1\"\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"\ninstances=0",
                "instances must be",
            ),
            (
                "listen = \"127.0.0.1:1\"\n[[app]]\nkind=\"mica\"\nid=4294967295\nitems=1\ncredential=\"k\"\ninstances=2",
                "past the last app id",
            ),
            ("listen = \"127.0.0.1:1\"\ncolour = 1\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"", "colour"),
            (
                "listen = \"127.0.0.1:1\"\nreceive_loops = 0\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"",
                "receive_loops must be 1 to 64, not 0",
            ),
            (
                "listen = \"127.0.0.1:1\"\nreceive_loops = 65\n[[app]]\nkind=\"mica\"\nid=1\nitems=1\ncredential=\"k\"",
                "receive_loops must be 1 to 64, not 65",
            ),
        ] {
            let e = Config::parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
