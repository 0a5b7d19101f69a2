//! Deeper models (`--layers N`, `--residual`, per-layer `--hidden`): partitioned training of
//! 3- and 4-layer models equals single-process training as the 2-layer models do (loss within
//! 1e-5 relative, same test accuracy, a fixed P repeats bit for bit), and the binary trains,
//! saves, predicts with and refuses them as a user meets it.
use std::path::Path;
use std::process::{Command, Output};
use trellis::actors::{RunEvent, Topology};
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, Dataset, ModelKind, RunReport, Trainer};

const DATA: &str = "synthetic:nodes=600,degree=6,features=12,classes=3,seed=4";

fn synthetic() -> Dataset {
    DataSource::parse("synthetic:nodes=1200,degree=8,features=24,classes=4,seed=3")
        .unwrap()
        .load()
        .unwrap()
}

/// `kind` with hidden layers of `widths` (per head), residual or not.
fn deep(ds: &Dataset, kind: ModelKind, widths: &[usize], residual: bool) -> TrainConfig {
    let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, 7);
    cfg.epochs = 10;
    cfg.threads = 2;
    cfg.model.layers = widths.len() + 1;
    cfg.model.hidden = widths[0];
    cfg.model.hidden_sizes = widths.to_vec();
    cfg.model.residual = residual;
    cfg
}

fn partitioned(ds: &Dataset, cfg: &TrainConfig, parts: usize) -> RunReport {
    let topo = Topology::partition(ds, parts, PartitionMethod::Metis, None, cfg.clone()).unwrap();
    let run = topo.spawn().unwrap();
    let epochs = run
        .events()
        .iter()
        .filter(|ev| matches!(ev, RunEvent::Epoch(_)))
        .count();
    let report = run.wait().unwrap();
    assert_eq!(epochs as u32, cfg.epochs, "one event per epoch");
    report
}

