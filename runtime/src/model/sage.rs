//! GraphSAGE layer with the mean aggregator (Hamilton et al. 2017, as PyG's `SAGEConv`):
//! `act(mean_{j in N(i)} x_j · W_l + x_i · W_r + b)` on dropped-out inputs, computed as
//! `Ā (X W_l) + X_inner W_r + b` (the mean is linear, so transforming first is exact and
//! aggregates the narrower rows).
use super::{dropout_backward, ActSaved, Init, LayerArgs, LayerInput, LayerSpec, Param, StepCtx};
use crate::Result;
use std::borrow::Cow;
use trellis_gpu::{EdgeWeights, Tensor};

pub(crate) fn param_shapes(spec: &LayerSpec) -> Vec<(String, usize, usize, Init)> {
    let fan = Init::LinearUniform(spec.in_dim);
    vec![
        ("lin_l.weight".into(), spec.in_dim, spec.out_dim, fan),
        ("lin_l.bias".into(), 1, spec.out_dim, fan),
        ("lin_r.weight".into(), spec.in_dim, spec.out_dim, fan),
    ]
}

pub(crate) struct SageCache {
    epoch: u32,
    /// Dropped-out input rows.
    xd: LayerInput,
    act: ActSaved,
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
    let xd = LayerInput::dropped(x, s, spec, seed, block, ctx)?;
    let z = xd.matmul(s, &p[0].value)?;
    let mut h = s.zeros(block.n_out(), spec.out_dim)?;
    s.spmm(block.adj(), EdgeWeights::Stored, &z, &mut h)?;
    drop(z);
    xd.matmul_prefix_acc(s, block.n_out(), &p[2].value, &mut h)?;
    s.add_bias(&mut h, &p[1].value)?;
    s.activate(spec.act, &mut h)?;
    let y = h;
    let act = if ctx.train {
        Some(ActSaved::save(s, spec.act, &y)?)
    } else {
        None
    };
    let cache = ctx.train.then(|| SageCache {
        epoch: ctx.epoch,
        xd: xd.into_owned(),
        act: act.expect("saved in training"),
    });
    Ok((y, cache))
}

pub(crate) fn backward(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: SageCache,
    mut g: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    let mut gz = s.zeros(block.n_in(), spec.out_dim)?;
    s.spmm(block.adj_t(), EdgeWeights::Stored, &g, &mut gz)?;
    c.xd.t_matmul_acc(s, &gz, &mut p[0].grad)?;
    c.xd.t_matmul_acc(s, &g, &mut p[2].grad)?;
    if !need_input_grad {
        return Ok(None);
    }
    let mut gx = s.matmul(&gz, false, &p[0].value, true)?;
    let gself = s.matmul(&g, false, &p[2].value, true)?;
    s.add_rows_prefix(&gself, &mut gx)?;
    dropout_backward(s, spec, seed, block, &mut gx, c.epoch)?;
    Ok(Some(gx))
}
