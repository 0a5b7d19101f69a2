//! GraphSAGE layer with the mean aggregator (Hamilton et al. 2017, as PyG's `SAGEConv`):
//! `act(mean_{j in N(i)} x_j · W_l + x_i · W_r + b)` on dropped-out inputs. The mean is
//! linear, so the layer aggregates over the narrower side, as GCN's does: a narrowing layer
//! transforms first, `Ā (X W_l)` (the aggregation reads the narrower rows); any other layer
//! with dense inputs aggregates first, `(Ā X) W_l`, which multiplies only the inner rows and
//! keeps for backward the aggregated and the inner rows instead of every input row (a
//! partition of a large graph has about twice as many halo rows as inner ones).
use super::{dropout_backward, ActSaved, Init, LayerArgs, LayerInput, LayerSpec, Param, StepCtx};
use crate::Result;
use std::borrow::Cow;
use trellis_gpu::halo::HaloRows;
use trellis_gpu::{EdgeWeights, Stream, Tensor};

pub(crate) fn param_shapes(spec: &LayerSpec) -> Vec<(String, usize, usize, Init)> {
    let fan = Init::LinearUniform(spec.in_dim);
    vec![
        ("lin_l.weight".into(), spec.in_dim, spec.out_dim, fan),
        ("lin_l.bias".into(), 1, spec.out_dim, fan),
        ("lin_r.weight".into(), spec.in_dim, spec.out_dim, fan),
    ]
}

/// What backward needs besides the output.
pub(crate) enum Saved {
    /// Transform first: every dropped-out input row (`W_l`'s gradient reads them all).
    Input(LayerInput),
    /// Aggregate first: the aggregated rows `Ā X` and the dropped-out inner rows.
    Aggregated { mean: Tensor, inner: Tensor },
}

pub(crate) struct SageCache {
    epoch: u32,
    pub(crate) saved: Saved,
    act: ActSaved,
    /// A split layer between its backward stages: `act'(grad_out)`, which the self term's
    /// gradients read in stage 2.
    grad_h: Option<Tensor>,
}

pub(crate) fn forward(
    a: &LayerArgs<'_>,
    p: &[Param],
    x: Cow<'_, LayerInput>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<SageCache>)> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    let (w_l, b, w_r) = (&p[0].value, &p[1].value, &p[2].value);
    let n_out = block.n_out();
    let xd = LayerInput::dropped(x, s, spec, seed, block, ctx)?;
    let mut h = s.zeros(n_out, spec.out_dim)?;
    let saved = match xd.as_ref() {
        LayerInput::Dense(xt) if spec.out_dim >= spec.in_dim => {
            let mut mean = s.zeros(n_out, spec.in_dim)?;
            s.spmm(block.adj(), EdgeWeights::Stored, xt, &mut mean)?;
            s.gemm(1.0, &mean, false, w_l, false, 0.0, &mut h)?;
            s.gemm_prefix(1.0, xt, n_out, false, w_r, false, 1.0, &mut h)?;
            match (ctx.train, xd) {
                (false, _) => None,
                (true, Cow::Owned(LayerInput::Dense(mut inner))) => {
                    inner.shrink_to_rows(n_out);
                    Some(Saved::Aggregated { mean, inner })
                }
                (true, Cow::Borrowed(LayerInput::Dense(all))) => {
                    let inner = s.copy_rows_prefix(all, n_out)?;
                    Some(Saved::Aggregated { mean, inner })
                }
                (true, _) => {
                    return Err(crate::RuntimeError::Config(format!(
                        "GraphSAGE layer {}: dense input rows turned sparse",
                        spec.index
                    )))
                }
            }
        }
        xi => {
            let z = xi.matmul(s, w_l)?;
            s.spmm(block.adj(), EdgeWeights::Stored, &z, &mut h)?;
            drop(z);
            xi.matmul_prefix_acc(s, n_out, w_r, &mut h)?;
            ctx.train.then(|| Saved::Input(xd.into_owned()))
        }
    };
    finish(s, spec, b, h, saved, ctx)
}

/// `act(h + b)`, and in training the cache backward needs.
fn finish(
    s: &Stream,
    spec: &LayerSpec,
    b: &Tensor,
    mut h: Tensor,
    saved: Option<Saved>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<SageCache>)> {
    let cache = ActSaved::finish(s, spec.act, b, &mut h, saved)?.map(|(saved, act)| SageCache {
        epoch: ctx.epoch,
        saved,
        act,
        grad_h: None,
    });
    Ok((h, cache))
}

/// Forward stage 2 of a split layer (its stage 1 is GCN's, `Z = dropout(X_inner) W_l`):
/// `act(Ā Z + X_inner W_r + b)` with `z` holding every input row's `Z` (inner, then halo)
/// and `xd` the dropped inner rows stage 1 kept; the same operations, in the same order, as
/// the whole transform-first layer.
pub(crate) fn aggregate(
    a: &LayerArgs<'_>,
    p: &[Param],
    z: &Tensor,
    xd: LayerInput,
    ctx: StepCtx,
) -> Result<(Tensor, Option<SageCache>)> {
    let LayerArgs { s, spec, block, .. } = *a;
    let mut h = s.zeros(block.n_out(), spec.out_dim)?;
    s.spmm(block.adj(), EdgeWeights::Stored, z, &mut h)?;
    finish_split(a, p, h, xd, ctx)
}

