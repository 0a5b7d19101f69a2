//! The partition machine: one partition's inbox of halo blocks and its parked step around its
//! compute state ([`PartitionState`]), free of actors and sockets. The actix
//! [`PartitionActor`](crate::shells::partition::PartitionActor) and the simulator feed it
//! requests and blocks and execute the [`PartitionAction`]s it returns.
//!
//! Every computation (a stage of a step, the optimizer step, an epoch reset, a restore) runs
//! inside `catch_unwind`: a panic answers the request with [`ActorError::Panicked`] and asks
//! the shell to restart the partition ([`PartitionAction::Restart`]), which then calls
//! [`PartitionMachine::restore`] with the replica it holds.
use crate::faults::{FaultPlan, APPLY_LAYER};
use crate::protocol::epoch::{RequestId, Response};
use crate::protocol::messages::{Applied, Outcome, ReplicaCost, RestoreReport, Step, StepReply};
use crate::protocol::state::{timed, EpochBlocks, PartitionState, Stage};
use crate::replica::{PendingResidual, Snapshot};
use crate::telemetry::{self, node_attr as node};
use crate::ActorError;
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};
use trellis_gpu::KernelTimes;
use trellis_transport::{HaloBlock, PartId, Phase, RunId};

/// Halo blocks waiting to be used, by (epoch, phase, layer tag) then sender.
type Inbox = BTreeMap<(u32, Phase, u16), BTreeMap<PartId, HaloBlock>>;

/// What the shell must do.
#[derive(Debug)]
pub enum PartitionAction {
    /// Send a halo block to its destination partition.
    Send(HaloBlock),
    /// Answer request `id`.
    Answer {
        id: RequestId,
        result: Result<Response, ActorError>,
    },
    /// Store this snapshot of the committed state with the replicas (after an optimizer step);
    /// `ms`: the time taken to copy it out.
    Replicate { snapshot: Arc<Snapshot>, ms: f64 },
    /// The partition went back to this committed state (a reset with rollback): it replaces
    /// the node's own snapshot of the partition, without shipping it (see
    /// [`PartitionMachine::handle_reset`]).
    RolledBack(Arc<Snapshot>),
    /// Hold this residual of the step in progress in the node's store, outside the actor
    /// (`--grad-codec`: a restart during the optimizer step resumes with it, see
    /// [`PartitionMachine::resume_pending`]).
    HoldResidual(PendingResidual),
    /// The computation panicked: restart the partition (then [`PartitionMachine::restore`]).
    Restart,
}

/// The step a partition is working on.
#[derive(Debug)]
enum StepSlot {
    Idle,
    /// Waiting for the halo blocks of its next stage.
    Parked(Parked),
}

/// A step waiting for halo blocks, with what its stages so far cost.
#[derive(Debug)]
struct Parked {
    id: RequestId,
    step: Step,
    parked_at: Instant,
    compute_ms: f64,
    halo_bytes: u64,
    halo_fp32_bytes: u64,
    kernels: KernelTimes,
}

/// One partition's protocol state.
pub struct PartitionMachine {
    part: PartId,
    run: RunId,
    state: PartitionState,
    faults: Arc<FaultPlan>,
    /// Snapshots of committed states are sent to the replicas after each optimizer step.
    replicate: bool,
    inbox: Inbox,
    slot: StepSlot,
    /// The state restored at the last restart, reported with the next step reply.
    restored: Option<RestoreReport>,
    actions: VecDeque<PartitionAction>,
    /// Blocks dropped as stale (another run, a committed epoch, another destination).
    dropped_blocks: u64,
    /// The newest request handled: ids only grow, so an older one (delayed, duplicated) is
    /// stale and dropped unanswered. A stale reset must never wipe a replay in progress.
    last_request: Option<RequestId>,
    stale_requests: u64,
    /// With replication: the snapshot of the state after the last optimizer step (shared with
    /// the node's replica store), and the one before it, kept until the coordinator is known
    /// to have committed the last step (its next epoch or its evaluation starts): a reset
    /// with rollback goes back to it.
    latest: Option<Arc<Snapshot>>,
    before: Option<Arc<Snapshot>>,
}

impl std::fmt::Debug for PartitionMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionMachine")
            .field("part", &self.part)
            .field("slot", &self.slot)
            .finish()
    }
}

