//! ELF loader: turns an eBPF object file into linked handler programs.
//!
//! It owns three jobs, all pure (bytes in, programs out):
//! - parsing: any little-endian eBPF ELF whose handlers live in `naam/<name>` sections, whether
//!   Rust (`naam build`) or C (`clang -target bpf`) produced it;
//! - linking: bpf-to-bpf calls into `.text` (or any other code section) are resolved by appending
//!   the callee section and patching the pc-relative immediate; `lddw` references to read-only
//!   data (`.rodata*`) become absolute addresses of a copy the program owns;
//! - abort sealing: LLVM emits nothing after a call that never returns (the abort helper, and
//!   functions that only abort), so execution would fall into unrelated code. The loader inserts
//!   an `exit` after each such call and re-targets every jump and call.

use std::collections::HashMap;
use std::sync::Arc;

use crate::insn::{decode_all, encode_all, Insn};
use crate::memory::slot;
use crate::opcode::INSN_SIZE;
use naam_ebpf::abi::{helper, SECTION_PREFIX};
use object::{
    Architecture, Endianness, Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex,
    SectionKind, SymbolSection,
};

/// Errors while loading an object file. Each names the problem and where it is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// Not a parsable ELF file.
    #[error("malformed ELF: {0}")]
    Malformed(String),
    /// An ELF file for another machine or byte order.
    #[error("not a little-endian eBPF object (machine: {0})")]
    NotBpf(String),
    /// No `naam/<name>` section at all.
    #[error("no handler sections: expected at least one section named `{SECTION_PREFIX}<name>`")]
    NoHandlers,
    /// A handler section has a length that is not a whole number of instructions.
    #[error("section `{section}`: truncated bytecode ({len} bytes is not a multiple of 8)")]
    Truncated {
        /// Section name.
        section: String,
        /// Section length in bytes.
        len: usize,
    },
    /// A section name `naam/` with nothing after it, or an invalid name.
    #[error("section `{0}`: handler names must be 1-64 characters of [A-Za-z0-9_.-]")]
    BadName(String),
    /// A relocation this loader cannot apply.
    #[error("section `{section}`, insn {index}: {reason}")]
    Relocation {
        /// Section holding the instruction.
        section: String,
        /// Instruction index inside that section.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The requested handler is not in the object.
    #[error("no handler named `{name}` (the object has: {available})")]
    UnknownHandler {
        /// Requested name.
        name: String,
        /// Comma-separated names present.
        available: String,
    },
}

/// Read-only data referenced by a program; its address is baked into `lddw` immediates, so it
/// lives in a stable heap allocation for as long as any program refers to it.
#[derive(Debug)]
pub struct Rodata {
    /// Name of the ELF section the data was copied from.
    pub name: String,
    bytes: Box<[u64]>,
    len: usize,
}

impl Rodata {
    fn new(name: String, data: &[u8]) -> Rodata {
        // u64 storage keeps the copy 8-byte aligned, as the section was.
        let mut bytes = vec![0u64; data.len().div_ceil(8)].into_boxed_slice();
        for (i, chunk) in data.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            bytes[i] = u64::from_ne_bytes(w);
        }
        Rodata {
            name,
            bytes,
            len: data.len(),
        }
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the u64 storage holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.bytes.as_ptr().cast::<u8>(), self.len) }
    }

    /// True when the section is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// An `lddw` whose constant is an address inside read-only data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RodataRef {
    /// Slot of the `lddw`.
    pub pc: usize,
    /// Index into [`Program::rodata`].
    pub index: usize,
    /// Byte offset inside that section.
    pub offset: u64,
}

/// One linked handler program.
#[derive(Debug, Clone)]
pub struct Program {
    /// Handler name (the section name without `naam/`).
    pub name: String,
    /// Linked, sealed bytecode. `lddw` constants that refer to read-only data hold its
    /// absolute address in this process ([`Rodata::addr`]).
    pub code: Vec<u8>,
    /// Slot indices where functions start (0 is the entry).
    pub functions: Vec<usize>,
    /// Read-only data the bytecode points into (at most [`slot::MAX_RODATA`] sections).
    pub rodata: Vec<Arc<Rodata>>,
    /// Every `lddw` that points into `rodata`, so compiled code can take the address from the
    /// grant table instead of the constant (position-independent code).
    pub rodata_refs: Vec<RodataRef>,
}

