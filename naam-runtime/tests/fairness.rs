//! Bounded harm: one tenant's retry storm, or its flood of valid requests sent with no regard
//! for `Busy`, leaves another most of its throughput. Its own test binary, so no other test
//! shares the machine while it measures.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::deployment::{key_a, key_b, Deployment, A, B};
use common::{rd, words};
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::handler_id;
use naam_proto::session::Credential;
use naam_proto::transport::Transport;
use naam_proto::wire::{Reply, Request, Status};
use naam_proto::Placement;
use naam_runtime::udp::{UdpClient, UdpConfig};

fn client(server: SocketAddr, tenant: &str, key: Credential) -> UdpClient {
    let mut cfg = UdpConfig::new(server, tenant, key);
    cfg.pin = Some(Placement::Host);
    cfg.rto = Duration::from_millis(10);
    UdpClient::connect(&cfg).unwrap()
}

/// One tenant keeps a record torn for good (a fetch-and-add on its front version) and storms
/// it with optimistic reads that retry; the other tenant keeps most of its throughput: retries
/// are parked off the executor, never slept on, and each app's retries per period are bounded.
/// B keeps [`STORM_WINDOW`] calls in flight (see [`rate`]). The assertion guards against
/// starvation (half kept; before the fixes B kept almost nothing), not a figure: one-second
/// windows on a shared 2-core runner vary by tens of percent, and the measured shares (86%
/// threads, 93% processes) are in docs/SECURITY.md.
fn a_retry_storm_from_one_tenant_leaves_the_other_most_of_its_throughput() {
    // One after the other, never at once: each measures.
    guard("threads, retry storm", 0.5, |attempt| {
        let what = format!("threads, attempt {attempt}");
        Some(retry_storm(&mut Deployment::threads(), &what))
    });
    guard("processes, retry storm", 0.5, |attempt| {
        let mut d = Deployment::processes("the retry storm")?;
        Some(retry_storm(
            &mut d,
            &format!("processes, attempt {attempt}"),
        ))
    });
}

/// Measurements of B's share a guard may take before it fails: a noisy neighbour on a shared
/// 2-core runner can halve one measurement (in a CI run the flood's processes left B 48%,
/// 8-17 K calls/s during the flood against 20-24 K alone), while starvation, what the guards
/// are for, fails every attempt.
const ATTEMPTS: usize = 3;

/// Passes as soon as one of [`ATTEMPTS`] fresh measurements of B's share (`measure(attempt)`,
/// each in a deployment of its own) reaches `bound`, or when `measure` skips (`None`: its
/// deployment is not built here); fails with every share otherwise.
fn guard(what: &str, bound: f64, mut measure: impl FnMut(usize) -> Option<f64>) {
    let mut shares = Vec::new();
    for attempt in 1..=ATTEMPTS {
        let Some(share) = measure(attempt) else {
            return;
        };
        shares.push(format!("{:.0}%", 100.0 * share));
        if share >= bound {
            return;
        }
    }
    panic!(
        "{what}: B kept less than {:.0}% of its throughput in each of {ATTEMPTS} attempts: {}",
        100.0 * bound,
        shares.join(", ")
    );
}

