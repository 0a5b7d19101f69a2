//! Loader tests: good round trips for every source and an error (naming the file and the
//! problem, never a panic) for every kind of bad input.
use flate2::write::GzEncoder;
use flate2::Compression;
use ndarray::{Array1, Array2, ShapeBuilder};
use ndarray_npy::{write_npy, NpzWriter, WritableElement};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use trellis_runtime::data::SyntheticSpec;
use trellis_runtime::{DataSource, Dataset};

// ---------------------------------------------------------------------------------------------
// Helpers

/// A small, valid data set: 6 nodes, 3 features, 3 classes, 7 edges.
fn small() -> Dataset {
    let n = 6;
    let f = 3;
    Dataset {
        name: "small".into(),
        num_nodes: n,
        num_features: f,
        num_classes: 3,
        features: (0..n * f).map(|v| v as f32 * 0.5 - 1.0).collect(),
        labels: vec![0, 1, 2, 0, 1, 2],
        edge_src: vec![0, 1, 2, 3, 4, 5, 0],
        edge_dst: vec![1, 2, 3, 4, 5, 0, 3],
        train_mask: vec![true, true, false, false, false, false],
        val_mask: vec![false, false, true, false, false, false],
        test_mask: vec![false, false, false, true, true, true],
    }
}

fn x_of(d: &Dataset) -> Array2<f32> {
    Array2::from_shape_vec((d.num_nodes, d.num_features), d.features.clone()).unwrap()
}
fn y_of(d: &Dataset) -> Array1<i64> {
    d.labels.iter().map(|&c| c as i64).collect()
}
fn ei_of(d: &Dataset) -> Array2<i64> {
    let e = d.edge_src.len();
    let v: Vec<i64> = d
        .edge_src
        .iter()
        .chain(&d.edge_dst)
        .map(|&v| v as i64)
        .collect();
    Array2::from_shape_vec((2, e), v).unwrap()
}
fn mask(m: &[bool]) -> Array1<bool> {
    m.iter().copied().collect()
}

/// Writes `d` as a PyG export folder `root/name`.
fn write_dir(root: &Path, name: &str, d: &Dataset) -> PathBuf {
    let dir = root.join(name);
    fs::create_dir_all(&dir).unwrap();
    write_npy(dir.join("x.npy"), &x_of(d)).unwrap();
    write_npy(dir.join("y.npy"), &y_of(d)).unwrap();
    write_npy(dir.join("edge_index.npy"), &ei_of(d)).unwrap();
    write_npy(dir.join("train_mask.npy"), &mask(&d.train_mask)).unwrap();
    write_npy(dir.join("val_mask.npy"), &mask(&d.val_mask)).unwrap();
    write_npy(dir.join("test_mask.npy"), &mask(&d.test_mask)).unwrap();
    dir
}

fn npy_bytes<T: ndarray_npy::WriteNpyExt + ?Sized>(a: &T) -> Vec<u8> {
    let mut v = Vec::new();
    a.write_npy(&mut v).unwrap();
    v
}

/// A hand-made `.npy`: any descriptor and shape text, any payload.
fn raw_npy(descr: &str, shape: &str, payload: &[u8]) -> Vec<u8> {
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.extend_from_slice(payload);
    out
}

fn write_array<T: WritableElement, D: ndarray::Dimension>(
    dir: &Path,
    file: &str,
    a: &ndarray::Array<T, D>,
) {
    write_npy(dir.join(file), a).unwrap();
}

/// The error message of loading `src`; panics if it loads.
fn load_err(src: &DataSource) -> String {
    match src.load() {
        Ok(_) => panic!("{src:?} loaded but should have failed"),
        Err(e) => e.to_string(),
    }
}

/// Asserts that `msg` contains every word in `words` (case-insensitive).
fn assert_mentions(msg: &str, words: &[&str]) {
    let low = msg.to_lowercase();
    for w in words {
        assert!(
            low.contains(&w.to_lowercase()),
            "error `{msg}` does not mention `{w}`"
        );
    }
}

/// Makes a fresh copy of the small folder, lets `edit` break it, and checks the error.
fn npy_case(edit: impl FnOnce(&Path), words: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_dir(tmp.path(), "broken", &small());
    edit(&dir);
    let msg = load_err(&DataSource::NpyDir(dir));
    assert_mentions(&msg, words);
}

fn gz(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut e = GzEncoder::new(fs::File::create(path).unwrap(), Compression::default());
    e.write_all(text.as_bytes()).unwrap();
    e.finish().unwrap();
}

fn lines<T: ToString>(v: impl IntoIterator<Item = T>) -> String {
    v.into_iter().map(|t| t.to_string() + "\n").collect()
}

/// Writes `d` as an OGB folder `root/name` with split `split/<split>/`.
fn write_ogb(root: &Path, name: &str, d: &Dataset, with_count: bool) -> PathBuf {
    let dir = root.join(name);
    let raw = dir.join("raw");
    let f = d.num_features;
    let feat: String = d
        .features
        .chunks(f)
        .map(|r| {
            r.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(",")
                + "\n"
        })
        .collect();
    gz(&raw.join("node-feat.csv.gz"), &feat);
    gz(&raw.join("node-label.csv.gz"), &lines(&d.labels));
    let edges: String = d
        .edge_src
        .iter()
        .zip(&d.edge_dst)
        .map(|(s, t)| format!("{s},{t}\n"))
        .collect();
    gz(&raw.join("edge.csv.gz"), &edges);
    if with_count {
        gz(
            &raw.join("num-node-list.csv.gz"),
            &format!("{}\n", d.num_nodes),
        );
    }
    let split = dir.join("split").join("random");
    gz(
        &split.join("train.csv.gz"),
        &lines(Dataset::mask_ids(&d.train_mask)),
    );
    gz(
        &split.join("valid.csv.gz"),
        &lines(Dataset::mask_ids(&d.val_mask)),
    );
    gz(
        &split.join("test.csv.gz"),
        &lines(Dataset::mask_ids(&d.test_mask)),
    );
    dir
}

