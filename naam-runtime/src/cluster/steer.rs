//! The steering thread's side of the cluster: what the [`Controller`] observes of it, and
//! publishing its decisions (weights, client signals, owner handoffs).

use super::{
    AppView, Arc, ClusterError, Controller, Duration, HandlerKey, HandlerKind, HandlerView, Inner,
    Instant, LoadTracker, Observe, Ordering, Placement, SteeringInputs, WeightCell, Weights,
    REMOTE_SILENCE,
};

/// The cluster as the steering [`Controller`] observes it: trackers behind their locks, the
/// executors' queues, the registry's apps and their current owners.
pub(super) struct Observed<'a>(&'a Inner);

impl Observe for Observed<'_> {
    fn with_tracker<R>(&mut self, p: Placement, f: impl FnOnce(&mut LoadTracker) -> R) -> R {
        f(&mut self.0.lock_tracker(p))
    }

    fn queued(&self, p: Placement) -> Option<(u32, u32)> {
        let executors = match p {
            Placement::Host => self.0.config.host_executors,
            _ => self.0.config.nic_executors,
        };
        self.0.queues[p.index()]
            .as_ref()
            .map(|q| (q.len() as u32, executors as u32))
    }

    fn available(&self, p: Placement) -> bool {
        match p {
            Placement::Client => self.0.agent_available(),
            _ => self.0.available(p),
        }
    }

    fn client_rtt_ns(&self) -> Option<f64> {
        self.0.client_rtt.lock().ok().and_then(|e| e.get())
    }

    fn apps(&self, ids: Option<&[u32]>) -> Vec<AppView> {
        let registry = self.0.registry.load();
        let view = |a: &crate::registry::AppEntry| AppView {
            id: a.id,
            owner: self.0.owner_of(a.id),
            handlers: a
                .handlers
                .values()
                .map(|h| HandlerView {
                    id: h.id,
                    read_only: h.kind == HandlerKind::Read,
                })
                .collect(),
        };
        match ids {
            // Looked up one by one: a period's cost follows the apps that ran, not how many
            // the registry holds.
            Some(ids) => ids
                .iter()
                .filter_map(|id| registry.app(*id))
                .map(view)
                .collect(),
            None => registry.apps().map(view).collect(),
        }
    }
}

/// One steering period: the controller decides, this publishes what changed and moves owners.
/// Returns whether anything ran or waited anywhere during the period.
pub(super) fn decide_all(inner: &Inner, controller: &mut Controller, full: bool) -> bool {
    let now = inner.clock.now();
    if inner.config.remote_nic
        && inner.remote_nic_up.load(Ordering::SeqCst)
        && now.saturating_sub(inner.remote_nic_seen.load(Ordering::SeqCst))
            > REMOTE_SILENCE.as_nanos() as u64
    {
        inner.remote_nic_up.store(false, Ordering::SeqCst);
        tracing::warn!(
            "naam-nic has been silent for {REMOTE_SILENCE:?}: it is out of the weights, \
             and its share goes to the host"
        );
    }
    inner.apply_local_reports();
    let decisions = controller.tick(now, &mut Observed(inner), full);
    let active = decisions.inputs.total_rate > 0.0
        || decisions
            .inputs
            .placements
            .iter()
            .any(|p| p.queue_depth > 0);
    // Clients read the weights on every message, from each handler's cell: a change is a
    // store into the cell, and only a handler's first weights take the map's write lock.
    let mut first = Vec::new();
    let mut changes = inner
        .weight_changes
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    {
        let table = inner.weights.read().unwrap_or_else(|e| e.into_inner());
        for (key, w) in decisions.weights {
            match table.get(&key) {
                Some(cell) => {
                    let was = cell.load();
                    if was != w {
                        log_shift(key, Some(&was), &w, &decisions.inputs);
                        inner.metrics.record_weights(now, key, w);
                        cell.store(w);
                        changes.changed(key);
                    }
                }
                None => first.push((key, w)),
            }
        }
    }
    if !first.is_empty() {
        let mut table = inner.weights.write().unwrap_or_else(|e| e.into_inner());
        for (key, w) in first {
            log_shift(key, None, &w, &decisions.inputs);
            inner.metrics.record_weights(now, key, w);
            table.insert(key, Arc::new(WeightCell::new(w)));
            changes.changed(key);
        }
    }
    drop(changes);
    if let Some((client_inputs, handlers)) = decisions.client_signals {
        let mut signals = inner.signals.write().unwrap_or_else(|e| e.into_inner());
        signals.0 = client_inputs;
        signals.1.extend(handlers);
    }
    for (app, to) in decisions.owner_moves {
        // A handoff that cannot drain in time is abandoned; a later decision may try again.
        let _ = move_owner(inner, app, to, OWNER_DRAIN_TIMEOUT);
    }
    active
}

