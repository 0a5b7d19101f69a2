//! GCN layer (Kipf & Welling 2017): `act(Â · dropout(X) · W + b)` with
//! `Â = D^-1/2 (A + I) D^-1/2` over global degrees (the block's stored values).
use super::{dropout_backward, ActSaved, Init, LayerArgs, LayerInput, LayerSpec, Param, StepCtx};
use crate::Result;
use std::borrow::Cow;
use trellis_gpu::halo::HaloRows;
use trellis_gpu::{Csr, EdgeWeights, Stream, Tensor};

pub(crate) fn param_shapes(spec: &LayerSpec) -> Vec<(String, usize, usize, Init)> {
    vec![
        ("weight".into(), spec.in_dim, spec.out_dim, Init::Glorot),
        ("bias".into(), 1, spec.out_dim, Init::Zeros),
    ]
}

/// What backward needs besides the output: the dropped input (when the layer transforms
/// first, `Â (X W)`) or the aggregated input `Â X` (when it aggregates first).
pub(crate) enum Saved {
    Input(LayerInput),
    Aggregated(Tensor),
}

pub(crate) struct GcnCache {
    epoch: u32,
    saved: Saved,
    /// What the activation's backward needs.
    act: ActSaved,
}

pub(crate) fn forward(
    a: &LayerArgs<'_>,
    p: &[Param],
    x: Cow<'_, LayerInput>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<GcnCache>)> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    let (w, b) = (&p[0].value, &p[1].value);
    let xd = LayerInput::dropped(x, s, spec, seed, block, ctx)?;
    let mut h = s.zeros(block.n_out(), spec.out_dim)?;
    // Aggregate over the narrower side: transform first when it shrinks the rows.
    let saved = match xd.as_ref() {
        LayerInput::Dense(xt) if spec.out_dim >= spec.in_dim => {
            let mut ax = s.zeros(block.n_out(), spec.in_dim)?;
            s.spmm(block.adj(), EdgeWeights::Stored, xt, &mut ax)?;
            s.gemm(1.0, &ax, false, w, false, 0.0, &mut h)?;
            ctx.train.then_some(Saved::Aggregated(ax))
        }
        xi => {
            let z = xi.matmul(s, w)?;
            s.spmm(block.adj(), EdgeWeights::Stored, &z, &mut h)?;
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
) -> Result<(Tensor, Option<GcnCache>)> {
    let cache = ActSaved::finish(s, spec.act, b, &mut h, saved)?.map(|(saved, act)| GcnCache {
        epoch: ctx.epoch,
        saved,
        act,
    });
    Ok((h, cache))
}

/// Forward stage 1 of a split transform-first layer (the halo exchange carries its output):
/// `Z = dropout(X) W` over the block's inner rows `x` only (`W`: the layer's first parameter;
/// GraphSAGE's `W_l` too). Returns `Z` and the dropped rows (backward reads them, and a
/// GraphSAGE layer's self term).
pub(crate) fn transform(
    a: &LayerArgs<'_>,
    p: &[Param],
    mut x: Tensor,
    ctx: StepCtx,
) -> Result<(Tensor, LayerInput)> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    if ctx.train && spec.dropout > 0.0 {
        let key = spec.dropout_key(seed, ctx.epoch, 0);
        s.dropout(&mut x, block.inner_gids(), key, spec.dropout)?;
    }
    let z = s.matmul(&x, false, &p[0].value, false)?;
    Ok((z, LayerInput::Dense(x)))
}

/// Forward stage 2 of a split layer: `act(Â Z + b)`, `z` holding every input row (inner rows
/// computed here, halo rows received from their owners); `xd` is what stage 1 kept.
pub(crate) fn aggregate(
    a: &LayerArgs<'_>,
    p: &[Param],
    z: &Tensor,
    xd: Option<LayerInput>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<GcnCache>)> {
    let LayerArgs { s, spec, block, .. } = *a;
    let mut h = s.zeros(block.n_out(), spec.out_dim)?;
    s.spmm(block.adj(), EdgeWeights::Stored, z, &mut h)?;
    finish(s, spec, &p[1].value, h, xd.map(Saved::Input), ctx)
}

/// Overlapped forward stage 2a of a split layer: `Â_inner Z_inner`, the part of the
/// aggregation over the inner rows, started before the halo rows have arrived.
pub(crate) fn aggregate_inner(a: &LayerArgs<'_>, z_inner: &Tensor) -> Result<Tensor> {
    let LayerArgs { s, spec, block, .. } = *a;
    let (inner, _) = block.adj_split()?;
    let mut h = s.zeros(block.n_out(), spec.out_dim)?;
    s.spmm(inner, EdgeWeights::Stored, z_inner, &mut h)?;
    Ok(h)
}

/// Overlapped forward stage 2b: adds `Â_halo Z_halo` once the halo rows have arrived, then
/// `act(h + b)` as [`aggregate`] does.
pub(crate) fn aggregate_halo(
    a: &LayerArgs<'_>,
    p: &[Param],
    mut h: Tensor,
    z_halo: &HaloRows,
    xd: Option<LayerInput>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<GcnCache>)> {
    let LayerArgs { s, spec, block, .. } = *a;
    let (_, halo) = block.adj_split()?;
    s.spmm_halo_acc(halo, EdgeWeights::Stored, z_halo, &mut h)?;
    finish(s, spec, &p[1].value, h, xd.map(Saved::Input), ctx)
}

pub(crate) fn backward(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: GcnCache,
    mut g: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    if let Saved::Input(_) = &c.saved {
        // h = Â Z, Z = X W: gZ = Â^T g, gW = X^T gZ, gX = gZ W^T.
        let gz = grad_z(a, p, &c, g)?;
        return grad_transform(a, p, c, gz, need_input_grad);
    }
    // h = (Â X) W: gW = (ÂX)^T g, gÂX = g W^T, gX = Â^T gÂX.
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    let Saved::Aggregated(ax) = c.saved else {
        unreachable!("the other case returned above")
    };
    s.gemm(1.0, &ax, true, &g, false, 1.0, &mut p[0].grad)?;
    if !need_input_grad {
        return Ok(None);
    }
    drop(ax); // done with: freed before the input gradient is allocated
    let gax = s.matmul(&g, false, &p[0].value, true)?;
    let mut gx = s.zeros(block.n_in(), spec.in_dim)?;
    s.spmm(block.adj_t(), EdgeWeights::Stored, &gax, &mut gx)?;
    dropout_backward(s, spec, seed, block, &mut gx, c.epoch)?;
    Ok(Some(gx))
}

/// Backward stage 1 of a transform-first layer: `gZ = Â^T act'(g)` for every input row of the
/// block (a partition sends the halo rows to their owners); accumulates the bias gradient.
pub(crate) fn grad_z(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: &GcnCache,
    g: Tensor,
) -> Result<Tensor> {
    let g = grad_h(a, p, c, g)?;
    grad_z_rows(a, a.block.adj_t(), &g)
}

/// `act'(g)`, with the bias gradient accumulated: what every row of `gZ` is computed from.
pub(crate) fn grad_h(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: &GcnCache,
    mut g: Tensor,
) -> Result<Tensor> {
    let LayerArgs { s, spec, .. } = *a;
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    Ok(g)
}

/// `gZ` for the rows of `adj_t_rows` (the whole `Â^T`, or its inner or halo rows from
/// [`Block::adj_t_split`](crate::Block::adj_t_split)) from `g = act'(grad_out)`.
pub(crate) fn grad_z_rows(a: &LayerArgs<'_>, adj_t_rows: &Csr, g: &Tensor) -> Result<Tensor> {
    let LayerArgs { s, spec, .. } = *a;
    let mut gz = s.zeros(adj_t_rows.n_rows(), spec.out_dim)?;
    s.spmm(adj_t_rows, EdgeWeights::Stored, g, &mut gz)?;
    Ok(gz)
}

/// Backward stage 2 of a transform-first layer, given `gZ` complete for the rows the layer
/// transformed (every input row in one process, the inner rows of a split layer):
/// `gW += X^T gZ` and, if asked, `gX = dropout'(gZ W^T)` for those rows.
pub(crate) fn grad_transform(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: GcnCache,
    gz: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    let Saved::Input(xd) = c.saved else {
        return Err(crate::RuntimeError::Config(
            "GCN transform backward on an aggregate-first layer".into(),
        ));
    };
    xd.t_matmul_acc(s, &gz, &mut p[0].grad)?;
    if !need_input_grad {
        return Ok(None);
    }
    drop(xd); // done with: freed before the input gradient is allocated
    let mut gx = s.matmul(&gz, false, &p[0].value, true)?;
    dropout_backward(s, spec, seed, block, &mut gx, c.epoch)?;
    Ok(Some(gx))
}
