//! GNN models with hand-written backward passes: GCN, GraphSAGE (mean) and GAT.
//!
//! A model is a stack of layers. Each layer maps the input rows of a [`Block`] (inner nodes,
//! then halo nodes) to its output rows (inner nodes), so the same code runs on a whole graph or
//! on one partition whose halo rows are filled by exchange between layers. Layers cache what
//! their backward needs; `backward_layer` returns the gradient for every input row (halo rows
//! included: a partition sends those back to their owners) and accumulates weight gradients.
use crate::graph::{Aggregation, Block};
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use trellis_gpu::{Activation, Bits, DropoutKey, Philox4x32, Stream, Tensor};

mod gat;
mod gcn;
mod increment;
mod input;
mod optim;
mod residual;
mod sage;
mod split;

pub use increment::PreActivationInput;
pub use input::LayerInput;

pub use optim::{Optimizer, OptimizerKind};

/// Which architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Gcn,
    Sage,
    Gat,
}

impl std::str::FromStr for ModelKind {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "gcn" => Ok(ModelKind::Gcn),
            "sage" | "graphsage" => Ok(ModelKind::Sage),
            "gat" => Ok(ModelKind::Gat),
            _ => Err(RuntimeError::Config(format!(
                "unknown model `{s}` (expected gcn, sage or gat)"
            ))),
        }
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModelKind::Gcn => "gcn",
            ModelKind::Sage => "sage",
            ModelKind::Gat => "gat",
        })
    }
}

impl ModelKind {
    /// The aggregation this architecture's blocks need.
    pub fn aggregation(self) -> Aggregation {
        match self {
            ModelKind::Gcn => Aggregation::GcnNorm,
            ModelKind::Sage => Aggregation::Mean,
            ModelKind::Gat => Aggregation::Attention,
        }
    }
}

/// Architecture and regularisation of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub kind: ModelKind,
    pub in_dim: usize,
    pub hidden: usize,
    pub out_dim: usize,
    /// Number of layers (>= 1).
    pub layers: usize,
    /// GAT: attention heads of hidden layers (concatenated).
    pub heads: usize,
    /// GAT: attention heads of the output layer (averaged).
    pub out_heads: usize,
    /// Feature dropout on every layer's input.
    pub dropout: f32,
    /// GAT: dropout on attention coefficients.
    pub attn_dropout: f32,
    /// Seed of init and dropout.
    pub seed: u64,
    /// Widths of the hidden layers, one per hidden layer (`layers - 1`; per head for GAT).
    /// Empty: every hidden layer is `hidden` wide (what models saved before this field say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hidden_sizes: Vec<usize>,
    /// Residual connections (DeepGCNs): every hidden layer after the first adds its input to
    /// its output, `h_{l+1} = act(layer(h_l)) + h_l`, or a learned projection `h_l P` of its
    /// input where the widths differ (see [`ModelConfig::residual_of`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub residual: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Most layers a model may have (deep GCNs of the literature reach 56 to 112).
pub const MAX_LAYERS: usize = 128;

/// How a layer's residual connection maps its input to its output's width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Residual {
    /// No residual connection (the first and the last layer, or `residual` off).
    None,
    /// The input itself (input and output widths are equal).
    Identity,
    /// The input times a learned `in x out` matrix (`res.weight`, no bias): where the
    /// widths differ.
    Projection,
}

impl ModelConfig {
    /// Each paper's Cora settings for `kind` (layers 2; GCN hidden 16, dropout 0.5; GraphSAGE
    /// hidden 16, dropout 0.5; GAT 8 heads x 8 hidden, 1 output head, dropout 0.6 on features
    /// and attention).
    pub fn paper_defaults(kind: ModelKind, in_dim: usize, out_dim: usize, seed: u64) -> Self {
        let (hidden, heads, dropout, attn) = match kind {
            ModelKind::Gcn => (16, 1, 0.5, 0.0),
            ModelKind::Sage => (16, 1, 0.5, 0.0),
            ModelKind::Gat => (8, 8, 0.6, 0.6),
        };
        ModelConfig {
            kind,
            in_dim,
            hidden,
            out_dim,
            layers: 2,
            heads,
            out_heads: 1,
            dropout,
            attn_dropout: attn,
            seed,
            hidden_sizes: Vec::new(),
            residual: false,
        }
    }

