//! `trellis train --save-model` and `trellis predict`, through the real binary: the file loads
//! in Python with `safetensors` + `numpy` under PyG's names and reproduces Trellis's logits;
//! partitioned prediction gives the same bytes; bad model files are clear errors naming them.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn trellis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(args)
        .output()
        .expect("the trellis binary runs")
}

fn ok(args: &[&str]) -> String {
    let out = trellis(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "trellis {args:?} failed:\n{text}");
    text
}

fn fails(args: &[&str]) -> String {
    let out = trellis(args);
    assert!(!out.status.success(), "trellis {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn cora() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/datasets/cora");
    if p.join("x.npy").exists() {
        Some(p)
    } else {
        println!("SKIPPED: ../shared/datasets/cora is absent");
        None
    }
}

const SYNTH: &str = "synthetic:nodes=400,degree=6,features=16,classes=4,seed=1";

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// A Python with safetensors and numpy, from the project's set-up script (None: no python3).
fn python() -> Option<PathBuf> {
    if Command::new("python3").arg("--version").output().is_err() {
        println!("SKIPPED: python3 is absent");
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = std::env::temp_dir().join("trellis-py-venv");
    let out = Command::new("sh")
        .arg(root.join("scripts/py-setup.sh"))
        .arg(&venv)
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "scripts/py-setup.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(PathBuf::from(
        String::from_utf8(out.stdout).unwrap().trim().to_string(),
    ))
}

#[test]
fn python_reproduces_the_logits_of_every_model_on_cora() {
    let Some(data) = cora() else { return };
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pyg_check.py");
    // The paper models, then deeper ones with residual connections (an identity one, and a
    // projection where the widths differ).
    let deep: [&[&str]; 3] = [
        &["--layers", "4", "--residual", "--hidden", "32,32,16"],
        &["--layers", "3", "--residual", "--hidden", "32,16"],
        &["--layers", "3", "--residual", "--hidden", "8,4"],
    ];
    let runs = [
        ("gcn", "200", &[][..]),
        ("sage", "60", &[][..]),
        ("gat", "40", &[][..]),
        ("gcn", "30", deep[0]),
        ("sage", "20", deep[1]),
        ("gat", "10", deep[2]),
    ];
    for (i, (model, epochs, extra)) in runs.into_iter().enumerate() {
        let file = dir.path().join(format!("{model}{i}.safetensors"));
        let logits = dir.path().join(format!("{model}{i}.npy"));
        let mut args = vec![
            "train",
            "--data",
            s(&data),
            "--model",
            model,
            "--epochs",
            epochs,
            "--threads",
            "2",
            "--save-model",
            s(&file),
        ];
        args.extend_from_slice(extra);
        let text = ok(&args);
        assert!(text.contains("model (epoch"), "{text}");
        ok(&[
            "predict",
            "--model",
            s(&file),
            "--data",
            s(&data),
            "--out",
            s(&logits),
        ]);
        let out = Command::new(&py)
            .arg(&script)
            .args([&file, &data, &logits])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}");
        assert!(
            out.status.success(),
            "numpy does not reproduce the {model} {extra:?} logits: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("max |trellis - numpy|"), "{text}");
    }
}

fn read_npy(path: &Path) -> ndarray::Array2<f32> {
    ndarray_npy::read_npy(path).unwrap()
}

#[test]
fn partitioned_prediction_gives_the_same_bytes_and_embeddings_have_their_width() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.safetensors");
    for model in ["gcn", "sage", "gat"] {
        ok(&[
            "train",
            "--data",
            SYNTH,
            "--model",
            model,
            "--epochs",
            "5",
            "--save-model",
            s(&file),
        ]);
        let one = dir.path().join("one.npy");
        let four = dir.path().join("four.npy");
        ok(&[
            "predict",
            "--model",
            s(&file),
            "--data",
            SYNTH,
            "--out",
            s(&one),
        ]);
        ok(&[
            "predict",
            "--model",
            s(&file),
            "--data",
            SYNTH,
            "--out",
            s(&four),
            "--partitions",
            "4",
        ]);
        assert_eq!(
            std::fs::read(&one).unwrap(),
            std::fs::read(&four).unwrap(),
            "{model}: 4 parts differ from one"
        );
        assert_eq!(read_npy(&one).dim(), (400, 4));
        let emb = dir.path().join("emb.npy");
        ok(&[
            "predict",
            "--model",
            s(&file),
            "--data",
            SYNTH,
            "--out",
            s(&emb),
            "--embeddings",
            "0",
        ]);
        let width = if model == "gat" { 64 } else { 16 };
        assert_eq!(read_npy(&emb).dim(), (400, width), "{model}");
    }
}

