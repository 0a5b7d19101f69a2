//! [`QuicNode`]: the endpoint, its peers and the public node API.
use super::tls::quinn_configs;
use super::{QuicConfig, QuicError};
use crate::certs::NodeIdentity;
use crate::wire::Rejection;
use crate::{HaloBlock, MsgHeader};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::{broadcast, mpsc, Notify, Semaphore};

/// A node id (the `N` of `node-N.trellis`).
pub type NodeId = u32;

/// What a node does with what it receives. Called on the node's runtime threads.
pub trait Inbound: Send + Sync + 'static {
    /// Admission check of a halo block, before its body is received.
    fn admit(&self, from: NodeId, header: &MsgHeader) -> Result<(), Rejection>;
    /// A complete, admitted block; `block.payload` is the buffer it was received into.
    fn halo(&self, from: NodeId, block: HaloBlock);
    /// A control message.
    fn control(&self, from: NodeId, bytes: Vec<u8>);
    /// A connection from `from` was refused (already counted in [`QuicStats`] and logged):
    /// lets the owner count it where its metrics live, at once.
    fn refused(&self, _from: SocketAddr, _reason: &str) {}
}

/// Counters of a node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuicStats {
    /// Connections refused: failed TLS handshake (no or foreign certificate), bad hello.
    pub refused_handshakes: u64,
    /// Streams dropped for a malformed frame.
    pub bad_frames: u64,
    /// Halo blocks refused by the admission check (unknown partition or run, stale epoch).
    pub rejected_blocks: u64,
    pub blocks_received: u64,
    pub bytes_received: u64,
    pub blocks_sent: u64,
    pub bytes_sent: u64,
    /// Blocks this node sent that the receiving node refused, as far as the sender learnt it:
    /// a refusal arriving after the whole block was acknowledged (small blocks) is only
    /// counted and logged by the receiver.
    pub rejected_by_peer: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub refused_handshakes: AtomicU64,
    pub bad_frames: AtomicU64,
    pub rejected_blocks: AtomicU64,
    pub blocks_received: AtomicU64,
    pub bytes_received: AtomicU64,
    pub blocks_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub rejected_by_peer: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A message queued for a peer.
pub(crate) enum Outgoing {
    Halo(HaloBlock),
    Control(Vec<u8>),
    /// A control message sent on a stream of its own at low priority (bulk state such as a
    /// replica's pieces), so that it neither holds up the ordered control stream nor the
    /// halo blocks queued after it.
    Bulk(Vec<u8>),
    Pong(u64),
}

impl Outgoing {
    pub fn bytes(&self) -> u64 {
        match self {
            Outgoing::Halo(b) => b.payload_bytes(),
            Outgoing::Control(b) | Outgoing::Bulk(b) => b.len() as u64,
            Outgoing::Pong(_) => 0,
        }
    }
}

/// What the long-lived tasks share (no endpoint, no peer table: no reference cycle).
pub(crate) struct Core {
    pub cfg: QuicConfig,
    pub me: NodeId,
    /// This endpoint's process incarnation (random), said in every hello.
    pub incarnation: u64,
    pub inbound: Arc<dyn Inbound>,
    pub counters: Counters,
    pub failures: broadcast::Sender<QuicError>,
    /// Peers that closed their connection on purpose (shut down).
    pub departures: broadcast::Sender<NodeId>,
    pub rt: Handle,
    pub closing: AtomicBool,
}

