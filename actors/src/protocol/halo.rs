//! Halo blocks of one partition: gathering the rows each neighbour needs into shared buffers
//! (encoded by the run's halo codec, `protocol::codec`), assembling `[own rows; halo rows]`
//! from received blocks (decoded), and adding received gradient rows into the owner's rows
//! (ARCHITECTURE.md, "Halo exchange").
use crate::protocol::codec::HaloEncoder;
use crate::protocol::skip::SkipSender;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use trellis_gpu::halo::HaloStaging;
use trellis_gpu::{Device, Stream, Tensor};
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
    /// `recv` numbered from the first halo row (rows of a halo-rows-only tensor).
    pub recv_halo: Vec<(PartId, Vec<u32>)>,
    /// Global node ids of the rows of `send` and of `recv`, by part (the codec's rounding is
    /// keyed by them).
    pub send_gids: BTreeMap<PartId, Vec<u32>>,
    pub recv_gids: BTreeMap<PartId, Vec<u32>>,
    /// The codec of every block this partition sends.
    pub encoder: HaloEncoder,
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

    /// `[own rows; halo rows from the blocks]` as one tensor of `n_in` rows in `s`'s memory:
    /// the halo rows are placed in one host buffer, then appended below `own` (on a GPU they
    /// are copied in through a pinned buffer and the compute stream waits for their arrival).
    pub fn assemble(
        &self,
        s: &Stream,
        mut own: Tensor,
        n_in: usize,
        blocks: &BTreeMap<PartId, HaloBlock>,
        staging: &mut Staging,
    ) -> Result<Tensor> {
        let (first, width) = (own.rows(), own.cols());
        let halo = self.halo_rows(first, n_in, width, blocks)?;
        if own.device() == Device::Cpu {
            s.append_rows(&mut own, &halo)?;
        } else {
            let staging = staging.get(self.part, n_in - first, width);
            let halo = s.arrived(s.rows_from_host(halo, n_in - first, width, staging)?)?;
            s.concat_rows(&mut own, &halo)?;
        }
        Ok(own)
    }

    /// The halo rows `first..n_in` (`width` wide, in row order) from the blocks, in one host
    /// buffer.
    pub fn halo_rows(
        &self,
        first: usize,
        n_in: usize,
        width: usize,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> Result<Vec<f32>> {
        if n_in < first {
            return Err(proto(
                self.part,
                &format!("{first} own rows for {n_in} inputs"),
            ));
        }
        // Every halo row is overwritten below: the receive lists cover `first..n_in`.
        let mut halo = vec![0.0; (n_in - first) * width];
        for (q, rows) in &self.recv {
            let b = blocks.get(q).ok_or_else(|| {
                proto(self.part, &format!("missing halo block from partition {q}"))
            })?;
            // Decoded straight into the rows' places (no buffer per block).
            self.check_shape(b, rows.len(), width)?;
            let place = |k: usize| (rows[k] as usize).wrapping_sub(first);
            b.values_into(&mut halo, &place).map_err(|e| {
                let from = b.header.from;
                proto(self.part, &format!("halo block from partition {from}: {e}"))
            })?;
        }
        Ok(halo)
    }

    /// Adds the received rows of gradients into this partition's inner rows of `g`, in
    /// ascending sender order (deterministic for a fixed partitioning).
    pub fn add_received(
        &self,
        s: &Stream,
        g: &mut Tensor,
        blocks: &BTreeMap<PartId, HaloBlock>,
        staging: &mut Staging,
    ) -> Result<()> {
        let w = g.cols();
        for (q, rows) in &self.send {
            if let Some(b) = blocks.get(q) {
                let data = self.values(b, rows.len(), w)?;
                if g.device() == Device::Cpu {
                    s.scatter_add_slice(&data, rows, g)?;
                } else {
                    // Through a pinned buffer; the scatter waits for the rows' arrival.
                    let staging = staging.get(*q, rows.len(), w);
                    let received = s.rows_from_host(data.into_owned(), rows.len(), w, staging)?;
                    s.scatter_add_rows(&s.arrived(received)?, rows, g)?;
                }
            }
        }
        Ok(())
    }

    /// One block per destination in `lists` with the given rows of `t` (in `s`'s memory):
    /// gathered straight into shared buffers on the CPU; on a GPU every copy is started (pinned
    /// buffers, transfer stream) before the first is waited for.
    pub fn blocks(
        &self,
        s: &Stream,
        tag: Tag,
        t: &Tensor,
        lists: &[(PartId, Vec<u32>)],
        staging: &mut Staging,
        skip: &mut SkipSender,
    ) -> Result<Vec<HaloBlock>> {
        if t.device() != Device::Cpu {
            self.start_blocks(s, t, lists, staging)?;
            return self.finish_blocks(s, tag, t.cols(), lists, staging, skip);
        }
        lists
            .iter()
            .map(|(q, rows)| {
                let data = gather_shared(t, rows)?;
                self.block(tag, *q, rows.len(), t.cols(), data, skip)
            })
            .collect()
    }

    /// Starts copying the rows of `t` each destination in `lists` needs to the host
    /// ([`HaloLists::finish_blocks`] waits for them).
    pub fn start_blocks(
        &self,
        s: &Stream,
        t: &Tensor,
        lists: &[(PartId, Vec<u32>)],
        staging: &mut Staging,
    ) -> Result<()> {
        for (q, rows) in lists {
            s.start_rows_to_host(t, rows, staging.get(*q, rows.len(), t.cols()))?;
        }
        Ok(())
    }

    /// The blocks of `cols`-wide rows [`HaloLists::start_blocks`] started, once their copies
    /// have completed.
    pub fn finish_blocks(
        &self,
        s: &Stream,
        tag: Tag,
        cols: usize,
        lists: &[(PartId, Vec<u32>)],
        staging: &mut Staging,
        skip: &mut SkipSender,
    ) -> Result<Vec<HaloBlock>> {
        lists
            .iter()
            .map(|(q, rows)| {
                let data = s.finish_rows_to_host(staging.get(*q, rows.len(), cols))?;
                self.block(tag, *q, rows.len(), cols, data, skip)
            })
            .collect()
    }

    /// The block of `rows x cols` values `data` from this partition to `to`, encoded by the
    /// run's codec (only the rows that changed when `skip` is on): forward (and evaluation)
    /// rows are this partition's send list to `to`, backward rows its halo rows owned by `to`.
    pub fn block(
        &self,
        tag: Tag,
        to: PartId,
        rows: usize,
        cols: usize,
        data: Arc<[f32]>,
        skip: &mut SkipSender,
    ) -> Result<HaloBlock> {
        let gids = match tag.phase {
            Phase::Backward => self.recv_gids.get(&to),
            Phase::Forward | Phase::Eval => self.send_gids.get(&to),
        }
        .filter(|g| g.len() == rows)
        .ok_or_else(|| proto(self.part, &format!("no {rows}-row list for partition {to}")))?;
        let payload = skip.payload(&self.encoder, self.part, tag, to, gids, cols, data)?;
        Ok(HaloBlock {
            header: MsgHeader {
                run: tag.run,
                epoch: tag.epoch,
                layer: tag.layer,
                phase: tag.phase,
                from: self.part,
                to,
            },
            trace: None,
            rows: rows as u32,
            cols: cols as u32,
            payload,
        })
    }

    /// Checks that a received block is `rows x cols`.
    fn check_shape(&self, b: &HaloBlock, rows: usize, cols: usize) -> Result<()> {
        if b.rows as usize != rows || b.cols as usize != cols {
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

    /// A received block's rows (decoded when encoded), checked to be `rows x cols`.
    fn values<'b>(&self, b: &'b HaloBlock, rows: usize, cols: usize) -> Result<Cow<'b, [f32]>> {
        let from = b.header.from;
        self.check_shape(b, rows, cols)?;
        let data = b
            .values()
            .map_err(|e| proto(self.part, &format!("halo block from partition {from}: {e}")))?;
        if data.len() != rows * cols {
            return Err(proto(
                self.part,
                &format!(
                    "halo block from partition {from} holds {} values, expected {rows}x{cols}",
                    data.len()
                ),
            ));
        }
        Ok(data)
    }
}

