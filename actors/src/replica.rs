//! The node's replica store: the latest committed state of each partition's model replica and
//! optimizer, kept in memory so a restarted actor resumes from it without a checkpoint file.
use crate::protocol::skip::SentRows;
use dashmap::DashMap;
use rkyv::{Archive, Deserialize, Serialize};
use std::sync::Arc;
use trellis_gpu::Tensor;
use trellis_transport::{HaloBlock, HaloPayload, MsgHeader, PartId, Phase, RunId};

/// A snapshot as replicated bytes: shapes and values of every tensor.
#[derive(Archive, Serialize, Deserialize)]
struct SnapshotWire {
    epoch: u32,
    params: Vec<WireTensor>,
    moments: Vec<(WireTensor, WireTensor)>,
    opt_steps: u64,
    digest: String,
    grad_residual: Vec<f32>,
    held_halo: Vec<WireBlock>,
    skip_sent: Vec<WireSent>,
}

/// A sender's record of the rows one receiver holds (`--skip-threshold`).
#[derive(Archive, Serialize, Deserialize)]
struct WireSent {
    to: u32,
    /// 0 forward, 1 backward.
    phase: u8,
    layer: u16,
    cols: u32,
    values: Vec<f32>,
    sent: Vec<u32>,
}

impl WireSent {
    fn of(s: &SentRows) -> Self {
        WireSent {
            to: s.to.0,
            phase: u8::from(s.phase != Phase::Forward),
            layer: s.layer,
            cols: s.cols,
            values: s.values.clone(),
            sent: s.sent.clone(),
        }
    }

    fn record(self) -> Result<SentRows, String> {
        let phase = match self.phase {
            0 => Phase::Forward,
            1 => Phase::Backward,
            p => return Err(format!("skip record with unknown phase {p}")),
        };
        if self.values.len() as u64 != self.sent.len() as u64 * u64::from(self.cols) {
            return Err(format!(
                "skip record for partition {} holds {} values for {} rows of {}",
                self.to,
                self.values.len(),
                self.sent.len(),
                self.cols
            ));
        }
        Ok(SentRows {
            to: PartId(self.to),
            phase,
            layer: self.layer,
            cols: self.cols,
            values: self.values,
            sent: self.sent,
        })
    }
}

/// A held halo block (`--staleness`): its header without the run, its shape and its payload
/// as it was received (fp32 values or encoded bytes).
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
    values: Vec<f32>,
    encoded: Option<Vec<u8>>,
}

impl WireBlock {
    fn of(b: &HaloBlock) -> Self {
        let (values, encoded) = match &b.payload {
            HaloPayload::F32(d) => (d.to_vec(), None),
            HaloPayload::Encoded(e) => (Vec::new(), Some(e.to_vec())),
        };
        WireBlock {
            epoch: b.header.epoch,
            phase: match b.header.phase {
                Phase::Forward => 0,
                Phase::Backward | Phase::Eval => 1,
            },
            layer: b.header.layer,
            from: b.header.from.0,
            to: b.header.to.0,
            rows: b.rows,
            cols: b.cols,
            values,
            encoded,
        }
    }

