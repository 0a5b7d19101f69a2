//! `trellis partition`.
use super::train::load_data;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use trellis_runtime::partition::{partition, PartitionMethod};
use trellis_runtime::report::peak_rss_bytes;

#[derive(Debug, Clone, Args)]
pub struct PartitionArgs {
    /// The data set (same forms as `train --data`).
    #[arg(long)]
    pub data: String,
    /// Number of partitions (1 to 4096).
    #[arg(long, value_name = "P", alias = "parts", value_parser = super::validate::partitions)]
    pub partitions: usize,
    /// How to partition: metis (few cut edges) or random.
    #[arg(long, alias = "method", default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// Seed of the partitioning (METIS and random assignment).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output folder (created): partition files and partition.json.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

pub fn run(a: PartitionArgs) -> Result<()> {
    let ds = load_data(&a.data)?;
    let book = partition(&ds, a.partitions, a.partition_method, a.seed, &a.out)?;
    println!(
        "{} parts of {} ({} nodes, {} edges) by {} in {} ms: edge cut {} ({:.1}%), balance nodes {:.3} edges {:.3} train {:.3}, peak RSS {:.1} MiB",
        book.parts,
        book.dataset,
        book.num_nodes,
        book.num_edges,
        book.method,
        book.partition_ms,
        book.edge_cut,
        100.0 * book.edge_cut as f64 / book.num_edges.max(1) as f64,
        book.balance.nodes,
        book.balance.edges,
        book.balance.train,
        peak_rss_bytes() as f64 / (1 << 20) as f64
    );
    for p in &book.partitions {
        println!(
            "  part {}: {} inner, {} halo, {} edges, {} train -> {}",
            p.part, p.inner_nodes, p.halo_nodes, p.edges, p.train_nodes, p.file
        );
    }
    println!(
        "partition book written to {}",
        a.out.join("partition.json").display()
    );
    Ok(())
}
