//! Integer halo codes: a row's grid (minimum rounded down and step rounded up to bfloat16, so
//! the grid covers the row), stochastic rounding onto it, and bit packing.
//!
//! A value `x` of a row with grid `(min, step)` is `t = (x - min) / step` steps above the
//! minimum; it is coded as `q = floor(t + u)` with `u` uniform in `[0, 1)`, so `q` is
//! `ceil(t)` with probability `frac(t)` and `floor(t)` otherwise: `E[min + q step] = x`
//! (unbiased, up to f32 rounding of the decoded value) and
//! `Var = step^2 frac(t) (1 - frac(t)) <= step^2 / 4`.
use super::CodecError;
use half::bf16;

/// Uniform random bits for stochastic rounding.
pub trait Dither {
    /// Fills `out` (one entry per column) with uniform u32 draws for row `row` of the block.
    /// The draws must depend only on what identifies the value (Trellis: the run's seed,
    /// epoch, layer, phase, the row's global node id and the column), never on timing.
    fn fill(&self, row: usize, out: &mut [u32]);
}

/// The largest code of `bits` bits.
pub(crate) fn levels(bits: u32) -> u32 {
    (1u32 << bits) - 1
}

/// Bytes of one row of `cols` codes of `bits` bits (byte-aligned), `None` on overflow.
pub(crate) fn row_bytes(cols: usize, bits: u32) -> Option<usize> {
    Some(cols.checked_mul(bits as usize)?.div_ceil(8))
}

/// `x` rounded towards minus infinity to a bfloat16.
pub(crate) fn bf16_down(x: f32) -> bf16 {
    let bits = x.to_bits();
    let (hi, lo) = ((bits >> 16) as u16, bits & 0xffff);
    if lo == 0 || x >= 0.0 {
        // Truncation rounds a non-negative value down.
        bf16::from_bits(hi)
    } else {
        // A negative value's magnitude grows by one unit in the last place.
        bf16::from_bits(hi + 1)
    }
}

/// The non-negative `x` rounded towards plus infinity to a bfloat16.
pub(crate) fn bf16_up(x: f64) -> bf16 {
    let mut s = x as f32;
    if (s as f64) < x {
        s = f32::from_bits(s.to_bits() + 1);
    }
    let bits = s.to_bits();
    let (hi, lo) = ((bits >> 16) as u16, bits & 0xffff);
    bf16::from_bits(if lo == 0 { hi } else { hi + 1 })
}

/// The grid of a row whose values lie in `[min, max]` with `bits`-bit codes: `(min', step)`
/// with `min' <= min` and `min' + step (2^bits - 1) >= max`, both bfloat16.
pub(crate) fn grid(min: f32, max: f32, bits: u32) -> (bf16, bf16) {
    let lo = bf16_down(min);
    let span = max as f64 - lo.to_f64();
    (lo, bf16_up(span / levels(bits) as f64))
}