/// Overlapped forward stage 2b of a split layer: adds `Ā_halo Z_halo` to the inner rows'
/// part `h` (stage 2a, GCN's), then finishes as [`aggregate`].
pub(crate) fn aggregate_halo(
    a: &LayerArgs<'_>,
    p: &[Param],
    mut h: Tensor,
    z_halo: &HaloRows,
    xd: LayerInput,
    ctx: StepCtx,
) -> Result<(Tensor, Option<SageCache>)> {
    let (_, halo) = a.block.adj_split()?;
    a.s.spmm_halo_acc(halo, EdgeWeights::Stored, z_halo, &mut h)?;
    finish_split(a, p, h, xd, ctx)
}

/// `h += X_inner W_r`, then [`finish`]; training keeps the inner rows.
fn finish_split(
    a: &LayerArgs<'_>,
    p: &[Param],
    mut h: Tensor,
    xd: LayerInput,
    ctx: StepCtx,
) -> Result<(Tensor, Option<SageCache>)> {
    let LayerArgs { s, spec, block, .. } = *a;
    xd.matmul_prefix_acc(s, block.n_out(), &p[2].value, &mut h)?;
    let saved = ctx.train.then_some(Saved::Input(xd));
    finish(s, spec, &p[1].value, h, saved, ctx)
}

/// Backward stage 1 of a split layer: `act'(grad_out)`, with the bias gradient accumulated;
/// keeps a copy for stage 2 (the self term's gradients).
pub(crate) fn grad_h(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: &mut SageCache,
    mut g: Tensor,
) -> Result<Tensor> {
    let LayerArgs { s, spec, .. } = *a;
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    c.grad_h = Some(s.copy(&g)?);
    Ok(g)
}

/// Backward stage 2 of a split layer, given `gZ` of the inner rows with every part's
/// contribution added: `gW_l += X_inner^T gZ`, `gW_r += X_inner^T g` and, if asked, the inner
/// rows' input gradient `dropout'(gZ W_l^T + g W_r^T)`.
pub(crate) fn grad_transform(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: SageCache,
    gz: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let (Saved::Input(xd), Some(g)) = (c.saved, c.grad_h) else {
        return Err(crate::RuntimeError::Config(
            "GraphSAGE transform backward before its aggregation backward".into(),
        ));
    };
    transform_backward(a, p, xd, &gz, &g, c.epoch, need_input_grad)
}

pub(crate) fn backward(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: SageCache,
    mut g: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let LayerArgs { s, spec, block, .. } = *a;
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    match c.saved {
        Saved::Input(xd) => {
            // h = Ā (X W_l) + X_inner W_r: gZ = Ā^T g for every input row.
            let mut gz = s.zeros(block.n_in(), spec.out_dim)?;
            s.spmm(block.adj_t(), EdgeWeights::Stored, &g, &mut gz)?;
            transform_backward(a, p, xd, &gz, &g, c.epoch, need_input_grad)
        }
        Saved::Aggregated { mean, inner } => {
            // h = (Ā X) W_l + X_inner W_r: gW_l = (ĀX)^T g, gX = Ā^T (g W_l^T).
            s.gemm(1.0, &mean, true, &g, false, 1.0, &mut p[0].grad)?;
            s.gemm(1.0, &inner, true, &g, false, 1.0, &mut p[2].grad)?;
            if !need_input_grad {
                return Ok(None);
            }
            drop((mean, inner)); // done with: freed before the input gradient is allocated
            let gmean = s.matmul(&g, false, &p[0].value, true)?;
            let mut gx = s.zeros(block.n_in(), spec.in_dim)?;
            s.spmm(block.adj_t(), EdgeWeights::Stored, &gmean, &mut gx)?;
            self_term_backward(a, p, &g, gx, c.epoch)
        }
    }
}

/// A transform-first layer's backward from `gZ` (of every input row, or of the inner rows of
/// a split layer) and `g = act'(grad_out)`: `gW_l += X^T gZ`, `gW_r += X_inner^T g` and, if
/// asked, `dropout'(gZ W_l^T + g W_r^T)` for `gZ`'s rows.
fn transform_backward(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    xd: LayerInput,
    gz: &Tensor,
    g: &Tensor,
    epoch: u32,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let s = a.s;
    xd.t_matmul_acc(s, gz, &mut p[0].grad)?;
    xd.t_matmul_acc(s, g, &mut p[2].grad)?;
    if !need_input_grad {
        return Ok(None);
    }
    drop(xd); // done with: freed before the input gradient is allocated
    let gx = s.matmul(gz, false, &p[0].value, true)?;
    self_term_backward(a, p, g, gx, epoch)
}

/// Adds the self term's input gradient `g W_r^T` into the inner rows of `gx`, then applies
/// the input dropout's mask.
fn self_term_backward(
    a: &LayerArgs<'_>,
    p: &[Param],
    g: &Tensor,
    mut gx: Tensor,
    epoch: u32,
) -> Result<Option<Tensor>> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    let gself = s.matmul(g, false, &p[2].value, true)?;
    s.add_rows_prefix(&gself, &mut gx)?;
    dropout_backward(s, spec, seed, block, &mut gx, epoch)?;
    Ok(Some(gx))
}
