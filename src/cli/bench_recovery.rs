//! `trellis bench recovery`: what fault tolerance costs and how fast it recovers, measured
//! side by side in one command on a local cluster (node processes on loopback): the epoch time
//! with replication on and off (alternating runs), the recovery from a partition panic, and
//! the recovery from a node SIGKILL (detection by the QUIC idle timeout included).
use super::launch::{launch_cluster, ClusterOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use trellis_runtime::{report::median, RunReport};

#[derive(Debug, Clone, Args)]
pub struct RecoveryBenchArgs {
    #[arg(
        long,
        default_value = "synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0"
    )]
    pub data: String,
    #[arg(long, default_value = "gcn")]
    pub model: String,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Node processes.
    #[arg(long, default_value_t = 2)]
    pub nodes: u32,
    /// Partitions (spread over the nodes).
    #[arg(long, default_value_t = 4)]
    pub partitions: usize,
    /// Epochs per run (the first is not timed).
    #[arg(long, default_value_t = 4)]
    pub epochs: u32,
    /// Runs with replication on, and as many off, alternating.
    #[arg(long, default_value_t = 2)]
    pub repeats: u32,
    #[arg(long, default_value_t = 500)]
    pub heartbeat_ms: u64,
    #[arg(long, default_value_t = 1500)]
    pub idle_timeout_ms: u64,
    /// CPU threads per node process (0: all).
    #[arg(long, default_value_t = 0)]
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
    for i in 0..a.repeats {
        let r = run_one(&format!("on{i}"), 1, "")?;
        on.extend(timed(&r));
        digests.push(r.weights_digest.clone());
        let r = run_one(&format!("off{i}"), 0, "")?;
        off.extend(timed(&r));
        digests.push(r.weights_digest.clone());
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
    print_table(&a, m_on, m_off, (pd, pr, pz), (kd, kr, kz), &digests[0]);
    Ok(())
}

fn print_table(
    a: &RecoveryBenchArgs,
    on: f64,
    off: f64,
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
    println!("| epoch, replication on (median) | {on:.1} ms | |");
    println!("| epoch, replication off (median) | {off:.1} ms | |");
    println!(
        "| replication overhead | {:+.2}% | <= 3% |",
        100.0 * (on - off) / off
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
