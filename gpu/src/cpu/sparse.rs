//! Sparse kernels over CSR: SpMM, SDDMM, edge softmax, row gather and scatter-add.
//!
//! All are row-parallel with a sequential inner loop per output row, so results are
//! bit-identical for any thread count.
use super::row_chunk;
use crate::Csr;
use rayon::prelude::*;

/// `out[i, h*d..(h+1)*d] = sum_e w[e, h] * x[col(e), h*d..(h+1)*d]` over the entries `e` of row
/// `i`. `x` is `n_cols x width`, `out` is `n_rows x width`, `width = heads * d`. Without weights
/// every entry weighs 1 (and `heads` only splits the width).
pub fn spmm(csr: &Csr, weights: Option<&[f32]>, heads: usize, x: &[f32], width: usize, out: &mut [f32]) {
    assert!(heads >= 1 && width % heads == 0, "spmm: width {width} not divisible by {heads} heads");
    assert_eq!(x.len(), csr.n_cols() * width, "spmm: x has the wrong length");
    assert_eq!(out.len(), csr.n_rows() * width, "spmm: out has the wrong length");
    if let Some(w) = weights {
        assert_eq!(w.len(), csr.nnz() * heads, "spmm: weights have the wrong length");
    }
    if width == 0 {
        return;
    }
    let d = width / heads;
    let indptr = csr.indptr();
    let indices = csr.indices();
    let chunk = row_chunk(csr.n_rows(), width);
    out.par_chunks_mut(chunk * width).enumerate().for_each(|(c, block)| {
        for (r, orow) in block.chunks_mut(width).enumerate() {
            let i = c * chunk + r;
            orow.iter_mut().for_each(|v| *v = 0.0);
            for e in indptr[i]..indptr[i + 1] {
                let j = indices[e] as usize;
                let xrow = &x[j * width..(j + 1) * width];
                match weights {
                    None => orow.iter_mut().zip(xrow).for_each(|(o, &v)| *o += v),
                    Some(w) if heads == 1 => {
                        let we = w[e];
                        orow.iter_mut().zip(xrow).for_each(|(o, &v)| *o += we * v);
                    }
                    Some(w) => {
                        for h in 0..heads {
                            let we = w[e * heads + h];
                            let o = &mut orow[h * d..(h + 1) * d];
                            o.iter_mut().zip(&xrow[h * d..(h + 1) * d]).for_each(|(o, &v)| *o += we * v);
                        }
                    }
                }
            }
        }
    });
}

/// Sampled dense-dense product: `out[e, h] = <a[row(e), h-block], b[col(e), h-block]>`.
/// `a` is `n_rows x width`, `b` is `n_cols x width`, `out` has `nnz * heads` entries.
pub fn sddmm_dot(csr: &Csr, heads: usize, a: &[f32], b: &[f32], width: usize, out: &mut [f32]) {
    assert!(heads >= 1 && width % heads == 0, "sddmm: width not divisible by heads");
    assert_eq!(a.len(), csr.n_rows() * width, "sddmm: a has the wrong length");
    assert_eq!(b.len(), csr.n_cols() * width, "sddmm: b has the wrong length");
    assert_eq!(out.len(), csr.nnz() * heads, "sddmm: out has the wrong length");
    let d = width / heads;
    let indptr = csr.indptr();
    let indices = csr.indices();
    for_each_row_edges(csr, heads, out, |i, e0, seg| {
        let arow = &a[i * width..(i + 1) * width];
        for (k, e) in (indptr[i]..indptr[i + 1]).enumerate() {
            let j = indices[e] as usize;
            let brow = &b[j * width..(j + 1) * width];
            for h in 0..heads {
                let s = h * d..(h + 1) * d;
                seg[k * heads + h] = arow[s.clone()].iter().zip(&brow[s]).map(|(x, y)| x * y).sum();
            }
        }
        let _ = e0;
    });
}

/// Edge scores from per-node terms: `out[e, h] = left[row(e), h] + right[col(e), h]`
/// (GAT's `a_l . Wh_i + a_r . Wh_j`). `left` is `n_rows x heads`, `right` is `n_cols x heads`.
pub fn sddmm_add(csr: &Csr, heads: usize, left: &[f32], right: &[f32], out: &mut [f32]) {
    assert_eq!(left.len(), csr.n_rows() * heads, "sddmm_add: left has the wrong length");
    assert_eq!(right.len(), csr.n_cols() * heads, "sddmm_add: right has the wrong length");
    assert_eq!(out.len(), csr.nnz() * heads, "sddmm_add: out has the wrong length");
    let indptr = csr.indptr();
    let indices = csr.indices();
    for_each_row_edges(csr, heads, out, |i, _, seg| {
        for (k, e) in (indptr[i]..indptr[i + 1]).enumerate() {
            let j = indices[e] as usize;
            for h in 0..heads {
                seg[k * heads + h] = left[i * heads + h] + right[j * heads + h];
            }
        }
    });
}

