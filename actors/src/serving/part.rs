//! A serving partition as a sans-I/O machine: it owns its own (inner) nodes' rows of every
//! layer's table (and of every split layer's transformed table), their features and its
//! view of the graph ([`PartGraph`]), and computes them on its own stream, one layer of a
//! pass at a time: a [`PassStep`] first transforms the rows it names (split layers), sends
//! each other partition the rows that partition's blocks read (halo blocks through the
//! transport), then, once every halo block it needs is in, computes its rows of the layer.
//! Graph changes ([`DeltaOp`]) are applied between passes; a new model's tables are computed
//! into a staged set ([`Target::Staged`]) while the live one keeps serving, and installed
//! between two passes.
//!
//! Every computation runs inside `catch_unwind`: a panic answers the step with
//! [`ActorError::Panicked`] and emits [`ServeAction::Restart`]; the shell then restores the
//! partition ([`ServePartMachine::restore`]) from the served graph and features the engine
//! keeps (its replica of every partition's inputs), with empty tables that the engine's
//! recovery pass recomputes (`stale` until then: lookups are refused).
//!
//! States: the step slot is `Idle` or `Parked{id, step}` (waiting for halo blocks); the inbox
//! holds blocks by `(pass, layer tag)` then sender; `floor` is the lowest pass still
//! accepted (passes below it were aborted).
use super::plan::Ids;
use crate::faults::{DueServeFault, FaultPlan, ServeFaultAction};
use crate::ActorError;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;
use trellis_gpu::{PriorityGate, Stream, Tensor, UrgentGuard};
use trellis_runtime::inference::{
    Adjacency, HaloRows, Inference, PartGraph, PartInput, Rows, PREFETCH_AHEAD,
};
use trellis_runtime::{Model, ModelConfig, RuntimeError};
use trellis_transport::{
    HaloBlock, HaloPayload, MsgHeader, PartId, Phase, RunId, INCREMENT, TRANSFORMED,
};

/// Which set of tables a step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The tables queries are answered from.
    Live,
    /// A new model's tables, being computed (installed by [`ServePartMachine::install`]).
    Staged,
}

/// One change of the served graph, as the engine applied it to the whole graph (only
/// changes that took effect), in order.
#[derive(Debug, Clone, PartialEq)]
pub enum DeltaOp {
    /// A new node (the next id), owned by partition `owner`, with its prepared features.
    AddNode {
        id: u32,
        owner: u32,
        features: Vec<f32>,
    },
    AddEdge {
        a: u32,
        b: u32,
    },
    RemoveEdge {
        a: u32,
        b: u32,
    },
}

/// One layer of a pass, for one partition (from [`super::plan::LayerPlan`]).
#[derive(Debug, Clone)]
pub struct PassStep {
    /// The span of the engine's pass this step belongs to (the partition's span of the
    /// step is its child).
    pub trace: Option<trellis_transport::TraceContext>,
    /// The pass (unique per pass; halo blocks carry it as their epoch).
    pub seq: u32,
    pub layer: u16,
    pub target: Target,
    /// The graph update this pass computes (counting from 1), for fault plans.
    pub update: Option<u64>,
    /// Rows whose transformed rows are computed first (split layers).
    pub transform: Ids,
    /// Rows to compute.
    pub compute: Ids,
    /// `(to, rows)`: rows of this partition to send first.
    pub send: Vec<(u32, Ids)>,
    /// `(from, rows)`: rows to receive before computing.
    pub recv: Vec<(u32, Ids)>,
    /// Rows updated incrementally instead of computed (see
    /// [`super::plan::plan_incremental_update`]); empty otherwise.
    pub increment: Ids,
    /// `(to, rows)`: changes of this partition's re-transformed rows to send.
    pub increment_send: Vec<(u32, Ids)>,
    /// `(from, rows)`: changes to receive before updating `increment`.
    pub increment_recv: Vec<(u32, Ids)>,
    /// Answer the computed rows (the last layer's: the engine publishes them).
    pub return_rows: bool,
    /// With `return_rows`: answer the transformed rows of `transform` instead (the last
    /// layer is read from them, [`super::plan::LayerPlan::returns_transformed`]).
    pub return_transformed: bool,
    /// This layer recomputes every row of the partition (a recovery); after the last layer
    /// the partition answers lookups again.
    pub full: bool,
}

/// Rows a step computed.
#[derive(Debug, Clone, PartialEq)]
pub struct ComputedRows {
    pub ids: Ids,
    pub width: usize,
    pub data: Vec<f32>,
}

/// A partition's answer to a [`PassStep`].
#[derive(Debug, Clone)]
pub struct StepDone {
    pub part: u32,
    /// The computed rows, when asked for.
    pub rows: Option<ComputedRows>,
    pub compute_ms: f64,
    /// Halo payload bytes sent by this step.
    pub halo_bytes: u64,
}

/// A node's rows as a lookup returns them.
#[derive(Debug, Clone, PartialEq)]
pub struct LookedUp {
    /// Its last layer's row.
    pub logits: Vec<f32>,
    /// The asked-for layer's row.
    pub embedding: Option<Vec<f32>>,
}

/// A model's parameters on the host, from which every partition builds its own copy.
#[derive(Clone)]
pub struct ModelValues {
    pub config: ModelConfig,
    pub values: Vec<Tensor>,
    /// Row-normalise raw features (as training did).
    pub normalize: bool,
}

impl std::fmt::Debug for ModelValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelValues")
            .field("config", &self.config)
            .finish()
    }
}

