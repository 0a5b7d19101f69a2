//! The single-process trainer: full-graph training of one model replica on one stream.
//!
//! This is the reference the partitioned runtime is compared against: the partition actors run
//! the same layers on their blocks and must reproduce its losses.
use crate::comm::HaloConfig;
use crate::grad_codec::GradCodec;
use crate::metrics::{names, Key, Metrics};
use crate::model::{LayerInput, StepCtx};
use crate::report::{self, BestTracker, EpochLog, RunReport};
use crate::{
    Block, Dataset, Graph, Model, ModelConfig, ModelKind, Optimizer, OptimizerKind, Result,
    RuntimeError,
};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use trellis_gpu::{AdamConfig, Device, Stream, Tensor, ThreadBudget};

/// Everything that defines a training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub model: ModelConfig,
    pub epochs: u32,
    pub lr: f32,
    pub weight_decay: f32,
    /// Row-normalise input features (as the GCN and GAT papers do).
    pub normalize_features: bool,
    /// CPU threads for kernels (0 = all CPUs).
    pub threads: usize,
    /// Where the kernels run: `cpu`, or `cuda:N` (each trainer or partition actor gets its
    /// own stream there). Written as text; absent means the CPU.
    #[serde(default, with = "device_text")]
    pub device: Device,
    /// Partitioned runs: start the aggregation over a split layer's inner rows before its halo
    /// rows arrive and add their part when they do. `None` = on GPU streams (whose work runs
    /// while the host exchanges), off on the CPU (where it would only change summation order).
    #[serde(default)]
    pub halo_overlap: Option<bool>,
    /// Seed of the partitioner (the random method's hash; METIS's tie-breaks). Separate from
    /// the model's seed, so a run with a new training seed reuses the same partition files.
    #[serde(default)]
    pub partition_seed: u64,
    /// How partitions compress the gradients they send to the all-reduce (with error
    /// feedback; partitioned runs only). `none`: exact.
    #[serde(default, skip_serializing_if = "GradCodec::is_none")]
    pub grad_codec: GradCodec,
    /// Partitioned runs: how halo rows are encoded (exact fp32 unless set; then not written,
    /// so exact runs' configurations read as before).
    #[serde(default, skip_serializing_if = "HaloConfig::is_exact")]
    pub halo: HaloConfig,
}

/// [`Device`] as its text form (`cpu`, `cuda:0`) in serialized configs.
mod device_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use trellis_gpu::Device;

    pub fn serialize<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(d)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl TrainConfig {
    /// Each paper's Cora settings for `kind` on a data set of the given widths.
    pub fn paper_defaults(kind: ModelKind, in_dim: usize, classes: usize, seed: u64) -> Self {
        let lr = match kind {
            ModelKind::Gat => 0.005,
            _ => 0.01,
        };
        TrainConfig {
            model: ModelConfig::paper_defaults(kind, in_dim, classes, seed),
            epochs: 200,
            lr,
            weight_decay: 5e-4,
            normalize_features: true,
            threads: 0,
            device: Device::Cpu,
            halo_overlap: None,
            partition_seed: 0,
            grad_codec: GradCodec::None,
            halo: HaloConfig::default(),
        }
    }

    /// Whether partitioned runs overlap the halo exchange of split layers (see
    /// [`TrainConfig::halo_overlap`]).
    pub fn overlaps_halo(&self) -> bool {
        self.halo_overlap
            .unwrap_or(matches!(self.device, Device::Cuda(_)))
    }

    /// The optimizer this config asks for.
    pub fn optimizer(&self) -> OptimizerKind {
        OptimizerKind::Adam(AdamConfig {
            lr: self.lr,
            weight_decay: self.weight_decay,
            ..AdamConfig::default()
        })
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        let lr_ok = self.lr > 0.0 && self.lr.is_finite();
        let wd_ok = self.weight_decay >= 0.0 && self.weight_decay.is_finite();
        if !lr_ok || !wd_ok {
            return Err(RuntimeError::Config(
                "lr must be > 0 and weight decay >= 0".into(),
            ));
        }
        Ok(())
    }
}

/// Node id lists of the three splits, and the labels.
#[derive(Debug, Clone)]
pub struct Splits {
    pub labels: Vec<u32>,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    pub test: Vec<u32>,
}

impl Splits {
    /// From a data set's masks.
    pub fn from_dataset(ds: &Dataset) -> Self {
        Splits {
            labels: ds.labels.clone(),
            train: Dataset::mask_ids(&ds.train_mask),
            val: Dataset::mask_ids(&ds.val_mask),
            test: Dataset::mask_ids(&ds.test_mask),
        }
    }
}

/// Features as the model sees them (row-normalised if asked).
pub fn input_features(ds: &Dataset, normalize: bool) -> Result<Tensor> {
    input_tensor(ds, ds.features.clone(), normalize)
}

