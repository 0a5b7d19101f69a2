//! `cargo bench -p trellis-transport --bench throughput`: the transport throughput table
//! (QUIC vs TLS over TCP vs plain TCP) for 1, 4, 16 and 64 MiB blocks.
//!
//! Environment: `TRELLIS_BENCH_MIB=N` MiB moved per size and transport (default 512);
//! `TRELLIS_BENCH_VARIANTS=1` also measures the tuning variants recorded in `src/bench/mod.rs`;
//! `TRELLIS_BENCH_QUIC_ONLY=1` skips the TCP baselines (for profiling);
//! `TRELLIS_BENCH_DEBUG=1` prints quinn's path statistics after each table.
use std::time::Instant;
use trellis_transport::bench::{bench_throughput, format_table, BenchOptions, DEFAULT_SIZES};
use trellis_transport::quic::QuicConfig;

fn main() {
    let mib: u64 = std::env::var("TRELLIS_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let base = BenchOptions {
        bytes_per_size: mib << 20,
        baselines: std::env::var_os("TRELLIS_BENCH_QUIC_ONLY").is_none(),
        ..BenchOptions::default()
    };
    let d = QuicConfig::default();
    let mut variants: Vec<(&str, QuicConfig)> = vec![("tuned (defaults)", d.clone())];
    if std::env::var("TRELLIS_BENCH_VARIANTS").is_ok_and(|v| v == "1") {
        variants.extend([
            ("quinn 0.11 defaults", QuicConfig::quinn_defaults()),
            (
                "tuned, 1452-byte MTU with GSO",
                QuicConfig {
                    max_udp_payload: 1452,
                    gso: true,
                    ..d.clone()
                },
            ),
            (
                "tuned, GSO on",
                QuicConfig {
                    gso: true,
                    ..d.clone()
                },
            ),
            (
                "tuned, 1 stream in flight",
                QuicConfig {
                    send_streams: 1,
                    ..d.clone()
                },
            ),
            (
                "tuned, 8 streams in flight",
                QuicConfig {
                    send_streams: 8,
                    ..d.clone()
                },
            ),
            (
                "tuned, quinn's 1.25 MB stream window",
                QuicConfig {
                    stream_window: 1_250_000,
                    ..d.clone()
                },
            ),
            (
                "tuned, 16 MiB stream / 64 MiB connection windows",
                QuicConfig {
                    stream_window: 16 << 20,
                    conn_window: 64 << 20,
                    send_window: 64 << 20,
                    ..d.clone()
                },
            ),
            (
                "tuned, OS socket buffers",
                QuicConfig {
                    socket_buffer: 0,
                    ..d.clone()
                },
            ),
        ]);
    }
    for (name, quic) in variants {
        let start = Instant::now();
        let rows = bench_throughput(
            &DEFAULT_SIZES,
            &BenchOptions {
                quic,
                ..base.clone()
            },
        )
        .expect("benchmark");
        println!(
            "== {name} ({:.1} s)\n{}",
            start.elapsed().as_secs_f64(),
            format_table(&rows)
        );
    }
}
