//! Where a partitioned training step's time goes: for each step of the epoch protocol (phase,
//! layer) the coordinator's wall time, each partition's compute time with its kernels by
//! family, and the halo bytes sent; then the all-reduce and optimizer step.
use crate::protocol::messages::StepReply;
use trellis_gpu::KernelTimes;
use trellis_transport::Phase;

/// One step of the epoch protocol, on every partition.
#[derive(Debug, Clone, PartialEq)]
pub struct StepProfile {
    pub phase: Phase,
    pub layer: u16,
    /// From sending the step to the last reply, ms.
    pub wall_ms: f64,
    /// Each partition's compute time (its stages, from the first kernel to its reply), ms.
    pub compute_ms: Vec<f64>,
    /// Each partition's kernel times (part of its compute time).
    pub kernels: Vec<KernelTimes>,
    /// Halo payload bytes sent by all partitions.
    pub halo_bytes: u64,
}

impl StepProfile {
    pub(crate) fn new(phase: Phase, layer: u16, wall_ms: f64, replies: &[StepReply]) -> Self {
        let mut compute_ms = vec![0.0; replies.len()];
        let mut kernels = vec![KernelTimes::default(); replies.len()];
        for (k, r) in replies.iter().enumerate() {
            compute_ms[k] = r.compute_ms;
            kernels[k] = r.kernels;
        }
        StepProfile {
            phase,
            layer,
            wall_ms,
            compute_ms,
            kernels,
            halo_bytes: replies.iter().map(|r| r.halo_bytes).sum(),
        }
    }

    /// The longest compute time of one partition, ms.
    pub fn max_compute_ms(&self) -> f64 {
        self.compute_ms.iter().cloned().fold(0.0, f64::max)
    }

    /// Kernel times summed over partitions.
    pub fn kernels_total(&self) -> KernelTimes {
        let mut t = KernelTimes::default();
        self.kernels.iter().for_each(|k| t.add(k));
        t
    }
}

/// The training step of one epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochProfile {
    pub epoch: u32,
    /// Forward steps (layer 0 up), then backward steps (last layer down).
    pub steps: Vec<StepProfile>,
    /// Gradient all-reduce plus every partition's optimizer step, ms.
    pub apply_ms: f64,
}

impl EpochProfile {
    pub(crate) fn new(epoch: u32) -> Self {
        EpochProfile {
            epoch,
            steps: Vec::new(),
            apply_ms: 0.0,
        }
    }

    /// Halo payload bytes of the whole step.
    pub fn halo_bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.halo_bytes).sum()
    }
}
