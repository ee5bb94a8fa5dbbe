//! naam-server operated as an operator would, with real processes. Nothing lost across its
//! restarts:
//! a `kill -9` and a restart under running verifiers (MICA and the B-tree) loses no
//! acknowledged write; a clean stop keeps the regions for the next start; a config of another
//! layout is refused until `--reset-regions`; a second server on the same `shm_dir` is refused
//! naming the first one's pid and deletes nothing; a start that fails leaves nothing behind.
//! And its logs: what `-v` and `RUST_LOG` show of a session and a call.
//! The binaries are the workspace's (`cargo build --workspace --bins`, as scripts/test.sh
//! does first).

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_naam-bench"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let b = dir.join(name);
    assert!(
        b.is_file(),
        "no {} (run `cargo build --workspace --bins` first)",
        b.display()
    );
    b
}

fn free_port() -> String {
    let s = UdpSocket::bind("127.0.0.1:0").expect("free port");
    s.local_addr().expect("addr").to_string()
}

/// A working directory with the tenants' keys and a config serving MICA (app 1) and a
/// B-tree (app 2) from `shm`.
struct Site {
    dir: tempfile::TempDir,
    addr: String,
}

impl Site {
    fn new(mica_items: u64) -> Site {
        let dir = tempfile::tempdir().expect("tempdir");
        let site = Site {
            dir,
            addr: free_port(),
        };
        for t in ["mica", "btree", "naam-nic"] {
            let out = site.run(
                "naam-server",
                &["keygen", "--out", &format!("keys/{t}.key")],
            );
            assert!(out.status.success(), "{}", text(&out.stderr));
        }
        site.config(mica_items);
        site
    }

