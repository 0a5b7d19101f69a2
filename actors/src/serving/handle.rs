//! The engine's handle on one serving partition, wherever it runs: an actor of this process
//! ([`PartHandle::Local`]) or a partition hosted by another node of a cluster, reached over
//! the control protocol ([`PartHandle::Remote`]). Every message of a pass — steps, graph
//! deltas, aborts, lookups, and the stage / install / drop of a new model's tables — goes
//! through this one interface, so the engine's passes do not know where a partition lives.
use super::part::{DeltaOp, LookedUp, ModelValues, PassStep, StepDone};
use super::shell::{Abort, Delta, DropStaged, Install, Lookup, ServeActor, Stage, Step};
use crate::cluster::serving::RemoteServePart;
use crate::ActorError;
use actix::Addr;
use std::sync::Arc;
use trellis_transport::TraceContext;

/// One serving partition, as the engine reaches it.
#[derive(Clone)]
pub enum PartHandle {
    /// An actor of this process.
    Local { part: u32, addr: Addr<ServeActor> },
    /// A partition hosted by another node.
    Remote(RemoteServePart),
}

fn unreachable(part: u32, e: actix::MailboxError) -> ActorError {
    ActorError::Unreachable {
        part,
        detail: e.to_string(),
    }
}

impl PartHandle {
    /// The partition's id.
    pub fn part(&self) -> u32 {
        match self {
            PartHandle::Local { part, .. } => *part,
            PartHandle::Remote(r) => r.part(),
        }
    }

    /// The node hosting it, when it is another node.
    pub fn node(&self) -> Option<u32> {
        match self {
            PartHandle::Local { .. } => None,
            PartHandle::Remote(r) => Some(r.node()),
        }
    }

    /// Runs one layer of a pass.
    pub async fn step(&self, step: PassStep) -> Result<StepDone, ActorError> {
        match self {
            PartHandle::Local { part, addr } => addr
                .send(Step(step))
                .await
                .map_err(|e| unreachable(*part, e))?,
            PartHandle::Remote(r) => r.step(step).await,
        }
    }

    /// Applies graph changes before the next pass. `generation` numbers the engine's
    /// broadcasts (a node hosting several partitions applies each to its copy of the
    /// served graph once).
    pub async fn delta(&self, ops: Arc<Vec<DeltaOp>>, generation: u64) -> Result<(), ActorError> {
        match self {
            PartHandle::Local { part, addr } => addr
                .send(Delta(ops))
                .await
                .map_err(|e| unreachable(*part, e))?,
            PartHandle::Remote(r) => r.delta(&ops, generation).await,
        }
    }

    /// Abandons pass `seq` (not waited for).
    pub fn abort(&self, seq: u32) {
        match self {
            PartHandle::Local { addr, .. } => addr.do_send(Abort(seq)),
            PartHandle::Remote(r) => r.abort(seq),
        }
    }

    /// The last layer's rows (and layer `layer`'s) of `ids`, which it owns; `trace` is
    /// the asking span (the lookup's span is its child).
    pub async fn lookup(
        &self,
        ids: Vec<u32>,
        layer: Option<usize>,
        trace: Option<TraceContext>,
    ) -> Result<Vec<LookedUp>, ActorError> {
        match self {
            PartHandle::Local { part, addr } => addr
                .send(Lookup { ids, layer, trace })
                .await
                .map_err(|e| unreachable(*part, e))?,
            PartHandle::Remote(r) => r.lookup(ids, layer, trace).await,
        }
    }

    /// Starts computing `model`'s tables beside the live ones.
    pub async fn stage(&self, model: Arc<ModelValues>) -> Result<(), ActorError> {
        match self {
            PartHandle::Local { part, addr } => addr
                .send(Stage(model))
                .await
                .map_err(|e| unreachable(*part, e))?,
            PartHandle::Remote(r) => r.stage(&model).await,
        }
    }

    /// Makes the staged tables live; false when there were none.
    pub async fn install(&self) -> Result<bool, ActorError> {
        match self {
            PartHandle::Local { part, addr } => addr
                .send(Install)
                .await
                .map_err(|e| unreachable(*part, e))?,
            PartHandle::Remote(r) => r.install().await,
        }
    }

    /// Drops the staged tables (not waited for).
    pub fn drop_staged(&self) {
        match self {
            PartHandle::Local { addr, .. } => addr.do_send(DropStaged),
            PartHandle::Remote(r) => r.drop_staged(),
        }
    }
}
