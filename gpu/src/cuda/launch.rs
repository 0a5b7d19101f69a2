//! The op API on device operands: one method per kernel of `kernels.cu`, which checks shapes
//! and index bounds on the host, picks the grid, and enqueues the kernel on the compute stream.
//!
//! The invariant every `unsafe` launch below relies on: (1) the arguments are pushed in the
//! order and with the types of the kernel's signature in `kernels.cu`; (2) the kernel touches
//! only elements below the sizes it is given, and those sizes were checked against the
//! buffers' lengths just before (buffers hold at least their logical length); (3) index
//! operands were checked against the rows they index (host-side bounds of [`DeviceIndex`] and
//! [`DeviceCsr`], validated when uploaded); (4) buffer lifetime vs stream completion: every
//! buffer is borrowed until the launch is enqueued, and cudarc frees device memory in stream
//! order (and makes other streams wait on its recorded events), so no kernel can see a freed
//! buffer.
use super::memory::{DeviceCsr, DeviceIndex, DeviceTensor};
use super::stream::GpuStream;
use crate::ops::{Activation, AdamConfig, SgdConfig};
use crate::rng::{dropout_scale, dropout_threshold};
use crate::{DropoutKey, GpuError, LossOutput, Result};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Threads per block of every kernel (a multiple of the warp size).
pub(crate) const BLOCK: u32 = 256;
/// Most blocks launched; grid-stride loops cover the rest.
const MAX_BLOCKS: u64 = 1 << 20;

/// The grid for a grid-stride loop over `items` work items, `per_block` items per block per
/// pass; `None` when there is nothing to do (a zero-block launch is an error in CUDA).
pub(crate) fn grid(items: u64, per_block: u64) -> Option<LaunchConfig> {
    if items == 0 {
        return None;
    }
    let blocks = items.div_ceil(per_block.max(1)).min(MAX_BLOCKS) as u32;
    Some(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One thread per item.
fn grid1(items: usize) -> Option<LaunchConfig> {
    grid(items as u64, BLOCK as u64)
}

/// Enqueues kernel `$name` on the compute stream with `$args` (each a reference that outlives
/// the statement) if `$cfg` is `Some`. Must be used inside an `unsafe` block whose comment
/// states why the launch is sound.
macro_rules! launch {
    ($s:expr, $name:literal, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        match $cfg {
            None => Ok(()),
            Some(cfg) => {
                let f = $s.dev.kernel($name)?;
                let mut b = $s.compute.launch_builder(f);
                $( b.arg($arg); )*
                b.launch(cfg).map(|_| ()).map_err(|e| GpuError::cuda($name, e))
            }
        }
    }};
}

fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::shape(op, detail()))
    }
}

/// Per-entry weights for [`GpuStream::spmm`] (as [`crate::EdgeWeights`], on the device).
#[derive(Debug, Clone, Copy)]
pub enum DeviceWeights<'a> {
    /// Every entry weighs 1.
    Ones,
    /// The matrix's own values.
    Stored,
    /// `heads` weights per entry, entry-major (an `nnz x heads` tensor).
    PerHead(&'a DeviceTensor, usize),
}

/// One bit per element, set where the element is positive (ReLU's backward mask).
#[derive(Debug)]
pub struct DeviceBits {
    len: usize,
    words: CudaSlice<u64>,
}

fn act_code(act: Activation) -> (i32, f32) {
    match act {
        Activation::Identity => (0, 0.0),
        Activation::Relu => (1, 0.0),
        Activation::Elu { alpha } => (2, alpha),
        Activation::LeakyRelu { slope } => (3, slope),
    }
}

impl GpuStream {
    /// `out = A x` (or `out += A x` with `accumulate`), `heads` column blocks of `x`.
    pub fn spmm(
        &self,
        a: &DeviceCsr,
        w: DeviceWeights<'_>,
        x: &DeviceTensor,
        out: &mut DeviceTensor,
        accumulate: bool,
    ) -> Result<()> {
        check(
            "spmm",
            x.rows == a.n_cols && out.shape() == (a.n_rows, x.cols),
            || {
                format!(
                    "A {}x{}, x {:?}, out {:?}",
                    a.n_rows,
                    a.n_cols,
                    x.shape(),
                    out.shape()
                )
            },
        )?;
        let (weights, mode, heads) = match w {
            DeviceWeights::Ones => (&self.dummy, 0i32, 1usize),
            DeviceWeights::Stored => {
                let v = a
                    .values
                    .as_ref()
                    .ok_or_else(|| GpuError::shape("spmm", "matrix has no stored values"))?;
                (v, 1, 1)
            }
            DeviceWeights::PerHead(v, h) => {
                check(
                    "spmm",
                    h >= 1 && v.len() == a.nnz * h && x.cols % h == 0,
                    || {
                        format!(
                            "{} weights, {} entries x {h} heads, width {}",
                            v.len(),
                            a.nnz,
                            x.cols
                        )
                    },
                )?;
                (&v.buf, 2, h)
            }
        };
        let (heads, n_rows, width) = (heads as u32, a.n_rows as u64, x.cols as u64);
        let acc = accumulate as i32;
        let cfg = if width == 0 {
            None
        } else {
            grid(n_rows, (BLOCK / 32) as u64)
        };
        // SAFETY: module invariant (1)-(4); the kernel reads indptr[0..=n_rows], the entries
        // they span (< nnz), x rows < n_cols (the CSR was validated on upload), weights below
        // nnz * heads, and writes out[0..n_rows * width].
        unsafe {
            launch!(
                self,
                "trellis_spmm",
                cfg,
                [
                    &a.indptr,
                    &a.indices,
                    weights,
                    &mode,
                    &heads,
                    &n_rows,
                    &x.buf,
                    &width,
                    &mut out.buf,
                    &acc,
                ]
            )
        }
    }

