//! Spawning a training topology from code: partition a data set into P parts, start one
//! partition actor per part, train while receiving per-epoch events, read the report, shut down.
//!
//! ```text
//! cargo run --release --example train_topology -- [DATA] [PARTS] [EPOCHS]
//! ```
use anyhow::Result;
use trellis::actors::{RunEvent, Topology};
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, ModelKind};

fn main() -> Result<()> {
    // Reuse freed tensor memory instead of page-faulting it in again every epoch.
    trellis::tune_allocator();
    let mut args = std::env::args().skip(1);
    let data = args
        .next()
        .unwrap_or_else(|| "synthetic:nodes=5000,degree=10,features=32,classes=6,seed=1".into());
    let parts: usize = args.next().map_or(Ok(4), |s| s.parse())?;
    let epochs: u32 = args.next().map_or(Ok(20), |s| s.parse())?;

    // 1. Load a data set (a PyG export folder, an .npz, an OGB folder or a synthetic spec).
    let ds = DataSource::parse(&data)?.load()?;

    // 2. A model and training configuration: the GCN paper's Cora settings, 2 kernel threads.
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 42);
    cfg.epochs = epochs;
    cfg.threads = 2;

    // 3. Partition with METIS into a temporary folder and spawn one actor per partition.
    let run = Topology::partition(&ds, parts, PartitionMethod::Metis, None, cfg)?.spawn()?;

    // 4. Per-epoch events arrive while the topology trains.
    for event in run.events() {
        match event {
            RunEvent::Epoch(e) => println!(
                "epoch {:>3}: loss {:.4}, val {:.3}, {:.1} ms ({:.1} compute, {} KiB of halo rows)",
                e.epoch,
                e.loss,
                e.val_acc,
                e.ms,
                e.compute_ms,
                e.halo_bytes / 1024
            ),
            RunEvent::Recovered(r) => {
                println!("recovered partition {} in epoch {}", r.partition, r.epoch)
            }
            RunEvent::Profile(p) => println!(
                "  step profile: {} protocol steps, {} KiB of halo rows",
                p.steps.len(),
                p.halo_bytes() / 1024
            ),
        }
    }

    // 5. The report; every actor and thread has stopped when `wait` returns.
    let report = run.wait()?;
    println!(
        "{} partitions, edge cut {}: test accuracy {:.2}% (best validation epoch {}), weights {}",
        report.partitions,
        report.edge_cut,
        100.0 * report.test_acc,
        report.best_epoch,
        report.weights_digest
    );
    Ok(())
}