fn max_rel_loss_diff(a: &RunReport, b: &RunReport) -> f64 {
    a.epochs_log
        .iter()
        .zip(&b.epochs_log)
        .map(|(x, y)| (x.loss - y.loss).abs() / x.loss.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// P = 2 and 4 against one process, and P = 2 twice (bit-identical).
fn check_exact(ds: &Dataset, cfg: &TrainConfig) {
    let m = &cfg.model;
    let name = format!(
        "{} {} layers {:?}{}",
        m.kind,
        m.layers,
        m.hidden_sizes,
        if m.residual { " residual" } else { "" }
    );
    let single = Trainer::new(ds, cfg.clone()).unwrap().run(|_| {}).unwrap();
    let two = partitioned(ds, cfg, 2);
    for (p, rep) in [(2, &two), (4, &partitioned(ds, cfg, 4))] {
        let d = max_rel_loss_diff(&single, rep);
        eprintln!("{name} P={p}: max relative loss difference {d:.3e}");
        assert!(d <= 1e-5, "{name} P={p}: loss differs by {d:e}");
        assert_eq!(rep.test_acc, single.test_acc, "{name} P={p}: test accuracy");
        assert_eq!(rep.epochs_log.len(), single.epochs_log.len());
    }
    let again = partitioned(ds, cfg, 2);
    assert_eq!(
        two.weights_digest, again.weights_digest,
        "{name}: P=2 repeat"
    );
}

#[test]
fn gcn_three_and_four_layers_partitioned_match_single() {
    let ds = synthetic();
    check_exact(&ds, &deep(&ds, ModelKind::Gcn, &[32, 32], false));
    // Layer 1 identity residual, layer 2 (32 -> 16) projected, layer 3 split (16 -> 4).
    check_exact(&ds, &deep(&ds, ModelKind::Gcn, &[32, 32, 16], true));
}

#[test]
fn sage_three_and_four_layers_partitioned_match_single() {
    let ds = synthetic();
    check_exact(&ds, &deep(&ds, ModelKind::Sage, &[32, 16], true));
    check_exact(&ds, &deep(&ds, ModelKind::Sage, &[16, 16, 16], false));
}

#[test]
fn gat_three_and_four_layers_partitioned_match_single() {
    let ds = synthetic();
    check_exact(&ds, &deep(&ds, ModelKind::Gat, &[4, 4], false));
    check_exact(&ds, &deep(&ds, ModelKind::Gat, &[4, 4, 2], true));
}

fn trellis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(args)
        .output()
        .expect("run trellis")
}

fn ok(args: &[&str]) -> String {
    let out = trellis(args);
    assert!(
        out.status.success(),
        "trellis {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails(args: &[&str]) -> String {
    let out = trellis(args);
    assert!(!out.status.success(), "trellis {args:?} succeeded");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The safetensors header of a model file: tensor names with shapes, and the metadata.
fn header(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).unwrap()
}

#[test]
fn train_a_residual_three_layer_model_save_it_and_predict_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (file, report) = (dir.path().join("m.safetensors"), dir.path().join("r.json"));
    let out = ok(&[
        "train",
        "--data",
        DATA,
        "--layers",
        "3",
        "--residual",
        "--hidden",
        "32,16",
        "--epochs",
        "8",
        "--threads",
        "2",
        "--report",
        s(&report),
        "--save-model",
        s(&file),
    ]);
    assert!(out.contains("test accuracy"), "{out}");
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let model = &rep["config"]["model"];
    assert_eq!(model["layers"], 3, "{model}");
    assert_eq!(
        model["hidden_sizes"],
        serde_json::json!([32, 16]),
        "{model}"
    );
    assert_eq!(model["residual"], true, "{model}");

    // The model file carries three layers, the per-layer widths and the projection of the
    // residual layer whose widths differ (32 -> 16).
    let h = header(&file);
    assert_eq!(h["__metadata__"]["trellis.layer_sizes"], "12,32,16,3");
    assert_eq!(h["__metadata__"]["trellis.residual"], "true");
    for (name, shape) in [
        ("conv1.lin.weight", [32, 12]),
        ("conv2.lin.weight", [16, 32]),
        ("conv2.res.weight", [16, 32]),
        ("conv3.lin.weight", [3, 16]),
    ] {
        assert_eq!(h[name]["shape"], serde_json::json!(shape), "{name}");
    }

    let (one, two) = (dir.path().join("one.npy"), dir.path().join("two.npy"));
    let args = |out: &Path| {
        vec![
            "predict".to_string(),
            "--model".into(),
            s(&file).into(),
            "--data".into(),
            DATA.into(),
            "--out".into(),
            s(out).into(),
        ]
    };
    let run = |v: Vec<String>| ok(&v.iter().map(String::as_str).collect::<Vec<_>>());
    run(args(&one));
    let mut parted = args(&two);
    parted.extend(["--partitions".into(), "3".into()]);
    run(parted);
    let (a, b) = (std::fs::read(&one).unwrap(), std::fs::read(&two).unwrap());
    assert_eq!(a, b, "3 parts predict other logits than one");
    let logits: ndarray::Array2<f32> = ndarray_npy::read_npy(&one).unwrap();
    assert_eq!(logits.dim(), (600, 3));
    assert!(logits.iter().all(|v| v.is_finite()));
    let emb = dir.path().join("emb.npy");
    let mut e = args(&emb);
    e.extend(["--embeddings".into(), "1".into()]);
    run(e);
    let rows: ndarray::Array2<f32> = ndarray_npy::read_npy(&emb).unwrap();
    assert_eq!(rows.dim(), (600, 16), "layer 1 is 16 wide");

    // The same configuration on 2 partition actors trains too (its report says so).
    let out = ok(&[
        "train",
        "--data",
        DATA,
        "--layers",
        "3",
        "--residual",
        "--hidden",
        "32,16",
        "--epochs",
        "3",
        "--threads",
        "2",
        "--partitions",
        "2",
    ]);
    assert!(out.contains("2 partitions"), "{out}");
}

#[test]
fn model_shape_flags_that_do_not_fit_are_clear_errors() {
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        [&["train", "--data", DATA, "--epochs", "1"][..], extra].concat()
    }
    let err = fails(&with(&["--layers", "4", "--hidden", "32,16"]));
    assert!(
        err.contains("--hidden 32,16 lists 2 widths but a 4-layer model has 3 hidden layers"),
        "{err}"
    );
    let err = fails(&with(&["--residual"]));
    assert!(err.contains("--layers 3 or more"), "{err}");
    let err = fails(&with(&["--layers", "0"]));
    assert!(err.contains("between 1 and 128"), "{err}");
    let err = fails(&with(&["--layers", "1000"]));
    assert!(err.contains("between 1 and 128"), "{err}");
    let err = fails(&with(&["--hidden", "32,0"]));
    assert!(err.contains("`0`"), "{err}");
    // One layer: a linear model over aggregated features, no hidden layer.
    let out = ok(&with(&["--layers", "1"]));
    assert!(out.contains("test accuracy"), "{out}");
}
