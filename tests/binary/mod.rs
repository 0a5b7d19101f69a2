//! Running the `trellis` binary as a user does, for the integration tests.
// Each test binary uses a part of this module.
#![allow(dead_code)]
use std::path::Path;
use std::process::{Command, Output};

/// The `trellis` binary, not exporting to a collector the environment may name (a test that
/// wants one sets the variables on the command).
pub fn trellis() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_trellis"));
    c.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    c
}

/// Checks that the command succeeded (else fails with its stderr); returns its stdout.
#[track_caller]
pub fn assert_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "trellis failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A run report written by `--report`.
pub fn read_report(path: &Path) -> serde_json::Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("report {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("report {}: {e}", path.display()))
}

/// `GET path` from the HTTP server at `addr` (`host:port`): the status line and the body.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(String, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

/// The value of the sample line starting with `series ` in Prometheus text.
pub fn prometheus_sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Whether this process may build network namespaces (effective CAP_NET_ADMIN and
/// CAP_SYS_ADMIN) and has iproute2; else prints why `test` is skipped.
pub fn can_build_networks(test: &str) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .unwrap_or(0);
    let needed = (1u64 << 12) | (1u64 << 21);
    if caps & needed != needed {
        println!("SKIPPED: {test}: needs CAP_NET_ADMIN and CAP_SYS_ADMIN (run the tests as root)");
        return false;
    }
    let ip = std::process::Command::new("ip").arg("-V").output();
    if !ip.is_ok_and(|o| o.status.success()) {
        println!("SKIPPED: {test}: iproute2 (`ip`, `tc`) is not installed");
        return false;
    }
    true
}