    /// Width (per head for GAT) of hidden layer `l` (`l < layers - 1`).
    pub fn hidden_of(&self, l: usize) -> usize {
        self.hidden_sizes.get(l).copied().unwrap_or(self.hidden)
    }

    /// Output width of layer `l` as the next layer reads it (heads concatenated).
    pub fn output_width(&self, l: usize) -> usize {
        if l + 1 == self.layers {
            self.out_dim
        } else if self.kind == ModelKind::Gat {
            self.hidden_of(l) * self.heads
        } else {
            self.hidden_of(l)
        }
    }

    /// Input width of layer `l`.
    pub fn input_width(&self, l: usize) -> usize {
        if l == 0 {
            self.in_dim
        } else {
            self.output_width(l - 1)
        }
    }

    /// The residual connection of layer `l`: none on the first layer (its input is the
    /// features) and the last (its output is the logits), nor without `residual`; else the
    /// identity where the input is as wide as the output, a projection where it is not.
    pub fn residual_of(&self, l: usize) -> Residual {
        if !self.residual || l == 0 || l + 1 >= self.layers {
            Residual::None
        } else if self.input_width(l) == self.output_width(l) {
            Residual::Identity
        } else {
            Residual::Projection
        }
    }

    /// Whether `other` has this architecture (kind, widths, layers, heads): its parameters
    /// have the same names and shapes, whatever its seed or regularisation.
    pub fn same_architecture(&self, other: &ModelConfig) -> bool {
        let widths = |c: &ModelConfig| (0..c.layers).map(|l| c.output_width(l)).collect::<Vec<_>>();
        (
            self.kind,
            self.in_dim,
            self.out_dim,
            self.layers,
            self.residual,
        ) == (
            other.kind,
            other.in_dim,
            other.out_dim,
            other.layers,
            other.residual,
        ) && widths(self) == widths(other)
            && (self.kind != ModelKind::Gat
                || (self.heads, self.out_heads) == (other.heads, other.out_heads))
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(RuntimeError::Config(m.to_string()));
        if self.layers == 0 || self.layers > MAX_LAYERS {
            return Err(RuntimeError::Config(format!(
                "a model has 1 to {MAX_LAYERS} layers, not {}",
                self.layers
            )));
        }
        if !self.hidden_sizes.is_empty() && self.hidden_sizes.len() != self.layers - 1 {
            return Err(RuntimeError::Config(format!(
                "{} hidden widths for a {}-layer model, which has {} hidden layers \
                 (give one width for all, or one per hidden layer)",
                self.hidden_sizes.len(),
                self.layers,
                self.layers - 1
            )));
        }
        let hidden_zero = (0..self.layers.saturating_sub(1)).any(|l| self.hidden_of(l) == 0);
        if self.in_dim == 0 || self.out_dim == 0 || hidden_zero {
            return bad("input, hidden and output widths must be > 0");
        }
        if self.residual && self.layers < 3 {
            return bad(
                "residual connections join hidden layers: a residual model needs at least 3 layers",
            );
        }
        if self.kind == ModelKind::Gat && (self.heads == 0 || self.out_heads == 0) {
            return bad("GAT needs at least one head");
        }
        if !(0.0..1.0).contains(&self.dropout) || !(0.0..1.0).contains(&self.attn_dropout) {
            return bad("dropout must be in [0, 1)");
        }
        Ok(())
    }
}

/// A trainable tensor with its gradient.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
}

