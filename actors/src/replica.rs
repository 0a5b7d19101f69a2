//! The node's replica store: the latest committed state of each partition's model replica and
//! optimizer, kept in memory so a restarted actor resumes from it without a checkpoint file.
use dashmap::DashMap;
use std::sync::Arc;
use trellis_gpu::Tensor;

/// A partition's dynamic state after an optimizer step.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Epochs completed (the step number).
    pub epoch: u32,
    pub params: Vec<Tensor>,
    /// Optimizer moments, in parameter order.
    pub opt_state: Vec<(Tensor, Tensor)>,
    pub opt_steps: u64,
    /// Digest of `params` when the snapshot was taken.
    pub digest: String,
}

/// Snapshots by partition id, shared by the actors of one node.
#[derive(Debug, Default)]
pub struct ReplicaStore {
    snaps: DashMap<u32, Arc<Snapshot>>,
    /// Replication off: nothing is stored (measures what replication costs).
    disabled: bool,
}

impl ReplicaStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that keeps nothing: replication off.
    pub fn disabled() -> Self {
        ReplicaStore {
            disabled: true,
            ..Self::default()
        }
    }

    /// Whether snapshots are kept (replication on).
    pub fn enabled(&self) -> bool {
        !self.disabled
    }

    /// Stores `part`'s latest snapshot.
    pub fn put(&self, part: u32, snap: Snapshot) {
        if !self.disabled {
            self.snaps.insert(part, Arc::new(snap));
        }
    }
    /// `part`'s latest snapshot.
    pub fn get(&self, part: u32) -> Option<Arc<Snapshot>> {
        self.snaps.get(&part).map(|s| s.clone())
    }

    /// The snapshot of the most advanced partition held here. Every partition's model
    /// replica and optimizer state are identical after a step (the all-reduce makes them so
    /// and the coordinator checks their digests), so this is the state a partition re-placed
    /// here after a node loss resumes from.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.snaps
            .iter()
            .max_by_key(|e| (e.value().epoch, std::cmp::Reverse(*e.key())))
            .map(|e| e.value().clone())
    }
}
