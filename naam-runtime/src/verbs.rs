//! The `verbs` fabric backend (feature `verbs`, rdma-sys): RDMA devices, protection domain,
//! completion queue, memory registration, reliable-connected queue pairs brought up by an
//! out-of-band exchange of endpoints ([`naam_proto::control::QpEndpoint`]) over the control
//! channel (no librdmacm), and the operations NAAM needs: READ, WRITE, compare-and-swap, fetch-and-add, SEND and RECV. One
//! queue pair per peer, shared by every app.
//!
//! This machine has no RDMA device (and its kernel has no InfiniBand, so no Soft-RoCE either):
//! [`Device::open`] then fails with [`VerbsError::NoDevice`], and the tests say they skipped.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;
use serde::Serialize;

/// Why a verbs operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No device at all.
    #[error("no RDMA device: ibv_get_device_list found none (no RDMA NIC here, and no Soft-RoCE without kernel InfiniBand support); use the udp fabric")]
    NoDevice,
    /// No device of that name.
    #[error("no RDMA device named {0} (have: {1})")]
    UnknownDevice(String, String),
    /// A verbs call failed.
    #[error("{call} failed: {source}")]
    Call {
        /// The libibverbs function that failed.
        call: &'static str,
        /// The errno it set, or the error code it returned.
        #[source]
        source: std::io::Error,
    },
    /// A work request completed with an error status.
    #[error("work request {wr_id} completed with status {status} ({text})")]
    WorkCompletion {
        /// The `wr_id` it was posted with.
        wr_id: u64,
        /// `ibv_wc_status`.
        status: u32,
        /// `ibv_wc_status_str`.
        text: String,
    },
    /// No completion in time.
    #[error("no completion for work request {0} within {1:?}")]
    Timeout(u64, Duration),
    /// The out-of-band exchange over the control channel failed.
    #[error("queue pair exchange with naam-server: {0}")]
    Exchange(String),
    /// A local buffer range outside its registration.
    #[error("range {offset}+{len} is outside the {size}-byte registration")]
    Range {
        /// Start of the range, in bytes from the start of the registered buffer.
        offset: usize,
        /// Length of the range in bytes.
        len: usize,
        /// Size of the registration in bytes.
        size: usize,
    },
}

fn last_error(call: &'static str) -> VerbsError {
    VerbsError::Call {
        call,
        source: std::io::Error::last_os_error(),
    }
}

fn check(call: &'static str, rc: i32) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(VerbsError::Call {
            call,
            source: std::io::Error::from_raw_os_error(if rc > 0 { rc } else { -rc }),
        })
    }
}

/// An RDMA device found on this host.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    /// Name (`mlx5_0`).
    pub name: String,
    /// Node GUID.
    pub guid: u64,
}

/// `ibv_get_device_list`, with "the kernel has no RDMA support" (ENOSYS) as an empty list.
fn device_list(n: &mut i32) -> Result<Option<*mut *mut ibv_device>, VerbsError> {
    // SAFETY: plain libibverbs call; callers free the list.
    let list = unsafe { ibv_get_device_list(n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOSYS) {
            *n = 0;
            return Ok(None);
        }
        return Err(VerbsError::Call {
            call: "ibv_get_device_list",
            source: e,
        });
    }
    Ok(Some(list))
}

/// Every RDMA device on this host (empty when there is none, or no kernel RDMA support).
pub fn devices() -> Result<Vec<DeviceInfo>, VerbsError> {
    let mut n = 0;
    let Some(list) = device_list(&mut n)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        unsafe {
            let d = *list.add(i);
            out.push(DeviceInfo {
                name: CStr::from_ptr(ibv_get_device_name(d))
                    .to_string_lossy()
                    .into_owned(),
                guid: u64::from_be(ibv_get_device_guid(d)),
            });
        }
    }
    // SAFETY: the list came from ibv_get_device_list.
    unsafe { ibv_free_device_list(list) };
    Ok(out)
}

use naam_proto::control::QpEndpoint as Endpoint;

/// An open device with its protection domain and one completion queue.
pub struct Device {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    port: u8,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
}

