//! Turning executor events into one placement's load signals ([`LoadTracker`]).

use std::collections::HashMap;

use super::{Ewma, HandlerKey, PlacementLoad, RemoteHandler, RemoteLoad};
use crate::Nanos;

/// Tracks one placement's load from the events its executors report.
#[derive(Clone, Debug, Default)]
pub struct LoadTracker {
    queue_delay: Ewma,
    depth: u32,
    busy_ns: u64,
    window_start: Nanos,
    executors: u32,
    available: bool,
    last_utilisation: f64,
    service: HashMap<HandlerKey, Ewma>,
    steps: HashMap<HandlerKey, Ewma>,
    completions: HashMap<HandlerKey, u64>,
    overall: Ewma,
    dequeues: u64,
    /// The receive loops' own work per message beyond the handler.
    loop_work: Ewma,
}

impl LoadTracker {
    /// A tracker for `executors` executor threads, starting at `now`.
    pub fn new(executors: u32, now: Nanos) -> Self {
        LoadTracker {
            executors,
            window_start: now,
            available: executors > 0,
            ..Default::default()
        }
    }

    /// A message left the queue after waiting `waited` nanoseconds; `depth` are still queued.
    pub fn dequeued(&mut self, waited: Nanos, depth: u32) {
        // Waits are often zero, so clip against a floor of a microsecond.
        let cap = self.queue_delay.get().unwrap_or(0.0).max(1_000.0) * Ewma::CLIP;
        self.queue_delay.add((waited as f64).min(cap));
        self.dequeues += 1;
        self.depth = depth;
    }

    /// A run-to-completion loop took in `count` messages that waited `mean_ns` on average in
    /// its receive queue: taken as a dequeue from an executor's queue would be (one sample of
    /// their mean, clipped as [`LoadTracker::dequeued`] clips).
    pub fn received(&mut self, mean_ns: f64, count: u64) {
        if count == 0 || !mean_ns.is_finite() {
            return;
        }
        let cap = self.queue_delay.get().unwrap_or(0.0).max(1_000.0) * Ewma::CLIP;
        self.queue_delay.add(mean_ns.max(0.0).min(cap));
        self.dequeues += count;
    }

    /// A run-to-completion loop spent `mean_ns` on average on each of its last messages
    /// beyond their handlers (one sample of that mean).
    pub fn loop_worked(&mut self, mean_ns: f64) {
        if mean_ns.is_finite() && mean_ns >= 0.0 {
            self.loop_work.add_clipped(mean_ns);
        }
    }

    /// The receive loops' own work per message, nanoseconds (0: not measured).
    pub fn loop_ns(&self) -> f64 {
        self.loop_work.get().unwrap_or(0.0)
    }

    /// A message of `key` finished after `service` nanoseconds of executor time and `steps`.
    pub fn completed(&mut self, key: HandlerKey, service: Nanos, steps: u16) {
        self.busy_ns += service;
        self.overall.add_clipped(service as f64);
        *self.completions.entry(key).or_default() += 1;
        self.service
            .entry(key)
            .or_default()
            .add_clipped(service as f64);
        self.steps.entry(key).or_default().add(steps as f64);
    }

    /// Executor time taken away from messages (a CPU hog, a capacity limit).
    pub fn stolen(&mut self, ns: Nanos) {
        self.busy_ns += ns;
    }

    /// Marks the placement up or down.
    pub fn set_available(&mut self, up: bool) {
        self.available = up;
    }

    /// Closes the period ending at `now` and returns the placement's load.
    pub fn sample(&mut self, now: Nanos) -> PlacementLoad {
        // Queueing delay describes the present: a placement that dequeued nothing for a whole
        // period has no queue to speak of (a standing queue still shows through the
        // controller's Little's-law estimate), so its estimate decays with time instead of
        // waiting for the rare probe (sample-driven averages go stale exactly where the policy
        // stopped sending traffic).
        if self.dequeues == 0 {
            self.queue_delay.decay(0.5);
        }
        self.dequeues = 0;
        let window =
            now.saturating_sub(self.window_start).max(1) as f64 * self.executors.max(1) as f64;
        let utilisation = (self.busy_ns as f64 / window).min(1.0);
        self.last_utilisation = utilisation;
        self.busy_ns = 0;
        self.window_start = now;
        PlacementLoad {
            queue_depth: self.depth,
            queue_delay_ns: self.queue_delay.get().unwrap_or(0.0),
            utilisation,
            available: self.available,
            mean_service_ns: self.overall.get(),
            loop_ns: self.loop_ns(),
        }
    }

