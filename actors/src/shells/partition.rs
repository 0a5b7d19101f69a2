//! The partition actor: a thin actix shell around the [`PartitionMachine`]. It turns actix
//! messages into the machine's events, sends the blocks the machine emits through the
//! transport, answers requests through their reply channels, puts snapshots into the node's
//! [`ReplicaStore`], and restarts the partition when the machine asks (a caught panic): the
//! committed state is restored from the store before the next message is handled.
use crate::faults::FaultPlan;
use crate::protocol::epoch::{RequestId, Response};
use crate::protocol::messages::{
    Applied, ApplyStep, Halo, ReplicaCost, ResetEpoch, Step, StepReply,
};
use crate::protocol::partition::{PartitionAction, PartitionMachine};
use crate::protocol::state::PartitionState;
use crate::replica::ReplicaStore;
use crate::ActorError;
use actix::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use trellis_gpu::CancelToken;
use trellis_runtime::metrics::{names, Key, Metrics};
use trellis_transport::{PartId, RunId, Transport, TransportError};

type Reply = oneshot::Sender<Result<StepReply, ActorError>>;

pub struct PartitionActor {
    part: PartId,
    machine: PartitionMachine,
    transport: Arc<dyn Transport>,
    replicas: Arc<ReplicaStore>,
    run: RunId,
    /// Step requests waiting for their answer.
    waiting: HashMap<RequestId, Reply>,
    next_id: u64,
    /// Cancels the kernels of the stage running now (set by [`PartitionRef::reset`], cleared
    /// when the reset is handled).
    cancel: CancelToken,
    /// What storing and shipping the last snapshot cost here (added to the optimizer step's
    /// answer).
    replica_cost: ReplicaCost,
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
        let machine = PartitionMachine::new(state, run, faults, replicas.enabled());
        if replicas.enabled() {
            match machine.snapshot() {
                Ok(snap) => {
                    replicas.put(part.0, Arc::new(snap));
                }
                Err(e) => tracing::error!("partition {part}: no initial replica: {e}"),
            }
        }
        PartitionActor {
            part,
            run,
            machine,
            transport,
            replicas,
            waiting: HashMap::new(),
            next_id: 0,
            cancel,
            replica_cost: ReplicaCost::default(),
        }
    }

    fn next_id(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id)
    }

    /// Executes the machine's actions; returns the answer to request `sync`, if it came.
    fn drain(&mut self, sync: Option<RequestId>) -> Option<Result<Response, ActorError>> {
        let mut answer = None;
        let mut send_failed: Option<String> = None;
        loop {
            while let Some(action) = self.machine.poll_action() {
                match action {
                    PartitionAction::Send(b) => match self.transport.send(b) {
                        Ok(()) => {}
                        // A lost peer node: the coordinator detects the loss on its own link
                        // and recovers (re-placing that node's partitions, replaying the
                        // epoch), so this step still answers.
                        Err(e @ TransportError::Peer { .. }) => {
                            tracing::warn!("partition {}: {e}; block dropped", self.part)
                        }
                        Err(e) => send_failed = Some(e.to_string()),
                    },
                    PartitionAction::Answer { id, result } if Some(id) == sync => {
                        answer = Some(result)
                    }
                    PartitionAction::Answer { id, result } => {
                        let Some(tx) = self.waiting.remove(&id) else {
                            continue;
                        };
                        let result = match (result, &send_failed) {
                            (Ok(_), Some(detail)) => Err(ActorError::Unreachable {
                                part: self.part.0,
                                detail: detail.clone(),
                            }),
                            (Ok(Response::Step(r)), None) => Ok(r),
                            (Ok(_), None) => Err(ActorError::Protocol {
                                part: self.part.0,
                                detail: "a step answered with another reply".into(),
                            }),
                            (Err(e), _) => Err(e),
                        };
                        let _ = tx.send(result);
                    }
                    PartitionAction::HoldResidual(held) => {
                        self.replicas.hold_pending(self.part.0, held)
                    }
                    PartitionAction::RolledBack(snapshot) => {
                        self.replicas.put_local(self.part.0, snapshot)
                    }
                    PartitionAction::Replicate { snapshot, ms } => {
                        // Encoding, hashing and queueing it run here, before the step answers.
                        let (bytes, put_ms) = crate::protocol::state::timed(|| {
                            self.replicas.put(self.part.0, snapshot)
                        });
                        self.replica_cost = ReplicaCost { ms: put_ms, bytes };
                        Metrics::global().record_ms(
                            Key::new(names::REPLICATE).with("partition", self.part.0),
                            ms + put_ms,
                        );
                    }
                    // The supervisor's restart, done here and now: waiting for actix to stop and
                    // restart the actor let requests already in the mailbox reach the
                    // un-restored state under load (found by the optimizer-step panic test).
                    PartitionAction::Restart => {
                        crate::failure_clock::record(self.run, self.part.0, Instant::now());
                        self.restart();
                    }
                }
            }
            match send_failed.take() {
                // A block of a parked step could not leave: that step fails.
                Some(detail) => self.machine.abort_parked(detail),
                None => return answer,
            }
        }
    }
}

