//! Durable checkpoints with per-partition state, as a user runs them: `trellis train
//! --partitions P --checkpoint-dir D` with `--grad-codec`, `--staleness`, `--skip-threshold`
//! (the error-feedback residuals, the halo rows held for the next epoch and the skip records
//! are each partition's own), stopped (killed, or at an earlier `--epochs`) and continued
//! with `--resume`: the same final weights as the uninterrupted run. A checkpoint of another
//! communication setting or of an older format is a clear error naming the file.
mod binary;

use binary::{assert_ok, read_report, trellis};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const DATA: &str = "synthetic:nodes=1500,degree=8,features=24,classes=4,seed=3";

/// `trellis train` on 3 partitions for `epochs` with `extra`; returns its report.
fn train(dir: &Path, name: &str, epochs: u32, extra: &[&str]) -> serde_json::Value {
    let report = dir.join(format!("{name}.json"));
    assert_ok(
        &trellis()
            .args(["train", "--data", DATA, "--partitions", "3", "--seed", "5"])
            .args(["--epochs", &epochs.to_string()])
            .args(extra)
            .arg("--report")
            .arg(&report)
            .output()
            .unwrap(),
    );
    read_report(&report)
}

fn digest(r: &serde_json::Value) -> String {
    r["weights_digest"].as_str().unwrap().to_string()
}

const SETTINGS: [&[&str]; 4] = [
    &["--grad-codec", "int8"],
    &["--staleness", "1"],
    &["--skip-threshold", "0.3", "--max-staleness", "3"],
    &[
        "--staleness",
        "1",
        "--skip-threshold",
        "0.3",
        "--max-staleness",
        "3",
        "--halo-codec",
        "int8",
        "--grad-codec",
        "int8",
    ],
];

#[test]
fn a_stopped_run_resumes_to_the_uninterrupted_weights_with_per_partition_state() {
    for (i, setting) in SETTINGS.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        let ck = ck.to_str().unwrap();
        let whole = train(dir.path(), "whole", 6, setting);
        let with_ck = |epochs: u32, resume: bool, name: &str| {
            let mut args: Vec<&str> = setting.to_vec();
            args.extend(["--checkpoint-dir", ck, "--checkpoint-every", "1"]);
            if resume {
                args.push("--resume");
            }
            train(dir.path(), name, epochs, &args)
        };
        let first = with_ck(3, false, "first");
        let rest = with_ck(6, true, "rest");
        assert_eq!(digest(&rest), digest(&whole), "setting {i}: {setting:?}");
        assert_eq!(rest["epochs_log"].as_array().unwrap().len(), 6);
        // The resumed epochs equal the uninterrupted run's, epoch by epoch.
        for (a, b) in rest["epochs_log"]
            .as_array()
            .unwrap()
            .iter()
            .zip(whole["epochs_log"].as_array().unwrap())
        {
            assert_eq!(a["weights_digest"], b["weights_digest"], "setting {i}");
            assert_eq!(a["halo_bytes"], b["halo_bytes"], "setting {i}");
        }
        assert_eq!(
            first["epochs_log"][2]["weights_digest"],
            whole["epochs_log"][2]["weights_digest"]
        );
    }
}

#[test]
fn a_killed_run_resumes_to_the_uninterrupted_weights() {
    let dir = tempfile::tempdir().unwrap();
    let setting = SETTINGS[3];
    let epochs = 40;
    let data = "synthetic:nodes=20000,degree=10,features=32,classes=4,seed=3";
    let run = |extra: &[&str], name: &str| {
        let report = dir.path().join(format!("{name}.json"));
        let mut c = trellis();
        c.args(["train", "--data", data, "--partitions", "3", "--seed", "5"])
            .args(["--epochs", &epochs.to_string()])
            .args(setting)
            .args(extra)
            .arg("--report")
            .arg(&report);
        (c, report)
    };
    let (mut whole, report) = run(&[], "whole");
    assert_ok(&whole.output().unwrap());
    let whole = read_report(&report);
    let ck = dir.path().join("ck");
    let ck_args = ["--checkpoint-dir", ck.to_str().unwrap()];
    let (mut first, _) = run(&ck_args, "first");
    let mut child = first
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // SIGKILL as soon as a checkpoint is on disk.
    let t = Instant::now();
    let written = loop {
        let found = std::fs::read_dir(&ck)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with(".ckpt"))
            })
            .unwrap_or(false);
        if found {
            break true;
        }
        if child.try_wait().unwrap().is_some() {
            break false;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no checkpoint written"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(written, "the run ended before writing a checkpoint");
    assert!(!status.success(), "killed before the end: {status:?}");
    let mut resume_args = ck_args.to_vec();
    resume_args.push("--resume");
    let (mut rest, report) = run(&resume_args, "rest");
    let out = assert_ok(&rest.output().unwrap());
    let rest = read_report(&report);
    assert_eq!(digest(&rest), digest(&whole), "{out}");
}

#[test]
fn a_checkpoint_of_other_settings_or_an_older_format_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    train(
        dir.path(),
        "stale",
        2,
        &["--staleness", "1", "--checkpoint-dir", ck_s],
    );
    let file = ck.join("checkpoint-00000002.ckpt");
    assert!(file.exists());
    let resume = |extra: &[&str]| {
        trellis()
            .args(["train", "--data", DATA, "--partitions", "3", "--seed", "5"])
            .args(["--epochs", "4", "--checkpoint-dir", ck_s, "--resume"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = resume(&["--staleness", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&file.display().to_string()) && err.contains("other communication settings"),
        "{err}"
    );
    let out = resume(&["--staleness", "1", "--grad-codec", "int8"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--grad-codec"),
        "{err}"
    );
    // The same file as an older build wrote it (format version 2): named, and refused.
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let out = resume(&["--staleness", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&file.display().to_string()) && err.contains("format version 2"),
        "{err}"
    );
}

/// On a cluster the coordinator's node receives every partition's replica too (it writes their
/// own state into the checkpoint): a stopped cluster run resumes to the uninterrupted weights.
#[test]
fn a_stopped_cluster_run_resumes_to_the_uninterrupted_weights() {
    let dir = tempfile::tempdir().unwrap();
    let setting = SETTINGS[3];
    let ck = dir.path().join("ck");
    let launch = |epochs: &str, name: &str, extra: &[&str]| {
        let report = dir.path().join(format!("{name}.json"));
        assert_ok(
            &trellis()
                .args(["launch", "--nodes", "3", "--partitions", "6"])
                .args(["--data", DATA, "--seed", "5", "--epochs", epochs])
                .arg("--dir")
                .arg(dir.path().join(name))
                .args(setting)
                .args(extra)
                .arg("--report")
                .arg(&report)
                .output()
                .unwrap(),
        );
        read_report(&report)
    };
    let ck_args = ["--checkpoint-dir", ck.to_str().unwrap()];
    let whole = launch("5", "whole", &[]);
    launch("2", "first", &ck_args);
    assert!(ck.join("checkpoint-00000002.ckpt").exists());
    let mut resume = ck_args.to_vec();
    resume.push("--resume");
    let rest = launch("5", "rest", &resume);
    assert_eq!(digest(&rest), digest(&whole));
}
