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

/// Vertical red lines at the recovered epochs, labelled once in the legend.
fn mark_recoveries<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    xs: &[f64],
    y: (f64, f64),
    chart_name: &'static str,
) -> Result<(), PlotError> {
    if xs.is_empty() {
        return Ok(());
    }
    chart
        .draw_series(
            xs.iter()
                .map(|&x| PathElement::new(vec![(x, y.0), (x, y.1)], MARK.stroke_width(2))),
        )
        .map_err(draw_err(chart_name))?
        .label("recovery")
        .legend(|(x, y)| PathElement::new(vec![(x, y - 6), (x, y + 6)], MARK.stroke_width(2)));
    Ok(())
}

/// The recovery marks, then the legend box (at `pos`, plotters' default place when `None`).
fn marks_and_legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut ChartContext<
        'a,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    xs: &[f64],
    y: (f64, f64),
    pos: Option<SeriesLabelPosition>,
    alpha: f64,
    chart_name: &'static str,
) -> Result<(), PlotError> {
    mark_recoveries(chart, xs, y, chart_name)?;
    let mut labels = chart.configure_series_labels();
    if let Some(pos) = pos {
        labels.position(pos);
    }
    labels
        .background_style(WHITE.mix(alpha))
        .border_style(BLACK)
        .label_font((FAMILY, 14))
        .draw()
        .map_err(draw_err(chart_name))
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

    let (lo, hi) = logs.iter().fold((f64::MAX, f64::MIN), |(a, b), l| {
        (a.min(l.loss), b.max(l.loss))
    });
    let y = padded(lo, hi);
    let caption = format!("{} on {}: training loss", r.model, r.dataset);
    let mut c = epoch_axes(&top, caption, 22, x, y, "loss", NAME)?;
    c.draw_series(LineSeries::new(
        logs.iter().map(|l| (l.epoch as f64, l.loss)),
        COMPUTE.stroke_width(2),
    ))
    .map_err(draw_err(NAME))?
    .label("loss")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], COMPUTE.stroke_width(2)));
    marks_and_legend(&mut c, &marks_x, y, None, 0.8, NAME)?;

    let accuracy = "accuracy".to_string();
    let mut c = epoch_axes(&bottom, accuracy, 22, x, (0.0, 1.0), "accuracy", NAME)?;
    type Pick = fn(&trellis_runtime::EpochLog) -> f64;
    let splits: [(&str, RGBColor, Pick); 3] = [
        ("train", RGBColor(78, 154, 6), |l| l.train_acc),
        ("val", COMM, |l| l.val_acc),
        ("test", COMPUTE, |l| l.test_acc),
    ];
    for (label, color, pick) in splits {
        c.draw_series(LineSeries::new(
            logs.iter().map(|l| (l.epoch as f64, pick(l))),
            color.stroke_width(2),
        ))
        .map_err(draw_err(NAME))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    let pos = Some(SeriesLabelPosition::LowerRight);
    marks_and_legend(&mut c, &marks_x, (0.0, 1.0), pos, 0.8, NAME)?;
    root.present().map_err(draw_err(NAME))?;
    Ok(path.to_path_buf())
}

/// Per partition, along the run's time: each epoch's compute, then communication and waiting
/// (the rest of the training step), then evaluation.
pub fn timeline(r: &RunReport, marks: &[RecoveryMark], path: &Path) -> Result<PathBuf, PlotError> {
    const NAME: &str = "timeline";
    let parts = r.partitions.max(1);
    let root = canvas(path, (1100, 160 + 70 * parts as u32), NAME)?;
    let total_s: f64 = r.epochs_log.iter().map(|l| (l.ms + l.eval_ms) / 1e3).sum();
    let mut c = ChartBuilder::on(&root)
        .caption(
            "per-partition timeline: compute / communication / evaluation",
            (FAMILY, 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..total_s.max(1e-6), -0.5..parts as f64 - 0.5)
        .map_err(draw_err(NAME))?;
    c.configure_mesh()
        .disable_y_mesh()
        .x_desc("time since the first epoch (s)")
        .y_desc("partition")
        .y_labels(parts)
        .y_label_formatter(&|y| format!("{}", y.round() as i64))
        .label_style((FAMILY, 14))
        .draw()
        .map_err(draw_err(NAME))?;
    let mut bars = Vec::new();
    let mut starts = Vec::new();
    let mut t = 0.0;
    for l in &r.epochs_log {
        starts.push((l.epoch, t));
        let (step, eval) = (l.ms / 1e3, l.eval_ms / 1e3);
        for p in 0..parts {
            let compute = l
                .part_compute_ms
                .get(p)
                .copied()
                .unwrap_or(l.compute_ms)
                .min(l.ms)
                / 1e3;
            let (y0, y1) = (p as f64 - 0.35, p as f64 + 0.35);
            bars.push(Rectangle::new(
                [(t, y0), (t + compute, y1)],
                COMPUTE.filled(),
            ));
            bars.push(Rectangle::new(
                [(t + compute, y0), (t + step, y1)],
                COMM.filled(),
            ));
            bars.push(Rectangle::new(
                [(t + step, y0), (t + step + eval, y1)],
                EVAL.filled(),
            ));
        }
        t += step + eval;
    }
    c.draw_series(bars).map_err(draw_err(NAME))?;
    for (label, color) in [
        ("compute", COMPUTE),
        ("communication", COMM),
        ("evaluation", EVAL),
    ] {
        c.draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(draw_err(NAME))?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    let marks_x: Vec<f64> = marks
        .iter()
        .filter_map(|m| starts.iter().find(|(e, _)| *e == m.epoch).map(|(_, t)| *t))
        .collect();
    let (y, pos) = (
        (-0.5, parts as f64 - 0.5),
        Some(SeriesLabelPosition::UpperRight),
    );
    marks_and_legend(&mut c, &marks_x, y, pos, 0.85, NAME)?;
    root.present().map_err(draw_err(NAME))?;
    Ok(path.to_path_buf())
}

/// Halo bytes per epoch (MiB).
pub fn bytes(r: &RunReport, marks: &[RecoveryMark], path: &Path) -> Result<PathBuf, PlotError> {
    const NAME: &str = "halo bytes";
    let root = canvas(path, (1100, 420), NAME)?;
    let logs = &r.epochs_log;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let hi = logs.iter().map(|l| mib(l.halo_bytes)).fold(0.0, f64::max);
    let x = epoch_range(logs);
    let y = (0.0, if hi > 0.0 { hi * 1.1 } else { 1.0 });
    let caption = "halo exchange: MiB per epoch".to_string();
    let mut c = epoch_axes(&root, caption, 20, x, y, "MiB", NAME)?;
    c.draw_series(logs.iter().map(|l| {
        let e = l.epoch as f64;
        Rectangle::new(
            [(e - 0.4, 0.0), (e + 0.4, mib(l.halo_bytes))],
            COMPUTE.filled(),
        )
    }))
    .map_err(draw_err(NAME))?
    .label("halo bytes")
    .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], COMPUTE.filled()));
    let marks_x: Vec<f64> = marks.iter().map(|m| m.epoch as f64).collect();
    marks_and_legend(&mut c, &marks_x, y, None, 0.8, NAME)?;
    root.present().map_err(draw_err(NAME))?;
    Ok(path.to_path_buf())
}
