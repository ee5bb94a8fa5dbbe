//! The model pieces both virtual-time suites (`endpoints.rs`, `shards.rs`) build on: the
//! app's ids, its manifest, and the NIC's executors.

use bytes::Bytes;
use naam_proto::control::{AppManifest, Manifest};
use naam_proto::endpoint::{Channel, NicBackend, Routed, Transmit};
use naam_proto::onesided::{Completion, Operation};
use naam_proto::steering::{RemoteLoad, Selector};
use naam_proto::wire::{LoadFeedback, Reply, Request, Status};
use naam_proto::{Nanos, Placement};

pub(crate) const MS: Nanos = 1_000_000;
pub(crate) const APP: u32 = 1;
/// The model's write handler: adds one to a counter and answers the new value.
pub(crate) const INCREMENT: u32 = 1;
/// The model's read handler: answers the counter.
pub(crate) const READ: u32 = 2;

/// The NIC's executors, as naam-nic's: a read runs at once and answers the client directly
/// (payload `nic`); the regions of any server start can be mapped.
#[derive(Default)]
pub(crate) struct ModelNic {
    pub(crate) outbox: Vec<Transmit>,
    pub(crate) executed: u64,
    /// `executed` at the last load report (a report counts what ran since the one before).
    reported: u64,
}

impl NicBackend for ModelNic {
    fn dispatch(
        &mut self,
        req: Request,
        _sel: &mut Selector,
        _forced: Option<Placement>,
        reply_to: Channel,
        _out: &mut Reply,
    ) -> Routed {
        self.executed += 1;
        let r = Reply {
            app: req.app,
            request_id: req.request_id,
            status: Status::Ok,
            code: 0,
            steps: 1,
            placement: Placement::Nic,
            load: LoadFeedback::default(),
            payload: Bytes::from_static(b"nic"),
        };
        self.outbox.push(reply_to.reply(&r));
        Routed::Queued(Placement::Nic)
    }

    fn one_sided(&mut self, op: &Operation) -> Completion {
        Completion::error(
            op.app,
            op.id,
            Status::Unavailable,
            "no regions in the model",
        )
    }

    fn load_report(&mut self) -> RemoteLoad {
        let dequeues = self.executed - std::mem::replace(&mut self.reported, self.executed);
        RemoteLoad {
            dequeues,
            ..RemoteLoad::default()
        }
    }

    fn remap(&mut self, epoch: u64) -> Result<Manifest, String> {
        Ok(manifest(epoch))
    }
}

/// The model app's manifest at `epoch`.
pub(crate) fn manifest(epoch: u64) -> Manifest {
    Manifest {
        apps: vec![AppManifest {
            id: APP,
            name: "counter".into(),
            kind: "object".into(),
            params: serde_json::Value::Null,
            object: String::new(),
            object_hash: 0,
            handlers: Vec::new(),
            regions: Vec::new(),
        }],
        mode: "virtual".into(),
        policy: "model".into(),
        epoch,
        version: 0,
    }
}
