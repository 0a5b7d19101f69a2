//! Serving beside partitioned training (`trellis train --partitions P --serve ADDR`), driven
//! as a user would: the real binary on 127.0.0.1 with an ephemeral port and a real HTTP
//! client; and the topology API's yielding of training partitions to inference work.
mod serve_support;
mod support;

use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::{json, Value};
use serve_support::{agent, s, trellis, Reply};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use trellis_actors::Topology;
use trellis_gpu::PriorityGate;
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{DataSource, ModelKind, TrainConfig};

const DATA: &str = "synthetic:nodes=1500,degree=8,features=16,classes=4,seed=2";
const NODES: u32 = 1500;

/// A running `trellis train --serve`, stopped on drop.
struct Server {
    child: Child,
    url: String,
    /// Its stdout lines after `listening on`.
    lines: mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Runs `trellis ARGS` (with `env`) and waits for its `listening on http://...` line.
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Server {
        let started = serve_support::start(args, env);
        let url = serve_support::listening_url(&started.lines, Duration::from_secs(120));
        Server {
            child: started.child,
            url,
            lines: started.lines,
        }
    }

    /// `/readyz`'s placement: the node serving each serving partition (a cluster's).
    fn placement(&self) -> Vec<u32> {
        let r = serve_support::request(&agent(), "GET", &format!("{}/readyz", self.url), b"", &[]);
        assert_eq!(r.status, 200, "{}", r.text);
        serde_json::from_value(r.body["placement"].clone()).expect("a placement")
    }

    /// Waits (bounded) for a stdout line containing `what`; returns it.
    fn wait_line(&self, what: &str, within: Duration) -> String {
        let end = Instant::now() + within;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(what) => return l,
                Ok(_) => {}
                Err(e) => panic!("no line with {what:?} within {within:?}: {e}"),
            }
        }
    }

    /// Sends SIGINT (Ctrl-C) and waits (bounded) for a successful exit.
    fn interrupt_and_wait(&mut self, within: Duration) {
        // SAFETY: a signal to the child this test started and has not reaped.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) },
            0
        );
        self.exits_successfully(within, "Ctrl-C");
    }

    /// Waits (bounded) for the process to exit successfully; `after` says after what.
    fn exits_successfully(&mut self, within: Duration, after: &str) {
        let end = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "exit after {after}: {status}");
                return;
            }
            assert!(
                Instant::now() < end,
                "still running {within:?} after {after}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn post(&self, agent: &ureq::Agent, path: &str, body: &Value) -> Reply {
        self.post_with(agent, path, body, &[])
    }

    fn post_with(
        &self,
        agent: &ureq::Agent,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Reply {
        post(agent, &format!("{}{path}", self.url), body, headers)
    }
}

/// The answer to a POST of `body` with `headers`.
fn post(agent: &ureq::Agent, url: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    serve_support::request(agent, "POST", url, body.to_string().as_bytes(), headers)
}