/// Host buffers of halo rows, one per (neighbour, rows, columns): pinned on a GPU and reused
/// every step (the shapes repeat), empty on the CPU.
#[derive(Debug, Default)]
pub(crate) struct Staging(BTreeMap<(PartId, usize, usize), HaloStaging>);

impl Staging {
    pub(crate) fn get(&mut self, peer: PartId, rows: usize, cols: usize) -> &mut HaloStaging {
        self.0.entry((peer, rows, cols)).or_default()
    }
}

/// Rows `rows` of the host tensor `t` gathered straight into a shared buffer (one allocation,
/// one copy).
fn gather_shared(t: &Tensor, rows: &[u32]) -> Result<Arc<[f32]>> {
    let w = t.cols();
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= t.rows()) {
        return Err(RuntimeError::Config(format!(
            "halo row {r} of a {}-row tensor",
            t.rows()
        )));
    }
    let mut buf = Arc::<[f32]>::new_uninit_slice(rows.len() * w);
    let dst = Arc::get_mut(&mut buf).expect("a new Arc is unique");
    for (k, &r) in rows.iter().enumerate() {
        for (d, &v) in dst[k * w..(k + 1) * w].iter_mut().zip(t.row(r as usize)) {
            d.write(v);
        }
    }
    // SAFETY: the loop above wrote every element: `rows.len()` rows of `w` values each.
    Ok(unsafe { buf.assume_init() })
}

/// A protocol error of partition `part`.
pub(crate) fn proto(part: PartId, detail: &str) -> RuntimeError {
    RuntimeError::Config(format!("partition {part}: {detail}"))
}
