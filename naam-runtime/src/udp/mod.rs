//! The `udp` fabric: NAAM between processes over real datagrams (loopback, or veth pairs
//! between network namespaces). One-sided RDMA is emulated by an agent in the NIC process;
//! everything reported over this fabric is labelled `udp`.
//!
//! Its modules are private; what callers use is re-exported here:
//! - the socket, the thin IO layer (`sendmmsg` / `recvmmsg`, fragmentation and reassembly):
//!   [`Socket`], [`Sender`], loss injection ([`injected_loss_from_env`]); bound in a
//!   [`MemoryNet`] instead, the same fabric runs inside one process with no network;
//! - one socket per receive loop on one address, sessions routed by the kernel
//!   ([`bind_group`]);
//! - the control messages it carries (manifest, hello, weights, NIC load reports, forwarded
//!   requests) are naam-proto's [`naam_proto::control`];
//! - `naam-server`'s driver, the host executors behind the user-space switch: [`serve_host`];
//! - `naam-nic`'s driver, the NIC executors and the one-sided agent: [`serve_nic`];
//! - the client, a [`naam_proto::transport::Transport`]: [`UdpClient`];
//! - deployment helpers shared by the binaries and the tests: [`start_host`], [`start_nic`],
//!   and naam-server's start over regions that outlive it, [`start_host_persistent`];
//! - SIGTERM/SIGINT as a stop flag, for draining: [`stop_flag`];
//! - live measurements in Prometheus' format and the `--metrics` endpoint: [`Telemetry`],
//!   [`spawn_metrics`].

mod client;
mod created;
mod deploy;
mod deploy_error;
mod deployer;
mod inline;
mod memnet;
mod nic;
mod reuseport;
mod server;
mod shm_dir;
mod signal;
mod socket;
mod telemetry;

pub use client::{Deployment, UdpClient, UdpConfig, UdpError};
pub use created::{created_app_count, restore_created_apps};
pub use deploy::{
    cleanup, read_manifest, redeploy_nic, snapshot, start_host, start_host_persistent,
    start_host_with, start_nic, start_nic_in_process, HostApp, HostRegions, PersistentHost,
    RegionStart, RegionsCheck, Started, MANIFEST_FILE, SERVER_EXECUTOR_POLL,
};
pub use deploy_error::DeployError;
pub use deployer::{forget_deploys, restore_deploys, DeployPolicy};
pub use memnet::{MemoryNet, MEMORY_MODE, PORT_QUEUE};
pub use nic::{
    serve_nic, serve_nic_inline, serve_nic_loops, InlineNic, NicCluster, NicOptions, Remap,
};
pub use reuseport::{bind_group, default_receive_loops};
pub use server::{serve_host, serve_host_inline, serve_host_loops, InlineServer, ServerOptions};
pub use shm_dir::{RegionsHeader, RegionsState, ShmDir, HEADER_FILE, LOCK_FILE, REGIONS_FORMAT};
pub use signal::stop_flag;
pub use socket::{
    datagram_for, injected_loss_from_env, parse_loss, Poller, Sender, Socket, SocketStats,
    DEFAULT_DATAGRAM, INJECT_LOSS_ENV, LOOPBACK_DATAGRAM, MAX_DATAGRAM, RECV_BATCH,
};
pub use telemetry::{
    route, serve_metrics, spawn_metrics, Route, Telemetry, LATENCY_BUCKETS_US, MAX_SERIES,
};

