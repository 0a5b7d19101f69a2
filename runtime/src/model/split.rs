//! Split layers: the two-stage form of a transform-first layer (GCN's `Â (X W)`, GraphSAGE's
//! `Ā (X W_l) + X_inner W_r`) for partitioned runs, where the halo exchange carries the
//! layer's transformed rows `Z = dropout(H) W` (out_dim wide) instead of its input rows
//! (in_dim wide).
//!
//! Forward: stage 1 transforms the inner rows; the caller sends the `Z` rows its neighbours
//! hold as halo and assembles `[Z_inner; Z_halo]`; stage 2 aggregates (and adds GraphSAGE's
//! self term from the inner rows stage 1 kept). Backward: stage 1 computes `gZ = Â^T g` for
//! every input row; the caller sends the halo rows of `gZ` to their owners and adds the rows
//! it receives into its inner rows; stage 2 computes the weight gradients and the inner
//! rows' input gradient. Overlapped forward (GPU streams, or asked for
//! with `TrainConfig::halo_overlap`): stage 2 runs as 2a, the aggregation over the inner rows,
//! enqueued right after the sends start, and 2b, which adds the halo rows' part once they
//! arrive. Between the stages the model keeps what
//! stage 2 needs in the layer's cache; [`Model::clear_caches`] forgets it.
use super::{gcn, sage, Cache, LayerInput, Model, ModelKind, Residual, StepCtx};
use crate::graph::Block;
use crate::{Result, RuntimeError};
use trellis_gpu::halo::HaloRows;
use trellis_gpu::{Stream, Tensor};

impl Model {
    /// True when layer `l` runs split in a partitioned run: a GCN or GraphSAGE layer after
    /// the first that narrows (`out_dim < in_dim`), so exchanging its transformed rows moves
    /// fewer bytes and transforms no halo row. (The first layer's halo inputs are static:
    /// never exchanged.) A layer with a residual connection does not run split: it runs
    /// whole, as [`Model::forward_layer`] adds its residual.
    pub fn is_split(&self, l: usize) -> bool {
        let spec = &self.layers[l];
        matches!(self.cfg.kind, ModelKind::Gcn | ModelKind::Sage)
            && l > 0
            && spec.out_dim < spec.in_dim
            && spec.residual == Residual::None
    }

    /// True when layer `l`'s output rows are a function of its transformed rows `Z` alone: a
    /// split GCN layer, `act(Â Z + b)` (a split GraphSAGE layer also reads its own input rows
    /// for the self term). Layer-wise inference and the service keep a `Z` table for these
    /// layers, and an update re-transforms the rows whose input changed.
    pub fn reads_transformed_only(&self, l: usize) -> bool {
        self.cfg.kind == ModelKind::Gcn && self.is_split(l)
    }

    fn check_split(&self, l: usize) -> Result<()> {
        if l >= self.num_layers() || !self.is_split(l) {
            return Err(RuntimeError::Config(format!(
                "layer {l} does not run split (only narrowing GCN and GraphSAGE layers after \
                 the first do)"
            )));
        }
        Ok(())
    }

    /// Forward stage 1 of split layer `l`: `Z = dropout(X) W` for the block's inner rows `x`.
    pub fn forward_transform(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        x: Tensor,
        ctx: StepCtx,
    ) -> Result<Tensor> {
        self.check_split(l)?;
        let spec = self.layers[l];
        if x.rows() != block.n_out() || x.cols() != spec.in_dim {
            return Err(RuntimeError::Config(format!(
                "layer {l} expects {}x{} inner rows, got {}x{}",
                block.n_out(),
                spec.in_dim,
                x.rows(),
                x.cols()
            )));
        }
        let p = &self.params[spec.first_param..];
        let (z, xd) = gcn::transform(&self.args(s, &spec, block), p, x, ctx)?;
        self.caches[l] = self
            .stage_2_reads_input(ctx)
            .then_some(Cache::SplitInput(xd));
        Ok(z)
    }

