//! Residual connections of hidden layers (DeepGCNs, Li et al. 2019): a layer's output adds
//! its input rows, `h_{l+1} = act(layer(h_l)) + h_l`, or `act(layer(h_l)) + h_l P` with a
//! learned `in x out` matrix `P` (`res.weight`, Glorot, no bias; PyG's `GATConv(residual=True)`
//! names its projection the same way) where the input and output widths differ.
//!
//! The residual uses the layer's input before its feature dropout, and only the block's
//! inner rows (the first `n_out` input rows): it needs no halo row, so a partitioned run
//! exchanges nothing more for it. Its backward adds `g` (or `g P^T`) to the gradient of the
//! inner input rows and accumulates `P`'s gradient `X_inner^T g`.
use super::{Init, LayerInput, LayerSpec, Model, Residual, StepCtx};
use crate::graph::Block;
use crate::{Result, RuntimeError};
use trellis_gpu::{Stream, Tensor};

/// The projection matrix of a [`Residual::Projection`] layer: `in_dim x out_width`.
pub(crate) fn param_shape(spec: &LayerSpec, out_width: usize) -> (String, usize, usize, Init) {
    ("res.weight".into(), spec.in_dim, out_width, Init::Glorot)
}

impl Model {
    /// The residual term layer `l` adds to its output rows (`None` without a residual
    /// connection), from its input `x` before dropout. In training, a projected residual
    /// keeps the inner input rows for its backward.
    pub(crate) fn residual_forward(
        &mut self,
        s: &Stream,
        l: usize,
        block: &Block,
        x: &LayerInput,
        ctx: StepCtx,
    ) -> Result<Option<Tensor>> {
        let spec = self.layers[l];
        if spec.residual == Residual::None {
            return Ok(None);
        }
        let LayerInput::Dense(xt) = x else {
            return Err(RuntimeError::Config(format!(
                "layer {l} has a residual connection but a sparse input (only hidden rows can be added)"
            )));
        };
        let n = block.n_out();
        let inner = || -> Result<Tensor> {
            let mut r = s.copy(xt)?;
            r.truncate_rows(n);
            Ok(r)
        };
        match spec.residual {
            Residual::None => Ok(None),
            Residual::Identity => Ok(Some(inner()?)),
            Residual::Projection => {
                let p = &self.params[spec.residual_param].value;
                let mut r = s.zeros(n, p.cols())?;
                s.gemm_prefix(1.0, xt, n, false, p, false, 0.0, &mut r)?;
                if ctx.train {
                    self.residual_inputs[l] = Some(inner()?);
                }
                Ok(Some(r))
            }
        }
    }

    /// Backward of layer `l`'s residual connection given the gradient `g` of its output
    /// rows: accumulates the projection's gradient and returns the gradient of the inner
    /// input rows through the residual (`None` without a connection or an input gradient).
    pub(crate) fn residual_backward(
        &mut self,
        s: &Stream,
        l: usize,
        g: &Tensor,
        need_input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let spec = self.layers[l];
        match spec.residual {
            Residual::None => Ok(None),
            Residual::Identity => Ok(if need_input_grad {
                Some(s.copy(g)?)
            } else {
                None
            }),
            Residual::Projection => {
                let x = self.residual_inputs[l].take().ok_or_else(|| {
                    RuntimeError::Config(format!(
                        "backward of layer {l}'s residual without a training forward"
                    ))
                })?;
                let p = &mut self.params[spec.residual_param];
                s.gemm(1.0, &x, true, g, false, 1.0, &mut p.grad)?;
                if !need_input_grad {
                    return Ok(None);
                }
                Ok(Some(s.matmul(g, false, &p.value, true)?))
            }
        }
    }
}
