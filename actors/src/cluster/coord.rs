//! The coordinator node: waits for every node to join, places the partitions, sends each
//! node its setup (shipping partition files on request), hosts its own partitions, drives
//! the epochs over local and remote partitions alike, and ends the run on every node.
use super::config::ClusterFile;
use super::config::{replica_nodes, replicated_by};
use super::files::serve_part;
use super::node::InboxEvent;
use super::node::{
    adopt_partitions, apply_link_faults, await_mirrors, fetch_mirrors, reroute, Standby,
};
use super::node::{
    host_partitions, on_replica_msg, ControlInbox, NodeEndpoint, ReplicaShipper, SharedEndpoint,
};
use super::proto::{ControlMsg, Setup};
use super::proto::{ReplyBody, Request};
use super::remote::{ControlClient, RemotePart};
use crate::checkpoint::{Checkpoint, CheckpointPolicy, CheckpointWriter};
use crate::kept_model::{KeptModel, KeptModels, ModelKeeper};
use crate::protocol::session::{CoordAction, CoordState, CoordinatorConfig, CoordinatorSession};
use crate::protocol::session::{SessionMsg, Verdict};
use crate::shells::coordinator::{Coordinator, NodeRecovery, Replaced, RestartPolicy};
use crate::shells::handle::PartHandle;
use crate::shells::supervisor::NodeSupervisor;
use crate::topology::{local_handles, RunEvent, TrainingRun};
use crate::ActorError;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc as tmpsc;
use tracing::Instrument;
use trellis_runtime::metrics::{Metrics, MetricsSnapshot};
use trellis_runtime::partition::PartitionSet;
use trellis_runtime::train::build_report;
use trellis_runtime::{NodeTraffic, RunReport, TrainConfig};
use trellis_transport::quic::QuicTransport;

/// A training job for a cluster.
pub struct ClusterJob {
    pub cluster: ClusterFile,
    /// The coordinator's own id.
    pub id: u32,
    pub set: PartitionSet,
    pub cfg: TrainConfig,
    /// `--chaos` spec (partition panics), applied on every node.
    pub chaos: String,
    /// Write the bound address here once listening (for launchers).
    pub addr_file: Option<PathBuf>,
    /// Durable checkpoints (written by the coordinator from its own partitions' replicas).
    pub checkpoints: Option<CheckpointPolicy>,
    /// Keep the trained models (best validation epoch, last epoch) from the coordinator's own
    /// partitions' snapshots, for [`TrainingRun::wait_with_models`].
    pub keep_models: bool,
    /// Every committed epoch's model, from the coordinator's own partitions' snapshots, goes
    /// down this channel as the epoch ends (serving beside a cluster's training publishes
    /// from it).
    pub publish: Option<mpsc::Sender<KeptModel>>,
    /// The coordinator's own partitions' streams, and those of partitions it adopts after a
    /// node loss, yield to this gate between kernel pieces (serving beside training: the
    /// service's update steps come first).
    pub yield_to: Option<trellis_gpu::PriorityGate>,
    /// Serving beside the training: the service's engine runs on this run's endpoint, and
    /// its partitions on the training nodes.
    pub serving: Option<ServingBeside>,
}

/// What a service beside a cluster's training gets from the run (`launch --serve`, the
/// coordinator's `node --serve`).
pub struct ServingBeside {
    /// Gets, once the coordinator's endpoint is bound, a handle on it and the serving
    /// messages its inbox's tap takes out (the training nodes' `Join`s, replies, forwarded
    /// HTTP requests): the service starts its engine on them.
    pub handoff: mpsc::Sender<SharedEndpoint>,
    /// Where the run leaves the coordinator's QUIC endpoint when it ends, so the service
    /// goes on after the run; it closes the endpoint once its engine has stopped (the
    /// other nodes' serving partitions and front ends then stop).
    pub endpoint: Arc<Mutex<Option<NodeEndpoint>>>,
}

