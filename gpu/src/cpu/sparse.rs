//! Sparse kernels over CSR: SpMM, SDDMM, edge softmax, row gather and scatter-add.
//!
//! Every output element is summed sequentially, in a fixed order, by one task (the kernels are
//! row-parallel, scatter-add is column-block parallel), so results are bit-identical for any
//! thread count. The hot loops are also compiled for AVX2 and picked at run time; both builds
//! perform the same operations in the same order (never a fused multiply-add), so the bits do
//! not depend on the CPU's SIMD width either.
use super::row_chunk;
use crate::Csr;
use rayon::prelude::*;

/// `out[i, h*d..(h+1)*d] = sum_e w[e, h] * x[col(e), h*d..(h+1)*d]` over the entries `e` of row
/// `i`. `x` is `n_cols x width`, `out` is `n_rows x width`, `width = heads * d`. Without weights
/// every entry weighs 1 (and `heads` only splits the width).
///
/// Every output element is summed from 0 in CSR order by one task, with a separate multiply
/// and add (never a fused multiply-add), so the bits do not depend on the thread count nor on
/// the SIMD width the CPU offers.
pub fn spmm(
    csr: &Csr,
    weights: Option<&[f32]>,
    heads: usize,
    x: &[f32],
    width: usize,
    out: &mut [f32],
) {
    spmm_range(csr, weights, heads, x, width, 0..csr.n_rows(), out)
}

/// [`spmm`] for the output rows `rows` only: `out` holds those rows (`rows.len() x width`).
/// Each row is computed exactly as [`spmm`] computes it, so pieces give the same bits.
pub fn spmm_range(
    csr: &Csr,
    weights: Option<&[f32]>,
    heads: usize,
    x: &[f32],
    width: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    assert!(
        heads >= 1 && width % heads == 0,
        "spmm: width {width} not divisible by {heads} heads"
    );
    assert_eq!(
        x.len(),
        csr.n_cols() * width,
        "spmm: x has the wrong length"
    );
    assert!(rows.end <= csr.n_rows(), "spmm: rows out of range");
    assert_eq!(
        out.len(),
        rows.len() * width,
        "spmm: out has the wrong length"
    );
    if let Some(w) = weights {
        assert_eq!(
            w.len(),
            csr.nnz() * heads,
            "spmm: weights have the wrong length"
        );
    }
    if width == 0 {
        return;
    }
    let args = SpmmArgs {
        indptr: csr.indptr(),
        indices: csr.indices(),
        weights,
        heads,
        x,
        width,
    };
    let chunk = row_chunk(rows.len(), width);
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    out.par_chunks_mut(chunk * width)
        .enumerate()
        .for_each(|(c, block)| {
            let first = rows.start + c * chunk;
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU supports AVX2 (checked just above).
                unsafe { spmm_rows_avx2(&args, first, block) };
                return;
            }
            spmm_rows(&args, first, block);
        });
}

/// The operands of one [`spmm`].
struct SpmmArgs<'a> {
    indptr: &'a [usize],
    indices: &'a [u32],
    weights: Option<&'a [f32]>,
    heads: usize,
    x: &'a [f32],
    width: usize,
}

/// Columns accumulated in registers at once: 8 AVX2 (or 16 SSE) registers.
const SPMM_TILE: usize = 64;
/// How many entries ahead the `x` rows are prefetched.
const SPMM_PREFETCH: usize = 8;

/// [`spmm_rows`] compiled for AVX2 (wider loads and adds; same operations, same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn spmm_rows_avx2(a: &SpmmArgs<'_>, first: usize, block: &mut [f32]) {
    spmm_rows(a, first, block)
}

