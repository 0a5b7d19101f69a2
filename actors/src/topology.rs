//! The Rust API for programs that spawn training topologies: build a [`Topology`] of P
//! partitions from a data set (or a partition folder) and a training config, [`spawn`] it, read
//! per-epoch [`RunEvent`]s while it trains, then [`TrainingRun::wait`] for the report. Every
//! actor and thread of the run is stopped and joined before `wait` returns.
//!
//! [`spawn`]: Topology::spawn
use crate::checkpoint::{Checkpoint, CheckpointPolicy, CheckpointWriter};
use crate::coordinator::{Coordinator, Recovery};
use crate::handle::PartHandle;
use crate::profile::EpochProfile;
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
use trellis_gpu::{Stream, ThreadBudget};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::partition::{open_or_partition, PartitionBook, PartitionMethod, PartitionSet};
use trellis_runtime::train::{build_report, TrainConfig};
use trellis_runtime::{Dataset, EpochLog, RunReport};
use trellis_transport::{InProcessTransport, Phase};

/// A planned panic: (partition, epoch, layer, phase, in the second stage, fired).
type PlannedPanic = (u32, u32, u16, Phase, bool, bool);

/// Faults to inject (tests and `--chaos`): each fires once.
#[derive(Debug, Default)]
pub struct FaultPlan {
    panics: Mutex<Vec<PlannedPanic>>,
    /// Stalls: (partition, epoch, how long), fired once in that epoch's first step.
    stalls: Mutex<Vec<(u32, u32, Duration, bool)>>,
    restores: Mutex<Vec<(u32, bool)>>,
    /// Node kills: (node, epoch, fired): the node's process SIGKILLs itself when the
    /// coordinator starts that epoch.
    kills: Mutex<Vec<(u32, u32, bool)>>,
    /// Link faults between two nodes, each side fired once by its own node.
    links: Mutex<Vec<LinkFault>>,
}

/// What a link fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkAction {
    /// Drop every message both ways for this long.
    Cut(Duration),
    /// Hold every message for this long (both ways).
    Delay(Duration),
    /// Corrupt the next halo frame from `a` to `b`.
    Corrupt,
}

#[derive(Debug, Clone)]
struct LinkFault {
    action: LinkAction,
    a: u32,
    b: u32,
    epoch: u32,
    fired: [bool; 2],
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Panic partition `part` in the `phase` pass of `layer` in `epoch`.
    pub fn panic_at(self, part: u32, epoch: u32, layer: u16, phase: Phase) -> Self {
        self.plan_panic((part, epoch, layer, phase, false, false))
    }

    /// As [`FaultPlan::panic_at`], in the second stage of a split layer's step (after its
    /// first stage sent its blocks).
    pub fn panic_in_second_stage(self, part: u32, epoch: u32, layer: u16, phase: Phase) -> Self {
        self.plan_panic((part, epoch, layer, phase, true, false))
    }

    fn plan_panic(self, p: PlannedPanic) -> Self {
        self.panics.lock().expect("fault plan lock").push(p);
        self
    }

