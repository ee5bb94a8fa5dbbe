//! A whole deployment inside this process: naam-server's and naam-nic's endpoints over their
//! executors, the manifest and the handlers' objects in a scratch directory, credentials
//! made for the run. The regions are the host's own memory, which the NIC's cluster sees
//! as its DMA would (one process: no file between them, and the host's huge pages). Over the kernel's
//! UDP on loopback, the two drivers run their socket loops on threads of their own, as the
//! binaries do (`auth-cost`). Over an in-memory network ([`MemoryNet`], `ycsb --fabric
//! inproc-endpoints`), the two endpoints are bound as inline services: a client's datagram is
//! handled in the client's thread, so a request reaches an executor with one hand-off, as in
//! the in-process cluster; naam-server's with one endpoint per receive loop, as the binary
//! runs them by default, its sessions sharded over them. Everything above the datagram is the
//! code the two binaries run.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::bail;
use naam_runtime::cluster::{Cluster, ClusterConfig};
use naam_runtime::proto::session::{self, Authentication, Credential};
use naam_runtime::udp::{
    self, HostRegions, InlineNic, InlineServer, MemoryNet, Socket, UdpClient, UdpConfig,
};

/// What to deploy.
pub struct DeploymentPlan {
    /// The one app served (its `credential` is the tenant's).
    pub app: udp::HostApp,
    /// The tenant's name (clients authenticate as it).
    pub tenant: String,
    /// The tenant's credential.
    pub credential: Credential,
    /// naam-server's cluster (host executors, controller).
    pub host: ClusterConfig,
    /// naam-nic's cluster (NIC executors).
    pub nic: ClusterConfig,
    /// Datagram authentication (off only on loopback, for `auth-cost`; none inside one
    /// process's in-memory network).
    pub authentication: Authentication,
    /// Whether naam-server steers under congestion (`congestion_control`).
    pub congestion_control: bool,
    /// The in-memory network to deploy on; `None`: kernel UDP on 127.0.0.1.
    pub network: Option<MemoryNet>,
    /// More apps, each of its own tenant (name, credential), beside `app`.
    pub others: Vec<(udp::HostApp, String, Credential)>,
    /// Whether tenants may deploy into their apps, and how many times a second each
    /// ([`udp::DeployPolicy`]'s defaults otherwise; kernel UDP only: an inline server takes
    /// no deploys).
    pub deploys: Option<f64>,
}

/// A running deployment; [`InProcessDeployment::stop`] drains and joins it.
pub struct InProcessDeployment {
    /// naam-server's address.
    pub server: SocketAddr,
    app: u32,
    tenant: String,
    credential: Credential,
    authentication: Authentication,
    network: Option<MemoryNet>,
    stop: Arc<AtomicBool>,
    /// The socket drivers' threads (kernel UDP).
    threads: Vec<JoinHandle<()>>,
    /// The endpoints bound inline (in-memory network).
    inline_server: Option<InlineServer>,
    inline_nic: Option<InlineNic>,
    shm: PathBuf,
}

