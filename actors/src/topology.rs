//! The Rust API for programs that spawn training topologies: build a [`Topology`] of P
//! partitions from a data set (or a partition folder) and a training config, [`spawn`] it, read
//! per-epoch [`RunEvent`]s while it trains, then [`TrainingRun::wait`] for the report. Every
//! actor and thread of the run is stopped and joined before `wait` returns.
//!
//! [`spawn`]: Topology::spawn
use crate::coordinator::{Coordinator, Recovery};
use crate::replica::ReplicaStore;
use crate::state::{GlobalCounts, PartitionState};
use crate::supervisor::NodeSupervisor;
use crate::telemetry;
use crate::ActorError;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tracing::Instrument;
use trellis_gpu::{Device, Stream, ThreadBudget};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::partition::{partition, PartitionMethod, PartitionSet};
use trellis_runtime::report::BestTracker;
use trellis_runtime::train::{build_report, TrainConfig};
use trellis_runtime::{Dataset, EpochLog, RunReport};
use trellis_transport::{InProcessTransport, Phase};

/// A planned panic: (partition, epoch, layer, phase, fired).
type PlannedPanic = (u32, u32, u16, Phase, bool);

/// Faults to inject (tests and `--chaos`): each fires once.
#[derive(Debug, Default)]
pub struct FaultPlan {
    panics: Mutex<Vec<PlannedPanic>>,
    /// Stalls: (partition, epoch, how long), fired once in that epoch's first step.
    stalls: Mutex<Vec<(u32, u32, Duration, bool)>>,
    restores: Mutex<Vec<(u32, bool)>>,
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Panic partition `part` in the `phase` pass of `layer` in `epoch`.
    pub fn panic_at(self, part: u32, epoch: u32, layer: u16, phase: Phase) -> Self {
        self.panics
            .lock()
            .expect("fault plan lock")
            .push((part, epoch, layer, phase, false));
        self
    }

