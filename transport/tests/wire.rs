//! The frame format and decoder: round trips, chunking, and every kind of bad input.
mod common;

use common::{block, f32s, header, run_id, traced_block};
use trellis_transport::wire::*;
use trellis_transport::{MsgHeader, PartId, Phase};

fn decode_all(bytes: &[u8], limits: Limits) -> Vec<Result<Frame, WireError>> {
    let mut dec = FrameDecoder::new(limits);
    dec.handle_bytes(bytes);
    let mut out: Vec<_> = std::iter::from_fn(|| dec.poll_frame()).collect();
    if let Err(e) = dec.handle_eof() {
        out.push(Err(e));
    }
    out
}

fn one_error(bytes: &[u8], limits: Limits) -> WireError {
    let out = decode_all(bytes, limits);
    assert_eq!(out.len(), 1, "expected exactly one error, got {out:?}");
    out.into_iter().next().unwrap().unwrap_err()
}

fn samples() -> Vec<Frame> {
    vec![
        Frame::Hello {
            node: 3,
            protocol: PROTOCOL_VERSION,
            incarnation: u64::MAX,
        },
        Frame::Ping(42),
        Frame::Pong(u64::MAX),
        Frame::Refused("node 3 is already connected from 127.0.0.1:9".into()),
        Frame::Refused(String::new()),
        Frame::Control(b"coordinator: start epoch 4".to_vec()),
        Frame::Control(Vec::new()),
        Frame::ControlPiece(vec![7; 300]),
        Frame::Halo(block(1, 2, 5, 3, 4)),
        Frame::Halo(block(1, 2, 5, 0, 16)),
        Frame::Halo(transformed_block()),
        Frame::Halo(traced_block(1, 2, 5, 2, 2)),
    ]
}

/// A split layer's block: the layer field carries the TRANSFORMED flag through the wire.
fn transformed_block() -> trellis_transport::HaloBlock {
    let mut b = block(3, 0, 9, 2, 16);
    b.header.layer = 1 | trellis_transport::TRANSFORMED;
    b
}

fn same(a: &Frame, b: &Frame) -> bool {
    match (a, b) {
        (Frame::Halo(x), Frame::Halo(y)) => {
            x.header == y.header
                && x.rows == y.rows
                && x.cols == y.cols
                && f32s(x)[..] == f32s(y)[..]
                && x.trace == y.trace
        }
        _ => format!("{a:?}") == format!("{b:?}"),
    }
}

#[test]
fn round_trip_every_kind() {
    for f in samples() {
        let bytes = encode_to_vec(&f);
        let out = decode_all(&bytes, Limits::default());
        assert_eq!(out.len(), 1);
        let got = out[0].as_ref().unwrap();
        assert!(same(&f, got), "{f:?} came back as {got:?}");
    }
}

#[test]
fn byte_by_byte_and_back_to_back() {
    let frames = samples();
    let stream: Vec<u8> = frames.iter().flat_map(encode_to_vec).collect();
    let mut dec = FrameDecoder::new(Limits::default());
    let mut got = Vec::new();
    for b in &stream {
        dec.handle_bytes(std::slice::from_ref(b));
        got.extend(std::iter::from_fn(|| dec.poll_frame()));
    }
    assert!(dec.is_idle());
    dec.handle_eof().unwrap();
    assert_eq!(got.len(), frames.len());
    for (f, g) in frames.iter().zip(&got) {
        assert!(same(f, g.as_ref().unwrap()));
    }
}

#[test]
fn want_stops_at_section_boundaries() {
    let bytes = encode_to_vec(&Frame::Halo(block(0, 1, 1, 8, 8)));
    let mut dec = FrameDecoder::new(Limits::default());
    assert_eq!(dec.want(), HEADER_LEN);
    dec.handle_bytes(&bytes[..HEADER_LEN]);
    let h = *dec.header().expect("header decoded");
    assert_eq!((h.kind, h.body_len), (FrameKind::Halo, 256));
    assert_eq!(dec.want(), h.meta_len as usize);
    let meta_end = HEADER_LEN + h.meta_len as usize;
    dec.handle_bytes(&bytes[HEADER_LEN..meta_end]);
    assert_eq!(dec.pending_halo(), Some(&header(0, 1, 1)));
    assert_eq!(dec.want(), 256);
    dec.handle_bytes(&bytes[meta_end..]);
    assert!(matches!(dec.poll_frame(), Some(Ok(Frame::Halo(_)))));
}

#[test]
fn the_body_lands_in_the_blocks_only_buffer() {
    let sent = block(4, 9, 2, 1024, 64);
    let bytes = encode_to_vec(&Frame::Halo(sent.clone()));
    let mut dec = FrameDecoder::new(Limits::default());
    for chunk in bytes.chunks(1000) {
        dec.handle_bytes(chunk);
    }
    let Some(Ok(Frame::Halo(got))) = dec.poll_frame() else {
        panic!("no block")
    };
    assert_eq!(
        std::sync::Arc::strong_count(f32s(&got)),
        1,
        "the decoder keeps no other reference"
    );
    assert_eq!(f32s(&got).len(), 1024 * 64);
    assert_eq!(f32s(&got)[..], f32s(&sent)[..]);
}

