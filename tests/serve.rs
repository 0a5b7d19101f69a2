//! `trellis serve` as a user runs it: the real binary on 127.0.0.1 with an ephemeral port,
//! driven by a real HTTP client (ureq). Predictions equal `trellis predict`; after random
//! sequences of updates they equal a fresh `trellis predict` on the updated graph; model
//! swaps never fail or mix versions; every kind of bad request is a 4xx that says what is
//! wrong while everyone else keeps being served; partition actors that panic under
//! open-loop load are restarted and recomputed with no failed or wrong answer. Runs with 1,
//! 2 and 3 partition actors.
mod serve_support;

use serde_json::{json, Value};
use serve_support::{agent, first_allowed_cpu, http_thread_cpus, s, trellis, Reply};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use trellis::runtime::{DataSource, Dataset};

const DATA: &str = "synthetic:nodes=1500,degree=8,features=16,classes=4,seed=2";

/// A running `trellis serve` (or `trellis train --serve`), stopped on drop.
struct Server {
    child: Child,
    url: String,
    /// Its stdout lines after `listening on`.
    lines: std::sync::mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut args = vec!["serve", "--model", s(model), "--data", DATA];
        args.extend(["--listen", "127.0.0.1:0", "--threads", "2"]);
        args.extend(extra);
        Server::spawn(&args)
    }

    /// Runs `trellis ARGS` and waits for its `listening on http://...` line.
    fn spawn(args: &[&str]) -> Server {
        let started = serve_support::start(args, &[]);
        let url = serve_support::listening_url(&started.lines, Duration::from_secs(60));
        Server {
            child: started.child,
            url,
            lines: started.lines,
        }
    }

    fn addr(&self) -> String {
        self.url.trim_start_matches("http://").to_string()
    }
}

fn call(agent: &ureq::Agent, method: &str, url: &str, body: &[u8], key: Option<&str>) -> Reply {
    let key: Vec<_> = key.map(|k| ("x-api-key", k)).into_iter().collect();
    serve_support::request(agent, method, url, body, &key)
}

fn post(server: &Server, path: &str, body: &Value) -> Reply {
    call(
        &agent(),
        "POST",
        &format!("{}{path}", server.url),
        body.to_string().as_bytes(),
        None,
    )
}

