//! The partition book: the JSON manifest (`partition.json`) that describes a partition folder.
//!
//! The book carries `book_digest`, a BLAKE3 digest of its own file text (with the digest's
//! value blanked), checked on every read: a book that was corrupted or edited is
//! an error naming the file, never silently trusted or re-partitioned over. Each part file's
//! size and digest are in the book, so the whole folder is covered.
use super::format::{FORMAT_VERSION, MANIFEST_FILE};
use super::PartitionMethod;
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The JSON key of [`PartitionBook::book_digest`].
const DIGEST_KEY: &str = "book_digest";

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
    /// BLAKE3 (hex) of this book's file text with this field's value empty; set by
    /// [`PartitionBook::write`], checked by [`PartitionBook::read`].
    #[serde(default)]
    pub book_digest: String,
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
    /// The book's file text with an empty `book_digest`, and the BLAKE3 (hex) of that text.
    fn text_and_digest(&self) -> (String, String) {
        let mut b = self.clone();
        b.book_digest.clear();
        let text = serde_json::to_string_pretty(&b).expect("a partition book serialises") + "\n";
        let digest = blake3::hash(text.as_bytes()).to_hex().to_string();
        (text, digest)
    }

    /// Reads and checks `dir/partition.json`: its digest (over the file's exact text, the
    /// digest's own value blanked), then its consistency.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| RuntimeError::io(&path, e))?;
        let book: PartitionBook = serde_json::from_str(&text).map_err(|e| {
            RuntimeError::bad_file(&path, format!("not a valid partition manifest: {e}"))
        })?;
        if book.book_digest.is_empty() {
            return Err(RuntimeError::bad_file(
                &path,
                "no book_digest (written by an older Trellis or edited): it cannot be checked; \
                 partition again (--repartition)",
            ));
        }
        let field = format!("\"{DIGEST_KEY}\": \"{}\"", book.book_digest);
        let blank = format!("\"{DIGEST_KEY}\": \"\"");
        let blanked = text.replacen(&field, &blank, 1);
        let got = blake3::hash(blanked.as_bytes()).to_hex().to_string();
        if blanked == text || got != book.book_digest {
            return Err(RuntimeError::bad_file(
                &path,
                format!(
                    "corrupt: its content digest {got} does not match its book_digest {}",
                    book.book_digest
                ),
            ));
        }
        book.check().map_err(|m| RuntimeError::bad_file(&path, m))?;
        Ok(book)
    }

    /// This book with its digest set (as [`PartitionBook::write`] writes it).
    pub fn sealed(mut self) -> Self {
        self.book_digest = self.text_and_digest().1;
        self
    }

    /// Writes `dir/partition.json` (with its digest) through a temporary file of this
    /// process, an fsync and a rename. A full disk is an error naming the file.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.{}.tmp", std::process::id()));
        let (text, digest) = self.text_and_digest();
        let text = text.replacen(
            &format!("\"{DIGEST_KEY}\": \"\""),
            &format!("\"{DIGEST_KEY}\": \"{digest}\""),
            1,
        );
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, text.as_bytes())?;
            f.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(RuntimeError::io(&tmp, e));
        }
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
