//! Codec round trips and error bounds, unbiasedness of stochastic rounding, determinism, and
//! the decoder's refusals.
use super::*;

/// Uniform draws from a SplitMix64 stream keyed by (seed, row, column): deterministic, and
/// independent across rows and columns (the tests' stand-in for Trellis's Philox dither).
struct TestDither(u64);

impl Dither for TestDither {
    fn fill(&self, row: usize, out: &mut [u32]) {
        for (c, o) in out.iter_mut().enumerate() {
            let mut z =
                self.0 ^ ((row as u64) << 32 | c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            *o = ((z ^ (z >> 31)) >> 32) as u32;
        }
    }
}

/// Rows with a spread of magnitudes: embeddings-like (non-negative, ~1), gradient-like
/// (signed, ~1e-6), one constant row and one with a large offset.
fn sample(rows: usize, cols: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let t = ((r * 31 + c * 17) % 97) as f32 / 97.0;
            v.push(match r % 4 {
                0 => t * 3.0,
                1 => (t - 0.5) * 2e-6,
                2 => 0.25,
                _ => 1000.0 + t,
            });
        }
    }
    v
}

const ALL: [Codec; 5] = [
    Codec::Fp16,
    Codec::Bf16,
    Codec::Int8,
    Codec::Int4,
    Codec::Adaptive { error_bound: 1e-3 },
];

#[test]
fn round_trips_stay_within_each_codecs_error_bound() {
    let (rows, cols) = (12, 13);
    let x = sample(rows, cols);
    for codec in ALL {
        let enc = encode(codec, rows, cols, &x, &TestDither(1)).unwrap();
        assert_eq!(enc[0], codec.id());
        assert_eq!(enc[1], CODEC_VERSION);
        let y = decode(&enc, rows, cols).unwrap();
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let (min, max) = quant::range(row);
            for c in 0..cols {
                let (a, b) = (row[c], y[r * cols + c]);
                let bound = match codec {
                    // Round to nearest: half a unit in the last place.
                    Codec::Fp16 => a.abs() * 2f32.powi(-11) + 6e-8,
                    Codec::Bf16 => a.abs() * 2f32.powi(-8),
                    // Stochastic rounding moves a value by less than one step, and the step
                    // is the row's range (widened to bfloat16 grid points) over 2^b - 1.
                    Codec::Int8 | Codec::Int4 | Codec::Adaptive { .. } => {
                        let bits = match codec {
                            Codec::Int8 => 8,
                            Codec::Int4 => 4,
                            _ => choose_bits(row, 1e-3),
                        };
                        let (lo, step) = quant::grid(min, max, bits);
                        assert!(
                            lo.to_f32() <= min
                                && (max - lo.to_f32())
                                    <= step.to_f32() * quant::levels(bits) as f32 * 1.0001
                        );
                        assert!(
                            step.to_f32()
                                <= (max - lo.to_f32()) / quant::levels(bits) as f32 * 1.01 + 1e-30
                        );
                        step.to_f32() * 1.0001 + a.abs() * 1e-6
                    }
                };
                assert!(
                    (a - b).abs() <= bound,
                    "{} row {r} col {c}: {a} -> {b} (bound {bound})",
                    codec.name()
                );
            }
        }
    }
}

#[test]
fn encodings_are_deterministic_and_depend_only_on_the_dither() {
    let (rows, cols) = (8, 20);
    let x = sample(rows, cols);
    for codec in ALL {
        let a = encode(codec, rows, cols, &x, &TestDither(7)).unwrap();
        assert_eq!(a, encode(codec, rows, cols, &x, &TestDither(7)).unwrap());
        let b = encode(codec, rows, cols, &x, &TestDither(8)).unwrap();
        let stochastic = !matches!(codec, Codec::Fp16 | Codec::Bf16);
        assert_eq!(a != b, stochastic, "{}", codec.name());
    }
}

