//! Sparse ops on device operands: SpMM, SDDMM, edge softmax, row gather and scatter-add.
//! (The invariant every `unsafe` launch here relies on is stated in `launch.rs`.)
use super::launch::{grid, grid1, launch, DeviceWeights, BLOCK};
use super::memory::{DeviceCsr, DeviceIndex, DeviceTensor};
use super::stream::GpuStream;
use crate::ops::check;
use crate::{GpuError, Result};
use cudarc::driver::PushKernelArg;

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
        let p = idx.plan.as_ref().ok_or_else(|| {
            GpuError::shape(
                "scatter_add_rows",
                "index uploaded without a scatter plan (use upload_index)",
            )
        })?;
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
}
