//! `trellis bench transport`: bulk transfer of halo-sized blocks on loopback, in one run, through
//! the QUIC transport, TLS over TCP (tokio-rustls, same cipher suite, mutual TLS) and plain TCP.
//! Sender and receiver share the process (and, here, 2 vCPUs), so every number is CPU-bound.
//!
//! What the QUIC tuning did — one run of `TRELLIS_BENCH_VARIANTS=1 cargo bench -p
//! trellis-transport --bench throughput` (512 MiB per cell, 2 vCPUs shared with other builds, so
//! +-30% between runs). MB/s for 1 / 4 / 16 / 64 MiB blocks, then QUIC / TLS-over-TCP:
//!
//! | QUIC settings                                  | 1 MiB | 4 MiB | 16 MiB | 64 MiB | vs TLS     |
//! |------------------------------------------------|------:|------:|-------:|-------:|------------|
//! | quinn 0.11 defaults (1452 MTU, GSO, 1.25 MB)   |   793 |   629 |    476 |    409 | 0.43-0.67x |
//! | tuned windows, 1452 MTU, GSO                   |   564 |   531 |    491 |    426 | 0.48-0.61x |
//! | tuned, 64 KiB MTU but GSO on (black hole)      |   479 |   447 |    387 |    361 | 0.41-0.54x |
//! | tuned, 16/64 MiB windows (socket overflow)     |  1582 |  1531 |    850 |    828 | 0.93-1.58x |
//! | tuned, OS socket buffers (20% datagrams lost) |  1457 |  1493 |    798 |    740 | 0.84-1.37x |
//! | tuned, 1 stream in flight                      |   833 |   450 |   1073 |    841 | 0.44-1.18x |
//! | tuned, 8 streams in flight                     |  1627 |  1366 |   1125 |    639 | 0.94-1.30x |
//! | **tuned (the defaults)**: 64 KiB MTU, no GSO,  |  2171 |  2062 |   1848 |   1429 | 1.03-1.51x |
//! | 6 MiB windows, 8 MiB socket buffers, 4 streams |       |       |        |        |            |
//!
//! What helped, in order: (1) datagrams of ~64 KiB (MTU discovery up to 65527) with GSO off —
//! per-packet costs (AEAD call, quinn packet assembly, syscall) dominate at 1.2-1.4 KiB, and
//! quinn's GSO batches of large datagrams exceed 64 KiB and are refused; (2) windows that fit
//! the socket buffer, so there is no loss and Cubic keeps its window; (3) a few streams in
//! flight (an RTT bubble per block with one). Buffer reuse: the send side hands the block's
//! `Arc<[f32]>` to quinn as `Bytes` (no copy); the receive side copies each chunk once, into
//! the block's final buffer. Plain TCP stays ~1.5-3x faster: the kernel's loopback path has
//! no per-datagram user-space work.
use crate::certs::{CertError, ClusterCa};
use crate::quic::{QuicConfig, QuicError, QuicTransport};
use crate::{HaloBlock, MsgHeader, PartId, Phase, RunId, Transport};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::Notify;

mod tcp;

/// A failed benchmark.
#[derive(Debug, Error)]
#[error("transport benchmark: {0}")]
pub struct BenchError(pub String);

impl From<QuicError> for BenchError {
    fn from(e: QuicError) -> Self {
        BenchError(e.to_string())
    }
}

impl From<CertError> for BenchError {
    fn from(e: CertError) -> Self {
        BenchError(e.to_string())
    }
}

/// How much to move per block size, and the QUIC settings to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Bytes moved per block size and transport (at least `min_blocks` blocks).
    pub bytes_per_size: u64,
    pub min_blocks: usize,
    /// Worker threads of the benchmark's tokio runtime.
    pub threads: usize,
    /// Also measure TLS over TCP and plain TCP (off: QUIC alone, e.g. to profile it; the
    /// baseline columns are then NaN).
    pub baselines: bool,
    /// The QUIC node settings (bind address and timeouts are overridden for loopback).
    pub quic: QuicConfig,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            bytes_per_size: 512 << 20,
            min_blocks: 4,
            threads: 2,
            baselines: true,
            quic: QuicConfig::default(),
        }
    }
}

/// The sizes `trellis bench transport` measures: 1, 4, 16 and 64 MiB.
pub const DEFAULT_SIZES: [usize; 4] = [1 << 20, 4 << 20, 16 << 20, 64 << 20];

/// Throughput of one block size, MB/s (10^6 bytes per second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThroughputRow {
    pub block_bytes: usize,
    pub blocks: usize,
    pub quic_mbps: f64,
    pub tls_tcp_mbps: f64,
    pub tcp_mbps: f64,
}

impl ThroughputRow {
    /// QUIC / TLS-over-TCP.
    pub fn ratio_tls(&self) -> f64 {
        self.quic_mbps / self.tls_tcp_mbps
    }

    /// QUIC / plain TCP.
    pub fn ratio_tcp(&self) -> f64 {
        self.quic_mbps / self.tcp_mbps
    }
}

/// The rows as a table for the terminal.
pub fn format_table(rows: &[ThroughputRow]) -> String {
    let mut out =
        String::from("block      blocks   QUIC MB/s  TLS/TCP MB/s  TCP MB/s  QUIC/TLS  QUIC/TCP\n");
    for r in rows {
        out += &format!(
            "{:>5} MiB  {:>6}  {:>10.0}  {:>12.0}  {:>8.0}  {:>7.2}x  {:>7.2}x\n",
            r.block_bytes >> 20,
            r.blocks,
            r.quic_mbps,
            r.tls_tcp_mbps,
            r.tcp_mbps,
            r.ratio_tls(),
            r.ratio_tcp()
        );
    }
    out
}