/// Makes a fresh OGB copy of the small data set, lets `edit` break it, and checks the error.
fn ogb_case(edit: impl FnOnce(&Path), words: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_ogb(tmp.path(), "ogbn_small", &small(), true);
    edit(&dir);
    let msg = load_err(&DataSource::Ogb(dir));
    assert_mentions(&msg, words);
}

fn cut_tail(path: &Path, k: usize) {
    let b = fs::read(path).unwrap();
    fs::write(path, &b[..b.len() - k]).unwrap();
}

// ---------------------------------------------------------------------------------------------
// NumPy folder and archive: good input

#[test]
fn npy_dir_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let d = small();
    let dir = write_dir(tmp.path(), "tiny-set", &d);
    let src = DataSource::parse(dir.to_str().unwrap()).unwrap();
    assert_eq!(src, DataSource::NpyDir(dir.clone()));
    let got = src.load().unwrap();
    assert_eq!(
        got,
        Dataset {
            name: "tiny-set".into(),
            ..d
        }
    );
}

#[test]
fn npy_accepts_int32_labels_float64_features_and_fortran_order() {
    let tmp = tempfile::tempdir().unwrap();
    let d = small();
    let dir = write_dir(tmp.path(), "alt", &d);
    let x64 = x_of(&d).mapv(|v| v as f64);
    // Fortran-ordered copy of the same logical array.
    let mut xf = Array2::<f64>::zeros((d.num_nodes, d.num_features).f());
    xf.assign(&x64);
    write_array(&dir, "x.npy", &xf);
    assert!(String::from_utf8_lossy(&fs::read(dir.join("x.npy")).unwrap()[..80]).contains("True"));
    write_array(&dir, "y.npy", &y_of(&d).mapv(|c| c as i32));
    let ei32 = ei_of(&d).mapv(|v| v as i32);
    write_array(&dir, "edge_index.npy", &ei32);
    let got = DataSource::NpyDir(dir).load().unwrap();
    assert_eq!(
        got,
        Dataset {
            name: "alt".into(),
            ..d.clone()
        }
    );

    // y as [N, 1].
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_dir(tmp.path(), "col", &d);
    let ycol = y_of(&d).into_shape_with_order((d.num_nodes, 1)).unwrap();
    write_array(&dir, "y.npy", &ycol);
    assert_eq!(DataSource::NpyDir(dir).load().unwrap().labels, d.labels);
}

