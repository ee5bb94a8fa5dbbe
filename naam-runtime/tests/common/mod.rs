//! Shared test support: builds handler crates with the real pipeline, once per test binary.
#![allow(dead_code)]

pub(crate) mod deployment;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use naam_pipeline::BuildOptions;
use naam_runtime::pipeline::build;
use naam_vm::LoadedObject;

/// Repository root.
pub(crate) fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Target dir shared by every handler build of the test run.
pub(crate) fn handler_target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("handlers")
}

/// Builds `crate_dir` (relative to the repository) into `<tmp>/<name>.o`.
pub(crate) fn build_crate(
    crate_dir: &str,
    name: &str,
) -> Result<PathBuf, naam_runtime::pipeline::PipelineError> {
    build_output(crate_dir, name).map(|b| b.object)
}

/// Builds `crate_dir` (relative to the repository) into `<tmp>/<name>.o`, loaded.
pub(crate) fn build_output(
    crate_dir: &str,
    name: &str,
) -> Result<naam_runtime::pipeline::BuildOutput, naam_runtime::pipeline::PipelineError> {
    let mut opts = BuildOptions::new(repo().join(crate_dir));
    opts.target_dir = Some(handler_target_dir());
    opts.out = Some(handler_target_dir().join(format!("{name}.o")));
    build(&opts)
}

/// The example handlers (`examples/handlers`), built once.
pub(crate) fn examples() -> &'static (PathBuf, LoadedObject) {
    static EXAMPLES: OnceLock<(PathBuf, LoadedObject)> = OnceLock::new();
    EXAMPLES.get_or_init(|| {
        let built = build_output("examples/handlers", "examples").unwrap_or_else(|e| {
            panic!("building examples/handlers failed (run scripts/setup.sh first): {e}")
        });
        (built.object, built.loaded)
    })
}

/// Little-endian bytes of `words`.
pub(crate) fn words(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// A tiny deterministic generator (SplitMix64) for test data.
pub(crate) struct Rng(pub u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        naam_ebpf::hash::finish(self.0)
    }
}

/// The example handlers as app `id`: a read-only sorted array (`sorted`, 512 words i × 4) and a
/// small all-rights region (`data`), with read and write handlers (hostile ones included), on
/// the JIT.
pub(crate) fn examples_app(id: u32) -> naam_runtime::cluster::AppSpec {
    use naam_runtime::cluster::{AppSpec, RegionSpec};
    use naam_runtime::HandlerSpec;
    use naam_runtime::{ALL_RIGHTS, READ_ONLY};
    AppSpec {
        id,
        name: "examples".into(),
        owner: naam_proto::Placement::Host,
        regions: vec![
            RegionSpec {
                name: "sorted".into(),
                access: READ_ONLY,
                contents: words(&(0..512u64).map(|i| i * 4).collect::<Vec<_>>()),
            },
            RegionSpec {
                name: "data".into(),
                access: ALL_RIGHTS,
                contents: words(&[24, 1000, 0, 42, 0, 0, 0, 0]),
            },
        ],
        object: std::sync::Arc::new(examples().1.clone()),
        handlers: vec![
            HandlerSpec::read("bsearch"),
            HandlerSpec::read("two_step"),
            HandlerSpec::read("add"),
            HandlerSpec::read("panics"),
            HandlerSpec::read("vget"),
            HandlerSpec::write("counter_add"),
            HandlerSpec::write("store"),
            // Hostile handlers: every engine must contain them.
            HandlerSpec::read("wild_write"),
            HandlerSpec::read("spin"),
            HandlerSpec::read("recurse"),
            HandlerSpec::read("oob_read"),
        ],
    }
}

/// A fabric driver thread (naam-server's or naam-nic's loop) standing in for a process; stops
/// and joins when dropped.
pub(crate) struct Driver {
    /// Set to stop the loop.
    pub stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The loop's thread.
    pub thread: Option<std::thread::JoinHandle<()>>,
    /// Its socket's address.
    pub addr: std::net::SocketAddr,
}

