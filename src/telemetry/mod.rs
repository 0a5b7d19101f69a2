//! Observability of a Trellis process: [`init`] turns on what its [`TelemetryOptions`] ask for
//! and returns the [`Telemetry`] guard that keeps it running.
//!
//! - Traces: the `tracing` spans of the runtime (run, epoch, forward/backward/eval per layer and
//!   partition, halo send and receive, all-reduce, apply and replicate, recovery) exported to an
//!   OpenTelemetry collector over OTLP, gRPC or HTTP/protobuf, when `--otlp-endpoint` or the
//!   standard `OTEL_EXPORTER_OTLP_*` variables say where. Otherwise every span is disabled
//!   at its call site and costs a cached flag check.
//! - Logs: the runtime's `tracing` events on stderr, warnings and errors unless `RUST_LOG`
//!   chooses otherwise, each line tagged with the node id (also [`init_logs`], for commands
//!   that export nothing).
//! - Metrics: the latency histograms and counters of [`trellis_runtime::metrics`], exported
//!   as OTLP metrics alongside the traces (`otel_metrics`) and served as Prometheus text on
//!   `--metrics-addr` at `/metrics` ([`prometheus`]).
//!
//! A node binary calls [`init`] once, early, with [`TelemetryOptions::from_env`] plus its
//! flags and its node id, keeps the guard for the life of the process and drops it (or calls
//! [`Telemetry::shutdown`]) at exit so that the last spans and metrics are flushed.
mod error;
mod otel_metrics;
mod otlp;
pub mod prometheus;

pub use error::TelemetryError;

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;
use tracing_subscriber::filter::{filter_fn, FilterExt, Targets};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (`grpc`, usually port 4317).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (`http/protobuf`, usually port 4318); the OpenTelemetry
    /// specification's default.
    HttpProtobuf,
}

impl FromStr for OtlpProtocol {
    type Err = TelemetryError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "grpc" => Ok(OtlpProtocol::Grpc),
            "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
            other => Err(TelemetryError::Config(format!(
                "OTLP protocol `{other}` is not supported (use grpc or http/protobuf)"
            ))),
        }
    }
}

/// What to turn on.
#[derive(Debug, Clone)]
pub struct TelemetryOptions {
    /// The collector's OTLP endpoint (e.g. `http://collector:4317`); overrides
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`. For HTTP it is the base URL: `/v1/traces` and
    /// `/v1/metrics` are appended.
    pub otlp_endpoint: Option<String>,
    /// The OTLP transport; from `OTEL_EXPORTER_OTLP_PROTOCOL` when unset, else HTTP/protobuf.
    pub protocol: Option<OtlpProtocol>,
    /// `service.name`; from `OTEL_SERVICE_NAME` when unset, else `trellis`.
    pub service_name: Option<String>,
    /// This process's node id: the `trellis.node` resource attribute and the `node` attribute
    /// of every span.
    pub node: u32,
    /// Serve Prometheus text on this address at `/metrics` (port 0 picks a free port).
    pub metrics_addr: Option<SocketAddr>,
    /// How often metrics are pushed over OTLP (they are also pushed at shutdown).
    pub metrics_interval: Duration,
}

impl Default for TelemetryOptions {
    fn default() -> Self {
        TelemetryOptions {
            otlp_endpoint: None,
            protocol: None,
            service_name: None,
            node: 0,
            metrics_addr: None,
            metrics_interval: Duration::from_secs(10),
        }
    }
}

/// A set, non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl TelemetryOptions {
    /// Options from the standard OpenTelemetry variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`; `OTEL_RESOURCE_ATTRIBUTES` is read
    /// when the exporter starts).
    pub fn from_env() -> Result<Self, TelemetryError> {
        let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .map(|p| p.parse())
            .transpose()?;
        Ok(TelemetryOptions {
            otlp_endpoint: None,
            protocol,
            service_name: env("OTEL_SERVICE_NAME"),
            ..Default::default()
        })
    }

    /// Whether traces and metrics go to a collector: an endpoint was given, here or in
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
    pub fn exports(&self) -> bool {
        self.otlp_endpoint.is_some()
            || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
            || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
    }

    fn protocol(&self) -> OtlpProtocol {
        self.protocol.unwrap_or(OtlpProtocol::HttpProtobuf)
    }
}

/// Keeps exporters and the metrics endpoint running; flushes and stops them when dropped.
pub struct Telemetry {
    otlp: Option<otlp::Pipeline>,
    server: Option<prometheus::MetricsServer>,
}

impl Telemetry {
    /// The address `/metrics` is served on, once bound.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(|s| s.addr())
    }

    /// Whether spans and metrics are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.otlp.is_some()
    }

    /// Exports the spans and metrics recorded so far now (they are otherwise exported in
    /// batches every few seconds, and at shutdown).
    pub fn flush(&self) -> Result<(), TelemetryError> {
        match &self.otlp {
            Some(p) => p.flush(),
            None => Ok(()),
        }
    }

    /// Stops (`true`) or resumes (`false`) recording new spans while the exporters keep
    /// running: an operator's switch for a hot loop, and how the overhead example compares
    /// export on and off epoch by epoch in one process. No effect when not exporting.
    pub fn pause_tracing(&self, paused: bool) {
        if self.otlp.is_some() {
            otlp::set_tracing(!paused);
        }
    }

    /// Flushes what is buffered and stops exporting and serving.
    pub fn shutdown(mut self) -> Result<(), TelemetryError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), TelemetryError> {
        if let Some(s) = self.server.take() {
            s.stop();
        }
        match self.otlp.take() {
            Some(p) => p.shutdown(),
            None => Ok(()),
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("telemetry: {e}");
        }
    }
}