impl PartitionMachine {
    /// A machine around `state`; `replicate`: snapshot the committed state after each step.
    pub fn new(state: PartitionState, run: RunId, faults: Arc<FaultPlan>, replicate: bool) -> Self {
        PartitionMachine {
            part: state.part(),
            run,
            state,
            faults,
            replicate,
            inbox: Inbox::new(),
            slot: StepSlot::Idle,
            restored: None,
            actions: VecDeque::new(),
            dropped_blocks: 0,
            last_request: None,
            stale_requests: 0,
            latest: None,
            before: None,
        }
    }

    /// The partition id.
    pub fn part(&self) -> PartId {
        self.part
    }

    /// The compute state.
    pub fn state(&self) -> &PartitionState {
        &self.state
    }

    /// The compute state, mutably (the shell sets its cancel token).
    pub fn state_mut(&mut self) -> &mut PartitionState {
        &mut self.state
    }

    /// Blocks dropped as stale so far.
    pub fn dropped_blocks(&self) -> u64 {
        self.dropped_blocks
    }

    /// Requests dropped as older than one already handled.
    pub fn stale_requests(&self) -> u64 {
        self.stale_requests
    }

    /// Whether request `id` is newer than every request handled so far (and records it).
    fn fresh(&mut self, id: RequestId) -> bool {
        if self.last_request.is_some_and(|last| id <= last) {
            self.stale_requests += 1;
            return false;
        }
        self.last_request = Some(id);
        true
    }

    /// The next action to execute.
    pub fn poll_action(&mut self) -> Option<PartitionAction> {
        self.actions.pop_front()
    }

    /// A snapshot of the current committed state (the first replica, before any step).
    pub fn snapshot(&self) -> Result<Snapshot, ActorError> {
        self.state.snapshot().map_err(|source| ActorError::Compute {
            part: self.part.0,
            source,
        })
    }

    /// The coordinator asks for one layer of a pass. A newer request supersedes a parked one.
    pub fn handle_step(&mut self, id: RequestId, step: Step, now: Instant) {
        if !self.fresh(id) {
            return;
        }
        let part = self.part.0;
        if step.run != self.run {
            return self.answer(
                id,
                Err(ActorError::Protocol {
                    part,
                    detail: "request of another run".into(),
                }),
            );
        }
        if step.phase == Phase::Eval || step.epoch > self.state.epoch_done() {
            // The coordinator committed the last step: no rollback can ask for the one before.
            self.before = None;
        }
        let new = Parked {
            id,
            step,
            parked_at: now,
            compute_ms: 0.0,
            halo_bytes: 0,
            halo_fp32_bytes: 0,
            kernels: KernelTimes::default(),
        };
        if let StepSlot::Parked(old) = std::mem::replace(&mut self.slot, StepSlot::Parked(new)) {
            self.answer(
                old.id,
                Err(ActorError::Protocol {
                    part,
                    detail: "superseded by a newer request".into(),
                }),
            );
        }
        self.try_progress();
    }

    /// A halo block arrived.
    pub fn handle_halo(&mut self, block: HaloBlock, now: Instant) {
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
            self.dropped_blocks += 1;
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
        let waited = match &self.slot {
            StepSlot::Parked(p) if p.step.epoch == h.epoch && p.step.phase == h.phase => {
                now.saturating_duration_since(p.parked_at)
            }
            _ => Duration::ZERO,
        };
        telemetry::record_halo_wait(h.to.0, h.from.0, waited);
        // Idempotent: a duplicate replaces an identical block.
        self.inbox
            .entry((h.epoch, h.phase, h.layer))
            .or_default()
            .insert(h.from, block);
        drop(in_recv);
        self.try_progress();
    }