/// Logs (debug) a change of `key`'s weights from `was` to `now` that an operator would call a
/// shift: where most messages go changes, or a placement's share moves by a quarter or more
/// in one decision. Says why, from the load the decision saw.
fn log_shift(key: HandlerKey, was: Option<&Weights>, now: &Weights, inputs: &SteeringInputs) {
    let most = |w: &Weights| {
        Placement::ALL
            .into_iter()
            .max_by(|a, b| w.of(*a).total_cmp(&w.of(*b)))
            .unwrap_or(Placement::Host)
    };
    let shifted = match was {
        None => true,
        Some(w) => {
            most(w) != most(now)
                || Placement::ALL
                    .iter()
                    .any(|p| (w.of(*p) - now.of(*p)).abs() >= 0.25)
        }
    };
    if !shifted {
        return;
    }
    let load = |p: Placement| {
        let l = &inputs.placements[p.index()];
        format!(
            "{p}: queue {} ({:.0} ns), busy {:.0}%{}",
            l.queue_depth,
            l.queue_delay_ns,
            l.utilisation * 100.0,
            if l.available { "" } else { ", down" }
        )
    };
    tracing::debug!(
        app = key.0,
        handler = format_args!("{:#x}", key.1),
        "steering: client {:.2} nic {:.2} host {:.2} (was {}); {} msg/s; {}; {}; {}",
        now.of(Placement::Client),
        now.of(Placement::Nic),
        now.of(Placement::Host),
        was.map_or_else(
            || "none".to_string(),
            |w| format!(
                "{:.2}/{:.2}/{:.2}",
                w.of(Placement::Client),
                w.of(Placement::Nic),
                w.of(Placement::Host)
            )
        ),
        inputs.total_rate.round(),
        load(Placement::Client),
        load(Placement::Nic),
        load(Placement::Host)
    );
}

/// How long the controller waits for an owner handoff to drain.
pub(super) const OWNER_DRAIN_TIMEOUT: Duration = Duration::from_millis(200);

/// Moves `app`'s write ownership to `to`: new writes get `Busy` while in-flight writes at the
/// old owner drain; then the owner changes and the epoch advances.
pub(super) fn move_owner(
    inner: &Inner,
    app: u32,
    to: Placement,
    timeout: Duration,
) -> Result<u64, ClusterError> {
    if to == Placement::Client {
        return Err(ClusterError::Config("the client cannot own writes".into()));
    }
    if to == Placement::Nic && inner.config.remote_nic {
        // naam-nic serves forwarded reads and one-sided operations; writes stay at the host.
        return Err(ClusterError::Config(
            "the NIC runs in another process and cannot own writes".into(),
        ));
    }
    let o = inner.owner(app).ok_or(ClusterError::UnknownApp(app))?;
    o.draining.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + timeout;
    while o.inflight.load(Ordering::SeqCst) > 0 {
        if Instant::now() > deadline {
            o.draining.store(false, Ordering::SeqCst);
            return Err(ClusterError::HandoffTimeout(app, timeout));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    o.placement.store(to.abi() as u8, Ordering::SeqCst);
    let epoch = o.epoch.fetch_add(1, Ordering::SeqCst) + 1;
    o.draining.store(false, Ordering::SeqCst);
    Ok(epoch)
}

/// Steering periods without any message before the controller slows down.
const IDLE_TICKS: u32 = 50;

/// The longest the controller sleeps while nothing runs (it ticks every period again as soon
/// as a tick sees a message).
const IDLE_PERIOD: Duration = Duration::from_millis(50);

pub(super) fn controller_loop(inner: Arc<Inner>, mut controller: Controller) {
    let mut idle_ticks = 0u32;
    while !inner.shutdown.load(Ordering::SeqCst) {
        // Nothing to steer while nothing runs: an idle server ticks twenty times a second,
        // not a thousand.
        let period = if idle_ticks < IDLE_TICKS {
            inner.config.steering_period
        } else {
            IDLE_PERIOD.max(inner.config.steering_period)
        };
        if period > inner.config.steering_period {
            // A report handed over while this sleeps long wakes it (`Inner::hand_over`): the
            // apps' budgets must not wait out an idle period.
            let _ = inner.steering.set(std::thread::current());
            inner.steering_asleep.store(true, Ordering::SeqCst);
            if inner.local_reports_waiting() {
                inner.steering_asleep.store(false, Ordering::SeqCst);
            } else {
                std::thread::park_timeout(period);
                inner.steering_asleep.store(false, Ordering::SeqCst);
            }
        } else {
            std::thread::sleep(period);
        }
        let active = decide_all(&inner, &mut controller, false);
        idle_ticks = if active {
            0
        } else {
            idle_ticks.saturating_add(1)
        };
    }
}
