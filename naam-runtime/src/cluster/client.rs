//! The synchronous in-process client and the Client placement's run.

use super::here::Apply;
use naam_vm::HandlerEngine;

use super::{
    bounded, error_reply, executor, recv_polling, reply_for, resume_served, run_message, serve,
    spin_for, submit, thread_vm, AgentJob, AgentResult, AgentSink, Arc, ByteArena, Bytes,
    ClientError, ClientPath, Clock, Cluster, Descriptor, Descriptors, FetchError, HandlerEntry,
    HandlerKey, HandlerKind, HandlerSlot, HostPath, Inner, Instant, IntMap, Limits, LoadFeedback,
    LocalLoad, MessageStart, MetricsShard, Nanos, OneSided, Ordering, Placement, Receiver, Refusal,
    Registry, RegistryView, Reply, ReplySink, Request, Selector, Sender, Served, Status,
    StepMachine, ThreadVm, WeightCell, Weights, WriteError,
};

impl Cluster {
    /// A new synchronous client of this cluster, with its own id and reply channel.
    pub fn client(&self) -> Client {
        let id = self.inner.next_client.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = bounded(64);
        Client {
            transport: ClientPath::new(AgentTransport::new(self.inner.clone())),
            inner: self.inner.clone(),
            id,
            seq: 0,
            tx,
            rx,
            vm: thread_vm(&self.inner.config),
            steered: IntMap::default(),
            host: HostPath::new(self.inner.regions.clone()),
            metrics: self.inner.metrics.shard(),
            local: LocalLoad::new(Placement::Host, self.inner.clock.now()),
            machine: StepMachine::unused(),
            args: ByteArena::default(),
            registry: RegistryView::new(&self.inner),
        }
    }
}

/// The in-process one-sided transport: READs served by the agent thread.
pub struct AgentTransport {
    inner: Arc<Inner>,
    tx: Sender<AgentResult>,
    rx: Receiver<AgentResult>,
}

impl AgentTransport {
    pub(super) fn new(inner: Arc<Inner>) -> Self {
        let (tx, rx) = bounded(1);
        AgentTransport { inner, tx, rx }
    }
}

impl OneSided for AgentTransport {
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, FetchError> {
        // A late answer to a READ that timed out must not be taken for this one.
        while self.rx.try_recv().is_ok() {}
        let start = Instant::now();
        let job = AgentJob {
            app,
            descs: Descriptors::from_slice(descs).unwrap_or_default(),
            bufs: bufs.iter_mut().map(std::mem::take).collect(),
            sink: AgentSink::Sync(self.tx.clone()),
        };
        let unavailable = || FetchError::Unavailable("the one-sided agent did not answer".into());
        if self
            .inner
            .agent
            .send_timeout(job, self.inner.config.client_timeout)
            .is_err()
        {
            return Err(unavailable());
        }
        let got = recv_polling(&self.rx, self.inner.config.client_timeout)
            .map_err(|_| unavailable())??;
        for (dst, src) in bufs.iter_mut().zip(got) {
            *dst = src;
        }
        let rtt = start.elapsed().as_nanos() as u64;
        if let Ok(mut e) = self.inner.client_rtt.lock() {
            e.add(rtt as f64);
        }
        Ok(rtt)
    }
}

/// A client's steering state for one handler: the memory of its picks, and the cell its
/// weights are published in (taken the first time the steering has one for it).
#[derive(Default)]
struct Steered {
    selector: Selector,
    weights: Option<Arc<WeightCell>>,
    /// The handler's place in this client's metrics shard, taken the first time a call runs
    /// here: its latency is then recorded with no second lookup by handler.
    metrics_slot: Option<HandlerSlot>,
}

impl Steered {
    /// A read's weighted pick among the placements that can take it, by the weights the
    /// steering published for handler `key` (the host's alone until it has).
    fn pick(&mut self, inner: &Inner, key: HandlerKey) -> Option<Placement> {
        if self.weights.is_none() {
            self.weights = inner.weight_cell(key);
        }
        let weights = self
            .weights
            .as_ref()
            .map_or(Weights::all(Placement::Host), |c| c.load());
        self.selector.pick(&weights, |p| {
            (p == Placement::Client && inner.agent_available()) || inner.queues[p.index()].is_some()
        })
    }
}

