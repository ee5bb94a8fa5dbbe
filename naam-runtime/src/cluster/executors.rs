//! The executor and one-sided agent threads: serving a message at a placement, parking a
//! torn-read retry, write ownership and deduplication at the owner.

use super::{
    apply_owned, error_reply, executor, one_sided_read, recv_polling, reply_for, spin_for,
    thread_vm, AgentJob, AgentSink, Arc, DataPath, Dedup, Driven, Duration, FairQueue,
    HandlerEntry, HandlerKind, HostPath, Inner, Instant, Job, LoadFeedback, Nanos, NicPath,
    Ordering, Outcome, ParkedRun, Placement, Receiver, RegionTable, Request, RunCost, Status,
    StepMachine, ThreadVm, WriteError,
};
use naam_proto::step::{InPlace, WriteBatch};

/// What serving a message left: an answer, or a message parked for a torn-read retry.
pub(super) enum Served {
    /// The completion and the modelled fetch cost.
    Done(Outcome, u64),
    /// Waiting for its backoff; `write`: it holds its dedup entry and owner count.
    Parked { run: Box<ParkedRun>, write: bool },
}

/// Runs `req` on `path` until it completes or parks: reads anywhere, writes only at the owner
/// and once per (origin, request id). `admitted`: the handler its admission routed it with
/// (the version it runs on); `None`: the registry's current one.
pub(super) fn serve<P: DataPath>(
    inner: &Inner,
    req: &Request,
    admitted: Option<&Arc<HandlerEntry>>,
    path: &mut P,
    vm: &mut ThreadVm,
    machine: &mut StepMachine,
) -> Served {
    if let Some(handler) = admitted {
        return serve_handler(inner, req, handler, path, vm, machine);
    }
    let registry = inner.registry.load();
    match registry.handler(req.app, req.handler) {
        Ok(handler) => serve_handler(inner, req, handler, path, vm, machine),
        Err(e) => {
            let status = match e {
                crate::LookupError::UnknownApp(_) => Status::UnknownApp,
                _ => Status::UnknownHandler,
            };
            Served::Done(Outcome::error(status, 0, e.to_string(), req.steps), 0)
        }
    }
}

/// [`serve`] of a request whose handler the caller has looked up already (the switch does,
/// to route it).
pub(super) fn serve_handler<P: DataPath>(
    inner: &Inner,
    req: &Request,
    handler: &Arc<HandlerEntry>,
    path: &mut P,
    vm: &mut ThreadVm,
    machine: &mut StepMachine,
) -> Served {
    let placement = path.placement();
    let at = executor::Place {
        path,
        vm,
        limits: inner.config.limits,
        clock: inner.clock.as_ref(),
        machine: Some(machine),
    };
    if handler.kind == HandlerKind::Read {
        let driven = executor::start(req, handler, at, &mut |_, _| Err(WriteError::NotOwner));
        return served(inner, req, driven, false);
    }
    // Writes: only at the owner, once per (origin, request id); one handed in within the
    // process exists once ([`Request::handed_in`]), so it takes no entry.
    let refused = |c: Outcome| {
        release_owner(inner, req.app);
        Served::Done(c, 0)
    };
    if inner.owner_of(req.app) != Some(placement) {
        return refused(Outcome::error(
            Status::NotOwner,
            0,
            format!("{placement} does not own app {}'s writes", req.app),
            req.steps,
        ));
    }
    if !req.handed_in {
        let Some(dedup) = inner.dedup(req.app) else {
            return refused(Outcome::error(
                Status::UnknownApp,
                0,
                format!("no app {}", req.app),
                req.steps,
            ));
        };
        let mut t = dedup.lock().unwrap_or_else(|e| e.into_inner());
        let key = (req.origin, req.request_id);
        match t.get(&key) {
            Some(Dedup::Done(c)) => return refused(c.clone()),
            Some(Dedup::Pending) => {
                return refused(Outcome::error(
                    Status::Busy,
                    0,
                    "a write with this request id is in progress",
                    req.steps,
                ))
            }
            None => t.insert(key, Dedup::Pending),
        }
    }
    let regions = inner.regions.clone();
    let driven = {
        let _one_writer = inner.owner(req.app).map(|o| o.writer.lock());
        executor::start(req, handler, at, &mut |batch, in_place| {
            apply_journaled(inner, &regions, batch, in_place)
        })
    };
    served(inner, req, driven, true)
}

