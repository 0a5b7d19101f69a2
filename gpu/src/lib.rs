//! `trellis-gpu` owns devices, streams, tensors and compute kernels.
//!
//! One device-neutral API ([`Stream`] methods in [`ops`]) with backends behind it. The CPU
//! backend ([`cpu`]) is the reference implementation: every kernel is parallel (rayon, inside
//! the global [`ThreadBudget`]) and deterministic — the same inputs and thread count give
//! bit-identical outputs, and row-parallel kernels are bit-identical for any thread count.
//! The CUDA backend (`cuda`, behind the `cuda` cargo feature) runs the same ops on device
//! buffers; its kernel sources live in `src/cuda/` ([`kernel_source`]).

pub mod bench;
pub mod cpu;
mod csr;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod digest;
mod error;
pub mod halo;
#[path = "cuda/source.rs"]
pub mod kernel_source;
pub mod ops;
pub mod rng;
mod stream;
mod tensor;

pub use csr::{Csr, CsrTranspose};
pub use device::{Device, ThreadBudget};
pub use digest::{digest_bytes, digest_f32};
pub use error::{CudaLibrary, GpuError};
pub use ops::{Activation, AdamConfig, EdgeWeights, LossOutput, SgdConfig};
pub use rng::{DropoutKey, Philox4x32};
pub use stream::{CancelToken, KernelTimes, PriorityGate, Stream, UrgentGuard};
pub use tensor::{Bits, IndexBuffer, Tensor};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, GpuError>;
