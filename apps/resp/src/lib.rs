//! # naam-resp
//!
//! RESP, the Redis protocol, in front of NAAM's MICA tables: redis-cli, redis-benchmark,
//! redis-py and every cluster-aware Redis client talk to NAAM with no NAAM code on their side.
//!
//! The core does no IO: [`codec`] parses and encodes RESP2/RESP3, [`command`] holds the one
//! table of commands, [`slots`] the Redis Cluster key space and map, [`front`] a connection's
//! state and [`store`] what it asks of the store. [`naam`] is the store that sends every op as
//! an active message through a [`naam_runtime::udp::UdpClient`] (so the steering places it at
//! the host, the NIC or the client like any other request), and [`server`] the poll loop that
//! drives connections: naam-server runs it on `resp_listen`, and the `naam-resp` gateway
//! beside an application.
#![deny(missing_docs)]

pub mod cluster_file;
pub mod codec;
pub mod command;
pub mod front;
pub mod naam;
pub mod server;
pub mod slots;
pub mod store;
