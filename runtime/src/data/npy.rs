//! Loader for PyTorch Geometric exports written with `numpy.save` (a folder) or `numpy.savez`.
//!
//! Keys: `x` (float32 `[N, F]`, float64 accepted and converted), `y` (int64 `[N]`, int32 and
//! `[N, 1]` accepted), `edge_index` (int64 `[2, E]`, int32 accepted) and `train_mask`,
//! `val_mask`, `test_mask` (bool `[N]`). Features are kept raw; `num_classes` is the largest
//! label plus one. Every header is checked against the file size before any data is allocated,
//! so a truncated or corrupt file is an error, never a panic or a giant allocation.
use super::{file_in, Dataset};
use crate::{Result, RuntimeError};
use ndarray::{ArrayD, IxDyn, ShapeBuilder};
use ndarray_npy::npy::header::{Header, ReadHeaderError};
use ndarray_npy::{ReadDataError, ReadableElement};
use rayon::prelude::*;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

/// Labels must lie in `[0, MAX_CLASSES)`; a larger label is treated as corrupt data.
pub(crate) const MAX_CLASSES: u64 = 1 << 16;

/// Loads `edge_index.npy`, `x.npy`, `y.npy` and the three masks from `dir`.
pub fn load_dir(dir: &Path) -> Result<Dataset> {
    if !dir.is_dir() {
        return Err(RuntimeError::io(
            dir,
            io::Error::new(io::ErrorKind::NotFound, "no such directory"),
        ));
    }
    let mut store = Store::Dir(dir.to_path_buf());
    load_from(&mut store, dataset_name(dir, false))
}

/// Loads the same keys from one `.npz` archive.
pub fn load_npz(path: &Path) -> Result<Dataset> {
    let file = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    let zip = zip::ZipArchive::new(BufReader::new(file)).map_err(|e| {
        RuntimeError::bad_file(path, format!("not a valid .npz (zip) archive: {e}"))
    })?;
    let mut store = Store::Npz {
        path: path.to_path_buf(),
        zip,
    };
    load_from(&mut store, dataset_name(path, true))
}

/// The folder name, or the archive's file stem.
pub(crate) fn dataset_name(path: &Path, stem: bool) -> String {
    let pick = |p: &Path| {
        if stem { p.file_stem() } else { p.file_name() }.map(|s| s.to_string_lossy().into_owned())
    };
    pick(path)
        .or_else(|| path.canonicalize().ok().and_then(|p| pick(&p)))
        .unwrap_or_else(|| "dataset".to_string())
}

/// Reads every array's header first and checks that the shapes agree and that all the data
/// fits in memory, so a file claiming a huge array is refused before anything is allocated.
fn plan(store: &mut Store) -> Result<()> {
    let x = store.peek("x")?;
    let Some(&n) = x.shape.first().filter(|_| x.shape.len() == 2) else {
        return Err(RuntimeError::bad_file(
            &x.label,
            format!(
                "wrong shape {:?}: expected a 2-D array [num_nodes, num_features]",
                x.shape
            ),
        ));
    };
    if n == 0 || x.shape[1] == 0 {
        return Err(RuntimeError::bad_file(
            &x.label,
            format!(
                "empty array of shape {:?}: no nodes or no features",
                x.shape
            ),
        ));
    }
    let mut total = x.bytes;
    for (key, what) in [
        ("y", "labels"),
        ("train_mask", "entries"),
        ("val_mask", "entries"),
        ("test_mask", "entries"),
    ] {
        let a = store.peek(key)?;
        match a.shape.first() {
            Some(&k) if k != n => {
                return Err(RuntimeError::bad_file(
                    &a.label,
                    format!("node count mismatch: {k} {what} but x.npy has {n} rows"),
                ))
            }
            _ => {}
        }
        total += a.bytes;
    }
    let e = store.peek("edge_index")?;
    // int32 edges are widened to int64, then split into two u32 lists.
    total += e.bytes * 2;
    check_memory(&x.label, "the data set (every array)", total)
}

