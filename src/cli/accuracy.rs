//! `trellis accuracy`: mean test accuracy over seeds for each model.
use super::train::{load_data, TrainArgs};
use anyhow::Result;
use clap::Args;
use trellis_runtime::{ModelKind, Trainer};

#[derive(Debug, Clone, Args)]
pub struct AccuracyArgs {
    /// The data set (default: the shared Cora export).
    #[arg(long, default_value = "../shared/datasets/cora")]
    pub data: String,
    /// Number of seeds (0..N).
    #[arg(long, default_value_t = 10)]
    pub seeds: u64,
    /// Models to run, comma separated.
    #[arg(long, default_value = "gcn,gat,sage", value_delimiter = ',')]
    pub models: Vec<ModelKind>,
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

pub fn run(a: AccuracyArgs) -> Result<()> {
    let ds = load_data(&a.data)?;
    println!("| model | seeds | test accuracy (mean ± std) | min | max | median epoch ms |");
    println!("|---|---|---|---|---|---|");
    for &kind in &a.models {
        let mut accs = Vec::new();
        let mut ms = Vec::new();
        for seed in 0..a.seeds {
            let args = TrainArgs {
                data: a.data.clone(),
                model: kind,
                epochs: None,
                lr: None,
                hidden: None,
                heads: None,
                dropout: None,
                weight_decay: None,
                seed,
                threads: a.threads,
                no_normalize_features: false,
                partitions: 1,
                partition_method: trellis_runtime::partition::PartitionMethod::Metis,
                partition_dir: None,
                chaos: None,
                report: None,
                verbose: false,
                telemetry: Default::default(),
            };
            let cfg = args.config(&ds)?;
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
