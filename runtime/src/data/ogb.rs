//! Loader for OGB node-property-prediction folders as OGB downloads them.
//!
//! Reads `raw/node-feat.csv.gz` (N lines of F floats), `raw/node-label.csv.gz` (N lines, one
//! integer label each), `raw/edge.csv.gz` (`src,dst` lines, kept directed as given), the
//! optional `raw/num-node-list.csv.gz` (one line: N) and `split/<name>/{train,valid,test}.csv.gz`
//! (one node id per line) from the single folder under `split/`.
//!
//! A label written as `nan` marks an unlabeled node: it gets label 0 and must not appear in any
//! split file (OGB's splits never list unlabeled nodes; one that does is reported as an error).
//!
//! The gzip streams are decompressed in blocks of whole lines and each block is parsed in
//! parallel, so memory stays bounded by the block size plus the result.
use super::{file_in, Dataset};
use crate::{Result, RuntimeError};
use flate2::read::MultiGzDecoder;
use rayon::prelude::*;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender};

/// Decompressed bytes handed to the parallel parser at a time.
const BLOCK: usize = 8 << 20;
/// Bytes per parallel piece of a block.
const PIECE: usize = 256 << 10;
/// A line longer than this means the file is not the expected CSV.
const MAX_LINE: usize = 64 << 20;

/// Marks an unlabeled node while parsing.
const UNLABELED: u32 = u32::MAX;

