//! Handlers deployed at run time: a tenant's new object verified and built beside the serving
//! handlers, then published in one registry swap ([`Cluster::deploy`]), or an app's handlers
//! taken away ([`Cluster::undeploy`]). A call admitted before the swap holds the handler it
//! was routed with and finishes on it; every call admitted after runs the new one. An app
//! the cluster did not start with is created the same way ([`Cluster::create_app`]): its
//! regions and state first, then its handlers in one swap.

use std::sync::Arc;
use std::time::Duration;

use naam_proto::step::HandlerKind;
use naam_proto::EngineKind;
use naam_vm::LoadedObject;

use super::{register_region, AppSpec, AppState, Cluster, ClusterError};
use crate::intmap::IntMap;
use crate::registry::{BuiltHandlers, HandlerEntry};
use crate::HandlerSpec;
use naam_proto::limits::MAX_CREATED_APP_REGIONS;

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

    /// Creates app `spec` while the cluster serves: its regions (memory from the builder's
    /// region backing), its write journal (from its journal backing, if it has one), its
    /// write ownership and budgets, and then its handlers, published in one registry swap.
    /// Refused, with nothing changed, when the id is taken, the cluster has made room for no
    /// more apps ([`super::ClusterConfig::run_time_apps`]), the app has more than
    /// [`MAX_CREATED_APP_REGIONS`] regions, a handler does not verify or a backing fails
    /// before the first region is in. A journal backing that fails after the regions are in
    /// leaves them in the table, bound to an app that has no state: no message reaches
    /// them, and their id can be created again. Serialized with deploys.
    pub fn create_app(&self, spec: &AppSpec) -> Result<Deployed, ClusterError> {
        let inner = &*self.inner;
        let app = spec.id;
        let no_room = |why: String| ClusterError::NoRoom { app, why };
        let mut backings = inner.deploying.lock().unwrap_or_else(|e| e.into_inner());
        let current = inner.registry.load_full();
        if current.app(app).is_some() || inner.apps.contains_key(app) {
            return Err(ClusterError::AppExists(app));
        }
        if inner.config.remote_nic && spec.owner == naam_proto::Placement::Nic {
            return Err(ClusterError::Config(
                "with a remote NIC, writes are owned by the host (owner = host)".into(),
            ));
        }
        if inner.apps.len() >= inner.apps.capacity() {
            return Err(no_room(format!(
                "the cluster holds as many apps as it has room for ({})",
                inner.apps.capacity()
            )));
        }
        if spec.regions.len() > MAX_CREATED_APP_REGIONS {
            return Err(no_room(format!(
                "{} regions, more than the {MAX_CREATED_APP_REGIONS} an app created at run \
                 time may have",
                spec.regions.len()
            )));
        }
        if inner.regions.len() + spec.regions.len() > inner.regions.capacity() {
            return Err(no_room(format!(
                "the region table holds {} of {} regions",
                inner.regions.len(),
                inner.regions.capacity()
            )));
        }
        let mut names: Vec<&str> = spec.regions.iter().map(|r| r.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(ClusterError::Region {
                app,
                region: w[0].to_string(),
                message: "two regions of the app have this name".into(),
            });
        }
        // The handlers first: a program the verifier refuses changes nothing.
        let mut with_app = (*current).clone();
        with_app.add_app(app, &spec.name, spec.owner)?;
        let verifier = &inner.config.verifier;
        let built = with_app.build_handlers(
            app,
            &spec.object,
            &spec.handlers,
            verifier,
            &IntMap::default(),
        )?;
        let reports = spec
            .handlers
            .iter()
            .filter_map(|s| built.get(&naam_proto::handler_id(&s.name)))
            .map(|h| DeployedHandler::of(h))
            .collect();
        // Every region's memory before any region is in; then no registration can fail: the
        // keys asked for are checked free, and only this lock's holder registers.
        let mut backed = Vec::with_capacity(spec.regions.len());
        for r in &spec.regions {
            backed.push((backings.regions)(app, r)?);
        }
        let mut asked: Vec<u64> = backed.iter().filter_map(|(_, k)| *k).collect();
        asked.sort_unstable();
        if let Some(&k) = asked
            .iter()
            .find(|&&k| k == 0 || inner.regions.contains_key(k))
            .or_else(|| asked.windows(2).find(|w| w[0] == w[1]).map(|w| &w[0]))
        {
            return Err(ClusterError::Region {
                app,
                region: String::new(),
                message: format!("rkey {k:#x} is 0 or already in use"),
            });
        }
        let mut keys = Vec::with_capacity(spec.regions.len());
        let mut mine = Vec::with_capacity(spec.regions.len());
        for (r, b) in spec.regions.iter().zip(backed) {
            let region = register_region(&inner.regions, app, r, b)?;
            keys.push((r.name.clone(), region.rkey));
            mine.push(region);
        }
        let journal = match &mut backings.journals {
            Some(backing) => backing(app, mine)?,
            None => None,
        };
        if inner
            .apps
            .insert(app, AppState::new(spec, keys, journal))
            .is_err()
        {
            return Err(no_room("the app table is full".into()));
        }
        let next = with_app.with_handlers(app, built)?;
        let version = next.version();
        inner.registry.store(Arc::new(next));
        Ok(Deployed {
            app,
            version,
            handlers: reports,
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
