//! The client, server and NIC endpoints joined by an in-memory network in virtual time (the model
//! is quinn-proto's `Pair`): loss, duplication, reordering and delay are parameters, time
//! advances to the next event, and no test opens a socket or sleeps. The host behind the
//! server is a model with the executor's contract: writes applied once per request id (a
//! dedup table answers retransmissions), reads steered to the NIC when the host is
//! congested.

mod common;

use common::{manifest, ModelNic, APP, INCREMENT, MS, READ};
use std::collections::HashMap;
use std::net::SocketAddr;

use bytes::Bytes;
use naam_proto::control::{AppManifest, Control};
use naam_proto::dedup::RecentAnswers;
use naam_proto::endpoint::{
    Channel, ClientConfig, ClientEndpoint, ClientEvent, DeployChange, DeployJob, ExchangeError,
    HostBackend, InProcess, NicConfig, NicEndpoint, NicEvent, Routed, ServerConfig, ServerEndpoint,
    SwitchHandle, Transmit, VerbsAcceptor,
};
use naam_proto::entropy::Entropy;
use naam_proto::limits;
use naam_proto::session::{tenant_entries, CookieJar, Credential};
use naam_proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_proto::wire::{LoadFeedback, Reply, Request, Status};
use naam_proto::{Nanos, Placement};

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("literal address")
}

fn client_addr() -> SocketAddr {
    addr("10.0.0.2:5000")
}

fn server_addr() -> SocketAddr {
    addr("10.0.0.1:7000")
}

fn nic_addr() -> SocketAddr {
    addr("10.0.0.3:7001")
}

/// The host behind the server endpoint, as the cluster behaves: executes at once, answers
/// on the request's channel, deduplicates writes, steers reads to the NIC when congested.
#[derive(Default)]
struct ModelHost {
    /// Replies "sent from executor threads", for the network.
    outbox: Vec<Transmit>,
    counter: u64,
    /// Times each write was applied, by (session, request id).
    applied: HashMap<(u64, u64), u32>,
    answers: Option<RecentAnswers<(u64, u64), Reply>>,
    /// Requests that arrived marked as retransmissions (RETRY).
    retried: u64,
    /// Reads go to the NIC (the host is congested).
    congested: bool,
    /// Requests are run where they arrive and answered through the endpoint (naam-server's
    /// run to completion), not on the channel by "executors".
    inline: bool,
    nic_up: bool,
    next_client: u32,
    /// Writes are answered only when the test releases them (`held`), as writes queued for
    /// an owner elsewhere are answered after reads that came later.
    hold_writes: bool,
    held: Vec<Transmit>,
    /// Deploys the endpoint passed on, checked.
    deploys: Vec<DeployJob>,
}

impl ModelHost {
    fn reply(&self, req: &Request) -> Reply {
        Reply {
            app: req.app,
            request_id: req.request_id,
            status: Status::Ok,
            code: 0,
            steps: 1,
            placement: Placement::Host,
            load: LoadFeedback::default(),
            payload: Bytes::copy_from_slice(&self.counter.to_le_bytes()),
        }
    }
}

impl HostBackend for ModelHost {
    fn dispatch(
        &mut self,
        req: &mut Request,
        _sel: &mut Selector,
        forced: Option<Placement>,
        reply_to: &Channel,
        out: &mut Reply,
    ) -> Routed {
        if req.flags & naam_proto::wire::flags::RETRY != 0 {
            self.retried += 1;
        }
        if req.handler == READ && self.congested && forced != Some(Placement::Host) {
            return Routed::Remote(Box::new(std::mem::take(req)));
        }
        let r = if req.handler == INCREMENT {
            let key = (req.origin, req.request_id);
            let answers = self.answers.get_or_insert_with(|| RecentAnswers::new(1024));
            match answers.get(&key) {
                Some(r) => r.clone(),
                None => {
                    self.counter += 1;
                    *self.applied.entry(key).or_default() += 1;
                    let r = self.reply(req);
                    if let Some(a) = self.answers.as_mut() {
                        a.insert(key, r.clone());
                    }
                    r
                }
            }
        } else {
            self.reply(req)
        };
        if self.hold_writes && req.handler == INCREMENT {
            self.held.push(reply_to.reply(&r));
            return Routed::Queued(Placement::Host);
        }
        if self.inline {
            *out = r;
            return Routed::Answered;
        }
        self.outbox.push(reply_to.reply(&r));
        Routed::Queued(Placement::Host)
    }

    fn next_client_id(&mut self) -> u32 {
        self.next_client += 1;
        self.next_client
    }

    fn nic_up(&self) -> bool {
        self.nic_up
    }

    fn nic_load(&mut self, _load: &RemoteLoad) {
        self.nic_up = true;
    }

    fn nic_gone(&mut self) {
        self.nic_up = false;
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

    fn weights(&self, _app: u32, handler: u32, _share: Option<&mut ClientShare>) -> Weights {
        if handler == READ && self.congested {
            Weights::all(Placement::Nic)
        } else {
            Weights::all(Placement::Host)
        }
    }

    fn congest(&mut self, extra_ns: Option<u64>) {
        self.congested = extra_ns.is_some();
    }

    fn switch(&self) -> Option<&dyn SwitchHandle> {
        None
    }

    fn verbs(&self) -> Option<&dyn VerbsAcceptor> {
        None
    }

    fn deploy(&mut self, job: DeployJob, _reply_to: &Channel) -> Option<Control> {
        let app = job.app;
        // A retransmission carries the id of the first: answered again, not deployed again.
        if self.deploys.last().is_none_or(|j| j.id != job.id) {
            self.deploys.push(job);
        }
        Some(Control::Deployed {
            app,
            version: self.deploys.len() as u64,
            handlers: Vec::new(),
        })
    }
}

/// The network: every datagram is lost, duplicated and delayed (with jitter, so reordered)
/// by a seeded generator.
struct Net {
    loss: f64,
    duplicate: f64,
    delay: Nanos,
    jitter: Nanos,
    rng: u64,
    seq: u64,
    in_flight: Vec<(Nanos, u64, SocketAddr, SocketAddr, Bytes)>,
    /// Datagrams delivered, by destination.
    delivered: HashMap<SocketAddr, u64>,
    /// Datagrams delivered, by (source, destination).
    delivered_between: HashMap<(SocketAddr, SocketAddr), u64>,
}

impl Net {
    fn new(seed: u64) -> Net {
        Net {
            loss: 0.0,
            duplicate: 0.0,
            delay: 50_000,
            jitter: 0,
            rng: seed | 1,
            seq: 0,
            in_flight: Vec::new(),
            delivered: HashMap::new(),
            delivered_between: HashMap::new(),
        }
    }

    fn random(&mut self) -> f64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn send(&mut self, now: Nanos, from: SocketAddr, t: Transmit) {
        if self.random() < self.loss {
            return;
        }
        let copies = if self.random() < self.duplicate { 2 } else { 1 };
        for _ in 0..copies {
            let at = now + self.delay + (self.random() * self.jitter as f64) as Nanos;
            self.seq += 1;
            self.in_flight.push((at, self.seq, from, t.to, t.message()));
        }
    }

