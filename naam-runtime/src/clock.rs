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

/// The machine's monotonic time: nanoseconds since the clock was made. On x86-64 with an
/// invariant time-stamp counter (one rate on every core, in every power state) it reads the
/// counter, scaled by a rate measured once per process against [`Instant`]: about 10 ns a
/// read where `clock_gettime` costs 25 ns or more in a VM, which matters when every message
/// reads the clock. Elsewhere it reads [`Instant`].
#[derive(Clone, Copy, Debug)]
pub struct SystemClock {
    epoch: Instant,
    /// The counter at the epoch, when the counter is used.
    epoch_ticks: Option<u64>,
}

impl SystemClock {
    /// A clock whose epoch is now.
    pub fn new() -> Self {
        SystemClock {
            epoch_ticks: tsc::rate().map(|_| tsc::ticks()),
            epoch: Instant::now(),
        }
    }

    /// The process's clock: every clock this returns has one epoch (when the first was
    /// made), so what one thread reads on it another may use as its own reading (a request
    /// handed from a client's thread to a server endpoint in the same process carries the
    /// time its client read, and the server reads no clock again).
    pub fn of_process() -> Self {
        static PROCESS: std::sync::OnceLock<SystemClock> = std::sync::OnceLock::new();
        *PROCESS.get_or_init(SystemClock::new)
    }
}

/// The time-stamp counter: whether it can be a clock here, and its rate.
mod tsc {
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    /// Nanoseconds per tick as a 32.32 fixed-point number, when the counter is invariant.
    pub(super) fn rate() -> Option<u64> {
        static RATE: OnceLock<Option<u64>> = OnceLock::new();
        *RATE.get_or_init(measure)
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) fn ticks() -> u64 {
        // SAFETY: RDTSC exists on every x86-64 processor and has no side effects.
        unsafe { core::arch::x86_64::_rdtsc() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(super) fn ticks() -> u64 {
        0
    }

    #[cfg(target_arch = "x86_64")]
    fn invariant() -> bool {
        use core::arch::x86_64::__cpuid;
        // Leaf 0x8000_0000 says which extended leaves exist; 0x8000_0007 EDX bit 8 is the
        // invariant-TSC flag.
        __cpuid(0x8000_0000).eax >= 0x8000_0007 && __cpuid(0x8000_0007).edx & (1 << 8) != 0
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn invariant() -> bool {
        false
    }

    /// Counts ticks over about 2 ms of [`Instant`] time, between two moments each read on
    /// both clocks at once ([`paired`]). A thread preempted between reading one clock and the
    /// other would otherwise count the pause on one side only: half a millisecond of it at
    /// the start made the clock run 25% fast for the whole process (seen on a busy VM).
    fn measure() -> Option<u64> {
        if !invariant() {
            return None;
        }
        let (t0, c0) = paired();
        while t0.elapsed() < Duration::from_millis(2) {
            std::hint::spin_loop();
        }
        let (t1, c1) = paired();
        let ticks = c1.checked_sub(c0).filter(|&t| t > 0)?;
        let rate = (t1.duration_since(t0).as_nanos() << 32) / ticks as u128;
        u64::try_from(rate).ok().filter(|&r| r > 0)
    }

    /// An [`Instant`] and the tick count of the same moment ([`at_once`]).
    fn paired() -> (Instant, u64) {
        // A few microseconds at most, even where reading the time is a system call.
        super::at_once(ticks, 10_000)
    }
}

/// An [`Instant`] and what `read` gives at the same moment: `read` just before and just
/// after the `Instant`, the narrowest of a few tries (a pause between the reads widens them;
/// a pair within `enough` ends the search). `read` counts up; a pair that goes backwards
/// (another core's counter a little behind) is skipped.
fn at_once(read: impl Fn() -> u64, enough: u64) -> (Instant, u64) {
    let mut best = (u64::MAX, Instant::now(), read());
    for _ in 0..64 {
        let before = read();
        let at = Instant::now();
        let after = read();
        let Some(width) = after.checked_sub(before) else {
            continue;
        };
        if width < best.0 {
            best = (width, at, before + width / 2);
        }
        if width < enough {
            break;
        }
    }
    (best.1, best.2)
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Nanos {
        match (self.epoch_ticks, tsc::rate()) {
            (Some(at), Some(rate)) => {
                ((tsc::ticks().saturating_sub(at) as u128 * rate as u128) >> 32) as Nanos
            }
            _ => self.epoch.elapsed().as_nanos() as Nanos,
        }
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
    fn the_system_clock_keeps_pace_with_the_os_clock() {
        let c = SystemClock::new();
        // Both clocks read at each end at once, so a pause between reads counts on neither.
        let (t0, n0) = at_once(|| c.now(), 20_000);
        std::thread::sleep(std::time::Duration::from_millis(30));
        let (t1, n1) = at_once(|| c.now(), 20_000);
        let (os, ours) = (
            t1.duration_since(t0).as_nanos() as f64,
            n1.saturating_sub(n0) as f64,
        );
        assert!((ours / os - 1.0).abs() < 0.05, "{ours} ns against {os} ns");
    }

    #[test]
    fn clocks_of_the_process_read_one_time() {
        // Made apart, read apart: a reading on one is a reading on the other.
        let a = SystemClock::of_process();
        let before = a.now();
        let b = SystemClock::of_process();
        let between = b.now();
        let after = a.now();
        assert!(
            before <= between && between <= after,
            "{before} {between} {after}"
        );
    }

    #[test]
    fn waiting_on_the_system_clock_reaches_the_deadline() {
        let c = SystemClock::new();
        let deadline = c.now() + 20_000;
        c.wait_until(deadline);
        assert!(c.now() >= deadline);
    }
}