    /// The coordinator sends the all-reduced gradients of `epoch`: apply them (once), answer
    /// the weights digest, and replicate the committed state.
    pub fn handle_apply(
        &mut self,
        id: RequestId,
        run: RunId,
        epoch: u32,
        grads: &[f32],
        trace: Option<trellis_transport::TraceContext>,
    ) {
        if !self.fresh(id) {
            return;
        }
        let part = self.part.0;
        if run != self.run {
            return self.answer(
                id,
                Err(ActorError::Protocol {
                    part,
                    detail: "step of another run".into(),
                }),
            );
        }
        if epoch <= self.state.epoch_done() {
            // Already applied (a retried request): idempotent.
            let d = self.state.model().weights_digest(self.state.stream());
            let restored = self.restored.take();
            let r = d
                .map(|digest| {
                    Response::Applied(Applied {
                        digest,
                        restored,
                        replica: ReplicaCost::default(),
                    })
                })
                .map_err(|source| ActorError::Compute { part, source });
            return self.answer(id, r);
        }
        // With staleness or skipping, the rows held for the next epoch, and with evaluation
        // rows skipped those the last evaluation received (checked and merged before the
        // step, so a bad block fails it without stepping).
        let (holds, holds_eval) = (self.state.holds_rows(), self.state.holds_eval_rows());
        if holds && !self.epoch_blocks_in(epoch) {
            // Only after a restart during the optimizer step on a node that was lost (a
            // restart on the same node keeps the blocks of the epoch in progress).
            return self.answer(id, Err(ActorError::HeldRowsLost { part, epoch }));
        }
        let evaluated = epoch.saturating_sub(1);
        if holds_eval && evaluated > 0 && !self.blocks_in(evaluated, &self.state.eval_inputs()) {
            // The coordinator replays the evaluation whenever a partition may have lost them.
            let detail = format!(
                "the halo blocks of the evaluation of epoch {evaluated} are missing at the \
                 optimizer step of epoch {epoch} (--eval-skip-threshold)"
            );
            return self.answer(id, Err(ActorError::Protocol { part, detail }));
        }
        let held = if holds || holds_eval {
            let mut blocks = if holds {
                self.epoch_blocks(epoch)
            } else {
                EpochBlocks::new()
            };
            if holds_eval {
                blocks.extend(self.eval_blocks(evaluated));
            }
            match self.state.merge_held(blocks) {
                Ok(h) => Some(h),
                Err(source) => return self.answer(id, Err(ActorError::Compute { part, source })),
            }
        } else {
            None
        };
        let span = tracing::info_span!(
            "apply",
            partition = i64::from(part),
            node = node(),
            epoch = i64::from(epoch)
        );
        telemetry::set_parent(&span, trace);
        let _in_apply = span.enter();
        let done = self.state.epoch_done();
        let mut replica = ReplicaCost::default();
        if self.replicate && self.latest.as_ref().is_none_or(|s| s.epoch != done) {
            // The committed state this step starts from, kept for a rollback (only the first
            // step and the first after a restore copy it out here; every other step's
            // replicated snapshot is it).
            match timed(|| self.state.snapshot()) {
                (Ok(s), ms) => {
                    self.latest = Some(Arc::new(s));
                    replica.ms += ms;
                }
                (Err(source), _) => {
                    return self.answer(id, Err(ActorError::Compute { part, source }))
                }
            }
        }
        let faults = self.faults.clone();
        let result = catch_unwind(AssertUnwindSafe(|| {
            if let Some(message) = faults.panic_due(part, epoch, APPLY_LAYER, Phase::Forward, false)
            {
                self.state.clobber_for_fault();
                std::panic::panic_any(message);
            }
            self.state.apply(epoch, grads)
        }));
        match result {
            Ok(Ok(digest)) => {
                if let Some(held) = held {
                    self.state.hold(held);
                }
                if self.replicate {
                    let _in_replicate = tracing::info_span!(
                        "replicate",
                        partition = i64::from(part),
                        node = node(),
                        epoch = i64::from(epoch)
                    )
                    .entered();
                    match timed(|| self.state.snapshot()) {
                        (Ok(snapshot), ms) => {
                            replica.ms += ms;
                            let snapshot = Arc::new(snapshot);
                            self.before = self.latest.replace(snapshot.clone());
                            self.actions
                                .push_back(PartitionAction::Replicate { snapshot, ms })
                        }
                        (Err(source), _) => {
                            return self.answer(id, Err(ActorError::Compute { part, source }))
                        }
                    }
                }
                self.inbox.retain(|k, _| k.0 > epoch);
                let restored = self.restored.take();
                self.answer(
                    id,
                    Ok(Response::Applied(Applied {
                        digest,
                        restored,
                        replica,
                    })),
                );
            }
            Ok(Err(source)) => self.answer(id, Err(ActorError::Compute { part, source })),
            Err(panic) => self.panicked(id, panic),
        }
    }

