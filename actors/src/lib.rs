//! `trellis-actors` owns the actors of a training topology.
//!
//! - `PartitionActor`: one per graph partition, on its own arbiter
//!   (thread) with its own compute [`Stream`](trellis_gpu::Stream); owns the partition's block,
//!   features, model replica and optimizer state.
//! - the node supervisor (`supervisor`): starts partition actors under actix's `Supervisor`,
//!   turns kernel panics into restarts from the node's [`ReplicaStore`](replica::ReplicaStore).
//! - the [`Coordinator`]: drives the epoch protocol (ARCHITECTURE.md).
//! - [`Topology`]/[`TrainingRun`]: the Rust API for programs that spawn training topologies.
//! - [`cluster`]: multi-process clusters over QUIC (`trellis node`, `trellis launch`).
//! - [`telemetry`]: trace-context propagation through messages, the node id on spans.

pub mod checkpoint;
pub mod cluster;
mod coordinator;
mod error;
mod halo;
mod handle;
mod messages;
mod partition;
pub mod profile;
pub mod replica;
pub mod serving;
mod state;
mod supervisor;
pub mod telemetry;
mod topology;

pub use coordinator::{Coordinator, Recovery};
pub use error::ActorError;
pub use handle::PartHandle;
pub use messages::{Outcome, StepReply};
pub use profile::{EpochProfile, StepProfile};
pub use state::{PartitionState, Stage};
pub use topology::{FaultPlan, LinkAction, RunEvent, Topology, TrainingRun};
