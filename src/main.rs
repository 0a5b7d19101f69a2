//! The `trellis` command line.
use clap::Parser;

/// How an injected fault's panic message starts (`--chaos panic:...`).
const INJECTED: &str = "injected fault:";

fn main() {
    install_panic_hook();
    trellis::tune_allocator();
    let cli = trellis::cli::Cli::parse();
    if let Err(e) = trellis::cli::run(cli) {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// Panics inside partition actors are caught and recovered from. An injected one (`--chaos`)
/// is reported in one line whatever `RUST_BACKTRACE` says; any other panic gets one line too,
/// or Rust's default report (with its backtrace) when `RUST_BACKTRACE` asks for one.
fn install_panic_hook() {
    let default = std::panic::take_hook();
    let backtraces = std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0");
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("unnamed");
        if message.starts_with(INJECTED) {
            eprintln!("chaos: {message} (thread '{thread}'); its supervisor restarts it");
        } else if backtraces {
            default(info);
        } else {
            let at = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            eprintln!("panic in thread '{thread}'{at}: {message}");
        }
    }));
}

/// The error and its causes joined by `: `, leaving out a cause whose text the message
/// already contains (errors that print their source and also return it from `source()`).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !text.contains(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}
