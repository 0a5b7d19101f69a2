//! Optimizers over a model's parameters. Every replica applies the same step to the same
//! all-reduced gradients, so replicas stay bit-identical.
use super::Model;
use crate::Result;
use trellis_gpu::{AdamConfig, SgdConfig, Stream, Tensor};

/// Which optimizer, with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    Adam(AdamConfig),
    Sgd(SgdConfig),
}

/// Optimizer state: the step count and two moment buffers per parameter (SGD uses the first).
#[derive(Debug, Clone)]
pub struct Optimizer {
    kind: OptimizerKind,
    t: u64,
    state: Vec<(Tensor, Tensor)>,
}

impl Optimizer {
    /// Fresh state for `model`'s parameters.
    pub fn new(kind: OptimizerKind, model: &Model) -> Self {
        let state = model
            .params()
            .iter()
            .map(|p| {
                let (r, c) = p.value.shape();
                let second = if matches!(kind, OptimizerKind::Adam(_)) {
                    Tensor::zeros(r, c)
                } else {
                    Tensor::zeros(0, 0)
                };
                (Tensor::zeros(r, c), second)
            })
            .collect();
        Optimizer { kind, t: 0, state }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// The moment buffers, in parameter order.
    pub fn state(&self) -> &[(Tensor, Tensor)] {
        &self.state
    }

    /// Replaces the step count and moment buffers (restoring a replica).
    pub fn restore(&mut self, steps: u64, state: Vec<(Tensor, Tensor)>) {
        self.t = steps;
        self.state = state;
    }

    /// Applies one step with the gradients currently held by the model (the state moves into
    /// `s`'s memory first if it is not there: fresh or restored state is built on the host).
    pub fn step(&mut self, s: &Stream, model: &mut Model) -> Result<()> {
        for (m, v) in &mut self.state {
            s.place_in(m)?;
            s.place_in(v)?;
        }
        self.t += 1;
        for (p, (m, v)) in model.params_mut().iter_mut().zip(self.state.iter_mut()) {
            match &self.kind {
                OptimizerKind::Adam(cfg) => {
                    s.adam_step(cfg, self.t, &mut p.value, &p.grad, m, v)?
                }
                OptimizerKind::Sgd(cfg) => s.sgd_step(cfg, &mut p.value, &p.grad, m)?,
            }
        }
        Ok(())
    }
}
