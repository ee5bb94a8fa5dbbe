//! The rack in virtual time: every node has one full-duplex link to a top-of-rack switch. A
//! message leaves its sender as the frames its bytes need at the profile's MTU, is serialised on
//! the sender's link (each direction a FIFO at the link's bandwidth), crosses the switch, is
//! serialised again on the receiver's link when that is free, and arrives whole when its last
//! frame does; it is lost when any of its frames is (each with the profile's probability, drawn
//! from the simulation's seeded generator). Pure: times are arguments and results.

use crate::sim::profile::Profile;
use crate::ycsb::Rng;
use naam_runtime::proto::Nanos;

/// Bytes each Ethernet frame carries beyond its IP packet: preamble and start delimiter (8),
/// header (14), frame check (4) and the inter-frame gap (12).
const ETHERNET_OVERHEAD: usize = 38;
/// IPv4 and UDP headers of each datagram.
const IP_UDP_HEADERS: usize = 28;

/// One direction of a link: when it is next free.
#[derive(Clone, Copy, Debug, Default)]
struct Wire {
    free_at: Nanos,
}

/// The links of `nodes` nodes and the switch between them.
#[derive(Debug)]
pub struct Rack {
    /// Per node: its link towards the switch, and the switch's port towards it.
    up: Vec<Wire>,
    down: Vec<Wire>,
    ps_per_byte: f64,
    propagation_ns: Nanos,
    switch_ns: Nanos,
    /// Bytes of a message's payload per frame (MTU less the IP, UDP and fragment headers).
    payload_per_frame: usize,
    loss: f64,
    /// Frames sent.
    pub frames: u64,
    /// Frames lost.
    pub lost_frames: u64,
    /// Bytes serialised on the links, both hops.
    pub wire_bytes: u64,
}

impl Rack {
    /// A rack of `nodes` nodes under `profile`.
    pub fn new(profile: &Profile, nodes: usize) -> Rack {
        Rack {
            up: vec![Wire::default(); nodes],
            down: vec![Wire::default(); nodes],
            ps_per_byte: 8_000.0 / profile.link.bandwidth_gbps,
            propagation_ns: profile.link.propagation_ns,
            switch_ns: profile.switch.latency_ns,
            payload_per_frame: profile.link.mtu
                - IP_UDP_HEADERS
                - naam_runtime::proto::frame::HEADER,
            loss: profile.link.loss,
            frames: 0,
            lost_frames: 0,
            wire_bytes: 0,
        }
    }

    /// Frames a message of `len` bytes travels in.
    pub fn fragments(&self, len: usize) -> usize {
        len.div_ceil(self.payload_per_frame).max(1)
    }

    /// Frames and wire bytes of a message of `len` bytes.
    fn frames_of(&self, len: usize) -> (u64, u64) {
        let frames = len.div_ceil(self.payload_per_frame).max(1);
        let bytes = len
            + frames * (naam_runtime::proto::frame::HEADER + IP_UDP_HEADERS + ETHERNET_OVERHEAD);
        (frames as u64, bytes as u64)
    }

    fn serialise(&self, bytes: u64) -> Nanos {
        ((bytes as f64 * self.ps_per_byte) / 1_000.0).ceil() as Nanos
    }

    /// Sends `len` bytes from node `from` to node `to` at `now`: when the message arrives
    /// whole, or `None` if a frame of it was lost.
    pub fn send(
        &mut self,
        now: Nanos,
        from: usize,
        to: usize,
        len: usize,
        rng: &mut Rng,
    ) -> Option<Nanos> {
        let (frames, bytes) = self.frames_of(len);
        let ser = self.serialise(bytes);
        self.frames += frames;
        self.wire_bytes += 2 * bytes;
        let first = self.serialise(bytes / frames);
        let up = &mut self.up[from];
        let start_up = now.max(up.free_at);
        let sent = start_up + ser;
        up.free_at = sent;
        // Cut-through: the switch forwards a frame once it is in, so the receiver's port may
        // start as soon as the first frame has crossed; it cannot finish before the last one
        // has, and it serialises messages one after another.
        let hop = self.propagation_ns + self.switch_ns;
        let down = &mut self.down[to];
        let start_down = (start_up + first + hop).max(down.free_at);
        let finished = (start_down + ser).max(sent + hop + first);
        down.free_at = finished;
        let delivered = finished;
        // Each frame may be lost on either hop.
        let mut lost = 0;
        if self.loss > 0.0 {
            for _ in 0..frames * 2 {
                if rng.next_f64() < self.loss {
                    lost += 1;
                }
            }
        }
        if lost > 0 {
            self.lost_frames += lost;
            return None;
        }
        Some(delivered + self.propagation_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rack(nodes: usize) -> Rack {
        Rack::new(&Profile::load("bluefield2-100g").unwrap(), nodes)
    }

    #[test]
    fn a_small_message_takes_two_hops_and_the_switch() {
        let mut r = rack(2);
        let mut rng = Rng::new(1);
        let at = r.send(0, 0, 1, 64, &mut rng).unwrap();
        // 64 B + headers = 153 B: 12.24 ns a hop at 100 Gb/s; 2 x 510 ns of propagation and
        // 300 ns of switch.
        assert!((1_330..1_360).contains(&at), "{at}");
    }

    #[test]
    fn messages_queue_behind_each_other_on_a_busy_port() {
        let mut r = rack(3);
        let mut rng = Rng::new(1);
        // Two senders, one receiver, 1 MB each: the receiver's port is the bottleneck.
        let a = r.send(0, 0, 2, 1_000_000, &mut rng).unwrap();
        let b = r.send(0, 1, 2, 1_000_000, &mut rng).unwrap();
        let one = r.serialise(r.frames_of(1_000_000).1);
        assert!(b >= a + one - 1, "{a} {b} {one}");
        assert!(r.frames > 1_000);
    }

    #[test]
    fn loss_drops_whole_messages_at_the_profiles_rate() {
        let mut p = Profile::load("bluefield2-100g").unwrap();
        p.link.loss = 0.1;
        let mut r = Rack::new(&p, 2);
        let mut rng = Rng::new(7);
        let lost = (0..10_000)
            .filter(|i| r.send(*i * 1_000, 0, 1, 100, &mut rng).is_none())
            .count();
        // Two frames' chances (each hop): 1 - 0.9^2 = 19%.
        assert!((1_700..2_100).contains(&lost), "{lost}");
    }
}