// SAFETY: libibverbs objects may be used from any thread; the CQ is polled under &self with
// libibverbs' own locking.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: created by open; destroyed once, children first.
        unsafe {
            ibv_destroy_cq(self.cq);
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

const PORT: u8 = 1;
const CQ_DEPTH: i32 = 1024;

impl Device {
    /// Opens device `name` (or the first one) with port 1.
    pub fn open(name: Option<&str>) -> Result<Arc<Device>, VerbsError> {
        let mut n = 0;
        let Some(list) = device_list(&mut n)? else {
            return Err(VerbsError::NoDevice);
        };
        let all = devices()?;
        let pick = match name {
            None => (n > 0).then_some(0),
            Some(want) => all.iter().position(|d| d.name == want),
        };
        let Some(i) = pick else {
            // SAFETY: from ibv_get_device_list.
            unsafe { ibv_free_device_list(list) };
            return Err(match name {
                None => VerbsError::NoDevice,
                Some(w) => VerbsError::UnknownDevice(
                    w.to_string(),
                    all.iter()
                        .map(|d| d.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
            });
        };
        // SAFETY: `i` < n; the list is freed after the device is opened (allowed by libibverbs).
        let ctx = unsafe { ibv_open_device(*list.add(i)) };
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(last_error("ibv_open_device"));
        }
        // SAFETY: valid context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            unsafe { ibv_close_device(ctx) };
            return Err(last_error("ibv_alloc_pd"));
        }
        let cq =
            unsafe { ibv_create_cq(ctx, CQ_DEPTH, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            unsafe {
                ibv_dealloc_pd(pd);
                ibv_close_device(ctx);
            }
            return Err(last_error("ibv_create_cq"));
        }
        let mut dev = Device {
            ctx,
            pd,
            cq,
            port: PORT,
            lid: 0,
            gid: [0; 16],
            gid_index: 0,
        };
        // SAFETY: zeroed plain-data attributes filled by the library.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        check("ibv_query_port", unsafe {
            ___ibv_query_port(ctx, PORT, &mut attr)
        })?;
        dev.lid = attr.lid;
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        if unsafe { ibv_query_gid(ctx, PORT, 0, &mut gid) } == 0 {
            // SAFETY: every bit pattern is a valid raw GID.
            dev.gid = unsafe { gid.raw };
        }
        Ok(Arc::new(dev))
    }

    /// Polls the completion queue until work request `wr_id` completes (other completions are
    /// returned too, so callers with several outstanding requests can match them).
    pub fn wait(&self, wr_id: u64, timeout: Duration) -> Result<Vec<WorkCompletion>, VerbsError> {
        let start = Instant::now();
        let mut seen = Vec::new();
        loop {
            // SAFETY: zeroed plain data filled by the provider.
            let mut wc: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
            let n = unsafe { ibv_poll_cq(self.cq, wc.len() as i32, wc.as_mut_ptr()) };
            if n < 0 {
                return Err(last_error("ibv_poll_cq"));
            }
            for w in &wc[..n as usize] {
                if w.status != ibv_wc_status::IBV_WC_SUCCESS {
                    // SAFETY: returns a static string.
                    let text = unsafe { CStr::from_ptr(ibv_wc_status_str(w.status)) }
                        .to_string_lossy()
                        .into_owned();
                    return Err(VerbsError::WorkCompletion {
                        wr_id: w.wr_id,
                        status: w.status,
                        text,
                    });
                }
                seen.push(WorkCompletion {
                    wr_id: w.wr_id,
                    byte_len: w.byte_len,
                });
            }
            if seen.iter().any(|c| c.wr_id == wr_id) {
                return Ok(seen);
            }
            if start.elapsed() > timeout {
                return Err(VerbsError::Timeout(wr_id, timeout));
            }
            std::hint::spin_loop();
        }
    }
}

/// A successful work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// Bytes received (RECV).
    pub byte_len: u32,
}

/// Registered memory: local buffers, or NAAM regions exposed to remote READ / WRITE / atomics.
pub struct MemoryRegion {
    mr: *mut ibv_mr,
    addr: u64,
    len: usize,
    _dev: Arc<Device>,
}

