//! The serving control protocol: what the engine node and the nodes hosting serving
//! partitions say to each other, as rkyv archives inside the cluster's
//! [`ControlMsg::Serve`] envelope. The envelope carries a protocol version, checked before
//! the body is decoded; a body that does not decode (validated with bytecheck) or a version
//! this build does not speak is a [`ServeWireError`] naming the peer, never a panic. Free of
//! I/O: encode, decode and the conversions from and to the serving machine's types are all
//! here and unit-tested without sockets.
use crate::cluster::proto::ControlMsg;
use crate::faults::{FaultPlan, ServeFaultAction};
use crate::serving::part::{
    ComputedRows, DeltaOp, LookedUp, ModelValues, PassStep, StepDone, Target,
};
use crate::serving::shell::Served;
use rkyv::{Archive, Deserialize, Serialize};
use std::sync::Arc;
use trellis_gpu::Tensor;
use trellis_runtime::inference::{NodeGraph, Rows};
use trellis_runtime::ModelConfig;
use trellis_transport::TraceContext;

/// The version of the serving messages this build speaks (6: a returned node's
/// incarnation in [`PeerAddr`]).
pub const SERVE_PROTOCOL: u16 = 6;

/// Bytes of the served inputs per [`ServeMsg::Inputs`] chunk: the inputs of a large graph
/// exceed the 1 GiB a control message may have, and chunks are sent as they are cut, with
/// no second whole copy of the inputs in a message.
pub const INPUT_CHUNK: usize = 8 << 20;

/// The envelope of a serving message.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq)]
pub struct ServeEnvelope {
    pub version: u16,
    /// A [`ServeMsg`] archive.
    pub body: Vec<u8>,
}

/// The version and the body's size, not its bytes (a log line, not a dump).
impl std::fmt::Debug for ServeEnvelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ServeEnvelope {{ version: {}, body: {} bytes }}",
            self.version,
            self.body.len()
        )
    }
}

/// One serving message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum ServeMsg {
    /// Node -> engine node, first message: this node serves, and listens on `addr`. After a
    /// take-over: `inputs`, the digest of the served inputs this node holds
    /// ([`Served::digest`](crate::serving::shell::Served::digest)).
    Join {
        addr: String,
        inputs: Option<[u8; 32]>,
    },
    /// Engine node -> node: host these serving partitions; the inputs follow.
    Setup(ServeSetup),
    /// Engine node -> node: bytes `offset..offset+data.len()` of the served inputs
    /// ([`ServedWire`] archive of `total` bytes).
    Inputs {
        offset: u64,
        total: u64,
        data: Vec<u8>,
    },
    /// Node -> engine node: the partitions are restored from the inputs and running.
    Ready { parts: Vec<u32> },
    /// Node -> engine node: the setup failed (the node exits).
    SetupFailed { error: String },
    /// Engine node -> node: a request for one hosted partition.
    Request {
        id: u64,
        part: u32,
        req: ServeRequest,
    },
    /// Node -> engine node: the answer to request `id`.
    Reply { id: u64, body: ServeReply },
    /// Engine node -> node: abandon pass `seq` on partition `part` (no answer).
    Abort { part: u32, seq: u32 },
    /// Engine node -> node: drop partition `part`'s staged tables (no answer).
    DropStaged { part: u32 },
    /// Engine node -> node: partitions moved (a node was lost, or one came back): route
    /// halo blocks by `placement`, refuse everything from the `fenced` nodes (every node
    /// lost so far and not back) and admit the others again, reaching each node of
    /// `returned` (restarted since) at its new address.
    Reroute {
        placement: Vec<u32>,
        fenced: Vec<u32>,
        returned: Vec<PeerAddr>,
    },
    /// Engine node -> node: stop hosting partition `part` (it moved back to the node that
    /// came back; no answer).
    DropPart { part: u32 },
    /// Node -> engine node: it answers HTTP too, at `addr` (for the logs).
    Http { addr: String },
    /// Node -> engine node: an HTTP request this node received, for the engine node's
    /// HTTP front end to answer.
    HttpRequest { id: u64, req: HttpRequestWire },
    /// Engine node -> node: the answer to HTTP request `id`.
    HttpReply { id: u64, answer: HttpAnswerWire },
    /// Engine node -> node: the service stops; stop the actors and exit.
    Finish,
}