fn load_from(store: &mut Store, name: String) -> Result<Dataset> {
    plan(store)?;
    // Features: [N, F] float32 (or float64).
    let x = store.read("x")?;
    let xp = store.label("x");
    if x.shape.len() != 2 {
        return Err(RuntimeError::bad_file(
            &xp,
            format!(
                "wrong shape {:?}: expected a 2-D array [num_nodes, num_features]",
                x.shape
            ),
        ));
    }
    let (n, f) = (x.shape[0], x.shape[1]);
    if n == 0 || f == 0 {
        return Err(RuntimeError::bad_file(
            &xp,
            format!(
                "empty array of shape {:?}: no nodes or no features",
                x.shape
            ),
        ));
    }
    if n > u32::MAX as usize {
        return Err(RuntimeError::bad_file(
            &xp,
            format!("{n} nodes exceed the limit of {} nodes", u32::MAX),
        ));
    }
    let features: Vec<f32> = match x.data {
        Data::F32(v) => v,
        Data::F64(v) => v.into_par_iter().map(|a| a as f32).collect(),
        other => return Err(wrong_dtype(&xp, &other, "float32 (or float64)")),
    };
    if let Some(i) = first_where(&features, |v| !v.is_finite()) {
        return Err(RuntimeError::bad_file(
            &xp,
            format!("non-finite feature value {} (NaN or infinity, or beyond float32 range) at node {}, feature {}", features[i], i / f, i % f),
        ));
    }

    // Labels: [N] (or [N, 1]) int64 (or int32).
    let y = store.read("y")?;
    let yp = store.label("y");
    if !matches!(y.shape.as_slice(), [_] | [_, 1]) {
        return Err(RuntimeError::bad_file(
            &yp,
            format!(
                "wrong shape {:?}: expected a 1-D array [num_nodes]",
                y.shape
            ),
        ));
    }
    let raw_labels: Vec<i64> = match y.data {
        Data::I64(v) => v,
        Data::I32(v) => v.into_iter().map(i64::from).collect(),
        other => return Err(wrong_dtype(&yp, &other, "int64 (or int32)")),
    };
    if raw_labels.len() != n {
        return Err(RuntimeError::bad_file(
            &yp,
            format!(
                "node count mismatch: {} labels but x.npy has {n} rows",
                raw_labels.len()
            ),
        ));
    }
    if let Some(i) = raw_labels
        .iter()
        .position(|&c| c < 0 || c as u64 >= MAX_CLASSES)
    {
        let c = raw_labels[i];
        let what = if c < 0 {
            "negative label"
        } else {
            "label out of range"
        };
        return Err(RuntimeError::bad_file(
            &yp,
            format!("{what} {c} at node {i} (labels must be in [0, {MAX_CLASSES}))"),
        ));
    }
    let labels: Vec<u32> = raw_labels.iter().map(|&c| c as u32).collect();
    drop(raw_labels);
    let num_classes = labels.iter().copied().max().map_or(0, |m| m as usize + 1);

    // Edges: [2, E] int64 (or int32).
    let ei = store.read("edge_index")?;
    let ep = store.label("edge_index");
    if ei.shape.len() != 2 || ei.shape[0] != 2 {
        return Err(RuntimeError::bad_file(
            &ep,
            format!("wrong shape {:?}: expected [2, num_edges]", ei.shape),
        ));
    }
    let e = ei.shape[1];
    let ids: Vec<i64> = match ei.data {
        Data::I64(v) => v,
        Data::I32(v) => v.into_par_iter().map(i64::from).collect(),
        other => return Err(wrong_dtype(&ep, &other, "int64 (or int32)")),
    };
    if let Some(i) = first_where(&ids, |&v| v < 0 || v as u64 >= n as u64) {
        let v = ids[i];
        let what = if v < 0 {
            "negative node id"
        } else {
            "node id out of range"
        };
        return Err(RuntimeError::bad_file(
            &ep,
            format!(
                "{what} {v} at edge_index[{}, {}] for {n} nodes",
                i / e.max(1),
                i % e.max(1)
            ),
        ));
    }
    let edge_src: Vec<u32> = ids[..e].par_iter().map(|&v| v as u32).collect();
    let edge_dst: Vec<u32> = ids[e..].par_iter().map(|&v| v as u32).collect();
    drop(ids);

    let mut masks = Vec::with_capacity(3);
    for key in ["train_mask", "val_mask", "test_mask"] {
        let m = store.read(key)?;
        let mp = store.label(key);
        if m.shape.len() != 1 {
            return Err(RuntimeError::bad_file(
                &mp,
                format!(
                    "wrong shape {:?}: expected a 1-D array [num_nodes]",
                    m.shape
                ),
            ));
        }
        let v = match m.data {
            Data::Bool(v) => v,
            other => return Err(wrong_dtype(&mp, &other, "bool")),
        };
        if v.len() != n {
            return Err(RuntimeError::bad_file(
                &mp,
                format!(
                    "node count mismatch: {} entries but x.npy has {n} rows",
                    v.len()
                ),
            ));
        }
        masks.push(v);
    }
    let test_mask = masks.pop().unwrap_or_default();
    let val_mask = masks.pop().unwrap_or_default();
    let train_mask = masks.pop().unwrap_or_default();

    Ok(Dataset {
        name,
        num_nodes: n,
        num_features: f,
        num_classes,
        features,
        labels,
        edge_src,
        edge_dst,
        train_mask,
        val_mask,
        test_mask,
    })
}