/// A synchronous client of the in-process cluster (one call at a time).
pub struct Client {
    inner: Arc<Inner>,
    id: u32,
    seq: u64,
    tx: Sender<Reply>,
    rx: Receiver<Reply>,
    vm: ThreadVm,
    transport: ClientPath<AgentTransport>,
    steered: IntMap<HandlerKey, Steered>,
    /// Host memory, for the messages this client runs to completion itself.
    host: HostPath,
    metrics: MetricsShard,
    local: LocalLoad,
    /// The machine the messages this client runs itself run in: their replies are split off
    /// its buffer, and once a caller has dropped one the next reuses its memory.
    machine: StepMachine,
    /// The args of requests this client builds are copied here.
    args: ByteArena,
    /// The registry this client's calls route and run with.
    registry: RegistryView,
}

impl Drop for Client {
    fn drop(&mut self) {
        let now = self.inner.clock.now();
        self.local.flush(&self.inner, now, Apply::Now);
    }
}

impl Client {
    fn next_id(&mut self) -> u64 {
        self.seq += 1;
        naam_proto::wire::request_id(self.id, self.seq)
    }

    /// Sends one message, placed by the steering weights; waits for the reply.
    pub fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.call_with(None, app, handler, args, descs)
    }

    /// Sends one message to `placement` (reads only for the client; writes always go to the
    /// owner), bypassing steering.
    pub fn call_at(
        &mut self,
        placement: Placement,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.call_with(Some(placement), app, handler, args, descs)
    }

    /// Where a message goes: a read's weighted pick (or `placement`), a write's owner.
    fn choose(
        &mut self,
        placement: Option<Placement>,
        key: HandlerKey,
        is_read: bool,
    ) -> Option<Placement> {
        match placement {
            Some(p) => Some(p),
            None if is_read => self.steered.entry(key).or_default().pick(&self.inner, key),
            None => None,
        }
    }

    /// Sends a prepared request (its request id is replaced by a fresh one unless it is a retry).
    pub fn send(
        &mut self,
        placement: Option<Placement>,
        mut req: Request,
    ) -> Result<Reply, ClientError> {
        if req.flags & naam_proto::wire::flags::RETRY == 0 {
            req.request_id = self.next_id();
        }
        req.validate()?;
        let key = (req.app, req.handler);
        let kind = RegistryView::with(
            self,
            |c| &mut c.registry,
            |_, registry| registry.handler(req.app, req.handler).ok().map(|h| h.kind),
        );
        let is_read = kind == Some(HandlerKind::Read);
        let start = Instant::now();
        let choice = self.choose(placement, key, is_read);
        let reply = if is_read && choice == Some(Placement::Client) {
            self.run_locally(&req)
        } else if kind == Some(HandlerKind::Write) && self.owned_here(req.app) {
            self.write_here(&req)
        } else {
            self.submit_and_wait(req, choice)?
        };
        self.metrics.record(
            reply.placement,
            key,
            start.elapsed().as_nanos() as u64,
            reply.status,
        );
        Ok(reply)
    }

    /// Whether this client runs `app`'s writes itself: the host owns them and the cluster has
    /// host cores (in one process, the calling thread is one of them).
    fn owned_here(&self, app: u32) -> bool {
        self.inner.owner_of(app) == Some(Placement::Host)
            && self.inner.queues[Placement::Host.index()].is_some()
    }

    /// Queues `req` at an executor and waits for its reply.
    fn submit_and_wait(
        &mut self,
        req: Request,
        choice: Option<Placement>,
    ) -> Result<Reply, ClientError> {
        let key = (req.app, req.handler);
        let sink = ReplySink::Sync(self.tx.clone());
        let sel = &mut self.steered.entry(key).or_default().selector;
        match submit(&self.inner, req.clone(), sel, choice, sink) {
            Err(Refusal::Client(e)) => Err(e),
            Err(refusal) => Ok(refusal.reply(&req)),
            Ok(_) => {
                let deadline = Instant::now() + self.inner.config.client_timeout;
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match recv_polling(&self.rx, left) {
                        Ok(r) if r.request_id == req.request_id => return Ok(r),
                        Ok(_) => continue, // a late reply to an earlier, timed-out call
                        Err(_) => {
                            return Err(ClientError::Timeout(self.inner.config.client_timeout))
                        }
                    }
                }
            }
        }
    }

    /// Runs write `req` at the host in this thread, as an executor would (owner, dedup and
    /// budget rules included): run to completion, no hand-off. Writers on several threads are
    /// safe because every handler's writes are guarded by compare-and-swap, as with several
    /// host executors.
    fn write_here(&mut self, req: &Request) -> Reply {
        let inner = &*self.inner;
        if let Some(what) = inner.over_budget(req.app) {
            return Refusal::Budget(what).reply(req);
        }
        let o = match inner.owner(req.app) {
            Some(o) => o,
            None => return Refusal::Status(Status::UnknownApp).reply(req),
        };
        if o.draining.load(Ordering::SeqCst) {
            return Refusal::Status(Status::Busy).reply(req);
        }
        o.inflight.fetch_add(1, Ordering::SeqCst);
        if o.draining.load(Ordering::SeqCst) || inner.owner_of(req.app) != Some(Placement::Host) {
            o.inflight.fetch_sub(1, Ordering::SeqCst);
            return Refusal::Status(Status::Busy).reply(req);
        }
        let start = inner.clock.now();
        let extra = inner.congestion.host_extra_ns();
        spin_for(extra);
        // `serve` leaves the owner's in-flight count when the write completes.
        let mut served = serve(
            inner,
            req,
            None,
            &mut self.host,
            &mut self.vm,
            &mut self.machine,
        );
        // A torn read waits here, on the writer's own thread.
        let c = loop {
            match served {
                Served::Done(c, _) => break c,
                Served::Parked { run, write } => {
                    inner.clock.wait_until(run.resume_at);
                    served = resume_served(inner, req, run, write, &mut self.host, &mut self.vm);
                }
            }
        };
        let end = inner.clock.now();
        let service = end.saturating_sub(start);
        self.local
            .completed(inner, (req.app, req.handler), service, c.steps, end);
        reply_for(
            req,
            c,
            Placement::Host,
            LoadFeedback {
                service_ns: service,
                ..LoadFeedback::default()
            },
        )
    }

    fn call_with(
        &mut self,
        placement: Option<Placement>,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        Request::check_call(args, descs)?;
        // Found once for the whole call: a read run here uses the handler found now.
        let mut cache = self.registry.take();
        let r = match cache.as_mut() {
            Some(c) => self.call_on(c.load(), placement, app, handler, args, descs),
            None => {
                let registry = self.inner.registry.load_full();
                self.call_on(&registry, placement, app, handler, args, descs)
            }
        };
        self.registry.put(cache);
        r
    }

    /// [`Client::call_with`] on registry version `registry`: a read the steering (or
    /// `placement`) puts at the host runs here, to completion; anything else is sent.
    fn call_on(
        &mut self,
        registry: &Registry,
        placement: Option<Placement>,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        let key = (app, handler);
        let is_read = registry
            .handler(app, handler)
            .is_ok_and(|h| h.kind == HandlerKind::Read);
        if !is_read {
            let req = self.request(app, handler, args, descs)?;
            return self.send(placement, req);
        }
        // One lookup of the handler's steering entry serves the pick and the metrics slot.
        let steered = self.steered.entry(key).or_default();
        let choice = placement.or_else(|| steered.pick(&self.inner, key));
        if choice != Some(Placement::Host) || self.inner.queues[Placement::Host.index()].is_none() {
            let req = self.request(app, handler, args, descs)?;
            return self.send(choice, req);
        }
        let metrics = &self.metrics;
        let slot = *steered
            .metrics_slot
            .get_or_insert_with(|| metrics.slot(key));
        let request_id = self.next_id();
        // The fields are borrowed apart: no reference count of the shared cluster state is
        // touched per message (two client threads would bounce its cache line).
        let Client {
            inner,
            vm,
            host,
            local,
            metrics,
            machine,
            ..
        } = self;
        let inner = &**inner;
        let start = inner.clock.now();
        let (reply, end) = read_here(
            inner,
            registry,
            HostRun {
                vm,
                host,
                local,
                machine,
            },
            key,
            request_id,
            args,
            descs,
            start,
        );
        metrics.record_at(
            reply.placement,
            slot,
            end.saturating_sub(start),
            reply.status,
        );
        Ok(reply)
    }

    /// A request for a call that leaves this thread's fast path: its args are copied into
    /// the client's arena, not into an allocation of their own.
    fn request(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Request, ClientError> {
        let descriptors = naam_proto::wire::Descriptors::from_slice(descs)?;
        Ok(Request::new(
            app,
            handler,
            0,
            self.args.copy(args),
            descriptors,
        ))
    }

    fn run_locally(&mut self, req: &Request) -> Reply {
        let (reply, ran) = RegistryView::with(
            self,
            |c| &mut c.registry,
            |client, registry| {
                run_at_client(
                    req,
                    registry,
                    &mut client.transport,
                    &mut client.vm,
                    client.inner.config.limits,
                    client.inner.clock.as_ref(),
                )
            },
        );
        if let Some(ran) = ran {
            self.inner.lock_tracker(Placement::Client).completed(
                (req.app, req.handler),
                ran.service_ns,
                ran.steps,
            );
        }
        reply
    }
}