impl Param {
    fn new(name: String, value: Tensor) -> Self {
        let grad = Tensor::zeros(value.rows(), value.cols());
        Param { name, value, grad }
    }
}

/// Per-step context of a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCtx {
    /// Epoch number (keys dropout masks).
    pub epoch: u32,
    /// Training (dropout on) or evaluation.
    pub train: bool,
}

/// What every layer function works with: the stream its kernels run on, the layer's spec, the
/// model's seed (keys dropout) and the block it computes over.
#[derive(Clone, Copy)]
pub(crate) struct LayerArgs<'a> {
    pub s: &'a Stream,
    pub spec: &'a LayerSpec,
    pub seed: u64,
    pub block: &'a Block,
}

/// What one layer needs for its backward pass.
pub(crate) enum Cache {
    Gcn(gcn::GcnCache),
    /// A split layer between its forward stages: the dropped inner input rows.
    SplitInput(LayerInput),
    Sage(sage::SageCache),
    /// Boxed: it holds the most tensors (and a device tensor is larger than a host one).
    Gat(Box<gat::GatCache>),
}

/// Shape of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerSpec {
    pub index: usize,
    pub in_dim: usize,
    pub out_dim: usize,
    pub heads: usize,
    /// GAT: concatenate heads (hidden layers) or average them (output layer).
    pub concat: bool,
    pub act: Activation,
    pub dropout: f32,
    pub attn_dropout: f32,
    /// Index of this layer's first parameter in the model's list.
    pub first_param: usize,
    /// The layer's residual connection.
    pub residual: Residual,
    /// Index of the projection matrix of a [`Residual::Projection`] layer.
    pub residual_param: usize,
}

impl LayerSpec {
    pub fn dropout_key(&self, seed: u64, epoch: u32, site: u16) -> DropoutKey {
        DropoutKey {
            seed,
            epoch,
            layer: self.index as u16,
            site,
        }
    }
}

/// A GNN model: parameters, layer specs and the caches of the current step.
pub struct Model {
    cfg: ModelConfig,
    layers: Vec<LayerSpec>,
    params: Vec<Param>,
    caches: Vec<Option<Cache>>,
    /// Per layer with a projected residual, in training: the inner input rows its weight
    /// gradient needs.
    residual_inputs: Vec<Option<Tensor>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cfg", &self.cfg)
            .field("params", &self.num_parameters())
            .finish()
    }
}

