//! [`PartHandle`]: how the coordinator reaches a partition, whether its actor runs in this
//! process or on another node of a cluster. Every call resolves to the partition's answer or
//! an [`ActorError`] naming the partition (and the node, when remote).
use crate::cluster::RemotePart;
use crate::protocol::messages::{Applied, ApplyStep, ResetEpoch, Step, StepReply};
use crate::shells::partition::PartitionRef;
use crate::ActorError;
use std::future::Future;
use std::pin::Pin;

/// A reply still to come.
pub type Pending<T> = Pin<Box<dyn Future<Output = Result<T, ActorError>>>>;

/// A partition as the coordinator sees it.
#[derive(Clone)]
pub enum PartHandle {
    /// An actor of this process.
    Local { part: u32, addr: PartitionRef },
    /// An actor on another node, reached through control messages over QUIC.
    Remote(RemotePart),
}

impl PartHandle {
    /// The partition id.
    pub fn part(&self) -> u32 {
        match self {
            PartHandle::Local { part, .. } => *part,
            PartHandle::Remote(r) => r.part(),
        }
    }

    /// Runs one layer of a pass.
    pub fn step(&self, step: Step) -> Pending<StepReply> {
        match self {
            PartHandle::Local { part, addr } => local(*part, addr.addr.send(step)),
            PartHandle::Remote(r) => Box::pin(r.clone().step(step)),
        }
    }

    /// Applies the all-reduced gradients; answers the new weights digest.
    pub fn apply(&self, msg: ApplyStep) -> Pending<Applied> {
        match self {
            PartHandle::Local { part, addr } => local(*part, addr.addr.send(msg)),
            PartHandle::Remote(r) => Box::pin(r.clone().apply(msg)),
        }
    }

    /// Cancels the kernels a partition of this process is running (a failure elsewhere was
    /// detected; the reset follows once the failed part is replaced). A remote partition's
    /// kernels are cancelled when its node receives the reset.
    pub fn cancel_local(&self) {
        if let PartHandle::Local { addr, .. } = self {
            addr.cancel.cancel();
        }
    }

    /// Drops the epoch in progress before it is replayed (cancelling its running kernels).
    pub fn reset(&self, msg: ResetEpoch) -> Pending<()> {
        match self {
            PartHandle::Local { part, addr } => {
                let (part, f) = (*part, addr.reset(msg));
                Box::pin(async move { f.await.map_err(|e| closed(part, e)) })
            }
            PartHandle::Remote(r) => Box::pin(r.clone().reset(msg)),
        }
    }
}

fn local<T: 'static>(
    part: u32,
    f: impl Future<Output = Result<Result<T, ActorError>, actix::MailboxError>> + 'static,
) -> Pending<T> {
    Box::pin(async move { f.await.map_err(|e| closed(part, e))? })
}

fn closed(part: u32, e: actix::MailboxError) -> ActorError {
    ActorError::Unreachable {
        part,
        detail: e.to_string(),
    }
}
