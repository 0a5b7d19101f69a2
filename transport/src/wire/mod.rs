//! The wire format of the QUIC transport, free of I/O.
//!
//! A frame is a fixed [`HEADER_LEN`]-byte header followed by an rkyv archive of an
//! [`Envelope`] (the *meta*) and, for halo blocks, the raw little-endian f32 rows (the *body*):
//!
//! ```text
//! magic "TRLS" | version u16 | kind u8 | flags u8 (0) | meta_len u32 | body_len u64 | meta | body
//! ```
//!
//! All integers are little-endian. [`FrameDecoder`] is a plain state machine — feed it bytes
//! with [`FrameDecoder::handle_bytes`], pull decoded [`Frame`]s with
//! [`FrameDecoder::poll_frame`] — so it is tested without sockets. It validates the header
//! (magic, version, kind, size limits) before allocating anything, checks the archive with
//! bytecheck before reading it, and streams a halo body straight into the block's final
//! buffer. [`RecvFilter`] then drops blocks for unknown partitions, runs or stale epochs.
//! A control message over the envelope limit travels in pieces ([`control_frames`],
//! [`ControlAssembly`]).

mod decoder;
mod encode;
mod envelope;
mod filter;
mod header;
mod pieces;

pub use decoder::FrameDecoder;
pub use encode::{encode_head, encode_to_vec, halo_body};
pub use envelope::{ArchivedEnvelope, Envelope, Frame, TraceParent};
pub use filter::{FilterStats, RecvFilter, Rejection};
pub use header::{FrameHeader, FrameKind, Limits, WireError, HEADER_LEN, MAGIC, PROTOCOL_VERSION};
pub use pieces::{control_frames, ControlAssembly};
