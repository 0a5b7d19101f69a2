//! One trace across a cluster: a 2-node `trellis launch` exports into a real OTLP/gRPC
//! receiver (the opentelemetry-proto collector service on a tonic server); the spans of both
//! node processes share the run's trace id, a layer step on node 1 is a child of the
//! coordinator's epoch on node 0 (trace context in the control messages), and a halo receive
//! on one node is a child of the send on the other (trace context in the QUIC frames).
mod binary;
mod support;

use binary::{assert_ok, read_report, trellis};
use std::collections::HashMap;
use support::{int, Received};

#[test]
fn a_two_node_run_is_one_trace_across_both_processes() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (addr, store) = support::grpc_receiver(&rt);
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("run.json");
    let out = trellis()
        .args([
            "launch",
            "--nodes",
            "2",
            "--partitions",
            "2",
            "--epochs",
            "2",
        ])
        .args([
            "--data",
            "synthetic:nodes=800,degree=6,features=12,classes=3,seed=2",
        ])
        .args(["--dir", dir.path().join("c").to_str().unwrap()])
        .args(["--report", report.to_str().unwrap()])
        // Every node process inherits the standard variables.
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"))
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env("OTEL_SERVICE_NAME", "trellis-cluster-test")
        .output()
        .unwrap();
    assert_ok(&out);
    let r = read_report(&report);
    let trace_id = r["trace_id"]
        .as_str()
        .expect("the report names its trace")
        .to_string();
    // Both processes have exited (and flushed their exporters) when launch returns.
    let spans = store.wait_for(
        &trace_id,
        || {},
        |s| {
            let nodes: Vec<i64> = s.iter().filter_map(|r| int(&r.span, "node")).collect();
            nodes.contains(&0) && nodes.contains(&1)
        },
    );
    let by_id: HashMap<&[u8], &Received> = spans
        .iter()
        .map(|r| (r.span.span_id.as_slice(), r))
        .collect();
    let node_of = |r: &Received| int(&r.span, "node").unwrap_or(-1);
    let parent = |r: &Received| by_id.get(r.span.parent_span_id.as_slice()).copied();
    // A layer step of partition 1 (on node 1) under an epoch span of node 0.
    let remote_layers: Vec<&Received> = spans
        .iter()
        .filter(|r| int(&r.span, "partition") == Some(1) && r.span.name == "forward")
        .collect();
    assert!(!remote_layers.is_empty());
    for l in &remote_layers {
        assert_eq!(node_of(l), 1);
        let p = parent(l).expect("a remote layer has its parent in the trace");
        assert_eq!((p.span.name.as_str(), node_of(p)), ("epoch", 0));
    }
    // Halo receives whose send ran in the other process.
    let cross: Vec<(&Received, &Received)> = spans
        .iter()
        .filter(|r| r.span.name == "halo_recv")
        .filter_map(|r| parent(r).map(|p| (r, p)))
        .filter(|(r, p)| node_of(r) != node_of(p))
        .collect();
    assert!(
        !cross.is_empty(),
        "no halo receive linked to a send on the other node"
    );
    for (recv, send) in cross {
        assert_eq!(send.span.name, "halo_send");
        assert_eq!(int(&recv.span, "peer"), int(&send.span, "partition"));
        assert_eq!(int(&recv.span, "bytes"), int(&send.span, "bytes"));
        assert_eq!(int(&recv.span, "epoch"), int(&send.span, "epoch"));
    }
}
