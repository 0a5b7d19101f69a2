//! A partition's compute state and the per-layer steps of the epoch protocol, free of actors
//! and I/O: the actor feeds it requests and halo blocks and sends what it returns.
//!
//! A step of a split layer (see `trellis_runtime::model` split layers) runs in two stages: the
//! first sends the layer's transformed rows (forward) or their gradients (backward), the
//! second runs once the neighbours' blocks of those are in. Between the stages the state
//! holds a `Staged` record; [`PartitionState::reset_epoch`] forgets it.
use crate::protocol::codec::{merged_payload, HaloEncoder};
use crate::protocol::halo::{proto, HaloLists, Staging, Tag};
use crate::protocol::messages::Outcome;
use crate::protocol::skip::{self, SkipSender};
use crate::replica::{PendingResidual, Snapshot};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use trellis_gpu::{CancelToken, Stream, Tensor};
use trellis_runtime::grad_codec::{ErrorFeedback, GradCodec, RoundingKey};
use trellis_runtime::model::StepCtx;
use trellis_runtime::partition::{block, PartitionFile};
use trellis_runtime::train::{normalize_rows, TrainConfig};
use trellis_runtime::{Block, LayerInput, Model, Optimizer, Result};
use trellis_transport::codec;
use trellis_transport::{HaloBlock, HaloPayload, PartId, Phase, RunId, TRANSFORMED};

/// Halo blocks by (phase, layer tag) then sender: the training blocks of one epoch.
pub type EpochBlocks = BTreeMap<(Phase, u16), BTreeMap<PartId, HaloBlock>>;

/// What a stage returns: the step's outcome (`None` after the first stage of a split layer)
/// and the blocks to send.
pub type StageOut = Result<(Option<Outcome>, Vec<HaloBlock>)>;

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
    /// Rows exchanged with each neighbour.
    halo: HaloLists,
    counts: GlobalCounts,
    model: Model,
    opt: Optimizer,
    stream: Stream,
    /// Output of the last forward layer (inner rows), input of the next.
    own_out: Option<Tensor>,
    /// Gradient of the inner rows of the next backward layer (local part).
    grad_inner: Option<Tensor>,
    /// A split layer's step between its two stages.
    staged: Option<Staged>,
    /// Epochs completed (optimizer steps applied).
    epoch_done: u32,
    /// Split layers start their inner aggregation before the halo rows arrive
    /// ([`TrainConfig::overlaps_halo`]).
    overlap: bool,
    /// Host buffers of the exchange, per peer and shape, for the rows sent and the rows
    /// received (pinned on a GPU, reused every step).
    send_staging: Staging,
    recv_staging: Staging,
    /// Gradient compression of the all-reduce and its error feedback.
    grads: GradCompression,
    /// Epochs old the halo rows of a training step are ([`HaloConfig::staleness`]: 0 or 1).
    ///
    /// [`HaloConfig::staleness`]: trellis_runtime::comm::HaloConfig::staleness
    staleness: u32,
    /// With staleness 1 or skipping: the training blocks received in epoch `epoch_done`
    /// (sparse ones merged into the rows held before), which the training pass of epoch
    /// `epoch_done + 1` uses (stale) or merges its sparse blocks into (skipping); empty before
    /// the first step. Part of the replicated snapshot: no other partition holds them.
    held: EpochBlocks,
    /// Whether `held` keeps training blocks ([`HaloConfig::holds_rows`]).
    ///
    /// [`HaloConfig::holds_rows`]: trellis_runtime::comm::HaloConfig::holds_rows
    holds: bool,
    /// Whether `held` keeps evaluation blocks ([`HaloConfig::skips_eval_rows`]): those an
    /// epoch's evaluation received, held by the next optimizer step for the next evaluation.
    ///
    /// [`HaloConfig::skips_eval_rows`]: trellis_runtime::comm::HaloConfig::skips_eval_rows
    holds_eval: bool,
    /// Skipping rows that barely changed: what each receiver holds.
    skip: SkipSender,
}

/// A partition's gradient compression: the codec, the error-feedback residual committed
/// with the last applied step, and the one computed by the step in progress (it becomes the
/// committed one when that step is applied, so a replayed step starts from the same residual).
#[derive(Debug, Default)]
struct GradCompression {
    codec: GradCodec,
    seed: u64,
    committed: ErrorFeedback,
    pending: Option<(u32, ErrorFeedback)>,
}