    /// Forward stage 2 of split layer `l`: the layer's output rows from `z`, the transformed
    /// rows of every input row of the block (inner, then halo).
    pub fn forward_aggregate(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        z: &Tensor,
        ctx: StepCtx,
    ) -> Result<Tensor> {
        self.check_split(l)?;
        let spec = self.layers[l];
        if z.rows() != block.n_in() || z.cols() != spec.out_dim {
            return Err(RuntimeError::Config(format!(
                "layer {l} expects {}x{} transformed rows, got {}x{}",
                block.n_in(),
                spec.out_dim,
                z.rows(),
                z.cols()
            )));
        }
        let xd = self.take_transform_input(l, ctx)?;
        let p = &self.params[spec.first_param..];
        let a = self.args(s, &spec, block);
        match (self.cfg.kind, xd) {
            (ModelKind::Sage, Some(xd)) => {
                let (y, cache) = sage::aggregate(&a, p, z, xd, ctx)?;
                self.finish_stage(l, y, cache.map(Cache::Sage))
            }
            (_, xd) => {
                let (y, cache) = gcn::aggregate(&a, p, z, xd, ctx)?;
                self.finish_stage(l, y, cache.map(Cache::Gcn))
            }
        }
    }

    /// Whether a split layer's stage 2 reads the dropped inner rows stage 1 kept: in
    /// training (the backward reads them), and always for GraphSAGE (its self term).
    fn stage_2_reads_input(&self, ctx: StepCtx) -> bool {
        ctx.train || self.cfg.kind == ModelKind::Sage
    }

    /// Keeps a finished forward stage's cache; returns its output rows.
    fn finish_stage(&mut self, l: usize, y: Tensor, cache: Option<Cache>) -> Result<Tensor> {
        self.caches[l] = cache;
        Ok(y)
    }

    /// What stage 1 of split layer `l` kept: the dropped inner rows (GCN: for the backward,
    /// nothing outside training; GraphSAGE: always, for its self term).
    fn take_transform_input(&mut self, l: usize, ctx: StepCtx) -> Result<Option<LayerInput>> {
        match (self.stage_2_reads_input(ctx), self.caches[l].take()) {
            (false, _) => Ok(None),
            (true, Some(Cache::SplitInput(xd))) => Ok(Some(xd)),
            (true, _) => Err(RuntimeError::Config(format!(
                "layer {l}: aggregation stage without its transform stage"
            ))),
        }
    }

    /// Overlapped forward stage 2a of split layer `l`: the aggregation over the inner rows,
    /// `Â_inner Z_inner`, started while the halo rows are in flight (`z_inner`: what stage 1
    /// returned). Stage 2b ([`Model::forward_aggregate_halo`]) adds the halo part.
    pub fn forward_aggregate_inner(
        &self,
        s: &Stream,
        l: usize,
        block: &Block,
        z_inner: &Tensor,
    ) -> Result<Tensor> {
        self.check_split(l)?;
        let spec = self.layers[l];
        if z_inner.shape() != (block.n_out(), spec.out_dim) {
            return Err(RuntimeError::Config(format!(
                "layer {l} expects {}x{} inner transformed rows, got {:?}",
                block.n_out(),
                spec.out_dim,
                z_inner.shape()
            )));
        }
        gcn::aggregate_inner(&self.args(s, &spec, block), z_inner)
    }

    /// Overlapped forward stage 2b of split layer `l`: adds `Â_halo Z_halo` (the received
    /// rows, once they have arrived) to the partial output `h` of stage 2a; the layer's output
    /// rows, as [`Model::forward_aggregate`] returns them up to summation order.
    pub fn forward_aggregate_halo(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        h: Tensor,
        z_halo: &HaloRows,
        ctx: StepCtx,
    ) -> Result<Tensor> {
        self.check_split(l)?;
        let spec = self.layers[l];
        let xd = self.take_transform_input(l, ctx)?;
        let p = &self.params[spec.first_param..];
        let a = self.args(s, &spec, block);
        match (self.cfg.kind, xd) {
            (ModelKind::Sage, Some(xd)) => {
                let (y, cache) = sage::aggregate_halo(&a, p, h, z_halo, xd, ctx)?;
                self.finish_stage(l, y, cache.map(Cache::Sage))
            }
            (_, xd) => {
                let (y, cache) = gcn::aggregate_halo(&a, p, h, z_halo, xd, ctx)?;
                self.finish_stage(l, y, cache.map(Cache::Gcn))
            }
        }
    }

