//! The partition book: the JSON manifest (`partition.json`) that describes a partition folder.
use super::format::{FORMAT_VERSION, MANIFEST_FILE};
use super::PartitionMethod;
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What `partition.json` holds: where each part lives, its sizes and the partition's quality.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionBook {
    pub format_version: u32,
    /// Name of the source data set.
    pub dataset: String,
    /// [`Dataset::digest`](crate::Dataset::digest) of the source data.
    pub data_digest: String,
    pub method: PartitionMethod,
    pub parts: usize,
    pub seed: u64,
    pub num_nodes: usize,
    /// Undirected edges of the symmetrised graph (adjacency entries / 2).
    pub num_edges: usize,
    pub num_features: usize,
    pub num_classes: usize,
    pub train_nodes: usize,
    pub val_nodes: usize,
    pub test_nodes: usize,
    /// Undirected edges whose endpoints lie in different parts.
    pub edge_cut: usize,
    /// One entry per part, in part order.
    pub partitions: Vec<PartInfo>,
    /// `halo_pairs[p][q]`: how many of part `p`'s halo nodes part `q` owns.
    pub halo_pairs: Vec<Vec<usize>>,
    pub balance: Balance,
    /// Milliseconds spent assigning nodes to parts (0 when the caller assigned them).
    pub assign_ms: u64,
    /// Milliseconds spent building and writing the part files.
    pub write_ms: u64,
    /// `assign_ms + write_ms`.
    pub partition_ms: u64,
}

/// One part's entry in the book.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    pub part: usize,
    /// File name relative to the partition folder.
    pub file: String,
    /// blake3 of the file's bytes, hex.
    pub file_digest: String,
    pub file_bytes: u64,
    pub inner_nodes: usize,
    pub halo_nodes: usize,
    /// Entries of the part's local CSR (directed edges into its inner nodes).
    pub edges: usize,
    pub train_nodes: usize,
}

/// Largest part over the mean part, per quantity (1.0 is perfect balance).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Balance {
    pub nodes: f64,
    pub edges: f64,
    pub train: f64,
}

impl Balance {
    pub(crate) fn of(parts: &[PartInfo]) -> Self {
        let ratio = |get: fn(&PartInfo) -> usize| {
            let max = parts.iter().map(get).max().unwrap_or(0) as f64;
            let mean = parts.iter().map(get).sum::<usize>() as f64 / parts.len().max(1) as f64;
            if mean > 0.0 {
                max / mean
            } else {
                1.0
            }
        };
        Balance {
            nodes: ratio(|p| p.inner_nodes),
            edges: ratio(|p| p.edges),
            train: ratio(|p| p.train_nodes),
        }
    }
}

impl PartitionBook {
    /// Reads and checks `dir/partition.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| RuntimeError::io(&path, e))?;
        let book: PartitionBook = serde_json::from_str(&text).map_err(|e| {
            RuntimeError::bad_file(&path, format!("not a valid partition manifest: {e}"))
        })?;
        book.check().map_err(|m| RuntimeError::bad_file(&path, m))?;
        Ok(book)
    }

    /// Writes `dir/partition.json` through a temporary file and a rename.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self).expect("a partition book serialises");
        std::fs::write(&tmp, text + "\n").map_err(|e| RuntimeError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| RuntimeError::io(&path, e))
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format version {} (this build reads {FORMAT_VERSION})",
                self.format_version
            ));
        }
        if self.parts == 0 || self.partitions.len() != self.parts {
            return Err(format!(
                "{} part entries for {} parts",
                self.partitions.len(),
                self.parts
            ));
        }
        if let Some((i, p)) = self
            .partitions
            .iter()
            .enumerate()
            .find(|(i, p)| p.part != *i)
        {
            return Err(format!("entry {i} describes part {}", p.part));
        }
        if let Some(p) = self.partitions.iter().find(|p| !is_plain_name(&p.file)) {
            return Err(format!(
                "part {} file `{}` is not a plain file name",
                p.part, p.file
            ));
        }
        if self.halo_pairs.len() != self.parts
            || self.halo_pairs.iter().any(|r| r.len() != self.parts)
        {
            return Err(format!("halo_pairs is not a {0} x {0} matrix", self.parts));
        }
        if self.partitions.iter().map(|p| p.inner_nodes).sum::<usize>() != self.num_nodes {
            return Err(format!(
                "inner node counts do not add up to {} nodes",
                self.num_nodes
            ));
        }
        Ok(())
    }
}

/// A single normal path component: no folders, no `..`, not absolute.
fn is_plain_name(name: &str) -> bool {
    let mut c = Path::new(name).components();
    matches!(
        (c.next(), c.next()),
        (Some(std::path::Component::Normal(_)), None)
    )
}
