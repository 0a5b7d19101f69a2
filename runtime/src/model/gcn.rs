//! GCN layer (Kipf & Welling 2017): `act(Â · dropout(X) · W + b)` with
//! `Â = D^-1/2 (A + I) D^-1/2` over global degrees (the block's stored values).
use super::{dropout_backward, ActSaved, Init, LayerInput, LayerSpec, Param, StepCtx};
use crate::graph::Block;
use crate::Result;
use std::borrow::Cow;
use trellis_gpu::{EdgeWeights, Stream, Tensor};

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
    s: &Stream,
    spec: &LayerSpec,
    seed: u64,
    p: &[Param],
    block: &Block,
    x: Cow<'_, LayerInput>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<GcnCache>)> {
    let (w, b) = (&p[0].value, &p[1].value);
    let xd = LayerInput::dropped(x, s, spec, seed, block, ctx)?;
    let mut h = Tensor::zeros(block.n_out(), spec.out_dim);
    // Aggregate over the narrower side: transform first when it shrinks the rows.
    let saved = match xd.as_ref() {
        LayerInput::Dense(xt) if spec.out_dim >= spec.in_dim => {
            let mut ax = Tensor::zeros(block.n_out(), spec.in_dim);
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
    s.add_bias(&mut h, b)?;
    s.activate(spec.act, &mut h)?;
    let y = h;
    let act = if ctx.train {
        Some(ActSaved::save(s, spec.act, &y)?)
    } else {
        None
    };
    let cache = saved.zip(act).map(|(saved, act)| GcnCache {
        epoch: ctx.epoch,
        saved,
        act,
    });
    Ok((y, cache))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    s: &Stream,
    spec: &LayerSpec,
    seed: u64,
    p: &mut [Param],
    block: &Block,
    c: GcnCache,
    mut g: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    let adj_t = block.adj_t();
    let mut gx = match c.saved {
        Saved::Input(xd) => {
            // h = Â Z, Z = X W: gZ = Â^T g, gW = X^T gZ, gX = gZ W^T.
            let mut gz = Tensor::zeros(block.n_in(), spec.out_dim);
            s.spmm(adj_t, EdgeWeights::Stored, &g, &mut gz)?;
            xd.t_matmul_acc(s, &gz, &mut p[0].grad)?;
            if !need_input_grad {
                return Ok(None);
            }
            s.matmul(&gz, false, &p[0].value, true)?
        }
        Saved::Aggregated(ax) => {
            // h = (Â X) W: gW = (ÂX)^T g, gÂX = g W^T, gX = Â^T gÂX.
            s.gemm(1.0, &ax, true, &g, false, 1.0, &mut p[0].grad)?;
            if !need_input_grad {
                return Ok(None);
            }
            let gax = s.matmul(&g, false, &p[0].value, true)?;
            let mut gx = Tensor::zeros(block.n_in(), spec.in_dim);
            s.spmm(adj_t, EdgeWeights::Stored, &gax, &mut gx)?;
            gx
        }
    };
    dropout_backward(s, spec, seed, block, &mut gx, c.epoch)?;
    Ok(Some(gx))
}
