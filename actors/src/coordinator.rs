//! The coordinator: drives the epoch protocol over the partition actors (ARCHITECTURE.md,
//! "Epoch protocol"), sums weight gradients in a fixed order, checks that every replica holds
//! the same weights after each step, and replays an epoch after a partition was restarted.
use crate::messages::{ApplyStep, Outcome, ResetEpoch, Step, StepReply};
use crate::partition::PartitionActor;
use crate::telemetry::{self, node_attr as node};
use crate::ActorError;
use actix::Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;
use trellis_runtime::metrics::{names, Key, Metrics};
use trellis_runtime::train::TrainConfig;
use trellis_runtime::EpochLog;
use trellis_transport::{Phase, RunId};

/// A recovery the coordinator performed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Recovery {
    pub kind: String,
    pub partition: u32,
    pub epoch: u32,
    /// From the failed step's start to the failure report, ms.
    pub detected_ms: f64,
    /// From the failure report to the replayed step completing, ms.
    pub resumed_ms: f64,
    pub steps_replayed: u32,
}

/// Drives epochs over a set of partition actors.
pub struct Coordinator {
    run: RunId,
    addrs: Vec<Addr<PartitionActor>>,
    num_layers: u16,
    deadline: Duration,
    max_restarts: u32,
    cancel: Arc<AtomicBool>,
    /// Restarts so far (the budget is for the whole run).
    restarts_used: u32,
    pub recoveries: Vec<Recovery>,
}

/// Result of one training step (forward, backward, all-reduce, optimizer) on every partition.
struct StepStats {
    loss_sum: f64,
    count: usize,
    compute_ms: Vec<f64>,
    halo_bytes: u64,
    digest: String,
}

impl Coordinator {
    pub fn new(
        run: RunId,
        addrs: Vec<Addr<PartitionActor>>,
        cfg: &TrainConfig,
        deadline: Duration,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        Coordinator {
            run,
            addrs,
            num_layers: cfg.model.layers as u16,
            deadline,
            max_restarts: 3,
            cancel,
            restarts_used: 0,
            recoveries: Vec::new(),
        }
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
        let t0 = Instant::now();
        let stats = self
            .retrying(epoch, |c| Box::pin(c.train_step(epoch)))
            .await?;
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
            part_compute_ms: stats.compute_ms,
        };
        Ok((log, stats.digest))
    }

    /// Runs `unit`; if a partition panicked, waits for its restart, resets the epoch on every
    /// partition and runs `unit` again (bounded by the restart budget).
    async fn retrying<T>(
        &mut self,
        epoch: u32,
        mut unit: impl for<'a> FnMut(
            &'a mut Self,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, ActorError>> + 'a>,
        >,
    ) -> Result<T, ActorError> {
        // Failures seen while running this unit, waiting for the unit to complete once, with
        // the span of each recovery (open from the failure report to the replay's end).
        let mut open: Vec<(u32, f64, Instant, tracing::Span)> = Vec::new();
        loop {
            let started = Instant::now();
            match unit(self).await {
                Err(ActorError::Panicked { part, message }) => {
                    let detected_ms = started.elapsed().as_secs_f64() * 1e3;
                    self.restarts_used += 1;
                    if self.restarts_used > self.max_restarts {
                        return Err(ActorError::RestartsExhausted {
                            part,
                            restarts: self.restarts_used - 1,
                            last: message,
                        });
                    }
                    let span = tracing::info_span!(
                        "recovery",
                        kind = "actor-panic",
                        partition = i64::from(part),
                        node = node(),
                        epoch = i64::from(epoch),
                        detected_ms,
                        resumed_ms = tracing::field::Empty,
                        steps_replayed = tracing::field::Empty,
                    );
                    Metrics::global().add(Key::new(names::RESTARTS).with("partition", part), 1);
                    open.push((part, detected_ms, Instant::now(), span));
                    for a in &self.addrs {
                        a.send(ResetEpoch { epoch }).await.map_err(|e| {
                            ActorError::Unreachable {
                                part,
                                detail: e.to_string(),
                            }
                        })?;
                    }
                }
                other => {
                    let replayed = open.len() as u32;
                    for (part, detected_ms, at, span) in open.drain(..) {
                        let resumed_ms = at.elapsed().as_secs_f64() * 1e3;
                        span.record("resumed_ms", resumed_ms);
                        span.record("steps_replayed", i64::from(replayed));
                        Metrics::global()
                            .record_ms(Key::new(names::RECOVERY), detected_ms + resumed_ms);
                        self.recoveries.push(Recovery {
                            kind: "actor-panic".into(),
                            partition: part,
                            epoch,
                            detected_ms,
                            resumed_ms,
                            steps_replayed: replayed,
                        });
                    }
                    return other;
                }
            }
        }
    }

    async fn train_step(&mut self, epoch: u32) -> Result<StepStats, ActorError> {
        let p = self.addrs.len();
        let mut compute_ms = vec![0.0; p];
        let mut halo_bytes = 0;
        let (mut loss_sum, mut count) = (0.0, 0);
        for l in 0..self.num_layers {
            for r in self.broadcast(epoch, l, Phase::Forward).await? {
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
            for r in self.broadcast(epoch, l, Phase::Backward).await? {
                compute_ms[r.part as usize] += r.compute_ms;
                halo_bytes += r.halo_bytes;
                if let Outcome::Grads(g) = r.outcome {
                    grads[r.part as usize] = Some(g);
                }
            }
        }
        // All-reduce in a fixed order: partition 0, 1, ..., so the sum never depends on timing.
        let all_reduce = tracing::info_span!("all_reduce", epoch = i64::from(epoch), node = node());
        let t_reduce = Instant::now();
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
        let grads: Arc<[f32]> = Arc::from(sum);
        let futs: Vec<_> = self
            .addrs
            .iter()
            .map(|a| {
                a.send(ApplyStep {
                    run: self.run,
                    epoch,
                    grads: grads.clone(),
                    trace: telemetry::context_of(&all_reduce),
                })
            })
            .collect();
        let mut digest = String::new();
        for (q, f) in futs.into_iter().enumerate() {
            let d = self.await_reply(q as u32, "optimizer step", f).await??;
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
        Metrics::global().record(Key::new(names::ALL_REDUCE), t_reduce.elapsed());
        drop(all_reduce);
        Ok(StepStats {
            loss_sum,
            count,
            compute_ms,
            halo_bytes,
            digest,
        })
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

    /// Sends one step to every partition and waits for all replies; a panic is reported after
    /// every other partition has answered, so the epoch can be reset cleanly.
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
        let futs: Vec<_> = self.addrs.iter().map(|a| a.send(step)).collect();
        let mut replies = Vec::with_capacity(futs.len());
        let mut first_err = None;
        for (q, f) in futs.into_iter().enumerate() {
            let what = format!("{phase:?} layer {layer} of epoch {epoch}");
            match self.await_reply(q as u32, &what, f).await.and_then(|r| r) {
                Ok(r) => replies.push(r),
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
            None => Ok(replies),
        }
    }

    async fn await_reply<T>(
        &self,
        part: u32,
        what: &str,
        f: impl std::future::Future<Output = Result<T, actix::MailboxError>>,
    ) -> Result<T, ActorError> {
        match tokio::time::timeout(self.deadline, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(ActorError::Unreachable {
                part,
                detail: format!("{what}: {e}"),
            }),
            Err(_) => Err(ActorError::Timeout {
                part,
                ms: self.deadline.as_millis() as u64,
                what: what.to_string(),
            }),
        }
    }
}