impl ClusterJob {
    /// Binds the coordinator's endpoint and starts the run on its own thread: the same
    /// [`TrainingRun`] API as a single-process topology.
    pub fn spawn(self) -> Result<TrainingRun, ActorError> {
        let nodes = self.cluster.ids().iter().max().map_or(0, |m| m + 1);
        crate::faults::FaultPlan::parse(&self.chaos)?.check_reachable(
            self.cfg.epochs,
            self.set.parts() as u32,
            self.cfg.model.layers as u16,
            nodes,
        )?;
        let (endpoint, inbox) =
            NodeEndpoint::bind(&self.cluster, self.id, self.addr_file.as_deref())?;
        // Serving messages are taken out of the inbox as they arrive: to the service beside
        // the training, or, without one, refused at once (a node's `Join` is told the
        // service is over, a forwarded HTTP request gets a 503).
        let inbox = match &self.serving {
            Some(serving) => {
                let (feed, serving_inbox) = ControlInbox::fed(&endpoint.transport);
                serving
                    .handoff
                    .send(SharedEndpoint {
                        handle: endpoint.handle()?,
                        inbox: serving_inbox,
                    })
                    .map_err(|_| ActorError::System("the service beside stopped".into()))?;
                inbox.tapped(
                    &endpoint,
                    Arc::new(move |from, env| drop(feed.send((from, ControlMsg::Serve(env))))),
                )
            }
            None => inbox.tapped(
                &endpoint,
                crate::cluster::serving::remote::not_serving_tap(
                    endpoint.transport.clone(),
                    format!(
                        "node {}, the coordinator, does not serve this training (start it with --serve ADDR)",
                        self.id
                    ),
                ),
            ),
        };
        let keep_endpoint = self.serving.as_ref().map(|s| s.endpoint.clone());
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let cancel2 = cancel.clone();
        let kept: Option<Arc<Mutex<KeptModels>>> =
            (self.keep_models || self.publish.is_some()).then(Arc::default);
        let kept2 = kept.clone();
        let thread = std::thread::Builder::new()
            .name("trellis-coordinator".into())
            .spawn(move || {
                let sys = actix::System::new();
                // One trace per run: every node's spans join it through the trace context in
                // the control messages and halo blocks.
                let run_span = tracing::info_span!(
                    "run",
                    node = crate::telemetry::node_attr(),
                    partitions = self.set.parts() as i64,
                    model = %self.cfg.model.kind,
                    dataset = %self.set.book().dataset,
                );
                let trace_id = crate::telemetry::context_of(&run_span).map(|t| t.trace_id_hex());
                let before = Metrics::global().snapshot();
                let result = sys
                    .block_on(
                        drive(self, &endpoint, inbox, tx, cancel2, kept2).instrument(run_span),
                    )
                    .map(|(mut report, remote)| {
                        // This process's metrics, and those every other node sent with its Bye.
                        let mut metrics = Metrics::global().snapshot().since(&before);
                        metrics.merge(&remote);
                        report.latency = metrics.summaries();
                        report.counters = metrics.counter_values();
                        report.trace_id = trace_id;
                        report
                    });
                drop(sys);
                match keep_endpoint {
                    Some(slot) => *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(endpoint),
                    None => drop(endpoint),
                }
                result
            })
            .map_err(|e| ActorError::System(e.to_string()))?;
        Ok(TrainingRun::new(rx, cancel, thread).keeping(kept))
    }
}