#[test]
fn stochastic_rounding_is_unbiased() {
    // One row whose values sit at every fraction between grid points; the mean of many
    // independently dithered decodings converges to the value (error ~ step / (2 sqrt(n))).
    let cols = 64;
    let row: Vec<f32> = (0..cols).map(|c| (c as f32 * 0.37).sin()).collect();
    let draws = 4000;
    for bits in [2u32, 4, 8] {
        let codec = match bits {
            8 => Codec::Int8,
            4 => Codec::Int4,
            _ => Codec::Adaptive { error_bound: 1e9 }, // every row takes 2 bits
        };
        let mut sum = vec![0f64; cols];
        let mut sq = vec![0f64; cols];
        for d in 0..draws {
            let y = decode(
                &encode(codec, 1, cols, &row, &TestDither(d)).unwrap(),
                1,
                cols,
            )
            .unwrap();
            for c in 0..cols {
                let e = (y[c] - row[c]) as f64;
                sum[c] += e;
                sq[c] += e * e;
            }
        }
        let (min, max) = quant::range(&row);
        let step = quant::grid(min, max, bits).1.to_f64();
        for c in 0..cols {
            let mean = sum[c] / draws as f64;
            // Five standard errors of the mean, with the variance bound step^2 / 4.
            let tol = 5.0 * step / 2.0 / (draws as f64).sqrt();
            assert!(
                mean.abs() <= tol,
                "{bits} bits col {c}: bias {mean} > {tol}"
            );
            let var = sq[c] / draws as f64 - mean * mean;
            assert!(
                var <= step * step / 4.0 * 1.1,
                "{bits} bits col {c}: variance {var}"
            );
        }
    }
}

#[test]
fn adaptive_widths_keep_the_variance_under_the_bound() {
    let cols = 32;
    let smooth: Vec<f32> = (0..cols).map(|c| 1.0 + c as f32 * 1e-3).collect();
    let spiky: Vec<f32> = (0..cols).map(|c| if c == 3 { 5.0 } else { 0.01 }).collect();
    let zeros = vec![0f32; cols];
    for (row, e) in [
        (&smooth, 1e-2f32),
        (&smooth, 1e-8),
        (&spiky, 1e-1),
        (&spiky, 1e-4),
        (&zeros, 1e-6),
    ] {
        let bits = choose_bits(row, e);
        let (min, max) = quant::range(row);
        let step = quant::grid(min, max, bits).1.to_f64();
        let energy: f64 = row.iter().map(|&x| (x as f64).powi(2)).sum();
        let var = cols as f64 * step * step / 4.0;
        assert!(
            var <= e as f64 * energy || bits == 16,
            "{bits} bits, {var} > {e} * {energy}"
        );
        // Fewest bits: the next narrower width would break the bound.
        if let Some(i) = ADAPTIVE_WIDTHS
            .iter()
            .position(|&b| b == bits)
            .filter(|&i| i > 0)
        {
            let narrower = quant::grid(min, max, ADAPTIVE_WIDTHS[i - 1]).1.to_f64();
            assert!(cols as f64 * narrower * narrower / 4.0 > e as f64 * energy);
        }
    }
    assert_eq!(choose_bits(&zeros, 1e-6), 2);
    assert_eq!(
        choose_bits(&smooth, 1e-2),
        2,
        "an offset row has a small relative range"
    );
    assert!(choose_bits(&spiky, 1e-4) >= 8);
}

#[test]
fn encoded_sizes_are_what_the_format_says() {
    let (rows, cols) = (10, 16);
    let x = sample(rows, cols);
    let len = |c| encode(c, rows, cols, &x, &TestDither(0)).unwrap().len();
    assert_eq!(len(Codec::Fp16), 2 + rows * cols * 2);
    assert_eq!(len(Codec::Bf16), 2 + rows * cols * 2);
    assert_eq!(len(Codec::Int8), 2 + rows * (4 + cols));
    assert_eq!(len(Codec::Int4), 2 + rows * (4 + cols / 2));
    let adaptive = len(Codec::Adaptive { error_bound: 1e-2 });
    assert!(
        adaptive >= 2 + 3 + rows * (4 + cols / 4)
            && adaptive <= max_encoded_len(rows, cols).unwrap()
    );
}

#[test]
fn values_that_are_not_finite_are_refused_by_the_encoder() {
    let mut x = sample(3, 4);
    x[6] = f32::NAN;
    for codec in ALL {
        let e = encode(codec, 3, 4, &x, &TestDither(0)).unwrap_err();
        assert!(
            matches!(e, CodecError::NonFinite { row: 1, col: 2, .. }),
            "{e}"
        );
    }
    assert!(matches!(
        encode(Codec::Int8, 3, 5, &x, &TestDither(0)),
        Err(CodecError::Shape { .. })
    ));
    let wide = [-3e38f32, 3e38];
    assert!(matches!(
        encode(Codec::Int8, 1, 2, &wide, &TestDither(0)),
        Err(CodecError::Range { row: 0, .. })
    ));
}