    fn next_delivery(&self) -> Option<Nanos> {
        self.in_flight.iter().map(|d| d.0).min()
    }

    fn take_due(&mut self, now: Nanos) -> Vec<(SocketAddr, SocketAddr, Bytes)> {
        let mut due: Vec<_> = Vec::new();
        self.in_flight.retain(|d| {
            if d.0 <= now {
                due.push(d.clone());
                false
            } else {
                true
            }
        });
        due.sort_by_key(|d| (d.0, d.1));
        due.into_iter()
            .map(|(_, _, from, to, b)| {
                *self.delivered.entry(to).or_default() += 1;
                *self.delivered_between.entry((from, to)).or_default() += 1;
                (from, to, b)
            })
            .collect()
    }
}

/// A client, a server over the model host, and optionally a NIC, joined by a [`Net`].
struct World {
    now: Nanos,
    net: Net,
    credential: Credential,
    pairing: Credential,
    /// The client's and the NIC's randomness (the server has its own, per epoch).
    entropy: Entropy,
    client: ClientEndpoint,
    server: ServerEndpoint<ModelHost>,
    nic: Option<NicEndpoint<ModelNic>>,
    /// The client's events, in order.
    events: Vec<ClientEvent>,
    /// The NIC's events, in order.
    nic_events: Vec<NicEvent>,
    /// The server takes each datagram as an inline driver does
    /// (`ServerEndpoint::handle_alone`), not as a receive loop (`handle`, then `run`).
    alone: bool,
}

fn server(credential: &Credential, pairing: &Credential, epoch: u64) -> ServerEndpoint<ModelHost> {
    let tenants = tenant_entries(
        &[(APP, "counter".into(), credential.clone())],
        Some(Credential::generate(&Entropy::seeded(1_000 + epoch)).expect("randomness")),
        Some(pairing.clone()),
    );
    let mut config = ServerConfig::new(manifest(epoch), tenants, Entropy::seeded(2_000 + epoch));
    config.congestion_control = true;
    ServerEndpoint::new(
        config,
        ModelHost::default(),
        CookieJar::with_key([epoch as u8; 32]),
        0,
    )
    .expect("a one-page manifest")
}

impl World {
    fn new(seed: u64) -> World {
        let entropy = Entropy::seeded(seed);
        let credential = Credential::generate(&entropy).expect("randomness");
        let pairing = Credential::generate(&entropy).expect("randomness");
        let client = ClientEndpoint::new(
            ClientConfig::new(
                server_addr(),
                "counter",
                credential.clone(),
                entropy.clone(),
            ),
            0,
        );
        World {
            now: 0,
            net: Net::new(seed),
            server: server(&credential, &pairing, 1),
            credential,
            pairing,
            entropy,
            client,
            nic: None,
            events: Vec::new(),
            nic_events: Vec::new(),
            alone: false,
        }
    }

    /// Moves everything every endpoint wants sent onto the network and takes the events.
    fn flush(&mut self) {
        let now = self.now;
        while let Some(t) = self.client.poll_transmit() {
            self.net.send(now, client_addr(), t);
        }
        while let Some(t) = self.server.poll_transmit() {
            self.net.send(now, server_addr(), t);
        }
        for t in std::mem::take(&mut self.server.backend_mut().outbox) {
            self.net.send(now, server_addr(), t);
        }
        if let Some(nic) = &mut self.nic {
            while let Some(t) = nic.poll_transmit() {
                self.net.send(now, nic_addr(), t);
            }
            for t in std::mem::take(&mut nic.backend_mut().outbox) {
                self.net.send(now, nic_addr(), t);
            }
            while let Some(e) = nic.poll_event() {
                self.nic_events.push(e);
            }
        }
        while let Some(e) = self.client.poll_event() {
            self.events.push(e);
        }
    }

    /// Runs until `done` holds or virtual time passes `limit` (from now); returns `done`.
    fn run_until(&mut self, limit: Nanos, done: impl Fn(&World) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            self.flush();
            if done(self) {
                return true;
            }
            let next = [
                self.net.next_delivery(),
                self.client.poll_timeout(),
                self.server.poll_timeout(),
                self.nic.as_ref().and_then(|n| n.poll_timeout()),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next.filter(|n| *n <= end) else {
                self.now = end;
                return done(self);
            };
            self.now = self.now.max(next);
            for (from, to, bytes) in self.net.take_due(self.now) {
                if to == server_addr() && self.alone {
                    self.server.handle_alone(self.now, from, bytes);
                    self.server.run(usize::MAX);
                } else if to == server_addr() {
                    self.server.handle(self.now, from, bytes);
                    self.server.run(usize::MAX);
                } else if to == client_addr() {
                    self.client.handle(self.now, from, bytes);
                } else if let Some(nic) = self.nic.as_mut().filter(|_| to == nic_addr()) {
                    nic.handle(self.now, from, bytes);
                }
            }
            self.client.handle_timeout(self.now);
            self.server.handle_timeout(self.now);
            if let Some(nic) = &mut self.nic {
                nic.handle_timeout(self.now);
            }
        }
    }

    fn connected(&mut self) {
        self.client.connect(self.now);
        assert!(
            self.run_until(10_000 * MS, |w| w
                .events
                .iter()
                .any(|e| matches!(e, ClientEvent::Connected(_)))),
            "no session: {:?}",
            self.events
        );
    }

    /// Sends a request for `handler` and returns its id.
    fn call(&mut self, handler: u32) -> u64 {
        let mut req = Request::for_call(APP, handler, 0, b"", &[]).expect("small request");
        self.client.request(self.now, &mut req).expect("sent")
    }

    /// The outcome of exchange `id`, once there is one.
    fn outcome(&self, id: u64) -> Option<Result<Bytes, ExchangeError>> {
        self.events.iter().find_map(|e| match e {
            ClientEvent::Answered { id: i, message } if *i == id => Some(Ok(message.clone())),
            ClientEvent::Failed { id: i, error } if *i == id => Some(Err(error.clone())),
            _ => None,
        })
    }

    fn outcomes(&self, id: u64) -> usize {
        self.events
            .iter()
            .filter(|e| {
                matches!(e, ClientEvent::Answered { id: i, .. } | ClientEvent::Failed { id: i, .. }
                    if *i == id)
            })
            .count()
    }

    /// Runs until exchange `id` has an outcome (within a virtual minute) and returns its
    /// reply.
    fn reply(&mut self, id: u64) -> Result<Reply, ExchangeError> {
        self.run_until(60_000 * MS, |w| w.outcome(id).is_some());
        let m = self
            .outcome(id)
            .expect("an outcome within a virtual minute")?;
        Ok(Reply::decode(m).expect("a reply"))
    }

