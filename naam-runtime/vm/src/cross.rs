//! Running aarch64 code on a machine that is not aarch64: JIT output for BlueField-2's
//! Cortex-A72 cores, executed under qemu-user inside a small C harness (`harness/aarch64.c`,
//! cross-compiled by the build script) that maps an [`Image`] of the invocation, installs C
//! mirrors of the helpers, calls the entry and prints the memory it left.
//!
//! What this proves, and what it does not: the generated A64 instructions compute what the
//! interpreter computes and never touch memory the grants do not allow, as qemu executes
//! them. It says nothing about speed, and qemu does not model the A72's memory ordering; only
//! a BlueField-2 can measure those.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use std::sync::Arc;

use naam_ebpf::abi::WriteOp;
use naam_proto::step::{Engine, Invocation, StepFault, StepResult};

use crate::engine::{step_fault, Image, VmError};
use crate::helpers::HelperSet;
use crate::jit::{Compiled, Target};
use crate::memory::{VmCtx, HARNESS_MAGIC};
use crate::{Executable, HandlerEngine, NextStep, StepError, StepOutput, Vm};

/// The cross-compiled harness, when the build machine had `aarch64-linux-gnu-gcc`.
#[cfg(naam_aarch64_harness)]
const HARNESS: Result<&[u8], &str> = Ok(include_bytes!(env!("NAAM_AARCH64_HARNESS")));
#[cfg(not(naam_aarch64_harness))]
const HARNESS: Result<&[u8], &str> = Err(env!("NAAM_AARCH64_HARNESS_MISSING"));

/// Why an aarch64 run could not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CrossError {
    /// naam-vm was built without the cross compiler.
    #[error("the aarch64 harness was not built: {0}; scripts/setup.sh installs gcc-aarch64-linux-gnu, then rebuild naam-vm")]
    NoHarness(String),
    /// qemu-aarch64 is missing.
    #[error("cannot start {program}: {reason}; scripts/setup.sh installs qemu-user (or set NAAM_QEMU_AARCH64)")]
    NoQemu {
        /// The command tried: `NAAM_QEMU_AARCH64`, else `qemu-aarch64`.
        program: String,
        /// Why it failed.
        reason: String,
    },
    /// The code is not aarch64 code.
    #[error("the code was compiled for {0}, not aarch64")]
    WrongTarget(&'static str),
    /// The harness refused its input or crashed.
    #[error("the aarch64 harness failed ({status}): {stderr}")]
    Harness {
        /// Its exit status, as the OS reported it.
        status: String,
        /// What it printed.
        stderr: String,
    },
    /// Its output could not be read.
    #[error("unreadable harness output: {0}")]
    Output(String),
}

/// True when aarch64 runs can work here (harness built, qemu present).
pub fn available() -> Result<(), CrossError> {
    harness_path()?;
    let program = qemu();
    match Command::new(&program).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(CrossError::NoQemu {
            program,
            reason: format!("exit status {}", o.status),
        }),
        Err(e) => Err(CrossError::NoQemu {
            program,
            reason: e.to_string(),
        }),
    }
}

/// For tests of aarch64 code: true when it can run here. Otherwise, outside CI, it says on
/// stderr why `what` is skipped and returns false; in CI (`CI` set, where `scripts/setup.sh`
/// installed the tools) a missing tool fails the test instead.
pub fn available_or_skip(what: &str) -> bool {
    match available() {
        Ok(()) => true,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{what}: aarch64 runs are required in CI: {e}")
        }
        Err(e) => {
            eprintln!("skipping {what}: {e}");
            false
        }
    }
}

/// Compiles every handler of `object` to aarch64; the total code size, or the first failure.
pub fn compile_object(object: &crate::LoadedObject) -> Result<usize, String> {
    let mut bytes = 0;
    for p in &object.programs {
        let exe = crate::Executable::new(p, naam_proto::EngineKind::Interp, &Default::default())
            .map_err(|e| e.to_string())?;
        bytes += exe
            .compile_for(Target::Aarch64)
            .map_err(|e| format!("{}: {e}", p.name))?
            .code
            .len();
    }
    Ok(bytes)
}

fn qemu() -> String {
    std::env::var("NAAM_QEMU_AARCH64").unwrap_or_else(|_| "qemu-aarch64".into())
}

