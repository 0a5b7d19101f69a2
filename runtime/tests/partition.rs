//! Partitioner: coverage, halo and send-list invariants, blocks equal to the unsplit graph's,
//! edge cut and balance, determinism, manifest round trip, and clear errors on bad files.
use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;
use trellis_runtime::partition::{
    self, assign, block, write_partitions, PartitionBook, PartitionFile, PartitionMethod,
    PartitionSet,
};
use trellis_runtime::{Aggregation, Block, DataSource, Dataset, Graph, RuntimeError};

const SPEC: &str = "synthetic:nodes=2000,degree=8,features=16,classes=4,seed=1";
const AGGS: [Aggregation; 3] = [
    Aggregation::GcnNorm,
    Aggregation::Mean,
    Aggregation::Attention,
];
const METHODS: [PartitionMethod; 2] = [PartitionMethod::Metis, PartitionMethod::Random];

fn fixture() -> &'static (Dataset, Graph) {
    static F: OnceLock<(Dataset, Graph)> = OnceLock::new();
    F.get_or_init(|| {
        let ds = DataSource::parse(SPEC).unwrap().load().unwrap();
        let g = Graph::from_dataset(&ds).unwrap();
        (ds, g)
    })
}

fn write(dir: &Path, parts: usize, method: PartitionMethod, seed: u64) -> PartitionBook {
    let (ds, g) = fixture();
    let a = assign(g, ds, parts, method, seed).unwrap();
    write_partitions(ds, g, &a, parts, method, seed, dir).unwrap()
}

fn same_block(a: &Block, b: &Block) {
    assert_eq!(a.n_out(), b.n_out());
    assert_eq!(a.gids(), b.gids());
    assert_eq!(a.adj().indptr(), b.adj().indptr());
    assert_eq!(a.adj().indices(), b.adj().indices());
    assert_eq!(a.adj().values(), b.adj().values());
}

/// Everything a part must satisfy, checked against the unsplit data set and graph.
fn check_set(set: &PartitionSet) {
    let (ds, g) = fixture();
    let parts = set.parts();
    let files: Vec<PartitionFile> = (0..parts).map(|p| set.open_part(p).unwrap()).collect();
    let mut owner = vec![u32::MAX; ds.num_nodes];
    for (p, f) in files.iter().enumerate() {
        for &v in f.inner() {
            assert_eq!(owner[v as usize], u32::MAX, "node {v} inner in two parts");
            owner[v as usize] = p as u32;
        }
    }
    assert!(owner.iter().all(|&p| p != u32::MAX), "a node is in no part");
    let mut cut = 0;
    for (p, f) in files.iter().enumerate() {
        let inner = f.inner();
        let want: HashSet<u32> = inner
            .iter()
            .flat_map(|&v| g.neighbors(v as usize))
            .copied()
            .filter(|&j| owner[j as usize] != p as u32)
            .collect();
        let mut want: Vec<u32> = want.into_iter().collect();
        want.sort_unstable();
        assert_eq!(f.halo(), &want[..], "halo of part {p}");
        assert!(f
            .halo()
            .iter()
            .zip(f.halo_owner())
            .all(|(&h, &q)| owner[h as usize] == q));
        for agg in AGGS {
            same_block(
                &block(f, agg).unwrap(),
                &Block::build(g, inner, agg).unwrap(),
            );
        }
        let nf = ds.num_features;
        for (k, &v) in f.gids().iter().enumerate() {
            assert_eq!(
                &f.features()[k * nf..(k + 1) * nf],
                &ds.features[v as usize * nf..(v as usize + 1) * nf]
            );
            assert_eq!(f.degrees()[k] as usize, g.degree(v as usize));
        }
        for (k, &v) in inner.iter().enumerate() {
            assert_eq!(f.labels()[k], ds.labels[v as usize]);
            assert_eq!(f.train_mask()[k], ds.train_mask[v as usize]);
            assert_eq!(f.val_mask()[k], ds.val_mask[v as usize]);
            assert_eq!(f.test_mask()[k], ds.test_mask[v as usize]);
        }
        // Send lists: p's list to q, in global ids, is q's halo owned by p, in order.
        let sends: Vec<(usize, &[u32])> = f.send_lists().collect();
        for (q, other) in files.iter().enumerate().filter(|&(q, _)| q != p) {
            let expect: Vec<u32> = other
                .halo()
                .iter()
                .zip(other.halo_owner())
                .filter(|&(_, &o)| o == p as u32)
                .map(|(&h, _)| h)
                .collect();
            let got: Vec<u32> = sends
                .iter()
                .find(|(t, _)| *t == q)
                .map(|(_, rows)| rows.iter().map(|&r| inner[r as usize]).collect())
                .unwrap_or_default();
            assert_eq!(got, expect, "send list {p} -> {q}");
            assert_eq!(set.book().halo_pairs[q][p], expect.len());
        }
        assert!(sends.iter().all(|(_, rows)| !rows.is_empty()));
        assert!(sends.windows(2).all(|w| w[0].0 < w[1].0));
        let info = &set.book().partitions[p];
        assert_eq!(
            (info.inner_nodes, info.halo_nodes, info.edges),
            (inner.len(), f.halo().len(), f.indices().len())
        );
        cut += f
            .indices()
            .iter()
            .filter(|&&j| j as usize >= inner.len())
            .count();
    }
    assert_eq!(
        cut,
        2 * set.book().edge_cut,
        "cut edges counted from both sides"
    );
    assert_eq!(set.book().num_edges, g.num_entries() / 2);
}

