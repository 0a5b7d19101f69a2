//! Fuzzing the frame decoder: random bytes and mutated valid frames never panic, and the result
//! does not depend on how the bytes are chunked. `fuzz-corpus/` holds regression inputs: files
//! named `ok-*` must decode without error, `err-*` must yield an error. Add every input a fuzz
//! run finds there (see `write_seed_corpus` to regenerate the seeds).
mod common;

use common::{block, encoded_block, sparse_block, traced_block};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::path::PathBuf;
use trellis_transport::codec::{self, Codec};
use trellis_transport::wire::*;
use trellis_transport::HaloPayload;

const LIMITS: Limits = Limits {
    max_meta: 1 << 16,
    max_body: 1 << 20,
};

/// Decodes `bytes` fed in pieces cut at `cuts`; a summary of every frame and error.
fn decode(bytes: &[u8], cuts: &[usize]) -> Vec<String> {
    let mut dec = FrameDecoder::new(LIMITS);
    let mut out = Vec::new();
    let mut start = 0;
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    for p in points.into_iter().chain([bytes.len()]) {
        dec.handle_bytes(&bytes[start..p.max(start)]);
        start = p.max(start);
        out.extend(std::iter::from_fn(|| dec.poll_frame()).map(|r| summary(&r)));
    }
    if let Err(e) = dec.handle_eof() {
        out.push(format!("eof: {e}"));
    }
    out
}

fn summary(r: &Result<Frame, WireError>) -> String {
    match r {
        Ok(Frame::Halo(b)) => {
            // A decoded frame's payload always decodes: the wire decoder validated it (a
            // sparse-row one into its row indices and rows).
            let values = match &b.payload {
                HaloPayload::Encoded(bytes) if codec::is_sparse(bytes) => {
                    let s = codec::decode_sparse(bytes, b.rows as usize, b.cols as usize)
                        .expect("a decoded frame's payload is valid");
                    s.index.iter().map(|&r| r as f32).chain(s.values).collect()
                }
                _ => b
                    .values()
                    .expect("a decoded frame's payload is valid")
                    .into_owned(),
            };
            let bits: Vec<u32> = values.iter().map(|x| x.to_bits()).collect();
            let encoded = matches!(b.payload, HaloPayload::Encoded(_));
            format!(
                "halo {:?} {}x{} encoded={encoded} {:?} {:?}",
                b.header, b.rows, b.cols, bits, b.trace
            )
        }
        Ok(f) => format!("{f:?}"),
        // bytecheck messages carry addresses: compare the kind only.
        Err(WireError::Invalid(_)) => "error: invalid envelope".into(),
        Err(e) => format!("error: {e}"),
    }
}

fn valid_frames() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "hello",
            encode_to_vec(&Frame::Hello {
                node: 7,
                protocol: PROTOCOL_VERSION,
                incarnation: 0x5eed,
            }),
        ),
        ("ping", encode_to_vec(&Frame::Ping(9))),
        (
            "control",
            encode_to_vec(&Frame::Control(b"epoch 3 done".to_vec())),
        ),
        (
            "control-piece",
            encode_to_vec(&Frame::ControlPiece(
                b"the first piece of a large message".to_vec(),
            )),
        ),
        ("halo", encode_to_vec(&Frame::Halo(block(1, 2, 3, 4, 5)))),
        (
            "halo-empty",
            encode_to_vec(&Frame::Halo(block(1, 2, 3, 0, 5))),
        ),
        (
            "halo-traced",
            encode_to_vec(&Frame::Halo(traced_block(1, 2, 3, 2, 2))),
        ),
        (
            "halo-fp16",
            encode_to_vec(&Frame::Halo(encoded_block(Codec::Fp16, 1, 2, 3, 4))),
        ),
        (
            "halo-int4",
            encode_to_vec(&Frame::Halo(encoded_block(Codec::Int4, 1, 2, 3, 5))),
        ),
        (
            "halo-adaptive",
            encode_to_vec(&Frame::Halo(encoded_block(
                Codec::Adaptive { error_bound: 1e-3 },
                2,
                1,
                5,
                3,
            ))),
        ),
        (
            "halo-sparse",
            encode_to_vec(&Frame::Halo(sparse_block(1, 2, 6, 4, &[0, 3, 5]))),
        ),
        (
            "refused",
            encode_to_vec(&Frame::Refused("node 1 is already connected".into())),
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2000,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "fuzz-corpus/proptest-regressions.txt",
        ))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_encoded_bodies_decode_or_are_codec_errors(
        which in 6usize..9,
        flips in vec((any::<usize>(), any::<u8>()), 1..4),
    ) {
        // Flip bytes of the body only (the halo-codec payload after header and envelope): the
        // frame either decodes to finite values or is refused with a codec error.
        let mut bytes = valid_frames()[which].1.clone();
        let meta = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        let body = HEADER_LEN + meta;
        for (at, x) in flips {
            let n = bytes.len() - body;
            bytes[body + at % n] ^= x;
        }
        let out = decode(&bytes, &[]);
        prop_assert_eq!(out.len(), 1);
        prop_assert!(
            out[0].starts_with("halo ") || out[0].starts_with("error: halo block from partition"),
            "{}", out[0]
        );
    }

    #[test]
    fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..512), cuts in vec(any::<usize>(), 0..8)) {
        let whole = decode(&bytes, &[]);
        prop_assert_eq!(whole, decode(&bytes, &cuts));
    }

    #[test]
    fn random_bytes_after_a_valid_header_never_panic(
        kind in 0u8..4,
        meta in vec(any::<u8>(), 0..256),
        body in 0u64..512,
    ) {
        let header = FrameHeader { kind: FrameKind::Halo, meta_len: meta.len() as u32, body_len: body };
        let mut bytes = header.encode().to_vec();
        bytes[6] = kind;
        bytes.extend_from_slice(&meta);
        let _ = decode(&bytes, &[]);
    }

    #[test]
    fn mutated_frames_never_panic(
        which in 0usize..valid_frames().len(),
        flips in vec((any::<usize>(), any::<u8>()), 1..6),
        cut in any::<usize>(),
        cuts in vec(any::<usize>(), 0..6),
    ) {
        let mut bytes = valid_frames()[which].1.clone();
        for (at, x) in flips {
            let n = bytes.len();
            bytes[at % n] ^= x;
        }
        bytes.truncate(cut % (bytes.len() + 1) + 1);
        let whole = decode(&bytes, &[]);
        prop_assert_eq!(whole, decode(&bytes, &cuts));
    }
}

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus")
}