/// Runs the cluster job; returns the report and the metrics the other nodes recorded.
async fn drive(
    job: ClusterJob,
    ep: &NodeEndpoint,
    mut inbox: ControlInbox,
    events: mpsc::Sender<RunEvent>,
    cancel: Arc<AtomicBool>,
    kept: Option<Arc<Mutex<KeptModels>>>,
) -> Result<(RunReport, MetricsSnapshot), ActorError> {
    let cluster = &job.cluster;
    let book = job.set.book().clone();
    let placement = cluster.placement(book.parts)?;
    let workers = cluster.workers();
    let run = uuid::Uuid::new_v4();
    let ck_lock = job.checkpoints.as_ref().map(|p| p.lock()).transpose()?;
    let resume = match &job.checkpoints {
        Some(pol) if pol.resume => Checkpoint::read(&pol.dir)?,
        _ => None,
    };
    if let (Some(ck), Some(pol)) = (&resume, &job.checkpoints) {
        ck.check_matches(&pol.dir, &job.cfg, &book.data_digest, book.parts)?;
    }
    if job.checkpoints.is_some() && cluster.replicas == 0 {
        return Err(ActorError::Cluster(
            "checkpoints are written from the replicated state: they need replicas >= 1".into(),
        ));
    }
    if kept.is_some() && (cluster.replicas == 0 || !placement.contains(&ep.id)) {
        return Err(ActorError::Cluster(
            "--save-model and --serve take the model from the coordinator's own partitions' \
             replicated state: they need replicas >= 1 and at least one partition placed on the \
             coordinator"
                .into(),
        ));
    }
    if job.checkpoints.is_some() && !placement.contains(&ep.id) {
        return Err(ActorError::Cluster(
            "checkpoints are written from the coordinator's own partitions: place at least one on it".into(),
        ));
    }

    // 1-2. The session (a pure machine, `protocol::session`): every other node joins and
    // says where it listens (nodes start in any order; one started before this node retries
    // its join until it gets through), then each loads (or fetches) its partitions and starts
    // their actors; this node hosts its own meanwhile.
    let join = Duration::from_millis(cluster.join_timeout_ms);
    let mut session = CoordinatorSession::new(
        CoordinatorConfig {
            me: ep.id,
            workers: workers.clone(),
            addr: ep.addr().to_string(),
            join_within: join,
            setup_within: join.max(Duration::from_secs(120)),
        },
        Instant::now(),
    );
    let mut addrs = BTreeMap::new();
    let mine: Vec<u32> = (0..book.parts as u32)
        .filter(|&p| placement[p as usize] == ep.id)
        .collect();
    let faults = Arc::new(crate::faults::FaultPlan::parse(&job.chaos)?);
    // Checkpoints of every partition's own state need each partition's replica here.
    let checkpoint_node = job
        .checkpoints
        .as_ref()
        .filter(|p| p.every > 0 && cluster.replicas > 0)
        .filter(|_| job.cfg.halo.holds_rows() || !job.cfg.grad_codec.is_none())
        .map(|_| ep.id);
    let shipper = ReplicaShipper::new(
        ep.transport.clone(),
        cluster.ids(),
        cluster.replicas as usize,
        placement.clone(),
        checkpoint_node,
    );
    let replicated = replicated_by(&placement, &cluster.ids(), cluster.replicas as usize, ep.id);
    // This node's partitions, and the standby data of those it keeps replicas of.
    let host_here = || -> Result<(NodeSupervisor, Standby), ActorError> {
        let local = host_partitions(
            &job.set,
            &mine,
            &placement,
            ep.id,
            &job.cfg,
            run,
            ep.transport.clone(),
            faults.clone(),
            resume.as_ref(),
            cluster.replicas > 0,
            Some(&shipper),
            job.yield_to.as_ref(),
        )?;
        if let Some(ck) = &resume {
            // Resumed: the checkpoint is every partition's committed state until the next
            // step ships its own.
            for &p in &replicated {
                local
                    .replicas()
                    .put_remote(crate::replica::ReplicaBytes::encode(p, &ck.snapshot_for(p)));
            }
        }
        let standby =
            Standby::load(&job.set, &replicated, &job.cfg)?.yielding_to(job.yield_to.clone());
        Ok((local, standby))
    };
    let mut hosted: Option<(NodeSupervisor, Standby)> = None;
    let (local, standby) = 'setup: loop {
        while let Some(action) = session.poll_action() {
            match action {
                CoordAction::Say(line) => super::say(&line),
                CoordAction::ResetPeer(node) => ep.transport.node().reset_peer(node),
                CoordAction::SendSetups { peers } => {
                    addrs = peers;
                    let setup = Setup {
                        run: *run.as_bytes(),
                        config_json: serde_json::to_string(&job.cfg).expect("a config serialises"),
                        book_json: serde_json::to_string(&book).expect("a book serialises"),
                        placement: placement.clone(),
                        peers: addrs.iter().map(|(n, a)| (*n, a.clone())).collect(),
                        deadline_ms: cluster.step_deadline_ms,
                        chaos: job.chaos.clone(),
                        replicas: cluster.replicas,
                        resume: resume.as_ref().map(|c| c.to_bytes()).unwrap_or_default(),
                        checkpoint_node,
                    };
                    for &w in &workers {
                        let addr = addrs[&w].parse().map_err(|e| ActorError::Node {
                            node: w,
                            detail: format!("bad address: {e}"),
                        })?;
                        ep.transport.add_peer(w, addr);
                        ep.send(w, &ControlMsg::Setup(setup.clone()))?;
                    }
                    match host_here() {
                        Ok(h) => hosted = Some(h),
                        Err(e) => {
                            abort(ep, &workers, &e.to_string()).await;
                            return Err(e);
                        }
                    }
                }
                CoordAction::ShipPart { to, part } => {
                    ship(ep.transport.clone(), &job.set, to, part)
                }
                CoordAction::StartTraining => match hosted.take() {
                    Some(h) => {
                        // A training run goes on without a lost node: one that comes back
                        // (restarted) is told so at its hello and ends, instead of waiting
                        // for a setup that never comes.
                        ep.transport.refuse_returns(|n| {
                            format!(
                                "node {n} was lost from this training run, which goes on \
                                 without it and does not take nodes back; start it again \
                                 for the next run (or one resumed from a checkpoint)"
                            )
                        });
                        break 'setup h;
                    }
                    None => {
                        return Err(ActorError::System(
                            "training started before the setup".into(),
                        ))
                    }
                },
                CoordAction::SendAbort { nodes, reason } => abort(ep, &nodes, &reason).await,
                CoordAction::Ignored { from, what } => {
                    tracing::warn!(peer = from, "ignored {what}")
                }
                CoordAction::Failed(e) => {
                    if let Some((local, _)) = hosted.take() {
                        local.shutdown();
                    }
                    return Err(e);
                }
                CoordAction::SendFinish { .. } | CoordAction::Done { .. } => {}
            }
        }
        let event = inbox.next_event(None, session.poll_timeout()).await?;
        let now = Instant::now();
        match event {
            InboxEvent::Message { from, msg } => {
                session.handle_message(from, msg.session(), now);
            }
            InboxEvent::PeerDown { node, detail } => session.handle_peer_down(node, &detail, now),
            InboxEvent::Timeout => session.handle_timeout(now),
        }
    };

    // 3. Train: replies and failures are dispatched to the waiting requests.
    let client = ControlClient::new(ep.transport.clone());
    let (late_tx, mut late) = tmpsc::unbounded_channel();
    let dispatcher = actix::spawn(dispatch(
        inbox,
        client.clone(),
        late_tx,
        job.set.clone(),
        local.replicas().clone(),
        shipper.clone(),
    ));
    let mut handles = local_handles(&local);
    for (p, &node) in placement.iter().enumerate() {
        if node != ep.id {
            handles.push(PartHandle::Remote(RemotePart::new(
                client.clone(),
                node,
                p as u32,
            )));
        }
    }
    handles.sort_by_key(|h| h.part());
    let local = Rc::new(RefCell::new(local));
    let live = Rc::new(RefCell::new(
        workers.iter().copied().collect::<BTreeSet<u32>>(),
    ));
    let recovery = Rc::new(ClusterRecovery {
        me: ep.id,
        ids: cluster.ids(),
        replicas: cluster.replicas as usize,
        transport: ep.transport.clone(),
        client: client.clone(),
        placement: RefCell::new(placement.clone()),
        live: live.clone(),
        local: local.clone(),
        standby: Rc::new(RefCell::new(standby)),
        set: job.set.clone(),
        cfg: job.cfg.clone(),
        shipper: shipper.clone(),
    });
    let deadline = Duration::from_millis(cluster.step_deadline_ms);
    let transport = ep.transport.clone();
    let me = ep.id;
    let mut coord = Coordinator::new(run, handles, &job.cfg, deadline, cancel)
        .with_epoch_hook(move |e| {
            if faults.kill_due(me, e) {
                super::worker::kill_self(me, e);
            }
            apply_link_faults(&transport, &faults, me, e);
            transport.set_epoch(run, e)
        })
        .with_node_recovery(recovery.clone())
        .with_max_restarts(cluster.max_restarts)
        .with_restart_policy(RestartPolicy {
            max_restarts: cluster.max_restarts_per_partition,
            window_epochs: cluster.restart_window_epochs,
        })
        .with_timeout_retry();
    let prior_logs = resume
        .as_ref()
        .map(|ck| ck.logs.clone())
        .unwrap_or_default();
    if let Some(ck) = resume {
        let s = &ck.snapshot;
        coord = coord.resumed(s.epoch, s.digest.clone(), ck.logs);
    }
    if let (Some(pol), Some(lock)) = (&job.checkpoints, ck_lock) {
        let writer = CheckpointWriter::new(
            pol,
            lock,
            local.borrow().replicas().clone(),
            job.cfg.clone(),
            book.data_digest.clone(),
            book.parts,
        );
        coord = coord.with_checkpoints(pol.every, writer.into_fn());
    }
    if let Some(into) = kept {
        let mut keeper = ModelKeeper::new(local.borrow().replicas().clone(), &prior_logs, into)
            .publishing_to(job.publish.clone());
        coord = coord.with_epoch_done(Box::new(move |log| keeper.epoch_done(log)));
    }
    let totals = (book.train_nodes, book.val_nodes, book.test_nodes);
    let outcome = coord.run_epochs(job.cfg.epochs, totals, &events).await;
    let workers: Vec<u32> = live.borrow().iter().copied().collect();
    let placement = recovery.placement.borrow().clone();
    let mine = parts_of(&placement, ep.id);

    // 4. The session ends the run on every live node (fenced ones are neither told nor
    // waited for) and collects each node's traffic and metrics from its `Bye`.
    for n in session.live() {
        if !workers.contains(&n) {
            session.handle_fenced(n);
        }
    }
    let over = outcome.as_ref().map(|_| ()).map_err(|e| e.to_string());
    session.handle_training_over(over, Instant::now());
    let mut nodes = Vec::new();
    let mut remote_metrics = MetricsSnapshot::default();
    while session.state() != &CoordState::Over {
        while let Some(action) = session.poll_action() {
            match action {
                CoordAction::SendFinish { nodes } => {
                    for w in nodes {
                        let _ = ep.send(w, &ControlMsg::Finish);
                    }
                }
                CoordAction::SendAbort { nodes, reason } => abort(ep, &nodes, &reason).await,
                CoordAction::Ignored { from, what } => tracing::warn!(peer = from, "ignored {what}"),
                CoordAction::Say(line) => super::say(&line),
                CoordAction::Done { missing_byes } if !missing_byes.is_empty() => tracing::warn!(
                    "node(s) {missing_byes:?} did not say goodbye: their traffic is not in the report"
                ),
                _ => {}
            }
        }
        // Finishing always has a deadline; without one nothing more can arrive to wait for.
        let Some(until) = session.poll_timeout() else {
            break;
        };
        let late = tokio::time::timeout_at(until.into(), late.recv()).await;
        let now = Instant::now();
        match late {
            Ok(Some(Late::Bye(bye))) => {
                if session.handle_message(bye.node, SessionMsg::Bye, now) == Verdict::Accept {
                    match MetricsSnapshot::from_bytes(&bye.metrics) {
                        Ok(m) => remote_metrics.merge(&m),
                        Err(e) => tracing::warn!(peer = bye.node, "{e}; not in the report"),
                    }
                    nodes.push(NodeTraffic {
                        node: bye.node,
                        addr: addrs.get(&bye.node).cloned().unwrap_or_default(),
                        partitions: parts_of(&placement, bye.node),
                        bytes_sent: bye.bytes_sent,
                        bytes_received: bye.bytes_received,
                    })
                }
            }
            Ok(Some(Late::Down { node, detail })) => session.handle_peer_down(node, &detail, now),
            Ok(None) => break,
            Err(_) => session.handle_timeout(now),
        }
    }
    let recoveries = std::mem::take(&mut coord.recoveries);
    drop(coord);
    drop(recovery);
    match Rc::try_unwrap(local) {
        Ok(local) => local.into_inner().shutdown(),
        Err(_) => tracing::warn!("local partitions still referenced at shutdown"),
    }
    dispatcher.abort();
    ep.transport.end_run(run);
    let stats = ep.transport.stats();
    nodes.push(NodeTraffic {
        node: ep.id,
        addr: ep.addr().to_string(),
        partitions: mine,
        bytes_sent: stats.bytes_sent,
        bytes_received: stats.bytes_received,
    });
    nodes.sort_by_key(|n| n.node);
    ep.flush(Duration::from_secs(2)).await;
    let done = outcome?;
    let mut report = build_report(
        &job.cfg,
        &book.dataset,
        &book.data_digest,
        book.parts,
        book.edge_cut as u64,
        trellis_gpu::ThreadBudget::global(job.cfg.threads)?.threads(),
        &done.best,
        done.logs,
        done.digest,
    );
    report.recoveries = serde_json::to_value(&recoveries).unwrap_or_default();
    report.nodes = nodes;
    Ok((report, remote_metrics))
}

