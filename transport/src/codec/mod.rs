//! Halo codecs: lossy, versioned encodings of a halo block's rows (forward embeddings and
//! backward gradients), and their validating decoder.
//!
//! An encoded payload is self-describing (all integers little-endian):
//!
//! ```text
//! codec id u8 | format version u8 | codec-specific body
//! fp16, bf16 : rows*cols u16 (IEEE half / bfloat16 bits, round to nearest even)
//! int8, int4 : per row: min bf16, step bf16        then per row: ceil(cols*b/8) packed codes
//! adaptive   : ceil(rows/4) bytes of 2-bit width codes (row r at bits 2*(r%4); 0=2, 1=4,
//!              2=8, 3=16 bits), then per row: min bf16, step bf16, then per row its codes
//! sparse     : n u32, n row indices u32, then the n rows (raw fp32 or any codec above;
//!              `codec/sparse.rs`): only the rows that changed, for a receiver that keeps the rest
//! ```
//!
//! The block's shape (rows, cols) travels beside the payload (the halo envelope), so the
//! decoder knows exactly how long every section must be. An integer code `q` of `b` bits
//! stands for `min + q * step` (`q` in `0..=2^b-1`); codes are packed low bits first, each row
//! starts on a byte boundary, and unused padding bits are zero. [`decode`] and [`validate`]
//! refuse anything else — an unknown codec or version, a wrong length, a scale or value that is
//! not finite, non-zero padding — with a [`CodecError`], never a panic.
//!
//! Integer codecs round stochastically (`codec/quant.rs`): unbiased, with per-element variance at
//! most `step^2 / 4`. The random bits come from a [`Dither`] the caller supplies (Trellis keys
//! Philox by seed, epoch, layer and phase, with the row's global node id and the column in the
//! counter), so an encoding is a pure function of the rows and that key.
mod adaptive;
mod quant;
mod sparse;

pub use adaptive::{choose_bits, ADAPTIVE_WIDTHS};
pub use quant::Dither;
pub use sparse::{encode_sparse, overwrite_rows, SparseInner, SparseRows};

use half::{bf16, f16};
use thiserror::Error;

/// The format version this build writes and reads.
pub const CODEC_VERSION: u8 = 1;

/// A lossy halo encoding (fp32, the exact path, is no codec: its rows travel as they are).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Codec {
    /// IEEE half precision, round to nearest even; magnitudes beyond 65504 saturate.
    Fp16,
    /// bfloat16 (f32's exponent range, 8 significant bits), round to nearest even.
    Bf16,
    /// 8-bit codes with a per-row minimum (zero point) and step, stochastic rounding.
    Int8,
    /// 4-bit codes, as `Int8`.
    Int4,
    /// Per row, the fewest bits among [`ADAPTIVE_WIDTHS`] whose stochastic-rounding variance
    /// stays under `error_bound` times the row's energy (see [`choose_bits`]).
    Adaptive { error_bound: f32 },
}

/// Codec ids on the wire.
const ID_FP16: u8 = 1;
const ID_BF16: u8 = 2;
const ID_INT8: u8 = 3;
const ID_INT4: u8 = 4;
const ID_ADAPTIVE: u8 = 5;
/// A sparse-row payload (`codec/sparse.rs`): not a codec of its own, a frame around one.
const ID_SPARSE: u8 = 6;

/// Bytes of one row's header (min and step, bfloat16 each) in the integer formats.
const ROW_HEADER: usize = 4;

impl Codec {
    /// The codec's id on the wire.
    pub fn id(&self) -> u8 {
        match self {
            Codec::Fp16 => ID_FP16,
            Codec::Bf16 => ID_BF16,
            Codec::Int8 => ID_INT8,
            Codec::Int4 => ID_INT4,
            Codec::Adaptive { .. } => ID_ADAPTIVE,
        }
    }

    /// The codec's name (as the `--halo-codec` option spells it).
    pub fn name(&self) -> &'static str {
        codec_name(self.id())
    }
}

fn codec_name(id: u8) -> &'static str {
    match id {
        ID_FP16 => "fp16",
        ID_BF16 => "bf16",
        ID_INT8 => "int8",
        ID_INT4 => "int4",
        ID_ADAPTIVE => "adaptive",
        ID_SPARSE => "sparse",
        _ => "unknown",
    }
}