/// An HTTP request as a node forwards it: everything the front end reads of one.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct HttpRequestWire {
    pub method: String,
    /// Path and query.
    pub path: String,
    /// The caller's API key header (its fair share and quota).
    pub api_key: Option<String>,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// The engine node's HTTP answer, as the forwarding node gives it to its caller.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct HttpAnswerWire {
    pub status: u16,
    pub retry_after: Option<String>,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// What a node needs to host its serving partitions (besides the inputs).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ServeSetup {
    pub run: [u8; 16],
    /// `placement[p]`: the node hosting partition `p`.
    pub placement: Vec<u32>,
    /// The placement the service started with: a lost node that comes back gets its
    /// partitions of it back (kept by every node for a successor).
    pub home: Vec<u32>,
    /// Every node's address.
    pub peers: Vec<PeerAddr>,
    /// The live model.
    pub model: WireModel,
    /// Layer 0's input layout, decided by the start-up feature matrix.
    pub sparse_input: bool,
    /// The serving faults planned (`--chaos` on the engine node) for partitions of other
    /// nodes, not yet fired: the partitions of the node they are placed on fire them.
    pub faults: Vec<WireServeFault>,
    /// The served inputs follow (`Inputs`); else the node's own copy, whose digest its
    /// `Join` gave, equals the engine node's and is used.
    pub inputs_follow: bool,
}

/// A planned serving fault: partition `part` fails as `action` says when it starts layer
/// `layer` of graph update `update`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireServeFault {
    pub part: u32,
    pub update: u64,
    pub layer: u16,
    pub action: WireServeFaultAction,
}

/// What a [`WireServeFault`] does (`ServeFaultAction`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub enum WireServeFaultAction {
    Panic,
    Stall { ms: u64 },
}

impl WireServeFault {
    /// The faults of `plan` not fired yet for partitions not placed on node `engine`.
    pub fn shipped(plan: &FaultPlan, placement: &[u32], engine: u32) -> Vec<WireServeFault> {
        plan.serve_faults()
            .into_iter()
            .filter(|f| !f.fired && placement.get(f.part as usize).is_some_and(|&n| n != engine))
            .map(|f| WireServeFault {
                part: f.part,
                update: f.update,
                layer: f.layer,
                action: match f.action {
                    ServeFaultAction::Panic => WireServeFaultAction::Panic,
                    ServeFaultAction::Stall(d) => WireServeFaultAction::Stall {
                        ms: u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
                    },
                },
            })
            .collect()
    }

    /// The plan of a node's partitions made of `faults`.
    pub fn plan(faults: &[WireServeFault]) -> FaultPlan {
        faults.iter().fold(FaultPlan::none(), |plan, f| {
            let action = match f.action {
                WireServeFaultAction::Panic => ServeFaultAction::Panic,
                WireServeFaultAction::Stall { ms } => {
                    ServeFaultAction::Stall(std::time::Duration::from_millis(ms))
                }
            };
            plan.serve_fault_at(f.part, f.update, f.layer, action)
        })
    }
}

/// Node `node` listens on `addr`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PeerAddr {
    pub node: u32,
    pub addr: String,
    /// In `Reroute{returned}`: the process incarnation of the node taken back, as the engine
    /// node's transport sees it (the others drop a connection to an older process of it).
    pub incarnation: Option<u64>,
}

/// The served graph (adjacency as CSR), its prepared features and the ownership table.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ServedWire {
    pub offsets: Vec<u64>,
    pub targets: Vec<u32>,
    pub width: u32,
    pub features: Vec<f32>,
    pub owner: Vec<u32>,
}

/// A model's parameters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireModel {
    /// The `ModelConfig`, as JSON.
    pub config_json: String,
    pub normalize: bool,
    pub tensors: Vec<WireTensor>,
}

/// One parameter tensor, row-major.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireTensor {
    pub rows: u32,
    pub cols: u32,
    pub data: Vec<f32>,
}

/// Rows exchanged with partition `part`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireRows {
    pub part: u32,
    pub ids: Vec<u32>,
}

/// A trace context on the wire: its `traceparent`, empty for none.
pub fn wire_trace(trace: Option<TraceContext>) -> String {
    trace.map(|t| t.to_string()).unwrap_or_default()
}

