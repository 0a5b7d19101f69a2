//! The cluster session, as two pure machines: [`CoordinatorSession`] (the coordinator node's
//! side: join, setup, train, finish, fencing) and [`WorkerSession`] (every other node's side:
//! join with backoff, setup, serve, bye). They take `now` and what arrived and return actions;
//! `cluster::coord` and `cluster::worker` are their tokio pumps (ARCHITECTURE.md, "Cluster
//! session"). Training itself is the [`super::epoch::EpochMachine`]'s; the session only
//! brackets it and keeps the set of live (not fenced) nodes.
use crate::ActorError;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// How long the coordinator waits for the nodes before it says that it is waiting.
pub const JOIN_NOTICE_AFTER: Duration = Duration::from_secs(2);
/// First wait between two attempts to reach the coordinator; it doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between two attempts to reach the coordinator.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long a node waits for the coordinator to hang up after its `Bye`, and the coordinator
/// for the nodes' `Bye`s.
pub const BYE_WITHIN: Duration = Duration::from_secs(10);

/// A control message, as far as the session cares: everything else is the shells'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionMsg {
    /// A node joins and says where it listens.
    Join { addr: String },
    /// The coordinator's setup; steps take at most `deadline_ms`.
    Setup { deadline_ms: u64 },
    /// A node hosts its partitions and is ready to train.
    Ready,
    /// A node lacks a partition's files.
    FetchPart { part: u32 },
    /// A node could not set up.
    SetupFailed { error: String },
    /// A request of the training protocol; `step_epoch` for a training or evaluation step.
    Request { step_epoch: Option<u32> },
    /// A replica of another node's partition state.
    Replica,
    /// End of a successful run.
    Finish,
    /// A node's last message: its traffic and metrics.
    Bye,
    /// The run was aborted; why.
    Abort { reason: String },
    /// Anything else (named for the log).
    Other(String),
}

/// Whether the shell acts on a message it fed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// Dropped (logged by the machine as an [`CoordAction::Ignored`] / [`WorkerAction::Ignored`]).
    Drop,
}

/// Coordinator-side session settings.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    pub me: u32,
    /// The other nodes, ascending.
    pub workers: Vec<u32>,
    /// Where this node listens (for messages).
    pub addr: String,
    pub join_within: Duration,
    pub setup_within: Duration,
}

/// Where the coordinator's session is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordState {
    /// Waiting for every node's `Join` (`announced`: the waiting line was printed).
    Joining {
        joined: BTreeMap<u32, String>,
        announced: bool,
        by: Instant,
    },
    /// Setups sent; waiting for every node's `Ready`.
    SettingUp {
        ready: BTreeSet<u32>,
        by: Instant,
    },
    /// The epoch machine runs; nodes may be fenced.
    Training,
    /// `Finish` sent to every live node; waiting for their `Bye`s.
    Finishing {
        waiting: BTreeSet<u32>,
        by: Instant,
    },
    Over,
}

/// What the coordinator's shell does.
#[derive(Debug)]
pub enum CoordAction {
    /// Print one line on stderr.
    Say(String),
    /// Forget a peer's connection state (it left and may join again).
    ResetPeer(u32),
    /// Every node joined: send each its setup naming these addresses, host the local
    /// partitions.
    SendSetups { peers: BTreeMap<u32, String> },
    /// Send node `to` the files of partition `part`.
    ShipPart { to: u32, part: u32 },
    /// Every node is ready: run the epochs.
    StartTraining,
    /// Tell these nodes that the run ended well.
    SendFinish { nodes: Vec<u32> },
    /// Tell these nodes that the run is aborted, and why.
    SendAbort { nodes: Vec<u32>, reason: String },
    /// A message was dropped (a log line).
    Ignored { from: u32, what: String },
    /// The session ended well; `missing_byes`: live nodes that neither said `Bye` in time nor
    /// stayed connected (their traffic and metrics are not in the report).
    Done { missing_byes: Vec<u32> },
    /// The session failed with this error.
    Failed(ActorError),
}

