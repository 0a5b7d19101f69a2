//! Messages between the coordinator and partition actors. Every request carries
//! (run, epoch, layer, phase) so handling is idempotent and stale requests are recognised.
use crate::ActorError;
use actix::Message;
use std::sync::Arc;
use trellis_gpu::KernelTimes;
use trellis_runtime::grad_codec::GradPayload;
use trellis_transport::{HaloBlock, Phase, RunId, TraceContext};

/// Run one layer of a pass on a partition.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Result<StepReply, ActorError>")]
pub struct Step {
    pub run: RunId,
    pub epoch: u32,
    pub layer: u16,
    /// `Forward` / `Eval`: forward of `layer`; `Backward`: backward of `layer`.
    pub phase: Phase,
    /// The requesting (epoch) span, parent of the partition's layer span.
    pub trace: Option<TraceContext>,
}

/// Apply the all-reduced gradients with the optimizer, then snapshot the replica.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Applied, ActorError>")]
pub struct ApplyStep {
    pub run: RunId,
    pub epoch: u32,
    /// The sum over partitions of every parameter's gradient, concatenated in parameter order.
    pub grads: Arc<[f32]>,
    /// The all-reduce span, parent of the partition's optimizer and replication spans.
    pub trace: Option<TraceContext>,
}

/// Forget everything about `epoch` in progress (caches, halo blocks, pending requests): the
/// epoch is about to be replayed after a recovery.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct ResetEpoch {
    pub epoch: u32,
    /// The training step is replayed: a partition that already applied `epoch` goes back to
    /// the committed state before it.
    pub rollback: bool,
}

/// A halo block delivered by the transport.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Halo(pub HaloBlock);

/// What a step produced.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// A layer finished; its halo rows were sent.
    LayerDone,
    /// The training forward finished: sums over this partition's training nodes.
    Loss {
        loss_sum: f64,
        count: usize,
        correct: usize,
    },
    /// The backward finished: this partition's weight gradients, concatenated.
    Grads(Arc<[f32]>),
    /// The same, compressed (`TrainConfig::grad_codec`, error feedback at the partition).
    CompressedGrads(Arc<GradPayload>),
    /// The evaluation forward finished: correct predictions per split.
    Eval {
        train: usize,
        val: usize,
        test: usize,
    },
}

/// A partition's answer to a `Step` request.
#[derive(Debug, Clone)]
pub struct StepReply {
    pub part: u32,
    /// Time this partition spent computing the step.
    pub compute_ms: f64,
    /// Halo payload bytes this partition sent during the step (encoded, as sent).
    pub halo_bytes: u64,
    /// What those halo rows would have taken as exact fp32.
    pub halo_fp32_bytes: u64,
    /// Time of the step's kernels by family (part of `compute_ms`).
    pub kernels: KernelTimes,
    pub outcome: Outcome,
    /// Set in the first reply after a supervised restart: the step and the weights digest of
    /// the state the partition restored (the coordinator checks it against the digest it
    /// committed for that step).
    pub restored: Option<RestoreReport>,
}

/// A partition's answer to an [`ApplyStep`].
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The new weights digest.
    pub digest: String,
    /// Set in the first answer after a supervised restart (a panic in the optimizer step):
    /// the state the partition restored before applying again.
    pub restored: Option<RestoreReport>,
    /// What replicating the new state cost this partition before it answered.
    pub replica: ReplicaCost,
}

/// The time replication took on a partition's thread before its optimizer step answered (the
/// snapshot's copy-out, its encoding and BLAKE3 digest, queueing it for the replica nodes:
/// the epoch's critical path waits for it) and the bytes shipped. The transfer itself is
/// asynchronous (overlapped with the next epoch) and not counted here.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaCost {
    pub ms: f64,
    pub bytes: u64,
}

/// The state a restarted partition resumed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreReport {
    /// Optimizer steps the restored state has applied.
    pub epoch: u32,
    /// Weights digest computed from the restored tensors.
    pub digest: String,
}
