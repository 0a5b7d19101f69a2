//! Compressed sparse row matrices.
use crate::{GpuError, Result};
#[cfg(feature = "cuda")]
use std::sync::{Arc, Mutex};

/// A CSR sparse matrix with optional per-edge values.
///
/// Row `i` holds the entries `indices[indptr[i]..indptr[i+1]]`. In Trellis a row is a target
/// (output) node and its entries are the source rows it aggregates from, in ascending global id.
#[derive(Debug, Clone, PartialEq)]
pub struct Csr {
    n_rows: usize,
    n_cols: usize,
    indptr: Vec<usize>,
    indices: Vec<u32>,
    values: Option<Vec<f32>>,
    /// Copies in device memory, made on first use by a device stream (see [`DeviceCopies`]).
    device: DeviceCopies,
}

/// A matrix's copies in device memory, one per GPU, made on first use by a stream there and
/// shared by the matrix's clones; dropped (for this matrix) when its values change, so a copy
/// never differs from the host matrix. Without the `cuda` feature it holds nothing.
#[derive(Clone, Default)]
pub(crate) struct DeviceCopies {
    #[cfg(feature = "cuda")]
    copies: Arc<Mutex<Vec<DeviceCopy>>>,
}

/// A GPU ordinal and the matrix's copy in that GPU's memory.
#[cfg(feature = "cuda")]
type DeviceCopy = (usize, Arc<crate::cuda::DeviceCsr>);

impl std::fmt::Debug for DeviceCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceCopies")
    }
}

/// Copies do not take part in equality: they always equal the host matrix.
impl PartialEq for DeviceCopies {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// The transpose of a [`Csr`] plus, for each of its entries, the entry index in the original.
#[derive(Debug, Clone, PartialEq)]
pub struct CsrTranspose {
    /// The transposed matrix (values permuted along if the original had any).
    pub csr: Csr,
    /// `perm[k]` = index in the original of the transposed entry `k`.
    pub perm: Vec<u32>,
}

impl Csr {
    /// Builds and validates a CSR matrix.
    pub fn new(
        n_rows: usize,
        n_cols: usize,
        indptr: Vec<usize>,
        indices: Vec<u32>,
        values: Option<Vec<f32>>,
    ) -> Result<Self> {
        let bad = |d: String| Err(GpuError::shape("Csr::new", d));
        if indptr.len() != n_rows + 1 {
            return bad(format!(
                "indptr has {} entries for {n_rows} rows",
                indptr.len()
            ));
        }
        if indptr[0] != 0 || indptr[n_rows] != indices.len() {
            return bad("indptr does not span the indices".into());
        }
        if indptr.windows(2).any(|w| w[0] > w[1]) {
            return bad("indptr is not monotone".into());
        }
        if let Some(&c) = indices.iter().find(|&&c| c as usize >= n_cols) {
            return bad(format!("column {c} out of range for {n_cols} columns"));
        }
        if let Some(v) = &values {
            if v.len() != indices.len() {
                return bad(format!("{} values for {} entries", v.len(), indices.len()));
            }
        }
        Ok(Csr {
            n_rows,
            n_cols,
            indptr,
            indices,
            values,
            device: DeviceCopies::default(),
        })
    }

    /// Builds from (row, col) pairs; entries of each row are sorted by column, duplicates kept.
    pub fn from_pairs(n_rows: usize, n_cols: usize, pairs: &[(u32, u32)]) -> Result<Self> {
        let mut counts = vec![0usize; n_rows + 1];
        for &(r, c) in pairs {
            if r as usize >= n_rows || c as usize >= n_cols {
                return Err(GpuError::shape(
                    "Csr::from_pairs",
                    format!("entry ({r},{c}) outside {n_rows}x{n_cols}"),
                ));
            }
            counts[r as usize + 1] += 1;
        }
        for i in 0..n_rows {
            counts[i + 1] += counts[i];
        }
        let mut fill = counts.clone();
        let mut indices = vec![0u32; pairs.len()];
        for &(r, c) in pairs {
            indices[fill[r as usize]] = c;
            fill[r as usize] += 1;
        }
        for i in 0..n_rows {
            indices[counts[i]..counts[i + 1]].sort_unstable();
        }
        Self::new(n_rows, n_cols, counts, indices, None)
    }

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
        self.indices.len()
    }
    /// Row pointers (`n_rows + 1`).
    pub fn indptr(&self) -> &[usize] {
        &self.indptr
    }
    /// Column indices.
    pub fn indices(&self) -> &[u32] {
        &self.indices
    }
    /// Per-entry values, if any.
    pub fn values(&self) -> Option<&[f32]> {
        self.values.as_deref()
    }
    /// Replaces the per-entry values.
    pub fn set_values(&mut self, values: Option<Vec<f32>>) -> Result<()> {
        if let Some(v) = &values {
            if v.len() != self.nnz() {
                return Err(GpuError::shape(
                    "Csr::set_values",
                    format!("{} values for {} entries", v.len(), self.nnz()),
                ));
            }
        }
        self.values = values;
        self.device = DeviceCopies::default();
        Ok(())
    }
    /// Row pointers, column indices and (mutable) values together.
    pub fn parts_mut(&mut self) -> (&[usize], &[u32], Option<&mut [f32]>) {
        self.device = DeviceCopies::default();
        (&self.indptr, &self.indices, self.values.as_deref_mut())
    }