/// Mode label of everything measured over this fabric.
pub const MODE: &str =
    "udp (separate processes over UDP; NIC cores, DMA and one-sided RDMA emulated)";

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use naam_ebpf::eswitch as abi;

    use naam_proto::frame::fragment;
    use naam_proto::wire::{flags, Descriptors, Request};

    /// The XDP eSwitch reads NAAM packets at fixed offsets (naam-ebpf's `eswitch` ABI): they
    /// must match what the runtime's encoders write.
    #[test]
    fn the_eswitch_offsets_match_the_encoders() {
        let mut req = Request::new(
            0x0102_0304,
            0x0a0b_0c0d,
            0x1122_3344_5566_7788,
            Bytes::from_static(b"args"),
            Descriptors::default(),
        );
        req.flags = flags::PIN_NIC;
        let key = naam_proto::session::SessionKey::new(9, 1, [5; 32]);
        let sealed = key.seal(
            naam_proto::session::Sender::Client,
            1,
            &req.to_bytes().unwrap(),
        );
        let frags = fragment(req.request_id, &sealed, 1472).unwrap();
        assert_eq!(frags.len(), 1);
        let mut frame = vec![0u8; abi::L4_PAYLOAD];
        frame.extend_from_slice(&frags[0]);
        assert!(frame.len() >= abi::NEEDED);
        let f = &frame[abi::L4_PAYLOAD..];
        assert_eq!(&f[..4], b"NAAM");
        assert_eq!(f[abi::FRAG_COUNT], 1);
        assert_eq!(f[abi::FRAG_HEADER + abi::SEAL_KIND], abi::KIND_SEALED);
        let r = &f[abi::FRAG_HEADER + abi::SEAL_HEADER..];
        let u32_at = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().unwrap());
        assert_eq!(r[abi::REQ_KIND], abi::KIND_REQUEST);
        assert_eq!(
            u16::from_le_bytes([r[abi::REQ_FLAGS], r[abi::REQ_FLAGS + 1]]),
            abi::FLAG_PIN_NIC
        );
        assert_eq!(u32_at(abi::REQ_APP), req.app);
        assert_eq!(u32_at(abi::REQ_HANDLER), req.handler);
        assert_eq!(
            u64::from_le_bytes(r[abi::REQ_ID..abi::REQ_ID + 8].try_into().unwrap()),
            req.request_id
        );
    }

    /// The eSwitch's decision over a message in memory (the simulator's switch) reads what the
    /// encoders wrote: pins first, then the handler's share; other messages stay with the host.
    #[test]
    fn the_eswitch_decision_reads_sealed_requests() {
        let key = naam_proto::session::SessionKey::new(9, 1, [5; 32]);
        let sealed = |flags: u16, id: u64| {
            let mut req = Request::new(3, 4, id, Bytes::from_static(b"a"), Descriptors::default());
            req.flags = flags;
            key.seal(
                naam_proto::session::Sender::Client,
                1,
                &req.to_bytes().unwrap(),
            )
        };
        let all = |_: u64| Some(1000);
        assert!(abi::steers_to_nic(&sealed(flags::PIN_NIC, 1), 1, |_| None));
        assert!(!abi::steers_to_nic(&sealed(flags::PIN_HOST, 1), 1, all));
        assert!(abi::steers_to_nic(&sealed(0, 1), 1, |k| {
            assert_eq!(k, abi::steer_key(3, 4));
            Some(1000)
        }));
        assert!(!abi::steers_to_nic(&sealed(0, 1), 1, |_| None));
        assert!(!abi::steers_to_nic(&sealed(0, 1), 2, all), "fragmented");
        let msg = sealed(0, 1);
        assert!(
            !abi::steers_to_nic(&msg[..abi::SEAL_HEADER + 3], 1, all),
            "cut short"
        );
        let mut other = msg.to_vec();
        other[abi::SEAL_HEADER + abi::REQ_KIND] = abi::KIND_REQUEST + 1;
        assert!(!abi::steers_to_nic(&other, 1, all), "not a request");
        let half = (0..1000u64)
            .filter(|&id| abi::steers_to_nic(&sealed(0, id), 1, |_| Some(500)))
            .count();
        assert!((400..600).contains(&half), "{half}");
    }

    #[test]
    fn the_eswitch_share_is_followed() {
        for permille in [0u32, 1, 100, 500, 999, 1000] {
            let n = (0..100_000u64)
                .filter(|&id| abi::picks_nic(id * 7 + 3, permille))
                .count();
            let want = permille as f64 * 100.0;
            assert!(
                (n as f64 - want).abs() <= want * 0.05 + 20.0,
                "{permille}: {n}"
            );
        }
    }
}