/// Output rows `first..` of `block`. Small power-of-two head widths take tiles spanning several
/// heads; otherwise each row is cut into per-head segments (one segment without per-head
/// weights) and each segment into column tiles summed over the row's entries in registers.
#[inline(always)]
fn spmm_rows(a: &SpmmArgs<'_>, first: usize, block: &mut [f32]) {
    if a.weights.is_some() && a.heads > 1 {
        match a.width / a.heads {
            1 => return spmm_rows_heads::<1>(a, first, block),
            2 => return spmm_rows_heads::<2>(a, first, block),
            4 => return spmm_rows_heads::<4>(a, first, block),
            8 => return spmm_rows_heads::<8>(a, first, block),
            16 => return spmm_rows_heads::<16>(a, first, block),
            32 => return spmm_rows_heads::<32>(a, first, block),
            _ => {}
        }
    }
    let width = a.width;
    // Without per-head weights the whole row is one segment.
    let (segs, d) = if a.weights.is_some() && a.heads > 1 {
        (a.heads, width / a.heads)
    } else {
        (1, width)
    };
    for (r, orow) in block.chunks_exact_mut(width).enumerate() {
        let (e0, e1) = (a.indptr[first + r], a.indptr[first + r + 1]);
        prefetch_ahead(a, e0, e1);
        for h in 0..segs {
            let col0 = h * d;
            let seg = &mut orow[col0..col0 + d];
            let mut c = 0;
            while c + SPMM_TILE <= d {
                tile::<SPMM_TILE>(a, e0, e1, h, col0 + c, &mut seg[c..c + SPMM_TILE]);
                c += SPMM_TILE;
            }
            if c + 32 <= d {
                tile::<32>(a, e0, e1, h, col0 + c, &mut seg[c..c + 32]);
                c += 32;
            }
            if c + 16 <= d {
                tile::<16>(a, e0, e1, h, col0 + c, &mut seg[c..c + 16]);
                c += 16;
            }
            if c + 8 <= d {
                tile::<8>(a, e0, e1, h, col0 + c, &mut seg[c..c + 8]);
                c += 8;
            }
            while c < d {
                tile::<1>(a, e0, e1, h, col0 + c, &mut seg[c..c + 1]);
                c += 1;
            }
        }
    }
}

/// [`spmm_rows`] for per-head weights with `D` columns per head (a power of two below 64).
#[inline(always)]
fn spmm_rows_heads<const D: usize>(a: &SpmmArgs<'_>, first: usize, block: &mut [f32]) {
    let width = a.width;
    for (r, orow) in block.chunks_exact_mut(width).enumerate() {
        let (e0, e1) = (a.indptr[first + r], a.indptr[first + r + 1]);
        prefetch_ahead(a, e0, e1);
        let mut c = 0;
        while c + SPMM_TILE <= width {
            tile_heads::<D, SPMM_TILE>(a, e0, e1, c, &mut orow[c..c + SPMM_TILE]);
            c += SPMM_TILE;
        }
        if D <= 16 {
            while c + 16 <= width {
                tile_heads::<D, 16>(a, e0, e1, c, &mut orow[c..c + 16]);
                c += 16;
            }
        }
        while c < width {
            tile_heads::<D, D>(a, e0, e1, c, &mut orow[c..c + D]);
            c += D;
        }
    }
}

/// Prefetches the `x` rows of the entries [`SPMM_PREFETCH`] ahead of row `e0..e1`'s (the tail of
/// this row and the head of the next ones).
#[inline(always)]
fn prefetch_ahead(a: &SpmmArgs<'_>, e0: usize, e1: usize) {
    let nnz = a.indices.len();
    prefetch_rows(
        a.x,
        a.width,
        &a.indices[(e0 + SPMM_PREFETCH).min(nnz)..(e1 + SPMM_PREFETCH).min(nnz)],
    );
}

/// Like [`tile`], over `T / D` whole heads starting at column `col0` (a multiple of `D`).
#[inline(always)]
fn tile_heads<const D: usize, const T: usize>(
    a: &SpmmArgs<'_>,
    e0: usize,
    e1: usize,
    col0: usize,
    out: &mut [f32],
) {
    let w = a.weights.expect("per-head tiles need weights");
    let (heads, h0) = (a.heads, col0 / D);
    let mut acc = [0.0f32; T];
    for (k, &j) in a.indices[e0..e1].iter().enumerate() {
        let ws = &w[(e0 + k) * heads + h0..][..T / D];
        let xs: &[f32; T] = a.x[j as usize * a.width + col0..][..T].try_into().unwrap();
        for (hh, &we) in ws.iter().enumerate() {
            for t in 0..D {
                acc[hh * D + t] += we * xs[hh * D + t];
            }
        }
    }
    out.copy_from_slice(&acc);
}

