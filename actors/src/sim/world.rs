//! The simulated cluster: nodes, their partition machines and replica copies, the
//! coordinator's machine, the event queue in virtual time, and the faults as they fire.
use super::net::{Fate, Network, SimRng};
use super::schedule::{Schedule, SimFault, TimedFault, EPOCHS, MODELS, PART_COUNTS};
use super::{EpochMachine, PartitionMachine, ReplicaBytes};
use crate::faults::FaultPlan;
use crate::protocol::epoch::{
    Committed, EpochAction, EpochConfig, Outgoing, Placement, Request, RequestId, Response,
    RestartPolicy, SplitTotals,
};
use crate::protocol::messages::Step;
use crate::protocol::partition::PartitionAction;
use crate::protocol::session::{
    CoordAction, CoordState, CoordinatorConfig, CoordinatorSession, LinkDown, SessionMsg, Verdict,
    WorkerAction, WorkerConfig, WorkerSession, WorkerState,
};
use crate::protocol::state::{GlobalCounts, PartitionState};
use crate::replica::PendingResidual;
use crate::{ActorError, Recovery};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use trellis_gpu::Stream;
use trellis_runtime::partition::{partition, PartitionMethod, PartitionSet};
use trellis_runtime::{DataSource, EpochLog, ModelKind, TrainConfig};
use trellis_transport::codec;
use trellis_transport::{HaloBlock, HaloPayload, Phase, RunId};

/// The coordinator's node.
const COORDINATOR: u32 = 0;
/// A node silent this long is declared lost, µs.
const IDLE_TIMEOUT_US: u64 = 300_000;
/// The coordinator's deadline for one round.
const DEADLINE: Duration = Duration::from_millis(1_000);
/// Recoveries a run may perform.
const MAX_RECOVERIES: u32 = 24;
/// A run that has not ended after this much virtual time, or this many events, hangs.
const MAX_VIRTUAL_US: u64 = 600_000_000;
const MAX_EVENTS: u64 = 2_000_000;

/// What a fault-free reference run is recorded by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct RefKey {
    parts: u32,
    model: &'static str,
    staleness: u32,
    skip: bool,
}

/// What a fault-free run ended with (`None`: it did not finish).
type References = BTreeMap<RefKey, Option<Reference>>;

/// A fault-free run's final weights digest and its evaluations ([`super::eval_fingerprint`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub digest: String,
    pub evals: String,
}

/// The graph, its partitionings and the training configurations, prepared once per sweep.
pub struct SimGraph {
    _dir: tempfile::TempDir,
    sets: BTreeMap<u32, PartitionSet>,
    counts: GlobalCounts,
    configs: BTreeMap<&'static str, TrainConfig>,
    /// Fault-free digests by (partitions, model, staleness, skip).
    references: Mutex<References>,
}

impl SimGraph {
    /// A 120-node synthetic graph partitioned (METIS) for every count in [`PART_COUNTS`].
    pub fn new() -> Result<Self, ActorError> {
        let ds = DataSource::parse("synthetic:nodes=120,degree=6,features=12,classes=4,seed=3")?
            .load()?;
        let dir = tempfile::tempdir()
            .map_err(|e| ActorError::System(format!("simulator: temporary folder: {e}")))?;
        let mut sets = BTreeMap::new();
        for p in PART_COUNTS {
            let d = dir.path().join(format!("p{p}"));
            partition(&ds, p as usize, PartitionMethod::Metis, 0, &d)?;
            sets.insert(p, PartitionSet::open(&d)?);
        }
        let book = sets[&1].book().clone();
        let mut configs = BTreeMap::new();
        for kind in MODELS {
            let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, 7);
            cfg.epochs = EPOCHS;
            cfg.threads = 1;
            configs.insert(model_key(kind), cfg);
        }
        Ok(SimGraph {
            _dir: dir,
            sets,
            counts: GlobalCounts {
                train: book.train_nodes,
                val: book.val_nodes,
                test: book.test_nodes,
            },
            configs,
            references: Mutex::new(BTreeMap::new()),
        })
    }

    /// The training configuration of `model`.
    pub fn config(&self, model: ModelKind) -> &TrainConfig {
        &self.configs[model_key(model)]
    }

    /// The training configuration of `model` with halo staleness `staleness`, and with rows
    /// skipped when they changed by at most half their norm (evaluation rows: a fifth; at
    /// most 2 epochs old) if `skip`.
    pub fn config_with(&self, model: ModelKind, staleness: u32, skip: bool) -> TrainConfig {
        let mut cfg = self.config(model).clone();
        cfg.halo.staleness = staleness;
        if skip {
            cfg.halo.skip_threshold = 0.5;
            cfg.halo.eval_skip_threshold = 0.2;
            cfg.halo.max_staleness = Some(2);
        }
        cfg
    }

    /// The folder of the partitioning into `parts`.
    pub fn partition_dir(&self, parts: u32) -> PathBuf {
        self._dir.path().join(format!("p{parts}"))
    }

    /// The fault-free run's digest for `parts` partitions, `model`, halo `staleness` and
    /// `skip`: a run on a perfect network without faults, recorded once, before and apart
    /// from the faulty runs.
    pub fn reference(
        &self,
        parts: u32,
        model: ModelKind,
        staleness: u32,
        skip: bool,
    ) -> Option<Reference> {
        let key = RefKey {
            parts,
            model: model_key(model),
            staleness,
            skip,
        };
        if let Some(d) = self.lock_refs().get(&key) {
            return d.clone();
        }
        let mut s = Schedule::generate(0, false);
        s.parts = parts;
        s.model = model;
        s.staleness = staleness;
        s.skip = skip;
        s.nodes = parts + 1;
        let r = SimRun::new(self, s).run();
        let d = match r.outcome {
            SimOutcome::Finished { digest, evals } if r.violation.is_none() => {
                Some(Reference { digest, evals })
            }
            _ => None,
        };
        self.lock_refs().insert(key, d.clone());
        d
    }

    fn lock_refs(&self) -> std::sync::MutexGuard<'_, References> {
        self.references.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[cfg(test)]
    pub(crate) fn state(
        &self,
        parts: u32,
        part: u32,
        model: ModelKind,
    ) -> Result<PartitionState, ActorError> {
        self.state_with(parts, part, self.config(model))
    }

    /// The state of partition `part` of `parts` under `cfg` (a variant of a model's config).
    pub(crate) fn state_with(
        &self,
        parts: u32,
        part: u32,
        cfg: &TrainConfig,
    ) -> Result<PartitionState, ActorError> {
        let set = &self.sets[&parts];
        let file = set.open_part(part as usize)?;
        let stream = Stream::cpu(cfg.threads)?;
        Ok(PartitionState::new(&file, cfg, self.counts, stream)?)
    }
}

