//! The simulation's side of the endpoints: naam-server's host backend and naam-nic's backend
//! over the clusters (each message run on the core that took it in, through the cluster's own
//! switch, admission and executor, its service time the cost model's), and the transport the
//! apps' client libraries submit through.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use naam_ebpf::abi::Descriptor;
use naam_runtime::cluster::{Cluster, HereRunner};
use naam_runtime::proto::control::{Manifest, SwitchCounters};
use naam_runtime::proto::endpoint::{
    Channel, HostBackend, NicBackend, Routed, SwitchHandle, VerbsAcceptor,
};
use naam_runtime::proto::onesided::{Completion, Operation};
use naam_runtime::proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_runtime::proto::step::{DmaModel, FetchError, OneSided};
use naam_runtime::proto::transport::{ClientError, Pipeline, Transport};
use naam_runtime::proto::wire::{Reply, Request};
use naam_runtime::proto::Placement;
use naam_runtime::RegionTable;

/// naam-server's host side in the simulation: each message runs where it arrived, on this
/// loop's core, through the cluster's own switch, admission and executor
/// ([`Cluster::dispatch_here`]); its service time is the cost model's.
pub(super) struct SimHost {
    pub(super) cluster: Arc<Cluster>,
    pub(super) runner: HereRunner,
    /// Service time of the messages run since the core last took it.
    pub(super) busy_ns: u64,
    /// Messages the cluster queued at an executor (the simulation has none: a bug if not 0).
    pub(super) stranded: u64,
    /// The card's eSwitch, when the profile has one: what reaches the host's loops was
    /// steered to them, and the loops do not steer it again.
    pub(super) eswitch: Option<SimSwitch>,
}

/// The simulated card's eSwitch as naam-server's endpoint sees it (the event loop steers by
/// its map; see `World::sync_eswitch`).
pub(super) struct SimSwitch;

impl SwitchHandle for SimSwitch {
    fn describe(&self) -> String {
        "the simulated card's eSwitch".into()
    }
    fn counters(&self) -> Result<SwitchCounters, String> {
        Err("the simulation's eSwitch is not counted apart (see the report's placements)".into())
    }
    fn pin_nic_share(&self, _permille: Option<u32>) {}
}

impl HostBackend for SimHost {
    fn dispatch(
        &mut self,
        req: &mut Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        _reply_to: &Channel,
        out: &mut Reply,
    ) -> Routed {
        let routed =
            self.cluster
                .dispatch_here(&mut self.runner, req, sel, forced, || |_: Reply| {}, out);
        match &routed {
            Routed::Answered => self.busy_ns += out.load.service_ns,
            Routed::Queued(_) => self.stranded += 1,
            _ => {}
        }
        routed
    }
    fn next_client_id(&mut self) -> u32 {
        self.cluster.next_client_id()
    }
    fn nic_up(&self) -> bool {
        self.cluster.remote_nic_up()
    }
    fn nic_load(&mut self, load: &RemoteLoad) {
        self.cluster.absorb_remote_load(load);
    }
    fn nic_gone(&mut self) {
        self.cluster.remote_nic_down();
    }
    fn handlers(&self, app: u32) -> Option<Vec<u32>> {
        let registry = self.cluster.registry();
        let a = registry.app(app)?;
        Some(a.handlers.values().map(|h| h.id).collect())
    }
    fn has_handler(&self, app: u32, handler: u32) -> bool {
        self.cluster.registry().handler(app, handler).is_ok()
    }
    fn client_share(&self) -> Option<ClientShare> {
        self.cluster.client_share()
    }
    fn weights(&self, app: u32, handler: u32, share: Option<&mut ClientShare>) -> Weights {
        match share {
            Some(s) => self.cluster.client_weights(s, app, handler),
            None => self.cluster.weights(app, handler),
        }
    }
    fn congest(&mut self, extra_ns: Option<u64>) {
        match extra_ns {
            Some(ns) => self.cluster.congestion().limit_host(ns),
            None => self.cluster.congestion().clear(),
        }
    }
    fn switch(&self) -> Option<&dyn SwitchHandle> {
        self.eswitch.as_ref().map(|s| s as &dyn SwitchHandle)
    }
    fn verbs(&self) -> Option<&dyn VerbsAcceptor> {
        None
    }
}

