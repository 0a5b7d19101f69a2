//! Dense elementwise kernels: bias, activations, dropout, axpy.
use super::row_chunk;
use crate::ops::Activation;
use crate::rng::{dropout_scale, dropout_threshold, DropoutKey, Philox4x32};
use rayon::prelude::*;
use std::mem::MaybeUninit;

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

/// Rows per partial sum in [`column_sums`]: a constant, so the summation order (and the bits)
/// never depend on the thread count.
pub const COLUMN_SUM_BLOCK_ROWS: usize = 1024;

/// Column sums of a `rows x width` matrix (the bias gradient). Each block of
/// [`COLUMN_SUM_BLOCK_ROWS`] rows is summed in row order (in parallel across blocks), then the
/// block sums are added in block order; up to one block this is plain row order.
pub fn column_sums(g: &[f32], width: usize, out: &mut [f32]) {
    assert_eq!(out.len(), width, "column_sums: out has the wrong length");
    if width == 0 {
        return;
    }
    assert_eq!(g.len() % width, 0, "column_sums: width mismatch");
    let sum_rows = |rows: &[f32], acc: &mut [f32]| {
        acc.fill(0.0);
        for row in rows.chunks_exact(width) {
            acc.iter_mut().zip(row).for_each(|(v, &x)| *v += x);
        }
    };
    let block = COLUMN_SUM_BLOCK_ROWS * width;
    if g.len() <= block {
        sum_rows(g, out);
        return;
    }
    let partials: Vec<Vec<f32>> = g
        .par_chunks(block)
        .map(|rows| {
            let mut acc = vec![0.0; width];
            sum_rows(rows, &mut acc);
            acc
        })
        .collect();
    out.copy_from_slice(&partials[0]);
    for p in &partials[1..] {
        out.iter_mut().zip(p).for_each(|(v, &x)| *v += x);
    }
}

/// `y = act(x)` elementwise.
pub fn activation(act: Activation, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "activation: length mismatch");
    y.par_chunks_mut(16_384)
        .zip(x.par_chunks(16_384))
        .for_each(|(y, x)| {
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
///
/// One Philox block gives 16-bit draws for 8 consecutive columns (keep probability resolution
/// 2^-16). A block whose 8 values are all zero is skipped: its mask cannot change them, which
/// makes dropout on sparse inputs (bag-of-words features) nearly free.
pub fn dropout(x: &mut [f32], width: usize, gids: &[u32], key: DropoutKey, p: f32) {
    if p <= 0.0 || width == 0 {
        return;
    }
    let mask = RowMask::new("dropout", x.len(), width, gids, key, p);
    x.par_chunks_mut(mask.chunk * width)
        .enumerate()
        .for_each(|(c, block)| mask.apply(c, block));
}

/// `dst = dropout(src)` with the mask [`dropout`] applies, in one parallel pass (no separate
/// copy of `src` first).
pub fn dropout_copy(
    src: &[f32],
    dst: &mut [f32],
    width: usize,
    gids: &[u32],
    key: DropoutKey,
    p: f32,
) {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and `dropout_copy_uninit` only
    // writes initialised values through this view.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    dropout_copy_uninit(src, dst, width, gids, key, p)
}

/// [`dropout_copy`] into memory that need not be initialised (a fresh allocation that would
/// otherwise be zeroed first, only to be overwritten): every value of `dst` is written.
pub fn dropout_copy_uninit(
    src: &[f32],
    dst: &mut [MaybeUninit<f32>],
    width: usize,
    gids: &[u32],
    key: DropoutKey,
    p: f32,
) {
    assert_eq!(src.len(), dst.len(), "dropout_copy: length mismatch");
    if width == 0 {
        return;
    }
    let mask = RowMask::new("dropout_copy", dst.len(), width, gids, key, p);
    dst.par_chunks_mut(mask.chunk * width)
        .zip(src.par_chunks(mask.chunk * width))
        .enumerate()
        .for_each(|(c, (block, from))| {
            let len = block.len();
            let out = block.as_mut_ptr().cast::<f32>();
            // SAFETY: `block` and `from` have the same length (the chunks of equal-length
            // slices) and do not overlap (`dst` is borrowed mutably); after the copy every
            // element of `block` is an initialised f32, and `MaybeUninit<f32>` has its layout,
            // so the view is valid for the rest of this closure.
            let block = unsafe {
                std::ptr::copy_nonoverlapping(from.as_ptr(), out, len);
                std::slice::from_raw_parts_mut(out, len)
            };
            if p > 0.0 {
                mask.apply(c, block);
            }
        });
}

/// The row loop shared by [`dropout`] and [`dropout_copy`]: rows of `width` values split into
/// parallel chunks of `chunk` rows, row `r` masked with the draws of `gids[r]`.
struct RowMask<'a> {
    mask: MaskGen,
    width: usize,
    chunk: usize,
    gids: &'a [u32],
}

impl<'a> RowMask<'a> {
    /// The mask for `len` values in rows `width` wide (`width` not 0), checking that every row
    /// has a global id.
    fn new(op: &str, len: usize, width: usize, gids: &'a [u32], key: DropoutKey, p: f32) -> Self {
        assert_eq!(
            len,
            gids.len() * width,
            "{op}: one global id per row is needed"
        );
        RowMask {
            mask: MaskGen::new(key, p),
            width,
            chunk: row_chunk(gids.len(), width),
            gids,
        }
    }

    /// Masks chunk `c` (`block`, its rows' values) in place.
    fn apply(&self, c: usize, block: &mut [f32]) {
        for (r, row) in block.chunks_mut(self.width).enumerate() {
            self.mask.apply_row(self.gids[c * self.chunk + r], row);
        }
    }
}

/// Dropout over a row's entries (GAT attention dropout): value `k` of row `r`'s segment (its
/// entries times `heads`) is kept if the draw for `(gids[r], k)` passes.
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
    assert_row_ids("edge_dropout", indptr, gids);
    assert_eq!(
        vals.len(),
        indptr[gids.len()] * heads,
        "edge_dropout: values length"
    );
    let mask = MaskGen::new(key, p);
    for_each_row_segment(vals, indptr, heads, |r, seg| mask.apply_row(gids[r], seg));
}

