//! Two-tenant deployments for the security and fairness tests, in two forms that the same test
//! bodies drive: the UDP fabric's driver loops on threads of the test process, and the real
//! `naam-server` and `naam-nic` binaries as child processes on loopback, configured from files
//! as an operator would (credential files, a TOML config, `naam-nic run --pairing`).
//!
//! Tenant `a` owns app [`A`], tenant `b` app [`B`]; both are the example handlers with a
//! read-only `sorted` region and an all-rights `data` region, and clients may write them
//! one-sided (so that refusing another tenant's writes is a real test). The processes zero
//! their regions (as `kind = "object"` apps do); the threads start them with contents.

use naam_runtime::CredentialFile as _;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use naam_proto::session::Credential;
use naam_runtime::cluster::ClusterConfig;

use super::Driver;

/// Tenant `a`'s app.
pub(crate) const A: u32 = 1;
/// Tenant `b`'s app.
pub(crate) const B: u32 = 2;

/// Tenant `a`'s credential.
pub(crate) fn key_a() -> Credential {
    Credential::from_bytes([0xa1; 32])
}

/// Tenant `b`'s credential.
pub(crate) fn key_b() -> Credential {
    Credential::from_bytes([0xb2; 32])
}

fn tenants() -> [(u32, String, Credential); 2] {
    [(A, "a".to_string(), key_a()), (B, "b".to_string(), key_b())]
}

/// A running deployment of tenants `a` and `b`: a server and its paired NIC.
pub(crate) enum Deployment {
    /// The driver loops on threads of this process.
    Threads {
        /// Regions and manifest.
        shm: tempfile::TempDir,
        /// naam-server's loop.
        host: Option<Driver>,
        /// naam-nic's loop.
        nic: Driver,
        /// The server's address (kept across restarts).
        server: SocketAddr,
    },
    /// `naam-server` and `naam-nic` processes.
    Processes(Processes),
}

/// The child processes of a [`Deployment::Processes`]; killed when dropped.
pub(crate) struct Processes {
    dir: tempfile::TempDir,
    bin: PathBuf,
    server: Child,
    nic: Child,
    server_addr: SocketAddr,
    nic_addr: SocketAddr,
    server_metrics: SocketAddr,
    nic_metrics: SocketAddr,
}

impl Deployment {
    /// The driver loops on threads.
    pub(crate) fn threads() -> Deployment {
        let shm = tempfile::tempdir().expect("tempdir");
        let host = host_threads(shm.path(), "127.0.0.1:0".parse().expect("literal"));
        let server = host.addr;
        let nic = super::udp_nic(shm.path(), server);
        Deployment::Threads {
            shm,
            host: Some(host),
            nic,
            server,
        }
    }

    /// The real binaries, or `None` (with the reason on stderr) when they have not been built
    /// and this is not CI (`scripts/test.sh` builds them before testing; CI must run these).
    pub(crate) fn processes(test: &str) -> Option<Deployment> {
        Deployment::processes_from(test, binaries())
    }

    /// [`Deployment::processes`] with the release binaries when they are built (as deployed:
    /// a measurement of the server's scheduling, not of an unoptimised build), else those of
    /// the test's own profile.
    pub(crate) fn processes_as_deployed(test: &str) -> Option<Deployment> {
        let release = binaries().ok().and_then(|dir| {
            let target = dir.parent()?.join("release");
            ["naam-server", "naam-nic"]
                .iter()
                .all(|b| target.join(b).is_file())
                .then_some(target)
        });
        match release {
            Some(dir) => Deployment::processes_from(test, Ok(dir)),
            None => Deployment::processes(test),
        }
    }