/// `out[t] = sum_{e in e0..e1} w[e, h] * x[col(e), col0 + t]` for `t < T`, summed in entry order.
#[inline(always)]
fn tile<const T: usize>(
    a: &SpmmArgs<'_>,
    e0: usize,
    e1: usize,
    h: usize,
    col0: usize,
    out: &mut [f32],
) {
    let mut acc = [0.0f32; T];
    let idx = &a.indices[e0..e1];
    match a.weights {
        None => {
            for &j in idx {
                let xs: &[f32; T] = a.x[j as usize * a.width + col0..][..T].try_into().unwrap();
                for t in 0..T {
                    acc[t] += xs[t];
                }
            }
        }
        Some(w) => {
            let heads = a.heads;
            for (k, &j) in idx.iter().enumerate() {
                let we = w[(e0 + k) * heads + h];
                let xs: &[f32; T] = a.x[j as usize * a.width + col0..][..T].try_into().unwrap();
                for t in 0..T {
                    acc[t] += we * xs[t];
                }
            }
        }
    }
    out.copy_from_slice(&acc);
}

/// Hints the CPU to fetch rows `idx` of the row-major `? x width` matrix `x` into cache.
#[inline(always)]
fn prefetch_rows(x: &[f32], width: usize, idx: &[u32]) {
    for &j in idx {
        prefetch_span(
            x[j as usize * width..(j as usize + 1) * width].as_ptr(),
            width,
        );
    }
}

/// Sampled dense-dense product: `out[e, h] = <a[row(e), h-block], b[col(e), h-block]>`.
/// `a` is `n_rows x width`, `b` is `n_cols x width`, `out` has `nnz * heads` entries.
///
/// Each dot product is summed in a fixed order, one task per row, so the bits do not depend on
/// the thread count nor on the CPU's SIMD width: eight partial sums, lane `l` adding the
/// products `t = l, l + 8, ...` of the whole 8-blocks, combined as
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, then the tail products in order.
pub fn sddmm_dot(csr: &Csr, heads: usize, a: &[f32], b: &[f32], width: usize, out: &mut [f32]) {
    assert!(
        heads >= 1 && width % heads == 0,
        "sddmm: width not divisible by heads"
    );
    assert_eq!(
        a.len(),
        csr.n_rows() * width,
        "sddmm: a has the wrong length"
    );
    assert_eq!(
        b.len(),
        csr.n_cols() * width,
        "sddmm: b has the wrong length"
    );
    assert_eq!(
        out.len(),
        csr.nnz() * heads,
        "sddmm: out has the wrong length"
    );
    let d = width / heads;
    let indices = csr.indices();
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    for_each_row_edges(csr, heads, out, |i, e0, seg| {
        let arow = &a[i * width..(i + 1) * width];
        let cols = &indices[e0..e0 + seg.len() / heads];
        let nnz = indices.len();
        prefetch_rows(
            b,
            width,
            &indices[(e0 + SPMM_PREFETCH).min(nnz)..(e0 + cols.len() + SPMM_PREFETCH).min(nnz)],
        );
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU supports AVX2 (checked above).
            unsafe { sddmm_dot_row_avx2(arow, b, cols, heads, d, seg) };
            return;
        }
        sddmm_dot_row(arow, b, cols, heads, d, seg);
    });
}

/// [`sddmm_dot_row`] with [`dot`] in AVX2 intrinsics (same operations in the same order, so the
/// same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sddmm_dot_row_avx2(
    arow: &[f32],
    b: &[f32],
    cols: &[u32],
    heads: usize,
    d: usize,
    seg: &mut [f32],
) {
    let width = arow.len();
    for (k, &j) in cols.iter().enumerate() {
        let brow = &b[j as usize * width..(j as usize + 1) * width];
        for h in 0..heads {
            // SAFETY: AVX2 is enabled on this function.
            seg[k * heads + h] =
                unsafe { dot_avx2(&arow[h * d..(h + 1) * d], &brow[h * d..(h + 1) * d]) };
        }
    }
}

/// [`dot`] with 256-bit vectors: one register holds the eight partial sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_avx2(x: &[f32], y: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(y.len());
    let whole = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < whole {
        // SAFETY: `i + 8 <= n`, so both 8-float loads are in bounds.
        let (xv, yv) = unsafe {
            (
                _mm256_loadu_ps(x.as_ptr().add(i)),
                _mm256_loadu_ps(y.as_ptr().add(i)),
            )
        };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(xv, yv));
        i += 8;
    }
    // m = [l0 + l4, l1 + l5, l2 + l6, l3 + l7], then (m0 + m2) + (m1 + m3).
    let m = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s2 = _mm_add_ps(m, _mm_movehl_ps(m, m));
    let mut s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)));
    for t in whole..n {
        s += x[t] * y[t];
    }
    s
}