/// Starts what `opts` asks for, and the log on stderr: the runtime's warnings and errors
/// (a lost peer, a dropped block, a recovery that failed), or what `RUST_LOG` selects
/// (`tracing_subscriber`'s target syntax, e.g. `trellis_actors=debug,warn`). Installing the
/// tracing subscriber is process-wide: a second `init` that exports fails with
/// [`TelemetryError::AlreadyInstalled`]; one that does not keeps the first one's.
pub fn init(opts: &TelemetryOptions) -> Result<Telemetry, TelemetryError> {
    trellis_actors::telemetry::set_node(opts.node);
    let log = log_filter(env("RUST_LOG").as_deref())?;
    let (otlp, spans) = match opts.exports() {
        true => {
            let (pipeline, layer) = otlp::Pipeline::start(opts)?;
            (Some(pipeline), Some(layer))
        }
        false => (None, None),
    };
    let exporting = spans.is_some();
    if !install(log, Some(opts.node), spans) && exporting {
        return Err(TelemetryError::AlreadyInstalled);
    }
    let server = opts
        .metrics_addr
        .map(prometheus::MetricsServer::start)
        .transpose()?;
    Ok(Telemetry { otlp, server })
}

/// Only the log on stderr (as [`init`] starts it, untagged), for commands that export
/// nothing (`predict`, `bench`, `partition`, ...). Does nothing where a subscriber is
/// installed already.
pub fn init_logs() -> Result<(), TelemetryError> {
    install(log_filter(env("RUST_LOG").as_deref())?, None, None);
    Ok(())
}

/// Installs the process's subscriber: `spans` (the exporter's layer), if any, and the log
/// on stderr showing what `log` lets through, each line tagged with `node` if given.
/// False if a subscriber was installed already.
fn install(log: Targets, node: Option<u32>, spans: Option<otlp::SpanLayer>) -> bool {
    // Two types, not an `Option` layer: an absent layer in a stack with per-layer filters
    // would enable every span.
    match spans {
        Some(spans) => {
            let subscriber = tracing_subscriber::registry()
                .with(spans)
                .with(log_layer(log, node));
            tracing::subscriber::set_global_default(subscriber).is_ok()
        }
        None => {
            let subscriber = tracing_subscriber::registry().with(log_layer(log, node));
            tracing::subscriber::set_global_default(subscriber).is_ok()
        }
    }
}

/// The log on stderr: the events `log` lets through (never a span: one it let through
/// would be created for nothing), each line tagged with `node` if given.
fn log_layer<S>(log: Targets, node: Option<u32>) -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .event_format(NodeTagged {
            node,
            inner: tracing_subscriber::fmt::format(),
        })
        .with_filter(log.and(filter_fn(|m| m.is_event())))
}

/// A log line's format: `node N ` first (the processes of a cluster on one machine share a
/// terminal), then `inner`'s.
struct NodeTagged<F> {
    node: Option<u32>,
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for NodeTagged<F>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        if let Some(node) = self.node {
            write!(writer, "node {node} ")?;
        }
        self.inner.format_event(ctx, writer, event)
    }
}

/// What the log on stderr shows: `RUST_LOG` (`tracing_subscriber`'s target syntax) when
/// set, else warnings and errors.
fn log_filter(spec: Option<&str>) -> Result<Targets, TelemetryError> {
    match spec {
        None => Ok(Targets::new().with_default(tracing::Level::WARN)),
        Some(s) => s.parse().map_err(|e| {
            TelemetryError::Config(format!("RUST_LOG `{s}` is not a log filter: {e}"))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_shows_warnings_unless_rust_log_says_otherwise() {
        use tracing::Level;
        let default = log_filter(None).unwrap();
        assert!(default.would_enable("trellis_actors::serving", &Level::WARN));
        assert!(!default.would_enable("trellis_actors::serving", &Level::INFO));
        let chosen = log_filter(Some("trellis_transport=debug,error")).unwrap();
        assert!(chosen.would_enable("trellis_transport::quic", &Level::DEBUG));
        assert!(!chosen.would_enable("trellis_actors", &Level::WARN));
        let e = log_filter(Some("trellis=loud")).unwrap_err().to_string();
        assert!(e.contains("RUST_LOG") && e.contains("trellis=loud"), "{e}");
    }

    #[test]
    fn protocols_parse() {
        assert_eq!("grpc".parse::<OtlpProtocol>().unwrap(), OtlpProtocol::Grpc);
        assert_eq!(
            "http/protobuf".parse::<OtlpProtocol>().unwrap(),
            OtlpProtocol::HttpProtobuf
        );
        let e = "http/json".parse::<OtlpProtocol>().unwrap_err().to_string();
        assert!(e.contains("http/json"), "{e}");
    }

    #[test]
    fn without_endpoint_or_address_nothing_starts() {
        let opts = TelemetryOptions::default();
        if opts.exports() {
            return; // the environment of this test run points at a collector
        }
        let t = init(&opts).unwrap();
        assert!(!t.exporting());
        assert_eq!(t.metrics_addr(), None);
        if env("RUST_LOG").is_none() {
            // Only the log is installed, and it lets no span through: spans stay a flag check.
            assert!(tracing::info_span!("probe").is_disabled());
            assert!(tracing::error_span!("probe").is_disabled());
        }
        t.shutdown().unwrap();
    }
}
