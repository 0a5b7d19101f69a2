//! The `trellis` binary as a user runs it: reports, determinism, partitioning, the demo, and
//! clear errors with a non-zero exit on bad input.
use std::path::Path;
mod binary;

use std::process::Output;

const DATA: &str = "synthetic:nodes=600,degree=6,features=12,classes=3,seed=4";

/// Runs `trellis ARGS` to its end.
fn trellis(args: &[&str]) -> Output {
    binary::trellis().args(args).output().expect("run trellis")
}

/// Runs `trellis ARGS`, which must succeed; its stdout.
fn ok(args: &[&str]) -> String {
    binary::assert_ok(&trellis(args))
}

fn report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn train_writes_a_complete_report_and_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    for p in [&a, &b] {
        ok(&[
            "train",
            "--data",
            DATA,
            "--model",
            "gat",
            "--epochs",
            "4",
            "--report",
            p.to_str().unwrap(),
        ]);
    }
    let (ra, rb) = (report(&a), report(&b));
    for key in [
        "model",
        "dataset",
        "seed",
        "epochs",
        "partitions",
        "test_acc",
        "best_val_acc",
        "best_epoch",
        "step_ms_median",
        "peak_rss_bytes",
        "weights_digest",
        "epochs_log",
        "data_digest",
        "config",
        "code_version",
    ] {
        assert!(ra.get(key).is_some(), "report lacks {key}");
    }
    assert_eq!(ra["model"], "gat");
    assert_eq!(ra["partitions"], 1);
    assert_eq!(ra["epochs_log"].as_array().unwrap().len(), 4);
    for key in ["epoch", "loss", "train_acc", "val_acc", "ms"] {
        assert!(
            ra["epochs_log"][0].get(key).is_some(),
            "epoch log lacks {key}"
        );
    }
    assert_eq!(
        ra["weights_digest"], rb["weights_digest"],
        "same config and seed, different weights"
    );
    assert_eq!(ra["weights_digest"].as_str().unwrap().len(), 64);
}

#[test]
fn partition_then_train_partitioned() {
    let dir = tempfile::tempdir().unwrap();
    let parts = dir.path().join("parts");
    let out = ok(&[
        "partition",
        "--data",
        DATA,
        "--parts",
        "3",
        "--method",
        "metis",
        "--out",
        parts.to_str().unwrap(),
    ]);
    assert!(out.contains("edge cut"), "{out}");
    let book = report(&parts.join("partition.json"));
    assert_eq!(book["parts"], 3);
    let rep = dir.path().join("r.json");
    ok(&[
        "train",
        "--data",
        DATA,
        "--epochs",
        "3",
        "--partitions",
        "3",
        "--partition-dir",
        parts.to_str().unwrap(),
        "--report",
        rep.to_str().unwrap(),
    ]);
    let r = report(&rep);
    assert_eq!(r["partitions"], 3);
    assert_eq!(r["edge_cut"], book["edge_cut"]);
    let e = &r["epochs_log"][0];
    assert!(e["halo_bytes"].as_u64().unwrap() > 0);
    assert!(e["compute_ms"].as_f64().unwrap() > 0.0);
}

/// The demo ends with recovery verified and with the trained model served on partition
/// actors: its answers equal layer-wise inference, and a new node is served.
#[test]
fn demo_verifies_recovery_and_serving() {
    let out = ok(&["demo", "--data", DATA, "--epochs", "4", "--partitions", "3"]);
    assert!(
        out.contains("recovery verified: identical weights"),
        "{out}"
    );
    assert!(out.contains("listening on http://127.0.0.1:"), "{out}");
    assert!(
        out.contains("serving verified: answers equal layer-wise inference"),
        "{out}"
    );
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "train".into(),
                "--data".into(),
                missing.display().to_string(),
            ],
            "nowhere",
        ),
        (
            vec![
                "train".into(),
                "--data".into(),
                "synthetic:nodes=abc".into(),
            ],
            "abc",
        ),
        (
            vec![
                "train".into(),
                "--data".into(),
                DATA.into(),
                "--model".into(),
                "mlp".into(),
            ],
            "mlp",
        ),
        (
            vec![
                "train".into(),
                "--data".into(),
                DATA.into(),
                "--lr=-1".into(),
            ],
            "lr",
        ),
    ];
    // A folder whose x.npy is garbage.
    let bad = dir.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("x.npy"), b"not a numpy file").unwrap();
    let mut cases = cases;
    cases.push((
        vec!["train".into(), "--data".into(), bad.display().to_string()],
        "npy",
    ));
    for (args, needle) in cases {
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let out = trellis(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            err.contains(needle),
            "{args:?}: error does not mention {needle}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

/// `--device cuda` on a machine (or build) without a usable GPU: exit 1 with a message that
/// names what is missing, never a panic. Skipped (with a note on stderr) where a GPU works.
#[test]
fn device_cuda_without_a_gpu_is_a_clear_error() {
    let out = trellis(&["train", "--data", DATA, "--device", "cuda", "--epochs", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        use std::io::Write;
        let _ = std::io::stderr()
            .lock()
            .write_all(b"SKIPPED device_cuda_without_a_gpu: cuda:0 is usable here\n");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: device cuda:0 is unavailable"),
        "{err}"
    );
    assert!(
        err.contains("--features cuda") || err.contains("cannot load") || err.contains("device"),
        "{err}"
    );
    assert!(!err.contains("panic"), "{err}");
    let out = trellis(&["train", "--data", DATA, "--device", "tpu"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected cpu, cuda or cuda:N"));
}

#[test]
fn bench_partitions_times_both_sides_and_says_where_time_goes() {
    let out = ok(&[
        "bench",
        "partitions",
        "--data",
        DATA,
        "--partitions",
        "2",
        "--epochs",
        "3",
        "--hidden",
        "16",
        "--threads",
        "2",
    ]);
    let ms_of = |prefix: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{out}"));
        line[prefix.len()..]
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no time in `{line}`"))
    };
    let (one, two) = (ms_of("P=1"), ms_of("P=2"));
    assert!(one > 0.0 && two > 0.0, "{out}");
    let ratio = out
        .lines()
        .find_map(|l| l.strip_prefix("ratio"))
        .and_then(|r| r.trim().split('x').next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no ratio in:\n{out}"));
    // The printed times are rounded to 0.01 ms; tiny steps make the ratio of the rounded
    // times only roughly the printed ratio.
    assert!(
        ratio > 0.0 && (ratio - two / one).abs() <= 0.25 * ratio + 0.02,
        "{out}"
    );
    for needle in ["forward 0", "backward 0", "apply", "halo MiB", "gemm"] {
        assert!(out.contains(needle), "no `{needle}` in:\n{out}");
    }
    let bad = trellis(&["bench", "partitions", "--data", DATA, "--partitions", "1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--partitions must be at least 2"));
}
