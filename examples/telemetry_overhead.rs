//! Epoch time with OpenTelemetry export off and on (to an in-process OTLP/gRPC receiver), in
//! one process over the same partition files: the overhead figure of docs/observability.md.
//!
//! ```text
//! cargo run --release --example telemetry_overhead -- [DATA] [PARTS] [EPOCHS] [HIDDEN] [ROUNDS]
//! ```
//! The exporter is installed once (the tracing subscriber is global) and tracing is switched
//! off and on between rounds (`Telemetry::pause_tracing`), so that both conditions alternate
//! and share the machine's load; rounds run `EPOCHS` epochs each over the same files.
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

/// Whole-epoch times (training step + evaluation), ms.
fn round(ds: &Dataset, cfg: &TrainConfig, parts: usize, dir: &Path) -> Result<Vec<f64>> {
    let report = Topology::partition(ds, parts, PartitionMethod::Metis, Some(dir), cfg.clone())?
        .spawn()?
        .wait()?;
    Ok(report.epochs_log.iter().map(|l| l.ms + l.eval_ms).collect())
}

/// Mean cost of one halo-send-like span with export on, in microseconds (fewer spans than the
/// batch queue holds, so none is dropped).
fn span_cost_us() -> f64 {
    let n = 1500;
    let start = std::time::Instant::now();
    for i in 0..n {
        let span = tracing::info_span!(
            target: "trellis::overhead",
            "halo_send",
            partition = 0i64,
            peer = 1i64,
            node = 0i64,
            epoch = 1i64,
            layer = 0i64,
            bytes = i as i64
        );
        let _context = trellis::actors::telemetry::context_of(&span);
        let _entered = span.enter();
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn main() -> Result<()> {
    // Reuse freed tensor memory instead of page-faulting it in again every epoch.
    trellis::tune_allocator();
    let mut args = std::env::args().skip(1);
    let data = args.next().unwrap_or_else(|| {
        "synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0".into()
    });
    let parts: usize = args.next().map_or(Ok(2), |s| s.parse())?;
    let epochs: u32 = args.next().map_or(Ok(3), |s| s.parse())?;
    let hidden: usize = args.next().map_or(Ok(256), |s| s.parse())?;
    let rounds: usize = args.next().map_or(Ok(4), |s| s.parse())?;
    let ds = DataSource::parse(&data)?.load()?;
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    cfg.epochs = epochs;
    cfg.model.hidden = hidden;
    let dir = std::env::temp_dir().join(format!("trellis-overhead-{}", std::process::id()));

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
    println!("{data}: {parts} partitions, hidden {hidden}, {rounds} rounds of {epochs} epochs");
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let exporting = r % 2 == 1;
        t.pause_tracing(!exporting);
        let ms = round(&ds, &cfg, parts, &dir)?;
        let rounded: Vec<f64> = ms.iter().map(|v| v.round()).collect();
        println!(
            "  round {r}, export {}: epochs (ms) {rounded:?}",
            if exporting { "on " } else { "off" }
        );
        if exporting {
            on.extend(ms)
        } else {
            off.extend(ms)
        }
    }
    t.pause_tracing(false);
    t.flush()?;
    let spans = store.spans.lock().map(|s| s.len()).unwrap_or(0);
    let per_span_us = span_cost_us();
    t.shutdown()?;
    let _ = std::fs::remove_dir_all(&dir);

    let (m_off, m_on) = (median(&off), median(&on));
    let per_epoch = spans as f64 / on.len() as f64;
    println!(
        "median epoch: off {m_off:.1} ms, on {m_on:.1} ms ({:+.2}%)",
        100.0 * (m_on - m_off) / m_off
    );
    println!("spans exported: {spans} ({per_epoch:.0} per epoch)");
    println!(
        "one exported span (create, read its context, enter, close): {per_span_us:.2} us; \
         {per_epoch:.0} per epoch cost {:.4}% of the median epoch",
        100.0 * per_epoch * per_span_us / 1e3 / m_on
    );
    Ok(())
}
