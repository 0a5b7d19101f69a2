//! Trellis: an actor-based distributed runtime for training and serving graph neural networks.
//!
//! This facade re-exports the workspace crates:
//! - [`gpu`]: devices, streams, tensors and kernels (CPU reference backend);
//! - [`runtime`]: data loaders, graphs, partitioning, models, trainers and run reports.

pub use trellis_gpu as gpu;
pub use trellis_runtime as runtime;

pub mod cli;
