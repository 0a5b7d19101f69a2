//! Partition id spaces on one transport: [`PartitionSpace`] gives a set of partitions its
//! own ids on a transport another set already uses. A cluster that serves beside its
//! training runs training partition `p` and serving partition `p` on the same node and the
//! same QUIC transport; the serving partitions speak through a space based at
//! `SERVING_BASE`, so their blocks are routed, filtered and delivered apart from the
//! training partitions' (which keep ids `0..P`), and each side still sees ids `0..P`.
use crate::{Deliver, HaloBlock, PartId, Transport, TransportError};
use std::sync::Arc;

/// `inner`, with every partition id it sees offset by `base`.
pub struct PartitionSpace {
    inner: Arc<dyn Transport>,
    base: u32,
}

impl PartitionSpace {
    /// Partitions `0..` of the new space are partitions `base..` of `inner`.
    pub fn new(inner: Arc<dyn Transport>, base: u32) -> Self {
        Self { inner, base }
    }

    /// Where partition `part` of this space is on the inner transport.
    pub fn inner_id(&self, part: PartId) -> PartId {
        PartId(part.0.wrapping_add(self.base))
    }

    /// The error of the inner transport, with the partition named as this space names it.
    fn outer_error(&self, e: TransportError) -> TransportError {
        let outer = |p: PartId| PartId(p.0.wrapping_sub(self.base));
        match e {
            TransportError::UnknownPartition(p) => TransportError::UnknownPartition(outer(p)),
            TransportError::Closed(p) => TransportError::Closed(outer(p)),
            e => e,
        }
    }
}

impl Transport for PartitionSpace {
    fn send(&self, mut block: HaloBlock) -> Result<(), TransportError> {
        block.header.from = self.inner_id(block.header.from);
        block.header.to = self.inner_id(block.header.to);
        self.inner.send(block).map_err(|e| self.outer_error(e))
    }

    fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }

    fn register(&self, part: PartId, deliver: Deliver) {
        let base = self.base;
        // Blocks arrive addressed in the inner space; the partition reads its own ids.
        let deliver: Deliver = Arc::new(move |mut block: HaloBlock| {
            block.header.from = PartId(block.header.from.0.wrapping_sub(base));
            block.header.to = PartId(block.header.to.0.wrapping_sub(base));
            deliver(block)
        });
        self.inner.register(self.inner_id(part), deliver);
    }

    fn unregister(&self, part: PartId) {
        self.inner.unregister(self.inner_id(part));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HaloPayload, InProcessTransport, MsgHeader, Phase, RunId};
    use std::sync::Mutex;

    fn block(from: u32, to: u32) -> HaloBlock {
        HaloBlock {
            header: MsgHeader {
                run: RunId::nil(),
                epoch: 0,
                layer: 0,
                phase: Phase::Forward,
                from: PartId(from),
                to: PartId(to),
            },
            rows: 1,
            cols: 1,
            payload: HaloPayload::F32(Arc::from(vec![from as f32])),
            trace: None,
        }
    }

    type Seen = Arc<Mutex<Vec<(u32, u32)>>>;

    fn recorder(seen: &Seen) -> Deliver {
        let seen = seen.clone();
        Arc::new(move |b: HaloBlock| {
            seen.lock().unwrap().push((b.header.from.0, b.header.to.0));
            true
        })
    }

    #[test]
    fn two_spaces_on_one_transport_keep_their_partitions_apart() {
        let inner: Arc<dyn Transport> = Arc::new(InProcessTransport::new());
        let serving = PartitionSpace::new(inner.clone(), 1 << 20);
        let (training_seen, serving_seen): (Seen, Seen) = Default::default();
        // Partition 1 of each space.
        inner.register(PartId(1), recorder(&training_seen));
        serving.register(PartId(1), recorder(&serving_seen));
        inner.send(block(0, 1)).unwrap();
        serving.send(block(0, 1)).unwrap();
        serving.send(block(2, 1)).unwrap();
        assert_eq!(*training_seen.lock().unwrap(), vec![(0, 1)]);
        // The serving partition reads its own ids, not the inner ones.
        assert_eq!(*serving_seen.lock().unwrap(), vec![(0, 1), (2, 1)]);
        // An unknown partition is named as the space names it.
        let err = serving.send(block(0, 7)).unwrap_err();
        assert!(
            matches!(err, TransportError::UnknownPartition(PartId(7))),
            "{err}"
        );
        serving.unregister(PartId(1));
        assert!(serving.send(block(0, 1)).is_err());
        inner.send(block(0, 1)).unwrap();
        assert_eq!(training_seen.lock().unwrap().len(), 2);
    }
}
