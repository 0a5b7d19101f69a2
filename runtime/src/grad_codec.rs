//! Gradient compression for the all-reduce, with error feedback.
//!
//! A partition's weight gradients (every parameter's, concatenated) leave it compressed and
//! are decoded by the coordinator before the fixed-order sum:
//!
//! - `int8` (QSGD-style): blocks of [`INT8_BLOCK`] values share one f32 scale
//!   `max|v| / 127`; each value becomes `floor(v / scale + u)` in `[-127, 127]` with `u`
//!   uniform in `[0, 1)` (stochastic rounding: unbiased), drawn from Philox keyed by
//!   (seed, epoch, partition, element). 1 byte per value plus 4 per block.
//! - `topk:F` (Deep Gradient Compression): the `ceil(F * n)` values of largest magnitude
//!   (ties broken by lower index) as (u32 index, f32 value) pairs; the rest are zero.
//!
//! **Error feedback** ([`ErrorFeedback`]): each partition keeps what compression dropped,
//! `residual = (g + residual) - decode(encode(g + residual))`, and adds it into its next
//! step's gradient, so over steps every gradient contribution is eventually sent. The
//! residual is per-partition state that nobody else can recompute: it is part of the
//! partition's replicated snapshot. Everything here is a pure function of its inputs and
//! the key: the same seed gives the same bytes, whatever the threads or timing.
use rkyv::{Archive, Deserialize as RkyvDeserialize, Serialize as RkyvSerialize};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use trellis_gpu::Philox4x32;

/// Values per int8 block (one scale each).
pub const INT8_BLOCK: usize = 256;

/// Errors of gradient codecs: a spec that does not parse, or a payload that does not decode.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GradCodecError {
    #[error("unknown gradient codec `{0}` (expected none, int8 or topk:F with 0 < F <= 1)")]
    BadSpec(String),
    #[error("malformed compressed gradients: {0}")]
    Malformed(String),
}

/// How partitions compress their gradients (`--grad-codec`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum GradCodec {
    /// Exact f32 gradients.
    #[default]
    None,
    /// Block-scaled int8 with stochastic rounding.
    Int8,
    /// The largest `fraction` of the values by magnitude.
    TopK { fraction: f32 },
}

impl GradCodec {
    /// True for exact gradients.
    pub fn is_none(&self) -> bool {
        *self == GradCodec::None
    }
}

impl std::str::FromStr for GradCodec {
    type Err = GradCodecError;
    fn from_str(s: &str) -> Result<Self, GradCodecError> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "none" | "exact" => return Ok(GradCodec::None),
            "int8" => return Ok(GradCodec::Int8),
            _ => {}
        }
        let fraction = t
            .strip_prefix("topk:")
            .and_then(|f| f.parse::<f32>().ok())
            .filter(|f| f.is_finite() && *f > 0.0 && *f <= 1.0)
            .ok_or_else(|| GradCodecError::BadSpec(s.to_string()))?;
        Ok(GradCodec::TopK { fraction })
    }
}

impl std::fmt::Display for GradCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GradCodec::None => f.write_str("none"),
            GradCodec::Int8 => f.write_str("int8"),
            GradCodec::TopK { fraction } => write!(f, "topk:{fraction}"),
        }
    }
}

impl From<GradCodec> for String {
    fn from(c: GradCodec) -> String {
        c.to_string()
    }
}

impl TryFrom<String> for GradCodec {
    type Error = GradCodecError;
    fn try_from(s: String) -> Result<Self, GradCodecError> {
        s.parse()
    }
}

/// What keys the stochastic rounding of one partition's gradients in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundingKey {
    pub seed: u64,
    pub epoch: u32,
    pub partition: u32,
}

/// Compressed gradients as they travel from a partition to the coordinator.
#[derive(Debug, Clone, PartialEq, Archive, RkyvSerialize, RkyvDeserialize)]
pub enum GradPayload {
    /// `len` values in blocks of [`INT8_BLOCK`]: value `i` is `values[i] * scales[i / B]`.
    Int8 {
        len: u32,
        scales: Vec<f32>,
        values: Vec<i8>,
    },
    /// `len` values, zero but at `indices` (ascending), which hold `values`.
    TopK {
        len: u32,
        indices: Vec<u32>,
        values: Vec<f32>,
    },
}

