//! Halo blocks of one partition: gathering the rows each neighbour needs into shared buffers,
//! assembling `[own rows; halo rows]` from received blocks, and adding received gradient rows
//! into the owner's rows (ARCHITECTURE.md, "Halo exchange").
use std::collections::BTreeMap;
use std::sync::Arc;
use trellis_gpu::{Stream, Tensor};
use trellis_runtime::{Result, RuntimeError};
use trellis_transport::{HaloBlock, MsgHeader, PartId, Phase, RunId};

/// A partition's row lists for the exchange, by neighbour (ascending part id).
#[derive(Debug, Clone)]
pub(crate) struct HaloLists {
    pub part: PartId,
    /// Local inner rows each other part holds as halo, ascending global id.
    pub send: Vec<(PartId, Vec<u32>)>,
    /// Local input rows (halo) each other part owns, ascending global id.
    pub recv: Vec<(PartId, Vec<u32>)>,
}

/// Where a message goes and what it holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tag {
    pub run: RunId,
    pub epoch: u32,
    pub layer: u16,
    pub phase: Phase,
}

impl HaloLists {
    /// The parts that own this partition's halo rows.
    pub fn owners(&self) -> Vec<PartId> {
        self.recv.iter().map(|(q, _)| *q).collect()
    }
    /// The parts that hold some of this partition's inner rows as halo.
    pub fn holders(&self) -> Vec<PartId> {
        self.send.iter().map(|(q, _)| *q).collect()
    }

    /// `[own rows; halo rows from the blocks]` as one tensor of `n_in` rows.
    pub fn assemble(
        &self,
        own: Tensor,
        n_in: usize,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> Result<Tensor> {
        let width = own.cols();
        // One allocation for [own rows; halo rows]; every halo row is overwritten below.
        let mut input = Tensor::zeros(n_in, width);
        input.as_mut_slice()[..own.len()].copy_from_slice(own.as_slice());
        drop(own);
        for (q, rows) in &self.recv {
            let b = blocks.get(q).ok_or_else(|| {
                proto(self.part, &format!("missing halo block from partition {q}"))
            })?;
            self.check(b, rows.len(), width)?;
            for (k, &r) in rows.iter().enumerate() {
                input
                    .row_mut(r as usize)
                    .copy_from_slice(&b.data[k * width..(k + 1) * width]);
            }
        }
        Ok(input)
    }

    /// Adds the received rows of gradients into this partition's inner rows of `g`, in
    /// ascending sender order (deterministic for a fixed partitioning).
    pub fn add_received(
        &self,
        s: &Stream,
        g: &mut Tensor,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> Result<()> {
        for (q, rows) in &self.send {
            if let Some(b) = blocks.get(q) {
                self.check(b, rows.len(), g.cols())?;
                s.scatter_add_slice(&b.data, rows, g)?;
            }
        }
        Ok(())
    }

    /// One block per destination in `lists` with the given rows of `t`.
    pub fn blocks(&self, tag: Tag, t: &Tensor, lists: &[(PartId, Vec<u32>)]) -> Vec<HaloBlock> {
        lists
            .iter()
            .map(|(q, rows)| HaloBlock {
                header: MsgHeader {
                    run: tag.run,
                    epoch: tag.epoch,
                    layer: tag.layer,
                    phase: tag.phase,
                    from: self.part,
                    to: *q,
                },
                trace: None,
                rows: rows.len() as u32,
                cols: t.cols() as u32,
                data: gather_shared(t, rows),
            })
            .collect()
    }

    /// Checks a received block's shape.
    fn check(&self, b: &HaloBlock, rows: usize, cols: usize) -> Result<()> {
        if b.rows as usize != rows || b.cols as usize != cols || b.data.len() != rows * cols {
            return Err(proto(
                self.part,
                &format!(
                    "halo block from partition {} is {}x{}, expected {rows}x{cols}",
                    b.header.from, b.rows, b.cols
                ),
            ));
        }
        Ok(())
    }
}

/// Rows `rows` of `t` gathered straight into a shared buffer (one allocation, one copy).
fn gather_shared(t: &Tensor, rows: &[u32]) -> Arc<[f32]> {
    let w = t.cols();
    let mut buf = Arc::<[f32]>::new_uninit_slice(rows.len() * w);
    let dst = Arc::get_mut(&mut buf).expect("a new Arc is unique");
    for (k, &r) in rows.iter().enumerate() {
        for (d, &v) in dst[k * w..(k + 1) * w].iter_mut().zip(t.row(r as usize)) {
            d.write(v);
        }
    }
    // SAFETY: the loop above wrote every element: `rows.len()` rows of `w` values each.
    unsafe { buf.assume_init() }
}

/// A protocol error of partition `part`.
pub(crate) fn proto(part: PartId, detail: &str) -> RuntimeError {
    RuntimeError::Config(format!("partition {part}: {detail}"))
}