fn input_tensor(ds: &Dataset, mut x: Vec<f32>, normalize: bool) -> Result<Tensor> {
    if normalize {
        normalize_rows(&mut x, ds.num_features);
    }
    Ok(Tensor::from_vec(ds.num_nodes, ds.num_features, x)?)
}

/// Row-normalises a row-major matrix in place: each row is divided by its sum (rows summing to
/// zero stay as they are), as Kipf & Welling and PyG's `NormalizeFeatures` do.
pub fn normalize_rows(x: &mut [f32], width: usize) {
    if width == 0 {
        return;
    }
    for row in x.chunks_mut(width) {
        let s: f32 = row.iter().sum();
        if s != 0.0 {
            row.iter_mut().for_each(|v| *v /= s);
        }
    }
}

/// Full-graph trainer on one stream.
pub struct Trainer {
    cfg: TrainConfig,
    stream: Stream,
    block: Block,
    x: LayerInput,
    splits: Splits,
    model: Model,
    opt: Optimizer,
    dataset: String,
    data_digest: String,
    /// Host copies of the parameters after the epoch of best validation accuracy (what the
    /// report's test accuracy comes from), kept while [`Trainer::run`] runs.
    best_values: Option<BestValues>,
}

/// The parameters of one epoch, on the host.
#[derive(Debug, Clone)]
struct BestValues {
    epoch: u32,
    values: Vec<Tensor>,
}

impl Trainer {
    /// Prepares the graph block, features and a freshly initialised model (copies the features).
    pub fn new(ds: &Dataset, cfg: TrainConfig) -> Result<Self> {
        Self::from_dataset(ds.clone(), cfg)
    }

    /// As [`Trainer::new`], taking the data set so its features are not held twice.
    pub fn from_dataset(mut ds: Dataset, cfg: TrainConfig) -> Result<Self> {
        cfg.validate()?;
        let data_digest = ds.digest();
        let features = std::mem::take(&mut ds.features);
        let stream = Stream::new(cfg.device, ThreadBudget::global(cfg.threads)?)?;
        let graph = Graph::from_dataset(&ds)?;
        let block = Block::full(&graph, cfg.model.kind.aggregation())?;
        drop(graph);
        let x = LayerInput::auto(
            &stream,
            input_tensor(&ds, features, cfg.normalize_features)?,
        )?;
        let mut model = Model::new(cfg.model.clone())?;
        model.place(&stream)?;
        let opt = Optimizer::new(cfg.optimizer(), &model);
        let splits = Splits::from_dataset(&ds);
        if splits.train.is_empty() {
            return Err(RuntimeError::BadData(
                "the training mask selects no node".into(),
            ));
        }
        Ok(Trainer {
            cfg,
            stream,
            block,
            x,
            splits,
            model,
            opt,
            dataset: ds.name.clone(),
            data_digest,
            best_values: None,
        })
    }

    /// The model being trained.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The data digest of the data set being trained on.
    pub fn data_digest(&self) -> &str {
        &self.data_digest
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }

    /// A host copy of the model after the epoch of best validation accuracy of the last
    /// [`Trainer::run`], and that epoch (`None` before a run).
    pub fn best_model(&self) -> Result<Option<(u32, Model)>> {
        self.best_values
            .as_ref()
            .map(|b| {
                Ok((
                    b.epoch,
                    Model::with_values(self.cfg.model.clone(), b.values.clone())?,
                ))
            })
            .transpose()
    }

    /// The compute stream (its kernel clock times the steps).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Makes the trainer's work background work of `gate` (serving beside training): its
    /// long kernels pause between pieces while an inference step holds the gate.
    pub fn yield_to(&mut self, gate: trellis_gpu::PriorityGate) {
        self.stream = self.stream.yielding_to(gate);
    }

    /// One training step (forward, backward, optimizer); `epoch` counts from 1. Returns the
    /// mean training loss and the step's wall time in ms.
    pub fn train_step(&mut self, epoch: u32) -> Result<(f64, f64)> {
        let s = &self.stream;
        let t0 = Instant::now();
        self.model.zero_grad(s)?;
        let logits =
            self.model
                .forward_full(s, &self.block, &self.x, StepCtx { epoch, train: true })?;
        let mut grad = s.zeros(logits.rows(), logits.cols())?;
        let scale = 1.0 / self.splits.train.len() as f32;
        let loss = s.softmax_nll(
            &logits,
            &self.splits.labels,
            &self.splits.train,
            scale,
            &mut grad,
        )?;
        drop(logits);
        self.model.backward_full(s, &self.block, grad)?;
        self.opt.step(s, &mut self.model)?;
        // A GPU stream runs ahead of the host: the step ends when its work does.
        s.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Metrics::global().record_ms(Key::new(names::STEP), ms);
        Ok((loss.loss_sum / loss.count as f64, ms))
    }

