//! Trellis: an actor-based distributed runtime for training and serving graph neural networks.
//!
//! This facade re-exports the workspace crates:
//! - [`gpu`]: devices, streams, tensors and kernels (CPU reference backend; CUDA with the
//!   `cuda` feature, which also builds `gpu_gcn`, GCN trained on one CUDA stream);
//! - [`runtime`]: data loaders, graphs, partitioning, models, trainers and run reports;
//! - [`actors`]: partition actors, supervisors, the coordinator and the topology API;
//! - [`transport`]: halo-exchange messages and transports.

pub use trellis_actors as actors;
pub use trellis_gpu as gpu;
pub use trellis_runtime as runtime;
pub use trellis_transport as transport;

pub mod cli;
#[cfg(feature = "cuda")]
pub mod gpu_gcn;
