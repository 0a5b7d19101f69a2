//! A node that is not the coordinator: joins the coordinator, receives its setup (fetching
//! partition files it lacks), hosts its partition actors, and serves the coordinator's
//! requests until `Finish` (or `Abort`, or the coordinator's loss).
use super::config::replicated_by;
use super::config::ClusterFile;
use super::files::PartDownload;
use super::node::InboxEvent;
use super::node::{
    adopt_partitions, apply_link_faults, fetch_mirrors, fetched, host_partitions, on_replica_msg,
    reroute, ControlInbox, NodeEndpoint, ReplicaShipper, Standby, MIRROR_FETCH_WITHIN,
};
use super::proto::{phase_from, ControlMsg, ReplyBody, Request, Setup};
use crate::checkpoint::Checkpoint;
use crate::cluster::serving::node::host_beside_training;
use crate::cluster::serving::HttpUplink;
use crate::faults::FaultPlan;
use crate::protocol::messages::{ApplyStep, ResetEpoch, Step};
use crate::protocol::session::{LinkDown, Verdict, WorkerAction, WorkerConfig, WorkerSession};
use crate::shells::partition::PartitionRef;
use crate::shells::supervisor::NodeSupervisor;
use crate::ActorError;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::partition::{PartitionBook, PartitionSet};
use trellis_runtime::{NodeTraffic, TrainConfig};
use trellis_transport::quic::{QuicError, REFUSED_PREFIX};
use trellis_transport::{RunId, TraceContext};

/// Takes this node's way to the coordinator's HTTP front end (serving beside the cluster's
/// training) once the node is up: the caller starts a front end that forwards to it.
pub type OnUplink = Box<dyn FnOnce(Arc<HttpUplink>) + Send>;

/// Runs node `id` of `cluster` until the coordinator ends the run, and, when the coordinator
/// serves beside the training, the serving partitions it places here until it stops
/// serving ([`host_beside_training`]). Returns this node's traffic; errors name the node
/// or file at fault. With `http`, HTTP requests this node's front end takes are forwarded
/// to the coordinator's service, during the run and after it, until the coordinator is
/// gone.
pub fn run_worker(
    cluster: &ClusterFile,
    id: u32,
    addr_file: Option<&Path>,
    threads: Option<usize>,
    http: Option<OnUplink>,
) -> Result<NodeTraffic, ActorError> {
    let coord = cluster.coordinator;
    if id == coord {
        return Err(ActorError::Cluster(format!(
            "node {id} is the coordinator; start it with training options"
        )));
    }
    let (endpoint, inbox) = NodeEndpoint::bind(cluster, id, addr_file)?;
    endpoint
        .transport
        .add_peer(coord, cluster.node(coord)?.addr);
    // Serving messages are taken out of the inbox as they arrive: answers to the HTTP
    // requests this node's front end forwarded, and the service's messages to the serving
    // partitions this node hosts beside its training when the coordinator serves.
    let uplink = http.map(|on_uplink| {
        let uplink = Arc::new(HttpUplink::new(endpoint.transport.clone(), coord));
        on_uplink(uplink.clone());
        (uplink, endpoint.watch(coord))
    });
    let (feed, serving) = ControlInbox::fed(&endpoint.transport);
    let tap = HttpUplink::training_node_tap(uplink.as_ref().map(|(u, _)| u.clone()), feed);
    let inbox = inbox.tapped(&endpoint, tap);
    // The training partitions yield to the serving partitions' update steps.
    let gate = trellis_gpu::PriorityGate::new();
    let (go, joined) = std::sync::mpsc::channel();
    let (result, hosting) = std::thread::scope(|s| {
        let host = std::thread::Builder::new()
            .name("trellis-serve-host".into())
            .spawn_scoped(s, || {
                host_beside_training(&endpoint, serving, coord, gate.clone(), joined)
            });
        let sys = actix::System::new();
        let result = sys.block_on(serve(cluster, &endpoint, inbox, threads, &gate, go));
        drop(sys);
        // The hosted serving partitions serve until the coordinator stops its service.
        let hosting = match host {
            Ok(h) => h
                .join()
                .unwrap_or_else(|_| Err(ActorError::System("the serving host panicked".into()))),
            Err(e) => Err(ActorError::System(format!(
                "cannot start the serving host thread: {e}"
            ))),
        };
        (result, hosting)
    });
    if let Err(e) = &hosting {
        eprintln!("warning: node {id}: the serving partitions beside the training: {e}");
    }
    if let (Ok(_), Some((uplink, watch))) = (&result, uplink) {
        // The coordinator goes on serving after the run: so does this node's front end.
        super::say(&format!(
            "node {id}: the run ended; forwarding HTTP to node {coord} until it stops"
        ));
        endpoint.wait_until_gone(watch);
        uplink.engine_lost("the coordinator stopped serving");
    }
    drop(endpoint);
    result
}

