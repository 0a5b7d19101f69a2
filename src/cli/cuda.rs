//! `trellis train --device cuda`: single-process GCN on one CUDA stream ([`crate::gpu_gcn`]).
use super::train::{load_data, TrainArgs};
use crate::gpu_gcn::GpuGcn;
use anyhow::{ensure, Result};
use trellis_gpu::Device;
use trellis_runtime::ModelKind;

/// Trains as `a` asks on `device` (a CUDA device that passed its availability check) and
/// prints one summary line; `--report` is not written for CUDA runs yet.
pub fn train(a: &TrainArgs, device: Device) -> Result<()> {
    let Device::Cuda(ordinal) = device else {
        anyhow::bail!("{device} is not a CUDA device");
    };
    ensure!(
        a.model == ModelKind::Gcn && a.partitions <= 1 && a.partition_dir.is_none(),
        "on CUDA, only single-process GCN runs yet (partition actors and the other models run \
         on host tensors; see ARCHITECTURE.md, \"CUDA backend\")"
    );
    ensure!(
        a.chaos.is_none() && a.report.is_none(),
        "--chaos and --report are CPU-only yet"
    );
    let ds = load_data(&a.data)?;
    let cfg = a.config(&ds)?;
    let epochs = cfg.epochs;
    let mut gcn = GpuGcn::new(&ds, cfg, ordinal)?;
    let (mut best_val, mut best) = (f64::NEG_INFINITY, None);
    let mut ms = Vec::with_capacity(epochs as usize);
    for epoch in 1..=epochs {
        let e = gcn.epoch(epoch)?;
        ensure!(
            e.loss.is_finite(),
            "training diverged: loss {} at epoch {epoch}",
            e.loss
        );
        if a.verbose {
            println!(
                "epoch {:>4}  loss {:.4}  train {:.3}  val {:.3}  test {:.3}  {:.2} ms",
                e.epoch, e.loss, e.train_acc, e.val_acc, e.test_acc, e.ms
            );
        }
        if e.val_acc > best_val {
            best_val = e.val_acc;
            best = Some(e);
        }
        ms.push(e.ms);
    }
    ms.sort_by(f64::total_cmp);
    let median = ms.get(ms.len() / 2).copied().unwrap_or(0.0);
    if let Some(b) = best {
        println!(
            "gcn on {} ({} on {}): test accuracy {:.2}% at best validation epoch {} (val {:.2}%), \
             median epoch {:.2} ms\nweights_digest {}",
            ds.name,
            device,
            gcn.device_name(),
            100.0 * b.test_acc,
            b.epoch,
            100.0 * b.val_acc,
            median,
            gcn.weights_digest()?
        );
    }
    Ok(())
}
