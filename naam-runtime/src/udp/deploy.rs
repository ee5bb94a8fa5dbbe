//! Starting the two server-side processes of a UDP deployment from library code (the binaries
//! `naam-server` and `naam-nic` are thin wrappers, and tests start both in one process).
//!
//! The host creates every region as a file in a shared-memory directory (`/dev/shm/...`) and
//! writes `manifest.json` there with the regions' rkeys and the handler objects; the NIC maps
//! the same files, which is how this emulation gives NIC cores DMA access to host memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::deploy_error::DeployError;
use super::shm_dir::{
    describe_layout, layout_hash, RegionsHeader, RegionsState, ShmDir, HEADER_FILE, REGIONS_FORMAT,
};
use crate::cluster::{AppSpec, Cluster, ClusterConfig, ClusterError, PolicyChoice, RegionSpec};
use crate::journal::{RolledBack, WriteJournal, JOURNAL_SIZE};
use crate::HandlerSpec;
use crate::RegionMemory;
use naam_proto::control::{object_hash, AppManifest, HandlerManifest, Manifest, RegionManifest};
use naam_proto::handler_id;
use naam_proto::step::HandlerKind;
use naam_proto::Placement;
use naam_vm::LoadedObject;

/// Name of the manifest file in the shared-memory directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// How long naam-server's idle host executors poll before they park, by default: longer than
/// the in-process default, because a datagram round trip over UDP outlasts a short poll and
/// naam-server has no emulated NIC threads in its process to starve (bench/RESULTS.md, "MICA
/// YCSB-B over UDP against memcached", has the measurement).
pub const SERVER_EXECUTOR_POLL: std::time::Duration = std::time::Duration::from_micros(200);

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
    config: ClusterConfig,
    shm_dir: &Path,
    kept: HostRegions,
) -> Result<(Arc<Cluster>, Manifest), DeployError> {
    std::fs::create_dir_all(shm_dir).map_err(file_err(shm_dir))?;
    let made = Made::default();
    let (cluster, manifest, _) = build_host(apps, config, shm_dir, kept, false, false, &made)?;
    Ok((cluster, manifest))
}

/// How a persistent start ([`start_host_persistent`]) treats the regions its directory holds
/// from an earlier start.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionStart {
    /// Uses them again when they have the config's layout (after a clean stop or a crash),
    /// makes new ones when there are none, and refuses others
    /// ([`DeployError::LayoutChanged`]).
    Reattach,
    /// Discards them and starts empty.
    Reset,
    /// Copies in the regions of a snapshot ([`snapshot`]) into a directory that holds none,
    /// then uses them as [`RegionStart::Reattach`] would.
    FromSnapshot(PathBuf),
}

/// Copies the regions a stopped server left in `shm_dir` (files, journals and header) into
/// the new directory `out`, for a server on another machine to start from
/// ([`RegionStart::FromSnapshot`]): taken under the directory's lock, so never while a server
/// runs over it ([`DeployError::Locked`]). Returns the files copied.
pub fn snapshot(shm_dir: &Path, out: &Path) -> Result<usize, DeployError> {
    if !shm_dir.is_dir() {
        return Err(DeployError::Snapshot {
            path: shm_dir.to_path_buf(),
            message: "no such directory: no regions to snapshot".into(),
        });
    }
    let dir = ShmDir::lock(shm_dir)?;
    dir.snapshot_to(out)
}

/// What a persistent start began with.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Started {
    /// New regions, from the config's initial contents.
    Fresh {
        /// Region, journal and header files of an earlier start it removed
        /// ([`RegionStart::Reset`]).
        discarded: usize,
    },
    /// The regions an earlier start left, with their data.
    Reattached {
        /// Whether the server before stopped cleanly (else it crashed or was killed).
        clean: bool,
        /// The apps whose unfinished write batch was undone, and what was undone.
        rolled_back: Vec<(u32, RolledBack)>,
    },
}

/// A host started by [`start_host_persistent`]: it holds its directory until
/// [`PersistentHost::stop`] (or until dropped, which leaves the regions marked as in use, as
/// a crash would).
pub struct PersistentHost {
    /// The host's cluster.
    pub cluster: Arc<Cluster>,
    /// The manifest written for this start (a new epoch).
    pub manifest: Manifest,
    /// What the regions were at the start.
    pub started: Started,
    dir: ShmDir,
    header: RegionsHeader,
}

