//! The node's replica store: the latest committed state of each partition's model replica and
//! optimizer, kept in memory so a restarted actor resumes from it without a checkpoint file;
//! and the replicated wire form of a snapshot ([`ReplicaBytes`]).
//!
//! The wire form is `raw section length u64 | raw section | rkyv archive`: the archive holds
//! the model and every small field, the raw section the payloads of the held halo blocks and
//! skip records (what grows with the graph), which the archive locates by offset. Encoding
//! writes each payload once, straight into the one buffer that is shipped and kept (no
//! intermediate copies of the held rows); decoding reads them out of it. The raw section
//! starts at the same offset every step and holds the training rows' blocks and records before
//! the evaluation rows' ones, so that evaluation blocks kept or dropped from one step to the
//! next (`skip::keeps_eval_rows`) move only what follows them, not the training rows a patch
//! ([`delta`]) finds unchanged at the same offsets.
//!
//! A replica may leave the model and optimizer state out (`model_elided`): after a step every
//! partition's model replica and optimizer are identical (the all-reduce makes them so, and
//! the coordinator checks their digests), so where every node a replica goes to hosts a
//! partition of its own, shipping them would only copy what the receiver holds already. Such
//! a replica carries the weights' digest, and the receiver completes it from the state of the
//! same step that its own partitions committed ([`ReplicaBytes::decode_in`]), checked
//! against that digest. What is left is what only that partition holds: its gradient
//! residual, held halo rows and skip records.
//!
//! A replica also leaves out the rows that partitions on other nodes hold byte for byte
//! ([`Mirrors`]): a skip record is exactly the held block of the partition it was sent to,
//! and a held block exactly the record of the partition that sent it (where that partition
//! keeps one). The replica carries only the BLAKE3 digest of such a payload. Where that
//! partition is hosted on the replica node, the receiver completes it from the snapshot of
//! the same step its own partition committed ([`ReplicaBytes::decode_in`]); where it is
//! hosted on a third node, the node adopting the partition fetches it from that node first
//! ([`ReplicaStore::missing_mirrors`], [`ReplicaStore::put_fetched`]); either is checked
//! against the digest. Only a partition's own node can lose both copies of such rows at once,
//! so rows shared with partitions on the same node are shipped; the rest cross the wire only
//! as halo rows. This holds with one replica node (one node lost at a time), where it is set.
//!
//! After the first replica a node acknowledged, later ones reach it as the bytes that
//! changed ([`delta`]).
pub mod delta;
mod intake;
use crate::protocol::skip::{SentRows, SentValues};
use dashmap::DashMap;
pub use delta::{DeltaBases, DeltaHeader, DeltaPiece, ReplicaDelta};
pub use intake::{OnStored, ReceivedPiece, Stored};
use rkyv::{Archive, Deserialize, Serialize};
use std::sync::Arc;
use trellis_gpu::Tensor;
use trellis_transport::{codec, HaloBlock, HaloPayload, MsgHeader, PartId, Phase, RunId};

/// A snapshot as replicated bytes: shapes and values of every tensor.
#[derive(Archive, Serialize, Deserialize)]
struct SnapshotWire {
    epoch: u32,
    /// `params` and `moments` are left out (empty): the receiver completes them from its own
    /// partitions' state of the same step, whose weights have `digest`.
    model_elided: bool,
    params: Vec<WireTensor>,
    moments: Vec<(WireTensor, WireTensor)>,
    opt_steps: u64,
    digest: String,
    grad_residual: Vec<f32>,
    held_halo: Vec<WireBlock>,
    skip_sent: Vec<WireSent>,
}

/// Bytes of a BLAKE3 digest: what a replica carries in place of rows it leaves out.
const DIGEST_LEN: usize = 32;

/// What a replica may leave out because partitions on other nodes hold it byte for byte: a
/// skip record to such a partition (the record is what that partition holds: its held
/// block), and a held block from one (the block is that partition's record of it). The
/// replica carries the payload's BLAKE3 digest instead; the receiver completes it from the
/// snapshot that partition committed at the same step, its own or fetched from the
/// partition's node at adoption ([`ReplicaStore::set_mirrors`]).
/// Only fixed-width payloads are mirrors: rows sent as fp32 or in adaptive widths are
/// recorded by their sender in int8, which is not what the receiver holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mirrors {
    /// The partitions whose rows the replica leaves out: those hosted on other nodes than
    /// the replicated partition's (empty: leave nothing out).
    pub peers: Vec<u32>,
    /// Partitions keep skip records of their training rows (`--skip-threshold` above 0), so
    /// that a held training block is its sender's record; evaluation blocks are held exactly
    /// where their sender keeps a record (`skip::keeps_eval_rows`).
    pub training_records: bool,
}

impl Mirrors {
    /// Whether the receiver's partition `r.to` holds this record's rows as its held block.
    fn record(&self, r: &SentRows) -> bool {
        matches!(r.values, SentValues::Encoded(_)) && self.peers.contains(&r.to.0)
    }

    /// Whether the receiver's partition `b.from` holds this block as its skip record.
    fn block(&self, b: &HaloBlock) -> bool {
        let fixed = matches!(&b.payload, HaloPayload::Encoded(e) if codec::is_fixed_width(e));
        fixed
            && self.peers.contains(&b.header.from.0)
            && (b.header.phase == Phase::Eval || self.training_records)
    }
}

/// The BLAKE3 digests of the payloads each partition's last replica left out
/// ([`Mirrors`]), with the payloads themselves: a payload that is the same buffer in the next
/// replica (a block or record no row of which was resent, which keeps its buffer) is not
/// hashed again. Holding the buffers keeps their addresses from being reused by others while
/// their digests are kept.
#[derive(Default)]
pub struct MirrorDigests(std::collections::HashMap<u32, Vec<MirrorDigest>>);

/// A payload left out and its digest.
struct MirrorDigest {
    payload: Arc<[u8]>,
    digest: [u8; DIGEST_LEN],
}

impl MirrorDigests {
    /// `payload`'s digest: the one in `prev` if it is the same buffer, else computed; noted
    /// in `next`.
    fn digest(
        prev: &[MirrorDigest],
        next: &mut Vec<MirrorDigest>,
        payload: &Arc<[u8]>,
    ) -> [u8; DIGEST_LEN] {
        let digest = prev
            .iter()
            .find(|m| Arc::ptr_eq(&m.payload, payload))
            .map(|m| m.digest)
            .unwrap_or_else(|| *blake3::hash(payload).as_bytes());
        next.push(MirrorDigest {
            payload: payload.clone(),
            digest,
        });
        digest
    }
}

/// The [`Mirrors`] of each partition's next replica (given by the cluster node, which knows
/// where the replica goes and what is hosted there).
pub type MirrorsOf = Arc<dyn Fn(u32) -> Mirrors + Send + Sync>;

/// A payload a replica left out: partition `holder`'s skip record to `peer` (`record`), or
/// its held block from `peer`, of one phase and layer tag. Also what a node adopting a
/// partition asks a third node for ([`ReplicaStore::missing_mirrors`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MirrorKey {
    pub holder: u32,
    pub peer: u32,
    /// The phase: 0 forward, 1 backward, 2 evaluation.
    pub phase: u8,
    pub layer: u16,
    pub record: bool,
}

impl MirrorKey {
    /// What the payload is, for errors.
    fn describe(&self) -> String {
        format!(
            "the {} partition {} keeps of {:?} layer tag {} with partition {}",
            if self.record {
                "skip record"
            } else {
                "held rows"
            },
            self.holder,
            phase_of(self.phase),
            self.layer,
            self.peer
        )
    }
}

/// Where a replica being decoded finds the payloads it left out: the snapshots of the same
/// step that the receiving store's own partitions committed, or the payloads it fetched from
/// the nodes hosting the others.
struct MirrorSource<'a> {
    /// The replica's partition and step.
    part: u32,
    epoch: u32,
    store: Option<&'a ReplicaStore>,
}

impl MirrorSource<'_> {
    /// The payload `key` names, checked against `digest` (the sender's BLAKE3 of it).
    fn payload(&self, key: MirrorKey, digest: &[u8]) -> Result<Arc<[u8]>, String> {
        let what = key.describe();
        let store = self.store.ok_or_else(|| {
            format!(
                "it leaves out {what}: it is completed only on the node that hosts partition {} or fetches it",
                key.holder
            )
        })?;
        let bytes = store
            .mirror_at(self.epoch, key)
            .or_else(|| store.fetched_at(self.epoch, key))
            .ok_or_else(|| {
                format!(
                    "it leaves out {what} at step {}, which this node neither holds nor fetched",
                    self.epoch
                )
            })?;
        if blake3::hash(&bytes).as_bytes()[..] != *digest {
            return Err(format!(
                "it leaves out {what} at step {}, and this node's copy has another digest than the sender's",
                self.epoch
            ));
        }
        Ok(bytes)
    }
}

/// A sender's record of the rows one receiver holds (`--skip-threshold`).
#[derive(Archive, Serialize, Deserialize)]
struct WireSent {
    to: u32,
    /// 0 forward, 1 backward.
    phase: u8,
    layer: u16,
    cols: u32,
    /// The values are the rows as sent, a dense payload of a fixed-width codec, in `codes`
    /// (`scales` empty); else int8 codes and per-row scales.
    encoded: bool,
    /// The rows are left out (the receiver's partition `to` holds them: see [`Mirrors`]);
    /// `codes` holds their BLAKE3 digest (32 bytes).
    mirror: bool,
    /// The int8 codes, or the encoded rows, in the raw section.
    codes: RawRange,
    /// The per-row scales, f32 little endian in the raw section.
    scales: RawRange,
    sent: Vec<u32>,
}

/// Where a payload lies in the raw section: byte offset and length.
#[derive(Archive, Serialize, Deserialize, Clone, Copy)]
struct RawRange {
    offset: u64,
    len: u64,
}

/// Lays payloads out in the raw section as the archive's entries are made.
#[derive(Default)]
struct RawLayout {
    len: u64,
}

impl RawLayout {
    fn take(&mut self, len: u64) -> RawRange {
        let r = RawRange {
            offset: self.len,
            len,
        };
        self.len += len;
        r
    }
}

/// The raw section of a replica being decoded.
struct Raw<'a>(&'a [u8]);

