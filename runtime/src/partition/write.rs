//! Writes a partition folder: one rkyv archive per part, then the partition book.
use super::book::{Balance, PartInfo, PartitionBook};
use super::build::{members, PartSpec, Scratch};
use super::format::{end_marker, header, part_file_name, PartitionData, FORMAT_VERSION};
use super::lock::{DirLock, LockMode};
use super::PartitionMethod;
use crate::{progress, Dataset, Graph, Result, RuntimeError};
use rayon::prelude::*;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Instant;

/// Builds and writes every part of `assignment` (part of each node) into `out_dir`, then the
/// manifest. Parts are built one at a time (each in parallel) so that peak memory stays at the
/// data set plus one part; each file is written to a temporary name and renamed into place,
/// and the manifest is written last.
pub fn write_partitions(
    ds: &Dataset,
    graph: &Graph,
    assignment: &[u32],
    parts: usize,
    method: PartitionMethod,
    seed: u64,
    out_dir: &Path,
) -> Result<PartitionBook> {
    write_partitions_timed(ds, graph, assignment, parts, method, seed, out_dir, 0)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn write_partitions_timed(
    ds: &Dataset,
    graph: &Graph,
    assignment: &[u32],
    parts: usize,
    method: PartitionMethod,
    seed: u64,
    out_dir: &Path,
    assign_ms: u64,
) -> Result<PartitionBook> {
    let start = Instant::now();
    let n = graph.num_nodes();
    if ds.num_nodes != n || assignment.len() != n {
        return Err(RuntimeError::BadData(format!(
            "graph has {n} nodes, data set {}, assignment {}",
            ds.num_nodes,
            assignment.len()
        )));
    }
    if parts == 0 || parts > u32::MAX as usize {
        return Err(RuntimeError::Config(format!("cannot write {parts} parts")));
    }
    if let Some(&q) = assignment.iter().find(|&&q| q as usize >= parts) {
        return Err(RuntimeError::BadData(format!(
            "assignment names part {q} of {parts}"
        )));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| RuntimeError::io(out_dir, e))?;
    let _writing = DirLock::acquire(out_dir, LockMode::Exclusive, "partition folder")?;
    let data_digest = ds.digest();
    let spec = PartSpec {
        ds,
        graph,
        assignment,
        parts,
        data_digest: &data_digest,
    };
    let lists = members(assignment, parts);
    let mut scratch = Scratch::new(n);
    let mut infos = Vec::with_capacity(parts);
    let mut halo_pairs = vec![vec![0usize; parts]; parts];
    let bar = progress::bar(parts as u64, "partition");
    for (p, inner) in lists.iter().enumerate() {
        let data = spec.build(p, inner, &mut scratch);
        for &q in &data.halo_owner {
            halo_pairs[p][q as usize] += 1;
        }
        let file = part_file_name(p);
        let (file_digest, file_bytes) = write_archive(&data, &out_dir.join(&file))?;
        infos.push(PartInfo {
            part: p,
            file,
            file_digest,
            file_bytes,
            inner_nodes: data.inner.len(),
            halo_nodes: data.halo.len(),
            edges: data.indices.len(),
            train_nodes: data.train_mask.iter().filter(|&&t| t).count(),
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    let count = |m: &[bool]| m.iter().filter(|&&t| t).count();
    let write_ms = start.elapsed().as_millis() as u64;
    let book = PartitionBook {
        format_version: FORMAT_VERSION,
        dataset: ds.name.clone(),
        data_digest,
        method,
        parts,
        seed,
        num_nodes: n,
        num_edges: graph.num_entries() / 2,
        num_features: ds.num_features,
        num_classes: ds.num_classes,
        train_nodes: count(&ds.train_mask),
        val_nodes: count(&ds.val_mask),
        test_nodes: count(&ds.test_mask),
        edge_cut: edge_cut(graph, assignment),
        balance: Balance::of(&infos),
        partitions: infos,
        halo_pairs,
        assign_ms,
        write_ms,
        partition_ms: assign_ms + write_ms,
        book_digest: String::new(),
    }
    .sealed();
    book.write(out_dir)?;
    Ok(book)
}

/// Undirected edges whose endpoints are in different parts.
pub(crate) fn edge_cut(graph: &Graph, assignment: &[u32]) -> usize {
    (0..graph.num_nodes())
        .into_par_iter()
        .map(|i| {
            graph
                .neighbors(i)
                .iter()
                .filter(|&&j| j as usize > i && assignment[j as usize] != assignment[i])
                .count()
        })
        .sum()
}

/// Streams `data` as a framed rkyv archive into `path` (via `path.tmp` and a rename); returns the
/// blake3 hex digest and the size of the bytes written.
fn write_archive(data: &PartitionData, path: &Path) -> Result<(String, u64)> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let failed = FirstError::default();
    let result = (|| {
        let file = File::create(&tmp)?;
        let mut out = HashingWriter {
            inner: BufWriter::with_capacity(1 << 20, file),
            hasher: blake3::Hasher::new(),
            bytes: 0,
            failed: failed.clone(),
        };
        out.write_all(&header())?;
        // rkyv positions are relative to the archive's start, which the header keeps aligned.
        let mut out = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(
            data,
            rkyv::ser::writer::IoWriter::new(out),
        )
        .map_err(|e| {
            failed
                .borrow_mut()
                .take()
                .unwrap_or_else(|| std::io::Error::other(e))
        })?
        .into_inner();
        let archive_len = out.bytes - header().len() as u64;
        out.write_all(&end_marker(archive_len))?;
        out.flush()?;
        let digest = out.hasher.finalize().to_hex().to_string();
        // No fsync: a part torn by a crash fails the manifest's size and digest checks on
        // open, and partitioning can simply be rerun.
        out.inner.into_inner().map_err(|e| e.into_error())?;
        Ok((digest, out.bytes))
    })();
    match result {
        Ok(r) => {
            std::fs::rename(&tmp, path).map_err(|e| RuntimeError::io(path, e))?;
            Ok(r)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(RuntimeError::io(&tmp, e))
        }
    }
}

/// Forwards writes and hashes what was written.
/// The first I/O error a writer hit: the serializer wraps errors into its own type, which
/// would hide e.g. "No space left on device".
type FirstError = std::rc::Rc<std::cell::RefCell<Option<std::io::Error>>>;

struct HashingWriter<W> {
    inner: W,
    hasher: blake3::Hasher,
    bytes: u64,
    failed: FirstError,
}

impl<W> HashingWriter<W> {
    fn note<T>(&self, r: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &r {
            let mut f = self.failed.borrow_mut();
            if f.is_none() {
                *f = Some(std::io::Error::new(e.kind(), e.to_string()));
            }
        }
        r
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let r = self.inner.write(buf);
        let k = self.note(r)?;
        self.hasher.update(&buf[..k]);
        self.bytes += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        let r = self.inner.flush();
        self.note(r)
    }
}