impl ModelValues {
    /// The parameters of `model` (on the host).
    pub fn of(model: &Model, normalize: bool) -> Result<Self, RuntimeError> {
        let s = Stream::cpu(0)?;
        Ok(ModelValues {
            config: model.config().clone(),
            values: model.values_on_host(&s)?,
            normalize,
        })
    }

    /// A copy of the model ready for inference on `stream`.
    pub fn build(&self, stream: Stream) -> Result<Inference, RuntimeError> {
        let model = Model::with_values(self.config.clone(), self.values.clone())?;
        Inference::new(model, stream, self.normalize)
    }
}

/// What a partition serves from: its view of the graph, its nodes' features, the model, and
/// layer 0's input layout (decided by the whole feature matrix).
#[derive(Debug, Clone)]
pub struct PartData {
    pub graph: PartGraph,
    /// Prepared features of the partition's nodes, by local row.
    pub features: Rows,
    pub model: Arc<ModelValues>,
    pub sparse_input: bool,
}

/// What the machine asks its shell to do.
#[derive(Debug)]
pub enum ServeAction {
    /// Send a halo block through the transport.
    Send(HaloBlock),
    /// Answer step `id`.
    Answer {
        id: u64,
        result: Result<StepDone, ActorError>,
    },
    /// The partition panicked: restore it (and drop requests in flight).
    Restart,
}

/// One model's tables, by local row.
struct Tables {
    inference: Inference,
    layers: Vec<Rows>,
    transformed: Vec<Option<Rows>>,
    /// The pre-activation rows of the layers that take increments and have an activation
    /// ([`Model::keeps_pre_activation`]): increments are added there.
    pre: Vec<Option<Rows>>,
}

impl Tables {
    fn new(
        model: &ModelValues,
        stream: Stream,
        sparse: bool,
        rows: usize,
    ) -> Result<Self, RuntimeError> {
        let mut inference = model.build(stream)?;
        inference.set_sparse_input(sparse);
        let n = inference.model().num_layers();
        let table = |l: usize| {
            let mut t = Rows {
                width: inference.layer_width(l),
                data: Vec::new(),
            };
            t.reserve_rows(rows + super::spare_rows(rows));
            t.grow(rows);
            t.prefer_huge_pages();
            t
        };
        let layers = (0..n).map(table).collect();
        let table_if = |keep: fn(&Model, usize) -> bool| -> Vec<Option<Rows>> {
            (0..n)
                .map(|l| keep(inference.model(), l).then(|| table(l)))
                .collect()
        };
        let transformed = table_if(Model::reads_transformed_only);
        let pre = table_if(Model::keeps_pre_activation);
        Ok(Tables {
            inference,
            layers,
            transformed,
            pre,
        })
    }

    fn grow(&mut self, rows: usize) {
        for t in self
            .layers
            .iter_mut()
            .chain(self.transformed.iter_mut().flatten())
            .chain(self.pre.iter_mut().flatten())
        {
            t.grow(rows);
        }
    }
}

struct State {
    graph: PartGraph,
    features: Rows,
    live: Tables,
    staged: Option<Tables>,
    sparse: bool,
    /// The halo rows' global-to-row table, reused by every step.
    halo_slots: Vec<u32>,
    /// The same for the changes an incremental step adds.
    increment_slots: Vec<u32>,
    /// Per local row, the scale of an incremental step's updated rows, 0 for the others
    /// (zero between steps), reused by every step: [`add_changes`].
    update_scales: Vec<f32>,
    /// The degree each node had when the live tables' last layer was last computed, for the
    /// nodes whose degree changed since (an incremental step scales their old transformed
    /// rows by it); [`NEW_NODE`] for nodes added since (they had no row).
    prev_degree: HashMap<u32, u32>,
    /// The rows the last step computed, when the next layer of its pass is split: that
    /// layer re-transforms exactly these rows, and takes them from here instead of gathering
    /// them again from the table (1 KB rows at random places of a table of 1 GB).
    carried: Option<CarriedRows>,
}

/// A step's computed rows of layer `layer` of pass `seq` on the tables `target`: the rows
/// of `ids`, one after the other (the incremented rows, then the computed ones; each part
/// ascending).
struct CarriedRows {
    seq: u32,
    layer: u16,
    target: Target,
    ids: Vec<u32>,
    data: Vec<f32>,
}

/// Carried rows taken as the input of a transform: `order[j]` is the place in `ids` of the
/// `j`-th row of the step's (ascending) list.
struct CarriedInput {
    ids: Vec<u32>,
    data: Vec<f32>,
    order: Vec<u32>,
}

impl CarriedRows {
    /// The computed rows `computed` of `computed_ids` and the incremented rows
    /// `incremented` of `incremented_ids` (both ascending, disjoint), without copying the
    /// incremented ones (all of an update's rows but its new nodes).
    fn new(
        (seq, layer, target): (u32, u16, Target),
        (computed_ids, computed): (&[u32], Vec<f32>),
        (incremented_ids, mut incremented): (&[u32], Vec<f32>),
    ) -> Self {
        let (ids, data) = if incremented_ids.is_empty() {
            (computed_ids.to_vec(), computed)
        } else {
            incremented.extend_from_slice(&computed);
            let mut ids = incremented_ids.to_vec();
            ids.extend_from_slice(computed_ids);
            (ids, incremented)
        };
        CarriedRows {
            seq,
            layer,
            target,
            ids,
            data,
        }
    }