impl Raw<'_> {
    fn bytes(&self, r: RawRange) -> Result<&[u8], String> {
        let end = r
            .offset
            .checked_add(r.len)
            .filter(|e| *e <= self.0.len() as u64);
        match end {
            Some(end) => Ok(&self.0[r.offset as usize..end as usize]),
            None => Err(format!(
                "a payload at {}..+{} lies outside the {} raw bytes",
                r.offset,
                r.len,
                self.0.len()
            )),
        }
    }

    /// f32 values (little endian), in one allocation.
    fn floats(&self, r: RawRange) -> Result<Arc<[f32]>, String> {
        let b = self.bytes(r)?;
        if b.len() % 4 != 0 {
            return Err(format!("{} bytes of f32 values", b.len()));
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Writes f32 values little endian into `dst` (exactly `4 * values.len()` bytes).
fn put_floats(dst: &mut [u8], values: &[f32]) {
    #[cfg(target_endian = "little")]
    dst.copy_from_slice(bytemuck::cast_slice(values));
    #[cfg(not(target_endian = "little"))]
    for (d, v) in dst.chunks_exact_mut(4).zip(values) {
        d.copy_from_slice(&v.to_le_bytes());
    }
}

/// A phase in a replica's wire form (the held blocks and skip records of every pass).
fn phase_code(p: Phase) -> u8 {
    match p {
        Phase::Forward => 0,
        Phase::Backward => 1,
        Phase::Eval => 2,
    }
}

/// The phase of a [`phase_code`].
fn phase_of(code: u8) -> Option<Phase> {
    match code {
        0 => Some(Phase::Forward),
        1 => Some(Phase::Backward),
        2 => Some(Phase::Eval),
        _ => None,
    }
}

impl WireSent {
    fn of(s: &SentRows, raw: &mut RawLayout, mirror: bool) -> Self {
        let (encoded, codes, scales) = match &s.values {
            SentValues::Encoded(_) if mirror => (true, DIGEST_LEN, 0),
            SentValues::Encoded(b) => (true, b.len(), 0),
            SentValues::Int8 { codes, scales } => (false, codes.len(), scales.len()),
        };
        WireSent {
            to: s.to.0,
            phase: phase_code(s.phase),
            layer: s.layer,
            cols: s.cols,
            encoded,
            mirror,
            codes: raw.take(codes as u64),
            scales: raw.take(4 * scales as u64),
            sent: s.sent.clone(),
        }
    }

    /// The record; rows left out are taken from `mirrors` (the receiver's own partitions).
    fn record(self, raw: &Raw<'_>, mirrors: &MirrorSource<'_>) -> Result<SentRows, String> {
        let phase = phase_of(self.phase)
            .ok_or_else(|| format!("skip record with unknown phase {}", self.phase))?;
        let rows = self.sent.len() as u64;
        let record = |values| SentRows {
            to: PartId(self.to),
            phase,
            layer: self.layer,
            cols: self.cols,
            values,
            sent: self.sent.clone(),
        };
        if self.mirror {
            let key = MirrorKey {
                holder: self.to,
                peer: mirrors.part,
                phase: self.phase,
                layer: self.layer,
                record: false,
            };
            let bytes = mirrors.payload(key, raw.bytes(self.codes)?)?;
            return Ok(record(SentValues::Encoded(bytes)));
        }
        if self.encoded {
            let bytes = raw.bytes(self.codes)?;
            if !codec::is_fixed_width(bytes) {
                return Err(format!(
                    "skip record for partition {}: its rows are not a fixed-width payload",
                    self.to
                ));
            }
            codec::validate(bytes, rows as usize, self.cols as usize)
                .map_err(|e| format!("skip record for partition {}: {e}", self.to))?;
            return Ok(record(SentValues::Encoded(Arc::from(bytes))));
        }
        let codes: Vec<i8> = raw.bytes(self.codes)?.iter().map(|&b| b as i8).collect();
        let scales = raw.floats(self.scales)?.to_vec();
        if codes.len() as u64 != rows * u64::from(self.cols) || scales.len() as u64 != rows {
            return Err(format!(
                "skip record for partition {} holds {} values and {} scales for {} rows of {}",
                self.to,
                codes.len(),
                scales.len(),
                rows,
                self.cols
            ));
        }
        Ok(record(SentValues::Int8 { codes, scales }))
    }
}

/// A held halo block (`--staleness`): its header without the run, its shape and where its
/// payload lies in the raw section, as it was received (fp32 values or encoded bytes).
#[derive(Archive, Serialize, Deserialize)]
struct WireBlock {
    epoch: u32,
    /// 0 forward, 1 backward (evaluation blocks are never held).
    phase: u8,
    layer: u16,
    from: u32,
    to: u32,
    rows: u32,
    cols: u32,
    /// Encoded bytes (a codec's payload), else f32 values.
    encoded: bool,
    /// The rows are left out (the receiver's partition `from` holds them as its skip record:
    /// see [`Mirrors`]); `payload` holds their BLAKE3 digest (32 bytes).
    mirror: bool,
    payload: RawRange,
}

impl WireBlock {
    fn of(b: &HaloBlock, raw: &mut RawLayout, mirror: bool) -> Self {
        let encoded = matches!(b.payload, HaloPayload::Encoded(_));
        let len = if mirror {
            DIGEST_LEN as u64
        } else {
            b.payload.len_bytes()
        };
        WireBlock {
            epoch: b.header.epoch,
            phase: phase_code(b.header.phase),
            layer: b.header.layer,
            from: b.header.from.0,
            to: b.header.to.0,
            rows: b.rows,
            cols: b.cols,
            encoded,
            mirror,
            payload: raw.take(len),
        }
    }

    /// The block (run id nil: a held block is only read for its rows). Fp32 values must be
    /// exactly `rows x cols`; encoded payloads are checked by the decoder when used.
    /// Rows left out are taken from `mirrors` (the receiver's own partitions).
    fn block(self, raw: &Raw<'_>, mirrors: &MirrorSource<'_>) -> Result<HaloBlock, String> {
        let phase = phase_of(self.phase)
            .ok_or_else(|| format!("held halo block with unknown phase {}", self.phase))?;
        let payload = if self.mirror {
            let key = MirrorKey {
                holder: self.from,
                peer: mirrors.part,
                phase: self.phase,
                layer: self.layer,
                record: true,
            };
            HaloPayload::Encoded(mirrors.payload(key, raw.bytes(self.payload)?)?)
        } else if self.encoded {
            HaloPayload::Encoded(Arc::from(raw.bytes(self.payload)?))
        } else {
            let values = raw.floats(self.payload)?;
            if values.len() as u64 != self.rows as u64 * self.cols as u64 {
                return Err(format!(
                    "held halo block from partition {} holds {} values, not {}x{}",
                    self.from,
                    values.len(),
                    self.rows,
                    self.cols
                ));
            }
            HaloPayload::F32(values)
        };
        Ok(HaloBlock {
            header: MsgHeader {
                run: RunId::nil(),
                epoch: self.epoch,
                layer: self.layer,
                phase,
                from: PartId(self.from),
                to: PartId(self.to),
            },
            rows: self.rows,
            cols: self.cols,
            payload,
            trace: None,
        })
    }
}

#[derive(Archive, Serialize, Deserialize)]
struct WireTensor {
    rows: u32,
    cols: u32,
    data: Vec<f32>,
}

impl WireTensor {
    fn of(t: &Tensor) -> Self {
        WireTensor {
            rows: t.rows() as u32,
            cols: t.cols() as u32,
            data: t.as_slice().to_vec(),
        }
    }

    fn tensor(self) -> Result<Tensor, String> {
        Tensor::from_vec(self.rows as usize, self.cols as usize, self.data)
            .map_err(|e| e.to_string())
    }
}

/// A snapshot as it travels to a replica node: its bytes and the BLAKE3 digest the sender
/// computed of them. The receiver keeps both; a restore checks the bytes against the
/// sender's digest before decoding them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaBytes {
    pub part: u32,
    /// The step the snapshot was taken after.
    pub epoch: u32,
    /// Shared, never copied once made: assembled or patched buffers become this without a
    /// copy (a `Vec<u8>` into `Arc<[u8]>` copies the whole, and a replica of held halo rows
    /// is hundreds of MB, kept for two steps).
    pub bytes: bytes::Bytes,
    /// Hex BLAKE3 of `bytes`, computed by the sender.
    pub digest: String,
}

impl ReplicaBytes {
    /// Encodes `snap` (host tensors) for replication, model included.
    pub fn encode(part: u32, snap: &Snapshot) -> Self {
        Encoding::start(part, snap, true, &Mirrors::default()).finish(snap)
    }

    /// Encodes `snap` without its model and optimizer state (see the module's doc).
    pub fn encode_without_model(part: u32, snap: &Snapshot) -> Self {
        Self::encode_for(part, snap, &Mirrors::default())
    }

    /// Encodes `snap` without its model and optimizer state, and without the payloads of
    /// `mirrors` (see the module's doc).
    pub fn encode_for(part: u32, snap: &Snapshot, mirrors: &Mirrors) -> Self {
        Encoding::start(part, snap, false, mirrors).finish(snap)
    }
}

/// A snapshot's encoding in two parts: the archive of its small fields ([`Encoding::start`],
/// cheap: the model and the payloads' layout) and the one buffer with every payload written
/// into it and its digest ([`Encoding::finish`], which grows with the held rows and can run
/// on another thread). The encoded length is known from the start.
pub struct Encoding {
    part: u32,
    epoch: u32,
    archive: rkyv::util::AlignedVec,
    /// Where each held block's and each skip record's payload goes in the raw section, and
    /// whether only its digest does (a mirror).
    blocks: Vec<(RawRange, bool)>,
    records: Vec<(RawRange, RawRange, bool)>,
    raw_len: u64,
    /// Bytes of the payloads left out, less the digests carried in their place.
    left_out: u64,
}

impl Encoding {
    /// Lays `snap` out and archives its small fields (and, `with_model`, its model and
    /// optimizer state); the payloads of `mirrors` are laid out as their digests.
    pub fn start(part: u32, snap: &Snapshot, with_model: bool, mirrors: &Mirrors) -> Self {
        // Raw section order: training blocks, training records, evaluation blocks, evaluation
        // records (see the module's doc); the archive keeps the snapshot's own order.
        let mut raw = RawLayout::default();
        let mut held: Vec<Option<WireBlock>> = snap.held_halo.iter().map(|_| None).collect();
        let mut sent: Vec<Option<WireSent>> = snap.skip_sent.iter().map(|_| None).collect();
        // Bytes of the payloads left out, less the digests laid out in their place.
        let mut left_out = 0;
        let mut leave_out = |mirror: bool, len: usize| {
            if mirror {
                left_out += len.saturating_sub(DIGEST_LEN) as u64;
            }
            mirror
        };
        for eval in [false, true] {
            for (i, b) in snap.held_halo.iter().enumerate() {
                if (b.header.phase == Phase::Eval) == eval {
                    let mirror = leave_out(mirrors.block(b), b.payload.len_bytes() as usize);
                    held[i] = Some(WireBlock::of(b, &mut raw, mirror));
                }
            }
            for (i, r) in snap.skip_sent.iter().enumerate() {
                if (r.phase == Phase::Eval) == eval {
                    let len = match &r.values {
                        SentValues::Encoded(b) => b.len(),
                        SentValues::Int8 { .. } => 0,
                    };
                    let mirror = leave_out(mirrors.record(r), len);
                    sent[i] = Some(WireSent::of(r, &mut raw, mirror));
                }
            }
        }
        let held_halo: Vec<WireBlock> = held.into_iter().flatten().collect();
        let skip_sent: Vec<WireSent> = sent.into_iter().flatten().collect();
        let (params, moments) = if with_model {
            (
                snap.params.iter().map(WireTensor::of).collect(),
                snap.opt_state
                    .iter()
                    .map(|(m, v)| (WireTensor::of(m), WireTensor::of(v)))
                    .collect(),
            )
        } else {
            (Vec::new(), Vec::new())
        };
        let wire = SnapshotWire {
            epoch: snap.epoch,
            model_elided: !with_model,
            params,
            moments,
            opt_steps: snap.opt_steps,
            digest: snap.digest.clone(),
            grad_residual: snap.grad_residual.clone(),
            held_halo,
            skip_sent,
        };
        let archive = rkyv::to_bytes::<rkyv::rancor::Error>(&wire)
            .expect("serialising plain data into a growable buffer cannot fail");
        Encoding {
            part,
            epoch: snap.epoch,
            archive,
            blocks: wire
                .held_halo
                .iter()
                .map(|w| (w.payload, w.mirror))
                .collect(),
            records: wire
                .skip_sent
                .iter()
                .map(|w| (w.codes, w.scales, w.mirror))
                .collect(),
            raw_len: raw.len,
            left_out,
        }
    }

    /// Bytes of the state the encoding leaves out ([`Mirrors`]), less the digests it carries
    /// in their place: with [`Encoding::len`], the size of the whole state.
    pub fn left_out(&self) -> u64 {
        self.left_out
    }

    /// Bytes of the encoded snapshot.
    pub fn len(&self) -> u64 {
        8 + self.archive.len() as u64 + self.raw_len
    }

    /// Whether the encoding is empty (never: it always has a header).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Writes the payloads of `snap` (the snapshot [`Encoding::start`] laid out) and digests
    /// the whole.
    pub fn finish(self, snap: &Snapshot) -> ReplicaBytes {
        self.finish_with(snap, &mut MirrorDigests::default())
    }

    /// As [`Encoding::finish`], taking the digests of payloads left out that are unchanged
    /// since the partition's last replica from `digests` (and noting this one's there).
    pub fn finish_with(self, snap: &Snapshot, digests: &mut MirrorDigests) -> ReplicaBytes {
        let prev = digests.0.remove(&self.part).unwrap_or_default();
        let mut next = Vec::new();
        let mut digest_of = |p: &Arc<[u8]>| MirrorDigests::digest(&prev, &mut next, p);
        let end = 8 + self.raw_len as usize;
        // One allocation, the size of the whole; every payload is written into it once.
        let mut buf = vec![0u8; self.len() as usize];
        buf[..8].copy_from_slice(&self.raw_len.to_le_bytes());
        buf[end..].copy_from_slice(&self.archive);
        let section = &mut buf[8..end];
        for (b, (r, mirror)) in snap.held_halo.iter().zip(&self.blocks) {
            let dst = &mut section[r.offset as usize..][..r.len as usize];
            match &b.payload {
                HaloPayload::Encoded(e) if *mirror => dst.copy_from_slice(&digest_of(e)),
                HaloPayload::F32(d) => put_floats(dst, d),
                HaloPayload::Encoded(e) => dst.copy_from_slice(e),
            }
        }
        for (s, (codes, scales, mirror)) in snap.skip_sent.iter().zip(&self.records) {
            let dst = &mut section[codes.offset as usize..][..codes.len as usize];
            match &s.values {
                SentValues::Encoded(b) if *mirror => dst.copy_from_slice(&digest_of(b)),
                SentValues::Encoded(b) => dst.copy_from_slice(b),
                SentValues::Int8 {
                    codes: c,
                    scales: f,
                } => {
                    dst.copy_from_slice(bytemuck::cast_slice(c));
                    let dst = &mut section[scales.offset as usize..][..scales.len as usize];
                    put_floats(dst, f);
                }
            }
        }
        digests.0.insert(self.part, next);
        let digest = blake3::hash(&buf).to_hex().to_string();
        ReplicaBytes {
            part: self.part,
            epoch: self.epoch,
            bytes: buf.into(),
            digest,
        }
    }
}

impl ReplicaBytes {
    /// Checks the bytes against the sender's digest, then decodes them. Never panics on bad
    /// bytes: a mismatch or a corrupt archive is an error saying which; so is a replica that
    /// left its model out (decode it with [`ReplicaBytes::decode_in`]).
    pub fn decode(&self) -> Result<Snapshot, String> {
        match self.decode_parts(None)? {
            (snap, false) => Ok(snap),
            (snap, true) => Err(format!(
                "replica of partition {} (step {}) leaves the model out: it is completed only on a node that hosts a partition",
                self.part, snap.epoch
            )),
        }
    }

    /// As [`ReplicaBytes::decode`]; a replica that left its model out is completed from the
    /// model and optimizer state of the same step that `store`'s own partitions committed,
    /// with the weights digest it names (an error naming the partition and step when `store`
    /// holds none), and one that left out rows this node's partitions hold ([`Mirrors`])
    /// from their snapshots of that step, each checked against the digest it names.
    pub fn decode_in(&self, store: &ReplicaStore) -> Result<Snapshot, String> {
        let (mut snap, elided) = self.decode_parts(Some(store))?;
        if elided {
            let model = store.model_at(snap.epoch, &snap.digest).ok_or_else(|| {
                format!(
                    "replica of partition {} (step {}) leaves the model out, and no partition of this node holds step {} with weights {}",
                    self.part, snap.epoch, snap.epoch, snap.digest
                )
            })?;
            snap.params = model.params.clone();
            snap.opt_state = model.opt_state.clone();
        }
        Ok(snap)
    }

    /// The raw section and the archive of small fields (not checked against the digest).
    fn parts(&self) -> Result<(Raw<'_>, SnapshotWire), String> {
        let corrupt = |e: String| format!("replica of partition {}: corrupt: {e}", self.part);
        let len = self
            .bytes
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .filter(|n| *n <= self.bytes.len() as u64 - 8)
            .ok_or_else(|| corrupt("no raw section length".into()))?;
        let (raw, archive) = self.bytes[8..].split_at(len as usize);
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(archive.len());
        aligned.extend_from_slice(archive);
        let w = rkyv::from_bytes::<SnapshotWire, rkyv::rancor::Error>(&aligned)
            .map_err(|e| corrupt(e.to_string()))?;
        Ok((Raw(raw), w))
    }

    /// The payloads this replica left out ([`Mirrors`]): what decoding it completes from
    /// the snapshots of their holders.
    pub fn left_out(&self) -> Result<Vec<MirrorKey>, String> {
        let (_, w) = self.parts()?;
        let blocks = w.held_halo.iter().filter(|b| b.mirror).map(|b| MirrorKey {
            holder: b.from,
            peer: self.part,
            phase: b.phase,
            layer: b.layer,
            record: true,
        });
        let records = w.skip_sent.iter().filter(|r| r.mirror).map(|r| MirrorKey {
            holder: r.to,
            peer: self.part,
            phase: r.phase,
            layer: r.layer,
            record: false,
        });
        Ok(blocks.chain(records).collect())
    }

    /// The snapshot as shipped, and whether it left its model out; rows it left out are
    /// completed from `store` (an error without one).
    fn decode_parts(&self, store: Option<&ReplicaStore>) -> Result<(Snapshot, bool), String> {
        let got = blake3::hash(&self.bytes).to_hex().to_string();
        if got != self.digest {
            return Err(format!(
                "replica of partition {} (step {}): bytes digest {got} is not the sender's {}",
                self.part, self.epoch, self.digest
            ));
        }
        let (raw, w) = self.parts()?;
        let elided = w.model_elided;
        let mirrors = MirrorSource {
            part: self.part,
            epoch: w.epoch,
            store,
        };
        let snap = Snapshot {
            epoch: w.epoch,
            params: w
                .params
                .into_iter()
                .map(WireTensor::tensor)
                .collect::<Result<_, _>>()?,
            opt_state: w
                .moments
                .into_iter()
                .map(|(m, v)| Ok((m.tensor()?, v.tensor()?)))
                .collect::<Result<_, String>>()?,
            opt_steps: w.opt_steps,
            digest: w.digest,
            grad_residual: w.grad_residual,
            held_halo: w
                .held_halo
                .into_iter()
                .map(|b| b.block(&raw, &mirrors))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("replica of partition {}: {e}", self.part))?,
            skip_sent: w
                .skip_sent
                .into_iter()
                .map(|s| s.record(&raw, &mirrors))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("replica of partition {}: {e}", self.part))?,
        };
        Ok((snap, elided))
    }
}

