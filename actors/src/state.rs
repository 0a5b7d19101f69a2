//! A partition's compute state and the per-layer steps of the epoch protocol, free of actors
//! and I/O: the actor feeds it requests and halo blocks and sends what it returns.
use crate::messages::Outcome;
use crate::replica::Snapshot;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use trellis_gpu::{Stream, Tensor};
use trellis_runtime::model::StepCtx;
use trellis_runtime::partition::{block, PartitionFile};
use trellis_runtime::train::{normalize_rows, TrainConfig};
use trellis_runtime::{Block, LayerInput, Model, Optimizer, Result, RuntimeError};
use trellis_transport::{HaloBlock, MsgHeader, PartId, Phase, RunId};

/// Totals over the whole graph that scale losses and accuracies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalCounts {
    pub train: usize,
    pub val: usize,
    pub test: usize,
}

/// One partition's data, model replica and optimizer state.
pub struct PartitionState {
    part: PartId,
    block: Block,
    x: LayerInput,
    labels: Vec<u32>,
    train: Vec<u32>,
    val: Vec<u32>,
    test: Vec<u32>,
    /// Local inner rows each other part needs, ascending part id.
    send: Vec<(PartId, Vec<u32>)>,
    /// Local input rows (halo) each other part owns, ascending part id, ascending global id.
    recv: Vec<(PartId, Vec<u32>)>,
    counts: GlobalCounts,
    model: Model,
    opt: Optimizer,
    stream: Stream,
    /// Output of the last forward layer (inner rows), input of the next.
    own_out: Option<Tensor>,
    /// Gradient of the inner rows of the next backward layer (local part).
    grad_inner: Option<Tensor>,
    /// Epochs completed (optimizer steps applied).
    epoch_done: u32,
}

impl std::fmt::Debug for PartitionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionState")
            .field("part", &self.part)
            .field("inner", &self.block.n_out())
            .field("halo", &(self.block.n_in() - self.block.n_out()))
            .finish()
    }
}

fn ids(mask: &[bool]) -> Vec<u32> {
    mask.iter()
        .enumerate()
        .filter(|(_, &m)| m)
        .map(|(i, _)| i as u32)
        .collect()
}

impl PartitionState {
    /// Builds the state of the partition stored in `file`.
    pub fn new(
        file: &PartitionFile,
        cfg: &TrainConfig,
        counts: GlobalCounts,
        stream: Stream,
    ) -> Result<Self> {
        let part = PartId(file.part() as u32);
        let block = block(file, cfg.model.kind.aggregation())?;
        let f = file.num_features();
        let mut feats = file.features().to_vec();
        if cfg.normalize_features {
            normalize_rows(&mut feats, f);
        }
        let x = LayerInput::auto(Tensor::from_vec(block.n_in(), f, feats)?)?;
        let send = file
            .send_lists()
            .map(|(q, rows)| (PartId(q as u32), rows.to_vec()))
            .collect();
        let mut by_owner: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let n_inner = block.n_out() as u32;
        for (k, &owner) in file.halo_owner().iter().enumerate() {
            by_owner.entry(owner).or_default().push(n_inner + k as u32);
        }
        let recv = by_owner
            .into_iter()
            .map(|(q, rows)| (PartId(q), rows))
            .collect();
        let model = Model::new(cfg.model.clone())?;
        let opt = Optimizer::new(cfg.optimizer(), &model);
        Ok(PartitionState {
            part,
            x,
            labels: file.labels().to_vec(),
            train: ids(file.train_mask()),
            val: ids(file.val_mask()),
            test: ids(file.test_mask()),
            block,
            send,
            recv,
            counts,
            model,
            opt,
            stream,
            own_out: None,
            grad_inner: None,
            epoch_done: 0,
        })
    }

