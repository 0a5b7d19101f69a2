//! The serving engine: the router and coordinator of the serving partition actors. It keeps
//! the served graph (its replica of every partition's inputs, [`ServeStore`]) and the
//! ownership table, plans every pass ([`plan_pass`]) and drives it layer by layer over the
//! partition actors ([`ServeNode`]), which own the rows of every layer and compute them on
//! their own streams, exchanging halo rows through the transport.
//!
//! Commands are handled in rounds: queries go through the [`Scheduler`] (batched, shed,
//! shared fairly between tenants) and are answered from the owning partitions' tables;
//! graph updates are applied to the served graph, sent to every partition as a [`Delta`](super::shell::Delta),
//! and recomputed by an update pass over the rows they reach; a new model's tables are
//! computed by the partitions beside the live ones, one layer per round (updates keep being
//! applied between those layers and are replayed onto the new tables at the end), then
//! installed between two rounds, so every answer comes from one model version and names it.
//! A partition that panics in a pass is restored by its actor's shell from the store, the
//! pass is aborted on the others and run again with the restarted partition computing every
//! row (a recovery pass) before anything else is answered.
use super::handle::PartHandle;
use super::part::{ComputedRows, DeltaOp, LookedUp, ModelValues, PassStep, Target};
use super::plan::{plan_incremental_update, plan_pass, Coverage, LayerPlan};
use super::published::{LastRows, Published};
use super::routing::{place_new_node, route};
use super::scheduler::{Action, Pending, Quotas, Refusal, Scheduler, SchedulerConfig};
use super::shell::{ServeNode, ServeStore, Served};
use super::ServeError;
use crate::cluster::node::{ControlInbox, EndpointHandle, NodeEndpoint, SharedEndpoint};
use crate::cluster::serving::engine_side::send_setup;
use crate::cluster::serving::proto::{
    PeerAddr, ServeMsg, ServeReply, ServeRequest, ServeSetup, ServedWire, WireModel,
};
use crate::cluster::serving::succession::{self, Quorum};
use crate::cluster::serving::{route_serving, serving_space};
use crate::cluster::serving::{ClusterServing, ForwardSlot, RemoteServePart, ServeLink};
use crate::faults::FaultPlan;
use crate::ActorError;
use futures_util::stream::{FuturesUnordered, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use trellis_gpu::PriorityGate;
use trellis_runtime::inference::{argmax, prepare_features, softmax_row, NodeGraph, Rows};
use trellis_runtime::model::LayerInput;
use trellis_runtime::model_file::SavedModel;
use trellis_transport::quic::QuicTransport;
use trellis_transport::{InProcessTransport, RunId, TraceContext};

mod cluster;
mod swap;

use cluster::EngineCluster;
use swap::SwapInFlight;

/// One node's answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodePrediction {
    pub node: u32,
    pub class: usize,
    pub probabilities: Vec<f32>,
    /// The requested layer's row (when asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
}

/// The answer to a query or an update.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Answer {
    /// The model version every number in it comes from.
    pub model_version: String,
    pub predictions: Vec<NodePrediction>,
    /// Rows recomputed (or, in an incremental layer, updated) per layer by an update
    /// (empty for queries).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recomputed_rows: Vec<usize>,
    /// Edges added and removed by an update.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub edges_added: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub edges_removed: Option<usize>,
}

/// A node to add: its raw features and its edges to existing nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct NewNode {
    pub features: Vec<f32>,
    pub edges: Vec<u32>,
}

/// An edge `a-b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edge {
    pub a: u32,
    pub b: u32,
}

type Reply = oneshot::Sender<Result<Answer, ServeError>>;

/// What the engine is asked to do. `trace` is the span of the request that asks (its
/// HTTP span): the engine's spans for it, and the partition actors' steps under them, join
/// that request's trace.
pub enum Command {
    Predict {
        tenant: String,
        nodes: Vec<u32>,
        layer: Option<usize>,
        deadline: Instant,
        reply: Reply,
        trace: Option<TraceContext>,
    },
    /// Adds nodes; not applied (and answered [`ServeError::Expired`]) once `deadline` passed.
    AddNodes {
        nodes: Vec<NewNode>,
        deadline: Instant,
        reply: Reply,
        trace: Option<TraceContext>,
    },
    /// Adds and removes edges; not applied once `deadline` passed.
    Edges {
        add: Vec<Edge>,
        remove: Vec<Edge>,
        deadline: Instant,
        reply: Reply,
        trace: Option<TraceContext>,
    },
    SwapModel {
        model: Box<SavedModel>,
        reply: Reply,
        trace: Option<TraceContext>,
    },
}

/// Numbers the engine publishes for `/metrics`.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub queue_depth: AtomicUsize,
    pub batch_target: AtomicUsize,
    pub nodes: AtomicUsize,
    pub batches: Mutex<Option<hdrhistogram::Histogram<u64>>>,
    pub shed: Mutex<HashMap<&'static str, u64>>,
    pub version: Mutex<String>,
    /// False while the engine rebuilds its tables after a failure.
    pub ready: std::sync::atomic::AtomicBool,
    /// Failures recovered so far.
    pub recoveries: AtomicUsize,
    /// Times every partition was started again from the store (a pass that failed
    /// without a panic: a timeout, an unreachable partition).
    pub rebuilds: AtomicUsize,
    /// Updates that added new nodes, and the nodes they added (their ratio is the mean
    /// number of additions that waited for each other and ran as one update).
    pub addition_updates: AtomicUsize,
    pub added_nodes: AtomicUsize,
    /// On a cluster: `placement[p]`, the node serving partition `p` now.
    pub placement: Mutex<Vec<u32>>,
    /// On a cluster: the nodes of the service lost (and not taken back), ascending.
    pub lost_nodes: Mutex<Vec<u32>>,
    /// On a cluster with a quorum: why this engine node refuses every request, while it is
    /// cut off from more than half of the service's nodes.
    cut_off: Mutex<Option<String>>,
    /// The node that took over as the engine node while this one was cut off: this
    /// engine stopped (the process goes on as a serving node).
    deposed_by: Mutex<Option<u32>>,
}

impl EngineStats {
    pub(crate) fn record_batch(&self, size: usize) {
        let mut h = self.batches.lock().expect("stats lock");
        let h = h.get_or_insert_with(|| {
            hdrhistogram::Histogram::new_with_bounds(1, 1 << 24, 3).expect("valid bounds")
        });
        let _ = h.record(size.max(1) as u64);
    }
    /// Why this engine node refuses every request, while it is cut off from most of its
    /// cluster (`takeover = "majority"`).
    pub fn cut_off(&self) -> Option<String> {
        self.cut_off.lock().expect("stats lock").clone()
    }

    /// The node that took over as the engine node while this one was cut off, once this
    /// engine stopped for it.
    pub fn deposed_by(&self) -> Option<u32> {
        *self.deposed_by.lock().expect("stats lock")
    }

    /// The nodes lost and not taken back (`lost`, in any order).
    fn set_lost(&self, lost: &[u32]) {
        let mut sorted = lost.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        *self.lost_nodes.lock().expect("stats lock") = sorted;
    }

    /// Counts a refused request.
    pub fn record_shed(&self, why: Refusal) {
        let key = match why {
            Refusal::Overloaded => "overloaded",
            Refusal::Quota => "quota",
            Refusal::Expired => "deadline",
        };
        *self
            .shed
            .lock()
            .expect("stats lock")
            .entry(key)
            .or_default() += 1;
    }
}

