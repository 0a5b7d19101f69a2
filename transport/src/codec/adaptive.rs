//! The adaptive codec's choice of bits per row (the AdaQP idea, per row instead of per
//! message).
//!
//! Stochastic rounding onto a grid of step `s` adds, to each value, independent noise of
//! variance `s^2 f (1 - f) <= s^2 / 4` (`f` the value's fractional position between two grid
//! points). A row of `d` values in a range `r` coded with `b` bits has `s ~ r / (2^b - 1)`,
//! so its total noise variance is at most `d r^2 / (4 (2^b - 1)^2)`: every two more bits
//! divide it by about 16. The adaptive codec gives each row the fewest bits among
//! [`ADAPTIVE_WIDTHS`] for which this bound, computed with the row's actual grid (bfloat16
//! minimum and step, see `quant::grid`), is at most `E` times the row's energy `sum x^2`: the
//! expected squared error relative to the row's squared norm stays under `E` (the
//! `--halo-error-bound`). The bound is relative, so it means the same for embeddings and for
//! gradients (which are orders of magnitude smaller). A row the widest width cannot satisfy
//! gets that width.
use super::quant::{grid, levels, range};

/// The widths the adaptive codec chooses from, by their 2-bit code.
pub const ADAPTIVE_WIDTHS: [u32; 4] = [2, 4, 8, 16];

/// The 2-bit code of width `bits` (one of [`ADAPTIVE_WIDTHS`]).
pub(crate) fn width_code(bits: u32) -> u8 {
    ADAPTIVE_WIDTHS
        .iter()
        .position(|&b| b == bits)
        .expect("an adaptive width") as u8
}

/// The bits the adaptive codec gives `row` (finite values) under the relative variance bound
/// `error_bound`.
pub fn choose_bits(row: &[f32], error_bound: f32) -> u32 {
    if row.is_empty() {
        return ADAPTIVE_WIDTHS[0];
    }
    let (min, max) = range(row);
    let energy: f64 = row.iter().map(|&x| x as f64 * x as f64).sum();
    let budget = error_bound as f64 * energy;
    for bits in ADAPTIVE_WIDTHS {
        let (lo, step) = grid(min, max, bits);
        let top = lo.to_f64() + step.to_f64() * levels(bits) as f64;
        let var = row.len() as f64 * step.to_f64() * step.to_f64() / 4.0;
        if var <= budget && top.is_finite() {
            return bits;
        }
    }
    ADAPTIVE_WIDTHS[3]
}