/// Writes the harness to a content-named file in the temp directory (once per process,
/// shared by processes with the same harness) and returns its path.
fn harness_path() -> Result<PathBuf, CrossError> {
    static PATH: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let bytes = HARNESS.map_err(|e| CrossError::NoHarness(e.to_string()))?;
    PATH.get_or_init(|| {
        let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let path = std::env::temp_dir().join(format!("naam-aarch64-harness-{hash:016x}"));
        if std::fs::metadata(&path).is_ok_and(|m| m.len() == bytes.len() as u64) {
            return Ok(path);
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(&tmp, bytes)?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| format!("writing {}: {e}", path.display()))?;
        Ok(path)
    })
    .clone()
    .map_err(CrossError::NoHarness)
}

/// What an aarch64 run left.
#[derive(Clone, Debug)]
pub struct CrossOutput {
    /// Final r0 (meaningless when the run faulted).
    pub r0: u64,
    /// The machine state after the run: fault, instruction count, trace, stack.
    pub state: VmCtx,
    /// Each writable region's bytes after the run (`None` for read-only regions).
    pub regions: Vec<Option<Vec<u8>>>,
    /// Where the harness mapped each region, and its length.
    pub maps: Vec<(u64, u64)>,
}

impl CrossOutput {
    /// r0, or the fault, as [`crate::Vm`] reports them.
    pub fn result(&self, budget: u64) -> Result<u64, VmError> {
        match VmError::from_record(&self.state.fault, budget) {
            None => Ok(self.r0),
            Some(e) => Err(e),
        }
    }

    /// Where each region was mapped in the harness, and its length.
    pub fn region_addrs_and_lens(&self) -> Vec<(u64, u64)> {
        self.maps.clone()
    }

    /// r0 or the fault, with a fault address translated back into the host's address space
    /// (relative to the region nearest to it, within [`NEAR`]), so it compares with a host run
    /// of the same image normalised by [`normalize_host_fault`]. An address far from every
    /// region becomes [`FAR`]: the two address spaces agree only that nothing is granted there.
    pub fn result_in_host_space(&self, image: &Image, budget: u64) -> Result<u64, VmError> {
        let mut r = self.result(budget);
        if let Err(VmError::OutOfBounds { addr, .. } | VmError::Misaligned { addr, .. }) = &mut r {
            let regions = self.maps.iter().map(|&(base, len)| (base, len));
            *addr = match nearest(regions, *addr) {
                Some((i, base)) => image.regions.get(i).map_or(FAR, |region| {
                    region.host_addr.wrapping_add(addr.wrapping_sub(base))
                }),
                None => FAR,
            };
        }
        r
    }

    /// The eBPF stack as the run left it (it lives in the machine state).
    pub fn stack_bytes(&self) -> Vec<u8> {
        self.state
            .stack
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .collect()
    }

    /// Values the trace helper recorded.
    pub fn trace(&self) -> &[u64] {
        &self.state.trace[..(self.state.trace_len as usize).min(self.state.trace.len())]
    }
}