impl GradCompression {
    /// The outcome carrying this step's gradients `flat` of `epoch`: exact, or compressed
    /// from `flat` plus the committed residual.
    fn outcome(&mut self, part: PartId, epoch: u32, flat: Vec<f32>) -> Outcome {
        let mut ef = self.committed.clone();
        let key = RoundingKey {
            seed: self.seed,
            epoch,
            partition: part.0,
        };
        match ef.compress(self.codec, &flat, key) {
            None => Outcome::Grads(Arc::from(flat)),
            Some(payload) => {
                self.pending = Some((epoch, ef));
                Outcome::CompressedGrads(Arc::new(payload))
            }
        }
    }

    /// The residual `epoch`'s compressed gradients left, before the optimizer step commits it.
    fn pending(&self, epoch: u32) -> Option<&[f32]> {
        match &self.pending {
            Some((e, ef)) if *e == epoch => Some(ef.residual()),
            _ => None,
        }
    }

    /// Whether the residual of `epoch`'s compressed gradients is at hand (always, exact).
    fn ready_to_apply(&self, epoch: u32) -> bool {
        self.codec.is_none() || matches!(self.pending, Some((e, _)) if e == epoch)
    }

    /// The step of `epoch` was applied: its residual is now the committed one. (A pending
    /// residual survives an epoch reset: a replayed backward recomputes the same one.)
    fn commit(&mut self, epoch: u32) {
        if let Some((e, ef)) = self.pending.take() {
            if e == epoch {
                self.committed = ef;
            }
        }
    }
}

/// Which stage of its step a request is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The step's only stage, or the first of a split layer.
    First,
    /// The second stage of a split layer (its first ran).
    Second,
}

/// A split layer's step whose first stage ran.
struct Staged {
    epoch: u32,
    phase: Phase,
    layer: u16,
    /// Forward: the transformed inner rows `Z` (overlapped: the aggregation over them,
    /// `Â_inner Z_inner`, already under way). Backward: this partition's part of `gZ` for its
    /// inner rows.
    rows: Tensor,
}

