//! Dense ops on device operands: bias, column sums, activations, ReLU bit masks, axpy,
//! dropout, softmax-NLL, accuracy and the optimizer steps.
//! (The invariant every `unsafe` launch here relies on is stated in `launch.rs`.)
use super::launch::{act_code, grid, grid1, launch, layer_site, DeviceBits, BLOCK};
use super::memory::{DeviceCsr, DeviceIndex, DeviceTensor};
use super::stream::GpuStream;
use crate::ops::{check, check_same_shape, Activation, AdamConfig, SgdConfig};
use crate::rng::{dropout_scale, dropout_threshold};
use crate::{DropoutKey, LossOutput, Result};
use cudarc::driver::PushKernelArg;

impl GpuStream {
    /// `x[i, :] += bias`.
    pub fn add_bias(&self, x: &mut DeviceTensor, bias: &DeviceTensor) -> Result<()> {
        check("add_bias", bias.len() == x.cols, || {
            format!("bias {} for width {}", bias.len(), x.cols)
        })?;
        let (n, width) = (x.len() as u64, x.cols as u64);
        // SAFETY: module invariant (1)-(4); i < n = rows * width, bias index i % width < width.
        unsafe {
            launch!(
                self,
                "trellis_add_bias",
                grid1(x.len()),
                [&mut x.buf, &n, &bias.buf, &width]
            )
        }
    }

    /// `out += column sums of g`, summed as the CPU backend does (blocks of
    /// [`crate::cpu::COLUMN_SUM_BLOCK_ROWS`] rows in row order, then the blocks in order).
    pub fn add_column_sums(&self, g: &DeviceTensor, out: &mut DeviceTensor) -> Result<()> {
        check("add_column_sums", out.len() == g.cols, || {
            format!("out {} for width {}", out.len(), g.cols)
        })?;
        if g.is_empty() {
            return Ok(());
        }
        let block_rows = crate::cpu::COLUMN_SUM_BLOCK_ROWS as u64;
        let (rows, width) = (g.rows as u64, g.cols as u64);
        let n_blocks = rows.div_ceil(block_rows);
        let mut partial = self.alloc_zeros::<f32>((n_blocks * width) as usize)?;
        // SAFETY: module invariant (1)-(4); thread (b, c) reads rows of block b (< rows) and
        // writes partial[b * width + c], n_blocks * width long.
        unsafe {
            launch!(
                self,
                "trellis_column_sums_partial",
                grid(n_blocks * width, BLOCK as u64),
                [&g.buf, &rows, &width, &block_rows, &mut partial,]
            )?;
        }
        // SAFETY: module invariant (1)-(4); n_blocks >= 1 (g is not empty), so partial[c] and
        // partial[b * width + c] for b < n_blocks exist; out has width elements.
        unsafe {
            launch!(
                self,
                "trellis_column_sums_finish",
                grid1(g.cols),
                [&partial, &n_blocks, &width, &mut out.buf,]
            )
        }
    }

    /// `act(x)` as a new tensor.
    pub fn activation(&self, act: Activation, x: &DeviceTensor) -> Result<DeviceTensor> {
        let mut y = self.zeros(x.rows, x.cols)?;
        let (kind, param) = act_code(act);
        let n = x.len() as u64;
        // SAFETY: module invariant (1)-(4); x and y both hold n elements.
        unsafe {
            launch!(
                self,
                "trellis_activation",
                grid1(x.len()),
                [&kind, &param, &x.buf, &mut y.buf, &n]
            )?;
        }
        Ok(y)
    }

    /// `x = act(x)` in place.
    pub fn activate(&self, act: Activation, x: &mut DeviceTensor) -> Result<()> {
        if act == Activation::Identity {
            return Ok(());
        }
        let (kind, param) = act_code(act);
        let n = x.len() as u64;
        // SAFETY: module invariant (1)-(4); x holds n elements.
        unsafe {
            launch!(
                self,
                "trellis_activate_inplace",
                grid1(x.len()),
                [&kind, &param, &mut x.buf, &n]
            )
        }
    }

    /// `gy * act'(x)` as a new tensor.
    pub fn activation_backward(
        &self,
        act: Activation,
        x: &DeviceTensor,
        gy: &DeviceTensor,
    ) -> Result<DeviceTensor> {
        check_same_shape("activation_backward", x.shape(), gy.shape())?;
        let mut gx = self.zeros(x.rows, x.cols)?;
        let (kind, param) = act_code(act);
        let n = x.len() as u64;
        // SAFETY: module invariant (1)-(4); x, gy and gx all hold n elements.
        unsafe {
            launch!(
                self,
                "trellis_activation_backward",
                grid1(x.len()),
                [&kind, &param, &x.buf, &gy.buf, &mut gx.buf, &n,]
            )?;
        }
        Ok(gx)
    }