/// Bytes of a replica per piece on the wire: a replica larger than this (held halo rows grow
/// with the graph, to hundreds of MB) travels in pieces, each a bulk message of its own that
/// shares the link with halo blocks, and the receiving store puts them together
/// ([`ReplicaStore::put_remote_piece`]).
pub const REPLICA_PIECE: usize = 8 << 20;

/// One piece of partition `part`'s replica of step `epoch`: `data` is `bytes[offset ..]` of
/// the whole, which is `total` bytes long and has BLAKE3 digest `digest`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaPiece {
    pub part: u32,
    pub epoch: u32,
    pub digest: String,
    pub offset: u64,
    pub total: u64,
    pub data: Vec<u8>,
}

/// The byte ranges of a payload of `total` bytes in pieces of at most [`REPLICA_PIECE`]
/// bytes, in order (one, maybe empty, for a small payload).
pub fn piece_ranges(total: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..total.div_ceil(REPLICA_PIECE).max(1))
        .map(move |i| i * REPLICA_PIECE..((i + 1) * REPLICA_PIECE).min(total))
}

impl ReplicaBytes {
    /// The replica in pieces of at most [`REPLICA_PIECE`] bytes, in order (one for a small
    /// replica).
    pub fn pieces(&self) -> impl Iterator<Item = ReplicaPiece> + '_ {
        let total = self.bytes.len();
        piece_ranges(total).map(move |r| ReplicaPiece {
            part: self.part,
            epoch: self.epoch,
            digest: self.digest.clone(),
            offset: r.start as u64,
            total: total as u64,
            data: self.bytes[r].to_vec(),
        })
    }
}

