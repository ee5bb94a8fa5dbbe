//! `naam-bench sim calibrate`: measures this machine's constants for the `this-machine`
//! profile, so that the simulator can be checked against what naam-server, naam-nic and the
//! YCSB client do here before it is trusted at another machine's scale. Each constant is
//! measured with the code the deployment runs, on the engine it runs (the JIT):
//! - the JIT's nanoseconds per eBPF instruction: MICA's YCSB-B operations run directly
//!   (`naam_runtime::Direct`), timed on the JIT, their instructions counted on the
//!   interpreter, the copy of their bytes taken out;
//! - memory copy, picoseconds per byte (1 KB copies, as a record's);
//! - the kernel's UDP on loopback: one datagram sent and received (small and record-sized),
//!   and a round trip between two threads (the wake-up included);
//! - the protocol's own cost per message: a client and a server endpoint exchanging sealed
//!   requests and 1 KB replies in one thread, each side timed;
//! - the receive loops naam-server and naam-nic start here, and the processors they share.
//!
//! The emulated NIC runs on this machine's cores: its instruction cost is the host's times
//! the emulation's slowdown, its DMA the emulation's model (`NicModel`).

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use serde::Serialize;

use naam_mica::{MicaClient, MicaConfig, MicaHandle};
use naam_runtime::cluster::NicModel;
use naam_runtime::proto::control::{AppManifest, Manifest};
use naam_runtime::proto::endpoint::{
    Channel, ClientConfig, ClientEndpoint, ClientEvent, HostBackend, Routed, ServerConfig,
    ServerEndpoint, SwitchHandle, VerbsAcceptor,
};
use naam_runtime::proto::entropy::Entropy;
use naam_runtime::proto::session::{tenant_entries, CookieJar, Credential};
use naam_runtime::proto::steering::{ClientShare, RemoteLoad, Selector, Weights};
use naam_runtime::proto::wire::{LoadFeedback, Reply, Request, Status};
use naam_runtime::proto::{EngineKind, Nanos, Placement};
use naam_runtime::Direct;

use crate::ycsb::{KeyNaming, RecordShape, Rng};

/// What was measured, in the units the profile takes.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// JIT nanoseconds per eBPF instruction (YCSB-B's mix of MICA GET and PUT).
    pub ns_per_insn: f64,
    /// Instructions of a GET and of a PUT (interpreter count).
    pub get_insns: f64,
    /// See `get_insns`.
    pub put_insns: f64,
    /// JIT nanoseconds of a direct GET and PUT.
    pub get_ns: f64,
    /// See `get_ns`.
    pub put_ns: f64,
    /// Memory copy, picoseconds per byte.
    pub ps_per_byte: f64,
    /// One datagram of 100 B sent and received on loopback, one thread, nanoseconds.
    pub udp_small_ns: f64,
    /// The same with 1,100 B.
    pub udp_record_ns: f64,
    /// A small datagram's round trip between two polling threads on loopback, nanoseconds.
    pub loopback_rtt_ns: f64,
    /// The same with both threads sleeping in their receives (two wake-ups more).
    pub sleeping_rtt_ns: f64,
    /// One poll of an idle loop: a receive that finds nothing and a `sched_yield`.
    pub poll_yield_ns: f64,
    /// One YCSB-C read at a time through the whole stack: the YCSB driver and MICA's client
    /// library over `UdpClient`, naam-server's receive loops and naam-nic's (in this process,
    /// on threads, over loopback UDP), nanoseconds per operation.
    pub stack_read_ns: f64,
    /// The server endpoint's cost per request (open, decode, dispatch, seal the reply).
    pub server_endpoint_ns: f64,
    /// The client endpoint's cost per request (seal, send; take the reply in, open it).
    pub client_endpoint_ns: f64,
    /// naam-server's receive loops here, naam-nic's, and the processors.
    pub host_loops: usize,
    /// See `host_loops`.
    pub nic_loops: usize,
    /// See `host_loops`.
    pub cpus: usize,
}

