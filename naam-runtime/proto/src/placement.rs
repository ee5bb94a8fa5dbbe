//! Where a message's steps run.

use std::fmt;
use std::str::FromStr;

use naam_ebpf::abi::placement as abi;
use serde::Serialize;

/// A placement: the client (one-sided READs), SmartNIC cores (DMA) or server host cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// On the client, over data fetched by one-sided READs.
    Client,
    /// On SmartNIC cores, over data reached by DMA.
    Nic,
    /// On server host cores, over region memory directly.
    Host,
}

impl Placement {
    /// All placements, in index order.
    pub const ALL: [Placement; 3] = [Placement::Client, Placement::Nic, Placement::Host];

    /// Dense index (0, 1, 2) for per-placement arrays.
    pub const fn index(self) -> usize {
        match self {
            Placement::Client => 0,
            Placement::Nic => 1,
            Placement::Host => 2,
        }
    }

    /// The ABI value handlers see in `Context::placement`.
    pub const fn abi(self) -> u32 {
        match self {
            Placement::Client => abi::CLIENT,
            Placement::Nic => abi::NIC,
            Placement::Host => abi::HOST,
        }
    }

    /// From the ABI / wire value.
    pub const fn from_abi(v: u32) -> Option<Placement> {
        match v {
            abi::CLIENT => Some(Placement::Client),
            abi::NIC => Some(Placement::Nic),
            abi::HOST => Some(Placement::Host),
            _ => None,
        }
    }

    /// Lower-case name: `client`, `nic` or `host`.
    pub const fn name(self) -> &'static str {
        match self {
            Placement::Client => "client",
            Placement::Nic => "nic",
            Placement::Host => "host",
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "client" => Ok(Placement::Client),
            "nic" => Ok(Placement::Nic),
            "host" => Ok(Placement::Host),
            other => Err(format!("unknown placement `{other}` (client, nic, host)")),
        }
    }
}
