//! Dense matrix multiply through the `gemm` crate.
//!
//! `gemm` was chosen over `matrixmultiply` and `faer` by measurement on this machine kind (see
//! `benches/kernels.rs`): it reaches the highest f32 throughput here and takes arbitrary strides,
//! so transposes cost nothing. For a fixed thread count its results are bit-identical run to run
//! (the k-loop order does not depend on scheduling).

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
