//! The halo exchange options shared by `train`, `launch` and `node` (`--halo-codec`,
//! `--halo-error-bound`, `--staleness`, `--skip-threshold`, `--eval-skip-threshold`,
//! `--max-staleness`) and the summary line of what the exchange sent.
use anyhow::{bail, Result};
use clap::Args;
use trellis_runtime::comm::{HaloCodec, HaloConfig, DEFAULT_ERROR_BOUND, MAX_STALENESS};
use trellis_runtime::RunReport;

/// How partitions encode the halo rows they exchange.
#[derive(Debug, Clone, Args)]
pub struct HaloArgs {
    /// Encoding of halo rows (forward embeddings and backward gradients) between partitions:
    /// fp32 (exact), fp16 or bf16 (round to nearest), int8 or int4 (per-row minimum and step,
    /// stochastic rounding), adaptive (2, 4, 8 or 16 bits per row, under --halo-error-bound).
    #[arg(long, value_name = "CODEC", default_value = "fp32", value_parser = parse_codec)]
    pub halo_codec: HaloCodec,
    /// adaptive: the bound on each row's expected squared rounding error relative to its
    /// squared norm (finite, above 0).
    #[arg(long, value_name = "E", default_value_t = DEFAULT_ERROR_BOUND, value_parser = parse_bound)]
    pub halo_error_bound: f32,
    /// Epochs old the halo rows and gradients of a training step are: 0 (exact) or 1 (the
    /// previous epoch's, PipeGCN: each epoch's exchange overlaps all of its compute; the first
    /// epoch runs exact). Evaluation uses the current rows.
    #[arg(long, value_name = "EPOCHS", default_value_t = 0, value_parser = parse_staleness)]
    pub staleness: u32,
    /// Training passes: do not resend a halo row (embedding or gradient) whose change since it
    /// was last sent is at most T times its last sent value in L2 norm; the receiver keeps
    /// its copy (blocks then carry only the changed rows). 0: off [finite, at least 0].
    #[arg(long, value_name = "T", default_value_t = 0.0, value_parser = parse_threshold)]
    pub skip_threshold: f32,
    /// Evaluation passes: the same for the rows an evaluation sends (no dropout there, so a
    /// small T such as 0.1 skips most rows); the accuracies are then computed with boundary
    /// rows within T of this epoch's. Bounded by --max-staleness too. 0: off (every row goes)
    /// [finite, at least 0].
    #[arg(long, value_name = "T", default_value_t = 0.0, value_parser = parse_threshold)]
    pub eval_skip_threshold: f32,
    /// The most epochs old a halo row may be where it is used: a row not resent for that long
    /// is resent (at least --staleness) [default: unbounded].
    #[arg(long, value_name = "EPOCHS")]
    pub max_staleness: Option<u32>,
}

impl HaloArgs {
    /// The configuration these options give.
    pub fn config(&self) -> HaloConfig {
        HaloConfig {
            codec: self.halo_codec,
            error_bound: self.halo_error_bound,
            staleness: self.staleness,
            skip_threshold: self.skip_threshold,
            max_staleness: self.max_staleness,
            eval_skip_threshold: self.eval_skip_threshold,
        }
    }

    /// Refuses a codec or staleness for a run that exchanges no halo rows (one process).
    pub fn check_partitioned(&self, partitioned: bool) -> Result<()> {
        self.config().validate()?;
        if !partitioned && self.skip_threshold != 0.0 {
            bail!(
                "--skip-threshold {} skips rows partitions exchange: it needs --partitions 2 \
                 or more (a single process exchanges none)",
                self.skip_threshold
            );
        }
        if !partitioned && self.eval_skip_threshold != 0.0 {
            bail!(
                "--eval-skip-threshold {} skips rows partitions exchange: it needs \
                 --partitions 2 or more (a single process exchanges none)",
                self.eval_skip_threshold
            );
        }
        if !partitioned && self.staleness != 0 {
            bail!(
                "--staleness {} delays the rows partitions exchange: it needs --partitions 2 \
                 or more (a single process exchanges none)",
                self.staleness
            );
        }
        if !partitioned && self.halo_codec != HaloCodec::Fp32 {
            bail!(
                "--halo-codec {} encodes the rows partitions exchange: it needs --partitions 2 \
                 or more (a single process exchanges none)",
                self.halo_codec
            );
        }
        Ok(())
    }
}

