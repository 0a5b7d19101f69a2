//! What serving's incremental updates need from a model: which layers can take an update as
//! increments of their pre-activation rows, and those rows themselves.
//!
//! A GCN layer with no residual computes `y_v = act(p_v)`, `p_v = b + Σ_u Z_u / sqrt((d_u +
//! 1)(d_v + 1))` over `u ∈ N(v) ∪ {v}`, `Z = H W`: the pre-activation `p` is linear in the
//! degree-scaled transformed rows. When a few rows of `Z` (or their degrees) change, `p`
//! changes by `Σ_u ΔY_u / sqrt(d_v + 1)` over the changed neighbours only, so a service can
//! keep `p` and add the changes instead of aggregating every neighbour again. Which `Z` rows
//! changed must be known without recomputing them all: for layer 0 they are the rows of the
//! new nodes and of the nodes whose degree changed (the features never change), for a split
//! layer ([`Model::reads_transformed_only`]) the rows its partition re-transformed.
use super::{gcn, LayerInput, Model, ModelKind, Residual, StepCtx};
use crate::graph::Block;
use crate::{Result, RuntimeError};
use std::borrow::Cow;
use trellis_gpu::{Activation, Stream, Tensor};

/// Inference (dropout off).
const EVAL: StepCtx = StepCtx {
    epoch: 0,
    train: false,
};

impl Model {
    /// True when layer `l` can take an update as increments of its pre-activation rows (see
    /// the module's documentation): a GCN layer with no residual that is the first layer or
    /// runs split.
    pub fn takes_increments(&self, l: usize) -> bool {
        self.cfg.kind == ModelKind::Gcn
            && l < self.layers.len()
            && self.layers[l].residual == Residual::None
            && (l == 0 || self.reads_transformed_only(l))
    }

    /// True when a service keeps layer `l`'s pre-activation rows beside its output rows: it
    /// takes increments and has an activation (with none, the output rows are the
    /// pre-activation rows).
    pub fn keeps_pre_activation(&self, l: usize) -> bool {
        self.takes_increments(l) && self.layers[l].act != Activation::Identity
    }

    fn check_increments(&self, l: usize) -> Result<()> {
        if !self.takes_increments(l) {
            return Err(RuntimeError::Config(format!(
                "layer {l} does not take increments (only GCN layers with no residual that \
                 are the first or run split do)"
            )));
        }
        Ok(())
    }

    /// The transformed rows `Z = X W` of layer 0 (which takes increments) for the input rows
    /// `x` of the block's inner nodes.
    pub fn transform_first(&self, s: &Stream, block: &Block, x: Tensor) -> Result<Tensor> {
        self.check_increments(0)?;
        let spec = self.layers[0];
        if x.shape() != (block.n_out(), spec.in_dim) {
            return Err(RuntimeError::Config(format!(
                "layer 0 expects {}x{} inner rows, got {:?}",
                block.n_out(),
                spec.in_dim,
                x.shape()
            )));
        }
        let p = &self.params[spec.first_param..];
        let (z, _) = gcn::transform(&self.args(s, &spec, block), p, x, EVAL)?;
        Ok(z)
    }

    /// Layer `l`'s pre-activation rows `p` (inference) of the block's inner nodes: from the
    /// layer's input rows `x` (layer 0), or from the transformed rows `Z` of every input row
    /// (a split layer). [`Model::activate`] of them gives the bits the layer's forward does.
    pub fn forward_pre_activation(
        &self,
        s: &Stream,
        l: usize,
        block: &Block,
        input: PreActivationInput<'_>,
    ) -> Result<Tensor> {
        self.check_increments(l)?;
        // The layer as it is, its activation left for `activate`.
        let spec = super::LayerSpec {
            act: Activation::Identity,
            ..self.layers[l]
        };
        let p = &self.params[spec.first_param..];
        let a = self.args(s, &spec, block);
        let (y, _) = match (input, self.reads_transformed_only(l)) {
            (PreActivationInput::Input(x), false) => {
                self.check_layer_input(l, block, x)?;
                gcn::forward(&a, p, Cow::Borrowed(x), EVAL)?
            }
            (PreActivationInput::Transformed(z), true) => {
                if z.shape() != (block.n_in(), spec.out_dim) {
                    return Err(RuntimeError::Config(format!(
                        "layer {l} expects {}x{} transformed rows, got {:?}",
                        block.n_in(),
                        spec.out_dim,
                        z.shape()
                    )));
                }
                gcn::aggregate(&a, p, z, None, EVAL)?
            }
            _ => {
                return Err(RuntimeError::Config(format!(
                    "layer {l}: pre-activation rows from the wrong kind of input rows"
                )))
            }
        };
        Ok(y)
    }

    /// True when the last layer's output rows can be aggregated where they are read, from
    /// its transformed rows `Z`: a split GCN layer ([`Model::reads_transformed_only`]) with no activation,
    /// whose rows are `b + Σ_u Z_u / sqrt((d_u + 1)(d_v + 1))` over `u ∈ N(v) ∪ {v}`
    /// ([`crate::inference::aggregate_gcn_row`]). A service then keeps `Z` and the bias, and
    /// a graph change re-transforms the rows whose input changed instead of aggregating
    /// every row that reads them (about twenty times as many).
    pub fn last_layer_reads_transformed(&self) -> bool {
        let l = self.layers.len() - 1;
        self.reads_transformed_only(l) && self.layers[l].act == Activation::Identity
    }

    /// The last layer's bias `b` (see [`Model::last_layer_reads_transformed`]).
    pub fn last_layer_bias(&self, s: &Stream) -> Result<Vec<f32>> {
        if !self.last_layer_reads_transformed() {
            return Err(RuntimeError::Config(
                "the last layer's rows are not read from its transformed rows".into(),
            ));
        }
        let spec = self.layers[self.layers.len() - 1];
        Ok(s.download(&self.params[spec.first_param + 1].value)?)
    }

    /// `x = act(x)` with layer `l`'s activation.
    pub fn activate(&self, s: &Stream, l: usize, x: &mut Tensor) -> Result<()> {
        Ok(s.activate(self.layers[l].act, x)?)
    }
}

/// What [`Model::forward_pre_activation`] computes from.
pub enum PreActivationInput<'a> {
    /// The layer's input rows (a layer that is not split).
    Input(&'a LayerInput),
    /// The transformed rows of every input row of the block (a split layer).
    Transformed(&'a Tensor),
}
