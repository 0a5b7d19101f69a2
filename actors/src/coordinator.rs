//! The coordinator: drives the epoch protocol over the partition actors (ARCHITECTURE.md,
//! "Epoch protocol"), sums weight gradients in a fixed order, checks that every replica holds
//! the same weights after each step, and replays an epoch after a partition was restarted.
use crate::messages::{ApplyStep, Outcome, ResetEpoch, Step, StepReply};
use crate::partition::PartitionActor;
use crate::profile::{EpochProfile, StepProfile};
use crate::ActorError;
use actix::Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
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
    /// Where the last completed training step's time went.
    pub last_profile: Option<EpochProfile>,
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
            last_profile: None,
        }
    }

    /// Runs epoch `epoch` (training step, then evaluation). `totals` are the global split sizes.
    pub async fn epoch(
        &mut self,
        epoch: u32,
        totals: (usize, usize, usize),
    ) -> Result<(EpochLog, String), ActorError> {
        let t0 = Instant::now();
        let stats = self
            .retrying(epoch, |c| Box::pin(c.train_step(epoch)))
            .await?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
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
        // Failures seen while running this unit, waiting for the unit to complete once.
        let mut open: Vec<(u32, f64, Instant)> = Vec::new();
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
                    open.push((part, detected_ms, Instant::now()));
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
                    for (part, detected_ms, at) in open.drain(..) {
                        self.recoveries.push(Recovery {
                            kind: "actor-panic".into(),
                            partition: part,
                            epoch,
                            detected_ms,
                            resumed_ms: at.elapsed().as_secs_f64() * 1e3,
                            steps_replayed: replayed,
                        });
                    }
                    return other;
                }
            }
        }
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

    async fn train_step(&mut self, epoch: u32) -> Result<StepStats, ActorError> {
        let p = self.addrs.len();
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
        let t_apply = Instant::now();
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
        profile.apply_ms = t_apply.elapsed().as_secs_f64() * 1e3;
        self.last_profile = Some(profile);
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

    /// Sends one step to every partition and collects the replies as they come. A panic is
    /// reported at once: other partitions may be parked waiting for blocks the failed one
    /// never sent, and `ResetEpoch` answers them. Any other failure is reported once every
    /// partition has answered or the deadline has passed, a panic elsewhere taking precedence.
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
        };
        let what = format!("{phase:?} layer {layer} of epoch {epoch}");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (q, a) in self.addrs.iter().enumerate() {
            let request = a.send(step);
            let tx = tx.clone();
            actix::spawn(async move {
                let _ = tx.send((q, request.await));
            });
        }
        drop(tx);
        let deadline = tokio::time::Instant::now() + self.deadline;
        let mut replies: Vec<Option<StepReply>> = vec![None; self.addrs.len()];
        let mut answered = vec![false; self.addrs.len()];
        let mut first_err = None;
        while answered.iter().any(|a| !a) {
            let (q, reply) = match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(_) => {
                    let part = answered.iter().position(|a| !a).unwrap_or(0) as u32;
                    return Err(first_err.unwrap_or(ActorError::Timeout {
                        part,
                        ms: self.deadline.as_millis() as u64,
                        what,
                    }));
                }
            };
            answered[q] = true;
            match reply {
                Ok(Ok(r)) => replies[q] = Some(r),
                Ok(Err(e @ ActorError::Panicked { .. })) => return Err(e),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => {
                    first_err.get_or_insert(ActorError::Unreachable {
                        part: q as u32,
                        detail: format!("{what}: {e}"),
                    });
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        replies
            .into_iter()
            .enumerate()
            .map(|(q, r)| {
                r.ok_or_else(|| ActorError::Unreachable {
                    part: q as u32,
                    detail: format!("{what}: no reply"),
                })
            })
            .collect()
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
