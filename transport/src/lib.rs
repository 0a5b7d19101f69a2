//! `trellis-transport` owns the messages partitions exchange and the transports that move them.
//!
//! Every data message carries a [`MsgHeader`] — (run, epoch, layer, phase, from, to) — so a
//! receiver can drop stale or misrouted messages and handle duplicates idempotently — and,
//! when the sender traces, a [`TraceContext`] so that the receive span joins the sender's trace. A
//! [`Transport`] moves [`HaloBlock`]s between partitions; [`InProcessTransport`] does so between
//! actors of one process without copying the block (the buffer is shared). The QUIC transport
//! between processes implements the same trait.

mod inproc;
mod message;
mod space;
mod trace;

pub use inproc::Deliver;
pub use inproc::InProcessTransport;
pub use message::{
    HaloBlock, HaloPayload, MsgHeader, PartId, Phase, RunId, SharedBuf, INCREMENT, TRANSFORMED,
};
pub use space::PartitionSpace;
pub use trace::TraceContext;

use thiserror::Error;

/// Errors of the transports.
#[derive(Debug, Error)]
pub enum TransportError {
    /// No route is registered for the destination partition.
    #[error("no route to partition {0}")]
    UnknownPartition(PartId),
    /// The destination exists but no longer accepts messages (it stopped).
    #[error("partition {0} is not accepting messages")]
    Closed(PartId),
    /// A remote node failed: unreachable, refused, timed out or gone. Names the peer.
    #[error("peer node {node}: {reason}")]
    Peer { node: u32, reason: String },
    /// This node's own endpoint failed (bind, TLS set-up, shut down): no peer to blame.
    #[error("local endpoint: {0}")]
    Local(String),
}

/// Moves halo blocks from one partition to another.
pub trait Transport: Send + Sync {
    /// Sends `block` to `block.header.to`. Returns once the transport owns the block.
    fn send(&self, block: HaloBlock) -> Result<(), TransportError>;
    /// Payload bytes sent through this transport so far.
    fn bytes_sent(&self) -> u64;
    /// Registers (or replaces, after a restart) the delivery function of local partition `part`.
    fn register(&self, part: PartId, deliver: Deliver);
    /// Removes local partition `part`: blocks for it are refused from now on.
    fn unregister(&self, part: PartId);
}

pub mod bench;
pub mod certs;
pub mod codec;
pub mod quic;
pub mod wire;
