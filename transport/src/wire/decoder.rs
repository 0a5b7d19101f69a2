//! [`FrameDecoder`]: bytes in, validated frames out; no I/O.
use super::envelope::{access, halo_parts, small_frame, Frame, HaloParts};
use super::header::{FrameHeader, FrameKind, Limits, WireError, HEADER_LEN};
use crate::codec;
use crate::{HaloBlock, HaloPayload, MsgHeader, TraceContext};
use rkyv::util::AlignedVec;
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::sync::Arc;

enum State {
    Header {
        buf: [u8; HEADER_LEN],
        have: usize,
    },
    Meta {
        header: FrameHeader,
        buf: AlignedVec<16>,
    },
    Body {
        header: FrameHeader,
        halo: MsgHeader,
        rows: u32,
        cols: u32,
        trace: Option<TraceContext>,
        buf: BodyBuf,
        have: u64,
    },
    Failed,
}

/// The buffer a halo body is received into.
enum BodyBuf {
    /// Exact rows: the block's final f32 buffer.
    F32(Arc<[MaybeUninit<f32>]>),
    /// A halo-codec payload, validated once complete.
    Encoded(Vec<u8>),
}

impl State {
    fn start() -> Self {
        State::Header {
            buf: [0; HEADER_LEN],
            have: 0,
        }
    }
}

/// Decodes a byte stream of frames. After the first error it ignores the rest of the stream
/// (a byte stream cannot be resynchronised): the caller drops the stream, not the peer.
pub struct FrameDecoder {
    limits: Limits,
    state: State,
    ready: VecDeque<Result<Frame, WireError>>,
}

