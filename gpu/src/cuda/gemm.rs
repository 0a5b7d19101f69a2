//! Dense products through cuBLAS `sgemm`, on the stream's compute stream.
//!
//! cuBLAS is column-major; Trellis tensors are row-major. A row-major `r x s` matrix read as
//! column-major (leading dimension `s`) is its `s x r` transpose, so the row-major product
//! `C = op(A) op(B)` (`m x n`) is computed as the column-major product
//! `C^T = op(B)^T op(A)^T` (`n x m`): B is passed first, A second, `m` and `n` swap, and each
//! operand is transposed in cuBLAS's terms exactly when it is in Trellis's
//! ([`col_major_args`], checked on the CPU against the CPU backend). cuBLAS's default math mode
//! is used, which computes in FP32 (no TF32 unless `NVIDIA_TF32_OVERRIDE=1` is set).
use super::memory::DeviceTensor;
use super::stream::GpuStream;
use crate::ops::gemm_prefix_dims;
use crate::{GpuError, Result};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm, GemmConfig};

/// Column-major cuBLAS arguments for a row-major product (see the module docs). The first
/// cuBLAS operand is Trellis's `b`, the second its `a`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ColMajorArgs {
    pub(crate) trans_first: bool,
    pub(crate) trans_second: bool,
    pub(crate) m: i32,
    pub(crate) n: i32,
    pub(crate) k: i32,
    pub(crate) ld_first: i32,
    pub(crate) ld_second: i32,
    pub(crate) ldc: i32,
}

/// The cuBLAS arguments for row-major `c (m x n) = op(a) (m x k) * op(b) (k x n)`. Leading
/// dimensions are at least 1 (cuBLAS rejects 0 even where the matrix is empty).
pub(crate) fn col_major_args(
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
) -> Result<ColMajorArgs> {
    let fit = |v: usize| {
        i32::try_from(v).map_err(|_| {
            GpuError::shape(
                "gemm",
                format!("dimension {v} exceeds cuBLAS's 32-bit sizes"),
            )
        })
    };
    let ld = |v: usize| fit(v.max(1));
    Ok(ColMajorArgs {
        trans_first: trans_b,
        trans_second: trans_a,
        m: fit(n)?,
        n: fit(m)?,
        k: fit(k)?,
        // b is row-major k x n (ld n), or n x k (ld k) when transposed.
        ld_first: ld(if trans_b { k } else { n })?,
        // a is row-major m x k (ld k), or k x m (ld m) when transposed.
        ld_second: ld(if trans_a { m } else { k })?,
        ldc: ld(n)?,
    })
}

fn op(t: bool) -> cublasOperation_t {
    if t {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

impl GpuStream {
    /// `c = alpha * op(a) * op(b) + beta * c`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        alpha: f32,
        a: &DeviceTensor,
        trans_a: bool,
        b: &DeviceTensor,
        trans_b: bool,
        beta: f32,
        c: &mut DeviceTensor,
    ) -> Result<()> {
        self.gemm_prefix(alpha, a, a.rows, trans_a, b, trans_b, beta, c)
    }

    /// [`GpuStream::gemm`] over only the first `a_rows` rows of `a`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_prefix(
        &self,
        alpha: f32,
        a: &DeviceTensor,
        a_rows: usize,
        trans_a: bool,
        b: &DeviceTensor,
        trans_b: bool,
        beta: f32,
        c: &mut DeviceTensor,
    ) -> Result<()> {
        let (m, n, k) =
            gemm_prefix_dims(a.shape(), a_rows, trans_a, b.shape(), trans_b, c.shape())?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let args = col_major_args(m, n, k, trans_a, trans_b)?;
        let cfg = GemmConfig {
            transa: op(args.trans_first),
            transb: op(args.trans_second),
            m: args.m,
            n: args.n,
            k: args.k,
            alpha,
            lda: args.ld_first,
            ldb: args.ld_second,
            beta,
            ldc: args.ldc,
        };
        let a_view = a.buf.slice(..a_rows * a.cols);
        let b_view = b.view();
        let n_c = c.len();
        let mut c_view = c.buf.slice_mut(..n_c);
        // SAFETY: with the arguments of `col_major_args`, cuBLAS reads exactly the k x n
        // elements of b, the m x k elements of a's first a_rows rows and writes the m x n
        // elements of c — the lengths of the three views (shapes checked above). The views are
        // borrowed until the call is enqueued on the compute stream, which the handle is bound
        // to; cudarc records the buffers' use on that stream, so they outlive the kernel.
        unsafe { self.blas.gemm(cfg, &b_view, &a_view, &mut c_view) }
            .map_err(|e| GpuError::cuda("cublasSgemm", e))
    }

    /// `op(a) * op(b)` into a new tensor.
    pub fn matmul(
        &self,
        a: &DeviceTensor,
        trans_a: bool,
        b: &DeviceTensor,
        trans_b: bool,
    ) -> Result<DeviceTensor> {
        let m = if trans_a { a.cols } else { a.rows };
        let n = if trans_b { b.rows } else { b.cols };
        let mut c = self.zeros(m, n)?;
        self.gemm(1.0, a, trans_a, b, trans_b, 0.0, &mut c)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::random_tensor;

    /// Column-major BLAS sgemm semantics, naively: `C = alpha op(A) op(B) + beta C` with
    /// `C` m x n (ldc), `op(A)` m x k, `op(B)` k x n.
    #[allow(clippy::too_many_arguments)]
    fn blas_sgemm(
        p: &ColMajorArgs,
        alpha: f32,
        first: &[f32],
        second: &[f32],
        beta: f32,
        c: &mut [f32],
    ) {
        let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
        let (lda, ldb, ldc) = (p.ld_first as usize, p.ld_second as usize, p.ldc as usize);
        let a = |i: usize, l: usize| {
            if p.trans_first {
                first[l + i * lda]
            } else {
                first[i + l * lda]
            }
        };
        let b = |l: usize, j: usize| {
            if p.trans_second {
                second[j + l * ldb]
            } else {
                second[l + j * ldb]
            }
        };
        for j in 0..n {
            for i in 0..m {
                let s: f64 = (0..k).map(|l| a(i, l) as f64 * b(l, j) as f64).sum();
                let old = if beta == 0.0 {
                    0.0
                } else {
                    beta * c[i + j * ldc]
                };
                c[i + j * ldc] = alpha * s as f32 + old;
            }
        }
    }

    #[test]
    fn column_major_swap_computes_the_row_major_product() {
        for (m, n, k) in [(1, 1, 1), (3, 5, 7), (17, 4, 33), (8, 1, 9), (2, 6, 0)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = random_tensor(1, m * k, 1).into_vec();
                let b = random_tensor(1, k * n, 2).into_vec();
                let c0 = random_tensor(1, m * n, 3).into_vec();
                let (alpha, beta) = (0.75, -0.5);
                let mut want = c0.clone();
                crate::cpu::gemm(m, n, k, alpha, &a, ta, &b, tb, beta, &mut want, 1);
                let p = col_major_args(m, n, k, ta, tb).unwrap();
                let mut got = c0.clone();
                blas_sgemm(&p, alpha, &b, &a, beta, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "m {m} n {n} k {k} ta {ta} tb {tb} elem {i}: {g} vs {w}"
                    );
                }
                assert!(p.ld_first >= 1 && p.ld_second >= 1 && p.ldc >= 1);
            }
        }
    }

    #[test]
    fn sizes_beyond_i32_are_an_error() {
        assert!(col_major_args(1 << 31, 1, 1, false, false).is_err());
        assert!(col_major_args(4, 4, 4, false, false).is_ok());
    }
}