fn parse_codec(s: &str) -> Result<HaloCodec, String> {
    s.parse()
        .map_err(|e: trellis_runtime::RuntimeError| e.to_string())
}

fn parse_threshold(s: &str) -> Result<f32, String> {
    let v: f32 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("{v} must be finite and at least 0"));
    }
    Ok(v)
}

fn parse_staleness(s: &str) -> Result<u32, String> {
    let v: u32 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of epochs: {e}"))?;
    if v > MAX_STALENESS {
        return Err(format!(
            "{v} epochs is not supported: 0 (exact) or {MAX_STALENESS} (the previous epoch's rows)"
        ));
    }
    Ok(v)
}

fn parse_bound(s: &str) -> Result<f32, String> {
    let v: f32 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    HaloConfig {
        codec: HaloCodec::Adaptive,
        error_bound: v,
        ..HaloConfig::default()
    }
    .validate()
    .map_err(|e| e.to_string())?;
    Ok(v)
}

/// The codec a report's configuration names (fp32 when absent) and its error bound.
fn report_codec(r: &RunReport) -> HaloConfig {
    r.config
        .get("halo")
        .and_then(|h| serde_json::from_value(h.clone()).ok())
        .unwrap_or_default()
}

/// One line on the halo bytes a partitioned run sent against what fp32 rows would take, or
/// `None` when nothing was exchanged.
pub fn summary(r: &RunReport) -> Option<String> {
    let sent: u64 = r.epochs_log.iter().map(|l| l.halo_bytes).sum();
    let fp32: u64 = r.epochs_log.iter().map(|l| l.halo_fp32_bytes).sum();
    if fp32 == 0 {
        return None;
    }
    let h = report_codec(r);
    let codec = match h.codec {
        HaloCodec::Adaptive => format!("adaptive, error bound {}", h.error_bound),
        c => c.to_string(),
    };
    let epochs = r.epochs_log.len().max(1) as u64;
    let mut stale = match h.staleness {
        0 => String::new(),
        1 => ", rows of the previous epoch".to_string(),
        n => format!(", rows {n} epochs old"),
    };
    if h.skip_threshold > 0.0 {
        stale += &format!(", rows changed by at most {} skipped", h.skip_threshold);
    }
    if h.eval_skip_threshold > 0.0 {
        stale += &format!(
            ", evaluation rows changed by at most {} skipped",
            h.eval_skip_threshold
        );
    }
    if let Some(k) = h.max_staleness {
        stale += &format!(", at most {k} epochs old");
    }
    if h.codec == HaloCodec::Fp32 && h.skip_threshold == 0.0 {
        let exact = if h.staleness == 0 { ", exact" } else { "" };
        return Some(format!(
            "halo exchange (fp32{exact}{stale}): {} per epoch",
            size(sent / epochs)
        ));
    }
    let eval_sent: u64 = r.epochs_log.iter().map(|l| l.eval_halo_bytes).sum();
    let eval_fp32: u64 = r.epochs_log.iter().map(|l| l.eval_halo_fp32_bytes).sum();
    let evaluation = if eval_fp32 > 0 {
        format!(
            "; evaluations {} per epoch sent, {} as fp32; both {:.2}x fewer",
            size(eval_sent / epochs),
            size(eval_fp32 / epochs),
            (fp32 + eval_fp32) as f64 / (sent + eval_sent).max(1) as f64
        )
    } else {
        String::new()
    };
    Some(format!(
        "halo exchange ({codec}{stale}): training steps {} per epoch sent, {} as fp32 ({:.2}x fewer bytes){evaluation}",
        size(sent / epochs),
        size(fp32 / epochs),
        fp32 as f64 / sent.max(1) as f64
    ))
}

/// `bytes` in KiB below a MiB, else in MiB.
fn size(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
    }
}