    /// `gy *= act'(x)` with the derivative taken from the output `y = act(x)`.
    pub fn activation_backward_from_output(
        &self,
        act: Activation,
        y: &DeviceTensor,
        gy: &mut DeviceTensor,
    ) -> Result<()> {
        check_same_shape("activation_backward_from_output", y.shape(), gy.shape())?;
        if act == Activation::Identity {
            return Ok(());
        }
        let (kind, param) = act_code(act);
        let n = y.len() as u64;
        // SAFETY: module invariant (1)-(4); y and gy both hold n elements.
        unsafe {
            launch!(
                self,
                "trellis_activation_backward_from_output",
                grid1(y.len()),
                [&kind, &param, &y.buf, &mut gy.buf, &n,]
            )
        }
    }

    /// One bit per element of `y`, set where `y > 0`.
    pub fn positive_bits(&self, y: &DeviceTensor) -> Result<DeviceBits> {
        let n_words = y.len().div_ceil(64);
        let mut words = self.alloc_zeros::<u64>(n_words)?;
        let (n, nw) = (y.len() as u64, n_words as u64);
        // SAFETY: module invariant (1)-(4); word w reads y[64 w .. 64 w + 64) below n only.
        unsafe {
            launch!(
                self,
                "trellis_positive_bits",
                grid1(n_words),
                [&y.buf, &n, &mut words, &nw]
            )?;
        }
        Ok(DeviceBits {
            len: y.len(),
            words,
        })
    }

    /// The bits of [`GpuStream::positive_bits`] on the host (as [`crate::Stream::positive_bits`]).
    pub fn download_bits(&self, bits: &DeviceBits) -> Result<Vec<u64>> {
        self.download_slice(&bits.words, bits.len.div_ceil(64))
    }

    /// Zeroes the elements of `g` whose bit is clear.
    pub fn mask_by_bits(&self, bits: &DeviceBits, g: &mut DeviceTensor) -> Result<()> {
        check("mask_by_bits", bits.len == g.len(), || {
            format!("bits of {} elements for {}", bits.len, g.len())
        })?;
        let n = g.len() as u64;
        // SAFETY: module invariant (1)-(4); element i < n reads word i / 64 < ceil(n / 64).
        unsafe {
            launch!(
                self,
                "trellis_mask_by_bits",
                grid1(g.len()),
                [&bits.words, &mut g.buf, &n]
            )
        }
    }

    /// `y += alpha * x`.
    pub fn axpy(&self, alpha: f32, x: &DeviceTensor, y: &mut DeviceTensor) -> Result<()> {
        check_same_shape("axpy", x.shape(), y.shape())?;
        let n = x.len() as u64;
        // SAFETY: module invariant (1)-(4); x and y both hold n elements.
        unsafe {
            launch!(
                self,
                "trellis_axpy",
                grid1(x.len()),
                [&alpha, &x.buf, &mut y.buf, &n]
            )
        }
    }

    /// `dst[..src.rows()] += src` (adds into a row prefix of `dst`).
    pub fn add_rows_prefix(&self, src: &DeviceTensor, dst: &mut DeviceTensor) -> Result<()> {
        check(
            "add_rows_prefix",
            src.cols == dst.cols && src.rows <= dst.rows,
            || format!("{:?} into {:?}", src.shape(), dst.shape()),
        )?;
        let alpha = 1.0f32;
        let n = src.len() as u64;
        // SAFETY: module invariant (1)-(4); the kernel touches the first n = src.len() <=
        // dst.len() elements of both.
        unsafe {
            launch!(
                self,
                "trellis_axpy",
                grid1(src.len()),
                [&alpha, &src.buf, &mut dst.buf, &n]
            )
        }
    }

