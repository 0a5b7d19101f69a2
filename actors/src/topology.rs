//! The Rust API for programs that spawn training topologies: build a [`Topology`] of P
//! partitions from a data set (or a partition folder) and a training config, [`spawn`] it, read
//! per-epoch [`RunEvent`]s while it trains, then [`TrainingRun::wait`] for the report. Every
//! actor and thread of the run is stopped and joined before `wait` returns.
//!
//! [`spawn`]: Topology::spawn
use crate::checkpoint::{Checkpoint, CheckpointPolicy, CheckpointWriter};
pub use crate::faults::FaultPlan;
use crate::kept_model::{KeptModel, KeptModels, ModelKeeper};
use crate::profile::EpochProfile;
use crate::protocol::state::{GlobalCounts, PartitionState};
use crate::replica::ReplicaStore;
use crate::shells::coordinator::{Coordinator, Recovery};
use crate::shells::handle::PartHandle;
use crate::shells::supervisor::NodeSupervisor;
use crate::telemetry;
use crate::ActorError;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tracing::Instrument;
use trellis_gpu::{PriorityGate, Stream, ThreadBudget};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::partition::{open_or_partition, PartitionBook, PartitionMethod, PartitionSet};
use trellis_runtime::train::{build_report, TrainConfig};
use trellis_runtime::{Dataset, EpochLog, RunReport};
use trellis_transport::InProcessTransport;

/// What a running topology reports while it trains.
#[derive(Debug, Clone)]
pub enum RunEvent {
    /// An epoch finished.
    Epoch(EpochLog),
    /// A failed partition was restarted and the interrupted step replayed.
    Recovered(Recovery),
    /// Where an epoch's training step spent its time (sent just before its `Epoch` event).
    Profile(EpochProfile),
}

/// P partitions of one data set plus the training configuration.
pub struct Topology {
    set: PartitionSet,
    cfg: TrainConfig,
    faults: Arc<FaultPlan>,
    deadline: Duration,
    checkpoints: Option<CheckpointPolicy>,
    dataset: String,
    gate: Option<mpsc::Receiver<()>>,
    keep_models: bool,
    /// Where every epoch's committed model is sent (serving beside training).
    publish: Option<mpsc::Sender<KeptModel>>,
    /// The gate the partitions' streams yield to (serving beside training).
    yield_to: Option<PriorityGate>,
    _tmp: Option<TempDir>,
}