    fn processes_from(test: &str, bin: Result<PathBuf, String>) -> Option<Deployment> {
        let bin = match bin {
            Ok(bin) => bin,
            Err(why) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "CI must run {test} against real processes, but: {why}"
                );
                eprintln!("SKIPPED {test} against processes: {why}");
                return None;
            }
        };
        // The ports are free when picked, not reserved: another test's socket may take one
        // before the process binds it. That start is given up and tried on other ports.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match Deployment::start_processes(&bin) {
                Ok(p) => return Some(Deployment::Processes(p)),
                Err(why) if attempts < 3 => eprintln!("{test}: starting again: {why}"),
                Err(why) => panic!("{test}: the processes did not start: {why}"),
            }
        }
    }

    /// naam-server and naam-nic on ports free a moment ago, serving; `Err` when one of them
    /// exited because its port was taken in the meantime.
    fn start_processes(bin: &Path) -> Result<Processes, String> {
        let bin = bin.to_path_buf();
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        for (name, key) in [
            ("a.key", key_a()),
            ("b.key", key_b()),
            ("nic.key", super::pairing_key()),
            ("operator.key", super::operator_key()),
        ] {
            key.write_new(&d.join(name)).expect("credential file");
        }
        let object = &super::examples().0;
        let handlers = "handlers = [{ name = \"bsearch\" }, { name = \"two_step\" }, \
                        { name = \"add\" }, { name = \"vget\" }, \
                        { name = \"counter_add\", write = true }, { name = \"store\", write = true }]\n\
                        regions = [{ name = \"sorted\", size = 4096, access = \"r\" }, \
                        { name = \"data\", size = 64, access = \"rwa\" }]\n";
        let server_addr = free_loopback_port();
        // Compiled code is kept in `code-cache` across restarts; tenant a's handlers are
        // tiered (the interpreter until the JIT's code is ready), b's on the JIT.
        let mut config = format!(
            "listen = \"{server_addr}\"\nnic_pairing = \"nic.key\"\n\
             operator_credential = \"operator.key\"\ncode_cache = \"code-cache\"\n"
        );
        for (id, tenant, _) in tenants() {
            let engine = if tenant == "a" { "tiered" } else { "jit" };
            config.push_str(&format!(
                "[[app]]\nkind = \"object\"\nid = {id}\nname = \"{tenant}\"\n\
                 credential = \"{tenant}.key\"\nclient_writes = true\nengine = \"{engine}\"\n\
                 object = \"{}\"\n{handlers}",
                object.display()
            ));
        }
        // Tenants may deploy into their own apps (tests/deploys.rs), up to 8 handlers each.
        // Tenants may create two apps each, of 64 KiB of regions together (tests/deploys.rs).
        config.push_str("[deploy]\nmax_handlers = 8\nmax_apps = 2\nmax_region_bytes = 65536\n");
        std::fs::write(d.join("naam-server.toml"), config).expect("config");
        let nic_addr = free_loopback_port();
        let (server_metrics, nic_metrics) = (free_tcp_port(), free_tcp_port());
        let server = spawn_server(&bin, d, server_metrics);
        let nic = Command::new(bin.join("naam-nic"))
            .args(["run", "--server", &server_addr.to_string()])
            .args(["--metrics", &nic_metrics.to_string()])
            .args(["--listen", &nic_addr.to_string(), "--no-cost-model"])
            .arg("--shm-dir")
            .arg(d.join("shm"))
            .arg("--pairing")
            .arg(d.join("nic.key"))
            .stdout(Stdio::null())
            .stderr(log(d, "naam-nic.log"))
            .spawn()
            .expect("naam-nic starts");
        let mut p = Processes {
            dir,
            bin,
            server,
            nic,
            server_addr,
            nic_addr,
            server_metrics,
            nic_metrics,
        };
        p.wait_until_serving().map(|()| p)
    }

    /// naam-server's address.
    pub(crate) fn server(&self) -> SocketAddr {
        match self {
            Deployment::Threads { server, .. } => *server,
            Deployment::Processes(p) => p.server_addr,
        }
    }

    /// The processes' directory (config, credentials, logs, `code-cache`; processes only).
    pub(crate) fn dir(&self) -> Option<&Path> {
        match self {
            Deployment::Threads { .. } => None,
            Deployment::Processes(p) => Some(p.dir.path()),
        }
    }

    /// The `--metrics` addresses of naam-server and naam-nic (processes only).
    pub(crate) fn metrics(&self) -> Option<(SocketAddr, SocketAddr)> {
        match self {
            Deployment::Threads { .. } => None,
            Deployment::Processes(p) => Some((p.server_metrics, p.nic_metrics)),
        }
    }

    /// naam-nic's address.
    pub(crate) fn nic(&self) -> SocketAddr {
        match self {
            Deployment::Threads { nic, .. } => nic.addr,
            Deployment::Processes(p) => p.nic_addr,
        }
    }

    /// Stops the server abruptly (the process with SIGKILL) and starts a new one on the same
    /// address and regions directory, without waiting for it to serve; the NIC keeps running.
    pub(crate) fn restart_server(&mut self) {
        match self {
            Deployment::Threads {
                shm, host, server, ..
            } => {
                if let Some(mut h) = host.take() {
                    h.stop();
                }
                *host = Some(host_threads(shm.path(), *server));
            }
            Deployment::Processes(p) => {
                let _ = p.server.kill();
                let _ = p.server.wait();
                p.server = spawn_server(&p.bin, p.dir.path(), p.server_metrics);
            }
        }
    }
}

