//! The input rows of a layer: a dense tensor, or a sparse matrix for sparse features
//! (bag-of-words data such as Cora is ~1% non-zero, where sparse products and dropout over the
//! stored values alone are many times faster than their dense forms, with the same results up
//! to summation order).
use super::{LayerSpec, StepCtx};
use crate::graph::Block;
use crate::Result;
use std::borrow::Cow;
use trellis_gpu::{Csr, CsrTranspose, EdgeWeights, Stream, Tensor};

/// Features below this density are held sparse.
const SPARSE_DENSITY: f64 = 0.1;

/// A layer's input rows (one per input row of the block).
#[derive(Debug, Clone)]
pub enum LayerInput {
    Dense(Tensor),
    Sparse(SparseRows),
}

/// A sparse row-major matrix with its transpose's structure.
#[derive(Debug, Clone)]
pub struct SparseRows {
    m: Csr,
    t: CsrTranspose,
}

impl From<Tensor> for LayerInput {
    fn from(t: Tensor) -> Self {
        LayerInput::Dense(t)
    }
}

impl LayerInput {
    /// Holds the host rows `x` sparse if fewer than 10% of its values are non-zero, else
    /// dense, in `s`'s memory (a sparse matrix stays a host structure: ops on a GPU use its
    /// device copy).
    pub fn auto(s: &Stream, x: Tensor) -> Result<Self> {
        let values = x.host("LayerInput::auto")?;
        let nnz = values.iter().filter(|&&v| v != 0.0).count();
        if x.is_empty() || (nnz as f64) >= SPARSE_DENSITY * x.len() as f64 {
            return Ok(LayerInput::Dense(s.place(x)?));
        }
        let m = Csr::from_dense(x.rows(), x.cols(), values)?;
        let t = m.transpose();
        Ok(LayerInput::Sparse(SparseRows { m, t }))
    }

    /// The density test of [`LayerInput::auto`]: whether `values` would be held sparse.
    pub fn would_be_sparse(values: &[f32]) -> bool {
        let nnz = values.iter().filter(|&&v| v != 0.0).count();
        !values.is_empty() && (nnz as f64) < SPARSE_DENSITY * values.len() as f64
    }

    /// Holds the host rows `x` sparse or dense as `sparse` says, whatever their own density:
    /// inference over a subset of rows keeps the layout chosen for the whole matrix, so each
    /// row is computed by the same kernel (and to the same bits) in every subset.
    pub fn with_layout(s: &Stream, x: Tensor, sparse: bool) -> Result<Self> {
        if !sparse {
            return Ok(LayerInput::Dense(s.place(x)?));
        }
        let m = Csr::from_dense(x.rows(), x.cols(), x.host("LayerInput::with_layout")?)?;
        let t = m.transpose();
        Ok(LayerInput::Sparse(SparseRows { m, t }))
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        match self {
            LayerInput::Dense(t) => t.rows(),
            LayerInput::Sparse(s) => s.m.n_rows(),
        }
    }
    /// Width.
    pub fn cols(&self) -> usize {
        match self {
            LayerInput::Dense(t) => t.cols(),
            LayerInput::Sparse(s) => s.m.n_cols(),
        }
    }
    /// True if held sparse.
    pub fn is_sparse(&self) -> bool {
        matches!(self, LayerInput::Sparse(_))
    }

    /// The rows after the layer's feature dropout: in place when `x` is owned, on a copy when
    /// it is borrowed, and `x` itself when no dropout applies.
    pub(crate) fn dropped<'a>(
        x: Cow<'a, LayerInput>,
        s: &Stream,
        spec: &LayerSpec,
        seed: u64,
        block: &Block,
        ctx: StepCtx,
    ) -> Result<Cow<'a, LayerInput>> {
        if !ctx.train || spec.dropout <= 0.0 {
            return Ok(x);
        }
        let key = spec.dropout_key(seed, ctx.epoch, 0);
        if let Cow::Borrowed(LayerInput::Dense(t)) = x {
            // One parallel pass straight into new rows (not zeroed first), instead of a copy
            // then dropout.
            let out = s.dropout_copy(t, block.gids(), key, spec.dropout)?;
            return Ok(Cow::Owned(LayerInput::Dense(out)));
        }
        let mut out = x.into_owned();
        match &mut out {
            LayerInput::Dense(t) => s.dropout(t, block.gids(), key, spec.dropout)?,
            LayerInput::Sparse(sp) => s.dropout_csr(&mut sp.m, block.gids(), key, spec.dropout)?,
        }
        Ok(Cow::Owned(out))
    }

    /// `X W`.
    pub(crate) fn matmul(&self, s: &Stream, w: &Tensor) -> Result<Tensor> {
        match self {
            LayerInput::Dense(x) => Ok(s.matmul(x, false, w, false)?),
            LayerInput::Sparse(sp) => {
                let mut out = s.zeros(sp.m.n_rows(), w.cols())?;
                s.spmm(&sp.m, EdgeWeights::Stored, w, &mut out)?;
                Ok(out)
            }
        }
    }

    /// `out += X[..n] W` (the first `n` rows).
    pub(crate) fn matmul_prefix_acc(
        &self,
        s: &Stream,
        n: usize,
        w: &Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        match self {
            LayerInput::Dense(x) => Ok(s.gemm_prefix(1.0, x, n, false, w, false, 1.0, out)?),
            LayerInput::Sparse(_) => {
                let mut full = self.matmul(s, w)?;
                full.truncate_rows(n);
                Ok(s.add_rows_prefix(&full, out)?)
            }
        }
    }

    /// `gw += X[..g.rows()]^T g`.
    pub(crate) fn t_matmul_acc(&self, s: &Stream, g: &Tensor, gw: &mut Tensor) -> Result<()> {
        match self {
            LayerInput::Dense(x) => Ok(s.gemm_prefix(1.0, x, g.rows(), true, g, false, 1.0, gw)?),
            LayerInput::Sparse(sp) => {
                // X^T has X's transposed structure; its values follow the (dropped) values of X.
                let vals = sp.m.values().expect("sparse inputs store values");
                let tv: Vec<f32> = sp.t.perm.iter().map(|&e| vals[e as usize]).collect();
                let tv = s.upload_vec(tv, sp.t.csr.nnz(), 1)?;
                let padded;
                let g_full = if g.rows() == sp.m.n_rows() {
                    g
                } else {
                    let mut p = s.zeros(sp.m.n_rows(), g.cols())?;
                    s.add_rows_prefix(g, &mut p)?;
                    padded = p;
                    &padded
                };
                let mut prod = s.zeros(sp.m.n_cols(), g.cols())?;
                s.spmm(&sp.t.csr, EdgeWeights::PerHead(&tv, 1), g_full, &mut prod)?;
                Ok(s.axpy(1.0, &prod, gw)?)
            }
        }
    }
}
