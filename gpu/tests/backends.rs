//! One test body per op, run on every backend compiled in and compared with the CPU backend
//! (a 1-thread stream) on random inputs with awkward sizes: tolerance 1e-4 relative (to the
//! value, or to the output's RMS where sums cancel); exact for masks, bits, gathers and counts.
//!
//! The CPU instance (a 4-thread stream) always runs. The CUDA instance runs when the crate is
//! built with `--features cuda` and a GPU is usable; otherwise each test writes
//! `SKIPPED cuda: <reason>` to stderr (uncaptured, so it shows in every test run) — it never
//! passes silently.
use std::io::Write;
use trellis_gpu::{
    Activation, AdamConfig, Csr, Device, DropoutKey, EdgeWeights, LossOutput, Philox4x32,
    SgdConfig, Stream, Tensor, ThreadBudget,
};

// ---------------------------------------------------------------------------------------------
// The backend interface the tests see: host operands in, host results out.
// ---------------------------------------------------------------------------------------------

/// Edge weights with owned per-head values.
#[derive(Clone)]
enum W {
    Ones,
    Stored,
    PerHead(Vec<f32>, usize),
}

trait Backend {
    fn name(&self) -> String;
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        alpha: f32,
        a: &Tensor,
        a_rows: usize,
        ta: bool,
        b: &Tensor,
        tb: bool,
        beta: f32,
        c: &Tensor,
    ) -> Vec<f32>;
    fn spmm(&self, csr: &Csr, w: &W, x: &Tensor) -> Vec<f32>;
    fn sddmm_dot(&self, csr: &Csr, heads: usize, a: &Tensor, b: &Tensor) -> Vec<f32>;
    fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Vec<f32>;
    fn edge_softmax(&self, csr: &Csr, heads: usize, s: &[f32]) -> Vec<f32>;
    fn edge_softmax_backward(&self, csr: &Csr, heads: usize, a: &[f32], g: &[f32]) -> Vec<f32>;
    fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Vec<f32>;
    fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &Tensor) -> Vec<f32>;
    fn add_bias(&self, x: &Tensor, bias: &Tensor) -> Vec<f32>;
    fn add_column_sums(&self, g: &Tensor, out: &Tensor) -> Vec<f32>;
    /// `(activation(x), activate(x), activation_backward(x, gy), backward_from_output(act(x), gy))`.
    fn activations(&self, act: Activation, x: &Tensor, gy: &Tensor) -> [Vec<f32>; 4];
    /// `(positive_bits(y), mask_by_bits(bits, g))`.
    fn bits(&self, y: &Tensor, g: &Tensor) -> (Vec<u64>, Vec<f32>);
    fn dropout(&self, x: &Tensor, gids: &[u32], key: DropoutKey, p: f32) -> Vec<f32>;
    fn dropout_csr(&self, m: &Csr, gids: &[u32], key: DropoutKey, p: f32) -> Vec<f32>;
    #[allow(clippy::too_many_arguments)]
    fn edge_dropout(
        &self,
        csr: &Csr,
        vals: &[f32],
        heads: usize,
        gids: &[u32],
        key: DropoutKey,
        p: f32,
    ) -> Vec<f32>;
    fn axpy(&self, alpha: f32, x: &Tensor, y: &Tensor) -> Vec<f32>;
    fn softmax_nll(
        &self,
        logits: &Tensor,
        labels: &[u32],
        rows: &[u32],
        scale: f32,
    ) -> (LossOutput, Vec<f32>);
    fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> usize;
    /// `(param, m, v)` after one Adam step.
    fn adam(
        &self,
        cfg: &AdamConfig,
        t: u64,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> [Vec<f32>; 3];
    /// `(param, buf)` after one SGD step.
    fn sgd(&self, cfg: &SgdConfig, p: &Tensor, g: &Tensor, buf: &Tensor) -> [Vec<f32>; 2];
    fn digest(&self, ts: &[&Tensor]) -> String;
}

struct Cpu(Stream);

