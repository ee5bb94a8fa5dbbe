//! Issue 12's findings, one test each, run twice: against the UDP fabric's driver loops on
//! threads (the loops naam-server and naam-nic run), and against `naam-server` and `naam-nic`
//! processes on loopback, configured from credential files and a TOML config. Strangers and
//! other tenants can neither read nor change a tenant's memory, guessed request ids poison
//! nothing, the NIC reflects nothing and cannot be impersonated, answers to unproven peers
//! stay within the amplification limit, a server restart recovers by itself, and a load
//! report moves only its sender's choices.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::deployment::{key_a, key_b, Deployment, A, B};
use common::{rd, words};
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::control::{self, Control};
use naam_proto::handler_id;
use naam_proto::kind::MessageKind;
use naam_proto::onesided::{self, Op};
use naam_proto::session::{Credential, HELLO_PADDING};
use naam_proto::transport::Transport;
use naam_proto::wire::{Reply, Request, Status};
use naam_proto::Placement;
use naam_runtime::udp::Socket;
use naam_runtime::udp::{UdpClient, UdpConfig};

fn client(server: SocketAddr, tenant: &str, key: Credential, pin: Option<Placement>) -> UdpClient {
    let mut cfg = UdpConfig::new(server, tenant, key);
    cfg.pin = pin;
    cfg.rto = Duration::from_millis(10);
    UdpClient::connect(&cfg).unwrap()
}