impl Model {
    /// Builds a model with parameters initialised from counter-based RNG keyed by the seed.
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        cfg.validate()?;
        let mut layers = Vec::with_capacity(cfg.layers);
        let mut params = Vec::new();
        let mut in_dim = cfg.in_dim;
        for l in 0..cfg.layers {
            let last = l + 1 == cfg.layers;
            let (heads, concat, out_dim) = match (cfg.kind, last) {
                (ModelKind::Gat, false) => (cfg.heads, true, cfg.hidden_of(l)),
                (ModelKind::Gat, true) => (cfg.out_heads, false, cfg.out_dim),
                (_, false) => (1, true, cfg.hidden_of(l)),
                (_, true) => (1, true, cfg.out_dim),
            };
            let act = match (cfg.kind, last) {
                (_, true) => Activation::Identity,
                (ModelKind::Gat, false) => Activation::Elu { alpha: 1.0 },
                _ => Activation::Relu,
            };
            let spec = LayerSpec {
                index: l,
                in_dim,
                out_dim,
                heads,
                concat,
                act,
                dropout: cfg.dropout,
                attn_dropout: cfg.attn_dropout,
                first_param: params.len(),
                residual: cfg.residual_of(l),
                residual_param: 0,
            };
            let mut shapes: Vec<(String, usize, usize, Init)> = match cfg.kind {
                ModelKind::Gcn => gcn::param_shapes(&spec),
                ModelKind::Sage => sage::param_shapes(&spec),
                ModelKind::Gat => gat::param_shapes(&spec),
            };
            let mut spec = spec;
            if spec.residual == Residual::Projection {
                spec.residual_param = params.len() + shapes.len();
                shapes.push(residual::param_shape(&spec, cfg.output_width(l)));
            }
            for (name, r, c, init) in shapes {
                let idx = params.len();
                params.push(Param::new(
                    format!("layers.{l}.{name}"),
                    init.tensor(cfg.seed, idx, r, c),
                ));
            }
            layers.push(spec);
            in_dim = if concat { out_dim * heads } else { out_dim };
        }
        let caches = (0..layers.len()).map(|_| None).collect();
        let residual_inputs = (0..layers.len()).map(|_| None).collect();
        Ok(Model {
            cfg,
            layers,
            params,
            caches,
            residual_inputs,
        })
    }

    /// A model of `cfg` holding the given parameter values (in [`Model::params`] order, each
    /// of the shape [`Model::new`] gives it): how a saved model is loaded.
    pub fn with_values(cfg: ModelConfig, values: Vec<Tensor>) -> Result<Self> {
        let mut model = Model::new(cfg)?;
        if values.len() != model.params.len() {
            return Err(RuntimeError::Config(format!(
                "a {} model of this shape has {} parameters, {} were given",
                model.cfg.kind,
                model.params.len(),
                values.len()
            )));
        }
        for (p, v) in model.params.iter_mut().zip(values) {
            if v.shape() != p.value.shape() {
                return Err(RuntimeError::Config(format!(
                    "parameter {} is {}x{}, expected {}x{}",
                    p.name,
                    v.rows(),
                    v.cols(),
                    p.value.rows(),
                    p.value.cols()
                )));
            }
            p.value = v;
        }
        Ok(model)
    }

    /// Host copies of the parameter values, in order (`s` holds them).
    pub fn values_on_host(&self, s: &Stream) -> Result<Vec<Tensor>> {
        self.params
            .iter()
            .map(|p| Ok(s.to_host(&p.value)?))
            .collect()
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Input width of layer `l`.
    pub fn layer_in_dim(&self, l: usize) -> usize {
        self.layers[l].in_dim
    }
    /// Parameters, in a fixed order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }
    /// Parameters, mutable.
    pub fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }
    /// Total number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.value.len()).sum()
    }
    /// Moves the parameters and gradients into `s`'s memory (a model is built on the host;
    /// a GPU trainer places it on its stream before the first step).
    pub fn place(&mut self, s: &Stream) -> Result<()> {
        for p in &mut self.params {
            s.place_in(&mut p.value)?;
            s.place_in(&mut p.grad)?;
        }
        Ok(())
    }
    /// Sets all gradients to zero.
    pub fn zero_grad(&mut self, s: &Stream) -> Result<()> {
        for p in &mut self.params {
            s.fill(&mut p.grad, 0.0)?;
        }
        Ok(())
    }
    /// Drops the caches of the last forward pass.
    pub fn clear_caches(&mut self) {
        self.caches.iter_mut().for_each(|c| *c = None);
        self.residual_inputs.iter_mut().for_each(|c| *c = None);
    }
    /// The residual connection of layer `l`.
    pub fn residual(&self, l: usize) -> Residual {
        self.layers[l].residual
    }
    /// Hex digest of all parameter values, in order (`s` holds them).
    pub fn weights_digest(&self, s: &Stream) -> Result<String> {
        let values: Vec<&Tensor> = self.params.iter().map(|p| &p.value).collect();
        Ok(s.digest(&values)?)
    }

    /// The arguments of a layer function of this model.
    pub(crate) fn args<'a>(
        &self,
        s: &'a Stream,
        spec: &'a LayerSpec,
        block: &'a Block,
    ) -> LayerArgs<'a> {
        LayerArgs {
            s,
            spec,
            seed: self.cfg.seed,
            block,
        }
    }

    /// Checks that `x` holds one row of layer `l`'s input width per input row of `block`.
    pub(crate) fn check_layer_input(&self, l: usize, block: &Block, x: &LayerInput) -> Result<()> {
        let in_dim = self.layers[l].in_dim;
        if x.rows() != block.n_in() || x.cols() != in_dim {
            return Err(RuntimeError::Config(format!(
                "layer {l} expects {}x{in_dim} input rows, got {}x{}",
                block.n_in(),
                x.rows(),
                x.cols()
            )));
        }
        Ok(())
    }

    /// Runs layer `l` on `x` (one row per input row of `block`) and returns its output rows
    /// (one per inner node). An owned input is reused for the layer's dropout (no copy).
    /// In training mode the layer keeps what its backward needs.
    pub fn forward_layer(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        x: Cow<'_, LayerInput>,
        ctx: StepCtx,
    ) -> Result<Tensor> {
        let spec = self.layers[l];
        self.check_layer_input(l, block, &x)?;
        let res = self.residual_forward(s, l, block, x.as_ref(), ctx)?;
        let params = &self.params[spec.first_param..];
        let a = self.args(s, &spec, block);
        let (mut out, cache) = match self.cfg.kind {
            ModelKind::Gcn => {
                let (o, c) = gcn::forward(&a, params, x, ctx)?;
                (o, c.map(Cache::Gcn))
            }
            ModelKind::Sage => {
                let (o, c) = sage::forward(&a, params, x, ctx)?;
                (o, c.map(Cache::Sage))
            }
            ModelKind::Gat => {
                let (o, c) = gat::forward(&a, params, x, ctx)?;
                (o, c.map(|c| Cache::Gat(Box::new(c))))
            }
        };
        self.caches[l] = cache;
        if let Some(r) = res {
            s.axpy(1.0, &r, &mut out)?;
        }
        Ok(out)
    }

    /// Backward of layer `l` given the gradient of its output rows. Accumulates the layer's
    /// weight gradients and, if `need_input_grad`, returns the gradient of every input row.
    pub fn backward_layer(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        grad_out: Tensor,
        need_input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let spec = self.layers[l];
        let cache = self.caches[l].take().ok_or_else(|| {
            RuntimeError::Config(format!("backward of layer {l} without a training forward"))
        })?;
        let res_grad = self.residual_backward(s, l, &grad_out, need_input_grad)?;
        let a = self.args(s, &spec, block);
        let params = &mut self.params[spec.first_param..];
        let gx = match cache {
            Cache::Gcn(c) => gcn::backward(&a, params, c, grad_out, need_input_grad),
            Cache::Sage(c) => sage::backward(&a, params, c, grad_out, need_input_grad),
            Cache::Gat(c) => gat::backward(&a, params, *c, grad_out, need_input_grad),
            Cache::SplitInput(_) => Err(RuntimeError::Config(format!(
                "backward of layer {l} before its forward finished"
            ))),
        }?;
        match (gx, res_grad) {
            (Some(mut gx), Some(r)) => {
                s.add_rows_prefix(&r, &mut gx)?;
                Ok(Some(gx))
            }
            (gx, _) => Ok(gx),
        }
    }

    /// Forward through all layers on a block that covers the whole graph (no halo).
    pub fn forward_full(
        &mut self,
        s: &Stream,
        block: &Block,
        x: &LayerInput,
        ctx: StepCtx,
    ) -> Result<Tensor> {
        let mut h = self.forward_layer(s, 0, block, Cow::Borrowed(x), ctx)?;
        for l in 1..self.num_layers() {
            h = self.forward_layer(s, l, block, Cow::Owned(LayerInput::Dense(h)), ctx)?;
        }
        Ok(h)
    }

    /// Backward through all layers on a whole-graph block.
    pub fn backward_full(&mut self, s: &Stream, block: &Block, grad: Tensor) -> Result<()> {
        let mut g = grad;
        for l in (0..self.num_layers()).rev() {
            match self.backward_layer(s, l, block, g, l > 0)? {
                Some(next) => g = next,
                None => break,
            }
        }
        Ok(())
    }
}

