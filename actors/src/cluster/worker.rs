//! A node that is not the coordinator: joins the coordinator, receives its setup (fetching
//! partition files it lacks), hosts its partition actors, and serves the coordinator's
//! requests until `Finish` (or `Abort`, or the coordinator's loss).
use super::config::replicated_by;
use super::config::ClusterFile;
use super::files::PartDownload;
use super::node::{
    adopt_partitions, apply_link_faults, host_partitions, reroute, ControlInbox, NodeEndpoint,
    ReplicaShipper, Standby,
};
use super::proto::{phase_from, ControlMsg, ReplyBody, Request, Setup};
use crate::checkpoint::Checkpoint;
use crate::faults::FaultPlan;
use crate::protocol::messages::{ApplyStep, ResetEpoch, Step};
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
use trellis_transport::{RunId, TraceContext};

/// Runs node `id` of `cluster` until the coordinator ends the run. Returns this node's
/// traffic; errors name the node or file at fault.
pub fn run_worker(
    cluster: &ClusterFile,
    id: u32,
    addr_file: Option<&Path>,
    threads: Option<usize>,
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
    let sys = actix::System::new();
    let result = sys.block_on(serve(cluster, &endpoint, inbox, threads));
    drop(sys);
    drop(endpoint);
    result
}

async fn serve(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    mut inbox: ControlInbox,
    threads: Option<usize>,
) -> Result<NodeTraffic, ActorError> {
    let coord = cluster.coordinator;
    let metrics_before = Metrics::global().snapshot();
    let setup = join_coordinator(cluster, ep, &mut inbox).await?;
    let mut hosted = match setup_node(cluster, ep, &mut inbox, &setup, threads).await {
        Ok(v) => v,
        Err(e) => {
            let _ = ep.send(
                coord,
                &ControlMsg::SetupFailed {
                    error: e.to_string(),
                },
            );
            ep.flush(Duration::from_secs(2)).await;
            return Err(e);
        }
    };
    ep.send(
        coord,
        &ControlMsg::Ready {
            parts: hosted.parts.clone(),
        },
    )?;
    // A step takes at most the deadline; allow two before calling the coordinator silent.
    let quiet = Duration::from_millis(setup.deadline_ms.saturating_mul(2).max(10_000));
    let run = hosted.run;
    let mut epoch = 0u32;
    let outcome = loop {
        match inbox.next(Some(coord), quiet).await {
            Ok((from, ControlMsg::Request { id, part, req })) if from == coord => match req {
                Request::Adopt {
                    parts,
                    epoch: committed,
                    digest,
                } => {
                    let body = match hosted
                        .adopt(ep, &mut inbox, coord, &parts, committed, &digest)
                        .await
                    {
                        Ok(digest_ok) => ReplyBody::Adopted { digest_ok },
                        Err(e) => ReplyBody::of_error(e),
                    };
                    ep.send(coord, &ControlMsg::Reply { id, body })?;
                }
                Request::Evict { part } => {
                    hosted.node.evict(trellis_transport::PartId(part));
                    hosted.addrs.remove(&part);
                    hosted.parts.retain(|&p| p != part);
                    let body = ReplyBody::Evicted;
                    ep.send(coord, &ControlMsg::Reply { id, body })?;
                }
                Request::Reroute { placement, fenced } => {
                    for n in fenced {
                        ep.transport.fence(n);
                    }
                    reroute(&ep.transport, &placement, ep.id);
                    hosted.shipper.reroute(&placement);
                    let body = ReplyBody::Rerouted;
                    ep.send(coord, &ControlMsg::Reply { id, body })?;
                }
                req => {
                    if let Request::Step { epoch: e, .. } = req {
                        if hosted.faults.kill_due(ep.id, e) {
                            kill_self(ep.id, e);
                        }
                        apply_link_faults(&ep.transport, &hosted.faults, ep.id, e);
                        if e > epoch {
                            epoch = e;
                            ep.transport.set_epoch(run, e);
                        }
                    }
                    match hosted.addrs.get(&part) {
                        Some(addr) => answer(ep, coord, id, run, addr.clone(), req),
                        None => ep.send(
                            coord,
                            &ControlMsg::Reply {
                                id,
                                body: ReplyBody::Failed {
                                    message: format!(
                                        "partition {part} is not hosted on node {}",
                                        ep.id
                                    ),
                                },
                            },
                        )?,
                    }
                }
            },
            Ok((_, ControlMsg::Replica(r))) => hosted.node.replicas().put_remote(r.into()),
            Ok((_, ControlMsg::Finish)) => break Ok(()),
            Ok((_, ControlMsg::Abort { reason })) => break Err(aborted(coord, reason)),
            Ok((from, other)) => tracing::warn!(peer = from, "ignored {other:?}"),
            Err(e) => break Err(e),
        }
    };
    let parts = hosted.parts.clone();
    hosted.node.shutdown();
    ep.transport.end_run(run);
    let stats = ep.transport.stats();
    let traffic = NodeTraffic {
        node: ep.id,
        addr: ep.addr().to_string(),
        partitions: parts,
        bytes_sent: stats.bytes_sent,
        bytes_received: stats.bytes_received,
    };
    if outcome.is_ok() {
        ep.send(
            coord,
            &ControlMsg::Bye {
                bytes_sent: traffic.bytes_sent,
                bytes_received: traffic.bytes_received,
                metrics: Metrics::global()
                    .snapshot()
                    .since(&metrics_before)
                    .to_bytes(),
            },
        )?;
        ep.flush(Duration::from_secs(5)).await;
        // Closing now could drop the Bye before it is acknowledged: the coordinator hangs up
        // first, once it has every node's Bye.
        while inbox
            .next(Some(coord), Duration::from_secs(5))
            .await
            .is_ok()
        {}
    }
    outcome.map(|_| traffic)
}

