//! The coordinator: an async pump around the [`EpochMachine`] (ARCHITECTURE.md, "Epoch
//! protocol" and "Recovery"). It sends the machine's requests through [`PartHandle`]s, feeds
//! their replies and the deadlines back with the current time, runs re-placements through a
//! [`NodeRecovery`], writes checkpoints, and turns the machine's actions into spans, metrics
//! and [`RunEvent`]s. Every protocol decision (what to send, when a round is complete, whether
//! and how to recover) is the machine's.
use crate::protocol::epoch::{
    Committed, EpochAction, EpochConfig, EpochMachine, Outgoing, Placement, Request, RequestId,
    Response, SplitTotals,
};
use crate::protocol::messages::{ApplyStep, ResetEpoch, Step};
use crate::shells::handle::PartHandle;
use crate::telemetry::{self, node_attr as node};
use crate::topology::RunEvent;
use crate::ActorError;
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use trellis_runtime::metrics::{names, Key, Metrics};
use trellis_runtime::train::TrainConfig;
use trellis_runtime::EpochLog;

pub use crate::protocol::epoch::{EpochsDone, Recovery, RestartPolicy};

/// What re-placing a lost node's partitions produced.
pub struct Replaced {
    /// New handles of the re-placed partitions.
    pub handles: Vec<PartHandle>,
    /// (partition, node it now runs on).
    pub moves: Vec<(u32, u32)>,
    /// Whether every adopted state matched the committed digest.
    pub digest_ok: bool,
}

/// Re-places the partitions of a lost node (cluster runs).
pub trait NodeRecovery {
    /// Node `node` is lost; the last committed step is `epoch` with weights `digest` (empty
    /// before the first step). Re-places its partitions on nodes holding their replicas.
    fn node_lost(
        &self,
        node: u32,
        epoch: u32,
        digest: String,
    ) -> Pin<Box<dyn Future<Output = Result<Replaced, ActorError>>>>;

    /// Partition `part` keeps failing where it runs: move it to a node holding its replica
    /// (the escalation of the restart policy).
    fn move_partition(
        &self,
        part: u32,
        epoch: u32,
        digest: String,
    ) -> Pin<Box<dyn Future<Output = Result<Replaced, ActorError>>>>;
}

/// Called with each epoch's log once the epoch is done (evaluated); an error fails the run.
pub type EpochDoneFn = Box<dyn FnMut(&EpochLog) -> Result<(), ActorError>>;

/// Writes a durable checkpoint: (epoch, committed digest, every epoch's log so far).
pub type CheckpointFn = Box<dyn Fn(u32, &str, &[EpochLog]) -> Result<(), ActorError>>;

type Answer = Pin<Box<dyn Future<Output = (RequestId, u32, Result<Response, ActorError>)>>>;
type Placing = Pin<Box<dyn Future<Output = Result<Replaced, ActorError>>>>;

/// Drives epochs over a set of partitions.
pub struct Coordinator {
    run: trellis_transport::RunId,
    parts: Vec<PartHandle>,
    cfg: EpochConfig,
    cancel: Arc<AtomicBool>,
    pub recoveries: Vec<Recovery>,
    /// Called with each epoch before its first step (e.g. to advance a transport's stale-epoch
    /// filter).
    on_epoch: Option<Box<dyn Fn(u32)>>,
    node_recovery: Option<Rc<dyn NodeRecovery>>,
    /// The last committed step (a resumed run starts after it).
    committed: Committed,
    /// Epochs already done before this run resumed from a checkpoint, with their logs.
    prior: Vec<EpochLog>,
    checkpoint: Option<CheckpointFn>,
    on_epoch_done: Option<EpochDoneFn>,
    /// Paces the run: each epoch starts once a token arrives; the run ends when it closes.
    gate: Option<mpsc::Receiver<()>>,
    /// Digest of the initial weights (what a restore before the first step must match).
    initial_digest: Option<String>,
}

