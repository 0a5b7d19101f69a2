//! Replicas shipped as the bytes that changed: after a partition's first replica reaches a
//! node, each later one goes to that node as a patch against the newest step the node
//! acknowledged ([`ReplicaDelta`]), and the node rebuilds the whole replica from its copy of
//! that step and checks it against the sender's digest of the whole before it acknowledges.
//!
//! A partition's replicated state changes little from one step to the next where it is
//! large: its held halo rows and skip records (`--staleness`, `--skip-threshold`) stay in
//! their wire encoding and only the rows resent in the step change, byte for byte
//! (`codec::merge_sparse`); the raw section starts at the same offset every step, training
//! rows before evaluation rows, so evaluation blocks kept or dropped move only what follows
//! them (see [`super`]). So the patch is about the size of the rows that moved, not of the
//! state. Where a patch would not save a quarter of the bytes (the first replica, a node that
//! never acknowledged one, a state that changed nearly everywhere) the whole replica is
//! shipped: a patch costs the replica node a rebuild and a digest of the whole, and the
//! sender a base kept per node, so it must save more than its run headers.
//!
//! The diff is a plain byte comparison written here: it runs on buffers of the same layout
//! (same offsets every step), where a general binary-diff crate (rolling hashes, moved
//! blocks) would cost more and find nothing more.
use super::{ReplicaBytes, REPLICA_PIECE};
use rkyv::{Archive, Deserialize, Serialize};
use std::collections::HashMap;

/// The granularity of the comparison, bytes: a changed byte ships the 16 around it.
const BLOCK: usize = 16;
/// Unchanged bytes between two changed blocks that are shipped rather than starting a new run
/// (a run's header is 12 bytes).
const GAP: usize = 2 * BLOCK;
/// Equal ranges are skipped this many bytes at a time before looking closer.
const CHUNK: usize = 4096;
/// A run's header: offset u64 and length u32, little endian.
const RUN_HEADER: usize = 12;
/// The longest run: every run fits a piece with room to spare.
const MAX_RUN: usize = REPLICA_PIECE / 2;

/// Which replica a patch rebuilds and from which: partition `part`'s replica of step
/// `epoch`, `total` bytes long with digest `digest`, from its replica of step `base_epoch`,
/// whose bytes have digest `base_digest`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct DeltaHeader {
    pub part: u32,
    pub epoch: u32,
    pub base_epoch: u32,
    pub base_digest: String,
    pub total: u64,
    pub digest: String,
}

/// A replica as the runs of bytes that differ from an earlier one of the same partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaDelta {
    pub header: DeltaHeader,
    /// Runs `offset u64 | len u32 | bytes`, ascending and apart, each at most [`MAX_RUN`].
    pub(super) runs: Vec<u8>,
}

impl ReplicaDelta {
    /// The patch that turns `base` into `new` (two replicas of one partition).
    pub fn between(base: &ReplicaBytes, new: &ReplicaBytes) -> Self {
        ReplicaDelta {
            header: DeltaHeader {
                part: new.part,
                epoch: new.epoch,
                base_epoch: base.epoch,
                base_digest: base.digest.clone(),
                total: new.bytes.len() as u64,
                digest: new.digest.clone(),
            },
            runs: diff(&base.bytes, &new.bytes),
        }
    }

    /// Bytes of the patch's runs (what it puts on the wire, less the message headers).
    pub fn len(&self) -> u64 {
        self.runs.len() as u64
    }

    /// Whether the patch has no run (the replica did not change).
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Whether shipping the patch saves at least a quarter of the whole replica's bytes.
    pub fn worth_it(&self) -> bool {
        4 * self.len() < 3 * self.header.total
    }