/// The coordinator's side of the cluster session.
#[derive(Debug)]
pub struct CoordinatorSession {
    cfg: CoordinatorConfig,
    state: CoordState,
    started: Instant,
    /// Nodes taking part (fenced ones removed).
    live: BTreeSet<u32>,
    fenced: BTreeSet<u32>,
    /// Messages dropped because their sender was fenced.
    stale_dropped: u64,
    actions: VecDeque<CoordAction>,
}

impl CoordinatorSession {
    pub fn new(cfg: CoordinatorConfig, now: Instant) -> Self {
        let live = cfg.workers.iter().copied().collect();
        let mut joined = BTreeMap::new();
        joined.insert(cfg.me, cfg.addr.clone());
        let by = now + cfg.join_within;
        let mut s = CoordinatorSession {
            cfg,
            state: CoordState::Joining {
                joined,
                announced: false,
                by,
            },
            started: now,
            live,
            fenced: BTreeSet::new(),
            stale_dropped: 0,
            actions: VecDeque::new(),
        };
        s.check_joined(now);
        s
    }

    pub fn poll_action(&mut self) -> Option<CoordAction> {
        self.actions.pop_front()
    }

    pub fn state(&self) -> &CoordState {
        &self.state
    }

    /// Nodes taking part now (not fenced).
    pub fn live(&self) -> Vec<u32> {
        self.live.iter().copied().collect()
    }

    /// Messages dropped because their sender had been fenced.
    pub fn stale_dropped(&self) -> u64 {
        self.stale_dropped
    }

