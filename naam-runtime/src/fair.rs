//! Per-app fair queueing of one placement's executor queue.
//!
//! One FIFO shared by every app lets a tenant with a deep backlog (a flood, or messages whose
//! handlers run to their instruction budget) put its whole backlog ahead of every other
//! tenant's next message. Here each app has its own FIFO, and executors take the next message
//! from the app that has used the least executor time, start-time fair queueing with the app as
//! the flow:
//! - every app carries a virtual time, the executor time it was charged; an app that becomes
//!   active again starts from the current virtual time, so idleness banks no credit;
//! - a message is charged when it is taken, at its app's running estimate of a message's cost
//!   (corrected as real service times come in through [`FairQueue::record`]), so a cheap app's
//!   messages pass an expensive app's backlog;
//! - admission is fair too: when the queue is full, a message of an app holding fewer messages
//!   than the longest backlog pushes out that backlog's newest message (whose caller is answered
//!   `Busy`), so a full queue never locks the others out.
//!
//! The scheduling core ([`FairState`]) is pure and tested on its own; [`FairQueue`] adds the
//! lock and the wake-ups executors block on.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a message is assumed to cost before its app's first one was measured, nanoseconds.
const FIRST_ESTIMATE_NS: u64 = 1_000;
/// Weight of a new measurement in an app's cost estimate (1/8).
const ESTIMATE_SHIFT: u32 = 3;

/// Why a message was not queued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PushError<T> {
    /// The queue is full and the message's app holds at least as many as any other.
    Full(T),
    /// The queue was closed.
    Closed(T),
}

/// One app's backlog.
#[derive(Debug)]
struct AppQueue<T> {
    items: VecDeque<T>,
    /// Executor time charged so far, on the queue's virtual clock.
    virtual_ns: u64,
    /// Running estimate of one message's cost, nanoseconds.
    estimate_ns: u64,
}

/// The scheduling core: per-app FIFOs, the order they are served in, and fair admission.
#[derive(Debug)]
pub(crate) struct FairState<T> {
    apps: HashMap<u32, AppQueue<T>>,
    /// Apps with queued messages, by (virtual time, app).
    active: BTreeSet<(u64, u32)>,
    /// Virtual time of the last message taken.
    now_ns: u64,
    len: usize,
    capacity: usize,
}

impl<T> FairState<T> {
    /// An empty queue holding at most `capacity` messages (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        FairState {
            apps: HashMap::new(),
            active: BTreeSet::new(),
            now_ns: 0,
            len: 0,
            capacity: capacity.max(1),
        }
    }

    /// Messages queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Messages of `app` queued.
    pub(crate) fn queued(&self, app: u32) -> usize {
        self.apps.get(&app).map_or(0, |a| a.items.len())
    }

    /// Queues `item` of `app`. When the queue is full, the newest message of the longest
    /// backlog makes room if that backlog is longer than `app`'s would be; it is returned so
    /// its caller can be told (`Ok(Some(..))`).
    pub(crate) fn push(&mut self, app: u32, item: T) -> Result<Option<(u32, T)>, PushError<T>> {
        let mut evicted = None;
        if self.len >= self.capacity {
            let mine = self.queued(app);
            let longest = self
                .apps
                .iter()
                .filter(|(&a, _)| a != app)
                .max_by_key(|(&a, q)| (q.items.len(), a))
                .map(|(&a, q)| (a, q.items.len()));
            match longest {
                Some((victim, n)) if n > mine + 1 => {
                    evicted = self.take_newest(victim).map(|t| (victim, t));
                }
                _ => return Err(PushError::Full(item)),
            }
        }
        let now = self.now_ns;
        let q = self.apps.entry(app).or_insert_with(|| AppQueue {
            items: VecDeque::new(),
            virtual_ns: now,
            estimate_ns: FIRST_ESTIMATE_NS,
        });
        if q.items.is_empty() {
            // Back from idle: no credit for the time it used nothing.
            q.virtual_ns = q.virtual_ns.max(now);
            self.active.insert((q.virtual_ns, app));
        }
        q.items.push_back(item);
        self.len += 1;
        Ok(evicted)
    }

    fn take_newest(&mut self, app: u32) -> Option<T> {
        let q = self.apps.get_mut(&app)?;
        let item = q.items.pop_back()?;
        self.len -= 1;
        if q.items.is_empty() {
            self.active.remove(&(q.virtual_ns, app));
        }
        Some(item)
    }

    /// The next message: the oldest of the app that was charged least. Its app is charged
    /// the app's current cost estimate.
    pub(crate) fn pop(&mut self) -> Option<(u32, T)> {
        let (v, app) = self.active.pop_first()?;
        let q = self.apps.get_mut(&app)?;
        let item = q.items.pop_front()?;
        self.len -= 1;
        self.now_ns = self.now_ns.max(v);
        q.virtual_ns = v.saturating_add(q.estimate_ns);
        if !q.items.is_empty() {
            self.active.insert((q.virtual_ns, app));
        }
        Some((app, item))
    }

    /// A message of `app` took `service_ns` of executor time: its cost estimate moves toward it.
    pub(crate) fn record(&mut self, app: u32, service_ns: u64) {
        if let Some(q) = self.apps.get_mut(&app) {
            let (old, new) = (q.estimate_ns as i128, service_ns.max(1) as i128);
            q.estimate_ns = (old + ((new - old) >> ESTIMATE_SHIFT)).max(1) as u64;
        }
    }

    /// Takes every queued message (shutdown).
    pub(crate) fn drain(&mut self) -> Vec<(u32, T)> {
        let mut out = Vec::with_capacity(self.len);
        while let Some(x) = self.pop() {
            out.push(x);
        }
        out
    }
}

