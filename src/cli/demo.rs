//! `trellis demo`: the main job on a built-in synthetic graph. Trains single-process, with four
//! partition actors in one process, and on a local 3-node cluster (node processes on
//! loopback), then on that cluster again while a partition panics (its supervisor restarts it
//! from the replicated state) and a node's process is SIGKILLed (its partition is re-placed on
//! the node holding its replica); each interrupted epoch is replayed and every run ends with
//! the same weights.
use super::launch::{launch_cluster, ClusterOptions};
use super::train::{print_summary, train_single};
use anyhow::{bail, Result};
use clap::Args;
use trellis_actors::{Recovery, Topology};
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{DataSource, ModelKind, RunReport, TrainConfig};

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The synthetic graph to train on.
    #[arg(
        long,
        default_value = "synthetic:nodes=20000,degree=10,features=64,classes=8,seed=0"
    )]
    pub data: String,
    /// Partition actors (METIS), spread over the 3 node processes of the cluster runs.
    #[arg(long, value_name = "P", default_value_t = 4, value_parser = super::validate::partitions)]
    pub partitions: usize,
    /// Epochs of every run (the faults fire in epochs 10 and 20 when there are that many).
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = super::validate::positive_u32)]
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

    let tmp = tempfile::Builder::new().prefix("trellis-demo-").tempdir()?;
    let cluster_run = |name: &str, chaos: &str| -> Result<RunReport> {
        let dir = tmp.path().join(name);
        let report = dir.join("report.json");
        let opts = ClusterOptions {
            nodes: 3,
            heartbeat_ms: 500,
            idle_timeout_ms: 1500,
            replicas: 1,
            max_restarts: 8,
            step_deadline_ms: 120_000,
        };
        let mut args: Vec<String> = vec![
            "--data".into(),
            a.data.clone(),
            "--partitions".into(),
            a.partitions.to_string(),
            "--epochs".into(),
            a.epochs.to_string(),
            "--partition-dir".into(),
            tmp.path().join("parts").display().to_string(),
            "--report".into(),
            report.display().to_string(),
        ];
        if !chaos.is_empty() {
            args.extend(["--chaos".into(), chaos.into()]);
        }
        // The nodes' own output is not shown: the summary and the recoveries below are
        // printed once each, from the report (whose temporary path is not printed).
        launch_cluster(&opts, &dir, Some(&tmp.path().join("parts")), &args, true)?;
        Ok(RunReport::read(&report)?)
    };

    println!(
        "\n3. a local cluster: 3 node processes on loopback (QUIC, mutual TLS), {} partitions, no faults",
        a.partitions
    );
    let cluster = cluster_run("clean", "")?;
    print_summary(&cluster);

    let (panic_epoch, kill_epoch) = (a.epochs / 3, 2 * a.epochs / 3);
    println!(
        "\n4. the same cluster; partition 1 panics in the backward pass of epoch {panic_epoch}, and node 2's process is SIGKILLed as epoch {kill_epoch} starts"
    );
    let chaos = format!(
        "panic:part=1:epoch={panic_epoch}:layer=0:phase=backward,kill-node:node=2:epoch={kill_epoch}"
    );
    let faulty = cluster_run("faults", &chaos)?;
    print_summary(&faulty);
    let recoveries: Vec<Recovery> =
        serde_json::from_value(faulty.recoveries.clone()).unwrap_or_default();
    for r in &recoveries {
        let what = match r.node {
            Some(n) => {
                let moved: Vec<String> = r
                    .replaced
                    .iter()
                    .map(|(p, to)| format!("partition {p} to node {to}"))
                    .collect();
                format!("node {n} lost, re-placed {}", moved.join(", "))
            }
            None => format!("partition {} panicked and was restarted", r.partition),
        };
        println!(
            "   recovery in epoch {}: {what}; detected {:.1} ms after the failure, ready to replay {:.1} ms after detection, step done again {:.1} ms after detection; restored state matched its digest: {}",
            r.epoch,
            r.detected_ms,
            r.ready_ms,
            r.resumed_ms,
            r.digest_ok.map_or("n/a".to_string(), |b| b.to_string())
        );
    }
    let max_diff = single
        .epochs_log
        .iter()
        .zip(&clean.epochs_log)
        .map(|(x, y)| (x.loss - y.loss).abs() / x.loss.abs().max(1e-12))
        .fold(0.0, f64::max);
    println!("\nsingle process vs {} partitions: max relative loss difference {max_diff:.2e}, test accuracy {:.2}% vs {:.2}%", a.partitions, 100.0 * single.test_acc, 100.0 * clean.test_acc);
    println!(
        "weights digest, {} partition actors in one process: {}",
        a.partitions, clean.weights_digest
    );
    println!(
        "weights digest, 3-node cluster without faults:      {}",
        cluster.weights_digest
    );
    println!(
        "weights digest, 3-node cluster with 2 faults:       {}",
        faulty.weights_digest
    );
    if max_diff > 1e-5 {
        bail!("partitioned training diverged from the single-process run");
    }
    if recoveries.len() != 2 {
        bail!(
            "expected 2 recoveries, the report lists {}",
            recoveries.len()
        );
    }
    if clean.weights_digest != cluster.weights_digest
        || cluster.weights_digest != faulty.weights_digest
    {
        bail!("the runs ended with different weights");
    }
    println!("recovery verified: identical weights");
    Ok(())
}
