//! A partition folder is never trusted or overwritten silently: seeded single-bit flips of
//! the book and of a part file each either fail to open (naming the file) or read back
//! exactly what was written; a folder holding another partitioning is an error saying what
//! differs, replaced only on request; a folder being written is refused naming the writer.
use std::path::Path;
use trellis_runtime::partition::{
    self, open_or_partition, remove_partitions, DirLock, LockMode, PartitionMethod, PartitionSet,
    MANIFEST_FILE,
};
use trellis_runtime::{DataSource, Dataset};

fn data(seed: u64) -> Dataset {
    DataSource::parse(&format!(
        "synthetic:nodes=400,degree=5,features=6,classes=3,seed={seed}"
    ))
    .unwrap()
    .load()
    .unwrap()
}

fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a part holds: global ids, features, labels.
#[derive(Debug, PartialEq)]
struct Part {
    gids: Vec<u32>,
    features: Vec<f32>,
    labels: Vec<u32>,
}

/// Every part's content, as opened and checked.
fn contents(dir: &Path) -> Result<Vec<Part>, String> {
    let set = PartitionSet::open(dir).map_err(|e| e.to_string())?;
    (0..set.parts())
        .map(|p| {
            let f = set.open_part(p).map_err(|e| e.to_string())?;
            Ok(Part {
                gids: f.gids(),
                features: f.features().to_vec(),
                labels: f.labels().to_vec(),
            })
        })
        .collect()
}

#[test]
fn single_bit_flips_of_the_book_and_the_parts_never_open_silently_different() {
    let ds = data(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("p");
    partition::partition(&ds, 3, PartitionMethod::Metis, 0, &dir).unwrap();
    let good = contents(&dir).unwrap();
    let book_path = dir.join(MANIFEST_FILE);
    let book = std::fs::read(&book_path).unwrap();
    let part_path = dir.join("part-1.rkyv");
    let part = std::fs::read(&part_path).unwrap();
    let mut rng = 0xb00c_u64;
    let mut refused = 0;
    for (path, bytes, flips) in [(&book_path, &book, 700), (&part_path, &part, 500)] {
        for _ in 0..flips {
            let r = next(&mut rng);
            let (at, bit) = ((r >> 3) as usize % bytes.len(), 1u8 << (r & 7));
            let mut bad = bytes.clone();
            bad[at] ^= bit;
            std::fs::write(path, &bad).unwrap();
            match contents(&dir) {
                Ok(c) => assert_eq!(c, good, "flip at byte {at} of {}", path.display()),
                Err(e) => {
                    refused += 1;
                    assert!(e.contains(&path.display().to_string()), "{e}");
                }
            }
        }
        std::fs::write(path, bytes).unwrap();
    }
    assert_eq!(refused, 1200, "every flip is caught by a digest");
    assert_eq!(contents(&dir).unwrap(), good);
}

#[test]
fn another_partitioning_in_the_folder_is_an_error_until_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("p");
    let ds = data(1);
    open_or_partition(&ds, 3, PartitionMethod::Metis, 0, &dir).unwrap();
    // The same request reuses it.
    open_or_partition(&ds, 3, PartitionMethod::Metis, 0, &dir).unwrap();
    for (ds, parts, method, seed, needle) in [
        (data(1), 4, PartitionMethod::Metis, 0, "3 parts, not 4"),
        (
            data(1),
            3,
            PartitionMethod::Random,
            0,
            "method metis, not random",
        ),
        (
            data(1),
            3,
            PartitionMethod::Metis,
            7,
            "partition seed 0, not 7",
        ),
        (data(2), 3, PartitionMethod::Metis, 0, "data "),
    ] {
        let e = open_or_partition(&ds, parts, method, seed, &dir)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(needle) && e.contains("--repartition") && e.contains(MANIFEST_FILE),
            "{e}"
        );
    }
    // A corrupt book is an error too, not a silent re-partition over the folder.
    let book = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&book).unwrap();
    std::fs::write(&book, text.replacen("\"edge_cut\": ", "\"edge_cut\": 1", 1)).unwrap();
    let e = open_or_partition(&ds, 3, PartitionMethod::Metis, 0, &dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("corrupt") && e.contains("--repartition"), "{e}");
    // --repartition: the old partitioning goes completely, other files stay.
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    remove_partitions(&dir).unwrap();
    let set = open_or_partition(&ds, 4, PartitionMethod::Metis, 0, &dir).unwrap();
    assert_eq!(set.parts(), 4);
    assert!(dir.join("notes.txt").exists());
    let parts: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("part-"))
        .collect();
    assert_eq!(parts.len(), 4, "{parts:?}");
}

#[test]
fn a_folder_being_written_is_refused_naming_the_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("p");
    let ds = data(1);
    partition::partition(&ds, 2, PartitionMethod::Metis, 0, &dir).unwrap();
    let writer = DirLock::acquire(&dir, LockMode::Exclusive, "partition folder").unwrap();
    for e in [
        PartitionSet::open(&dir).unwrap_err().to_string(),
        partition::partition(&ds, 2, PartitionMethod::Metis, 0, &dir)
            .unwrap_err()
            .to_string(),
        remove_partitions(&dir).unwrap_err().to_string(),
    ] {
        assert!(
            e.contains("in use by pid") && e.contains(&dir.display().to_string()),
            "{e}"
        );
    }
    drop(writer);
    // Readers share it; a writer waits for none of them but is refused while they read.
    let a = PartitionSet::open(&dir).unwrap();
    let _b = PartitionSet::open(&dir).unwrap();
    assert!(remove_partitions(&dir).is_err());
    drop(a);
}

/// A full disk is reported as such, with the file, not as a serializer failure.
#[cfg(target_os = "linux")]
#[test]
fn a_full_disk_says_no_space_left_and_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("p");
    std::fs::create_dir_all(&dir).unwrap();
    // The part's temporary file is /dev/full, where every write fails with ENOSPC.
    std::os::unix::fs::symlink("/dev/full", dir.join("part-0.rkyv.tmp")).unwrap();
    let e = partition::partition(&data(1), 2, PartitionMethod::Metis, 0, &dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("No space left on device") && e.contains("part-0.rkyv.tmp"),
        "{e}"
    );
}