/// naam-nic's side in the simulation: messages run on the Arm core that took them in.
pub(super) struct SimNic {
    pub(super) cluster: Arc<Cluster>,
    pub(super) runner: HereRunner,
    pub(super) busy_ns: u64,
    pub(super) stranded: u64,
    pub(super) dma: DmaModel,
}

impl NicBackend for SimNic {
    fn dispatch(
        &mut self,
        mut req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        _reply_to: Channel,
        out: &mut Reply,
    ) -> Routed {
        let routed = self.cluster.dispatch_here(
            &mut self.runner,
            &mut req,
            sel,
            forced,
            || |_: Reply| {},
            out,
        );
        match &routed {
            Routed::Answered => self.busy_ns += out.load.service_ns,
            Routed::Queued(_) => self.stranded += 1,
            _ => {}
        }
        routed
    }
    fn one_sided(&mut self, op: &Operation) -> Completion {
        let c = naam_runtime::onesided::execute(self.cluster.regions(), op);
        self.busy_ns += self.dma.cost_ns(c.data.len() as u64);
        c
    }
    fn load_report(&mut self) -> RemoteLoad {
        self.runner.flush(&self.cluster);
        self.cluster.take_load_report(Placement::Nic)
    }
    fn remap(&mut self, _epoch: u64) -> Result<Manifest, String> {
        Err("the simulated server does not restart".into())
    }
}

/// What a client's MICA pipeline submitted and was answered, between it and the event loop.
#[derive(Default)]
pub(super) struct ClientIo {
    pub(super) submitted: Vec<(u64, Request)>,
    pub(super) answers: Vec<(u64, Result<Reply, ClientError>)>,
    pub(super) next_token: u64,
    pub(super) in_flight: usize,
    pub(super) window: usize,
}

/// MICA's client library's transport in the simulation: a submission waits for the event
/// loop to hand it to the client's endpoint; answers come back through the loop.
pub(super) struct SimTransport(pub Rc<RefCell<ClientIo>>);

impl Transport for SimTransport {
    fn call(
        &mut self,
        _app: u32,
        _handler: u32,
        _args: &[u8],
        _descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        Err(ClientError::Session(
            "the simulation's clients only pipeline (no call waits)".into(),
        ))
    }
    fn backoff(&mut self, _attempt: u32) {}
}

impl Pipeline for SimTransport {
    fn submit(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<u64, ClientError> {
        let mut io = self.0.borrow_mut();
        if io.in_flight >= io.window {
            return Err(ClientError::Busy(Placement::Host));
        }
        let req = Request::for_call(app, handler, 0, args, descs)?;
        io.next_token += 1;
        let token = io.next_token;
        io.in_flight += 1;
        io.submitted.push((token, req));
        Ok(token)
    }
    fn poll(&mut self, _block: bool) -> Vec<(u64, Result<Reply, ClientError>)> {
        let mut io = self.0.borrow_mut();
        let answers = std::mem::take(&mut io.answers);
        io.in_flight -= answers.len().min(io.in_flight);
        answers
    }
    fn in_flight(&self) -> usize {
        self.0.borrow().in_flight
    }
    fn window(&self) -> usize {
        self.0.borrow().window
    }
}

/// A client's one-sided READs of one server's memory, for the Client placement: each is
/// served at once by the agent's own code against the server's region table (rkey, rights
/// and bounds checked as an RNIC checks them), and its bytes are noted for the event loop,
/// which times the READ through the rack and the card's RDMA engine. The data is what memory
/// held when the client's handler started (the simulation runs a handler whole at once).
pub(super) struct SimReads {
    pub(super) regions: Arc<RegionTable>,
    /// Bytes of each READ since the event loop last took them (one per step).
    pub(super) reads: Vec<u64>,
}

impl OneSided for SimReads {
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, FetchError> {
        naam_runtime::executor::one_sided_read(&self.regions, app, descs, bufs)?;
        self.reads
            .push(bufs.iter().take(descs.len()).map(|b| b.len() as u64).sum());
        // Timed by the event loop, not here.
        Ok(0)
    }
}