/// The index of the first element satisfying `bad`, scanning in parallel chunks.
pub(crate) fn first_where<T: Sync>(v: &[T], bad: impl Fn(&T) -> bool + Sync) -> Option<usize> {
    const CHUNK: usize = 1 << 16;
    let k = v.par_chunks(CHUNK).position_first(|c| c.iter().any(&bad))?;
    let off = k * CHUNK;
    v[off..].iter().position(&bad).map(|i| off + i)
}

fn wrong_dtype(path: &Path, got: &Data, want: &str) -> RuntimeError {
    RuntimeError::bad_file(
        path,
        format!("wrong dtype {}: expected {want}", got.dtype_name()),
    )
}

/// A flat array in logical (C) order and its shape.
struct Array {
    shape: Vec<usize>,
    data: Data,
}

/// The element types the loader understands.
enum Data {
    I64(Vec<i64>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
}

impl Data {
    fn dtype_name(&self) -> &'static str {
        match self {
            Data::I64(_) => "int64",
            Data::I32(_) => "int32",
            Data::F32(_) => "float32",
            Data::F64(_) => "float64",
            Data::Bool(_) => "bool",
        }
    }
}

/// The dtype named by a header's `descr`, with its item size.
#[derive(Clone, Copy)]
enum Kind {
    I64,
    I32,
    F32,
    F64,
    Bool,
}

impl Kind {
    fn of(descr: &str) -> Option<Kind> {
        Some(match descr {
            "<i8" | ">i8" => Kind::I64,
            "<i4" | ">i4" => Kind::I32,
            "<f4" | ">f4" => Kind::F32,
            "<f8" | ">f8" => Kind::F64,
            "|b1" => Kind::Bool,
            _ => return None,
        })
    }
    fn size(self) -> u64 {
        match self {
            Kind::I64 | Kind::F64 => 8,
            Kind::I32 | Kind::F32 => 4,
            Kind::Bool => 1,
        }
    }
}

/// Where arrays come from.
enum Store {
    Dir(PathBuf),
    Npz {
        path: PathBuf,
        zip: zip::ZipArchive<BufReader<File>>,
    },
}

impl Store {
    /// The name used in error messages for `key`: `dir/key.npy` or `archive.npz:key.npy`.
    fn label(&self, key: &str) -> PathBuf {
        match self {
            Store::Dir(d) => file_in(d, &format!("{key}.npy")),
            Store::Npz { path, .. } => PathBuf::from(format!("{}:{key}.npy", path.display())),
        }
    }

    /// Reads and type-checks the array stored under `key`.
    fn read(&mut self, key: &str) -> Result<Array> {
        self.with_entry(key, |r, total, label, in_archive| {
            read_npy(r, total, label, in_archive)
        })
    }

    /// The shape and data size of the array under `key`, from its header alone (nothing
    /// else of it is read or allocated).
    fn peek(&mut self, key: &str) -> Result<Planned> {
        self.with_entry(key, |r, total, label, in_archive| {
            let mut r = Counting { inner: r, count: 0 };
            let (header, kind, len) = npy_header(&mut r, total, label, in_archive)?;
            Ok(Planned {
                label: label.to_path_buf(),
                shape: header.shape,
                bytes: len as u64 * kind.size(),
            })
        })
    }

