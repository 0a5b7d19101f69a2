//! `trellis bench`: epoch time next to the kernels' achieved bandwidth and this machine's
//! measured memory bandwidth (a STREAM triad), all in one run.
use super::train::{load_data, train_single};
use anyhow::Result;
use clap::Args;
use trellis_gpu::{bench, EdgeWeights, Stream};
use trellis_runtime::{Aggregation, Block, Graph, ModelKind, TrainConfig};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// `transport`: QUIC vs TLS-over-TCP vs plain TCP on loopback; `partitions`: P partition
    /// actors vs one process. Without one: the compute bench.
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    /// The data set to time an epoch on.
    #[arg(
        long,
        default_value = "synthetic:nodes=100000,degree=20,features=128,classes=16,seed=0"
    )]
    pub data: String,
    /// The architecture timed: gcn, sage or gat (paper settings but --hidden).
    #[arg(long, default_value = "gcn")]
    pub model: ModelKind,
    /// Hidden layer width, or one per hidden layer (comma separated).
    #[arg(long, default_value = "256", value_parser = super::shape::hidden_widths)]
    pub hidden: super::shape::HiddenWidths,
    #[command(flatten)]
    pub shape: super::shape::ShapeArgs,
    /// Epochs timed.
    #[arg(long, default_value_t = 5, value_parser = super::validate::positive_u32)]
    pub epochs: u32,
    /// CPU threads for kernels (0 = one per CPU).
    #[arg(long, default_value_t = 0, value_parser = super::validate::threads)]
    pub threads: usize,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchWhat {
    /// Bulk transfer of halo-sized blocks (1-64 MiB): QUIC vs TLS over TCP vs plain TCP.
    Transport,
    /// Replication overhead and recovery times (panic, node SIGKILL) on a local cluster.
    Recovery(super::bench_recovery::RecoveryBenchArgs),
    /// P partition actors vs one process, epochs alternated in one run: times, ratio, and
    /// where the partitioned step's time goes.
    Partitions(super::bench_partitions::PartitionsArgs),
    /// Communication cost: node processes on an emulated rate-limited network (default
    /// 1 Gbit/s) per configuration, beside the exact run on loopback; halo and link bytes,
    /// epoch time, accuracy. Needs root (network namespaces).
    Comm(super::bench_comm::CommBenchArgs),
    /// The serving service under open-loop Poisson load over HTTP: latency quantiles and
    /// achieved rates of existing-node predictions and new-node inductive queries.
    Serve(super::bench_serve::ServeBenchArgs),
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(BenchWhat::Recovery(r)) = a.what {
        return super::bench_recovery::run(r);
    }
    if let Some(BenchWhat::Serve(s)) = a.what {
        return super::bench_serve::run(s);
    }
    if let Some(BenchWhat::Comm(c)) = a.what {
        return super::bench_comm::run(c);
    }
    if let Some(BenchWhat::Partitions(p)) = a.what {
        return super::bench_partitions::run(p);
    }
    if let Some(BenchWhat::Transport) = a.what {
        use trellis_transport::bench::{
            bench_throughput, format_table, BenchOptions, DEFAULT_SIZES,
        };
        let rows = bench_throughput(&DEFAULT_SIZES, &BenchOptions::default())?;
        print!("{}", format_table(&rows));
        return Ok(());
    }
    let ds = load_data(&a.data)?;
    let stream = Stream::cpu(a.threads)?;
    let triad = bench::triad_bandwidth_gbs(256 << 20, stream.budget());
    let (spmm, n, nnz) = {
        let graph = Graph::from_dataset(&ds)?;
        let block = Block::full(&graph, Aggregation::GcnNorm)?;
        let x = bench::random_tensor(block.n_in(), a.hidden.first(), 1);
        (
            bench::spmm_gbs(&stream, block.adj(), EdgeWeights::Stored, &x)?,
            block.n_in(),
            block.adj().nnz(),
        )
    };
    let name = ds.name.clone();
    let mut cfg = TrainConfig::paper_defaults(a.model, ds.num_features, ds.num_classes, 0);
    a.shape.apply(&mut cfg.model, Some(&a.hidden))?;
    cfg.epochs = a.epochs;
    cfg.threads = a.threads;
    let report = train_single(ds, cfg, false)?;
    println!("data            {name} ({n} nodes, {nnz} adjacency entries with self loops)");
    println!("threads         {}", stream.threads());
    println!("memory (triad)  {triad:.1} GB/s   <- the physical limit on this machine");
    println!(
        "SpMM width {:<4} {spmm:.1} GB/s   ({:.0}% of triad)",
        a.hidden.first(),
        100.0 * spmm / triad
    );
    println!(
        "{} step        {:.1} ms median over {} training steps ({} layers{}, hidden {}), peak RSS {:.1} MiB",
        a.model,
        report.step_ms_median,
        a.epochs,
        a.shape.layers.unwrap_or(2),
        if a.shape.residual { ", residual" } else { "" },
        a.hidden,
        report.peak_rss_bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