/// The pump of this node's [`WorkerSession`]: feeds it what the inbox delivers and carries
/// out its actions; the coordinator's requests are answered here once the session accepts
/// them.
async fn serve(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    mut inbox: ControlInbox,
    threads: Option<usize>,
    gate: &trellis_gpu::PriorityGate,
    serving_go: std::sync::mpsc::Sender<usize>,
) -> Result<NodeTraffic, ActorError> {
    // Sent once, when the training's setup came (with its kernel threads): the serving
    // host then joins the service.
    let mut serving_go = Some(serving_go);
    let coord = cluster.coordinator;
    let metrics_before = Metrics::global().snapshot();
    let quic = ep.transport.node();
    let mut session = WorkerSession::new(
        WorkerConfig {
            me: ep.id,
            coord,
            coord_addr: cluster.node(coord)?.addr.to_string(),
            join_within: Duration::from_millis(cluster.join_timeout_ms),
        },
        Instant::now(),
    );
    let mut setup: Option<Setup> = None;
    let mut hosted: Option<Hosted> = None;
    let mut traffic: Option<NodeTraffic> = None;
    // A message the session accepted, carried out after the actions it caused (an epoch's
    // faults and filter come before its first step is answered).
    let mut pending: Option<(u32, ControlMsg)> = None;
    loop {
        while let Some(action) = session.poll_action() {
            match action {
                WorkerAction::SendJoin { reset } => {
                    if reset {
                        quic.reset_peer(coord);
                    }
                    let addr = ep.addr().to_string();
                    ep.send(coord, &ControlMsg::Join { addr })?;
                }
                WorkerAction::StartSetup => {
                    let s = setup.as_ref().ok_or_else(|| {
                        ActorError::System("the session started a setup it did not get".into())
                    })?;
                    let result = setup_node(cluster, ep, &mut inbox, s, threads, gate).await;
                    let result = result.map(|h| hosted = Some(h)).map_err(|e| e.to_string());
                    session.handle_setup_done(result, Instant::now());
                }
                WorkerAction::SendReady => {
                    let parts = hosted.as_ref().map(|h| h.parts.clone()).unwrap_or_default();
                    ep.send(coord, &ControlMsg::Ready { parts })?;
                }
                WorkerAction::SendSetupFailed { error } => {
                    let _ = ep.send(coord, &ControlMsg::SetupFailed { error });
                    ep.flush(Duration::from_secs(2)).await;
                }
                WorkerAction::EpochStarted(e) => {
                    if let Some(h) = &hosted {
                        if h.faults.kill_due(ep.id, e) {
                            // The fault is the loss of a node whose replicas of the
                            // committed step reached their nodes (one lost with a replica
                            // on its way takes the step with it: a double fault).
                            h.node.replicas().wait_shipped(Duration::from_secs(10));
                            ep.flush(Duration::from_secs(10)).await;
                            kill_self(ep.id, e);
                        }
                        apply_link_faults(&ep.transport, &h.faults, ep.id, e);
                        ep.transport.set_epoch(h.run, e);
                    }
                }
                WorkerAction::SendBye => {
                    let t = stop(ep, hosted.take());
                    ep.send(
                        coord,
                        &ControlMsg::Bye {
                            bytes_sent: t.bytes_sent,
                            bytes_received: t.bytes_received,
                            metrics: Metrics::global()
                                .snapshot()
                                .since(&metrics_before)
                                .to_bytes(),
                        },
                    )?;
                    traffic = Some(t);
                    ep.flush(Duration::from_secs(5)).await;
                }
                WorkerAction::Ignored { from, what } => {
                    tracing::warn!(peer = from, "ignored {what}")
                }
                WorkerAction::Say(line) => super::say(&line),
                WorkerAction::Done => return Ok(traffic.unwrap_or_else(|| stop(ep, hosted.take()))),
                WorkerAction::Failed(e) => {
                    stop(ep, hosted.take());
                    return Err(e);
                }
            }
        }
        match (pending.take(), hosted.as_mut()) {
            (Some((from, m)), Some(h)) if m.is_replica() => {
                on_replica_msg(h.node.replicas(), &h.shipper, &ep.transport, from, m)
            }
            (Some((_, ControlMsg::Request { id, part, req })), Some(h)) => {
                on_request(ep, &mut inbox, coord, h, id, part, req).await?
            }
            _ => {}
        }
        let event = inbox
            .next_event(Some(coord), session.poll_timeout())
            .await?;
        let now = Instant::now();
        match event {
            InboxEvent::Message { from, msg } => {
                if let ControlMsg::Setup(s) = &msg {
                    if from == coord && setup.is_none() {
                        setup = Some(s.clone());
                        if let Some(go) = serving_go.take() {
                            // The serving partitions get the training's kernel threads.
                            let cfg = serde_json::from_str::<TrainConfig>(&s.config_json);
                            let _ = go.send(threads.or(cfg.ok().map(|c| c.threads)).unwrap_or(0));
                        }
                    }
                }
                if session.handle_message(from, msg.session(), now) == Verdict::Accept {
                    pending = Some((from, msg));
                }
            }
            InboxEvent::PeerDown { node, detail } if node == coord => {
                let failure = quic.peer_failure(coord);
                let refused = match &failure {
                    Some(
                        QuicError::PeerLost { reason, .. } | QuicError::Connect { reason, .. },
                    ) if reason.starts_with(REFUSED_PREFIX) => Some(reason.clone()),
                    _ => None,
                };
                let down = LinkDown {
                    detail,
                    still_connected: quic.connected_peers().contains(&coord),
                    refused,
                    was_up: matches!(failure, Some(QuicError::PeerLost { .. })),
                };
                session.handle_link_down(down, now);
            }
            InboxEvent::PeerDown { node, detail } => {
                tracing::warn!(peer = node, "node {node}: {detail}")
            }
            InboxEvent::Timeout => {
                if quic.connected_peers().contains(&coord) {
                    session.handle_coordinator_up(now);
                }
                session.handle_timeout(now);
            }
        }
    }
}