#[test]
fn every_truncation_is_an_error() {
    for f in samples() {
        let bytes = encode_to_vec(&f);
        for cut in 1..bytes.len() {
            match one_error(&bytes[..cut], Limits::default()) {
                WireError::Truncated { have, need, .. } => assert!(have < need),
                e => panic!("cut at {cut}: {e:?}"),
            }
        }
        assert!(
            decode_all(&[], Limits::default()).is_empty(),
            "an empty stream is fine"
        );
    }
}

#[test]
fn oversized_frames_are_refused_before_allocation() {
    let limits = Limits {
        max_meta: 1024,
        max_body: 4096,
    };
    let big = encode_to_vec(&Frame::Halo(block(0, 1, 1, 2, 1024)));
    assert_eq!(
        one_error(&big, limits),
        WireError::BodyTooLarge {
            len: 8192,
            max: 4096
        }
    );
    let control = encode_to_vec(&Frame::Control(vec![0; 2000]));
    assert!(matches!(
        one_error(&control, limits),
        WireError::MetaTooLarge { max: 1024, .. }
    ));
    // A header announcing 2^64-4 bytes: refused from the header alone.
    let mut h = FrameHeader {
        kind: FrameKind::Halo,
        meta_len: 40,
        body_len: u64::MAX - 3,
    }
    .encode()
    .to_vec();
    h.extend_from_slice(&[0; 8]);
    assert!(matches!(
        one_error(&h, Limits::default()),
        WireError::BodyTooLarge { .. }
    ));
}

#[test]
fn garbage_and_wrong_versions_are_refused() {
    assert_eq!(
        one_error(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Limits::default()),
        WireError::BadMagic(*b"GET ")
    );
    // Another version, older (1: halo envelopes without trace context) or newer.
    for other in [1u16, PROTOCOL_VERSION + 1] {
        let mut bytes = encode_to_vec(&Frame::Ping(1));
        bytes[4..6].copy_from_slice(&other.to_le_bytes());
        assert_eq!(
            one_error(&bytes, Limits::default()),
            WireError::Version { got: other }
        );
    }
    let mut bytes = encode_to_vec(&Frame::Ping(1));
    bytes[6] = 9;
    assert_eq!(one_error(&bytes, Limits::default()), WireError::Kind(9));
    let mut bytes = encode_to_vec(&Frame::Ping(1));
    bytes[7] = 1;
    assert_eq!(one_error(&bytes, Limits::default()), WireError::Flags(1));
    // A valid header followed by an envelope that fails bytecheck.
    let mut bytes = FrameHeader {
        kind: FrameKind::Message,
        meta_len: 16,
        body_len: 0,
    }
    .encode()
    .to_vec();
    bytes.extend_from_slice(&[0xff; 16]);
    assert!(matches!(
        one_error(&bytes, Limits::default()),
        WireError::Invalid(_)
    ));
}

#[test]
fn inconsistent_frames_are_refused() {
    // The halo envelope says 3x4 f32 but the header announces 12 bytes.
    let b = block(0, 1, 1, 3, 4);
    let mut bytes = encode_head(&Envelope::halo(&b), 12);
    bytes.extend_from_slice(&[0; 12]);
    assert_eq!(
        one_error(&bytes, Limits::default()),
        WireError::BodyMismatch {
            rows: 3,
            cols: 4,
            body_len: 12
        }
    );
    // A halo envelope in a frame of kind Message.
    let mut bytes = encode_head(&Envelope::halo(&block(0, 1, 1, 0, 0)), 0);
    bytes[6] = FrameKind::Message as u8;
    assert!(matches!(
        one_error(&bytes, Limits::default()),
        WireError::BodyMismatch { .. }
    ));
    // A ping in a frame of kind Halo.
    let mut bytes = encode_to_vec(&Frame::Ping(1));
    bytes[6] = FrameKind::Halo as u8;
    assert!(matches!(
        one_error(&bytes, Limits::default()),
        WireError::BodyShape { .. }
    ));
    // An unknown phase.
    let env = Envelope::Halo {
        run: [0; 16],
        epoch: 0,
        layer: 0,
        phase: 7,
        from: 0,
        to: 1,
        rows: 0,
        cols: 0,
        trace: None,
        encoded: false,
    };
    assert_eq!(
        one_error(&encode_head(&env, 0), Limits::default()),
        WireError::Phase(7)
    );
}

#[test]
fn a_failed_decoder_ignores_the_rest() {
    let mut dec = FrameDecoder::new(Limits::default());
    dec.handle_bytes(b"garbage!garbage!garbage!");
    dec.handle_bytes(&encode_to_vec(&Frame::Ping(1)));
    assert!(matches!(
        dec.poll_frame(),
        Some(Err(WireError::BadMagic(_)))
    ));
    assert!(dec.poll_frame().is_none());
    assert!(dec.is_failed());
    assert!(dec.handle_eof().is_ok());
}

