//! Sparse ops of the [`Stream`] API: aggregation (SpMM), per-edge scores (SDDMM, edge
//! softmax, edge dropout) and row gathers/scatters. On a GPU the matrix operands are the
//! [`Csr`]s' device copies (uploaded once per GPU, see `Csr::on_device`) and index lists are
//! uploaded per call.
use super::{check, on_gpu, EdgeWeights, SPMM_PIECE};
use crate::cpu;
use crate::stream::KernelKind;
use crate::{Csr, DropoutKey, GpuError, Result, Stream, Tensor};

impl Stream {
    /// `out = A x` with `A` a CSR matrix (rows = outputs) and `heads` column blocks of `x`.
    pub fn spmm(&self, a: &Csr, w: EdgeWeights<'_>, x: &Tensor, out: &mut Tensor) -> Result<()> {
        self.admit()?;
        check(
            "spmm",
            x.rows() == a.n_cols() && out.shape() == (a.n_rows(), x.cols()),
            || {
                format!(
                    "A {}x{}, x {}x{}, out {}x{}",
                    a.n_rows(),
                    a.n_cols(),
                    x.rows(),
                    x.cols(),
                    out.rows(),
                    out.cols()
                )
            },
        )?;
        if let EdgeWeights::PerHead(v, h) = w {
            check(
                "spmm",
                h >= 1 && v.len() == a.nnz() * h && x.cols() % h == 0,
                || {
                    format!(
                        "{} weights for {} entries x {h} heads, width {}",
                        v.len(),
                        a.nnz(),
                        x.cols()
                    )
                },
            )?;
        }
        on_gpu!(self, |g| {
            let (x, out) = (x.on_device("spmm")?, out.on_device_mut("spmm")?);
            g.spmm(&*a.on_device(g)?, w.on_device("spmm")?, x, out, false)
        });
        let (weights, heads) = match w {
            EdgeWeights::Ones => (None, 1),
            EdgeWeights::Stored => {
                let v = a
                    .values()
                    .ok_or_else(|| GpuError::shape("spmm", "matrix has no stored values"))?;
                (Some(v), 1)
            }
            EdgeWeights::PerHead(v, h) => (Some(v.host("spmm")?), h),
        };
        let (xs, w, out) = (x.host("spmm")?, x.cols(), out.host_mut("spmm")?);
        let per_row = (a.nnz() / a.n_rows().max(1) + 1) * w;
        self.run_rows(
            KernelKind::Spmm,
            a.n_rows(),
            SPMM_PIECE / per_row.max(1),
            |r| {
                let block = &mut out[r.start * w..r.end * w];
                cpu::spmm_range(a, weights, heads, xs, w, r, block)
            },
        )
    }

    /// Per-entry, per-head dot products `<a[row], b[col]>` (SDDMM), as an `nnz x heads`
    /// tensor.
    pub fn sddmm_dot(&self, csr: &Csr, heads: usize, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.admit()?;
        check(
            "sddmm_dot",
            a.rows() == csr.n_rows()
                && b.rows() == csr.n_cols()
                && a.cols() == b.cols()
                && heads >= 1
                && a.cols() % heads == 0,
            || {
                format!(
                    "csr {}x{}, a {:?}, b {:?}, heads {heads}",
                    csr.n_rows(),
                    csr.n_cols(),
                    a.shape(),
                    b.shape()
                )
            },
        )?;
        on_gpu!(self, |g| Ok(Tensor::from_device(g.sddmm_dot(
            &*csr.on_device(g)?,
            heads,
            a.on_device("sddmm_dot")?,
            b.on_device("sddmm_dot")?
        )?)));
        let mut out = vec![0.0; csr.nnz() * heads];
        let (w, a, b) = (a.cols(), a.host("sddmm_dot")?, b.host("sddmm_dot")?);
        self.run(|| cpu::sddmm_dot(csr, heads, a, b, w, &mut out));
        Tensor::from_vec(csr.nnz(), heads, out)
    }