/// Answers one request of the coordinator: node requests (adopt, evict, reroute) here,
/// partition requests by the partition's actor.
async fn on_request(
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
    hosted: &mut Hosted,
    id: u64,
    part: u32,
    req: Request,
) -> Result<(), ActorError> {
    let body = match req {
        Request::Adopt {
            parts,
            epoch: committed,
            digest,
        } => match hosted
            .adopt(ep, inbox, coord, &parts, committed, &digest)
            .await
        {
            Ok(digest_ok) => ReplyBody::Adopted { digest_ok },
            Err(e) => ReplyBody::of_error(e),
        },
        Request::Evict { part } => {
            hosted.node.evict(trellis_transport::PartId(part));
            hosted.addrs.remove(&part);
            hosted.parts.retain(|&p| p != part);
            ReplyBody::Evicted
        }
        Request::Reroute { placement, fenced } => {
            for n in fenced {
                ep.transport.fence(n);
            }
            reroute(&ep.transport, &placement, ep.id);
            hosted.shipper.reroute(&placement);
            ReplyBody::Rerouted
        }
        req => match hosted.addrs.get(&part) {
            Some(addr) => {
                if let Request::Apply { epoch, .. } = &req {
                    if hosted.faults.kill_in_apply_due(ep.id, *epoch) {
                        kill_self_in_apply(ep.id, *epoch);
                    }
                }
                answer(ep, coord, id, hosted.run, addr.clone(), req);
                return Ok(());
            }
            None => ReplyBody::Failed {
                message: format!("partition {part} is not hosted on node {}", ep.id),
            },
        },
    };
    ep.send(coord, &ControlMsg::Reply { id, body })
}

