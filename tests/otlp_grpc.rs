//! Traces and metrics over OTLP/gRPC into a real receiver (the opentelemetry-proto collector
//! services on a tonic server): a partitioned run is one trace whose spans link run -> epoch ->
//! layer -> halo send -> halo receive, with a recovery; a halo block carries its send span's
//! context between two QUIC nodes; the Trellis metrics arrive as OTLP metrics.
mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use support::{float, hex, int, string, Received, Store};
use trellis::telemetry::{self, OtlpProtocol, Telemetry, TelemetryOptions};
use trellis_actors::{FaultPlan, Topology};
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{DataSource, ModelKind, TrainConfig};
use trellis_transport::Phase;

struct Env {
    _rt: tokio::runtime::Runtime,
    store: Arc<Store>,
    telemetry: Mutex<Telemetry>,
}

/// One receiver and one telemetry pipeline for the whole test binary (the tracing subscriber
/// is process-wide).
fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (addr, store) = support::grpc_receiver(&rt);
        let opts = TelemetryOptions {
            otlp_endpoint: Some(format!("http://{addr}")),
            protocol: Some(OtlpProtocol::Grpc),
            service_name: Some("trellis-test".into()),
            node: 0,
            ..Default::default()
        };
        let telemetry = Mutex::new(telemetry::init(&opts).unwrap());
        Env {
            _rt: rt,
            store,
            telemetry,
        }
    })
}

fn flush() {
    env().telemetry.lock().unwrap().flush().unwrap();
}

fn by_name<'a>(spans: &'a [Received], name: &str) -> Vec<&'a Received> {
    spans.iter().filter(|r| r.span.name == name).collect()
}

fn ids(spans: &[&Received]) -> HashSet<Vec<u8>> {
    spans.iter().map(|r| r.span.span_id.clone()).collect()
}

