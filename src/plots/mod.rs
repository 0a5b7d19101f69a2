//! Run reports as pictures: `trellis report RUN.json --out DIR` draws loss and accuracy per
//! epoch, a per-partition timeline of compute against communication (consecutive epochs summed
//! into one bar for long runs), halo bytes per epoch (partitioned runs only; each chart with
//! the run's recoveries marked and its legend beside the plot, never over it) as PNG files, and one self-contained HTML page that embeds
//! them next to what reproduces the run (config, data digest, code version and commit, seed,
//! final weights digest) and the latency summaries.
//!
//! Text is drawn with a bundled font (DejaVu Sans Mono, Bitstream Vera licence, see
//! `DejaVuSansMono-LICENSE.txt`), so rendering needs no fontconfig or system fonts.
pub mod charts;
mod html;

use std::path::{Path, PathBuf};
use thiserror::Error;
use trellis_runtime::RunReport;

/// Why a report could not be rendered.
#[derive(Debug, Error)]
pub enum PlotError {
    #[error("cannot draw {chart}: {detail}")]
    Draw { chart: &'static str, detail: String },
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the report has no epochs to plot")]
    Empty,
}

/// A recovery as the charts mark it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct RecoveryMark {
    pub kind: String,
    pub partition: u32,
    pub epoch: u32,
    #[serde(default)]
    pub detected_ms: f64,
    #[serde(default)]
    pub resumed_ms: f64,
}

/// The recoveries recorded in a report (entries that are not recoveries are skipped).
pub fn recoveries(report: &RunReport) -> Vec<RecoveryMark> {
    report
        .recoveries
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| serde_json::from_value(v.clone()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The files written.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub pngs: Vec<PathBuf>,
    pub html: PathBuf,
}

/// Renders `report` into `out` (created if missing).
pub fn render(report: &RunReport, out: &Path) -> Result<Rendered, PlotError> {
    if report.epochs_log.is_empty() {
        return Err(PlotError::Empty);
    }
    std::fs::create_dir_all(out).map_err(|source| PlotError::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let marks = recoveries(report);
    let mut pngs = vec![
        charts::loss_accuracy(report, &marks, &out.join("loss_accuracy.png"))?,
        charts::timeline(report, &marks, &out.join("timeline.png"))?,
    ];
    // One process exchanges no halo: no chart of it.
    let exchanged = report.partitions > 1 || report.epochs_log.iter().any(|l| l.halo_bytes > 0);
    if exchanged {
        pngs.push(charts::bytes(report, &marks, &out.join("halo_bytes.png"))?);
    } else {
        let _ = std::fs::remove_file(out.join("halo_bytes.png"));
    }
    let html = out.join("report.html");
    let page = html::page(report, &marks, &pngs)?;
    std::fs::write(&html, page).map_err(|source| PlotError::Io {
        path: html.clone(),
        source,
    })?;
    Ok(Rendered { pngs, html })
}
