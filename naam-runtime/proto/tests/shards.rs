//! A server of two receive loops (two server endpoints sharing a session directory, one
//! address), several clients and a NIC, in virtual time. The network delivers a datagram to
//! the loop its route names, as the kernel's reuseport filter does, and by a hash of the
//! sender's address when it has none (handshakes). Every session routes back to the loop that
//! set it up; the NIC, of two receive loops itself, pairs through one server loop, learns
//! every loop's sessions, takes requests forwarded by either, and serves each session's own
//! datagrams on its route's loop.

mod common;

use common::{manifest, ModelNic, APP, INCREMENT, MS, READ};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use naam_ebpf::abi::{Descriptor, ACCESS_READ};
use naam_proto::control::Control;
use naam_proto::endpoint::{
    Channel, ClientConfig, ClientEndpoint, ClientEvent, HostBackend, NicConfig, NicEndpoint,
    Routed, ServerConfig, ServerEndpoint, SessionDirectory, SwitchHandle, Transmit, VerbsAcceptor,
};
use naam_proto::entropy::Entropy;
use naam_proto::session::{tenant_entries, CookieJar, Credential};
use naam_proto::shard::{loop_of_route, route_of_session, Shard};
use naam_proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_proto::wire::{LoadFeedback, Reply, Request, Status};
use naam_proto::{Nanos, Placement};

const LOOPS: usize = 2;
const CLIENTS: u16 = 6;
const NIC_LOOPS: usize = 2;

fn server_addr() -> SocketAddr {
    "10.0.0.1:7000".parse().expect("literal")
}

fn nic_addr() -> SocketAddr {
    "10.0.0.3:7001".parse().expect("literal")
}

fn client_addr(i: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 2], 5000 + i))
}

/// What the host's loops share, as the cluster behind naam-server's loops is one.
#[derive(Default)]
struct HostState {
    counter: u64,
    congested: bool,
    nic_up: bool,
    next_client: u32,
}

/// One loop's view of the shared host: runs requests at once, answered through the endpoint.
struct LoopHost(Arc<Mutex<HostState>>);

impl HostBackend for LoopHost {
    fn dispatch(
        &mut self,
        req: &mut Request,
        _sel: &mut Selector,
        _forced: Option<Placement>,
        _reply_to: &Channel,
        out: &mut Reply,
    ) -> Routed {
        let mut h = self.0.lock().unwrap();
        if req.handler == READ && h.congested {
            return Routed::Remote(Box::new(std::mem::take(req)));
        }
        if req.handler == INCREMENT {
            h.counter += 1;
        }
        *out = Reply {
            app: req.app,
            request_id: req.request_id,
            status: Status::Ok,
            code: 0,
            steps: 1,
            placement: Placement::Host,
            load: LoadFeedback::default(),
            payload: Bytes::copy_from_slice(&h.counter.to_le_bytes()),
        };
        Routed::Answered
    }
    fn next_client_id(&mut self) -> u32 {
        let mut h = self.0.lock().unwrap();
        h.next_client += 1;
        h.next_client
    }
    fn nic_up(&self) -> bool {
        self.0.lock().unwrap().nic_up
    }
    fn nic_load(&mut self, _load: &RemoteLoad) {
        self.0.lock().unwrap().nic_up = true;
    }
    fn nic_gone(&mut self) {
        self.0.lock().unwrap().nic_up = false;
    }
    fn handlers(&self, app: u32) -> Option<Vec<u32>> {
        (app == APP).then(|| vec![INCREMENT, READ])
    }
    fn has_handler(&self, app: u32, handler: u32) -> bool {
        app == APP && (handler == INCREMENT || handler == READ)
    }
    fn client_share(&self) -> Option<ClientShare> {
        None
    }
    fn weights(&self, _app: u32, _handler: u32, _share: Option<&mut ClientShare>) -> Weights {
        Weights::all(Placement::Host)
    }
    fn congest(&mut self, _extra_ns: Option<u64>) {}
    fn switch(&self) -> Option<&dyn SwitchHandle> {
        None
    }
    fn verbs(&self) -> Option<&dyn VerbsAcceptor> {
        None
    }
}

struct World {
    now: Nanos,
    /// Datagrams in flight: (due, from, to, route, bytes), delivered in order after a fixed
    /// delay; the route is the one their frame headers carry.
    wire: Vec<(Nanos, SocketAddr, SocketAddr, u8, Bytes)>,
    host: Arc<Mutex<HostState>>,
    loops: Vec<ServerEndpoint<LoopHost>>,
    /// Datagrams each loop took in.
    taken: Vec<u64>,
    clients: Vec<ClientEndpoint>,
    events: Vec<Vec<ClientEvent>>,
    pairing: Credential,
    /// The NIC's receive loops (empty: no NIC), and the datagrams each took in.
    nic: Vec<NicEndpoint<ModelNic>>,
    nic_taken: Vec<u64>,
    /// Where datagrams without a route go: `None`, a hash of the sender; `Some(i)`, loop `i`
    /// (a kernel whose hash puts every client on one loop).
    unrouted_to: Option<usize>,
}

