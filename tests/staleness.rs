//! Halo staleness (`--staleness 1`, PipeGCN) and row skipping (`--skip-threshold`,
//! `--max-staleness`) in partitioned training, through the public API and the binary: runs
//! repeat bit for bit, `--staleness 0` is the exact run, staleness sends the same bytes as
//! exact and lands near it, skipping sends fewer, a cluster of processes (QUIC) trains
//! exactly as one process, faults in any phase recover to the fault-free weights, and bad
//! options are clear errors.
mod binary;

use binary::{assert_ok, read_report, trellis};
use trellis::actors::{FaultPlan, Topology};
use trellis::runtime::comm::HaloConfig;
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, Dataset, ModelKind, RunReport};

const DATA: &str = "synthetic:nodes=1500,degree=8,features=24,classes=4,seed=3";

fn synthetic() -> Dataset {
    DataSource::parse(DATA).unwrap().load().unwrap()
}

fn skipping(ds: &Dataset, kind: ModelKind, epochs: u32, threshold: f32) -> TrainConfig {
    let mut cfg = config(ds, kind, epochs, 2, 0);
    cfg.halo.skip_threshold = threshold;
    cfg.halo.max_staleness = Some(4);
    cfg
}

fn config(ds: &Dataset, kind: ModelKind, epochs: u32, seed: u64, staleness: u32) -> TrainConfig {
    let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, seed);
    cfg.epochs = epochs;
    cfg.threads = 2;
    cfg.halo = HaloConfig {
        staleness,
        ..HaloConfig::default()
    };
    cfg
}

/// The folder of `ds` partitioned into `parts`, written once per test process (later runs
/// only read it: tests running side by side never wait on each other's folder locks).
fn partition_dir(ds: &Dataset, parts: usize) -> std::path::PathBuf {
    use std::collections::BTreeMap;
    use std::sync::{Mutex, OnceLock};
    static DIRS: OnceLock<Mutex<BTreeMap<usize, tempfile::TempDir>>> = OnceLock::new();
    let mut dirs = DIRS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    dirs.entry(parts)
        .or_insert_with(|| {
            let dir = tempfile::tempdir().unwrap();
            trellis::runtime::partition::partition(
                ds,
                parts,
                PartitionMethod::Metis,
                0,
                dir.path(),
            )
            .unwrap();
            dir
        })
        .path()
        .to_path_buf()
}

fn run_with(ds: &Dataset, cfg: &TrainConfig, parts: usize, faults: FaultPlan) -> RunReport {
    let topo = Topology::open(partition_dir(ds, parts), cfg.clone())
        .unwrap()
        .with_faults(faults);
    let run = topo.spawn().unwrap();
    for _ in run.events() {}
    run.wait().unwrap()
}

fn run(ds: &Dataset, cfg: &TrainConfig, parts: usize) -> RunReport {
    run_with(ds, cfg, parts, FaultPlan::none())
}

fn halo_bytes(r: &RunReport) -> Vec<u64> {
    r.epochs_log.iter().map(|l| l.halo_bytes).collect()
}

#[test]
fn stale_runs_repeat_bit_for_bit_send_what_exact_sends_and_land_near_it() {
    let ds = synthetic();
    for kind in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat] {
        for parts in [2, 4] {
            let exact = run(&ds, &config(&ds, kind, 30, 5, 0), parts);
            let cfg = config(&ds, kind, 30, 5, 1);
            let (a, b) = (run(&ds, &cfg, parts), run(&ds, &cfg, parts));
            assert_eq!(a.weights_digest, b.weights_digest, "{kind} P={parts}");
            assert_ne!(a.weights_digest, exact.weights_digest, "{kind} P={parts}");
            // The first epoch runs exact; later ones use other rows.
            assert_eq!(a.epochs_log[0].loss, exact.epochs_log[0].loss, "{kind}");
            assert_ne!(a.epochs_log[5].loss, exact.epochs_log[5].loss, "{kind}");
            // The same rows cross the wire, only a step later.
            assert_eq!(halo_bytes(&a), halo_bytes(&exact), "{kind} P={parts}");
            let (first, last) = (a.epochs_log[0].loss, a.epochs_log[29].loss);
            let exact_last = exact.epochs_log[29].loss;
            assert!(
                last < 0.9 * first,
                "{kind} P={parts}: loss {first} -> {last}"
            );
            assert!(
                ((last - exact_last) / exact_last).abs() < 0.05,
                "{kind} P={parts}: final loss {last} vs exact {exact_last}"
            );
            assert!(
                (a.test_acc - exact.test_acc).abs() <= 0.05,
                "{kind} P={parts}: test accuracy {} vs exact {}",
                a.test_acc,
                exact.test_acc
            );
            eprintln!(
                "{kind} P={parts} staleness 1: loss {last:.4} (exact {exact_last:.4}), test {:.3} (exact {:.3})",
                a.test_acc, exact.test_acc
            );
        }
    }
}

