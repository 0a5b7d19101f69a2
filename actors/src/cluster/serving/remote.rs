//! The engine node's side of the serving links: [`ServeLink`] sends requests to the nodes
//! hosting serving partitions and matches their replies to the waiting requests (a pump on
//! the QUIC runtime reads the control inbox, so replies and node losses are seen while the
//! engine thread waits); [`RemoteServePart`] is one remote partition as the engine's
//! [`crate::serving::handle::PartHandle`] reaches it. Every request is bounded in time, and a
//! lost node fails every request waiting on it at once, naming it.
use super::proto::{
    HttpAnswerWire, HttpRequestWire, ServeMsg, ServeReply, ServeRequest, WireDelta, WireModel,
    WireStep,
};
use crate::cluster::node::{ControlInbox, InboxEvent};
use crate::cluster::proto::ControlMsg;
use crate::serving::part::{DeltaOp, LookedUp, ModelValues, PassStep, StepDone};
use crate::ActorError;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use trellis_transport::quic::QuicTransport;
use trellis_transport::TraceContext;

type Waiter = oneshot::Sender<Result<ServeReply, ActorError>>;

/// How a node set up again ended its setup: its partitions, or why it failed.
type SetupOutcome = Result<Vec<u32>, String>;

/// How the engine node's HTTP front end answers a request forwarded by another node.
pub type HttpForward = Arc<
    dyn Fn(
            HttpRequestWire,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = HttpAnswerWire> + Send>>
        + Send
        + Sync,
>;

/// Where the engine node's HTTP front end plugs in its [`HttpForward`] once it listens.
#[derive(Default)]
pub struct ForwardSlot {
    front_end: Mutex<Option<HttpForward>>,
    set: tokio::sync::Notify,
}

impl ForwardSlot {
    pub fn set(&self, f: HttpForward) {
        *self.front_end.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
        self.set.notify_waiters();
    }

    pub(crate) fn get(&self) -> Option<HttpForward> {
        self.front_end
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The front end, waiting at most `within` for it to be set.
    async fn wait(&self, within: Duration) -> Option<HttpForward> {
        let set = self.set.notified();
        tokio::pin!(set);
        // Registered before the check, so a `set` between them is not missed.
        set.as_mut().enable();
        if let Some(f) = self.get() {
            return Some(f);
        }
        let _ = tokio::time::timeout(within, set).await;
        self.get()
    }
}

/// How long a request forwarded to an engine node whose HTTP front end is not listening yet
/// (it is starting, or a successor is taking over) waits for it before a 503.
const FRONT_END_START: Duration = Duration::from_secs(5);

/// A request waiting for its reply.
struct Waiting {
    node: u32,
    tx: Waiter,
}

/// The engine node's requests to the serving nodes, and their replies.
pub struct ServeLink {
    transport: Arc<QuicTransport>,
    waiting: Mutex<HashMap<u64, Waiting>>,
    next_id: AtomicU64,
    /// Nodes lost so far, with why; not yet handled by the engine while in `unhandled`.
    lost: Mutex<BTreeMap<u32, String>>,
    unhandled: Mutex<Vec<u32>>,
    /// Longest a request other than a step waits for its reply.
    timeout: Duration,
    /// Answers HTTP requests forwarded by other nodes.
    http: Arc<ForwardSlot>,
    /// Lost nodes that joined again (a `Join`), with the address it joined from; not yet
    /// taken back by the engine.
    returned: Mutex<Vec<(u32, String)>>,
    /// A node the engine is setting up again, waiting for its `Ready` (or `SetupFailed`).
    setting_up: Mutex<HashMap<u32, oneshot::Sender<SetupOutcome>>>,
    /// A lost node that answered this engine node's `Join` with a setup: it runs the
    /// engine now (it took over while this node was cut off).
    deposed_by: Mutex<Option<u32>>,
}

impl ServeLink {
    pub fn new(
        transport: Arc<QuicTransport>,
        timeout: Duration,
        http: Arc<ForwardSlot>,
    ) -> Arc<Self> {
        let link = Arc::new(ServeLink {
            transport: transport.clone(),
            waiting: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            lost: Mutex::new(BTreeMap::new()),
            unhandled: Mutex::new(Vec::new()),
            timeout,
            http,
            returned: Mutex::new(Vec::new()),
            setting_up: Mutex::new(HashMap::new()),
            deposed_by: Mutex::new(None),
        });
        // A lost node is fenced: of what it sends only a `Join` is taken, as the node coming
        // back: a restarted process, a node that was cut off or frozen and looks for the
        // engine node, or one still joining this node as its successor (it holds inputs;
        // the setup that takes it back sends the current ones all the same).
        let weak = Arc::downgrade(&link);
        transport.on_fenced_control(Arc::new(move |from, bytes| {
            let Some(link) = weak.upgrade() else {
                return;
            };
            let Ok(ControlMsg::Serve(env)) = ControlMsg::decode(&bytes) else {
                return;
            };
            match ServeMsg::open(&env, from) {
                Ok(ServeMsg::Join { addr, .. }) => link.came_back(from, addr),
                // The answer to this node's own `Join` while it was cut off (see
                // `Engine::deposed`): a successor serves.
                Ok(ServeMsg::Setup(_)) => link.deposed(from),
                Ok(ServeMsg::Inputs { .. }) => {}
                Ok(other) => {
                    tracing::debug!(peer = from, "fenced node {from} sent {}", other.kind())
                }
                Err(e) => tracing::debug!(peer = from, "fenced node {from}: {e}"),
            }
        }));
        link
    }

    /// Lost node `node` joined again from `addr` (a restarted process).
    fn came_back(&self, node: u32, addr: String) {
        if self.lost(node).is_none() {
            return;
        }
        let mut returned = self.returned.lock().unwrap_or_else(|e| e.into_inner());
        // It resends its `Join` until it is set up: the latest address counts.
        returned.retain(|(n, _)| *n != node);
        returned.push((node, addr));
    }

    /// Lost node `node` runs the engine now (it sent this node a setup): this engine steps
    /// down. The setup is refused, so `node` does not wait for this node's `Ready`.
    fn deposed(&self, node: u32) {
        let mut by = self.deposed_by.lock().unwrap_or_else(|e| e.into_inner());
        if by.is_none() {
            *by = Some(node);
        }
        let error = "it runs an engine (it was cut off while this node took over); it steps \
                     down and joins again as a serving node"
            .to_string();
        if let Err(e) = super::tell(&self.transport, node, &ServeMsg::SetupFailed { error }) {
            tracing::warn!(peer = node, "{e}");
        }
    }

    /// The lost node that runs the engine now, if one told this node so.
    pub fn deposed_by(&self) -> Option<u32> {
        *self.deposed_by.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lost nodes that joined again since the last call, with their addresses.
    pub fn take_returned(&self) -> Vec<(u32, String)> {
        std::mem::take(&mut *self.returned.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Node `node` came back and is taken back: admitted again, no longer lost.
    pub fn taken_back(&self, node: u32) {
        self.transport.unfence(node);
        self.transport.node().reset_peer(node);
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&node);
    }

    /// Waits at most `within` for node `node`'s `Ready` (its partitions); call before its
    /// setup is sent.
    pub fn expect_ready(
        &self,
        node: u32,
        within: Duration,
    ) -> impl std::future::Future<Output = Result<Vec<u32>, ActorError>> {
        let (tx, rx) = oneshot::channel();
        self.setting_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(node, tx);
        async move {
            let failed = |detail: String| ActorError::Node { node, detail };
            match tokio::time::timeout(within, rx).await {
                Ok(Ok(Ok(parts))) => Ok(parts),
                Ok(Ok(Err(error))) => Err(failed(format!("its serving setup failed: {error}"))),
                Ok(Err(_)) => Err(failed("lost while it was set up".into())),
                Err(_) => Err(failed(format!(
                    "not ready within {} s of its setup",
                    within.as_secs()
                ))),
            }
        }
    }

    fn setup_done(&self, node: u32, outcome: SetupOutcome) {
        let waiter = self
            .setting_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&node);
        match waiter {
            Some(tx) => drop(tx.send(outcome)),
            None => tracing::warn!(peer = node, "node {node} reported its setup unasked"),
        }
    }

    /// Sends `msg` to `node` without waiting for an answer.
    pub fn tell(&self, node: u32, msg: &ServeMsg) -> Result<(), ActorError> {
        super::tell(&self.transport, node, msg)
    }

    /// Why `node` was lost, if it was.
    pub fn lost(&self, node: u32) -> Option<String> {
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .cloned()
    }

    /// Nodes lost since the last call (each reported once).
    pub fn take_lost(&self) -> Vec<u32> {
        std::mem::take(&mut *self.unhandled.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Sends `req` for partition `part` on `node` and waits at most `within` for the reply.
    pub async fn request(
        &self,
        node: u32,
        part: u32,
        req: ServeRequest,
        within: Duration,
    ) -> Result<ServeReply, ActorError> {
        if let Some(detail) = self.lost(node) {
            return Err(ActorError::Node { node, detail });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Waiting { node, tx });
        let sent = self.tell(node, &ServeMsg::Request { id, part, req });
        if let Err(e) = sent {
            self.forget(id);
            return Err(e);
        }
        match tokio::time::timeout(within, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ActorError::Node {
                node,
                detail: "the serving link closed".into(),
            }),
            Err(_) => {
                self.forget(id);
                Err(ActorError::Timeout {
                    part,
                    ms: within.as_millis() as u64,
                    what: format!("a serving request to node {node}"),
                })
            }
        }
    }

    fn forget(&self, id: u64) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Reply `id` arrived from `from`.
    fn deliver(&self, from: u32, id: u64, body: ServeReply) {
        let w = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        match w {
            Some(w) if w.node == from => {
                let _ = w.tx.send(Ok(body));
            }
            Some(w) => {
                let _ = w.tx.send(Err(ActorError::Node {
                    node: from,
                    detail: format!("answered request {id}, which was sent to node {}", w.node),
                }));
            }
            None => tracing::debug!(peer = from, "late serving reply {id} from node {from}"),
        }
    }

    /// `node` is lost: it is fenced, and every request waiting on it fails naming it.
    pub fn node_lost(&self, node: u32, detail: &str) {
        {
            let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
            if lost.contains_key(&node) {
                return;
            }
            lost.insert(node, detail.to_string());
        }
        self.transport.fence(node);
        // A node lost while it was set up again fails its setup.
        self.setting_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&node);
        self.unhandled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(node);
        let failed: Vec<Waiting> = {
            let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            let ids: Vec<u64> = w
                .iter()
                .filter(|(_, v)| v.node == node)
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter().filter_map(|id| w.remove(&id)).collect()
        };
        for w in failed {
            let _ = w.tx.send(Err(ActorError::Node {
                node,
                detail: detail.to_string(),
            }));
        }
    }

    /// Answers HTTP request `id` forwarded by `from` through the engine node's front end,
    /// once it listens (a 503 if it does not within [`FRONT_END_START`]).
    fn answer_http(self: &Arc<Self>, from: u32, id: u64, req: HttpRequestWire) {
        let link = self.clone();
        tokio::spawn(async move {
            let answer = match link.http.wait(FRONT_END_START).await {
                Some(f) => f(req).await,
                None => unavailable("the serving node's HTTP front end is starting"),
            };
            reply_forwarded(&link.transport, from, id, answer);
        });
    }

    /// Reads the control inbox until it closes: replies go to their requests, node
    /// failures to [`ServeLink::node_lost`]. Runs on the QUIC runtime.
    pub async fn pump(self: Arc<Self>, mut inbox: ControlInbox) {
        loop {
            match inbox.next_event(None, None).await {
                Ok(InboxEvent::Message {
                    from,
                    msg: ControlMsg::Serve(env),
                }) => match ServeMsg::open(&env, from) {
                    Ok(ServeMsg::Reply { id, body }) => self.deliver(from, id, body),
                    Ok(ServeMsg::HttpRequest { id, req }) => self.answer_http(from, id, req),
                    Ok(ServeMsg::Http { addr }) => {
                        crate::cluster::say(&format!("node {from} answers HTTP on http://{addr}"))
                    }
                    Ok(ServeMsg::Ready { parts }) => self.setup_done(from, Ok(parts)),
                    Ok(ServeMsg::SetupFailed { error }) => self.setup_done(from, Err(error)),
                    // A restarted process whose hello has not yet been turned into the old
                    // one's loss here (or, at a new address, whose old connection still
                    // looks live): its `Join`s go again each second, and one after the loss
                    // takes it back.
                    Ok(ServeMsg::Join { .. }) => tracing::debug!(
                        peer = from,
                        "node {from} joined again while it is live here; its next Join is \
                         taken once its old process is found lost"
                    ),
                    Ok(other) => {
                        tracing::warn!(peer = from, "node {from} sent {}; ignored", other.kind())
                    }
                    Err(e) => tracing::warn!(peer = from, "{e}; dropped"),
                },
                Ok(InboxEvent::Message { from, msg }) => {
                    tracing::warn!(
                        peer = from,
                        "node {from} sent {msg:?} to a serving engine; ignored"
                    )
                }
                Ok(InboxEvent::PeerDown { node, detail }) => {
                    crate::cluster::say(&format!("serving: node {node} lost: {detail}"));
                    self.node_lost(node, &detail);
                }
                Ok(InboxEvent::Timeout) => {}
                Err(e) => {
                    tracing::info!("serving link: {e}");
                    return;
                }
            }
        }
    }
}

/// How the coordinator of a cluster's training that does not serve takes the serving
/// messages of its tapped inbox ([`ControlInbox::tapped`](crate::cluster::node::ControlInbox::tapped)):
/// a training node's `Join` (its offer to host serving partitions) is told the service is
/// over (`Finish`), and an HTTP request another node's front end forwards is refused at
/// once with a 503 saying `why`.
pub fn not_serving_tap(
    transport: Arc<QuicTransport>,
    why: String,
) -> crate::cluster::node::ServeTap {
    Arc::new(move |from, env| match ServeMsg::open(&env, from) {
        Ok(ServeMsg::HttpRequest { id, req: _ }) => {
            reply_forwarded(&transport, from, id, unavailable(&why))
        }
        Ok(ServeMsg::Join { .. }) => {
            if let Err(e) = transport.send_control(from, ServeMsg::Finish.control().encode()) {
                tracing::warn!(peer = from, "node {from}: {e}");
            }
        }
        Ok(other) => tracing::warn!(peer = from, "node {from} sent {}; ignored", other.kind()),
        Err(e) => tracing::warn!(peer = from, "{e}; dropped"),
    })
}

/// A 503 with `Retry-After: 1` saying `why`, as the answer to a forwarded request.
pub fn unavailable(why: &str) -> HttpAnswerWire {
    HttpAnswerWire {
        status: 503,
        retry_after: Some("1".into()),
        content_type: Some("application/json".into()),
        body: serde_json::json!({ "error": why }).to_string().into_bytes(),
    }
}

/// Sends `answer` to node `from` as the answer to its forwarded HTTP request `id`.
pub fn reply_forwarded(transport: &QuicTransport, from: u32, id: u64, answer: HttpAnswerWire) {
    let reply = ServeMsg::HttpReply { id, answer }.control().encode();
    if let Err(e) = transport.send_control(from, reply) {
        tracing::warn!("serving: the answer to node {from}'s HTTP request: {e}");
    }
}

/// How long a lookup waits for a partition on another node.
const LOOKUP_PATIENCE: Duration = Duration::from_millis(300);

/// One serving partition hosted by another node.
#[derive(Clone)]
pub struct RemoteServePart {
    part: u32,
    node: u32,
    link: Arc<ServeLink>,
    /// Longest one step may take (the engine's step deadline bounds it too).
    step_timeout: Duration,
}

impl RemoteServePart {
    pub fn new(part: u32, node: u32, link: Arc<ServeLink>, step_timeout: Duration) -> Self {
        RemoteServePart {
            part,
            node,
            link,
            step_timeout,
        }
    }

    pub fn part(&self) -> u32 {
        self.part
    }

    pub fn node(&self) -> u32 {
        self.node
    }

    async fn ask(&self, req: ServeRequest, within: Duration) -> Result<ServeReply, ActorError> {
        self.link.request(self.node, self.part, req, within).await
    }

    pub async fn step(&self, step: PassStep) -> Result<StepDone, ActorError> {
        let req = ServeRequest::Step(WireStep::from(&step));
        // The engine's own deadline ends the pass first; this one frees the request.
        let within = self.step_timeout + Duration::from_secs(1);
        self.ask(req, within).await?.into_step(self.node, self.part)
    }

    pub async fn delta(&self, ops: &[DeltaOp], generation: u64) -> Result<(), ActorError> {
        let req = ServeRequest::Delta {
            generation,
            ops: ops.iter().map(WireDelta::from).collect(),
        };
        match self.ask(req, self.link.timeout).await? {
            ServeReply::Applied => Ok(()),
            other => Err(other.unexpected(self.node, self.part, "a delta")),
        }
    }

    pub fn abort(&self, seq: u32) {
        let msg = ServeMsg::Abort {
            part: self.part,
            seq,
        };
        if let Err(e) = self.link.tell(self.node, &msg) {
            tracing::warn!("abort of pass {seq} on partition {}: {e}", self.part);
        }
    }

    pub async fn lookup(
        &self,
        ids: Vec<u32>,
        layer: Option<usize>,
        trace: Option<TraceContext>,
    ) -> Result<Vec<LookedUp>, ActorError> {
        let req = ServeRequest::Lookup {
            ids,
            layer: layer.map(|l| l as u32),
            trace: super::proto::wire_trace(trace),
        };
        // A live node answers a lookup in about a millisecond; one that does not answer
        // soon (dead, not yet declared lost) must not hold the engine's batch, and the
        // updates behind it, until the link's timeout.
        self.ask(req, LOOKUP_PATIENCE.min(self.link.timeout))
            .await?
            .into_found(self.node, self.part)
    }

    pub async fn stage(&self, model: &ModelValues) -> Result<(), ActorError> {
        let wire = WireModel::of(model)?;
        match self
            .ask(ServeRequest::Stage(wire), self.link.timeout)
            .await?
        {
            ServeReply::Staged => Ok(()),
            other => Err(other.unexpected(self.node, self.part, "a model stage")),
        }
    }

    pub async fn install(&self) -> Result<bool, ActorError> {
        match self.ask(ServeRequest::Install, self.link.timeout).await? {
            ServeReply::Installed(b) => Ok(b),
            other => Err(other.unexpected(self.node, self.part, "an install")),
        }
    }

    pub fn drop_staged(&self) {
        let msg = ServeMsg::DropStaged { part: self.part };
        if let Err(e) = self.link.tell(self.node, &msg) {
            tracing::warn!("dropping partition {}'s staged tables: {e}", self.part);
        }
    }
}
