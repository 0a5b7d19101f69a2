//! `trellis accuracy`: mean test accuracy over seeds for each model.
use super::train::load_data;
use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use trellis_runtime::{ModelKind, TrainConfig, Trainer};

#[derive(Debug, Clone, Args)]
pub struct AccuracyArgs {
    /// The data set (same forms as `train --data`) [default: the Cora export at
    /// ../shared/datasets/cora, looked up from the current folder, then from the source tree
    /// this binary was built from].
    #[arg(long)]
    pub data: Option<String>,
    /// Number of seeds (0..N).
    #[arg(long, default_value_t = 10, value_parser = super::validate::positive_u64)]
    pub seeds: u64,
    /// Models to run, comma separated.
    #[arg(long, default_value = "gcn,gat,sage", value_delimiter = ',')]
    pub models: Vec<ModelKind>,
    /// CPU threads for kernels (0 = one per CPU).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = super::validate::threads)]
    pub threads: usize,
    /// Hidden width(s) instead of each paper's (one, or one per hidden layer).
    #[arg(long, value_name = "WIDTH[,WIDTH...]", value_parser = super::shape::hidden_widths)]
    pub hidden: Option<super::shape::HiddenWidths>,
    #[command(flatten)]
    pub shape: super::shape::ShapeArgs,
}

/// Where the shared Cora export is looked for when `--data` is not given.
const CORA: &str = "../shared/datasets/cora";

/// The `--data` to use: the one given, else the first Cora export found.
fn data_spec(given: Option<String>) -> Result<String> {
    if let Some(d) = given {
        return Ok(d);
    }
    let candidates = [
        PathBuf::from(CORA),
        Path::new(env!("CARGO_MANIFEST_DIR")).join(CORA),
    ];
    match candidates.iter().find(|p| p.is_dir()) {
        Some(p) => Ok(p.display().to_string()),
        None => bail!(
            "no --data given and no Cora export at {} or {}: pass --data with a PyG export \
             folder (edge_index.npy, x.npy, y.npy, *_mask.npy), an .npz, an OGB folder or \
             synthetic:nodes=N,degree=D,features=F,classes=C",
            candidates[0].display(),
            candidates[1].display()
        ),
    }
}

pub fn run(a: AccuracyArgs) -> Result<()> {
    let spec = data_spec(a.data.clone())?;
    let ds = load_data(&spec)?;
    println!("| model | seeds | test accuracy (mean ± std) | min | max | median epoch ms |");
    println!("|---|---|---|---|---|---|");
    for &kind in &a.models {
        let mut accs = Vec::new();
        let mut ms = Vec::new();
        for seed in 0..a.seeds {
            let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, seed);
            cfg.threads = a.threads;
            a.shape.apply(&mut cfg.model, a.hidden.as_ref())?;
            let report = Trainer::new(&ds, cfg)?.run(|_| {})?;
            accs.push(report.test_acc);
            ms.push(report.epoch_ms_median);
        }
        let n = accs.len() as f64;
        let mean = accs.iter().sum::<f64>() / n;
        let std = (accs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        let min = accs.iter().cloned().fold(f64::INFINITY, f64::min);
        let max = accs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        println!(
            "| {kind} | {} | {:.2} ± {:.2} % | {:.2} | {:.2} | {:.1} |",
            a.seeds,
            100.0 * mean,
            100.0 * std,
            100.0 * min,
            100.0 * max,
            trellis_runtime::report::median(&ms)
        );
    }
    Ok(())
}
