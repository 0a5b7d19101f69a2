//! Temporary A/B timing harness (old vs new kernels), interleaved, best of N.
#![allow(clippy::all)]
use rayon::prelude::*;
use std::time::Instant;
use trellis_gpu::bench::{random_csr, random_tensor};
use trellis_gpu::{Csr, ThreadBudget};

fn row_chunk(rows: usize, cols: usize) -> usize {
    let per_row = cols.max(1);
    (16_384 / per_row).clamp(1, rows.max(1))
}

mod old {
    use super::*;
    /// `out[i, h*d..(h+1)*d] = sum_e w[e, h] * x[col(e), h*d..(h+1)*d]` over the entries `e` of row
    /// `i`. `x` is `n_cols x width`, `out` is `n_rows x width`, `width = heads * d`. Without weights
    /// every entry weighs 1 (and `heads` only splits the width).
    pub fn spmm(
        csr: &Csr,
        weights: Option<&[f32]>,
        heads: usize,
        x: &[f32],
        width: usize,
        out: &mut [f32],
    ) {
        assert!(
            heads >= 1 && width % heads == 0,
            "spmm: width {width} not divisible by {heads} heads"
        );
        assert_eq!(
            x.len(),
            csr.n_cols() * width,
            "spmm: x has the wrong length"
        );
        assert_eq!(
            out.len(),
            csr.n_rows() * width,
            "spmm: out has the wrong length"
        );
        if let Some(w) = weights {
            assert_eq!(
                w.len(),
                csr.nnz() * heads,
                "spmm: weights have the wrong length"
            );
        }
        if width == 0 {
            return;
        }
        let d = width / heads;
        let indptr = csr.indptr();
        let indices = csr.indices();
        let chunk = row_chunk(csr.n_rows(), width);
        out.par_chunks_mut(chunk * width)
            .enumerate()
            .for_each(|(c, block)| {
                for (r, orow) in block.chunks_mut(width).enumerate() {
                    let i = c * chunk + r;
                    orow.iter_mut().for_each(|v| *v = 0.0);
                    for e in indptr[i]..indptr[i + 1] {
                        let j = indices[e] as usize;
                        let xrow = &x[j * width..(j + 1) * width];
                        match weights {
                            None => orow.iter_mut().zip(xrow).for_each(|(o, &v)| *o += v),
                            Some(w) if heads == 1 => {
                                let we = w[e];
                                orow.iter_mut().zip(xrow).for_each(|(o, &v)| *o += we * v);
                            }
                            Some(w) => {
                                for h in 0..heads {
                                    let we = w[e * heads + h];
                                    let o = &mut orow[h * d..(h + 1) * d];
                                    o.iter_mut()
                                        .zip(&xrow[h * d..(h + 1) * d])
                                        .for_each(|(o, &v)| *o += we * v);
                                }
                            }
                        }
                    }
                }
            });
    }

    /// Sampled dense-dense product: `out[e, h] = <a[row(e), h-block], b[col(e), h-block]>`.
    /// `a` is `n_rows x width`, `b` is `n_cols x width`, `out` has `nnz * heads` entries.
    pub fn sddmm_dot(csr: &Csr, heads: usize, a: &[f32], b: &[f32], width: usize, out: &mut [f32]) {
        assert!(
            heads >= 1 && width % heads == 0,
            "sddmm: width not divisible by heads"
        );
        assert_eq!(
            a.len(),
            csr.n_rows() * width,
            "sddmm: a has the wrong length"
        );
        assert_eq!(
            b.len(),
            csr.n_cols() * width,
            "sddmm: b has the wrong length"
        );
        assert_eq!(
            out.len(),
            csr.nnz() * heads,
            "sddmm: out has the wrong length"
        );
        let d = width / heads;
        let indptr = csr.indptr();
        let indices = csr.indices();
        for_each_row_edges(csr, heads, out, |i, e0, seg| {
            let arow = &a[i * width..(i + 1) * width];
            for (k, e) in (indptr[i]..indptr[i + 1]).enumerate() {
                let j = indices[e] as usize;
                let brow = &b[j * width..(j + 1) * width];
                for h in 0..heads {
                    let s = h * d..(h + 1) * d;
                    seg[k * heads + h] = arow[s.clone()]
                        .iter()
                        .zip(&brow[s])
                        .map(|(x, y)| x * y)
                        .sum();
                }
            }
            let _ = e0;
        });
    }