#[test]
fn best_and_last_epochs_are_saved_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    let best = dir.path().join("best.safetensors");
    let last = dir.path().join("last.safetensors");
    let common = ["train", "--data", SYNTH, "--epochs", "30"];
    let text = ok(&[&common[..], &["--save-model", s(&best)]].concat());
    let text_last = ok(&[
        &common[..],
        &["--save-model", s(&last), "--save-model-at", "last"],
    ]
    .concat());
    assert!(text_last.contains("model (epoch 30)"), "{text_last}");
    let best_epoch: String = text
        .split("best validation epoch ")
        .nth(1)
        .unwrap()
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    assert!(
        text.contains(&format!("model (epoch {best_epoch})")),
        "the saved epoch is the best validation epoch: {text}"
    );
    let bytes = std::fs::read(&best).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().as_ref().unwrap();
    assert_eq!(meta["trellis.model_kind"], "gcn");
    assert_eq!(meta["trellis.layer_sizes"], "16,16,4");
    assert_eq!(meta["trellis.epoch"], best_epoch);
    for k in [
        "trellis.train_config",
        "trellis.data_digest",
        "trellis.weights_digest",
        "trellis.code_version",
        "trellis.heads",
    ] {
        assert!(meta.contains_key(k), "metadata lacks {k}");
    }
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        tensors.tensor("conv1.lin.weight").unwrap().shape(),
        [16, 16]
    );
    assert_eq!(tensors.tensor("conv2.lin.weight").unwrap().shape(), [4, 16]);
    assert_eq!(tensors.tensor("conv2.bias").unwrap().shape(), [4]);
}

/// The metadata of the model file at `path`.
fn metadata(path: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap()
}

/// The tensors of the model file at `path`, by name, as f32 values.
fn tensors(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let t = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    t.tensors()
        .into_iter()
        .map(|(name, v)| {
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, vals)
        })
        .collect()
}

/// The report a `--report` file holds.
fn report(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn a_partitioned_run_saves_its_model_also_with_faults() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["train", "--data", SYNTH, "--epochs", "20"];
    let file = |name: &str| dir.path().join(format!("{name}.safetensors"));
    let rep = |name: &str| dir.path().join(format!("{name}.json"));
    for at in ["best", "last"] {
        fn save<'a>(f: &'a Path, r: &'a Path, at: &'a str) -> [&'a str; 6] {
            [
                "--save-model",
                s(f),
                "--save-model-at",
                at,
                "--report",
                s(r),
            ]
        }
        let (one, parts, faulted) = (file("one"), file("parts"), file("faulted"));
        let (r_one, r_parts, r_faulted) = (rep("one"), rep("parts"), rep("faulted"));
        ok(&[&common[..], &save(&one, &r_one, at)].concat());
        let text = ok(&[
            &common[..],
            &["--partitions", "3"],
            &save(&parts, &r_parts, at),
        ]
        .concat());
        assert!(text.contains("model (epoch "), "{text}");
        // A partition that panics in the backward pass of epoch 3 is restored from its
        // replica; the saved model is the same, bit for bit.
        let chaos = [
            "--partitions",
            "3",
            "--chaos",
            "panic:part=1:epoch=3:layer=1:phase=backward",
        ];
        let text = ok(&[&common[..], &chaos, &save(&faulted, &r_faulted, at)].concat());
        assert!(
            text.contains("recovered:"),
            "the fault did not fire: {text}"
        );
        let (m_parts, m_faulted) = (metadata(&parts), metadata(&faulted));
        assert_eq!(
            m_parts["trellis.weights_digest"], m_faulted["trellis.weights_digest"],
            "{at}: a fault changed the saved model"
        );
        assert!(
            tensors(&parts) == tensors(&faulted),
            "{at}: a fault changed the saved values"
        );
        // The saved epoch is the one the report's test accuracy comes from (or the last).
        let r = report(&r_parts);
        let epoch = match at {
            "best" => r["best_epoch"].to_string(),
            _ => "20".to_string(),
        };
        assert_eq!(m_parts["trellis.epoch"], epoch, "{at}");
        if at == "last" {
            assert_eq!(
                m_parts["trellis.weights_digest"],
                r["weights_digest"].as_str().unwrap(),
                "the last model is the run's final weights"
            );
        }
        // Partitioned training equals one process up to the order of the gradient sums: the
        // same epoch is saved, with the same parameters to 1e-4.
        let m_one = metadata(&one);
        assert_eq!(m_one["trellis.epoch"], m_parts["trellis.epoch"], "{at}");
        assert_eq!(m_one["trellis.data_digest"], m_parts["trellis.data_digest"]);
        let (t_one, t_parts) = (tensors(&one), tensors(&parts));
        assert_eq!(
            t_one.keys().collect::<Vec<_>>(),
            t_parts.keys().collect::<Vec<_>>()
        );
        for (name, a) in &t_one {
            let b = &t_parts[name];
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 1e-4, "{at}: {name} differs by {worst}");
        }
        let _ = std::fs::remove_file(&r_one);
    }
}

