//! naam-server's RESP front, driven by the real Redis tools: Debian's redis-cli and
//! redis-benchmark, and PyPI's redis-py (scripts/setup.sh installs all three), against real
//! naam-server processes: one server, three servers as one Redis Cluster, and the naam-resp
//! gateway in front of either. Hostile bytes close only their own connection.
//!
//! Outside CI a missing tool skips its part with the reason; in CI it fails the test.

use naam_resp::codec::{parse_frame, Frame, Limits};
use naam_runtime::CredentialFile as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A tool scripts/setup.sh installs, or `None` (and why) outside CI.
fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must test with {name} (scripts/setup.sh installs it), but it is not on PATH"
        );
        eprintln!("SKIPPED the {name} part: {name} is not installed (bash scripts/setup.sh)");
    }
    found
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> Option<PathBuf> {
    let p = repo().join("target/pytools/bin/python");
    let ok = Command::new(&p)
        .args(["-c", "import redis"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must test with redis-py, but {} cannot import redis (scripts/setup.sh)",
            p.display()
        );
        eprintln!(
            "SKIPPED the redis-py part: no redis-py in target/pytools (bash scripts/setup.sh)"
        );
        return None;
    }
    Some(p)
}

/// Runs resp_clients.py's `mode` checks with redis-py against the RESP port `port` as tenant
/// `mica` (skipped outside CI when redis-py is missing).
fn redis_py(mode: &str, port: u16, password: &str) {
    let Some(py) = python() else { return };
    let out = Command::new(py)
        .arg(repo().join("apps/server/tests/resp_clients.py"))
        .args([mode, "127.0.0.1", &port.to_string(), "mica", password])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "redis-py {mode}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A loopback port free a moment ago (TCP and UDP alike are tried), never handed out before
/// in this process.
fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        let mut used = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
        if !used.contains(&port) {
            used.push(port);
            return port;
        }
    }
}

/// One naam-server with a MICA table of 1 KB values and a RESP front.
struct Server {
    dir: tempfile::TempDir,
    child: Child,
    resp: SocketAddr,
    udp: SocketAddr,
    password: String,
}

impl Server {
    /// Starts one; `cluster` is the text of a cluster file every node shares.
    fn start(
        resp: SocketAddr,
        udp: SocketAddr,
        key: &naam_runtime::proto::session::Credential,
        cluster: Option<&str>,
    ) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        key.write_new(&d.join("mica.key")).expect("credential");
        let mut config = format!(
            "listen = \"{udp}\"\nresp_listen = \"{resp}\"\nreceive_loops = 1\n\
             [[app]]\nkind = \"mica\"\nid = 1\ncredential = \"mica.key\"\n\
             items = 20000\nkey_cap = 32\nvalue_cap = 1100\n\
             [[app]]\nkind = \"btree\"\nid = 2\ncredential = \"mica.key\"\nkeys = 2000\n"
        );
        if let Some(text) = cluster {
            std::fs::write(d.join("cluster.toml"), text).expect("cluster file");
            config = format!("resp_cluster = \"cluster.toml\"\nresp_path = \"inline\"\n{config}");
        }
        std::fs::write(d.join("naam-server.toml"), config).expect("config");
        let child = Command::new(env!("CARGO_BIN_EXE_naam-server"))
            .arg("--config")
            .arg(d.join("naam-server.toml"))
            .arg("--shm-dir")
            .arg(d.join("shm"))
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(log(d, "naam-server.log"))
            .spawn()
            .expect("naam-server starts");
        let password = key.file_text().trim().to_string();
        let mut s = Server {
            dir,
            child,
            resp,
            udp,
            password,
        };
        s.wait_until_serving();
        s
    }

    /// Until an `AUTH` succeeds: the front is up and the server behind it serves.
    fn wait_until_serving(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let auth = command(&["AUTH", "mica", &self.password]);
        loop {
            if let Ok(reply) = exchange(self.resp, &auth) {
                if reply.starts_with(b"+OK") {
                    return;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("naam-server exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "no RESP answer within 30 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("naam-server.log")).unwrap_or_default()
    }

    /// redis-cli's output for `args`, authenticated.
    fn cli(&self, cli: &Path, args: &[&str]) -> String {
        redis_cli(cli, self.resp, Some(&self.password), args)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- naam-server.log ({})\n{}", self.resp, self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log(dir: &Path, name: &str) -> Stdio {
    std::fs::File::create(dir.join(name))
        .expect("log file")
        .into()
}

fn redis_cli(cli: &Path, at: SocketAddr, password: Option<&str>, args: &[&str]) -> String {
    let mut c = Command::new(cli);
    c.args(["-h", &at.ip().to_string(), "-p", &at.port().to_string()]);
    if let Some(p) = password {
        c.args(["--user", "mica", "--pass", p, "--no-auth-warning"]);
    }
    let out = c.args(args).output().expect("redis-cli runs");
    assert!(
        out.status.success(),
        "redis-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A command as RESP.
fn command(words: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", words.len()).into_bytes();
    for w in words {
        out.extend_from_slice(format!("${}\r\n{w}\r\n", w.len()).as_bytes());
    }
    out
}

/// Sends `bytes` on a new connection and returns what comes back before the server closes
/// or goes quiet for 300 ms.
fn exchange(at: SocketAddr, bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_millis(300)))?;
    s.write_all(bytes)?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return if out.is_empty() { Err(e) } else { Ok(out) }
            }
            Err(e) => return Err(e),
        }
    }
}

