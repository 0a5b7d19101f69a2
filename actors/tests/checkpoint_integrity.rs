//! A checkpoint can never resume wrong: every byte a resume depends on is covered by its
//! digest. Property test: 1,200 seeded single-bit flips of a real checkpoint each either fail
//! the check (naming the file) or, with an older checkpoint kept, fall back to it; sampled
//! flips are resumed for real and must end with the uncorrupted resume's weights digest.
use std::path::Path;
use trellis_actors::checkpoint::{checkpoint_path, Checkpoint, CheckpointPolicy};
use trellis_actors::Topology;
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::train::TrainConfig;
use trellis_runtime::{DataSource, Dataset, ModelKind};

fn data() -> Dataset {
    DataSource::parse("synthetic:nodes=300,degree=5,features=8,classes=3,seed=4")
        .unwrap()
        .load()
        .unwrap()
}

fn config(ds: &Dataset, epochs: u32, threads: usize) -> TrainConfig {
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 9);
    cfg.model.hidden = 4;
    cfg.epochs = epochs;
    cfg.threads = threads;
    cfg
}

/// Trains `epochs` epochs over the partitions in `parts`, checkpointing into `ck` every 2
/// (keeping `keep`), resuming from `ck` when `resume`; returns the final weights digest.
fn train(
    ds: &Dataset,
    parts: &Path,
    ck: &Path,
    epochs: u32,
    keep: usize,
    resume: bool,
    threads: usize,
) -> Result<String, String> {
    let policy = CheckpointPolicy {
        dir: ck.to_path_buf(),
        every: 2,
        keep,
        resume,
    };
    Topology::partition(
        ds,
        2,
        PartitionMethod::Metis,
        Some(parts),
        config(ds, epochs, threads),
    )
    .and_then(|t| t.with_checkpoints(policy).spawn())
    .and_then(|run| run.wait())
    .map(|r| r.weights_digest)
    .map_err(|e| e.to_string())
}

/// A SplitMix64 step: the flips are seeded, so a failure reproduces.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_name() != ".trellis.lock" {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn no_single_bit_flip_resumes_silently_to_different_weights() {
    let ds = data();
    let tmp = tempfile::tempdir().unwrap();
    let parts = tmp.path().join("parts");
    let base = tmp.path().join("base");
    // Epochs 1-4, checkpoints after 2 and 4 (both kept).
    train(&ds, &parts, &base, 4, 2, false, 1).unwrap();
    let newest = checkpoint_path(&base, 4);
    let older = checkpoint_path(&base, 2);
    assert!(newest.exists() && older.exists());
    let good = std::fs::read(&newest).unwrap();

    // The uncorrupted resume to epoch 6 equals an uninterrupted run of 6 epochs, and does
    // not depend on the thread count.
    let reference = {
        let d = tmp.path().join("ref");
        copy_dir(&base, &d);
        train(&ds, &parts, &d, 6, 2, true, 2).unwrap()
    };
    let straight = train(&ds, &parts, &tmp.path().join("straight"), 6, 2, false, 1).unwrap();
    assert_eq!(reference, straight, "resume = uninterrupted run");

    // 1,200 seeded single-bit flips anywhere in the file: each is refused by the check.
    let mut rng = 0x5eed_u64;
    let flips: Vec<(usize, u8)> = (0..1200)
        .map(|_| {
            let r = next(&mut rng);
            ((r >> 3) as usize % good.len(), 1u8 << (r & 7))
        })
        .collect();
    for &(at, bit) in &flips {
        let mut bad = good.clone();
        bad[at] ^= bit;
        let e = Checkpoint::from_bytes(&bad, &newest)
            .err()
            .unwrap_or_else(|| panic!("flip of bit {bit:#04x} at byte {at} was accepted"));
        assert!(e.to_string().contains(&newest.display().to_string()), "{e}");
    }
    // Every header byte too (magic, version, length, digest).
    for at in 0..52 {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        assert!(Checkpoint::from_bytes(&bad, &newest).is_err(), "byte {at}");
    }
    // Truncations and an extension.
    for len in [0, 10, 52, good.len() / 2, good.len() - 1] {
        assert!(Checkpoint::from_bytes(&good[..len], &newest).is_err());
    }
    let mut longer = good.clone();
    longer.push(0);
    assert!(Checkpoint::from_bytes(&longer, &newest).is_err());

    // Resumes for real with a sample of the flips: with the older checkpoint kept, the run
    // falls back to it (naming the skipped file) and ends with the reference weights.
    for (i, &(at, bit)) in flips.iter().step_by(300).enumerate() {
        let d = tmp.path().join(format!("flip{i}"));
        copy_dir(&base, &d);
        let mut bad = good.clone();
        bad[at] ^= bit;
        std::fs::write(checkpoint_path(&d, 4), &bad).unwrap();
        let r = Checkpoint::read_latest(&d).unwrap().unwrap();
        assert_eq!(r.path, checkpoint_path(&d, 2));
        assert_eq!(r.skipped.len(), 1);
        assert!(r.skipped[0].1.contains("digest"), "{:?}", r.skipped);
        assert_eq!(
            train(&ds, &parts, &d, 6, 2, true, 1).unwrap(),
            reference,
            "flip {i}"
        );
    }

    // With nothing to fall back to, the resume fails naming the file and the fault.
    let d = tmp.path().join("alone");
    std::fs::create_dir_all(&d).unwrap();
    let mut bad = good.clone();
    bad[good.len() - 7] ^= 0x01;
    std::fs::write(checkpoint_path(&d, 4), &bad).unwrap();
    let e = train(&ds, &parts, &d, 6, 2, true, 1).unwrap_err();
    assert!(
        e.contains("no intact checkpoint") && e.contains("checkpoint-00000004.ckpt"),
        "{e}"
    );
    let _ = older;
}

#[test]
fn only_the_newest_k_checkpoints_are_kept_and_a_held_folder_is_refused() {
    let ds = data();
    let tmp = tempfile::tempdir().unwrap();
    let parts = tmp.path().join("parts");
    let ck = tmp.path().join("ck");
    train(&ds, &parts, &ck, 8, 3, false, 1).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ckpt"))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "checkpoint-00000004.ckpt",
            "checkpoint-00000006.ckpt",
            "checkpoint-00000008.ckpt"
        ]
    );
    // Another run holding the folder: refused at once, naming the holder.
    let held = CheckpointPolicy {
        dir: ck.clone(),
        every: 2,
        keep: 1,
        resume: false,
    }
    .lock()
    .unwrap();
    let e = train(&ds, &parts, &ck, 10, 3, true, 1).unwrap_err();
    assert!(
        e.contains("is in use by pid") && e.contains(&ck.display().to_string()),
        "{e}"
    );
    drop(held);
    train(&ds, &parts, &ck, 10, 3, true, 1).unwrap();
}
