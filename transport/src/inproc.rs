//! The in-process transport: routes halo blocks to partitions of this process by calling the
//! delivery function each partition registered. The block's buffer is moved, never copied.
use crate::{HaloBlock, PartId, Transport, TransportError};
use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Delivers a block to a local partition; returns false if the partition no longer accepts.
pub type Deliver = Arc<dyn Fn(HaloBlock) -> bool + Send + Sync>;

/// Routes between partitions of one process.
#[derive(Default)]
pub struct InProcessTransport {
    routes: DashMap<PartId, Deliver>,
    bytes: AtomicU64,
}

impl InProcessTransport {
    /// An empty router.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Transport for InProcessTransport {
    fn send(&self, block: HaloBlock) -> Result<(), TransportError> {
        let to = block.header.to;
        let deliver = self
            .routes
            .get(&to)
            .map(|d| d.clone())
            .ok_or(TransportError::UnknownPartition(to))?;
        self.bytes
            .fetch_add(block.payload_bytes(), Ordering::Relaxed);
        if deliver(block) {
            Ok(())
        } else {
            Err(TransportError::Closed(to))
        }
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn register(&self, part: PartId, deliver: Deliver) {
        self.routes.insert(part, deliver);
    }

    fn unregister(&self, part: PartId) {
        self.routes.remove(&part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MsgHeader, Phase};
    use std::sync::Mutex;

    fn block(to: u32, data: Arc<[f32]>) -> HaloBlock {
        let header = MsgHeader {
            run: uuid::Uuid::nil(),
            epoch: 1,
            layer: 0,
            phase: Phase::Forward,
            from: PartId(0),
            to: PartId(to),
        };
        HaloBlock {
            header,
            rows: 1,
            cols: data.len() as u32,
            payload: crate::HaloPayload::F32(data),
            trace: None,
        }
    }

    #[test]
    fn routes_without_copying() {
        let t = InProcessTransport::new();
        let got: Arc<Mutex<Vec<HaloBlock>>> = Arc::default();
        let sink = got.clone();
        t.register(
            PartId(1),
            Arc::new(move |b| {
                sink.lock().unwrap().push(b);
                true
            }),
        );
        let data: Arc<[f32]> = Arc::from(vec![1.0, 2.0, 3.0]);
        t.send(block(1, data.clone())).unwrap();
        let got = got.lock().unwrap();
        let crate::HaloPayload::F32(received) = &got[0].payload else {
            panic!("an f32 block arrived as {:?}", got[0].payload)
        };
        assert!(
            Arc::ptr_eq(received, &data),
            "the buffer must be shared, not copied"
        );
        assert_eq!(t.bytes_sent(), 12);
    }

    #[test]
    fn unknown_and_closed_partitions_are_errors() {
        let t = InProcessTransport::new();
        let data: Arc<[f32]> = Arc::from(vec![0.0]);
        assert!(matches!(
            t.send(block(3, data.clone())),
            Err(TransportError::UnknownPartition(PartId(3)))
        ));
        t.register(PartId(3), Arc::new(|_| false));
        assert!(matches!(
            t.send(block(3, data)),
            Err(TransportError::Closed(PartId(3)))
        ));
    }
}
