//! The epoch and recovery machine of the coordinator, free of I/O and clocks (quinn-proto
//! style): the shell feeds it the replies of partitions, the results of re-placements and the
//! current time, and executes the [`EpochAction`]s it returns. The async
//! [`Coordinator`](crate::Coordinator) and the deterministic simulator ([`crate::sim`]) are
//! both pumps around it.
//!
//! An epoch is three *units*, each a sequence of *rounds* (one request to every partition):
//! the training step (forward of layers `0..L`, backward of `L-1..=0`), the optimizer step
//! (`Apply`), and evaluation (forward of `0..L` without dropout). A failure anywhere in a unit
//! rolls the unit back: every partition is reset and the unit is replayed from its first
//! round (the states are in ARCHITECTURE.md, "Recovery"). With evaluation rows skipped
//! ([`EpochConfig::replays_eval`]) a fourth unit, the replay of the last evaluation, comes
//! before a training step that does not follow its epoch's evaluation directly.
use crate::profile::{EpochProfile, StepProfile};
pub use crate::protocol::messages::Applied;
use crate::{ActorError, Outcome, StepReply};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use trellis_runtime::report::BestTracker;
use trellis_runtime::EpochLog;
use trellis_transport::Phase;

/// Identifies one request, so that a reply to a request of a rolled-back round is recognised
/// and dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// What the coordinator asks of a partition.
#[derive(Debug, Clone)]
pub enum Request {
    /// Run one layer of a pass.
    Step { layer: u16, phase: Phase },
    /// Apply the all-reduced gradients.
    Apply { grads: Arc<[f32]> },
    /// Drop the epoch in progress (before a replay). `rollback`: the training step is
    /// replayed, so a partition that already applied the epoch's optimizer step goes back to
    /// the committed state before it (a node lost during the optimizer step took the state
    /// its partitions' step needs: the step is replayed with its training pass).
    Reset { rollback: bool },
}

/// A request to send to one partition.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub id: RequestId,
    pub part: u32,
    pub epoch: u32,
    pub request: Request,
}

/// A partition's answer to a [`Request`].
#[derive(Debug, Clone)]
pub enum Response {
    Step(StepReply),
    Applied(Applied),
    ResetDone,
}

/// The global sizes of the training, validation and test splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SplitTotals {
    pub train: usize,
    pub val: usize,
    pub test: usize,
}

/// How many restarts a partition may have within a window of epochs before the failure
/// escalates to the coordinator (which moves the partition to another node, in a cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// The fixed settings of a run.
#[derive(Debug, Clone)]
pub struct EpochConfig {
    pub parts: u32,
    pub layers: u16,
    /// The last epoch to run.
    pub epochs: u32,
    /// Longest wait for any one round (or reset) before it fails as a timeout.
    pub deadline: Duration,
    /// Recoveries (restarts, re-placements, replays) the whole run may perform.
    pub max_recoveries: u32,
    pub policy: RestartPolicy,
    /// A missed deadline is a lost message: reset and replay (clusters) instead of failing.
    pub retry_timeouts: bool,
    /// A lost node's partitions are re-placed (clusters) instead of failing the run.
    pub node_recovery: bool,
    /// Write a checkpoint every K committed epochs (and after the last).
    pub checkpoint_every: Option<u32>,
    /// Each epoch waits for the shell's [`EpochMachine::handle_gate`].
    pub gated: bool,
    pub totals: SplitTotals,
    /// Evaluation rows are skipped (`--eval-skip-threshold`): what an evaluation sent and
    /// received is state its partitions keep until the next optimizer step, which a
    /// re-placed or resumed partition lacks. A training step after a re-placement, and the
    /// first after a resume, is then preceded by a replay of the last epoch's evaluation (its
    /// counts checked against the first run's).
    pub replays_eval: bool,
}

/// The last committed optimizer step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Committed {
    pub epoch: u32,
    /// Weights digest after it (empty before the first step of a fresh run).
    pub digest: String,
}

/// A recovery the coordinator performed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Recovery {
    /// `actor-panic`, `node-loss`, `timeout` or `escalated-move`.
    pub kind: String,
    pub partition: u32,
    /// The node lost (node-loss recoveries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// Partitions re-placed, with the node each now runs on (node-loss recoveries).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replaced: Vec<(u32, u32)>,
    /// Whether the state the partition resumed from has the weights digest the coordinator
    /// committed for that step (`None` when nothing was restored, e.g. a replayed timeout).
    #[serde(default)]
    pub digest_ok: Option<bool>,
    pub epoch: u32,
    /// From the failed unit's start to the failure report, ms.
    pub detected_ms: f64,
    /// From the failure report until the replay could start (restart or re-placement,
    /// restore, epoch reset), ms.
    #[serde(default)]
    pub ready_ms: f64,
    /// From the failure report to the replayed unit completing, ms.
    pub resumed_ms: f64,
    pub steps_replayed: u32,
}