impl Backend for Cpu {
    fn name(&self) -> String {
        format!("cpu ({} threads)", self.0.threads())
    }
    fn gemm(
        &self,
        alpha: f32,
        a: &Tensor,
        a_rows: usize,
        ta: bool,
        b: &Tensor,
        tb: bool,
        beta: f32,
        c: &Tensor,
    ) -> Vec<f32> {
        let mut c = c.clone();
        self.0
            .gemm_prefix(alpha, a, a_rows, ta, b, tb, beta, &mut c)
            .unwrap();
        c.into_vec()
    }
    fn spmm(&self, csr: &Csr, w: &W, x: &Tensor) -> Vec<f32> {
        let mut out = Tensor::zeros(csr.n_rows(), x.cols());
        let w = match w {
            W::Ones => EdgeWeights::Ones,
            W::Stored => EdgeWeights::Stored,
            W::PerHead(v, h) => EdgeWeights::PerHead(v, *h),
        };
        self.0.spmm(csr, w, x, &mut out).unwrap();
        out.into_vec()
    }
    fn sddmm_dot(&self, csr: &Csr, heads: usize, a: &Tensor, b: &Tensor) -> Vec<f32> {
        self.0.sddmm_dot(csr, heads, a, b).unwrap()
    }
    fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Vec<f32> {
        self.0.sddmm_add(csr, left, right).unwrap()
    }
    fn edge_softmax(&self, csr: &Csr, heads: usize, s: &[f32]) -> Vec<f32> {
        self.0.edge_softmax(csr, heads, s).unwrap()
    }
    fn edge_softmax_backward(&self, csr: &Csr, heads: usize, a: &[f32], g: &[f32]) -> Vec<f32> {
        self.0.edge_softmax_backward(csr, heads, a, g).unwrap()
    }
    fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Vec<f32> {
        self.0.gather_rows(x, idx).unwrap().into_vec()
    }
    fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &Tensor) -> Vec<f32> {
        let mut out = out.clone();
        self.0.scatter_add_rows(src, idx, &mut out).unwrap();
        out.into_vec()
    }
    fn add_bias(&self, x: &Tensor, bias: &Tensor) -> Vec<f32> {
        let mut x = x.clone();
        self.0.add_bias(&mut x, bias).unwrap();
        x.into_vec()
    }
    fn add_column_sums(&self, g: &Tensor, out: &Tensor) -> Vec<f32> {
        let mut out = out.clone();
        self.0.add_column_sums(g, &mut out).unwrap();
        out.into_vec()
    }
    fn activations(&self, act: Activation, x: &Tensor, gy: &Tensor) -> [Vec<f32>; 4] {
        let s = &self.0;
        let y = s.activation(act, x).unwrap();
        let mut inplace = x.clone();
        s.activate(act, &mut inplace).unwrap();
        let gx = s.activation_backward(act, x, gy).unwrap();
        let mut gyo = gy.clone();
        s.activation_backward_from_output(act, &y, &mut gyo)
            .unwrap();
        [
            y.into_vec(),
            inplace.into_vec(),
            gx.into_vec(),
            gyo.into_vec(),
        ]
    }
    fn bits(&self, y: &Tensor, g: &Tensor) -> (Vec<u64>, Vec<f32>) {
        let bits = self.0.positive_bits(y).unwrap();
        let mut g = g.clone();
        self.0.mask_by_bits(&bits, &mut g).unwrap();
        (bits, g.into_vec())
    }
    fn dropout(&self, x: &Tensor, gids: &[u32], key: DropoutKey, p: f32) -> Vec<f32> {
        let mut x = x.clone();
        self.0.dropout(&mut x, gids, key, p).unwrap();
        x.into_vec()
    }
    fn dropout_csr(&self, m: &Csr, gids: &[u32], key: DropoutKey, p: f32) -> Vec<f32> {
        let mut m = m.clone();
        self.0.dropout_csr(&mut m, gids, key, p).unwrap();
        m.values().unwrap().to_vec()
    }
    fn edge_dropout(
        &self,
        csr: &Csr,
        vals: &[f32],
        heads: usize,
        gids: &[u32],
        key: DropoutKey,
        p: f32,
    ) -> Vec<f32> {
        let mut v = vals.to_vec();
        self.0
            .edge_dropout(csr, &mut v, heads, gids, key, p)
            .unwrap();
        v
    }
    fn axpy(&self, alpha: f32, x: &Tensor, y: &Tensor) -> Vec<f32> {
        let mut y = y.clone();
        self.0.axpy(alpha, x, &mut y).unwrap();
        y.into_vec()
    }
    fn softmax_nll(
        &self,
        logits: &Tensor,
        labels: &[u32],
        rows: &[u32],
        scale: f32,
    ) -> (LossOutput, Vec<f32>) {
        let mut g = Tensor::zeros(logits.rows(), logits.cols());
        let l = self
            .0
            .softmax_nll(logits, labels, rows, scale, &mut g)
            .unwrap();
        (l, g.into_vec())
    }
    fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> usize {
        self.0.accuracy_count(logits, labels, rows).unwrap()
    }
    fn adam(
        &self,
        cfg: &AdamConfig,
        t: u64,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> [Vec<f32>; 3] {
        let (mut p, mut m, mut v) = (p.clone(), m.clone(), v.clone());
        self.0.adam_step(cfg, t, &mut p, g, &mut m, &mut v).unwrap();
        [p.into_vec(), m.into_vec(), v.into_vec()]
    }
    fn sgd(&self, cfg: &SgdConfig, p: &Tensor, g: &Tensor, buf: &Tensor) -> [Vec<f32>; 2] {
        let (mut p, mut b) = (p.clone(), buf.clone());
        self.0.sgd_step(cfg, &mut p, g, &mut b).unwrap();
        [p.into_vec(), b.into_vec()]
    }
    fn digest(&self, ts: &[&Tensor]) -> String {
        self.0.digest(ts).unwrap()
    }
}

