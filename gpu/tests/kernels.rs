//! Every CPU kernel, through the public `Stream` API, against a naive reference written here
//! (f64 accumulation where the kernel sums), on random inputs with awkward sizes; plus the
//! determinism contract: row-parallel kernels give the same bits for 1, 2 and 4 threads, and
//! gemm gives the same bits call after call at a fixed thread count.
use std::sync::OnceLock;
use trellis_gpu::{
    digest_bytes, Activation, AdamConfig, Bits, Csr, Device, DropoutKey, EdgeWeights, Philox4x32,
    SgdConfig, Stream, Tensor, ThreadBudget,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Awkward widths: around SIMD and block boundaries.
const WIDTHS: [usize; 11] = [1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 257];

/// A tiny deterministic generator over Philox (counter mode).
struct Rng {
    g: Philox4x32,
    ctr: u32,
    buf: [u32; 4],
    pos: usize,
}

impl Rng {
    fn new(seed: u64) -> Self {
        Rng {
            g: Philox4x32::new(seed),
            ctr: 0,
            buf: [0; 4],
            pos: 4,
        }
    }
    fn next_u32(&mut self) -> u32 {
        if self.pos == 4 {
            self.buf = self.g.block([self.ctr, 0x7e57, 0, 0]);
            self.ctr += 1;
            self.pos = 0;
        }
        self.pos += 1;
        self.buf[self.pos - 1]
    }
    /// Uniform in `[lo, hi)`.
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * Philox4x32::to_unit(self.next_u32())
    }
    /// Uniform integer in `[0, n)`.
    fn below(&mut self, n: usize) -> usize {
        ((self.next_u32() as u64 * n as u64) >> 32) as usize
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    fn tensor(&mut self, rows: usize, cols: usize) -> Tensor {
        Tensor::from_vec(rows, cols, self.vec(rows * cols, -1.0, 1.0)).unwrap()
    }
    fn indices(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(below) as u32).collect()
    }
    /// Operands `a`, `b` of `op(a) (m x k) * op(b) (k x n)`, stored transposed where `ta`, `tb`.
    fn gemm_operands(
        &mut self,
        m: usize,
        n: usize,
        k: usize,
        ta: bool,
        tb: bool,
    ) -> (Tensor, Tensor) {
        let a = if ta {
            self.tensor(k, m)
        } else {
            self.tensor(m, k)
        };
        let b = if tb {
            self.tensor(n, k)
        } else {
            self.tensor(k, n)
        };
        (a, b)
    }
}

fn stream_with(threads: usize) -> Stream {
    Stream::new(Device::Cpu, ThreadBudget::new(threads).unwrap()).unwrap()
}

/// One stream per thread count, built once for the whole test binary.
fn streams() -> &'static [Stream; 3] {
    static S: OnceLock<[Stream; 3]> = OnceLock::new();
    S.get_or_init(|| [stream_with(1), stream_with(2), stream_with(4)])
}

/// The default stream for correctness tests (2 threads, so the parallel paths run).
fn s() -> &'static Stream {
    &streams()[1]
}

/// A random `rows x cols` CSR with: every 5th row (and row 0) empty, the last column never
/// referenced (a node with no edges), duplicate entries possible, and per-entry values.
fn random_csr(rng: &mut Rng, rows: usize, cols: usize, max_deg: usize) -> Csr {
    let used_cols = if cols > 1 { cols - 1 } else { cols };
    let mut pairs = Vec::new();
    for i in 0..rows {
        if i % 5 == 0 || used_cols == 0 {
            continue;
        }
        let deg = 1 + rng.below(max_deg);
        for _ in 0..deg {
            pairs.push((i as u32, rng.below(used_cols) as u32));
        }
    }
    let mut csr = Csr::from_pairs(rows, cols, &pairs).unwrap();
    let vals = rng.vec(csr.nnz(), -1.0, 1.0);
    csr.set_values(Some(vals)).unwrap();
    csr
}

/// `|got - want| <= rel * mag + abs` elementwise, where `mag` bounds the summed magnitudes.
#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= rel * m + abs,
            "{what}: element {i}: got {g}, want {w} (err {err:e}, mag {m})"
        );
    }
}

#[track_caller]
fn assert_close_plain(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let mag: Vec<f64> = want.iter().map(|w| w.abs()).collect();
    assert_close(what, got, want, &mag, tol, tol);
}

#[track_caller]
fn assert_bits_eq(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
}

fn key(seed: u64) -> DropoutKey {
    DropoutKey {
        seed,
        epoch: 3,
        layer: 1,
        site: 0,
    }
}

// ---------------------------------------------------------------------------------------------
// gemm
// ---------------------------------------------------------------------------------------------

/// `(alpha * op(a) op(b) + beta * c, magnitude)` in f64.
#[allow(clippy::too_many_arguments)]
fn ref_gemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    beta: f32,
    c: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] } as f64;
    let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] } as f64;
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut sm) = (0.0, 0.0);
            for p in 0..k {
                s += at(i, p) * bt(p, j);
                sm += (at(i, p) * bt(p, j)).abs();
            }
            let cij = if beta == 0.0 {
                0.0
            } else {
                beta as f64 * c[i * n + j] as f64
            };
            out[i * n + j] = alpha as f64 * s + cij;
            mag[i * n + j] = (alpha as f64).abs() * sm + cij.abs();
        }
    }
    (out, mag)
}

/// Per-entry values (`heads` per entry, entry-major) as the `nnz x heads` tensor ops take.
fn entries(v: &[f32], heads: usize) -> Tensor {
    Tensor::from_vec(v.len() / heads, heads, v.to_vec()).unwrap()
}

#[test]
fn gemm_all_transposes_alpha_beta() {
    let mut rng = Rng::new(1);
    let shapes = [
        (1, 1, 1),
        (7, 9, 8),
        (1, 257, 7),
        (33, 31, 65),
        (65, 1, 33),
        (9, 64, 257),
        (66, 63, 64), // 266k multiply-adds: above the parallel threshold
        (4, 5, 0),    // k = 0: c = beta * c
        (0, 5, 3),
    ];
    let coefs = [(1.0f32, 0.0f32), (0.5, -1.5), (-2.0, 1.0), (0.0, 0.25)];
    for &(m, n, k) in &shapes {
        for ta in [false, true] {
            for tb in [false, true] {
                let (a, b) = rng.gemm_operands(m, n, k, ta, tb);
                for &(alpha, beta) in &coefs {
                    let mut c = rng.tensor(m, n);
                    if beta == 0.0 {
                        // BLAS semantics: with beta = 0, c is not read (NaN must not leak).
                        c.fill(f32::NAN);
                    }
                    let c0 = c.as_slice().to_vec();
                    s().gemm(alpha, &a, ta, &b, tb, beta, &mut c).unwrap();
                    let (want, mag) = ref_gemm(
                        m,
                        n,
                        k,
                        alpha,
                        a.as_slice(),
                        ta,
                        b.as_slice(),
                        tb,
                        beta,
                        &c0,
                    );
                    let what =
                        format!("gemm {m}x{n}x{k} ta={ta} tb={tb} alpha={alpha} beta={beta}");
                    assert_close(&what, c.as_slice(), &want, &mag, 3e-5, 1e-6);
                }
            }
        }
    }
}

#[test]
fn matmul_and_gemm_shape_errors() {
    let mut rng = Rng::new(2);
    let a = rng.tensor(5, 3);
    let b = rng.tensor(5, 4);
    // a^T b: 3x4.
    let c = s().matmul(&a, true, &b, false).unwrap();
    assert_eq!(c.shape(), (3, 4));
    let (want, mag) = ref_gemm(
        3,
        4,
        5,
        1.0,
        a.as_slice(),
        true,
        b.as_slice(),
        false,
        0.0,
        &[0.0; 12],
    );
    assert_close("matmul", c.as_slice(), &want, &mag, 3e-5, 1e-6);
    assert!(s().matmul(&a, false, &b, false).is_err());
    let mut bad = Tensor::zeros(3, 5);
    assert!(s().gemm(1.0, &a, true, &b, false, 0.0, &mut bad).is_err());
}

