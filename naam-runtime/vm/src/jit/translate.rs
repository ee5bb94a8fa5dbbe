//! Translation of one verified eBPF function into Cranelift IR: registers as variables, fuel
//! metering per basic block, inline bounds checks with the slow path out of line, helper and
//! local calls.

use std::collections::BTreeMap;

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{
    types, AtomicRmwOp, Block, FuncRef, InstBuilder, MemFlagsData, SigRef, Value,
};
use cranelift_codegen::isa::{CallConv, TargetFrontendConfig};
use cranelift_frontend::{FunctionBuilder, Variable};

use naam_ebpf::abi::STACK_SIZE;

use crate::analysis::{Check, Facts};
use crate::insn::{AluOp, AtomicOp, Cond, Op, Operand, Width};
use crate::loader::Program;
use crate::memory::{access, fault, layout, slot, HELPER_SLOTS, SITE_HINTS, SITE_SHIFT};
use crate::semantics::imm64;
use crate::verifier::Checked;

use super::{check_signature, helper_signature, import_function};

/// Longest `memcmp` the JIT compares inline (short keys; longer ones call the helper).
const INLINE_MEMCMP: u64 = 64;

/// Flags for context fields that never change during a run: free to hoist and deduplicate.
pub(super) fn fixed() -> MemFlagsData {
    MemFlagsData::trusted().with_readonly().with_can_move()
}

/// Flags for context fields the run updates (count, fault).
pub(super) fn mutable() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Flags for the handler's own memory accesses: unaligned, checked before they happen.
fn guest() -> MemFlagsData {
    MemFlagsData::new().with_notrap()
}

pub(super) struct Translator<'a, 'b> {
    b: FunctionBuilder<'b>,
    checked: &'a Checked,
    program: &'a Program,
    facts: &'a Facts,
    function: usize,
    call_conv: CallConv,
    regs: [Variable; 10],
    /// Budget minus instructions executed, up to the last materialisation: the instructions
    /// since then are [`Translator::pending`], known at compile time.
    fuel: Variable,
    /// Instructions executed since `fuel` was last brought up to date (a constant along
    /// the path being translated). Fuel is subtracted only where a value is needed: at
    /// backward jumps (the budget check), calls, exits, and edges into blocks that several
    /// edges reach; a block reached by a single edge inherits its predecessor's count, so a
    /// loop pays one subtraction per iteration, not one per block.
    pending: u64,
    /// Blocks reached by a single edge (not loop headers), and the pending count each inherits
    /// from the edge already translated into it.
    inherits: std::collections::BTreeSet<usize>,
    inherited: BTreeMap<usize, u64>,
    ctx: Value,
    fp: Value,
    blocks: BTreeMap<usize, Block>,
    /// Returns `(0, 1)`: the fault is already recorded.
    propagate: Block,
    /// Records `(kind, pc, addr, len)` then propagates.
    fault: Block,
    helper_sig: Option<SigRef>,
    check_sig: Option<SigRef>,
    /// The module's check trampoline: its index, then its reference once imported.
    trampoline: usize,
    trampoline_ref: Option<FuncRef>,
    /// Returns `r0` alone (the entry signature) instead of `(r0, status)`.
    entry_abi: bool,
    callees: BTreeMap<usize, FuncRef>,
}

impl<'a, 'b> Translator<'a, 'b> {
    pub(super) fn new(
        mut b: FunctionBuilder<'b>,
        checked: &'a Checked,
        program: &'a Program,
        facts: &'a Facts,
        (function, trampoline): (usize, usize),
        call_conv: CallConv,
        entry_abi: bool,
    ) -> Self {
        let regs = std::array::from_fn(|_| b.declare_var(types::I64));
        let fuel = b.declare_var(types::I64);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let params = b.block_params(entry).to_vec();
        let zero = b.ins().iconst(types::I64, 0);
        // Internal functions take (ctx, fp, r1..r5); the entry takes (ctx, r1, r2), its frame
        // pointer a constant away from ctx (the stack lives in the context): the entry's
        // stack accesses address ctx directly, and no register holds r10 across the function.
        let (ctx, fp, args) = if entry_abi {
            let fp = b.ins().iadd_imm_s(params[0], layout::STACK_TOP as i64);
            (params[0], fp, vec![params[1], params[2], zero, zero, zero])
        } else {
            (params[0], params[1], params[2..7].to_vec())
        };
        b.def_var(regs[0], zero);
        for (i, reg) in regs.iter().enumerate().skip(1) {
            b.def_var(*reg, if i <= 5 { args[i - 1] } else { zero });
        }
        let budget = b
            .ins()
            .load(types::I64, fixed(), ctx, layout::BUDGET as i32);
        let left = if entry_abi {
            // A run starts with nothing executed.
            budget
        } else {
            let executed = b
                .ins()
                .load(types::I64, mutable(), ctx, layout::EXECUTED as i32);
            b.ins().isub(budget, executed)
        };
        b.def_var(fuel, left);

        let propagate = b.create_block();
        b.set_cold_block(propagate);
        let fault = b.create_block();
        b.set_cold_block(fault);
        for _ in 0..4 {
            b.append_block_param(fault, types::I64);
        }

        let (start, end) = checked.functions[function];
        let mut blocks = BTreeMap::new();
        for pc in leaders(checked, start, end) {
            blocks.insert(pc, b.create_block());
        }
        let first = blocks[&start];
        b.ins().jump(first, &[]);
        b.seal_block(entry);
        Translator {
            b,
            checked,
            program,
            facts,
            function,
            call_conv,
            regs,
            fuel,
            ctx,
            fp,
            blocks,
            propagate,
            fault,
            helper_sig: None,
            check_sig: None,
            trampoline,
            trampoline_ref: None,
            pending: 0,
            inherits: Default::default(),
            inherited: BTreeMap::new(),
            entry_abi,
            callees: BTreeMap::new(),
        }
    }