    /// Forget the epoch in progress (it is about to be replayed): its blocks, its parked step
    /// (answered with an error) and the state's caches. With `rollback` (the training step is
    /// replayed) a partition that already applied `epoch` first goes back to the committed
    /// state before it, the snapshot it kept ([`PartitionAction::RolledBack`]).
    pub fn handle_reset(&mut self, id: RequestId, epoch: u32, rollback: bool) {
        if !self.fresh(id) {
            return;
        }
        let part = self.part.0;
        if rollback && self.state.epoch_done() >= epoch {
            if let Err(e) = self.roll_back(epoch) {
                return self.answer(id, Err(e));
            }
        }
        // With staleness or skipping the epoch's training blocks stay: the optimizer step
        // holds them for the next epoch, and the replay sends the same ones again.
        let keep = self.state.holds_rows();
        self.inbox
            .retain(|k, _| k.0 != epoch || (keep && k.1 != Phase::Eval));
        if let StepSlot::Parked(p) = std::mem::replace(&mut self.slot, StepSlot::Idle) {
            self.answer(
                p.id,
                Err(ActorError::Protocol {
                    part,
                    detail: "epoch reset".into(),
                }),
            );
        }
        match catch_unwind(AssertUnwindSafe(|| self.state.reset_epoch())) {
            Ok(Ok(())) => self.answer(id, Ok(Response::ResetDone)),
            Ok(Err(source)) => self.answer(id, Err(ActorError::Compute { part, source })),
            Err(panic) => self.panicked(id, panic),
        }
    }

    /// Goes back to the state committed before `epoch`'s optimizer step (see
    /// [`PartitionMachine::handle_reset`]).
    fn roll_back(&mut self, epoch: u32) -> Result<(), ActorError> {
        let part = self.part.0;
        let done = self.state.epoch_done();
        let target = epoch.saturating_sub(1);
        let snap = [&self.before, &self.latest]
            .into_iter()
            .flatten()
            .find(|s| s.epoch == target)
            .cloned()
            .ok_or_else(|| ActorError::Protocol {
                part,
                detail: format!(
                    "asked to roll back to step {target} from step {done}, and no snapshot of \
                     it is kept (is replication off?)"
                ),
            })?;
        match catch_unwind(AssertUnwindSafe(|| self.state.restore(&snap))) {
            Ok(Ok(_)) => {}
            Ok(Err(source)) => return Err(ActorError::Compute { part, source }),
            Err(panic) => {
                self.actions.push_back(PartitionAction::Restart);
                return Err(ActorError::Panicked {
                    part,
                    message: panic_message(panic),
                });
            }
        }
        // The inbox holds no training block of `epoch` (they were dropped when it was
        // applied, and later ones as stale): the replay sends them again.
        self.latest = Some(snap.clone());
        self.before = None;
        self.actions.push_back(PartitionAction::RolledBack(snap));
        Ok(())
    }

    /// The partition restarted: drop its inbox and parked step, and restore the committed
    /// state from `replica` (the shell's replica of this partition, if it holds one). Returns
    /// what was restored; the next step reply reports it to the coordinator, which checks it
    /// against the digest it committed.
    pub fn restore(&mut self, replica: Option<&Snapshot>) -> Result<RestoreReport, ActorError> {
        let part = self.part.0;
        self.slot = StepSlot::Idle;
        self.latest = None;
        self.before = None;
        let result = catch_unwind(AssertUnwindSafe(|| match replica {
            Some(snap) => self.state.restore(snap).map(|_| ()),
            None => self.state.reset_epoch(),
        }));
        // The blocks other partitions sent are no part of the failure; with staleness or
        // skipping the training blocks of the epoch in progress are kept (its replay sends the
        // same ones, and an optimizer step replayed after a restart holds them), and with
        // evaluation rows skipped the blocks of the restored epoch's evaluation (the next
        // optimizer step holds them).
        let done = self.state.epoch_done();
        let (keep, keep_eval) = (self.state.holds_rows(), self.state.holds_eval_rows());
        self.inbox.retain(|k, _| match k.1 {
            Phase::Eval => keep_eval && k.0 == done,
            Phase::Forward | Phase::Backward => keep && k.0 > done,
        });
        match result {
            Ok(Ok(())) => {}
            Ok(Err(source)) => return Err(ActorError::Compute { part, source }),
            Err(panic) => {
                return Err(ActorError::Panicked {
                    part,
                    message: panic_message(panic),
                })
            }
        }
        let digest = self
            .state
            .model()
            .weights_digest(self.state.stream())
            .map_err(|source| ActorError::Compute { part, source })?;
        let report = RestoreReport {
            epoch: self.state.epoch_done(),
            digest,
        };
        self.restored = Some(report.clone());
        Ok(report)
    }

