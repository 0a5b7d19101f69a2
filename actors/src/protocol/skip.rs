//! Skipping halo rows that barely changed (`--skip-threshold`, historical embeddings as in
//! SANCUS), on the sending side: the sender's record of the rows each receiver holds, per
//! (receiver, phase, layer tag), and the sparse-row payloads of the rows that changed.
//!
//! A row is resent when its change since it was last sent is above the threshold relative to
//! the last sent value in L2 norm (`|x - x_sent|² > T² |x_sent|²`), or when the receiver
//! would otherwise use it older than `--max-staleness` epochs; the others stay as the
//! receiver has them. The record keeps what the receiver holds ([`SentValues`]): with a
//! fixed-width codec (fp16, bf16, int8, int4) the rows exactly as sent, a dense payload the
//! sparse ones merge into as they do into the receiver's held block (an int4 row of 256 values
//! is 132 bytes); otherwise (fp32 rows, adaptive widths) the decoded values as int8 with one
//! scale per row, only the reference of the comparison. Either is the same in every run (so
//! results stay deterministic), and compact: the record is replicated every step, where f32
//! made it the bulk of a replica (about 200 MB per partition on a 100k-node graph with
//! 256-wide rows). Records of the epoch in progress are pending until its optimizer step
//! commits them (a replayed pass starts from the committed ones and sends the same blocks);
//! the committed records are part of the partition's replicated snapshot.
//!
//! Evaluation rows (`--eval-skip-threshold`) follow the same rule with their own threshold
//! and no staleness. An epoch's evaluation runs after its optimizer step, so its records are
//! pending until the *next* optimizer step commits them (with that step's training records)
//! and reach the replicas with that step's snapshot; a partition re-placed in between has
//! none, and the coordinator replays that evaluation before the training pass
//! (ARCHITECTURE.md, "Staleness and skipping", step 8).
//!
//! Evaluation records are kept only where they pay ([`keeps_eval_rows`]): while a model still
//! moves, most evaluation rows change by more than the threshold every epoch, so a record
//! saves few halo bytes and costs its replicas (the record and the receiver's copy change in
//! most rows every step). Where more than half of a block's rows changed by value the block
//! goes whole and neither side keeps it; the next evaluations send it whole, and every
//! [`EVAL_PROBE_EPOCHS`] epochs one is kept again to see whether its rows settled. Where a
//! record is kept, the block goes as a sparse payload even when every row goes (rows forced
//! by `--max-staleness` are not a change of value): the receiver keeps a block exactly when it
//! is sparse, or when it held none and the epoch is a probe, so both sides decide alike from
//! what crossed the wire.
use crate::protocol::codec::{merged_payload, HaloEncoder};
use crate::protocol::halo::{proto, Tag};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use trellis_runtime::comm::HaloConfig;
use trellis_runtime::Result;
use trellis_transport::codec::{self, SparseInner};
use trellis_transport::{HaloPayload, PartId, Phase};

/// What one receiver holds of one (phase, layer tag)'s rows, as the sender last sent them.
#[derive(Debug, Clone, PartialEq)]
pub struct SentRows {
    pub to: PartId,
    pub phase: Phase,
    pub layer: u16,
    pub cols: u32,
    pub values: SentValues,
    /// The epoch each row was last sent in.
    pub sent: Vec<u32>,
}

/// The values of a [`SentRows`] record.
#[derive(Debug, Clone, PartialEq)]
pub enum SentValues {
    /// The rows exactly as the receiver holds them: a dense payload of a fixed-width codec
    /// ([`codec::is_fixed_width`]), into which each sparse payload sent after it was merged
    /// ([`codec::merge_sparse`]).
    Encoded(Arc<[u8]>),
    /// The values the receiver decoded, in int8 (rows sent as fp32, or in adaptive widths,
    /// which do not merge in encoded form): value ≈ code × the row's scale.
    Int8 {
        /// `rows * cols` codes.
        codes: Vec<i8>,
        /// Per row: its largest magnitude / 127 (0 for a zero row).
        scales: Vec<f32>,
    },
}

