//! What every node process has: a QUIC endpoint on its own tokio runtime, the control-message
//! receiver, and the partitions it hosts (loaded from files, started under a node supervisor).
use super::config::ClusterFile;
use super::proto::ControlMsg;
use crate::faults::FaultPlan;
use crate::protocol::state::{GlobalCounts, PartitionState};
use crate::replica::{
    piece_ranges, DeltaBases, FetchProgress, MirrorKey, Mirrors, MirrorsOf, ReceivedPiece,
    ReplicaBytes, ReplicaDelta, ReplicaStore, Stored,
};
use crate::shells::supervisor::NodeSupervisor;
use crate::ActorError;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::broadcast;
use trellis_gpu::{Stream, ThreadBudget};
use trellis_runtime::partition::PartitionSet;
use trellis_runtime::TrainConfig;
use trellis_transport::certs::NodeIdentity;
use trellis_transport::quic::{ControlRx, QuicError, QuicTransport};
use trellis_transport::{RunId, Transport};

/// A node's endpoint. Dropping it closes the connections and stops the QUIC runtime.
pub struct NodeEndpoint {
    pub id: u32,
    pub transport: Arc<QuicTransport>,
    rt: Option<tokio::runtime::Runtime>,
}

/// Another holder's view of a node's endpoint (a service sharing a training node's
/// endpoint): it sends and spawns on the endpoint's runtime, and neither owns nor closes it.
#[derive(Clone)]
pub struct EndpointHandle {
    pub id: u32,
    pub transport: Arc<QuicTransport>,
    rt: tokio::runtime::Handle,
}

impl EndpointHandle {
    /// Where the node listens.
    pub fn addr(&self) -> SocketAddr {
        self.transport.local_addr()
    }

    /// Queues a control message for `node`.
    pub fn send(&self, node: u32, msg: &ControlMsg) -> Result<(), ActorError> {
        send_control(&self.transport, node, msg)
    }

    /// Runs `task` on the endpoint's QUIC runtime.
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.rt.spawn(task);
    }
}

/// Queues control message `msg` for `node` on `t`; a failure names the node.
pub(crate) fn send_control(
    t: &QuicTransport,
    node: u32,
    msg: &ControlMsg,
) -> Result<(), ActorError> {
    t.send_control(node, msg.encode())
        .map_err(|e| ActorError::Node {
            node,
            detail: e.to_string(),
        })
}

/// A node's endpoint as a service that shares it gets it: a handle on it and an inbox of
/// the messages its tap takes out for the service.
pub struct SharedEndpoint {
    pub handle: EndpointHandle,
    pub inbox: ControlInbox,
}

/// Where a tap puts the messages it takes out of a node's inbox for another inbox
/// ([`ControlInbox::fed`]).
pub type InboxFeed = tokio::sync::mpsc::UnboundedSender<(u32, ControlMsg)>;

/// What arrives at a node: control messages and peer failures.
pub struct ControlInbox {
    control: Control,
    failures: broadcast::Receiver<QuicError>,
    departures: broadcast::Receiver<u32>,
}

/// The control messages of an inbox: frames as the transport delivers them, or messages a
/// tap ([`ControlInbox::tapped`]) decoded and passed on.
enum Control {
    Frames(ControlRx),
    Decoded(tokio::sync::mpsc::UnboundedReceiver<(u32, ControlMsg)>),
}

impl Control {
    /// The next decodable message (undecodable frames are logged and skipped: a bad peer
    /// cannot stop the node); `None` once the channel closed. Cancel-safe.
    async fn recv(&mut self) -> Option<(u32, ControlMsg)> {
        match self {
            Control::Frames(rx) => loop {
                let (from, bytes) = rx.recv().await?;
                match ControlMsg::decode(&bytes) {
                    Ok(msg) => return Some((from, msg)),
                    Err(e) => tracing::warn!(peer = from, "node {from}: {e}; dropped"),
                }
            },
            Control::Decoded(rx) => rx.recv().await,
        }
    }
}

/// What a training node does with the serving messages it receives (serving beside a
/// cluster's training: HTTP requests forwarded to the coordinator, their answers back).
pub type ServeTap = Arc<dyn Fn(u32, super::serving::proto::ServeEnvelope) + Send + Sync>;

/// A peer to wait for: its failure or departure (subscribed when made, so nothing after
/// that is missed).
pub struct PeerWatch {
    node: u32,
    failures: broadcast::Receiver<QuicError>,
    departures: broadcast::Receiver<u32>,
}

