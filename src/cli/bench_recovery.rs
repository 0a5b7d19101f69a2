//! `trellis bench recovery`: what fault tolerance costs and how fast it recovers, measured
//! side by side in one command on a local cluster (node processes on loopback): the epoch time
//! with replication on and off (alternating runs), the recovery from a partition panic, and
//! the recovery from a node SIGKILL (detection by the QUIC idle timeout included).
use super::launch::{launch_cluster, ClusterOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use trellis_runtime::metrics::names;
use trellis_runtime::{report::median, RunReport};

#[derive(Debug, Clone, Args)]
pub struct RecoveryBenchArgs {
    /// The data set (same forms as `train --data`).
    #[arg(
        long,
        default_value = "synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0"
    )]
    pub data: String,
    /// The architecture: gcn, sage or gat (paper settings but --hidden).
    #[arg(long, default_value = "gcn")]
    pub model: String,
    /// Hidden layer width.
    #[arg(long, default_value_t = 256, value_parser = super::validate::width)]
    pub hidden: usize,
    /// Node processes (at least 2: one is killed).
    #[arg(long, default_value_t = 2, value_parser = super::validate::positive_u32)]
    pub nodes: u32,
    /// Partitions (spread over the nodes).
    #[arg(long, default_value_t = 4, value_parser = super::validate::partitions)]
    pub partitions: usize,
    /// Epochs per run (the first is not timed).
    #[arg(long, default_value_t = 4, value_parser = super::validate::positive_u32)]
    pub epochs: u32,
    /// Runs with replication on, and as many off, alternating.
    #[arg(long, default_value_t = 2, value_parser = super::validate::positive_u32)]
    pub repeats: u32,
    /// QUIC keep-alive (heartbeat) interval, ms.
    #[arg(long, default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// A node is declared lost after this long without a packet (two missed heartbeats).
    #[arg(long, default_value_t = 1000)]
    pub idle_timeout_ms: u64,
    /// CPU threads per node process (0: one per CPU).
    #[arg(long, default_value_t = 0, value_parser = super::validate::threads)]
    pub threads: usize,
}

pub fn run(a: RecoveryBenchArgs) -> Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("trellis-bench-recovery-")
        .tempdir()?;
    let parts = tmp.path().join("parts");
    let run_one = |name: &str, replicas: u32, chaos: &str| -> Result<RunReport> {
        let dir = tmp.path().join(name);
        let report = dir.join("report.json");
        let opts = ClusterOptions {
            nodes: a.nodes,
            heartbeat_ms: a.heartbeat_ms,
            idle_timeout_ms: a.idle_timeout_ms,
            replicas,
            max_restarts: 8,
            step_deadline_ms: 600_000,
        };
        let mut args: Vec<String> = [
            "--data",
            &a.data,
            "--model",
            &a.model,
            "--hidden",
            &a.hidden.to_string(),
            "--partitions",
            &a.partitions.to_string(),
            "--epochs",
            &a.epochs.to_string(),
            "--threads",
            &a.threads.to_string(),
            "--partition-dir",
            parts.to_str().context("temporary path")?,
            "--report",
            report.to_str().context("temporary path")?,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if !chaos.is_empty() {
            args.extend(["--chaos".to_string(), chaos.to_string()]);
        }
        eprintln!("bench recovery: {name} ...");
        launch_cluster(&opts, &dir, Some(&parts), &args, true)?;
        Ok(RunReport::read(&report)?)
    };
    let timed = |r: &RunReport| -> Vec<f64> { r.epochs_log.iter().skip(1).map(|l| l.ms).collect() };
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let mut digests = Vec::new();
    // Replication work per epoch, measured inside the runs with replication on: the time the
    // partitions spend storing their state (summed over all of them, as if serial).
    let mut replicate_ms = Vec::new();
    for i in 0..a.repeats {
        // ABBA order: whatever drifts during the command (page cache, other load) weighs on
        // both settings alike.
        let order: [u32; 2] = if i % 2 == 0 { [1, 0] } else { [0, 1] };
        for replicas in order {
            let name = format!("{}{i}", if replicas > 0 { "on" } else { "off" });
            let r = run_one(&name, replicas, "")?;
            if replicas > 0 {
                on.extend(timed(&r));
                replicate_ms.push(replication_ms_per_epoch(&r));
            } else {
                off.extend(timed(&r));
            }
            digests.push(r.weights_digest.clone());
        }
    }
    let panic = run_one("panic", 1, "panic:part=1:epoch=2")?;
    let kill = run_one(
        "kill",
        1,
        &format!("kill-node:node={}:epoch=2", a.nodes - 1),
    )?;
    for r in [&panic, &kill] {
        digests.push(r.weights_digest.clone());
    }
    if digests.iter().any(|d| *d != digests[0]) {
        bail!("runs ended with different weights: {digests:?}");
    }
    let recovery = |r: &RunReport, kind: &str| -> Result<(f64, f64, f64)> {
        let rec = r
            .recoveries
            .as_array()
            .and_then(|v| v.iter().find(|x| x["kind"] == kind))
            .with_context(|| format!("no {kind} recovery recorded"))?;
        let f = |k: &str| rec[k].as_f64().unwrap_or(f64::NAN);
        Ok((f("detected_ms"), f("ready_ms"), f("resumed_ms")))
    };
    let (m_on, m_off) = (median(&on), median(&off));
    let (pd, pr, pz) = recovery(&panic, "actor-panic")?;
    let (kd, kr, kz) = recovery(&kill, "node-loss")?;
    let epochs = Epochs {
        on: m_on,
        off: m_off,
        spread: spread(&on, &off),
        replicate: median(&replicate_ms),
    };
    print_table(&a, &epochs, (pd, pr, pz), (kd, kr, kz), &digests[0]);
    Ok(())
}