    /// When [`Self::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            CoordState::Joining { announced, by, .. } if !announced => {
                Some((self.started + JOIN_NOTICE_AFTER).min(*by))
            }
            CoordState::Joining { by, .. }
            | CoordState::SettingUp { by, .. }
            | CoordState::Finishing { by, .. } => Some(*by),
            CoordState::Training | CoordState::Over => None,
        }
    }

    /// A control message from `from`.
    pub fn handle_message(&mut self, from: u32, msg: SessionMsg, now: Instant) -> Verdict {
        if self.fenced.contains(&from) {
            self.stale_dropped += 1;
            self.ignore(from, format!("{msg:?} from fenced node {from}"));
            return Verdict::Drop;
        }
        if !self.cfg.workers.contains(&from) {
            self.ignore(
                from,
                format!("{msg:?} from node {from}, not in the cluster"),
            );
            return Verdict::Drop;
        }
        match (&mut self.state, msg) {
            (CoordState::Joining { joined, .. }, SessionMsg::Join { addr }) => {
                joined.insert(from, addr);
                self.check_joined(now);
                Verdict::Accept
            }
            (CoordState::SettingUp { ready, .. }, SessionMsg::Ready) => {
                ready.insert(from);
                if ready.len() == self.live.len() {
                    self.state = CoordState::Training;
                    self.actions.push_back(CoordAction::StartTraining);
                }
                Verdict::Accept
            }
            // Files are also fetched while adopting a lost node's partitions.
            (
                CoordState::SettingUp { .. } | CoordState::Training,
                SessionMsg::FetchPart { part },
            ) => {
                self.actions
                    .push_back(CoordAction::ShipPart { to: from, part });
                Verdict::Accept
            }
            (CoordState::SettingUp { .. }, SessionMsg::SetupFailed { error }) => {
                let e = ActorError::Node {
                    node: from,
                    detail: format!("setup failed: {error}"),
                };
                self.fail(e);
                Verdict::Accept
            }
            (CoordState::Finishing { waiting, .. }, SessionMsg::Bye) => {
                if !waiting.remove(&from) {
                    self.ignore(from, "a second Bye".into());
                    return Verdict::Drop;
                }
                if waiting.is_empty() {
                    self.finish(Vec::new());
                }
                Verdict::Accept
            }
            // Replies, replicas and the like belong to training.
            (CoordState::Training, _) => Verdict::Accept,
            (state, msg) => {
                let phase = phase_name(state);
                self.ignore(from, format!("{msg:?} while {phase}"));
                Verdict::Drop
            }
        }
    }

    /// The connection to `node` failed or it hung up.
    pub fn handle_peer_down(&mut self, node: u32, detail: &str, _now: Instant) {
        if !self.live.contains(&node) {
            return;
        }
        match &mut self.state {
            // A node that went away before its setup may start again and join again.
            CoordState::Joining { joined, .. } => {
                if joined.remove(&node).is_some() {
                    self.actions.push_back(CoordAction::Say(format!(
                        "node {}: node {node} left before the setup ({detail}); waiting for it to join again",
                        self.cfg.me
                    )));
                }
                self.actions.push_back(CoordAction::ResetPeer(node));
            }
            CoordState::SettingUp { .. } => self.fail(ActorError::Node {
                node,
                detail: detail.to_string(),
            }),
            // Training: the epoch machine's recovery decides (and fences through
            // `handle_fenced`).
            CoordState::Training | CoordState::Over => {}
            CoordState::Finishing { waiting, .. } => {
                waiting.remove(&node);
                if waiting.is_empty() {
                    self.finish(vec![node]);
                }
            }
        }
    }

    /// Recovery declared `node` lost: from now on everything it sends is dropped, and it is
    /// neither finished nor waited for.
    pub fn handle_fenced(&mut self, node: u32) {
        self.live.remove(&node);
        self.fenced.insert(node);
    }

    /// The epochs ended: finish on every live node, or abort them with the error.
    pub fn handle_training_over(&mut self, outcome: Result<(), String>, now: Instant) {
        if self.state != CoordState::Training {
            return;
        }
        let nodes = self.live();
        match outcome {
            Ok(()) => {
                self.actions.push_back(CoordAction::SendFinish {
                    nodes: nodes.clone(),
                });
                if nodes.is_empty() {
                    self.finish(Vec::new());
                } else {
                    self.state = CoordState::Finishing {
                        waiting: self.live.clone(),
                        by: now + BYE_WITHIN,
                    };
                }
            }
            Err(reason) => {
                self.actions
                    .push_back(CoordAction::SendAbort { nodes, reason });
                self.state = CoordState::Over;
            }
        }
    }

    /// A deadline of [`Self::poll_timeout`] passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        match &mut self.state {
            CoordState::Joining {
                joined,
                announced,
                by,
            } => {
                let missing: Vec<u32> = self
                    .live
                    .iter()
                    .copied()
                    .filter(|n| !joined.contains_key(n))
                    .collect();
                if now >= *by {
                    let joined: Vec<u32> = self
                        .live
                        .iter()
                        .copied()
                        .filter(|n| joined.contains_key(n))
                        .collect();
                    let e = ActorError::Cluster(format!(
                        "node(s) {missing:?} did not join within {} s (join_timeout_ms): start them \
                         with `trellis node --cluster FILE --id N`; they must reach this node at {}",
                        self.cfg.join_within.as_secs(),
                        self.cfg.addr
                    ));
                    // The nodes that did join wait for a setup that will not come: tell them.
                    self.actions.push_back(CoordAction::SendAbort {
                        nodes: joined,
                        reason: e.to_string(),
                    });
                    self.state = CoordState::Over;
                    self.actions.push_back(CoordAction::Failed(e));
                } else if !*announced && now >= self.started + JOIN_NOTICE_AFTER {
                    *announced = true;
                    self.actions.push_back(CoordAction::Say(format!(
                        "node {}: listening on {}, waiting up to {} s (join_timeout_ms) for node(s) {missing:?} to join",
                        self.cfg.me,
                        self.cfg.addr,
                        self.cfg.join_within.as_secs()
                    )));
                }
            }
            CoordState::SettingUp { ready, by } if now >= *by => {
                let waiting: Vec<u32> = self
                    .live
                    .iter()
                    .copied()
                    .filter(|n| !ready.contains(n))
                    .collect();
                let e = ActorError::Cluster(format!(
                    "node(s) {waiting:?} did not finish their setup within {} s",
                    self.cfg.setup_within.as_secs()
                ));
                self.fail(e);
            }
            CoordState::Finishing { waiting, by } if now >= *by => {
                let missing = waiting.iter().copied().collect();
                self.finish(missing);
            }
            _ => {}
        }
    }

    fn check_joined(&mut self, now: Instant) {
        let CoordState::Joining { joined, .. } = &self.state else {
            return;
        };
        if self.live.iter().all(|n| joined.contains_key(n)) {
            let peers = joined.clone();
            self.actions.push_back(CoordAction::SendSetups { peers });
            if self.live.is_empty() {
                self.state = CoordState::Training;
                self.actions.push_back(CoordAction::StartTraining);
            } else {
                self.state = CoordState::SettingUp {
                    ready: BTreeSet::new(),
                    by: now + self.cfg.setup_within,
                };
            }
        }
    }

    fn fail(&mut self, e: ActorError) {
        self.actions.push_back(CoordAction::SendAbort {
            nodes: self.live(),
            reason: e.to_string(),
        });
        self.state = CoordState::Over;
        self.actions.push_back(CoordAction::Failed(e));
    }

    fn finish(&mut self, missing_byes: Vec<u32>) {
        self.state = CoordState::Over;
        self.actions.push_back(CoordAction::Done { missing_byes });
    }

    fn ignore(&mut self, from: u32, what: String) {
        self.actions.push_back(CoordAction::Ignored { from, what });
    }
}