/// Held rows are part of each partition's replica: a panic anywhere (forward, backward,
/// either stage of a split layer, evaluation, the optimizer step) restores them, and the run
/// ends with the fault-free weights.
#[test]
fn panics_with_staleness_on_recover_to_identical_weights() {
    let ds = synthetic();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        let cfg = config(&ds, kind, 6, 1, 1);
        let clean = run(&ds, &cfg, 3);
        let faults = [
            "panic:part=2:epoch=3:layer=1",
            "panic:part=2:epoch=3:layer=1:stage=2",
            "panic:part=1:epoch=2:layer=1:phase=backward",
            "panic:part=0:epoch=4:layer=0:phase=backward",
            "panic:part=2:epoch=3:layer=1:phase=eval",
            "panic:part=1:epoch=3:phase=apply",
            // Epoch 1 runs exact, its blocks used as they come and held for epoch 2.
            "panic:part=0:epoch=1:layer=1",
        ];
        for label in faults {
            if label.contains("stage=2") && kind != ModelKind::Gcn {
                continue; // only GCN's output layer is split (two stages)
            }
            let faulty = run_with(&ds, &cfg, 3, FaultPlan::parse(label).unwrap());
            let fired = faulty.recoveries.as_array().map_or(0, |a| a.len());
            assert_eq!(fired, 1, "{kind} {label}: {}", faulty.recoveries);
            assert_eq!(
                faulty.weights_digest, clean.weights_digest,
                "{kind}: {label}"
            );
        }
    }
}

#[test]
fn skipping_repeats_bit_for_bit_sends_fewer_bytes_and_recovers_from_panics() {
    let ds = synthetic();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        let exact = run(&ds, &config(&ds, kind, 30, 2, 0), 3);
        let cfg = skipping(&ds, kind, 30, 0.3);
        let (a, b) = (run(&ds, &cfg, 3), run(&ds, &cfg, 3));
        assert_eq!(a.weights_digest, b.weights_digest, "{kind}");
        let (sent, full): (u64, u64) =
            (halo_bytes(&a).iter().sum(), halo_bytes(&exact).iter().sum());
        // What fp32 would send is the same rows; fewer of them travel.
        let fp32: u64 = a.epochs_log.iter().map(|l| l.halo_fp32_bytes).sum();
        assert_eq!(fp32, full, "{kind}");
        assert!(sent < full, "{kind}: {sent} vs {full}");
        let (last, exact_last) = (a.epochs_log[29].loss, exact.epochs_log[29].loss);
        assert!(
            ((last - exact_last) / exact_last).abs() < 0.1,
            "{kind}: final loss {last} vs exact {exact_last}"
        );
        eprintln!(
            "{kind} skip 0.3: {:.2}x fewer halo bytes, loss {last:.4} (exact {exact_last:.4}), test {:.3} (exact {:.3})",
            full as f64 / sent as f64,
            a.test_acc,
            exact.test_acc
        );
        // The sender's records and the receiver's copies are replicated: panics anywhere end
        // with the fault-free weights.
        let short = skipping(&ds, kind, 6, 0.3);
        let clean = run(&ds, &short, 3);
        for spec in [
            "panic:part=1:epoch=3:layer=1:phase=backward",
            "panic:part=2:epoch=4:phase=apply",
            "panic:part=0:epoch=2:layer=1",
        ] {
            let faulty = run_with(&ds, &short, 3, FaultPlan::parse(spec).unwrap());
            assert_eq!(
                faulty.recoveries.as_array().map_or(0, |a| a.len()),
                1,
                "{spec}"
            );
            assert_eq!(
                faulty.weights_digest, clean.weights_digest,
                "{kind}: {spec}"
            );
        }
    }
}

