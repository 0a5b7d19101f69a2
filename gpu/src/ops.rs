//! The device-neutral op API: methods on [`Stream`] that check shapes and dispatch to the
//! stream's backend. Callers (models, partition actors) use only these. The shape checks
//! (`check`, `check_same_shape`, `gemm_prefix_dims`) and Adam's bias correction
//! ([`AdamConfig`]) are shared with the CUDA op API on device operands.
use crate::cpu;
use crate::stream::KernelKind;
use crate::{Csr, Device, DropoutKey, GpuError, Result, Stream, Tensor};

/// Elementwise nonlinearities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Identity,
    Relu,
    Elu { alpha: f32 },
    LeakyRelu { slope: f32 },
}

impl Activation {
    /// `act(x)`.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Identity => x,
            Activation::Relu => x.max(0.0),
            Activation::Elu { alpha } => {
                if x > 0.0 {
                    x
                } else {
                    alpha * x.exp_m1()
                }
            }
            Activation::LeakyRelu { slope } => {
                if x > 0.0 {
                    x
                } else {
                    slope * x
                }
            }
        }
    }
    /// `act'(x)` expressed through the output `y = act(x)`, so backward passes need not keep
    /// the pre-activation (valid for these monotone activations).
    #[inline]
    pub fn derivative_from_output(self, y: f32) -> f32 {
        match self {
            Activation::Identity => 1.0,
            Activation::Relu => (y > 0.0) as u8 as f32,
            Activation::Elu { alpha } => {
                if y > 0.0 {
                    1.0
                } else {
                    y + alpha
                }
            }
            Activation::LeakyRelu { slope } => {
                if y > 0.0 {
                    1.0
                } else {
                    slope
                }
            }
        }
    }
    /// `act'(x)`.
    #[inline]
    pub fn derivative(self, x: f32) -> f32 {
        match self {
            Activation::Identity => 1.0,
            Activation::Relu => (x > 0.0) as u8 as f32,
            Activation::Elu { alpha } => {
                if x > 0.0 {
                    1.0
                } else {
                    alpha * x.exp()
                }
            }
            Activation::LeakyRelu { slope } => {
                if x > 0.0 {
                    1.0
                } else {
                    slope
                }
            }
        }
    }
}

/// Adam hyper-parameters (L2 weight decay added to the gradient, as `torch.optim.Adam`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamConfig {
    /// The bias-corrected step size `lr / (1 - beta1^t)` and `sqrt(1 - beta2^t)` of step `t`
    /// (from 1), computed in f64 and rounded once: every backend's Adam step uses these.
    pub(crate) fn bias_correction(&self, t: u64) -> (f32, f32) {
        let bc1 = 1.0 - (self.beta1 as f64).powi(t as i32);
        let bc2 = 1.0 - (self.beta2 as f64).powi(t as i32);
        ((self.lr as f64 / bc1) as f32, bc2.sqrt() as f32)
    }
}

/// SGD hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SgdConfig {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

/// Per-entry weights for [`Stream::spmm`].
#[derive(Debug, Clone, Copy)]
pub enum EdgeWeights<'a> {
    /// Every entry weighs 1.
    Ones,
    /// The matrix's own values.
    Stored,
    /// `heads` weights per entry, entry-major.
    PerHead(&'a [f32], usize),
}

/// Output of [`Stream::softmax_nll`].
pub type LossOutput = cpu::LossSums;

/// Work per piece when a cancellable stream cuts a kernel (see `Stream::run_rows`): each is
/// about ten milliseconds on one core, so a cancelled epoch stops that soon.
/// Multiply-adds per GEMM piece.
const GEMM_PIECE: usize = 1 << 29;
/// Gathered elements per SpMM piece.
const SPMM_PIECE: usize = 1 << 24;
/// Elements per piece of an element-wise kernel.
const ELEMENTWISE_PIECE: usize = 1 << 22;

/// A shape error of `op` (with `detail`) unless `ok`; the CPU and CUDA op APIs check with it.
pub(crate) fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::shape(op, detail()))
    }
}