/// What a read run at the Client placement did, for the caller's load tracker (and a
/// simulation's cost model).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientRan {
    /// Client-side service time: run time less the fetches' (one-sided READ) time.
    pub service_ns: u64,
    /// Steps over the message's life.
    pub steps: u16,
    /// Instructions the engine executed.
    pub insns: u64,
    /// Of those, the memory accesses and helper calls (where the engine counts them).
    pub mix: naam_proto::step::InsnMix,
}

/// Runs read `req` at the Client placement over `path` (every step's data by one-sided READ):
/// the client's side of a client-placed message, in every driver (the in-process client, the
/// UDP client, and the simulator's clients). Returns the reply, with the client-side service
/// time as its load feedback, and what ran when the handler ran.
pub fn run_at_client<T: OneSided, E: HandlerEngine>(
    req: &Request,
    registry: &Registry,
    path: &mut ClientPath<T>,
    vm: &mut E,
    limits: Limits,
    clock: &dyn Clock,
) -> (Reply, Option<ClientRan>) {
    let handler: &Arc<HandlerEntry> = match registry.handler(req.app, req.handler) {
        Ok(h) => h,
        Err(e) => {
            let r = error_reply(
                req,
                Status::UnknownHandler,
                Placement::Client,
                e.to_string(),
            );
            return (r, None);
        }
    };
    let begin = clock.now();
    let (c, cost) = run_message(req, handler, path, vm, limits, clock, |_, _| {
        Err(WriteError::NotOwner)
    });
    let service = clock
        .now()
        .saturating_sub(begin)
        .saturating_sub(cost.fetch_ns);
    let ran = ClientRan {
        service_ns: service,
        steps: c.steps,
        insns: c.insns,
        mix: c.mix,
    };
    let reply = reply_for(
        req,
        c,
        Placement::Client,
        LoadFeedback {
            service_ns: service,
            ..LoadFeedback::default()
        },
    );
    (reply, Some(ran))
}