    /// Hands a request for `app`'s `handler` to the server as a client in its process does
    /// (no datagram); the server's verdict, the request's id, and the caller's reply slot
    /// after it (the reply of one answered at once).
    fn call_in_process(&mut self, app: u32, handler: u32) -> (Option<InProcess>, u64, Reply) {
        let mut req = Request::for_call(app, handler, 0, b"", &[]).expect("small request");
        let sid = self
            .client
            .request_in_process(self.now, &mut req)
            .expect("alive")
            .expect("a session is up");
        let id = req.request_id;
        let mut out = Reply::unanswered();
        let verdict = self
            .server
            .request_in_process(self.now, sid, &mut req, &mut out);
        (verdict, id, out)
    }

    /// Calls `handler` and waits for the reply.
    fn roundtrip(&mut self, handler: u32) -> Result<Reply, ExchangeError> {
        let id = self.call(handler);
        self.reply(id)
    }

    /// Starts a (new) NIC and runs until it is paired, has reported its load, and knows the
    /// client's session.
    fn start_nic(&mut self) {
        let config = NicConfig::new(
            server_addr(),
            nic_addr(),
            self.pairing.clone(),
            self.entropy.clone(),
        );
        self.nic = Some(NicEndpoint::new(
            config,
            ModelNic::default(),
            &manifest(1),
            self.now,
        ));
        assert!(
            self.run_until(1_000 * MS, |w| w.server.backend().nic_up
                && w.nic
                    .as_ref()
                    .is_some_and(|n| n.is_paired() && n.sessions() > 0)),
            "the NIC did not pair: {:?}",
            self.nic_events
        );
    }
}

fn counter(r: &Reply) -> u64 {
    u64::from_le_bytes(r.payload[..8].try_into().expect("eight bytes"))
}

#[test]
fn a_session_is_set_up_and_requests_are_answered() {
    let mut w = World::new(1);
    w.connected();
    let id = w.call(INCREMENT);
    let r = w.reply(id).expect("answered");
    assert_eq!((r.status, counter(&r)), (Status::Ok, 1));
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!(counter(&r), 1);
    assert_eq!(w.server.stats().sessions, 1);
    assert_eq!(w.server.stats().host, 2);
}

/// A request queued when a new handshake starts (a renewal) leaves sealed in the session it
/// was queued in, ahead of the hello, as it would have had it been polled first.
#[test]
fn what_waits_when_a_handshake_starts_leaves_sealed_in_its_own_session() {
    let mut w = World::new(1);
    w.connected();
    let probe = w.client.seal(b"probe");
    let old = naam_proto::session::peek_sealed(&probe)
        .expect("sealed in the session")
        .session;
    let id = w.call(INCREMENT);
    w.client.connect(w.now);
    let first = w.client.poll_transmit().expect("the queued request");
    assert_eq!(first.id, id);
    let h = naam_proto::session::peek_sealed(first.bytes()).expect("sealed");
    assert_eq!(h.session, old);
    // Then the new handshake, outside any session.
    let hello = w.client.poll_transmit().expect("the hello");
    assert!(naam_proto::session::peek_sealed(hello.bytes()).is_err());
}

#[test]
fn datagrams_taken_alone_are_answered_as_through_the_turns() {
    for alone in [false, true] {
        let mut w = World::new(3);
        w.alone = alone;
        w.net.loss = 0.2;
        w.connected();
        let ids: Vec<u64> = (0..20).map(|_| w.call(INCREMENT)).collect();
        for id in ids {
            assert_eq!(w.reply(id).expect("answered").status, Status::Ok);
        }
        let r = w.roundtrip(READ).expect("answered");
        assert_eq!(counter(&r), 20, "alone: {alone}: every write applied once");
        assert!(w.server.stats().host >= 21);
        assert!(!w.server.has_waiting());
    }
}

#[test]
fn a_datagram_taken_alone_waits_behind_work_already_waiting() {
    let mut w = World::new(4);
    w.connected();
    let write = w.call(INCREMENT);
    w.flush();
    let read = w.call(READ);
    w.flush();
    w.now += 1_000 * MS;
    let due = w.net.take_due(w.now);
    assert_eq!(due.len(), 2, "one datagram per call");
    let mut due = due.into_iter();
    let (from, _, first) = due.next().expect("the write");
    let (_, _, second) = due.next().expect("the read");
    // A receive loop took the write in and has not run it yet.
    w.server.handle(w.now, from, first);
    assert!(w.server.has_waiting());
    // The read must not overtake it: it waits for its turn, after the write, and what
    // waits is left for the driver's run (a receive loop bounds its runs).
    w.server.handle_alone(w.now, from, second);
    assert!(
        w.server.has_waiting(),
        "nothing waiting was run by handle_alone"
    );
    w.server.run(usize::MAX);
    assert!(!w.server.has_waiting());
    assert_eq!(w.reply(write).map(|r| counter(&r)), Ok(1));
    assert_eq!(
        w.reply(read).map(|r| counter(&r)),
        Ok(1),
        "the read ran after the write"
    );
}

#[test]
fn under_heavy_loss_every_write_is_answered_and_applied_once() {
    for seed in [7, 8, 9, 10] {
        let mut w = World::new(seed);
        // 30% loss each way: an attempt succeeds half the time, so allow 16 of them.
        let mut config = ClientConfig::new(
            server_addr(),
            "counter",
            w.credential.clone(),
            w.entropy.clone(),
        );
        config.attempts = 16;
        w.client = ClientEndpoint::new(config, 0);
        w.connected();
        w.net.loss = 0.3;
        for n in 1..=50 {
            let r = w.roundtrip(INCREMENT).expect("answered despite loss");
            assert_eq!(counter(&r), n, "seed {seed}: write {n} applied once");
        }
        let host = w.server.backend();
        assert_eq!(host.counter, 50);
        assert!(host.applied.values().all(|&n| n == 1), "{:?}", host.applied);
        // Retransmissions reached the host, said so, and were answered from the dedup table.
        assert!(w.server.stats().host > 50, "{:?}", w.server.stats());
        // Every arrival past a write's first is a resend, and resends carry RETRY (a write whose
        // first send was lost arrives first as a resend, so there may be more).
        assert!(
            host.retried >= w.server.stats().host - 50,
            "resends carry RETRY"
        );
    }
}

/// Datagrams delivered to `to` so far.
fn delivered(w: &World, to: SocketAddr) -> u64 {
    w.net.delivered.get(&to).copied().unwrap_or(0)
}

#[test]
fn a_pipelined_sessions_requests_and_answers_share_datagrams() {
    let mut w = World::new(21);
    w.server.backend_mut().inline = true;
    w.client.set_datagram_payload(8948);
    w.server.set_datagram_payload(8948);
    w.connected();
    let (to_server, to_client) = (delivered(&w, server_addr()), delivered(&w, client_addr()));
    // Ten requests submitted together: one datagram there, one back.
    let ids: Vec<u64> = (0..10).map(|_| w.call(INCREMENT)).collect();
    w.run_until(60_000 * MS, |w| {
        ids.iter().all(|id| w.outcome(*id).is_some())
    });
    let counters: Vec<u64> = ids
        .iter()
        .map(|id| counter(&Reply::decode(w.outcome(*id).unwrap().unwrap()).unwrap()))
        .collect();
    assert_eq!(
        counters,
        (1..=10).collect::<Vec<_>>(),
        "answered in order, once each"
    );
    assert_eq!(
        delivered(&w, server_addr()) - to_server,
        1,
        "requests coalesced"
    );
    assert_eq!(
        delivered(&w, client_addr()) - to_client,
        1,
        "answers coalesced"
    );
    assert_eq!(w.server.stats().batches, 1);
    // A datagram too small for two answers sends them one by one, still answered.
    w.server.set_datagram_payload(64);
    let more: Vec<u64> = (0..3).map(|_| w.call(READ)).collect();
    w.run_until(60_000 * MS, |w| {
        more.iter().all(|id| w.outcome(*id).is_some())
    });
    assert!(more.iter().all(|id| w.outcome(*id).unwrap().is_ok()));
}

#[test]
fn a_pipelined_window_under_loss_applies_every_write_once_and_resends_early() {
    for seed in [31, 32, 33] {
        let mut w = World::new(seed);
        w.server.backend_mut().inline = true;
        // One message a datagram, so that each loss is one exchange's.
        w.client.set_datagram_payload(64);
        w.server.set_datagram_payload(64);
        w.connected();
        // Round trips measured first: the timeout is then the estimate, not the initial 20 ms.
        for _ in 0..20 {
            w.roundtrip(READ).expect("answered");
        }
        let rto_floor = w.client.rtt().expect("measured");
        w.net.loss = 0.2;
        let start = w.now;
        let ids: Vec<u64> = (0..60).map(|_| w.call(INCREMENT)).collect();
        w.run_until(60_000 * MS, |w| {
            ids.iter().all(|id| w.outcome(*id).is_some())
        });
        assert!(
            ids.iter().all(|id| w.outcome(*id).unwrap().is_ok()),
            "seed {seed}"
        );
        let host = w.server.backend();
        assert_eq!(host.counter, 60, "seed {seed}");
        assert!(
            host.applied.values().all(|&n| n == 1),
            "seed {seed}: once each"
        );
        assert!(
            w.client.stats().resends > 0,
            "seed {seed}: losses were repaired"
        );
        // Repaired within a few estimated round trips, not the initial 20 ms timeout.
        assert!(
            w.now - start < 20 * MS,
            "seed {seed}: {} ns (srtt {rto_floor} ns)",
            w.now - start
        );
    }
}

#[test]
fn handshakes_survive_a_fifth_of_datagrams_lost_each_way() {
    // Forty seeded worlds, each losing a fifth of every datagram both ways, all connect
    // within the connect timeout's budget.
    for seed in 0..40 {
        let mut w = World::new(100 + seed);
        w.net.loss = 0.2;
        w.client.connect(w.now);
        let connected = w.run_until(10_000 * MS, |w| {
            w.events
                .iter()
                .any(|e| matches!(e, ClientEvent::Connected(_)))
        });
        assert!(connected, "seed {seed}: {:?}", w.events);
    }
}

#[test]
fn a_handler_answered_out_of_order_is_resent_early_once_then_left_to_its_timeout() {
    let mut w = World::new(31);
    // The network's delay never varies here, so the probe timeout would be about one round
    // trip, and the write's timer, not the later answers, would find it late: a floor of five
    // round trips leaves the finding to the answers (this test's subject).
    let mut config = ClientConfig::new(
        server_addr(),
        "counter",
        w.credential.clone(),
        w.entropy.clone(),
    );
    config.min_rto = 500_000;
    w.client = ClientEndpoint::new(config, 0);
    w.connected();
    w.server.backend_mut().inline = true;
    for _ in 0..8 {
        w.roundtrip(READ).expect("answered");
    }
    let srtt = w.client.rtt().expect("a round trip measured");
    assert_eq!(
        srtt, 100_000,
        "the network's delay changed: review the timeout floor"
    );
    // A write waits for its owner while later reads are answered: its first early resend is
    // spurious (both sends are answered), and teaches the endpoint.
    let round = |w: &mut World| {
        w.server.backend_mut().hold_writes = true;
        let write = w.call(INCREMENT);
        w.run_until(2 * srtt, |_| false);
        let reads: Vec<u64> = (0..4).map(|_| w.call(READ)).collect();
        w.run_until(60_000 * MS, |w| {
            reads.iter().all(|r| w.outcome(*r).is_some())
        });
        let early = w.client.stats().early_resends;
        let host = w.server.backend_mut();
        host.hold_writes = false;
        let held = std::mem::take(&mut host.held);
        for t in held {
            w.net.send(w.now, server_addr(), t);
        }
        let answer = w.reply(write).expect("the write is answered");
        assert_eq!(answer.status, Status::Ok);
        w.run_until(10 * MS, |_| false);
        early
    };
    assert_eq!(round(&mut w), 1, "the overtaken write was resent early");
    assert_eq!(w.client.stats().spurious_resends, 1);
    assert_eq!(
        round(&mut w),
        1,
        "learnt: no early resend of the write again"
    );
    assert_eq!(w.server.backend().applied.values().max(), Some(&1));
}

/// An exchange lost several times running has backed off; an answer to another exchange on
/// the same path shows the path alive, and the lost one is resent one timeout after its last
/// send instead of at the end of its backoff (RFC 9002's reset on an acknowledgement).
#[test]
fn an_answer_on_the_path_ends_another_exchange_s_backoff() {
    const RTO: Nanos = 200_000;
    let mut w = World::new(37);
    // A floor above the network's fixed 100 us round trip: every timeout here is RTO.
    let mut config = ClientConfig::new(
        server_addr(),
        "counter",
        w.credential.clone(),
        w.entropy.clone(),
    );
    config.min_rto = RTO;
    w.client = ClientEndpoint::new(config, 0);
    w.connected();
    for _ in 0..8 {
        w.roundtrip(READ).expect("answered");
    }
    let start = w.now;
    // Everything is lost: the first send times out at 1 RTO, the two flat resends at 2 and
    // 3, the next (waiting 2 RTO) at 5; the one after would wait 4 RTO, until 9.
    w.net.loss = 1.0;
    let lost = w.call(READ);
    w.run_until(RTO * 11 / 2, |_| false);
    assert_eq!(w.client.stats().resends, 4);
    w.net.loss = 0.0;
    let other = w.call(READ);
    assert!(w.run_until(10 * RTO, |w| w.outcome(other).is_some()));
    assert!(w.run_until(10 * RTO, |w| w.outcome(lost).is_some()));
    // The other's answer came at 6.5 RTO: the lost one, last sent at 5, was due at 6 and is
    // resent at once, answered a round trip later.
    let answered = w.now - start;
    assert!(
        answered < 8 * RTO,
        "answered {answered} ns after its first send, past its backoff's end"
    );
    assert!(matches!(w.outcome(lost), Some(Ok(_))));
}

#[test]
fn a_session_flooding_past_busy_is_muted_and_others_are_heard() {
    let mut w = World::new(41);
    w.connected();
    // Sealed requests straight to the server, none run in between: past the session's
    // credit they are refused, and far past it the session goes unheard for a while.
    let req = Request::for_call(APP, READ, 0, b"", &[]).expect("small");
    for i in 0..(limits::SESSION_CREDIT as u64 + limits::FLOOD_MIN_REFUSALS as u64 + 50) {
        let mut r = req.clone();
        r.request_id = 1_000 + i;
        let sealed = w.client.seal(&r.to_bytes().expect("encodes"));
        w.server.handle(w.now, client_addr(), sealed);
    }
    let s = w.server.stats();
    assert_eq!(s.over_credit, limits::FLOOD_MIN_REFUSALS as u64 + 1);
    assert!(s.flood_drops > 0, "{s:?}");
    // The admitted ones run; after the mute the session is heard again.
    w.server.run(usize::MAX);
    w.now += limits::FLOOD_MUTE + MS;
    w.server.handle_timeout(w.now);
    while w.server.poll_transmit().is_some() {}
    assert_eq!(counter(&w.roundtrip(READ).expect("heard again")), 0);
}

#[test]
fn strangers_are_rate_limited_before_any_work() {
    let mut w = World::new(43);
    let stranger = addr("10.9.9.9:1");
    let hello = Control::Hello {
        tenant: "counter".into(),
        nonce: [7; 32],
    }
    .to_bytes(1);
    for _ in 0..1_000 {
        w.server.handle(w.now, stranger, hello.clone());
    }
    assert!(w.server.stats().stranger_drops >= 1_000 - limits::STRANGER_BURST_PER_IP as u64);
    // Another address still gets its session.
    w.connected();
    assert_eq!(counter(&w.roundtrip(READ).expect("answered")), 0);
}

#[test]
fn duplicated_and_reordered_answers_end_each_exchange_once() {
    let mut w = World::new(11);
    w.net.duplicate = 0.5;
    w.net.jitter = 400_000;
    w.connected();
    let ids: Vec<u64> = (0..40).map(|_| w.call(INCREMENT)).collect();
    w.run_until(60_000 * MS, |w| {
        ids.iter().all(|id| w.outcome(*id).is_some())
    });
    let mut seen: Vec<u64> = Vec::new();
    for id in &ids {
        assert_eq!(w.outcomes(*id), 1, "exchange {id} ended once");
        let r = Reply::decode(w.outcome(*id).expect("ended").expect("answered")).expect("reply");
        seen.push(counter(&r));
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        (1..=40).collect::<Vec<u64>>(),
        "each write applied once"
    );
    assert_eq!(w.client.outstanding(), 0);
}

#[test]
fn a_silent_server_times_out_then_is_declared_gone() {
    let mut w = World::new(3);
    w.connected();
    w.net.loss = 1.0;
    let id = w.call(READ);
    match w.reply(id) {
        Err(ExchangeError::TimedOut { waited_ns }) => assert!(waited_ns >= 20 * MS),
        other => panic!("{other:?}"),
    }
    w.run_until(20_000 * MS, |_| false);
    let mut req = Request::for_call(APP, READ, 0, b"", &[]).expect("small");
    assert!(matches!(
        w.client.request(w.now, &mut req),
        Err(ExchangeError::ServerGone { .. })
    ));
}

#[test]
fn a_client_idle_past_the_liveness_bound_is_answered_when_it_asks_again() {
    let mut w = World::new(4);
    w.connected();
    assert_eq!(counter(&w.roundtrip(INCREMENT).expect("answered")), 1);
    // Nothing asked for twice the bound (a gateway with no clients overnight).
    let idle_until = 20_000 * MS;
    w.run_until(idle_until, |_| false);
    assert_eq!(
        counter(&w.roundtrip(INCREMENT).expect("answered after idling")),
        2
    );
}

#[test]
fn after_a_server_restart_the_client_sets_up_a_new_session_by_itself() {
    let mut w = World::new(5);
    w.connected();
    assert_eq!(counter(&w.roundtrip(INCREMENT).expect("answered")), 1);
    // The server restarts: a new epoch, no sessions, a fresh host.
    w.server = server(&w.credential, &w.pairing, 2);
    w.events.clear();
    let r = w.roundtrip(INCREMENT).expect("answered after renewal");
    assert_eq!((r.status, counter(&r)), (Status::Ok, 1));
    assert!(
        w.events
            .iter()
            .any(|e| matches!(e, ClientEvent::Connected(w)
                if matches!(**w, Control::Welcome { epoch: 2, .. }))),
        "{:?}",
        w.events
    );
    assert_eq!(w.server.stats().sessions, 1);
}

#[test]
fn a_stale_notice_forged_without_the_credential_is_ignored() {
    let mut w = World::new(9);
    w.connected();
    let forged = Control::Stale {
        session: 1,
        epoch: 9,
        token: [0; naam_proto::session::RESET_TOKEN_LEN],
    };
    w.client.handle(w.now, server_addr(), forged.to_bytes(0));
    assert!(w.client.is_connected());
    assert_eq!(counter(&w.roundtrip(INCREMENT).expect("answered")), 1);
}

#[test]
fn congestion_shifts_reads_to_the_nic_and_its_crash_and_restart_are_survived() {
    let mut w = World::new(13);
    w.connected();
    w.start_nic();
    // The host is congested: the weights say NIC and the switch forwards reads there.
    w.server.backend_mut().congested = true;
    let q = w
        .client
        .query(
            w.now,
            &Control::QueryWeights {
                app: APP,
                client: None,
                rtt_ns: None,
            },
        )
        .expect("sent");
    w.run_until(1_000 * MS, |w| w.outcome(q).is_some());
    let answer = w.outcome(q).expect("answered").expect("weights");
    match Control::decode(&answer).expect("control").1 {
        Control::Weights {
            handlers, agent, ..
        } => {
            assert_eq!(agent, Some(nic_addr()));
            let read = handlers.iter().find(|h| h.handler == READ).expect("read");
            assert_eq!(read.weights, Weights::all(Placement::Nic).0);
        }
        other => panic!("{other:?}"),
    }
    // A read: client → server → forwarded in the pairing session → NIC → client.
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
    assert_eq!(&r.payload[..], b"nic");
    assert_eq!(w.server.stats().forwarded, 1);
    // Writes stay on the host.
    assert_eq!(counter(&w.roundtrip(INCREMENT).expect("answered")), 1);

    // The NIC crashes (its reports stop): reads are refused quickly rather than lost.
    w.nic = None;
    w.server.backend_mut().nic_up = false;
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!(
        (r.status, r.placement),
        (Status::Unavailable, Placement::Nic)
    );

    // A restarted NIC pairs anew, learns the client's session, and serves reads again.
    w.start_nic();
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));

    // Congestion clears: reads are the host's again.
    w.server.backend_mut().congested = false;
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!((r.status, r.placement), (Status::Ok, Placement::Host));
}