    /// The patch in pieces of at most [`REPLICA_PIECE`] bytes of runs, each a whole number of
    /// runs (one piece for a patch with no run).
    pub fn pieces(&self) -> Vec<DeltaPiece> {
        let mut cuts = vec![0usize];
        let mut at = 0;
        let mut piece_start = 0;
        while at < self.runs.len() {
            let len = run_len(&self.runs[at..]);
            if at - piece_start + RUN_HEADER + len > REPLICA_PIECE {
                cuts.push(at);
                piece_start = at;
            }
            at += RUN_HEADER + len;
        }
        cuts.push(self.runs.len());
        let count = cuts.len() as u32 - 1;
        cuts.windows(2)
            .enumerate()
            .map(|(i, w)| DeltaPiece {
                header: self.header.clone(),
                index: i as u32,
                count,
                runs: self.runs[w[0]..w[1]].to_vec(),
            })
            .collect()
    }
}

/// The length field of the run at the start of `runs` (which the diff wrote: well formed).
fn run_len(runs: &[u8]) -> usize {
    u32::from_le_bytes(runs[8..12].try_into().expect("4 bytes")) as usize
}

/// One piece of a [`ReplicaDelta`]: piece `index` of `count`, with whole runs (what a
/// `ControlMsg::ReplicaDelta` carries).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct DeltaPiece {
    pub header: DeltaHeader,
    pub index: u32,
    pub count: u32,
    pub runs: Vec<u8>,
}

/// The runs of `new` that differ from `base` (and `new`'s bytes past `base`'s end).
fn diff(base: &[u8], new: &[u8]) -> Vec<u8> {
    let mut runs = Vec::new();
    let mut open: Option<(usize, usize)> = None;
    let mut changed = |start: usize, end: usize, open: &mut Option<(usize, usize)>| match open {
        Some((s, e)) if start <= *e + GAP && end - *s <= MAX_RUN => *e = end,
        _ => {
            if let Some((s, e)) = open.take() {
                emit(&mut runs, s, &new[s..e]);
            }
            *open = Some((start, end));
        }
    };
    let common = base.len().min(new.len());
    let mut i = 0;
    while i < common {
        let end = (i + CHUNK).min(common);
        if base[i..end] != new[i..end] {
            let mut j = i;
            while j < end {
                let e = (j + BLOCK).min(end);
                if base[j..e] != new[j..e] {
                    changed(j, e, &mut open);
                }
                j = e;
            }
        }
        i = end;
    }
    let mut j = common;
    while j < new.len() {
        let e = (j + BLOCK).min(new.len());
        changed(j, e, &mut open);
        j = e;
    }
    if let Some((s, e)) = open {
        emit(&mut runs, s, &new[s..e]);
    }
    runs
}

fn emit(runs: &mut Vec<u8>, offset: usize, bytes: &[u8]) {
    runs.extend_from_slice(&(offset as u64).to_le_bytes());
    runs.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    runs.extend_from_slice(bytes);
}

/// Writes the runs of one piece into `dst` (the base's bytes, resized to the whole's length).
/// A run that is cut short or lies outside `dst` is an error saying which; nothing panics.
pub(super) fn apply_runs(dst: &mut [u8], runs: &[u8]) -> Result<(), String> {
    let mut at = 0;
    while at < runs.len() {
        let head = runs
            .get(at..at + RUN_HEADER)
            .ok_or_else(|| format!("a run header cut short at byte {at} of the patch"))?;
        let offset = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as usize;
        let body = runs
            .get(at + RUN_HEADER..at + RUN_HEADER + len)
            .ok_or_else(|| format!("a run of {len} bytes cut short at byte {at} of the patch"))?;
        let size = dst.len();
        let place = usize::try_from(offset)
            .ok()
            .and_then(|o| Some(o..o.checked_add(len)?))
            .and_then(|r| dst.get_mut(r))
            .ok_or_else(|| {
                format!(
                    "a run at byte {offset} (+{len}) lies outside the {size} bytes of the replica"
                )
            })?;
        place.copy_from_slice(body);
        at += RUN_HEADER + len;
    }
    Ok(())
}

/// What a node's shipper keeps to ship patches: per partition, the replicas it shipped that
/// can still be a base (the newest, and the step each replica node acknowledged last), and
/// per (partition, node) that step.
#[derive(Debug, Default)]
pub struct DeltaBases {
    kept: HashMap<u32, Vec<ReplicaBytes>>,
    acked: HashMap<(u32, u32), u32>,
}