impl GradPayload {
    /// Number of gradient values it stands for.
    pub fn len(&self) -> usize {
        match self {
            GradPayload::Int8 { len, .. } | GradPayload::TopK { len, .. } => *len as usize,
        }
    }

    /// True when it stands for no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of its payload on the wire (scales, values, indices).
    pub fn wire_bytes(&self) -> u64 {
        match self {
            GradPayload::Int8 { scales, values, .. } => {
                4 * scales.len() as u64 + values.len() as u64
            }
            GradPayload::TopK {
                indices, values, ..
            } => 4 * (indices.len() + values.len()) as u64,
        }
    }

    /// Bytes the same gradients take exact (f32).
    pub fn exact_bytes(&self) -> u64 {
        4 * self.len() as u64
    }

    /// The gradients it stands for. A payload received from elsewhere is checked: wrong
    /// lengths, indices out of range or not ascending, and non-finite numbers are errors.
    pub fn decode(&self) -> Result<Vec<f32>, GradCodecError> {
        let bad = |m: String| Err(GradCodecError::Malformed(m));
        match self {
            GradPayload::Int8 {
                len,
                scales,
                values,
            } => {
                let n = *len as usize;
                if values.len() != n || scales.len() != n.div_ceil(INT8_BLOCK) {
                    return bad(format!(
                        "int8: {} values and {} scales for {n} gradients",
                        values.len(),
                        scales.len()
                    ));
                }
                if scales.iter().any(|s| !s.is_finite() || *s < 0.0) {
                    return bad("int8: a scale is negative or not finite".into());
                }
                Ok(values
                    .iter()
                    .enumerate()
                    .map(|(i, &q)| q as f32 * scales[i / INT8_BLOCK])
                    .collect())
            }
            GradPayload::TopK {
                len,
                indices,
                values,
            } => {
                let n = *len as usize;
                if indices.len() != values.len() || indices.len() > n {
                    return bad(format!(
                        "topk: {} indices and {} values for {n} gradients",
                        indices.len(),
                        values.len()
                    ));
                }
                if indices.windows(2).any(|w| w[0] >= w[1])
                    || indices.last().is_some_and(|&i| i as usize >= n)
                {
                    return bad(format!("topk: indices not ascending below {n}"));
                }
                if values.iter().any(|v| !v.is_finite()) {
                    return bad("topk: a value is not finite".into());
                }
                let mut out = vec![0.0; n];
                for (&i, &v) in indices.iter().zip(values) {
                    out[i as usize] = v;
                }
                Ok(out)
            }
        }
    }
}

/// Uniform `[0, 1)` draws for elements `first..first + n` of a step's gradients.
fn uniforms(key: RoundingKey, first: usize, n: usize) -> Vec<f32> {
    let g = Philox4x32::new(key.seed ^ 0x6772_6164_5f71_7367); // "grad_qsg"
    let mut out = Vec::with_capacity(n);
    let mut e = first;
    while out.len() < n {
        let quad = e / 4;
        let block = g.block([0x4752_4144, key.epoch, key.partition, quad as u32]);
        for &x in block.iter().skip(e % 4) {
            if out.len() == n {
                break;
            }
            out.push(Philox4x32::to_unit(x));
            e += 1;
        }
    }
    out
}

/// `v` in int8 blocks with stochastic rounding.
fn encode_int8(v: &[f32], key: RoundingKey) -> GradPayload {
    let mut scales = Vec::with_capacity(v.len().div_ceil(INT8_BLOCK));
    let mut values = Vec::with_capacity(v.len());
    for (b, block) in v.chunks(INT8_BLOCK).enumerate() {
        let max = block
            .iter()
            .filter(|x| x.is_finite())
            .fold(0.0f32, |m, x| m.max(x.abs()));
        let scale = max / 127.0;
        scales.push(scale);
        let u = uniforms(key, b * INT8_BLOCK, block.len());
        for (&x, &u) in block.iter().zip(&u) {
            let q = if scale > 0.0 && x.is_finite() {
                (x / scale + u).floor().clamp(-127.0, 127.0)
            } else {
                0.0
            };
            values.push(q as i8);
        }
    }
    GradPayload::Int8 {
        len: v.len() as u32,
        scales,
        values,
    }
}