/// How a simulated run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum SimOutcome {
    Finished {
        digest: String,
        /// Every epoch's evaluation ([`super::eval_fingerprint`]).
        evals: String,
    },
    /// The run failed; `expected`: the schedule made it unavoidable.
    Failed { error: String, expected: bool },
}

impl SimOutcome {
    /// A short name for counting outcomes.
    pub fn name(&self) -> &'static str {
        match self {
            SimOutcome::Finished { .. } => "finished",
            SimOutcome::Failed { expected: true, .. } => "expected-error",
            SimOutcome::Failed {
                expected: false, ..
            } => "unexpected-error",
        }
    }
}

/// What a simulated run produced, before the reference check.
#[derive(Debug)]
pub struct SimResult {
    pub seed: u64,
    pub nodes: u32,
    pub parts: u32,
    pub model: ModelKind,
    pub staleness: u32,
    pub skip: bool,
    pub outcome: SimOutcome,
    pub fired: BTreeMap<SimFault, u32>,
    pub virtual_us: u64,
    pub recoveries: usize,
    /// Partitions rolled back to the committed step before their last optimizer step (a node
    /// lost during the optimizer step: it is replayed with its training pass).
    pub rollbacks: u32,
    /// Evaluation step requests of a replayed evaluation ([`EpochConfig::replays_eval`]),
    /// and evaluation blocks sent as only their changed rows.
    pub eval_replay_steps: u32,
    pub sparse_eval_blocks: u64,
    pub logs: Vec<EpochLog>,
    pub violation: Option<String>,
}

/// A reply as it travels (errors as data, so a duplicated message can be copied).
#[derive(Debug, Clone)]
enum WireReply {
    Ok(Response),
    Panicked(String),
    Failed(String),
}

/// A message between nodes.
#[derive(Debug, Clone)]
enum Msg {
    /// Coordinator to a partition's node.
    Request {
        coord: u32,
        out: Outgoing,
    },
    /// A partition's node to the coordinator.
    Reply {
        coord: u32,
        id: RequestId,
        part: u32,
        reply: WireReply,
    },
    Halo(HaloBlock),
    Replica(ReplicaBytes),
}

#[derive(Debug)]
enum Event {
    Deliver {
        from: u32,
        to: u32,
        msg: Msg,
    },
    /// The coordinator's failure detector fires for `node` (silent since it stopped).
    LossDetected {
        node: u32,
    },
    /// A stopped node continues.
    Wake {
        node: u32,
    },
}

struct Queued {
    at: u64,
    seq: u64,
    event: Event,
}
impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

#[derive(Default)]
struct SimNode {
    alive: bool,
    /// Stopped: messages wait until it wakes.
    paused: bool,
    /// Declared lost by the coordinator: everything it sends is refused.
    fenced: bool,
    parts: BTreeMap<u32, PartitionMachine>,
    /// Its own partitions' latest committed state (what a restarted actor restores).
    local: BTreeMap<u32, ReplicaBytes>,
    /// Its own partitions' residuals of the step in progress (`--grad-codec`).
    held: BTreeMap<u32, PendingResidual>,
    /// Replicas it keeps for partitions hosted elsewhere: the two newest steps of each (a
    /// step can be replicated before the coordinator commits it, and a recovery then resumes
    /// from the one before).
    replicas: BTreeMap<u32, Vec<ReplicaBytes>>,
    waiting: Vec<(u32, Msg)>,
}

/// One simulated run of a schedule.
pub struct SimRun<'g> {
    graph: &'g SimGraph,
    s: Schedule,
    rng: SimRng,
    net: Network,
    now: u64,
    seq: u64,
    events: u64,
    queue: BinaryHeap<Reverse<Queued>>,
    nodes: Vec<SimNode>,
    /// Partition -> node.
    placement: Vec<u32>,
    lost: BTreeSet<u32>,
    run: RunId,
    /// The coordinator's incarnation (a resumed coordinator is a new process).
    coord: u32,
    machine: EpochMachine,
    faults: Arc<FaultPlan>,
    /// The coordinator's clock is ahead of virtual time by this much, µs.
    clock_offset: u64,
    origin: Instant,
    /// Requests in flight: id -> (partition, node).
    outstanding: BTreeMap<RequestId, (u32, u32)>,
    checkpoint: Option<(Committed, Vec<EpochLog>, ReplicaBytes)>,
    fired: BTreeMap<SimFault, u32>,
    /// Nodes that crashed, stopped or were fenced (what can explain a node-loss recovery).
    failed_nodes: BTreeSet<u32>,
    recoveries: Vec<Recovery>,
    outcome: Option<SimOutcome>,
    violation: Option<String>,
    /// The coordinator must crash once the actions in progress are executed.
    coordinator_crash: bool,
    /// A partition lost every replica (the run cannot continue: an expected error).
    unrecoverable: bool,
    rollbacks: u32,
    eval_replay_steps: u32,
    sparse_eval_blocks: u64,
    /// Replicas sent and not delivered yet: (to, part, step) -> copies.
    replicas_in_flight: BTreeMap<(u32, u32, u32), u32>,
    /// The coordinator's cluster session (join, setup, fencing, finish) of this incarnation.
    session: CoordinatorSession,
    /// Every other node's side of the session, while its process lives.
    workers: BTreeMap<u32, WorkerSession>,
}

