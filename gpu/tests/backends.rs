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
// The backend interface the tests see: host operands in, host results out (one
// implementation over `Stream`, which dispatches to the backend the stream runs on).
// ---------------------------------------------------------------------------------------------

/// Edge weights with owned per-head values.
#[derive(Clone)]
enum W {
    Ones,
    Stored,
    PerHead(Vec<f32>, usize),
}

/// One `gemm_prefix` call: `c = alpha * op(a[..a_rows]) * op(b) + beta * c`.
struct Gemm {
    alpha: f32,
    a: Tensor,
    a_rows: usize,
    ta: bool,
    b: Tensor,
    tb: bool,
    beta: f32,
    c: Tensor,
}

/// A dropout mask: rows keyed by their global ids `gids`, drop probability `p`.
#[derive(Clone, Copy)]
struct Mask<'a> {
    gids: &'a [u32],
    key: DropoutKey,
    p: f32,
}

/// `softmax_nll`'s loss and gradient.
type Loss = (LossOutput, Vec<f32>);

trait Backend {
    fn name(&self) -> String;
    fn gemm(&self, g: &Gemm) -> Vec<f32>;
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
    fn dropout(&self, x: &Tensor, mask: Mask) -> Vec<f32>;
    fn dropout_csr(&self, m: &Csr, mask: Mask) -> Vec<f32>;
    fn edge_dropout(&self, csr: &Csr, vals: &[f32], heads: usize, mask: Mask) -> Vec<f32>;
    fn axpy(&self, alpha: f32, x: &Tensor, y: &Tensor) -> Vec<f32>;
    fn softmax_nll(&self, logits: &Tensor, labels: &[u32], rows: &[u32], scale: f32) -> Loss;
    fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> usize;
    /// `[param, m, v]` after one Adam step from `state = [param, m, v]`.
    fn adam(&self, cfg: &AdamConfig, t: u64, g: &Tensor, state: [&Tensor; 3]) -> [Vec<f32>; 3];
    /// `[param, buf]` after one SGD step from `state = [param, buf]`.
    fn sgd(&self, cfg: &SgdConfig, g: &Tensor, state: [&Tensor; 2]) -> [Vec<f32>; 2];
    fn digest(&self, ts: &[&Tensor]) -> String;
}

/// A backend behind the device-neutral [`Stream`] API: operands are moved into the stream's
/// memory, the op runs, results come back to the host.
struct OnStream(Stream);

impl OnStream {
    fn up(&self, t: &Tensor) -> Tensor {
        self.0.place(t.clone()).unwrap()
    }
    /// `nnz x heads` per-entry values in the stream's memory.
    fn up_entries(&self, v: &[f32], heads: usize) -> Tensor {
        self.0.upload(v, v.len() / heads.max(1), heads).unwrap()
    }
    fn down(&self, t: &Tensor) -> Vec<f32> {
        self.0.download(t).unwrap()
    }
    /// `t` after `op` updated a copy of it (in the stream's memory) in place.
    fn updated(
        &self,
        t: &Tensor,
        op: impl FnOnce(&Stream, &mut Tensor) -> trellis_gpu::Result<()>,
    ) -> Vec<f32> {
        let mut t = self.up(t);
        op(&self.0, &mut t).unwrap();
        self.down(&t)
    }
}

