//! The cluster's control protocol: the messages between the coordinator node and the other
//! nodes, as rkyv archives carried in the transport's `Control` frames. Free of I/O: encode,
//! decode (validated with bytecheck before use) and the conversions from and to the actor
//! messages are all here and unit-tested without sockets.
use crate::protocol::messages::{Outcome, StepReply};
use crate::ActorError;
use rkyv::{Archive, Deserialize, Serialize};
use std::sync::Arc;
use trellis_transport::Phase;

/// One control message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum ControlMsg {
    /// Node -> coordinator, first message: this node is up and listens on `addr`.
    Join { addr: String },
    /// Coordinator -> node: host these partitions of this run.
    Setup(Setup),
    /// Node -> coordinator: the partitions of the setup are loaded and their actors started.
    Ready { parts: Vec<u32> },
    /// Node -> coordinator: the setup failed (the node exits).
    SetupFailed { error: String },
    /// Node -> coordinator: send me partition file `part` (I lack it or mine does not match).
    FetchPart { part: u32 },
    /// Coordinator -> node: bytes `offset..offset+data.len()` of partition file `part`.
    PartChunk {
        part: u32,
        offset: u64,
        total: u64,
        data: Vec<u8>,
    },
    /// Coordinator -> node: a request for one hosted partition.
    Request { id: u64, part: u32, req: Request },
    /// Node -> coordinator: the answer to request `id`.
    Reply { id: u64, body: ReplyBody },
    /// Coordinator -> node: the run ended; stop the actors, answer `Bye` and exit.
    Finish,
    /// Node -> coordinator: last words, with this node's traffic and the metrics it recorded
    /// during the run (`MetricsSnapshot::to_bytes`), which join the run report's.
    Bye {
        bytes_sent: u64,
        bytes_received: u64,
        metrics: Vec<u8>,
    },
    /// Coordinator -> node: the run failed; stop and exit with this reason.
    Abort { reason: String },
    /// Node -> replica node: a partition's committed state after a step.
    Replica(ReplicaWire),
    /// Node -> replica node: a partition's committed state after a step, as a patch against
    /// a step the replica node acknowledged ([`crate::replica::delta`]).
    ReplicaDelta(crate::replica::DeltaPiece),
    /// Replica node -> the node that shipped it: partition `part`'s state after step `epoch`
    /// is stored (the shipper times the transfer).
    ReplicaAck { part: u32, epoch: u32 },
    /// Replica node -> the node that shipped it: partition `part`'s state after step `epoch`
    /// could not be stored (a patch against a step it does not hold, or a piece that did not
    /// fit): ship the whole.
    ReplicaNack { part: u32, epoch: u32 },
    /// Node adopting partitions -> a node hosting partitions whose rows their replicas left
    /// out ([`crate::replica::Mirrors`]): send me these payloads of step `epoch`.
    MirrorFetch {
        epoch: u32,
        keys: Vec<crate::replica::MirrorKey>,
    },
    /// The answer to a `MirrorFetch`: one piece of one payload (bytes `offset..` of `total`,
    /// pieces of at most [`crate::replica::REPLICA_PIECE`]); `found` false: not kept here.
    MirrorRows {
        epoch: u32,
        key: crate::replica::MirrorKey,
        found: bool,
        offset: u64,
        total: u64,
        data: Vec<u8>,
    },
    /// A serving message (`trellis serve --cluster`), versioned on its own
    /// ([`super::serving::proto`]).
    Serve(super::serving::proto::ServeEnvelope),
}

/// One piece of a partition's committed state after step `epoch`
/// ([`crate::replica::ReplicaPiece`]): `bytes` is the whole's `[offset ..]`, the whole is
/// `total` bytes with the BLAKE3 digest `digest` the sender computed (a restore checks it).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ReplicaWire {
    pub part: u32,
    pub epoch: u32,
    pub offset: u64,
    pub total: u64,
    pub bytes: Vec<u8>,
    pub digest: String,
}

impl From<crate::replica::ReplicaPiece> for ReplicaWire {
    fn from(p: crate::replica::ReplicaPiece) -> Self {
        ReplicaWire {
            part: p.part,
            epoch: p.epoch,
            offset: p.offset,
            total: p.total,
            bytes: p.data,
            digest: p.digest,
        }
    }
}

impl From<ReplicaWire> for crate::replica::ReplicaPiece {
    fn from(w: ReplicaWire) -> Self {
        crate::replica::ReplicaPiece {
            part: w.part,
            epoch: w.epoch,
            digest: w.digest,
            offset: w.offset,
            total: w.total,
            data: w.bytes,
        }
    }
}

