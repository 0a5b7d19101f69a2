//! Graph partitioning for distributed training (`trellis partition`).
//!
//! [`assign`] decides each node's part (METIS with DistDGL-style balance constraints, or a
//! seeded random baseline); [`write_partitions`] writes one memory-mappable rkyv archive per
//! part ([`PartitionData`]) and the JSON partition book ([`PartitionBook`]); [`PartitionSet`]
//! and [`PartitionFile`] open them again, validated, and [`block`] turns a part into the
//! [`Block`](crate::Block) its worker aggregates over.
use crate::{Dataset, Graph, Result, RuntimeError};
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Instant;

mod assign;
mod book;
mod build;
mod file;
mod format;
mod lock;
mod validate;
mod write;

pub use assign::assign;
pub use book::{Balance, PartInfo, PartitionBook};
pub use file::{block, PartitionFile, PartitionSet};
pub use format::{
    part_file_name, ArchivedPartitionData, ArchivedSendList, PartitionData, SendList,
    FORMAT_VERSION, MANIFEST_FILE,
};
pub use lock::{DirLock, LockMode, LOCK_FILE};
pub use write::write_partitions;

/// How nodes are assigned to parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionMethod {
    /// METIS k-way: minimises the edge cut while balancing nodes, edges and training nodes.
    Metis,
    /// Each node's part is a counter-based hash of (seed, node): the baseline.
    Random,
}

impl FromStr for PartitionMethod {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "metis" => Ok(PartitionMethod::Metis),
            "random" => Ok(PartitionMethod::Random),
            _ => Err(RuntimeError::Config(format!(
                "unknown partition method `{s}` (expected metis or random)"
            ))),
        }
    }
}

impl fmt::Display for PartitionMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PartitionMethod::Metis => "metis",
            PartitionMethod::Random => "random",
        })
    }
}

/// Opens `dir` if it already holds this exact partitioning of `ds` (same parts, method, seed
/// and data digest), else partitions `ds` into it.
pub fn open_or_partition(
    ds: &Dataset,
    parts: usize,
    method: PartitionMethod,
    seed: u64,
    dir: &Path,
) -> Result<PartitionSet> {
    let reusable = PartitionSet::open(dir).is_ok_and(|set| {
        let b = set.book();
        b.parts == parts && b.method == method && b.seed == seed && b.data_digest == ds.digest()
    });
    if !reusable {
        partition(ds, parts, method, seed, dir)?;
    }
    PartitionSet::open(dir)
}

/// Builds the graph, assigns parts and writes them to `out_dir`; the book's timings cover
/// the assignment and the writing.
pub fn partition(
    ds: &Dataset,
    parts: usize,
    method: PartitionMethod,
    seed: u64,
    out_dir: &Path,
) -> Result<PartitionBook> {
    let graph = Graph::from_dataset(ds)?;
    let t = Instant::now();
    let assignment = assign(&graph, ds, parts, method, seed)?;
    let assign_ms = t.elapsed().as_millis() as u64;
    write::write_partitions_timed(
        ds,
        &graph,
        &assignment,
        parts,
        method,
        seed,
        out_dir,
        assign_ms,
    )
}
