//! Streams: ordered queues of work owned by one actor.
use crate::{Device, GpuError, Result, Tensor, ThreadBudget};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

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
    /// Time spent in this stream's kernels (shared by its clones).
    clock: Arc<KernelClock>,
    /// When set, ops refuse to start ([`GpuError::Cancelled`]) once the token is cancelled,
    /// and long kernels run in pieces with a check between pieces.
    cancel: Option<CancelToken>,
    /// Divides the rows per piece of a cancellable stream (tests cut small kernels with it).
    piece_divisor: usize,
}

/// A request to abandon the work in progress on the streams that carry this token (an epoch
/// being rolled back after a failure elsewhere).
///
/// Kernels are not preemptible, so cancellation is cooperative: an op checks the token before
/// it starts and, on a cancellable stream, between the row pieces a long kernel is cut into
/// (about ten milliseconds of work each). Whoever cancels must [`CancelToken::clear`] the
/// token before the stream's owner issues work that must run.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }
    /// Asks the streams carrying this token to stop at their next check.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    /// Lets work run again.
    pub fn clear(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
    /// Whether cancellation was asked for.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Which kernel family a timed op belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KernelKind {
    Gemm,
    Spmm,
    Other,
}

/// Cumulative kernel time of a stream, in nanoseconds per family.
#[derive(Debug, Default)]
struct KernelClock {
    ns: [AtomicU64; 3],
}

/// Time a stream's kernels took (wall time of each kernel, its parallel part included), ms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelTimes {
    /// Dense matrix products.
    pub gemm_ms: f64,
    /// Sparse-dense products (aggregation).
    pub spmm_ms: f64,
    /// Every other kernel (dropout, activations, gathers, loss, optimizer, ...).
    pub other_ms: f64,
}

impl KernelTimes {
    /// Sum over the three families.
    pub fn total_ms(&self) -> f64 {
        self.gemm_ms + self.spmm_ms + self.other_ms
    }
    /// The time between an earlier reading `before` and this one.
    pub fn since(&self, before: &KernelTimes) -> KernelTimes {
        KernelTimes {
            gemm_ms: self.gemm_ms - before.gemm_ms,
            spmm_ms: self.spmm_ms - before.spmm_ms,
            other_ms: self.other_ms - before.other_ms,
        }
    }
    /// Element-wise sum.
    pub fn add(&mut self, o: &KernelTimes) {
        self.gemm_ms += o.gemm_ms;
        self.spmm_ms += o.spmm_ms;
        self.other_ms += o.other_ms;
    }
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
            clock: Arc::default(),
            cancel: None,
            piece_divisor: 1,
        })
    }

    /// This stream (same id and kernel clock) with its work cancellable through `token`.
    pub fn with_cancel(&self, token: CancelToken) -> Stream {
        Stream {
            cancel: Some(token),
            ..self.clone()
        }
    }

    /// This stream (same id and kernel clock) without a cancel token: work that must not stop
    /// half-way (an optimizer step) runs on it.
    pub fn uncancellable(&self) -> Stream {
        Stream {
            cancel: None,
            ..self.clone()
        }
    }

    /// Cuts a cancellable stream's kernels into `divisor` times more pieces (for tests that
    /// exercise pieces on small inputs).
    #[doc(hidden)]
    pub fn with_piece_divisor(mut self, divisor: usize) -> Stream {
        self.piece_divisor = divisor.max(1);
        self
    }

    /// Fails with [`GpuError::Cancelled`] when this stream's token is cancelled.
    pub(crate) fn check_cancelled(&self) -> Result<()> {
        match &self.cancel {
            Some(t) if t.is_cancelled() => Err(GpuError::Cancelled),
            _ => Ok(()),
        }
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

    /// Runs data-parallel CPU work inside the budget (timed as [`KernelKind::Other`]).
    pub(crate) fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.run_as(KernelKind::Other, f)
    }

    /// Runs data-parallel CPU work inside the budget, adding its wall time to `kind`.
    pub(crate) fn run_as<R: Send>(&self, kind: KernelKind, f: impl FnOnce() -> R + Send) -> R {
        let t = Instant::now();
        let r = self.budget.install(f);
        self.clock.ns[kind as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Runs a kernel over `rows` independent rows as `f(range)` calls: one call on a stream
    /// without a cancel token, else pieces of `rows_per_piece` rows with a cancellation check
    /// before each. `f` runs at least once (with `0..0` when there are no rows).
    pub(crate) fn run_rows(
        &self,
        kind: KernelKind,
        rows: usize,
        rows_per_piece: usize,
        mut f: impl FnMut(Range<usize>) + Send,
    ) -> Result<()> {
        let step = if self.cancel.is_some() {
            (rows_per_piece / self.piece_divisor).max(1)
        } else {
            rows.max(1)
        };
        let mut start = 0;
        loop {
            self.check_cancelled()?;
            let end = (start + step).min(rows);
            self.run_as(kind, || f(start..end));
            start = end;
            if start >= rows {
                return Ok(());
            }
        }
    }

    /// Cumulative time of this stream's kernels since it was created.
    pub fn kernel_times(&self) -> KernelTimes {
        let ms = |k: KernelKind| self.clock.ns[k as usize].load(Ordering::Relaxed) as f64 / 1e6;
        KernelTimes {
            gemm_ms: ms(KernelKind::Gemm),
            spmm_ms: ms(KernelKind::Spmm),
            other_ms: ms(KernelKind::Other),
        }
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