/// What a node needs to host its partitions.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Setup {
    pub run: [u8; 16],
    /// The `TrainConfig`, as JSON.
    pub config_json: String,
    /// The partition book (manifest), as JSON: file names, sizes and digests.
    pub book_json: String,
    /// `placement[p]`: the node hosting partition `p`.
    pub placement: Vec<u32>,
    /// Every node's address: (node, "ip:port").
    pub peers: Vec<(u32, String)>,
    /// Deadline of one step, ms.
    pub deadline_ms: u64,
    /// The fault plan (`--chaos`), as the spec string; each node fires its own faults.
    pub chaos: String,
    /// R: how many other nodes keep each partition's replica (its file, ready to adopt it).
    pub replicas: u32,
    /// A durable checkpoint to resume from (its bytes), or empty.
    pub resume: Vec<u8>,
    /// The node writing durable checkpoints that hold every partition's own state (held
    /// rows, skip records, residuals): every replica is shipped to it too.
    pub checkpoint_node: Option<u32>,
}

/// A request for one partition.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Request {
    /// `trace`: the W3C traceparent of the coordinator's span (empty: none), so the
    /// partition's spans on the remote node join the run's trace.
    Step {
        epoch: u32,
        layer: u16,
        phase: u8,
        trace: String,
    },
    Apply {
        epoch: u32,
        grads: Vec<f32>,
        trace: String,
    },
    /// `rollback`: see [`crate::protocol::epoch::Request::Reset`].
    Reset { epoch: u32, rollback: bool },
    /// Host these partitions of a lost node from now on, resuming from this node's replica of
    /// the model state, which must be the committed step `epoch` with weights `digest`
    /// (empty: not known yet).
    Adopt {
        parts: Vec<u32>,
        epoch: u32,
        digest: String,
    },
    /// Stop hosting partition `part` (it keeps failing here and moves to another node).
    Evict { part: u32 },
    /// The placement changed: route by `placement`, refuse everything from `fenced` nodes.
    Reroute {
        placement: Vec<u32>,
        fenced: Vec<u32>,
    },
}

/// The answer to a [`Request`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum ReplyBody {
    Step {
        compute_ms: f64,
        halo_bytes: u64,
        /// What those halo rows would have taken as exact fp32.
        halo_fp32_bytes: u64,
        outcome: WireOutcome,
        /// The state restored since the last reply (a supervised restart): its step and its
        /// weights digest; `None` when nothing was restored.
        restored: Option<(u32, String)>,
        /// Kernel time by family: GEMM, SpMM, other (ms).
        kernels: [f64; 3],
    },
    Applied {
        digest: String,
        /// As in `Step`: the state restored since the last reply, if any.
        restored: Option<(u32, String)>,
        /// [`crate::protocol::messages::ReplicaCost`]: ms on the partition's thread, bytes.
        replica_ms: f64,
        replica_bytes: u64,
    },
    Reset,
    Adopted {
        digest_ok: bool,
    },
    Rerouted,
    Evicted,
    /// The partition panicked (its node's supervisor restarts it) `since_ms` before the reply
    /// was sent.
    Panicked {
        message: String,
        since_ms: f64,
    },
    /// Any other failure, as text.
    Failed {
        message: String,
    },
}

/// [`Outcome`] on the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum WireOutcome {
    LayerDone,
    Loss {
        loss_sum: f64,
        count: u64,
        correct: u64,
    },
    Grads(Vec<f32>),
    CompressedGrads(trellis_runtime::grad_codec::GradPayload),
    Eval {
        train: u64,
        val: u64,
        test: u64,
    },
}

/// Why control bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("bad control message: {0}")]
pub struct DecodeError(pub String);

impl ControlMsg {
    /// Whether this is a replica message (a piece of a replica or of a patch, an
    /// acknowledgement, a refusal, a fetch of rows a replica left out and its answer): every
    /// node hands these to `node::on_replica_msg`.
    pub fn is_replica(&self) -> bool {
        matches!(
            self,
            ControlMsg::Replica(_)
                | ControlMsg::ReplicaDelta(_)
                | ControlMsg::ReplicaAck { .. }
                | ControlMsg::ReplicaNack { .. }
                | ControlMsg::MirrorFetch { .. }
                | ControlMsg::MirrorRows { .. }
        )
    }

