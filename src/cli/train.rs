//! `trellis train`.
use super::telemetry::TelemetryArgs;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use trellis_actors::checkpoint::CheckpointPolicy;
use trellis_actors::{FaultPlan, RunEvent, Topology, TrainingRun};
use trellis_gpu::Device;
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{progress, DataSource, Dataset, ModelKind, RunReport, TrainConfig, Trainer};

/// Options of `trellis train`. Unset hyper-parameters take the paper's Cora settings.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// A PyG export folder, an .npz, an OGB folder, or `synthetic:nodes=N,degree=D,...`.
    #[arg(long, default_value = "synthetic")]
    pub data: String,
    /// gcn, sage or gat.
    #[arg(long, default_value = "gcn")]
    pub model: ModelKind,
    #[arg(long)]
    pub epochs: Option<u32>,
    #[arg(long)]
    pub lr: Option<f32>,
    #[arg(long)]
    pub hidden: Option<usize>,
    /// GAT attention heads of the hidden layer.
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub dropout: Option<f32>,
    #[arg(long)]
    pub weight_decay: Option<f32>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads for kernels (0 = all CPUs).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Do not row-normalise the input features.
    #[arg(long)]
    pub no_normalize_features: bool,
    /// Train with this many partition actors (halo exchange between them); 1 = single process.
    #[arg(long, default_value_t = 1)]
    pub partitions: usize,
    /// How to partition: metis or random.
    #[arg(long, default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// Use (or write) partition files in this folder instead of a temporary one.
    #[arg(long)]
    pub partition_dir: Option<PathBuf>,
    /// Seed of the partitioner (its own: a new --seed reuses the partition files).
    #[arg(long, default_value_t = 0)]
    pub partition_seed: u64,
    /// Replace the partitioning in --partition-dir when it is another one (or corrupt)
    /// instead of stopping with an error.
    #[arg(long)]
    pub repartition: bool,
    /// Inject faults into a partitioned run, e.g. `panic:part=1:epoch=5[:layer=L][:phase=backward]`
    /// (comma separated). The run recovers and ends with the fault-free weights.
    #[arg(long)]
    pub chaos: Option<String>,
    /// Write durable checkpoints (atomic: temporary file, fsync, rename) into this folder.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after every N epochs (and after the last).
    #[arg(long, default_value_t = 5)]
    pub checkpoint_every: u32,
    /// Keep the newest K checkpoints; a resume whose newest checkpoint fails its integrity
    /// check falls back to the one before.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub keep_checkpoints: u32,
    /// Resume from the checkpoint in --checkpoint-dir (if there is one) instead of starting
    /// over; the configuration must match, --epochs may be larger.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Where to write the JSON run report.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Print one line per epoch.
    #[arg(long)]
    pub verbose: bool,
    /// Where kernels run: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`);
    /// each partition actor gets its own stream there.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl TrainArgs {
    /// The checkpoint policy of `--checkpoint-dir`, `--checkpoint-every` and `--resume`.
    pub fn checkpoints(&self) -> Option<CheckpointPolicy> {
        self.checkpoint_dir.as_ref().map(|dir| CheckpointPolicy {
            dir: dir.clone(),
            every: self.checkpoint_every,
            keep: self.keep_checkpoints as usize,
            resume: self.resume,
        })
    }

    /// The training configuration for a loaded data set.
    pub fn config(&self, ds: &Dataset) -> Result<TrainConfig> {
        self.config_for(ds.num_features, ds.num_classes)
    }

    /// The training configuration for `features` inputs and `classes` outputs.
    pub fn config_for(&self, features: usize, classes: usize) -> Result<TrainConfig> {
        let mut cfg = TrainConfig::paper_defaults(self.model, features, classes, self.seed);
        if let Some(e) = self.epochs {
            cfg.epochs = e;
        }
        if let Some(v) = self.lr {
            cfg.lr = v;
        }
        if let Some(v) = self.hidden {
            cfg.model.hidden = v;
        }
        if let Some(v) = self.heads {
            cfg.model.heads = v;
        }
        if let Some(v) = self.dropout {
            cfg.model.dropout = v;
            if self.model == ModelKind::Gat {
                cfg.model.attn_dropout = v;
            }
        }
        if let Some(v) = self.weight_decay {
            cfg.weight_decay = v;
        }
        cfg.threads = self.threads;
        cfg.partition_seed = self.partition_seed;
        cfg.normalize_features = !self.no_normalize_features;
        cfg.device = self
            .device
            .parse()
            .with_context(|| format!("cannot use --device {}", self.device))?;
        Ok(cfg)
    }
}

/// Loads the data named by `--data`.
pub fn load_data(spec: &str) -> Result<Dataset> {
    let src = DataSource::parse(spec).with_context(|| format!("cannot use --data {spec}"))?;
    let sp = progress::spinner("loading");
    let ds = src.load().with_context(|| format!("cannot load {spec}"))?;
    sp.finish_and_clear();
    for w in ds.split_warnings() {
        eprintln!("warning: {spec}: {w}");
    }
    Ok(ds)
}

/// Trains single-process and returns the report.
pub fn train_single(ds: Dataset, cfg: TrainConfig, verbose: bool) -> Result<RunReport> {
    let pb = progress::bar(cfg.epochs as u64, "training");
    let mut trainer = Trainer::from_dataset(ds, cfg)?;
    let report = trainer.run(|log| {
        pb.inc(1);
        if verbose {
            pb.suspend(|| {
                println!(
                    "epoch {:>4}  loss {:.4}  train {:.3}  val {:.3}  test {:.3}  {:.1} ms",
                    log.epoch, log.loss, log.train_acc, log.val_acc, log.test_acc, log.ms
                )
            });
        }
    })?;
    pb.finish_and_clear();
    Ok(report)
}