fn phase_name(s: &CoordState) -> &'static str {
    match s {
        CoordState::Joining { .. } => "joining",
        CoordState::SettingUp { .. } => "setting up",
        CoordState::Training => "training",
        CoordState::Finishing { .. } => "finishing",
        CoordState::Over => "over",
    }
}

/// Worker-side session settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub me: u32,
    pub coord: u32,
    /// Where the coordinator listens (for messages).
    pub coord_addr: String,
    pub join_within: Duration,
}

/// Where a worker's session is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerState {
    /// `Join` sent (attempt `attempts`); `retry_at` when the coordinator was unreachable.
    Joining {
        attempts: u32,
        retry_at: Option<Instant>,
    },
    /// The setup is being carried out (loading or fetching partitions, starting actors).
    SettingUp {
        deadline_ms: u64,
    },
    /// Ready: serving the coordinator's requests; silent for longer than `quiet` is a failure.
    Serving {
        quiet: Duration,
        heard: Instant,
    },
    /// `Bye` sent: waiting for the coordinator to hang up.
    Finishing {
        until: Instant,
    },
    Over,
}

/// Why a worker's link to the coordinator went down, as the transport saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkDown {
    pub detail: String,
    /// The coordinator is still connected (a per-message failure, not the link).
    pub still_connected: bool,
    /// The coordinator refused this node, and said why (retrying is futile).
    pub refused: Option<String>,
    /// A connection that was up broke (the coordinator was reachable until now).
    pub was_up: bool,
}

/// What a worker's shell does.
#[derive(Debug)]
pub enum WorkerAction {
    Say(String),
    /// Send `Join` to the coordinator (after forgetting the failed connection if `reset`).
    SendJoin {
        reset: bool,
    },
    /// Carry out the setup just received.
    StartSetup,
    SendReady,
    SendSetupFailed {
        error: String,
    },
    /// The first request of epoch `epoch`: apply its node faults and the epoch filter.
    EpochStarted(u32),
    /// Stop the partitions and send `Bye` (traffic, metrics).
    SendBye,
    Ignored {
        from: u32,
        what: String,
    },
    /// The session ended (well: after `Bye`).
    Done,
    Failed(ActorError),
}

/// A worker's side of the cluster session.
#[derive(Debug)]
pub struct WorkerSession {
    cfg: WorkerConfig,
    state: WorkerState,
    /// The coordinator was last known to be up (or this node started) then.
    reachable_at: Instant,
    backoff: Duration,
    last_failure: String,
    /// The newest epoch a step was requested for.
    epoch: Option<u32>,
    actions: VecDeque<WorkerAction>,
}

impl WorkerSession {
    /// Starts joining: the first `Join` goes out at once.
    pub fn new(cfg: WorkerConfig, now: Instant) -> Self {
        let mut actions = VecDeque::new();
        actions.push_back(WorkerAction::SendJoin { reset: false });
        WorkerSession {
            cfg,
            state: WorkerState::Joining {
                attempts: 1,
                retry_at: None,
            },
            reachable_at: now,
            backoff: FIRST_BACKOFF,
            last_failure: String::new(),
            epoch: None,
            actions,
        }
    }

