//! Injected time. Decision code (executors' accounting, load trackers, steering) reads time only
//! through a [`Clock`], so a virtual clock can drive it deterministically.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use naam_proto::Nanos;

/// A source of monotonic time.
pub trait Clock: Send + Sync {
    /// Now, in nanoseconds since the clock's epoch.
    fn now(&self) -> Nanos;

    /// Returns once [`Clock::now`] reads `deadline` or later: the OS clock first yields the
    /// core (the writer a parked reader waits for may need it), then sleeps or spins; a virtual
    /// clock moves to `deadline` at once. Callers that wait (a parked step machine's retry) go
    /// through here, never through `thread::sleep`, so virtual time drives them too.
    fn wait_until(&self, deadline: Nanos);
}

/// The OS monotonic clock ([`Instant`]): nanoseconds since the clock was made.
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

    fn wait_until(&self, deadline: Nanos) {
        std::thread::yield_now();
        let left = deadline.saturating_sub(self.now());
        if left >= 50_000 {
            std::thread::sleep(std::time::Duration::from_nanos(left));
        } else {
            while self.now() < deadline {
                std::hint::spin_loop();
            }
        }
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

    fn wait_until(&self, deadline: Nanos) {
        self.set(deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_on_a_virtual_clock_moves_it_and_never_back() {
        let c = VirtualClock::new(1_000);
        c.wait_until(5_000_000_000);
        assert_eq!(c.now(), 5_000_000_000);
        c.wait_until(10);
        assert_eq!(c.now(), 5_000_000_000);
    }

    #[test]
    fn waiting_on_the_system_clock_reaches_the_deadline() {
        let c = SystemClock::new();
        let deadline = c.now() + 20_000;
        c.wait_until(deadline);
        assert!(c.now() >= deadline);
    }
}
