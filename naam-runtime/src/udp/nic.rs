//! The NIC side of the UDP fabric: the driver loop of `naam-nic`. It runs on the NIC's own
//! cores: forwarded (or switch-redirected) requests go to the NIC executors, which reply to the
//! client directly; one-sided operations are served by this loop itself, the one-sided agent
//! (never by host executor threads); and every period it reports its load to the server.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::control::{self, Control, KIND_CONTROL, KIND_FORWARD};
use super::server::{malformed, Replies};
use super::socket::Socket;
use crate::cluster::{Cluster, Dispatch, Selector};
use crate::onesided::{self, KIND_OP};
use crate::placement::Placement;
use crate::wire::{peek_kind, Request, Status, KIND_REQUEST};

/// Counters of a NIC driver.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct NicStats {
    /// Requests run by the NIC executors.
    pub executed: u64,
    /// One-sided operations served.
    pub one_sided: u64,
    /// Retransmitted one-sided writes answered from the duplicate cache.
    pub duplicates: u64,
    /// Messages that did not decode.
    pub malformed: u64,
    /// Requests refused (busy, shutting down).
    pub refused: u64,
}

/// How the NIC driver behaves.
#[derive(Clone, Debug)]
pub struct NicOptions {
    /// The server's address (load reports go there).
    pub server: SocketAddr,
    /// The address the NIC advertises to clients and the switch.
    pub advertise: SocketAddr,
    /// Load report period.
    pub report_every: Duration,
    /// How long SIGTERM waits for queued work.
    pub drain: Duration,
}

/// Recent answers to mutating one-sided operations, so a retransmission is not applied twice.
struct DuplicateCache {
    answers: HashMap<(SocketAddr, u64), Bytes>,
    order: VecDeque<(SocketAddr, u64)>,
}

const DUPLICATE_CACHE: usize = 1 << 16;

impl DuplicateCache {
    fn get(&self, key: &(SocketAddr, u64)) -> Option<&Bytes> {
        self.answers.get(key)
    }

    fn put(&mut self, key: (SocketAddr, u64), answer: Bytes) {
        if self.answers.insert(key, answer).is_none() {
            self.order.push_back(key);
            if self.order.len() > DUPLICATE_CACHE {
                if let Some(old) = self.order.pop_front() {
                    self.answers.remove(&old);
                }
            }
        }
    }
}

/// Runs the NIC driver until `stop` is set; then says goodbye to the server (which stops
/// forwarding) and drains queued work.
pub fn serve_nic(
    cluster: Arc<Cluster>,
    mut socket: Socket,
    options: NicOptions,
    stop: &AtomicBool,
) -> std::io::Result<NicStats> {
    let replies = Replies::new(socket.sender()?);
    let mut stats = NicStats::default();
    let mut sel = Selector::default();
    let mut dup = DuplicateCache {
        answers: HashMap::new(),
        order: VecDeque::new(),
    };
    let mut next_report = Instant::now();
    let mut drain_deadline: Option<Instant> = None;
    let mut report_id = 0u64;
    loop {
        if stop.load(Ordering::SeqCst) && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + options.drain);
            replies.send_bytes(options.server, 0, &Control::NicBye.to_bytes(0));
        }
        if let Some(d) = drain_deadline {
            if replies.idle() || Instant::now() >= d {
                return Ok(stats);
            }
        }
        if drain_deadline.is_none() && Instant::now() >= next_report {
            next_report = Instant::now() + options.report_every;
            report_id += 1;
            let m = Control::NicLoad {
                agent: options.advertise,
                load: cluster.take_load_report(Placement::Nic),
            };
            replies.send_bytes(options.server, report_id, &m.to_bytes(report_id));
        }
        let wait = next_report
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(1));
        for (peer, msg) in socket.recv(wait)? {
            match peek_kind(&msg) {
                Some(k @ (KIND_REQUEST | KIND_FORWARD)) => {
                    let (client, bytes) = if k == KIND_FORWARD {
                        match control::unforward(&msg) {
                            Ok(x) => x,
                            Err(_) => {
                                stats.malformed += 1;
                                continue;
                            }
                        }
                    } else {
                        (peer, msg.clone())
                    };
                    let req = match Request::decode(bytes) {
                        Ok(r) => r,
                        Err(e) => {
                            stats.malformed += 1;
                            replies.send(client, &malformed(0, 0, Placement::Nic, e.to_string()));
                            continue;
                        }
                    };
                    if drain_deadline.is_some() {
                        stats.refused += 1;
                        let r = crate::cluster::error_reply(
                            &req,
                            Status::Unavailable,
                            Placement::Nic,
                            "the NIC is shutting down".into(),
                        );
                        replies.send(client, &r);
                        continue;
                    }
                    match replies.dispatch(&cluster, req, &mut sel, Some(Placement::Nic), client) {
                        Dispatch::Queued(_) => stats.executed += 1,
                        Dispatch::Remote(req) => {
                            stats.refused += 1;
                            let r = crate::cluster::error_reply(
                                &req,
                                Status::Unavailable,
                                Placement::Nic,
                                "this NIC has no executors".into(),
                            );
                            replies.send(client, &r);
                        }
                        Dispatch::Refused(r) => {
                            stats.refused += 1;
                            replies.send(client, &r);
                        }
                    }
                }
                Some(KIND_OP) => {
                    let op = match onesided::Request::decode(msg.clone()) {
                        Ok(op) => op,
                        Err(e) => {
                            stats.malformed += 1;
                            let c =
                                onesided::Completion::error(0, 0, Status::Malformed, e.to_string());
                            replies.send_bytes(peer, 0, &c.to_bytes());
                            continue;
                        }
                    };
                    let key = (peer, op.id);
                    if op.op.mutates() {
                        if let Some(answer) = dup.get(&key) {
                            stats.duplicates += 1;
                            replies.send_bytes(peer, op.id, answer);
                            continue;
                        }
                    }
                    stats.one_sided += 1;
                    let answer = onesided::execute(cluster.regions(), &op).to_bytes();
                    replies.send_bytes(peer, op.id, &answer);
                    if op.op.mutates() {
                        dup.put(key, answer);
                    }
                }
                Some(KIND_CONTROL) => {
                    // The NIC takes no control queries; say so rather than stay silent.
                    if let Ok((id, _)) = Control::decode(&msg) {
                        let m = Control::Error {
                            message: "this is naam-nic; send control queries to naam-server".into(),
                        };
                        replies.send_bytes(peer, id, &m.to_bytes(id));
                    } else {
                        stats.malformed += 1;
                    }
                }
                _ => stats.malformed += 1,
            }
        }
    }
}
