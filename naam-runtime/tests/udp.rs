//! The UDP fabric end to end in one process: a host driver, a NIC driver mapping the host's
//! regions through shared memory, and clients over loopback sockets. Every placement, the
//! one-sided agent's checks, bad input, write deduplication, and the NIC going away mid-run.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{examples, rd, words};
use naam_proto::control::Control;
use naam_proto::handler_id;
use naam_proto::kind::MessageKind;
use naam_proto::onesided::{self, Op};
use naam_proto::transport::Transport;
use naam_proto::wire::Status;
use naam_proto::Placement;
use naam_runtime::cluster::ClusterConfig;
use naam_runtime::udp::Socket;
use naam_runtime::udp::{UdpClient, UdpConfig, UdpError};

const APP: u32 = 3;

type Process = common::Driver;

fn host(shm: &std::path::Path) -> Process {
    host_with(shm, &[APP], ClusterConfig::functional(), false)
}

/// A host serving the examples object as apps `ids` (clients may write one-sided where the
/// regions allow it).
fn host_with(
    shm: &std::path::Path,
    ids: &[u32],
    config: ClusterConfig,
    congestion_control: bool,
) -> Process {
    common::udp_host(shm, ids, config, congestion_control, true, |_| None)
}

fn nic(shm: &std::path::Path, server: SocketAddr) -> Process {
    common::udp_nic(shm, server)
}

fn client(server: SocketAddr, pin: Option<Placement>) -> UdpClient {
    let mut cfg = UdpConfig::new(server, common::TENANT, common::tenant_key());
    cfg.pin = pin;
    cfg.rto = Duration::from_millis(10);
    let mut c = UdpClient::connect(&cfg).unwrap();
    c.install_handlers(APP, &std::fs::read(&examples().0).unwrap())
        .unwrap();
    c
}