    pub(super) fn translate(mut self, config: TargetFrontendConfig) {
        let (start, end) = self.checked.functions[self.function];
        let leaders: Vec<usize> = self.blocks.keys().copied().collect();
        // Loop headers have a predecessor later in the function; every other block's
        // predecessors are emitted before it, so it can be sealed on entry.
        let loop_headers: std::collections::BTreeSet<usize> = (start..end)
            .filter_map(|pc| match self.checked.ops[pc] {
                Some(Op::Ja { target }) | Some(Op::Jump { target, .. })
                    if target as usize <= pc =>
                {
                    Some(target as usize)
                }
                _ => None,
            })
            .collect();
        let incoming = incoming_edges(self.checked, start, end, &leaders);
        self.inherits = leaders
            .iter()
            .copied()
            .filter(|l| incoming.get(l) == Some(&1) && !loop_headers.contains(l))
            .collect();
        for (k, &leader) in leaders.iter().enumerate() {
            let block_end = leaders.get(k + 1).copied().unwrap_or(end);
            let block = self.blocks[&leader];
            if loop_headers.contains(&leader) {
                self.b.switch_to_block(block);
            } else {
                self.enter(block);
            }
            // The block's instructions count from its start (`lddw` counts once), added to
            // what its only edge brought, if it has only one.
            let n = (leader..block_end)
                .filter(|&pc| self.checked.ops[pc].is_some())
                .count() as u64;
            self.pending = self.inherited.remove(&leader).unwrap_or(0) + n;
            let mut pc = leader;
            let mut terminated = false;
            while pc < block_end {
                let Some(op) = self.checked.ops[pc] else {
                    pc += 1;
                    continue;
                };
                terminated = self.op(pc, op);
                pc += op.slots();
            }
            if !terminated {
                // Falls into the next block; verified functions never run past their end.
                if block_end < end && self.blocks.contains_key(&block_end) {
                    self.goto(block_end);
                } else {
                    self.b.ins().jump(self.propagate, &[]);
                }
            }
        }
        let _ = start;
        for header in loop_headers {
            self.b.seal_block(self.blocks[&header]);
        }
        // Shared exits: record a fault, then return the failure status.
        self.enter(self.fault);
        let p = self.b.block_params(self.fault).to_vec();
        for (i, v) in p.iter().enumerate() {
            self.b
                .ins()
                .store(mutable(), *v, self.ctx, (layout::FAULT + 8 * i) as i32);
        }
        self.b.ins().jump(self.propagate, &[]);
        self.enter(self.propagate);
        let zero = self.b.ins().iconst(types::I64, 0);
        if self.entry_abi {
            // The fault is in the context; the caller reads it there.
            self.b.ins().return_(&[zero]);
        } else {
            let one = self.b.ins().iconst(types::I64, 1);
            self.b.ins().return_(&[zero, one]);
        }
        self.b.seal_all_blocks();
        self.b.finalize(config);
    }

    /// Switches to a block whose predecessors are all emitted, and seals it (the SSA builder
    /// then resolves variables without placeholder parameters).
    fn enter(&mut self, block: Block) {
        self.b.switch_to_block(block);
        self.b.seal_block(block);
    }

    fn reg(&mut self, r: u8) -> Value {
        if r == crate::insn::FRAME_POINTER {
            self.fp
        } else {
            self.b.use_var(self.regs[r as usize])
        }
    }

    fn set(&mut self, r: u8, v: Value) {
        self.b.def_var(self.regs[r as usize], v);
    }

    fn iconst(&mut self, v: u64) -> Value {
        self.b.ins().iconst(types::I64, v as i64)
    }

    fn operand64(&mut self, v: Operand) -> Value {
        match v {
            Operand::Reg(r) => self.reg(r),
            Operand::Imm(i) => self.iconst(imm64(i)),
        }
    }

    /// Jumps to the shared fault exit with a record.
    fn fault_here(&mut self, kind: u64, pc: usize, addr: Value, len: u64) {
        let k = self.iconst(kind);
        let p = self.iconst(pc as u64);
        let l = self.iconst(len);
        self.b
            .ins()
            .jump(self.fault, &[k.into(), p.into(), addr.into(), l.into()]);
    }

    /// `if cond { fault }`, continuing in a fresh block.
    fn fault_if(&mut self, cond: Value, kind: u64, pc: usize, addr: Value, len: u64) {
        let bad = self.b.create_block();
        self.b.set_cold_block(bad);
        let cont = self.b.create_block();
        self.b.ins().brif(cond, bad, &[], cont, &[]);
        self.enter(bad);
        self.fault_here(kind, pc, addr, len);
        self.enter(cont);
    }

