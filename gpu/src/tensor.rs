//! Dense f32 row-major tensors, where their elements live (host or device memory), and the
//! bit masks ReLU's backward keeps.
use crate::{Device, GpuError, Result};

/// A dense, row-major `rows x cols` matrix of f32, in host memory or (with the `cuda` feature)
/// in the memory of the device whose [`crate::Stream`] created it.
///
/// Ops take tensors from the stream that runs them: [`crate::Stream::zeros`],
/// [`crate::Stream::upload`]. The element accessors ([`Tensor::as_slice`], [`Tensor::row`],
/// ...) are for host tensors; a device tensor's elements reach the host through
/// [`crate::Stream::download`].
#[derive(Clone)]
pub struct Tensor {
    rows: usize,
    cols: usize,
    data: Storage,
}

/// Where a tensor's elements are.
#[derive(Clone)]
pub(crate) enum Storage {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceTensor),
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor[{}x{} on {}]",
            self.rows,
            self.cols,
            self.device()
        )
    }
}

/// Host tensors are equal when their shapes and bits are; a device tensor equals no tensor
/// (download both to compare them).
impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        match (&self.data, &other.data) {
            (Storage::Host(a), Storage::Host(b)) => self.shape() == other.shape() && a == b,
            #[cfg(feature = "cuda")]
            _ => false,
        }
    }
}

impl Tensor {
    /// A zero-filled host tensor.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Tensor {
            rows,
            cols,
            data: Storage::Host(vec![0.0; rows * cols]),
        }
    }

    /// A host tensor over `data` (row-major); fails if the length is not `rows * cols`.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(GpuError::shape(
                "Tensor::from_vec",
                format!("{} values for a {rows}x{cols} tensor", data.len()),
            ));
        }
        Ok(Tensor {
            rows,
            cols,
            data: Storage::Host(data),
        })
    }

    /// A device tensor (its shape is the device buffer's).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_device(t: crate::cuda::DeviceTensor) -> Self {
        Tensor {
            rows: t.rows(),
            cols: t.cols(),
            data: Storage::Cuda(t),
        }
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
        self.rows * self.cols
    }
    /// True if the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device whose memory holds the elements.
    pub fn device(&self) -> Device {
        match &self.data {
            Storage::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(t) => Device::Cuda(t.ordinal()),
        }
    }

    /// The elements of a host tensor, or an error naming `op` for a device tensor.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn host(&self, op: &'static str) -> Result<&[f32]> {
        match &self.data {
            Storage::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(self.not_on_host(op)),
        }
    }

    /// [`Tensor::host`], mutable.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn host_mut(&mut self, op: &'static str) -> Result<&mut [f32]> {
        #[cfg(feature = "cuda")]
        let found = self.device();
        match &mut self.data {
            Storage::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(GpuError::wrong_device(op, Device::Cpu, found)),
        }
    }

    #[cfg(feature = "cuda")]
    fn not_on_host(&self, op: &'static str) -> GpuError {
        GpuError::wrong_device(op, Device::Cpu, self.device())
    }

    /// The device buffer of a tensor on `cuda`, or an error naming `op`.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(&self, op: &'static str) -> Result<&crate::cuda::DeviceTensor> {
        match &self.data {
            Storage::Cuda(t) => Ok(t),
            Storage::Host(_) => Err(self.not_on_device(op)),
        }
    }

    /// [`Tensor::on_device`], mutable.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device_mut(
        &mut self,
        op: &'static str,
    ) -> Result<&mut crate::cuda::DeviceTensor> {
        match &mut self.data {
            Storage::Cuda(t) => Ok(t),
            Storage::Host(_) => Err(GpuError::wrong_device(op, "cuda", Device::Cpu)),
        }
    }

    #[cfg(feature = "cuda")]
    fn not_on_device(&self, op: &'static str) -> GpuError {
        GpuError::wrong_device(op, "cuda", self.device())
    }

    /// The elements, row-major.
    ///
    /// # Panics
    /// On a device tensor (use [`crate::Stream::download`], or [`Tensor::host`] for an error).
    pub fn as_slice(&self) -> &[f32] {
        self.host("Tensor::as_slice")
            .unwrap_or_else(|e| panic!("{e}"))
    }
    /// The elements, row-major, mutable.
    ///
    /// # Panics
    /// On a device tensor (see [`Tensor::as_slice`]).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.host_mut("Tensor::as_mut_slice")
            .unwrap_or_else(|e| panic!("{e}"))
    }
    /// Row `i` of a host tensor (panics as [`Tensor::as_slice`] does).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.as_slice()[i * self.cols..(i + 1) * self.cols]
    }
    /// Row `i` of a host tensor, mutable (panics as [`Tensor::as_slice`] does).
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        let cols = self.cols;
        &mut self.as_mut_slice()[i * cols..(i + 1) * cols]
    }
    /// Takes the buffer out (panics as [`Tensor::as_slice`] does).
    pub fn into_vec(self) -> Vec<f32> {
        self.into_host().unwrap_or_else(|e| panic!("{e}"))
    }
    /// Takes a host tensor's buffer out, or an error for a device tensor.
    pub fn into_host(self) -> Result<Vec<f32>> {
        match self.data {
            Storage::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(self.not_on_host("Tensor::into_host")),
        }
    }
    /// Sets every element of a host tensor to `v` (panics as [`Tensor::as_slice`] does; ops
    /// use [`crate::Stream::fill`]).
    pub fn fill(&mut self, v: f32) {
        self.as_mut_slice().iter_mut().for_each(|x| *x = v);
    }
    /// Appends the rows of `other` (same width, host values) below this host tensor's rows.
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
        let cols = self.cols;
        match &mut self.data {
            Storage::Host(v) => v.extend_from_slice(other),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => return Err(self.not_on_host("Tensor::append_rows")),
        }
        self.rows += other.len() / cols;
        Ok(())
    }
    /// Keeps only the first `rows` rows and hands the memory of the others back: a host
    /// tensor's allocation shrinks (in place with glibc's allocator), a device tensor keeps
    /// its buffer and shows a prefix, as [`Tensor::truncate_rows`].
    pub fn shrink_to_rows(&mut self, rows: usize) {
        self.truncate_rows(rows);
        match &mut self.data {
            Storage::Host(v) => v.shrink_to_fit(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => {}
        }
    }
    /// Keeps only the first `rows` rows (a device tensor keeps its buffer and shows a prefix).
    pub fn truncate_rows(&mut self, rows: usize) {
        self.rows = self.rows.min(rows);
        let n = self.rows * self.cols;
        match &mut self.data {
            Storage::Host(v) => v.truncate(n),
            #[cfg(feature = "cuda")]
            Storage::Cuda(t) => t.truncate_rows(self.rows),
        }
    }
}

