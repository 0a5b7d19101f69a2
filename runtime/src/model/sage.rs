//! GraphSAGE layer with the mean aggregator (Hamilton et al. 2017, as PyG's `SAGEConv`):
//! `act(mean_{j in N(i)} x_j · W_l + x_i · W_r + b)` on dropped-out inputs.
use super::{dropout_backward, dropped_input, Init, LayerSpec, Param, StepCtx};
use crate::graph::Block;
use crate::Result;
use trellis_gpu::{EdgeWeights, Stream, Tensor};

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
    xd: Tensor,
    /// Mean of neighbour rows.
    mean: Tensor,
    y: Tensor,
}

pub(crate) fn forward(
    s: &Stream,
    spec: &LayerSpec,
    seed: u64,
    p: &[Param],
    block: &Block,
    x: &Tensor,
    ctx: StepCtx,
) -> Result<(Tensor, SageCache)> {
    let xd = dropped_input(s, spec, seed, block, x, ctx)?;
    let mut mean = Tensor::zeros(block.n_out(), spec.in_dim);
    s.spmm(block.adj(), EdgeWeights::Stored, &xd, &mut mean)?;
    let mut h = s.matmul(&mean, false, &p[0].value, false)?;
    s.gemm_prefix(1.0, &xd, block.n_out(), false, &p[2].value, false, 1.0, &mut h)?;
    s.add_bias(&mut h, &p[1].value)?;
    let y = s.activation(spec.act, &h)?;
    Ok((y.clone(), SageCache { epoch: ctx.epoch, xd, mean, y }))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    s: &Stream,
    spec: &LayerSpec,
    seed: u64,
    p: &mut [Param],
    block: &Block,
    c: SageCache,
    mut g: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    s.activation_backward_from_output(spec.act, &c.y, &mut g)?;
    s.add_column_sums(&g, &mut p[1].grad)?;
    s.gemm(1.0, &c.mean, true, &g, false, 1.0, &mut p[0].grad)?;
    s.gemm_prefix(1.0, &c.xd, block.n_out(), true, &g, false, 1.0, &mut p[2].grad)?;
    if !need_input_grad {
        return Ok(None);
    }
    let gmean = s.matmul(&g, false, &p[0].value, true)?;
    let mut gx = Tensor::zeros(block.n_in(), spec.in_dim);
    s.spmm(&block.adj_t().csr, EdgeWeights::Stored, &gmean, &mut gx)?;
    let gself = s.matmul(&g, false, &p[2].value, true)?;
    s.add_rows_prefix(&gself, &mut gx)?;
    dropout_backward(s, spec, seed, block, &mut gx, c.epoch)?;
    Ok(Some(gx))
}