    /// Per-entry, per-head dot products `<a[row], b[col]>` (an `nnz x heads` tensor).
    pub fn sddmm_dot(
        &self,
        csr: &DeviceCsr,
        heads: usize,
        a: &DeviceTensor,
        b: &DeviceTensor,
    ) -> Result<DeviceTensor> {
        check(
            "sddmm_dot",
            a.rows == csr.n_rows
                && b.rows == csr.n_cols
                && a.cols == b.cols
                && heads >= 1
                && a.cols % heads == 0,
            || {
                format!(
                    "csr {}x{}, a {:?}, b {:?}, heads {heads}",
                    csr.n_rows,
                    csr.n_cols,
                    a.shape(),
                    b.shape()
                )
            },
        )?;
        let mut out = self.zeros(csr.nnz, heads)?;
        let (nnz, h, width) = (csr.nnz as u64, heads as u32, a.cols as u64);
        // SAFETY: module invariant (1)-(4); thread (e, h) reads a row entry_rows[e] < n_rows
        // and b row indices[e] < n_cols, columns below width, and writes out[e * heads + h].
        unsafe {
            launch!(
                self,
                "trellis_sddmm_dot",
                grid1(csr.nnz * heads),
                [
                    &csr.entry_rows,
                    &csr.indices,
                    &nnz,
                    &h,
                    &a.buf,
                    &b.buf,
                    &width,
                    &mut out.buf,
                ]
            )?;
        }
        Ok(out)
    }

    /// Per-entry, per-head sums `left[row] + right[col]` (an `nnz x heads` tensor).
    pub fn sddmm_add(
        &self,
        csr: &DeviceCsr,
        left: &DeviceTensor,
        right: &DeviceTensor,
    ) -> Result<DeviceTensor> {
        let heads = left.cols;
        check(
            "sddmm_add",
            left.rows == csr.n_rows && right.rows == csr.n_cols && right.cols == heads,
            || {
                format!(
                    "csr {}x{}, left {:?}, right {:?}",
                    csr.n_rows,
                    csr.n_cols,
                    left.shape(),
                    right.shape()
                )
            },
        )?;
        let mut out = self.zeros(csr.nnz, heads)?;
        let (nnz, h) = (csr.nnz as u64, heads as u32);
        // SAFETY: module invariant (1)-(4); reads left/right rows < n_rows / n_cols, writes
        // out[0..nnz * heads].
        unsafe {
            launch!(
                self,
                "trellis_sddmm_add",
                grid1(csr.nnz * heads),
                [
                    &csr.entry_rows,
                    &csr.indices,
                    &nnz,
                    &h,
                    &left.buf,
                    &right.buf,
                    &mut out.buf,
                ]
            )?;
        }
        Ok(out)
    }

    /// Softmax of per-entry scores (`nnz x heads`) over each row, per head.
    pub fn edge_softmax(
        &self,
        csr: &DeviceCsr,
        heads: usize,
        scores: &DeviceTensor,
    ) -> Result<DeviceTensor> {
        check(
            "edge_softmax",
            heads >= 1 && scores.len() == csr.nnz * heads,
            || {
                format!(
                    "{} scores, {} entries x {heads} heads",
                    scores.len(),
                    csr.nnz
                )
            },
        )?;
        let mut out = self.zeros(csr.nnz, heads)?;
        let (n_rows, h) = (csr.n_rows as u64, heads as u32);
        // SAFETY: module invariant (1)-(4); thread (row, h) touches entries
        // indptr[row]..indptr[row + 1] (< nnz) of scores and out, both nnz * heads long.
        unsafe {
            launch!(
                self,
                "trellis_edge_softmax",
                grid1(csr.n_rows * heads),
                [&csr.indptr, &n_rows, &h, &scores.buf, &mut out.buf,]
            )?;
        }
        Ok(out)
    }