/// Every epoch's evaluation accuracies (train, val, test).
fn evaluations(r: &RunReport) -> Vec<(f64, f64, f64)> {
    r.epochs_log
        .iter()
        .map(|l| (l.train_acc, l.val_acc, l.test_acc))
        .collect()
}

#[test]
fn evaluation_skipping_keeps_the_weights_sends_fewer_bytes_and_recovers_its_evaluations() {
    let ds = synthetic();
    let eval_bytes = |r: &RunReport| -> (u64, u64) {
        let sum = |f: fn(&trellis::runtime::EpochLog) -> u64| r.epochs_log.iter().map(f).sum();
        (sum(|l| l.eval_halo_bytes), sum(|l| l.eval_halo_fp32_bytes))
    };
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        let exact = run(&ds, &config(&ds, kind, 30, 2, 0), 3);
        let mut cfg = config(&ds, kind, 30, 2, 0);
        cfg.halo.eval_skip_threshold = 0.1;
        cfg.halo.max_staleness = Some(8);
        let (a, b) = (run(&ds, &cfg, 3), run(&ds, &cfg, 3));
        // Evaluation never touches the weights; its rows are skipped the same way each run.
        assert_eq!(a.weights_digest, exact.weights_digest, "{kind}");
        assert_eq!(evaluations(&a), evaluations(&b), "{kind}");
        // The training steps send what exact sends; evaluations fewer rows.
        assert_eq!(halo_bytes(&a), halo_bytes(&exact), "{kind}");
        let ((sent, fp32), (full, full_fp32)) = (eval_bytes(&a), eval_bytes(&exact));
        assert_eq!(
            (fp32, full),
            (full_fp32, full_fp32),
            "{kind}: exact sends every row"
        );
        assert!(
            sent < full,
            "{kind}: {sent} vs {full} evaluation halo bytes"
        );
        assert!(
            (a.test_acc - exact.test_acc).abs() <= 0.02,
            "{kind}: test {} vs exact {}",
            a.test_acc,
            exact.test_acc
        );
        eprintln!(
            "{kind} eval skip 0.1: {:.2}x fewer evaluation halo bytes, test {:.3} (exact {:.3})",
            full as f64 / sent as f64,
            a.test_acc,
            exact.test_acc
        );
        // Panics in an evaluation, in the optimizer step that commits the last evaluation's
        // rows, and in the training pass between them end with the fault-free weights and
        // the same evaluations.
        let mut short = cfg.clone();
        short.epochs = 6;
        let clean = run(&ds, &short, 3);
        for spec in [
            "panic:part=2:epoch=3:layer=1:phase=eval",
            "panic:part=1:epoch=4:phase=apply",
            "panic:part=0:epoch=4:layer=1:phase=backward",
        ] {
            let faulty = run_with(&ds, &short, 3, FaultPlan::parse(spec).unwrap());
            let fired = faulty.recoveries.as_array().map_or(0, |a| a.len());
            assert_eq!(fired, 1, "{kind} {spec}: {}", faulty.recoveries);
            assert_eq!(
                faulty.weights_digest, clean.weights_digest,
                "{kind}: {spec}"
            );
            assert_eq!(evaluations(&faulty), evaluations(&clean), "{kind}: {spec}");
        }
    }
}

