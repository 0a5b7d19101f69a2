//! Trellis: an actor-based distributed runtime for training and serving graph neural networks.
//!
//! This facade re-exports the workspace crates:
//! - [`gpu`]: devices, streams, tensors and kernels (CPU reference backend);
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
pub mod plots;
pub mod telemetry;