    /// What the cluster session machines see of this message.
    pub(crate) fn session(&self) -> crate::protocol::session::SessionMsg {
        use crate::protocol::session::SessionMsg as S;
        match self {
            ControlMsg::Join { addr } => S::Join { addr: addr.clone() },
            ControlMsg::Setup(s) => S::Setup {
                deadline_ms: s.deadline_ms,
            },
            ControlMsg::Ready { .. } => S::Ready,
            ControlMsg::SetupFailed { error } => S::SetupFailed {
                error: error.clone(),
            },
            ControlMsg::FetchPart { part } => S::FetchPart { part: *part },
            ControlMsg::Request { req, .. } => S::Request {
                step_epoch: match req {
                    Request::Step { epoch, .. } => Some(*epoch),
                    _ => None,
                },
            },
            ControlMsg::Replica(_)
            | ControlMsg::ReplicaDelta(_)
            | ControlMsg::ReplicaAck { .. }
            | ControlMsg::ReplicaNack { .. }
            | ControlMsg::MirrorFetch { .. }
            | ControlMsg::MirrorRows { .. } => S::Replica,
            ControlMsg::Finish => S::Finish,
            ControlMsg::Bye { .. } => S::Bye,
            ControlMsg::Abort { reason } => S::Abort {
                reason: reason.clone(),
            },
            ControlMsg::PartChunk { part, .. } => S::Other(format!("a chunk of partition {part}")),
            ControlMsg::Reply { id, .. } => S::Other(format!("reply {id}")),
            ControlMsg::Serve(_) => S::Other("a serving message".into()),
        }
    }
    /// The archived bytes.
    pub fn encode(&self) -> Vec<u8> {
        rkyv::to_bytes::<rkyv::rancor::Error>(self)
            .map(|b| b.into_vec())
            .expect("serialising plain data into a growable buffer cannot fail")
    }

    /// Validates and decodes archived bytes (any byte string: never panics).
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        // rkyv needs its input aligned; received buffers carry no such guarantee.
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        rkyv::from_bytes::<ControlMsg, rkyv::rancor::Error>(&aligned)
            .map_err(|e| DecodeError(e.to_string()))
    }
}

pub fn phase_code(p: Phase) -> u8 {
    match p {
        Phase::Forward => 0,
        Phase::Backward => 1,
        Phase::Eval => 2,
    }
}

pub fn phase_from(code: u8) -> Option<Phase> {
    match code {
        0 => Some(Phase::Forward),
        1 => Some(Phase::Backward),
        2 => Some(Phase::Eval),
        _ => None,
    }
}

impl From<&Outcome> for WireOutcome {
    fn from(o: &Outcome) -> Self {
        match o {
            Outcome::LayerDone => WireOutcome::LayerDone,
            Outcome::Loss {
                loss_sum,
                count,
                correct,
            } => WireOutcome::Loss {
                loss_sum: *loss_sum,
                count: *count as u64,
                correct: *correct as u64,
            },
            Outcome::Grads(g) => WireOutcome::Grads(g.to_vec()),
            Outcome::CompressedGrads(g) => WireOutcome::CompressedGrads((**g).clone()),
            Outcome::Eval { train, val, test } => WireOutcome::Eval {
                train: *train as u64,
                val: *val as u64,
                test: *test as u64,
            },
        }
    }
}

impl From<WireOutcome> for Outcome {
    fn from(o: WireOutcome) -> Self {
        match o {
            WireOutcome::LayerDone => Outcome::LayerDone,
            WireOutcome::Loss {
                loss_sum,
                count,
                correct,
            } => Outcome::Loss {
                loss_sum,
                count: count as usize,
                correct: correct as usize,
            },
            WireOutcome::Grads(g) => Outcome::Grads(Arc::from(g)),
            WireOutcome::CompressedGrads(g) => Outcome::CompressedGrads(Arc::new(g)),
            WireOutcome::Eval { train, val, test } => Outcome::Eval {
                train: train as usize,
                val: val as usize,
                test: test as usize,
            },
        }
    }
}

impl ReplyBody {
    /// The reply carrying `r`'s result.
    pub fn of_step(r: Result<StepReply, ActorError>) -> Self {
        match r {
            Ok(s) => ReplyBody::Step {
                compute_ms: s.compute_ms,
                halo_bytes: s.halo_bytes,
                halo_fp32_bytes: s.halo_fp32_bytes,
                outcome: WireOutcome::from(&s.outcome),
                restored: s.restored.map(|r| (r.epoch, r.digest)),
                kernels: [s.kernels.gemm_ms, s.kernels.spmm_ms, s.kernels.other_ms],
            },
            Err(e) => Self::of_error(e),
        }
    }

    /// The reply reporting `e`.
    pub fn of_error(e: ActorError) -> Self {
        match e {
            ActorError::Panicked { message, .. } => ReplyBody::Panicked {
                message,
                since_ms: 0.0,
            },
            other => ReplyBody::Failed {
                message: other.to_string(),
            },
        }
    }