    /// The rows, if they are the input of `step` (its re-transformed rows).
    fn input_of(self, step: &PassStep) -> Option<CarriedInput> {
        if self.seq != step.seq
            || self.target != step.target
            || self.layer + 1 != step.layer
            || self.ids.len() != step.transform.len()
        {
            return None;
        }
        // The two ascending runs of `ids`, merged: each row's place in the step's list.
        let split = self
            .ids
            .windows(2)
            .position(|p| p[0] > p[1])
            .map_or(self.ids.len(), |i| i + 1);
        let (a, b) = self.ids.split_at(split);
        let mut order = Vec::with_capacity(self.ids.len());
        let (mut i, mut j) = (0, 0);
        for &want in step.transform.iter() {
            if i < a.len() && a[i] == want {
                order.push(i as u32);
                i += 1;
            } else if j < b.len() && b[j] == want {
                order.push((split + j) as u32);
                j += 1;
            } else {
                return None;
            }
        }
        Some(CarriedInput {
            ids: self.ids,
            data: self.data,
            order,
        })
    }
}

impl CarriedInput {
    /// Layer `l`'s transform of the carried rows, in the step's order (the transformed rows
    /// are the narrower ones: reordering them is cheaper than the input).
    fn transform(
        self,
        inference: &mut Inference,
        l: usize,
        graph: &PartGraph,
    ) -> Result<Vec<f32>, RuntimeError> {
        let z = inference.transform_given_rows(l, graph, &self.ids, self.data)?;
        let n = self.order.len();
        if n == 0 || self.order.iter().enumerate().all(|(j, &k)| j == k as usize) {
            return Ok(z);
        }
        let w = z.len() / n;
        let mut out = Vec::with_capacity(z.len());
        for &k in &self.order {
            out.extend_from_slice(&z[k as usize * w..(k as usize + 1) * w]);
        }
        Ok(out)
    }
}

/// `prev_degree` of a node added since the live last layer was computed.
const NEW_NODE: u32 = u32::MAX;

/// A step waiting for its halo blocks.
struct Parked {
    id: u64,
    step: PassStep,
    /// Time its first stage took, and the halo bytes it sent.
    ms: f64,
    bytes: u64,
    /// An incremental step's changes of its own re-transformed rows (`step.transform`).
    changes: Vec<f32>,
}

/// What the first stage of a step did.
struct Started {
    bytes: u64,
    changes: Vec<f32>,
}

impl PassStep {
    /// Whether the step updates rows incrementally or sends changes for others that do.
    fn is_incremental(&self) -> bool {
        !self.increment.is_empty() || !self.increment_send.is_empty()
    }
}

/// The serving partition machine (see the module's documentation).
pub struct ServePartMachine {
    part: u32,
    run: RunId,
    faults: Arc<FaultPlan>,
    threads: usize,
    state: Option<State>,
    inbox: BTreeMap<(u32, u16), BTreeMap<u32, HaloBlock>>,
    parked: Option<Parked>,
    floor: u32,
    stale: bool,
    actions: VecDeque<ServeAction>,
    /// Steps on the live tables are urgent work of this gate: background (training) streams
    /// of the same gate pause between their kernel pieces while one computes.
    priority: Option<PriorityGate>,
}

/// The message of a caught panic.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

impl ServePartMachine {
    /// Partition `data.graph.part()` of run `run`, its stream on `threads` CPU threads.
    pub fn new(
        data: PartData,
        run: RunId,
        faults: Arc<FaultPlan>,
        threads: usize,
    ) -> Result<Self, ActorError> {
        let part = data.graph.part();
        let mut m = ServePartMachine {
            part,
            run,
            faults,
            threads,
            state: None,
            inbox: BTreeMap::new(),
            parked: None,
            floor: 0,
            stale: false,
            actions: VecDeque::new(),
            priority: None,
        };
        m.state = Some(m.build_state(data)?);
        Ok(m)
    }

    fn build_state(&self, data: PartData) -> Result<State, ActorError> {
        let rows = data.graph.inner().len();
        if data.features.len() != rows {
            return Err(self.protocol(format!(
                "{} feature rows for {rows} nodes",
                data.features.len()
            )));
        }
        let stream = Stream::cpu(self.threads).map_err(RuntimeError::from)?;
        let live = Tables::new(&data.model, stream, data.sparse_input, rows)
            .map_err(|e| self.compute_err(e))?;
        let mut features = data.features;
        features.reserve_rows(super::spare_rows(rows));
        features.prefer_huge_pages();
        Ok(State {
            graph: data.graph,
            features,
            live,
            staged: None,
            sparse: data.sparse_input,
            halo_slots: Vec::new(),
            increment_slots: Vec::new(),
            update_scales: Vec::new(),
            prev_degree: HashMap::new(),
            carried: None,
        })
    }

    /// Makes this partition's live steps urgent work of `gate` (see [`PriorityGate`]); a new
    /// model's tables stay background work.
    pub fn with_priority(mut self, gate: Option<PriorityGate>) -> Self {
        self.priority = gate;
        self
    }

    /// Holds the gate while a live step computes.
    fn urgent(&self, target: Target) -> Option<UrgentGuard> {
        match target {
            Target::Live => self.priority.as_ref().map(PriorityGate::urgent),
            Target::Staged => None,
        }
    }

    /// The partition id.
    pub fn part(&self) -> u32 {
        self.part
    }

    /// The next action for the shell.
    pub fn poll_action(&mut self) -> Option<ServeAction> {
        self.actions.pop_front()
    }

