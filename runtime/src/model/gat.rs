//! GAT layer (Velickovic et al. 2018, as PyG's `GATConv`): per head `h`,
//! `alpha_ij = softmax_j(LeakyReLU(a_dst·W x_i + a_src·W x_j))` over `N(i) + {i}`, attention
//! dropout on `alpha`, `out_i = sum_j alpha_ij W x_j`; heads concatenated (hidden layers) or
//! averaged (output layer), plus bias, then the activation.
//!
//! The per-node attention terms `a·W x` are GEMMs with a block-diagonal `HD x H` matrix that
//! holds each head's attention vector, so forward and backward reuse the dense kernels.
use super::{dropout_backward, ActSaved, Init, LayerArgs, LayerInput, LayerSpec, Param, StepCtx};
use crate::Result;
use std::borrow::Cow;
use trellis_gpu::{Activation, EdgeWeights, Stream, Tensor};

const NEGATIVE_SLOPE: f32 = 0.2;
const ATTN_SITE: u16 = 1;

pub(crate) fn param_shapes(spec: &LayerSpec) -> Vec<(String, usize, usize, Init)> {
    let (h, d) = (spec.heads, spec.out_dim);
    let out_w = if spec.concat { h * d } else { d };
    vec![
        ("lin.weight".into(), spec.in_dim, h * d, Init::Glorot),
        ("att_src".into(), h, d, Init::GlorotFans(h, d)),
        ("att_dst".into(), h, d, Init::GlorotFans(h, d)),
        ("bias".into(), 1, out_w, Init::Zeros),
    ]
}

pub(crate) struct GatCache {
    epoch: u32,
    xd: LayerInput,
    wh: Tensor,
    /// LeakyReLU of the raw edge scores (`nnz x heads`).
    e_act: Tensor,
    /// Attention before and after dropout (`nnz x heads`).
    alpha: Tensor,
    alpha_d: Tensor,
    act: ActSaved,
}

/// The `HD x H` block-diagonal matrix with `att[h]` in column `h` (parameter-sized: built on
/// the host, in the stream's memory).
fn block_diag(s: &Stream, att: &Tensor) -> Result<Tensor> {
    let (h, d) = att.shape();
    let att = s.download(att)?;
    let mut m = vec![0.0; h * d * h];
    for k in 0..h {
        for j in 0..d {
            m[(k * d + j) * h + k] = att[k * d + j];
        }
    }
    Ok(s.upload_vec(m, h * d, h)?)
}

/// Adds the block-diagonal part of `full` (`HD x H`) into `grad` (`H x D`), on the host
/// (parameter-sized).
fn add_block_diag(s: &Stream, full: &Tensor, grad: &mut Tensor) -> Result<()> {
    let (h, d) = grad.shape();
    let full = s.download(full)?;
    let mut g = s.download(grad)?;
    for k in 0..h {
        for j in 0..d {
            g[k * d + j] += full[(k * d + j) * h + k];
        }
    }
    *grad = s.upload_vec(g, h, d)?;
    Ok(())
}

/// The `HD x D` matrix that averages `heads` column blocks of width `d` (`x S`), or spreads
/// one block over all heads with weight `1/heads` (`g S^T`).
fn head_mean(s: &Stream, heads: usize, d: usize) -> Result<Tensor> {
    let inv = 1.0 / heads as f32;
    let mut m = vec![0.0; heads * d * d];
    for k in 0..heads {
        for j in 0..d {
            m[(k * d + j) * d + j] = inv;
        }
    }
    Ok(s.upload_vec(m, heads * d, d)?)
}

fn ones(s: &Stream, rows: usize, cols: usize) -> Result<Tensor> {
    let mut t = s.zeros(rows, cols)?;
    s.fill(&mut t, 1.0)?;
    Ok(t)
}

pub(crate) fn forward(
    a: &LayerArgs<'_>,
    p: &[Param],
    x: Cow<'_, LayerInput>,
    ctx: StepCtx,
) -> Result<(Tensor, Option<GatCache>)> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    let (heads, d) = (spec.heads, spec.out_dim);
    let adj = block.adj();
    let xd = LayerInput::dropped(x, s, spec, seed, block, ctx)?;
    let wh = xd.matmul(s, &p[0].value)?;
    let s_src = s.matmul(&wh, false, &block_diag(s, &p[1].value)?, false)?;
    let mut s_dst = s.zeros(block.n_out(), heads)?;
    s.gemm_prefix(
        1.0,
        &wh,
        block.n_out(),
        false,
        &block_diag(s, &p[2].value)?,
        false,
        0.0,
        &mut s_dst,
    )?;
    let mut e_act = s.sddmm_add(adj, &s_dst, &s_src)?;
    let leaky = Activation::LeakyRelu {
        slope: NEGATIVE_SLOPE,
    };
    s.activate(leaky, &mut e_act)?;
    let alpha = s.edge_softmax(adj, heads, &e_act)?;
    let mut alpha_d = s.copy(&alpha)?;
    if ctx.train && spec.attn_dropout > 0.0 {
        let key = spec.dropout_key(seed, ctx.epoch, ATTN_SITE);
        s.edge_dropout(
            adj,
            &mut alpha_d,
            heads,
            block.inner_gids(),
            key,
            spec.attn_dropout,
        )?;
    }
    let mut agg = s.zeros(block.n_out(), heads * d)?;
    s.spmm(adj, EdgeWeights::PerHead(&alpha_d, heads), &wh, &mut agg)?;
    let mut h = if spec.concat {
        agg
    } else {
        s.matmul(&agg, false, &head_mean(s, heads, d)?, false)?
    };
    s.add_bias(&mut h, &p[3].value)?;
    s.activate(spec.act, &mut h)?;
    let y = h;
    let act = if ctx.train {
        Some(ActSaved::save(s, spec.act, &y)?)
    } else {
        None
    };
    let cache = ctx.train.then(|| GatCache {
        epoch: ctx.epoch,
        xd: xd.into_owned(),
        wh,
        e_act,
        alpha,
        alpha_d,
        act: act.expect("saved in training"),
    });
    Ok((y, cache))
}