/// Why rows could not be encoded, or a payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CodecError {
    #[error("encoded halo payload of {0} bytes is too short for its codec id and version")]
    TooShort(usize),
    #[error("unknown halo codec id {0}")]
    UnknownCodec(u8),
    #[error("halo codec {codec} format version {got} is not supported (this build reads {CODEC_VERSION})")]
    Version { codec: &'static str, got: u8 },
    #[error("halo codec {codec}: {rows}x{cols} rows need {need} bytes, the payload has {have}")]
    Length {
        codec: &'static str,
        rows: usize,
        cols: usize,
        need: usize,
        have: usize,
    },
    #[error("halo codec {codec}: row {row} has a {what} that is not finite or negative")]
    BadScale {
        codec: &'static str,
        row: usize,
        what: &'static str,
    },
    #[error("halo codec {codec}: value {col} of row {row} is not finite")]
    BadValue {
        codec: &'static str,
        row: usize,
        col: usize,
    },
    #[error("halo codec {codec}: non-zero padding bits in {section}")]
    Padding {
        codec: &'static str,
        section: &'static str,
    },
    #[error(
        "halo row {row}, column {col} is not finite ({value}); codec {codec} cannot encode it"
    )]
    NonFinite {
        codec: &'static str,
        row: usize,
        col: usize,
        /// The value as text (`NaN`, `inf`, ...).
        value: String,
    },
    #[error("{values} decoded values do not fit a buffer of {room}")]
    Output { values: usize, room: usize },
    #[error("halo row {row} spans a range too wide for codec {codec}'s scales")]
    Range { codec: &'static str, row: usize },
    #[error("sparse halo payload: row index {row} at position {at} is not ascending or not below the block's {rows} rows")]
    SparseIndex { at: usize, row: u32, rows: usize },
    #[error("sparse halo payload inside a sparse payload")]
    NestedSparse,
    #[error("a sparse-row halo payload holds only the rows that changed: decode it with decode_sparse into the receiver's copy")]
    Sparse,
    #[error("{rows}x{cols} rows do not match {len} values")]
    Shape {
        rows: usize,
        cols: usize,
        len: usize,
    },
}

/// Encodes `rows x cols` values (row-major `data`) with `codec`; integer codecs draw their
/// rounding bits from `dither`. Refuses values that are not finite.
pub fn encode(
    codec: Codec,
    rows: usize,
    cols: usize,
    data: &[f32],
    dither: &impl Dither,
) -> Result<Vec<u8>, CodecError> {
    if rows.checked_mul(cols) != Some(data.len()) {
        return Err(CodecError::Shape {
            rows,
            cols,
            len: data.len(),
        });
    }
    if let Some(at) = data.iter().position(|x| !x.is_finite()) {
        return Err(CodecError::NonFinite {
            codec: codec.name(),
            row: at / cols.max(1),
            col: at % cols.max(1),
            value: data[at].to_string(),
        });
    }
    let mut out = vec![codec.id(), CODEC_VERSION];
    match codec {
        Codec::Fp16 => {
            out.reserve(data.len() * 2);
            for &x in data {
                let h = f16::from_f32(x.clamp(-f16::MAX.to_f32(), f16::MAX.to_f32()));
                out.extend_from_slice(&h.to_bits().to_le_bytes());
            }
        }
        Codec::Bf16 => {
            out.reserve(data.len() * 2);
            for &x in data {
                out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        Codec::Int8 | Codec::Int4 => {
            let bits = if codec == Codec::Int8 { 8 } else { 4 };
            quant::encode_rows(&mut out, data, cols, |_| bits, dither, codec.name())?;
        }
        Codec::Adaptive { error_bound } => {
            let widths: Vec<u32> = data
                .chunks(cols.max(1))
                .take(rows)
                .map(|row| choose_bits(row, error_bound))
                .collect();
            let mut codes = vec![0u8; rows.div_ceil(4)];
            for (r, &b) in widths.iter().enumerate() {
                codes[r / 4] |= adaptive::width_code(b) << (2 * (r % 4));
            }
            out.extend_from_slice(&codes);
            quant::encode_rows(&mut out, data, cols, |r| widths[r], dither, codec.name())?;
        }
    }
    Ok(out)
}

/// The widths (bits per value) of the rows of a payload, after its id and version.
enum Widths<'a> {
    /// 16-bit floats, no row headers.
    Float(fn(u16) -> f32),
    /// Every row has the same number of bits.
    Fixed(u32),
    /// Per row, from packed 2-bit codes.
    PerRow(&'a [u8]),
}

impl Widths<'_> {
    fn of_row(&self, r: usize) -> u32 {
        match self {
            Widths::Float(_) => 16,
            Widths::Fixed(b) => *b,
            Widths::PerRow(codes) => {
                ADAPTIVE_WIDTHS[((codes[r / 4] >> (2 * (r % 4))) & 3) as usize]
            }
        }
    }
}

/// A payload whose framing (id, version, length, widths) has been checked.
struct Parsed<'a> {
    codec: &'static str,
    widths: Widths<'a>,
    /// Row headers (integer formats), `rows * ROW_HEADER` bytes.
    headers: &'a [u8],
    /// Values: 16-bit floats, or each row's packed codes.
    body: &'a [u8],
}