#[cfg(feature = "cuda")]
#[path = "backends/cuda_backend.rs"]
mod cuda_backend;

/// The reference: the CPU backend on one thread.
fn reference() -> Cpu {
    Cpu(Stream::new(Device::Cpu, ThreadBudget::new(1).unwrap()).unwrap())
}

/// Every backend compiled in and usable here; a CUDA backend that cannot start is reported
/// on stderr (uncaptured) as skipped, with the reason.
fn backends(test: &str) -> Vec<Box<dyn Backend>> {
    let mut v: Vec<Box<dyn Backend>> = vec![Box::new(Cpu(Stream::new(
        Device::Cpu,
        ThreadBudget::new(4).unwrap(),
    )
    .unwrap()))];
    match cuda() {
        Ok(b) => v.push(b),
        Err(why) => {
            let msg = format!("SKIPPED cuda ({test}): {why}\n");
            // Written to the stderr handle directly: the test harness captures print! and
            // eprint!, and a skip must show even when the test passes.
            let _ = std::io::stderr().lock().write_all(msg.as_bytes());
        }
    }
    v
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Box<dyn Backend>, String> {
    cuda_backend::open().map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Box<dyn Backend>, String> {
    Err("this build has no CUDA backend (built without `--features cuda`)".into())
}

// ---------------------------------------------------------------------------------------------
// Inputs and comparison
// ---------------------------------------------------------------------------------------------

struct Rng {
    g: Philox4x32,
    ctr: u32,
}

impl Rng {
    fn new(seed: u64) -> Self {
        Rng {
            g: Philox4x32::new(seed),
            ctr: 0,
        }
    }
    fn u32(&mut self) -> u32 {
        self.ctr += 1;
        self.g.block([self.ctr, 0xbac, 0, 0])[0]
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.u32() as u64 * n as u64) >> 32) as usize
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| 2.0 * Philox4x32::to_unit(self.u32()) - 1.0)
            .collect()
    }
    fn tensor(&mut self, rows: usize, cols: usize) -> Tensor {
        Tensor::from_vec(rows, cols, self.vec(rows * cols)).unwrap()
    }
    fn indices(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(below) as u32).collect()
    }
    /// A CSR with empty rows (every 5th), an unreferenced last column, duplicates and values.
    fn csr(&mut self, rows: usize, cols: usize, max_deg: usize) -> Csr {
        let mut pairs = Vec::new();
        for i in 0..rows {
            if i % 5 == 0 || cols < 2 {
                continue;
            }
            for _ in 0..1 + self.below(max_deg) {
                pairs.push((i as u32, self.below(cols - 1) as u32));
            }
        }
        let mut m = Csr::from_pairs(rows, cols, &pairs).unwrap();
        let v = self.vec(m.nnz());
        m.set_values(Some(v)).unwrap();
        m
    }
}

/// Widths around warp, SIMD and SpMM tile boundaries.
const WIDTHS: [usize; 9] = [1, 7, 8, 31, 32, 33, 255, 256, 257];

#[track_caller]
fn assert_close(what: &str, backend: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{backend} {what}: length");
    let rms =
        (want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>() / want.len().max(1) as f64).sqrt();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w as f64).abs();
        let tol = 1e-4 * (w.abs() as f64).max(rms).max(1e-6);
        assert!(
            err <= tol,
            "{backend} {what}: element {i}: got {g}, want {w} (err {err:e}, tol {tol:e})"
        );
    }
}