/// Loads `raw/{edge,node-feat,node-label}.csv.gz` and `split/<name>/{train,valid,test}.csv.gz`.
pub fn load(dir: &Path) -> Result<Dataset> {
    let raw = file_in(dir, "raw");

    // Node count: num-node-list.csv.gz when present, else the feature rows.
    let nn_path = file_in(&raw, "num-node-list.csv.gz");
    let declared = if nn_path.exists() {
        let (counts, _) = parse_csv_gz(
            &nn_path,
            |_| Ok(()),
            |_, line, out: &mut Vec<u64>| {
                let v = parse_int(line, "node count")?;
                if v < 0 {
                    return Err(format!("negative node count {v}"));
                }
                out.push(v as u64);
                Ok(())
            },
        )?;
        match counts.as_slice() {
            [n] => Some(*n as usize),
            [] => {
                return Err(RuntimeError::bad_file(
                    &nn_path,
                    "empty file: expected one line with the node count",
                ))
            }
            _ => {
                return Err(RuntimeError::bad_file(
                    &nn_path,
                    format!(
                        "{} graphs listed: only single-graph (node-level) data sets are supported",
                        counts.len()
                    ),
                ))
            }
        }
    } else {
        None
    };

    // Features.
    let feat_path = file_in(&raw, "node-feat.csv.gz");
    let (features, f) = parse_csv_gz(
        &feat_path,
        |first| Ok(first.split(',').count()),
        |&f, line, out: &mut Vec<f32>| {
            let before = out.len();
            for (j, field) in line.split(',').enumerate() {
                if j >= f {
                    return Err(format!(
                        "{} values, expected {f} like the first line",
                        line.split(',').count()
                    ));
                }
                let v: f32 = field
                    .parse()
                    .or_else(|_| field.trim().parse())
                    .map_err(|_| {
                        format!("malformed number `{}` in column {}", clip(field), j + 1)
                    })?;
                if !v.is_finite() {
                    return Err(format!(
                        "non-finite feature value `{}` (NaN or infinity) in column {}",
                        clip(field),
                        j + 1
                    ));
                }
                out.push(v);
            }
            if out.len() - before != f {
                return Err(format!(
                    "{} values, expected {f} like the first line",
                    out.len() - before
                ));
            }
            Ok(())
        },
    )?;
    // The first line fixed F and every line was checked against it.
    let f = match f {
        Some(f) if !features.is_empty() => f,
        _ => {
            return Err(RuntimeError::bad_file(
                &feat_path,
                "empty file: no feature rows",
            ))
        }
    };
    let rows = features.len() / f;
    let n = match declared {
        Some(n) if n != rows => {
            return Err(RuntimeError::bad_file(
                &feat_path,
                format!("node count mismatch: {rows} rows but num-node-list.csv.gz says {n} nodes"),
            ))
        }
        _ => rows,
    };
    if n > u32::MAX as usize - 1 {
        return Err(RuntimeError::bad_file(
            &feat_path,
            format!("{n} nodes exceed the supported limit"),
        ));
    }

    // Labels.
    let label_path = file_in(&raw, "node-label.csv.gz");
    let (raw_labels, _) = parse_csv_gz(
        &label_path,
        |_| Ok(()),
        |_, line, out: &mut Vec<u32>| {
            let t = line.trim();
            if t.contains(',') {
                return Err(format!(
                "{} values on a line: expected one label per node (multi-label data sets are not supported)",
                t.split(',').count()
            ));
            }
            if t.eq_ignore_ascii_case("nan") {
                out.push(UNLABELED);
                return Ok(());
            }
            let c = parse_int(t, "label")?;
            if c < 0 {
                return Err(format!("negative label {c}"));
            }
            if c as u64 >= super::npy::MAX_CLASSES {
                return Err(format!(
                    "label out of range {c} (labels must be in [0, {}))",
                    super::npy::MAX_CLASSES
                ));
            }
            out.push(c as u32);
            Ok(())
        },
    )?;
    if raw_labels.len() != n {
        return Err(RuntimeError::bad_file(
            &label_path,
            format!(
                "node count mismatch: {} labels but node-feat.csv.gz has {n} rows",
                raw_labels.len()
            ),
        ));
    }
    let labeled: Vec<bool> = raw_labels.iter().map(|&c| c != UNLABELED).collect();
    let labels: Vec<u32> = raw_labels
        .iter()
        .map(|&c| if c == UNLABELED { 0 } else { c })
        .collect();
    drop(raw_labels);
    let num_classes = labels.iter().copied().max().map_or(0, |m| m as usize + 1);

    // Edges.
    let edge_path = file_in(&raw, "edge.csv.gz");
    let (pairs, _) = parse_csv_gz(
        &edge_path,
        |_| Ok(()),
        |_, line, out: &mut Vec<[u32; 2]>| {
            let (a, b) = line
                .split_once(',')
                .ok_or_else(|| format!("malformed line `{}`: expected `src,dst`", clip(line)))?;
            if b.contains(',') {
                return Err(format!(
                    "malformed line `{}`: expected two values `src,dst`",
                    clip(line)
                ));
            }
            out.push([node_id(a, n)?, node_id(b, n)?]);
            Ok(())
        },
    )?;
    let edge_src: Vec<u32> = pairs.par_iter().map(|p| p[0]).collect();
    let edge_dst: Vec<u32> = pairs.par_iter().map(|p| p[1]).collect();
    drop(pairs);

    // Splits.
    let split_dir = find_split(dir)?;
    let mut masks = Vec::with_capacity(3);
    for part in ["train", "valid", "test"] {
        let path = file_in(&split_dir, &format!("{part}.csv.gz"));
        let (ids, _) = parse_csv_gz(
            &path,
            |_| Ok(()),
            |_, line, out: &mut Vec<u32>| {
                let v = node_id(line, n)?;
                if !labeled[v as usize] {
                    return Err(format!(
                        "node {v} has no label (`nan` in node-label.csv.gz)"
                    ));
                }
                out.push(v);
                Ok(())
            },
        )?;
        let mut mask = vec![false; n];
        for v in ids {
            mask[v as usize] = true;
        }
        masks.push(mask);
    }
    let test_mask = masks.pop().unwrap_or_default();
    let val_mask = masks.pop().unwrap_or_default();
    let train_mask = masks.pop().unwrap_or_default();

    Ok(Dataset {
        name: super::npy::dataset_name(dir, false),
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

/// The single folder under `dir/split/`.
fn find_split(dir: &Path) -> Result<PathBuf> {
    let split = file_in(dir, "split");
    let entries = std::fs::read_dir(&split).map_err(|e| RuntimeError::io(&split, e))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| RuntimeError::io(&split, e))?;
        if entry.path().is_dir() {
            found.push(entry.path());
        }
    }
    found.sort();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(RuntimeError::bad_file(
            &split,
            "no split folder (expected split/<name>/{train,valid,test}.csv.gz)",
        )),
        _ => {
            let names: Vec<String> = found
                .iter()
                .filter_map(|p| p.file_name())
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            Err(RuntimeError::bad_file(
                &split,
                format!(
                    "several split folders ({}): keep exactly one",
                    names.join(", ")
                ),
            ))
        }
    }
}

