//! Injected time. Decision code (executors' accounting, load trackers, steering) reads time only
//! through a [`Clock`], so a virtual clock can drive it deterministically.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub use naam_proto::Nanos;

/// A source of monotonic time.
pub trait Clock: Send + Sync {
    /// Now, in nanoseconds since the clock's epoch.
    fn now(&self) -> Nanos;
}

/// The OS monotonic clock.
#[derive(Debug)]
pub struct SystemClock {
    epoch: Instant,
}

impl SystemClock {
    /// A clock whose epoch is now.
    pub fn new() -> Self {
        SystemClock {
            epoch: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        self.epoch.elapsed().as_nanos() as Nanos
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct VirtualClock {
    now: AtomicU64,
}

impl VirtualClock {
    /// A virtual clock at `start`.
    pub fn new(start: Nanos) -> Self {
        VirtualClock {
            now: AtomicU64::new(start),
        }
    }

    /// Sets the time (never backwards).
    pub fn set(&self, t: Nanos) {
        self.now.fetch_max(t, Ordering::SeqCst);
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Nanos) {
        self.now.fetch_add(d, Ordering::SeqCst);
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
    }
}
