//! Full-batch GCN trained on one CUDA stream (`--device cuda`, feature `cuda`).
//!
//! The runtime's models run on host tensors through `trellis_gpu::Stream`; until they run on
//! device tensors (ARCHITECTURE.md, "CUDA backend"), this driver trains the same GCN on the
//! GPU through `trellis_gpu::cuda::GpuStream`: the model's own initial parameters (from
//! `Model::new`), the same dropout keys (so the same masks), the same layer order
//! (aggregate first when a layer widens its dense input, transform first otherwise; sparse
//! inputs stay sparse) and the same Adam. Its losses and accuracies are compared with the
//! CPU trainer's by `tests/gpu_gcn.rs` and `scripts/gpu-check.sh`.
use anyhow::{ensure, Context, Result};
use std::time::Instant;
use trellis_gpu::cuda::{
    DeviceBits, DeviceCsr, DeviceIndex, DeviceTensor, DeviceWeights, GpuStream,
};
use trellis_gpu::{AdamConfig, Csr, DropoutKey};
use trellis_runtime::train::{input_features, Splits};
use trellis_runtime::{Block, Dataset, Graph, Model, ModelKind, TrainConfig};

/// Features below this density are held sparse (as the CPU trainer does).
const SPARSE_DENSITY: f64 = 0.1;

/// A layer input on the device.
enum Input {
    Dense(DeviceTensor),
    /// Sparse features (their transpose's structure is [`GpuGcn::x_t`]).
    Sparse(DeviceCsr),
}

/// What a layer's backward needs.
enum Saved {
    Input(Input),
    Aggregated(DeviceTensor),
}

struct LayerCache {
    saved: Saved,
    relu: Option<DeviceBits>,
}

/// One epoch's results.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuEpoch {
    pub epoch: u32,
    /// Mean training loss.
    pub loss: f64,
    pub train_acc: f64,
    pub val_acc: f64,
    pub test_acc: f64,
    /// Training step (forward, backward, optimizer), to completion on the device.
    pub ms: f64,
}

/// GCN (any depth) over the whole graph on one GPU stream.
pub struct GpuGcn {
    s: GpuStream,
    cfg: TrainConfig,
    adam: AdamConfig,
    /// `(in, out)` per layer.
    dims: Vec<(usize, usize)>,
    adj: DeviceCsr,
    adj_t: DeviceCsr,
    x: Input,
    /// For sparse features: the structure of `X^T` and, per entry of it, the entry of `X`.
    x_t: Option<(DeviceCsr, DeviceIndex)>,
    gids: DeviceIndex,
    labels: DeviceIndex,
    train: Vec<u32>,
    splits: [DeviceIndex; 3],
    split_sizes: [usize; 3],
    params: Vec<DeviceTensor>,
    moments: Vec<(DeviceTensor, DeviceTensor)>,
    t: u64,
}