#[test]
fn parts_cover_graph_and_match_unsplit_blocks() {
    for method in METHODS {
        for parts in [1, 2, 4, 8] {
            let dir = tempfile::tempdir().unwrap();
            let book = write(dir.path(), parts, method, 7);
            assert_eq!((book.parts, book.method), (parts, method));
            let set = PartitionSet::open(dir.path()).unwrap();
            assert_eq!(set.book(), &book, "manifest round-trips");
            check_set(&set);
            if parts == 1 {
                assert_eq!(book.edge_cut, 0);
                assert_eq!(book.partitions[0].halo_nodes, 0);
            }
        }
    }
}

#[test]
fn metis_cuts_fewer_edges_than_random_and_balances() {
    let (ds, g) = fixture();
    for parts in [2, 4, 8] {
        let d1 = tempfile::tempdir().unwrap();
        let d2 = tempfile::tempdir().unwrap();
        let metis = partition::partition(ds, parts, PartitionMethod::Metis, 0, d1.path()).unwrap();
        let random =
            partition::partition(ds, parts, PartitionMethod::Random, 0, d2.path()).unwrap();
        eprintln!(
            "P={parts}: metis cut {} balance {:?}; random cut {} balance {:?}",
            metis.edge_cut, metis.balance, random.edge_cut, random.balance
        );
        assert!((metis.edge_cut as f64) < 0.7 * random.edge_cut as f64);
        assert!(metis.balance.nodes <= 1.1, "{:?}", metis.balance);
        assert!(metis.balance.edges <= 1.2, "{:?}", metis.balance);
        assert!(metis.balance.train <= 1.2, "{:?}", metis.balance);
        assert!(random.balance.nodes <= 1.25, "{:?}", random.balance);
        assert_eq!(metis.num_nodes, g.num_nodes());
    }
}

#[test]
fn partitions_are_deterministic() {
    let (ds, g) = fixture();
    for method in METHODS {
        assert_eq!(
            assign(g, ds, 4, method, 3).unwrap(),
            assign(g, ds, 4, method, 3).unwrap()
        );
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let b1 = write(d1.path(), 4, method, 3);
        let b2 = write(d2.path(), 4, method, 3);
        for (x, y) in b1.partitions.iter().zip(&b2.partitions) {
            assert_eq!(x, y);
            let bytes = std::fs::read(d1.path().join(&x.file)).unwrap();
            assert_eq!(bytes, std::fs::read(d2.path().join(&y.file)).unwrap());
            assert_eq!(blake3::hash(&bytes).to_hex().as_str(), x.file_digest);
        }
    }
    let r0 = assign(g, ds, 4, PartitionMethod::Random, 0).unwrap();
    assert_ne!(
        r0,
        assign(g, ds, 4, PartitionMethod::Random, 1).unwrap(),
        "the seed matters"
    );
}

#[test]
fn method_parses_and_prints() {
    for m in METHODS {
        assert_eq!(m.to_string().parse::<PartitionMethod>().unwrap(), m);
    }
    assert!(matches!(
        "kahip".parse::<PartitionMethod>(),
        Err(RuntimeError::Config(_))
    ));
    let (ds, g) = fixture();
    assert!(assign(g, ds, 0, PartitionMethod::Metis, 0).is_err());
    let json = serde_json::to_string(&PartitionMethod::Metis).unwrap();
    assert_eq!(json, "\"metis\"");
}

