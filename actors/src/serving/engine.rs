//! The serving engine: one thread that owns the served graph, its features, every layer's
//! embeddings and the model, and answers commands in order.
//!
//! Queries go through the [`Scheduler`] (batched, shed, shared fairly between tenants) and
//! are answered from the stored last-layer rows; graph updates run between batches and
//! recompute only the rows they reach, each part computing its own
//! ([`Inference::update`]); a new model is computed in a background thread over a snapshot
//! (copy-on-write: the graph and features are copied only if an update comes meanwhile),
//! then the updates made since are replayed onto it and it replaces the old one between two
//! batches, so every answer comes from one model version and names it.
use super::published::Published;
use super::routing::{place_new_node, route};
use super::scheduler::{Action, Pending, Quotas, Refusal, Scheduler, SchedulerConfig};
use super::ServeError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use trellis_gpu::Stream;
use trellis_runtime::inference::{
    argmax, parts_of, softmax_row, Inference, LayerOutputs, NodeGraph, Rows,
};
use trellis_runtime::model_file::SavedModel;
use trellis_runtime::Model;

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
    /// Rows recomputed per layer by an update (empty for queries).
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

/// What the engine is asked to do.
pub enum Command {
    Predict {
        tenant: String,
        nodes: Vec<u32>,
        layer: Option<usize>,
        deadline: Instant,
        reply: Reply,
    },
    /// Adds nodes; not applied (and answered [`ServeError::Expired`]) once `deadline` passed.
    AddNodes {
        nodes: Vec<NewNode>,
        deadline: Instant,
        reply: Reply,
    },
    /// Adds and removes edges; not applied once `deadline` passed.
    Edges {
        add: Vec<Edge>,
        remove: Vec<Edge>,
        deadline: Instant,
        reply: Reply,
    },
    SwapModel {
        model: Box<SavedModel>,
        reply: Reply,
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
}

impl EngineStats {
    pub(crate) fn record_batch(&self, size: usize) {
        let mut h = self.batches.lock().expect("stats lock");
        let h = h.get_or_insert_with(|| {
            hdrhistogram::Histogram::new_with_bounds(1, 1 << 24, 3).expect("valid bounds")
        });
        let _ = h.record(size.max(1) as u64);
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
    /// CPU threads of the engine's stream (0 = all).
    pub threads: usize,
    /// Fault injection: the graph updates (counting from 1) whose computation panics.
    pub panic_on_updates: Vec<u64>,
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

    /// Class and probabilities of existing nodes, from the published rows: no engine round
    /// trip, never behind an update or a model load; the answer names its version.
    pub fn predict_published(&self, nodes: &[u32]) -> Result<Answer, ServeError> {
        self.published.predict(nodes)
    }
}

/// The state the engine thread owns.
struct Engine {
    inference: Inference,
    graph: Arc<NodeGraph>,
    features: Arc<Rows>,
    outputs: LayerOutputs,
    owner: Vec<u32>,
    /// Nodes per part (where new nodes go).
    part_sizes: Vec<usize>,
    parts: usize,
    version: String,
    scheduler: Scheduler,
    waiting: HashMap<u64, WaitingQuery>,
    next_id: u64,
    stats: Arc<EngineStats>,
    published: Arc<Published>,
    swap: Option<SwapInFlight>,
    threads: usize,
    /// Node additions received in this round: applied together, as one update.
    adds: Vec<PendingAdd>,
    /// Graph updates computed so far, and the ones to fail (fault injection).
    updates: u64,
    panic_on_updates: Vec<u64>,
}

struct PendingAdd {
    nodes: Vec<NewNode>,
    deadline: Instant,
    reply: Reply,
}

struct WaitingQuery {
    nodes: Vec<u32>,
    layer: Option<usize>,
    arrived: Instant,
    reply: Reply,
}

/// A new model being computed in the background.
struct SwapInFlight {
    done: Receiver<Result<(Inference, LayerOutputs), ServeError>>,
    version: String,
    /// Nodes changed since the snapshot it computes over.
    changed: Vec<u32>,
    reply: Reply,
}

/// Runs layer-wise inference over the whole graph, then starts the engine thread.
pub fn start(
    saved: SavedModel,
    graph: NodeGraph,
    raw_features: Vec<f32>,
    owner: Vec<u32>,
    cfg: EngineConfig,
) -> Result<EngineHandle, ServeError> {
    let version = saved.version();
    let stream = Stream::cpu(cfg.threads).map_err(|e| ServeError::Internal(e.to_string()))?;
    let mut inference = Inference::new(saved.model, stream, saved.meta.normalize_features)?;
    let features = inference.prepare_features(raw_features)?;
    let parts = cfg.parts.max(1);
    let outputs = inference.run(&graph, &features, &parts_of(&owner, parts))?;
    let stats = Arc::new(EngineStats::default());
    *stats.version.lock().expect("stats lock") = version.clone();
    let published = Arc::new(Published::new(version.clone(), outputs.logits().clone()));
    // Quotas are charged where a query arrives (the front end), for both paths.
    let quotas = Arc::new(Mutex::new(Quotas::new(cfg.scheduler.quota_rps)));
    let scheduler = Scheduler::new(SchedulerConfig {
        quota_rps: None,
        ..cfg.scheduler
    });
    stats.ready.store(true, Ordering::SeqCst);
    stats.nodes.store(graph.num_nodes(), Ordering::Relaxed);
    let (tx, rx) = mpsc::channel();
    let mut part_sizes = vec![0usize; parts];
    for &o in &owner {
        part_sizes[o as usize] += 1;
    }
    let mut engine = Engine {
        part_sizes,
        inference,
        graph: Arc::new(graph),
        features: Arc::new(features),
        outputs,
        owner,
        parts,
        version,
        scheduler,
        waiting: HashMap::new(),
        next_id: 0,
        stats: stats.clone(),
        published: published.clone(),
        swap: None,
        threads: cfg.threads,
        adds: Vec::new(),
        updates: 0,
        panic_on_updates: cfg.panic_on_updates,
    };
    std::thread::Builder::new()
        .name("trellis-serve-engine".into())
        .spawn(move || engine.run(rx))
        .map_err(|e| ServeError::Internal(format!("cannot start the engine thread: {e}")))?;
    Ok(EngineHandle {
        tx,
        stats,
        published,
        quotas,
    })
}

impl Engine {
    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            let now = Instant::now();
            let wait = match (self.scheduler.next_wake(), &self.swap) {
                (Some(w), _) => w.saturating_duration_since(now),
                (None, Some(_)) => Duration::from_millis(5),
                (None, None) => Duration::from_secs(3600),
            };
            match rx.recv_timeout(wait) {
                Ok(c) => self.handle(c),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // Everything that arrived meanwhile joins the same scheduling round.
            while let Ok(c) = rx.try_recv() {
                self.handle(c);
            }
            self.apply_adds();
            self.finish_swap();
            let actions = self.scheduler.poll(Instant::now());
            self.act(actions);
            self.stats
                .queue_depth
                .store(self.scheduler.queued(), Ordering::Relaxed);
        }
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Predict {
                tenant,
                nodes,
                layer,
                deadline,
                reply,
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
                        reply,
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
                self.act(actions);
            }
            Command::AddNodes {
                nodes,
                deadline,
                reply,
            } => self.adds.push(PendingAdd {
                nodes,
                deadline,
                reply,
            }),
            Command::Edges {
                add,
                remove,
                deadline,
                reply,
            } => {
                // Additions that arrived before keep their order.
                self.apply_adds();
                let r = if Instant::now() > deadline {
                    Err(ServeError::Expired)
                } else {
                    self.edges(&add, &remove)
                };
                let _ = reply.send(r);
            }
            Command::SwapModel { model, reply } => self.begin_swap(*model, reply),
        }
    }

