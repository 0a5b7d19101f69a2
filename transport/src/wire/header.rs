//! The fixed frame header, size limits and wire errors.
use thiserror::Error;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"TRLS";
/// The protocol version this build speaks; frames of any other version are refused.
/// Version 2 added the trace context of halo envelopes, version 3 encoded halo bodies
/// (halo codecs), version 4 sparse-row halo bodies (`--skip-threshold`: only changed rows)
/// and the `Refused` answer to a hello, version 5 control messages in pieces
/// (`ControlPiece`), version 6 the hello's process incarnation.
pub const PROTOCOL_VERSION: u16 = 6;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 20;

/// What follows the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// An envelope alone (hello, ping, control...).
    Message = 1,
    /// A halo envelope followed by its body (f32 rows or a halo-codec payload).
    Halo = 2,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub meta_len: u32,
    pub body_len: u64,
}

/// Bounds on what a decoder accepts; checked against the header before any allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest envelope archive (control messages included).
    pub max_meta: u32,
    /// Largest halo body in bytes.
    pub max_body: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_meta: 16 << 20,
            max_body: 1 << 30,
        }
    }
}

/// Why bytes on the wire were refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("bad magic {0:02x?} (not a Trellis frame)")]
    BadMagic([u8; 4]),
    #[error("protocol version {got} is not supported (this node speaks {PROTOCOL_VERSION})")]
    Version { got: u16 },
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("reserved flags {0:#04x} set")]
    Flags(u8),
    #[error("envelope of {len} bytes exceeds the limit of {max}")]
    MetaTooLarge { len: u32, max: u32 },
    #[error("control message of {len} bytes exceeds the limit of {max}")]
    MessageTooLarge { len: u64, max: u64 },
    #[error("halo body of {len} bytes exceeds the limit of {max}")]
    BodyTooLarge { len: u64, max: u64 },
    #[error("frame kind {kind:?} with a body of {body_len} bytes is malformed")]
    BodyShape { kind: FrameKind, body_len: u64 },
    #[error("invalid envelope: {0}")]
    Invalid(String),
    #[error("halo of {rows}x{cols} f32 does not match a body of {body_len} bytes")]
    BodyMismatch { rows: u32, cols: u32, body_len: u64 },
    #[error("unknown phase {0}")]
    Phase(u8),
    #[error("halo block from partition {from} to {to}: {source}")]
    Codec {
        from: u32,
        to: u32,
        source: crate::codec::CodecError,
    },
    #[error("stream ended inside a frame ({section}: {have} of {need} bytes)")]
    Truncated {
        section: &'static str,
        have: u64,
        need: u64,
    },
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6] = self.kind as u8;
        b[7] = 0;
        b[8..12].copy_from_slice(&self.meta_len.to_le_bytes());
        b[12..20].copy_from_slice(&self.body_len.to_le_bytes());
        b
    }

    /// Parses and checks a header against `limits`.
    pub fn parse(b: &[u8; HEADER_LEN], limits: &Limits) -> Result<Self, WireError> {
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != PROTOCOL_VERSION {
            return Err(WireError::Version { got: version });
        }
        let kind = match b[6] {
            1 => FrameKind::Message,
            2 => FrameKind::Halo,
            k => return Err(WireError::Kind(k)),
        };
        if b[7] != 0 {
            return Err(WireError::Flags(b[7]));
        }
        let meta_len = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        let body_len = u64::from_le_bytes(b[12..20].try_into().expect("8 bytes"));
        if meta_len > limits.max_meta {
            return Err(WireError::MetaTooLarge {
                len: meta_len,
                max: limits.max_meta,
            });
        }
        if body_len > limits.max_body {
            return Err(WireError::BodyTooLarge {
                len: body_len,
                max: limits.max_body,
            });
        }
        let shape_ok = match kind {
            FrameKind::Message => body_len == 0,
            // f32 bodies are checked against their envelope's shape; encoded ones have any length.
            FrameKind::Halo => true,
        };
        if !shape_ok || meta_len == 0 {
            return Err(WireError::BodyShape { kind, body_len });
        }
        Ok(FrameHeader {
            kind,
            meta_len,
            body_len,
        })
    }
}