impl<'g> SimRun<'g> {
    /// A fresh cluster for `s` (nothing runs until [`SimRun::run`]).
    pub fn new(graph: &'g SimGraph, s: Schedule) -> Self {
        let faults = Arc::new(s_panics(&s));
        let rng = SimRng::new(s.seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let net = Network::new(s.net);
        let nodes = (0..s.nodes)
            .map(|_| SimNode {
                alive: true,
                ..SimNode::default()
            })
            .collect();
        let placement = (0..s.parts).map(|p| 1 + p % (s.nodes - 1)).collect();
        let machine = Self::new_machine(graph, &s, Committed::default(), Vec::new());
        SimRun {
            graph,
            rng,
            net,
            now: 0,
            seq: 0,
            events: 0,
            queue: BinaryHeap::new(),
            nodes,
            placement,
            lost: BTreeSet::new(),
            run: RunId::from_u128(u128::from(s.seed) << 8),
            coord: 0,
            machine,
            faults,
            clock_offset: 0,
            origin: Instant::now(),
            outstanding: BTreeMap::new(),
            checkpoint: None,
            fired: BTreeMap::new(),
            failed_nodes: BTreeSet::new(),
            recoveries: Vec::new(),
            outcome: None,
            violation: None,
            coordinator_crash: false,
            unrecoverable: false,
            rollbacks: 0,
            eval_replay_steps: 0,
            sparse_eval_blocks: 0,
            replicas_in_flight: BTreeMap::new(),
            session: Self::new_session(s.nodes, Instant::now()),
            workers: BTreeMap::new(),
            s,
        }
    }

    fn new_session(nodes: u32, now: Instant) -> CoordinatorSession {
        CoordinatorSession::new(
            CoordinatorConfig {
                me: COORDINATOR,
                workers: (0..nodes).filter(|&n| n != COORDINATOR).collect(),
                addr: format!("sim-node-{COORDINATOR}"),
                join_within: Duration::from_secs(300),
                setup_within: Duration::from_secs(300),
            },
            now,
        )
    }

    /// Every node process (re)starts: each worker's session joins, receives the setup, sets
    /// up and says it is ready; the coordinator's session must then start training, having
    /// sent one setup naming every node, and every worker must be serving.
    fn open_session(&mut self) {
        let now = self.coord_now();
        self.session = Self::new_session(self.s.nodes, now);
        self.workers.clear();
        for n in (0..self.s.nodes).filter(|&n| n != COORDINATOR) {
            let cfg = WorkerConfig {
                me: n,
                coord: COORDINATOR,
                coord_addr: format!("sim-node-{COORDINATOR}"),
                join_within: Duration::from_secs(300),
            };
            let mut w = WorkerSession::new(cfg, now);
            match w.poll_action() {
                Some(WorkerAction::SendJoin { reset: false }) => {
                    let addr = format!("sim-node-{n}");
                    self.session
                        .handle_message(n, SessionMsg::Join { addr }, now);
                }
                other => {
                    self.violation
                        .get_or_insert(format!("node {n} joining: {other:?}"));
                }
            }
            self.workers.insert(n, w);
        }
        let mut setups = 0;
        while let Some(a) = self.session.poll_action() {
            match a {
                CoordAction::SendSetups { peers } if peers.len() == self.s.nodes as usize => {
                    setups += 1;
                    self.set_up_workers(now);
                }
                CoordAction::StartTraining => {}
                other => {
                    self.violation
                        .get_or_insert(format!("session start: unexpected {other:?}"));
                }
            }
        }
        if setups != 1 || self.session.state() != &CoordState::Training {
            let state = format!("{:?}", self.session.state());
            self.violation
                .get_or_insert(format!("session start: {setups} setups, state {state}"));
        }
        let not_serving: Vec<u32> = self
            .workers
            .iter()
            .filter(|(_, w)| !matches!(w.state(), WorkerState::Serving { .. }))
            .map(|(n, _)| *n)
            .collect();
        if !not_serving.is_empty() {
            self.violation.get_or_insert(format!(
                "nodes {not_serving:?} are not serving after the setup"
            ));
        }
    }

    /// Each worker receives the setup, carries it out and answers `Ready`.
    fn set_up_workers(&mut self, now: Instant) {
        let setup = SessionMsg::Setup {
            deadline_ms: DEADLINE.as_millis() as u64,
        };
        let mut ready = Vec::new();
        for (&n, w) in &mut self.workers {
            w.handle_message(COORDINATOR, setup.clone(), now);
            if let Some(WorkerAction::StartSetup) = w.poll_action() {
                w.handle_setup_done(Ok(()), now);
                if let Some(WorkerAction::SendReady) = w.poll_action() {
                    ready.push(n);
                }
            }
        }
        for n in ready {
            self.session.handle_message(n, SessionMsg::Ready, now);
        }
    }

    /// Training ended: the session finishes every live node and none that was fenced, each
    /// answers `Bye`, and the session is over with none missing.
    fn close_session(&mut self, outcome: Result<(), String>) {
        let now = self.coord_now();
        for (n, node) in self.nodes.iter().enumerate() {
            if node.fenced {
                self.session.handle_fenced(n as u32);
            }
        }
        let ok = outcome.is_ok();
        self.session.handle_training_over(outcome, now);
        let mut told = Vec::new();
        while let Some(a) = self.session.poll_action() {
            match a {
                CoordAction::SendFinish { nodes } | CoordAction::SendAbort { nodes, .. } => {
                    told = nodes
                }
                CoordAction::Done { .. } => {}
                other => {
                    self.violation
                        .get_or_insert(format!("session end: unexpected {other:?}"));
                }
            }
        }
        if let Some(n) = told.iter().find(|&&n| self.nodes[n as usize].fenced) {
            self.violation.get_or_insert(format!(
                "the session told fenced node {n} that the run ended"
            ));
        }
        for &n in &told {
            let Some(w) = self.workers.get_mut(&n) else {
                continue;
            };
            let msg = if ok {
                SessionMsg::Finish
            } else {
                SessionMsg::Abort {
                    reason: "the run failed".into(),
                }
            };
            w.handle_message(COORDINATOR, msg, now);
            let acts: Vec<WorkerAction> = std::iter::from_fn(|| w.poll_action()).collect();
            let expected = matches!(
                (ok, acts.as_slice()),
                (true, [WorkerAction::SendBye]) | (false, [WorkerAction::Failed(_)])
            );
            if !expected {
                self.violation
                    .get_or_insert(format!("node {n} at the end of the run: {acts:?}"));
            }
        }
        if ok {
            for &n in &told {
                self.session.handle_message(n, SessionMsg::Bye, now);
            }
            // The coordinator hangs up last: every worker that said goodbye is done.
            for &n in &told {
                if let Some(w) = self.workers.get_mut(&n) {
                    w.handle_link_down(
                        LinkDown {
                            detail: "the coordinator closed the connection".into(),
                            still_connected: false,
                            refused: None,
                            was_up: true,
                        },
                        now,
                    );
                    if !matches!(w.poll_action(), Some(WorkerAction::Done)) {
                        self.violation
                            .get_or_insert(format!("node {n} did not end after its Bye"));
                    }
                }
            }
            while let Some(a) = self.session.poll_action() {
                if !matches!(&a, CoordAction::Done { missing_byes } if missing_byes.is_empty()) {
                    self.violation
                        .get_or_insert(format!("session bye: unexpected {a:?}"));
                }
            }
        }
        if self.session.state() != &CoordState::Over {
            self.violation.get_or_insert(format!(
                "the session did not end: {:?}",
                self.session.state()
            ));
        }
    }

    fn new_machine(
        graph: &SimGraph,
        s: &Schedule,
        committed: Committed,
        logs: Vec<EpochLog>,
    ) -> EpochMachine {
        let coordinator_crashes = s
            .timed
            .iter()
            .any(|f| f.fault == TimedFault::CoordinatorCrash);
        let cfg = EpochConfig {
            parts: s.parts,
            layers: graph.config(s.model).model.layers as u16,
            epochs: EPOCHS,
            deadline: DEADLINE,
            max_recoveries: MAX_RECOVERIES,
            policy: RestartPolicy::default(),
            retry_timeouts: true,
            node_recovery: true,
            checkpoint_every: coordinator_crashes.then_some(1),
            gated: false,
            totals: SplitTotals {
                train: graph.counts.train,
                val: graph.counts.val,
                test: graph.counts.test,
            },
            replays_eval: graph
                .config_with(s.model, s.staleness, s.skip)
                .halo
                .skips_eval_rows(),
        };
        let m = EpochMachine::new(cfg, committed, logs);
        match initial_digest(graph, s.model) {
            Some(d) => m.with_initial_digest(d),
            None => m,
        }
    }

    /// Runs the schedule to its end.
    pub fn run(mut self) -> SimResult {
        if let Err(e) = self.start_partitions(None) {
            self.violation = Some(format!("setting up the partitions failed: {e}"));
        } else {
            self.open_session();
            self.machine.start(self.coord_now());
            self.main_loop();
        }
        let outcome = self.outcome.clone().unwrap_or(SimOutcome::Failed {
            error: "the run did not end".into(),
            expected: false,
        });
        self.check_recoveries();
        SimResult {
            seed: self.s.seed,
            nodes: self.s.nodes,
            parts: self.s.parts,
            model: self.s.model,
            staleness: self.s.staleness,
            skip: self.s.skip,
            outcome,
            fired: self.fired.clone(),
            virtual_us: self.now,
            recoveries: self.recoveries.len(),
            rollbacks: self.rollbacks,
            eval_replay_steps: self.eval_replay_steps,
            sparse_eval_blocks: self.sparse_eval_blocks,
            logs: Vec::new(),
            violation: self.violation.take(),
        }
    }

    fn coord_now(&self) -> Instant {
        self.origin + Duration::from_micros(self.now + self.clock_offset)
    }

    fn fire(&mut self, f: SimFault) {
        *self.fired.entry(f).or_default() += 1;
    }

    /// Builds every partition's machine on its node, restored from `from` (a checkpoint) or
    /// fresh, and replicates its state to its replica nodes.
    fn start_partitions(&mut self, from: Option<&ReplicaBytes>) -> Result<(), ActorError> {
        let snap = match from {
            Some(b) => Some(b.decode().map_err(ActorError::Cluster)?),
            None => None,
        };
        for p in 0..self.s.parts {
            let cfg = self
                .graph
                .config_with(self.s.model, self.s.staleness, self.s.skip);
            let state = self.graph.state_with(self.s.parts, p, &cfg)?;
            let mut m = PartitionMachine::new(state, self.run, self.faults.clone(), true);
            if let Some(snap) = &snap {
                m.restore(Some(snap))?;
            }
            let bytes = ReplicaBytes::encode(p, &m.snapshot()?);
            let node = self.placement[p as usize];
            self.nodes[node as usize].parts.insert(p, m);
            self.replicate(node, bytes);
        }
        Ok(())
    }

    /// The replica nodes of partition `part` hosted on `host`: the next R live nodes after it
    /// in id order (never the coordinator).
    fn holders(&self, part: u32, host: u32) -> Vec<u32> {
        let _ = part;
        let workers = self.s.nodes - 1;
        (1..workers)
            .map(|k| 1 + (host - 1 + k) % workers)
            .filter(|&n| self.nodes[n as usize].alive && !self.lost.contains(&n))
            .take(self.s.replicas as usize)
            .collect()
    }

    /// The replica nodes of a partition owned by `host` by position alone (dead or not).
    fn ring_holders(&self, host: u32) -> Vec<u32> {
        let workers = self.s.nodes - 1;
        (1..workers)
            .map(|k| 1 + (host - 1 + k) % workers)
            .take(self.s.replicas as usize)
            .collect()
    }

    fn replicate(&mut self, host: u32, bytes: ReplicaBytes) {
        let part = bytes.part;
        self.nodes[host as usize].local.insert(part, bytes.clone());
        for h in self.holders(part, host) {
            self.send(host, h, Msg::Replica(bytes.clone()));
        }
    }

    fn schedule(&mut self, after: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse(Queued {
            at: self.now + after,
            seq: self.seq,
            event,
        }));
    }