fn wait_for_agent(c: &mut UdpClient) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.agent().is_none() {
        assert!(Instant::now() < deadline, "the NIC never registered");
        // Any call refreshes the weights, which carry the agent's address.
        let _ = c.call(APP, handler_id("add"), &words(&[1, 1]), &[]);
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn rkey(c: &UdpClient, name: &str) -> u64 {
    c.manifest().app(APP).unwrap().region_key(name).unwrap()
}

#[test]
fn every_placement_answers_the_same_over_udp() {
    let shm = tempfile::tempdir().unwrap();
    let h = host(shm.path());
    let n = nic(shm.path(), h.addr);
    let _ = &n;
    let mut probe = client(h.addr, None);
    wait_for_agent(&mut probe);
    let sorted = rkey(&probe, "sorted");
    let data = rkey(&probe, "data");
    let mut answers: Vec<Vec<Bytes>> = Vec::new();
    for p in Placement::ALL {
        let mut c = client(h.addr, Some(p));
        wait_for_agent(&mut c);
        let mut mine = Vec::new();
        for key in [0u64, 4, 1000, 2044, 5000] {
            let r = c
                .call(
                    APP,
                    handler_id("bsearch"),
                    &words(&[key]),
                    &[rd(sorted, 0, 4096)],
                )
                .unwrap();
            assert_eq!((r.status, r.placement), (Status::Ok, p), "key {key}");
            if key % 4 == 0 && key <= 2044 {
                assert_eq!(
                    &r.payload[..8],
                    &(key / 4).to_le_bytes()[..],
                    "key {key} at {p}"
                );
            }
            mine.push(r.payload);
        }
        answers.push(mine);
        let r = c
            .call(
                APP,
                handler_id("two_step"),
                &words(&[data]),
                &[rd(data, 0, 16)],
            )
            .unwrap();
        assert_eq!(
            (r.status, r.steps, &r.payload[..]),
            (Status::Ok, 2, &words(&[1042])[..]),
            "{p}"
        );
    }
    assert!(answers.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn bad_input_gets_clear_errors_and_the_server_keeps_serving() {
    let shm = tempfile::tempdir().unwrap();
    let h = host(shm.path());
    let n = nic(shm.path(), h.addr);
    let mut c = client(h.addr, Some(Placement::Host));
    wait_for_agent(&mut c);
    let sorted = rkey(&c, "sorted");
    // Unknown handler, bad key, out of bounds.
    let r = c.call(APP, 0xdead_beef, &[], &[]).unwrap();
    assert_eq!(r.status, Status::UnknownHandler);
    common::check_descriptor_refusals(&mut c, APP, sorted);
    // Garbage datagrams and malformed messages to both processes.
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for to in [h.addr, n.addr] {
        raw.send_to(b"not a NAAM datagram", to).unwrap();
    }
    // Outside a session, a message is answered only within the amplification limit: a
    // 6-byte one gets nothing, a whole unsealed request gets `NoSession`.
    let mut s = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    s.send(h.addr, 1, &[1, 1, 0, 0, 9, 9]).unwrap();
    assert!(s.recv(Duration::from_millis(100)).unwrap().is_empty());
    let req = naam_proto::wire::Request::for_call(APP, handler_id("add"), 7, &words(&[1, 2]), &[])
        .unwrap();
    s.send(h.addr, 7, &req.to_bytes().unwrap()).unwrap();
    let r = naam_proto::wire::Reply::decode(recv_one(&mut s)).unwrap();
    assert_eq!(r.status, Status::NoSession);
    // Inside the session, a malformed request gets `Malformed`.
    c.send_sealed(h.addr, 1, &[1, 1, 0, 0, 9, 9]).unwrap();
    // Too short to carry a request id: answered as request 0.
    let got = recv_reply_to(&mut c, 0);
    assert_eq!(
        naam_proto::wire::Reply::decode(got).unwrap().status,
        Status::Malformed
    );
    // One-sided operations sent to the host are refused: only the NIC serves them.
    let op = onesided::Operation {
        app: APP,
        id: 5,
        op: Op::Read(vec![rd(sorted, 0, 8)]),
    };
    c.send_sealed(h.addr, 5, &op.to_bytes().unwrap()).unwrap();
    let c2 = recv_completion(&mut c, 5);
    assert_eq!(c2.status, Status::Unavailable);
    // The NIC's agent checks rkeys, rights and bounds.
    for (op, want) in [
        (Op::Read(vec![rd(sorted, 8, 8)]), Status::Ok),
        (Op::Read(vec![rd(sorted, 4090, 8)]), Status::OutOfRange),
        (Op::Read(vec![rd(12345, 0, 8)]), Status::BadKey),
        (
            Op::Write {
                rkey: sorted,
                offset: 0,
                data: Bytes::from_static(b"x"),
            },
            Status::AccessDenied,
        ),
        (
            Op::Faa {
                rkey: sorted,
                offset: 0,
                add: 1,
            },
            Status::AccessDenied,
        ),
    ] {
        let req = onesided::Operation {
            app: APP,
            id: 6,
            op,
        };
        c.send_sealed(n.addr, 6, &req.to_bytes().unwrap()).unwrap();
        let c3 = recv_completion(&mut c, 6);
        assert_eq!(c3.status, want, "{req:?}");
    }
    // RDMA peers are refused clearly by a server without the verbs backend.
    let answer = c
        .control(&naam_proto::control::Control::VerbsConnect {
            endpoint: naam_proto::control::QpEndpoint {
                lid: 1,
                qpn: 2,
                psn: 3,
                gid: [0; 16],
            },
        })
        .unwrap();
    assert!(
        matches!(&answer, naam_proto::control::Control::Error { message } if message.contains("no RDMA device")),
        "{answer:?}"
    );
    // Still serving.
    let r = c
        .call(APP, handler_id("add"), &words(&[2, 3]), &[])
        .unwrap();
    assert_eq!(&r.payload[..], &words(&[5])[..]);
}

/// The reply to request `id`, within 5 s ([`common::recv_answer`]: a late reply to a call
/// `wait_for_agent` retransmitted is passed over).
fn recv_reply_to(c: &mut UdpClient, id: u64) -> Bytes {
    common::recv_answer(c, MessageKind::Reply, id, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("no reply to request {id}"))
}

/// The completion of one-sided operation `id`, within 5 s (other sealed datagrams passed
/// over: a run once failed decoding a late reply as the completion).
fn recv_completion(c: &mut UdpClient, id: u64) -> onesided::Completion {
    let m = common::recv_answer(
        c,
        MessageKind::OneSidedCompletion,
        id,
        Duration::from_secs(5),
    )
    .unwrap_or_else(|| panic!("no completion of operation {id}"));
    onesided::Completion::decode(m).expect("a completion")
}

fn recv_one(s: &mut Socket) -> Bytes {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        assert!(Instant::now() < deadline, "no answer");
        if let Some((_, m)) = s
            .recv(Duration::from_millis(10))
            .unwrap()
            .into_iter()
            .next()
        {
            return m;
        }
    }
}

#[test]
fn one_sided_writes_are_applied_once_when_retransmitted() {
    let shm = tempfile::tempdir().unwrap();
    let h = host(shm.path());
    let n = nic(shm.path(), h.addr);
    let mut c = client(h.addr, None);
    wait_for_agent(&mut c);
    let data = rkey(&c, "data");
    let faa = onesided::Operation {
        app: APP,
        id: 42,
        op: Op::Faa {
            rkey: data,
            offset: 16,
            add: 5,
        },
    };
    let mut olds = Vec::new();
    for _ in 0..3 {
        // Each retransmission is a new packet of the session, with the same operation id.
        c.send_sealed(n.addr, 42, &faa.to_bytes().unwrap()).unwrap();
        olds.push(recv_completion(&mut c, 42).data);
    }
    assert!(olds.iter().all(|o| o[..] == 0u64.to_le_bytes()[..]));
    let read = onesided::Operation {
        app: APP,
        id: 43,
        op: Op::Read(vec![rd(data, 16, 8)]),
    };
    c.send_sealed(n.addr, 43, &read.to_bytes().unwrap())
        .unwrap();
    let now = recv_completion(&mut c, 43);
    assert_eq!(now.data[..], 5u64.to_le_bytes()[..], "applied exactly once");
}

#[test]
fn reads_survive_the_nic_going_away() {
    let shm = tempfile::tempdir().unwrap();
    let h = host(shm.path());
    let mut n = nic(shm.path(), h.addr);
    let mut c = client(h.addr, Some(Placement::Nic));
    wait_for_agent(&mut c);
    let sorted = rkey(&c, "sorted");
    let mut auto = client(h.addr, None);
    let bsearch = |c: &mut UdpClient| {
        c.call(
            APP,
            handler_id("bsearch"),
            &words(&[400]),
            &[rd(sorted, 0, 4096)],
        )
        .unwrap()
    };
    assert_eq!(bsearch(&mut c).placement, Placement::Nic);
    n.stop();
    // Pinned to a NIC that is gone: a clear error, no hang.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = bsearch(&mut c);
        if r.status == Status::Unavailable {
            break;
        }
        assert!(Instant::now() < deadline, "the NIC never went down");
    }
    // Steered reads keep being answered correctly, by the host.
    for _ in 0..200 {
        let r = bsearch(&mut auto);
        assert_eq!(r.status, Status::Ok);
        assert_eq!(&r.payload[..8], &100u64.to_le_bytes()[..]);
    }
}

#[test]
fn a_server_that_is_not_there_is_reported_clearly() {
    let free = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap();
    drop(free);
    let mut cfg = UdpConfig::new(addr, common::TENANT, common::tenant_key());
    cfg.connect_timeout = Duration::from_millis(200);
    match UdpClient::connect(&cfg) {
        Err(e @ UdpError::NoServer { .. }) => {
            assert!(e.to_string().contains("no answer from naam-server"), "{e}")
        }
        other => panic!("expected NoServer, got {:?}", other.err()),
    }
}

#[test]
fn unsealed_in_process_sessions_are_refused_on_real_sockets() {
    use naam_proto::session::Authentication;
    use naam_runtime::udp;
    // A client over the kernel's UDP refuses before it sends anything.
    let mut cfg = UdpConfig::new(
        "127.0.0.1:9".parse().unwrap(),
        common::TENANT,
        common::tenant_key(),
    );
    cfg.authentication = Authentication::InProcess;
    match UdpClient::connect(&cfg) {
        Err(e @ UdpError::Refused { .. }) => {
            assert!(e.to_string().contains("in-memory network"), "{e}")
        }
        other => panic!("expected Refused, got {:?}", other.err()),
    }
    // So does a server bound to a kernel socket.
    let shm = tempfile::tempdir().unwrap();
    let app = examples_host_app();
    let (cluster, manifest) =
        udp::start_host(vec![app], ClusterConfig::default(), shm.path()).unwrap();
    let socket = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    let mut opts = udp::ServerOptions::new(manifest, vec![]);
    opts.authentication = Authentication::InProcess;
    let e = udp::serve_host(cluster, socket, opts, &AtomicBool::new(false)).unwrap_err();
    assert!(e.to_string().contains("in-memory network"), "{e}");
}

#[test]
fn a_manifest_of_many_apps_reaches_clients_in_pages() {
    let shm = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (1..=60).collect();
    let h = host_with(shm.path(), &ids, ClusterConfig::functional(), false);
    let mut c = client(h.addr, Some(Placement::Host));
    let served: Vec<u32> = c.manifest().apps.iter().map(|a| a.id).collect();
    assert_eq!(served, ids);
    // The last page's app answers.
    let r = c.call(60, handler_id("add"), &words(&[2, 3]), &[]).unwrap();
    assert_eq!(&r.payload[..], &words(&[5])[..]);
    // A page that does not exist is refused clearly.
    let answer = c.control(&Control::QueryManifest { page: 9999 }).unwrap();
    assert!(
        matches!(&answer, Control::Error { message } if message.contains("no manifest page")),
        "{answer:?}"
    );
}

#[test]
fn congestion_control_is_refused_unless_the_server_allows_it() {
    let shm = tempfile::tempdir().unwrap();
    let h = host(shm.path());
    let mut c = operator(h.addr);
    let answer = c
        .control(&Control::Congest {
            extra_ns: Some(1000),
        })
        .unwrap();
    assert!(
        matches!(&answer, Control::Error { message } if message.contains("allow_congestion_control")),
        "{answer:?}"
    );
    let shm2 = tempfile::tempdir().unwrap();
    let h2 = host_with(shm2.path(), &[APP], ClusterConfig::functional(), true);
    // Even allowed, only the operator's session may congest the server.
    let mut tenant = client(h2.addr, Some(Placement::Host));
    assert!(matches!(
        tenant.control(&Control::Congest { extra_ns: Some(1) }).unwrap(),
        Control::Error { message } if message.contains("not allowed in this session")
    ));
    let mut c2 = operator(h2.addr);
    let too_much = Control::Congest {
        extra_ns: Some(naam_proto::control::MAX_CONGESTION_NS + 1),
    };
    assert!(matches!(
        c2.control(&too_much).unwrap(),
        Control::Error { .. }
    ));
    for extra_ns in [Some(50_000), None] {
        assert_eq!(
            c2.control(&Control::Congest { extra_ns }).unwrap(),
            Control::Congestion { extra_ns }
        );
    }
    let r = tenant
        .call(APP, handler_id("add"), &words(&[2, 3]), &[])
        .unwrap();
    assert_eq!(&r.payload[..], &words(&[5])[..]);
}

/// A client of the operator's session.
fn operator(server: SocketAddr) -> UdpClient {
    let cfg = UdpConfig::new(
        server,
        naam_proto::session::OPERATOR_TENANT,
        common::operator_key(),
    );
    UdpClient::connect(&cfg).unwrap()
}

#[test]
fn a_full_host_queue_answers_busy_and_keeps_serving() {
    let shm = tempfile::tempdir().unwrap();
    let mut config = ClusterConfig::functional();
    config.queue_capacity = 2;
    let h = host_with(shm.path(), &[APP], config, true);
    let mut c = client(h.addr, Some(Placement::Host));
    let mut op = operator(h.addr);
    // Every host message now takes 5 ms: a burst of 20 overflows a queue of 2.
    op.control(&Control::Congest {
        extra_ns: Some(5_000_000),
    })
    .unwrap();
    for id in 1..=20u64 {
        let mut req =
            naam_proto::wire::Request::for_call(APP, handler_id("add"), id, &words(&[1, 2]), &[])
                .unwrap();
        req.flags |= naam_proto::wire::flags::PIN_HOST;
        c.send_sealed(h.addr, id, &req.to_bytes().unwrap()).unwrap();
    }
    let mut statuses = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while statuses.len() < 20 {
        assert!(Instant::now() < deadline, "answers: {statuses:?}");
        for m in c.recv_sealed(Duration::from_millis(10)).unwrap() {
            // Only the answers to these twenty: a late duplicate answer to an earlier call
            // may still arrive (see `recv_reply_to`).
            if let Some((MessageKind::Reply, 1..=20)) = naam_proto::peek::message_id(&m) {
                statuses.push(naam_proto::wire::Reply::decode(m).unwrap().status);
            }
        }
    }
    let busy = statuses.iter().filter(|&&s| s == Status::Busy).count();
    let ok = statuses.iter().filter(|&&s| s == Status::Ok).count();
    assert!(busy > 0, "{statuses:?}");
    assert_eq!(ok + busy, 20, "{statuses:?}");
    op.control(&Control::Congest { extra_ns: None }).unwrap();
    let r = c
        .call(APP, handler_id("add"), &words(&[2, 3]), &[])
        .unwrap();
    assert_eq!(&r.payload[..], &words(&[5])[..]);
}

#[test]
fn a_server_claiming_endless_manifest_pages_is_refused() {
    let mut fake = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    let addr = fake.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        // A server that holds the tenant's credential (so the client trusts its welcome) but
        // claims a manifest of 4 billion pages.
        use naam_proto::session::{self, Gatekeeper, HandshakeNonces};
        let tenants = session::tenant_entries(
            &[(APP, common::TENANT.into(), common::tenant_key())],
            None,
            None,
        );
        let mut gate = Gatekeeper::new(
            1,
            tenants,
            session::CookieJar::new(&naam_runtime::entropy::os()).unwrap(),
            naam_runtime::entropy::os(),
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            for (peer, m) in fake.recv(Duration::from_millis(10)).unwrap() {
                let (id, c) = Control::decode(&m).unwrap();
                match c {
                    Control::Hello { nonce, .. } => {
                        let (server, cookie) = gate.challenge(0, peer, nonce).unwrap();
                        let ch = Control::Challenge {
                            route: 0,
                            nonce: server,
                            issued: 0,
                            cookie,
                        };
                        fake.send(peer, id, &ch.to_bytes(id)).unwrap();
                    }
                    Control::Auth {
                        tenant,
                        client_nonce,
                        server_nonce,
                        issued,
                        cookie,
                        proof,
                    } => {
                        let n = HandshakeNonces {
                            client: client_nonce,
                            server: server_nonce,
                        };
                        let s = gate
                            .authenticate(0, peer, &tenant, &n, issued, &cookie, &proof)
                            .unwrap();
                        let w = Control::Welcome {
                            session: s.id,
                            epoch: 1,
                            client_id: 1,
                            manifest: Default::default(),
                            pages: u32::MAX,
                            agent: None,
                            window: 0,
                        };
                        fake.send(peer, id, &s.sealer.seal(&w.to_bytes(id)))
                            .unwrap();
                        return;
                    }
                    _ => {}
                }
            }
        }
    });
    match UdpClient::connect(&UdpConfig::new(addr, common::TENANT, common::tenant_key())) {
        Err(UdpError::Refused { message, .. }) => assert!(message.contains("pages"), "{message}"),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("accepted a manifest of 4 billion pages"),
    }
    server.join().unwrap();
}