    /// Runs `f(row, first_entry, out_segment)` for every row in parallel, where `out_segment` is
    /// the row's `degree * heads` slice of a per-entry output.
    fn for_each_row_edges(
        csr: &Csr,
        heads: usize,
        out: &mut [f32],
        f: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) {
        let indptr = csr.indptr();
        // Split `out` into per-row segments, then process blocks of rows in parallel.
        let mut segs: Vec<&mut [f32]> = Vec::with_capacity(csr.n_rows());
        let mut rest = out;
        for i in 0..csr.n_rows() {
            let (s, r) = rest.split_at_mut((indptr[i + 1] - indptr[i]) * heads);
            segs.push(s);
            rest = r;
        }
        let chunk = row_chunk(csr.n_rows(), 8 * heads);
        segs.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, block)| {
                for (r, seg) in block.iter_mut().enumerate() {
                    let i = c * chunk + r;
                    f(i, indptr[i], seg);
                }
            });
    }

    /// `out[idx[r]] += src[r]` for every r, in ascending r for each target row (deterministic).
    /// Parallel over column blocks, so any thread count gives the same bits.
    pub fn scatter_add_rows(src: &[f32], width: usize, idx: &[u32], out: &mut [f32]) {
        assert_eq!(
            src.len(),
            idx.len() * width,
            "scatter_add_rows: src has the wrong length"
        );
        if width == 0 {
            return;
        }
        let rows = out.len() / width;
        assert!(
            idx.iter().all(|&i| (i as usize) < rows),
            "scatter_add_rows: index out of range"
        );
        const BLOCK: usize = 64;
        let nblocks = width.div_ceil(BLOCK);
        if nblocks == 1 || idx.len() * width < 1 << 16 {
            for (r, &t) in idx.iter().enumerate() {
                let t = t as usize;
                out[t * width..(t + 1) * width]
                    .iter_mut()
                    .zip(&src[r * width..(r + 1) * width])
                    .for_each(|(o, &v)| *o += v);
            }
            return;
        }
        // Each column block is owned by one task; wrap the pointer so tasks can share it.
        struct Out(*mut f32);
        // SAFETY: tasks write disjoint column ranges of `out`, see below.
        unsafe impl Sync for Out {}
        let base = Out(out.as_mut_ptr());
        (0..nblocks).into_par_iter().for_each(|b| {
            let lo = b * BLOCK;
            let hi = (lo + BLOCK).min(width);
            let base = &base;
            for (r, &t) in idx.iter().enumerate() {
                let t = t as usize;
                for c in lo..hi {
                    // SAFETY: `t < rows` was checked above, so `t * width + c` is in bounds, and
                    // column `c` belongs to this task's block only: no two tasks touch one element.
                    unsafe { *base.0.add(t * width + c) += src[r * width + c] };
                }
            }
        });
    }

    pub fn column_sums(g: &[f32], width: usize, out: &mut [f32]) {
        const BLOCK: usize = 16;
        out.par_chunks_mut(BLOCK).enumerate().for_each(|(b, o)| {
            let lo = b * BLOCK;
            let hi = lo + o.len();
            o.iter_mut().for_each(|v| *v = 0.0);
            for row in g.chunks(width) {
                o.iter_mut().zip(&row[lo..hi]).for_each(|(v, &x)| *v += x);
            }
        });
    }
}

