//! Dense elementwise kernels: bias, activations, dropout, axpy.
use super::row_chunk;
use crate::ops::Activation;
use crate::rng::{DropoutKey, Philox4x32};
use rayon::prelude::*;

/// `x[i, :] += bias` for every row.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    let w = bias.len();
    if w == 0 {
        return;
    }
    assert_eq!(x.len() % w, 0, "add_bias: width mismatch");
    let chunk = row_chunk(x.len() / w, w);
    x.par_chunks_mut(chunk * w).for_each(|block| {
        for row in block.chunks_mut(w) {
            row.iter_mut().zip(bias).for_each(|(v, &b)| *v += b);
        }
    });
}

/// Column sums of a `rows x width` matrix (the bias gradient), summed in row order.
pub fn column_sums(g: &[f32], width: usize, out: &mut [f32]) {
    assert_eq!(out.len(), width, "column_sums: out has the wrong length");
    if width == 0 {
        return;
    }
    assert_eq!(g.len() % width, 0, "column_sums: width mismatch");
    const BLOCK: usize = 16;
    out.par_chunks_mut(BLOCK).enumerate().for_each(|(b, o)| {
        let lo = b * BLOCK;
        let hi = lo + o.len();
        o.iter_mut().for_each(|v| *v = 0.0);
        for row in g.chunks(width) {
            o.iter_mut().zip(&row[lo..hi]).for_each(|(v, &x)| *v += x);
        }
    });
}

/// `y = act(x)` elementwise.
pub fn activation(act: Activation, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "activation: length mismatch");
    y.par_chunks_mut(16_384).zip(x.par_chunks(16_384)).for_each(|(y, x)| {
        for (o, &v) in y.iter_mut().zip(x) {
            *o = act.apply(v);
        }
    });
}

/// `gx = gy * act'(x)` elementwise (derivative taken at the pre-activation input `x`).
pub fn activation_backward(act: Activation, x: &[f32], gy: &[f32], gx: &mut [f32]) {
    assert_eq!(x.len(), gy.len(), "activation_backward: length mismatch");
    assert_eq!(x.len(), gx.len(), "activation_backward: length mismatch");
    gx.par_chunks_mut(16_384)
        .zip(x.par_chunks(16_384).zip(gy.par_chunks(16_384)))
        .for_each(|(gx, (x, gy))| {
            for ((o, &v), &g) in gx.iter_mut().zip(x).zip(gy) {
                *o = g * act.derivative(v);
            }
        });
}

/// Inverted dropout in place: each element of row `r` (global node id `gids[r]`) is kept with
/// probability `1 - p` and scaled by `1 / (1 - p)`, else zeroed. The mask is a pure function of
/// `(key, gid, column)`, so applying it again to a gradient is the backward pass.
pub fn dropout(x: &mut [f32], width: usize, gids: &[u32], key: DropoutKey, p: f32) {
    if p <= 0.0 || width == 0 {
        return;
    }
    assert_eq!(x.len(), gids.len() * width, "dropout: one global id per row is needed");
    let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
    let threshold = keep_threshold(p);
    let g = Philox4x32::new(key.seed);
    let chunk = row_chunk(gids.len(), width);
    x.par_chunks_mut(chunk * width).enumerate().for_each(|(c, block)| {
        for (r, row) in block.chunks_mut(width).enumerate() {
            let gid = gids[c * chunk + r];
            for (b, cols) in row.chunks_mut(4).enumerate() {
                let u = g.block(key.counter(gid, b as u32));
                for (v, &u) in cols.iter_mut().zip(&u) {
                    *v = if u >= threshold { *v * scale } else { 0.0 };
                }
            }
        }
    });
}

/// Dropout over a row's entries (GAT attention dropout): entry `k` of row `r` is kept if the
/// draw for `(gids[r], k)` passes. `vals` holds `heads` values per entry.
pub fn edge_dropout(
    indptr: &[usize],
    vals: &mut [f32],
    heads: usize,
    gids: &[u32],
    key: DropoutKey,
    p: f32,
) {
    if p <= 0.0 {
        return;
    }
    assert_eq!(indptr.len(), gids.len() + 1, "edge_dropout: one global id per row is needed");
    assert_eq!(vals.len(), indptr[gids.len()] * heads, "edge_dropout: values length");
    let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
    let threshold = keep_threshold(p);
    let g = Philox4x32::new(key.seed);
    // Sequential over rows; the per-row work is tiny and the mask stays a pure function.
    for (r, &gid) in gids.iter().enumerate() {
        let seg = &mut vals[indptr[r] * heads..indptr[r + 1] * heads];
        for (b, cols) in seg.chunks_mut(4).enumerate() {
            let u = g.block(key.counter(gid, b as u32));
            for (v, &u) in cols.iter_mut().zip(&u) {
                *v = if u >= threshold { *v * scale } else { 0.0 };
            }
        }
    }
}

fn keep_threshold(p: f32) -> u32 {
    ((p.clamp(0.0, 1.0) as f64) * 4_294_967_296.0).min(u32::MAX as f64) as u32
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    y.par_chunks_mut(16_384).zip(x.par_chunks(16_384)).for_each(|(y, x)| {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x);
    });
}
