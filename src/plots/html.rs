//! The self-contained HTML page: the charts as base64 data URIs, what reproduces the run, its
//! latency summaries, counters and recoveries. No scripts, no external resources.
use super::{PlotError, RecoveryMark};
use base64::Engine;
use std::fmt::Write as _;
use std::path::PathBuf;
use trellis_runtime::RunReport;

/// Escapes text for HTML element content and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn row(out: &mut String, key: &str, value: &str) {
    let _ = writeln!(out, "<tr><th>{}</th><td>{}</td></tr>", esc(key), esc(value));
}

/// `v` with every number that is an `f32` widened to `f64` (the configuration's rates:
/// `0.009999999776482582`) written as the `f32` it was (`0.01`), as the user gave it.
fn as_given(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or_default();
            let narrow = x as f32;
            let shortest = if f64::from(narrow) == x {
                narrow.to_string().parse::<f64>().unwrap_or(x)
            } else {
                x
            };
            serde_json::Number::from_f64(shortest).map_or_else(|| v.clone(), Value::Number)
        }
        Value::Array(a) => Value::Array(a.iter().map(as_given).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, v)| (k.clone(), as_given(v))).collect())
        }
        other => other.clone(),
    }
}

/// The page for `r` with the PNG files `pngs` embedded.
pub fn page(r: &RunReport, marks: &[RecoveryMark], pngs: &[PathBuf]) -> Result<String, PlotError> {
    let mut out = String::new();
    let title = format!("Trellis run: {} on {}", r.model, r.dataset);
    let _ = writeln!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n\
         <style>body{{font-family:sans-serif;margin:2em;max-width:1150px}}\
         table{{border-collapse:collapse;margin:1em 0}}th,td{{border:1px solid #ccc;\
         padding:3px 8px;text-align:left;font-size:14px}}img{{max-width:100%;\
         border:1px solid #ddd;margin:.5em 0}}pre{{background:#f6f6f6;padding:1em;\
         overflow:auto}}</style></head><body>\n<h1>{}</h1>",
        esc(&title),
        esc(&title)
    );

    out.push_str("<h2>Result</h2>\n<table>\n");
    row(
        &mut out,
        "test accuracy (at best validation epoch)",
        &format!("{:.2}%", 100.0 * r.test_acc),
    );
    row(
        &mut out,
        "best validation accuracy",
        &format!("{:.2}% at epoch {}", 100.0 * r.best_val_acc, r.best_epoch),
    );
    row(
        &mut out,
        "median training step",
        &format!("{:.1} ms", r.step_ms_median),
    );
    row(
        &mut out,
        "peak resident memory",
        &format!("{:.1} MiB", r.peak_rss_bytes as f64 / (1u64 << 20) as f64),
    );
    row(
        &mut out,
        "partitions / edge cut",
        &format!("{} / {}", r.partitions, r.edge_cut),
    );
    row(&mut out, "recoveries", &marks.len().to_string());
    out.push_str("</table>\n");

    out.push_str("<h2>What reproduces this run</h2>\n<table>\n");
    row(&mut out, "data set", &r.dataset);
    row(&mut out, "data digest (BLAKE3)", &r.data_digest);
    row(&mut out, "seed", &r.seed.to_string());
    row(&mut out, "epochs", &r.epochs.to_string());
    row(&mut out, "threads", &r.threads.to_string());
    row(&mut out, "code version", &r.code_version);
    row(
        &mut out,
        "code commit",
        r.code_commit.as_deref().unwrap_or("unknown"),
    );
    row(&mut out, "final weights digest", &r.weights_digest);
    row(
        &mut out,
        "trace id",
        r.trace_id.as_deref().unwrap_or("not traced"),
    );
    out.push_str("</table>\n<p>Configuration:</p>\n<pre>");
    let config = serde_json::to_string_pretty(&as_given(&r.config)).unwrap_or_default();
    out.push_str(&esc(&config));
    out.push_str("</pre>\n");

    out.push_str("<h2>Charts</h2>\n");
    for p in pngs {
        let bytes = std::fs::read(p).map_err(|source| PlotError::Io {
            path: p.clone(),
            source,
        })?;
        let name = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "<figure><img alt=\"{}\" src=\"data:image/png;base64,{}\"></figure>",
            esc(&name),
            base64::engine::general_purpose::STANDARD.encode(&bytes)
        );
    }

    if !marks.is_empty() {
        out.push_str(
            "<h2>Recoveries</h2>\n<table><tr><th>kind</th><th>partition</th>\
                      <th>epoch</th><th>detected (ms)</th><th>resumed (ms)</th></tr>\n",
        );
        for m in marks {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td></tr>",
                esc(&m.kind),
                m.partition,
                m.epoch,
                m.detected_ms,
                m.resumed_ms
            );
        }
        out.push_str("</table>\n");
    }

    if !r.latency.is_empty() {
        out.push_str(
            "<h2>Latency (ms)</h2>\n<table><tr><th>metric</th><th>count</th>\
                      <th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>\n",
        );
        for (k, s) in &r.latency {
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{:.3}</td><td>{:.3}</td></tr>",
                esc(k),
                s.count,
                s.p50_ms,
                s.p90_ms,
                s.p99_ms,
                s.max_ms
            );
        }
        out.push_str("</table>\n");
    }
    if !r.counters.is_empty() {
        out.push_str("<h2>Counters</h2>\n<table>\n");
        for (k, v) in &r.counters {
            row(&mut out, k, &v.to_string());
        }
        out.push_str("</table>\n");
    }
    out.push_str("</body></html>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{as_given, esc};

    #[test]
    fn config_values_read_as_given() {
        let cfg = serde_json::json!({
            "lr": f64::from(0.01f32),
            "model": { "dropout": f64::from(0.6f32), "hidden": 16 },
            "weight_decay": f64::from(5e-4f32),
            "exact": 0.1,
        });
        let text = serde_json::to_string(&as_given(&cfg)).unwrap();
        assert_eq!(
            text,
            r#"{"exact":0.1,"lr":0.01,"model":{"dropout":0.6,"hidden":16},"weight_decay":0.0005}"#
        );
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
