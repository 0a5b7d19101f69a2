//! Helpers shared by the transport tests.
#![allow(dead_code)]
use std::sync::Arc;
use trellis_transport::{HaloBlock, HaloPayload, MsgHeader, PartId, Phase, RunId, TraceContext};

pub fn run_id() -> RunId {
    RunId::from_bytes([7; 16])
}

pub fn header(from: u32, to: u32, epoch: u32) -> MsgHeader {
    MsgHeader {
        run: run_id(),
        epoch,
        layer: 1,
        phase: Phase::Backward,
        from: PartId(from),
        to: PartId(to),
    }
}

pub fn block(from: u32, to: u32, epoch: u32, rows: u32, cols: u32) -> HaloBlock {
    let data: Arc<[f32]> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
    HaloBlock {
        header: header(from, to, epoch),
        rows,
        cols,
        payload: HaloPayload::F32(data),
        trace: None,
    }
}

/// A sampled trace context with recognisable ids.
pub fn trace() -> TraceContext {
    TraceContext::new([0xab; 16], [0x5c; 8], 1).unwrap()
}

/// `block(...)` carrying [`trace`].
pub fn traced_block(from: u32, to: u32, epoch: u32, rows: u32, cols: u32) -> HaloBlock {
    HaloBlock {
        trace: Some(trace()),
        ..block(from, to, epoch, rows, cols)
    }
}

/// The f32 rows of an exact block (the tests' blocks are never encoded).
pub fn f32s(b: &HaloBlock) -> &Arc<[f32]> {
    match &b.payload {
        HaloPayload::F32(d) => d,
        HaloPayload::Encoded(_) => panic!("block {:?} is encoded", b.header),
    }
}

/// Rounding bits for test encodings: a fixed hash of (row, column).
pub struct Hashed;

impl trellis_transport::codec::Dither for Hashed {
    fn fill(&self, row: usize, out: &mut [u32]) {
        for (c, o) in out.iter_mut().enumerate() {
            *o = ((row as u32) << 16 ^ c as u32)
                .wrapping_mul(0x9E37_79B9)
                .rotate_left(13);
        }
    }
}

/// `block(...)` with its rows encoded by `codec`.
pub fn encoded_block(
    codec: trellis_transport::codec::Codec,
    from: u32,
    to: u32,
    rows: u32,
    cols: u32,
) -> HaloBlock {
    let b = block(from, to, 3, rows, cols);
    let bytes =
        trellis_transport::codec::encode(codec, rows as usize, cols as usize, f32s(&b), &Hashed)
            .expect("finite rows encode");
    HaloBlock {
        payload: HaloPayload::Encoded(Arc::from(bytes)),
        ..b
    }
}

/// A block of `rows x cols` whose payload is sparse: rows `index` of [`block`]'s values,
/// int8-encoded.
pub fn sparse_block(from: u32, to: u32, rows: u32, cols: u32, index: &[u32]) -> HaloBlock {
    use trellis_transport::codec::{self, Codec, SparseInner};
    let b = block(from, to, 3, rows, cols);
    let c = cols as usize;
    let picked: Vec<f32> = index
        .iter()
        .flat_map(|&r| f32s(&b)[r as usize * c..(r as usize + 1) * c].to_vec())
        .collect();
    let inner = codec::encode(Codec::Int8, index.len(), c, &picked, &Hashed).expect("finite");
    let bytes = codec::encode_sparse(rows as usize, index, SparseInner::Encoded(&inner))
        .expect("ascending rows");
    HaloBlock {
        payload: HaloPayload::Encoded(Arc::from(bytes)),
        ..b
    }
}
