//! The NIC side of the UDP fabric: `naam-nic`'s driver loop, on the NIC's own cores. The
//! protocol (pairing, announced client sessions, their checks, one-sided operations, load
//! reports, remapping after a server restart) is [`NicEndpoint`]'s; this module gives it
//! datagrams, sends what it asks for, logs its events, and implements its [`NicBackend`] over
//! the NIC executors (which reply to clients directly) and the mapped server regions.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::memnet::{MemoryNet, ServedPort, Service};
use super::server::{wait_until_idle, InlineState, Replies};
use super::socket::{Sender, Socket, DEFAULT_DATAGRAM};
use crate::cluster::Cluster;
use crate::onesided;
use crate::{Clock, SystemClock};
use naam_proto::control::Manifest;
use naam_proto::endpoint::Channel;
use naam_proto::endpoint::{NicBackend, NicConfig, NicEndpoint, NicEvent, Routed};
use naam_proto::onesided::{Completion, Operation};
use naam_proto::session::Credential;
use naam_proto::steering::{RemoteLoad, Selector};
use naam_proto::wire::Request;
use naam_proto::Placement;
use std::sync::Arc;

use naam_proto::endpoint::{NicStats, Transmit};
use naam_proto::Nanos;

/// How the NIC driver behaves.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NicOptions {
    /// The server's address (pairing and load reports go there).
    pub server: SocketAddr,
    /// The address the NIC advertises to clients and the switch.
    pub advertise: SocketAddr,
    /// Load report period.
    pub report_every: Duration,
    /// How long SIGTERM waits for queued work.
    pub drain: Duration,
    /// The pairing secret naam-server's config names.
    pub pairing: Credential,
    /// Datagram authentication: on, except in a loopback measurement of its cost
    /// ([`naam_proto::session::Authentication`]); it must match the server's.
    pub authentication: naam_proto::session::Authentication,
    /// Where replies and counters are recorded for `--metrics`.
    pub telemetry: std::sync::Arc<super::telemetry::Telemetry>,
}
impl NicOptions {
    /// A NIC that pairs with the server at `server` using `pairing` and advertises
    /// `advertise`, with authentication on, a load report every millisecond, a 2 s drain and
    /// fresh telemetry; set the other fields to change those.
    pub fn new(server: SocketAddr, advertise: SocketAddr, pairing: Credential) -> NicOptions {
        NicOptions {
            server,
            advertise,
            report_every: Duration::from_millis(1),
            drain: Duration::from_secs(2),
            pairing,
            authentication: naam_proto::session::Authentication::On,
            telemetry: Default::default(),
        }
    }
}

/// The NIC's executors and the manifest they were built from.
pub struct NicCluster {
    /// The executors, with the server's regions mapped.
    pub cluster: Arc<Cluster>,
    /// The manifest (its epoch says which server start it belongs to).
    pub manifest: Manifest,
}

/// The NIC endpoint's executors: the current server start's, and how to map a new one's
/// (`remap`, given the new start's epoch).
struct NicHost<R> {
    current: NicCluster,
    replies: Replies,
    remap: R,
}

impl<R: FnMut(u64) -> Result<NicCluster, String>> NicBackend for NicHost<R> {
    fn dispatch(
        &mut self,
        req: Request,
        sel: &mut Selector,
        forced: Option<Placement>,
        reply_to: Channel,
    ) -> Routed {
        self.replies
            .dispatch(&self.current.cluster, req, sel, forced, reply_to)
    }

    fn one_sided(&mut self, op: &Operation) -> Completion {
        onesided::execute(self.current.cluster.regions(), op)
    }

    fn load_report(&mut self) -> RemoteLoad {
        self.current.cluster.take_load_report(Placement::Nic)
    }

    fn remap(&mut self, epoch: u64) -> Result<Manifest, String> {
        let c = (self.remap)(epoch)?;
        let manifest = c.manifest.clone();
        if manifest.epoch == epoch {
            // The old executors stop when their cluster is dropped.
            self.current = c;
        }
        Ok(manifest)
    }
}

