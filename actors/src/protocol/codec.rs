//! A partition's halo codec: turns the rows of an outgoing block into its payload (exact fp32,
//! or encoded by the configured `trellis_transport::codec`), with the stochastic rounding's
//! random bits drawn from Philox keyed by the run's seed, the epoch, the layer tag and the
//! phase, with the row's *global* node id and the column in the counter. Every row therefore
//! gets the same noise whichever partition sends it, in whatever order, on whichever thread:
//! runs are deterministic, and a replayed step sends exactly the blocks of the failed attempt.
use crate::protocol::halo::Tag;
use std::sync::Arc;
use trellis_gpu::Philox4x32;
use trellis_runtime::comm::{HaloCodec, HaloConfig};
use trellis_runtime::{Result, RuntimeError};
use trellis_transport::codec::{self, Codec, Dither};
use trellis_transport::{HaloPayload, PartId, Phase};

/// Counter word 1 of halo rounding draws is `layer tag << 16 | HALO_SITE + phase`: sites
/// `0x100..` are disjoint from the dropout sites (feature dropout 0, attention dropout), so
/// rounding and dropout never share draws.
const HALO_SITE: u32 = 0x100;

/// The codec a partition applies to every block it sends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HaloEncoder {
    codec: Option<Codec>,
    rng: Philox4x32,
}

impl HaloEncoder {
    /// The encoder of `cfg` for a run seeded with `seed` (`None` codec: exact fp32).
    pub fn new(cfg: &HaloConfig, seed: u64) -> Self {
        let codec = match cfg.codec {
            HaloCodec::Fp32 => None,
            HaloCodec::Fp16 => Some(Codec::Fp16),
            HaloCodec::Bf16 => Some(Codec::Bf16),
            HaloCodec::Int8 => Some(Codec::Int8),
            HaloCodec::Int4 => Some(Codec::Int4),
            HaloCodec::Adaptive => Some(Codec::Adaptive {
                error_bound: cfg.error_bound,
            }),
        };
        HaloEncoder {
            codec,
            rng: Philox4x32::new(seed),
        }
    }

    /// The payload of the `gids.len() x cols` rows `data` (row `k` is global node `gids[k]`)
    /// sent by `from` under `tag`.
    pub fn payload(
        &self,
        from: PartId,
        tag: Tag,
        gids: &[u32],
        cols: usize,
        data: Arc<[f32]>,
    ) -> Result<HaloPayload> {
        let Some(codec) = self.codec else {
            return Ok(HaloPayload::F32(data));
        };
        let phase = match tag.phase {
            Phase::Forward => 0,
            Phase::Backward => 1,
            Phase::Eval => 2,
        };
        let dither = PhiloxDither {
            rng: self.rng,
            epoch: tag.epoch,
            word: (tag.layer as u32) << 16 | (HALO_SITE + phase),
            gids,
        };
        let bytes = codec::encode(codec, gids.len(), cols, &data, &dither).map_err(|e| {
            RuntimeError::Config(format!(
                "partition {from}: cannot encode a {:?} halo block of layer {}: {e}",
                tag.phase, tag.layer
            ))
        })?;
        Ok(HaloPayload::Encoded(Arc::from(bytes)))
    }
}

/// Rounding bits of one block: Philox block `[epoch, layer tag << 16 | site, gid, c / 4]`,
/// word `c % 4`, for column `c` of the row of global node `gid`.
struct PhiloxDither<'a> {
    rng: Philox4x32,
    epoch: u32,
    word: u32,
    gids: &'a [u32],
}

impl Dither for PhiloxDither<'_> {
    fn fill(&self, row: usize, out: &mut [u32]) {
        let gid = self.gids[row];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { self.fill_avx2(gid, out) };
        }
        self.fill_generic(gid, out)
    }
}

impl PhiloxDither<'_> {
    /// [`Self::fill_generic`] compiled with AVX2, which vectorises the 8-lane Philox.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn fill_avx2(&self, gid: u32, out: &mut [u32]) {
        self.fill_generic(gid, out)
    }

    /// Groups of 32 columns draw 8 Philox blocks at once, the tail block by block: both give
    /// `block([epoch, word, gid, c / 4])[c % 4]` for column `c`.
    #[inline(always)]
    fn fill_generic(&self, gid: u32, out: &mut [u32]) {
        let done = out.len() / 32 * 8;
        let mut groups = out.chunks_exact_mut(32);
        for (g, cols) in groups.by_ref().enumerate() {
            let ctr = [
                [self.epoch; 8],
                [self.word; 8],
                [gid; 8],
                std::array::from_fn(|i| (8 * g + i) as u32),
            ];
            let u = self.rng.block8(ctr);
            for (k, o) in cols.iter_mut().enumerate() {
                *o = u[k % 4][k / 4];
            }
        }
        for (b, chunk) in groups.into_remainder().chunks_mut(4).enumerate() {
            let draw = self
                .rng
                .block([self.epoch, self.word, gid, (done + b) as u32]);
            chunk.copy_from_slice(&draw[..chunk.len()]);
        }
    }
}

