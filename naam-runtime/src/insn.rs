//! eBPF instruction model shared by the loader, the verifier and the interpreter: decoding,
//! encoding, opcode classes and the few derived facts (jump targets, wide loads) that every
//! pass needs. Opcode values are rbpf's ([`rbpf::ebpf`]), so both engines speak the same ISA.

use rbpf::ebpf;

/// Size of one instruction slot in bytes.
pub const INSN_SIZE: usize = ebpf::INSN_SIZE;

/// One decoded instruction slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    /// Opcode byte.
    pub op: u8,
    /// Destination register (low nibble of byte 1).
    pub dst: u8,
    /// Source register (high nibble of byte 1).
    pub src: u8,
    /// Signed 16-bit offset.
    pub off: i16,
    /// Signed 32-bit immediate.
    pub imm: i32,
}

impl Insn {
    /// Decodes the slot at `bytes[0..8]`.
    pub fn decode(bytes: &[u8; INSN_SIZE]) -> Insn {
        Insn {
            op: bytes[0],
            dst: bytes[1] & 0x0f,
            src: bytes[1] >> 4,
            off: i16::from_le_bytes([bytes[2], bytes[3]]),
            imm: i32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
        }
    }

    /// Encodes the slot.
    pub fn encode(&self) -> [u8; INSN_SIZE] {
        let off = self.off.to_le_bytes();
        let imm = self.imm.to_le_bytes();
        [
            self.op,
            (self.src << 4) | (self.dst & 0x0f),
            off[0],
            off[1],
            imm[0],
            imm[1],
            imm[2],
            imm[3],
        ]
    }

    /// Opcode class (low three bits).
    pub fn class(&self) -> u8 {
        self.op & 0x07
    }

    /// True for `lddw`, which occupies two slots.
    pub fn is_wide(&self) -> bool {
        self.op == ebpf::LD_DW_IMM
    }

    /// True for a helper call (`call imm`, src 0).
    pub fn is_helper_call(&self) -> bool {
        self.op == ebpf::CALL && self.src == 0
    }

    /// True for a bpf-to-bpf call (`call pc+imm`, src 1).
    pub fn is_local_call(&self) -> bool {
        self.op == ebpf::CALL && self.src == 1
    }

    /// True for `exit`.
    pub fn is_exit(&self) -> bool {
        self.op == ebpf::EXIT
    }

    /// True for a jump that carries an offset (`ja` and every conditional jump, 64 and 32 bit).
    pub fn is_jump(&self) -> bool {
        match self.class() {
            ebpf::BPF_JMP => !matches!(self.op, ebpf::CALL | ebpf::EXIT | ebpf::TAIL_CALL),
            ebpf::BPF_JMP32 => true,
            _ => false,
        }
    }

    /// Target slot of a jump at `pc`, or of a local call at `pc`.
    pub fn target(&self, pc: usize) -> i64 {
        let delta = if self.is_local_call() {
            self.imm as i64
        } else {
            self.off as i64
        };
        pc as i64 + 1 + delta
    }

    /// The `exit` instruction.
    pub const EXIT: Insn = Insn {
        op: ebpf::EXIT,
        dst: 0,
        src: 0,
        off: 0,
        imm: 0,
    };
}

/// Decodes a bytecode buffer whose length is a multiple of [`INSN_SIZE`].
pub fn decode_all(code: &[u8]) -> Vec<Insn> {
    code.chunks_exact(INSN_SIZE)
        .map(|c| {
            let mut b = [0u8; INSN_SIZE];
            b.copy_from_slice(c);
            Insn::decode(&b)
        })
        .collect()
}

/// Encodes instructions back into bytecode.
pub fn encode_all(insns: &[Insn]) -> Vec<u8> {
    insns.iter().flat_map(|i| i.encode()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn encode_decode_round_trip(op: u8, dst in 0u8..16, src in 0u8..16, off: i16, imm: i32) {
            let i = Insn { op, dst, src, off, imm };
            prop_assert_eq!(Insn::decode(&i.encode()), i);
        }
    }

    #[test]
    fn targets() {
        let ja = Insn {
            op: ebpf::JA,
            dst: 0,
            src: 0,
            off: -1,
            imm: 0,
        };
        assert!(ja.is_jump());
        assert_eq!(ja.target(5), 5);
        let call = Insn {
            op: ebpf::CALL,
            dst: 0,
            src: 1,
            off: 0,
            imm: 3,
        };
        assert!(call.is_local_call() && !call.is_jump());
        assert_eq!(call.target(2), 6);
    }
}
