//! Measurement helpers shared by `benches/kernels.rs` and the `trellis bench` command: STREAM
//! triad memory bandwidth (the machine's ceiling) and the bandwidth spmm achieves against it,
//! with the bytes counted the same way in both places.
use crate::rng::Philox4x32;
use crate::{Csr, EdgeWeights, Result, Stream, Tensor, ThreadBudget};
use rayon::prelude::*;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Timed repeats (after one untimed warm-up); the best is reported.
const REPEATS: usize = 5;

/// STREAM triad bandwidth in GB/s (1e9 bytes per second): `a[i] = b[i] + s * c[i]` over three
/// f32 arrays of `bytes / 3` bytes each, parallel over `budget`'s threads, best of a few
/// repeats. Pass `bytes` much larger than the last-level cache (e.g. 1 GiB) to measure memory
/// rather than cache. As in STREAM, 12 bytes are counted per element (two reads, one write);
/// the write-allocate read of `a` is not counted.
pub fn triad_bandwidth_gbs(bytes: usize, budget: &ThreadBudget) -> f64 {
    let n = (bytes / 12).max(1 << 12);
    budget.install(|| {
        let chunk = n.div_ceil(4 * rayon::current_num_threads()).max(1 << 12);
        // First touch in parallel, so the pages are spread as the timed loop will use them.
        let mut a = vec![0.0f32; n];
        let mut b = vec![0.0f32; n];
        let mut c = vec![0.0f32; n];
        b.par_chunks_mut(chunk)
            .zip(c.par_chunks_mut(chunk))
            .for_each(|(b, c)| {
                b.fill(1.0);
                c.fill(2.0);
            });
        let s = black_box(3.0f32);
        let mut best = Duration::MAX;
        for rep in 0..=REPEATS {
            let t = Instant::now();
            a.par_chunks_mut(chunk)
                .zip(b.par_chunks(chunk).zip(c.par_chunks(chunk)))
                .for_each(|(a, (b, c))| {
                    for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
                        *a = b + s * c;
                    }
                });
            black_box(&mut a);
            if rep > 0 {
                best = best.min(t.elapsed());
            }
        }
        assert_eq!(a[n - 1], 7.0, "triad produced a wrong value");
        (12 * n) as f64 / best.as_secs_f64() / 1e9
    })
}

/// The bytes one [`Stream::spmm`] moves at least: `indptr` (8 bytes a row + 1), `indices`
/// (4 bytes an entry), the edge weights read (4 bytes an entry and head; none for
/// [`EdgeWeights::Ones`]), one gathered `x` row per entry (`width * 4` bytes) and the output
/// written once (`n_rows * width * 4`).
pub fn spmm_bytes(csr: &Csr, weights: &EdgeWeights<'_>, width: usize) -> usize {
    let weight_values = match weights {
        EdgeWeights::Ones => 0,
        EdgeWeights::Stored => csr.nnz(),
        EdgeWeights::PerHead(_, heads) => csr.nnz() * heads,
    };
    (csr.n_rows() + 1) * std::mem::size_of::<usize>()
        + csr.nnz() * 4
        + weight_values * 4
        + csr.nnz() * width * 4
        + csr.n_rows() * width * 4
}

/// Times `out = A x` on `stream` (one untimed warm-up, then the best of a few calls) and
/// returns the achieved bandwidth in GB/s, counting [`spmm_bytes`].
pub fn spmm_gbs(stream: &Stream, csr: &Csr, weights: EdgeWeights<'_>, x: &Tensor) -> Result<f64> {
    let mut out = Tensor::zeros(csr.n_rows(), x.cols());
    let mut best = Duration::MAX;
    for rep in 0..=REPEATS.min(3) {
        let t = Instant::now();
        stream.spmm(csr, weights, x, &mut out)?;
        stream.synchronize()?;
        black_box(&mut out);
        if rep > 0 {
            best = best.min(t.elapsed());
        }
    }
    Ok(spmm_bytes(csr, &weights, x.cols()) as f64 / best.as_secs_f64() / 1e9)
}

