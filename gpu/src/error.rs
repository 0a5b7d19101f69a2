//! Typed errors of the compute layer.
use thiserror::Error;

/// Errors raised by devices, streams and kernels.
#[derive(Debug, Error)]
pub enum GpuError {
    /// Operand shapes do not fit the operation.
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    /// The requested device is not available on this machine or build.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable { device: String, reason: String },
    /// The thread pool could not be built.
    #[error("cannot build the CPU thread pool: {0}")]
    ThreadPool(String),
}

impl GpuError {
    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        GpuError::Shape {
            op,
            detail: detail.into(),
        }
    }
}