impl Backend for OnStream {
    fn name(&self) -> String {
        match self.0.device() {
            Device::Cpu => format!("cpu ({} threads)", self.0.threads()),
            d => d.to_string(),
        }
    }
    fn gemm(&self, g: &Gemm) -> Vec<f32> {
        let (a, b) = (self.up(&g.a), self.up(&g.b));
        self.updated(&g.c, |s, c| {
            s.gemm_prefix(g.alpha, &a, g.a_rows, g.ta, &b, g.tb, g.beta, c)
        })
    }
    fn spmm(&self, csr: &Csr, w: &W, x: &Tensor) -> Vec<f32> {
        let per_head;
        let w = match w {
            W::Ones => EdgeWeights::Ones,
            W::Stored => EdgeWeights::Stored,
            W::PerHead(v, h) => {
                per_head = self.up_entries(v, *h);
                EdgeWeights::PerHead(&per_head, *h)
            }
        };
        let x = self.up(x);
        let out = Tensor::zeros(csr.n_rows(), x.cols());
        self.updated(&out, |s, out| s.spmm(csr, w, &x, out))
    }
    fn sddmm_dot(&self, csr: &Csr, heads: usize, a: &Tensor, b: &Tensor) -> Vec<f32> {
        let (a, b) = (self.up(a), self.up(b));
        self.down(&self.0.sddmm_dot(csr, heads, &a, &b).unwrap())
    }
    fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Vec<f32> {
        let (l, r) = (self.up(left), self.up(right));
        self.down(&self.0.sddmm_add(csr, &l, &r).unwrap())
    }
    fn edge_softmax(&self, csr: &Csr, heads: usize, s: &[f32]) -> Vec<f32> {
        let scores = self.up_entries(s, heads);
        self.down(&self.0.edge_softmax(csr, heads, &scores).unwrap())
    }
    fn edge_softmax_backward(&self, csr: &Csr, heads: usize, a: &[f32], g: &[f32]) -> Vec<f32> {
        let (a, g) = (self.up_entries(a, heads), self.up_entries(g, heads));
        self.down(&self.0.edge_softmax_backward(csr, heads, &a, &g).unwrap())
    }
    fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Vec<f32> {
        self.down(&self.0.gather_rows(&self.up(x), idx).unwrap())
    }
    fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &Tensor) -> Vec<f32> {
        let src = self.up(src);
        self.updated(out, |s, out| s.scatter_add_rows(&src, idx, out))
    }
    fn add_bias(&self, x: &Tensor, bias: &Tensor) -> Vec<f32> {
        let bias = self.up(bias);
        self.updated(x, |s, x| s.add_bias(x, &bias))
    }
    fn add_column_sums(&self, g: &Tensor, out: &Tensor) -> Vec<f32> {
        let g = self.up(g);
        self.updated(out, |s, out| s.add_column_sums(&g, out))
    }
    fn activations(&self, act: Activation, x: &Tensor, gy: &Tensor) -> [Vec<f32>; 4] {
        let s = &self.0;
        let xd = self.up(x);
        let y = s.activation(act, &xd).unwrap();
        let inplace = self.updated(x, |s, x| s.activate(act, x));
        let gx = s.activation_backward(act, &xd, &self.up(gy)).unwrap();
        let gyo = self.updated(gy, |s, gy| s.activation_backward_from_output(act, &y, gy));
        [self.down(&y), inplace, self.down(&gx), gyo]
    }
    fn bits(&self, y: &Tensor, g: &Tensor) -> (Vec<u64>, Vec<f32>) {
        let bits = self.0.positive_bits(&self.up(y)).unwrap();
        let g = self.updated(g, |s, g| s.mask_by_bits(&bits, g));
        (self.0.download_bits(&bits).unwrap(), g)
    }
    fn dropout(&self, x: &Tensor, mask: Mask) -> Vec<f32> {
        self.updated(x, |s, x| s.dropout(x, mask.gids, mask.key, mask.p))
    }
    fn dropout_csr(&self, m: &Csr, mask: Mask) -> Vec<f32> {
        let mut m = m.clone();
        self.0
            .dropout_csr(&mut m, mask.gids, mask.key, mask.p)
            .unwrap();
        m.values().unwrap().to_vec()
    }
    fn edge_dropout(&self, csr: &Csr, vals: &[f32], heads: usize, mask: Mask) -> Vec<f32> {
        let mut v = self.up_entries(vals, heads);
        self.0
            .edge_dropout(csr, &mut v, heads, mask.gids, mask.key, mask.p)
            .unwrap();
        self.down(&v)
    }
    fn axpy(&self, alpha: f32, x: &Tensor, y: &Tensor) -> Vec<f32> {
        let x = self.up(x);
        self.updated(y, |s, y| s.axpy(alpha, &x, y))
    }
    fn softmax_nll(&self, logits: &Tensor, labels: &[u32], rows: &[u32], scale: f32) -> Loss {
        let logits = self.up(logits);
        let mut g = self.0.zeros(logits.rows(), logits.cols()).unwrap();
        let l = self
            .0
            .softmax_nll(&logits, labels, rows, scale, &mut g)
            .unwrap();
        (l, self.down(&g))
    }
    fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> usize {
        self.0
            .accuracy_count(&self.up(logits), labels, rows)
            .unwrap()
    }
    fn adam(&self, cfg: &AdamConfig, t: u64, g: &Tensor, state: [&Tensor; 3]) -> [Vec<f32>; 3] {
        let [mut p, mut m, mut v] = state.map(|t| self.up(t));
        let g = self.up(g);
        self.0
            .adam_step(cfg, t, &mut p, &g, &mut m, &mut v)
            .unwrap();
        [p, m, v].map(|t| self.down(&t))
    }
    fn sgd(&self, cfg: &SgdConfig, g: &Tensor, state: [&Tensor; 2]) -> [Vec<f32>; 2] {
        let [mut p, mut b] = state.map(|t| self.up(t));
        let g = self.up(g);
        self.0.sgd_step(cfg, &mut p, &g, &mut b).unwrap();
        [p, b].map(|t| self.down(&t))
    }
    fn digest(&self, ts: &[&Tensor]) -> String {
        let placed: Vec<Tensor> = ts.iter().map(|t| self.up(t)).collect();
        self.0.digest(&placed.iter().collect::<Vec<_>>()).unwrap()
    }
}