fn timed(n: u64, mut f: impl FnMut(u64)) -> f64 {
    let start = Instant::now();
    for i in 0..n {
        f(i);
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// The median time of one call of `f`, nanoseconds, over `n` calls: for round trips whose
/// typical cost the profile wants, which a mean would let the machine's rare stalls (a
/// virtual machine's, of a millisecond) inflate.
fn timed_median(n: u64, mut f: impl FnMut(u64)) -> f64 {
    let mut ns: Vec<u64> = (0..n)
        .map(|i| {
            let start = Instant::now();
            f(i);
            start.elapsed().as_nanos() as u64
        })
        .collect();
    ns.sort_unstable();
    ns.get(ns.len() / 2).copied().unwrap_or(0) as f64
}

/// Measures everything; `quick` takes fewer samples (tests).
pub fn measure(quick: bool) -> anyhow::Result<Calibration> {
    let scale = if quick { 1 } else { 20 };
    let ps_per_byte = copy_ps_per_byte(5_000 * scale);
    let (get_insns, put_insns, get_ns, put_ns) = mica_ops(2_000 * scale)?;
    let bytes_get = 1_030.0;
    let bytes_put = 1_030.0;
    let insn = |ns: f64, insns: f64, bytes: f64| (ns - bytes * ps_per_byte / 1_000.0) / insns;
    let ns_per_insn = (0.95 * insn(get_ns, get_insns, bytes_get)
        + 0.05 * insn(put_ns, put_insns, bytes_put))
    .max(0.01);
    let (udp_small_ns, udp_record_ns) = udp_pairs(2_000 * scale)?;
    let loopback_rtt_ns = loopback_rtt(500 * scale)?;
    let sleeping_rtt_ns = loopback_rtt_sleeping(500 * scale)?;
    let (client_endpoint_ns, server_endpoint_ns) = endpoints(1_000 * scale)?;
    let poll_yield_ns = poll_yield(5_000 * scale)?;
    let stack_read_ns = stack_read(2_000 * scale)?;
    Ok(Calibration {
        ns_per_insn,
        get_insns,
        put_insns,
        get_ns,
        put_ns,
        ps_per_byte,
        udp_small_ns,
        udp_record_ns,
        loopback_rtt_ns,
        sleeping_rtt_ns,
        poll_yield_ns,
        stack_read_ns,
        server_endpoint_ns,
        client_endpoint_ns,
        host_loops: naam_runtime::udp::default_receive_loops(),
        nic_loops: naam_runtime::udp::default_receive_loops(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
    })
}

fn copy_ps_per_byte(n: u64) -> f64 {
    let src = vec![7u8; 1_000];
    let mut dst = vec![0u8; 1_000];
    let ns = timed(n, |_| {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    });
    ns * 1_000.0 / 1_000.0
}

/// Instructions and JIT time of MICA's GET and PUT of YCSB records.
fn mica_ops(n: u64) -> anyhow::Result<(f64, f64, f64, f64)> {
    const KEYS: u64 = 5_000;
    let shape = RecordShape::default();
    let mc = MicaConfig::sized(KEYS * 2, 24, shape.len());
    let object = Arc::new(naam_mica::handlers().context("MICA's embedded handlers")?);
    let naming = KeyNaming::default();
    let mut rng = Rng::new(1);
    let value = shape.record(&mut rng);
    let client = |engine: EngineKind| -> anyhow::Result<MicaClient<Direct>> {
        let spec =
            naam_mica::app_spec(1, &mc, object.clone(), Placement::Host)?.with_engine(engine);
        let direct = Direct::new(std::slice::from_ref(&spec))?;
        let handle =
            MicaHandle::with_keys(1, mc, |r| direct.region_key(1, r)).context("MICA's regions")?;
        let mut c = MicaClient::new(direct, handle);
        for k in 0..KEYS {
            c.put(naming.name(k).as_bytes(), &value)?;
        }
        Ok(c)
    };
    let mut interp = client(EngineKind::Interp)?;
    let (mut get, mut put) = (0u64, 0u64);
    for k in 0..KEYS {
        interp.get(naming.name(k).as_bytes())?;
        get += interp.transport().last_insns();
        interp.put(naming.name(k).as_bytes(), &value)?;
        put += interp.transport().last_insns();
    }
    let mut jit = client(EngineKind::Jit)?;
    let keys: Vec<String> = (0..KEYS).map(|k| naming.name(k)).collect();
    let mut failed = None;
    let get_ns = timed(n, |i| {
        if let Err(e) = jit.get(keys[(i % KEYS) as usize].as_bytes()) {
            failed = Some(e);
        }
    });
    let put_ns = timed(n / 4 + 1, |i| {
        if let Err(e) = jit.put(keys[(i % KEYS) as usize].as_bytes(), &value) {
            failed = Some(e);
        }
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    Ok((
        get as f64 / KEYS as f64,
        put as f64 / KEYS as f64,
        get_ns,
        put_ns,
    ))
}

/// One datagram sent to itself and received, by one socket: small and record-sized.
fn udp_pairs(n: u64) -> anyhow::Result<(f64, f64)> {
    let s = UdpSocket::bind("127.0.0.1:0")?;
    let me = s.local_addr()?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut buf = vec![0u8; 2_048];
    let mut pair = |len: usize| -> anyhow::Result<f64> {
        let out = vec![1u8; len];
        let mut failed = None;
        let ns = timed(n, |_| {
            if let Err(e) = s.send_to(&out, me).and_then(|_| s.recv_from(&mut buf)) {
                failed = Some(e);
            }
        });
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(ns),
        }
    };
    Ok((pair(100)?, pair(1_100)?))
}

/// A small datagram's round trip to an echoing thread that sleeps in its receive: the
/// polling round trip plus two wake-ups (the median round trip).
fn loopback_rtt_sleeping(n: u64) -> anyhow::Result<f64> {
    let echo = UdpSocket::bind("127.0.0.1:0")?;
    let at = echo.local_addr()?;
    echo.set_read_timeout(Some(Duration::from_secs(2)))?;
    let t = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        for _ in 0..n {
            match echo.recv_from(&mut buf) {
                Ok((len, from)) => {
                    let _ = echo.send_to(&buf[..len], from);
                }
                Err(_) => return,
            }
        }
    });
    let s = UdpSocket::bind("127.0.0.1:0")?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut buf = [0u8; 256];
    let mut failed = None;
    let ns = timed_median(n, |_| {
        if let Err(e) = s
            .send_to(&[1u8; 100], at)
            .and_then(|_| s.recv_from(&mut buf))
        {
            failed = Some(e);
        }
    });
    let _ = t.join();
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(ns),
    }
}

/// YCSB-C, one client thread, one read at a time, through an in-process deployment over
/// loopback UDP (naam-server's and naam-nic's drivers on threads, as `auth-cost` runs them):
/// nanoseconds per read, the YCSB driver's own work included.
fn stack_read(ops: u64) -> anyhow::Result<f64> {
    use crate::driver::{run_udp_with, PlacementChoice, YcsbConfig};
    let records = 10_000;
    let loaded = naam_mica::handlers().context("loading MICA's embedded handlers")?;
    let built = (Arc::new(loaded), naam_mica::HANDLERS_OBJECT.to_vec());
    let tenant = Credential::generate(&naam_runtime::entropy::os())?;
    let shm = crate::deployment::shm_dir(&format!("naam-calibrate-{}", std::process::id()));
    let d = crate::auth_cost::start(
        shm,
        records,
        &built,
        &tenant,
        naam_runtime::proto::session::Authentication::On,
    )?;
    let cfg = YcsbConfig {
        app: crate::driver::App::Mica,
        workload: crate::ycsb::Workload::core('c').context("workload c")?,
        records,
        ops,
        threads: 1,
        pipeline: 1,
        placement: PlacementChoice::Auto,
        shape: RecordShape::default(),
        seed: 7,
        executors: (1, 1),
        fabric: "udp".into(),
        server: Some(d.server),
        shards: Vec::new(),
        run: Default::default(),
    };
    let r = run_udp_with(&cfg, d.client_config(), &|_, _| {});
    d.stop();
    let r = r?;
    anyhow::ensure!(
        r.throughput > 0.0,
        "the stack's read loop completed nothing"
    );
    Ok(1e9 / r.throughput)
}

/// One poll of an idle receive loop: a non-blocking receive on a socket with nothing in it,
/// then yielding the processor (what naam's pollers do while they wait).
fn poll_yield(n: u64) -> anyhow::Result<f64> {
    let s = UdpSocket::bind("127.0.0.1:0")?;
    s.set_nonblocking(true)?;
    let mut buf = [0u8; 64];
    Ok(timed(n, |_| {
        let _ = std::hint::black_box(s.recv_from(&mut buf));
        std::thread::yield_now();
    }))
}

/// A small datagram's round trip to an echoing thread, both sides polling (as naam's loops
/// do while answers come back soon: no thread sleeps, no wake-up is timed; the median).
fn loopback_rtt(n: u64) -> anyhow::Result<f64> {
    fn recv_spinning(s: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr)> {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match s.recv_from(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(e);
                    }
                    std::hint::spin_loop();
                }
                other => return other,
            }
        }
    }
    let echo = UdpSocket::bind("127.0.0.1:0")?;
    let at = echo.local_addr()?;
    echo.set_nonblocking(true)?;
    let t = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        for _ in 0..n {
            match recv_spinning(&echo, &mut buf) {
                Ok((len, from)) => {
                    let _ = echo.send_to(&buf[..len], from);
                }
                Err(_) => return,
            }
        }
    });
    let s = UdpSocket::bind("127.0.0.1:0")?;
    s.set_nonblocking(true)?;
    let mut buf = [0u8; 256];
    let mut failed = None;
    let ns = timed_median(n, |_| {
        if let Err(e) = s
            .send_to(&[1u8; 100], at)
            .and_then(|_| recv_spinning(&s, &mut buf))
        {
            failed = Some(e);
        }
    });
    let _ = t.join();
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(ns),
    }
}

