//! Table-driven bad input, as a user feeds it to the real binary: allocation bombs in data
//! files, corrupt or foreign partition folders and checkpoints, key overwrites. Every case
//! must exit non-zero with an error naming the file or flag and the problem, never panic or
//! abort, and finish in bounded time.
mod binary;

use binary::trellis;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const DATA: &str = "synthetic:nodes=300,degree=4,features=6,classes=3,seed=2";

fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.extend_from_slice(data);
    out
}

/// An `.npz` of a 4-node data set whose `x.npy` is replaced by `x`.
fn npz(path: &Path, x: Vec<u8>) {
    let labels: Vec<u8> = [0i64, 1, 0, 1]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let edges: Vec<u8> = [0i64, 1, 1, 2]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let entries = [
        ("x.npy", x),
        ("y.npy", npy("<i8", "(4,)", &labels)),
        ("edge_index.npy", npy("<i8", "(2, 2)", &edges)),
        ("train_mask.npy", npy("|b1", "(4,)", &[1, 1, 0, 0])),
        ("val_mask.npy", npy("|b1", "(4,)", &[0, 0, 1, 0])),
        ("test_mask.npy", npy("|b1", "(4,)", &[0, 0, 0, 1])),
    ];
    let mut z = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for (name, bytes) in entries {
        z.start_file(name, opts).unwrap();
        z.write_all(&bytes).unwrap();
    }
    z.finish().unwrap();
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

fn run(args: &[String]) -> std::process::Output {
    trellis().args(args).output().unwrap()
}

/// Partitions DATA into `dir` (2 parts) and trains 2 epochs, checkpointing every epoch.
fn trained(dir: &Path) -> (PathBuf, PathBuf) {
    let (parts, ck) = (dir.join("parts"), dir.join("ck"));
    let args: Vec<String> = [
        "train",
        "--data",
        DATA,
        "--partitions",
        "2",
        "--epochs",
        "2",
        "--partition-dir",
        &s(&parts),
        "--checkpoint-dir",
        &s(&ck),
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1",
    ]
    .map(String::from)
    .to_vec();
    let out = run(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (parts, ck)
}

struct Case {
    name: &'static str,
    /// Prepares files in the folder and returns the command line.
    setup: fn(&Path) -> Vec<String>,
    /// What the error must say.
    expect: &'static [&'static str],
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|a| a.to_string()).collect()
}

const CASES: &[Case] = &[
    Case {
        name: "npz directory claiming 4 GiB for x.npy",
        setup: |d| {
            let p = d.join("claims.npz");
            npz(&p, npy("<f4", "(4, 1)", &[0; 16]));
            let mut b = std::fs::read(&p).unwrap();
            for (sig, off) in [(b"PK\x03\x04", 22usize), (b"PK\x01\x02", 24usize)] {
                let at = b.windows(4).position(|w| w == sig).unwrap();
                b[at + off..at + off + 4].copy_from_slice(&u32::MAX.to_le_bytes());
            }
            std::fs::write(&p, b).unwrap();
            strings(&["train", "--data", &s(&p), "--epochs", "1"])
        },
        expect: &["claims.npz:x.npy", "zip bomb"],
    },
    Case {
        name: "zip bomb: 64 MiB of x for 16M nodes, 4 labels",
        setup: |d| {
            let p = d.join("bomb.npz");
            npz(&p, npy("<f4", "(16777216, 1)", &vec![0; 64 << 20]));
            strings(&["train", "--data", &s(&p), "--epochs", "1"])
        },
        expect: &["bomb.npz:y.npy", "4 labels but x.npy has 16777216 rows"],
    },
    Case {
        name: "corrupt partition.json",
        setup: |d| {
            let (parts, _) = trained(d);
            let book = parts.join("partition.json");
            let t = std::fs::read_to_string(&book).unwrap();
            std::fs::write(&book, t.replacen("\"edge_cut\": ", "\"edge_cut\": 9", 1)).unwrap();
            strings(&[
                "train",
                "--data",
                DATA,
                "--partitions",
                "2",
                "--epochs",
                "1",
                "--partition-dir",
                &s(&parts),
            ])
        },
        expect: &["partition.json", "corrupt", "--repartition"],
    },
    Case {
        name: "partition folder holding another partitioning",
        setup: |d| {
            let (parts, _) = trained(d);
            strings(&[
                "train",
                "--data",
                DATA,
                "--partitions",
                "3",
                "--epochs",
                "1",
                "--partition-dir",
                &s(&parts),
            ])
        },
        expect: &["2 parts, not 3", "--repartition"],
    },
    Case {
        name: "the only checkpoint has a flipped bit",
        setup: |d| {
            let (parts, ck) = trained(d);
            let f = ck.join("checkpoint-00000002.ckpt");
            let mut b = std::fs::read(&f).unwrap();
            let at = b.len() / 2;
            b[at] ^= 0x04;
            std::fs::write(&f, b).unwrap();
            strings(&[
                "train",
                "--data",
                DATA,
                "--partitions",
                "2",
                "--epochs",
                "4",
                "--partition-dir",
                &s(&parts),
                "--checkpoint-dir",
                &s(&ck),
                "--resume",
            ])
        },
        expect: &["no intact checkpoint", "checkpoint-00000002.ckpt", "digest"],
    },
    Case {
        name: "a checkpoint without integrity digest (older format)",
        setup: |d| {
            let ck = d.join("old");
            std::fs::create_dir_all(&ck).unwrap();
            std::fs::write(ck.join("checkpoint.rkyv"), b"anything").unwrap();
            strings(&[
                "train",
                "--data",
                DATA,
                "--partitions",
                "2",
                "--epochs",
                "2",
                "--checkpoint-dir",
                &s(&ck),
                "--resume",
            ])
        },
        expect: &["checkpoint.rkyv", "no integrity digest"],
    },
    Case {
        name: "--keep-checkpoints 0",
        setup: |d| {
            strings(&[
                "train",
                "--data",
                DATA,
                "--checkpoint-dir",
                &s(&d.join("ck")),
                "--keep-checkpoints",
                "0",
            ])
        },
        expect: &["--keep-checkpoints"],
    },
    Case {
        name: "issuing a node key over an existing one",
        setup: |d| {
            let certs = s(&d.join("certs"));
            for a in [vec!["cert", "init"], vec!["cert", "issue", "--node", "3"]] {
                let mut a = strings(&a);
                a.extend(["--dir".to_string(), certs.clone()]);
                assert!(run(&a).status.success());
            }
            strings(&["cert", "issue", "--node", "3", "--dir", &certs])
        },
        expect: &["node-3", "already exists", "--force"],
    },
    Case {
        name: "an invalid certificate validity",
        setup: |d| strings(&["cert", "init", "--days", "0", "--dir", &s(&d.join("c"))]),
        expect: &["0 days", "out of range"],
    },
];