/// Tenant B's rate of `add` calls over `d`, `window` in flight.
///
/// Against the retry storm B keeps [`STORM_WINDOW`] in flight, so that its rate is the
/// server's to give. One call at a time, B's rate is one over its round trip, and the share it
/// keeps measured how the loops wake each other: B's rate during the storm stayed at 9-10 K/s
/// from build to build while B alone got faster, so a faster server showed a smaller share
/// with the storm's cost unchanged (the tenth session's client polling, reverted for it; the
/// seventeenth session's server, bench/RESULTS.md). The flood's guard keeps one call at a time,
/// as its measured ceiling was taken.
fn rate(b: &mut UdpClient, d: Duration, window: usize) -> f64 {
    use naam_proto::transport::Pipeline;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < d {
        while b.in_flight() < window {
            b.submit(B, handler_id("add"), &words(&[2, 3]), &[])
                .unwrap();
        }
        for (_, r) in b.poll(true) {
            // Busy: over the session's credit while the server is loaded; sent again as the
            // window refills, and not counted.
            match r.unwrap().status {
                Status::Ok => n += 1,
                Status::Busy => {}
                other => panic!("B's call answered {other:?}"),
            }
        }
    }
    // What is still in flight is answered before the next measurement starts.
    while b.in_flight() > 0 {
        for (_, r) in b.poll(true) {
            let status = r.unwrap().status;
            assert!(matches!(status, Status::Ok | Status::Busy), "{status:?}");
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Tenant B's calls in flight during the retry storm (see [`rate`]).
const STORM_WINDOW: usize = 8;

/// Tenant A floods valid requests from four sessions, 64 at a time each, every 2 ms, with no
/// regard for `Busy` (more than its credit admits, when the server is slow); tenant B keeps
/// most of the throughput it has alone (processes: the server in its own process and, when it
/// is built, its release binary, as deployed). The server answers A's excess `Busy`, mutes a
/// session that keeps at it, and opens and runs the tenants' datagrams in turns.
///
/// The goal is 80%, a measurement for bench/RESULTS.md ("Admission and fairness"), not this
/// test's: on a 2-core machine the flood's client, B's client and two server loops share the
/// cores, and the flood's sealing alone, sent to a socket that never reads it, leaves B
/// 63-73% ([`the_flood_s_cost_on_the_cores_alone`] in this debug build on the AMD EPYC VM;
/// 68-69% in release). Against the server, B kept 38-82% there in eight debug runs (59-63%
/// in release). So both deployments guard against starvation only, a third of B's throughput,
/// where B kept almost nothing before admission. With threads the server is unoptimised code
/// in the test's own process, and the same flood is several times heavier for it.
fn a_flood_of_valid_requests_leaves_the_other_tenant_its_throughput() {
    guard("threads, flood", 0.33, |attempt| {
        let what = format!("threads, attempt {attempt}");
        Some(flood_share(&mut Deployment::threads(), &what, None))
    });
    guard("processes, flood", 0.33, |attempt| {
        let mut d = Deployment::processes_as_deployed("the flood")?;
        Some(flood_share(
            &mut d,
            &format!("processes, attempt {attempt}"),
            None,
        ))
    });
}

/// Both scenarios, one after the other: one test, so that nothing else runs while either
/// measures.
#[test]
fn one_tenant_cannot_starve_another() {
    a_retry_storm_from_one_tenant_leaves_the_other_most_of_its_throughput();
    a_flood_of_valid_requests_leaves_the_other_tenant_its_throughput();
}

/// Rounds of B alone then B during A's flood; the bound holds between their medians (this
/// machine's speed drifts by tens of percent from one second to the next).
const FLOOD_ROUNDS: usize = 3;

/// What the flood costs B on this machine's cores alone, whatever the server does: the same
/// flood (sealed by the same four sessions, at the same pace, its answers polled the same
/// way) sent to a socket that never reads it instead of naam-server. B's share then is the
/// most any admission control could leave it here. A measurement, not a guard (bench/RESULTS.md,
/// "Admission and fairness"): `cargo test --release -p naam-runtime --test fairness --
/// --ignored --nocapture`.
#[test]
#[ignore = "a measurement for RESULTS, not a regression guard"]
fn the_flood_s_cost_on_the_cores_alone() {
    for round in 0..3 {
        let sink = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let sink_addr = sink.local_addr().unwrap();
        if let Some(mut d) = Deployment::processes_as_deployed("the flood's ceiling") {
            flood_share(
                &mut d,
                &format!("round {round}, flood to naam-server"),
                None,
            );
            flood_share(
                &mut d,
                &format!("round {round}, flood to a sink"),
                Some(sink_addr),
            );
        }
    }
}

/// B's median rate during A's flood over its median rate alone (see [`flood`]); the flood
/// goes to `sink` if given, else to the server.
fn flood_share(d: &mut Deployment, what: &str, sink: Option<SocketAddr>) -> f64 {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let server = d.server();
    let target = sink.unwrap_or(server);
    let mut b = client(server, "b", key_b());
    rate(&mut b, Duration::from_millis(200), 1);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flooding = std::sync::Arc::new(AtomicBool::new(false));
    let (halt, on) = (stop.clone(), flooding.clone());
    let mut sessions: Vec<UdpClient> = (0..4).map(|_| client(server, "a", key_a())).collect();
    let flood = std::thread::spawn(move || {
        let mut req = Request::for_call(A, handler_id("add"), 0, &words(&[1, 2]), &[]).unwrap();
        req.flags |= naam_proto::wire::flags::PIN_HOST;
        let (mut sent, mut answers) = (0u64, std::collections::HashMap::<Status, u64>::new());
        while !halt.load(SeqCst) {
            if on.load(SeqCst) {
                for s in &mut sessions {
                    for _ in 0..64 {
                        sent += 1;
                        req.request_id = sent;
                        let _ = s.send_sealed(target, sent, &req.to_bytes().unwrap());
                    }
                }
            }
            for s in &mut sessions {
                for m in s.recv_sealed(Duration::from_micros(1)).unwrap_or_default() {
                    if let Ok(r) = Reply::decode(m) {
                        *answers.entry(r.status).or_default() += 1;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (sent, answers)
    });
    let (alone, during, a, f) = alone_then_during(&mut b, &flooding, 1);
    stop.store(true, SeqCst);
    let (sent, answers) = flood.join().unwrap();
    eprintln!(
        "{what}: B alone {alone:.0?}/s (median {a:.0}), during A's flood {during:.0?}/s \
         (median {f:.0}, {:.0}%); A sent {sent}: {answers:?}",
        100.0 * f / a
    );
    f / a
}

/// B's rate in [`FLOOD_ROUNDS`] rounds of B alone, then B with `load` switched on (each
/// switch given 100 ms to take effect: what the load left in flight drains, a muted session's
/// mute runs out), `window` calls of B in flight: every round's rates, then the median alone
/// and the median during.
fn alone_then_during(
    b: &mut UdpClient,
    load: &std::sync::atomic::AtomicBool,
    window: usize,
) -> (Vec<f64>, Vec<f64>, f64, f64) {
    use std::sync::atomic::Ordering::SeqCst;
    let (mut alone, mut during) = (Vec::new(), Vec::new());
    for _ in 0..FLOOD_ROUNDS {
        alone.push(rate(b, Duration::from_millis(700), window));
        load.store(true, SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        during.push(rate(b, Duration::from_millis(700), window));
        load.store(false, SeqCst);
        std::thread::sleep(Duration::from_millis(100));
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, f) = (median(&alone), median(&during));
    (alone, during, a, f)
}

/// B's median rate during A's retry storm over its median rate alone; asserts that no
/// optimistic read ever returned the torn record.
fn retry_storm(d: &mut Deployment, what: &str) -> f64 {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let mut b = client(d.server(), "b", key_b());
    rate(&mut b, Duration::from_millis(200), STORM_WINDOW);
    // Tenant A tears its own record for good.
    let mut a = client(d.server(), "a", key_a());
    let data = a.manifest().app(A).unwrap().region_key("data").unwrap();
    let front = Descriptor {
        rkey: data,
        offset: 0,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    let r = a
        .call(A, handler_id("counter_add"), &words(&[1]), &[front])
        .unwrap();
    assert_eq!(r.status, Status::Ok);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let storming = std::sync::Arc::new(AtomicBool::new(false));
    let (halt, on) = (stop.clone(), storming.clone());
    let server = d.server();
    let storm = std::thread::spawn(move || {
        // Eight optimistic reads of the torn record in flight at all times.
        const WINDOW: u64 = 8;
        let (mut sent, mut answered) = (0u64, 0u64);
        let mut answers = std::collections::HashMap::<Status, u64>::new();
        let record = rd(data, 0, 32);
        while !halt.load(SeqCst) {
            if !on.load(SeqCst) {
                // Between rounds: what is still parked drains, and the window starts afresh.
                for m in a.recv_sealed(Duration::from_millis(2)).unwrap() {
                    if let Ok(r) = Reply::decode(m) {
                        *answers.entry(r.status).or_default() += 1;
                    }
                }
                answered = sent;
                continue;
            }
            while sent.saturating_sub(answered) < WINDOW {
                sent += 1;
                let mut req =
                    Request::for_call(A, handler_id("vget"), sent, &[], &[record]).unwrap();
                req.flags |= naam_proto::wire::flags::PIN_HOST;
                a.send_sealed(server, sent, &req.to_bytes().unwrap())
                    .unwrap();
            }
            let got = a.recv_sealed(Duration::from_millis(20)).unwrap();
            if got.is_empty() {
                // Lost or still parked: let the window refill.
                answered = sent;
            }
            let mut busy = false;
            for m in got {
                if let Ok(r) = Reply::decode(m) {
                    answered = (answered + 1).min(sent);
                    busy |= r.status == Status::Busy;
                    *answers.entry(r.status).or_default() += 1;
                }
            }
            if busy {
                // Back-pressure, as every NAAM client honours it.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        (sent, answers)
    });
    // Rounds, compared by their medians: one window of each once failed here (B "alone" in a
    // fast second, 14.7 K/s, against 7.3 K/s during, where B alone runs 7-15 K/s from one
    // second to the next).
    let (alone, during, a, f) = alone_then_during(&mut b, &storming, STORM_WINDOW);
    stop.store(true, SeqCst);
    let (sent, answers) = storm.join().unwrap();
    eprintln!(
        "{what}: B alone {alone:.0?}/s (median {a:.0}), during A's storm {during:.0?}/s \
         (median {f:.0}, {:.0}%); A sent {sent}: {answers:?}",
        100.0 * f / a
    );
    assert!(
        answers.get(&Status::Ok).copied().unwrap_or(0) == 0,
        "{what}: a torn record is never returned: {answers:?}"
    );
    f / a
}
