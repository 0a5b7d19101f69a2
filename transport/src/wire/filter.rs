//! [`RecvFilter`]: the receive-side admission check for halo blocks, free of I/O.
use crate::{MsgHeader, PartId, Phase, RunId};
use std::collections::{HashMap, HashSet};
use thiserror::Error;

/// Why a received block was dropped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Rejection {
    #[error("partition {0} is not hosted here")]
    UnknownPartition(PartId),
    #[error("run {0} is not active here")]
    UnknownRun(RunId),
    #[error("node {0} is fenced (declared lost); its messages are refused")]
    Fenced(u32),
    #[error("stale block for partition {part}: epoch {epoch} < current epoch {current}")]
    StaleEpoch {
        part: PartId,
        epoch: u32,
        current: u32,
    },
}

/// Counts of admitted and dropped blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FilterStats {
    pub accepted: u64,
    pub unknown_partition: u64,
    pub unknown_run: u64,
    pub stale_epoch: u64,
    pub fenced: u64,
}

/// Admits blocks addressed to a local partition of an active run at its current epoch or later,
/// and evaluation blocks of the epoch just before it: a partition adopted after the last
/// evaluation replays that evaluation at the start of the next epoch, so its peers' evaluation
/// rows of epoch `e` arrive while the run is already in epoch `e + 1`.
///
/// A run must be announced with [`RecvFilter::set_epoch`] before its first block arrives;
/// blocks of other runs are dropped.
#[derive(Debug, Default)]
pub struct RecvFilter {
    local: HashSet<PartId>,
    epochs: HashMap<RunId, u32>,
    stats: FilterStats,
}

impl RecvFilter {
    pub fn new() -> Self {
        Self::default()
    }

    /// `part` is hosted here.
    pub fn add_partition(&mut self, part: PartId) {
        self.local.insert(part);
    }

    /// `part` is no longer hosted here.
    pub fn remove_partition(&mut self, part: PartId) {
        self.local.remove(&part);
    }

    /// Sets `run`'s current epoch (it may go back, e.g. after a restore from a checkpoint).
    pub fn set_epoch(&mut self, run: RunId, epoch: u32) {
        self.epochs.insert(run, epoch);
    }

    /// Forgets `run`: its blocks are dropped from now on.
    pub fn end_run(&mut self, run: RunId) {
        self.epochs.remove(&run);
    }

    /// Counts a block refused because its sender node is fenced.
    pub fn count_fenced(&mut self) {
        self.stats.fenced += 1;
    }

    /// Admits or rejects a block with header `h`, counting the outcome.
    pub fn check(&mut self, h: &MsgHeader) -> Result<(), Rejection> {
        let verdict = if !self.local.contains(&h.to) {
            Err(Rejection::UnknownPartition(h.to))
        } else {
            match self.epochs.get(&h.run) {
                None => Err(Rejection::UnknownRun(h.run)),
                Some(&current) if h.epoch < current && !replayed_eval(h, current) => {
                    Err(Rejection::StaleEpoch {
                        part: h.to,
                        epoch: h.epoch,
                        current,
                    })
                }
                Some(_) => Ok(()),
            }
        };
        match &verdict {
            Ok(()) => self.stats.accepted += 1,
            Err(Rejection::UnknownPartition(_)) => self.stats.unknown_partition += 1,
            Err(Rejection::UnknownRun(_)) => self.stats.unknown_run += 1,
            Err(Rejection::StaleEpoch { .. }) => self.stats.stale_epoch += 1,
            Err(Rejection::Fenced(_)) => self.stats.fenced += 1,
        }
        verdict
    }

    pub fn stats(&self) -> FilterStats {
        self.stats
    }
}

/// An evaluation block of the epoch before `current` (an evaluation replayed after recovery).
fn replayed_eval(h: &MsgHeader, current: u32) -> bool {
    h.phase == Phase::Eval && h.epoch + 1 == current
}
