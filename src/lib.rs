//! Trellis: an actor-based distributed runtime for training and serving graph neural networks.
//!
//! This facade re-exports the workspace crates:
//! - [`gpu`]: devices, streams, tensors and kernels (CPU reference backend; CUDA with the
//!   `cuda` feature, which also builds `gpu_gcn`, GCN trained on one CUDA stream);
//! - [`runtime`]: data loaders, graphs, partitioning, models, trainers and run reports;
//! - [`actors`]: partition actors, supervisors, the coordinator and the topology API;
//! - [`transport`]: halo-exchange messages and transports.
//!
//! and owns the process-level pieces: [`telemetry`] (OpenTelemetry traces and metrics, the
//! Prometheus endpoint), [`plots`] (run reports as PNG charts and an HTML page) and the CLI.

pub use trellis_actors as actors;
pub use trellis_gpu as gpu;
pub use trellis_runtime as runtime;
pub use trellis_transport as transport;

pub mod build_info;
pub mod cli;
#[cfg(feature = "cuda")]
pub mod gpu_gcn;
pub mod plots;
pub mod telemetry;
