//! The runtime's [`Transport`]s (the trait is naam-proto's): the fabrics that carry a request
//! and return its reply (the in-process cluster's [`crate::cluster::Client`], the UDP fabric's
//! [`crate::udp::UdpClient`], or [`Direct`] execution), and how they wait before
//! retrying a message the server answered `Busy` or `Conflict`.

use std::collections::HashMap;
use std::sync::Arc;

use naam_ebpf::abi::Descriptor;

use crate::cluster::{error_reply, install, AppSpec, ClusterError};
use crate::executor::{apply_owned, run_in_place, HostPath};
use crate::HandlerEntry;
use crate::RegionTable;
use crate::Registry;
use crate::SystemClock;
use naam_proto::step::HandlerKind;
use naam_proto::step::{Limits, MessageStart, StepMachine, WriteError};
use naam_proto::transport::ClientError;
use naam_proto::wire::{LoadFeedback, Reply, ReplyView, Request, Status};
use naam_proto::Placement;
use naam_vm::VerifierConfig;
use naam_vm::Vm;

/// Waits before retry number `attempt` of a message that lost a race or met a full queue:
/// yields for the first 15 attempts (the other writer is usually done), then sleeps
/// `attempt` microseconds, at most a millisecond.
pub fn backoff(attempt: u32) {
    if attempt < 16 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros((attempt as u64).min(1000)));
    }
}

use naam_proto::transport::Transport;

impl Transport for crate::cluster::Client {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        crate::cluster::Client::call(self, app, handler, args, descs)
    }

    fn backoff(&mut self, attempt: u32) {
        backoff(attempt)
    }
}

/// A transport pinned to one placement (tests, placement baselines).
pub struct Pinned {
    /// The in-process cluster client every call goes through: reads run at `placement`, writes
    /// at their owner.
    pub client: crate::cluster::Client,
    /// Where reads run.
    pub placement: naam_proto::Placement,
}

impl Transport for Pinned {
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        self.client
            .call_at(self.placement, app, handler, args, descs)
    }

    fn backoff(&mut self, attempt: u32) {
        backoff(attempt)
    }
}

/// Runs every message in the caller's thread at Host placement, writes included (this transport
/// is the owner of every app): the NAAM execution path without any fabric, for benchmarks against
/// native code and for embedding. Not shared between threads.
pub struct Direct {
    regions: Arc<RegionTable>,
    registry: Registry,
    region_keys: HashMap<(u32, String), u64>,
    vm: Vm,
    path: HostPath,
    clock: SystemClock,
    limits: Limits,
    next_id: u64,
    /// Every message runs in this machine: replies are split off its buffer and reuse it once
    /// the caller drops them (write batches are read in the VM's context, never copied).
    machine: StepMachine,
    /// The handler the last message named, by `(app, handler)`: a client calls the same few
    /// handlers message after message, and the registry's two lookups were 2% of a GET.
    last_handler: Option<((u32, u32), Arc<HandlerEntry>)>,
}

impl Direct {
    /// Installs `apps` and returns the transport.
    pub fn new(apps: &[AppSpec]) -> Result<Direct, ClusterError> {
        let installed = install(apps, &VerifierConfig::default())?;
        let regions = Arc::new(installed.regions);
        Ok(Direct {
            path: HostPath::new(regions.clone()),
            regions,
            registry: installed.registry,
            region_keys: installed.region_keys,
            vm: Vm::new(),
            clock: SystemClock::new(),
            limits: Limits::default(),
            next_id: 0,
            machine: StepMachine::unused(),
            last_handler: None,
        })
    }

    /// The rkey of `app`'s region `name`.
    pub fn region_key(&self, app: u32, name: &str) -> Option<u64> {
        self.region_keys.get(&(app, name.to_string())).copied()
    }

    /// Instructions the last message executed, when its handler runs on the interpreter (0
    /// under the JIT): what the simulator's cost model charges per instruction
    /// (`naam-bench sim calibrate`).
    pub fn last_insns(&self) -> u64 {
        self.machine.insns()
    }
}

impl Direct {
    /// Runs handler `handler` of `app` on `args` and `descs` to its end in the transport's
    /// machine, then hands `with` and the machine to `ended` (with the request id); a handler
    /// the app does not have is answered with an error reply, handed with `with` to `refused`.
    /// The message runs from the caller's own buffers: no request is built.
    #[inline(always)]
    fn run<W, R>(
        &mut self,
        (app, handler): (u32, u32),
        (args, descs): (&[u8], &[Descriptor]),
        with: W,
        ended: impl FnOnce(W, &mut StepMachine, u64) -> R,
        refused: impl FnOnce(W, Reply) -> R,
    ) -> Result<R, ClientError> {
        self.next_id += 1;
        let request_id = self.next_id;
        Request::check_call(args, descs)?;
        let entry: &Arc<HandlerEntry> = match &mut self.last_handler {
            Some((named, h)) if *named == (app, handler) => h,
            last => match self.registry.handler(app, handler) {
                Ok(h) => &last.insert(((app, handler), h.clone())).1,
                Err(e) => {
                    let req = Request::for_call(app, handler, request_id, args, descs)?;
                    let reply =
                        error_reply(&req, Status::UnknownHandler, Placement::Host, e.to_string());
                    return Ok(refused(with, reply));
                }
            },
        };
        let regions = &self.regions;
        let writes = entry.kind == HandlerKind::Write;
        let msg = MessageStart {
            request_id,
            steps: 0,
            state: MessageStart::NO_STATE,
            partial_reply: &[],
            descriptors: descs,
        };
        run_in_place(
            msg,
            args,
            entry,
            &mut self.path,
            &mut self.vm,
            self.limits,
            &self.clock,
            &mut self.machine,
            |batch, in_place| {
                if writes {
                    apply_owned(regions, batch, in_place)
                } else {
                    Err(WriteError::NotOwner)
                }
            },
        );
        Ok(ended(with, &mut self.machine, request_id))
    }
}

impl Transport for Direct {
    /// Runs the message and returns its reply, split off the machine's buffer (reused once
    /// the caller drops it).
    #[inline]
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError> {
        let ended = |(), machine: &mut StepMachine, request_id| {
            let c = machine.outcome();
            Reply {
                app,
                request_id,
                status: c.status,
                code: c.code,
                steps: c.steps,
                placement: Placement::Host,
                load: LoadFeedback::default(),
                payload: c.payload,
            }
        };
        self.run((app, handler), (args, descs), (), ended, |(), reply| reply)
    }

    /// Runs the message and lends `read` the reply where it is, in the transport's machine:
    /// nothing split off, counted or copied on the way (a write's answer included: no one
    /// will ask this transport for it again).
    #[inline]
    fn call_with<R>(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
        read: impl FnOnce(ReplyView<'_>) -> R,
    ) -> Result<R, ClientError> {
        self.run(
            (app, handler),
            (args, descs),
            read,
            |read, machine, _| read(machine.ended()),
            |read, reply| read(reply.view()),
        )
    }

    fn backoff(&mut self, attempt: u32) {
        backoff(attempt)
    }
}