/// A random `n_rows x n_cols` CSR for benchmarks: row degrees uniform in
/// `0..=2 * avg_degree`, columns uniform (sorted within a row, duplicates possible), and
/// stored values `1 / degree` (mean aggregation). A pure function of `seed`.
pub fn random_csr(n_rows: usize, n_cols: usize, avg_degree: usize, seed: u64) -> Result<Csr> {
    let g = Philox4x32::new(seed);
    let draw =
        |row: usize, k: usize| g.block([row as u32, (row as u64 >> 32) as u32, k as u32, 0x5eed]);
    let mut indptr = Vec::with_capacity(n_rows + 1);
    let mut indices = Vec::with_capacity(n_rows * avg_degree);
    indptr.push(0);
    for i in 0..n_rows {
        let u = draw(i, usize::MAX);
        let deg = if n_cols == 0 {
            0
        } else {
            ((u[0] as u64 * (2 * avg_degree as u64 + 1)) >> 32) as usize
        };
        let start = indices.len();
        for k in 0..deg.div_ceil(4) {
            for &v in &draw(i, k) {
                if indices.len() - start < deg {
                    indices.push(((v as u64 * n_cols as u64) >> 32) as u32);
                }
            }
        }
        indices[start..].sort_unstable();
        indptr.push(indices.len());
    }
    let values = (0..n_rows)
        .flat_map(|i| {
            let d = indptr[i + 1] - indptr[i];
            std::iter::repeat_n(1.0 / d.max(1) as f32, d)
        })
        .collect();
    Csr::new(n_rows, n_cols, indptr, indices, Some(values))
}

/// A `rows x cols` tensor of uniform values in `[-1, 1)`, a pure function of `seed`.
pub fn random_tensor(rows: usize, cols: usize, seed: u64) -> Tensor {
    let g = Philox4x32::new(seed);
    let n = rows * cols;
    let mut data = vec![0.0f32; n];
    data.par_chunks_mut(1 << 14)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (b, vals) in chunk.chunks_mut(4).enumerate() {
                let i = (c << 12) + b; // 4-value block index: (1 << 14) / 4 blocks per chunk
                let u = g.block([i as u32, (i as u64 >> 32) as u32, 0, 0x7e45]);
                for (v, &u) in vals.iter_mut().zip(&u) {
                    *v = Philox4x32::to_unit(u) * 2.0 - 1.0;
                }
            }
        });
    Tensor::from_vec(rows, cols, data).expect("length is rows * cols")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triad_and_spmm_report_positive_bandwidth() {
        let budget = ThreadBudget::new(2).unwrap();
        let gbs = triad_bandwidth_gbs(3 << 20, &budget);
        assert!(gbs.is_finite() && gbs > 0.0, "{gbs}");
        let csr = random_csr(500, 300, 6, 1).unwrap();
        let x = random_tensor(300, 16, 2);
        let stream = Stream::new(crate::Device::Cpu, budget).unwrap();
        let gbs = spmm_gbs(&stream, &csr, EdgeWeights::Stored, &x).unwrap();
        assert!(gbs.is_finite() && gbs > 0.0, "{gbs}");
    }

    #[test]
    fn random_csr_is_deterministic_and_valid() {
        let a = random_csr(1000, 700, 10, 5).unwrap();
        assert_eq!(a, random_csr(1000, 700, 10, 5).unwrap());
        assert_ne!(a, random_csr(1000, 700, 10, 6).unwrap());
        let avg = a.nnz() as f64 / 1000.0;
        assert!((avg - 10.0).abs() < 1.0, "average degree {avg}");
        for i in 0..1000 {
            assert!(a.row(i).windows(2).all(|w| w[0] <= w[1]));
        }
        assert_eq!(random_tensor(3, 5, 1), random_tensor(3, 5, 1));
        assert!(random_tensor(30, 50, 1)
            .as_slice()
            .iter()
            .all(|v| (-1.0..1.0).contains(v)));
    }

    #[test]
    fn spmm_bytes_counts_every_stream() {
        let csr = random_csr(10, 10, 3, 1).unwrap();
        let (r, e) = (10, csr.nnz());
        let w = 8;
        assert_eq!(
            spmm_bytes(&csr, &EdgeWeights::Ones, w),
            (r + 1) * 8 + e * 4 + e * w * 4 + r * w * 4
        );
        assert_eq!(
            spmm_bytes(&csr, &EdgeWeights::Stored, w),
            (r + 1) * 8 + e * 8 + e * w * 4 + r * w * 4
        );
        let hw = Tensor::zeros(e, 2);
        assert_eq!(
            spmm_bytes(&csr, &EdgeWeights::PerHead(&hw, 2), w),
            (r + 1) * 8 + e * 12 + e * w * 4 + r * w * 4
        );
    }
}
