//! The `trellis` command line.
use clap::Parser;

fn main() {
    // Panics inside partition actors are caught and recovered from; print one line for them
    // instead of a backtrace (set RUST_BACKTRACE=1 to get the default report).
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        std::panic::set_hook(Box::new(|info| {
            let thread = std::thread::current();
            eprintln!("panic in thread '{}': {info}", thread.name().unwrap_or("?"));
        }));
    }
    // Injected faults (`--chaos`) print one line whatever RUST_BACKTRACE says.
    trellis::actors::faults::quiet_injected_panics(true);
    trellis::tune_allocator();
    let cli = trellis::cli::Cli::parse();
    if let Err(e) = trellis::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