impl Program {
    /// Number of instruction slots.
    pub fn len(&self) -> usize {
        self.code.len() / INSN_SIZE
    }

    /// True when the program has no instructions.
    pub fn is_empty(&self) -> bool {
        self.code.is_empty()
    }

    /// Builds a program from raw bytecode (tests, fuzzing, hand-written programs). The bytecode
    /// is not linked; only the entry is known to be a function.
    pub fn from_bytecode(name: &str, code: Vec<u8>) -> Program {
        Program {
            name: name.to_string(),
            code,
            functions: vec![0],
            rodata: Vec::new(),
            rodata_refs: Vec::new(),
        }
    }
}

/// Every handler of one object file.
#[derive(Debug, Clone)]
pub struct LoadedObject {
    /// Handlers in section order.
    pub programs: Vec<Program>,
}

impl LoadedObject {
    /// The handler named `name`; [`LoadError::UnknownHandler`] lists the names present.
    pub fn get(&self, name: &str) -> Result<&Program, LoadError> {
        self.programs
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| LoadError::UnknownHandler {
                name: name.to_string(),
                available: self
                    .programs
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Parses and links every `naam/<name>` handler of an eBPF ELF object.
pub fn load(bytes: &[u8]) -> Result<LoadedObject, LoadError> {
    // The ELF parser reads headers in place and needs them 8-byte aligned; slices need not be
    // (`include_bytes!`, a datagram's payload). Copy to an aligned spot when they are not.
    const ELF_ALIGN: usize = 8;
    if bytes.as_ptr().align_offset(ELF_ALIGN) != 0 {
        let mut buf = vec![0u8; bytes.len() + ELF_ALIGN];
        let at = buf.as_ptr().align_offset(ELF_ALIGN);
        let aligned = &mut buf[at..at + bytes.len()];
        aligned.copy_from_slice(bytes);
        return load_aligned(aligned);
    }
    load_aligned(bytes)
}

fn load_aligned(bytes: &[u8]) -> Result<LoadedObject, LoadError> {
    let file = object::File::parse(bytes).map_err(|e| LoadError::Malformed(e.to_string()))?;
    if file.architecture() != Architecture::Bpf || file.endianness() != Endianness::Little {
        return Err(LoadError::NotBpf(format!(
            "{:?}, {:?}",
            file.architecture(),
            file.endianness()
        )));
    }
    let mut linker = Linker {
        file: &file,
        rodata: HashMap::new(),
    };
    let mut programs = Vec::new();
    for section in file.sections() {
        let Ok(name) = section.name() else { continue };
        let Some(handler) = name.strip_prefix(SECTION_PREFIX) else {
            continue;
        };
        if !valid_name(handler) {
            return Err(LoadError::BadName(name.to_string()));
        }
        programs.push(linker.link(handler, section.index())?);
    }
    if programs.is_empty() {
        return Err(LoadError::NoHandlers);
    }
    Ok(LoadedObject { programs })
}

struct Linker<'d, 'f> {
    file: &'f object::File<'d>,
    rodata: HashMap<SectionIndex, Arc<Rodata>>,
}

impl Linker<'_, '_> {
    fn section_name(&self, index: SectionIndex) -> String {
        self.file
            .section_by_index(index)
            .ok()
            .and_then(|s| s.name().ok().map(str::to_string))
            .unwrap_or_else(|| format!("#{}", index.0))
    }

    fn code_of(&self, index: SectionIndex) -> Result<Vec<Insn>, LoadError> {
        let name = self.section_name(index);
        let section = self
            .file
            .section_by_index(index)
            .map_err(|e| LoadError::Malformed(e.to_string()))?;
        let data = section
            .data()
            .map_err(|e| LoadError::Malformed(format!("section `{name}`: {e}")))?;
        if data.len() % INSN_SIZE != 0 {
            return Err(LoadError::Truncated {
                section: name,
                len: data.len(),
            });
        }
        Ok(decode_all(data))
    }

    fn rodata_for(&mut self, index: SectionIndex) -> Result<Arc<Rodata>, String> {
        if let Some(r) = self.rodata.get(&index) {
            return Ok(r.clone());
        }
        let section = self
            .file
            .section_by_index(index)
            .map_err(|e| e.to_string())?;
        let name = section.name().unwrap_or("?").to_string();
        match section.kind() {
            SectionKind::ReadOnlyData | SectionKind::ReadOnlyString => {}
            SectionKind::Data | SectionKind::UninitializedData => {
                return Err(format!(
                    "mutable global data in `{name}` is not supported: handlers are stateless \
                     (keep state in regions or state words)"
                ))
            }
            other => {
                return Err(format!(
                    "`lddw` refers to section `{name}` of kind {other:?}"
                ))
            }
        }
        let data = section.data().map_err(|e| e.to_string())?;
        let r = Arc::new(Rodata::new(name, data));
        self.rodata.insert(index, r.clone());
        Ok(r)
    }

    /// Links the handler in `entry`: the entry section first, then every code section it calls.
    fn link(&mut self, name: &str, entry: SectionIndex) -> Result<Program, LoadError> {
        let mut insns = self.code_of(entry)?;
        if insns.is_empty() {
            return Err(LoadError::Truncated {
                section: self.section_name(entry),
                len: 0,
            });
        }
        let mut base: HashMap<SectionIndex, usize> = HashMap::from([(entry, 0)]);
        let mut queue = vec![entry];
        let mut functions = vec![0usize];
        let mut rodata: Vec<Arc<Rodata>> = Vec::new();
        let mut rodata_refs: Vec<RodataRef> = Vec::new();
        while let Some(sec_index) = queue.pop() {
            let section = self
                .file
                .section_by_index(sec_index)
                .map_err(|e| LoadError::Malformed(e.to_string()))?;
            let sec_name = self.section_name(sec_index);
            let sec_base = base[&sec_index];
            let sec_len = section.size() as usize / INSN_SIZE;
            for (offset, reloc) in section.relocations() {
                let index = offset as usize / INSN_SIZE;
                let err = |reason: String| LoadError::Relocation {
                    section: sec_name.clone(),
                    index,
                    reason,
                };
                if !(offset as usize).is_multiple_of(INSN_SIZE) || index >= sec_len {
                    return Err(err(format!(
                        "relocation at byte offset {offset} is not an instruction"
                    )));
                }
                let RelocationTarget::Symbol(sym_index) = reloc.target() else {
                    return Err(err("relocation without a symbol".into()));
                };
                let sym = self
                    .file
                    .symbol_by_index(sym_index)
                    .map_err(|e| err(e.to_string()))?;
                let sym_name = sym.name().unwrap_or("?").to_string();
                let target_section = match sym.section() {
                    SymbolSection::Section(s) => s,
                    _ => {
                        return Err(err(format!(
                            "undefined symbol `{sym_name}` (code without bitcode, or a missing \
                             function; handlers may only call helpers and their own code)"
                        )))
                    }
                };
                let at = sec_base + index;
                let insn = insns[at];
                if insn.is_local_call() || insn.is_helper_call() && insn.imm == -1 {
                    // Call relocation: the target is the symbol plus the encoded slot delta.
                    let target_sec = self
                        .file
                        .section_by_index(target_section)
                        .map_err(|e| err(e.to_string()))?;
                    if target_sec.kind() != SectionKind::Text {
                        return Err(err(format!("call to `{sym_name}`, which is not code")));
                    }
                    let target_base = match base.get(&target_section) {
                        Some(b) => *b,
                        None => {
                            let b = insns.len();
                            let code = self.code_of(target_section)?;
                            insns.extend(code);
                            base.insert(target_section, b);
                            queue.push(target_section);
                            // Every function of the section starts a body, called or not.
                            for f in self.file.symbols().filter(|s| {
                                s.section_index() == Some(target_section)
                                    && s.kind() == object::SymbolKind::Text
                            }) {
                                let start = b + f.address() as usize / INSN_SIZE;
                                if !functions.contains(&start) {
                                    functions.push(start);
                                }
                            }
                            b
                        }
                    };
                    let byte = sym.address() as i64 + (insn.imm as i64 + 1) * INSN_SIZE as i64;
                    if byte < 0 || !(byte as u64).is_multiple_of(INSN_SIZE as u64) {
                        return Err(err(format!(
                            "call to `{sym_name}` lands between instructions"
                        )));
                    }
                    let target = target_base + byte as usize / INSN_SIZE;
                    let delta = target as i64 - (at as i64 + 1);
                    insns[at] = Insn {
                        src: 1,
                        imm: i32::try_from(delta).map_err(|_| err("call too far".into()))?,
                        ..insn
                    };
                    if !functions.contains(&target) {
                        functions.push(target);
                    }
                } else if insn.is_wide() {
                    if at + 1 >= insns.len() {
                        return Err(err("`lddw` without its second slot".into()));
                    }
                    let data = self.rodata_for(target_section).map_err(err)?;
                    let addend = sym.address() as i64 + insn.imm as i64;
                    if addend < 0 || addend as usize > data.len() {
                        return Err(err(format!(
                            "reference past the end of `{}` (offset {addend})",
                            data.name
                        )));
                    }
                    let addr = data.addr() + addend as u64;
                    insns[at] = Insn {
                        src: 0,
                        imm: addr as u32 as i32,
                        ..insn
                    };
                    insns[at + 1].imm = (addr >> 32) as u32 as i32;
                    let index = match rodata.iter().position(|r| Arc::ptr_eq(r, &data)) {
                        Some(k) => k,
                        None => {
                            if rodata.len() == slot::MAX_RODATA {
                                return Err(err(format!(
                                    "more than {} read-only data sections",
                                    slot::MAX_RODATA
                                )));
                            }
                            rodata.push(data);
                            rodata.len() - 1
                        }
                    };
                    rodata_refs.push(RodataRef {
                        pc: at,
                        index,
                        offset: addend as u64,
                    });
                } else {
                    return Err(err(format!(
                        "unsupported relocation against `{sym_name}` on opcode {:#04x}",
                        insn.op
                    )));
                }
            }
        }
        // Calls resolved inside one section (no relocation) also start functions.
        for (pc, insn) in insns.iter().enumerate() {
            if insn.is_local_call() {
                let t = insn.target(pc);
                if t >= 0 && (t as usize) < insns.len() && !functions.contains(&(t as usize)) {
                    functions.push(t as usize);
                }
            }
        }
        functions.sort_unstable();
        let (insns, functions, new_index) = seal_aborts(insns, functions);
        for r in &mut rodata_refs {
            r.pc = new_index[r.pc];
        }
        rodata_refs.sort_by_key(|r| r.pc);
        Ok(Program {
            name: name.to_string(),
            code: encode_all(&insns),
            functions,
            rodata,
            rodata_refs,
        })
    }
}

/// Inserts `exit` after every call that cannot return (the abort helper, and local calls to
/// functions without any `exit`), then re-targets jumps and calls. Returns the new instructions,
/// the new function starts, and the new index of every old slot (plus one past the end).
pub(crate) fn seal_aborts(
    insns: Vec<Insn>,
    functions: Vec<usize>,
) -> (Vec<Insn>, Vec<usize>, Vec<usize>) {
    let n = insns.len();
    // A function "returns" if its body holds an exit. Bodies run to the next function start.
    let mut bounds = functions.clone();
    bounds.push(n);
    let returns: HashMap<usize, bool> = functions
        .iter()
        .enumerate()
        .map(|(k, &start)| {
            let end = bounds[k + 1].min(n);
            (start, insns[start.min(end)..end].iter().any(Insn::is_exit))
        })
        .collect();
    let never_returns = |pc: usize, insn: &Insn| -> bool {
        if insn.is_helper_call() {
            return insn.imm as u32 == helper::ABORT;
        }
        if insn.is_local_call() {
            let t = insn.target(pc);
            return t >= 0 && returns.get(&(t as usize)) == Some(&false);
        }
        false
    };
    let mut seal_after = vec![false; n];
    let mut any = false;
    for (pc, insn) in insns.iter().enumerate() {
        let next_is_exit = insns.get(pc + 1).is_some_and(Insn::is_exit);
        if never_returns(pc, insn) && !next_is_exit {
            seal_after[pc] = true;
            any = true;
        }
    }
    if !any {
        let identity = (0..=n).collect();
        return (insns, functions, identity);
    }
    // new_index[old] for every old slot, plus one past the end.
    let mut new_index = Vec::with_capacity(n + 1);
    let mut shift = 0usize;
    for &sealed in &seal_after {
        new_index.push(new_index.len() + shift);
        if sealed {
            shift += 1;
        }
    }
    new_index.push(n + shift);
    let mut out = Vec::with_capacity(n + shift);
    for (pc, insn) in insns.iter().enumerate() {
        let mut insn = *insn;
        if insn.is_jump() || insn.is_local_call() {
            let t = insn.target(pc);
            if t >= 0 && t as usize <= n {
                let delta = new_index[t as usize] as i64 - (new_index[pc] as i64 + 1);
                if insn.is_local_call() || insn.op == crate::opcode::JA32 {
                    insn.imm = delta as i32;
                } else if let Ok(off) = i16::try_from(delta) {
                    insn.off = off;
                }
                // An out-of-range target stays as it is; the verifier reports it.
            }
        }
        out.push(insn);
        if seal_after[pc] {
            out.push(Insn::EXIT);
        }
    }
    let functions = functions.iter().map(|&f| new_index[f.min(n)]).collect();
    (out, functions, new_index)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::opcode::{ALU_MOV, CALL, CALL_LOCAL, CLASS_ALU64, CLASS_JMP, JMP_JEQ};

    fn call_helper(id: u32) -> Insn {
        Insn::new(CALL, 0, 0, 0, id as i32)
    }

    #[test]
    fn seal_inserts_exit_and_retargets() {
        // 0: if r1 == 0 goto +1 (-> 2)
        // 1: call abort           (falls into 2 without sealing)
        // 2: r0 = 5
        // 3: exit
        let prog = vec![
            Insn::new(CLASS_JMP | JMP_JEQ, 1, 0, 1, 0),
            call_helper(helper::ABORT),
            Insn::new(CLASS_ALU64 | ALU_MOV, 0, 0, 0, 5),
            Insn::EXIT,
        ];
        let (out, f, index) = seal_aborts(prog, vec![0]);
        assert_eq!(index, vec![0, 1, 3, 4, 5]);
        assert_eq!(out.len(), 5);
        assert!(out[2].is_exit());
        assert_eq!(out[0].target(0), 3, "jump still lands on `r0 = 5`");
        assert_eq!(f, vec![0]);
    }

    #[test]
    fn seal_follows_functions_that_never_return() {
        // entry: 0: call +1 (-> 2, a function that only aborts), then nothing.
        // 1: exit  (unrelated)
        // fn at 2: call abort (no exit)
        let prog = vec![
            Insn::new(CALL, 0, CALL_LOCAL, 0, 1),
            Insn::EXIT,
            call_helper(helper::ABORT),
        ];
        let (out, f, _) = seal_aborts(prog, vec![0, 2]);
        // 0 is followed by exit already; 2 gets sealed.
        assert_eq!(out.len(), 4);
        assert!(out[3].is_exit());
        assert_eq!(f, vec![0, 2]);
        assert_eq!(out[0].target(0), 2);
    }

    #[test]
    fn garbage_is_malformed() {
        assert!(matches!(load(b"not an elf"), Err(LoadError::Malformed(_))));
        assert!(matches!(load(&[]), Err(LoadError::Malformed(_))));
    }
}
