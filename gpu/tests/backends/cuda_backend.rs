//! The CUDA instance of the backend interface: uploads the operands, runs the op on a
//! `GpuStream`, downloads the result.
use super::{Backend, Gemm, Loss, Mask, W};
use trellis_gpu::cuda::{DeviceCsr, DeviceIndex, DeviceTensor, DeviceWeights, GpuStream};
use trellis_gpu::{Activation, AdamConfig, Csr, SgdConfig, Tensor};

pub(super) struct Cuda(GpuStream);

pub(super) fn open() -> trellis_gpu::Result<Box<dyn Backend>> {
    Ok(Box::new(Cuda(GpuStream::new(0)?)))
}

impl Cuda {
    fn up(&self, t: &Tensor) -> DeviceTensor {
        self.0.upload(t.as_slice(), t.rows(), t.cols()).unwrap()
    }
    fn up_vec(&self, v: &[f32], heads: usize) -> DeviceTensor {
        self.0.upload(v, v.len() / heads.max(1), heads).unwrap()
    }
    fn down(&self, t: &DeviceTensor) -> Vec<f32> {
        self.0.download(t).unwrap()
    }
    fn csr(&self, csr: &Csr) -> DeviceCsr {
        self.0.upload_csr(csr).unwrap()
    }
    fn index(&self, idx: &[u32]) -> DeviceIndex {
        self.0.upload_index(idx).unwrap()
    }
    /// `t` uploaded, updated in place by `op` and downloaded.
    fn updated(
        &self,
        t: &Tensor,
        op: impl FnOnce(&GpuStream, &mut DeviceTensor) -> trellis_gpu::Result<()>,
    ) -> Vec<f32> {
        let mut d = self.up(t);
        op(&self.0, &mut d).unwrap();
        self.down(&d)
    }
}

