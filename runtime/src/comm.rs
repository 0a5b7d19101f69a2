//! How partitioned runs communicate: the halo codec settings (`--halo-codec`,
//! `--halo-error-bound`), the staleness of the rows a training step uses (`--staleness`),
//! the skipping of rows that barely changed (`--skip-threshold`) and the bound on both
//! (`--max-staleness`), part of [`crate::TrainConfig`] so they reach every node of a cluster
//! with the rest of the configuration. The codecs themselves are `trellis_transport::codec`.
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The encoding of halo rows (forward embeddings and backward gradients) between partitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HaloCodec {
    /// Exact fp32 rows (bit-identical to one process).
    #[default]
    Fp32,
    /// IEEE half precision, round to nearest.
    Fp16,
    /// bfloat16, round to nearest.
    Bf16,
    /// 8-bit codes, per-row minimum and step, stochastic rounding.
    Int8,
    /// 4-bit codes, as int8.
    Int4,
    /// 2, 4, 8 or 16 bits per row, the fewest that keep the rounding variance under
    /// [`HaloConfig::error_bound`] times the row's energy.
    Adaptive,
}

impl HaloCodec {
    /// Every codec, in the order `--help` lists them.
    pub const ALL: [HaloCodec; 6] = [
        HaloCodec::Fp32,
        HaloCodec::Fp16,
        HaloCodec::Bf16,
        HaloCodec::Int8,
        HaloCodec::Int4,
        HaloCodec::Adaptive,
    ];

    /// The codec's name, as `--halo-codec` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            HaloCodec::Fp32 => "fp32",
            HaloCodec::Fp16 => "fp16",
            HaloCodec::Bf16 => "bf16",
            HaloCodec::Int8 => "int8",
            HaloCodec::Int4 => "int4",
            HaloCodec::Adaptive => "adaptive",
        }
    }
}

impl fmt::Display for HaloCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HaloCodec {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self> {
        HaloCodec::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                RuntimeError::Config(format!(
                    "unknown halo codec {s:?} (one of fp32, fp16, bf16, int8, int4, adaptive)"
                ))
            })
    }
}

/// The halo exchange's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HaloConfig {
    pub codec: HaloCodec,
    /// `adaptive` only: the bound on each row's expected squared rounding error relative to
    /// its squared norm.
    #[serde(default = "default_error_bound")]
    pub error_bound: f32,
    /// How many epochs old the halo rows and halo gradients a training step uses are: 0 (exact:
    /// this epoch's), or 1 (PipeGCN: the ones exchanged in the previous epoch, so an epoch's
    /// exchange overlaps all of its compute; the first epoch, which has no previous one, runs
    /// exact). Evaluation always uses the current rows. Not written when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub staleness: u32,
    /// Training passes only: a halo row (embedding or gradient) whose change since it was
    /// last sent is at most this fraction of its last sent value, in L2 norm
    /// (`|x - x_sent| <= T |x_sent|`), is not resent; the receiver keeps its copy. 0: off.
    /// Not written when 0.
    #[serde(default, skip_serializing_if = "is_zero_f32")]
    pub skip_threshold: f32,
    /// The most epochs old a row may be where it is used: a skipped row is resent once it
    /// would be older. `None`: unbounded. Not written when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u32>,
    /// Evaluation passes: the same rule as [`HaloConfig::skip_threshold`] for the rows an
    /// evaluation sends (no dropout there, so its rows change smoothly and a much smaller
    /// threshold skips most of them), bounded by [`HaloConfig::max_staleness`] too. The
    /// accuracy is then computed with boundary rows that differ from this epoch's by at most
    /// this fraction. 0: off (evaluation exchanges every row). Not written when 0.
    #[serde(default, skip_serializing_if = "is_zero_f32")]
    pub eval_skip_threshold: f32,
}

fn is_zero_f32(v: &f32) -> bool {
    *v == 0.0
}

/// [`HaloConfig::eval_skip_threshold`] of `--comm efficient`.
pub const EFFICIENT_EVAL_SKIP_THRESHOLD: f32 = 0.1;

/// The largest [`HaloConfig::staleness`] implemented.
pub const MAX_STALENESS: u32 = 1;

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// The default of [`HaloConfig::error_bound`].
pub const DEFAULT_ERROR_BOUND: f32 = 0.01;

fn default_error_bound() -> f32 {
    DEFAULT_ERROR_BOUND
}

impl Default for HaloConfig {
    fn default() -> Self {
        HaloConfig {
            codec: HaloCodec::Fp32,
            error_bound: DEFAULT_ERROR_BOUND,
            staleness: 0,
            skip_threshold: 0.0,
            max_staleness: None,
            eval_skip_threshold: 0.0,
        }
    }
}

impl HaloConfig {
    /// `--comm efficient`, the setting `trellis bench comm` measured best on Cora
    /// (docs/clusters.md, "A network that costs something"): int4 rows, the previous epoch's
    /// rows (staleness 1), rows that changed by at most twice their norm skipped, evaluation
    /// rows that changed by at most a tenth of theirs skipped, none older than 8 epochs.
    pub fn efficient() -> Self {
        HaloConfig {
            codec: HaloCodec::Int4,
            staleness: 1,
            skip_threshold: 2.0,
            max_staleness: Some(8),
            eval_skip_threshold: EFFICIENT_EVAL_SKIP_THRESHOLD,
            ..HaloConfig::default()
        }
    }

