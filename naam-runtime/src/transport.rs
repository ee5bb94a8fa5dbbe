//! What application client libraries send messages through: any fabric that carries a request
//! and returns its reply (the in-process cluster's [`crate::cluster::Client`] now; UDP and verbs
//! clients later).

use naam_ebpf::abi::Descriptor;

use crate::cluster::ClientError;
use crate::wire::Reply;

/// Sends one active message and returns its reply.
pub trait Transport {
    /// Sends `handler` of `app` with `args` and `descs`, placed by the fabric's steering.
    fn call(
        &mut self,
        app: u32,
        handler: u32,
        args: &[u8],
        descs: &[Descriptor],
    ) -> Result<Reply, ClientError>;
}

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
}

/// A transport pinned to one placement (tests, placement baselines).
pub struct Pinned {
    /// The client.
    pub client: crate::cluster::Client,
    /// Where reads run.
    pub placement: crate::placement::Placement,
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
}