/// Re-places a lost node's partitions on the live nodes that keep their replicas.
struct ClusterRecovery {
    me: u32,
    ids: Vec<u32>,
    replicas: usize,
    transport: Arc<QuicTransport>,
    client: Arc<ControlClient>,
    placement: RefCell<Vec<u32>>,
    live: Rc<RefCell<BTreeSet<u32>>>,
    local: Rc<RefCell<NodeSupervisor>>,
    standby: Rc<RefCell<Standby>>,
    set: PartitionSet,
    cfg: TrainConfig,
    shipper: Arc<ReplicaShipper>,
}

impl NodeRecovery for ClusterRecovery {
    fn node_lost(
        &self,
        node: u32,
        epoch: u32,
        digest: String,
    ) -> Pin<Box<dyn Future<Output = Result<Replaced, ActorError>>>> {
        let plan = self.replan(node);
        let this = self.snapshot_refs();
        Box::pin(async move {
            let moves = plan?;
            this.apply(Some(node), moves, epoch, digest).await
        })
    }

    fn move_partition(
        &self,
        part: u32,
        epoch: u32,
        digest: String,
    ) -> Pin<Box<dyn Future<Output = Result<Replaced, ActorError>>>> {
        let plan = self.replan_one(part);
        let this = self.snapshot_refs();
        Box::pin(async move {
            let (from, to) = plan?;
            // Stop the failing actor where it runs, then start it anew on `to`.
            if from == this.me {
                this.local
                    .borrow_mut()
                    .evict(trellis_transport::PartId(part));
            } else {
                let req = Request::Evict { part };
                this.client.clone().request(from, u32::MAX, req).await?;
            }
            this.apply(None, vec![(part, to)], epoch, digest).await
        })
    }
}

