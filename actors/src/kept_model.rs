//! The trained model a partitioned run hands back: as each epoch ends, the committed
//! parameters of the epoch of best validation accuracy and of the last epoch are taken from
//! the node's [`ReplicaStore`] (after a step every partition holds the same model replica, so
//! any partition's snapshot is the model). Kept as `Arc`s of snapshots the store already
//! holds: keeping costs no copy. A keeper can also hand every epoch's committed model to a
//! channel as the epoch ends (serving beside partitioned training publishes from it).
use crate::replica::{ReplicaStore, Snapshot};
use crate::ActorError;
use std::sync::{mpsc, Arc, Mutex};
use trellis_runtime::report::BestTracker;
use trellis_runtime::EpochLog;

/// The committed state after one epoch of a run.
#[derive(Debug, Clone)]
pub struct KeptModel {
    /// The epoch (step number) the parameters are from.
    pub epoch: u32,
    /// The partition snapshot: `params` in the model's parameter order, and their digest.
    pub snapshot: Arc<Snapshot>,
}

/// The models a run kept: the best validation epoch's (`None` when the best epoch was
/// trained before the run resumed from a checkpoint) and the last epoch's.
#[derive(Debug, Clone, Default)]
pub struct KeptModels {
    pub best: Option<KeptModel>,
    pub last: Option<KeptModel>,
}

/// Takes the snapshots as epochs end (the coordinator's epoch-done hook).
pub(crate) struct ModelKeeper {
    store: Arc<ReplicaStore>,
    best: BestTracker,
    kept: Arc<Mutex<KeptModels>>,
    /// Where every epoch's committed model goes too (a receiver that hung up is ignored).
    publish: Option<mpsc::Sender<KeptModel>>,
}

impl ModelKeeper {
    /// A keeper over `store` that has seen `prior` (the logs of epochs done before a resume)
    /// and keeps into `kept`.
    pub(crate) fn new(
        store: Arc<ReplicaStore>,
        prior: &[EpochLog],
        kept: Arc<Mutex<KeptModels>>,
    ) -> Self {
        let mut best = BestTracker::default();
        prior.iter().for_each(|l| best.update(l));
        ModelKeeper {
            store,
            best,
            kept,
            publish: None,
        }
    }

    /// Also sends every epoch's committed model to `to` as the epoch ends.
    pub(crate) fn publishing_to(mut self, to: Option<mpsc::Sender<KeptModel>>) -> Self {
        self.publish = to;
        self
    }

    /// Records the epoch `log` names; its committed snapshot must be in the store.
    pub(crate) fn epoch_done(&mut self, log: &EpochLog) -> Result<(), ActorError> {
        self.best.update(log);
        let snapshot = self
            .store
            .latest()
            .filter(|s| s.epoch == log.epoch && s.digest == log.weights_digest)
            .ok_or_else(|| {
                ActorError::System(format!(
                    "no replica of the committed state of epoch {} to keep the model from \
                     (is replication off?)",
                    log.epoch
                ))
            })?;
        let kept = KeptModel {
            epoch: log.epoch,
            snapshot,
        };
        if let Some(to) = &self.publish {
            // The receiver is the service beside the run: a service that stopped must not
            // stop training.
            let _ = to.send(kept.clone());
        }
        let mut models = self.kept.lock().expect("poisoned");
        if self.best.best_epoch == log.epoch {
            models.best = Some(kept.clone());
        }
        models.last = Some(kept);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_gpu::Tensor;

    fn snap(epoch: u32, v: f32) -> Snapshot {
        Snapshot {
            epoch,
            params: vec![Tensor::from_vec(1, 2, vec![v, v]).unwrap()],
            opt_state: vec![],
            opt_steps: u64::from(epoch),
            digest: format!("d{epoch}"),
            grad_residual: vec![],
            held_halo: vec![],
            skip_sent: vec![],
        }
    }

    fn log(epoch: u32, val_acc: f64) -> EpochLog {
        EpochLog {
            epoch,
            val_acc,
            weights_digest: format!("d{epoch}"),
            ..EpochLog::default()
        }
    }

    #[test]
    fn keeps_the_best_validation_epoch_and_the_last() {
        let store = Arc::new(ReplicaStore::new());
        let kept = Arc::default();
        let mut k = ModelKeeper::new(store.clone(), &[], Arc::clone(&kept));
        for (e, val) in [(1, 0.5), (2, 0.7), (3, 0.6)] {
            store.put(0, Arc::new(snap(e, e as f32)));
            store.put(1, Arc::new(snap(e, e as f32)));
            k.epoch_done(&log(e, val)).unwrap();
        }
        let m = kept.lock().unwrap().clone();
        assert_eq!(m.best.as_ref().unwrap().epoch, 2);
        assert_eq!(m.best.unwrap().snapshot.params[0].as_slice(), &[2.0, 2.0]);
        assert_eq!(m.last.unwrap().epoch, 3);
    }

    #[test]
    fn every_epoch_is_published_in_order_and_a_gone_receiver_is_harmless() {
        let store = Arc::new(ReplicaStore::new());
        let (tx, rx) = mpsc::channel();
        let mut k = ModelKeeper::new(store.clone(), &[], Arc::default()).publishing_to(Some(tx));
        for e in 1..=3 {
            store.put(0, Arc::new(snap(e, e as f32)));
            k.epoch_done(&log(e, 0.1 * f64::from(e))).unwrap();
        }
        let got: Vec<(u32, f32)> = rx
            .try_iter()
            .map(|m| (m.epoch, m.snapshot.params[0].as_slice()[0]))
            .collect();
        assert_eq!(got, vec![(1, 1.0), (2, 2.0), (3, 3.0)]);
        drop(rx);
        store.put(0, Arc::new(snap(4, 4.0)));
        k.epoch_done(&log(4, 0.5)).unwrap();
    }

    #[test]
    fn a_best_epoch_before_the_resume_is_not_kept() {
        let store = Arc::new(ReplicaStore::new());
        let kept = Arc::default();
        let mut k = ModelKeeper::new(store.clone(), &[log(1, 0.9)], Arc::clone(&kept));
        store.put(0, Arc::new(snap(2, 2.0)));
        k.epoch_done(&log(2, 0.5)).unwrap();
        let m = kept.lock().unwrap().clone();
        assert!(m.best.is_none());
        assert_eq!(m.last.unwrap().epoch, 2);
    }

    #[test]
    fn a_missing_or_different_snapshot_is_an_error() {
        let store = Arc::new(ReplicaStore::new());
        let mut k = ModelKeeper::new(store.clone(), &[], Arc::default());
        assert!(k.epoch_done(&log(1, 0.5)).is_err());
        let mut other = snap(1, 1.0);
        other.digest = "else".into();
        store.put(0, Arc::new(other));
        let e = k.epoch_done(&log(1, 0.5)).unwrap_err().to_string();
        assert!(e.contains("epoch 1"), "{e}");
    }
}
