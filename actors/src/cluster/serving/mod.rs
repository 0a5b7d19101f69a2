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