#[test]
fn the_binary_takes_the_flag_and_a_cluster_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    let common = [
        "--data",
        DATA,
        "--epochs",
        "6",
        "--seed",
        "4",
        "--partitions",
        "4",
    ];
    let train = |extra: &[&str], report: &str| {
        assert_ok(
            &trellis()
                .arg("train")
                .args(common)
                .args(extra)
                .arg("--report")
                .arg(path(report))
                .output()
                .unwrap(),
        )
    };
    train(&[], "exact.json");
    train(&["--staleness", "0", "--skip-threshold", "0"], "zero.json");
    let out = train(&["--staleness", "1"], "stale.json");
    assert!(out.contains("rows of the previous epoch"), "{out}");
    let (exact, zero, stale) = (
        read_report(&path("exact.json")),
        read_report(&path("zero.json")),
        read_report(&path("stale.json")),
    );
    // --staleness 0 --skip-threshold 0 is today's exact run, and is recorded as one.
    assert_eq!(zero["weights_digest"], exact["weights_digest"]);
    assert!(zero["config"].get("halo").is_none(), "{}", zero["config"]);
    assert_eq!(stale["config"]["halo"]["staleness"], 1);
    assert_ne!(stale["weights_digest"], exact["weights_digest"]);
    // Two node processes over QUIC, with partition 3 panicking in the backward pass of epoch
    // 4 and partition 0 in the optimizer step of epoch 2: the same weights.
    assert_ok(
        &trellis()
            .args(["launch", "--nodes", "2", "--dir"])
            .arg(path("c"))
            .args(common)
            .args(["--staleness", "1"])
            .args([
                "--chaos",
                "panic:part=3:epoch=4:layer=1:phase=backward,panic:part=0:epoch=2:phase=apply",
                "--report",
            ])
            .arg(path("cluster.json"))
            .output()
            .unwrap(),
    );
    let cluster = read_report(&path("cluster.json"));
    assert_eq!(cluster["weights_digest"], stale["weights_digest"]);
    assert_eq!(
        cluster["recoveries"].as_array().unwrap().len(),
        2,
        "{}",
        cluster["recoveries"]
    );
    for (x, y) in stale["epochs_log"]
        .as_array()
        .unwrap()
        .iter()
        .zip(cluster["epochs_log"].as_array().unwrap())
    {
        assert_eq!(x["halo_bytes"], y["halo_bytes"]);
        assert_eq!(x["weights_digest"], y["weights_digest"]);
    }
    // Skipping with a codec, staleness and a bound, in one process and over QUIC: the same
    // weights and bytes, fewer bytes than the codec alone.
    let skip = [
        "--staleness",
        "1",
        "--skip-threshold",
        "0.3",
        "--max-staleness",
        "3",
        "--halo-codec",
        "int8",
    ];
    let out = train(&skip, "skip.json");
    assert!(out.contains("rows changed by at most 0.3 skipped"), "{out}");
    train(&["--halo-codec", "int8"], "int8.json");
    assert_ok(
        &trellis()
            .args(["launch", "--nodes", "2", "--dir"])
            .arg(path("s"))
            .args(common)
            .args(skip)
            .arg("--report")
            .arg(path("skip-cluster.json"))
            .output()
            .unwrap(),
    );
    let (one, many, int8) = (
        read_report(&path("skip.json")),
        read_report(&path("skip-cluster.json")),
        read_report(&path("int8.json")),
    );
    assert_eq!(one["weights_digest"], many["weights_digest"]);
    assert_eq!(
        one["config"]["halo"]["skip_threshold"].as_f64(),
        Some(0.3f32 as f64)
    );
    assert_eq!(one["config"]["halo"]["max_staleness"], 3);
    let bytes = |r: &serde_json::Value| -> u64 {
        r["epochs_log"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["halo_bytes"].as_u64().unwrap())
            .sum()
    };
    assert_eq!(bytes(&one), bytes(&many));
    assert!(
        bytes(&one) < bytes(&int8),
        "{} vs {}",
        bytes(&one),
        bytes(&int8)
    );
}

#[test]
fn bad_staleness_options_are_clear_errors() {
    let cases: [(&[&str], &str); 9] = [
        (
            &["--eval-skip-threshold=-1", "--partitions", "2"],
            "must be finite and at least 0",
        ),
        (
            &["--eval-skip-threshold", "0.1"],
            "--eval-skip-threshold 0.1 skips rows partitions exchange: it needs",
        ),
        (
            &["--skip-threshold=-1", "--partitions", "2"],
            "must be finite and at least 0",
        ),
        (
            &["--skip-threshold", "nan", "--partitions", "2"],
            "must be finite and at least 0",
        ),
        (&["--skip-threshold", "0.1"], "needs --partitions 2 or more"),
        (
            &[
                "--staleness",
                "1",
                "--max-staleness",
                "0",
                "--partitions",
                "2",
            ],
            "max staleness 0 is below the staleness 1",
        ),
        (
            &["--staleness", "2", "--partitions", "2"],
            "2 epochs is not supported",
        ),
        (&["--staleness", "one"], "\"one\" is not a number of epochs"),
        (&["--staleness", "1"], "needs --partitions 2 or more"),
    ];
    for (args, want) in cases {
        let out = trellis()
            .args(["train", "--data", DATA, "--epochs", "1"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
    }
}
