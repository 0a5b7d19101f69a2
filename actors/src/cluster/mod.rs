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
pub mod config;
pub mod coord;
pub mod files;
pub mod node;
pub mod proto;
pub mod remote;
pub mod worker;

pub use config::ClusterFile;

/// Prints one line to stderr in a single write, so lines of several node processes sharing a
/// terminal do not interleave.
/// Puts the connections node `node` refused (foreign or missing certificates, a claimed
/// node id the certificate is not for, bad hellos) into the run's metrics and so its report.
pub(crate) fn count_refusals(node: u32, stats: &trellis_transport::quic::QuicStats) {
    use trellis_runtime::metrics::{Key, Metrics};
    if stats.refused_handshakes > 0 {
        Metrics::global().add(
            Key::new("refused_connections").with("node", node),
            stats.refused_handshakes,
        );
    }
}

pub(crate) fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}
pub use coord::ClusterJob;
pub use remote::RemotePart;
pub use worker::run_worker;