pub(crate) fn backward(
    a: &LayerArgs<'_>,
    p: &mut [Param],
    c: GatCache,
    mut g: Tensor,
    need_input_grad: bool,
) -> Result<Option<Tensor>> {
    let LayerArgs {
        s,
        spec,
        seed,
        block,
    } = *a;
    let (heads, d) = (spec.heads, spec.out_dim);
    let adj = block.adj();
    let (adj_t, perm) = (block.adj_t(), block.adj_t_perm());
    c.act.backward(s, spec.act, &mut g)?;
    s.add_column_sums(&g, &mut p[3].grad)?;
    let gout = if spec.concat {
        g
    } else {
        s.matmul(&g, false, &head_mean(s, heads, d)?, true)?
    };
    // out = spmm(alpha_d, wh): gradients w.r.t. the attention and the transformed rows.
    let mut g_alpha = s.sddmm_dot(adj, heads, &gout, &c.wh)?;
    let alpha_d_t = s.gather_rows(&c.alpha_d, perm)?;
    let mut gwh = s.zeros(block.n_in(), heads * d)?;
    s.spmm(
        adj_t,
        EdgeWeights::PerHead(&alpha_d_t, heads),
        &gout,
        &mut gwh,
    )?;
    drop(gout);
    if spec.attn_dropout > 0.0 {
        let key = spec.dropout_key(seed, c.epoch, ATTN_SITE);
        s.edge_dropout(
            adj,
            &mut g_alpha,
            heads,
            block.inner_gids(),
            key,
            spec.attn_dropout,
        )?;
    }
    let mut g_e = s.edge_softmax_backward(adj, heads, &c.alpha, &g_alpha)?;
    let leaky = Activation::LeakyRelu {
        slope: NEGATIVE_SLOPE,
    };
    s.activation_backward_from_output(leaky, &c.e_act, &mut g_e)?;
    // e = s_dst[row] + s_src[col]: sum the edge gradients per row and per column.
    let mut g_s_dst = s.zeros(block.n_out(), heads)?;
    s.spmm(
        adj,
        EdgeWeights::PerHead(&g_e, heads),
        &ones(s, block.n_in(), heads)?,
        &mut g_s_dst,
    )?;
    let g_e_t = s.gather_rows(&g_e, perm)?;
    let mut g_s_src = s.zeros(block.n_in(), heads)?;
    s.spmm(
        adj_t,
        EdgeWeights::PerHead(&g_e_t, heads),
        &ones(s, block.n_out(), heads)?,
        &mut g_s_src,
    )?;
    // s_src = wh A_src, s_dst = wh[:n_out] A_dst.
    let ga_src = s.matmul(&c.wh, true, &g_s_src, false)?;
    add_block_diag(s, &ga_src, &mut p[1].grad)?;
    let mut ga_dst = s.zeros(heads * d, heads)?;
    s.gemm_prefix(
        1.0,
        &c.wh,
        block.n_out(),
        true,
        &g_s_dst,
        false,
        0.0,
        &mut ga_dst,
    )?;
    add_block_diag(s, &ga_dst, &mut p[2].grad)?;
    s.gemm(
        1.0,
        &g_s_src,
        false,
        &block_diag(s, &p[1].value)?,
        true,
        1.0,
        &mut gwh,
    )?;
    let gwh_dst = s.matmul(&g_s_dst, false, &block_diag(s, &p[2].value)?, true)?;
    s.add_rows_prefix(&gwh_dst, &mut gwh)?;
    // wh = xd W.
    c.xd.t_matmul_acc(s, &gwh, &mut p[0].grad)?;
    if !need_input_grad {
        return Ok(None);
    }
    let mut gx = s.matmul(&gwh, false, &p[0].value, true)?;
    dropout_backward(s, spec, seed, block, &mut gx, c.epoch)?;
    Ok(Some(gx))
}
