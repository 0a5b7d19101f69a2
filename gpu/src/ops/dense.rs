//! Dense ops of the [`Stream`] API: products, element-wise kernels, dropout, loss and
//! optimizer steps. Each checks shapes, then runs on the stream's GPU (`on_gpu!`) or the CPU
//! reference kernels.
use super::{
    check, check_same_shape, gemm_prefix_dims, on_gpu, Activation, AdamConfig, LossOutput,
    SgdConfig, ELEMENTWISE_PIECE, GEMM_PIECE,
};
use crate::cpu;
use crate::stream::KernelKind;
use crate::tensor::{Bits, BitsStorage};
use crate::{DropoutKey, Result, Stream, Tensor};

impl Stream {
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
        on_gpu!(self, |g| g.gemm_prefix(
            alpha,
            a.on_device("gemm")?,
            a_rows,
            trans_a,
            b.on_device("gemm")?,
            trans_b,
            beta,
            c.on_device_mut("gemm")?,
        ));
        let a_data = &a.host("gemm")?[..a_rows * a.cols()];
        let threads = self.threads();
        let b = b.host("gemm")?;
        let c = c.host_mut("gemm")?;
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
        on_gpu!(self, |g| g.add_rows_prefix(
            src.on_device("add_rows_prefix")?,
            dst.on_device_mut("add_rows_prefix")?
        ));
        let (n, src) = (src.len(), src.host("add_rows_prefix")?);
        let dst = &mut dst.host_mut("add_rows_prefix")?[..n];
        self.run(|| cpu::axpy(1.0, src, dst));
        Ok(())
    }

    /// `op(a) * op(b)` into a new tensor.
    pub fn matmul(&self, a: &Tensor, trans_a: bool, b: &Tensor, trans_b: bool) -> Result<Tensor> {
        let m = if trans_a { a.cols() } else { a.rows() };
        let n = if trans_b { b.rows() } else { b.cols() };
        let mut c = self.zeros(m, n)?;
        self.gemm(1.0, a, trans_a, b, trans_b, 0.0, &mut c)?;
        Ok(c)
    }

    /// `x[i, :] += bias`.
    pub fn add_bias(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        self.admit()?;
        check("add_bias", bias.len() == x.cols(), || {
            format!("bias {} for width {}", bias.len(), x.cols())
        })?;
        on_gpu!(self, |g| g.add_bias(
            x.on_device_mut("add_bias")?,
            bias.on_device("add_bias")?
        ));
        let (w, x, b) = (x.cols(), x.host_mut("add_bias")?, bias.host("add_bias")?);
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
        on_gpu!(self, |gs| gs.add_column_sums(
            g.on_device("add_column_sums")?,
            out.on_device_mut("add_column_sums")?
        ));
        let mut sums = vec![0.0; g.cols()];
        let (w, g) = (g.cols(), g.host("add_column_sums")?);
        self.run(|| cpu::column_sums(g, w, &mut sums));
        out.host_mut("add_column_sums")?
            .iter_mut()
            .zip(&sums)
            .for_each(|(o, s)| *o += s);
        Ok(())
    }

    /// `act(x)` as a new tensor.
    pub fn activation(&self, act: Activation, x: &Tensor) -> Result<Tensor> {
        self.admit()?;
        on_gpu!(self, |g| Ok(Tensor::from_device(
            g.activation(act, x.on_device("activation")?)?
        )));
        let mut y = Tensor::zeros(x.rows(), x.cols());
        let (x, out) = (x.host("activation")?, y.as_mut_slice());
        self.run(|| cpu::activation(act, x, out));
        Ok(y)
    }

    /// `x = act(x)` in place.
    pub fn activate(&self, act: Activation, x: &mut Tensor) -> Result<()> {
        self.admit()?;
        if act == Activation::Identity {
            return Ok(());
        }
        on_gpu!(self, |g| g.activate(act, x.on_device_mut("activate")?));
        use rayon::prelude::*;
        let x = x.host_mut("activate")?;
        self.run_rows(KernelKind::Other, x.len(), ELEMENTWISE_PIECE, |r| {
            x[r].par_chunks_mut(16_384)
                .for_each(|c| c.iter_mut().for_each(|v| *v = act.apply(*v)))
        })
    }

    /// `gy * act'(x)` as a new tensor.
    pub fn activation_backward(&self, act: Activation, x: &Tensor, gy: &Tensor) -> Result<Tensor> {
        self.admit()?;
        check_same_shape("activation_backward", x.shape(), gy.shape())?;
        on_gpu!(self, |g| Ok(Tensor::from_device(g.activation_backward(
            act,
            x.on_device("activation_backward")?,
            gy.on_device("activation_backward")?
        )?)));
        let mut gx = Tensor::zeros(x.rows(), x.cols());
        let (x, gy) = (
            x.host("activation_backward")?,
            gy.host("activation_backward")?,
        );
        let out = gx.as_mut_slice();
        self.run(|| cpu::activation_backward(act, x, gy, out));
        Ok(gx)
    }

    /// `gy * act'(x)` in place in `gy`, with the derivative taken from the output `y = act(x)`.
    pub fn activation_backward_from_output(
        &self,
        act: Activation,
        y: &Tensor,
        gy: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "activation_backward_from_output";
        self.admit()?;
        check_same_shape(OP, y.shape(), gy.shape())?;
        if act == Activation::Identity {
            return Ok(());
        }
        on_gpu!(self, |g| g.activation_backward_from_output(
            act,
            y.on_device(OP)?,
            gy.on_device_mut(OP)?
        ));
        use rayon::prelude::*;
        let (gy, y) = (gy.host_mut(OP)?, y.host(OP)?);
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
    pub fn positive_bits(&self, y: &Tensor) -> Result<Bits> {
        self.admit()?;
        on_gpu!(self, |g| Ok(Bits(BitsStorage::Cuda(
            g.positive_bits(y.on_device("positive_bits")?)?
        ))));
        use rayon::prelude::*;
        let y = y.host("positive_bits")?;
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
        Ok(Bits::from_words(bits))
    }

    /// The words of `bits` on the host (64 elements each, element `k` in bit `k`).
    pub fn download_bits(&self, bits: &Bits) -> Result<Vec<u64>> {
        match &bits.0 {
            BitsStorage::Host(w) => Ok(w.clone()),
            #[cfg(feature = "cuda")]
            BitsStorage::Cuda(b) => match self.gpu() {
                Some(g) => g.download_bits(b),
                None => Err(crate::GpuError::wrong_device(
                    "download_bits",
                    self.device(),
                    "cuda",
                )),
            },
        }
    }

    /// Zeroes the elements of `g` whose bit in `bits` (from [`Stream::positive_bits`]) is clear.
    pub fn mask_by_bits(&self, bits: &Bits, g: &mut Tensor) -> Result<()> {
        self.admit()?;
        check("mask_by_bits", bits.words() == g.len().div_ceil(64), || {
            format!("{} words for {} elements", bits.words(), g.len())
        })?;
        on_gpu!(self, |gs| match &bits.0 {
            BitsStorage::Cuda(b) => gs.mask_by_bits(b, g.on_device_mut("mask_by_bits")?),
            BitsStorage::Host(_) => Err(crate::GpuError::wrong_device(
                "mask_by_bits",
                self.device(),
                crate::Device::Cpu
            )),
        });
        let bits = bits
            .host_words()
            .ok_or_else(|| crate::GpuError::wrong_device("mask_by_bits", self.device(), "cuda"))?;
        use rayon::prelude::*;
        let g = g.host_mut("mask_by_bits")?;
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
        on_gpu!(self, |g| g.dropout(
            x.on_device_mut("dropout")?,
            &g.upload_ids(gids)?,
            key,
            p
        ));
        let (w, x) = (x.cols(), x.host_mut("dropout")?);
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
        on_gpu!(self, |_g| {
            *dst = self.dropout_copy(src, gids, key, p)?;
            Ok(())
        });
        let (w, src, dst) = (
            src.cols(),
            src.host("dropout_into")?,
            dst.host_mut("dropout_into")?,
        );
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
        on_gpu!(self, |g| {
            let mut out = g.clone_tensor(src.on_device("dropout_copy")?)?;
            g.dropout(&mut out, &g.upload_ids(gids)?, key, p)?;
            Ok(Tensor::from_device(out))
        });
        let (rows, w, n) = (src.rows(), src.cols(), src.len());
        let src = src.host("dropout_copy")?;
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

    /// `y += alpha * x`.
    pub fn axpy(&self, alpha: f32, x: &Tensor, y: &mut Tensor) -> Result<()> {
        self.admit()?;
        check_same_shape("axpy", x.shape(), y.shape())?;
        on_gpu!(self, |g| g.axpy(
            alpha,
            x.on_device("axpy")?,
            y.on_device_mut("axpy")?
        ));
        let (x, y) = (x.host("axpy")?, y.host_mut("axpy")?);
        self.run(|| cpu::axpy(alpha, x, y));
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
        on_gpu!(self, |g| g.softmax_nll(
            logits.on_device("softmax_nll")?,
            &g.upload_ids(labels)?,
            rows,
            scale,
            grad.on_device_mut("softmax_nll")?
        ));
        let (logits, grad) = (logits.host("softmax_nll")?, grad.host_mut("softmax_nll")?);
        Ok(self.run(|| cpu::softmax_nll(logits, classes, labels, rows, scale, grad)))
    }

    /// Number of `rows` predicted correctly (argmax).
    pub fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> Result<usize> {
        self.admit()?;
        check(
            "accuracy_count",
            labels.len() == logits.rows() && rows.iter().all(|&r| (r as usize) < logits.rows()),
            || format!("logits {:?}, {} labels", logits.shape(), labels.len()),
        )?;
        on_gpu!(self, |g| g.accuracy_count(
            logits.on_device("accuracy_count")?,
            &g.upload_ids(labels)?,
            &g.upload_ids(rows)?
        ));
        let (classes, logits) = (logits.cols(), logits.host("accuracy_count")?);
        Ok(self.run(|| cpu::accuracy_count(logits, classes, labels, rows)))
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
        const OP: &str = "adam_step";
        self.admit()?;
        check(
            OP,
            grad.len() == param.len() && m.len() == param.len() && v.len() == param.len(),
            || "state sizes differ".into(),
        )?;
        on_gpu!(self, |g| g.adam_step(
            cfg,
            t,
            param.on_device_mut(OP)?,
            grad.on_device(OP)?,
            m.on_device_mut(OP)?,
            v.on_device_mut(OP)?
        ));
        let (param, grad) = (param.host_mut(OP)?, grad.host(OP)?);
        let (m, v) = (m.host_mut(OP)?, v.host_mut(OP)?);
        self.run(|| cpu::adam_step(cfg, t, param, grad, m, v));
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
        const OP: &str = "sgd_step";
        self.admit()?;
        check(
            OP,
            grad.len() == param.len() && buf.len() == param.len(),
            || "state sizes differ".into(),
        )?;
        on_gpu!(self, |g| g.sgd_step(
            cfg,
            param.on_device_mut(OP)?,
            grad.on_device(OP)?,
            buf.on_device_mut(OP)?
        ));
        let (param, grad, buf) = (param.host_mut(OP)?, grad.host(OP)?, buf.host_mut(OP)?);
        self.run(|| cpu::sgd_step(cfg, param, grad, buf));
        Ok(())
    }
}