/// A host that answers every request in the call with a 1 KB value, as a run-to-completion
/// loop does (no handler: the endpoint's own cost alone).
struct Answering {
    value: Bytes,
    next_client: u32,
}

const APP: u32 = 1;
const GET: u32 = 1;

impl HostBackend for Answering {
    fn dispatch(
        &mut self,
        req: &mut Request,
        _sel: &mut Selector,
        _forced: Option<Placement>,
        _reply_to: &Channel,
        out: &mut Reply,
    ) -> Routed {
        *out = Reply {
            app: req.app,
            request_id: req.request_id,
            status: Status::Ok,
            code: 0,
            steps: 1,
            placement: Placement::Host,
            load: LoadFeedback::default(),
            payload: self.value.clone(),
        };
        Routed::Answered
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

/// Per request: the client endpoint's cost and the server endpoint's, sealed, in one thread.
fn endpoints(n: u64) -> anyhow::Result<(f64, f64)> {
    let entropy = Entropy::seeded(1);
    let credential = Credential::generate(&entropy)?;
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
        mode: "calibrate".into(),
        version: 0,
        policy: "static".into(),
        epoch: 1,
    };
    let server_addr: SocketAddr = "10.0.0.1:7000".parse()?;
    let client_addr: SocketAddr = "10.0.0.2:5000".parse()?;
    let tenants = tenant_entries(&[(APP, "kv".into(), credential.clone())], None, None);
    let mut server = ServerEndpoint::new(
        ServerConfig::new(manifest, tenants, entropy.fork()?),
        Answering {
            value: Bytes::from(vec![b'v'; 1_000]),
            next_client: 0,
        },
        CookieJar::new(&entropy)?,
        0,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut client = ClientEndpoint::new(
        ClientConfig::new(server_addr, "kv", credential, entropy.fork()?),
        0,
    );
    let mut now: Nanos = 0;
    client.connect(now);
    let mut connected = false;
    for _ in 0..20 {
        now += 1_000;
        while let Some(t) = client.poll_transmit() {
            server.handle(now, client_addr, t.message());
            server.run(usize::MAX);
        }
        while let Some(t) = server.poll_transmit() {
            client.handle(now, server_addr, t.message());
        }
        while let Some(e) = client.poll_event() {
            connected |= matches!(e, ClientEvent::Connected(_));
        }
        if connected {
            break;
        }
    }
    anyhow::ensure!(connected, "the calibration's endpoints set up no session");
    let (mut client_ns, mut server_ns) = (0u128, 0u128);
    let mut req = Request::for_call(APP, GET, 0, &[0u8; 24], &[])?;
    for _ in 0..n {
        now += 1_000;
        let t0 = Instant::now();
        client
            .request(now, &mut req)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut out = Vec::new();
        while let Some(t) = client.poll_transmit() {
            out.push(t.message());
        }
        let t1 = Instant::now();
        let mut back = Vec::new();
        for m in out {
            server.handle(now, client_addr, m);
            server.run(usize::MAX);
        }
        while let Some(t) = server.poll_transmit() {
            back.push(t.message());
        }
        let t2 = Instant::now();
        for m in back {
            client.handle(now, server_addr, m);
        }
        while client.poll_event().is_some() {}
        let t3 = Instant::now();
        client_ns += (t1 - t0).as_nanos() + (t3 - t2).as_nanos();
        server_ns += (t2 - t1).as_nanos();
    }
    Ok((client_ns as f64 / n as f64, server_ns as f64 / n as f64))
}

/// The `this-machine` profile of `c`, as TOML, each constant saying how it was measured.
pub fn profile_text(c: &Calibration, when: &str) -> String {
    let nic = NicModel::default();
    // What the whole stack's read takes beyond the parts measured apart (the endpoints, two
    // record-sized datagrams, the handler): the drivers' own work (UdpClient, MICA's client
    // library, the YCSB driver, naam-server's receive loop), split evenly between the
    // client and the server (not attributed apart).
    let parts = c.server_endpoint_ns + c.client_endpoint_ns + 2.0 * c.udp_record_ns + c.get_ns;
    let drivers = ((c.stack_read_ns - parts) / 2.0).max(0.0);
    let host_message = c.server_endpoint_ns + c.udp_record_ns + drivers;
    let client_message = c.client_endpoint_ns + c.udp_record_ns + drivers;
    let propagation = ((c.loopback_rtt_ns - 2.0 * c.udp_small_ns) / 2.0).max(0.0);
    let gbps = 8.0 * 1_000.0 / c.ps_per_byte.max(1.0);
    let wakeup = ((c.sleeping_rtt_ns - c.loopback_rtt_ns) / 2.0).max(0.0);
    format!(
        r#"# This machine, measured by `naam-bench sim calibrate` ({when}). naam-server, naam-nic and
# the YCSB client share its {cpus} processors; the NIC is emulated on them (NicModel).
name = "this-machine"
description = "this machine: {cpus} processors shared by naam-server, the emulated naam-nic and the clients (calibrated {when})"

[link]
# Loopback: as fast as a copy ({ps:.1} ps/byte measured).
bandwidth_gbps = {gbps:.1}
# Half of a small datagram's round trip between two polling threads ({rtt:.0} ns), less
# the two sends and receives (2 x {small:.0} ns): the kernel's hand-over between them.
propagation_ns = {propagation:.0}
# NAAM's datagrams on loopback (udp::LOOPBACK_DATAGRAM plus the IP and UDP headers).
mtu = {mtu}
loss = 0.0

[switch]
latency_ns = 0

[host]
# naam-server's receive loops here (udp::default_receive_loops).
cores = {host_loops}
# MICA's YCSB-B operations run directly on the JIT: GET {get_ns:.0} ns for {get_insns:.0}
# instructions, PUT {put_ns:.0} ns for {put_insns:.0}, less the copy of their 1,030 bytes.
ns_per_insn = {ns_per_insn:.3}
# Not measured apart: loads, stores and helper calls are in the operations' cost above.
ns_per_memory_insn = {ns_per_insn:.3}
ns_per_helper = 0.0
# The server endpoint per request ({server:.0} ns: open, decode, dispatch, seal a 1 KB reply),
# one record-sized datagram sent and received through the kernel ({record:.0} ns), and half
# of what a YCSB-C read through the whole stack ({stack:.0} ns, one at a time) takes beyond
# those parts, the handler and the client's ({drivers:.0} ns: the drivers' own work).
per_message_ns = {host_message:.0}
ps_per_byte = {ps:.0}
# Included in the measured instruction cost.
access_ns = 0
rx_ring = 1024
# naam-server's loops poll 50 us after their last message (udp::server SERVER_SPIN); a wake-up
# is half of what sleeping adds to a round trip ({sleeping:.0} ns against {rtt:.0}).
spin_ns = 50000
wakeup_ns = {wakeup:.0}

[nic]
# naam-nic's receive loops here; the emulated NIC runs on the host's processors.
cores = {nic_loops}
# The host's instruction cost x the emulation's core slowdown ({slow}).
ns_per_insn = {nic_insn:.3}
ns_per_memory_insn = {nic_insn:.3}
ns_per_helper = 0.0
per_message_ns = {host_message:.0}
ps_per_byte = {ps:.0}
# The emulation's DMA model (NicModel::default().dma).
dma_ps_per_byte = {dma_ps}
dma_access_ns = {dma_access}
# Each emulated core's DMA is its own: no shared engine.
dma_reads_per_s = 0.0
# A client's one-sided READ is answered by naam-nic's agent (a receive loop), not by an
# RDMA engine: the agent's message cost, and no rate beyond its loops'.
rdma_read_ns = {host_message:.0}
rdma_reads_per_s = 0.0
# On loopback no XDP eSwitch is attached: naam-server's loops forward the NIC's share.
eswitch = false
# naam-server forwards to naam-nic over loopback: as the link.
host_hop_ns = {propagation:.0}
rx_ring = 1024
# naam-nic's loops sleep in their receive at once.
spin_ns = 0
wakeup_ns = {wakeup:.0}

[client]
# The client endpoint per request ({client:.0} ns), one datagram ({record:.0} ns) and the
# other half of the drivers' own work ({drivers:.0} ns).
per_message_ns = {client_message:.0}
# The client runs handlers on the host's processors: their instruction cost.
ns_per_insn = {ns_per_insn:.3}
ns_per_memory_insn = {ns_per_insn:.3}
ns_per_helper = 0.0
# A one-sided READ here is a datagram to naam-nic's agent and its answer: a message's cost.
read_post_ns = {client_message:.0}
# naam's UDP client polls 100 us for answers (udp::client CLIENT_SPIN).
spin_ns = 100000
wakeup_ns = {wakeup:.0}

[steering]
period_ns = 1000000
report_every_ns = 1000000

[machine]
shared_cpus = {cpus}
# A poller gives its processor to a thread with work after one poll: a receive that finds
# nothing and a sched_yield ({poll_yield:.0} ns measured).
yield_ns = {poll_yield:.0}
"#,
        cpus = c.cpus,
        poll_yield = c.poll_yield_ns,
        stack = c.stack_read_ns,
        drivers = drivers,
        ps = c.ps_per_byte,
        rtt = c.loopback_rtt_ns,
        sleeping = c.sleeping_rtt_ns,
        small = c.udp_small_ns,
        mtu = (naam_runtime::udp::LOOPBACK_DATAGRAM + 28).min(65_535),
        host_loops = c.host_loops,
        nic_loops = c.nic_loops,
        get_ns = c.get_ns,
        get_insns = c.get_insns,
        put_ns = c.put_ns,
        put_insns = c.put_insns,
        ns_per_insn = c.ns_per_insn,
        server = c.server_endpoint_ns,
        record = c.udp_record_ns,
        slow = nic.core_slowdown,
        nic_insn = c.ns_per_insn * nic.core_slowdown,
        dma_ps = nic.dma.ps_per_byte,
        dma_access = nic.dma.access_ns,
        client = c.client_endpoint_ns,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quick_calibration_gives_a_profile_the_simulator_takes() {
        let c = measure(true).unwrap();
        assert!(
            c.get_insns > 10.0 && c.put_insns > c.get_insns / 2.0,
            "{c:?}"
        );
        assert!(c.ns_per_insn > 0.0 && c.udp_small_ns > 0.0, "{c:?}");
        let text = profile_text(&c, "test");
        let p = super::super::Profile::parse(&text, "calibrated").unwrap();
        assert_eq!(p.name, "this-machine");
        assert_eq!(p.machine.shared_cpus, Some(c.cpus));
    }
}
