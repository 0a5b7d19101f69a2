//! The model-shape flags shared by `train`, `launch`, `node`, `accuracy` and the benches:
//! `--layers N`, `--residual` and `--hidden W` or `--hidden W1,W2,...` (one width per hidden
//! layer), and how they set a [`ModelConfig`] (with errors that name the flags).
use anyhow::{bail, Result};
use clap::Args;
use trellis_runtime::{ModelConfig, MAX_LAYERS};

/// Hidden widths as `--hidden` gives them: one for every hidden layer, or one per hidden layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HiddenWidths {
    pub widths: Vec<usize>,
}

impl std::fmt::Display for HiddenWidths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text: Vec<String> = self.widths.iter().map(|w| w.to_string()).collect();
        f.write_str(&text.join(","))
    }
}

impl HiddenWidths {
    /// The first (or only) width: what the single-width benches and kernels use.
    pub fn first(&self) -> usize {
        self.widths[0]
    }
}

/// Parses `--hidden`: comma-separated widths, each 1 to [`super::validate::MAX_WIDTH`].
pub fn hidden_widths(s: &str) -> Result<HiddenWidths, String> {
    let widths = s
        .split(',')
        .map(|w| super::validate::width(w).map_err(|e| format!("`{}`: {e}", w.trim())))
        .collect::<Result<Vec<_>, _>>()?;
    if widths.len() > MAX_LAYERS {
        return Err(format!("at most {MAX_LAYERS} widths"));
    }
    Ok(HiddenWidths { widths })
}

/// Parses `--layers`: 1 to [`MAX_LAYERS`].
pub fn layers(s: &str) -> Result<usize, String> {
    let v = s.trim().parse::<usize>().map_err(|e| e.to_string())?;
    if (1..=MAX_LAYERS).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be between 1 and {MAX_LAYERS}"))
    }
}

/// `--layers` and `--residual`.
#[derive(Debug, Clone, Default, Args)]
pub struct ShapeArgs {
    /// Number of GNN layers, 1 to 128 (the last one outputs the classes) [default: 2].
    #[arg(long, value_name = "N", value_parser = layers)]
    pub layers: Option<usize>,
    /// Residual connections (DeepGCNs): every hidden layer after the first adds its input to
    /// its output, h_{l+1} = act(layer(h_l)) + h_l. Where a layer's input and output widths
    /// differ (e.g. --hidden 64,32), the input goes through a learned projection matrix
    /// (`convN.res.weight` in model files) instead. Needs --layers 3 or more.
    #[arg(long)]
    pub residual: bool,
}

impl ShapeArgs {
    /// Sets `cfg`'s depth, residual connections and (if given) hidden widths, refusing a
    /// width list that does not fit the depth.
    pub fn apply(&self, cfg: &mut ModelConfig, hidden: Option<&HiddenWidths>) -> Result<()> {
        if let Some(n) = self.layers {
            cfg.layers = n;
        }
        let hidden_layers = cfg.layers - 1;
        if let Some(h) = hidden {
            match h.widths.as_slice() {
                [w] => {
                    cfg.hidden = *w;
                    cfg.hidden_sizes.clear();
                }
                ws if ws.len() == hidden_layers => {
                    cfg.hidden = ws[0];
                    cfg.hidden_sizes = ws.to_vec();
                }
                ws => bail!(
                    "--hidden {h} lists {} widths but a {}-layer model has {hidden_layers} hidden \
                     layer{}: give one width for all of them or one per hidden layer",
                    ws.len(),
                    cfg.layers,
                    if hidden_layers == 1 { "" } else { "s" }
                ),
            }
        }
        if self.residual && cfg.layers < 3 {
            bail!(
                "--residual joins hidden layers after the first: it needs --layers 3 or more \
                 (the model has {})",
                cfg.layers
            );
        }
        cfg.residual = self.residual;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::ModelKind;

    fn cfg() -> ModelConfig {
        ModelConfig::paper_defaults(ModelKind::Gcn, 10, 3, 0)
    }

    #[test]
    fn widths_and_depth_parse_and_fit_or_say_why() {
        assert_eq!(hidden_widths("256").unwrap().widths, vec![256]);
        assert_eq!(hidden_widths("256, 128").unwrap().widths, vec![256, 128]);
        assert!(hidden_widths("256,0").unwrap_err().contains("`0`"));
        assert!(hidden_widths("a").is_err());
        assert!(layers("0").is_err());
        assert!(layers("129").unwrap_err().contains("between 1 and 128"));
        assert_eq!(layers("4"), Ok(4));

        let shape = ShapeArgs {
            layers: Some(4),
            residual: true,
        };
        let mut c = cfg();
        shape
            .apply(&mut c, Some(&hidden_widths("32,32,16").unwrap()))
            .unwrap();
        assert_eq!((c.layers, c.hidden, c.residual), (4, 32, true));
        assert_eq!(c.hidden_sizes, vec![32, 32, 16]);
        let mut c = cfg();
        let err = shape
            .apply(&mut c, Some(&hidden_widths("32,16").unwrap()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lists 2 widths but a 4-layer model has 3"),
            "{err}"
        );
        let mut c = cfg();
        shape
            .apply(&mut c, Some(&hidden_widths("64").unwrap()))
            .unwrap();
        assert!(c.hidden_sizes.is_empty() && c.hidden == 64);
        let shallow = ShapeArgs {
            layers: Some(2),
            residual: true,
        };
        let err = shallow.apply(&mut cfg(), None).unwrap_err().to_string();
        assert!(err.contains("--layers 3 or more"), "{err}");
    }
}
