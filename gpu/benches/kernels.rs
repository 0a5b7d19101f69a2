//! Kernel benchmarks at GNN training shapes.
//!
//! `cargo bench -p trellis-gpu --bench kernels` (add a filter such as `gemm` or `spmm`).
//!
//! - gemm: the `gemm` crate (what `Stream::gemm` uses) against `matrixmultiply` side by side, for
//!   1 thread and for every CPU, reported in elements/s = FLOP/s (2 m n k per call).
//!   `matrixmultiply` runs single-threaded per call; its multi-thread variant splits the output
//!   into one block per thread on the same rayon budget, so both use the same threads.
//! - spmm on a random 200k x 200k CSR of average degree 20 at widths 128 and 16, reported in
//!   GB/s with the bytes of `trellis_gpu::bench::spmm_bytes`; gather/scatter rows and SDDMM.
//!
//! STREAM triad bandwidth is printed first, as the ceiling for the memory-bound kernels.
use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Duration;
use trellis_gpu::bench::{random_csr, random_tensor, spmm_bytes, spmm_gbs, triad_bandwidth_gbs};
use trellis_gpu::{Device, EdgeWeights, Stream, Tensor, ThreadBudget};

fn all_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Thread counts to measure: 1 and every CPU (once if they are the same).
fn thread_counts() -> Vec<usize> {
    let mut t = vec![1, all_cpus()];
    t.dedup();
    t
}

fn stream(threads: usize) -> Stream {
    Stream::new(Device::Cpu, ThreadBudget::new(threads).unwrap()).unwrap()
}

/// `c = op(a) op(b)` through `matrixmultiply::sgemm`, the output split into one block of rows
/// (or of columns, when it has more columns than rows) per thread of `budget`.
#[allow(clippy::too_many_arguments)]
fn mm_sgemm(
    budget: &ThreadBudget,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    c: &mut [f32],
) {
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    let parts = budget.threads();
    let (ap, bp, cp) = (
        a.as_ptr() as usize,
        b.as_ptr() as usize,
        c.as_mut_ptr() as usize,
    );
    let block = |lo: usize, hi: usize, by_rows: bool| {
        // SAFETY: every block addresses a disjoint part of `c` and in-bounds parts of `a`, `b`.
        unsafe {
            let (a0, b0, c0, mb, nb) = if by_rows {
                (
                    (ap as *const f32).offset(lo as isize * rsa),
                    bp as *const f32,
                    (cp as *mut f32).add(lo * n),
                    hi - lo,
                    n,
                )
            } else {
                (
                    ap as *const f32,
                    (bp as *const f32).offset(lo as isize * csb),
                    (cp as *mut f32).add(lo),
                    m,
                    hi - lo,
                )
            };
            matrixmultiply::sgemm(
                mb, k, nb, 1.0, a0, rsa, csa, b0, rsb, csb, 0.0, c0, n as isize, 1,
            );
        }
    };
    if parts == 1 {
        block(0, m, true);
        return;
    }
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let step = len.div_ceil(parts).next_multiple_of(16);
    budget.install(|| {
        (0..len.div_ceil(step))
            .into_par_iter()
            .for_each(|p| block(p * step, ((p + 1) * step).min(len), by_rows));
    });
}

fn bench_gemm(cr: &mut Criterion) {
    // (name, m, n, k, trans_a, trans_b): forward X W, its data gradient dY W^T, and the
    // weight gradient X^T dY, for a 100k-node batch.
    let shapes = [
        ("fwd_100000x128_128x256", 100_000, 256, 128, false, false),
        ("fwd_100000x256_256x16", 100_000, 16, 256, false, false),
        (
            "dgrad_100000x256_(128x256)T",
            100_000,
            128,
            256,
            false,
            true,
        ),
        (
            "wgrad_(100000x128)T_100000x256",
            128,
            256,
            100_000,
            true,
            false,
        ),
    ];
    for (name, m, n, k, ta, tb) in shapes {
        let a = if ta {
            random_tensor(k, m, 1)
        } else {
            random_tensor(m, k, 1)
        };
        let b = if tb {
            random_tensor(n, k, 2)
        } else {
            random_tensor(k, n, 2)
        };
        let mut c = Tensor::zeros(m, n);
        let mut g = cr.benchmark_group(format!("gemm/{name}"));
        g.sampling_mode(SamplingMode::Flat);
        g.throughput(Throughput::Elements(2 * (m * n * k) as u64));
        for threads in thread_counts() {
            let st = stream(threads);
            g.bench_function(
                BenchmarkId::new("gemm-crate", format!("t{threads}")),
                |bch| bch.iter(|| st.gemm(1.0, &a, ta, &b, tb, 0.0, &mut c).unwrap()),
            );
            g.bench_function(
                BenchmarkId::new("matrixmultiply", format!("t{threads}")),
                |bch| {
                    bch.iter(|| {
                        mm_sgemm(
                            st.budget(),
                            m,
                            n,
                            k,
                            a.as_slice(),
                            ta,
                            b.as_slice(),
                            tb,
                            c.as_mut_slice(),
                        )
                    })
                },
            );
        }
        g.finish();
        black_box(&c);
    }
}