#[test]
fn npz_round_trip_numpy_names_and_bare_compressed_names() {
    let tmp = tempfile::tempdir().unwrap();
    let d = small();
    // As numpy.savez writes it: entries `x.npy`, ...
    let path = tmp.path().join("graph.npz");
    let mut w = NpzWriter::new(fs::File::create(&path).unwrap());
    w.add_array("x", &x_of(&d)).unwrap();
    w.add_array("y", &y_of(&d)).unwrap();
    w.add_array("edge_index", &ei_of(&d)).unwrap();
    w.add_array("train_mask", &mask(&d.train_mask)).unwrap();
    w.add_array("val_mask", &mask(&d.val_mask)).unwrap();
    w.add_array("test_mask", &mask(&d.test_mask)).unwrap();
    w.finish().unwrap();
    let src = DataSource::parse(path.to_str().unwrap()).unwrap();
    assert_eq!(src, DataSource::Npz(path.clone()));
    assert_eq!(
        src.load().unwrap(),
        Dataset {
            name: "graph".into(),
            ..d.clone()
        }
    );

    // Bare entry names, deflate-compressed (numpy.savez_compressed style).
    let path = tmp.path().join("bare.npz");
    let mut z = zip::ZipWriter::new(fs::File::create(&path).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    let entries: Vec<(&str, Vec<u8>)> = vec![
        ("x", npy_bytes(&x_of(&d))),
        ("y", npy_bytes(&y_of(&d))),
        ("edge_index", npy_bytes(&ei_of(&d))),
        ("train_mask", npy_bytes(&mask(&d.train_mask))),
        ("val_mask", npy_bytes(&mask(&d.val_mask))),
        ("test_mask", npy_bytes(&mask(&d.test_mask))),
    ];
    for (name, bytes) in entries {
        z.start_file(name, opts).unwrap();
        z.write_all(&bytes).unwrap();
    }
    z.finish().unwrap();
    assert_eq!(
        DataSource::Npz(path).load().unwrap(),
        Dataset {
            name: "bare".into(),
            ..d
        }
    );
}

#[test]
fn cora_when_present() {
    let dir = Path::new("/work/shared/datasets/cora");
    if !dir.join("x.npy").exists() {
        println!("skipping: {} not present", dir.display());
        return;
    }
    let t = Instant::now();
    let d = DataSource::parse(dir.to_str().unwrap())
        .unwrap()
        .load()
        .unwrap();
    println!("cora loaded in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    assert_eq!(d.name, "cora");
    assert_eq!(
        (d.num_nodes, d.num_features, d.num_classes),
        (2708, 1433, 7)
    );
    assert_eq!(d.edge_src.len(), 10556);
    let count = |m: &[bool]| m.iter().filter(|&&b| b).count();
    assert_eq!(
        (
            count(&d.train_mask),
            count(&d.val_mask),
            count(&d.test_mask)
        ),
        (140, 500, 1000)
    );
    // Raw bag-of-words features: 0/1, not normalised.
    assert!(d.features.iter().all(|&v| v == 0.0 || v == 1.0));
}

// ---------------------------------------------------------------------------------------------
// NumPy folder: bad input

#[test]
fn npy_missing_files() {
    for file in [
        "x.npy",
        "y.npy",
        "edge_index.npy",
        "train_mask.npy",
        "val_mask.npy",
        "test_mask.npy",
    ] {
        npy_case(
            |d| fs::remove_file(d.join(file)).unwrap(),
            &[file, "no such file"],
        );
    }
    let msg = load_err(&DataSource::NpyDir(PathBuf::from(
        "/nonexistent/trellis-data",
    )));
    assert_mentions(&msg, &["trellis-data", "no such"]);
    let err = DataSource::parse("/nonexistent/trellis-data")
        .unwrap_err()
        .to_string();
    assert_mentions(&err, &["trellis-data"]);
}

#[test]
fn npy_wrong_dtypes() {
    let d = small();
    npy_case(
        |p| write_array(p, "x.npy", &x_of(&d).mapv(|v| v as i64)),
        &["x.npy", "dtype int64", "float32"],
    );
    npy_case(
        |p| write_array(p, "x.npy", &x_of(&d).mapv(|v| v as u8)),
        &["x.npy", "dtype"],
    );
    npy_case(
        |p| write_array(p, "edge_index.npy", &ei_of(&d).mapv(|v| v as f32)),
        &["edge_index.npy", "dtype float32"],
    );
    npy_case(
        |p| write_array(p, "y.npy", &y_of(&d).mapv(|v| v as f64)),
        &["y.npy", "dtype float64"],
    );
    npy_case(
        |p| write_array(p, "train_mask.npy", &y_of(&d)),
        &["train_mask.npy", "dtype int64", "bool"],
    );
    npy_case(
        |p| fs::write(p.join("x.npy"), raw_npy("<U3", "(6, 3)", &[0; 18 * 12])).unwrap(),
        &["x.npy", "dtype"],
    );
}

#[test]
fn npy_wrong_shapes() {
    let d = small();
    npy_case(
        |p| write_array(p, "x.npy", &Array1::<f32>::zeros(18)),
        &["x.npy", "shape", "2-D"],
    );
    npy_case(
        |p| write_array(p, "x.npy", &ndarray::Array3::<f32>::zeros((6, 3, 1))),
        &["x.npy", "shape"],
    );
    npy_case(
        |p| write_array(p, "x.npy", &Array2::<f32>::zeros((0, 3))),
        &["x.npy", "empty"],
    );
    npy_case(
        |p| write_array(p, "edge_index.npy", &Array2::<i64>::zeros((3, 4))),
        &["edge_index.npy", "shape", "[2, num_edges]"],
    );
    npy_case(
        |p| write_array(p, "edge_index.npy", &ei_of(&d).reversed_axes().to_owned()),
        &["edge_index.npy", "shape"],
    );
    npy_case(
        |p| write_array(p, "edge_index.npy", &Array1::<i64>::zeros(14)),
        &["edge_index.npy", "shape"],
    );
    npy_case(
        |p| write_array(p, "y.npy", &Array2::<i64>::zeros((6, 2))),
        &["y.npy", "shape"],
    );
    npy_case(
        |p| write_array(p, "val_mask.npy", &Array2::<bool>::from_elem((6, 1), false)),
        &["val_mask.npy", "shape"],
    );
}

#[test]
fn npy_node_counts_differ() {
    npy_case(
        |p| write_array(p, "y.npy", &Array1::<i64>::zeros(5)),
        &["y.npy", "mismatch", "5 labels", "6 rows"],
    );
    npy_case(
        |p| write_array(p, "train_mask.npy", &Array1::from_elem(7, false)),
        &["train_mask.npy", "mismatch"],
    );
    npy_case(
        |p| write_array(p, "test_mask.npy", &Array1::from_elem(2, true)),
        &["test_mask.npy", "mismatch"],
    );
}

#[test]
fn npy_bad_labels() {
    let mut y = y_of(&small());
    y[3] = -1;
    npy_case(
        |p| write_array(p, "y.npy", &y),
        &["y.npy", "negative label -1", "node 3"],
    );
    let mut y = y_of(&small());
    y[2] = 1 << 40;
    npy_case(|p| write_array(p, "y.npy", &y), &["y.npy", "out of range"]);
}

#[test]
fn npy_bad_edge_ids() {
    let mut ei = ei_of(&small());
    ei[[1, 2]] = -4;
    npy_case(
        |p| write_array(p, "edge_index.npy", &ei),
        &["edge_index.npy", "negative node id -4", "[1, 2]"],
    );
    let mut ei = ei_of(&small());
    ei[[0, 5]] = 6;
    npy_case(
        |p| write_array(p, "edge_index.npy", &ei),
        &["edge_index.npy", "out of range", "6 nodes"],
    );
    let mut ei = ei_of(&small()).mapv(|v| v as i32);
    ei[[0, 0]] = i32::MAX;
    npy_case(
        |p| write_array(p, "edge_index.npy", &ei),
        &["edge_index.npy", "out of range"],
    );
}

#[test]
fn npy_non_finite_features() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x = x_of(&small());
        x[[4, 1]] = bad;
        npy_case(
            |p| write_array(p, "x.npy", &x),
            &["x.npy", "non-finite", "node 4", "feature 1"],
        );
    }
    // A float64 value beyond float32 range.
    let mut x = x_of(&small()).mapv(|v| v as f64);
    x[[0, 0]] = 1e300;
    npy_case(|p| write_array(p, "x.npy", &x), &["x.npy", "non-finite"]);
}

