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

/// A collector that answers every request with `status` (e.g. `500 Internal Server Error`)
/// after waiting `delay` (served by a thread that ends with the test process).
fn collector(status: &'static str, delay: Duration) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
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
                        std::thread::sleep(delay);
                        let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                        let _ = r.get_mut().write_all(answer.as_bytes());
                        len = 0;
                    }
                }
            });
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
fn a_run_succeeds_when_the_collector_is_down_failing_refusing_or_slow() {
    let cases = [
        ("down", closed_port()),
        (
            "HTTP 500",
            collector("500 Internal Server Error", Duration::ZERO),
        ),
        ("HTTP 400", collector("400 Bad Request", Duration::ZERO)),
        // Answers long after the exporter's own timeout.
        ("slow", collector("200 OK", Duration::from_secs(40))),
    ];
    for (what, port) in cases {
        let t = std::time::Instant::now();
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
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "collector {what}: the run took {:?}",
            t.elapsed()
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