#[test]
fn an_idle_nic_reports_rarely_and_a_working_one_every_period() {
    let mut w = World::new(29);
    w.connected();
    w.start_nic();
    let reports = |w: &World| {
        w.net
            .delivered_between
            .get(&(nic_addr(), server_addr()))
            .copied()
            .unwrap_or(0)
    };
    // Idle for a virtual second: a heartbeat every NIC_IDLE_REPORT (20 ms), well within the
    // server's NIC_SILENCE, not a report every period (5 ms here: 200 of them, against 50).
    let heartbeats = 1_000 * MS / naam_proto::limits::NIC_IDLE_REPORT;
    let before = reports(&w);
    w.run_until(1_000 * MS, |_| false);
    let idle = reports(&w) - before;
    assert!(
        (heartbeats - 1..=heartbeats + 1).contains(&idle),
        "{idle} reports in an idle second"
    );
    // Work: the read it runs is reported within a period, not at the next heartbeat.
    w.server.backend_mut().congested = true;
    let mut on_nic = false;
    for _ in 0..20 {
        on_nic |= w.roundtrip(READ).expect("answered").placement == Placement::Nic;
    }
    assert!(on_nic, "the congested host sent no read to the NIC");
    let before = reports(&w);
    let period = NicConfig::new(
        server_addr(),
        nic_addr(),
        w.pairing.clone(),
        w.entropy.clone(),
    )
    .report_every;
    w.run_until(2 * period, |_| false);
    assert!(reports(&w) > before, "the NIC's work went unreported");
}

