//! Dense matrix multiply through the `gemm` crate, built with its `x86-v4` feature so that it
//! has AVX-512 kernels (picked at run time; AVX2+FMA or SSE kernels on other CPUs).
//!
//! Chosen over `matrixmultiply` by measurement on the 2-vCPU AVX-512 (Sapphire Rapids class)
//! dev machine: `cargo bench -p trellis-gpu --bench kernels -- gemm` runs both side by side.
//! Best of 10 samples, GFLOP/s. The 1-thread columns are from that bench; the shared machine's
//! second vCPU was mostly busy with other builds during it, so the 2-thread columns are from a
//! one-off harness run in a quiet window (`Stream::gemm` against `matrixmultiply` over fixed
//! 2048-row tiles, 64x64 tiles for `X^T dY`, on the same 2-thread rayon budget):
//!
//! | shape                                       | gemm 1t | matrixmultiply 1t | gemm 2t | matrixmultiply 2t |
//! |---------------------------------------------|--------:|------------------:|--------:|------------------:|
//! | `X W`: 100000x128 * 128x256                 |     131 |               123 |     268 |               250 |
//! | `X W`: 100000x256 * 256x16                  |      44 |                41 |     143 |               122 |
//! | `dY W^T`: 100000x256 * (128x256)^T          |     131 |               110 |     276 |               227 |
//! | `X^T dY`: (100000x128)^T * 100000x256       |     123 |               120 |     212 |               178 |
//!
//! The feature matters: without `x86-v4` the `gemm` crate has only AVX2 kernels and
//! `matrixmultiply` (which detects AVX-512 itself) beat it on three of these shapes, by 1.5-2.2x
//! in the same run (1 thread: 35 vs 77, 30 vs 25, 67 vs 104, 67 vs 118 GFLOP/s, under load).
//! `gemm` also takes arbitrary strides, so transposes cost nothing, and splits the work over
//! the caller's rayon budget. For a fixed thread count its results are bit-identical run to run
//! (the k-loop order does not depend on scheduling); across thread counts this is not promised.

/// `c = alpha * op(a) * op(b) + beta * c`, all row-major.
///
/// `op(a)` is `m x k`: `a` is `m x k` (or `k x m` when `trans_a`); `op(b)` is `k x n`: `b` is
/// `k x n` (or `n x k` when `trans_b`); `c` is `m x n`. `threads` is the parallelism to use.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    trans_a: bool,
    b: &[f32],
    trans_b: bool,
    beta: f32,
    c: &mut [f32],
    threads: usize,
) {
    assert_eq!(a.len(), m * k, "gemm: a has the wrong length");
    assert_eq!(b.len(), k * n, "gemm: b has the wrong length");
    assert_eq!(c.len(), m * n, "gemm: c has the wrong length");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // op(a) op(b) is all zeros; as in BLAS, beta = 0 means `c` is not read (NaN-safe).
        if beta == 0.0 {
            c.fill(0.0);
        } else {
            c.iter_mut().for_each(|x| *x *= beta);
        }
        return;
    }
    if n == 1 {
        // A matrix-vector product: the `gemm` crate takes a path here whose sums depend on
        // how many rows there are, so the same row would get other bits in another row
        // subset (a partition's rows). Each row's dot product runs in `k` order instead.
        gemv_rows(m, k, alpha, a, trans_a, b, beta, c);
        return;
    }
    // Row-major strides: element (i, j) of a row-major r x s matrix is at i * s + j.
    let (a_rs, a_cs) = if trans_a {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (b_rs, b_cs) = if trans_b {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    let par = if threads > 1 && m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above ensure every (i, j) addressed through these strides lies inside
    // `a` (m x k), `b` (k x n) and `c` (m x n); `c` is uniquely borrowed and does not alias them.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            beta != 0.0,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            beta,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
}

/// `c = alpha * op(a) * b + beta * c` for a single column `b` (`k x 1`): one dot product per
/// row of `op(a)`, summed in `k` order, rows in parallel. Each row's bits depend only on that
/// row.
#[allow(clippy::too_many_arguments)]
fn gemv_rows(
    m: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    trans_a: bool,
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    use rayon::prelude::*;
    let row = |i: usize| -> f32 {
        let mut acc = 0.0f32;
        if trans_a {
            for (j, &bj) in b.iter().enumerate() {
                acc += a[j * m + i] * bj;
            }
        } else {
            for (&x, &bj) in a[i * k..(i + 1) * k].iter().zip(b) {
                acc += x * bj;
            }
        }
        acc
    };
    c.par_iter_mut()
        .enumerate()
        .with_min_len(4096)
        .for_each(|(i, ci)| {
            let v = alpha * row(i);
            *ci = if beta == 0.0 { v } else { v + beta * *ci };
        });
}
