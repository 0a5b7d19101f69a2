//! Telemetry never changes a run's outcome: with the collector down, or answering every export
//! with HTTP 500, a training run and a cluster run still succeed, and the failure is reported
//! once on stderr.
mod binary;
use binary::{assert_ok, trellis};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::time::Duration;

const DATA: &str = "synthetic:nodes=400,degree=6,features=16,classes=4,seed=1";

/// A port nothing listens on.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A collector that answers every request with `500 Internal Server Error` (served by a thread
/// that ends with the test process).
fn failing_collector() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming().flatten() {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let mut r = BufReader::new(conn);
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                if line == "\r\n" {
                    let mut body = vec![0; len];
                    let _ = r.read_exact(&mut body);
                    let _ = r.get_mut().write_all(
                        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n",
                    );
                    len = 0;
                }
            }
        }
    });
    port
}

fn telemetry_warnings(stderr: &[u8]) -> usize {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| l.contains("telemetry"))
        .count()
}

#[test]
fn a_run_succeeds_when_the_collector_is_down_or_failing() {
    for (what, port) in [("down", closed_port()), ("HTTP 500", failing_collector())] {
        let out = trellis()
            .args([
                "train",
                "--data",
                DATA,
                "--partitions",
                "2",
                "--epochs",
                "3",
            ])
            .args(["--otlp-endpoint", &format!("http://127.0.0.1:{port}")])
            .output()
            .unwrap();
        assert_ok(&out);
        let warnings = telemetry_warnings(&out.stderr);
        assert!(
            warnings <= 1,
            "collector {what}: reported {warnings} times: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_cluster_run_succeeds_when_the_collector_is_down() {
    let port = closed_port();
    let out = trellis()
        .args([
            "launch",
            "--nodes",
            "2",
            "--partitions",
            "2",
            "--data",
            DATA,
        ])
        .args(["--epochs", "2"])
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{port}"),
        )
        .output()
        .unwrap();
    let stdout = assert_ok(&out);
    assert!(stdout.contains("weights_digest"), "{stdout}");
}
