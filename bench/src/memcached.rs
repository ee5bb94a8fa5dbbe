//! The memcached baseline: Debian's memcached started by the bench on a free loopback port (and
//! stopped when the run ends, even on error), and a text-protocol client that serves the YCSB
//! driver as a [`Store`]. Records are whole values: memcached cannot patch one field, so an
//! update writes the full record with one field changed, as YCSB's memcached binding does.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::driver::{run_phases, Store, StoreFactory, YcsbConfig, YcsbResult};
use crate::ycsb::key_name;

/// A memcached server on loopback, killed on drop.
pub struct MemcachedServer {
    child: Child,
    /// Its TCP port on 127.0.0.1.
    pub port: u16,
}

impl MemcachedServer {
    /// Starts `memcached` with `threads` worker threads and `memory_mb` of cache on a free
    /// loopback port, and waits until it accepts connections.
    pub fn start(threads: usize, memory_mb: usize) -> anyhow::Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .context("finding a free loopback port")?
            .local_addr()?
            .port();
        let mut cmd = Command::new("memcached");
        cmd.args([
            "-l",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "0",
            "-c",
            "1024",
        ])
        .args(["-t", &threads.to_string(), "-m", &memory_mb.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        // memcached refuses to run as root unless told which user to become.
        #[cfg(unix)]
        if running_as_root() {
            cmd.args(["-u", "root"]);
        }
        let child = cmd
            .spawn()
            .context("starting memcached (scripts/setup.sh installs Debian's memcached)")?;
        let mut server = MemcachedServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                let mut err = String::new();
                if let Some(mut e) = server.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                bail!("memcached exited ({status}): {}", err.trim());
            }
            if Instant::now() > deadline {
                bail!("memcached did not accept connections on 127.0.0.1:{port} within 5 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn running_as_root() -> bool {
    std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || std::fs::read_to_string("/proc/self/status")
            .map(|s| {
                s.lines()
                    .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
            })
            .unwrap_or(false)
}

impl Drop for MemcachedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A memcached text-protocol client.
pub struct MemcachedClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl MemcachedClient {
    /// Connects to 127.0.0.1:`port`.
    pub fn connect(port: u16) -> anyhow::Result<Self> {
        let s = TcpStream::connect(("127.0.0.1", port))
            .with_context(|| format!("connecting to memcached on port {port}"))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(MemcachedClient {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
            line: String::new(),
        })
    }

    fn read_line(&mut self) -> anyhow::Result<&str> {
        self.line.clear();
        if self.reader.read_line(&mut self.line)? == 0 {
            bail!("memcached closed the connection");
        }
        Ok(self.line.trim_end())
    }

    /// `get`: the value, if present.
    pub fn get(&mut self, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
        write!(self.writer, "get {key}\r\n")?;
        let header = self.read_line()?.to_string();
        if header == "END" {
            return Ok(None);
        }
        let len: usize = header
            .strip_prefix("VALUE ")
            .and_then(|h| h.split_whitespace().nth(2))
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("unexpected memcached reply `{header}`"))?;
        let mut value = vec![0u8; len + 2];
        self.reader.read_exact(&mut value)?;
        value.truncate(len);
        let end = self.read_line()?;
        if end != "END" {
            bail!("unexpected memcached reply `{end}` after a value");
        }
        Ok(Some(value))
    }

    /// `set`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        write!(self.writer, "set {key} 0 0 {}\r\n", value.len())?;
        self.writer.write_all(value)?;
        self.writer.write_all(b"\r\n")?;
        let r = self.read_line()?;
        if r != "STORED" {
            bail!("memcached refused a set: `{r}`");
        }
        Ok(())
    }
}

struct MemcachedStore {
    c: MemcachedClient,
    field_length: usize,
    record_len: usize,
}

impl Store for MemcachedStore {
    fn read(&mut self, n: u64) -> anyhow::Result<bool> {
        Ok(self.c.get(&key_name(n))?.is_some())
    }
    fn update(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        // The whole record, with the field changed (no patching in memcached).
        let mut record = vec![b'x'; self.record_len];
        let at = field * self.field_length;
        record[at..at + bytes.len()].copy_from_slice(bytes);
        self.c.set(&key_name(n), &record)
    }
    fn insert(&mut self, n: u64, record: &[u8]) -> anyhow::Result<()> {
        self.c.set(&key_name(n), record)
    }
    fn scan(&mut self, _: u64, _: usize) -> anyhow::Result<usize> {
        bail!("memcached has no scans")
    }
    fn rmw(&mut self, n: u64, field: usize, bytes: &[u8]) -> anyhow::Result<()> {
        let key = key_name(n);
        let mut record = self
            .c
            .get(&key)?
            .unwrap_or_else(|| vec![b'x'; self.record_len]);
        let at = (field * self.field_length).min(record.len());
        let end = (at + bytes.len()).min(record.len());
        record[at..end].copy_from_slice(&bytes[..end - at]);
        self.c.set(&key, &record)
    }
}

/// Mode label of memcached runs.
pub const MEMCACHED_MODE: &str = "memcached (Debian's server on loopback TCP, same YCSB driver)";

/// Runs `cfg` against a fresh memcached with `server_threads` worker threads.
pub fn run_memcached(
    cfg: &YcsbConfig,
    server_threads: usize,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> anyhow::Result<YcsbResult> {
    if cfg.workload.has_scans() {
        bail!(
            "memcached has no scans: workload {} is not comparable",
            cfg.workload.name
        );
    }
    let record_bytes = (cfg.records + cfg.ops) as usize * (cfg.shape.len() + 100);
    let server = MemcachedServer::start(server_threads, (record_bytes / (1 << 20) + 64).max(64))?;
    let port = server.port;
    let (fl, rl) = (cfg.shape.field_length, cfg.shape.len());
    let make: StoreFactory = Arc::new(move || {
        Ok(Box::new(MemcachedStore {
            c: MemcachedClient::connect(port)?,
            field_length: fl,
            record_len: rl,
        }) as Box<dyn Store + Send>)
    });
    let result = run_phases(cfg, make, None, progress, MEMCACHED_MODE);
    drop(server);
    result
}
