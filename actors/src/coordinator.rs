//! The coordinator: drives the epoch protocol over the partitions (ARCHITECTURE.md, "Epoch
//! protocol"), sums weight gradients in a fixed order, checks that every replica holds the
//! same weights after each step, and recovers: after a partition panic (its supervisor
//! restarted it) or the loss of a node (its partitions are re-placed through a
//! [`NodeRecovery`]), it resets the epoch everywhere and replays the interrupted unit.
use crate::handle::PartHandle;
use crate::messages::{ApplyStep, Outcome, ResetEpoch, Step, StepReply};
use crate::profile::{EpochProfile, StepProfile};
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
use tracing::Instrument;
use trellis_runtime::metrics::{names, Key, Metrics};
use trellis_runtime::report::BestTracker;
use trellis_runtime::train::TrainConfig;
use trellis_runtime::EpochLog;
use trellis_transport::{Phase, RunId};

/// A recovery the coordinator performed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Recovery {
    /// `actor-panic` or `node-loss`.
    pub kind: String,
    pub partition: u32,
    /// The node lost (node-loss recoveries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// Partitions re-placed, with the node each now runs on (node-loss recoveries).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replaced: Vec<(u32, u32)>,
    /// Whether the state the partition resumed from had the digest recorded when it was
    /// replicated (`None` when not reported).
    #[serde(default)]
    pub digest_ok: Option<bool>,
    pub epoch: u32,
    /// From the failure to its report, ms: from the panic for a partition panic; from the
    /// start of the interrupted step for a lost node (killed as its step starts) or a missed
    /// deadline.
    pub detected_ms: f64,
    /// From the failure report until the replay could start (restart or re-placement,
    /// restore, epoch reset), ms.
    #[serde(default)]
    pub ready_ms: f64,
    /// From the failure report to the replayed unit completing, ms.
    pub resumed_ms: f64,
    pub steps_replayed: u32,
}

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

/// How many restarts a partition may have within a window of epochs before the failure
/// escalates to the coordinator (which moves the partition to another node, in a cluster).
#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    pub max_restarts: u32,
    pub window_epochs: u32,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            window_epochs: 10,
        }
    }
}

/// Drives epochs over a set of partitions.
pub struct Coordinator {
    run: RunId,
    parts: Vec<PartHandle>,
    num_layers: u16,
    deadline: Duration,
    max_restarts: u32,
    cancel: Arc<AtomicBool>,
    /// Restarts so far (the budget is for the whole run).
    restarts_used: u32,
    pub recoveries: Vec<Recovery>,
    /// Called with each epoch before its first step (e.g. to advance a transport's stale-epoch
    /// filter).
    on_epoch: Option<Box<dyn Fn(u32)>>,
    node_recovery: Option<Rc<dyn NodeRecovery>>,
    /// The last committed step and its weights digest.
    committed: (u32, String),
    /// Restore checks reported by restarted partitions, not yet attached to a recovery.
    restores: std::cell::RefCell<Vec<(u32, bool)>>,
    /// Treat a step that misses its deadline as a lost message: reset and replay.
    retry_timeouts: bool,
    policy: RestartPolicy,
    /// (partition, epoch) of every restart so far.
    restart_log: Vec<(u32, u32)>,
    /// Epochs already done before this run resumed from a checkpoint, with their logs.
    prior: Vec<EpochLog>,
    /// Every `.0` epochs, called with (epoch, committed digest, every log so far).
    checkpoint: Option<(u32, CheckpointFn)>,
    /// Where the last completed training step's time went.
    pub last_profile: Option<EpochProfile>,
    /// Paces the run: each epoch starts once a token arrives; the run ends when it closes.
    gate: Option<mpsc::Receiver<()>>,
}

/// Writes a durable checkpoint: (epoch, committed digest, every epoch's log so far).
pub type CheckpointFn = Box<dyn Fn(u32, &str, &[EpochLog]) -> Result<(), ActorError>>;

/// What a run of epochs produced.
pub struct EpochsDone {
    pub logs: Vec<EpochLog>,
    pub best: BestTracker,
    pub digest: String,
}