/// The smallest and largest value of a non-empty row.
pub(crate) fn range(row: &[f32]) -> (f32, f32) {
    row.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// Appends every row's header, then every row's codes, of the finite values `data`
/// (`cols` per row), row `r` with `bits(r)` bits.
pub(crate) fn encode_rows(
    out: &mut Vec<u8>,
    data: &[f32],
    cols: usize,
    bits: impl Fn(usize) -> u32,
    dither: &impl Dither,
    codec: &'static str,
) -> Result<(), CodecError> {
    let rows = data.len().checked_div(cols).unwrap_or(0);
    let mut grids = Vec::with_capacity(rows);
    for (r, row) in data.chunks(cols.max(1)).take(rows).enumerate() {
        let (min, max) = range(row);
        let (lo, step) = grid(min, max, bits(r));
        let top = lo.to_f32() + step.to_f32() * levels(bits(r)) as f32;
        if !step.to_f32().is_finite() || !top.is_finite() {
            return Err(CodecError::Range { codec, row: r });
        }
        out.extend_from_slice(&lo.to_bits().to_le_bytes());
        out.extend_from_slice(&step.to_bits().to_le_bytes());
        grids.push((lo.to_f64(), step.to_f64()));
    }
    let mut draws = vec![0u32; cols];
    for (r, row) in data.chunks(cols.max(1)).take(rows).enumerate() {
        let b = bits(r);
        let (lo, step) = grids[r];
        // Multiplying by the reciprocal is not division, but the same on every machine.
        let inv = if step == 0.0 { 0.0 } else { 1.0 / step };
        let top = levels(b);
        dither.fill(r, &mut draws);
        let start = out.len();
        out.resize(
            start + row_bytes(cols, b).expect("fits: the values are in memory"),
            0,
        );
        let dst = &mut out[start..];
        // Stochastic rounding: floor(t + u) with u uniform in [0, 1). For t + u >= 0 the
        // truncating cast is that floor; below 0 (and for NaN) it saturates to 0, as
        // `floor().max(0.0)` would: the same code for every input, without a call to libm's
        // `floor` per value (baseline x86-64 has no rounding instruction).
        let code = |x: f32, u: u32| {
            let t = (x as f64 - lo) * inv;
            let u = (u >> 8) as f64 * (1.0 / 16_777_216.0);
            ((t + u) as u32).min(top)
        };
        match b {
            // Two codes a byte, low nibble first (as `put_code` packs them).
            4 => {
                for ((xs, us), d) in row.chunks(2).zip(draws.chunks(2)).zip(dst.iter_mut()) {
                    let mut byte = code(xs[0], us[0]);
                    if let (Some(&x), Some(&u)) = (xs.get(1), us.get(1)) {
                        byte |= code(x, u) << 4;
                    }
                    *d = byte as u8;
                }
            }
            8 => {
                for ((&x, &u), d) in row.iter().zip(&draws).zip(dst.iter_mut()) {
                    *d = code(x, u) as u8;
                }
            }
            _ => {
                for (c, (&x, &u)) in row.iter().zip(&draws).enumerate() {
                    put_code(dst, c, b, code(x, u));
                }
            }
        }
    }
    Ok(())
}

/// Decodes one packed row of `bits`-bit codes into `dst` (`cols` values: `min + code *
/// step`); `Err` when the padding bits after the last code are not zero. The 8- and 4-bit
/// rows are unpacked a byte at a time, the others through [`unpack_row`]; the values are the
/// same either way.
pub(crate) fn dequant_row(
    row: &[u8],
    cols: usize,
    bits: u32,
    min: f32,
    step: f32,
    dst: &mut [f32],
) -> Result<(), ()> {
    let value = |q: u8| min + q as f32 * step;
    match bits {
        8 => {
            for (d, &b) in dst.iter_mut().zip(row) {
                *d = value(b);
            }
            Ok(())
        }
        4 => {
            for (pair, &b) in dst.chunks_mut(2).zip(row) {
                pair[0] = value(b & 15);
                if let Some(hi) = pair.get_mut(1) {
                    *hi = value(b >> 4);
                }
            }
            if cols % 2 == 1 && row.last().is_some_and(|b| b >> 4 != 0) {
                return Err(());
            }
            Ok(())
        }
        _ => unpack_row(row, cols, bits, |c, q| dst[c] = min + q as f32 * step),
    }
}

/// Writes code `q` of column `c` into a zeroed row of `bits`-bit codes.
fn put_code(row: &mut [u8], c: usize, bits: u32, q: u32) {
    match bits {
        16 => row[2 * c..2 * c + 2].copy_from_slice(&(q as u16).to_le_bytes()),
        8 => row[c] = q as u8,
        _ => {
            let at = c * bits as usize;
            row[at / 8] |= (q as u8) << (at % 8);
        }
    }
}

/// Calls `put(column, code)` for each of the `cols` codes of a packed row; `Err` when the
/// padding bits after the last code are not zero.
pub(crate) fn unpack_row(
    row: &[u8],
    cols: usize,
    bits: u32,
    mut put: impl FnMut(usize, u32),
) -> Result<(), ()> {
    match bits {
        16 => {
            for (c, b) in row.chunks_exact(2).enumerate() {
                put(c, u16::from_le_bytes([b[0], b[1]]) as u32);
            }
        }
        8 => row.iter().enumerate().for_each(|(c, &b)| put(c, b as u32)),
        _ => {
            let mask = levels(bits) as u8;
            for c in 0..cols {
                let at = c * bits as usize;
                put(c, ((row[at / 8] >> (at % 8)) & mask) as u32);
            }
            let used = (cols * bits as usize) % 8;
            if used != 0 && row[row.len() - 1] >> used != 0 {
                return Err(());
            }
        }
    }
    Ok(())
}