/// What a re-placement produced (the shell points its handles at the new places).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// (partition, node it now runs on).
    pub moves: Vec<(u32, u32)>,
    /// Whether every adopted state matched the committed digest.
    pub digest_ok: bool,
}

/// What the shell must do.
#[derive(Debug)]
pub enum EpochAction {
    /// Wait for the pacing gate, then call [`EpochMachine::handle_gate`].
    WaitGate { epoch: u32 },
    /// Epoch `epoch` starts (hooks: advance a transport's stale-epoch filter, open spans).
    EpochStarted { epoch: u32 },
    /// Send a request; its answer goes to [`EpochMachine::handle_response`].
    Send(Outgoing),
    /// A failure was detected: cancel the kernels partitions of this process are running.
    CancelRunning,
    /// Re-place the partitions of lost node `node` on nodes holding their replicas, then call
    /// [`EpochMachine::handle_placement`].
    ReplaceNode { node: u32, committed: Committed },
    /// Move partition `part` (it keeps failing where it runs), then call
    /// [`EpochMachine::handle_placement`].
    MovePartition { part: u32, committed: Committed },
    /// A recovery began (for its span and the restart counter).
    RecoveryStarted {
        kind: &'static str,
        part: u32,
        epoch: u32,
        detected_ms: f64,
    },
    /// The replayed unit completed: the recovery is done.
    Recovered(Recovery),
    /// Where a training step's time went.
    Profile(EpochProfile),
    /// The optimizer step of `epoch` was committed with this digest; `step_ms` is the whole
    /// training step (forward, backward, all-reduce and optimizer), `apply_ms` its all-reduce.
    Committed {
        epoch: u32,
        digest: String,
        step_ms: f64,
        apply_ms: f64,
    },
    /// An epoch finished (training step and evaluation).
    EpochDone(EpochLog),
    /// Write a durable checkpoint of the committed state.
    Checkpoint {
        epoch: u32,
        digest: String,
        logs: Vec<EpochLog>,
    },
    /// The run is over.
    Finished(EpochsDone),
    /// The run failed.
    Failed(ActorError),
}

/// What a run of epochs produced.
#[derive(Debug)]
pub struct EpochsDone {
    pub logs: Vec<EpochLog>,
    pub best: BestTracker,
    pub digest: String,
}

/// The units of an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    TrainStep,
    Apply,
    Eval,
    /// The evaluation of the epoch before the one in progress, replayed before its training
    /// step to rebuild the partitions' evaluation halo state ([`EpochConfig::replays_eval`]).
    EvalReplay,
}

/// What a unit has gathered so far (dropped when it is rolled back).
#[derive(Debug, Default)]
struct UnitWork {
    compute_ms: Vec<f64>,
    halo_bytes: u64,
    grad_bytes: GradBytes,
    halo_fp32_bytes: u64,
    loss_sum: f64,
    count: usize,
    grads: Vec<Option<Arc<[f32]>>>,
    profile: Option<EpochProfile>,
    eval: SplitTotals,
    /// An evaluation's halo bytes, as sent and as fp32.
    eval_halo_bytes: u64,
    eval_halo_fp32_bytes: u64,
}

/// Gradient bytes of a training step, as sent and as they would have been exact.
#[derive(Debug, Default, Clone, Copy)]
struct GradBytes {
    sent: u64,
    exact: u64,
}

/// The gathered results of the training step of the epoch in progress.
#[derive(Debug, Default, Clone)]
struct StepResults {
    compute_ms: Vec<f64>,
    halo_bytes: u64,
    grad_bytes: GradBytes,
    halo_fp32_bytes: u64,
    loss_sum: f64,
    count: usize,
    grads: Option<Arc<[f32]>>,
    digest: String,
    step_ms: f64,
    /// Replication's cost on the critical path (slowest partition, every attempt of the
    /// optimizer step) and the bytes shipped.
    replica_ms: f64,
    replica_bytes: u64,
}

/// One request to every partition, waiting for their replies.
#[derive(Debug)]
struct Round {
    /// Index into the unit's rounds.
    index: usize,
    request: Request,
    outstanding: BTreeMap<u32, RequestId>,
    replies: Vec<Option<Response>>,
    started: Instant,
    deadline: Instant,
    /// The first failure that does not abort the round at once.
    failure: Option<ActorError>,
}

/// A failure being recovered from, until the replayed unit completes.
#[derive(Debug)]
struct OpenRecovery {
    kind: &'static str,
    part: u32,
    node: Option<u32>,
    moves: Vec<(u32, u32)>,
    digest_ok: Option<bool>,
    detected_ms: f64,
    at: Instant,
    ready_ms: f64,
}

/// Where the machine is.
#[derive(Debug)]
enum State {
    /// Not started yet.
    Idle,
    /// Waiting for the gate before epoch `epoch`.
    Gate { epoch: u32 },
    /// A round of a unit is in flight.
    Running { unit: Unit, round: Round },
    /// Every partition is being reset before the unit is replayed.
    Resetting {
        unit: Unit,
        outstanding: BTreeMap<u32, RequestId>,
        deadline: Instant,
    },
    /// Waiting for the shell to re-place partitions (`handle_placement`).
    Placing {
        unit: Unit,
        kind: &'static str,
        part: u32,
        node: Option<u32>,
        detected_ms: f64,
        at: Instant,
    },
    /// Finished or failed; no more actions.
    Over,
}