impl Coordinator {
    /// `parts[q]` must be partition `q`.
    pub fn new(
        run: trellis_transport::RunId,
        parts: Vec<PartHandle>,
        cfg: &TrainConfig,
        deadline: Duration,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        debug_assert!(parts.iter().enumerate().all(|(q, h)| h.part() == q as u32));
        let initial_digest = initial_digest(cfg);
        Coordinator {
            run,
            cfg: EpochConfig {
                parts: parts.len() as u32,
                layers: cfg.model.layers as u16,
                epochs: cfg.epochs,
                deadline,
                max_recoveries: 3,
                policy: RestartPolicy::default(),
                retry_timeouts: false,
                node_recovery: false,
                checkpoint_every: None,
                gated: false,
                totals: SplitTotals::default(),
                replays_eval: cfg.halo.skips_eval_rows(),
            },
            parts,
            cancel,
            recoveries: Vec::new(),
            on_epoch: None,
            node_recovery: None,
            committed: Committed::default(),
            prior: Vec::new(),
            checkpoint: None,
            on_epoch_done: None,
            gate: None,
            initial_digest,
        }
    }

    /// Starts each epoch only once a token arrives on `gate`; the run ends (successfully,
    /// with the epochs done so far) when the gate closes.
    pub fn with_epoch_gate(mut self, gate: mpsc::Receiver<()>) -> Self {
        self.gate = Some(gate);
        self.cfg.gated = true;
        self
    }

    /// Continues a run restored from a checkpoint taken after `epoch` (weights `digest`),
    /// whose earlier epochs logged `logs`.
    pub fn resumed(mut self, epoch: u32, digest: String, logs: Vec<EpochLog>) -> Self {
        self.committed = Committed { epoch, digest };
        self.prior = logs;
        self
    }

    /// Calls `write` after every `every` committed epochs (and after the last one).
    pub fn with_checkpoints(mut self, every: u32, write: CheckpointFn) -> Self {
        if every > 0 {
            self.cfg.checkpoint_every = Some(every);
            self.checkpoint = Some(write);
        }
        self
    }

    /// Calls `f(epoch)` before each epoch's first step.
    pub fn with_epoch_hook(mut self, f: impl Fn(u32) + 'static) -> Self {
        self.on_epoch = Some(Box::new(f));
        self
    }

    /// Calls `f(log)` after each epoch is done (e.g. to keep the parameters of the best one).
    pub fn with_epoch_done(mut self, f: EpochDoneFn) -> Self {
        self.on_epoch_done = Some(f);
        self
    }

    /// Recovers from node losses through `r` instead of failing the run.
    pub fn with_node_recovery(mut self, r: Rc<dyn NodeRecovery>) -> Self {
        self.node_recovery = Some(r);
        self.cfg.node_recovery = true;
        self
    }

    /// A step that misses its deadline (a message lost on a faulty link, a corrupted frame)
    /// is replayed like a failed one instead of failing the run, within the restart budget.
    pub fn with_timeout_retry(mut self) -> Self {
        self.cfg.retry_timeouts = true;
        self
    }

    /// Sets the per-partition restart policy.
    pub fn with_restart_policy(mut self, policy: RestartPolicy) -> Self {
        self.cfg.policy = policy;
        self
    }

    /// Sets how many recoveries (restarts and node losses) the run may perform.
    pub fn with_max_restarts(mut self, n: u32) -> Self {
        self.cfg.max_recoveries = n;
        self
    }

