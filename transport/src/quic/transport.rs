//! [`QuicTransport`]: the [`Transport`] of a multi-process run, over a [`QuicNode`].
use super::node::{Inbound, NodeId, QuicNode, QuicStats};
use super::{QuicConfig, QuicError};
use crate::certs::NodeIdentity;
use crate::inproc::Deliver;
use crate::wire::{FilterStats, RecvFilter, Rejection};
use crate::{HaloBlock, MsgHeader, PartId, RunId, Transport, TransportError};
use dashmap::DashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};

/// Control messages received: (from node, bytes), in order per sending node.
pub type ControlRx = mpsc::UnboundedReceiver<(NodeId, Vec<u8>)>;

/// Told of every refused connection (the peer's address and the reason), as it happens.
pub type RefusalSink = Arc<dyn Fn(SocketAddr, &str) + Send + Sync>;

/// Told of every control message a fenced node sends (refused for everything else): a
/// service may take a restarted node back on its first message ([`QuicTransport::unfence`]).
pub type FencedSink = Arc<dyn Fn(NodeId, Vec<u8>) + Send + Sync>;

struct Dispatch {
    local: DashMap<PartId, Deliver>,
    /// Nodes declared lost: everything they send is refused (fencing).
    fenced: dashmap::DashSet<NodeId>,
    filter: Mutex<RecvFilter>,
    control: mpsc::UnboundedSender<(NodeId, Vec<u8>)>,
    on_refusal: Mutex<Option<RefusalSink>>,
    on_fenced: Mutex<Option<FencedSink>>,
}

impl Inbound for Dispatch {
    fn admit(&self, from: NodeId, header: &MsgHeader) -> Result<(), Rejection> {
        let mut filter = self.filter.lock().expect("poisoned");
        if self.fenced.contains(&from) {
            filter.count_fenced();
            return Err(Rejection::Fenced(from));
        }
        filter.check(header)
    }

    fn halo(&self, from: NodeId, block: HaloBlock) {
        let to = block.header.to;
        let deliver = self.local.get(&to).map(|d| d.clone());
        match deliver {
            Some(d) if d(block) => {}
            _ => tracing::warn!(
                peer = from,
                "partition {to} stopped accepting; dropped a block from node {from}"
            ),
        }
    }

    fn control(&self, from: NodeId, bytes: Vec<u8>) {
        if self.fenced.contains(&from) {
            let sink = self.on_fenced.lock().expect("poisoned").clone();
            match sink {
                Some(sink) => sink(from, bytes),
                None => tracing::warn!(
                    peer = from,
                    "dropped a control message from fenced node {from}"
                ),
            }
            return;
        }
        let _ = self.control.send((from, bytes));
    }

    fn refused(&self, from: SocketAddr, reason: &str) {
        let sink = self.on_refusal.lock().expect("poisoned").clone();
        if let Some(sink) = sink {
            sink(from, reason);
        }
    }
}

/// Routes halo blocks between partitions of a cluster: to local partitions directly (the
/// buffer is shared, never copied), to remote ones through the QUIC node hosting them.
pub struct QuicTransport {
    node: QuicNode,
    dispatch: Arc<Dispatch>,
    routes: DashMap<PartId, NodeId>,
    bytes: AtomicU64,
}

impl QuicTransport {
    /// Binds node `id.node` on `cfg.bind` (inside a tokio runtime). Returns the transport and
    /// the receiver of control messages.
    pub fn bind(cfg: QuicConfig, id: &NodeIdentity) -> Result<(Self, ControlRx), QuicError> {
        let (control, rx) = mpsc::unbounded_channel();
        let dispatch = Arc::new(Dispatch {
            local: DashMap::new(),
            fenced: dashmap::DashSet::new(),
            filter: Mutex::default(),
            control,
            on_refusal: Mutex::new(None),
            on_fenced: Mutex::new(None),
        });
        let node = QuicNode::bind(cfg, id, dispatch.clone())?;
        Ok((
            QuicTransport {
                node,
                dispatch,
                routes: DashMap::new(),
                bytes: AtomicU64::new(0),
            },
            rx,
        ))
    }

    /// The underlying node (connections, control messages, failures, counters).
    pub fn node(&self) -> &QuicNode {
        &self.node
    }

