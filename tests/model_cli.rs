//! The binary with deeper models and compressed gradients, as a user runs it: train, save and
//! predict with a residual 3-layer model; train through a panic with `--grad-codec int8`; the
//! flags that do not fit are clear errors.
use std::path::Path;
mod binary;

use std::process::Output;
use trellis::runtime::grad_codec::GradCodec;

const DATA: &str = "synthetic:nodes=600,degree=6,features=12,classes=3,seed=4";

/// Runs `trellis ARGS` to its end.
fn trellis(args: &[&str]) -> Output {
    binary::trellis().args(args).output().expect("run trellis")
}

/// Runs `trellis ARGS`, which must succeed; its stdout.
fn ok(args: &[&str]) -> String {
    binary::assert_ok(&trellis(args))
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

#[test]
fn the_binary_trains_with_a_codec_through_a_panic_and_refuses_what_it_cannot_do() {
    let data = DATA;
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            data,
            "--epochs",
            "6",
            "--threads",
            "2",
            "--partitions",
            "3",
            "--grad-codec",
            "int8",
        ];
        args.extend_from_slice(extra);
        trellis(&args)
    };
    let digest = |out: &Output| {
        let text = binary::assert_ok(out);
        assert!(text.contains("gradients to the all-reduce"), "{text}");
        text.lines()
            .find_map(|l| l.strip_prefix("weights_digest "))
            .unwrap()
            .to_string()
    };
    let clean = digest(&train(&[]));
    let faulty = digest(&train(&["--chaos", "panic:part=1:epoch=3:layer=1"]));
    assert_eq!(clean, faulty);

    let refuse = |args: &[&str]| {
        let out = trellis(args);
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refuse(&["train", "--data", data, "--grad-codec", "int8"]);
    assert!(err.contains("--partitions P"), "{err}");
    let err = refuse(&["train", "--data", data, "--grad-codec", "topk:2"]);
    assert!(err.contains("topk:F"), "{err}");
    // Checkpoints hold each partition's residual (`tests/checkpoint_resume.rs` resumes them).
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = trellis(&[
        "train",
        "--data",
        data,
        "--epochs",
        "2",
        "--partitions",
        "2",
        "--grad-codec",
        "int8",
        "--checkpoint-dir",
        d,
    ]);
    binary::assert_ok(&out);
    assert!(
        std::fs::read_dir(d).unwrap().next().is_some(),
        "no checkpoint written"
    );
    assert_eq!("none".parse::<GradCodec>().unwrap(), GradCodec::None);
}

/// A node process SIGKILLed mid-run with `--grad-codec int8`: its partition is re-placed on
/// the node that keeps its replica, whose bytes carry the error-feedback residual, and the
/// run ends with the weights of the same partitions trained in one process.
#[test]
fn a_cluster_with_compressed_gradients_survives_a_node_loss_with_identical_weights() {
    let data = "synthetic:nodes=1000,degree=6,features=12,classes=3,seed=4";
    let common = [
        "--data",
        data,
        "--epochs",
        "5",
        "--threads",
        "1",
        "--partitions",
        "3",
        "--grad-codec",
        "int8",
    ];
    let digest = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("weights_digest "))
            .unwrap_or_else(|| panic!("no digest in {text}"))
            .to_string()
    };
    let single = ok(&[&["train"][..], &common].concat());
    let cluster = ok(&[
        &[
            "launch",
            "--nodes",
            "3",
            "--chaos",
            "kill-node:node=2:epoch=3",
        ][..],
        &common,
    ]
    .concat());
    assert!(cluster.contains("loss of node 2"), "{cluster}");
    assert!(
        cluster.contains("restored state matched its digest"),
        "{cluster}"
    );
    assert_eq!(digest(&single), digest(&cluster), "{cluster}");
}