    /// This matrix in the memory of `g`'s GPU: uploaded on `g`'s compute stream the first
    /// time, then shared (other streams wait for the upload through cudarc's event tracking).
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(
        &self,
        g: &crate::cuda::GpuStream,
    ) -> Result<Arc<crate::cuda::DeviceCsr>> {
        let ordinal = g.device().ordinal();
        let mut copies = self.device.copies.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, m)) = copies.iter().find(|(o, _)| *o == ordinal) {
            return Ok(m.clone());
        }
        let m = Arc::new(g.upload_csr(self)?);
        copies.push((ordinal, m.clone()));
        Ok(m)
    }

    /// Splits the entries into those with column `< n_inner` (same columns) and the rest
    /// (columns renumbered from 0 over `n_cols() - n_inner`), keeping order and values: a
    /// block's adjacency over inner and over halo input rows, `A x = A_inner x_inner + A_halo
    /// x_halo`.
    pub fn split_columns(&self, n_inner: usize) -> Result<(Csr, Csr)> {
        let a = self;
        if n_inner > a.n_cols() {
            return Err(GpuError::shape(
                "Csr::split_columns",
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

    /// Rows `start..end` (clamped to the matrix) as a new matrix over the same columns; each
    /// row keeps its entries, values and order, so a row-parallel product over it gives the
    /// same bits for those rows as over the whole matrix.
    pub fn row_range(&self, start: usize, end: usize) -> Csr {
        let end = end.min(self.n_rows);
        let start = start.min(end);
        let (first, last) = (self.indptr[start], self.indptr[end]);
        Csr {
            n_rows: end - start,
            n_cols: self.n_cols,
            indptr: self.indptr[start..=end]
                .iter()
                .map(|&p| p - first)
                .collect(),
            indices: self.indices[first..last].to_vec(),
            values: self.values.as_ref().map(|v| v[first..last].to_vec()),
            device: DeviceCopies::default(),
        }
    }

    /// A dense row-major matrix's non-zero entries as CSR (values stored).
    pub fn from_dense(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(GpuError::shape(
                "Csr::from_dense",
                format!("{} values for {rows}x{cols}", data.len()),
            ));
        }
        let mut indptr = Vec::with_capacity(rows + 1);
        indptr.push(0);
        let mut indices = Vec::new();
        let mut values = Vec::new();
        for r in 0..rows {
            for (c, &v) in data[r * cols..(r + 1) * cols].iter().enumerate() {
                if v != 0.0 {
                    indices.push(c as u32);
                    values.push(v);
                }
            }
            indptr.push(indices.len());
        }
        Self::new(rows, cols, indptr, indices, Some(values))
    }

    /// The entries of row `i`.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.indices[self.indptr[i]..self.indptr[i + 1]]
    }
    /// Number of entries in row `i`.
    pub fn degree(&self, i: usize) -> usize {
        self.indptr[i + 1] - self.indptr[i]
    }
    /// Approximate heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.indptr.len() * 8
            + self.indices.len() * 4
            + self.values.as_ref().map_or(0, |v| v.len() * 4)
    }

    /// The transpose; entries of each transposed row come in ascending original-row order,
    /// so the result is deterministic.
    pub fn transpose(&self) -> CsrTranspose {
        let mut counts = vec![0usize; self.n_cols + 1];
        for &c in &self.indices {
            counts[c as usize + 1] += 1;
        }
        for i in 0..self.n_cols {
            counts[i + 1] += counts[i];
        }
        let mut fill = counts.clone();
        let mut indices = vec![0u32; self.nnz()];
        let mut perm = vec![0u32; self.nnz()];
        for r in 0..self.n_rows {
            for e in self.indptr[r]..self.indptr[r + 1] {
                let c = self.indices[e] as usize;
                indices[fill[c]] = r as u32;
                perm[fill[c]] = e as u32;
                fill[c] += 1;
            }
        }
        let values = self
            .values
            .as_ref()
            .map(|v| perm.iter().map(|&e| v[e as usize]).collect());
        CsrTranspose {
            csr: Csr {
                n_rows: self.n_cols,
                n_cols: self.n_rows,
                indptr: counts,
                indices,
                values,
                device: DeviceCopies::default(),
            },
            perm,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::bench::{random_csr, random_tensor};

    #[test]
    fn split_columns_parts_add_up_to_the_whole_product() {
        let a = random_csr(50, 80, 7, 11).unwrap();
        let x = random_tensor(80, 9, 12).into_vec();
        let mut whole = vec![0.0f32; 50 * 9];
        crate::cpu::spmm(&a, a.values(), 1, &x, 9, &mut whole);
        for n_inner in [0usize, 1, 30, 79, 80] {
            let (inner, halo) = a.split_columns(n_inner).unwrap();
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
        assert!(a.split_columns(81).is_err());
    }
}
