//! The serving partition actor: a thin actix shell around the [`ServePartMachine`], and the
//! node that starts one per partition on its own arbiter (thread) under actix's
//! `Supervisor`, as training's node supervisor does. The shell turns messages into the
//! machine's events, sends the halo blocks it emits through the transport, answers steps
//! through their reply channels, and restores the partition when the machine asks (a caught
//! panic), from the [`ServeStore`]: the served graph, features and model the engine keeps.
//!
//! Each step and lookup is a span (`serve_step`, `serve_lookup`, with `partition`) whose
//! parent is the engine's span that sent it (the trace context the message carries): a
//! request's trace reaches down to the partitions that served it.
use super::part::{
    DeltaOp, LookedUp, ModelValues, PartData, PassStep, ServeAction, ServePartMachine, StepDone,
};
use crate::faults::FaultPlan;
use crate::ActorError;
use actix::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use tokio::sync::oneshot;
use trellis_gpu::PriorityGate;
use trellis_runtime::inference::{NodeGraph, PartGraph, Rows};
use trellis_transport::{HaloBlock, PartId, RunId, TraceContext, Transport};

/// The served graph as the engine keeps it: every partition's inputs, from which a restarted
/// partition is restored (the engine's replica of the partitions' static state).
#[derive(Debug)]
pub struct Served {
    pub graph: NodeGraph,
    /// Prepared features of every node.
    pub features: Rows,
    /// Node -> partition.
    pub owner: Vec<u32>,
}

impl Served {
    /// BLAKE3 of the graph (each node's neighbours in order), the features and the
    /// ownership, with layer 0's input layout `sparse_input`: two nodes' copies with the
    /// same digest serve alike (a successor's survivors skip its inputs when theirs match).
    pub fn digest(&self, sparse_input: bool) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(&[u8::from(sparse_input)]);
        h.update(&(self.graph.num_nodes() as u64).to_le_bytes());
        for v in 0..self.graph.num_nodes() as u32 {
            let nbrs = self.graph.neighbors(v);
            h.update(&(nbrs.len() as u32).to_le_bytes());
            h.update(bytemuck::cast_slice(nbrs));
        }
        h.update(&(self.features.width as u64).to_le_bytes());
        h.update(bytemuck::cast_slice(&self.features.data));
        h.update(bytemuck::cast_slice(&self.owner));
        *h.finalize().as_bytes()
    }

    /// Applies graph changes as the engine applied them to its copy (a node hosting
    /// serving partitions keeps its own copy, for restores, up to date with this).
    pub fn apply(&mut self, ops: &[DeltaOp]) -> Result<(), ActorError> {
        for op in ops {
            match op {
                DeltaOp::AddNode {
                    id,
                    owner,
                    features,
                } => {
                    let next = self.graph.num_nodes() as u32;
                    if *id != next || features.len() != self.features.width {
                        return Err(ActorError::Protocol {
                            part: *owner,
                            detail: format!(
                                "new node {id} with {} features; the graph's next node is {next}, of {} features",
                                features.len(),
                                self.features.width
                            ),
                        });
                    }
                    self.graph.add_node();
                    self.owner.push(*owner);
                    self.features.data.extend_from_slice(features);
                }
                DeltaOp::AddEdge { a, b } => {
                    self.graph.add_edge(*a, *b)?;
                }
                DeltaOp::RemoveEdge { a, b } => {
                    self.graph.remove_edge(*a, *b)?;
                }
            }
        }
        Ok(())
    }
}

/// What a restarted partition is restored from: the served graph and the live model.
#[derive(Debug)]
pub struct ServeStore {
    pub served: RwLock<Served>,
    pub model: RwLock<Arc<ModelValues>>,
    /// Layer 0's input layout, decided by the start-up feature matrix.
    pub sparse_input: bool,
}

impl ServeStore {
    /// The digest of the served inputs ([`Served::digest`]).
    pub fn inputs_digest(&self) -> [u8; 32] {
        let s = self.served.read().unwrap_or_else(|e| e.into_inner());
        s.digest(self.sparse_input)
    }

    /// Partition `part`'s inputs as the engine has them now.
    pub fn part_data(&self, part: u32) -> Result<PartData, ActorError> {
        let s = self.served.read().unwrap_or_else(|e| e.into_inner());
        let graph = PartGraph::from_graph(&s.graph, &s.owner, part)?;
        let features = Rows {
            width: s.features.width,
            data: s.features.gather(graph.inner()),
        };
        let model = self.model.read().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(PartData {
            graph,
            features,
            model,
            sparse_input: self.sparse_input,
        })
    }
}