#[test]
fn fp16_saturates_instead_of_overflowing() {
    let x = [1e6f32, -1e6, 3.0];
    let y = decode(
        &encode(Codec::Fp16, 1, 3, &x, &TestDither(0)).unwrap(),
        1,
        3,
    )
    .unwrap();
    assert_eq!(y, vec![65504.0, -65504.0, 3.0]);
}

#[test]
fn corrupt_payloads_are_typed_errors() {
    let (rows, cols) = (5, 3);
    let x = sample(rows, cols);
    let good = encode(
        Codec::Adaptive { error_bound: 1e-3 },
        rows,
        cols,
        &x,
        &TestDither(0),
    )
    .unwrap();
    assert!(validate(&good, rows, cols).is_ok());
    assert!(matches!(
        decode(&[], rows, cols),
        Err(CodecError::TooShort(0))
    ));
    assert!(matches!(
        decode(&[9, 1], rows, cols),
        Err(CodecError::UnknownCodec(9))
    ));
    let mut v = good.clone();
    v[1] = 2;
    assert!(matches!(
        decode(&v, rows, cols),
        Err(CodecError::Version { got: 2, .. })
    ));
    assert!(matches!(
        decode(&good[..good.len() - 1], rows, cols),
        Err(CodecError::Length { .. })
    ));
    assert!(matches!(
        decode(&good, rows + 1, cols),
        Err(CodecError::Length { .. })
    ));
    // Row width codes: 5 rows leave 6 padding bits in the second byte.
    let mut v = good.clone();
    v[3] |= 0x80;
    assert!(matches!(
        decode(&v, rows, cols),
        Err(CodecError::Padding { .. })
    ));
    // A step that is NaN (bfloat16 0x7fc0) in row 0's header.
    let mut v = good.clone();
    let h = 2 + rows.div_ceil(4);
    v[h + 2..h + 4].copy_from_slice(&0x7fc0u16.to_le_bytes());
    assert!(matches!(
        decode(&v, rows, cols),
        Err(CodecError::BadScale {
            row: 0,
            what: "step",
            ..
        })
    ));
    let mut v = good.clone();
    v[h..h + 2].copy_from_slice(&0xff80u16.to_le_bytes()); // -inf
    assert!(matches!(
        decode(&v, rows, cols),
        Err(CodecError::BadScale {
            row: 0,
            what: "minimum",
            ..
        })
    ));
    // Int4 with an odd column count has a zero nibble at the end of every row.
    let int4 = encode(Codec::Int4, rows, cols, &x, &TestDither(0)).unwrap();
    let mut v = int4.clone();
    let row0 = 2 + rows * 4;
    v[row0 + 1] |= 0xf0;
    assert!(matches!(
        decode(&v, rows, cols),
        Err(CodecError::Padding { .. })
    ));
    // fp16 infinity.
    let mut v = encode(Codec::Fp16, rows, cols, &x, &TestDither(0)).unwrap();
    v[2..4].copy_from_slice(&0x7c00u16.to_le_bytes());
    assert!(matches!(
        decode(&v, rows, cols),
        Err(CodecError::BadValue { row: 0, col: 0, .. })
    ));
    // Shapes whose sizes overflow are refused without allocating.
    assert!(matches!(
        decode(&good, usize::MAX, usize::MAX),
        Err(CodecError::Length { .. })
    ));
}

#[test]
fn every_mutation_of_a_payload_decodes_or_fails_cleanly() {
    let (rows, cols) = (6, 5);
    let x = sample(rows, cols);
    for codec in ALL {
        let good = encode(codec, rows, cols, &x, &TestDither(3)).unwrap();
        for at in 0..good.len() {
            for flip in [0x01u8, 0x10, 0x80, 0xff] {
                let mut v = good.clone();
                v[at] ^= flip;
                // Either a typed error or finite values, and validate agrees with decode.
                match decode(&v, rows, cols) {
                    Ok(y) => {
                        assert!(y.iter().all(|x| x.is_finite()));
                        assert!(validate(&v, rows, cols).is_ok());
                    }
                    Err(e) => assert_eq!(validate(&v, rows, cols), Err(e)),
                }
            }
        }
    }
}