    /// Utilisation over the last closed period (0..=1).
    pub fn last_utilisation(&self) -> f64 {
        self.last_utilisation
    }

    /// Queueing-delay EWMA, nanoseconds.
    pub fn queue_delay_ns(&self) -> f64 {
        self.queue_delay.get().unwrap_or(0.0)
    }

    /// Service-time EWMA of `key` here.
    pub fn service(&self, key: HandlerKey) -> Option<f64> {
        self.service.get(&key).and_then(Ewma::get)
    }

    /// Steps EWMA of `key` here.
    pub fn steps(&self, key: HandlerKey) -> Option<f64> {
        self.steps.get(&key).and_then(Ewma::get)
    }

    /// Service-time average over every handler here, nanoseconds.
    pub fn overall_service(&self) -> Option<f64> {
        self.overall.get()
    }

    /// Handlers that completed messages here since the last call, with how many, and forgets
    /// them.
    pub fn take_touched(&mut self) -> Vec<(HandlerKey, u64)> {
        // Drained, not replaced: the map keeps its capacity for the next period.
        self.completions.drain().collect()
    }

    /// Every handler seen here.
    pub fn handlers(&self) -> impl Iterator<Item = &HandlerKey> {
        self.service.keys()
    }

    /// The report a remote placement sends: what happened since the last report (busy time,
    /// dequeues, completions are drained), with the current averages.
    pub fn report(&mut self) -> RemoteLoad {
        let handlers = self
            .completions
            .drain()
            .map(|((app, handler), completions)| RemoteHandler {
                app,
                handler,
                service_ns: self
                    .service
                    .get(&(app, handler))
                    .and_then(Ewma::get)
                    .unwrap_or(0.0),
                steps: self
                    .steps
                    .get(&(app, handler))
                    .and_then(Ewma::get)
                    .unwrap_or(1.0),
                completions,
            })
            .collect();
        let r = RemoteLoad {
            executors: self.executors,
            queue_depth: self.depth,
            queue_delay_ns: self.queue_delay_ns(),
            busy_ns: self.busy_ns,
            dequeues: self.dequeues,
            handlers,
            loop_ns: self.loop_ns(),
        };
        self.busy_ns = 0;
        self.dequeues = 0;
        r
    }

    /// Takes in what `r` reports of completed messages (busy time, per-handler service and
    /// steps, completions) and nothing of its queue: the report of messages run to completion
    /// by the threads that received them, for this placement whose queue is its executors'.
    pub fn absorb_completions(&mut self, r: &RemoteLoad) {
        self.busy_ns += r.busy_ns;
        self.absorb_loop_work(r);
        self.absorb_handlers(r);
    }

    fn absorb_loop_work(&mut self, r: &RemoteLoad) {
        if r.loop_ns > 0.0 && r.loop_ns.is_finite() {
            self.loop_work.set(r.loop_ns);
        }
    }

    fn absorb_handlers(&mut self, r: &RemoteLoad) {
        for h in &r.handlers {
            let key = (h.app, h.handler);
            if !h.service_ns.is_finite() || !h.steps.is_finite() {
                continue;
            }
            self.service.entry(key).or_default().set(h.service_ns);
            self.steps.entry(key).or_default().set(h.steps);
            self.overall.add_clipped(h.service_ns);
            *self.completions.entry(key).or_default() += h.completions;
        }
    }

    /// Takes in a remote placement's report as if its executors had run here.
    pub fn absorb(&mut self, r: &RemoteLoad) {
        self.executors = r.executors.max(1);
        self.depth = r.queue_depth;
        if r.dequeues > 0 || self.queue_delay.get().is_none() {
            self.queue_delay.set(r.queue_delay_ns);
        }
        self.busy_ns += r.busy_ns;
        self.dequeues += r.dequeues;
        self.absorb_loop_work(r);
        self.absorb_handlers(r);
    }
}