/// Logs what the endpoint reports.
fn log(event: NicEvent, server: SocketAddr) {
    match event {
        NicEvent::Paired { epoch } => {
            tracing::info!("paired with naam-server at {server} (epoch {epoch:#x})")
        }
        NicEvent::PairingFailed(e) => tracing::warn!("pairing: {e}"),
        NicEvent::Refused(m) => tracing::warn!("the server refused pairing: {m}"),
        NicEvent::Unpaired => {
            tracing::info!("the server does not know this NIC any more: pairing again")
        }
        NicEvent::Remapped { epoch } => {
            tracing::info!("the server restarted (epoch {epoch:#x}): regions mapped anew")
        }
        NicEvent::RemapFailed(e) => {
            tracing::error!("mapping the restarted server's regions: {e}")
        }
        other => tracing::info!("{other:?}"),
    }
}

/// naam-nic's endpoint over `start`, whose executors send replies with `replies`, for a driver
/// bound at `local`.
fn nic_endpoint<R: FnMut(u64) -> Result<NicCluster, String>>(
    start: NicCluster,
    replies: Sender,
    options: &NicOptions,
    local: SocketAddr,
    now: Nanos,
    remap: R,
) -> std::io::Result<NicEndpoint<NicHost<R>>> {
    options
        .authentication
        .check_scope(local)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut config = NicConfig::new(options.server, options.advertise, options.pairing.clone());
    config.authentication = options.authentication;
    config.report_every = options.report_every.as_nanos() as u64;
    let manifest = start.manifest.clone();
    let host = NicHost {
        current: start,
        replies: Replies::new(replies, options.telemetry.clone()),
        remap,
    };
    Ok(NicEndpoint::new(config, host, &manifest, now))
}

/// Runs the NIC driver until `stop` is set; then says goodbye to the server (which stops
/// forwarding) and drains queued work. `remap` maps the regions of a restarted server's
/// manifest for epoch `epoch`.
pub fn serve_nic(
    start: NicCluster,
    mut socket: Socket,
    options: NicOptions,
    stop: &AtomicBool,
    remap: &mut dyn FnMut(u64) -> Result<NicCluster, String>,
) -> std::io::Result<NicStats> {
    let clock = SystemClock::new();
    let sender = socket.sender()?;
    let local = socket.local_addr()?;
    let mut nic = nic_endpoint(start, socket.sender()?, &options, local, clock.now(), remap)?;
    let mut drain_deadline: Option<Instant> = None;
    let mut next_publish = Instant::now();
    loop {
        if stop.load(Ordering::SeqCst) && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
            nic.start_drain();
        }
        nic.handle_timeout(clock.now());
        while let Some(t) = nic.poll_transmit() {
            let _ = sender.send(t.to, t.id, &t.bytes);
        }
        while let Some(e) = nic.poll_event() {
            log(e, options.server);
        }
        if let Some(d) = drain_deadline {
            if nic.backend().replies.idle() || Instant::now() >= d {
                return Ok(nic.stats());
            }
        }
        if Instant::now() >= next_publish {
            next_publish = Instant::now() + options.report_every;
            options.telemetry.publish_counters(nic.stats().counters());
        }
        let now = clock.now();
        let wait = nic
            .poll_timeout()
            .map_or(Duration::from_millis(1), |d| {
                Duration::from_nanos(d.saturating_sub(now))
            })
            .min(Duration::from_millis(1));
        for (peer, msg) in socket.recv(wait)? {
            nic.handle(clock.now(), peer, msg);
            while let Some(t) = nic.poll_transmit() {
                let _ = sender.send(t.to, t.id, &t.bytes);
            }
        }
    }
}

/// How an inline NIC maps a restarted server's regions (see [`serve_nic`]'s `remap`).
pub type Remap = Box<dyn FnMut(u64) -> Result<NicCluster, String> + Send>;

/// naam-nic's endpoint bound as a service of a [`MemoryNet`] ([`serve_nic_inline`]): a
/// datagram to it (a forwarded request, a one-sided operation) is handled in the sending
/// thread. Dropping it closes the port at once; [`InlineNic::stop`] says goodbye to the
/// server and drains first.
pub struct InlineNic {
    port: ServedPort,
    service: Arc<InlineNicHost>,
    drain: Duration,
}