#[track_caller]
fn assert_exact(what: &str, backend: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{backend} {what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w, "{backend} {what}: element {i}: got {g}, want {w}");
    }
}

fn key(seed: u64) -> DropoutKey {
    DropoutKey {
        seed,
        epoch: 3,
        layer: 1,
        site: 2,
    }
}

// ---------------------------------------------------------------------------------------------
// One test per op
// ---------------------------------------------------------------------------------------------

#[test]
fn gemm_all_transposes_and_prefixes() {
    let r = reference();
    let mut rng = Rng::new(1);
    for b in backends("gemm") {
        for (m, n, k) in [(1, 1, 1), (33, 7, 65), (64, 257, 31), (5, 3, 0), (0, 4, 3)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                // a holds 2 extra rows beyond the prefix when not transposed.
                let (ar, ac) = if ta { (k, m) } else { (m + 2, k) };
                let a = rng.tensor(ar, ac);
                let a_rows = if ta { k } else { m };
                let bt = if tb {
                    rng.tensor(n, k)
                } else {
                    rng.tensor(k, n)
                };
                let c = rng.tensor(m, n);
                let want = r.gemm(0.5, &a, a_rows, ta, &bt, tb, -1.25, &c);
                let got = b.gemm(0.5, &a, a_rows, ta, &bt, tb, -1.25, &c);
                assert_close(
                    &format!("gemm {m}x{n}x{k} {ta} {tb}"),
                    &b.name(),
                    &got,
                    &want,
                );
            }
        }
    }
}

#[test]
fn spmm_every_weighting_and_width() {
    let r = reference();
    let mut rng = Rng::new(2);
    for b in backends("spmm") {
        for width in WIDTHS {
            let csr = rng.csr(41, 37, 9);
            let x = rng.tensor(37, width);
            for w in [W::Ones, W::Stored] {
                assert_close(
                    "spmm",
                    &b.name(),
                    &b.spmm(&csr, &w, &x),
                    &r.spmm(&csr, &w, &x),
                );
            }
        }
        for (heads, d) in [(1, 5), (2, 16), (8, 8), (3, 33), (4, 1)] {
            let csr = rng.csr(29, 23, 6);
            let x = rng.tensor(23, heads * d);
            let w = W::PerHead(rng.vec(csr.nnz() * heads), heads);
            assert_close(
                "spmm per head",
                &b.name(),
                &b.spmm(&csr, &w, &x),
                &r.spmm(&csr, &w, &x),
            );
        }
        let empty = Csr::from_pairs(0, 3, &[]).unwrap();
        assert!(b.spmm(&empty, &W::Ones, &rng.tensor(3, 4)).is_empty());
    }
}

#[test]
fn sddmm_dot_and_add() {
    let r = reference();
    let mut rng = Rng::new(3);
    for b in backends("sddmm") {
        for (heads, d) in [(1, 1), (1, 7), (1, 65), (2, 16), (8, 8), (3, 9)] {
            let csr = rng.csr(31, 27, 7);
            let (a, bb) = (rng.tensor(31, heads * d), rng.tensor(27, heads * d));
            let (got, want) = (
                b.sddmm_dot(&csr, heads, &a, &bb),
                r.sddmm_dot(&csr, heads, &a, &bb),
            );
            assert_close("sddmm_dot", &b.name(), &got, &want);
            let (left, right) = (rng.tensor(31, heads), rng.tensor(27, heads));
            let (got, want) = (
                b.sddmm_add(&csr, &left, &right),
                r.sddmm_add(&csr, &left, &right),
            );
            assert_close("sddmm_add", &b.name(), &got, &want);
        }
    }
}

#[test]
fn edge_softmax_forward_and_backward() {
    let r = reference();
    let mut rng = Rng::new(4);
    for b in backends("edge_softmax") {
        for heads in [1, 2, 8] {
            let csr = rng.csr(45, 45, 12);
            let s: Vec<f32> = rng.vec(csr.nnz() * heads).iter().map(|v| 8.0 * v).collect();
            let (got, want) = (
                b.edge_softmax(&csr, heads, &s),
                r.edge_softmax(&csr, heads, &s),
            );
            assert_close("edge_softmax", &b.name(), &got, &want);
            let g = rng.vec(s.len());
            let got = b.edge_softmax_backward(&csr, heads, &want, &g);
            let want = r.edge_softmax_backward(&csr, heads, &want, &g);
            assert_close("edge_softmax_backward", &b.name(), &got, &want);
        }
    }
}

