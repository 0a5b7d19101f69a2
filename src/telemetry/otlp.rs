//! The OTLP pipeline: a tracer provider behind the `tracing` subscriber, a meter provider with
//! the Trellis instruments, both exporting from batch tasks on a small runtime of their own (the
//! gRPC and HTTP clients need a tokio reactor; training threads never run export work).
use super::{otel_metrics, OtlpProtocol, TelemetryError, TelemetryOptions};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{MetricExporter, SpanExporter, WithExportConfig};
use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::runtime::Tokio;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::Level;
use tracing_subscriber::filter::{DynFilterFn, FilterExt, Targets};
use tracing_subscriber::{Layer, Registry};

/// The layer that records Trellis's spans for the exporter.
pub(super) type SpanLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// Whether new spans are recorded (see [`super::Telemetry::pause_tracing`]).
static TRACING: AtomicBool = AtomicBool::new(true);

/// Records new spans from now on, or stops recording them.
pub(super) fn set_tracing(on: bool) {
    TRACING.store(on, Ordering::Relaxed);
}

/// Running exporters.
pub(super) struct Pipeline {
    runtime: tokio::runtime::Runtime,
    tracer: SdkTracerProvider,
    meter: SdkMeterProvider,
    _instruments: otel_metrics::Instruments,
}

impl Pipeline {
    /// Builds the exporters; returns them and the `tracing` layer that feeds them spans (the
    /// caller installs it beside the log layer).
    pub(super) fn start(opts: &TelemetryOptions) -> Result<(Self, SpanLayer), TelemetryError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("trellis-otlp")
            .enable_all()
            .build()
            .map_err(TelemetryError::Runtime)?;
        // Exporters and batch tasks bind to the runtime entered here.
        let _entered = runtime.enter();
        let resource = resource(opts);
        let spans = span_exporter(opts)?;
        let tracer = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(spans, Tokio).build())
            .with_resource(resource.clone())
            .build();
        let reader = PeriodicReader::builder(metric_exporter(opts)?, Tokio)
            .with_interval(opts.metrics_interval)
            .build();
        let meter = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource)
            .build();
        let instruments = otel_metrics::register(&opentelemetry::metrics::MeterProvider::meter(
            &meter, "trellis",
        ));
        // Only Trellis's own spans: the exporter's HTTP/2 stack traces too, and exporting
        // those would feed the exporter its own activity.
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer.tracer("trellis"))
            .with_tracked_inactivity(false)
            .with_threads(false)
            .with_location(false)
            .with_filter(
                Targets::new()
                    .with_target("trellis", Level::INFO)
                    // Evaluated per span, never cached per call site: it can change.
                    .and(DynFilterFn::new(|_, _| TRACING.load(Ordering::Relaxed))),
            );
        drop(_entered);
        let pipeline = Pipeline {
            runtime,
            tracer,
            meter,
            _instruments: instruments,
        };
        Ok((pipeline, layer.boxed()))
    }

    /// Exports the spans and metrics recorded so far, waiting for the collector's answer.
    pub(super) fn flush(&self) -> Result<(), TelemetryError> {
        let traces = self
            .tracer
            .force_flush()
            .map_err(|e| TelemetryError::Flush {
                signal: "traces",
                detail: e.to_string(),
            });
        let metrics = self.meter.force_flush().map_err(|e| TelemetryError::Flush {
            signal: "metrics",
            detail: e.to_string(),
        });
        traces.and(metrics)
    }

    /// Exports what is buffered, then stops the exporters and their runtime. Traces and
    /// metrics are flushed at once, so a slow or unreachable collector delays the exit by one
    /// export timeout, not two.
    pub(super) fn shutdown(self) -> Result<(), TelemetryError> {
        let (traces, metrics) = std::thread::scope(|s| {
            let traces = s.spawn(|| self.tracer.shutdown());
            let metrics = self.meter.shutdown();
            (traces.join(), metrics)
        });
        let traces = match traces {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("the flushing thread panicked".to_string()),
        }
        .map_err(|detail| TelemetryError::Flush {
            signal: "traces",
            detail,
        });
        let metrics = metrics.map_err(|e| TelemetryError::Flush {
            signal: "metrics",
            detail: e.to_string(),
        });
        self.runtime
            .shutdown_timeout(std::time::Duration::from_secs(5));
        traces.and(metrics)
    }
}

/// `service.name`, `OTEL_RESOURCE_ATTRIBUTES` and the node id.
fn resource(opts: &TelemetryOptions) -> Resource {
    // The default detectors read OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    let mut b = Resource::builder().with_attribute(KeyValue::new("trellis.node", opts.node as i64));
    if let Some(name) = &opts.service_name {
        b = b.with_service_name(name.clone());
    } else if super::env("OTEL_SERVICE_NAME").is_none() {
        b = b.with_service_name("trellis");
    }
    b.build()
}

/// `base` with the signal path appended (HTTP endpoints given as options are base URLs).
fn http_url(base: &str, path: &str) -> String {
    format!("{}/{path}", base.trim_end_matches('/'))
}

fn span_exporter(opts: &TelemetryOptions) -> Result<SpanExporter, TelemetryError> {
    let err = |e: opentelemetry_otlp::ExporterBuildError| TelemetryError::Exporter {
        signal: "trace",
        detail: e.to_string(),
    };
    let ep = opts.otlp_endpoint.as_deref();
    match opts.protocol() {
        OtlpProtocol::Grpc => {
            let b = SpanExporter::builder().with_tonic();
            match ep {
                Some(ep) => b.with_endpoint(ep).build(),
                None => b.build(),
            }
        }
        OtlpProtocol::HttpProtobuf => {
            let b = SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
            match ep {
                Some(ep) => b.with_endpoint(http_url(ep, "v1/traces")).build(),
                None => b.build(),
            }
        }
    }
    .map_err(err)
}

fn metric_exporter(opts: &TelemetryOptions) -> Result<MetricExporter, TelemetryError> {
    let err = |e: opentelemetry_otlp::ExporterBuildError| TelemetryError::Exporter {
        signal: "metrics",
        detail: e.to_string(),
    };
    let ep = opts.otlp_endpoint.as_deref();
    match opts.protocol() {
        OtlpProtocol::Grpc => {
            let b = MetricExporter::builder().with_tonic();
            match ep {
                Some(ep) => b.with_endpoint(ep).build(),
                None => b.build(),
            }
        }
        OtlpProtocol::HttpProtobuf => {
            let b = MetricExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
            match ep {
                Some(ep) => b.with_endpoint(http_url(ep, "v1/metrics")).build(),
                None => b.build(),
            }
        }
    }
    .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_base_urls_get_signal_paths() {
        assert_eq!(
            http_url("http://c:4318/", "v1/traces"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            http_url("http://c:4318", "v1/metrics"),
            "http://c:4318/v1/metrics"
        );
    }
}
