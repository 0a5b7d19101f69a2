//! The QUIC transport between nodes: quinn 0.11 over rustls 0.23 (ring), mutual TLS against
//! the cluster CA, frames of [`crate::wire`].
//!
//! * [`QuicNode`] owns the UDP endpoint and one connection per peer node. A connection starts
//!   with a `Hello` exchange on a bidirectional stream: the dialled node checks the protocol
//!   version and that the dialler's certificate (already verified against the cluster CA by
//!   rustls) is valid for `node-N.trellis`, the node id it claims. Peers without a certificate
//!   or with one from another CA fail the TLS handshake; they are refused, counted and logged.
//! * Every halo block travels on its own unidirectional stream (a few in flight per peer);
//!   control messages share one ordered stream per connection. The receiver reads a frame's
//!   header, reserves the block's bytes from the peer's receive budget, checks the block's
//!   addressing ([`crate::wire::RecvFilter`]) before its body arrives — a rejected block's
//!   stream is stopped, the sender is told with an error code — and streams the body into the
//!   block's final buffer. Bad frames stop their stream only; the connection keeps serving.
//! * Every wait has a deadline: connect, each send, each frame being received, flush. A peer
//!   that stops answering is detected by the idle timeout (keep-alives keep healthy idle
//!   connections open); the error names the node and its address, is returned by later sends
//!   and is broadcast on [`QuicTransport::failures`].
//! * [`QuicTransport`] implements [`crate::Transport`] over a node: it routes each block to the
//!   node hosting its destination partition, or delivers it locally without copying.

mod chaos;
mod config;
mod conn;
mod error;
mod node;
mod recv;
mod send;
pub mod tls;
mod transport;

pub use config::QuicConfig;
pub use conn::REFUSED_PREFIX;
pub use error::{QuicError, StopCode};
pub use node::{Inbound, NodeId, QuicNode, QuicStats, ReturnPolicy};
pub use transport::{ControlRx, FencedSink, QuicTransport, RefusalSink};
