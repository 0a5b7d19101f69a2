//! Devices and the process-wide CPU thread budget.
use crate::{GpuError, Result};
use std::fmt;
use std::sync::{Arc, OnceLock};

/// Where tensors live and kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The host CPU (reference backend).
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (needs the `cuda` feature).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
                Some(i) => Ok(Device::Cuda(i)),
                None => Err(GpuError::DeviceUnavailable {
                    device: s.to_string(),
                    reason: "unknown device name (expected cpu, cuda or cuda:N)".into(),
                }),
            },
        }
    }
}

impl Device {
    /// Checks that this device can run kernels in this build on this machine.
    ///
    /// For `cuda:N` with the `cuda` feature this loads the driver, NVRTC and cuBLAS libraries
    /// (each checked before its first call, so a machine without them gets
    /// [`GpuError::CudaLibrariesMissing`] naming them, never a panic) and checks that device
    /// `N` exists.
    pub fn check_available(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(i) => crate::cuda::probe(*i),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(GpuError::DeviceUnavailable {
                device: self.to_string(),
                reason: "this build has no CUDA backend (rebuild with `--features cuda`)".into(),
            }),
        }
    }
}

/// The global CPU thread budget: one rayon pool shared by every stream of the process, so
/// that P partition actors with their own streams never run more than `threads` kernel
/// threads together.
#[derive(Clone)]
pub struct ThreadBudget {
    pool: Arc<rayon::ThreadPool>,
}

static GLOBAL: OnceLock<ThreadBudget> = OnceLock::new();

impl ThreadBudget {
    /// A fresh budget of `threads` threads (0 = number of CPUs).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = if threads == 0 { num_cpus() } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("trellis-cpu-{i}"))
            .build()
            .map_err(|e| GpuError::ThreadPool(e.to_string()))?;
        Ok(ThreadBudget {
            pool: Arc::new(pool),
        })
    }

    /// The process-wide budget; the first call fixes its size (0 = number of CPUs).
    pub fn global(threads: usize) -> Result<Self> {
        if let Some(b) = GLOBAL.get() {
            return Ok(b.clone());
        }
        let b = Self::new(threads)?;
        Ok(GLOBAL.get_or_init(|| b).clone())
    }

    /// Number of threads in this budget.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` inside this budget's pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

impl fmt::Debug for ThreadBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadBudget")
            .field("threads", &self.threads())
            .finish()
    }
}

fn num_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
