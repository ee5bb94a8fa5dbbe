//! naam-server and naam-nic serve Prometheus metrics while they run (`--metrics ADDR`): a
//! scrape after some calls shows the messages per app, handler and placement, errors by
//! status, queue depths, steering weights, service-time histograms and the drivers' counters.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::deployment::{key_a, Deployment, A};
use common::words;
use naam_proto::handler_id;
use naam_proto::transport::Transport;
use naam_proto::Placement;
use naam_runtime::udp::{UdpClient, UdpConfig};

fn scrape(addr: SocketAddr) -> String {
    let out = try_scrape(addr).expect("metrics endpoint");
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out
}

/// One GET of `/metrics` (`None`: nothing listens there yet, or the answer broke off).
fn try_scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: naam\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// The value of the first sample whose line starts with `prefix`.
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn server_and_nic_metrics_can_be_scraped_while_serving() {
    let Some(d) = Deployment::processes("the metrics scrape") else {
        return;
    };
    let (server_metrics, nic_metrics) = d.metrics().expect("processes");
    // Requests each client resent: a read resent after a pause (a loaded machine's scheduler)
    // runs again where it is received, and is counted again.
    let mut resent = Vec::new();
    for (pin, n) in [(Placement::Host, 20u64), (Placement::Nic, 10)] {
        let mut cfg = UdpConfig::new(d.server(), "a", key_a());
        cfg.pin = Some(pin);
        let mut c = UdpClient::connect(&cfg).unwrap();
        for i in 0..n {
            let r = c.call(A, handler_id("add"), &words(&[i, 1]), &[]).unwrap();
            assert_eq!(r.status, naam_proto::wire::Status::Ok);
        }
        // One handler error: `bsearch` without its segment.
        let r = c.call(A, handler_id("bsearch"), &words(&[7]), &[]).unwrap();
        assert_eq!(r.status, naam_proto::wire::Status::HandlerError);
        resent.push(c.transport_counts().resends as f64);
    }
    // `want` answered, plus at most what was resent.
    let counted = |value: Option<f64>, want: f64, resent: f64| {
        value.is_some_and(|v| v >= want && v <= want + resent)
    };
    // Counters are published about once a second.
    let deadline = Instant::now() + Duration::from_secs(5);
    let server = loop {
        let text = scrape(server_metrics);
        if sample(&text, "naam_sessions_total").unwrap_or(0.0) >= 1.0 || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let host_adds = "naam_messages_total{role=\"server\",app=\"a\",handler=\"add\",placement=\"host\",status=\"ok\"}";
    assert!(
        counted(sample(&server, host_adds), 20.0, resent[0]),
        "resent {resent:?}: {server}"
    );
    let host_errors = "naam_messages_total{role=\"server\",app=\"a\",handler=\"bsearch\",placement=\"host\",status=\"handler-error\"}";
    assert!(
        counted(sample(&server, host_errors), 1.0, resent[0]),
        "resent {resent:?}: {server}"
    );
    let host_served = "naam_service_seconds_bucket{role=\"server\",app=\"a\",handler=\"add\",placement=\"host\",le=\"+Inf\"}";
    assert!(
        counted(sample(&server, host_served), 20.0, resent[0]),
        "resent {resent:?}: {server}"
    );
    assert!(server.contains("naam_queue_depth{role=\"server\",placement=\"host\"}"));
    assert!(server.contains(
        "naam_steering_weight{role=\"server\",app=\"a\",handler=\"add\",placement=\"nic\"}"
    ));
    assert!(
        sample(&server, "naam_sessions_total").unwrap_or(0.0) >= 1.0,
        "{server}"
    );
    assert!(server.contains("# TYPE naam_service_seconds histogram"));
    let nic = scrape(nic_metrics);
    let nic_adds = "naam_messages_total{role=\"nic\",app=\"a\",handler=\"add\",placement=\"nic\",status=\"ok\"}";
    assert!(
        counted(sample(&nic, nic_adds), 10.0, resent[1]),
        "resent {resent:?}: {nic}"
    );
    assert!(
        nic.contains("naam_queue_depth{role=\"nic\",placement=\"nic\"}"),
        "{nic}"
    );
}

/// Parses `text` (a scrape's body) with the Prometheus project's Python client's parser
/// (scripts/setup.sh installs it in target/pytools) and returns how many samples it read;
/// `None` where it is not installed (not in CI).
fn parsed_by_prometheus_client(text: &str) -> Option<usize> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/pytools/bin/python");
    if !python.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI parses the metrics with prometheus-client: scripts/setup.sh installs it"
        );
        eprintln!(
            "skipped prometheus-client's parser: no {}",
            python.display()
        );
        return None;
    }
    let script = "import sys\n\
        from prometheus_client.parser import text_string_to_metric_families\n\
        n = sum(len(f.samples) for f in text_string_to_metric_families(sys.stdin.read()))\n\
        print(n)\n";
    let mut child = std::process::Command::new(python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus-client refused the metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// naam-server keeps its handlers' compiled code in `code_cache`: a restart maps it instead
/// of compiling it, a corrupted entry is refused and compiled again, and tenant a's tiered
/// handlers run on the JIT once their code is ready.
#[test]
fn a_restart_maps_its_handlers_from_the_code_cache() {
    let Some(mut d) = Deployment::processes("the code cache") else {
        return;
    };
    let (server_metrics, _) = d.metrics().expect("processes");
    let counter = |text: &str, name: &str| {
        sample(
            text,
            &format!("naam_code_cache_{name}_total{{role=\"server\"}}"),
        )
        .unwrap_or_else(|| panic!("no {name} counter in\n{text}"))
    };
    // Scraped until the restarted server renders its cluster (and its tiered handlers are on
    // the JIT).
    let serving = || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(out) = try_scrape(server_metrics) {
                let tiered_on_jit = out
                    .lines()
                    .filter(|l| {
                        l.starts_with("naam_handler_engine{")
                            && l.contains("configured=\"tiered\"")
                            && l.contains("engine=\"jit\"")
                    })
                    .collect::<Vec<_>>();
                if !tiered_on_jit.is_empty() && tiered_on_jit.iter().all(|l| l.ends_with(" 1")) {
                    return out;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the server's handlers were not all on the JIT within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let first = serving();
    let compiled = counter(&first, "compiled");
    // Nothing ran yet: no handler time, no budget spent.
    assert!(!first.contains("naam_app_cpu_seconds_total{"), "{first}");
    assert!(first
        .contains("naam_app_budget_exhausted_total{role=\"server\",app=\"a\",budget=\"steps\"} 0"));
    assert!(compiled >= 1.0, "{first}");
    assert_eq!(counter(&first, "store_hits"), 0.0);
    assert!(
        first.contains("naam_handler_jit_ready_seconds{role=\"server\",app=\"a\""),
        "{first}"
    );

    d.restart_server();
    let second = serving();
    assert_eq!(counter(&second, "compiled"), 0.0, "{second}");
    assert_eq!(counter(&second, "store_hits"), compiled);
    assert_eq!(counter(&second, "rejected"), 0.0);

    // One entry corrupted: refused, compiled again, and the others still mapped.
    let dir = d.dir().expect("processes").join("code-cache");
    let entry = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "code"))
        .expect("a stored entry");
    let mut bytes = std::fs::read(&entry).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&entry, bytes).unwrap();
    d.restart_server();
    let third = serving();
    assert_eq!(counter(&third, "rejected"), 1.0, "{third}");
    assert_eq!(counter(&third, "compiled"), 1.0);
    assert_eq!(counter(&third, "store_hits"), compiled - 1.0);
    // And it serves, its handler time accounted to tenant a at the host.
    let mut cfg = UdpConfig::new(d.server(), "a", key_a());
    cfg.pin = Some(Placement::Host);
    let mut c = UdpClient::connect(&cfg).unwrap();
    let r = c.call(A, handler_id("add"), &words(&[2, 3]), &[]).unwrap();
    assert_eq!(r.status, naam_proto::wire::Status::Ok);
    let body = |scrape: String| {
        scrape
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let cpu = "naam_app_cpu_seconds_total{role=\"server\",app=\"a\",placement=\"host\"}";
    while sample(&scrape(server_metrics), cpu).is_none_or(|s| s <= 0.0) {
        assert!(Instant::now() < deadline, "no handler time for tenant a");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every line, the new families' included, is what Prometheus's own parser reads.
    let text = body(scrape(server_metrics));
    if let Some(samples) = parsed_by_prometheus_client(&text) {
        let ours = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .count();
        assert_eq!(samples, ours, "{text}");
    }
}