/// `bytes` with its metadata entry `key` set to `value`.
fn with_metadata(bytes: &[u8], key: &str, value: &str) -> Vec<u8> {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    meta.insert(key.into(), value.into());
    let t = safetensors::SafeTensors::deserialize(bytes).unwrap();
    safetensors::serialize(t.tensors(), Some(meta)).unwrap()
}

#[test]
fn bad_model_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    ok(&[
        "train",
        "--data",
        SYNTH,
        "--epochs",
        "3",
        "--save-model",
        s(&good),
    ]);
    let bytes = std::fs::read(&good).unwrap();
    let out = dir.path().join("out.npy");
    let check = |name: &str, content: &[u8], want: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, content).unwrap();
        let err = fails(&[
            "predict",
            "--model",
            s(&p),
            "--data",
            SYNTH,
            "--out",
            s(&out),
        ]);
        assert!(
            err.contains(name),
            "{name}: error does not name the file: {err}"
        );
        assert!(err.contains(want), "{name}: expected `{want}` in: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    check(
        "truncated.safetensors",
        &bytes[..bytes.len() - 9],
        "not a safetensors file",
    );
    check("empty.safetensors", b"", "not a safetensors file");
    let mut flipped = bytes.clone();
    let at = bytes.len() - 6;
    flipped[at] ^= 0x40;
    check("flipped.safetensors", &flipped, "corrupt");
    check(
        "kind.safetensors",
        &with_metadata(&bytes, "trellis.model_kind", "gat"),
        "says gat but the model config says gcn",
    );
    // A SAGE model's tensors under a GCN header: the names do not match.
    let sage = dir.path().join("sage.safetensors");
    ok(&[
        "train",
        "--data",
        SYNTH,
        "--model",
        "sage",
        "--epochs",
        "2",
        "--save-model",
        s(&sage),
    ]);
    let sage_bytes = std::fs::read(&sage).unwrap();
    let gcn_cfg = {
        let (_, h) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        h.metadata().as_ref().unwrap()["trellis.model_config"].clone()
    };
    let mixed = with_metadata(
        &with_metadata(&sage_bytes, "trellis.model_kind", "gcn"),
        "trellis.model_config",
        &gcn_cfg,
    );
    check(
        "mixed.safetensors",
        &mixed,
        "tensor `conv1.lin.weight` is missing",
    );
    // The right file for another data set: widths do not fit.
    let err = fails(&[
        "predict",
        "--model",
        s(&good),
        "--data",
        "synthetic:nodes=300,degree=4,features=24,classes=4,seed=1",
        "--out",
        s(&out),
    ]);
    assert!(
        err.contains("good.safetensors")
            && err.contains("takes 16 input features, the data has 24"),
        "{err}"
    );
    let err = fails(&[
        "predict",
        "--model",
        s(&dir.path().join("absent.safetensors")),
        "--data",
        SYNTH,
        "--out",
        s(&out),
    ]);
    assert!(err.contains("absent.safetensors"), "{err}");
}
