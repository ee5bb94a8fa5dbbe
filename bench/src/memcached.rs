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

use crate::driver::{run_phases, YcsbConfig, YcsbResult};
use crate::phase::{PipedStore, Store, StoreFactory, StoreOp};
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
        self.read_value()
    }

    /// The answer to one `get`: the value, or `None` for a miss.
    fn read_value(&mut self) -> anyhow::Result<Option<Vec<u8>>> {
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
    /// With `--pipeline`: commands written and not yet answered, in order (memcached answers
    /// a connection's commands in the order they came).
    piped: std::collections::VecDeque<Piped>,
    /// Commands not yet written: they go out together, in one write.
    out: Vec<u8>,
    /// Operations finished while another's answer was read, to hand back.
    ready: Vec<(u64, anyhow::Result<bool>)>,
}

/// A pipelined command waiting for its answer.
enum Piped {
    /// A read (`get`): tagged; a read-modify-write's read carries the write to make after it.
    Get(u64, Option<(String, usize, Vec<u8>)>),
    /// A write (`set`), tagged.
    Set(u64),
}

impl MemcachedStore {
    fn new(c: MemcachedClient, field_length: usize, record_len: usize) -> Self {
        MemcachedStore {
            c,
            field_length,
            record_len,
            piped: std::collections::VecDeque::new(),
            out: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// The whole record with `bytes` over field `field` of `record` (or of a blank record).
    fn patched(&self, record: Option<&[u8]>, field: usize, bytes: &[u8]) -> Vec<u8> {
        let mut r = record.map_or_else(|| vec![b'x'; self.record_len], <[u8]>::to_vec);
        let at = (field * self.field_length).min(r.len());
        let end = (at + bytes.len()).min(r.len());
        r[at..end].copy_from_slice(&bytes[..end - at]);
        r
    }

    fn queue_get(&mut self, key: &str) {
        self.out.extend_from_slice(b"get ");
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\r\n");
    }

    fn queue_set(&mut self, key: &str, value: &[u8]) {
        self.out
            .extend_from_slice(format!("set {key} 0 0 {}\r\n", value.len()).as_bytes());
        self.out.extend_from_slice(value);
        self.out.extend_from_slice(b"\r\n");
    }

    /// Reads one answer (blocking) and finishes its command.
    fn read_one(&mut self) -> anyhow::Result<()> {
        let Some(cmd) = self.piped.pop_front() else {
            return Ok(());
        };
        match cmd {
            Piped::Set(tag) => {
                let r = self.c.read_line()?.to_string();
                let ok = if r == "STORED" {
                    Ok(true)
                } else {
                    Err(anyhow::anyhow!("memcached refused a set: `{r}`"))
                };
                self.ready.push((tag, ok));
            }
            Piped::Get(tag, rmw) => {
                let value = self.c.read_value()?;
                match rmw {
                    Some((key, field, bytes)) => {
                        let record = self.patched(value.as_deref(), field, &bytes);
                        self.queue_set(&key, &record);
                        self.piped.push_back(Piped::Set(tag));
                    }
                    None => self.ready.push((tag, Ok(value.is_some()))),
                }
            }
        }
        Ok(())
    }
}

impl PipedStore for MemcachedStore {
    fn start(&mut self, tag: u64, op: StoreOp) -> anyhow::Result<()> {
        match op {
            StoreOp::Read(n) => {
                self.queue_get(&key_name(n));
                self.piped.push_back(Piped::Get(tag, None));
            }
            StoreOp::Update(n, field, bytes) => {
                let record = self.patched(None, field, &bytes);
                self.queue_set(&key_name(n), &record);
                self.piped.push_back(Piped::Set(tag));
            }
            StoreOp::Insert(n, record) => {
                self.queue_set(&key_name(n), &record);
                self.piped.push_back(Piped::Set(tag));
            }
            StoreOp::Rmw(n, field, bytes) => {
                let key = key_name(n);
                self.queue_get(&key);
                self.piped
                    .push_back(Piped::Get(tag, Some((key, field, bytes))));
            }
            StoreOp::Scan(..) => bail!("memcached has no scans"),
        }
        Ok(())
    }

    fn finished(&mut self, block: bool) -> Vec<(u64, anyhow::Result<bool>)> {
        let mut step = || -> anyhow::Result<()> {
            if !self.out.is_empty() {
                self.c.writer.write_all(&self.out)?;
                self.out.clear();
            }
            // Answers already buffered are taken without blocking; with `block`, at least one
            // is waited for.
            let mut first = block && self.ready.is_empty();
            while !self.piped.is_empty() && (first || !self.c.reader.buffer().is_empty()) {
                self.read_one()?;
                first = false;
                if !self.out.is_empty() {
                    // A read-modify-write's set: out at once.
                    self.c.writer.write_all(&self.out)?;
                    self.out.clear();
                }
            }
            Ok(())
        };
        if let Err(e) = step() {
            // The connection is broken: every command in flight fails with it.
            let why = format!("{e:#}");
            for cmd in std::mem::take(&mut self.piped) {
                let tag = match cmd {
                    Piped::Get(t, _) | Piped::Set(t) => t,
                };
                self.ready.push((tag, Err(anyhow::anyhow!("{why}"))));
            }
        }
        std::mem::take(&mut self.ready)
    }

    fn in_flight(&self) -> usize {
        self.piped.len() + self.ready.len()
    }
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
        let old = self.c.get(&key)?;
        let record = self.patched(old.as_deref(), field, bytes);
        self.c.set(&key, &record)
    }
    fn piped(&mut self) -> Option<&mut dyn PipedStore> {
        Some(self)
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
        Ok(
            Box::new(MemcachedStore::new(MemcachedClient::connect(port)?, fl, rl))
                as Box<dyn Store + Send>,
        )
    });
    let result = run_phases(cfg, make, None, progress, MEMCACHED_MODE);
    drop(server);
    result
}