#[test]
fn gather_and_scatter_add_rows() {
    let r = reference();
    let mut rng = Rng::new(5);
    for b in backends("gather/scatter") {
        for width in WIDTHS {
            let x = rng.tensor(19, width);
            let idx = rng.indices(40, 19);
            assert_exact(
                "gather_rows",
                &b.name(),
                &b.gather_rows(&x, &idx),
                &r.gather_rows(&x, &idx),
            );
            let src = rng.tensor(40, width);
            let got = b.scatter_add_rows(&src, &idx, &x);
            assert_close(
                "scatter_add_rows",
                &b.name(),
                &got,
                &r.scatter_add_rows(&src, &idx, &x),
            );
        }
        let x = rng.tensor(4, 3);
        assert!(b.gather_rows(&x, &[]).is_empty());
        assert_exact(
            "scatter none",
            &b.name(),
            &b.scatter_add_rows(&Tensor::zeros(0, 3), &[], &x),
            x.as_slice(),
        );
    }
}

#[test]
fn bias_and_column_sums() {
    let r = reference();
    let mut rng = Rng::new(6);
    for b in backends("bias") {
        for (rows, width) in [(1, 1), (3, 33), (1025, 7), (2100, 65), (0, 5)] {
            let x = rng.tensor(rows, width);
            let bias = rng.tensor(1, width);
            assert_close(
                "add_bias",
                &b.name(),
                &b.add_bias(&x, &bias),
                &r.add_bias(&x, &bias),
            );
            let got = b.add_column_sums(&x, &bias);
            assert_close(
                "add_column_sums",
                &b.name(),
                &got,
                &r.add_column_sums(&x, &bias),
            );
        }
    }
}

#[test]
fn activations_forward_backward_and_bits() {
    let r = reference();
    let mut rng = Rng::new(7);
    for b in backends("activations") {
        for act in [
            Activation::Identity,
            Activation::Relu,
            Activation::Elu { alpha: 1.0 },
            Activation::LeakyRelu { slope: 0.2 },
        ] {
            let (x, gy) = (rng.tensor(13, 67), rng.tensor(13, 67));
            let got = b.activations(act, &x, &gy);
            let want = r.activations(act, &x, &gy);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_close(&format!("{act:?} output {i}"), &b.name(), g, w);
            }
        }
        for n in [1usize, 63, 64, 65, 1000] {
            let (y, g) = (rng.tensor(1, n), rng.tensor(1, n));
            let (gb, gm) = b.bits(&y, &g);
            let (wb, wm) = r.bits(&y, &g);
            assert_eq!(gb, wb, "{} positive_bits {n}", b.name());
            assert_exact("mask_by_bits", &b.name(), &gm, &wm);
        }
    }
}

#[test]
fn dropout_masks_equal_the_cpu_masks() {
    let r = reference();
    let mut rng = Rng::new(8);
    for b in backends("dropout") {
        for (width, p) in [
            (1, 0.5f32),
            (7, 0.5),
            (64, 0.6),
            (65, 0.1),
            (257, 0.9),
            (9, 0.0),
        ] {
            let x = rng.tensor(11, width);
            let gids = rng.indices(11, 1 << 30);
            let k = key(width as u64);
            assert_exact(
                "dropout",
                &b.name(),
                &b.dropout(&x, &gids, k, p),
                &r.dropout(&x, &gids, k, p),
            );
            let m = rng.csr(11, width.max(2), 6);
            let got = b.dropout_csr(&m, &gids, k, p);
            assert_exact(
                "dropout_csr",
                &b.name(),
                &got,
                &r.dropout_csr(&m, &gids, k, p),
            );
            for heads in [1, 3] {
                let vals = rng.vec(m.nnz() * heads);
                let got = b.edge_dropout(&m, &vals, heads, &gids, k, p);
                let want = r.edge_dropout(&m, &vals, heads, &gids, k, p);
                assert_exact("edge_dropout", &b.name(), &got, &want);
            }
        }
    }
}

#[test]
fn axpy_matches() {
    let r = reference();
    let mut rng = Rng::new(9);
    for b in backends("axpy") {
        for n in [0usize, 1, 1000, 70_001] {
            let (x, y) = (rng.tensor(1, n), rng.tensor(1, n));
            assert_close(
                "axpy",
                &b.name(),
                &b.axpy(-0.3, &x, &y),
                &r.axpy(-0.3, &x, &y),
            );
        }
    }
}