#[test]
fn after_a_server_restart_the_nic_pairs_again_and_maps_the_new_regions() {
    let mut w = World::new(21);
    w.connected();
    w.start_nic();
    w.server = server(&w.credential, &w.pairing, 2);
    w.server.backend_mut().congested = true;
    // The NIC's next report meets a server that does not know it: it pairs again.
    let remapped = |w: &World| {
        w.nic_events.contains(&NicEvent::Remapped { epoch: 2 }) && w.server.backend().nic_up
    };
    assert!(w.run_until(2_000 * MS, remapped), "{:?}", w.nic_events);
    assert!(w.nic_events.contains(&NicEvent::Unpaired));
    // The client renews its session on its next call; the NIC learns it and serves reads.
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
    assert_eq!(w.nic.as_ref().map(|n| n.stats().pairings), Some(2));
}

#[test]
fn the_nic_refuses_forged_and_out_of_session_messages_and_keeps_serving() {
    let mut w = World::new(23);
    w.connected();
    w.start_nic();
    let stranger = addr("10.0.0.9:4000");
    let nic = w.nic.as_mut().expect("started");
    let bare = Request::for_call(APP, READ, 5, b"", &[]).expect("small");
    nic.handle(w.now, stranger, bare.to_bytes().expect("encodes"));
    // Sealed in the client's session but sent from another address.
    let sealed = w.client.seal(&bare.to_bytes().expect("encodes"));
    nic.handle(w.now, stranger, sealed);
    nic.handle(w.now, stranger, Bytes::from_static(b"\x01\xee"));
    let stats = nic.stats();
    assert_eq!(
        (stats.unauthenticated, stats.malformed),
        (2, 1),
        "{stats:?}"
    );
    assert_eq!(stats.executed, 0);
    w.server.backend_mut().congested = true;
    let r = w.roundtrip(READ).expect("answered");
    assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
}

