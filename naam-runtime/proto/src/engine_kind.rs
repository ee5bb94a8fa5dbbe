//! Which engine runs a handler: part of the protocol because a server's manifest tells the NIC
//! and clients which engine to run each handler on. naam-vm, which implements both engines,
//! re-exports this type.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Which engine runs a handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// The reference interpreter (the engine that counts the instructions it executes).
    Interp,
    /// The memory-checked Cranelift JIT (the default).
    #[default]
    Jit,
    /// The interpreter as soon as the handler is verified, the JIT once a background thread
    /// has compiled it (or found it in the code cache): the switch is per handler, between
    /// two steps, and both engines give the same results, faults and instruction counts.
    Tiered,
}

impl EngineKind {
    /// Name as printed and parsed.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Interp => "interp",
            EngineKind::Jit => "jit",
            EngineKind::Tiered => "tiered",
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "interp" => Ok(EngineKind::Interp),
            "jit" => Ok(EngineKind::Jit),
            "tiered" => Ok(EngineKind::Tiered),
            other => Err(format!("unknown engine `{other}` (interp, jit, tiered)")),
        }
    }
}