    /// Per-entry, per-head sums `left[row] + right[col]`, as an `nnz x heads` tensor.
    pub fn sddmm_add(&self, csr: &Csr, left: &Tensor, right: &Tensor) -> Result<Tensor> {
        self.admit()?;
        let heads = left.cols();
        check(
            "sddmm_add",
            left.rows() == csr.n_rows() && right.rows() == csr.n_cols() && right.cols() == heads,
            || {
                format!(
                    "csr {}x{}, left {:?}, right {:?}",
                    csr.n_rows(),
                    csr.n_cols(),
                    left.shape(),
                    right.shape()
                )
            },
        )?;
        on_gpu!(self, |g| Ok(Tensor::from_device(g.sddmm_add(
            &*csr.on_device(g)?,
            left.on_device("sddmm_add")?,
            right.on_device("sddmm_add")?
        )?)));
        let mut out = vec![0.0; csr.nnz() * heads];
        let (l, r) = (left.host("sddmm_add")?, right.host("sddmm_add")?);
        self.run(|| cpu::sddmm_add(csr, heads, l, r, &mut out));
        Tensor::from_vec(csr.nnz(), heads, out)
    }

    /// Softmax of per-entry scores (`nnz x heads`) over each row, per head.
    pub fn edge_softmax(&self, csr: &Csr, heads: usize, scores: &Tensor) -> Result<Tensor> {
        self.admit()?;
        check("edge_softmax", scores.shape() == (csr.nnz(), heads), || {
            format!(
                "scores {:?} for {} entries x {heads}",
                scores.shape(),
                csr.nnz()
            )
        })?;
        on_gpu!(self, |g| Ok(Tensor::from_device(g.edge_softmax(
            &*csr.on_device(g)?,
            heads,
            scores.on_device("edge_softmax")?
        )?)));
        let mut out = vec![0.0; scores.len()];
        let scores = scores.host("edge_softmax")?;
        self.run(|| cpu::edge_softmax(csr, heads, scores, &mut out));
        Tensor::from_vec(csr.nnz(), heads, out)
    }

    /// Backward of [`Stream::edge_softmax`] given its output `alpha` and the output gradient.
    pub fn edge_softmax_backward(
        &self,
        csr: &Csr,
        heads: usize,
        alpha: &Tensor,
        grad: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "edge_softmax_backward";
        self.admit()?;
        check(
            OP,
            alpha.shape() == (csr.nnz(), heads) && grad.shape() == alpha.shape(),
            || format!("alpha {:?}, grad {:?}", alpha.shape(), grad.shape()),
        )?;
        on_gpu!(self, |g| Ok(Tensor::from_device(g.edge_softmax_backward(
            &*csr.on_device(g)?,
            heads,
            alpha.on_device(OP)?,
            grad.on_device(OP)?
        )?)));
        let mut out = vec![0.0; alpha.len()];
        let (alpha, grad) = (alpha.host(OP)?, grad.host(OP)?);
        self.run(|| cpu::edge_softmax_backward(csr, heads, alpha, grad, &mut out));
        Tensor::from_vec(csr.nnz(), heads, out)
    }

    /// Rows `idx` of `x` as a new tensor.
    pub fn gather_rows(&self, x: &Tensor, idx: &[u32]) -> Result<Tensor> {
        self.admit()?;
        check(
            "gather_rows",
            idx.iter().all(|&i| (i as usize) < x.rows()),
            || format!("index out of {} rows", x.rows()),
        )?;
        on_gpu!(self, |g| Ok(Tensor::from_device(g.gather_rows(
            x.on_device("gather_rows")?,
            &g.upload_ids(idx)?
        )?)));
        let mut out = Tensor::zeros(idx.len(), x.cols());
        let (w, x, o) = (x.cols(), x.host("gather_rows")?, out.as_mut_slice());
        self.run(|| cpu::gather_rows(x, w, idx, o));
        Ok(out)
    }