fn put(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    put(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
    while !buf.len().is_multiple_of(8) {
        buf.push(0);
    }
}

/// The harness's input for `compiled` over `image`.
pub fn encode(compiled: &Compiled, image: &Image) -> Vec<u8> {
    let mut b = Vec::with_capacity(compiled.code.len() + 64 * 1024);
    put(&mut b, HARNESS_MAGIC);
    put_bytes(&mut b, &compiled.code);
    put(&mut b, compiled.entry as u64);
    put(
        &mut b,
        match image.helpers {
            HelperSet::Naam => 0,
            HelperSet::Conformance => 1,
        },
    );
    put(&mut b, image.helper_mask);
    put(&mut b, image.regions.len() as u64);
    for r in &image.regions {
        put(&mut b, r.bytes.len() as u64);
        put(&mut b, r.writable as u64);
        put(&mut b, r.host_addr & 4095);
        b.extend_from_slice(&r.bytes);
        while !b.len().is_multiple_of(8) {
            b.push(0);
        }
    }
    put(&mut b, image.fixups.len() as u64);
    for f in &image.fixups {
        put(&mut b, f.region as u64);
        put(&mut b, f.offset);
        put(&mut b, f.target as u64);
        put(&mut b, f.addend);
    }
    match image.r1_absolute {
        Some(v) => {
            put(&mut b, u64::MAX);
            put(&mut b, v);
        }
        None => {
            put(&mut b, image.r1.0 as u64);
            put(&mut b, image.r1.1);
        }
    }
    put(&mut b, image.r2);
    b
}

/// Runs aarch64 code over an image, under qemu-user.
pub fn run(compiled: &Compiled, image: &Image) -> Result<CrossOutput, CrossError> {
    if compiled.target != Target::Aarch64 {
        return Err(CrossError::WrongTarget(compiled.target.name()));
    }
    let harness = harness_path()?;
    let program = qemu();
    let mut child = Command::new(&program)
        .arg(&harness)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CrossError::NoQemu {
            program: program.clone(),
            reason: e.to_string(),
        })?;
    let input = encode(compiled, image);
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| CrossError::Output("no stdin".into()))?;
    // Write from another thread: the harness may fill its stdout pipe before reading all of
    // its input.
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child
        .wait_with_output()
        .map_err(|e| CrossError::Output(e.to_string()))?;
    let _ = writer.join();
    if !out.status.success() {
        return Err(CrossError::Harness {
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    parse(&String::from_utf8_lossy(&out.stdout), image.regions.len())
}

fn parse(text: &str, regions: usize) -> Result<CrossOutput, CrossError> {
    let bad = |m: String| CrossError::Output(m);
    let mut r0 = None;
    let mut out: Vec<Option<Vec<u8>>> = vec![None; regions];
    let mut maps = vec![(0u64, 0u64); regions];
    for line in text.lines() {
        let mut words = line.split(' ');
        match words.next() {
            Some("r0") => {
                let v = words
                    .next()
                    .ok_or_else(|| bad("r0 without a value".into()))?;
                r0 = Some(u64::from_str_radix(v, 16).map_err(|e| bad(format!("r0: {e}")))?);
            }
            Some("map") => {
                let mut num = || {
                    words
                        .next()
                        .and_then(|w| u64::from_str_radix(w, 16).ok())
                        .ok_or_else(|| bad(format!("bad map line `{line:.40}`")))
                };
                let (i, addr, len) = (num()? as usize, num()?, num()?);
                if let Some(m) = maps.get_mut(i) {
                    *m = (addr, len);
                }
            }
            Some("region") => {
                let i: usize = words
                    .next()
                    .and_then(|w| w.parse().ok())
                    .filter(|&i| i < regions)
                    .ok_or_else(|| bad(format!("bad region line `{line:.40}`")))?;
                let hex = words.next().unwrap_or("");
                let bytes = (0..hex.len() / 2)
                    .map(|k| u8::from_str_radix(&hex[2 * k..2 * k + 2], 16))
                    .collect::<Result<Vec<u8>, _>>()
                    .map_err(|e| bad(format!("region {i}: {e}")))?;
                out[i] = Some(bytes);
            }
            _ => return Err(bad(format!("unexpected line `{line:.40}`"))),
        }
    }
    let r0 = r0.ok_or_else(|| bad("no r0".into()))?;
    let state = out
        .first()
        .and_then(|r| r.as_deref())
        .and_then(VmCtx::from_bytes)
        .ok_or_else(|| bad("no machine state".into()))?;
    Ok(CrossOutput {
        r0,
        state,
        regions: out,
        maps,
    })
}

/// Replays sampled handler steps of a [`crate::Vm`] as aarch64 code under qemu and records
/// every difference from what the VM itself computed (r0 or the fault, instruction count,
/// trace, reply, next descriptors, writes, state words). Tests wrap the VMs of a cluster in
/// it ([`CrossChecked`]) and run a real workload through them.
#[derive(Debug, Default)]
pub struct CrossCheck {
    every: u64,
    seen: std::sync::atomic::AtomicU64,
    compared: std::sync::atomic::AtomicU64,
    problems: std::sync::Mutex<Vec<String>>,
}

impl CrossCheck {
    /// Checks one step in every `every` (at least 1).
    pub fn new(every: u64) -> std::sync::Arc<CrossCheck> {
        std::sync::Arc::new(CrossCheck {
            every: every.max(1),
            ..CrossCheck::default()
        })
    }

    /// True when the next step should be checked.
    pub(crate) fn due(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.seen
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(self.every)
    }

    /// Records the comparison of one step.
    pub(crate) fn record(&self, step: &str, result: Result<(), String>) {
        use std::sync::atomic::Ordering;
        self.compared.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = result {
            if let Ok(mut p) = self.problems.lock() {
                if p.len() < 100 {
                    p.push(format!("{step}: {e}"));
                }
            }
        }
    }

    /// Steps compared so far.
    pub fn compared(&self) -> u64 {
        self.compared.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every divergence (or failure to run aarch64 code) recorded so far.
    pub fn problems(&self) -> Vec<String> {
        self.problems.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

/// How far from a region a fault address may lie and still be compared exactly.
pub const NEAR: u64 = 1 << 20;
/// The address of a fault far from every region, in normalised results.
pub const FAR: u64 = u64::MAX;

/// The region (index, base) nearest to `addr`, if within [`NEAR`] of it: the one holding it,
/// else the one whose ends it lies closest to (region 0, the machine state, for a fault
/// beside the stack it holds).
fn nearest(regions: impl Iterator<Item = (u64, u64)>, addr: u64) -> Option<(usize, u64)> {
    let distance = |base: u64, len: u64| {
        if addr < base {
            base - addr
        } else {
            (addr - base).saturating_sub(len.saturating_sub(1))
        }
    };
    regions
        .enumerate()
        .filter(|(_, (base, len))| *len > 0 && distance(*base, *len) < NEAR)
        .min_by_key(|(_, (base, len))| distance(*base, *len))
        .map(|(i, (base, _))| (i, base))
}

/// A host result of `image`, with a fault address far from every region replaced by [`FAR`]
/// (see [`CrossOutput::result_in_host_space`]).
pub fn normalize_host_fault(image: &Image, mut r: Result<u64, VmError>) -> Result<u64, VmError> {
    if let Err(VmError::OutOfBounds { addr, .. } | VmError::Misaligned { addr, .. }) = &mut r {
        let regions = image
            .regions
            .iter()
            .map(|region| (region.host_addr, region.bytes.len() as u64));
        if nearest(regions, *addr).is_none() {
            *addr = FAR;
        }
    }
    r
}

/// A [`Vm`] whose sampled steps are replayed as aarch64 code under qemu and compared
/// ([`CrossCheck`]): a wrapper around the engine, which the drivers run like the VM itself
/// ([`HandlerEngine`]). Without a check it is the VM, steps in one entry included; with
/// one it runs every step alone, so that each can be imaged before it runs.
pub struct CrossChecked {
    vm: Vm,
    check: Option<Arc<CrossCheck>>,
}

impl CrossChecked {
    /// `vm`, its steps sampled by `check` (`None`: none are).
    pub fn new(vm: Vm, check: Option<Arc<CrossCheck>>) -> CrossChecked {
        CrossChecked { vm, check }
    }

    /// The check the steps are sampled by, when one is due for the next step.
    fn due(&self) -> Option<Arc<CrossCheck>> {
        self.check.as_ref().filter(|c| c.due()).cloned()
    }

    /// [`Vm::run`], the step replayed and compared when it is sampled.
    pub fn run(&mut self, exe: &Executable, inv: &Invocation<'_>) -> Result<StepOutput, StepError> {
        match self.due() {
            Some(check) => self.vm.run_cross_checked(&check, exe, inv),
            None => self.vm.run(exe, inv),
        }
    }

    /// The wrapped VM.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }
}

impl Engine for CrossChecked {
    type Program = Executable;

    fn run_step(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<StepResult<'_>, StepFault> {
        match self.due() {
            Some(check) => {
                let out = self
                    .vm
                    .run_cross_checked(&check, exe, inv)
                    .map_err(step_fault)?;
                Ok(self.vm.step_result(out.return_code))
            }
            None => Engine::run_step(&mut self.vm, exe, inv),
        }
    }

    fn queued_writes(&self) -> (&[WriteOp], &[u8]) {
        self.vm.queued_writes()
    }
}

impl HandlerEngine for CrossChecked {
    fn begin_steps(&mut self, exe: &Executable, inv: &Invocation<'_>) -> Result<bool, StepFault> {
        if self.check.is_some() {
            return Ok(false);
        }
        self.vm.begin_steps(exe, inv)
    }

    fn run_steps(
        &mut self,
        exe: &Executable,
        next: &mut dyn NextStep,
    ) -> Result<StepResult<'_>, StepFault> {
        self.vm.run_steps(exe, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_is_placed_in_the_region_holding_it_else_beside_the_closest_end() {
        // Region 0 (the machine state, its stack at the end here) and region 1 just after it.
        let regions = [(0x1000u64, 0x3000u64), (0x4100, 0x100)];
        let at = |addr| nearest(regions.iter().copied(), addr);
        // Inside region 0, though region 1's base is nearer.
        assert_eq!(at(0x3ff8), Some((0, 0x1000)));
        // Just past region 0's end (a frame pointer plus eight): beside region 0.
        assert_eq!(at(0x4008), Some((0, 0x1000)));
        // Just before region 1.
        assert_eq!(at(0x40f0), Some((1, 0x4100)));
        // Far from both.
        assert_eq!(at(0x4100 + NEAR + 0x100), None);
    }
}