    fn protocol(&self, detail: String) -> ActorError {
        ActorError::Protocol {
            part: self.part,
            detail,
        }
    }
    fn compute_err(&self, source: RuntimeError) -> ActorError {
        ActorError::Compute {
            part: self.part,
            source,
        }
    }

    fn state(&mut self) -> Result<&mut State, ActorError> {
        let part = self.part;
        self.state.as_mut().ok_or(ActorError::Unreachable {
            part,
            detail: "the partition could not be restored".into(),
        })
    }

    /// [`Self::guarded`], run on the stream's thread budget: the stage's kernels then run
    /// where they are issued instead of each being handed to a pool thread and waited for
    /// (two thread switches per kernel, most of a small update's time).
    fn guarded_on_stream<T: Send>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, ActorError> + Send,
    ) -> Result<T, ActorError> {
        match self
            .state
            .as_ref()
            .map(|st| st.live.inference.stream().budget().clone())
        {
            Some(budget) => budget.install(|| self.guarded(f)),
            None => self.guarded(f),
        }
    }

    /// Runs `f` inside `catch_unwind`; a panic becomes [`ActorError::Panicked`] and a restart.
    fn guarded<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, ActorError>,
    ) -> Result<T, ActorError> {
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(r) => r,
            Err(p) => {
                self.actions.push_back(ServeAction::Restart);
                Err(ActorError::Panicked {
                    part: self.part,
                    message: panic_text(&*p),
                })
            }
        }
    }

    /// Applies graph changes (the same ones the engine applied to the whole graph).
    pub fn handle_delta(&mut self, ops: &[DeltaOp]) -> Result<(), ActorError> {
        self.guarded(|m| {
            let part = m.part;
            let st = m.state()?;
            for op in ops {
                match op {
                    DeltaOp::AddNode {
                        id,
                        owner,
                        features,
                    } => {
                        let mine = *owner == part;
                        st.graph.add_node(*id, mine)?;
                        st.prev_degree.insert(*id, NEW_NODE);
                        if mine {
                            if features.len() != st.features.width {
                                return Err(ActorError::Protocol {
                                    part,
                                    detail: format!(
                                        "node {id} has {} features, the model takes {}",
                                        features.len(),
                                        st.features.width
                                    ),
                                });
                            }
                            st.features.data.extend_from_slice(features);
                        }
                    }
                    DeltaOp::AddEdge { a, b } | DeltaOp::RemoveEdge { a, b } => {
                        for v in [*a, *b] {
                            if (v as usize) < st.graph.num_nodes() {
                                let d = st.graph.degree(v) as u32;
                                st.prev_degree.entry(v).or_insert(d);
                            }
                        }
                        match op {
                            DeltaOp::AddEdge { .. } => st.graph.add_edge(*a, *b)?,
                            _ => st.graph.remove_edge(*a, *b)?,
                        }
                    }
                }
            }
            let rows = st.graph.inner().len();
            st.live.grow(rows);
            if let Some(s) = &mut st.staged {
                s.grow(rows);
            }
            Ok(())
        })
    }

    /// Starts step `id`: transform, send, then compute at once or park for halo blocks.
    pub fn handle_step(&mut self, id: u64, step: PassStep) {
        if step.seq < self.floor {
            let e = self.protocol(format!("pass {} was aborted", step.seq));
            self.actions
                .push_back(ServeAction::Answer { id, result: Err(e) });
            return;
        }
        if let Some(p) = self.parked.take() {
            let e = self.protocol(format!(
                "pass {} layer {} superseded",
                p.step.seq, p.step.layer
            ));
            self.actions.push_back(ServeAction::Answer {
                id: p.id,
                result: Err(e),
            });
        }
        let t = Instant::now();
        let urgent = self.urgent(step.target);
        let started = self.guarded_on_stream(|m| m.start(&step));
        drop(urgent);
        match started {
            Ok(Started { bytes, changes }) => {
                let ms = t.elapsed().as_secs_f64() * 1e3;
                self.parked = Some(Parked {
                    id,
                    step,
                    ms,
                    bytes,
                    changes,
                });
                self.try_finish();
            }
            Err(e) => self
                .actions
                .push_back(ServeAction::Answer { id, result: Err(e) }),
        }
    }

    /// A halo block arrived.
    pub fn handle_halo(&mut self, block: HaloBlock) {
        let h = block.header;
        if h.run != self.run || h.epoch < self.floor || h.to.0 != self.part {
            return;
        }
        self.inbox
            .entry((h.epoch, h.layer))
            .or_default()
            .insert(h.from.0, block);
        self.try_finish();
    }

    /// Abandons pass `seq` (and every earlier one): a parked step answers an error, blocks are
    /// dropped.
    pub fn handle_abort(&mut self, seq: u32) {
        self.floor = self.floor.max(seq + 1);
        let floor = self.floor;
        self.inbox.retain(|(s, _), _| *s >= floor);
        if let Some(p) = self.parked.take() {
            if p.step.seq < floor {
                let e = self.protocol(format!("pass {} was aborted", p.step.seq));
                self.actions.push_back(ServeAction::Answer {
                    id: p.id,
                    result: Err(e),
                });
            } else {
                self.parked = Some(p);
            }
        }
    }

    fn tag(&self, step: &PassStep) -> Result<u16, ActorError> {
        let st = self
            .state
            .as_ref()
            .ok_or_else(|| self.protocol("no state".into()))?;
        let tables = match step.target {
            Target::Live => &st.live,
            Target::Staged => st
                .staged
                .as_ref()
                .ok_or_else(|| self.protocol("no new model is being computed".into()))?,
        };
        let split = tables
            .inference
            .model()
            .reads_transformed_only(step.layer as usize);
        Ok(step.layer | if split { TRANSFORMED } else { 0 })
    }

    /// Stage one of a step: the fault check, the transform (and an incremental step's
    /// changes of the re-transformed rows), the sends.
    fn start(&mut self, step: &PassStep) -> Result<Started, ActorError> {
        let (part, run) = (self.part, self.run);
        let l = step.layer as usize;
        if let (Some(u), Target::Live) = (step.update, step.target) {
            match self.faults.serve_fault_due(part, u, step.layer) {
                Some(DueServeFault {
                    action: ServeFaultAction::Panic,
                    message,
                }) => {
                    // A kernel interrupted half-way leaves its tables half-written.
                    if let Some(st) = &mut self.state {
                        for t in &mut st.live.layers {
                            t.data.iter_mut().step_by(3).for_each(|x| *x = f32::NAN);
                        }
                    }
                    panic!("{message}");
                }
                // A stuck kernel: the partition's compute thread does nothing for a while
                // (this blocks the actor's thread, as a hung kernel would), then goes on.
                Some(DueServeFault {
                    action: ServeFaultAction::Stall(d),
                    ..
                }) => std::thread::sleep(d),
                None => {}
            }
        }
        let tag = self.tag(step)?;
        let st = self.state()?;
        let State {
            graph,
            features,
            live,
            staged,
            prev_degree,
            carried,
            ..
        } = st;
        let carried = carried.take().and_then(|c| c.input_of(step));
        let tables = match step.target {
            Target::Live => live,
            Target::Staged => staged.as_mut().expect("checked by tag"),
        };
        if l >= tables.layers.len() {
            return Err(ActorError::Protocol {
                part,
                detail: format!("layer {l} of a {}-layer model", tables.layers.len()),
            });
        }
        let err = |e: RuntimeError| ActorError::Compute { part, source: e };
        if step.is_incremental() && !tables.inference.model().takes_increments(l) {
            return Err(ActorError::Protocol {
                part,
                detail: format!("an incremental step of layer {l}, which takes no increments"),
            });
        }
        let mut changes = Vec::new();
        if let Some(mut z) = tables.transformed[l].take() {
            let r = (|| {
                let input = &tables.layers[l - 1];
                let zr = match carried {
                    Some(rows) => rows.transform(&mut tables.inference, l, graph)?,
                    None => tables.inference.transform_rows(
                        l,
                        &*graph,
                        &step.transform,
                        &local_table(graph, input),
                    )?,
                };
                let locals = graph.locals(&step.transform)?;
                if step.is_incremental() {
                    let old = OldRows::Table {
                        z: &z,
                        locals: &locals,
                    };
                    changes = scaled_changes(graph, prev_degree, &step.transform, old, &zr);
                }
                z.scatter(&locals, &zr);
                Ok(())
            })();
            tables.transformed[l] = Some(z);
            r.map_err(err)?;
        } else if step.is_incremental() {
            // Layer 0: `Z = X W` of the changed nodes, whose features never change.
            let zr = tables
                .inference
                .transform_rows(0, &*graph, &step.transform, &local_table(graph, features))
                .map_err(err)?;
            changes = scaled_changes(graph, prev_degree, &step.transform, OldRows::Same, &zr);
        }
        let source = match &tables.transformed[l] {
            Some(z) => z,
            None if l == 0 => &*features,
            None => &tables.layers[l - 1],
        };
        let mut bytes = 0;
        let mut blocks = Vec::with_capacity(step.send.len() + step.increment_send.len());
        let width = source.width;
        let change_width = tables.layers[l].width;
        // The block of `rows` rows of `cols` values `data` for partition `to`, tagged `layer`.
        let mut send = |to: u32, layer: u16, rows: usize, cols: usize, data: Vec<f32>| {
            bytes += data.len() as u64 * 4;
            blocks.push(HaloBlock {
                header: MsgHeader {
                    run,
                    epoch: step.seq,
                    layer,
                    phase: Phase::Eval,
                    from: PartId(part),
                    to: PartId(to),
                },
                trace: None,
                rows: rows as u32,
                cols: cols as u32,
                payload: HaloPayload::F32(data.into()),
            });
        };
        for (to, ids) in &step.send {
            let locals = graph.locals(ids).map_err(err)?;
            send(*to, tag, ids.len(), width, source.gather(&locals));
        }
        let width = change_width;
        for (to, ids) in &step.increment_send {
            let mut data = Vec::with_capacity(ids.len() * width);
            for v in ids.iter() {
                let k = step
                    .transform
                    .binary_search(v)
                    .map_err(|_| ActorError::Protocol {
                        part,
                        detail: format!(
                            "the change of node {v} for partition {to}: not re-transformed"
                        ),
                    })?;
                data.extend_from_slice(&changes[k * width..(k + 1) * width]);
            }
            send(*to, tag | INCREMENT, ids.len(), width, data);
        }
        self.actions
            .extend(blocks.into_iter().map(ServeAction::Send));
        Ok(Started { bytes, changes })
    }

    /// Computes the parked step if every block it needs is in.
    fn try_finish(&mut self) {
        let Some(Parked { step, .. }) = &self.parked else {
            return;
        };
        let Ok(tag) = self.tag(step) else {
            let id = self.parked.take().expect("parked").id;
            let e = self.protocol("the step's tables are gone".into());
            self.actions
                .push_back(ServeAction::Answer { id, result: Err(e) });
            return;
        };
        let key = (step.seq, tag);
        let increment_key = (step.seq, tag | INCREMENT);
        let missing = |key, list: &[(u32, Ids)]| {
            let have = self.inbox.get(&key);
            list.iter()
                .any(|(from, _)| !have.is_some_and(|b| b.contains_key(from)))
        };
        if missing(key, &step.recv) || missing(increment_key, &step.increment_recv) {
            return;
        }
        let Parked {
            id,
            step,
            ms,
            bytes,
            changes,
        } = self.parked.take().expect("parked");
        let blocks = self.inbox.remove(&key).unwrap_or_default();
        let increments = self.inbox.remove(&increment_key).unwrap_or_default();
        let t = Instant::now();
        let urgent = self.urgent(step.target);
        let result = self.guarded_on_stream(|m| m.finish(&step, &blocks, &changes, &increments));
        drop(urgent);
        let result = result.map(|rows| StepDone {
            part: self.part,
            rows,
            compute_ms: ms + t.elapsed().as_secs_f64() * 1e3,
            halo_bytes: bytes,
        });
        if result.is_ok() && step.full && step.return_rows {
            self.stale = false;
        }
        self.actions.push_back(ServeAction::Answer { id, result });
    }

    /// Stage two: the layer's rows of `step.compute` from own and received rows, and the
    /// rows of `step.increment` updated by the changes of the re-transformed rows (own:
    /// `changes`, received: `increments`).
    fn finish(
        &mut self,
        step: &PassStep,
        blocks: &BTreeMap<u32, HaloBlock>,
        changes: &[f32],
        increments: &BTreeMap<u32, HaloBlock>,
    ) -> Result<Option<ComputedRows>, ActorError> {
        let part = self.part;
        let l = step.layer as usize;
        let st = self.state()?;
        let State {
            graph,
            features,
            live,
            staged,
            halo_slots,
            increment_slots,
            update_scales,
            prev_degree,
            carried,
            ..
        } = st;
        let tables = match step.target {
            Target::Live => live,
            Target::Staged => staged.as_mut().ok_or(ActorError::Protocol {
                part,
                detail: "no new model is being computed".into(),
            })?,
        };
        let err = |e: RuntimeError| ActorError::Compute { part, source: e };
        let source = match &tables.transformed[l] {
            Some(z) => z,
            None if l == 0 => &*features,
            None => &tables.layers[l - 1],
        };
        let mut halo = HaloRows::reuse(source.width, std::mem::take(halo_slots));
        let r = received(part, &mut halo, &step.recv, blocks, "halo block");
        if let Err(e) = r {
            *halo_slots = halo.into_slots();
            return Err(e);
        }
        let input = PartInput {
            own: source,
            graph: &*graph,
            halo: &halo,
        };
        let inference = &mut tables.inference;
        let computed = graph.locals(&step.compute).and_then(|locals| {
            let rows = match &mut tables.pre[l] {
                // The pre-activation rows are kept for later increments.
                Some(pre) => {
                    let p =
                        inference.compute_pre_activation_rows(l, &*graph, &step.compute, &input)?;
                    pre.scatter(&locals, &p);
                    inference.activate_rows(l, p)?
                }
                None => inference.compute_rows(l, &*graph, &step.compute, &input)?,
            };
            Ok((locals, rows))
        });
        *halo_slots = halo.into_slots();
        let (locals, mut rows) = computed.map_err(err)?;
        tables.layers[l].scatter(&locals, &rows);
        let width = tables.layers[l].width;
        let mut ids = step.compute.clone();
        // The next layer re-transforms the rows this one computes (`plan_layers`).
        let carry = !step.return_rows && tables.transformed.get(l + 1).is_some_and(Option::is_some);
        let mut incremented = Vec::new();
        if !step.increment.is_empty() {
            let mut add = HaloRows::reuse(width, std::mem::take(increment_slots));
            let r = received(
                part,
                &mut add,
                &step.increment_recv,
                increments,
                "changed rows",
            )
            .and_then(|()| {
                let locals = graph.locals(&step.increment).map_err(err)?;
                // `changes` are `start`'s: one row of `width` per re-transformed row.
                let own = OwnChanges {
                    ids: &step.transform,
                    values: changes,
                };
                let received = (!step.increment_recv.is_empty()).then_some(&add);
                match &mut tables.pre[l] {
                    Some(pre) => {
                        let updated =
                            add_changes(graph, &locals, own, received, pre, update_scales);
                        let y = tables.inference.activate_rows(l, updated).map_err(err)?;
                        tables.layers[l].scatter(&locals, &y);
                        incremented = y;
                    }
                    None => {
                        let updated = add_changes(
                            graph,
                            &locals,
                            own,
                            received,
                            &mut tables.layers[l],
                            update_scales,
                        );
                        if carry {
                            incremented = updated;
                        }
                    }
                }
                Ok(locals)
            });
            *increment_slots = add.into_slots();
            let locals = r?;
            if step.return_rows {
                rows.extend_from_slice(&tables.layers[l].gather(&locals));
                let mut all = ids.to_vec();
                all.extend_from_slice(&step.increment);
                ids = Arc::new(all);
            }
        }
        if carry {
            *carried = Some(CarriedRows::new(
                (step.seq, step.layer, step.target),
                (&step.compute, rows),
                (&step.increment, incremented),
            ));
            return Ok(None);
        }
        if step.return_rows && step.target == Target::Live {
            // The live last layer now matches the degrees of the graph as it is.
            prev_degree.clear();
        }
        if step.return_rows && step.return_transformed {
            let z = tables.transformed[l].as_ref().ok_or(ActorError::Protocol {
                part,
                detail: format!("transformed rows of layer {l}, which is not split"),
            })?;
            let locals = graph.locals(&step.transform).map_err(err)?;
            return Ok(Some(ComputedRows {
                ids: step.transform.clone(),
                width: z.width,
                data: z.gather(&locals),
            }));
        }
        Ok(step.return_rows.then_some(ComputedRows {
            ids,
            width,
            data: rows,
        }))
    }

    /// The last layer's rows (and layer `layer`'s, if asked) of the partition's nodes `ids`,
    /// from the live tables.
    pub fn lookup(
        &mut self,
        ids: &[u32],
        layer: Option<usize>,
    ) -> Result<Vec<LookedUp>, ActorError> {
        if self.stale {
            return Err(ActorError::Unreachable {
                part: self.part,
                detail: "restarted; its tables are being recomputed".into(),
            });
        }
        let part = self.part;
        let st = self.state()?;
        let locals = st
            .graph
            .locals(ids)
            .map_err(|e| ActorError::Compute { part, source: e })?;
        let layers = &st.live.layers;
        if let Some(l) = layer.filter(|&l| l >= layers.len()) {
            return Err(ActorError::Protocol {
                part,
                detail: format!("layer {l} of a {}-layer model", layers.len()),
            });
        }
        let last = layers.last().expect("a model has a layer");
        Ok(locals
            .iter()
            .map(|&r| LookedUp {
                logits: last.row(r).to_vec(),
                embedding: layer.map(|l| layers[l].row(r).to_vec()),
            })
            .collect())
    }

    /// Starts computing `model`'s tables beside the live ones (zero rows until its passes).
    pub fn stage(&mut self, model: Arc<ModelValues>) -> Result<(), ActorError> {
        let threads = self.threads;
        self.guarded(|m| {
            let st = m.state()?;
            let stream = Stream::cpu(threads).map_err(RuntimeError::from)?;
            let t = Tables::new(&model, stream, st.sparse, st.graph.inner().len())?;
            st.staged = Some(t);
            Ok(())
        })
    }

    /// Makes the staged tables the live ones (false if there were none).
    pub fn install(&mut self) -> Result<bool, ActorError> {
        let st = self.state()?;
        Ok(match st.staged.take() {
            Some(t) => {
                st.live = t;
                // The new tables were computed on the graph as it is.
                st.prev_degree.clear();
                true
            }
            None => false,
        })
    }

    /// Drops the staged tables.
    pub fn drop_staged(&mut self) {
        if let Some(st) = &mut self.state {
            st.staged = None;
        }
    }

    /// After a restart: everything is rebuilt from `data` (the engine's copy of this
    /// partition's inputs); the tables are empty (`stale`) until a recovery pass
    /// recomputes them. Blocks and parked steps are dropped.
    pub fn restore(&mut self, data: Result<PartData, ActorError>) {
        self.inbox.clear();
        if let Some(p) = self.parked.take() {
            let e = ActorError::Unreachable {
                part: self.part,
                detail: "the partition restarted".into(),
            };
            self.actions.push_back(ServeAction::Answer {
                id: p.id,
                result: Err(e),
            });
        }
        self.stale = true;
        self.state = None;
        match data.and_then(|d| self.build_state(d)) {
            Ok(s) => self.state = Some(s),
            Err(e) => tracing::error!("serving partition {}: restore failed: {e}", self.part),
        }
    }

    /// Whether the partition restarted and its tables are not recomputed yet.
    pub fn is_stale(&self) -> bool {
        self.stale
    }
}