/// Forward and backward of one training step, summed over partitions.
struct GradStats {
    loss_sum: f64,
    count: usize,
    compute_ms: Vec<f64>,
    halo_bytes: u64,
    grads: Arc<[f32]>,
}

/// A failure being recovered from, until the interrupted unit completes.
struct OpenRecovery {
    kind: &'static str,
    part: u32,
    node: Option<u32>,
    moves: Vec<(u32, u32)>,
    digest_ok: Option<bool>,
    detected_ms: f64,
    at: Instant,
    ready_ms: f64,
    /// Open from the failure report to the replay's end.
    span: tracing::Span,
}

impl OpenRecovery {
    /// A recovery that restarts `part` where it runs (a panic, a missed deadline).
    fn of_restart(kind: &'static str, part: u32, detected_ms: f64) -> Self {
        OpenRecovery {
            kind,
            part,
            node: None,
            moves: Vec::new(),
            digest_ok: None,
            detected_ms,
            at: Instant::now(),
            ready_ms: 0.0,
            span: tracing::Span::none(),
        }
    }
}

impl Coordinator {
    /// `parts[q]` must be partition `q`.
    pub fn new(
        run: RunId,
        parts: Vec<PartHandle>,
        cfg: &TrainConfig,
        deadline: Duration,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        debug_assert!(parts.iter().enumerate().all(|(q, h)| h.part() == q as u32));
        Coordinator {
            run,
            parts,
            num_layers: cfg.model.layers as u16,
            deadline,
            max_restarts: 3,
            cancel,
            restarts_used: 0,
            recoveries: Vec::new(),
            on_epoch: None,
            node_recovery: None,
            committed: (0, String::new()),
            restores: Default::default(),
            prior: Vec::new(),
            checkpoint: None,
            retry_timeouts: false,
            policy: RestartPolicy::default(),
            restart_log: Vec::new(),
            last_profile: None,
            gate: None,
        }
    }