#[test]
fn sparse_payloads_carry_the_changed_rows_raw_or_encoded() {
    let (rows, cols) = (9, 5);
    let data = sample(rows, cols);
    let index = [1u32, 4, 8];
    let picked: Vec<f32> = index
        .iter()
        .flat_map(|&r| data[r as usize * cols..(r as usize + 1) * cols].to_vec())
        .collect();
    let raw = encode_sparse(rows, &index, SparseInner::F32(&picked)).unwrap();
    assert!(is_sparse(&raw));
    assert_eq!(raw.len(), 6 + 4 * index.len() + 2 + 4 * picked.len());
    let back = decode_sparse(&raw, rows, cols).unwrap();
    assert_eq!(back.index, index);
    assert_eq!(back.values, picked);
    validate(&raw, rows, cols).unwrap();
    // A plain decode needs the receiver's copy: refused, typed.
    assert_eq!(decode(&raw, rows, cols), Err(CodecError::Sparse));
    for codec in ALL {
        let inner = encode(codec, index.len(), cols, &picked, &TestDither(3)).unwrap();
        let bytes = encode_sparse(rows, &index, SparseInner::Encoded(&inner)).unwrap();
        let back = decode_sparse(&bytes, rows, cols).unwrap();
        assert_eq!(back.index, index);
        assert_eq!(
            back.values,
            decode(&inner, index.len(), cols).unwrap(),
            "{codec:?}"
        );
        assert!(bytes.len() <= max_encoded_len(rows, cols).unwrap());
    }
    // No rows changed: a valid, short payload.
    let none = encode_sparse(rows, &[], SparseInner::F32(&[])).unwrap();
    assert_eq!(decode_sparse(&none, rows, cols).unwrap().values.len(), 0);
    // Every row, raw: the longest sparse payload, within the decoder's bound.
    let all: Vec<u32> = (0..rows as u32).collect();
    let full = encode_sparse(rows, &all, SparseInner::F32(&data)).unwrap();
    assert!(full.len() <= max_encoded_len(rows, cols).unwrap());
}

#[test]
fn corrupt_sparse_payloads_are_typed_errors() {
    let (rows, cols) = (6, 3);
    let vals = [1.0f32; 6];
    let good = encode_sparse(rows, &[0, 5], SparseInner::F32(&vals)).unwrap();
    // Indices not ascending, repeated, or past the block: refused by the encoder and decoder.
    for bad in [[5u32, 0], [2, 2], [1, 6]] {
        assert!(matches!(
            encode_sparse(rows, &bad, SparseInner::F32(&vals)),
            Err(CodecError::SparseIndex { .. })
        ));
        let mut b = good.clone();
        b[6..10].copy_from_slice(&bad[0].to_le_bytes());
        b[10..14].copy_from_slice(&bad[1].to_le_bytes());
        assert!(
            matches!(
                decode_sparse(&b, rows, cols),
                Err(CodecError::SparseIndex { .. })
            ),
            "{bad:?}"
        );
    }
    // More rows than the block has, a truncated index, a short or long raw section.
    let mut b = good.clone();
    b[2..6].copy_from_slice(&7u32.to_le_bytes());
    assert!(decode_sparse(&b, rows, cols).is_err());
    assert!(decode_sparse(&good[..9], rows, cols).is_err());
    assert!(matches!(
        decode_sparse(&good[..good.len() - 1], rows, cols),
        Err(CodecError::Length { .. })
    ));
    let mut long = good.clone();
    long.push(0);
    assert!(validate(&long, rows, cols).is_err());
    // A non-finite raw value, another version, a sparse payload inside a sparse payload.
    let mut b = good.clone();
    let at = b.len() - 4;
    b[at..].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(matches!(
        decode_sparse(&b, rows, cols),
        Err(CodecError::BadValue { .. })
    ));
    let mut b = good.clone();
    b[1] = 9;
    assert!(matches!(
        decode_sparse(&b, rows, cols),
        Err(CodecError::Version { .. })
    ));
    let nested = encode_sparse(rows, &[0, 5], SparseInner::Encoded(&good)).unwrap();
    assert_eq!(
        decode_sparse(&nested, rows, cols),
        Err(CodecError::NestedSparse)
    );
    assert!(encode_sparse(rows, &[1], SparseInner::F32(&[f32::INFINITY; 3])).is_err());
    // Every single-byte mutation decodes or fails cleanly (never panics).
    for i in 0..good.len() {
        for x in [1u8, 0x80, 0xff] {
            let mut b = good.clone();
            b[i] ^= x;
            let _ = decode_sparse(&b, rows, cols);
            let _ = validate(&b, rows, cols);
        }
    }
}