    /// Backward stage 1 of split layer `l`: `gZ = Â^T act'(grad_out)` for every input row of
    /// the block; accumulates the bias gradient.
    pub fn backward_aggregate(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        grad_out: Tensor,
    ) -> Result<Tensor> {
        let g = self.backward_activation(s, l, block, grad_out)?;
        let a = self.args(s, &self.layers[l], block);
        gcn::grad_z_rows(&a, block.adj_t(), &g)
    }

    /// Overlapped backward stage 1 of split layer `l`: `g = act'(grad_out)` (accumulating
    /// the bias gradient), for [`Model::backward_aggregate_rows`] to compute `gZ` from, halo
    /// rows first so they can leave while the inner rows are computed.
    pub fn backward_activation(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        grad_out: Tensor,
    ) -> Result<Tensor> {
        self.check_split(l)?;
        let spec = self.layers[l];
        if grad_out.rows() != block.n_out() || grad_out.cols() != spec.out_dim {
            return Err(RuntimeError::Config(format!(
                "layer {l}: output gradient is {}x{}, expected {}x{}",
                grad_out.rows(),
                grad_out.cols(),
                block.n_out(),
                spec.out_dim
            )));
        }
        let a = self.args(s, &spec, block);
        let p = &mut self.params[spec.first_param..];
        match &mut self.caches[l] {
            Some(Cache::Gcn(c)) => gcn::grad_h(&a, p, c, grad_out),
            Some(Cache::Sage(c)) => sage::grad_h(&a, p, c, grad_out),
            _ => Err(RuntimeError::Config(format!(
                "backward of layer {l} without a training forward"
            ))),
        }
    }

    /// `gZ` of split layer `l` for the block's inner input rows (`halo = false`) or its halo
    /// input rows (`halo = true`) from `g` of [`Model::backward_activation`]: together, the
    /// rows of [`Model::backward_aggregate`], bit for bit.
    pub fn backward_aggregate_rows(
        &self,
        s: &Stream,
        l: usize,
        block: &Block,
        g: &Tensor,
        halo: bool,
    ) -> Result<Tensor> {
        self.check_split(l)?;
        let (inner, halo_rows) = block.adj_t_split();
        let rows = if halo { halo_rows } else { inner };
        gcn::grad_z_rows(&self.args(s, &self.layers[l], block), rows, g)
    }

