//! No allocation bombs: every size a loader derives from its input (an `.npy` header, an
//! `.npz` directory entry) is checked against the file's real size, what an archive entry can
//! expand to, the other arrays' shapes and the machine's memory before anything is allocated.
//! Split masks that make the accuracies mean something else are explained.
use std::io::Write;
use std::path::Path;
use trellis_runtime::DataSource;

/// A version 1.0 `.npy` header for `descr` and `shape` (the data is not included).
fn npy_header(descr: &str, shape: &str) -> Vec<u8> {
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut v = npy_header(descr, shape);
    v.extend_from_slice(data);
    v
}

/// A small valid data set (4 nodes) as `(name, bytes)` pairs.
fn small() -> Vec<(&'static str, Vec<u8>)> {
    let f32s: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let labels: Vec<u8> = [0i64, 1, 0, 1]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let edges: Vec<u8> = [0i64, 1, 2, 1, 2, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    vec![
        ("x.npy", npy("<f4", "(4, 2)", &f32s)),
        ("y.npy", npy("<i8", "(4,)", &labels)),
        ("edge_index.npy", npy("<i8", "(2, 3)", &edges)),
        ("train_mask.npy", npy("|b1", "(4,)", &[1, 1, 0, 0])),
        ("val_mask.npy", npy("|b1", "(4,)", &[0, 0, 1, 0])),
        ("test_mask.npy", npy("|b1", "(4,)", &[0, 0, 0, 1])),
    ]
}

fn write_npz(path: &Path, entries: &[(&str, Vec<u8>)], method: zip::CompressionMethod) {
    let mut z = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default().compression_method(method);
    for (name, bytes) in entries {
        z.start_file(*name, opts).unwrap();
        z.write_all(bytes).unwrap();
    }
    z.finish().unwrap();
}

fn load_err(spec: &Path) -> String {
    DataSource::parse(spec.to_str().unwrap())
        .and_then(|s| s.load())
        .expect_err("must be refused")
        .to_string()
}

#[test]
fn an_npz_directory_claiming_more_than_its_entry_can_hold_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for method in [
        zip::CompressionMethod::Stored,
        zip::CompressionMethod::Deflated,
    ] {
        let path = dir.path().join("claims.npz");
        write_npz(&path, &small(), method);
        // Patch x.npy's uncompressed size to 4 GiB - 1 in both the local header and the
        // central directory, as a hand-made bomb does.
        let mut bytes = std::fs::read(&path).unwrap();
        let claim = u32::MAX.to_le_bytes();
        for (sig, off) in [(b"PK\x03\x04", 22usize), (b"PK\x01\x02", 24usize)] {
            let at = bytes.windows(4).position(|w| w == sig).unwrap();
            bytes[at + off..at + off + 4].copy_from_slice(&claim);
        }
        std::fs::write(&path, &bytes).unwrap();
        let e = load_err(&path);
        assert!(
            e.contains("claims.npz:x.npy")
                && e.contains("4294967295 bytes")
                && e.contains("zip bomb"),
            "{method:?}: {e}"
        );
    }
}

#[test]
fn a_zip_bomb_is_refused_from_the_headers_before_it_is_inflated() {
    // x.npy: 64 MiB of zeros deflated to ~64 KiB, for 16M nodes, while y has 4: the shapes
    // disagree, which the headers alone show.
    let dir = tempfile::tempdir().unwrap();
    let rows = 16 << 20;
    let mut entries = small();
    entries[0] = (
        "x.npy",
        npy("<f4", &format!("({rows}, 1)"), &vec![0u8; rows * 4]),
    );
    let path = dir.path().join("bomb.npz");
    write_npz(&path, &entries, zip::CompressionMethod::Deflated);
    assert!(std::fs::metadata(&path).unwrap().len() < 1 << 20);
    let t = std::time::Instant::now();
    let e = load_err(&path);
    assert!(
        e.contains("bomb.npz:y.npy") && e.contains("4 labels but x.npy has 16777216 rows"),
        "{e}"
    );
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "x was not inflated"
    );
}

#[test]
fn an_array_larger_than_the_machines_memory_is_refused_before_allocation() {
    // A sparse x.npy whose header and size agree on 1 TiB of float32.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("huge");
    std::fs::create_dir_all(&data).unwrap();
    for (name, bytes) in small() {
        std::fs::write(data.join(name), bytes).unwrap();
    }
    let rows: u64 = 1 << 38;
    let header = npy_header("<f4", &format!("({rows}, 1)"));
    let x = data.join("x.npy");
    let mut f = std::fs::File::create(&x).unwrap();
    f.write_all(&header).unwrap();
    if f.set_len(header.len() as u64 + rows * 4).is_err() {
        eprintln!("SKIPPED: this file system cannot hold a sparse 1 TiB file");
        return;
    }
    drop(f);
    let e = load_err(&data);
    assert!(
        e.contains("x.npy") && e.contains("memory available") && e.contains("1099511627776"),
        "{e}"
    );
}

#[test]
fn empty_or_overlapping_masks_are_explained() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("masks");
    std::fs::create_dir_all(&data).unwrap();
    let mut files = small();
    files[4] = ("val_mask.npy", npy("|b1", "(4,)", &[0, 0, 0, 0]));
    files[5] = ("test_mask.npy", npy("|b1", "(4,)", &[1, 0, 0, 1]));
    for (name, bytes) in files {
        std::fs::write(data.join(name), bytes).unwrap();
    }
    let ds = DataSource::parse(data.to_str().unwrap())
        .unwrap()
        .load()
        .unwrap();
    let w = ds.split_warnings().join("\n");
    assert!(w.contains("validation mask is empty"), "{w}");
    assert!(
        w.contains("1 nodes are in both the training and the test mask"),
        "{w}"
    );
    let clean = DataSource::parse("synthetic:nodes=200,degree=4,features=4,classes=2")
        .unwrap()
        .load()
        .unwrap();
    assert!(clean.split_warnings().is_empty());
}