#[test]
fn a_sparse_payload_merges_into_a_dense_one_without_decoding() {
    let (rows, cols) = (9, 5);
    let base_rows = sample(rows, cols);
    // Other values in the changed rows, so that a merge that kept the base's shows.
    let index = [0u32, 3, 8];
    let picked: Vec<f32> = index
        .iter()
        .flat_map(|&r| {
            base_rows[r as usize * cols..(r as usize + 1) * cols]
                .iter()
                .map(|x| x * -2.0 + 0.5)
                .collect::<Vec<_>>()
        })
        .collect();
    for codec in ALL {
        let base = encode(codec, rows, cols, &base_rows, &TestDither(1)).unwrap();
        let inner = encode(codec, index.len(), cols, &picked, &TestDither(2)).unwrap();
        let sparse = encode_sparse(rows, &index, SparseInner::Encoded(&inner)).unwrap();
        let merged = merge_sparse(&base, rows, cols, &sparse).unwrap();
        let Some(merged) = merged else {
            assert!(matches!(codec, Codec::Adaptive { .. }), "{codec:?}");
            continue;
        };
        assert_eq!(
            merged.len(),
            base.len(),
            "{codec:?}: still dense, same size"
        );
        // What a receiver that decodes both and overwrites rows gets, bit for bit.
        let mut want = decode(&base, rows, cols).unwrap();
        decode_sparse(&sparse, rows, cols)
            .unwrap()
            .overwrite(&mut want, cols);
        let got = decode(&merged, rows, cols).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{codec:?}");
        // Another codec's rows, or raw fp32 rows, are not merged in encoded form.
        let other = if codec == Codec::Int8 {
            Codec::Int4
        } else {
            Codec::Int8
        };
        let inner = encode(other, index.len(), cols, &picked, &TestDither(2)).unwrap();
        let mixed = encode_sparse(rows, &index, SparseInner::Encoded(&inner)).unwrap();
        assert_eq!(merge_sparse(&base, rows, cols, &mixed), Ok(None));
        let raw = encode_sparse(rows, &index, SparseInner::F32(&picked)).unwrap();
        assert_eq!(merge_sparse(&base, rows, cols, &raw), Ok(None));
        // A corrupt payload on either side is a typed error, never a panic.
        let mut bad = sparse.clone();
        bad.truncate(bad.len() - 1);
        assert!(merge_sparse(&base, rows, cols, &bad).is_err(), "{codec:?}");
        assert!(merge_sparse(&base[..base.len() - 1], rows, cols, &sparse).is_err());
        assert_eq!(
            merge_sparse(&sparse, rows, cols, &sparse),
            Err(CodecError::Sparse)
        );
    }
}

/// A held block merges sparse payloads that came off the network: every mutation of one is a
/// typed error or a merge that decodes as decoding and overwriting would.
#[test]
fn every_mutation_of_a_merged_sparse_payload_merges_exactly_or_fails_cleanly() {
    let (rows, cols) = (6, 5);
    let x = sample(rows, cols);
    let index = [1u32, 4];
    let picked: Vec<f32> = index
        .iter()
        .flat_map(|&r| {
            x[r as usize * cols..(r as usize + 1) * cols]
                .iter()
                .map(|v| v + 1.0)
        })
        .collect();
    for codec in [Codec::Fp16, Codec::Bf16, Codec::Int8, Codec::Int4] {
        let base = encode(codec, rows, cols, &x, &TestDither(3)).unwrap();
        let inner = encode(codec, index.len(), cols, &picked, &TestDither(4)).unwrap();
        let good = encode_sparse(rows, &index, SparseInner::Encoded(&inner)).unwrap();
        for at in 0..good.len() {
            for flip in [0x01u8, 0x10, 0x80, 0xff] {
                let mut v = good.clone();
                v[at] ^= flip;
                match merge_sparse(&base, rows, cols, &v) {
                    Ok(Some(merged)) => {
                        let mut want = decode(&base, rows, cols).unwrap();
                        decode_sparse(&v, rows, cols)
                            .unwrap()
                            .overwrite(&mut want, cols);
                        assert_eq!(decode(&merged, rows, cols).unwrap(), want, "{codec:?}");
                    }
                    // Another codec's id in the inner section (after id, version, count and
                    // the two indices): the caller decodes, and checks, the rows itself.
                    Ok(None) => assert_ne!(v[2 + 4 + 8], base[0], "{codec:?} at {at}"),
                    Err(_) => assert!(
                        decode_sparse(&v, rows, cols).is_err()
                            || decode(&base, rows, cols).is_err()
                    ),
                }
            }
        }
    }
}

