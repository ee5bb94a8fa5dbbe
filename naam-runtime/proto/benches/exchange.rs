//! CPU cost of one request/reply exchange through the protocol core, with no socket and no
//! executor: a YCSB-style GET (16-byte key, one descriptor, 100-byte value) from
//! `ClientEndpoint` to `ServerEndpoint` and back, the host answering at once.
//!
//! Three figures, measured in the same run:
//! - `codec`: encode and decode the request and the reply only (what any fabric pays);
//! - `endpoints`: the whole exchange as the UDP fabric runs it minus the kernel: request id,
//!   session seal (AES-256-GCM) and replay window, the server's admission and switch, the
//!   reply's seal, the client's open and matching;
//! - `endpoints_unsealed`: the same with [`Authentication::OffForMeasurement`] (tags neither
//!   computed nor checked; loopback addresses, where the drivers allow it), so that the
//!   difference from `endpoints` is what the four seals and opens cost.
//! - `inline_unsealed/{100,1000}`: the path a request takes when it runs to completion where
//!   it is received (the in-process deployment's inline service, a receive loop's batch of
//!   one): the server takes the datagram with `handle_alone` and the host answers in the call
//!   (`Routed::Answered`), unsealed, with a 100-byte value and with YCSB's 1,000-byte record.
//!   This is the protocol core's share of `--fabric inproc-endpoints` (no driver, no network).
//!
//! What `endpoints` adds to `codec` is what routing in-process messages through the endpoints
//! adds to each one (docs/ARCHITECTURE.md, "the main job's direct path").
//!
//! And the seal alone (`seal/*`): sealing and opening one message of 80 bytes (a GET) and of
//! 1,100 bytes (a YCSB record's reply) with a session key, against an HMAC-SHA-256 tag over
//! the same bytes made and checked (the seal before issue 24), and against ring's AES-256-GCM
//! alone (`seal/ring_alone_*`: the same bytes sealed and opened in place in one kept buffer, no
//! header, no allocation, no copy): the floor under any framing of ours.
//!
//! Run: `cargo bench -p naam-proto --bench exchange`.

use std::hint::black_box;
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, Criterion};
use naam_ebpf::abi::{Descriptor, ACCESS_READ};
use naam_proto::control::{AppManifest, Manifest};
use naam_proto::endpoint::{
    Channel, ClientConfig, ClientEndpoint, ClientEvent, HostBackend, Routed, ServerConfig,
    ServerEndpoint, SwitchHandle, Transmit, VerbsAcceptor,
};
use naam_proto::entropy::Entropy;
use naam_proto::session::{tenant_entries, Authentication, CookieJar, Credential};
use naam_proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_proto::wire::{LoadFeedback, Reply, Request, Status};
use naam_proto::{Nanos, Placement};

const APP: u32 = 1;
const GET: u32 = 2;
const VALUE: [u8; 100] = [0x5a; 100];

fn client_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 5000))
}

fn server_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7000))
}

fn reply_to(req: &Request) -> Reply {
    Reply {
        app: req.app,
        request_id: req.request_id,
        status: Status::Ok,
        code: 0,
        steps: 1,
        placement: Placement::Host,
        load: LoadFeedback::default(),
        payload: Bytes::from_static(&VALUE),
    }
}

/// A host that answers every request at once: on the request's channel (as an executor
/// does), or, when `inline`, in the call (as a host that runs it to completion does).
#[derive(Default)]
struct AnsweringHost {
    outbox: Vec<Transmit>,
    next_client: u32,
    inline: bool,
    value: Bytes,
}

