//! Starting the two server-side processes of a UDP deployment from library code (the binaries
//! `naam-server` and `naam-nic` are thin wrappers, and tests start both in one process).
//!
//! The host creates every region as a file in a shared-memory directory (`/dev/shm/...`) and
//! writes `manifest.json` there with the regions' rkeys and the handler objects; the NIC maps
//! the same files, which is how this emulation gives NIC cores DMA access to host memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cluster::{AppSpec, Cluster, ClusterConfig, ClusterError, PolicyChoice, RegionSpec};
use crate::HandlerSpec;
use crate::RegionMemory;
use naam_proto::control::{object_hash, AppManifest, HandlerManifest, Manifest, RegionManifest};
use naam_proto::handler_id;
use naam_proto::step::HandlerKind;
use naam_proto::Placement;

/// Name of the manifest file in the shared-memory directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// How long naam-server's idle host executors poll before they park, by default: longer than
/// the in-process default, because a datagram round trip over UDP outlasts a short poll and
/// naam-server has no emulated NIC threads in its process to starve (bench/RESULTS.md, "MICA
/// YCSB-B over UDP against memcached", has the measurement).
pub const SERVER_EXECUTOR_POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// Why a deployment could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeployError {
    /// The cluster refused the apps or configuration.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The manifest is not valid.
    #[error("{path}: invalid manifest: {message}")]
    Manifest {
        /// The file.
        path: PathBuf,
        /// The cause as text: a JSON, handler-object loading or OS RNG error, or a handler
        /// object that changed since the host loaded it.
        message: String,
    },
}

/// An app for the host, with what the manifest says about it.
pub struct HostApp {
    /// The app.
    pub spec: AppSpec,
    /// Kind (`mica`, `btree`, `object`).
    pub kind: String,
    /// Kind-specific parameters for clients.
    pub params: serde_json::Value,
    /// The handler object's ELF bytes.
    pub object_bytes: Vec<u8>,
    /// Whether clients may WRITE, CAS and FAA its regions one-sided (where the regions grant
    /// it to handlers); otherwise clients only READ them.
    pub client_writes: bool,
    /// The tenant's credential: region rkeys are derived from it
    /// ([`naam_proto::session::Credential::region_key`]), so they stay the same across restarts;
    /// `None`: random rkeys.
    pub credential: Option<naam_proto::session::Credential>,
}

fn file_err(path: &Path) -> impl FnOnce(std::io::Error) -> DeployError + '_ {
    move |source| DeployError::File {
        path: path.to_path_buf(),
        source,
    }
}

/// Where a host keeps its regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostRegions {
    /// Each a file in the shared-memory directory, which a naam-nic process maps
    /// ([`start_nic`]).
    SharedFiles,
    /// The host's own memory (anonymous, on huge pages when large), for a naam-nic in the
    /// same process ([`start_nic_in_process`]); the manifest names no file.
    InProcess,
}

/// Builds the host's cluster (host executors only; the NIC is remote) with every region in
/// `shm_dir`, and writes the manifest there.
pub fn start_host(
    apps: Vec<HostApp>,
    config: ClusterConfig,
    shm_dir: &Path,
) -> Result<(Arc<Cluster>, Manifest), DeployError> {
    start_host_with(apps, config, shm_dir, HostRegions::SharedFiles)
}