#[test]
fn filter_rejects_unknown_partitions_runs_and_stale_epochs() {
    let mut f = RecvFilter::new();
    f.add_partition(PartId(2));
    assert_eq!(
        f.check(&header(1, 2, 5)),
        Err(Rejection::UnknownRun(run_id()))
    );
    f.set_epoch(run_id(), 5);
    assert_eq!(
        f.check(&header(1, 3, 5)),
        Err(Rejection::UnknownPartition(PartId(3)))
    );
    assert_eq!(
        f.check(&header(1, 2, 4)),
        Err(Rejection::StaleEpoch {
            part: PartId(2),
            epoch: 4,
            current: 5
        })
    );
    assert_eq!(f.check(&header(1, 2, 5)), Ok(()));
    let eval = |epoch| MsgHeader {
        phase: Phase::Eval,
        ..header(1, 2, epoch)
    };
    assert_eq!(
        f.check(&eval(4)),
        Ok(()),
        "the evaluation of the epoch before, replayed after a recovery"
    );
    assert_eq!(
        f.check(&eval(3)),
        Err(Rejection::StaleEpoch {
            part: PartId(2),
            epoch: 3,
            current: 5
        })
    );
    assert_eq!(
        f.check(&header(1, 2, 6)),
        Ok(()),
        "a peer already in the next epoch is fine"
    );
    f.set_epoch(run_id(), 3);
    assert_eq!(
        f.check(&header(1, 2, 4)),
        Ok(()),
        "restored to an earlier epoch"
    );
    f.remove_partition(PartId(2));
    assert!(f.check(&header(1, 2, 4)).is_err());
    f.end_run(run_id());
    let s = f.stats();
    assert_eq!(
        (
            s.accepted,
            s.unknown_partition,
            s.unknown_run,
            s.stale_epoch
        ),
        (4, 2, 1, 2)
    );
}

#[test]
fn trace_context_travels_and_invalid_ones_are_ignored() {
    let sent = traced_block(3, 4, 2, 1, 3);
    let out = decode_all(
        &encode_to_vec(&Frame::Halo(sent.clone())),
        Limits::default(),
    );
    let Ok(Frame::Halo(got)) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(got.trace, sent.trace);
    assert_eq!(
        got.trace.unwrap().to_string(),
        "00-abababababababababababababababab-5c5c5c5c5c5c5c5c-01"
    );
    // An all-zero span id is not a valid traceparent: the block arrives without one.
    let b = block(3, 4, 2, 1, 3);
    let mut env = Envelope::halo(&b);
    if let Envelope::Halo { trace, .. } = &mut env {
        *trace = Some(TraceParent {
            trace_id: [1; 16],
            span_id: [0; 8],
            flags: 1,
        });
    }
    let mut bytes = encode_head(&env, b.payload_bytes());
    bytes.extend_from_slice(&halo_body(&b.payload));
    let out = decode_all(&bytes, Limits::default());
    let Ok(Frame::Halo(got)) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(got.trace, None);
    assert_eq!(f32s(got)[..], f32s(&b)[..]);
}

#[test]
fn encoded_blocks_cross_the_wire_and_corrupt_payloads_are_codec_errors() {
    use common::encoded_block;
    use trellis_transport::codec::{Codec, CodecError};
    use trellis_transport::HaloPayload;
    for codec in [
        Codec::Fp16,
        Codec::Bf16,
        Codec::Int8,
        Codec::Int4,
        Codec::Adaptive { error_bound: 1e-2 },
    ] {
        let sent = encoded_block(codec, 1, 2, 7, 9);
        let bytes = encode_to_vec(&Frame::Halo(sent.clone()));
        let out = decode_all(&bytes, Limits::default());
        let [Ok(Frame::Halo(got))] = &out[..] else {
            panic!("{out:?}")
        };
        let (HaloPayload::Encoded(a), HaloPayload::Encoded(b)) = (&sent.payload, &got.payload)
        else {
            panic!("{} arrived as {:?}", codec.name(), got.payload)
        };
        assert_eq!(a[..], b[..]);
        assert_eq!(got.payload_bytes(), sent.payload_bytes());
        assert!(got.payload_bytes() < got.raw_bytes());
        // The codec byte replaced by an unknown one: refused, naming the sender.
        let mut bad = bytes.clone();
        let at = bad.len() - a.len();
        bad[at] = 42;
        assert_eq!(
            one_error(&bad, Limits::default()),
            WireError::Codec {
                from: 1,
                to: 2,
                source: CodecError::UnknownCodec(42)
            }
        );
    }
    // An encoded body longer than any codec writes for its shape is refused before it is read.
    let b = encoded_block(Codec::Int8, 0, 1, 2, 2);
    let mut bytes = encode_head(&Envelope::halo(&b), 1 << 16);
    bytes.extend_from_slice(&[0; 64]);
    assert!(matches!(
        one_error(&bytes, Limits::default()),
        WireError::BodyMismatch { .. }
    ));
}
