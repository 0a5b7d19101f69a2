//! Multi-process clusters as a user runs them: real `trellis node` / `trellis launch`
//! processes on 127.0.0.1 with ephemeral ports. Every process a test starts is killed and
//! reaped when the test ends (also when it fails), and every wait is bounded.
mod binary;

use binary::{http_get, prometheus_sample, read_report as report};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DATA: &str = "synthetic:nodes=1500,degree=8,features=24,classes=4,seed=3";

/// A started process, killed and reaped on drop.
struct Proc {
    name: String,
    child: Child,
}

impl Proc {
    fn start(name: &str, args: &[&str]) -> Proc {
        let child = Command::new(env!("CARGO_BIN_EXE_trellis"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start trellis");
        Proc {
            name: name.into(),
            child,
        }
    }

    /// The process's stdout, line by line, as it comes.
    fn stdout_lines(&mut self) -> mpsc::Receiver<String> {
        let stdout = self.child.stdout.take().expect("stdout is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    }

    /// Waits at most `limit` for the exit; returns the status, stdout and stderr.
    fn finish(mut self, limit: Duration) -> (ExitStatus, String, String) {
        let t = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t.elapsed() < limit,
                "{} did not exit within {limit:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        let mut err = String::new();
        use std::io::Read;
        if let Some(mut s) = self.child.stdout.take() {
            s.read_to_string(&mut out).unwrap();
        }
        if let Some(mut s) = self.child.stderr.take() {
            s.read_to_string(&mut err).unwrap();
        }
        (status, out, err)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_ok(name: &str, args: &[&str], limit: Duration) -> String {
    let (status, out, err) = Proc::start(name, args).finish(limit);
    assert!(status.success(), "{name} failed ({status}): {err}\n{out}");
    out
}

fn losses(r: &serde_json::Value) -> Vec<f64> {
    r["epochs_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["loss"].as_f64().unwrap())
        .collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn three_node_cluster_matches_single_process() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single.json");
    let inproc = dir.path().join("inproc.json");
    let common = ["--data", DATA, "--epochs", "6", "--seed", "2"];
    let limit = Duration::from_secs(120);
    let mut args = vec!["train", "--report", s(&single)];
    args.extend(common);
    run_ok("single", &args, limit);
    let inproc_model = dir.path().join("inproc.safetensors");
    let mut args = vec!["train", "--partitions", "6", "--report", s(&inproc)];
    args.extend(["--save-model", s(&inproc_model)]);
    args.extend(common);
    run_ok("in-process", &args, limit);
    let (single, inproc) = (report(&single), report(&inproc));

    let mut digests = Vec::new();
    for i in 0..2 {
        let out = dir.path().join(format!("cluster{i}.json"));
        let cdir = dir.path().join(format!("cluster{i}"));
        let model = dir.path().join(format!("cluster{i}.safetensors"));
        let mut args = vec![
            "launch",
            "--nodes",
            "3",
            "--dir",
            s(&cdir),
            "--partitions",
            "6",
            "--report",
            s(&out),
        ];
        args.extend(common);
        args.extend(["--save-model", s(&model)]);
        run_ok("launch", &args, limit);
        let r = report(&out);
        // The coordinator saves the best epoch's model: the one the same partitions save in
        // one process.
        let (a, b) = (model_meta(&model), model_meta(&inproc_model));
        assert_eq!(a["trellis.weights_digest"], b["trellis.weights_digest"]);
        assert_eq!(a["trellis.epoch"], r["best_epoch"].to_string());
        assert_eq!(r["partitions"], 6);
        let nodes = r["nodes"].as_array().unwrap();
        assert_eq!(nodes.len(), 3, "{r}");
        for (i, n) in nodes.iter().enumerate() {
            assert_eq!(n["node"], i as u64);
            assert_eq!(n["partitions"].as_array().unwrap().len(), 2);
            assert!(n["bytes_sent"].as_u64().unwrap() > 0, "{n}");
            assert!(n["bytes_received"].as_u64().unwrap() > 0, "{n}");
        }
        // The latencies and counters cover every node's partitions, not only the
        // coordinator's: one replication per epoch each, halo traffic from each.
        for p in 0..6 {
            let rep = &r["latency"][format!("replicate{{partition={p}}}")];
            assert_eq!(rep["count"], 6, "partition {p}: {}", r["latency"]);
            let sent = r["counters"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.starts_with(&format!("halo_bytes{{partition={p},")))
                .count();
            assert!(sent > 0, "partition {p}: {}", r["counters"]);
        }
        // Same per-epoch loss as one process (1e-5 relative) and the same test accuracy.
        let (a, b) = (losses(&r), losses(&single));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(((x - y) / y).abs() <= 1e-5, "loss {x} vs {y}");
        }
        assert_eq!(r["test_acc"], single["test_acc"]);
        // The same partitions in one process compute exactly the same weights.
        assert_eq!(r["weights_digest"], inproc["weights_digest"]);
        digests.push(r["weights_digest"].clone());
    }
    assert_eq!(digests[0], digests[1], "a fixed placement is deterministic");
}

/// The report of the same training (`--partitions 3`, `epochs`) in one process, in `dir`:
/// the weights a cluster run must end with, recorded by another party.
fn one_process_reference(dir: &Path, epochs: &str) -> PathBuf {
    let reference = dir.join("reference.json");
    let args = [
        "train",
        "--data",
        DATA,
        "--partitions",
        "3",
        "--epochs",
        epochs,
    ];
    let args: Vec<&str> = args
        .into_iter()
        .chain(["--report", s(&reference)])
        .collect();
    run_ok("reference", &args, Duration::from_secs(120));
    reference
}

/// Starts `args` as `name`, which must be refused: it ends unsuccessfully within
/// `within_s` seconds, saying `why` on stderr.
fn ends_refused(name: &str, args: &[&str], why: &str, within_s: u64) {
    let t = Instant::now();
    let (status, _, err) = Proc::start(name, args).finish(Duration::from_secs(within_s + 30));
    assert!(!status.success(), "{name} joined: {err}");
    assert!(err.contains(why), "{name} is not told why ({why}): {err}");
    let within = Duration::from_secs(within_s);
    assert!(t.elapsed() < within, "{name} ended after {:?}", t.elapsed());
}

/// The first line of `rx` that starts with `prefix` (each line within 60 s).
fn first_line_starting(rx: &mpsc::Receiver<String>, prefix: &str) -> String {
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no `{prefix}` line"));
        if line.starts_with(prefix) {
            return line;
        }
    }
}

/// The metadata of a model file.
fn model_meta(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap()
}

/// `extra` lines for the top level of the cluster file, not a `[[node]]` table.
const TOP: u32 = u32::MAX;

/// Certificates plus a cluster file for nodes `0..n`; returns the folder.
fn cluster_dir(n: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    trellis_transport::certs::init(&certs).unwrap();
    for i in 0..n {
        trellis_transport::certs::issue(&certs, i).unwrap();
    }
    dir
}

fn write_cluster(
    dir: &Path,
    name: &str,
    coord_addr: &str,
    n: u32,
    extra: &[(u32, &str)],
) -> PathBuf {
    let mut t = "certs = \"certs\"\npartitions = \"parts\"\nheartbeat_ms = 200\nidle_timeout_ms = 1500\nstep_deadline_ms = 20000\njoin_timeout_ms = 20000\n".to_string();
    for (node, line) in extra {
        if *node == TOP {
            t += &format!("{line}\n");
        }
    }
    for i in 0..n {
        let addr = if i == 0 { coord_addr } else { "127.0.0.1:0" };
        t += &format!("[[node]]\nid = {i}\naddr = \"{addr}\"\n");
        for (node, line) in extra {
            if *node == i {
                t += &format!("{line}\n");
            }
        }
    }
    let path = dir.join(name);
    std::fs::write(&path, t).unwrap();
    path
}

/// Starts the coordinator (node 0) with `train` options; returns it and its address.
fn start_coordinator(dir: &Path, n: u32, extra: &[(u32, &str)], train: &[&str]) -> (Proc, String) {
    let c0 = write_cluster(dir, "c0.toml", "127.0.0.1:0", n, extra);
    let addr_file = dir.join("node0.addr");
    let mut args = vec![
        "node",
        "--cluster",
        s(&c0),
        "--id",
        "0",
        "--addr-file",
        s(&addr_file),
    ];
    args.extend(train);
    let coord = Proc::start("coordinator", &args);
    let t = Instant::now();
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "coordinator never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (coord, addr)
}

/// Starts nodes 1 and 2 of a 3-node cluster whose coordinator listens at `addr`.
fn start_workers(dir: &Path, addr: &str, extra: &[(u32, &str)]) -> (Proc, Proc) {
    let c1 = write_cluster(dir, "c1.toml", addr, 3, extra);
    let w1 = Proc::start("node 1", &["node", "--cluster", s(&c1), "--id", "1"]);
    let w2 = Proc::start("node 2", &["node", "--cluster", s(&c1), "--id", "2"]);
    (w1, w2)
}

#[test]
fn a_node_without_partition_files_receives_them_from_the_coordinator() {
    let dir = cluster_dir(2);
    let extra = [(1, "partitions = \"node1-parts\"")];
    let train = ["--data", DATA, "--partitions", "4", "--epochs", "3"];
    let (coord, addr) = start_coordinator(dir.path(), 2, &extra, &train);
    let c1 = write_cluster(dir.path(), "c1.toml", &addr, 2, &extra);
    let worker = Proc::start("node 1", &["node", "--cluster", s(&c1), "--id", "1"]);
    let (status, out, err) = coord.finish(Duration::from_secs(120));
    assert!(status.success(), "{err}\n{out}");
    let (status, wout, werr) = worker.finish(Duration::from_secs(20));
    assert!(status.success(), "{werr}\n{wout}");
    // Node 1 hosts partitions 2 and 3 and keeps the replica of node 0's (0 and 1); it had
    // none of them and now holds exact copies.
    for p in [0, 1, 2, 3] {
        let name = format!("part-{p}.rkyv");
        let a = std::fs::read(dir.path().join("parts").join(&name));
        let b = std::fs::read(dir.path().join("node1-parts").join(&name));
        assert!(
            a.is_ok() && a.ok() == b.ok(),
            "{name} was not shipped intact"
        );
    }
}

#[test]
fn a_node_that_stops_answering_fails_the_run_naming_it_and_nothing_hangs() {
    let dir = cluster_dir(3);
    let train = [
        "--data",
        DATA,
        "--partitions",
        "3",
        "--epochs",
        "100000",
        "--verbose",
    ];
    // Without replicas the run cannot recover from the loss: it must fail, naming the node.
    let norep = [(TOP, "replicas = 0")];
    let (mut coord, addr) = start_coordinator(dir.path(), 3, &norep, &train);
    let (w1, w2) = start_workers(dir.path(), &addr, &norep);
    // Wait for training to be under way, then freeze node 2.
    let rx = coord.stdout_lines();
    let t = Instant::now();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the cluster trains");
        if line.starts_with("epoch    3") {
            break;
        }
    }
    // SIGSTOP: the process stays, its sockets stay open, it just stops answering; only the
    // idle timeout (1.5 s here) can tell. The guard kills it at the end.
    let rc = unsafe { libc::kill(w2.child.id() as i32, libc::SIGSTOP) };
    assert_eq!(rc, 0);
    let killed = Instant::now();
    let (status, _, err) = coord.finish(Duration::from_secs(30));
    assert!(!status.success());
    assert!(
        err.contains("node 2"),
        "the error names the lost node: {err}"
    );
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "detected after {:?}",
        killed.elapsed()
    );
    let (status, _, werr) = w1.finish(Duration::from_secs(20));
    assert!(!status.success(), "node 1 learns that the run failed");
    assert!(
        werr.contains("aborted") || werr.contains("node 0"),
        "{werr}"
    );
    eprintln!(
        "silent node detected in {:?} (run took {:?})",
        killed.elapsed(),
        t.elapsed()
    );
}

#[test]
fn bad_cluster_files_and_ids_are_clear_errors() {
    let dir = cluster_dir(1);
    let missing = dir.path().join("missing.toml");
    let (status, _, err) = Proc::start("node", &["node", "--cluster", s(&missing), "--id", "0"])
        .finish(Duration::from_secs(20));
    assert!(!status.success());
    assert!(err.contains("missing.toml"), "{err}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "certs = \"certs\"\npartitions = \"p\"\n").unwrap();
    let (status, _, err) = Proc::start("node", &["node", "--cluster", s(&bad), "--id", "0"])
        .finish(Duration::from_secs(20));
    assert!(!status.success());
    assert!(err.contains("bad.toml") && err.contains("node"), "{err}");
    let good = write_cluster(dir.path(), "c.toml", "127.0.0.1:0", 1, &[]);
    let (status, _, err) = Proc::start("node", &["node", "--cluster", s(&good), "--id", "7"])
        .finish(Duration::from_secs(20));
    assert!(!status.success());
    assert!(err.contains("node 7 is not in the cluster file"), "{err}");
    // Without replicas the coordinator has no replicated state to take a model from: said
    // before any epoch is trained.
    let bare = write_cluster(
        dir.path(),
        "r0.toml",
        "127.0.0.1:0",
        1,
        &[(TOP, "replicas = 0")],
    );
    let model = dir.path().join("m.safetensors");
    let args = [
        "node",
        "--cluster",
        s(&bare),
        "--id",
        "0",
        "--data",
        DATA,
        "--epochs",
        "2",
    ];
    let (status, _, err) = Proc::start("node", &[&args[..], &["--save-model", s(&model)]].concat())
        .finish(Duration::from_secs(60));
    assert!(!status.success());
    assert!(
        err.contains("--save-model") && err.contains("replicas >= 1"),
        "{err}"
    );
    assert!(!model.exists());
}

#[test]
fn a_frozen_node_is_replaced_and_fenced_when_it_wakes_up() {
    let dir = cluster_dir(3);
    let epochs = "12";
    let train = [
        "--data",
        DATA,
        "--partitions",
        "3",
        "--epochs",
        epochs,
        "--verbose",
    ];
    let reference = one_process_reference(dir.path(), epochs);
    let out = dir.path().join("cluster.json");
    let mut train = train.to_vec();
    train.extend(["--report", s(&out)]);
    let (mut coord, addr) = start_coordinator(dir.path(), 3, &[], &train);
    let (w1, w2) = start_workers(dir.path(), &addr, &[]);
    let rx = coord.stdout_lines();
    let wait_for = |prefix: &str| first_line_starting(&rx, prefix);
    wait_for("epoch    2");
    // Freeze node 2: it is declared lost (idle timeout) and its partition re-placed...
    let pid = w2.child.id() as i32;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let recovered = wait_for("recovered: loss of node 2");
    // ...then it wakes up with stale state; whatever it still sends is refused (fenced).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(recovered.contains("restored state matched"), "{recovered}");
    let (status, _, err) = coord.finish(Duration::from_secs(60));
    assert!(status.success(), "{err}");
    let (a, b) = (report(&out), report(&reference));
    assert_eq!(a["weights_digest"], b["weights_digest"]);
    assert_eq!(losses(&a).len(), 12);
    let (status, _, _) = w1.finish(Duration::from_secs(20));
    assert!(status.success());
    // The woken node finds itself cut off and exits on its own.
    let (status, _, werr) = w2.finish(Duration::from_secs(20));
    assert!(!status.success(), "{werr}");
}

#[test]
fn a_second_process_claiming_a_joined_node_id_is_refused_at_once() {
    let dir = cluster_dir(3);
    let out = dir.path().join("cluster.json");
    let train = [
        "--data",
        DATA,
        "--partitions",
        "3",
        "--epochs",
        "12",
        "--verbose",
        "--report",
        s(&out),
        "--metrics-addr",
        "127.0.0.1:0",
        "--metrics-linger",
        "5",
    ];
    let (mut coord, addr) = start_coordinator(dir.path(), 3, &[], &train);
    let (w1, w2) = start_workers(dir.path(), &addr, &[]);
    let rx = coord.stdout_lines();
    let mut metrics = None;
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("no `epoch    2` line");
        if let Some(a) = line.strip_prefix("metrics: http://") {
            metrics = a.strip_suffix("/metrics").map(str::to_string);
        }
        if line.starts_with("epoch    2") {
            break;
        }
    }
    let metrics = metrics.expect("no `metrics: http://...` line");
    let refused = || {
        let (_, body) = http_get(&metrics, "/metrics").expect("scrape /metrics");
        prometheus_sample(&body, "trellis_refused_connections_total{node=\"0\"}")
    };
    assert_eq!(refused(), None, "a refusal before any was made");
    // A copy of node 1 (same certificate, another port) tries to join the running cluster.
    let c1 = dir.path().join("c1.toml");
    let copy = ["node", "--cluster", s(&c1), "--id", "1"];
    ends_refused("copy of node 1", &copy, "already connected", 30);
    // The refusal is on /metrics at once (the run, or the endpoint's linger, still going).
    assert_eq!(refused(), Some(1.0), "the refusal is not counted live");
    // The run is unaffected, and the coordinator logged the refusal.
    let (status, _, err) = coord.finish(Duration::from_secs(120));
    assert!(status.success(), "{err}");
    assert!(
        err.contains("security: node 0 refused a connection"),
        "{err}"
    );
    assert!(err.contains("node 1 is already connected from"), "{err}");
    let report = report(&out);
    assert_eq!(report["epochs_log"].as_array().unwrap().len(), 12);
    assert_eq!(
        report["counters"]["refused_connections{node=0}"], 1,
        "{}",
        report["counters"]
    );
    for w in [w1, w2] {
        let (status, _, werr) = w.finish(Duration::from_secs(20));
        assert!(status.success(), "{werr}");
    }
}

/// A worker killed (SIGKILL) and started again at once at its fixed address, as a service
/// manager restarts it: its hello tells the coordinator at once that the old process is
/// gone (another incarnation from its address), the run recovers from the loss, and the
/// new process is refused saying why (a training run does not take nodes back) and ends
/// at once instead of waiting for a setup. The run ends with the weights of one process.
#[test]
fn a_worker_restarted_during_training_is_told_it_was_lost_and_ends() {
    let dir = cluster_dir(3);
    let epochs = "60";
    let reference = one_process_reference(dir.path(), epochs);
    let out = dir.path().join("cluster.json");
    let train = [
        "--data",
        DATA,
        "--partitions",
        "3",
        "--epochs",
        epochs,
        "--verbose",
        "--report",
        s(&out),
    ];
    let (mut coord, addr) = start_coordinator(dir.path(), 3, &[], &train);
    // Node 2 at a fixed port, so that its restart binds the same address.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|u| u.local_addr())
        .unwrap()
        .port();
    let c1 = write_cluster(dir.path(), "c1.toml", &addr, 3, &[]);
    let text = std::fs::read_to_string(&c1).unwrap();
    let (head, node2) = text.split_at(text.find("id = 2").unwrap());
    let node2 = node2.replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    std::fs::write(&c1, format!("{head}{node2}")).unwrap();
    let w1 = Proc::start("node 1", &["node", "--cluster", s(&c1), "--id", "1"]);
    let mut w2 = Proc::start("node 2", &["node", "--cluster", s(&c1), "--id", "2"]);
    let rx = coord.stdout_lines();
    let wait_for = |prefix: &str| first_line_starting(&rx, prefix);
    wait_for("epoch    2");
    w2.child.kill().unwrap();
    w2.child.wait().unwrap();
    let again = ["node", "--cluster", s(&c1), "--id", "2"];
    ends_refused(
        "node 2 again",
        &again,
        "was lost from this training run",
        10,
    );
    wait_for("recovered: loss of node 2");
    let (status, _, err) = coord.finish(Duration::from_secs(120));
    assert!(status.success(), "{err}");
    assert!(
        err.contains("a new process of it connected from"),
        "the loss was not found by the restart's hello: {err}"
    );
    let (a, b) = (report(&out), report(&reference));
    assert_eq!(a["weights_digest"], b["weights_digest"]);
    let (status, _, werr) = w1.finish(Duration::from_secs(20));
    assert!(status.success(), "{werr}");
}
