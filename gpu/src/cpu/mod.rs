//! The CPU backend: the reference implementation of every kernel.
//!
//! Kernels take plain slices with explicit dimensions and run their data-parallel part on the
//! current rayon pool (the caller's [`crate::Stream`] installs its budget). Each output element
//! is produced by one thread in a fixed summation order, so results do not depend on timing.

mod dense;
mod gemm;
mod loss;
mod optim;
mod sparse;

pub use dense::*;
pub use gemm::*;
pub use loss::*;
pub use optim::*;
pub use sparse::*;

/// Rows per rayon task for row-parallel kernels: enough work per task to amortise scheduling.
pub(crate) fn row_chunk(rows: usize, cols: usize) -> usize {
    let per_row = cols.max(1);
    (16_384 / per_row).clamp(1, rows.max(1))
}

/// Splits per-entry data into one slice per CSR row (`per_entry` values per entry), so rows can
/// be processed in parallel.
pub(crate) fn split_rows<'a>(
    data: &'a mut [f32],
    indptr: &[usize],
    per_entry: usize,
) -> Vec<&'a mut [f32]> {
    let mut segs = Vec::with_capacity(indptr.len().saturating_sub(1));
    let mut rest = data;
    for w in indptr.windows(2) {
        let (seg, tail) = rest.split_at_mut((w[1] - w[0]) * per_entry);
        segs.push(seg);
        rest = tail;
    }
    segs
}