    /// This partition's id.
    pub fn part(&self) -> PartId {
        self.part
    }
    /// Number of layers of the model.
    pub fn num_layers(&self) -> usize {
        self.model.num_layers()
    }
    /// Epochs completed.
    pub fn epoch_done(&self) -> u32 {
        self.epoch_done
    }
    /// The model replica.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The parts whose halo blocks a step needs before it can run.
    pub fn expected_senders(&self, phase: Phase, layer: u16) -> Vec<PartId> {
        let last = self.num_layers() as u16 - 1;
        match phase {
            Phase::Forward | Phase::Eval if layer > 0 => {
                self.recv.iter().map(|(q, _)| *q).collect()
            }
            Phase::Backward if layer < last => self.send.iter().map(|(q, _)| *q).collect(),
            _ => Vec::new(),
        }
    }

    /// Runs the forward of `layer` (training or evaluation). `blocks` holds, by sender, the
    /// halo rows of the previous layer's output. Returns the outcome and the blocks to send.
    pub fn forward(
        &mut self,
        run: RunId,
        epoch: u32,
        layer: u16,
        phase: Phase,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> Result<(Outcome, Vec<HaloBlock>)> {
        let l = layer as usize;
        let ctx = StepCtx {
            epoch,
            train: phase == Phase::Forward,
        };
        let y = if l == 0 {
            self.model
                .forward_layer(&self.stream, 0, &self.block, Cow::Borrowed(&self.x), ctx)?
        } else {
            let own = self
                .own_out
                .take()
                .ok_or_else(|| proto(self.part, "forward without the previous layer's output"))?;
            let input = self.assemble_halo(own, blocks)?;
            self.model.forward_layer(
                &self.stream,
                l,
                &self.block,
                Cow::Owned(LayerInput::Dense(input)),
                ctx,
            )?
        };
        if l + 1 < self.num_layers() {
            let out = self.blocks_from_rows(run, epoch, layer, phase, &y, &self.send)?;
            self.own_out = Some(y);
            return Ok((Outcome::LayerDone, out));
        }
        let s = &self.stream;
        if phase == Phase::Forward {
            let mut grad = Tensor::zeros(y.rows(), y.cols());
            let scale = 1.0 / self.counts.train.max(1) as f32;
            let loss = s.softmax_nll(&y, &self.labels, &self.train, scale, &mut grad)?;
            self.grad_inner = Some(grad);
            Ok((
                Outcome::Loss {
                    loss_sum: loss.loss_sum,
                    count: loss.count,
                    correct: loss.correct,
                },
                Vec::new(),
            ))
        } else {
            let train = s.accuracy_count(&y, &self.labels, &self.train)?;
            let val = s.accuracy_count(&y, &self.labels, &self.val)?;
            let test = s.accuracy_count(&y, &self.labels, &self.test)?;
            Ok((Outcome::Eval { train, val, test }, Vec::new()))
        }
    }

    /// Runs the backward of `layer`. `blocks` holds, by sender, gradients of this partition's
    /// inner rows that other parts computed (their halo), from the backward of `layer + 1`.
    pub fn backward(
        &mut self,
        run: RunId,
        epoch: u32,
        layer: u16,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> Result<(Outcome, Vec<HaloBlock>)> {
        let l = layer as usize;
        let mut g = self
            .grad_inner
            .take()
            .ok_or_else(|| proto(self.part, "backward without an output gradient"))?;
        // Received gradients are added in ascending sender order: deterministic for fixed P.
        for (q, rows) in &self.send {
            if let Some(b) = blocks.get(q) {
                check_block(b, rows.len(), g.cols(), self.part)?;
                self.stream.scatter_add_slice(&b.data, rows, &mut g)?;
            }
        }
        let gx = self
            .model
            .backward_layer(&self.stream, l, &self.block, g, l > 0)?;
        match gx {
            Some(mut gx) => {
                let out =
                    self.blocks_from_rows(run, epoch, layer, Phase::Backward, &gx, &self.recv)?;
                gx.truncate_rows(self.block.n_out());
                self.grad_inner = Some(gx);
                Ok((Outcome::LayerDone, out))
            }
            None => {
                let mut flat = Vec::with_capacity(self.model.num_parameters());
                for p in self.model.params() {
                    flat.extend_from_slice(p.grad.as_slice());
                }
                Ok((Outcome::Grads(Arc::from(flat)), Vec::new()))
            }
        }
    }

    /// Applies the all-reduced gradients and returns the new weights' digest.
    pub fn apply(&mut self, epoch: u32, grads: &[f32]) -> Result<String> {
        if grads.len() != self.model.num_parameters() {
            return Err(proto(
                self.part,
                &format!(
                    "{} gradients for {} parameters",
                    grads.len(),
                    self.model.num_parameters()
                ),
            ));
        }
        let mut off = 0;
        for p in self.model.params_mut() {
            let n = p.grad.len();
            p.grad.as_mut_slice().copy_from_slice(&grads[off..off + n]);
            off += n;
        }
        self.opt.step(&self.stream, &mut self.model)?;
        self.model.zero_grad();
        self.epoch_done = epoch;
        Ok(self.model.weights_digest())
    }

    /// Drops the caches of an epoch in progress.
    pub fn reset_epoch(&mut self) {
        self.own_out = None;
        self.grad_inner = None;
        self.model.clear_caches();
        self.model.zero_grad();
    }

    /// The dynamic state to replicate.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            epoch: self.epoch_done,
            params: self
                .model
                .params()
                .iter()
                .map(|p| p.value.clone())
                .collect(),
            opt_state: self.opt.state().to_vec(),
            opt_steps: self.opt.steps(),
            digest: self.model.weights_digest(),
        }
    }