/// The coordinator's epoch protocol and recovery policy as a pure state machine.
#[derive(Debug)]
pub struct EpochMachine {
    cfg: EpochConfig,
    state: State,
    actions: VecDeque<EpochAction>,
    next_id: u64,
    /// The epoch in progress.
    epoch: u32,
    committed: Committed,
    /// The weights digest every partition starts from (the state a restore before the first
    /// optimizer step must match), recorded by the shell from the configuration.
    initial_digest: Option<String>,
    /// Epochs done (including those before a resume), their logs and the best so far.
    logs: Vec<EpochLog>,
    best: BestTracker,
    /// Recoveries performed so far (the budget is for the whole run).
    recoveries_used: u32,
    /// (partition, epoch) of every restart, for the restart policy.
    restart_log: Vec<(u32, u32)>,
    open: Vec<OpenRecovery>,
    /// When the epoch's training step started, and when the unit in progress started.
    epoch_started: Option<Instant>,
    unit_started: Option<Instant>,
    work: UnitWork,
    step: StepResults,
    apply_started: Option<Instant>,
    eval_started: Option<Instant>,
    /// Restores reported by restarted partitions since the last completed unit:
    /// (partition, epoch restored, digest restored).
    restores: Vec<(u32, u32, String)>,
    /// Replies that arrived for requests no longer outstanding (rolled back, duplicated).
    stale_replies: u64,
    recoveries: Vec<Recovery>,
    /// When partitions' failures happened, as their shells observed them (a detection is
    /// timed from there rather than from the start of the round).
    failure_times: BTreeMap<u32, Instant>,
    /// The next training step is preceded by an [`Unit::EvalReplay`].
    eval_replay_due: bool,
}

impl EpochMachine {
    /// A machine that will run epochs `committed.epoch + 1 ..= cfg.epochs`, continuing after
    /// `prior` (the logs of the epochs before a resume).
    pub fn new(cfg: EpochConfig, committed: Committed, prior: Vec<EpochLog>) -> Self {
        let mut best = BestTracker::default();
        for log in &prior {
            best.update(log);
        }
        // A resume: the partitions restored the committed step, not its evaluation's state.
        let eval_replay_due = committed.epoch > 0;
        EpochMachine {
            state: State::Idle,
            actions: VecDeque::new(),
            next_id: 0,
            epoch: committed.epoch,
            committed,
            initial_digest: None,
            logs: prior,
            best,
            recoveries_used: 0,
            restart_log: Vec::new(),
            open: Vec::new(),
            epoch_started: None,
            unit_started: None,
            work: UnitWork::default(),
            step: StepResults::default(),
            apply_started: None,
            eval_started: None,
            restores: Vec::new(),
            stale_replies: 0,
            recoveries: Vec::new(),
            failure_times: BTreeMap::new(),
            eval_replay_due,
            cfg,
        }
    }

    /// Records the weights digest of the initial state (restores before the first optimizer
    /// step are checked against it).
    pub fn with_initial_digest(mut self, digest: String) -> Self {
        self.initial_digest = Some(digest);
        self
    }

    /// Starts the run.
    pub fn start(&mut self, now: Instant) {
        if matches!(self.state, State::Idle) {
            self.begin_epoch(self.committed.epoch + 1, now);
        }
    }

    /// The next action to execute.
    pub fn poll_action(&mut self) -> Option<EpochAction> {
        self.actions.pop_front()
    }

