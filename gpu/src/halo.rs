//! Halo rows between a stream's memory and the host, for the partition actors' exchange: send
//! rows are gathered and copied out, received rows copied in, and the halo part of an
//! aggregation added once they have arrived.
//!
//! On a GPU the copies go through pinned host buffers on the stream's transfer stream
//! (`cuda::halo`), so they run while the compute stream goes on: an actor starts its sends,
//! enqueues the aggregation over its inner rows, and only then waits for the copies; received
//! rows are added after the compute stream has waited on their arrival event. On the CPU the
//! same calls copy at once.
use crate::{Csr, EdgeWeights, Result, Stream, Tensor};
use std::sync::Arc;

/// A reusable host buffer for one direction of one neighbour's halo rows (pinned on a GPU,
/// reallocated when the shape changes; nothing on the CPU).
#[derive(Debug, Default)]
pub struct HaloStaging {
    #[cfg(feature = "cuda")]
    pinned: Option<crate::cuda::halo::PinnedRows>,
    /// Rows gathered on the CPU, waiting for [`Stream::finish_rows_to_host`].
    host: Option<Arc<[f32]>>,
}

/// Halo rows received into a stream's memory (on a GPU: possibly still in flight).
#[derive(Debug)]
pub struct HaloRows(Repr);

#[derive(Debug)]
enum Repr {
    Host(Tensor),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::halo::HaloArrival),
}

impl HaloStaging {
    /// A pinned buffer of `rows x cols`, reusing the last one if it has that shape.
    #[cfg(feature = "cuda")]
    fn pinned(
        &mut self,
        g: &crate::cuda::GpuStream,
        rows: usize,
        cols: usize,
    ) -> Result<&mut crate::cuda::halo::PinnedRows> {
        let fits = matches!(&self.pinned, Some(p) if (p.rows(), p.cols()) == (rows, cols));
        if !fits {
            self.pinned = Some(g.pinned_rows(rows, cols)?);
        }
        Ok(self.pinned.as_mut().expect("set above"))
    }
}

impl Stream {
    /// Starts copying rows `idx` of `x` to the host through `staging` (on a GPU the gather and
    /// the copy are enqueued and this returns at once).
    pub fn start_rows_to_host(
        &self,
        x: &Tensor,
        idx: &[u32],
        staging: &mut HaloStaging,
    ) -> Result<()> {
        super::ops::on_gpu!(self, |g| {
            let idx_d = g.upload_ids(idx)?;
            let pinned = staging.pinned(g, idx.len(), x.cols())?;
            g.send_rows(x.on_device("start_rows_to_host")?, &idx_d, pinned)
        });
        let rows = self.gather_rows(x, idx)?;
        staging.host = Some(Arc::from(rows.into_host()?));
        Ok(())
    }

    /// The rows [`Stream::start_rows_to_host`] started, in a shared host buffer (on a GPU,
    /// after waiting for that copy only).
    pub fn finish_rows_to_host(&self, staging: &mut HaloStaging) -> Result<Arc<[f32]>> {
        super::ops::on_gpu!(self, |_g| match &staging.pinned {
            Some(p) => Ok(Arc::from(p.as_slice()?)),
            None => Err(not_started()),
        });
        staging.host.take().ok_or_else(not_started)
    }

    /// Starts copying `rows x cols` host rows into this stream's memory through `staging` (on
    /// a GPU the copy runs on the transfer stream; ops that use the rows wait for it).
    pub fn rows_from_host(
        &self,
        data: Vec<f32>,
        rows: usize,
        cols: usize,
        staging: &mut HaloStaging,
    ) -> Result<HaloRows> {
        super::ops::on_gpu!(self, |g| {
            super::ops::check("rows_from_host", data.len() == rows * cols, || {
                format!("{} values for {rows}x{cols}", data.len())
            })?;
            let pinned = staging.pinned(g, rows, cols)?;
            pinned.as_mut_slice()?.copy_from_slice(&data);
            Ok(HaloRows(Repr::Cuda(g.receive_rows(pinned)?)))
        });
        let _ = staging;
        Ok(HaloRows(Repr::Host(Tensor::from_vec(rows, cols, data)?)))
    }

