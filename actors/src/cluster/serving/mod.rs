//! Serving on a cluster (`trellis serve --cluster FILE`): the engine node (the cluster
//! file's coordinator) runs the serving engine; the other nodes host serving partitions.
//!
//! * [`proto`]: the serving messages (versioned rkyv inside the control protocol), free of I/O.
//! * [`engine_side`]: the engine node's start-up (joins, setups, inputs) and its handle on
//!   the remote partitions ([`remote`]).
//! * [`node`]: a node hosting serving partitions, and taking over as the engine node when
//!   it is lost ([`succession`]: which node does).
pub mod engine_side;
pub mod node;
pub mod proto;
pub mod remote;
pub mod succession;

pub use engine_side::ClusterServing;
pub use node::HttpUplink;
pub use remote::{ForwardSlot, HttpForward, RemoteServePart, ServeLink};

use std::sync::Arc;
use trellis_transport::quic::QuicTransport;
use trellis_transport::{PartitionSpace, Transport};

/// Where serving partition `p` is on a cluster's QUIC transport: `SERVING_PART_BASE + p`.
/// A node serving beside its training hosts training partition `p` and serving partition
/// `p` on one transport; their halo blocks never meet (training partitions keep `0..P`).
pub const SERVING_PART_BASE: u32 = 1 << 24;

/// The serving partitions' view of the cluster's transport `t` (see [`SERVING_PART_BASE`]).
pub fn serving_space(t: &Arc<QuicTransport>) -> Arc<dyn Transport> {
    Arc::new(PartitionSpace::new(
        t.clone() as Arc<dyn Transport>,
        SERVING_PART_BASE,
    ))
}

/// Queues serving message `msg` for `node` on `t`; a failure names the node.
pub(crate) fn tell(
    t: &QuicTransport,
    node: u32,
    msg: &proto::ServeMsg,
) -> Result<(), crate::ActorError> {
    crate::cluster::node::send_control(t, node, &msg.control())
}

/// Sends `join` (a `Join`) to each of `nodes`, dialling again those not connected; a node
/// not up (or that cannot be dialled) is left to the next round of the caller.
pub(crate) fn join_each(t: &QuicTransport, nodes: &[u32], join: &proto::ServeMsg) {
    let connected = t.node().connected_peers();
    for &n in nodes {
        if !connected.contains(&n) {
            t.node().reset_peer(n);
        }
        let _ = tell(t, n, join);
    }
}

/// Routes the serving partitions of `placement` that other nodes than `me` serve.
pub fn route_serving(t: &QuicTransport, placement: &[u32], me: u32) {
    crate::cluster::node::route_from(t, placement, me, SERVING_PART_BASE);
}