/// Dropout of a sparse matrix's stored values with the same mask as [`dropout`] would apply to
/// its dense form: entry (row `r`, column `c`) uses the draw for `(gids[r], c)`.
pub fn dropout_csr(
    indptr: &[usize],
    indices: &[u32],
    vals: &mut [f32],
    gids: &[u32],
    key: DropoutKey,
    p: f32,
) {
    if p <= 0.0 {
        return;
    }
    assert_row_ids("dropout_csr", indptr, gids);
    assert_eq!(vals.len(), indices.len(), "dropout_csr: values length");
    let mask = MaskGen::new(key, p);
    for_each_row_segment(vals, indptr, 1, |r, seg| {
        mask.apply_sparse_row(gids[r], &indices[indptr[r]..indptr[r + 1]], seg)
    });
}

/// Panics unless the CSR rows of `indptr` each have a global id in `gids` (`op` names the
/// caller).
fn assert_row_ids(op: &str, indptr: &[usize], gids: &[u32]) {
    assert_eq!(
        indptr.len(),
        gids.len() + 1,
        "{op}: one global id per row is needed"
    );
}

/// The row loop shared by [`edge_dropout`] and [`dropout_csr`]: `vals` split into the rows'
/// segments (`per_entry` values per entry of `indptr`), each passed with its row index to `f`,
/// in parallel chunks of 256 rows.
fn for_each_row_segment(
    vals: &mut [f32],
    indptr: &[usize],
    per_entry: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    let mut segs = super::split_rows(vals, indptr, per_entry);
    segs.par_chunks_mut(256).enumerate().for_each(|(c, block)| {
        for (k, seg) in block.iter_mut().enumerate() {
            f(c * 256 + k, seg);
        }
    });
}

/// Draws and applies keep/drop decisions for one row.
struct MaskGen {
    g: Philox4x32,
    key: DropoutKey,
    threshold: u32,
    scale: f32,
}

impl MaskGen {
    fn new(key: DropoutKey, p: f32) -> Self {
        MaskGen {
            g: Philox4x32::new(key.seed),
            key,
            threshold: dropout_threshold(p),
            scale: dropout_scale(p),
        }
    }