fn wait_for_agent(c: &mut UdpClient, app: u32) -> SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let _ = c.call(app, handler_id("add"), &words(&[1, 1]), &[]);
        if let Some(a) = c.agent() {
            return a;
        }
        assert!(Instant::now() < deadline, "the NIC never paired");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How long a test waits for an answer (and, where it asserts there is none, how long it
/// waits to be sure).
const ANSWER_WAIT: Duration = Duration::from_millis(500);

/// The reply to request `id`, within [`ANSWER_WAIT`] ([`common::recv_answer`]).
fn recv_answer_to(c: &mut UdpClient, id: u64) -> Option<Bytes> {
    common::recv_answer(c, MessageKind::Reply, id, ANSWER_WAIT)
}

/// The completion of one-sided operation `id`, within [`ANSWER_WAIT`].
fn recv_completion(c: &mut UdpClient, id: u64) -> Option<Bytes> {
    common::recv_answer(c, MessageKind::OneSidedCompletion, id, ANSWER_WAIT)
}

/// Tenant A writes its `data` region's first words (A's app lets clients write one-sided):
/// the processes start it zeroed, the threads with these contents.
fn seed_data_of_a(a: &mut UdpClient) {
    let data = a.manifest().app(A).unwrap().region_key("data").unwrap();
    let op = onesided::Operation {
        app: A,
        id: 901,
        op: Op::Write {
            rkey: data,
            offset: 0,
            data: Bytes::from(words(&[24, 1000, 0, 42])),
        },
    };
    let agent = wait_for_agent(a, A);
    a.send_sealed(agent, 901, &op.to_bytes().unwrap()).unwrap();
    let c =
        onesided::Completion::decode(recv_completion(a, 901).expect("A writes its data")).unwrap();
    assert_eq!(c.status, Status::Ok);
}

/// Tenant A's `data` region, read through A's own handler.
fn data_of_a(a: &mut UdpClient) -> Vec<u8> {
    let data = a.manifest().app(A).unwrap().region_key("data").unwrap();
    let r = a
        .call(A, handler_id("bsearch"), &words(&[0]), &[rd(data, 0, 64)])
        .unwrap();
    assert_eq!(r.status, Status::Ok);
    let op = onesided::Operation {
        app: A,
        id: 900,
        op: Op::Read(vec![rd(data, 0, 64)]),
    };
    let agent = wait_for_agent(a, A);
    a.send_sealed(agent, 900, &op.to_bytes().unwrap()).unwrap();
    let c =
        onesided::Completion::decode(recv_completion(a, 900).expect("A reads its data")).unwrap();
    assert_eq!(c.status, Status::Ok);
    c.data.to_vec()
}

fn strangers_and_other_tenants_can_neither_read_nor_change_a_tenants_memory(d: &mut Deployment) {
    let mut a = client(d.server(), "a", key_a(), None);
    let mut b = client(d.server(), "b", key_b(), None);
    // Each session sees only its own app.
    assert_eq!(
        a.manifest().apps.iter().map(|x| x.id).collect::<Vec<_>>(),
        [A]
    );
    assert_eq!(
        b.manifest().apps.iter().map(|x| x.id).collect::<Vec<_>>(),
        [B]
    );
    assert!(b.manifest().apps[0]
        .regions
        .iter()
        .all(|r| r.path.is_none()));
    seed_data_of_a(&mut a);
    let before = data_of_a(&mut a);
    assert_eq!(before[..8], 24u64.to_le_bytes());
    // B learned A's rkey somehow (it is derived, but say it leaked).
    let rkey = a.manifest().app(A).unwrap().region_key("data").unwrap();
    let agent = wait_for_agent(&mut b, B);
    let ops = |app| {
        vec![
            Op::Read(vec![rd(rkey, 0, 8)]),
            Op::Write {
                rkey,
                offset: 0,
                data: Bytes::from_static(&[0xff; 8]),
            },
            Op::Cas {
                rkey,
                offset: 0,
                expected: 24,
                new: 0,
            },
            Op::Faa {
                rkey,
                offset: 8,
                add: 1,
            },
        ]
        .into_iter()
        .map(move |op| onesided::Operation { app, id: 77, op })
    };
    // In B's session, naming A's app or its own: refused, nothing read.
    for (i, op) in ops(A).chain(ops(B)).enumerate() {
        b.send_sealed(agent, i as u64, &op.to_bytes().unwrap())
            .unwrap();
        let c = onesided::Completion::decode(recv_completion(&mut b, op.id).expect("an answer"))
            .unwrap();
        let want = if op.app == A {
            Status::UnknownApp
        } else {
            Status::BadKey
        };
        assert_eq!(c.status, want, "{op:?}");
        assert!(
            !c.data.windows(8).any(|w| w == 24u64.to_le_bytes()),
            "{c:?}"
        );
    }
    // B's requests for A's app are refused as if it did not exist.
    let w = Descriptor {
        rkey,
        offset: 0,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    let r = b
        .call(A, handler_id("counter_add"), &words(&[5]), &[w])
        .unwrap();
    assert_eq!(r.status, Status::UnknownApp);
    let r = b
        .call(B, handler_id("counter_add"), &words(&[5]), &[w])
        .unwrap();
    assert_eq!(r.status, Status::BadKey, "A's rkey in B's app");
    // A stranger: unsealed operations to the NIC and the server get nothing done.
    let mut s = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    for op in ops(A) {
        s.send(d.nic(), 1, &op.to_bytes().unwrap()).unwrap();
        s.send(d.server(), 1, &op.to_bytes().unwrap()).unwrap();
    }
    let req = Request::for_call(A, handler_id("counter_add"), 1, &words(&[5]), &[w]).unwrap();
    s.send(d.server(), 1, &req.to_bytes().unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    for (_, m) in s.recv(Duration::from_millis(50)).unwrap() {
        // Only refusals come back, each small.
        let status = Reply::decode(m.clone())
            .map(|r| r.status)
            .or_else(|_| onesided::Completion::decode(m).map(|c| c.status))
            .unwrap();
        assert_eq!(status, Status::NoSession);
    }
    assert_eq!(data_of_a(&mut a), before, "A's memory is unchanged");
}

fn guessed_request_ids_poison_no_one_elses_writes(d: &mut Deployment) {
    let server = d.server();
    let mut attacker = client(server, "a", key_a(), Some(Placement::Host));
    let mut victim = client(server, "a", key_a(), Some(Placement::Host));
    let data = victim
        .manifest()
        .app(A)
        .unwrap()
        .region_key("data")
        .unwrap();
    let w = Descriptor {
        rkey: data,
        offset: 16,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    // The attacker sends writes under every id the victim will use.
    for seq in 1..=64u64 {
        let req = Request::for_call(A, handler_id("counter_add"), seq, &words(&[0]), &[w]).unwrap();
        attacker
            .send_sealed(server, seq, &req.to_bytes().unwrap())
            .unwrap();
        let id = naam_proto::wire::request_id(2, seq);
        let req = Request::for_call(A, handler_id("counter_add"), id, &words(&[0]), &[w]).unwrap();
        attacker
            .send_sealed(server, id, &req.to_bytes().unwrap())
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    // Every one of the victim's writes is applied.
    for _ in 0..20 {
        let r = victim
            .call(A, handler_id("counter_add"), &words(&[1]), &[w])
            .unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    let r = victim
        .call(A, handler_id("bsearch"), &words(&[0]), &[rd(data, 0, 64)])
        .unwrap();
    assert_eq!(r.status, Status::Ok);
    let op = onesided::Operation {
        app: A,
        id: 5,
        op: Op::Read(vec![rd(data, 16, 8)]),
    };
    let agent = wait_for_agent(&mut victim, A);
    victim
        .send_sealed(agent, 5, &op.to_bytes().unwrap())
        .unwrap();
    let c = onesided::Completion::decode(recv_completion(&mut victim, 5).unwrap()).unwrap();
    assert_eq!(
        c.data[..],
        20u64.to_le_bytes()[..],
        "all 20 applied, none poisoned"
    );
}

fn the_nic_reflects_nothing_and_cannot_be_impersonated(d: &mut Deployment) {
    let (server, nic) = (d.server(), d.nic());
    let mut a = client(server, "a", key_a(), Some(Placement::Nic));
    let agent = wait_for_agent(&mut a, A);
    assert_eq!(agent, nic);
    // A third party that would receive reflected answers.
    let mut victim = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    let req = Request::for_call(A, handler_id("add"), 3, &words(&[1, 2]), &[]).unwrap();
    // Forwards from a stranger (unsealed), and from a tenant's session: dropped.
    let mut s = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    let sealed = a.send_sealed(server, 3, &req.to_bytes().unwrap()).unwrap();
    assert!(
        recv_answer_to(&mut a, 3).is_some(),
        "the request itself is answered"
    );
    for _ in 0..20 {
        s.send(nic, 1, &control::forward(&sealed)).unwrap();
        a.send_sealed(nic, 1, &control::forward(&sealed)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(victim.recv(Duration::from_millis(50)).unwrap().is_empty());
    assert!(s.recv(Duration::from_millis(10)).unwrap().is_empty());
    assert!(
        recv_answer_to(&mut a, 3).is_none(),
        "no answer to a replayed forward"
    );
    // Nobody but the paired NIC may report load or say goodbye for it.
    let bye = Control::NicBye.to_bytes(9);
    s.send(server, 9, &bye).unwrap();
    let answer = a.control(&Control::NicBye).unwrap();
    assert!(
        matches!(&answer, Control::Error { message } if message.contains("not allowed")),
        "{answer:?}"
    );
    let load = Control::NicLoad {
        agent: victim.local_addr().unwrap(),
        load: Default::default(),
        manifest: 0,
    };
    let answer = a.control(&load).unwrap();
    assert!(matches!(answer, Control::Error { .. }), "{answer:?}");
    std::thread::sleep(Duration::from_millis(50));
    // The NIC is still the NIC, and still serves.
    for _ in 0..50 {
        let r = a.call(A, handler_id("add"), &words(&[2, 3]), &[]).unwrap();
        assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
    }
    assert_eq!(a.agent(), Some(nic));
    assert!(victim.recv(Duration::from_millis(10)).unwrap().is_empty());
}

/// A stranger's sealed datagram for a session the server does not know gets the same answer
/// (a "no such session" notice of the same size) whether it carries a tenant's real tag or a
/// random one: the answer confirms no guess. Only the tenant's own credential proves the
/// notice.
fn a_guessed_tenant_tag_gets_the_answer_a_random_one_gets(d: &mut Deployment) {
    use naam_proto::session::{Sender, SessionKey};
    let mut s = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    let mut answer = |tag: u32, session: u64| {
        let forged = SessionKey::new(session, tag, [7; 32]).seal(Sender::Client, 1, &[0; 64]);
        s.send(d.server(), 1, &forged).unwrap();
        let got = s.recv(ANSWER_WAIT).unwrap();
        assert_eq!(got.len(), 1, "one answer for tag {tag:#x}");
        let m = got[0].1.clone();
        match Control::decode(&m).unwrap().1 {
            Control::Stale {
                session: at, token, ..
            } => {
                assert_eq!(at, session);
                (m.len(), token)
            }
            other => panic!("{other:?}"),
        }
    };
    let real = key_a().tag();
    let (guessed_len, guessed_token) = answer(real, 0x5151_0001);
    let (random_len, random_token) = answer(real ^ 0x00c0_ffee, 0x5151_0002);
    assert_eq!(guessed_len, random_len);
    assert_eq!(guessed_token, key_a().reset_token(0x5151_0001));
    assert_ne!(random_token, key_a().reset_token(0x5151_0002));
}

fn answers_to_unproven_peers_stay_within_the_amplification_limit(d: &mut Deployment) {
    let mut s = Socket::bind("127.0.0.1:0".parse().unwrap(), 1472).unwrap();
    let hello = |pad: usize| {
        let mut b = Control::Hello {
            tenant: "a".into(),
            nonce: [3; 32],
        }
        .to_bytes(1)
        .to_vec();
        b.resize(b.len().max(pad), b' ');
        b
    };
    let frame = naam_proto::frame::HEADER;
    for (msg, answered) in [
        (hello(HELLO_PADDING), true),
        (hello(0), true),
        (b"{}".to_vec(), false),
        // A malformed control message gets a short error, within the limit.
        (
            {
                use naam_proto::kind::{CONTROL, VERSION};
                vec![
                    VERSION, CONTROL, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, b'x',
                ]
            },
            true,
        ),
        (
            Control::Auth {
                tenant: "a".into(),
                client_nonce: [0; 32],
                server_nonce: [0; 32],
                issued: 0,
                cookie: [0; 16],
                proof: [0; 32],
            }
            .to_bytes(2)
            .to_vec(),
            true,
        ),
    ] {
        s.send(d.server(), 1, &msg).unwrap();
        let got = s.recv(Duration::from_millis(200)).unwrap();
        if let (Ok(asked), [(_, m)]) = (Control::request_id(&msg), &got[..]) {
            // Each answer comes under the request id of the message it answers, a malformed
            // one's too (read from its header), so that its sender can match it.
            assert_eq!(
                Control::request_id(m),
                Ok(asked),
                "{}",
                String::from_utf8_lossy(&msg)
            );
        }
        for (_, m) in &got {
            assert!(
                m.len() + frame <= 3 * (msg.len() + frame),
                "{} bytes answered {} bytes",
                msg.len(),
                m.len()
            );
        }
        assert_eq!(
            !got.is_empty(),
            answered,
            "{}",
            String::from_utf8_lossy(&msg)
        );
    }
}

fn a_server_restart_recovers_by_itself_within_five_seconds(d: &mut Deployment) {
    let at = d.server();
    let mut host = client(at, "a", key_a(), Some(Placement::Host));
    let mut nic = client(at, "a", key_a(), Some(Placement::Nic));
    wait_for_agent(&mut nic, A);
    let sorted = host
        .manifest()
        .app(A)
        .unwrap()
        .region_key("sorted")
        .unwrap();
    let lookup = |c: &mut UdpClient| {
        c.call(
            A,
            handler_id("bsearch"),
            &words(&[400]),
            &[rd(sorted, 0, 4096)],
        )
    };
    for c in [&mut host, &mut nic] {
        let r = lookup(c).unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    let restarted = Instant::now();
    d.restart_server();
    for (c, p) in [(&mut host, Placement::Host), (&mut nic, Placement::Nic)] {
        loop {
            match lookup(c) {
                Ok(r) if r.status == Status::Ok && r.placement == p => break,
                _ => {}
            }
            assert!(
                restarted.elapsed() < Duration::from_secs(5),
                "{p} did not recover within 5 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let took = restarted.elapsed();
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// `app`'s weights for `handler` as the server states them to `c`'s session, after `c`'s
/// load report `report` (`None`: no report).
fn weights_after(
    c: &mut UdpClient,
    app: u32,
    handler: &str,
    report: Option<naam_proto::steering::RemoteLoad>,
    rtt_ns: Option<f64>,
) -> Result<[f64; 3], String> {
    let q = Control::QueryWeights {
        app,
        client: report,
        rtt_ns,
    };
    match c.control(&q).unwrap() {
        Control::Weights { handlers, .. } => Ok(handlers
            .iter()
            .find(|h| h.handler == handler_id(handler))
            .expect("the handler's weights")
            .weights),
        Control::Error { message } => Err(message),
        other => panic!("unexpected answer {other:?}"),
    }
}

/// A report claiming `handler` of `app` costs nothing at the client.
fn free_client_runs(app: u32, handler: &str) -> naam_proto::steering::RemoteLoad {
    naam_proto::steering::RemoteLoad {
        executors: 1,
        handlers: vec![naam_proto::steering::RemoteHandler {
            app,
            handler: handler_id(handler),
            service_ns: 1.0,
            steps: 1.0,
            completions: 1_000,
        }],
        ..Default::default()
    }
}

/// Finding 5: client load reports are range-checked, and an in-range report moves only the
/// reporting session's own placement choices: another session of the same tenant, and
/// another tenant, keep theirs.
fn load_reports_are_range_checked_and_move_only_the_reporters_choices(d: &mut Deployment) {
    let mut liar = client(d.server(), "a", key_a(), None);
    let mut honest = client(d.server(), "a", key_a(), None);
    let mut other = client(d.server(), "b", key_b(), None);
    wait_for_agent(&mut honest, A);
    wait_for_agent(&mut other, B);
    // Traffic, so the controller has measured `add` at the server placements.
    for _ in 0..300 {
        honest
            .call(A, handler_id("add"), &words(&[1, 2]), &[])
            .unwrap();
        other
            .call(B, handler_id("add"), &words(&[1, 2]), &[])
            .unwrap();
    }
    let client = Placement::Client.index();
    let before = weights_after(&mut honest, A, "add", None, None).unwrap();
    let before_b = weights_after(&mut other, B, "add", None, None).unwrap();
    assert!(before[client] < 0.5, "{before:?}");
    // Out of range: refused with a reason, nothing taken in.
    let mut negative = free_client_runs(A, "add");
    negative.handlers[0].service_ns = -1e12;
    let e = weights_after(&mut liar, A, "add", Some(negative), None).unwrap_err();
    assert!(e.contains("out of range"), "{e}");
    let e = weights_after(&mut liar, A, "add", None, Some(-5.0)).unwrap_err();
    assert!(e.contains("out of range"), "{e}");
    // (JSON has no NaN or infinity: a report carries finite numbers or fails to decode.)
    for absurd in [-1.0, 1e15] {
        let mut report = free_client_runs(A, "add");
        report.loop_ns = absurd;
        let e = weights_after(&mut liar, A, "add", Some(report), None).unwrap_err();
        assert!(e.contains("out of range"), "loop_ns {absurd}: {e}");
    }
    // In range and flattering to the Client placement, over and over: the liar's own Client
    // share moves (as soon as the server's controller has taken the reports in: on a loaded
    // CI runner that took more than the 20 reports and 40 ms this once waited)...
    let mut mine = before;
    let deadline = Instant::now() + Duration::from_secs(5);
    for round in 0.. {
        if round >= 20 && (mine[client] > 0.5 || Instant::now() >= deadline) {
            break;
        }
        mine = weights_after(
            &mut liar,
            A,
            "add",
            Some(free_client_runs(A, "add")),
            Some(1.0),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(mine[client] > 0.5, "the liar's own choice moved: {mine:?}");
    // ...and nobody else's.
    let after = weights_after(&mut honest, A, "add", None, None).unwrap();
    let after_b = weights_after(&mut other, B, "add", None, None).unwrap();
    assert!(after[client] < 0.5, "{after:?}");
    assert!(
        (after[client] - before[client]).abs() < 0.05,
        "{before:?} -> {after:?}"
    );
    assert!(
        (after_b[client] - before_b[client]).abs() < 0.05,
        "{before_b:?} -> {after_b:?}"
    );
    // The honest client's calls still go to the server.
    let r = honest
        .call(A, handler_id("add"), &words(&[2, 2]), &[])
        .unwrap();
    assert_eq!(r.status, Status::Ok);
}

/// Each finding's test twice: against the driver loops on threads of this process, and against
/// `naam-server` and `naam-nic` processes started from files as an operator would.
macro_rules! on_threads_and_as_processes {
    ($($finding:ident),* $(,)?) => {$(
        mod $finding {
            #[test]
            fn on_threads() {
                super::$finding(&mut super::Deployment::threads());
            }

            #[test]
            fn as_processes() {
                if let Some(mut d) = super::Deployment::processes(stringify!($finding)) {
                    super::$finding(&mut d);
                }
            }
        }
    )*};
}

on_threads_and_as_processes!(
    strangers_and_other_tenants_can_neither_read_nor_change_a_tenants_memory,
    guessed_request_ids_poison_no_one_elses_writes,
    the_nic_reflects_nothing_and_cannot_be_impersonated,
    answers_to_unproven_peers_stay_within_the_amplification_limit,
    a_guessed_tenant_tag_gets_the_answer_a_random_one_gets,
    a_server_restart_recovers_by_itself_within_five_seconds,
    load_reports_are_range_checked_and_move_only_the_reporters_choices,
);
