//! The CUDA instance of the backend interface: uploads the operands, runs the op on a
//! `GpuStream`, downloads the result.
use super::{Backend, W};
use trellis_gpu::cuda::{DeviceTensor, DeviceWeights, GpuStream};
use trellis_gpu::{Activation, AdamConfig, Csr, DropoutKey, LossOutput, SgdConfig, Tensor};

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
}

impl Backend for Cuda {
    fn name(&self) -> String {
        format!("cuda:0 ({})", self.0.device().name())
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
        let mut dc = self.up(c);
        self.0
            .gemm_prefix(
                alpha,
                &self.up(a),
                a_rows,
                ta,
                &self.up(b),
                tb,
                beta,
                &mut dc,
            )
            .unwrap();
        self.down(&dc)
    }
    fn spmm(&self, csr: &Csr, w: &W, x: &Tensor) -> Vec<f32> {
        let dcsr = self.0.upload_csr(csr).unwrap();
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
        let d = self.0.upload_csr(csr).unwrap();
        self.down(
            &self
                .0
                .sddmm_dot(&d, heads, &self.up(a), &self.up(b))
                .unwrap(),
        )
    }
    fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Vec<f32> {
        let d = self.0.upload_csr(csr).unwrap();
        self.down(
            &self
                .0
                .sddmm_add(&d, &self.up(left), &self.up(right))
                .unwrap(),
        )
    }
    fn edge_softmax(&self, csr: &Csr, heads: usize, s: &[f32]) -> Vec<f32> {
        let d = self.0.upload_csr(csr).unwrap();
        self.down(
            &self
                .0
                .edge_softmax(&d, heads, &self.up_vec(s, heads))
                .unwrap(),
        )
    }
    fn edge_softmax_backward(&self, csr: &Csr, heads: usize, a: &[f32], g: &[f32]) -> Vec<f32> {
        let d = self.0.upload_csr(csr).unwrap();
        let (da, dg) = (self.up_vec(a, heads), self.up_vec(g, heads));
        self.down(&self.0.edge_softmax_backward(&d, heads, &da, &dg).unwrap())
    }
    fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Vec<f32> {
        let di = self.0.upload_index(idx).unwrap();
        self.down(&self.0.gather_rows(&self.up(x), &di).unwrap())
    }
    fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &Tensor) -> Vec<f32> {
        let di = self.0.upload_index(idx).unwrap();
        let mut dout = self.up(out);
        self.0
            .scatter_add_rows(&self.up(src), &di, &mut dout)
            .unwrap();
        self.down(&dout)
    }
    fn add_bias(&self, x: &Tensor, bias: &Tensor) -> Vec<f32> {
        let mut dx = self.up(x);
        self.0.add_bias(&mut dx, &self.up(bias)).unwrap();
        self.down(&dx)
    }
    fn add_column_sums(&self, g: &Tensor, out: &Tensor) -> Vec<f32> {
        let mut dout = self.up(out);
        self.0.add_column_sums(&self.up(g), &mut dout).unwrap();
        self.down(&dout)
    }
    fn activations(&self, act: Activation, x: &Tensor, gy: &Tensor) -> [Vec<f32>; 4] {
        let s = &self.0;
        let (dx, dgy) = (self.up(x), self.up(gy));
        let y = s.activation(act, &dx).unwrap();
        let mut inplace = self.up(x);
        s.activate(act, &mut inplace).unwrap();
        let gx = s.activation_backward(act, &dx, &dgy).unwrap();
        let mut gyo = self.up(gy);
        s.activation_backward_from_output(act, &y, &mut gyo)
            .unwrap();
        [
            self.down(&y),
            self.down(&inplace),
            self.down(&gx),
            self.down(&gyo),
        ]
    }
    fn bits(&self, y: &Tensor, g: &Tensor) -> (Vec<u64>, Vec<f32>) {
        let bits = self.0.positive_bits(&self.up(y)).unwrap();
        let mut dg = self.up(g);
        self.0.mask_by_bits(&bits, &mut dg).unwrap();
        (self.0.download_bits(&bits).unwrap(), self.down(&dg))
    }
    fn dropout(&self, x: &Tensor, gids: &[u32], key: DropoutKey, p: f32) -> Vec<f32> {
        let mut dx = self.up(x);
        let dg = self.0.upload_index(gids).unwrap();
        self.0.dropout(&mut dx, &dg, key, p).unwrap();
        self.down(&dx)
    }
    fn dropout_csr(&self, m: &Csr, gids: &[u32], key: DropoutKey, p: f32) -> Vec<f32> {
        let mut dm = self.0.upload_csr(m).unwrap();
        let dg = self.0.upload_index(gids).unwrap();
        self.0.dropout_csr(&mut dm, &dg, key, p).unwrap();
        self.0.download_csr_values(&dm).unwrap().unwrap()
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
        let d = self.0.upload_csr(csr).unwrap();
        let mut dv = self.up_vec(vals, heads);
        let dg = self.0.upload_index(gids).unwrap();
        self.0
            .edge_dropout(&d, &mut dv, heads, &dg, key, p)
            .unwrap();
        self.down(&dv)
    }
    fn axpy(&self, alpha: f32, x: &Tensor, y: &Tensor) -> Vec<f32> {
        let mut dy = self.up(y);
        self.0.axpy(alpha, &self.up(x), &mut dy).unwrap();
        self.down(&dy)
    }
    fn softmax_nll(
        &self,
        logits: &Tensor,
        labels: &[u32],
        rows: &[u32],
        scale: f32,
    ) -> (LossOutput, Vec<f32>) {
        let mut g = self.0.zeros(logits.rows(), logits.cols()).unwrap();
        let dl = self.0.upload_index(labels).unwrap();
        let l = self
            .0
            .softmax_nll(&self.up(logits), &dl, rows, scale, &mut g)
            .unwrap();
        (l, self.down(&g))
    }
    fn accuracy_count(&self, logits: &Tensor, labels: &[u32], rows: &[u32]) -> usize {
        let (dl, dr) = (
            self.0.upload_index(labels).unwrap(),
            self.0.upload_index(rows).unwrap(),
        );
        self.0.accuracy_count(&self.up(logits), &dl, &dr).unwrap()
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
        let (mut dp, mut dm, mut dv) = (self.up(p), self.up(m), self.up(v));
        self.0
            .adam_step(cfg, t, &mut dp, &self.up(g), &mut dm, &mut dv)
            .unwrap();
        [self.down(&dp), self.down(&dm), self.down(&dv)]
    }
    fn sgd(&self, cfg: &SgdConfig, p: &Tensor, g: &Tensor, buf: &Tensor) -> [Vec<f32>; 2] {
        let (mut dp, mut db) = (self.up(p), self.up(buf));
        self.0.sgd_step(cfg, &mut dp, &self.up(g), &mut db).unwrap();
        [self.down(&dp), self.down(&db)]
    }
    fn digest(&self, ts: &[&Tensor]) -> String {
        let up: Vec<DeviceTensor> = ts.iter().map(|t| self.up(t)).collect();
        self.0.digest(&up.iter().collect::<Vec<_>>()).unwrap()
    }
}