/// What the asynchronous part of a re-placement needs (no borrows held across awaits).
struct RecoveryRefs {
    me: u32,
    transport: Arc<QuicTransport>,
    client: Arc<ControlClient>,
    local: Rc<RefCell<NodeSupervisor>>,
    standby: Rc<RefCell<Standby>>,
    live: Rc<RefCell<BTreeSet<u32>>>,
    set: PartitionSet,
    cfg: TrainConfig,
    placement: Vec<u32>,
    shipper: Arc<ReplicaShipper>,
}

impl ClusterRecovery {
    fn snapshot_refs(&self) -> RecoveryRefs {
        RecoveryRefs {
            me: self.me,
            transport: self.transport.clone(),
            client: self.client.clone(),
            local: self.local.clone(),
            standby: self.standby.clone(),
            live: self.live.clone(),
            set: self.set.clone(),
            cfg: self.cfg.clone(),
            placement: self.placement.borrow().clone(),
            shipper: self.shipper.clone(),
        }
    }

    /// Chooses a live replica node for `part` (other than where it runs); records it.
    fn replan_one(&self, part: u32) -> Result<(u32, u32), ActorError> {
        let mut placement = self.placement.borrow_mut();
        let from = placement[part as usize];
        let live = self.live.borrow();
        let to = replica_nodes(&self.ids, from, self.replicas)
            .into_iter()
            .find(|&n| n == self.me || live.contains(&n))
            .ok_or_else(|| {
                ActorError::Cluster(format!(
                    "partition {part} keeps failing on node {from} and no live node keeps its replica to move it to"
                ))
            })?;
        placement[part as usize] = to;
        Ok((from, to))
    }

