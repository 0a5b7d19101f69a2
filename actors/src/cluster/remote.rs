//! The coordinator's side of remote partitions: [`ControlClient`] sends requests to other
//! nodes and matches their replies by id; [`RemotePart`] is one partition behind it. A node
//! that fails (QUIC idle timeout, refused connection, closed) fails every request waiting on
//! it at once, with an error naming the node.
use super::proto::{phase_code, ControlMsg, ReplyBody, Request};
use crate::protocol::messages::{ApplyStep, ResetEpoch, Step, StepReply};
use crate::ActorError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use trellis_transport::quic::QuicTransport;

type Waiter = oneshot::Sender<Result<ReplyBody, ActorError>>;

/// Requests in flight to other nodes.
pub struct ControlClient {
    transport: Arc<QuicTransport>,
    next: AtomicU64,
    pending: Mutex<HashMap<u64, (u32, Waiter)>>,
    failed: Mutex<HashMap<u32, String>>,
}

impl ControlClient {
    pub fn new(transport: Arc<QuicTransport>) -> Arc<Self> {
        Arc::new(ControlClient {
            transport,
            next: AtomicU64::new(1),
            pending: Mutex::default(),
            failed: Mutex::default(),
        })
    }

    /// The transport requests travel on.
    pub fn transport(&self) -> &Arc<QuicTransport> {
        &self.transport
    }

    /// Sends `req` for partition `part` to `node`; resolves with the reply.
    pub async fn request(
        self: Arc<Self>,
        node: u32,
        part: u32,
        req: Request,
    ) -> Result<ReplyBody, ActorError> {
        if let Some(detail) = self.failed.lock().expect("poisoned").get(&node) {
            return Err(ActorError::Node {
                node,
                detail: detail.clone(),
            });
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .expect("poisoned")
            .insert(id, (node, tx));
        let bytes = ControlMsg::Request { id, part, req }.encode();
        if let Err(e) = self.transport.send_control(node, bytes) {
            self.pending.lock().expect("poisoned").remove(&id);
            return Err(ActorError::Node {
                node,
                detail: e.to_string(),
            });
        }
        rx.await.unwrap_or_else(|_| {
            Err(ActorError::Node {
                node,
                detail: "the request was dropped (coordinator shutting down)".into(),
            })
        })
    }

    /// Delivers reply `id` received from `from`. Replies from the wrong node, or to requests
    /// that already failed, are dropped.
    pub fn on_reply(&self, from: u32, id: u64, body: ReplyBody) {
        let mut pending = self.pending.lock().expect("poisoned");
        match pending.get(&id) {
            Some((node, _)) if *node == from => {
                if let Some((_, tx)) = pending.remove(&id) {
                    let _ = tx.send(Ok(body));
                }
            }
            _ => tracing::warn!(
                peer = from,
                "dropped an unexpected reply {id} from node {from}"
            ),
        }
    }

    /// Node `node` failed: every request waiting on it, and every later one, fails with
    /// `detail`.
    pub fn fail_node(&self, node: u32, detail: String) {
        self.failed
            .lock()
            .expect("poisoned")
            .entry(node)
            .or_insert_with(|| detail.clone());
        let mut pending = self.pending.lock().expect("poisoned");
        let ids: Vec<u64> = pending
            .iter()
            .filter(|(_, (n, _))| *n == node)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some((_, tx)) = pending.remove(&id) {
                let _ = tx.send(Err(ActorError::Node {
                    node,
                    detail: detail.clone(),
                }));
            }
        }
    }
}

/// A partition hosted by another node.
#[derive(Clone)]
pub struct RemotePart {
    client: Arc<ControlClient>,
    node: u32,
    part: u32,
}

impl RemotePart {
    pub fn new(client: Arc<ControlClient>, node: u32, part: u32) -> Self {
        RemotePart { client, node, part }
    }

    pub fn part(&self) -> u32 {
        self.part
    }

    async fn call(&self, req: Request) -> Result<ReplyBody, ActorError> {
        let body = self
            .client
            .clone()
            .request(self.node, self.part, req)
            .await?;
        match body.error(self.node, self.part) {
            Some(e) => Err(e),
            None => Ok(body),
        }
    }

    fn unexpected(&self, body: ReplyBody) -> ActorError {
        ActorError::Node {
            node: self.node,
            detail: format!("answered {body:?} for partition {}", self.part),
        }
    }

    pub async fn step(self, step: Step) -> Result<StepReply, ActorError> {
        let req = Request::Step {
            epoch: step.epoch,
            layer: step.layer,
            phase: phase_code(step.phase),
            trace: step.trace.map(|t| t.to_string()).unwrap_or_default(),
        };
        let body = self
            .client
            .clone()
            .request(self.node, self.part, req)
            .await?;
        if let ReplyBody::Panicked { since_ms, .. } = &body {
            let ago = std::time::Duration::from_secs_f64(since_ms.max(0.0) / 1e3);
            crate::failure_clock::record_ago(step.run, self.part, ago);
        }
        if let Some(e) = body.error(self.node, self.part) {
            return Err(e);
        }
        match body {
            ReplyBody::Step {
                compute_ms,
                halo_bytes,
                halo_fp32_bytes,
                outcome,
                restored,
                kernels,
            } => Ok(StepReply {
                part: self.part,
                compute_ms,
                halo_bytes,
                halo_fp32_bytes,
                kernels: trellis_gpu::KernelTimes {
                    gemm_ms: kernels[0],
                    spmm_ms: kernels[1],
                    other_ms: kernels[2],
                },
                outcome: outcome.into(),
                restored: restored.map(|(epoch, digest)| crate::RestoreReport { epoch, digest }),
            }),
            other => Err(self.unexpected(other)),
        }
    }

    pub async fn apply(
        self,
        msg: ApplyStep,
    ) -> Result<crate::protocol::messages::Applied, ActorError> {
        let req = Request::Apply {
            epoch: msg.epoch,
            grads: msg.grads.to_vec(),
            trace: msg.trace.map(|t| t.to_string()).unwrap_or_default(),
        };
        match self.call(req).await? {
            ReplyBody::Applied {
                digest,
                restored,
                replica_ms,
                replica_bytes,
            } => Ok(crate::protocol::messages::Applied {
                digest,
                restored: restored.map(|(epoch, digest)| crate::RestoreReport { epoch, digest }),
                replica: crate::protocol::messages::ReplicaCost {
                    ms: replica_ms,
                    bytes: replica_bytes,
                },
            }),
            other => Err(self.unexpected(other)),
        }
    }

    pub async fn reset(self, msg: ResetEpoch) -> Result<(), ActorError> {
        match self
            .call(Request::Reset {
                epoch: msg.epoch,
                rollback: msg.rollback,
            })
            .await?
        {
            ReplyBody::Reset => Ok(()),
            other => Err(self.unexpected(other)),
        }
    }
}
