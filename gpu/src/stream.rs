//! Streams: ordered queues of work owned by one actor.
use crate::{Device, Result, Tensor, ThreadBudget};
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// An ordered queue of work on one device, owned by one actor.
///
/// Ops issued on one stream run in issue order; different streams may run concurrently. On the
/// CPU a stream executes each op when it is issued, on the issuing (actor's) thread, with the
/// op's data-parallel part spread over the shared [`ThreadBudget`]; so program order is stream
/// order and [`Stream::synchronize`] has nothing to wait for. A CUDA stream will enqueue instead.
#[derive(Debug, Clone)]
pub struct Stream {
    id: u64,
    device: Device,
    budget: ThreadBudget,
}

impl Stream {
    /// A new stream on `device` that runs CPU work inside `budget`.
    ///
    /// `Device::Cuda` fails with a typed error: without a usable GPU, the one from
    /// [`Device::check_available`] naming what is missing; with one, because this stream type
    /// runs host tensors — device work goes through `cuda::GpuStream` (ARCHITECTURE.md, "CUDA
    /// backend", says what is left to route models through it).
    pub fn new(device: Device, budget: ThreadBudget) -> Result<Self> {
        device.check_available()?;
        if let Device::Cuda(_) = device {
            return Err(crate::GpuError::DeviceUnavailable {
                device: device.to_string(),
                reason: "models and partition actors do not run on CUDA streams yet (the op \
                         API on device tensors is `trellis_gpu::cuda::GpuStream`)"
                    .into(),
            });
        }
        Ok(Stream {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            budget,
        })
    }

    /// A CPU stream on the process-wide budget (`threads` fixes its size on first use).
    pub fn cpu(threads: usize) -> Result<Self> {
        Self::new(Device::Cpu, ThreadBudget::global(threads)?)
    }

    /// This stream's process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The device this stream runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The thread budget CPU work of this stream runs in.
    pub fn budget(&self) -> &ThreadBudget {
        &self.budget
    }

    /// Number of CPU threads kernels of this stream may use.
    pub fn threads(&self) -> usize {
        self.budget.threads()
    }

    /// Runs data-parallel CPU work inside the budget.
    pub(crate) fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.budget.install(f)
    }

    /// Waits until all work issued on this stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Host -> device copy of a row-major `rows x cols` block.
    pub fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Tensor> {
        Tensor::from_vec(rows, cols, data.to_vec())
    }

    /// Host -> device transfer that takes ownership of the host buffer (no copy on the CPU).
    pub fn upload_vec(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Tensor> {
        Tensor::from_vec(rows, cols, data)
    }

    /// Device -> host copy of a tensor's contents.
    pub fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.as_slice().to_vec())
    }
}