    /// The received rows as a tensor, usable by every op issued on this stream from now on
    /// (on a GPU the compute stream waits on their arrival event, not the whole device).
    pub fn arrived(&self, rows: HaloRows) -> Result<Tensor> {
        match rows.0 {
            Repr::Host(t) => Ok(t),
            #[cfg(feature = "cuda")]
            Repr::Cuda(arrival) => match self.gpu() {
                Some(g) => Ok(Tensor::from_device(g.arrived(arrival)?)),
                None => Err(crate::GpuError::wrong_device(
                    "arrived",
                    self.device(),
                    "cuda",
                )),
            },
        }
    }

    /// `out += A_halo x_halo` with the received rows, once they have arrived (on a GPU the
    /// compute stream waits on their arrival event, not the whole device).
    pub fn spmm_halo_acc(
        &self,
        a_halo: &Csr,
        w: EdgeWeights<'_>,
        x_halo: &HaloRows,
        out: &mut Tensor,
    ) -> Result<()> {
        self.admit()?;
        match &x_halo.0 {
            Repr::Host(x) => {
                let mut part = self.zeros(out.rows(), out.cols())?;
                self.spmm(a_halo, w, x, &mut part)?;
                self.axpy(1.0, &part, out)
            }
            #[cfg(feature = "cuda")]
            Repr::Cuda(arrival) => {
                const OP: &str = "spmm_halo_acc";
                let g = self
                    .gpu()
                    .ok_or_else(|| crate::GpuError::wrong_device(OP, self.device(), "cuda"))?;
                if matches!(w, EdgeWeights::PerHead(..)) {
                    return Err(crate::GpuError::shape(
                        OP,
                        "per-head weights are per entry of the unsplit matrix",
                    ));
                }
                let (w, out) = (w.on_device(OP)?, out.on_device_mut(OP)?);
                g.spmm_after(&*a_halo.on_device(g)?, w, arrival, out)
            }
        }
    }
}

fn not_started() -> crate::GpuError {
    crate::GpuError::shape("finish_rows_to_host", "no copy was started on this staging")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{random_csr, random_tensor};

    #[test]
    fn rows_leave_and_arrive_through_staging() {
        let s = Stream::cpu(2).unwrap();
        let x = random_tensor(10, 3, 1);
        let mut staging = HaloStaging::default();
        assert!(
            s.finish_rows_to_host(&mut staging).is_err(),
            "nothing started"
        );
        s.start_rows_to_host(&x, &[7, 2, 2], &mut staging).unwrap();
        let got = s.finish_rows_to_host(&mut staging).unwrap();
        let want: Vec<f32> = [7, 2, 2].iter().flat_map(|&r| x.row(r).to_vec()).collect();
        assert_eq!(&got[..], &want[..]);
        assert!(s.rows_from_host(vec![0.0; 5], 2, 3, &mut staging).is_err());
    }

    #[test]
    fn the_halo_part_adds_to_the_inner_part() {
        let s = Stream::cpu(2).unwrap();
        let a = random_csr(20, 30, 5, 3).unwrap();
        let x = random_tensor(30, 4, 4);
        let mut whole = Tensor::zeros(20, 4);
        s.spmm(&a, EdgeWeights::Stored, &x, &mut whole).unwrap();
        let (inner, halo) = a.split_columns(12).unwrap();
        let mut out = Tensor::zeros(20, 4);
        let x_inner = Tensor::from_vec(12, 4, x.as_slice()[..48].to_vec()).unwrap();
        s.spmm(&inner, EdgeWeights::Stored, &x_inner, &mut out)
            .unwrap();
        let mut staging = HaloStaging::default();
        let rows = s
            .rows_from_host(x.as_slice()[48..].to_vec(), 18, 4, &mut staging)
            .unwrap();
        s.spmm_halo_acc(&halo, EdgeWeights::Stored, &rows, &mut out)
            .unwrap();
        for (g, w) in out.as_slice().iter().zip(whole.as_slice()) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()));
        }
    }
}