    /// After [`PartitionMachine::restore`]: the residual the node held for the step after the
    /// restored one (a restart during that step's optimizer step replays it with this).
    pub fn resume_pending(&mut self, pending: &PendingResidual) {
        self.state.resume_pending(pending);
    }

    /// A block the shell was asked to send could not leave (not a lost peer): the parked step,
    /// if any, fails with `detail`.
    pub fn abort_parked(&mut self, detail: String) {
        if let StepSlot::Parked(p) = std::mem::replace(&mut self.slot, StepSlot::Idle) {
            let part = self.part.0;
            self.answer(p.id, Err(ActorError::Unreachable { part, detail }));
        }
    }

    fn answer(&mut self, id: RequestId, result: Result<Response, ActorError>) {
        self.actions
            .push_back(PartitionAction::Answer { id, result });
    }

    fn panicked(&mut self, id: RequestId, panic: Box<dyn std::any::Any + Send>) {
        let part = self.part.0;
        self.answer(
            id,
            Err(ActorError::Panicked {
                part,
                message: panic_message(panic),
            }),
        );
        self.actions.push_back(PartitionAction::Restart);
    }

    /// Runs the parked step's stages as far as the halo blocks that are here allow.
    fn try_progress(&mut self) {
        loop {
            let StepSlot::Parked(p) = &self.slot else {
                return;
            };
            let step = p.step;
            let stage = self.state.stage_of(step.epoch, step.phase, step.layer);
            let (tag, need) = self.state.inputs(step.phase, step.layer, stage);
            // With staleness or skipping a training pass keeps its blocks in the inbox (the
            // optimizer step holds them for the next epoch), and its last step waits until all
            // of them are in: the exchange overlaps the whole pass but ends with it. With
            // evaluation rows skipped an evaluation keeps its blocks for the next step too.
            let keep = self.state.keeps_blocks(step.phase);
            let last = step.phase == Phase::Backward && step.layer == 0 && stage == Stage::First;
            if keep && last && !self.epoch_blocks_in(step.epoch) {
                return;
            }
            // A stage that needs no blocks leaves the inbox alone (they may be another's).
            let blocks = if need.is_empty() {
                BTreeMap::new()
            } else {
                match self.state.held_inputs(step.epoch, step.phase, tag) {
                    Ok(Some(held)) => match need.iter().find(|q| !held.contains_key(q)) {
                        None => held,
                        Some(q) => {
                            let detail = format!(
                                "no halo block of epoch {} (layer tag {tag:#x}) from partition \
                                 {q} is held for {:?} step {} of epoch {}",
                                step.epoch - 1,
                                step.phase,
                                step.layer,
                                step.epoch
                            );
                            return self.fail_parked(ActorError::Protocol {
                                part: self.part.0,
                                detail,
                            });
                        }
                    },
                    Ok(None) => {
                        let key = (step.epoch, step.phase, tag);
                        let have = self.inbox.get(&key);
                        if !need.iter().all(|q| have.is_some_and(|m| m.contains_key(q))) {
                            return;
                        }
                        if !keep {
                            self.inbox.remove(&key).unwrap_or_default()
                        } else {
                            let have = have.cloned().unwrap_or_default();
                            match self.state.full_blocks(step.phase, tag, &have) {
                                Ok(full) => full,
                                Err(source) => {
                                    return self.fail_parked(ActorError::Compute {
                                        part: self.part.0,
                                        source,
                                    })
                                }
                            }
                        }
                    }
                    Err(source) => {
                        return self.fail_parked(ActorError::Compute {
                            part: self.part.0,
                            source,
                        })
                    }
                }
            };
            if !self.run_stage(step, stage, &blocks) {
                return;
            }
        }
    }

    /// Whether every training block of `epoch` this partition receives is in the inbox.
    fn epoch_blocks_in(&self, epoch: u32) -> bool {
        self.blocks_in(epoch, &self.state.epoch_inputs())
    }