/// [`PassStep`] on the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireStep {
    /// The engine pass's W3C traceparent (empty: none).
    pub trace: String,
    pub seq: u32,
    pub layer: u16,
    /// Target: the staged tables (else the live ones).
    pub staged: bool,
    pub update: Option<u64>,
    pub transform: Vec<u32>,
    pub compute: Vec<u32>,
    pub send: Vec<WireRows>,
    pub recv: Vec<WireRows>,
    pub increment: Vec<u32>,
    pub increment_send: Vec<WireRows>,
    pub increment_recv: Vec<WireRows>,
    pub return_rows: bool,
    pub return_transformed: bool,
    pub full: bool,
}

/// [`DeltaOp`] on the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum WireDelta {
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

/// A request for one partition.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum ServeRequest {
    Step(WireStep),
    /// Graph changes; `generation` numbers the engine's broadcasts (the node applies each
    /// to its copy of the served graph once, whichever partition it reaches first).
    Delta {
        generation: u64,
        ops: Vec<WireDelta>,
    },
    /// `trace`: the asking span's W3C traceparent (empty: none).
    Lookup {
        ids: Vec<u32>,
        layer: Option<u32>,
        trace: String,
    },
    Stage(WireModel),
    Install,
    /// Start partition `part` (of the request) on this node, restored from its copy of the
    /// served inputs with empty tables: the engine re-places a lost node's partition here.
    Host,
}

/// Rows a step computed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireComputed {
    pub ids: Vec<u32>,
    pub width: u32,
    pub data: Vec<f32>,
}

/// A node's rows as a lookup returns them.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WireLookedUp {
    pub logits: Vec<f32>,
    pub embedding: Option<Vec<f32>>,
}

/// The answer to a [`ServeRequest`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum ServeReply {
    Stepped {
        rows: Option<WireComputed>,
        compute_ms: f64,
        halo_bytes: u64,
    },
    Applied,
    Found(Vec<WireLookedUp>),
    Staged,
    Installed(bool),
    /// The partition of a [`ServeRequest::Host`] runs on this node.
    Hosting,
    /// The partition panicked (its node restored it from its copy of the inputs).
    Panicked {
        message: String,
    },
    Failed {
        message: String,
    },
}

/// Why a serving message from a peer cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeWireError {
    #[error(
        "node {node} speaks serving protocol version {got}, this node speaks {SERVE_PROTOCOL}"
    )]
    Version { node: u32, got: u16 },
    #[error("node {node} sent a serving message that does not decode: {detail}")]
    Decode { node: u32, detail: String },
    #[error("node {node} sent bad serving data: {detail}")]
    Invalid { node: u32, detail: String },
}

fn to_bytes<T>(value: &T) -> Vec<u8>
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rkyv::rancor::Error,
        >,
    >,
{
    rkyv::to_bytes::<rkyv::rancor::Error>(value)
        .map(|b| b.into_vec())
        .expect("serialising plain data into a growable buffer cannot fail")
}

impl ServeMsg {
    /// The message's name, for log lines (its fields can be megabytes).
    pub fn kind(&self) -> &'static str {
        match self {
            ServeMsg::Join { .. } => "Join",
            ServeMsg::Setup(_) => "Setup",
            ServeMsg::Inputs { .. } => "Inputs",
            ServeMsg::Ready { .. } => "Ready",
            ServeMsg::SetupFailed { .. } => "SetupFailed",
            ServeMsg::Request { .. } => "Request",
            ServeMsg::Reply { .. } => "Reply",
            ServeMsg::Abort { .. } => "Abort",
            ServeMsg::DropStaged { .. } => "DropStaged",
            ServeMsg::Reroute { .. } => "Reroute",
            ServeMsg::DropPart { .. } => "DropPart",
            ServeMsg::Http { .. } => "Http",
            ServeMsg::HttpRequest { .. } => "HttpRequest",
            ServeMsg::HttpReply { .. } => "HttpReply",
            ServeMsg::Finish => "Finish",
        }
    }

    /// The control message carrying this one.
    pub fn control(&self) -> ControlMsg {
        ControlMsg::Serve(ServeEnvelope {
            version: SERVE_PROTOCOL,
            body: to_bytes(self),
        })
    }

    /// Opens an envelope received from `node`.
    pub fn open(env: &ServeEnvelope, node: u32) -> Result<Self, ServeWireError> {
        if env.version != SERVE_PROTOCOL {
            return Err(ServeWireError::Version {
                node,
                got: env.version,
            });
        }
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(env.body.len());
        aligned.extend_from_slice(&env.body);
        rkyv::from_bytes::<ServeMsg, rkyv::rancor::Error>(&aligned).map_err(|e| {
            ServeWireError::Decode {
                node,
                detail: e.to_string(),
            }
        })
    }
}