impl World {
    fn new() -> World {
        let entropy = Entropy::seeded(1);
        let credential = Credential::generate(&entropy).expect("randomness");
        let pairing = Credential::generate(&entropy).expect("randomness");
        let tenants = tenant_entries(
            &[(APP, "counter".into(), credential.clone())],
            None,
            Some(pairing.clone()),
        );
        let host = Arc::new(Mutex::new(HostState::default()));
        let directory = SessionDirectory::new();
        let loops = Shard::all(LOOPS)
            .expect("two loops")
            .into_iter()
            .map(|shard| {
                let mut config = ServerConfig::new(manifest(1), tenants.clone(), entropy.clone());
                config.shard = shard;
                config.directory = directory.clone();
                ServerEndpoint::new(
                    config,
                    LoopHost(host.clone()),
                    CookieJar::with_key([7; 32]),
                    0,
                )
                .expect("a one-page manifest")
            })
            .collect();
        let clients = (0..CLIENTS)
            .map(|_| {
                ClientEndpoint::new(
                    ClientConfig::new(
                        server_addr(),
                        "counter",
                        credential.clone(),
                        entropy.clone(),
                    ),
                    0,
                )
            })
            .collect();
        World {
            now: 0,
            wire: Vec::new(),
            host,
            loops,
            taken: vec![0; LOOPS],
            clients,
            events: (0..CLIENTS).map(|_| Vec::new()).collect(),
            pairing,
            nic: Vec::new(),
            nic_taken: vec![0; NIC_LOOPS],
            unrouted_to: None,
        }
    }

    fn send(&mut self, from: SocketAddr, t: Transmit) {
        let (route, to) = (t.frame_route(), t.to);
        self.wire
            .push((self.now + 50_000, from, to, route, t.into_message()));
    }

    fn flush(&mut self) {
        let mut out = Vec::new();
        for (i, c) in self.clients.iter_mut().enumerate() {
            while let Some(t) = c.poll_transmit() {
                out.push((client_addr(i as u16), t));
            }
            while let Some(e) = c.poll_event() {
                self.events[i].push(e);
            }
        }
        for l in &mut self.loops {
            while let Some(t) = l.poll_transmit() {
                out.push((server_addr(), t));
            }
        }
        for nic in &mut self.nic {
            while let Some(t) = nic.poll_transmit() {
                out.push((nic_addr(), t));
            }
            for t in std::mem::take(&mut nic.backend_mut().outbox) {
                out.push((nic_addr(), t));
            }
            while nic.poll_event().is_some() {}
        }
        for (from, t) in out {
            self.send(from, t);
        }
    }

    /// The loop of `loops` a datagram from `from` reaches: its route's, else a hash of the
    /// sender (or the loop [`World::unrouted_to`] names).
    fn loop_for(&self, from: SocketAddr, route: u8, loops: usize) -> usize {
        loop_of_route(route, loops)
            .unwrap_or_else(|| self.unrouted_to.unwrap_or(from.port() as usize) % loops)
    }