/// A partition folder removed on drop.
struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Topology {
    /// A topology over an existing partition folder (`trellis partition --out DIR`).
    pub fn open(dir: impl AsRef<Path>, cfg: TrainConfig) -> Result<Self, ActorError> {
        let set = PartitionSet::open(dir)?;
        let dataset = set.book().dataset.clone();
        Ok(Topology {
            set,
            cfg,
            faults: Arc::new(FaultPlan::none()),
            deadline: Duration::from_secs(300),
            dataset,
            gate: None,
            keep_models: false,
            publish: None,
            yield_to: None,
            _tmp: None,
            checkpoints: None,
        })
    }

    /// Partitions `ds` into `parts` with `method` into `dir` (a fresh temporary folder when
    /// `None`, removed with the topology) and builds a topology over it.
    pub fn partition(
        ds: &Dataset,
        parts: usize,
        method: PartitionMethod,
        dir: Option<&Path>,
        cfg: TrainConfig,
    ) -> Result<Self, ActorError> {
        let (dir, tmp) = match dir {
            Some(d) => (d.to_path_buf(), None),
            None => {
                let d =
                    std::env::temp_dir().join(format!("trellis-parts-{}", uuid::Uuid::new_v4()));
                (d.clone(), Some(TempDir(d)))
            }
        };
        open_or_partition(ds, parts, method, cfg.partition_seed, &dir)?;
        let mut t = Self::open(&dir, cfg)?;
        t._tmp = tmp;
        Ok(t)
    }

    /// Injects faults (tests, `--chaos`).
    pub fn with_faults(mut self, faults: FaultPlan) -> Self {
        self.faults = Arc::new(faults);
        self
    }

    /// Writes durable checkpoints (and resumes from one) as `policy` says.
    pub fn with_checkpoints(mut self, policy: CheckpointPolicy) -> Self {
        self.checkpoints = Some(policy);
        self
    }

    /// How long the coordinator waits for any one reply before failing the run.
    pub fn with_deadline(mut self, d: Duration) -> Self {
        self.deadline = d;
        self
    }

    /// Paces the run: each epoch starts only once a token arrives on `gate`, and the run ends
    /// early, cleanly, when the sending side is dropped. Benchmarks use it to alternate the
    /// run's epochs with other work in the same process.
    pub fn with_epoch_gate(mut self, gate: mpsc::Receiver<()>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Keeps the trained parameters of the best validation epoch and of the last epoch, for
    /// [`TrainingRun::wait_with_models`] (`trellis train --save-model` on partitions).
    pub fn keeping_models(mut self) -> Self {
        self.keep_models = true;
        self
    }

    /// Sends the committed model of every epoch to `to` as the epoch ends (no copy: the
    /// replica store's snapshot), for a service beside the run (`trellis train --partitions
    /// P --serve`). A receiver that hangs up does not stop the run.
    pub fn publishing_models(mut self, to: mpsc::Sender<KeptModel>) -> Self {
        self.publish = Some(to);
        self
    }

    /// Makes every partition's stream background work of `gate`: its long kernels pause
    /// between row pieces while urgent (inference) work holds the gate. The values computed
    /// are the same.
    pub fn yielding_to(mut self, gate: PriorityGate) -> Self {
        self.yield_to = Some(gate);
        self
    }

    /// The partition of every node (by global id), read from the partition files.
    pub fn owners(&self) -> Result<Vec<u32>, ActorError> {
        Ok(self.set.owners()?)
    }

    /// Number of partitions.
    pub fn parts(&self) -> usize {
        self.set.parts()
    }

    /// The partition book (sizes, halo counts, edge cut).
    pub fn book(&self) -> &PartitionBook {
        self.set.book()
    }

    /// Loads every partition, starts the actor system on its own thread and begins training.
    pub fn spawn(self) -> Result<TrainingRun, ActorError> {
        if self.faults.kills_nodes() {
            return Err(ActorError::Runtime(trellis_runtime::RuntimeError::Config(
                "--chaos: kill-node and link faults need a cluster of node processes \
                 (trellis launch, trellis node)"
                    .into(),
            )));
        }
        self.faults.check_reachable(
            self.cfg.epochs,
            self.set.parts() as u32,
            self.cfg.model.layers as u16,
            0,
        )?;
        let book = self.set.book().clone();
        let counts = GlobalCounts {
            train: book.train_nodes,
            val: book.val_nodes,
            test: book.test_nodes,
        };
        let budget = ThreadBudget::global(self.cfg.threads)?;
        let mut states = Vec::with_capacity(self.set.parts());
        for p in 0..self.set.parts() {
            let file = self.set.open_part(p)?;
            let mut stream = Stream::new(self.cfg.device, budget.clone())?;
            if let Some(gate) = &self.yield_to {
                stream = stream.yielding_to(gate.clone());
            }
            states.push(PartitionState::new(&file, &self.cfg, counts, stream)?);
        }
        let ck_lock = self.checkpoints.as_ref().map(|p| p.lock()).transpose()?;
        let resume = match &self.checkpoints {
            Some(pol) if pol.resume => Checkpoint::read(&pol.dir)?,
            _ => None,
        };
        if let (Some(ck), Some(pol)) = (&resume, &self.checkpoints) {
            ck.check_matches(&pol.dir, &self.cfg, &book.data_digest, book.parts)?;
            for (p, s) in states.iter_mut().enumerate() {
                if !s.restore(&ck.snapshot_for(p as u32))? {
                    return Err(ActorError::Checkpoint {
                        path: pol.dir.clone(),
                        detail: "the restored weights do not match its digest".into(),
                    });
                }
            }
        }
        let policy = self.checkpoints.clone();
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let cancel2 = cancel.clone();
        let cfg = self.cfg.clone();
        let faults = self.faults.clone();
        let deadline = self.deadline;
        let threads = budget.threads();
        let dataset = self.dataset.clone();
        let tmp = self._tmp;
        let gate = self.gate;
        let prior_logs = resume
            .as_ref()
            .map(|ck| ck.logs.clone())
            .unwrap_or_default();
        let kept: Option<Arc<Mutex<KeptModels>>> = self.keep_models.then(Arc::default);
        let kept_out = kept.clone();
        let publish = self.publish;
        let thread = std::thread::Builder::new()
            .name("trellis-coordinator".into())
            .spawn(move || {
                let _keep_partitions_until_done = tmp;
                let sys = actix::System::new();
                let run = uuid::Uuid::new_v4();
                let run_span = tracing::info_span!(
                    "run",
                    run = %run,
                    node = telemetry::node_attr(),
                    partitions = book.parts as i64,
                    model = %cfg.model.kind,
                    dataset = %dataset,
                );
                let trace_id = telemetry::context_of(&run_span).map(|t| t.trace_id_hex());
                let metrics_before = Metrics::global().snapshot();
                let result = sys.block_on(
                    async move {
                        let transport = Arc::new(InProcessTransport::new());
                        let replicas = Arc::new(ReplicaStore::new());
                        let node = NodeSupervisor::start(states, run, transport, replicas, faults);
                        let handles = local_handles(&node);
                        let mut coord = Coordinator::new(run, handles, &cfg, deadline, cancel2);
                        if let Some(g) = gate {
                            coord = coord.with_epoch_gate(g);
                        }
                        if kept.is_some() || publish.is_some() {
                            let into = kept.unwrap_or_default();
                            let mut keeper =
                                ModelKeeper::new(node.replicas().clone(), &prior_logs, into)
                                    .publishing_to(publish);
                            coord =
                                coord.with_epoch_done(Box::new(move |log| keeper.epoch_done(log)));
                        }
                        if let Some(ck) = resume {
                            let s = &ck.snapshot;
                            coord = coord.resumed(s.epoch, s.digest.clone(), ck.logs);
                        }
                        if let (Some(pol), Some(lock)) = (policy, ck_lock) {
                            let writer = CheckpointWriter::new(
                                &pol,
                                lock,
                                node.replicas().clone(),
                                cfg.clone(),
                                book.data_digest.clone(),
                                book.parts,
                            );
                            coord = coord.with_checkpoints(pol.every, writer.into_fn());
                        }
                        let totals = (counts.train, counts.val, counts.test);
                        let outcome = coord.run_epochs(cfg.epochs, totals, &tx).await;
                        node.shutdown();
                        outcome.map(|done| {
                            let mut report = build_report(
                                &cfg,
                                &dataset,
                                &book.data_digest,
                                book.parts,
                                book.edge_cut as u64,
                                threads,
                                &done.best,
                                done.logs,
                                done.digest,
                            );
                            report.recoveries =
                                serde_json::to_value(&coord.recoveries).unwrap_or_default();
                            let metrics = Metrics::global().snapshot().since(&metrics_before);
                            report.latency = metrics.summaries();
                            report.counters = metrics.counter_values();
                            report.trace_id = trace_id;
                            report
                        })
                    }
                    .instrument(run_span),
                );
                drop(sys);
                result
            })
            .map_err(|e| ActorError::System(e.to_string()))?;
        Ok(TrainingRun {
            events: rx,
            cancel,
            thread: Some(thread),
            kept: kept_out,
        })
    }
}

/// Handles of the actors of `node`, by partition id.
pub(crate) fn local_handles(node: &NodeSupervisor) -> Vec<PartHandle> {
    let mut v: Vec<PartHandle> = node
        .parts()
        .iter()
        .zip(node.addrs())
        .map(|(p, a)| PartHandle::Local {
            part: p.0,
            addr: a.clone(),
        })
        .collect();
    v.sort_by_key(|h| h.part());
    v
}

/// A running topology.
pub struct TrainingRun {
    events: mpsc::Receiver<RunEvent>,
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<RunReport, ActorError>>>,
    /// What [`Topology::keeping_models`] keeps, filled as epochs end.
    kept: Option<Arc<Mutex<KeptModels>>>,
}

impl TrainingRun {
    pub(crate) fn new(
        events: mpsc::Receiver<RunEvent>,
        cancel: Arc<AtomicBool>,
        thread: JoinHandle<Result<RunReport, ActorError>>,
    ) -> Self {
        TrainingRun {
            events,
            cancel,
            thread: Some(thread),
            kept: None,
        }
    }

    /// The run keeps its models into `kept` (see [`Topology::keeping_models`]).
    pub(crate) fn keeping(mut self, kept: Option<Arc<Mutex<KeptModels>>>) -> Self {
        self.kept = kept;
        self
    }

    /// Per-epoch events; the channel closes when the run ends.
    pub fn events(&self) -> &mpsc::Receiver<RunEvent> {
        &self.events
    }

    /// A handle that cancels the run (e.g. from a Ctrl-C handler).
    pub fn canceller(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// Asks the run to stop after the step in progress.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Waits for the end of the run; every actor and thread has stopped when this returns.
    pub fn wait(mut self) -> Result<RunReport, ActorError> {
        let t = self.thread.take().expect("joined once");
        t.join()
            .map_err(|_| ActorError::System("the coordinator thread panicked".into()))?
    }

    /// [`TrainingRun::wait`], and the models the run kept (empty unless the topology was
    /// [`Topology::keeping_models`]).
    pub fn wait_with_models(mut self) -> Result<(RunReport, KeptModels), ActorError> {
        let kept = self.kept.take();
        let report = self.wait()?;
        let models = kept
            .map(|k| k.lock().expect("poisoned").clone())
            .unwrap_or_default();
        Ok((report, models))
    }
}

impl Drop for TrainingRun {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.cancel.store(true, Ordering::SeqCst);
            let _ = t.join();
        }
    }
}
