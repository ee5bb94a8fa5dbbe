//! Apps and their handlers. Messages name a handler by a stable 32-bit id derived from its name
//! (FNV-1a), so clients and servers in different processes agree without a lookup.
//!
//! A [`Registry`] is a value: a deploy at run time builds the new handlers apart
//! ([`Registry::build_handlers`]) and makes a new registry with them ([`Registry::with_handlers`],
//! which shares every other app with the old one); the cluster swaps the whole registry in
//! one store, so a call that looked its handler up on the old one finishes on it.

use std::sync::Arc;

use crate::intmap::IntMap;
use naam_proto::EngineKind;
use naam_proto::Placement;
use naam_vm::LoadedObject;
use naam_vm::VerifierConfig;
use naam_vm::{CodeCache, EngineError, ExecOptions, Executable, DEFAULT_BUDGET};

use naam_proto::handler_id;

use naam_proto::step::HandlerKind;

/// A registered handler: verified and built for its engine, shared by every executor.
#[derive(Debug)]
pub struct HandlerEntry {
    /// Name in the object (section `naam/<name>`); unique within its app.
    pub name: String,
    /// [`handler_id`] of the name (FNV-1a): the id messages carry.
    pub id: u32,
    /// Id of the app it was registered for.
    pub app: u32,
    /// Read or write.
    pub kind: HandlerKind,
    /// The verified handler, built for its engine with its instruction budget.
    pub exe: Executable,
}

impl HandlerEntry {
    /// Bytes of its linked bytecode (what a tenant's code quota counts).
    pub fn code_bytes(&self) -> usize {
        self.exe.program().code.len()
    }
}

/// A registered app: its handlers by wire id, and where its writes are applied.
#[derive(Clone, Debug)]
pub struct AppEntry {
    /// App id requests carry; unique in the registry.
    pub id: u32,
    /// Name from its spec (`mica`, `btree`, an object app's configured name); not unique:
    /// instances of one app share it.
    pub name: String,
    /// Handlers by id.
    pub handlers: IntMap<u32, Arc<HandlerEntry>>,
    /// Placement that applies this app's writes.
    pub owner: Placement,
    /// The registry version its handlers were last set at: 0 for those of the start, else
    /// the [`Registry::version`] the deploy that set them made.
    pub version: u64,
}

/// Why a registration failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The app id is taken.
    #[error("app {0} is already registered")]
    DuplicateApp(u32),
    /// No such app.
    #[error("no app {0}")]
    UnknownApp(u32),
    /// The object has no handler of that name.
    #[error(transparent)]
    Load(#[from] naam_vm::LoadError),
    /// The handler does not verify or cannot use the engine.
    #[error("handler `{name}`: {source}")]
    Handler {
        /// The handler's name.
        name: String,
        /// What the verifier or the engine found.
        source: EngineError,
    },
    /// Two names hash to the same id, or a name is registered twice.
    #[error("handler `{name}` collides with `{other}` (id {id:#010x})")]
    Collision {
        /// The name being registered.
        name: String,
        /// The name already registered under `id`.
        other: String,
        /// The [`handler_id`] both names map to.
        id: u32,
    },
    /// A write owner that cannot write.
    #[error("the client cannot own writes")]
    ClientOwner,
}

/// How to register one handler ([`HandlerSpec::read`] or [`HandlerSpec::write`], then
/// [`HandlerSpec::engine`] and [`HandlerSpec::budget`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct HandlerSpec {
    /// Name in the object.
    pub name: String,
    /// Read or write.
    pub kind: HandlerKind,
    /// Engine (the memory-checked JIT unless asked otherwise; every handler may use it).
    pub engine: EngineKind,
    /// Instructions one step may run before it faults with `budget exhausted`.
    pub budget: u64,
}

impl HandlerSpec {
    /// A read-only handler on the JIT with the default budget.
    pub fn read(name: &str) -> Self {
        HandlerSpec {
            name: name.into(),
            kind: HandlerKind::Read,
            engine: EngineKind::Jit,
            budget: DEFAULT_BUDGET,
        }
    }

    /// A write handler on the JIT with the default budget.
    pub fn write(name: &str) -> Self {
        HandlerSpec {
            kind: HandlerKind::Write,
            ..HandlerSpec::read(name)
        }
    }

    /// The same handler on another engine.
    pub fn engine(mut self, engine: EngineKind) -> Self {
        self.engine = engine;
        self
    }

    /// The same handler with another instruction budget per step.
    pub fn budget(mut self, budget: u64) -> Self {
        self.budget = budget;
        self
    }
}

/// Every app of one server. Cloning copies pointers only (apps and handlers are shared): a
/// deploy clones, changes one app and publishes the copy.
#[derive(Clone, Debug, Default)]
pub struct Registry {
    apps: IntMap<u32, Arc<AppEntry>>,
    /// Every app's handlers by (app, handler id), the same entries as the apps': a message's
    /// lookup is one probe, not two maps and an app entry on the way (at thousands of apps
    /// each is a cache miss).
    by_key: IntMap<(u32, u32), Arc<HandlerEntry>>,
    /// Where its handlers' compiled code is shared and kept (the process's cache unless set).
    code_cache: Option<Arc<CodeCache>>,
    /// Bumped by every [`Registry::with_handlers`]: 0 as the server started.
    version: u64,
}