fn bench_sparse(cr: &mut Criterion) {
    let (rows, deg) = (200_000, 20);
    let csr = random_csr(rows, rows, deg, 7).unwrap();
    let heads = 8;
    let head_w = random_tensor(csr.nnz(), heads, 3);
    // The ceiling first: memory bandwidth, then spmm through the same helper the CLI uses.
    for threads in thread_counts() {
        let budget = ThreadBudget::new(threads).unwrap();
        let triad = triad_bandwidth_gbs(1 << 30, &budget);
        let x = random_tensor(rows, 128, 4);
        let spmm = spmm_gbs(&stream(threads), &csr, EdgeWeights::Stored, &x).unwrap();
        println!("threads {threads}: STREAM triad {triad:.1} GB/s, spmm (width 128, stored) {spmm:.1} GB/s");
    }
    for width in [128usize, 16] {
        let x = random_tensor(rows, width, 4);
        let mut out = Tensor::zeros(rows, width);
        let mut g = cr.benchmark_group(format!("spmm/200k_deg20_w{width}"));
        g.sampling_mode(SamplingMode::Flat);
        let mut cases = vec![("ones", EdgeWeights::Ones), ("stored", EdgeWeights::Stored)];
        if width % heads == 0 {
            cases.push(("heads8", EdgeWeights::PerHead(&head_w, heads)));
        }
        for (wname, w) in cases {
            g.throughput(Throughput::BytesDecimal(spmm_bytes(&csr, &w, width) as u64));
            for threads in thread_counts() {
                let st = stream(threads);
                g.bench_function(BenchmarkId::new(wname, format!("t{threads}")), |bch| {
                    bch.iter(|| st.spmm(&csr, w, &x, &mut out).unwrap())
                });
            }
        }
        g.finish();
    }

    // SDDMM (per-edge dot products, 8 heads of 16) and edge softmax over the same graph.
    let width = 128;
    let a = random_tensor(rows, width, 5);
    let x = random_tensor(rows, width, 6);
    let mut g = cr.benchmark_group("sddmm/200k_deg20_w128_h8");
    g.sampling_mode(SamplingMode::Flat);
    let bytes = (rows + 1) * 8
        + csr.nnz() * 4
        + rows * width * 4
        + csr.nnz() * width * 4
        + csr.nnz() * heads * 4;
    g.throughput(Throughput::BytesDecimal(bytes as u64));
    for threads in thread_counts() {
        let st = stream(threads);
        g.bench_function(BenchmarkId::new("dot", format!("t{threads}")), |bch| {
            bch.iter(|| black_box(st.sddmm_dot(&csr, heads, &a, &x).unwrap()))
        });
    }
    g.throughput(Throughput::BytesDecimal(
        ((rows + 1) * 8 + csr.nnz() * heads * 8) as u64,
    ));
    for threads in thread_counts() {
        let st = stream(threads);
        g.bench_function(
            BenchmarkId::new("edge_softmax", format!("t{threads}")),
            |bch| bch.iter(|| black_box(st.edge_softmax(&csr, heads, &head_w).unwrap())),
        );
    }
    g.finish();
}

fn bench_gather_scatter(cr: &mut Criterion) {
    let (rows, width) = (200_000, 128);
    let x = random_tensor(rows, width, 8);
    let g0 = trellis_gpu::Philox4x32::new(9);
    let idx: Vec<u32> = (0..rows as u32)
        .map(|i| ((g0.block([i, 0, 0, 0])[0] as u64 * rows as u64) >> 32) as u32)
        .collect();
    let mut g = cr.benchmark_group(format!("rows/200k_w{width}"));
    g.sampling_mode(SamplingMode::Flat);
    // gather: index + row read + row written; scatter-add: index + source row + target read/write.
    g.throughput(Throughput::BytesDecimal(
        (rows * 4 + 2 * rows * width * 4) as u64,
    ));
    for threads in thread_counts() {
        let st = stream(threads);
        g.bench_function(BenchmarkId::new("gather", format!("t{threads}")), |bch| {
            bch.iter(|| black_box(st.gather_rows(&x, &idx).unwrap()))
        });
        // The kernel alone, into a reused buffer: `Stream::gather_rows` returns a fresh tensor
        // whose first-touch page faults cost more than the copy itself.
        let mut out = vec![0.0f32; rows * width];
        g.bench_function(
            BenchmarkId::new("gather_into", format!("t{threads}")),
            |bch| {
                bch.iter(|| {
                    st.budget().install(|| {
                        trellis_gpu::cpu::gather_rows(x.as_slice(), width, &idx, &mut out)
                    })
                })
            },
        );
    }
    g.throughput(Throughput::BytesDecimal(
        (rows * 4 + 3 * rows * width * 4) as u64,
    ));
    let mut out = Tensor::zeros(rows, width);
    for threads in thread_counts() {
        let st = stream(threads);
        g.bench_function(
            BenchmarkId::new("scatter_add", format!("t{threads}")),
            |bch| bch.iter(|| st.scatter_add_rows(&x, &idx, &mut out).unwrap()),
        );
    }
    g.throughput(Throughput::BytesDecimal((rows * width * 4) as u64));
    let mut sums = Tensor::zeros(1, width);
    for threads in thread_counts() {
        let st = stream(threads);
        g.bench_function(
            BenchmarkId::new("column_sums", format!("t{threads}")),
            |bch| bch.iter(|| st.add_column_sums(&x, &mut sums).unwrap()),
        );
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .without_plots()
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_gemm, bench_sparse, bench_gather_scatter
}
criterion_main!(benches);