    /// Restores the dynamic state; returns whether the restored weights match the digest
    /// recorded when the snapshot was taken.
    pub fn restore(&mut self, snap: &Snapshot) -> bool {
        for (p, v) in self.model.params_mut().iter_mut().zip(&snap.params) {
            p.value = v.clone();
        }
        self.opt.restore(snap.opt_steps, snap.opt_state.clone());
        self.epoch_done = snap.epoch;
        self.reset_epoch();
        self.model.weights_digest() == snap.digest
    }

    /// `[own rows; halo rows from the blocks]` as one input tensor.
    fn assemble_halo(&self, own: Tensor, blocks: &BTreeMap<PartId, HaloBlock>) -> Result<Tensor> {
        let width = own.cols();
        // One allocation for [own rows; halo rows]; every halo row is overwritten below.
        let mut input = Tensor::zeros(self.block.n_in(), width);
        input.as_mut_slice()[..own.len()].copy_from_slice(own.as_slice());
        drop(own);
        for (q, rows) in &self.recv {
            let b = blocks.get(q).ok_or_else(|| {
                proto(self.part, &format!("missing halo block from partition {q}"))
            })?;
            check_block(b, rows.len(), width, self.part)?;
            for (k, &r) in rows.iter().enumerate() {
                input
                    .row_mut(r as usize)
                    .copy_from_slice(&b.data[k * width..(k + 1) * width]);
            }
        }
        Ok(input)
    }

    /// One block per destination with the given rows of `t`.
    fn blocks_from_rows(
        &self,
        run: RunId,
        epoch: u32,
        layer: u16,
        phase: Phase,
        t: &Tensor,
        lists: &[(PartId, Vec<u32>)],
    ) -> Result<Vec<HaloBlock>> {
        lists
            .iter()
            .map(|(q, rows)| {
                let data = gather_shared(t, rows);
                let header = MsgHeader {
                    run,
                    epoch,
                    layer,
                    phase,
                    from: self.part,
                    to: *q,
                };
                Ok(HaloBlock {
                    header,
                    rows: rows.len() as u32,
                    cols: t.cols() as u32,
                    data,
                    trace: None,
                })
            })
            .collect()
    }
}

/// Checks a received block's shape.
fn check_block(b: &HaloBlock, rows: usize, cols: usize, me: PartId) -> Result<()> {
    if b.rows as usize != rows || b.cols as usize != cols || b.data.len() != rows * cols {
        return Err(proto(
            me,
            &format!(
                "halo block from partition {} is {}x{}, expected {rows}x{cols}",
                b.header.from, b.rows, b.cols
            ),
        ));
    }
    Ok(())
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

fn proto(part: PartId, detail: &str) -> RuntimeError {
    RuntimeError::Config(format!("partition {part}: {detail}"))
}

/// Times a closure in milliseconds.
pub(crate) fn timed<R>(f: impl FnOnce() -> R) -> (R, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64() * 1e3)
}
