//! The `trellis` command line.
use clap::Parser;

fn main() {
    let cli = trellis::cli::Cli::parse();
    if let Err(e) = trellis::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
