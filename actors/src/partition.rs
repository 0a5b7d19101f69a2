//! The partition actor: an actix shell around [`PartitionState`].
//!
//! A [`Step`] request is parked until every halo block it needs has arrived, then computed on
//! this actor's arbiter thread (its stream); blocks it produces go out through the transport.
//! A split layer's step has two stages: the first runs and sends its blocks, the step parks
//! again until the neighbours' blocks for the second stage are in, then the second runs and
//! the step is answered.
//! A panic inside a computation is caught, reported to the coordinator as
//! [`ActorError::Panicked`], and the actor stops itself so that actix's `Supervisor` restarts
//! it: `restarting` restores the model replica and optimizer from the node's replica store.
use crate::messages::{ApplyStep, Halo, ResetEpoch, Step, StepReply};
use crate::replica::ReplicaStore;
use crate::state::{timed, PartitionState, Stage};
use crate::telemetry::{self, node_attr as node};
use crate::topology::FaultPlan;
use crate::ActorError;
use actix::prelude::*;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use trellis_gpu::{CancelToken, KernelTimes};
use trellis_runtime::metrics::{names, Key, Metrics};
use trellis_transport::{HaloBlock, PartId, Phase, RunId, Transport, TransportError};

type Reply = oneshot::Sender<Result<StepReply, ActorError>>;

/// Halo blocks waiting to be used, by (epoch, phase, layer) then sender.
type Inbox = BTreeMap<(u32, Phase, u16), BTreeMap<PartId, HaloBlock>>;

pub struct PartitionActor {
    part: PartId,
    run: RunId,
    state: PartitionState,
    transport: Arc<dyn Transport>,
    replicas: Arc<ReplicaStore>,
    faults: Arc<FaultPlan>,
    inbox: Inbox,
    pending: Option<Pending>,
    /// Outcome of the last restore, reported with the next reply.
    restored: Option<bool>,
    /// When the pending step was parked (halo wait latency per peer).
    parked_at: Option<Instant>,
    /// Cancels the kernels of the stage running now (set by [`PartitionRef::reset`], cleared
    /// when the reset is handled).
    cancel: CancelToken,
}

/// How a partition actor is reached on its node: its mailbox, and the token that cancels the
/// kernels it is running, so a reset need not wait for a layer to finish.
#[derive(Clone)]
pub struct PartitionRef {
    pub addr: Addr<PartitionActor>,
    pub cancel: CancelToken,
}

impl PartitionRef {
    /// Abandons the epoch in progress: cancels the running stage at its next kernel piece,
    /// then queues the reset (which lets work run again).
    pub fn reset(&self, msg: ResetEpoch) -> actix::dev::Request<PartitionActor, ResetEpoch> {
        self.cancel.cancel();
        self.addr.send(msg)
    }
}

/// A step waiting for halo blocks, with what its stages so far cost.
struct Pending {
    step: Step,
    reply: Reply,
    compute_ms: f64,
    halo_bytes: u64,
    kernels: KernelTimes,
}

impl PartitionActor {
    pub fn new(
        state: PartitionState,
        run: RunId,
        transport: Arc<dyn Transport>,
        replicas: Arc<ReplicaStore>,
        faults: Arc<FaultPlan>,
        cancel: CancelToken,
    ) -> Self {
        let part = state.part();
        if replicas.enabled() {
            match state.snapshot() {
                Ok(snap) => replicas.put(part.0, snap),
                Err(e) => tracing::error!("partition {part}: no initial replica: {e}"),
            }
        }
        PartitionActor {
            part,
            run,
            state,
            transport,
            replicas,
            faults,
            inbox: Inbox::new(),
            pending: None,
            restored: None,
            parked_at: None,
            cancel,
        }
    }

    /// Runs the parked step's stages as far as the halo blocks that are here allow.
    fn try_progress(&mut self, ctx: &mut Context<Self>) {
        while let Some(p) = &self.pending {
            let step = p.step;
            let stage = self.state.stage_of(step.epoch, step.phase, step.layer);
            let (tag, need) = self.state.inputs(step.phase, step.layer, stage);
            // A stage that needs no blocks leaves the inbox alone (they may be another's).
            let blocks = if need.is_empty() {
                BTreeMap::new()
            } else {
                let key = (step.epoch, step.phase, tag);
                let have = self.inbox.get(&key);
                if !need.iter().all(|q| have.is_some_and(|m| m.contains_key(q))) {
                    return;
                }
                self.inbox.remove(&key).unwrap_or_default()
            };
            if !self.run_stage(step, stage, &blocks, ctx) {
                return;
            }
        }
    }

