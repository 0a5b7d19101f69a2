//! Traces and metrics over OTLP/HTTP with protobuf bodies into a real receiver (an HTTP/1.1
//! server decoding the opentelemetry-proto export requests).
mod support;

use support::int;
use trellis::telemetry::{self, OtlpProtocol, TelemetryOptions};
use trellis_actors::Topology;
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{DataSource, ModelKind, TrainConfig};

#[test]
fn a_run_exports_spans_and_metrics_over_http_protobuf() {
    let (addr, store) = support::http_receiver();
    let opts = TelemetryOptions {
        otlp_endpoint: Some(format!("http://{addr}")),
        protocol: Some(OtlpProtocol::HttpProtobuf),
        node: 4,
        ..Default::default()
    };
    let t = telemetry::init(&opts).unwrap();
    assert!(t.exporting());
    let ds = DataSource::parse("synthetic:nodes=300,degree=5,features=6,classes=3,seed=3")
        .unwrap()
        .load()
        .unwrap();
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Sage, ds.num_features, ds.num_classes, 0);
    cfg.epochs = 2;
    let report = Topology::partition(&ds, 2, PartitionMethod::Random, None, cfg)
        .unwrap()
        .spawn()
        .unwrap()
        .wait()
        .unwrap();
    let trace = report.trace_id.clone().unwrap();
    let spans = store.wait_for(
        &trace,
        || t.flush().unwrap(),
        |got| got.iter().filter(|r| r.span.name == "epoch").count() == 2,
    );
    let run = spans.iter().find(|r| r.span.name == "run").unwrap();
    assert_eq!(
        int(&run.span, "node"),
        Some(4),
        "the node id is on every span"
    );
    for e in spans.iter().filter(|r| r.span.name == "epoch") {
        assert_eq!(e.span.parent_span_id, run.span.span_id);
    }
    let forward = spans.iter().filter(|r| r.span.name == "forward").count();
    // Layer 1 (16 -> 3 classes) runs split: its two stages are a span each.
    assert_eq!(forward, 2 * 2 * 3, "epochs x partitions x layer stages");
    // Paused, a run records no spans and so has no trace id.
    t.pause_tracing(true);
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Sage, ds.num_features, ds.num_classes, 0);
    cfg.epochs = 1;
    let paused = Topology::partition(&ds, 2, PartitionMethod::Random, None, cfg)
        .unwrap()
        .spawn()
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(paused.trace_id, None);
    t.pause_tracing(false);
    t.shutdown().unwrap();
    // Shutdown pushed the metrics one last time.
    let names = store.metrics.lock().unwrap().clone();
    assert!(
        names.iter().any(|n| n == "trellis.step.duration"),
        "metrics received: {names:?}"
    );
}
