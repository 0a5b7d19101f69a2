//! `trellis train`.
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
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
    /// Where to write the JSON run report.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Print one line per epoch.
    #[arg(long)]
    pub verbose: bool,
}

impl TrainArgs {
    /// The training configuration for a loaded data set.
    pub fn config(&self, ds: &Dataset) -> Result<TrainConfig> {
        let mut cfg = TrainConfig::paper_defaults(self.model, ds.num_features, ds.num_classes, self.seed);
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
        cfg.normalize_features = !self.no_normalize_features;
        Ok(cfg)
    }
}

/// Loads the data named by `--data`.
pub fn load_data(spec: &str) -> Result<Dataset> {
    let src = DataSource::parse(spec).with_context(|| format!("cannot use --data {spec}"))?;
    let sp = progress::spinner("loading");
    let ds = src.load().with_context(|| format!("cannot load {spec}"))?;
    sp.finish_and_clear();
    Ok(ds)
}

/// Trains single-process and returns the report.
pub fn train_single(ds: &Dataset, cfg: TrainConfig, verbose: bool) -> Result<RunReport> {
    let pb = progress::bar(cfg.epochs as u64, "training");
    let mut trainer = Trainer::new(ds, cfg)?;
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

pub fn run(a: TrainArgs) -> Result<()> {
    let ds = load_data(&a.data)?;
    let cfg = a.config(&ds)?;
    let report = train_single(&ds, cfg, a.verbose)?;
    print_summary(&report);
    if let Some(path) = &a.report {
        report.write(path)?;
        println!("report written to {}", path.display());
    }
    Ok(())
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
}