/// Trains with `a.partitions` partition actors (partitioning, faults and checkpoints as `a`
/// says) through the topology API and returns the report.
pub fn train_partitioned(ds: &Dataset, cfg: TrainConfig, a: &TrainArgs) -> Result<RunReport> {
    let epochs = cfg.epochs as u64;
    let faults = a
        .chaos
        .as_deref()
        .map(FaultPlan::parse)
        .transpose()?
        .unwrap_or_default();
    let parts = a.partitions.max(1);
    let dir = a.partition_dir.as_deref();
    if let (true, Some(d)) = (a.repartition, dir) {
        trellis_runtime::partition::remove_partitions(d)?;
    }
    let mut topo =
        Topology::partition(ds, parts, a.partition_method, dir, cfg)?.with_faults(faults);
    if let Some(pol) = a.checkpoints() {
        topo = topo.with_checkpoints(pol);
    }
    let run = topo.spawn()?;
    follow(run, epochs, a.verbose)
}

/// Shows a run's progress (a bar on a terminal, per-epoch lines with `verbose`, every
/// recovery), stops it on Ctrl-C, and returns its report.
pub fn follow(run: TrainingRun, epochs: u64, verbose: bool) -> Result<RunReport> {
    let cancel = run.canceller();
    // Ctrl-C stops the run after the step in progress; actors and threads are joined.
    let _ = ctrlc::set_handler(move || cancel.store(true, std::sync::atomic::Ordering::SeqCst));
    let pb = progress::bar(epochs, "training");
    for ev in run.events() {
        match ev {
            RunEvent::Epoch(log) => {
                pb.inc(1);
                if verbose {
                    pb.suspend(|| {
                        println!(
                            "epoch {:>4}  loss {:.4}  val {:.3}  test {:.3}  {:.1} ms (compute {:.1}, comm {:.1}, halo {} KiB)",
                            log.epoch, log.loss, log.val_acc, log.test_acc, log.ms, log.compute_ms, log.comm_ms, log.halo_bytes / 1024
                        )
                    });
                }
            }
            RunEvent::Recovered(r) => pb.suspend(|| {
                let what = match r.node {
                    Some(n) => {
                        let moved: Vec<String> = r
                            .replaced
                            .iter()
                            .map(|(p, to)| format!("{p}->node {to}"))
                            .collect();
                        format!("loss of node {n} (partitions {})", moved.join(", "))
                    }
                    None => format!("{} of partition {}", r.kind, r.partition),
                };
                let check = match r.digest_ok {
                    Some(true) => ", restored state matched its digest",
                    Some(false) => ", RESTORED STATE DID NOT MATCH ITS DIGEST",
                    None => "",
                };
                println!(
                    "recovered: {what} in epoch {}: detected after {:.1} ms, ready to replay after {:.1} ms, resumed after {:.1} ms, {} step(s) replayed{check}",
                    r.epoch, r.detected_ms, r.ready_ms, r.resumed_ms, r.steps_replayed
                )
            }),
            RunEvent::Profile(_) => {}
        }
    }
    pb.finish_and_clear();
    Ok(run.wait()?)
}

pub fn run(a: TrainArgs) -> Result<()> {
    let device: Device = a
        .device
        .parse()
        .with_context(|| format!("cannot use --device {}", a.device))?;
    // A clear error (what is missing) before any data is loaded.
    device.check_available()?;
    let telemetry = a.telemetry.start(0)?;
    let ds = load_data(&a.data)?;
    let cfg = a.config(&ds)?;
    let report = if a.partitions > 1
        || a.partition_dir.is_some()
        || a.chaos.is_some()
        || a.checkpoint_dir.is_some()
    {
        train_partitioned(&ds, cfg, &a)?
    } else {
        train_single(ds, cfg, a.verbose)?
    };
    let mut report = report;
    report.code_commit = crate::build_info::commit().map(str::to_string);
    print_summary(&report);
    if let Some(path) = &a.report {
        report.write(path)?;
        println!("report written to {}", path.display());
    }
    a.telemetry.finish(telemetry)
}

/// One paragraph describing a finished run.
pub fn print_summary(r: &RunReport) {
    println!(
        "{} on {} ({} partition{}): test accuracy {:.2}% at best validation epoch {} (val {:.2}%), \
         median epoch {:.1} ms, peak RSS {:.1} MiB\nweights_digest {}",
        r.model,
        r.dataset,
        r.partitions,
        if r.partitions == 1 { "" } else { "s" },
        100.0 * r.test_acc,
        r.best_epoch,
        100.0 * r.best_val_acc,
        r.epoch_ms_median,
        r.peak_rss_bytes as f64 / (1 << 20) as f64,
        r.weights_digest
    );
    for n in &r.nodes {
        println!(
            "node {} at {}: partitions {:?}, sent {:.1} MiB, received {:.1} MiB",
            n.node,
            n.addr,
            n.partitions,
            n.bytes_sent as f64 / (1 << 20) as f64,
            n.bytes_received as f64 / (1 << 20) as f64
        );
    }
    if let Some(t) = &r.trace_id {
        println!("trace_id {t}");
    }
}