    /// Parses a `--chaos` spec: faults separated by `,`, each `panic:part=P:epoch=E` with
    /// optional `:layer=L` (default 0) and `:phase=forward|backward|eval` (default forward),
    /// or `kill-node:node=N:epoch=E` (cluster runs only). `cut-link`, `delay` and `corrupt`
    /// are refused with an error saying they are not built yet.
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
            if !["panic", "kill-node", "cut-link", "delay", "corrupt"].contains(&kind) {
                return Err(bad(format!(
                    "fault kind `{kind}` is not supported (supported: panic, kill-node, cut-link, delay, corrupt)"
                )));
            }
            let link = matches!(kind, "cut-link" | "delay" | "corrupt");
            let (mut part, mut epoch, mut layer, mut phase) = (None, None, 0u16, Phase::Forward);
            let (mut node, mut a, mut b, mut ms) = (None, None, None, None);
            for kv in fields {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| bad(format!("`{kv}` is not key=value")))?;
                let num = |v: &str| {
                    v.parse::<u32>()
                        .map_err(|_| bad(format!("`{v}` is not a number for {k}")))
                };
                match k {
                    "part" if kind == "panic" => part = Some(num(v)?),
                    "node" if kind == "kill-node" => node = Some(num(v)?),
                    "a" if link => a = Some(num(v)?),
                    "b" if link => b = Some(num(v)?),
                    "ms" if kind == "cut-link" || kind == "delay" => ms = Some(num(v)?),
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
            if link {
                let need = |v: Option<u32>, what: &str| {
                    v.ok_or_else(|| bad(format!("`{fault}` needs {what}")))
                };
                let (a, b) = (need(a, "a=N")?, need(b, "b=M")?);
                if a == b {
                    return Err(bad(format!("`{fault}`: a link joins two different nodes")));
                }
                let action = match kind {
                    "cut-link" => LinkAction::Cut(Duration::from_millis(need(ms, "ms=T")? as u64)),
                    "delay" => LinkAction::Delay(Duration::from_millis(need(ms, "ms=T")? as u64)),
                    _ => LinkAction::Corrupt,
                };
                let epoch = match kind {
                    "delay" => epoch.unwrap_or(1),
                    _ => need(epoch, "epoch=E")?,
                };
                plan.links.lock().expect("fault plan lock").push(LinkFault {
                    action,
                    a,
                    b,
                    epoch,
                    fired: [false; 2],
                });
                continue;
            }
            let epoch = epoch.ok_or_else(|| bad(format!("`{fault}` needs epoch=E")))?;
            if kind == "kill-node" {
                let node = node.ok_or_else(|| bad(format!("`{fault}` needs node=N")))?;
                plan = plan.kill_node_at(node, epoch);
                continue;
            }
            let part = part.ok_or_else(|| bad(format!("`{fault}` needs part=P")))?;
            plan = plan.panic_at(part, epoch, layer, phase);
        }
        Ok(plan)
    }

    /// SIGKILL node `node`'s process when the coordinator starts `epoch` (cluster runs).
    pub fn kill_node_at(self, node: u32, epoch: u32) -> Self {
        self.kills
            .lock()
            .expect("fault plan lock")
            .push((node, epoch, false));
        self
    }

    /// Whether the plan has faults that need a cluster (node kills, link faults).
    pub fn kills_nodes(&self) -> bool {
        self.kills.lock().map(|v| !v.is_empty()).unwrap_or(false)
            || self.links.lock().map(|v| !v.is_empty()).unwrap_or(false)
    }

    /// The link faults node `me` must apply now that `epoch` starts: (peer, action), each
    /// once. Cuts and delays act on both ends; a corruption on the sending end `a`.
    pub fn link_faults_due(&self, me: u32, epoch: u32) -> Vec<(u32, LinkAction)> {
        let Ok(mut v) = self.links.lock() else {
            return Vec::new();
        };
        let mut due = Vec::new();
        for f in v.iter_mut().filter(|f| f.epoch <= epoch) {
            if me == f.a && !f.fired[0] {
                f.fired[0] = true;
                due.push((f.b, f.action));
            }
            if me == f.b && !f.fired[1] && f.action != LinkAction::Corrupt {
                f.fired[1] = true;
                due.push((f.a, f.action));
            }
        }
        due
    }

    /// Whether node `node` must die now that `epoch` starts (fires once).
    pub fn kill_due(&self, node: u32, epoch: u32) -> bool {
        let Ok(mut v) = self.kills.lock() else {
            return false;
        };
        let mut due = false;
        for k in v.iter_mut() {
            if !k.2 && k.0 == node && k.1 <= epoch {
                k.2 = true;
                due = true;
            }
        }
        due
    }

    /// Marks `part`'s panics up to `epoch` as fired: the partition moved here after they fired
    /// on the node that hosted it (each node holds its own copy of the plan).
    pub fn retire_panics(&self, part: u32, epoch: u32) {
        if let Ok(mut v) = self.panics.lock() {
            for f in v.iter_mut().filter(|f| f.0 == part && f.1 <= epoch) {
                f.4 = true;
            }
        }
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

    /// Panics (or stalls) if a planned fault matches and has not fired yet; `second`: the
    /// second stage of a split layer's step.
    pub(crate) fn maybe_panic(
        &self,
        part: u32,
        epoch: u32,
        layer: u16,
        phase: Phase,
        second: bool,
    ) {
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
                if !f.5 && (f.0, f.1, f.2, f.3, f.4) == (part, epoch, layer, phase, second) {
                    f.5 = true;
                    fire = true;
                }
            }
        }
        if fire {
            let stage = if second { " (second stage)" } else { "" };
            panic!(
                "injected fault: partition {part}, epoch {epoch}, {phase:?} layer {layer}{stage}"
            );
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
                (1, 3, 0, Phase::Forward, false, false),
                (0, 5, 1, Phase::Backward, false, false)
            ]
        );
        let plan = FaultPlan::parse("kill-node:node=2:epoch=3").unwrap();
        assert!(plan.kills_nodes());
        assert!(!plan.kill_due(2, 2) && !plan.kill_due(1, 3));
        assert!(plan.kill_due(2, 3) && !plan.kill_due(2, 3), "fires once");
        let plan = FaultPlan::parse(
            "cut-link:a=1:b=2:epoch=2:ms=100,corrupt:a=2:b=0:epoch=3,delay:a=0:b=1:ms=5",
        )
        .unwrap();
        assert_eq!(
            plan.link_faults_due(1, 1),
            vec![(0, LinkAction::Delay(Duration::from_millis(5)))]
        );
        assert_eq!(
            plan.link_faults_due(1, 2),
            vec![(2, LinkAction::Cut(Duration::from_millis(100)))]
        );
        assert_eq!(
            plan.link_faults_due(2, 3).len(),
            2,
            "cut (b side) and corrupt (a side)"
        );
        assert!(
            plan.link_faults_due(0, 3).len() == 1,
            "only the delay: corruption is one-sided"
        );
        for (spec, needle) in [
            ("cut-link:a=1:b=2:epoch=2", "ms=T"),
            ("corrupt:a=1:b=1:epoch=2", "two different"),
            ("partition:part=1:epoch=2", "not supported"),
            ("kill-node:part=1:epoch=2", "part"),
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
            return Err(ActorError::Cluster(
                "kill-node faults need a cluster of node processes (trellis launch)".into(),
            ));
        }
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
            let stream = Stream::new(self.cfg.device, budget.clone())?;
            states.push(PartitionState::new(&file, &self.cfg, counts, stream)?);
        }
        let ck_lock = self.checkpoints.as_ref().map(|p| p.lock()).transpose()?;
        let resume = match &self.checkpoints {
            Some(pol) if pol.resume => Checkpoint::read(&pol.dir)?,
            _ => None,
        };
        if let (Some(ck), Some(pol)) = (&resume, &self.checkpoints) {
            ck.check_matches(&pol.dir, &self.cfg, &book.data_digest, book.parts)?;
            for s in &mut states {
                if !s.restore(&ck.snapshot)? {
                    return Err(ActorError::Cluster(format!(
                        "checkpoint in {}: the restored weights do not match its digest",
                        pol.dir.display()
                    )));
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
        }
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
}

impl Drop for TrainingRun {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.cancel.store(true, Ordering::SeqCst);
            let _ = t.join();
        }
    }
}