    /// Backward stage 2 of split layer `l`, given `gZ` of the inner rows with every part's
    /// contribution added: accumulates the weight gradient and, if `need_input_grad`, returns
    /// the gradient of the inner input rows.
    pub fn backward_transform(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        gz: Tensor,
        need_input_grad: bool,
    ) -> Result<Option<Tensor>> {
        self.check_split(l)?;
        let spec = self.layers[l];
        if gz.rows() != block.n_out() || gz.cols() != spec.out_dim {
            return Err(RuntimeError::Config(format!(
                "layer {l}: transformed-row gradient is {}x{}, expected {}x{}",
                gz.rows(),
                gz.cols(),
                block.n_out(),
                spec.out_dim
            )));
        }
        let a = self.args(s, &spec, block);
        let p = &mut self.params[spec.first_param..];
        match self.caches[l].take() {
            Some(Cache::Gcn(c)) => gcn::grad_transform(&a, p, c, gz, need_input_grad),
            Some(Cache::Sage(c)) => sage::grad_transform(&a, p, c, gz, need_input_grad),
            _ => Err(RuntimeError::Config(format!(
                "backward of layer {l} without a training forward"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Graph;
    use crate::model::{LayerInput, ModelConfig};
    use std::borrow::Cow;

    /// A split layer run on one block (no halo) equals the same layer run whole, forward and
    /// backward, bit for bit, for GCN and GraphSAGE; in evaluation too.
    #[test]
    fn split_stages_equal_the_whole_layer() {
        split_stages_equal_the_whole_layer_of(ModelKind::Gcn);
        split_stages_equal_the_whole_layer_of(ModelKind::Sage);
    }

    fn split_stages_equal_the_whole_layer_of(kind: ModelKind) {
        let s = Stream::cpu(2).unwrap();
        let n = 40;
        let src: Vec<u32> = (0..n).collect();
        let dst: Vec<u32> = (0..n).map(|i| (i * 7 + 3) % n).collect();
        let g = Graph::from_edges(n as usize, &src, &dst).unwrap();
        let block = Block::full(&g, kind.aggregation()).unwrap();
        let mut cfg = ModelConfig::paper_defaults(kind, 6, 3, 9);
        cfg.hidden = 12;
        let mut whole = Model::new(cfg.clone()).unwrap();
        let mut split = Model::new(cfg).unwrap();
        assert!(!split.is_split(0) && split.is_split(1));
        let ctx = StepCtx {
            epoch: 2,
            train: true,
        };
        let h: Vec<f32> = (0..n as usize * 12)
            .map(|i| (i % 11) as f32 * 0.1)
            .collect();
        let h = Tensor::from_vec(n as usize, 12, h).unwrap();
        let x = Cow::Owned(LayerInput::Dense(h.clone()));
        let eval = StepCtx {
            epoch: 2,
            train: false,
        };
        let x_eval = Cow::Owned(LayerInput::Dense(h.clone()));
        let y_whole = whole.forward_layer(&s, 1, &block, x_eval, eval).unwrap();
        let z = split
            .forward_transform(&s, 1, &block, h.clone(), eval)
            .unwrap();
        let y_split = split.forward_aggregate(&s, 1, &block, &z, eval).unwrap();
        assert_eq!(y_whole.as_slice(), y_split.as_slice(), "{kind} evaluation");
        let y_whole = whole.forward_layer(&s, 1, &block, x, ctx).unwrap();
        let z = split.forward_transform(&s, 1, &block, h, ctx).unwrap();
        let y_split = split.forward_aggregate(&s, 1, &block, &z, ctx).unwrap();
        assert_eq!(y_whole.as_slice(), y_split.as_slice(), "{kind} training");

        let g_out: Vec<f32> = (0..n as usize * 3).map(|i| (i % 5) as f32 - 2.0).collect();
        let g_out = Tensor::from_vec(n as usize, 3, g_out).unwrap();
        let gx_whole = whole
            .backward_layer(&s, 1, &block, g_out.clone(), true)
            .unwrap()
            .unwrap();
        let gz = split.backward_aggregate(&s, 1, &block, g_out).unwrap();
        let gx_split = split
            .backward_transform(&s, 1, &block, gz, true)
            .unwrap()
            .unwrap();
        assert_eq!(gx_whole.as_slice(), gx_split.as_slice());
        for (a, b) in whole.params().iter().zip(split.params()) {
            assert_eq!(a.grad.as_slice(), b.grad.as_slice(), "{}", a.name);
        }
        // Stage 1 of the backward in two row parts (inner, halo) gives the same rows.
        let halo_block =
            Block::build(&g, &(0..25).collect::<Vec<u32>>(), kind.aggregation()).unwrap();
        let (n_out, n_in) = (halo_block.n_out(), halo_block.n_in());
        assert!(n_in > n_out, "the block has halo rows");
        let trained = || {
            let cfg = ModelConfig::paper_defaults(kind, 6, 3, 9);
            let mut m = Model::new(cfg).unwrap();
            let h = (0..n_out * 16).map(|i| (i % 7) as f32).collect();
            let h = Tensor::from_vec(n_out, 16, h).unwrap();
            let mut z = m.forward_transform(&s, 1, &halo_block, h, ctx).unwrap();
            z.append_rows(&vec![0.5; (n_in - n_out) * 3]).unwrap();
            m.forward_aggregate(&s, 1, &halo_block, &z, ctx).unwrap();
            m
        };
        let (mut whole, mut parts) = (trained(), trained());
        let g_out: Vec<f32> = (0..n_out * 3).map(|i| i as f32 * 0.01).collect();
        let g_out = Tensor::from_vec(n_out, 3, g_out).unwrap();
        let gz = whole
            .backward_aggregate(&s, 1, &halo_block, g_out.clone())
            .unwrap();
        let g = parts
            .backward_activation(&s, 1, &halo_block, g_out)
            .unwrap();
        let rows = |halo| {
            parts
                .backward_aggregate_rows(&s, 1, &halo_block, &g, halo)
                .unwrap()
                .into_vec()
        };
        let mut joined = rows(false);
        joined.extend(rows(true));
        assert_eq!(gz.as_slice(), &joined[..]);
        // Stage 2 without stage 1 is a clear error, not a panic.
        let err = split.forward_aggregate(&s, 1, &block, &z, ctx).unwrap_err();
        assert!(err.to_string().contains("transform stage"), "{err}");
        assert!(split.forward_transform(&s, 0, &block, z, ctx).is_err());
    }
}