#[test]
fn npy_truncated_and_corrupt_files() {
    // Cut the data.
    npy_case(|p| cut_tail(&p.join("x.npy"), 5), &["x.npy", "truncated"]);
    npy_case(
        |p| cut_tail(&p.join("edge_index.npy"), 8),
        &["edge_index.npy", "truncated"],
    );
    npy_case(
        |p| cut_tail(&p.join("test_mask.npy"), 1),
        &["test_mask.npy", "truncated"],
    );
    // Cut inside the header.
    npy_case(
        |p| {
            let b = fs::read(p.join("y.npy")).unwrap();
            fs::write(p.join("y.npy"), &b[..30]).unwrap();
        },
        &["y.npy", "truncated"],
    );
    npy_case(
        |p| fs::write(p.join("y.npy"), b"").unwrap(),
        &["y.npy", "truncated"],
    );
    // Extra bytes after the data.
    npy_case(
        |p| {
            let mut b = fs::read(p.join("x.npy")).unwrap();
            b.extend_from_slice(&[0; 4]);
            fs::write(p.join("x.npy"), b).unwrap();
        },
        &["x.npy", "extra bytes"],
    );
    // Not an .npy file at all.
    npy_case(
        |p| fs::write(p.join("x.npy"), b"hello, this is not numpy data at all").unwrap(),
        &["x.npy", "not a valid .npy"],
    );
    // A header whose shape claims far more data than the file holds: no giant allocation.
    npy_case(
        |p| {
            fs::write(
                p.join("x.npy"),
                raw_npy("<f4", "(4000000000000, 3)", &[0; 72]),
            )
            .unwrap()
        },
        &["x.npy", "truncated"],
    );
    npy_case(
        |p| {
            fs::write(
                p.join("x.npy"),
                raw_npy("<f4", "(18446744073709551615, 18446744073709551615)", &[]),
            )
            .unwrap()
        },
        &["x.npy", "too large"],
    );
    // A malformed header dictionary.
    npy_case(
        |p| fs::write(p.join("x.npy"), raw_npy("<f4", "(6, 3", &[0; 72])).unwrap(),
        &["x.npy", "not a valid .npy"],
    );
    // A bool mask holding a byte that is not 0 or 1.
    npy_case(
        |p| {
            fs::write(
                p.join("val_mask.npy"),
                raw_npy("|b1", "(6,)", &[0, 1, 2, 0, 0, 0]),
            )
            .unwrap()
        },
        &["val_mask.npy", "invalid data"],
    );
    // A directory where a file should be.
    npy_case(
        |p| {
            fs::remove_file(p.join("x.npy")).unwrap();
            fs::create_dir(p.join("x.npy")).unwrap();
        },
        &["x.npy"],
    );
}

// ---------------------------------------------------------------------------------------------
// NumPy archive: bad input

fn write_npz(path: &Path, d: &Dataset, skip: &str, replace: Option<(&str, Vec<u8>)>) {
    let mut z = zip::ZipWriter::new(fs::File::create(path).unwrap());
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let entries: Vec<(&str, Vec<u8>)> = vec![
        ("x", npy_bytes(&x_of(d))),
        ("y", npy_bytes(&y_of(d))),
        ("edge_index", npy_bytes(&ei_of(d))),
        ("train_mask", npy_bytes(&mask(&d.train_mask))),
        ("val_mask", npy_bytes(&mask(&d.val_mask))),
        ("test_mask", npy_bytes(&mask(&d.test_mask))),
    ];
    for (name, mut bytes) in entries {
        if name == skip {
            continue;
        }
        if let Some((r, b)) = &replace {
            if *r == name {
                bytes = b.clone();
            }
        }
        z.start_file(format!("{name}.npy"), opts).unwrap();
        z.write_all(&bytes).unwrap();
    }
    z.finish().unwrap();
}

#[test]
fn npz_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let d = small();
    let p = tmp.path().join("data.npz");

    let msg = load_err(&DataSource::Npz(tmp.path().join("absent.npz")));
    assert_mentions(&msg, &["absent.npz", "no such file"]);

    write_npz(&p, &d, "y", None);
    assert_mentions(
        &load_err(&DataSource::Npz(p.clone())),
        &["data.npz", "y.npy", "missing array"],
    );

    write_npz(
        &p,
        &d,
        "",
        Some(("x", npy_bytes(&x_of(&d).mapv(|v| v as i64)))),
    );
    assert_mentions(
        &load_err(&DataSource::Npz(p.clone())),
        &["data.npz:x.npy", "dtype int64"],
    );

    let mut ei = ei_of(&d);
    ei[[0, 0]] = 99;
    write_npz(&p, &d, "", Some(("edge_index", npy_bytes(&ei))));
    assert_mentions(
        &load_err(&DataSource::Npz(p.clone())),
        &["data.npz:edge_index.npy", "out of range"],
    );

    let mut b = npy_bytes(&x_of(&d));
    b.truncate(b.len() - 3);
    write_npz(&p, &d, "", Some(("x", b)));
    assert_mentions(
        &load_err(&DataSource::Npz(p.clone())),
        &["data.npz:x.npy", "truncated"],
    );

    // The archive itself cut short or not a zip at all.
    write_npz(&p, &d, "", None);
    cut_tail(&p, 30);
    assert_mentions(
        &load_err(&DataSource::Npz(p.clone())),
        &["data.npz", "not a valid .npz"],
    );
    fs::write(&p, b"definitely not a zip archive").unwrap();
    assert_mentions(
        &load_err(&DataSource::Npz(p.clone())),
        &["data.npz", "not a valid .npz"],
    );
}