    /// Sends `msg` from node `from` to node `to` through the network.
    fn send(&mut self, from: u32, to: u32, msg: Msg) {
        if from == to {
            // Between actors of one process: in order, never lost.
            return self.schedule(1, Event::Deliver { from, to, msg });
        }
        let lossy = !matches!(msg, Msg::Replica(_));
        match self.net.fate(&mut self.rng, from, to, self.now, lossy) {
            Fate::Lost => {
                if !self.net.is_cut(from, to, self.now) {
                    self.fire(SimFault::MessageLost);
                }
            }
            Fate::Corrupted => self.fire(SimFault::FrameCorrupted),
            Fate::Delivered(delays) => {
                let (lo, hi) = self.net.spec.delay_us;
                if delays[0] > hi.max(lo) {
                    self.fire(SimFault::MessageReordered);
                }
                if delays.len() > 1 {
                    self.fire(SimFault::MessageDuplicated);
                }
                for d in delays {
                    if let Msg::Replica(b) = &msg {
                        *self
                            .replicas_in_flight
                            .entry((to, b.part, b.epoch))
                            .or_default() += 1;
                    }
                    let msg = msg.clone();
                    self.schedule(d, Event::Deliver { from, to, msg });
                }
            }
        }
    }

    fn main_loop(&mut self) {
        loop {
            self.drain_coordinator();
            if self.coordinator_crash {
                self.coordinator_crash = false;
                self.crash_coordinator();
                continue;
            }
            if self.outcome.is_some() {
                return;
            }
            let timeout = self.machine.poll_timeout().map(|t| {
                let coord_us = t.saturating_duration_since(self.origin).as_micros() as u64;
                coord_us.saturating_sub(self.clock_offset)
            });
            let next = self.queue.peek().map(|Reverse(q)| q.at);
            match (next, timeout) {
                (Some(n), Some(t)) if t < n => self.timeout_at(t),
                (None, Some(t)) => self.timeout_at(t),
                (Some(_), _) => {
                    let Some(Reverse(q)) = self.queue.pop() else {
                        continue;
                    };
                    self.now = self.now.max(q.at);
                    self.handle(q.event);
                }
                (None, None) => {
                    self.violation = Some(format!(
                        "hang: nothing is scheduled at {} ms and the run has not ended",
                        self.now / 1000
                    ));
                    return;
                }
            }
            self.events += 1;
            if self.now > MAX_VIRTUAL_US || self.events > MAX_EVENTS {
                self.violation = Some(format!(
                    "hang: the run had not ended after {} ms of virtual time and {} events",
                    self.now / 1000,
                    self.events
                ));
                return;
            }
        }
    }