    /// Fences `node` and chooses, for each of its partitions, the first live node among the
    /// partition's replica nodes; records the new placement.
    fn replan(&self, node: u32) -> Result<Vec<(u32, u32)>, ActorError> {
        if node == self.me {
            return Err(ActorError::Cluster(
                "the coordinator's own node failed".into(),
            ));
        }
        self.live.borrow_mut().remove(&node);
        self.transport.fence(node);
        self.client.fail_node(node, "lost (fenced)".into());
        let live = self.live.borrow();
        let alive = |n: u32| n == self.me || live.contains(&n);
        let mut placement = self.placement.borrow_mut();
        let mut moves = Vec::new();
        for p in 0..placement.len() {
            if placement[p] != node {
                continue;
            }
            let holders = replica_nodes(&self.ids, node, self.replicas);
            let to = holders.iter().copied().find(|&n| alive(n)).ok_or_else(|| {
                if holders.is_empty() {
                    return ActorError::Cluster(format!(
                        "partition {p} is lost with node {node}: it has no replica (replicas = 0 in the cluster file)"
                    ));
                }
                ActorError::Cluster(format!(
                    "partition {p} is lost: node {node} hosted it and its replica nodes {holders:?} are gone too (raise `replicas` in the cluster file, or resume from a durable checkpoint)"
                ))
            })?;
            placement[p] = to;
            moves.push((p as u32, to));
        }
        Ok(moves)
    }
}

