//! The CUDA backend (cargo feature `cuda`), through cudarc with CUDA 12.8 bindings loaded at run
//! time: this module builds on machines with no CUDA toolkit and no driver, and asking for a
//! GPU there is a typed error ([`crate::GpuError::CudaLibrariesMissing`]), never a panic.
//!
//! What it owns:
//! - [`probe`]: which CUDA libraries load and whether the device exists (`probe.rs`);
//! - [`CudaDevice`]: one context per GPU with the kernels compiled once by NVRTC
//!   (`context.rs`; sources in `kernels.cu` and `philox.cuh`, assembled by
//!   [`crate::kernel_source`]);
//! - [`GpuStream`]: a partition actor's compute stream, its transfer stream and its cuBLAS
//!   handle; every op of the partition is ordered on the compute stream (`stream.rs`, ops in
//!   `launch_sparse.rs`, `launch_dense.rs` and `gemm.rs`, plumbing in `launch.rs`);
//! - device buffers: [`DeviceTensor`], [`DeviceCsr`], [`DeviceIndex`] (`memory.rs`);
//! - halo staging through pinned host buffers with event-ordered overlap (`halo.rs`).
//!
//! Buffer lifetimes: cudarc frees a [`cudarc::driver::CudaSlice`] on its stream (stream
//! ordered), and its event tracking makes a stream that uses a buffer written on another stream
//! wait for that write. So a device buffer may be dropped as soon as the last op that uses it
//! is enqueued; host memory handed to an async copy is either pinned and guarded by an event
//! ([`halo`]) or pageable, which the driver copies before the call returns.

mod context;
mod gemm;
pub mod halo;
mod launch;
mod launch_dense;
mod launch_sparse;
mod memory;
mod probe;
mod stream;

pub use context::CudaDevice;
pub use launch::{DeviceBits, DeviceWeights};
pub use memory::{DeviceCsr, DeviceIndex, DeviceTensor};
pub use probe::{missing_libraries, probe};
pub use stream::GpuStream;
