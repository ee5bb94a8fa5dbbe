//! Messages run to completion by the thread that took them in: a client's own thread in
//! process, naam-server's and naam-nic's receive loops over UDP. No queue, no hand-off; the
//! load they put on their placement reaches the steering in periodic reports.

use super::{
    serve_handler, spin_for, thread_vm, write_reply_for, Arc, Cluster, HandlerEntry, HandlerKey,
    HostPath, Inner, IntMap, LoadFeedback, Nanos, NicPath, ParkedRun, Placement, RegistryView,
    RemoteHandler, RemoteLoad, Reply, Request, Served, StepMachine, ThreadVm,
};

/// How often a thread that runs messages itself hands the load it measured to the cluster's
/// tracker: well inside one steering period, so the controller always decides on fresh
/// figures.
const LOCAL_LOAD_FLUSH_NS: Nanos = 250_000;

/// How long a thread holds its figures back, summed period after period, while the steering
/// has every report made so far (it falls behind, starved of a core): then the thread applies
/// what waits itself ([`LocalLoad::flush`]). Bounds how stale the tracker and the budgets get.
const MAX_FLUSH_DEFERRAL_NS: Nanos = 16 * LOCAL_LOAD_FLUSH_NS;

/// Reports waiting for the steering at most ([`Inner::hand_over`]): a few periods' worth from
/// every thread that runs messages itself.
pub(super) const MAX_PENDING_LOCAL_REPORTS: usize = 256;

/// Messages a thread ran to completion itself at one placement, kept apart from the
/// cluster's shared tracker (whose lock every such thread would otherwise take per message)
/// and handed over in one report every [`LOCAL_LOAD_FLUSH_NS`]; the apps' budget spending
/// likewise.
pub(super) struct LocalLoad {
    placement: Placement,
    /// Per handler since the last flush: completions, service time and steps summed.
    handlers: Vec<(HandlerKey, u64, u64, u64)>,
    /// Where each handler of `handlers` is: with thousands of apps a flush period sees
    /// hundreds of handlers, too many to search.
    index: IntMap<HandlerKey, usize>,
    busy_ns: u64,
    /// Messages taken in since the last flush, and the time they waited in the receive queue
    /// (arrival to start) summed: a run-to-completion loop's queue, which no executor's
    /// queue shows.
    received: u64,
    waited_ns: u64,
    /// Messages whose loop work was reported since the last flush, and that work summed.
    looped: u64,
    loop_ns: u64,
    /// When the figures were last handed over.
    flushed_at: Nanos,
    /// When a flush is next tried: a period after the last, or sooner while one is held back.
    flush_due: Nanos,
}

/// When a [`LocalLoad`] report is applied.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Apply {
    /// By the steering, before its next decision ([`Inner::hand_over`]): the thread that
    /// serves requests does not pay for the report's hundreds of tracker and budget entries.
    BySteering,
    /// Now, by the caller (its loop goes idle, or it stops).
    Now,
}

impl LocalLoad {
    pub(super) fn new(placement: Placement, now: Nanos) -> LocalLoad {
        LocalLoad {
            placement,
            handlers: Vec::new(),
            index: IntMap::default(),
            busy_ns: 0,
            received: 0,
            waited_ns: 0,
            looped: 0,
            loop_ns: 0,
            flushed_at: now,
            flush_due: now + LOCAL_LOAD_FLUSH_NS,
        }
    }

    /// Records a finished host message and hands everything over when a flush is due.
    #[inline]
    pub(super) fn completed(
        &mut self,
        inner: &Inner,
        key: HandlerKey,
        service: Nanos,
        steps: u16,
        now: Nanos,
    ) {
        self.busy_ns += service;
        match self.index.get(&key) {
            Some(&i) => {
                let h = &mut self.handlers[i];
                h.1 += 1;
                h.2 += service;
                h.3 += steps as u64;
            }
            None => {
                self.index.insert(key, self.handlers.len());
                self.handlers.push((key, 1, service, steps as u64));
            }
        }
        if now >= self.flush_due {
            self.flush(inner, now, Apply::BySteering);
        }
    }

