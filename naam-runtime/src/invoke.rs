//! Whole messages for people (`naam call`, `naam run --region`): descriptors written as
//! `REGION:OFFSET:LEN[:ACCESS]` with regions by name, regions given as files, a local run of a
//! message through every step on an in-process cluster, and a call on a deployment. Parsing is
//! pure; the runs are thin wrappers over [`crate::cluster`] and [`crate::udp::UdpClient`].

use std::path::PathBuf;
use std::sync::Arc;

use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use serde_json::{json, Value};

use crate::cluster::{AppSpec, Cluster, ClusterConfig, PolicyChoice, RegionSpec};
use crate::HandlerSpec;
use crate::RegionMemory;
use naam_proto::handler_id;
use naam_proto::wire::{Reply, Status};
use naam_proto::EngineKind;
use naam_proto::Placement;
use naam_vm::LoadedObject;

/// Why a message could not be described or run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvokeError {
    /// A `--desc` is not `REGION:OFFSET:LEN[:ACCESS]`.
    #[error("--desc {spec}: {reason} (REGION:OFFSET:LEN[:r|rw|rwa], REGION a name or an rkey)")]
    Descriptor {
        /// As given.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// A `--region` is not `NAME=FILE[,rkey=HEX][,access=r|rw|rwa]`.
    #[error("--region {spec}: {reason} (NAME=FILE[,rkey=HEX][,access=r|rw|rwa])")]
    Region {
        /// As given.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// Access letters other than r, w, a.
    #[error("access `{0}`: use letters r (read), w (write), a (atomic)")]
    Access(String),
    /// The one-app cluster of a local run could not be set up (the handler is not in the
    /// object, it does not verify, a region is refused).
    #[error("setting up the local run: {0}")]
    Setup(String),
    /// The message could not be sent to the local cluster.
    #[error("running the message: {0}")]
    Call(String),
}

/// `ACCESS_*` bits of `r`, `rw`, `rwa`, ...
pub fn parse_access(text: &str) -> Result<u32, InvokeError> {
    let mut bits = 0;
    for c in text.chars() {
        bits |= match c {
            'r' => ACCESS_READ,
            'w' => ACCESS_WRITE,
            'a' => ACCESS_ATOMIC,
            _ => return Err(InvokeError::Access(text.to_string())),
        };
    }
    if bits == 0 {
        return Err(InvokeError::Access(text.to_string()));
    }
    Ok(bits)
}

fn number(text: &str) -> Option<u64> {
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// Parses `REGION:OFFSET:LEN[:ACCESS]`; `rkey_of` resolves a region name (numbers are rkeys).
pub fn parse_descriptor(
    spec: &str,
    rkey_of: &dyn Fn(&str) -> Option<u64>,
) -> Result<Descriptor, InvokeError> {
    let bad = |reason: &str| InvokeError::Descriptor {
        spec: spec.to_string(),
        reason: reason.to_string(),
    };
    let parts: Vec<&str> = spec.split(':').collect();
    if !(3..=4).contains(&parts.len()) {
        return Err(bad("three or four fields"));
    }
    let rkey = rkey_of(parts[0])
        .or_else(|| number(parts[0]))
        .ok_or_else(|| bad(&format!("no region `{}`", parts[0])))?;
    let offset = number(parts[1]).ok_or_else(|| bad("OFFSET is not a number"))?;
    let len = number(parts[2])
        .and_then(|l| u32::try_from(l).ok())
        .ok_or_else(|| bad("LEN is not a 32-bit number"))?;
    let access = match parts.get(3) {
        Some(a) => parse_access(a).map_err(|e| bad(&e.to_string()))?,
        None => ACCESS_READ,
    };
    Ok(Descriptor {
        rkey,
        offset,
        len,
        access,
    })
}

/// A region given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionFile {
    /// Name (descriptors use it).
    pub name: String,
    /// File with its contents.
    pub file: PathBuf,
    /// The rkey, if chosen (handlers that carry rkeys in their args need a known one).
    pub rkey: Option<u64>,
    /// Rights handlers have (default `rwa`: a local run is the user's own memory).
    pub access: u32,
}

/// Parses `NAME=FILE[,rkey=HEX][,access=r|rw|rwa]`.
pub fn parse_region(spec: &str) -> Result<RegionFile, InvokeError> {
    let bad = |reason: &str| InvokeError::Region {
        spec: spec.to_string(),
        reason: reason.to_string(),
    };
    let (name, rest) = spec.split_once('=').ok_or_else(|| bad("no `=`"))?;
    if name.is_empty() || name.contains(':') {
        return Err(bad("a region needs a name without `:`"));
    }
    let mut fields = rest.split(',');
    let file = fields
        .next()
        .filter(|f| !f.is_empty())
        .ok_or_else(|| bad("no file"))?;
    let mut region = RegionFile {
        name: name.to_string(),
        file: PathBuf::from(file),
        rkey: None,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    for f in fields {
        match f.split_once('=') {
            Some(("rkey", v)) => {
                region.rkey = Some(
                    number(v)
                        .filter(|k| *k != 0)
                        .ok_or_else(|| bad("rkey must be a non-zero number"))?,
                )
            }
            Some(("access", v)) => {
                region.access = parse_access(v).map_err(|e| bad(&e.to_string()))?
            }
            _ => return Err(bad(&format!("unknown option `{f}`"))),
        }
    }
    Ok(region)
}

/// Settings of a local whole-message run.
pub struct LocalMessage<'a> {
    /// The loaded object holding the handler.
    pub object: Arc<LoadedObject>,
    /// Name of the handler in the object (its section name without `naam/`).
    pub handler: &'a str,
    /// Whether the handler writes (its `Write` steps are applied).
    pub write: bool,
    /// The engine that runs every step.
    pub engine: EngineKind,
    /// Instructions per step.
    pub budget: u64,
    /// Regions and their contents.
    pub regions: Vec<(RegionFile, Vec<u8>)>,
    /// Inline args, handed to every step.
    pub args: &'a [u8],
    /// First step's descriptors (`REGION:OFFSET:LEN[:ACCESS]`).
    pub descriptors: &'a [String],
}

/// A region of a local run as it was installed: name, rkey, length.
pub type InstalledRegion = (String, u64, usize);

/// Runs a whole message, every step, on a one-app in-process cluster whose regions are the
/// given files' bytes (in memory: the files are not changed). Returns the reply and the
/// regions' rkeys.
pub fn run_local(m: LocalMessage<'_>) -> Result<(Reply, Vec<InstalledRegion>), InvokeError> {
    const APP: u32 = 1;
    let spec = if m.write {
        HandlerSpec::write(m.handler)
    } else {
        HandlerSpec::read(m.handler)
    };
    let chosen: Vec<Option<u64>> = m.regions.iter().map(|(r, _)| r.rkey).collect();
    let app = AppSpec {
        id: APP,
        name: "local".into(),
        owner: Placement::Host,
        regions: m
            .regions
            .iter()
            .map(|(r, bytes)| RegionSpec {
                name: r.name.clone(),
                access: r.access,
                contents: bytes.clone(),
            })
            .collect(),
        object: m.object,
        handlers: vec![spec],
    }
    .with_engine(m.engine)
    .with_budget(m.budget);
    // Chosen rkeys where given; the others numbered from 1 past every chosen one.
    let mut next = chosen.iter().flatten().max().copied().unwrap_or(0) + 1;
    let mut keys = chosen.into_iter();
    let cluster = Cluster::builder()
        .config(ClusterConfig {
            host_executors: 1,
            nic_executors: 0,
            policy: PolicyChoice::Always(Placement::Host),
            ..ClusterConfig::default()
        })
        .app(app)
        .region_backing(Box::new(move |_, r: &RegionSpec| {
            let key = keys.next().flatten().unwrap_or_else(|| {
                next += 1;
                next - 1
            });
            Ok((RegionMemory::from_bytes(&r.contents), Some(key)))
        }))
        .build()
        .map_err(|e| InvokeError::Setup(e.to_string()))?;
    let rkeys: Vec<InstalledRegion> = m
        .regions
        .iter()
        .map(|(r, bytes)| {
            (
                r.name.clone(),
                cluster.region_key(APP, &r.name).unwrap_or(0),
                bytes.len(),
            )
        })
        .collect();
    let rkey_of = |name: &str| rkeys.iter().find(|(n, ..)| n == name).map(|(_, k, _)| *k);
    let descs: Vec<Descriptor> = m
        .descriptors
        .iter()
        .map(|d| parse_descriptor(d, &rkey_of))
        .collect::<Result<_, _>>()?;
    let mut client = cluster.client();
    let reply = client
        .call(APP, handler_id(m.handler), m.args, &descs)
        .map_err(|e| InvokeError::Call(e.to_string()))?;
    Ok((reply, rkeys))
}

/// A status as people read it (`ok`, `handler-error`): [`Status::name`].
pub fn status_name(s: Status) -> String {
    s.name().to_string()
}

/// The JSON a command prints for a reply: status and code by name, where it ran, its steps
/// and its bytes (an error's message as text).
pub fn reply_json(reply: &Reply) -> Value {
    let mut v = json!({
        "status": status_name(reply.status),
        "placement": reply.placement.name(),
        "steps": reply.steps,
    });
    match reply.status {
        // The handler's bytes: its reply, or what it wrote before its error.
        Status::Ok => v["reply_hex"] = json!(hex::encode(&reply.payload)),
        Status::HandlerError => {
            v["reply_hex"] = json!(hex::encode(&reply.payload));
            v["code"] = json!(reply.code);
            v["code_name"] = json!(naam_ebpf::abi::error_code::Describe(reply.code).to_string());
        }
        // The runtime's error: its text, as text, never hex.
        _ => {
            v["code"] = json!(reply.code);
            v["message"] = json!(String::from_utf8_lossy(&reply.payload));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_by_name_or_rkey() {
        let names = |n: &str| (n == "data").then_some(0xabcd);
        let d = parse_descriptor("data:8:16", &names).unwrap();
        assert_eq!(
            (d.rkey, d.offset, d.len, d.access),
            (0xabcd, 8, 16, ACCESS_READ)
        );
        let d = parse_descriptor("0x10:0x20:4:rw", &names).unwrap();
        assert_eq!((d.rkey, d.offset, d.len), (0x10, 0x20, 4));
        assert_eq!(d.access, ACCESS_READ | ACCESS_WRITE);
        for bad in [
            "data:8",
            "nope:0:8",
            "data:x:8",
            "data:0:99999999999",
            "data:0:8:q",
            "a:b:c:d:e",
        ] {
            assert!(parse_descriptor(bad, &names).is_err(), "{bad}");
        }
    }

    #[test]
    fn regions_with_options() {
        let r = parse_region("data=d.bin,rkey=0xab,access=r").unwrap();
        assert_eq!(r.name, "data");
        assert_eq!(r.rkey, Some(0xab));
        assert_eq!(r.access, ACCESS_READ);
        assert_eq!(parse_region("t=x.bin").unwrap().rkey, None);
        for bad in [
            "x",
            "=f",
            "a:b=f",
            "d=",
            "d=f,rkey=0",
            "d=f,colour=red",
            "d=f,access=z",
        ] {
            assert!(parse_region(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn statuses_read_as_words() {
        assert_eq!(status_name(Status::HandlerError), "handler-error");
        assert_eq!(status_name(Status::Ok), "ok");
    }
}