fn err_text(r: Result<PartitionFile, RuntimeError>) -> String {
    r.expect_err("bad file must not open").to_string()
}

#[test]
fn bad_files_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), 2, PartitionMethod::Metis, 0);
    let good = std::fs::read(dir.path().join("part-0.rkyv")).unwrap();
    assert!(PartitionFile::open(dir.path().join("part-0.rkyv")).is_ok());

    let missing = dir.path().join("part-9.rkyv");
    let e = err_text(PartitionFile::open(&missing));
    assert!(e.contains("part-9.rkyv"), "{e}");

    let cases: [(&str, Vec<u8>); 4] = [
        ("truncated.rkyv", good[..good.len() / 2].to_vec()),
        ("short.rkyv", good[..good.len() - 3].to_vec()),
        (
            "garbage.rkyv",
            (0..4096u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
                .collect(),
        ),
        ("empty.rkyv", Vec::new()),
    ];
    for (name, bytes) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = err_text(PartitionFile::open(&p));
        assert!(e.contains(name), "{e}");
        eprintln!("{e}");
    }

    // Flipped bytes in the middle of part 0: rejected by validation or the manifest digest.
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    for b in &mut flipped[mid..mid + 8] {
        *b ^= 0xa5;
    }
    std::fs::write(dir.path().join("part-0.rkyv"), &flipped).unwrap();
    let set = PartitionSet::open(dir.path()).unwrap();
    let e = err_text(set.open_part(0));
    assert!(e.contains("part-0.rkyv") && e.contains("digest"), "{e}");
    // Truncated part through the set.
    std::fs::write(dir.path().join("part-1.rkyv"), &good[..100]).unwrap();
    let e = err_text(set.open_part(1));
    assert!(e.contains("part-1.rkyv"), "{e}");
    assert!(matches!(set.open_part(2), Err(RuntimeError::Config(_))));

    // A broken manifest names the manifest.
    std::fs::write(dir.path().join("partition.json"), "{\"parts\": 2").unwrap();
    let e = PartitionSet::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("partition.json"), "{e}");
    let e = PartitionSet::open(dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("partition.json"), "{e}");
}

#[test]
fn corrupt_archive_is_caught_by_validation() {
    // Damage inside an intact frame (header and end marker kept) must be caught by rkyv's
    // validation or the semantic checks: never a panic, always an error naming the file.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), 2, PartitionMethod::Random, 0);
    let good = std::fs::read(dir.path().join("part-1.rkyv")).unwrap();
    let (head, tail) = (16, 16);
    let archive = &good[head..good.len() - tail];
    let framed = |a: &[u8]| {
        let mut f = good[..head].to_vec();
        f.extend_from_slice(a);
        f.extend_from_slice(b"TRELLEND");
        f.extend_from_slice(&(a.len() as u64).to_le_bytes());
        f
    };
    assert_eq!(
        framed(archive),
        good,
        "the test rebuilds the frame as the writer does"
    );
    let p = dir.path().join("flip.rkyv");
    // The archive's root object (lengths, relative pointers) is at its end.
    let mut rejected = 0;
    for k in archive.len() - 256..archive.len() {
        let mut bad = archive.to_vec();
        bad[k] ^= 0xff;
        std::fs::write(&p, framed(&bad)).unwrap();
        if let Err(e) = PartitionFile::open(&p) {
            assert!(e.to_string().contains("flip.rkyv"));
            rejected += 1;
        }
    }
    assert!(rejected > 64, "only {rejected} of 256 flips rejected");
    // A cut-short archive in a well-formed frame.
    for keep in [0, 8, archive.len() / 3, archive.len() - 8] {
        std::fs::write(&p, framed(&archive[..keep & !7])).unwrap();
        let e = err_text(PartitionFile::open(&p));
        assert!(e.contains("flip.rkyv"), "{e}");
    }
}

#[test]
fn manifest_catches_replaced_part() {
    // A valid part file of another partition in place of part 0: the size or digest differs.
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write(d1.path(), 2, PartitionMethod::Metis, 0);
    write(d2.path(), 2, PartitionMethod::Random, 0);
    std::fs::copy(d2.path().join("part-0.rkyv"), d1.path().join("part-0.rkyv")).unwrap();
    let set = PartitionSet::open(d1.path()).unwrap();
    let e = err_text(set.open_part(0));
    assert!(e.contains("part-0.rkyv") && e.contains("manifest"), "{e}");
    assert!(set.open_part(1).is_ok());
}