    /// True for the exact exchange (this epoch's fp32 rows): what runs before codecs and
    /// staleness existed did.
    pub fn is_exact(&self) -> bool {
        self.codec == HaloCodec::Fp32
            && self.staleness == 0
            && self.skip_threshold == 0.0
            && self.eval_skip_threshold == 0.0
    }

    /// Whether evaluation passes skip rows ([`HaloConfig::eval_skip_threshold`]): partitions
    /// then keep an evaluation's blocks until the next optimizer step holds them.
    pub fn skips_eval_rows(&self) -> bool {
        self.eval_skip_threshold > 0.0
    }

    /// Whether partitions keep the halo blocks of an epoch for the next one: the stale rows
    /// (staleness 1) or the receiver's copy of rows not resent (skipping).
    pub fn holds_rows(&self) -> bool {
        self.staleness > 0 || self.skip_threshold > 0.0
    }

    /// Checks the values (the error bound must be finite and above 0, the staleness at most
    /// [`MAX_STALENESS`], the skip threshold finite and at least 0, the maximum staleness at
    /// least the staleness).
    pub fn validate(&self) -> Result<()> {
        if !(self.skip_threshold.is_finite() && self.skip_threshold >= 0.0) {
            return Err(RuntimeError::Config(format!(
                "halo skip threshold {} must be finite and at least 0",
                self.skip_threshold
            )));
        }
        if !(self.eval_skip_threshold.is_finite() && self.eval_skip_threshold >= 0.0) {
            return Err(RuntimeError::Config(format!(
                "evaluation halo skip threshold {} must be finite and at least 0",
                self.eval_skip_threshold
            )));
        }
        if let Some(k) = self.max_staleness.filter(|&k| k < self.staleness) {
            return Err(RuntimeError::Config(format!(
                "max staleness {k} is below the staleness {}: every row used is {} epoch(s) old",
                self.staleness, self.staleness
            )));
        }
        if self.staleness > MAX_STALENESS {
            return Err(RuntimeError::Config(format!(
                "halo staleness {} is not supported (0: exact, or 1: the previous epoch's rows)",
                self.staleness
            )));
        }
        if !(self.error_bound.is_finite() && self.error_bound > 0.0) {
            return Err(RuntimeError::Config(format!(
                "halo error bound {} must be finite and above 0",
                self.error_bound
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_ones_are_refused() {
        for c in HaloCodec::ALL {
            assert_eq!(c.name().parse::<HaloCodec>().unwrap(), c);
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
        let e = "int3".parse::<HaloCodec>().unwrap_err().to_string();
        assert!(e.contains("int3") && e.contains("adaptive"), "{e}");
    }

    #[test]
    fn error_bounds_are_checked() {
        let mut h = HaloConfig::default();
        assert!(h.validate().is_ok() && h.is_exact());
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            h.error_bound = bad;
            assert!(h.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn staleness_is_checked_and_written_only_when_set() {
        let mut h = HaloConfig::default();
        assert_eq!(serde_json::to_value(h).unwrap().get("staleness"), None);
        h.staleness = 1;
        assert!(h.validate().is_ok() && !h.is_exact());
        let back: HaloConfig = serde_json::from_value(serde_json::to_value(h).unwrap()).unwrap();
        assert_eq!(back, h);
        h.staleness = 2;
        let e = h.validate().unwrap_err().to_string();
        assert!(e.contains("staleness 2"), "{e}");
    }

    #[test]
    fn skip_thresholds_and_max_staleness_are_checked() {
        let mut h = HaloConfig {
            skip_threshold: 0.1,
            ..HaloConfig::default()
        };
        assert!(h.validate().is_ok() && !h.is_exact() && h.holds_rows());
        for bad in [-0.1, f32::NAN, f32::INFINITY] {
            h.skip_threshold = bad;
            assert!(h.validate().is_err(), "{bad}");
        }
        h.skip_threshold = 0.0;
        h.staleness = 1;
        h.max_staleness = Some(0);
        let e = h.validate().unwrap_err().to_string();
        assert!(e.contains("max staleness 0"), "{e}");
        h.max_staleness = Some(1);
        assert!(h.validate().is_ok());
        let json = serde_json::to_value(HaloConfig::default()).unwrap();
        assert!(json.get("skip_threshold").is_none() && json.get("max_staleness").is_none());
        assert!(json.get("eval_skip_threshold").is_none());
    }

    #[test]
    fn evaluation_skip_thresholds_are_checked_and_written_only_when_set() {
        let mut h = HaloConfig {
            eval_skip_threshold: 0.1,
            ..HaloConfig::default()
        };
        assert!(h.validate().is_ok() && !h.is_exact() && h.skips_eval_rows() && !h.holds_rows());
        let back: HaloConfig = serde_json::from_value(serde_json::to_value(h).unwrap()).unwrap();
        assert_eq!(back, h);
        for bad in [-0.1, f32::NAN, f32::INFINITY] {
            h.eval_skip_threshold = bad;
            let e = h.validate().unwrap_err().to_string();
            assert!(e.contains("evaluation halo skip threshold"), "{e}");
        }
        assert!(HaloConfig::efficient().skips_eval_rows());
    }
}