/// What a layer keeps of its output for the activation's backward: nothing for the identity,
/// one bit per element for ReLU, the output itself otherwise.
pub(crate) enum ActSaved {
    Nothing,
    Positive(Bits),
    Output(Tensor),
}

impl ActSaved {
    /// `h = act(h + b)` in place; with `saved` (what a training forward keeps for backward),
    /// also what the activation's backward needs.
    pub(crate) fn finish<S>(
        s: &Stream,
        act: Activation,
        b: &Tensor,
        h: &mut Tensor,
        saved: Option<S>,
    ) -> Result<Option<(S, ActSaved)>> {
        s.add_bias(h, b)?;
        s.activate(act, h)?;
        match saved {
            Some(saved) => Ok(Some((saved, ActSaved::save(s, act, h)?))),
            None => Ok(None),
        }
    }

    pub(crate) fn save(s: &Stream, act: Activation, y: &Tensor) -> Result<Self> {
        Ok(match act {
            Activation::Identity => ActSaved::Nothing,
            Activation::Relu => ActSaved::Positive(s.positive_bits(y)?),
            _ => ActSaved::Output(s.copy(y)?),
        })
    }

    /// `g *= act'(x)` for the saved output.
    pub(crate) fn backward(&self, s: &Stream, act: Activation, g: &mut Tensor) -> Result<()> {
        match self {
            ActSaved::Nothing => Ok(()),
            ActSaved::Positive(bits) => Ok(s.mask_by_bits(bits, g)?),
            ActSaved::Output(y) => Ok(s.activation_backward_from_output(act, y, g)?),
        }
    }
}

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Init {
    /// Glorot/Xavier uniform over (fan_in, fan_out) = (rows, cols).
    Glorot,
    /// Glorot uniform with explicit fans (GAT attention vectors).
    GlorotFans(usize, usize),
    /// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as torch.nn.Linear.
    LinearUniform(usize),
    Zeros,
}