impl GpuGcn {
    /// Uploads the graph, features and the model's initial parameters to `cuda:<ordinal>`.
    pub fn new(ds: &Dataset, cfg: TrainConfig, ordinal: usize) -> Result<Self> {
        ensure!(
            cfg.model.kind == ModelKind::Gcn,
            "the CUDA trainer runs GCN only"
        );
        cfg.validate()?;
        let s = GpuStream::new(ordinal)?;
        let graph = Graph::from_dataset(ds)?;
        let block = Block::full(&graph, cfg.model.kind.aggregation())?;
        let model = Model::new(cfg.model.clone())?;
        let splits = Splits::from_dataset(ds);
        ensure!(
            !splits.train.is_empty(),
            "the training mask selects no node"
        );
        let x = input_features(ds, cfg.normalize_features)?;
        let nnz = x.as_slice().iter().filter(|&&v| v != 0.0).count();
        let (x, x_t) = if x.is_empty() || nnz as f64 >= SPARSE_DENSITY * x.len() as f64 {
            (
                Input::Dense(s.upload(x.as_slice(), x.rows(), x.cols())?),
                None,
            )
        } else {
            let m = Csr::from_dense(x.rows(), x.cols(), x.as_slice())?;
            let t = m.transpose();
            let x_t = (s.upload_csr(&t.csr)?, s.upload_index(&t.perm)?);
            (Input::Sparse(s.upload_csr(&m)?), Some(x_t))
        };
        let mut dims = Vec::new();
        for l in 0..model.num_layers() {
            let w = &model.params()[2 * l].value;
            dims.push((w.rows(), w.cols()));
        }
        let params = model
            .params()
            .iter()
            .map(|p| s.upload(p.value.as_slice(), p.value.rows(), p.value.cols()))
            .collect::<trellis_gpu::Result<Vec<_>>>()?;
        let moments = params
            .iter()
            .map(|p| Ok((s.zeros(p.rows(), p.cols())?, s.zeros(p.rows(), p.cols())?)))
            .collect::<trellis_gpu::Result<Vec<_>>>()?;
        let split_sizes = [splits.train.len(), splits.val.len(), splits.test.len()];
        Ok(GpuGcn {
            adam: AdamConfig {
                lr: cfg.lr,
                weight_decay: cfg.weight_decay,
                ..AdamConfig::default()
            },
            dims,
            adj: s.upload_csr(block.adj())?,
            adj_t: s.upload_csr(block.adj_t())?,
            x,
            x_t,
            gids: s.upload_index(block.gids())?,
            labels: s.upload_index(&splits.labels)?,
            splits: [
                s.upload_index(&splits.train)?,
                s.upload_index(&splits.val)?,
                s.upload_index(&splits.test)?,
            ],
            train: splits.train,
            split_sizes,
            params,
            moments,
            t: 0,
            cfg,
            s,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.s.device().name()
    }

    /// One training step and evaluation; `epoch` counts from 1.
    pub fn epoch(&mut self, epoch: u32) -> Result<GpuEpoch> {
        let t0 = Instant::now();
        let (logits, caches) = self.forward(epoch, true)?;
        let mut grad = self.s.zeros(logits.rows(), logits.cols())?;
        let scale = 1.0 / self.train.len() as f32;
        let loss = self
            .s
            .softmax_nll(&logits, &self.labels, &self.train, scale, &mut grad)?;
        drop(logits);
        let grads = self.backward(epoch, caches, grad)?;
        self.t += 1;
        for ((p, g), (m, v)) in self.params.iter_mut().zip(&grads).zip(&mut self.moments) {
            self.s.adam_step(&self.adam, self.t, p, g, m, v)?;
        }
        self.s.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let (logits, _) = self.forward(epoch, false)?;
        let mut acc = [0.0; 3];
        for (k, idx) in self.splits.iter().enumerate() {
            if self.split_sizes[k] > 0 {
                let hit = self.s.accuracy_count(&logits, &self.labels, idx)?;
                acc[k] = hit as f64 / self.split_sizes[k] as f64;
            }
        }
        Ok(GpuEpoch {
            epoch,
            loss: loss.loss_sum / loss.count as f64,
            train_acc: acc[0],
            val_acc: acc[1],
            test_acc: acc[2],
            ms,
        })
    }

    /// Hex BLAKE3 digest of the parameters (as `Model::weights_digest` on the host).
    pub fn weights_digest(&self) -> Result<String> {
        Ok(self.s.digest(&self.params.iter().collect::<Vec<_>>())?)
    }

    fn key(&self, epoch: u32, layer: usize) -> DropoutKey {
        DropoutKey {
            seed: self.cfg.model.seed,
            epoch,
            layer: layer as u16,
            site: 0,
        }
    }

    /// The layer input after dropout (a copy of the features for layer 0).
    fn dropped(&self, x: Input, epoch: u32, layer: usize, train: bool) -> Result<Input> {
        let p = self.cfg.model.dropout;
        if !train || p <= 0.0 {
            return Ok(x);
        }
        let key = self.key(epoch, layer);
        Ok(match x {
            Input::Dense(mut t) => {
                self.s.dropout(&mut t, &self.gids, key, p)?;
                Input::Dense(t)
            }
            Input::Sparse(mut m) => {
                self.s.dropout_csr(&mut m, &self.gids, key, p)?;
                Input::Sparse(m)
            }
        })
    }

    fn features(&self) -> Result<Input> {
        Ok(match &self.x {
            Input::Dense(t) => Input::Dense(self.s.clone_tensor(t)?),
            Input::Sparse(m) => Input::Sparse(self.s.clone_csr(m)?),
        })
    }

    fn forward(&self, epoch: u32, train: bool) -> Result<(DeviceTensor, Vec<LayerCache>)> {
        let s = &self.s;
        let n = self.adj.n_rows();
        let last = self.dims.len() - 1;
        let mut input = self.features()?;
        let mut caches = Vec::new();
        for (l, &(din, dout)) in self.dims.iter().enumerate() {
            let (w, b) = (&self.params[2 * l], &self.params[2 * l + 1]);
            let xd = self.dropped(input, epoch, l, train)?;
            let mut h = s.zeros(n, dout)?;
            let saved = match xd {
                Input::Dense(xt) if dout >= din => {
                    let mut ax = s.zeros(n, din)?;
                    s.spmm(&self.adj, DeviceWeights::Stored, &xt, &mut ax, false)?;
                    s.gemm(1.0, &ax, false, w, false, 0.0, &mut h)?;
                    Saved::Aggregated(ax)
                }
                xi => {
                    let z = self.matmul(&xi, w)?;
                    s.spmm(&self.adj, DeviceWeights::Stored, &z, &mut h, false)?;
                    Saved::Input(xi)
                }
            };
            s.add_bias(&mut h, b)?;
            let relu = if l < last {
                s.activate(trellis_gpu::Activation::Relu, &mut h)?;
                Some(s.positive_bits(&h)?)
            } else {
                None
            };
            if train {
                caches.push(LayerCache { saved, relu });
            }
            if l == last {
                return Ok((h, caches));
            }
            input = Input::Dense(h);
        }
        anyhow::bail!("a model needs at least one layer")
    }

    /// `X W` for a dense or sparse input.
    fn matmul(&self, x: &Input, w: &DeviceTensor) -> Result<DeviceTensor> {
        Ok(match x {
            Input::Dense(t) => self.s.matmul(t, false, w, false)?,
            Input::Sparse(m) => {
                let mut out = self.s.zeros(m.n_rows(), w.cols())?;
                self.s.spmm(m, DeviceWeights::Stored, w, &mut out, false)?;
                out
            }
        })
    }

    /// `gw += X^T g` for a dense or sparse input.
    fn t_matmul_acc(&self, x: &Input, g: &DeviceTensor, gw: &mut DeviceTensor) -> Result<()> {
        match x {
            Input::Dense(t) => Ok(self.s.gemm(1.0, t, true, g, false, 1.0, gw)?),
            Input::Sparse(m) => {
                let (t, perm) = self.x_t.as_ref().context("sparse inputs keep X^T")?;
                let vals = self
                    .s
                    .csr_values(m)?
                    .context("sparse inputs store values")?;
                let tv = self.s.gather_rows(&vals, perm)?;
                let mut prod = self.s.zeros(m.n_cols(), g.cols())?;
                self.s
                    .spmm(t, DeviceWeights::PerHead(&tv, 1), g, &mut prod, false)?;
                Ok(self.s.axpy(1.0, &prod, gw)?)
            }
        }
    }

    fn backward(
        &self,
        epoch: u32,
        caches: Vec<LayerCache>,
        mut g: DeviceTensor,
    ) -> Result<Vec<DeviceTensor>> {
        let s = &self.s;
        let mut grads = self
            .params
            .iter()
            .map(|p| s.zeros(p.rows(), p.cols()))
            .collect::<trellis_gpu::Result<Vec<_>>>()?;
        let n = self.adj.n_rows();
        for (l, c) in caches.into_iter().enumerate().rev() {
            let (din, dout) = self.dims[l];
            if let Some(bits) = &c.relu {
                s.mask_by_bits(bits, &mut g)?;
            }
            let (gw, gb) = grads.split_at_mut(2 * l + 1);
            s.add_column_sums(&g, &mut gb[0])?;
            let gw = &mut gw[2 * l];
            let w = &self.params[2 * l];
            let need_input_grad = l > 0;
            let gx = match c.saved {
                Saved::Input(xd) => {
                    let mut gz = s.zeros(n, dout)?;
                    s.spmm(&self.adj_t, DeviceWeights::Stored, &g, &mut gz, false)?;
                    self.t_matmul_acc(&xd, &gz, gw)?;
                    if !need_input_grad {
                        break;
                    }
                    s.matmul(&gz, false, w, true)?
                }
                Saved::Aggregated(ax) => {
                    s.gemm(1.0, &ax, true, &g, false, 1.0, gw)?;
                    if !need_input_grad {
                        break;
                    }
                    let gax = s.matmul(&g, false, w, true)?;
                    let mut gx = s.zeros(n, din)?;
                    s.spmm(&self.adj_t, DeviceWeights::Stored, &gax, &mut gx, false)?;
                    gx
                }
            };
            g = gx;
            let p = self.cfg.model.dropout;
            if p > 0.0 {
                s.dropout(&mut g, &self.gids, self.key(epoch, l), p)?;
            }
        }
        Ok(grads)
    }
}