/// Handlers built for one app and not registered yet ([`Registry::build_handlers`]).
pub type BuiltHandlers = IntMap<u32, Arc<HandlerEntry>>;

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry whose handlers' code comes from, and goes to, `cache`.
    pub fn with_code_cache(cache: Arc<CodeCache>) -> Self {
        Registry {
            code_cache: Some(cache),
            ..Registry::default()
        }
    }

    /// Adds an app whose writes are applied at `owner`.
    pub fn add_app(&mut self, id: u32, name: &str, owner: Placement) -> Result<(), RegistryError> {
        if owner == Placement::Client {
            return Err(RegistryError::ClientOwner);
        }
        if self.apps.contains_key(&id) {
            return Err(RegistryError::DuplicateApp(id));
        }
        self.apps.insert(
            id,
            Arc::new(AppEntry {
                id,
                name: name.into(),
                handlers: IntMap::default(),
                owner,
                version: 0,
            }),
        );
        Ok(())
    }

    /// Verifies and registers handlers of `object` for `app`, beside those it has; returns
    /// their ids.
    pub fn add_handlers(
        &mut self,
        app: u32,
        object: &LoadedObject,
        specs: &[HandlerSpec],
        config: &VerifierConfig,
    ) -> Result<Vec<u32>, RegistryError> {
        let existing = &self
            .apps
            .get(&app)
            .ok_or(RegistryError::UnknownApp(app))?
            .handlers;
        let built = self.build_handlers(app, object, specs, config, existing)?;
        let entry = Arc::make_mut(
            self.apps
                .get_mut(&app)
                .ok_or(RegistryError::UnknownApp(app))?,
        );
        let ids = specs.iter().map(|s| handler_id(&s.name)).collect();
        for (id, h) in &built {
            self.by_key.insert((app, *id), h.clone());
        }
        entry.handlers.extend(built);
        Ok(ids)
    }

    /// Verifies and builds handlers of `object` for `app` (which need not be registered yet)
    /// without registering them, on this registry's code cache: a deploy builds them apart,
    /// then publishes [`Registry::with_handlers`]. Names colliding among `specs`, or with
    /// `beside` (the handlers they will join), are refused.
    pub fn build_handlers(
        &self,
        app: u32,
        object: &LoadedObject,
        specs: &[HandlerSpec],
        config: &VerifierConfig,
        beside: &BuiltHandlers,
    ) -> Result<BuiltHandlers, RegistryError> {
        let mut built: BuiltHandlers = IntMap::default();
        for spec in specs {
            let program = object.get(&spec.name)?;
            let mut options = ExecOptions::new(spec.engine, spec.budget);
            options.verifier = config.clone();
            if let Some(cache) = &self.code_cache {
                options.code_cache = cache.clone();
            }
            let id = handler_id(&spec.name);
            if let Some(other) = built.get(&id).or_else(|| beside.get(&id)) {
                return Err(RegistryError::Collision {
                    name: spec.name.clone(),
                    other: other.name.clone(),
                    id,
                });
            }
            let exe =
                Executable::build(program, &options).map_err(|source| RegistryError::Handler {
                    name: spec.name.clone(),
                    source,
                })?;
            built.insert(
                id,
                Arc::new(HandlerEntry {
                    name: spec.name.clone(),
                    id,
                    app,
                    kind: spec.kind,
                    exe,
                }),
            );
        }
        Ok(built)
    }

    /// This registry with `app`'s handlers replaced by `handlers` (none: the app stays,
    /// with nothing to call), at the next [`Registry::version`]; every other app is shared.
    pub fn with_handlers(
        &self,
        app: u32,
        handlers: BuiltHandlers,
    ) -> Result<Registry, RegistryError> {
        let old = self.apps.get(&app).ok_or(RegistryError::UnknownApp(app))?;
        let mut next = self.clone();
        next.version = self.version + 1;
        for id in old.handlers.keys() {
            next.by_key.remove(&(app, *id));
        }
        for (id, h) in &handlers {
            next.by_key.insert((app, *id), h.clone());
        }
        next.apps.insert(
            app,
            Arc::new(AppEntry {
                handlers,
                version: next.version,
                ..AppEntry::clone(old)
            }),
        );
        Ok(next)
    }

    /// Its version: 0 as the server started, one more per [`Registry::with_handlers`].
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The app with id `app`, if registered.
    pub fn app(&self, app: u32) -> Option<&AppEntry> {
        self.apps.get(&app).map(|a| &**a)
    }

    /// Every registered app, in no particular order.
    pub fn apps(&self) -> impl Iterator<Item = &AppEntry> {
        self.apps.values().map(|a| &**a)
    }

    /// The handler, if both app and handler exist.
    pub fn handler(&self, app: u32, handler: u32) -> Result<&Arc<HandlerEntry>, LookupError> {
        match self.by_key.get(&(app, handler)) {
            Some(h) => Ok(h),
            None if self.apps.contains_key(&app) => {
                Err(LookupError::UnknownHandler { app, handler })
            }
            None => Err(LookupError::UnknownApp(app)),
        }
    }
}

/// Why a message's app or handler does not exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
    /// No such app.
    #[error("no app {0}")]
    UnknownApp(u32),
    /// No such handler.
    #[error("app {app} has no handler {handler:#010x}")]
    UnknownHandler {
        /// The app the message named; it exists, the handler does not.
        app: u32,
        /// The handler id the message carried ([`handler_id`] of a name).
        handler: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apps_and_lookups() {
        let mut r = Registry::new();
        r.add_app(1, "one", Placement::Host).unwrap();
        assert!(matches!(
            r.add_app(1, "again", Placement::Host),
            Err(RegistryError::DuplicateApp(1))
        ));
        assert!(matches!(
            r.add_app(2, "c", Placement::Client),
            Err(RegistryError::ClientOwner)
        ));
        assert_eq!(r.handler(9, 1).unwrap_err(), LookupError::UnknownApp(9));
        assert_eq!(
            r.handler(1, 7).unwrap_err(),
            LookupError::UnknownHandler { app: 1, handler: 7 }
        );
    }
}