/// A [`FairState`] shared by the threads that queue messages and the executors that take them.
pub(crate) struct FairQueue<T> {
    state: Mutex<FairState<T>>,
    ready: Condvar,
    /// Messages queued, readable without the lock (executors poll it).
    len: AtomicUsize,
    closed: AtomicBool,
}

impl<T> FairQueue<T> {
    /// An empty queue of `capacity` messages.
    pub(crate) fn new(capacity: usize) -> Self {
        FairQueue {
            state: Mutex::new(FairState::new(capacity)),
            ready: Condvar::new(),
            len: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FairState<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Messages queued.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `item` of `app` (see [`FairState::push`]); a pushed-out message comes back.
    pub(crate) fn push(&self, app: u32, item: T) -> Result<Option<(u32, T)>, PushError<T>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(PushError::Closed(item));
        }
        let mut s = self.lock();
        let r = s.push(app, item);
        self.len.store(s.len(), Ordering::Release);
        drop(s);
        if r.is_ok() {
            self.ready.notify_one();
        }
        r
    }

    /// The next message, if one is queued.
    pub(crate) fn try_pop(&self) -> Option<(u32, T)> {
        if self.is_empty() {
            return None;
        }
        let mut s = self.lock();
        let r = s.pop();
        self.len.store(s.len(), Ordering::Release);
        r
    }

    /// The next message: polls for `poll` (an executor that parks pays a wake-up), then waits
    /// up to `timeout` in all. `None` when nothing came or the queue is closed and empty.
    pub(crate) fn pop_timeout(&self, timeout: Duration, poll: Duration) -> Option<(u32, T)> {
        let start = Instant::now();
        loop {
            if let Some(x) = self.try_pop() {
                return Some(x);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return None;
            }
            if waited < poll {
                std::hint::spin_loop();
                continue;
            }
            let mut s = self.lock();
            if s.is_empty() {
                let (guard, _) = self
                    .ready
                    .wait_timeout(s, timeout - waited)
                    .unwrap_or_else(|e| e.into_inner());
                s = guard;
            }
            let r = s.pop();
            self.len.store(s.len(), Ordering::Release);
            if r.is_some() {
                return r;
            }
        }
    }

    /// A message of `app` took `service_ns` of executor time.
    pub(crate) fn record(&self, app: u32, service_ns: u64) {
        self.lock().record(app, service_ns);
    }