    /// `out[idx[r]] += src[r]`.
    pub fn scatter_add_rows(&self, src: &Tensor, idx: &[u32], out: &mut Tensor) -> Result<()> {
        check(
            "scatter_add_rows",
            src.cols() == out.cols() && src.rows() == idx.len(),
            || {
                format!(
                    "src {:?} into out {:?}, {} indices",
                    src.shape(),
                    out.shape(),
                    idx.len()
                )
            },
        )?;
        on_gpu!(self, |g| {
            self.admit()?;
            check_rows("scatter_add_rows", idx, out.rows())?;
            g.scatter_add_rows(
                src.on_device("scatter_add_rows")?,
                &g.upload_index(idx)?,
                out.on_device_mut("scatter_add_rows")?,
            )
        });
        self.scatter_add_slice(src.host("scatter_add_rows")?, idx, out)
    }

    /// `out[idx[r]] += src[r]` with `src` a host row-major slice of `idx.len()` rows (a
    /// received buffer, added without first copying it into a tensor on the CPU; uploaded on a
    /// GPU).
    pub fn scatter_add_slice(&self, src: &[f32], idx: &[u32], out: &mut Tensor) -> Result<()> {
        self.admit()?;
        let w = out.cols();
        check("scatter_add_slice", src.len() == idx.len() * w, || {
            format!(
                "{} values, {} indices, out {:?}",
                src.len(),
                idx.len(),
                out.shape()
            )
        })?;
        check_rows("scatter_add_slice", idx, out.rows())?;
        on_gpu!(self, |_g| {
            let src = self.upload(src, idx.len(), w)?;
            self.scatter_add_rows(&src, idx, out)
        });
        let out = out.host_mut("scatter_add_slice")?;
        self.run(|| cpu::scatter_add_rows(src, w, idx, out));
        Ok(())
    }

    /// Dropout of a sparse matrix's stored values, with the mask [`Stream::dropout`] applies to
    /// the dense form (rows keyed by `gids`). The matrix is a host structure on every backend:
    /// this runs on the host and drops the matrix's device copies, which the next op on a GPU
    /// uploads again.
    pub fn dropout_csr(&self, m: &mut Csr, gids: &[u32], key: DropoutKey, p: f32) -> Result<()> {
        self.admit()?;
        check(
            "dropout_csr",
            gids.len() == m.n_rows() && m.values().is_some(),
            || {
                format!(
                    "{} ids for {} rows (values stored: {})",
                    gids.len(),
                    m.n_rows(),
                    m.values().is_some()
                )
            },
        )?;
        let (indptr, indices, values) = m.parts_mut();
        let values = values.expect("checked above");
        self.run(|| cpu::dropout_csr(indptr, indices, values, gids, key, p));
        Ok(())
    }

    /// Dropout over CSR entries (`vals`: `nnz x heads`), keyed by the row's global id.
    pub fn edge_dropout(
        &self,
        csr: &Csr,
        vals: &mut Tensor,
        heads: usize,
        gids: &[u32],
        key: DropoutKey,
        p: f32,
    ) -> Result<()> {
        self.admit()?;
        check(
            "edge_dropout",
            gids.len() == csr.n_rows() && vals.shape() == (csr.nnz(), heads),
            || {
                format!(
                    "{} ids for {} rows, values {:?}",
                    gids.len(),
                    csr.n_rows(),
                    vals.shape()
                )
            },
        )?;
        on_gpu!(self, |g| g.edge_dropout(
            &*csr.on_device(g)?,
            vals.on_device_mut("edge_dropout")?,
            heads,
            &g.upload_ids(gids)?,
            key,
            p
        ));
        let vals = vals.host_mut("edge_dropout")?;
        self.run(|| cpu::edge_dropout(csr.indptr(), vals, heads, gids, key, p));
        Ok(())
    }
}

/// A shape error of `op` unless every index is below `rows`.
fn check_rows(op: &'static str, idx: &[u32], rows: usize) -> Result<()> {
    check(op, idx.iter().all(|&i| (i as usize) < rows), || {
        format!("index out of {rows} rows")
    })
}