    /// One training step plus evaluation; `epoch` counts from 1.
    pub fn epoch(&mut self, epoch: u32) -> Result<EpochLog> {
        let _span =
            tracing::info_span!("epoch", epoch = i64::from(epoch), partition = 0i64).entered();
        let (loss, ms) = self.train_step(epoch)?;
        let t1 = Instant::now();
        let (train_acc, val_acc, test_acc) = self.evaluate(epoch)?;
        let eval_ms = t1.elapsed().as_secs_f64() * 1e3;
        Ok(EpochLog {
            epoch,
            loss,
            train_acc,
            val_acc,
            test_acc,
            ms,
            eval_ms,
            grad_bytes: 0,
            grad_bytes_exact: 0,
            compute_ms: ms,
            comm_ms: 0.0,
            halo_bytes: 0,
            halo_fp32_bytes: 0,
            eval_halo_bytes: 0,
            eval_halo_fp32_bytes: 0,
            weights_digest: self.model.weights_digest(&self.stream)?,
            part_compute_ms: vec![ms],
            replica_bytes: 0,
            replica_ms: 0.0,
        })
    }

    /// Accuracy on the three splits with dropout off.
    pub fn evaluate(&mut self, epoch: u32) -> Result<(f64, f64, f64)> {
        let s = &self.stream;
        let logits = self.model.forward_full(
            s,
            &self.block,
            &self.x,
            StepCtx {
                epoch,
                train: false,
            },
        )?;
        let acc = |ids: &[u32]| -> Result<f64> {
            Ok(if ids.is_empty() {
                0.0
            } else {
                s.accuracy_count(&logits, &self.splits.labels, ids)? as f64 / ids.len() as f64
            })
        };
        Ok((
            acc(&self.splits.train)?,
            acc(&self.splits.val)?,
            acc(&self.splits.test)?,
        ))
    }

    /// Trains for the configured epochs, calling `on_epoch` after each, and returns the report.
    pub fn run(&mut self, mut on_epoch: impl FnMut(&EpochLog)) -> Result<RunReport> {
        self.run_with_model(|log, _, _| {
            on_epoch(log);
            Ok(())
        })
    }

    /// As [`Trainer::run`]; `on_epoch` also gets the model after the epoch's update and its
    /// stream (to publish the weights, say), and an error from it stops the run.
    pub fn run_with_model(
        &mut self,
        mut on_epoch: impl FnMut(&EpochLog, &Model, &Stream) -> Result<()>,
    ) -> Result<RunReport> {
        let _span =
            tracing::info_span!("run", partitions = 1i64, model = %self.cfg.model.kind).entered();
        let before = Metrics::global().snapshot();
        let mut logs = Vec::with_capacity(self.cfg.epochs as usize);
        let mut best = BestTracker::default();
        for epoch in 1..=self.cfg.epochs {
            let log = self.epoch(epoch)?;
            if !log.loss.is_finite() {
                return Err(RuntimeError::BadData(format!(
                    "training diverged: loss {} at epoch {epoch}",
                    log.loss
                )));
            }
            best.update(&log);
            if best.best_epoch == epoch {
                self.best_values = Some(BestValues {
                    epoch,
                    values: self.model.values_on_host(&self.stream)?,
                });
            }
            on_epoch(&log, &self.model, &self.stream)?;
            logs.push(log);
        }
        let mut report = build_report(
            &self.cfg,
            &self.dataset,
            &self.data_digest,
            1,
            0,
            self.stream.threads(),
            &best,
            logs,
            self.model.weights_digest(&self.stream)?,
        );
        let run = Metrics::global().snapshot().since(&before);
        report.latency = run.summaries();
        report.counters = run.counter_values();
        Ok(report)
    }
}

/// Assembles a run report from the epoch logs.
#[allow(clippy::too_many_arguments)]
pub fn build_report(
    cfg: &TrainConfig,
    dataset: &str,
    data_digest: &str,
    partitions: usize,
    edge_cut: u64,
    threads: usize,
    best: &BestTracker,
    logs: Vec<EpochLog>,
    weights_digest: String,
) -> RunReport {
    let ms: Vec<f64> = logs.iter().map(|l| l.ms).collect();
    RunReport {
        model: cfg.model.kind.to_string(),
        dataset: dataset.to_string(),
        data_digest: data_digest.to_string(),
        seed: cfg.model.seed,
        epochs: cfg.epochs,
        partitions,
        edge_cut,
        threads,
        test_acc: best.test_at_best,
        best_val_acc: best.best_val_acc,
        best_epoch: best.best_epoch,
        step_ms_median: report::median(&ms),
        peak_rss_bytes: report::peak_rss_bytes(),
        weights_digest,
        config: serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null),
        code_version: env!("CARGO_PKG_VERSION").to_string(),
        code_commit: None,
        trace_id: None,
        latency: Default::default(),
        counters: Default::default(),
        recoveries: serde_json::Value::Array(Vec::new()),
        nodes: Vec::new(),
        epochs_log: logs,
    }
}