    /// Hands the period's figures to the cluster: the mean service time and steps of each
    /// handler, the busy time, and every app's steps against its budget.
    ///
    /// The report is one whose vectors an earlier flush left, so that the per-message path
    /// allocates nothing once reports circulate. While the steering holds every report made
    /// so far, a flush by the steering's leave is held back (the figures keep summing, and it
    /// is tried again an eighth of a period later) rather than made in a new report: up to
    /// [`MAX_FLUSH_DEFERRAL_NS`], after which this thread applies what waits itself.
    pub(super) fn flush(&mut self, inner: &Inner, now: Nanos, when: Apply) {
        if self.received == 0 && self.looped == 0 && self.handlers.is_empty() {
            self.flushed_at = now;
            self.flush_due = now + LOCAL_LOAD_FLUSH_NS;
            return;
        }
        let spare = match inner.spare_report() {
            Some(r) => Some(r),
            None if when == Apply::BySteering && inner.reports_out() > 0 => {
                if now.saturating_sub(self.flushed_at) < MAX_FLUSH_DEFERRAL_NS {
                    self.flush_due = now + LOCAL_LOAD_FLUSH_NS / 8;
                    return;
                }
                inner.apply_local_reports();
                inner.spare_report()
            }
            None => None,
        };
        self.flushed_at = now;
        self.flush_due = now + LOCAL_LOAD_FLUSH_NS;
        let mut report = spare.unwrap_or_else(|| LocalReport {
            at: now,
            placement: self.placement,
            received: None,
            loop_ns: None,
            completions: RemoteLoad::default(),
            spending: Vec::new(),
        });
        report.at = now;
        report.placement = self.placement;
        report.received = None;
        report.loop_ns = None;
        report.completions.busy_ns = 0;
        report.completions.handlers.clear();
        report.spending.clear();
        if self.received > 0 {
            let mean = self.waited_ns as f64 / self.received as f64;
            report.received = Some((mean, self.received));
            (self.received, self.waited_ns) = (0, 0);
        }
        if self.looped > 0 {
            report.loop_ns = Some(self.loop_ns as f64 / self.looped as f64);
            (self.looped, self.loop_ns) = (0, 0);
        }
        if !self.handlers.is_empty() {
            report.completions.busy_ns = std::mem::take(&mut self.busy_ns);
            report.completions.handlers.extend(self.handlers.iter().map(
                |&((app, handler), n, service, steps)| RemoteHandler {
                    app,
                    handler,
                    service_ns: service as f64 / n as f64,
                    steps: steps as f64 / n as f64,
                    completions: n,
                },
            ));
            report.spending.extend(
                self.handlers
                    .iter()
                    .map(|&((app, _), _, service, steps)| (app, service, steps)),
            );
            self.handlers.clear();
            self.index.clear();
        }
        match when {
            Apply::BySteering => inner.hand_over(report),
            Apply::Now => {
                // Those left for the steering first, so that everything measured so far
                // counts once this returns (budgets, accounts).
                inner.apply_local_reports();
                report.apply(inner);
                inner.keep_spare(report);
            }
        }
    }
}

/// One [`LocalLoad`] flush: what it adds to its placement's tracker and to the apps' budgets.
pub(super) struct LocalReport {
    /// When it was made: its spending counts in the budget period of that time.
    at: Nanos,
    placement: Placement,
    /// Mean wait in the receive queue, and the messages taken in.
    received: Option<(f64, u64)>,
    /// Mean loop work per message.
    loop_ns: Option<f64>,
    /// Busy time and per-handler completions.
    completions: RemoteLoad,
    /// Per handler: its app, handler nanoseconds and steps.
    spending: Vec<(u32, Nanos, u64)>,
}

impl LocalReport {
    /// Adds this report to the cluster's tracker and the apps' accounts.
    pub(super) fn apply(&self, inner: &Inner) {
        if self.received.is_some() || self.loop_ns.is_some() || !self.spending.is_empty() {
            let mut t = inner.lock_tracker(self.placement);
            if let Some((mean, n)) = self.received {
                t.received(mean, n);
            }
            if let Some(mean) = self.loop_ns {
                t.loop_worked(mean);
            }
            if !self.completions.handlers.is_empty() {
                t.absorb_completions(&self.completions);
            }
        }
        for &(app, service, steps) in &self.spending {
            inner.spend_then(self.at, app, Some((self.placement, service)), 0, steps);
        }
    }
}

