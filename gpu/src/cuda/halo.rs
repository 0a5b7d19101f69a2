//! Halo rows on the GPU: they leave and arrive through pinned host buffers with async copies
//! on the partition's transfer stream, and the aggregation over inner nodes runs on the compute
//! stream while they are in flight; the halo part is added once their copies have completed,
//! ordered by events (the compute stream waits on the copy's event — never a device-wide
//! sync).
//!
//! A block's adjacency is split by column ([`split_by_column`]) into the entries over inner
//! input rows and those over halo input rows, so that `A x = A_inner x_inner + A_halo x_halo`.
//! Summing the two parts separately changes the order of additions relative to the CPU
//! backend (which sums each row in ascending global id), so results agree within rounding,
//! not bit for bit.
use super::launch::DeviceWeights;
use super::memory::{DeviceCsr, DeviceIndex, DeviceTensor};
use super::stream::GpuStream;
use crate::{Csr, GpuError, Result};
use cudarc::driver::{CudaEvent, PinnedHostSlice};

/// Splits `a`'s entries into those with column `< n_inner` (same columns) and the rest (columns
/// renumbered from 0 over `a.n_cols() - n_inner` halo rows), keeping order and values.
pub fn split_by_column(a: &Csr, n_inner: usize) -> Result<(Csr, Csr)> {
    if n_inner > a.n_cols() {
        return Err(GpuError::shape(
            "split_by_column",
            format!("{n_inner} inner columns of {}", a.n_cols()),
        ));
    }
    let vals = a.values();
    let (mut ip_in, mut ip_h) = (vec![0usize], vec![0usize]);
    let (mut ix_in, mut ix_h) = (Vec::new(), Vec::new());
    let (mut v_in, mut v_h) = (Vec::new(), Vec::new());
    for r in 0..a.n_rows() {
        for e in a.indptr()[r]..a.indptr()[r + 1] {
            let c = a.indices()[e] as usize;
            let v = vals.map(|v| v[e]);
            if c < n_inner {
                ix_in.push(c as u32);
                v_in.extend(v);
            } else {
                ix_h.push((c - n_inner) as u32);
                v_h.extend(v);
            }
        }
        ip_in.push(ix_in.len());
        ip_h.push(ix_h.len());
    }
    let has = vals.is_some();
    let inner = Csr::new(a.n_rows(), n_inner, ip_in, ix_in, has.then_some(v_in))?;
    let halo = Csr::new(
        a.n_rows(),
        a.n_cols() - n_inner,
        ip_h,
        ix_h,
        has.then_some(v_h),
    )?;
    Ok((inner, halo))
}

/// A pinned (page-locked) host buffer of `rows x cols` f32 for halo rows, so that copies to
/// and from it are truly asynchronous. Its own event (inside cudarc) orders host access after
/// the copies that use it.
#[derive(Debug)]
pub struct PinnedRows {
    rows: usize,
    cols: usize,
    buf: PinnedHostSlice<f32>,
}

impl PinnedRows {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The rows, once every copy that uses the buffer has completed (waits on its event).
    pub fn as_slice(&self) -> Result<&[f32]> {
        let n = self.rows * self.cols;
        self.buf
            .as_slice()
            .map(|s| &s[..n])
            .map_err(|e| GpuError::cuda("cuEventSynchronize", e))
    }
    /// The rows, writable (e.g. to receive a block from the transport), once every copy that
    /// uses the buffer has completed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        let n = self.rows * self.cols;
        self.buf
            .as_mut_slice()
            .map(|s| &mut s[..n])
            .map_err(|e| GpuError::cuda("cuEventSynchronize", e))
    }
}

/// Halo rows copied (or being copied) to the device on the transfer stream; `event` completes
/// when they have arrived.
#[derive(Debug)]
pub struct HaloArrival {
    rows: DeviceTensor,
    event: CudaEvent,
}

impl HaloArrival {
    /// The device rows (use them on the compute stream only after [`GpuStream::spmm_overlapped`]
    /// or another wait on the arrival event).
    pub fn rows(&self) -> &DeviceTensor {
        &self.rows
    }
}

impl GpuStream {
    /// A zeroed pinned host buffer for `rows x cols` halo values.
    pub fn pinned_rows(&self, rows: usize, cols: usize) -> Result<PinnedRows> {
        let n = rows * cols;
        // SAFETY: the allocation is uninitialised; it is zero-filled below before anything
        // reads it, and f32 is valid for any bit pattern. Flags 0: plain page-locked memory
        // (not write-combined, so the host can read received rows at full speed).
        let mut buf = unsafe {
            self.dev
                .context()
                .alloc_pinned_with_flags::<f32>(n.max(1), 0)
        }
        .map_err(|e| GpuError::cuda("cuMemHostAlloc", e))?;
        buf.as_mut_slice()
            .map_err(|e| GpuError::cuda("cuEventSynchronize", e))?
            .fill(0.0);
        Ok(PinnedRows { rows, cols, buf })
    }

