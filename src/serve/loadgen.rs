//! An open-loop HTTP load generator: requests are scheduled at Poisson arrival times at a
//! fixed rate, whatever the answers' speed, and each latency is measured from the request's
//! *scheduled* time, so time spent queueing (on the client or the server) is never hidden
//! (no coordinated omission). Connections are HTTP/1.1 keep-alive; latencies go into an HDR
//! histogram.
use hdrhistogram::Histogram;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex};

/// What to send, how fast, for how long.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub addr: SocketAddr,
    /// Mean arrivals per second.
    pub rate: f64,
    pub duration: Duration,
    /// Keep-alive connections (requests beyond them wait on the client, timed).
    pub connections: usize,
    pub seed: u64,
    /// Sent as `x-api-key` (the tenant), if set.
    pub api_key: Option<String>,
}

/// What happened.
#[derive(Debug)]
pub struct LoadResult {
    pub sent: u64,
    pub ok: u64,
    /// Refused by the service (429 or 503).
    pub shed: u64,
    /// Other statuses or broken connections.
    pub failed: u64,
    /// Latency of answered requests (2xx), microseconds from their scheduled time.
    pub latency_us: Histogram<u64>,
    pub elapsed: Duration,
}

impl LoadResult {
    /// Answered requests per second.
    pub fn achieved_rps(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }
    /// Latency quantile in ms.
    pub fn ms(&self, q: f64) -> f64 {
        self.latency_us.value_at_quantile(q) as f64 / 1000.0
    }
}

struct Job {
    scheduled: Instant,
    path: &'static str,
    body: Vec<u8>,
}

#[derive(Default)]
struct Tally {
    ok: u64,
    shed: u64,
    failed: u64,
}

/// Arrival gaps and request contents come from the simulator's seeded generator.
pub type Rng = trellis_actors::sim::SimRng;

/// Reads one HTTP/1.1 response; returns its status.
async fn read_response(r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> std::io::Result<u16> {
    let mut line = String::new();
    if r.read_line(&mut line).await? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
    let mut len = 0usize;
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(status)
}

async fn connection(
    addr: SocketAddr,
    key_header: Arc<str>,
    jobs: Arc<Mutex<mpsc::UnboundedReceiver<Job>>>,
    hist: Arc<std::sync::Mutex<Histogram<u64>>>,
    tally: Arc<std::sync::Mutex<Tally>>,
) {
    let mut conn: Option<(BufReader<_>, tokio::net::tcp::OwnedWriteHalf)> = None;
    loop {
        let job = { jobs.lock().await.recv().await };
        let Some(job) = job else { return };
        if conn.is_none() {
            if let Ok(s) = TcpStream::connect(addr).await {
                let _ = s.set_nodelay(true);
                let (r, w) = s.into_split();
                conn = Some((BufReader::new(r), w));
            }
        }
        let Some((r, w)) = conn.as_mut() else {
            tally.lock().expect("tally").failed += 1;
            continue;
        };
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: bench\r\n{key_header}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            job.path,
            job.body.len()
        );
        let sent = async {
            w.write_all(head.as_bytes()).await?;
            w.write_all(&job.body).await?;
            read_response(r).await
        }
        .await;
        let mut t = tally.lock().expect("tally");
        match sent {
            Ok(s) if (200..300).contains(&s) => {
                t.ok += 1;
                let us = job.scheduled.elapsed().as_micros() as u64;
                let _ = hist.lock().expect("hist").record(us.max(1));
            }
            Ok(429) | Ok(503) => t.shed += 1,
            Ok(_) => t.failed += 1,
            Err(_) => {
                t.failed += 1;
                conn = None;
            }
        }
    }
}

/// Runs the load: `make(rng)` gives each request's path and body.
pub fn run_open_loop(
    spec: &LoadSpec,
    mut make: impl FnMut(&mut Rng) -> (&'static str, Vec<u8>) + Send,
) -> std::io::Result<LoadResult> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let hist = Arc::new(std::sync::Mutex::new(
        Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"),
    ));
    let tally = Arc::new(std::sync::Mutex::new(Tally::default()));
    let (tx, rx) = mpsc::unbounded_channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    let key_header: Arc<str> = match &spec.api_key {
        Some(k) => format!("x-api-key: {k}\r\n").into(),
        None => "".into(),
    };
    let workers: Vec<_> = (0..spec.connections.max(1))
        .map(|_| {
            rt.spawn(connection(
                spec.addr,
                key_header.clone(),
                rx.clone(),
                hist.clone(),
                tally.clone(),
            ))
        })
        .collect();
    // The arrival clock runs on its own thread: sleeps to each scheduled time (Linux timers
    // are ~0.1 ms precise; tokio's are 1 ms), never waiting for answers.
    let mut rng = Rng::new(spec.seed);
    let start = Instant::now();
    let mut next = start;
    let mut sent = 0u64;
    while next < start + spec.duration {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        let (path, body) = make(&mut rng);
        if tx
            .send(Job {
                scheduled: next,
                path,
                body,
            })
            .is_err()
        {
            break;
        }
        sent += 1;
        next += Duration::from_secs_f64(-rng.unit().ln() / spec.rate);
    }
    drop(tx);
    rt.block_on(async {
        for w in workers {
            let _ = w.await;
        }
    });
    let elapsed = start.elapsed();
    let t = tally.lock().expect("tally");
    let latency_us = hist.lock().expect("hist").clone();
    Ok(LoadResult {
        sent,
        ok: t.ok,
        shed: t.shed,
        failed: t.failed,
        latency_us,
        elapsed,
    })
}