    /// This node's bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.node.local_addr()
    }

    /// Calls `sink` for every connection refused from now on (the counts in
    /// [`QuicStats::refused_handshakes`] include those before).
    pub fn on_refusal(&self, sink: RefusalSink) {
        *self.dispatch.on_refusal.lock().expect("poisoned") = Some(sink);
    }

    /// Records where node `node` listens.
    pub fn add_peer(&self, node: NodeId, addr: SocketAddr) {
        self.node.add_peer(node, addr);
    }

    /// Partition `part` is hosted by remote node `node`.
    pub fn route(&self, part: PartId, node: NodeId) {
        self.routes.insert(part, node);
    }

    /// Fences `node` (declared lost): its blocks and control messages are refused from now
    /// on, even if it comes back, and routes to it are dropped.
    pub fn fence(&self, node: NodeId) {
        self.dispatch.fenced.insert(node);
        self.node().declare_lost(node);
        self.routes.retain(|_, n| *n != node);
    }

    /// Takes back `node`, fenced before (a restarted process of it joined again): its
    /// blocks and control messages are admitted again; routes to it are set anew.
    pub fn unfence(&self, node: NodeId) {
        self.dispatch.fenced.remove(&node);
    }

    /// From now on a node that comes back — a new process at its address, or a new
    /// connection of a fenced node — is refused at its hello, told `why(node)`
    /// ([`QuicNode::refuse_returns`]).
    pub fn refuse_returns(&self, why: impl Fn(NodeId) -> String + Send + Sync + 'static) {
        let dispatch = self.dispatch.clone();
        self.node().refuse_returns(Arc::new(move |node, restart| {
            (restart || dispatch.fenced.contains(&node)).then(|| why(node))
        }));
    }

    /// Gives every control message of a fenced node to `sink` instead of dropping it.
    pub fn on_fenced_control(&self, sink: FencedSink) {
        *self.dispatch.on_fenced.lock().expect("poisoned") = Some(sink);
    }

    /// Sets `run`'s current epoch: blocks of older epochs are refused. A run's blocks are
    /// refused until this is called for it.
    pub fn set_epoch(&self, run: RunId, epoch: u32) {
        self.dispatch
            .filter
            .lock()
            .expect("poisoned")
            .set_epoch(run, epoch);
    }

    /// Ends `run`: its blocks are refused from now on.
    pub fn end_run(&self, run: RunId) {
        self.dispatch.filter.lock().expect("poisoned").end_run(run);
    }

    /// Dials `node` now, within the connect timeout.
    pub async fn connect(&self, node: NodeId) -> Result<(), QuicError> {
        self.node.connect(node).await
    }

    /// Queues a control message for `node`.
    pub fn send_control(&self, node: NodeId, bytes: Vec<u8>) -> Result<(), QuicError> {
        self.node.send_control(node, bytes)
    }

    /// Sends bulk state as a control message at low priority ([`QuicNode::send_bulk`]).
    pub fn send_bulk(&self, node: NodeId, bytes: Vec<u8>) -> Result<(), QuicError> {
        self.node.send_bulk(node, bytes)
    }

    /// Waits until everything sent so far is acknowledged, a peer fails, or `within` passes.
    pub async fn flush(&self, within: Duration) -> Result<(), QuicError> {
        self.node.flush(within).await
    }

    /// Waits like [`QuicTransport::flush`], skipping peers that already failed.
    pub async fn flush_live(&self, within: Duration) -> Result<(), QuicError> {
        self.node.flush_live(within).await
    }

    /// Peers that shut down and closed their connection gracefully.
    pub fn departures(&self) -> broadcast::Receiver<NodeId> {
        self.node.departures()
    }

    /// Peer failures, as they happen (each names the node).
    pub fn failures(&self) -> broadcast::Receiver<QuicError> {
        self.node.failures()
    }

    /// Admission counters of received blocks.
    pub fn filter_stats(&self) -> FilterStats {
        self.dispatch.filter.lock().expect("poisoned").stats()
    }

    /// Node counters.
    pub fn stats(&self) -> QuicStats {
        self.node.stats()
    }

    /// Closes the node's connections gracefully.
    pub async fn close(&self) {
        self.node.close().await
    }
}

impl Transport for QuicTransport {
    fn send(&self, block: HaloBlock) -> Result<(), TransportError> {
        let to = block.header.to;
        let bytes = block.payload_bytes();
        if let Some(deliver) = self.dispatch.local.get(&to).map(|d| d.clone()) {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
            return if deliver(block) {
                Ok(())
            } else {
                Err(TransportError::Closed(to))
            };
        }
        let node = *self
            .routes
            .get(&to)
            .ok_or(TransportError::UnknownPartition(to))?;
        self.node.send_halo(node, block)?;
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn register(&self, part: PartId, deliver: Deliver) {
        self.dispatch.local.insert(part, deliver);
        self.dispatch
            .filter
            .lock()
            .expect("poisoned")
            .add_partition(part);
    }

    fn unregister(&self, part: PartId) {
        self.dispatch.local.remove(&part);
        self.dispatch
            .filter
            .lock()
            .expect("poisoned")
            .remove_partition(part);
    }
}
