//! Executable memory: compiled host code mapped read+execute, and its entry point.

use std::time::Duration;

use super::{Compiled, JitError, Target};

/// Page-aligned memory holding compiled code, read+execute once sealed.
pub struct ExecMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: after sealing the mapping is immutable code; sharing it between threads is sharing
// read-only memory.
unsafe impl Send for ExecMemory {}
// SAFETY: as above.
unsafe impl Sync for ExecMemory {}

impl ExecMemory {
    /// Maps `code`, then seals it read+execute.
    pub fn new(code: &[u8]) -> Result<ExecMemory, JitError> {
        let page = 4096;
        let len = code.len().max(1).div_ceil(page) * page;
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(JitError::Memory(format!("mmap of {len} bytes failed")));
        }
        let mem = ExecMemory {
            ptr: ptr.cast(),
            len,
        };
        // SAFETY: the mapping is `len >= code.len()` writable bytes we own.
        unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), mem.ptr, code.len()) };
        // SAFETY: our own mapping of `len` bytes.
        let rc = unsafe { libc::mprotect(ptr, len, libc::PROT_READ | libc::PROT_EXEC) };
        if rc != 0 {
            return Err(JitError::Memory(
                "mprotect(PROT_READ | PROT_EXEC) failed".into(),
            ));
        }
        // Instruction caches are not coherent with data writes on Arm: make the new code
        // visible to instruction fetch on every core before anyone runs it.
        // SAFETY: the range is our own mapping, fully written above.
        unsafe { wasmtime_jit_icache_coherence::clear_cache(ptr.cast_const(), code.len()) }
            .map_err(|e| JitError::Memory(format!("instruction cache flush: {e}")))?;
        wasmtime_jit_icache_coherence::pipeline_flush_mt()
            .map_err(|e| JitError::Memory(format!("pipeline flush: {e}")))?;
        Ok(mem)
    }

    /// Address of byte `offset`.
    pub fn addr(&self, offset: usize) -> usize {
        self.ptr as usize + offset
    }
}

impl Drop for ExecMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; nothing runs its code any more (its owner, the
        // executable, is being dropped).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The entry point of host code: `(ctx, r1, r2) -> r0`. The frame pointer is not an
/// argument: it is the top of `ctx`'s own stack ([`crate::memory::layout::STACK_TOP`]).
pub type EntryFn = extern "C" fn(*mut crate::memory::VmCtx, u64, u64) -> u64;

/// Compiled code mapped executable in this process.
pub struct HostCode {
    mem: ExecMemory,
    entry: usize,
    /// What was compiled.
    pub compiled_len: usize,
    /// Time spent in translation and code generation ([`Compiled::compile_time`]).
    pub compile_time: Duration,
}

impl HostCode {
    /// Maps host code.
    pub fn new(compiled: &Compiled) -> Result<HostCode, JitError> {
        if compiled.target != Target::Host {
            return Err(JitError::Isa {
                target: compiled.target.name(),
                reason:
                    "only host code runs in this process (run aarch64 code with naam_vm::cross)"
                        .into(),
            });
        }
        let mem = ExecMemory::new(&compiled.code)?;
        Ok(HostCode {
            entry: mem.addr(compiled.entry),
            mem,
            compiled_len: compiled.code.len(),
            compile_time: compiled.compile_time,
        })
    }

    /// The entry function; its code is unmapped when `self` drops.
    pub fn entry(&self) -> EntryFn {
        let _ = &self.mem;
        // SAFETY: `entry` is the address of the entry function Cranelift compiled with the
        // host's default calling convention and `EntryFn`'s signature, inside `mem`, which
        // lives as long as `self`.
        unsafe { std::mem::transmute::<usize, EntryFn>(self.entry) }
    }
}

impl std::fmt::Debug for HostCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCode")
            .field("bytes", &self.compiled_len)
            .field("compile_time", &self.compile_time)
            .finish()
    }
}
