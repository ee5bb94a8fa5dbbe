//! YCSB sharded over three naam-server processes (`naam-bench ycsb --cluster FILE`): the run
//! completes with no error, and every record it loaded is held by the node that owns its
//! key's hash slot, as an unmodified Redis Cluster client finds it (asked over RESP, each
//! node answers the keys of its slots and redirects the others with `MOVED`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use naam_bench::ycsb::KeyNaming;
use naam_resp::slots::key_slot;

/// naam-server beside this test's naam-bench (a workspace build makes both); `None`, said
/// why, when it is not there outside CI.
fn naam_server() -> Option<PathBuf> {
    let bin = Path::new(env!("CARGO_BIN_EXE_naam-bench"))
        .with_file_name(format!("naam-server{}", std::env::consts::EXE_SUFFIX));
    if bin.is_file() {
        return Some(bin);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI builds every binary, but {} is missing",
        bin.display()
    );
    eprintln!(
        "SKIPPED: no {} (run `cargo build --bins` first)",
        bin.display()
    );
    None
}

/// A loopback port free for TCP and UDP now.
fn free_port() -> u16 {
    loop {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = tcp.local_addr().expect("addr").port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One RESP exchange: `commands` sent at once, and each answer's kind: a simple line
/// (`+OK`, `-MOVED …`), `nil`, or `bulk` (a value, whatever bytes it holds).
fn resp(at: SocketAddr, commands: &[Vec<&str>]) -> Vec<String> {
    let mut s = TcpStream::connect(at).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut out = Vec::new();
    for words in commands {
        out.extend(format!("*{}\r\n", words.len()).bytes());
        for w in words {
            out.extend(format!("${}\r\n{w}\r\n", w.len()).bytes());
        }
    }
    s.write_all(&out).expect("send");
    let mut input: Vec<u8> = Vec::new();
    let mut kinds = Vec::new();
    let mut at = 0;
    let mut buf = [0u8; 65536];
    while kinds.len() < commands.len() {
        // The next answer, if `input` holds all of it: a line, or a bulk's header and body.
        let line_end = input[at..]
            .windows(2)
            .position(|w| w == b"\r\n")
            .map(|i| at + i);
        let parsed = line_end.and_then(|end| {
            let line = String::from_utf8_lossy(&input[at..end]).into_owned();
            match line.strip_prefix('$').map(|n| n.parse::<i64>()) {
                Some(Ok(-1)) => Some(("nil".to_string(), end + 2)),
                Some(Ok(len)) => {
                    let stop = end + 2 + len as usize + 2;
                    (input.len() >= stop).then(|| ("bulk".to_string(), stop))
                }
                Some(Err(e)) => panic!("bad bulk header {line:?}: {e}"),
                None => Some((line, end + 2)),
            }
        });
        match parsed {
            Some((kind, next)) => {
                kinds.push(kind);
                at = next;
            }
            None => {
                let n = s.read(&mut buf).expect("read");
                assert!(n > 0, "connection closed after {} answers", kinds.len());
                input.extend_from_slice(&buf[..n]);
            }
        }
    }
    kinds
}

#[test]
fn a_sharded_ycsb_run_puts_every_record_on_its_slot_s_node() {
    let Some(server) = naam_server() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let keys = d.join("keys");
    std::fs::create_dir(&keys).expect("keys dir");
    let out = Command::new(&server)
        .args(["keygen", "--out"])
        .arg(keys.join("mica.key"))
        .output()
        .expect("keygen runs");
    assert!(out.status.success(), "{out:?}");
    let password = std::fs::read_to_string(keys.join("mica.key"))
        .expect("key")
        .trim()
        .to_string();

    let resp_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let udp_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let ranges = ["0-5460", "5461-10922", "10923-16383"];
    let mut cluster = String::new();
    for i in 0..3 {
        cluster.push_str(&format!(
            "[[node]]\nresp = \"127.0.0.1:{}\"\nnaam = \"127.0.0.1:{}\"\nslots = [\"{}\"]\n",
            resp_ports[i], udp_ports[i], ranges[i]
        ));
    }
    std::fs::write(d.join("cluster.toml"), &cluster).expect("cluster file");
    let mut servers = Vec::new();
    for i in 0..3 {
        let node = d.join(format!("node{i}"));
        std::fs::create_dir(&node).expect("node dir");
        std::fs::write(
            node.join("naam-server.toml"),
            format!(
                "listen = \"127.0.0.1:{}\"\nresp_listen = \"127.0.0.1:{}\"\n\
                 resp_cluster = \"{}\"\nresp_path = \"inline\"\nreceive_loops = 1\n\
                 shm_dir = \"shm\"\n\n[[app]]\nkind = \"mica\"\nid = 1\n\
                 credential = \"{}\"\nitems = 2000\n",
                udp_ports[i],
                resp_ports[i],
                d.join("cluster.toml").display(),
                keys.join("mica.key").display()
            ),
        )
        .expect("config");
        servers.push(Killed(
            Command::new(&server)
                .args(["--config", "naam-server.toml", "-q"])
                .current_dir(&node)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("naam-server starts"),
        ));
    }

    let records = 300u64;
    let cluster_arg = d.join("cluster.toml").display().to_string();
    let records_arg = records.to_string();
    let args = [
        "ycsb",
        "--fabric",
        "udp",
        "--cluster",
        &cluster_arg,
        "--keys",
        keys.to_str().expect("utf-8 path"),
        "--records",
        &records_arg,
        "--ops",
        "600",
        "--threads",
        "2",
    ];
    // The servers load and verify their handlers first: retry until all three answer.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = Command::new(env!("CARGO_BIN_EXE_naam-bench"))
            .args(args)
            .output()
            .expect("naam-bench runs");
        if out.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sharded ycsb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // Every loaded record is at the node of its slot, and only there.
    let naming = KeyNaming::default();
    let names: Vec<String> = (0..records)
        .map(|n| {
            let mut s = String::new();
            naming.name_into(n, &mut s);
            s
        })
        .collect();
    let mut held = [0usize; 3];
    for (i, port) in resp_ports.iter().enumerate() {
        let at = SocketAddr::from(([127, 0, 0, 1], *port));
        let mut asked = vec![vec!["AUTH", "mica", password.as_str()]];
        asked.extend(names.iter().map(|k| vec!["GET", k.as_str()]));
        let answers = resp(at, &asked);
        assert_eq!(answers[0], "+OK");
        for (name, answer) in names.iter().zip(&answers[1..]) {
            let slot = key_slot(name.as_bytes());
            let owner = match slot {
                0..=5460 => 0,
                5461..=10922 => 1,
                _ => 2,
            };
            if owner == i {
                assert_eq!(answer, "bulk", "{name} (slot {slot}) on node {i}");
                held[i] += 1;
            } else {
                assert_eq!(
                    answer,
                    &format!("-MOVED {slot} 127.0.0.1:{}", resp_ports[owner]),
                    "{name} on node {i}"
                );
            }
        }
    }
    assert_eq!(held.iter().sum::<usize>(), records as usize, "{held:?}");
    assert!(held.iter().all(|&h| h > 0), "{held:?}");
}
