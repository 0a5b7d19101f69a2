//! Sparse-row payloads (`--skip-threshold`): only the rows of a block that changed since the
//! sender last sent them, with their row indices; the receiver overwrites those rows of its
//! copy of the block and keeps the others.
//!
//! ```text
//! 6 | format version u8 | n u32 | n row indices u32 (strictly ascending, below the block's rows)
//!   | the n rows: a raw fp32 section (0 | format version | n*cols f32) or any codec's payload
//! ```
use super::{CodecError, CODEC_VERSION, ID_SPARSE};

/// Codec id of the raw fp32 section inside a sparse payload (never a payload of its own).
pub(super) const ID_RAW: u8 = 0;

/// The changed rows of a sparse payload.
pub enum SparseInner<'a> {
    /// The rows as fp32 values (`index.len() * cols`).
    F32(&'a [f32]),
    /// The rows encoded by a halo codec (a complete payload of `index.len()` rows).
    Encoded(&'a [u8]),
}

/// The decoded changed rows of a sparse payload.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseRows {
    /// Row indices within the block, strictly ascending.
    pub index: Vec<u32>,
    /// `index.len() * cols` values, row-major.
    pub values: Vec<f32>,
}

impl SparseRows {
    /// Overwrites the rows it carries in `block` (a receiver's copy of the block, row-major,
    /// rows of `cols` values), leaving the others.
    pub fn overwrite(&self, block: &mut [f32], cols: usize) {
        overwrite_rows(block, cols, &self.index, &self.values);
    }
}

/// Overwrites rows `index` of `block` (rows of `cols` values) with the rows of `values`, in
/// order.
pub fn overwrite_rows(block: &mut [f32], cols: usize, index: &[u32], values: &[f32]) {
    for (k, &r) in index.iter().enumerate() {
        let r = r as usize;
        block[r * cols..(r + 1) * cols].copy_from_slice(&values[k * cols..(k + 1) * cols]);
    }
}

/// A sparse payload of block rows `index` (strictly ascending, below `rows`).
pub fn encode_sparse(
    rows: usize,
    index: &[u32],
    inner: SparseInner<'_>,
) -> Result<Vec<u8>, CodecError> {
    check_index(index, rows)?;
    let mut out = vec![ID_SPARSE, CODEC_VERSION];
    out.extend_from_slice(&(index.len() as u32).to_le_bytes());
    for &r in index {
        out.extend_from_slice(&r.to_le_bytes());
    }
    match inner {
        SparseInner::F32(values) => {
            if let Some(at) = values.iter().position(|x| !x.is_finite()) {
                return Err(CodecError::NonFinite {
                    codec: "sparse",
                    row: at,
                    col: 0,
                    value: values[at].to_string(),
                });
            }
            out.extend_from_slice(&[ID_RAW, CODEC_VERSION]);
            for x in values {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        SparseInner::Encoded(bytes) => out.extend_from_slice(bytes),
    }
    Ok(out)
}

fn check_index(index: &[u32], rows: usize) -> Result<(), CodecError> {
    for (k, &r) in index.iter().enumerate() {
        if r as usize >= rows || (k > 0 && index[k - 1] >= r) {
            return Err(CodecError::SparseIndex {
                at: k,
                row: r,
                rows,
            });
        }
    }
    Ok(())
}

/// Splits a sparse payload of a `rows`-row block into its row indices and its inner section,
/// checking the framing of both but not the inner values.
pub(super) fn split(bytes: &[u8], rows: usize) -> Result<(Vec<u32>, &[u8]), CodecError> {
    let [_, version, rest @ ..] = bytes else {
        return Err(CodecError::TooShort(bytes.len()));
    };
    if *version != CODEC_VERSION {
        return Err(CodecError::Version {
            codec: "sparse",
            got: *version,
        });
    }
    let short = || CodecError::Length {
        codec: "sparse",
        rows,
        cols: 0,
        need: usize::MAX,
        have: bytes.len(),
    };
    let (n, rest) = rest.split_first_chunk::<4>().ok_or_else(short)?;
    let n = u32::from_le_bytes(*n) as usize;
    if n > rows {
        return Err(CodecError::SparseIndex {
            at: n,
            row: n as u32,
            rows,
        });
    }
    if rest.len() < 4 * n {
        return Err(short());
    }
    let (idx, inner) = rest.split_at(4 * n);
    let index: Vec<u32> = idx
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    check_index(&index, rows)?;
    match inner.first() {
        Some(&ID_SPARSE) => Err(CodecError::NestedSparse),
        None => Err(CodecError::TooShort(bytes.len())),
        _ => Ok((index, inner)),
    }
}

/// Decodes a raw fp32 section of `n * cols` values.
pub(super) fn decode_raw(inner: &[u8], n: usize, cols: usize) -> Result<Vec<f32>, CodecError> {
    let [_, version, body @ ..] = inner else {
        return Err(CodecError::TooShort(inner.len()));
    };
    if *version != CODEC_VERSION {
        return Err(CodecError::Version {
            codec: "sparse",
            got: *version,
        });
    }
    let need = n.checked_mul(cols).and_then(|v| v.checked_mul(4));
    if need != Some(body.len()) {
        return Err(CodecError::Length {
            codec: "sparse",
            rows: n,
            cols,
            need: need.map_or(usize::MAX, |v| v + 2),
            have: inner.len(),
        });
    }
    body.chunks_exact(4)
        .enumerate()
        .map(|(i, b)| {
            let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if x.is_finite() {
                Ok(x)
            } else {
                Err(CodecError::BadValue {
                    codec: "sparse",
                    row: i / cols.max(1),
                    col: i % cols.max(1),
                })
            }
        })
        .collect()
}
