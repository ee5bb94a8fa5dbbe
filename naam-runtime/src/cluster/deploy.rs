//! Handlers deployed at run time: a tenant's new object verified and built beside the serving
//! handlers, then published in one registry swap ([`Cluster::deploy`]), or an app's handlers
//! taken away ([`Cluster::undeploy`]). A call admitted before the swap holds the handler it
//! was routed with and finishes on it; every call admitted after runs the new one.

use std::sync::Arc;
use std::time::Duration;

use naam_proto::step::HandlerKind;
use naam_proto::EngineKind;
use naam_vm::LoadedObject;

use super::{Cluster, ClusterError};
use crate::intmap::IntMap;
use crate::registry::{BuiltHandlers, HandlerEntry};
use crate::HandlerSpec;

/// One handler a deploy made callable, with the verifier's report on it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeployedHandler {
    /// Its name in the object.
    pub name: String,
    /// Its wire id ([`naam_proto::handler_id`] of the name).
    pub id: u32,
    /// Read or write.
    pub kind: HandlerKind,
    /// The engine it was built for (a tiered handler answers on the interpreter until its
    /// background compile is done).
    pub engine: EngineKind,
    /// Instructions per step before `budget exhausted`.
    pub budget: u64,
    /// Instruction slots in the linked program.
    pub insns: usize,
    /// Bytes of its bytecode (what a code quota counts).
    pub code_bytes: usize,
    /// Functions, the entry included.
    pub functions: usize,
    /// Distinct helpers it calls.
    pub helpers: usize,
    /// Backward jumps (loops, metered by the budget).
    pub backward_jumps: usize,
    /// Memory accesses the analysis proved in bounds (they run unchecked), hinted, and
    /// checked at run time.
    pub accesses: [usize; 3],
    /// Verification and building, until it could answer.
    pub build: Duration,
}

impl DeployedHandler {
    fn of(h: &HandlerEntry) -> DeployedHandler {
        let verdict = h.exe.verdict();
        let facts = h.exe.facts();
        DeployedHandler {
            name: h.name.clone(),
            id: h.id,
            kind: h.kind,
            engine: h.exe.engine(),
            budget: h.exe.budget(),
            insns: verdict.insns,
            code_bytes: h.code_bytes(),
            functions: verdict.functions,
            helpers: verdict.helpers.len(),
            backward_jumps: verdict.backward_jumps,
            accesses: [facts.proven, facts.hinted, facts.scanned],
            build: h.exe.compile_time(),
        }
    }
}

/// What a deploy or undeploy published.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Deployed {
    /// The app.
    pub app: u32,
    /// The registry version now serving ([`crate::Registry::version`]).
    pub version: u64,
    /// The app's handlers now, in the order the deploy named them (none after an undeploy).
    pub handlers: Vec<DeployedHandler>,
}

impl Cluster {
    /// Verifies and builds `specs` of `object` for `app` (an app this cluster has), then makes
    /// them the app's handlers in one swap: the handlers it had and `specs` does not name are
    /// no longer callable. Nothing changes if one handler fails: the error names it, with
    /// what the verifier or engine found. Calls already admitted finish on the handlers they
    /// were admitted with. Deploys are serialized; building runs on the caller's thread and
    /// shares compiled code through the cluster's code cache.
    pub fn deploy(
        &self,
        app: u32,
        object: &LoadedObject,
        specs: &[HandlerSpec],
    ) -> Result<Deployed, ClusterError> {
        let verifier = &self.inner.config.verifier;
        self.publish(app, |current| {
            let built = current.build_handlers(app, object, specs, verifier, &IntMap::default())?;
            let reports = specs
                .iter()
                .filter_map(|s| built.get(&naam_proto::handler_id(&s.name)))
                .map(|h| DeployedHandler::of(h))
                .collect();
            Ok((built, reports))
        })
    }

    /// Takes every handler of `app` away (the app and its regions stay): its messages are
    /// answered `UnknownHandler` from now on; calls already admitted finish.
    pub fn undeploy(&self, app: u32) -> Result<Deployed, ClusterError> {
        self.publish(app, |_| Ok((BuiltHandlers::default(), Vec::new())))
    }

    /// Makes `app`'s handlers what `make` builds from the current registry, in one swap,
    /// one deploy at a time; nothing is published if `make` fails.
    fn publish(
        &self,
        app: u32,
        make: impl FnOnce(
            &crate::Registry,
        ) -> Result<(BuiltHandlers, Vec<DeployedHandler>), ClusterError>,
    ) -> Result<Deployed, ClusterError> {
        let inner = &*self.inner;
        let _one_at_a_time = inner.deploying.lock().unwrap_or_else(|e| e.into_inner());
        let current = inner.registry.load_full();
        if current.app(app).is_none() {
            return Err(ClusterError::UnknownApp(app));
        }
        let (built, handlers) = make(&current)?;
        let next = current.with_handlers(app, built)?;
        let version = next.version();
        inner.registry.store(Arc::new(next));
        Ok(Deployed {
            app,
            version,
            handlers,
        })
    }

    /// The handlers `app` serves now, with their reports (`None`: no such app).
    pub fn deployed(&self, app: u32) -> Option<Vec<DeployedHandler>> {
        let registry = self.inner.registry.load();
        let a = registry.app(app)?;
        let mut v: Vec<DeployedHandler> = a
            .handlers
            .values()
            .map(|h: &Arc<HandlerEntry>| DeployedHandler::of(h))
            .collect();
        v.sort_by(|x, y| x.name.cmp(&y.name));
        Some(v)
    }
}
