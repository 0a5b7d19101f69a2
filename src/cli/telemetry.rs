//! The telemetry flags shared by commands that train (`--otlp-endpoint`, `--otlp-protocol`,
//! `--metrics-addr`, `--metrics-linger`) and how they start [`crate::telemetry`].
use crate::telemetry::{self, Telemetry, TelemetryOptions};
use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Clone, Default, Args)]
pub struct TelemetryArgs {
    /// Export traces and metrics to this OpenTelemetry collector (OTLP); without it the
    /// standard OTEL_EXPORTER_OTLP_ENDPOINT decides, and nothing is exported if unset.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf).
    #[arg(long)]
    pub otlp_protocol: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0 picks one; the address is
    /// printed as `metrics: http://.../metrics`).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Keep serving /metrics this many seconds after training, for a last scrape.
    #[arg(long, default_value_t = 0)]
    pub metrics_linger: u64,
}

impl TelemetryArgs {
    /// Starts telemetry for node `node` (prints the metrics address when serving).
    pub fn start(&self, node: u32) -> Result<Telemetry> {
        let mut opts = TelemetryOptions::from_env()?;
        opts.node = node;
        opts.otlp_endpoint = self.otlp_endpoint.clone();
        if let Some(p) = &self.otlp_protocol {
            opts.protocol = Some(p.parse()?);
        }
        opts.metrics_addr = self.metrics_addr;
        let t = telemetry::init(&opts).context("cannot start telemetry")?;
        if let Some(addr) = t.metrics_addr() {
            println!("metrics: http://{addr}/metrics");
        }
        Ok(t)
    }

    /// Waits `--metrics-linger` seconds if metrics are served, then stops telemetry (flushing
    /// spans and metrics to the collector). Telemetry never changes a run's outcome: a
    /// collector that is down, slow or refusing is reported once on stderr, and the command
    /// still succeeds.
    pub fn finish(&self, t: Telemetry) {
        if t.metrics_addr().is_some() && self.metrics_linger > 0 {
            std::thread::sleep(Duration::from_secs(self.metrics_linger));
        }
        if let Err(e) = t.shutdown() {
            eprintln!("warning: telemetry: {e} (the run's results are unaffected)");
        }
    }
}