/// Adds the rows of `blocks` (by sender, the lists `expect` names) to `into`.
fn received(
    part: u32,
    into: &mut HaloRows,
    expect: &[(u32, Ids)],
    blocks: &BTreeMap<u32, HaloBlock>,
    what: &str,
) -> Result<(), ActorError> {
    let width = into.width;
    for (from, ids) in expect {
        let bad = |detail: String| ActorError::Protocol { part, detail };
        let b = blocks
            .get(from)
            .ok_or_else(|| bad(format!("no {what} from partition {from}")))?;
        if b.rows as usize != ids.len() || b.cols as usize != width {
            return Err(bad(format!(
                "{what} from partition {from} is {}x{}, expected {}x{width}",
                b.rows,
                b.cols,
                ids.len(),
            )));
        }
        let values = b
            .values()
            .map_err(|e| bad(format!("{what} from partition {from}: {e}")))?;
        into.extend(ids, &values)
            .map_err(|e| bad(format!("{what} from partition {from}: {e}")))?;
    }
    Ok(())
}

/// Where [`scaled_changes`] finds the old transformed rows.
enum OldRows<'a> {
    /// In a split layer's table `z`, at the local rows `locals` of the changed rows.
    Table { z: &'a Rows, locals: &'a [u32] },
    /// They are the new ones (layer 0: the features never change; only the scale does).
    Same,
}

