//! Size limits shared by every codec and driver, each defined once. The handler ABI's own caps
//! (args, state words, descriptors, reply) live in naam-ebpf's `abi` and are used from there.

use naam_ebpf::abi::{ARGS_CAP, MAX_NEXT, REPLY_CAP, STATE_WORDS};

/// Fixed request header size.
pub const REQUEST_HEADER: usize = 32;
/// Fixed reply header size, load feedback included.
pub const REPLY_HEADER: usize = 56;
/// Size of one encoded descriptor.
pub const DESCRIPTOR_SIZE: usize = 24;
/// Largest encoded request: full args, state words, descriptors and a partial reply.
pub const MAX_REQUEST: usize =
    REQUEST_HEADER + ARGS_CAP + 8 * STATE_WORDS + DESCRIPTOR_SIZE * MAX_NEXT + REPLY_CAP;
/// Largest encoded reply.
pub const MAX_REPLY: usize = REPLY_HEADER + REPLY_CAP;
/// Largest message the datagram framing carries once reassembled, sealing included: any
/// request, reply, one-sided operation or control message must fit.
pub const MAX_MESSAGE: usize = 8 * 1024;
/// Largest payload of one one-sided operation or completion (a READ's ranges together, or a
/// WRITE's bytes), so that an operation and its completion fit in [`MAX_MESSAGE`].
pub const MAX_TRANSFER: usize = 7 * 1024;
/// Object bytes one [`crate::control::Control::DeployChunk`] carries: hex-encoded in JSON,
/// they fit a control message with room for its other fields.
pub const DEPLOY_CHUNK: usize = 3 * 1024;
/// The largest object a tenant may upload for a deploy (a server's code quota may allow
/// less).
pub const MAX_DEPLOY_OBJECT: usize = 1 << 20;
/// Deploys and undeploys a tenant may make a second on one server by default
/// ([`crate::endpoint::ServerConfig::deploys_per_second`]).
pub const DEPLOYS_PER_SECOND: f64 = 10.0;
/// Bytes a control message from a tenant refused for its deploy rate may have, until the
/// wait its refusal named is over: larger ones (upload chunks, 6 KB) are dropped unread, so
/// a tenant that ignores the wait cannot make a receive loop decode its uploads. Queries and
/// the deploy request itself are smaller.
pub const MUTED_CONTROL_BYTES: usize = 1024;
/// Bytes of a handler's name a deploy may give it (with [`MAX_DEPLOY_HANDLERS`], the
/// answer's reports and the app's manifest page stay within a message).
pub const MAX_HANDLER_NAME: usize = 64;
/// Handlers one deploy may install: their reports fit one answer.
pub const MAX_DEPLOY_HANDLERS: usize = 16;
/// Regions an app created at run time may have ([`crate::control::Control::CreateApp`]): the
/// cluster makes room in its region table for this many per app it may create.
pub const MAX_CREATED_APP_REGIONS: usize = 16;
/// Bytes of the name of an app or region a tenant creates at run time; names are ASCII
/// letters, digits, `-` and `_` (they become file names in the server's `shm_dir`).
pub const MAX_CREATED_NAME: usize = 48;
/// Bytes sealing adds to a message: the envelope header and the authentication tag.
pub const SEAL_OVERHEAD: usize = naam_ebpf::eswitch::SEAL_HEADER + SEAL_TAG;
/// Length of a sealed envelope's authentication tag (AES-256-GCM's).
pub const SEAL_TAG: usize = 16;
/// Bytes at the start of a sealed message left in the clear (authenticated, not encrypted):
/// a request's kind, flags, app, handler and id, which a switch in front of the server (the
/// XDP eSwitch) steers by. The rest is encrypted.
pub const SEAL_CLEAR: usize = 24;
const _: () = assert!(naam_ebpf::eswitch::REQ_ID + 8 <= SEAL_CLEAR);

const _: () = assert!(MAX_REQUEST + SEAL_OVERHEAD <= MAX_MESSAGE);
const _: () = assert!(MAX_REPLY + SEAL_OVERHEAD <= MAX_MESSAGE);
const _: () = assert!(MAX_TRANSFER + 64 + SEAL_OVERHEAD <= MAX_MESSAGE);

/// Requests a session may have waiting at the server by default (its in-flight credit, the
/// window its client keeps): deep enough for a client pipelining 32 requests with room for a
/// burst of retransmissions.
pub const SESSION_CREDIT: u32 = 64;

/// Requests all sessions of one tenant may have waiting at the server together by default.
pub const TENANT_CREDIT: u32 = 256;

/// How long a session's refusals over its credit are counted together, nanoseconds.
pub const FLOOD_WINDOW: crate::Nanos = 100_000_000;
/// A session refused more than this many times its credit (and more than
/// [`FLOOD_MIN_REFUSALS`]) within [`FLOOD_WINDOW`] ignores `Busy` (a client that honours it is
/// refused about a window's worth at most, then backs off).
pub const FLOOD_FACTOR: u32 = 4;
/// The fewest refusals within [`FLOOD_WINDOW`] that make a session a flooder, whatever its
/// credit.
pub const FLOOD_MIN_REFUSALS: u32 = 256;
/// How long a session that ignores `Busy` goes unheard: its datagrams are dropped before they
/// are opened. Nanoseconds.
pub const FLOOD_MUTE: crate::Nanos = 20_000_000;

/// Datagrams without a session (hellos, auths, strays) the server looks at per second, from
/// everyone together; beyond it they are dropped before any work.
pub const STRANGER_RATE: f64 = 5_000.0;
/// How many of [`STRANGER_RATE`] may come at once.
pub const STRANGER_BURST: f64 = 512.0;
/// Datagrams without a session the server looks at per second from one IP address.
pub const STRANGER_RATE_PER_IP: f64 = 500.0;
/// How many of [`STRANGER_RATE_PER_IP`] may come at once.
pub const STRANGER_BURST_PER_IP: f64 = 128.0;
/// IP addresses whose stranger budget is tracked at once (the table starts afresh when full).
pub const STRANGER_IPS: usize = 4096;

/// App ids one tenant session may name ([`crate::control::app_runs`]): past the 10,000 apps
/// of one tenant a server is measured with.
pub const MAX_SESSION_APPS: usize = 65_536;

/// Receive loops one server may run (one socket each in an `SO_REUSEPORT` group, sessions
/// sharded over them by the low byte of their ids: [`crate::shard`]).
pub const MAX_LOOPS: usize = 64;

/// How often an idle NIC reports that it is still there: its heartbeat, nanoseconds. Reports
/// of work come every report period; one that would say "nothing ran" waits for this.
pub const NIC_IDLE_REPORT: crate::Nanos = 20_000_000;

/// How long a NIC may stay silent before the server takes it out of the weights: three
/// heartbeats, nanoseconds.
pub const NIC_SILENCE: crate::Nanos = 3 * NIC_IDLE_REPORT;

/// Refusals of pairing in a row after which naam-nic stops (exit 2): the server answered each
/// attempt, so it is there, and refused the secret every time (about a second of retries).
pub const NIC_PAIRING_REFUSALS: u32 = 10;