impl ServedWire {
    /// The engine's served inputs.
    pub fn of(s: &Served) -> Self {
        let n = s.graph.num_nodes();
        let mut offsets = Vec::with_capacity(n + 1);
        let mut targets = Vec::with_capacity(2 * s.graph.num_edges());
        offsets.push(0);
        for v in 0..n as u32 {
            targets.extend_from_slice(s.graph.neighbors(v));
            offsets.push(targets.len() as u64);
        }
        ServedWire {
            offsets,
            targets,
            width: s.features.width as u32,
            features: s.features.data.clone(),
            owner: s.owner.clone(),
        }
    }

    /// The archive, to be cut into [`ServeMsg::Inputs`] chunks.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(self)
    }

    /// Validates and decodes the inputs received from `node`, and checks they are a graph
    /// of `parts` partitions.
    pub fn decode(bytes: &[u8], node: u32, parts: usize) -> Result<Served, ServeWireError> {
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        let w = rkyv::from_bytes::<ServedWire, rkyv::rancor::Error>(&aligned).map_err(|e| {
            ServeWireError::Decode {
                node,
                detail: format!("served inputs: {e}"),
            }
        })?;
        let bad = |detail: String| ServeWireError::Invalid { node, detail };
        let n = w.owner.len();
        if w.offsets.len() != n + 1 {
            return Err(bad(format!(
                "{} adjacency offsets for {n} nodes",
                w.offsets.len()
            )));
        }
        if w.width == 0 || w.features.len() != n * w.width as usize {
            return Err(bad(format!(
                "{} feature values for {n} nodes of width {}",
                w.features.len(),
                w.width
            )));
        }
        if let Some(&o) = w.owner.iter().find(|&&o| o as usize >= parts) {
            return Err(bad(format!("a node is owned by partition {o} of {parts}")));
        }
        let mut nbrs = Vec::with_capacity(n);
        for v in 0..n {
            let (a, b) = (w.offsets[v] as usize, w.offsets[v + 1] as usize);
            if a > b || b > w.targets.len() {
                return Err(bad(format!("adjacency offsets of node {v} out of range")));
            }
            nbrs.push(w.targets[a..b].to_vec());
        }
        let graph = NodeGraph::from_neighbors(nbrs).map_err(|e| bad(e.to_string()))?;
        Ok(Served {
            graph,
            features: Rows {
                width: w.width as usize,
                data: w.features,
            },
            owner: w.owner,
        })
    }
}

impl WireModel {
    pub fn of(m: &ModelValues) -> Result<Self, trellis_gpu::GpuError> {
        let tensors = m
            .values
            .iter()
            .map(|t| {
                let (rows, cols) = t.shape();
                Ok(WireTensor {
                    rows: rows as u32,
                    cols: cols as u32,
                    data: t.host("ship a model")?.to_vec(),
                })
            })
            .collect::<Result<_, trellis_gpu::GpuError>>()?;
        Ok(WireModel {
            config_json: serde_json::to_string(&m.config).expect("a model config serialises"),
            normalize: m.normalize,
            tensors,
        })
    }