// ---------------------------------------------------------------------------------------------
// OGB folder

#[test]
fn ogb_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let d = small();
    for with_count in [true, false] {
        let dir = write_ogb(
            tmp.path(),
            &format!("ogbn_small_{with_count}"),
            &d,
            with_count,
        );
        let src = DataSource::parse(dir.to_str().unwrap()).unwrap();
        assert_eq!(src, DataSource::Ogb(dir.clone()));
        let got = src.load().unwrap();
        assert_eq!(
            got,
            Dataset {
                name: format!("ogbn_small_{with_count}"),
                ..d.clone()
            }
        );
    }
}

#[test]
fn ogb_nan_labels_are_unlabeled_and_crlf_is_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let d = small();
    let dir = write_ogb(tmp.path(), "ogbn_nan", &d, true);
    // Node 1 (train) and node 2 (val) unlabeled; drop them from the splits.
    gz(
        &dir.join("raw/node-label.csv.gz"),
        "0\r\nnan\r\nNaN\r\n0\r\n1\r\n2.0\r\n",
    );
    gz(&dir.join("split/random/train.csv.gz"), "0\n");
    gz(&dir.join("split/random/valid.csv.gz"), "3\n");
    let got = DataSource::Ogb(dir.clone()).load().unwrap();
    assert_eq!(got.labels, vec![0, 0, 0, 0, 1, 2]);
    assert_eq!(Dataset::mask_ids(&got.train_mask), vec![0]);
    assert_eq!(Dataset::mask_ids(&got.val_mask), vec![3]);
    // An unlabeled node listed in a split is an error.
    gz(&dir.join("split/random/valid.csv.gz"), "3\n2\n");
    assert_mentions(
        &load_err(&DataSource::Ogb(dir)),
        &["valid.csv.gz", "line 2", "node 2 has no label"],
    );
}

#[test]
fn ogb_large_input_spans_blocks() {
    // More than one decompression block (8 MiB) of features, to exercise the block seams.
    let tmp = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec {
        nodes: 25_000,
        degree: 6,
        features: 64,
        classes: 5,
        seed: 3,
    };
    let d = DataSource::Synthetic(spec).load().unwrap();
    let dir = write_ogb(tmp.path(), "ogbn_big", &d, false);
    let t = Instant::now();
    let got = DataSource::Ogb(dir).load().unwrap();
    println!("ogb 25k x 64 loaded in {:.2} s", t.elapsed().as_secs_f64());
    assert_eq!(got.features, d.features); // f32 Display round-trips exactly
    assert_eq!(got.labels, d.labels);
    assert_eq!((got.edge_src, got.edge_dst), (d.edge_src, d.edge_dst));
    assert_eq!(got.test_mask, d.test_mask);
}

#[test]
fn ogb_missing_files() {
    for file in [
        "raw/node-feat.csv.gz",
        "raw/node-label.csv.gz",
        "raw/edge.csv.gz",
        "split/random/train.csv.gz",
        "split/random/valid.csv.gz",
        "split/random/test.csv.gz",
    ] {
        ogb_case(
            |d| fs::remove_file(d.join(file)).unwrap(),
            &[file.rsplit('/').next().unwrap(), "no such file"],
        );
    }
    ogb_case(
        |d| fs::remove_dir_all(d.join("split/random")).unwrap(),
        &["split", "no split folder"],
    );
    ogb_case(
        |d| fs::create_dir_all(d.join("split/other")).unwrap(),
        &["split", "several split folders", "other", "random"],
    );
}

#[test]
fn ogb_corrupt_gzip() {
    ogb_case(
        |d| fs::write(d.join("raw/edge.csv.gz"), b"0,1\n1,2\n").unwrap(),
        &["edge.csv.gz", "gzip"],
    );
    ogb_case(
        |d| {
            fs::write(
                d.join("raw/node-feat.csv.gz"),
                [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6, 7, 8],
            )
            .unwrap()
        },
        &["node-feat.csv.gz", "gzip"],
    );
    ogb_case(
        |d| cut_tail(&d.join("raw/node-label.csv.gz"), 6),
        &["node-label.csv.gz", "gzip"],
    );
    ogb_case(
        |d| {
            let p = d.join("raw/node-feat.csv.gz");
            let b = fs::read(&p).unwrap();
            fs::write(&p, &b[..b.len() / 2]).unwrap();
        },
        &["node-feat.csv.gz", "truncated gzip"],
    );
    ogb_case(
        |d| {
            // Flip a byte of the compressed payload: bad deflate data or a checksum mismatch.
            let p = d.join("raw/edge.csv.gz");
            let mut b = fs::read(&p).unwrap();
            let k = b.len() / 2;
            b[k] ^= 0x55;
            fs::write(&p, b).unwrap();
        },
        &["edge.csv.gz", "gzip"],
    );
    ogb_case(
        |d| fs::write(d.join("split/random/test.csv.gz"), b"").unwrap_or(()),
        &[],
    );
}