/// Where an in-process deployment puts its directory of regions, `name`: under `/dev/shm`,
/// as naam-server's default, when there is one. Regions are mapped shared (the NIC maps the
/// host's files); on a disk's file system their pages would be written back to the disk
/// while they serve, and faulted again at the next store after each write-back.
pub fn shm_dir(name: &str) -> PathBuf {
    let tmpfs = std::path::Path::new("/dev/shm");
    let root = if tmpfs.is_dir() {
        tmpfs.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    root.join(name)
}

impl InProcessDeployment {
    /// Starts `plan` with regions under `shm` (see [`shm_dir`]), then waits until the NIC has paired with the
    /// server (clients are told its agent), so every run has it from the first operation.
    pub fn start(shm: PathBuf, plan: DeploymentPlan) -> anyhow::Result<InProcessDeployment> {
        let app = plan.app.spec.id;
        let pairing = Credential::generate(&naam_runtime::entropy::os())?;
        let mut credentials = vec![(app, plan.tenant.clone(), plan.credential.clone())];
        credentials.extend(
            plan.others
                .iter()
                .map(|(a, t, c)| (a.spec.id, t.clone(), c.clone())),
        );
        let tenants = session::tenant_entries(&credentials, None, Some(pairing.clone()));
        let mut apps = vec![plan.app];
        apps.extend(plan.others.into_iter().map(|(a, _, _)| a));
        // One process: the NIC sees the host's own regions, not files both map.
        let (cluster, manifest) =
            udp::start_host_with(apps, plan.host, &shm, HostRegions::InProcess)?;
        let host = cluster.clone();
        let mut options = udp::ServerOptions::new(manifest, tenants);
        options.drain = Duration::from_secs(1);
        options.congestion_control = plan.congestion_control;
        options.authentication = plan.authentication;
        if let Some(rate) = plan.deploys {
            let mut policy = udp::DeployPolicy::new(shm.clone());
            policy.deploys_per_second = rate;
            options.deploy = Some(policy);
        }
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("literal");
        let stop = Arc::new(AtomicBool::new(false));
        let (server, threads, inline_server) = match &plan.network {
            Some(net) => match udp::serve_host_inline(
                cluster,
                net,
                loopback,
                options,
                udp::default_receive_loops(),
            ) {
                Ok(s) => (s.addr(), Vec::new(), Some(s)),
                Err(e) => {
                    udp::cleanup(&shm);
                    return Err(e.into());
                }
            },
            None => {
                let bound = Socket::bind(loopback, udp::DEFAULT_DATAGRAM)
                    .and_then(|s| Ok((s.local_addr()?, s)));
                let (server, socket) = match bound {
                    Ok(b) => b,
                    Err(e) => {
                        udp::cleanup(&shm);
                        return Err(e.into());
                    }
                };
                let s = stop.clone();
                let t = std::thread::spawn(move || {
                    if let Err(e) = udp::serve_host(cluster, socket, options, &s) {
                        eprintln!("naam-bench: in-process naam-server driver: {e}");
                    }
                });
                (server, vec![t], None)
            }
        };
        let mut d = InProcessDeployment {
            server,
            app,
            tenant: plan.tenant,
            credential: plan.credential,
            authentication: plan.authentication,
            network: plan.network,
            stop: stop.clone(),
            threads,
            inline_server,
            inline_nic: None,
            shm,
        };
        // From here on a failure stops the server and removes the regions.
        let nic = d.start_nic_driver(&host, plan.nic, pairing, stop);
        match nic.and_then(|()| d.wait_for_nic()) {
            Ok(()) => Ok(d),
            Err(e) => {
                d.stop();
                Err(e)
            }
        }
    }

    /// Starts naam-nic's driver over the regions of `host`, the server's cluster.
    fn start_nic_driver(
        &mut self,
        host: &Cluster,
        config: ClusterConfig,
        pairing: Credential,
        stop: Arc<AtomicBool>,
    ) -> anyhow::Result<()> {
        let (nic_cluster, nic_manifest) = udp::start_nic_in_process(&self.shm, config, host)?;
        let start = udp::NicCluster {
            cluster: nic_cluster,
            manifest: nic_manifest,
        };
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("literal");
        let no_remap = |_| Err("the in-process server does not restart".to_string());
        if let Some(net) = &self.network {
            let mut options = udp::NicOptions::new(self.server, loopback, pairing);
            options.drain = Duration::from_secs(1);
            options.authentication = self.authentication;
            self.inline_nic = Some(udp::serve_nic_inline(
                start,
                net,
                loopback,
                options,
                Box::new(no_remap),
            )?);
            return Ok(());
        }
        let nic_socket = Socket::bind(loopback, udp::DEFAULT_DATAGRAM)?;
        let mut options = udp::NicOptions::new(self.server, nic_socket.local_addr()?, pairing);
        options.drain = Duration::from_secs(1);
        options.authentication = self.authentication;
        // It takes deploys up from the manifest the host rewrites there.
        options.shm_dir = Some(self.shm.clone());
        self.threads.push(std::thread::spawn(move || {
            let mut no_remap = no_remap;
            if let Err(e) = udp::serve_nic(start, nic_socket, options, &stop, &mut no_remap) {
                eprintln!("naam-bench: in-process naam-nic driver: {e}");
            }
        }));
        Ok(())
    }

    /// Client settings for this deployment: its server, tenant, credential, authentication
    /// and network.
    pub fn client_config(&self) -> UdpConfig {
        self.client_config_as(&self.tenant, &self.credential)
    }

    /// [`InProcessDeployment::client_config`] for tenant `tenant` with `credential` (one of
    /// the plan's `others`).
    pub fn client_config_as(&self, tenant: &str, credential: &Credential) -> UdpConfig {
        let mut c = UdpConfig::new(self.server, tenant, credential.clone());
        c.authentication = self.authentication;
        c.liveness = crate::udp_client::DEFAULT_LIVENESS;
        c.network = self.network.clone();
        // One process: requests are handed to the server endpoint as they are.
        c.in_process = c.network.is_some();
        c
    }

    fn wait_for_nic(&self) -> anyhow::Result<()> {
        use naam_runtime::proto::control::Control;
        let mut probe = UdpClient::connect(&self.client_config())?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let q = Control::QueryWeights {
                app: self.app,
                client: None,
                rtt_ns: None,
            };
            if let Ok(Control::Weights { agent: Some(_), .. }) = probe.control(&q) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the in-process NIC did not pair with the server within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Drains both drivers, joins them and removes the regions.
    pub fn stop(mut self) {
        if let Some(nic) = self.inline_nic.take() {
            nic.stop();
        }
        if let Some(server) = self.inline_server.take() {
            server.stop();
        }
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        udp::cleanup(&self.shm);
        let _ = std::fs::remove_dir_all(&self.shm);
    }
}

impl Drop for InProcessDeployment {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
