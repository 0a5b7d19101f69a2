//! Trellis: an actor-based distributed runtime for training and serving graph neural networks.
//!
//! This facade re-exports the workspace crates:
//! - [`gpu`]: devices, streams, tensors and kernels (CPU reference backend; CUDA with the
//!   `cuda` feature: `--device cuda` runs the same trainers and partition actors there);
//! - [`runtime`]: data loaders, graphs, partitioning, models, trainers and run reports;
//! - [`actors`]: partition actors, supervisors, the coordinator and the topology API;
//! - [`transport`]: halo-exchange messages and transports.
//!
//! and owns the process-level pieces: [`telemetry`] (OpenTelemetry traces and metrics, the
//! Prometheus endpoint), [`plots`] (run reports as PNG charts and an HTML page), [`netns`]
//! (an emulated rate-limited network of namespaces for local clusters) and the CLI.

pub use trellis_actors as actors;
pub use trellis_gpu as gpu;
pub use trellis_runtime as runtime;
pub use trellis_transport as transport;

pub mod build_info;
pub mod cli;
pub mod netns;
pub mod plots;
pub mod serve;
pub mod telemetry;

/// Keeps freed tensor memory in the process for reuse instead of handing it back to the
/// kernel. Every epoch allocates and frees the same large activations; by default glibc
/// serves them from fresh mappings, or from per-thread heaps it unmaps once they empty, and
/// each epoch then page-faults (and the kernel zeroes) all of that memory anew. Measured with
/// `trellis bench partitions` on the 1M-node graph: 4 partition actors went from 6.06 s to
/// 3.20 s per training step (a third of the process's time had been kernel time spent on page
/// faults). Settings: no mmap for large blocks, never trim the heap, one arena for all
/// threads (allocations are few and large, so the arena lock is not contended).
///
/// Call it first thing in `main`, before any thread starts; the `trellis` binary does. Does
/// nothing off glibc.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc malloc's tuning parameters (under its own lock).
    // A value of -1 disables trimming (documented in mallopt(3)).
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
