//! `cargo bench -p trellis-transport --bench throughput`: the transport throughput table
//! (QUIC vs TLS over TCP vs plain TCP). `TRELLIS_BENCH_MIB=N` sets the MiB moved per size;
//! `TRELLIS_BENCH_VARIANTS=1` also measures the tuning variants recorded in `bench/mod.rs`.
use std::time::Instant;
use trellis_transport::bench::{bench_throughput, format_table, BenchOptions, DEFAULT_SIZES};
use trellis_transport::quic::QuicConfig;

fn main() {
    let mib: u64 = std::env::var("TRELLIS_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let baselines = std::env::var("TRELLIS_BENCH_QUIC_ONLY").is_err();
    let base = BenchOptions {
        baselines,
        bytes_per_size: mib << 20,
        ..BenchOptions::default()
    };
    let mut tuned = QuicConfig::default();
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(v) = env("Q_MTU") {
        tuned.max_udp_payload = v as u16;
    }
    if let Some(v) = env("Q_COOL_MS") {
        tuned.mtu_black_hole_cooldown = std::time::Duration::from_millis(v);
    }
    if let Some(v) = env("Q_STREAMS") {
        tuned.send_streams = v as usize;
    }
    if let Some(v) = env("Q_SWIN") {
        tuned.stream_window = v << 20;
    }
    if let Some(v) = env("Q_CWIN") {
        tuned.conn_window = v << 20;
    }
    if let Some(v) = env("Q_SENDWIN") {
        tuned.send_window = v << 20;
    }
    if let Some(v) = env("Q_SOCKBUF") {
        tuned.socket_buffer = (v << 20) as usize;
    }
    if let Some(v) = env("Q_KNOWN") {
        tuned.known_mtu = Some(v as u16);
    }
    if let Some(v) = env("Q_GSO") {
        tuned.gso = v == 1;
    }
    let mut variants: Vec<(&str, QuicConfig)> = vec![("tuned (defaults)", tuned)];
    if std::env::var("TRELLIS_BENCH_VARIANTS").is_ok_and(|v| v == "1") {
        let d = QuicConfig::default();
        variants.extend([
            ("quinn 0.11 defaults", QuicConfig::quinn_defaults()),
            (
                "tuned, 1452-byte MTU",
                QuicConfig {
                    max_udp_payload: 1452,
                    ..d.clone()
                },
            ),
            (
                "tuned, GSO off",
                QuicConfig {
                    gso: false,
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
                "tuned, quinn's 1.25 MB stream window",
                QuicConfig {
                    stream_window: 1_250_000,
                    ..d.clone()
                },
            ),
            (
                "tuned, default socket buffers",
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
