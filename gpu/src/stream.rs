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
/// order and [`Stream::synchronize`] has nothing to wait for. On a GPU (feature `cuda`) ops
/// enqueue kernels on the stream's own CUDA stream and return; tensors the stream creates live
/// in device memory, and reach the host through [`Stream::download`] (which waits).
#[derive(Debug, Clone)]
pub struct Stream {
    id: u64,
    device: Device,
    backend: Backend,
    budget: ThreadBudget,
    /// Time spent in this stream's kernels (shared by its clones).
    clock: Arc<KernelClock>,
    /// When set, ops refuse to start ([`GpuError::Cancelled`]) once the token is cancelled,
    /// and long kernels run in pieces with a check between pieces.
    cancel: Option<CancelToken>,
    /// Divides the rows per piece of a cancellable stream (tests cut small kernels with it).
    piece_divisor: usize,
    /// When set, this stream's work is background work: its long kernels run in pieces and
    /// wait, before each piece, while urgent (inference) work holds the gate.
    yield_to: Option<PriorityGate>,
}

/// What runs a stream's ops.
#[derive(Debug, Clone)]
enum Backend {
    /// The reference kernels in [`crate::cpu`], on the calling thread and the budget.
    Cpu,
    /// A CUDA compute stream (with its transfer stream and cuBLAS handle), shared by this
    /// stream's clones.
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::cuda::GpuStream>),
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

/// Priority of inference over training on shared compute. Streams that carry the gate as
/// background streams ([`Stream::yielding_to`]) cut their long kernels into row pieces (as a
/// cancellable stream does) and, before each piece, wait while any urgent work holds the gate
/// ([`PriorityGate::urgent`]): a waiting inference step runs between the pieces of a training
/// kernel instead of behind the whole kernel. A piece already running is never interrupted.
#[derive(Debug, Clone, Default)]
pub struct PriorityGate(Arc<GateState>);

#[derive(Debug, Default)]
struct GateState {
    urgent: std::sync::Mutex<usize>,
    clear: std::sync::Condvar,
    /// Times a background piece waited for urgent work.
    yields: AtomicU64,
}

/// Urgent work in progress: background streams of the gate wait between pieces until it is
/// dropped.
#[derive(Debug)]
pub struct UrgentGuard(PriorityGate);

impl PriorityGate {
    /// A gate no urgent work holds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks urgent work (an inference step) as waiting or running until the guard drops.
    pub fn urgent(&self) -> UrgentGuard {
        *self.0.urgent.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        UrgentGuard(self.clone())
    }

    /// Whether urgent work holds the gate now.
    pub fn is_urgent(&self) -> bool {
        *self.0.urgent.lock().unwrap_or_else(|e| e.into_inner()) > 0
    }

    /// How many times a background piece waited for urgent work so far.
    pub fn yields(&self) -> u64 {
        self.0.yields.load(Ordering::Relaxed)
    }

