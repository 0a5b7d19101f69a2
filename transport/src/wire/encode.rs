//! Frame encoding. A halo body is never copied: [`halo_body`] wraps the block's shared buffer.
use super::envelope::{Envelope, Frame};
use super::header::{FrameHeader, FrameKind, HEADER_LEN};
use crate::HaloPayload;
use bytes::Bytes;

/// Header and envelope archive of a frame whose body (if any) has `body_len` bytes.
pub fn encode_head(env: &Envelope, body_len: u64) -> Vec<u8> {
    let meta =
        rkyv::to_bytes::<rkyv::rancor::Error>(env).expect("archiving an envelope cannot fail");
    let kind = if matches!(env, Envelope::Halo { .. }) {
        FrameKind::Halo
    } else {
        FrameKind::Message
    };
    let header = FrameHeader {
        kind,
        meta_len: meta.len() as u32,
        body_len,
    };
    let mut out = Vec::with_capacity(HEADER_LEN + meta.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&meta);
    out
}

/// A whole frame in one buffer (tests, small messages).
pub fn encode_to_vec(frame: &Frame) -> Vec<u8> {
    match frame {
        Frame::Halo(b) => {
            let mut out = encode_head(&Envelope::halo(b), b.payload_bytes());
            out.extend_from_slice(&halo_body(&b.payload));
            out
        }
        f => encode_head(&Envelope::of(f), 0),
    }
}

/// The body of a halo frame: the payload's bytes, shared, not copied (f32 rows: on
/// little-endian hosts).
pub fn halo_body(payload: &HaloPayload) -> Bytes {
    let data = match payload {
        HaloPayload::Encoded(bytes) => return Bytes::from_owner(bytes.clone()),
        HaloPayload::F32(data) => data,
    };
    if cfg!(target_endian = "little") {
        Bytes::from_owner(F32Bytes(data.clone()))
    } else {
        Bytes::from(
            data.iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }
}

/// Views a shared f32 buffer as bytes.
struct F32Bytes(crate::SharedBuf);

impl AsRef<[u8]> for F32Bytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: f32 has no padding and u8 has alignment 1; the length covers exactly the
        // slice's bytes, which live as long as `self.0`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 4) }
    }
}