/// The changes `ΔY_u = Z'_u / sqrt(d'_u + 1) - Z_u / sqrt(d_u + 1)` of the re-transformed
/// rows `ids`: `new` holds the new rows `Z'`, `old` says where the old ones `Z` are; `d` is
/// the degree the last layer was computed with (`prev_degree`, else the current one, `d'`).
/// A node added since had no row: its change is its new row, scaled.
fn scaled_changes(
    graph: &PartGraph,
    prev_degree: &HashMap<u32, u32>,
    ids: &[u32],
    old: OldRows<'_>,
    new: &[f32],
) -> Vec<f32> {
    let w = if ids.is_empty() {
        0
    } else {
        new.len() / ids.len()
    };
    let mut out = Vec::with_capacity(new.len());
    for (k, &v) in ids.iter().enumerate() {
        let d_new = graph.degree(v) as f32;
        let s_new = 1.0 / (d_new + 1.0).sqrt();
        let s_old = match prev_degree.get(&v) {
            Some(&NEW_NODE) => 0.0,
            Some(&d) => 1.0 / (d as f32 + 1.0).sqrt(),
            None => s_new,
        };
        let fresh = &new[k * w..(k + 1) * w];
        let before = match old {
            OldRows::Table { z, locals } => z.row(locals[k]),
            OldRows::Same => fresh,
        };
        out.extend(
            fresh
                .iter()
                .zip(before)
                .map(|(&a, &b)| a * s_new - b * s_old),
        );
    }
    out
}