/// A payload of `total` bytes whose pieces ([`piece_ranges`]) are arriving, in any order.
struct Pieces {
    total: u64,
    /// Which pieces (by index: offset / [`REPLICA_PIECE`]) arrived.
    arrived: Vec<bool>,
    bytes: bytes::BytesMut,
}

impl Pieces {
    /// None arrived yet; they are written into `bytes` (cleared).
    fn start(total: u64, mut bytes: bytes::BytesMut) -> Self {
        let count = total.div_ceil(REPLICA_PIECE as u64).max(1);
        bytes.clear();
        Pieces {
            total,
            arrived: vec![false; count.min(MAX_REPLICA / REPLICA_PIECE as u64) as usize],
            bytes,
        }
    }

    /// Takes bytes `offset..` of the whole, which the sender says is `total` bytes: false
    /// if they are not the next of its pieces at that index (another total, a length or
    /// offset off its grid, a piece that arrived already).
    fn put(&mut self, offset: u64, total: u64, data: &[u8]) -> bool {
        let step = REPLICA_PIECE as u64;
        let index = offset / step;
        let expected = total.saturating_sub(offset).min(step);
        let fits = self.total == total
            && total <= MAX_REPLICA
            && offset.is_multiple_of(step)
            && index < total.div_ceil(step).max(1)
            && data.len() as u64 == expected
            && self.arrived.get(index as usize) == Some(&false);
        if !fits {
            return false;
        }
        // The buffer grows to the end of the furthest piece so far (at most `total`).
        let (offset, end) = (offset as usize, (offset + expected) as usize);
        if self.bytes.len() < end {
            self.bytes.resize(end, 0);
        }
        self.bytes[offset..end].copy_from_slice(data);
        self.arrived[index as usize] = true;
        true
    }

    /// Whether every piece arrived.
    fn whole(&self) -> bool {
        self.arrived.iter().all(|&got| got)
    }
}

/// A replica whose pieces are arriving (in any order).
struct Assembly {
    digest: String,
    pieces: Pieces,
}

/// The largest replica a store assembles (a bound on what a piece's `total` may claim).
const MAX_REPLICA: u64 = 1 << 40;

/// The model and optimizer state one of a node's partitions committed after a step (what a
/// replica that left them out is completed from).
#[derive(Debug)]
struct CommittedModel {
    epoch: u32,
    digest: String,
    params: Vec<Tensor>,
    opt_state: Vec<(Tensor, Tensor)>,
}

/// Steps whose committed model a node keeps (a recovery resumes the committed step, at most
/// one behind a partition's newest; one more for margin).
const MODELS_KEPT: usize = 3;

/// A partition's dynamic state after an optimizer step.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Epochs completed (the step number).
    pub epoch: u32,
    pub params: Vec<Tensor>,
    /// Optimizer moments, in parameter order.
    pub opt_state: Vec<(Tensor, Tensor)>,
    pub opt_steps: u64,
    /// Digest of `params` when the snapshot was taken.
    pub digest: String,
    /// The partition's gradient-compression residual (error feedback) after the step; empty
    /// with exact gradients.
    pub grad_residual: Vec<f32>,
    /// `--staleness 1`: the halo blocks the partition received during the step's training
    /// pass, which the next epoch's training pass uses (ascending phase, layer tag, sender);
    /// empty otherwise.
    pub held_halo: Vec<HaloBlock>,
    /// `--skip-threshold`: the partition's record of the rows each receiver holds (what it
    /// sent them last); empty otherwise.
    pub skip_sent: Vec<SentRows>,
}

impl Snapshot {
    /// Bytes of the held halo blocks' payloads and of the skip records (what `--staleness`
    /// and `--skip-threshold` add to a replica).
    pub fn held_halo_bytes(&self) -> u64 {
        let records: u64 = self.skip_sent.iter().map(|s| s.bytes()).sum::<u64>();
        self.held_halo
            .iter()
            .map(HaloBlock::payload_bytes)
            .sum::<u64>()
            + records
    }
}

/// A partition's error-feedback residual computed by the step in progress, before its
/// optimizer step commits it (`--grad-codec`). Kept in the node's store, outside the actor: a
/// partition restarted *during* that optimizer step replays the step from the all-reduced sum
/// alone, and resumes with this residual instead of losing it.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingResidual {
    /// The step (epoch) whose backward pass computed it.
    pub epoch: u32,
    pub residual: Vec<f32>,
}

/// Ships a partition's committed state to the nodes that keep its replica (cluster runs).
pub type ReplicaSender = Arc<dyn Fn(ReplicaBytes) + Send + Sync>;

/// A snapshot on its way to the replication thread, its small fields encoded.
struct Shipment {
    encoding: Encoding,
    snap: Arc<Snapshot>,
}

/// How far the replication thread has got.
#[derive(Default)]
struct ShipmentCount {
    queued: std::sync::atomic::AtomicU64,
    sent: std::sync::atomic::AtomicU64,
}

/// The replicas a node keeps: the latest snapshot of each partition it hosts (a restarted
/// actor restores from it), and the replicated bytes of partitions hosted on other nodes
/// (adopting one after its node is lost restores from them, checked against the sender's
/// digest). Shared by the actors of one node.
#[derive(Default)]
pub struct ReplicaStore {
    snaps: DashMap<u32, Arc<Snapshot>>,
    /// The two newest steps of each (a step can be replicated before the coordinator commits
    /// it; a recovery then resumes from the one before).
    remote: DashMap<u32, Vec<ReplicaBytes>>,
    /// Each hosted partition's residual of the step in progress (see [`PendingResidual`]).
    pending: DashMap<u32, PendingResidual>,
    /// Encodes and ships snapshots on a thread of its own (cluster runs), in the order put.
    shipping: std::sync::OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<Shipment>>>,
    /// Snapshots given to the replication thread, and those it has handed to the transport.
    shipments: Arc<ShipmentCount>,
    /// Replication off: nothing is stored (measures what replication costs).
    disabled: bool,
    /// Replicas shipped from here leave the model out (every receiver hosts a partition).
    elide_model: std::sync::atomic::AtomicBool,
    /// While replicas leave the model out: the model of the newest steps this node's
    /// partitions committed, one copy per step.
    models: std::sync::Mutex<Vec<Arc<CommittedModel>>>,
    /// Stores arriving pieces on a thread of its own ([`ReplicaStore::receive_in_background`]).
    intake: std::sync::OnceLock<intake::Intake>,
    /// Replicas arriving in pieces, by (sender, partition, step).
    assembling: std::sync::Mutex<std::collections::HashMap<(u32, u32, u32), Assembly>>,
    /// Replicas arriving as patches, by (sender, partition, step).
    patching: std::sync::Mutex<std::collections::HashMap<(u32, u32, u32), Patching>>,
    /// Which rows the replicas shipped from here leave out ([`ReplicaStore::set_mirrors`]).
    mirrors_of: std::sync::OnceLock<MirrorsOf>,
    /// While replicas leave rows out: the snapshots of the newest steps of each partition
    /// hosted here (newest last), which replicas from other nodes are completed from.
    history: std::sync::Mutex<std::collections::HashMap<u32, Vec<Arc<Snapshot>>>>,
    /// Payloads left out of replicas kept here, fetched from the nodes that hold them to adopt
    /// a partition ([`ReplicaStore::put_fetched`]), by step and key.
    fetched: std::sync::Mutex<std::collections::HashMap<(u32, MirrorKey), Fetched>>,
}

/// A payload being fetched for an adoption ([`ReplicaStore::put_fetched`]).
enum Fetched {
    /// Asked of node `from`; no piece arrived yet.
    Asked {
        from: u32,
    },
    /// Pieces arriving from node `from`.
    Arriving {
        from: u32,
        pieces: Pieces,
    },
    Whole(Arc<[u8]>),
    /// The node asked does not hold it (or sent pieces that do not fit): why.
    Refused(String),
}

/// Where fetching the payloads an adoption needs stands ([`ReplicaStore::fetch_progress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchProgress {
    /// Every payload is here.
    Done,
    /// So many payloads are still to come.
    Waiting(usize),
    /// One cannot come: why.
    Failed(String),
}

/// A replica being rebuilt from its base and the pieces of its patch (in any order).
struct Patching {
    digest: String,
    total: u64,
    count: u32,
    arrived: Vec<bool>,
    bytes: bytes::BytesMut,
}

impl std::fmt::Debug for ReplicaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaStore")
            .field("own", &self.snaps.len())
            .field("remote", &self.remote.len())
            .field("ships", &self.shipping.get().is_some())
            .field("disabled", &self.disabled)
            .finish()
    }
}

