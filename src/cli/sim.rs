//! `trellis sim`: the deterministic cluster simulator (`trellis_actors::sim`) over many seeded
//! fault schedules; exits non-zero naming the first failing seed if any invariant broke.
use anyhow::{bail, Result};
use clap::Args;
use std::time::Instant;
use trellis_actors::sim::{self, SimGraph};

#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Number of fault schedules to run (seeds SEED, SEED+1, ...).
    #[arg(long, default_value_t = 1000)]
    pub schedules: u64,
    /// The first schedule's seed; `--schedules 1 --seed S` replays schedule S exactly.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Threads running schedules (each schedule is single-threaded; the result does not
    /// depend on this).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

pub fn run(a: SimArgs) -> Result<()> {
    if a.schedules == 0 {
        bail!("--schedules must be at least 1");
    }
    if a.threads == 0 || a.threads > 256 {
        bail!("--threads must be between 1 and 256");
    }
    let graph = SimGraph::new()?;
    let bar = trellis_runtime::progress::bar(a.schedules, "schedules");
    let t = Instant::now();
    let report = sim::sweep(&graph, a.seed, a.schedules, a.threads, &|_| bar.inc(1));
    bar.finish_and_clear();
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{} schedules (seeds {}..={}) in {secs:.1} s: {} faults fired, {} recoveries, longest run {:.0} ms of virtual time",
        report.schedules,
        a.seed,
        a.seed + a.schedules - 1,
        report.fired_total(),
        report.recoveries,
        report.longest_virtual_ms
    );
    println!(
        "{} schedules with halo staleness 1 ({} faults fired in them), {} with skipped rows ({})",
        report.stale, report.stale_fired, report.skip, report.skip_fired
    );
    println!(
        "  skipped rows include evaluation rows: {} evaluation blocks sent as their changed rows, {} evaluation steps replayed before a training step in runs that finished",
        report.sparse_eval_blocks, report.eval_replays_finished
    );
    println!("faults fired, by kind:");
    for (kind, n) in &report.fired {
        println!("  {:<24} {n}", kind.name());
    }
    println!("outcomes:");
    for (name, n) in &report.outcomes {
        println!("  {name:<24} {n}");
    }
    if let Some((seed, why)) = report.failures.first() {
        bail!(
            "{} schedule(s) broke an invariant; first: seed {seed}: {why}\n  replay it with: trellis sim --schedules 1 --seed {seed}",
            report.failures.len()
        );
    }
    println!("every invariant held");
    Ok(())
}