impl SentRows {
    /// The record of a whole block sent in `epoch` as `payload` (decoded only where the
    /// record keeps values, not the payload itself).
    fn whole(
        key: Key,
        cols: usize,
        rows: usize,
        payload: &HaloPayload,
        epoch: u32,
    ) -> Result<Self> {
        let kept = match payload {
            HaloPayload::Encoded(b) if codec::is_fixed_width(b) => SentValues::Encoded(b.clone()),
            _ => SentValues::quantised(&decoded(key.0, payload, rows, cols)?, cols),
        };
        Ok(SentRows {
            to: key.0,
            phase: key.1,
            layer: key.2,
            cols: cols as u32,
            values: kept,
            sent: vec![epoch; rows],
        })
    }

    /// The rows as the receiver holds them, decoded (`rows * cols` values, row-major).
    pub fn decoded(&self) -> std::result::Result<Vec<f32>, codec::CodecError> {
        let cols = self.cols as usize;
        match &self.values {
            SentValues::Encoded(b) => codec::decode(b, self.sent.len(), cols),
            SentValues::Int8 { codes, scales } => Ok(codes
                .chunks(cols.max(1))
                .zip(scales)
                .flat_map(|(row, &s)| row.iter().map(move |&c| f32::from(c) * s))
                .collect()),
        }
    }

    /// This record after `sparse` (a sparse payload of the rows `changed`, whose rows are
    /// `inner`) was sent in `epoch`: merged in encoded form where both are in one fixed-width
    /// codec, else kept as int8 (the only case that decodes `inner`).
    fn updated(
        &self,
        sparse: &[u8],
        changed: &[u32],
        inner: &HaloPayload,
        epoch: u32,
    ) -> std::result::Result<Self, codec::CodecError> {
        let (rows, cols) = (self.sent.len(), self.cols as usize);
        let merged = match &self.values {
            SentValues::Encoded(b) => {
                codec::merge_sparse(b, rows, cols, sparse)?.map(|m| merged_payload(b, m))
            }
            SentValues::Int8 { .. } => None,
        };
        let kept = match merged {
            Some(m) => SentValues::Encoded(m),
            None => {
                let values = values_of(inner, changed.len(), cols)?;
                let mut all = self.decoded()?;
                codec::overwrite_rows(&mut all, cols, changed, &values);
                SentValues::quantised(&all, cols)
            }
        };
        let mut sent = self.sent.clone();
        for &r in changed {
            sent[r as usize] = epoch;
        }
        Ok(SentRows {
            values: kept,
            sent,
            ..self.clone()
        })
    }

    /// Bytes the record holds.
    pub fn bytes(&self) -> u64 {
        let values = match &self.values {
            SentValues::Encoded(b) => b.len(),
            SentValues::Int8 { codes, scales } => codes.len() + 4 * scales.len(),
        };
        (values + 4 * self.sent.len()) as u64
    }
}

impl SentValues {
    /// `values` (rows of `cols`) as int8 with one scale per row.
    pub fn quantised(values: &[f32], cols: usize) -> Self {
        let mut codes = Vec::with_capacity(values.len());
        let mut scales = Vec::with_capacity(values.len() / cols.max(1));
        for x in values.chunks(cols.max(1)) {
            let m = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = if m.is_finite() { m / 127.0 } else { 0.0 };
            // `as` saturates and maps NaN to 0.
            codes.extend(x.iter().map(|&v| {
                if scale > 0.0 {
                    (v / scale).round().clamp(-127.0, 127.0) as i8
                } else {
                    0
                }
            }));
            scales.push(scale);
        }
        SentValues::Int8 { codes, scales }
    }
}

type Key = (PartId, Phase, u16);

/// Evaluation blocks that are not kept (more than half of their rows changed) are kept
/// again at evaluations `1, 1 + this, 1 + 2 * this, ...`, to see whether their rows settled.
pub const EVAL_PROBE_EPOCHS: u32 = 8;

/// Whether the receiver of evaluation `epoch`'s block and its sender keep it for the next
/// evaluation: a sparse block always (its sender kept the record); a whole one where none was
/// held before and `epoch` is a probe ([`EVAL_PROBE_EPOCHS`]); otherwise not (most of its rows
/// changed). The same function of what crossed the wire on both sides.
pub fn keeps_eval_rows(epoch: u32, held_before: bool, sparse: bool) -> bool {
    sparse || (!held_before && epoch.saturating_sub(1).is_multiple_of(EVAL_PROBE_EPOCHS))
}