    /// The block (run id nil: a held block is only read for its rows). Fp32 values must be
    /// exactly `rows x cols`; encoded payloads are checked by the decoder when used.
    fn block(self) -> Result<HaloBlock, String> {
        let phase = match self.phase {
            0 => Phase::Forward,
            1 => Phase::Backward,
            p => return Err(format!("held halo block with unknown phase {p}")),
        };
        let payload = match self.encoded {
            Some(bytes) => HaloPayload::Encoded(Arc::from(bytes)),
            None if self.values.len() as u64 == self.rows as u64 * self.cols as u64 => {
                HaloPayload::F32(Arc::from(self.values))
            }
            None => {
                return Err(format!(
                    "held halo block from partition {} holds {} values, not {}x{}",
                    self.from,
                    self.values.len(),
                    self.rows,
                    self.cols
                ))
            }
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
    pub bytes: Arc<[u8]>,
    /// Hex BLAKE3 of `bytes`, computed by the sender.
    pub digest: String,
}

impl ReplicaBytes {
    /// Encodes `snap` (host tensors) for replication.
    pub fn encode(part: u32, snap: &Snapshot) -> Self {
        let wire = SnapshotWire {
            epoch: snap.epoch,
            params: snap.params.iter().map(WireTensor::of).collect(),
            moments: snap
                .opt_state
                .iter()
                .map(|(m, v)| (WireTensor::of(m), WireTensor::of(v)))
                .collect(),
            opt_steps: snap.opt_steps,
            digest: snap.digest.clone(),
            grad_residual: snap.grad_residual.clone(),
            held_halo: snap.held_halo.iter().map(WireBlock::of).collect(),
            skip_sent: snap.skip_sent.iter().map(WireSent::of).collect(),
        };
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&wire)
            .map(|b| b.into_vec())
            .unwrap_or_default();
        let digest = blake3::hash(&bytes).to_hex().to_string();
        ReplicaBytes {
            part,
            epoch: snap.epoch,
            bytes: Arc::from(bytes),
            digest,
        }
    }

    /// Checks the bytes against the sender's digest, then decodes them. Never panics on bad
    /// bytes: a mismatch or a corrupt archive is an error saying which.
    pub fn decode(&self) -> Result<Snapshot, String> {
        let got = blake3::hash(&self.bytes).to_hex().to_string();
        if got != self.digest {
            return Err(format!(
                "replica of partition {} (step {}): bytes digest {got} is not the sender's {}",
                self.part, self.epoch, self.digest
            ));
        }
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(self.bytes.len());
        aligned.extend_from_slice(&self.bytes);
        let w = rkyv::from_bytes::<SnapshotWire, rkyv::rancor::Error>(&aligned)
            .map_err(|e| format!("replica of partition {}: corrupt: {e}", self.part))?;
        Ok(Snapshot {
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
                .map(WireBlock::block)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("replica of partition {}: {e}", self.part))?,
            skip_sent: w
                .skip_sent
                .into_iter()
                .map(WireSent::record)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("replica of partition {}: {e}", self.part))?,
        })
    }
}

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
        let records: usize = self
            .skip_sent
            .iter()
            .map(|s| 4 * (s.values.len() + s.sent.len()))
            .sum();
        self.held_halo
            .iter()
            .map(HaloBlock::payload_bytes)
            .sum::<u64>()
            + records as u64
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
    sender: std::sync::OnceLock<ReplicaSender>,
    /// Replication off: nothing is stored (measures what replication costs).
    disabled: bool,
}

impl std::fmt::Debug for ReplicaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaStore")
            .field("own", &self.snaps.len())
            .field("remote", &self.remote.len())
            .field("ships", &self.sender.get().is_some())
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
    /// (set once, by the cluster node that owns this store).
    pub fn set_sender(&self, sender: ReplicaSender) {
        let _ = self.sender.set(sender);
    }

    /// Stores `part`'s latest snapshot and, in a cluster, ships it to the partition's replica
    /// nodes (the initial state, step 0, is not shipped: any node recomputes it from the
    /// configuration). Returns the bytes shipped to each replica node (0: none).
    pub fn put(&self, part: u32, snap: Arc<Snapshot>) -> u64 {
        if self.disabled {
            return 0;
        }
        let mut shipped = 0;
        if let Some(send) = self.sender.get() {
            if snap.epoch > 0 {
                use trellis_runtime::metrics::{names, Key, Metrics};
                let bytes = ReplicaBytes::encode(part, &snap);
                let metrics = Metrics::global();
                let key = |name| Key::new(name).with("partition", part);
                metrics.add(key(names::REPLICA_BYTES), bytes.bytes.len() as u64);
                let held = snap.held_halo_bytes();
                if held > 0 {
                    metrics.add(key(names::REPLICA_HALO_BYTES), held);
                }
                shipped = bytes.bytes.len() as u64;
                send(bytes);
            }
        }
        self.snaps.insert(part, snap);
        shipped
    }

    /// Replaces `part`'s own snapshot without shipping it (a partition rolled back to the
    /// committed step before its latest one: every replica node still keeps that step).
    pub fn put_local(&self, part: u32, snap: Arc<Snapshot>) {
        if !self.disabled {
            self.snaps.insert(part, snap);
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

    /// The replica of another node's partition `part` at step `epoch`, if kept here.
    pub fn remote_at(&self, part: u32, epoch: u32) -> Option<ReplicaBytes> {
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
                    bytes: Arc::from(b),
                    ..r.clone()
                };
                let e = bad.decode().unwrap_err();
                assert!(e.contains("not the sender's"), "{e}");
            }
        }
    }
}
