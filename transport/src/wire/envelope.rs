//! The rkyv-archived envelope and the decoded [`Frame`] it turns into once validated.
use super::header::WireError;
use crate::{HaloBlock, HaloPayload, MsgHeader, PartId, Phase, RunId, TraceContext};
use rkyv::{Archive, Deserialize, Serialize};

/// What travels in a frame's meta section, archived with rkyv.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum Envelope {
    /// First message of a connection, both ways: who I am, what I speak, and which
    /// process of that node I am (random per process: a restart is told from the process
    /// it replaces).
    Hello {
        node: u32,
        protocol: u16,
        incarnation: u64,
    },
    /// Liveness probe; answered with a [`Envelope::Pong`] carrying the same nonce.
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    /// Opaque bytes for the cluster layer (coordinator requests and replies).
    Control(Vec<u8>),
    /// A halo block's header; the frame's body follows: `rows * cols` little-endian f32, or,
    /// when `encoded`, a halo-codec payload (codec id and format version first; see
    /// [`crate::codec`]).
    Halo {
        run: [u8; 16],
        epoch: u32,
        layer: u16,
        phase: u8,
        from: u32,
        to: u32,
        rows: u32,
        cols: u32,
        /// The sending span's W3C trace context, if the sender traces.
        trace: Option<TraceParent>,
        /// The body is encoded by a halo codec (protocol version 3).
        encoded: bool,
    },
    /// The answer to a hello the node will not accept, saying why (protocol version 4). It
    /// travels on the hello stream, which QUIC delivers reliably, so the dialler learns the
    /// reason even when a `CONNECTION_CLOSE` frame would be lost or come too late.
    Refused {
        reason: String,
    },
    /// A leading piece of a control message larger than one frame; the pieces travel back
    /// to back on one stream, the last as a [`Envelope::Control`] (protocol version 5).
    ControlPiece(Vec<u8>),
}

/// A W3C `traceparent` on the wire: trace id, span id, trace flags.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl From<TraceContext> for TraceParent {
    fn from(t: TraceContext) -> Self {
        TraceParent {
            trace_id: t.trace_id,
            span_id: t.span_id,
            flags: t.flags,
        }
    }
}

/// A decoded, validated frame.
#[derive(Debug, Clone)]
pub enum Frame {
    Hello {
        node: u32,
        protocol: u16,
        incarnation: u64,
    },
    Ping(u64),
    Pong(u64),
    Control(Vec<u8>),
    /// The block's payload is the buffer the body was received into (an encoded one has
    /// been validated).
    Halo(HaloBlock),
    /// A refused hello and why (see [`Envelope::Refused`]).
    Refused(String),
    /// A leading piece of a control message (see [`Envelope::ControlPiece`]).
    ControlPiece(Vec<u8>),
}

pub(crate) fn phase_code(p: Phase) -> u8 {
    match p {
        Phase::Forward => 0,
        Phase::Backward => 1,
        Phase::Eval => 2,
    }
}

fn phase_from(code: u8) -> Result<Phase, WireError> {
    match code {
        0 => Ok(Phase::Forward),
        1 => Ok(Phase::Backward),
        2 => Ok(Phase::Eval),
        c => Err(WireError::Phase(c)),
    }
}

impl Envelope {
    /// The envelope announcing `block` (its body is sent separately).
    pub fn halo(block: &HaloBlock) -> Self {
        let h = &block.header;
        Envelope::Halo {
            run: *h.run.as_bytes(),
            epoch: h.epoch,
            layer: h.layer,
            phase: phase_code(h.phase),
            from: h.from.0,
            to: h.to.0,
            rows: block.rows,
            cols: block.cols,
            trace: block.trace.map(TraceParent::from),
            encoded: matches!(block.payload, HaloPayload::Encoded(_)),
        }
    }

    /// The envelope of a frame without body; `None` for a halo (see [`Envelope::halo`]).
    pub fn of(frame: &Frame) -> Self {
        match frame {
            Frame::Hello {
                node,
                protocol,
                incarnation,
            } => Envelope::Hello {
                node: *node,
                protocol: *protocol,
                incarnation: *incarnation,
            },
            Frame::Ping(n) => Envelope::Ping { nonce: *n },
            Frame::Pong(n) => Envelope::Pong { nonce: *n },
            Frame::Control(b) => Envelope::Control(b.clone()),
            Frame::ControlPiece(b) => Envelope::ControlPiece(b.clone()),
            Frame::Halo(b) => Envelope::halo(b),
            Frame::Refused(reason) => Envelope::Refused {
                reason: reason.clone(),
            },
        }
    }
}

/// Checks `meta` with bytecheck and returns the archived envelope.
pub(crate) fn access(meta: &[u8]) -> Result<&ArchivedEnvelope, WireError> {
    rkyv::access::<ArchivedEnvelope, rkyv::rancor::Error>(meta)
        .map_err(|e| WireError::Invalid(e.to_string()))
}

/// What a halo envelope announces: addressing, shape, trace context and body format.
pub(crate) struct HaloParts {
    pub header: MsgHeader,
    pub rows: u32,
    pub cols: u32,
    pub trace: Option<TraceContext>,
    pub encoded: bool,
}

/// A halo envelope's header, shape and trace context, checked. A trace context with an
/// all-zero id is ignored, as W3C Trace Context asks of an invalid `traceparent`.
pub(crate) fn halo_parts(env: &ArchivedEnvelope) -> Result<Option<HaloParts>, WireError> {
    let ArchivedEnvelope::Halo {
        run,
        epoch,
        layer,
        phase,
        from,
        to,
        rows,
        cols,
        trace,
        encoded,
    } = env
    else {
        return Ok(None);
    };
    let header = MsgHeader {
        run: RunId::from_bytes(*run),
        epoch: epoch.to_native(),
        layer: layer.to_native(),
        phase: phase_from(*phase)?,
        from: PartId(from.to_native()),
        to: PartId(to.to_native()),
    };
    let trace = trace
        .as_ref()
        .and_then(|t| TraceContext::new(t.trace_id, t.span_id, t.flags));
    Ok(Some(HaloParts {
        header,
        rows: rows.to_native(),
        cols: cols.to_native(),
        trace,
        encoded: *encoded,
    }))
}

/// A non-halo envelope as a frame.
pub(crate) fn small_frame(env: &ArchivedEnvelope) -> Frame {
    match env {
        ArchivedEnvelope::Hello {
            node,
            protocol,
            incarnation,
        } => Frame::Hello {
            node: node.to_native(),
            protocol: protocol.to_native(),
            incarnation: incarnation.to_native(),
        },
        ArchivedEnvelope::Ping { nonce } => Frame::Ping(nonce.to_native()),
        ArchivedEnvelope::Pong { nonce } => Frame::Pong(nonce.to_native()),
        ArchivedEnvelope::Control(b) => Frame::Control(b.as_slice().to_vec()),
        ArchivedEnvelope::ControlPiece(b) => Frame::ControlPiece(b.as_slice().to_vec()),
        ArchivedEnvelope::Refused { reason } => Frame::Refused(reason.as_str().to_string()),
        ArchivedEnvelope::Halo { .. } => unreachable!("halo envelopes carry a body"),
    }
}
