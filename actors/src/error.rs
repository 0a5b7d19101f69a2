//! Typed errors of the actor runtime; each names the partition involved.
use thiserror::Error;

/// Errors of partition actors, supervisors and the coordinator.
#[derive(Debug, Error)]
pub enum ActorError {
    /// A partition's computation panicked; its supervisor restarts it.
    #[error("partition {part} panicked: {message}")]
    Panicked { part: u32, message: String },
    /// A partition's computation failed.
    #[error("partition {part}: {source}")]
    Compute {
        part: u32,
        #[source]
        source: trellis_runtime::RuntimeError,
    },
    /// A partition did not answer before its deadline.
    #[error("partition {part} did not answer within {ms} ms ({what})")]
    Timeout { part: u32, ms: u64, what: String },
    /// A partition's mailbox is closed (the actor stopped and was not restarted).
    #[error("partition {part} is unreachable: {detail}")]
    Unreachable { part: u32, detail: String },
    /// A message did not fit the protocol state (wrong run, stale epoch, ...).
    #[error("partition {part}: protocol violation: {detail}")]
    Protocol { part: u32, detail: String },
    /// With `--staleness 1`, the halo rows a partition holds for its next epoch were lost: it
    /// was restarted from its replica on another node while the optimizer step of `epoch` was
    /// replayed, after its own node (which had received them) was lost.
    #[error(
        "partition {part}: the halo rows of epoch {epoch}, which epoch {} uses with \
         --staleness 1, were lost with the partition's node during the optimizer step; the \
         run cannot go on from here", epoch + 1
    )]
    HeldRowsLost { part: u32, epoch: u32 },
    /// An evaluation replayed to rebuild the partitions' evaluation halo state (rows skipped
    /// with `--eval-skip-threshold`) counted other correct predictions than its first run.
    #[error(
        "the evaluation of epoch {epoch}, replayed after a recovery to rebuild the evaluation \
         halo rows, counted {replay} correct (train/val/test), its first run {first}"
    )]
    EvalReplayDiffers {
        epoch: u32,
        first: String,
        replay: String,
    },
    /// Replicas disagree after an optimizer step.
    #[error("replicas diverged at epoch {epoch}: partition {part} has digest {got}, partition 0 has {want}")]
    Diverged {
        epoch: u32,
        part: u32,
        got: String,
        want: String,
    },
    /// The restart budget of a partition is spent.
    #[error(
        "partition {part} failed {restarts} times within the restart window; giving up: {last}"
    )]
    RestartsExhausted {
        part: u32,
        restarts: u32,
        last: String,
    },
    /// Setting up the topology failed.
    #[error(transparent)]
    Runtime(#[from] trellis_runtime::RuntimeError),
    /// A stream or kernel could not be set up.
    #[error(transparent)]
    Gpu(#[from] trellis_gpu::GpuError),
    /// A partition on another node failed (the message is that node's error).
    #[error("partition {part} on node {node}: {message}")]
    Remote {
        node: u32,
        part: u32,
        message: String,
    },
    /// A node of the cluster failed, stopped answering, or broke the protocol.
    #[error("node {node}: {detail}")]
    Node { node: u32, detail: String },
    /// Nothing arrived from any node within the wait (no node to blame yet).
    #[error("no message from any node within {ms} ms")]
    NoMessage { ms: u64 },
    /// A checkpoint cannot be written, read or used (single-process runs and clusters alike).
    #[error("checkpoint {}: {detail}", path.display())]
    Checkpoint {
        path: std::path::PathBuf,
        detail: String,
    },
    /// The cluster file or the cluster's setup is wrong.
    #[error("cluster: {0}")]
    Cluster(String),
    /// The run was cancelled (Ctrl-C or `TrainingRun::cancel`).
    #[error("the run was cancelled")]
    Cancelled,
    /// The actor system could not be started or stopped.
    #[error("actor system: {0}")]
    System(String),
}