/// Settings of an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Number of parts the graph's rows are computed in.
    pub parts: usize,
    /// CPU threads of each partition's stream (0 = all).
    pub threads: usize,
    /// Faults to inject into the partition actors (`serve-panic`).
    pub faults: Arc<FaultPlan>,
    /// Longest one layer of a pass may take on every partition before the pass fails. Once
    /// the start-up pass has run, the limit of every pass but a full one (start-up,
    /// rebuild) is at most [`LAYER_LIMIT_PER_PASS`] times that pass (at least
    /// [`LAYER_LIMIT_FLOOR`]): a block lost on the way stalls a pass for seconds, not for a
    /// limit sized for the largest graphs.
    pub step_timeout: Duration,
    /// Latency-bound steps (updates, on the live tables) are urgent work of this gate:
    /// training streams yielding to it pause between kernel pieces while one computes.
    pub priority: Option<PriorityGate>,
}

/// A handle to a running engine: send commands, read its stats, answer existing-node
/// predictions from its published rows.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    pub stats: Arc<EngineStats>,
    /// The last layer's rows and their version, as the engine last published them.
    pub published: Arc<Published>,
    /// Every query's quota (one bucket per tenant, whichever path answers it).
    quotas: Arc<Mutex<Quotas>>,
    /// The faults injected into the partition actors (and which fired).
    pub faults: Arc<FaultPlan>,
    /// On a cluster: how the HTTP front end answers requests other nodes forward.
    pub http_forward: Arc<ForwardSlot>,
    /// The width of a node's raw features (a new node's `features`).
    pub features: usize,
    /// Classes of the served model.
    pub classes: usize,
    /// Set when the engine thread has ended.
    stopped: Arc<EngineStopped>,
}

/// Whether an engine has stopped: its thread ends once every [`EngineHandle`] is dropped,
/// after it said `Finish` to the other nodes of its cluster.
#[derive(Debug, Default)]
pub struct EngineStopped {
    done: Mutex<bool>,
    changed: std::sync::Condvar,
}

impl EngineStopped {
    fn set(&self) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.changed.notify_all();
    }

    /// Waits at most `within` for the engine to stop (drop every handle first); true if it
    /// did.
    pub fn wait(&self, within: Duration) -> bool {
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let (done, _) = self
            .changed
            .wait_timeout_while(done, within, |d| !*d)
            .unwrap_or_else(|e| e.into_inner());
        *done
    }
}

impl EngineHandle {
    /// Sends a command; false if the engine has stopped.
    pub fn send(&self, c: Command) -> bool {
        self.tx.send(c).is_ok()
    }

    /// Charges one query to `tenant`'s quota: [`ServeError::Quota`] (counted as shed) when
    /// it is spent.
    pub fn admit(&self, tenant: &str) -> Result<(), ServeError> {
        let r = self
            .quotas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(tenant, Instant::now());
        r.map_err(|retry_after| {
            self.stats.record_shed(Refusal::Quota);
            ServeError::Quota { retry_after }
        })
    }

    /// What says when the engine has stopped (it stops once every handle is dropped).
    pub fn stopped(&self) -> Arc<EngineStopped> {
        self.stopped.clone()
    }

    /// Class and probabilities of existing nodes, from the published rows: no engine round
    /// trip, never behind an update or a model load; the answer names its version.
    pub fn predict_published(&self, nodes: &[u32]) -> Result<Answer, ServeError> {
        if let Some(detail) = self.stats.cut_off() {
            return Err(ServeError::CutOff {
                retry_after: REBUILD_RETRY,
                detail,
            });
        }
        self.published.predict(nodes)
    }
}

/// The state the engine thread owns.
struct Engine {
    store: Arc<ServeStore>,
    node: Option<ServeNode>,
    /// Every partition, by id: local actors or partitions of other nodes.
    handles: Vec<PartHandle>,
    /// Delta broadcasts sent so far (numbers each one).
    generation: u64,
    parts: usize,
    /// Whether each layer is split (the same for every model of this architecture).
    split: Vec<bool>,
    /// Per layer: whether update passes update its rows incrementally
    /// ([`plan_incremental_update`]; the same for every model of this architecture).
    incremental: Vec<bool>,
    /// Per layer, per node: incremental updates of its row since it was last computed.
    increments: Vec<Vec<u8>>,
    /// The served model's last-layer bias when its last layer is read from its transformed
    /// rows (the same for every model of this architecture): the partitions answer `Z`, the
    /// published rows aggregate it ([`LastRows::Transformed`]).
    last_bias: Option<Vec<f32>>,
    /// Graph changes made since the last publish (the published graph takes them with the
    /// rows computed on them).
    unpublished: Vec<DeltaOp>,
    /// Width of the served logits.
    classes: usize,
    normalize: bool,
    version: String,
    scheduler: Scheduler,
    waiting: HashMap<u64, WaitingQuery>,
    next_id: u64,
    stats: Arc<EngineStats>,
    published: Arc<Published>,
    swap: Option<SwapInFlight>,
    /// Nodes per part (where new nodes go).
    part_sizes: Vec<usize>,
    /// Node additions waiting to be applied together, as one update (see
    /// [`Engine::adds_due`]).
    adds: Vec<PendingAdd>,
    /// How long the last update of new nodes took.
    last_add: Duration,
    /// Graph updates computed so far (their number keys `serve-panic` faults).
    updates: u64,
    /// The last pass number given out.
    seq: u32,
    /// How long one layer of a pass may take: `step_cap`, or less once a full pass was timed
    /// ([`Engine::time_full_pass`]).
    step_timeout: Duration,
    /// The configured limit ([`EngineConfig::step_timeout`]).
    step_cap: Duration,
    /// How the partition actors are started (again, by a rebuild).
    launch: PartLaunch,
    /// Set while the partitions' tables may be behind the store and a rebuild has not
    /// succeeded yet: queries through the actors and updates are refused meanwhile.
    broken: Option<Broken>,
    /// On a cluster: the other nodes and how to reach them.
    cluster: Option<EngineCluster>,
    http_forward: Arc<ForwardSlot>,
}

/// What starting the partition actors takes.
struct PartLaunch {
    threads: usize,
    faults: Arc<FaultPlan>,
    priority: Option<PriorityGate>,
}

/// Why the partitions are being rebuilt, and when the next attempt is due.
struct Broken {
    reason: String,
    retry_at: Instant,
}

/// How long a failed rebuild waits before the next attempt.
const REBUILD_RETRY: Duration = Duration::from_secs(1);

struct PendingAdd {
    nodes: Vec<NewNode>,
    arrived: Instant,
    deadline: Instant,
    reply: Reply,
    trace: Option<TraceContext>,
}

struct WaitingQuery {
    nodes: Vec<u32>,
    layer: Option<usize>,
    arrived: Instant,
    deadline: Instant,
    reply: Reply,
    trace: Option<TraceContext>,
}

/// What a pass computed.
struct PassOutput {
    rows_per_layer: Vec<usize>,
    /// The last layer's rows, by partition.
    last: Vec<ComputedRows>,
}

/// Why a pass did not complete.
enum PassError {
    /// These partitions panicked (their shells restored them; the pass was aborted).
    Failed(Vec<u32>),
    Other(ServeError),
}

impl From<ServeError> for PassError {
    fn from(e: ServeError) -> Self {
        PassError::Other(e)
    }
}

fn actor_err(e: ActorError) -> ServeError {
    ServeError::Internal(e.to_string())
}

/// A default for [`EngineConfig::step_timeout`]: one layer of a 1M-node graph on one core
/// takes seconds.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Once a full pass (every row of every layer) was timed, one layer of any pass may take at
/// most this many times as long (and at least [`LAYER_LIMIT_FLOOR`]).
pub const LAYER_LIMIT_PER_PASS: u32 = 10;

/// The least time one layer of a pass may take before the pass fails.
pub const LAYER_LIMIT_FLOOR: Duration = Duration::from_secs(5);

/// How many times one pass is retried after partition failures before it gives up.
const MAX_RECOVERIES_PER_PASS: usize = 3;