/// Applies `batch` as the write owner ([`apply_owned`]), under its app's undo journal when
/// its regions outlive the process.
fn apply_journaled(
    inner: &Inner,
    regions: &RegionTable,
    batch: &WriteBatch<'_>,
    in_place: Option<InPlace<'_>>,
) -> Result<(), WriteError> {
    match inner.journal(batch.app) {
        Some(journal) => journal.apply(batch, || apply_owned(regions, batch, in_place)),
        None => apply_owned(regions, batch, in_place),
    }
}

/// Resumes a parked message, its backoff served. An app past its retry budget gets no more
/// retries: the message fails at once.
pub(super) fn resume_served<P: DataPath>(
    inner: &Inner,
    req: &Request,
    run: Box<ParkedRun>,
    write: bool,
    path: &mut P,
    vm: &mut ThreadVm,
) -> Served {
    if inner.over_budget(req.app) == Some("torn-read retries") {
        let c = Outcome::error(
            Status::Refused,
            0,
            format!(
                "app {} spent its torn-read retry budget for this period",
                req.app
            ),
            req.steps,
        );
        return served(inner, req, Driven::Done(c, RunCost::default()), write);
    }
    let clock = inner.clock.as_ref();
    let driven = if write {
        let regions = inner.regions.clone();
        // A parked write left the lock while it waited: what it read before may be stale, and
        // its batch's CAS on the layout's version then fails (a conflict), as it must.
        let _one_writer = inner.owner(req.app).map(|o| o.writer.lock());
        executor::resume(run, &req.args, path, vm, clock, &mut |batch, in_place| {
            apply_journaled(inner, &regions, batch, in_place)
        })
    } else {
        executor::resume(run, &req.args, path, vm, clock, &mut |_, _| {
            Err(WriteError::NotOwner)
        })
    };
    served(inner, req, driven, write)
}

/// Books a driven message: a parked one counts a retry against its app; a finished write
/// records its answer for deduplication and leaves its owner's in-flight count. A finished
/// message's steps are the caller's to book: an executor's at once, a thread that runs
/// messages itself in its periodic report ([`super::here::LocalLoad`]), which took them a
/// second time when they were also booked here (and took the app's budget lock per message).
pub(super) fn served(inner: &Inner, req: &Request, driven: Driven, write: bool) -> Served {
    match driven {
        Driven::Parked(run) => {
            inner.spend(req.app, 1, 1);
            Served::Parked { run, write }
        }
        Driven::Done(c, cost) => {
            if write {
                if let Some(dedup) = inner.dedup(req.app).filter(|_| !req.handed_in) {
                    let mut t = dedup.lock().unwrap_or_else(|e| e.into_inner());
                    t.insert((req.origin, req.request_id), Dedup::Done(c.clone()));
                }
                release_owner(inner, req.app);
            }
            Served::Done(c, cost.fetch_ns)
        }
    }
}