/// The reference: the CPU backend on one thread.
fn reference() -> OnStream {
    OnStream(Stream::new(Device::Cpu, ThreadBudget::new(1).unwrap()).unwrap())
}

/// Every backend compiled in and usable here; a CUDA backend that cannot start is reported
/// on stderr (uncaptured) as skipped, with the reason.
fn backends(test: &str) -> Vec<Box<dyn Backend>> {
    let mut v: Vec<Box<dyn Backend>> = vec![Box::new(OnStream(
        Stream::new(Device::Cpu, ThreadBudget::new(4).unwrap()).unwrap(),
    ))];
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

/// A CUDA stream on GPU 0 behind the same [`Stream`] API (its availability check says what is
/// missing, including a build without `--features cuda`).
fn cuda() -> Result<Box<dyn Backend>, String> {
    let budget = ThreadBudget::new(1).map_err(|e| e.to_string())?;
    match Stream::new(Device::Cuda(0), budget) {
        Ok(s) => Ok(Box::new(OnStream(s))),
        Err(e) => Err(e.to_string()),
    }
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

/// Each result of a multi-output op compared with [`assert_close`], as `"{what} {i}"`.
#[track_caller]
fn assert_each_close(what: &str, backend: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_close(&format!("{what} {i}"), backend, g, w);
    }
}

/// Runs `op(args)` on backend `b` and on the reference `r` and compares the results with
/// `cmp` (one of the `assert_*` functions above), naming them `what`.
macro_rules! compare {
    ($cmp:ident, $what:expr, $r:expr, $b:expr, $op:ident($($arg:expr),* $(,)?)) => {
        $cmp(&$what, &$b.name(), &$b.$op($($arg),*), &$r.$op($($arg),*))
    };
}

/// Runs `body` with the reference and each backend in turn (see [`backends`]), drawing inputs
/// from one generator seeded with `seed`.
fn on_backends(test: &str, seed: u64, mut body: impl FnMut(&OnStream, &dyn Backend, &mut Rng)) {
    let r = reference();
    let mut rng = Rng::new(seed);
    for b in backends(test) {
        body(&r, b.as_ref(), &mut rng);
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
    on_backends("gemm", 1, |r, b, rng| {
        for (m, n, k) in [(1, 1, 1), (33, 7, 65), (64, 257, 31), (5, 3, 0), (0, 4, 3)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                // a holds 2 extra rows beyond the prefix when not transposed.
                let (ar, ac) = if ta { (k, m) } else { (m + 2, k) };
                let g = Gemm {
                    alpha: 0.5,
                    a: rng.tensor(ar, ac),
                    a_rows: if ta { k } else { m },
                    ta,
                    b: if tb {
                        rng.tensor(n, k)
                    } else {
                        rng.tensor(k, n)
                    },
                    tb,
                    beta: -1.25,
                    c: rng.tensor(m, n),
                };
                let what = format!("gemm {m}x{n}x{k} {ta} {tb}");
                compare!(assert_close, what, r, b, gemm(&g));
            }
        }
    });
}

#[test]
fn spmm_every_weighting_and_width() {
    on_backends("spmm", 2, |r, b, rng| {
        for width in WIDTHS {
            let csr = rng.csr(41, 37, 9);
            let x = rng.tensor(37, width);
            for w in [W::Ones, W::Stored] {
                compare!(assert_close, "spmm", r, b, spmm(&csr, &w, &x));
            }
        }
        for (heads, d) in [(1, 5), (2, 16), (8, 8), (3, 33), (4, 1)] {
            let csr = rng.csr(29, 23, 6);
            let x = rng.tensor(23, heads * d);
            let w = W::PerHead(rng.vec(csr.nnz() * heads), heads);
            compare!(assert_close, "spmm per head", r, b, spmm(&csr, &w, &x));
        }
        let empty = Csr::from_pairs(0, 3, &[]).unwrap();
        assert!(b.spmm(&empty, &W::Ones, &rng.tensor(3, 4)).is_empty());
    });
}

#[test]
fn sddmm_dot_and_add() {
    on_backends("sddmm", 3, |r, b, rng| {
        for (heads, d) in [(1, 1), (1, 7), (1, 65), (2, 16), (8, 8), (3, 9)] {
            let csr = rng.csr(31, 27, 7);
            let (x, y) = (rng.tensor(31, heads * d), rng.tensor(27, heads * d));
            compare!(
                assert_close,
                "sddmm_dot",
                r,
                b,
                sddmm_dot(&csr, heads, &x, &y)
            );
            let (left, right) = (rng.tensor(31, heads), rng.tensor(27, heads));
            compare!(
                assert_close,
                "sddmm_add",
                r,
                b,
                sddmm_add(&csr, &left, &right)
            );
        }
    });
}

#[test]
fn edge_softmax_forward_and_backward() {
    on_backends("edge_softmax", 4, |r, b, rng| {
        for heads in [1, 2, 8] {
            let csr = rng.csr(45, 45, 12);
            let s: Vec<f32> = rng.vec(csr.nnz() * heads).iter().map(|v| 8.0 * v).collect();
            compare!(
                assert_close,
                "edge_softmax",
                r,
                b,
                edge_softmax(&csr, heads, &s)
            );
            let alpha = r.edge_softmax(&csr, heads, &s);
            let g = rng.vec(s.len());
            compare!(
                assert_close,
                "edge_softmax_backward",
                r,
                b,
                edge_softmax_backward(&csr, heads, &alpha, &g)
            );
        }
    });
}

#[test]
fn gather_and_scatter_add_rows() {
    on_backends("gather/scatter", 5, |r, b, rng| {
        for width in WIDTHS {
            let x = rng.tensor(19, width);
            let idx = rng.indices(40, 19);
            compare!(assert_exact, "gather_rows", r, b, gather_rows(&x, &idx));
            let src = rng.tensor(40, width);
            compare!(
                assert_close,
                "scatter_add_rows",
                r,
                b,
                scatter_add_rows(&src, &idx, &x)
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
    });
}

#[test]
fn bias_and_column_sums() {
    on_backends("bias", 6, |r, b, rng| {
        for (rows, width) in [(1, 1), (3, 33), (1025, 7), (2100, 65), (0, 5)] {
            let x = rng.tensor(rows, width);
            let bias = rng.tensor(1, width);
            compare!(assert_close, "add_bias", r, b, add_bias(&x, &bias));
            compare!(
                assert_close,
                "add_column_sums",
                r,
                b,
                add_column_sums(&x, &bias)
            );
        }
    });
}

#[test]
fn activations_forward_backward_and_bits() {
    on_backends("activations", 7, |r, b, rng| {
        for act in [
            Activation::Identity,
            Activation::Relu,
            Activation::Elu { alpha: 1.0 },
            Activation::LeakyRelu { slope: 0.2 },
        ] {
            let (x, gy) = (rng.tensor(13, 67), rng.tensor(13, 67));
            let what = format!("{act:?} output");
            compare!(assert_each_close, what, r, b, activations(act, &x, &gy));
        }
        for n in [1usize, 63, 64, 65, 1000] {
            let (y, g) = (rng.tensor(1, n), rng.tensor(1, n));
            let (gb, gm) = b.bits(&y, &g);
            let (wb, wm) = r.bits(&y, &g);
            assert_eq!(gb, wb, "{} positive_bits {n}", b.name());
            assert_exact("mask_by_bits", &b.name(), &gm, &wm);
        }
    });
}

#[test]
fn dropout_masks_equal_the_cpu_masks() {
    on_backends("dropout", 8, |r, b, rng| {
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
            let mask = Mask {
                gids: &gids,
                key: key(width as u64),
                p,
            };
            compare!(assert_exact, "dropout", r, b, dropout(&x, mask));
            let m = rng.csr(11, width.max(2), 6);
            compare!(assert_exact, "dropout_csr", r, b, dropout_csr(&m, mask));
            for heads in [1, 3] {
                let vals = rng.vec(m.nnz() * heads);
                compare!(
                    assert_exact,
                    "edge_dropout",
                    r,
                    b,
                    edge_dropout(&m, &vals, heads, mask)
                );
            }
        }
    });
}

#[test]
fn axpy_matches() {
    on_backends("axpy", 9, |r, b, rng| {
        for n in [0usize, 1, 1000, 70_001] {
            let (x, y) = (rng.tensor(1, n), rng.tensor(1, n));
            compare!(assert_close, "axpy", r, b, axpy(-0.3, &x, &y));
        }
    });
}

#[test]
fn softmax_nll_and_accuracy_count() {
    on_backends("loss", 10, |r, b, rng| {
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
    });
}

#[test]
fn optimizer_steps() {
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
    on_backends("optimizers", 11, |r, b, rng| {
        for n in [1usize, 4097, 20_000] {
            let (p, g, m) = (rng.tensor(1, n), rng.tensor(1, n), rng.tensor(1, n));
            let v = Tensor::from_vec(1, n, rng.vec(n).iter().map(|x| x.abs()).collect()).unwrap();
            for t in [1, 7] {
                let what = format!("adam t {t} state");
                compare!(
                    assert_each_close,
                    what,
                    r,
                    b,
                    adam(&adam, t, &g, [&p, &m, &v])
                );
            }
            compare!(
                assert_each_close,
                "sgd state",
                r,
                b,
                sgd(&sgd, &g, [&p, &m])
            );
        }
    });
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
