//! An invocation as plain bytes for an engine in another process (the aarch64 harness under
//! qemu), and the cross-check that replays sampled steps there and compares the results.

use super::{
    expect_entry, slot, Context, Entry, Executable, GrantSlot, HelperSet, Invocation, StepError,
    StepOutput, Target, Vm, CONTEXT_SIZE, REPLY_CAP, WRITE_DATA_CAP,
};

impl Vm {
    pub(crate) fn run_cross_checked(
        &mut self,
        check: &crate::cross::CrossCheck,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<StepOutput, StepError> {
        let image = match self.image_step(exe, inv) {
            Ok(image) => image,
            Err(_) => return self.run_step(exe, inv),
        };
        let host = self.run_step(exe, inv);
        let name = format!(
            "{} step {} of request {:#x}",
            exe.name, inv.step, inv.request_id
        );
        let compared = exe
            .compile_for(Target::Aarch64)
            .map_err(|e| e.to_string())
            .and_then(|code| crate::cross::run(&code, &image).map_err(|e| e.to_string()))
            .and_then(|out| self.compare_cross(exe, &image, &host, &out));
        check.record(&name, compared);
        host
    }

    /// Compares this VM's last step with an aarch64 run of the same image.
    pub(super) fn compare_cross(
        &self,
        exe: &Executable,
        image: &Image,
        host: &Result<StepOutput, StepError>,
        out: &crate::cross::CrossOutput,
    ) -> Result<(), String> {
        let arm = out.result_in_host_space(image, exe.options.budget);
        match host {
            Err(StepError::Vm(e)) => {
                let e = crate::cross::normalize_host_fault(image, Err(e.clone()));
                return if arm.as_ref().err() == e.as_ref().err() {
                    Ok(())
                } else {
                    Err(format!("host fault {e:?}, aarch64 {arm:?}"))
                };
            }
            Err(e) if arm.is_err() => return Err(format!("host {e}, aarch64 {arm:?}")),
            _ => {}
        }
        let r0 = arm.map_err(|e| format!("aarch64 faulted: {e}"))?;
        let entry = image.slot_region[slot::ENTRY].ok_or("no context region")?;
        let bytes = out.regions[entry]
            .as_deref()
            .ok_or("no context after the run")?;
        if bytes.len() != CONTEXT_SIZE {
            return Err("context of the wrong size".into());
        }
        // SAFETY: `Context` is plain `repr(C)` data and `bytes` holds exactly one.
        let arm_ctx: Context = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        let c = &*self.ctx;
        let mut diffs = Vec::new();
        if let Ok(o) = host {
            if o.return_code != r0 {
                diffs.push(format!("r0 {:#x} vs {r0:#x}", o.return_code));
            }
            if o.insns != Some(out.state.executed) {
                diffs.push(format!("insns {:?} vs {}", o.insns, out.state.executed));
            }
            if o.trace != out.trace() {
                diffs.push(format!("trace {:?} vs {:?}", o.trace, out.trace()));
            }
        }
        let same = |a: &[u8], b: &[u8]| a == b;
        if c.reply_len != arm_ctx.reply_len
            || !same(
                self.reply(),
                &arm_ctx.reply[..(arm_ctx.reply_len as usize).min(REPLY_CAP)],
            )
        {
            diffs.push("reply".into());
        }
        if c.next_count != arm_ctx.next_count || c.next != arm_ctx.next {
            diffs.push("next descriptors".into());
        }
        if c.write_count != arm_ctx.write_count || c.writes != arm_ctx.writes {
            diffs.push("write operations".into());
        }
        if c.write_data_len != arm_ctx.write_data_len
            || !same(
                self.write_data(),
                &arm_ctx.write_data[..(arm_ctx.write_data_len as usize).min(WRITE_DATA_CAP)],
            )
        {
            diffs.push("write data".into());
        }
        if c.state != arm_ctx.state {
            diffs.push(format!("state {:x?} vs {:x?}", c.state, arm_ctx.state));
        }
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(diffs.join("; "))
        }
    }

    /// Prepares the handler step `inv` of `exe` without running it, and returns it as an
    /// [`Image`]: what an engine in another process (the aarch64 harness) needs to run it
    /// exactly as this VM would. A later [`Vm::run`] of the same invocation starts from the
    /// same state.
    pub fn image_step(
        &mut self,
        exe: &Executable,
        inv: &Invocation<'_>,
    ) -> Result<Image, StepError> {
        expect_entry(exe, Entry::Context)?;
        self.prepare(inv)?;
        self.install(exe);
        self.vmctx.reset_run();
        let mut image = self.image(exe);
        let entry = image.slot_region[slot::ENTRY].expect("the context is granted");
        let base = std::mem::offset_of!(Context, segments)
            + std::mem::offset_of!(naam_ebpf::Segment, addr);
        for i in 0..inv.segments.len() {
            if let Some(target) = image.slot_region[slot::SEGMENT + i] {
                image.fixups.push(Fixup {
                    region: entry,
                    offset: (base + i * std::mem::size_of::<naam_ebpf::Segment>()) as u64,
                    target,
                    addend: 0,
                });
            }
        }
        image.r1 = (entry, 0);
        image.r2 = CONTEXT_SIZE as u64;
        Ok(image)
    }