    /// Opens the stream of `key` and calls `f(stream, its size, its label, in an archive)`.
    /// An archive entry's declared size is checked against its compressed size first: numpy
    /// stores entries or deflates them, and deflate expands at most 1032:1, so a directory
    /// claiming more is corrupt or a zip bomb, refused before anything is inflated.
    fn with_entry<T>(
        &mut self,
        key: &str,
        f: impl FnOnce(&mut dyn Read, u64, &Path, bool) -> Result<T>,
    ) -> Result<T> {
        let label = self.label(key);
        match self {
            Store::Dir(d) => {
                let path = file_in(d, &format!("{key}.npy"));
                let file = File::open(&path).map_err(|e| RuntimeError::io(&path, e))?;
                let total = file
                    .metadata()
                    .map_err(|e| RuntimeError::io(&path, e))?
                    .len();
                f(
                    &mut BufReader::with_capacity(1 << 20, file),
                    total,
                    &label,
                    false,
                )
            }
            Store::Npz { path, zip } => {
                let name = if zip.index_for_name(key).is_some() {
                    key.to_string()
                } else {
                    format!("{key}.npy")
                };
                let mut entry = match zip.by_name(&name) {
                    Ok(entry) => entry,
                    Err(zip::result::ZipError::FileNotFound) => {
                        return Err(RuntimeError::bad_file(
                            &label,
                            format!(
                                "missing array: the archive has no `{key}` or `{key}.npy` entry"
                            ),
                        ))
                    }
                    Err(e) => {
                        return Err(RuntimeError::bad_file(
                            &*path,
                            format!("corrupt .npz archive: {e}"),
                        ))
                    }
                };
                let (total, packed) = (entry.size(), entry.compressed_size());
                let most = match entry.compression() {
                    zip::CompressionMethod::Stored => packed,
                    _ => packed
                        .saturating_mul(MAX_DEFLATE_RATIO)
                        .saturating_add(1024),
                };
                if total > most {
                    return Err(RuntimeError::bad_file(
                        &label,
                        format!(
                            "the archive directory claims {total} bytes for an entry of {packed} compressed bytes ({:?}), more than it can hold: a corrupt archive or a zip bomb",
                            entry.compression()
                        ),
                    ));
                }
                f(&mut entry, total, &label, true)
            }
        }
    }
}

/// What an array's header announces.
struct Planned {
    label: PathBuf,
    shape: Vec<usize>,
    bytes: u64,
}

/// Deflate's largest expansion (a stream of maximal back-references) is about 1032:1.
const MAX_DEFLATE_RATIO: u64 = 1032;

/// Bytes of memory this process can still get: the least of the machine's `MemAvailable`
/// (`/proc/meminfo`), what its cgroup (v2) allows beyond what it uses, and what its data
/// size limit (`ulimit -d`, `RLIMIT_DATA`) allows beyond its data segment (`VmData`). `None`
/// where none of them is known.
pub(crate) fn available_memory() -> Option<u64> {
    [
        meminfo_available(),
        cgroup_headroom(),
        data_limit_headroom(),
    ]
    .into_iter()
    .flatten()
    .min()
}