    fn config(&self, mica_items: u64) {
        std::fs::write(
            self.path("naam-server.toml"),
            format!(
                "listen = \"{}\"\nshm_dir = \"shm\"\nnic_pairing = \"keys/naam-nic.key\"\n\n[[app]]\nkind = \"mica\"\nid = 1\n\
                 credential = \"keys/mica.key\"\nitems = {mica_items}\nvalue_cap = 128\n\n\
                 [[app]]\nkind = \"btree\"\nid = 2\ncredential = \"keys/btree.key\"\n\
                 keys = 5000\n",
                self.addr
            ),
        )
        .expect("config");
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn command(&self, name: &str, args: &[&str]) -> Command {
        let mut c = Command::new(bin(name));
        c.args(args).current_dir(self.dir.path());
        c
    }

    fn run(&self, name: &str, args: &[&str]) -> Output {
        self.command(name, args).output().expect("runs")
    }

    /// naam-server started on the config (extra `args`), its log appended to `server.log`.
    fn start(&self, args: &[&str]) -> Server {
        self.start_with_env(args, &[])
    }

    /// [`Site::start`] with environment variables `env`.
    fn start_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("server.log"))
            .expect("log");
        let mut command = self.command(
            "naam-server",
            &[&["--config", "naam-server.toml"], args].concat(),
        );
        // The test's own RUST_LOG would override the flags under test.
        command.env_remove("RUST_LOG").envs(env.iter().copied());
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("naam-server starts");
        Server(Some(child))
    }

    /// naam-nic paired with the site's server, mapping its regions, its log in `nic.log`.
    fn start_nic(&self) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("nic.log"))
            .expect("log");
        let mut command = self.command(
            "naam-nic",
            &[
                "run",
                "--server",
                &self.addr,
                "--listen",
                &free_port(),
                "--pairing",
                "keys/naam-nic.key",
                "--no-cost-model",
            ],
        );
        command
            .arg("--shm-dir")
            .arg(self.path("shm"))
            .env_remove("RUST_LOG");
        Server(Some(
            command
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("naam-nic starts"),
        ))
    }

    /// Waits until `app`'s verifier gets an answer (the server has loaded and serves).
    fn wait_serving(&self, server: &mut Server) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = self.verify("mica", 1, 1);
            if out.status.success() {
                return;
            }
            if let Some(Ok(Some(status))) = server.0.as_mut().map(Child::try_wait) {
                panic!("naam-server exited {status}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "naam-server did not serve within 60 s:\n{}\n{}",
                text(&out.stderr),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn verify_command(&self, app: &str, seconds: u64, ops: u64) -> Command {
        self.verify_at(app, "host", seconds, ops)
    }

    /// A verifier whose reads run at `placement`.
    fn verify_at(&self, app: &str, placement: &str, seconds: u64, ops: u64) -> Command {
        let mut c = self.command(
            "naam-bench",
            &[
                "verify",
                "--app",
                app,
                "--server",
                &self.addr,
                "--placement",
                placement,
                "--threads",
                "2",
                "--ops",
                &ops.to_string(),
                "--seconds",
                &seconds.to_string(),
                "--max-errors",
                "1000",
            ],
        );
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }

    fn verify(&self, app: &str, seconds: u64, ops: u64) -> Output {
        self.verify_command(app, seconds, ops)
            .output()
            .expect("verify runs")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("server.log")).unwrap_or_default()
    }

    fn shm_entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.path("shm"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// Starts naam-server on a config of MICA (app 1, whose regions are made first) and an
/// object app serving `handler` of `object`, which must fail: exit 2 and no `shm` left.
/// Returns its stderr.
fn refused_after_mica(site: &Site, object: &str, handler: &str) -> String {
    std::fs::write(
        site.path("naam-server.toml"),
        format!(
            "listen = \"{}\"\nshm_dir = \"shm\"\n\n[[app]]\nkind = \"mica\"\nid = 1\n\
             credential = \"keys/mica.key\"\nitems = 2000\n\n[[app]]\nkind = \"object\"\n\
             id = 3\nname = \"x\"\ncredential = \"keys/btree.key\"\nobject = \"{object}\"\n\
             handlers = [{{ name = \"{handler}\" }}]\n\
             regions = [{{ name = \"r\", size = 64, access = \"r\" }}]\n",
            site.addr
        ),
    )
    .expect("config");
    let out = site.run("naam-server", &["--config", "naam-server.toml"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!site.path("shm").exists(), "{:?}", site.shm_entries());
    err
}

/// An eBPF object whose one handler, `legacy`, the verifier refuses: a legacy packet load
/// (`ldabsw`), which no NAAM handler may use.
fn legacy_object() -> Vec<u8> {
    use object::write::{Object, Symbol, SymbolSection};
    use object::{Architecture, BinaryFormat, Endianness, SectionKind, SymbolFlags, SymbolKind};
    let code = [
        0xb7u8, 0, 0, 0, 0, 0, 0, 0, // r0 = 0
        0x20, 0, 0, 0, 0, 0, 0, 0, // ldabsw 0
        0x95, 0, 0, 0, 0, 0, 0, 0, // exit
    ];
    let mut obj = Object::new(BinaryFormat::Elf, Architecture::Bpf, Endianness::Little);
    let id = obj.add_section(Vec::new(), b"naam/legacy".to_vec(), SectionKind::Text);
    obj.append_section_data(id, &code, 8);
    obj.add_symbol(Symbol {
        name: b"legacy".to_vec(),
        value: 0,
        size: code.len() as u64,
        kind: SymbolKind::Text,
        scope: object::SymbolScope::Dynamic,
        weak: false,
        section: SymbolSection::Section(id),
        flags: SymbolFlags::None,
    });
    obj.write().expect("an ELF object")
}

/// A running naam-server, killed when dropped.
struct Server(Option<Child>);

impl Server {
    fn kill9(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then its exit status.
    fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.0.take().expect("running");
        // SAFETY: signalling a child we started and have not reaped.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        c.wait().expect("exits")
    }

    fn pid(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A verify run's result, asserting it lost nothing and read nothing wrong.
fn lost_nothing(out: &Output, what: &str, log: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: no result ({e}): {}\n{}\n{log}",
            text(&out.stdout),
            text(&out.stderr)
        )
    });
    let r = &v["result"];
    assert_eq!(
        (r["wrong"].as_u64(), r["misses"].as_u64()),
        (Some(0), Some(0)),
        "{what}: {v}\n{log}"
    );
    assert!(r["ops"].as_u64() > Some(100), "{what}: {v}");
    v
}

#[test]
fn kill_9_and_restart_under_running_verifiers_lose_no_acknowledged_write() {
    let site = Site::new(2000);
    let mut server = site.start(&[]);
    site.wait_serving(&mut server);
    let _nic = site.start_nic();
    // MICA's reads at naam-nic once it has paired.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !site
        .verify_at("mica", "nic", 1, 50)
        .output()
        .expect("verify")
        .status
        .success()
    {
        assert!(
            Instant::now() < deadline,
            "naam-nic did not pair:\n{}",
            site.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Both verifiers write and read their own keys for 8 s (MICA's reads at naam-nic, which
    // keeps running); the server dies 2.5 s in and is back a moment later over the same
    // regions, which naam-nic maps again.
    let mica = site
        .verify_at("mica", "nic", 8, 1_000_000)
        .spawn()
        .expect("verify");
    let btree = site
        .verify_command("btree", 8, 1_000_000)
        .spawn()
        .expect("verify");
    std::thread::sleep(Duration::from_millis(2500));
    server.kill9();
    let mut server = site.start(&[]);
    let (mica, btree) = (
        mica.wait_with_output().expect("verify ends"),
        btree.wait_with_output().expect("verify ends"),
    );
    let log = site.log();
    let m = lost_nothing(&mica, "MICA across kill -9", &log);
    assert!(
        m["result"]["placement_fractions"][1].as_f64() > Some(0.1),
        "MICA's reads ran at naam-nic: {m}"
    );
    lost_nothing(&btree, "B-tree across kill -9", &log);
    assert!(
        log.contains("re-attached the regions") && log.contains("did not stop cleanly"),
        "{log}"
    );

    // A clean stop keeps the regions (header marked stopped) and removes the rest; the next
    // start takes them up again, under a verifier again.
    let verifier = site
        .verify_command("mica", 6, 1_000_000)
        .spawn()
        .expect("verify");
    std::thread::sleep(Duration::from_millis(2000));
    assert!(server.stop().success(), "{}", site.log());
    let kept = site.shm_entries();
    assert!(kept.contains(&"regions.json".to_string()), "{kept:?}");
    assert!(
        !kept
            .iter()
            .any(|f| f == "manifest.json" || f.starts_with('.')),
        "{kept:?}"
    );
    let header = std::fs::read_to_string(site.path("shm/regions.json")).expect("header");
    assert!(header.contains("\"stopped\""), "{header}");
    let mut server = site.start(&[]);
    lost_nothing(
        &verifier.wait_with_output().expect("verify ends"),
        "MICA across a clean restart",
        &site.log(),
    );
    assert!(
        site.log().contains("the last server stopped cleanly"),
        "{}",
        site.log()
    );

    // Another server on the same directory is refused, naming the first one, and removes
    // nothing of it.
    let before = site.shm_entries();
    let other = site
        .command(
            "naam-server",
            &["--config", "naam-server.toml", "--listen", &free_port()],
        )
        .output()
        .expect("runs");
    let err = text(&other.stderr);
    assert_eq!(other.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("pid {}", server.pid())) && err.contains("shm_dir"),
        "{err}"
    );
    assert_eq!(site.shm_entries(), before);
    site.wait_serving(&mut server);
    server.kill9();

    // A config of another layout is refused, the regions left as they are, until
    // --reset-regions discards them.
    site.config(4000);
    let refused = site.run("naam-server", &["--config", "naam-server.toml"]);
    let err = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(
        err.contains("another layout") && err.contains("--reset-regions"),
        "{err}"
    );
    let mut server = site.start(&["--reset-regions"]);
    site.wait_serving(&mut server);
    assert!(
        site.log().contains("--reset-regions: discarded"),
        "{}",
        site.log()
    );
}

#[test]
fn a_start_that_fails_leaves_nothing_behind() {
    // A --metrics port in use (bound before any region is made).
    let site = Site::new(2000);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let port = taken.local_addr().expect("addr").to_string();
    let out = site.run(
        "naam-server",
        &["--config", "naam-server.toml", "--metrics", &port],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(!site.path("shm").exists(), "{:?}", site.shm_entries());

    // An unknown handler in the second app: the first app's regions were made, and go.
    std::fs::write(site.path("mica.o"), naam_mica::HANDLERS_OBJECT).expect("object");
    let err = refused_after_mica(&site, "mica.o", "no_such_handler");
    assert!(err.contains("no_such_handler"), "{err}");

    // A handler the verifier refuses (a legacy packet load), after MICA's regions were made.
    std::fs::write(site.path("legacy.o"), legacy_object()).expect("object");
    let err = refused_after_mica(&site, "legacy.o", "legacy");
    assert!(err.contains("legacy"), "{err}");

    // A directory someone else made keeps what is theirs.
    std::fs::create_dir(site.path("shm")).expect("dir");
    std::fs::write(site.path("shm/notes.txt"), b"mine").expect("file");
    let out = site.run("naam-server", &["--config", "naam-server.toml"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert_eq!(site.shm_entries(), ["notes.txt"]);
}

/// MICA's client for `site`'s server, pinned at the host.
fn mica_client(site: &Site) -> naam_mica::MicaClient<naam_runtime::udp::UdpClient> {
    naam_bench::udp_client::set_dir(site.path("keys"));
    let addr = site.addr.parse().expect("address");
    let setup = naam_bench::driver::UdpSetup::new(
        naam_bench::driver::App::Mica,
        addr,
        Some(naam_runtime::proto::Placement::Host),
    )
    .expect("the server answers");
    naam_mica::MicaClient::new(
        setup.connect().expect("a session"),
        setup.mica().expect("MICA"),
    )
}

#[test]
fn a_snapshot_of_a_stopped_server_starts_another_with_the_same_data() {
    let site = Site::new(2000);
    let mut server = site.start(&[]);
    site.wait_serving(&mut server);
    let mut m = mica_client(&site);
    for i in 0..200u32 {
        m.put(format!("key{i}").as_bytes(), &i.to_le_bytes().repeat(8))
            .expect("put");
    }
    drop(m);
    // Not while the server runs over the directory.
    let busy = site.run(
        "naam-server",
        &["snapshot", "--config", "naam-server.toml", "--out", "busy"],
    );
    assert_eq!(busy.status.code(), Some(2), "{}", text(&busy.stderr));
    assert!(text(&busy.stderr).contains("in use by another naam-server"));
    assert!(server.stop().success(), "{}", site.log());
    let snap = site.path("snap");
    let taken = site.run(
        "naam-server",
        &["snapshot", "--config", "naam-server.toml", "--out"],
    );
    assert_eq!(taken.status.code(), Some(2), "--out is required");
    let taken = site
        .command(
            "naam-server",
            &["snapshot", "--config", "naam-server.toml", "--out"],
        )
        .arg(&snap)
        .output()
        .expect("runs");
    assert!(taken.status.success(), "{}", text(&taken.stderr));

    // Another site (its own directory and port, the same config otherwise) starts from it.
    let other = Site::new(2000);
    for t in ["mica", "btree"] {
        std::fs::copy(
            site.path(&format!("keys/{t}.key")),
            other.path(&format!("keys/{t}.key")),
        )
        .expect("the tenants' keys travel with their data");
    }
    let from = snap.to_string_lossy().into_owned();
    let mut moved = other.start(&["--from-snapshot", &from]);
    other.wait_serving(&mut moved);
    assert!(
        other.log().contains("re-attached the regions"),
        "{}",
        other.log()
    );
    let mut m = mica_client(&other);
    for i in 0..200u32 {
        let got = m.get(format!("key{i}").as_bytes()).expect("get");
        assert_eq!(got, Some(i.to_le_bytes().repeat(8)), "key{i}");
    }
    drop(m);
    moved.kill9();
    // Not over regions that are there already.
    let again = other.run(
        "naam-server",
        &["--config", "naam-server.toml", "--from-snapshot", &from],
    );
    assert_eq!(again.status.code(), Some(2), "{}", text(&again.stderr));
    assert!(text(&again.stderr).contains("holds regions already"));
}

#[test]
fn debug_logs_show_a_session_and_its_calls() {
    // -vvv: sessions at debug, each answer at trace.
    let site = Site::new(2000);
    let mut server = site.start(&["-vvv"]);
    site.wait_serving(&mut server);
    let out = site.verify("mica", 5, 200);
    lost_nothing(&out, "a verify run", &site.log());
    server.stop();
    let log = site.log();
    for needle in [
        "epoch 0x",
        "session opened",
        "role=\"mica\"",
        "answered",
        "status=\"ok\"",
        "placement=\"host\"",
    ] {
        assert!(log.contains(needle), "no {needle:?} in:\n{log}");
    }
    // A filter for one module keeps everything else at the default: INFO lines stay.
    let site = Site::new(2000);
    let mut server = site.start_with_env(&[], &[("RUST_LOG", "naam_runtime=debug")]);
    site.wait_serving(&mut server);
    server.stop();
    let log = site.log();
    assert!(log.contains("INFO") && log.contains("serving"), "{log}");
}