#[test]
fn a_request_outside_a_session_is_refused_and_the_server_keeps_serving() {
    let mut w = World::new(17);
    w.connected();
    let bare = Request::for_call(APP, READ, 99, b"", &[]).expect("small");
    w.server.handle(
        w.now,
        addr("10.0.0.9:4000"),
        bare.to_bytes().expect("encodes"),
    );
    w.server.handle(
        w.now,
        addr("10.0.0.9:4000"),
        Bytes::from_static(b"\x01\xffjunk"),
    );
    assert_eq!(w.server.stats().unauthenticated, 1);
    assert_eq!(w.server.stats().malformed, 1);
    assert_eq!(counter(&w.roundtrip(INCREMENT).expect("answered")), 1);
}

mod hostile {
    //! Arbitrary datagrams from anywhere, to every endpoint: nothing panics, nothing is
    //! executed, and the session that was set up keeps working with its writes applied once.
    use super::*;
    use proptest::prelude::*;

    /// Bytes that look like NAAM messages often enough to get past the first checks: a version
    /// byte, a known kind byte, then anything; or anything at all.
    fn datagram() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            (1u8..=7, proptest::collection::vec(any::<u8>(), 0..200)).prop_map(|(k, rest)| {
                let mut m = vec![naam_proto::kind::VERSION, k];
                m.extend(rest);
                m
            }),
            proptest::collection::vec(any::<u8>(), 0..64),
        ]
    }

    fn from() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            Just(client_addr()),
            Just(server_addr()),
            Just(nic_addr()),
            Just(addr("10.0.0.9:4000")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn hostile_datagrams_change_nothing(
            hits in proptest::collection::vec((0u8..3, from(), datagram()), 1..40),
        ) {
            let mut w = World::new(29);
            w.connected();
            w.start_nic();
            for (to, from, bytes) in hits {
                let bytes = Bytes::from(bytes);
                match to {
                    0 => {
                        w.server.handle(w.now, from, bytes);
                        w.server.run(usize::MAX);
                    }
                    1 => w.client.handle(w.now, from, bytes),
                    _ => {
                        if let Some(nic) = w.nic.as_mut() {
                            nic.handle(w.now, from, bytes);
                        }
                    }
                }
            }
            prop_assert_eq!(w.server.backend().counter, 0);
            prop_assert_eq!(w.nic.as_ref().map(|n| n.stats().executed), Some(0));
            let r = w.roundtrip(INCREMENT).expect("the session still works");
            prop_assert_eq!((r.status, counter(&r)), (Status::Ok, 1));
            w.server.backend_mut().congested = true;
            let r = w.roundtrip(READ).expect("the NIC still serves");
            prop_assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
        }
    }
}

/// Reads a pipelined session sends together are forwarded together: the server coalesces
/// the forwards into one datagram in the NIC's session, and the NIC takes each of them.
#[test]
fn forwards_that_share_a_datagram_all_reach_the_nic() {
    let mut w = World::new(41);
    w.connected();
    w.start_nic();
    w.server.backend_mut().congested = true;
    let before = w.server.stats().batches;
    let ids: Vec<u64> = (0..6).map(|_| w.call(READ)).collect();
    for id in ids {
        let r = w.reply(id).expect("answered");
        assert_eq!((r.status, r.placement), (Status::Ok, Placement::Nic));
    }
    assert_eq!(w.server.stats().forwarded, 6);
    assert!(
        w.server.stats().batches > before,
        "the forwards were coalesced"
    );
    assert_eq!(w.nic.as_ref().map(|n| n.stats().malformed), Some(0));
}