/// One layer of a pass.
#[derive(Debug, Message)]
#[rtype(result = "Result<StepDone, ActorError>")]
pub struct Step(pub PassStep);

/// Graph changes, applied before the next pass.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ActorError>")]
pub struct Delta(pub Arc<Vec<DeltaOp>>);

/// Abandon pass `.0` (a partition failed in it).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Abort(pub u32);

/// A halo block delivered by the transport.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ServeHalo(pub HaloBlock);

/// The last layer's rows (and layer `layer`'s) of some of the partition's nodes.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<LookedUp>, ActorError>")]
pub struct Lookup {
    pub ids: Vec<u32>,
    pub layer: Option<usize>,
    /// The engine's span that asks (the lookup's span is its child).
    pub trace: Option<TraceContext>,
}

/// Start computing a new model's tables beside the live ones.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ActorError>")]
pub struct Stage(pub Arc<ModelValues>);

/// Make the staged tables live.
#[derive(Debug, Message)]
#[rtype(result = "Result<bool, ActorError>")]
pub struct Install;

/// Drop the staged tables.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DropStaged;

type Reply = oneshot::Sender<Result<StepDone, ActorError>>;

/// A step the machine has not answered yet: where its answer goes, and its span (open
/// until the answer).
struct WaitingStep {
    reply: Reply,
    _span: tracing::Span,
}

/// The actor of one serving partition.
pub struct ServeActor {
    part: u32,
    machine: ServePartMachine,
    transport: Arc<dyn Transport>,
    store: Arc<ServeStore>,
    waiting: HashMap<u64, WaitingStep>,
    next_id: u64,
}

impl ServeActor {
    fn drain(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                ServeAction::Send(b) => {
                    if let Err(e) = self.transport.send(b) {
                        // The receiver's step then waits for a block that never comes; the
                        // engine's step deadline turns that into an error naming it.
                        tracing::error!("serving partition {}: {e}", self.part);
                    }
                }
                ServeAction::Answer { id, result } => {
                    if let Some(w) = self.waiting.remove(&id) {
                        let _ = w.reply.send(result);
                    }
                }
                ServeAction::Restart => self.restart(),
            }
        }
    }

    /// The supervisor's restart, here and now (before the next message): the partition is
    /// rebuilt from the engine's copy of its inputs.
    fn restart(&mut self) {
        tracing::warn!("serving partition {} restarts", self.part);
        let data = self.store.part_data(self.part);
        self.machine.restore(data);
    }
}

impl Actor for ServeActor {
    type Context = Context<Self>;
}

/// If the actor itself ever stops (a panic outside the machine's `catch_unwind`), actix's
/// `Supervisor` starts it again through the same restore.
impl Supervised for ServeActor {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.waiting.clear();
        self.restart();
    }
}

impl Handler<Step> for ServeActor {
    type Result = ResponseFuture<Result<StepDone, ActorError>>;

    fn handle(&mut self, Step(step): Step, _ctx: &mut Context<Self>) -> Self::Result {
        let part = self.part;
        self.next_id += 1;
        let id = self.next_id;
        let (tx, rx) = oneshot::channel();
        let span = tracing::info_span!(
            "serve_step",
            partition = i64::from(part),
            node = crate::telemetry::node_attr(),
            pass = i64::from(step.seq),
            layer = i64::from(step.layer),
            target = ?step.target,
            rows = step.compute.len() as i64,
        );
        crate::telemetry::set_parent(&span, step.trace);
        let entered = span.clone().entered();
        self.waiting.insert(
            id,
            WaitingStep {
                reply: tx,
                _span: span,
            },
        );
        self.machine.handle_step(id, step);
        self.drain();
        drop(entered);
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(ActorError::Unreachable {
                    part,
                    detail: "the actor restarted".into(),
                })
            })
        })
    }
}

impl Handler<ServeHalo> for ServeActor {
    type Result = ();
    fn handle(&mut self, ServeHalo(b): ServeHalo, _ctx: &mut Context<Self>) {
        self.machine.handle_halo(b);
        self.drain();
    }
}

impl Handler<Delta> for ServeActor {
    type Result = Result<(), ActorError>;
    fn handle(&mut self, Delta(ops): Delta, _ctx: &mut Context<Self>) -> Self::Result {
        let r = self.machine.handle_delta(&ops);
        self.drain();
        r
    }
}