    fn timeout_at(&mut self, t: u64) {
        self.now = self.now.max(t);
        let now = self.coord_now();
        self.machine.handle_timeout(now);
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Deliver { from, to, msg } => self.deliver(from, to, msg),
            Event::LossDetected { node } => self.loss_detected(node),
            Event::Wake { node } => {
                let n = &mut self.nodes[node as usize];
                n.paused = false;
                for (from, msg) in std::mem::take(&mut n.waiting) {
                    self.schedule(
                        0,
                        Event::Deliver {
                            from,
                            to: node,
                            msg,
                        },
                    );
                }
            }
        }
    }

    fn deliver(&mut self, from: u32, to: u32, msg: Msg) {
        if let Msg::Replica(b) = &msg {
            if let Some(n) = self.replicas_in_flight.get_mut(&(to, b.part, b.epoch)) {
                *n = n.saturating_sub(1);
            }
        }
        let n = &mut self.nodes[to as usize];
        if !n.alive {
            return;
        }
        if n.paused {
            n.waiting.push((from, msg));
            return;
        }
        // The session must refuse whatever a fenced node sends the coordinator (checked
        // against the simulator's own record); the transport refuses it first.
        if to == COORDINATOR {
            let kind = match &msg {
                Msg::Replica(_) => SessionMsg::Replica,
                _ => SessionMsg::Other("a reply".into()),
            };
            let now = self.coord_now();
            let verdict = self.session.handle_message(from, kind, now);
            while self.session.poll_action().is_some() {}
            if self.nodes[from as usize].fenced && verdict == Verdict::Accept {
                self.violation.get_or_insert(format!(
                    "the session accepted a message from fenced node {from}"
                ));
            }
        }
        if self.nodes[from as usize].fenced {
            return;
        }
        if to == COORDINATOR {
            if let Msg::Reply {
                coord,
                id,
                part,
                reply,
            } = msg
            {
                if coord != self.coord {
                    return;
                }
                self.outstanding.remove(&id);
                let node = from;
                let result = match reply {
                    WireReply::Ok(r) => Ok(r),
                    WireReply::Panicked(message) => Err(ActorError::Panicked { part, message }),
                    WireReply::Failed(message) => Err(ActorError::Remote {
                        node,
                        part,
                        message,
                    }),
                };
                let now = self.coord_now();
                self.machine.handle_response(id, part, result, now);
            }
            return;
        }
        match msg {
            Msg::Request { coord, out } => {
                if coord != self.coord {
                    return;
                }
                self.request(to, out);
            }
            Msg::Halo(b) => {
                let part = b.header.to.0;
                let now = self.coord_now();
                if let Some(m) = self.nodes[to as usize].parts.get_mut(&part) {
                    m.handle_halo(b, now);
                    self.drain_partition(to, part);
                }
            }
            Msg::Replica(bytes) => {
                let kept = self.nodes[to as usize]
                    .replicas
                    .entry(bytes.part)
                    .or_default();
                keep_newest_two(kept, bytes);
            }
            Msg::Reply { .. } => {}
        }
    }

    /// A request reached the node hosting (or that hosted) its partition.
    fn request(&mut self, node: u32, out: Outgoing) {
        let part = out.part;
        let now = self.coord_now();
        let run = self.run;
        let Some(m) = self.nodes[node as usize].parts.get_mut(&part) else {
            let reply = WireReply::Failed(format!("partition {part} is not on node {node}"));
            let coord = self.coord;
            return self.send(
                node,
                COORDINATOR,
                Msg::Reply {
                    coord,
                    id: out.id,
                    part,
                    reply,
                },
            );
        };
        match out.request {
            Request::Step { layer, phase } => m.handle_step(
                out.id,
                Step {
                    run,
                    epoch: out.epoch,
                    layer,
                    phase,
                    trace: None,
                },
                now,
            ),
            Request::Apply { grads } => m.handle_apply(out.id, run, out.epoch, &grads, None),
            Request::Reset { rollback } => m.handle_reset(out.id, out.epoch, rollback),
        }
        self.drain_partition(node, part);
    }

    /// Executes what partition `part` on `node` asked for.
    fn drain_partition(&mut self, node: u32, part: u32) {
        loop {
            let Some(m) = self.nodes[node as usize].parts.get_mut(&part) else {
                return;
            };
            let Some(action) = m.poll_action() else {
                return;
            };
            match action {
                PartitionAction::Send(b) => {
                    if b.header.phase == Phase::Eval
                        && matches!(&b.payload, HaloPayload::Encoded(e) if codec::is_sparse(e))
                    {
                        self.sparse_eval_blocks += 1;
                    }
                    let to = self.placement[b.header.to.0 as usize];
                    self.send(node, to, Msg::Halo(b));
                }
                PartitionAction::Answer { id, result } => {
                    let reply = match result {
                        Ok(r) => WireReply::Ok(r),
                        Err(ActorError::Panicked { message, .. }) => WireReply::Panicked(message),
                        Err(e) => WireReply::Failed(e.to_string()),
                    };
                    let coord = self.coord;
                    self.send(
                        node,
                        COORDINATOR,
                        Msg::Reply {
                            coord,
                            id,
                            part,
                            reply,
                        },
                    );
                }
                PartitionAction::Replicate { snapshot, .. } => {
                    self.replicate(node, ReplicaBytes::encode(part, &snapshot));
                }
                PartitionAction::RolledBack(snapshot) => {
                    self.rollbacks += 1;
                    let bytes = ReplicaBytes::encode(part, &snapshot);
                    self.nodes[node as usize].local.insert(part, bytes);
                }
                PartitionAction::HoldResidual(held) => {
                    self.nodes[node as usize].held.insert(part, held);
                }
                PartitionAction::Restart => {
                    self.fire(SimFault::ActorPanic);
                    // The node's supervisor restarts the actor from the node's own copy.
                    let copy = self.nodes[node as usize].local.get(&part).cloned();
                    let snap = match copy.as_ref().map(ReplicaBytes::decode) {
                        Some(Ok(s)) => Some(s),
                        Some(Err(e)) => {
                            self.violation
                                .get_or_insert(format!("partition {part}'s local copy: {e}"));
                            None
                        }
                        None => None,
                    };
                    let n = &mut self.nodes[node as usize];
                    if let Some(m) = n.parts.get_mut(&part) {
                        match m.restore(snap.as_ref()) {
                            // A residual of another step than the restored one's next is
                            // ignored by the machine.
                            Ok(_) => n
                                .held
                                .get(&part)
                                .into_iter()
                                .for_each(|h| m.resume_pending(h)),
                            Err(e) => {
                                self.violation
                                    .get_or_insert(format!("restoring partition {part}: {e}"));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Executes the coordinator machine's actions.
    fn drain_coordinator(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                EpochAction::WaitGate { .. } => {
                    let now = self.coord_now();
                    self.machine.handle_gate(true, now);
                }
                EpochAction::EpochStarted { epoch } => self.epoch_faults(epoch),
                EpochAction::Send(out) => {
                    // A replayed evaluation is of the epoch before the one in progress.
                    if matches!(
                        out.request,
                        Request::Step {
                            phase: Phase::Eval,
                            ..
                        }
                    ) && out.epoch < self.machine.epoch()
                    {
                        self.eval_replay_steps += 1;
                    }
                    let node = self.placement[out.part as usize];
                    if self.lost.contains(&node) {
                        let now = self.coord_now();
                        let e = ActorError::Node {
                            node,
                            detail: "lost".into(),
                        };
                        self.machine.handle_response(out.id, out.part, Err(e), now);
                        continue;
                    }
                    self.outstanding.insert(out.id, (out.part, node));
                    let coord = self.coord;
                    self.send(COORDINATOR, node, Msg::Request { coord, out });
                }
                EpochAction::CancelRunning | EpochAction::Profile(_) => {}
                EpochAction::Committed { .. } | EpochAction::EpochDone(_) => {}
                EpochAction::ReplaceNode { node, committed } => {
                    let parts: Vec<u32> = (0..self.s.parts)
                        .filter(|&p| self.placement[p as usize] == node)
                        .collect();
                    let r = self.replace(&parts, &committed);
                    let now = self.coord_now();
                    self.machine.handle_placement(r, now);
                }
                EpochAction::MovePartition { part, committed } => {
                    let r = self.replace(&[part], &committed);
                    let now = self.coord_now();
                    self.machine.handle_placement(r, now);
                }
                EpochAction::RecoveryStarted { .. } => self.recovery_faults(),
                EpochAction::Recovered(r) => self.recoveries.push(r),
                EpochAction::Checkpoint {
                    epoch,
                    digest,
                    logs,
                } => {
                    // The coordinator's node reads the committed state from a live replica.
                    let copy = self.nodes.iter().find_map(|n| {
                        (n.alive && !n.fenced)
                            .then(|| n.local.values().chain(n.replicas.values().flatten()))
                            .into_iter()
                            .flatten()
                            .find(|b| b.epoch == epoch)
                            .cloned()
                    });
                    if let Some(bytes) = copy {
                        self.checkpoint = Some((Committed { epoch, digest }, logs, bytes));
                    }
                }
                EpochAction::Finished(done) => {
                    self.close_session(Ok(()));
                    self.outcome = Some(SimOutcome::Finished {
                        evals: super::eval_fingerprint(&done.logs),
                        digest: done.digest,
                    });
                }
                EpochAction::Failed(e) => {
                    self.close_session(Err(e.to_string()));
                    let expected = self.unrecoverable;
                    self.outcome = Some(SimOutcome::Failed {
                        error: e.to_string(),
                        expected,
                    });
                }
            }
        }
    }

    /// Fires the faults planned for the start of `epoch`.
    fn epoch_faults(&mut self, epoch: u32) {
        for i in 0..self.s.timed.len() {
            let f = self.s.timed[i];
            if f.fired || f.epoch != epoch {
                continue;
            }
            let fired = match f.fault {
                TimedFault::NodeCrash { node } => self.crash_node(node),
                TimedFault::CrashDuringRecovery { .. } => continue,
                TimedFault::CoordinatorCrash => {
                    self.coordinator_crash = true;
                    self.fire(SimFault::CoordinatorCrash);
                    true
                }
                TimedFault::StaleNodeWakes { node, pause_ms } => {
                    let n = &mut self.nodes[node as usize];
                    if !n.alive || n.paused || self.lost.contains(&node) {
                        false
                    } else {
                        n.paused = true;
                        self.failed_nodes.insert(node);
                        self.schedule(pause_ms * 1000, Event::Wake { node });
                        self.schedule(IDLE_TIMEOUT_US, Event::LossDetected { node });
                        self.fire(SimFault::StaleNodeWakes);
                        true
                    }
                }
                TimedFault::ClockJump { ms } => {
                    self.clock_offset += ms * 1000;
                    self.fire(SimFault::ClockJump);
                    true
                }
                TimedFault::LinkCut { a, b, ms } => {
                    self.net.cut(a, b, self.now + ms * 1000);
                    self.fire(SimFault::LinkCut);
                    true
                }
            };
            self.s.timed[i].fired = fired;
        }
    }

    /// Fires one planned crash-during-recovery whose epoch has come.
    fn recovery_faults(&mut self) {
        let epoch = self.machine.epoch();
        for i in 0..self.s.timed.len() {
            let f = self.s.timed[i];
            if let TimedFault::CrashDuringRecovery { node } = f.fault {
                if !f.fired && f.epoch <= epoch {
                    self.s.timed[i].fired = true;
                    if self.crash_node(node) {
                        // Counted as its own kind, not as a plain crash.
                        if let Some(n) = self.fired.get_mut(&SimFault::NodeCrash) {
                            *n -= 1;
                        }
                        self.fire(SimFault::CrashDuringRecovery);
                    }
                    return;
                }
            }
        }
    }

    /// Kills node `node`'s process; the coordinator notices after the idle timeout.
    fn crash_node(&mut self, node: u32) -> bool {
        let n = &mut self.nodes[node as usize];
        if !n.alive || self.lost.contains(&node) {
            return false;
        }
        n.alive = false;
        n.parts.clear();
        n.local.clear();
        n.replicas.clear();
        n.waiting.clear();
        self.workers.remove(&node);
        self.failed_nodes.insert(node);
        self.schedule(IDLE_TIMEOUT_US, Event::LossDetected { node });
        self.fire(SimFault::NodeCrash);
        true
    }

    /// The coordinator's failure detector: `node` has been silent for the idle timeout.
    fn loss_detected(&mut self, node: u32) {
        let n = &self.nodes[node as usize];
        if n.alive && !n.paused {
            return; // it woke in time
        }
        self.lost.insert(node);
        let failed: Vec<(RequestId, u32)> = self
            .outstanding
            .iter()
            .filter(|(_, (_, n))| *n == node)
            .map(|(id, (p, _))| (*id, *p))
            .collect();
        for (id, part) in failed {
            self.outstanding.remove(&id);
            let e = ActorError::Node {
                node,
                detail: "silent past the idle timeout".into(),
            };
            let now = self.coord_now();
            self.machine.handle_response(id, part, Err(e), now);
        }
    }

    /// Re-places `parts` on live nodes holding their replica at the committed step, fencing
    /// the nodes they ran on.
    fn replace(&mut self, parts: &[u32], committed: &Committed) -> Result<Placement, ActorError> {
        let mut moves = Vec::new();
        let mut digest_ok = true;
        for &p in parts {
            let old = self.placement[p as usize];
            if self.lost.contains(&old) {
                self.nodes[old as usize].fenced = true;
                self.session.handle_fenced(old);
            }
            let candidate = (1..self.s.nodes).find(|&n| {
                let node = &self.nodes[n as usize];
                n != old
                    && node.alive
                    && !node.paused
                    && !self.lost.contains(&n)
                    && replica_at(node, p, committed.epoch).is_some()
            });
            let Some(to) = candidate else {
                // Unavoidable only if every node that kept a replica is gone; a live replica
                // node without the committed state is a replication gap (a protocol defect).
                let live_holder = self.ring_holders(old).into_iter().find(|&n| {
                    let node = &self.nodes[n as usize];
                    // A stopped (not yet detected) holder counts as failed too.
                    node.alive && !node.paused && !self.lost.contains(&n)
                });
                // The one double fault asynchronous replication cannot survive: the owner died
                // while its replica of the committed step was still on the way (held on a cut
                // link), so no live node has it.
                let in_flight = live_holder.is_some_and(|n| {
                    self.replicas_in_flight
                        .get(&(n, p, committed.epoch))
                        .is_some_and(|&c| c > 0)
                });
                self.unrecoverable = live_holder.is_none() || in_flight;
                let why = match live_holder {
                    None => "every node keeping its replica is lost".to_string(),
                    Some(n) if in_flight => {
                        format!("its owner died before the replica reached replica node {n}")
                    }
                    Some(n) => format!(
                        "replica node {n} is live but holds {}",
                        self.nodes[n as usize].replicas.get(&p).map_or(
                            "no replica".to_string(),
                            |v| format!(
                                "steps {:?}",
                                v.iter().map(|b| b.epoch).collect::<Vec<_>>()
                            )
                        )
                    ),
                };
                return Err(ActorError::Cluster(format!(
                    "partition {p} has no live replica at step {}: {why}",
                    committed.epoch
                )));
            };
            let Some(bytes) = replica_at(&self.nodes[to as usize], p, committed.epoch) else {
                continue;
            };
            let snap = bytes.decode().map_err(ActorError::Cluster)?;
            let cfg = self
                .graph
                .config_with(self.s.model, self.s.staleness, self.s.skip);
            let state = self.graph.state_with(self.s.parts, p, &cfg)?;
            let mut m = PartitionMachine::new(state, self.run, self.faults.clone(), true);
            let restored = m.restore(Some(&snap))?;
            let want = if committed.epoch == 0 {
                initial_digest(self.graph, self.s.model).unwrap_or_default()
            } else {
                committed.digest.clone()
            };
            digest_ok &= restored.digest == want;
            if let Some(n) = self.nodes.get_mut(old as usize) {
                n.parts.remove(&p);
            }
            self.nodes[to as usize].parts.insert(p, m);
            self.placement[p as usize] = to;
            self.replicate(to, bytes);
            moves.push((p, to));
        }
        Ok(Placement { moves, digest_ok })
    }

    /// The coordinator's process dies; a new one resumes from the last checkpoint (or from
    /// the start), with new connections: every partition is rebuilt from its files and the
    /// checkpointed state.
    fn crash_coordinator(&mut self) {
        self.coord += 1;
        self.outstanding.clear();
        self.lost.clear();
        for n in &mut self.nodes {
            n.parts.clear();
            n.local.clear();
            n.replicas.clear();
            n.fenced = false;
        }
        // The operator restarts every node process with `--resume`.
        for n in self.nodes.iter_mut() {
            n.alive = true;
            n.paused = false;
            n.waiting.clear();
        }
        self.placement = (0..self.s.parts)
            .map(|p| 1 + p % (self.s.nodes - 1))
            .collect();
        self.run = RunId::from_u128(self.run.as_u128().wrapping_add(1));
        let (committed, logs, bytes) = match self.checkpoint.clone() {
            Some((c, l, b)) => (c, l, Some(b)),
            None => (Committed::default(), Vec::new(), None),
        };
        if let Some(b) = &bytes {
            match b.decode() {
                Ok(s) if s.digest == committed.digest => {}
                Ok(s) => {
                    self.violation.get_or_insert(format!(
                        "the checkpoint's state has digest {}, the coordinator committed {}",
                        s.digest, committed.digest
                    ));
                }
                Err(e) => {
                    self.violation.get_or_insert(format!("checkpoint: {e}"));
                }
            }
        }
        if let Err(e) = self.start_partitions(bytes.as_ref()) {
            self.violation
                .get_or_insert(format!("resuming from the checkpoint failed: {e}"));
            self.outcome = Some(SimOutcome::Failed {
                error: e.to_string(),
                expected: false,
            });
            return;
        }
        self.machine = Self::new_machine(self.graph, &self.s, committed, logs);
        self.open_session();
        let now = self.coord_now();
        self.machine.start(now);
    }

    /// Every recovery record must be explained by a fault that fired and, where it restored
    /// state, must have restored the committed one.
    fn check_recoveries(&mut self) {
        let panics = self.fired.get(&SimFault::ActorPanic).copied().unwrap_or(0);
        for r in &self.recoveries {
            let explained = match r.kind.as_str() {
                "actor-panic" | "escalated-move" => panics > 0,
                "node-loss" => r.node.is_some_and(|n| self.failed_nodes.contains(&n)),
                "timeout" => true,
                _ => false,
            };
            if !explained {
                self.violation.get_or_insert(format!(
                    "recovery {:?} of partition {} in epoch {} matches no fault that fired",
                    r.kind, r.partition, r.epoch
                ));
            }
            if r.digest_ok == Some(false) {
                self.violation.get_or_insert(format!(
                    "recovery {:?} of partition {} in epoch {} restored a state without the committed digest",
                    r.kind, r.partition, r.epoch
                ));
            }
        }
    }
}

/// Keeps `bytes` among the two newest steps in `kept` (a duplicate replaces its step).
fn keep_newest_two(kept: &mut Vec<ReplicaBytes>, bytes: ReplicaBytes) {
    kept.retain(|b| b.epoch != bytes.epoch);
    kept.push(bytes);
    kept.sort_by_key(|b| b.epoch);
    if kept.len() > 2 {
        kept.remove(0);
    }
}

/// The replica of partition `part` at step `epoch` kept on `node`.
fn replica_at(node: &SimNode, part: u32, epoch: u32) -> Option<ReplicaBytes> {
    node.replicas
        .get(&part)?
        .iter()
        .find(|b| b.epoch == epoch)
        .cloned()
}

/// The key of a model kind in the graph's tables.
fn model_key(kind: ModelKind) -> &'static str {
    match kind {
        ModelKind::Gcn => "gcn",
        ModelKind::Sage => "sage",
        ModelKind::Gat => "gat",
    }
}

/// The weights digest every partition of `model` starts from.
fn initial_digest(graph: &SimGraph, model: ModelKind) -> Option<String> {
    let m = trellis_runtime::Model::new(graph.config(model).model.clone()).ok()?;
    m.weights_digest(&Stream::cpu(1).ok()?).ok()
}

/// The panics of a schedule (moved out: the partition machines share them).
fn s_panics(s: &Schedule) -> FaultPlan {
    let plan = FaultPlan::none();
    let mut plan = plan;
    for p in s.panics.panics() {
        plan = if p.second_stage {
            plan.panic_in_second_stage(p.part, p.epoch, p.layer, p.phase)
        } else {
            plan.panic_at(p.part, p.epoch, p.layer, p.phase)
        };
    }
    plan
}