    /// Whether every block of `inputs` (phase, layer tag, senders) of `epoch` is in the inbox.
    fn blocks_in(&self, epoch: u32, inputs: &[(Phase, u16, Vec<PartId>)]) -> bool {
        inputs.iter().all(|(phase, tag, from)| {
            let have = self.inbox.get(&(epoch, *phase, *tag));
            from.iter().all(|q| have.is_some_and(|m| m.contains_key(q)))
        })
    }

    /// The evaluation blocks of `epoch` in the inbox.
    fn eval_blocks(&self, epoch: u32) -> EpochBlocks {
        self.inbox
            .iter()
            .filter(|(k, _)| k.0 == epoch && k.1 == Phase::Eval)
            .map(|(k, by)| ((k.1, k.2), by.clone()))
            .collect()
    }

    /// The training blocks of `epoch` in the inbox (shared buffers: cheap copies).
    fn epoch_blocks(&self, epoch: u32) -> EpochBlocks {
        self.inbox
            .iter()
            .filter(|(k, _)| k.0 == epoch && k.1 != Phase::Eval)
            .map(|(k, by)| ((k.1, k.2), by.clone()))
            .collect()
    }

    /// The parked step fails with `error`.
    fn fail_parked(&mut self, error: ActorError) {
        if let StepSlot::Parked(p) = std::mem::replace(&mut self.slot, StepSlot::Idle) {
            self.answer(p.id, Err(error));
        }
    }

    /// Runs one stage of the parked step and queues its blocks; answers the step when it is
    /// done or failed. Returns whether the step goes on with its second stage.
    fn run_stage(
        &mut self,
        step: Step,
        stage: Stage,
        blocks: &BTreeMap<PartId, HaloBlock>,
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
        let second = stage == Stage::Second;
        let result = catch_unwind(AssertUnwindSafe(|| {
            if !second && step.layer == 0 && step.phase == Phase::Forward {
                if let Some(d) = faults.stall_due(part.0, step.epoch) {
                    // A hung kernel: the coordinator's deadline must turn it into an error.
                    std::thread::sleep(d);
                }
            }
            if let Some(message) =
                faults.panic_due(part.0, step.epoch, step.layer, step.phase, second)
            {
                // As a kernel interrupted half-way would, leave the replica partly
                // overwritten: only a real restore brings the committed state back.
                self.state.clobber_for_fault();
                std::panic::panic_any(message);
            }
            timed(|| {
                self.state
                    .run_stage(step.run, step.epoch, step.layer, step.phase, stage, blocks)
            })
        }));
        let kernels = self.state.stream().kernel_times().since(&before);
        let StepSlot::Parked(p) = &mut self.slot else {
            return false;
        };
        let id = p.id;
        match result {
            Ok((Ok((outcome, out)), ms)) => {
                p.compute_ms += ms;
                p.kernels.add(&kernels);
                for mut b in out {
                    let bytes = b.payload_bytes();
                    p.halo_bytes += bytes;
                    p.halo_fp32_bytes += b.raw_bytes();
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
                    telemetry::count_halo_send(part.0, to, bytes);
                    self.actions.push_back(PartitionAction::Send(b));
                }
                let Some(outcome) = outcome else {
                    return true;
                };
                if self.replicate && matches!(outcome, Outcome::CompressedGrads(_)) {
                    if let Some(held) = self.state.pending_residual(step.epoch) {
                        self.actions.push_back(PartitionAction::HoldResidual(held));
                    }
                }
                let StepSlot::Parked(p) = std::mem::replace(&mut self.slot, StepSlot::Idle) else {
                    return false;
                };
                let reply = StepReply {
                    part: part.0,
                    compute_ms: p.compute_ms,
                    halo_bytes: p.halo_bytes,
                    halo_fp32_bytes: p.halo_fp32_bytes,
                    kernels: p.kernels,
                    outcome,
                    restored: self.restored.take(),
                };
                self.answer(id, Ok(Response::Step(reply)));
            }
            Ok((Err(source), _)) => {
                self.slot = StepSlot::Idle;
                self.answer(
                    id,
                    Err(ActorError::Compute {
                        part: part.0,
                        source,
                    }),
                );
            }
            Err(panic) => {
                self.slot = StepSlot::Idle;
                self.panicked(id, panic);
            }
        }
        false
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
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

#[cfg(test)]
mod stale_tests;
#[cfg(test)]
mod tests;