/// What running a message here left.
pub(super) enum Ran {
    /// It finished: its reply is in the caller's slot.
    Answered,
    /// A torn read must wait out a backoff: the run and whether it is a write (holding its
    /// dedup entry and owner count), for an executor to park.
    Parked(Box<ParkedRun>, bool),
}

/// A thread's means to run its placement's messages itself: its engine state, its data path
/// for the placement, and where it counts the load. Made by [`Cluster::here_runner`], used
/// with [`Cluster::dispatch_here`]; one per thread.
pub struct HereRunner {
    pub(super) placement: Placement,
    vm: ThreadVm,
    host: HostPath,
    nic: NicPath,
    local: LocalLoad,
    /// Every message this thread runs runs in this machine (its buffers are reused).
    machine: StepMachine,
    /// The registry this thread routes and runs with.
    pub(super) registry: RegistryView,
}

impl HereRunner {
    pub(super) fn new(inner: &Arc<Inner>, placement: Placement) -> HereRunner {
        let vm = thread_vm(&inner.config);
        HereRunner {
            placement,
            vm,
            host: HostPath::new(inner.regions.clone()),
            nic: NicPath::new(inner.regions.clone(), inner.config.nic.dma),
            local: LocalLoad::new(placement, inner.clock.now()),
            machine: StepMachine::unused(),
            registry: RegistryView::new(inner),
        }
    }

    /// The placement this runner's thread serves.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Runs admitted `req` here (a write counted in flight at its owner: `serve` releases
    /// it), as an executor of the placement would: the host's congestion, the NIC's modelled
    /// DMA time and core slowdown included. A torn read that must wait is handed back, never
    /// waited for on this thread (it serves everyone's datagrams). The reply of a run that
    /// finished is written into `out`, field by field where it lies: built apart and moved
    /// in, each of the layers above would copy it again. `handler` is `req`'s, as admission
    /// found it (the registry is not searched twice per message).
    pub(super) fn run(
        &mut self,
        inner: &Inner,
        req: &Request,
        handler: &Arc<HandlerEntry>,
        out: &mut Reply,
    ) -> Ran {
        let start = inner.clock.now();
        let congested = match self.placement {
            Placement::Host => inner.congestion.host_extra_ns(),
            _ => 0,
        };
        // A simulated core is busy for the congestion's extra time in virtual time, below.
        if congested > 0 && inner.config.simulated.is_none() {
            spin_for(congested);
        }
        let (vm, machine) = (&mut self.vm, &mut self.machine);
        let served = match self.placement {
            Placement::Nic => serve_handler(inner, req, handler, &mut self.nic, vm, machine),
            _ => serve_handler(inner, req, handler, &mut self.host, vm, machine),
        };
        let c = match served {
            Served::Done(c, _) => c,
            Served::Parked { run, write } => return Ran::Parked(run, write),
        };
        if self.placement == Placement::Nic
            && inner.config.nic.emulate_costs
            && inner.config.simulated.is_none()
        {
            let ran = inner.clock.now().saturating_sub(start);
            let slower = (ran as f64 * (inner.config.nic.core_slowdown - 1.0).max(0.0)) as u64;
            spin_for(c.fetch_ns + slower);
        }
        let end = inner.clock.now();
        let service = match &inner.config.simulated {
            Some(s) => {
                s.service.service_ns(
                    self.placement,
                    &super::RunFacts {
                        insns: c.insns,
                        mix: c.mix,
                        runs: c.runs,
                        steps: c.steps,
                        fetch_ns: c.fetch_ns,
                        args_bytes: req.args.len() as u32,
                        reply_bytes: c.payload.len() as u32,
                    },
                ) + congested
            }
            None => end.saturating_sub(start),
        };
        self.local
            .completed(inner, (req.app, req.handler), service, c.steps, end);
        let load = LoadFeedback {
            service_ns: service,
            ..LoadFeedback::default()
        };
        write_reply_for(out, req, c, self.placement, load);
        Ran::Answered
    }

