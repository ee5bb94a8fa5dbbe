//! The tiered engine ([`naam_proto::EngineKind::Tiered`]): a handler runs on the interpreter
//! as soon as it is verified, while one background thread of the process, at the lowest
//! scheduling priority, compiles it (or finds it in the code cache); the JIT's code is then
//! published once, and every later step of the handler runs on it. Both engines give the same
//! results, faults and instruction counts, so the switch can fall between any two steps.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::interp::InterpCode;
use crate::jit::HostCode;

use super::cache::{CodeCache, CodeKey};
use super::Prepared;

/// One background compilation.
type Job = Box<dyn FnOnce() + Send>;

/// A tiered handler's two codes: the interpreter's at once, the JIT's when published.
pub(crate) struct TierUp {
    interp: InterpCode,
    jit: OnceLock<Arc<HostCode>>,
    /// Time from the build's start to the JIT's code, or why it could not be compiled.
    outcome: OnceLock<Result<Duration, String>>,
    started: Instant,
    /// Set (and waiters woken) once `outcome` is.
    done: Mutex<bool>,
    finished: Condvar,
}

impl TierUp {
    /// A handler served by `interp` now; its JIT code comes from `cache` (at once when
    /// another executable holds it in memory, else from the background thread).
    pub(super) fn start(
        key: CodeKey,
        interp: InterpCode,
        prepared: &Arc<Prepared>,
        cache: &Arc<CodeCache>,
        started: Instant,
    ) -> Arc<TierUp> {
        let tier = Arc::new(TierUp {
            interp,
            jit: OnceLock::new(),
            outcome: OnceLock::new(),
            started,
            done: Mutex::new(false),
            finished: Condvar::new(),
        });
        if let Some(code) = cache.in_memory_code(&key) {
            tier.publish(Ok(code));
            return tier;
        }
        let weak: Weak<TierUp> = Arc::downgrade(&tier);
        let (prepared, cache) = (prepared.clone(), cache.clone());
        let job: Job = Box::new(move || {
            // A handler dropped before its turn (undeployed, replaced) is not compiled.
            let Some(tier) = weak.upgrade() else {
                return;
            };
            let code = cache.host_code(&key, &prepared);
            tier.publish(code.map_err(|e| e.to_string()));
        });
        if let Err(job) = submit(job) {
            // No compiler thread (the process could not start one): compile here, as the
            // JIT engine would have.
            job();
        }
        tier
    }

    fn publish(&self, code: Result<Arc<HostCode>, String>) {
        let outcome = match code {
            Ok(code) => {
                let _ = self.jit.set(code);
                Ok(self.started.elapsed())
            }
            Err(why) => Err(why),
        };
        let _ = self.outcome.set(outcome);
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        *done = true;
        self.finished.notify_all();
    }

    /// The interpreter's code.
    pub(super) fn interp(&self) -> &InterpCode {
        &self.interp
    }

    /// The JIT's code, once published.
    #[inline(always)]
    pub(super) fn jit(&self) -> Option<&Arc<HostCode>> {
        self.jit.get()
    }

    /// Time from the build's start to the JIT's code.
    pub(super) fn ready_after(&self) -> Option<Duration> {
        self.outcome.get().and_then(|o| o.as_ref().ok().copied())
    }

    /// Why the background compilation failed.
    pub(super) fn failure(&self) -> Option<&str> {
        self.outcome
            .get()
            .and_then(|o| o.as_ref().err().map(String::as_str))
    }

    /// Waits up to `timeout` for the JIT's code; whether it is ready.
    pub(super) fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            done = self
                .finished
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        self.jit.get().is_some()
    }
}

/// Hands `job` to the process's compiler thread (started on first use); gives it back when
/// there is no such thread.
fn submit(job: Job) -> Result<(), Job> {
    static COMPILER: OnceLock<Option<Mutex<mpsc::Sender<Job>>>> = OnceLock::new();
    let sender = COMPILER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("naam-jit".into())
            .spawn(move || {
                lowest_priority();
                for job in rx {
                    job();
                }
            })
            .ok()
            .map(|_| Mutex::new(tx))
    });
    match sender {
        Some(tx) => tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .map_err(|e| e.0),
        None => Err(job),
    }
}

/// Puts the calling thread at the lowest scheduling priority (nice 19), so compiling never
/// takes a core from a thread serving requests. (On Linux a nice value is a thread's.)
fn lowest_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority with `who` 0 changes the calling thread's nice value only; its
    // failure (a sandbox that forbids it) leaves the priority as it was.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS as _, 0, 19);
    }
}
