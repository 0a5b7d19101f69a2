//! Temporary: gemm parallel strategies, interleaved, best of N.
#![allow(clippy::all)]
use rayon::prelude::*;
use std::time::Instant;
use trellis_gpu::bench::random_tensor;
use trellis_gpu::ThreadBudget;

#[derive(Clone, Copy)]
struct P(usize);
unsafe impl Send for P {}
unsafe impl Sync for P {}

unsafe fn gemm_block(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    a_rs: isize,
    a_cs: isize,
    b: *const f32,
    b_rs: isize,
    b_cs: isize,
    c: *mut f32,
    ldc: usize,
    mm: bool,
) {
    if mm {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a,
            a_rs,
            a_cs,
            b,
            b_rs,
            b_cs,
            0.0,
            c,
            ldc as isize,
            1,
        );
    } else {
        gemm::gemm(
            m,
            n,
            k,
            c,
            1,
            ldc as isize,
            false,
            a,
            a_cs,
            a_rs,
            b,
            b_cs,
            b_rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Fixed output tiles (independent of thread count), run over rayon.
fn split(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    c: &mut [f32],
    bm: usize,
    bn: usize,
    mm: bool,
) {
    let (a_rs, a_cs) = if ta {
        (1isize, m as isize)
    } else {
        (k as isize, 1isize)
    };
    let (b_rs, b_cs) = if tb {
        (1isize, k as isize)
    } else {
        (n as isize, 1isize)
    };
    let (ap, bp, cp) = (
        P(a.as_ptr() as usize),
        P(b.as_ptr() as usize),
        P(c.as_mut_ptr() as usize),
    );
    let mb = m.div_ceil(bm);
    let nb = n.div_ceil(bn);
    (0..mb * nb).into_par_iter().for_each(|t| {
        let (i, j) = (t / nb, t % nb);
        let (i0, j0) = (i * bm, j * bn);
        let (mi, nj) = (bm.min(m - i0), bn.min(n - j0));
        unsafe {
            gemm_block(
                mi,
                nj,
                k,
                (ap.0 as *const f32).offset(i0 as isize * a_rs),
                a_rs,
                a_cs,
                (bp.0 as *const f32).offset(j0 as isize * b_cs),
                b_rs,
                b_cs,
                (cp.0 as *mut f32).add(i0 * n + j0),
                n,
                mm,
            );
        }
    });
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
        .unwrap_or(2);
    let budget = ThreadBudget::new(threads).unwrap();
    let shapes = [
        (
            "fwd 100000x128 * 128x256",
            100_000usize,
            256usize,
            128usize,
            false,
            false,
        ),
        ("fwd 100000x256 * 256x16", 100_000, 16, 256, false, false),
        (
            "dgrad 100000x256 * (128x256)^T",
            100_000,
            128,
            256,
            false,
            true,
        ),
        (
            "wgrad (100000x128)^T * 100000x256",
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
        let mut c = vec![0.0f32; m * n];
        let fl = 2.0 * (m * n * k) as f64 / 1e9;
        let st = trellis_gpu::Stream::new(trellis_gpu::Device::Cpu, budget.clone()).unwrap();
        let mut ct = trellis_gpu::Tensor::zeros(m, n);
        let (bm, bn) = if m >= 4096 { (2048, n) } else { (64, 64) };
        let mut r = [f64::MAX; 4];
        for _ in 0..3 {
            r[0] = r[0].min(best(3, || {
                st.gemm(1.0, &a, ta, &b, tb, 0.0, &mut ct).unwrap()
            }));
            r[1] = r[1].min(budget.install(|| {
                best(3, || {
                    split(
                        m,
                        n,
                        k,
                        a.as_slice(),
                        ta,
                        b.as_slice(),
                        tb,
                        &mut c,
                        bm,
                        bn,
                        false,
                    )
                })
            }));
            r[2] = r[2].min(budget.install(|| {
                best(3, || {
                    split(
                        m,
                        n,
                        k,
                        a.as_slice(),
                        ta,
                        b.as_slice(),
                        tb,
                        &mut c,
                        bm,
                        bn,
                        true,
                    )
                })
            }));
        }
        println!("{name:36} t{threads}: gemm-crate Rayon {:6.1} | gemm-crate tiles {:6.1} | matrixmultiply tiles {:6.1} GFLOP/s", fl / r[0], fl / r[1], fl / r[2]);
    }
}