/// How many steps behind the newest a base may be: a replica node keeps the two newest steps
/// of a partition, so an older one is gone there.
const BASE_AGE: u32 = 2;

impl DeltaBases {
    /// The replica of `part` that node `to` acknowledged last, if it is still kept and older
    /// than step `epoch`: the base of a patch to `to`.
    pub fn base_for(&self, part: u32, to: u32, epoch: u32) -> Option<ReplicaBytes> {
        let acked = *self.acked.get(&(part, to))?;
        self.kept
            .get(&part)?
            .iter()
            .find(|b| b.epoch == acked && acked < epoch)
            .cloned()
    }

    /// `bytes` was shipped: it is the partition's newest base.
    pub fn shipped(&mut self, bytes: ReplicaBytes) {
        let part = bytes.part;
        let kept = self.kept.entry(part).or_default();
        kept.retain(|b| b.epoch != bytes.epoch);
        kept.push(bytes);
        self.prune(part);
    }

    /// Node `from` stored `part`'s replica of step `epoch`.
    pub fn acked(&mut self, from: u32, part: u32, epoch: u32) {
        let e = self.acked.entry((part, from)).or_insert(epoch);
        *e = (*e).max(epoch);
        self.prune(part);
    }

    /// Node `from` could not rebuild a replica of `part` (it lacks the base, or the result
    /// did not match): it gets the whole replica until it acknowledges one again.
    pub fn refused(&mut self, from: u32, part: u32) {
        self.acked.remove(&(part, from));
        self.prune(part);
    }

    /// The shipped replica of `part` at step `epoch`, if kept.
    pub fn kept(&self, part: u32, epoch: u32) -> Option<ReplicaBytes> {
        self.kept
            .get(&part)?
            .iter()
            .find(|b| b.epoch == epoch)
            .cloned()
    }