    /// Masks the entries of a sparse row (columns ascending) as [`Self::apply_row`] would.
    fn apply_sparse_row(&self, gid: u32, cols: &[u32], vals: &mut [f32]) {
        let mut cached = (u32::MAX, [0u32; 4]);
        for (&c, v) in cols.iter().zip(vals) {
            let b = c / 8;
            if cached.0 != b {
                cached = (b, self.g.block(self.key.counter(gid, b)));
            }
            let k = (c % 8) as usize;
            let draw = (cached.1[k / 2] >> (16 * (k % 2))) & 0xffff;
            *v = if draw >= self.threshold {
                *v * self.scale
            } else {
                0.0
            };
        }
    }

    #[inline]
    fn apply_row(&self, gid: u32, row: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { self.apply_row_avx2(gid, row) };
        }
        self.apply_row_generic(gid, row)
    }

    /// [`Self::apply_row_generic`] compiled with AVX2, which vectorises the 8-lane Philox.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn apply_row_avx2(&self, gid: u32, row: &mut [f32]) {
        self.apply_row_generic(gid, row)
    }

    /// Groups of 64 columns draw 8 Philox blocks at once; the tail goes block by block. Both give
    /// the draws of `block(counter(gid, column / 8))`, so the mask is the same either way.
    #[inline(always)]
    fn apply_row_generic(&self, gid: u32, row: &mut [f32]) {
        let done = row.len() / 64 * 8;
        let mut groups = row.chunks_exact_mut(64);
        for (gi, cols) in groups.by_ref().enumerate() {
            // Any non-zero bit outside the sign bit means a non-zero value.
            if cols.iter().fold(0u32, |acc, v| acc | (v.to_bits() << 1)) == 0 {
                continue;
            }
            let first = self.key.counter(gid, 8 * gi as u32);
            let ctr = [
                [first[0]; 8],
                [first[1]; 8],
                [first[2]; 8],
                std::array::from_fn(|i| first[3] + i as u32),
            ];
            let u = self.g.block8(ctr);
            for (k, v) in cols.iter_mut().enumerate() {
                let (blk, lane) = (k / 8, k % 8);
                let draw = (u[lane / 2][blk] >> (16 * (lane % 2))) & 0xffff;
                *v = if draw >= self.threshold {
                    *v * self.scale
                } else {
                    0.0
                };
            }
        }
        let tail = groups.into_remainder();
        for (b, cols) in tail.chunks_mut(8).enumerate() {
            if cols.iter().fold(0u32, |acc, v| acc | (v.to_bits() << 1)) == 0 {
                continue;
            }
            let u = self.g.block(self.key.counter(gid, (done + b) as u32));
            for (k, v) in cols.iter_mut().enumerate() {
                let draw = (u[k / 2] >> (16 * (k % 2))) & 0xffff;
                *v = if draw >= self.threshold {
                    *v * self.scale
                } else {
                    0.0
                };
            }
        }
    }
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    y.par_chunks_mut(16_384)
        .zip(x.par_chunks(16_384))
        .for_each(|(y, x)| {
            y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Csr;

    #[test]
    fn dense_grouped_and_sparse_masks_agree() {
        let key = DropoutKey {
            seed: 9,
            epoch: 2,
            layer: 1,
            site: 0,
        };
        for width in [1, 7, 8, 9, 63, 64, 65, 200, 257] {
            let rows = 3;
            let x: Vec<f32> = (0..rows * width).map(|i| 1.0 + (i % 5) as f32).collect();
            let gids = [5u32, 900, 12];
            let mut dense = x.clone();
            dropout(&mut dense, width, &gids, key, 0.4);
            let mut m = Csr::from_dense(rows, width, &x).unwrap();
            let (indptr, indices, vals) = m.parts_mut();
            dropout_csr(indptr, indices, vals.unwrap(), &gids, key, 0.4);
            assert_eq!(m.values().unwrap(), &dense[..], "width {width}");
            // Each element individually: the draw of block col/8, lane col%8.
            let g = Philox4x32::new(key.seed);
            let thr = (0.4f64 * 65_536.0).round() as u32;
            for r in 0..rows {
                for c in 0..width {
                    let u = g.block(key.counter(gids[r], (c / 8) as u32));
                    let draw = (u[(c % 8) / 2] >> (16 * (c % 2))) & 0xffff;
                    let want = if draw >= thr {
                        x[r * width + c] / 0.6
                    } else {
                        0.0
                    };
                    assert_eq!(dense[r * width + c], want, "width {width} row {r} col {c}");
                }
            }
        }
    }
}