fn best(n: usize, mut f: impl FnMut()) -> f64 {
    let mut b = f64::MAX;
    for _ in 0..n {
        let t = Instant::now();
        f();
        b = b.min(t.elapsed().as_secs_f64());
    }
    b
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1);
    let which = std::env::args().nth(2).unwrap_or_default();
    let budget = ThreadBudget::new(threads).unwrap();
    let rows: usize = std::env::var("AB_ROWS")
        .ok()
        .map(|v| v.parse().unwrap())
        .unwrap_or(200_000);
    let deg: usize = std::env::var("AB_DEG")
        .ok()
        .map(|v| v.parse().unwrap())
        .unwrap_or(20);
    let csr: Csr = random_csr(rows, rows, deg, 7).unwrap();
    let reps = 5;
    for &width in &[128usize, 16] {
        let x = random_tensor(rows, width, 4);
        let mut o1 = vec![0.0f32; rows * width];
        let mut o2 = vec![0.0f32; rows * width];
        let heads = 8;
        let hw = random_tensor(1, csr.nnz() * heads, 3).into_vec();
        let cases: Vec<(&str, Option<&[f32]>, usize)> = vec![
            ("ones", None, 1),
            ("stored", csr.values(), 1),
            ("heads8", Some(&hw), heads),
        ];
        for (name, w, h) in cases {
            if !which.is_empty() && !"spmm".contains(which.as_str()) {
                break;
            }
            let mut to = f64::MAX;
            let mut tn = f64::MAX;
            for _ in 0..2 {
                to = to.min(budget.install(|| {
                    best(reps, || old::spmm(&csr, w, h, x.as_slice(), width, &mut o1))
                }));
                tn = tn.min(budget.install(|| {
                    best(reps, || {
                        trellis_gpu::cpu::spmm(&csr, w, h, x.as_slice(), width, &mut o2)
                    })
                }));
            }
            assert!(
                o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "spmm bits differ"
            );
            println!(
                "spmm w{width} {name:7} t{threads}: old {:7.1} ms  new {:7.1} ms  x{:.2}",
                to * 1e3,
                tn * 1e3,
                to / tn
            );
        }
    }
    if which.is_empty() || which == "sddmm" {
        let width = 128;
        let heads = 8;
        let a = random_tensor(rows, width, 5);
        let b = random_tensor(rows, width, 6);
        let mut o1 = vec![0.0f32; csr.nnz() * heads];
        let mut o2 = vec![0.0f32; csr.nnz() * heads];
        let mut to = f64::MAX;
        let mut tn = f64::MAX;
        for _ in 0..2 {
            to = to.min(budget.install(|| {
                best(3, || {
                    old::sddmm_dot(&csr, heads, a.as_slice(), b.as_slice(), width, &mut o1)
                })
            }));
            tn = tn.min(budget.install(|| {
                best(3, || {
                    trellis_gpu::cpu::sddmm_dot(
                        &csr,
                        heads,
                        a.as_slice(),
                        b.as_slice(),
                        width,
                        &mut o2,
                    )
                })
            }));
        }
        let maxdiff = o1
            .iter()
            .zip(&o2)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("sddmm_dot w128 h8 t{threads}: old {:7.1} ms  new {:7.1} ms  x{:.2} (max diff {maxdiff:e})", to * 1e3, tn * 1e3, to / tn);
    }
    if which.is_empty() || which == "rows" {
        let width = 128;
        let x = random_tensor(rows, width, 8);
        let g0 = trellis_gpu::Philox4x32::new(9);
        let idx: Vec<u32> = (0..rows as u32)
            .map(|i| ((g0.block([i, 0, 0, 0])[0] as u64 * rows as u64) >> 32) as u32)
            .collect();
        let mut o1 = vec![0.0f32; rows * width];
        let mut o2 = vec![0.0f32; rows * width];
        let mut to = f64::MAX;
        let mut tn = f64::MAX;
        for _ in 0..2 {
            to = to.min(budget.install(|| {
                best(reps, || {
                    old::scatter_add_rows(x.as_slice(), width, &idx, &mut o1)
                })
            }));
            tn = tn.min(budget.install(|| {
                best(reps, || {
                    trellis_gpu::cpu::scatter_add_rows(x.as_slice(), width, &idx, &mut o2)
                })
            }));
        }
        assert!(
            o1.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()),
            "scatter bits differ"
        );
        println!(
            "scatter_add w128 t{threads}: old {:7.1} ms  new {:7.1} ms  x{:.2}",
            to * 1e3,
            tn * 1e3,
            to / tn
        );
        let tg = budget.install(|| {
            best(reps, || {
                trellis_gpu::cpu::gather_rows(x.as_slice(), width, &idx, &mut o2)
            })
        });
        let tga = budget.install(|| {
            best(reps, || {
                let mut o = vec![0.0f32; rows * width];
                trellis_gpu::cpu::gather_rows(x.as_slice(), width, &idx, &mut o);
                std::hint::black_box(&o);
            })
        });
        println!("gather w128 t{threads}: into existing {:7.1} ms ({:.1} GB/s), with fresh output {:7.1} ms", tg * 1e3, (rows * 4 + 2 * rows * width * 4) as f64 / tg / 1e9, tga * 1e3);
        let mut s1 = vec![0.0f32; width];
        let mut s2 = vec![0.0f32; width];
        let mut to = f64::MAX;
        let mut tn = f64::MAX;
        for _ in 0..2 {
            to = to.min(
                budget.install(|| best(reps, || old::column_sums(x.as_slice(), width, &mut s1))),
            );
            tn = tn.min(budget.install(|| {
                best(reps, || {
                    trellis_gpu::cpu::column_sums(x.as_slice(), width, &mut s2)
                })
            }));
        }
        println!(
            "column_sums 200k x128 t{threads}: old {:7.1} ms  new {:7.1} ms  x{:.2}",
            to * 1e3,
            tn * 1e3,
            to / tn
        );
    }
}
