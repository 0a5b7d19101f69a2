//! `trellis accuracy`: mean test accuracy over seeds for each model.
use super::train::load_data;
use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use trellis_actors::Topology;
use trellis_runtime::comm::{HaloCodec, HaloConfig};
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{Dataset, ModelKind, TrainConfig, Trainer};

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
    /// Train with P partition actors (METIS) instead of one process.
    #[arg(long, value_name = "P", default_value_t = 1, value_parser = super::validate::partitions)]
    pub partitions: usize,
    /// With --partitions: one row per halo codec (comma separated: fp32, fp16, bf16, int8,
    /// int4, adaptive), with the halo bytes sent against fp32's.
    #[arg(
        long,
        value_name = "CODECS",
        default_value = "fp32",
        value_delimiter = ','
    )]
    pub halo_codecs: Vec<String>,
    /// The adaptive codec's error bound (as `train --halo-error-bound`).
    #[arg(long, value_name = "E", default_value_t = trellis_runtime::comm::DEFAULT_ERROR_BOUND)]
    pub halo_error_bound: f32,
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
    let codecs = a
        .halo_codecs
        .iter()
        .map(|c| c.parse::<HaloCodec>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let halo = |codec| HaloConfig {
        codec,
        error_bound: a.halo_error_bound,
        ..HaloConfig::default()
    };
    for c in &codecs {
        halo(*c).validate()?;
    }
    if a.partitions == 1 && codecs.iter().any(|c| *c != HaloCodec::Fp32) {
        bail!("--halo-codecs needs --partitions 2 or more (one process exchanges no halo rows)");
    }
    let spec = data_spec(a.data.clone())?;
    let ds = load_data(&spec)?;
    if a.partitions > 1 {
        println!("| model | partitions | halo codec | seeds | test accuracy (mean ± std) | min | max | median step ms | halo bytes vs fp32 |");
        println!("|---|---|---|---|---|---|---|---|---|");
    } else {
        println!("| model | seeds | test accuracy (mean ± std) | min | max | median step ms |");
        println!("|---|---|---|---|---|---|");
    }
    for &kind in &a.models {
        for &codec in &codecs {
            table_row(&a, &ds, kind, halo(codec))?;
        }
    }
    Ok(())
}

/// Trains `a.seeds` runs of `kind` with halo settings `halo` and prints their table row.
fn table_row(a: &AccuracyArgs, ds: &Dataset, kind: ModelKind, halo: HaloConfig) -> Result<()> {
    let mut accs = Vec::new();
    let mut ms = Vec::new();
    let (mut sent, mut fp32) = (0u64, 0u64);
    for seed in 0..a.seeds {
        let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, seed);
        cfg.threads = a.threads;
        a.shape.apply(&mut cfg.model, a.hidden.as_ref())?;
        cfg.halo = halo;
        let report = if a.partitions > 1 {
            let topo = Topology::partition(ds, a.partitions, PartitionMethod::Metis, None, cfg)?;
            let run = topo.spawn()?;
            for _ in run.events() {}
            run.wait()?
        } else {
            Trainer::new(ds, cfg)?.run(|_| {})?
        };
        sent += report.epochs_log.iter().map(|l| l.halo_bytes).sum::<u64>();
        fp32 += report
            .epochs_log
            .iter()
            .map(|l| l.halo_fp32_bytes)
            .sum::<u64>();
        accs.push(report.test_acc);
        ms.push(report.step_ms_median);
    }
    let n = accs.len() as f64;
    let mean = accs.iter().sum::<f64>() / n;
    let std = (accs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    let min = accs.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = accs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let stats = format!(
        "{} | {:.2} ± {:.2} % | {:.2} | {:.2} | {:.1}",
        a.seeds,
        100.0 * mean,
        100.0 * std,
        100.0 * min,
        100.0 * max,
        trellis_runtime::report::median(&ms)
    );
    if a.partitions > 1 {
        let ratio = sent as f64 / fp32.max(1) as f64;
        println!(
            "| {kind} | {} | {} | {stats} | {:.3} ({:.2}x fewer) |",
            a.partitions,
            halo.codec,
            ratio,
            1.0 / ratio.max(f64::MIN_POSITIVE)
        );
    } else {
        println!("| {kind} | {stats} |");
    }
    Ok(())
}