impl std::fmt::Debug for PersistentHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PersistentHost")
            .field("dir", &self.dir.path())
            .field("started", &self.started)
            .finish_non_exhaustive()
    }
}

impl PersistentHost {
    /// Marks the regions stopped cleanly and removes this start's manifest and handler
    /// objects (the next start writes its own); the regions, their journals and their header
    /// stay for the next start. Then the directory is released.
    pub fn stop(mut self) -> Result<(), DeployError> {
        self.header.state = RegionsState::Stopped;
        self.dir.write_header(&self.header)?;
        let _ = std::fs::remove_file(self.dir.path().join(MANIFEST_FILE));
        for a in &self.manifest.apps {
            let _ = std::fs::remove_file(&a.object);
        }
        Ok(())
    }
}

/// A check of one app's re-attached regions (its kind and parameters, and its regions in its
/// spec's order): `Err` says what is inconsistent.
pub type RegionsCheck<'a> =
    &'a dyn Fn(u32, &str, &serde_json::Value, &[Arc<crate::Region>]) -> Result<(), String>;

/// Starts a host whose regions outlive it, as naam-server runs one: the directory `shm_dir`
/// locked for the process ([`DeployError::Locked`] if another server holds it); the regions
/// an earlier start left there used again when their layout is the config's (`start`),
/// after each app's unfinished write batch is undone ([`crate::journal`]) and `check`
/// passes; every write batch journaled; the header ([`RegionsHeader`]) marking them in use.
/// A start that fails removes what it made, and only that.
pub fn start_host_persistent(
    apps: Vec<HostApp>,
    config: ClusterConfig,
    shm_dir: &Path,
    start: RegionStart,
    check: RegionsCheck<'_>,
) -> Result<PersistentHost, DeployError> {
    // The manifest names files by this path, for a NIC started anywhere: absolute.
    let shm_dir = &std::path::absolute(shm_dir).map_err(file_err(shm_dir))?;
    let mut dir = ShmDir::lock(shm_dir)?;
    if let RegionStart::FromSnapshot(from) = &start {
        if let Err(e) = dir.restore_from(from) {
            dir.remove_made();
            return Err(e);
        }
    }
    let layout: Vec<String> = apps
        .iter()
        .map(|a| {
            let regions: Vec<(String, u64, u32)> = a
                .spec
                .regions
                .iter()
                .map(|r| (r.name.clone(), r.contents.len() as u64, r.access))
                .collect();
            describe_layout(a.spec.id, &a.kind, &a.params, &regions)
        })
        .collect();
    let hash = layout_hash(&layout);
    let kinds: Vec<(u32, String, serde_json::Value)> = apps
        .iter()
        .map(|a| (a.spec.id, a.kind.clone(), a.params.clone()))
        .collect();
    let earlier = dir.region_files();
    let decided = match (&start, dir.header()) {
        (RegionStart::Reset, _) => earlier
            .iter()
            .try_for_each(|f| std::fs::remove_file(f).map_err(file_err(f)))
            .map(|()| (false, false, earlier.len())),
        (_, Ok(Some(h))) if h.format == REGIONS_FORMAT && h.layout == hash => {
            Ok((true, h.state == RegionsState::Stopped, 0))
        }
        (_, Ok(Some(h))) => Err(DeployError::LayoutChanged {
            dir: shm_dir.to_path_buf(),
            found: format!("format {}: {}", h.format, h.apps.join("; ")),
            wanted: layout.join("; "),
        }),
        (_, Ok(None)) if !earlier.is_empty() => Err(DeployError::LayoutChanged {
            dir: shm_dir.to_path_buf(),
            found: format!("{} region files and no {HEADER_FILE}", earlier.len()),
            wanted: layout.join("; "),
        }),
        (_, Ok(None)) => Ok((false, false, 0)),
        (_, Err(e)) => Err(e),
    };
    // A snapshot copied in and refused goes again.
    let (reattach, clean, discarded) = match decided {
        Ok(d) => d,
        Err(e) => {
            dir.remove_made();
            return Err(e);
        }
    };
    let made = Made::default();
    let built = build_host(
        apps,
        config,
        shm_dir,
        HostRegions::SharedFiles,
        reattach,
        true,
        &made,
    );
    for f in made.take() {
        dir.made(f);
    }
    let (cluster, manifest, rolled_back) = match built {
        Ok(b) => b,
        Err(e) => {
            dir.remove_made();
            return Err(e);
        }
    };
    if reattach {
        for (id, kind, params) in &kinds {
            let regions: Vec<_> = manifest
                .app(*id)
                .map(|a| {
                    a.regions
                        .iter()
                        .filter_map(|r| cluster.regions().get(*id, r.rkey).cloned())
                        .collect()
                })
                .unwrap_or_default();
            if let Err(message) = check(*id, kind, params, &regions) {
                drop(cluster);
                dir.remove_made();
                return Err(DeployError::Inconsistent {
                    dir: shm_dir.to_path_buf(),
                    app: *id,
                    message,
                });
            }
        }
    }
    let header = RegionsHeader {
        format: REGIONS_FORMAT,
        layout: hash,
        apps: layout,
        state: RegionsState::Serving,
        pid: std::process::id(),
    };
    if let Err(e) = dir.write_header(&header) {
        drop(cluster);
        dir.remove_made();
        return Err(e);
    }
    dir.keep_made();
    let started = if reattach {
        Started::Reattached { clean, rolled_back }
    } else {
        Started::Fresh { discarded }
    };
    Ok(PersistentHost {
        cluster,
        manifest,
        started,
        dir,
        header,
    })
}