    /// Blocks while urgent work holds the gate.
    fn wait_turn(&self) {
        let mut urgent = self.0.urgent.lock().unwrap_or_else(|e| e.into_inner());
        if *urgent > 0 {
            self.0.yields.fetch_add(1, Ordering::Relaxed);
        }
        while *urgent > 0 {
            urgent = self.0.clear.wait(urgent).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for UrgentGuard {
    fn drop(&mut self) {
        let mut urgent = (self.0).0.urgent.lock().unwrap_or_else(|e| e.into_inner());
        *urgent = urgent.saturating_sub(1);
        if *urgent == 0 {
            (self.0).0.clear.notify_all();
        }
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
    /// A new stream on `device`; CPU work (all of it on the CPU, host-side bookkeeping on a
    /// GPU) runs inside `budget`.
    ///
    /// `Device::Cuda(n)` creates a new CUDA stream on GPU `n` (opening the device and compiling
    /// the kernels on first use); without a usable GPU or this build's `cuda` feature it fails
    /// with the typed error from [`Device::check_available`] naming what is missing.
    pub fn new(device: Device, budget: ThreadBudget) -> Result<Self> {
        device.check_available()?;
        let backend = match device {
            Device::Cpu => Backend::Cpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => Backend::Cuda(Arc::new(crate::cuda::GpuStream::new(n)?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                return Err(crate::GpuError::DeviceUnavailable {
                    device: device.to_string(),
                    reason: "this build has no CUDA backend".into(),
                })
            }
        };
        Ok(Stream {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            backend,
            budget,
            clock: Arc::default(),
            cancel: None,
            piece_divisor: 1,
            yield_to: None,
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

    /// This stream (same id and kernel clock) as background work of `gate`: before each piece
    /// of its long kernels it waits while urgent work holds the gate.
    pub fn yielding_to(&self, gate: PriorityGate) -> Stream {
        Stream {
            yield_to: Some(gate),
            ..self.clone()
        }
    }

    /// Whether this stream is background work of a gate ([`Stream::yielding_to`]).
    pub fn yields(&self) -> bool {
        self.yield_to.is_some()
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
        let step = if self.cancel.is_some() || self.yield_to.is_some() {
            (rows_per_piece / self.piece_divisor).max(1)
        } else {
            rows.max(1)
        };
        let mut start = 0;
        loop {
            if let Some(g) = &self.yield_to {
                g.wait_turn();
            }
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

    /// The CUDA stream behind this stream, if it runs on a GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn gpu(&self) -> Option<&crate::cuda::GpuStream> {
        match &self.backend {
            Backend::Cuda(g) => Some(g),
            Backend::Cpu => None,
        }
    }

    /// Waits until all work issued on this stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.backend {
            Backend::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.synchronize(),
        }
    }

    /// A zero-filled `rows x cols` tensor in this stream's memory.
    pub fn zeros(&self, rows: usize, cols: usize) -> Result<Tensor> {
        match &self.backend {
            Backend::Cpu => Ok(Tensor::zeros(rows, cols)),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => Ok(Tensor::from_device(g.zeros(rows, cols)?)),
        }
    }

    /// Host -> device copy of a row-major `rows x cols` block.
    pub fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Tensor> {
        match &self.backend {
            Backend::Cpu => Tensor::from_vec(rows, cols, data.to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => Ok(Tensor::from_device(g.upload(data, rows, cols)?)),
        }
    }

    /// Host -> device transfer that takes ownership of the host buffer (no copy on the CPU).
    pub fn upload_vec(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Tensor> {
        match &self.backend {
            Backend::Cpu => Tensor::from_vec(rows, cols, data),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => self.upload(&data, rows, cols),
        }
    }

    /// A tensor (host or device) in this stream's memory: moved if it is there already
    /// (parameters built on the host move onto a GPU stream with this).
    pub fn place(&self, t: Tensor) -> Result<Tensor> {
        if t.device() == self.device {
            return Ok(t);
        }
        let (rows, cols) = t.shape();
        self.upload_vec(t.into_host()?, rows, cols)
    }

    /// Moves `t` into this stream's memory in place (nothing to do if it is there).
    pub fn place_in(&self, t: &mut Tensor) -> Result<()> {
        if t.device() != self.device {
            let moved = std::mem::replace(t, Tensor::zeros(0, 0));
            *t = self.place(moved)?;
        }
        Ok(())
    }

    /// A host copy of `t` (a clone on the CPU).
    pub fn to_host(&self, t: &Tensor) -> Result<Tensor> {
        Tensor::from_vec(t.rows(), t.cols(), self.download(t)?)
    }

    /// A tensor's contents on the host, taking the tensor: a host tensor's buffer is moved
    /// out (no copy), a device tensor's copied as [`Stream::download`] does.
    pub fn download_owned(&self, t: Tensor) -> Result<Vec<f32>> {
        match &self.backend {
            Backend::Cpu => t.into_host(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => self.download(&t),
        }
    }

    /// Device -> host copy of a tensor's contents (waits for the work that writes it).
    pub fn download(&self, t: &Tensor) -> Result<Vec<f32>> {
        match &self.backend {
            Backend::Cpu => Ok(t.host("Stream::download")?.to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.download(t.on_device("Stream::download")?),
        }
    }
}

#[cfg(test)]
mod priority_tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    /// A background kernel of 60 pieces (2 ms each) while urgent work takes the gate for
    /// 50 ms in the middle: the urgent work runs between two pieces, no piece starts while it
    /// holds the gate (but the one already past the gate), and the kernel then finishes.
    #[test]
    fn urgent_work_runs_between_the_pieces_of_a_background_kernel() {
        let gate = PriorityGate::new();
        let background = Stream::cpu(1).unwrap().yielding_to(gate.clone());
        let starts = Mutex::new(Vec::new());
        let window = Mutex::new(None);
        std::thread::scope(|s| {
            s.spawn(|| {
                background
                    .run_rows(KernelKind::Gemm, 60, 1, |r| {
                        starts.lock().unwrap().push((Instant::now(), r.start));
                        std::thread::sleep(Duration::from_millis(2));
                    })
                    .unwrap();
            });
            std::thread::sleep(Duration::from_millis(30));
            let guard = gate.urgent();
            let from = Instant::now();
            assert!(gate.is_urgent());
            std::thread::sleep(Duration::from_millis(50));
            let to = Instant::now();
            drop(guard);
            *window.lock().unwrap() = Some((from, to));
        });
        let (from, to) = window.into_inner().unwrap().unwrap();
        let starts = starts.into_inner().unwrap();
        assert_eq!(starts.len(), 60, "every piece ran once");
        let before = starts.iter().filter(|(t, _)| *t < from).count();
        let during = starts.iter().filter(|(t, _)| *t >= from && *t < to).count();
        let after = starts.iter().filter(|(t, _)| *t >= to).count();
        assert!(before >= 2 && after >= 2, "{before} before, {after} after");
        assert!(
            during <= 1,
            "{during} pieces started while urgent work held the gate"
        );
        assert_eq!(gate.yields(), 1, "the kernel waited once");
        // Pieces run in order, before and after the pause.
        assert!(starts.windows(2).all(|w| w[0].1 < w[1].1));
        assert!(!gate.is_urgent());
    }

    /// A stream without the gate runs its kernel in one piece, whatever the gate says.
    #[test]
    fn streams_without_the_gate_do_not_wait() {
        let gate = PriorityGate::new();
        let _urgent = gate.urgent();
        let plain = Stream::cpu(1).unwrap();
        let mut calls = 0;
        plain
            .run_rows(KernelKind::Other, 1000, 10, |_| calls += 1)
            .unwrap();
        assert_eq!(calls, 1);
        assert_eq!(gate.yields(), 0);
    }
}

#[cfg(test)]
mod download_tests {
    use super::*;

    /// Taking a tensor gives the values a copy gives.
    #[test]
    fn a_taken_tensor_holds_what_its_copy_holds() {
        let s = Stream::cpu(1).unwrap();
        let t = s.upload(&[1.0, -2.0, 3.5, 0.25], 2, 2).unwrap();
        let copy = s.download(&t).unwrap();
        assert_eq!(s.download_owned(t).unwrap(), copy);
    }
}
