//! # naam-bench
//!
//! YCSB A–F against MICA and the B-tree on NAAM ([`ycsb`] generators, [`driver`] runs), and the
//! paper's experiments. Every result names its mode: `inproc` is one process with NIC cores,
//! DMA and one-sided RDMA emulated; nothing here is a hardware figure.
#![deny(missing_docs)]

pub mod auth_cost;
pub mod deployment;
pub mod deploys;
pub mod driver;
pub mod experiments;
pub mod memcached;
pub mod phase;
pub mod plot;
pub mod properties;
pub mod report;
pub mod sharded;
pub mod sim;
pub mod udp_ceiling;
pub mod udp_client;
pub mod verify;
pub mod ycsb;
pub mod ycsb_cli;