/// Files a start made, gathered from inside the cluster's backing closures.
#[derive(Clone, Default)]
struct Made(Arc<std::sync::Mutex<Vec<PathBuf>>>);

impl Made {
    fn note(&self, path: PathBuf) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(path);
    }
    fn take(&self) -> Vec<PathBuf> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A host's cluster, its manifest, and the apps whose unfinished batch its journals undid.
type Built = (Arc<Cluster>, Manifest, Vec<(u32, RolledBack)>);

/// The host's cluster over `shm_dir` (which exists) and its manifest there: regions made
/// from their specs' contents, or, `reattach`, mapped from the files an earlier start made,
/// each app's writes then under its journal there (files that outlive the process). Every
/// file made is noted in `made`. `journaled`: each app's writes under a journal there.
fn build_host(
    apps: Vec<HostApp>,
    mut config: ClusterConfig,
    shm_dir: &Path,
    kept: HostRegions,
    reattach: bool,
    journaled: bool,
    made: &Made,
) -> Result<Built, DeployError> {
    config.remote_nic = true;
    config.remote_clients = true;
    config.nic_executors = 0;
    let dir = shm_dir.to_path_buf();
    let region_path = move |app: u32, name: &str| super::shm_dir::region_file(&dir, app, name);
    let rp = region_path.clone();
    let credentials: std::collections::HashMap<u32, naam_proto::session::Credential> = apps
        .iter()
        .filter_map(|a| a.credential.clone().map(|c| (a.spec.id, c)))
        .collect();
    // Apps created at run time (`Cluster::create_app`) are not the config's: their files
    // are mapped when a record brought them back at a start, made when they are new.
    let configured: std::sync::Arc<std::collections::HashSet<u32>> =
        std::sync::Arc::new(apps.iter().map(|a| a.spec.id).collect());
    let in_config = configured.clone();
    let records = shm_dir.to_path_buf();
    let made_regions = made.clone();
    let mut builder =
        Cluster::builder()
            .config(config)
            .region_backing(Box::new(move |app, r: &RegionSpec| {
                let path = rp(app, &r.name);
                let rkey = credentials.get(&app).map(|c| c.region_key(app, &r.name));
                let fail = |e: crate::ShmError| ClusterError::Region {
                    app,
                    region: r.name.clone(),
                    message: e.to_string(),
                };
                let created = !in_config.contains(&app);
                match kept {
                    HostRegions::SharedFiles if created => {
                        // Brought back by its record: under the rkey it was created with.
                        let rkey =
                            rkey.or_else(|| super::created::recorded_rkey(&records, app, &r.name));
                        if path.exists() {
                            RegionMemory::map_shared(&path, r.contents.len())
                        } else {
                            RegionMemory::create_shared(&path, &r.contents)
                        }
                        .map(|m| (m, rkey))
                        .map_err(fail)
                    }
                    HostRegions::SharedFiles if reattach => {
                        RegionMemory::map_shared(&path, r.contents.len())
                            .map(|m| (m, rkey))
                            .map_err(fail)
                    }
                    HostRegions::SharedFiles => {
                        let m = RegionMemory::create_shared(&path, &r.contents).map_err(fail)?;
                        made_regions.note(path);
                        Ok((m, rkey))
                    }
                    HostRegions::InProcess => Ok((RegionMemory::from_bytes(&r.contents), rkey)),
                }
            }));
    let rolled_back = Arc::new(std::sync::Mutex::new(Vec::new()));
    // Regions that outlive the process (naam-server's) get journals; a test's or a
    // benchmark's throwaway files need none.
    if journaled {
        let (dir, made, rolled) = (shm_dir.to_path_buf(), made.clone(), rolled_back.clone());
        builder = builder.write_journals(Box::new(move |app, regions| {
            let path = super::shm_dir::journal_file(&dir, app);
            let fail = |message: String| ClusterError::Region {
                app,
                region: "(journal)".into(),
                message: format!("{}: {message}", path.display()),
            };
            let created = !configured.contains(&app);
            if reattach || (created && path.exists()) {
                let mem =
                    RegionMemory::map_shared(&path, JOURNAL_SIZE).map_err(|e| fail(e.to_string()))?;
                let (j, undone) = WriteJournal::open(mem, regions).map_err(|e| fail(e.to_string()))?;
                if let Some(u) = undone {
                    tracing::warn!(
                        "app {app}: undid write batch {} that the last server left unfinished ({} operations)",
                        u.batch,
                        u.entries
                    );
                    rolled.lock().unwrap_or_else(|e| e.into_inner()).push((app, u));
                }
                Ok(Some(j))
            } else {
                let mem = RegionMemory::create_shared(&path, &vec![0; JOURNAL_SIZE])
                    .map_err(|e| fail(e.to_string()))?;
                if !created {
                    made.note(path.clone());
                }
                WriteJournal::create(mem, regions)
                    .map(Some)
                    .map_err(|e| fail(e.to_string()))
            }
        }));
    }
    let mut manifest = Manifest {
        apps: Vec::new(),
        mode: super::MODE.into(),
        policy: String::new(),
        version: 0,
        epoch: crate::entropy::os()
            .nonzero_u64()
            .map_err(|e| DeployError::Manifest {
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
            if !object_path.exists() {
                made.note(object_path.clone());
            }
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
    let written = std::fs::write(&tmp, json)
        .map_err(file_err(&tmp))
        .and_then(|()| std::fs::rename(&tmp, &path).map_err(file_err(&path)));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        drop(cluster);
        return Err(e);
    }
    made.note(path);
    let rolled_back = std::mem::take(&mut *rolled_back.lock().unwrap_or_else(|e| e.into_inner()));
    Ok((cluster, manifest, rolled_back))
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
    let dir = shm_dir.to_path_buf();
    let mut builder =
        Cluster::builder()
            .config(config)
            .region_backing(Box::new(move |app, r: &RegionSpec| {
                let find = |apps: &[AppManifest]| {
                    apps.iter()
                        .find(|a| a.id == app)
                        .and_then(|a| a.regions.iter().find(|x| x.name == r.name))
                        .cloned()
                };
                // An app created after the start ([`redeploy_nic`]) is in the manifest as
                // the host wrote it since.
                let m =
                    find(&regions).or_else(|| read_manifest(&dir).ok().and_then(|m| find(&m.apps)));
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
        builder = builder.app(nic_app_spec(a, &mpath)?);
    }
    Ok((Arc::new(builder.build()?), manifest))
}

/// The spec the NIC builds app `a` of the manifest at `mpath` from: its regions mapped (the
/// backing finds them in the manifest), its handlers from its object (none for an app
/// created at run time that has no handlers yet, whose manifest names no object).
fn nic_app_spec(a: &AppManifest, mpath: &Path) -> Result<AppSpec, DeployError> {
    let object = if a.handlers.is_empty() && a.object.is_empty() {
        LoadedObject {
            programs: Vec::new(),
        }
    } else {
        load_manifest_object(a, mpath)?
    };
    Ok(AppSpec {
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
        handlers: handler_specs(a),
    })
}

/// App `a`'s handler object, as the manifest at `mpath` names it, checked against the hash
/// the host recorded.
fn load_manifest_object(a: &AppManifest, mpath: &Path) -> Result<LoadedObject, DeployError> {
    let opath = PathBuf::from(&a.object);
    let bytes = std::fs::read(&opath).map_err(file_err(&opath))?;
    if object_hash(&bytes) != a.object_hash {
        return Err(DeployError::Manifest {
            path: mpath.to_path_buf(),
            message: format!("{} changed since the host loaded it", a.object),
        });
    }
    naam_vm::load(&bytes).map_err(|e| DeployError::Manifest {
        path: opath,
        message: e.to_string(),
    })
}

/// The handlers the manifest lists for `a`, as specs to build.
fn handler_specs(a: &AppManifest) -> Vec<HandlerSpec> {
    a.handlers.iter().map(spec_of).collect()
}

/// A read (or, `write`, a write) handler named `name`, with the defaults.
pub(crate) fn spec_named(name: &str, write: bool) -> HandlerSpec {
    if write {
        HandlerSpec::write(name)
    } else {
        HandlerSpec::read(name)
    }
}

/// The spec a manifest's handler entry was built from.
pub(crate) fn spec_of(h: &HandlerManifest) -> HandlerSpec {
    spec_named(&h.name, h.write)
        .engine(h.engine)
        .budget(h.budget)
}

/// Takes up on the NIC's `cluster` the deploys the host made since `served` (the manifest
/// the NIC's handlers come from): reads the manifest in `shm_dir` again and deploys each app
/// whose object or handlers changed. Returns the manifest now served; one of another server
/// start is refused (the NIC remaps instead). An app that fails leaves the ones before it
/// deployed, and the returned error: the caller tries again, and the host forwards none of
/// that app's requests meanwhile.
pub fn redeploy_nic(
    shm_dir: &Path,
    cluster: &Cluster,
    served: &Manifest,
) -> Result<Manifest, DeployError> {
    let manifest = read_manifest(shm_dir)?;
    let mpath = shm_dir.join(MANIFEST_FILE);
    if manifest.epoch != served.epoch {
        return Err(DeployError::Manifest {
            path: mpath,
            message: "the manifest is of another server start: the regions must be mapped anew"
                .into(),
        });
    }
    for a in &manifest.apps {
        let before = served.app(a.id);
        let same =
            before.is_some_and(|b| b.object_hash == a.object_hash && b.handlers == a.handlers);
        if same {
            continue;
        }
        let result = if before.is_none() && cluster.registry().app(a.id).is_none() {
            // Created at run time: its regions mapped from the files the host made.
            nic_app_spec(a, &mpath).and_then(|spec| {
                cluster
                    .create_app(&spec)
                    .map_err(|e| DeployError::Manifest {
                        path: mpath.clone(),
                        message: format!("app {}: {e}", a.id),
                    })
            })?;
            continue;
        } else if a.handlers.is_empty() {
            cluster.undeploy(a.id)
        } else {
            let object = load_manifest_object(a, &mpath)?;
            cluster.deploy(a.id, &object, &handler_specs(a))
        };
        result.map_err(|e| DeployError::Manifest {
            path: mpath.clone(),
            message: format!("app {}: {e}", a.id),
        })?;
    }
    Ok(manifest)
}

/// Removes what [`start_host`] created in `shm_dir` (regions, objects, manifest), and the
/// directory itself when nothing else is in it.
pub fn cleanup(shm_dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(shm_dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = name == MANIFEST_FILE
                || (name.starts_with("app") && name.ends_with(".region"))
                || (name.starts_with("object-") && name.ends_with(".o"))
                || (name.starts_with("deployed-app") && name.ends_with(".json"))
                || (name.starts_with("created-app") && name.ends_with(".json"));
            if ours {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(shm_dir);
}
