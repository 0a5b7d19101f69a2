//! Progress bars for long work: drawn on a terminal (stderr), silent otherwise.
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// A progress bar that draws only when stderr is a terminal.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), draw_target());
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {pos}/{len} {elapsed_precise} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// A spinner for work of unknown length, drawn only on a terminal.
pub fn spinner(what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(None, draw_target());
    pb.set_message(what.to_string());
    pb
}

fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}
