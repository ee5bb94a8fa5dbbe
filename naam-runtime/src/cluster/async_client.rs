//! The asynchronous (tokio) client of the in-process cluster, behind the `async` feature: many
//! calls in flight, replies through tokio oneshots, and the Client placement awaiting its
//! one-sided READs without blocking the runtime.

use super::{
    error_reply, reply_for, submit, thread_vm, AgentJob, AgentSink, Arc, AtomicU64, ClientError,
    Cluster, Descriptor, Duration, HandlerEntry, HandlerKey, HandlerKind, HashMap, Inner, Instant,
    LoadFeedback, Mutex, Ordering, Placement, Refusal, Reply, ReplySink, Request, Selector, Status,
    WriteError,
};
use crate::executor::run_step;
use naam_proto::step::{Action, StepMachine};

impl Cluster {
    /// An asynchronous (tokio) client; cheap to clone and share (feature `async`).
    pub fn async_client(&self) -> AsyncClient {
        let id = self.inner.next_client.fetch_add(1, Ordering::SeqCst);
        AsyncClient {
            inner: self.inner.clone(),
            id,
            seq: Arc::new(AtomicU64::new(0)),
            selector: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// An asynchronous client: many calls in flight, replies through tokio oneshots; client-side
/// execution awaits one-sided READs without blocking the runtime.
#[derive(Clone)]
pub struct AsyncClient {
    inner: Arc<Inner>,
    id: u32,
    seq: Arc<AtomicU64>,
    selector: Arc<Mutex<HashMap<HandlerKey, Selector>>>,
}

impl AsyncClient {
    /// Sends one message placed by the steering weights and awaits the reply.
    pub async fn call(
        &self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        let id = naam_proto::wire::request_id(self.id, seq);
        let req = Request::for_call(app, handler, id, args, descs)?;
        let key = (app, handler);
        let start = Instant::now();
        let is_read = self
            .inner
            .registry
            .load()
            .handler(app, handler)
            .is_ok_and(|h| h.kind == HandlerKind::Read);
        let choice = if is_read {
            let mut sels = self.selector.lock().unwrap_or_else(|e| e.into_inner());
            let w = self.inner.weights(key);
            sels.entry(key).or_default().pick(&w, |p| {
                (p == Placement::Client && self.inner.agent_available())
                    || self.inner.queues[p.index()].is_some()
            })
        } else {
            None
        };
        let reply = if choice == Some(Placement::Client) {
            self.run_locally(&req).await
        } else {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let submitted = {
                let mut sels = self.selector.lock().unwrap_or_else(|e| e.into_inner());
                let sel = sels.entry(key).or_default();
                submit(&self.inner, req.clone(), sel, choice, ReplySink::Async(tx))
            };
            match submitted {
                Err(Refusal::Client(e)) => return Err(e),
                Err(refusal) => refusal.reply(&req),
                Ok(_) => match tokio::time::timeout(self.inner.config.client_timeout, rx).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => return Err(ClientError::Shutdown),
                    Err(_) => return Err(ClientError::Timeout(self.inner.config.client_timeout)),
                },
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

    async fn run_locally(&self, req: &Request) -> Reply {
        // Owned, not a registry guard: the run awaits, and may go on another thread.
        let looked_up = self
            .inner
            .registry
            .load()
            .handler(req.app, req.handler)
            .cloned();
        let handler: Arc<HandlerEntry> = match looked_up {
            Ok(h) => h,
            Err(e) => {
                return error_reply(
                    req,
                    Status::UnknownHandler,
                    Placement::Client,
                    e.to_string(),
                )
            }
        };
        let mut vm = thread_vm(&self.inner.config);
        let (mut m, mut action) = StepMachine::start(
            req.into(),
            handler.app,
            handler.kind,
            Placement::Client,
            self.inner.config.limits,
        );
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        loop {
            action = match action {
                Action::Complete => {
                    let c = m.outcome();
                    return reply_for(req, c, Placement::Client, LoadFeedback::default());
                }
                Action::Write => m.writes_applied(Err(WriteError::NotOwner)),
                Action::Fetch => {
                    let descs = *m.current();
                    if let Some(ns) = m.retry_backoff_ns() {
                        tokio::time::sleep(Duration::from_nanos(ns)).await;
                    }
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let job = AgentJob {
                        app: req.app,
                        descs,
                        bufs: std::mem::take(&mut bufs),
                        sink: AgentSink::Async(tx),
                    };
                    if self.inner.agent.try_send(job).is_err() {
                        return error_reply(
                            req,
                            Status::Busy,
                            Placement::Client,
                            "the one-sided agent's queue is full".into(),
                        );
                    }
                    match tokio::time::timeout(self.inner.config.client_timeout, rx).await {
                        Ok(Ok(Ok(got))) => {
                            bufs = got;
                            let grants: Vec<naam_proto::step::Grant> = bufs[..descs.len()]
                                .iter()
                                .map(|b| naam_proto::step::Grant::read(b))
                                .collect();
                            run_step(&mut m, &mut vm, &handler.exe, &req.args, &grants, 0)
                        }
                        Ok(Ok(Err(e))) => m.fetch_failed(&e.into()),
                        _ => {
                            return error_reply(
                                req,
                                Status::Unavailable,
                                Placement::Client,
                                "the one-sided agent did not answer".into(),
                            )
                        }
                    }
                }
            };
        }
    }
}