/// One peer node: its send queue, connection and failure state.
pub(crate) struct Peer {
    pub node: NodeId,
    pub addr: Mutex<SocketAddr>,
    pub tx: mpsc::UnboundedSender<Outgoing>,
    /// Bytes queued and not yet handed to a stream.
    pub queued: AtomicU64,
    /// Messages queued or in flight.
    pub pending: AtomicU64,
    pub changed: Notify,
    /// Woken when the peer's address changes: a dial to the old one gives way to a dial to
    /// the new one.
    pub readdressed: Notify,
    pub failed: Mutex<Option<QuicError>>,
    pub conn: Mutex<Option<quinn::Connection>>,
    /// The process incarnation behind `conn`, from its hello.
    pub incarnation: Mutex<Option<u64>>,
    /// The incarnation of the last process of this node known lost: its connection died,
    /// a new process replaced it, or it was declared lost ([`QuicNode::declare_lost`]).
    pub lost: Mutex<Option<u64>>,
    pub dial: tokio::sync::Mutex<()>,
    /// Receive budget in KiB.
    pub budget: Arc<Semaphore>,
    /// Injected faults on this link.
    pub chaos: super::chaos::LinkChaos,
    /// The delay line of a delayed link (created on first use): messages wait there in order.
    pub delayed: Mutex<Option<mpsc::UnboundedSender<(tokio::time::Instant, Outgoing)>>>,
}

impl Peer {
    pub fn addr(&self) -> SocketAddr {
        *self.addr.lock().expect("poisoned")
    }

    pub fn failure(&self) -> Option<QuicError> {
        self.failed.lock().expect("poisoned").clone()
    }

    /// Forgets a failure (a later failure is recorded and broadcast again).
    pub fn clear_failure(&self) {
        *self.failed.lock().expect("poisoned") = None;
    }

    /// The process incarnation of the peer's current (or last) connection.
    pub fn incarnation(&self) -> Option<u64> {
        *self.incarnation.lock().expect("poisoned")
    }

    pub fn live_conn(&self) -> Option<quinn::Connection> {
        self.conn
            .lock()
            .expect("poisoned")
            .clone()
            .filter(|c| c.close_reason().is_none())
    }