/// The per-head dot products of one row of `a` with the rows `cols` of `b`.
fn sddmm_dot_row(arow: &[f32], b: &[f32], cols: &[u32], heads: usize, d: usize, seg: &mut [f32]) {
    let width = arow.len();
    for (k, &j) in cols.iter().enumerate() {
        let brow = &b[j as usize * width..(j as usize + 1) * width];
        for h in 0..heads {
            seg[k * heads + h] = dot(&arow[h * d..(h + 1) * d], &brow[h * d..(h + 1) * d]);
        }
    }
}

/// `sum_t x[t] * y[t]` in a fixed order: lane `l` of eight partial sums adds the products
/// `t = l, l + 8, l + 16, ...` of the whole 8-blocks; the lanes are combined as a SIMD
/// horizontal sum does, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, then the tail
/// products are added in order.
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (xb, yb) = (x.chunks_exact(8), y.chunks_exact(8));
    let (xt, yt) = (xb.remainder(), yb.remainder());
    for (xs, ys) in xb.zip(yb) {
        for l in 0..8 {
            acc[l] += xs[l] * ys[l];
        }
    }
    let m = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    let mut s = (m[0] + m[2]) + (m[1] + m[3]);
    for (&p, &q) in xt.iter().zip(yt) {
        s += p * q;
    }
    s
}

/// Edge scores from per-node terms: `out[e, h] = left[row(e), h] + right[col(e), h]`
/// (GAT's `a_l . Wh_i + a_r . Wh_j`). `left` is `n_rows x heads`, `right` is `n_cols x heads`.
pub fn sddmm_add(csr: &Csr, heads: usize, left: &[f32], right: &[f32], out: &mut [f32]) {
    assert_eq!(
        left.len(),
        csr.n_rows() * heads,
        "sddmm_add: left has the wrong length"
    );
    assert_eq!(
        right.len(),
        csr.n_cols() * heads,
        "sddmm_add: right has the wrong length"
    );
    assert_eq!(
        out.len(),
        csr.nnz() * heads,
        "sddmm_add: out has the wrong length"
    );
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
    assert_eq!(
        scores.len(),
        csr.nnz() * heads,
        "edge_softmax: scores have the wrong length"
    );
    assert_eq!(
        out.len(),
        scores.len(),
        "edge_softmax: out has the wrong length"
    );
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
pub fn edge_softmax_backward(
    csr: &Csr,
    heads: usize,
    alpha: &[f32],
    grad: &[f32],
    out: &mut [f32],
) {
    assert_eq!(
        alpha.len(),
        csr.nnz() * heads,
        "edge_softmax_backward: alpha length"
    );
    assert_eq!(
        grad.len(),
        alpha.len(),
        "edge_softmax_backward: grad length"
    );
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
    let mut segs = super::split_rows(out, indptr, heads);
    let chunk = row_chunk(csr.n_rows(), 8 * heads);
    segs.par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(c, block)| {
            for (r, seg) in block.iter_mut().enumerate() {
                let i = c * chunk + r;
                f(i, indptr[i], seg);
            }
        });
}

/// `out[r] = x[idx[r]]` for every r: gathers rows of a `? x width` matrix.
pub fn gather_rows(x: &[f32], width: usize, idx: &[u32], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        idx.len() * width,
        "gather_rows: out has the wrong length"
    );
    if width == 0 {
        return;
    }
    let rows = x.len() / width;
    assert!(
        idx.iter().all(|&i| (i as usize) < rows),
        "gather_rows: index out of range"
    );
    let chunk = row_chunk(idx.len(), width);
    out.par_chunks_mut(chunk * width)
        .enumerate()
        .for_each(|(c, block)| {
            for (r, orow) in block.chunks_mut(width).enumerate() {
                let i = idx[c * chunk + r] as usize;
                orow.copy_from_slice(&x[i * width..(i + 1) * width]);
            }
        });
}