#[test]
fn a_request_handed_in_process_is_answered_as_one_in_a_datagram() {
    // The host runs what arrives where it arrives (naam-server's run to completion): the
    // answer comes back from the call, and a write is applied once whichever way it came.
    let mut w = World::new(41);
    w.server.backend_mut().inline = true;
    w.connected();
    let by_datagram = w.roundtrip(INCREMENT).expect("answered");
    assert_eq!(by_datagram.payload[..], 1u64.to_le_bytes());
    let (verdict, id, r) = w.call_in_process(APP, INCREMENT);
    assert!(matches!(verdict, Some(InProcess::Answered)), "{verdict:?}");
    assert_eq!((r.status, r.request_id), (Status::Ok, id));
    assert_eq!(r.payload[..], 2u64.to_le_bytes());
    let applied = &w.server.backend().applied;
    assert!(applied.values().all(|&n| n == 1), "{applied:?}");
    assert_eq!(applied.len(), 2);
    // Nothing went over the network for it, and the client keeps no exchange.
    assert_eq!(w.client.outstanding(), 0);
}

#[test]
fn a_request_handed_in_process_may_use_only_its_session_s_apps() {
    let mut w = World::new(42);
    w.server.backend_mut().inline = true;
    w.connected();
    let (verdict, id, r) = w.call_in_process(APP + 1, READ);
    assert!(matches!(verdict, Some(InProcess::Answered)), "{verdict:?}");
    assert_eq!((r.status, r.request_id), (Status::UnknownApp, id));
    assert!(w.server.backend().applied.is_empty());
}

#[test]
fn a_session_the_server_does_not_hold_gets_its_request_back() {
    let mut w = World::new(43);
    w.server.backend_mut().inline = true;
    w.connected();
    let mut req = Request::for_call(APP, INCREMENT, 0, b"", &[]).expect("small request");
    let mut out = Reply::unanswered();
    let verdict = w
        .server
        .request_in_process(w.now, 0xdead_beef, &mut req, &mut out);
    assert!(verdict.is_none(), "{verdict:?}");
    assert_eq!(
        (req.app, req.handler),
        (APP, INCREMENT),
        "left with the caller"
    );
    assert!(w.server.backend().applied.is_empty());
}

#[test]
fn an_answer_that_comes_later_reaches_the_exchange_the_client_expects() {
    // The host answers on the session's channel, from its "executors": the server takes the
    // request and answers it later, as a datagram the client's expected exchange takes.
    let mut w = World::new(44);
    w.connected();
    let (verdict, id, _) = w.call_in_process(APP, INCREMENT);
    assert!(matches!(verdict, Some(InProcess::Pending)), "{verdict:?}");
    w.client.expect_in_process(w.now, id);
    let r = w.reply(id).expect("answered");
    assert_eq!((r.status, r.request_id), (Status::Ok, id));
    assert_eq!(w.outcomes(id), 1);
    assert_eq!(w.server.backend().applied.len(), 1);
}

#[test]
fn an_expected_answer_that_never_comes_times_out_without_a_resend() {
    // Held writes are never released: the exchange has nothing to send again, and fails
    // once its attempts are spent, as a lost datagram's would.
    let mut w = World::new(45);
    w.connected();
    w.server.backend_mut().hold_writes = true;
    let (verdict, id, _) = w.call_in_process(APP, INCREMENT);
    assert!(matches!(verdict, Some(InProcess::Pending)), "{verdict:?}");
    w.client.expect_in_process(w.now, id);
    assert!(matches!(w.reply(id), Err(ExchangeError::TimedOut { .. })));
    assert_eq!(w.client.stats().resends, 0);
    assert_eq!(w.server.backend().retried, 0);
}

impl World {
    /// Control message `m` sent in the client's session, and its answer.
    fn ask(&mut self, m: &Control) -> Control {
        let q = self.client.query(self.now, m).expect("sent");
        self.run_until(1_000 * MS, |w| w.outcome(q).is_some());
        let answer = self.outcome(q).expect("answered").expect("an answer");
        Control::decode(&answer).expect("control").1
    }
}

/// The refusal message of `c`, which must be one.
fn refusal(c: Control) -> String {
    match c {
        Control::Error { message } => message,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn an_upload_is_taken_in_order_and_a_deploy_needs_its_whole_object_in_its_own_app() {
    let mut w = World::new(41);
    w.connected();
    let object: Vec<u8> = (0..(limits::DEPLOY_CHUNK * 2 + 100))
        .map(|i| i as u8)
        .collect();
    let total = object.len() as u32;
    let hash = naam_proto::control::object_hash(&object);
    let chunk = |offset: usize, len: usize| Control::DeployChunk {
        app: APP,
        total,
        object_hash: hash,
        offset: offset as u32,
        bytes: object[offset..offset + len].to_vec(),
    };
    let c = limits::DEPLOY_CHUNK;
    let deploy = |hash: u64| Control::Deploy {
        app: APP,
        object_hash: hash,
        handlers: vec![naam_proto::control::DeployHandler {
            name: "get".into(),
            write: false,
        }],
        engine: None,
        budget: None,
    };
    // Nothing uploaded yet.
    assert!(refusal(w.ask(&deploy(hash))).contains("no object uploaded"));
    // Into an app that is not the session's.
    let other = Control::DeployChunk {
        app: 99,
        total,
        object_hash: hash,
        offset: 0,
        bytes: vec![1],
    };
    assert!(refusal(w.ask(&other)).contains("not this tenant's"));
    assert!(refusal(w.ask(&Control::Undeploy { app: 99 })).contains("not this tenant's"));
    // Too big, or past the end.
    let huge = Control::DeployChunk {
        app: APP,
        total: limits::MAX_DEPLOY_OBJECT as u32 + 1,
        object_hash: 0,
        offset: 0,
        bytes: vec![0],
    };
    assert!(refusal(w.ask(&huge)).contains("a deploy uploads 1 to"));
    let past = Control::DeployChunk {
        app: APP,
        total: 4,
        object_hash: 0,
        offset: 2,
        bytes: vec![0; 3],
    };
    assert!(refusal(w.ask(&past)).contains("run past"));
    // In order; a chunk again is answered again; a gap is refused.
    let received = |c: Control| match c {
        Control::DeployReceived { received, .. } => received as usize,
        other => panic!("{other:?}"),
    };
    assert_eq!(received(w.ask(&chunk(0, c))), c);
    assert_eq!(received(w.ask(&chunk(0, c))), c, "the first chunk again");
    assert!(refusal(w.ask(&chunk(2 * c, 100))).contains(&format!("holds {c} bytes")));
    assert_eq!(received(w.ask(&chunk(c, c))), 2 * c);
    // Not whole yet.
    assert!(refusal(w.ask(&deploy(hash))).contains("not whole"));
    assert_eq!(received(w.ask(&chunk(2 * c, 100))), object.len());
    assert_eq!(received(w.ask(&chunk(c, c))), object.len(), "a chunk again");
    // Another object's hash.
    assert!(refusal(w.ask(&deploy(hash ^ 1))).contains("hash"));
    // The right one reaches the backend, with the bytes uploaded.
    match w.ask(&deploy(hash)) {
        Control::Deployed { app, version, .. } => assert_eq!((app, version), (APP, 1)),
        other => panic!("{other:?}"),
    }
    let jobs = &w.server.backend().deploys;
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].tenant_apps, vec![APP]);
    match &jobs[0].change {
        DeployChange::Install {
            object: o,
            handlers,
            ..
        } => {
            assert_eq!(&o[..], &object[..]);
            assert_eq!(handlers[0].name, "get");
        }
        other => panic!("{other:?}"),
    }
    // More handlers than one deploy may install.
    let many = Control::Deploy {
        app: APP,
        object_hash: hash,
        handlers: (0..=limits::MAX_DEPLOY_HANDLERS)
            .map(|i| naam_proto::control::DeployHandler {
                name: format!("h{i}"),
                write: false,
            })
            .collect(),
        engine: None,
        budget: None,
    };
    assert!(refusal(w.ask(&many)).contains("handlers in one deploy"));
    let long = Control::Deploy {
        app: APP,
        object_hash: hash,
        handlers: vec![naam_proto::control::DeployHandler {
            name: "x".repeat(limits::MAX_HANDLER_NAME + 1),
            write: false,
        }],
        engine: None,
        budget: None,
    };
    assert!(refusal(w.ask(&long)).contains("names are 1 to 64 bytes"));
    // A new upload (offset 0, other bytes) replaces the old one.
    let fresh = Control::DeployChunk {
        app: APP,
        total: 2,
        object_hash: naam_proto::control::object_hash(&[9, 9]),
        offset: 0,
        bytes: vec![9, 9],
    };
    assert_eq!(received(w.ask(&fresh)), 2);
    assert!(refusal(w.ask(&deploy(hash))).contains("hash"));
    // Another object of the same length and first bytes is a new upload, not a repeat.
    let twin = Control::DeployChunk {
        app: APP,
        total: 2,
        object_hash: 1,
        offset: 0,
        bytes: vec![9],
    };
    assert_eq!(received(w.ask(&twin)), 1);
    assert_eq!(received(w.ask(&fresh)), 2, "and back to the first");

    // Deploys and undeploys take the tenant's tokens (10 a second, as many in a burst; the
    // eight above took eight, refused or not): past them, a refusal says when to retry.
    let small = naam_proto::control::object_hash(&[9, 9]);
    for _ in 0..2 {
        assert!(matches!(w.ask(&deploy(small)), Control::Deployed { .. }));
    }
    let over = refusal(w.ask(&Control::Undeploy { app: APP }));
    assert!(over.contains("at most 10 times a second"), "{over}");
    assert!(over.contains("retry in"), "{over}");
    // An upload that ignores the wait is dropped unread until the wait is over (the
    // refusal's ~100 ms); its retransmission after that is taken, and small messages are
    // answered all along.
    let refused_at = w.now;
    assert_eq!(w.server.stats().deploy_flood_drops, 0);
    assert_eq!(received(w.ask(&chunk(0, c))), c);
    assert!(w.server.stats().deploy_flood_drops >= 1);
    assert!(
        w.now - refused_at >= 90 * MS,
        "answered before the wait was over"
    );
    // A second later the bucket has refilled (the small object uploaded again: the chunk
    // above began another upload).
    w.now += 1_000 * MS;
    assert_eq!(received(w.ask(&fresh)), 2);
    assert!(matches!(w.ask(&deploy(small)), Control::Deployed { .. }));
}