fn meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `memory.max - memory.current` of this process's cgroup v2 (`None` without a limit).
fn cgroup_headroom() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max" = no limit
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// The soft `RLIMIT_DATA` minus this process's `VmData` (`None` when unlimited).
fn data_limit_headroom() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` only writes the `rlimit` struct it is given, which lives on this
    // stack frame for the whole call.
    if unsafe { libc::getrlimit(libc::RLIMIT_DATA, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmData:"))?;
    let used_kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(lim.rlim_cur.saturating_sub(used_kib * 1024))
}

/// Refuses to allocate `bytes` for `what` (of `path`) when the machine does not have them.
pub(crate) fn check_memory(path: &Path, what: &str, bytes: u64) -> Result<()> {
    match available_memory() {
        Some(avail) if bytes > avail => Err(RuntimeError::bad_file(
            path,
            format!(
                "{what} needs {bytes} bytes ({:.1} GiB) but this machine has {avail} bytes ({:.1} GiB) of memory available",
                bytes as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            ),
        )),
        _ => Ok(()),
    }
}

/// Counts the bytes read through it, to learn the header's length.
struct Counting<R> {
    inner: R,
    count: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.count += k as u64;
        Ok(k)
    }
}

/// Maps an I/O error while reading `path`: running out of bytes means truncation; inside an
/// archive any other error means a corrupt entry.
fn read_error(path: &Path, e: io::Error, in_archive: bool) -> RuntimeError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        RuntimeError::bad_file(
            path,
            "truncated: the file ends before all the data its header declares",
        )
    } else if in_archive {
        RuntimeError::bad_file(path, format!("corrupt archive entry: {e}"))
    } else {
        RuntimeError::io(path, e)
    }
}

/// Parses the header of a `.npy` stream of `total` bytes and checks the data it declares
/// against what follows (and against the machine's memory) before anything is allocated.
fn npy_header<R: Read>(
    r: &mut Counting<R>,
    total: u64,
    path: &Path,
    in_archive: bool,
) -> Result<(Header, Kind, usize)> {
    let header = Header::from_reader(&mut *r).map_err(|e| match e {
        ReadHeaderError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            RuntimeError::bad_file(path, "truncated: the file ends inside the .npy header")
        }
        ReadHeaderError::Io(e) => read_error(path, e, in_archive),
        ReadHeaderError::Parse(e) => {
            RuntimeError::bad_file(path, format!("not a valid .npy file: {e}"))
        }
    })?;
    let kind = header
        .type_descriptor
        .as_string()
        .and_then(|d| Kind::of(d))
        .ok_or_else(|| {
            RuntimeError::bad_file(
                path,
                format!(
                    "unsupported dtype {}: expected int64, int32, float32, float64 or bool",
                    header.type_descriptor
                ),
            )
        })?;
    let len = header
        .shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&l| {
            l.checked_mul(kind.size())
                .is_some_and(|b| b <= isize::MAX as u64)
        })
        .ok_or_else(|| {
            RuntimeError::bad_file(
                path,
                format!("corrupt header: shape {:?} is too large", header.shape),
            )
        })?;
    let need = len * kind.size();
    let have = total.saturating_sub(r.count);
    if have < need {
        return Err(RuntimeError::bad_file(
            path,
            format!("truncated: header declares shape {:?} ({need} data bytes) but only {have} bytes follow", header.shape),
        ));
    }
    if have > need {
        return Err(RuntimeError::bad_file(
            path,
            format!(
                "{} extra bytes after the data of shape {:?} (corrupt file)",
                have - need,
                header.shape
            ),
        ));
    }
    check_memory(path, &format!("shape {:?}", header.shape), need)?;
    Ok((header, kind, len as usize))
}

/// Parses one `.npy` stream of `total` bytes.
fn read_npy<R: Read>(reader: R, total: u64, path: &Path, in_archive: bool) -> Result<Array> {
    let mut r = Counting {
        inner: reader,
        count: 0,
    };
    let (header, kind, len) = npy_header(&mut r, total, path, in_archive)?;
    let h = &header;
    let data = match kind {
        Kind::I64 => Data::I64(typed(&mut r, h, len, path, in_archive)?),
        Kind::I32 => Data::I32(typed(&mut r, h, len, path, in_archive)?),
        Kind::F32 => Data::F32(typed(&mut r, h, len, path, in_archive)?),
        Kind::F64 => Data::F64(typed(&mut r, h, len, path, in_archive)?),
        Kind::Bool => Data::Bool(typed(&mut r, h, len, path, in_archive)?),
    };
    Ok(Array {
        shape: header.shape,
        data,
    })
}

/// Reads `len` elements and returns them in C order.
fn typed<T: ReadableElement + Clone, R: Read>(
    r: &mut R,
    header: &Header,
    len: usize,
    path: &Path,
    in_archive: bool,
) -> Result<Vec<T>> {
    let v = T::read_to_end_exact_vec(r, &header.type_descriptor, len).map_err(|e| match e {
        ReadDataError::Io(e) => read_error(path, e, in_archive),
        ReadDataError::MissingData => RuntimeError::bad_file(
            path,
            "truncated: the file ends before all the data its header declares",
        ),
        ReadDataError::ExtraBytes(k) => RuntimeError::bad_file(
            path,
            format!("{k} extra bytes after the data (corrupt file)"),
        ),
        ReadDataError::WrongDescriptor(d) => {
            RuntimeError::bad_file(path, format!("unsupported dtype {d}"))
        }
        ReadDataError::ParseData(e) => RuntimeError::bad_file(path, format!("invalid data: {e}")),
    })?;
    if !header.layout.is_fortran() || header.shape.len() < 2 {
        return Ok(v);
    }
    let arr = ArrayD::from_shape_vec(IxDyn(&header.shape).f(), v)
        .map_err(|e| RuntimeError::bad_file(path, format!("corrupt header: {e}")))?;
    Ok(arr.iter().cloned().collect())
}
