//! The on-disk layout of one part: [`PartitionData`], stored as an rkyv archive framed by a
//! 16-byte header and a 16-byte end marker, and the names of the files in a partition folder.
//!
//! Part file: `HEADER_MAGIC` (12 bytes), format version (u32 LE), the rkyv archive (its root
//! at its end, as rkyv lays it out), `END_MAGIC` (8 bytes), archive length (u64 LE). The
//! header tells a foreign file from a damaged one; the end marker catches truncation.
use rkyv::{Archive, Deserialize, Serialize};

#[cfg(not(target_endian = "little"))]
compile_error!("partition archives are little-endian; zero-copy access needs a little-endian host");

/// Version of the part archive and manifest layout; bumped on any change.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the partition book inside a partition folder.
pub const MANIFEST_FILE: &str = "partition.json";

/// First bytes of every part file.
pub(crate) const HEADER_MAGIC: &[u8; 12] = b"TRELLIS-PART";
/// First bytes of the end marker.
pub(crate) const END_MAGIC: &[u8; 8] = b"TRELLEND";
/// Bytes before the archive (a multiple of 16, so a page-aligned mapping keeps it aligned).
pub(crate) const HEADER_LEN: usize = 16;
/// Bytes after the archive.
pub(crate) const END_LEN: usize = 16;

/// The header of a part file.
pub(crate) fn header() -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..12].copy_from_slice(HEADER_MAGIC);
    h[12..].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h
}

/// The end marker of a part file whose archive is `len` bytes.
pub(crate) fn end_marker(len: u64) -> [u8; END_LEN] {
    let mut e = [0u8; END_LEN];
    e[..8].copy_from_slice(END_MAGIC);
    e[8..].copy_from_slice(&len.to_le_bytes());
    e
}

/// The archive inside a part file's bytes, or what is wrong with the framing.
pub(crate) fn unframe(bytes: &[u8]) -> Result<&[u8], String> {
    let n = bytes.len();
    if n < HEADER_LEN || &bytes[..12] != HEADER_MAGIC {
        return Err(format!(
            "not a Trellis partition file ({n} bytes, no TRELLIS-PART header)"
        ));
    }
    let version = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(format!(
            "partition format version {version}, this build reads {FORMAT_VERSION}"
        ));
    }
    let end = &bytes[n.saturating_sub(END_LEN).max(HEADER_LEN)..];
    if end.len() != END_LEN || &end[..8] != END_MAGIC {
        return Err(format!("truncated or damaged: {n} bytes and no end marker"));
    }
    let len = u64::from_le_bytes(end[8..].try_into().expect("8 bytes"));
    let have = (n - HEADER_LEN - END_LEN) as u64;
    if len != have {
        return Err(format!(
            "truncated or damaged: the archive has {have} bytes, its end marker says {len}"
        ));
    }
    Ok(&bytes[HEADER_LEN..n - END_LEN])
}

/// File name of part `p` inside a partition folder.
pub fn part_file_name(p: usize) -> String {
    format!("part-{p}.rkyv")
}

/// The rows of one part whose embeddings another part reads as halo rows.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SendList {
    /// The part that needs these rows.
    pub to_part: u32,
    /// Local inner ids, in ascending global id: exactly `to_part`'s halo nodes owned here.
    pub rows: Vec<u32>,
}

/// Everything one worker needs: its inner nodes, halo nodes, local CSR, features, labels,
/// masks, and the id maps (local id `k` is `inner[k]` for `k < inner.len()`, else
/// `halo[k - inner.len()]`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PartitionData {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    pub part: u32,
    pub num_parts: u32,
    pub num_features: u32,
    pub num_classes: u32,
    pub num_global_nodes: u64,
    /// [`Dataset::digest`](crate::Dataset::digest) of the source data.
    pub data_digest: String,
    /// Global ids of the inner (owned) nodes, ascending.
    pub inner: Vec<u32>,
    /// Global ids of the halo nodes (neighbours of inner nodes owned elsewhere), ascending.
    pub halo: Vec<u32>,
    /// Owning part of each halo node.
    pub halo_owner: Vec<u32>,
    /// Row pointers of the local CSR over inner rows (`inner.len() + 1` entries).
    pub indptr: Vec<u64>,
    /// Local ids of each inner row's neighbours, ascending global id, no self loops.
    pub indices: Vec<u32>,
    /// Global degree of every input row (inner, then halo).
    pub degrees: Vec<u32>,
    /// Features of every input row (inner, then halo), row-major.
    pub features: Vec<f32>,
    /// Labels of the inner nodes.
    pub labels: Vec<u32>,
    pub train_mask: Vec<bool>,
    pub val_mask: Vec<bool>,
    pub test_mask: Vec<bool>,
    /// One list per other part that reads rows of this one, ascending `to_part`.
    pub send: Vec<SendList>,
}

/// An archived little-endian primitive with the native type it stands for.
pub(crate) trait LittleEndian {
    type Native;
}
impl LittleEndian for rkyv::rend::u32_le {
    type Native = u32;
}
impl LittleEndian for rkyv::rend::u64_le {
    type Native = u64;
}
impl LittleEndian for rkyv::rend::f32_le {
    type Native = f32;
}

/// Reinterprets archived little-endian primitives as native ones, zero-copy.
pub(crate) fn native<A: LittleEndian>(s: &[A]) -> &[A::Native] {
    const {
        assert!(
            size_of::<A>() == size_of::<A::Native>() && align_of::<A>() >= align_of::<A::Native>()
        );
    }
    // SAFETY: `A` is rkyv's `*_le` wrapper of `A::Native`: same size, at least its alignment,
    // and on a little-endian host (the only kind this module compiles for) the same bits;
    // every bit pattern is a valid u32, u64 or f32.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<A::Native>(), s.len()) }
}
