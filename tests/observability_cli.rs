//! The `trellis` binary's observability as an operator uses it: scraping `/metrics` during a
//! run, and `trellis report` turning a run record into PNG charts and an HTML page.
use base64::Engine;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const DATA: &str = "synthetic:nodes=800,degree=6,features=12,classes=3,seed=5";

mod binary;
use binary::{assert_ok, http_get as get, prometheus_sample as sample, read_report, trellis};

#[test]
fn metrics_are_scraped_while_training() {
    let mut child = trellis()
        .args([
            "train",
            "--data",
            DATA,
            "--partitions",
            "2",
            "--epochs",
            "20",
            "--metrics-addr",
            "127.0.0.1:0",
            "--metrics-linger",
            "60",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .strip_prefix("metrics: http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("first line should name the endpoint: {first}"))
        .to_string();
    let start = Instant::now();
    let text = loop {
        let (status, body) = get(&addr, "/metrics").unwrap();
        assert_eq!(status, "HTTP/1.1 200 OK");
        // Done once all 20 training steps are counted (the endpoint lingers after the run).
        if sample(&body, "trellis_step_seconds_count") == Some(20.0) {
            break body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "last scrape:\n{body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        text.contains("# TYPE trellis_step_seconds summary"),
        "{text}"
    );
    for series in [
        "trellis_step_seconds{quantile=\"0.5\"}",
        "trellis_step_seconds{quantile=\"0.99\"}",
        "trellis_step_seconds{quantile=\"1\"}",
        "trellis_all_reduce_seconds_count",
        "trellis_halo_exchange_seconds_count{partition=\"0\",peer=\"1\"}",
        "trellis_halo_exchange_seconds_count{partition=\"1\",peer=\"0\"}",
    ] {
        assert!(
            sample(&text, series).is_some_and(|v| v > 0.0),
            "{series} in\n{text}"
        );
    }
    let bytes = sample(
        &text,
        "trellis_halo_bytes_total{partition=\"0\",peer=\"1\"}",
    )
    .unwrap();
    let msgs = sample(
        &text,
        "trellis_halo_messages_total{partition=\"0\",peer=\"1\"}",
    )
    .unwrap();
    assert!(bytes > 0.0 && msgs > 0.0);
    let (status, _) = get(&addr, "/nothing").unwrap();
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    child.kill().unwrap();
    child.wait().unwrap();
}

fn png_size(bytes: &[u8]) -> (u32, u32) {
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().expect("a valid PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("PNG pixels decode");
    // Not blank: charts draw more than the white background.
    assert!(buf.iter().any(|&b| b != 255), "blank image");
    (info.width, info.height)
}

#[test]
fn report_renders_pngs_and_a_self_contained_page() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let out = trellis()
        .args([
            "train",
            "--data",
            DATA,
            "--partitions",
            "2",
            "--epochs",
            "6",
            "--chaos",
            "panic:part=1:epoch=4",
            "--report",
            json.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_ok(&out);
    let report = read_report(&json);
    // The record of what reproduces the run, and the latency summary.
    for key in [
        "config",
        "data_digest",
        "code_version",
        "seed",
        "weights_digest",
    ] {
        assert!(!report[key].is_null(), "{key}");
    }
    // Built from a git checkout, the commit is recorded.
    let commit = report["code_commit"].as_str().unwrap_or("");
    assert!(commit.is_empty() || commit.len() == 40, "{commit}");
    let step = &report["latency"]["step"];
    for q in ["p50_ms", "p90_ms", "p99_ms", "max_ms"] {
        assert!(step[q].as_f64().unwrap() > 0.0, "{q}: {step}");
    }
    assert_eq!(
        report["epochs_log"][0]["part_compute_ms"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    let charts = dir.path().join("charts");
    let out = trellis()
        .args([
            "report",
            json.to_str().unwrap(),
            "--out",
            charts.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_ok(&out);
    let names = ["loss_accuracy.png", "timeline.png", "halo_bytes.png"];
    for name in names {
        let (w, h) = png_size(&std::fs::read(charts.join(name)).unwrap());
        assert!(w >= 800 && h >= 300, "{name}: {w}x{h}");
    }
    let html = std::fs::read_to_string(charts.join("report.html")).unwrap();
    let images: Vec<&str> = html
        .split("src=\"data:image/png;base64,")
        .skip(1)
        .map(|s| &s[..s.find('"').unwrap()])
        .collect();
    assert_eq!(images.len(), names.len());
    for (b64, name) in images.iter().zip(names) {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(
            bytes,
            std::fs::read(charts.join(name)).unwrap(),
            "{name} embedded as is"
        );
    }
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "self-contained"
    );
    for needle in [
        report["weights_digest"].as_str().unwrap(),
        report["data_digest"].as_str().unwrap(),
        commit,
        "actor-panic",
        "halo_exchange{partition=0,peer=1}",
    ] {
        assert!(html.contains(needle), "{needle} missing from the page");
    }
}

#[test]
fn report_of_a_missing_file_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.json");
    let out = trellis()
        .args([
            "report",
            missing.to_str().unwrap(),
            "--out",
            dir.path().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("none.json"), "{err}");
    assert!(!Path::new(&dir.path().join("report.html")).exists());
}