fn parse(bytes: &[u8], rows: usize, cols: usize) -> Result<Parsed<'_>, CodecError> {
    let [id, version, rest @ ..] = bytes else {
        return Err(CodecError::TooShort(bytes.len()));
    };
    let codec = codec_name(*id);
    if !(ID_FP16..=ID_ADAPTIVE).contains(id) {
        return Err(CodecError::UnknownCodec(*id));
    }
    if *version != CODEC_VERSION {
        return Err(CodecError::Version {
            codec,
            got: *version,
        });
    }
    let length = |need: Option<usize>| -> Result<(), CodecError> {
        match need {
            Some(n) if n == rest.len() => Ok(()),
            n => Err(CodecError::Length {
                codec,
                rows,
                cols,
                need: n.map_or(usize::MAX, |n| n + 2),
                have: bytes.len(),
            }),
        }
    };
    let (widths, rest) = match *id {
        ID_FP16 | ID_BF16 => {
            length(rows.checked_mul(cols).and_then(|n| n.checked_mul(2)))?;
            let f: fn(u16) -> f32 = if *id == ID_FP16 {
                |b| f16::from_bits(b).to_f32()
            } else {
                |b| bf16::from_bits(b).to_f32()
            };
            return Ok(Parsed {
                codec,
                widths: Widths::Float(f),
                headers: &[],
                body: rest,
            });
        }
        ID_INT8 => (Widths::Fixed(8), rest),
        ID_INT4 => (Widths::Fixed(4), rest),
        _ => {
            let n = rows.div_ceil(4);
            if rest.len() < n {
                length(None)?;
            }
            let (codes, rest) = rest.split_at(n);
            if !rows.is_multiple_of(4) && codes[n - 1] >> (2 * (rows % 4)) != 0 {
                return Err(CodecError::Padding {
                    codec,
                    section: "the row width codes",
                });
            }
            (Widths::PerRow(codes), rest)
        }
    };
    let mut need = rows.checked_mul(ROW_HEADER);
    for r in 0..rows {
        let row = quant::row_bytes(cols, widths.of_row(r));
        need = need.and_then(|n| row.and_then(|b| n.checked_add(b)));
    }
    let offset = bytes.len() - rest.len();
    match need {
        Some(n) if n == rest.len() => {}
        n => {
            return Err(CodecError::Length {
                codec,
                rows,
                cols,
                need: n.map_or(usize::MAX, |n| n + offset),
                have: bytes.len(),
            })
        }
    }
    let (headers, body) = rest.split_at(rows * ROW_HEADER);
    Ok(Parsed {
        codec,
        widths,
        headers,
        body,
    })
}

/// Checks an encoded payload of `rows x cols` values completely, without decoding it
/// (a sparse-row payload with its inner rows).
pub fn validate(bytes: &[u8], rows: usize, cols: usize) -> Result<(), CodecError> {
    if is_sparse(bytes) {
        return decode_sparse(bytes, rows, cols).map(|_| ());
    }
    walk(bytes, rows, cols, None)
}

/// Whether `bytes` is a dense payload whose rows all take the same bytes (fp16, bf16, int8,
/// int4): one whose rows [`merge_sparse`] can replace in place.
pub fn is_fixed_width(bytes: &[u8]) -> bool {
    matches!(
        bytes.first(),
        Some(&(ID_FP16 | ID_BF16 | ID_INT8 | ID_INT4))
    )
}

/// Whether `bytes` is a sparse-row payload (only the rows that changed).
pub fn is_sparse(bytes: &[u8]) -> bool {
    bytes.first() == Some(&ID_SPARSE)
}