/// [`start_host`] with its regions kept as `kept` says (the manifest, with the handlers'
/// objects, is written in `shm_dir` either way).
pub fn start_host_with(
    apps: Vec<HostApp>,
    mut config: ClusterConfig,
    shm_dir: &Path,
    kept: HostRegions,
) -> Result<(Arc<Cluster>, Manifest), DeployError> {
    config.remote_nic = true;
    config.remote_clients = true;
    config.nic_executors = 0;
    std::fs::create_dir_all(shm_dir).map_err(file_err(shm_dir))?;
    let dir = shm_dir.to_path_buf();
    let region_path = move |app: u32, name: &str| dir.join(format!("app{app}-{name}.region"));
    let rp = region_path.clone();
    let credentials: std::collections::HashMap<u32, naam_proto::session::Credential> = apps
        .iter()
        .filter_map(|a| a.credential.clone().map(|c| (a.spec.id, c)))
        .collect();
    let mut builder =
        Cluster::builder()
            .config(config)
            .region_backing(Box::new(move |app, r: &RegionSpec| {
                let path = rp(app, &r.name);
                let rkey = credentials.get(&app).map(|c| c.region_key(app, &r.name));
                match kept {
                    HostRegions::SharedFiles => RegionMemory::create_shared(&path, &r.contents)
                        .map(|m| (m, rkey))
                        .map_err(|e| ClusterError::Region {
                            app,
                            region: r.name.clone(),
                            message: e.to_string(),
                        }),
                    HostRegions::InProcess => Ok((RegionMemory::from_bytes(&r.contents), rkey)),
                }
            }));
    let mut manifest = Manifest {
        apps: Vec::new(),
        mode: super::MODE.into(),
        policy: String::new(),
        epoch: naam_proto::session::random_u64().map_err(|e| DeployError::Manifest {
            path: shm_dir.join(MANIFEST_FILE),
            message: e.to_string(),
        })?,
    };
    let mut pending = Vec::new();
    let mut written = std::collections::HashSet::new();
    for a in apps {
        // Named by content: instances of one app kind share one file.
        let hash = object_hash(&a.object_bytes);
        let object_path = shm_dir.join(format!("object-{hash:016x}.o"));
        if written.insert(hash) {
            std::fs::write(&object_path, &a.object_bytes).map_err(file_err(&object_path))?;
        }
        pending.push((
            a.spec.id,
            a.spec.name.clone(),
            a.kind,
            a.params,
            object_path,
            hash,
            a.spec.handlers.clone(),
            a.spec.regions.clone(),
            a.client_writes,
        ));
        builder = builder.app(a.spec);
    }
    let cluster = Arc::new(builder.build()?);
    manifest.policy = cluster.policy_name().to_string();
    for (id, name, kind, params, object, hash, handlers, regions, client_writes) in pending {
        manifest.apps.push(AppManifest {
            id,
            name,
            kind,
            params,
            object: object.display().to_string(),
            object_hash: hash,
            handlers: handlers
                .iter()
                .map(|h| HandlerManifest {
                    name: h.name.clone(),
                    id: handler_id(&h.name),
                    write: h.kind == HandlerKind::Write,
                    engine: h.engine,
                    budget: h.budget,
                })
                .collect(),
            regions: regions
                .iter()
                .map(|r| RegionManifest {
                    name: r.name.clone(),
                    rkey: cluster.region_key(id, &r.name).unwrap_or(0),
                    access: r.access,
                    client_access: if client_writes {
                        r.access
                    } else {
                        r.access & naam_ebpf::abi::ACCESS_READ
                    },
                    len: r.contents.len() as u64,
                    path: (kept == HostRegions::SharedFiles)
                        .then(|| region_path(id, &r.name).display().to_string()),
                })
                .collect(),
        });
    }
    let path = shm_dir.join(MANIFEST_FILE);
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| DeployError::Manifest {
        path: path.clone(),
        message: e.to_string(),
    })?;
    // Written whole, then renamed: a NIC starting now never reads half a manifest.
    let tmp = shm_dir.join(".manifest.json.tmp");
    std::fs::write(&tmp, json).map_err(file_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(file_err(&path))?;
    Ok((cluster, manifest))
}

/// Reads the manifest a host wrote in `shm_dir`.
pub fn read_manifest(shm_dir: &Path) -> Result<Manifest, DeployError> {
    let path = shm_dir.join(MANIFEST_FILE);
    let bytes = std::fs::read(&path).map_err(file_err(&path))?;
    serde_json::from_slice(&bytes).map_err(|e| DeployError::Manifest {
        path,
        message: e.to_string(),
    })
}