#[test]
fn replay_regression_corpus() {
    let mut n = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("fuzz-corpus/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "bin") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let bytes = std::fs::read(&path).unwrap();
        let whole = decode(&bytes, &[]);
        let cuts: Vec<usize> = (0..bytes.len()).collect();
        assert_eq!(
            whole,
            decode(&bytes, &cuts),
            "{name}: chunking changed the result"
        );
        let failed = whole
            .iter()
            .any(|s| s.starts_with("error") || s.starts_with("eof"));
        if name.starts_with("ok-") {
            assert!(!failed && !whole.is_empty(), "{name}: {whole:?}");
        } else if name.starts_with("err-") {
            assert!(failed, "{name} decoded without error: {whole:?}");
        }
        n += 1;
    }
    assert!(n >= 10, "the corpus has only {n} inputs");
}

/// Regenerates the seed inputs: `cargo test -p trellis-transport --test fuzz -- --ignored`.
#[test]
#[ignore]
fn write_seed_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    for (name, bytes) in valid_frames() {
        seeds.push((format!("ok-{name}"), bytes.clone()));
        seeds.push((
            format!("err-truncated-{name}"),
            bytes[..bytes.len() - 1].to_vec(),
        ));
        let mut v = bytes.clone();
        v[4] = 0x7f;
        seeds.push((format!("err-version-{name}"), v));
    }
    seeds.push((
        "ok-stream-of-all".into(),
        valid_frames().into_iter().flat_map(|(_, b)| b).collect(),
    ));
    seeds.push((
        "err-garbage-http".into(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
    ));
    seeds.push(("err-garbage-zeros".into(), vec![0; 64]));
    seeds.push(("err-truncated-header".into(), MAGIC.to_vec()));
    let huge = FrameHeader {
        kind: FrameKind::Halo,
        meta_len: 64,
        body_len: !3u64,
    }
    .encode()
    .to_vec();
    seeds.push(("err-oversized-body".into(), huge));
    let huge_meta = FrameHeader {
        kind: FrameKind::Message,
        meta_len: u32::MAX,
        body_len: 0,
    }
    .encode()
    .to_vec();
    seeds.push(("err-oversized-meta".into(), huge_meta));
    let mut bad_meta = FrameHeader {
        kind: FrameKind::Message,
        meta_len: 24,
        body_len: 0,
    }
    .encode()
    .to_vec();
    bad_meta.extend_from_slice(&[0xa5; 24]);
    seeds.push(("err-bytecheck".into(), bad_meta));
    let b = block(0, 1, 1, 3, 4);
    let mut mismatch = encode_head(&Envelope::halo(&b), 16);
    mismatch.extend_from_slice(&[0; 16]);
    seeds.push(("err-body-mismatch".into(), mismatch));
    let env = Envelope::Halo {
        run: [1; 16],
        epoch: 1,
        layer: 0,
        phase: 200,
        from: 0,
        to: 1,
        rows: 0,
        cols: 0,
        trace: None,
        encoded: false,
    };
    seeds.push(("err-phase".into(), encode_head(&env, 0)));
    for (name, bytes) in seeds {
        std::fs::write(dir.join(format!("{name}.bin")), bytes).unwrap();
    }
}