// SAFETY: the registration is a handle; the memory it names is the caller's (see `register`).
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` for local access and the remote operations `remote`
    /// (NAAM `ACCESS_*` bits) grants: the RNIC itself then refuses a remote WRITE or atomic on
    /// a region whose app gives clients no one-sided writes.
    ///
    /// # Safety
    /// The memory must stay valid, and must not move, while the registration lives; remote
    /// peers may write it at any time if `remote` allows (NAAM regions are accessed through
    /// atomics only).
    pub unsafe fn register(
        dev: &Arc<Device>,
        addr: *mut u8,
        len: usize,
        remote: u32,
    ) -> Result<MemoryRegion, VerbsError> {
        use naam_ebpf::abi::{ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote & ACCESS_READ != 0 {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        }
        if remote & ACCESS_WRITE != 0 {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        if remote & ACCESS_ATOMIC != 0 {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC;
        }
        // SAFETY: the caller keeps the memory valid.
        let mr = unsafe { ibv_reg_mr(dev.pd, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(last_error("ibv_reg_mr"));
        }
        Ok(MemoryRegion {
            mr,
            addr: addr as u64,
            len,
            _dev: dev.clone(),
        })
    }

    /// The key remote peers name this memory with.
    pub fn rkey(&self) -> u32 {
        // SAFETY: valid registration.
        unsafe { (*self.mr).rkey }
    }

    /// The key local work requests name this memory by (in their scatter/gather entries).
    pub fn lkey(&self) -> u32 {
        unsafe { (*self.mr).lkey }
    }

    /// Address of the first byte (what remote peers add offsets to).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    fn sge(&self, offset: usize, len: usize) -> Result<ibv_sge, VerbsError> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(VerbsError::Range {
                offset,
                len,
                size: self.len,
            });
        }
        Ok(ibv_sge {
            addr: self.addr + offset as u64,
            length: len as u32,
            lkey: self.lkey(),
        })
    }
}

/// A reliable-connected queue pair to one peer.
pub struct QueuePair {
    qp: *mut ibv_qp,
    dev: Arc<Device>,
    psn: u32,
}

// SAFETY: posting is thread-safe in libibverbs.
unsafe impl Send for QueuePair {}
unsafe impl Sync for QueuePair {}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once.
        unsafe { ibv_destroy_qp(self.qp) };
    }
}

use naam_proto::control::RdmaRemote as Remote;

impl QueuePair {
    /// Creates an RC queue pair on `dev` and moves it to INIT.
    pub fn create(dev: &Arc<Device>) -> Result<QueuePair, VerbsError> {
        // SAFETY: zeroed plain data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = dev.cq;
        init.recv_cq = dev.cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap = ibv_qp_cap {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = unsafe { ibv_create_qp(dev.pd, &mut init) };
        if qp.is_null() {
            return Err(last_error("ibv_create_qp"));
        }
        let mut psn = [0u8; 4];
        let _ = getrandom::fill(&mut psn);
        let q = QueuePair {
            qp,
            dev: dev.clone(),
            psn: u32::from_le_bytes(psn) & 0xff_ffff,
        };
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = dev.port;
        a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC)
            .0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        check("ibv_modify_qp(INIT)", unsafe {
            ibv_modify_qp(qp, &mut a, mask.0 as i32)
        })?;
        Ok(q)
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            lid: self.dev.lid,
            // SAFETY: valid QP.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            gid: self.dev.gid,
        }
    }

    /// Connects to `remote` (INIT → RTR → RTS).
    pub fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::IBV_MTU_1024;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = self.dev.port;
        if remote.gid != [0; 16] {
            // RoCE: route by GID.
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = self.dev.gid_index;
            a.ah_attr.grh.hop_limit = 1;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        check("ibv_modify_qp(RTR)", unsafe {
            ibv_modify_qp(self.qp, &mut a, mask.0 as i32)
        })?;
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 16;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        check("ibv_modify_qp(RTS)", unsafe {
            ibv_modify_qp(self.qp, &mut a, mask.0 as i32)
        })
    }

    fn post(
        &self,
        wr_id: u64,
        opcode: ibv_wr_opcode::Type,
        mut sge: ibv_sge,
        wr: Option<wr_t>,
    ) -> Result<(), VerbsError> {
        // SAFETY: zeroed plain data; the SGE outlives the call (the provider copies it).
        let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
        w.wr_id = wr_id;
        w.sg_list = &mut sge;
        w.num_sge = 1;
        w.opcode = opcode;
        w.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        if let Some(wr) = wr {
            w.wr = wr;
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        check("ibv_post_send", unsafe {
            ibv_post_send(self.qp, &mut w, &mut bad)
        })
    }

    fn post_rdma(
        &self,
        wr_id: u64,
        opcode: ibv_wr_opcode::Type,
        sge: ibv_sge,
        remote: Remote,
    ) -> Result<(), VerbsError> {
        let wr = wr_t {
            rdma: rdma_t {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
        };
        self.post(wr_id, opcode, sge, Some(wr))
    }

    fn post_atomic(
        &self,
        wr_id: u64,
        opcode: ibv_wr_opcode::Type,
        sge: ibv_sge,
        remote: Remote,
        compare_add: u64,
        swap: u64,
    ) -> Result<(), VerbsError> {
        let wr = wr_t {
            atomic: atomic_t {
                remote_addr: remote.addr,
                compare_add,
                swap,
                rkey: remote.rkey,
            },
        };
        self.post(wr_id, opcode, sge, Some(wr))
    }

    /// RDMA READ of `len` bytes at `remote` into `local[offset..]`.
    pub fn read(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: Remote,
    ) -> Result<(), VerbsError> {
        let sge = local.sge(offset, len)?;
        self.post_rdma(wr_id, ibv_wr_opcode::IBV_WR_RDMA_READ, sge, remote)
    }

    /// RDMA WRITE of `local[offset..offset + len]` to `remote`.
    pub fn write(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: Remote,
    ) -> Result<(), VerbsError> {
        let sge = local.sge(offset, len)?;
        self.post_rdma(wr_id, ibv_wr_opcode::IBV_WR_RDMA_WRITE, sge, remote)
    }

    /// 64-bit compare-and-swap at `remote`; the old value lands in `local[offset..offset + 8]`.
    pub fn compare_swap(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: Remote,
        expected: u64,
        new: u64,
    ) -> Result<(), VerbsError> {
        let sge = local.sge(offset, 8)?;
        let op = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
        self.post_atomic(wr_id, op, sge, remote, expected, new)
    }

    /// 64-bit fetch-and-add at `remote`; the old value lands in `local[offset..offset + 8]`.
    pub fn fetch_add(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: Remote,
        add: u64,
    ) -> Result<(), VerbsError> {
        let sge = local.sge(offset, 8)?;
        let op = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
        self.post_atomic(wr_id, op, sge, remote, add, 0)
    }

    /// SEND of `local[offset..offset + len]` (an active message) to the peer's posted RECV.
    pub fn send(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<(), VerbsError> {
        self.post(
            wr_id,
            ibv_wr_opcode::IBV_WR_SEND,
            local.sge(offset, len)?,
            None,
        )
    }

    /// Posts a RECV buffer `local[offset..offset + len]`.
    pub fn recv(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<(), VerbsError> {
        let mut sge = local.sge(offset, len)?;
        let mut w = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        check("ibv_post_recv", unsafe {
            ibv_post_recv(self.qp, &mut w, &mut bad)
        })
    }
}

/// One queue pair per peer, shared by every app, and every NAAM region registered for remote
/// access: the server side of the out-of-band exchange
/// ([`naam_proto::control::Control::VerbsConnect`]).
pub struct Peers {
    dev: Arc<Device>,
    qps: std::sync::Mutex<std::collections::HashMap<std::net::SocketAddr, Arc<QueuePair>>>,
    regions: Vec<(naam_proto::control::RdmaRegion, MemoryRegion)>,
    _table: Arc<crate::RegionTable>,
}

impl Peers {
    /// Registers every region of `table` on `dev`, each for the remote operations
    /// `client_access(app, rkey)` grants clients (read-only unless the app opts into client
    /// one-sided writes).
    pub fn new(
        dev: Arc<Device>,
        table: Arc<crate::RegionTable>,
        client_access: &dyn Fn(u32, u64) -> u32,
    ) -> Result<Peers, VerbsError> {
        let mut regions = Vec::new();
        for r in table.regions() {
            let len = r.mem.len().div_ceil(8) * 8;
            // SAFETY: region memory is fixed-size, never moves, and lives as long as `table`,
            // which this value holds; remote writes go through the same words the runtime
            // accesses atomically.
            let remote = client_access(r.app, r.rkey);
            let mr = unsafe {
                MemoryRegion::register(&dev, r.mem.addr() as *mut u8, len.max(8), remote)?
            };
            regions.push((
                naam_proto::control::RdmaRegion {
                    app: r.app,
                    naam_rkey: r.rkey,
                    remote: Remote {
                        addr: mr.addr(),
                        rkey: mr.rkey(),
                    },
                    len: r.mem.len() as u64,
                    access: remote,
                },
                mr,
            ));
        }
        Ok(Peers {
            dev,
            qps: Default::default(),
            regions,
            _table: table,
        })
    }

    /// The registered regions, as clients address them.
    pub fn regions(&self) -> Vec<naam_proto::control::RdmaRegion> {
        self.regions.iter().map(|(r, _)| *r).collect()
    }

    /// Connects (or reconnects) the queue pair of `peer` to its endpoint; returns ours.
    pub fn accept(
        &self,
        peer: std::net::SocketAddr,
        remote: &Endpoint,
    ) -> Result<Endpoint, VerbsError> {
        let qp = Arc::new(QueuePair::create(&self.dev)?);
        qp.connect(remote)?;
        let ours = qp.endpoint();
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer, qp);
        Ok(ours)
    }

    /// The queue pair of `peer`.
    pub fn get(&self, peer: &std::net::SocketAddr) -> Option<Arc<QueuePair>> {
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .cloned()
    }
}

impl naam_proto::endpoint::VerbsAcceptor for Peers {
    fn accept(
        &self,
        peer: std::net::SocketAddr,
        remote: &Endpoint,
    ) -> Result<(Endpoint, Vec<naam_proto::control::RdmaRegion>), String> {
        let ours = Peers::accept(self, peer, remote).map_err(|e| e.to_string())?;
        Ok((ours, self.regions()))
    }
}

/// The client side of the out-of-band exchange: creates this peer's queue pair (shared by every
/// app it uses), sends its endpoint to naam-server over the UDP control channel, and connects
/// it to the server's answer. Returns the queue pair and the server's regions.
pub fn connect(
    client: &mut crate::udp::UdpClient,
    dev: &Arc<Device>,
) -> Result<(QueuePair, Vec<naam_proto::control::RdmaRegion>), VerbsError> {
    use naam_proto::control::Control;
    let qp = QueuePair::create(dev)?;
    let answer = client
        .control(&Control::VerbsConnect {
            endpoint: qp.endpoint(),
        })
        .map_err(|e| VerbsError::Exchange(e.to_string()))?;
    match answer {
        Control::VerbsAccept { endpoint, regions } => {
            qp.connect(&endpoint)?;
            Ok((qp, regions))
        }
        Control::Error { message } => Err(VerbsError::Exchange(message)),
        other => Err(VerbsError::Exchange(format!("unexpected answer {other:?}"))),
    }
}

impl crate::udp::UdpClient {
    /// Sends this client's one-sided READs over RDMA: connects a queue pair on `dev` to
    /// naam-server's (the out-of-band exchange on the control channel) and reads the server's
    /// registered regions directly, with no naam-nic agent in the path.
    pub fn use_rdma(&mut self, dev: &Arc<Device>) -> Result<(), VerbsError> {
        let (qp, regions) = connect(self, dev)?;
        let reader = RdmaReader::new(dev.clone(), qp, regions)?;
        self.set_direct_reads(Box::new(reader));
        Ok(())
    }
}

/// The client's data path sees RDMA READs as one more one-sided source; the round trip is
/// measured around the posted READs and their completions.
impl naam_proto::step::OneSided for RdmaReader {
    fn read(
        &mut self,
        app: u32,
        descs: &[naam_ebpf::abi::Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, naam_proto::step::FetchError> {
        let start = std::time::Instant::now();
        RdmaReader::read(self, app, descs, bufs)?;
        Ok(start.elapsed().as_nanos() as u64)
    }
}

/// Bytes one step of a client's reads may fetch at most (its registered landing buffer).
pub const READ_BUFFER: usize = 1 << 20;

/// How long a client waits for its READs to complete.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// A client's one-sided READs over its RDMA queue pair: the Client placement on hardware, where
/// the server's NIC reads host memory with no server CPU (and no naam-nic agent) involved.
///
/// The descriptors are checked here against the server's NAAM rights and bounds before
/// anything is posted; the RDMA registration itself grants remote READ on every region, so on
/// a shared fabric these checks are the client's own discipline, not a protection boundary.
pub struct RdmaReader {
    dev: Arc<Device>,
    qp: QueuePair,
    regions: std::collections::HashMap<u64, naam_proto::control::RdmaRegion>,
    mr: MemoryRegion,
    // Where completions land; registered, so it must not move while `mr` lives.
    _buf: Box<[u64]>,
    next_wr: u64,
}

impl RdmaReader {
    /// A reader on `qp` (connected to the server) over its `regions`.
    pub fn new(
        dev: Arc<Device>,
        qp: QueuePair,
        regions: Vec<naam_proto::control::RdmaRegion>,
    ) -> Result<RdmaReader, VerbsError> {
        let mut buf = vec![0u64; READ_BUFFER / 8].into_boxed_slice();
        // SAFETY: the boxed buffer never moves and is dropped after the registration (field
        // order: `mr` before `_buf`).
        let mr = unsafe { MemoryRegion::register(&dev, buf.as_mut_ptr().cast(), READ_BUFFER, 0)? };
        Ok(RdmaReader {
            dev,
            qp,
            regions: regions.into_iter().map(|r| (r.naam_rkey, r)).collect(),
            mr,
            _buf: buf,
            next_wr: 1,
        })
    }

    /// Reads every descriptor of `app` into `bufs` (one RDMA READ each, waited for together).
    pub fn read(
        &mut self,
        app: u32,
        descs: &[naam_ebpf::abi::Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<(), naam_proto::step::FetchError> {
        use naam_proto::step::FetchError;
        use naam_proto::step::{MemError, ResolveError};
        let mut at = 0usize;
        let mut posts = Vec::with_capacity(descs.len());
        for d in descs {
            let r = self
                .regions
                .get(&d.rkey)
                .filter(|r| r.app == app)
                .ok_or(ResolveError::BadKey(d.rkey))?;
            if r.access & naam_ebpf::abi::ACCESS_READ == 0 {
                return Err(ResolveError::AccessDenied {
                    need: naam_ebpf::abi::ACCESS_READ,
                    have: r.access,
                }
                .into());
            }
            let len = d.len as u64;
            if d.offset.checked_add(len).is_none_or(|e| e > r.len) {
                return Err(ResolveError::OutOfRange(MemError::OutOfRange {
                    offset: d.offset,
                    len,
                    size: r.len as usize,
                })
                .into());
            }
            if at + d.len as usize > READ_BUFFER {
                return Err(FetchError::Refused {
                    status: naam_proto::wire::Status::Refused,
                    message: format!("one step reads more than {READ_BUFFER} bytes over RDMA"),
                });
            }
            posts.push((at, d.len as usize, r.remote.addr + d.offset, r.remote.rkey));
            at += d.len as usize;
        }
        let failed = |e: VerbsError| FetchError::Unavailable(format!("RDMA READ: {e}"));
        let mut last = None;
        for &(offset, len, addr, rkey) in &posts {
            let wr = self.next_wr;
            self.next_wr += 1;
            self.qp
                .read(wr, &self.mr, offset, len, Remote { addr, rkey })
                .map_err(failed)?;
            last = Some(wr);
        }
        if let Some(wr) = last {
            // One reliable connection completes its work requests in order: the last one
            // completing means every earlier one did (an error completion fails the wait).
            self.dev.wait(wr, READ_TIMEOUT).map_err(failed)?;
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        for (&(offset, len, _, _), b) in posts.iter().zip(bufs.iter_mut()) {
            b.clear();
            b.resize(len, 0);
            // SAFETY: `offset + len` is inside the registered buffer (checked above), the
            // device wrote it before its completion, and nothing else writes it meanwhile.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.mr.addr() as *const u8).add(offset),
                    b.as_mut_ptr(),
                    len,
                )
            };
        }
        Ok(())
    }
}