/// Parses a node id in `[0, n)`.
fn node_id(s: &str, n: usize) -> std::result::Result<u32, String> {
    let v = parse_int(s, "node id")?;
    if v < 0 {
        return Err(format!("negative node id {v}"));
    }
    if v as u64 >= n as u64 {
        return Err(format!("node id out of range: {v} for {n} nodes"));
    }
    Ok(v as u32)
}

/// Parses an integer; an integral float such as `3.0` is accepted too.
fn parse_int(s: &str, what: &str) -> std::result::Result<i64, String> {
    if let Ok(v) = s.parse::<i64>() {
        return Ok(v);
    }
    let t = s.trim();
    if let Ok(v) = t.parse::<i64>() {
        return Ok(v);
    }
    match t.parse::<f64>() {
        Ok(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 9.0e15 => Ok(x as i64),
        _ => Err(format!(
            "malformed {what} `{}`: expected an integer",
            clip(t)
        )),
    }
}

/// At most 40 characters of `s`, for error messages.
fn clip(s: &str) -> String {
    if s.chars().count() <= 40 {
        s.to_string()
    } else {
        format!("{}...", s.chars().take(40).collect::<String>())
    }
}

/// Why the decompressing thread stopped early.
enum ReadFail {
    Gzip(std::io::Error),
    LongLine,
    /// The text inflated past this many bytes, the memory available when reading began.
    TooLarge(u64),
}

/// Decompresses `file` in blocks that end at a line break (the last block may not) and sends
/// them down `tx`; stops at the end, on an error, or when the receiver hangs up.
fn decompress_blocks(file: File, tx: SyncSender<std::result::Result<Vec<u8>, ReadFail>>) {
    let mut dec = MultiGzDecoder::new(BufReader::with_capacity(1 << 20, file));
    let mut carry: Vec<u8> = Vec::new();
    // What the parsed values may take is bounded by the machine's memory; text inflating
    // beyond it (a gzip bomb) is stopped there instead of when allocation fails.
    let budget = super::npy::available_memory().unwrap_or(u64::MAX);
    let mut inflated = 0u64;
    loop {
        let mut buf = std::mem::take(&mut carry);
        buf.reserve(BLOCK);
        let got = match (&mut dec).take(BLOCK as u64).read_to_end(&mut buf) {
            Ok(k) => k,
            Err(e) => {
                let _ = tx.send(Err(ReadFail::Gzip(e)));
                return;
            }
        };
        inflated += got as u64;
        if inflated > budget {
            let _ = tx.send(Err(ReadFail::TooLarge(budget)));
            return;
        }
        if got == 0 {
            if !buf.is_empty() {
                let _ = tx.send(Ok(buf));
            }
            return;
        }
        match buf.iter().rposition(|&b| b == b'\n') {
            Some(p) => {
                carry = buf[p + 1..].to_vec();
                buf.truncate(p + 1);
                if tx.send(Ok(buf)).is_err() {
                    return;
                }
            }
            None if buf.len() > MAX_LINE => {
                let _ = tx.send(Err(ReadFail::LongLine));
                return;
            }
            None => carry = buf,
        }
    }
}

/// Decompresses `path` (gzip) and parses it line by line into one vector. One thread
/// decompresses while the blocks it produced are parsed in parallel.
///
/// `init` sees the first line and returns the context every line is parsed with (e.g. the
/// column count); `per_line` parses one line (without its line break) and appends to `out`.
/// Errors name the file and the 1-based line number. Returns the values and the context
/// (`None` for an empty file).
fn parse_csv_gz<T, C, I, P>(path: &Path, init: I, per_line: P) -> Result<(Vec<T>, Option<C>)>
where
    T: Send,
    C: Sync,
    I: FnOnce(&str) -> std::result::Result<C, String>,
    P: Fn(&C, &str, &mut Vec<T>) -> std::result::Result<(), String> + Sync,
{
    let file = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    let budget = super::npy::available_memory().unwrap_or(u64::MAX);
    let (tx, rx) = sync_channel(1);
    std::thread::scope(|scope| {
        scope.spawn(move || decompress_blocks(file, tx));
        let mut out: Vec<T> = Vec::new();
        let mut init = Some(init);
        let mut ctx: Option<C> = None;
        let mut line_no = 1usize; // number of the first line of the next block
        for block in rx {
            let block = block.map_err(|fail| match fail {
                ReadFail::Gzip(e) => {
                    let what = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        "truncated"
                    } else {
                        "corrupt"
                    };
                    RuntimeError::bad_file(path, format!("{what} gzip data: {e}"))
                }
                ReadFail::TooLarge(budget) => RuntimeError::bad_file(
                    path,
                    format!(
                        "decompresses to more than the {budget} bytes of memory this machine has available (a gzip bomb?)"
                    ),
                ),
                ReadFail::LongLine => RuntimeError::bad_file(
                    path,
                    format!(
                        "line {line_no}: longer than {} MiB (not a CSV file?)",
                        MAX_LINE >> 20
                    ),
                ),
            })?;
            let text = std::str::from_utf8(&block).map_err(|e| {
                let at = line_no + count_lines(&block[..e.valid_up_to()]);
                RuntimeError::bad_file(path, format!("line {at}: not UTF-8 text"))
            })?;
            if let Some(init) = init.take() {
                let first = text.split('\n').next().unwrap_or("");
                let first = first.strip_suffix('\r').unwrap_or(first);
                ctx = Some(
                    init(first)
                        .map_err(|m| RuntimeError::bad_file(path, format!("line 1: {m}")))?,
                );
            }
            let c = ctx.as_ref().expect("context set by the first block");
            // Split the block into pieces that end at line breaks.
            let bytes = text.as_bytes();
            let mut pieces = Vec::new();
            let mut start = 0;
            while start < bytes.len() {
                let mut stop = (start + PIECE).min(bytes.len());
                while stop < bytes.len() && bytes[stop - 1] != b'\n' {
                    stop += 1;
                }
                pieces.push((start, &text[start..stop]));
                start = stop;
            }
            let parsed: Vec<std::result::Result<Vec<T>, (usize, String)>> = pieces
                .par_iter()
                .map(|&(off, piece)| {
                    let mut v = Vec::new();
                    let mut pos = 0;
                    for line in piece.split_terminator('\n') {
                        let l = line.strip_suffix('\r').unwrap_or(line);
                        if l.trim().is_empty() {
                            return Err((off + pos, "empty line".to_string()));
                        }
                        per_line(c, l, &mut v).map_err(|m| (off + pos, m))?;
                        pos += line.len() + 1;
                    }
                    Ok(v)
                })
                .collect();
            for r in parsed {
                match r {
                    Ok(v) if out.is_empty() => out = v,
                    Ok(v) => {
                        // The values must fit beside the text still being inflated; growing
                        // the vector is checked, not left to abort the process.
                        let bytes = (out.len() + v.len()) as u64 * size_of::<T>() as u64;
                        if bytes > budget || out.try_reserve(v.len()).is_err() {
                            return Err(RuntimeError::bad_file(
                                path,
                                format!(
                                    "parses into more than the {budget} bytes of memory available (a gzip bomb?)"
                                ),
                            ));
                        }
                        out.extend(v)
                    }
                    Err((at, m)) => {
                        let line = line_no + count_lines(&bytes[..at]);
                        return Err(RuntimeError::bad_file(path, format!("line {line}: {m}")));
                    }
                }
            }
            line_no += count_lines(bytes);
        }
        Ok((out, ctx))
    })
}

fn count_lines(b: &[u8]) -> usize {
    b.iter().filter(|&&c| c == b'\n').count()
}