#[test]
fn softmax_nll_and_accuracy_count() {
    let r = reference();
    let mut rng = Rng::new(10);
    for b in backends("loss") {
        for classes in [1usize, 2, 7, 40] {
            let n = 57;
            let logits = Tensor::from_vec(
                n,
                classes,
                rng.vec(n * classes).iter().map(|v| 6.0 * v).collect(),
            )
            .unwrap();
            let labels = rng.indices(n, classes);
            let mut rows = rng.indices(30, n);
            rows.push(rows[0]); // a row selected twice counts twice
            let (gl, gg) = b.softmax_nll(&logits, &labels, &rows, 0.25);
            let (wl, wg) = r.softmax_nll(&logits, &labels, &rows, 0.25);
            assert!(
                (gl.loss_sum - wl.loss_sum).abs() <= 1e-4 * wl.loss_sum.abs().max(1.0),
                "{} loss",
                b.name()
            );
            assert_eq!(
                (gl.correct, gl.count),
                (wl.correct, wl.count),
                "{} counts",
                b.name()
            );
            assert_close("softmax_nll grad", &b.name(), &gg, &wg);
            let got = b.accuracy_count(&logits, &labels, &rows);
            assert_eq!(
                got,
                r.accuracy_count(&logits, &labels, &rows),
                "{} accuracy",
                b.name()
            );
        }
    }
}

#[test]
fn optimizer_steps() {
    let r = reference();
    let mut rng = Rng::new(11);
    let adam = AdamConfig {
        lr: 0.01,
        weight_decay: 5e-4,
        ..Default::default()
    };
    let sgd = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 1e-3,
    };
    for b in backends("optimizers") {
        for n in [1usize, 4097, 20_000] {
            let (p, g, m) = (rng.tensor(1, n), rng.tensor(1, n), rng.tensor(1, n));
            let v = Tensor::from_vec(1, n, rng.vec(n).iter().map(|x| x.abs()).collect()).unwrap();
            for t in [1, 7] {
                let got = b.adam(&adam, t, &p, &g, &m, &v);
                let want = r.adam(&adam, t, &p, &g, &m, &v);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(&format!("adam t {t} state {i}"), &b.name(), g, w);
                }
            }
            let got = b.sgd(&sgd, &p, &g, &m);
            let want = r.sgd(&sgd, &p, &g, &m);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_close(&format!("sgd state {i}"), &b.name(), g, w);
            }
        }
    }
}

#[test]
fn digests_agree() {
    let r = reference();
    let mut rng = Rng::new(12);
    let (a, c) = (rng.tensor(3, 5), rng.tensor(0, 5));
    for b in backends("digest") {
        assert_eq!(b.digest(&[&a, &c]), r.digest(&[&a, &c]), "{}", b.name());
    }
}

/// On a machine without a usable GPU, asking for one is a typed error naming what is missing.
#[test]
fn asking_for_cuda_without_a_gpu_is_a_clear_error() {
    let check = Device::Cuda(0).check_available();
    let stream = Stream::new(Device::Cuda(0), ThreadBudget::new(1).unwrap());
    let err = stream
        .expect_err("a CUDA `Stream` is not available in this build")
        .to_string();
    assert!(err.contains("cuda:0"), "{err}");
    #[cfg(not(feature = "cuda"))]
    {
        let e = check.unwrap_err().to_string();
        assert!(e.contains("--features cuda"), "{e}");
    }
    #[cfg(feature = "cuda")]
    {
        let missing = trellis_gpu::cuda::missing_libraries();
        match check {
            Err(trellis_gpu::GpuError::CudaLibrariesMissing { device, missing: m }) => {
                assert_eq!(device, "cuda:0");
                assert_eq!(m, missing);
                assert!(err.contains("cannot load"), "{err}");
            }
            Err(e) => {
                // Libraries present but no device (or a driver that does not initialise).
                assert!(missing.is_empty(), "{e}");
                assert!(e.to_string().contains("cuda:0"), "{e}");
            }
            Ok(()) => {
                let _ = std::io::stderr().lock().write_all(
                    b"cuda:0 is available here: the no-GPU error path is not exercised\n",
                );
            }
        }
        if let Err(e) = trellis_gpu::cuda::GpuStream::new(0) {
            assert!(
                e.to_string().contains("cuda:0") || e.to_string().contains("CUDA"),
                "{e}"
            );
        }
    }
}