/// Softmax of edge scores over each row's entries, per head. Rows with no entry produce nothing.
pub fn edge_softmax(csr: &Csr, heads: usize, scores: &[f32], out: &mut [f32]) {
    assert_eq!(scores.len(), csr.nnz() * heads, "edge_softmax: scores have the wrong length");
    assert_eq!(out.len(), scores.len(), "edge_softmax: out has the wrong length");
    for_each_row_edges(csr, heads, out, |_, e0, seg| {
        let deg = seg.len() / heads.max(1);
        let src = &scores[e0 * heads..e0 * heads + seg.len()];
        for h in 0..heads {
            let mut mx = f32::NEG_INFINITY;
            for k in 0..deg {
                mx = mx.max(src[k * heads + h]);
            }
            let mut sum = 0.0f32;
            for k in 0..deg {
                let v = (src[k * heads + h] - mx).exp();
                seg[k * heads + h] = v;
                sum += v;
            }
            let inv = 1.0 / sum;
            for k in 0..deg {
                seg[k * heads + h] *= inv;
            }
        }
    });
}

/// Backward of [`edge_softmax`]: `gs[e] = alpha[e] * (g[e] - sum_{e' in row} alpha[e'] g[e'])`.
pub fn edge_softmax_backward(csr: &Csr, heads: usize, alpha: &[f32], grad: &[f32], out: &mut [f32]) {
    assert_eq!(alpha.len(), csr.nnz() * heads, "edge_softmax_backward: alpha length");
    assert_eq!(grad.len(), alpha.len(), "edge_softmax_backward: grad length");
    assert_eq!(out.len(), alpha.len(), "edge_softmax_backward: out length");
    for_each_row_edges(csr, heads, out, |_, e0, seg| {
        let deg = seg.len() / heads.max(1);
        let a = &alpha[e0 * heads..e0 * heads + seg.len()];
        let g = &grad[e0 * heads..e0 * heads + seg.len()];
        for h in 0..heads {
            let mut dot = 0.0f32;
            for k in 0..deg {
                dot += a[k * heads + h] * g[k * heads + h];
            }
            for k in 0..deg {
                let idx = k * heads + h;
                seg[idx] = a[idx] * (g[idx] - dot);
            }
        }
    });
}

/// Runs `f(row, first_entry, out_segment)` for every row in parallel, where `out_segment` is
/// the row's `degree * heads` slice of a per-entry output.
fn for_each_row_edges(
    csr: &Csr,
    heads: usize,
    out: &mut [f32],
    f: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    let indptr = csr.indptr();
    // Split `out` into per-row segments, then process blocks of rows in parallel.
    let mut segs: Vec<&mut [f32]> = Vec::with_capacity(csr.n_rows());
    let mut rest = out;
    for i in 0..csr.n_rows() {
        let (s, r) = rest.split_at_mut((indptr[i + 1] - indptr[i]) * heads);
        segs.push(s);
        rest = r;
    }
    let chunk = row_chunk(csr.n_rows(), 8 * heads);
    segs.par_chunks_mut(chunk).enumerate().for_each(|(c, block)| {
        for (r, seg) in block.iter_mut().enumerate() {
            let i = c * chunk + r;
            f(i, indptr[i], seg);
        }
    });
}

/// `out[r] = x[idx[r]]` for every r: gathers rows of a `? x width` matrix.
pub fn gather_rows(x: &[f32], width: usize, idx: &[u32], out: &mut [f32]) {
    assert_eq!(out.len(), idx.len() * width, "gather_rows: out has the wrong length");
    if width == 0 {
        return;
    }
    let rows = x.len() / width;
    assert!(idx.iter().all(|&i| (i as usize) < rows), "gather_rows: index out of range");
    let chunk = row_chunk(idx.len(), width);
    out.par_chunks_mut(chunk * width).enumerate().for_each(|(c, block)| {
        for (r, orow) in block.chunks_mut(width).enumerate() {
            let i = idx[c * chunk + r] as usize;
            orow.copy_from_slice(&x[i * width..(i + 1) * width]);
        }
    });
}

/// `out[idx[r]] += src[r]` for every r, in ascending r for each target row (deterministic).
/// Parallel over column blocks, so any thread count gives the same bits.
pub fn scatter_add_rows(src: &[f32], width: usize, idx: &[u32], out: &mut [f32]) {
    assert_eq!(src.len(), idx.len() * width, "scatter_add_rows: src has the wrong length");
    if width == 0 {
        return;
    }
    let rows = out.len() / width;
    assert!(idx.iter().all(|&i| (i as usize) < rows), "scatter_add_rows: index out of range");
    const BLOCK: usize = 64;
    let nblocks = width.div_ceil(BLOCK);
    if nblocks == 1 || idx.len() * width < 1 << 16 {
        for (r, &t) in idx.iter().enumerate() {
            let t = t as usize;
            out[t * width..(t + 1) * width]
                .iter_mut()
                .zip(&src[r * width..(r + 1) * width])
                .for_each(|(o, &v)| *o += v);
        }
        return;
    }
    // Each column block is owned by one task; wrap the pointer so tasks can share it.
    struct Out(*mut f32);
    // SAFETY: tasks write disjoint column ranges of `out`, see below.
    unsafe impl Sync for Out {}
    let base = Out(out.as_mut_ptr());
    (0..nblocks).into_par_iter().for_each(|b| {
        let lo = b * BLOCK;
        let hi = (lo + BLOCK).min(width);
        let base = &base;
        for (r, &t) in idx.iter().enumerate() {
            let t = t as usize;
            for c in lo..hi {
                // SAFETY: `t < rows` was checked above, so `t * width + c` is in bounds, and
                // column `c` belongs to this task's block only: no two tasks touch one element.
                unsafe { *base.0.add(t * width + c) += src[r * width + c] };
            }
        }
    });
}
