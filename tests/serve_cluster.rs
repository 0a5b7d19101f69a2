//! `trellis serve --cluster` as a user runs it: real `trellis serve` processes on 127.0.0.1
//! with ephemeral ports (QUIC between the nodes, HTTP to the engine node), driven by a real
//! HTTP client. The served outputs equal `trellis predict` before and after node and edge
//! updates, partition panics on the other nodes and a model swap; a worker node killed with SIGKILL under open-loop load costs
//! no wrong answer and no hang, and after recovery every prediction equals `trellis
//! predict` again. Every process a test starts is killed and reaped when it ends (also when
//! it fails), and every wait is bounded.
mod binary;
mod serve_support;

use serde_json::{json, Value};
use serve_support::{agent, first_allowed_cpu, http_thread_cpus, s, trellis, Reply};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use trellis::netns::{EmulatedNet, NetSpec};
use trellis::runtime::{DataSource, Dataset};

const DATA: &str = "synthetic:nodes=900,degree=6,features=12,classes=4,seed=5";

/// The network-partition test runs alone (its timings are about the network, not about
/// the tests beside it on 2 vCPUs); every other test shares the machine.
static MACHINE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn sharing_the_machine() -> std::sync::RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(|p| p.into_inner())
}
const WIDTH: usize = 12;

/// A started process, killed and reaped on drop.
struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn start(name: &str, args: &[&str]) -> Proc {
        Self::start_prepared(name, args, |_| {})
    }

    /// [`Proc::start`], with the command prepared by `prepare` first.
    fn start_prepared(name: &str, args: &[&str], prepare: impl FnOnce(&mut Command)) -> Proc {
        let started = serve_support::start_prepared(args, prepare);
        Proc {
            name: name.into(),
            child: started.child,
            lines: started.lines,
        }
    }

    /// Waits (at most a minute) for the `listening on http://...` line; its address.
    fn listening(&self) -> String {
        let t = Instant::now();
        loop {
            let left = Duration::from_secs(90).saturating_sub(t.elapsed());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("{} printed no `listening on` line", self.name));
            if let Some(u) = line.strip_prefix("listening on ") {
                assert!(!u.ends_with(":0"), "port 0 was resolved: {u}");
                return u.to_string();
            }
        }
    }

    /// Waits (until 60 s after `since`) for a line of its output containing `needle`.
    fn line_with(&self, needle: &str, since: Instant) -> String {
        loop {
            let left = Duration::from_secs(60).saturating_sub(since.elapsed());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|_| {
                panic!("{} said nothing with {needle:?} within 60 s", self.name)
            });
            if line.contains(needle) {
                return line;
            }
        }
    }
}

/// Waits (until 60 s after `since`) for `url`'s `/readyz` to answer 200 with `placement`.
fn wait_ready(url: &str, placement: &Value, since: Instant) {
    let within = Duration::from_secs(60).saturating_sub(since.elapsed());
    until_readyz(url, within, "readiness after the loss", |r| {
        (r.status == 200).then(|| assert_eq!(&r.body["placement"], placement, "{}", r.text))
    })
}