/// One bit per element of a tensor (ReLU's backward keeps where its output was positive), in
/// the memory of the stream that computed it.
#[derive(Debug)]
pub struct Bits(pub(crate) BitsStorage);

#[derive(Debug)]
pub(crate) enum BitsStorage {
    /// 64 elements per word, element `k` of a word in bit `k`.
    Host(Vec<u64>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceBits),
}

impl Bits {
    /// Host words (64 elements each, element `k` in bit `k`).
    pub fn from_words(words: Vec<u64>) -> Self {
        Bits(BitsStorage::Host(words))
    }
    /// The words, if they are in host memory.
    pub(crate) fn host_words(&self) -> Option<&[u64]> {
        match &self.0 {
            BitsStorage::Host(w) => Some(w),
            #[cfg(feature = "cuda")]
            BitsStorage::Cuda(_) => None,
        }
    }
    /// Number of 64-bit words.
    pub fn words(&self) -> usize {
        match &self.0 {
            BitsStorage::Host(w) => w.len(),
            #[cfg(feature = "cuda")]
            BitsStorage::Cuda(b) => b.len.div_ceil(64),
        }
    }
    /// Bytes held (what a layer's saved activation costs).
    pub fn bytes(&self) -> usize {
        self.words() * 8
    }
}

/// A buffer of u32 indices (node ids, rows to gather).
pub type IndexBuffer = Vec<u32>;
