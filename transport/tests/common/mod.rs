//! Helpers shared by the transport tests.
#![allow(dead_code)]
use std::sync::Arc;
use trellis_transport::{HaloBlock, MsgHeader, PartId, Phase, RunId, TraceContext};

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
        data,
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
