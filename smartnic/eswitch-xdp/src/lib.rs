//! The NAAM eSwitch as an XDP program, attached to the server's veth: single-fragment NAAM
//! requests to naam-server's port are steered to naam-nic's port by a per-(app, handler) share
//! in a BPF map that naam-server's steering controller keeps up to date, with per-destination
//! packet counters. Everything else passes untouched. It never drops a packet.
#![no_std]

use core::ffi::c_void;
use naam_ebpf::eswitch::{self as abi, Config, MapDef};

/// `struct xdp_md`.
#[repr(C)]
pub struct XdpMd {
    data: u32,
    data_end: u32,
    data_meta: u32,
    ingress_ifindex: u32,
    rx_queue_index: u32,
    egress_ifindex: u32,
}

const XDP_PASS: u32 = 2;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;

/// The switch's configuration (one entry).
#[unsafe(no_mangle)]
#[unsafe(link_section = "maps")]
pub static mut NAAM_ESWITCH_CONFIG: MapDef = MapDef {
    map_type: BPF_MAP_TYPE_ARRAY,
    key_size: 4,
    value_size: core::mem::size_of::<Config>() as u32,
    max_entries: 1,
    map_flags: 0,
    id: 0,
    pinning: 0,
};

/// NIC share per handler, per mille.
#[unsafe(no_mangle)]
#[unsafe(link_section = "maps")]
pub static mut NAAM_ESWITCH_STEER: MapDef = MapDef {
    map_type: BPF_MAP_TYPE_HASH,
    key_size: 8,
    value_size: 4,
    max_entries: abi::STEER_ENTRIES,
    map_flags: 0,
    id: 0,
    pinning: 0,
};

/// Packet counters per destination.
#[unsafe(no_mangle)]
#[unsafe(link_section = "maps")]
pub static mut NAAM_ESWITCH_COUNTERS: MapDef = MapDef {
    map_type: BPF_MAP_TYPE_PERCPU_ARRAY,
    key_size: 4,
    value_size: 8,
    max_entries: abi::COUNTERS,
    map_flags: 0,
    id: 0,
    pinning: 0,
};

/// GPL-compatible licence string the kernel reads (the helpers used need none; dual-licensed
/// so that the program may also use GPL-only helpers later).
#[unsafe(no_mangle)]
#[unsafe(link_section = "license")]
pub static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[inline(always)]
unsafe fn map_lookup(map: *mut MapDef, key: *const c_void) -> *mut c_void {
    // Helper 1, bpf_map_lookup_elem: a call through its id, which the BPF backend emits as
    // `call 1`.
    let f: unsafe extern "C" fn(*mut c_void, *const c_void) -> *mut c_void =
        unsafe { core::mem::transmute(1usize) };
    unsafe { f(map.cast(), key) }
}

#[inline(always)]
unsafe fn count(index: u32) {
    let p = unsafe {
        map_lookup(
            core::ptr::addr_of_mut!(NAAM_ESWITCH_COUNTERS),
            (&index as *const u32).cast(),
        )
    } as *mut u64;
    if !p.is_null() {
        unsafe { *p += 1 };
    }
}

#[inline(always)]
unsafe fn u16_be(p: *const u8) -> u16 {
    unsafe { ((*p as u16) << 8) | *p.add(1) as u16 }
}

#[inline(always)]
unsafe fn read_le<T: Copy>(p: *const u8) -> T {
    unsafe { core::ptr::read_unaligned(p.cast::<T>()) }
}

/// The XDP entry point.
///
/// # Safety
/// Called by the kernel with a valid `xdp_md`; every packet access is bounds-checked against
/// `data_end` first (the kernel's verifier proves it).
#[unsafe(no_mangle)]
#[unsafe(link_section = "xdp")]
pub unsafe extern "C" fn naam_eswitch(ctx: *mut XdpMd) -> u32 {
    unsafe { steer(ctx) };
    XDP_PASS
}

#[inline(always)]
unsafe fn steer(ctx: *mut XdpMd) {
    let zero: u32 = 0;
    let cfg = unsafe {
        map_lookup(
            core::ptr::addr_of_mut!(NAAM_ESWITCH_CONFIG),
            (&zero as *const u32).cast(),
        )
    } as *const Config;
    if cfg.is_null() {
        return;
    }
    let cfg = unsafe { *cfg };
    if cfg.enabled == 0 {
        return;
    }
    let data = unsafe { (*ctx).data } as usize;
    let end = unsafe { (*ctx).data_end } as usize;
    if data + abi::NEEDED > end {
        return;
    }
    let p = data as *mut u8;
    unsafe {
        // Ethernet: IPv4 only; IPv4 without options, not fragmented, UDP.
        if u16_be(p.add(12)) != 0x0800 || *p.add(14) != 0x45 || *p.add(23) != 17 {
            return;
        }
        if u16_be(p.add(20)) & 0x3fff != 0 {
            return;
        }
        if u16_be(p.add(36)) != cfg.server_port {
            return;
        }
        let frag = p.add(abi::L4_PAYLOAD);
        if read_le::<u32>(frag) != u32::from_le_bytes(*b"NAAM") {
            return;
        }
        if *frag.add(abi::FRAG_COUNT) != 1 {
            count(abi::COUNTER_FRAGMENTED);
            return;
        }
        let sealed = frag.add(abi::FRAG_HEADER);
        if *sealed.add(abi::SEAL_KIND) != abi::KIND_SEALED {
            return;
        }
        // The switch reads the request's routing fields through the envelope; the tag is the
        // receiver's to check (the NIC checks it as the host does).
        let req = sealed.add(abi::SEAL_HEADER);
        if *req.add(abi::REQ_KIND) != abi::KIND_REQUEST {
            return;
        }
        let flags: u16 = read_le(req.add(abi::REQ_FLAGS));
        let to_nic = if flags & abi::FLAG_PIN_HOST != 0 {
            false
        } else if flags & abi::FLAG_PIN_NIC != 0 {
            true
        } else {
            let key = abi::steer_key(read_le(req.add(abi::REQ_APP)), read_le(req.add(abi::REQ_HANDLER)));
            let share = map_lookup(
                core::ptr::addr_of_mut!(NAAM_ESWITCH_STEER),
                (&key as *const u64).cast(),
            ) as *const u32;
            !share.is_null() && abi::picks_nic(read_le(req.add(abi::REQ_ID)), *share)
        };
        if to_nic {
            // New destination port; IPv4 UDP may carry no checksum (0), which spares
            // recomputing it over the payload.
            let port = cfg.nic_port.to_be_bytes();
            *p.add(36) = port[0];
            *p.add(37) = port[1];
            *p.add(40) = 0;
            *p.add(41) = 0;
            count(abi::COUNTER_NIC);
        } else {
            count(abi::COUNTER_HOST);
        }
    }
}

#[panic_handler]
fn on_panic(_: &core::panic::PanicInfo) -> ! {
    // No code path panics (no indexing, no arithmetic that can overflow-check); this is
    // unreachable and removed by LTO.
    loop {}
}
