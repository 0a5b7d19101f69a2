//! The PNG charts (plotters, bitmap backend).
use super::{PlotError, RecoveryMark};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::{Path, PathBuf};
use std::sync::Once;
use trellis_runtime::RunReport;

static FONT: &[u8] = include_bytes!("DejaVuSansMono.ttf");
const FAMILY: &str = "sans-serif";
const COMPUTE: RGBColor = RGBColor(52, 101, 164);
const COMM: RGBColor = RGBColor(245, 121, 0);
const EVAL: RGBColor = RGBColor(186, 189, 182);
const MARK: RGBColor = RGBColor(204, 0, 0);

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bundled font parses; a failure would only lose the text, not the chart.
        let _ = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT);
    });
}

fn draw_err<E: std::fmt::Debug>(chart: &'static str) -> impl Fn(E) -> PlotError {
    move |e| PlotError::Draw {
        chart,
        detail: format!("{e:?}"),
    }
}

/// A bitmap canvas for `path`, cleared to white.
fn canvas<'a>(
    path: &'a Path,
    size: (u32, u32),
    chart: &'static str,
) -> Result<DrawingArea<BitMapBackend<'a>, Shift>, PlotError> {
    register_font();
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err(chart))?;
    Ok(root)
}

/// The x range of an epoch axis: every logged epoch, half an epoch of margin each side.
fn epoch_range(logs: &[trellis_runtime::EpochLog]) -> (f64, f64) {
    (
        logs[0].epoch as f64 - 0.5,
        logs[logs.len() - 1].epoch as f64 + 0.5,
    )
}

/// Axes with epochs along x and `y_desc` over `y` along y, captioned, mesh drawn.
fn epoch_axes<'a, DB: DrawingBackend + 'a>(
    area: &'a DrawingArea<DB, Shift>,
    caption: String,
    caption_size: u32,
    x: (f64, f64),
    y: (f64, f64),
    y_desc: &str,
    chart: &'static str,
) -> Result<ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>, PlotError> {
    let mut c = ChartBuilder::on(area)
        .caption(caption, (FAMILY, caption_size))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)
        .map_err(draw_err(chart))?;
    c.configure_mesh()
        .x_desc("epoch")
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .y_desc(y_desc)
        .label_style((FAMILY, 14))
        .draw()
        .map_err(draw_err(chart))?;
    Ok(c)
}

/// `(lo, hi)` padded so a flat series still gets a visible range.
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if !(lo.is_finite() && hi.is_finite()) {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 0.01).max(1e-9);
    (lo - pad, hi + pad)
}

/// Width of the legend column right of every chart: legends never cover data.
const LEGEND_W: u32 = 170;

/// How a legend entry is drawn.
#[derive(Clone, Copy)]
enum Swatch {
    Line(RGBColor),
    Bar(RGBColor),
    Mark,
}

/// One legend entry.
struct Entry {
    label: &'static str,
    swatch: Swatch,
}

const fn entry(label: &'static str, swatch: Swatch) -> Entry {
    Entry { label, swatch }
}

/// Splits `area` into the plot (left) and the legend column (right).
fn with_legend_column<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
) -> (DrawingArea<DB, Shift>, DrawingArea<DB, Shift>) {
    let w = area.dim_in_pixel().0;
    area.split_horizontally(w.saturating_sub(LEGEND_W))
}

/// Draws `entries` (and a recovery entry when there are `marks`) down the legend column.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[Entry],
    marks: bool,
    chart: &'static str,
) -> Result<(), PlotError> {
    let recovery = entry("recovery", Swatch::Mark);
    let all = entries.iter().chain(marks.then_some(&recovery));
    for (i, e) in all.enumerate() {
        let y = 48 + 24 * i as i32;
        match e.swatch {
            Swatch::Line(c) => {
                area.draw(&PathElement::new(vec![(8, y), (30, y)], c.stroke_width(2)))
            }
            Swatch::Bar(c) => area.draw(&Rectangle::new([(10, y - 6), (28, y + 6)], c.filled())),
            Swatch::Mark => area.draw(&PathElement::new(
                vec![(19, y - 8), (19, y + 8)],
                MARK.stroke_width(2),
            )),
        }
        .map_err(draw_err(chart))?;
        area.draw(&Text::new(e.label, (36, y - 8), (FAMILY, 14)))
            .map_err(draw_err(chart))?;
    }
    Ok(())
}