    /// Refuses new messages and wakes every waiting executor.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.ready.notify_all();
    }

    /// Takes every queued message.
    pub(crate) fn drain(&self) -> Vec<(u32, T)> {
        let mut s = self.lock();
        let r = s.drain();
        self.len.store(0, Ordering::Release);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_cheap_app_passes_an_expensive_backlog() {
        let mut q = FairState::new(1_000);
        // App 1 queues a backlog of messages measured at 1 ms each.
        for i in 0..100 {
            q.push(1, i).unwrap();
        }
        q.record(1, 1_000_000);
        for _ in 0..40 {
            q.record(1, 1_000_000);
        }
        let _ = q.pop();
        // App 2 arrives with cheap messages: they are taken before app 1's next.
        for i in 0..5 {
            q.push(2, 100 + i).unwrap();
        }
        let next: Vec<u32> = (0..5).map(|_| q.pop().unwrap().0).collect();
        assert!(next.iter().filter(|&&a| a == 2).count() >= 4, "{next:?}");
    }

    #[test]
    fn equal_apps_alternate() {
        let mut q = FairState::new(100);
        for i in 0..10 {
            q.push(1, i).unwrap();
            q.push(2, i).unwrap();
        }
        let order: Vec<u32> = std::iter::from_fn(|| q.pop().map(|(a, _)| a)).collect();
        for pair in order.chunks(2) {
            assert_ne!(pair[0], pair[1], "{order:?}");
        }
    }

    #[test]
    fn a_full_queue_pushes_out_the_longest_backlog_not_the_newcomer() {
        let mut q = FairState::new(4);
        for i in 0..4 {
            q.push(1, i).unwrap();
        }
        assert_eq!(q.push(2, 10), Ok(Some((1, 3))));
        assert_eq!(q.push(2, 11), Ok(Some((1, 2))));
        // Now 2 and 2: nobody's backlog is longer than app 2's would be.
        assert_eq!(q.push(2, 12), Err(PushError::Full(12)));
        assert_eq!(q.push(1, 4), Err(PushError::Full(4)));
        assert_eq!(q.len(), 4);
    }

    #[test]
    fn idleness_banks_no_credit() {
        let mut q = FairState::new(100);
        // App 1 works alone for a while...
        for i in 0..50 {
            q.push(1, i).unwrap();
            let _ = q.pop();
        }
        // ...then app 2, long idle, arrives with a backlog: it alternates with app 1
        // instead of owning the executors until its virtual time catches up.
        for i in 0..10 {
            q.push(2, i).unwrap();
            q.push(1, i).unwrap();
        }
        let first: Vec<u32> = (0..6).map(|_| q.pop().unwrap().0).collect();
        assert!(first.contains(&1) && first.contains(&2), "{first:?}");
    }

    #[test]
    fn blocking_pop_wakes_on_push_and_on_close() {
        let q = std::sync::Arc::new(FairQueue::new(8));
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.pop_timeout(Duration::from_secs(10), Duration::ZERO));
        std::thread::sleep(Duration::from_millis(20));
        q.push(3, "m").unwrap();
        assert_eq!(t.join().unwrap(), Some((3, "m")));
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.pop_timeout(Duration::from_secs(10), Duration::ZERO));
        std::thread::sleep(Duration::from_millis(20));
        q.close();
        assert_eq!(t.join().unwrap(), None);
        assert!(matches!(q.push(1, "late"), Err(PushError::Closed("late"))));
    }

    proptest! {
        /// Whatever the arrivals: nothing is lost or duplicated, each app's messages leave in
        /// the order they came, the queue never holds more than its capacity, and a refused
        /// message's app held at least as many as every other app.
        #[test]
        fn conserves_orders_and_bounds(ops in proptest::collection::vec((0u32..4, any::<bool>(), 0u64..5_000), 1..400), cap in 1usize..16) {
            let mut q = FairState::new(cap);
            let mut next_seq = [0u64; 4];
            let mut last_out = [None::<u64>; 4];
            let mut inside = std::collections::HashSet::new();
            for (app, pop, cost) in ops {
                if pop {
                    if let Some((a, (aa, seq))) = q.pop() {
                        prop_assert_eq!(a, aa);
                        prop_assert!(inside.remove(&(a, seq)));
                        prop_assert!(last_out[a as usize].is_none_or(|l| l < seq));
                        last_out[a as usize] = Some(seq);
                        q.record(a, cost);
                    }
                } else {
                    let seq = next_seq[app as usize];
                    next_seq[app as usize] += 1;
                    let before: Vec<usize> = (0..4).map(|a| q.queued(a)).collect();
                    match q.push(app, (app, seq)) {
                        Ok(evicted) => {
                            inside.insert((app, seq));
                            if let Some((v, (vv, vseq))) = evicted {
                                prop_assert_eq!(v, vv);
                                prop_assert!(before[v as usize] > before[app as usize] + 1);
                                prop_assert!(inside.remove(&(v, vseq)));
                            }
                        }
                        Err(PushError::Full(_)) => {
                            prop_assert_eq!(q.len(), cap);
                            for (a, n) in before.iter().enumerate() {
                                prop_assert!(a as u32 == app || *n <= before[app as usize] + 1);
                            }
                        }
                        Err(PushError::Closed(_)) => prop_assert!(false, "never closed"),
                    }
                }
                prop_assert!(q.len() <= cap);
                prop_assert_eq!(q.len(), inside.len());
            }
        }
    }
}