    /// Backward of [`GpuStream::edge_softmax`] given its output `alpha` and the output gradient.
    pub fn edge_softmax_backward(
        &self,
        csr: &DeviceCsr,
        heads: usize,
        alpha: &DeviceTensor,
        grad: &DeviceTensor,
    ) -> Result<DeviceTensor> {
        check(
            "edge_softmax_backward",
            heads >= 1 && alpha.len() == csr.nnz * heads && grad.len() == alpha.len(),
            || format!("{} alpha, {} grad", alpha.len(), grad.len()),
        )?;
        let mut out = self.zeros(csr.nnz, heads)?;
        let (n_rows, h) = (csr.n_rows as u64, heads as u32);
        // SAFETY: as edge_softmax; alpha, grad and out are all nnz * heads long.
        unsafe {
            launch!(
                self,
                "trellis_edge_softmax_backward",
                grid1(csr.n_rows * heads),
                [
                    &csr.indptr,
                    &n_rows,
                    &h,
                    &alpha.buf,
                    &grad.buf,
                    &mut out.buf,
                ]
            )?;
        }
        Ok(out)
    }

    /// Rows `idx` of `x` as a new tensor.
    pub fn gather_rows(&self, x: &DeviceTensor, idx: &DeviceIndex) -> Result<DeviceTensor> {
        check("gather_rows", idx.bound <= x.rows, || {
            format!(
                "index {} out of {} rows",
                idx.bound.saturating_sub(1),
                x.rows
            )
        })?;
        let mut out = self.zeros(idx.len, x.cols)?;
        let (width, n) = (x.cols as u64, idx.len as u64);
        // SAFETY: module invariant (1)-(4); every idx < bound <= x.rows (checked above), out
        // holds n * width elements.
        unsafe {
            launch!(
                self,
                "trellis_gather_rows",
                grid1(idx.len * x.cols),
                [&x.buf, &width, &idx.idx, &n, &mut out.buf,]
            )?;
        }
        Ok(out)
    }

    /// `out[idx[r]] += src[r]`, deterministic (each target's rows added in ascending `r`).
    pub fn scatter_add_rows(
        &self,
        src: &DeviceTensor,
        idx: &DeviceIndex,
        out: &mut DeviceTensor,
    ) -> Result<()> {
        check(
            "scatter_add_rows",
            src.cols == out.cols && src.rows == idx.len && idx.bound <= out.rows,
            || {
                format!(
                    "src {:?}, {} indices (bound {}), out {:?}",
                    src.shape(),
                    idx.len,
                    idx.bound,
                    out.shape()
                )
            },
        )?;
        let p = &idx.plan;
        let (width, groups) = (out.cols as u64, p.n_groups as u64);
        // SAFETY: module invariant (1)-(4); the plan's targets are the distinct idx values
        // (< out.rows) and its order entries are source rows < idx.len = src.rows.
        unsafe {
            launch!(
                self,
                "trellis_scatter_add_rows",
                grid1(p.n_groups * out.cols),
                [
                    &src.buf,
                    &width,
                    &p.targets,
                    &p.group_ptr,
                    &p.order,
                    &groups,
                    &mut out.buf,
                ]
            )
        }
    }

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
        check("activation_backward", x.shape() == gy.shape(), || {
            format!("{:?} vs {:?}", x.shape(), gy.shape())
        })?;
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
        check(
            "activation_backward_from_output",
            y.shape() == gy.shape(),
            || format!("{:?} vs {:?}", y.shape(), gy.shape()),
        )?;
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
        check("axpy", x.shape() == y.shape(), || {
            format!("{:?} vs {:?}", x.shape(), y.shape())
        })?;
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
        let bc1 = 1.0 - (cfg.beta1 as f64).powi(t as i32);
        let bc2 = 1.0 - (cfg.beta2 as f64).powi(t as i32);
        let step = (cfg.lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
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

/// The counter word `layer << 16 | site` of a dropout key (as [`DropoutKey::counter`]).
fn layer_site(key: DropoutKey) -> u32 {
    key.counter(0, 0)[1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_every_item_and_skip_empty_work() {
        assert!(grid(0, 256).is_none());
        let g = grid(1, 256).unwrap();
        assert_eq!((g.grid_dim.0, g.block_dim.0), (1, BLOCK));
        assert_eq!(grid(257, 256).unwrap().grid_dim.0, 2);
        // Row-per-warp SpMM: 8 rows per block.
        assert_eq!(grid(17, 8).unwrap().grid_dim.0, 3);
        // Huge sizes are capped; kernels grid-stride over the rest (no u32 overflow).
        assert_eq!(
            grid(u64::MAX / 2, 256).unwrap().grid_dim.0,
            MAX_BLOCKS as u32
        );
        assert_eq!(BLOCK % 32, 0);
    }

    #[test]
    fn layer_site_is_the_counter_word() {
        let key = DropoutKey {
            seed: 1,
            epoch: 2,
            layer: 3,
            site: 4,
        };
        assert_eq!(layer_site(key), 3 << 16 | 4);
    }
}
