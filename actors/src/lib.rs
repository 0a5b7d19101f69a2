//! `trellis-actors` owns the actors of a training topology.
//!
//! - [`protocol`]: the protocol machines (epoch and recovery, partition inbox), free of I/O.
//! - [`sim`]: a deterministic simulator of a whole cluster over those machines.
//! - [`faults`]: fault plans (`--chaos`, tests, the simulator) and the count of faults fired.
//! - `PartitionActor` ([`shells`]): one per graph partition, on its own arbiter
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
mod error;
mod failure_clock;
pub mod faults;
mod kept_model;
pub mod priority;
pub mod profile;
pub mod protocol;
pub mod replica;
pub mod serving;
pub mod shells;
pub mod sim;
pub mod telemetry;
mod topology;

pub use error::ActorError;
pub use faults::{FaultKind, FaultPlan, LinkAction};
pub use kept_model::{KeptModel, KeptModels};
pub use profile::{EpochProfile, StepProfile};
pub use protocol::epoch::{Recovery, RestartPolicy};
pub use protocol::messages::{Outcome, RestoreReport, StepReply};
pub use protocol::state::{PartitionState, Stage};
pub use shells::coordinator::Coordinator;
pub use shells::handle::PartHandle;
pub use topology::{RunEvent, Topology, TrainingRun};