    /// Runs one stage of the parked step and sends its blocks; answers the step when it is
    /// done or failed. Returns whether the step goes on with its second stage.
    fn run_stage(
        &mut self,
        step: Step,
        stage: Stage,
        blocks: &BTreeMap<PartId, HaloBlock>,
        ctx: &mut Context<Self>,
    ) -> bool {
        let part = self.part;
        let span = tracing::info_span!(
            "layer",
            otel.name = phase_name(step.phase),
            partition = i64::from(part.0),
            node = node(),
            epoch = i64::from(step.epoch),
            layer = i64::from(step.layer),
        );
        telemetry::set_parent(&span, step.trace);
        let _in_layer = span.enter();
        let faults = self.faults.clone();
        let before = self.state.stream().kernel_times();
        let result = catch_unwind(AssertUnwindSafe(|| {
            let second = stage == Stage::Second;
            faults.maybe_panic(part.0, step.epoch, step.layer, step.phase, second);
            timed(|| {
                self.state
                    .run_stage(step.run, step.epoch, step.layer, step.phase, stage, blocks)
            })
        }));
        let kernels = self.state.stream().kernel_times().since(&before);
        let error = match result {
            Ok((Ok((outcome, out)), ms)) => {
                let p = self.pending.as_mut().expect("a parked step runs");
                p.compute_ms += ms;
                p.kernels.add(&kernels);
                for mut b in out {
                    let bytes = b.payload_bytes();
                    p.halo_bytes += bytes;
                    let (to, layer) = (b.header.to.0, b.header.layer);
                    let send = tracing::info_span!(
                        "halo_send",
                        partition = i64::from(part.0),
                        peer = i64::from(to),
                        node = node(),
                        epoch = i64::from(step.epoch),
                        layer = i64::from(layer),
                        bytes = bytes as i64
                    );
                    b.trace = telemetry::context_of(&send);
                    let _in_send = send.enter();
                    telemetry::count_halo_send(part.0, to, bytes);
                    match self.transport.send(b) {
                        Ok(()) => {}
                        // A lost peer node: the coordinator detects the loss on its own link
                        // and recovers (re-placing that node's partitions, replaying the
                        // epoch), so this step still answers.
                        Err(e @ TransportError::Peer { .. }) => {
                            tracing::warn!("partition {part}: {e}; block dropped")
                        }
                        Err(e) => {
                            let p = self.pending.take().expect("a parked step runs");
                            let _ = p.reply.send(Err(ActorError::Unreachable {
                                part: part.0,
                                detail: e.to_string(),
                            }));
                            return false;
                        }
                    }
                }
                let Some(outcome) = outcome else {
                    return true;
                };
                let p = self.pending.take().expect("a parked step runs");
                let _ = p.reply.send(Ok(StepReply {
                    part: part.0,
                    compute_ms: p.compute_ms,
                    halo_bytes: p.halo_bytes,
                    kernels: p.kernels,
                    outcome,
                    restored: self.restored.take(),
                }));
                return false;
            }
            Ok((Err(e), _)) => ActorError::Compute {
                part: part.0,
                source: e,
            },
            Err(panic) => {
                crate::failure_clock::record(self.run, part.0, std::time::Instant::now());
                // Stopping makes actix's Supervisor call `restarting` and start us again.
                ctx.stop();
                ActorError::Panicked {
                    part: part.0,
                    message: panic_message(panic),
                }
            }
        };
        let p = self.pending.take().expect("a parked step runs");
        let _ = p.reply.send(Err(error));
        false
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

impl Actor for PartitionActor {
    type Context = Context<Self>;
}

impl Supervised for PartitionActor {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.inbox.clear();
        self.pending = None;
        match self.replicas.get(self.part.0) {
            Some(snap) => {
                let ok = self.state.restore(&snap).unwrap_or_else(|e| {
                    tracing::error!("partition {}: restoring its replica failed: {e}", self.part);
                    false
                });
                self.faults.record_restore(self.part.0, ok);
                self.restored = Some(ok);
            }
            None => self.reset_state(),
        }
    }
}

impl Handler<Step> for PartitionActor {
    type Result = ResponseFuture<Result<StepReply, ActorError>>;

