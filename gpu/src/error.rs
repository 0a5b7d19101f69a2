//! Typed errors of the compute layer.
use std::fmt;
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
    /// CUDA libraries the backend loads at run time are not on this machine.
    #[error(
        "device {device} is unavailable: cannot load {} (looked in the dynamic loader's path; \
         install the NVIDIA driver and the CUDA 12 runtime libraries, or use --device cpu)",
        list(missing)
    )]
    CudaLibrariesMissing {
        device: String,
        missing: Vec<CudaLibrary>,
    },
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("CUDA error in {op}: {detail}")]
    Cuda { op: &'static str, detail: String },
    /// An operand lives in another device's memory than the op runs on.
    #[error("{op}: operand is on {found}, the op runs on {expected} (upload or download it through the stream first)")]
    WrongDevice {
        op: &'static str,
        expected: String,
        found: String,
    },
    /// The stream's work was cancelled (see `CancelToken`).
    #[error("cancelled: the work in progress was abandoned")]
    Cancelled,
    /// The thread pool could not be built.
    #[error("cannot build the CPU thread pool: {0}")]
    ThreadPool(String),
}

/// A shared library the CUDA backend loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The driver API (`libcuda.so`, installed with the NVIDIA driver).
    Driver,
    /// The runtime compiler for the kernels (`libnvrtc.so`, CUDA toolkit or pip wheel).
    Nvrtc,
    /// cuBLAS for dense matrix products (`libcublas.so`).
    Cublas,
}

impl fmt::Display for CudaLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaLibrary::Driver => "the CUDA driver library (libcuda.so)",
            CudaLibrary::Nvrtc => "NVRTC (libnvrtc.so)",
            CudaLibrary::Cublas => "cuBLAS (libcublas.so)",
        })
    }
}

fn list(missing: &[CudaLibrary]) -> String {
    let names: Vec<String> = missing.iter().map(|l| l.to_string()).collect();
    names.join(", ")
}

impl GpuError {
    /// An operand of `op` on `found` where the op runs on `expected`.
    pub(crate) fn wrong_device(
        op: &'static str,
        expected: impl ToString,
        found: impl ToString,
    ) -> Self {
        GpuError::WrongDevice {
            op,
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        GpuError::Shape {
            op,
            detail: detail.into(),
        }
    }

    /// A failed CUDA call in `op`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda(op: &'static str, detail: impl fmt::Display) -> Self {
        GpuError::Cuda {
            op,
            detail: detail.to_string(),
        }
    }
}