#[test]
fn ogb_malformed_lines() {
    let feat_path = "raw/node-feat.csv.gz";
    let good_feat = "0,0,0\n1,1,1\n2,2,2\n3,3,3\n4,4,4\n5,5,5\n";
    let with = |text: &'static str, file: &'static str| move |d: &Path| gz(&d.join(file), text);

    ogb_case(
        with("0,0,0\n1,1\n2,2,2\n3,3,3\n4,4,4\n5,5,5\n", feat_path),
        &["node-feat.csv.gz", "line 2", "expected 3"],
    );
    ogb_case(
        with("0,0,0\n1,1,1,1\n2,2,2\n3,3,3\n4,4,4\n5,5,5\n", feat_path),
        &["node-feat.csv.gz", "line 2", "expected 3"],
    );
    ogb_case(
        with("0,0,0\n1,1,1\n2,abc,2\n3,3,3\n4,4,4\n5,5,5\n", feat_path),
        &[
            "node-feat.csv.gz",
            "line 3",
            "malformed number `abc`",
            "column 2",
        ],
    );
    ogb_case(
        with("0,0,0\n1,1,1\n2,2,2\n3,nan,3\n4,4,4\n5,5,5\n", feat_path),
        &["node-feat.csv.gz", "line 4", "non-finite"],
    );
    ogb_case(
        with("0,0,0\n1,1,1\n2,2,2\n3,3,3\n4,4,inf\n5,5,5\n", feat_path),
        &["node-feat.csv.gz", "line 5", "non-finite"],
    );
    ogb_case(
        with("0,0,0\n1,1,1\n\n2,2,2\n3,3,3\n4,4,4\n5,5,5\n", feat_path),
        &["node-feat.csv.gz", "line 3", "empty line"],
    );
    ogb_case(with("", feat_path), &["node-feat.csv.gz", "empty"]);
    ogb_case(
        with("0,0,0\n1,1,1\n2,2,2\n", feat_path),
        &["node-feat.csv.gz", "mismatch", "3 rows", "says 6"],
    );
    ogb_case(
        |d| {
            fs::remove_file(d.join("raw/num-node-list.csv.gz")).unwrap();
            gz(&d.join(feat_path), "0,0,0\n1,1,1\n2,2,2\n");
        },
        &["node-label.csv.gz", "mismatch", "6 labels", "3 rows"],
    );
    let _ = good_feat;

    let label = "raw/node-label.csv.gz";
    ogb_case(
        with("0\n1\n-2\n0\n1\n2\n", label),
        &["node-label.csv.gz", "line 3", "negative label -2"],
    );
    ogb_case(
        with("0\n1\n2\n0\ncat\n2\n", label),
        &["node-label.csv.gz", "line 5", "malformed label"],
    );
    ogb_case(
        with("0\n1\n2\n0\n1\n99999999999\n", label),
        &["node-label.csv.gz", "line 6", "out of range"],
    );
    ogb_case(
        with("0,1\n1,0\n2,0\n0,1\n1,1\n2,0\n", label),
        &["node-label.csv.gz", "line 1", "multi-label"],
    );
    ogb_case(
        with("0\n1\n2\n0\n1\n", label),
        &["node-label.csv.gz", "mismatch"],
    );

    let edge = "raw/edge.csv.gz";
    ogb_case(
        with("0,1\n1,2\n2;3\n", edge),
        &["edge.csv.gz", "line 3", "malformed"],
    );
    ogb_case(
        with("0,1\n1,2,3\n", edge),
        &["edge.csv.gz", "line 2", "malformed"],
    );
    ogb_case(
        with("0,1\nx,2\n", edge),
        &["edge.csv.gz", "line 2", "malformed node id `x`"],
    );
    ogb_case(
        with("0,1\n1,-1\n", edge),
        &["edge.csv.gz", "line 2", "negative node id -1"],
    );
    ogb_case(
        with("0,1\n1,2\n6,0\n", edge),
        &["edge.csv.gz", "line 3", "out of range", "6 nodes"],
    );
    ogb_case(
        with("0,1\n1,2\n3,4\n5,0\n0,1\n1,2\n1.5,2\n", edge),
        &["edge.csv.gz", "line 7", "malformed"],
    );

    ogb_case(
        with("0\n1\n17\n", "split/random/train.csv.gz"),
        &["train.csv.gz", "line 3", "out of range"],
    );
    ogb_case(
        with("0\n-1\n", "split/random/test.csv.gz"),
        &["test.csv.gz", "line 2", "negative"],
    );
    ogb_case(
        with("2\nfoo\n", "split/random/valid.csv.gz"),
        &["valid.csv.gz", "line 2", "malformed"],
    );

    ogb_case(
        with("", "raw/num-node-list.csv.gz"),
        &["num-node-list.csv.gz", "empty"],
    );
    ogb_case(
        with("6\n4\n", "raw/num-node-list.csv.gz"),
        &["num-node-list.csv.gz", "graphs"],
    );
    ogb_case(
        with("six\n", "raw/num-node-list.csv.gz"),
        &["num-node-list.csv.gz", "line 1", "malformed"],
    );
    ogb_case(
        with("-6\n", "raw/num-node-list.csv.gz"),
        &["num-node-list.csv.gz", "line 1", "negative node count"],
    );

    // Not UTF-8.
    ogb_case(
        |d| {
            let p = d.join("raw/edge.csv.gz");
            let mut e = GzEncoder::new(fs::File::create(&p).unwrap(), Compression::default());
            e.write_all(b"0,1\n\xff\xfe,2\n").unwrap();
            e.finish().unwrap();
        },
        &["edge.csv.gz", "line 2", "utf-8"],
    );
}