/// As [`ask`], with the client writing everything (from another thread) and reading nothing
/// for `wait` first: the server's output for it piles up.
fn ask_slowly(at: SocketAddr, commands: &[Vec<u8>], wait: Duration) -> Vec<Frame> {
    let s = TcpStream::connect_timeout(&at, Duration::from_secs(1)).expect("connects");
    let mut w = s.try_clone().unwrap();
    let all = commands.concat();
    let writer = std::thread::spawn(move || w.write_all(&all));
    std::thread::sleep(wait);
    let frames = read_answers(s, commands.len());
    writer.join().unwrap().expect("all written");
    frames
}

fn read_answers(mut s: TcpStream, n: usize) -> Vec<Frame> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (mut buf, mut frames, mut chunk) = (Vec::new(), Vec::new(), vec![0u8; 1 << 16]);
    let mut at = 0;
    while frames.len() < n {
        let got = s.read(&mut chunk).expect("an answer within 10 s");
        assert!(got > 0, "closed after {} answers", frames.len());
        buf.extend_from_slice(&chunk[..got]);
        while let Some((f, used)) = parse_frame(&buf[at..], &Limits::default()).expect("RESP") {
            frames.push(f);
            at += used;
        }
        if at > (1 << 20) {
            buf.drain(..at);
            at = 0;
        }
    }
    frames
}

/// Sends `commands` pipelined on one connection and reads one answer per command.
fn ask(at: SocketAddr, commands: &[Vec<u8>]) -> Vec<Frame> {
    let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(1)).expect("connects");
    s.write_all(&commands.concat()).unwrap();
    read_answers(s, commands.len())
}

fn key() -> naam_runtime::proto::session::Credential {
    naam_runtime::proto::session::Credential::generate(&naam_runtime::entropy::os())
        .expect("entropy")
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A gateway process, killed when the test ends (or fails).
struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// naam-resp, the gateway, from the same build.
fn gateway(args: &[String], dir: &Path) -> Gateway {
    let exe = std::env::current_exe().expect("test binary");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("naam-resp");
    assert!(
        bin.is_file(),
        "no {} (cargo build --workspace --bins first)",
        bin.display()
    );
    Gateway(
        Command::new(bin)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log(dir, "naam-resp.log"))
            .spawn()
            .expect("naam-resp starts"),
    )
}