    /// Keeps the newest replica of `part` and those some node acknowledged last, no more than
    /// [`BASE_AGE`] steps behind the newest.
    fn prune(&mut self, part: u32) {
        let Some(kept) = self.kept.get_mut(&part) else {
            return;
        };
        let newest = kept.iter().map(|b| b.epoch).max().unwrap_or(0);
        self.acked
            .retain(|&(p, _), e| p != part || *e + BASE_AGE >= newest);
        let acked = &self.acked;
        kept.retain(|b| {
            b.epoch == newest || acked.iter().any(|(&(p, _), &e)| p == part && e == b.epoch)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(epoch: u32, bytes: Vec<u8>) -> ReplicaBytes {
        ReplicaBytes {
            part: 2,
            epoch,
            digest: blake3::hash(&bytes).to_hex().to_string(),
            bytes: bytes.into(),
        }
    }

    /// A counter-based byte stream (no RNG crate needed for test data).
    fn noise(seed: u64, n: usize) -> Vec<u8> {
        (0..n as u64)
            .map(|i| {
                let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                (x >> 56) as u8
            })
            .collect()
    }

    fn rebuilt(base: &ReplicaBytes, d: &ReplicaDelta) -> Vec<u8> {
        let mut out = base.bytes.to_vec();
        out.resize(d.header.total as usize, 0);
        for p in d.pieces() {
            apply_runs(&mut out, &p.runs).unwrap();
        }
        out
    }

    /// Patches rebuild the new bytes exactly: scattered rows changed, a grown or shrunk
    /// replica, nothing changed, everything changed.
    #[test]
    fn a_patch_rebuilds_the_new_replica_exactly() {
        let base = noise(1, 300_000);
        let mut rows = base.clone();
        for r in (0..rows.len() / 136).step_by(7) {
            rows[r * 136 + 5] ^= 0x5A;
            rows[r * 136 + 100] ^= 1;
        }
        let mut grown = rows.clone();
        grown.extend(noise(2, 5000));
        let shrunk = base[..250_001].to_vec();
        let mut most = base.clone();
        most[..180_000].copy_from_slice(&noise(4, 180_000));
        for (name, new) in [
            ("rows", rows),
            ("most", most),
            ("grown", grown),
            ("shrunk", shrunk),
            ("same", base.clone()),
            ("all", noise(3, 300_000)),
        ] {
            let (b, n) = (replica(4, base.clone()), replica(5, new.clone()));
            let d = ReplicaDelta::between(&b, &n);
            assert_eq!(rebuilt(&b, &d), new, "{name}");
            assert_eq!(d.header.base_digest, b.digest);
            match name {
                "rows" => assert!(d.worth_it() && d.len() < new.len() as u64 / 3, "{name}"),
                "same" => assert!(d.is_empty()),
                // 60 % changed: the patch still saves a third.
                "most" => assert!(d.worth_it(), "{name}: {} of {}", d.len(), new.len()),
                "all" => assert!(!d.worth_it()),
                _ => {}
            }
        }
    }

    /// A patch larger than a piece travels in pieces of whole runs, each within the limit.
    #[test]
    fn a_large_patch_is_cut_into_pieces_of_whole_runs() {
        let n = 3 * REPLICA_PIECE;
        let base = vec![0u8; n];
        let mut new = base.clone();
        for i in (0..n).step_by(64) {
            new[i] = 1;
        }
        let (b, nb) = (replica(1, base), replica(2, new.clone()));
        let d = ReplicaDelta::between(&b, &nb);
        let pieces = d.pieces();
        assert!(pieces.len() >= 2, "{} pieces", pieces.len());
        assert!(pieces.iter().all(|p| p.runs.len() <= REPLICA_PIECE));
        assert!(pieces.iter().all(|p| p.count == pieces.len() as u32));
        assert_eq!(rebuilt(&b, &d), new);
    }

    /// Runs that are cut short or point outside the replica are errors, never panics.
    #[test]
    fn a_bad_run_is_an_error() {
        let mut dst = vec![0u8; 100];
        let mut runs = Vec::new();
        emit(&mut runs, 90, &[1; 20]);
        assert!(apply_runs(&mut dst, &runs).unwrap_err().contains("outside"));
        let mut runs = Vec::new();
        emit(&mut runs, u64::MAX as usize, &[1; 2]);
        assert!(apply_runs(&mut dst, &runs).is_err());
        let mut runs = Vec::new();
        emit(&mut runs, 0, &[1; 20]);
        assert!(apply_runs(&mut dst, &runs[..25])
            .unwrap_err()
            .contains("cut short"));
        assert!(apply_runs(&mut dst, &runs[..5])
            .unwrap_err()
            .contains("header"));
        assert!(apply_runs(&mut dst, &runs).is_ok());
    }

    /// A node gets a patch against the newest step it acknowledged while that step is kept;
    /// a refusal sends it whole replicas again; old bases are let go.
    #[test]
    fn bases_follow_what_each_node_acknowledged() {
        let mut b = DeltaBases::default();
        b.shipped(replica(1, vec![1]));
        assert!(b.base_for(2, 7, 2).is_none(), "nothing acknowledged yet");
        b.acked(7, 2, 1);
        assert_eq!(b.base_for(2, 7, 2).unwrap().epoch, 1);
        assert!(b.base_for(2, 8, 2).is_none(), "another node");
        assert!(b.base_for(3, 7, 2).is_none(), "another partition");
        b.shipped(replica(2, vec![2]));
        // Step 2 not acknowledged yet: step 1 stays the base.
        assert_eq!(b.base_for(2, 7, 3).unwrap().epoch, 1);
        b.acked(7, 2, 2);
        assert!(b.kept(2, 1).is_none(), "step 1 is no one's base any more");
        assert_eq!(b.base_for(2, 7, 3).unwrap().epoch, 2);
        b.acked(7, 2, 1);
        assert_eq!(
            b.base_for(2, 7, 3).unwrap().epoch,
            2,
            "acks only move forward"
        );
        b.refused(7, 2);
        assert!(b.base_for(2, 7, 3).is_none());
        assert!(b.kept(2, 2).is_some(), "the newest is kept");
        // A node that stopped acknowledging holds no base alive for long.
        b.acked(9, 2, 2);
        for e in 3..6 {
            b.shipped(replica(e, vec![e as u8]));
        }
        assert!(b.kept(2, 2).is_none());
        assert!(b.base_for(2, 9, 6).is_none());
    }
}
