//! Opening a partition folder: the memory-mapped, validated part archive ([`PartitionFile`]),
//! the folder with its book ([`PartitionSet`]), and the worker [`Block`] of a part.
use super::book::PartitionBook;
use super::format::{native, unframe, ArchivedPartitionData};
use super::lock::{DirLock, LockMode};
use super::validate::check;
use crate::{Aggregation, Block, Result, RuntimeError};
use memmap2::Mmap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One part archive, memory-mapped and validated; all access is zero-copy.
///
/// The archive is checked once in [`open`](Self::open) (rkyv's bytecheck validation plus the
/// invariants listed in `check`); [`data`](Self::data) then reads the mapping unchecked. That
/// is sound as long as the file is not modified in place while mapped: the writer only ever
/// replaces part files by renaming a new file over them, which leaves existing mappings intact.
pub struct PartitionFile {
    path: PathBuf,
    mmap: Mmap,
    /// Where the validated archive lies in `mmap` (inside the header and end marker).
    archive: Range<usize>,
}

impl std::fmt::Debug for PartitionFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionFile")
            .field("path", &self.path)
            .field("bytes", &self.mmap.len())
            .finish()
    }
}

impl PartitionFile {
    /// Maps and validates the part archive at `path`. A missing, truncated or corrupt file is
    /// an error naming the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_checked(path.as_ref(), None)
    }

    /// As [`open`](Self::open), first comparing the file's size and blake3 digest with the
    /// manifest's `(digest, bytes)`.
    pub(crate) fn open_checked(path: &Path, expect: Option<(&str, u64)>) -> Result<Self> {
        let bad = |m: String| RuntimeError::bad_file(path, m);
        let file = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
        let len = file
            .metadata()
            .map_err(|e| RuntimeError::io(path, e))?
            .len();
        if len == 0 {
            return Err(bad("empty file, not a partition archive".into()));
        }
        // SAFETY: the mapping is read-only; see the type's invariant on in-place modification.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| RuntimeError::io(path, e))?;
        if let Some((want, bytes)) = expect {
            if len != bytes {
                return Err(bad(format!(
                    "{len} bytes, the manifest says {bytes}: the file is truncated or was replaced"
                )));
            }
            let got = blake3::hash(&mmap).to_hex();
            if got.as_str() != want {
                return Err(bad(format!(
                    "content digest {got} does not match the manifest's {want}: the file is corrupt or was changed after partitioning"
                )));
            }
        }
        let archive = unframe(&mmap).map_err(bad)?;
        let data = rkyv::access::<ArchivedPartitionData, rkyv::rancor::Error>(archive)
            .map_err(|e| bad(format!("corrupt partition archive: {e}")))?;
        check(data).map_err(|m| bad(format!("inconsistent partition archive: {m}")))?;
        let start = archive.as_ptr() as usize - mmap.as_ptr() as usize;
        let archive = start..start + archive.len();
        Ok(PartitionFile {
            path: path.to_path_buf(),
            mmap,
            archive,
        })
    }

    /// The archived part.
    pub fn data(&self) -> &ArchivedPartitionData {
        // SAFETY: `open_checked` validated these exact bytes with `rkyv::access`, and the
        // mapping is immutable for the life of `self` (see the type's documentation).
        unsafe { rkyv::access_unchecked::<ArchivedPartitionData>(&self.mmap[self.archive.clone()]) }
    }

    /// The file this part was mapped from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn part(&self) -> usize {
        self.data().part.to_native() as usize
    }
    pub fn num_parts(&self) -> usize {
        self.data().num_parts.to_native() as usize
    }
    pub fn num_features(&self) -> usize {
        self.data().num_features.to_native() as usize
    }
    pub fn num_classes(&self) -> usize {
        self.data().num_classes.to_native() as usize
    }
    /// Global ids of the inner nodes, ascending.
    pub fn inner(&self) -> &[u32] {
        native(self.data().inner.as_slice())
    }
    /// Global ids of the halo nodes, ascending.
    pub fn halo(&self) -> &[u32] {
        native(self.data().halo.as_slice())
    }
    /// Owning part of each halo node.
    pub fn halo_owner(&self) -> &[u32] {
        native(self.data().halo_owner.as_slice())
    }
    /// Global ids of all input rows: inner, then halo.
    pub fn gids(&self) -> Vec<u32> {
        [self.inner(), self.halo()].concat()
    }
    pub fn indptr(&self) -> &[u64] {
        native(self.data().indptr.as_slice())
    }
    pub fn indices(&self) -> &[u32] {
        native(self.data().indices.as_slice())
    }
    pub fn degrees(&self) -> &[u32] {
        native(self.data().degrees.as_slice())
    }
    /// Features of every input row (inner, then halo), row-major.
    pub fn features(&self) -> &[f32] {
        native(self.data().features.as_slice())
    }
    pub fn labels(&self) -> &[u32] {
        native(self.data().labels.as_slice())
    }
    pub fn train_mask(&self) -> &[bool] {
        self.data().train_mask.as_slice()
    }
    pub fn val_mask(&self) -> &[bool] {
        self.data().val_mask.as_slice()
    }
    pub fn test_mask(&self) -> &[bool] {
        self.data().test_mask.as_slice()
    }
    /// `(to_part, local inner rows)` for every part that reads rows of this one.
    pub fn send_lists(&self) -> impl Iterator<Item = (usize, &[u32])> + '_ {
        self.data()
            .send
            .iter()
            .map(|s| (s.to_part.to_native() as usize, native(s.rows.as_slice())))
    }
}

