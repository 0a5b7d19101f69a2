//! Range checks of command-line values, made before anything is loaded or allocated: clap
//! value parsers for counts, rates and thread numbers (each refusal says what is accepted),
//! and the memory estimate that refuses a model too wide for the data set on this machine
//! instead of letting it abort on a failed allocation.
use std::fmt::Display;
use std::str::FromStr;
use thiserror::Error;
use trellis_runtime::{Dataset, ModelKind, TrainConfig};

/// Widest hidden layer accepted (per head); far above any published GNN setting.
pub const MAX_WIDTH: usize = 1 << 16;
/// Most attention heads accepted.
pub const MAX_HEADS: usize = 256;
/// Most partitions accepted.
pub const MAX_PARTITIONS: usize = 4096;
/// Absolute ceiling of `--threads`, whatever the machine.
pub const MAX_THREADS: usize = 1024;

/// A model that does not fit this machine's memory.
#[derive(Debug, Error)]
#[error(
    "the model needs at least {need_gib:.1} GiB ({what}) but {avail_gib:.1} GiB of memory is \
     available: use a smaller --hidden{heads}"
)]
pub struct TooLarge {
    pub what: String,
    pub need_gib: f64,
    pub avail_gib: f64,
    heads: &'static str,
}

fn parse<T: FromStr>(s: &str) -> Result<T, String>
where
    T::Err: Display,
{
    s.trim().parse::<T>().map_err(|e| format!("{e}"))
}

/// A count of at least 1.
pub fn positive_u32(s: &str) -> Result<u32, String> {
    match parse::<u32>(s)? {
        0 => Err("must be at least 1".into()),
        v => Ok(v),
    }
}

/// A count of at least 1.
pub fn positive_u64(s: &str) -> Result<u64, String> {
    match parse::<u64>(s)? {
        0 => Err("must be at least 1".into()),
        v => Ok(v),
    }
}

/// A layer width: 1 to [`MAX_WIDTH`].
pub fn width(s: &str) -> Result<usize, String> {
    in_range(parse::<usize>(s)?, 1, MAX_WIDTH)
}

/// A number of attention heads: 1 to [`MAX_HEADS`].
pub fn heads(s: &str) -> Result<usize, String> {
    in_range(parse::<usize>(s)?, 1, MAX_HEADS)
}

/// A number of partitions: 1 to [`MAX_PARTITIONS`].
pub fn partitions(s: &str) -> Result<usize, String> {
    in_range(parse::<usize>(s)?, 1, MAX_PARTITIONS)
}

fn in_range(v: usize, lo: usize, hi: usize) -> Result<usize, String> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be between {lo} and {hi}"))
    }
}

/// A learning rate: finite and above 0.
pub fn learning_rate(s: &str) -> Result<f32, String> {
    let v = parse::<f32>(s)?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err("must be a finite number above 0".into())
    }
}

/// A dropout probability: at least 0 and below 1.
pub fn dropout(s: &str) -> Result<f32, String> {
    let v = parse::<f32>(s)?;
    if v.is_finite() && (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err("must be at least 0 and below 1".into())
    }
}

/// A weight decay: finite and at least 0.
pub fn weight_decay(s: &str) -> Result<f32, String> {
    let v = parse::<f32>(s)?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err("must be a finite number of at least 0".into())
    }
}

/// The most `--threads` this machine accepts: 4 per CPU, at most [`MAX_THREADS`].
pub fn max_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (4 * cpus).min(MAX_THREADS)
}

/// A kernel thread count: 0 (all CPUs) up to [`max_threads`].
pub fn threads(s: &str) -> Result<usize, String> {
    let v = parse::<usize>(s)?;
    let max = max_threads();
    if v <= max {
        Ok(v)
    } else {
        Err(format!(
            "must be at most {max} (4 per CPU; 0 = one per CPU)"
        ))
    }
}

/// Bytes of memory the kernel says are available (Linux `MemAvailable`), if known.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// A lower bound of the memory `cfg` needs on `ds`: every hidden layer's activations and
/// their gradients for every node (the training step keeps each layer's), the attention
/// coefficients of every edge in every GAT layer, and the weights (residual projections
/// included) with Adam's two moments. The real peak is a few times higher.
pub fn memory_lower_bound(cfg: &TrainConfig, nodes: u64, edges: u64, features: u64) -> u64 {
    let m = &cfg.model;
    let heads = if m.kind == ModelKind::Gat {
        m.heads.max(1) as u64
    } else {
        1
    };
    let layers = m.layers.max(1);
    // The first layer's input width is the data's (`features`), whatever `m.in_dim` says.
    let in_width = |l: usize| {
        if l == 0 {
            features
        } else {
            m.output_width(l - 1) as u64
        }
    };
    let hidden_widths: u64 = (0..layers - 1)
        .map(|l| m.output_width(l) as u64)
        .fold(0, u64::saturating_add);
    let activations = nodes.saturating_mul(hidden_widths).saturating_mul(2);
    let attention = if m.kind == ModelKind::Gat {
        edges
            .saturating_mul(heads)
            .saturating_mul(2)
            .saturating_mul(layers as u64)
    } else {
        0
    };
    let weights = (0..layers)
        .map(|l| {
            let w = in_width(l).saturating_mul(m.output_width(l) as u64);
            match m.residual_of(l) {
                trellis_runtime::Residual::Projection => w.saturating_mul(2),
                _ => w,
            }
        })
        .fold(0, u64::saturating_add)
        .saturating_mul(3);
    activations
        .saturating_add(attention)
        .saturating_add(weights)
        .saturating_mul(4)
}

