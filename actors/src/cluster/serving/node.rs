//! A node hosting serving partitions for the engine node (`trellis serve --cluster FILE
//! --id N`): joins the engine node, receives its setup and the served inputs (the engine's
//! [`ServeStore`] copied here, so a partition that panics is restored on this node), starts
//! a [`ServeActor`] per hosted partition on the QUIC
//! transport (halo blocks go straight to the partitions of other nodes), and answers the
//! engine's steps, deltas, lookups and model swaps until `Finish`. When the engine node is
//! lost, the survivors agree on its successor ([`succession`]): that
//! node starts the engine from its own copy of the served inputs ([`take_over`]), the
//! others join it as they joined the first and are set up again.
use super::proto::{
    HttpAnswerWire, HttpRequestWire, ServeMsg, ServeReply, ServeRequest, ServeSetup, ServeWireError,
};
use super::remote::{ForwardSlot, HttpForward};
use super::succession::{self, Succession};
use super::ClusterServing;
use super::{route_serving, serving_space, tell};
use crate::cluster::config::ClusterFile;
use crate::cluster::node::{ControlInbox, InboxEvent, InboxFeed, NodeEndpoint, ServeTap};
use crate::cluster::proto::ControlMsg;
use crate::serving::engine::{take_over, EngineConfig, EngineHandle};
use crate::serving::part::{DeltaOp, ModelValues};
use crate::serving::shell::{
    Abort, Delta, DropStaged, Install, Lookup, ServeActor, ServeNode, ServeStore, Stage, Step,
};
use crate::ActorError;
use actix::Addr;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use trellis_gpu::PriorityGate;
use trellis_transport::quic::QuicTransport;
use trellis_transport::TraceContext;

/// This node's way to the engine node's HTTP front end: requests its own HTTP front end
/// received go over QUIC, and their answers come back. After a take-over it leads to the
/// new engine node (on the node that took over: to its own engine's front end).
pub struct HttpUplink {
    transport: Arc<QuicTransport>,
    engine: AtomicU32,
    /// Set on the node that took over: its engine's front end, reached in this process.
    local: ForwardSlot,
    waiting: Mutex<HashMap<u64, oneshot::Sender<HttpAnswerWire>>>,
    next_id: AtomicU64,
    /// Why the engine node is unreachable, once it is.
    lost: Mutex<Option<String>>,
    /// Counts the engine nodes this uplink has led to (a new one after each take-over).
    term: tokio::sync::watch::Sender<u64>,
    /// How long a read the lost engine node did not answer waits for its successor.
    patience: Duration,
}

/// Why a forwarded request got no answer.
enum Unanswered {
    /// The engine node is lost: a read may go to its successor.
    Unreachable(String),
    /// No answer in time (the engine node may still act on it).
    Late(String),
}

/// Whether `req` only reads (a prediction of existing or given nodes, a health or metrics
/// page), so that sending it again changes nothing.
fn only_reads(req: &HttpRequestWire) -> bool {
    let path = req.path.split('?').next().unwrap_or_default();
    req.method == "GET" || (req.method == "POST" && path == "/v1/predict")
}

impl HttpUplink {
    /// A way to node `engine`'s HTTP front end over `transport`.
    pub fn new(transport: Arc<QuicTransport>, engine: u32) -> Self {
        HttpUplink {
            transport,
            engine: AtomicU32::new(engine),
            local: ForwardSlot::default(),
            waiting: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            lost: Mutex::new(None),
            term: tokio::sync::watch::Sender::new(0),
            patience: Duration::ZERO,
        }
    }