#[test]
fn gemm_prefix_and_add_rows_prefix() {
    let mut rng = Rng::new(4);
    // a: 40 stored rows, of which the first 27 take part.
    let a = rng.tensor(40, 9);
    let b = rng.tensor(9, 5);
    let bt = rng.tensor(27, 5);
    let (want, mag) = ref_gemm(
        27,
        5,
        9,
        1.0,
        &a.as_slice()[..27 * 9],
        false,
        b.as_slice(),
        false,
        0.0,
        &[0.0; 27 * 5],
    );
    let mut c = Tensor::zeros(27, 5);
    s().gemm_prefix(1.0, &a, 27, false, &b, false, 0.0, &mut c)
        .unwrap();
    assert_close("gemm_prefix", c.as_slice(), &want, &mag, 3e-5, 1e-6);
    // Transposed prefix: (a[..27])^T bt = 9x5.
    let mut c = rng.tensor(9, 5);
    let c0 = c.as_slice().to_vec();
    s().gemm_prefix(0.5, &a, 27, true, &bt, false, 2.0, &mut c)
        .unwrap();
    let (want, mag) = ref_gemm(
        9,
        5,
        27,
        0.5,
        &a.as_slice()[..27 * 9],
        true,
        bt.as_slice(),
        false,
        2.0,
        &c0,
    );
    assert_close(
        "gemm_prefix transposed",
        c.as_slice(),
        &want,
        &mag,
        3e-5,
        1e-6,
    );
    assert!(s()
        .gemm_prefix(
            1.0,
            &a,
            41,
            false,
            &b,
            false,
            0.0,
            &mut Tensor::zeros(41, 5)
        )
        .is_err());

    let src = rng.tensor(6, 9);
    let mut dst = rng.tensor(10, 9);
    let want: Vec<f32> = (0..90)
        .map(|i| {
            if i < 54 {
                dst.as_slice()[i] + src.as_slice()[i]
            } else {
                dst.as_slice()[i]
            }
        })
        .collect();
    s().add_rows_prefix(&src, &mut dst).unwrap();
    assert_bits_eq("add_rows_prefix", dst.as_slice(), &want);
    assert!(s().add_rows_prefix(&rng.tensor(11, 9), &mut dst).is_err());
    assert!(s().add_rows_prefix(&rng.tensor(2, 8), &mut dst).is_err());
}

