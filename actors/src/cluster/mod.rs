//! Multi-process clusters: nodes (one process each, one per machine in production) connected
//! by the QUIC transport. The coordinator node drives the same epoch protocol as a
//! single-process topology; partitions on other nodes are reached through control messages
//! ([`proto`]), and halo blocks go straight from node to node.
//!
//! * [`config`]: the cluster file (nodes, placement, certificates, timeouts).
//! * [`proto`]: the control messages (rkyv, validated), free of I/O.
//! * [`node`]: a node's QUIC endpoint and its hosted partitions.
//! * [`worker`]: a node that serves the coordinator.
//! * [`coord`]: the coordinator node.
//! * [`remote`]: the coordinator's handles on remote partitions.
//! * [`files`]: shipping partition files to nodes that lack them.
//! * [`serving`]: serving on a cluster (the engine node and the nodes of serving partitions).
pub mod config;
pub mod coord;
pub mod files;
pub mod node;
pub mod proto;
pub mod remote;
pub mod serving;
pub mod worker;

pub use config::ClusterFile;

/// Counts one connection node `node` refused (a foreign or missing certificate, a claimed
/// node id the certificate is not for, a bad hello, a node id already connected) in the
/// process's metrics as it happens: live on `/metrics`, and in the run's report.
pub(crate) fn count_refusal(node: u32) {
    use trellis_runtime::metrics::{names, Key, Metrics};
    Metrics::global().add(Key::new(names::REFUSED_CONNECTIONS).with("node", node), 1);
}

/// Prints one line to stderr in a single write, so lines of several node processes sharing a
/// terminal do not interleave.
pub(crate) fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}
pub use coord::{ClusterJob, ServingBeside};
pub use remote::RemotePart;
pub use worker::run_worker;
