//! Command-line interface: argument parsing and the subcommands.
use anyhow::Result;
use clap::{Parser, Subcommand};

mod accuracy;
mod bench;
mod bench_comm;
mod bench_partitions;
mod bench_recovery;
mod bench_serve;
mod cert;
mod demo;
mod halo;
mod launch;
mod node;
mod partition;
pub mod predict;
mod report;
mod serve;
mod shape;
mod sim;
pub mod telemetry;
mod train;
pub mod validate;

pub use train::TrainArgs;

/// Trellis: train graph neural networks on one machine or many.
#[derive(Debug, Parser)]
#[command(name = "trellis", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model (single process, or P partition actors with --partitions) and report.
    Train(Box<TrainArgs>),
    /// Split a data set into partition files plus a partition book.
    Partition(partition::PartitionArgs),
    /// Mean test accuracy over several seeds for each model (the README table).
    Accuracy(accuracy::AccuracyArgs),
    /// Measure epoch time, SpMM bandwidth and this machine's memory bandwidth side by side.
    Bench(bench::BenchArgs),
    /// Render a run report (JSON) as PNG charts and one self-contained HTML page.
    Report(report::ReportArgs),
    /// Create the cluster CA and per-node certificates for QUIC with mutual TLS.
    Cert(cert::CertArgs),
    /// Run one node of a multi-process cluster (QUIC with mutual TLS) from a cluster file.
    Node(node::NodeArgs),
    /// Predict with a saved model: layer-wise full-graph inference into a .npy file.
    Predict(predict::PredictArgs),
    /// Serve a saved model over HTTP/JSON: predictions, graph updates, model swaps.
    Serve(Box<serve::ServeArgs>),
    /// Start a local cluster of K node processes on loopback, with fresh certificates.
    Launch(launch::LaunchArgs),
    /// Train on a built-in synthetic graph, single-process and partitioned with an injected
    /// fault, and show that both end with the same weights.
    Demo(demo::DemoArgs),
    /// Run the deterministic cluster simulator over seeded fault schedules and check that every
    /// run ends with the fault-free weights (or an unavoidable, clear error).
    Sim(sim::SimArgs),
}

/// `args` without the flags `flags` and the options `options`, each option with its value
/// (the next argument, unless given as `--name=value`).
fn without_options<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    flags: &[&str],
    options: &[&str],
) -> Vec<S> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let text = arg.as_ref().to_string_lossy();
        let name = text.split('=').next().unwrap_or_default();
        if flags.contains(&name) {
            continue;
        }
        if options.contains(&name) {
            if !text.contains('=') {
                args.next();
            }
            continue;
        }
        drop(text);
        out.push(arg);
    }
    out
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    // The commands that train or serve start their telemetry (and the log) themselves.
    if !matches!(
        cli.command,
        Command::Train(_) | Command::Node(_) | Command::Serve(_)
    ) {
        crate::telemetry::init_logs()?;
    }
    match cli.command {
        Command::Train(a) => train::run(*a),
        Command::Partition(a) => partition::run(a),
        Command::Accuracy(a) => accuracy::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Cert(a) => cert::run(a),
        Command::Node(a) => node::run(a),
        Command::Launch(a) => launch::run(a),
        Command::Report(a) => report::run(a),
        Command::Sim(a) => sim::run(a),
        Command::Predict(a) => predict::run(a),
        Command::Serve(a) => serve::run(*a),
    }
}
