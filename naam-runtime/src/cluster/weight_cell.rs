//! One handler's published steering weights, read by every client without a lock.
//!
//! The steering thread decides up to [`naam_proto::steering::DECISION_BUDGET`] apps' weights
//! each period. Clients read a handler's weights on every read they place. A table behind a
//! reader-writer lock made every client wait while the steering thread wrote a period's
//! changes into it, and at 10,000 apps those waits were the p99 (bench/RESULTS.md, "Scale to
//! 10,000 apps"). Each handler now has a cell of its own: a sequence lock over the three
//! fractions. The steering thread stores into cells; a reader retries only if it met a store
//! in progress, which lasts three relaxed stores.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use naam_proto::steering::Weights;

/// A handler's weights under a sequence lock. One writer at a time: the cluster's steering
/// (its first decision at build, then the thread or [`crate::cluster::Cluster::steer`],
/// never both), which stores while it holds the cluster's weight-changes mutex.
#[derive(Debug)]
pub(crate) struct WeightCell {
    /// Even: the fractions are whole. Odd: a store is in progress.
    seq: AtomicU64,
    /// The fractions' `f64` bits, by [`naam_proto::Placement::index`].
    parts: [AtomicU64; 3],
}

impl WeightCell {
    pub(crate) fn new(w: Weights) -> WeightCell {
        WeightCell {
            seq: AtomicU64::new(0),
            parts: w.0.map(|f| AtomicU64::new(f.to_bits())),
        }
    }

    /// The last weights stored whole.
    pub(crate) fn load(&self) -> Weights {
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 0 {
                let parts =
                    [0, 1, 2].map(|i| f64::from_bits(self.parts[i].load(Ordering::Relaxed)));
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == before {
                    return Weights(parts);
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Publishes `w`. The caller is the only writer (see the type's doc).
    pub(crate) fn store(&self, w: Weights) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        for (part, f) in self.parts.iter().zip(w.0) {
            part.store(f.to_bits(), Ordering::Relaxed);
        }
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use naam_proto::Placement;
    use std::sync::Arc;

    #[test]
    fn a_load_returns_what_was_stored() {
        let c = WeightCell::new(Weights::all(Placement::Host));
        assert_eq!(c.load(), Weights::all(Placement::Host));
        c.store(Weights([0.25, 0.25, 0.5]));
        assert_eq!(c.load(), Weights([0.25, 0.25, 0.5]));
    }

    /// A reader racing a writer sees only weights that were stored whole: every stored
    /// triple here is (x, x, 1 - 2x), so a torn read shows as unequal first two parts.
    #[test]
    fn a_reader_never_sees_a_torn_store() {
        let c = Arc::new(WeightCell::new(Weights([0.0, 0.0, 1.0])));
        let writer = {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..200_000u32 {
                    let x = f64::from(i % 1000) / 2000.0;
                    c.store(Weights([x, x, 1.0 - 2.0 * x]));
                }
            })
        };
        let mut reads = 0u64;
        while !writer.is_finished() || reads < 1000 {
            let w = c.load();
            assert_eq!(w.0[0], w.0[1], "torn read {w:?}");
            assert!((w.0.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            reads += 1;
        }
        writer.join().expect("writer");
    }
}