    /// Runs epochs up to `epochs`, sending each epoch's log and every recovery to `events`.
    pub async fn run_epochs(
        &mut self,
        epochs: u32,
        totals: (usize, usize, usize),
        events: &mpsc::Sender<RunEvent>,
    ) -> Result<EpochsDone, ActorError> {
        let cfg = EpochConfig {
            epochs,
            totals: SplitTotals {
                train: totals.0,
                val: totals.1,
                test: totals.2,
            },
            ..self.cfg.clone()
        };
        let mut m = EpochMachine::new(cfg, self.committed.clone(), std::mem::take(&mut self.prior));
        if let Some(d) = self.initial_digest.clone() {
            m = m.with_initial_digest(d);
        }
        let mut pump = Pump {
            inflight: FuturesUnordered::new(),
            placing: None,
            epoch_span: tracing::Span::none(),
            all_reduce: None,
            recovery_spans: Vec::new(),
        };
        m.start(Instant::now());
        loop {
            while let Some(action) = m.poll_action() {
                match action {
                    EpochAction::Finished(done) => {
                        self.committed = m.committed().clone();
                        return Ok(done);
                    }
                    EpochAction::Failed(e) => return Err(e),
                    other => self.execute(&mut m, &mut pump, other, events)?,
                }
            }
            let timeout = m.poll_timeout();
            let sleep = async {
                match timeout {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let placing = async {
                match pump.placing.as_mut() {
                    Some(f) => f.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Some((id, part, r)) = pump.inflight.next(), if !pump.inflight.is_empty() => {
                    if matches!(r, Err(ActorError::Panicked { .. })) {
                        if let Some(at) = crate::failure_clock::take(self.run, part) {
                            m.handle_failure_time(part, at);
                        }
                    }
                    m.handle_response(id, part, r, Instant::now());
                }
                r = placing => {
                    pump.placing = None;
                    let r = r.map(|replaced| {
                        for h in replaced.handles {
                            let p = h.part() as usize;
                            self.parts[p] = h;
                        }
                        Placement { moves: replaced.moves, digest_ok: replaced.digest_ok }
                    });
                    m.handle_placement(r, Instant::now());
                }
                () = sleep => m.handle_timeout(Instant::now()),
            }
        }
    }

    /// Executes one action of the machine.
    fn execute(
        &mut self,
        m: &mut EpochMachine,
        pump: &mut Pump,
        action: EpochAction,
        events: &mpsc::Sender<RunEvent>,
    ) -> Result<(), ActorError> {
        match action {
            EpochAction::WaitGate { .. } => {
                let open = self.gate.as_ref().is_some_and(|g| g.recv().is_ok());
                m.handle_gate(open, Instant::now());
            }
            EpochAction::EpochStarted { epoch } => {
                if let Some(f) = &self.on_epoch {
                    f(epoch);
                }
                pump.epoch_span =
                    tracing::info_span!("epoch", epoch = i64::from(epoch), node = node());
                pump.all_reduce = None;
            }
            EpochAction::Send(out) => {
                if self.cancel.load(Ordering::SeqCst) {
                    m.handle_cancel();
                    return Ok(());
                }
                let answer = self.send(pump, out);
                pump.inflight.push(answer);
            }
            EpochAction::CancelRunning => {
                for h in &self.parts {
                    h.cancel_local();
                }
            }
            EpochAction::ReplaceNode { node, committed } => {
                let Some(r) = self.node_recovery.clone() else {
                    m.handle_placement(
                        Err(ActorError::Cluster("no node recovery in this run".into())),
                        Instant::now(),
                    );
                    return Ok(());
                };
                tracing::warn!("node {node} lost; re-placing its partitions");
                pump.placing = Some(r.node_lost(node, committed.epoch, committed.digest));
            }
            EpochAction::MovePartition { part, committed } => {
                let Some(r) = self.node_recovery.clone() else {
                    m.handle_placement(
                        Err(ActorError::Cluster("no node recovery in this run".into())),
                        Instant::now(),
                    );
                    return Ok(());
                };
                tracing::warn!("partition {part} keeps failing where it runs; moving it");
                pump.placing = Some(r.move_partition(part, committed.epoch, committed.digest));
            }
            EpochAction::RecoveryStarted {
                kind,
                part,
                epoch,
                detected_ms,
            } => {
                let span = pump.epoch_span.in_scope(|| {
                    tracing::info_span!(
                        "recovery",
                        kind = kind,
                        partition = i64::from(part),
                        node = node(),
                        epoch = i64::from(epoch),
                        detected_ms = detected_ms,
                        resumed_ms = tracing::field::Empty,
                        steps_replayed = tracing::field::Empty,
                    )
                });
                pump.recovery_spans.push(span);
                Metrics::global().add(Key::new(names::RESTARTS).with("partition", part), 1);
            }
            EpochAction::Recovered(r) => {
                if !pump.recovery_spans.is_empty() {
                    let span = pump.recovery_spans.remove(0);
                    span.record("resumed_ms", r.resumed_ms);
                    span.record("steps_replayed", i64::from(r.steps_replayed));
                }
                Metrics::global()
                    .record_ms(Key::new(names::RECOVERY), r.detected_ms + r.resumed_ms);
                self.recoveries.push(r.clone());
                let _ = events.send(RunEvent::Recovered(r));
            }
            EpochAction::Profile(p) => {
                let _ = events.send(RunEvent::Profile(p));
            }
            EpochAction::Committed {
                step_ms, apply_ms, ..
            } => {
                Metrics::global().record_ms(Key::new(names::ALL_REDUCE), apply_ms);
                Metrics::global().record_ms(Key::new(names::STEP), step_ms);
                pump.all_reduce = None;
            }
            EpochAction::EpochDone(log) => {
                if let Some(f) = &mut self.on_epoch_done {
                    f(&log)?;
                }
                let _ = events.send(RunEvent::Epoch(log));
            }
            EpochAction::Checkpoint {
                epoch,
                digest,
                logs,
            } => {
                if let Some(write) = &self.checkpoint {
                    write(epoch, &digest, &logs)?;
                }
            }
            EpochAction::Finished(_) | EpochAction::Failed(_) => {}
        }
        Ok(())
    }

    /// Sends one request; the future resolves to its answer.
    fn send(&self, pump: &mut Pump, out: Outgoing) -> Answer {
        let Outgoing {
            id,
            part,
            epoch,
            request,
        } = out;
        let h = self.parts[part as usize].clone();
        let run = self.run;
        match request {
            Request::Step { layer, phase } => {
                let step = Step {
                    run,
                    epoch,
                    layer,
                    phase,
                    trace: telemetry::context_of(&pump.epoch_span),
                };
                Box::pin(async move { (id, part, h.step(step).await.map(Response::Step)) })
            }
            Request::Apply { grads } => {
                // The all-reduce span covers sending the summed gradients and every replica's
                // optimizer step (their `apply` spans are its children).
                let span = pump.all_reduce.get_or_insert_with(|| {
                    pump.epoch_span.in_scope(|| {
                        tracing::info_span!("all_reduce", epoch = i64::from(epoch), node = node())
                    })
                });
                let msg = ApplyStep {
                    run,
                    epoch,
                    grads,
                    trace: telemetry::context_of(span),
                };
                Box::pin(async move { (id, part, h.apply(msg).await.map(Response::Applied)) })
            }
            Request::Reset { rollback } => Box::pin(async move {
                let r = h.reset(ResetEpoch { epoch, rollback }).await;
                (id, part, r.map(|()| Response::ResetDone))
            }),
        }
    }
}

/// The shell's side of a run in progress.
struct Pump {
    inflight: FuturesUnordered<Answer>,
    placing: Option<Placing>,
    epoch_span: tracing::Span,
    all_reduce: Option<tracing::Span>,
    /// Open recovery spans, oldest first (closed when the machine reports them recovered).
    recovery_spans: Vec<tracing::Span>,
}

/// The weights digest every partition starts from: the configuration's initial model.
fn initial_digest(cfg: &TrainConfig) -> Option<String> {
    let model = trellis_runtime::Model::new(cfg.model.clone()).ok()?;
    let stream = trellis_gpu::Stream::cpu(cfg.threads).ok()?;
    model.weights_digest(&stream).ok()
}