/// A partition folder: its book, and checked access to its parts. While any clone of it
/// lives, the folder is held with a shared lock: other runs may read it, none may
/// re-partition it.
#[derive(Debug, Clone)]
pub struct PartitionSet {
    book: PartitionBook,
    dir: PathBuf,
    _reading: Option<Arc<DirLock>>,
}

impl PartitionSet {
    /// Reads and checks the book in `dir`. A folder being written by another process is an
    /// error naming it; a folder where no lock file can be made (read-only) is read unlocked.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let reading = if dir.join(super::MANIFEST_FILE).is_file() {
            match DirLock::acquire(&dir, LockMode::Shared, "partition folder") {
                Ok(l) => Some(Arc::new(l)),
                Err(e @ RuntimeError::Config(_)) => return Err(e),
                Err(_) => None,
            }
        } else {
            None
        };
        Ok(PartitionSet {
            book: PartitionBook::read(&dir)?,
            dir,
            _reading: reading,
        })
    }

    pub fn book(&self) -> &PartitionBook {
        &self.book
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Number of parts.
    pub fn parts(&self) -> usize {
        self.book.parts
    }

    /// The part that owns each node (its inner nodes), read from the part files; a node
    /// past the book's count or owned by no part is an error naming the file or folder.
    pub fn owners(&self) -> Result<Vec<u32>> {
        let mut owner = vec![u32::MAX; self.book.num_nodes];
        for p in 0..self.parts() {
            let file = self.open_part(p)?;
            for &g in file.inner() {
                let slot = owner.get_mut(g as usize).ok_or_else(|| {
                    RuntimeError::BadData(format!(
                        "{}: node {g} is past the {} nodes of the partition book",
                        file.path().display(),
                        self.book.num_nodes
                    ))
                })?;
                *slot = p as u32;
            }
        }
        if let Some(v) = owner.iter().position(|&o| o == u32::MAX) {
            return Err(RuntimeError::BadData(format!(
                "{}: node {v} is owned by no partition",
                self.dir.display()
            )));
        }
        Ok(owner)
    }

    /// Maps part `p`, checking its digest against the book and its identity and sizes
    /// against the book's entry.
    pub fn open_part(&self, p: usize) -> Result<PartitionFile> {
        let info = self.book.partitions.get(p).ok_or_else(|| {
            RuntimeError::Config(format!(
                "part {p} out of range for {} parts",
                self.book.parts
            ))
        })?;
        let path = self.dir.join(&info.file);
        let file = PartitionFile::open_checked(&path, Some((&info.file_digest, info.file_bytes)))?;
        let d = file.data();
        if file.part() != p
            || file.num_parts() != self.book.parts
            || d.data_digest.as_str() != self.book.data_digest
            || file.inner().len() != info.inner_nodes
            || file.halo().len() != info.halo_nodes
        {
            return Err(RuntimeError::bad_file(
                &path,
                format!("does not match the manifest's entry for part {p}"),
            ));
        }
        Ok(file)
    }
}

/// The aggregation block of a part (inner rows over inner + halo input rows).
pub fn block(file: &PartitionFile, agg: Aggregation) -> Result<Block> {
    let indptr: Vec<usize> = file.indptr().iter().map(|&x| x as usize).collect();
    Block::from_local(
        file.inner().len(),
        file.gids(),
        &indptr,
        file.indices(),
        file.degrees(),
        agg,
    )
}