// ---------------------------------------------------------------------------------------------
// Synthetic

fn spec(s: &str) -> SyntheticSpec {
    match DataSource::parse(s).unwrap() {
        DataSource::Synthetic(sp) => sp,
        other => panic!("{other:?}"),
    }
}

#[test]
fn synthetic_is_deterministic_for_a_seed_and_thread_count_independent() {
    let s = spec("synthetic:nodes=5000,degree=9,features=16,classes=5,seed=42");
    let a = DataSource::Synthetic(s.clone()).load().unwrap();
    let b = DataSource::Synthetic(s.clone()).load().unwrap();
    assert_eq!(a, b);
    assert_eq!(a.digest(), b.digest());
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let c = pool.install(|| DataSource::Synthetic(s.clone()).load().unwrap());
        assert_eq!(a, c, "{threads} threads");
    }
    let other = DataSource::Synthetic(SyntheticSpec {
        seed: 43,
        ..s.clone()
    })
    .load()
    .unwrap();
    assert_ne!(a.digest(), other.digest());
    assert_ne!(a.labels, other.labels);
    assert_ne!(a.features, other.features);
    assert_ne!(a.edge_dst, other.edge_dst);
    assert_eq!(
        a.name,
        "synthetic:nodes=5000,degree=9,features=16,classes=5,seed=42"
    );
}

#[test]
fn synthetic_structure() {
    let s = spec("synthetic:nodes=20000,degree=10,features=32,classes=8,seed=7");
    let d = DataSource::Synthetic(s).load().unwrap();
    let n = d.num_nodes as f64;
    assert_eq!((d.num_nodes, d.num_features, d.num_classes), (20000, 32, 8));
    // degree / 2 out-edges per node; no self loops.
    assert_eq!(d.edge_src.len(), 20000 * 5);
    assert!(d.edge_src.iter().zip(&d.edge_dst).all(|(s, t)| s != t));
    // Homophily: about 0.8 + 0.2 / C of edges join equal labels (less the label noise).
    let same = d
        .edge_src
        .iter()
        .zip(&d.edge_dst)
        .filter(|(&s, &t)| d.labels[s as usize] == d.labels[t as usize])
        .count();
    let h = same as f64 / d.edge_src.len() as f64;
    assert!((0.6..0.8).contains(&h), "homophily {h}");
    // Masks: disjoint, covering, about 10/10/80.
    for i in 0..d.num_nodes {
        assert_eq!(
            d.train_mask[i] as u8 + d.val_mask[i] as u8 + d.test_mask[i] as u8,
            1
        );
    }
    let frac = |m: &[bool]| m.iter().filter(|&&b| b).count() as f64 / n;
    assert!((frac(&d.train_mask) - 0.1).abs() < 0.01);
    assert!((frac(&d.val_mask) - 0.1).abs() < 0.01);
    // Every class is used, roughly uniformly.
    let mut counts = vec![0usize; 8];
    d.labels.iter().for_each(|&c| counts[c as usize] += 1);
    assert!(
        counts
            .iter()
            .all(|&k| (k as f64 - n / 8.0).abs() < n / 8.0 * 0.1),
        "{counts:?}"
    );
    // Features are finite and non-negative, so row normalisation is well defined.
    assert!(d.features.iter().all(|&v| v.is_finite() && v >= 0.0));
}

#[test]
fn synthetic_edge_cases() {
    // Odd degree: half the nodes take one extra out-edge.
    let d = DataSource::Synthetic(spec("synthetic:nodes=10000,degree=5,features=4,classes=3"))
        .load()
        .unwrap();
    let e = d.edge_src.len() as f64 / 10000.0;
    assert!((e - 2.5).abs() < 0.05, "{e}");
    // One node: no edges; two nodes: every edge joins them.
    let d = DataSource::Synthetic(spec("synthetic:nodes=1,degree=4,features=2,classes=2"))
        .load()
        .unwrap();
    assert!(d.edge_src.is_empty());
    let d = DataSource::Synthetic(spec("synthetic:nodes=2,degree=6,features=2,classes=5"))
        .load()
        .unwrap();
    assert_eq!(d.edge_src.len(), 6);
    assert!(d.edge_src.iter().zip(&d.edge_dst).all(|(s, t)| s != t));
    // Degree 0: no edges; more classes than nodes.
    let d = DataSource::Synthetic(spec("synthetic:nodes=3,degree=0,features=1,classes=10"))
        .load()
        .unwrap();
    assert!(d.edge_src.is_empty());
    assert_eq!(d.num_classes, 10);
    // Fields set directly (not parsed) are checked too.
    let bad = SyntheticSpec {
        nodes: 0,
        ..SyntheticSpec::default()
    };
    assert!(DataSource::Synthetic(bad).load().is_err());
    let bad = SyntheticSpec {
        classes: 1 << 20,
        ..SyntheticSpec::default()
    };
    assert_mentions(
        &DataSource::Synthetic(bad).load().unwrap_err().to_string(),
        &["classes"],
    );
    let huge = SyntheticSpec {
        nodes: 1 << 31,
        features: 1 << 31,
        ..SyntheticSpec::default()
    };
    assert_mentions(
        &DataSource::Synthetic(huge).load().unwrap_err().to_string(),
        &["too large"],
    );
}

