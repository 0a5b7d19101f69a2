//! One CUDA context per GPU, with the kernels compiled once (NVRTC) and loaded into it.
use super::probe::{guarded, probe};
use crate::kernel_source::{device_source, KERNEL_NAMES};
use crate::{GpuError, Result};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::CompileOptions;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A GPU: its primary context and the compiled kernels. Shared by every stream on it.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    kernels: HashMap<&'static str, CudaFunction>,
}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();

impl CudaDevice {
    /// The device `cuda:<ordinal>`, opened and its kernels compiled on first use, then cached
    /// for the process. Fails with a typed error (never a panic) where CUDA is unavailable.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        probe(ordinal)?;
        let map = DEVICES.get_or_init(Default::default);
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let ctx = guarded("cuCtxCreate", || CudaContext::new(ordinal))?
            .map_err(|e| GpuError::cuda("cuCtxCreate", e))?;
        let name = ctx
            .name()
            .map_err(|e| GpuError::cuda("cuDeviceGetName", e))?;
        let kernels = compile(&ctx)?;
        let dev = Arc::new(CudaDevice {
            ordinal,
            name,
            ctx,
            kernels,
        });
        map.insert(ordinal, dev.clone());
        Ok(dev)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        self.ctx
            .total_mem()
            .map_err(|e| GpuError::cuda("cuDeviceTotalMem", e))
    }

    /// Theoretical memory bandwidth in GB/s: 2 transfers per memory clock times the bus width
    /// (both from the device attributes).
    pub fn peak_bandwidth_gbs(&self) -> Result<f64> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a| {
            self.ctx
                .attribute(a)
                .map_err(|e| GpuError::cuda("cuDeviceGetAttribute", e))
        };
        let clock_khz = attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? as f64;
        let bus_bits = attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as f64;
        Ok(2.0 * clock_khz * 1e3 * bus_bits / 8.0 / 1e9)
    }

    /// The loaded kernel `name` (one of [`KERNEL_NAMES`]).
    pub(crate) fn kernel(&self, name: &'static str) -> Result<&CudaFunction> {
        self.kernels
            .get(name)
            .ok_or_else(|| GpuError::cuda("kernel lookup", format!("no kernel named {name}")))
    }
}

/// Compiles the kernel module for this device's architecture and loads every kernel.
///
/// `--fmad=false` keeps `a * b + c` as two rounded operations (as Rust computes it), so the
/// kernels that sum in the CPU backend's order reproduce its bits; division and square root
/// stay IEEE-rounded (NVRTC's defaults).
fn compile(ctx: &Arc<CudaContext>) -> Result<HashMap<&'static str, CudaFunction>> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| GpuError::cuda("cuDeviceGetAttribute", e))?;
    let opts = CompileOptions {
        fmad: Some(false),
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some("trellis_kernels.cu".into()),
        ..Default::default()
    };
    let src = device_source();
    let ptx = guarded("nvrtcCompileProgram", || {
        cudarc::nvrtc::compile_ptx_with_opts(&src, opts)
    })?
    .map_err(|e| GpuError::cuda("nvrtcCompileProgram", format!("{e:?}")))?;
    let module = ctx
        .load_module(ptx)
        .map_err(|e| GpuError::cuda("cuModuleLoadData", e))?;
    KERNEL_NAMES
        .iter()
        .map(|&name| {
            module
                .load_function(name)
                .map(|f| (name, f))
                .map_err(|e| GpuError::cuda("cuModuleGetFunction", format!("{name}: {e}")))
        })
        .collect()
}