/// The state behind an [`InlineNic`]'s port.
struct InlineNicHost {
    state: Mutex<InlineNicState>,
    clock: SystemClock,
    sender: Sender,
    server: SocketAddr,
    telemetry: Arc<super::telemetry::Telemetry>,
    report_every: Nanos,
}

type InlineNicState = InlineState<NicEndpoint<NicHost<Remap>>>;

/// What the endpoint asked for while it was held: datagrams to send and events to log.
type Pending = (Vec<Transmit>, Vec<NicEvent>);

impl InlineNicHost {
    fn lock(&self) -> std::sync::MutexGuard<'_, InlineNicState> {
        // As the inline server's: a panic inside one call must not take the NIC down.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the endpoint, then sends and logs what it asked for, with the lock released
    /// (a datagram to another service must not be delivered while this one is held).
    fn with<T>(&self, f: impl FnOnce(&mut InlineNicState) -> T) -> T {
        let (t, (out, events)): (T, Pending) = {
            let mut s = self.lock();
            let t = f(&mut s);
            let out = std::iter::from_fn(|| s.endpoint.poll_transmit()).collect();
            let events = std::iter::from_fn(|| s.endpoint.poll_event()).collect();
            (t, (out, events))
        };
        for t in out {
            let _ = self.sender.send(t.to, t.id, &t.bytes);
        }
        for e in events {
            log(e, self.server);
        }
        t
    }
}

impl Service for InlineNicHost {
    fn deliver(&self, _net: &MemoryNet, from: SocketAddr, datagram: Bytes) {
        let now = self.clock.now();
        self.with(|s| {
            if let Some(msg) = s.inbound.take(from, datagram) {
                s.endpoint.handle(now, from, msg);
            }
        });
    }

    fn tick(&self, _net: &MemoryNet) -> Option<Duration> {
        let now = self.clock.now();
        let next = self.with(|s| {
            s.endpoint.handle_timeout(now);
            s.inbound.expire();
            if now >= s.next_publish {
                s.next_publish = now + self.report_every;
                self.telemetry
                    .publish_counters(s.endpoint.stats().counters());
            }
            s.endpoint.poll_timeout()
        });
        next.map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }
}

/// Binds naam-nic's endpoint over `start` at `addr` in `net` as an inline service (see
/// [`InlineNic`]); it advertises the address it is bound at (`options.advertise` is not
/// used: an in-memory network has no address translation) and starts pairing with
/// `options.server` at once.
pub fn serve_nic_inline(
    start: NicCluster,
    net: &MemoryNet,
    addr: SocketAddr,
    mut options: NicOptions,
    remap: Remap,
) -> std::io::Result<InlineNic> {
    let clock = SystemClock::new();
    let (port, service) = net.serve(addr, |local| {
        options.advertise = local;
        let replies = Sender::memory(net, local, DEFAULT_DATAGRAM);
        let endpoint = nic_endpoint(start, replies, &options, local, clock.now(), remap)?;
        Ok(Arc::new(InlineNicHost {
            state: InlineState::new(endpoint),
            clock,
            sender: Sender::memory(net, local, DEFAULT_DATAGRAM),
            server: options.server,
            telemetry: options.telemetry.clone(),
            report_every: options.report_every.as_nanos() as Nanos,
        }))
    })?;
    Ok(InlineNic {
        port,
        service,
        drain: options.drain,
    })
}

impl InlineNic {
    /// The address forwarded requests and one-sided operations come to.
    pub fn addr(&self) -> SocketAddr {
        self.port.addr()
    }

    /// Whether the NIC is paired with the server.
    pub fn is_paired(&self) -> bool {
        self.service.lock().endpoint.is_paired()
    }

    /// The endpoint's counters so far.
    pub fn stats(&self) -> NicStats {
        self.service.lock().endpoint.stats()
    }

    /// Says goodbye to the server, refuses new work, waits (at most the drain time of its
    /// [`NicOptions`]) until queued work is answered, then closes the port.
    pub fn stop(self) -> NicStats {
        self.service.with(|s| s.endpoint.start_drain());
        wait_until_idle(self.drain, || {
            self.service.lock().endpoint.backend().replies.idle()
        });
        self.stats()
    }
}
