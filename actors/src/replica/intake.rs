//! Stores the replica pieces that reach a node on a thread of its own, in the order they
//! arrived, instead of on the task that reads the node's control messages.
//!
//! Storing a piece is not free: the last piece of a patch copies its base, applies the runs
//! and checks the BLAKE3 digest of the whole replica (tens of MB for held halo rows), and on
//! the control task every request of the epoch protocol and every reply to the coordinator
//! waited behind it. Here that work runs beside the steps, at `nice` 10: a step's compute
//! comes first on a shared CPU. (The replication thread that encodes and ships replicas,
//! `ReplicaStore::set_sender`, keeps its class: the sooner a replica leaves, the shorter the
//! time in which a node lost with it takes its step with it.)
//!
//! Readers of the kept replicas (adopting a lost node's partition, a checkpoint of a
//! cluster) first wait until every piece received before their call is stored
//! ([`Intake::settle`]), so they see what they saw when pieces were stored on arrival.
use super::{DeltaPiece, ReplicaPiece, ReplicaStore};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// A piece of a replica as it arrived from another node.
#[derive(Debug)]
pub enum ReceivedPiece {
    /// A slice of a whole replica ([`ReplicaStore::put_remote_piece`]).
    Whole(ReplicaPiece),
    /// A piece of a patch against an earlier step ([`ReplicaStore::put_remote_delta_piece`]).
    Patch(DeltaPiece),
}

/// What storing a piece gave: `Some((partition, step))` once a replica is whole and kept,
/// `None` while pieces are missing, an error naming the partition and sender when it cannot
/// be stored.
pub type Stored = Result<Option<(u32, u32)>, String>;

/// Called with what storing a piece gave (acknowledges or refuses the replica to its sender).
pub type OnStored = Box<dyn FnOnce(Stored) + Send>;

struct Job {
    from: u32,
    piece: ReceivedPiece,
    then: OnStored,
}

/// How many pieces were handed to the thread, and how many it stored.
#[derive(Default)]
struct Progress {
    received: AtomicU64,
    stored: Mutex<u64>,
    changed: Condvar,
}

/// The queue of a store's intake thread.
pub(super) struct Intake {
    queue: mpsc::Sender<Job>,
    progress: Arc<Progress>,
}

/// How long a reader waits for the pieces before it (a stuck thread must not hang a
/// recovery: the reader then goes on with what is stored, and says so).
const SETTLE_WITHIN: Duration = Duration::from_secs(30);

impl Intake {
    /// Starts the thread; it ends when the store (the queue's sender) is dropped.
    pub(super) fn start(store: Weak<ReplicaStore>) -> std::io::Result<Intake> {
        let (tx, rx) = mpsc::channel::<Job>();
        let progress = Arc::new(Progress::default());
        let done = progress.clone();
        std::thread::Builder::new()
            .name("trellis-replica-in".into())
            .spawn(move || {
                crate::priority::background_this_thread_as(crate::priority::Class::Nice(10));
                while let Ok(job) = rx.recv() {
                    let Some(store) = store.upgrade() else { break };
                    let stored = store.store_piece(job.from, job.piece);
                    drop(store);
                    (job.then)(stored);
                    let mut n = done.stored.lock().unwrap_or_else(|p| p.into_inner());
                    *n += 1;
                    done.changed.notify_all();
                }
            })?;
        Ok(Intake {
            queue: tx,
            progress,
        })
    }

    /// Queues a piece; gives it back if the thread is gone.
    pub(super) fn push(
        &self,
        from: u32,
        piece: ReceivedPiece,
        then: OnStored,
    ) -> Result<(), (ReceivedPiece, OnStored)> {
        // Counted before it is queued, so a reader that starts waiting after this call
        // returns waits for it too.
        self.progress.received.fetch_add(1, Ordering::SeqCst);
        self.queue.send(Job { from, piece, then }).map_err(|e| {
            self.progress.received.fetch_sub(1, Ordering::SeqCst);
            let job = e.0;
            (job.piece, job.then)
        })
    }

    /// Waits until every piece queued before this call is stored (at most
    /// [`SETTLE_WITHIN`], then says so in the log).
    pub(super) fn settle(&self) {
        let target = self.progress.received.load(Ordering::SeqCst);
        let stored = self
            .progress
            .stored
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (stored, wait) = self
            .progress
            .changed
            .wait_timeout_while(stored, SETTLE_WITHIN, |n| *n < target)
            .unwrap_or_else(|p| p.into_inner());
        if wait.timed_out() {
            tracing::error!(
                "replica pieces still waiting to be stored after {SETTLE_WITHIN:?} ({} of {target} stored)",
                *stored
            );
        }
    }
}