/// The `weights_digest` a run's summary printed.
fn digest_of(line: &str) -> String {
    line.split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("no digest in {line:?}"))
        .to_string()
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = row.iter().map(|&x| f64::from(x - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// Probabilities of one answer's predictions, checked whole: one per asked node, in order,
/// each a distribution whose class is its largest entry (and a row of `embedding_width`
/// when asked for).
fn whole_answer(body: &Value, nodes: &[u32], embedding_width: Option<usize>) -> Vec<Vec<f64>> {
    let preds = body["predictions"].as_array().expect("predictions");
    assert_eq!(preds.len(), nodes.len(), "{body}");
    preds
        .iter()
        .zip(nodes)
        .map(|(p, &v)| {
            assert_eq!(p["node"], v, "{body}");
            let row: Vec<f64> = p["probabilities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(row.len(), 4, "{body}");
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-5, "{row:?}");
            let class = p["class"].as_u64().unwrap() as usize;
            let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            assert_eq!(class, best, "{body}");
            if let Some(w) = embedding_width {
                assert_eq!(p["embedding"].as_array().map(Vec::len), Some(w), "{body}");
            }
            row
        })
        .collect()
}

/// Serve beside the training on an ephemeral port, publishing every 25 epochs, and save the
/// last weights to `file`.
fn serving_args(file: &Path) -> [&str; 8] {
    [
        "--serve",
        "127.0.0.1:0",
        "--publish-every",
        "25",
        "--save-model",
        s(file),
        "--save-model-at",
        "last",
    ]
}

/// What querying a service while its training ran saw.
struct WhileTraining {
    /// The trainer's `weights_digest` line.
    digest_line: String,
    /// The trainer's other lines meanwhile.
    said: Vec<String>,
    answers: usize,
    /// Answers looked up on the serving partitions (with embeddings).
    through_actors: usize,
    /// 503s with `Retry-After` saying a serving partition is being recovered (only where
    /// a node is lost).
    recovering: usize,
    /// The versions answers named, in order.
    versions: Vec<String>,
}

/// Queries `queried` for the same nodes (the published rows and, every other request, the
/// serving partition actors with embeddings) until `trainer` prints its weights digest,
/// checking every answer is whole and of one version and versions only move forward.
/// With `node_lost`, a query may also be answered a clear 503 (with `Retry-After`, saying a
/// serving partition is being recovered) while a lost node's serving partition is
/// re-placed: the loss is found by the QUIC idle timeout, after the query's deadline.
fn query_while_training(queried: &Server, trainer: &Server, node_lost: bool) -> WhileTraining {
    let agent = agent();
    let mut seen = WhileTraining {
        digest_line: String::new(),
        said: Vec::new(),
        answers: 0,
        through_actors: 0,
        recovering: 0,
        versions: Vec::new(),
    };
    let asked = [0, 7, NODES - 1, 7];
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        assert!(Instant::now() < deadline, "training did not finish in time");
        let with_embeddings = seen.answers % 2 == 1;
        let body = if with_embeddings {
            json!({ "nodes": asked, "embeddings": 0 })
        } else {
            json!({ "nodes": asked })
        };
        let r = queried.post(&agent, "/v1/predict", &body);
        if node_lost && r.status == 503 {
            assert!(r.retry_after.is_some(), "{}", r.text);
            assert!(r.text.contains("being recovered"), "{}", r.text);
            seen.recovering += 1;
            seen.answers += 1;
            continue;
        }
        assert_eq!(r.status, 200, "{}", r.text);
        let version = r.body["model_version"].as_str().unwrap().to_string();
        assert_eq!(version.len(), 12, "{}", r.text);
        let rows = whole_answer(&r.body, &asked, with_embeddings.then_some(16));
        assert_eq!(rows[1], rows[3], "one node, one answer within a version");
        seen.answers += 1;
        seen.through_actors += usize::from(with_embeddings);
        serve_support::note_version(&mut seen.versions, version);
        if let Ok(line) = trainer.lines.try_recv() {
            if line.starts_with("weights_digest") {
                seen.digest_line = line;
                return seen;
            }
            seen.said.push(line);
        }
    }
}

/// Every node's served probabilities at `server` are of one version and equal those of
/// `trellis predict` with the model file `saved` (1e-5).
fn assert_serves_saved(server: &Server, saved: &Path, dir: &Path) {
    let out = dir.join("logits.npy");
    trellis(&[
        "predict",
        "--model",
        s(saved),
        "--data",
        DATA,
        "--out",
        s(&out),
    ]);
    let worst = worst_difference(server, &out, NODES);
    assert!(
        worst <= 1e-5,
        "served at {} and predicted (saved weights) differ by {worst}",
        server.url
    );
}

/// The largest difference between the probabilities `server` serves for nodes `0..n` (all
/// of one version) and the softmax of the logits `trellis predict` wrote to `logits_file`.
fn worst_difference(server: &Server, logits_file: &Path, n: u32) -> f64 {
    let agent = agent();
    let logits: ndarray::Array2<f32> = ndarray_npy::read_npy(logits_file).unwrap();
    let all: Vec<u32> = (0..n).collect();
    let mut worst = 0f64;
    let mut last_version = None;
    for chunk in all.chunks(500) {
        let r = server.post(&agent, "/v1/predict", &json!({ "nodes": chunk }));
        assert_eq!(r.status, 200, "{}", r.text);
        let v = r.body["model_version"].as_str().unwrap().to_string();
        assert!(last_version.as_ref().is_none_or(|l| *l == v), "{v}");
        last_version = Some(v);
        for (row, &node) in whole_answer(&r.body, chunk, None).iter().zip(chunk) {
            let want = softmax(logits.row(node as usize).as_slice().unwrap());
            for (a, b) in row.iter().zip(&want) {
                worst = worst.max((a - b).abs());
            }
        }
    }
    worst
}

/// Updates through `server` (an edge between the first and last nodes, then a new node
/// with two edges) are served as `trellis predict` with the model file `saved` computes
/// them on the updated graph (1e-5), every node's: on a cluster the updates' regions are
/// recomputed on the serving partitions of every node that owns a part of them.
fn assert_updates_served_as_predicted(server: &Server, saved: &Path, dir: &Path) {
    let ds = DataSource::parse(DATA).unwrap().load().unwrap();
    let agent = agent();
    let width = ds.num_features;
    let r = server.post(&agent, "/v1/edges", &json!({ "add": [[0, NODES - 1]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    let features: Vec<f32> = (0..width).map(|i| (i % 3) as f32).collect();
    let new_node = json!({ "nodes": [{ "features": features, "edges": [3, NODES - 2] }] });
    let r = server.post(&agent, "/v1/nodes", &new_node);
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["predictions"][0]["node"], NODES, "{}", r.text);
    let mut edges: std::collections::BTreeSet<(i64, i64)> = ds
        .edge_src
        .iter()
        .zip(&ds.edge_dst)
        .filter(|(a, b)| a != b)
        .map(|(&a, &b)| (a.min(b) as i64, a.max(b) as i64))
        .collect();
    let n = NODES as i64;
    edges.extend([(0, n - 1), (3, n), (n - 2, n)]);
    let (src, dst): (Vec<i64>, Vec<i64>) = edges.into_iter().unzip();
    let mut all_features = ds.features.clone();
    all_features.extend(&features);
    let updated = serve_support::write_dataset(dir, "updated", &all_features, width, &src, &dst);
    let out = dir.join("updated.npy");
    trellis(&[
        "predict",
        "--model",
        s(saved),
        "--data",
        s(&updated),
        "--out",
        s(&out),
    ]);
    let worst = worst_difference(server, &out, NODES + 1);
    assert!(
        worst <= 1e-5,
        "served after updates and predicted differ by {worst}"
    );
}

/// Trains 2 partitions with `extra` without a service (`trellis train --partitions 2`),
/// then the same run with `--serve` as `run` says (`train`, or `launch` of a cluster),
/// querying it (published rows and, every other request, through the serving partition
/// actors with embeddings) for as long as it trains; checks every answer is whole and of
/// one version, versions only move forward, the weights digest equals the run without
/// the service, and afterwards every served probability equals `trellis predict` with the
/// saved last weights; Ctrl-C then ends the process successfully.
fn serves_beside_partitioned_training(run: &[&str], extra: &[&str]) {
    serves_beside_and_says(run, extra, &[]);
}

/// As [`serves_beside_partitioned_training`], and the service's output says each of `says`
/// (a line containing it) while it trains.
fn serves_beside_and_says(run: &[&str], extra: &[&str], says: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let settings = training_args("600", "2");
    let alone: Vec<&str> = ["train"]
        .iter()
        .chain(&settings)
        .chain(extra)
        .copied()
        .collect();
    let out = trellis(&alone);
    let want = digest_of(
        out.lines()
            .find(|l| l.starts_with("weights_digest"))
            .unwrap(),
    );

    let file = dir.path().join("last.safetensors");
    let mut args: Vec<&str> = run.iter().chain(&settings).chain(extra).copied().collect();
    args.extend(serving_args(&file));
    let server = Server::spawn(&args, &[]);
    let on_cluster = run[0] == "launch";
    if on_cluster {
        // One serving partition beside each training partition, on its node.
        assert_eq!(server.placement(), [0, 1]);
    }
    let node_lost = extra.iter().chain(run).any(|a| a.contains("kill-node"));
    let seen = query_while_training(&server, &server, node_lost);
    for want in says {
        assert!(
            seen.said.iter().any(|l| l.contains(want)),
            "the service never said {want:?}: {:?}",
            seen.said
        );
    }
    println!(
        "{} answers ({} through the serving partitions, {} 503s while a lost node's serving \
         partition was recovered) while training, versions: {:?}",
        seen.answers, seen.through_actors, seen.recovering, seen.versions
    );
    if node_lost {
        // The lost node's serving partition now runs on the coordinator, and the 503s
        // were a short window of the run.
        assert_eq!(server.placement(), [0, 0]);
        assert!(
            seen.recovering * 10 < seen.answers,
            "{} of {}",
            seen.recovering,
            seen.answers
        );
    }
    assert_eq!(
        digest_of(&seen.digest_line),
        want,
        "serving beside changed the trained weights"
    );
    assert!(
        seen.versions.len() >= 3,
        "the version advanced only {} time(s) over 24 publishes: {:?}",
        seen.versions.len() - 1,
        seen.versions
    );
    // Once the last publish is served it says so; then it serves exactly the saved weights.
    server.wait_line("still serving", Duration::from_secs(120));
    assert_serves_saved(&server, &file, dir.path());
    if on_cluster {
        assert_updates_served_as_predicted(&server, &file, dir.path());
    }
    // Ctrl-C stops the service: the process exits, successfully.
    let mut server = server;
    server.interrupt_and_wait(Duration::from_secs(30));
}

#[test]
fn partitioned_training_serves_its_published_weights_and_trains_the_same_weights() {
    serves_beside_partitioned_training(&["train"], &[]);
}

#[test]
fn with_efficient_communication_too() {
    serves_beside_partitioned_training(&["train"], &["--comm", "efficient"]);
}

/// The topology API: training partitions that yield to a gate wait between kernel pieces
/// while urgent work holds it (no epoch finishes), go on once it is released, and end with
/// the weights of the same run without the gate.
#[test]
fn training_partitions_yield_to_inference_and_train_the_same_weights() {
    let ds = DataSource::parse("synthetic:nodes=2000,degree=8,features=32,classes=4,seed=5")
        .unwrap()
        .load()
        .unwrap();
    let cfg = || {
        let mut c = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
        c.epochs = 6;
        c.threads = 2;
        c
    };
    let plain = Topology::partition(&ds, 2, PartitionMethod::Metis, None, cfg())
        .unwrap()
        .spawn()
        .unwrap()
        .wait()
        .unwrap();
    let gate = PriorityGate::new();
    let urgent = gate.urgent();
    let topo = Topology::partition(&ds, 2, PartitionMethod::Metis, None, cfg())
        .unwrap()
        .yielding_to(gate.clone());
    let owners = topo.owners().unwrap();
    assert_eq!(owners.len(), ds.num_nodes);
    assert!(owners.iter().all(|&o| o < 2) && owners.contains(&0) && owners.contains(&1));
    let run = topo.spawn().unwrap();
    // Urgent work holds the gate: the partitions' first kernels wait at their first piece.
    match run.events().recv_timeout(Duration::from_millis(1500)) {
        Err(mpsc::RecvTimeoutError::Timeout) => {}
        other => panic!("training went on while inference held the gate: {other:?}"),
    }
    assert!(gate.yields() >= 1, "no training piece waited for the gate");
    drop(urgent);
    let gated = run.wait().unwrap();
    assert_eq!(gated.epochs_log.len(), 6);
    assert_eq!(
        gated.weights_digest, plain.weights_digest,
        "yielding changed the trained weights"
    );
}

/// The spans of trace `trace` the collector got, once `done` holds for them (bounded).
fn trace_spans(
    store: &support::Store,
    trace: &str,
    done: impl Fn(&[support::Received]) -> bool,
) -> Vec<Span> {
    store
        .wait_for(trace, || {}, done)
        .into_iter()
        .map(|r| r.span)
        .collect()
}

fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// The trace id (hex) of a `traceparent` value.
fn trace_of(traceparent: &str) -> String {
    traceparent.split('-').nth(1).unwrap().to_string()
}

/// A service beside 2 training partitions exporting to a test collector: a
/// predict-with-embeddings request (in the caller's trace, named by its `traceparent`) and a
/// node update are each one trace, from the HTTP span through the engine's batch or update
/// spans down to the serving partition actors' lookup or step spans.
#[test]
fn each_request_is_one_trace_down_to_the_partition_actors() {
    let (collector, store) = support::http_receiver();
    let endpoint = format!("http://{collector}");
    let server = Server::spawn(
        &[
            "train",
            "--data",
            DATA,
            "--partitions",
            "2",
            "--epochs",
            "20",
            "--threads",
            "2",
            "--serve",
            "127.0.0.1:0",
            "--publish-every",
            "10",
            "--otlp-endpoint",
            &endpoint,
        ],
        // Export batches every 200 ms (the OpenTelemetry SDK's standard variable).
        &[("OTEL_BSP_SCHEDULE_DELAY", "200")],
    );
    server.wait_line("still serving", Duration::from_secs(120));
    let agent = agent();

    // A query through the partition actors, as part of the caller's trace.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let every: Vec<u32> = (0..NODES).collect();
    let r = server.post_with(
        &agent,
        "/v1/predict",
        &json!({ "nodes": every, "embeddings": 1 }),
        &[(
            "traceparent",
            &format!("00-{caller_trace}-{caller_span}-01"),
        )],
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let tp = r.traceparent.expect("a traced answer names its span");
    assert_eq!(trace_of(&tp), caller_trace, "{tp}");
    let spans = trace_spans(&store, caller_trace, |got| {
        got.iter().filter(|r| r.span.name == "serve_lookup").count() == 2
            && got.iter().any(|r| r.span.name == "serve_request")
    });
    let request = named(&spans, "serve_request");
    assert_eq!(request.len(), 1);
    let request = request[0];
    assert_eq!(support::hex(&request.parent_span_id), caller_span);
    assert_eq!(support::string(request, "route"), Some("/v1/predict"));
    assert_eq!(support::int(request, "status"), Some(200));
    let batch = named(&spans, "serve_batch");
    assert_eq!(batch.len(), 1, "one engine step served the request");
    assert_eq!(batch[0].parent_span_id, request.span_id);
    let mut parts: Vec<i64> = named(&spans, "serve_lookup")
        .iter()
        .map(|l| {
            assert_eq!(l.parent_span_id, batch[0].span_id);
            assert_eq!(support::int(l, "layer"), Some(1));
            support::int(l, "partition").unwrap()
        })
        .collect();
    parts.sort_unstable();
    assert_eq!(parts, [0, 1], "both partitions own asked nodes");

    // A node update: a trace of its own (no caller span), named in the answer.
    let features: Vec<f32> = (0..16).map(|i| (i % 3) as f32).collect();
    let r = server.post(
        &agent,
        "/v1/nodes",
        &json!({ "nodes": [{ "features": features, "edges": [0, 700, NODES - 1] }] }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let trace = trace_of(&r.traceparent.expect("a traced answer names its span"));
    // 2 layers on 2 partitions.
    let spans = trace_spans(&store, &trace, |got| {
        got.iter().filter(|r| r.span.name == "serve_step").count() == 4
            && got.iter().any(|r| r.span.name == "serve_request")
    });
    let request = named(&spans, "serve_request");
    assert_eq!(request.len(), 1);
    assert!(request[0].parent_span_id.is_empty(), "a root span");
    assert_eq!(support::string(request[0], "route"), Some("/v1/nodes"));
    let add = named(&spans, "serve_add_nodes");
    assert_eq!(add.len(), 1);
    assert_eq!(add[0].parent_span_id, request[0].span_id);
    let update = named(&spans, "serve_update");
    assert_eq!(update.len(), 1);
    assert_eq!(update[0].parent_span_id, add[0].span_id);
    let mut steps: Vec<(i64, i64)> = named(&spans, "serve_step")
        .iter()
        .map(|st| {
            assert_eq!(st.parent_span_id, update[0].span_id);
            (
                support::int(st, "layer").unwrap(),
                support::int(st, "partition").unwrap(),
            )
        })
        .collect();
    steps.sort_unstable();
    assert_eq!(steps, [(0, 0), (0, 1), (1, 0), (1, 1)]);
}

/// `trellis bench serve --beside-partitions 2`: (c) trains on 2 partition actors beside
/// (a)'s load, reports its latencies and epoch rate, and publishes weights the service
/// then serves.
#[test]
fn bench_serve_measures_a_beside_partitioned_training() {
    let out = trellis(&[
        "bench",
        "serve",
        "--data",
        DATA,
        "--hidden",
        "16",
        "--seconds",
        "1",
        "--beside-seconds",
        "2",
        "--rate-predict",
        "300",
        "--rate-new",
        "0",
        "--rate-light",
        "0",
        "--connections",
        "4",
        "--threads",
        "2",
        "--beside-partitions",
        "2",
    ]);
    for row in ["(a) existing-node predict", "(c) (a) beside training"] {
        let line = out
            .lines()
            .find(|l| l.starts_with(row))
            .unwrap_or_else(|| panic!("no `{row}` in {out}"));
        assert!(
            line.contains("p99.9") && line.contains("failed 0"),
            "{line}"
        );
    }
    assert!(out.contains("(c) training on 2 partition actors"), "{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("(c) p99"))
        .unwrap_or_else(|| panic!("no (c) summary in {out}"));
    assert!(summary.contains("% of its epoch rate"), "{summary}");
    assert!(
        summary.contains("the served version advanced"),
        "training beside the service published no weights: {summary}"
    );
}

/// A step serving several requests (a batch): the child of the first traced request's span,
/// with span links to the other requests' spans (untraced requests are skipped).
#[test]
fn a_batch_step_is_the_child_of_its_first_request_and_links_the_others() {
    use trellis::telemetry::{self, OtlpProtocol, TelemetryOptions};
    let (collector, store) = support::http_receiver();
    let t = telemetry::init(&TelemetryOptions {
        otlp_endpoint: Some(format!("http://{collector}")),
        protocol: Some(OtlpProtocol::HttpProtobuf),
        ..Default::default()
    })
    .unwrap();
    // Only `trellis*` targets are exported.
    let requests: Vec<tracing::Span> = (0..3)
        .map(|i| tracing::info_span!(target: "trellis::tests", "serve_request", request = i))
        .collect();
    let contexts: Vec<_> = requests
        .iter()
        .map(|s| trellis_actors::telemetry::context_of(s).expect("a recorded span"))
        .collect();
    let batch = tracing::info_span!(target: "trellis::tests", "serve_batch");
    trellis_actors::telemetry::join_requests(
        &batch,
        [
            Some(contexts[0]),
            None,
            Some(contexts[1]),
            Some(contexts[2]),
        ],
    );
    drop(batch);
    drop(requests);
    let spans: Vec<Span> = store
        .wait_for(
            &contexts[0].trace_id_hex(),
            || t.flush().unwrap(),
            |got| got.iter().any(|r| r.span.name == "serve_batch"),
        )
        .into_iter()
        .map(|r| r.span)
        .collect();
    let batch = named(&spans, "serve_batch")[0];
    assert_eq!(batch.parent_span_id, contexts[0].span_id);
    let links: Vec<(Vec<u8>, Vec<u8>)> = batch
        .links
        .iter()
        .map(|l| (l.trace_id.clone(), l.span_id.clone()))
        .collect();
    let want: Vec<(Vec<u8>, Vec<u8>)> = contexts[1..]
        .iter()
        .map(|c| (c.trace_id.to_vec(), c.span_id.to_vec()))
        .collect();
    assert_eq!(links, want, "links to the batch's other requests");
    assert_ne!(
        contexts[1].trace_id, contexts[0].trace_id,
        "each request is its own trace"
    );
    t.shutdown().unwrap();
}

/// A cluster's training serves beside itself from its coordinator (`trellis launch
/// --serve`): the same checks as in one process (the cluster's weights equal the
/// single-process run's), and the launcher passes Ctrl-C on and exits cleanly.
#[test]
fn cluster_training_serves_its_published_weights_and_trains_the_same_weights() {
    serves_beside_partitioned_training(&["launch", "--nodes", "2"], &[]);
}

/// Node 1 dies (SIGKILL) in epoch 300 while the coordinator serves: the coordinator adopts
/// its partition from the replica (its stream yielding to the service as the coordinator's
/// own do), training ends with the weights of the run without fault or service, and the
/// service answered whole, one-version answers throughout and serves the last weights.
#[test]
fn cluster_training_that_loses_a_node_keeps_serving_and_trains_the_same_weights() {
    serves_beside_and_says(
        &[
            "launch",
            "--nodes",
            "2",
            "--heartbeat-ms",
            "100",
            "--idle-timeout-ms",
            "800",
            "--chaos",
            "kill-node:node=1:epoch=300",
        ],
        &[],
        // The fault fired, and the recovery restored the committed weights.
        &[
            "recovered: loss of node 1 (partitions 1->node 0) in epoch 300",
            "restored state matched its digest",
        ],
    );
}

/// A launch on an emulated network (where the service would listen inside a namespace) is
/// refused with a message saying why, not ignored.
#[test]
fn serve_beside_cluster_training_is_refused_where_it_cannot_serve() {
    let refused = |args: &[&str], says: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    };
    refused(
        &[
            "launch",
            "--nodes",
            "2",
            "--data",
            DATA,
            "--serve",
            "127.0.0.1:0",
            "--link-rate",
            "1gbit",
        ],
        "--serve with --link-rate",
    );
}

/// A cluster of `trellis node` processes on 127.0.0.1, node 0 (the coordinator) serving
/// beside the training and node 1 given `--serve` too: node 1's address answers the API
/// while the cluster trains and after, each answer whole and of one version, versions
/// moving forward, and at the end exactly `trellis predict` with the saved last weights;
/// Ctrl-C to the coordinator ends both processes successfully.
#[test]
fn another_node_of_a_training_cluster_takes_queries_for_the_coordinators_service() {
    let dir = tempfile::tempdir().unwrap();
    let c0 = two_node_cluster(dir.path(), "c0.toml", "127.0.0.1:0");
    let (addr_file, file) = (
        dir.path().join("node0.addr"),
        dir.path().join("last.safetensors"),
    );
    let mut args = coordinator_args(&c0, &addr_file, "300");
    args.extend(serving_args(&file));
    // The coordinator listens once node 1 has joined its training and its service.
    let started = serve_support::start(&args, &[]);
    let mut node1 = serving_node1(dir.path(), &addr_file);
    let url = serve_support::listening_url(&started.lines, Duration::from_secs(120));
    let mut coordinator = Server {
        child: started.child,
        url,
        lines: started.lines,
    };
    assert_ne!(node1.url, coordinator.url);
    // Node 1 serves its training partition's serving partition.
    assert_eq!(coordinator.placement(), [0, 1]);
    let seen = query_while_training(&node1, &coordinator, false);
    println!(
        "{} answers through node 1 while the cluster trained, versions: {:?}",
        seen.answers, seen.versions
    );
    assert!(seen.versions.len() >= 3, "versions: {:?}", seen.versions);
    coordinator.wait_line("still serving", Duration::from_secs(120));
    // After the run: node 1 still answers, as the coordinator does, with the saved weights.
    assert_serves_saved(&node1, &file, dir.path());
    let agent = agent();
    let body = json!({ "nodes": [0, 1, 2, NODES - 1], "embeddings": 0 });
    let (via, direct) = (
        node1.post(&agent, "/v1/predict", &body),
        coordinator.post(&agent, "/v1/predict", &body),
    );
    assert_eq!(via.status, 200, "{}", via.text);
    assert_eq!(
        via.body, direct.body,
        "node 1 answers as the coordinator does"
    );
    // Ctrl-C to the coordinator ends the service; node 1 then ends too, successfully.
    coordinator.interrupt_and_wait(Duration::from_secs(30));
    node1.exits_successfully(Duration::from_secs(30), "the coordinator stopped");
}

/// Certificates for nodes 0 and 1 in `dir` (made once) and the cluster file `dir/name` of
/// the two, node 0 (the coordinator) at `coordinator`, node 1 at any port.
fn two_node_cluster(dir: &Path, name: &str, coordinator: &str) -> PathBuf {
    let certs = dir.join("certs");
    if !certs.exists() {
        trellis::transport::certs::init(&certs).unwrap();
        for i in 0..2 {
            trellis::transport::certs::issue(&certs, i).unwrap();
        }
    }
    let path = dir.join(name);
    let text = format!(
        "certs = \"certs\"\npartitions = \"parts\"\njoin_timeout_ms = 60000\n\
         [[node]]\nid = 0\naddr = \"{coordinator}\"\n[[node]]\nid = 1\naddr = \"127.0.0.1:0\"\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// `trellis node` arguments of the coordinator of cluster file `c0` training `epochs` epochs
/// of GCN on 2 partitions, its QUIC address written to `addr_file`.
fn coordinator_args<'a>(c0: &'a Path, addr_file: &'a Path, epochs: &'a str) -> Vec<&'a str> {
    let mut args = vec![
        "node",
        "--cluster",
        s(c0),
        "--id",
        "0",
        "--addr-file",
        s(addr_file),
    ];
    args.extend(training_args(epochs, "1"));
    args
}

/// GCN on `DATA` in 2 partitions for `epochs` epochs with `threads` kernel threads.
fn training_args<'a>(epochs: &'a str, threads: &'a str) -> [&'a str; 10] {
    [
        "--data",
        DATA,
        "--model",
        "gcn",
        "--partitions",
        "2",
        "--epochs",
        epochs,
        "--threads",
        threads,
    ]
}

/// Node 1 of the cluster whose coordinator writes its address to `addr_file`, taking
/// queries (`--serve`) on an ephemeral port.
fn serving_node1(dir: &Path, addr_file: &Path) -> Server {
    let c1 = two_node_cluster(dir, "c1.toml", &bound_addr(addr_file));
    let args = [
        "node",
        "--cluster",
        s(&c1),
        "--id",
        "1",
        "--serve",
        "127.0.0.1:0",
    ];
    Server::spawn(&args, &[])
}

/// The QUIC address node 0 wrote to `addr_file` (waits at most a minute).
fn bound_addr(addr_file: &Path) -> String {
    let t = Instant::now();
    loop {
        if let Ok(a) = std::fs::read_to_string(addr_file) {
            return a;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "node 0 never bound");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A node given `--serve` in a cluster whose coordinator does not serve answers 503 at once
/// (with `Retry-After`), saying why, and ends successfully after the run.
#[test]
fn a_node_forwarding_to_a_coordinator_that_does_not_serve_answers_503_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    let c0 = two_node_cluster(dir.path(), "c0.toml", "127.0.0.1:0");
    let addr_file = dir.path().join("node0.addr");
    let coordinator = serve_support::start(&coordinator_args(&c0, &addr_file, "150"), &[]);
    let mut coordinator = Server {
        child: coordinator.child,
        url: String::new(),
        lines: coordinator.lines,
    };
    let mut node1 = serving_node1(dir.path(), &addr_file);
    let t = Instant::now();
    let r = node1.post(&agent(), "/v1/predict", &json!({ "nodes": [0] }));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(r.status, 503, "{}", r.text);
    assert!(r.retry_after.is_some(), "{}", r.text);
    assert!(r.text.contains("does not serve"), "{}", r.text);
    coordinator.exits_successfully(Duration::from_secs(120), "its run");
    node1.exits_successfully(Duration::from_secs(30), "the coordinator's run");
}