/// Epoch times with replication on and off, and what replication itself took.
struct Epochs {
    on: f64,
    off: f64,
    /// The range of the epoch times of both settings (min, max), ms.
    spread: (f64, f64),
    /// Replication work per epoch, summed over the partitions, ms.
    replicate: f64,
}

/// Replication work per epoch: the mean time of storing a snapshot, summed over the
/// partitions (the report's latencies merge every node's).
fn replication_ms_per_epoch(r: &RunReport) -> f64 {
    r.latency
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{}{{", names::REPLICATE)))
        .map(|(_, s)| s.mean_ms)
        .sum()
}

fn spread(a: &[f64], b: &[f64]) -> (f64, f64) {
    let all = a.iter().chain(b);
    let min = all.clone().copied().fold(f64::INFINITY, f64::min);
    (min, all.copied().fold(f64::NEG_INFINITY, f64::max))
}

fn print_table(
    a: &RecoveryBenchArgs,
    e: &Epochs,
    panic: (f64, f64, f64),
    kill: (f64, f64, f64),
    digest: &str,
) {
    println!(
        "{} on {}: {} partitions on {} node processes (loopback), heartbeat {} ms, idle timeout {} ms",
        a.model, a.data, a.partitions, a.nodes, a.heartbeat_ms, a.idle_timeout_ms
    );
    println!("| measure | value | goal |");
    println!("|---|---|---|");
    println!("| epoch, replication on (median) | {:.1} ms | |", e.on);
    println!("| epoch, replication off (median) | {:.1} ms | |", e.off);
    println!(
        "| epoch times, both settings (min - max) | {:.1} - {:.1} ms | |",
        e.spread.0, e.spread.1
    );
    println!(
        "| replication overhead (on vs off) | {:+.2}% | <= 3% |",
        100.0 * (e.on - e.off) / e.off
    );
    println!(
        "| replication work per epoch (all partitions summed) | {:.2} ms = {:.3}% of the epoch | <= 3% |",
        e.replicate,
        100.0 * e.replicate / e.off
    );
    println!(
        "| actor panic: detection to ready to replay | {:.1} ms | <= 100 ms |",
        panic.1
    );
    println!(
        "| actor panic: detection to replayed step done | {:.1} ms | |",
        panic.2
    );
    println!(
        "| node SIGKILL: failure to detection | {:.1} ms | |",
        kill.0
    );
    println!(
        "| node SIGKILL: detection to ready to replay (re-placement) | {:.1} ms | |",
        kill.1
    );
    println!(
        "| node SIGKILL: failure to ready to replay | {:.1} ms | <= 2000 ms |",
        kill.0 + kill.1
    );
    println!(
        "| node SIGKILL: detection to replayed step done | {:.1} ms | |",
        kill.2
    );
    println!("every run ended with weights_digest {digest}");
}