/// What a client runs host messages with: its engine state, its view of host memory, and
/// where it counts the load.
struct HostRun<'a> {
    vm: &'a mut ThreadVm,
    host: &'a mut HostPath,
    local: &'a mut LocalLoad,
    machine: &'a mut StepMachine,
}

/// Runs read `key` at the host in the calling thread, from the caller's own buffers: no
/// request is built, nothing is queued, the handler's steps run back to back (eRPC's and
/// MICA's run to completion). The message counts against its app's budget and into the
/// host's load like an executor's. `start` is the clock's time now; returns the reply and the
/// clock's time at its end.
#[allow(clippy::too_many_arguments)]
fn read_here(
    inner: &Inner,
    registry: &Registry,
    run: HostRun<'_>,
    key: HandlerKey,
    request_id: u64,
    args: &[u8],
    descs: &[Descriptor],
    start: Nanos,
) -> (Reply, Nanos) {
    let (app, handler) = key;
    let refuse = |status: Status, why: String| Reply {
        app,
        request_id,
        status,
        code: 0,
        steps: 0,
        placement: Placement::Host,
        load: LoadFeedback::default(),
        payload: Bytes::from(why.into_bytes()),
    };
    let entry = match registry.handler(app, handler) {
        Ok(h) => h,
        Err(e) => return (refuse(Status::UnknownHandler, e.to_string()), start),
    };
    if let Some(what) = inner.over_budget_at(app, start) {
        let why = format!("app {app} spent its {what} budget for this period: retry later");
        return (refuse(Status::Busy, why), start);
    }
    let extra = inner.congestion.host_extra_ns();
    if extra > 0 {
        spin_for(extra);
    }
    let msg = MessageStart {
        request_id,
        steps: 0,
        state: MessageStart::NO_STATE,
        partial_reply: &[],
        descriptors: descs,
    };
    let at = executor::Place {
        path: run.host,
        vm: run.vm,
        limits: inner.config.limits,
        clock: inner.clock.as_ref(),
        machine: Some(run.machine),
    };
    let (c, _) =
        executor::run_message_parts(msg, args, entry, at, |_, _| Err(WriteError::NotOwner));
    if c.retries > 0 {
        inner.spend(app, c.retries as u64, 0);
    }
    let end = inner.clock.now();
    let service = end.saturating_sub(start);
    run.local.completed(inner, key, service, c.steps, end);
    let reply = Reply {
        app,
        request_id,
        status: c.status,
        code: c.code,
        steps: c.steps,
        placement: Placement::Host,
        load: LoadFeedback {
            service_ns: service,
            ..LoadFeedback::default()
        },
        payload: c.payload,
    };
    (reply, end)
}
