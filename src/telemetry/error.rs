//! Errors of [`super::init`] and of the exporters.
use thiserror::Error;

/// Why telemetry could not start or stop cleanly.
#[derive(Debug, Error)]
pub enum TelemetryError {
    /// An option or `OTEL_*` variable is invalid.
    #[error("telemetry configuration: {0}")]
    Config(String),
    /// The OTLP exporter could not be built (bad endpoint, ...).
    #[error("cannot build the OTLP {signal} exporter: {detail}")]
    Exporter {
        signal: &'static str,
        detail: String,
    },
    /// Another tracing subscriber is already installed in this process.
    #[error("a tracing subscriber is already installed in this process")]
    AlreadyInstalled,
    /// The metrics endpoint could not be served.
    #[error("cannot serve metrics on {addr}: {source}")]
    Serve {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    /// The background runtime of the exporters could not start.
    #[error("cannot start the telemetry runtime: {0}")]
    Runtime(std::io::Error),
    /// Flushing at shutdown failed (the collector is unreachable, ...).
    #[error("flushing {signal} at shutdown: {detail}")]
    Flush {
        signal: &'static str,
        detail: String,
    },
}