/// Builds the NIC's cluster (NIC executors only, no controller) from the host's manifest in
/// `shm_dir`: the same handlers, the host's regions mapped under the same rkeys.
pub fn start_nic(
    shm_dir: &Path,
    config: ClusterConfig,
) -> Result<(Arc<Cluster>, Manifest), DeployError> {
    start_nic_over(shm_dir, config, None)
}

/// [`start_nic`] for a NIC in the host's process, over `host`'s own regions (kept by
/// [`HostRegions::InProcess`]): each seen through [`RegionMemory::view_of`], not mapped
/// from a file.
pub fn start_nic_in_process(
    shm_dir: &Path,
    config: ClusterConfig,
    host: &Cluster,
) -> Result<(Arc<Cluster>, Manifest), DeployError> {
    start_nic_over(shm_dir, config, Some(host.regions().clone()))
}

/// [`start_nic`] over the regions of `host` when given, else over the manifest's files.
fn start_nic_over(
    shm_dir: &Path,
    mut config: ClusterConfig,
    host: Option<Arc<crate::region::RegionTable>>,
) -> Result<(Arc<Cluster>, Manifest), DeployError> {
    let manifest = read_manifest(shm_dir)?;
    let mpath = shm_dir.join(MANIFEST_FILE);
    config.host_executors = 0;
    config.nic_executors = config.nic_executors.max(1);
    config.controller = false;
    config.remote_nic = false;
    config.policy = PolicyChoice::Always(Placement::Nic);
    let regions = manifest.apps.clone();
    let mut builder =
        Cluster::builder()
            .config(config)
            .region_backing(Box::new(move |app, r: &RegionSpec| {
                let m = regions
                    .iter()
                    .find(|a| a.id == app)
                    .and_then(|a| a.regions.iter().find(|x| x.name == r.name));
                let fail = |message: String| ClusterError::Region {
                    app,
                    region: r.name.clone(),
                    message,
                };
                let m = m.ok_or_else(|| fail("not in the manifest".into()))?;
                if let Some(host) = &host {
                    let region = host.get(app, m.rkey).ok_or_else(|| {
                        fail("the host in this process has no such region".into())
                    })?;
                    return Ok((RegionMemory::view_of(region), Some(m.rkey)));
                }
                let path = m
                    .path
                    .as_ref()
                    .ok_or_else(|| fail("the manifest names no shared-memory file".into()))?;
                let mem = RegionMemory::map_shared(Path::new(path), m.len as usize)
                    .map_err(|e| fail(e.to_string()))?;
                Ok((mem, Some(m.rkey)))
            }));
    for a in &manifest.apps {
        let opath = PathBuf::from(&a.object);
        let bytes = std::fs::read(&opath).map_err(file_err(&opath))?;
        if object_hash(&bytes) != a.object_hash {
            return Err(DeployError::Manifest {
                path: mpath.clone(),
                message: format!("{} changed since the host loaded it", a.object),
            });
        }
        let object = naam_vm::load(&bytes).map_err(|e| DeployError::Manifest {
            path: opath.clone(),
            message: e.to_string(),
        })?;
        builder = builder.app(AppSpec {
            id: a.id,
            name: a.name.clone(),
            owner: Placement::Host,
            regions: a
                .regions
                .iter()
                .map(|r| RegionSpec {
                    name: r.name.clone(),
                    access: r.access,
                    contents: Vec::new(),
                })
                .collect(),
            object: Arc::new(object),
            handlers: a
                .handlers
                .iter()
                .map(|h| {
                    let s = if h.write {
                        HandlerSpec::write(&h.name)
                    } else {
                        HandlerSpec::read(&h.name)
                    };
                    s.engine(h.engine).budget(h.budget)
                })
                .collect(),
        });
    }
    Ok((Arc::new(builder.build()?), manifest))
}

/// Removes what [`start_host`] created in `shm_dir` (regions, objects, manifest), and the
/// directory itself when nothing else is in it.
pub fn cleanup(shm_dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(shm_dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = name == MANIFEST_FILE
                || (name.starts_with("app") && name.ends_with(".region"))
                || (name.starts_with("object-") && name.ends_with(".o"));
            if ours {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(shm_dir);
}