/// Decodes (and checks) a sparse-row payload of a `rows x cols` block: the indices of the
/// rows it carries and their values.
pub fn decode_sparse(bytes: &[u8], rows: usize, cols: usize) -> Result<SparseRows, CodecError> {
    if !is_sparse(bytes) {
        return Err(CodecError::UnknownCodec(
            bytes.first().copied().unwrap_or(0),
        ));
    }
    let (index, inner) = sparse::split(bytes, rows)?;
    let values = if inner.first() == Some(&sparse::ID_RAW) {
        sparse::decode_raw(inner, index.len(), cols)?
    } else {
        decode(inner, index.len(), cols)?
    };
    Ok(SparseRows { index, values })
}

/// Decodes (and checks) an encoded payload of `rows x cols` values, row-major. A sparse-row
/// payload is refused ([`CodecError::Sparse`]): it needs the receiver's copy of the block.
pub fn decode(bytes: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>, CodecError> {
    if is_sparse(bytes) {
        return Err(CodecError::Sparse);
    }
    // The framing first: the length check bounds `rows * cols` by the payload's size.
    parse(bytes, rows, cols)?;
    let mut out = vec![0.0f32; rows * cols];
    decode_into(bytes, rows, cols, &mut out, &|r| r)?;
    Ok(out)
}

/// As [`decode`], into the caller's buffer `out` (`cols` wide), payload row `r` at row
/// `place(r)` (no buffer of its own: a receiver decodes a block straight into its places
/// among the halo rows); a place past the end of `out` is [`CodecError::Output`].
pub fn decode_into(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    place: &dyn Fn(usize) -> usize,
) -> Result<(), CodecError> {
    if is_sparse(bytes) {
        return Err(CodecError::Sparse);
    }
    walk(bytes, rows, cols, Some(Placed { out, place }))
}

/// Copies `rows` rows of `cols` values (raw fp32 rows, `values`) into `out`, row `r` at row
/// `place(r)`, as [`decode_into`] places decoded ones; a place past the end of `out`, or
/// `values` of another length, is [`CodecError::Output`].
pub fn place_rows(
    values: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    place: &dyn Fn(usize) -> usize,
) -> Result<(), CodecError> {
    if values.len() != rows * cols {
        return Err(CodecError::Output {
            values: values.len(),
            room: rows * cols,
        });
    }
    let mut placed = Placed { out, place };
    for (r, src) in values.chunks_exact(cols.max(1)).take(rows).enumerate() {
        placed.row(r, cols)?.copy_from_slice(src);
    }
    Ok(())
}

/// Where [`walk`] writes decoded rows: into `out`, `cols` wide, row `r` of the payload at row
/// `place(r)`.
struct Placed<'a> {
    out: &'a mut [f32],
    place: &'a dyn Fn(usize) -> usize,
}

impl Placed<'_> {
    /// The `cols` values of payload row `r` in `out`; a place past its end is an error.
    fn row(&mut self, r: usize, cols: usize) -> Result<&mut [f32], CodecError> {
        let room = self.out.len();
        let at = (self.place)(r).saturating_mul(cols);
        self.out
            .get_mut(at..at.saturating_add(cols))
            .ok_or(CodecError::Output {
                values: at.saturating_add(cols),
                room,
            })
    }
}

/// Checks every value after the payload's framing and, given `out`, decodes them into it;
/// fails on the first scale, value, padding or place that is not allowed.
fn walk(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    mut out: Option<Placed<'_>>,
) -> Result<(), CodecError> {
    let p = parse(bytes, rows, cols)?;
    if let Widths::Float(f) = p.widths {
        for (r, row) in p.body.chunks_exact(2 * cols.max(1)).take(rows).enumerate() {
            let mut dst = match out.as_mut() {
                Some(o) => Some(o.row(r, cols)?),
                None => None,
            };
            for (c, b) in row.chunks_exact(2).enumerate() {
                let x = f(u16::from_le_bytes([b[0], b[1]]));
                if !x.is_finite() {
                    return Err(CodecError::BadValue {
                        codec: p.codec,
                        row: r,
                        col: c,
                    });
                }
                if let Some(d) = dst.as_deref_mut() {
                    d[c] = x;
                }
            }
        }
        return Ok(());
    }
    let mut body = p.body;
    for r in 0..rows {
        let h = &p.headers[r * ROW_HEADER..(r + 1) * ROW_HEADER];
        let min = bf16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f32();
        let step = bf16::from_bits(u16::from_le_bytes([h[2], h[3]])).to_f32();
        let bits = p.widths.of_row(r);
        let top = min + step * quant::levels(bits) as f32;
        let bad = |what| CodecError::BadScale {
            codec: p.codec,
            row: r,
            what,
        };
        if !min.is_finite() {
            return Err(bad("minimum"));
        }
        if !(step.is_finite() && step >= 0.0 && top.is_finite()) {
            return Err(bad("step"));
        }
        let n = quant::row_bytes(cols, bits).expect("checked by parse");
        let (row, rest) = body.split_at(n);
        body = rest;
        match out.as_mut() {
            Some(o) => quant::dequant_row(row, cols, bits, min, step, o.row(r, cols)?),
            None => quant::unpack_row(row, cols, bits, |_, _| {}),
        }
        .map_err(|()| CodecError::Padding {
            codec: p.codec,
            section: "a row of codes",
        })?;
    }
    Ok(())
}