#[test]
fn a_partitioned_run_is_one_linked_trace() {
    let env = env();
    let ds = DataSource::parse("synthetic:nodes=500,degree=6,features=8,classes=3,seed=2")
        .unwrap()
        .load()
        .unwrap();
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 1);
    cfg.epochs = 3;
    let faults = FaultPlan::none().panic_at(1, 2, 0, Phase::Backward);
    let report = Topology::partition(&ds, 2, PartitionMethod::Metis, None, cfg)
        .unwrap()
        .with_faults(faults)
        .spawn()
        .unwrap()
        .wait()
        .unwrap();
    let trace = report
        .trace_id
        .clone()
        .expect("a traced run records its trace id");
    let spans = env.store.wait_for(&trace, flush, |got| {
        let names: Vec<&str> = got.iter().map(|r| r.span.name.as_str()).collect();
        names.contains(&"run") && names.iter().filter(|n| **n == "epoch").count() == 3
    });

    // Every span of the run carries the run's trace id and the node's resource attribute.
    for r in &spans {
        assert_eq!(hex(&r.span.trace_id), trace);
        assert_eq!(
            support::value(&r.resource, "trellis.node"),
            Some(&opentelemetry_proto::tonic::common::v1::any_value::Value::IntValue(0)),
        );
    }
    let run = by_name(&spans, "run");
    assert_eq!(run.len(), 1);
    assert!(
        run[0].span.parent_span_id.is_empty(),
        "the run span is the root"
    );
    assert_eq!(int(&run[0].span, "partitions"), Some(2));

    let epochs = by_name(&spans, "epoch");
    assert_eq!(epochs.len(), 3);
    for e in &epochs {
        assert_eq!(e.span.parent_span_id, run[0].span.span_id);
        assert_eq!(int(&e.span, "node"), Some(0));
    }
    let epoch_of: HashMap<Vec<u8>, i64> = epochs
        .iter()
        .map(|e| (e.span.span_id.clone(), int(&e.span, "epoch").unwrap()))
        .collect();

    // Layer spans: children of their epoch's span, named by phase, with partition/node/epoch/layer.
    let mut layers = Vec::new();
    for name in ["forward", "backward", "eval"] {
        layers.extend(by_name(&spans, name));
    }
    // 3 epochs x 2 partitions x 2 layers x 3 phases, plus the replayed step of epoch 2.
    assert!(layers.len() >= 36, "{} layer spans", layers.len());
    let mut seen = HashSet::new();
    for l in &layers {
        let s = &l.span;
        let epoch = epoch_of
            .get(&s.parent_span_id)
            .unwrap_or_else(|| panic!("{} span without an epoch parent", s.name));
        assert_eq!(int(s, "epoch"), Some(*epoch));
        assert_eq!(int(s, "node"), Some(0));
        let part = int(s, "partition").unwrap();
        let layer = int(s, "layer").unwrap();
        assert!((0..2).contains(&part) && (0..2).contains(&layer), "{s:?}");
        seen.insert((s.name.clone(), part, layer));
    }
    assert_eq!(seen.len(), 12, "every phase x partition x layer: {seen:?}");

    // Halo sends are children of a layer span; each receive is a child of its send.
    let layer_ids = ids(&layers);
    let sends = by_name(&spans, "halo_send");
    assert!(!sends.is_empty());
    let send_by_id: HashMap<Vec<u8>, &Received> =
        sends.iter().map(|r| (r.span.span_id.clone(), *r)).collect();
    for s in &sends {
        assert!(layer_ids.contains(&s.span.parent_span_id));
        assert!(int(&s.span, "bytes").unwrap() > 0);
        assert_ne!(int(&s.span, "peer"), int(&s.span, "partition"));
    }
    let recvs = by_name(&spans, "halo_recv");
    assert!(!recvs.is_empty());
    for r in &recvs {
        let send = send_by_id
            .get(&r.span.parent_span_id)
            .expect("a halo receive is a child of its send");
        assert_eq!(int(&r.span, "peer"), int(&send.span, "partition"));
        assert_eq!(int(&r.span, "partition"), int(&send.span, "peer"));
        assert_eq!(int(&r.span, "bytes"), int(&send.span, "bytes"));
        assert_eq!(int(&r.span, "layer"), int(&send.span, "layer"));
    }

    // All-reduce under the epoch; apply under the all-reduce; replication under apply.
    let reduces = by_name(&spans, "all_reduce");
    assert_eq!(reduces.len(), 3);
    assert!(reduces
        .iter()
        .all(|r| epoch_of.contains_key(&r.span.parent_span_id)));
    let applies = by_name(&spans, "apply");
    assert!(applies.len() >= 6);
    let reduce_ids = ids(&reduces);
    assert!(applies
        .iter()
        .all(|a| reduce_ids.contains(&a.span.parent_span_id)));
    let apply_ids = ids(&applies);
    let reps = by_name(&spans, "replicate");
    assert_eq!(reps.len(), applies.len());
    assert!(reps
        .iter()
        .all(|r| apply_ids.contains(&r.span.parent_span_id)));

    // The recovery: its kind, partition, epoch and both durations, under epoch 2's span.
    let rec = by_name(&spans, "recovery");
    assert_eq!(rec.len(), 1);
    let s = &rec[0].span;
    assert_eq!(string(s, "kind"), Some("actor-panic"));
    assert_eq!(int(s, "partition"), Some(1));
    assert_eq!(epoch_of.get(&s.parent_span_id), Some(&2));
    assert!(float(s, "detected_ms").unwrap() >= 0.0);
    assert!(float(s, "resumed_ms").unwrap() > 0.0);
    assert_eq!(int(s, "steps_replayed"), Some(1));

    // The run report summarises the latency histograms.
    for key in ["step", "all_reduce", "recovery"] {
        let l = report
            .latency
            .get(key)
            .unwrap_or_else(|| panic!("no {key} latency"));
        assert!(
            l.count >= 1 && l.p50_ms <= l.p99_ms && l.p99_ms <= l.max_ms,
            "{key}: {l:?}"
        );
    }
    assert_eq!(report.latency["step"].count, 3);
    assert!(report
        .latency
        .keys()
        .any(|k| k.starts_with("halo_exchange{partition=0,peer=1}")));
    assert_eq!(report.counters["restarts{partition=1}"], 1);

    // The same metrics reach the collector as OTLP metrics.
    let start = std::time::Instant::now();
    loop {
        flush();
        let names = env.store.metrics.lock().unwrap().clone();
        let want = [
            "trellis.step.duration",
            "trellis.halo_exchange.duration",
            "trellis.halo_bytes",
            "trellis.restarts",
        ];
        if want.iter().all(|w| names.iter().any(|n| n == w)) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "metrics so far: {names:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_halo_block_carries_its_send_span_between_quic_nodes() {
    use trellis_actors::telemetry::{context_of, set_parent};
    use trellis_transport::certs::ClusterCa;
    use trellis_transport::quic::{QuicConfig, QuicTransport};
    use trellis_transport::{HaloBlock, MsgHeader, PartId, Transport};

    let env = env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let run = uuid::Uuid::new_v4();
    let ca = ClusterCa::generate().unwrap();
    let inbox: Arc<Mutex<Vec<HaloBlock>>> = Arc::default();
    let (a, b) = rt.block_on(async {
        let (a, _) =
            QuicTransport::bind(QuicConfig::loopback(), &ca.issue_identity(1).unwrap()).unwrap();
        let (b, _) =
            QuicTransport::bind(QuicConfig::loopback(), &ca.issue_identity(2).unwrap()).unwrap();
        let sink = inbox.clone();
        b.register(
            PartId(20),
            Arc::new(move |blk| {
                sink.lock().unwrap().push(blk);
                true
            }),
        );
        b.set_epoch(run, 1);
        a.add_peer(2, b.local_addr());
        a.route(PartId(20), 2);
        (a, b)
    });

    // Node 1: a layer span and, under it, the send span whose context the block carries.
    let layer =
        tracing::info_span!(target: "trellis::test", "forward", partition = 10u32, node = 1u32);
    let send = tracing::info_span!(target: "trellis::test", parent: &layer, "halo_send", partition = 10u32, peer = 20u32);
    let header = MsgHeader {
        run,
        epoch: 1,
        layer: 0,
        phase: Phase::Forward,
        from: PartId(10),
        to: PartId(20),
    };
    let block = HaloBlock {
        header,
        rows: 2,
        cols: 2,
        payload: trellis_transport::HaloPayload::F32(Arc::from(vec![1.0f32, 2.0, 3.0, 4.0])),
        trace: context_of(&send),
    };
    let sent = block.trace.expect("an exported span has a context");
    a.send(block).unwrap();
    rt.block_on(async {
        a.flush(Duration::from_secs(10)).await.unwrap();
        let start = std::time::Instant::now();
        while inbox.lock().unwrap().is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "block not delivered"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    drop(send);
    drop(layer);

    // Node 2: the receive span takes the block's context as its parent.
    let got = inbox.lock().unwrap().pop().unwrap();
    assert_eq!(got.trace, Some(sent));
    let recv =
        tracing::info_span!(target: "trellis::test", "halo_recv", partition = 20u32, peer = 10u32);
    set_parent(&recv, got.trace);
    drop(recv.enter());
    let recv_ctx = context_of(&recv).unwrap();
    drop(recv);
    assert_eq!(recv_ctx.trace_id, sent.trace_id);

    let trace = sent.trace_id_hex();
    let spans = env.store.wait_for(&trace, flush, |got| got.len() >= 3);
    let find = |name: &str| by_name(&spans, name)[0].span.clone();
    let (layer, send, recv) = (find("forward"), find("halo_send"), find("halo_recv"));
    assert_eq!(send.parent_span_id, layer.span_id);
    assert_eq!(send.span_id, sent.span_id.to_vec());
    assert_eq!(
        recv.parent_span_id, send.span_id,
        "receive is a child of the send"
    );
    rt.block_on(async {
        a.close().await;
        b.close().await;
    });
}