#[test]
fn synthetic_spec_parser() {
    let s = spec("synthetic:seed=9,classes=3");
    assert_eq!(
        s,
        SyntheticSpec {
            seed: 9,
            classes: 3,
            ..SyntheticSpec::default()
        }
    );
    assert_eq!(spec("synthetic"), SyntheticSpec::default());
    assert_eq!(spec(&s.to_spec_string()), s);
    for (bad, word) in [
        ("synthetic:nodes=10,colour=3", "unknown key `colour`"),
        ("synthetic:nodes=ten", "not a number"),
        ("synthetic:nodes=-5", "not a number"),
        ("synthetic:nodes", "not key=value"),
        ("synthetic:nodes=0", "must be > 0"),
        ("synthetic:classes=0", "must be > 0"),
        ("synthetic:features=0", "must be > 0"),
    ] {
        let msg = DataSource::parse(bad).unwrap_err().to_string();
        assert_mentions(&msg, &[word]);
    }
}

/// A cheap stand-in for a 2-layer GCN: propagate row-normalised features twice with mean
/// aggregation over the symmetrised graph with self loops (SGC-like), then classify by the nearest training
/// class mean. Returns (features-only accuracy, propagated accuracy) on the test mask.
fn proxy_accuracy(d: &Dataset) -> (f64, f64) {
    let (n, f) = (d.num_nodes, d.num_features);
    // Row normalisation, as the trainer does by default.
    let mut x = d.clone();
    for row in x.features.chunks_mut(f) {
        let s: f32 = row.iter().sum();
        if s != 0.0 {
            row.iter_mut().for_each(|v| *v /= s);
        }
    }
    let mut deg = vec![1.0f32; n];
    for (&s, &t) in d.edge_src.iter().zip(&d.edge_dst) {
        deg[s as usize] += 1.0;
        deg[t as usize] += 1.0;
    }
    let prop = |h: &[f32]| {
        let mut out: Vec<f32> = h.to_vec();
        for (&s, &t) in d.edge_src.iter().zip(&d.edge_dst) {
            let (s, t) = (s as usize, t as usize);
            for j in 0..f {
                out[s * f + j] += h[t * f + j];
                out[t * f + j] += h[s * f + j];
            }
        }
        out.iter_mut()
            .enumerate()
            .for_each(|(k, v)| *v /= deg[k / f]);
        out
    };
    let nearest_mean = |h: &[f32]| {
        let c = d.num_classes;
        let mut mean = vec![0.0f64; c * f];
        let mut cnt = vec![0usize; c];
        for i in Dataset::mask_ids(&d.train_mask) {
            let i = i as usize;
            let y = d.labels[i] as usize;
            cnt[y] += 1;
            for j in 0..f {
                mean[y * f + j] += h[i * f + j] as f64;
            }
        }
        for y in 0..c {
            for j in 0..f {
                mean[y * f + j] /= cnt[y].max(1) as f64;
            }
        }
        let test = Dataset::mask_ids(&d.test_mask);
        let ok = test
            .iter()
            .filter(|&&i| {
                let i = i as usize;
                let best = (0..c)
                    .map(|y| {
                        (0..f)
                            .map(|j| (h[i * f + j] as f64 - mean[y * f + j]).powi(2))
                            .sum::<f64>()
                    })
                    .enumerate()
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .unwrap()
                    .0;
                best == d.labels[i] as usize
            })
            .count();
        ok as f64 / test.len() as f64
    };
    let h1 = prop(&x.features);
    let h2 = prop(&h1);
    (nearest_mean(&x.features), nearest_mean(&h2))
}

#[test]
fn synthetic_is_learnable_but_not_trivial() {
    let d = DataSource::Synthetic(SyntheticSpec::default())
        .load()
        .unwrap();
    let (feat, graph) = proxy_accuracy(&d);
    println!(
        "default spec: features-only {feat:.3}, propagated {graph:.3} (chance {:.3})",
        1.0 / d.num_classes as f64
    );
    assert!(feat > 1.5 / d.num_classes as f64, "{feat}");
    assert!(
        graph > feat + 0.05 && (0.6..0.95).contains(&graph),
        "{graph}"
    );
}

/// Prints the proxy accuracy for several specs (run with `--ignored --nocapture`).
#[test]
#[ignore]
fn synthetic_difficulty_survey() {
    for s in [
        "synthetic:nodes=10000,degree=10,features=64,classes=8",
        "synthetic:nodes=10000,degree=4,features=64,classes=8",
        "synthetic:nodes=10000,degree=20,features=128,classes=16",
        "synthetic:nodes=10000,degree=10,features=8,classes=4",
        "synthetic:nodes=10000,degree=10,features=512,classes=40",
        "synthetic:nodes=50000,degree=2,features=32,classes=8",
    ] {
        let d = DataSource::parse(s).unwrap().load().unwrap();
        let (feat, graph) = proxy_accuracy(&d);
        println!(
            "{s}: features-only {feat:.3}, propagated {graph:.3}, chance {:.3}",
            1.0 / d.num_classes as f64
        );
    }
}

/// The 1M-node generation benchmark (run in release: `cargo test --release --test loaders --
/// --ignored synthetic_million --nocapture`).
#[test]
#[ignore]
fn synthetic_million_nodes_timing() {
    let s = spec("synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=1");
    for threads in [2, rayon::current_num_threads()] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let t = Instant::now();
        let d = pool.install(|| DataSource::Synthetic(s.clone()).load().unwrap());
        println!(
            "nodes=1000000,degree=20,features=128,classes=16 on {threads} threads: {:.2} s ({} edges)",
            t.elapsed().as_secs_f64(),
            d.edge_src.len()
        );
    }
}