/// A tenant's hostile handlers (a wild write, an endless loop, deep recursion, an
/// out-of-bounds read) get clean error replies at the host and at the NIC, while another app
/// on the same server keeps being served, and the server stays up.
#[test]
fn hostile_handlers_fault_cleanly_while_another_app_is_served() {
    let shm = tempfile::tempdir().unwrap();
    let h = host_with(
        shm.path(),
        &[APP, APP + 1],
        ClusterConfig::functional(),
        false,
    );
    let n = nic(shm.path(), h.addr);
    let _ = &n;
    // The other tenant: lookups from another thread for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let (server, halt) = (h.addr, stop.clone());
    let other = std::thread::spawn(move || {
        let mut c = client(server, Some(Placement::Host));
        let sorted = c
            .manifest()
            .app(APP + 1)
            .unwrap()
            .region_key("sorted")
            .unwrap();
        let (mut ok, mut failed) = (0u64, Vec::new());
        while !halt.load(std::sync::atomic::Ordering::SeqCst) {
            let r = c
                .call(
                    APP + 1,
                    handler_id("bsearch"),
                    &words(&[400]),
                    &[rd(sorted, 0, 4096)],
                )
                .unwrap();
            if r.status == Status::Ok && r.payload[..8] == words(&[100])[..] {
                ok += 1;
            } else {
                failed.push(format!("{:?} {:?}", r.status, r.payload));
            }
        }
        (ok, failed)
    });
    let mut victim = [0u8; 16];
    let victim_addr = victim.as_mut_ptr() as u64;
    for p in [Placement::Host, Placement::Nic] {
        let mut c = client(h.addr, Some(p));
        wait_for_agent(&mut c);
        let sorted = rkey(&c, "sorted");
        for (handler, args, want) in [
            (
                "wild_write",
                words(&[victim_addr, 0x41]),
                "store of 8 bytes",
            ),
            ("wild_write", words(&[0, 0x41]), "store of 8 bytes at 0x0"),
            ("spin", Vec::new(), "budget exhausted"),
            ("recurse", words(&[1000]), "calls nested deeper"),
            ("oob_read", words(&[1 << 40]), "load of 8 bytes"),
        ] {
            let r = c
                .call(APP, handler_id(handler), &args, &[rd(sorted, 0, 64)])
                .unwrap();
            let msg = String::from_utf8_lossy(&r.payload);
            assert_eq!(
                (r.status, r.placement),
                (Status::Fault, p),
                "{handler}: {msg}"
            );
            assert!(msg.contains(want), "{handler} at {p}: {msg}");
        }
        // The same tenant's well-behaved handler still runs there.
        let r = c
            .call(APP, handler_id("add"), &words(&[2, 3]), &[])
            .unwrap();
        assert_eq!(
            (r.status, &r.payload[..]),
            (Status::Ok, &words(&[5])[..]),
            "{p}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, failed) = other.join().unwrap();
    assert!(failed.is_empty(), "the other app saw errors: {failed:?}");
    assert!(ok > 10, "the other app was served only {ok} times");
    assert_eq!(victim, [0u8; 16], "the server's memory was not written");
}

/// A pipelined client keeps many requests in flight in one session: every one is answered
/// with its own result, within the window the server granted; one more is refused at the
/// client, not sent.
#[test]
fn a_pipelined_session_keeps_its_window_in_flight_and_gets_every_answer() {
    use naam_proto::transport::Pipeline;
    let shm = tempfile::tempdir().unwrap();
    let h = host(shm.path());
    let mut c = client(h.addr, Some(Placement::Host));
    let window = c.window();
    assert_eq!(window, naam_proto::limits::SESSION_CREDIT as usize);
    let mut expected = std::collections::HashMap::new();
    for n in 0..window as u64 {
        let id = c
            .submit(APP, handler_id("add"), &words(&[n, 1000]), &[])
            .unwrap();
        expected.insert(id, n + 1000);
    }
    assert!(
        matches!(
            c.submit(APP, handler_id("add"), &words(&[1, 1]), &[]),
            Err(naam_proto::transport::ClientError::Busy(_))
        ),
        "past the window"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !expected.is_empty() {
        assert!(Instant::now() < deadline, "{} unanswered", expected.len());
        for (id, r) in c.poll(true) {
            let r = r.unwrap();
            let want = expected
                .remove(&id)
                .expect("an answer to a submitted request");
            assert_eq!(
                (r.status, &r.payload[..]),
                (Status::Ok, &words(&[want])[..])
            );
        }
    }
    assert_eq!(c.in_flight(), 0);
    assert!(c.transport_counts().sent >= window as u64);
}

/// A host that keeps its regions in process writes no region file and names none in its
/// manifest: a NIC process cannot map them (and says why), a NIC in the same process sees
/// the host's own memory under the same rkeys.
#[test]
fn a_nic_in_the_hosts_process_sees_the_hosts_own_regions() {
    use naam_runtime::udp;
    let shm = tempfile::tempdir().unwrap();
    let app = examples_host_app();
    let (host, manifest) = udp::start_host_with(
        vec![app],
        ClusterConfig::functional(),
        shm.path(),
        udp::HostRegions::InProcess,
    )
    .unwrap();
    let regions = &manifest.apps[0].regions;
    assert!(!regions.is_empty());
    assert!(regions.iter().all(|r| r.path.is_none()), "{regions:?}");
    let files: Vec<_> = std::fs::read_dir(shm.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(files.iter().all(|f| !f.ends_with(".region")), "{files:?}");
    match udp::start_nic(shm.path(), ClusterConfig::functional()) {
        Err(e) => assert!(e.to_string().contains("no shared-memory file"), "{e}"),
        Ok(_) => panic!("a NIC mapped regions the host keeps in process"),
    }
    let (nic, _) =
        udp::start_nic_in_process(shm.path(), ClusterConfig::functional(), &host).unwrap();
    for r in regions {
        let mine = host.regions().get(1, r.rkey).unwrap();
        let seen = nic.regions().get(1, r.rkey).unwrap();
        assert_eq!(seen.mem.addr(), mine.mem.addr(), "{}", r.name);
        if mine.mem.len() >= 8 {
            mine.mem.write(0, &[0x5a; 8]).unwrap();
            assert_eq!(seen.mem.load_u64(0).unwrap(), 0x5a5a_5a5a_5a5a_5a5a);
        }
    }
}

/// The examples' app as app 1 of the tenant, as naam-server deploys an app.
fn examples_host_app() -> naam_runtime::udp::HostApp {
    naam_runtime::udp::HostApp {
        spec: common::examples_app(1),
        kind: "object".into(),
        params: serde_json::Value::Null,
        object_bytes: std::fs::read(&examples().0).unwrap(),
        client_writes: false,
        credential: Some(common::tenant_key()),
    }
}
