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
    tune_allocator();
    let cli = trellis::cli::Cli::parse();
    if let Err(e) = trellis::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Serves large tensors from the heap instead of fresh mmaps: every epoch allocates and frees
/// the same big activations, and without this each of them is page-faulted in anew (measured:
/// a third of the 1M-node epoch was kernel time spent on page faults).
fn tune_allocator() {
    // SAFETY: mallopt only changes glibc malloc's tuning parameters; called before any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}