impl FrameDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: Limits) -> Self {
        FrameDecoder {
            limits,
            state: State::start(),
            ready: VecDeque::new(),
        }
    }

    /// Consumes all of `data`. A halo body is copied once, into the block's final buffer.
    pub fn handle_bytes(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            match self.step(data) {
                Ok(used) => data = &data[used..],
                Err(e) => {
                    self.state = State::Failed;
                    self.ready.push_back(Err(e));
                    return;
                }
            }
        }
    }

    /// Reports the end of the stream: an error if it ended inside a frame.
    pub fn handle_eof(&mut self) -> Result<(), WireError> {
        let (section, have, need) = match &self.state {
            State::Header { have: 0, .. } | State::Failed => return Ok(()),
            State::Header { have, .. } => ("header", *have as u64, HEADER_LEN as u64),
            State::Meta { header, buf } => ("envelope", buf.len() as u64, header.meta_len as u64),
            State::Body { header, have, .. } => ("body", *have, header.body_len),
        };
        self.state = State::Failed;
        Err(WireError::Truncated {
            section,
            have,
            need,
        })
    }

    /// The next decoded frame or error, if any.
    pub fn poll_frame(&mut self) -> Option<Result<Frame, WireError>> {
        self.ready.pop_front()
    }

    /// Bytes needed to finish the current section (header, envelope or body); 0 once failed.
    /// Reading at most this much lets a caller act between sections.
    pub fn want(&self) -> usize {
        match &self.state {
            State::Header { have, .. } => HEADER_LEN - have,
            State::Meta { header, buf } => header.meta_len as usize - buf.len(),
            State::Body { header, have, .. } => (header.body_len - have) as usize,
            State::Failed => 0,
        }
    }

    /// The header of the frame being decoded, once its header is complete.
    pub fn header(&self) -> Option<&FrameHeader> {
        match &self.state {
            State::Meta { header, .. } | State::Body { header, .. } => Some(header),
            _ => None,
        }
    }

    /// The addressing of the halo block whose body is being received.
    pub fn pending_halo(&self) -> Option<&MsgHeader> {
        match &self.state {
            State::Body { halo, .. } => Some(halo),
            _ => None,
        }
    }

    /// True between frames (nothing partial buffered) and not failed.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Header { have: 0, .. })
    }

    /// True after an error: the rest of the stream is ignored.
    pub fn is_failed(&self) -> bool {
        matches!(self.state, State::Failed)
    }

    fn step(&mut self, data: &[u8]) -> Result<usize, WireError> {
        match &mut self.state {
            State::Failed => Ok(data.len()),
            State::Header { buf, have } => {
                let n = (HEADER_LEN - *have).min(data.len());
                buf[*have..*have + n].copy_from_slice(&data[..n]);
                *have += n;
                if *have == HEADER_LEN {
                    let header = FrameHeader::parse(buf, &self.limits)?;
                    let buf = AlignedVec::with_capacity(header.meta_len as usize);
                    self.state = State::Meta { header, buf };
                }
                Ok(n)
            }
            State::Meta { header, buf } => {
                let n = (header.meta_len as usize - buf.len()).min(data.len());
                buf.extend_from_slice(&data[..n]);
                if buf.len() == header.meta_len as usize {
                    let header = *header;
                    let env = access(buf)?;
                    match halo_parts(env)? {
                        Some(parts) => self.start_body(header, parts)?,
                        None if header.kind == FrameKind::Message => {
                            self.ready.push_back(Ok(small_frame(env)));
                            self.state = State::start();
                        }
                        None => {
                            return Err(WireError::BodyShape {
                                kind: header.kind,
                                body_len: header.body_len,
                            })
                        }
                    }
                }
                Ok(n)
            }
            State::Body {
                header, buf, have, ..
            } => {
                let n = ((header.body_len - *have) as usize).min(data.len());
                match buf {
                    BodyBuf::F32(buf) => {
                        let dst =
                            Arc::get_mut(buf).expect("the body buffer is owned by the decoder");
                        // SAFETY: `have + n <= body_len == dst.len() * 4`, so the copy stays
                        // inside the allocation; MaybeUninit<f32> accepts any bytes; the
                        // regions cannot overlap.
                        unsafe {
                            let base = dst.as_mut_ptr().cast::<u8>().add(*have as usize);
                            std::ptr::copy_nonoverlapping(data.as_ptr(), base, n);
                        }
                    }
                    BodyBuf::Encoded(buf) => buf.extend_from_slice(&data[..n]),
                }
                *have += n as u64;
                if *have == header.body_len {
                    self.finish_body()?;
                }
                Ok(n)
            }
        }
    }

    fn start_body(&mut self, header: FrameHeader, parts: HaloParts) -> Result<(), WireError> {
        let HaloParts {
            header: halo,
            rows,
            cols,
            trace,
            encoded,
        } = parts;
        // An encoded body is at least its codec id and version and at most what the widest
        // codec writes for the shape; its exact length is checked once it is complete.
        let fits = if encoded {
            let max = codec::max_encoded_len(rows as usize, cols as usize);
            header.body_len >= 2 && max.is_some_and(|m| header.body_len <= m as u64)
        } else {
            (rows as u64)
                .checked_mul(cols as u64)
                .and_then(|n| n.checked_mul(4))
                == Some(header.body_len)
        };
        if header.kind != FrameKind::Halo || !fits {
            return Err(WireError::BodyMismatch {
                rows,
                cols,
                body_len: header.body_len,
            });
        }
        let buf = if encoded {
            BodyBuf::Encoded(Vec::with_capacity(header.body_len as usize))
        } else {
            BodyBuf::F32(Arc::<[f32]>::new_uninit_slice(
                (header.body_len / 4) as usize,
            ))
        };
        self.state = State::Body {
            header,
            halo,
            rows,
            cols,
            trace,
            buf,
            have: 0,
        };
        if header.body_len == 0 {
            self.finish_body()?;
        }
        Ok(())
    }

    fn finish_body(&mut self) -> Result<(), WireError> {
        let State::Body {
            halo,
            rows,
            cols,
            trace,
            buf,
            ..
        } = std::mem::replace(&mut self.state, State::start())
        else {
            unreachable!("finish_body outside a body");
        };
        let payload = match buf {
            BodyBuf::F32(buf) => {
                // SAFETY: every byte of the buffer was written (have == body_len == len * 4).
                let mut data: Arc<[f32]> = unsafe { buf.assume_init() };
                if cfg!(target_endian = "big") {
                    for x in Arc::get_mut(&mut data).expect("unique") {
                        *x = f32::from_bits(u32::from_le(x.to_bits()));
                    }
                }
                HaloPayload::F32(data)
            }
            BodyBuf::Encoded(bytes) => {
                codec::validate(&bytes, rows as usize, cols as usize).map_err(|e| {
                    WireError::Codec {
                        from: halo.from.0,
                        to: halo.to.0,
                        source: e,
                    }
                })?;
                HaloPayload::Encoded(Arc::from(bytes))
            }
        };
        self.ready.push_back(Ok(Frame::Halo(HaloBlock {
            header: halo,
            rows,
            cols,
            payload,
            trace,
        })));
        Ok(())
    }
}
