//! Apps tenants created while naam-server ran ([`naam_proto::control::Control::CreateApp`]),
//! as recorded beside the regions (`created-app<id>.json` in `shm_dir`): who owns each, its
//! name and its regions. The record is written before the tenant is answered, so an app a
//! tenant was told exists is there after any restart; the next start creates it again over
//! its region files ([`restore_created_apps`]), before the deploys into it are served again.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cluster::{AppSpec, Cluster, RegionSpec};
use naam_proto::control::{AppManifest, Manifest, NewRegion, RegionManifest};
use naam_proto::session::{grant_app, TenantEntry};
use naam_proto::Placement;
use naam_vm::LoadedObject;
use serde::{Deserialize, Serialize};

/// One created app, as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreatedRecord {
    /// Its id.
    pub(crate) app: u32,
    /// Its name.
    pub(crate) name: String,
    /// The tenant it was created for (the name that tenant's hello gave).
    pub(crate) owner: String,
    /// Its regions, as the tenant asked for them.
    pub(crate) regions: Vec<NewRegion>,
    /// The rkey each region was given when the app was created (by name): a restart gives
    /// the same, so that clients' descriptors stay valid.
    #[serde(default)]
    pub(crate) rkeys: Vec<(String, u64)>,
}

/// The rkey `app`'s region `name` was created with, as its record in `shm_dir` says
/// (`None`: no record, an app being created now).
pub(crate) fn recorded_rkey(shm_dir: &Path, app: u32, name: &str) -> Option<u64> {
    let bytes = std::fs::read(created_path(shm_dir, app)).ok()?;
    let r: CreatedRecord = serde_json::from_slice(&bytes).ok()?;
    r.rkeys.iter().find(|(n, _)| n == name).map(|(_, k)| *k)
}

impl CreatedRecord {
    /// Bytes of its regions together.
    pub(crate) fn region_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.len).sum()
    }

    /// The spec the cluster creates it from: its regions zeroed (or mapped from their files,
    /// which the host's region backing does for an app not in the config), no handlers.
    pub(crate) fn spec(&self) -> AppSpec {
        AppSpec {
            id: self.app,
            name: self.name.clone(),
            owner: Placement::Host,
            regions: self
                .regions
                .iter()
                .map(|r| RegionSpec {
                    name: r.name.clone(),
                    access: r.access,
                    contents: vec![0; r.len as usize],
                })
                .collect(),
            object: Arc::new(LoadedObject {
                programs: Vec::new(),
            }),
            handlers: Vec::new(),
        }
    }

    /// Its manifest entry, with the rkeys `cluster` gave its regions.
    pub(crate) fn manifest_entry(&self, cluster: &Cluster, shm_dir: &Path) -> AppManifest {
        AppManifest {
            id: self.app,
            name: self.name.clone(),
            kind: "object".into(),
            params: serde_json::Value::Null,
            object: String::new(),
            object_hash: 0,
            handlers: Vec::new(),
            regions: self
                .regions
                .iter()
                .map(|r| RegionManifest {
                    name: r.name.clone(),
                    rkey: cluster.region_key(self.app, &r.name).unwrap_or(0),
                    access: r.access,
                    client_access: r.access & naam_ebpf::abi::ACCESS_READ,
                    len: r.len,
                    path: Some(
                        super::shm_dir::region_file(shm_dir, self.app, &r.name)
                            .display()
                            .to_string(),
                    ),
                })
                .collect(),
        }
    }
}

/// The record of created app `app` in `shm_dir`.
pub(crate) fn created_path(shm_dir: &Path, app: u32) -> PathBuf {
    shm_dir.join(format!("created-app{app}.json"))
}

