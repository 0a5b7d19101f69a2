//! Epoch time with OpenTelemetry export off, then on (to an in-process OTLP/gRPC receiver), in
//! one process over the same partition files: the overhead figure of the README.
//!
//! ```text
//! cargo run --release --example telemetry_overhead -- [DATA] [PARTS] [EPOCHS] [HIDDEN]
//! ```
//! Export can only be turned on once per process (the tracing subscriber is global), so the
//! "off" round runs first; the first epoch of each round is a warm-up and is not counted.
#[path = "../tests/support/mod.rs"]
mod support;

use anyhow::Result;
use std::path::Path;
use trellis::actors::Topology;
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::report::median;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, Dataset, ModelKind};
use trellis::telemetry::{self, OtlpProtocol, TelemetryOptions};

/// Median training-step and whole-epoch (step + evaluation) ms, first epoch excluded.
fn round(ds: &Dataset, cfg: &TrainConfig, parts: usize, dir: &Path) -> Result<(f64, f64)> {
    let report = Topology::partition(ds, parts, PartitionMethod::Metis, Some(dir), cfg.clone())?
        .spawn()?
        .wait()?;
    let logs = &report.epochs_log[1..];
    let step: Vec<f64> = logs.iter().map(|l| l.ms).collect();
    let epoch: Vec<f64> = logs.iter().map(|l| l.ms + l.eval_ms).collect();
    println!(
        "  per epoch (ms): {:?}",
        epoch.iter().map(|v| v.round()).collect::<Vec<_>>()
    );
    Ok((median(&step), median(&epoch)))
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let data = args.next().unwrap_or_else(|| {
        "synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0".into()
    });
    let parts: usize = args.next().map_or(Ok(2), |s| s.parse())?;
    let epochs: u32 = args.next().map_or(Ok(4), |s| s.parse())?;
    let hidden: usize = args.next().map_or(Ok(256), |s| s.parse())?;
    let ds = DataSource::parse(&data)?.load()?;
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    cfg.epochs = epochs;
    cfg.model.hidden = hidden;
    let dir = std::env::temp_dir().join(format!("trellis-overhead-{}", std::process::id()));

    println!("export off: {data}, {parts} partitions, {epochs} epochs, hidden {hidden}");
    let off = round(&ds, &cfg, parts, &dir)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (addr, store) = support::grpc_receiver(&rt);
    let t = telemetry::init(&TelemetryOptions {
        otlp_endpoint: Some(format!("http://{addr}")),
        protocol: Some(OtlpProtocol::Grpc),
        ..Default::default()
    })?;
    println!("export on (OTLP/gRPC to {addr})");
    let on = round(&ds, &cfg, parts, &dir)?;
    t.shutdown()?;
    let spans = store.spans.lock().map(|s| s.len()).unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);

    let pct = |a: f64, b: f64| 100.0 * (b - a) / a;
    println!("spans received by the collector: {spans}");
    println!(
        "median training step: off {:.1} ms, on {:.1} ms ({:+.2}%)",
        off.0,
        on.0,
        pct(off.0, on.0)
    );
    println!(
        "median epoch (step + eval): off {:.1} ms, on {:.1} ms ({:+.2}%)",
        off.1,
        on.1,
        pct(off.1, on.1)
    );
    Ok(())
}
