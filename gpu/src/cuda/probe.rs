//! Availability checks: each CUDA library is looked up before anything calls into it, because
//! cudarc's dynamic loading panics on the first call into a library that is missing.
use crate::{CudaLibrary, GpuError, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The CUDA libraries the backend needs that the dynamic loader cannot find here.
pub fn missing_libraries() -> Vec<CudaLibrary> {
    // SAFETY: each `is_culib_present` only tries to open the library under its candidate names
    // and closes it again; nothing is called through a handle, so a missing or mismatched
    // library cannot be reached through these calls.
    let present = unsafe {
        [
            (CudaLibrary::Driver, cudarc::driver::sys::is_culib_present()),
            (CudaLibrary::Nvrtc, cudarc::nvrtc::sys::is_culib_present()),
            (CudaLibrary::Cublas, cudarc::cublas::sys::is_culib_present()),
        ]
    };
    present
        .into_iter()
        .filter(|&(_, ok)| !ok)
        .map(|(lib, _)| lib)
        .collect()
}

/// Checks that `cuda:<ordinal>` can run this backend: the driver, NVRTC and cuBLAS libraries
/// load, the driver initialises, and the device exists.
pub fn probe(ordinal: usize) -> Result<()> {
    let device = format!("cuda:{ordinal}");
    let missing = missing_libraries();
    if !missing.is_empty() {
        return Err(GpuError::CudaLibrariesMissing { device, missing });
    }
    let count = guarded(
        "cuDeviceGetCount",
        cudarc::driver::CudaContext::device_count,
    )?
    .map_err(|e| GpuError::DeviceUnavailable {
        device: device.clone(),
        reason: format!("the CUDA driver did not initialise: {e}"),
    })?;
    if ordinal >= count.max(0) as usize {
        return Err(GpuError::DeviceUnavailable {
            device,
            reason: format!("this machine has {count} CUDA device(s)"),
        });
    }
    Ok(())
}

/// Runs the first call into a CUDA library, turning a panic inside cudarc (a library that
/// loads but lacks a symbol this build expects, e.g. a driver older than CUDA 12.8) into an
/// error instead of unwinding through the caller.
pub(crate) fn guarded<T>(op: &'static str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        GpuError::cuda(op, format!("the CUDA library call panicked: {msg}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_turns_a_panic_into_an_error() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r = guarded("test_op", || -> u32 { panic!("Missing symbol cuFoo") });
        std::panic::set_hook(prev);
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("test_op") && e.contains("Missing symbol cuFoo"),
            "{e}"
        );
        assert_eq!(guarded("ok", || 7).unwrap(), 7);
    }
}