impl Backend for Cuda {
    fn name(&self) -> String {
        format!("cuda:0 ({})", self.0.device().name())
    }
    fn gemm(&self, g: &Gemm) -> Vec<f32> {
        let (a, b) = (self.up(&g.a), self.up(&g.b));
        self.updated(&g.c, |s, c| {
            s.gemm_prefix(g.alpha, &a, g.a_rows, g.ta, &b, g.tb, g.beta, c)
        })
    }
    fn spmm(&self, csr: &Csr, w: &W, x: &Tensor) -> Vec<f32> {
        let dcsr = self.csr(csr);
        let mut out = self.0.zeros(csr.n_rows(), x.cols()).unwrap();
        let per_head;
        let dw = match w {
            W::Ones => DeviceWeights::Ones,
            W::Stored => DeviceWeights::Stored,
            W::PerHead(v, h) => {
                per_head = self.up_vec(v, *h);
                DeviceWeights::PerHead(&per_head, *h)
            }
        };
        self.0
            .spmm(&dcsr, dw, &self.up(x), &mut out, false)
            .unwrap();
        self.down(&out)
    }
    fn sddmm_dot(&self, csr: &Csr, heads: usize, a: &Tensor, b: &Tensor) -> Vec<f32> {
        let (d, a, b) = (self.csr(csr), self.up(a), self.up(b));
        self.down(&self.0.sddmm_dot(&d, heads, &a, &b).unwrap())
    }
    fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Vec<f32> {
        let (d, l, r) = (self.csr(csr), self.up(left), self.up(right));
        self.down(&self.0.sddmm_add(&d, &l, &r).unwrap())
    }
    fn edge_softmax(&self, csr: &Csr, heads: usize, s: &[f32]) -> Vec<f32> {
        let (d, s) = (self.csr(csr), self.up_vec(s, heads));
        self.down(&self.0.edge_softmax(&d, heads, &s).unwrap())
    }
    fn edge_softmax_backward(&self, csr: &Csr, heads: usize, a: &[f32], g: &[f32]) -> Vec<f32> {
        let (d, da, dg) = (self.csr(csr), self.up_vec(a, heads), self.up_vec(g, heads));
        self.down(&self.0.edge_softmax_backward(&d, heads, &da, &dg).unwrap())
    }
    fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Vec<f32> {
        let di = self.index(idx);
        self.down(&self.0.gather_rows(&self.up(x), &di).unwrap())
    }
    fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &Tensor) -> Vec<f32> {
        let (src, di) = (self.up(src), self.index(idx));
        self.updated(out, |s, out| s.scatter_add_rows(&src, &di, out))
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
        let (dx, dgy) = (self.up(x), self.up(gy));
        let y = s.activation(act, &dx).unwrap();
        let inplace = self.updated(x, |s, x| s.activate(act, x));
        let gx = s.activation_backward(act, &dx, &dgy).unwrap();
        let gyo = self.updated(gy, |s, gy| s.activation_backward_from_output(act, &y, gy));
        [self.down(&y), inplace, self.down(&gx), gyo]
    }
    fn bits(&self, y: &Tensor, g: &Tensor) -> (Vec<u64>, Vec<f32>) {
        let bits = self.0.positive_bits(&self.up(y)).unwrap();
        let g = self.updated(g, |s, g| s.mask_by_bits(&bits, g));
        (self.0.download_bits(&bits).unwrap(), g)
    }
    fn dropout(&self, x: &Tensor, mask: Mask) -> Vec<f32> {
        let dg = self.index(mask.gids);
        self.updated(x, |s, x| s.dropout(x, &dg, mask.key, mask.p))
    }
    fn dropout_csr(&self, m: &Csr, mask: Mask) -> Vec<f32> {
        let (mut dm, dg) = (self.csr(m), self.index(mask.gids));
        self.0.dropout_csr(&mut dm, &dg, mask.key, mask.p).unwrap();
        self.0.download_csr_values(&dm).unwrap().unwrap()
    }
    fn edge_dropout(&self, csr: &Csr, vals: &[f32], heads: usize, mask: Mask) -> Vec<f32> {
        let (d, mut dv, dg) = (
            self.csr(csr),
            self.up_vec(vals, heads),
            self.index(mask.gids),
        );
        self.0
            .edge_dropout(&d, &mut dv, heads, &dg, mask.key, mask.p)
            .unwrap();
        self.down(&dv)
    }
    fn axpy(&self, alpha: f32, x: &Tensor, y: &Tensor) -> Vec<f32> {
        let x = self.up(x);
        self.updated(y, |s, y| s.axpy(alpha, &x, y))
    }
    fn softmax_nll(&self, logits: &Tensor, labels: &[u32], rows: &[u32], scale: f32) -> Loss {
        let mut g = self.0.zeros(logits.rows(), logits.cols()).unwrap();
        let dl = self.index(labels);
        let l = self
            .0
            .softmax_nll(&self.up(logits), &dl, rows, scale, &mut g)
            .unwrap();
        (l, self.down(&g))
    }
    fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> usize {
        let (dl, dr) = (self.index(labels), self.index(rows));
        self.0.accuracy_count(&self.up(logits), &dl, &dr).unwrap()
    }
    fn adam(&self, cfg: &AdamConfig, t: u64, g: &Tensor, state: [&Tensor; 3]) -> [Vec<f32>; 3] {
        let [mut p, mut m, mut v] = state.map(|t| self.up(t));
        self.0
            .adam_step(cfg, t, &mut p, &self.up(g), &mut m, &mut v)
            .unwrap();
        [p, m, v].map(|t| self.down(&t))
    }
    fn sgd(&self, cfg: &SgdConfig, g: &Tensor, state: [&Tensor; 2]) -> [Vec<f32>; 2] {
        let [mut p, mut b] = state.map(|t| self.up(t));
        self.0.sgd_step(cfg, &mut p, &self.up(g), &mut b).unwrap();
        [p, b].map(|t| self.down(&t))
    }
    fn digest(&self, ts: &[&Tensor]) -> String {
        let up: Vec<DeviceTensor> = ts.iter().map(|t| self.up(t)).collect();
        self.0.digest(&up.iter().collect::<Vec<_>>()).unwrap()
    }
}
