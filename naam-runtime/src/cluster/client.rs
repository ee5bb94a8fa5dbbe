//! The synchronous in-process client and the Client placement's run.

use super::*;

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
            vm: {
                let mut vm = Vm::new();
                vm.set_cross_check(self.inner.config.cross_check.clone());
                vm
            },
            selectors: HashMap::new(),
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

/// A synchronous client of the in-process cluster (one call at a time).
pub struct Client {
    inner: Arc<Inner>,
    id: u32,
    seq: u64,
    tx: Sender<Reply>,
    rx: Receiver<Reply>,
    vm: Vm,
    transport: ClientPath<AgentTransport>,
    selectors: HashMap<HandlerKey, Selector>,
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
        let is_read = self
            .inner
            .registry
            .handler(req.app, req.handler)
            .is_ok_and(|h| h.kind == HandlerKind::Read);
        let start = Instant::now();
        let weights = self.inner.weights(key);
        let sel = self.selectors.entry(key).or_default();
        // The client decides Client vs server for reads, with one weighted pick; a server pick is
        // passed on to the switch as the placement. Writes always go to the owner.
        let choice = match placement {
            Some(p) => Some(p),
            None if is_read => sel.pick(&weights, |p| {
                (p == Placement::Client && self.inner.agent_available())
                    || self.inner.queues[p.index()].is_some()
            }),
            None => None,
        };
        let reply = if is_read && choice == Some(Placement::Client) {
            self.run_locally(&req)
        } else {
            let sink = ReplySink::Sync(self.tx.clone());
            match submit(&self.inner, req.clone(), sel, choice, sink) {
                Err(Refusal::Client(e)) => return Err(e),
                Err(refusal) => refusal.reply(&req),
                Ok(_) => {
                    let deadline = Instant::now() + self.inner.config.client_timeout;
                    loop {
                        let left = deadline.saturating_duration_since(Instant::now());
                        match recv_polling(&self.rx, left) {
                            Ok(r) if r.request_id == req.request_id => break r,
                            Ok(_) => continue, // a late reply to an earlier, timed-out call
                            Err(_) => {
                                return Err(ClientError::Timeout(self.inner.config.client_timeout))
                            }
                        }
                    }
                }
            }
        };
        self.inner.metrics.record(
            reply.placement,
            key,
            start.elapsed().as_nanos() as u64,
            reply.status,
        );
        Ok(reply)
    }

    fn call_with(
        &mut self,
        placement: Option<Placement>,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.send(placement, Request::for_call(app, handler, 0, args, descs)?)
    }

    fn run_locally(&mut self, req: &Request) -> Reply {
        let (reply, ran) = run_at_client(
            req,
            &self.inner.registry,
            &mut self.transport,
            &mut self.vm,
            self.inner.config.limits,
            self.inner.clock.as_ref(),
        );
        if let Some((service, steps)) = ran {
            self.inner.lock_tracker(Placement::Client).completed(
                (req.app, req.handler),
                service,
                steps,
            );
        }
        reply
    }
}

/// Runs read `req` at the Client placement over `path` (every step's data by one-sided READ).
/// Returns the reply, with the client-side service time (run time less fetch time) as its load
/// feedback, and `(service, steps)` when the handler ran, for the caller's load tracker.
pub(crate) fn run_at_client<T: OneSided>(
    req: &Request,
    registry: &Registry,
    path: &mut ClientPath<T>,
    vm: &mut Vm,
    limits: Limits,
    clock: &dyn Clock,
) -> (Reply, Option<(u64, u16)>) {
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
    let (c, cost) = run_message(req, handler, path, vm, limits, clock, |_| {
        Err(WriteError::NotOwner)
    });
    let service = clock
        .now()
        .saturating_sub(begin)
        .saturating_sub(cost.fetch_ns);
    let reply = reply_for(
        req,
        &c,
        Placement::Client,
        LoadFeedback {
            service_ns: service,
            ..LoadFeedback::default()
        },
    );
    (reply, Some((service, c.steps)))
}