/// Incremental updates a row of a layer takes before it is computed again: each rounds a
/// few units in the last place away from the aggregation's value, and the roundings of
/// successive increments do not add up in one direction: in `part::tests`, rows updated up
/// to 250 times stayed within 1.1e-7 (relative) of the whole graph's over 400 updates,
/// against the service's contract of 1e-5. Each computation of a row reads all of its
/// neighbours' rows: with the first limit, 8 (1 computation in 9), those reads took 16 % of
/// the samples of `trellis bench serve`'s new-node workload on the 1M-node graph, with 64
/// (1 in 65) 4 %.
const MAX_INCREMENTS: u8 = 64;

/// Node additions waiting to be applied as one update.
#[derive(Debug, Clone, Copy)]
struct AddBatch {
    /// When the first of them arrived.
    oldest: Instant,
    /// New nodes in all of them.
    nodes: usize,
}

/// The last-layer bias of `model` where its last layer is read from its transformed rows
/// ([`trellis_runtime::Model::last_layer_reads_transformed`]), else none.
fn last_bias(model: &trellis_runtime::Model) -> Result<Option<Vec<f32>>, ServeError> {
    if !model.last_layer_reads_transformed() {
        return Ok(None);
    }
    let stream = trellis_gpu::Stream::cpu(1).map_err(trellis_runtime::RuntimeError::from)?;
    Ok(Some(model.last_layer_bias(&stream)?))
}

/// A pass's last-layer table as published: `Z` with its bias, or the logits.
fn last_rows(table: Rows, last_bias: Option<&Vec<f32>>) -> LastRows {
    match last_bias {
        Some(bias) => LastRows::Transformed {
            z: table,
            bias: bias.clone(),
        },
        None => LastRows::Logits(table),
    }
}

/// When `waiting` is applied (see [`Engine::adds_due`]): at once when it is a full batch
/// (`cfg.max_batch` nodes), else once its oldest addition has waited a quarter of the last
/// update's time `last`, at most the SLO.
fn add_batch_due(waiting: AddBatch, last: Duration, cfg: &SchedulerConfig) -> Instant {
    if waiting.nodes >= cfg.max_batch {
        return waiting.oldest;
    }
    waiting.oldest + (last / 4).min(cfg.slo)
}

/// Computes every layer over the partition actors, then starts the engine thread (an actix
/// system: one arbiter per partition actor, the engine's loop on the system's thread).
pub fn start(
    saved: SavedModel,
    graph: NodeGraph,
    raw_features: Vec<f32>,
    owner: Vec<u32>,
    cfg: EngineConfig,
) -> Result<EngineHandle, ServeError> {
    start_engine(saved, graph, raw_features, owner, cfg, None)
}

/// As [`start`], on a cluster: this process is the engine node; the partitions are placed
/// on the cluster's nodes (by the cluster file), which must join within its join timeout.
/// The engine binds the cluster file's address of this node, or, with `shared`, serves on
/// the endpoint of this process's training (serving beside a cluster's training: the
/// serving partitions are placed as the training partitions, on the training nodes, which
/// join through it; the caller keeps it open until the engine stopped,
/// [`EngineHandle::stopped`]).
pub fn start_on_cluster(
    saved: SavedModel,
    graph: NodeGraph,
    raw_features: Vec<f32>,
    owner: Vec<u32>,
    cfg: EngineConfig,
    cluster: ClusterServing,
    shared: Option<SharedEndpoint>,
) -> Result<EngineHandle, ServeError> {
    let endpoint = match shared {
        Some(s) => EngineEndpoint::Shared(s),
        None => EngineEndpoint::Bind,
    };
    start_engine(
        saved,
        graph,
        raw_features,
        owner,
        cfg,
        Some((cluster, endpoint)),
    )
}

fn start_engine(
    saved: SavedModel,
    graph: NodeGraph,
    raw_features: Vec<f32>,
    owner: Vec<u32>,
    cfg: EngineConfig,
    cluster: Option<(ClusterServing, EngineEndpoint)>,
) -> Result<EngineHandle, ServeError> {
    let version = saved.version();
    let normalize = saved.meta.normalize_features;
    let model = saved.model;
    let values = Arc::new(ModelValues::of(&model, normalize)?);
    let mut features = prepare_features(raw_features, model.config().in_dim, normalize)?;
    features.reserve_rows(super::spare_rows(features.len()));
    let store = Arc::new(ServeStore {
        sparse_input: LayerInput::would_be_sparse(&features.data),
        served: RwLock::new(Served {
            graph,
            features,
            owner,
        }),
        model: RwLock::new(values),
    });
    launch_engine(model, version, store, cfg, cluster)
}

/// Where the engine of a cluster gets its QUIC endpoint.
enum EngineEndpoint {
    /// Binds the cluster file's address of its node.
    Bind,
    /// This process's endpoint, already bound and joined (a node taking over as the
    /// engine node).
    Bound(NodeEndpoint, ControlInbox),
    /// The endpoint of this process's training (serving beside a cluster's training; its
    /// owner keeps it open while the engine runs), with the serving messages its inbox's
    /// tap takes out.
    Shared(SharedEndpoint),
}

/// A serving node becomes the engine node of what remains of its cluster after the engine
/// node was lost (`cluster`: the survivors, this node their coordinator, the placement
/// explicit): the engine starts from this node's copy of the served inputs and model
/// (`store`), on this node's endpoint, sends every other survivor its setup and the inputs,
/// and computes every layer again before it answers.
pub fn take_over(
    store: Arc<ServeStore>,
    cfg: EngineConfig,
    cluster: ClusterServing,
    endpoint: NodeEndpoint,
    inbox: ControlInbox,
) -> Result<EngineHandle, ServeError> {
    let values = store
        .model
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let model = trellis_runtime::Model::with_values(values.config.clone(), values.values.clone())?;
    // The version a model file of these weights names, so answers name the same version
    // after the take-over as before it.
    let stream = trellis_gpu::Stream::cpu(1).map_err(trellis_runtime::RuntimeError::from)?;
    let version = trellis_runtime::model_file::version_of(&model.weights_digest(&stream)?);
    {
        let mut served = store.served.write().unwrap_or_else(|e| e.into_inner());
        let spare = super::spare_rows(served.features.len());
        served.features.reserve_rows(spare);
    }
    launch_engine(
        model,
        version,
        store,
        cfg,
        Some((cluster, EngineEndpoint::Bound(endpoint, inbox))),
    )
}