    /// The budget check at a backward jump or a call: more executed than allowed.
    fn budget_check(&mut self, pc: usize) {
        let fuel = self.b.use_var(self.fuel);
        let over = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, fuel, 0);
        let zero = self.iconst(0);
        self.fault_if(over, fault::BUDGET, pc, zero, 0);
    }

    /// Stores the instructions executed so far (budget minus fuel) into the context.
    fn store_executed(&mut self) {
        let fuel = self.b.use_var(self.fuel);
        let budget = self
            .b
            .ins()
            .load(types::I64, fixed(), self.ctx, layout::BUDGET as i32);
        let executed = self.b.ins().isub(budget, fuel);
        self.b
            .ins()
            .store(mutable(), executed, self.ctx, layout::EXECUTED as i32);
    }

    /// Checks an access of `size` bytes at `addr` as the analysis decided: nothing for a
    /// proven access; else the hinted slot inline (a hint), then the slot this site last
    /// passed in ([`crate::memory::VmCtx::sites`]), then the slow path, which scans every
    /// grant and remembers the slot for the site.
    fn check_access(&mut self, pc: usize, addr: Value, size: u64, kind: u64) {
        let write = kind != access::LOAD;
        let hint = match self.facts.check(pc) {
            Check::Proven => return,
            Check::Hint(h) => Some(h as usize),
            Check::Scan => None,
        };
        let cont = self.b.create_block();
        if let Some(hint) = hint {
            let start =
                self.b
                    .ins()
                    .load(types::I64, fixed(), self.ctx, layout::start(hint) as i32);
            let lim = self.b.ins().load(
                types::I64,
                fixed(),
                self.ctx,
                layout::limit(hint, size, write) as i32,
            );
            let off = self.b.ins().isub(addr, start);
            let inside = self.b.ins().icmp(IntCC::UnsignedLessThan, off, lim);
            let site = self.b.create_block();
            self.b.set_cold_block(site);
            self.b.ins().brif(inside, cont, &[], site, &[]);
            self.enter(site);
        }
        let site = pc % SITE_HINTS;
        let (off, lim) = self.remembered_offset(site, addr, layout::limit(0, size, write));
        let inside = self.b.ins().icmp(IntCC::UnsignedLessThan, off, lim);
        let slow = self.b.create_block();
        self.b.set_cold_block(slow);
        self.b.ins().brif(inside, cont, &[], slow, &[]);
        self.enter(slow);
        let t = match self.trampoline_ref {
            Some(t) => t,
            None => {
                let t = super::import_trampoline(&mut self.b, self.trampoline);
                self.trampoline_ref = Some(t);
                t
            }
        };
        let size_v = self.iconst(size);
        let kind_v = self.iconst(kind | ((site as u64 + 1) << SITE_SHIFT));
        let pc_v = self.iconst(pc as u64);
        self.b
            .ins()
            .call(t, &[self.ctx, addr, size_v, kind_v, pc_v]);
        // A refused access is in the fault record (none was before: a fault ends the run).
        let fault = self
            .b
            .ins()
            .load(types::I64, mutable(), self.ctx, layout::FAULT as i32);
        self.b.ins().brif(fault, self.propagate, &[], cont, &[]);
        self.enter(cont);
    }

    fn address(&mut self, base: u8, off: i16) -> Value {
        let b = self.reg(base);
        self.b.ins().iadd_imm_s(b, off as i64)
    }

    fn target(&self, t: i64) -> Block {
        self.blocks[&(t as usize)]
    }

    /// Brings `fuel` up to date: subtracts the pending count.
    fn materialize(&mut self) {
        if self.pending > 0 {
            let f = self.b.use_var(self.fuel);
            let f = self.b.ins().iadd_imm_s(f, -(self.pending as i64));
            self.b.def_var(self.fuel, f);
            self.pending = 0;
        }
    }

    /// Whether an edge into `target` leaves the pending count for it to inherit (its only
    /// edge, going forwards), rather than materialising it first.
    fn passes_pending(&self, target: usize) -> bool {
        self.inherits.contains(&target)
    }

    /// Jumps forwards to the block at `target` (the end of the current one).
    fn goto(&mut self, target: usize) {
        if self.passes_pending(target) {
            self.inherited.insert(target, self.pending);
        } else {
            self.materialize();
        }
        let t = self.blocks[&target];
        self.b.ins().jump(t, &[]);
    }

    /// Branches to `target`, with a budget check first when it goes backwards.
    fn branch_to(&mut self, pc: usize, target: i64) {
        if target as usize <= pc {
            self.materialize();
            self.budget_check(pc);
            let t = self.target(target);
            self.b.ins().jump(t, &[]);
        } else {
            self.goto(target as usize);
        }
    }

    /// `if c { goto target } else { goto fallthrough }` from the jump at `pc`, each edge with
    /// its fuel: a backward edge materialises and checks the budget in a block of its own;
    /// a forward edge into a block of several edges materialises, once before the branch when
    /// both edges need it, else in a block of its own; the other edge passes the count on.
    fn branch_if(&mut self, pc: usize, c: Value, target: usize, fallthrough: usize) {
        let pending = self.pending;
        let backward = target <= pc;
        let taken_passes = !backward && self.passes_pending(target);
        let falls_passes = self.passes_pending(fallthrough);
        if !backward && !taken_passes && !falls_passes {
            // Both edges need the fuel: once, before the branch.
            self.materialize();
            let (t, f) = (self.blocks[&target], self.blocks[&fallthrough]);
            self.b.ins().brif(c, t, &[], f, &[]);
            return;
        }
        let taken = if taken_passes {
            self.inherited.insert(target, pending);
            self.blocks[&target]
        } else {
            self.b.create_block()
        };
        let falls = if falls_passes {
            self.inherited.insert(fallthrough, pending);
            self.blocks[&fallthrough]
        } else {
            self.b.create_block()
        };
        self.b.ins().brif(c, taken, &[], falls, &[]);
        if !taken_passes {
            self.enter(taken);
            self.pending = pending;
            self.branch_to(pc, target as i64);
        }
        if !falls_passes {
            self.enter(falls);
            self.pending = pending;
            self.materialize();
            let f = self.blocks[&fallthrough];
            self.b.ins().jump(f, &[]);
        }
    }

    fn call_helper(&mut self, pc: usize, id: Value) {
        // Bound the index (callx), then load the entry; an empty entry is an unknown helper.
        let limit = self.iconst(HELPER_SLOTS as u64);
        let out = self
            .b
            .ins()
            .icmp(IntCC::UnsignedGreaterThanOrEqual, id, limit);
        self.fault_if(out, fault::UNKNOWN_HELPER, pc, id, 0);
        let scaled = self.b.ins().ishl_imm_s(id, 3);
        let at = self.b.ins().iadd(self.ctx, scaled);
        // Not hoistable: the address is only valid after the bounds check above.
        let f = self.b.ins().load(
            types::I64,
            MemFlagsData::trusted().with_readonly(),
            at,
            layout::HELPERS as i32,
        );
        let missing = self.b.ins().icmp_imm_s(IntCC::Equal, f, 0);
        self.fault_if(missing, fault::UNKNOWN_HELPER, pc, id, 0);
        let sig = match self.helper_sig {
            Some(s) => s,
            None => {
                let s = self.b.import_signature(helper_signature(self.call_conv));
                self.helper_sig = Some(s);
                s
            }
        };
        let mut args = vec![self.ctx];
        for r in 1..=5 {
            let v = self.reg(r);
            args.push(v);
        }
        let call = self.b.ins().call_indirect(sig, f, &args);
        let r0 = self.b.inst_results(call)[0];
        self.set(0, r0);
        // A helper that stops the run (abort) records a fault.
        let kind = self
            .b
            .ins()
            .load(types::I64, mutable(), self.ctx, layout::FAULT as i32);
        let cont = self.b.create_block();
        self.b.ins().brif(kind, self.propagate, &[], cont, &[]);
        self.enter(cont);
    }

    /// `addr`'s offset from the start of the grant site `site` passed in last (a byte of the
    /// context, masked to a slot index), and that grant's limit at `limit_at` (a
    /// [`layout::limit`] of slot 0).
    fn remembered_offset(&mut self, site: usize, addr: Value, limit_at: usize) -> (Value, Value) {
        let remembered = self.b.ins().uload8(
            types::I64,
            mutable(),
            self.ctx,
            (layout::SITES + site) as i32,
        );
        let index = self
            .b
            .ins()
            .band_imm_s(remembered, (crate::memory::MAX_GRANTS - 1) as i64);
        let scaled = self.b.ins().imul_imm_s(index, layout::GRANT_SIZE as i64);
        let grant = self.b.ins().iadd(self.ctx, scaled);
        let start = self
            .b
            .ins()
            .load(types::I64, mutable(), grant, layout::start(0) as i32);
        let lim = self
            .b
            .ins()
            .load(types::I64, mutable(), grant, limit_at as i32);
        (self.b.ins().isub(addr, start), lim)
    }

    /// Whether `[addr, addr + len)` (`len` at least 1) lies inside the grant site `site` passed
    /// in last, with the read right: one load of the remembered slot, two comparisons.
    fn remembered_range(&mut self, site: usize, addr: Value, len: Value) -> Value {
        // The 1-byte read limit is the grant's length, or 0 without the read right.
        let (off, lim) = self.remembered_offset(site, addr, layout::limit(0, 1, false));
        let starts_inside = self.b.ins().icmp(IntCC::UnsignedLessThan, off, lim);
        let room = self.b.ins().isub(lim, off);
        let fits = self.b.ins().icmp(IntCC::UnsignedLessThanOrEqual, len, room);
        self.b.ins().band(starts_inside, fits)
    }

    /// Asks the slow-path check which grant holds `addr` (a probe: a miss records nothing),
    /// so that the site remembers it for the next time.
    fn probe_site(&mut self, pc: usize, site: usize, addr: Value) {
        let sig = match self.check_sig {
            Some(s) => s,
            None => {
                let s = self.b.import_signature(check_signature(self.call_conv));
                self.check_sig = Some(s);
                s
            }
        };
        let f = self
            .b
            .ins()
            .load(types::I64, fixed(), self.ctx, layout::CHECK as i32);
        let one = self.iconst(1);
        let kind = self.iconst(access::LOAD | access::PROBE | ((site as u64 + 1) << SITE_SHIFT));
        let pc_v = self.iconst(pc as u64);
        self.b
            .ins()
            .call_indirect(sig, f, &[self.ctx, addr, one, kind, pc_v]);
    }

    /// `memcmp(r1, r2, r3)` of the NAAM helpers, inline for 1 to [`INLINE_MEMCMP`] bytes when
    /// both ranges lie in the grants their sites remember: eight bytes a step, then single
    /// bytes, no call. Anything else (other lengths, a range in another grant or in none)
    /// probes the two sites, then calls the helper, whose result it is: the inline code only
    /// answers where the helper would compare the same bytes.
    fn inline_memcmp(&mut self, pc: usize) {
        use naam_ebpf::abi::helper as h;
        let (a, b, len) = (self.reg(1), self.reg(2), self.reg(3));
        let (site_a, site_b) = (pc % SITE_HINTS, (pc + 1) % SITE_HINTS);
        let check_a = self.b.create_block();
        let check_b = self.b.create_block();
        let slow = self.b.create_block();
        self.b.set_cold_block(slow);
        let head = self.b.create_block();
        self.b.append_block_param(head, types::I64);
        let done = self.b.create_block();
        self.b.append_block_param(done, types::I64);

        let below = self.b.ins().iadd_imm_s(len, -1);
        let small = self
            .b
            .ins()
            .icmp_imm_u(IntCC::UnsignedLessThan, below, INLINE_MEMCMP as i64);
        self.b.ins().brif(small, check_a, &[], slow, &[]);
        self.enter(check_a);
        let ok = self.remembered_range(site_a, a, len);
        self.b.ins().brif(ok, check_b, &[], slow, &[]);
        self.enter(check_b);
        let ok = self.remembered_range(site_b, b, len);
        let zero = self.iconst(0);
        self.b.ins().brif(ok, head, &[zero.into()], slow, &[]);

        // The loop: `i` bytes compared equal so far.
        self.b.switch_to_block(head);
        let i = self.b.block_params(head)[0];
        let left = self.b.ins().isub(len, i);
        let word = self.b.create_block();
        let tail = self.b.create_block();
        let words = self
            .b
            .ins()
            .icmp_imm_u(IntCC::UnsignedGreaterThanOrEqual, left, 8);
        self.b.ins().brif(words, word, &[], tail, &[]);
        self.enter(word);
        let pa = self.b.ins().iadd(a, i);
        let pb = self.b.ins().iadd(b, i);
        let wa = self.b.ins().load(types::I64, guest(), pa, 0);
        let wb = self.b.ins().load(types::I64, guest(), pb, 0);
        // Memory order, most significant byte first: byte-swapped on little-endian targets.
        let (wa, wb) = (self.b.ins().bswap(wa), self.b.ins().bswap(wb));
        let differ = self.b.create_block();
        let i8 = self.b.ins().iadd_imm_s(i, 8);
        let same = self.b.ins().icmp(IntCC::Equal, wa, wb);
        self.b
            .ins()
            .brif(same, head, &[i8.into()], differ, &[wa.into(), wb.into()]);
        self.enter(tail);
        let ended = self.b.create_block();
        let byte = self.b.create_block();
        self.b.ins().brif(left, byte, &[], ended, &[]);
        self.enter(byte);
        let pa = self.b.ins().iadd(a, i);
        let pb = self.b.ins().iadd(b, i);
        let ba = self.b.ins().uload8(types::I64, guest(), pa, 0);
        let bb = self.b.ins().uload8(types::I64, guest(), pb, 0);
        let i1 = self.b.ins().iadd_imm_s(i, 1);
        let same = self.b.ins().icmp(IntCC::Equal, ba, bb);
        self.b
            .ins()
            .brif(same, head, &[i1.into()], differ, &[ba.into(), bb.into()]);
        self.b.seal_block(head);
        self.enter(ended);
        let equal = self.iconst(h::CMP_EQUAL);
        self.b.ins().jump(done, &[equal.into()]);
        // The first difference, as unsigned numbers in memory order.
        self.b.append_block_param(differ, types::I64);
        self.b.append_block_param(differ, types::I64);
        self.enter(differ);
        let p = self.b.block_params(differ).to_vec();
        let less = self.b.ins().icmp(IntCC::UnsignedLessThan, p[0], p[1]);
        let (lt, gt) = (self.iconst(h::CMP_LESS), self.iconst(h::CMP_GREATER));
        let r = self.b.ins().select(less, lt, gt);
        self.b.ins().jump(done, &[r.into()]);

        self.enter(slow);
        self.probe_site(pc, site_a, a);
        self.probe_site(pc, site_b, b);
        let id = self.iconst(h::MEMCMP as u64);
        self.call_helper(pc, id);
        let r0 = self.reg(0);
        self.b.ins().jump(done, &[r0.into()]);

        self.enter(done);
        let r = self.b.block_params(done)[0];
        self.set(0, r);
    }

    /// Translates one instruction; returns true when it ended the block.
    fn op(&mut self, pc: usize, op: Op) -> bool {
        match op {
            Op::Alu {
                width,
                op,
                dst,
                src,
            } => {
                let a = self.reg(dst);
                let v = match width {
                    Width::W64 => {
                        let b = self.operand64(src);
                        self.alu(types::I64, op, a, b, src)
                    }
                    Width::W32 => {
                        let a32 = self.b.ins().ireduce(types::I32, a);
                        let b32 = match src {
                            Operand::Reg(r) => {
                                let v = self.reg(r);
                                self.b.ins().ireduce(types::I32, v)
                            }
                            Operand::Imm(i) => self.b.ins().iconst(types::I32, i as u32 as i64),
                        };
                        let r = self.alu(types::I32, op, a32, b32, src);
                        self.b.ins().uextend(types::I64, r)
                    }
                };
                self.set(dst, v);
            }
            Op::Neg { width, dst } => {
                let a = self.reg(dst);
                let v = match width {
                    Width::W64 => self.b.ins().ineg(a),
                    Width::W32 => {
                        let a32 = self.b.ins().ireduce(types::I32, a);
                        let n = self.b.ins().ineg(a32);
                        self.b.ins().uextend(types::I64, n)
                    }
                };
                self.set(dst, v);
            }
            Op::Mov { width, dst, src } => {
                let v = match (width, src) {
                    (Width::W64, s) => self.operand64(s),
                    (Width::W32, Operand::Imm(i)) => self.iconst(i as u32 as u64),
                    (Width::W32, Operand::Reg(r)) => {
                        let v = self.reg(r);
                        let lo = self.b.ins().ireduce(types::I32, v);
                        self.b.ins().uextend(types::I64, lo)
                    }
                };
                self.set(dst, v);
            }
            Op::MovSx {
                width,
                dst,
                src,
                bits,
            } => {
                let v = self.reg(src);
                let narrow = match bits {
                    8 => types::I8,
                    16 => types::I16,
                    _ => types::I32,
                };
                let lo = self.b.ins().ireduce(narrow, v);
                let ext = self.b.ins().sextend(types::I64, lo);
                let out = match width {
                    Width::W64 => ext,
                    Width::W32 => {
                        let w = self.b.ins().ireduce(types::I32, ext);
                        self.b.ins().uextend(types::I64, w)
                    }
                };
                self.set(dst, out);
            }
            Op::End { dst, bits, swap } => {
                let v = self.reg(dst);
                let out = match bits {
                    64 => {
                        if swap {
                            self.b.ins().bswap(v)
                        } else {
                            v
                        }
                    }
                    _ => {
                        let ty = if bits == 16 { types::I16 } else { types::I32 };
                        let lo = self.b.ins().ireduce(ty, v);
                        let lo = if swap { self.b.ins().bswap(lo) } else { lo };
                        self.b.ins().uextend(types::I64, lo)
                    }
                };
                self.set(dst, out);
            }
            Op::Lddw { dst, imm } => {
                let r = self
                    .program
                    .rodata_refs
                    .binary_search_by_key(&pc, |r| r.pc)
                    .ok()
                    .map(|k| self.program.rodata_refs[k]);
                let v = match r {
                    Some(r) => {
                        let base = self.b.ins().load(
                            types::I64,
                            fixed(),
                            self.ctx,
                            layout::start(slot::RODATA + r.index) as i32,
                        );
                        self.b.ins().iadd_imm_s(base, r.offset as i64)
                    }
                    None => self.iconst(imm),
                };
                self.set(dst, v);
            }
            Op::Load {
                dst,
                base,
                off,
                size,
                signed,
            } => {
                let addr = self.address(base, off);
                self.check_access(pc, addr, size as u64, access::LOAD);
                let v = if size == 8 {
                    self.b.ins().load(types::I64, guest(), addr, 0)
                } else {
                    let ty = int_type(size);
                    let n = self.b.ins().load(ty, guest(), addr, 0);
                    if signed {
                        self.b.ins().sextend(types::I64, n)
                    } else {
                        self.b.ins().uextend(types::I64, n)
                    }
                };
                self.set(dst, v);
            }
            Op::Store {
                base,
                off,
                size,
                value,
            } => {
                let addr = self.address(base, off);
                self.check_access(pc, addr, size as u64, access::STORE);
                let v = self.operand64(value);
                let v = if size == 8 {
                    v
                } else {
                    self.b.ins().ireduce(int_type(size), v)
                };
                self.b.ins().store(guest(), v, addr, 0);
            }
            Op::Atomic {
                base,
                off,
                size,
                op,
                fetch,
                src,
            } => {
                let addr = self.address(base, off);
                self.check_access(pc, addr, size as u64, access::ATOMIC);
                let misaligned = self.b.ins().band_imm_s(addr, size as i64 - 1);
                self.fault_if(misaligned, fault::MISALIGNED, pc, addr, size as u64);
                let ty = int_type(size);
                let operand = self.reg(src);
                let operand = if size == 8 {
                    operand
                } else {
                    self.b.ins().ireduce(ty, operand)
                };
                let flags = MemFlagsData::trusted();
                let old = match op {
                    AtomicOp::Cmpxchg => {
                        let r0 = self.reg(0);
                        let expected = if size == 8 {
                            r0
                        } else {
                            self.b.ins().ireduce(ty, r0)
                        };
                        self.b.ins().atomic_cas(flags, addr, expected, operand)
                    }
                    _ => {
                        let rmw = match op {
                            AtomicOp::Add => AtomicRmwOp::Add,
                            AtomicOp::Or => AtomicRmwOp::Or,
                            AtomicOp::And => AtomicRmwOp::And,
                            AtomicOp::Xor => AtomicRmwOp::Xor,
                            _ => AtomicRmwOp::Xchg,
                        };
                        self.b.ins().atomic_rmw(ty, flags, rmw, addr, operand)
                    }
                };
                if fetch {
                    let old = if size == 8 {
                        old
                    } else {
                        self.b.ins().uextend(types::I64, old)
                    };
                    let r = if op == AtomicOp::Cmpxchg { 0 } else { src };
                    self.set(r, old);
                }
            }
            Op::Ja { target } => {
                self.branch_to(pc, target);
                return true;
            }
            Op::Jump {
                width,
                cond,
                dst,
                src,
                target,
            } => {
                let (a, b) = match width {
                    Width::W64 => {
                        let a = self.reg(dst);
                        let b = self.operand64(src);
                        (a, b)
                    }
                    Width::W32 => {
                        let a = self.reg(dst);
                        let a = self.b.ins().ireduce(types::I32, a);
                        let b = match src {
                            Operand::Reg(r) => {
                                let v = self.reg(r);
                                self.b.ins().ireduce(types::I32, v)
                            }
                            Operand::Imm(i) => self.b.ins().iconst(types::I32, i as u32 as i64),
                        };
                        (a, b)
                    }
                };
                let c = match cond {
                    Cond::Set => {
                        let x = self.b.ins().band(a, b);
                        self.b.ins().icmp_imm_s(IntCC::NotEqual, x, 0)
                    }
                    _ => self.b.ins().icmp(intcc(cond), a, b),
                };
                self.branch_if(pc, c, target as usize, pc + 1);
                return true;
            }
            Op::CallHelper { id }
                if id == naam_ebpf::abi::helper::MEMCMP
                    && self.facts.helpers == crate::helpers::HelperSet::Naam =>
            {
                self.inline_memcmp(pc);
            }
            Op::CallHelper { id } => {
                let id = self.iconst(id as u64);
                self.call_helper(pc, id);
            }
            Op::CallReg { reg } => {
                let id = self.reg(reg);
                self.call_helper(pc, id);
            }
            Op::CallLocal { target } => {
                self.materialize();
                self.budget_check(pc);
                let callee_fp = self.b.ins().iadd_imm_s(self.fp, -(STACK_SIZE as i64));
                let bottom = self.b.ins().iadd_imm_s(callee_fp, -(STACK_SIZE as i64));
                let limit =
                    self.b
                        .ins()
                        .load(types::I64, fixed(), self.ctx, layout::STACK_LIMIT as i32);
                let deep = self.b.ins().icmp(IntCC::UnsignedLessThan, bottom, limit);
                let zero = self.iconst(0);
                self.fault_if(deep, fault::CALL_DEPTH, pc, zero, 0);
                self.store_executed();
                let callee = self
                    .checked
                    .function_at(target as usize)
                    .expect("verified call targets start functions");
                let f = match self.callees.get(&callee) {
                    Some(f) => *f,
                    None => {
                        let f = import_function(&mut self.b, callee, self.call_conv);
                        self.callees.insert(callee, f);
                        f
                    }
                };
                let mut args = vec![self.ctx, callee_fp];
                for r in 1..=5 {
                    let v = self.reg(r);
                    args.push(v);
                }
                let call = self.b.ins().call(f, &args);
                let results = self.b.inst_results(call).to_vec();
                let cont = self.b.create_block();
                self.b
                    .ins()
                    .brif(results[1], self.propagate, &[], cont, &[]);
                self.enter(cont);
                let executed =
                    self.b
                        .ins()
                        .load(types::I64, mutable(), self.ctx, layout::EXECUTED as i32);
                let budget =
                    self.b
                        .ins()
                        .load(types::I64, fixed(), self.ctx, layout::BUDGET as i32);
                let left = self.b.ins().isub(budget, executed);
                self.b.def_var(self.fuel, left);
                self.set(0, results[0]);
                let zero = self.iconst(0);
                for r in 1..=5 {
                    self.set(r, zero);
                }
            }
            Op::Exit => {
                self.materialize();
                self.store_executed();
                let r0 = self.reg(0);
                if self.entry_abi {
                    self.b.ins().return_(&[r0]);
                } else {
                    let ok = self.iconst(0);
                    self.b.ins().return_(&[r0, ok]);
                }
                return true;
            }
        }
        false
    }

    /// `a <op> b` in `ty` (I64 or I32) with eBPF's definitions of the trapping cases.
    fn alu(&mut self, ty: types::Type, op: AluOp, a: Value, b: Value, src: Operand) -> Value {
        match op {
            AluOp::Add => self.b.ins().iadd(a, b),
            AluOp::Sub => self.b.ins().isub(a, b),
            AluOp::Mul => self.b.ins().imul(a, b),
            AluOp::Or => self.b.ins().bor(a, b),
            AluOp::And => self.b.ins().band(a, b),
            AluOp::Xor => self.b.ins().bxor(a, b),
            AluOp::Lsh => self.b.ins().ishl(a, b),
            AluOp::Rsh => self.b.ins().ushr(a, b),
            AluOp::Arsh => self.b.ins().sshr(a, b),
            AluOp::Div | AluOp::Mod | AluOp::Sdiv | AluOp::Smod => {
                let width_mask = if ty == types::I64 {
                    u64::MAX
                } else {
                    u32::MAX as u64
                };
                let zero = self.b.ins().iconst(ty, 0);
                // A constant divisor needs no run-time guards.
                if let Operand::Imm(i) = src {
                    let d = imm64(i) & width_mask;
                    let minus_one = d == width_mask;
                    return match (op, d) {
                        (AluOp::Div | AluOp::Sdiv, 0) => zero,
                        (AluOp::Mod | AluOp::Smod, 0) => a,
                        (AluOp::Sdiv, _) if minus_one => self.b.ins().ineg(a),
                        (AluOp::Smod, _) if minus_one => zero,
                        (AluOp::Div, _) => self.b.ins().udiv(a, b),
                        (AluOp::Mod, _) => self.b.ins().urem(a, b),
                        (AluOp::Sdiv, _) => self.b.ins().sdiv(a, b),
                        _ => self.b.ins().srem(a, b),
                    };
                }
                let one = self.b.ins().iconst(ty, 1);
                let is_zero = self.b.ins().icmp_imm_s(IntCC::Equal, b, 0);
                match op {
                    AluOp::Div | AluOp::Mod => {
                        let safe = self.b.ins().select(is_zero, one, b);
                        if op == AluOp::Div {
                            let q = self.b.ins().udiv(a, safe);
                            self.b.ins().select(is_zero, zero, q)
                        } else {
                            let r = self.b.ins().urem(a, safe);
                            self.b.ins().select(is_zero, a, r)
                        }
                    }
                    _ => {
                        let is_minus_one = self.b.ins().icmp_imm_s(IntCC::Equal, b, -1);
                        let bad = self.b.ins().bor(is_zero, is_minus_one);
                        let safe = self.b.ins().select(bad, one, b);
                        if op == AluOp::Sdiv {
                            let q = self.b.ins().sdiv(a, safe);
                            let neg = self.b.ins().ineg(a);
                            let q = self.b.ins().select(is_minus_one, neg, q);
                            self.b.ins().select(is_zero, zero, q)
                        } else {
                            let r = self.b.ins().srem(a, safe);
                            let r = self.b.ins().select(is_minus_one, zero, r);
                            self.b.ins().select(is_zero, a, r)
                        }
                    }
                }
            }
        }
    }
}