fn train(dir: &Path, name: &str, model: &str, seed: &str) -> PathBuf {
    let file = dir.join(name);
    trellis(&[
        "train",
        "--data",
        DATA,
        "--model",
        model,
        "--epochs",
        "15",
        "--seed",
        seed,
        "--save-model",
        s(&file),
    ]);
    file
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = row.iter().map(|&x| ((x - m) as f64).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// `trellis predict` on `data` (a spec or a folder): the logits.
fn predict(model: &Path, data: &str, dir: &Path) -> ndarray::Array2<f32> {
    let out = dir.join("logits.npy");
    trellis(&[
        "predict",
        "--model",
        s(model),
        "--data",
        data,
        "--out",
        s(&out),
    ]);
    ndarray_npy::read_npy(&out).unwrap()
}

/// The served probabilities of `nodes`.
fn served(server: &Server, nodes: &[u32]) -> (String, Vec<Vec<f64>>) {
    let mut probs = Vec::new();
    let mut version = String::new();
    for chunk in nodes.chunks(1000) {
        let r = post(server, "/v1/predict", &json!({ "nodes": chunk }));
        assert_eq!(r.status, 200, "{}", r.text);
        version = r.body["model_version"].as_str().unwrap().to_string();
        for (p, &v) in r.body["predictions"].as_array().unwrap().iter().zip(chunk) {
            assert_eq!(p["node"], v);
            let row: Vec<f64> = p["probabilities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let class = p["class"].as_u64().unwrap() as usize;
            let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
            assert_eq!(class, best);
            probs.push(row);
        }
    }
    (version, probs)
}

/// The probabilities of every prediction of an answer's body (none for an error's body).
fn probabilities(body: &Value) -> Vec<Vec<f64>> {
    body["predictions"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    p["probabilities"]
                        .as_array()
                        .map(|xs| xs.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
                        .unwrap_or_default()
                })
                .collect()
        })
        .unwrap_or_default()
}

fn assert_close(served: &[Vec<f64>], logits: &ndarray::Array2<f32>, what: &str) {
    assert_eq!(served.len(), logits.nrows(), "{what}: row count");
    let mut worst = 0f64;
    for (i, row) in served.iter().enumerate() {
        let want = softmax(logits.row(i).as_slice().unwrap());
        for (a, b) in row.iter().zip(&want) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(
        worst <= 1e-5,
        "{what}: served and predicted differ by {worst}"
    );
}

/// Writes `ds` with the served graph's extra nodes and edges as a PyG-style folder.
fn write_dataset(dir: &Path, features: &[f32], width: usize, src: &[i64], dst: &[i64]) -> PathBuf {
    serve_support::write_dataset(dir, "updated", features, width, src, dst)
}

/// A small deterministic generator (the test's own, for reproducible update sequences).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn predictions_equal_trellis_predict_and_stay_equal_after_random_updates() {
    let dir = tempfile::tempdir().unwrap();
    for (model, parts, seed) in [("gcn", "3", 1u64), ("sage", "1", 2), ("gat", "2", 3)] {
        let file = train(dir.path(), &format!("{model}.safetensors"), model, "0");
        let server = Server::start(&file, &["--partitions", parts]);
        let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
        let all: Vec<u32> = (0..ds.num_nodes as u32).collect();
        let (_, probs) = served(&server, &all);
        assert_close(&probs, &predict(&file, DATA, dir.path()), model);

        // The graph as the test tracks it: undirected edges as (min, max).
        let mut edges: std::collections::BTreeSet<(u32, u32)> = ds
            .edge_src
            .iter()
            .zip(&ds.edge_dst)
            .filter(|(a, b)| a != b)
            .map(|(&a, &b)| (a.min(b), a.max(b)))
            .collect();
        let mut features = ds.features.clone();
        let mut n = ds.num_nodes;
        let mut rng = Lcg(seed);
        let mut max_rows = 0u64;
        for _ in 0..12 {
            match rng.below(3) {
                0 => {
                    let feats: Vec<f64> = (0..16).map(|_| rng.below(1000) as f64 / 250.0).collect();
                    let targets: Vec<u32> =
                        (0..1 + rng.below(4)).map(|_| rng.below(n) as u32).collect();
                    let r = post(
                        &server,
                        "/v1/nodes",
                        &json!({ "nodes": [{ "features": feats, "edges": targets }] }),
                    );
                    assert_eq!(r.status, 200, "{}", r.text);
                    assert_eq!(r.body["predictions"][0]["node"], n as u64);
                    features.extend(feats.iter().map(|&x| x as f32));
                    for t in targets {
                        edges.insert((t, n as u32));
                    }
                    n += 1;
                }
                1 => {
                    let a = rng.below(n) as u32;
                    let b = rng.below(n) as u32;
                    if a == b {
                        continue;
                    }
                    let r = post(&server, "/v1/edges", &json!({ "add": [[a, b]] }));
                    assert_eq!(r.status, 200, "{}", r.text);
                    edges.insert((a.min(b), a.max(b)));
                }
                _ => {
                    let &(a, b) = edges.iter().nth(rng.below(edges.len())).unwrap();
                    let r = post(&server, "/v1/edges", &json!({ "remove": [[b, a]] }));
                    assert_eq!(r.status, 200, "{}", r.text);
                    assert_eq!(r.body["edges_removed"], 1);
                    edges.remove(&(a, b));
                }
            }
        }
        // Additions sent together: each answered with its own node; the metrics count
        // every node once (updates that merged several count once).
        let barrier = std::sync::Barrier::new(8);
        let added: Vec<(u64, Vec<f64>, Vec<u32>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8u64)
                .map(|k| {
                    let (url, barrier) = (format!("{}/v1/nodes", server.url), &barrier);
                    let feats: Vec<f64> = (0..16).map(|i| ((i + k) % 7) as f64 / 3.0).collect();
                    let targets = vec![(k * 13 % n as u64) as u32, (k * 29 % n as u64) as u32];
                    scope.spawn(move || {
                        let body = json!({ "nodes": [{ "features": feats, "edges": targets }] });
                        barrier.wait();
                        let r = call(&agent(), "POST", &url, body.to_string().as_bytes(), None);
                        assert_eq!(r.status, 200, "{}", r.text);
                        (
                            r.body["predictions"][0]["node"].as_u64().unwrap(),
                            feats,
                            targets,
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut added = added;
        added.sort_by_key(|(id, _, _)| *id);
        for (id, feats, targets) in added {
            assert_eq!(id, n as u64, "new nodes take the next ids");
            features.extend(feats.iter().map(|&x| x as f32));
            for t in targets {
                edges.insert((t, n as u32));
            }
            n += 1;
        }
        let metrics = call(
            &agent(),
            "GET",
            &format!("{}/metrics", server.url),
            b"",
            None,
        )
        .text;
        let counter = |name: &str| -> u64 {
            let line = metrics
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("/metrics lacks {name}:\n{metrics}"));
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        };
        let (nodes_added, updates) = (
            counter("trellis_serve_added_nodes_total"),
            counter("trellis_serve_addition_updates_total"),
        );
        assert_eq!(nodes_added, (n - ds.num_nodes) as u64, "{model}");
        assert!(
            updates >= 1 && updates <= nodes_added,
            "{model}: {updates} updates"
        );
        // Only the k-hop region was recomputed: far fewer rows than the graph has.
        let r = post(
            &server,
            "/v1/edges",
            &json!({ "add": [[0, 1]], "remove": [] }),
        );
        for rows in r.body["recomputed_rows"].as_array().unwrap() {
            max_rows = max_rows.max(rows.as_u64().unwrap());
        }
        edges.insert((0, 1));
        assert!(
            max_rows < n as u64 / 4,
            "{model}: recomputed {max_rows} of {n} rows"
        );
        let (src, dst): (Vec<i64>, Vec<i64>) =
            edges.iter().map(|&(a, b)| (a as i64, b as i64)).unzip();
        let updated = write_dataset(dir.path(), &features, 16, &src, &dst);
        let all: Vec<u32> = (0..n as u32).collect();
        let (_, probs) = served(&server, &all);
        assert_close(
            &probs,
            &predict(&file, s(&updated), dir.path()),
            &format!("{model} after updates"),
        );
    }
}

#[test]
fn model_swaps_never_fail_or_mix_versions() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = train(dir.path(), "v1.safetensors", "gcn", "0");
    let v2 = train(dir.path(), "v2.safetensors", "gcn", "7");
    let server = Server::start(&v1, &["--partitions", "2"]);
    let old = post(&server, "/v1/predict", &json!({ "nodes": [5] }));
    let old_version = old.body["model_version"].as_str().unwrap().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let url = server.url.clone();
    let flag = stop.clone();
    let load = std::thread::spawn(move || {
        let agent = agent();
        let mut seen = Vec::new();
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            let r = call(
                &agent,
                "POST",
                &format!("{url}/v1/predict"),
                b"{\"nodes\":[5,6,7]}",
                None,
            );
            assert_eq!(r.status, 200, "a query failed during the swap: {}", r.text);
            let versions: Vec<&str> = vec![r.body["model_version"].as_str().unwrap()];
            seen.push((
                versions[0].to_string(),
                r.body["predictions"][0]["probabilities"].clone(),
            ));
        }
        seen
    });
    std::thread::sleep(Duration::from_millis(200));
    let bytes = std::fs::read(&v2).unwrap();
    let r = call(
        &agent(),
        "PUT",
        &format!("{}/v1/model", server.url),
        &bytes,
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let new_version = r.body["model_version"].as_str().unwrap().to_string();
    assert_ne!(new_version, old_version);
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = load.join().unwrap();
    assert!(seen.len() > 10, "only {} queries ran", seen.len());
    // Versions only move forward, and each version's numbers are that version's.
    let first_new = seen
        .iter()
        .position(|(v, _)| *v == new_version)
        .expect("v2 served");
    assert!(seen[..first_new].iter().all(|(v, _)| *v == old_version));
    assert!(seen[first_new..].iter().all(|(v, _)| *v == new_version));
    for (v, p) in &seen {
        let want = if *v == old_version {
            &old.body["predictions"][0]["probabilities"]
        } else {
            &seen[first_new].1
        };
        assert_eq!(
            p, want,
            "an answer of version {v} has another version's numbers"
        );
    }
    let logits = predict(&v2, DATA, dir.path());
    let (version, probs) = served(&server, &(0..1500).collect::<Vec<u32>>());
    assert_eq!(version, new_version);
    assert_close(&probs, &logits, "after the swap");
    // A model of another shape is refused with a reason, and the old one keeps serving.
    let other = dir.path().join("wide.safetensors");
    trellis(&[
        "train",
        "--data",
        DATA,
        "--hidden",
        "32",
        "--epochs",
        "2",
        "--save-model",
        s(&other),
    ]);
    let r = call(
        &agent(),
        "PUT",
        &format!("{}/v1/model", server.url),
        &std::fs::read(&other).unwrap(),
        None,
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.text.contains("not the architecture being served"),
        "{}",
        r.text
    );
    let r = call(
        &agent(),
        "PUT",
        &format!("{}/v1/model", server.url),
        b"not a model",
        None,
    );
    assert_eq!(r.status, 400);
    assert!(r.text.contains("PUT /v1/model body"), "{}", r.text);
    assert_eq!(served(&server, &[1]).0, new_version);
}

/// Sends raw bytes and returns the status line and body.
fn raw(addr: &str, request: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(request).unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out
}

#[test]
fn bad_requests_get_a_4xx_that_says_what_is_wrong_and_others_are_still_served() {
    let dir = tempfile::tempdir().unwrap();
    let file = train(dir.path(), "m.safetensors", "gcn", "0");
    let server = Server::start(
        &file,
        &[
            "--max-batch",
            "50",
            "--max-body-bytes",
            "20000",
            "--client-timeout-ms",
            "500",
        ],
    );
    // A slow-loris client: sends half a request head, then nothing.
    let mut slow = TcpStream::connect(server.addr()).unwrap();
    slow.write_all(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/predict",
            b"{\"nodes\": [1, 2".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "/v1/predict",
            b"{\"nodes\": NaN}".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "/v1/predict",
            b"{\"nodes\": \"all\"}".to_vec(),
            400,
            "invalid request body",
        ),
        (
            "/v1/predict",
            b"{\"nodes\": []}".to_vec(),
            400,
            "`nodes` is empty",
        ),
        (
            "/v1/predict",
            b"{\"nodes\": [1499, 1500]}".to_vec(),
            404,
            "node 1500 does not exist",
        ),
        (
            "/v1/predict",
            b"{\"nodes\": [-1]}".to_vec(),
            400,
            "invalid request body",
        ),
        (
            "/v1/predict",
            b"{\"nodes\": [1], \"embeddings\": 9}".to_vec(),
            400,
            "layer 9",
        ),
        (
            "/v1/predict",
            json!({ "nodes": (0..51).collect::<Vec<u32>>() })
                .to_string()
                .into_bytes(),
            413,
            "51 nodes in one request is over the limit of 50",
        ),
        (
            "/v1/predict",
            format!("{{\"nodes\": [{}]}}", vec!["1"; 12000].join(",")).into_bytes(),
            413,
            "over the limit of 20000 bytes",
        ),
        (
            "/v1/nodes",
            json!({ "nodes": [{ "features": [1.0, 2.0], "edges": [1] }] })
                .to_string()
                .into_bytes(),
            400,
            "has 2 features, the model takes 16",
        ),
        (
            "/v1/nodes",
            format!(
                "{{\"nodes\": [{{\"features\": [{}1e300], \"edges\": [1]}}]}}",
                "0.5,".repeat(15)
            )
            .into_bytes(),
            400,
            "nodes[0].features[15] = 1e300 is not a finite 32-bit number",
        ),
        (
            "/v1/nodes",
            json!({ "nodes": [{ "features": vec![0.5; 16], "edges": [4000] }] })
                .to_string()
                .into_bytes(),
            404,
            "node 4000 does not exist",
        ),
        (
            "/v1/edges",
            b"{\"add\": [[1, 99999]]}".to_vec(),
            404,
            "node 99999 does not exist",
        ),
        (
            "/v1/edges",
            b"{\"add\": [[3, 3]]}".to_vec(),
            400,
            "self loop",
        ),
        (
            "/v1/edges",
            b"{\"add\": [[1]]}".to_vec(),
            400,
            "invalid request body",
        ),
        (
            "/v1/edges",
            b"{}".to_vec(),
            400,
            "neither `add` nor `remove`",
        ),
        ("/v2/predict", b"{}".to_vec(), 404, "no such endpoint"),
    ];
    let a = agent();
    for (path, body, status, want) in &cases {
        let r = call(&a, "POST", &format!("{}{path}", server.url), body, None);
        assert_eq!(
            r.status,
            *status,
            "{path} {}: {}",
            String::from_utf8_lossy(&body[..body.len().min(80)]),
            r.text
        );
        assert!(
            r.body["error"].as_str().unwrap_or("").contains(want),
            "{path}: expected `{want}` in {}",
            r.text
        );
        // Everyone else is still served.
        let ok = post(&server, "/v1/predict", &json!({ "nodes": [0, 1] }));
        assert_eq!(ok.status, 200, "{}", ok.text);
    }
    // A body that never finishes: 408 once the client timeout passes, not a hang.
    let t = Instant::now();
    let reply = raw(
        &server.addr(),
        b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"nodes\": [1",
    );
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // The slow-loris connection is closed by the server (its head timed out), and the
    // service kept answering meanwhile.
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = String::new();
    let _ = slow.read_to_string(&mut buf);
    assert!(buf.is_empty() || buf.starts_with("HTTP/1.1 408"), "{buf}");
    let ok = post(&server, "/v1/predict", &json!({ "nodes": [7] }));
    assert_eq!(ok.status, 200);
}

#[test]
fn health_readiness_metrics_and_shedding() {
    let dir = tempfile::tempdir().unwrap();
    let file = train(dir.path(), "m.safetensors", "sage", "0");
    // The HTTP workers pinned to the first CPU this test may use.
    let cpu = first_allowed_cpu(&std::fs::read_to_string("/proc/self/status").unwrap());
    let server = Server::start(&file, &["--quota-rps", "5", "--http-cpus", &cpu]);
    // Two workers (`--http-workers` 2) beside actix's system thread, which is not one.
    let threads = http_thread_cpus(server.child.id(), &cpu, 2);
    assert_eq!(
        threads.iter().filter(|c| *c == &cpu).count(),
        2,
        "HTTP threads on CPUs {threads:?}: not both workers pinned to {cpu}"
    );
    let a = agent();
    assert_eq!(
        call(&a, "GET", &format!("{}/healthz", server.url), b"", None).status,
        200
    );
    let ready = call(&a, "GET", &format!("{}/readyz", server.url), b"", None);
    assert_eq!(ready.status, 200);
    assert_eq!(ready.body["ready"], true);
    // A tenant over its quota gets 429 with Retry-After; another tenant is unaffected.
    let mut limited = 0;
    for _ in 0..20 {
        let r = call(
            &a,
            "POST",
            &format!("{}/v1/predict", server.url),
            b"{\"nodes\":[1]}",
            Some("greedy"),
        );
        if r.status == 429 {
            limited += 1;
            assert!(r.retry_after.is_some(), "429 without Retry-After");
            assert!(r.text.contains("quota"), "{}", r.text);
        } else {
            assert_eq!(r.status, 200, "{}", r.text);
        }
    }
    assert!(
        limited >= 10,
        "only {limited} of 20 over-quota requests were refused"
    );
    let r = call(
        &a,
        "POST",
        &format!("{}/v1/predict", server.url),
        b"{\"nodes\":[1]}",
        Some("polite"),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let m = call(&a, "GET", &format!("{}/metrics", server.url), b"", None).text;
    for want in [
        "trellis_serve_request_seconds_bucket{route=\"/v1/predict\",le=\"0.005\"}",
        "trellis_serve_requests_total{route=\"/v1/predict\",status=\"429\"}",
        "trellis_serve_batch_size_count",
        "trellis_serve_queue_depth 0",
        "trellis_serve_shed_total{reason=\"quota\"}",
        "trellis_serve_model_info{version=",
    ] {
        assert!(m.contains(want), "/metrics lacks {want}:\n{m}");
    }
}

#[test]
fn http_cpus_outside_the_process_are_refused_with_the_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["serve", "--model", s(&dir.path().join("none.safetensors"))])
        .args([
            "--data",
            DATA,
            "--listen",
            "127.0.0.1:0",
            "--http-cpus",
            "1023",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--http-cpus") && err.contains("1023"),
        "the error does not name the flag and the CPU: {err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["serve", "--http-cpus", "2-1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("runs backwards"),
        "{err}"
    );
}

/// What one request of the open-loop load saw.
struct Seen {
    status: u16,
    retry_after: bool,
    /// Updates answered before it was sent, and updates sent before its answer came.
    acked_before: usize,
    sent_by_answer: usize,
    probs: Vec<Vec<f64>>,
    text: String,
}

#[test]
fn panicking_partition_actors_are_recovered_under_open_loop_load_without_wrong_answers() {
    let dir = tempfile::tempdir().unwrap();
    let file = train(dir.path(), "m.safetensors", "gcn", "0");
    // Partition 1 panics in layer 1 of the second update, partition 0 in layer 0 of the
    // third: each is restarted by its supervisor, restored and recomputed.
    let server = Server::start(
        &file,
        &[
            "--partitions",
            "2",
            "--chaos",
            "serve-panic:part=1:update=2:layer=1,serve-panic:part=0:update=3:layer=0",
            "--deadline-ms",
            "2000",
        ],
    );
    let updates = [(0u32, 700u32), (3, 900), (5, 1200), (8, 1400)];
    // The graph after k updates, and the probabilities `trellis predict` gives for the
    // queried nodes in each of those states.
    let queried = [10u32, 11, 12, 700];
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut src: Vec<i64> = ds.edge_src.iter().map(|&v| v as i64).collect();
    let mut dst: Vec<i64> = ds.edge_dst.iter().map(|&v| v as i64).collect();
    let mut states = Vec::new();
    for k in 0..=updates.len() {
        if k > 0 {
            src.push(updates[k - 1].0 as i64);
            dst.push(updates[k - 1].1 as i64);
        }
        let data = serve_support::write_dataset(
            dir.path(),
            &format!("state{k}"),
            &ds.features,
            16,
            &src,
            &dst,
        );
        let logits = predict(&file, s(&data), dir.path());
        let probs: Vec<Vec<f64>> = queried
            .iter()
            .map(|&v| softmax(logits.row(v as usize).as_slice().unwrap()))
            .collect();
        states.push(probs);
    }
    let last_state =
        serve_support::write_dataset(dir.path(), "final", &ds.features, 16, &src, &dst);

    // Open-loop load: requests leave on a fixed clock (400/s) whatever the answers do, half
    // of them through the partition actors (with embeddings), half from the published rows.
    let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<usize>();
    let jobs_rx = std::sync::Arc::new(std::sync::Mutex::new(jobs_rx));
    let (seen_tx, seen_rx) = std::sync::mpsc::channel::<Seen>();
    let workers: Vec<_> = (0..6)
        .map(|_| {
            let (rx, tx) = (jobs_rx.clone(), seen_tx.clone());
            let (acked, sent, url) = (acked.clone(), sent.clone(), server.url.clone());
            std::thread::spawn(move || {
                let agent = agent();
                loop {
                    let Ok(i) = rx.lock().unwrap().recv() else {
                        return;
                    };
                    let body = if i % 2 == 0 {
                        json!({ "nodes": queried, "embeddings": 1 })
                    } else {
                        json!({ "nodes": queried })
                    };
                    let acked_before = acked.load(std::sync::atomic::Ordering::SeqCst);
                    let r = call(
                        &agent,
                        "POST",
                        &format!("{url}/v1/predict"),
                        body.to_string().as_bytes(),
                        None,
                    );
                    let sent_by_answer = sent.load(std::sync::atomic::Ordering::SeqCst);
                    let probs = probabilities(&r.body);
                    let _ = tx.send(Seen {
                        status: r.status,
                        retry_after: r.retry_after.is_some(),
                        acked_before,
                        sent_by_answer,
                        probs,
                        text: r.text,
                    });
                }
            })
        })
        .collect();
    drop(seen_tx);
    let clock = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let at = start + Duration::from_micros(2500 * i as u64);
                if let Some(d) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
                if jobs_tx.send(i).is_err() {
                    return;
                }
                i += 1;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    for (a, b) in updates {
        sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let r = post(&server, "/v1/edges", &json!({ "add": [[a, b]] }));
        assert_eq!(r.status, 200, "update {a}-{b}: {}", r.text);
        acked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(150));
    }
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    clock.join().unwrap();
    for w in workers {
        w.join().unwrap();
    }
    let (mut answered, mut shed, mut failed, mut wrong) = (0, 0, 0, 0);
    for seen in seen_rx.iter() {
        match seen.status {
            200 => {
                answered += 1;
                // The answer must be the state of some moment between its sending and
                // its answer: never a half-recovered table, never a state from the future.
                let fits = (seen.acked_before..=seen.sent_by_answer).any(|k| {
                    states[k].iter().zip(&seen.probs).all(|(want, got)| {
                        want.len() == got.len()
                            && want.iter().zip(got).all(|(a, b)| (a - b).abs() <= 1e-5)
                    })
                });
                if !fits {
                    wrong += 1;
                    eprintln!(
                        "wrong answer (updates {}..={}): {}",
                        seen.acked_before, seen.sent_by_answer, seen.text
                    );
                }
            }
            503 => {
                assert!(seen.retry_after, "503 without Retry-After: {}", seen.text);
                shed += 1;
            }
            _ => {
                failed += 1;
                eprintln!("failed: {} {}", seen.status, seen.text);
            }
        }
    }
    println!(
        "open-loop load through 2 partition panics: answered {answered}, shed {shed}, failed {failed}, wrong {wrong}"
    );
    assert_eq!(failed, 0);
    assert_eq!(wrong, 0);
    assert!(answered > 100, "answered {answered}");
    let ready = call(
        &agent(),
        "GET",
        &format!("{}/readyz", server.url),
        b"",
        None,
    );
    assert_eq!(ready.status, 200);
    assert_eq!(ready.body["faults_fired"], 2, "{}", ready.text);
    assert_eq!(ready.body["recoveries"], 2, "{}", ready.text);
    // Every answer now equals a fresh prediction on the updated graph.
    let (_, probs) = served(&server, &(0..1500).collect::<Vec<u32>>());
    assert_close(
        &probs,
        &predict(&file, s(&last_state), dir.path()),
        "after recoveries",
    );
}

#[test]
fn a_partition_stuck_past_its_step_timeout_is_rebuilt_from_the_store_without_wrong_answers() {
    let dir = tempfile::tempdir().unwrap();
    let file = train(dir.path(), "m.safetensors", "gcn", "0");
    // Partition 1 hangs for 2 s in layer 1 of the first update: no panic, so nothing
    // restores it; the pass times out after 300 ms with layer 0 recomputed and layer 1 not
    // (its tables are behind the graph). The engine starts every partition again from its
    // store and recomputes every row.
    let server = Server::start(
        &file,
        &[
            "--partitions",
            "2",
            "--chaos",
            "serve-stall:part=1:update=1:layer=1:ms=2000",
            "--step-timeout-ms",
            "300",
        ],
    );
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut src: Vec<i64> = ds.edge_src.iter().map(|&v| v as i64).collect();
    let mut dst: Vec<i64> = ds.edge_dst.iter().map(|&v| v as i64).collect();
    let all: Vec<u32> = (0..ds.num_nodes as u32).collect();
    let before = predict(&file, DATA, dir.path());
    // Queries through the actors while the update is stuck and rebuilt: each answer is
    // the graph before or after the update, never a mix.
    let watcher = {
        let url = server.url.clone();
        std::thread::spawn(move || {
            let agent = agent();
            let mut seen = Vec::new();
            let until = Instant::now() + Duration::from_millis(2500);
            while Instant::now() < until {
                let body = json!({ "nodes": [0, 700, 10], "embeddings": 1 });
                let r = call(
                    &agent,
                    "POST",
                    &format!("{url}/v1/predict"),
                    body.to_string().as_bytes(),
                    None,
                );
                seen.push(r);
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let r = post(&server, "/v1/edges", &json!({ "add": [[0, 700]] }));
    assert_eq!(
        r.status, 200,
        "the update is answered once rebuilt: {}",
        r.text
    );
    let n = ds.num_nodes as u64;
    assert_eq!(
        r.body["recomputed_rows"],
        json!([n, n]),
        "a rebuild recomputes every row: {}",
        r.text
    );
    src.push(0);
    dst.push(700);
    let updated = write_dataset(dir.path(), &ds.features, 16, &src, &dst);
    let after = predict(&file, s(&updated), dir.path());
    let (mut answered, mut refused) = (0, 0);
    for seen in watcher.join().unwrap() {
        match seen.status {
            200 => {
                answered += 1;
                let got = probabilities(&seen.body);
                assert_eq!(got.len(), 3, "{}", seen.text);
                let fits = |logits: &ndarray::Array2<f32>| {
                    [0usize, 700, 10].iter().zip(&got).all(|(&v, row)| {
                        let want = softmax(logits.row(v).as_slice().unwrap());
                        want.iter().zip(row).all(|(a, b)| (a - b).abs() <= 1e-5)
                    })
                };
                assert!(
                    fits(&before) || fits(&after),
                    "an answer of neither state: {}",
                    seen.text
                );
            }
            503 => {
                assert!(seen.retry_after.is_some(), "503 without Retry-After");
                refused += 1;
            }
            s => panic!("unexpected {s}: {}", seen.text),
        }
    }
    println!("queries through a stuck partition's rebuild: answered {answered}, 503 {refused}");
    assert!(answered > 0);
    let ready = call(
        &agent(),
        "GET",
        &format!("{}/readyz", server.url),
        b"",
        None,
    );
    assert_eq!(ready.status, 200, "{}", ready.text);
    assert_eq!(ready.body["faults_fired"], 1, "{}", ready.text);
    assert_eq!(ready.body["rebuilds"], 1, "{}", ready.text);
    let (_, probs) = served(&server, &all);
    assert_close(&probs, &after, "after the rebuild");
    // The rebuilt partitions take later updates as before.
    let r = post(&server, "/v1/edges", &json!({ "add": [[3, 900]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    src.push(3);
    dst.push(900);
    let updated = write_dataset(dir.path(), &ds.features, 16, &src, &dst);
    let (_, probs) = served(&server, &all);
    assert_close(
        &probs,
        &predict(&file, s(&updated), dir.path()),
        "an update after the rebuild",
    );
}

/// Without `--step-timeout-ms`, a layer may take ten times the start-up pass (at least
/// 5 s): a partition stuck for 30 s costs its update about 5 s and a rebuild, not the
/// two-minute limit sized for the largest graphs.
#[test]
fn a_stuck_partition_is_given_up_on_after_seconds_without_a_step_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let file = train(dir.path(), "m.safetensors", "gcn", "0");
    let server = Server::start(
        &file,
        &[
            "--partitions",
            "2",
            "--chaos",
            "serve-stall:part=1:update=1:layer=0:ms=30000",
        ],
    );
    let t = Instant::now();
    let r = post(&server, "/v1/edges", &json!({ "add": [[0, 700]] }));
    let took = t.elapsed();
    assert_eq!(r.status, 200, "answered once rebuilt: {}", r.text);
    let n = DataSource::parse(DATA).unwrap().load().unwrap().num_nodes as u64;
    assert_eq!(r.body["recomputed_rows"], json!([n, n]), "{}", r.text);
    println!("an update through a partition stuck for 30 s answered after {took:?}");
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(20),
        "{took:?}"
    );
}

#[test]
fn training_serves_its_last_published_weights_while_it_trains() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("last.safetensors");
    let server = Server::spawn(&[
        "train",
        "--data",
        DATA,
        "--model",
        "gcn",
        "--epochs",
        "3000",
        "--threads",
        "2",
        "--serve",
        "127.0.0.1:0",
        "--publish-every",
        "150",
        "--save-model",
        s(&file),
        "--save-model-at",
        "last",
    ]);
    // Query while it trains: every answer is whole and names one version; versions advance.
    let agent = agent();
    let mut versions: Vec<String> = Vec::new();
    let mut answers = 0;
    let deadline = Instant::now() + Duration::from_secs(240);
    let finished = loop {
        assert!(Instant::now() < deadline, "training did not finish in time");
        let r = call(
            &agent,
            "POST",
            &format!("{}/v1/predict", server.url),
            b"{\"nodes\":[0,7,1499,7]}",
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text);
        let version = r.body["model_version"].as_str().unwrap().to_string();
        assert_eq!(version.len(), 12, "{}", r.text);
        let preds = r.body["predictions"].as_array().unwrap();
        assert_eq!(preds.len(), 4);
        for (p, v) in preds.iter().zip([0, 7, 1499, 7]) {
            assert_eq!(p["node"], v);
            let row: Vec<f64> = p["probabilities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(row.len(), 4);
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-5, "{row:?}");
        }
        assert_eq!(preds[1], preds[3], "one node, one answer within a version");
        answers += 1;
        serve_support::note_version(&mut versions, version);
        // The model is written after the last publish has been served.
        if let Ok(line) = server.lines.try_recv() {
            if line.contains("written to") {
                break line;
            }
        }
    };
    assert!(finished.contains("epoch 3000"), "{finished}");
    println!("{answers} answers while training, versions served: {versions:?}");
    assert!(
        versions.len() >= 3,
        "the version advanced only {} time(s) over 20 publishes: {versions:?}",
        versions.len() - 1
    );
    // Now it serves the last weights: exactly `trellis predict` with the saved model.
    let (version, probs) = served(&server, &(0..1500).collect::<Vec<u32>>());
    assert_eq!(version.len(), 12);
    assert_close(
        &probs,
        &predict(&file, DATA, dir.path()),
        "after training, the last weights",
    );
}

#[test]
fn bench_serve_reports_every_workload() {
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args([
            "bench",
            "serve",
            "--data",
            DATA,
            "--hidden",
            "16",
            "--seconds",
            "1",
            "--beside-seconds",
            "1",
        ])
        .args([
            "--rate-predict",
            "300",
            "--rate-new",
            "50",
            "--rate-light",
            "50",
        ])
        .args(["--connections", "4", "--threads", "2"])
        .args(["--pin-generator", "auto"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("memory bandwidth (STREAM triad)"), "{text}");
    for row in [
        "(a) existing-node predict",
        "(b) new-node inductive",
        "(d) light tenant alone",
        "(d) light beside 10x heavy",
        "(c) (a) beside training",
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(row))
            .unwrap_or_else(|| panic!("no `{row}` in {text}"));
        assert!(
            line.contains("p99.9") && line.contains("failed 0"),
            "{line}"
        );
    }
    assert!(text.contains("CPU: load generator"), "{text}");
    // With two CPUs or more the generator gets the last and the HTTP workers the others.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let placed = if cpus >= 2 {
        "load generator on CPU "
    } else {
        "not pinned"
    };
    assert!(text.contains(placed), "no `{placed}` in {text}");
    // The limit beside (c)'s training share: what (a)'s load took of the machine's cores.
    let limit = text
        .lines()
        .find(|l| l.starts_with("(c) CPU limit"))
        .unwrap_or_else(|| panic!("no (c) CPU limit in {text}"));
    let number_after = |what: &str| -> f64 {
        let rest = &limit[limit.find(what).unwrap_or_else(|| panic!("{limit}")) + what.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        rest[..end].parse().unwrap_or_else(|_| panic!("{limit}"))
    };
    let service = number_after("(service ");
    let share = number_after("leaving training at most ");
    assert!(service > 0.0, "the service used no CPU under load: {limit}");
    assert!((0.0..=100.0).contains(&share), "{limit}");
    assert!(
        text.contains("the served version advanced"),
        "training beside the service published no weights: {text}"
    );
}

/// `--rate-predict 0` skips (a): (b) alone runs; with (c), which is compared with (a), it
/// is refused saying so.
#[test]
fn bench_serve_runs_new_node_queries_alone() {
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_trellis"))
            .args(["bench", "serve", "--data", DATA, "--hidden", "16"])
            .args(["--seconds", "1", "--rate-predict", "0", "--rate-light", "0"])
            .args(["--rate-new", "50", "--connections", "4", "--threads", "1"])
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = bench(&[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{err}");
    assert!(err.contains("--beside-epochs 0"), "{err}");
    let out = bench(&["--beside-epochs", "0"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let new = text
        .lines()
        .find(|l| l.starts_with("(b) new-node inductive"))
        .unwrap_or_else(|| panic!("no (b) in {text}"));
    assert!(new.contains("failed 0"), "{new}");
    assert!(!text.contains("(a) existing-node"), "(a) ran: {text}");
}