    /// A message left the queue for good (sent, refused or dropped).
    pub fn settle(&self) {
        self.pending.fetch_sub(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

impl Core {
    /// Marks `peer` failed (first error wins), logs and broadcasts it.
    pub fn fail(&self, peer: &Peer, err: QuicError) {
        {
            let mut f = peer.failed.lock().expect("poisoned");
            if f.is_some() || self.closing.load(Ordering::Relaxed) {
                return;
            }
            *f = Some(err.clone());
        }
        tracing::warn!(peer = peer.node, "{err}");
        let _ = self.failures.send(err);
        peer.changed.notify_waiters();
    }
}

/// Says why a node that comes back is refused (`None`: taken): given the node and whether
/// it is a new process at a live connection's address.
pub type ReturnPolicy = Arc<dyn Fn(NodeId, bool) -> Option<String> + Send + Sync>;

pub(crate) struct Shared {
    /// [`QuicNode::refuse_returns`].
    pub returns: Mutex<Option<ReturnPolicy>>,
    pub core: Arc<Core>,
    pub endpoint: quinn::Endpoint,
    pub client: quinn::ClientConfig,
    pub addrs: RwLock<HashMap<NodeId, SocketAddr>>,
    pub peers: Mutex<HashMap<NodeId, Arc<Peer>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.core.closing.store(true, Ordering::Relaxed);
        self.endpoint
            .close(super::StopCode::Shutdown.varint(), b"shutdown");
    }
}

impl Shared {
    /// The peer entry of `node`, created (with its writer task) on first use. `seen_at` is the
    /// address of an incoming connection, used when no address was configured.
    pub fn peer(
        self: &Arc<Self>,
        node: NodeId,
        seen_at: Option<SocketAddr>,
    ) -> Result<Arc<Peer>, QuicError> {
        if self.core.closing.load(Ordering::Relaxed) {
            return Err(QuicError::Shutdown { node });
        }
        let mut peers = self.peers.lock().expect("poisoned");
        if let Some(p) = peers.get(&node) {
            return Ok(p.clone());
        }
        let known = self.addrs.read().expect("poisoned").get(&node).copied();
        let addr = known.or(seen_at).ok_or(QuicError::UnknownNode { node })?;
        let (tx, rx) = mpsc::unbounded_channel();
        let peer = Arc::new(Peer {
            node,
            addr: Mutex::new(addr),
            tx,
            queued: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            changed: Notify::new(),
            readdressed: Notify::new(),
            failed: Mutex::new(None),
            conn: Mutex::new(None),
            incarnation: Mutex::new(None),
            lost: Mutex::new(None),
            dial: tokio::sync::Mutex::new(()),
            budget: Arc::new(Semaphore::new(self.core.cfg.recv_budget_kib() as usize)),
            chaos: Default::default(),
            delayed: Mutex::new(None),
        });
        peers.insert(node, peer.clone());
        self.core
            .rt
            .spawn(super::send::writer(Arc::downgrade(self), peer.clone(), rx));
        Ok(peer)
    }

    fn enqueue(self: &Arc<Self>, node: NodeId, msg: Outgoing) -> Result<(), QuicError> {
        let peer = self.peer(node, None)?;
        match peer.failure() {
            // A dial that failed (a busy machine, a peer still starting) says nothing about
            // the peer itself: the next message dials again. Only the loss of an established
            // connection (or a refusal) sticks.
            Some(e) if e.is_dial_failure() => peer.clear_failure(),
            Some(e) => return Err(e),
            None => {}
        }
        let bytes = msg.bytes();
        let queued = peer.queued.fetch_add(bytes, Ordering::SeqCst) + bytes;
        let max = self.core.cfg.max_queued;
        if queued > max && queued != bytes {
            peer.queued.fetch_sub(bytes, Ordering::SeqCst);
            return Err(QuicError::QueueFull {
                node,
                queued: queued - bytes,
                max,
            });
        }
        peer.pending.fetch_add(1, Ordering::SeqCst);
        if peer.chaos.is_cut() {
            // An injected link cut: the message is lost.
            peer.queued.fetch_sub(bytes, Ordering::SeqCst);
            peer.settle();
            return Ok(());
        }
        let delay = peer.chaos.delay();
        if !delay.is_zero() {
            let mut line = peer.delayed.lock().expect("poisoned");
            let tx = line.get_or_insert_with(|| {
                let (tx, mut rx) = mpsc::unbounded_channel::<(tokio::time::Instant, Outgoing)>();
                let out = peer.tx.clone();
                self.core.rt.spawn(async move {
                    while let Some((at, msg)) = rx.recv().await {
                        tokio::time::sleep_until(at).await;
                        if out.send(msg).is_err() {
                            break;
                        }
                    }
                });
                tx
            });
            let at = tokio::time::Instant::now() + delay;
            if tx.send((at, msg)).is_err() {
                peer.queued.fetch_sub(bytes, Ordering::SeqCst);
                peer.settle();
                return Err(QuicError::Shutdown { node });
            }
            return Ok(());
        }
        if peer.tx.send(msg).is_err() {
            peer.queued.fetch_sub(bytes, Ordering::SeqCst);
            peer.settle();
            return Err(QuicError::Shutdown { node });
        }
        Ok(())
    }
}

/// A QUIC endpoint with one connection per peer node. Cheap to clone; the endpoint closes
/// when the last clone is dropped or on [`QuicNode::close`].
#[derive(Clone)]
pub struct QuicNode {
    shared: Arc<Shared>,
}

impl QuicNode {
    /// Binds `cfg.bind` as node `id.node`. Must be called inside a tokio runtime (multi-threaded
    /// recommended): the node's tasks run there.
    pub fn bind(
        cfg: QuicConfig,
        id: &NodeIdentity,
        inbound: Arc<dyn Inbound>,
    ) -> Result<Self, QuicError> {
        let rt = Handle::try_current()
            .map_err(|_| QuicError::Endpoint("bind needs a tokio runtime".into()))?;
        let _guard = rt.enter();
        let (server, client) = quinn_configs(&cfg, id)?;
        let endpoint_err = |e: std::io::Error| QuicError::Endpoint(format!("{}: {e}", cfg.bind));
        let socket = std::net::UdpSocket::bind(cfg.bind).map_err(endpoint_err)?;
        if cfg.socket_buffer > 0 {
            let sock = socket2::SockRef::from(&socket);
            let _ = sock.set_recv_buffer_size(cfg.socket_buffer);
            let _ = sock.set_send_buffer_size(cfg.socket_buffer);
        }
        let mut ecfg = quinn::EndpointConfig::default();
        ecfg.max_udp_payload_size(cfg.max_udp_payload.clamp(1200, 65527))
            .map_err(|e| QuicError::Endpoint(e.to_string()))?;
        let endpoint =
            quinn::Endpoint::new(ecfg, Some(server), socket, Arc::new(quinn::TokioRuntime))
                .map_err(endpoint_err)?;
        let core = Arc::new(Core {
            me: id.node,
            incarnation: uuid::Uuid::new_v4().as_u64_pair().0,
            inbound,
            counters: Counters::default(),
            failures: broadcast::channel(64).0,
            departures: broadcast::channel(64).0,
            rt: rt.clone(),
            closing: AtomicBool::new(false),
            cfg,
        });
        let shared = Arc::new(Shared {
            returns: Mutex::new(None),
            core,
            endpoint: endpoint.clone(),
            client,
            addrs: RwLock::default(),
            peers: Mutex::default(),
        });
        rt.spawn(super::conn::accept_loop(Arc::downgrade(&shared), endpoint));
        Ok(QuicNode { shared })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.shared.core.me
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared
            .endpoint
            .local_addr()
            .expect("a bound endpoint has an address")
    }

    /// The node's settings.
    pub fn config(&self) -> &QuicConfig {
        &self.shared.core.cfg
    }

    /// Records (or updates) the address of node `node`. A dial in progress to an address it
    /// no longer has is abandoned for one to the new address (a restarted process listens
    /// elsewhere; what is queued for it goes there instead of failing with the old dial).
    pub fn add_peer(&self, node: NodeId, addr: SocketAddr) {
        self.shared
            .addrs
            .write()
            .expect("poisoned")
            .insert(node, addr);
        if let Some(p) = self.shared.peers.lock().expect("poisoned").get(&node) {
            let old = std::mem::replace(&mut *p.addr.lock().expect("poisoned"), addr);
            if old != addr {
                p.readdressed.notify_waiters();
            }
        }
    }

    /// Dials `node` now (if not connected), within the connect timeout.
    pub async fn connect(&self, node: NodeId) -> Result<(), QuicError> {
        let peer = self.shared.peer(node, None)?;
        self.shared.connection(&peer).await.map(|_| ())
    }

    /// Queues `block` for `node`; returns at once. Errors if the peer already failed, the
    /// block exceeds the frame limit or the peer's queue is full.
    pub fn send_halo(&self, node: NodeId, block: HaloBlock) -> Result<(), QuicError> {
        let (bytes, max) = (block.payload_bytes(), self.shared.core.cfg.limits.max_body);
        if bytes > max {
            return Err(QuicError::TooLarge { node, bytes, max });
        }
        self.shared.enqueue(node, Outgoing::Halo(block))
    }

    /// Queues a control message for `node`. Control messages to one node arrive in order.
    pub fn send_control(&self, node: NodeId, bytes: Vec<u8>) -> Result<(), QuicError> {
        self.check_control(node, &bytes)?;
        self.shared.enqueue(node, Outgoing::Control(bytes))
    }

    /// A control message must fit the message limit (pieces carry one over the envelope
    /// limit).
    fn check_control(&self, node: NodeId, bytes: &[u8]) -> Result<(), QuicError> {
        let (len, max) = (bytes.len() as u64, self.shared.core.cfg.max_message);
        if len > max {
            return Err(QuicError::TooLarge {
                node,
                bytes: len,
                max,
            });
        }
        Ok(())
    }

    /// As [`QuicNode::send_control`], for bulk state: the message goes on a stream of its
    /// own, one at a time per peer, at a lower priority than halo blocks and the ordered
    /// control messages, so it fills the link when they leave room. Messages sent this way
    /// may arrive in any order relative to each other and to the control messages.
    pub fn send_bulk(&self, node: NodeId, bytes: Vec<u8>) -> Result<(), QuicError> {
        self.check_control(node, &bytes)?;
        self.shared.enqueue(node, Outgoing::Bulk(bytes))
    }

    /// Waits until every queued message is delivered (acknowledged), a peer fails, or `within`
    /// passes.
    pub async fn flush(&self, within: Duration) -> Result<(), QuicError> {
        self.flush_peers(within, false).await
    }

    /// As [`QuicNode::flush`], but peers that already failed are skipped instead of ending
    /// the wait: for a last message to the survivors after a failure.
    pub async fn flush_live(&self, within: Duration) -> Result<(), QuicError> {
        self.flush_peers(within, true).await
    }

    async fn flush_peers(&self, within: Duration, skip_failed: bool) -> Result<(), QuicError> {
        let peers: Vec<Arc<Peer>> = self
            .shared
            .peers
            .lock()
            .expect("poisoned")
            .values()
            .cloned()
            .collect();
        let deadline = tokio::time::Instant::now() + within;
        for peer in peers {
            loop {
                let notified = peer.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(e) = peer.failure() {
                    if skip_failed {
                        break;
                    }
                    return Err(e);
                }
                let pending = peer.pending.load(Ordering::SeqCst);
                if pending == 0 {
                    break;
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    return Err(QuicError::FlushTimeout {
                        node: peer.node,
                        pending,
                        after: within,
                    });
                }
            }
        }
        Ok(())
    }

    /// Fault injection: drop every message to and from `node` for `for_`.
    pub fn cut_link(&self, node: NodeId, for_: Duration) -> Result<(), QuicError> {
        self.shared.peer(node, None)?.chaos.cut_for(for_);
        Ok(())
    }

    /// Fault injection: every later message to `node` waits `delay` before it is sent.
    pub fn delay_link(&self, node: NodeId, delay: Duration) -> Result<(), QuicError> {
        self.shared.peer(node, None)?.chaos.set_delay(delay);
        Ok(())
    }

    /// Fault injection: the next `n` halo frames to `node` leave with corrupted headers.
    pub fn corrupt_link(&self, node: NodeId, n: u32) -> Result<(), QuicError> {
        self.shared.peer(node, None)?.chaos.corrupt_next(n);
        Ok(())
    }

    /// Peer failures, as they happen.
    pub fn failures(&self) -> broadcast::Receiver<QuicError> {
        self.shared.core.failures.subscribe()
    }

    /// Peers that closed their connection gracefully (they shut down), as it happens.
    pub fn departures(&self) -> broadcast::Receiver<NodeId> {
        self.shared.core.departures.subscribe()
    }

    /// The failure recorded for `node`, if any.
    pub fn peer_failure(&self, node: NodeId) -> Option<QuicError> {
        self.shared
            .peers
            .lock()
            .expect("poisoned")
            .get(&node)
            .and_then(|p| p.failure())
    }

    /// Forgets `node`'s failure so that later sends dial it again (e.g. after it restarted).
    pub fn reset_peer(&self, node: NodeId) {
        if let Some(p) = self.shared.peers.lock().expect("poisoned").get(&node) {
            p.clear_failure();
        }
    }

    /// The process incarnation of `node`'s current connection, if it has one.
    pub fn incarnation_of(&self, node: NodeId) -> Option<u64> {
        let peers = self.shared.peers.lock().expect("poisoned");
        let p = peers.get(&node)?;
        p.live_conn().and(p.incarnation())
    }

    /// `node` is now the process `incarnation` (another node took it back): a connection to
    /// another process of it that still looks live (its idle timeout has not passed) is
    /// dropped, so that the next message dials the node instead of going to a process that
    /// is gone and failing only at that timeout.
    pub fn expect_process(&self, node: NodeId, incarnation: u64) {
        let Some(p) = self
            .shared
            .peers
            .lock()
            .expect("poisoned")
            .get(&node)
            .cloned()
        else {
            return;
        };
        let stale = {
            let mut current = p.conn.lock().expect("poisoned");
            let other = p.incarnation().filter(|i| *i != incarnation);
            match (other, current.is_some()) {
                (Some(gone), true) => {
                    *p.lost.lock().expect("poisoned") = Some(gone);
                    current.take()
                }
                _ => None,
            }
        };
        if let Some(c) = stale {
            tracing::debug!(
                peer = node,
                "dropped the connection to a lost process of node {node}"
            );
            c.close(super::StopCode::Shutdown.varint(), b"lost");
        }
    }

    /// `node` is lost (fenced). Where the transport reported the loss, the process it
    /// found lost is known already (a new process may have replaced its connection since);
    /// else it is the one behind the current connection (a step deadline, a cut link). A
    /// new process that replaces that connection is not reported lost again.
    pub fn declare_lost(&self, node: NodeId) {
        if let Some(p) = self.shared.peers.lock().expect("poisoned").get(&node) {
            if p.failure().is_none() {
                *p.lost.lock().expect("poisoned") = p.incarnation();
            }
        }
    }

    /// From now on a node that comes back — a new process at its address, or any new
    /// connection of a node `refused(node)` names (a fenced one) — is refused at its hello
    /// with that reason (its old process still reported lost). A training run, which does
    /// not take nodes back, sets this once its nodes are set up, so a restarted node ends
    /// at once saying why instead of waiting for a setup that never comes.
    pub fn refuse_returns(&self, policy: ReturnPolicy) {
        *self.shared.returns.lock().expect("poisoned") = Some(policy);
    }

    /// Nodes with a live connection.
    pub fn connected_peers(&self) -> Vec<NodeId> {
        let peers = self.shared.peers.lock().expect("poisoned");
        let mut v: Vec<NodeId> = peers
            .values()
            .filter(|p| p.live_conn().is_some())
            .map(|p| p.node)
            .collect();
        v.sort_unstable();
        v
    }

    /// quinn's statistics of the live connection to `node` (path MTU, RTT, congestion window,
    /// lost packets...).
    pub fn connection_stats(&self, node: NodeId) -> Option<quinn::ConnectionStats> {
        let peers = self.shared.peers.lock().expect("poisoned");
        peers
            .get(&node)
            .and_then(|p| p.live_conn())
            .map(|c| c.stats())
    }

    /// The node's counters.
    pub fn stats(&self) -> QuicStats {
        let c = &self.shared.core.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QuicStats {
            refused_handshakes: l(&c.refused_handshakes),
            bad_frames: l(&c.bad_frames),
            rejected_blocks: l(&c.rejected_blocks),
            blocks_received: l(&c.blocks_received),
            bytes_received: l(&c.bytes_received),
            blocks_sent: l(&c.blocks_sent),
            bytes_sent: l(&c.bytes_sent),
            rejected_by_peer: l(&c.rejected_by_peer),
        }
    }

    /// Closes every connection gracefully and waits (at most a second) for the peers to know.
    pub async fn close(&self) {
        self.shared.core.closing.store(true, Ordering::Relaxed);
        self.shared
            .endpoint
            .close(super::StopCode::Shutdown.varint(), b"shutdown");
        let _ =
            tokio::time::timeout(Duration::from_secs(1), self.shared.endpoint.wait_idle()).await;
    }
}
