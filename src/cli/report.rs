//! `trellis report`: renders a run report (JSON) as PNG charts and one HTML page.
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use trellis_runtime::RunReport;

#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// The run report written by `trellis train --report`.
    pub report: PathBuf,
    /// The folder to write the PNG files and `report.html` into.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let report = RunReport::read(&a.report)?;
    let done = crate::plots::render(&report, &a.out)
        .with_context(|| format!("cannot render {}", a.report.display()))?;
    for p in &done.pngs {
        println!("wrote {}", p.display());
    }
    println!("wrote {}", done.html.display());
    Ok(())
}