impl HostBackend for AnsweringHost {
    fn dispatch(
        &mut self,
        req: &mut Request,
        _sel: &mut Selector,
        _forced: Option<Placement>,
        reply_to_channel: &Channel,
        out: &mut Reply,
    ) -> Routed {
        let mut reply = reply_to(req);
        reply.payload = self.value.clone();
        if self.inline {
            *out = reply;
            return Routed::Answered;
        }
        self.outbox.push(reply_to_channel.reply(&reply));
        Routed::Queued(Placement::Host)
    }
    fn next_client_id(&mut self) -> u32 {
        self.next_client += 1;
        self.next_client
    }
    fn nic_up(&self) -> bool {
        false
    }
    fn nic_load(&mut self, _load: &RemoteLoad) {}
    fn nic_gone(&mut self) {}
    fn handlers(&self, app: u32) -> Option<Vec<u32>> {
        (app == APP).then(|| vec![GET])
    }
    fn has_handler(&self, app: u32, handler: u32) -> bool {
        app == APP && handler == GET
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

struct Pair {
    now: Nanos,
    client: ClientEndpoint,
    server: ServerEndpoint<AnsweringHost>,
    inline: bool,
}

impl Pair {
    fn connected(authentication: Authentication) -> Pair {
        Pair::connected_with(authentication, false, Bytes::from_static(&VALUE))
    }

    /// A pair whose host answers `inline` (see [`AnsweringHost`]) with `value`.
    fn connected_with(authentication: Authentication, inline: bool, value: Bytes) -> Pair {
        let credential = Credential::generate(&Entropy::seeded(1)).expect("randomness");
        let manifest = Manifest {
            apps: vec![AppManifest {
                id: APP,
                name: "kv".into(),
                kind: "object".into(),
                params: serde_json::Value::Null,
                object: String::new(),
                object_hash: 0,
                handlers: Vec::new(),
                regions: Vec::new(),
            }],
            mode: "bench".into(),
            policy: "static".into(),
            epoch: 1,
            version: 0,
        };
        let tenants = tenant_entries(&[(APP, "kv".into(), credential.clone())], None, None);
        let mut config = ServerConfig::new(manifest, tenants, Entropy::seeded(2));
        config.authentication = authentication;
        let server = ServerEndpoint::new(
            config,
            AnsweringHost {
                inline,
                value,
                ..AnsweringHost::default()
            },
            CookieJar::with_key([7; 32]),
            0,
        )
        .expect("a one-page manifest");
        let mut config = ClientConfig::new(server_addr(), "kv", credential, Entropy::seeded(3));
        config.authentication = authentication;
        let client = ClientEndpoint::new(config, 0);
        let mut pair = Pair {
            now: 0,
            client,
            server,
            inline,
        };
        pair.client.connect(0);
        for _ in 0..100 {
            if pair
                .pump()
                .iter()
                .any(|e| matches!(e, ClientEvent::Connected(_)))
            {
                return pair;
            }
        }
        panic!("no session after 100 rounds");
    }

    /// Delivers everything in flight once, both ways; returns the client's events.
    fn pump(&mut self) -> Vec<ClientEvent> {
        while let Some(t) = self.client.poll_transmit() {
            match self.inline {
                true => self
                    .server
                    .handle_alone(self.now, client_addr(), t.into_message()),
                false => self
                    .server
                    .handle(self.now, client_addr(), t.into_message()),
            }
        }
        // Admitted requests wait for their tenant's turn, as in naam-server's loop.
        self.server.run(usize::MAX);
        let mut back: Vec<Transmit> = std::mem::take(&mut self.server.backend_mut().outbox);
        while let Some(t) = self.server.poll_transmit() {
            back.push(t);
        }
        for t in back {
            self.client
                .handle(self.now, server_addr(), t.into_message());
        }
        let mut events = Vec::new();
        while let Some(e) = self.client.poll_event() {
            events.push(e);
        }
        events
    }

    /// One GET, end to end.
    fn exchange(&mut self, mut req: Request) -> Bytes {
        self.now += 1_000;
        let id = self
            .client
            .request(self.now, &mut req)
            .expect("session is up");
        for e in self.pump() {
            if let ClientEvent::Answered { id: got, message } = e {
                if got == id {
                    return message;
                }
            }
        }
        panic!("exchange {id} did not complete in one round");
    }
}

fn get_request(id: u64) -> Request {
    let desc = Descriptor {
        rkey: 0x1234_5678_9abc_def0,
        offset: 4096,
        len: 128,
        access: ACCESS_READ,
    };
    Request::for_call(APP, GET, id, &[7u8; 16], &[desc]).expect("a small request")
}

fn exchange(c: &mut Criterion) {
    let mut g = c.benchmark_group("exchange");
    g.bench_function("codec", |b| {
        let mut buf = BytesMut::with_capacity(512);
        let mut id = 0u64;
        b.iter(|| {
            id += 1;
            get_request(id).encode(&mut buf).expect("encodes");
            let req = Request::decode(buf.split().freeze()).expect("decodes");
            reply_to(&req).encode(&mut buf).expect("encodes");
            black_box(Reply::decode(buf.split().freeze()).expect("decodes"))
        })
    });
    g.bench_function("endpoints", |b| {
        let mut pair = Pair::connected(Authentication::On);
        b.iter(|| black_box(pair.exchange(get_request(0))))
    });
    g.bench_function("endpoints_unsealed", |b| {
        let mut pair = Pair::connected(Authentication::OffForMeasurement);
        b.iter(|| black_box(pair.exchange(get_request(0))))
    });
    for len in [100, 1000] {
        g.bench_function(format!("inline_unsealed/{len}"), |b| {
            let value = Bytes::from(vec![0x5a; len]);
            let mut pair = Pair::connected_with(Authentication::OffForMeasurement, true, value);
            b.iter(|| black_box(pair.exchange(get_request(0))))
        });
    }
    g.finish();
}

fn seal(c: &mut Criterion) {
    use hmac::{Hmac, Mac};
    use naam_proto::session::{Sender, SessionKey};
    let mut g = c.benchmark_group("seal");
    let key = SessionKey::new(0x1234_5678_9abc_de01, 7, [0x42; 32]);
    let mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(&[0x42; 32]).expect("any size");
    for len in [80usize, 1100] {
        let inner = vec![0x5au8; len];
        let mut packet = 0u64;
        g.bench_function(format!("aes256gcm_seal_open_{len}"), |b| {
            b.iter(|| {
                packet += 1;
                let sealed = key.seal(Sender::Client, packet, black_box(&inner));
                black_box(key.open(&sealed).expect("opens"))
            })
        });
        let raw = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &[0x42; 32]).expect("32 bytes"),
        );
        let mut buf = inner.clone();
        g.bench_function(format!("ring_alone_seal_open_{len}"), |b| {
            b.iter(|| {
                packet += 1;
                let mut n = [0u8; 12];
                n[4..].copy_from_slice(&packet.to_be_bytes());
                let tag = raw
                    .seal_in_place_separate_tag(
                        ring::aead::Nonce::assume_unique_for_key(n),
                        ring::aead::Aad::from(&[0u8; 24]),
                        black_box(&mut buf[..]),
                    )
                    .expect("seals");
                raw.open_in_place_separate_tag(
                    ring::aead::Nonce::assume_unique_for_key(n),
                    ring::aead::Aad::from(&[0u8; 24]),
                    tag,
                    black_box(&mut buf[..]),
                    0..,
                )
                .expect("opens")
                .len()
            })
        });
        g.bench_function(format!("hmac_sha256_tag_check_{len}"), |b| {
            b.iter(|| {
                let mut m = mac.clone();
                m.update(black_box(&inner));
                let tag = m.finalize().into_bytes();
                let mut m = mac.clone();
                m.update(black_box(&inner));
                black_box(m.verify_truncated_left(&tag[..16]).is_ok())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, exchange, seal);
criterion_main!(benches);
