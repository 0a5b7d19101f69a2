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
use crate::telemetry::{self, node_attr as node};
use crate::topology::FaultPlan;
use crate::ActorError;
use actix::prelude::*;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use trellis_transport::{HaloBlock, PartId, Phase, RunId, Transport};

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
    /// When the pending step was parked (halo wait latency per peer).
    parked_at: Option<Instant>,
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
        replicas.put(part.0, state.snapshot());
        PartitionActor {
            part,
            run,
            state,
            transport,
            replicas,
            faults,
            inbox: Inbox::new(),
            pending: None,
            parked_at: None,
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
                for mut b in out {
                    let bytes = b.payload_bytes();
                    halo_bytes += bytes;
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
                    if let Err(e) = self.transport.send(b) {
                        let _ = reply.send(Err(ActorError::Unreachable {
                            part: part.0,
                            detail: e.to_string(),
                        }));
                        return;
                    }
                }
                let _ = reply.send(Ok(StepReply {
                    part: part.0,
                    compute_ms,
                    halo_bytes,
                    outcome,
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

/// The name of a layer span.
fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Eval => "eval",
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
        self.parked_at = Some(Instant::now());
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
        let _in_recv = span.enter();
        let waited = match &self.pending {
            Some((s, _)) if input_key(s) == (h.epoch, h.phase, h.layer) => {
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
        drop(_in_recv);
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
        let _in_replicate = tracing::info_span!(
            "replicate",
            partition = i64::from(part),
            node = node(),
            epoch = i64::from(msg.epoch)
        )
        .entered();
        self.replicas.put(part, self.state.snapshot());
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