impl RecoveryRefs {
    async fn apply(
        self,
        lost: Option<u32>,
        moves: Vec<(u32, u32)>,
        epoch: u32,
        digest: String,
    ) -> Result<Replaced, ActorError> {
        let mut placement = self.placement.clone();
        for &(p, to) in &moves {
            placement[p as usize] = to;
        }
        let mut by_node: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for &(p, to) in &moves {
            by_node.entry(to).or_default().push(p);
        }
        let mut handles = Vec::new();
        let mut digest_ok = true;
        for (to, parts) in by_node {
            if to == self.me {
                let store = self.local.borrow().replicas().clone();
                let keys = fetch_mirrors(
                    &store,
                    &self.shipper,
                    &self.transport,
                    self.me,
                    &parts,
                    epoch,
                )?;
                await_mirrors(&store, epoch, &keys).await?;
                let (addrs, ok) = adopt_partitions(
                    &mut self.local.borrow_mut(),
                    &mut self.standby.borrow_mut(),
                    &self.set,
                    &parts,
                    &self.cfg,
                    epoch,
                    &digest,
                )?;
                digest_ok &= ok;
                handles.extend(
                    addrs
                        .into_iter()
                        .map(|(part, addr)| PartHandle::Local { part, addr }),
                );
                continue;
            }
            let req = Request::Adopt {
                parts: parts.clone(),
                epoch,
                digest: digest.clone(),
            };
            match self.client.clone().request(to, u32::MAX, req).await? {
                ReplyBody::Adopted { digest_ok: ok } => digest_ok &= ok,
                other => {
                    return Err(other.error(to, parts[0]).unwrap_or(ActorError::Node {
                        node: to,
                        detail: format!("answered {other:?} to an adoption"),
                    }))
                }
            }
            handles.extend(
                parts
                    .iter()
                    .map(|&p| PartHandle::Remote(RemotePart::new(self.client.clone(), to, p))),
            );
        }
        // Every live node routes to the new places and refuses the lost node from now on.
        reroute(&self.transport, &placement, self.me);
        self.shipper.reroute(&placement);
        let live: Vec<u32> = self.live.borrow().iter().copied().collect();
        for n in live {
            let req = Request::Reroute {
                placement: placement.clone(),
                fenced: lost.into_iter().collect(),
            };
            self.client.clone().request(n, u32::MAX, req).await?;
        }
        Ok(Replaced {
            handles,
            moves,
            digest_ok,
        })
    }
}