/// Vertical red lines at `xs` over the y range `y`.
fn mark_recoveries<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    xs: &[f64],
    y: (f64, f64),
    chart_name: &'static str,
) -> Result<(), PlotError> {
    chart
        .draw_series(
            xs.iter()
                .map(|&x| PathElement::new(vec![(x, y.0), (x, y.1)], MARK.stroke_width(2))),
        )
        .map_err(draw_err(chart_name))?;
    Ok(())
}

/// Loss (top) and accuracy per split (bottom) per epoch.
pub fn loss_accuracy(
    r: &RunReport,
    marks: &[RecoveryMark],
    path: &Path,
) -> Result<PathBuf, PlotError> {
    const NAME: &str = "loss and accuracy";
    let root = canvas(path, (1100, 800), NAME)?;
    let (top, bottom) = root.split_vertically(400);
    let logs = &r.epochs_log;
    let x = epoch_range(logs);
    let marks_x: Vec<f64> = marks.iter().map(|m| m.epoch as f64).collect();

    let (plot, key) = with_legend_column(&top);
    let (lo, hi) = logs.iter().fold((f64::MAX, f64::MIN), |(a, b), l| {
        (a.min(l.loss), b.max(l.loss))
    });
    let y = padded(lo, hi);
    let caption = format!("{} on {}: training loss", r.model, r.dataset);
    let mut c = epoch_axes(&plot, caption, 22, x, y, "loss", NAME)?;
    c.draw_series(LineSeries::new(
        logs.iter().map(|l| (l.epoch as f64, l.loss)),
        COMPUTE.stroke_width(2),
    ))
    .map_err(draw_err(NAME))?;
    mark_recoveries(&mut c, &marks_x, y, NAME)?;
    legend(
        &key,
        &[entry("loss", Swatch::Line(COMPUTE))],
        !marks.is_empty(),
        NAME,
    )?;

    let (plot, key) = with_legend_column(&bottom);
    let accuracy = "accuracy".to_string();
    let mut c = epoch_axes(&plot, accuracy, 22, x, (0.0, 1.0), "accuracy", NAME)?;
    type Pick = fn(&trellis_runtime::EpochLog) -> f64;
    const TRAIN: RGBColor = RGBColor(78, 154, 6);
    let splits: [(RGBColor, Pick); 3] = [
        (TRAIN, |l| l.train_acc),
        (COMM, |l| l.val_acc),
        (COMPUTE, |l| l.test_acc),
    ];
    for (color, pick) in splits {
        c.draw_series(LineSeries::new(
            logs.iter().map(|l| (l.epoch as f64, pick(l))),
            color.stroke_width(2),
        ))
        .map_err(draw_err(NAME))?;
    }
    mark_recoveries(&mut c, &marks_x, (0.0, 1.0), NAME)?;
    let entries = [
        entry("train", Swatch::Line(TRAIN)),
        entry("val", Swatch::Line(COMM)),
        entry("test", Swatch::Line(COMPUTE)),
    ];
    legend(&key, &entries, !marks.is_empty(), NAME)?;
    root.present().map_err(draw_err(NAME))?;
    Ok(path.to_path_buf())
}

/// Most bars along the timeline; longer runs are drawn with consecutive epochs summed.
pub const MAX_TIMELINE_BARS: usize = 60;

/// Consecutive epochs drawn as one bar of the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineBin {
    pub first_epoch: u32,
    pub last_epoch: u32,
    /// Seconds since the first epoch when the bin starts.
    pub start_s: f64,
    /// Per partition: compute, then communication and waiting, in seconds.
    pub compute_s: Vec<f64>,
    pub comm_s: Vec<f64>,
    /// Evaluation, seconds.
    pub eval_s: f64,
}

/// Groups the run's epochs into at most [`MAX_TIMELINE_BARS`] bins of equal epoch counts
/// (one epoch each for short runs), with their time per partition.
pub fn timeline_bins(r: &RunReport, parts: usize) -> Vec<TimelineBin> {
    let logs = &r.epochs_log;
    let per_bin = logs.len().div_ceil(MAX_TIMELINE_BARS).max(1);
    let mut bins = Vec::new();
    let mut t = 0.0;
    for chunk in logs.chunks(per_bin) {
        let mut bin = TimelineBin {
            first_epoch: chunk[0].epoch,
            last_epoch: chunk[chunk.len() - 1].epoch,
            start_s: t,
            compute_s: vec![0.0; parts],
            comm_s: vec![0.0; parts],
            eval_s: 0.0,
        };
        for l in chunk {
            let step = l.ms / 1e3;
            for p in 0..parts {
                let compute = l
                    .part_compute_ms
                    .get(p)
                    .copied()
                    .unwrap_or(l.compute_ms)
                    .clamp(0.0, l.ms)
                    / 1e3;
                bin.compute_s[p] += compute;
                bin.comm_s[p] += step - compute;
            }
            bin.eval_s += l.eval_ms / 1e3;
            t += step + l.eval_ms / 1e3;
        }
        bins.push(bin);
    }
    bins
}

