//! `trellis-runtime` owns graphs, loaders, partitioning, models, trainers and run reports.
//!
//! The models are written layer by layer over a [`graph::Block`]: a CSR whose rows are the
//! nodes a worker computes (its inner nodes) and whose columns are the input rows it reads
//! (inner nodes, then halo nodes). A single process uses one block over the whole graph; a
//! partition actor uses its partition's block and fills the halo rows by exchange between layers.

pub mod comm;
pub mod data;
mod error;
pub mod grad_codec;
pub mod graph;
pub mod host_memory;
pub mod inference;
pub mod metrics;
pub mod model;
pub mod model_file;
pub mod partition;
pub mod progress;
pub mod report;
pub mod train;

pub use data::{DataSource, Dataset};
pub use error::RuntimeError;
pub use graph::{Aggregation, Block, Graph};
pub use model::{
    LayerInput, Model, ModelConfig, ModelKind, Optimizer, OptimizerKind, Residual, StepCtx,
    MAX_LAYERS,
};
pub use report::{EpochLog, NodeTraffic, RunReport};
pub use train::{TrainConfig, Trainer};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, RuntimeError>;