impl ReplicaStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that keeps nothing: replication off.
    pub fn disabled() -> Self {
        ReplicaStore {
            disabled: true,
            ..Self::default()
        }
    }

    /// Whether snapshots are kept (replication on).
    pub fn enabled(&self) -> bool {
        !self.disabled
    }

    /// Ships every committed snapshot after the first step to other nodes through `sender`
    /// (set once, by the cluster node that owns this store). `without_model`: every node the
    /// replicas go to hosts a partition, so they leave the model out (see the module's doc),
    /// and this store keeps its own partitions' models of the newest steps for the same use.
    pub fn set_sender(&self, sender: ReplicaSender, without_model: bool) {
        if self.shipping.get().is_some() {
            return;
        }
        self.elide_model
            .store(without_model, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel::<Shipment>();
        let count = self.shipments.clone();
        let spawned = std::thread::Builder::new()
            .name("trellis-replicate".into())
            .spawn(move || {
                // Keeps the calling class (unlike the intake thread): until a replica has
                // left, a node lost with it takes the step with it (ARCHITECTURE.md,
                // "Replicated state", step 5).
                // Ends when the store (the channel's sender) is dropped.
                let mut digests = MirrorDigests::default();
                while let Ok(s) = rx.recv() {
                    sender(s.encoding.finish_with(&s.snap, &mut digests));
                    count
                        .sent
                        .fetch_add(1, std::sync::atomic::Ordering::Release);
                }
            });
        match spawned {
            Ok(_) => {
                let _ = self.shipping.set(std::sync::Mutex::new(tx));
            }
            Err(e) => tracing::error!("no replication thread: {e}; replicas are not shipped"),
        }
    }

    /// Waits at most `within` until every snapshot put so far has been handed to the
    /// transport by the replication thread (the transport's `flush` then waits for its
    /// delivery); whether it was. True at once when nothing is shipped.
    pub fn wait_shipped(&self, within: std::time::Duration) -> bool {
        use std::sync::atomic::Ordering;
        let target = self.shipments.queued.load(Ordering::Acquire);
        let until = std::time::Instant::now() + within;
        while self.shipments.sent.load(Ordering::Acquire) < target {
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }

    /// Stores `part`'s latest snapshot and, in a cluster, ships it to the partition's replica
    /// nodes (the initial state, step 0, is not shipped: any node recomputes it from the
    /// configuration). Returns the bytes of state replicated: those shipped to each replica
    /// node and those the replica left out for its receiver's partitions hold them
    /// ([`Mirrors`]) (0: none). Only the
    /// snapshot's layout and small fields are encoded here; its payloads are written, digested
    /// and shipped on the store's replication thread, overlapped with the next epoch.
    pub fn put(&self, part: u32, snap: Arc<Snapshot>) -> u64 {
        if self.disabled {
            return 0;
        }
        let mut shipped = 0;
        let with_model = !self.elides_model();
        if !with_model {
            self.keep_model(&snap);
        }
        self.keep_history(part, &snap);
        if let Some(queue) = self.shipping.get() {
            if snap.epoch > 0 {
                use trellis_runtime::metrics::{names, Key, Metrics};
                let mirrors = self.mirrors_of.get().map(|f| f(part)).unwrap_or_default();
                let encoding = Encoding::start(part, &snap, with_model, &mirrors);
                shipped = encoding.len() + encoding.left_out();
                let metrics = Metrics::global();
                let key = |name| Key::new(name).with("partition", part);
                metrics.add(key(names::REPLICA_BYTES), shipped);
                if encoding.left_out() > 0 {
                    metrics.add(key(names::REPLICA_MIRRORED_BYTES), encoding.left_out());
                }
                let held = snap.held_halo_bytes();
                if held > 0 {
                    metrics.add(key(names::REPLICA_HALO_BYTES), held);
                }
                let shipment = Shipment {
                    encoding,
                    snap: snap.clone(),
                };
                let queue = queue.lock().unwrap_or_else(|p| p.into_inner());
                self.shipments
                    .queued
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                if queue.send(shipment).is_err() {
                    tracing::error!("partition {part}: the replication thread is gone");
                }
            }
        }
        self.snaps.insert(part, snap);
        shipped
    }

    /// Replaces `part`'s own snapshot without shipping it (a partition rolled back to the
    /// committed step before its latest one: every replica node still keeps that step).
    pub fn put_local(&self, part: u32, snap: Arc<Snapshot>) {
        if !self.disabled {
            if self.elides_model() {
                self.keep_model(&snap);
            }
            self.keep_history(part, &snap);
            self.snaps.insert(part, snap);
        }
    }

    /// Leaves out of the replicas shipped from here the rows their receiver holds
    /// ([`Mirrors`]; `of` says which for each partition), and keeps the snapshots of the
    /// newest three steps of this node's partitions, which replicas from other
    /// nodes that leave rows out are completed from: every node of a cluster sets it alike.
    /// Set once.
    pub fn set_mirrors(&self, of: MirrorsOf) {
        if !self.disabled {
            let _ = self.mirrors_of.set(of);
        }
    }

    /// Keeps `snap` among `part`'s newest snapshots while replicas leave rows out (one per
    /// step: a step replayed after a rollback replaces its first snapshot).
    fn keep_history(&self, part: u32, snap: &Arc<Snapshot>) {
        if self.mirrors_of.get().is_none() {
            return;
        }
        let mut history = self.history.lock().unwrap_or_else(|p| p.into_inner());
        let kept = history.entry(part).or_default();
        kept.retain(|s| s.epoch != snap.epoch);
        kept.push(snap.clone());
        kept.sort_by_key(|s| s.epoch);
        let extra = kept.len().saturating_sub(MODELS_KEPT);
        kept.drain(..extra);
    }

    /// The payload `key` names in the snapshot of step `epoch` of this node's partition
    /// `key.holder` (see [`Mirrors`]), if this node keeps it: what a node adopting
    /// `key.peer` fetches from here.
    pub fn mirror_at(&self, epoch: u32, key: MirrorKey) -> Option<Arc<[u8]>> {
        let history = self.history.lock().unwrap_or_else(|p| p.into_inner());
        let snap = history
            .get(&key.holder)?
            .iter()
            .find(|s| s.epoch == epoch)?;
        if key.record {
            let r = snap.skip_sent.iter().find(|r| {
                r.to.0 == key.peer && phase_code(r.phase) == key.phase && r.layer == key.layer
            })?;
            match &r.values {
                SentValues::Encoded(b) => Some(b.clone()),
                SentValues::Int8 { .. } => None,
            }
        } else {
            let b = snap.held_halo.iter().find(|b| {
                b.header.from.0 == key.peer
                    && phase_code(b.header.phase) == key.phase
                    && b.header.layer == key.layer
            })?;
            match &b.payload {
                HaloPayload::Encoded(e) => Some(e.clone()),
                HaloPayload::F32(_) => None,
            }
        }
    }

    /// The payloads that the replica of partition `part` at step `epoch` kept here left out
    /// and this node cannot complete from its own partitions or has not fetched yet: what
    /// an adoption of `part` first fetches from the nodes hosting their holders. Empty when
    /// no such replica is kept (the adoption then fails, naming the steps kept).
    pub fn missing_mirrors(&self, part: u32, epoch: u32) -> Result<Vec<MirrorKey>, String> {
        let Some(replica) = self.remote_at(part, epoch) else {
            return Ok(Vec::new());
        };
        Ok(replica
            .left_out()?
            .into_iter()
            .filter(|&k| self.mirror_at(epoch, k).is_none() && self.fetched_at(epoch, k).is_none())
            .collect())
    }

    /// Expects the payloads `keys` of step `epoch` from node `from` (asked by an adoption):
    /// only pieces of payloads expected, from the node asked, are taken.
    pub fn expect_fetched(&self, epoch: u32, keys: &[MirrorKey], from: u32) {
        let mut fetched = self.fetched.lock().unwrap_or_else(|p| p.into_inner());
        for &k in keys {
            fetched.insert((epoch, k), Fetched::Asked { from });
        }
    }

    /// Takes one piece of a payload fetched for an adoption from node `from`: `data` is
    /// bytes `offset..` of the payload `key` names at step `epoch`, `total` bytes long;
    /// `found` false: the node asked does not hold it. A piece of a payload not expected
    /// from `from` ([`ReplicaStore::expect_fetched`]) is dropped. Checked against the
    /// replica's digest when it is used.
    #[allow(clippy::too_many_arguments)]
    pub fn put_fetched(
        &self,
        from: u32,
        epoch: u32,
        key: MirrorKey,
        found: bool,
        offset: u64,
        total: u64,
        data: Vec<u8>,
    ) {
        let mut fetched = self.fetched.lock().unwrap_or_else(|p| p.into_inner());
        let Some(entry) = fetched.get_mut(&(epoch, key)) else {
            tracing::warn!(
                peer = from,
                "dropped rows not asked for: {key:?} at step {epoch}"
            );
            return;
        };
        let asked_of = match entry {
            Fetched::Asked { from } | Fetched::Arriving { from, .. } => *from,
            Fetched::Whole(_) | Fetched::Refused(_) => u32::MAX,
        };
        if asked_of != from {
            tracing::warn!(
                peer = from,
                "dropped rows not asked of node {from}: {key:?} at step {epoch}"
            );
            return;
        }
        let refused =
            |why: String| Fetched::Refused(format!("{} at step {epoch}: {why}", key.describe()));
        if !found {
            *entry = refused(format!("node {from}, which hosts it, does not hold it"));
            return;
        }
        if let Fetched::Asked { .. } = entry {
            *entry = Fetched::Arriving {
                from,
                pieces: Pieces::start(total, bytes::BytesMut::new()),
            };
        }
        let Fetched::Arriving { pieces, .. } = entry else {
            return;
        };
        if !pieces.put(offset, total, &data) {
            *entry = refused(format!(
                "node {from} sent a piece at {offset}..+{} that does not fit {total} bytes",
                data.len()
            ));
            return;
        }
        if pieces.whole() {
            use trellis_runtime::metrics::{names, Key, Metrics};
            let key = Key::new(names::REPLICA_FETCHED_BYTES).with("partition", key.peer);
            Metrics::global().add(key, total);
            let bytes = std::mem::take(&mut pieces.bytes);
            *entry = Fetched::Whole(Arc::from(&bytes[..]));
        }
    }

    /// Whether every payload of `keys` at step `epoch` was fetched whole.
    pub fn fetch_progress(&self, epoch: u32, keys: &[MirrorKey]) -> FetchProgress {
        let fetched = self.fetched.lock().unwrap_or_else(|p| p.into_inner());
        let mut waiting = 0;
        for k in keys {
            match fetched.get(&(epoch, *k)) {
                Some(Fetched::Whole(_)) => {}
                Some(Fetched::Refused(why)) => return FetchProgress::Failed(why.clone()),
                Some(Fetched::Asked { .. } | Fetched::Arriving { .. }) | None => waiting += 1,
            }
        }
        if waiting == 0 {
            FetchProgress::Done
        } else {
            FetchProgress::Waiting(waiting)
        }
    }

    /// A payload fetched whole for an adoption.
    fn fetched_at(&self, epoch: u32, key: MirrorKey) -> Option<Arc<[u8]>> {
        let fetched = self.fetched.lock().unwrap_or_else(|p| p.into_inner());
        match fetched.get(&(epoch, key))? {
            Fetched::Whole(b) => Some(b.clone()),
            _ => None,
        }
    }

    /// Drops every fetched payload (an adoption restored what it needed).
    pub fn clear_fetched(&self) {
        self.fetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    fn elides_model(&self) -> bool {
        self.elide_model.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keeps `snap`'s model (once per step and digest; the newest [`MODELS_KEPT`] steps).
    fn keep_model(&self, snap: &Snapshot) {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if models
            .iter()
            .any(|m| m.epoch == snap.epoch && m.digest == snap.digest)
        {
            return;
        }
        models.push(Arc::new(CommittedModel {
            epoch: snap.epoch,
            digest: snap.digest.clone(),
            params: snap.params.clone(),
            opt_state: snap.opt_state.clone(),
        }));
        models.sort_by_key(|m| std::cmp::Reverse(m.epoch));
        models.truncate(MODELS_KEPT);
    }

    /// The model this node's partitions committed after step `epoch` with weights `digest`.
    fn model_at(&self, epoch: u32, digest: &str) -> Option<Arc<CommittedModel>> {
        let models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        models
            .iter()
            .find(|m| m.epoch == epoch && m.digest == digest)
            .cloned()
    }

    /// Stores the replica pieces that reach this node ([`ReplicaStore::receive`]) on a thread
    /// of its own, in order, off the caller's (the `intake` module). Set once, by a cluster
    /// node.
    pub fn receive_in_background(self: &Arc<Self>) {
        if self.disabled || self.intake.get().is_some() {
            return;
        }
        match intake::Intake::start(Arc::downgrade(self)) {
            Ok(i) => {
                let _ = self.intake.set(i);
            }
            Err(e) => {
                tracing::error!("no replica intake thread: {e}; pieces are stored on arrival")
            }
        }
    }

    /// Takes a piece of a replica node `from` shipped and calls `then` with what storing it
    /// gave: on the intake thread where [`ReplicaStore::receive_in_background`] started one,
    /// else at once.
    pub fn receive(&self, from: u32, piece: ReceivedPiece, then: OnStored) {
        let (piece, then) = match self.intake.get() {
            Some(intake) => match intake.push(from, piece, then) {
                Ok(()) => return,
                Err(back) => back,
            },
            None => (piece, then),
        };
        then(self.store_piece(from, piece))
    }

    /// Stores one received piece (see [`ReplicaStore::receive`]).
    fn store_piece(&self, from: u32, piece: ReceivedPiece) -> Stored {
        match piece {
            ReceivedPiece::Whole(p) => self.put_remote_piece(from, p),
            ReceivedPiece::Patch(p) => self.put_remote_delta_piece(from, p),
        }
    }

    /// Keeps the replica of another node's partition (with the one step before it).
    pub fn put_remote(&self, bytes: ReplicaBytes) {
        if self.disabled {
            return;
        }
        let mut kept = self.remote.entry(bytes.part).or_default();
        kept.retain(|b| b.epoch != bytes.epoch);
        kept.push(bytes);
        kept.sort_by_key(|b| b.epoch);
        if kept.len() > 2 {
            kept.remove(0);
        }
    }

    /// Takes one piece of a replica node `from` ships; once every piece of it arrived, keeps
    /// the replica ([`ReplicaStore::put_remote`]) and returns its partition and step. Pieces
    /// may come in any order; each is the `REPLICA_PIECE`-long slice at its index (the last
    /// one shorter). A piece that does not fit the others (another length or digest, not at
    /// a piece's place, one that already arrived) is an error naming the partition and the
    /// sender, and that replica is dropped; the digest of the whole is checked when it is
    /// restored. Only the two newest steps of each partition from each sender are assembled
    /// at a time.
    pub fn put_remote_piece(
        &self,
        from: u32,
        piece: ReplicaPiece,
    ) -> Result<Option<(u32, u32)>, String> {
        let key = (from, piece.part, piece.epoch);
        let (part, epoch) = (piece.part, piece.epoch);
        let mut assembling = self.assembling.lock().unwrap_or_else(|p| p.into_inner());
        let a = assembling.entry(key).or_insert_with(|| Assembly {
            digest: piece.digest.clone(),
            pieces: Pieces::start(piece.total, self.recycled(part, epoch, u32::MAX)),
        });
        if a.digest != piece.digest || !a.pieces.put(piece.offset, piece.total, &piece.data) {
            assembling.remove(&key);
            return Err(format!(
                "replica of partition {part} (step {epoch}) from node {from}: a piece at byte {} of {} does not fit the others",
                piece.offset, piece.total
            ));
        }
        if !a.pieces.whole() {
            // Older steps of the same partition from the same sender will not complete.
            assembling.retain(|k, _| !(k.0 == from && k.1 == part && k.2 + 1 < epoch));
            return Ok(None);
        }
        let a = assembling.remove(&key).expect("just updated");
        drop(assembling);
        self.put_remote(ReplicaBytes {
            part,
            epoch,
            bytes: a.pieces.bytes.freeze(),
            digest: a.digest,
        });
        Ok(Some((part, epoch)))
    }

    /// Takes one piece of a patch node `from` ships (see [`delta`]); once every piece of it
    /// arrived, keeps the rebuilt replica ([`ReplicaStore::put_remote`]) and returns its
    /// partition and step. The first piece copies the base, the newest step of the partition
    /// this store keeps with the digest the patch names; the rebuilt whole is checked against
    /// the sender's digest before it is kept. A patch against a step not kept here, with runs
    /// outside the replica, that does not fit its other pieces or rebuilds other bytes is an
    /// error naming the partition and the sender (the sender then ships the whole), and that
    /// replica is dropped.
    pub fn put_remote_delta_piece(
        &self,
        from: u32,
        piece: DeltaPiece,
    ) -> Result<Option<(u32, u32)>, String> {
        let h = &piece.header;
        let (part, epoch) = (h.part, h.epoch);
        let key = (from, part, epoch);
        let fail = |what: String| {
            format!("replica of partition {part} (step {epoch}) from node {from}: {what}")
        };
        let mut patching = self.patching.lock().unwrap_or_else(|p| p.into_inner());
        let p = match patching.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let base = self
                .kept_at(part, h.base_epoch)
                .filter(|b| b.digest == h.base_digest)
                .ok_or_else(|| {
                    fail(format!(
                        "a patch against step {}, which this node does not hold (it holds steps {:?})",
                        h.base_epoch,
                        self.remote_steps(part)
                    ))
                })?;
                // A patch grows the base by at most its pieces' bytes.
                let most = base.bytes.len() as u64
                    + u64::from(piece.count).saturating_mul(REPLICA_PIECE as u64);
                if piece.count == 0 || h.total > most.min(MAX_REPLICA) {
                    return Err(fail(format!(
                        "a patch of {} pieces claims {} bytes",
                        piece.count, h.total
                    )));
                }
                // Into an obsolete step's buffer, or one allocation of the final size
                // (growing a copy of the base would reallocate it).
                let total = h.total as usize;
                let mut bytes = self.recycled(part, epoch, h.base_epoch);
                bytes.reserve(total);
                bytes.extend_from_slice(&base.bytes[..base.bytes.len().min(total)]);
                bytes.resize(total, 0);
                v.insert(Patching {
                    digest: h.digest.clone(),
                    total: h.total,
                    count: piece.count,
                    arrived: vec![false; piece.count as usize],
                    bytes,
                })
            }
        };
        let fits = p.digest == h.digest
            && p.total == h.total
            && p.count == piece.count
            && p.arrived.get(piece.index as usize) == Some(&false);
        let applied = if fits {
            delta::apply_runs(&mut p.bytes, &piece.runs)
        } else {
            Err(format!(
                "piece {} of {} does not fit the others",
                piece.index, piece.count
            ))
        };
        if let Err(e) = applied {
            patching.remove(&key);
            return Err(fail(e));
        }
        p.arrived[piece.index as usize] = true;
        if p.arrived.iter().any(|&got| !got) {
            patching.retain(|k, _| !(k.0 == from && k.1 == part && k.2 + 1 < epoch));
            return Ok(None);
        }
        let p = patching.remove(&key).expect("just updated");
        drop(patching);
        let got = blake3::hash(&p.bytes).to_hex().to_string();
        if got != p.digest {
            return Err(fail(format!(
                "the patched bytes have digest {got}, not the sender's {}",
                p.digest
            )));
        }
        self.put_remote(ReplicaBytes {
            part,
            epoch,
            bytes: p.bytes.freeze(),
            digest: p.digest,
        });
        Ok(Some((part, epoch)))
    }

    /// An empty buffer for the replica of `part`'s step `epoch` that is arriving: the buffer
    /// of a kept step of `part` older than `epoch - 1` and than `base` (the step a patch
    /// starts from), if one is kept beside a newer one and nothing else holds it (it is
    /// dropped from the store), else a new one. Such a step is obsolete: a partition's step
    /// `epoch` exists only after the coordinator committed step `epoch - 1` on every
    /// partition (epoch protocol, step 6), so a recovery resumes from `epoch - 1` or later.
    /// Reusing it keeps a node at two replicas of each partition and the one arriving, where
    /// a fresh buffer would add a third copy of hundreds of MB for as long as the arriving
    /// one takes.
    fn recycled(&self, part: u32, epoch: u32, base: u32) -> bytes::BytesMut {
        let old = self.remote.get_mut(&part).and_then(|mut kept| {
            let newest = kept.iter().map(|b| b.epoch).max()?;
            let oldest = kept
                .iter()
                .position(|b| b.epoch + 1 < epoch && b.epoch < base && b.epoch < newest)?;
            Some(kept.remove(oldest))
        });
        match old.map(|b| b.bytes.try_into_mut()) {
            Some(Ok(mut buf)) => {
                buf.clear();
                buf
            }
            _ => bytes::BytesMut::new(),
        }
    }

    /// The replica of another node's partition `part` at step `epoch`, if kept here, once
    /// every piece received before this call is stored.
    pub fn remote_at(&self, part: u32, epoch: u32) -> Option<ReplicaBytes> {
        if let Some(intake) = self.intake.get() {
            intake.settle();
        }
        self.kept_at(part, epoch)
    }

    /// The replica of partition `part` at step `epoch` stored so far.
    fn kept_at(&self, part: u32, epoch: u32) -> Option<ReplicaBytes> {
        self.remote
            .get(&part)?
            .iter()
            .find(|b| b.epoch == epoch)
            .cloned()
    }

    /// The steps of partition `part` whose replicas are kept here.
    pub fn remote_steps(&self, part: u32) -> Vec<u32> {
        self.remote
            .get(&part)
            .map(|v| v.iter().map(|b| b.epoch).collect())
            .unwrap_or_default()
    }
    /// `part`'s latest snapshot.
    pub fn get(&self, part: u32) -> Option<Arc<Snapshot>> {
        self.snaps.get(&part).map(|s| s.clone())
    }

    /// Keeps `part`'s residual of the step in progress (replacing an older one).
    pub fn hold_pending(&self, part: u32, pending: PendingResidual) {
        if !self.disabled {
            self.pending.insert(part, pending);
        }
    }

    /// `part`'s residual of the step after `epoch` (the step a partition restored to `epoch`
    /// may be replaying), if one is held.
    pub fn pending_after(&self, part: u32, epoch: u32) -> Option<PendingResidual> {
        self.pending
            .get(&part)
            .filter(|p| p.epoch == epoch + 1)
            .map(|p| p.clone())
    }

    /// The snapshot of the most advanced partition held here. Every partition's model
    /// replica and optimizer state are identical after a step (the all-reduce makes them so
    /// and the coordinator checks their digests), so this is the state a partition re-placed
    /// here after a node loss resumes from.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.snaps
            .iter()
            .max_by_key(|e| (e.value().epoch, std::cmp::Reverse(*e.key())))
            .map(|e| e.value().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> Snapshot {
        Snapshot {
            epoch: 7,
            params: vec![Tensor::from_vec(2, 3, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap()],
            opt_state: vec![(Tensor::zeros(2, 3), Tensor::zeros(2, 3))],
            opt_steps: 7,
            digest: "abc".into(),
            grad_residual: vec![0.25, -1.0],
            held_halo: Vec::new(),
            skip_sent: Vec::new(),
        }
    }

    #[test]
    fn a_held_residual_is_found_only_for_the_step_after_the_restored_one() {
        let store = ReplicaStore::new();
        let held = PendingResidual {
            epoch: 4,
            residual: vec![0.5, -0.25],
        };
        store.hold_pending(1, held.clone());
        assert_eq!(store.pending_after(1, 3), Some(held));
        assert_eq!(
            store.pending_after(1, 4),
            None,
            "a committed step's residual"
        );
        assert_eq!(store.pending_after(0, 3), None, "another partition's");
        let off = ReplicaStore::disabled();
        off.hold_pending(
            1,
            PendingResidual {
                epoch: 4,
                residual: vec![],
            },
        );
        assert_eq!(
            off.pending_after(1, 3),
            None,
            "replication off keeps nothing"
        );
    }

    /// A replica of several pieces is put together whole (and decodes); a piece that does not
    /// fit is an error naming the partition and the sender, never a panic.
    #[test]
    fn a_replica_in_pieces_is_put_together_and_a_piece_that_does_not_fit_is_refused() {
        let mut big = snap();
        let n = REPLICA_PIECE / 4 * 2 + 1000;
        big.grad_residual = (0..n).map(|i| i as f32).collect();
        let whole = ReplicaBytes::encode(4, &big);
        let pieces: Vec<_> = whole.pieces().collect();
        assert_eq!(pieces.len(), 3);
        assert!(pieces.iter().all(|p| p.data.len() <= REPLICA_PIECE));
        // Out of order (bulk messages travel on streams of their own).
        let store = ReplicaStore::new();
        assert_eq!(store.put_remote_piece(1, pieces[2].clone()), Ok(None));
        assert_eq!(store.put_remote_piece(1, pieces[0].clone()), Ok(None));
        assert!(store.remote_at(4, 7).is_none(), "not yet whole");
        assert_eq!(
            store.put_remote_piece(1, pieces[1].clone()),
            Ok(Some((4, 7)))
        );
        let kept = store.remote_at(4, 7).unwrap();
        assert_eq!(kept.bytes[..], whole.bytes[..]);
        assert_eq!(kept.decode().unwrap().grad_residual, big.grad_residual);
        // One small replica is one piece.
        assert_eq!(ReplicaBytes::encode(4, &snap()).pieces().count(), 1);
        // Another digest, a piece past the end, one that already arrived, one off its place.
        for bad in [
            ReplicaPiece {
                offset: 5,
                ..pieces[1].clone()
            },
            ReplicaPiece {
                digest: "other".into(),
                ..pieces[1].clone()
            },
            ReplicaPiece {
                offset: pieces[0].total,
                ..pieces[1].clone()
            },
            pieces[0].clone(),
        ] {
            let store = ReplicaStore::new();
            store.put_remote_piece(2, pieces[0].clone()).unwrap();
            let e = store.put_remote_piece(2, bad).unwrap_err();
            assert!(e.contains("partition 4") && e.contains("node 2"), "{e}");
            assert!(store.remote_at(4, 7).is_none());
        }
    }

    /// A replica that reaches a node as a patch against the step it holds is rebuilt byte
    /// for byte, from pieces in any order; a patch against a step it does not hold, one whose
    /// result is not the sender's bytes, or a piece that does not fit is an error naming the
    /// partition and the sender, and nothing is kept.
    #[test]
    fn a_patched_replica_is_rebuilt_exactly_or_refused() {
        let mut s = snap();
        s.grad_residual = (0..3 * REPLICA_PIECE / 4).map(|i| i as f32).collect();
        let base = ReplicaBytes::encode(4, &s);
        s.epoch = 8;
        for i in (0..s.grad_residual.len()).step_by(3) {
            s.grad_residual[i] = -1.0;
        }
        let new = ReplicaBytes::encode(4, &s);
        let d = ReplicaDelta::between(&base, &new);
        let pieces = d.pieces();
        assert!(pieces.len() > 1, "{} pieces", pieces.len());
        let store = ReplicaStore::new();
        let e = store
            .put_remote_delta_piece(1, pieces[0].clone())
            .unwrap_err();
        assert!(
            e.contains("partition 4") && e.contains("node 1") && e.contains("step 7"),
            "{e}"
        );
        store.put_remote(base.clone());
        let mut got = None;
        for p in pieces.iter().rev() {
            got = store.put_remote_delta_piece(1, p.clone()).unwrap();
        }
        assert_eq!(got, Some((4, 8)));
        assert_eq!(store.remote_at(4, 8).unwrap(), new);
        assert_eq!(
            store
                .remote_at(4, 8)
                .unwrap()
                .decode()
                .unwrap()
                .grad_residual,
            s.grad_residual
        );
        // Against other bytes of step 7, or rebuilding other bytes, or not fitting.
        let other_base = ReplicaDelta {
            header: DeltaHeader {
                base_digest: "0".repeat(64),
                ..d.header.clone()
            },
            ..d.clone()
        };
        let wrong_result = ReplicaDelta {
            header: DeltaHeader {
                digest: base.digest.clone(),
                ..d.header.clone()
            },
            ..d.clone()
        };
        for (bad, says) in [
            (other_base.pieces()[0].clone(), "does not hold"),
            (
                DeltaPiece {
                    index: 99,
                    ..pieces[0].clone()
                },
                "does not fit",
            ),
        ] {
            let store = ReplicaStore::new();
            store.put_remote(base.clone());
            let e = store.put_remote_delta_piece(1, bad).unwrap_err();
            assert!(e.contains("partition 4") && e.contains(says), "{e}");
            assert!(store.remote_at(4, 8).is_none());
        }
        let store = ReplicaStore::new();
        store.put_remote(base.clone());
        let mut last = Ok(None);
        for p in wrong_result.pieces() {
            last = store.put_remote_delta_piece(1, p);
        }
        let e = last.unwrap_err();
        assert!(e.contains("not the sender's"), "{e}");
        assert!(store.remote_at(4, 8).is_none());
    }

    /// Pieces received for the intake thread are stored in order off the caller's thread,
    /// each answered once (the whole replica, a patch against it, and a patch that does not
    /// fit: refused, naming the sender); a reader of the kept replicas asked right after the
    /// last piece was handed over sees it, and the thread ends with the store.
    #[test]
    fn the_intake_thread_stores_pieces_in_order_and_readers_wait_for_them() {
        let mut s = snap();
        s.grad_residual = (0..3 * REPLICA_PIECE / 4).map(|i| i as f32).collect();
        let base = ReplicaBytes::encode(4, &s);
        s.epoch = 8;
        for i in (0..s.grad_residual.len()).step_by(5) {
            s.grad_residual[i] = -2.0;
        }
        let new = ReplicaBytes::encode(4, &s);
        let patch = ReplicaDelta::between(&base, &new).pieces();
        let store = Arc::new(ReplicaStore::new());
        store.receive_in_background();
        let caller = std::thread::current().id();
        let (tx, rx) = std::sync::mpsc::channel();
        let answer = |tag: &'static str| -> OnStored {
            let tx = tx.clone();
            Box::new(move |stored: Stored| {
                assert_ne!(std::thread::current().id(), caller, "stored off the caller");
                tx.send((tag, stored)).unwrap();
            })
        };
        for p in base.pieces() {
            store.receive(3, ReceivedPiece::Whole(p), answer("whole"));
        }
        // The patch names step 7, which is stored only once the pieces before it are.
        for p in patch.iter().rev() {
            store.receive(3, ReceivedPiece::Patch(p.clone()), answer("patch"));
        }
        let misfit = DeltaPiece {
            index: 99,
            ..patch[0].clone()
        };
        store.receive(2, ReceivedPiece::Patch(misfit), answer("misfit"));
        assert_eq!(store.remote_at(4, 8).unwrap(), new, "the reader waited");
        assert_eq!(store.remote_at(4, 7).unwrap(), base);
        drop(tx);
        let got: Vec<_> = rx.iter().collect();
        assert_eq!(got.len(), base.pieces().count() + patch.len() + 1);
        let whole: Vec<_> = got
            .iter()
            .filter(|g| g.0 == "whole")
            .map(|g| &g.1)
            .collect();
        assert_eq!(whole.last().unwrap(), &&Ok(Some((4, 7))));
        assert!(whole[..whole.len() - 1].iter().all(|g| g == &&Ok(None)));
        let patched: Vec<_> = got
            .iter()
            .filter(|g| g.0 == "patch")
            .map(|g| &g.1)
            .collect();
        assert_eq!(patched.last().unwrap(), &&Ok(Some((4, 8))));
        let e = got
            .iter()
            .find(|g| g.0 == "misfit")
            .unwrap()
            .1
            .clone()
            .unwrap_err();
        assert!(e.contains("partition 4") && e.contains("node 2"), "{e}");
        // Only the caller's `Arc` holds the store: the thread keeps a weak one.
        assert_eq!(Arc::strong_count(&store), 1);
    }

    /// A node keeps two steps of a remote partition and the one arriving, not three: the
    /// replica arriving (whole or as a patch) is written into the buffer of a kept step older
    /// than the one before it, which is dropped as it starts; never into the patch's base,
    /// the step before it, or a buffer something else still holds.
    #[test]
    fn an_arriving_replica_reuses_the_buffer_of_an_obsolete_step() {
        let at = |epoch: u32, fill: f32| {
            let mut s = snap();
            s.epoch = epoch;
            s.grad_residual = vec![fill; REPLICA_PIECE / 2];
            ReplicaBytes::encode(4, &s)
        };
        let store = ReplicaStore::new();
        store.put_remote(at(5, 1.0));
        store.put_remote(at(6, 2.0));
        let old = store.remote_at(4, 5).unwrap().bytes.as_ptr();
        // Step 7 patched against step 6: step 5's buffer takes it.
        let new = at(7, 3.0);
        let pieces = ReplicaDelta::between(&at(6, 2.0), &new).pieces();
        store.put_remote_delta_piece(1, pieces[0].clone()).unwrap();
        assert_eq!(
            store.remote_steps(4),
            vec![6],
            "step 5 is dropped as step 7 starts"
        );
        let mut got = None;
        for p in &pieces[1..] {
            got = store.put_remote_delta_piece(1, p.clone()).unwrap();
        }
        if pieces.len() == 1 {
            got = Some((4, 7));
        }
        assert_eq!(got, Some((4, 7)));
        let kept = store.remote_at(4, 7).unwrap();
        assert_eq!(kept, new);
        assert_eq!(kept.bytes.as_ptr(), old, "written into step 5's buffer");
        // Step 8 as a patch against step 6 (its node acknowledged 6, not 7): the base stays.
        let new = at(8, 4.0);
        for p in ReplicaDelta::between(&at(6, 2.0), &new).pieces() {
            store.put_remote_delta_piece(1, p).unwrap();
        }
        assert_eq!(store.remote_steps(4), vec![7, 8]);
        assert_eq!(store.remote_at(4, 8).unwrap(), new);
        // A whole replica of step 10 reuses step 7's buffer unless something holds it.
        let held = store.remote_at(4, 7).unwrap();
        let whole = at(10, 5.0);
        for p in whole.pieces() {
            store.put_remote_piece(2, p).unwrap();
        }
        assert_eq!(store.remote_steps(4), vec![8, 10]);
        assert_ne!(
            store.remote_at(4, 10).unwrap().bytes.as_ptr(),
            held.bytes.as_ptr()
        );
        assert_eq!(store.remote_at(4, 10).unwrap(), whole);
        let eight = store.remote_at(4, 8).unwrap().bytes.as_ptr();
        let whole = at(12, 6.0);
        for p in whole.pieces() {
            store.put_remote_piece(2, p).unwrap();
        }
        assert_eq!(store.remote_steps(4), vec![10, 12]);
        assert_eq!(store.remote_at(4, 12).unwrap(), whole);
        assert_eq!(store.remote_at(4, 12).unwrap().bytes.as_ptr(), eight);
    }

    #[test]
    fn a_store_keeps_the_two_newest_steps_of_each_remote_partition() {
        let store = ReplicaStore::new();
        for epoch in [3, 1, 2, 4, 4] {
            let mut s = snap();
            s.epoch = epoch;
            store.put_remote(ReplicaBytes::encode(5, &s));
        }
        assert_eq!(store.remote_steps(5), vec![3, 4]);
        assert!(store.remote_at(5, 2).is_none());
        assert_eq!(store.remote_at(5, 3).unwrap().epoch, 3);
        assert!(store.remote_at(6, 3).is_none());
    }

    /// Evaluation blocks and records kept at one step and dropped at the next
    /// (`skip::keeps_eval_rows`) change only the tail of the replica: the patch between the
    /// two carries none of the training rows before it.
    #[test]
    fn evaluation_state_dropped_between_steps_leaves_the_training_rows_in_place() {
        let block = |phase: Phase, fill: u8| HaloBlock {
            header: MsgHeader {
                run: RunId::nil(),
                epoch: 7,
                layer: 1,
                phase,
                from: PartId(0),
                to: PartId(3),
            },
            rows: 64,
            cols: 64,
            payload: HaloPayload::Encoded(Arc::from(vec![fill; 16 << 10])),
            trace: None,
        };
        let record = |phase: Phase, fill: u8| SentRows {
            to: PartId(0),
            phase,
            layer: 1,
            cols: 64,
            values: SentValues::Int8 {
                codes: vec![fill as i8; 16 << 10],
                scales: vec![1.0; 256],
            },
            sent: vec![4; 256],
        };
        let mut kept = snap();
        kept.held_halo = vec![block(Phase::Forward, 1), block(Phase::Eval, 2)];
        // Records sort by receiver first: the evaluation one comes between training ones.
        kept.skip_sent = vec![
            record(Phase::Forward, 3),
            record(Phase::Eval, 4),
            record(Phase::Backward, 5),
        ];
        let mut dropped = kept.clone();
        dropped.held_halo.pop();
        dropped.skip_sent.remove(1);
        let (a, b) = (
            ReplicaBytes::encode(3, &kept),
            ReplicaBytes::encode(3, &dropped),
        );
        let training = 3 * (16 << 10);
        assert!(a.bytes.len() > training + (32 << 10));
        // Dropping ships the archive alone; keeping them again the evaluation rows too.
        let eval = (16 << 10) + (16 << 10) + 4 * 256;
        for (from, to, most) in [(&a, &b, 4 << 10), (&b, &a, eval + (4 << 10))] {
            let patch = ReplicaDelta::between(from, to);
            assert!(
                patch.len() < most as u64,
                "{} bytes of patch for a change in the evaluation rows",
                patch.len()
            );
            let mut rebuilt = from.bytes.to_vec();
            rebuilt.resize(patch.header.total as usize, 0);
            for piece in patch.pieces() {
                delta::apply_runs(&mut rebuilt, &piece.runs).unwrap();
            }
            assert_eq!(rebuilt[..], to.bytes[..]);
        }
    }

    /// Held blocks (fp32 and encoded) and skip records travel in the raw section; one whose
    /// bytes are cut short (with a digest that matches, as a buggy sender would make) is an
    /// error naming the partition, never a panic.
    #[test]
    fn held_rows_and_skip_records_round_trip_through_the_raw_section() {
        let block = |from: u32, payload: HaloPayload| HaloBlock {
            header: MsgHeader {
                run: RunId::nil(),
                epoch: 7,
                layer: 1,
                phase: Phase::Forward,
                from: PartId(from),
                to: PartId(3),
            },
            rows: 2,
            cols: 2,
            payload,
            trace: None,
        };
        let mut s = snap();
        s.held_halo = vec![
            block(
                0,
                HaloPayload::F32(Arc::from(vec![1.5f32, -2.0, 3.25, 0.0])),
            ),
            block(1, HaloPayload::Encoded(Arc::from(vec![9u8, 8, 7]))),
        ];
        let record = |values| SentRows {
            to: PartId(2),
            phase: Phase::Backward,
            layer: 0,
            cols: 2,
            values,
            sent: vec![4],
        };
        // One record in int8, one as the fp16 rows sent (1.0, -2.0).
        let fp16_row: Arc<[u8]> = Arc::from(vec![1u8, 1, 0x00, 0x3C, 0x00, 0xC0]);
        s.skip_sent = vec![
            record(SentValues::Int8 {
                codes: vec![127, -64],
                scales: vec![0.5 / 127.0],
            }),
            record(SentValues::Encoded(fp16_row)),
        ];
        // Every pass's state keeps its phase (evaluation rows are held with
        // --eval-skip-threshold).
        let mut eval_block = s.held_halo[0].clone();
        eval_block.header.phase = Phase::Eval;
        s.held_halo.push(eval_block);
        let mut eval_record = s.skip_sent[0].clone();
        eval_record.phase = Phase::Eval;
        s.skip_sent.push(eval_record);
        let r = ReplicaBytes::encode(3, &s);
        let back = r.decode().unwrap();
        let phases = |b: &[HaloBlock]| b.iter().map(|b| b.header.phase).collect::<Vec<_>>();
        assert_eq!(phases(&back.held_halo), phases(&s.held_halo));
        assert_eq!(
            back.held_halo[0].values().unwrap()[..],
            [1.5, -2.0, 3.25, 0.0]
        );
        assert!(
            matches!(&back.held_halo[1].payload, HaloPayload::Encoded(e) if e[..] == [9, 8, 7])
        );
        assert_eq!(back.held_halo[1].header.from, PartId(1));
        assert_eq!(back.skip_sent, s.skip_sent);
        assert_eq!(back.skip_sent[0].sent, [4]);
        assert_eq!(back.skip_sent[1].decoded().unwrap(), [1.0, -2.0]);
        // Encoded rows that are not a valid fixed-width payload are refused, naming the record.
        for bytes in [vec![1u8, 1, 0x00, 0x3C], vec![4u8, 1, 0, 0]] {
            let mut bad = s.clone();
            bad.skip_sent[1] = record(SentValues::Encoded(Arc::from(bytes)));
            let e = ReplicaBytes::encode(3, &bad).decode().unwrap_err();
            assert!(e.contains("skip record for partition 2"), "{e}");
        }
        assert_eq!(back.held_halo_bytes(), s.held_halo_bytes());
        for cut in [1, 5, 19] {
            let short = &r.bytes[..r.bytes.len() - cut];
            let bad = ReplicaBytes {
                bytes: bytes::Bytes::copy_from_slice(short),
                digest: blake3::hash(short).to_hex().to_string(),
                ..r.clone()
            };
            let e = bad.decode().unwrap_err();
            assert!(e.contains("partition 3"), "{e}");
        }
    }

    /// A replica without the model is a fraction of the whole, decodes only where a partition
    /// of the receiving node committed the same step with the same weights, and then equals
    /// the whole replica's snapshot.
    #[test]
    fn a_replica_without_the_model_is_completed_from_the_receivers_own_partition() {
        let mut own = snap();
        own.params = vec![Tensor::from_vec(16, 64, vec![0.5; 1024]).unwrap()];
        own.opt_state = vec![(Tensor::zeros(16, 64), Tensor::zeros(16, 64))];
        let whole = ReplicaBytes::encode(3, &own);
        let thin = ReplicaBytes::encode_without_model(3, &own);
        assert!(
            thin.bytes.len() * 20 < whole.bytes.len(),
            "{} of {} bytes",
            thin.bytes.len(),
            whole.bytes.len()
        );
        let e = thin.decode().unwrap_err();
        assert!(e.contains("partition 3") && e.contains("model out"), "{e}");
        // A node whose partitions did not commit that step (or committed other weights).
        let receiver = ReplicaStore::new();
        receiver.set_sender(Arc::new(|_| {}), true);
        let e = thin.decode_in(&receiver).unwrap_err();
        assert!(e.contains("partition 3") && e.contains("step 7"), "{e}");
        let mut other = own.clone();
        other.digest = "other weights".into();
        receiver.put(0, Arc::new(other));
        assert!(thin.decode_in(&receiver).is_err());
        // Its partition 0 committed step 7 with the same weights.
        receiver.put(0, Arc::new(own.clone()));
        let back = thin.decode_in(&receiver).unwrap();
        let full = whole.decode().unwrap();
        assert_eq!(format!("{back:?}"), format!("{full:?}"));
        // Later steps keep the newest few models, step 7's among them for a while.
        for epoch in 8..8 + MODELS_KEPT as u32 {
            let mut later = own.clone();
            later.epoch = epoch;
            receiver.put(0, Arc::new(later));
        }
        assert!(
            thin.decode_in(&receiver).is_err(),
            "step 7 is no longer kept"
        );
        // A whole replica decodes anywhere.
        assert!(whole.decode_in(&ReplicaStore::new()).is_ok());
    }

    #[test]
    fn replica_bytes_round_trip_and_reject_any_flipped_bit() {
        let r = ReplicaBytes::encode(3, &snap());
        let back = r.decode().unwrap();
        assert_eq!(back.epoch, 7);
        assert_eq!(back.params[0].as_slice(), snap().params[0].as_slice());
        assert_eq!(back.digest, "abc");
        for i in 0..r.bytes.len() {
            for bit in [0, 3, 7] {
                let mut b = r.bytes.to_vec();
                b[i] ^= 1 << bit;
                let bad = ReplicaBytes {
                    bytes: b.into(),
                    ..r.clone()
                };
                let e = bad.decode().unwrap_err();
                assert!(e.contains("not the sender's"), "{e}");
            }
        }
    }
}