impl NodeEndpoint {
    /// Binds node `id` of `cluster` with its certificate; writes the bound address to
    /// `addr_file` (write-then-rename) when given.
    pub fn bind(
        cluster: &ClusterFile,
        id: u32,
        addr_file: Option<&Path>,
    ) -> Result<(Self, ControlInbox), ActorError> {
        let identity = NodeIdentity::load(&cluster.certs, id)
            .map_err(|e| ActorError::Cluster(format!("node {id}: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("trellis-quic")
            .enable_all()
            .build()
            .map_err(|e| ActorError::System(e.to_string()))?;
        let cfg = cluster.quic(id)?;
        let bind = cfg.bind;
        let (transport, control) = {
            let _guard = rt.enter();
            QuicTransport::bind(cfg, &identity).map_err(|e| {
                ActorError::Cluster(format!("node {id} cannot listen on {bind}: {e}"))
            })?
        };
        // Before the address is published, so no refusal goes uncounted.
        transport.on_refusal(Arc::new(move |_from, _reason| super::count_refusal(id)));
        let failures = transport.failures();
        let departures = transport.departures();
        if let Some(path) = addr_file {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, transport.local_addr().to_string())
                .and_then(|_| std::fs::rename(&tmp, path))
                .map_err(|e| ActorError::Cluster(format!("{}: {e}", path.display())))?;
        }
        let endpoint = NodeEndpoint {
            id,
            transport: Arc::new(transport),
            rt: Some(rt),
        };
        Ok((
            endpoint,
            ControlInbox {
                control: Control::Frames(control),
                failures,
                departures,
            },
        ))
    }

    /// Watches `node` from now on (see [`NodeEndpoint::wait_until_gone`]).
    pub fn watch(&self, node: u32) -> PeerWatch {
        PeerWatch {
            node,
            failures: self.transport.failures(),
            departures: self.transport.departures(),
        }
    }

    /// Blocks (outside any async runtime) until the watched node fails or leaves, or this
    /// node has no connection to it.
    pub fn wait_until_gone(&self, mut w: PeerWatch) {
        let Some(rt) = &self.rt else {
            return;
        };
        let t = self.transport.clone();
        rt.block_on(async move {
            loop {
                if !t.node().connected_peers().contains(&w.node) {
                    return;
                }
                tokio::select! {
                    f = w.failures.recv() => match f {
                        Ok(e) if e.node() == Some(w.node) => return,
                        Err(broadcast::error::RecvError::Closed) => return,
                        _ => {}
                    },
                    d = w.departures.recv() => match d {
                        Ok(n) if n == w.node => return,
                        Err(broadcast::error::RecvError::Closed) => return,
                        _ => {}
                    },
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
    }

    /// Runs `task` on this node's QUIC runtime (off the caller's thread).
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        if let Some(rt) = &self.rt {
            rt.spawn(task);
        }
    }

    /// Where this node listens.
    pub fn addr(&self) -> SocketAddr {
        self.transport.local_addr()
    }

    /// A view of this endpoint for a service that shares it; it must not outlive the
    /// endpoint's use (its sends fail, its tasks stop, once the endpoint is dropped).
    pub fn handle(&self) -> Result<EndpointHandle, ActorError> {
        let rt = self
            .rt
            .as_ref()
            .ok_or_else(|| ActorError::System("the node's endpoint is closed".into()))?;
        Ok(EndpointHandle {
            id: self.id,
            transport: self.transport.clone(),
            rt: rt.handle().clone(),
        })
    }

    /// Queues a control message for `node`.
    pub fn send(&self, node: u32, msg: &ControlMsg) -> Result<(), ActorError> {
        send_control(&self.transport, node, msg)
    }

    /// Waits (at most `within`) until everything queued is acknowledged.
    pub async fn flush(&self, within: Duration) {
        if let Err(e) = self.transport.flush_live(within).await {
            tracing::warn!("flush: {e}");
        }
    }
}

/// What the control inbox delivered, for the session machines' pumps.
pub(crate) enum InboxEvent {
    Message {
        from: u32,
        msg: ControlMsg,
    },
    /// The watched peer's connection failed, or it hung up.
    PeerDown {
        node: u32,
        detail: String,
    },
    /// Nothing came by the deadline.
    Timeout,
}

impl ControlInbox {
    /// This inbox with its serving messages taken out as they arrive: a task on `ep`'s QUIC
    /// runtime decodes every control message, gives each `ControlMsg::Serve` to `tap` there
    /// and passes the others on. So a training node handles serving messages while its
    /// session is busy with a step (or after its run, while the endpoint lives).
    pub fn tapped(self, ep: &NodeEndpoint, tap: ServeTap) -> ControlInbox {
        let ControlInbox {
            mut control,
            failures,
            departures,
        } = self;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        ep.spawn(async move {
            while let Some((from, msg)) = control.recv().await {
                match msg {
                    ControlMsg::Serve(env) => tap(from, env),
                    // The session may be over (the inbox dropped): the tap goes on.
                    msg => drop(tx.send((from, msg))),
                }
            }
        });
        ControlInbox {
            control: Control::Decoded(rx),
            failures,
            departures,
        }
    }

    /// An inbox of the messages sent down the returned feed (a tap's), with the peer
    /// failures and departures `t` reports from now on.
    pub fn fed(t: &QuicTransport) -> (InboxFeed, ControlInbox) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let inbox = ControlInbox {
            control: Control::Decoded(rx),
            failures: t.failures(),
            departures: t.departures(),
        };
        (tx, inbox)
    }

    /// The next message, a failure of peer `watch` (of any peer when `None`; a watched peer's
    /// departure too), or [`InboxEvent::Timeout`] at `until` (never, when `None`).
    /// Undecodable messages are logged and skipped: a bad peer cannot stop the node.
    pub(crate) async fn next_event(
        &mut self,
        watch: Option<u32>,
        until: Option<Instant>,
    ) -> Result<InboxEvent, ActorError> {
        let deadline = until.map(tokio::time::Instant::from_std);
        let timeout = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(timeout);
        loop {
            tokio::select! {
                m = self.control.recv() => match m {
                    Some((from, msg)) => return Ok(InboxEvent::Message { from, msg }),
                    None => return Err(ActorError::System("the control channel closed".into())),
                },
                f = self.failures.recv() => match f {
                    Ok(e) => match e.node() {
                        Some(n) if Some(n) == watch || watch.is_none() => {
                            return Ok(InboxEvent::PeerDown { node: n, detail: e.to_string() })
                        }
                        _ => tracing::warn!("{e}"),
                    },
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err(ActorError::System("the QUIC node closed".into()))
                    }
                },
                d = self.departures.recv() => match d {
                    Ok(n) if Some(n) == watch => {
                        let detail = "shut down and closed the connection".into();
                        return Ok(InboxEvent::PeerDown { node: n, detail });
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err(ActorError::System("the QUIC node closed".into()))
                    }
                    _ => {}
                },
                _ = &mut timeout => return Ok(InboxEvent::Timeout),
            }
        }
    }

    /// The next control message, or an error when `watch` fails (a failure of another peer
    /// is logged and skipped) or nothing arrives within `within` ([`ActorError::NoMessage`]
    /// when no node is watched).
    pub async fn next(
        &mut self,
        watch: Option<u32>,
        within: Duration,
    ) -> Result<(u32, ControlMsg), ActorError> {
        match self
            .next_event(watch, Some(Instant::now() + within))
            .await?
        {
            InboxEvent::Message { from, msg } => Ok((from, msg)),
            InboxEvent::PeerDown { node, detail } => Err(ActorError::Node { node, detail }),
            InboxEvent::Timeout => {
                let ms = within.as_millis() as u64;
                Err(match watch {
                    Some(node) => ActorError::Node {
                        node,
                        detail: format!("no message from node {node} within {ms} ms"),
                    },
                    None => ActorError::NoMessage { ms },
                })
            }
        }
    }
}

impl Drop for NodeEndpoint {
    /// Must run outside any async runtime (it blocks on closing the connections).
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            let t = self.transport.clone();
            rt.block_on(async move { t.close().await });
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Applies the link faults of `faults` due for node `me` at the start of `epoch`.
pub fn apply_link_faults(transport: &QuicTransport, faults: &FaultPlan, me: u32, epoch: u32) {
    for (peer, action) in faults.link_faults_due(me, epoch) {
        super::say(&format!(
            "chaos: node {me}, link to node {peer}: {action:?} (epoch {epoch})"
        ));
        let node = transport.node();
        let r = match action {
            crate::LinkAction::Cut(d) => node.cut_link(peer, d),
            crate::LinkAction::Delay(d) => node.delay_link(peer, d),
            crate::LinkAction::Corrupt => node.corrupt_link(peer, 1),
        };
        if let Err(e) = r {
            tracing::warn!("chaos on the link to node {peer}: {e}");
        }
    }
}

/// Ships each hosted partition's committed state to its replica nodes over QUIC
/// ([`ControlMsg::Replica`]): the next R nodes after the
/// partition's current owner in id order (the nodes that also keep it warm).
pub struct ReplicaShipper {
    transport: Arc<QuicTransport>,
    ids: Vec<u32>,
    replicas: usize,
    /// A node every replica also goes to (the one writing checkpoints of every partition's
    /// own state), if any.
    also_to: Option<u32>,
    placement: std::sync::Mutex<Vec<u32>>,
    /// When each replica not yet acknowledged was shipped.
    in_flight: std::sync::Mutex<HashMap<ShippedReplica, Instant>>,
    /// The replicas shipped that later ones can be patches against.
    bases: std::sync::Mutex<DeltaBases>,
}

/// One replica on its way: partition `part`'s state after step `epoch`, to node `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ShippedReplica {
    part: u32,
    epoch: u32,
    to: u32,
}

impl ReplicaShipper {
    pub fn new(
        transport: Arc<QuicTransport>,
        ids: Vec<u32>,
        replicas: usize,
        placement: Vec<u32>,
        also_to: Option<u32>,
    ) -> Arc<Self> {
        Arc::new(ReplicaShipper {
            transport,
            ids,
            replicas,
            also_to,
            placement: std::sync::Mutex::new(placement),
            in_flight: std::sync::Mutex::new(HashMap::new()),
            bases: std::sync::Mutex::new(DeltaBases::default()),
        })
    }

    /// Node `from` stored partition `part`'s state of step `epoch`: the transfer's time goes
    /// into the `replica_transfer` histogram.
    pub fn acked(&self, from: u32, part: u32, epoch: u32) {
        self.bases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .acked(from, part, epoch);
        let key = ShippedReplica {
            part,
            epoch,
            to: from,
        };
        let shipped = self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        if let Some(at) = shipped {
            use trellis_runtime::metrics::{names, Key, Metrics};
            let key = Key::new(names::REPLICA_TRANSFER).with("partition", part);
            Metrics::global().record(key, at.elapsed());
        }
    }

    /// Follows a re-placement: replicas go to the new owner's replica nodes.
    pub fn reroute(&self, placement: &[u32]) {
        *self.placement.lock().unwrap_or_else(|p| p.into_inner()) = placement.to_vec();
    }

    /// Sends `bytes` to the replica nodes of its partition (queued on their connections; a
    /// lost node is the failure detector's business, not this send's): to a node that
    /// acknowledged an earlier step still kept here, the bytes that changed since that step
    /// ([`ReplicaDelta`]) where that saves a quarter or more, else the whole.
    pub fn ship(&self, bytes: ReplicaBytes) {
        let owner = {
            let placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
            placement.get(bytes.part as usize).copied()
        };
        let Some(owner) = owner else {
            return;
        };
        let (part, epoch) = (bytes.part, bytes.epoch);
        let mut nodes = super::config::replica_nodes(&self.ids, owner, self.replicas);
        if let Some(c) = self.also_to.filter(|c| *c != owner && !nodes.contains(c)) {
            nodes.push(c);
        }
        // Not to a node whose connection was lost: the send would fail at every step (and
        // say so each time) while the failure detector re-places its partitions.
        let node = self.transport.node();
        nodes.retain(|&n| node.peer_failure(n).is_none_or(|e| e.is_dial_failure()));
        if nodes.is_empty() {
            return;
        }
        let bases: Vec<Option<ReplicaBytes>> = {
            let b = self.bases.lock().unwrap_or_else(|p| p.into_inner());
            nodes.iter().map(|&n| b.base_for(part, n, epoch)).collect()
        };
        // One patch per base, worked out here (the replication thread), not under a lock.
        let mut patches: Vec<(u32, Vec<Vec<u8>>)> = Vec::new();
        for base in bases.iter().flatten() {
            if patches.iter().all(|(e, _)| *e != base.epoch) {
                let d = ReplicaDelta::between(base, &bytes);
                let msgs = if d.worth_it() {
                    d.pieces()
                        .into_iter()
                        .map(|p| ControlMsg::ReplicaDelta(p).encode())
                        .collect()
                } else {
                    Vec::new()
                };
                patches.push((base.epoch, msgs));
            }
        }
        // What each node gets: a patch (its index in `patches`), or the whole (`None`).
        let uses: Vec<Option<usize>> = bases
            .iter()
            .map(|b| {
                let e = b.as_ref()?.epoch;
                patches.iter().position(|(pe, m)| *pe == e && !m.is_empty())
            })
            .collect();
        // In pieces that fit a control frame, each on a low-priority stream of its own (a
        // replica of held halo rows is hundreds of MB: it must not hold up the control
        // messages and halo blocks behind it).
        let mut whole: Vec<Vec<u8>> = if uses.contains(&None) {
            bytes
                .pieces()
                .map(|p| ControlMsg::Replica(p.into()).encode())
                .collect()
        } else {
            Vec::new()
        };
        // Kept as the base of the next patches.
        self.bases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .shipped(bytes);
        {
            let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            // Replicas of older steps that were never acknowledged (their node was lost)
            // are forgotten: at most two steps per partition are in flight.
            in_flight.retain(|k, _| k.part != part || k.epoch + 1 >= epoch);
            let now = Instant::now();
            for &to in &nodes {
                in_flight.insert(ShippedReplica { part, epoch, to }, now);
            }
        }
        for (i, (&node, set)) in nodes.iter().zip(&uses).enumerate() {
            let msgs = match set {
                Some(k) => &mut patches[*k].1,
                None => &mut whole,
            };
            // The last node to get these messages takes them; the ones before get copies.
            let msgs = if uses[i + 1..].contains(set) {
                msgs.clone()
            } else {
                std::mem::take(msgs)
            };
            self.send_all(part, node, msgs);
        }
    }

    /// Sends replica messages of partition `part` to `node`, counting their bytes.
    fn send_all(&self, part: u32, node: u32, msgs: Vec<Vec<u8>>) {
        use trellis_runtime::metrics::{names, Key, Metrics};
        let mut sent = 0;
        for m in msgs {
            sent += m.len() as u64;
            if let Err(e) = self.transport.send_bulk(node, m) {
                tracing::error!("replica of partition {part} to node {node}: {e}");
                break;
            }
        }
        let key = Key::new(names::REPLICA_WIRE_BYTES).with("partition", part);
        Metrics::global().add(key, sent);
    }

    /// Node `from` could not store partition `part`'s replica of step `epoch` (it lacks the
    /// base of the patch it got): it gets that step whole now, and whole replicas until it
    /// acknowledges one.
    pub fn refused(&self, from: u32, part: u32, epoch: u32) {
        let kept = {
            let mut b = self.bases.lock().unwrap_or_else(|p| p.into_inner());
            b.refused(from, part);
            b.kept(part, epoch)
        };
        tracing::warn!("node {from} refused the patch of partition {part}'s step {epoch}");
        if let Some(bytes) = kept {
            let msgs: Vec<Vec<u8>> = bytes
                .pieces()
                .map(|p| ControlMsg::Replica(p.into()).encode())
                .collect();
            self.send_all(part, from, msgs);
        }
    }

    /// Whether every node a replica can go to hosts a partition: then replicas leave the
    /// model and optimizer state out, each receiver completing them from its own partitions'
    /// state of the same step (see [`crate::replica`]).
    pub fn receivers_host_partitions(&self) -> bool {
        let placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
        let hosts = |n: &u32| placement.contains(n);
        self.ids.iter().all(hosts) && self.also_to.as_ref().is_none_or(hosts)
    }

    /// What each partition's next replica leaves out ([`Mirrors`]): where it goes to one node
    /// only (one replica, no checkpoint writer beside), the rows it shares with partitions on
    /// other nodes than its own (the replica node's own, completed there; a third node's,
    /// fetched from it when the partition is adopted, [`fetch_mirrors`]). `None` where
    /// replicas go to more than one node (they are then meant to survive more than one lost
    /// node, which may take a third node's rows too), so nothing is left out.
    /// `training_records`: partitions keep skip records of their training rows
    /// (`--skip-threshold` above 0).
    pub fn mirrors(self: &Arc<Self>, training_records: bool) -> Option<MirrorsOf> {
        if self.replicas != 1 || self.also_to.is_some() {
            return None;
        }
        let me = self.clone();
        Some(Arc::new(move |part| me.mirrors_of(part, training_records)))
    }

    /// The rows partition `part`'s replica leaves out now (see [`ReplicaShipper::mirrors`]).
    fn mirrors_of(&self, part: u32, training_records: bool) -> Mirrors {
        let placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
        let Some(&owner) = placement.get(part as usize) else {
            return Mirrors::default();
        };
        Mirrors {
            peers: (0..placement.len() as u32)
                .filter(|&p| placement[p as usize] != owner)
                .collect(),
            training_records,
        }
    }

    /// The node partition `part` is placed on now.
    pub fn owner(&self, part: u32) -> Option<u32> {
        let placement = self.placement.lock().unwrap_or_else(|p| p.into_inner());
        placement.get(part as usize).copied()
    }

    /// The sender a node's [`ReplicaStore`] ships through.
    pub fn sender(self: &Arc<Self>) -> crate::replica::ReplicaSender {
        let me = self.clone();
        Arc::new(move |b| me.ship(b))
    }
}

/// Takes a replica message that reached this node from node `from` (a piece of a replica or
/// of a patch, an acknowledgement, a refusal) into `store` or `shipper`. A piece is stored
/// on the store's intake thread where it has one (`ReplicaStore::receive_in_background`),
/// which then answers `from` through `transport`: an acknowledgement once a replica is
/// stored whole, a refusal when it cannot be. Other messages are left alone.
pub fn on_replica_msg(
    store: &ReplicaStore,
    shipper: &ReplicaShipper,
    transport: &Arc<QuicTransport>,
    from: u32,
    msg: ControlMsg,
) {
    let (piece, part, epoch) = match msg {
        ControlMsg::Replica(r) => {
            let (part, epoch) = (r.part, r.epoch);
            (ReceivedPiece::Whole(r.into()), part, epoch)
        }
        ControlMsg::ReplicaDelta(d) => {
            let (part, epoch) = (d.header.part, d.header.epoch);
            (ReceivedPiece::Patch(d), part, epoch)
        }
        ControlMsg::ReplicaAck { part, epoch } => return shipper.acked(from, part, epoch),
        ControlMsg::MirrorFetch { epoch, keys } => {
            return answer_mirror_fetch(store, transport, from, epoch, keys)
        }
        ControlMsg::MirrorRows {
            epoch,
            key,
            found,
            offset,
            total,
            data,
        } => return store.put_fetched(from, epoch, key, found, offset, total, data),
        ControlMsg::ReplicaNack { part, epoch } => return shipper.refused(from, part, epoch),
        _ => return,
    };
    let transport = transport.clone();
    let answer = move |stored: Stored| {
        let answer = match stored {
            Ok(Some((part, epoch))) => ControlMsg::ReplicaAck { part, epoch },
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("{e}");
                ControlMsg::ReplicaNack { part, epoch }
            }
        };
        let _ = transport.send_control(from, answer.encode());
    };
    store.receive(from, piece, Box::new(answer));
}

/// Sends node `to` the payloads `keys` of step `epoch` that this node's partitions keep
/// ([`ReplicaStore::mirror_at`]), each in pieces ([`piece_ranges`]), or that
/// it keeps none of one. Copies them out on a thread of its own, off the control loop.
fn answer_mirror_fetch(
    store: &ReplicaStore,
    transport: &Arc<QuicTransport>,
    to: u32,
    epoch: u32,
    keys: Vec<MirrorKey>,
) {
    let found: Vec<(MirrorKey, Option<Arc<[u8]>>)> = keys
        .into_iter()
        .map(|k| (k, store.mirror_at(epoch, k)))
        .collect();
    let transport = transport.clone();
    let spawned = std::thread::Builder::new()
        .name("trellis-mirror-out".into())
        .spawn(move || {
            for (key, payload) in found {
                let Some(payload) = payload else {
                    tracing::warn!(
                        peer = to,
                        "asked for rows this node does not keep: {key:?} at step {epoch}"
                    );
                    let msg = ControlMsg::MirrorRows {
                        epoch,
                        key,
                        found: false,
                        offset: 0,
                        total: 0,
                        data: Vec::new(),
                    };
                    let _ = transport.send_control(to, msg.encode());
                    continue;
                };
                for r in piece_ranges(payload.len()) {
                    let msg = ControlMsg::MirrorRows {
                        epoch,
                        key,
                        found: true,
                        offset: r.start as u64,
                        total: payload.len() as u64,
                        data: payload[r].to_vec(),
                    };
                    if transport.send_control(to, msg.encode()).is_err() {
                        return;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot answer node {to}'s fetch of replica rows: {e}");
    }
}

/// The payloads that the replicas of `parts` at step `epoch` kept in `store` left out and
/// this node's own partitions do not hold (none before the first step, which is not
/// replicated): asks the node each holder is placed on (by
/// `shipper`) for them, and returns them, to wait for with [`ReplicaStore::fetch_progress`].
/// An error names a holder placed on no live node.
pub fn fetch_mirrors(
    store: &ReplicaStore,
    shipper: &ReplicaShipper,
    transport: &QuicTransport,
    me: u32,
    parts: &[u32],
    epoch: u32,
) -> Result<Vec<MirrorKey>, ActorError> {
    let mut by_node: BTreeMap<u32, Vec<MirrorKey>> = BTreeMap::new();
    for &p in parts {
        for key in store
            .missing_mirrors(p, epoch)
            .map_err(ActorError::Cluster)?
        {
            let node = shipper
                .owner(key.holder)
                .filter(|&n| n != me)
                .ok_or_else(|| {
                    ActorError::Cluster(format!(
                        "partition {p}: its replica at step {epoch} leaves out rows partition {} holds, which is placed nowhere to fetch them from",
                        key.holder
                    ))
                })?;
            by_node.entry(node).or_default().push(key);
        }
    }
    let mut all = Vec::new();
    for (node, keys) in by_node {
        tracing::info!(
            "fetching {} payloads of step {epoch} left out of replicas from node {node}",
            keys.len()
        );
        all.extend_from_slice(&keys);
        store.expect_fetched(epoch, &keys, node);
        let msg = ControlMsg::MirrorFetch { epoch, keys };
        transport
            .send_control(node, msg.encode())
            .map_err(|e| ActorError::Node {
                node,
                detail: format!("cannot ask for replica rows: {e}"),
            })?;
    }
    Ok(all)
}

/// How long an adoption waits for the rows it fetches ([`fetch_mirrors`]).
pub const MIRROR_FETCH_WITHIN: Duration = Duration::from_secs(60);

/// Whether the rows an adoption fetched (`keys`, of step `epoch`) are all in `store`
/// (`Some(Ok)`), one cannot come or they are not all in by `until` (`Some(Err)`, naming the
/// partitions whose rows they are), or it waits on (`None`).
pub fn fetched(
    store: &ReplicaStore,
    epoch: u32,
    keys: &[MirrorKey],
    until: Instant,
) -> Option<Result<(), ActorError>> {
    match store.fetch_progress(epoch, keys) {
        FetchProgress::Done => Some(Ok(())),
        FetchProgress::Failed(why) => Some(Err(ActorError::Cluster(why))),
        FetchProgress::Waiting(left) if Instant::now() >= until => {
            let mut holders: Vec<u32> = keys.iter().map(|k| k.holder).collect();
            holders.sort_unstable();
            holders.dedup();
            Some(Err(ActorError::Cluster(format!(
                "{left} payloads left out of replicas of step {epoch} did not arrive within {} s (rows partitions {holders:?} hold, asked of the nodes they are placed on)",
                MIRROR_FETCH_WITHIN.as_secs()
            ))))
        }
        FetchProgress::Waiting(_) => None,
    }
}

/// Waits until `store` holds every payload of `keys` at step `epoch` (fetched by
/// [`fetch_mirrors`]; another task hands the answers to [`on_replica_msg`]).
pub async fn await_mirrors(
    store: &ReplicaStore,
    epoch: u32,
    keys: &[MirrorKey],
) -> Result<(), ActorError> {
    let until = Instant::now() + MIRROR_FETCH_WITHIN;
    loop {
        if let Some(outcome) = fetched(store, epoch, keys, until) {
            return outcome;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Loads partition `p` of `set` into a fresh state (initial weights) with its own stream.
pub fn load_state(
    set: &PartitionSet,
    p: u32,
    cfg: &TrainConfig,
) -> Result<PartitionState, ActorError> {
    let book = set.book();
    let counts = GlobalCounts {
        train: book.train_nodes,
        val: book.val_nodes,
        test: book.test_nodes,
    };
    let budget = ThreadBudget::global(cfg.threads)?;
    let file = set.open_part(p as usize)?;
    let stream = Stream::new(cfg.device, budget)?;
    Ok(PartitionState::new(&file, cfg, counts, stream)?)
}

/// Loads partitions `parts` of `set` and starts their actors (inside an actix system), wired
/// to `transport`; partitions elsewhere are routed through it by `placement`.
#[allow(clippy::too_many_arguments)]
pub fn host_partitions(
    set: &PartitionSet,
    parts: &[u32],
    placement: &[u32],
    me: u32,
    cfg: &TrainConfig,
    run: RunId,
    transport: Arc<QuicTransport>,
    faults: Arc<FaultPlan>,
    resume: Option<&crate::checkpoint::Checkpoint>,
    replicate: bool,
    shipper: Option<&Arc<ReplicaShipper>>,
    yield_to: Option<&trellis_gpu::PriorityGate>,
) -> Result<NodeSupervisor, ActorError> {
    let mut states = parts
        .iter()
        .map(|&p| load_state(set, p, cfg))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(gate) = yield_to {
        for s in &mut states {
            s.yield_to(gate.clone());
        }
    }
    if let Some(ck) = resume {
        for (s, &p) in states.iter_mut().zip(parts) {
            if !s.restore(&ck.snapshot_for(p))? {
                return Err(ActorError::Cluster(
                    "the checkpoint's weights do not match its digest".into(),
                ));
            }
        }
    }
    reroute(&transport, placement, me);
    transport.set_epoch(run, 0);
    let replicas = Arc::new(if replicate {
        ReplicaStore::new()
    } else {
        ReplicaStore::disabled()
    });
    replicas.receive_in_background();
    if let Some(s) = shipper {
        replicas.set_sender(s.sender(), s.receivers_host_partitions());
        if cfg.halo.skip_threshold > 0.0 || cfg.halo.skips_eval_rows() {
            if let Some(of) = s.mirrors(cfg.halo.skip_threshold > 0.0) {
                replicas.set_mirrors(of);
            }
        }
    }
    Ok(NodeSupervisor::start(
        states,
        run,
        transport as Arc<dyn Transport>,
        replicas,
        faults,
    ))
}

/// Routes every partition placed on another node to that node.
pub fn reroute(transport: &QuicTransport, placement: &[u32], me: u32) {
    route_from(transport, placement, me, 0);
}

/// Routes partition `base + p` to `placement[p]` for every `p` another node than `me` hosts
/// (`base`: where a set of partitions starts on the transport, see
/// [`SERVING_PART_BASE`](crate::cluster::serving::SERVING_PART_BASE)).
pub(crate) fn route_from(transport: &QuicTransport, placement: &[u32], me: u32, base: u32) {
    for (p, &node) in placement.iter().enumerate() {
        if node != me {
            transport.route(trellis_transport::PartId(base + p as u32), node);
        }
    }
}

/// A partition adopted here and its new actor.
pub type Adopted = (u32, crate::shells::partition::PartitionRef);

/// Warm replicas: partitions of other nodes whose static state (block, features, labels)
/// this node keeps loaded in memory, so that adopting one after a node loss only restores the
/// model state (identical on every node) and starts an actor.
#[derive(Default)]
pub struct Standby {
    states: std::collections::HashMap<u32, PartitionState>,
    /// The gate of a service beside the training (`launch --serve`): partitions adopted here
    /// yield to it as this node's own do.
    yield_to: Option<trellis_gpu::PriorityGate>,
}

impl Standby {
    /// Loads partitions `parts` of `set`.
    pub fn load(set: &PartitionSet, parts: &[u32], cfg: &TrainConfig) -> Result<Self, ActorError> {
        let mut states = std::collections::HashMap::new();
        for &p in parts {
            states.insert(p, load_state(set, p, cfg)?);
        }
        Ok(Standby {
            states,
            yield_to: None,
        })
    }

    /// Partitions adopted here yield to `gate` (see [`PartitionState::yield_to`]).
    pub fn yielding_to(mut self, gate: Option<trellis_gpu::PriorityGate>) -> Self {
        self.yield_to = gate;
        self
    }

    /// Partition `p`'s state to adopt: the warm one, else loaded from `set`; yielding to
    /// the gate of a service beside, if any.
    fn adoptable(
        &mut self,
        set: &PartitionSet,
        p: u32,
        cfg: &TrainConfig,
    ) -> Result<PartitionState, ActorError> {
        let mut state = match self.states.remove(&p) {
            Some(s) => s,
            None => load_state(set, p, cfg)?,
        };
        if let Some(gate) = &self.yield_to {
            state.yield_to(gate.clone());
        }
        Ok(state)
    }
}

/// Adopts partitions `parts` (re-placed here after a node loss) into `node`: takes each from
/// the warm `standby` (or loads it) and restores it from the replica its previous owner
/// shipped here, checked against the sender's digest, then starts its actor. Before the first
/// step the state is the initial one, which any node recomputes from the configuration.
/// Returns the new actors and whether every restored state is the committed step `epoch`
/// with weights `digest` (the coordinator's, when known).
#[allow(clippy::too_many_arguments)]
pub fn adopt_partitions(
    node: &mut NodeSupervisor,
    standby: &mut Standby,
    set: &PartitionSet,
    parts: &[u32],
    cfg: &TrainConfig,
    epoch: u32,
    digest: &str,
) -> Result<(Vec<Adopted>, bool), ActorError> {
    let mut ok = true;
    let mut out = Vec::new();
    for &p in parts {
        // Faults of the epoch in progress already fired where the partition was.
        node.faults().retire_panics(p, epoch + 1);
        let mut state = standby.adoptable(set, p, cfg)?;
        if epoch > 0 {
            let replica = node.replicas().remote_at(p, epoch).ok_or_else(|| {
                ActorError::Cluster(format!(
                    "partition {p}: this node holds no replica of its state at the committed step {epoch} (it holds steps {:?})",
                    node.replicas().remote_steps(p)
                ))
            })?;
            let snap = replica
                .decode_in(node.replicas())
                .map_err(ActorError::Cluster)?;
            state.restore(&snap)?;
        }
        let restored = state
            .model()
            .weights_digest(state.stream())
            .map_err(|source| ActorError::Compute { part: p, source })?;
        ok &= digest.is_empty() || restored == digest;
        out.push((p, node.adopt(state)));
    }
    node.replicas().clear_fetched();
    Ok((out, ok))
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::partition::{partition, PartitionMethod};
    use trellis_runtime::{DataSource, ModelKind};

    /// A partition adopted on a node that serves beside its training (`launch --serve`)
    /// yields to the service's gate as the node's own partitions do, whether its state was
    /// kept warm or is loaded at adoption; without a gate it does not.
    #[test]
    fn adopted_partitions_yield_to_the_gate_of_a_service_beside() {
        let ds = DataSource::parse("synthetic:nodes=120,degree=6,features=12,classes=4,seed=3")
            .unwrap()
            .load()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        partition(&ds, 3, PartitionMethod::Metis, 0, dir.path()).unwrap();
        let set = PartitionSet::open(dir.path()).unwrap();
        let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, 12, 4, 7);
        cfg.threads = 1;
        let gate = trellis_gpu::PriorityGate::new();
        let mut standby = Standby::load(&set, &[1], &cfg)
            .unwrap()
            .yielding_to(Some(gate));
        for p in [1, 2] {
            assert!(
                standby.adoptable(&set, p, &cfg).unwrap().stream().yields(),
                "{p}"
            );
        }
        let mut plain = Standby::load(&set, &[1], &cfg).unwrap();
        for p in [1, 2] {
            assert!(
                !plain.adoptable(&set, p, &cfg).unwrap().stream().yields(),
                "{p}"
            );
        }
    }
}