#[test]
fn gemm_repeatable_at_fixed_thread_count() {
    let mut rng = Rng::new(3);
    let (m, n, k) = (96, 80, 72); // above the parallel threshold
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let (a, b) = rng.gemm_operands(m, n, k, ta, tb);
        let c0 = rng.tensor(m, n);
        for st in streams() {
            let run = || {
                let mut c = c0.clone();
                st.gemm(0.75, &a, ta, &b, tb, 0.5, &mut c).unwrap();
                c
            };
            let first = run();
            for _ in 0..3 {
                assert_bits_eq("gemm repeat", run().as_slice(), first.as_slice());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// spmm
// ---------------------------------------------------------------------------------------------

/// Reference `A x` with `heads` weights per entry (or ones), plus magnitudes.
fn ref_spmm(
    csr: &Csr,
    w: Option<(&[f32], usize)>,
    x: &[f32],
    width: usize,
) -> (Vec<f64>, Vec<f64>) {
    let heads = w.map_or(1, |w| w.1);
    let d = width / heads;
    let mut out = vec![0.0; csr.n_rows() * width];
    let mut mag = vec![0.0; csr.n_rows() * width];
    for i in 0..csr.n_rows() {
        for e in csr.indptr()[i]..csr.indptr()[i + 1] {
            let j = csr.indices()[e] as usize;
            for c in 0..width {
                let we = w.map_or(1.0, |(w, h)| w[e * h + c / d] as f64);
                let v = we * x[j * width + c] as f64;
                out[i * width + c] += v;
                mag[i * width + c] += v.abs();
            }
        }
    }
    (out, mag)
}

#[test]
fn spmm_ones_and_stored_all_widths_rectangular() {
    let mut rng = Rng::new(10);
    for &(rows, cols) in &[(37usize, 23usize), (12, 40), (1, 1), (0, 5), (6, 1)] {
        let csr = random_csr(&mut rng, rows, cols, 7);
        if cols > 1 {
            assert!(
                csr.indices().iter().all(|&c| c as usize != cols - 1),
                "a column without edges"
            );
        }
        for &width in &WIDTHS {
            let x = rng.tensor(cols, width);
            for stored in [false, true] {
                let mut out = Tensor::zeros(rows, width);
                out.fill(f32::NAN); // spmm overwrites
                let w = if stored {
                    EdgeWeights::Stored
                } else {
                    EdgeWeights::Ones
                };
                s().spmm(&csr, w, &x, &mut out).unwrap();
                let (want, mag) = ref_spmm(
                    &csr,
                    stored.then(|| (csr.values().unwrap(), 1)),
                    x.as_slice(),
                    width,
                );
                let what = format!("spmm {rows}x{cols} width {width} stored={stored}");
                assert_close(&what, out.as_slice(), &want, &mag, 1e-5, 1e-6);
                // Empty rows are exactly zero.
                for i in (0..rows).step_by(5) {
                    assert!(
                        out.row(i).iter().all(|&v| v == 0.0),
                        "{what}: empty row {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn spmm_per_head() {
    let mut rng = Rng::new(11);
    let csr = random_csr(&mut rng, 29, 41, 9);
    for heads in [1usize, 2, 8] {
        for d in [1usize, 2, 4, 7, 8, 9, 16, 32, 33, 64, 65] {
            let width = heads * d;
            let x = rng.tensor(41, width);
            let w = rng.vec(csr.nnz() * heads, -1.0, 1.0);
            let mut out = Tensor::zeros(29, width);
            let wt = entries(&w, heads);
            s().spmm(&csr, EdgeWeights::PerHead(&wt, heads), &x, &mut out)
                .unwrap();
            let (want, mag) = ref_spmm(&csr, Some((&w, heads)), x.as_slice(), width);
            assert_close(
                &format!("spmm heads {heads} d {d}"),
                out.as_slice(),
                &want,
                &mag,
                1e-5,
                1e-6,
            );
        }
    }
}

/// The documented summation: each output element from 0, in CSR order, `acc += w * x` in f32.
#[test]
fn spmm_bits_follow_csr_order() {
    let mut rng = Rng::new(13);
    let csr = random_csr(&mut rng, 40, 30, 12);
    for (heads, d) in [
        (1usize, 1usize),
        (1, 33),
        (1, 130),
        (2, 8),
        (4, 16),
        (8, 2),
        (3, 7),
        (2, 64),
        (2, 70),
    ] {
        let width = heads * d;
        let x = rng.tensor(30, width);
        let w = rng.vec(csr.nnz() * heads, -1.0, 1.0);
        let wt = entries(&w, heads);
        let cases = [
            (EdgeWeights::Ones, None),
            (EdgeWeights::Stored, Some((csr.values().unwrap(), 1))),
            (EdgeWeights::PerHead(&wt, heads), Some((&w[..], heads))),
        ];
        for (ew, wref) in cases {
            if heads > 1 && wref.is_some_and(|(_, h)| h == 1) {
                continue;
            }
            let mut out = Tensor::zeros(40, width);
            s().spmm(&csr, ew, &x, &mut out).unwrap();
            let mut want = vec![0.0f32; 40 * width];
            for i in 0..40 {
                for e in csr.indptr()[i]..csr.indptr()[i + 1] {
                    let j = csr.indices()[e] as usize;
                    for c in 0..width {
                        let v = x.row(j)[c];
                        match wref {
                            None => want[i * width + c] += v,
                            Some((w, h)) => want[i * width + c] += w[e * h + c / (width / h)] * v,
                        }
                    }
                }
            }
            assert_bits_eq(
                &format!("spmm order heads {heads} d {d} {ew:?}"),
                out.as_slice(),
                &want,
            );
        }
    }
}

#[test]
fn spmm_shape_errors() {
    let mut rng = Rng::new(12);
    let mut csr = random_csr(&mut rng, 6, 4, 3);
    let x = rng.tensor(4, 8);
    let mut out = Tensor::zeros(6, 8);
    assert!(s()
        .spmm(&csr, EdgeWeights::Ones, &rng.tensor(5, 8), &mut out)
        .is_err());
    assert!(s()
        .spmm(&csr, EdgeWeights::Ones, &x, &mut Tensor::zeros(6, 7))
        .is_err());
    let w = vec![1.0; csr.nnz() * 3];
    let (w3, w2) = (entries(&w, 3), Tensor::zeros(csr.nnz() + 1, 2));
    assert!(
        s().spmm(&csr, EdgeWeights::PerHead(&w3, 3), &x, &mut out)
            .is_err(),
        "8 % 3 != 0"
    );
    assert!(s()
        .spmm(&csr, EdgeWeights::PerHead(&w2, 2), &x, &mut out)
        .is_err());
    csr.set_values(None).unwrap();
    assert!(s().spmm(&csr, EdgeWeights::Stored, &x, &mut out).is_err());
}

// ---------------------------------------------------------------------------------------------
// SDDMM
// ---------------------------------------------------------------------------------------------

#[test]
fn sddmm_dot_all_widths_and_heads() {
    let mut rng = Rng::new(20);
    let csr = random_csr(&mut rng, 23, 31, 6);
    let mut cases: Vec<(usize, usize)> = WIDTHS.iter().map(|&w| (w, 1)).collect();
    cases.extend([
        (2, 2),
        (14, 2),
        (66, 2),
        (8, 8),
        (64, 8),
        (264, 8),
        (520, 8),
    ]);
    for (width, heads) in cases {
        let a = rng.tensor(23, width);
        let b = rng.tensor(31, width);
        let got = s().sddmm_dot(&csr, heads, &a, &b).unwrap();
        let d = width / heads;
        let (mut want, mut mag) = (vec![], vec![]);
        for i in 0..csr.n_rows() {
            for e in csr.indptr()[i]..csr.indptr()[i + 1] {
                let j = csr.indices()[e] as usize;
                for h in 0..heads {
                    let (mut s, mut m) = (0.0f64, 0.0f64);
                    for c in h * d..(h + 1) * d {
                        let p = a.row(i)[c] as f64 * b.row(j)[c] as f64;
                        s += p;
                        m += p.abs();
                    }
                    want.push(s);
                    mag.push(m);
                }
            }
        }
        assert_close(
            &format!("sddmm_dot width {width} heads {heads}"),
            got.as_slice(),
            &want,
            &mag,
            2e-5,
            1e-6,
        );
    }
    assert!(s()
        .sddmm_dot(&csr, 3, &rng.tensor(23, 8), &rng.tensor(31, 8))
        .is_err());
    assert!(s()
        .sddmm_dot(&csr, 1, &rng.tensor(22, 8), &rng.tensor(31, 8))
        .is_err());
}

#[test]
fn sddmm_add_heads() {
    let mut rng = Rng::new(21);
    let csr = random_csr(&mut rng, 19, 27, 6);
    for heads in [1usize, 2, 8] {
        let l = rng.tensor(19, heads);
        let r = rng.tensor(27, heads);
        let got = s().sddmm_add(&csr, &l, &r).unwrap();
        let mut want = vec![];
        for i in 0..csr.n_rows() {
            for &j in csr.row(i) {
                for h in 0..heads {
                    want.push(l.row(i)[h] + r.row(j as usize)[h]);
                }
            }
        }
        assert_bits_eq(&format!("sddmm_add heads {heads}"), got.as_slice(), &want);
    }
    assert!(s()
        .sddmm_add(&csr, &rng.tensor(19, 2), &rng.tensor(27, 3))
        .is_err());
}

// ---------------------------------------------------------------------------------------------
// Edge softmax
// ---------------------------------------------------------------------------------------------

/// Per-row, per-head softmax in f64.
fn ref_edge_softmax(csr: &Csr, heads: usize, s: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; s.len()];
    for i in 0..csr.n_rows() {
        let (e0, e1) = (csr.indptr()[i], csr.indptr()[i + 1]);
        for h in 0..heads {
            let mx = (e0..e1)
                .map(|e| s[e * heads + h])
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (e0..e1).map(|e| (s[e * heads + h] - mx).exp()).sum();
            for e in e0..e1 {
                out[e * heads + h] = (s[e * heads + h] - mx).exp() / sum;
            }
        }
    }
    out
}

#[test]
fn edge_softmax_matches_reference_and_rows_sum_to_one() {
    let mut rng = Rng::new(30);
    let csr = random_csr(&mut rng, 31, 17, 9);
    for heads in [1usize, 2, 8] {
        for range in [1.0f32, 100.0] {
            let scores = rng.vec(csr.nnz() * heads, -range, range);
            let alpha = s()
                .edge_softmax(&csr, heads, &entries(&scores, heads))
                .unwrap()
                .into_vec();
            let s64: Vec<f64> = scores.iter().map(|&v| v as f64).collect();
            let want = ref_edge_softmax(&csr, heads, &s64);
            assert_close_plain(
                &format!("edge_softmax heads {heads} range {range}"),
                &alpha,
                &want,
                2e-6,
            );
            for i in 0..csr.n_rows() {
                if csr.degree(i) == 0 {
                    continue;
                }
                for h in 0..heads {
                    let sum: f64 = (csr.indptr()[i]..csr.indptr()[i + 1])
                        .map(|e| alpha[e * heads + h] as f64)
                        .sum();
                    assert!((sum - 1.0).abs() < 1e-5, "row {i} head {h} sums to {sum}");
                }
            }
        }
    }
    assert!(s()
        .edge_softmax(&csr, 2, &Tensor::zeros(csr.nnz(), 1))
        .is_err());
}

#[test]
fn edge_softmax_backward_matches_finite_differences() {
    let mut rng = Rng::new(31);
    let csr = random_csr(&mut rng, 21, 13, 7);
    for heads in [1usize, 2, 8] {
        let scores = rng.vec(csr.nnz() * heads, -2.0, 2.0);
        let g = rng.vec(csr.nnz() * heads, -1.0, 1.0);
        let alpha = s()
            .edge_softmax(&csr, heads, &entries(&scores, heads))
            .unwrap();
        let got = s()
            .edge_softmax_backward(&csr, heads, &alpha, &entries(&g, heads))
            .unwrap()
            .into_vec();
        // L(s) = sum_e g_e * softmax(s)_e, differentiated by central differences in f64.
        let loss = |s64: &[f64]| -> f64 {
            ref_edge_softmax(&csr, heads, s64)
                .iter()
                .zip(&g)
                .map(|(a, &g)| a * g as f64)
                .sum()
        };
        let mut s64: Vec<f64> = scores.iter().map(|&v| v as f64).collect();
        let h = 1e-6;
        let mut fd = vec![0.0; s64.len()];
        for e in 0..s64.len() {
            let v = s64[e];
            s64[e] = v + h;
            let lp = loss(&s64);
            s64[e] = v - h;
            let lm = loss(&s64);
            s64[e] = v;
            fd[e] = (lp - lm) / (2.0 * h);
        }
        assert_close_plain(
            &format!("edge_softmax_backward heads {heads}"),
            &got,
            &fd,
            1e-5,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Gather / scatter / bias / column sums / activations / axpy
// ---------------------------------------------------------------------------------------------

#[test]
fn gather_rows_exact() {
    let mut rng = Rng::new(40);
    for &width in &WIDTHS {
        let x = rng.tensor(50, width);
        let mut idx = rng.indices(77, 50);
        idx.extend([0, 49, 49, 0]);
        let got = s().gather_rows(&x, &idx).unwrap();
        assert_eq!(got.shape(), (idx.len(), width));
        for (r, &i) in idx.iter().enumerate() {
            assert_bits_eq("gather", got.row(r), x.row(i as usize));
        }
        assert_eq!(s().gather_rows(&x, &[]).unwrap().shape(), (0, width));
    }
    assert!(s().gather_rows(&rng.tensor(3, 2), &[3]).is_err());
}

#[test]
fn scatter_add_rows_repeated_indices() {
    let mut rng = Rng::new(41);
    // (rows of src, rows of out, width): the large cases take the column-parallel path.
    let mut cases: Vec<(usize, usize, usize)> = WIDTHS.iter().map(|&w| (60, 13, w)).collect();
    cases.extend([(300, 40, 257), (1100, 90, 65), (0, 4, 9)]);
    for (n, rows, width) in cases {
        let src = rng.tensor(n, width);
        let mut idx = rng.indices(n, rows);
        if n >= 3 {
            idx[1] = idx[0];
            idx[2] = idx[0];
        }
        let mut out = rng.tensor(rows, width);
        // Reference: the same additions, in ascending source row for every target (f32).
        let mut want = out.as_slice().to_vec();
        for (r, &t) in idx.iter().enumerate() {
            for c in 0..width {
                want[t as usize * width + c] += src.row(r)[c];
            }
        }
        s().scatter_add_rows(&src, &idx, &mut out).unwrap();
        assert_bits_eq(
            &format!("scatter_add {n}->{rows} width {width}"),
            out.as_slice(),
            &want,
        );
    }
    let mut out = Tensor::zeros(2, 3);
    assert!(s()
        .scatter_add_rows(&rng.tensor(1, 3), &[2], &mut out)
        .is_err());
    assert!(s()
        .scatter_add_rows(&rng.tensor(2, 3), &[0], &mut out)
        .is_err());
}

#[test]
fn add_bias_and_column_sums() {
    let mut rng = Rng::new(42);
    for &width in &WIDTHS {
        for rows in [0usize, 1, 37, 2500] {
            let x = rng.tensor(rows, width);
            let bias = rng.tensor(1, width);
            let mut y = x.clone();
            s().add_bias(&mut y, &bias).unwrap();
            let want: Vec<f32> = (0..rows * width)
                .map(|i| x.as_slice()[i] + bias.as_slice()[i % width])
                .collect();
            assert_bits_eq("add_bias", y.as_slice(), &want);

            let mut acc = rng.tensor(1, width);
            let acc0 = acc.clone();
            s().add_column_sums(&x, &mut acc).unwrap();
            let mut want = vec![0.0f64; width];
            let mut mag = vec![0.0f64; width];
            for r in 0..rows {
                for c in 0..width {
                    want[c] += x.row(r)[c] as f64;
                    mag[c] += (x.row(r)[c] as f64).abs();
                }
            }
            for c in 0..width {
                want[c] += acc0.as_slice()[c] as f64;
                mag[c] += (acc0.as_slice()[c] as f64).abs();
            }
            assert_close(
                &format!("column sums {rows}x{width}"),
                acc.as_slice(),
                &want,
                &mag,
                1e-5,
                1e-6,
            );
        }
    }
    let mut x = rng.tensor(3, 4);
    assert!(s().add_bias(&mut x, &rng.tensor(1, 3)).is_err());
    assert!(s().add_column_sums(&x, &mut Tensor::zeros(1, 5)).is_err());
}

#[test]
fn activations_and_backward() {
    let mut rng = Rng::new(43);
    let x = Tensor::from_vec(3, 67, rng.vec(201, -3.0, 3.0)).unwrap();
    let gy = rng.tensor(3, 67);
    let acts = [
        Activation::Identity,
        Activation::Relu,
        Activation::Elu { alpha: 1.0 },
        Activation::Elu { alpha: 0.3 },
        Activation::LeakyRelu { slope: 0.2 },
    ];
    for act in acts {
        let f = |v: f64| -> f64 {
            match act {
                Activation::Identity => v,
                Activation::Relu => v.max(0.0),
                Activation::Elu { alpha } => {
                    if v > 0.0 {
                        v
                    } else {
                        alpha as f64 * (v.exp() - 1.0)
                    }
                }
                Activation::LeakyRelu { slope } => {
                    if v > 0.0 {
                        v
                    } else {
                        slope as f64 * v
                    }
                }
            }
        };
        let y = s().activation(act, &x).unwrap();
        let want: Vec<f64> = x.as_slice().iter().map(|&v| f(v as f64)).collect();
        assert_close_plain(&format!("{act:?}"), y.as_slice(), &want, 1e-6);
        // Backward vs central differences of the f64 function (x is never within h of 0).
        let gx = s().activation_backward(act, &x, &gy).unwrap();
        let h = 1e-6;
        let want: Vec<f64> = x
            .as_slice()
            .iter()
            .zip(gy.as_slice())
            .map(|(&v, &g)| g as f64 * (f(v as f64 + h) - f(v as f64 - h)) / (2.0 * h))
            .collect();
        assert_close_plain(&format!("{act:?} backward"), gx.as_slice(), &want, 1e-5);
    }
    assert!(s()
        .activation_backward(Activation::Relu, &x, &rng.tensor(67, 3))
        .is_err());
}

#[test]
fn activation_backward_from_output_matches_backward() {
    let mut rng = Rng::new(45);
    let x = Tensor::from_vec(5, 41, rng.vec(205, -3.0, 3.0)).unwrap();
    let gy = rng.tensor(5, 41);
    for act in [
        Activation::Identity,
        Activation::Relu,
        Activation::Elu { alpha: 1.0 },
        Activation::Elu { alpha: 0.3 },
        Activation::LeakyRelu { slope: 0.2 },
    ] {
        let y = s().activation(act, &x).unwrap();
        let want = s().activation_backward(act, &x, &gy).unwrap();
        let mut g = gy.clone();
        s().activation_backward_from_output(act, &y, &mut g)
            .unwrap();
        // ELU's derivative from the output, y + alpha, rounds differently from alpha * exp(x).
        let want64: Vec<f64> = want.as_slice().iter().map(|&v| v as f64).collect();
        assert_close_plain(&format!("{act:?} from output"), g.as_slice(), &want64, 1e-6);
    }
    let mut g = rng.tensor(41, 5);
    assert!(s()
        .activation_backward_from_output(Activation::Relu, &x, &mut g)
        .is_err());
}

#[test]
fn activate_in_place_and_relu_bit_masks() {
    let mut rng = Rng::new(46);
    for &width in &WIDTHS {
        let x = Tensor::from_vec(9, width, rng.vec(9 * width, -2.0, 2.0)).unwrap();
        for act in [
            Activation::Identity,
            Activation::Relu,
            Activation::Elu { alpha: 0.5 },
        ] {
            let mut y = x.clone();
            s().activate(act, &mut y).unwrap();
            assert_eq!(y, s().activation(act, &x).unwrap(), "{act:?} in place");
        }
        // ReLU backward through one bit per element.
        let y = s().activation(Activation::Relu, &x).unwrap();
        let bits = s().positive_bits(&y).unwrap();
        assert_eq!(bits.words(), y.len().div_ceil(64));
        let gy = rng.tensor(9, width);
        let mut g = gy.clone();
        s().mask_by_bits(&bits, &mut g).unwrap();
        let want = s().activation_backward(Activation::Relu, &x, &gy).unwrap();
        assert_eq!(g, want, "mask_by_bits width {width}");
        let mut words = s().download_bits(&bits).unwrap();
        words.pop();
        assert!(s().mask_by_bits(&Bits::from_words(words), &mut g).is_err());
    }
    let mut g = Tensor::zeros(1, 65);
    assert!(s()
        .mask_by_bits(&Bits::from_words(vec![0]), &mut g)
        .is_err());
}

#[test]
fn axpy_exact() {
    let mut rng = Rng::new(44);
    for &width in &WIDTHS {
        let x = rng.tensor(70, width);
        let mut y = rng.tensor(70, width);
        let want: Vec<f32> = y
            .as_slice()
            .iter()
            .zip(x.as_slice())
            .map(|(&y, &x)| y + -0.375 * x)
            .collect();
        s().axpy(-0.375, &x, &mut y).unwrap();
        assert_bits_eq("axpy", y.as_slice(), &want);
    }
    assert!(s()
        .axpy(1.0, &rng.tensor(2, 3), &mut rng.tensor(3, 2))
        .is_err());
}

// ---------------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------------

/// Positive values, so that "dropped" (0) and "kept" are unambiguous.
fn positive(rng: &mut Rng, rows: usize, cols: usize) -> Tensor {
    Tensor::from_vec(rows, cols, rng.vec(rows * cols, 0.5, 1.5)).unwrap()
}

#[test]
fn dropout_fraction_and_scale() {
    let mut rng = Rng::new(50);
    for p in [0.1f32, 0.5, 0.9] {
        for &width in &[1usize, 7, 9, 65, 257] {
            let rows = 20_000 / width + 1;
            let x = positive(&mut rng, rows, width);
            let gids: Vec<u32> = (0..rows as u32).map(|r| r * 7 + 3).collect();
            let mut y = x.clone();
            s().dropout(&mut y, &gids, key(5), p).unwrap();
            let scale = 1.0 / (1.0 - p);
            let mut kept = 0usize;
            for (&a, &b) in x.as_slice().iter().zip(y.as_slice()) {
                if b != 0.0 {
                    kept += 1;
                    assert_eq!(
                        b.to_bits(),
                        (a * scale).to_bits(),
                        "kept values are scaled by 1/(1-p)"
                    );
                }
            }
            let frac = kept as f64 / x.len() as f64;
            assert!(
                (frac - (1.0 - p as f64)).abs() < 0.02,
                "p {p} width {width}: kept {frac}"
            );
        }
    }
    // p = 0 is the identity, p = 1 drops everything.
    let x = positive(&mut rng, 5, 9);
    let mut y = x.clone();
    s().dropout(&mut y, &[1, 2, 3, 4, 5], key(5), 0.0).unwrap();
    assert_eq!(y, x);
    s().dropout(&mut y, &[1, 2, 3, 4, 5], key(5), 1.0).unwrap();
    assert!(y.as_slice().iter().all(|&v| v == 0.0));
    assert!(s().dropout(&mut y, &[1, 2], key(5), 0.5).is_err());
}

#[test]
fn dropout_mask_depends_only_on_key_gid_col() {
    let mut rng = Rng::new(51);
    let p = 0.5;
    let ones = |rows, cols| {
        let mut t = Tensor::zeros(rows, cols);
        t.fill(1.0);
        t
    };
    // The same gids at different row positions, and repeated within one tensor.
    let gids_a = [5u32, 9, 1000, 5, 77];
    let gids_b = [77u32, 1000, 5, 9];
    let mut a = ones(5, 33);
    let mut b = ones(4, 33);
    s().dropout(&mut a, &gids_a, key(1), p).unwrap();
    s().dropout(&mut b, &gids_b, key(1), p).unwrap();
    for (ra, &ga) in gids_a.iter().enumerate() {
        let rb = gids_b.iter().position(|&g| g == ga).unwrap();
        assert_bits_eq("same gid, different row", a.row(ra), b.row(rb));
    }
    // Independent of the tensor width: column c of a narrower tensor gets the same draw.
    for width in [1usize, 7, 9] {
        let mut c = ones(5, width);
        s().dropout(&mut c, &gids_a, key(1), p).unwrap();
        for r in 0..5 {
            assert_bits_eq("same column, other width", c.row(r), &a.row(r)[..width]);
        }
    }
    // Independent of the thread count and of being applied in pieces.
    for st in streams() {
        let mut d = ones(5, 33);
        st.dropout(&mut d, &gids_a, key(1), p).unwrap();
        assert_eq!(d, a);
    }
    // Every part of the key matters.
    let variants = [
        DropoutKey { seed: 2, ..key(1) },
        DropoutKey { epoch: 4, ..key(1) },
        DropoutKey { layer: 2, ..key(1) },
        DropoutKey { site: 1, ..key(1) },
    ];
    for k in variants {
        let mut d = ones(5, 33);
        s().dropout(&mut d, &gids_a, k, p).unwrap();
        assert_ne!(d, a, "{k:?} gives the same mask");
    }
    // Different gids give different masks.
    let mut e = ones(5, 33);
    s().dropout(&mut e, &[6, 10, 1001, 6, 78], key(1), p)
        .unwrap();
    assert_ne!(e, a);
    let _ = rng.next_u32();
}

#[test]
fn dropout_is_its_own_backward() {
    let mut rng = Rng::new(52);
    let p = 0.3;
    let gids: Vec<u32> = (0..40u32).map(|r| 1000 - r * 3).collect();
    // The Jacobian of dropout is diagonal: mask * scale = dropout(ones).
    let mut jac = Tensor::zeros(40, 31);
    jac.fill(1.0);
    s().dropout(&mut jac, &gids, key(9), p).unwrap();
    let x = rng.tensor(40, 31);
    let g = rng.tensor(40, 31);
    // Forward: y = x * jac; backward: gx = g * jac (the same op applied to g).
    let mut y = x.clone();
    s().dropout(&mut y, &gids, key(9), p).unwrap();
    let mut gx = g.clone();
    s().dropout(&mut gx, &gids, key(9), p).unwrap();
    for i in 0..x.len() {
        let j = jac.as_slice()[i];
        // (Compared as values: a dropped negative input gives +0 where x * 0 gives -0.)
        assert_eq!(y.as_slice()[i], x.as_slice()[i] * j);
        assert_eq!(gx.as_slice()[i], g.as_slice()[i] * j);
    }
    // Twice: mask^2 semantics, (x * s) * s where kept, 0 where dropped.
    let mut yy = y.clone();
    s().dropout(&mut yy, &gids, key(9), p).unwrap();
    for i in 0..x.len() {
        let j = jac.as_slice()[i];
        assert_eq!(yy.as_slice()[i], x.as_slice()[i] * j * j);
    }
}

#[test]
fn edge_dropout_masks() {
    let mut rng = Rng::new(53);
    let p = 0.4;
    for heads in [1usize, 2, 8] {
        let csr = random_csr(&mut rng, 300, 50, 20);
        let gids: Vec<u32> = (0..300u32).map(|r| r * 2 + 1).collect();
        let x: Vec<f32> = rng.vec(csr.nnz() * heads, 0.5, 1.5);
        let mut y = entries(&x, heads);
        s().edge_dropout(&csr, &mut y, heads, &gids, key(3), p)
            .unwrap();
        let y = y.into_vec();
        let scale = 1.0 / (1.0 - p);
        let kept = y.iter().filter(|&&v| v != 0.0).count();
        for (&a, &b) in x.iter().zip(&y) {
            assert!(b == 0.0 || b.to_bits() == (a * scale).to_bits());
        }
        let frac = kept as f64 / y.len() as f64;
        assert!((frac - 0.6).abs() < 0.03, "heads {heads}: kept {frac}");
        // Its own backward: applying it again multiplies by the same mask.
        let mut yy = entries(&y, heads);
        s().edge_dropout(&csr, &mut yy, heads, &gids, key(3), p)
            .unwrap();
        let yy = yy.into_vec();
        for (&b, &bb) in y.iter().zip(&yy) {
            assert_eq!(
                bb.to_bits(),
                (b * if b == 0.0 { 0.0 } else { scale }).to_bits()
            );
        }
    }
    // The mask of a row depends on its gid and entry position, not on where the row sits.
    let a = Csr::from_pairs(3, 4, &[(0, 0), (0, 1), (0, 2), (2, 3), (2, 1)]).unwrap();
    let b = Csr::from_pairs(2, 4, &[(1, 0), (1, 1), (1, 3)]).unwrap();
    let mut va = entries(&[1.0f32; 5 * 2], 2);
    let mut vb = entries(&[1.0f32; 3 * 2], 2);
    s().edge_dropout(&a, &mut va, 2, &[7, 8, 9], key(4), 0.5)
        .unwrap();
    s().edge_dropout(&b, &mut vb, 2, &[3, 7], key(4), 0.5)
        .unwrap();
    assert_bits_eq("edge mask by gid", &va.as_slice()[..6], vb.as_slice());
    assert!(s()
        .edge_dropout(&a, &mut va, 2, &[7, 8], key(4), 0.5)
        .is_err());
}

#[test]
fn dropout_csr_matches_dense_dropout() {
    let mut rng = Rng::new(54);
    for &width in &[1usize, 7, 9, 33, 257] {
        let rows = 23;
        // A sparse-ish dense matrix (about a third non-zero, some rows empty).
        let mut dense = vec![0.0f32; rows * width];
        for (i, v) in dense.iter_mut().enumerate() {
            if (i / width) % 7 != 3 && rng.below(3) == 0 {
                *v = rng.uniform(0.5, 1.5);
            }
        }
        let gids: Vec<u32> = (0..rows as u32).map(|r| 40 - r).collect();
        let mut csr = Csr::from_dense(rows, width, &dense).unwrap();
        s().dropout_csr(&mut csr, &gids, key(6), 0.35).unwrap();
        let mut t = Tensor::from_vec(rows, width, dense).unwrap();
        s().dropout(&mut t, &gids, key(6), 0.35).unwrap();
        let mut back = vec![0.0f32; rows * width];
        for i in 0..rows {
            for e in csr.indptr()[i]..csr.indptr()[i + 1] {
                back[i * width + csr.indices()[e] as usize] = csr.values().unwrap()[e];
            }
        }
        assert_bits_eq(&format!("dropout_csr width {width}"), &back, t.as_slice());
    }
    let mut no_values = Csr::from_pairs(2, 2, &[(0, 1)]).unwrap();
    assert!(s()
        .dropout_csr(&mut no_values, &[0, 1], key(6), 0.5)
        .is_err());
}

// ---------------------------------------------------------------------------------------------
// Loss and accuracy
// ---------------------------------------------------------------------------------------------

#[test]
fn softmax_nll_and_accuracy() {
    let mut rng = Rng::new(60);
    for classes in [1usize, 2, 7, 40] {
        let n = 53;
        let logits = Tensor::from_vec(n, classes, rng.vec(n * classes, -4.0, 4.0)).unwrap();
        let labels = rng.indices(n, classes);
        let rows: Vec<u32> = (0..n as u32).filter(|r| r % 3 != 1).rev().collect();
        let scale = 1.0 / rows.len() as f32;
        let mut grad = rng.tensor(n, classes); // overwritten
        let out = s()
            .softmax_nll(&logits, &labels, &rows, scale, &mut grad)
            .unwrap();

        let mut loss = 0.0f64;
        let mut correct = 0usize;
        let mut want_grad = vec![0.0f64; n * classes];
        for &r in &rows {
            let r = r as usize;
            let z: Vec<f64> = logits.row(r).iter().map(|&v| v as f64).collect();
            let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + z.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            let y = labels[r] as usize;
            loss += lse - z[y];
            // argmax, ties to the lowest index
            let arg = (0..classes).fold(0, |b, c| if z[c] > z[b] { c } else { b });
            correct += (arg == y) as usize;
            for c in 0..classes {
                want_grad[r * classes + c] =
                    scale as f64 * ((z[c] - lse).exp() - (c == y) as u8 as f64);
            }
        }
        assert!(
            (out.loss_sum - loss).abs() <= 1e-5 * (1.0 + loss.abs()),
            "loss {} vs {loss}",
            out.loss_sum
        );
        assert_eq!(out.correct, correct);
        assert_eq!(out.count, rows.len());
        assert_close_plain(
            &format!("nll grad classes {classes}"),
            grad.as_slice(),
            &want_grad,
            1e-6,
        );
        for r in (1..n).step_by(3) {
            assert!(
                grad.row(r).iter().all(|&g| g == 0.0),
                "unselected rows get zero gradient"
            );
        }
        assert_eq!(
            s().accuracy_count(&logits, &labels, &rows).unwrap(),
            correct
        );
        // Rows of the gradient sum to zero.
        for &r in &rows {
            let sum: f64 = grad.row(r as usize).iter().map(|&v| v as f64).sum();
            assert!(sum.abs() < 1e-6, "row {r} of the gradient sums to {sum}");
        }
    }
    // Ties go to the lowest index.
    let logits = Tensor::from_vec(2, 3, vec![1.0, 1.0, 0.0, 0.0, 2.0, 2.0]).unwrap();
    assert_eq!(s().accuracy_count(&logits, &[0, 1], &[0, 1]).unwrap(), 2);
    assert_eq!(s().accuracy_count(&logits, &[1, 2], &[0, 1]).unwrap(), 0);
    // Out-of-range labels or rows are errors, not panics.
    let mut g = Tensor::zeros(2, 3);
    assert!(s()
        .softmax_nll(&logits, &[0, 3], &[1], 1.0, &mut g)
        .is_err());
    assert!(s()
        .softmax_nll(&logits, &[0, 1], &[2], 1.0, &mut g)
        .is_err());
    assert!(s().accuracy_count(&logits, &[0, 1], &[2]).is_err());
}

#[test]
fn softmax_nll_large_logits_are_stable() {
    let logits = Tensor::from_vec(2, 3, vec![1000.0, -1000.0, 999.0, -5e4, -5e4, -5e4]).unwrap();
    let mut g = Tensor::zeros(2, 3);
    let out = s()
        .softmax_nll(&logits, &[2, 1], &[0, 1], 1.0, &mut g)
        .unwrap();
    let want = (1.0 + (-1.0f64).exp()).ln() + 1.0 + 3.0f64.ln();
    assert!(
        (out.loss_sum - want).abs() < 1e-9,
        "{} vs {want}",
        out.loss_sum
    );
    assert!(g.as_slice().iter().all(|v| v.is_finite()));
}

#[test]
fn softmax_nll_repeated_rows_count_twice() {
    // A row listed twice contributes twice to the loss, so twice to its gradient.
    let mut rng = Rng::new(61);
    let logits = rng.tensor(4, 5);
    let labels = [1u32, 4, 0, 2];
    let mut g1 = Tensor::zeros(4, 5);
    let mut g2 = Tensor::zeros(4, 5);
    let once = s()
        .softmax_nll(&logits, &labels, &[2], 1.0, &mut g1)
        .unwrap();
    let twice = s()
        .softmax_nll(&logits, &labels, &[2, 3, 2], 1.0, &mut g2)
        .unwrap();
    let mut g3 = Tensor::zeros(4, 5);
    let only3 = s()
        .softmax_nll(&logits, &labels, &[3], 1.0, &mut g3)
        .unwrap();
    let want = once.loss_sum + once.loss_sum + only3.loss_sum;
    assert!(
        (twice.loss_sum - want).abs() < 1e-12,
        "{} vs {want}",
        twice.loss_sum
    );
    assert_eq!(twice.count, 3);
    for c in 0..5 {
        assert_eq!(g2.row(2)[c], 2.0 * g1.row(2)[c]);
        assert_eq!(g2.row(3)[c], g3.row(3)[c]);
    }
}

// ---------------------------------------------------------------------------------------------
// Optimizers
// ---------------------------------------------------------------------------------------------

/// `torch.optim.Adam` (amsgrad off, L2 weight decay), one scalar parameter, in f64.
struct RefAdam {
    p: f64,
    m: f64,
    v: f64,
}

impl RefAdam {
    fn step(&mut self, cfg: &AdamConfig, t: u64, g: f64) {
        let (b1, b2) = (cfg.beta1 as f64, cfg.beta2 as f64);
        let g = g + cfg.weight_decay as f64 * self.p;
        self.m = b1 * self.m + (1.0 - b1) * g;
        self.v = b2 * self.v + (1.0 - b2) * g * g;
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        let step_size = cfg.lr as f64 / bc1;
        let denom = self.v.sqrt() / bc2.sqrt() + cfg.eps as f64;
        self.p -= step_size * self.m / denom;
    }
}

#[test]
fn adam_matches_torch_reference() {
    let mut rng = Rng::new(70);
    let cfgs = [
        AdamConfig::default(),
        AdamConfig {
            lr: 0.05,
            beta1: 0.8,
            beta2: 0.99,
            eps: 0.1,
            weight_decay: 0.0,
        },
        AdamConfig {
            lr: 0.003,
            weight_decay: 5e-4,
            ..AdamConfig::default()
        },
        AdamConfig {
            lr: 0.02,
            weight_decay: 0.1,
            eps: 1e-3,
            ..AdamConfig::default()
        },
    ];
    for cfg in cfgs {
        let n = 4099; // not a multiple of any chunk
        let mut p = rng.tensor(1, n);
        let mut m = Tensor::zeros(1, n);
        let mut v = Tensor::zeros(1, n);
        let mut refs: Vec<RefAdam> = p
            .as_slice()
            .iter()
            .map(|&p| RefAdam {
                p: p as f64,
                m: 0.0,
                v: 0.0,
            })
            .collect();
        for t in 1..=6u64 {
            let g = Tensor::from_vec(1, n, rng.vec(n, -0.5, 0.5)).unwrap();
            let g0 = g.clone();
            s().adam_step(&cfg, t, &mut p, &g, &mut m, &mut v).unwrap();
            assert_eq!(g, g0, "the gradient is not modified");
            for (r, &gi) in refs.iter_mut().zip(g.as_slice()) {
                r.step(&cfg, t, gi as f64);
            }
        }
        let want_p: Vec<f64> = refs.iter().map(|r| r.p).collect();
        let want_m: Vec<f64> = refs.iter().map(|r| r.m).collect();
        let want_v: Vec<f64> = refs.iter().map(|r| r.v).collect();
        assert_close_plain(&format!("adam p {cfg:?}"), p.as_slice(), &want_p, 2e-6);
        assert_close_plain(&format!("adam m {cfg:?}"), m.as_slice(), &want_m, 1e-5);
        assert_close_plain(&format!("adam v {cfg:?}"), v.as_slice(), &want_v, 1e-5);
    }
    let mut p = Tensor::zeros(1, 3);
    let mut m = Tensor::zeros(1, 3);
    let mut v = Tensor::zeros(1, 2);
    assert!(s()
        .adam_step(
            &AdamConfig::default(),
            1,
            &mut p,
            &Tensor::zeros(1, 3),
            &mut m,
            &mut v
        )
        .is_err());
}

#[test]
fn sgd_matches_torch_reference() {
    let mut rng = Rng::new(71);
    let cfgs = [
        SgdConfig {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        },
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 5e-4,
        },
        SgdConfig {
            lr: 0.2,
            momentum: 0.0,
            weight_decay: 0.01,
        },
    ];
    for cfg in cfgs {
        let n = 5000;
        let mut p = rng.tensor(1, n);
        let mut buf = Tensor::zeros(1, n);
        let mut rp: Vec<f64> = p.as_slice().iter().map(|&v| v as f64).collect();
        let mut rb: Vec<Option<f64>> = vec![None; n];
        for _ in 0..5 {
            let g = rng.tensor(1, n);
            s().sgd_step(&cfg, &mut p, &g, &mut buf).unwrap();
            // torch.optim.SGD (dampening 0, no nesterov): the buffer starts as the first d_p.
            for i in 0..n {
                let mut d = g.as_slice()[i] as f64 + cfg.weight_decay as f64 * rp[i];
                if cfg.momentum != 0.0 {
                    let b = match rb[i] {
                        None => d,
                        Some(b) => cfg.momentum as f64 * b + d,
                    };
                    rb[i] = Some(b);
                    d = b;
                }
                rp[i] -= cfg.lr as f64 * d;
            }
        }
        assert_close_plain(&format!("sgd {cfg:?}"), p.as_slice(), &rp, 2e-6);
    }
    let mut p = Tensor::zeros(1, 3);
    assert!(s()
        .sgd_step(
            &SgdConfig::default(),
            &mut p,
            &Tensor::zeros(1, 3),
            &mut Tensor::zeros(1, 4)
        )
        .is_err());
}

// ---------------------------------------------------------------------------------------------
// Digest
// ---------------------------------------------------------------------------------------------

#[test]
fn digest_is_stable() {
    let a = Tensor::from_vec(2, 2, vec![0.0, 1.0, -2.5, 3.25]).unwrap();
    let b = Tensor::from_vec(1, 3, vec![1e-30, f32::MAX, -0.0]).unwrap();
    let d = s().digest(&[&a, &b]).unwrap();
    // A fixed value: digests recorded by earlier runs must stay comparable.
    assert_eq!(
        d,
        "778e021094ede7e2ab73acf5f3be13c7c8b5c1cd4f147cd76b449247c8f6218b"
    );
    // Over the little-endian bytes, in order, without separators.
    let bytes: Vec<u8> = a
        .as_slice()
        .iter()
        .chain(b.as_slice())
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(d, digest_bytes(&bytes));
    for st in streams() {
        assert_eq!(st.digest(&[&a, &b]).unwrap(), d);
    }
    assert_ne!(s().digest(&[&b, &a]).unwrap(), d);
    let mut c = b.clone();
    c.as_mut_slice()[2] = 0.0; // -0.0 -> +0.0 is a different bit pattern
    assert_ne!(s().digest(&[&a, &c]).unwrap(), d);
    assert_eq!(s().digest(&[]).unwrap(), digest_bytes(&[]));
}

// ---------------------------------------------------------------------------------------------
// Determinism across thread counts
// ---------------------------------------------------------------------------------------------

/// Runs `f` on streams of 1, 2 and 4 threads and asserts the outputs have the same bits.
#[track_caller]
fn same_bits_across_threads(what: &str, f: impl Fn(&Stream) -> Vec<f32>) {
    let outs: Vec<Vec<f32>> = streams().iter().map(&f).collect();
    for (o, st) in outs.iter().zip(streams()).skip(1) {
        assert_bits_eq(
            &format!("{what} ({} threads vs 1)", st.threads()),
            o,
            &outs[0],
        );
    }
}

#[test]
fn row_parallel_kernels_are_bit_identical_across_thread_counts() {
    let mut rng = Rng::new(80);
    // Enough rows for several row chunks per kernel.
    let (rows, cols, width, heads) = (6000, 5000, 24, 2);
    let csr = random_csr(&mut rng, rows, cols, 12);
    let x = rng.tensor(cols, width);
    let w = rng.vec(csr.nnz() * heads, -1.0, 1.0);
    same_bits_across_threads("spmm ones", |st| {
        let mut out = Tensor::zeros(rows, width);
        st.spmm(&csr, EdgeWeights::Ones, &x, &mut out).unwrap();
        out.into_vec()
    });
    same_bits_across_threads("spmm stored", |st| {
        let mut out = Tensor::zeros(rows, width);
        st.spmm(&csr, EdgeWeights::Stored, &x, &mut out).unwrap();
        out.into_vec()
    });
    same_bits_across_threads("spmm per head", |st| {
        let mut out = Tensor::zeros(rows, width);
        st.spmm(
            &csr,
            EdgeWeights::PerHead(&entries(&w, heads), heads),
            &x,
            &mut out,
        )
        .unwrap();
        out.into_vec()
    });
    let a = rng.tensor(rows, width);
    same_bits_across_threads("sddmm_dot", |st| {
        st.sddmm_dot(&csr, heads, &a, &x).unwrap().into_vec()
    });
    let l = rng.tensor(rows, heads);
    let r = rng.tensor(cols, heads);
    same_bits_across_threads("sddmm_add", |st| {
        st.sddmm_add(&csr, &l, &r).unwrap().into_vec()
    });
    let scores = entries(&rng.vec(csr.nnz() * heads, -3.0, 3.0), heads);
    same_bits_across_threads("edge_softmax", |st| {
        st.edge_softmax(&csr, heads, &scores).unwrap().into_vec()
    });
    let alpha = s().edge_softmax(&csr, heads, &scores).unwrap();
    let wt = entries(&w, heads);
    same_bits_across_threads("edge_softmax_backward", |st| {
        st.edge_softmax_backward(&csr, heads, &alpha, &wt)
            .unwrap()
            .into_vec()
    });
    let idx = rng.indices(20_000, cols);
    same_bits_across_threads("gather_rows", |st| {
        st.gather_rows(&x, &idx).unwrap().into_vec()
    });
    for (n, width) in [(400usize, 257usize), (3000, 24), (2000, 65)] {
        let src = rng.tensor(n, width);
        let idx = rng.indices(n, 50);
        let out0 = rng.tensor(50, width);
        same_bits_across_threads("scatter_add_rows", |st| {
            let mut out = out0.clone();
            st.scatter_add_rows(&src, &idx, &mut out).unwrap();
            out.into_vec()
        });
    }
    for width in [16usize, 65, 300] {
        let g = rng.tensor(20_000 / width * 10, width);
        same_bits_across_threads("column sums", |st| {
            let mut out = Tensor::zeros(1, width);
            st.add_column_sums(&g, &mut out).unwrap();
            out.into_vec()
        });
    }
    let big = rng.tensor(3000, 33);
    let gids: Vec<u32> = (0..3000u32).map(|i| i * 5 + 11).collect();
    same_bits_across_threads("dropout", |st| {
        let mut y = big.clone();
        st.dropout(&mut y, &gids, key(8), 0.5).unwrap();
        y.into_vec()
    });
    let gids_rows: Vec<u32> = (0..rows as u32).collect();
    same_bits_across_threads("edge_dropout", |st| {
        let mut v = entries(&w, heads);
        st.edge_dropout(&csr, &mut v, heads, &gids_rows, key(8), 0.3)
            .unwrap();
        v.into_vec()
    });
    let logits = rng.tensor(5000, 7);
    let labels = rng.indices(5000, 7);
    let sel: Vec<u32> = (0..5000u32).filter(|i| i % 4 != 0).collect();
    same_bits_across_threads("softmax_nll", |st| {
        let mut g = Tensor::zeros(5000, 7);
        let out = st
            .softmax_nll(&logits, &labels, &sel, 0.001, &mut g)
            .unwrap();
        let mut v = g.into_vec();
        v.push(out.loss_sum as f32);
        v.push(out.correct as f32);
        v.push(f32::from_bits((out.loss_sum.to_bits() >> 32) as u32));
        v.push(f32::from_bits(out.loss_sum.to_bits() as u32));
        v
    });
    let counts: Vec<usize> = streams()
        .iter()
        .map(|st| st.accuracy_count(&logits, &labels, &sel).unwrap())
        .collect();
    assert!(counts.iter().all(|&c| c == counts[0]));
    let big2 = rng.tensor(3000, 33);
    same_bits_across_threads("activation", |st| {
        st.activation(Activation::Elu { alpha: 1.0 }, &big)
            .unwrap()
            .into_vec()
    });
    same_bits_across_threads("axpy", |st| {
        let mut y = big2.clone();
        st.axpy(0.3, &big, &mut y).unwrap();
        y.into_vec()
    });
    same_bits_across_threads("adam", |st| {
        let (mut p, mut m, mut v) = (
            big2.clone(),
            Tensor::zeros(3000, 33),
            Tensor::zeros(3000, 33),
        );
        let cfg = AdamConfig {
            weight_decay: 0.01,
            ..AdamConfig::default()
        };
        st.adam_step(&cfg, 1, &mut p, &big, &mut m, &mut v).unwrap();
        st.adam_step(&cfg, 2, &mut p, &big, &mut m, &mut v).unwrap();
        p.into_vec()
    });
    same_bits_across_threads("sgd", |st| {
        let (mut p, mut b) = (big2.clone(), Tensor::zeros(3000, 33));
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        st.sgd_step(&cfg, &mut p, &big, &mut b).unwrap();
        st.sgd_step(&cfg, &mut p, &big, &mut b).unwrap();
        p.into_vec()
    });
}

#[test]
#[should_panic(expected = "steps count from 1")]
fn adam_step_zero_panics_instead_of_producing_nan() {
    let mut p = Tensor::zeros(1, 3);
    let (mut m, mut v) = (Tensor::zeros(1, 3), Tensor::zeros(1, 3));
    let _ = s().adam_step(
        &AdamConfig::default(),
        0,
        &mut p,
        &Tensor::zeros(1, 3),
        &mut m,
        &mut v,
    );
}

#[test]
fn dropout_into_equals_copy_then_dropout() {
    let (rows, cols) = (37, 21);
    let x = Tensor::from_vec(
        rows,
        cols,
        (0..rows * cols).map(|i| i as f32 - 300.0).collect(),
    )
    .unwrap();
    let gids: Vec<u32> = (0..rows as u32).map(|r| r * 3 + 1).collect();
    for p in [0.0, 0.5] {
        let mut a = x.clone();
        s().dropout(&mut a, &gids, key(9), p).unwrap();
        let mut b = Tensor::zeros(rows, cols);
        s().dropout_into(&x, &mut b, &gids, key(9), p).unwrap();
        assert_eq!(a.as_slice(), b.as_slice(), "p = {p}");
    }
    let mut wrong = Tensor::zeros(rows, cols + 1);
    assert!(s()
        .dropout_into(&x, &mut wrong, &gids, key(9), 0.5)
        .is_err());
}

#[test]
fn kernel_clock_times_each_family_on_its_own_stream() {
    let st = stream_with(2);
    assert_eq!(st.kernel_times(), trellis_gpu::KernelTimes::default());
    let a = Tensor::from_vec(64, 64, vec![0.5; 64 * 64]).unwrap();
    st.matmul(&a, false, &a, false).unwrap();
    let after_gemm = st.kernel_times();
    assert!(after_gemm.gemm_ms > 0.0, "{after_gemm:?}");
    assert_eq!((after_gemm.spmm_ms, after_gemm.other_ms), (0.0, 0.0));
    let mut b = a.clone();
    st.activate(Activation::Relu, &mut b).unwrap();
    let d = st.kernel_times().since(&after_gemm);
    assert!(d.other_ms > 0.0 && d.gemm_ms == 0.0, "{d:?}");
    // Clones share the clock; another stream has its own.
    assert_eq!(st.clone().kernel_times(), st.kernel_times());
    assert_eq!(stream_with(2).kernel_times().total_ms(), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Cancellable streams
// ---------------------------------------------------------------------------------------------

/// A cancellable stream cuts long kernels into pieces: row-independent kernels give the same
/// bits as in one piece, and `a^T b` (summed piece by piece) stays within rounding.
#[test]
fn kernels_cut_into_pieces_match_the_whole() {
    let s = s();
    let cut = s
        .with_cancel(trellis_gpu::CancelToken::new())
        .with_piece_divisor(1 << 30);
    let mut rng = Rng::new(77);
    let (m, k, n) = (301, 33, 17);
    let a = rng.tensor(m, k);
    let b = rng.tensor(k, n);
    let g = rng.tensor(m, n);
    let whole = s.matmul(&a, false, &b, false).unwrap();
    let pieces = cut.matmul(&a, false, &b, false).unwrap();
    assert_bits_eq("pieces", whole.as_slice(), pieces.as_slice());
    let whole = s.matmul(&a, true, &g, false).unwrap();
    let pieces = cut.matmul(&a, true, &g, false).unwrap();
    for (x, y) in whole.as_slice().iter().zip(pieces.as_slice()) {
        assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{x} vs {y}");
    }
    let csr = random_csr(&mut rng, m, 97, 5);
    let x = rng.tensor(97, 65);
    let mut whole = Tensor::zeros(m, 65);
    let mut pieces = Tensor::zeros(m, 65);
    s.spmm(&csr, EdgeWeights::Stored, &x, &mut whole).unwrap();
    cut.spmm(&csr, EdgeWeights::Stored, &x, &mut pieces)
        .unwrap();
    assert_bits_eq("pieces", whole.as_slice(), pieces.as_slice());
    let gids: Vec<u32> = (0..m as u32).map(|i| i * 3 + 1).collect();
    let key = key(5);
    let mut whole = Tensor::zeros(m, k);
    let mut pieces = Tensor::zeros(m, k);
    s.dropout_into(&a, &mut whole, &gids, key, 0.5).unwrap();
    cut.dropout_into(&a, &mut pieces, &gids, key, 0.5).unwrap();
    assert_bits_eq("pieces", whole.as_slice(), pieces.as_slice());
    // Into a fresh (not zeroed) allocation: the same rows, whole or in pieces.
    for st in [s, &cut] {
        let fresh = st.dropout_copy(&a, &gids, key, 0.5).unwrap();
        assert_eq!(fresh.shape(), a.shape());
        assert_bits_eq("dropout_copy", whole.as_slice(), fresh.as_slice());
    }
    assert!(s.dropout_copy(&a, &gids[1..], key, 0.5).is_err());
    // Element-wise kernels, cut into single rows or single 64-element words.
    let bias = rng.tensor(1, k);
    let (mut whole, mut pieces) = (a.clone(), a.clone());
    for (st, t) in [(s, &mut whole), (&cut, &mut pieces)] {
        st.add_bias(t, &bias).unwrap();
        st.activate(Activation::Elu { alpha: 1.0 }, t).unwrap();
    }
    assert_bits_eq("bias, activation", whole.as_slice(), pieces.as_slice());
    let bits = s.positive_bits(&whole).unwrap();
    assert_eq!(
        s.download_bits(&bits).unwrap(),
        cut.download_bits(&cut.positive_bits(&whole).unwrap())
            .unwrap()
    );
    let gy = rng.tensor(m, k);
    let (mut gw, mut gp) = (gy.clone(), gy.clone());
    s.activation_backward_from_output(Activation::Elu { alpha: 1.0 }, &whole, &mut gw)
        .unwrap();
    cut.activation_backward_from_output(Activation::Elu { alpha: 1.0 }, &whole, &mut gp)
        .unwrap();
    s.mask_by_bits(&bits, &mut gw).unwrap();
    cut.mask_by_bits(&bits, &mut gp).unwrap();
    assert_bits_eq("activation backward, mask", gw.as_slice(), gp.as_slice());
}

/// Once its token is cancelled, a stream refuses new ops and stops a long kernel between
/// pieces; cleared, it runs again. A stream without the token is not affected.
#[test]
fn a_cancelled_stream_stops_and_a_cleared_one_runs() {
    let s = s();
    let token = trellis_gpu::CancelToken::new();
    let cut = s.with_cancel(token.clone());
    let mut rng = Rng::new(78);
    let a = rng.tensor(64, 16);
    let b = rng.tensor(16, 8);
    token.cancel();
    let err = cut.matmul(&a, false, &b, false).unwrap_err();
    assert!(matches!(err, trellis_gpu::GpuError::Cancelled), "{err}");
    assert!(cut.uncancellable().matmul(&a, false, &b, false).is_ok());
    assert!(s.matmul(&a, false, &b, false).is_ok());
    token.clear();
    assert!(cut.matmul(&a, false, &b, false).is_ok());
}