/// Every record in `shm_dir`, by ascending id: each read, or why it could not be.
pub(crate) fn created_records(shm_dir: &Path) -> Vec<(u32, Result<CreatedRecord, String>)> {
    let Ok(entries) = std::fs::read_dir(shm_dir) else {
        return Vec::new();
    };
    let mut out: Vec<(u32, Result<CreatedRecord, String>)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let id: u32 = name
                .strip_prefix("created-app")?
                .strip_suffix(".json")?
                .parse()
                .ok()?;
            let path = e.path();
            let read = std::fs::read(&path)
                .map_err(|e| format!("{}: {e}", path.display()))
                .and_then(|b| {
                    serde_json::from_slice::<CreatedRecord>(&b)
                        .map_err(|e| format!("{}: {e}", path.display()))
                })
                .and_then(|r| {
                    if r.app == id {
                        Ok(r)
                    } else {
                        Err(format!("{} names app {}", path.display(), r.app))
                    }
                });
            Some((id, read))
        })
        .collect();
    out.sort_by_key(|(id, _)| *id);
    out
}

/// How many apps the records in `shm_dir` hold: the room a start makes for apps created at
/// run time must take them as well as the new ones its config allows.
pub fn created_app_count(shm_dir: &Path) -> usize {
    created_records(shm_dir).len()
}

/// Creates again, on a server start, the apps tenants created before (the records in
/// `shm_dir`), over their region files, and adds them to `manifest` and to their owners'
/// credentials in `tenants`. A record whose owner the config no longer has, or that cannot
/// be read or created, is left where it is (its files too: nothing is deleted that held a
/// tenant's data) and logged; its id is not given to another app. Returns what was done,
/// one line each, for the log.
pub fn restore_created_apps(
    cluster: &Cluster,
    manifest: &mut Manifest,
    tenants: &mut Vec<TenantEntry>,
    shm_dir: &Path,
) -> Vec<String> {
    let mut done = Vec::new();
    for (id, record) in created_records(shm_dir) {
        let r = match record {
            Ok(r) => r,
            Err(why) => {
                done.push(format!("created app {id} is not served: {why}"));
                continue;
            }
        };
        if !tenants.iter().any(|t| t.name == r.owner) {
            done.push(format!(
                "created app {id} ({}) is not served: its tenant {} is not in the config \
                 (its record and regions are kept in {})",
                r.name,
                r.owner,
                shm_dir.display()
            ));
            continue;
        }
        if manifest.apps.iter().any(|a| a.id == id || a.name == r.name) {
            done.push(format!(
                "created app {id} ({}) is not served: the config has an app of that id or name",
                r.name
            ));
            continue;
        }
        match cluster.create_app(&r.spec()) {
            Ok(d) => {
                manifest.apps.push(r.manifest_entry(cluster, shm_dir));
                manifest.version = manifest.version.max(d.version);
                grant_app(tenants, &r.owner, id, &r.name);
                done.push(format!(
                    "created app {id} ({}) of tenant {} served again over its regions",
                    r.name, r.owner
                ));
            }
            Err(e) => done.push(format!("created app {id} ({}) is not served: {e}", r.name)),
        }
    }
    done
}

/// Forgets the apps tenants created, with their regions and journals (a start with new
/// regions: they go with the others').
pub(crate) fn forget_created(shm_dir: &Path) {
    for (id, record) in created_records(shm_dir) {
        if let Ok(r) = record {
            for region in &r.regions {
                let _ =
                    std::fs::remove_file(super::shm_dir::region_file(shm_dir, id, &region.name));
            }
        }
        let _ = std::fs::remove_file(super::shm_dir::journal_file(shm_dir, id));
        let _ = std::fs::remove_file(created_path(shm_dir, id));
    }
}

/// Removes what files an earlier app of id `app` may have left in `shm_dir` (its regions
/// and journal), before an app is created under that id: none of its bytes reach the new
/// app.
pub(crate) fn clear_leftovers(shm_dir: &Path, app: u32) {
    let prefix = format!("app{app}-");
    if let Ok(entries) = std::fs::read_dir(shm_dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && name.ends_with(".region") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_file(super::shm_dir::journal_file(shm_dir, app));
}
