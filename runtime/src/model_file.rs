//! Model files: a trained model's parameters as safetensors, named and laid out as PyTorch
//! Geometric's modules for the same model, with the metadata that says how it was made.
//!
//! Layer `l` of a Trellis model is PyG's `conv{l+1}`:
//!
//! | model | tensors of `convN` (PyG layout) |
//! |---|---|
//! | GCN (`GCNConv`) | `lin.weight` `[out, in]`, `bias` `[out]` |
//! | GraphSAGE (`SAGEConv`, mean) | `lin_l.weight` `[out, in]`, `lin_l.bias` `[out]`, `lin_r.weight` `[out, in]` |
//! | GAT (`GATConv`) | `lin.weight` `[heads*out, in]`, `att_src` and `att_dst` `[1, heads, out]`, `bias` `[heads*out]` (hidden) or `[out]` (last layer) |
//! | a residual layer whose input and output widths differ (any model) | `res.weight` `[out, in]` |
//!
//! Trellis keeps weights as `[in, out]` (it computes `X W`), so they are transposed on the way
//! out and back. The header's `__metadata__` holds `format = pt` and the `trellis.*` keys of
//! [`ModelMeta`]; loading checks the model kind, every tensor's name, dtype and shape against
//! the configuration, and the weights digest against the values (a corrupt or truncated file
//! is an error naming it).
use crate::model::{Model, ModelConfig, ModelKind};
use crate::{Result, RuntimeError};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use trellis_gpu::{Stream, Tensor};

/// What a model file says about the model besides its parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelMeta {
    /// Architecture and widths (what rebuilds the model).
    pub config: ModelConfig,
    /// The whole training configuration (JSON), when the model came from `trellis train`.
    pub train_config: Option<serde_json::Value>,
    /// Whether input features are row-normalised before the first layer.
    pub normalize_features: bool,
    /// BLAKE3 digest of the data set the model was trained on.
    pub data_digest: String,
    /// BLAKE3 digest of the parameters (Trellis's own layout, as in run reports).
    pub weights_digest: String,
    /// Epoch whose parameters these are.
    pub epoch: u32,
    /// `trellis` version that wrote the file.
    pub code_version: String,
}