impl Driver {
    /// Stops the loop and waits for it.
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The tenant every test app belongs to unless a test says otherwise.
pub(crate) const TENANT: &str = "examples";

/// The test tenant's credential.
pub(crate) fn tenant_key() -> naam_proto::session::Credential {
    naam_proto::session::Credential::from_bytes([0x11; 32])
}

/// The test NIC's pairing secret.
pub(crate) fn pairing_key() -> naam_proto::session::Credential {
    naam_proto::session::Credential::from_bytes([0x22; 32])
}

/// The test operator's credential.
pub(crate) fn operator_key() -> naam_proto::session::Credential {
    naam_proto::session::Credential::from_bytes([0x33; 32])
}

/// Receive loops of the test hosts.
pub(crate) const HOST_LOOPS: usize = 2;

/// A naam-server driver on loopback serving the examples object as apps `ids` from `shm`,
/// all of tenant [`TENANT`]; `verbs` gives it an RDMA side once its cluster exists.
pub(crate) fn udp_host(
    shm: &Path,
    ids: &[u32],
    config: naam_runtime::cluster::ClusterConfig,
    congestion_control: bool,
    client_writes: bool,
    verbs: impl FnOnce(
        &std::sync::Arc<naam_runtime::cluster::Cluster>,
    ) -> Option<std::sync::Arc<dyn naam_proto::endpoint::VerbsAcceptor>>,
) -> Driver {
    let tenants: Vec<_> = ids
        .iter()
        .map(|&id| (id, TENANT.to_string(), tenant_key()))
        .collect();
    let at = "127.0.0.1:0".parse().unwrap();
    udp_host_tenants(
        shm,
        at,
        &tenants,
        config,
        congestion_control,
        client_writes,
        verbs,
    )
}

/// A naam-server driver on `at` serving the examples object as the apps of `tenants` (app id,
/// tenant name, credential), with the test NIC's pairing secret and operator credential.
#[allow(clippy::too_many_arguments)]
pub(crate) fn udp_host_tenants(
    shm: &Path,
    at: std::net::SocketAddr,
    tenants: &[(u32, String, naam_proto::session::Credential)],
    config: naam_runtime::cluster::ClusterConfig,
    congestion_control: bool,
    client_writes: bool,
    verbs: impl FnOnce(
        &std::sync::Arc<naam_runtime::cluster::Cluster>,
    ) -> Option<std::sync::Arc<dyn naam_proto::endpoint::VerbsAcceptor>>,
) -> Driver {
    use naam_runtime::udp;
    let bytes = std::fs::read(&examples().0).unwrap();
    let apps = tenants
        .iter()
        .map(|(id, _, c)| udp::HostApp {
            spec: examples_app(*id),
            kind: "object".into(),
            params: serde_json::Value::Null,
            object_bytes: bytes.clone(),
            client_writes,
            credential: Some(c.clone()),
        })
        .collect();
    let tenants =
        naam_proto::session::tenant_entries(tenants, Some(operator_key()), Some(pairing_key()));
    let mut seen = std::collections::HashSet::new();
    let tenants: Vec<_> = tenants
        .into_iter()
        .filter(|t| seen.insert(t.name.clone()))
        .collect();
    let (cluster, manifest) = udp::start_host(apps, config, shm).unwrap();
    let verbs = verbs(&cluster);
    // Two receive loops, as a deployment on two cores runs: every test over this host goes
    // through the kernel's routing of sessions to loops and the loops' shared directory.
    let sockets = udp::bind_group(at, 1472, HOST_LOOPS).unwrap();
    let addr = sockets[0].local_addr().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        let mut opts = udp::ServerOptions::new(manifest, tenants);
        opts.drain = std::time::Duration::from_secs(1);
        opts.verbs = verbs;
        opts.congestion_control = congestion_control;
        udp::serve_host_loops(cluster, sockets, opts, &s).unwrap();
    });
    Driver {
        stop,
        thread: Some(thread),
        addr,
    }
}

