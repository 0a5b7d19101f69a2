//! Fault injection on one peer link (tests and `--chaos`): drop every message both ways for
//! a while (`cut`), hold every outgoing message for a fixed time (`delay`, order kept), or send
//! the next halo frames with corrupted headers (`corrupt`), which the receiver must reject.
//! The QUIC connection itself is untouched: these act on whole messages.
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The faults active on a link.
#[derive(Debug, Default)]
pub(crate) struct LinkChaos {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    cut_until: Option<Instant>,
    delay: Duration,
    corrupt: u32,
}

impl LinkChaos {
    pub fn cut_for(&self, d: Duration) {
        self.state.lock().expect("poisoned").cut_until = Some(Instant::now() + d);
    }

    pub fn set_delay(&self, d: Duration) {
        self.state.lock().expect("poisoned").delay = d;
    }

    pub fn corrupt_next(&self, n: u32) {
        self.state.lock().expect("poisoned").corrupt += n;
    }

    /// Whether messages on this link are dropped now.
    pub fn is_cut(&self) -> bool {
        self.state
            .lock()
            .expect("poisoned")
            .cut_until
            .is_some_and(|t| Instant::now() < t)
    }

    /// The delay of outgoing messages (zero: none).
    pub fn delay(&self) -> Duration {
        self.state.lock().expect("poisoned").delay
    }

    /// Whether the next halo frame must be corrupted (counts it).
    pub fn take_corrupt(&self) -> bool {
        let mut s = self.state.lock().expect("poisoned");
        if s.corrupt > 0 {
            s.corrupt -= 1;
            true
        } else {
            false
        }
    }
}

/// Corrupts an encoded frame head so that a receiver's validation rejects it: the frame
/// header's magic bytes are flipped (the receiver stops that stream; the connection stays).
pub(crate) fn corrupt_head(head: &mut [u8]) {
    for b in head.iter_mut().take(4) {
        *b ^= 0xA5;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_fire_as_configured() {
        let c = LinkChaos::default();
        assert!(!c.is_cut() && c.delay().is_zero() && !c.take_corrupt());
        c.cut_for(Duration::from_millis(50));
        assert!(c.is_cut());
        std::thread::sleep(Duration::from_millis(60));
        assert!(!c.is_cut());
        c.corrupt_next(2);
        assert!(c.take_corrupt() && c.take_corrupt() && !c.take_corrupt());
        c.set_delay(Duration::from_millis(5));
        assert_eq!(c.delay(), Duration::from_millis(5));
    }

    #[test]
    fn a_corrupted_head_is_rejected_by_the_decoder() {
        use crate::wire::{encode_head, Envelope, FrameDecoder, Limits};
        use crate::{HaloBlock, MsgHeader, PartId, Phase};
        let block = HaloBlock {
            header: MsgHeader {
                run: uuid::Uuid::nil(),
                epoch: 3,
                layer: 1,
                phase: Phase::Forward,
                from: PartId(1),
                to: PartId(2),
            },
            rows: 2,
            cols: 2,
            payload: crate::HaloPayload::F32(vec![1.0f32; 4].into()),
            trace: None,
        };
        let mut head = encode_head(&Envelope::halo(&block), 16);
        corrupt_head(&mut head);
        let mut dec = FrameDecoder::new(Limits::default());
        dec.handle_bytes(&head);
        dec.handle_bytes(&[0u8; 16]);
        assert!(matches!(dec.poll_frame(), Some(Err(_))));
    }
}
