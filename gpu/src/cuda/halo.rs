//! Halo rows on the GPU: they leave and arrive through pinned host buffers with async copies
//! on the partition's transfer stream, and the aggregation over inner nodes runs on the compute
//! stream while they are in flight; the halo part is added once their copies have completed,
//! ordered by events (the compute stream waits on the copy's event — never a device-wide
//! sync).
//!
//! A block's adjacency is split by column ([`crate::Csr::split_columns`]) into the entries over inner
//! input rows and those over halo input rows, so that `A x = A_inner x_inner + A_halo x_halo`.
//! Summing the two parts separately changes the order of additions relative to the CPU
//! backend (which sums each row in ascending global id), so results agree within rounding,
//! not bit for bit.
use super::launch::DeviceWeights;
use super::memory::{DeviceCsr, DeviceIndex, DeviceTensor};
use super::stream::GpuStream;
use crate::{GpuError, Result};
use cudarc::driver::{CudaEvent, PinnedHostSlice};

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
/// when they have arrived. [`GpuStream::arrived`] and [`GpuStream::spmm_after`] order the
/// compute stream after it.
#[derive(Debug)]
pub struct HaloArrival {
    rows: DeviceTensor,
    event: CudaEvent,
}

impl HaloArrival {}

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

    /// The received rows, usable by every op enqueued on the compute stream from now on: the
    /// compute stream waits on the arrival's event (not the whole device).
    pub fn arrived(&self, arrival: HaloArrival) -> Result<DeviceTensor> {
        self.compute
            .wait(&arrival.event)
            .map_err(|e| GpuError::cuda("cuStreamWaitEvent", e))?;
        Ok(arrival.rows)
    }

    /// `out += A_halo x_halo` once the halo rows have arrived: the compute stream waits on the
    /// arrival's event (not the whole device), then adds the product.
    pub fn spmm_after(
        &self,
        halo: &DeviceCsr,
        weights: DeviceWeights<'_>,
        arrival: &HaloArrival,
        out: &mut DeviceTensor,
    ) -> Result<()> {
        self.compute
            .wait(&arrival.event)
            .map_err(|e| GpuError::cuda("cuStreamWaitEvent", e))?;
        self.spmm(halo, weights, &arrival.rows, out, true)
    }
}