/// A naam-nic driver of two receive loops on loopback for the host that wrote `shm`,
/// reporting to `server`; it maps the regions anew when the server restarts.
pub(crate) fn udp_nic(shm: &Path, server: std::net::SocketAddr) -> Driver {
    use naam_runtime::cluster::ClusterConfig;
    use naam_runtime::udp::start_nic;
    use naam_runtime::udp::{bind_group, serve_nic_loops, NicCluster, NicOptions};
    let (cluster, manifest) = start_nic(shm, ClusterConfig::functional()).unwrap();
    let shm = shm.to_path_buf();
    let sockets = bind_group("127.0.0.1:0".parse().unwrap(), 1472, 2).unwrap();
    let addr = sockets[0].local_addr().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        let mut opts = NicOptions::new(server, addr, pairing_key());
        opts.drain = std::time::Duration::from_secs(1);
        let start = NicCluster { cluster, manifest };
        serve_nic_loops(start, sockets, opts, &s, &mut |_| {
            start_nic(&shm, ClusterConfig::functional())
                .map(|(cluster, manifest)| NicCluster { cluster, manifest })
                .map_err(|e| e.to_string())
        })
        .unwrap();
    });
    Driver {
        stop,
        thread: Some(thread),
        addr,
    }
}

/// A read descriptor.
/// The next sealed message for `c` of kind `kind` that answers id `id` (a reply's request id,
/// a completion's operation id), if one comes `within`. Other sealed datagrams are passed
/// over: a call resent (while the NIC paired, or after a pause) is answered once per send,
/// and the answers after the first may still be on their way.
pub(crate) fn recv_answer(
    c: &mut naam_runtime::udp::UdpClient,
    kind: naam_proto::kind::MessageKind,
    id: u64,
    within: std::time::Duration,
) -> Option<bytes::Bytes> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return None;
        }
        let got = c
            .recv_sealed(left.min(std::time::Duration::from_millis(10)))
            .expect("a client's receive");
        if let Some(m) = got
            .into_iter()
            .find(|m| naam_proto::peek::message_id(m) == Some((kind, id)))
        {
            return Some(m);
        }
    }
}

pub(crate) fn rd(rkey: u64, offset: u64, len: u32) -> naam_ebpf::abi::Descriptor {
    naam_ebpf::abi::Descriptor {
        rkey,
        offset,
        len,
        access: naam_ebpf::abi::ACCESS_READ,
    }
}

/// Checks that `bsearch` of the examples app `app` refuses an unknown rkey and a range past its
/// `sorted` region (whose rkey is `sorted`) with clear statuses, over any transport.
pub(crate) fn check_descriptor_refusals<T: naam_proto::transport::Transport>(
    c: &mut T,
    app: u32,
    sorted: u64,
) {
    use naam_proto::handler_id;
    use naam_proto::wire::Status;
    for (desc, want) in [
        (rd(77, 0, 8), Status::BadKey),
        (rd(sorted, 4000, 4096), Status::OutOfRange),
    ] {
        let r = c
            .call(app, handler_id("bsearch"), &words(&[4]), &[desc])
            .unwrap();
        assert_eq!(r.status, want, "{desc:?}");
    }
}

/// An eBPF ELF with one section per (name, bytes) pair.
pub(crate) fn elf_object(sections: &[(&str, &[u8])]) -> Vec<u8> {
    use object::write::{Object as WObject, Symbol, SymbolSection};
    use object::{
        Architecture, BinaryFormat, Endianness, SectionKind, SymbolFlags, SymbolKind, SymbolScope,
    };
    let mut obj = WObject::new(BinaryFormat::Elf, Architecture::Bpf, Endianness::Little);
    for (name, bytes) in sections {
        let id = obj.add_section(Vec::new(), name.as_bytes().to_vec(), SectionKind::Text);
        obj.append_section_data(id, bytes, 8);
        obj.add_symbol(Symbol {
            name: name.rsplit('/').next().unwrap().as_bytes().to_vec(),
            value: 0,
            size: bytes.len() as u64,
            kind: SymbolKind::Text,
            scope: SymbolScope::Dynamic,
            weak: false,
            section: SymbolSection::Section(id),
            flags: SymbolFlags::None,
        });
    }
    obj.write().unwrap()
}