    /// [`Vm::image_step`] for a raw run over `memory`.
    pub fn image_raw(&mut self, exe: &Executable, memory: &[u8]) -> Result<Image, StepError> {
        expect_entry(exe, Entry::Memory)?;
        self.install(exe);
        for i in 0..self.segments_installed {
            self.vmctx.grants[slot::SEGMENT + i] = GrantSlot::EMPTY;
        }
        self.segments_installed = 0;
        self.entry_is_context = false;
        self.vmctx.grants[slot::ENTRY] =
            GrantSlot::new(memory.as_ptr() as u64, memory.len() as u64, true);
        self.vmctx.grants[slot::ENTRY_OUT] = GrantSlot::EMPTY;
        self.vmctx.reset_run();
        let mut image = self.image(exe);
        self.vmctx.grants[slot::ENTRY] = GrantSlot::EMPTY;
        match image.slot_region[slot::ENTRY] {
            Some(entry) => image.r1 = (entry, 0),
            // No memory: r1 is a null pointer, as in a host run over an empty buffer.
            None => image.r1 = (0, 0),
        }
        image.r2 = memory.len() as u64;
        if image.slot_region[slot::ENTRY].is_none() {
            image.r1_absolute = Some(memory.as_ptr() as u64);
        }
        Ok(image)
    }

    pub(super) fn image(&self, exe: &Executable) -> Image {
        let mut vmctx = self.vmctx.as_ref().clone();
        vmctx.helpers = [0; crate::memory::HELPER_SLOTS];
        vmctx.check = 0;
        let mut image = Image {
            regions: Vec::new(),
            fixups: Vec::new(),
            slot_region: [None; crate::memory::MAX_GRANTS],
            r1: (0, 0),
            r1_absolute: None,
            r2: 0,
            helpers: exe.options.helpers,
            helper_mask: exe
                .helper_table
                .iter()
                .enumerate()
                .filter(|(_, f)| **f != 0)
                .fold(0u64, |m, (id, _)| m | (1 << id)),
        };
        // Region 0 is the machine state, the stack inside it (compiled code finds the stack
        // at a fixed offset from the state it is handed).
        image.regions.push(ImageRegion {
            bytes: vmctx.to_bytes(),
            writable: true,
            host_addr: self.vmctx.as_ref() as *const crate::memory::VmCtx as u64,
        });
        let grants = &self.vmctx.grants;
        for (k, g) in grants.iter().enumerate() {
            if g.len == 0 {
                continue;
            }
            // A grant inside a region already taken (the stack inside the machine state, the
            // context's output part right after its input part) shares that region, so the
            // two stay where they are to each other.
            let inside = image.regions.iter().enumerate().find(|(_, r)| {
                g.start >= r.host_addr && g.start + g.len <= r.host_addr + r.bytes.len() as u64
            });
            if let Some((r, region)) = inside {
                let addend = g.start - region.host_addr;
                image.slot_region[k] = Some(r);
                image.fixups.push(Fixup {
                    region: 0,
                    offset: crate::memory::layout::start(k) as u64,
                    target: r,
                    addend,
                });
                continue;
            }
            let mut len = g.len;
            let mut writable = g.writable != 0;
            let out = &grants[slot::ENTRY_OUT];
            if k == slot::ENTRY && out.len > 0 && out.start == g.start + g.len {
                len += out.len;
                writable = true;
            }
            // SAFETY: grants of this VM cover [start, start + len) for reading (the context's
            // two parts are one allocation).
            let bytes =
                unsafe { std::slice::from_raw_parts(g.start as *const u8, len as usize) }.to_vec();
            image.slot_region[k] = Some(image.regions.len());
            image.fixups.push(Fixup {
                region: 0,
                offset: crate::memory::layout::start(k) as u64,
                target: image.regions.len(),
                addend: 0,
            });
            image.regions.push(ImageRegion {
                bytes,
                writable,
                host_addr: g.start,
            });
        }
        image.fixups.push(Fixup {
            region: 0,
            offset: crate::memory::layout::STACK_LIMIT as u64,
            target: 0,
            addend: crate::memory::layout::STACK as u64,
        });
        image
    }
}

/// An invocation as plain bytes, for an engine in another process: memory regions to map
/// (region 0 is the [`VmCtx`], the stack inside it), pointers to patch once they are mapped,
/// and where the entry registers point (the frame pointer is the top of region 0's stack).
#[derive(Clone, Debug)]
pub struct Image {
    /// Regions; region 0 is the machine state.
    pub regions: Vec<ImageRegion>,
    /// Pointers to write once regions are mapped.
    pub fixups: Vec<Fixup>,
    /// Region of each grant slot, if granted.
    pub slot_region: [Option<usize>; crate::memory::MAX_GRANTS],
    /// `r1`: region and offset.
    pub r1: (usize, u64),
    /// `r1` as an absolute value when it points at no region (an empty raw memory).
    pub r1_absolute: Option<u64>,
    /// `r2`.
    pub r2: u64,
    /// The helper set to install.
    pub helpers: HelperSet,
    /// Bit `i`: helper id `i` is installed.
    pub helper_mask: u64,
}

/// One memory region of an [`Image`].
#[derive(Clone, Debug)]
pub struct ImageRegion {
    /// The region's bytes, copied when the image is made (region 0: the serialised [`VmCtx`],
    /// helper pointers zeroed); their length is the region's size.
    pub bytes: Vec<u8>,
    /// Whether the handler may write it (its contents come back after the run).
    pub writable: bool,
    /// Where it lives in this process (its low 12 bits are kept, so alignment is the same).
    pub host_addr: u64,
}

/// "Write the address of region `target` plus `addend` at `offset` of region `region`".
#[derive(Clone, Copy, Debug)]
pub struct Fixup {
    /// Region patched.
    pub region: usize,
    /// Byte offset in it.
    pub offset: u64,
    /// Region whose address is written.
    pub target: usize,
    /// Added to that address.
    pub addend: u64,
}