/// The `ceil(fraction * n)` values of `v` of largest magnitude (ties: lower index first).
fn encode_topk(v: &[f32], fraction: f32) -> GradPayload {
    let n = v.len();
    let k = ((fraction as f64 * n as f64).ceil() as usize).clamp(n.min(1), n);
    let mag = |i: u32| {
        let x = v[i as usize];
        if x.is_finite() {
            x.abs()
        } else {
            0.0
        }
    };
    let mut order: Vec<u32> = (0..n as u32).collect();
    if k < n {
        // A total order (magnitude descending, then index ascending): the same set every time.
        order.select_nth_unstable_by(k, |&a, &b| mag(b).total_cmp(&mag(a)).then(a.cmp(&b)));
        order.truncate(k);
    }
    order.sort_unstable();
    let values = order.iter().map(|&i| v[i as usize]).collect();
    GradPayload::TopK {
        len: n as u32,
        indices: order,
        values,
    }
}

/// A partition's error-feedback residual: what compression has dropped so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
}

impl ErrorFeedback {
    /// A residual restored from a snapshot (empty: none yet).
    pub fn from_residual(residual: Vec<f32>) -> Self {
        ErrorFeedback { residual }
    }

    /// The residual (empty before the first compressed step).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Compresses `grads + residual` with `codec` and keeps what the payload does not carry
    /// as the next residual; `None` for [`GradCodec::None`] (exact gradients, no residual).
    pub fn compress(
        &mut self,
        codec: GradCodec,
        grads: &[f32],
        key: RoundingKey,
    ) -> Option<GradPayload> {
        if codec.is_none() {
            return None;
        }
        if self.residual.len() != grads.len() {
            self.residual = vec![0.0; grads.len()];
        }
        let v: Vec<f32> = grads
            .iter()
            .zip(&self.residual)
            .map(|(g, r)| g + r)
            .collect();
        let payload = match codec {
            GradCodec::None | GradCodec::Int8 => encode_int8(&v, key),
            GradCodec::TopK { fraction } => encode_topk(&v, fraction),
        };
        let sent = payload.decode().expect("a payload encoded here decodes");
        for ((r, x), s) in self.residual.iter_mut().zip(&v).zip(&sent) {
            *r = x - s;
        }
        Some(payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grads(n: usize, seed: u32) -> Vec<f32> {
        let g = Philox4x32::new(seed as u64);
        (0..n)
            .map(|i| {
                let u = Philox4x32::to_unit(g.block([i as u32, seed, 0, 0])[0]);
                (2.0 * u - 1.0) * 10f32.powi((i % 5) as i32 - 3)
            })
            .collect()
    }

    fn key(epoch: u32) -> RoundingKey {
        RoundingKey {
            seed: 3,
            epoch,
            partition: 1,
        }
    }

    #[test]
    fn specs_parse_print_and_refuse() {
        for (s, c) in [
            ("none", GradCodec::None),
            ("INT8", GradCodec::Int8),
            ("topk:0.01", GradCodec::TopK { fraction: 0.01 }),
        ] {
            assert_eq!(s.parse::<GradCodec>().unwrap(), c);
            assert_eq!(c.to_string().parse::<GradCodec>().unwrap(), c);
        }
        for bad in ["int4", "topk:0", "topk:1.5", "topk:nan", "topk:"] {
            let e = bad.parse::<GradCodec>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("topk:F"), "{e}");
        }
        let json = serde_json::to_string(&GradCodec::TopK { fraction: 0.1 }).unwrap();
        assert_eq!(json, "\"topk:0.1\"");
        assert!(serde_json::from_str::<GradCodec>("\"int3\"").is_err());
    }

    #[test]
    fn int8_round_trip_is_within_one_step_and_unbiased() {
        let g = grads(1000, 1);
        let p = encode_int8(&g, key(0));
        assert_eq!(p.wire_bytes(), 1000 + 4 * 4);
        assert_eq!(p.exact_bytes(), 4000);
        let d = p.decode().unwrap();
        let GradPayload::Int8 { scales, .. } = &p else {
            unreachable!()
        };
        for (i, (a, b)) in g.iter().zip(&d).enumerate() {
            let step = scales[i / INT8_BLOCK];
            assert!(
                (a - b).abs() <= step * 1.0001,
                "{i}: {a} vs {b} (step {step})"
            );
        }
        // Stochastic rounding is unbiased: the mean over many keys approaches the value.
        let x = vec![0.3f32, -0.77, 1.0, 0.01];
        let n = 4000;
        let mut mean = [0.0f64; 4];
        for e in 0..n {
            let d = encode_int8(&x, key(e)).decode().unwrap();
            for (m, v) in mean.iter_mut().zip(d) {
                *m += v as f64 / n as f64;
            }
        }
        for (m, v) in mean.iter().zip(&x) {
            assert!((m - *v as f64).abs() < 2e-3, "mean {m} vs {v}");
        }
    }

    #[test]
    fn topk_keeps_the_largest_and_breaks_ties_by_index() {
        let g = vec![0.1, -5.0, 2.0, 2.0, -2.0, 0.0, 3.0];
        let p = encode_topk(&g, 0.5); // ceil(3.5) = 4
        assert_eq!(
            p,
            GradPayload::TopK {
                len: 7,
                indices: vec![1, 2, 3, 6],
                values: vec![-5.0, 2.0, 2.0, 3.0],
            }
        );
        assert_eq!(p.wire_bytes(), 32);
        assert_eq!(
            p.decode().unwrap(),
            vec![0.0, -5.0, 2.0, 2.0, 0.0, 0.0, 3.0]
        );
        // A fraction so small it rounds to nothing still sends one value.
        let p = encode_topk(&g, 1e-6);
        assert_eq!(p.decode().unwrap().iter().filter(|v| **v != 0.0).count(), 1);
    }

    /// With error feedback, what was sent over T steps plus the final residual is exactly
    /// (up to f32 rounding) the sum of the T exact gradients.
    #[test]
    fn error_feedback_sends_every_contribution_eventually() {
        for codec in [GradCodec::Int8, GradCodec::TopK { fraction: 0.05 }] {
            let mut ef = ErrorFeedback::default();
            let n = 700;
            let (mut exact, mut sent) = (vec![0.0f64; n], vec![0.0f64; n]);
            for t in 0..30 {
                let g = grads(n, 10 + t);
                let p = ef.compress(codec, &g, key(t)).unwrap();
                assert!(p.wire_bytes() < p.exact_bytes(), "{codec}");
                for (i, v) in p.decode().unwrap().into_iter().enumerate() {
                    sent[i] += v as f64;
                    exact[i] += g[i] as f64;
                }
            }
            for i in 0..n {
                let total = sent[i] + ef.residual()[i] as f64;
                assert!(
                    (total - exact[i]).abs() <= 1e-4 * exact[i].abs().max(1e-2),
                    "{codec} [{i}]: sent + residual {total} vs exact {}",
                    exact[i]
                );
            }
        }
    }

    #[test]
    fn compression_is_deterministic_and_keyed() {
        let g = grads(2000, 5);
        for codec in [GradCodec::Int8, GradCodec::TopK { fraction: 0.1 }] {
            let run = || {
                let mut ef = ErrorFeedback::default();
                let a = ef.compress(codec, &g, key(4)).unwrap();
                let b = ef.compress(codec, &g, key(5)).unwrap();
                (a, b, ef)
            };
            let (a1, b1, e1) = run();
            let (a2, b2, e2) = run();
            assert_eq!((&a1, &b1, &e1), (&a2, &b2, &e2));
            // A restored residual continues exactly as the original.
            let mut restored = ErrorFeedback::from_residual(e1.residual().to_vec());
            let mut orig = e1.clone();
            assert_eq!(
                restored.compress(codec, &g, key(6)),
                orig.compress(codec, &g, key(6))
            );
        }
        assert_eq!(
            ErrorFeedback::default().compress(GradCodec::None, &g, key(0)),
            None
        );
        let other = RoundingKey {
            partition: 2,
            ..key(4)
        };
        assert_ne!(encode_int8(&g, key(4)), encode_int8(&g, other));
    }

    #[test]
    fn malformed_payloads_are_errors() {
        let bad = [
            GradPayload::Int8 {
                len: 3,
                scales: vec![1.0],
                values: vec![1, 2],
            },
            GradPayload::Int8 {
                len: 1,
                scales: vec![f32::NAN],
                values: vec![1],
            },
            GradPayload::TopK {
                len: 3,
                indices: vec![2, 1],
                values: vec![1.0, 1.0],
            },
            GradPayload::TopK {
                len: 3,
                indices: vec![3],
                values: vec![1.0],
            },
            GradPayload::TopK {
                len: 3,
                indices: vec![0],
                values: vec![f32::INFINITY],
            },
        ];
        for p in bad {
            assert!(
                matches!(p.decode(), Err(GradCodecError::Malformed(_))),
                "{p:?}"
            );
        }
    }
}
