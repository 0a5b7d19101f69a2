//! Helpers shared by the transport tests.
#![allow(dead_code)]
use std::sync::Arc;
use trellis_transport::{HaloBlock, MsgHeader, PartId, Phase, RunId};

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
    }
}