fn launch_engine(
    model: trellis_runtime::Model,
    version: String,
    store: Arc<ServeStore>,
    cfg: EngineConfig,
    cluster: Option<(ClusterServing, EngineEndpoint)>,
) -> Result<EngineHandle, ServeError> {
    let normalize = store
        .model
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .normalize;
    let (in_dim, classes) = (model.config().in_dim, model.config().out_dim);
    let split: Vec<bool> = (0..model.num_layers())
        .map(|l| model.reads_transformed_only(l))
        .collect();
    let incremental: Vec<bool> = (0..model.num_layers())
        .map(|l| model.takes_increments(l))
        .collect();
    let last_bias = last_bias(&model)?;
    let parts = cfg.parts.max(1);
    let (n, part_sizes, published) = {
        let served = store.served.read().unwrap_or_else(|e| e.into_inner());
        let (graph, owner) = (&served.graph, &served.owner);
        if owner.len() != graph.num_nodes() || owner.iter().any(|&o| o as usize >= parts) {
            return Err(ServeError::BadRequest(format!(
                "the ownership table does not fit {} nodes on {parts} partitions",
                graph.num_nodes()
            )));
        }
        let mut part_sizes = vec![0usize; parts];
        for &o in owner {
            part_sizes[o as usize] += 1;
        }
        let n = graph.num_nodes();
        let published = Arc::new(Published::new(
            version.clone(),
            last_rows(Rows::zeros(n, classes), last_bias.as_ref()),
            graph,
        ));
        (n, part_sizes, published)
    };
    let stats = Arc::new(EngineStats::default());
    *stats.version.lock().expect("stats lock") = version.clone();
    stats.nodes.store(n, Ordering::Relaxed);
    // Quotas are charged where a query arrives (the front end), for both paths.
    let quotas = Arc::new(Mutex::new(Quotas::new(cfg.scheduler.quota_rps)));
    let scheduler = Scheduler::new(SchedulerConfig {
        quota_rps: None,
        ..cfg.scheduler
    });
    let (tx, rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel();
    let engine = Engine {
        store,
        node: None,
        handles: Vec::new(),
        generation: 0,
        parts,
        split,
        incremental,
        increments: Vec::new(),
        last_bias,
        unpublished: Vec::new(),
        classes,
        normalize,
        version,
        scheduler,
        waiting: HashMap::new(),
        next_id: 0,
        stats: stats.clone(),
        published: published.clone(),
        swap: None,
        part_sizes,
        adds: Vec::new(),
        last_add: Duration::ZERO,
        updates: 0,
        seq: 0,
        step_timeout: cfg.step_timeout,
        step_cap: cfg.step_timeout,
        launch: PartLaunch {
            threads: cfg.threads,
            faults: cfg.faults.clone(),
            priority: cfg.priority,
        },
        broken: None,
        cluster: None,
        http_forward: Arc::default(),
    };
    let http_forward = engine.http_forward.clone();
    let plan = cfg.faults;
    let stopped = Arc::new(EngineStopped::default());
    let stopped_here = stopped.clone();
    std::thread::Builder::new()
        .name("trellis-serve-engine".into())
        .spawn(move || {
            // The QUIC endpoint is bound (and dropped) outside the actix system: its
            // runtime must not be entered from another one.
            // The endpoint this thread owns (and drops), if any, and the handle it serves on.
            let owned_handle = |ep: NodeEndpoint| ep.handle().map(|h| (Some(ep), h));
            let bound = match cluster {
                Some((c, EngineEndpoint::Bind)) => {
                    NodeEndpoint::bind(&c.cluster, c.id, c.addr_file.as_deref()).and_then(
                        |(ep, inbox)| owned_handle(ep).map(|(ep, h)| Some((c, ep, h, inbox))),
                    )
                }
                Some((c, EngineEndpoint::Bound(ep, inbox))) => {
                    owned_handle(ep).map(|(ep, h)| Some((c, ep, h, inbox)))
                }
                Some((c, EngineEndpoint::Shared(shared))) => {
                    Ok(Some((c, None, shared.handle, shared.inbox)))
                }
                None => Ok(None),
            };
            let (ep, on) = match bound {
                Ok(Some((c, ep, h, inbox))) => (ep, Some(((h, inbox), c))),
                Ok(None) => (None, None),
                Err(e) => {
                    let _ = ready_tx.send(Err(actor_err(e)));
                    return;
                }
            };
            let sys = actix::System::new();
            sys.block_on(async move {
                let mut engine = engine;
                let started = engine.start_partitions(on).await;
                let ok = started.is_ok();
                let _ = ready_tx.send(started);
                if ok {
                    engine.run(rx).await;
                }
                engine.stop_cluster().await;
                if let Some(node) = engine.node.take() {
                    node.shutdown();
                }
            });
            drop(sys);
            drop(ep);
            stopped_here.set();
        })
        .map_err(|e| ServeError::Internal(format!("cannot start the engine thread: {e}")))?;
    ready_rx
        .recv()
        .map_err(|_| ServeError::Internal("the engine stopped while starting".into()))??;
    stats.ready.store(true, Ordering::SeqCst);
    Ok(EngineHandle {
        tx,
        stats,
        published,
        quotas,
        faults: plan,
        http_forward,
        features: in_dim,
        classes,
        stopped,
    })
}

impl Engine {
    /// Starts the partition actors and runs the start-up pass (every row of every layer).
    async fn start_partitions(
        &mut self,
        cluster: Option<((EndpointHandle, ControlInbox), ClusterServing)>,
    ) -> Result<(), ServeError> {
        self.launch_partitions(cluster).await?;
        self.full_pass().await
    }

    /// Starts the partition actors: all of them here, or (on a cluster) this node's and a
    /// handle on every other node's.
    async fn launch_partitions(
        &mut self,
        cluster: Option<((EndpointHandle, ControlInbox), ClusterServing)>,
    ) -> Result<(), ServeError> {
        // A new run id (and, in one process, a new transport): blocks of abandoned actors
        // never reach the new ones.
        let run = uuid::Uuid::new_v4();
        let threads = self.launch.threads;
        let (faults, priority) = (self.launch.faults.clone(), self.launch.priority.clone());
        match cluster {
            None => {
                let transport = Arc::new(InProcessTransport::new());
                let node = ServeNode::start(
                    self.parts,
                    run,
                    transport,
                    self.store.clone(),
                    faults,
                    threads,
                    priority,
                )
                .map_err(actor_err)?;
                self.handles = node
                    .addrs()
                    .iter()
                    .enumerate()
                    .map(|(p, addr)| PartHandle::Local {
                        part: p as u32,
                        addr: addr.clone(),
                    })
                    .collect();
                self.node = Some(node);
            }
            Some(((ep, mut inbox), c)) => {
                let placement = c.placement(self.parts).map_err(actor_err)?;
                let home = c.home(&placement);
                let peers = crate::cluster::serving::engine_side::connect(
                    &ep,
                    &mut inbox,
                    &c,
                    &self.store,
                    &placement,
                    run,
                    &self.launch.faults,
                )
                .await
                .map_err(actor_err)?;
                let link = ServeLink::new(
                    ep.transport.clone(),
                    self.step_timeout,
                    self.http_forward.clone(),
                );
                // Nodes lost before this node took over: fenced, and taken back should they
                // come back.
                for &n in &c.lost {
                    link.node_lost(n, "lost before this node took over");
                }
                ep.spawn(link.clone().pump(inbox));
                route_serving(&ep.transport, &placement, c.id);
                ep.transport.set_epoch(run, 0);
                let mine: Vec<u32> = (0..self.parts as u32)
                    .filter(|&p| placement[p as usize] == c.id)
                    .collect();
                let node = ServeNode::start_parts(
                    &mine,
                    run,
                    serving_space(&ep.transport),
                    self.store.clone(),
                    faults.clone(),
                    threads,
                    priority.clone(),
                )
                .map_err(actor_err)?;
                let local: HashMap<u32, _> = node
                    .parts()
                    .iter()
                    .copied()
                    .zip(node.addrs().iter().cloned())
                    .collect();
                self.handles = (0..self.parts as u32)
                    .map(|p| match local.get(&p) {
                        Some(addr) => PartHandle::Local {
                            part: p,
                            addr: addr.clone(),
                        },
                        None => PartHandle::Remote(RemoteServePart::new(
                            p,
                            placement[p as usize],
                            link.clone(),
                            self.step_timeout,
                        )),
                    })
                    .collect();
                self.node = Some(node);
                *self.stats.placement.lock().expect("stats lock") = placement.clone();
                self.stats.set_lost(&c.lost);
                let mut workers = c.cluster.workers();
                workers.extend(&c.lost);
                self.cluster = Some(EngineCluster {
                    link,
                    transport: ep.transport.clone(),
                    first_placement: home,
                    placement,
                    me: c.id,
                    workers,
                    lost: c.lost.clone(),
                    run,
                    peers,
                    quorum: c.quorum,
                    probed: None,
                });
                if let Some(c) = &self.cluster {
                    c.check_quorum(&self.stats);
                }
            }
        }
        Ok(())
    }

    /// Computes every row of every layer on every partition and publishes the last layer.
    /// Later passes are timed against this one, so it runs under the configured limit (a
    /// rebuild on a machine busier than at start-up is not cut short by the limit the
    /// start-up pass set); a failed one leaves the limit as it was.
    async fn full_pass(&mut self) -> Result<(), ServeError> {
        let timed = std::mem::replace(&mut self.step_timeout, self.step_cap);
        let r = self.compute_every_row().await;
        if r.is_err() {
            self.step_timeout = timed;
        }
        r
    }

    async fn compute_every_row(&mut self) -> Result<(), ServeError> {
        let _span = tracing::info_span!("serve_start", parts = self.parts as i64).entered();
        let mut attempt = 0;
        let out = loop {
            let plans = self.plan(Coverage::Full);
            let seq = self.next_seq();
            let all = vec![true; self.parts];
            let started = Instant::now();
            match self.run_pass(seq, &plans, Target::Live, None, &all).await {
                Ok(out) => {
                    self.time_full_pass(started.elapsed());
                    break out;
                }
                Err(PassError::Failed(parts)) if attempt < MAX_RECOVERIES_PER_PASS => {
                    attempt += 1;
                    tracing::warn!("start-up pass: partitions {parts:?} failed; computing again");
                }
                Err(PassError::Failed(parts)) => {
                    return Err(ServeError::Internal(format!(
                        "partitions {parts:?} kept failing in the start-up pass"
                    )))
                }
                Err(PassError::Other(e)) => return Err(e),
            }
        };
        let n = self.nodes();
        let mut logits = Rows::zeros(n, self.classes);
        for r in &out.last {
            logits.scatter(&r.ids, &r.data);
        }
        let rows = last_rows(logits, self.last_bias.as_ref());
        let edits = std::mem::take(&mut self.unpublished);
        self.published.replace(self.version.clone(), rows, &edits);
        // Every row was computed.
        self.increments.clear();
        Ok(())
    }

    /// A full pass took `took`: one layer of a later pass may take at most
    /// [`LAYER_LIMIT_PER_PASS`] times as long, at least [`LAYER_LIMIT_FLOOR`], at most the
    /// configured limit.
    fn time_full_pass(&mut self, took: Duration) {
        let limit = (took * LAYER_LIMIT_PER_PASS)
            .max(LAYER_LIMIT_FLOOR)
            .min(self.step_cap);
        if limit != self.step_timeout {
            tracing::debug!(
                "serving: a full pass took {took:?}; one layer may take up to {limit:?} from now on"
            );
        }
        self.step_timeout = limit;
    }

    fn next_seq(&mut self) -> u32 {
        self.seq += 1;
        self.seq
    }

    fn nodes(&self) -> usize {
        self.served().graph.num_nodes()
    }

    fn served(&self) -> std::sync::RwLockReadGuard<'_, Served> {
        self.store.served.read().unwrap_or_else(|e| e.into_inner())
    }

    fn plan(&self, coverage: Coverage<'_>) -> Vec<LayerPlan> {
        let s = self.served();
        plan_pass(
            &s.graph,
            &s.owner,
            self.parts,
            &self.split,
            self.last_bias.is_some(),
            coverage,
        )
    }

    fn handles(&self) -> Result<Vec<PartHandle>, ServeError> {
        if self.handles.len() != self.parts {
            return Err(ServeError::Internal(
                "the partitions are not running".into(),
            ));
        }
        Ok(self.handles.clone())
    }

    /// Runs the layers `plans` of pass `seq` on every partition, layer by layer; a partition
    /// that panics aborts the pass on the others (they may wait for its blocks).
    async fn run_pass(
        &mut self,
        seq: u32,
        plans: &[LayerPlan],
        target: Target,
        update: Option<u64>,
        full: &[bool],
    ) -> Result<PassOutput, PassError> {
        let replaced = self.replace_lost().await;
        if !replaced.is_empty() {
            // They start with no tables: the caller runs the pass again with them full.
            return Err(PassError::Failed(replaced));
        }
        let mut out = PassOutput {
            rows_per_layer: Vec::with_capacity(plans.len()),
            last: Vec::new(),
        };
        let layers = self.split.len();
        for plan in plans {
            let last = plan.layer + 1 == layers;
            let addrs = self.handles()?;
            let mut replies: FuturesUnordered<_> = addrs
                .iter()
                .enumerate()
                .map(|(p, a)| {
                    let step = PassStep {
                        trace: crate::telemetry::current(),
                        seq,
                        layer: plan.layer as u16,
                        target,
                        update,
                        transform: plan.transform[p].clone(),
                        compute: plan.compute[p].clone(),
                        send: plan.send[p].clone(),
                        recv: plan.recv[p].clone(),
                        increment: plan.increment[p].clone(),
                        increment_send: plan.increment_send[p].clone(),
                        increment_recv: plan.increment_recv[p].clone(),
                        return_rows: last,
                        return_transformed: plan.returns_transformed,
                        full: full.get(p) == Some(&true),
                    };
                    let a = a.clone();
                    async move { (p, a.step(step).await) }
                })
                .collect();
            let mut failed = Vec::new();
            let mut error = None;
            let deadline = tokio::time::Instant::now() + self.step_timeout;
            let mut answered = vec![false; addrs.len()];
            while !answered.iter().all(|&a| a) {
                let next = tokio::time::timeout_at(deadline, replies.next()).await;
                let (p, r) = match next {
                    Ok(Some(x)) => x,
                    Ok(None) => break,
                    Err(_) => {
                        let late: Vec<usize> = (0..addrs.len()).filter(|&p| !answered[p]).collect();
                        for a in &addrs {
                            a.abort(seq);
                        }
                        return Err(PassError::Other(ServeError::Internal(format!(
                            "partitions {late:?} did not finish layer {} within {} ms",
                            plan.layer,
                            self.step_timeout.as_millis()
                        ))));
                    }
                };
                answered[p] = true;
                match r {
                    Ok(done) => {
                        if let Some(rows) = done.rows {
                            out.last.push(rows);
                        }
                    }
                    Err(ActorError::Panicked { part, message }) => {
                        tracing::warn!("serving partition {part} panicked: {message}");
                        if failed.is_empty() && error.is_none() {
                            for a in &addrs {
                                a.abort(seq);
                            }
                        }
                        failed.push(part);
                    }
                    Err(ActorError::Node { node, detail }) => {
                        // Its node is lost: the partition is re-placed before the pass runs
                        // again.
                        tracing::warn!("serving partition {p} on node {node}: {detail}");
                        self.declare_lost(node, &detail);
                        if failed.is_empty() && error.is_none() {
                            for a in &addrs {
                                a.abort(seq);
                            }
                        }
                        failed.push(p as u32);
                    }
                    Err(e) => {
                        if failed.is_empty() && error.is_none() {
                            for a in &addrs {
                                a.abort(seq);
                            }
                        }
                        error.get_or_insert(actor_err(e));
                    }
                }
            }
            if !failed.is_empty() {
                failed.sort_unstable();
                return Err(PassError::Failed(failed));
            }
            if let Some(e) = error {
                return Err(PassError::Other(e));
            }
            out.rows_per_layer.push(plan.rows());
        }
        Ok(out)
    }

    /// A graph change at `changed` (already applied to the store and every partition):
    /// the update pass, recovered from partition failures; publishes the logits it changed
    /// and returns the rows recomputed per layer.
    async fn recompute(&mut self, changed: &[u32]) -> Result<Vec<usize>, ServeError> {
        self.updates += 1;
        let update = self.updates;
        let _span = tracing::info_span!("serve_update", update = update as i64).entered();
        let mut full = vec![false; self.parts];
        let mut recovered = false;
        let mut attempt = 0;
        let out = loop {
            // A pass run again after a failure computes its rows: an aborted incremental
            // pass may have added its changes on some partitions only.
            let plans = if self.incremental.contains(&true) && attempt == 0 {
                let s = self.store.served.read().unwrap_or_else(|e| e.into_inner());
                plan_incremental_update(
                    &s.graph,
                    &s.owner,
                    self.parts,
                    &self.split,
                    self.last_bias.is_some(),
                    &self.incremental,
                    changed,
                    &mut self.increments,
                    MAX_INCREMENTS,
                )
            } else {
                self.plan(Coverage::Changed {
                    nodes: changed,
                    full: &full,
                })
            };
            let seq = self.next_seq();
            match self
                .run_pass(seq, &plans, Target::Live, Some(update), &full)
                .await
            {
                Ok(out) => break out,
                Err(PassError::Failed(parts)) if attempt < MAX_RECOVERIES_PER_PASS => {
                    attempt += 1;
                    self.stats.ready.store(false, Ordering::SeqCst);
                    self.stats
                        .recoveries
                        .fetch_add(parts.len(), Ordering::Relaxed);
                    for &p in &parts {
                        full[p as usize] = true;
                    }
                    recovered = true;
                }
                Err(PassError::Failed(parts)) => {
                    return self
                        .rebuild_or_break(format!(
                            "partitions {parts:?} kept failing in update {update}"
                        ))
                        .await;
                }
                Err(PassError::Other(e)) => {
                    return self
                        .rebuild_or_break(format!("update {update} failed: {e}"))
                        .await
                }
            }
        };
        let n = self.nodes();
        let edits = std::mem::take(&mut self.unpublished);
        self.published.write_rows(&edits, &out.last, n);
        if recovered {
            self.after_recovery(&full).await;
        }
        Ok(out.rows_per_layer)
    }

    /// After restarted partitions were recomputed: a model swap in flight starts again (the
    /// restarted partitions lost its tables), and the service is ready again.
    async fn after_recovery(&mut self, restarted: &[bool]) {
        self.restart_swap().await;
        let which: Vec<usize> = (0..restarted.len()).filter(|&p| restarted[p]).collect();
        tracing::warn!("serving partitions {which:?} restarted and recomputed");
        self.stats.ready.store(true, Ordering::SeqCst);
    }

    /// The partitions' tables may be behind the store (a pass or a delta failed without a
    /// panic, so no partition restored itself, or recovery gave up): every partition is
    /// started again from the store and computes every row, as at start-up. Until that has
    /// succeeded the service is not ready, refuses queries through the actors and updates,
    /// and keeps answering existing-node predictions from the last published rows (a
    /// consistent earlier state). Returns every layer's row count once rebuilt.
    async fn rebuild_or_break(&mut self, reason: String) -> Result<Vec<usize>, ServeError> {
        match self.rebuild(&reason).await {
            Ok(()) => Ok(vec![self.nodes(); self.split.len()]),
            Err(e) => {
                tracing::error!("serving: rebuild after `{reason}` failed: {e}");
                self.broken = Some(Broken {
                    reason: format!("{reason}; rebuilding: {e}"),
                    retry_at: Instant::now() + REBUILD_RETRY,
                });
                Err(self.recovering())
            }
        }
    }

    async fn rebuild(&mut self, reason: &str) -> Result<(), ServeError> {
        self.stats.ready.store(false, Ordering::SeqCst);
        self.stats.rebuilds.fetch_add(1, Ordering::Relaxed);
        if self.cluster.is_some() {
            // The partitions of other nodes cannot be restarted from here (their node is
            // declared lost, and they are re-placed from the store, only when it does not
            // answer): every partition computes every row again from the graph it holds.
            tracing::warn!("serving: {reason}; computing every row of every partition again");
            self.full_pass().await?;
        } else {
            tracing::warn!("serving: {reason}; starting every partition again from the store");
            if let Some(node) = self.node.take() {
                node.abandon();
            }
            self.start_partitions(None).await?;
        }
        self.broken = None;
        let everyone = vec![true; self.parts];
        self.after_recovery(&everyone).await;
        Ok(())
    }

    /// The answer to a request that needs the partitions while they are being rebuilt.
    fn recovering(&self) -> ServeError {
        ServeError::Recovering {
            retry_after: REBUILD_RETRY,
            detail: self
                .broken
                .as_ref()
                .map_or_else(|| "rebuilding".into(), |b| b.reason.clone()),
        }
    }

    async fn stage_everywhere(&self, model: &Arc<ModelValues>) -> Result<(), ServeError> {
        for a in self.handles()? {
            a.stage(model.clone()).await.map_err(actor_err)?;
        }
        Ok(())
    }

    /// Recovers partitions that failed outside an update (in a swap's layer): they recompute
    /// their live rows from the others' (nothing changed), then the swap starts again.
    async fn recover(&mut self, failed: Vec<u32>) -> Result<(), ServeError> {
        self.stats.ready.store(false, Ordering::SeqCst);
        self.stats
            .recoveries
            .fetch_add(failed.len(), Ordering::Relaxed);
        let mut full = vec![false; self.parts];
        for &p in &failed {
            full[p as usize] = true;
        }
        for _ in 0..MAX_RECOVERIES_PER_PASS {
            let plans = self.plan(Coverage::Changed {
                nodes: &[],
                full: &full,
            });
            let seq = self.next_seq();
            match self.run_pass(seq, &plans, Target::Live, None, &full).await {
                Ok(_) => {
                    self.after_recovery(&full).await;
                    return Ok(());
                }
                Err(PassError::Failed(more)) => {
                    for &p in &more {
                        full[p as usize] = true;
                    }
                }
                Err(PassError::Other(e)) => {
                    return self
                        .rebuild_or_break(format!("recovering partitions {failed:?}: {e}"))
                        .await
                        .map(drop)
                }
            }
        }
        self.rebuild_or_break(format!("partitions {failed:?} could not be recovered"))
            .await
            .map(drop)
    }

    async fn run(&mut self, rx: Receiver<Command>) {
        loop {
            let now = Instant::now();
            if let Some(b) = &self.broken {
                if now >= b.retry_at {
                    let reason = b.reason.clone();
                    let _ = self.rebuild_or_break(reason).await;
                }
            }
            let now = Instant::now();
            let wait = match (self.scheduler.next_wake(), &self.swap) {
                (_, Some(_)) => Duration::ZERO,
                (Some(w), None) => w.saturating_duration_since(now),
                (None, None) => Duration::from_secs(3600),
            };
            let wait = match &self.broken {
                Some(b) => wait.min(b.retry_at.saturating_duration_since(now)),
                None => wait,
            };
            let wait = match self.adds_due() {
                Some(due) => wait.min(due.saturating_duration_since(now)),
                None => wait,
            };
            // On a cluster, a lost node is noticed (and its partitions recovered) while idle.
            let wait = match &self.cluster {
                Some(_) => wait.min(Duration::from_millis(100)),
                None => wait,
            };
            match rx.recv_timeout(wait) {
                Ok(c) => self.handle(c).await,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // Everything that arrived meanwhile joins the same scheduling round.
            while let Ok(c) = rx.try_recv() {
                self.handle(c).await;
            }
            self.recover_lost().await;
            self.take_back_returned().await;
            if self.deposed() {
                return;
            }
            self.apply_adds().await;
            self.swap_step().await;
            let actions = self.scheduler.poll(Instant::now());
            self.act(actions).await;
            self.stats
                .queue_depth
                .store(self.scheduler.queued(), Ordering::Relaxed);
        }
    }

    async fn handle(&mut self, c: Command) {
        let refusal = match self.stats.cut_off() {
            Some(detail) => Some(ServeError::CutOff {
                retry_after: REBUILD_RETRY,
                detail,
            }),
            None => self.broken.is_some().then(|| self.recovering()),
        };
        if let Some(refusal) = refusal {
            let reply = match c {
                Command::Predict { reply, .. }
                | Command::AddNodes { reply, .. }
                | Command::Edges { reply, .. }
                | Command::SwapModel { reply, .. } => reply,
            };
            let _ = reply.send(Err(refusal));
            return;
        }
        match c {
            Command::Predict {
                tenant,
                nodes,
                layer,
                deadline,
                reply,
                trace,
            } => {
                if let Err(e) = self.check_query(&nodes, layer) {
                    let _ = reply.send(Err(e));
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let now = Instant::now();
                let cost = nodes.len().max(1);
                self.waiting.insert(
                    id,
                    WaitingQuery {
                        nodes,
                        layer,
                        arrived: now,
                        deadline,
                        reply,
                        trace,
                    },
                );
                let actions = self.scheduler.arrive(
                    Pending {
                        id,
                        tenant,
                        cost,
                        arrived: now,
                        deadline,
                    },
                    now,
                );
                self.act(actions).await;
            }
            Command::AddNodes {
                nodes,
                deadline,
                reply,
                trace,
            } => self.adds.push(PendingAdd {
                nodes,
                arrived: Instant::now(),
                deadline,
                reply,
                trace,
            }),
            Command::Edges {
                add,
                remove,
                deadline,
                reply,
                trace,
            } => {
                if Instant::now() > deadline {
                    let _ = reply.send(Err(ServeError::Expired));
                    return;
                }
                let r = self.edges(&add, &remove, trace).await;
                let _ = reply.send(r);
            }
            Command::SwapModel {
                model,
                reply,
                trace,
            } => self.begin_swap(*model, reply, trace).await,
        }
    }

    fn check_query(&self, nodes: &[u32], layer: Option<usize>) -> Result<(), ServeError> {
        let n = self.nodes();
        if let Some(&v) = nodes.iter().find(|&&v| v as usize >= n) {
            return Err(ServeError::UnknownNode { node: v, nodes: n });
        }
        let layers = self.split.len();
        if let Some(l) = layer.filter(|&l| l >= layers) {
            return Err(ServeError::BadRequest(format!(
                "layer {l} does not exist (the model has layers 0..{layers})"
            )));
        }
        Ok(())
    }

    async fn act(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Run(ids) => self.run_batch(ids).await,
                Action::Refuse {
                    id,
                    why,
                    retry_after,
                } => {
                    self.stats.record_shed(why);
                    if let Some(q) = self.waiting.remove(&id) {
                        let e = match why {
                            Refusal::Overloaded => ServeError::Overloaded { retry_after },
                            Refusal::Quota => ServeError::Quota { retry_after },
                            Refusal::Expired => ServeError::Expired,
                        };
                        let _ = q.reply.send(Err(e));
                    }
                }
            }
        }
    }

    /// One engine step: every query of the batch answered from the same tables, each
    /// owning partition asked once for the rows of all the batch's nodes it owns.
    async fn run_batch(&mut self, ids: Vec<u64>) {
        let t = Instant::now();
        let mut cost = 0;
        let mut oldest = t;
        let queries: Vec<WaitingQuery> = ids
            .iter()
            .filter_map(|id| self.waiting.remove(id))
            .collect();
        let span = tracing::info_span!("serve_batch", size = ids.len() as i64);
        crate::telemetry::join_requests(&span, queries.iter().map(|q| q.trace));
        let _span = span.entered();
        // One lookup per (partition, layer) for the whole batch.
        let mut wanted: HashMap<(u32, Option<usize>), Vec<u32>> = HashMap::new();
        {
            let served = self.served();
            for q in &queries {
                cost += q.nodes.len().max(1);
                oldest = oldest.min(q.arrived);
                for (p, nodes) in route(&q.nodes, &served.owner) {
                    wanted.entry((p, q.layer)).or_default().extend(nodes);
                }
            }
        }
        let mut rows: HashMap<(u32, Option<usize>), HashMap<u32, LookedUp>> = HashMap::new();
        let mut failure = None;
        // A partition that does not answer (a stuck actor; a node not yet known to be lost:
        // its handle gives up sooner, see `RemoteServePart::lookup`) holds the engine no
        // longer than the batch's first deadline: the batch gets 503 and the engine goes on
        // to other work, such as an update that waits for the node to be declared lost and
        // then recovers it.
        let due = queries.iter().map(|q| q.deadline).min().unwrap_or(t);
        for ((p, layer), mut nodes) in wanted {
            nodes.sort_unstable();
            nodes.dedup();
            let handle = match self.handles() {
                Ok(h) => h[p as usize].clone(),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let lookup = handle.lookup(nodes.clone(), layer, crate::telemetry::current());
            let Ok(answer) = tokio::time::timeout_at(due.into(), lookup).await else {
                failure = Some(ServeError::Recovering {
                    retry_after: Duration::from_secs(1),
                    detail: format!("serving partition {p} did not answer within the deadline"),
                });
                break;
            };
            match answer {
                Ok(found) if found.len() == nodes.len() => {
                    rows.insert((p, layer), nodes.into_iter().zip(found).collect());
                }
                Ok(found) => {
                    failure = Some(ServeError::Internal(format!(
                        "serving partition {p} answered {} rows for {} nodes",
                        found.len(),
                        nodes.len()
                    )))
                }
                Err(e) => {
                    if let ActorError::Node { node, detail } = &e {
                        self.declare_lost(*node, detail);
                    }
                    failure = Some(ServeError::Recovering {
                        retry_after: Duration::from_secs(1),
                        detail: e.to_string(),
                    })
                }
            }
        }
        let owner_of = |v: u32, served: &Served| served.owner[v as usize];
        let last = self.split.len() - 1;
        for q in queries {
            if let Some(e) = &failure {
                let _ = q.reply.send(Err(e.clone()));
                continue;
            }
            // The partitions do not keep a last layer that is read from its transformed
            // rows: its rows are the published ones (of this version: the engine publishes
            // every change before it answers anything else).
            let published = if self.last_bias.is_some() {
                match self.published.logits(&q.nodes) {
                    Ok((_, l)) => Some(l),
                    Err(e) => {
                        let _ = q.reply.send(Err(e));
                        continue;
                    }
                }
            } else {
                None
            };
            let predictions = {
                let served = self.served();
                q.nodes
                    .iter()
                    .enumerate()
                    .map(|(k, &v)| {
                        let found = &rows[&(owner_of(v, &served), q.layer)][&v];
                        let logits = published.as_ref().map_or(&found.logits, |p| &p[k]);
                        let embedding = match (&published, q.layer) {
                            (Some(p), Some(l)) if l == last => Some(p[k].clone()),
                            _ => found.embedding.clone(),
                        };
                        NodePrediction {
                            node: v,
                            class: argmax(logits),
                            probabilities: softmax_row(logits),
                            embedding,
                        }
                    })
                    .collect()
            };
            let _ = q.reply.send(Ok(Answer {
                model_version: self.version.clone(),
                predictions,
                recomputed_rows: Vec::new(),
                edges_added: None,
                edges_removed: None,
            }));
        }
        self.stats.record_batch(ids.len());
        let now = Instant::now();
        self.scheduler
            .finished(cost, now - t, now.saturating_duration_since(oldest));
        self.stats
            .batch_target
            .store(self.scheduler.batch_target(), Ordering::Relaxed);
    }

    /// Checks one request's new nodes against the model and the graph.
    fn check_new_nodes(&self, nodes: &[NewNode]) -> Result<(), ServeError> {
        let served = self.served();
        let width = served.features.width;
        let n = served.graph.num_nodes();
        for (i, node) in nodes.iter().enumerate() {
            if node.features.len() != width {
                return Err(ServeError::BadRequest(format!(
                    "node {i} of the request has {} features, the model takes {width}",
                    node.features.len()
                )));
            }
            if let Some(k) = node.features.iter().position(|x| !x.is_finite()) {
                return Err(ServeError::BadRequest(format!(
                    "feature {k} of node {i} of the request is not a finite number"
                )));
            }
            if let Some(&v) = node.edges.iter().find(|&&v| v as usize >= n) {
                return Err(ServeError::UnknownNode { node: v, nodes: n });
            }
        }
        Ok(())
    }

    /// Applies every node addition of this round as one update (the k-hop regions of all
    /// new nodes recomputed together), and answers each with its own nodes.
    /// When the waiting node additions are applied: additions that arrive together are one
    /// update, whose cost grows much slower than its size (a new node's region is planned,
    /// exchanged and computed with the others'; ~4 ms for one node on the 1M-node graph,
    /// ~1.7 ms each for 64), so the oldest waits for others to join for a quarter of the
    /// time the last update took, at most the SLO; a full batch goes at once.
    fn adds_due(&self) -> Option<Instant> {
        let oldest = self.adds.iter().map(|a| a.arrived).min()?;
        let cfg = self.scheduler.config();
        Some(add_batch_due(
            AddBatch {
                oldest,
                nodes: self.adds.iter().map(|a| a.nodes.len()).sum(),
            },
            self.last_add,
            cfg,
        ))
    }

    async fn apply_adds(&mut self) {
        match self.adds_due() {
            Some(due) if due <= Instant::now() => {}
            _ => return,
        }
        let t = Instant::now();
        self.apply_due_adds().await;
        self.last_add = t.elapsed();
    }

    /// Applies the waiting additions as one update, counted (`/metrics`) before any of its
    /// answers leaves: a caller that reads the metrics after its answer sees its nodes.
    async fn apply_due_adds(&mut self) {
        let adds = std::mem::take(&mut self.adds);
        let now = Instant::now();
        let mut accepted = Vec::with_capacity(adds.len());
        for a in adds {
            if now > a.deadline {
                let _ = a.reply.send(Err(ServeError::Expired));
            } else if let Err(e) = self.check_new_nodes(&a.nodes) {
                let _ = a.reply.send(Err(e));
            } else {
                accepted.push(a);
            }
        }
        if accepted.is_empty() {
            return;
        }
        let total: usize = accepted.iter().map(|a| a.nodes.len()).sum();
        let span = tracing::info_span!("serve_add_nodes", nodes = total as i64);
        crate::telemetry::join_requests(&span, accepted.iter().map(|a| a.trace));
        let _span = span.entered();
        match self.add_nodes(&accepted).await {
            Ok((ids, rows)) => {
                self.stats.addition_updates.fetch_add(1, Ordering::Relaxed);
                self.stats.added_nodes.fetch_add(total, Ordering::Relaxed);
                let mut next = 0;
                for a in accepted {
                    let mine = &ids[next..next + a.nodes.len()];
                    next += a.nodes.len();
                    let answer = self.published.predict(mine).map(|p| Answer {
                        model_version: p.model_version,
                        predictions: p.predictions,
                        recomputed_rows: rows.clone(),
                        edges_added: Some(a.nodes.iter().map(|n| n.edges.len()).sum()),
                        edges_removed: None,
                    });
                    let _ = a.reply.send(answer);
                }
            }
            Err(e) => {
                for a in accepted {
                    let _ = a.reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// A change the store already has: sent to every partition, then recomputed where it
    /// reaches. A partition that cannot take the delta leaves the partitions behind the
    /// store, so they are rebuilt from it.
    async fn apply_change(
        &mut self,
        ops: Vec<DeltaOp>,
        changed: &[u32],
    ) -> Result<Vec<usize>, ServeError> {
        self.unpublished.extend(ops.iter().cloned());
        if let Err(e) = self.broadcast(ops).await {
            return self
                .rebuild_or_break(format!("a graph change did not reach every partition: {e}"))
                .await;
        }
        self.note_changed(changed);
        self.recompute(changed).await
    }

    /// Sends graph changes to every partition.
    async fn broadcast(&mut self, ops: Vec<DeltaOp>) -> Result<(), ServeError> {
        let ops = Arc::new(ops);
        self.generation += 1;
        let generation = self.generation;
        let handles = self.handles()?;
        let replies: FuturesUnordered<_> = handles
            .iter()
            .map(|h| h.delta(ops.clone(), generation))
            .collect();
        for r in replies.collect::<Vec<_>>().await {
            match r {
                // A partition whose node is lost is re-placed from the store, which has
                // these changes already.
                Err(ActorError::Node { node, detail }) => self.declare_lost(node, &detail),
                r => r.map_err(actor_err)?,
            }
        }
        Ok(())
    }

    /// Adds the nodes of `adds` (checked) to the graph and recomputes what they reach;
    /// returns their ids and the rows recomputed per layer.
    async fn add_nodes(
        &mut self,
        adds: &[PendingAdd],
    ) -> Result<(Vec<u32>, Vec<usize>), ServeError> {
        let nodes: Vec<&NewNode> = adds.iter().flat_map(|a| &a.nodes).collect();
        let mut ops = Vec::new();
        let mut changed = Vec::new();
        let mut ids = Vec::with_capacity(nodes.len());
        {
            let mut served = self.store.served.write().unwrap_or_else(|e| e.into_inner());
            let width = served.features.width;
            for node in &nodes {
                let rows = prepare_features(node.features.clone(), width, self.normalize)?;
                let part = place_new_node(&node.edges, &served.owner, &self.part_sizes);
                self.part_sizes[part as usize] += 1;
                let id = served.graph.add_node();
                served.owner.push(part);
                served.features.data.extend_from_slice(&rows.data);
                ops.push(DeltaOp::AddNode {
                    id,
                    owner: part,
                    features: rows.data,
                });
                for &e in &node.edges {
                    if served.graph.add_edge(id, e)? {
                        ops.push(DeltaOp::AddEdge { a: id, b: e });
                        changed.push(e);
                    }
                }
                changed.push(id);
                ids.push(id);
            }
            self.stats
                .nodes
                .store(served.graph.num_nodes(), Ordering::Relaxed);
        }
        let rows = self.apply_change(ops, &changed).await?;
        Ok((ids, rows))
    }

    async fn edges(
        &mut self,
        add: &[Edge],
        remove: &[Edge],
        trace: Option<TraceContext>,
    ) -> Result<Answer, ServeError> {
        let span = tracing::info_span!(
            "serve_edges",
            add = add.len() as i64,
            remove = remove.len() as i64
        );
        crate::telemetry::join_requests(&span, [trace]);
        let _span = span.entered();
        let mut ops = Vec::new();
        let mut changed = Vec::new();
        let (mut added, mut removed) = (0, 0);
        {
            let mut served = self.store.served.write().unwrap_or_else(|e| e.into_inner());
            let n = served.graph.num_nodes();
            for e in add.iter().chain(remove) {
                if let Some(v) = [e.a, e.b].into_iter().find(|&v| v as usize >= n) {
                    return Err(ServeError::UnknownNode { node: v, nodes: n });
                }
                if e.a == e.b {
                    return Err(ServeError::BadRequest(format!(
                        "edge {}-{} is a self loop (every layer already includes the node itself)",
                        e.a, e.b
                    )));
                }
            }
            for e in remove {
                if served.graph.remove_edge(e.a, e.b)? {
                    removed += 1;
                    ops.push(DeltaOp::RemoveEdge { a: e.a, b: e.b });
                    changed.extend([e.a, e.b]);
                }
            }
            for e in add {
                if served.graph.add_edge(e.a, e.b)? {
                    added += 1;
                    ops.push(DeltaOp::AddEdge { a: e.a, b: e.b });
                    changed.extend([e.a, e.b]);
                }
            }
        }
        let rows = self.apply_change(ops, &changed).await?;
        Ok(Answer {
            model_version: self.version.clone(),
            predictions: Vec::new(),
            recomputed_rows: rows,
            edges_added: Some(added),
            edges_removed: Some(removed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_additions_wait_a_quarter_of_the_last_update_at_most_the_slo_unless_full() {
        let cfg = SchedulerConfig {
            slo: Duration::from_millis(5),
            max_batch: 64,
            ..SchedulerConfig::default()
        };
        let oldest = Instant::now();
        let batch = |nodes| AddBatch { oldest, nodes };
        let ms = Duration::from_millis;
        // The first update (nothing measured yet) goes at once.
        assert_eq!(add_batch_due(batch(1), Duration::ZERO, &cfg), oldest);
        assert_eq!(add_batch_due(batch(3), ms(8), &cfg), oldest + ms(2));
        assert_eq!(
            add_batch_due(batch(3), ms(120), &cfg),
            oldest + ms(5),
            "the SLO"
        );
        assert_eq!(
            add_batch_due(batch(64), ms(120), &cfg),
            oldest,
            "a full batch"
        );
    }
}