    /// A message this runner's loop takes in waited `waited_ns` in its receive queue, from
    /// its arrival (or the receive that brought it) to now: the queueing a run-to-completion
    /// loop's messages see, which the steering weighs as an executor queue's delay (without
    /// it, a loop saturated by protocol work looks idle to the controller, which counts
    /// handler time).
    pub fn received(&mut self, waited_ns: Nanos) {
        self.local.received += 1;
        self.local.waited_ns = self.local.waited_ns.saturating_add(waited_ns);
    }

    /// This runner's loop spent `ns` on a message beyond its handler (taking it in, opening,
    /// sealing, sending): the steering prices a placement with it, since where the protocol's
    /// work is dear (the Arm cores) a cheap handler alone would make the placement look
    /// cheaper than it is.
    ///
    /// (The simulator's loops report it; naam-server's do not yet: measured there as a
    /// round's time less its handlers', it charged the host for forwarding the NIC's
    /// messages and drove every read to the NIC. See RESULTS, "The simulator".)
    pub fn loop_worked(&mut self, ns: Nanos) {
        self.local.looped += 1;
        self.local.loop_ns = self.local.loop_ns.saturating_add(ns);
    }

    /// Hands what this runner measured to the cluster now (its loop goes idle, or stops).
    pub fn flush(&mut self, cluster: &Cluster) {
        let now = cluster.inner.clock.now();
        self.local.flush(&cluster.inner, now, Apply::Now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterConfig;
    use std::sync::atomic::Ordering;

    fn pending(inner: &Inner) -> usize {
        inner.local_reports.lock().map_or(0, |p| p.len())
    }

    fn spares(inner: &Inner) -> usize {
        inner.spare_reports.lock().map_or(0, |s| s.len())
    }

    /// A steering that holds the only report (starved of a core) makes the thread that
    /// reports hold its figures back, summed, rather than make report after report; past
    /// the deferral bound the thread applies what waits itself and reuses that report.
    #[test]
    fn a_steering_that_falls_behind_makes_no_new_reports_until_the_bound() {
        // No steering thread: what waits stays until someone applies it.
        let config = ClusterConfig {
            controller: false,
            ..ClusterConfig::default()
        };
        let cluster = Cluster::builder().config(config).build().unwrap();
        let inner = &cluster.inner;
        // The steering holds the one report made so far.
        inner.local_reports.lock().unwrap().push(LocalReport {
            at: 0,
            placement: Placement::Host,
            received: None,
            loop_ns: None,
            completions: RemoteLoad::default(),
            spending: Vec::new(),
        });
        inner.reports_out.fetch_add(1, Ordering::AcqRel);

        let key = (7, 1);
        let mut local = LocalLoad::new(Placement::Host, 0);
        let step = LOCAL_LOAD_FLUSH_NS / 10;
        let mut now = 0;
        let mut completed = 0u64;
        while now + step < MAX_FLUSH_DEFERRAL_NS {
            now += step;
            local.completed(inner, key, 1_000, 2, now);
            completed += 1;
        }
        assert_eq!(
            pending(inner),
            1,
            "no report handed over while the steering holds one"
        );
        assert_eq!(spares(inner), 0);
        assert_eq!(
            local.handlers,
            vec![(key, completed, completed * 1_000, completed * 2)]
        );

        // Past the bound: the waiting report is applied here and carries these figures.
        now = MAX_FLUSH_DEFERRAL_NS;
        local.completed(inner, key, 1_000, 2, now);
        completed += 1;
        assert_eq!(pending(inner), 0);
        assert_eq!(inner.reports_out(), 0);
        assert_eq!(spares(inner), 1, "one report in all, back among the spares");
        assert!(local.handlers.is_empty());
        let mut tracker = inner.lock_tracker(Placement::Host);
        assert_eq!(tracker.service(key), Some(1_000.0));
        assert_eq!(tracker.take_touched(), vec![(key, completed)]);
    }
}
