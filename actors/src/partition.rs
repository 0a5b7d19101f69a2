//! The partition actor: an actix shell around [`PartitionState`].
//!
//! A [`Step`] request is parked until every halo block it needs has arrived, then computed on
//! this actor's arbiter thread (its stream); blocks it produces go out through the transport.
//! A panic inside a computation is caught, reported to the coordinator as
//! [`ActorError::Panicked`], and the actor stops itself so that actix's `Supervisor` restarts
//! it: `restarting` restores the model replica and optimizer from the node's replica store.
use crate::messages::{ApplyStep, Halo, ResetEpoch, Step, StepReply};
use crate::replica::ReplicaStore;
use crate::state::{timed, PartitionState};
use crate::topology::FaultPlan;
use crate::ActorError;
use actix::prelude::*;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use tokio::sync::oneshot;
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
    pending: Option<(Step, Reply)>,
    /// Outcome of the last restore, reported with the next reply.
    restored: Option<bool>,
}

impl PartitionActor {
    pub fn new(
        state: PartitionState,
        run: RunId,
        transport: Arc<dyn Transport>,
        replicas: Arc<ReplicaStore>,
        faults: Arc<FaultPlan>,
    ) -> Self {
        let part = state.part();
        if replicas.enabled() {
            replicas.put(part.0, state.snapshot());
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
        }
    }

    /// Runs the parked step if all its halo blocks are here.
    fn try_progress(&mut self, ctx: &mut Context<Self>) {
        let Some((step, _)) = &self.pending else {
            return;
        };
        let step = *step;
        let need = self.state.expected_senders(step.phase, step.layer);
        let key = input_key(&step);
        let have = self.inbox.get(&key);
        if !need.iter().all(|q| have.is_some_and(|m| m.contains_key(q))) {
            return;
        }
        let (_, reply) = self.pending.take().expect("checked above");
        let blocks = self.inbox.remove(&key).unwrap_or_default();
        let part = self.part;
        let faults = self.faults.clone();
        let result = catch_unwind(AssertUnwindSafe(|| {
            faults.maybe_panic(part.0, step.epoch, step.layer, step.phase);
            timed(|| match step.phase {
                Phase::Forward | Phase::Eval => self
                    .state
                    .forward(step.run, step.epoch, step.layer, step.phase, &blocks),
                Phase::Backward => self
                    .state
                    .backward(step.run, step.epoch, step.layer, &blocks),
            })
        }));
        match result {
            Ok((Ok((outcome, out)), compute_ms)) => {
                let mut halo_bytes = 0;
                for b in out {
                    halo_bytes += b.payload_bytes();
                    match self.transport.send(b) {
                        Ok(()) => {}
                        // A lost peer node: the coordinator detects the loss on its own link
                        // and recovers (re-placing that node's partitions, replaying the
                        // epoch), so this step still answers.
                        Err(e @ TransportError::Peer { .. }) => {
                            tracing::warn!("partition {part}: {e}; block dropped")
                        }
                        Err(e) => {
                            let _ = reply.send(Err(ActorError::Unreachable {
                                part: part.0,
                                detail: e.to_string(),
                            }));
                            return;
                        }
                    }
                }
                let _ = reply.send(Ok(StepReply {
                    part: part.0,
                    compute_ms,
                    halo_bytes,
                    outcome,
                    restored: self.restored.take(),
                }));
            }
            Ok((Err(e), _)) => {
                let _ = reply.send(Err(ActorError::Compute {
                    part: part.0,
                    source: e,
                }));
            }
            Err(panic) => {
                let message = panic_message(panic);
                let _ = reply.send(Err(ActorError::Panicked {
                    part: part.0,
                    message,
                }));
                // Stopping makes actix's Supervisor call `restarting` and start us again.
                ctx.stop();
            }
        }
    }
}

/// The inbox key of the blocks a step consumes.
fn input_key(step: &Step) -> (u32, Phase, u16) {
    match step.phase {
        Phase::Forward | Phase::Eval => (step.epoch, step.phase, step.layer.wrapping_sub(1)),
        Phase::Backward => (step.epoch, Phase::Backward, step.layer + 1),
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
                let ok = self.state.restore(&snap);
                self.faults.record_restore(self.part.0, ok);
                self.restored = Some(ok);
            }
            None => self.state.reset_epoch(),
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
        if let Some((_, old)) = self.pending.replace((step, tx)) {
            let _ = old.send(Err(ActorError::Protocol {
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
        // Idempotent: a duplicate replaces an identical block.
        self.inbox
            .entry((h.epoch, h.phase, h.layer))
            .or_default()
            .insert(h.from, block);
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
            return Ok(self.state.model().weights_digest());
        }
        let digest = self
            .state
            .apply(msg.epoch, &msg.grads)
            .map_err(|source| ActorError::Compute { part, source })?;
        if self.replicas.enabled() {
            self.replicas.put(part, self.state.snapshot());
        }
        self.inbox.retain(|k, _| k.0 > msg.epoch);
        Ok(digest)
    }
}

impl Handler<ResetEpoch> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: ResetEpoch, _ctx: &mut Context<Self>) {
        self.inbox.retain(|k, _| k.0 != msg.epoch);
        if let Some((_, reply)) = self.pending.take() {
            let _ = reply.send(Err(ActorError::Protocol {
                part: self.part.0,
                detail: "epoch reset".into(),
            }));
        }
        self.state.reset_epoch();
    }
}