/// A partition's skip state as a sender.
#[derive(Debug, Default)]
pub(crate) struct SkipSender {
    threshold: f32,
    max_staleness: Option<u32>,
    staleness: u32,
    eval_threshold: f32,
    committed: BTreeMap<Key, SentRows>,
    /// The records of the epoch in progress (kept through an epoch reset: the replay
    /// recomputes the same ones; always `Some` for training rows).
    pending: Option<(u32, BTreeMap<Key, Option<SentRows>>)>,
    /// The records of the last evaluation, until the next optimizer step commits them
    /// (`None`: the block was not kept, its record goes at the commit).
    eval_pending: Option<(u32, BTreeMap<Key, Option<SentRows>>)>,
}

impl SkipSender {
    pub fn new(cfg: &HaloConfig) -> Self {
        SkipSender {
            threshold: cfg.skip_threshold,
            max_staleness: cfg.max_staleness,
            staleness: cfg.staleness,
            eval_threshold: cfg.eval_skip_threshold,
            ..SkipSender::default()
        }
    }

    /// Whether rows of training passes may be skipped.
    pub fn on(&self) -> bool {
        self.threshold > 0.0
    }

    /// Whether rows of evaluation passes may be skipped.
    pub fn eval_on(&self) -> bool {
        self.eval_threshold > 0.0
    }

    /// The threshold and staleness of `phase`'s rows; `None` where they are never skipped.
    fn rule(&self, phase: Phase) -> Option<(f32, u32)> {
        match phase {
            Phase::Eval if self.eval_on() => Some((self.eval_threshold, 0)),
            Phase::Forward | Phase::Backward if self.on() => Some((self.threshold, self.staleness)),
            _ => None,
        }
    }

    /// The payload of the `gids.len() x cols` rows `data` for `to` under `tag`: every row
    /// (encoded by `encoder`) when nothing was sent before or every row changed, else a
    /// sparse payload of the rows to resend.
    #[allow(clippy::too_many_arguments)]
    pub fn payload(
        &mut self,
        encoder: &HaloEncoder,
        from: PartId,
        tag: Tag,
        to: PartId,
        gids: &[u32],
        cols: usize,
        data: Arc<[f32]>,
    ) -> Result<HaloPayload> {
        let Some((threshold, staleness)) = self.rule(tag.phase) else {
            return encoder.payload(from, tag, gids, cols, data);
        };
        let rows = gids.len();
        let key = (to, tag.phase, tag.layer);
        let eval = tag.phase == Phase::Eval;
        let bad = |what: String| proto(from, &format!("skip record for partition {to}: {what}"));
        let base = self
            .committed
            .get(&key)
            .filter(|b| b.cols as usize == cols && b.sent.len() == rows);
        // The rows to resend, and how many of them changed by value (not only forced by age).
        let (changed, moved) = match base {
            None => ((0..rows as u32).collect(), rows),
            Some(b) => {
                let held = b.decoded().map_err(|e| bad(e.to_string()))?;
                let (mut changed, mut moved) = (Vec::new(), 0);
                for r in 0..rows {
                    let at = r * cols..(r + 1) * cols;
                    let age = (tag.epoch + staleness).saturating_sub(b.sent[r]);
                    let forced = self.max_staleness.is_some_and(|k| age > k);
                    let m = moved_past(&data[at.clone()], &held[at], threshold);
                    moved += usize::from(m);
                    if m || forced {
                        changed.push(r as u32);
                    }
                }
                (changed, moved)
            }
        };
        let whole = || -> Result<(HaloPayload, Option<SentRows>)> {
            let p = encoder.payload(from, tag, gids, cols, data.clone())?;
            let keep = !eval || keeps_eval_rows(tag.epoch, base.is_some(), false);
            let next = if keep {
                Some(SentRows::whole(key, cols, rows, &p, tag.epoch)?)
            } else {
                None
            };
            Ok((p, next))
        };
        let (payload, next) = match base {
            // Evaluation: a record is kept where at most half of the rows changed by value
            // (`keeps_eval_rows`), and then the rows go sparse however many were forced.
            Some(_) if eval && 2 * moved > rows => whole()?,
            Some(b) if eval || changed.len() < rows => {
                let mut sub = Vec::with_capacity(changed.len() * cols);
                for &r in &changed {
                    sub.extend_from_slice(&data[r as usize * cols..(r as usize + 1) * cols]);
                }
                let sub_gids: Vec<u32> = changed.iter().map(|&r| gids[r as usize]).collect();
                let inner = encoder.payload(from, tag, &sub_gids, cols, Arc::from(sub))?;
                let bytes = match &inner {
                    HaloPayload::F32(d) => {
                        codec::encode_sparse(rows, &changed, SparseInner::F32(d))
                    }
                    HaloPayload::Encoded(b) => {
                        codec::encode_sparse(rows, &changed, SparseInner::Encoded(b))
                    }
                }
                .map_err(|e| proto(from, &format!("sparse halo block for partition {to}: {e}")))?;
                // Each row sent costs its index too: where most rows go, the whole block is
                // smaller (estimated from the rows' own size, so the choice is a pure
                // function of the values). Not for evaluation rows, whose record the sparse
                // form keeps (above).
                let per_row = inner.len_bytes() as f64 / changed.len().max(1) as f64;
                if !eval && !changed.is_empty() && bytes.len() as f64 >= per_row * rows as f64 {
                    whole()?
                } else {
                    let next = b
                        .updated(&bytes, &changed, &inner, tag.epoch)
                        .map_err(|e| bad(e.to_string()))?;
                    (HaloPayload::Encoded(Arc::from(bytes)), Some(next))
                }
            }
            _ => whole()?,
        };
        let slot = match tag.phase {
            Phase::Eval => &mut self.eval_pending,
            Phase::Forward | Phase::Backward => &mut self.pending,
        };
        let pending = match slot {
            Some((e, m)) if *e == tag.epoch => m,
            slot => &mut slot.insert((tag.epoch, BTreeMap::new())).1,
        };
        pending.insert(key, next);
        Ok(payload)
    }