    /// Starts each epoch only once a token arrives on `gate`; the run ends (successfully,
    /// with the epochs done so far) when the gate closes.
    pub fn with_epoch_gate(mut self, gate: mpsc::Receiver<()>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Continues a run restored from a checkpoint taken after `epoch` (weights `digest`),
    /// whose earlier epochs logged `logs`.
    pub fn resumed(mut self, epoch: u32, digest: String, logs: Vec<EpochLog>) -> Self {
        self.committed = (epoch, digest);
        self.prior = logs;
        self
    }

    /// Calls `write` after every `every` committed epochs (and after the last one).
    pub fn with_checkpoints(mut self, every: u32, write: CheckpointFn) -> Self {
        if every > 0 {
            self.checkpoint = Some((every, write));
        }
        self
    }

    /// Calls `f(epoch)` before each epoch's first step.
    pub fn with_epoch_hook(mut self, f: impl Fn(u32) + 'static) -> Self {
        self.on_epoch = Some(Box::new(f));
        self
    }

    /// Recovers from node losses through `r` instead of failing the run.
    pub fn with_node_recovery(mut self, r: Rc<dyn NodeRecovery>) -> Self {
        self.node_recovery = Some(r);
        self
    }

    /// Runs epochs `1..=epochs`, sending each epoch's log and every recovery to `events`.
    pub async fn run_epochs(
        &mut self,
        epochs: u32,
        totals: (usize, usize, usize),
        events: &mpsc::Sender<RunEvent>,
    ) -> Result<EpochsDone, ActorError> {
        let mut done = EpochsDone {
            logs: std::mem::take(&mut self.prior),
            best: BestTracker::default(),
            digest: self.committed.1.clone(),
        };
        for log in &done.logs {
            done.best.update(log);
        }
        for epoch in self.committed.0 + 1..=epochs {
            if self.gate.as_ref().is_some_and(|g| g.recv().is_err()) {
                break;
            }
            let seen = self.recoveries.len();
            let (log, digest) = self.epoch(epoch, totals).await?;
            for r in &self.recoveries[seen..] {
                let _ = events.send(RunEvent::Recovered(r.clone()));
            }
            if let Some(p) = self.last_profile.take() {
                let _ = events.send(RunEvent::Profile(p));
            }
            done.best.update(&log);
            let _ = events.send(RunEvent::Epoch(log.clone()));
            done.logs.push(log);
            done.digest = digest;
            if let Some((every, write)) = &self.checkpoint {
                if epoch % every == 0 || epoch == epochs {
                    write(epoch, &done.digest, &done.logs)?;
                }
            }
        }
        Ok(done)
    }

    /// Runs epoch `epoch` (training step, then evaluation). `totals` are the global split sizes.
    pub async fn epoch(
        &mut self,
        epoch: u32,
        totals: (usize, usize, usize),
    ) -> Result<(EpochLog, String), ActorError> {
        let span = tracing::info_span!("epoch", epoch = i64::from(epoch), node = node());
        self.run_epoch(epoch, totals).instrument(span).await
    }

    async fn run_epoch(
        &mut self,
        epoch: u32,
        totals: (usize, usize, usize),
    ) -> Result<(EpochLog, String), ActorError> {
        if let Some(f) = &self.on_epoch {
            f(epoch);
        }
        let t0 = Instant::now();
        let stats = self
            .retrying(epoch, |c| Box::pin(c.forward_backward(epoch)))
            .await?;
        // Once the gradients are summed the step is decided: a failure while applying it
        // re-applies the same sum (idempotent where it was already applied).
        let grads = stats.grads.clone();
        let t_apply = Instant::now();
        // The all-reduce span covers sending the summed gradients and every replica's
        // optimizer step (their `apply` spans are its children).
        let all_reduce = tracing::info_span!("all_reduce", epoch = i64::from(epoch), node = node());
        let digest = self
            .retrying(epoch, move |c| Box::pin(c.apply(epoch, grads.clone())))
            .instrument(all_reduce)
            .await?;
        Metrics::global().record(Key::new(names::ALL_REDUCE), t_apply.elapsed());
        if let Some(p) = &mut self.last_profile {
            p.apply_ms = t_apply.elapsed().as_secs_f64() * 1e3;
        }
        self.committed = (epoch, digest.clone());
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Metrics::global().record_ms(Key::new(names::STEP), ms);
        let t1 = Instant::now();
        let (train, val, test) = self.retrying(epoch, |c| Box::pin(c.eval(epoch))).await?;
        let eval_ms = t1.elapsed().as_secs_f64() * 1e3;
        let compute_ms = stats.compute_ms.iter().cloned().fold(0.0, f64::max);
        let frac = |n: usize, d: usize| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        let log = EpochLog {
            epoch,
            loss: stats.loss_sum / stats.count.max(1) as f64,
            train_acc: frac(train, totals.0),
            val_acc: frac(val, totals.1),
            test_acc: frac(test, totals.2),
            ms,
            eval_ms,
            compute_ms,
            comm_ms: (ms - compute_ms).max(0.0),
            halo_bytes: stats.halo_bytes,
            weights_digest: digest.clone(),
            part_compute_ms: stats.compute_ms,
        };
        Ok((log, digest))
    }

    /// Runs `unit`; after a partition panic (its supervisor restarts it) or a node loss (its
    /// partitions are re-placed), resets the epoch on every partition and runs `unit` again,
    /// within the restart budget.
    async fn retrying<T>(
        &mut self,
        epoch: u32,
        mut unit: impl for<'a> FnMut(
            &'a mut Self,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, ActorError>> + 'a>,
        >,
    ) -> Result<T, ActorError> {
        let mut open: Vec<OpenRecovery> = Vec::new();
        // A failure met while recovering (during a reset or an adoption) is handled like one
        // met while running the unit.
        let mut carried: Option<(ActorError, f64)> = None;
        loop {
            let (err, detected_ms) = match carried.take() {
                Some(c) => c,
                None => {
                    let started = Instant::now();
                    match unit(self).await {
                        Ok(v) => {
                            let replayed = open.len() as u32;
                            let restores = std::mem::take(&mut *self.restores.borrow_mut());
                            for mut o in open.drain(..) {
                                let resumed_ms = o.at.elapsed().as_secs_f64() * 1e3;
                                o.span.record("resumed_ms", resumed_ms);
                                o.span.record("steps_replayed", i64::from(replayed));
                                Metrics::global().record_ms(
                                    Key::new(names::RECOVERY),
                                    o.detected_ms + resumed_ms,
                                );
                                if o.kind == "actor-panic" {
                                    o.digest_ok = restores
                                        .iter()
                                        .find(|r| r.0 == o.part)
                                        .map(|r| r.1)
                                        .or(o.digest_ok);
                                }
                                self.recoveries.push(Recovery {
                                    kind: o.kind.into(),
                                    partition: o.part,
                                    node: o.node,
                                    replaced: o.moves,
                                    digest_ok: o.digest_ok,
                                    epoch,
                                    detected_ms: o.detected_ms,
                                    ready_ms: o.ready_ms,
                                    resumed_ms,
                                    steps_replayed: replayed,
                                });
                            }
                            return Ok(v);
                        }
                        Err(e) => {
                            // A panic is timed from the moment it happened; anything else
                            // (a lost node, a missed deadline) from the start of the step.
                            let failed_at = match &e {
                                ActorError::Panicked { part, .. } => {
                                    crate::failure_clock::take(self.run, *part)
                                }
                                _ => None,
                            };
                            let from = failed_at.unwrap_or(started).max(started);
                            (e, from.elapsed().as_secs_f64() * 1e3)
                        }
                    }
                }
            };
            self.restarts_used += 1;
            // Whatever failed, the epoch in progress is rolled back: stop this process's
            // partitions from computing it while the failed part is replaced.
            for h in &self.parts {
                h.cancel_local();
            }
            let recovery = match err {
                ActorError::Panicked { part, message } => {
                    if self.restarts_used > self.max_restarts {
                        return Err(ActorError::RestartsExhausted {
                            part,
                            restarts: self.restarts_used - 1,
                            last: message,
                        });
                    }
                    self.restart_log.push((part, epoch));
                    let since = epoch.saturating_sub(self.policy.window_epochs);
                    let recent = self
                        .restart_log
                        .iter()
                        .filter(|(p, e)| *p == part && *e > since)
                        .count() as u32;
                    if recent > self.policy.max_restarts {
                        let Some(r) = self.node_recovery.clone() else {
                            return Err(ActorError::RestartsExhausted {
                                part,
                                restarts: recent - 1,
                                last: message,
                            });
                        };
                        // Escalate: the partition keeps failing where it is; move it.
                        tracing::warn!(
                            "partition {part} failed {recent} times within {} epochs; moving it",
                            self.policy.window_epochs
                        );
                        let at = Instant::now();
                        let (e, d) = self.committed.clone();
                        let replaced = r.move_partition(part, e, d).await?;
                        self.restart_log.retain(|(p, _)| *p != part);
                        self.placed("escalated-move", part, None, replaced, detected_ms, at)
                    } else {
                        OpenRecovery::of_restart("actor-panic", part, detected_ms)
                    }
                }
                ActorError::Node { node, detail } if self.node_recovery.is_some() => {
                    let lost = ActorError::Node { node, detail };
                    if self.restarts_used > self.max_restarts {
                        return Err(lost);
                    }
                    tracing::warn!("{lost}; re-placing its partitions");
                    let at = Instant::now();
                    let r = self.node_recovery.clone().expect("checked");
                    let (e, d) = self.committed.clone();
                    let replaced = match r.node_lost(node, e, d).await {
                        Ok(r) => r,
                        Err(e @ ActorError::Node { .. }) => {
                            // The node chosen to adopt was lost too: recover from that.
                            carried = Some((e, at.elapsed().as_secs_f64() * 1e3));
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    let part = replaced.moves.first().map_or(u32::MAX, |m| m.0);
                    self.placed("node-loss", part, Some(node), replaced, detected_ms, at)
                }
                ActorError::Timeout { part, ms, what } if self.retry_timeouts => {
                    if self.restarts_used > self.max_restarts {
                        return Err(ActorError::Timeout { part, ms, what });
                    }
                    tracing::warn!(
                        "partition {part} missed its {ms} ms deadline ({what}); replaying"
                    );
                    OpenRecovery::of_restart("timeout", part, detected_ms)
                }
                other => return Err(other),
            };
            let mut recovery = recovery;
            recovery.span = tracing::info_span!(
                "recovery",
                kind = recovery.kind,
                partition = i64::from(recovery.part),
                node = node(),
                epoch = i64::from(epoch),
                detected_ms = recovery.detected_ms,
                resumed_ms = tracing::field::Empty,
                steps_replayed = tracing::field::Empty,
            );
            Metrics::global().add(
                Key::new(names::RESTARTS).with("partition", recovery.part),
                1,
            );
            let at = Instant::now();
            match self.reset_all(epoch).await {
                Ok(()) => {
                    let ready_ms = recovery.at.elapsed().as_secs_f64() * 1e3;
                    open.push(OpenRecovery {
                        ready_ms,
                        ..recovery
                    });
                }
                Err(e) => {
                    open.push(recovery);
                    carried = Some((e, at.elapsed().as_secs_f64() * 1e3));
                }
            }
        }
    }

    /// Points the re-placed partitions' handles at their new places and opens the record of
    /// that recovery.
    fn placed(
        &mut self,
        kind: &'static str,
        part: u32,
        node: Option<u32>,
        replaced: Replaced,
        detected_ms: f64,
        at: Instant,
    ) -> OpenRecovery {
        for h in replaced.handles {
            let p = h.part() as usize;
            self.parts[p] = h;
        }
        OpenRecovery {
            kind,
            part,
            node,
            moves: replaced.moves,
            digest_ok: Some(replaced.digest_ok),
            detected_ms,
            at,
            ready_ms: 0.0,
            span: tracing::Span::none(),
        }
    }

    /// Makes every partition drop the epoch in progress (and any step parked in it).
    async fn reset_all(&self, epoch: u32) -> Result<(), ActorError> {
        let what = format!("reset of epoch {epoch}");
        let mut waiting: FuturesUnordered<_> = self
            .parts
            .iter()
            .map(|h| self.await_reply(h.part(), &what, h.reset(ResetEpoch { epoch })))
            .collect();
        while let Some(r) = waiting.next().await {
            r?;
        }
        Ok(())
    }

    /// A step that misses its deadline (a message lost on a faulty link, a corrupted frame)
    /// is replayed like a failed one instead of failing the run, within the restart budget.
    pub fn with_timeout_retry(mut self) -> Self {
        self.retry_timeouts = true;
        self
    }

    /// Sets the per-partition restart policy.
    pub fn with_restart_policy(mut self, policy: RestartPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets how many recoveries (restarts and node losses) the run may perform.
    pub fn with_max_restarts(mut self, n: u32) -> Self {
        self.max_restarts = n;
        self
    }

    /// Sends one step to every partition and records its profile.
    async fn profiled(
        &self,
        profile: &mut EpochProfile,
        epoch: u32,
        layer: u16,
        phase: Phase,
    ) -> Result<Vec<StepReply>, ActorError> {
        let t = Instant::now();
        let replies = self.broadcast(epoch, layer, phase).await?;
        profile.steps.push(StepProfile::new(
            phase,
            layer,
            t.elapsed().as_secs_f64() * 1e3,
            &replies,
        ));
        Ok(replies)
    }

    async fn forward_backward(&mut self, epoch: u32) -> Result<GradStats, ActorError> {
        let p = self.parts.len();
        let mut compute_ms = vec![0.0; p];
        let mut halo_bytes = 0;
        let (mut loss_sum, mut count) = (0.0, 0);
        let mut profile = EpochProfile::new(epoch);
        for l in 0..self.num_layers {
            for r in self
                .profiled(&mut profile, epoch, l, Phase::Forward)
                .await?
            {
                compute_ms[r.part as usize] += r.compute_ms;
                halo_bytes += r.halo_bytes;
                if let Outcome::Loss {
                    loss_sum: s,
                    count: c,
                    ..
                } = r.outcome
                {
                    loss_sum += s;
                    count += c;
                }
            }
        }
        let mut grads: Vec<Option<Arc<[f32]>>> = vec![None; p];
        for l in (0..self.num_layers).rev() {
            for r in self
                .profiled(&mut profile, epoch, l, Phase::Backward)
                .await?
            {
                compute_ms[r.part as usize] += r.compute_ms;
                halo_bytes += r.halo_bytes;
                if let Outcome::Grads(g) = r.outcome {
                    grads[r.part as usize] = Some(g);
                }
            }
        }
        // All-reduce in a fixed order: partition 0, 1, ..., so the sum never depends on timing.
        let mut sum: Vec<f32> = Vec::new();
        for (q, g) in grads.iter().enumerate() {
            let g = g.as_ref().ok_or_else(|| ActorError::Protocol {
                part: q as u32,
                detail: "no gradients".into(),
            })?;
            if sum.is_empty() {
                sum = g.to_vec();
            } else {
                sum.iter_mut().zip(g.iter()).for_each(|(s, v)| *s += v);
            }
        }
        self.last_profile = Some(profile);
        Ok(GradStats {
            loss_sum,
            count,
            compute_ms,
            halo_bytes,
            grads: Arc::from(sum),
        })
    }

    /// The identical optimizer step on every partition; checks that all digests agree.
    async fn apply(&mut self, epoch: u32, grads: Arc<[f32]>) -> Result<String, ActorError> {
        let futs: Vec<_> = self
            .parts
            .iter()
            .map(|h| {
                h.apply(ApplyStep {
                    run: self.run,
                    epoch,
                    grads: grads.clone(),
                    trace: telemetry::current(),
                })
            })
            .collect();
        let mut digest = String::new();
        for (q, f) in futs.into_iter().enumerate() {
            let d = self.await_reply(q as u32, "optimizer step", f).await?;
            if q == 0 {
                digest = d;
            } else if d != digest {
                return Err(ActorError::Diverged {
                    epoch,
                    part: q as u32,
                    got: d,
                    want: digest,
                });
            }
        }
        Ok(digest)
    }

    async fn eval(&mut self, epoch: u32) -> Result<(usize, usize, usize), ActorError> {
        let mut acc = (0, 0, 0);
        for l in 0..self.num_layers {
            for r in self.broadcast(epoch, l, Phase::Eval).await? {
                if let Outcome::Eval { train, val, test } = r.outcome {
                    acc = (acc.0 + train, acc.1 + val, acc.2 + test);
                }
            }
        }
        Ok(acc)
    }

    /// Sends one step to every partition and waits for all replies, returned in partition
    /// order. A panic or a lost node is reported at once: other partitions may be parked
    /// waiting for blocks the failed one never sent, and the epoch reset answers them. Any
    /// other failure is reported once every partition has answered (or its deadline passed).
    async fn broadcast(
        &self,
        epoch: u32,
        layer: u16,
        phase: Phase,
    ) -> Result<Vec<StepReply>, ActorError> {
        if self.cancel.load(Ordering::SeqCst) {
            return Err(ActorError::Cancelled);
        }
        let step = Step {
            run: self.run,
            epoch,
            layer,
            phase,
            trace: telemetry::current(),
        };
        let what = format!("{phase:?} layer {layer} of epoch {epoch}");
        let mut waiting: FuturesUnordered<_> = self
            .parts
            .iter()
            .map(|h| self.await_reply(h.part(), &what, h.step(step)))
            .collect();
        let mut replies = Vec::with_capacity(self.parts.len());
        let mut first_err = None;
        while let Some(r) = waiting.next().await {
            match r {
                Ok(r) => {
                    if let Some(ok) = r.restored {
                        self.restores.borrow_mut().push((r.part, ok));
                    }
                    replies.push(r)
                }
                Err(e @ (ActorError::Node { .. } | ActorError::Panicked { .. })) => return Err(e),
                Err(e) => {
                    // Prefer reporting a panic (recoverable) over its consequences elsewhere.
                    let is_panic = matches!(e, ActorError::Panicked { .. });
                    if first_err.is_none() || is_panic {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => {
                replies.sort_by_key(|r| r.part);
                Ok(replies)
            }
        }
    }

    async fn await_reply<T>(
        &self,
        part: u32,
        what: &str,
        f: impl std::future::Future<Output = Result<T, ActorError>>,
    ) -> Result<T, ActorError> {
        match tokio::time::timeout(self.deadline, f).await {
            Ok(r) => r,
            Err(_) => Err(ActorError::Timeout {
                part,
                ms: self.deadline.as_millis() as u64,
                what: what.to_string(),
            }),
        }
    }
}