/// Ships partition file `part` to node `to` (any node of the cluster may keep any partition's
/// replica; the transport has already authenticated it).
fn ship(transport: Arc<QuicTransport>, set: &PartitionSet, to: u32, part: u32) {
    match set.book().partitions.get(part as usize) {
        Some(info) => serve_part(transport, to, set.dir().to_path_buf(), info.clone()),
        None => tracing::warn!(
            peer = to,
            "node {to} asked for partition {part}, which does not exist"
        ),
    }
}

fn parts_of(placement: &[u32], node: u32) -> Vec<u32> {
    (0..placement.len() as u32)
        .filter(|&p| placement[p as usize] == node)
        .collect()
}

/// Tells every node the run failed (best effort, bounded).
async fn abort(ep: &NodeEndpoint, workers: &[u32], reason: &str) {
    for &w in workers {
        let reason = reason.to_string();
        let _ = ep.send(w, &ControlMsg::Abort { reason });
    }
    ep.flush(Duration::from_secs(1)).await;
}

/// What the dispatcher passes on to the end of the run.
enum Late {
    Bye(Bye),
    /// A node's connection failed (also told to the requests waiting on it).
    Down {
        node: u32,
        detail: String,
    },
}

/// A node's last words: its traffic and the metrics it recorded.
struct Bye {
    node: u32,
    bytes_sent: u64,
    bytes_received: u64,
    metrics: Vec<u8>,
}

/// Routes what arrives during training: replies to their requests, node failures to the
/// requests waiting on those nodes, `Bye`s to the end of the run.
async fn dispatch(
    mut inbox: ControlInbox,
    client: Arc<ControlClient>,
    late: tmpsc::UnboundedSender<Late>,
    set: PartitionSet,
    replicas: Arc<crate::replica::ReplicaStore>,
    shipper: Arc<ReplicaShipper>,
) {
    loop {
        match inbox.next(None, Duration::from_secs(3600)).await {
            Ok((from, ControlMsg::Reply { id, body })) => client.on_reply(from, id, body),
            Ok((from, m)) if m.is_replica() => {
                on_replica_msg(&replicas, &shipper, client.transport(), from, m)
            }
            // A node adopting a lost node's partition may lack its file.
            Ok((from, ControlMsg::FetchPart { part })) => {
                ship(client.transport().clone(), &set, from, part)
            }
            Ok((
                from,
                ControlMsg::Bye {
                    bytes_sent,
                    bytes_received,
                    metrics,
                },
            )) => {
                let _ = late.send(Late::Bye(Bye {
                    node: from,
                    bytes_sent,
                    bytes_received,
                    metrics,
                }));
            }
            Ok((from, other)) => tracing::warn!(peer = from, "ignored {other:?}"),
            Err(ActorError::Node { node, detail }) => {
                client.fail_node(node, detail.clone());
                let _ = late.send(Late::Down { node, detail });
            }
            Err(ActorError::NoMessage { .. }) => {}
            Err(e) => {
                tracing::warn!("control dispatch ends: {e}");
                return;
            }
        }
    }
}
