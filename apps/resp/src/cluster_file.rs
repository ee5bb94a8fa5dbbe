//! The cluster file: the static list of a cluster's nodes, one file that every naam-server of
//! the cluster (`resp_cluster = FILE`) and every `naam-resp --cluster FILE` gateway reads.
//!
//! ```toml
//! [[node]]
//! resp = "127.0.0.1:7001"      # where Redis clients connect (naam-server's resp_listen)
//! naam = "127.0.0.1:7101"      # naam-server's UDP address (for gateways, which are NAAM clients)
//! slots = ["0-5460"]
//! # id = "40 hex digits"       # optional; derived from `resp` when absent
//! ```

use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

use crate::slots::{derived_id, parse_range, ClusterMap, MapError, Node};

/// The file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// The nodes.
    pub node: Vec<NodeEntry>,
}

/// One node in the file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    /// Its RESP address.
    pub resp: SocketAddr,
    /// Its naam-server's UDP address.
    pub naam: SocketAddr,
    /// Its slot ranges (`"A-B"` or `"A"`).
    pub slots: Vec<String>,
    /// Its node id; derived from `resp` when absent.
    #[serde(default)]
    pub id: Option<String>,
}

/// Why a cluster file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterFileError {
    /// Not readable.
    #[error("cluster file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not TOML of the file's form.
    #[error("cluster file {path}: {message}")]
    Format {
        /// The file.
        path: String,
        /// The parser's message (with the line).
        message: String,
    },
    /// Not a map of the slots.
    #[error("cluster file {path}: {source}")]
    Map {
        /// The file.
        path: String,
        /// What is wrong.
        source: MapError,
    },
}

impl ClusterFile {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<ClusterFile, ClusterFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterFileError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses the file's text (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<ClusterFile, ClusterFileError> {
        toml::from_str(text).map_err(|e| ClusterFileError::Format {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    }

    /// The nodes as the map's, with their ids.
    pub fn nodes(&self, path: &Path) -> Result<Vec<Node>, ClusterFileError> {
        let map_err = |source| ClusterFileError::Map {
            path: path.display().to_string(),
            source,
        };
        self.node
            .iter()
            .map(|n| {
                let ranges = n
                    .slots
                    .iter()
                    .map(|r| parse_range(n.resp, r))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(map_err)?;
                Ok(Node {
                    id: n.id.clone().unwrap_or_else(|| derived_id(n.resp)),
                    addr: n.resp,
                    ranges,
                })
            })
            .collect()
    }

    /// The map as node `me` (its RESP address) sees it.
    pub fn map_for(&self, me: SocketAddr, path: &Path) -> Result<ClusterMap, ClusterFileError> {
        ClusterMap::new(self.nodes(path)?, me).map_err(|source| ClusterFileError::Map {
            path: path.display().to_string(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_of_three_nodes_is_a_map_and_a_bad_one_names_its_fault() {
        let text = r#"
[[node]]
resp = "127.0.0.1:7001"
naam = "127.0.0.1:7101"
slots = ["0-5460"]
[[node]]
resp = "127.0.0.1:7002"
naam = "127.0.0.1:7102"
slots = ["5461-10922"]
[[node]]
resp = "127.0.0.1:7003"
naam = "127.0.0.1:7103"
slots = ["10923-16383"]
"#;
        let p = Path::new("cluster.toml");
        let f = ClusterFile::parse(text, p).unwrap();
        let m = f.map_for("127.0.0.1:7002".parse().unwrap(), p).unwrap();
        assert!(m.is_mine(5461));
        let bad = text.replace("10923-16383", "10924-16383");
        let e = ClusterFile::parse(&bad, p)
            .unwrap()
            .map_for("127.0.0.1:7002".parse().unwrap(), p);
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("slot 10923 is served by no node"));
        let typo = text.replace("slots =", "slot =");
        assert!(ClusterFile::parse(&typo, p).is_err());
    }
}