    fn check_query(&self, nodes: &[u32], layer: Option<usize>) -> Result<(), ServeError> {
        let n = self.graph.num_nodes();
        if let Some(&v) = nodes.iter().find(|&&v| v as usize >= n) {
            return Err(ServeError::UnknownNode { node: v, nodes: n });
        }
        if let Some(l) = layer {
            let layers = self.outputs.layers.len();
            if l >= layers {
                return Err(ServeError::BadRequest(format!(
                    "embeddings of layer {l} asked for: the model has layers 0..{}",
                    layers - 1
                )));
            }
        }
        Ok(())
    }

    fn act(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Refuse {
                    id,
                    why,
                    retry_after,
                } => {
                    self.stats.record_shed(why);
                    if let Some(q) = self.waiting.remove(&id) {
                        let _ = q.reply.send(Err(match why {
                            Refusal::Quota => ServeError::Quota { retry_after },
                            Refusal::Overloaded => ServeError::Overloaded { retry_after },
                            Refusal::Expired => ServeError::Expired,
                        }));
                    }
                }
                Action::Run(ids) => self.run_batch(ids),
            }
        }
    }

    fn answer_rows(&self, nodes: &[u32], layer: Option<usize>) -> Vec<NodePrediction> {
        let logits = self.outputs.logits();
        nodes
            .iter()
            .map(|&v| {
                let row = logits.row(v);
                NodePrediction {
                    node: v,
                    class: argmax(row),
                    probabilities: softmax_row(row),
                    embedding: layer.map(|l| self.outputs.layers[l].row(v).to_vec()),
                }
            })
            .collect()
    }

    /// One engine step: every query of the batch answered from the same model version.
    fn run_batch(&mut self, ids: Vec<u64>) {
        let _span = tracing::info_span!("serve_batch", size = ids.len() as i64).entered();
        let t = Instant::now();
        let mut cost = 0;
        let mut oldest = t;
        let by_part_span = tracing::info_span!("serve_lookup", parts = self.parts as i64);
        let _g = by_part_span.enter();
        for id in &ids {
            let Some(q) = self.waiting.remove(id) else {
                continue;
            };
            cost += q.nodes.len().max(1);
            oldest = oldest.min(q.arrived);
            // Rows are read where their owners keep them (one lookup per owning part).
            let groups = route(&q.nodes, &self.owner);
            let mut preds = Vec::with_capacity(q.nodes.len());
            for (_, nodes) in groups {
                preds.extend(self.answer_rows(&nodes, q.layer));
            }
            let order: HashMap<u32, usize> =
                q.nodes.iter().enumerate().map(|(i, &v)| (v, i)).collect();
            preds.sort_by_key(|p| order[&p.node]);
            let dedup = q.nodes.len() != order.len();
            let predictions = if dedup {
                q.nodes
                    .iter()
                    .map(|v| {
                        preds
                            .iter()
                            .find(|p| p.node == *v)
                            .cloned()
                            .expect("routed")
                    })
                    .collect()
            } else {
                preds
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

    fn note_changed(&mut self, changed: &[u32]) {
        if let Some(s) = &mut self.swap {
            s.changed.extend_from_slice(changed);
        }
    }

    /// Checks one request's new nodes against the model and the graph.
    fn check_new_nodes(&self, nodes: &[NewNode]) -> Result<(), ServeError> {
        let width = self.features.width;
        let n = self.graph.num_nodes();
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
    fn apply_adds(&mut self) {
        if self.adds.is_empty() {
            return;
        }
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
        let _span = tracing::info_span!("serve_add_nodes", nodes = total as i64).entered();
        match self.add_nodes(&accepted) {
            Ok((ids, rows)) => {
                let mut next = 0;
                for a in accepted {
                    let mine = &ids[next..next + a.nodes.len()];
                    next += a.nodes.len();
                    let _ = a.reply.send(Ok(Answer {
                        model_version: self.version.clone(),
                        predictions: self.answer_rows(mine, None),
                        recomputed_rows: rows.clone(),
                        edges_added: Some(a.nodes.iter().map(|n| n.edges.len()).sum()),
                        edges_removed: None,
                    }));
                }
            }
            Err(e) => {
                for a in accepted {
                    let _ = a.reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// Adds the nodes of `adds` (checked) to the graph and recomputes what they reach;
    /// returns their ids and the rows recomputed per layer.
    fn add_nodes(&mut self, adds: &[PendingAdd]) -> Result<(Vec<u32>, Vec<usize>), ServeError> {
        let nodes: Vec<&NewNode> = adds.iter().flat_map(|a| &a.nodes).collect();
        let raw: Vec<f32> = nodes
            .iter()
            .flat_map(|v| v.features.iter().copied())
            .collect();
        let rows = self.inference.prepare_features(raw)?;
        let graph = Arc::make_mut(&mut self.graph);
        let features = Arc::make_mut(&mut self.features);
        features.data.extend_from_slice(&rows.data);
        let mut changed = Vec::new();
        let mut ids = Vec::with_capacity(nodes.len());
        for node in &nodes {
            let id = graph.add_node();
            let part = place_new_node(&node.edges, &self.owner, &self.part_sizes);
            self.part_sizes[part as usize] += 1;
            self.owner.push(part);
            for &e in &node.edges {
                graph.add_edge(id, e)?;
                changed.push(e);
            }
            changed.push(id);
            ids.push(id);
        }
        self.stats.nodes.store(graph.num_nodes(), Ordering::Relaxed);
        let rows = self.recompute(&changed)?;
        self.note_changed(&changed);
        Ok((ids, rows))
    }

    fn edges(&mut self, add: &[Edge], remove: &[Edge]) -> Result<Answer, ServeError> {
        let _span = tracing::info_span!(
            "serve_edges",
            add = add.len() as i64,
            remove = remove.len() as i64
        )
        .entered();
        let n = self.graph.num_nodes();
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
        let graph = Arc::make_mut(&mut self.graph);
        let mut changed = Vec::new();
        let (mut added, mut removed) = (0, 0);
        for e in remove {
            if graph.remove_edge(e.a, e.b)? {
                removed += 1;
                changed.extend([e.a, e.b]);
            }
        }
        for e in add {
            if graph.add_edge(e.a, e.b)? {
                added += 1;
                changed.extend([e.a, e.b]);
            }
        }
        let rows = self.recompute(&changed)?;
        self.note_changed(&changed);
        Ok(Answer {
            model_version: self.version.clone(),
            predictions: Vec::new(),
            recomputed_rows: rows,
            edges_added: Some(added),
            edges_removed: Some(removed),
        })
    }

    /// Recomputes the rows the graph change at `changed` reaches; returns the rows
    /// recomputed per layer. A panic in the computation (a failed kernel, or one injected
    /// with [`EngineConfig::panic_on_updates`]) is recovered as a partition actor's is: the
    /// tables are rebuilt from the engine's graph and features (its replica of the served
    /// state, which the change had already been applied to) before anything else is
    /// answered; meanwhile `/readyz` says not ready and queries wait within their deadline.
    fn recompute(&mut self, changed: &[u32]) -> Result<Vec<usize>, ServeError> {
        self.updates += 1;
        let inject = self.panic_on_updates.contains(&self.updates);
        let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if inject {
                panic!("injected failure in update {}", self.updates);
            }
            self.inference.update(
                &self.graph,
                &self.features,
                &mut self.outputs,
                changed,
                &self.owner,
                self.parts,
            )
        }));
        match attempt {
            Ok(r) => {
                let stats = r?;
                self.published
                    .update_rows(&stats.last_rows, self.outputs.logits());
                Ok(stats.rows_per_layer)
            }
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into());
                let _span =
                    tracing::info_span!("serve_recovery", update = self.updates as i64).entered();
                let t = Instant::now();
                self.stats.ready.store(false, Ordering::SeqCst);
                let rebuilt = self.inference.run(
                    &self.graph,
                    &self.features,
                    &parts_of(&self.owner, self.parts),
                );
                self.stats.ready.store(true, Ordering::SeqCst);
                self.stats.recoveries.fetch_add(1, Ordering::Relaxed);
                let out = rebuilt.map_err(|e| {
                    ServeError::Internal(format!("recovery after `{what}` failed: {e}"))
                })?;
                self.outputs = out;
                self.published
                    .replace(self.version.clone(), self.outputs.logits().clone());
                tracing::warn!(
                    "serving engine recovered from `{what}` in {:.1} ms",
                    t.elapsed().as_secs_f64() * 1e3
                );
                Ok(vec![self.graph.num_nodes(); self.outputs.layers.len()])
            }
        }
    }

    fn begin_swap(&mut self, saved: SavedModel, reply: Reply) {
        if self.swap.is_some() {
            let _ = reply.send(Err(ServeError::Conflict(
                "another model is being loaded; retry when it is served".into(),
            )));
            return;
        }
        if !saved
            .meta
            .config
            .same_architecture(self.inference.model().config())
        {
            let _ = reply.send(Err(ServeError::BadRequest(format!(
                "the new model ({} {}->{}->{}, {} layers) is not the architecture being served",
                saved.meta.config.kind,
                saved.meta.config.in_dim,
                saved.meta.config.hidden,
                saved.meta.config.out_dim,
                saved.meta.config.layers
            ))));
            return;
        }
        let version = saved.version();
        let graph = self.graph.clone();
        let features = self.features.clone();
        let owner = self.owner.clone();
        let (parts, threads) = (self.parts, self.threads);
        let normalize = saved.meta.normalize_features;
        let model: Model = saved.model;
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("trellis-serve-swap".into())
            .spawn(move || {
                let r = (|| {
                    let stream =
                        Stream::cpu(threads).map_err(|e| ServeError::Internal(e.to_string()))?;
                    let mut inf = Inference::new(model, stream, normalize)?;
                    let out = inf.run(&graph, &features, &parts_of(&owner, parts))?;
                    Ok((inf, out))
                })();
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            let _ = reply.send(Err(ServeError::Internal(format!(
                "cannot start the model load: {e}"
            ))));
            return;
        }
        self.swap = Some(SwapInFlight {
            done: rx,
            version,
            changed: Vec::new(),
            reply,
        });
    }

    /// Puts a computed new model in place (between batches), after replaying the updates
    /// made since its snapshot.
    fn finish_swap(&mut self) {
        let Some(s) = &self.swap else { return };
        let result = match s.done.try_recv() {
            Ok(r) => r,
            Err(mpsc::TryRecvError::Empty) => return,
            Err(mpsc::TryRecvError::Disconnected) => Err(ServeError::Internal(
                "the model load stopped without an answer".into(),
            )),
        };
        let s = self.swap.take().expect("checked above");
        let outcome = result.and_then(|(mut inf, mut out)| {
            if !s.changed.is_empty() {
                inf.update(
                    &self.graph,
                    &self.features,
                    &mut out,
                    &s.changed,
                    &self.owner,
                    self.parts,
                )?;
            }
            Ok((inf, out))
        });
        match outcome {
            Ok((inf, out)) => {
                self.inference = inf;
                self.outputs = out;
                self.version = s.version;
                self.published
                    .replace(self.version.clone(), self.outputs.logits().clone());
                *self.stats.version.lock().expect("stats lock") = self.version.clone();
                let _ = s.reply.send(Ok(Answer {
                    model_version: self.version.clone(),
                    predictions: Vec::new(),
                    recomputed_rows: vec![self.graph.num_nodes(); self.outputs.layers.len()],
                    edges_added: None,
                    edges_removed: None,
                }));
            }
            Err(e) => {
                let _ = s.reply.send(Err(e));
            }
        }
    }
}