#[test]
fn a_created_app_is_checked_for_form_then_granted_to_its_owners_sessions() {
    use naam_proto::control::NewRegion;
    use naam_proto::endpoint::AppGrant;
    let mut w = World::new(47);
    w.connected();
    let region = |name: &str, len: u64| NewRegion {
        name: name.into(),
        len,
        access: naam_ebpf::abi::ACCESS_READ,
    };
    let create = |name: &str, regions: Vec<NewRegion>| Control::CreateApp {
        name: name.into(),
        regions,
    };
    // Refused by the endpoint for their form, or a name another credential's hello gives:
    // the backend never sees them (it refuses the names of the apps it has).
    for (bad, why) in [
        (create("../x", vec![region("d", 8)]), "names are 1 to"),
        (create("ok", vec![region("d/e", 8)]), "names are 1 to"),
        (create("ok", Vec::new()), "0 regions"),
        (create("ok", vec![region("d", 0)]), "0 bytes"),
        (
            create("ok", vec![region("d", 8), region("d", 8)]),
            "two regions",
        ),
        (create("naam-nic", vec![region("d", 8)]), "taken"),
    ] {
        let m = refusal(w.ask(&bad));
        assert!(m.contains(why), "{bad:?}: {m}");
    }
    assert!(w.server.backend().deploys.is_empty());
    // A well-formed one reaches the backend, for the session's tenant, with no app id yet.
    assert!(matches!(
        w.ask(&create("mine", vec![region("d", 8)])),
        Control::Deployed { .. }
    ));
    let jobs = &w.server.backend().deploys;
    assert_eq!(
        (jobs.len(), jobs[0].app, jobs[0].tenant.as_str()),
        (1, 0, "counter")
    );
    match &jobs[0].change {
        DeployChange::Create { name, regions } => {
            assert_eq!((name.as_str(), regions.len()), ("mine", 1))
        }
        other => panic!("{other:?}"),
    }
    // The backend made app 7 and granted it: the session may use it from its next message,
    // and its manifest page shows it.
    let mut m = manifest(47);
    m.apps.push(AppManifest {
        id: 7,
        name: "mine".into(),
        ..manifest(47).apps[0].clone()
    });
    m.version = 2;
    w.server.directory().publish_manifest(m);
    let chunk = |app: u32| Control::DeployChunk {
        app,
        total: 1,
        object_hash: 0,
        offset: 0,
        bytes: vec![1],
    };
    assert!(refusal(w.ask(&chunk(7))).contains("not this tenant's"));
    w.server.directory().grant(AppGrant {
        owner: "counter".into(),
        app: 7,
        name: "mine".into(),
    });
    assert!(matches!(
        w.ask(&chunk(7)),
        Control::DeployReceived { app: 7, .. }
    ));
    match w.ask(&Control::QueryManifest { page: 0 }) {
        Control::ManifestPage { apps, version, .. } => {
            let ids: Vec<u32> = apps.iter().map(|a| a.id).collect();
            assert_eq!((ids, version), (vec![APP, 7], 2));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_published_manifest_reaches_clients_with_their_weights_and_the_nic_is_told() {
    let mut w = World::new(43);
    w.connected();
    w.start_nic();
    // A deploy published manifest version 3: the next weights carry it.
    let mut m = manifest(1);
    m.version = 3;
    w.server.directory().publish_manifest(m);
    let weights = Control::QueryWeights {
        app: APP,
        client: None,
        rtt_ns: None,
    };
    match w.ask(&weights) {
        Control::Weights { manifest, .. } => assert_eq!(manifest, 3),
        other => panic!("{other:?}"),
    }
    // An older one published late is ignored.
    let mut old = manifest(1);
    old.version = 2;
    w.server.directory().publish_manifest(old);
    assert_eq!(w.server.directory().manifest_version(), 3);
    // The NIC's reports show it behind: the server tells it, and this model NIC, which
    // cannot take deploys up, says so (and the server forwards it nothing of the app).
    assert!(w.run_until(1_000 * MS, |w| w
        .nic_events
        .iter()
        .any(|e| matches!(e, NicEvent::RedeployFailed(_)))));
}