/// [`check`] that two operands of `op` have the same shape.
pub(crate) fn check_same_shape(
    op: &'static str,
    a: (usize, usize),
    b: (usize, usize),
) -> Result<()> {
    check(op, a == b, || format!("{a:?} vs {b:?}"))
}

/// The sizes `(m, n, k)` of `c (m x n) = op(a[..a_rows]) (m x k) * op(b) (k x n)`, checked
/// against the shapes of `a`, `b` and `c` (every backend's `gemm_prefix` starts with this).
pub(crate) fn gemm_prefix_dims(
    a: (usize, usize),
    a_rows: usize,
    trans_a: bool,
    b: (usize, usize),
    trans_b: bool,
    c: (usize, usize),
) -> Result<(usize, usize, usize)> {
    check("gemm_prefix", a_rows <= a.0, || {
        format!("{a_rows} rows of {}", a.0)
    })?;
    let (m, k) = if trans_a {
        (a.1, a_rows)
    } else {
        (a_rows, a.1)
    };
    let (k2, n) = if trans_b { (b.1, b.0) } else { b };
    check("gemm_prefix", k == k2 && c == (m, n), || {
        format!("op(a) {m}x{k}, op(b) {k2}x{n}, c {}x{}", c.0, c.1)
    })?;
    Ok((m, n, k))
}

impl Stream {
    /// Checks that an op may start: this stream runs on the CPU backend and its work was not
    /// cancelled.
    fn admit(&self) -> Result<()> {
        self.check_cancelled()?;
        match self.device() {
            Device::Cpu => Ok(()),
            d => Err(GpuError::DeviceUnavailable {
                device: d.to_string(),
                reason: "no backend".into(),
            }),
        }
    }