    /// The model received from `node` (its tensors checked against its configuration
    /// when it is built).
    pub fn values(&self, node: u32) -> Result<ModelValues, ServeWireError> {
        let bad = |detail: String| ServeWireError::Invalid { node, detail };
        let config: ModelConfig = serde_json::from_str(&self.config_json)
            .map_err(|e| bad(format!("model configuration: {e}")))?;
        let values = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                Tensor::from_vec(t.rows as usize, t.cols as usize, t.data.clone())
                    .map_err(|e| bad(format!("model tensor {i}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The partition builds its copy with `Model::with_values`, which checks every
        // shape against the configuration; check here so a bad model fails the request.
        trellis_runtime::model::Model::with_values(config.clone(), values.clone())
            .map_err(|e| bad(format!("model: {e}")))?;
        Ok(ModelValues {
            config,
            values,
            normalize: self.normalize,
        })
    }
}

impl From<&PassStep> for WireStep {
    fn from(s: &PassStep) -> Self {
        let rows = |v: &[(u32, crate::serving::plan::Ids)]| {
            v.iter()
                .map(|(part, ids)| WireRows {
                    part: *part,
                    ids: ids.to_vec(),
                })
                .collect()
        };
        WireStep {
            trace: wire_trace(s.trace),
            seq: s.seq,
            layer: s.layer,
            staged: s.target == Target::Staged,
            update: s.update,
            transform: s.transform.to_vec(),
            compute: s.compute.to_vec(),
            send: rows(&s.send),
            recv: rows(&s.recv),
            increment: s.increment.to_vec(),
            increment_send: rows(&s.increment_send),
            increment_recv: rows(&s.increment_recv),
            return_rows: s.return_rows,
            return_transformed: s.return_transformed,
            full: s.full,
        }
    }
}

impl From<WireStep> for PassStep {
    fn from(s: WireStep) -> Self {
        let rows = |v: Vec<WireRows>| {
            v.into_iter()
                .map(|r| (r.part, Arc::new(r.ids)))
                .collect::<Vec<_>>()
        };
        PassStep {
            trace: TraceContext::from_traceparent(&s.trace),
            seq: s.seq,
            layer: s.layer,
            target: if s.staged {
                Target::Staged
            } else {
                Target::Live
            },
            update: s.update,
            transform: Arc::new(s.transform),
            compute: Arc::new(s.compute),
            send: rows(s.send),
            recv: rows(s.recv),
            increment: Arc::new(s.increment),
            increment_send: rows(s.increment_send),
            increment_recv: rows(s.increment_recv),
            return_rows: s.return_rows,
            return_transformed: s.return_transformed,
            full: s.full,
        }
    }
}

impl From<&DeltaOp> for WireDelta {
    fn from(d: &DeltaOp) -> Self {
        match d {
            DeltaOp::AddNode {
                id,
                owner,
                features,
            } => WireDelta::AddNode {
                id: *id,
                owner: *owner,
                features: features.clone(),
            },
            DeltaOp::AddEdge { a, b } => WireDelta::AddEdge { a: *a, b: *b },
            DeltaOp::RemoveEdge { a, b } => WireDelta::RemoveEdge { a: *a, b: *b },
        }
    }
}

impl From<WireDelta> for DeltaOp {
    fn from(d: WireDelta) -> Self {
        match d {
            WireDelta::AddNode {
                id,
                owner,
                features,
            } => DeltaOp::AddNode {
                id,
                owner,
                features,
            },
            WireDelta::AddEdge { a, b } => DeltaOp::AddEdge { a, b },
            WireDelta::RemoveEdge { a, b } => DeltaOp::RemoveEdge { a, b },
        }
    }
}

impl ServeReply {
    /// The reply carrying a step's result.
    pub fn of_step(r: Result<StepDone, crate::ActorError>) -> Self {
        match r {
            Ok(d) => ServeReply::Stepped {
                rows: d.rows.map(|r| WireComputed {
                    ids: r.ids.to_vec(),
                    width: r.width as u32,
                    data: r.data,
                }),
                compute_ms: d.compute_ms,
                halo_bytes: d.halo_bytes,
            },
            Err(e) => Self::of_error(e),
        }
    }

    /// The reply reporting `e`.
    pub fn of_error(e: crate::ActorError) -> Self {
        match e {
            crate::ActorError::Panicked { message, .. } => ServeReply::Panicked { message },
            other => ServeReply::Failed {
                message: other.to_string(),
            },
        }
    }

    /// The error this reply reports for partition `part` on `node`, if it reports one.
    pub fn error(&self, node: u32, part: u32) -> Option<crate::ActorError> {
        match self {
            ServeReply::Panicked { message } => Some(crate::ActorError::Panicked {
                part,
                message: message.clone(),
            }),
            ServeReply::Failed { message } => Some(crate::ActorError::Remote {
                node,
                part,
                message: message.clone(),
            }),
            _ => None,
        }
    }

    /// The step this reply answers, for partition `part` on `node`.
    pub fn into_step(self, node: u32, part: u32) -> Result<StepDone, crate::ActorError> {
        match self {
            ServeReply::Stepped {
                rows,
                compute_ms,
                halo_bytes,
            } => Ok(StepDone {
                part,
                rows: rows.map(|r| ComputedRows {
                    ids: Arc::new(r.ids),
                    width: r.width as usize,
                    data: r.data,
                }),
                compute_ms,
                halo_bytes,
            }),
            other => Err(other.unexpected(node, part, "a step")),
        }
    }

    /// The lookup this reply answers.
    pub fn into_found(self, node: u32, part: u32) -> Result<Vec<LookedUp>, crate::ActorError> {
        match self {
            ServeReply::Found(rows) => Ok(rows
                .into_iter()
                .map(|r| LookedUp {
                    logits: r.logits,
                    embedding: r.embedding,
                })
                .collect()),
            other => Err(other.unexpected(node, part, "a lookup")),
        }
    }

    /// This reply's error, or a protocol violation when it answers something else.
    pub fn unexpected(self, node: u32, part: u32, what: &str) -> crate::ActorError {
        self.error(node, part)
            .unwrap_or_else(|| crate::ActorError::Protocol {
                part,
                detail: format!("node {node} answered {what} with {self:?}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> PassStep {
        PassStep {
            trace: TraceContext::from_traceparent(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            seq: 4,
            layer: 1,
            target: Target::Staged,
            update: Some(3),
            transform: Arc::new(vec![1, 2]),
            compute: Arc::new(vec![2, 5, 9]),
            send: vec![(1, Arc::new(vec![2]))],
            recv: vec![(2, Arc::new(vec![7, 8]))],
            increment: Arc::new(vec![3, 4]),
            increment_send: vec![(0, Arc::new(vec![1]))],
            increment_recv: vec![(2, Arc::new(vec![6]))],
            return_rows: true,
            return_transformed: false,
            full: false,
        }
    }

    #[test]
    fn every_serving_message_round_trips_through_the_envelope() {
        let msgs = vec![
            ServeMsg::Join {
                addr: "127.0.0.1:9".into(),
                inputs: None,
            },
            ServeMsg::Join {
                addr: "127.0.0.1:9".into(),
                inputs: Some([7; 32]),
            },
            ServeMsg::Request {
                id: 7,
                part: 1,
                req: ServeRequest::Step(WireStep::from(&step())),
            },
            ServeMsg::Request {
                id: 8,
                part: 0,
                req: ServeRequest::Delta {
                    generation: 2,
                    ops: vec![
                        WireDelta::AddNode {
                            id: 10,
                            owner: 1,
                            features: vec![0.5, 1.0],
                        },
                        WireDelta::RemoveEdge { a: 1, b: 3 },
                    ],
                },
            },
            ServeMsg::Reply {
                id: 7,
                body: ServeReply::Found(vec![WireLookedUp {
                    logits: vec![0.25, -1.0],
                    embedding: Some(vec![3.0]),
                }]),
            },
            ServeMsg::Inputs {
                offset: 3,
                total: 9,
                data: vec![1, 2, 3],
            },
            ServeMsg::Reroute {
                placement: vec![0, 0, 2],
                fenced: vec![1],
                returned: vec![PeerAddr {
                    node: 3,
                    addr: "127.0.0.1:4000".into(),
                    incarnation: Some(0x5eed),
                }],
            },
            ServeMsg::DropPart { part: 2 },
            ServeMsg::Request {
                id: 9,
                part: 2,
                req: ServeRequest::Host,
            },
            ServeMsg::Reply {
                id: 9,
                body: ServeReply::Hosting,
            },
            ServeMsg::HttpRequest {
                id: 3,
                req: HttpRequestWire {
                    method: "POST".into(),
                    path: "/v1/predict".into(),
                    api_key: Some("tenant-a".into()),
                    content_type: Some("application/json".into()),
                    body: b"{\"nodes\":[1]}".to_vec(),
                },
            },
            ServeMsg::HttpReply {
                id: 3,
                answer: HttpAnswerWire {
                    status: 503,
                    retry_after: Some("1".into()),
                    content_type: None,
                    body: Vec::new(),
                },
            },
            ServeMsg::Finish,
        ];
        for m in msgs {
            let ControlMsg::Serve(env) = ControlMsg::decode(&m.control().encode()).unwrap() else {
                panic!("not a serving envelope");
            };
            assert_eq!(ServeMsg::open(&env, 1).unwrap(), m);
        }
    }

    /// The faults planned on the engine node for other nodes' partitions travel in the
    /// setup and come out as the same plan there; fired ones and the engine node's own stay.
    #[test]
    fn serving_faults_for_other_nodes_travel_in_the_setup() {
        let plan = FaultPlan::parse(
            "serve-panic:part=0:update=1,serve-panic:part=2:update=3:layer=1,serve-stall:part=1:update=2:ms=250",
        )
        .unwrap();
        let placement = [0, 1, 2];
        let shipped = WireServeFault::shipped(&plan, &placement, 0);
        assert_eq!(shipped.len(), 2, "{shipped:?}");
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&shipped).unwrap();
        let back: Vec<WireServeFault> = rkyv::from_bytes::<_, rkyv::rancor::Error>(&bytes).unwrap();
        assert_eq!(back, shipped);
        let there = WireServeFault::plan(&shipped).serve_faults();
        let wanted: Vec<_> = plan
            .serve_faults()
            .into_iter()
            .filter(|f| f.part != 0)
            .collect();
        assert_eq!(format!("{there:?}"), format!("{wanted:?}"));
        assert!(there
            .iter()
            .any(|f| f.part == 2 && f.update == 3 && f.layer == 1));
        assert!(there
            .iter()
            .any(|f| f.action == ServeFaultAction::Stall(std::time::Duration::from_millis(250))));
    }

    #[test]
    fn a_pass_step_survives_the_wire() {
        let s = step();
        let back = PassStep::from(WireStep::from(&s));
        assert_eq!(format!("{back:?}"), format!("{s:?}"));
    }

    #[test]
    fn other_versions_and_garbage_are_errors_naming_the_peer() {
        let ControlMsg::Serve(mut env) = ServeMsg::Finish.control() else {
            panic!("not a serving envelope");
        };
        env.version = SERVE_PROTOCOL + 1;
        let e = ServeMsg::open(&env, 3).unwrap_err().to_string();
        assert!(e.contains("node 3") && e.contains("version"), "{e}");
        let good = ServeMsg::Request {
            id: 1,
            part: 2,
            req: ServeRequest::Lookup {
                ids: vec![1, 2, 3],
                layer: None,
                trace: String::new(),
            },
        };
        let ControlMsg::Serve(env) = good.control() else {
            panic!("not a serving envelope");
        };
        for cut in 0..env.body.len() {
            let cut = ServeEnvelope {
                version: SERVE_PROTOCOL,
                body: env.body[..cut].to_vec(),
            };
            if let Err(e) = ServeMsg::open(&cut, 5) {
                assert!(e.to_string().contains("node 5"), "{e}");
            }
        }
        let half = ServeEnvelope {
            version: SERVE_PROTOCOL,
            body: env.body[..env.body.len() / 2].to_vec(),
        };
        assert!(ServeMsg::open(&half, 5).is_err());
    }

    #[test]
    fn served_inputs_round_trip_and_bad_ones_are_refused() {
        let mut graph = NodeGraph::default();
        for _ in 0..4 {
            graph.add_node();
        }
        graph.add_edge(0, 1).unwrap();
        graph.add_edge(1, 2).unwrap();
        graph.add_edge(3, 0).unwrap();
        let served = Served {
            graph,
            features: Rows {
                width: 2,
                data: (0..8).map(|i| i as f32).collect(),
            },
            owner: vec![0, 0, 1, 1],
        };
        let wire = ServedWire::of(&served);
        let back = ServedWire::decode(&wire.encode(), 0, 2).unwrap();
        assert_eq!(ServedWire::of(&back), wire);
        // A partition the cluster does not have.
        let e = ServedWire::decode(&wire.encode(), 0, 1).unwrap_err();
        assert!(e.to_string().contains("partition 1 of 1"), "{e}");
        // An edge one way only.
        let mut one_way = wire.clone();
        one_way.targets[0] = 2;
        let e = ServedWire::decode(&one_way.encode(), 4, 2).unwrap_err();
        assert!(e.to_string().contains("node 4"), "{e}");
        // Features of the wrong length.
        let mut short = wire;
        short.features.pop();
        assert!(ServedWire::decode(&short.encode(), 0, 2).is_err());
    }
}