    /// Inverted dropout in place, keyed by the rows' global ids: the CPU backend's mask.
    pub fn dropout(
        &self,
        x: &mut DeviceTensor,
        gids: &DeviceIndex,
        key: DropoutKey,
        p: f32,
    ) -> Result<()> {
        check("dropout", gids.len == x.rows, || {
            format!("{} ids for {} rows", gids.len, x.rows)
        })?;
        if p <= 0.0 || x.is_empty() {
            return Ok(());
        }
        let (rows, width) = (x.rows as u64, x.cols as u64);
        let (thr, scale, ls) = (dropout_threshold(p), dropout_scale(p), layer_site(key));
        let n_blocks = x.rows * x.cols.div_ceil(8);
        // SAFETY: module invariant (1)-(4); thread (r, b) touches row r < rows, columns
        // 8 b .. min(8 b + 8, width), and reads gids[r] (gids holds rows ids).
        unsafe {
            launch!(
                self,
                "trellis_dropout",
                grid1(n_blocks),
                [&mut x.buf, &rows, &width, &gids.idx, &key.seed, &key.epoch, &ls, &thr, &scale,]
            )
        }
    }

    /// Dropout of a sparse matrix's stored values, with the mask of [`GpuStream::dropout`] on
    /// its dense form (rows keyed by `gids`).
    pub fn dropout_csr(
        &self,
        m: &mut DeviceCsr,
        gids: &DeviceIndex,
        key: DropoutKey,
        p: f32,
    ) -> Result<()> {
        check(
            "dropout_csr",
            gids.len == m.n_rows && m.values.is_some(),
            || {
                format!(
                    "{} ids for {} rows (values stored: {})",
                    gids.len,
                    m.n_rows,
                    m.values.is_some()
                )
            },
        )?;
        if p <= 0.0 {
            return Ok(());
        }
        let nnz = m.nnz as u64;
        let (thr, scale, ls) = (dropout_threshold(p), dropout_scale(p), layer_site(key));
        let vals = m.values.as_mut().expect("checked above");
        // SAFETY: module invariant (1)-(4); entry e < nnz reads entry_rows[e] < n_rows = gids
        // length and writes vals[e].
        unsafe {
            launch!(
                self,
                "trellis_dropout_csr",
                grid1(m.nnz),
                [
                    &m.entry_rows,
                    &m.indices,
                    vals,
                    &nnz,
                    &gids.idx,
                    &key.seed,
                    &key.epoch,
                    &ls,
                    &thr,
                    &scale,
                ]
            )
        }
    }

    /// Dropout over CSR entries (`heads` values per entry), keyed by the row's global id.
    pub fn edge_dropout(
        &self,
        csr: &DeviceCsr,
        vals: &mut DeviceTensor,
        heads: usize,
        gids: &DeviceIndex,
        key: DropoutKey,
        p: f32,
    ) -> Result<()> {
        check(
            "edge_dropout",
            gids.len == csr.n_rows && heads >= 1 && vals.len() == csr.nnz * heads,
            || {
                format!(
                    "{} ids for {} rows, {} values",
                    gids.len,
                    csr.n_rows,
                    vals.len()
                )
            },
        )?;
        if p <= 0.0 {
            return Ok(());
        }
        let (nnz, h) = (csr.nnz as u64, heads as u32);
        let (thr, scale, ls) = (dropout_threshold(p), dropout_scale(p), layer_site(key));
        // SAFETY: module invariant (1)-(4); value i < nnz * heads reads entry_rows[i / heads],
        // indptr of that row and its gid.
        unsafe {
            launch!(
                self,
                "trellis_edge_dropout",
                grid1(csr.nnz * heads),
                [
                    &csr.entry_rows,
                    &csr.indptr,
                    &mut vals.buf,
                    &nnz,
                    &h,
                    &gids.idx,
                    &key.seed,
                    &key.epoch,
                    &ls,
                    &thr,
                    &scale,
                ]
            )
        }
    }

