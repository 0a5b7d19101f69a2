//! `trellis bench partitions`: the overhead of P partition actors over one process, measured
//! side by side in one run. The single-process trainer's epochs and the P-partition
//! topology's epochs alternate (same configuration and seed), then the medians of their
//! training steps, their ratio, and where the partitioned step's time went are printed.
use super::train::load_data;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::sync::mpsc;
use trellis_actors::{EpochProfile, RunEvent, Topology};
use trellis_gpu::KernelTimes;
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::report::median;
use trellis_runtime::{ModelKind, TrainConfig, Trainer};
use trellis_transport::Phase;

#[derive(Debug, Clone, Args)]
pub struct PartitionsArgs {
    /// The data set.
    #[arg(
        long,
        default_value = "synthetic:nodes=100000,degree=20,features=128,classes=16,seed=0"
    )]
    pub data: String,
    /// Number of partitions compared with one process.
    #[arg(long, value_name = "P", alias = "parts", default_value_t = 4, value_parser = super::validate::partitions)]
    pub partitions: usize,
    /// How to partition: metis (few cut edges) or random.
    #[arg(long, default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// The architecture: gcn, sage or gat (paper settings but --hidden).
    #[arg(long, default_value = "gcn")]
    pub model: ModelKind,
    /// Hidden layer width, or one per hidden layer (comma separated).
    #[arg(long, default_value = "256", value_parser = super::shape::hidden_widths)]
    pub hidden: super::shape::HiddenWidths,
    #[command(flatten)]
    pub shape: super::shape::ShapeArgs,
    /// Epochs of each (they alternate); the first is a warm-up for both.
    #[arg(long, default_value_t = 5, value_parser = super::validate::positive_u32)]
    pub epochs: u32,
    /// CPU threads for kernels (0 = one per CPU).
    #[arg(long, default_value_t = 0, value_parser = super::validate::threads)]
    pub threads: usize,
    /// Reuse (or create) the partition files here instead of a temporary folder.
    #[arg(long)]
    pub partition_dir: Option<std::path::PathBuf>,
}

/// One epoch of one side.
struct Sample {
    /// Training step wall time, ms.
    ms: f64,
    /// Process CPU time of the whole epoch (training step and evaluation), ms.
    cpu_ms: f64,
}

pub fn run(a: PartitionsArgs) -> Result<()> {
    if a.partitions < 2 {
        bail!("--partitions must be at least 2 (it is compared with one process)");
    }
    if a.epochs < 2 {
        bail!("--epochs must be at least 2 (the first is a warm-up)");
    }
    let ds = load_data(&a.data)?;
    let name = ds.name.clone();
    let n = ds.num_nodes;
    let mut cfg = TrainConfig::paper_defaults(a.model, ds.num_features, ds.num_classes, 0);
    a.shape.apply(&mut cfg.model, Some(&a.hidden))?;
    cfg.epochs = a.epochs;
    cfg.threads = a.threads;
    let topo = Topology::partition(
        &ds,
        a.partitions,
        a.partition_method,
        a.partition_dir.as_deref(),
        cfg.clone(),
    )
    .context("cannot partition the data")?;
    let book = topo.book().clone();
    let mut single = Trainer::from_dataset(ds, cfg)?;
    let (gate, gate_rx) = mpsc::channel();
    let run = topo.with_epoch_gate(gate_rx).spawn()?;

    let mut ones = Vec::new();
    let mut many = Vec::new();
    let mut one_kernels = Vec::new();
    let mut profiles = Vec::new();
    for epoch in 1..=a.epochs {
        // Alternate which side goes first, so neither always follows the other.
        for side in if epoch % 2 == 1 { [0, 1] } else { [1, 0] } {
            let cpu0 = process_cpu_ms();
            if side == 0 {
                let k0 = single.stream().kernel_times();
                let (_, ms) = single.train_step(epoch)?;
                one_kernels.push(single.stream().kernel_times().since(&k0));
                single.evaluate(epoch)?;
                let cpu_ms = process_cpu_ms() - cpu0;
                ones.push(Sample { ms, cpu_ms });
            } else {
                gate.send(()).context("the partitioned run stopped early")?;
                let (ms, profile) = next_epoch(&run)?;
                let cpu_ms = process_cpu_ms() - cpu0;
                many.push(Sample { ms, cpu_ms });
                profiles.push(profile);
            }
        }
    }
    drop(gate);
    run.wait()?;

    // Medians without the warm-up epoch.
    let med =
        |v: &[Sample], f: fn(&Sample) -> f64| median(&v[1..].iter().map(f).collect::<Vec<_>>());
    let (t1, tp) = (med(&ones, |s| s.ms), med(&many, |s| s.ms));
    let (c1, cp) = (med(&ones, |s| s.cpu_ms), med(&many, |s| s.cpu_ms));
    let p = a.partitions;
    println!(
        "data       {name} ({n} nodes), {} {} layers{} hidden {}",
        a.model,
        a.shape.layers.unwrap_or(2),
        if a.shape.residual { " residual" } else { "" },
        a.hidden
    );
    println!(
        "partitions {p} (METIS): edge cut {} of {} edges; inner/halo nodes per part: {}",
        book.edge_cut,
        book.num_edges,
        book.partitions
            .iter()
            .map(|q| format!("{}/{}", q.inner_nodes, q.halo_nodes))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "threads    {}; {} epochs each, alternated in this process, medians without the first",
        single.stream().threads(),
        a.epochs
    );
    let k1 = median_kernels(&one_kernels[1..]);
    println!(
        "P=1        {t1:>9.2} ms per training step   CPU {c1:>9.1} ms per epoch (step + eval)   kernels: gemm {:.1}, spmm {:.1}, other {:.1} ms",
        k1.gemm_ms, k1.spmm_ms, k1.other_ms
    );
    println!("P={p:<9}{tp:>9.2} ms per training step   CPU {cp:>9.1} ms per epoch (step + eval)",);
    println!("ratio      {:.2}x (P={p} over P=1)", tp / t1.max(1e-9));
    let prof = median_profile(&profiles[1..], &many[1..]);
    print_breakdown(prof, tp);
    Ok(())
}

