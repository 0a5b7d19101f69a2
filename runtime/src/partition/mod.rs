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

/// Opens `dir` if it holds this exact partitioning of `ds` (same parts, method, seed and data
/// digest); partitions `ds` into it if it holds no partition book. A book that is corrupt or
/// describes another partitioning is an error naming the file and what differs: the folder
/// is the user's, and is replaced only on request ([`remove_partitions`], `--repartition`).
pub fn open_or_partition(
    ds: &Dataset,
    parts: usize,
    method: PartitionMethod,
    seed: u64,
    dir: &Path,
) -> Result<PartitionSet> {
    let manifest = dir.join(MANIFEST_FILE);
    if !manifest.exists() {
        partition(ds, parts, method, seed, dir)?;
        return PartitionSet::open(dir);
    }
    let set = PartitionSet::open(dir).map_err(|e| {
        RuntimeError::Config(format!(
            "{e}; to partition again into {}, pass --repartition",
            dir.display()
        ))
    })?;
    let b = set.book();
    let mut differs = Vec::new();
    if b.parts != parts {
        differs.push(format!("{} parts, not {parts}", b.parts));
    }
    if b.method != method {
        differs.push(format!("method {}, not {method}", b.method));
    }
    if b.seed != seed {
        differs.push(format!("partition seed {}, not {seed}", b.seed));
    }
    let digest = ds.digest();
    if b.data_digest != digest {
        differs.push(format!(
            "data {} (digest {}), not {} (digest {digest})",
            b.dataset, b.data_digest, ds.name
        ));
    }
    if !differs.is_empty() {
        return Err(RuntimeError::Config(format!(
            "{} holds another partitioning: {}; pass --repartition to replace it, or use another folder",
            manifest.display(),
            differs.join(", ")
        )));
    }
    Ok(set)
}

/// Removes the partitioning in `dir` (its book and part files; nothing else), holding the
/// folder exclusively: `--repartition`. A folder in use by another run is an error naming it.
pub fn remove_partitions(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let _writing = DirLock::acquire(dir, LockMode::Exclusive, "partition folder")?;
    let entries = std::fs::read_dir(dir).map_err(|e| RuntimeError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| RuntimeError::io(dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let ours = name == MANIFEST_FILE
            || (name.starts_with("part-") && (name.ends_with(".rkyv") || name.ends_with(".tmp")))
            || (name.starts_with(MANIFEST_FILE) && name.ends_with(".tmp"));
        if ours {
            let p = entry.path();
            std::fs::remove_file(&p).map_err(|e| RuntimeError::io(&p, e))?;
        }
    }
    Ok(())
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
