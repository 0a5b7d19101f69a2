//! The Prometheus text endpoint: `GET /metrics` on `--metrics-addr` answers the registry of
//! [`trellis_runtime::metrics`] in the text exposition format (version 0.0.4): per histogram a
//! summary `trellis_<name>_seconds` (quantiles 0.5, 0.9, 0.99, 1, `_sum`, `_count`), per
//! counter `trellis_<name>_total`. A plain thread serves it: one short request at a time.
use super::TelemetryError;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use trellis_runtime::metrics::{names, Key, Metrics, MetricsSnapshot};

/// What a metric measures (HELP lines and OTLP descriptions).
pub fn help(name: &str) -> &'static str {
    match name {
        names::STEP => "Training step of one epoch over all partitions",
        names::HALO_EXCHANGE => "Time a partition's step waited for one peer's halo block",
        names::ALL_REDUCE => "Summing weight gradients and applying them on every partition",
        names::RECOVERY => "From a partition failure to the replayed step completing",
        names::REPLICATE => {
            "Copying out a partition's committed state after a step (to replicate it)"
        }
        names::HALO_BYTES => "Halo payload bytes sent",
        names::HALO_MESSAGES => "Halo blocks sent",
        names::RESTARTS => "Partition restarts",
        names::REPLICA_BYTES => "Bytes of committed partition state replicated after each step",
        names::REPLICA_WIRE_BYTES => {
            "Bytes of replica messages sent: whole states, or the bytes that changed since one a node holds"
        }
        names::REPLICA_MIRRORED_BYTES => {
            "Bytes of partition state a replica left out: partitions on other nodes hold them"
        }
        names::REPLICA_FETCHED_BYTES => {
            "Bytes of partition state left out of a replica that an adopting node fetched from a third node"
        }
        names::REPLICA_TRANSFER => {
            "From shipping a partition's state to a replica node until it acknowledged storing it"
        }
        names::REFUSED_CONNECTIONS => {
            "Connections refused: foreign or missing certificate, wrong node id, bad hello"
        }
        _ => "Trellis metric",
    }
}

fn labels(key: &Key, extra: Option<(&str, &str)>) -> String {
    let mut parts: Vec<String> = key
        .labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{v}\""))
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// The text exposition of a snapshot.
pub fn render(snap: &MetricsSnapshot) -> String {
    let mut out = String::new();
    let mut last = "";
    for (key, h) in &snap.hists {
        let metric = format!("trellis_{}_seconds", key.name);
        if key.name != last {
            let _ = writeln!(out, "# HELP {metric} {}", help(key.name));
            let _ = writeln!(out, "# TYPE {metric} summary");
            last = key.name;
        }
        for q in ["0.5", "0.9", "0.99", "1"] {
            let v = h.value_at_quantile(q.parse().expect("a quantile")) as f64 / 1e6;
            let _ = writeln!(out, "{metric}{} {v}", labels(key, Some(("quantile", q))));
        }
        let sum = h.mean() * h.len() as f64 / 1e6;
        let _ = writeln!(out, "{metric}_sum{} {sum}", labels(key, None));
        let _ = writeln!(out, "{metric}_count{} {}", labels(key, None), h.len());
    }
    last = "";
    for (key, v) in &snap.counters {
        let metric = format!("trellis_{}_total", key.name);
        if key.name != last {
            let _ = writeln!(out, "# HELP {metric} {}", help(key.name));
            let _ = writeln!(out, "# TYPE {metric} counter");
            last = key.name;
        }
        let _ = writeln!(out, "{metric}{} {v}", labels(key, None));
    }
    out
}

/// Connections answered at once; more are refused with [`BUSY`].
const MAX_CLIENTS: usize = 256;
/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// The serving thread.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` and serves `/metrics` until [`MetricsServer::stop`].
    pub fn start(addr: SocketAddr) -> Result<Self, TelemetryError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| TelemetryError::Serve { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| TelemetryError::Serve { addr, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("trellis-metrics".into())
            .spawn(move || {
                // Each connection is answered on its own thread, so clients that connect and
                // say nothing (idle, slow) delay nobody else; at most MAX_CLIENTS at once,
                // beyond which a connection is told 503 and closed at once.
                let active = Arc::new(AtomicUsize::new(0));
                for conn in listener.incoming() {
                    if flag.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = conn else { continue };
                    if active.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                        active.fetch_sub(1, Ordering::SeqCst);
                        let _ = stream.write_all(BUSY);
                        continue;
                    }
                    let done = active.clone();
                    let spawned = std::thread::Builder::new()
                        .name("trellis-metrics-conn".into())
                        .spawn(move || {
                            // A client that misbehaves only loses its own answer.
                            let _ = answer(stream);
                            done.fetch_sub(1, Ordering::SeqCst);
                        });
                    if spawned.is_err() {
                        active.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .map_err(|source| TelemetryError::Serve { addr, source })?;
        Ok(MetricsServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and joins the thread.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Reads one request head and answers it.
fn answer(mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(HEAD_TIMEOUT))?;
    stream.set_write_timeout(Some(HEAD_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut first = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let (status, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", render(&Metrics::global().snapshot())),
        ("GET", _) => ("404 Not Found", "not found: try /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "only GET\n".to_string()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use trellis_runtime::metrics::Metrics;

    #[test]
    fn metrics_answer_while_many_idle_connections_are_held() {
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let idle: Vec<TcpStream> = (0..100)
            .map(|_| TcpStream::connect(server.addr()).unwrap())
            .collect();
        let t = std::time::Instant::now();
        let mut c = TcpStream::connect(server.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "answered after {:?}",
            t.elapsed()
        );
        drop(idle);
        server.stop();
    }

    #[test]
    fn renders_summaries_and_counters() {
        let m = Metrics::default();
        let k = Key::new(names::HALO_EXCHANGE)
            .with("partition", 1)
            .with("peer", 0);
        m.record(k.clone(), Duration::from_millis(2));
        m.record(k, Duration::from_millis(4));
        m.add(Key::new(names::RESTARTS).with("partition", 1), 1);
        let text = render(&m.snapshot());
        assert!(
            text.contains("# TYPE trellis_halo_exchange_seconds summary"),
            "{text}"
        );
        assert!(
            text.contains(
                "trellis_halo_exchange_seconds{partition=\"1\",peer=\"0\",quantile=\"1\"} 0.004"
            ),
            "{text}"
        );
        assert!(
            text.contains("trellis_halo_exchange_seconds_count{partition=\"1\",peer=\"0\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("trellis_restarts_total{partition=\"1\"} 1"),
            "{text}"
        );
    }
}