fn wait_for_pong(at: SocketAddr, child: &mut Child, dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = exchange(at, &command(&["PING"])) {
            if r.starts_with(b"+PONG") {
                return;
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "naam-resp exited ({status}):\n{}",
                std::fs::read_to_string(dir.join("naam-resp.log")).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "naam-resp did not answer PING within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn redis_cli_redis_benchmark_and_redis_py_speak_to_naam_server_and_bad_bytes_harm_no_one() {
    let s = Server::start(local(free_port()), local(free_port()), &key(), None);
    // Hostile bytes first: each closes its own connection with an error, nothing else.
    for bad in [
        &b"*1\r\n$99999999999\r\n"[..],
        b"*2\r\n:1\r\n",
        b"*1\r\n$3\r\nPINGX\r\n",
        b"SET \"unbalanced\r\n",
    ] {
        let r = exchange(s.resp, bad).expect("an answer");
        assert!(
            r.starts_with(b"-ERR Protocol error"),
            "{:?}: {:?}",
            String::from_utf8_lossy(bad),
            String::from_utf8_lossy(&r)
        );
    }
    // A command larger than a connection's input may hold (two 1 MiB arguments) closes that
    // connection with the limit; it does not wait for bytes that could never be parsed.
    let mut huge = command(&["AUTH", "mica", &s.password]);
    let mb = "x".repeat(1 << 20);
    huge.extend(command(&["MSET", "h1", &mb, "h2", &mb]));
    let r = exchange(s.resp, &huge).expect("an answer");
    assert!(
        String::from_utf8_lossy(&r).starts_with("+OK\r\n-ERR Protocol error: unfinished command"),
        "{:?}",
        String::from_utf8_lossy(&r[..r.len().min(200)])
    );
    // A client that writes 6,000 pipelined GETs of a 1 KB value (6 MB of answers, over the
    // 4 MiB a connection may leave unsent) before it reads a byte gets every answer, in order.
    let mut setup = command(&["AUTH", "mica", &s.password]);
    setup.extend(command(&["SET", "kb", &"v".repeat(1024)]));
    let gets: Vec<Vec<u8>> = std::iter::once(setup)
        .chain((0..6000).map(|_| command(&["GET", "kb"])))
        .collect();
    let answers = ask_slowly(s.resp, &gets, Duration::from_millis(300));
    assert_eq!(answers.len(), 6002);
    assert!(answers[2..]
        .iter()
        .all(|f| matches!(f, Frame::Bulk(b) if b.len() == 1024)));
    let noauth = exchange(s.resp, &command(&["GET", "k"])).unwrap();
    assert_eq!(noauth, b"-NOAUTH Authentication required.\r\n");
    let Some(cli) = tool("redis-cli") else { return };
    assert_eq!(s.cli(&cli, &["PING"]), "PONG\n");
    assert_eq!(s.cli(&cli, &["SET", "greeting", "hello"]), "OK\n");
    assert_eq!(s.cli(&cli, &["GET", "greeting"]), "hello\n");
    assert_eq!(s.cli(&cli, &["MSET", "a", "1", "b", "2"]), "OK\n");
    assert_eq!(s.cli(&cli, &["MGET", "a", "nothing", "b"]), "1\n\n2\n");
    assert_eq!(s.cli(&cli, &["EXISTS", "a", "b", "nothing"]), "2\n");
    assert_eq!(s.cli(&cli, &["DEL", "a", "nothing"]), "1\n");
    assert_eq!(s.cli(&cli, &["SET", "b", "3", "XX"]), "OK\n");
    assert_eq!(s.cli(&cli, &["GET", "b"]), "3\n");
    assert_eq!(s.cli(&cli, &["INCR", "counter"]), "1\n");
    assert_eq!(s.cli(&cli, &["INCRBY", "counter", "41"]), "42\n");
    assert_eq!(s.cli(&cli, &["DECRBY", "counter", "50"]), "-8\n");
    assert_eq!(s.cli(&cli, &["GET", "counter"]), "-8\n");
    assert!(s
        .cli(&cli, &["INCR", "greeting"])
        .contains("not an integer"));
    assert_eq!(
        s.cli(&cli, &["GET", "greeting"]),
        "hello\n",
        "a refused INCR changes nothing"
    );
    assert!(s
        .cli(&cli, &["FLUSHALL"])
        .starts_with("ERR unknown command 'FLUSHALL'"));
    assert!(s
        .cli(&cli, &["SET", "k", "v", "NX"])
        .contains("insert-if-absent"));
    assert!(s
        .cli(&cli, &["SET", "k", &"v".repeat(2000)])
        .contains("over this table's 1100 bytes"));
    assert!(s.cli(&cli, &["INFO"]).contains("redis_mode:standalone"));
    assert!(
        s.cli(&cli, &["COMMAND", "COUNT"])
            .trim()
            .parse::<u32>()
            .unwrap()
            > 10
    );
    assert!(s
        .cli(&cli, &["CLUSTER", "SLOTS"])
        .contains("cluster support disabled"));
    assert!(
        redis_cli(&cli, s.resp, Some(&"0".repeat(64)), &["GET", "greeting"]).contains("NOAUTH")
    );
    // The B-tree, as the same credential's other app: decimal keys, SET/GET/MGET and SCAN in
    // key order with the next key as the cursor.
    let bt = |args: &[&str]| {
        let out = Command::new(&cli)
            .args([
                "-p",
                &s.resp.port().to_string(),
                "--user",
                "btree",
                "--pass",
                &s.password,
            ])
            .arg("--no-auth-warning")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(
        bt(&["MSET", "30", "3", "10", "1", "20", "2", "40", "4"]),
        "OK\n"
    );
    assert_eq!(bt(&["GET", "20"]), "2\n");
    assert_eq!(bt(&["MGET", "10", "15", "40"]), "1\n\n4\n");
    assert_eq!(bt(&["SCAN", "0", "COUNT", "3"]), "31\n10\n20\n30\n");
    assert_eq!(bt(&["SCAN", "31", "COUNT", "3"]), "0\n40\n");
    assert!(bt(&["GET", "not-a-number"]).contains("decimal integers"));
    assert!(bt(&["DEL", "10"]).contains("not supported on a B-tree"));
    assert!(s.cli(&cli, &["SCAN", "0"]).contains("no key order"));
    // INFO shows a tenant its own sessions only: not the B-tree tenant's, which is connected.
    let info = s.cli(&cli, &["INFO"]);
    assert!(
        info.contains("tenant:mica") && !info.contains("btree"),
        "{info}"
    );
    // Pipelining: redis-cli --pipe writes 5,000 commands without waiting for answers.
    let mut pipe = command(&["AUTH", "mica", &s.password]);
    for i in 0..5000 {
        pipe.extend(command(&["SET", &format!("pipe:{i}"), &format!("v{i}")]));
    }
    let mut child = Command::new(&cli)
        .args(["-p", &s.resp.port().to_string(), "--pipe"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&pipe).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("errors: 0, replies: 5001"), "{text}");
    assert_eq!(s.cli(&cli, &["GET", "pipe:4999"]), "v4999\n");
    assert_eq!(
        s.cli(&cli, &["GET", "greeting"]),
        "hello\n",
        "the bad connections took nothing"
    );
    if let Some(bench) = tool("redis-benchmark") {
        let out = Command::new(bench)
            .args([
                "-p",
                &s.resp.port().to_string(),
                "--user",
                "mica",
                "-a",
                &s.password,
            ])
            .args([
                "-t", "set,get", "-n", "4000", "-c", "8", "-P", "16", "-d", "1024", "-r", "1000",
                "-q",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for t in ["SET:", "GET:"] {
            assert!(
                text.contains(t) && text.contains("requests per second"),
                "{text}"
            );
        }
        assert!(!text.to_lowercase().contains("error"), "{text}");
        let mut keys = s.cli(&cli, &["--raw", "GET", "key:000000000042"]);
        keys.pop();
        assert!(
            keys.is_empty() || keys.len() == 1024,
            "a benchmark value is 1024 bytes: {}",
            keys.len()
        );
    }
    redis_py("single", s.resp.port(), &s.password);
}

#[test]
fn three_naam_servers_are_one_redis_cluster_for_unmodified_clients_and_for_the_gateway() {
    let resp: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let udp: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let ranges = ["0-5460", "5461-10922", "10923-16383"];
    let mut file = String::new();
    for i in 0..3 {
        file.push_str(&format!(
            "[[node]]\nresp = \"127.0.0.1:{}\"\nnaam = \"127.0.0.1:{}\"\nslots = [\"{}\"]\n",
            resp[i], udp[i], ranges[i]
        ));
    }
    let k = key();
    let nodes: Vec<Server> = (0..3)
        .map(|i| Server::start(local(resp[i]), local(udp[i]), &k, Some(&file)))
        .collect();
    let n0 = &nodes[0];
    // "foo" is slot 12182: the third node's. The first redirects.
    let moved = exchange(
        n0.resp,
        &[
            command(&["AUTH", "mica", &n0.password]),
            command(&["GET", "foo"]),
        ]
        .concat(),
    )
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&moved),
        format!("+OK\r\n-MOVED 12182 127.0.0.1:{}\r\n", resp[2])
    );
    if let Some(cli) = tool("redis-cli") {
        let slots = n0.cli(&cli, &["CLUSTER", "SLOTS"]);
        for r in &resp {
            assert!(slots.contains(&r.to_string()), "{slots}");
        }
        assert!(n0
            .cli(&cli, &["CLUSTER", "NODES"])
            .contains("myself,master"));
        assert!(n0
            .cli(&cli, &["CLUSTER", "INFO"])
            .contains("cluster_state:ok"));
        // -c: redis-cli follows MOVED by itself.
        assert_eq!(n0.cli(&cli, &["-c", "SET", "foo", "bar"]), "OK\n");
        assert_eq!(nodes[1].cli(&cli, &["-c", "GET", "foo"]), "bar\n");
        assert_eq!(
            nodes[2].cli(&cli, &["GET", "foo"]),
            "bar\n",
            "stored at its slot's node"
        );
        assert!(n0.cli(&cli, &["MGET", "foo", "bar"]).contains("CROSSSLOT"));
        if let Some(bench) = tool("redis-benchmark") {
            let out = Command::new(bench)
                .args([
                    "--cluster",
                    "-p",
                    &resp[0].to_string(),
                    "--user",
                    "mica",
                    "-a",
                    &n0.password,
                ])
                .args([
                    "-t", "set,get", "-n", "3000", "-c", "6", "-P", "8", "-d", "1024", "-r",
                    "1000", "-q",
                ])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(text.contains("SET:") && text.contains("GET:"), "{text}");
        }
    }
    redis_py("cluster", resp[1], &n0.password);
    // The gateway: one standalone server to its clients, each key sent to its slot's
    // naam-server as a NAAM client (no AUTH: it runs as the tenant of its credential).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cluster.toml"), &file).unwrap();
    k.write_new(&dir.path().join("mica.key")).unwrap();
    let listen = local(free_port());
    let mut gw = gateway(
        &[
            "--listen".into(),
            listen.to_string(),
            "--cluster".into(),
            dir.path().join("cluster.toml").display().to_string(),
            "--tenant".into(),
            "mica".into(),
            "--credential".into(),
            dir.path().join("mica.key").display().to_string(),
        ],
        dir.path(),
    );
    wait_for_pong(listen, &mut gw.0, dir.path());
    let mut sets = Vec::new();
    for i in 0..60 {
        sets.extend(command(&["SET", &format!("gw:{i}"), &format!("{i}")]));
    }
    sets.extend(command(&["MGET", "gw:0", "gw:1", "gw:2", "foo", "gw:none"]));
    let r = exchange(listen, &sets).unwrap();
    let text = String::from_utf8_lossy(&r);
    assert!(text.starts_with(&"+OK\r\n".repeat(60)), "{text}");
    let foo = if tool("redis-cli").is_some() {
        "$3\r\nbar\r\n"
    } else {
        "$-1\r\n"
    };
    assert!(
        text.ends_with(&format!(
            "*5\r\n$1\r\n0\r\n$1\r\n1\r\n$1\r\n2\r\n{foo}$-1\r\n"
        )),
        "{text}"
    );
    // Each key went to its own slot's node: ask each node, authenticated, with no redirection.
    let mut held = [0; 3];
    for (n, node) in nodes.iter().enumerate() {
        let mut asked = vec![command(&["AUTH", "mica", &node.password])];
        asked.extend((0..60).map(|i| command(&["GET", &format!("gw:{i}")])));
        let answers = ask(node.resp, &asked);
        held[n] = answers[1..]
            .iter()
            .filter(|f| matches!(f, Frame::Bulk(_)))
            .count();
    }
    assert!(
        held.iter().all(|&h| h > 0) && held.iter().sum::<usize>() == 60,
        "{held:?}"
    );
    drop(gw);
}

#[test]
fn the_gateway_refuses_a_wrong_credential_at_start_and_serves_one_server_without_auth() {
    let k = key();
    let s = Server::start(local(free_port()), local(free_port()), &k, None);
    let dir = tempfile::tempdir().unwrap();
    k.write_new(&dir.path().join("mica.key")).unwrap();
    key().write_new(&dir.path().join("other.key")).unwrap();
    let listen = local(free_port());
    let args = |cred: &str| {
        vec![
            "--listen".to_string(),
            listen.to_string(),
            "--server".into(),
            s.udp.to_string(),
            "--tenant".into(),
            "mica".into(),
            "--credential".into(),
            dir.path().join(cred).display().to_string(),
        ]
    };
    let mut refused = gateway(&args("other.key"), dir.path());
    assert_eq!(refused.0.wait().unwrap().code(), Some(1));
    let log = std::fs::read_to_string(dir.path().join("naam-resp.log")).unwrap();
    assert!(log.contains("WRONGPASS"), "{log}");
    let mut gw = gateway(&args("mica.key"), dir.path());
    wait_for_pong(listen, &mut gw.0, dir.path());
    let r = exchange(
        listen,
        &[
            command(&["SET", "via", "gateway"]),
            command(&["GET", "via"]),
        ]
        .concat(),
    )
    .unwrap();
    assert_eq!(r, b"+OK\r\n$7\r\ngateway\r\n");
    // The server sees the same table.
    let r = exchange(
        s.resp,
        &[
            command(&["AUTH", "mica", &s.password]),
            command(&["GET", "via"]),
        ]
        .concat(),
    )
    .unwrap();
    assert_eq!(r, b"+OK\r\n$7\r\ngateway\r\n");
    drop(gw);
}