    /// Log-softmax + NLL over `rows`; `grad` receives the gradient of `scale * loss_sum`.
    /// Per-row losses are computed on the device and summed on the host in `rows` order.
    pub fn softmax_nll(
        &self,
        logits: &DeviceTensor,
        labels: &DeviceIndex,
        rows: &[u32],
        scale: f32,
        grad: &mut DeviceTensor,
    ) -> Result<LossOutput> {
        let (n, classes) = logits.shape();
        check(
            "softmax_nll",
            labels.len == n
                && grad.shape() == logits.shape()
                && labels.bound <= classes
                && rows.iter().all(|&r| (r as usize) < n),
            || {
                format!(
                    "logits {:?}, {} labels (bound {}), rows in range",
                    logits.shape(),
                    labels.len,
                    labels.bound
                )
            },
        )?;
        let mut times = vec![0u32; n];
        for &r in rows {
            times[r as usize] += 1;
        }
        let times = self.upload_slice(&times)?;
        let mut row_loss = self.alloc_zeros::<f64>(n)?;
        let mut row_hit = self.alloc_zeros::<u32>(n)?;
        let (n64, c64) = (n as u64, classes as u64);
        let cfg = if classes == 0 { None } else { grid1(n) };
        // SAFETY: module invariant (1)-(4); row r < n reads logits/grad row r (classes
        // values), labels[r] < classes (bound checked), times[r]; writes row_loss[r], row_hit[r].
        unsafe {
            launch!(
                self,
                "trellis_softmax_nll",
                cfg,
                [
                    &logits.buf,
                    &n64,
                    &c64,
                    &labels.idx,
                    &times,
                    &scale,
                    &mut grad.buf,
                    &mut row_loss,
                    &mut row_hit,
                ]
            )?;
        }
        let loss = self.download_slice(&row_loss, n)?;
        let hit = self.download_slice(&row_hit, n)?;
        Ok(LossOutput {
            loss_sum: rows.iter().map(|&r| loss[r as usize]).sum(),
            correct: rows.iter().filter(|&&r| hit[r as usize] != 0).count(),
            count: rows.len(),
        })
    }

    /// Number of `rows` predicted correctly (argmax).
    pub fn accuracy_count(
        &self,
        logits: &DeviceTensor,
        labels: &DeviceIndex,
        rows: &DeviceIndex,
    ) -> Result<usize> {
        check(
            "accuracy_count",
            labels.len == logits.rows && rows.bound <= logits.rows,
            || {
                format!(
                    "logits {:?}, {} labels, rows bound {}",
                    logits.shape(),
                    labels.len,
                    rows.bound
                )
            },
        )?;
        if logits.cols == 0 {
            return Ok(0);
        }
        let mut count = self.alloc_zeros::<u32>(1)?;
        let (classes, n_sel) = (logits.cols as u64, rows.len as u64);
        // SAFETY: module invariant (1)-(4); selected rows are < logits.rows (bound checked),
        // count holds one u32.
        unsafe {
            launch!(
                self,
                "trellis_accuracy_count",
                grid1(rows.len),
                [
                    &logits.buf,
                    &classes,
                    &labels.idx,
                    &rows.idx,
                    &n_sel,
                    &mut count,
                ]
            )?;
        }
        Ok(self.download_slice(&count, 1)?[0] as usize)
    }

    /// One Adam step on `param` (`t` from 1).
    pub fn adam_step(
        &self,
        cfg: &AdamConfig,
        t: u64,
        param: &mut DeviceTensor,
        grad: &DeviceTensor,
        m: &mut DeviceTensor,
        v: &mut DeviceTensor,
    ) -> Result<()> {
        check(
            "adam_step",
            grad.len() == param.len() && m.len() == param.len() && v.len() == param.len(),
            || "state sizes differ".into(),
        )?;
        check("adam_step", t >= 1, || "steps count from 1".into())?;
        let (step, bc2_sqrt) = cfg.bias_correction(t);
        let n = param.len() as u64;
        // SAFETY: module invariant (1)-(4); param, grad, m and v all hold n elements.
        unsafe {
            launch!(
                self,
                "trellis_adam",
                grid1(param.len()),
                [
                    &mut param.buf,
                    &grad.buf,
                    &mut m.buf,
                    &mut v.buf,
                    &n,
                    &step,
                    &bc2_sqrt,
                    &cfg.beta1,
                    &cfg.beta2,
                    &cfg.eps,
                    &cfg.weight_decay,
                ]
            )
        }
    }

    /// One SGD step on `param`.
    pub fn sgd_step(
        &self,
        cfg: &SgdConfig,
        param: &mut DeviceTensor,
        grad: &DeviceTensor,
        buf: &mut DeviceTensor,
    ) -> Result<()> {
        check(
            "sgd_step",
            grad.len() == param.len() && buf.len() == param.len(),
            || "state sizes differ".into(),
        )?;
        let n = param.len() as u64;
        // SAFETY: module invariant (1)-(4); param, grad and buf all hold n elements.
        unsafe {
            launch!(
                self,
                "trellis_sgd",
                grid1(param.len()),
                [
                    &mut param.buf,
                    &grad.buf,
                    &mut buf.buf,
                    &n,
                    &cfg.lr,
                    &cfg.momentum,
                    &cfg.weight_decay,
                ]
            )
        }
    }
}
