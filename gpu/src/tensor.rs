//! Dense f32 row-major tensors and index buffers.
use crate::{GpuError, Result};

/// A dense, row-major `rows x cols` matrix of f32.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor[{}x{}]", self.rows, self.cols)
    }
}

impl Tensor {
    /// A zero-filled tensor.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Tensor {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    /// A tensor over `data` (row-major); fails if the length is not `rows * cols`.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(GpuError::shape(
                "Tensor::from_vec",
                format!("{} values for a {rows}x{cols} tensor", data.len()),
            ));
        }
        Ok(Tensor { rows, cols, data })
    }

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
        self.data.len()
    }
    /// True if the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// The elements, row-major.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }
    /// The elements, row-major, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
    /// Row `i`, mutable.
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.cols..(i + 1) * self.cols]
    }
    /// Takes the buffer out.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
    /// Rows `start..end` as a new tensor.
    pub fn slice_rows(&self, start: usize, end: usize) -> Tensor {
        Tensor {
            rows: end - start,
            cols: self.cols,
            data: self.data[start * self.cols..end * self.cols].to_vec(),
        }
    }
    /// Appends the rows of `other` (same width) below this tensor's rows.
    pub fn append_rows(&mut self, other: &[f32]) -> Result<()> {
        if self.cols == 0 || other.len() % self.cols != 0 {
            if other.is_empty() {
                return Ok(());
            }
            return Err(GpuError::shape(
                "Tensor::append_rows",
                format!("{} values onto width {}", other.len(), self.cols),
            ));
        }
        self.data.extend_from_slice(other);
        self.rows += other.len() / self.cols;
        Ok(())
    }
    /// Keeps only the first `rows` rows.
    pub fn truncate_rows(&mut self, rows: usize) {
        self.rows = self.rows.min(rows);
        self.data.truncate(self.rows * self.cols);
    }
    /// Fills every element with `v`.
    pub fn fill(&mut self, v: f32) {
        self.data.iter_mut().for_each(|x| *x = v);
    }
    /// Sets every element to zero.
    pub fn zero_(&mut self) {
        self.fill(0.0);
    }
}

/// A buffer of u32 indices (node ids, rows to gather).
pub type IndexBuffer = Vec<u32>;
