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
    let mut s = TcpStream::connect(addr).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: naam\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out
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