    /// Send side: gathers rows `idx` of `x` on the compute stream, then copies them into
    /// `staging` on the transfer stream (which waits for the gather through the buffer's
    /// write event). [`PinnedRows::as_slice`] then waits for that copy only.
    pub fn send_rows(
        &self,
        x: &DeviceTensor,
        idx: &DeviceIndex,
        staging: &mut PinnedRows,
    ) -> Result<()> {
        if staging.rows != idx.len() || staging.cols != x.cols() {
            return Err(GpuError::shape(
                "send_rows",
                format!(
                    "{} rows of width {} into staging {}x{}",
                    idx.len(),
                    x.cols(),
                    staging.rows,
                    staging.cols
                ),
            ));
        }
        let rows = self.gather_rows(x, idx)?;
        if rows.is_empty() {
            return Ok(());
        }
        let src = rows.view();
        self.copy
            .memcpy_dtoh(&src, &mut staging.buf)
            .map_err(|e| GpuError::cuda("cuMemcpyDtoHAsync", e))
        // `rows` is dropped here: cudarc frees it in stream order after the copy's read.
    }

    /// Receive side: starts the copy of `staging` (filled by the host with a received block)
    /// to a new device tensor on the transfer stream and records its arrival event.
    pub fn receive_rows(&self, staging: &PinnedRows) -> Result<HaloArrival> {
        let mut rows = self.zeros(staging.rows, staging.cols)?;
        if !rows.is_empty() {
            let mut dst = rows.view_mut();
            self.copy
                .memcpy_htod(&staging.buf, &mut dst)
                .map_err(|e| GpuError::cuda("cuMemcpyHtoDAsync", e))?;
        }
        let event = self
            .copy
            .record_event(None)
            .map_err(|e| GpuError::cuda("cuEventRecord", e))?;
        Ok(HaloArrival { rows, event })
    }

    /// `out = A_inner x_inner + A_halo x_halo`, overlapped with the halo transfer: the inner
    /// product is enqueued at once; then the compute stream waits on the arrival's event (not
    /// the whole device) and adds the halo product.
    pub fn spmm_overlapped(
        &self,
        inner: &DeviceCsr,
        halo: &DeviceCsr,
        weights: DeviceWeights<'_>,
        x_inner: &DeviceTensor,
        arrival: &HaloArrival,
        out: &mut DeviceTensor,
    ) -> Result<()> {
        if matches!(weights, DeviceWeights::PerHead(..)) {
            return Err(GpuError::shape(
                "spmm_overlapped",
                "per-head weights are per entry of the unsplit matrix",
            ));
        }
        self.spmm(inner, weights, x_inner, out, false)?;
        self.compute
            .wait(&arrival.event)
            .map_err(|e| GpuError::cuda("cuStreamWaitEvent", e))?;
        self.spmm(halo, weights, &arrival.rows, out, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{random_csr, random_tensor};

    #[test]
    fn split_parts_add_up_to_the_whole_product() {
        let a = random_csr(50, 80, 7, 11).unwrap();
        let x = random_tensor(80, 9, 12).into_vec();
        let mut whole = vec![0.0f32; 50 * 9];
        crate::cpu::spmm(&a, a.values(), 1, &x, 9, &mut whole);
        for n_inner in [0usize, 1, 30, 79, 80] {
            let (inner, halo) = split_by_column(&a, n_inner).unwrap();
            assert_eq!(inner.nnz() + halo.nnz(), a.nnz());
            assert_eq!(halo.n_cols(), 80 - n_inner);
            let mut got = vec![0.0f32; 50 * 9];
            let mut part = vec![0.0f32; 50 * 9];
            crate::cpu::spmm(&inner, inner.values(), 1, &x[..n_inner * 9], 9, &mut got);
            crate::cpu::spmm(&halo, halo.values(), 1, &x[n_inner * 9..], 9, &mut part);
            got.iter_mut().zip(&part).for_each(|(g, p)| *g += p);
            for (g, w) in got.iter().zip(&whole) {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "n_inner {n_inner}");
            }
        }
        assert!(split_by_column(&a, 81).is_err());
    }
}