/// Refuses `cfg` on `ds` when even [`memory_lower_bound`] exceeds the available memory.
pub fn check_fits(cfg: &TrainConfig, ds: &Dataset) -> Result<(), TooLarge> {
    check_fits_in(cfg, ds, available_memory())
}

fn check_fits_in(cfg: &TrainConfig, ds: &Dataset, avail: Option<u64>) -> Result<(), TooLarge> {
    let Some(avail) = avail else { return Ok(()) };
    let need = memory_lower_bound(
        cfg,
        ds.num_nodes as u64,
        ds.edge_src.len() as u64,
        ds.num_features as u64,
    );
    if need <= avail {
        return Ok(());
    }
    let gat = cfg.model.kind == ModelKind::Gat;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    Err(TooLarge {
        what: format!(
            "{} layers, hidden {}{} on {} nodes, {} edges, {} features",
            cfg.model.layers,
            (0..cfg.model.layers.saturating_sub(1))
                .map(|l| cfg.model.hidden_of(l).to_string())
                .collect::<Vec<_>>()
                .join(","),
            if gat {
                format!(" x {} heads", cfg.model.heads)
            } else {
                String::new()
            },
            ds.num_nodes,
            ds.edge_src.len(),
            ds.num_features
        ),
        need_gib: gib(need),
        avail_gib: gib(avail),
        heads: if gat { " or --heads" } else { "" },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::DataSource;

    #[test]
    fn counts_and_rates_say_what_is_accepted() {
        assert_eq!(positive_u32("3"), Ok(3));
        assert_eq!(positive_u32("0").unwrap_err(), "must be at least 1");
        assert!(positive_u32("-1").is_err());
        assert_eq!(
            width("4294967295").unwrap_err(),
            "must be between 1 and 65536"
        );
        assert_eq!(heads("1000000").unwrap_err(), "must be between 1 and 256");
        assert_eq!(learning_rate("0.01"), Ok(0.01));
        for bad in ["nan", "inf", "0", "-0.1"] {
            assert!(learning_rate(bad).is_err(), "{bad}");
        }
        assert_eq!(dropout("0"), Ok(0.0));
        assert!(dropout("1").is_err());
        assert!(weight_decay("NaN").is_err());
        assert_eq!(weight_decay("5e-4"), Ok(5e-4));
        assert!(threads("100000").unwrap_err().contains("at most"));
        assert_eq!(threads("0"), Ok(0));
    }

    #[test]
    fn a_model_wider_than_memory_is_refused_with_the_numbers() {
        let ds = DataSource::parse("synthetic:nodes=2000,degree=4,features=16,classes=3")
            .unwrap()
            .load()
            .unwrap();
        let mut cfg = TrainConfig::paper_defaults(ModelKind::Gat, 16, 3, 0);
        assert!(check_fits_in(&cfg, &ds, Some(1 << 30)).is_ok());
        cfg.model.hidden = MAX_WIDTH;
        cfg.model.heads = MAX_HEADS;
        let err = check_fits_in(&cfg, &ds, Some(1 << 30)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("x 256 heads on 2000 nodes"), "{text}");
        assert!(text.contains("2 layers, hidden 65536"), "{text}");
        assert!(text.contains("--heads"), "{text}");
        assert!(err.need_gib > err.avail_gib);
        // Deeper models need more: each hidden layer's activations are kept.
        let mut deep = TrainConfig::paper_defaults(ModelKind::Gcn, 16, 3, 0);
        let shallow = memory_lower_bound(&deep, 2000, 8000, 16);
        deep.model.layers = 4;
        deep.model.hidden_sizes = vec![16, 16, 16];
        let four = memory_lower_bound(&deep, 2000, 8000, 16);
        assert!(
            four >= shallow + 2 * 2000 * 16 * 2 * 4,
            "{shallow} vs {four}"
        );
        // Unknown available memory: nothing to compare with, nothing refused.
        assert!(check_fits_in(&cfg, &ds, None).is_ok());
    }
}
