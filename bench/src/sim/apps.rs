//! The apps a simulation serves (MICA tables or B-trees, one tenant each) and their clients:
//! each client runs the app's own pipelined client library (`MicaPipeline`, `BTreePipeline`)
//! over the simulation's transport, so operations are built, retried and read exactly as a
//! deployment's clients do.

use std::sync::Arc;

use anyhow::Context as _;
use naam_btree::{BTreeConfig, BTreeHandle, BTreePipeline};
use naam_mica::{MicaConfig, MicaHandle, MicaPipeline};
use naam_runtime::cluster::Cluster;
use naam_runtime::proto::session::Credential;
use naam_runtime::proto::{EngineKind, Placement};
use naam_runtime::udp::HostApp;

use super::backends::SimTransport;
use crate::driver::App;
use crate::ycsb::{KeyNaming, RecordShape, Rng};

/// One app of the simulated server, and what its clients need to reach it.
pub(super) struct SimApp {
    pub id: u32,
    pub tenant: String,
    pub credential: Credential,
    /// Records its clients load.
    pub records: u64,
    geometry: Geometry,
}

#[derive(Clone, Copy)]
enum Geometry {
    Mica(MicaConfig),
    Btree(BTreeConfig),
}

impl SimApp {
    /// App `id` of `kind` for `records` records, of which one server holds about `per_server`
    /// (its table is sized for them), its handlers on the interpreter (whose instruction
    /// counts the cost model reads), and what naam-server is given of it.
    pub(super) fn new(
        kind: App,
        id: u32,
        (records, per_server): (u64, u64),
        shape: &RecordShape,
        credential: Credential,
    ) -> anyhow::Result<(SimApp, HostApp)> {
        let room = per_server.saturating_mul(2).max(1_000);
        let (geometry, host) = match kind {
            App::Mica => {
                let mc = MicaConfig::sized(room, 24, shape.len());
                let object = Arc::new(naam_mica::handlers().context("MICA's embedded handlers")?);
                let spec = naam_mica::app_spec(id, &mc, object, Placement::Host)?
                    .with_engine(EngineKind::Interp);
                let host = HostApp {
                    spec,
                    kind: "mica".into(),
                    params: serde_json::to_value(mc)?,
                    object_bytes: naam_mica::HANDLERS_OBJECT.to_vec(),
                    client_writes: false,
                    credential: Some(credential.clone()),
                };
                (Geometry::Mica(mc), host)
            }
            App::Btree => {
                let bc = BTreeConfig::for_keys(room);
                let object =
                    Arc::new(naam_btree::handlers().context("the B-tree's embedded handlers")?);
                let spec = naam_btree::app_spec(id, &bc, object, Placement::Host)?
                    .with_engine(EngineKind::Interp);
                let host = HostApp {
                    spec,
                    kind: "btree".into(),
                    params: serde_json::to_value(bc)?,
                    object_bytes: naam_btree::HANDLERS_OBJECT.to_vec(),
                    client_writes: false,
                    credential: Some(credential.clone()),
                };
                (Geometry::Btree(bc), host)
            }
        };
        let app = SimApp {
            id,
            tenant: format!("{}-{id}", kind.kind()),
            credential,
            records,
            geometry,
        };
        Ok((app, host))
    }

    /// A client's pipeline of this app over `transport`.
    pub(super) fn pipe(&self, cluster: &Cluster, transport: SimTransport) -> anyhow::Result<Pipe> {
        Ok(match self.geometry {
            Geometry::Mica(mc) => Pipe::Mica(MicaPipeline::new(
                transport,
                MicaHandle::from_cluster(cluster, self.id, mc)
                    .context("MICA's regions in the manifest")?,
            )),
            Geometry::Btree(bc) => Pipe::Btree(BTreePipeline::new(
                transport,
                BTreeHandle::from_cluster(cluster, self.id, bc)
                    .context("the B-tree's regions in the manifest")?,
            )),
        })
    }
}

/// A client's operations in flight on its app.
pub(super) enum Pipe {
    Mica(MicaPipeline<SimTransport>),
    Btree(BTreePipeline<SimTransport>),
}

impl Pipe {
    pub(super) fn in_flight(&self) -> usize {
        match self {
            Pipe::Mica(p) => p.in_flight(),
            Pipe::Btree(p) => p.in_flight(),
        }
    }

    /// Starts a read of record `n`.
    pub(super) fn read(&mut self, tag: u64, n: u64, naming: &KeyNaming) -> Result<(), String> {
        match self {
            Pipe::Mica(p) => p
                .get(tag, naming.name(n).as_bytes())
                .map_err(|e| e.to_string()),
            Pipe::Btree(p) => p.get(tag, btree_key(naming, n)).map_err(|e| e.to_string()),
        }
    }

    /// Starts a write of record `n` (a load's insert, or an update), with a fresh value.
    pub(super) fn write(
        &mut self,
        tag: u64,
        n: u64,
        naming: &KeyNaming,
        shape: &RecordShape,
        rng: &mut Rng,
    ) -> Result<(), String> {
        match self {
            Pipe::Mica(p) => p
                .put(tag, naming.name(n).as_bytes(), &shape.record(rng))
                .map_err(|e| e.to_string()),
            Pipe::Btree(p) => p
                .insert(tag, btree_key(naming, n), rng.next_u64() >> 1)
                .map_err(|e| e.to_string()),
        }
    }

    /// The operations that finished since the last poll, by tag.
    pub(super) fn poll(&mut self) -> Vec<(u64, Result<(), String>)> {
        match self {
            Pipe::Mica(p) => p
                .poll(false)
                .into_iter()
                .map(|(t, r)| (t, r.map(|_| ()).map_err(|e| e.to_string())))
                .collect(),
            Pipe::Btree(p) => p
                .poll(false)
                .into_iter()
                .map(|(t, r)| (t, r.map(|_| ()).map_err(|e| e.to_string())))
                .collect(),
        }
    }
}

/// The B-tree's key for record `n`: the record's number as YCSB names it, kept clear of the
/// tree's reserved top key.
fn btree_key(naming: &KeyNaming, n: u64) -> u64 {
    naming.number(n) >> 1
}
