//! GPU benchmark (feature `cuda`; run by `scripts/gpu-check.sh`): SpMM's achieved bandwidth
//! against the card's, GEMM TFLOP/s, one stream against four (each on its own thread), and GCN
//! training steps on Cora and on the 1M-node synthetic graph with the trainer (one stream) and
//! with 4 partition actors (one stream each), all on `cuda:0`.
//!
//! `cargo run --release --features cuda --example gpu_bench -- [--cora DIR] [--nodes N]`
use std::time::Instant;
use trellis::actors::Topology;
use trellis::gpu::bench::{random_csr, random_tensor, spmm_bytes};
use trellis::gpu::cuda::{DeviceTensor, DeviceWeights, GpuStream};
use trellis::gpu::{Csr, Device, EdgeWeights};
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::{DataSource, ModelKind, RunReport, TrainConfig, Trainer};

type Result<T> = anyhow::Result<T>;

/// Median seconds of `reps` runs of `f`, each waited for on the device.
fn time(s: &GpuStream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    s.synchronize()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        s.synchronize()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Rows `a..b` of `m` as a matrix over the same columns.
fn row_range(m: &Csr, a: usize, b: usize) -> Result<Csr> {
    let ip = m.indptr();
    let indptr: Vec<usize> = ip[a..=b].iter().map(|&p| p - ip[a]).collect();
    let vals = m.values().map(|v| v[ip[a]..ip[b]].to_vec());
    Ok(Csr::new(
        b - a,
        m.n_cols(),
        indptr,
        m.indices()[ip[a]..ip[b]].to_vec(),
        vals,
    )?)
}

fn upload(s: &GpuStream, t: &trellis::gpu::Tensor) -> Result<DeviceTensor> {
    Ok(s.upload(t.as_slice(), t.rows(), t.cols())?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let nodes: usize = arg("--nodes").map_or(Ok(1_000_000), |v| v.parse())?;
    let s = GpuStream::new(0)?;
    let dev = s.device().clone();
    let (peak, copy) = bandwidths(&s)?;
    println!(
        "device: {} ({:.1} GiB); memory bandwidth: {peak:.0} GB/s peak (attributes), \
         {copy:.0} GB/s device-to-device copy",
        dev.name(),
        dev.total_memory()? as f64 / (1u64 << 30) as f64
    );

    // SpMM, width 256, stored weights, on an n-node graph of average degree 20.
    let width = 256;
    let csr = random_csr(nodes, nodes, 20, 1)?;
    let x = random_tensor(nodes, width, 2);
    let (dcsr, dx) = (s.upload_csr(&csr)?, upload(&s, &x)?);
    let mut out = s.zeros(nodes, width)?;
    let secs = time(&s, 10, || {
        Ok(s.spmm(&dcsr, DeviceWeights::Stored, &dx, &mut out, false)?)
    })?;
    let bytes = spmm_bytes(&csr, &EdgeWeights::Stored, width) as f64;
    println!(
        "spmm {nodes} rows x 20 entries x {width} wide: {:.2} ms, {:.0} GB/s ({:.0}% of copy, {:.0}% of peak)",
        secs * 1e3,
        bytes / secs / 1e9,
        100.0 * bytes / secs / 1e9 / copy,
        100.0 * bytes / secs / 1e9 / peak
    );

    // GEMM: square, and the GCN's 1M x 128 x 256 transform.
    for (m, k, n) in [(8192, 8192, 8192), (nodes, 128, 256)] {
        let (a, b) = (random_tensor(m, k, 3), random_tensor(k, n, 4));
        let (da, db) = (upload(&s, &a)?, upload(&s, &b)?);
        let mut c = s.zeros(m, n)?;
        let secs = time(&s, 5, || {
            Ok(s.gemm(1.0, &da, false, &db, false, 0.0, &mut c)?)
        })?;
        println!(
            "sgemm {m}x{k} * {k}x{n}: {:.2} ms, {:.1} TFLOP/s",
            secs * 1e3,
            2.0 * (m * n * k) as f64 / secs / 1e12
        );
    }

    // One stream against four, each on its own thread with a quarter of the rows.
    let parts = 4;
    let bounds: Vec<usize> = (0..=parts).map(|p| p * nodes / parts).collect();
    let one = secs;
    let four = std::thread::scope(|sc| -> Result<f64> {
        let handles: Vec<_> = (0..parts)
            .map(|p| {
                let (csr, x, bounds) = (&csr, &x, &bounds);
                sc.spawn(move || -> Result<f64> {
                    let s = GpuStream::new(0)?;
                    let part = s.upload_csr(&row_range(csr, bounds[p], bounds[p + 1])?)?;
                    let dx = upload(&s, x)?;
                    let mut out = s.zeros(part.n_rows(), width)?;
                    time(&s, 10, || {
                        Ok(s.spmm(&part, DeviceWeights::Stored, &dx, &mut out, false)?)
                    })
                })
            })
            .collect();
        let mut worst: f64 = 0.0;
        for h in handles {
            worst = worst.max(h.join().expect("bench thread panicked")?);
        }
        Ok(worst)
    })?;
    println!(
        "spmm, 1 stream: {:.2} ms; 4 streams (4 threads, a quarter of the rows each): {:.2} ms \
         (slowest stream)",
        one * 1e3,
        four * 1e3
    );
    drop((dcsr, dx, out));

    // GCN training steps: Cora (paper settings) and the synthetic graph (hidden 256), on one
    // stream and on four partition actors.
    if let Some(dir) = arg("--cora") {
        gcn_epochs(&dir, 16, 50)?;
    }
    gcn_epochs(
        &format!("synthetic:nodes={nodes},degree=20,features=128,classes=16"),
        256,
        5,
    )?;
    Ok(())
}

/// Peak bandwidth from the device attributes and a measured device-to-device copy, GB/s.
fn bandwidths(s: &GpuStream) -> Result<(f64, f64)> {
    let peak = s.device().peak_bandwidth_gbs()?;
    let n = 1 << 28; // 1 GiB of f32
    let src = s.zeros(n, 1)?;
    let secs = time(s, 5, || {
        drop(s.clone_tensor(&src)?);
        Ok(())
    })?;
    Ok((peak, 2.0 * (n * 4) as f64 / secs / 1e9))
}

/// Median training step of GCN on `data` on `cuda:0`: the trainer (one stream), then four
/// partition actors (one stream each, in this process).
fn gcn_epochs(data: &str, hidden: usize, epochs: u32) -> Result<()> {
    let ds = DataSource::parse(data)?.load()?;
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    cfg.model.hidden = hidden;
    cfg.epochs = epochs;
    cfg.device = Device::Cuda(0);
    let median = |r: &RunReport| {
        let mut ms: Vec<f64> = r.epochs_log.iter().map(|e| e.ms).collect();
        ms.sort_by(f64::total_cmp);
        ms[ms.len() / 2]
    };
    let one = Trainer::new(&ds, cfg.clone())?.run(|_| {})?;
    let topo = Topology::partition(&ds, 4, PartitionMethod::Metis, None, cfg)?;
    let four = topo.spawn()?.wait()?;
    println!(
        "gcn on {} (hidden {hidden}), median training step over {epochs} epochs: \
         1 stream {:.2} ms, 4 partition actors {:.2} ms ({:.2}x); test accuracy {:.3} / {:.3}",
        ds.name,
        median(&one),
        median(&four),
        median(&four) / median(&one),
        one.test_acc,
        four.test_acc
    );
    Ok(())
}