/// First wait between two attempts to reach the coordinator; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between two attempts to reach the coordinator.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Joins the coordinator and returns its setup. Nodes start in any order: while the
/// coordinator cannot be reached (not started yet, still loading its data, restarting), the
/// `Join` is sent again with exponential backoff; the node gives up when the coordinator has
/// been unreachable for the cluster's `join_timeout_ms`, which is printed once when the first
/// attempt fails. While connected, it waits for the setup as long as the coordinator waits
/// for the other nodes (the coordinator aborts the run when they do not come).
async fn join_coordinator(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
) -> Result<Setup, ActorError> {
    let coord = cluster.coordinator;
    let coord_addr = cluster.node(coord)?.addr;
    let within = Duration::from_millis(cluster.join_timeout_ms);
    let quic = ep.transport.node();
    let connected = || quic.connected_peers().contains(&coord);
    // The coordinator was last known to be up (or this node started) then.
    let mut reachable_at = Instant::now();
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let join = ControlMsg::Join {
            addr: ep.addr().to_string(),
        };
        ep.send(coord, &join)?;
        let failure = loop {
            let left = (reachable_at + within).saturating_duration_since(Instant::now());
            match inbox.next(Some(coord), left).await {
                Ok((from, ControlMsg::Setup(s))) if from == coord => return Ok(s),
                Ok((_, ControlMsg::Abort { reason })) => return Err(aborted(coord, reason)),
                Ok((from, other)) => tracing::warn!(peer = from, "ignored {other:?} before setup"),
                // Joined: the coordinator is up and waits for the other nodes.
                Err(ActorError::Node { node, .. }) if node == coord && connected() => {
                    reachable_at = Instant::now();
                }
                Err(ActorError::Node { node, detail }) if node == coord => break detail,
                Err(e) => return Err(e),
            }
        };
        // The coordinator refused this node (another process holds its id): retrying is futile.
        use trellis_transport::quic::QuicError;
        if let Some(QuicError::PeerLost { reason, .. } | QuicError::Connect { reason, .. }) =
            quic.peer_failure(coord)
        {
            if reason.starts_with(trellis_transport::quic::REFUSED_PREFIX) {
                return Err(ActorError::Node {
                    node: coord,
                    detail: format!("the coordinator at {coord_addr} {reason}"),
                });
            }
        }
        // A connection that was up and broke: the coordinator was reachable until now.
        if matches!(
            quic.peer_failure(coord),
            Some(trellis_transport::quic::QuicError::PeerLost { .. })
        ) {
            reachable_at = Instant::now();
        }
        let left = (reachable_at + within).saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ActorError::Node {
                node: coord,
                detail: format!(
                    "the coordinator at {coord_addr} did not answer within {} s \
                     (join_timeout_ms; {attempts} attempt(s)), last: {failure}",
                    within.as_secs()
                ),
            });
        }
        if attempts == 1 {
            super::say(&format!(
                "node {}: the coordinator (node {coord} at {coord_addr}) is not reachable yet \
                 ({failure}); retrying for up to {} s (join_timeout_ms)",
                ep.id,
                left.as_secs()
            ));
        }
        tokio::time::sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        quic.reset_peer(coord);
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
        Request::Reset { epoch } => Some(part.reset(ResetEpoch { epoch: *epoch })),
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
        let ck = Checkpoint::from_bytes(&setup.resume, Path::new("(received in the setup)"))?;
        Some(ck.snapshot)
    };
    let shipper = ReplicaShipper::new(
        ep.transport.clone(),
        ids.clone(),
        setup.replicas as usize,
        setup.placement.clone(),
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
    )?;
    if let Some(snap) = &resume {
        // Resumed: the checkpoint is every partition's committed state until the next step
        // ships its own.
        for &p in &replicated {
            node.replicas()
                .put_remote(crate::replica::ReplicaBytes::encode(p, snap));
        }
    }
    let standby = Standby::load(&set, &replicated, &cfg)?;
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