/// Measures each size through QUIC, TLS over TCP and plain TCP, one after the other, on
/// 127.0.0.1. Builds its own runtime: call it outside any tokio runtime.
pub fn bench_throughput(
    sizes: &[usize],
    opts: &BenchOptions,
) -> Result<Vec<ThroughputRow>, BenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.threads.max(1))
        .enable_all()
        .build()
        .map_err(|e| BenchError(e.to_string()))?;
    rt.block_on(async {
        let ca = ClusterCa::generate()?;
        let quic = QuicPair::new(&ca, opts).await?;
        let mut rows = Vec::new();
        for &size in sizes {
            let size = size.max(4) & !3;
            let blocks = ((opts.bytes_per_size / size as u64) as usize).max(opts.min_blocks);
            let floats: Arc<[f32]> = (0..size / 4).map(|i| i as f32).collect();
            let bytes: Arc<[u8]> = floats.iter().flat_map(|x| x.to_le_bytes()).collect();
            let total = (blocks * size) as f64;
            let mbps = |d: Duration| total / d.as_secs_f64() / 1e6;
            let quic_mbps = mbps(quic.run(floats.clone(), blocks).await?);
            let (mut tls_tcp_mbps, mut tcp_mbps) = (f64::NAN, f64::NAN);
            if opts.baselines {
                tls_tcp_mbps = mbps(tcp::tcp(bytes.clone(), blocks, Some(&ca)).await?);
                tcp_mbps = mbps(tcp::tcp(bytes, blocks, None).await?);
            }
            rows.push(ThroughputRow {
                block_bytes: size,
                blocks,
                quic_mbps,
                tls_tcp_mbps,
                tcp_mbps,
            });
        }
        if let Some(s) = quic.a.node().connection_stats(2) {
            tracing::info!(
                mtu = s.path.current_mtu,
                lost = s.path.lost_packets,
                cwnd = s.path.cwnd,
                "QUIC path"
            );
            if std::env::var_os("TRELLIS_BENCH_DEBUG").is_some() {
                eprintln!(
                    "QUIC path: black holes {} probes {}/{} lost, mtu {} rtt {:?} cwnd {} \
                     lost {} sent {} udp tx {:?} rx {:?}",
                    s.path.black_holes_detected,
                    s.path.lost_plpmtud_probes,
                    s.path.sent_plpmtud_probes,
                    s.path.current_mtu,
                    s.path.rtt,
                    s.path.cwnd,
                    s.path.lost_packets,
                    s.path.sent_packets,
                    s.udp_tx,
                    s.udp_rx
                );
            }
        }
        quic.a.close().await;
        quic.b.close().await;
        Ok(rows)
    })
}

/// Node 1 sending to partition 1 on node 2, which counts and drops what it receives.
struct QuicPair {
    a: QuicTransport,
    b: QuicTransport,
    received: Arc<AtomicU64>,
    arrived: Arc<Notify>,
    run: RunId,
}

impl QuicPair {
    async fn new(ca: &ClusterCa, opts: &BenchOptions) -> Result<Self, BenchError> {
        let cfg = QuicConfig {
            bind: "127.0.0.1:0".parse().expect("an address"),
            ..opts.quic.clone()
        };
        let (a, _) = QuicTransport::bind(cfg.clone(), &ca.issue_identity(1)?)?;
        let (b, _) = QuicTransport::bind(cfg, &ca.issue_identity(2)?)?;
        let (received, arrived) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
        let (r, n) = (received.clone(), arrived.clone());
        b.register(
            PartId(1),
            Arc::new(move |_block| {
                r.fetch_add(1, Ordering::SeqCst);
                n.notify_one();
                true
            }),
        );
        let run = RunId::from_bytes(*b"trellis-bench-01");
        b.set_epoch(run, 0);
        a.add_peer(2, b.local_addr());
        a.route(PartId(1), 2);
        a.connect(2).await?;
        let pair = QuicPair {
            a,
            b,
            received,
            arrived,
            run,
        };
        // Warm up: MTU discovery and congestion window before the first measurement.
        let warm: Arc<[f32]> = vec![0.0; 1 << 18].into();
        pair.run(warm, 16).await?;
        Ok(pair)
    }

    /// Time to deliver `blocks` blocks of `data` (the same buffer, sent without copying).
    async fn run(&self, data: Arc<[f32]>, blocks: usize) -> Result<Duration, BenchError> {
        let header = MsgHeader {
            run: self.run,
            epoch: 0,
            layer: 0,
            phase: Phase::Forward,
            from: PartId(0),
            to: PartId(1),
        };
        let (cols, rows) = (256u32, (data.len() / 256) as u32);
        let data: Arc<[f32]> = if (rows * cols) as usize == data.len() {
            data
        } else {
            data[..(rows * cols) as usize].into()
        };
        let target = self.received.load(Ordering::SeqCst) + blocks as u64;
        let start = Instant::now();
        for _ in 0..blocks {
            let block = HaloBlock {
                header,
                rows,
                cols,
                payload: crate::HaloPayload::F32(data.clone()),
                trace: None,
            };
            self.a.send(block).map_err(|e| BenchError(e.to_string()))?;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while self.received.load(Ordering::SeqCst) < target {
            let notified = self.arrived.notified();
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(BenchError("QUIC blocks not delivered within 120 s".into()));
            }
        }
        let elapsed = start.elapsed();
        self.a.flush(Duration::from_secs(30)).await?;
        Ok(elapsed)
    }
}