/// The int8 and int4 rows are packed and unpacked a byte at a time, with a truncating cast for
/// the stochastic rounding's floor: the codes are those of the formula with `floor` packed
/// code by code, and the values those of the generic unpacking, bit for bit.
#[test]
fn the_byte_at_a_time_int_paths_equal_the_generic_ones_bit_for_bit() {
    let rows = 9;
    for cols in [1, 7, 8, 13, 256] {
        let x = sample(rows, cols);
        for (codec, bits) in [(Codec::Int8, 8u32), (Codec::Int4, 4)] {
            let enc = encode(codec, rows, cols, &x, &TestDither(5)).unwrap();
            let p = parse(&enc, rows, cols).unwrap();
            let n = quant::row_bytes(cols, bits).unwrap();
            let mut draws = vec![0u32; cols];
            for r in 0..rows {
                let h = &p.headers[r * ROW_HEADER..(r + 1) * ROW_HEADER];
                let lo = bf16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f64();
                let step = bf16::from_bits(u16::from_le_bytes([h[2], h[3]])).to_f64();
                let inv = if step == 0.0 { 0.0 } else { 1.0 / step };
                TestDither(5).fill(r, &mut draws);
                let row = &p.body[r * n..(r + 1) * n];
                let mut codes = vec![0u32; cols];
                quant::unpack_row(row, cols, bits, |c, q| codes[c] = q).unwrap();
                for c in 0..cols {
                    let t = (x[r * cols + c] as f64 - lo) * inv;
                    let u = (draws[c] >> 8) as f64 * (1.0 / 16_777_216.0);
                    let q = ((t + u).floor().max(0.0) as u32).min(quant::levels(bits));
                    assert_eq!(codes[c], q, "{codec:?} {cols} cols, row {r}, column {c}");
                }
                let (min, st) = (lo as f32, step as f32);
                let mut fast = vec![0f32; cols];
                quant::dequant_row(row, cols, bits, min, st, &mut fast).unwrap();
                let mut slow = vec![0f32; cols];
                quant::unpack_row(row, cols, bits, |c, q| slow[c] = min + q as f32 * st).unwrap();
                assert_eq!(
                    fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
            // Set padding bits are refused by both.
            if cols % 2 == 1 && bits == 4 {
                let mut row = p.body[..n].to_vec();
                *row.last_mut().unwrap() |= 0xF0;
                let mut out = vec![0f32; cols];
                assert!(quant::dequant_row(&row, cols, 4, 0.0, 1.0, &mut out).is_err());
                assert!(quant::unpack_row(&row, cols, 4, |_, _| {}).is_err());
            }
        }
    }
}

/// A block decodes straight into its rows' places in a larger buffer, as decoding it and
/// copying each row there would; a place past the buffer is an error, not a panic.
#[test]
fn a_payload_decodes_into_scattered_rows_of_a_buffer() {
    let (rows, cols) = (5, 6);
    let x = sample(rows, cols);
    let places = [7usize, 0, 3, 4, 9];
    for codec in ALL {
        let enc = encode(codec, rows, cols, &x, &TestDither(2)).unwrap();
        let whole = decode(&enc, rows, cols).unwrap();
        let mut buf = vec![f32::NAN; 10 * cols];
        decode_into(&enc, rows, cols, &mut buf, &|r| places[r]).unwrap();
        for (r, &at) in places.iter().enumerate() {
            assert_eq!(
                buf[at * cols..(at + 1) * cols],
                whole[r * cols..(r + 1) * cols],
                "{codec:?}"
            );
        }
        let mut short = vec![0f32; 9 * cols];
        let e = decode_into(&enc, rows, cols, &mut short, &|r| places[r]).unwrap_err();
        assert!(matches!(e, CodecError::Output { .. }), "{e}");
    }
}

/// A sparse payload of no rows merges into the base itself, borrowed (no copy).
#[test]
fn merging_no_rows_borrows_the_base() {
    let (rows, cols) = (4, 3);
    let values: Vec<f32> = (0..rows * cols).map(|v| v as f32 * 0.25).collect();
    for codec in [Codec::Fp16, Codec::Int8, Codec::Int4] {
        let base = encode(codec, rows, cols, &values, &TestDither(1)).unwrap();
        let inner = encode(codec, 0, cols, &[], &TestDither(2)).unwrap();
        let sparse = encode_sparse(rows, &[], SparseInner::Encoded(&inner)).unwrap();
        match merge_sparse(&base, rows, cols, &sparse) {
            Ok(Some(std::borrow::Cow::Borrowed(b))) => assert!(std::ptr::eq(b, &base[..])),
            other => panic!("{codec:?}: {other:?}"),
        }
    }
}