    /// Parses a `--chaos` spec: faults separated by `,`, each `panic:part=P:epoch=E` with
    /// optional `:layer=L` (default 0) and `:phase=forward|backward|eval` (default forward).
    /// Fault kinds that need several nodes (`kill-node`, `cut-link`, `delay`, `corrupt`) are
    /// refused with an error saying so.
    pub fn parse(spec: &str) -> Result<Self, ActorError> {
        let bad = |m: String| {
            ActorError::Runtime(trellis_runtime::RuntimeError::Config(format!(
                "--chaos: {m}"
            )))
        };
        let mut plan = FaultPlan::none();
        for fault in spec.split(',').filter(|f| !f.is_empty()) {
            let mut fields = fault.split(':');
            let kind = fields.next().unwrap_or_default();
            if kind != "panic" {
                return Err(bad(format!("fault kind `{kind}` is not supported in a single-process run (supported: panic)")));
            }
            let (mut part, mut epoch, mut layer, mut phase) = (None, None, 0u16, Phase::Forward);
            for kv in fields {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| bad(format!("`{kv}` is not key=value")))?;
                let num = |v: &str| {
                    v.parse::<u32>()
                        .map_err(|_| bad(format!("`{v}` is not a number for {k}")))
                };
                match k {
                    "part" => part = Some(num(v)?),
                    "epoch" => epoch = Some(num(v)?),
                    "layer" => layer = num(v)? as u16,
                    "phase" => {
                        phase = match v {
                            "forward" => Phase::Forward,
                            "backward" => Phase::Backward,
                            "eval" => Phase::Eval,
                            _ => return Err(bad(format!("unknown phase `{v}`"))),
                        }
                    }
                    _ => return Err(bad(format!("unknown key `{k}` in `{fault}`"))),
                }
            }
            let part = part.ok_or_else(|| bad(format!("`{fault}` needs part=P")))?;
            let epoch = epoch.ok_or_else(|| bad(format!("`{fault}` needs epoch=E")))?;
            plan = plan.panic_at(part, epoch, layer, phase);
        }
        Ok(plan)
    }

    /// Make partition `part` stop answering for `for_` in its first step of `epoch` (a hung
    /// kernel); the coordinator's deadline must turn it into an error.
    pub fn stall_at(self, part: u32, epoch: u32, for_: Duration) -> Self {
        self.stalls
            .lock()
            .expect("fault plan lock")
            .push((part, epoch, for_, false));
        self
    }

    /// Panics (or stalls) if a planned fault matches and has not fired yet.
    pub(crate) fn maybe_panic(&self, part: u32, epoch: u32, layer: u16, phase: Phase) {
        let mut stall = None;
        if let Ok(mut v) = self.stalls.lock() {
            for f in v.iter_mut() {
                if !f.3 && (f.0, f.1) == (part, epoch) {
                    f.3 = true;
                    stall = Some(f.2);
                }
            }
        }
        if let Some(d) = stall {
            std::thread::sleep(d);
        }
        let mut fire = false;
        if let Ok(mut v) = self.panics.lock() {
            for f in v.iter_mut() {
                if !f.4 && (f.0, f.1, f.2, f.3) == (part, epoch, layer, phase) {
                    f.4 = true;
                    fire = true;
                }
            }
        }
        if fire {
            panic!("injected fault: partition {part}, epoch {epoch}, {phase:?} layer {layer}");
        }
    }

    pub(crate) fn record_restore(&self, part: u32, digest_ok: bool) {
        if let Ok(mut v) = self.restores.lock() {
            v.push((part, digest_ok));
        }
    }

    /// (partition, restored digest matched) of every restore so far.
    pub fn restores(&self) -> Vec<(u32, bool)> {
        self.restores.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chaos_specs_parse_or_fail_clearly() {
        let plan =
            FaultPlan::parse("panic:part=1:epoch=3,panic:part=0:epoch=5:layer=1:phase=backward")
                .unwrap();
        let p = plan.panics.lock().unwrap().clone();
        assert_eq!(
            p,
            vec![
                (1, 3, 0, Phase::Forward, false),
                (0, 5, 1, Phase::Backward, false)
            ]
        );
        for (spec, needle) in [
            ("kill-node:node=1:epoch=2", "kill-node"),
            ("panic:part=1", "epoch"),
            ("panic:part=x:epoch=1", "`x`"),
            ("panic:part=1:epoch=1:phase=up", "phase"),
        ] {
            let e = FaultPlan::parse(spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }
}

/// What a running topology reports while it trains.
#[derive(Debug, Clone)]
pub enum RunEvent {
    /// An epoch finished.
    Epoch(EpochLog),
    /// A failed partition was restarted and the interrupted step replayed.
    Recovered(Recovery),
}

/// P partitions of one data set plus the training configuration.
pub struct Topology {
    set: PartitionSet,
    cfg: TrainConfig,
    faults: Arc<FaultPlan>,
    deadline: Duration,
    dataset: String,
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
            _tmp: None,
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
        // Reuse a folder that already holds this exact partitioning of this data set.
        let reusable = PartitionSet::open(&dir).is_ok_and(|set| {
            let b = set.book();
            b.parts == parts
                && b.method == method
                && b.seed == cfg.model.seed
                && b.data_digest == ds.digest()
        });
        if !reusable {
            partition(ds, parts, method, cfg.model.seed, &dir)?;
        }
        let mut t = Self::open(&dir, cfg)?;
        t._tmp = tmp;
        Ok(t)
    }

    /// Injects faults (tests, `--chaos`).
    pub fn with_faults(mut self, faults: FaultPlan) -> Self {
        self.faults = Arc::new(faults);
        self
    }

    /// How long the coordinator waits for any one reply before failing the run.
    pub fn with_deadline(mut self, d: Duration) -> Self {
        self.deadline = d;
        self
    }

    /// Number of partitions.
    pub fn parts(&self) -> usize {
        self.set.parts()
    }

    /// Loads every partition, starts the actor system on its own thread and begins training.
    pub fn spawn(self) -> Result<TrainingRun, ActorError> {
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
            let stream = Stream::new(Device::Cpu, budget.clone())?;
            states.push(PartitionState::new(&file, &self.cfg, counts, stream)?);
        }
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let cancel2 = cancel.clone();
        let cfg = self.cfg.clone();
        let faults = self.faults.clone();
        let deadline = self.deadline;
        let threads = budget.threads();
        let dataset = self.dataset.clone();
        let tmp = self._tmp;
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
                        let mut coord =
                            Coordinator::new(run, node.addrs().to_vec(), &cfg, deadline, cancel2);
                        let totals = (counts.train, counts.val, counts.test);
                        let mut logs = Vec::new();
                        let mut best = BestTracker::default();
                        let mut digest = String::new();
                        let mut outcome = Ok(());
                        for epoch in 1..=cfg.epochs {
                            let seen = coord.recoveries.len();
                            match coord.epoch(epoch, totals).await {
                                Ok((log, d)) => {
                                    for r in &coord.recoveries[seen..] {
                                        let _ = tx.send(RunEvent::Recovered(r.clone()));
                                    }
                                    best.update(&log);
                                    let _ = tx.send(RunEvent::Epoch(log.clone()));
                                    logs.push(log);
                                    digest = d;
                                }
                                Err(e) => {
                                    outcome = Err(e);
                                    break;
                                }
                            }
                        }
                        node.shutdown();
                        outcome.map(|_| {
                            let mut report = build_report(
                                &cfg,
                                &dataset,
                                &book.data_digest,
                                book.parts,
                                book.edge_cut as u64,
                                threads,
                                &best,
                                logs,
                                digest,
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
        })
    }
}

/// A running topology.
pub struct TrainingRun {
    events: mpsc::Receiver<RunEvent>,
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<RunReport, ActorError>>>,
}

impl TrainingRun {
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
}

impl Drop for TrainingRun {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.cancel.store(true, Ordering::SeqCst);
            let _ = t.join();
        }
    }
}
