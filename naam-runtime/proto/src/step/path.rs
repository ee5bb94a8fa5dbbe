//! How a placement reaches the data a step needs: the traits its drivers implement, and the
//! cost model of the NIC's DMA.

use naam_ebpf::abi::Descriptor;

use super::engine::Grant;
use super::error::FetchError;
use crate::Placement;

/// Segments fetched for one step, and what fetching them cost.
pub struct Fetched<'a> {
    /// One grant per descriptor, in order (borrowed from the path's reused buffers).
    pub grants: &'a [Grant<'a>],
    /// Cost of the fetch, nanoseconds: modelled DMA, a measured READ round trip, or 0 for
    /// direct memory.
    pub cost_ns: u64,
}

/// How a placement reaches the data a step needs.
pub trait DataPath {
    /// The placement this path serves.
    fn placement(&self) -> Placement;
    /// Resolves `descs` against `app`'s regions and fetches them (the app scopes the rkeys:
    /// another tenant's key does not resolve).
    fn fetch(&mut self, app: u32, descs: &[Descriptor]) -> Result<Fetched<'_>, FetchError>;
    /// The segments of the last fetch, when they are the memory that writes change (the
    /// host's zero-copy grants, resolved with the rights each descriptor names): the write
    /// owner then applies a step's writes at those addresses without resolving each target
    /// again. `None`, the default, where the segments are copies (NIC buffers, one-sided
    /// reads). Only [`InPlace::new`], which is unsafe, makes the answer.
    fn segments_in_place(&self) -> Option<InPlace<'_>> {
        None
    }
}

/// A step's segments as region memory that its write owner may write at
/// ([`DataPath::segments_in_place`]). Made only by [`InPlace::new`], whose caller vouches for
/// the memory: whoever holds one may store through it.
#[derive(Clone, Copy, Debug)]
pub struct InPlace<'a> {
    segments: &'a [Grant<'a>],
}

impl<'a> InPlace<'a> {
    /// The segments `segments`, in the order of the step's descriptors.
    ///
    /// # Safety
    /// Each grant must be the range its descriptor resolved to inside region memory, with
    /// the rights the descriptor names: memory of whole 8-aligned words, accessed only
    /// through atomics by every thread, that stays mapped as long as `'a` and that the write
    /// owner may change.
    pub unsafe fn new(segments: &'a [Grant<'a>]) -> InPlace<'a> {
        InPlace { segments }
    }

    /// The segments, in the order of the step's descriptors.
    pub fn segments(&self) -> &'a [Grant<'a>] {
        self.segments
    }
}

/// A one-sided READ transport: fetch the bytes of several descriptors in one round trip.
pub trait OneSided {
    /// Reads `descs` of `app` into `bufs` (one per descriptor, resized to fit); returns the
    /// round-trip cost in nanoseconds (measured or modelled).
    fn read(
        &mut self,
        app: u32,
        descs: &[Descriptor],
        bufs: &mut [Vec<u8>],
    ) -> Result<u64, FetchError>;
}

/// Cost model of a DMA access from NIC cores to host memory: a fixed PCIe round trip plus a
/// per-byte transfer time. Defaults follow published BlueField-2 figures (about 1 µs for a
/// small DMA read across PCIe Gen4, about 10 GB/s sustained per engine); they are a model, not a
/// measurement on this machine.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct DmaModel {
    /// Fixed cost of one access, nanoseconds.
    pub access_ns: u64,
    /// Transfer cost, picoseconds per byte.
    pub ps_per_byte: u64,
}

impl Default for DmaModel {
    fn default() -> Self {
        DmaModel::new(1_000, 100)
    }
}

impl DmaModel {
    /// `access_ns` per access plus `ps_per_byte` picoseconds per byte moved.
    pub fn new(access_ns: u64, ps_per_byte: u64) -> DmaModel {
        DmaModel {
            access_ns,
            ps_per_byte,
        }
    }

    /// Modelled cost of reading `bytes` in one access.
    pub fn cost_ns(&self, bytes: u64) -> u64 {
        self.access_ns + bytes * self.ps_per_byte / 1000
    }
}