    /// `c = alpha * op(a) * op(b) + beta * c`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        alpha: f32,
        a: &Tensor,
        trans_a: bool,
        b: &Tensor,
        trans_b: bool,
        beta: f32,
        c: &mut Tensor,
    ) -> Result<()> {
        self.gemm_prefix(alpha, a, a.rows(), trans_a, b, trans_b, beta, c)
    }

    /// [`Stream::gemm`] over only the first `a_rows` stored rows of `a` (a row prefix, e.g. the
    /// inner rows of a block's input), so callers need not copy them out.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_prefix(
        &self,
        alpha: f32,
        a: &Tensor,
        a_rows: usize,
        trans_a: bool,
        b: &Tensor,
        trans_b: bool,
        beta: f32,
        c: &mut Tensor,
    ) -> Result<()> {
        self.admit()?;
        let (m, n, k) =
            gemm_prefix_dims(a.shape(), a_rows, trans_a, b.shape(), trans_b, c.shape())?;
        let a_data = &a.as_slice()[..a_rows * a.cols()];
        let threads = self.threads();
        let c = c.as_mut_slice();
        let b = b.as_slice();
        if !trans_a {
            // Rows of op(a) and c are independent: pieces of them.
            let per_piece = GEMM_PIECE / (n * k).max(1);
            return self.run_rows(KernelKind::Gemm, m, per_piece, |r| {
                let (a, c) = (
                    &a_data[r.start * k..r.end * k],
                    &mut c[r.start * n..r.end * n],
                );
                cpu::gemm(r.len(), n, k, alpha, a, false, b, trans_b, beta, c, threads)
            });
        }
        if !trans_b {
            // `a^T b` sums over the stored rows of `a` and `b`: pieces of them, accumulated in
            // order (so the bits depend on the piece size, which is fixed).
            let per_piece = GEMM_PIECE / (m * n).max(1);
            return self.run_rows(KernelKind::Gemm, k, per_piece, |r| {
                let (a, b) = (&a_data[r.start * m..r.end * m], &b[r.start * n..r.end * n]);
                let beta = if r.start == 0 { beta } else { 1.0 };
                cpu::gemm(m, n, r.len(), alpha, a, true, b, false, beta, c, threads)
            });
        }
        self.run_rows(KernelKind::Gemm, 1, 1, |_| {
            cpu::gemm(m, n, k, alpha, a_data, true, b, true, beta, c, threads)
        })
    }

    /// `dst[..src.rows()] += src` (adds into a row prefix of `dst`).
    pub fn add_rows_prefix(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        self.admit()?;
        check(
            "add_rows_prefix",
            src.cols() == dst.cols() && src.rows() <= dst.rows(),
            || format!("{:?} into {:?}", src.shape(), dst.shape()),
        )?;
        let n = src.len();
        self.run(|| cpu::axpy(1.0, src.as_slice(), &mut dst.as_mut_slice()[..n]));
        Ok(())
    }

    /// `op(a) * op(b)` into a new tensor.
    pub fn matmul(&self, a: &Tensor, trans_a: bool, b: &Tensor, trans_b: bool) -> Result<Tensor> {
        let m = if trans_a { a.cols() } else { a.rows() };
        let n = if trans_b { b.rows() } else { b.cols() };
        let mut c = Tensor::zeros(m, n);
        self.gemm(1.0, a, trans_a, b, trans_b, 0.0, &mut c)?;
        Ok(c)
    }

    /// `out = A x` with `A` a CSR matrix (rows = outputs) and `heads` column blocks of `x`.
    pub fn spmm(&self, a: &Csr, w: EdgeWeights<'_>, x: &Tensor, out: &mut Tensor) -> Result<()> {
        self.admit()?;
        check(
            "spmm",
            x.rows() == a.n_cols() && out.shape() == (a.n_rows(), x.cols()),
            || {
                format!(
                    "A {}x{}, x {}x{}, out {}x{}",
                    a.n_rows(),
                    a.n_cols(),
                    x.rows(),
                    x.cols(),
                    out.rows(),
                    out.cols()
                )
            },
        )?;
        let (weights, heads) = match w {
            EdgeWeights::Ones => (None, 1),
            EdgeWeights::Stored => {
                let v = a
                    .values()
                    .ok_or_else(|| GpuError::shape("spmm", "matrix has no stored values"))?;
                (Some(v), 1)
            }
            EdgeWeights::PerHead(v, h) => {
                check(
                    "spmm",
                    h >= 1 && v.len() == a.nnz() * h && x.cols() % h == 0,
                    || {
                        format!(
                            "{} weights for {} entries x {h} heads, width {}",
                            v.len(),
                            a.nnz(),
                            x.cols()
                        )
                    },
                )?;
                (Some(v), h)
            }
        };
        let (xs, w, out) = (x.as_slice(), x.cols(), out.as_mut_slice());
        let per_row = (a.nnz() / a.n_rows().max(1) + 1) * w;
        self.run_rows(
            KernelKind::Spmm,
            a.n_rows(),
            SPMM_PIECE / per_row.max(1),
            |r| {
                let block = &mut out[r.start * w..r.end * w];
                cpu::spmm_range(a, weights, heads, xs, w, r, block)
            },
        )
    }

    /// Per-entry, per-head dot products `<a[row], b[col]>` (SDDMM).
    pub fn sddmm_dot(&self, csr: &Csr, heads: usize, a: &Tensor, b: &Tensor) -> Result<Vec<f32>> {
        self.admit()?;
        check(
            "sddmm_dot",
            a.rows() == csr.n_rows()
                && b.rows() == csr.n_cols()
                && a.cols() == b.cols()
                && heads >= 1
                && a.cols() % heads == 0,
            || {
                format!(
                    "csr {}x{}, a {:?}, b {:?}, heads {heads}",
                    csr.n_rows(),
                    csr.n_cols(),
                    a.shape(),
                    b.shape()
                )
            },
        )?;
        let mut out = vec![0.0; csr.nnz() * heads];
        self.run(|| cpu::sddmm_dot(csr, heads, a.as_slice(), b.as_slice(), a.cols(), &mut out));
        Ok(out)
    }

    /// Per-entry, per-head sums `left[row] + right[col]`.
    pub fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Result<Vec<f32>> {
        self.admit()?;
        let heads = left.cols();
        check(
            "sddmm_add",
            left.rows() == csr.n_rows() && right.rows() == csr.n_cols() && right.cols() == heads,
            || {
                format!(
                    "csr {}x{}, left {:?}, right {:?}",
                    csr.n_rows(),
                    csr.n_cols(),
                    left.shape(),
                    right.shape()
                )
            },
        )?;
        let mut out = vec![0.0; csr.nnz() * heads];
        self.run(|| cpu::sddmm_add(csr, heads, left.as_slice(), right.as_slice(), &mut out));
        Ok(out)
    }

    /// Softmax of per-entry scores over each row, per head.
    pub fn edge_softmax(&self, csr: &Csr, heads: usize, scores: &[f32]) -> Result<Vec<f32>> {
        self.admit()?;
        check("edge_softmax", scores.len() == csr.nnz() * heads, || {
            format!("{} scores", scores.len())
        })?;
        let mut out = vec![0.0; scores.len()];
        self.run(|| cpu::edge_softmax(csr, heads, scores, &mut out));
        Ok(out)
    }

    /// Backward of [`Stream::edge_softmax`] given its output `alpha` and the output gradient.
    pub fn edge_softmax_backward(
        &self,
        csr: &Csr,
        heads: usize,
        alpha: &[f32],
        grad: &[f32],
    ) -> Result<Vec<f32>> {
        self.admit()?;
        check(
            "edge_softmax_backward",
            alpha.len() == csr.nnz() * heads && grad.len() == alpha.len(),
            || format!("{} alpha, {} grad", alpha.len(), grad.len()),
        )?;
        let mut out = vec![0.0; alpha.len()];
        self.run(|| cpu::edge_softmax_backward(csr, heads, alpha, grad, &mut out));
        Ok(out)
    }

    /// Rows `idx` of `x` as a new tensor.
    pub fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Result<Tensor> {
        self.admit()?;
        check(
            "gather_rows",
            idx.iter().all(|&i| (i as usize) < x.rows()),
            || format!("index out of {} rows", x.rows()),
        )?;
        let mut out = Tensor::zeros(idx.len(), x.cols());
        self.run(|| cpu::gather_rows(x.as_slice(), x.cols(), idx, out.as_mut_slice()));
        Ok(out)
    }

    /// `out[idx[r]] += src[r]`.
    pub fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &mut Tensor) -> Result<()> {
        check("scatter_add_rows", src.cols() == out.cols(), || {
            format!("src {:?} into out {:?}", src.shape(), out.shape())
        })?;
        self.scatter_add_slice(src.as_slice(), idx, out)
    }

    /// `out[idx[r]] += src[r]` with `src` a row-major slice of `idx.len()` rows (a received
    /// buffer, added without first copying it into a tensor).
    pub fn scatter_add_slice(&self, src: &[f32], idx: &[u32], out: &mut Tensor) -> Result<()> {
        self.admit()?;
        let w = out.cols();
        check(
            "scatter_add_slice",
            src.len() == idx.len() * w && idx.iter().all(|&i| (i as usize) < out.rows()),
            || {
                format!(
                    "{} values, {} indices, out {:?}",
                    src.len(),
                    idx.len(),
                    out.shape()
                )
            },
        )?;
        self.run(|| cpu::scatter_add_rows(src, w, idx, out.as_mut_slice()));
        Ok(())
    }

    /// `x[i, :] += bias`.
    pub fn add_bias(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        self.admit()?;
        check("add_bias", bias.len() == x.cols(), || {
            format!("bias {} for width {}", bias.len(), x.cols())
        })?;
        let (w, x, b) = (x.cols(), x.as_mut_slice(), bias.as_slice());
        self.run_rows(
            KernelKind::Other,
            x.len() / w.max(1),
            ELEMENTWISE_PIECE / w.max(1),
            |r| cpu::add_bias(&mut x[r.start * w..r.end * w], b),
        )
    }

    /// `out += column sums of g` (the bias gradient, accumulated).
    pub fn add_column_sums(&self, g: &Tensor, out: &mut Tensor) -> Result<()> {
        self.admit()?;
        check("add_column_sums", out.len() == g.cols(), || {
            format!("out {} for width {}", out.len(), g.cols())
        })?;
        let mut sums = vec![0.0; g.cols()];
        self.run(|| cpu::column_sums(g.as_slice(), g.cols(), &mut sums));
        out.as_mut_slice()
            .iter_mut()
            .zip(&sums)
            .for_each(|(o, s)| *o += s);
        Ok(())
    }

    /// `act(x)` as a new tensor.
    pub fn activation(&self, act: Activation, x: &Tensor) -> Result<Tensor> {
        self.admit()?;
        let mut y = Tensor::zeros(x.rows(), x.cols());
        self.run(|| cpu::activation(act, x.as_slice(), y.as_mut_slice()));
        Ok(y)
    }

    /// `x = act(x)` in place.
    pub fn activate(&self, act: Activation, x: &mut Tensor) -> Result<()> {
        self.admit()?;
        if act == Activation::Identity {
            return Ok(());
        }
        use rayon::prelude::*;
        let x = x.as_mut_slice();
        self.run_rows(KernelKind::Other, x.len(), ELEMENTWISE_PIECE, |r| {
            x[r].par_chunks_mut(16_384)
                .for_each(|c| c.iter_mut().for_each(|v| *v = act.apply(*v)))
        })
    }

    /// `gy * act'(x)` as a new tensor.
    pub fn activation_backward(&self, act: Activation, x: &Tensor, gy: &Tensor) -> Result<Tensor> {
        self.admit()?;
        check_same_shape("activation_backward", x.shape(), gy.shape())?;
        let mut gx = Tensor::zeros(x.rows(), x.cols());
        self.run(|| cpu::activation_backward(act, x.as_slice(), gy.as_slice(), gx.as_mut_slice()));
        Ok(gx)
    }

    /// `gy * act'(x)` in place in `gy`, with the derivative taken from the output `y = act(x)`.
    pub fn activation_backward_from_output(
        &self,
        act: Activation,
        y: &Tensor,
        gy: &mut Tensor,
    ) -> Result<()> {
        self.admit()?;
        check_same_shape("activation_backward_from_output", y.shape(), gy.shape())?;
        if act == Activation::Identity {
            return Ok(());
        }
        use rayon::prelude::*;
        let (gy, y) = (gy.as_mut_slice(), y.as_slice());
        self.run_rows(KernelKind::Other, gy.len(), ELEMENTWISE_PIECE, |r| {
            gy[r.clone()]
                .par_chunks_mut(16_384)
                .zip(y[r].par_chunks(16_384))
                .for_each(|(g, y)| {
                    g.iter_mut()
                        .zip(y)
                        .for_each(|(g, &y)| *g *= act.derivative_from_output(y));
                })
        })
    }

    /// One bit per element of `y`, set where `y > 0` (what ReLU's backward needs: 1/32 of `y`).
    pub fn positive_bits(&self, y: &Tensor) -> Result<Vec<u64>> {
        self.admit()?;
        use rayon::prelude::*;
        let y = y.as_slice();
        let mut bits = vec![0u64; y.len().div_ceil(64)];
        // Pieces of whole 64-element words.
        let words = bits.len();
        self.run_rows(KernelKind::Other, words, ELEMENTWISE_PIECE / 64, |r| {
            let elems = &y[r.start * 64..(r.end * 64).min(y.len())];
            bits[r]
                .par_iter_mut()
                .zip(elems.par_chunks(64))
                .for_each(|(b, c)| {
                    *b = c
                        .iter()
                        .enumerate()
                        .fold(0u64, |acc, (k, &v)| acc | (((v > 0.0) as u64) << k))
                })
        })?;
        Ok(bits)
    }

    /// Zeroes the elements of `g` whose bit in `bits` (from [`Stream::positive_bits`]) is clear.
    pub fn mask_by_bits(&self, bits: &[u64], g: &mut Tensor) -> Result<()> {
        self.admit()?;
        check("mask_by_bits", bits.len() == g.len().div_ceil(64), || {
            format!("{} words for {} elements", bits.len(), g.len())
        })?;
        use rayon::prelude::*;
        let g = g.as_mut_slice();
        let n = g.len();
        self.run_rows(KernelKind::Other, bits.len(), ELEMENTWISE_PIECE / 64, |r| {
            g[r.start * 64..(r.end * 64).min(n)]
                .par_chunks_mut(64)
                .zip(bits[r].par_iter())
                .for_each(|(c, &b)| {
                    c.iter_mut().enumerate().for_each(|(k, v)| {
                        if b >> k & 1 == 0 {
                            *v = 0.0;
                        }
                    })
                })
        })
    }

    /// Inverted dropout in place, keyed by the rows' global ids (its own backward).
    pub fn dropout(&self, x: &mut Tensor, gids: &[u32], key: DropoutKey, p: f32) -> Result<()> {
        self.admit()?;
        check("dropout", gids.len() == x.rows(), || {
            format!("{} ids for {} rows", gids.len(), x.rows())
        })?;
        let (w, x) = (x.cols(), x.as_mut_slice());
        self.run_rows(
            KernelKind::Other,
            gids.len(),
            ELEMENTWISE_PIECE / w.max(1),
            |r| {
                let rows = &mut x[r.start * w..r.end * w];
                cpu::dropout(rows, w, &gids[r], key, p)
            },
        )
    }

    /// `dst = dropout(src)`: the mask of [`Stream::dropout`], applied while copying.
    pub fn dropout_into(
        &self,
        src: &Tensor,
        dst: &mut Tensor,
        gids: &[u32],
        key: DropoutKey,
        p: f32,
    ) -> Result<()> {
        self.admit()?;
        check(
            "dropout_into",
            gids.len() == src.rows() && src.shape() == dst.shape(),
            || {
                format!(
                    "{} ids, src {:?}, dst {:?}",
                    gids.len(),
                    src.shape(),
                    dst.shape()
                )
            },
        )?;
        let (w, src, dst) = (src.cols(), src.as_slice(), dst.as_mut_slice());
        self.run_rows(
            KernelKind::Other,
            gids.len(),
            ELEMENTWISE_PIECE / w.max(1),
            |r| {
                let (s, d) = (
                    &src[r.start * w..r.end * w],
                    &mut dst[r.start * w..r.end * w],
                );
                cpu::dropout_copy(s, d, w, &gids[r], key, p)
            },
        )
    }

    /// `dropout(src)` as a new tensor, written in one pass (the new rows are not zeroed first).
    pub fn dropout_copy(
        &self,
        src: &Tensor,
        gids: &[u32],
        key: DropoutKey,
        p: f32,
    ) -> Result<Tensor> {
        self.admit()?;
        check("dropout_copy", gids.len() == src.rows(), || {
            format!("{} ids for {} rows", gids.len(), src.rows())
        })?;
        let (rows, w, n) = (src.rows(), src.cols(), src.len());
        let src = src.as_slice();
        let mut data: Vec<f32> = Vec::with_capacity(n);
        let out = &mut data.spare_capacity_mut()[..n];
        self.run_rows(KernelKind::Other, rows, ELEMENTWISE_PIECE / w.max(1), |r| {
            let (s, d) = (
                &src[r.start * w..r.end * w],
                &mut out[r.start * w..r.end * w],
            );
            cpu::dropout_copy_uninit(s, d, w, &gids[r], key, p)
        })?;
        // SAFETY: `run_rows` returned Ok, so `f` ran over row ranges covering `0..rows`, and
        // each call wrote every value of its rows: all `n` values are initialised.
        unsafe { data.set_len(n) };
        Tensor::from_vec(rows, w, data)
    }

    /// Dropout of a sparse matrix's stored values, with the mask [`Stream::dropout`] applies to
    /// the dense form (rows keyed by `gids`).
    pub fn dropout_csr(&self, m: &mut Csr, gids: &[u32], key: DropoutKey, p: f32) -> Result<()> {
        self.admit()?;
        check(
            "dropout_csr",
            gids.len() == m.n_rows() && m.values().is_some(),
            || {
                format!(
                    "{} ids for {} rows (values stored: {})",
                    gids.len(),
                    m.n_rows(),
                    m.values().is_some()
                )
            },
        )?;
        let (indptr, indices, values) = m.parts_mut();
        let values = values.expect("checked above");
        self.run(|| cpu::dropout_csr(indptr, indices, values, gids, key, p));
        Ok(())
    }

    /// Dropout over CSR entries (`heads` values per entry), keyed by the row's global id.
    pub fn edge_dropout(
        &self,
        csr: &Csr,
        vals: &mut [f32],
        heads: usize,
        gids: &[u32],
        key: DropoutKey,
        p: f32,
    ) -> Result<()> {
        self.admit()?;
        check(
            "edge_dropout",
            gids.len() == csr.n_rows() && vals.len() == csr.nnz() * heads,
            || {
                format!(
                    "{} ids for {} rows, {} values",
                    gids.len(),
                    csr.n_rows(),
                    vals.len()
                )
            },
        )?;
        self.run(|| cpu::edge_dropout(csr.indptr(), vals, heads, gids, key, p));
        Ok(())
    }

    /// `y += alpha * x`.
    pub fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
        self.admit()?;
        check_same_shape("axpy", x.shape(), y.shape())?;
        self.run(|| cpu::axpy(alpha, x.as_slice(), y.as_mut_slice()));
        Ok(())
    }

    /// Log-softmax + NLL over `rows`; `grad` receives the gradient of `scale * loss_sum`.
    pub fn softmax_nll(
        &self,
        logits: &Tensor,
        labels: &[u32],
        rows: &[u32],
        scale: f32,
        grad: &mut Tensor,
    ) -> Result<LossOutput> {
        self.admit()?;
        let classes = logits.cols();
        check(
            "softmax_nll",
            labels.len() == logits.rows()
                && grad.shape() == logits.shape()
                && rows.iter().all(|&r| {
                    (r as usize) < logits.rows() && (labels[r as usize] as usize) < classes
                }),
            || {
                format!(
                    "logits {:?}, {} labels, rows or labels out of range",
                    logits.shape(),
                    labels.len()
                )
            },
        )?;
        Ok(self.run(|| {
            cpu::softmax_nll(
                logits.as_slice(),
                classes,
                labels,
                rows,
                scale,
                grad.as_mut_slice(),
            )
        }))
    }

    /// Number of `rows` predicted correctly (argmax).
    pub fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> Result<usize> {
        self.admit()?;
        check(
            "accuracy_count",
            labels.len() == logits.rows() && rows.iter().all(|&r| (r as usize) < logits.rows()),
            || format!("logits {:?}, {} labels", logits.shape(), labels.len()),
        )?;
        Ok(self.run(|| cpu::accuracy_count(logits.as_slice(), logits.cols(), labels, rows)))
    }

    /// One Adam step on `param` (`t` from 1).
    pub fn adam_step(
        &self,
        cfg: &AdamConfig,
        t: u64,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
    ) -> Result<()> {
        self.admit()?;
        check(
            "adam_step",
            grad.len() == param.len() && m.len() == param.len() && v.len() == param.len(),
            || "state sizes differ".into(),
        )?;
        self.run(|| {
            cpu::adam_step(
                cfg,
                t,
                param.as_mut_slice(),
                grad.as_slice(),
                m.as_mut_slice(),
                v.as_mut_slice(),
            )
        });
        Ok(())
    }

    /// One SGD step on `param`.
    pub fn sgd_step(
        &self,
        cfg: &SgdConfig,
        param: &mut Tensor,
        grad: &Tensor,
        buf: &mut Tensor,
    ) -> Result<()> {
        self.admit()?;
        check(
            "sgd_step",
            grad.len() == param.len() && buf.len() == param.len(),
            || "state sizes differ".into(),
        )?;
        self.run(|| {
            cpu::sgd_step(
                cfg,
                param.as_mut_slice(),
                grad.as_slice(),
                buf.as_mut_slice(),
            )
        });
        Ok(())
    }

    /// Hex digest of the tensors' bytes, in order.
    pub fn digest(&self, tensors: &[&Tensor]) -> Result<String> {
        Ok(crate::digest_f32(tensors.iter().map(|t| t.as_slice())))
    }
}
