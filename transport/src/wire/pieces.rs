//! Control messages larger than one frame. A frame's envelope is bounded by
//! [`Limits::max_meta`](super::Limits) (16 MiB by default) so that a decoder never allocates
//! more than that for one frame; a larger control message is cut into
//! [`Frame::ControlPiece`]s followed by a last [`Frame::Control`], written back to back on
//! one stream. [`ControlAssembly`] puts them together on the receiving side, up to a bound
//! on the whole message. Free of I/O.
use super::envelope::Frame;
use super::header::WireError;

/// The frames carrying control message `body`: the message itself when it is at most
/// `piece` bytes, else its leading `piece`-byte pieces and a last [`Frame::Control`] with
/// the rest.
pub fn control_frames(body: Vec<u8>, piece: usize) -> Vec<Frame> {
    let piece = piece.max(1);
    if body.len() <= piece {
        return vec![Frame::Control(body)];
    }
    let mut chunks: Vec<Vec<u8>> = body.chunks(piece).map(<[u8]>::to_vec).collect();
    let last = chunks.pop().expect("a body over one piece has chunks");
    chunks
        .into_iter()
        .map(Frame::ControlPiece)
        .chain(std::iter::once(Frame::Control(last)))
        .collect()
}

/// Puts the pieces of the control messages of one stream back together.
#[derive(Debug)]
pub struct ControlAssembly {
    /// The pieces of the message being received.
    bytes: Vec<u8>,
    /// Largest whole message accepted.
    max: u64,
    /// A piece of the current message was dropped: the rest of it is dropped too.
    dropping: bool,
}

impl ControlAssembly {
    /// Accepts messages of up to `max` bytes.
    pub fn new(max: u64) -> Self {
        ControlAssembly {
            bytes: Vec::new(),
            max,
            dropping: false,
        }
    }

    /// Takes a control frame of the stream ([`Frame::ControlPiece`] or [`Frame::Control`])
    /// and returns the message it completes, if any; other frames are not its to take.
    pub fn handle(&mut self, frame: Frame) -> Result<Option<Vec<u8>>, WireError> {
        match frame {
            Frame::ControlPiece(piece) => self.handle_piece(piece).map(|()| None),
            Frame::Control(last) => self.handle_last(last),
            other => unreachable!("not a control frame: {other:?}"),
        }
    }

    /// Takes a leading piece of a message.
    fn handle_piece(&mut self, piece: Vec<u8>) -> Result<(), WireError> {
        if self.dropping {
            return Ok(());
        }
        self.check(piece.len())?;
        if self.bytes.is_empty() {
            self.bytes = piece;
        } else {
            self.bytes.extend_from_slice(&piece);
        }
        Ok(())
    }

    /// Takes the last piece of a message (or a whole one) and returns the message; `None`
    /// when a piece of it was dropped.
    fn handle_last(&mut self, last: Vec<u8>) -> Result<Option<Vec<u8>>, WireError> {
        if std::mem::take(&mut self.dropping) {
            self.bytes = Vec::new();
            return Ok(None);
        }
        if self.bytes.is_empty() {
            return Ok(Some(last));
        }
        self.check(last.len())?;
        self.bytes.extend_from_slice(&last);
        Ok(Some(std::mem::take(&mut self.bytes)))
    }

    /// A frame of the message being received was dropped (an injected link cut): the
    /// message is lost, and its remaining pieces are dropped as they come.
    pub fn drop_message(&mut self, last: bool) {
        self.bytes = Vec::new();
        self.dropping = !last;
    }

    fn check(&mut self, more: usize) -> Result<(), WireError> {
        let len = self.bytes.len() as u64 + more as u64;
        if len > self.max {
            self.bytes = Vec::new();
            return Err(WireError::MessageTooLarge { len, max: self.max });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assemble(frames: Vec<Frame>, a: &mut ControlAssembly) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for f in frames {
            out.extend(a.handle(f).unwrap());
        }
        out
    }

    #[test]
    fn a_message_over_one_piece_is_cut_and_put_back_together() {
        let body: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for piece in [1, 7, 4096, 9_999, 10_000, 20_000] {
            let frames = control_frames(body.clone(), piece);
            let pieces = frames
                .iter()
                .filter(|f| matches!(f, Frame::ControlPiece(_)))
                .count();
            assert_eq!(pieces, body.len().div_ceil(piece) - 1, "piece {piece}");
            assert!(matches!(frames.last(), Some(Frame::Control(_))));
            let mut a = ControlAssembly::new(1 << 20);
            assert_eq!(
                assemble(frames, &mut a),
                vec![body.clone()],
                "piece {piece}"
            );
        }
        let mut a = ControlAssembly::new(1 << 20);
        let mut frames = control_frames(vec![1; 10], 3);
        frames.extend(control_frames(Vec::new(), 3));
        frames.extend(control_frames(vec![2; 3], 3));
        assert_eq!(
            assemble(frames, &mut a),
            vec![vec![1; 10], Vec::new(), vec![2; 3]]
        );
    }

    #[test]
    fn a_message_over_the_bound_is_an_error_naming_its_size() {
        let mut a = ControlAssembly::new(100);
        a.handle_piece(vec![0; 60]).unwrap();
        let e = a.handle_last(vec![0; 60]).unwrap_err();
        assert_eq!(e, WireError::MessageTooLarge { len: 120, max: 100 });
        assert!(e.to_string().contains("120"), "{e}");
        let mut a = ControlAssembly::new(100);
        a.handle_piece(vec![0; 60]).unwrap();
        assert!(a.handle_piece(vec![0; 60]).is_err());
    }

    #[test]
    fn a_dropped_piece_loses_its_message_and_no_other() {
        let mut a = ControlAssembly::new(1 << 20);
        a.handle_piece(vec![1; 4]).unwrap();
        a.drop_message(false);
        a.handle_piece(vec![1; 4]).unwrap();
        assert_eq!(a.handle_last(vec![1; 4]).unwrap(), None);
        assert_eq!(a.handle_last(vec![2; 4]).unwrap(), Some(vec![2; 4]));
        a.handle_piece(vec![3; 4]).unwrap();
        a.drop_message(true);
        assert_eq!(a.handle_last(vec![4; 2]).unwrap(), Some(vec![4; 2]));
    }
}