/// Polls `url`'s `/readyz` every 50 ms until `done` makes something of an answer; fails
/// the test when nothing came of them within `within` (waiting for `what`).
fn until_readyz<T>(
    url: &str,
    within: Duration,
    what: &str,
    done: impl Fn(&Reply) -> Option<T>,
) -> T {
    let t = Instant::now();
    loop {
        let r = call(&agent(), "GET", &format!("{url}/readyz"), b"");
        if let Some(v) = done(&r) {
            return v;
        }
        assert!(
            t.elapsed() < within,
            "{url}: no {what} within {within:?}: {} {}",
            r.status,
            r.text
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process killed and reaped on drop.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn train(dir: &Path, name: &str, seed: &str) -> PathBuf {
    let file = dir.join(name);
    let args = ["train", "--data", DATA, "--model", "gcn", "--epochs", "10"];
    let mut args = args.to_vec();
    args.extend(["--seed", seed, "--save-model", s(&file)]);
    trellis(&args);
    file
}

/// `trellis predict` on `data`: the logits.
fn predict(model: &Path, data: &str, dir: &Path) -> ndarray::Array2<f32> {
    let out = dir.join("logits.npy");
    let args = [
        "predict",
        "--model",
        s(model),
        "--data",
        data,
        "--out",
        s(&out),
    ];
    trellis(&args);
    ndarray_npy::read_npy(&out).unwrap()
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = row.iter().map(|&x| ((x - m) as f64).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

fn call(agent: &ureq::Agent, method: &str, url: &str, body: &[u8]) -> Reply {
    serve_support::request(agent, method, url, body, &[])
}

fn post(url: &str, path: &str, body: &Value) -> Reply {
    call(
        &agent(),
        "POST",
        &format!("{url}{path}"),
        body.to_string().as_bytes(),
    )
}

/// The probabilities of each prediction of a `/v1/predict` answer.
fn probabilities(body: &Value) -> Vec<Vec<f64>> {
    body["predictions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["probabilities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

/// The probabilities `url` serves for `nodes`: from the published rows, or (with
/// `through_partitions`) looked up on the owning partitions with layer 0's embeddings.
fn served(url: &str, nodes: &[u32], through_partitions: bool) -> (String, Vec<Vec<f64>>) {
    let mut probs = Vec::new();
    let mut version = String::new();
    for chunk in nodes.chunks(500) {
        let body = if through_partitions {
            json!({ "nodes": chunk, "embeddings": 0 })
        } else {
            json!({ "nodes": chunk })
        };
        let r = post(url, "/v1/predict", &body);
        assert_eq!(r.status, 200, "{}", r.text);
        version = r.body["model_version"].as_str().unwrap().to_string();
        for (p, &v) in r.body["predictions"].as_array().unwrap().iter().zip(chunk) {
            assert_eq!(p["node"], v);
            if through_partitions {
                assert!(p["embedding"].as_array().is_some_and(|e| !e.is_empty()));
            }
        }
        probs.extend(probabilities(&r.body));
    }
    (version, probs)
}

/// The largest difference between served probabilities and those of `logits` (rows `nodes`).
fn worst(served: &[Vec<f64>], logits: &ndarray::Array2<f32>, nodes: &[u32]) -> f64 {
    let mut worst = 0f64;
    for (row, &v) in served.iter().zip(nodes) {
        let want = softmax(logits.row(v as usize).as_slice().unwrap());
        for (a, b) in row.iter().zip(&want) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}

fn assert_matches(url: &str, logits: &ndarray::Array2<f32>, what: &str) {
    let all: Vec<u32> = (0..logits.nrows() as u32).collect();
    for through in [false, true] {
        let (_, probs) = served(url, &all, through);
        assert_eq!(probs.len(), all.len());
        let w = worst(&probs, logits, &all);
        assert!(
            w <= 1e-5,
            "{what} ({url}, through the partitions: {through}): served and predicted differ by {w}"
        );
    }
}

/// Writes a graph as a PyG-style folder `dir/name`.
fn write_dataset(dir: &Path, name: &str, features: &[f32], edges: &[(u32, u32)]) -> PathBuf {
    let src: Vec<i64> = edges.iter().map(|&(a, _)| a as i64).collect();
    let dst: Vec<i64> = edges.iter().map(|&(_, b)| b as i64).collect();
    serve_support::write_dataset(dir, name, features, WIDTH, &src, &dst)
}

/// Certificates for nodes `0..n` in a fresh folder.
fn cluster_dir(n: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    trellis::transport::certs::init(&certs).unwrap();
    for i in 0..n {
        trellis::transport::certs::issue(&certs, i).unwrap();
    }
    dir
}

/// A cluster file of nodes `0..n` whose engine node listens at `engine`.
fn write_cluster(dir: &Path, name: &str, engine: &str, n: u32) -> PathBuf {
    write_cluster_set(dir, name, engine, n, "")
}

/// [`write_cluster`], with more `settings` (TOML lines).
fn write_cluster_set(dir: &Path, name: &str, engine: &str, n: u32, settings: &str) -> PathBuf {
    let mut addrs = vec![engine];
    addrs.extend((1..n).map(|_| "127.0.0.1:0"));
    write_cluster_at(dir, name, &addrs, settings)
}

/// The cluster file `dir/name` of nodes `0..addrs.len()`, node `i` at `addrs[i]`; `settings`
/// (TOML lines) replace the defaults of the keys they set.
fn write_cluster_at(dir: &Path, name: &str, addrs: &[&str], settings: &str) -> PathBuf {
    let defaults = [
        "certs = \"certs\"",
        "partitions = \"parts\"",
        "heartbeat_ms = 200",
        "idle_timeout_ms = 1500",
        "join_timeout_ms = 30000",
    ];
    let set = |line: &str| {
        let key = line.split('=').next().unwrap_or("").trim();
        settings
            .lines()
            .any(|l| l.split('=').next().unwrap_or("").trim() == key)
    };
    let mut t = String::new();
    for line in defaults.iter().filter(|l| !set(l)) {
        t += line;
        t += "\n";
    }
    t += settings;
    for (i, addr) in addrs.iter().enumerate() {
        t += &format!("[[node]]\nid = {i}\naddr = \"{addr}\"\n");
    }
    let path = dir.join(name);
    std::fs::write(&path, t).unwrap();
    path
}

/// The engine node and the other nodes of an `n`-node serving cluster; the engine node's
/// HTTP address.
struct Cluster {
    /// The engine node (killed and reaped with the cluster).
    engine: Proc,
    nodes: Vec<Proc>,
    url: String,
    /// The HTTP addresses of the other nodes (which forward to the engine node).
    node_urls: Vec<String>,
}

fn start_cluster(dir: &Path, n: u32, model: &Path, extra: &[&str]) -> Cluster {
    start_cluster_with(dir, n, model, extra, &[])
}

/// [`start_cluster`], with `node_extra` given to every node but the engine node.
fn start_cluster_with(
    dir: &Path,
    n: u32,
    model: &Path,
    extra: &[&str],
    node_extra: &[&str],
) -> Cluster {
    start_cluster_on(dir, n, model, DATA, extra, node_extra, "")
}

/// [`start_cluster_with`], serving `data`, with more cluster file `settings`.
fn start_cluster_on(
    dir: &Path,
    n: u32,
    model: &Path,
    data: &str,
    extra: &[&str],
    node_extra: &[&str],
    settings: &str,
) -> Cluster {
    let c0 = write_cluster_set(dir, "c0.toml", "127.0.0.1:0", n, settings);
    let addr_file = dir.join("node0.addr");
    let mut args = vec!["serve", "--cluster", s(&c0), "--model", s(model)];
    args.extend(["--data", data, "--listen", "127.0.0.1:0", "--threads", "1"]);
    args.extend(["--addr-file", s(&addr_file)]);
    args.extend(extra);
    let engine = Proc::start("engine node", &args);
    let t = Instant::now();
    let quic = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the engine node never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let c1 = write_cluster_set(dir, "c1.toml", &quic, n, settings);
    let nodes = (1..n)
        .map(|i| {
            let id = i.to_string();
            let mut args = vec!["serve", "--cluster", s(&c1), "--id", &id, "--threads", "1"];
            args.extend(["--listen", "127.0.0.1:0"]);
            args.extend(node_extra);
            Proc::start(&format!("node {i}"), &args)
        })
        .collect::<Vec<_>>();
    let url = engine.listening();
    let node_urls = nodes.iter().map(Proc::listening).collect();
    Cluster {
        engine,
        nodes,
        url,
        node_urls,
    }
}

fn undirected_edges(ds: &Dataset) -> std::collections::BTreeSet<(u32, u32)> {
    ds.edge_src
        .iter()
        .zip(&ds.edge_dst)
        .filter(|(a, b)| a != b)
        .map(|(&a, &b)| (a.min(b), a.max(b)))
        .collect()
}

/// The served graph as a test changes it through the API: `DATA`'s features and its
/// undirected edges.
struct EditedGraph {
    ds: Dataset,
    edges: std::collections::BTreeSet<(u32, u32)>,
}

impl EditedGraph {
    fn new() -> Self {
        let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
        let edges = undirected_edges(&ds);
        EditedGraph { ds, edges }
    }

    /// What `trellis predict` computes with `model` on the graph now (written as
    /// `dir/name`).
    fn logits(&self, model: &Path, dir: &Path, name: &str) -> ndarray::Array2<f32> {
        let list: Vec<(u32, u32)> = self.edges.iter().copied().collect();
        let data = write_dataset(dir, name, &self.ds.features, &list);
        predict(model, s(&data), dir)
    }
}

#[test]
fn a_three_node_cluster_serves_what_trellis_predict_computes_through_updates_and_a_swap() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m1.safetensors", "0");
    let newer = train(dir.path(), "m2.safetensors", "7");
    // Partition p is on node p: the second update panics partition 2 (node 2) as it starts
    // layer 0, the third partition 1 (node 1) at layer 1. Those nodes fire them (the plan
    // travels in their setup) and restore the partitions; the engine node recovers the pass.
    let chaos = "serve-panic:part=2:update=2,serve-panic:part=1:update=3:layer=1";
    // The other nodes' forwarding front ends pinned to the first CPU this test may use.
    let cpu = first_allowed_cpu(&std::fs::read_to_string("/proc/self/status").unwrap());
    let c = start_cluster_with(
        dir.path(),
        3,
        &model,
        &["--partitions", "3", "--chaos", chaos],
        &["--http-cpus", &cpu, "--http-workers", "2"],
    );
    for node in &c.nodes {
        let threads = http_thread_cpus(node.child.id(), &cpu, 2);
        assert_eq!(
            threads.iter().filter(|c| *c == &cpu).count(),
            2,
            "{}: HTTP threads on CPUs {threads:?}: not both forwarding workers pinned to {cpu}",
            node.name
        );
    }
    let ready = call(&agent(), "GET", &format!("{}/readyz", c.url), b"");
    assert_eq!(ready.status, 200, "{}", ready.text);
    assert_eq!(ready.body["recoveries"], 0, "{}", ready.text);
    let logits = predict(&model, DATA, dir.path());
    // Any node takes queries: the engine node and the two others, which forward them.
    for url in std::iter::once(&c.url).chain(&c.node_urls) {
        assert_matches(url, &logits, "at start");
        let ready = call(&agent(), "GET", &format!("{url}/readyz"), b"");
        assert_eq!(ready.status, 200, "{url}: {}", ready.text);
    }
    // Errors come back as the engine node gives them.
    let r = post(
        &c.node_urls[0],
        "/v1/predict",
        &json!({ "nodes": [100000] }),
    );
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.text.contains("100000"), "{}", r.text);

    // Updates that cross the partitions of the three nodes.
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut edges = undirected_edges(&ds);
    let mut features = ds.features.clone();
    let mut n = ds.num_nodes as u32;
    let new_feats: Vec<f64> = (0..WIDTH).map(|i| (i % 5) as f64 / 4.0).collect();
    let r = post(
        &c.url,
        "/v1/nodes",
        &json!({ "nodes": [{ "features": new_feats, "edges": [3, 450, 899] }] }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["predictions"][0]["node"], n);
    features.extend(new_feats.iter().map(|&x| x as f32));
    for t in [3, 450, 899] {
        edges.insert((t, n));
    }
    n += 1;
    let r = post(
        &c.node_urls[0],
        "/v1/edges",
        &json!({ "add": [[1, 600], [2, 890]] }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    edges.extend([(1, 600), (2, 890)]);
    let &(a, b) = edges.iter().nth(40).unwrap();
    let r = post(&c.node_urls[1], "/v1/edges", &json!({ "remove": [[a, b]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["edges_removed"], 1, "{}", r.text);
    edges.remove(&(a, b));
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let updated = write_dataset(dir.path(), "updated", &features, &edge_list);
    assert_eq!(features.len() / WIDTH, n as usize);
    let logits = predict(&model, s(&updated), dir.path());
    for url in std::iter::once(&c.url).chain(&c.node_urls) {
        assert_matches(url, &logits, "after updates");
    }
    // Both faults fired on the other nodes, each one recovery of the engine node's.
    let ready = call(&agent(), "GET", &format!("{}/readyz", c.url), b"");
    assert_eq!(ready.status, 200, "{}", ready.text);
    assert_eq!(ready.body["recoveries"], 2, "{}", ready.text);

    // A model swap: every node's tables move to the new version together.
    let bytes = std::fs::read(&newer).unwrap();
    let r = call(
        &agent(),
        "PUT",
        &format!("{}/v1/model", c.node_urls[1]),
        &bytes,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let version = r.body["model_version"].as_str().unwrap().to_string();
    let (v, _) = served(&c.url, &[0, 1, 2], true);
    assert_eq!(v, version);
    let logits = predict(&newer, s(&updated), dir.path());
    for url in std::iter::once(&c.url).chain(&c.node_urls) {
        assert_matches(url, &logits, "after the swap");
    }
    drop(c);
}

/// One answer under load.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    Right,
    Shed,
    Wrong,
    Failed,
}

/// Open-loop load on a serving cluster: a request for `queried` (with layer 0's embeddings,
/// so the owning partitions answer) leaves every 10 ms whatever the answers do, in turn to
/// each of `urls`. An answer is right when it equals one of `expected` (the probabilities of
/// `queried` in one state of the graph) to 1e-5.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    clock: std::thread::JoinHandle<()>,
    workers: Vec<std::thread::JoinHandle<()>>,
    seen: mpsc::Receiver<(Outcome, Duration)>,
}

impl Load {
    fn start(urls: Vec<String>, queried: &[u32], expected: Arc<Vec<Vec<Vec<f64>>>>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let (tx, seen) = mpsc::channel::<(Outcome, Duration)>();
        let (jobs_tx, jobs_rx) = mpsc::channel::<()>();
        let jobs_rx = Arc::new(std::sync::Mutex::new(jobs_rx));
        let workers = (0..6)
            .map(|i| {
                let url = urls[i % urls.len()].clone();
                let (jobs, tx) = (jobs_rx.clone(), tx.clone());
                let (queried, expected) = (queried.to_vec(), expected.clone());
                std::thread::spawn(move || {
                    let agent = agent();
                    while jobs.lock().unwrap().recv().is_ok() {
                        let t = Instant::now();
                        let body = json!({ "nodes": queried, "embeddings": 0 }).to_string();
                        let r = call(
                            &agent,
                            "POST",
                            &format!("{url}/v1/predict"),
                            body.as_bytes(),
                        );
                        let outcome = match r.status {
                            200 => {
                                let got = probabilities(&r.body);
                                let close = expected.iter().any(|state| {
                                    got.len() == state.len()
                                        && got.iter().zip(state).all(|(a, b)| {
                                            a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5)
                                        })
                                });
                                if close {
                                    Outcome::Right
                                } else {
                                    Outcome::Wrong
                                }
                            }
                            503 if r.retry_after.is_some() => Outcome::Shed,
                            _ => {
                                eprintln!("failed request to {url}: {} {}", r.status, r.text);
                                Outcome::Failed
                            }
                        };
                        let _ = tx.send((outcome, t.elapsed()));
                    }
                })
            })
            .collect();
        let clock = {
            let (stop, sent) = (stop.clone(), sent.clone());
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let mut k = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let _ = jobs_tx.send(());
                    sent.fetch_add(1, Ordering::SeqCst);
                    k += 1;
                    let next = t0 + Duration::from_millis(10) * k;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
            })
        };
        Load {
            stop,
            sent,
            clock,
            workers,
            seen,
        }
    }

    /// Stops the load and checks it: every request answered, none wrong or failed (a 503
    /// with `Retry-After` is shed, not failed), none slower than 10 s, some right.
    fn stop_and_check(self, what: &str, recovered: Duration) {
        self.stop.store(true, Ordering::SeqCst);
        self.clock.join().unwrap();
        for w in self.workers {
            w.join().unwrap();
        }
        let seen: Vec<(Outcome, Duration)> = self.seen.try_iter().collect();
        let count = |o: Outcome| seen.iter().filter(|(x, _)| *x == o).count();
        let slowest = seen.iter().map(|(_, d)| *d).max().unwrap_or_default();
        let sent = self.sent.load(Ordering::SeqCst);
        eprintln!(
            "{what}: sent {sent}, answered {}, shed (503) {}, wrong {}, failed {}, slowest {slowest:?}, ready again {recovered:?} after the kill",
            count(Outcome::Right),
            count(Outcome::Shed),
            count(Outcome::Wrong),
            count(Outcome::Failed),
        );
        assert_eq!(seen.len(), sent, "every request answered");
        assert_eq!(count(Outcome::Wrong), 0, "no wrong answer");
        assert_eq!(count(Outcome::Failed), 0, "no failed request");
        assert!(
            slowest < Duration::from_secs(10),
            "no hang: slowest {slowest:?}"
        );
        assert!(count(Outcome::Right) > 0);
    }
}

#[test]
fn a_node_killed_under_load_costs_no_wrong_answer_and_its_partitions_are_recovered() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    let mut c = start_cluster(
        dir.path(),
        3,
        &model,
        &["--partitions", "3", "--deadline-ms", "1500"],
    );
    let before = predict(&model, DATA, dir.path());
    // The graph after the update made while the node is dead.
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut edges = undirected_edges(&ds);
    edges.insert((7, 880));
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let during_data = write_dataset(dir.path(), "during", &ds.features, &edge_list);
    let during = predict(&model, s(&during_data), dir.path());
    // Queried nodes of every partition (contiguous placement: a third of the ids each), 7
    // and 880 among them: an answer is right when it is that of the graph before the
    // update or after it, for every node.
    let queried: Vec<u32> = vec![5, 7, 320, 640, 880, 899];
    let expected: Arc<Vec<Vec<Vec<f64>>>> = Arc::new(
        [&before, &during]
            .iter()
            .map(|logits| {
                queried
                    .iter()
                    .map(|&v| softmax(logits.row(v as usize).as_slice().unwrap()))
                    .collect()
            })
            .collect(),
    );

    // Open-loop load: a request leaves every 10 ms whatever the answers do, through the
    // partitions (embeddings) so the lost node's partition is needed; half of them to the
    // engine node, half to node 1 (which forwards them).
    let load = Load::start(
        vec![c.url.clone(), c.node_urls[0].clone()],
        &queried,
        expected,
    );
    std::thread::sleep(Duration::from_millis(800));
    // SIGKILL node 2 (it serves partition 2).
    let mut killed = c.nodes.remove(1);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    let killed_at = Instant::now();
    // An update while the node is dead: applied, and computed once its partition is
    // re-placed (never on a partition that missed it).
    let r = post(&c.url, "/v1/edges", &json!({ "add": [[7, 880]] }));
    assert_eq!(r.status, 200, "update during the loss: {}", r.text);
    // Ready again: the engine re-placed partition 2 on node 1 (the survivor serving
    // fewest partitions, a node other than the engine node at equal counts) and recomputed it.
    let recovered = loop {
        let r = call(&agent(), "GET", &format!("{}/readyz", c.url), b"");
        if r.status == 200 && r.body["recoveries"].as_u64().unwrap_or(0) >= 1 {
            assert_eq!(r.body["placement"], json!([0, 1, 1]), "{}", r.text);
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "not ready again 30 s after the kill: {}",
            r.text
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(800));
    load.stop_and_check("node loss under load", recovered);

    // After recovery: every prediction (with the update made during the loss), and one
    // more update across the re-placed partition.
    assert_matches(&c.url, &during, "after the recovery");
    assert_matches(
        &c.node_urls[0],
        &during,
        "after the recovery, through node 1",
    );
    let r = post(&c.url, "/v1/edges", &json!({ "add": [[300, 700]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    edges.insert((300, 700));
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let updated = write_dataset(dir.path(), "updated", &ds.features, &edge_list);
    let logits = predict(&model, s(&updated), dir.path());
    assert_matches(&c.url, &logits, "after an update on the recovered cluster");
    assert_matches(&c.node_urls[0], &logits, "after an update, through node 1");

    // Then the engine node is lost too: node 1, the last one of three, is no majority
    // (`takeover = "majority"`, the default): it does not take over, and answers 503 with
    // `Retry-After`, never from its own copy.
    kill_and_see_no_take_over(&mut c.engine, &c.node_urls[0], Duration::from_secs(5));
    drop(c);
}

/// Kills the engine node `engine` (SIGKILL) and checks that node 1, whose front end is
/// `url` and which is no majority, does not take over: from 2.5 s after the kill (the loss
/// found after the 1.5 s idle timeout, the succession given up) until `checked` after it,
/// every prediction through it gets 503 with `Retry-After`. Returns when it was killed.
fn kill_and_see_no_take_over(engine: &mut Proc, url: &str, checked: Duration) -> Instant {
    engine.child.kill().unwrap();
    engine.child.wait().unwrap();
    let killed = Instant::now();
    std::thread::sleep(Duration::from_millis(2500));
    while killed.elapsed() < checked {
        let r = post(url, "/v1/predict", &json!({ "nodes": [5, 300] }));
        assert_eq!(r.status, 503, "node 1 alone answered: {}", r.text);
        assert!(r.retry_after.is_some(), "{}", r.text);
        std::thread::sleep(Duration::from_millis(200));
    }
    killed
}

/// A two-node cluster has no take-over under the default `takeover = "majority"`: with its
/// engine node killed, node 1 does not serve alone (503 with `Retry-After`) and keeps
/// looking for an engine node; the engine node started again (same address, a fresh
/// service from its files) takes it at once, and both serve what `trellis predict`
/// computes.
#[test]
fn a_two_node_cluster_waits_for_its_engine_node_and_is_served_again_when_it_restarts() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(2);
    let model = train(dir.path(), "m.safetensors", "0");
    let mut c = start_cluster(dir.path(), 2, &model, &["--partitions", "2"]);
    wait_placement(&c.url, &json!([0, 1]));
    let quic = bound(&dir.path().join("node0.addr"));
    let killed = kill_and_see_no_take_over(&mut c.engine, &c.node_urls[0], Duration::from_secs(4));
    let file = write_cluster(dir.path(), "again.toml", &quic, 2);
    let mut args = vec!["serve", "--cluster", s(&file), "--model", s(&model)];
    args.extend([
        "--data",
        DATA,
        "--partitions",
        "2",
        "--listen",
        "127.0.0.1:0",
    ]);
    args.extend(["--threads", "1"]);
    let again = Proc::start("engine node again", &args);
    let url = again.listening();
    eprintln!(
        "the engine node served again {:?} after the kill",
        killed.elapsed()
    );
    wait_placement(&url, &json!([0, 1]));
    let logits = EditedGraph::new().logits(&model, dir.path(), "original");
    assert_matches(&url, &logits, "the engine node started again");
    assert_matches(
        &c.node_urls[0],
        &logits,
        "node 1 with the engine node started again",
    );
    drop((again, c));
}

/// Sends `signal` to process `pid`.
fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a child this test started and has not reaped; it touches no memory.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

/// A node frozen (SIGSTOP) past the idle timeout is declared lost and its partition
/// re-placed; resumed (SIGCONT), it finds its engine node lost, is told by the successor it
/// chose (node 1, which still serves the engine node and fenced it) that it is not one,
/// looks for the engine node, and is taken back by itself, with an update made while it
/// was frozen.
#[test]
fn a_frozen_node_resumed_is_taken_back_by_itself() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    let c = start_cluster(dir.path(), 3, &model, &["--partitions", "3"]);
    wait_placement(&c.url, &json!([0, 1, 2]));
    let pid = c.nodes[1].child.id();
    signal(pid, libc::SIGSTOP);
    let frozen = Instant::now();
    wait_placement(&c.url, &json!([0, 1, 1]));
    eprintln!("node 2 re-placed {:?} after it froze", frozen.elapsed());
    let r = post(&c.url, "/v1/edges", &json!({ "add": [[7, 880]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    let mut graph = EditedGraph::new();
    graph.edges.insert((7, 880));
    let logits = graph.logits(&model, dir.path(), "updated");
    signal(pid, libc::SIGCONT);
    let resumed = Instant::now();
    let took = wait_placement(&c.url, &json!([0, 1, 2]));
    eprintln!("node 2 taken back {took:?} after it resumed");
    assert_eq!(readyz(&c.url)["lost_nodes"], json!([]));
    assert!(resumed.elapsed() < Duration::from_secs(20));
    assert_matches(&c.url, &logits, "the engine node after node 2 came back");
    assert_matches(&c.node_urls[1], &logits, "node 2 after it came back");
    drop(c);
}

/// The `trellis_serve_cluster_nodes_lost` gauge of `url`'s `/metrics`.
fn lost_gauge(url: &str) -> u64 {
    let r = call(&agent(), "GET", &format!("{url}/metrics"), b"");
    assert_eq!(r.status, 200, "{}", r.text);
    let line = r
        .text
        .lines()
        .find(|l| l.starts_with("trellis_serve_cluster_nodes_lost "))
        .unwrap_or_else(|| panic!("no lost-nodes gauge in {}", r.text));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `url`'s `/readyz` answer (200 expected).
fn readyz(url: &str) -> Value {
    let r = call(&agent(), "GET", &format!("{url}/readyz"), b"");
    assert_eq!(r.status, 200, "{}", r.text);
    r.body
}

/// Waits (at most 60 s) until `url`'s `/readyz` answers 200 with `placement`; how long it
/// took.
fn wait_placement(url: &str, placement: &Value) -> Duration {
    let t = Instant::now();
    let what = format!("readiness with placement {placement}");
    until_readyz(url, Duration::from_secs(60), &what, |r| {
        (r.status == 200 && &r.body["placement"] == placement).then_some(())
    });
    t.elapsed()
}

/// A node killed (SIGKILL) and started again with its id is taken back: the engine node
/// sets it up with the current model and inputs (an update made while it was away among
/// them), moves its partition back from the node that adopted it and recomputes it there,
/// and every node, the restarted one too, serves what `trellis predict` computes, also
/// after a later update.
#[test]
fn a_restarted_node_is_taken_back_with_its_partitions() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    let mut c = start_cluster(dir.path(), 3, &model, &["--partitions", "3"]);
    wait_placement(&c.url, &json!([0, 1, 2]));
    let mut killed = c.nodes.remove(1);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    let lost = wait_placement(&c.url, &json!([0, 1, 1]));
    assert_eq!(readyz(&c.url)["lost_nodes"], json!([2]));
    assert_eq!(lost_gauge(&c.url), 1);
    // An update while node 2 is away.
    let r = post(&c.url, "/v1/edges", &json!({ "add": [[7, 880]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut edges = undirected_edges(&ds);
    edges.insert((7, 880));

    // Node 2 again: a new process, the same id, a new port.
    let c1 = dir.path().join("c1.toml");
    let args = ["serve", "--cluster", s(&c1), "--id", "2", "--threads", "1"];
    let restarted = Proc::start(
        "node 2 again",
        &[&args[..], &["--listen", "127.0.0.1:0"]].concat(),
    );
    let restarted_at = Instant::now();
    let url2 = restarted.listening();
    let back = wait_placement(&c.url, &json!([0, 1, 2]));
    assert_eq!(readyz(&c.url)["lost_nodes"], json!([]));
    assert_eq!(lost_gauge(&c.url), 0);
    println!(
        "node 2 lost after {lost:?}, taken back {:?} after its restart",
        restarted_at.elapsed().max(back)
    );
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let during = write_dataset(dir.path(), "during", &ds.features, &edge_list);
    let logits = predict(&model, s(&during), dir.path());
    for (url, what) in [
        (&c.url, "engine node"),
        (&c.node_urls[0], "node 1"),
        (&url2, "node 2"),
    ] {
        assert_matches(
            url,
            &logits,
            &format!("after node 2 came back, through the {what}"),
        );
    }
    // An update across the moved partition, computed on the node that came back.
    let r = post(
        &url2,
        "/v1/edges",
        &json!({ "add": [[300, 700], [650, 880]] }),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    edges.extend([(300, 700), (650, 880)]);
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let updated = write_dataset(dir.path(), "updated", &ds.features, &edge_list);
    let logits = predict(&model, s(&updated), dir.path());
    assert_matches(&c.url, &logits, "after an update, through the engine node");
    assert_matches(&url2, &logits, "after an update, through node 2");
    drop(restarted);
    drop(c);
}

/// Free UDP ports on 127.0.0.1, for a cluster file whose nodes listen at fixed addresses
/// (bound, read and released: another process could take one meanwhile, unlikely here).
fn free_udp_ports(n: usize) -> Vec<u16> {
    let sockets: Vec<std::net::UdpSocket> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    sockets
        .iter()
        .map(|u| u.local_addr().unwrap().port())
        .collect()
}

/// A 3-node serving cluster whose nodes listen at fixed QUIC addresses, as a service
/// manager runs them: the engine node (serving 3 partitions) and nodes 1 and 2.
struct FixedCluster {
    dir: tempfile::TempDir,
    model: PathBuf,
    file: PathBuf,
    engine: Proc,
    /// Nodes 1 and 2.
    nodes: Vec<Proc>,
    /// The nodes' fixed addresses, as in `file`.
    addrs: Vec<String>,
}

/// A [`FixedCluster`]'s idle timeout: long, so that a restart taken back before it was not
/// found by it.
const FIXED_IDLE: Duration = Duration::from_secs(8);

impl FixedCluster {
    fn start() -> Self {
        let dir = cluster_dir(3);
        let model = train(dir.path(), "m.safetensors", "0");
        let addrs: Vec<String> = free_udp_ports(3)
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
        let idle = format!("idle_timeout_ms = {}\n", FIXED_IDLE.as_millis());
        let file = write_cluster_at(dir.path(), "c.toml", &refs, &idle);
        let mut args = vec!["serve", "--cluster", s(&file), "--model", s(&model)];
        args.extend(["--data", DATA, "--listen", "127.0.0.1:0", "--threads", "1"]);
        args.extend(["--partitions", "3"]);
        let engine = Proc::start("engine node", &args);
        let mut c = FixedCluster {
            dir,
            model,
            file,
            engine,
            nodes: Vec::new(),
            addrs: addrs.clone(),
        };
        c.nodes = (1..3).map(|id| c.start_node(id, &[])).collect();
        c
    }

    /// Node `id` of the cluster file, started with `extra` arguments.
    fn start_node(&self, id: u32, extra: &[&str]) -> Proc {
        self.start_node_from(&self.file, id, extra)
    }

    /// Node `id` started with the cluster file `file`.
    fn start_node_from(&self, file: &Path, id: u32, extra: &[&str]) -> Proc {
        let id_arg = id.to_string();
        let mut args = vec!["serve", "--cluster", s(file), "--id", &id_arg];
        args.extend(["--threads", "1", "--listen", "127.0.0.1:0"]);
        args.extend(extra);
        Proc::start(&format!("node {id}"), &args)
    }
}

/// A node killed (SIGKILL) and started again at once at its fixed address, as a service
/// manager restarts it: the new process's hello (another incarnation from the old one's
/// address) tells the engine node's transport that the old process is gone, long before
/// the idle timeout would; its `Join` (again each second) takes the node back, and every
/// node serves what `trellis predict` computes.
#[test]
fn a_node_restarted_at_once_at_its_fixed_address_is_taken_back() {
    restarted_at_once_is_taken_back(true);
}

/// The same with node 2 started again at once at another port (its cluster file says port
/// 0): the old process's connection acknowledges no probe, so the engine node's transport
/// takes the new process for a restart at once (a live process would keep the node).
#[test]
fn a_node_restarted_at_once_at_another_port_is_taken_back() {
    restarted_at_once_is_taken_back(false);
}

fn restarted_at_once_is_taken_back(same_addr: bool) {
    let _shared = sharing_the_machine();
    let mut c = FixedCluster::start();
    let url = c.engine.listening();
    wait_placement(&url, &json!([0, 1, 2]));
    let mut node2 = c.nodes.remove(1);
    node2.child.kill().unwrap();
    node2.child.wait().unwrap();
    let file = if same_addr {
        c.file.clone()
    } else {
        let addrs = [c.addrs[0].as_str(), c.addrs[1].as_str(), "127.0.0.1:0"];
        let idle = format!("idle_timeout_ms = {}\n", FIXED_IDLE.as_millis());
        write_cluster_at(c.dir.path(), "c-any-port.toml", &addrs, &idle)
    };
    let restarted = c.start_node_from(&file, 2, &[]);
    let t = Instant::now();
    until_readyz(&url, Duration::from_secs(60), "node 2 taken back", |r| {
        (r.status == 200
            && r.body["placement"] == json!([0, 1, 2])
            && r.body["recoveries"].as_u64() >= Some(2))
        .then_some(())
    });
    println!(
        "node 2 restarted at {}, taken back after {:?}",
        if same_addr {
            "its address"
        } else {
            "another port"
        },
        t.elapsed()
    );
    assert!(
        t.elapsed() < FIXED_IDLE,
        "taken back {:?} after the restart: the idle timeout ({FIXED_IDLE:?}) was waited for",
        t.elapsed()
    );
    assert_eq!(readyz(&url)["lost_nodes"], json!([]));
    let url2 = restarted.listening();
    let logits = predict(&c.model, DATA, c.dir.path());
    assert_matches(
        &url,
        &logits,
        "after node 2 restarted, through the engine node",
    );
    assert_matches(&url2, &logits, "through the restarted node 2");
    drop((restarted, c));
}

/// The engine node killed (SIGKILL) and started again at once at its fixed address with
/// `--rejoin`, as a service manager restarts it: the survivors find the old process lost
/// when the new one says hello to them (not after the idle timeout), node 1 takes over, and
/// the new process's `Join`s (sent every 200 ms) are taken as the lost node coming back: it
/// serves its partition again, and every node answers what `trellis predict` computes.
#[test]
fn the_engine_node_restarted_at_once_at_its_fixed_address_is_taken_back_by_its_successor() {
    let _shared = sharing_the_machine();
    let mut c = FixedCluster::start();
    c.engine.listening();
    let url1 = c.nodes[0].listening();
    wait_placement(&url1, &json!([0, 1, 2]));
    c.engine.child.kill().unwrap();
    c.engine.child.wait().unwrap();
    let restarted = c.start_node(0, &["--rejoin"]);
    let t = Instant::now();
    until_readyz(&url1, Duration::from_secs(60), "node 0 taken back", |r| {
        // The successor's answer (the old engine never recovered anything).
        (r.status == 200
            && r.body["placement"] == json!([0, 1, 2])
            && r.body["lost_nodes"] == json!([])
            && r.body["recoveries"].as_u64() >= Some(1))
        .then_some(())
    });
    println!(
        "the engine node restarted at its address, taken back by node 1 after {:?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() < FIXED_IDLE,
        "taken back {:?} after the restart: the idle timeout ({FIXED_IDLE:?}) was waited for",
        t.elapsed()
    );
    let url0 = restarted.listening();
    let logits = predict(&c.model, DATA, c.dir.path());
    assert_matches(&url1, &logits, "through node 1, the engine node now");
    assert_matches(&url0, &logits, "through the restarted node 0");
    drop((restarted, c));
}

/// The engine node killed (SIGKILL) and started again with `--rejoin`: it finds its
/// successor (node 1) among the cluster file's nodes, which takes it back as a serving node
/// and moves its partition back to it; every node then serves what `trellis predict`
/// computes, with the update made while it was away and one made through it after.
#[test]
fn the_lost_engine_node_started_again_with_rejoin_is_taken_back_by_its_successor() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    let c0 = write_cluster(dir.path(), "c0.toml", "127.0.0.1:0", 3);
    let addr_of = |i: u32| dir.path().join(format!("node{i}.addr"));
    let (a0, a1, a2) = (addr_of(0), addr_of(1), addr_of(2));
    let mut args = vec![
        "serve",
        "--cluster",
        s(&c0),
        "--model",
        s(&model),
        "--data",
        DATA,
    ];
    args.extend([
        "--listen",
        "127.0.0.1:0",
        "--threads",
        "1",
        "--partitions",
        "3",
    ]);
    args.extend(["--addr-file", s(&a0)]);
    let mut engine = Proc::start("engine node", &args);
    let c1 = write_cluster(dir.path(), "c1.toml", &bound(&a0), 3);
    let nodes: Vec<Proc> = [("1", &a1), ("2", &a2)]
        .iter()
        .map(|(id, addr_file)| {
            let mut args = vec!["serve", "--cluster", s(&c1), "--id", id, "--threads", "1"];
            args.extend(["--listen", "127.0.0.1:0", "--addr-file", s(addr_file)]);
            args.extend(["--deadline-ms", "3000"]);
            Proc::start(&format!("node {id}"), &args)
        })
        .collect();
    let url = engine.listening();
    let urls: Vec<String> = nodes.iter().map(Proc::listening).collect();
    wait_placement(&url, &json!([0, 1, 2]));
    engine.child.kill().unwrap();
    engine.child.wait().unwrap();
    wait_placement(&urls[0], &json!([1, 1, 2]));
    // The successor names the lost engine node.
    assert_eq!(readyz(&urls[0])["lost_nodes"], json!([0]));
    let r = post(&urls[0], "/v1/edges", &json!({ "add": [[7, 880]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut edges = undirected_edges(&ds);
    edges.insert((7, 880));

    // Node 0 again, as a serving node: its cluster file names where nodes 1 and 2 listen.
    let c2 = write_cluster_at(
        dir.path(),
        "c2.toml",
        &["127.0.0.1:0", &bound(&a1), &bound(&a2)],
        "",
    );
    let args = [
        "serve",
        "--cluster",
        s(&c2),
        "--id",
        "0",
        "--rejoin",
        "--threads",
        "1",
    ];
    let restarted = Proc::start(
        "node 0 again",
        &[&args[..], &["--listen", "127.0.0.1:0"]].concat(),
    );
    let url0 = restarted.listening();
    let back = wait_placement(&urls[0], &json!([0, 1, 2]));
    assert_eq!(readyz(&urls[0])["lost_nodes"], json!([]));
    println!("node 0 taken back {back:?} after its front end listened");
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let during = write_dataset(dir.path(), "during", &ds.features, &edge_list);
    let logits = predict(&model, s(&during), dir.path());
    for u in [&urls[0], &urls[1], &url0] {
        assert_matches(u, &logits, "after node 0 came back");
    }
    let r = post(&url0, "/v1/edges", &json!({ "add": [[20, 500]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    edges.insert((20, 500));
    let edge_list: Vec<(u32, u32)> = edges.iter().copied().collect();
    let updated = write_dataset(dir.path(), "updated", &ds.features, &edge_list);
    let logits = predict(&model, s(&updated), dir.path());
    assert_matches(&urls[0], &logits, "after an update through node 0");
    assert_matches(&url0, &logits, "after an update, through node 0");
    drop((restarted, nodes));
}

/// The QUIC address a node wrote to `addr_file` (waits at most a minute).
fn bound(addr_file: &Path) -> String {
    let t = Instant::now();
    loop {
        if let Ok(a) = std::fs::read_to_string(addr_file) {
            return a;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{addr_file:?} never written"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_engine_node_killed_under_load_is_succeeded_by_another_node_with_no_wrong_answer() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    // The other nodes let a prediction wait up to 6 s for a successor (about 1.7 s after
    // the kill here; more when the tests running beside it load the machine).
    let Cluster {
        mut engine,
        nodes,
        node_urls,
        ..
    } = start_cluster_with(
        dir.path(),
        3,
        &model,
        &["--partitions", "3", "--deadline-ms", "1500"],
        &["--deadline-ms", "6000"],
    );
    // An update through node 2 before the loss: the successor serves the graph with it.
    let ds: Dataset = DataSource::parse(DATA).unwrap().load().unwrap();
    let mut edges = undirected_edges(&ds);
    let r = post(&node_urls[1], "/v1/edges", &json!({ "add": [[7, 880]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    edges.insert((7, 880));
    let data = |name: &str, edges: &std::collections::BTreeSet<(u32, u32)>| {
        let list: Vec<(u32, u32)> = edges.iter().copied().collect();
        write_dataset(dir.path(), name, &ds.features, &list)
    };
    let before = predict(&model, s(&data("before", &edges)), dir.path());
    let (version, _) = served(&node_urls[0], &[0], true);
    let queried: Vec<u32> = vec![5, 7, 320, 640, 880, 899];
    let expected = Arc::new(vec![queried
        .iter()
        .map(|&v| softmax(before.row(v as usize).as_slice().unwrap()))
        .collect::<Vec<_>>()]);
    // Open-loop load through the two other nodes (which forward to the engine node).
    let load = Load::start(node_urls.clone(), &queried, expected);
    std::thread::sleep(Duration::from_millis(800));
    // SIGKILL the engine node (it serves partition 0, the published rows and the API).
    engine.child.kill().unwrap();
    engine.child.wait().unwrap();
    let killed_at = Instant::now();
    // A prediction sent to node 2 now waits for the loss to be found, then for the
    // successor, which answers it.
    let in_flight = {
        let (url, nodes) = (node_urls[1].clone(), queried.clone());
        std::thread::spawn(move || {
            let r = post(&url, "/v1/predict", &json!({ "nodes": nodes }));
            (r, killed_at.elapsed())
        })
    };
    // Node 1, the lowest-numbered survivor, takes over; both survivors answer again.
    let mut node1 = nodes.into_iter();
    let (n1, n2) = (node1.next().unwrap(), node1.next().unwrap());
    let line = n1.line_with("took over", killed_at);
    assert!(line.contains("from node 0"), "{line}");
    let recovered = loop {
        let ready: Vec<Reply> = node_urls
            .iter()
            .map(|u| call(&agent(), "GET", &format!("{u}/readyz"), b""))
            .collect();
        if ready.iter().all(|r| r.status == 200) {
            // Node 0's partition moved to node 1, the successor.
            for r in &ready {
                assert_eq!(r.body["placement"], json!([1, 1, 2]), "{}", r.text);
            }
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "the survivors were not ready 60 s after the kill"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(800));
    load.stop_and_check("engine node loss under load", recovered);
    let (r, took) = in_flight.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    let w = worst(&probabilities(&r.body), &before, &queried);
    assert!(w <= 1e-5, "the successor's answer is off by {w}");
    eprintln!("a prediction sent at the kill was answered by the successor after {took:?}");

    // The successor serves the same model version and every prediction, through both
    // survivors, and takes updates and a model swap as the engine node did.
    let (v, _) = served(&node_urls[1], &[0], true);
    assert_eq!(v, version, "the model version survives the take-over");
    for u in &node_urls {
        assert_matches(u, &before, "after the take-over");
    }
    let r = post(&node_urls[1], "/v1/edges", &json!({ "add": [[300, 700]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    edges.insert((300, 700));
    let updated = data("after", &edges);
    let logits = predict(&model, s(&updated), dir.path());
    for u in &node_urls {
        assert_matches(u, &logits, "after an update on the successor");
    }
    let newer = train(dir.path(), "newer.safetensors", "1");
    let bytes = std::fs::read(&newer).unwrap();
    let r = call(
        &agent(),
        "PUT",
        &format!("{}/v1/model", node_urls[0]),
        &bytes,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let logits = predict(&newer, s(&updated), dir.path());
    for u in &node_urls {
        assert_matches(u, &logits, "after a swap on the successor");
    }
    drop((n1, n2));
}

/// With `takeover = "any"`, the engine node and the node that would succeed it (node 1) die
/// together: node 2 finds node 1 gone while it joins it, and takes over itself, with every
/// partition. (With the default, a majority, it would not: see
/// `a_network_partition_never_leaves_two_engine_nodes_serving_and_heals`.)
#[test]
fn the_engine_node_and_its_successor_lost_together_leave_the_last_node_serving_everything() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    let Cluster {
        mut engine,
        nodes,
        node_urls,
        ..
    } = start_cluster_on(
        dir.path(),
        3,
        &model,
        DATA,
        &["--partitions", "3"],
        &[],
        "takeover = \"any\"\n",
    );
    let r = post(&node_urls[1], "/v1/edges", &json!({ "add": [[7, 880]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    let mut graph = EditedGraph::new();
    graph.edges.insert((7, 880));
    let logits = graph.logits(&model, dir.path(), "updated");
    let mut nodes = nodes.into_iter();
    let (mut n1, n2) = (nodes.next().unwrap(), nodes.next().unwrap());
    for p in [&mut engine, &mut n1] {
        p.child.kill().unwrap();
        p.child.wait().unwrap();
    }
    let killed_at = Instant::now();
    let line = n2.line_with("took over", killed_at);
    assert!(line.contains("node 2"), "{line}");
    let url = &node_urls[1];
    wait_ready(url, &json!([2, 2, 2]), killed_at);
    eprintln!("node 2 ready {:?} after both kills", killed_at.elapsed());
    assert_matches(url, &logits, "on the last node");
    let r = post(url, "/v1/edges", &json!({ "add": [[300, 700]] }));
    assert_eq!(r.status, 200, "{}", r.text);
    graph.edges.insert((300, 700));
    let logits = graph.logits(&model, dir.path(), "updated-again");
    assert_matches(url, &logits, "after an update");
}

#[test]
fn wrong_roles_are_clear_errors_naming_the_node() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(2);
    let model = train(dir.path(), "m.safetensors", "0");
    // A node started with the engine node's options.
    let c = write_cluster(dir.path(), "c.toml", "127.0.0.1:0", 2);
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args([
            "serve",
            "--cluster",
            s(&c),
            "--id",
            "1",
            "--model",
            s(&model),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node 1") && err.contains("engine node"),
        "{err}"
    );

    // A training node joining a serving cluster: the engine node refuses to start, naming it.
    let err = engine_start_fails(dir.path(), &model, DATA, &["node"]);
    assert!(
        err.contains("node 1") && err.contains("trellis serve --cluster"),
        "{err}"
    );

    // A serving node joining a training coordinator that does not serve: told so at once,
    // it exits naming the coordinator (not after the join timeout).
    let c0 = write_cluster(dir.path(), "t0.toml", "127.0.0.1:0", 2);
    let addr_file = dir.path().join("trainer.addr");
    let mut args = vec!["node", "--cluster", s(&c0), "--id", "0"];
    args.extend([
        "--addr-file",
        s(&addr_file),
        "--data",
        DATA,
        "--epochs",
        "5",
    ]);
    let (_trainer, quic) = spawn_bound(&args, &addr_file, Stdio::null());
    let c1 = write_cluster(dir.path(), "t1.toml", &quic, 2);
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["serve", "--cluster", s(&c1), "--id", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node 0") && err.contains("does not serve"),
        "{err}"
    );
}

/// Starts `trellis ARGS` (stdout discarded, stderr to `stderr`), which writes its QUIC
/// address to `addr_file`; the process and that address (waited for, at most a minute).
fn spawn_bound(args: &[&str], addr_file: &Path, stderr: Stdio) -> (Reap, String) {
    let child = Reap(
        Command::new(env!("CARGO_BIN_EXE_trellis"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    loop {
        if let Ok(a) = std::fs::read_to_string(addr_file) {
            return (child, a);
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{args:?} never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the engine node of a 2-node serving cluster (`model` on `data`) and node 1 as
/// `trellis NODE1 --cluster FILE --id 1`; the engine node must exit unsuccessfully within
/// 120 s. Its standard error.
fn engine_start_fails(dir: &Path, model: &Path, data: &str, node1: &[&str]) -> String {
    let c0 = write_cluster(dir, "c0.toml", "127.0.0.1:0", 2);
    let addr_file = dir.join("node0.addr");
    let _ = std::fs::remove_file(&addr_file);
    let mut args = vec!["serve", "--cluster", s(&c0), "--model", s(model)];
    args.extend(["--data", data, "--listen", "127.0.0.1:0", "--threads", "1"]);
    args.extend(["--addr-file", s(&addr_file)]);
    let (mut engine, quic) = spawn_bound(&args, &addr_file, Stdio::piped());
    let t = Instant::now();
    let c1 = write_cluster(dir, "c1.toml", &quic, 2);
    let mut node_args = node1.to_vec();
    node_args.extend(["--cluster", s(&c1), "--id", "1"]);
    let _node1 = Proc::start("node 1", &node_args);
    let status = loop {
        if let Some(st) = engine.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the engine node did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    use std::io::Read;
    let mut stderr = engine.0.stderr.take().unwrap();
    stderr.read_to_string(&mut err).unwrap();
    assert!(!status.success());
    err
}

/// Messages over the 16 MiB a frame carries travel in pieces: a partition's rows of the
/// last layer at start-up (10,000 rows of 500 classes: 20 MB, which failed the start before
/// they did), and an HTTP answer forwarded by another node (3,000 nodes' probabilities: ~19
/// MB of JSON). The service starts and serves what `trellis predict` computes.
#[test]
fn answers_over_the_frame_limit_travel_in_pieces() {
    let _shared = sharing_the_machine();
    let dir = cluster_dir(2);
    let data = "synthetic:nodes=20000,degree=4,features=8,classes=500,seed=1";
    let model = dir.path().join("wide.safetensors");
    trellis(&[
        "train",
        "--data",
        data,
        "--model",
        "gcn",
        "--hidden",
        "8",
        "--epochs",
        "1",
        "--save-model",
        s(&model),
    ]);
    let c = start_cluster_on(dir.path(), 2, &model, data, &[], &[], "");
    let logits = predict(&model, data, dir.path());
    let sample: Vec<u32> = (0..20_000).step_by(97).collect();
    for through in [false, true] {
        let (_, probs) = served(&c.url, &sample, through);
        let w = worst(&probs, &logits, &sample);
        assert!(w <= 1e-5, "through the partitions: {through}: off by {w}");
    }
    let nodes: Vec<u32> = (0..3_000).map(|i| i * 6 + 3).collect();
    let r = post(&c.node_urls[0], "/v1/predict", &json!({ "nodes": nodes }));
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.text.len() > 16 << 20, "{} bytes of JSON", r.text.len());
    let probs = probabilities(&r.body);
    assert_eq!(probs.len(), nodes.len());
    let w = worst(&probs, &logits, &nodes);
    assert!(w <= 1e-5, "through node 1: off by {w}");
}

/// Runs `f` on a thread of its own in node `i`'s network namespace of `net` (where that
/// node's HTTP front end listens, on its 127.0.0.1).
fn in_ns<T: Send>(net: &EmulatedNet, i: u32, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                net.join_current_thread(i).expect("the node's namespace");
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Waits (at most 30 s) until `url`'s `/readyz` says it is cut off from most of its
/// cluster (503, `cut_off`); the reason it gives.
fn wait_cut_off(url: &str) -> String {
    until_readyz(url, Duration::from_secs(30), "`cut_off`", |r| {
        let why = r.body["cut_off"].as_str()?;
        assert_eq!(r.status, 503, "{}", r.text);
        Some(why.to_string())
    })
}

/// A serving cluster split by a network partition (three nodes in network namespaces on a
/// bridge; a node cut off by taking its bridge port down, as a pulled cable would; needs root,
/// SKIPPED otherwise), with the default `takeover = "majority"`:
/// 1. Node 2 cut off: the engine node (with node 1, a majority) re-places its partition and
///    takes an update; node 2, alone, does not take over and answers no prediction.
/// 2. Mended: node 2 finds the engine node, which takes it back with the update. Then only
///    the path between node 2 and the engine node cut and mended: the same.
/// 3. The engine node cut off: nodes 1 and 2 (a majority) take over; node 0 refuses every
///    request from when it finds itself cut off, also after an update on the other side.
/// 4. Mended: node 0 finds that node 1 took over, stops its engine and is taken back by
///    node 1 as a serving node (the process runs itself again: same pid, same output).
/// 5. Every node cut off from every other: none serves; mended, the engine node takes the
///    others back and answers again.
///
/// After each step every node that answers serves what `trellis predict` computes.
#[test]
fn a_network_partition_never_leaves_two_engine_nodes_serving_and_heals() {
    let _alone = MACHINE.write().unwrap_or_else(|p| p.into_inner());
    if !binary::can_build_networks(
        "a_network_partition_never_leaves_two_engine_nodes_serving_and_heals",
    ) {
        return;
    }
    let spec = NetSpec {
        nodes: 3,
        rate: "1gbit".parse().unwrap(),
        delay_ms: None,
        mtu: 1500,
    };
    // Declared first, dropped last: every node process has been reaped by then.
    let net = EmulatedNet::create(spec).unwrap();
    let dir = cluster_dir(3);
    let model = train(dir.path(), "m.safetensors", "0");
    let addrs: Vec<String> = (0..3).map(|i| format!("{}:7411", net.addr(i))).collect();
    let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    let file = write_cluster_at(dir.path(), "c.toml", &addrs, "");
    let common = [
        "--cluster",
        s(&file),
        "--listen",
        "127.0.0.1:0",
        "--threads",
        "1",
    ];
    let start = |i: u32, name: &str, args: &[&str]| {
        let args = [&["serve"][..], args, &common].concat();
        Proc::start_prepared(name, &args, |c| net.enter(i, c))
    };
    let engine_args = ["--model", s(&model), "--data", DATA, "--partitions", "3"];
    let n0 = start(0, "engine node 0", &engine_args);
    let n1 = start(1, "node 1", &["--id", "1"]);
    let n2 = start(2, "node 2", &["--id", "2"]);
    let urls = [n0.listening(), n1.listening(), n2.listening()];
    let on = |i: usize| (i as u32, urls[i].as_str());
    let placed = |(i, url): (u32, &str), placement: Value| {
        in_ns(&net, i, || wait_placement(url, &placement))
    };
    let lost_nodes = |(i, url): (u32, &str)| in_ns(&net, i, || readyz(url)["lost_nodes"].clone());
    let predicted = |(i, url): (u32, &str), nodes: &[u32]| {
        in_ns(&net, i, || {
            post(url, "/v1/predict", &json!({ "nodes": nodes }))
        })
    };
    let matches = |(i, url): (u32, &str), logits: &ndarray::Array2<f32>, what: &str| {
        in_ns(&net, i, || assert_matches(url, logits, what))
    };
    placed(on(0), json!([0, 1, 2]));
    let mut graph = EditedGraph::new();

    // 1. Node 2 cut off: its partition goes to node 1; an update on the majority's side.
    net.cut(2).unwrap();
    let cut = Instant::now();
    placed(on(0), json!([0, 1, 1]));
    eprintln!(
        "node 2's partition re-placed {:?} after the cut",
        cut.elapsed()
    );
    assert_eq!(lost_nodes(on(0)), json!([2]));
    let r = in_ns(&net, 0, || {
        post(&urls[0], "/v1/edges", &json!({ "add": [[7, 880]] }))
    });
    assert_eq!(r.status, 200, "{}", r.text);
    graph.edges.insert((7, 880));
    let first = graph.logits(&model, dir.path(), "first");
    matches(on(0), &first, "the engine node with node 2 cut off");
    // Node 2 alone neither takes over nor answers from its copy (which lacks the update).
    for _ in 0..5 {
        let r = predicted(on(2), &[7, 880]);
        assert_eq!(r.status, 503, "node 2 cut off answered: {}", r.text);
        std::thread::sleep(Duration::from_millis(300));
    }

    // 2. Mended: node 2 is taken back (its partition back on it) with the update.
    net.mend(2).unwrap();
    let mended = Instant::now();
    placed(on(0), json!([0, 1, 2]));
    eprintln!(
        "node 2 taken back {:?} after the network mended",
        mended.elapsed()
    );
    assert_eq!(lost_nodes(on(0)), json!([]));
    matches(on(0), &first, "the engine node after node 2 came back");
    matches(on(2), &first, "node 2 after it came back");

    // 2b. Only the path between node 2 and the engine node cut: node 2 takes node 1 for the
    // successor, which still serves the engine node (and fenced node 2) and tells it so;
    // node 2 then looks for the engine node, and is taken back once the path mends.
    net.cut_between(0, 2).unwrap();
    placed(on(0), json!([0, 1, 1]));
    for _ in 0..5 {
        let r = predicted(on(2), &[7, 880]);
        assert_eq!(
            r.status, 503,
            "node 2 cut off from the engine answered: {}",
            r.text
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    net.mend_between(0, 2).unwrap();
    let mended = Instant::now();
    placed(on(0), json!([0, 1, 2]));
    eprintln!(
        "node 2 taken back {:?} after its path to node 0 mended",
        mended.elapsed()
    );
    matches(on(2), &first, "node 2 after its path to node 0 mended");

    // 3. The engine node cut off: node 1 takes over with node 2; node 0 refuses.
    net.cut(0).unwrap();
    let cut = Instant::now();
    placed(on(1), json!([1, 1, 2]));
    eprintln!("node 1 took over {:?} after the cut", cut.elapsed());
    assert_eq!(lost_nodes(on(1)), json!([0]));
    let why = in_ns(&net, 0, || wait_cut_off(&urls[0]));
    assert!(why.contains("nodes [1, 2] of 3 are lost"), "{why}");
    let r = in_ns(&net, 2, || {
        post(&urls[2], "/v1/edges", &json!({ "add": [[300, 700]] }))
    });
    assert_eq!(r.status, 200, "{}", r.text);
    graph.edges.insert((300, 700));
    let second = graph.logits(&model, dir.path(), "second");
    matches(
        on(1),
        &second,
        "node 1, the engine node after the take-over",
    );
    matches(on(2), &second, "node 2 after the take-over");
    let r = predicted(on(0), &[300, 700]);
    assert_eq!(r.status, 503, "node 0 cut off answered: {}", r.text);
    assert!(r.text.contains("cut off"), "{}", r.text);
    assert!(r.retry_after.is_some(), "{}", r.text);

    // 4. Mended: node 0 learns that node 1 took over, steps down and is taken back as a
    //    serving node, by itself; its front end (on a new port) forwards to node 1.
    net.mend(0).unwrap();
    let mended = Instant::now();
    let url0 = n0.listening();
    placed(on(1), json!([0, 1, 2]));
    eprintln!(
        "node 0 stepped down and was taken back {:?} after the network mended",
        mended.elapsed()
    );
    assert_eq!(lost_nodes(on(1)), json!([]));
    matches((0, &url0), &second, "node 0 after it was taken back");
    matches(on(1), &second, "node 1 after node 0 was taken back");

    // 5. Every node cut off from every other: none serves (node 1, the engine node now, is
    //    cut off; nodes 0 and 2 reach no majority and look for the engine node). Mended,
    //    they find node 1, which takes them back and answers again.
    for i in 0..3 {
        net.cut(i).unwrap();
    }
    let why = in_ns(&net, 1, || wait_cut_off(&urls[1]));
    assert!(why.contains("nodes [0, 2] of 3 are lost"), "{why}");
    // Both others have given up their succession by then (two idle timeouts of waiting
    // for a majority, after the loss is found).
    std::thread::sleep(Duration::from_secs(6));
    for (i, url) in [(0, url0.as_str()), on(2)] {
        let r = predicted((i, url), &[300, 700]);
        assert_eq!(r.status, 503, "node {i} answered alone: {}", r.text);
    }
    for i in 0..3 {
        net.mend(i).unwrap();
    }
    let mended = Instant::now();
    placed(on(1), json!([0, 1, 2]));
    eprintln!(
        "nodes 0 and 2 taken back by node 1 {:?} after the network mended",
        mended.elapsed()
    );
    let ready = in_ns(&net, 1, || readyz(&urls[1]));
    assert_eq!(ready["lost_nodes"], json!([]), "{ready}");
    assert!(ready.get("cut_off").is_none(), "{ready}");
    matches(on(1), &second, "node 1 answering again");
    matches((0, &url0), &second, "node 0 after the network mended");
    matches(on(2), &second, "node 2 after the network mended");
    drop((n0, n1, n2));
}