    fn handle(&mut self, step: Step, ctx: &mut Context<Self>) -> Self::Result {
        let part = self.part.0;
        if step.run != self.run {
            return Box::pin(async move {
                Err(ActorError::Protocol {
                    part,
                    detail: "request of another run".into(),
                })
            });
        }
        let (tx, rx) = oneshot::channel();
        self.parked_at = Some(Instant::now());
        let new = Pending {
            step,
            reply: tx,
            compute_ms: 0.0,
            halo_bytes: 0,
            kernels: KernelTimes::default(),
        };
        if let Some(old) = self.pending.replace(new) {
            let _ = old.reply.send(Err(ActorError::Protocol {
                part,
                detail: "superseded by a newer request".into(),
            }));
        }
        self.try_progress(ctx);
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(ActorError::Unreachable {
                    part,
                    detail: "the actor restarted".into(),
                })
            })
        })
    }
}

impl Handler<Halo> for PartitionActor {
    type Result = ();

    fn handle(&mut self, Halo(block): Halo, ctx: &mut Context<Self>) {
        let h = block.header;
        // Drop blocks of other runs or of steps already committed (stale after a recovery);
        // an epoch's evaluation runs after its optimizer step.
        let done = self.state.epoch_done();
        let stale = if h.phase == Phase::Eval {
            h.epoch < done
        } else {
            h.epoch <= done
        };
        if h.run != self.run || h.to != self.part || stale {
            return;
        }
        let span = tracing::info_span!(
            "halo_recv",
            partition = i64::from(h.to.0),
            peer = i64::from(h.from.0),
            node = node(),
            epoch = i64::from(h.epoch),
            layer = i64::from(h.layer),
            bytes = block.payload_bytes() as i64
        );
        telemetry::set_parent(&span, block.trace);
        let in_recv = span.enter();
        let waited = match &self.pending {
            Some(p) if p.step.epoch == h.epoch && p.step.phase == h.phase => {
                self.parked_at.map(|t| t.elapsed()).unwrap_or_default()
            }
            _ => std::time::Duration::ZERO,
        };
        telemetry::record_halo_wait(h.to.0, h.from.0, waited);
        // Idempotent: a duplicate replaces an identical block.
        self.inbox
            .entry((h.epoch, h.phase, h.layer))
            .or_default()
            .insert(h.from, block);
        drop(in_recv);
        self.try_progress(ctx);
    }
}

impl Handler<ApplyStep> for PartitionActor {
    type Result = Result<String, ActorError>;

    fn handle(&mut self, msg: ApplyStep, _ctx: &mut Context<Self>) -> Self::Result {
        let part = self.part.0;
        if msg.run != self.run {
            return Err(ActorError::Protocol {
                part,
                detail: "step of another run".into(),
            });
        }
        if msg.epoch <= self.state.epoch_done() {
            // Already applied (a retried request): idempotent.
            return self
                .state
                .model()
                .weights_digest(self.state.stream())
                .map_err(|source| ActorError::Compute { part, source });
        }
        let span = tracing::info_span!(
            "apply",
            partition = i64::from(part),
            node = node(),
            epoch = i64::from(msg.epoch)
        );
        telemetry::set_parent(&span, msg.trace);
        let _in_apply = span.enter();
        let digest = self
            .state
            .apply(msg.epoch, &msg.grads)
            .map_err(|source| ActorError::Compute { part, source })?;
        if self.replicas.enabled() {
            let _in_replicate = tracing::info_span!(
                "replicate",
                partition = i64::from(part),
                node = node(),
                epoch = i64::from(msg.epoch)
            )
            .entered();
            let t = Instant::now();
            let snap = self
                .state
                .snapshot()
                .map_err(|source| ActorError::Compute { part, source })?;
            self.replicas.put(part, snap);
            Metrics::global().record(
                Key::new(names::REPLICATE).with("partition", part),
                t.elapsed(),
            );
        }
        self.inbox.retain(|k, _| k.0 > msg.epoch);
        Ok(digest)
    }
}

impl Handler<ResetEpoch> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: ResetEpoch, _ctx: &mut Context<Self>) {
        self.cancel.clear();
        self.inbox.retain(|k, _| k.0 != msg.epoch);
        if let Some(p) = self.pending.take() {
            let _ = p.reply.send(Err(ActorError::Protocol {
                part: self.part.0,
                detail: "epoch reset".into(),
            }));
        }
        self.reset_state();
    }
}

impl PartitionActor {
    /// Drops the epoch in progress; a failure (of the device) is logged, and surfaces again at
    /// the next op on the stream.
    fn reset_state(&mut self) {
        if let Err(e) = self.state.reset_epoch() {
            tracing::error!("partition {}: resetting the epoch failed: {e}", self.part);
        }
    }
}

/// The name of a layer span.
fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Eval => "eval",
    }
}
