//! Device-resident operands: dense tensors, CSR matrices and index lists, each with the host
//! metadata (shapes, index bounds, scatter plans) the op API checks before it launches.
//!
//! Every buffer is allocated with at least one element (a zero-byte allocation is not portable
//! across drivers); the logical length is kept beside it and views are cut to it.
use crate::{Csr, GpuError, Result};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

/// A dense, row-major `rows x cols` f32 matrix in device memory (a clone is a device-to-device
/// copy ordered on the buffer's stream).
#[derive(Debug, Clone)]
pub struct DeviceTensor {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) buf: CudaSlice<f32>,
}

impl DeviceTensor {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    /// True if the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The ordinal of the GPU whose memory holds the elements.
    pub fn ordinal(&self) -> usize {
        self.buf.context().ordinal()
    }
    /// Keeps the first `rows` rows visible (the buffer is kept).
    pub(crate) fn truncate_rows(&mut self, rows: usize) {
        self.rows = self.rows.min(rows);
    }
    /// The elements.
    pub(crate) fn view(&self) -> CudaView<'_, f32> {
        self.buf.slice(..self.len())
    }
    /// The elements, mutable.
    pub(crate) fn view_mut(&mut self) -> CudaViewMut<'_, f32> {
        let n = self.len();
        self.buf.slice_mut(..n)
    }
}

/// A CSR matrix in device memory: row pointers (u64), column indices (u32), the row of every
/// entry (u32, for entry-parallel kernels) and optional per-entry values.
#[derive(Debug)]
pub struct DeviceCsr {
    pub(crate) n_rows: usize,
    pub(crate) n_cols: usize,
    pub(crate) nnz: usize,
    pub(crate) indptr: CudaSlice<u64>,
    pub(crate) indices: CudaSlice<u32>,
    pub(crate) entry_rows: CudaSlice<u32>,
    pub(crate) values: Option<CudaSlice<f32>>,
}

impl DeviceCsr {
    /// Number of rows.
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns.
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// Number of stored entries.
    pub fn nnz(&self) -> usize {
        self.nnz
    }
}

/// The host-side arrays of a [`DeviceCsr`]: row pointers widened to u64 and each entry's row.
pub(crate) fn csr_host_arrays(m: &Csr) -> Result<(Vec<u64>, Vec<u32>)> {
    if m.n_rows() > u32::MAX as usize || m.n_cols() > u32::MAX as usize + 1 {
        return Err(GpuError::shape(
            "upload_csr",
            format!("{}x{} exceeds u32 node ids", m.n_rows(), m.n_cols()),
        ));
    }
    let indptr: Vec<u64> = m.indptr().iter().map(|&p| p as u64).collect();
    let mut rows = Vec::with_capacity(m.nnz());
    for r in 0..m.n_rows() {
        rows.extend(std::iter::repeat_n(r as u32, m.degree(r)));
    }
    Ok((indptr, rows))
}

/// A list of u32 row indices in device memory, with its bound and the plan that makes
/// scatter-add over it deterministic.
#[derive(Debug)]
pub struct DeviceIndex {
    pub(crate) len: usize,
    /// One more than the largest index (0 when empty): checked against the rows of operands.
    pub(crate) bound: usize,
    pub(crate) idx: CudaSlice<u32>,
    /// Built only for lists that ops scatter into ([`GpuStream::upload_index`]).
    pub(crate) plan: Option<DeviceScatterPlan>,
}

impl DeviceIndex {
    /// Number of indices.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// One more than the largest index (0 when empty).
    pub fn bound(&self) -> usize {
        self.bound
    }
}

/// [`ScatterPlan`] in device memory.
#[derive(Debug)]
pub(crate) struct DeviceScatterPlan {
    pub(crate) n_groups: usize,
    pub(crate) targets: CudaSlice<u32>,
    pub(crate) group_ptr: CudaSlice<u64>,
    pub(crate) order: CudaSlice<u32>,
}

/// How `out[idx[r]] += src[r]` runs without atomics: the distinct targets (ascending), and for
/// target `g` the source rows `order[group_ptr[g]..group_ptr[g + 1]]` in ascending order, so
/// one thread per (target, column) adds them in the CPU backend's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScatterPlan {
    pub(crate) targets: Vec<u32>,
    pub(crate) group_ptr: Vec<u64>,
    pub(crate) order: Vec<u32>,
}

impl ScatterPlan {
    /// The plan of `idx` (a stable counting sort by target).
    pub(crate) fn new(idx: &[u32]) -> Self {
        let bound = idx.iter().map(|&i| i as usize + 1).max().unwrap_or(0);
        let mut count = vec![0u64; bound + 1];
        for &t in idx {
            count[t as usize + 1] += 1;
        }
        for i in 0..bound {
            count[i + 1] += count[i];
        }
        let mut fill = count.clone();
        let mut order = vec![0u32; idx.len()];
        for (r, &t) in idx.iter().enumerate() {
            order[fill[t as usize] as usize] = r as u32;
            fill[t as usize] += 1;
        }
        let mut targets = Vec::new();
        let mut group_ptr = vec![0u64];
        for t in 0..bound {
            if count[t + 1] > count[t] {
                targets.push(t as u32);
                group_ptr.push(count[t + 1]);
            }
        }
        ScatterPlan {
            targets,
            group_ptr,
            order,
        }
    }

    /// What the kernel computes, on the host (the test oracle for the plan).
    #[cfg(test)]
    pub(crate) fn apply_on_host(&self, src: &[f32], width: usize, out: &mut [f32]) {
        for (g, &t) in self.targets.iter().enumerate() {
            for c in 0..width {
                let o = &mut out[t as usize * width + c];
                let mut acc = *o;
                for k in self.group_ptr[g]..self.group_ptr[g + 1] {
                    acc += src[self.order[k as usize] as usize * width + c];
                }
                *o = acc;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{random_csr, random_tensor};

    #[test]
    fn scatter_plan_reproduces_the_cpu_bits() {
        let idx: Vec<u32> = vec![5, 0, 5, 3, 3, 3, 9, 0, 5, 1];
        let plan = ScatterPlan::new(&idx);
        assert_eq!(plan.targets, vec![0, 1, 3, 5, 9]);
        assert_eq!(plan.group_ptr, vec![0, 2, 3, 6, 9, 10]);
        assert_eq!(plan.order, vec![1, 7, 9, 3, 4, 5, 0, 2, 8, 6]);
        for width in [1usize, 3, 64, 65, 130] {
            let src = random_tensor(idx.len(), width, 4).into_vec();
            let mut want = random_tensor(10, width, 5).into_vec();
            let mut got = want.clone();
            crate::cpu::scatter_add_rows(&src, width, &idx, &mut want);
            plan.apply_on_host(&src, width, &mut got);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "width {width}"
            );
        }
        let empty = ScatterPlan::new(&[]);
        assert!(empty.targets.is_empty() && empty.order.is_empty());
        assert_eq!(empty.group_ptr, vec![0]);
    }

    #[test]
    fn csr_arrays_give_each_entry_its_row() {
        let m = random_csr(40, 30, 6, 1).unwrap();
        let (indptr, rows) = csr_host_arrays(&m).unwrap();
        assert_eq!(indptr.len(), 41);
        assert_eq!(rows.len(), m.nnz());
        for (r, w) in m.indptr().windows(2).enumerate() {
            assert!(rows[w[0]..w[1]].iter().all(|&row| row == r as u32));
            assert_eq!(indptr[r], w[0] as u64);
        }
    }
}