/// A partition's own re-transformed rows `ids` (ascending) and their changes `ΔY`.
struct OwnChanges<'a> {
    ids: &'a [u32],
    values: &'a [f32],
}

/// Adds into the local rows `locals` of `table` `Σ_u ΔY_u / sqrt(d_v + 1)` over the
/// neighbours `u` of each row `v` (and `v` itself) that changed, and returns the updated rows
/// in the order of `locals`. The partition's own changes are found from their side (a
/// change reaches its own node's neighbours, whose lists the partition holds: ~20 rows per
/// change instead of ~20 lookups per updated row), the received ones (`received`, the halo
/// nodes' changes) from the updated rows' side. Each row is then visited once, in memory
/// order, with every change it takes (in the changes' order, own ones first: the sums of a
/// visit per change), and copied out while it is in the cache.
fn add_changes(
    graph: &PartGraph,
    locals: &[u32],
    own: OwnChanges<'_>,
    received: Option<&HaloRows>,
    table: &mut Rows,
    scales: &mut Vec<f32>,
) -> Vec<f32> {
    let w = table.width;
    // One read per reached row tells whether it is updated and its scale (a cache miss per
    // neighbour on a large graph, where the flag and the degree were two).
    if scales.len() < table.len() {
        scales.resize(table.len(), 0.0);
    }
    let inner = graph.inner();
    for &r in locals {
        scales[r as usize] = 1.0 / (graph.degree(inner[r as usize]) as f32 + 1.0).sqrt();
    }
    /// An own change `change` (its place in `own.ids`) that reaches local row `row`.
    struct Reach {
        row: u32,
        change: u32,
    }
    let mut reached = Vec::with_capacity(own.ids.len() * 24);
    for (k, &u) in own.ids.iter().enumerate() {
        for v in std::iter::once(u).chain(graph.neighbors(u).iter().copied()) {
            if let Some(r) = graph.local(v).filter(|&r| scales[r as usize] != 0.0) {
                reached.push(Reach {
                    row: r,
                    change: k as u32,
                });
            }
        }
    }
    // Stable: a row's changes stay in their order.
    reached.sort_by_key(|c| c.row);
    // The rows in memory order with their places in `locals` (nearly always ascending
    // already: a partition numbers its rows in the order of their ids).
    let mut visits: Vec<(u32, u32)> = locals
        .iter()
        .enumerate()
        .map(|(i, &r)| (r, i as u32))
        .collect();
    let in_order = locals.is_sorted();
    if !in_order {
        visits.sort_unstable();
    }
    let mut out = Vec::with_capacity(locals.len() * w);
    if !in_order {
        out.resize(locals.len() * w, 0.0);
    }
    let mut next = 0;
    for (j, &(r, place)) in visits.iter().enumerate() {
        table.prefetch_row(visits.get(j + PREFETCH_AHEAD).map(|(r, _)| r));
        let s = scales[r as usize];
        let row = &mut table.data[r as usize * w..(r as usize + 1) * w];
        while next < reached.len() && reached[next].row < r {
            next += 1;
        }
        while next < reached.len() && reached[next].row == r {
            let k = reached[next].change as usize;
            let dy = &own.values[k * w..(k + 1) * w];
            row.iter_mut().zip(dy).for_each(|(y, &d)| *y += d * s);
            next += 1;
        }
        if let Some(received) = received {
            for &u in graph.neighbors(inner[r as usize]) {
                if let Some(dy) = received.get(u) {
                    row.iter_mut().zip(dy).for_each(|(y, &d)| *y += d * s);
                }
            }
        }
        if in_order {
            out.extend_from_slice(row);
        } else {
            out[place as usize * w..(place as usize + 1) * w].copy_from_slice(row);
        }
    }
    for &r in locals {
        scales[r as usize] = 0.0;
    }
    out
}

/// A part's own table read by global id (a transform reads only its inner rows).
fn local_table<'a>(graph: &'a PartGraph, own: &'a Rows) -> PartInput<'a> {
    static EMPTY: std::sync::OnceLock<HaloRows> = std::sync::OnceLock::new();
    PartInput {
        own,
        graph,
        halo: EMPTY.get_or_init(|| HaloRows::new(0)),
    }
}

#[cfg(test)]
mod tests;