/// `out[idx[r]] += src[r]` for every r, in ascending r for each target row (deterministic).
/// Parallel over column blocks, so any thread count gives the same bits.
pub fn scatter_add_rows(src: &[f32], width: usize, idx: &[u32], out: &mut [f32]) {
    assert_eq!(
        src.len(),
        idx.len() * width,
        "scatter_add_rows: src has the wrong length"
    );
    if width == 0 {
        return;
    }
    let rows = out.len() / width;
    assert!(
        idx.iter().all(|&i| (i as usize) < rows),
        "scatter_add_rows: index out of range"
    );
    const BLOCK: usize = 64;
    const AHEAD: usize = 8;
    let nblocks = width.div_ceil(BLOCK);
    if nblocks == 1 || idx.len() * width < 1 << 16 {
        for (r, &t) in idx.iter().enumerate() {
            if let Some(&next) = idx.get(r + AHEAD) {
                prefetch_span(out[next as usize * width..].as_ptr(), width);
            }
            let t = t as usize;
            out[t * width..(t + 1) * width]
                .iter_mut()
                .zip(&src[r * width..(r + 1) * width])
                .for_each(|(o, &v)| *o += v);
        }
        return;
    }
    // Each column block is owned by one task; wrap the pointer so tasks can share it.
    struct Out(*mut f32, usize);
    // SAFETY: tasks write disjoint column ranges of `out`, see below.
    unsafe impl Sync for Out {}
    let base = Out(out.as_mut_ptr(), out.len());
    (0..nblocks).into_par_iter().for_each(|b| {
        let lo = b * BLOCK;
        let n = BLOCK.min(width - lo);
        let base = &base;
        for (r, &t) in idx.iter().enumerate() {
            if let Some(&next) = idx.get(r + AHEAD) {
                prefetch_span(base.0.wrapping_add(next as usize * width + lo), n);
            }
            let start = t as usize * width + lo;
            debug_assert!(start + n <= base.1);
            // SAFETY: `t < rows` was checked above, so `start..start + n` lies inside `out`, and
            // columns `lo..lo + n` belong to this task's block only: no two tasks touch one element
            // (the short-lived slice covers exactly this task's columns of row `t`).
            let o = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), n) };
            o.iter_mut()
                .zip(&src[r * width + lo..r * width + lo + n])
                .for_each(|(o, &v)| *o += v);
        }
    });
}

/// Hints the CPU to fetch the `len` floats from `p` into cache. Prefetching is only a hint: it
/// never faults nor reads the memory in the program's sense, so any address is fine.
#[inline(always)]
fn prefetch_span(p: *const f32, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for k in (0..len).step_by(16) {
            // SAFETY: a prefetch hint has no memory effect and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(k) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{random_csr, random_tensor};

    /// The AVX2 builds must give the bits of the portable code (no FMA, same order).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_paths_match_portable_bits() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let csr = random_csr(60, 50, 9, 3).unwrap();
        for (heads, d) in [
            (1usize, 1usize),
            (1, 7),
            (1, 8),
            (1, 65),
            (1, 130),
            (2, 16),
            (8, 8),
            (8, 2),
            (3, 33),
            (4, 32),
        ] {
            let width = heads * d;
            let x = random_tensor(50, width, 1);
            let w = random_tensor(1, csr.nnz() * heads, 2).into_vec();
            for weights in [None, csr.values(), Some(&w[..])] {
                let h = if weights.is_some_and(|v| v.len() == csr.nnz() * heads) {
                    heads
                } else {
                    1
                };
                let args = SpmmArgs {
                    indptr: csr.indptr(),
                    indices: csr.indices(),
                    weights,
                    heads: h,
                    x: x.as_slice(),
                    width,
                };
                let mut a = vec![0.0f32; 60 * width];
                let mut b = vec![1.0f32; 60 * width];
                spmm_rows(&args, 0, &mut a);
                // SAFETY: AVX2 was detected above.
                unsafe { spmm_rows_avx2(&args, 0, &mut b) };
                assert!(
                    a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "spmm heads {heads} d {d}"
                );
            }
            let arow = random_tensor(1, width, 3).into_vec();
            let cols = csr.indices();
            let mut p = vec![0.0f32; cols.len() * heads];
            let mut q = vec![1.0f32; cols.len() * heads];
            sddmm_dot_row(&arow, x.as_slice(), cols, heads, d, &mut p);
            // SAFETY: AVX2 was detected above.
            unsafe { sddmm_dot_row_avx2(&arow, x.as_slice(), cols, heads, d, &mut q) };
            assert!(
                p.iter().zip(&q).all(|(p, q)| p.to_bits() == q.to_bits()),
                "sddmm heads {heads} d {d}"
            );
        }
    }

    #[test]
    fn dot_order_is_the_documented_one() {
        let x: Vec<f32> = (0..19).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let y: Vec<f32> = (0..19).map(|i| 3.0 - i as f32 * 0.37).collect();
        let mut l = [0.0f32; 8];
        for t in 0..16 {
            l[t % 8] += x[t] * y[t];
        }
        let mut want = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        for t in 16..19 {
            want += x[t] * y[t];
        }
        assert_eq!(dot(&x, &y).to_bits(), want.to_bits());
    }
}