impl Staged {
    /// The rows a split layer's first stage keeps for its second, under the step's tag.
    fn of(tag: Tag, rows: Tensor) -> Self {
        Staged {
            epoch: tag.epoch,
            phase: tag.phase,
            layer: tag.layer,
            rows,
        }
    }
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
        cfg.halo.validate()?;
        let block = block(file, cfg.model.kind.aggregation())?;
        let f = file.num_features();
        let mut feats = file.features().to_vec();
        if cfg.normalize_features {
            normalize_rows(&mut feats, f);
        }
        let x = LayerInput::auto(&stream, Tensor::from_vec(block.n_in(), f, feats)?)?;
        let send: Vec<_> = file
            .send_lists()
            .map(|(q, rows)| (PartId(q as u32), rows.to_vec()))
            .collect();
        let mut by_owner: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let n_inner = block.n_out() as u32;
        for (k, &owner) in file.halo_owner().iter().enumerate() {
            by_owner.entry(owner).or_default().push(n_inner + k as u32);
        }
        let recv: Vec<_> = by_owner
            .into_iter()
            .map(|(q, rows)| (PartId(q), rows))
            .collect();
        let recv_halo = recv
            .iter()
            .map(|(q, rows)| (*q, rows.iter().map(|r| r - n_inner).collect()))
            .collect();
        let gids = block.gids();
        let global = |lists: &[(PartId, Vec<u32>)]| {
            lists
                .iter()
                .map(|(q, rows)| (*q, rows.iter().map(|&r| gids[r as usize]).collect()))
                .collect()
        };
        let (send_gids, recv_gids) = (global(&send), global(&recv));
        let mut model = Model::new(cfg.model.clone())?;
        model.place(&stream)?;
        let opt = Optimizer::new(cfg.optimizer(), &model);
        Ok(PartitionState {
            part,
            x,
            labels: file.labels().to_vec(),
            train: ids(file.train_mask()),
            val: ids(file.val_mask()),
            test: ids(file.test_mask()),
            block,
            halo: HaloLists {
                part,
                send,
                recv,
                recv_halo,
                send_gids,
                recv_gids,
                encoder: HaloEncoder::new(&cfg.halo, cfg.model.seed),
            },
            counts,
            model,
            opt,
            stream,
            own_out: None,
            grad_inner: None,
            staged: None,
            epoch_done: 0,
            overlap: cfg.overlaps_halo(),
            send_staging: Staging::default(),
            recv_staging: Staging::default(),
            grads: GradCompression {
                codec: cfg.grad_codec,
                seed: cfg.model.seed,
                ..GradCompression::default()
            },
            staleness: cfg.halo.staleness,
            held: EpochBlocks::new(),
            holds: cfg.halo.holds_rows(),
            holds_eval: cfg.halo.skips_eval_rows(),
            skip: SkipSender::new(&cfg.halo),
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
    /// Makes the stages' kernels cancellable through `token` (the optimizer step is not).
    pub fn set_cancel(&mut self, token: CancelToken) {
        self.stream = self.stream.with_cancel(token);
    }

    /// Makes this partition's work background work of `gate` (serving beside training): its
    /// long kernels pause between pieces while an inference step holds the gate.
    pub fn yield_to(&mut self, gate: trellis_gpu::PriorityGate) {
        self.stream = self.stream.yielding_to(gate);
    }

    /// The compute stream (its kernel clock times the steps).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// True when the halo rows of layer `l`'s input are exchanged as they are (not for the first
    /// layer, whose halo inputs are static, nor for split layers, which exchange `Z`).
    fn exchanges_input(&self, l: usize) -> bool {
        l > 0 && l < self.num_layers() && !self.model.is_split(l)
    }

    /// Whether the training pass uses the previous epoch's halo blocks (`--staleness 1`).
    pub fn is_stale(&self) -> bool {
        self.staleness > 0
    }

    /// Whether the training blocks of an epoch are held for the next (staleness or skipping):
    /// they then stay in the inbox when used and are held at the optimizer step.
    pub fn holds_rows(&self) -> bool {
        self.holds
    }

    /// Whether an evaluation's blocks are held for the next one (evaluation rows skipped):
    /// they then stay in the inbox until the next optimizer step holds them.
    pub fn holds_eval_rows(&self) -> bool {
        self.holds_eval
    }

    /// Whether blocks of `phase` stay in the inbox when a stage uses them.
    pub fn keeps_blocks(&self, phase: Phase) -> bool {
        match phase {
            Phase::Eval => self.holds_eval,
            Phase::Forward | Phase::Backward => self.holds,
        }
    }

    /// `blocks` (by sender) of `(phase, tag)` with every sparse one merged into the rows held
    /// from the last epoch: the rows a stage uses.
    pub fn full_blocks(
        &self,
        phase: Phase,
        tag: u16,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> Result<BTreeMap<PartId, HaloBlock>> {
        let held = self.held.get(&(phase, tag));
        blocks
            .iter()
            .map(|(q, b)| Ok((*q, self.merged(held.and_then(|h| h.get(q)), b)?)))
            .collect()
    }

    /// The held blocks of the next epoch: `blocks` (the training blocks of the epoch being
    /// applied, and the blocks of the evaluation before it) merged into the ones held now. An
    /// evaluation block is held only where its sender kept its record
    /// ([`skip::keeps_eval_rows`]: it came sparse, or it is a probe's first).
    pub fn merge_held(&self, blocks: EpochBlocks) -> Result<EpochBlocks> {
        blocks
            .into_iter()
            .map(|((phase, tag), mut by)| {
                if phase == Phase::Eval {
                    let held = self.held.get(&(phase, tag));
                    by.retain(|q, b| {
                        let before = held
                            .and_then(|h| h.get(q))
                            .is_some_and(|h| (h.rows, h.cols) == (b.rows, b.cols));
                        let sparse =
                            matches!(&b.payload, HaloPayload::Encoded(p) if codec::is_sparse(p));
                        skip::keeps_eval_rows(b.header.epoch, before, sparse)
                    });
                }
                Ok(((phase, tag), self.full_blocks(phase, tag, &by)?))
            })
            .collect()
    }

    /// `b` itself, or (a sparse block) `base` with the rows `b` carries overwritten: still
    /// encoded where both are in the same fixed-width codec ([`codec::merge_sparse`]; held
    /// int4 rows take an eighth of their fp32 size, in memory and in replicas), else decoded.
    fn merged(&self, base: Option<&HaloBlock>, b: &HaloBlock) -> Result<HaloBlock> {
        let HaloPayload::Encoded(bytes) = &b.payload else {
            return Ok(b.clone());
        };
        if !codec::is_sparse(bytes) {
            return Ok(b.clone());
        }
        let (from, layer) = (b.header.from, b.header.layer);
        let (rows, cols) = (b.rows as usize, b.cols as usize);
        let bad = |what: String| {
            proto(
                self.part,
                &format!("sparse halo block from partition {from} (layer tag {layer:#x}): {what}"),
            )
        };
        let base = base
            .filter(|h| (h.rows, h.cols) == (b.rows, b.cols))
            .ok_or_else(|| bad(format!("no {rows}x{cols} rows held to merge it into")))?;
        if let HaloPayload::Encoded(held) = &base.payload {
            if let Some(merged) =
                codec::merge_sparse(held, rows, cols, bytes).map_err(|e| bad(e.to_string()))?
            {
                return Ok(HaloBlock {
                    payload: HaloPayload::Encoded(merged_payload(held, merged)),
                    ..b.clone()
                });
            }
        }
        let changed = codec::decode_sparse(bytes, rows, cols).map_err(|e| bad(e.to_string()))?;
        let mut values = base.values().map_err(|e| bad(e.to_string()))?.into_owned();
        changed.overwrite(&mut values, cols);
        Ok(HaloBlock {
            payload: HaloPayload::F32(Arc::from(values)),
            ..b.clone()
        })
    }

    /// The held blocks a stage of `(epoch, phase)` with inputs tagged `tag` uses instead of
    /// this epoch's: `Some` for a training pass after the first epoch with staleness on.
    /// Errors when the held blocks are of another epoch than the one before `epoch`.
    pub fn held_inputs(
        &self,
        epoch: u32,
        phase: Phase,
        tag: u16,
    ) -> Result<Option<BTreeMap<PartId, HaloBlock>>> {
        if !self.is_stale() || phase == Phase::Eval || self.epoch_done == 0 {
            return Ok(None);
        }
        if epoch != self.epoch_done + 1 {
            return Err(proto(
                self.part,
                &format!(
                    "a {phase:?} step of epoch {epoch} with the halo rows of epoch {} held",
                    self.epoch_done
                ),
            ));
        }
        Ok(Some(
            self.held.get(&(phase, tag)).cloned().unwrap_or_default(),
        ))
    }

    /// Every (phase, layer tag, senders) of halo blocks one epoch's training pass receives.
    pub fn epoch_inputs(&self) -> Vec<(Phase, u16, Vec<PartId>)> {
        self.pass_inputs(&[Phase::Forward, Phase::Backward])
    }

    /// Every (phase, layer tag, senders) of halo blocks one evaluation receives.
    pub fn eval_inputs(&self) -> Vec<(Phase, u16, Vec<PartId>)> {
        self.pass_inputs(&[Phase::Eval])
    }

    fn pass_inputs(&self, phases: &[Phase]) -> Vec<(Phase, u16, Vec<PartId>)> {
        let mut out = Vec::new();
        for &phase in phases {
            for l in 0..self.num_layers() as u16 {
                let mut stages = vec![Stage::First];
                if self.model.is_split(l as usize) {
                    stages.push(Stage::Second);
                }
                for stage in stages {
                    let (tag, from) = self.inputs(phase, l, stage);
                    if !from.is_empty() {
                        out.push((phase, tag, from));
                    }
                }
            }
        }
        out
    }

    /// Keeps `blocks` ([`Self::merge_held`] of the epoch just applied) for the next epoch.
    pub fn hold(&mut self, blocks: EpochBlocks) {
        self.held = blocks;
    }

    /// The stage a request for `(epoch, phase, layer)` is at.
    pub fn stage_of(&self, epoch: u32, phase: Phase, layer: u16) -> Stage {
        match &self.staged {
            Some(s) if (s.epoch, s.phase, s.layer) == (epoch, phase, layer) => Stage::Second,
            _ => Stage::First,
        }
    }

    /// The halo blocks a stage of a step needs before it can run: the layer tag they carry
    /// (inbox key `(epoch, phase, tag)`) and the parts that send them (none: it runs at once).
    pub fn inputs(&self, phase: Phase, layer: u16, stage: Stage) -> (u16, Vec<PartId>) {
        let l = layer as usize;
        match (phase, stage) {
            (Phase::Forward | Phase::Eval, Stage::First) => {
                let from = self.exchanges_input(l).then(|| self.halo.owners());
                (layer.wrapping_sub(1), from.unwrap_or_default())
            }
            (Phase::Backward, Stage::First) => {
                let from = self.exchanges_input(l + 1).then(|| self.halo.holders());
                (layer + 1, from.unwrap_or_default())
            }
            (Phase::Forward | Phase::Eval, Stage::Second) => {
                (layer | TRANSFORMED, self.halo.owners())
            }
            (Phase::Backward, Stage::Second) => (layer | TRANSFORMED, self.halo.holders()),
        }
    }

    /// Runs `stage` of the step `(epoch, layer, phase)` with the blocks [`Self::inputs`] named
    /// (by sender). Returns the step's outcome (`None` after the first stage of a split layer:
    /// the step goes on with its second) and the blocks to send.
    pub fn run_stage(
        &mut self,
        run: RunId,
        epoch: u32,
        layer: u16,
        phase: Phase,
        stage: Stage,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> StageOut {
        let tag = Tag {
            run,
            epoch,
            layer,
            phase,
        };
        let split = self.model.is_split(layer as usize);
        match (phase, split, stage) {
            (_, false, Stage::Second) => Err(proto(
                self.part,
                &format!("layer {layer} has no second stage"),
            )),
            (Phase::Backward, false, _) => self.backward(tag, blocks),
            (Phase::Backward, true, Stage::First) => self.backward_first(tag, blocks),
            (Phase::Backward, true, Stage::Second) => self.backward_second(tag, blocks),
            (_, false, _) => self.forward(tag, blocks),
            (_, true, Stage::First) => self.forward_first(tag),
            (_, true, Stage::Second) => self.forward_second(tag, blocks),
        }
    }

    fn ctx(tag: Tag) -> StepCtx {
        StepCtx {
            epoch: tag.epoch,
            train: tag.phase == Phase::Forward,
        }
    }

    fn take_own_out(&mut self) -> Result<Tensor> {
        self.own_out
            .take()
            .ok_or_else(|| proto(self.part, "forward without the previous layer's output"))
    }

    /// Forward of a layer that is not split. `blocks` holds, by sender, the halo rows of the
    /// previous layer's output (none for the first layer).
    fn forward(&mut self, tag: Tag, blocks: &BTreeMap<PartId, HaloBlock>) -> StageOut {
        let l = tag.layer as usize;
        let ctx = Self::ctx(tag);
        let y = if l == 0 {
            self.model
                .forward_layer(&self.stream, 0, &self.block, Cow::Borrowed(&self.x), ctx)?
        } else {
            let own = self.take_own_out()?;
            let input = self.halo.assemble(
                &self.stream,
                own,
                self.block.n_in(),
                blocks,
                &mut self.recv_staging,
            )?;
            self.model.forward_layer(
                &self.stream,
                l,
                &self.block,
                Cow::Owned(LayerInput::Dense(input)),
                ctx,
            )?
        };
        self.forward_done(tag, y)
    }

    /// First stage of a split layer's forward: transforms the inner rows, sends the rows each
    /// neighbour holds as halo.
    fn forward_first(&mut self, tag: Tag) -> StageOut {
        let own = self.take_own_out()?;
        let l = tag.layer as usize;
        let z = self
            .model
            .forward_transform(&self.stream, l, &self.block, own, Self::ctx(tag))?;
        if self.overlap {
            return self.forward_first_overlapped(tag, z);
        }
        self.end_first_stage(tag, z)
    }

    /// Overlapped end of a split layer's first forward stage: starts copying out the `Z` rows
    /// each neighbour holds as halo, enqueues the aggregation over the inner rows (on a GPU it
    /// runs while the copies and the exchange proceed), then waits for the copies and sends.
    fn forward_first_overlapped(&mut self, tag: Tag, z: Tensor) -> StageOut {
        let (s, lists) = (&self.stream, &self.halo.send);
        self.halo
            .start_blocks(s, &z, lists, &mut self.send_staging)?;
        let h = self
            .model
            .forward_aggregate_inner(s, tag.layer as usize, &self.block, &z)?;
        let transformed = Tag {
            layer: tag.layer | TRANSFORMED,
            ..tag
        };
        let out = self.halo.finish_blocks(
            s,
            transformed,
            z.cols(),
            lists,
            &mut self.send_staging,
            &mut self.skip,
        )?;
        self.staged = Some(Staged::of(tag, h));
        Ok((None, out))
    }

    /// Ends a split layer's first stage: sends the rows of `rows` the neighbours need under the
    /// transformed-layer tag (forward: the inner rows they hold as halo; backward: the halo
    /// rows' gradients, to their owners) and keeps the inner rows for the second stage.
    fn end_first_stage(&mut self, tag: Tag, mut rows: Tensor) -> StageOut {
        let lists = match tag.phase {
            Phase::Backward => &self.halo.recv,
            Phase::Forward | Phase::Eval => &self.halo.send,
        };
        let transformed = Tag {
            layer: tag.layer | TRANSFORMED,
            ..tag
        };
        let out = self.halo.blocks(
            &self.stream,
            transformed,
            &rows,
            lists,
            &mut self.send_staging,
            &mut self.skip,
        )?;
        rows.truncate_rows(self.block.n_out());
        self.staged = Some(Staged::of(tag, rows));
        Ok((None, out))
    }

    /// Second stage of a split layer's forward: aggregates `[Z_inner; Z_halo]` (overlapped:
    /// adds the halo rows' part to the inner part under way).
    fn forward_second(&mut self, tag: Tag, blocks: &BTreeMap<PartId, HaloBlock>) -> StageOut {
        if self.overlap {
            return self.forward_second_overlapped(tag, blocks);
        }
        let z = self.take_staged(tag)?;
        let z = self.halo.assemble(
            &self.stream,
            z,
            self.block.n_in(),
            blocks,
            &mut self.recv_staging,
        )?;
        let l = tag.layer as usize;
        let y = self
            .model
            .forward_aggregate(&self.stream, l, &self.block, &z, Self::ctx(tag))?;
        drop(z);
        self.forward_done(tag, y)
    }

    fn forward_second_overlapped(
        &mut self,
        tag: Tag,
        blocks: &BTreeMap<PartId, HaloBlock>,
    ) -> StageOut {
        let h = self.take_staged(tag)?;
        let (first, n_in, width) = (self.block.n_out(), self.block.n_in(), h.cols());
        let rows = self.halo.halo_rows(first, n_in, width, blocks)?;
        let s = &self.stream;
        let staging = self.recv_staging.get(self.part, n_in - first, width);
        let z_halo = s.rows_from_host(rows, n_in - first, width, staging)?;
        let l = tag.layer as usize;
        let y = self
            .model
            .forward_aggregate_halo(s, l, &self.block, h, &z_halo, Self::ctx(tag))?;
        self.forward_done(tag, y)
    }

    fn take_staged(&mut self, tag: Tag) -> Result<Tensor> {
        match self.staged.take() {
            Some(s) if (s.epoch, s.phase, s.layer) == (tag.epoch, tag.phase, tag.layer) => {
                Ok(s.rows)
            }
            _ => Err(proto(
                self.part,
                &format!(
                    "second stage of {:?} layer {} of epoch {} without its first",
                    tag.phase, tag.layer, tag.epoch
                ),
            )),
        }
    }

    /// After a layer's forward: keeps its output for the next layer (sending the rows the
    /// neighbours hold as halo if the next layer exchanges its input), or computes the loss
    /// (training) or the correct counts (evaluation) after the last layer.
    fn forward_done(&mut self, tag: Tag, y: Tensor) -> StageOut {
        let l = tag.layer as usize;
        if l + 1 < self.num_layers() {
            let out = if self.exchanges_input(l + 1) {
                let lists = &self.halo.send;
                self.halo.blocks(
                    &self.stream,
                    tag,
                    &y,
                    lists,
                    &mut self.send_staging,
                    &mut self.skip,
                )?
            } else {
                Vec::new()
            };
            self.own_out = Some(y);
            return Ok((Some(Outcome::LayerDone), out));
        }
        let s = &self.stream;
        if tag.phase == Phase::Forward {
            let mut grad = s.zeros(y.rows(), y.cols())?;
            let scale = 1.0 / self.counts.train.max(1) as f32;
            let loss = s.softmax_nll(&y, &self.labels, &self.train, scale, &mut grad)?;
            self.grad_inner = Some(grad);
            Ok((
                Some(Outcome::Loss {
                    loss_sum: loss.loss_sum,
                    count: loss.count,
                    correct: loss.correct,
                }),
                Vec::new(),
            ))
        } else {
            let train = s.accuracy_count(&y, &self.labels, &self.train)?;
            let val = s.accuracy_count(&y, &self.labels, &self.val)?;
            let test = s.accuracy_count(&y, &self.labels, &self.test)?;
            Ok((Some(Outcome::Eval { train, val, test }), Vec::new()))
        }
    }

    /// The gradient of this layer's output rows: this partition's part plus the rows other
    /// parts computed for its inner nodes (`blocks`, by sender).
    fn output_grad(&mut self, blocks: &BTreeMap<PartId, HaloBlock>) -> Result<Tensor> {
        let mut g = self
            .grad_inner
            .take()
            .ok_or_else(|| proto(self.part, "backward without an output gradient"))?;
        self.halo
            .add_received(&self.stream, &mut g, blocks, &mut self.recv_staging)?;
        Ok(g)
    }

    /// Backward of a layer that is not split; sends the gradients of its halo input rows to
    /// their owners.
    fn backward(&mut self, tag: Tag, blocks: &BTreeMap<PartId, HaloBlock>) -> StageOut {
        let l = tag.layer as usize;
        let g = self.output_grad(blocks)?;
        let gx = self
            .model
            .backward_layer(&self.stream, l, &self.block, g, l > 0)?;
        let out = match &gx {
            Some(gx) if self.exchanges_input(l) => {
                let lists = &self.halo.recv;
                self.halo.blocks(
                    &self.stream,
                    tag,
                    gx,
                    lists,
                    &mut self.send_staging,
                    &mut self.skip,
                )?
            }
            _ => Vec::new(),
        };
        self.backward_done(tag.epoch, gx, out)
    }

    /// First stage of a split layer's backward: `gZ` for every input row; sends its halo rows
    /// to their owners.
    fn backward_first(&mut self, tag: Tag, blocks: &BTreeMap<PartId, HaloBlock>) -> StageOut {
        let l = tag.layer as usize;
        let g = self.output_grad(blocks)?;
        if self.overlap {
            return self.backward_first_overlapped(tag, g);
        }
        let gz = self
            .model
            .backward_aggregate(&self.stream, l, &self.block, g)?;
        self.end_first_stage(tag, gz)
    }

    /// Overlapped first stage of a split layer's backward: `gZ` of the halo rows first, whose
    /// copies to the host start at once, then (on a GPU, while they travel) `gZ` of the inner
    /// rows; the same rows, bit for bit, as the plain stage.
    fn backward_first_overlapped(&mut self, tag: Tag, g: Tensor) -> StageOut {
        let (l, s) = (tag.layer as usize, &self.stream);
        let g = self.model.backward_activation(s, l, &self.block, g)?;
        let gz_halo = self
            .model
            .backward_aggregate_rows(s, l, &self.block, &g, true)?;
        let lists = &self.halo.recv_halo;
        self.halo
            .start_blocks(s, &gz_halo, lists, &mut self.send_staging)?;
        let gz_inner = self
            .model
            .backward_aggregate_rows(s, l, &self.block, &g, false)?;
        let transformed = Tag {
            layer: tag.layer | TRANSFORMED,
            ..tag
        };
        let cols = gz_halo.cols();
        let out = self.halo.finish_blocks(
            s,
            transformed,
            cols,
            lists,
            &mut self.send_staging,
            &mut self.skip,
        )?;
        self.staged = Some(Staged::of(tag, gz_inner));
        Ok((None, out))
    }

    /// Second stage of a split layer's backward: adds the neighbours' `gZ` rows for the inner
    /// nodes (ascending sender order), then the weight and inner input gradients.
    fn backward_second(&mut self, tag: Tag, blocks: &BTreeMap<PartId, HaloBlock>) -> StageOut {
        let l = tag.layer as usize;
        let mut gz = self.take_staged(tag)?;
        self.halo
            .add_received(&self.stream, &mut gz, blocks, &mut self.recv_staging)?;
        let gx = self
            .model
            .backward_transform(&self.stream, l, &self.block, gz, l > 0)?;
        self.backward_done(tag.epoch, gx, Vec::new())
    }

    /// After a layer's backward: keeps the inner rows' input gradient for the layer below, or
    /// returns the weight gradients after the first layer.
    fn backward_done(&mut self, epoch: u32, gx: Option<Tensor>, out: Vec<HaloBlock>) -> StageOut {
        match gx {
            Some(mut gx) => {
                gx.truncate_rows(self.block.n_out());
                self.grad_inner = Some(gx);
                Ok((Some(Outcome::LayerDone), out))
            }
            None => {
                let mut flat = Vec::with_capacity(self.model.num_parameters());
                for p in self.model.params() {
                    flat.extend(self.stream.download(&p.grad)?);
                }
                let outcome = self.grads.outcome(self.part, epoch, flat);
                Ok((Some(outcome), Vec::new()))
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
        if self.skip.on() && !self.epoch_inputs().is_empty() && !self.skip.ready(epoch) {
            // The records of what the receivers hold now died with a lost node.
            return Err(proto(
                self.part,
                &format!(
                    "the record of the halo rows sent in epoch {epoch} (--skip-threshold) was \
                     lost with the partition's node during the optimizer step; the run cannot \
                     go on from here"
                ),
            ));
        }
        if epoch > 1 && !self.eval_inputs().is_empty() && !self.skip.eval_ready(epoch - 1) {
            // The coordinator replays the evaluation before a training pass whenever a
            // partition may have lost its records (a re-placement, a resume).
            return Err(proto(
                self.part,
                &format!(
                    "the record of the halo rows sent in the evaluation of epoch {} \
                     (--eval-skip-threshold) is missing at the optimizer step of epoch {epoch}",
                    epoch - 1
                ),
            ));
        }
        if !self.grads.ready_to_apply(epoch) {
            // A partition restarted during its optimizer step replays it from the all-reduced
            // sum with the residual its node held (`resume_pending`); without one (replication
            // off) the step's new residual is gone.
            return Err(proto(
                self.part,
                &format!(
                    "the error-feedback residual of epoch {epoch}'s compressed gradients was lost \
                     (restarted during the optimizer step with no held residual: is replication \
                     off?); --grad-codec {} cannot replay the step without it",
                    self.grads.codec
                ),
            ));
        }
        // Never cancelled half-way (a cancel between the optimizer step and `epoch_done`
        // would leave the weights stepped and the epoch not done, so the retried apply would
        // step them twice): a retried apply of this epoch is then a no-op.
        let s = self.stream.uncancellable();
        let mut off = 0;
        for p in self.model.params_mut() {
            let ((rows, cols), n) = (p.grad.shape(), p.grad.len());
            p.grad = s.upload(&grads[off..off + n], rows, cols)?;
            off += n;
        }
        self.opt.step(&s, &mut self.model)?;
        self.model.zero_grad(&s)?;
        self.grads.commit(epoch);
        self.skip.commit(epoch);
        self.epoch_done = epoch;
        self.model.weights_digest(&s)
    }

    /// Overwrites every other parameter of the model replica (weights and biases alike) with
    /// ones, as a kernel interrupted half-way would leave it (fault injection only): a restart
    /// that does not really restore the committed state then ends with different weights.
    pub fn clobber_for_fault(&mut self) {
        let stream = self.stream.uncancellable();
        for p in self.model.params_mut().iter_mut().step_by(2) {
            let _ = stream.fill(&mut p.value, 1.0);
        }
    }

    /// Drops the caches of an epoch in progress.
    pub fn reset_epoch(&mut self) -> Result<()> {
        self.own_out = None;
        self.grad_inner = None;
        self.staged = None;
        self.model.clear_caches();
        self.model.zero_grad(&self.stream)
    }

    /// The dynamic state to replicate, in host memory (copied from a GPU).
    pub fn snapshot(&self) -> Result<Snapshot> {
        let s = &self.stream;
        Ok(Snapshot {
            epoch: self.epoch_done,
            params: self
                .model
                .params()
                .iter()
                .map(|p| Ok(s.to_host(&p.value)?))
                .collect::<Result<_>>()?,
            opt_state: self
                .opt
                .state()
                .iter()
                .map(|(m, v)| Ok((s.to_host(m)?, s.to_host(v)?)))
                .collect::<Result<_>>()?,
            opt_steps: self.opt.steps(),
            digest: self.model.weights_digest(s)?,
            grad_residual: self.grads.committed.residual().to_vec(),
            held_halo: self
                .held
                .values()
                .flat_map(|by_sender| by_sender.values().cloned())
                .collect(),
            skip_sent: self.skip.committed(),
        })
    }

    /// The error-feedback residual `epoch`'s backward pass computed and its optimizer step has
    /// not committed yet (`None` with exact gradients or once committed).
    pub fn pending_residual(&self, epoch: u32) -> Option<PendingResidual> {
        self.grads.pending(epoch).map(|r| PendingResidual {
            epoch,
            residual: r.to_vec(),
        })
    }

    /// After a restore, resumes the step in progress with its held residual, so that its
    /// optimizer step, replayed from the all-reduced sum, commits it (see
    /// [`PendingResidual`]). A residual of any other step is ignored.
    pub fn resume_pending(&mut self, pending: &PendingResidual) {
        if pending.epoch == self.epoch_done + 1 && !self.grads.codec.is_none() {
            self.grads.pending = Some((
                pending.epoch,
                ErrorFeedback::from_residual(pending.residual.clone()),
            ));
        }
    }

    /// Restores the dynamic state; returns whether the restored weights match the digest
    /// recorded when the snapshot was taken.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<bool> {
        for (p, v) in self.model.params_mut().iter_mut().zip(&snap.params) {
            p.value = self.stream.place(v.clone())?;
        }
        // The optimizer moves its (host) state onto the stream at its next step.
        self.opt.restore(snap.opt_steps, snap.opt_state.clone());
        self.grads.committed = ErrorFeedback::from_residual(snap.grad_residual.clone());
        self.grads.pending = None;
        self.skip.restore(snap.epoch, &snap.skip_sent);
        self.held = EpochBlocks::new();
        for b in &snap.held_halo {
            self.held
                .entry((b.header.phase, b.header.layer))
                .or_default()
                .insert(b.header.from, b.clone());
        }
        self.epoch_done = snap.epoch;
        self.reset_epoch()?;
        Ok(self.model.weights_digest(&self.stream)? == snap.digest)
    }
}

/// Times a closure in milliseconds.
pub(crate) fn timed<R>(f: impl FnOnce() -> R) -> (R, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64() * 1e3)
}