/// A write of `app` left its executor: the owner's in-flight count goes down.
pub(super) fn release_owner(inner: &Inner, app: u32) {
    if let Some(o) = inner.owner(app) {
        o.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A message parked at an executor, with what its reply needs.
pub(super) struct ParkedJob {
    pub(super) job: Job,
    pub(super) run: Box<ParkedRun>,
    pub(super) write: bool,
    /// Executor time spent on it so far (its service time excludes the backoffs).
    pub(super) busy: Nanos,
    /// Modelled fetch cost so far.
    pub(super) fetch_ns: u64,
}

pub(super) fn executor_loop(inner: Arc<Inner>, rx: Arc<FairQueue<Job>>, placement: Placement) {
    let mut last_done: Nanos = 0;
    let mut vm = thread_vm(&inner.config);
    let mut host = HostPath::new(inner.regions.clone());
    let mut nic = NicPath::new(inner.regions.clone(), inner.config.nic.dma);
    let mut machine = StepMachine::unused();
    // Messages waiting out a torn-read backoff: never slept on, the executor serves others.
    let mut parked: Vec<ParkedJob> = Vec::new();
    // Due retries and queued messages take turns: retries never hold up the queue by more
    // than one step each, and a full queue never starves the retries.
    let mut retry_turn = false;
    // When it last served something: an executor polls before it parks only while it has
    // been busy lately (adaptive polling); idle, it sleeps, and longer the longer it idles.
    let mut last_busy = Instant::now();
    loop {
        let now = inner.clock.now();
        retry_turn = !retry_turn;
        let due = parked
            .iter()
            .enumerate()
            .filter(|(_, p)| p.run.resume_at <= now)
            .min_by_key(|(_, p)| p.run.resume_at)
            .map(|(i, _)| i)
            .filter(|_| retry_turn || rx.is_empty());
        let (job, resumed) = match due {
            Some(i) => {
                let p = parked.swap_remove(i);
                (p.job, Some((p.run, p.write, p.busy, p.fetch_ns)))
            }
            None => {
                // Sleep no longer than until the next parked message is due.
                let idle = last_busy.elapsed();
                let (longest, poll) = if idle < IDLE_AFTER {
                    (Duration::from_millis(20), inner.config.executor_poll)
                } else {
                    (IDLE_SLEEP, Duration::ZERO)
                };
                let next = parked.iter().map(|p| p.run.resume_at).min();
                let wait = next.map_or(longest, |t| {
                    Duration::from_nanos(t.saturating_sub(now)).min(longest)
                });
                let poll = poll.min(wait);
                match rx.pop_timeout(wait, poll) {
                    Some((_, mut j)) => match j.parked.take() {
                        // Started on the thread that took it in, waiting out a torn read:
                        // parked here until due.
                        Some((run, write)) => {
                            let fetch_ns = run.fetch_ns();
                            parked.push(ParkedJob {
                                job: j,
                                run,
                                write,
                                busy: 0,
                                fetch_ns,
                            });
                            continue;
                        }
                        None => (j, None),
                    },
                    None => {
                        if inner.shutdown.load(Ordering::SeqCst) {
                            rx.close();
                            let queued = rx.drain().into_iter().map(|(_, j)| j);
                            for job in parked.drain(..).map(|p| p.job).chain(queued) {
                                job.sink.send(error_reply(
                                    &job.req,
                                    Status::Unavailable,
                                    placement,
                                    "the cluster is shutting down".into(),
                                ));
                            }
                            return;
                        }
                        continue;
                    }
                }
            }
        };
        last_busy = Instant::now();
        if inner.shutdown.load(Ordering::SeqCst) {
            job.sink.send(error_reply(
                &job.req,
                Status::Unavailable,
                placement,
                "the cluster is shutting down".into(),
            ));
            continue;
        }
        let start = inner.clock.now();
        if resumed.is_none() {
            let depth = rx.len() as u32;
            // Queueing delay is time spent behind other work. A message that arrived while this
            // executor was idle waited only for it to wake up, an artefact of emulating
            // executors as threads that park (real ones busy-poll); counting it would make
            // every idle placement look congested to its probes.
            let waited = if job.enqueued >= last_done {
                0
            } else {
                start.saturating_sub(job.enqueued)
            };
            inner.lock_tracker(placement).dequeued(waited, depth);
            if placement == Placement::Host {
                let extra = inner.congestion.host_extra_ns();
                spin_for(extra);
                inner.lock_tracker(placement).stolen(extra);
            }
        }
        let begin = inner.clock.now();
        let (busy_before, fetched_before) = resumed.as_ref().map_or((0, 0), |r| (r.2, r.3));
        let outcome = match (placement, resumed) {
            (Placement::Nic, None) => serve(
                &inner,
                &job.req,
                Some(&job.handler),
                &mut nic,
                &mut vm,
                &mut machine,
            ),
            (Placement::Nic, Some((run, write, ..))) => {
                resume_served(&inner, &job.req, run, write, &mut nic, &mut vm)
            }
            (_, None) => serve(
                &inner,
                &job.req,
                Some(&job.handler),
                &mut host,
                &mut vm,
                &mut machine,
            ),
            (_, Some((run, write, ..))) => {
                resume_served(&inner, &job.req, run, write, &mut host, &mut vm)
            }
        };
        let fetch_total = match &outcome {
            Served::Done(_, f) => *f,
            Served::Parked { run, .. } => run.fetch_ns(),
        };
        if placement == Placement::Nic && inner.config.nic.emulate_costs {
            let run = inner.clock.now().saturating_sub(begin);
            let slower = (run as f64 * (inner.config.nic.core_slowdown - 1.0).max(0.0)) as u64;
            spin_for(fetch_total.saturating_sub(fetched_before) + slower);
        }
        // Service time runs from dequeue: time taken away from the executor (a hog, a capacity
        // limit) is time this message spent at this placement; backoffs are not.
        let busy = busy_before + inner.clock.now().saturating_sub(start);
        let c = match outcome {
            Served::Parked { run, write } => {
                parked.push(ParkedJob {
                    job,
                    run,
                    write,
                    busy,
                    fetch_ns: fetch_total,
                });
                continue;
            }
            Served::Done(c, _) => c,
        };
        inner.spend_at(job.req.app, Some((placement, busy)), 0, c.steps as u64);
        rx.record(job.req.app, busy);
        let load = {
            let mut t = inner.lock_tracker(placement);
            t.completed((job.req.app, job.req.handler), busy, c.steps);
            LoadFeedback {
                queue_depth: rx.len() as u32,
                utilisation_permille: (t.last_utilisation() * 1000.0).round() as u16,
                queue_delay_ns: t.queue_delay_ns() as u64,
                service_ns: busy,
            }
        };
        last_done = inner.clock.now();
        job.sink.send(reply_for(&job.req, c, placement, load));
    }
}

/// How long an executor or agent goes without work before it stops polling.
const IDLE_AFTER: Duration = Duration::from_millis(10);

/// How long an idle executor or agent sleeps at a time (it looks at the shutdown flag between).
const IDLE_SLEEP: Duration = Duration::from_millis(100);

pub(super) fn agent_loop(inner: Arc<Inner>, rx: Receiver<AgentJob>) {
    let mut last_busy = Instant::now();
    loop {
        let got = if last_busy.elapsed() < IDLE_AFTER {
            recv_polling(&rx, Duration::from_millis(20))
        } else {
            rx.recv_timeout(IDLE_SLEEP)
        };
        let mut job = match got {
            Ok(j) => {
                last_busy = Instant::now();
                j
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if inner.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                continue;
            }
            Err(_) => return,
        };
        let n = job.descs.len();
        job.bufs.resize_with(n.max(job.bufs.len()), Vec::new);
        let r = one_sided_read(
            &inner.regions,
            job.app,
            job.descs.as_slice(),
            &mut job.bufs[..n],
        )
        .map(|()| job.bufs);
        match job.sink {
            AgentSink::Sync(s) => {
                let _ = s.try_send(r);
            }
            #[cfg(feature = "async")]
            AgentSink::Async(s) => {
                let _ = s.send(r);
            }
        }
    }
}
