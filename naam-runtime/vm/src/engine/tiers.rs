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

/// Makes the analysed preparation a tiered handler's JIT code is compiled from.
pub(super) type Analyse = Box<dyn FnOnce() -> Arc<Prepared> + Send>;

/// A tiered handler's two codes: the interpreter's at once, the JIT's when published.
pub(crate) struct TierUp {
    interp: InterpCode,
    jit: OnceLock<Arc<HostCode>>,
    /// The program with its analysis, once the background job has made it.
    analysed: OnceLock<Arc<Prepared>>,
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
        analyse: Analyse,
        cache: &Arc<CodeCache>,
        started: Instant,
    ) -> Arc<TierUp> {
        let tier = Arc::new(TierUp {
            interp,
            jit: OnceLock::new(),
            analysed: OnceLock::new(),
            outcome: OnceLock::new(),
            started,
            done: Mutex::new(false),
            finished: Condvar::new(),
        });
        // Code another executable of the program holds is used at once; the analysis (for
        // the handler's facts) still runs in the background.
        if let Some(code) = cache.in_memory_code(&key) {
            tier.publish(Ok(code));
        }
        let weak: Weak<TierUp> = Arc::downgrade(&tier);
        let cache = cache.clone();
        let job: Job = Box::new(move || {
            // A handler dropped before its turn (undeployed, replaced) is not analysed or
            // compiled.
            let Some(tier) = weak.upgrade() else {
                return;
            };
            let prepared = tier.analysed.get_or_init(analyse).clone();
            if tier.jit.get().is_none() {
                let code = cache.host_code(&key, &prepared);
                tier.publish(code.map_err(|e| e.to_string()));
            }
        });
        if let Err(job) = submit(job) {
            // No compiler thread (the process could not start one): compile here, as the
            // JIT engine would have.
            job();
        }
        tier
    }

    /// The program with its analysis, once the background job has made it.
    pub(super) fn analysed(&self) -> Option<&Prepared> {
        self.analysed.get().map(|p| &**p)
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

/// Puts the calling thread at the lowest scheduling priority, so that compiling (or verifying
/// a deploy) never takes a core from a thread serving requests: Linux's `SCHED_IDLE` policy,
/// which any other thread waking up preempts at once (at nice 19 under the ordinary policy,
/// a compile still ran out its time slice first, and a request waited milliseconds behind
/// it; bench/RESULTS.md, "Deploys at run time"), else nice 19. (On Linux both are a thread's.)
/// Then it yields: lowering its own priority does not make the scheduler look at threads
/// already waiting for this core, and a thread that just started went on ahead of them.
pub fn lowest_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: sched_setscheduler and setpriority with pid/who 0 change the calling thread's
    // policy and nice value only; lowering them needs no privilege, and a failure (a sandbox
    // that forbids it) leaves them as they were; sched_yield only gives up the core.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            libc::setpriority(libc::PRIO_PROCESS as _, 0, 19);
        }
        libc::sched_yield();
    }
}
