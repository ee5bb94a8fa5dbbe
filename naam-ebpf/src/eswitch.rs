//! The eSwitch's ABI: what the XDP program on the server's veth (`smartnic/eswitch-xdp`) and
//! `naam-server`, which loads it and writes its maps, must agree on. Offsets into NAAM packets
//! are checked against the runtime's encoders by `naam-runtime`'s tests.

/// Name of the XDP program (its function, in section `xdp`).
pub const PROGRAM: &str = "naam_eswitch";
/// Array map, one [`Config`] at key 0.
pub const CONFIG_MAP: &str = "NAAM_ESWITCH_CONFIG";
/// Hash map: [`steer_key`] → per-mille share of server-bound messages for the NIC (`u32`).
pub const STEER_MAP: &str = "NAAM_ESWITCH_STEER";
/// Per-CPU array of `u64` packet counters, indexed by the `COUNTER_*` constants.
pub const COUNTERS_MAP: &str = "NAAM_ESWITCH_COUNTERS";

/// Entries of the steering map (read handlers across all apps): room for a server of 10,000
/// apps with several read handlers each (about 5 MB of kernel memory when full).
pub const STEER_ENTRIES: u32 = 65_536;
/// Messages left on their way to the host executors.
pub const COUNTER_HOST: u32 = 0;
/// Messages redirected to the NIC executor.
pub const COUNTER_NIC: u32 = 1;
/// Multi-fragment NAAM messages (always left for the host: later fragments carry no header).
pub const COUNTER_FRAGMENTED: u32 = 2;
/// Number of `COUNTER_*` indices: the counter map's `max_entries`.
pub const COUNTERS: u32 = 3;

/// What the switch steers: UDP messages to `server_port` go to `nic_port` instead when the
/// steering map says so. Ports in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// naam-server's UDP port.
    pub server_port: u16,
    /// naam-nic's UDP port (on the same address).
    pub nic_port: u16,
    /// Non-zero: steering on; zero: every message stays on its way to the host.
    pub enabled: u32,
}

/// Legacy BPF map definition (the `maps` section layout aya reads).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MapDef {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size.
    pub key_size: u32,
    /// Value size.
    pub value_size: u32,
    /// Most entries the map holds (for an array map, its fixed length).
    pub max_entries: u32,
    /// `BPF_F_*` map creation flags (0 for every map of the eSwitch).
    pub map_flags: u32,
    /// Unused id.
    pub id: u32,
    /// Pinning (0: none).
    pub pinning: u32,
}

/// Ethernet + IPv4 (no options) + UDP headers.
pub const L4_PAYLOAD: usize = 14 + 20 + 8;
/// In the NAAM fragment header (right after UDP): fragment count.
pub const FRAG_COUNT: usize = 6;
/// Size of the NAAM fragment header.
pub const FRAG_HEADER: usize = 24;
/// Kind byte of a sealed message: every client datagram after the handshake travels in a
/// session envelope (`naam_proto::session`), with the request inside it.
pub const KIND_SEALED: u8 = 7;
/// Size of the session envelope's header (the request starts after it).
pub const SEAL_HEADER: usize = 24;
/// In the envelope (after the fragment header): its kind byte.
pub const SEAL_KIND: usize = 1;
/// In a request (after the fragment header and the envelope's header): kind byte.
pub const REQ_KIND: usize = 1;
/// Request kind value.
pub const KIND_REQUEST: u8 = 1;
/// In a request: flags (`u16` LE).
pub const REQ_FLAGS: usize = 2;
/// In a request: app (`u32` LE).
pub const REQ_APP: usize = 4;
/// In a request: handler id (`u32` LE).
pub const REQ_HANDLER: usize = 8;
/// In a request: request id (`u64` LE).
pub const REQ_ID: usize = 16;
/// Request flag: run at the host.
pub const FLAG_PIN_HOST: u16 = 4;
/// Request flag: run at the NIC.
pub const FLAG_PIN_NIC: u16 = 8;
/// Bytes the program reads from the start of the frame.
pub const NEEDED: usize = L4_PAYLOAD + FRAG_HEADER + SEAL_HEADER + REQ_ID + 8;

/// The steering map's key for handler `handler` of `app`.
pub const fn steer_key(app: u32, handler: u32) -> u64 {
    ((app as u64) << 32) | handler as u64
}

/// Whether request `id` goes to the NIC under a per-mille NIC share: a hash of the id, so that
/// retransmissions of one request take the same way.
pub const fn picks_nic(id: u64, nic_permille: u32) -> bool {
    ((id.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) % 1000) < nic_permille as u64
}

/// The XDP program's decision for a NAAM message already in memory, from its first byte
/// after the fragment header (a sealed envelope) and the count of fragments it travels in:
/// whether a request goes to the NIC (its `PIN_*` flags, else `nic_permille` of its handler's
/// steering key, `None` when the map has no entry). Anything but a single-fragment sealed
/// request stays on its way to the host. For a switch that is not the kernel's (the
/// simulator's eSwitch); the XDP program checks the same fields at the same offsets.
pub fn steers_to_nic(
    message: &[u8],
    fragments: usize,
    nic_permille: impl FnOnce(u64) -> Option<u32>,
) -> bool {
    let u32_at = |at: usize| {
        message
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let req = SEAL_HEADER;
    if fragments != 1
        || message.get(SEAL_KIND) != Some(&KIND_SEALED)
        || message.get(req + REQ_KIND) != Some(&KIND_REQUEST)
    {
        return false;
    }
    let (Some(flags), Some(app), Some(handler), Some(id)) = (
        message
            .get(req + REQ_FLAGS..req + REQ_FLAGS + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]])),
        u32_at(req + REQ_APP),
        u32_at(req + REQ_HANDLER),
        message
            .get(req + REQ_ID..req + REQ_ID + 8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])),
    ) else {
        return false;
    };
    if flags & FLAG_PIN_HOST != 0 {
        false
    } else if flags & FLAG_PIN_NIC != 0 {
        true
    } else {
        nic_permille(steer_key(app, handler)).is_some_and(|share| picks_nic(id, share))
    }
}
