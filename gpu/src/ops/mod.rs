//! The device-neutral op API: methods on [`Stream`] that check shapes and dispatch to the
//! stream's backend. Callers (models, partition actors) use only these. The shape checks
//! (`check`, `check_same_shape`, `gemm_prefix_dims`) and Adam's bias correction
//! ([`AdamConfig`]) are shared with the CUDA op API on device operands.
use crate::{GpuError, Result, Stream, Tensor};

mod dense;
mod sparse;

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
    /// `heads` weights per entry: an `nnz x heads` tensor (entry-major), in the stream's memory.
    PerHead(&'a Tensor, usize),
}

#[cfg(feature = "cuda")]
impl<'a> EdgeWeights<'a> {
    /// The same weights for a GPU op (per-head weights must be a device tensor).
    pub(crate) fn on_device(self, op: &'static str) -> Result<crate::cuda::DeviceWeights<'a>> {
        use crate::cuda::DeviceWeights;
        Ok(match self {
            EdgeWeights::Ones => DeviceWeights::Ones,
            EdgeWeights::Stored => DeviceWeights::Stored,
            EdgeWeights::PerHead(v, h) => DeviceWeights::PerHead(v.on_device(op)?, h),
        })
    }
}

/// Output of [`Stream::softmax_nll`].
pub type LossOutput = crate::cpu::LossSums;

/// Work per piece when a cancellable stream cuts a kernel (see `Stream::run_rows`): each is
/// about ten milliseconds on one core, so a cancelled epoch stops that soon.
/// Multiply-adds per GEMM piece.
pub(crate) const GEMM_PIECE: usize = 1 << 29;
/// Gathered elements per SpMM piece.
pub(crate) const SPMM_PIECE: usize = 1 << 24;
/// Elements per piece of an element-wise kernel.
pub(crate) const ELEMENTWISE_PIECE: usize = 1 << 22;

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

/// Returns `$body` (with `$g` the CUDA stream) from the enclosing op when `$stream` runs on a
/// GPU; on the CPU the op goes on to its reference code. Operands reach the GPU arm through
/// `Tensor::on_device` (a host tensor there is a typed error).
macro_rules! on_gpu {
    ($stream:expr, |$g:ident| $body:expr) => {
        #[cfg(feature = "cuda")]
        if let Some($g) = $stream.gpu() {
            return $body;
        }
    };
}
pub(crate) use on_gpu;

impl Stream {
    /// Checks that an op may start: this stream's work was not cancelled.
    pub(crate) fn admit(&self) -> Result<()> {
        self.check_cancelled()
    }

    /// Sets every element of `t` to `v`.
    pub fn fill(&self, t: &mut Tensor, v: f32) -> Result<()> {
        self.admit()?;
        on_gpu!(self, |_g| {
            let (rows, cols) = t.shape();
            *t = if v == 0.0 {
                self.zeros(rows, cols)?
            } else {
                self.upload(&vec![v; rows * cols], rows, cols)?
            };
            Ok(())
        });
        t.host_mut("fill")?.iter_mut().for_each(|x| *x = v);
        Ok(())
    }

    /// A copy of `t` in this stream's memory (device to device on a GPU, with allocation
    /// failures as errors rather than the panic of `Tensor::clone`).
    pub fn copy(&self, t: &Tensor) -> Result<Tensor> {
        self.admit()?;
        on_gpu!(self, |g| Ok(Tensor::from_device(
            g.clone_tensor(t.on_device("copy")?)?
        )));
        Tensor::from_vec(t.rows(), t.cols(), t.host("copy")?.to_vec())
    }

    /// A copy of the first `rows` rows of `t` (all of them if it has fewer).
    pub fn copy_rows_prefix(&self, t: &Tensor, rows: usize) -> Result<Tensor> {
        self.admit()?;
        let rows = rows.min(t.rows());
        on_gpu!(self, |g| {
            let mut out = Tensor::from_device(g.clone_tensor(t.on_device("copy_rows_prefix")?)?);
            out.truncate_rows(rows);
            Ok(out)
        });
        let values = &t.host("copy_rows_prefix")?[..rows * t.cols()];
        Tensor::from_vec(rows, t.cols(), values.to_vec())
    }

    /// Appends the host rows `rows` (row-major, `t`'s width) below `t`'s rows.
    pub fn append_rows(&self, t: &mut Tensor, rows: &[f32]) -> Result<()> {
        self.admit()?;
        on_gpu!(self, |_g| {
            let bottom = self.upload(rows, rows.len() / t.cols().max(1), t.cols())?;
            self.concat_rows(t, &bottom)
        });
        t.append_rows(rows)
    }

    /// Appends `bottom`'s rows (same width, in this stream's memory) below `t`'s rows.
    pub fn concat_rows(&self, t: &mut Tensor, bottom: &Tensor) -> Result<()> {
        self.admit()?;
        check("concat_rows", t.cols() == bottom.cols(), || {
            format!("{:?} over {:?}", t.shape(), bottom.shape())
        })?;
        on_gpu!(self, |g| {
            let (top, bottom) = (
                t.on_device("concat_rows")?,
                bottom.on_device("concat_rows")?,
            );
            *t = Tensor::from_device(g.concat_rows(top, bottom)?);
            Ok(())
        });
        t.append_rows(bottom.host("concat_rows")?)
    }

    /// Hex digest of the tensors' bytes, in order (downloaded first on a GPU).
    pub fn digest(&self, tensors: &[&Tensor]) -> Result<String> {
        on_gpu!(self, |g| {
            let d = tensors
                .iter()
                .map(|t| t.on_device("digest"))
                .collect::<Result<Vec<_>>>()?;
            g.digest(&d)
        });
        let host = tensors
            .iter()
            .map(|t| t.host("digest"))
            .collect::<Result<Vec<_>>>()?;
        Ok(crate::digest_f32(host))
    }
}