    /// Whether the records of `epoch`'s pass are at hand (always, when nothing was sent).
    pub fn ready(&self, epoch: u32) -> bool {
        matches!(self.pending, Some((e, _)) if e == epoch)
    }

    /// Whether the records of `epoch`'s evaluation are at hand (always, when nothing was
    /// sent or evaluation rows are not skipped).
    pub fn eval_ready(&self, epoch: u32) -> bool {
        !self.eval_on() || matches!(self.eval_pending, Some((e, _)) if e == epoch)
    }

    /// The optimizer step of `epoch` was applied: its records, and those of the evaluation
    /// of the epoch before, become the committed ones.
    pub fn commit(&mut self, epoch: u32) {
        if let Some((e, m)) = self.pending.take() {
            if e == epoch {
                self.settle(m);
            }
        }
        match self.eval_pending.take() {
            Some((e, m)) if e + 1 == epoch => self.settle(m),
            // An evaluation of this step's own epoch or later stays pending.
            Some((e, m)) if e >= epoch => self.eval_pending = Some((e, m)),
            _ => {}
        }
    }

    /// Commits `records`: a record replaces the one of its key, `None` drops it.
    fn settle(&mut self, records: BTreeMap<Key, Option<SentRows>>) {
        for (key, record) in records {
            match record {
                Some(r) => self.committed.insert(key, r),
                None => self.committed.remove(&key),
            };
        }
    }

    /// The committed records (for the replicated snapshot), ascending key.
    pub fn committed(&self) -> Vec<SentRows> {
        self.committed.values().cloned().collect()
    }

    /// Restores the committed records of a snapshot taken after `epoch`; pending records of
    /// the epoch after it, and of `epoch`'s evaluation, survive (a restart on the same node
    /// during the next training or optimizer step).
    pub fn restore(&mut self, epoch: u32, records: &[SentRows]) {
        self.committed = records
            .iter()
            .map(|s| ((s.to, s.phase, s.layer), s.clone()))
            .collect();
        if self.pending.as_ref().is_some_and(|(e, _)| *e != epoch + 1) {
            self.pending = None;
        }
        if self.eval_pending.as_ref().is_some_and(|(e, _)| *e != epoch) {
            self.eval_pending = None;
        }
    }
}

/// Whether a row held by the receiver as `held` and now `x` changed by more than
/// `threshold` relative to `held` in L2 norm.
fn moved_past(x: &[f32], held: &[f32], threshold: f32) -> bool {
    let (mut d2, mut p2) = (0.0f64, 0.0f64);
    for (&a, &p) in x.iter().zip(held) {
        let d = f64::from(a) - f64::from(p);
        d2 += d * d;
        p2 += f64::from(p) * f64::from(p);
    }
    let t = f64::from(threshold);
    d2 > t * t * p2
}

