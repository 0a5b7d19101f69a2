//! Clusters far past 32 nodes: `trellis launch` with one partition per node process on
//! loopback, each holding a few dozen nodes of a small graph, must finish in bounded time with
//! exactly the weights of the same partitions in one process.
//!
//! Before the fix, 33 nodes never finished epoch 1: every node dialled all its neighbours at
//! the first halo exchange, and each connection's MTU discovery (quinn parses the padding of
//! every ~64 KB probe byte by byte, ~14 ms of CPU per connection) starved the handshakes past
//! a connect timeout tied to the 3 s idle timeout; the failed dial then failed that peer for
//! good and its blocks were dropped without a word. 64 nodes are checked in CI; 128
//! (`cargo test --release --test large_cluster -- --ignored --test-threads 1`) are not.
mod binary;

use binary::{read_report, trellis};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const DATA: &str = "synthetic:nodes=3000,degree=6,features=16,classes=4,seed=5";

/// Kills and reaps the process on drop (its node processes die with it: PR_SET_PDEATHSIG).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `trellis args`, failing the test if it does not succeed within `limit`.
fn run_within(args: &[&str], limit: Duration) -> String {
    let child = trellis()
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start trellis");
    let mut p = Reaped(child);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < limit,
            "trellis {} did not finish within {limit:?}",
            args.join(" ")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = p.0.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    assert!(
        status.success(),
        "trellis {} failed ({status}): {err}",
        args.join(" ")
    );
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `n` node processes, one partition each, against the same `n` partitions in one process.
fn cluster_of(n: u32, limit: Duration) {
    let dir = tempfile::tempdir().unwrap();
    let n_s = n.to_string();
    let (inproc, cluster) = (
        dir.path().join("inproc.json"),
        dir.path().join("cluster.json"),
    );
    let parts = dir.path().join("parts");
    let common = [
        "--data",
        DATA,
        "--epochs",
        "2",
        "--seed",
        "1",
        "--threads",
        "1",
        "--partitions",
        &n_s,
        "--partition-dir",
        s(&parts),
    ];
    let mut args = vec!["train", "--report", s(&inproc)];
    args.extend(common);
    run_within(&args, limit);
    let start = Instant::now();
    let cdir = dir.path().join("cluster");
    let mut args = vec![
        "launch",
        "--nodes",
        &n_s,
        "--dir",
        s(&cdir),
        "--step-deadline-ms",
        "60000",
        // 64+ processes share 2 vCPUs here, and a random graph makes every partition a
        // neighbour of most others (~47 of 63): the first exchange opens ~4,000 connections
        // at once and a node may not be scheduled for seconds. The default 3 s idle timeout
        // would declare such a node dead; a real cluster has a core per node.
        "--idle-timeout-ms",
        "20000",
        "--heartbeat-ms",
        "1000",
        "--report",
        s(&cluster),
    ];
    args.extend(common);
    run_within(&args, limit);
    eprintln!("{n} node processes: trained in {:?}", start.elapsed());
    let (a, b) = (read_report(&inproc), read_report(&cluster));
    assert_eq!(b["nodes"].as_array().unwrap().len(), n as usize, "{b}");
    assert_eq!(b["epochs_log"].as_array().unwrap().len(), 2);
    assert_eq!(
        a["weights_digest"], b["weights_digest"],
        "the cluster computes exactly the weights of one process"
    );
}

#[test]
fn sixty_four_node_cluster_matches_one_process() {
    cluster_of(64, Duration::from_secs(180));
}

#[test]
#[ignore = "128 processes on 2 vCPUs: the launch took 35 s here; kept out of CI time"]
fn a_128_node_cluster_matches_one_process() {
    cluster_of(128, Duration::from_secs(300));
}
