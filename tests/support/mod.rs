//! A real OTLP receiver for the telemetry tests: the collector services of opentelemetry-proto
//! served over gRPC (tonic) and over HTTP/protobuf (a small HTTP/1.1 server), storing every
//! span and metric name they receive.
#![allow(dead_code)]
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A span as received, with its resource's attributes.
#[derive(Debug, Clone)]
pub struct Received {
    pub resource: Vec<KeyValue>,
    pub span: Span,
}

/// Everything the receiver got.
#[derive(Default)]
pub struct Store {
    pub spans: Mutex<Vec<Received>>,
    pub metrics: Mutex<Vec<String>>,
}

impl Store {
    fn take_traces(&self, req: ExportTraceServiceRequest) {
        let mut spans = self.spans.lock().unwrap();
        for rs in req.resource_spans {
            let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received {
                        resource: resource.clone(),
                        span,
                    });
                }
            }
        }
    }

    fn take_metrics(&self, req: ExportMetricsServiceRequest) {
        let mut names = self.metrics.lock().unwrap();
        for rm in req.resource_metrics {
            for sm in rm.scope_metrics {
                names.extend(sm.metrics.into_iter().map(|m| m.name));
            }
        }
    }

    /// The spans of trace `trace_id` (hex), waiting (bounded) until `done` holds for them.
    pub fn wait_for(
        &self,
        trace_id: &str,
        flush: impl Fn(),
        done: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let start = Instant::now();
        loop {
            flush();
            let got: Vec<Received> = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .filter(|r| hex(&r.span.trace_id) == trace_id)
                .cloned()
                .collect();
            if done(&got) {
                return got;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "trace {trace_id} incomplete after 30 s: {} spans: {:?}",
                got.len(),
                got.iter().map(|r| &r.span.name).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The value of attribute `key` in `attrs`.
pub fn value<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

/// An integer attribute of a span.
pub fn int(span: &Span, key: &str) -> Option<i64> {
    match value(&span.attributes, key)? {
        any_value::Value::IntValue(i) => Some(*i),
        _ => None,
    }
}

/// A float attribute of a span.
pub fn float(span: &Span, key: &str) -> Option<f64> {
    match value(&span.attributes, key)? {
        any_value::Value::DoubleValue(v) => Some(*v),
        any_value::Value::IntValue(i) => Some(*i as f64),
        _ => None,
    }
}

/// A string attribute of a span.
pub fn string<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match value(&span.attributes, key)? {
        any_value::Value::StringValue(s) => Some(s),
        _ => None,
    }
}

#[derive(Clone)]
struct Grpc(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.take_traces(req.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Grpc {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.0.take_metrics(req.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

/// Serves the OTLP/gRPC collector services on a free loopback port of `rt`.
pub fn grpc_receiver(rt: &tokio::runtime::Runtime) -> (SocketAddr, Arc<Store>) {
    let store = Arc::new(Store::default());
    let _in_rt = rt.enter();
    let incoming =
        tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let svc = Grpc(store.clone());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(svc.clone()))
            .add_service(MetricsServiceServer::new(svc))
            .serve_with_incoming(incoming),
    );
    (addr, store)
}

/// Serves OTLP/HTTP with protobuf bodies (`POST /v1/traces`, `POST /v1/metrics`) on a free
/// loopback port, one thread per connection, keep-alive honoured.
pub fn http_receiver() -> (SocketAddr, Arc<Store>) {
    let store = Arc::new(Store::default());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let s = store.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let s = s.clone();
            std::thread::spawn(move || serve_http(conn, &s));
        }
    });
    (addr, store)
}

fn serve_http(conn: std::net::TcpStream, store: &Store) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        match path.as_str() {
            "/v1/traces" => {
                store.take_traces(ExportTraceServiceRequest::decode(&body[..]).unwrap())
            }
            "/v1/metrics" => {
                store.take_metrics(ExportMetricsServiceRequest::decode(&body[..]).unwrap())
            }
            other => panic!("unexpected OTLP path {other}"),
        }
        let _ = out.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n",
        );
    }
}