/// The values a receiver decodes from `p` (`rows x cols`).
fn decoded(from: PartId, p: &HaloPayload, rows: usize, cols: usize) -> Result<Vec<f32>> {
    values_of(p, rows, cols)
        .map(Cow::into_owned)
        .map_err(|e| proto(from, &format!("decoding its own halo block: {e}")))
}

/// The values of `p` (`rows x cols`): fp32 rows as they are, encoded ones decoded.
fn values_of(
    p: &HaloPayload,
    rows: usize,
    cols: usize,
) -> std::result::Result<Cow<'_, [f32]>, codec::CodecError> {
    match p {
        HaloPayload::F32(d) => Ok(Cow::Borrowed(d)),
        HaloPayload::Encoded(b) => codec::decode(b, rows, cols).map(Cow::Owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_transport::RunId;

    fn tag(epoch: u32) -> Tag {
        Tag {
            run: RunId::nil(),
            epoch,
            layer: 1,
            phase: Phase::Forward,
        }
    }

    fn sender(threshold: f32, max_staleness: Option<u32>) -> (SkipSender, HaloEncoder) {
        let cfg = HaloConfig {
            skip_threshold: threshold,
            max_staleness,
            ..HaloConfig::default()
        };
        (SkipSender::new(&cfg), HaloEncoder::new(&cfg, 1))
    }

    /// Sends `rows` (3 rows of 2) in `epoch` and commits; the rows the payload carries.
    fn send(s: &mut SkipSender, enc: &HaloEncoder, epoch: u32, rows: [f32; 6]) -> Vec<u32> {
        let p = s
            .payload(
                enc,
                PartId(0),
                tag(epoch),
                PartId(1),
                &[10, 11, 12],
                2,
                Arc::from(rows),
            )
            .unwrap();
        s.commit(epoch);
        match p {
            HaloPayload::F32(_) => vec![0, 1, 2],
            HaloPayload::Encoded(b) => codec::decode_sparse(&b, 3, 2).unwrap().index,
        }
    }

    #[test]
    fn rows_that_barely_changed_are_not_resent() {
        let (mut s, enc) = sender(0.1, None);
        assert_eq!(
            send(&mut s, &enc, 1, [1.0, 0.0, 0.0, 2.0, 5.0, 5.0]),
            [0, 1, 2]
        );
        // Row 0 moves by 5% of its norm, row 1 by 50%, row 2 not at all.
        assert_eq!(send(&mut s, &enc, 2, [1.05, 0.0, 0.0, 3.0, 5.0, 5.0]), [1]);
        // Against what was last sent (1.0, not 1.05): 1.15 is 15% away.
        assert_eq!(send(&mut s, &enc, 3, [1.15, 0.0, 0.0, 3.0, 5.0, 5.0]), [0]);
        let rec = &s.committed()[0];
        let kept = rec.decoded().unwrap();
        for (k, want) in kept.iter().zip([1.15, 0.0, 0.0, 3.0, 5.0, 5.0]) {
            // int8 with a scale per row: within half a step (max / 254) of the value.
            assert!((k - want).abs() <= 5.0 / 254.0 + 1e-6, "{kept:?}");
        }
        assert_eq!(rec.sent, [3, 2, 1]);
        assert_eq!(rec.bytes(), 6 + 4 * 3 + 4 * 3);
    }

    #[test]
    fn max_staleness_forces_a_resend() {
        let (mut s, enc) = sender(0.5, Some(2));
        let rows = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0];
        assert_eq!(send(&mut s, &enc, 1, rows), [0, 1, 2]);
        assert!(send(&mut s, &enc, 2, rows).is_empty());
        assert!(send(&mut s, &enc, 3, rows).is_empty());
        // In epoch 4 the rows of epoch 1 would be 3 epochs old: all resent, then skipped again.
        assert_eq!(send(&mut s, &enc, 4, rows), [0, 1, 2]);
        assert!(send(&mut s, &enc, 5, rows).is_empty());
        // Unbounded, they are never resent.
        let (mut s, enc) = sender(0.5, None);
        send(&mut s, &enc, 1, rows);
        assert!((2..10).all(|e| send(&mut s, &enc, e, rows).is_empty()));
    }

    #[test]
    fn a_replayed_pass_starts_from_the_committed_records() {
        let (mut s, enc) = sender(0.1, None);
        send(&mut s, &enc, 1, [1.0, 0.0, 0.0, 2.0, 5.0, 5.0]);
        let rows: Arc<[f32]> = Arc::from([1.0, 0.0, 0.0, 3.0, 5.0, 5.0]);
        let once = s
            .payload(
                &enc,
                PartId(0),
                tag(2),
                PartId(1),
                &[10, 11, 12],
                2,
                rows.clone(),
            )
            .unwrap();
        assert!(!s.ready(1) && s.ready(2));
        let again = s
            .payload(&enc, PartId(0), tag(2), PartId(1), &[10, 11, 12], 2, rows)
            .unwrap();
        let bytes = |p: HaloPayload| match p {
            HaloPayload::Encoded(b) => b.to_vec(),
            HaloPayload::F32(_) => panic!("dense"),
        };
        assert_eq!(bytes(once), bytes(again));
        // A restore of the snapshot after epoch 1 keeps epoch 2's pending records.
        let snap = s.committed();
        s.restore(1, &snap);
        assert!(s.ready(2));
        s.restore(0, &snap);
        assert!(!s.ready(2));
    }

    #[test]
    fn evaluation_records_are_committed_by_the_next_optimizer_step() {
        let cfg = HaloConfig {
            eval_skip_threshold: 0.1,
            max_staleness: Some(3),
            ..HaloConfig::default()
        };
        let (mut s, enc) = (SkipSender::new(&cfg), HaloEncoder::new(&cfg, 1));
        assert!(s.eval_on() && !s.on());
        let eval = |epoch| Tag {
            phase: Phase::Eval,
            ..tag(epoch)
        };
        let payload = |s: &mut SkipSender, epoch: u32, rows: [f32; 6]| {
            s.payload(
                &enc,
                PartId(0),
                eval(epoch),
                PartId(1),
                &[10, 11, 12],
                2,
                Arc::from(rows),
            )
            .unwrap()
        };
        // The rows an evaluation sends, and whether it sends the whole block.
        let sent = |s: &mut SkipSender, epoch: u32, rows: [f32; 6]| match payload(s, epoch, rows) {
            HaloPayload::F32(_) => vec![0, 1, 2],
            HaloPayload::Encoded(b) => codec::decode_sparse(&b, 3, 2).unwrap().index,
        };
        let whole = |s: &mut SkipSender, epoch: u32, rows: [f32; 6]| {
            matches!(payload(s, epoch, rows), HaloPayload::F32(_))
        };
        let first = [1.0, 0.0, 0.0, 2.0, 5.0, 5.0];
        let next = [1.05, 0.0, 0.0, 3.0, 5.0, 5.0];
        // Evaluation 1, then optimizer step 2 commits its records (step 1 committed none).
        assert_eq!(sent(&mut s, 1, first), [0, 1, 2]);
        assert!(s.eval_ready(1) && !s.eval_ready(2));
        s.commit(1);
        assert!(s.eval_ready(1), "step 1 does not commit evaluation 1");
        // A restart during epoch 2 on the same node keeps them; a restore of step 0 does not.
        let snap = s.committed();
        s.restore(1, &snap);
        assert!(s.eval_ready(1));
        s.commit(2);
        assert!(s
            .committed()
            .iter()
            .all(|r| r.phase == Phase::Eval && r.sent == [1; 3]));
        // Evaluation 2: only the row that moved by more than a tenth goes; a replay of it
        // starts from the committed records and sends the same rows.
        assert_eq!(sent(&mut s, 2, next), [1]);
        assert_eq!(sent(&mut s, 2, next), [1]);
        // Training rows are not skipped (no training threshold): every row goes.
        let train = s
            .payload(
                &enc,
                PartId(0),
                tag(3),
                PartId(1),
                &[10, 11, 12],
                2,
                Arc::from(next),
            )
            .unwrap();
        assert!(matches!(train, HaloPayload::F32(_)));
        s.commit(3);
        assert_eq!(s.committed()[0].sent, [1, 2, 1]);
        // No record older than --max-staleness 3: evaluation 5 resends rows 0 and 2, as a
        // sparse block (rows forced by age are no change of value: the record is kept).
        assert!(sent(&mut s, 3, next).is_empty());
        s.commit(4);
        assert!(sent(&mut s, 4, next).is_empty());
        s.commit(5);
        assert_eq!(sent(&mut s, 5, next), [0, 2]);
        s.restore(4, &s.committed());
        assert!(!s.eval_ready(5), "a restore of step 4 has no evaluation 5");
        assert_eq!(sent(&mut s, 5, next), [0, 2]);
        s.commit(6);
        assert_eq!(s.committed().len(), 1);
        // Evaluation 6 moves two rows of three (more than half): the block goes whole and the
        // record is dropped at the next commit; evaluations 7 and 8 then go whole with none
        // kept, and evaluation 9 (a probe, `EVAL_PROBE_EPOCHS` after 1) keeps its record.
        let moved = [2.0, 0.0, 0.0, 3.0, 9.0, 9.0];
        assert!(whole(&mut s, 6, moved));
        s.commit(7);
        assert!(s.committed().is_empty(), "a block that moved is not kept");
        for e in 7..=8 {
            assert!(whole(&mut s, e, moved));
            s.commit(e + 1);
            assert!(s.committed().is_empty(), "evaluation {e} is no probe");
        }
        assert!(whole(&mut s, 9, moved));
        s.commit(10);
        assert_eq!(s.committed().len(), 1, "evaluation 9 is a probe");
        assert_eq!(sent(&mut s, 10, moved), Vec::<u32>::new());
    }

    #[test]
    fn the_receiver_keeps_an_evaluation_block_exactly_where_its_sender_keeps_the_record() {
        assert!(keeps_eval_rows(5, true, true), "sparse: kept");
        assert!(
            !keeps_eval_rows(5, true, false),
            "whole after a record: dropped"
        );
        assert!(!keeps_eval_rows(5, false, false), "whole, no probe");
        for probe in [1, 1 + EVAL_PROBE_EPOCHS, 1 + 2 * EVAL_PROBE_EPOCHS] {
            assert!(keeps_eval_rows(probe, false, false), "probe {probe}");
            assert!(
                !keeps_eval_rows(probe, true, false),
                "a dropped record at {probe}"
            );
        }
    }

    #[test]
    fn with_a_fixed_width_codec_the_record_is_exactly_what_the_receiver_holds() {
        let cfg = HaloConfig {
            codec: trellis_runtime::comm::HaloCodec::Int4,
            skip_threshold: 0.1,
            ..HaloConfig::default()
        };
        let (mut s, enc) = (SkipSender::new(&cfg), HaloEncoder::new(&cfg, 1));
        let epochs: [[f32; 6]; 3] = [
            [1.0, 0.5, 0.0, 2.0, 5.0, 5.0],
            [1.02, 0.5, 0.0, 3.0, 5.0, 5.0],
            [1.5, 0.5, 0.0, 3.0, 5.0, 5.0],
        ];
        let mut held: Option<Vec<u8>> = None;
        for (e, rows) in epochs.iter().enumerate() {
            let epoch = e as u32 + 1;
            let p = s
                .payload(
                    &enc,
                    PartId(0),
                    tag(epoch),
                    PartId(1),
                    &[10, 11, 12],
                    2,
                    Arc::from(*rows),
                )
                .unwrap();
            s.commit(epoch);
            let HaloPayload::Encoded(b) = p else {
                panic!("int4 rows travel encoded")
            };
            // The receiver's side: a dense block, or a sparse one merged into what it holds.
            held = Some(match held {
                Some(h) if codec::is_sparse(&b) => codec::merge_sparse(&h, 3, 2, &b)
                    .unwrap()
                    .unwrap()
                    .into_owned(),
                _ => b.to_vec(),
            });
            let rec = &s.committed()[0];
            let SentValues::Encoded(kept) = &rec.values else {
                panic!("an int4 record stays encoded: {rec:?}")
            };
            assert_eq!(kept[..], held.as_deref().unwrap()[..], "epoch {epoch}");
            assert_eq!(rec.bytes(), kept.len() as u64 + 4 * 3);
        }
        assert_eq!(s.committed()[0].sent, [3, 2, 1]);
    }
}