    pub fn poll_action(&mut self) -> Option<WorkerAction> {
        self.actions.pop_front()
    }

    pub fn state(&self) -> &WorkerState {
        &self.state
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            WorkerState::Joining {
                retry_at: Some(t), ..
            } => Some(*t),
            // While connected, wait for the setup as long as the coordinator waits for the
            // other nodes (it aborts the run when they do not come).
            WorkerState::Joining { retry_at: None, .. } => {
                Some(self.reachable_at + self.cfg.join_within)
            }
            WorkerState::SettingUp { .. } => None,
            WorkerState::Serving { quiet, heard } => Some(*heard + *quiet),
            WorkerState::Finishing { until } => Some(*until),
            WorkerState::Over => None,
        }
    }

    /// A control message from `from`.
    pub fn handle_message(&mut self, from: u32, msg: SessionMsg, now: Instant) -> Verdict {
        let coord = self.cfg.coord;
        match (&mut self.state, msg) {
            (_, SessionMsg::Replica) => Verdict::Accept,
            (WorkerState::Over, msg) => {
                self.ignore(from, format!("{msg:?} after the run"));
                Verdict::Drop
            }
            (_, msg) if from != coord => {
                self.ignore(
                    from,
                    format!("{msg:?} from node {from}, not the coordinator"),
                );
                Verdict::Drop
            }
            (_, SessionMsg::Abort { reason }) => {
                self.state = WorkerState::Over;
                self.actions
                    .push_back(WorkerAction::Failed(ActorError::Node {
                        node: coord,
                        detail: format!("the coordinator aborted the run: {reason}"),
                    }));
                Verdict::Accept
            }
            (WorkerState::Joining { .. }, SessionMsg::Setup { deadline_ms }) => {
                self.state = WorkerState::SettingUp { deadline_ms };
                self.actions.push_back(WorkerAction::StartSetup);
                Verdict::Accept
            }
            (WorkerState::Serving { heard, .. }, SessionMsg::Request { step_epoch }) => {
                *heard = now;
                if let Some(e) = step_epoch {
                    if self.epoch.is_none_or(|newest| e > newest) {
                        self.epoch = Some(e);
                        self.actions.push_back(WorkerAction::EpochStarted(e));
                    }
                }
                Verdict::Accept
            }
            (WorkerState::Serving { .. }, SessionMsg::Finish) => {
                self.actions.push_back(WorkerAction::SendBye);
                // Closing now could drop the Bye before it is acknowledged: the
                // coordinator hangs up first, once it has every node's Bye.
                self.state = WorkerState::Finishing {
                    until: now + BYE_WITHIN,
                };
                Verdict::Accept
            }
            (WorkerState::Finishing { until }, _) => {
                *until = now + BYE_WITHIN;
                Verdict::Drop
            }
            (state, msg) => {
                let phase = match state {
                    WorkerState::Joining { .. } => "before the setup",
                    WorkerState::SettingUp { .. } => "during the setup",
                    _ => "while serving",
                };
                self.ignore(from, format!("{msg:?} {phase}"));
                Verdict::Drop
            }
        }
    }

    /// The setup was carried out (or failed).
    pub fn handle_setup_done(&mut self, result: Result<(), String>, now: Instant) {
        let WorkerState::SettingUp { deadline_ms } = self.state else {
            return;
        };
        match result {
            Ok(()) => {
                self.actions.push_back(WorkerAction::SendReady);
                // A step takes at most the deadline; allow two before calling the
                // coordinator silent.
                let quiet = Duration::from_millis(deadline_ms.saturating_mul(2).max(10_000));
                self.state = WorkerState::Serving { quiet, heard: now };
            }
            Err(error) => {
                self.actions.push_back(WorkerAction::SendSetupFailed {
                    error: error.clone(),
                });
                self.state = WorkerState::Over;
                self.actions
                    .push_back(WorkerAction::Failed(ActorError::Cluster(error)));
            }
        }
    }

    /// The link to the coordinator failed, or it hung up.
    pub fn handle_link_down(&mut self, down: LinkDown, now: Instant) {
        let coord = self.cfg.coord;
        match &mut self.state {
            WorkerState::Joining { attempts, retry_at } => {
                if retry_at.is_some() {
                    return;
                }
                // Joined: the coordinator is up and waits for the other nodes.
                if down.still_connected {
                    self.reachable_at = now;
                    return;
                }
                if let Some(reason) = down.refused {
                    self.state = WorkerState::Over;
                    self.actions
                        .push_back(WorkerAction::Failed(ActorError::Node {
                            node: coord,
                            detail: format!("the coordinator at {} {reason}", self.cfg.coord_addr),
                        }));
                    return;
                }
                if down.was_up {
                    self.reachable_at = now;
                }
                self.last_failure = down.detail.clone();
                let left =
                    (self.reachable_at + self.cfg.join_within).saturating_duration_since(now);
                if left.is_zero() {
                    let attempts = *attempts;
                    self.give_up(attempts);
                    return;
                }
                if *attempts == 1 {
                    self.actions.push_back(WorkerAction::Say(format!(
                        "node {}: the coordinator (node {coord} at {}) is not reachable yet \
                         ({}); retrying for up to {} s (join_timeout_ms)",
                        self.cfg.me,
                        self.cfg.coord_addr,
                        down.detail,
                        left.as_secs()
                    )));
                }
                *retry_at = Some(now + self.backoff.min(left));
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
            WorkerState::SettingUp { .. } => {}
            WorkerState::Serving { .. } => {
                self.state = WorkerState::Over;
                self.actions
                    .push_back(WorkerAction::Failed(ActorError::Node {
                        node: coord,
                        detail: down.detail,
                    }));
            }
            // The coordinator hung up after our Bye: the run is over.
            WorkerState::Finishing { .. } => self.done(),
            WorkerState::Over => {}
        }
    }

    /// The shell saw the coordinator connected: while joining, it is up and waits for the
    /// other nodes, so the join deadline starts again.
    pub fn handle_coordinator_up(&mut self, now: Instant) {
        if let WorkerState::Joining { retry_at: None, .. } = self.state {
            self.reachable_at = now;
        }
    }

    /// A deadline of [`Self::poll_timeout`] passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let coord = self.cfg.coord;
        match &mut self.state {
            WorkerState::Joining {
                attempts,
                retry_at: Some(t),
            } if now >= *t => {
                *attempts += 1;
                self.state = WorkerState::Joining {
                    attempts: *attempts,
                    retry_at: None,
                };
                self.actions
                    .push_back(WorkerAction::SendJoin { reset: true });
            }
            WorkerState::Joining {
                attempts,
                retry_at: None,
            } if now >= self.reachable_at + self.cfg.join_within => {
                let attempts = *attempts;
                if self.last_failure.is_empty() {
                    self.last_failure = "no setup arrived".into();
                }
                self.give_up(attempts);
            }
            WorkerState::Serving { quiet, heard } if now >= *heard + *quiet => {
                let ms = quiet.as_millis();
                self.state = WorkerState::Over;
                self.actions
                    .push_back(WorkerAction::Failed(ActorError::Node {
                        node: coord,
                        detail: format!("no message from node {coord} within {ms} ms"),
                    }));
            }
            WorkerState::Finishing { until } if now >= *until => self.done(),
            _ => {}
        }
    }

    fn give_up(&mut self, attempts: u32) {
        self.state = WorkerState::Over;
        self.actions
            .push_back(WorkerAction::Failed(ActorError::Node {
                node: self.cfg.coord,
                detail: format!(
                    "the coordinator at {} did not answer within {} s \
                 (join_timeout_ms; {attempts} attempt(s)), last: {}",
                    self.cfg.coord_addr,
                    self.cfg.join_within.as_secs(),
                    self.last_failure
                ),
            }));
    }

    fn done(&mut self) {
        self.state = WorkerState::Over;
        self.actions.push_back(WorkerAction::Done);
    }

    fn ignore(&mut self, from: u32, what: String) {
        self.actions.push_back(WorkerAction::Ignored { from, what });
    }
}

#[cfg(test)]
mod tests;
