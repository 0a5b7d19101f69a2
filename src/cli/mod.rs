//! Command-line interface: argument parsing and the subcommands.
use anyhow::Result;
use clap::{Parser, Subcommand};

mod accuracy;
mod train;

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
    /// Train a model and write a run report.
    Train(TrainArgs),
    /// Mean test accuracy over several seeds for each model (the README table).
    Accuracy(accuracy::AccuracyArgs),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::Accuracy(a) => accuracy::run(a),
    }
}