impl Init {
    /// A `rows x cols` tensor drawn from Philox keyed by (seed, parameter index, element).
    fn tensor(self, seed: u64, param: usize, rows: usize, cols: usize) -> Tensor {
        let bound = match self {
            Init::Glorot => (6.0 / (rows + cols) as f64).sqrt() as f32,
            Init::GlorotFans(a, b) => (6.0 / (a + b) as f64).sqrt() as f32,
            Init::LinearUniform(fan_in) => (1.0 / (fan_in.max(1) as f64)).sqrt() as f32,
            Init::Zeros => return Tensor::zeros(rows, cols),
        };
        let g = Philox4x32::new(seed);
        let n = rows * cols;
        let mut v = Vec::with_capacity(n);
        for b in 0..n.div_ceil(4) {
            let u = g.block([0x1417_0000, param as u32, b as u32, 0]);
            for &x in u.iter().take(n - 4 * b) {
                v.push((2.0 * Philox4x32::to_unit(x) - 1.0) * bound);
            }
        }
        Tensor::from_vec(rows, cols, v).expect("sized above")
    }
}

/// Applies the input dropout mask of a training step to an input gradient: of every input
/// row of `block`, or of its first `g.rows()` (a split layer's inner rows).
pub(crate) fn dropout_backward(
    s: &Stream,
    spec: &LayerSpec,
    seed: u64,
    block: &Block,
    g: &mut Tensor,
    epoch: u32,
) -> Result<()> {
    if spec.dropout > 0.0 {
        s.dropout(
            g,
            &block.gids()[..g.rows().min(block.n_in())],
            spec.dropout_key(seed, epoch, 0),
            spec.dropout,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod gradcheck;