    /// This uplink, where a read (a prediction, a GET) that the lost engine node did not
    /// answer waits at most `patience` for its successor and is sent to it again. Updates
    /// are never sent twice: one may have been applied before the loss.
    pub fn waiting_for_a_successor(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// The tap of a training node's inbox ([`ControlInbox::tapped`]): answers to the HTTP
    /// requests its front end forwarded go to `uplink`, if it has one; every other serving
    /// message goes down `feed`, to the serving partitions it hosts beside its training
    /// ([`host_beside_training`]).
    pub fn training_node_tap(uplink: Option<Arc<HttpUplink>>, feed: InboxFeed) -> ServeTap {
        Arc::new(move |from, env| {
            if let Some(u) = &uplink {
                if let Ok(ServeMsg::HttpReply { id, answer }) = ServeMsg::open(&env, from) {
                    u.deliver(id, answer);
                    return;
                }
            }
            // The hosting thread is gone once the service ended: nothing waits for these.
            let _ = feed.send((from, ControlMsg::Serve(env)));
        })
    }

    /// Forwards `req` and waits at most `within` for the answer; an error says why there
    /// is none (the engine node is lost, or slow). A read the lost engine node did not
    /// answer goes to its successor, if one takes over within the patience.
    pub async fn forward(
        &self,
        req: HttpRequestWire,
        within: Duration,
    ) -> Result<HttpAnswerWire, String> {
        if self.patience.is_zero() || !only_reads(&req) {
            return self.forward_once(req, within).await.map_err(|e| match e {
                Unanswered::Unreachable(why) | Unanswered::Late(why) => why,
            });
        }
        let patience = tokio::time::Instant::now() + self.patience;
        let mut term = self.term.subscribe();
        loop {
            match self.forward_once(req.clone(), within).await {
                Ok(a) => return Ok(a),
                Err(Unanswered::Late(why)) => return Err(why),
                Err(Unanswered::Unreachable(why)) => {
                    match tokio::time::timeout_at(patience, term.changed()).await {
                        Ok(Ok(())) => continue,
                        _ => return Err(why),
                    }
                }
            }
        }
    }

    async fn forward_once(
        &self,
        req: HttpRequestWire,
        within: Duration,
    ) -> Result<HttpAnswerWire, Unanswered> {
        if let Some(local) = self.local.get() {
            return tokio::time::timeout(within, local(req)).await.map_err(|_| {
                Unanswered::Late(format!(
                    "no answer from this node's engine within {} ms",
                    within.as_millis()
                ))
            });
        }
        let engine = self.engine.load(Ordering::SeqCst);
        if let Some(why) = self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(Unanswered::Unreachable(format!(
                "the engine node {engine} is unreachable: {why}"
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let forget = || {
            self.waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        };
        if let Err(e) = tell(&self.transport, engine, &ServeMsg::HttpRequest { id, req }) {
            forget();
            return Err(Unanswered::Unreachable(e.to_string()));
        }
        match tokio::time::timeout(within, rx).await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(_)) => Err(Unanswered::Unreachable(format!(
                "the engine node {engine} is unreachable"
            ))),
            Err(_) => {
                forget();
                Err(Unanswered::Late(format!(
                    "no answer from the engine node {engine} within {} ms",
                    within.as_millis()
                )))
            }
        }
    }

    /// Announces this node's HTTP address to the engine node (for its logs).
    pub fn announce(&self, addr: std::net::SocketAddr) {
        let msg = ServeMsg::Http {
            addr: addr.to_string(),
        };
        if let Err(e) = tell(&self.transport, self.engine.load(Ordering::SeqCst), &msg) {
            tracing::warn!("{e}");
        }
    }

    /// This node took over as the engine node: requests go to its engine's front end.
    pub fn serve_locally(&self, front_end: HttpForward) {
        self.local.set(front_end);
        self.term.send_modify(|t| *t += 1);
    }

    /// The node joined `engine`, the engine node after a take-over.
    fn rejoined(&self, engine: u32) {
        self.engine.store(engine, Ordering::SeqCst);
        *self.lost.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.term.send_modify(|t| *t += 1);
    }

    fn deliver(&self, id: u64, answer: HttpAnswerWire) {
        let w = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(tx) = w {
            let _ = tx.send(answer);
        }
    }

    /// The node it forwards to is gone (why): every waiting and later request fails.
    pub fn engine_lost(&self, why: &str) {
        *self.lost.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

/// How a serving node's part in the service ended.
pub enum ServeNodeEnd {
    /// The engine node stopped the service.
    Finished,
    /// The engine node was lost and this node took over: its engine runs (every layer
    /// computed, the survivors set up); the caller serves the HTTP API from `handle` and
    /// plugs its front end into `uplink`, the way this node's own front end has forwarded.
    Engine {
        handle: EngineHandle,
        uplink: Arc<HttpUplink>,
        succession: Succession,
    },
}

/// Runs serving node `id` of `cluster` until the engine node stops the service
/// ([`ServeNodeEnd::Finished`]) or this node takes over as the engine node after its loss
/// ([`ServeNodeEnd::Engine`], with `engine`'s settings; its partitions use `engine.threads`
/// kernel threads either way); an error when it cannot go on (no setup, a failed setup, or
/// the engine node lost with no successor). `on_ready` runs once its partitions first
/// serve, with this node's way to the engine node's HTTP front end, on which a read the
/// lost engine node did not answer waits at most `patience` for its successor. With
/// `rejoin` (this node's process was lost and started again, the engine node's too) it
/// joins the running service wherever its engine node now is: its `Join` goes to every
/// other node of the cluster file.
pub fn run_serve_node(
    cluster: &ClusterFile,
    id: u32,
    addr_file: Option<&Path>,
    engine: EngineConfig,
    patience: Duration,
    rejoin: bool,
    on_ready: impl FnOnce(&[u32], Arc<HttpUplink>),
) -> Result<ServeNodeEnd, ActorError> {
    let coord = cluster.coordinator;
    if id == coord && !rejoin {
        return Err(ActorError::Cluster(format!(
            "node {id} is the engine node; start it with --model and --data (or with --rejoin \
             to join the service it ran as a serving node)"
        )));
    }
    let (endpoint, mut inbox) = NodeEndpoint::bind(cluster, id, addr_file)?;
    let candidates: Vec<u32> = if rejoin {
        cluster.ids().into_iter().filter(|&n| n != id).collect()
    } else {
        vec![coord]
    };
    for &n in &candidates {
        let addr = cluster.node(n)?.addr;
        // A node of the file without a fixed port cannot be dialled (it dials this one).
        if addr.port() != 0 || n == coord {
            endpoint.transport.add_peer(n, addr);
        }
    }
    let sys = actix::System::new();
    let threads = engine.threads;
    let candidates = rejoin.then_some(candidates);
    let result = sys.block_on(serve(
        cluster, &endpoint, &mut inbox, threads, patience, candidates, on_ready,
    ));
    drop(sys);
    match result? {
        Served::Finished => Ok(ServeNodeEnd::Finished),
        Served::TakeOver {
            store,
            succession,
            uplink,
            home,
            gone,
        } => {
            let serving = ClusterServing {
                cluster: succession.cluster(cluster),
                id,
                addr_file: None,
                home: Some(home),
                lost: gone,
                quorum: cluster.quorum(),
            };
            let cfg = EngineConfig {
                parts: succession.placement.len(),
                ..engine
            };
            let t = std::time::Instant::now();
            let handle = take_over(store, cfg, serving, endpoint, inbox).map_err(|e| {
                ActorError::Cluster(format!(
                    "node {id} could not take over as the engine node: {e}"
                ))
            })?;
            crate::cluster::say(&format!(
                "serving: node {id} took over as the engine node (partitions on nodes {:?}, every layer computed in {:.0} ms)",
                succession.placement,
                t.elapsed().as_secs_f64() * 1e3
            ));
            Ok(ServeNodeEnd::Engine {
                handle,
                uplink,
                succession,
            })
        }
    }
}

/// How [`serve`] ended.
enum Served {
    Finished,
    /// The engine node was lost and this node is its successor.
    TakeOver {
        store: Arc<ServeStore>,
        succession: Succession,
        uplink: Arc<HttpUplink>,
        /// The placement the service started with.
        home: Vec<u32>,
        /// The nodes of the service that do not survive (they may come back).
        gone: Vec<u32>,
    },
}

/// How [`answer_requests`] ended.
enum Answered {
    Finished,
    /// The engine node is lost (why).
    EngineLost(String),
}

fn wire(e: ServeWireError) -> ActorError {
    ActorError::Cluster(e.to_string())
}

/// Sends the answer to request `id` to the engine node `coord`. An answer over a frame's
/// 16 MiB travels in pieces; one over the message limit (`QuicConfig::max_message`, 1 GiB:
/// about 16 million rows of 16 classes) is answered with a failure that says so, at once,
/// instead of never.
fn reply(t: &QuicTransport, coord: u32, id: u64, body: ServeReply) -> Result<(), ActorError> {
    match t.send_control(coord, ServeMsg::Reply { id, body }.control().encode()) {
        Err(trellis_transport::quic::QuicError::TooLarge { bytes, max, .. }) => {
            let body = ServeReply::Failed {
                message: format!(
                    "its answer ({bytes} bytes) exceeds the {max}-byte limit of a serving message: \
                     serve with more partitions (--partitions), so each holds fewer rows"
                ),
            };
            tell(t, coord, &ServeMsg::Reply { id, body })
        }
        Err(e) => Err(ActorError::Node {
            node: coord,
            detail: e.to_string(),
        }),
        Ok(()) => Ok(()),
    }
}

/// Why a node is not set up by an engine node.
enum SetUpError {
    /// The engine node's link went down (why).
    EngineLost(String),
    /// Anything else (no setup in time, a bad setup, a refusal).
    Failed(ActorError),
}

impl From<ActorError> for SetUpError {
    fn from(e: ActorError) -> Self {
        SetUpError::Failed(e)
    }
}

impl SetUpError {
    fn into_error(self, coord: u32) -> ActorError {
        match self {
            SetUpError::EngineLost(detail) => ActorError::Node {
                node: coord,
                detail,
            },
            SetUpError::Failed(e) => e,
        }
    }
}

/// The next serving message from the engine node `coord` within `until`; `None` on a
/// timeout. Anything else from it ends the node with a clear error.
async fn next_from(
    inbox: &mut ControlInbox,
    coord: u32,
    until: Instant,
    what: &str,
) -> Result<Option<ServeMsg>, SetUpError> {
    loop {
        match inbox.next_event(Some(coord), Some(until)).await? {
            InboxEvent::Message {
                from,
                msg: ControlMsg::Serve(env),
            } if from == coord => {
                return ServeMsg::open(&env, from)
                    .map(Some)
                    .map_err(|e| wire(e).into())
            }
            InboxEvent::Message {
                from,
                msg: ControlMsg::Setup(_),
            } if from == coord => {
                return Err(ActorError::Cluster(format!(
                    "node {coord} started a training run, but this node was started to serve \
                     (trellis serve --cluster); start it with trellis node to train"
                ))
                .into())
            }
            InboxEvent::Message {
                from,
                msg: ControlMsg::Abort { reason },
            } if from == coord => {
                return Err(ActorError::Node {
                    node: coord,
                    detail: format!("the engine node refused this node: {reason}"),
                }
                .into())
            }
            InboxEvent::Message { from, msg } => {
                tracing::warn!(peer = from, "ignored {msg:?} from node {from} while {what}")
            }
            InboxEvent::PeerDown { detail, .. } => {
                return Err(SetUpError::EngineLost(format!(
                    "lost while {what}: {detail}"
                )))
            }
            InboxEvent::Timeout => return Ok(None),
        }
    }
}

/// What this node hosts.
struct Hosted {
    node: ServeNode,
    addrs: HashMap<u32, Addr<ServeActor>>,
    store: Arc<ServeStore>,
    /// The last delta broadcast applied to the store.
    generation: u64,
    /// The model being staged (installed into the store with the tables).
    staged: Option<Arc<ModelValues>>,
    /// Every node of the setup (the engine node among them).
    peers: Vec<u32>,
    /// `placement[p]`: the node serving partition `p`, as last rerouted.
    placement: Vec<u32>,
    /// Nodes the engine node declared lost.
    fenced: Vec<u32>,
    /// The placement the service started with (the setup's).
    home: Vec<u32>,
    /// What a partition the engine re-places here starts with.
    run: uuid::Uuid,
    faults: Arc<crate::faults::FaultPlan>,
    threads: usize,
    /// The gate the hosted partitions' update steps hold (beside training: the node's
    /// training partitions yield to it).
    priority: Option<PriorityGate>,
}

async fn serve(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    threads: usize,
    patience: Duration,
    mut rejoin: Option<Vec<u32>>,
    on_ready: impl FnOnce(&[u32], Arc<HttpUplink>),
) -> Result<Served, ActorError> {
    let mut coord = cluster.coordinator;
    let t = ep.transport.clone();
    refuse_fenced_joins(&t, ep.id);
    let quorum = cluster.quorum();
    // Looking for the engine node with no deadline: this node was cut off from the service
    // (not restarted), and waits until the network lets it back.
    let mut until_found = false;
    let mut on_ready = Some(on_ready);
    let uplink = Arc::new(HttpUplink::new(t.clone(), coord).waiting_for_a_successor(patience));
    // After the engine node's loss: this node's copy of the inputs and the succession it
    // follows, until the successor sets it up.
    let mut following: Option<(Arc<ServeStore>, Succession)> = None;
    // The last setup's nodes and the placement the service started with.
    let (mut peers, mut home) = (Vec::new(), Vec::new());
    loop {
        let held = following.as_ref().map(|(store, _)| store.clone());
        let set = match rejoin.take() {
            Some(candidates) => {
                match find_engine(cluster, ep, inbox, &candidates, until_found).await {
                    Ok((engine, setup)) => {
                        coord = engine;
                        let hosted = host(ep, inbox, coord, &setup, threads, None, None).await;
                        reported(ep, coord, hosted).await
                    }
                    Err(e) => Err(e),
                }
            }
            None => set_up(cluster, ep, inbox, coord, held, threads).await,
        };
        // Who takes over, from which copy of the inputs, after what loss.
        let (store, next, lost) = match set {
            Ok(mut hosted) => {
                (peers, home) = (hosted.peers.clone(), hosted.home.clone());
                let served =
                    serve_engine(ep, inbox, coord, &mut hosted, &uplink, &mut on_ready).await;
                hosted.node.shutdown();
                let Some(why) = served? else {
                    return Ok(Served::Finished);
                };
                let next =
                    succession::after_loss(&hosted.peers, coord, &hosted.fenced, &hosted.placement);
                let lost = format!("the engine node {coord} was lost ({why})");
                (hosted.store.clone(), next, lost)
            }
            // The successor was lost during its take-over: the next one takes over.
            Err(SetUpError::EngineLost(why)) if following.is_some() => {
                let (store, succession) = following.take().expect("following a succession");
                let lost =
                    format!("node {coord}, taking over as the engine node, was lost ({why})");
                (store, succession.after_successor_loss(), lost)
            }
            // The node it took for the successor does not set it up: it still serves the
            // engine node (only this node was cut off from it), or it had no majority.
            Err(SetUpError::Failed(e)) if following.is_some() => {
                crate::cluster::say(&format!(
                    "serving: node {coord} does not set node {} up ({e}); it looks for the \
                     engine node",
                    ep.id
                ));
                following = None;
                (rejoin, until_found) = (Some(look_for_engine(cluster, ep, &peers)), true);
                continue;
            }
            Err(e) => return Err(e.into_error(coord)),
        };
        t.fence(coord);
        let Some(next) = next else {
            return Err(ActorError::Node {
                node: coord,
                detail: format!("{lost}, and no node is left to take over"),
            });
        };
        crate::cluster::say(&format!("serving: {lost}; node {} takes over", next.engine));
        if next.engine == ep.id {
            let next = match quorum {
                None => next,
                Some(q) => {
                    let reached = reached_by(cluster, ep, inbox, &next).await?;
                    if !q.may_take_over(reached.len()) {
                        crate::cluster::say(&format!(
                            "serving: node {} does not take over: only nodes {reached:?} of the \
                             {} reach it, not a majority; it serves nothing and looks for the \
                             engine node until the network lets it back",
                            ep.id, q.members
                        ));
                        following = None;
                        (rejoin, until_found) = (Some(look_for_engine(cluster, ep, &peers)), true);
                        continue;
                    }
                    next.among(&reached)
                }
            };
            let gone = peers
                .iter()
                .copied()
                .filter(|n| !next.survivors.contains(n))
                .collect();
            return Ok(Served::TakeOver {
                store,
                succession: next,
                uplink,
                home,
                gone,
            });
        }
        coord = next.engine;
        following = Some((store, next));
    }
}

/// Serves engine node `coord` with the partitions `hosted` (reporting them `Ready`, and
/// running `on_ready` the first time) until it finishes the service (`None`) or is lost
/// (why). The caller shuts the partitions down.
async fn serve_engine(
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
    hosted: &mut Hosted,
    uplink: &Arc<HttpUplink>,
    on_ready: &mut Option<impl FnOnce(&[u32], Arc<HttpUplink>)>,
) -> Result<Option<String>, ActorError> {
    let mut parts: Vec<u32> = hosted.addrs.keys().copied().collect();
    parts.sort_unstable();
    tell(
        &ep.transport,
        coord,
        &ServeMsg::Ready {
            parts: parts.clone(),
        },
    )?;
    uplink.rejoined(coord);
    if let Some(on_ready) = on_ready.take() {
        on_ready(&parts, uplink.clone());
    } else {
        crate::cluster::say(&format!(
            "serving: node {} serves partitions {parts:?} for the engine node {coord}",
            ep.id
        ));
    }
    match answer_requests(ep, inbox, coord, hosted, Some(uplink)).await {
        Ok(Answered::Finished) => Ok(None),
        Ok(Answered::EngineLost(why)) => {
            uplink.engine_lost(&why);
            Ok(Some(why))
        }
        Err(e) => {
            uplink.engine_lost(&e.to_string());
            Err(e)
        }
    }
}

/// Hosts the serving partitions that the coordinator `coord` of a cluster's training
/// places on this training node when it serves beside the training (`launch --serve`, the
/// coordinator's `node --serve`): once `go` says the training's setup came (the
/// coordinator is up) and with how many kernel threads the partitions compute, it joins
/// the service (`Join`); the coordinator answers with a
/// serving setup, or with `Finish` when it does not serve. The partitions are set up as on
/// a serving node, their update steps hold `gate` (the node's training partitions yield to
/// it) and this process's kernel thread pool moves to the background class, as the
/// coordinator's does. They serve until the coordinator stops the service (`Finish`), also
/// after the training ended, or is lost (the training reports that). `inbox` carries the
/// serving messages the training inbox's tap takes out, less HTTP answers. Returns at once
/// when `go` closes unsent (the training ended before its setup).
pub fn host_beside_training(
    ep: &NodeEndpoint,
    mut inbox: ControlInbox,
    coord: u32,
    gate: PriorityGate,
    go: std::sync::mpsc::Receiver<usize>,
) -> Result<(), ActorError> {
    let Ok(threads) = go.recv() else {
        return Ok(());
    };
    let sys = actix::System::new();
    let served = sys.block_on(async {
        let join = ServeMsg::Join {
            addr: ep.addr().to_string(),
            inputs: None,
        };
        tell(&ep.transport, coord, &join)?;
        // As long as the coordinator lives: its service starts beside the training's first
        // epochs, and this node may be done training before it is set up.
        let setup = loop {
            let until = Instant::now() + Duration::from_secs(3600);
            match next_from(&mut inbox, coord, until, "waiting for the service's setup").await {
                Ok(Some(ServeMsg::Setup(s))) => break s,
                Ok(Some(ServeMsg::Finish)) => return Ok(()),
                Ok(Some(other)) => {
                    tracing::warn!("ignored {} before the serving setup", other.kind())
                }
                Ok(None) => {}
                Err(SetUpError::EngineLost(_)) => return Ok(()),
                Err(SetUpError::Failed(e)) => return Err(e),
            }
        };
        let budget = trellis_gpu::ThreadBudget::global(threads)
            .map_err(|e| ActorError::System(e.to_string()))?;
        crate::priority::background_pool(&budget);
        let hosted = host(ep, &mut inbox, coord, &setup, threads, None, Some(gate)).await;
        let mut hosted = match reported(ep, coord, hosted).await {
            Ok(h) => h,
            Err(SetUpError::EngineLost(_)) => return Ok(()),
            Err(SetUpError::Failed(e)) => return Err(e),
        };
        let mut parts: Vec<u32> = hosted.addrs.keys().copied().collect();
        parts.sort_unstable();
        let ready = tell(
            &ep.transport,
            coord,
            &ServeMsg::Ready {
                parts: parts.clone(),
            },
        );
        crate::cluster::say(&format!(
            "serving: node {} serves partitions {parts:?} beside its training",
            ep.id
        ));
        let answered = match ready {
            Ok(()) => answer_requests(ep, &mut inbox, coord, &mut hosted, None).await,
            Err(e) => Ok(Answered::EngineLost(e.to_string())),
        };
        hosted.node.shutdown();
        // A lost coordinator ends the training too, which says so.
        answered.map(|_| ())
    });
    drop(sys);
    served
}

/// Joins engine node `coord` and hosts the partitions of its setup; `held`: this node's
/// copy of the served inputs, after the engine node's loss. A failed setup is reported to
/// it (`SetupFailed`).
async fn set_up(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
    held: Option<Arc<ServeStore>>,
    threads: usize,
) -> Result<Hosted, SetUpError> {
    let setup = join(cluster, ep, inbox, coord, held.as_deref()).await?;
    let hosted = host(ep, inbox, coord, &setup, threads, held, None).await;
    reported(ep, coord, hosted).await
}

/// `hosted`, with a failed setup reported to engine node `coord` (`SetupFailed`).
async fn reported(
    ep: &NodeEndpoint,
    coord: u32,
    hosted: Result<Hosted, SetUpError>,
) -> Result<Hosted, SetUpError> {
    if let Err(SetUpError::Failed(e)) = &hosted {
        let error = e.to_string();
        let _ = tell(&ep.transport, coord, &ServeMsg::SetupFailed { error });
        ep.flush(Duration::from_secs(2)).await;
    }
    hosted
}

/// A node this one fenced (the engine node declared it lost) that sends it a `Join` takes
/// it for its successor; it is told it is not (`Abort`), so it looks for the engine node
/// at once instead of waiting out its join timeout. (Once this node runs the engine, the
/// engine's link handles fenced nodes instead: it takes them back.)
fn refuse_fenced_joins(t: &Arc<QuicTransport>, me: u32) {
    let weak = Arc::downgrade(t);
    t.on_fenced_control(Arc::new(move |from, bytes| {
        let Some(t) = weak.upgrade() else {
            return;
        };
        let Ok(ControlMsg::Serve(env)) = ControlMsg::decode(&bytes) else {
            return;
        };
        if let Ok(ServeMsg::Join { addr, .. }) = ServeMsg::open(&env, from) {
            let reason = format!("node {me} is not the engine node (node {from} is fenced here)");
            refuse_join(&t, from, &addr, reason);
        }
    }));
}

/// Answers node `from`'s `Join` (sent from `addr`) with `Abort{reason}`. The answer goes to
/// the address the `Join` names: a restarted process listens elsewhere than the one this
/// node knew, and a dial to the old address would hold every later message to it (its
/// halo blocks once it is taken back) until the dial times out.
fn refuse_join(t: &QuicTransport, from: u32, addr: &str, reason: String) {
    if let Ok(addr) = addr.parse() {
        t.add_peer(from, addr);
    }
    let _ = crate::cluster::node::send_control(t, from, &ControlMsg::Abort { reason });
}

/// The nodes a node cut off from the service looks for the engine node among (every other
/// node of the cluster file and of the last setup, `peers`), admitted again: it fenced the
/// engine node it lost, and the successors it tried. Its copy of the served inputs is
/// dropped: it may be behind, and the engine node that takes it back sends its own.
fn look_for_engine(cluster: &ClusterFile, ep: &NodeEndpoint, peers: &[u32]) -> Vec<u32> {
    let mut candidates: Vec<u32> = cluster.ids();
    candidates.extend(peers);
    candidates.sort_unstable();
    candidates.dedup();
    candidates.retain(|&n| n != ep.id);
    for &n in &candidates {
        ep.transport.unfence(n);
    }
    candidates
}

/// The next serving message from a node `accepted` takes, decoded; `None` at `until`.
/// Messages of other nodes or kinds and peer failures are skipped (`what`: what this node
/// is doing meanwhile, for the log).
async fn next_serving(
    inbox: &mut ControlInbox,
    until: Instant,
    accepted: impl Fn(u32) -> bool,
    what: &str,
) -> Result<Option<(u32, ServeMsg)>, ActorError> {
    loop {
        match inbox.next_event(None, Some(until)).await? {
            InboxEvent::Message {
                from,
                msg: ControlMsg::Serve(env),
            } if accepted(from) => match ServeMsg::open(&env, from) {
                Ok(m) => return Ok(Some((from, m))),
                Err(e) => tracing::warn!(peer = from, "{e}; dropped"),
            },
            InboxEvent::Message { from, msg } => {
                tracing::debug!(peer = from, "ignored {msg:?} while {what}")
            }
            InboxEvent::PeerDown { .. } => {}
            InboxEvent::Timeout => return Ok(None),
        }
    }
}

/// The nodes whose `Join` reaches this node, the successor `next` chose, before it takes
/// over (`takeover = "majority"`), this node among them: every survivor that follows the
/// same succession joins it within moments, as does a node looking for the engine node.
/// Waits until every survivor joined, at most two idle timeouts (a survivor that has not
/// joined by then is lost, or still serves the engine node this node lost).
async fn reached_by(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    next: &Succession,
) -> Result<Vec<u32>, ActorError> {
    let mut reached = vec![ep.id];
    let until = Instant::now() + Duration::from_millis(2 * cluster.idle_timeout_ms);
    while !next.survivors.iter().all(|n| reached.contains(n)) {
        let from_survivor = |n| n != next.lost;
        match next_serving(inbox, until, from_survivor, "taking over").await? {
            Some((from, ServeMsg::Join { .. })) if !reached.contains(&from) => reached.push(from),
            Some((from, other)) => tracing::debug!("ignored {} from node {from}", other.kind()),
            None => break,
        }
    }
    reached.sort_unstable();
    Ok(reached)
}

/// Looks for the engine node of a running service among `candidates` (this node's process
/// was lost and started again, or it was cut off from the service): a fresh process's
/// `Join` (no inputs) goes to each of them, again every second (with a fresh connection to
/// those not connected), until one answers with a setup (the engine node takes the lost
/// node back; the others refuse a fenced node's messages), within the join timeout, or
/// with `until_found` for as long as it takes (saying so every 30 s). Returns the engine
/// node and its setup.
async fn find_engine(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    candidates: &[u32],
    until_found: bool,
) -> Result<(u32, ServeSetup), SetUpError> {
    let t = &ep.transport;
    let since = Instant::now();
    let mut said = since;
    let until = (!until_found).then(|| since + Duration::from_millis(cluster.join_timeout_ms));
    let join = ServeMsg::Join {
        addr: ep.addr().to_string(),
        inputs: None,
    };
    loop {
        super::join_each(t, candidates, &join);
        let second = Instant::now() + Duration::from_secs(1);
        let retry = until.map_or(second, |u| second.min(u));
        let candidate = |n| candidates.contains(&n);
        while let Some((from, msg)) =
            next_serving(inbox, retry, candidate, "looking for the engine").await?
        {
            match msg {
                ServeMsg::Setup(s) => return Ok((from, s)),
                other => tracing::debug!("ignored {} from node {from}", other.kind()),
            }
        }
        if said.elapsed() >= Duration::from_secs(30) {
            said = Instant::now();
            crate::cluster::say(&format!(
                "serving: node {} still looks for the engine node among nodes {candidates:?} ({:.0} s)",
                ep.id,
                since.elapsed().as_secs_f64()
            ));
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            return Err(ActorError::Cluster(format!(
                "no node of {candidates:?} took this node back as the engine node within {} ms \
                 (is the service running?)",
                cluster.join_timeout_ms
            ))
            .into());
        }
    }
}

/// Joins engine node `coord` (`Join`, resent every second, every 200 ms with `rejoin`, with
/// a fresh connection while it is not reachable) and returns its setup; an error when none
/// comes within the join timeout. At start-up the engine node may not be up yet,
/// so a failed link is tried again; when rejoining a successor (which was up), with
/// `held` (this node's copy of the inputs, whose digest the `Join` carries), it is
/// [`SetUpError::EngineLost`].
async fn join(
    cluster: &ClusterFile,
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
    held: Option<&ServeStore>,
) -> Result<ServeSetup, SetUpError> {
    let rejoin = held.is_some();
    let t = &ep.transport;
    let until = Instant::now() + Duration::from_millis(cluster.join_timeout_ms);
    let join = ServeMsg::Join {
        addr: ep.addr().to_string(),
        inputs: held.map(ServeStore::inputs_digest),
    };
    let sent = |t: &QuicTransport| match tell(t, coord, &join) {
        Err(ActorError::Node { detail, .. }) if rejoin => Err(SetUpError::EngineLost(detail)),
        r => r.map_err(SetUpError::from),
    };
    sent(t)?;
    // A successor drops the `Join`s that reach it before it runs as the engine node: they
    // are sent again soon, so the survivors are set up as soon as it does. At start-up a
    // failed link is dialled again, at a slower pace.
    let resend = if rejoin {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(1)
    };
    loop {
        let retry = (Instant::now() + resend).min(until);
        match next_from(inbox, coord, retry, "joining").await {
            Ok(Some(ServeMsg::Setup(s))) => return Ok(s),
            // The coordinator of a training run that does not serve answers a `Join` so.
            Ok(Some(ServeMsg::Finish)) => {
                return Err(ActorError::Node {
                    node: coord,
                    detail: "it does not serve (a training coordinator?); start this node with \
                             trellis node --cluster FILE --id N to train"
                        .into(),
                }
                .into())
            }
            Ok(Some(other)) => tracing::warn!("ignored {} before the setup", other.kind()),
            Err(SetUpError::EngineLost(why)) if rejoin => return Err(SetUpError::EngineLost(why)),
            Ok(None) | Err(SetUpError::EngineLost(_)) if Instant::now() < until => {
                // Not up yet (or it restarted): try again, with a fresh connection if there
                // is none. Connected, the `Join` goes again too: this process may have
                // restarted at the address of one the engine node still holds for live (it
                // ignores a live node's `Join`), and is taken back by the first `Join` after
                // the engine node finds that one lost.
                if !t.node().connected_peers().contains(&coord) {
                    t.node().reset_peer(coord);
                }
                sent(t)?;
            }
            Ok(None) => {
                return Err(ActorError::Node {
                    node: coord,
                    detail: format!(
                        "no serving setup from the engine node within {} ms (if the service \
                         runs with another engine node since a take-over, start this node \
                         with --rejoin)",
                        cluster.join_timeout_ms
                    ),
                }
                .into())
            }
            Err(e) => return Err(e),
        }
    }
}

/// Starts the hosted partitions' actors on the served inputs: those that follow the setup,
/// or this node's own copy `held` when the setup says they equal the engine node's.
async fn host(
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
    setup: &ServeSetup,
    threads: usize,
    held: Option<Arc<ServeStore>>,
    priority: Option<PriorityGate>,
) -> Result<Hosted, SetUpError> {
    let parts = setup.placement.len();
    for peer in &setup.peers {
        let addr = peer.addr.parse().map_err(|e| {
            ActorError::Cluster(format!(
                "serving setup: node {} address {}: {e}",
                peer.node, peer.addr
            ))
        })?;
        if peer.node != ep.id {
            ep.transport.add_peer(peer.node, addr);
        }
    }
    let model = Arc::new(setup.model.values(coord).map_err(wire)?);
    let store = match held {
        _ if setup.inputs_follow => Arc::new(ServeStore {
            served: RwLock::new(receive_inputs(inbox, coord, parts).await?),
            model: RwLock::new(model),
            sparse_input: setup.sparse_input,
        }),
        // Its digest matched the engine node's: this node's copy serves as it is.
        Some(store) => {
            *store.model.write().unwrap_or_else(|e| e.into_inner()) = model;
            store
        }
        None => {
            return Err(ActorError::Node {
                node: coord,
                detail: "its setup sent no inputs, and this node holds none".into(),
            }
            .into())
        }
    };
    let mine: Vec<u32> = (0..parts as u32)
        .filter(|&p| setup.placement[p as usize] == ep.id)
        .collect();
    let run = uuid::Uuid::from_bytes(setup.run);
    let faults = super::proto::WireServeFault::plan(&setup.faults);
    if !setup.faults.is_empty() {
        crate::faults::quiet_injected_panics(true);
    }
    route_serving(&ep.transport, &setup.placement, ep.id);
    ep.transport.set_epoch(run, 0);
    let faults = Arc::new(faults);
    let node = ServeNode::start_parts(
        &mine,
        run,
        serving_space(&ep.transport),
        store.clone(),
        faults.clone(),
        threads,
        priority.clone(),
    )?;
    let addrs = mine
        .iter()
        .copied()
        .zip(node.addrs().iter().cloned())
        .collect();
    let mut peers: Vec<u32> = setup.peers.iter().map(|p| p.node).collect();
    peers.push(coord);
    peers.sort_unstable();
    peers.dedup();
    Ok(Hosted {
        node,
        addrs,
        store,
        generation: 0,
        staged: None,
        peers,
        placement: setup.placement.clone(),
        fenced: Vec::new(),
        home: setup.home.clone(),
        run,
        faults,
        threads,
        priority,
    })
}

/// Receives the served inputs from the engine node `coord`, in chunks, and decodes them
/// (checked to be a graph of `parts` partitions).
async fn receive_inputs(
    inbox: &mut ControlInbox,
    coord: u32,
    parts: usize,
) -> Result<crate::serving::shell::Served, SetUpError> {
    let mut bytes: Vec<u8> = Vec::new();
    let mut total = None;
    let until = Instant::now() + Duration::from_secs(120);
    while total != Some(bytes.len() as u64) {
        match next_from(inbox, coord, until, "receiving the served inputs").await? {
            Some(ServeMsg::Inputs {
                offset,
                total: t,
                data,
            }) => {
                if offset != bytes.len() as u64 || total.is_some_and(|x| x != t) {
                    return Err(ActorError::Cluster(format!(
                        "node {coord} sent served inputs out of order (bytes at {offset} after {})",
                        bytes.len()
                    ))
                    .into());
                }
                if offset + data.len() as u64 > t {
                    return Err(ActorError::Cluster(format!(
                        "node {coord} sent more served input bytes than the {t} it announced"
                    ))
                    .into());
                }
                total = Some(t);
                bytes.extend_from_slice(&data);
            }
            Some(other) => tracing::warn!("ignored {} while receiving the inputs", other.kind()),
            None => {
                return Err(ActorError::Node {
                    node: coord,
                    detail: "the served inputs did not arrive within 120 s".into(),
                }
                .into())
            }
        }
    }
    let served = super::proto::ServedWire::decode(&bytes, coord, parts).map_err(wire)?;
    Ok(served)
}

/// Answers the engine node until it says `Finish` or is lost.
async fn answer_requests(
    ep: &NodeEndpoint,
    inbox: &mut ControlInbox,
    coord: u32,
    h: &mut Hosted,
    uplink: Option<&HttpUplink>,
) -> Result<Answered, ActorError> {
    let t = ep.transport.clone();
    loop {
        let msg = match inbox.next_event(Some(coord), None).await? {
            InboxEvent::Message {
                from,
                msg: ControlMsg::Serve(env),
            } if from == coord => match ServeMsg::open(&env, from) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(peer = from, "{e}; dropped");
                    continue;
                }
            },
            InboxEvent::Message {
                from,
                msg: ControlMsg::Serve(env),
            } => {
                // A node that lost the engine node while this one did not (it alone was cut
                // off) takes this node for its successor: it is told to look for the
                // engine node instead of waiting for a setup from here.
                match ServeMsg::open(&env, from) {
                    Ok(ServeMsg::Join { addr, .. }) => {
                        let reason = format!("node {} still serves the engine node {coord}", ep.id);
                        refuse_join(&t, from, &addr, reason);
                    }
                    Ok(other) => {
                        tracing::warn!(peer = from, "ignored {} from node {from}", other.kind())
                    }
                    Err(e) => tracing::warn!(peer = from, "{e}; dropped"),
                }
                continue;
            }
            InboxEvent::Message { from, msg } => {
                tracing::warn!(peer = from, "ignored {msg:?} from node {from}");
                continue;
            }
            InboxEvent::PeerDown { detail, .. } => return Ok(Answered::EngineLost(detail)),
            InboxEvent::Timeout => continue,
        };
        match msg {
            ServeMsg::Request {
                id,
                part,
                req: ServeRequest::Host,
            } => {
                let body = host_part(h, part, ep.id);
                if let Err(e) = tell(&t, coord, &ServeMsg::Reply { id, body }) {
                    return Ok(Answered::EngineLost(e.to_string()));
                }
            }
            ServeMsg::Request { id, part, req } => {
                let body = match h.addrs.get(&part).cloned() {
                    Some(addr) => match on_request(h, coord, addr, req) {
                        Ok(task) => {
                            let t = t.clone();
                            actix::spawn(async move {
                                let body = task.await;
                                if let Err(e) = reply(&t, coord, id, body) {
                                    tracing::warn!("{e}");
                                }
                            });
                            continue;
                        }
                        Err(e) => ServeReply::of_error(e),
                    },
                    None => ServeReply::Failed {
                        message: format!("partition {part} is not served on node {}", ep.id),
                    },
                };
                if let Err(e) = tell(&t, coord, &ServeMsg::Reply { id, body }) {
                    return Ok(Answered::EngineLost(e.to_string()));
                }
            }
            ServeMsg::Abort { part, seq } => {
                if let Some(a) = h.addrs.get(&part) {
                    a.do_send(Abort(seq));
                }
            }
            ServeMsg::DropStaged { part } => {
                if let Some(a) = h.addrs.get(&part) {
                    a.do_send(DropStaged);
                }
            }
            ServeMsg::Reroute {
                placement,
                fenced,
                returned,
            } => {
                for &n in &fenced {
                    t.fence(n);
                }
                // Nodes that came back: admitted again, reached at their new address.
                for n in h.fenced.iter().filter(|n| !fenced.contains(n)) {
                    t.unfence(*n);
                }
                for peer in returned {
                    // Fenced here by an earlier loss (this node's own engine-node loss
                    // fences the lost engine node outside any reroute).
                    t.unfence(peer.node);
                    match peer.addr.parse() {
                        Ok(addr) => {
                            t.add_peer(peer.node, addr);
                            t.node().reset_peer(peer.node);
                            if let Some(process) = peer.incarnation {
                                t.node().expect_process(peer.node, process);
                            }
                            if !h.peers.contains(&peer.node) {
                                h.peers.push(peer.node);
                                h.peers.sort_unstable();
                            }
                        }
                        Err(e) => {
                            tracing::warn!("node {} came back at {}: {e}", peer.node, peer.addr)
                        }
                    }
                }
                route_serving(&t, &placement, ep.id);
                h.fenced = fenced;
                h.fenced.sort_unstable();
                h.fenced.dedup();
                h.placement = placement;
            }
            ServeMsg::DropPart { part } => {
                if h.addrs.remove(&part).is_some() {
                    h.node.remove_part(part);
                    crate::cluster::say(&format!(
                        "serving: node {} no longer serves partition {part}",
                        ep.id
                    ));
                }
            }
            ServeMsg::HttpReply { id, answer } => match uplink {
                Some(u) => u.deliver(id, answer),
                None => tracing::warn!("an HTTP answer ({id}) for a node that forwards none"),
            },
            ServeMsg::Finish => {
                ep.flush(Duration::from_secs(2)).await;
                return Ok(Answered::Finished);
            }
            // A new process of the engine node (`--rejoin`) before its old one is found
            // lost here (its hello does that at once at the old address; elsewhere the
            // idle timeout): then the survivors take over and the successor takes it back.
            ServeMsg::Join { .. } => tracing::debug!(
                "the engine node {coord} joined as a serving node while it is live here; \
                 taken back by a successor once its old process is found lost"
            ),
            other => tracing::warn!("ignored {} from the engine node", other.kind()),
        }
    }
}

/// Starts partition `part` here for the engine (a lost node's partition re-placed on this
/// node), restored from this node's copy of the served inputs.
fn host_part(h: &mut Hosted, part: u32, me: u32) -> ServeReply {
    if h.addrs.contains_key(&part) {
        return ServeReply::Hosting;
    }
    match h.node.add_part(
        part,
        h.run,
        h.store.clone(),
        h.faults.clone(),
        h.threads,
        h.priority.clone(),
    ) {
        Ok(addr) => {
            h.addrs.insert(part, addr);
            crate::cluster::say(&format!("serving: node {me} now serves partition {part}"));
            ServeReply::Hosting
        }
        Err(e) => ServeReply::Failed {
            message: format!("node {me} cannot serve partition {part}: {e}"),
        },
    }
}

type Task = std::pin::Pin<Box<dyn std::future::Future<Output = ServeReply>>>;

/// Carries out one request: node-level effects (the store's copy of the graph, the staged
/// model) now, in arrival order; the partition's answer as a task, so the partitions of this
/// node run their steps side by side.
fn on_request(
    h: &mut Hosted,
    coord: u32,
    addr: Addr<ServeActor>,
    req: ServeRequest,
) -> Result<Task, ActorError> {
    let mailbox = |e: actix::MailboxError| ServeReply::Failed {
        message: format!("partition mailbox: {e}"),
    };
    Ok(match req {
        ServeRequest::Step(w) => Box::pin(async move {
            match addr.send(Step(w.into())).await {
                Ok(r) => ServeReply::of_step(r),
                Err(e) => mailbox(e),
            }
        }),
        ServeRequest::Delta { generation, ops } => {
            let ops: Vec<DeltaOp> = ops.into_iter().map(DeltaOp::from).collect();
            if generation > h.generation {
                h.store
                    .served
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .apply(&ops)?;
                h.generation = generation;
            }
            Box::pin(async move {
                match addr.send(Delta(Arc::new(ops))).await {
                    Ok(Ok(())) => ServeReply::Applied,
                    Ok(Err(e)) => ServeReply::of_error(e),
                    Err(e) => mailbox(e),
                }
            })
        }
        ServeRequest::Lookup { ids, layer, trace } => Box::pin(async move {
            let layer = layer.map(|l| l as usize);
            let trace = TraceContext::from_traceparent(&trace);
            match addr.send(Lookup { ids, layer, trace }).await {
                Ok(Ok(found)) => ServeReply::Found(
                    found
                        .into_iter()
                        .map(|r| super::proto::WireLookedUp {
                            logits: r.logits,
                            embedding: r.embedding,
                        })
                        .collect(),
                ),
                Ok(Err(e)) => ServeReply::of_error(e),
                Err(e) => mailbox(e),
            }
        }),
        ServeRequest::Stage(w) => {
            let model = Arc::new(w.values(coord).map_err(wire)?);
            h.staged = Some(model.clone());
            Box::pin(async move {
                match addr.send(Stage(model)).await {
                    Ok(Ok(())) => ServeReply::Staged,
                    Ok(Err(e)) => ServeReply::of_error(e),
                    Err(e) => mailbox(e),
                }
            })
        }
        // Answered before a partition is looked up (`host_part`); never reaches here.
        ServeRequest::Host => Box::pin(async {
            ServeReply::Failed {
                message: "a partition was asked to host itself".into(),
            }
        }),
        ServeRequest::Install => {
            // The store follows the partitions' tables: a partition restored from now on
            // computes with the new model.
            if let Some(m) = &h.staged {
                *h.store.model.write().unwrap_or_else(|e| e.into_inner()) = m.clone();
            }
            Box::pin(async move {
                match addr.send(Install).await {
                    Ok(Ok(b)) => ServeReply::Installed(b),
                    Ok(Err(e)) => ServeReply::of_error(e),
                    Err(e) => mailbox(e),
                }
            })
        }
    })
}