/// What a payload held between epochs becomes once a sparse payload is merged into it
/// ([`codec::merge_sparse`]): `held` itself, the same buffer, when no row was resent (so a
/// replica finds it unchanged by identity and no copy is made), else the merged bytes.
pub(crate) fn merged_payload(held: &Arc<[u8]>, merged: std::borrow::Cow<'_, [u8]>) -> Arc<[u8]> {
    match merged {
        std::borrow::Cow::Borrowed(_) => held.clone(),
        std::borrow::Cow::Owned(m) => Arc::from(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_transport::RunId;

    fn tag(epoch: u32, layer: u16, phase: Phase) -> Tag {
        Tag {
            run: RunId::nil(),
            epoch,
            layer,
            phase,
        }
    }

    fn encoded(p: HaloPayload) -> Arc<[u8]> {
        match p {
            HaloPayload::Encoded(b) => b,
            HaloPayload::F32(_) => panic!("not encoded"),
        }
    }

    #[test]
    fn the_same_global_row_gets_the_same_code_from_any_sender_and_position() {
        let cfg = HaloConfig {
            codec: HaloCodec::Int4,
            ..HaloConfig::default()
        };
        let enc = HaloEncoder::new(&cfg, 42);
        let rows: Vec<f32> = (0..30).map(|i| (i as f32 * 0.7).cos()).collect();
        let t = tag(3, 1, Phase::Forward);
        // Rows of global nodes 5, 9, 11 sent by partition 0, and the rows of 11 and 5 sent by
        // partition 2 in another order: row 11 and row 5 encode to the same bytes.
        let a = encoded(
            enc.payload(PartId(0), t, &[5, 9, 11], 10, Arc::from(&rows[..]))
                .unwrap(),
        );
        let mut swapped = rows[20..30].to_vec();
        swapped.extend_from_slice(&rows[0..10]);
        let b = encoded(
            enc.payload(PartId(2), t, &[11, 5], 10, Arc::from(swapped))
                .unwrap(),
        );
        let row = |p: &[u8], n: usize, k: usize| {
            let header = p[2 + 4 * k..2 + 4 * k + 4].to_vec();
            let codes = p[2 + 4 * n + 5 * k..2 + 4 * n + 5 * (k + 1)].to_vec();
            (header, codes)
        };
        assert_eq!(row(&a, 3, 2), row(&b, 2, 0));
        assert_eq!(row(&a, 3, 0), row(&b, 2, 1));
        // Another epoch, layer or phase draws other bits.
        for other in [
            tag(4, 1, Phase::Forward),
            tag(3, 2, Phase::Forward),
            tag(3, 1, Phase::Eval),
        ] {
            let c = encoded(
                enc.payload(PartId(0), other, &[5, 9, 11], 10, Arc::from(&rows[..]))
                    .unwrap(),
            );
            assert_ne!(a, c);
        }
    }

    #[test]
    fn grouped_draws_equal_block_by_block_draws() {
        let d = PhiloxDither {
            rng: Philox4x32::new(9),
            epoch: 4,
            word: 1 << 16 | HALO_SITE,
            gids: &[77],
        };
        for cols in [1, 5, 32, 45, 100] {
            let mut got = vec![0u32; cols];
            d.fill(0, &mut got);
            let want: Vec<u32> = (0..cols)
                .map(|c| d.rng.block([4, d.word, 77, (c / 4) as u32])[c % 4])
                .collect();
            assert_eq!(got, want, "{cols} columns");
        }
    }

    #[test]
    fn fp32_is_the_shared_buffer_itself() {
        let enc = HaloEncoder::new(&HaloConfig::default(), 1);
        let data: Arc<[f32]> = Arc::from(vec![1.0, 2.0]);
        let HaloPayload::F32(got) = enc
            .payload(PartId(0), tag(1, 0, Phase::Forward), &[0], 2, data.clone())
            .unwrap()
        else {
            panic!("fp32 was encoded")
        };
        assert!(Arc::ptr_eq(&got, &data));
    }

    #[test]
    fn rows_that_are_not_finite_are_an_error_naming_the_partition() {
        let cfg = HaloConfig {
            codec: HaloCodec::Int8,
            ..HaloConfig::default()
        };
        let e = HaloEncoder::new(&cfg, 1)
            .payload(
                PartId(3),
                tag(1, 0, Phase::Backward),
                &[0],
                2,
                Arc::from(vec![1.0, f32::NAN]),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("partition 3") && e.contains("not finite"), "{e}");
    }
}
