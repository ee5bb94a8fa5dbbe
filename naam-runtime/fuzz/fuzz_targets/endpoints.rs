//! Arbitrary bytes as datagrams to the three protocol endpoints (naam-proto's `ServerEndpoint`,
//! `NicEndpoint`, `ClientEndpoint`), from the addresses that matter. Nothing may panic, and no
//! datagram reaches the executors: without a session set up with a credential, nothing opens.
//! (`naam-runtime/proto/tests/endpoints.rs` runs the same idea as a property test on stable.)
#![no_main]
use std::net::SocketAddr;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use naam_proto::control::Manifest;
use naam_proto::endpoint::{
    Channel, ClientConfig, ClientEndpoint, HostBackend, NicBackend, NicConfig, NicEndpoint, Routed,
    ServerConfig, ServerEndpoint, SwitchHandle, VerbsAcceptor,
};
use naam_proto::onesided::{Completion, Operation};
use naam_proto::entropy::Entropy;
use naam_proto::session::{tenant_entries, CookieJar, Credential};
use naam_proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_proto::wire::{Reply, Request};
use naam_proto::Placement;

/// Executors that must never be reached.
struct Unreachable;

impl HostBackend for Unreachable {
    fn dispatch(
        &mut self,
        _: &mut Request,
        _: &mut Selector,
        _: Option<Placement>,
        _: &Channel,
        _: &mut Reply,
    ) -> Routed {
        panic!("a datagram reached the host executors without a session");
    }
    fn next_client_id(&mut self) -> u32 {
        1
    }
    fn nic_up(&self) -> bool {
        false
    }
    fn nic_load(&mut self, _: &RemoteLoad) {
        panic!("a load report was taken without a session");
    }
    fn nic_gone(&mut self) {}
    fn handlers(&self, _: u32) -> Option<Vec<u32>> {
        None
    }
    fn has_handler(&self, _: u32, _: u32) -> bool {
        false
    }
    fn client_share(&self) -> Option<ClientShare> {
        None
    }
    fn weights(&self, _: u32, _: u32, _: Option<&mut ClientShare>) -> Weights {
        Weights::all(Placement::Host)
    }
    fn congest(&mut self, _: Option<u64>) {
        panic!("congestion was changed without a session");
    }
    fn switch(&self) -> Option<&dyn SwitchHandle> {
        None
    }
    fn verbs(&self) -> Option<&dyn VerbsAcceptor> {
        None
    }
}

impl NicBackend for Unreachable {
    fn dispatch(
        &mut self,
        _: Request,
        _: &mut Selector,
        _: Option<Placement>,
        _: Channel,
        _: &mut Reply,
    ) -> Routed {
        panic!("a datagram reached the NIC executors without a session");
    }
    fn one_sided(&mut self, op: &Operation) -> Completion {
        panic!("one-sided operation {} ran without a session", op.id);
    }
    fn load_report(&mut self) -> RemoteLoad {
        RemoteLoad::default()
    }
    fn remap(&mut self, epoch: u64) -> Result<Manifest, String> {
        Err(format!("no server start {epoch} here"))
    }
}

fuzz_target!(|data: &[u8]| {
    let addr = |s: &str| -> SocketAddr { s.parse().expect("literal") };
    let (server, nic, client) = (
        addr("10.0.0.1:7000"),
        addr("10.0.0.3:7001"),
        addr("10.0.0.2:5000"),
    );
    let credential = Credential::from_bytes([3; 32]);
    let pairing = Credential::from_bytes([4; 32]);
    let tenants = tenant_entries(
        &[(1, "app".into(), credential.clone())],
        None,
        Some(pairing.clone()),
    );
    let manifest = Manifest::default();
    let Ok(mut s) = ServerEndpoint::new(
        ServerConfig::new(manifest.clone(), tenants, Entropy::seeded(1)),
        Unreachable,
        CookieJar::with_key([5; 32]),
        0,
    ) else {
        return;
    };
    let mut n = NicEndpoint::new(
        NicConfig::new(server, nic, pairing, Entropy::seeded(2)),
        Unreachable,
        &manifest,
        0,
    );
    let mut c = ClientEndpoint::new(ClientConfig::new(server, "app", credential, Entropy::seeded(3)), 0);
    c.connect(0);
    // Each chunk: one byte says who gets it and from where, the rest is the datagram.
    for (i, chunk) in data.split(|b| *b == 0xff).enumerate() {
        let Some((&who, bytes)) = chunk.split_first() else {
            continue;
        };
        let from = [server, nic, client, addr("10.0.0.9:4000")][usize::from(who >> 6)];
        let now = i as u64 * 1_000_000;
        let d = Bytes::copy_from_slice(bytes);
        match who % 3 {
            0 => {
                s.handle(now, from, d);
                s.run(usize::MAX);
            }
            1 => n.handle(now, from, d),
            _ => c.handle(now, from, d),
        }
        s.handle_timeout(now);
        n.handle_timeout(now);
        c.handle_timeout(now);
        while s.poll_transmit().is_some() {}
        while n.poll_transmit().is_some() {}
        while c.poll_transmit().is_some() {}
    }
});