/// Waits for the next epoch of the run: its training step time and profile.
fn next_epoch(run: &trellis_actors::TrainingRun) -> Result<(f64, EpochProfile)> {
    let mut profile = None;
    for ev in run.events() {
        match ev {
            RunEvent::Profile(p) => profile = Some(p),
            RunEvent::Epoch(log) => {
                let p = profile.context("an epoch without its profile")?;
                return Ok((log.ms, p));
            }
            RunEvent::Recovered(_) => {}
        }
    }
    bail!("the partitioned run ended early")
}

/// Element-wise medians of kernel times.
fn median_kernels(v: &[KernelTimes]) -> KernelTimes {
    let m = |f: fn(&KernelTimes) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    KernelTimes {
        gemm_ms: m(|k| k.gemm_ms),
        spmm_ms: m(|k| k.spmm_ms),
        other_ms: m(|k| k.other_ms),
    }
}

/// The profile of the epoch whose training step took the median time.
fn median_profile<'a>(profiles: &'a [EpochProfile], samples: &[Sample]) -> &'a EpochProfile {
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by(|&x, &y| samples[x].ms.total_cmp(&samples[y].ms));
    &profiles[order[order.len() / 2]]
}

fn print_breakdown(prof: &EpochProfile, step_ms: f64) {
    println!(
        "where the P-partition step goes (epoch {}; compute and kernels summed over partitions, which share the threads):",
        prof.epoch
    );
    println!(
        "  {:<12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "step", "wall", "max part", "wait", "gemm", "spmm", "other", "outside", "halo MiB"
    );
    let mut total = KernelTimes::default();
    let mut outside_total = 0.0;
    let mut wall_total = 0.0;
    for s in &prof.steps {
        let k = s.kernels_total();
        let compute: f64 = s.compute_ms.iter().sum();
        let outside = (compute - k.total_ms()).max(0.0);
        let phase = match s.phase {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Eval => "eval",
        };
        println!(
            "  {:<12} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.1}",
            format!("{phase} {}", s.layer),
            s.wall_ms,
            s.max_compute_ms(),
            (s.wall_ms - s.max_compute_ms()).max(0.0),
            k.gemm_ms,
            k.spmm_ms,
            k.other_ms,
            outside,
            s.halo_bytes as f64 / (1 << 20) as f64
        );
        total.add(&k);
        outside_total += outside;
        wall_total += s.wall_ms;
    }
    println!(
        "  {:<12} {:>9.1}   (gradient all-reduce and optimizer step on every partition)",
        "apply", prof.apply_ms
    );
    println!(
        "  total: steps {wall_total:.1} ms + apply {:.1} ms of a {step_ms:.1} ms step; kernels gemm {:.1}, spmm {:.1}, other {:.1} ms, outside kernels {outside_total:.1} ms; halo {:.1} MiB per training step",
        prof.apply_ms,
        total.gemm_ms,
        total.spmm_ms,
        total.other_ms,
        prof.halo_bytes() as f64 / (1 << 20) as f64
    );
}

/// CPU time (user + system) this process has used, ms.
fn process_cpu_ms() -> f64 {
    // SAFETY: an all-zero `rusage` is a valid value (integers only); getrusage only writes
    // into the struct it is given.
    let (rc, u) = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        let rc = libc::getrusage(libc::RUSAGE_SELF, &mut u);
        (rc, u)
    };
    if rc != 0 {
        return f64::NAN;
    }
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(u.ru_utime) + ms(u.ru_stime)
}