    fn run_until(&mut self, limit: Nanos, done: impl Fn(&World) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            self.flush();
            if done(self) {
                return true;
            }
            let timers = self
                .clients
                .iter()
                .filter_map(|c| c.poll_timeout())
                .chain(self.loops.iter().filter_map(|l| l.poll_timeout()))
                .chain(self.nic.iter().filter_map(|n| n.poll_timeout()));
            let next = self.wire.iter().map(|d| d.0).chain(timers).min();
            let Some(next) = next.filter(|n| *n <= end) else {
                self.now = end;
                return done(self);
            };
            self.now = self.now.max(next);
            let now = self.now;
            let due: Vec<_> = self.wire.iter().filter(|d| d.0 <= now).cloned().collect();
            self.wire.retain(|d| d.0 > now);
            for (_, from, to, route, bytes) in due {
                if to == server_addr() {
                    let i = self.loop_for(from, route, LOOPS);
                    self.taken[i] += 1;
                    self.loops[i].handle(now, from, bytes);
                    self.loops[i].run(usize::MAX);
                } else if to == nic_addr() {
                    if !self.nic.is_empty() {
                        let i = self.loop_for(from, route, NIC_LOOPS);
                        self.nic_taken[i] += 1;
                        self.nic[i].handle(now, from, bytes);
                        // A loop's turn ends with its timers, as the driver's does.
                        self.nic[i].handle_timeout(now);
                    }
                } else if let Some(i) = (0..CLIENTS).find(|i| client_addr(*i) == to) {
                    self.clients[i as usize].handle(now, from, bytes);
                }
            }
            for c in &mut self.clients {
                c.handle_timeout(now);
            }
            for l in &mut self.loops {
                l.handle_timeout(now);
            }
            for nic in &mut self.nic {
                nic.handle_timeout(now);
            }
        }
    }

    fn answer(&self, client: usize, id: u64) -> Option<Reply> {
        self.events[client].iter().find_map(|e| match e {
            ClientEvent::Answered { id: i, message } if *i == id => {
                Some(Reply::decode(message.clone()).expect("a reply"))
            }
            _ => None,
        })
    }

    /// Every client calls `handler` once; their replies.
    fn everyone_calls(&mut self, handler: u32) -> Vec<Reply> {
        let ids: Vec<u64> = (0..CLIENTS as usize)
            .map(|i| {
                let mut req = Request::for_call(APP, handler, 0, b"", &[]).expect("small");
                self.clients[i].request(self.now, &mut req).expect("sent")
            })
            .collect();
        let all = |w: &World| {
            ids.iter()
                .enumerate()
                .all(|(i, id)| w.answer(i, *id).is_some())
        };
        assert!(
            self.run_until(1_000 * MS, all),
            "unanswered calls: loops {:?}, NIC {:?}, events {:?}",
            self.loops.iter().map(|l| l.stats()).collect::<Vec<_>>(),
            self.nic.iter().map(|n| n.stats()).collect::<Vec<_>>(),
            self.events.iter().map(|e| e.last()).collect::<Vec<_>>()
        );
        ids.iter()
            .enumerate()
            .map(|(i, id)| self.answer(i, *id).expect("answered"))
            .collect()
    }

    fn start_nic(&mut self) {
        let config = NicConfig::new(
            server_addr(),
            nic_addr(),
            self.pairing.clone(),
            Entropy::seeded(2),
        );
        let first = NicEndpoint::new(config, ModelNic::default(), &manifest(1), self.now);
        let others: Vec<_> = (1..NIC_LOOPS)
            .map(|_| first.another_loop(ModelNic::default()))
            .collect();
        self.nic = std::iter::once(first).chain(others).collect();
        let ready = |w: &World| {
            w.host.lock().unwrap().nic_up
                && w.nic
                    .iter()
                    .all(|n| n.is_paired() && n.sessions() == CLIENTS as usize)
        };
        assert!(
            self.run_until(1_000 * MS, ready),
            "the NIC paired and learned every loop's sessions: {:?}",
            self.nic.iter().map(|n| n.sessions()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn sessions_stay_on_their_loop_and_the_nic_serves_every_loops_sessions() {
    let mut w = World::new();
    for c in &mut w.clients {
        c.connect(0);
    }
    let connected = |w: &World| {
        w.events
            .iter()
            .all(|e| e.iter().any(|e| matches!(e, ClientEvent::Connected(_))))
    };
    assert!(w.run_until(5_000 * MS, connected), "every client connected");
    // Sessions spread over the loops in turn: each holds its share, and each session's id
    // routes back to the loop that holds it.
    let per_loop: Vec<usize> = w.loops.iter().map(|l| l.sessions()).collect();
    assert_eq!(per_loop, vec![CLIENTS as usize / LOOPS; LOOPS]);
    for e in w.events.iter().flatten() {
        if let ClientEvent::Connected(welcome) = e {
            let Control::Welcome { session, .. } = **welcome else {
                continue;
            };
            let i = loop_of_route(route_of_session(session), LOOPS).expect("routed");
            assert_ne!(route_of_session(session), 0);
            assert!(w.loops[i].sessions() > 0);
        }
    }
    // Writes from every client, on either loop, reach the one host.
    let replies = w.everyone_calls(INCREMENT);
    assert!(replies.iter().all(|r| r.status == Status::Ok));
    assert_eq!(w.host.lock().unwrap().counter, CLIENTS as u64);
    let before = w.taken.clone();
    w.everyone_calls(READ);
    // Sealed traffic went to the owning loops only: each took one request per session.
    let took: Vec<u64> = w.taken.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(took, per_loop.iter().map(|n| *n as u64).collect::<Vec<_>>());

    // The NIC pairs through one loop and learns the sessions of both.
    w.start_nic();
    w.host.lock().unwrap().congested = true;
    let executed: Vec<u64> = w.nic.iter().map(|n| n.stats().executed).collect();
    let replies = w.everyone_calls(READ);
    for r in &replies {
        assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
        assert_eq!(&r.payload[..], b"nic");
    }
    // The forwards, sealed in the pairing session, carry their client sessions' routes: they
    // spread over the NIC's loops, each run by the loop that serves its session's own
    // datagrams, instead of all reaching the pairing session's loop.
    let ran: Vec<u64> = w
        .nic
        .iter()
        .zip(&executed)
        .map(|(n, before)| n.stats().executed - before)
        .collect();
    let mut expected = vec![0u64; NIC_LOOPS];
    for e in w.events.iter() {
        if let Some(ClientEvent::Connected(welcome)) =
            e.iter().find(|e| matches!(e, ClientEvent::Connected(_)))
        {
            let Control::Welcome { session, .. } = **welcome else {
                continue;
            };
            expected[loop_of_route(route_of_session(session), NIC_LOOPS).expect("routed")] += 1;
        }
    }
    assert_eq!(ran, expected, "each forward ran on its session's NIC loop");
    assert!(
        ran.iter().all(|n| *n > 0),
        "both NIC loops ran forwards: {ran:?}"
    );
    assert!(w.nic.iter().all(|n| n.stats().unauthenticated == 0));
    let forwarded: u64 = w.loops.iter().map(|l| l.stats().forwarded).sum();
    assert_eq!(forwarded, CLIENTS as u64);
    let mut by_loop = HashMap::new();
    for (i, l) in w.loops.iter().enumerate() {
        by_loop.insert(i, l.stats().forwarded);
    }
    assert!(
        by_loop.values().all(|n| *n > 0),
        "both loops forwarded: {by_loop:?}"
    );

    // Each session's own datagrams (one-sided reads, straight to the NIC) reach the NIC loop
    // of its route, which opens them although another loop learned the session (the model's
    // app has no regions: each read is refused by the loop that opened it).
    let before = w.nic_taken.clone();
    let ids: Vec<u64> = (0..CLIENTS as usize)
        .map(|i| {
            w.clients[i].set_agent(Some(nic_addr()));
            let now = w.now;
            let d = Descriptor {
                rkey: 1,
                offset: 0,
                len: 8,
                access: ACCESS_READ,
            };
            w.clients[i].read(now, APP, &[d]).expect("sent")
        })
        .collect();
    let answered = |w: &World| {
        ids.iter().enumerate().all(|(i, id)| {
            w.events[i]
                .iter()
                .any(|e| matches!(e, ClientEvent::Answered { id: got, .. } if got == id))
        })
    };
    assert!(w.run_until(1_000 * MS, answered), "every read answered");
    let served: Vec<u64> = w.nic.iter().map(|n| n.stats().refused).collect();
    assert!(w.nic.iter().all(|n| n.stats().unauthenticated == 0));
    assert_eq!(served.iter().sum::<u64>(), CLIENTS as u64, "{served:?}");
    assert!(
        served.iter().all(|n| *n > 0),
        "both NIC loops served: {served:?}"
    );
    let took: Vec<u64> = w
        .nic_taken
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    assert_eq!(took, served, "each read reached one loop, its session's");

    // A restarted NIC pairs again (through whichever loop) and learns every session anew.
    w.nic.clear();
    w.start_nic();
    let replies = w.everyone_calls(READ);
    assert!(replies
        .iter()
        .all(|r| (r.status, r.placement) == (Status::Ok, Placement::Nic)));
}

/// The kernel's hash of the addresses puts every handshake on loop 0, and clients connect
/// one at a time and all at once: the server still spreads their sessions over its loops in
/// turn (each `Auth` goes where its challenge says), and every session works.
#[test]
fn new_sessions_spread_over_the_loops_wherever_the_kernel_hashes_handshakes() {
    let mut w = World::new();
    w.unrouted_to = Some(0);
    let connected = |n: usize| {
        move |w: &World| {
            w.events[..n]
                .iter()
                .all(|e| e.iter().any(|e| matches!(e, ClientEvent::Connected(_))))
        }
    };
    // Half one after another, the other half together.
    let half = CLIENTS as usize / 2;
    for i in 0..half {
        let now = w.now;
        w.clients[i].connect(now);
        assert!(
            w.run_until(5_000 * MS, connected(i + 1)),
            "client {i} connected"
        );
    }
    let now = w.now;
    for c in &mut w.clients[half..] {
        c.connect(now);
    }
    assert!(
        w.run_until(5_000 * MS, connected(CLIENTS as usize)),
        "every client connected"
    );
    let per_loop: Vec<usize> = w.loops.iter().map(|l| l.sessions()).collect();
    assert_eq!(per_loop, vec![CLIENTS as usize / LOOPS; LOOPS]);
    // Each session's sealed traffic reaches its own loop, which answers it.
    let before = w.taken.clone();
    let replies = w.everyone_calls(READ);
    assert!(replies.iter().all(|r| r.status == Status::Ok));
    let took: Vec<u64> = w.taken.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(took, vec![(CLIENTS as usize / LOOPS) as u64; LOOPS]);
}