/// Per partition, along the run's time: each epoch's compute, then communication and waiting
/// (the rest of the training step), then evaluation; long runs sum consecutive epochs into
/// one bar (said in the caption). Recoveries are red lines at their epoch's start, labelled
/// with the epoch.
pub fn timeline(r: &RunReport, marks: &[RecoveryMark], path: &Path) -> Result<PathBuf, PlotError> {
    const NAME: &str = "timeline";
    let parts = r.partitions.max(1);
    let root = canvas(path, (1100, 180 + 60 * parts.min(16) as u32), NAME)?;
    let (plot, key) = with_legend_column(&root);
    let bins = timeline_bins(r, parts);
    let total_s: f64 = r.epochs_log.iter().map(|l| (l.ms + l.eval_ms) / 1e3).sum();
    let per_bin = bins
        .first()
        .map_or(1, |b| (b.last_epoch - b.first_epoch + 1) as usize);
    let caption = if per_bin > 1 {
        format!("time per partition ({per_bin} epochs per bar)")
    } else {
        "time per partition (one bar per epoch)".to_string()
    };
    let top = parts as f64 - 0.5 + if marks.is_empty() { 0.0 } else { 0.6 };
    let mut c = ChartBuilder::on(&plot)
        .caption(caption, (FAMILY, 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..total_s.max(1e-6), -0.5..top)
        .map_err(draw_err(NAME))?;
    c.configure_mesh()
        .disable_y_mesh()
        .x_desc("time since the first epoch (s)")
        .y_desc("partition")
        .y_labels(parts.min(16))
        .y_label_formatter(&|y| {
            if *y > parts as f64 - 0.5 {
                String::new()
            } else {
                format!("{}", y.round() as i64)
            }
        })
        .label_style((FAMILY, 14))
        .draw()
        .map_err(draw_err(NAME))?;
    let mut bars = Vec::new();
    for b in &bins {
        let t = b.start_s;
        for p in 0..parts {
            let (y0, y1) = (p as f64 - 0.35, p as f64 + 0.35);
            let (compute, step) = (b.compute_s[p], b.compute_s[p] + b.comm_s[p]);
            bars.push(Rectangle::new(
                [(t, y0), (t + compute, y1)],
                COMPUTE.filled(),
            ));
            bars.push(Rectangle::new(
                [(t + compute, y0), (t + step, y1)],
                COMM.filled(),
            ));
            bars.push(Rectangle::new(
                [(t + step, y0), (t + step + b.eval_s, y1)],
                EVAL.filled(),
            ));
        }
    }
    c.draw_series(bars).map_err(draw_err(NAME))?;
    // Each recovery at the start of its epoch.
    let mut starts = Vec::with_capacity(r.epochs_log.len());
    let mut t = 0.0;
    for l in &r.epochs_log {
        starts.push((l.epoch, t));
        t += (l.ms + l.eval_ms) / 1e3;
    }
    let marked: Vec<(f64, u32)> = marks
        .iter()
        .filter_map(|m| {
            starts
                .iter()
                .find(|(e, _)| *e == m.epoch)
                .map(|(_, t)| (*t, m.epoch))
        })
        .collect();
    let xs: Vec<f64> = marked.iter().map(|m| m.0).collect();
    mark_recoveries(&mut c, &xs, (-0.5, parts as f64 - 0.5), NAME)?;
    c.draw_series(marked.iter().map(|&(x, epoch)| {
        Text::new(
            format!("epoch {epoch}"),
            (x, top - 0.1),
            (FAMILY, 13).into_font().color(&MARK),
        )
    }))
    .map_err(draw_err(NAME))?;
    let entries = [
        entry("compute", Swatch::Bar(COMPUTE)),
        entry("communication", Swatch::Bar(COMM)),
        entry("evaluation", Swatch::Bar(EVAL)),
    ];
    legend(&key, &entries, !marks.is_empty(), NAME)?;
    root.present().map_err(draw_err(NAME))?;
    Ok(path.to_path_buf())
}

/// Halo bytes per epoch (MiB).
pub fn bytes(r: &RunReport, marks: &[RecoveryMark], path: &Path) -> Result<PathBuf, PlotError> {
    const NAME: &str = "halo bytes";
    let root = canvas(path, (1100, 420), NAME)?;
    let (plot, key) = with_legend_column(&root);
    let logs = &r.epochs_log;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let hi = logs.iter().map(|l| mib(l.halo_bytes)).fold(0.0, f64::max);
    let x = epoch_range(logs);
    let y = (0.0, if hi > 0.0 { hi * 1.1 } else { 1.0 });
    let caption = "halo exchange: MiB per epoch".to_string();
    let mut c = epoch_axes(&plot, caption, 20, x, y, "MiB", NAME)?;
    c.draw_series(logs.iter().map(|l| {
        let e = l.epoch as f64;
        Rectangle::new(
            [(e - 0.4, 0.0), (e + 0.4, mib(l.halo_bytes))],
            COMPUTE.filled(),
        )
    }))
    .map_err(draw_err(NAME))?;
    let marks_x: Vec<f64> = marks.iter().map(|m| m.epoch as f64).collect();
    mark_recoveries(&mut c, &marks_x, y, NAME)?;
    legend(
        &key,
        &[entry("halo bytes", Swatch::Bar(COMPUTE))],
        !marks.is_empty(),
        NAME,
    )?;
    root.present().map_err(draw_err(NAME))?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::EpochLog;

    fn report(epochs: u32, parts: usize) -> RunReport {
        let json = serde_json::json!({
            "model": "gcn", "dataset": "d", "data_digest": "", "seed": 0, "epochs": epochs,
            "threads": 1, "config": {}, "partitions": parts, "edge_cut": 0, "test_acc": 0.5,
            "best_val_acc": 0.5, "best_epoch": 1, "epoch_ms_median": 10.0, "peak_rss_bytes": 0,
            "weights_digest": "", "code_version": "0", "epochs_log": [], "recoveries": []
        });
        let mut r: RunReport = serde_json::from_value(json).expect("a minimal report");
        r.epochs_log = (1..=epochs)
            .map(|e| EpochLog {
                epoch: e,
                loss: 1.0 / e as f64,
                train_acc: 0.5,
                val_acc: 0.5,
                test_acc: 0.5,
                ms: 10.0,
                eval_ms: 2.0,
                compute_ms: 6.0,
                comm_ms: 4.0,
                halo_bytes: 1 << 20,
                grad_bytes: 0,
                grad_bytes_exact: 0,
                halo_fp32_bytes: 1 << 20,
                eval_halo_bytes: 0,
                eval_halo_fp32_bytes: 0,
                weights_digest: String::new(),
                part_compute_ms: vec![6.0; parts],
                replica_bytes: 0,
                replica_ms: 0.0,
            })
            .collect();
        r
    }

    #[test]
    fn short_runs_get_one_bar_per_epoch() {
        let bins = timeline_bins(&report(12, 2), 2);
        assert_eq!(bins.len(), 12);
        assert_eq!((bins[3].first_epoch, bins[3].last_epoch), (4, 4));
        assert!((bins[3].start_s - 3.0 * 0.012).abs() < 1e-12);
        assert!((bins[3].compute_s[1] - 0.006).abs() < 1e-12);
        assert!((bins[3].comm_s[1] - 0.004).abs() < 1e-12);
    }

    #[test]
    fn long_runs_sum_consecutive_epochs_and_keep_the_total_time() {
        let r = report(1000, 3);
        let bins = timeline_bins(&r, 3);
        assert!(bins.len() <= MAX_TIMELINE_BARS, "{} bars", bins.len());
        assert_eq!(bins[0].first_epoch, 1);
        assert_eq!(bins.last().unwrap().last_epoch, 1000);
        let total: f64 = bins
            .iter()
            .map(|b| b.compute_s[0] + b.comm_s[0] + b.eval_s)
            .sum();
        assert!((total - 1000.0 * 0.012).abs() < 1e-9, "{total}");
        for w in bins.windows(2) {
            assert_eq!(w[1].first_epoch, w[0].last_epoch + 1);
        }
    }
}
