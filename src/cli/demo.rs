//! `trellis demo`: the main job on a built-in synthetic graph. Trains single-process, then with
//! four partition actors while a partition's kernel panics mid-epoch; its supervisor restarts it
//! from the replicated state, the epoch is replayed, and the run ends with the same weights.
use super::train::{print_summary, train_single};
use anyhow::{bail, Result};
use clap::Args;
use trellis_actors::{FaultPlan, RunEvent, Topology};
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{DataSource, ModelKind, TrainConfig};
use trellis_transport::Phase;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The synthetic graph to train on.
    #[arg(
        long,
        default_value = "synthetic:nodes=20000,degree=10,features=64,classes=8,seed=0"
    )]
    pub data: String,
    #[arg(long, default_value_t = 4)]
    pub partitions: usize,
    #[arg(long, default_value_t = 30)]
    pub epochs: u32,
}

pub fn run(a: DemoArgs) -> Result<()> {
    let ds = DataSource::parse(&a.data)?.load()?;
    println!(
        "data: {} ({} nodes, {} edges, {} features, {} classes)",
        ds.name,
        ds.num_nodes,
        ds.edge_src.len(),
        ds.num_features,
        ds.num_classes
    );
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    cfg.epochs = a.epochs;

    println!("\n1. single process");
    let single = train_single(ds.clone(), cfg.clone(), false)?;
    print_summary(&single);

    println!("\n2. {} partition actors (METIS), no faults", a.partitions);
    let clean = Topology::partition(&ds, a.partitions, PartitionMethod::Metis, None, cfg.clone())?
        .spawn()?
        .wait()?;
    print_summary(&clean);

    let fail_epoch = a.epochs / 2;
    println!("\n3. the same, but partition 1 panics in the backward pass of epoch {fail_epoch}");
    let faults = FaultPlan::none().panic_at(1, fail_epoch, 0, Phase::Backward);
    let run = Topology::partition(&ds, a.partitions, PartitionMethod::Metis, None, cfg)?
        .with_faults(faults)
        .spawn()?;
    for ev in run.events() {
        if let RunEvent::Recovered(r) = ev {
            println!(
                "   recovery: {} on partition {} at epoch {}: detected {:.1} ms after the step began, resumed {:.1} ms later, {} step replayed",
                r.kind, r.partition, r.epoch, r.detected_ms, r.resumed_ms, r.steps_replayed
            );
        }
    }
    let faulty = run.wait()?;
    print_summary(&faulty);
    let max_diff = single
        .epochs_log
        .iter()
        .zip(&clean.epochs_log)
        .map(|(x, y)| (x.loss - y.loss).abs() / x.loss.abs().max(1e-12))
        .fold(0.0, f64::max);
    println!("\nsingle process vs {} partitions: max relative loss difference {max_diff:.2e}, test accuracy {:.2}% vs {:.2}%", a.partitions, 100.0 * single.test_acc, 100.0 * clean.test_acc);
    println!("weights digest without faults: {}", clean.weights_digest);
    println!("weights digest with a fault:   {}", faulty.weights_digest);
    if max_diff > 1e-5 {
        bail!("partitioned training diverged from the single-process run");
    }
    if clean.weights_digest != faulty.weights_digest {
        bail!("the run with a fault ended with different weights");
    }
    println!("recovery verified: identical weights");
    Ok(())
}