fn int_type(size: u8) -> types::Type {
    match size {
        1 => types::I8,
        2 => types::I16,
        4 => types::I32,
        _ => types::I64,
    }
}

fn intcc(c: Cond) -> IntCC {
    match c {
        Cond::Eq => IntCC::Equal,
        Cond::Ne => IntCC::NotEqual,
        Cond::Gt => IntCC::UnsignedGreaterThan,
        Cond::Ge => IntCC::UnsignedGreaterThanOrEqual,
        Cond::Lt => IntCC::UnsignedLessThan,
        Cond::Le => IntCC::UnsignedLessThanOrEqual,
        Cond::Sgt => IntCC::SignedGreaterThan,
        Cond::Sge => IntCC::SignedGreaterThanOrEqual,
        Cond::Slt => IntCC::SignedLessThan,
        Cond::Sle => IntCC::SignedLessThanOrEqual,
        Cond::Set => IntCC::NotEqual,
    }
}

/// How many edges reach each block of the function `[start, end)` (its start: one more, the
/// call).
fn incoming_edges(
    checked: &Checked,
    start: usize,
    end: usize,
    leaders: &[usize],
) -> BTreeMap<usize, u32> {
    let mut n: BTreeMap<usize, u32> = BTreeMap::new();
    *n.entry(start).or_default() += 1;
    for (k, &leader) in leaders.iter().enumerate() {
        let block_end = leaders.get(k + 1).copied().unwrap_or(end);
        let last = (leader..block_end)
            .rev()
            .find_map(|pc| checked.ops[pc].map(|op| (pc, op)));
        match last {
            Some((_, Op::Ja { target })) => *n.entry(target as usize).or_default() += 1,
            Some((pc, Op::Jump { target, .. })) => {
                *n.entry(target as usize).or_default() += 1;
                *n.entry(pc + 1).or_default() += 1;
            }
            Some((_, Op::Exit)) => {}
            _ if block_end < end => *n.entry(block_end).or_default() += 1,
            _ => {}
        }
    }
    n
}

/// Block leaders of the function `[start, end)`: its start, jump targets, and the slot after
/// every jump and every local call (so the fuel is exact at each call's budget check).
fn leaders(checked: &Checked, start: usize, end: usize) -> Vec<usize> {
    let mut l = vec![start];
    for pc in start..end {
        match checked.ops[pc] {
            Some(Op::Ja { target }) | Some(Op::Jump { target, .. }) => {
                l.push(target as usize);
                if pc + 1 < end {
                    l.push(pc + 1);
                }
            }
            Some(Op::CallLocal { .. }) | Some(Op::Exit) if pc + 1 < end => l.push(pc + 1),
            _ => {}
        }
    }
    l.sort_unstable();
    l.dedup();
    l
}