impl Handler<Abort> for ServeActor {
    type Result = ();
    fn handle(&mut self, Abort(seq): Abort, _ctx: &mut Context<Self>) {
        self.machine.handle_abort(seq);
        self.drain();
    }
}

impl Handler<Lookup> for ServeActor {
    type Result = Result<Vec<LookedUp>, ActorError>;
    fn handle(&mut self, m: Lookup, _ctx: &mut Context<Self>) -> Self::Result {
        let span = tracing::info_span!(
            "serve_lookup",
            partition = i64::from(self.part),
            node = crate::telemetry::node_attr(),
            nodes = m.ids.len() as i64,
            layer = m.layer.map_or(-1, |l| l as i64),
        );
        crate::telemetry::set_parent(&span, m.trace);
        let _entered = span.entered();
        self.machine.lookup(&m.ids, m.layer)
    }
}

impl Handler<Stage> for ServeActor {
    type Result = Result<(), ActorError>;
    fn handle(&mut self, Stage(model): Stage, _ctx: &mut Context<Self>) -> Self::Result {
        let r = self.machine.stage(model);
        self.drain();
        r
    }
}

impl Handler<Install> for ServeActor {
    type Result = Result<bool, ActorError>;
    fn handle(&mut self, _: Install, _ctx: &mut Context<Self>) -> Self::Result {
        self.machine.install()
    }
}

impl Handler<DropStaged> for ServeActor {
    type Result = ();
    fn handle(&mut self, _: DropStaged, _ctx: &mut Context<Self>) {
        self.machine.drop_staged();
    }
}

/// The serving partition actors of this process.
pub struct ServeNode {
    arbiters: Vec<Arbiter>,
    addrs: Vec<Addr<ServeActor>>,
    /// The partition of each actor.
    parts: Vec<u32>,
    transport: Arc<dyn Transport>,
}

impl ServeNode {
    /// Starts one supervised actor per partition `0..parts` (each from the store's copy of
    /// its inputs), each on a new arbiter, with its halo blocks routed to it. Must run inside
    /// an actix system.
    pub fn start(
        parts: usize,
        run: RunId,
        transport: Arc<dyn Transport>,
        store: Arc<ServeStore>,
        faults: Arc<FaultPlan>,
        threads: usize,
        priority: Option<PriorityGate>,
    ) -> Result<Self, ActorError> {
        let ids: Vec<u32> = (0..parts as u32).collect();
        Self::start_parts(&ids, run, transport, store, faults, threads, priority)
    }

    /// Starts one supervised actor for each partition of `parts` (the others run
    /// elsewhere, reached through the transport), as [`ServeNode::start`] does.
    pub fn start_parts(
        parts: &[u32],
        run: RunId,
        transport: Arc<dyn Transport>,
        store: Arc<ServeStore>,
        faults: Arc<FaultPlan>,
        threads: usize,
        priority: Option<PriorityGate>,
    ) -> Result<Self, ActorError> {
        let mut node = ServeNode {
            arbiters: Vec::new(),
            addrs: Vec::new(),
            parts: Vec::new(),
            transport,
        };
        for &p in parts {
            node.add_part(
                p,
                run,
                store.clone(),
                faults.clone(),
                threads,
                priority.clone(),
            )?;
        }
        Ok(node)
    }

    /// Starts partition `p` here (at start-up, or re-placed from a lost node): restored
    /// from the store, with no tables until a pass computes them; returns its actor.
    pub fn add_part(
        &mut self,
        p: u32,
        run: RunId,
        store: Arc<ServeStore>,
        faults: Arc<FaultPlan>,
        threads: usize,
        priority: Option<PriorityGate>,
    ) -> Result<Addr<ServeActor>, ActorError> {
        let transport = self.transport.clone();
        {
            let machine = ServePartMachine::new(store.part_data(p)?, run, faults.clone(), threads)?
                .with_priority(priority.clone());
            let arb = Arbiter::new();
            let (t, s) = (transport.clone(), store.clone());
            let addr = Supervisor::start_in_arbiter(&arb.handle(), move |_| ServeActor {
                part: p,
                machine,
                transport: t,
                store: s,
                waiting: HashMap::new(),
                next_id: 0,
            });
            let deliver = addr.clone();
            transport.register(
                PartId(p),
                Arc::new(move |b| {
                    let ok = deliver.connected();
                    deliver.do_send(ServeHalo(b));
                    ok
                }),
            );
            self.arbiters.push(arb);
            self.addrs.push(addr.clone());
            self.parts.push(p);
            Ok(addr)
        }
    }