/// Stops the hosted partitions and ends the run's traffic; this node's traffic.
fn stop(ep: &NodeEndpoint, hosted: Option<Hosted>) -> NodeTraffic {
    let parts = match hosted {
        Some(h) => {
            h.node.shutdown();
            ep.transport.end_run(h.run);
            h.parts
        }
        None => Vec::new(),
    };
    let stats = ep.transport.stats();
    NodeTraffic {
        node: ep.id,
        addr: ep.addr().to_string(),
        partitions: parts,
        bytes_sent: stats.bytes_sent,
        bytes_received: stats.bytes_received,
    }
}

/// A real SIGKILL of this node's process (the `kill-node` fault).
pub(crate) fn kill_self(node: u32, epoch: u32) {
    super::say(&format!(
        "chaos: node {node} kills itself (SIGKILL) at the start of epoch {epoch}"
    ));
    // SAFETY: kill(2) on our own pid with SIGKILL; no memory is involved.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// A real SIGKILL of this node's process as an optimizer step reaches it (`kill-node:...:
/// phase=apply`).
fn kill_self_in_apply(node: u32, epoch: u32) {
    super::say(&format!(
        "chaos: node {node} kills itself (SIGKILL) in the optimizer step of epoch {epoch}"
    ));
    // SAFETY: kill(2) on our own pid with SIGKILL; no memory is involved.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// What a node hosts, and what it needs to host more.
struct Hosted {
    node: NodeSupervisor,
    addrs: HashMap<u32, PartitionRef>,
    parts: Vec<u32>,
    set: PartitionSet,
    book: PartitionBook,
    cfg: TrainConfig,
    run: RunId,
    dir: PathBuf,
    faults: Arc<FaultPlan>,
    standby: Standby,
    shipper: Arc<ReplicaShipper>,
}

impl Hosted {
    /// Takes over `parts` of a lost node; answers whether the resumed state matched.
    async fn adopt(
        &mut self,
        ep: &NodeEndpoint,
        inbox: &mut ControlInbox,
        coord: u32,
        parts: &[u32],
        epoch: u32,
        digest: &str,
    ) -> Result<bool, ActorError> {
        self.set = ensure_files(&self.dir, &self.book, parts, ep, inbox, coord).await?;
        let keys = fetch_mirrors(
            self.node.replicas(),
            &self.shipper,
            &ep.transport,
            ep.id,
            parts,
            epoch,
        )?;
        self.receive_mirrors(ep, inbox, coord, epoch, &keys).await?;
        let (addrs, ok) = adopt_partitions(
            &mut self.node,
            &mut self.standby,
            &self.set,
            parts,
            &self.cfg,
            epoch,
            digest,
        )?;
        for (p, a) in addrs {
            self.addrs.insert(p, a);
            self.parts.push(p);
        }
        Ok(ok)
    }

    /// Waits until the rows [`fetch_mirrors`] asked for (`keys`, of step `epoch`) are here,
    /// storing every replica message that arrives meanwhile (the answers among them).
    async fn receive_mirrors(
        &self,
        ep: &NodeEndpoint,
        inbox: &mut ControlInbox,
        coord: u32,
        epoch: u32,
        keys: &[crate::replica::MirrorKey],
    ) -> Result<(), ActorError> {
        let store = self.node.replicas();
        let until = Instant::now() + MIRROR_FETCH_WITHIN;
        loop {
            if let Some(outcome) = fetched(store, epoch, keys, until) {
                return outcome;
            }
            match inbox.next_event(Some(coord), Some(until)).await? {
                InboxEvent::Message { from, msg } if msg.is_replica() => {
                    on_replica_msg(store, &self.shipper, &ep.transport, from, msg)
                }
                InboxEvent::Message {
                    msg: ControlMsg::Abort { reason },
                    ..
                } => return Err(aborted(coord, reason)),
                InboxEvent::Message { from, msg } => {
                    tracing::warn!(peer = from, "ignored {msg:?} while fetching replica rows")
                }
                InboxEvent::PeerDown { node, detail } if node == coord => {
                    return Err(ActorError::Node { node, detail })
                }
                InboxEvent::PeerDown { node, detail } => {
                    tracing::warn!(peer = node, "node {node}: {detail}")
                }
                // The next check says whether the rows came after all.
                InboxEvent::Timeout => {}
            }
        }
    }
}

fn aborted(coord: u32, reason: String) -> ActorError {
    ActorError::Node {
        node: coord,
        detail: format!("the coordinator aborted the run: {reason}"),
    }
}

/// Forwards one request to a local actor and sends the answer back when it comes.
fn answer(ep: &NodeEndpoint, coord: u32, id: u64, run: RunId, part: PartitionRef, req: Request) {
    let addr = part.addr.clone();
    // A reset cancels the running kernels now, not when this task is first polled.
    let reset = match &req {
        Request::Reset { epoch, rollback } => Some(part.reset(ResetEpoch {
            epoch: *epoch,
            rollback: *rollback,
        })),
        _ => None,
    };
    let transport = ep.transport.clone();
    actix::spawn(async move {
        let mailbox = |e: actix::MailboxError| ReplyBody::Failed {
            message: format!("partition mailbox: {e}"),
        };
        let body = match req {
            Request::Step {
                epoch,
                layer,
                phase,
                trace,
            } => match phase_from(phase) {
                Some(phase) => {
                    let step = Step {
                        run,
                        epoch,
                        layer,
                        phase,
                        trace: TraceContext::from_traceparent(&trace),
                    };
                    match addr.send(step).await {
                        Ok(r) => {
                            let panicked = match &r {
                                Err(ActorError::Panicked { part, .. }) => Some(*part),
                                _ => None,
                            };
                            let mut body = ReplyBody::of_step(r);
                            if let (ReplyBody::Panicked { since_ms, .. }, Some(p)) =
                                (&mut body, panicked)
                            {
                                if let Some(at) = crate::failure_clock::take(run, p) {
                                    *since_ms = at.elapsed().as_secs_f64() * 1e3;
                                }
                            }
                            body
                        }
                        Err(e) => mailbox(e),
                    }
                }
                None => ReplyBody::Failed {
                    message: format!("unknown phase code {phase}"),
                },
            },
            Request::Apply {
                epoch,
                grads,
                trace,
            } => {
                let msg = ApplyStep {
                    run,
                    epoch,
                    grads: Arc::from(grads),
                    trace: TraceContext::from_traceparent(&trace),
                };
                match addr.send(msg).await {
                    Ok(Ok(a)) => ReplyBody::Applied {
                        digest: a.digest,
                        restored: a.restored.map(|r| (r.epoch, r.digest)),
                        replica_ms: a.replica.ms,
                        replica_bytes: a.replica.bytes,
                    },
                    Ok(Err(e)) => ReplyBody::of_error(e),
                    Err(e) => mailbox(e),
                }
            }
            Request::Reset { .. } => match reset.expect("set for resets").await {
                Ok(()) => ReplyBody::Reset,
                Err(e) => mailbox(e),
            },
            Request::Adopt { .. } | Request::Reroute { .. } | Request::Evict { .. } => {
                ReplyBody::Failed {
                    message: "node requests are not for a partition".into(),
                }
            }
        };
        let msg = ControlMsg::Reply { id, body }.encode();
        if let Err(e) = transport.send_control(coord, msg) {
            tracing::warn!("cannot answer the coordinator: {e}");
        }
    });
}

/// Makes sure this node's partition files are present and match the book (fetching those
/// that are not), then starts their actors.
async fn setup_node(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    setup: &Setup,
    threads: Option<usize>,
    gate: &trellis_gpu::PriorityGate,
) -> Result<Hosted, ActorError> {
    let coord = cluster.coordinator;
    let mut cfg: TrainConfig = serde_json::from_str(&setup.config_json)
        .map_err(|e| ActorError::Cluster(format!("setup: bad training config: {e}")))?;
    if let Some(t) = threads {
        cfg.threads = t;
    }
    let book: PartitionBook = serde_json::from_str(&setup.book_json)
        .map_err(|e| ActorError::Cluster(format!("setup: bad partition book: {e}")))?;
    if setup.placement.len() != book.parts {
        return Err(ActorError::Cluster(format!(
            "setup: placement of {} partitions for a book of {}",
            setup.placement.len(),
            book.parts
        )));
    }
    for (n, addr) in &setup.peers {
        let addr = addr
            .parse()
            .map_err(|e| ActorError::Cluster(format!("setup: node {n} address {addr}: {e}")))?;
        if *n != ep.id {
            ep.transport.add_peer(*n, addr);
        }
    }
    let mine: Vec<u32> = (0..book.parts as u32)
        .filter(|&p| setup.placement[p as usize] == ep.id)
        .collect();
    // Partitions this node keeps a replica of: their files are fetched now, so adopting one
    // after a node loss needs no transfer.
    let mut ids: Vec<u32> = setup.peers.iter().map(|(n, _)| *n).collect();
    ids.sort_unstable();
    let replicated = replicated_by(&setup.placement, &ids, setup.replicas as usize, ep.id);
    let mut needed = mine.clone();
    needed.extend(&replicated);
    needed.sort_unstable();
    let dir = cluster.partitions_of(ep.id);
    let set = ensure_files(&dir, &book, &needed, ep, inbox, coord).await?;
    let run = uuid::Uuid::from_bytes(setup.run);
    let faults = Arc::new(FaultPlan::parse(&setup.chaos)?);
    let resume = if setup.resume.is_empty() {
        None
    } else {
        Some(Checkpoint::from_bytes(
            &setup.resume,
            Path::new("(received in the setup)"),
        )?)
    };
    let shipper = ReplicaShipper::new(
        ep.transport.clone(),
        ids.clone(),
        setup.replicas as usize,
        setup.placement.clone(),
        setup.checkpoint_node,
    );
    let node = host_partitions(
        &set,
        &mine,
        &setup.placement,
        ep.id,
        &cfg,
        run,
        ep.transport.clone(),
        faults.clone(),
        resume.as_ref(),
        setup.replicas > 0,
        Some(&shipper),
        Some(gate),
    )?;
    if let Some(ck) = &resume {
        // Resumed: the checkpoint is every partition's committed state until the next step
        // ships its own.
        for &p in &replicated {
            node.replicas()
                .put_remote(crate::replica::ReplicaBytes::encode(p, &ck.snapshot_for(p)));
        }
    }
    let standby = Standby::load(&set, &replicated, &cfg)?.yielding_to(Some(gate.clone()));
    let addrs = node
        .parts()
        .iter()
        .map(|p| p.0)
        .zip(node.addrs().iter().cloned())
        .collect();
    Ok(Hosted {
        node,
        addrs,
        parts: mine,
        set,
        book,
        cfg,
        run,
        dir,
        faults,
        standby,
        shipper,
    })
}

/// Opens `dir` as the partition set of `book`, fetching from the coordinator every file of
/// `parts` that is missing or does not match the book.
async fn ensure_files(
    dir: &Path,
    book: &PartitionBook,
    parts: &[u32],
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
) -> Result<PartitionSet, ActorError> {
    let same_book = PartitionBook::read(dir).is_ok_and(|b| b == *book);
    if !same_book {
        std::fs::create_dir_all(dir)
            .map_err(|e| ActorError::Cluster(format!("{}: {e}", dir.display())))?;
        book.write(dir)?;
    }
    let set = PartitionSet::open(dir)?;
    let mut downloads = BTreeMap::new();
    for &p in parts {
        if let Err(e) = set.open_part(p as usize) {
            tracing::info!("partition {p}: {e}; fetching it from node {coord}");
            downloads.insert(p, PartDownload::start(dir, &book.partitions[p as usize])?);
            ep.send(coord, &ControlMsg::FetchPart { part: p })?;
        }
    }
    let within = Duration::from_secs(120);
    while !downloads.is_empty() {
        match inbox.next(Some(coord), within).await? {
            (
                _,
                ControlMsg::PartChunk {
                    part,
                    offset,
                    total,
                    data,
                },
            ) => {
                let d = downloads.get_mut(&part).ok_or_else(|| {
                    ActorError::Cluster(format!(
                        "received partition {part}, which was not asked for"
                    ))
                })?;
                if d.chunk(offset, total, &data)? {
                    downloads.remove(&part);
                }
            }
            (_, ControlMsg::Abort { reason }) => return Err(aborted(coord, reason)),
            (from, other) => tracing::warn!(peer = from, "ignored {other:?} during setup"),
        }
    }
    // Re-open so every file is checked against the book (size and digest) before use.
    Ok(PartitionSet::open(dir)?)
}
