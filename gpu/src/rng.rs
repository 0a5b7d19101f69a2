//! Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//!
//! Every random draw in Trellis (init, dropout, attention dropout, sampling) is a pure function
//! of a key and a counter, so a mask never depends on which thread, partition or node computes
//! it. Written by hand because no maintained crate exposes Philox as a stateless
//! `(key, counter) -> block` function; the known-answer vectors of Random123 test it.

/// The Philox4x32-10 block function.
#[derive(Debug, Clone, Copy)]
pub struct Philox4x32 {
    key: [u32; 2],
}

// The Philox constants and round count. These are the only copy: the CUDA kernels get them as
// `#define`s generated from these (`crate::kernel_source`), so CPU and GPU masks cannot drift.
/// Multiplier of counter word 0.
pub const PHILOX_M0: u32 = 0xD251_1F53;
/// Multiplier of counter word 2.
pub const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Weyl increment of key word 0 (golden ratio).
pub const PHILOX_W0: u32 = 0x9E37_79B9;
/// Weyl increment of key word 1 (sqrt(3) - 1).
pub const PHILOX_W1: u32 = 0xBB67_AE85;
/// Number of rounds (Philox4x32-10).
pub const PHILOX_ROUNDS: usize = 10;
use PHILOX_M0 as M0;
use PHILOX_M1 as M1;
use PHILOX_W0 as W0;
use PHILOX_W1 as W1;

impl Philox4x32 {
    /// A generator keyed by a 64-bit seed.
    pub fn new(seed: u64) -> Self {
        Philox4x32 {
            key: [seed as u32, (seed >> 32) as u32],
        }
    }

    /// Four random u32 for a 128-bit counter.
    #[inline]
    pub fn block(&self, ctr: [u32; 4]) -> [u32; 4] {
        let mut c = ctr;
        let mut k = self.key;
        for round in 0..PHILOX_ROUNDS {
            if round > 0 {
                k[0] = k[0].wrapping_add(W0);
                k[1] = k[1].wrapping_add(W1);
            }
            let p0 = (M0 as u64) * (c[0] as u64);
            let p1 = (M1 as u64) * (c[2] as u64);
            c = [
                ((p1 >> 32) as u32) ^ c[1] ^ k[0],
                p1 as u32,
                ((p0 >> 32) as u32) ^ c[3] ^ k[1],
                p0 as u32,
            ];
        }
        c
    }

    /// Eight blocks at once, structure-of-arrays: lane `i` of the result is
    /// `block([c[0][i], c[1][i], c[2][i], c[3][i]])`. Written lane-wise so the compiler
    /// vectorises it (32x32->64-bit multiplies); callers compile it for AVX2 where available.
    #[inline(always)]
    pub fn block8(&self, ctr: [[u32; 8]; 4]) -> [[u32; 8]; 4] {
        let mut c = ctr;
        let mut k = self.key;
        for round in 0..PHILOX_ROUNDS {
            if round > 0 {
                k[0] = k[0].wrapping_add(W0);
                k[1] = k[1].wrapping_add(W1);
            }
            let mut n = [[0u32; 8]; 4];
            for i in 0..8 {
                let p0 = (M0 as u64) * (c[0][i] as u64);
                let p1 = (M1 as u64) * (c[2][i] as u64);
                n[0][i] = ((p1 >> 32) as u32) ^ c[1][i] ^ k[0];
                n[1][i] = p1 as u32;
                n[2][i] = ((p0 >> 32) as u32) ^ c[3][i] ^ k[1];
                n[3][i] = p0 as u32;
            }
            c = n;
        }
        c
    }

    /// A uniform f32 in [0, 1) from one u32.
    #[inline]
    pub fn to_unit(u: u32) -> f32 {
        (u >> 8) as f32 * (1.0 / 16_777_216.0)
    }
}

/// What a dropout mask is keyed by: (seed, epoch, layer, site). The row's global node id and
/// the column complete the counter, so masks are independent of partitioning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub epoch: u32,
    pub layer: u16,
    /// Which dropout within the layer (feature dropout, attention dropout, ...).
    pub site: u16,
}

impl DropoutKey {
    /// The counter for row `gid`, column block `block` (8 columns per block).
    #[inline]
    pub fn counter(&self, gid: u32, block: u32) -> [u32; 4] {
        [
            self.epoch,
            ((self.layer as u32) << 16) | self.site as u32,
            gid,
            block,
        ]
    }
}

/// The keep threshold of dropout with probability `p`: an element is kept when its 16-bit draw
/// is `>=` this (so `p = 0` keeps all, `p = 1` drops all). Shared by the CPU and CUDA kernels.
pub fn dropout_threshold(p: f32) -> u32 {
    (p.clamp(0.0, 1.0) as f64 * 65_536.0).round().min(65_536.0) as u32
}

/// The scale of kept elements under inverted dropout with probability `p` (0 when `p >= 1`).
pub fn dropout_scale(p: f32) -> f32 {
    if p < 1.0 {
        1.0 / (1.0 - p)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known-answer vectors from Random123's kat_vectors (philox4x32, 10 rounds).
    #[test]
    fn philox_known_answers() {
        let g = Philox4x32 { key: [0, 0] };
        assert_eq!(
            g.block([0, 0, 0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        let g = Philox4x32 {
            key: [0xffffffff, 0xffffffff],
        };
        assert_eq!(
            g.block([0xffffffff; 4]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        let g = Philox4x32 {
            key: [0xa4093822, 0x299f31d0],
        };
        assert_eq!(
            g.block([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn eight_lanes_equal_eight_blocks() {
        let g = Philox4x32::new(0x1234_5678_9abc_def0);
        let ctr = [
            [3; 8],
            [0x0001_0002; 8],
            std::array::from_fn(|i| 77 + i as u32 * 1000),
            std::array::from_fn(|i| i as u32 * 7),
        ];
        let out = g.block8(ctr);
        for i in 0..8 {
            let one = g.block([ctr[0][i], ctr[1][i], ctr[2][i], ctr[3][i]]);
            assert_eq!(one, [out[0][i], out[1][i], out[2][i], out[3][i]]);
        }
    }

    #[test]
    fn unit_interval_and_spread() {
        let g = Philox4x32::new(7);
        let mut sum = 0.0f64;
        let n = 100_000u32;
        for i in 0..n / 4 {
            for u in g.block([i, 0, 0, 0]) {
                let x = Philox4x32::to_unit(u);
                assert!((0.0..1.0).contains(&x));
                sum += x as f64;
            }
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }
}