#[test]
fn every_bad_input_is_a_clear_error() {
    for case in CASES {
        let dir = tempfile::tempdir().unwrap();
        let args = (case.setup)(dir.path());
        let t = Instant::now();
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{}: succeeded\n{err}", case.name);
        assert!(
            matches!(out.status.code(), Some(1) | Some(2)),
            "{}: exit {:?} (a crash, not an error)\n{err}",
            case.name,
            out.status
        );
        assert!(!err.contains("panicked"), "{}: panicked\n{err}", case.name);
        for needle in case.expect {
            assert!(
                err.contains(needle),
                "{}: no `{needle}` in\n{err}",
                case.name
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{}: took {:?}",
            case.name,
            t.elapsed()
        );
    }
}

/// Writes `text` gzipped, as `members` concatenated copies of one gzip member (a file of a
/// small file that inflates to `members * text.len()` bytes).
fn gzip_members(path: &Path, text: &[u8], members: usize) {
    use flate2::write::GzEncoder;
    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(text).unwrap();
    let member = enc.finish().unwrap();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    for _ in 0..members {
        f.write_all(&member).unwrap();
    }
}

#[test]
fn an_ogb_gzip_bomb_is_refused_within_the_processs_memory_limit() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ogbn_bomb");
    // node-feat.csv.gz: 13 MiB on disk (32 copies of one gzip member), 2 GiB of 128-column
    // zero rows when inflated.
    let row = vec!["0"; 128].join(",") + "\n";
    gzip_members(
        &dir.join("raw/node-feat.csv.gz"),
        row.repeat((64 << 20) / row.len()).as_bytes(),
        32,
    );
    gzip_members(&dir.join("raw/node-label.csv.gz"), b"0\n1\n", 1);
    gzip_members(&dir.join("raw/edge.csv.gz"), b"0,1\n", 1);
    for part in ["train", "valid", "test"] {
        gzip_members(&dir.join(format!("split/random/{part}.csv.gz")), b"0\n", 1);
    }
    // The process may hold 768 MiB of data (`ulimit -d`): far less than the bomb's values.
    const LIMIT: libc::rlim_t = 768 << 20;
    let mut cmd = trellis();
    cmd.args(["train", "--data", &s(&dir), "--epochs", "1"]);
    // SAFETY: the closure runs in the forked child before exec and only calls `setrlimit`,
    // which is async-signal-safe, on a struct on its own stack.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: LIMIT,
                rlim_max: LIMIT,
            };
            if libc::setrlimit(libc::RLIMIT_DATA, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let t = Instant::now();
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "not a clear error:\n{err}");
    assert!(err.contains("node-feat.csv.gz"), "{err}");
    assert!(err.contains("gzip bomb"), "{err}");
    assert!(!err.contains("memory allocation"), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t.elapsed()
    );
}
