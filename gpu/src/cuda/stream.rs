//! [`GpuStream`]: what a partition actor owns on a GPU — a compute stream on which every
//! kernel, copy and optimizer step of the partition is ordered, a second stream for halo
//! transfers (so they overlap compute), and a cuBLAS handle bound to the compute stream.
use super::context::CudaDevice;
use super::memory::{csr_host_arrays, DeviceCsr, DeviceIndex, DeviceScatterPlan, ScatterPlan};
use super::probe::guarded;
use super::DeviceTensor;
use crate::{Csr, GpuError, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// A partition's ordered queues on one GPU (see the module docs).
#[derive(Debug)]
pub struct GpuStream {
    pub(crate) dev: Arc<CudaDevice>,
    pub(crate) compute: Arc<CudaStream>,
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    /// A one-element buffer passed where a kernel's optional operand is absent.
    pub(crate) dummy: CudaSlice<f32>,
}

impl GpuStream {
    /// New compute and transfer streams on `cuda:<ordinal>` (the device is opened and its
    /// kernels compiled on first use).
    pub fn new(ordinal: usize) -> Result<Self> {
        let dev = CudaDevice::open(ordinal)?;
        let ctx = dev.context().clone();
        let compute = ctx
            .new_stream()
            .map_err(|e| GpuError::cuda("cuStreamCreate", e))?;
        let copy = ctx
            .new_stream()
            .map_err(|e| GpuError::cuda("cuStreamCreate", e))?;
        let blas = guarded("cublasCreate", || CudaBlas::new(compute.clone()))?
            .map_err(|e| GpuError::cuda("cublasCreate", e))?;
        let dummy = compute
            .alloc_zeros::<f32>(1)
            .map_err(|e| GpuError::cuda("cuMemAlloc", e))?;
        Ok(GpuStream {
            dev,
            compute,
            copy,
            blas,
            dummy,
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Waits until all work issued on both streams has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.compute
            .synchronize()
            .and_then(|_| self.copy.synchronize())
            .map_err(|e| GpuError::cuda("cuStreamSynchronize", e))
    }

    /// A zero-filled `rows x cols` tensor (the fill is ordered on the compute stream).
    pub fn zeros(&self, rows: usize, cols: usize) -> Result<DeviceTensor> {
        Ok(DeviceTensor {
            rows,
            cols,
            buf: self.alloc_zeros(rows * cols)?,
        })
    }

    /// Host -> device copy of a row-major `rows x cols` block.
    pub fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<DeviceTensor> {
        if data.len() != rows * cols {
            return Err(GpuError::shape(
                "GpuStream::upload",
                format!("{} values for a {rows}x{cols} tensor", data.len()),
            ));
        }
        Ok(DeviceTensor {
            rows,
            cols,
            buf: self.upload_slice(data)?,
        })
    }

    /// Device -> host copy of a tensor's contents (waits for the compute stream's work on it).
    pub fn download(&self, t: &DeviceTensor) -> Result<Vec<f32>> {
        self.download_slice(&t.buf, t.len())
    }

    /// Uploads a CSR matrix (with each entry's row, for entry-parallel kernels).
    pub fn upload_csr(&self, m: &Csr) -> Result<DeviceCsr> {
        let (indptr, rows) = csr_host_arrays(m)?;
        Ok(DeviceCsr {
            n_rows: m.n_rows(),
            n_cols: m.n_cols(),
            nnz: m.nnz(),
            indptr: self.upload_slice(&indptr)?,
            indices: self.upload_slice(m.indices())?,
            entry_rows: self.upload_slice(&rows)?,
            values: m.values().map(|v| self.upload_slice(v)).transpose()?,
        })
    }

    /// Uploads an index list that ops scatter into, with its bound and scatter plan.
    pub fn upload_index(&self, idx: &[u32]) -> Result<DeviceIndex> {
        let plan = ScatterPlan::new(idx);
        let mut d = self.upload_ids(idx)?;
        d.plan = Some(DeviceScatterPlan {
            n_groups: plan.targets.len(),
            targets: self.upload_slice(&plan.targets)?,
            group_ptr: self.upload_slice(&plan.group_ptr)?,
            order: self.upload_slice(&plan.order)?,
        });
        Ok(d)
    }

    /// Uploads an index list that ops only read from (node ids, rows to gather, labels): no
    /// scatter plan, which costs a counting sort over the ids' range.
    pub fn upload_ids(&self, idx: &[u32]) -> Result<DeviceIndex> {
        Ok(DeviceIndex {
            len: idx.len(),
            bound: idx.iter().map(|&i| i as usize + 1).max().unwrap_or(0),
            idx: self.upload_slice(idx)?,
            plan: None,
        })
    }

    /// Hex BLAKE3 digest of the tensors' bytes, in order: downloaded, then hashed on the host
    /// (the digest compares replicas once per step; a device hash would save the copy only).
    pub fn digest(&self, tensors: &[&DeviceTensor]) -> Result<String> {
        let host = tensors
            .iter()
            .map(|t| self.download(t))
            .collect::<Result<Vec<_>>>()?;
        Ok(crate::digest_f32(host.iter().map(|v| v.as_slice())))
    }

    /// A copy of a tensor (device to device, on the compute stream).
    pub fn clone_tensor(&self, t: &DeviceTensor) -> Result<DeviceTensor> {
        Ok(DeviceTensor {
            rows: t.rows,
            cols: t.cols,
            buf: self.clone_slice(&t.buf, t.len())?,
        })
    }

    /// `bottom`'s rows below `top`'s (same width), in a new buffer: two device-to-device
    /// copies on the compute stream.
    pub fn concat_rows(&self, top: &DeviceTensor, bottom: &DeviceTensor) -> Result<DeviceTensor> {
        if top.cols != bottom.cols {
            return Err(GpuError::shape(
                "concat_rows",
                format!("{:?} over {:?}", top.shape(), bottom.shape()),
            ));
        }
        let (n_top, n_all) = (top.len(), top.len() + bottom.len());
        let mut buf = self.alloc_zeros::<f32>(n_all)?;
        for (src, at) in [(top, 0), (bottom, n_top)] {
            if src.is_empty() {
                continue;
            }
            let (from, mut to) = (src.view(), buf.slice_mut(at..at + src.len()));
            self.compute
                .memcpy_dtod(&from, &mut to)
                .map_err(|e| GpuError::cuda("cuMemcpyDtoDAsync", e))?;
        }
        Ok(DeviceTensor {
            rows: top.rows + bottom.rows,
            cols: top.cols,
            buf,
        })
    }

    /// A new buffer holding the first `n` elements of `src`.
    fn clone_slice<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &CudaSlice<T>,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        let mut dst = self.alloc_zeros::<T>(n)?;
        if n > 0 {
            let (from, mut to) = (src.slice(..n), dst.slice_mut(..n));
            self.compute
                .memcpy_dtod(&from, &mut to)
                .map_err(|e| GpuError::cuda("cuMemcpyDtoDAsync", e))?;
        }
        Ok(dst)
    }

    /// A zeroed device buffer of `n` elements (at least one is allocated).
    pub(crate) fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.compute
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| GpuError::cuda("cuMemAlloc", e))
    }

    /// Copies `data` into a new device buffer on the compute stream. The host slice is
    /// pageable, which the driver stages before the call returns, so it may be dropped after.
    pub(crate) fn upload_slice<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        data: &[T],
    ) -> Result<CudaSlice<T>> {
        let mut buf = self.alloc_zeros::<T>(data.len())?;
        if !data.is_empty() {
            let mut dst = buf.slice_mut(..data.len());
            self.compute
                .memcpy_htod(data, &mut dst)
                .map_err(|e| GpuError::cuda("cuMemcpyHtoDAsync", e))?;
        }
        Ok(buf)
    }

    /// The first `n` elements of `buf`, on the host (a pageable copy returns when complete).
    pub(crate) fn download_slice<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        buf: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); n];
        if n > 0 {
            let src = buf.slice(..n);
            self.compute
                .memcpy_dtoh(&src, &mut out)
                .map_err(|e| GpuError::cuda("cuMemcpyDtoHAsync", e))?;
            // The copy into pageable memory is synchronous in the driver; waiting here as well
            // makes that explicit and surfaces errors of earlier kernels at this call.
            self.compute
                .synchronize()
                .map_err(|e| GpuError::cuda("cuStreamSynchronize", e))?;
        }
        Ok(out)
    }
}