    /// When [`EpochMachine::handle_timeout`] must be called if nothing else happens first.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Running { round, .. } => Some(round.deadline),
            State::Resetting { deadline, .. } => Some(*deadline),
            _ => None,
        }
    }

    /// Whether the run is over (finished or failed).
    pub fn is_over(&self) -> bool {
        matches!(self.state, State::Over)
    }

    /// The last committed step.
    pub fn committed(&self) -> &Committed {
        &self.committed
    }

    /// The epoch in progress (the last one started).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Recoveries completed so far.
    pub fn recoveries(&self) -> &[Recovery] {
        &self.recoveries
    }

    /// Replies dropped because their request was no longer outstanding.
    pub fn stale_replies(&self) -> u64 {
        self.stale_replies
    }

    /// The gate opened (`true`: run the epoch) or closed (`false`: end the run here).
    pub fn handle_gate(&mut self, open: bool, now: Instant) {
        if let State::Gate { epoch } = self.state {
            if open {
                self.start_epoch(epoch, now);
            } else {
                self.finish();
            }
        }
    }

    /// The run is cancelled (Ctrl-C).
    pub fn handle_cancel(&mut self) {
        if !self.is_over() {
            self.fail(ActorError::Cancelled);
        }
    }

    /// Partition `part` failed at `at` (its shell saw the panic then); the failure's reply
    /// follows, and its detection is timed from `at`.
    pub fn handle_failure_time(&mut self, part: u32, at: Instant) {
        self.failure_times.insert(part, at);
    }

    /// A partition answered request `id`.
    pub fn handle_response(
        &mut self,
        id: RequestId,
        part: u32,
        result: Result<Response, ActorError>,
        now: Instant,
    ) {
        match &mut self.state {
            State::Running { unit, round } if round.outstanding.get(&part) == Some(&id) => {
                let unit = *unit;
                round.outstanding.remove(&part);
                match result {
                    Ok(r) => {
                        let restored = match &r {
                            Response::Step(s) => s.restored.as_ref(),
                            Response::Applied(a) => a.restored.as_ref(),
                            Response::ResetDone => None,
                        };
                        if let Some(rest) = restored {
                            self.restores.push((part, rest.epoch, rest.digest.clone()));
                        }
                        round.replies[part as usize] = Some(r);
                    }
                    // A panic or a lost node is acted on at once: other partitions may wait for
                    // blocks the failed one never sent, and the reset answers them.
                    Err(e @ (ActorError::Node { .. } | ActorError::Panicked { .. })) => {
                        let from = match self.failure_times.remove(&part) {
                            Some(at) if matches!(e, ActorError::Panicked { .. }) => {
                                at.max(round.started)
                            }
                            _ => round.started,
                        };
                        let detected = ms_since(from, now);
                        return self.unit_failed(unit, e, detected, now);
                    }
                    Err(e) => {
                        if round.failure.is_none() {
                            round.failure = Some(e);
                        }
                    }
                }
                if round.outstanding.is_empty() {
                    self.round_complete(now);
                }
            }
            State::Resetting {
                unit, outstanding, ..
            } if outstanding.get(&part) == Some(&id) => {
                let unit = *unit;
                outstanding.remove(&part);
                if let Err(e) = result {
                    // A failure met while recovering is recovered from like any other.
                    return self.unit_failed(unit, e, 0.0, now);
                }
                if outstanding.is_empty() {
                    self.reset_complete(unit, now);
                }
            }
            _ => self.stale_replies += 1,
        }
    }

    /// Time passed; fails the round (or reset) in flight if its deadline is over.
    pub fn handle_timeout(&mut self, now: Instant) {
        let (unit, part, what, started) = match &self.state {
            State::Running { unit, round } if now >= round.deadline => {
                let part = round.outstanding.keys().next().copied().unwrap_or(0);
                let what = match &round.request {
                    Request::Step { layer, phase } if *unit == Unit::EvalReplay => format!(
                        "{phase:?} layer {layer} of epoch {} (replayed)",
                        self.unit_epoch(*unit)
                    ),
                    Request::Step { layer, phase } => {
                        format!("{phase:?} layer {layer} of epoch {}", self.epoch)
                    }
                    Request::Apply { .. } => "optimizer step".to_string(),
                    Request::Reset { .. } => format!("reset of epoch {}", self.epoch),
                };
                (*unit, part, what, round.started)
            }
            State::Resetting {
                unit,
                outstanding,
                deadline,
            } if now >= *deadline => {
                let part = outstanding.keys().next().copied().unwrap_or(0);
                let started = deadline.checked_sub(self.cfg.deadline).unwrap_or(now);
                (
                    *unit,
                    part,
                    format!("reset of epoch {}", self.epoch),
                    started,
                )
            }
            _ => return,
        };
        let e = ActorError::Timeout {
            part,
            ms: self.cfg.deadline.as_millis() as u64,
            what,
        };
        self.unit_failed(unit, e, ms_since(started, now), now);
    }

    /// The shell re-placed partitions (after [`EpochAction::ReplaceNode`] or
    /// [`EpochAction::MovePartition`]), or failed to.
    pub fn handle_placement(&mut self, result: Result<Placement, ActorError>, now: Instant) {
        let State::Placing {
            unit,
            kind,
            part,
            node,
            detected_ms,
            at,
        } = self.state
        else {
            return;
        };
        match result {
            Ok(p) => {
                if kind == "escalated-move" {
                    self.restart_log.retain(|(q, _)| *q != part);
                }
                let part = if kind == "node-loss" {
                    p.moves.first().map_or(part, |m| m.0)
                } else {
                    part
                };
                let rec = OpenRecovery {
                    kind,
                    part,
                    node,
                    moves: p.moves,
                    digest_ok: Some(p.digest_ok),
                    detected_ms,
                    at,
                    ready_ms: 0.0,
                };
                // A re-placed partition lacks what its optimizer step needs besides the
                // all-reduced sum (the halo rows it received for the next epoch, its skip
                // records, its residual): they went with its node. The step is replayed with
                // its training pass, every partition rolled back to the committed state.
                let unit = if unit == Unit::Apply {
                    Unit::TrainStep
                } else {
                    unit
                };
                // Nor has it what the epoch's evaluation sent and received, if that is
                // kept: the evaluation is replayed first.
                if unit != Unit::Eval {
                    self.eval_replay_due = true;
                }
                self.begin_reset(unit, rec, now);
            }
            // The node chosen to adopt was lost too: recover from that.
            Err(e @ ActorError::Node { .. }) => {
                let ms = ms_since(at, now);
                self.unit_failed(unit, e, ms, now);
            }
            Err(e) => self.fail(e),
        }
    }

    fn next_id(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id)
    }

    fn begin_epoch(&mut self, epoch: u32, now: Instant) {
        if epoch > self.cfg.epochs {
            return self.finish();
        }
        if self.cfg.gated {
            self.state = State::Gate { epoch };
            self.actions.push_back(EpochAction::WaitGate { epoch });
        } else {
            self.start_epoch(epoch, now);
        }
    }

    fn start_epoch(&mut self, epoch: u32, now: Instant) {
        self.epoch = epoch;
        self.actions.push_back(EpochAction::EpochStarted { epoch });
        self.epoch_started = Some(now);
        self.step = StepResults::default();
        self.start_training(now);
    }

    /// Starts (or replays) the training step, after the replay of the last evaluation where
    /// one is due ([`EpochConfig::replays_eval`]).
    fn start_training(&mut self, now: Instant) {
        let replay = std::mem::take(&mut self.eval_replay_due);
        if replay && self.cfg.replays_eval && self.epoch > 1 {
            self.start_unit(Unit::EvalReplay, now);
        } else {
            self.start_unit(Unit::TrainStep, now);
        }
    }

    /// The rounds of a unit, in order.
    fn round_request(&self, unit: Unit, index: usize) -> Option<Request> {
        let l = self.cfg.layers as usize;
        match unit {
            Unit::TrainStep if index < l => Some(Request::Step {
                layer: index as u16,
                phase: Phase::Forward,
            }),
            Unit::TrainStep if index < 2 * l => Some(Request::Step {
                layer: (2 * l - 1 - index) as u16,
                phase: Phase::Backward,
            }),
            Unit::Apply if index == 0 => Some(Request::Apply {
                grads: self
                    .step
                    .grads
                    .clone()
                    .unwrap_or_else(|| Arc::from(Vec::new())),
            }),
            Unit::Eval | Unit::EvalReplay if index < l => Some(Request::Step {
                layer: index as u16,
                phase: Phase::Eval,
            }),
            _ => None,
        }
    }

    fn start_unit(&mut self, unit: Unit, now: Instant) {
        let p = self.cfg.parts as usize;
        self.unit_started = Some(now);
        self.work = UnitWork {
            compute_ms: vec![0.0; p],
            grads: vec![None; p],
            profile: (unit == Unit::TrainStep).then(|| EpochProfile::new(self.epoch)),
            ..UnitWork::default()
        };
        match unit {
            Unit::Apply => self.apply_started = Some(now),
            Unit::Eval => self.eval_started = Some(now),
            Unit::TrainStep | Unit::EvalReplay => {}
        }
        self.send_round(unit, 0, now);
    }

    /// The epoch a unit's requests name: a replayed evaluation is the previous epoch's.
    fn unit_epoch(&self, unit: Unit) -> u32 {
        match unit {
            Unit::EvalReplay => self.epoch - 1,
            _ => self.epoch,
        }
    }

    fn send_round(&mut self, unit: Unit, index: usize, now: Instant) {
        let Some(request) = self.round_request(unit, index) else {
            return self.unit_complete(unit, now);
        };
        let outstanding = self.broadcast(&request, self.unit_epoch(unit));
        self.state = State::Running {
            unit,
            round: Round {
                index,
                request,
                outstanding,
                replies: vec![None; self.cfg.parts as usize],
                started: now,
                deadline: now + self.cfg.deadline,
                failure: None,
            },
        };
    }

    /// Sends `request` of `epoch` to every partition; returns the id outstanding for each.
    fn broadcast(&mut self, request: &Request, epoch: u32) -> BTreeMap<u32, RequestId> {
        let mut outstanding = BTreeMap::new();
        for part in 0..self.cfg.parts {
            let id = self.next_id();
            outstanding.insert(part, id);
            self.actions.push_back(EpochAction::Send(Outgoing {
                id,
                part,
                epoch,
                request: request.clone(),
            }));
        }
        outstanding
    }

    fn round_complete(&mut self, now: Instant) {
        let State::Running { unit, round } = std::mem::replace(&mut self.state, State::Over) else {
            return;
        };
        if let Some(e) = round.failure {
            let ms = ms_since(round.started, now);
            return self.unit_failed(unit, e, ms, now);
        }
        let wall_ms = ms_since(round.started, now);
        let mut steps = Vec::with_capacity(round.replies.len());
        let mut digests = Vec::new();
        let (mut replica_ms, mut replica_bytes) = (0.0f64, 0u64);
        for (part, r) in round.replies.into_iter().enumerate() {
            match r {
                Some(Response::Step(s)) => steps.push(s),
                Some(Response::Applied(a)) => {
                    replica_ms = replica_ms.max(a.replica.ms);
                    replica_bytes += a.replica.bytes;
                    digests.push(a.digest)
                }
                Some(Response::ResetDone) | None => {
                    return self.fail(ActorError::Protocol {
                        part: part as u32,
                        detail: "answered a round with the wrong kind of reply".into(),
                    })
                }
            }
        }
        match round.request {
            Request::Step { layer, phase } => {
                for s in &steps {
                    let q = s.part as usize;
                    if phase != Phase::Eval {
                        if let Some(c) = self.work.compute_ms.get_mut(q) {
                            *c += s.compute_ms;
                        }
                        self.work.halo_bytes += s.halo_bytes;
                        self.work.halo_fp32_bytes += s.halo_fp32_bytes;
                    } else {
                        self.work.eval_halo_bytes += s.halo_bytes;
                        self.work.eval_halo_fp32_bytes += s.halo_fp32_bytes;
                    }
                    match &s.outcome {
                        Outcome::Loss {
                            loss_sum, count, ..
                        } => {
                            self.work.loss_sum += loss_sum;
                            self.work.count += count;
                        }
                        Outcome::Grads(g) => {
                            self.work.grad_bytes.sent += 4 * g.len() as u64;
                            self.work.grad_bytes.exact += 4 * g.len() as u64;
                            if let Some(slot) = self.work.grads.get_mut(q) {
                                *slot = Some(g.clone());
                            }
                        }
                        // Decoded here, before the fixed-order sum.
                        Outcome::CompressedGrads(c) => {
                            self.work.grad_bytes.sent += c.wire_bytes();
                            self.work.grad_bytes.exact += c.exact_bytes();
                            match c.decode() {
                                Ok(g) => {
                                    if let Some(slot) = self.work.grads.get_mut(q) {
                                        *slot = Some(Arc::from(g));
                                    }
                                }
                                Err(e) => {
                                    return self.fail(ActorError::Protocol {
                                        part: q as u32,
                                        detail: e.to_string(),
                                    })
                                }
                            }
                        }
                        Outcome::Eval { train, val, test } => {
                            self.work.eval.train += train;
                            self.work.eval.val += val;
                            self.work.eval.test += test;
                        }
                        Outcome::LayerDone => {}
                    }
                }
                if let Some(p) = &mut self.work.profile {
                    p.steps
                        .push(StepProfile::new(phase, layer, wall_ms, &steps));
                }
            }
            Request::Apply { .. } => {
                // Every replica must hold the same weights after the step.
                let want = digests.first().cloned().unwrap_or_default();
                if let Some((q, got)) = digests.iter().enumerate().find(|(_, d)| **d != want) {
                    return self.fail(ActorError::Diverged {
                        epoch: self.epoch,
                        part: q as u32,
                        got: got.clone(),
                        want,
                    });
                }
                self.step.digest = want;
                self.step.replica_ms += replica_ms;
                self.step.replica_bytes += replica_bytes;
            }
            Request::Reset { .. } => {}
        }
        self.send_round(unit, round.index + 1, now);
    }

    fn unit_complete(&mut self, unit: Unit, now: Instant) {
        // A replayed evaluation is only the way back to the training step: the recoveries
        // close with that.
        if unit != Unit::EvalReplay {
            self.close_recoveries(now);
        }
        match unit {
            Unit::EvalReplay => self.eval_replayed(now),
            Unit::TrainStep => {
                // All-reduce in a fixed order: partition 0, 1, ..., so the sum never depends
                // on timing.
                let mut sum: Vec<f32> = Vec::new();
                for (q, g) in self.work.grads.iter().enumerate() {
                    let Some(g) = g else {
                        return self.fail(ActorError::Protocol {
                            part: q as u32,
                            detail: "no gradients".into(),
                        });
                    };
                    if sum.is_empty() {
                        sum = g.to_vec();
                    } else if sum.len() != g.len() {
                        return self.fail(ActorError::Protocol {
                            part: q as u32,
                            detail: format!(
                                "{} gradients, partition 0 sent {}",
                                g.len(),
                                sum.len()
                            ),
                        });
                    } else {
                        sum.iter_mut().zip(g.iter()).for_each(|(s, v)| *s += v);
                    }
                }
                self.step.compute_ms = std::mem::take(&mut self.work.compute_ms);
                self.step.halo_bytes = self.work.halo_bytes;
                self.step.grad_bytes = self.work.grad_bytes;
                self.step.halo_fp32_bytes = self.work.halo_fp32_bytes;
                self.step.loss_sum = self.work.loss_sum;
                self.step.count = self.work.count;
                self.step.grads = Some(Arc::from(sum));
                if let Some(p) = self.work.profile.take() {
                    self.actions.push_back(EpochAction::Profile(p));
                }
                self.start_unit(Unit::Apply, now);
            }
            Unit::Apply => {
                let digest = self.step.digest.clone();
                self.committed = Committed {
                    epoch: self.epoch,
                    digest: digest.clone(),
                };
                let step_ms = self.epoch_started.map_or(0.0, |t| ms_since(t, now));
                let apply_ms = self.apply_started.map_or(0.0, |t| ms_since(t, now));
                self.step.step_ms = step_ms;
                self.actions.push_back(EpochAction::Committed {
                    epoch: self.epoch,
                    digest,
                    step_ms,
                    apply_ms,
                });
                self.start_unit(Unit::Eval, now);
            }
            Unit::Eval => {
                let eval_ms = self.eval_started.map_or(0.0, |t| ms_since(t, now));
                let t = self.cfg.totals;
                let e = self.work.eval;
                let frac = |n: usize, d: usize| if d == 0 { 0.0 } else { n as f64 / d as f64 };
                let s = std::mem::take(&mut self.step);
                let compute_ms = s.compute_ms.iter().cloned().fold(0.0, f64::max);
                let log = EpochLog {
                    epoch: self.epoch,
                    loss: s.loss_sum / s.count.max(1) as f64,
                    train_acc: frac(e.train, t.train),
                    val_acc: frac(e.val, t.val),
                    test_acc: frac(e.test, t.test),
                    ms: s.step_ms,
                    eval_ms,
                    compute_ms,
                    comm_ms: (s.step_ms - compute_ms).max(0.0),
                    halo_bytes: s.halo_bytes,
                    grad_bytes: s.grad_bytes.sent,
                    grad_bytes_exact: s.grad_bytes.exact,
                    halo_fp32_bytes: s.halo_fp32_bytes,
                    eval_halo_bytes: self.work.eval_halo_bytes,
                    eval_halo_fp32_bytes: self.work.eval_halo_fp32_bytes,
                    weights_digest: self.committed.digest.clone(),
                    part_compute_ms: s.compute_ms,
                    replica_bytes: s.replica_bytes,
                    replica_ms: s.replica_ms,
                };
                self.best.update(&log);
                self.logs.push(log.clone());
                self.actions.push_back(EpochAction::EpochDone(log));
                if let Some(every) = self.cfg.checkpoint_every.filter(|k| *k > 0) {
                    if self.epoch.is_multiple_of(every) || self.epoch == self.cfg.epochs {
                        self.actions.push_back(EpochAction::Checkpoint {
                            epoch: self.epoch,
                            digest: self.committed.digest.clone(),
                            logs: self.logs.clone(),
                        });
                    }
                }
                self.begin_epoch(self.epoch + 1, now);
            }
        }
    }

    /// The last evaluation was replayed: its counts must be the first run's (every value is
    /// a pure function of the committed weights and the evaluation state committed before
    /// it); then the training step runs.
    fn eval_replayed(&mut self, now: Instant) {
        let t = self.cfg.totals;
        let e = self.work.eval;
        let frac = |n: usize, d: usize| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        let epoch = self.epoch - 1;
        if let Some(first) = self.logs.iter().rev().find(|l| l.epoch == epoch) {
            let replay = (
                frac(e.train, t.train),
                frac(e.val, t.val),
                frac(e.test, t.test),
            );
            if replay != (first.train_acc, first.val_acc, first.test_acc) {
                let show = |(a, b, c): (f64, f64, f64)| format!("{a:.6}/{b:.6}/{c:.6}");
                return self.fail(ActorError::EvalReplayDiffers {
                    epoch,
                    first: show((first.train_acc, first.val_acc, first.test_acc)),
                    replay: show(replay),
                });
            }
        }
        self.start_unit(Unit::TrainStep, now);
    }

    /// Closes the recoveries of the unit that just completed (its replay succeeded).
    fn close_recoveries(&mut self, now: Instant) {
        let replayed = self.open.len() as u32;
        let restores = std::mem::take(&mut self.restores);
        for o in std::mem::take(&mut self.open) {
            let digest_ok = match o.kind {
                // The restarted partition's restored state against the digest this machine
                // committed (another party than the replica that stored it).
                "actor-panic" => restores
                    .iter()
                    .rev()
                    .find(|r| r.0 == o.part)
                    .map(|(_, epoch, digest)| self.restore_matches(*epoch, digest))
                    .or(o.digest_ok),
                _ => o.digest_ok,
            };
            let rec = Recovery {
                kind: o.kind.into(),
                partition: o.part,
                node: o.node,
                replaced: o.moves,
                digest_ok,
                epoch: self.epoch,
                detected_ms: o.detected_ms,
                ready_ms: o.ready_ms,
                resumed_ms: ms_since(o.at, now),
                steps_replayed: replayed,
            };
            self.recoveries.push(rec.clone());
            self.actions.push_back(EpochAction::Recovered(rec));
        }
    }

    /// Whether a state restored at step `epoch` with `digest` is the committed one.
    fn restore_matches(&self, epoch: u32, digest: &str) -> bool {
        if epoch == self.committed.epoch && !self.committed.digest.is_empty() {
            return digest == self.committed.digest;
        }
        epoch == 0 && self.committed.epoch == 0 && self.initial_digest.as_deref() == Some(digest)
    }

    /// A unit failed with `err`: decide, by the restart policy and the budget, whether and how
    /// to recover.
    fn unit_failed(&mut self, unit: Unit, err: ActorError, detected_ms: f64, now: Instant) {
        self.recoveries_used += 1;
        // Whatever failed, the unit in progress is rolled back: stop this process's partitions
        // from computing it while the failed part is replaced.
        self.actions.push_back(EpochAction::CancelRunning);
        let over_budget = self.recoveries_used > self.cfg.max_recoveries;
        let epoch = self.epoch;
        match err {
            ActorError::Panicked { part, message } => {
                if over_budget {
                    return self.fail(ActorError::RestartsExhausted {
                        part,
                        restarts: self.recoveries_used - 1,
                        last: message,
                    });
                }
                self.restart_log.push((part, epoch));
                let since = epoch.saturating_sub(self.cfg.policy.window_epochs);
                let recent = self
                    .restart_log
                    .iter()
                    .filter(|(p, e)| *p == part && *e > since)
                    .count() as u32;
                if recent > self.cfg.policy.max_restarts {
                    if !self.cfg.node_recovery {
                        return self.fail(ActorError::RestartsExhausted {
                            part,
                            restarts: recent - 1,
                            last: message,
                        });
                    }
                    // Escalate: the partition keeps failing where it is; move it.
                    self.start_placing(unit, "escalated-move", part, None, detected_ms, now);
                    self.actions.push_back(EpochAction::MovePartition {
                        part,
                        committed: self.committed.clone(),
                    });
                } else {
                    let rec = OpenRecovery::restart("actor-panic", part, detected_ms, now);
                    self.begin_reset(unit, rec, now);
                }
            }
            ActorError::Node { node, detail } if self.cfg.node_recovery => {
                if over_budget {
                    return self.fail(ActorError::Node { node, detail });
                }
                self.start_placing(unit, "node-loss", u32::MAX, Some(node), detected_ms, now);
                self.actions.push_back(EpochAction::ReplaceNode {
                    node,
                    committed: self.committed.clone(),
                });
            }
            ActorError::Timeout { part, ms, what } if self.cfg.retry_timeouts => {
                if over_budget {
                    return self.fail(ActorError::Timeout { part, ms, what });
                }
                let rec = OpenRecovery::restart("timeout", part, detected_ms, now);
                self.begin_reset(unit, rec, now);
            }
            other => self.fail(other),
        }
    }

    fn start_placing(
        &mut self,
        unit: Unit,
        kind: &'static str,
        part: u32,
        node: Option<u32>,
        detected_ms: f64,
        now: Instant,
    ) {
        self.actions.push_back(EpochAction::RecoveryStarted {
            kind,
            part,
            epoch: self.epoch,
            detected_ms,
        });
        self.state = State::Placing {
            unit,
            kind,
            part,
            node,
            detected_ms,
            at: now,
        };
    }

    /// Resets every partition before replaying `unit`.
    fn begin_reset(&mut self, unit: Unit, rec: OpenRecovery, now: Instant) {
        if rec.kind != "node-loss" && rec.kind != "escalated-move" {
            self.actions.push_back(EpochAction::RecoveryStarted {
                kind: rec.kind,
                part: rec.part,
                epoch: self.epoch,
                detected_ms: rec.detected_ms,
            });
        }
        self.open.push(rec);
        let rollback = matches!(unit, Unit::TrainStep | Unit::EvalReplay);
        let outstanding = self.broadcast(&Request::Reset { rollback }, self.epoch);
        self.state = State::Resetting {
            unit,
            outstanding,
            deadline: now + self.cfg.deadline,
        };
    }

    fn reset_complete(&mut self, unit: Unit, now: Instant) {
        if let Some(o) = self.open.last_mut() {
            o.ready_ms = ms_since(o.at, now);
        }
        match unit {
            Unit::TrainStep => self.start_training(now),
            Unit::EvalReplay => {
                self.eval_replay_due = true;
                self.start_training(now)
            }
            _ => self.start_unit(unit, now),
        }
    }

    fn finish(&mut self) {
        self.state = State::Over;
        self.actions.push_back(EpochAction::Finished(EpochsDone {
            logs: std::mem::take(&mut self.logs),
            best: self.best.clone(),
            digest: self.committed.digest.clone(),
        }));
    }

    fn fail(&mut self, e: ActorError) {
        self.state = State::Over;
        self.actions.push_back(EpochAction::Failed(e));
    }
}

impl OpenRecovery {
    /// A recovery that restarts `part` where it runs (a panic, a missed deadline).
    fn restart(kind: &'static str, part: u32, detected_ms: f64, at: Instant) -> Self {
        OpenRecovery {
            kind,
            part,
            node: None,
            moves: Vec::new(),
            digest_ok: None,
            detected_ms,
            at,
            ready_ms: 0.0,
        }
    }
}

fn ms_since(t: Instant, now: Instant) -> f64 {
    now.saturating_duration_since(t).as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests;