impl Processes {
    /// Waits until the server answers a session handshake (it has loaded its apps), then
    /// until naam-nic has paired and reported (the weights name its agent), so a test's first
    /// call pinned to the NIC does not meet a NIC still pairing.
    /// `Err` when a process exited because an address it was given was taken (see
    /// [`Deployment::start_processes`]).
    fn wait_until_serving(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.exited_on_a_taken_port()?;
            let mut cfg = naam_runtime::udp::UdpConfig::new(self.server_addr, "a", key_a());
            cfg.rto = Duration::from_millis(50);
            if let Ok(mut c) = naam_runtime::udp::UdpClient::connect(&cfg) {
                // The weights carry the NIC's agent once the server counts the NIC as up. They
                // are asked for directly: a call would run a handler and show in the metrics
                // the tests check.
                let query = naam_proto::control::Control::QueryWeights {
                    app: A,
                    client: None,
                    rtt_ns: None,
                };
                loop {
                    if let Ok(naam_proto::control::Control::Weights { agent: Some(_), .. }) =
                        c.control(&query)
                    {
                        return Ok(());
                    }
                    self.exited_on_a_taken_port()?;
                    assert!(
                        Instant::now() < deadline,
                        "naam-nic did not pair within 30 s:\n{}",
                        std::fs::read_to_string(self.dir.path().join("naam-nic.log"))
                            .unwrap_or_default()
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            assert!(
                Instant::now() < deadline,
                "naam-server did not start serving within 30 s:\n{}",
                std::fs::read_to_string(self.dir.path().join("naam-server.log"))
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Processes {
    /// `Err` with its log when naam-server or naam-nic has exited saying an address was in
    /// use; any other exit is left to the caller's deadline, whose message shows the logs.
    fn exited_on_a_taken_port(&mut self) -> Result<(), String> {
        for (child, name) in [
            (&mut self.server, "naam-server"),
            (&mut self.nic, "naam-nic"),
        ] {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
                    .unwrap_or_default();
                if log.to_lowercase().contains("in use") {
                    return Err(format!("{name} exited ({status}):\n{log}"));
                }
            }
        }
        Ok(())
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for f in ["naam-server.log", "naam-nic.log"] {
                let text = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
                eprintln!("--- {f}\n{text}");
            }
        }
        for c in [&mut self.server, &mut self.nic] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// naam-server's loop for both tenants on `at`.
fn host_threads(shm: &Path, at: SocketAddr) -> Driver {
    super::udp_host_tenants(
        shm,
        at,
        &tenants(),
        ClusterConfig::functional(),
        false,
        true,
        |_| None,
    )
}

/// Where `naam-server` and `naam-nic` are: beside the test binary's directory (cargo puts test
/// binaries in `target/<profile>/deps` and binaries in `target/<profile>`).
fn binaries() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("the test binary has no parent directory")?
        .to_path_buf();
    for b in ["naam-server", "naam-nic"] {
        if !dir.join(b).is_file() {
            return Err(format!(
                "no {b} in {} (run `cargo build --workspace --bins` first)",
                dir.display()
            ));
        }
    }
    Ok(dir)
}

fn spawn_server(bin: &Path, dir: &Path, metrics: SocketAddr) -> Child {
    Command::new(bin.join("naam-server"))
        .args(["--metrics", &metrics.to_string()])
        .arg("--config")
        .arg(dir.join("naam-server.toml"))
        .arg("--shm-dir")
        .arg(dir.join("shm"))
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(log(dir, "naam-server.log"))
        .spawn()
        .expect("naam-server starts")
}

/// Appends to `dir/name` (a restarted server keeps its predecessor's log).
fn log(dir: &Path, name: &str) -> Stdio {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .expect("log file")
        .into()
}

/// A loopback TCP port free a moment ago (for `--metrics`), never handed out before in this
/// process.
fn free_tcp_port() -> SocketAddr {
    unused_port(|| std::net::TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr()))
}

/// A loopback UDP port free a moment ago, never handed out before in this process.
fn free_loopback_port() -> SocketAddr {
    unused_port(|| UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()))
}

/// An address `pick` finds free whose port this process has not handed out yet. The kernel
/// may give a port closed a moment ago to the next bind, and the servers' receive loops bind
/// with `SO_REUSEPORT`: two deployments of parallel tests given one port would both bind it
/// and share its datagrams.
fn unused_port(pick: impl Fn() -> std::io::Result<SocketAddr>) -> SocketAddr {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let a = pick().expect("a free loopback port");
        let mut used = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
        if !used.contains(&a.port()) {
            used.push(a.port());
            return a;
        }
    }
}
