//! Times partitioning and reports peak memory (VmHWM).
//!
//! `cargo run --release -p trellis-runtime --example partition_bench -- [DATA] [PARTS] [METHOD] [OUT]`
//! (defaults: the 1M-node synthetic graph, 4 parts, metis, a temporary folder). Prints one
//! JSON line per phase; the last holds the partition book's summary.
use std::time::Instant;
use trellis_runtime::partition::{assign, block, write_partitions, PartitionMethod, PartitionSet};
use trellis_runtime::{Aggregation, DataSource, Graph};

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN);
    kib / 1024.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let data = args.first().map_or(
        "synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0",
        |s| s,
    );
    let parts: usize = args.get(1).map_or(Ok(4), |s| s.parse())?;
    let method: PartitionMethod = args.get(2).map_or("metis", |s| s).parse()?;
    let tmp = tempfile::tempdir()?;
    let out = args
        .get(3)
        .map_or(tmp.path().to_path_buf(), std::path::PathBuf::from);
    let phase = |name: &str, t: Instant| {
        println!(
            "{{\"phase\":\"{name}\",\"seconds\":{:.3},\"peak_rss_mib\":{:.1}}}",
            t.elapsed().as_secs_f64(),
            peak_rss_mib()
        )
    };
    let t = Instant::now();
    let ds = DataSource::parse(data)?.load()?;
    phase("load", t);
    let t = Instant::now();
    let graph = Graph::from_dataset(&ds)?;
    phase("graph", t);
    let t = Instant::now();
    let assignment = assign(&graph, &ds, parts, method, 0)?;
    phase("assign", t);
    let t = Instant::now();
    let book = write_partitions(&ds, &graph, &assignment, parts, method, 0, &out)?;
    phase("write", t);
    // Peak of partitioning itself; mapping and hashing the parts below adds file-backed pages.
    let partition_peak = peak_rss_mib();
    drop((graph, assignment, ds));
    let t = Instant::now();
    let set = PartitionSet::open(&out)?;
    let files = (0..parts)
        .map(|p| set.open_part(p))
        .collect::<Result<Vec<_>, _>>()?;
    phase("open_all_checked", t);
    let t = Instant::now();
    let b = block(&files[0], Aggregation::GcnNorm)?;
    phase("block_part0", t);
    assert_eq!(b.n_out(), files[0].inner().len());
    let bytes: u64 = book.partitions.iter().map(|p| p.file_bytes).sum();
    println!(
        "{{\"data\":\"{data}\",\"method\":\"{method}\",\"parts\":{parts},\"nodes\":{},\"edges\":{},\"edge_cut\":{},\"cut_fraction\":{:.4},\"balance\":{},\"halo_nodes\":{:?},\"file_mib\":{:.1},\"partition_peak_rss_mib\":{:.1}}}",
        book.num_nodes,
        book.num_edges,
        book.edge_cut,
        book.edge_cut as f64 / book.num_edges.max(1) as f64,
        serde_json::to_string(&book.balance)?,
        book.partitions.iter().map(|p| p.halo_nodes).collect::<Vec<_>>(),
        bytes as f64 / (1 << 20) as f64,
        partition_peak
    );
    Ok(())
}