impl ModelMeta {
    /// The metadata of the weights of `epoch` of a training with `cfg` on the data of
    /// `data_digest` (the weights digest is computed when the file is written).
    pub fn of_training(cfg: &crate::TrainConfig, data_digest: &str, epoch: u32) -> Self {
        ModelMeta {
            config: cfg.model.clone(),
            train_config: serde_json::to_value(cfg).ok(),
            normalize_features: cfg.normalize_features,
            data_digest: data_digest.to_string(),
            weights_digest: String::new(),
            epoch,
            code_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// A model read from a file, its parameters on the host.
#[derive(Debug)]
pub struct SavedModel {
    pub model: Model,
    pub meta: ModelMeta,
    /// Where it was read from.
    pub path: PathBuf,
}

/// How one Trellis parameter is stored in the PyG layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// A `[in, out]` weight stored `[out, in]`.
    Transposed,
    /// A `1 x k` row stored as a vector `[k]`.
    Vector,
    /// A GAT attention matrix `[heads, d]` stored `[1, heads, d]`.
    Heads,
}

/// The PyG name and layout of the Trellis parameter `layers.{l}.{name}`.
fn pyg_name(kind: ModelKind, layer: usize, name: &str) -> Option<(String, Layout)> {
    let layout = match (kind, name) {
        (ModelKind::Gcn, "weight") => ("lin.weight", Layout::Transposed),
        (ModelKind::Gcn, "bias") => ("bias", Layout::Vector),
        (ModelKind::Sage, "lin_l.weight") => ("lin_l.weight", Layout::Transposed),
        (ModelKind::Sage, "lin_l.bias") => ("lin_l.bias", Layout::Vector),
        (ModelKind::Sage, "lin_r.weight") => ("lin_r.weight", Layout::Transposed),
        (ModelKind::Gat, "lin.weight") => ("lin.weight", Layout::Transposed),
        (ModelKind::Gat, "att_src") => ("att_src", Layout::Heads),
        (ModelKind::Gat, "att_dst") => ("att_dst", Layout::Heads),
        (ModelKind::Gat, "bias") => ("bias", Layout::Vector),
        (_, "res.weight") => ("res.weight", Layout::Transposed),
        _ => return None,
    };
    Some((format!("conv{}.{}", layer + 1, layout.0), layout.1))
}

/// Splits `layers.{l}.{rest}` into `(l, rest)`.
fn split_param_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("layers.")?;
    let (l, rest) = rest.split_once('.')?;
    Some((l.parse().ok()?, rest))
}

/// The stored shape and row-major values of a `rows x cols` Trellis tensor.
fn to_pyg(t: &[f32], rows: usize, cols: usize, layout: Layout) -> (Vec<usize>, Vec<f32>) {
    match layout {
        Layout::Transposed => {
            let mut out = vec![0.0; t.len()];
            for r in 0..rows {
                for c in 0..cols {
                    out[c * rows + r] = t[r * cols + c];
                }
            }
            (vec![cols, rows], out)
        }
        Layout::Vector => (vec![rows * cols], t.to_vec()),
        Layout::Heads => (vec![1, rows, cols], t.to_vec()),
    }
}

/// The Trellis `rows x cols` values of a tensor stored in `layout`.
fn from_pyg(v: &[f32], rows: usize, cols: usize, layout: Layout) -> Vec<f32> {
    match layout {
        Layout::Transposed => {
            let mut out = vec![0.0; v.len()];
            for c in 0..cols {
                for r in 0..rows {
                    out[r * cols + c] = v[c * rows + r];
                }
            }
            out
        }
        Layout::Vector | Layout::Heads => v.to_vec(),
    }
}

/// Metadata keys (all under `trellis.`).
mod key {
    pub const KIND: &str = "trellis.model_kind";
    pub const LAYER_SIZES: &str = "trellis.layer_sizes";
    pub const HEADS: &str = "trellis.heads";
    pub const RESIDUAL: &str = "trellis.residual";
    pub const OUT_HEADS: &str = "trellis.out_heads";
    pub const MODEL_CONFIG: &str = "trellis.model_config";
    pub const TRAIN_CONFIG: &str = "trellis.train_config";
    pub const NORMALIZE: &str = "trellis.normalize_features";
    pub const DATA_DIGEST: &str = "trellis.data_digest";
    pub const WEIGHTS_DIGEST: &str = "trellis.weights_digest";
    pub const EPOCH: &str = "trellis.epoch";
    pub const CODE_VERSION: &str = "trellis.code_version";
}

/// Layer widths `[in, hidden_0 * heads, ..., out]` as the metadata writes them.
fn layer_sizes(cfg: &ModelConfig) -> String {
    let mut sizes = vec![cfg.in_dim];
    sizes.extend((0..cfg.layers).map(|l| cfg.output_width(l)));
    sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Serialises `model` (its values held by `s`) with `meta` into safetensors bytes.
pub fn to_bytes(model: &Model, s: &Stream, meta: &ModelMeta) -> Result<Vec<u8>> {
    let cfg = model.config();
    let values = model.values_on_host(s)?;
    let mut stored: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(values.len());
    for (p, v) in model.params().iter().zip(&values) {
        let (layer, name) = split_param_name(&p.name)
            .ok_or_else(|| RuntimeError::Config(format!("unexpected parameter {}", p.name)))?;
        let (pyg, layout) = pyg_name(cfg.kind, layer, name)
            .ok_or_else(|| RuntimeError::Config(format!("no PyG name for parameter {}", p.name)))?;
        let (shape, data) = to_pyg(v.as_slice(), v.rows(), v.cols(), layout);
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        stored.push((pyg, shape, bytes));
    }
    let views = stored
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| RuntimeError::Config(format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut info = HashMap::new();
    info.insert("format".to_string(), "pt".to_string());
    info.insert(key::KIND.into(), cfg.kind.to_string());
    info.insert(key::LAYER_SIZES.into(), layer_sizes(cfg));
    info.insert(key::HEADS.into(), cfg.heads.to_string());
    info.insert(key::RESIDUAL.into(), cfg.residual.to_string());
    info.insert(key::OUT_HEADS.into(), cfg.out_heads.to_string());
    info.insert(key::MODEL_CONFIG.into(), json(cfg)?);
    if let Some(t) = &meta.train_config {
        info.insert(key::TRAIN_CONFIG.into(), t.to_string());
    }
    info.insert(key::NORMALIZE.into(), meta.normalize_features.to_string());
    info.insert(key::DATA_DIGEST.into(), meta.data_digest.clone());
    info.insert(key::WEIGHTS_DIGEST.into(), model.weights_digest(s)?);
    info.insert(key::EPOCH.into(), meta.epoch.to_string());
    info.insert(key::CODE_VERSION.into(), meta.code_version.clone());
    safetensors::serialize(views, Some(info))
        .map_err(|e| RuntimeError::Config(format!("cannot serialise the model: {e}")))
}

fn json(cfg: &ModelConfig) -> Result<String> {
    serde_json::to_string(cfg).map_err(|e| RuntimeError::Config(e.to_string()))
}

/// Writes `model` to `path` (a temporary file beside it, then a rename: a reader never sees
/// half a file).
pub fn save(path: &Path, model: &Model, s: &Stream, meta: &ModelMeta) -> Result<()> {
    let bytes = to_bytes(model, s, meta)?;
    let tmp = path.with_extension("safetensors.tmp");
    std::fs::write(&tmp, &bytes).map_err(|e| RuntimeError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| RuntimeError::io(path, e))
}

/// Reads and checks a model file.
pub fn load(path: &Path) -> Result<SavedModel> {
    let bytes = std::fs::read(path).map_err(|e| RuntimeError::io(path, e))?;
    from_bytes(&bytes, path)
}

/// Parses model file bytes; errors name `path`.
pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<SavedModel> {
    let bad = |d: String| RuntimeError::bad_file(path, d);
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let tensors = SafeTensors::deserialize(bytes)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let info = header
        .metadata()
        .as_ref()
        .ok_or_else(|| bad("no __metadata__: not a Trellis model file".into()))?;
    let get = |k: &str| {
        info.get(k)
            .ok_or_else(|| bad(format!("metadata lacks `{k}`: not a Trellis model file")))
    };
    let kind: ModelKind = get(key::KIND)?
        .parse()
        .map_err(|e: RuntimeError| bad(format!("`{}`: {e}", key::KIND)))?;
    let config: ModelConfig = serde_json::from_str(get(key::MODEL_CONFIG)?)
        .map_err(|e| bad(format!("`{}` does not parse: {e}", key::MODEL_CONFIG)))?;
    if config.kind != kind {
        return Err(bad(format!(
            "`{}` says {kind} but the model config says {}",
            key::KIND,
            config.kind
        )));
    }
    let template = Model::new(config.clone()).map_err(|e| bad(e.to_string()))?;
    let mut values = Vec::with_capacity(template.params().len());
    for p in template.params() {
        let (layer, name) = split_param_name(&p.name).expect("models name their parameters");
        let (pyg, layout) = pyg_name(kind, layer, name).expect("every parameter has a PyG name");
        let view = tensors.tensor(&pyg).map_err(|_| {
            bad(format!(
                "tensor `{pyg}` is missing (a {kind} model needs it)"
            ))
        })?;
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor `{pyg}` is {:?}, expected F32",
                view.dtype()
            )));
        }
        let (rows, cols) = p.value.shape();
        let (want, _) = to_pyg(&vec![0.0; rows * cols], rows, cols, layout);
        if view.shape() != want.as_slice() {
            return Err(bad(format!(
                "tensor `{pyg}` has shape {:?}, expected {want:?} for this {kind} model",
                view.shape()
            )));
        }
        let data: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if data.iter().any(|x| !x.is_finite()) {
            return Err(bad(format!("tensor `{pyg}` holds NaN or infinity")));
        }
        values.push(Tensor::from_vec(
            rows,
            cols,
            from_pyg(&data, rows, cols, layout),
        )?);
    }
    let expected = template.params().len();
    if tensors.len() != expected {
        let known: Vec<String> = template
            .params()
            .iter()
            .filter_map(|p| {
                let (l, n) = split_param_name(&p.name)?;
                Some(pyg_name(kind, l, n)?.0)
            })
            .collect();
        let extra: Vec<&str> = tensors
            .names()
            .into_iter()
            .filter(|n| !known.iter().any(|k| k == n))
            .collect();
        return Err(bad(format!(
            "unexpected tensors {extra:?} for a {kind} model of {} layers",
            config.layers
        )));
    }
    let model = Model::with_values(config.clone(), values).map_err(|e| bad(e.to_string()))?;
    let host = Stream::cpu(0)?;
    let digest = model.weights_digest(&host)?;
    let stored_digest = get(key::WEIGHTS_DIGEST)?.clone();
    if digest != stored_digest {
        return Err(bad(format!(
            "weights digest {digest} does not match the recorded {stored_digest}: the file is corrupt"
        )));
    }
    let train_config = match info.get(key::TRAIN_CONFIG) {
        Some(t) => Some(
            serde_json::from_str(t)
                .map_err(|e| bad(format!("`{}` does not parse: {e}", key::TRAIN_CONFIG)))?,
        ),
        None => None,
    };
    let normalize_features = match get(key::NORMALIZE)?.as_str() {
        "true" => true,
        "false" => false,
        other => return Err(bad(format!("`{}` is `{other}`", key::NORMALIZE))),
    };
    let epoch = get(key::EPOCH)?
        .parse()
        .map_err(|_| bad(format!("`{}` is not a number", key::EPOCH)))?;
    let meta = ModelMeta {
        config,
        train_config,
        normalize_features,
        data_digest: get(key::DATA_DIGEST)?.clone(),
        weights_digest: stored_digest,
        epoch,
        code_version: get(key::CODE_VERSION)?.clone(),
    };
    Ok(SavedModel {
        model,
        meta,
        path: path.to_path_buf(),
    })
}

impl SavedModel {
    /// Checks that the model fits a data set of `features` input columns and `classes`
    /// classes; the error names the model file.
    pub fn check_fits(&self, features: usize, classes: usize) -> Result<()> {
        let cfg = &self.meta.config;
        if cfg.in_dim != features {
            return Err(RuntimeError::bad_file(
                &self.path,
                format!(
                    "the model takes {} input features, the data has {features}",
                    cfg.in_dim
                ),
            ));
        }
        if cfg.out_dim != classes {
            return Err(RuntimeError::bad_file(
                &self.path,
                format!(
                    "the model predicts {} classes, the data has {classes}",
                    cfg.out_dim
                ),
            ));
        }
        Ok(())
    }

    /// A short name of these weights ([`version_of`] their digest).
    pub fn version(&self) -> String {
        version_of(&self.meta.weights_digest)
    }
}

/// The short name of weights whose digest is `weights_digest`: its first 12 hex digits (what
/// answers and logs name a served model by).
pub fn version_of(weights_digest: &str) -> String {
    weights_digest.chars().take(12).collect()
}