impl Actor for PartitionActor {
    type Context = Context<Self>;
}

impl PartitionActor {
    /// Restarts the partition: requests in flight are answered "the actor restarted" (their
    /// channels are dropped) and the machine restores the committed state from the node's
    /// replica store.
    fn restart(&mut self) {
        self.waiting.clear();
        let snap = self.replicas.get(self.part.0);
        match self.machine.restore(snap.as_deref()) {
            Ok(restored) => {
                if let Some(held) = self.replicas.pending_after(self.part.0, restored.epoch) {
                    self.machine.resume_pending(&held);
                }
            }
            Err(e) => tracing::error!("partition {}: restoring its replica failed: {e}", self.part),
        }
    }
}

/// If the actor itself ever stops (a panic outside the machine's `catch_unwind`), actix's
/// `Supervisor` starts it again through the same restart.
impl Supervised for PartitionActor {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.restart();
    }
}

impl Handler<Step> for PartitionActor {
    type Result = ResponseFuture<Result<StepReply, ActorError>>;

    fn handle(&mut self, step: Step, _ctx: &mut Context<Self>) -> Self::Result {
        let part = self.part.0;
        let id = self.next_id();
        let (tx, rx) = oneshot::channel();
        self.waiting.insert(id, tx);
        self.machine.handle_step(id, step, Instant::now());
        self.drain(None);
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

    fn handle(&mut self, Halo(block): Halo, _ctx: &mut Context<Self>) {
        self.machine.handle_halo(block, Instant::now());
        self.drain(None);
    }
}

impl Handler<ApplyStep> for PartitionActor {
    type Result = Result<Applied, ActorError>;

    fn handle(&mut self, msg: ApplyStep, _ctx: &mut Context<Self>) -> Self::Result {
        let id = self.next_id();
        self.machine
            .handle_apply(id, msg.run, msg.epoch, &msg.grads, msg.trace);
        self.replica_cost = ReplicaCost::default();
        match self.drain(Some(id)) {
            Some(Ok(Response::Applied(mut a))) => {
                let here = std::mem::take(&mut self.replica_cost);
                a.replica.ms += here.ms;
                a.replica.bytes += here.bytes;
                Ok(a)
            }
            Some(Err(e)) => Err(e),
            _ => Err(ActorError::Protocol {
                part: self.part.0,
                detail: "the optimizer step gave no digest".into(),
            }),
        }
    }
}

impl Handler<ResetEpoch> for PartitionActor {
    type Result = ();

    fn handle(&mut self, msg: ResetEpoch, _ctx: &mut Context<Self>) {
        self.cancel.clear();
        let id = self.next_id();
        self.machine.handle_reset(id, msg.epoch, msg.rollback);
        if let Some(Err(e)) = self.drain(Some(id)) {
            // A failure of the device surfaces again at the next op on the stream.
            tracing::error!("partition {}: resetting the epoch failed: {e}", self.part);
        }
    }
}