    /// Stops partition `p`'s actor here (it moved to another node): its halo route is
    /// removed first, and its arbiter stops once the actor is done with what it runs.
    pub fn remove_part(&mut self, p: u32) {
        let Some(i) = self.parts.iter().position(|&q| q == p) else {
            return;
        };
        self.transport.unregister(PartId(p));
        self.parts.remove(i);
        drop(self.addrs.remove(i));
        self.arbiters.remove(i).stop();
    }

    /// The actors, in the order their partitions were started.
    pub fn addrs(&self) -> &[Addr<ServeActor>] {
        &self.addrs
    }

    /// The partitions of [`ServeNode::addrs`].
    pub fn parts(&self) -> &[u32] {
        &self.parts
    }

    /// Stops every actor without waiting for them: an actor stuck in a computation (the
    /// reason a node is abandoned) finishes it on its own thread, whose results go nowhere
    /// (its halo routes are removed first, and the engine no longer holds its address).
    pub fn abandon(self) {
        for &p in &self.parts {
            self.transport.unregister(PartId(p));
        }
        drop(self.addrs);
        for arb in self.arbiters {
            arb.stop();
        }
    }

    /// Stops every actor and joins every arbiter thread.
    pub fn shutdown(self) {
        for &p in &self.parts {
            self.transport.unregister(PartId(p));
        }
        drop(self.addrs);
        for arb in self.arbiters {
            arb.stop();
            let _ = arb.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Served {
        let mut graph = NodeGraph::default();
        for _ in 0..3 {
            graph.add_node();
        }
        graph.add_edge(0, 1).unwrap();
        Served {
            graph,
            features: Rows {
                width: 2,
                data: vec![0.0; 6],
            },
            owner: vec![0, 0, 1],
        }
    }

    /// A new node 3 (of partition 1) and its edge to node 0.
    fn new_node() -> Vec<DeltaOp> {
        vec![
            DeltaOp::AddNode {
                id: 3,
                owner: 1,
                features: vec![1.0, 2.0],
            },
            DeltaOp::AddEdge { a: 3, b: 0 },
        ]
    }

    #[test]
    fn copies_that_took_the_same_changes_have_the_same_digest_and_others_do_not() {
        let (mut a, mut b) = (served(), served());
        assert_eq!(a.digest(false), b.digest(false));
        assert_ne!(a.digest(false), a.digest(true), "the input layout counts");
        let ops = new_node();
        a.apply(&ops).unwrap();
        assert_ne!(a.digest(false), b.digest(false), "a copy behind differs");
        b.apply(&ops).unwrap();
        assert_eq!(a.digest(false), b.digest(false));
        b.apply(&[DeltaOp::RemoveEdge { a: 0, b: 1 }]).unwrap();
        assert_ne!(a.digest(false), b.digest(false), "an edge differs");
        let (mut c, mut d) = (served(), served());
        c.features.data[0] = 0.5;
        assert_ne!(served().digest(false), c.digest(false), "a feature differs");
        d.owner[0] = 1;
        assert_ne!(served().digest(false), d.digest(false), "an owner differs");
    }

    #[test]
    fn a_copy_of_the_served_graph_follows_the_engines_changes() {
        let mut s = served();
        let mut ops = new_node();
        ops.push(DeltaOp::RemoveEdge { a: 1, b: 0 });
        s.apply(&ops).unwrap();
        assert_eq!(s.graph.num_nodes(), 4);
        assert_eq!(s.owner, vec![0, 0, 1, 1]);
        assert_eq!(s.features.row(3), &[1.0, 2.0]);
        assert_eq!(s.graph.neighbors(0), &[3]);
        assert!(s.graph.neighbors(1).is_empty());
    }

    #[test]
    fn changes_that_do_not_fit_the_copy_are_errors() {
        let mut s = served();
        // Not the next id: this copy missed a change.
        let skipped = [DeltaOp::AddNode {
            id: 5,
            owner: 0,
            features: vec![0.0, 0.0],
        }];
        let e = s.apply(&skipped).unwrap_err().to_string();
        assert!(e.contains("next node is 3"), "{e}");
        let wrong_width = [DeltaOp::AddNode {
            id: 3,
            owner: 0,
            features: vec![0.0],
        }];
        assert!(s.apply(&wrong_width).is_err());
        assert!(s.apply(&[DeltaOp::AddEdge { a: 0, b: 9 }]).is_err());
        assert_eq!(s.graph.num_nodes(), 3);
    }
}