/// `base` (a dense payload of `rows x cols` values) with the rows a sparse-row payload
/// carries put in place of its own, still encoded: `Some` when both hold their rows in the
/// same fixed-width format (fp16, bf16, int8, int4), so that a row is a byte range of its own
/// (and, in the integer formats, its header); `None` otherwise (adaptive widths, raw fp32
/// rows), where the caller merges decoded values. Decoding the result gives, bit for bit, the
/// values of decoding `base` and overwriting the changed rows with the sparse payload's:
/// every row decodes on its own. The sparse payload is checked completely first, `base`
/// for its framing (its values are checked when it is decoded).
///
/// A receiver that keeps a block's rows between epochs (`--skip-threshold`) keeps them this
/// way: in the width they travelled in (an int4 row of 256 values is 132 bytes, its fp32
/// values 1,024), which is also what its replicas and checkpoints carry. A sparse payload of
/// no rows (nothing changed enough to be resent: most blocks of most epochs) gives `base`
/// itself, borrowed, so that callers keep the buffer they hold instead of a copy of it.
pub fn merge_sparse<'a>(
    base: &'a [u8],
    rows: usize,
    cols: usize,
    sparse: &[u8],
) -> Result<Option<std::borrow::Cow<'a, [u8]>>, CodecError> {
    if !is_sparse(sparse) {
        return Err(CodecError::UnknownCodec(
            sparse.first().copied().unwrap_or(0),
        ));
    }
    let (index, inner) = sparse::split(sparse, rows)?;
    if is_sparse(base) {
        return Err(CodecError::Sparse);
    }
    let (Some(&id), Some(&inner_id)) = (base.first(), inner.first()) else {
        return Err(CodecError::TooShort(base.len().min(inner.len())));
    };
    if id != inner_id || !is_fixed_width(base) {
        return Ok(None);
    }
    // The rows that arrive are checked completely (values, scales, padding), as the decoders
    // check them; the held block only for its framing: it was checked when it arrived, and
    // is decoded (and so checked again) wherever it is used, so a full pass over it here on
    // every merge would only repeat that work.
    validate(inner, index.len(), cols)?;
    let (to, from) = (parse(base, rows, cols)?, parse(inner, index.len(), cols)?);
    if index.is_empty() {
        return Ok(Some(std::borrow::Cow::Borrowed(base)));
    }
    let row_len = to.body.len() / rows.max(1);
    let headers_at = base.len() - to.body.len() - to.headers.len();
    let body_at = base.len() - to.body.len();
    let mut out = base.to_vec();
    for (k, &r) in index.iter().enumerate() {
        let r = r as usize;
        let h = ROW_HEADER * usize::from(!to.headers.is_empty());
        out[headers_at + r * h..headers_at + (r + 1) * h]
            .copy_from_slice(&from.headers[k * h..(k + 1) * h]);
        out[body_at + r * row_len..body_at + (r + 1) * row_len]
            .copy_from_slice(&from.body[k * row_len..(k + 1) * row_len]);
    }
    Ok(Some(std::borrow::Cow::Owned(out)))
}

/// The longest payload any codec writes for `rows x cols` values (a decoder's bound before it
/// reads a body), or `None` on overflow: a sparse-row payload of every row in raw fp32, or
/// of every row in the widest codec, whichever is longer.
pub fn max_encoded_len(rows: usize, cols: usize) -> Option<usize> {
    let per_row = quant::row_bytes(cols, 16)?.checked_add(ROW_HEADER)?;
    let widest = rows
        .checked_mul(per_row)?
        .checked_add(rows.div_ceil(4))?
        .checked_add(2)?;
    let raw = rows.checked_mul(cols)?.checked_mul(4)?.checked_add(2)?;
    widest
        .max(raw)
        .checked_add(rows.checked_mul(4)?.checked_add(6)?)
}

#[cfg(test)]
mod tests;