    /// The error this reply reports for partition `part` on `node`, if it reports one.
    pub fn error(&self, node: u32, part: u32) -> Option<ActorError> {
        match self {
            ReplyBody::Panicked { message, .. } => Some(ActorError::Panicked {
                part,
                message: message.clone(),
            }),
            ReplyBody::Failed { message } => Some(ActorError::Remote {
                node,
                part,
                message: message.clone(),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let msgs = vec![
            ControlMsg::Join {
                addr: "127.0.0.1:4000".into(),
            },
            ControlMsg::Setup(Setup {
                run: [7; 16],
                config_json: "{}".into(),
                book_json: "{\"parts\":2}".into(),
                placement: vec![0, 1, 1],
                peers: vec![(0, "127.0.0.1:1".into()), (1, "[::1]:2".into())],
                deadline_ms: 5000,
                chaos: String::new(),
                replicas: 1,
                resume: vec![1, 2],
                checkpoint_node: Some(0),
            }),
            ControlMsg::Request {
                id: 9,
                part: 2,
                req: Request::Apply {
                    epoch: 3,
                    grads: vec![1.0, -0.5, f32::MIN_POSITIVE],
                    trace: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                },
            },
            ControlMsg::Reply {
                id: 9,
                body: ReplyBody::Step {
                    compute_ms: 1.5,
                    halo_bytes: 42,
                    halo_fp32_bytes: 168,
                    restored: Some((3, "ab12".into())),
                    kernels: [1.0, 2.0, 3.0],
                    outcome: WireOutcome::Loss {
                        loss_sum: 0.25,
                        count: 3,
                        correct: 1,
                    },
                },
            },
            ControlMsg::PartChunk {
                part: 1,
                offset: 8,
                total: 11,
                data: vec![1, 2, 3],
            },
            ControlMsg::Finish,
            ControlMsg::Replica(ReplicaWire {
                part: 3,
                epoch: 9,
                offset: 8,
                total: 11,
                bytes: vec![1, 2, 3],
                digest: "ab".into(),
            }),
            ControlMsg::ReplicaDelta(crate::replica::DeltaPiece {
                header: crate::replica::DeltaHeader {
                    part: 3,
                    epoch: 10,
                    base_epoch: 9,
                    base_digest: "ab".into(),
                    total: 11,
                    digest: "cd".into(),
                },
                index: 0,
                count: 1,
                runs: vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 7],
            }),
            ControlMsg::ReplicaNack { part: 3, epoch: 10 },
            ControlMsg::MirrorFetch {
                epoch: 4,
                keys: vec![crate::replica::MirrorKey {
                    holder: 2,
                    peer: 0,
                    phase: 1,
                    layer: 3,
                    record: true,
                }],
            },
            ControlMsg::MirrorRows {
                epoch: 4,
                key: crate::replica::MirrorKey {
                    holder: 2,
                    peer: 0,
                    phase: 2,
                    layer: 1,
                    record: false,
                },
                found: true,
                offset: 0,
                total: 3,
                data: vec![1, 2, 3],
            },
            ControlMsg::Bye {
                bytes_sent: 1,
                bytes_received: 2,
                metrics: b"{}".to_vec(),
            },
        ];
        for m in msgs {
            assert_eq!(ControlMsg::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn garbage_and_truncation_are_errors_not_panics() {
        let good = ControlMsg::Request {
            id: 1,
            part: 0,
            req: Request::Step {
                epoch: 1,
                layer: 0,
                phase: 0,
                trace: String::new(),
            },
        }
        .encode();
        for cut in 0..good.len() {
            let _ = ControlMsg::decode(&good[..cut]);
        }
        let mut state = 0x9e37_79b9_u32;
        for len in [0usize, 1, 7, 64, 300] {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state as u8
                })
                .collect();
            let _ = ControlMsg::decode(&bytes);
        }
        assert!(ControlMsg::decode(&good[..good.len() / 2]).is_err());
    }

    #[test]
    fn remote_panics_stay_panics() {
        let body = ReplyBody::of_error(ActorError::Panicked {
            part: 3,
            message: "boom".into(),
        });
        assert!(matches!(
            body.error(1, 3),
            Some(ActorError::Panicked { part: 3, .. })
        ));
        let body = ReplyBody::of_error(ActorError::Cancelled);
        let e = body.error(2, 5).unwrap().to_string();
        assert!(e.contains("node 2") && e.contains("partition 5"), "{e}");
    }
}
