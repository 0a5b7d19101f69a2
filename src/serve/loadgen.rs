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
use trellis_actors::priority::CpuSet;

/// One caller of the load: its API key and arrival rate.
#[derive(Debug, Clone)]
pub struct TenantLoad {
    /// Sent as `x-api-key`, if set.
    pub api_key: Option<String>,
    /// Mean arrivals per second.
    pub rate: f64,
}

/// What to send, how fast, for how long.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    pub addr: SocketAddr,
    /// The callers; their arrivals are independent Poisson processes, generated as one
    /// (the sum of the rates, each arrival drawn to a caller by its share of the rate), on
    /// one clock thread and one set of connections.
    pub tenants: Vec<TenantLoad>,
    pub duration: Duration,
    /// Keep-alive connections (requests beyond them wait on the client, timed).
    pub connections: usize,
    pub seed: u64,
    /// The CPUs the generator's threads run on (`None`: wherever the process may). On one
    /// machine with the service, keeping it off the service's cores stands in for a load
    /// generator on another machine.
    pub cpus: Option<CpuSet>,
}

/// What happened to one caller's requests.
#[derive(Debug)]
pub struct LoadResult {
    pub sent: u64,
    pub ok: u64,
    /// Refused by the service (429 or 503).
    pub shed: u64,
    /// Other statuses or broken connections.
    pub failed: u64,
    /// Why they failed (`HTTP 500`, `connection: ...`), with counts.
    pub failures: std::collections::BTreeMap<String, u64>,
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

/// A whole run: each caller's results (in [`LoadSpec::tenants`] order), the CPU time the
/// generator itself used (its clock thread and connection threads) and the CPU time of
/// the whole process meanwhile, so a reader can tell how much of the machine the client
/// took and how much the rest of the process (the service, and training beside it) used.
#[derive(Debug)]
pub struct LoadRun {
    pub tenants: Vec<LoadResult>,
    pub generator_cpu: Duration,
    /// Every thread of this process, the generator's included, over the run.
    pub process_cpu: Duration,
    pub elapsed: Duration,
}

impl LoadRun {
    /// The generator's CPU use in cores (1.0 = one core busy the whole run).
    pub fn generator_cores(&self) -> f64 {
        self.cores(self.generator_cpu)
    }

    /// The CPU use of the rest of the process in cores: the service (and whatever runs
    /// beside it in the process), the generator left out.
    pub fn server_cores(&self) -> f64 {
        self.cores(self.process_cpu.saturating_sub(self.generator_cpu))
    }

    fn cores(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// CPU time of `clock` (a thread's or the process's CPU-time clock).
fn cpu_clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the thread and process CPU-time clocks
    // are always supported on Linux.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time every thread of this process has used.
fn process_cpu() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

struct Job {
    tenant: usize,
    scheduled: Instant,
    path: &'static str,
    body: Vec<u8>,
}

struct Tally {
    ok: u64,
    shed: u64,
    failed: u64,
    failures: std::collections::BTreeMap<String, u64>,
    latency_us: Histogram<u64>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            ok: 0,
            shed: 0,
            failed: 0,
            failures: Default::default(),
            latency_us: Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"),
        }
    }

    fn fail(&mut self, why: String) {
        self.failed += 1;
        *self.failures.entry(why).or_default() += 1;
    }
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
    key_headers: Arc<Vec<String>>,
    jobs: Arc<Mutex<mpsc::UnboundedReceiver<Job>>>,
    tallies: Arc<Vec<std::sync::Mutex<Tally>>>,
) {
    let mut conn: Option<(BufReader<_>, tokio::net::tcp::OwnedWriteHalf)> = None;
    loop {
        let job = { jobs.lock().await.recv().await };
        let Some(job) = job else { return };
        let tally = &tallies[job.tenant];
        if conn.is_none() {
            if let Ok(s) = TcpStream::connect(addr).await {
                let _ = s.set_nodelay(true);
                let (r, w) = s.into_split();
                conn = Some((BufReader::new(r), w));
            }
        }
        let Some((r, w)) = conn.as_mut() else {
            tally
                .lock()
                .expect("tally")
                .fail("connection refused".into());
            continue;
        };
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: bench\r\n{}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            job.path,
            key_headers[job.tenant],
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
                let _ = t.latency_us.record(us.max(1));
            }
            Ok(429) | Ok(503) => t.shed += 1,
            Ok(status) => t.fail(format!("HTTP {status}")),
            Err(e) => {
                t.fail(format!("connection: {}", e.kind()));
                conn = None;
            }
        }
    }
}

/// Runs the load: `make(tenant, rng)` gives each request's path and body.
pub fn run_open_loop(
    spec: &LoadSpec,
    mut make: impl FnMut(usize, &mut Rng) -> (&'static str, Vec<u8>) + Send,
) -> std::io::Result<LoadRun> {
    let total: f64 = spec.tenants.iter().map(|t| t.rate.max(0.0)).sum();
    if !(total > 0.0 && total.is_finite()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("the load's arrival rates sum to {total}/s: nothing to send"),
        ));
    }
    // The clock thread (this one) is pinned for the run and given its own CPUs back after.
    let own_cpus = match spec.cpus {
        Some(cpus) => {
            let own = CpuSet::of_this_thread()?;
            cpus.pin_this_thread()?;
            Some(own)
        }
        None => None,
    };
    let run = run_pinned(spec, total, &mut make);
    if let Some(own) = own_cpus {
        own.pin_this_thread()?;
    }
    run
}

/// [`run_open_loop`] on the calling thread as it is placed; `total` is the sum of the
/// tenants' rates.
fn run_pinned(
    spec: &LoadSpec,
    total: f64,
    make: &mut impl FnMut(usize, &mut Rng) -> (&'static str, Vec<u8>),
) -> std::io::Result<LoadRun> {
    let worker_cpu = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let on_stop = worker_cpu.clone();
    // The connection thread is created by the (pinned) clock thread and inherits its CPUs.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("trellis-loadgen")
        .on_thread_stop(move || {
            on_stop.fetch_add(
                thread_cpu().as_nanos() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        })
        .enable_all()
        .build()?;
    let tallies: Arc<Vec<std::sync::Mutex<Tally>>> = Arc::new(
        spec.tenants
            .iter()
            .map(|_| std::sync::Mutex::new(Tally::new()))
            .collect(),
    );
    let (tx, rx) = mpsc::unbounded_channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    let key_headers: Arc<Vec<String>> = Arc::new(
        spec.tenants
            .iter()
            .map(|t| match &t.api_key {
                Some(k) => format!("x-api-key: {k}\r\n"),
                None => String::new(),
            })
            .collect(),
    );
    let workers: Vec<_> = (0..spec.connections.max(1))
        .map(|_| {
            rt.spawn(connection(
                spec.addr,
                key_headers.clone(),
                rx.clone(),
                tallies.clone(),
            ))
        })
        .collect();
    // The arrival clock runs on this thread: sleeps to each scheduled time (Linux timers
    // are ~0.1 ms precise; tokio's are 1 ms), never waiting for answers.
    let clock_cpu = thread_cpu();
    let process_start = process_cpu();
    let mut rng = Rng::new(spec.seed);
    let start = Instant::now();
    let mut next = start;
    let mut sent = vec![0u64; spec.tenants.len()];
    while next < start + spec.duration {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        // Which caller this arrival belongs to, by its share of the rate.
        let mut pick = rng.unit() * total;
        let tenant = spec
            .tenants
            .iter()
            .position(|t| {
                pick -= t.rate.max(0.0);
                pick < 0.0
            })
            .unwrap_or(spec.tenants.len() - 1);
        let (path, body) = make(tenant, &mut rng);
        if tx
            .send(Job {
                tenant,
                scheduled: next,
                path,
                body,
            })
            .is_err()
        {
            break;
        }
        sent[tenant] += 1;
        next += Duration::from_secs_f64(-rng.unit().ln() / total);
    }
    drop(tx);
    rt.block_on(async {
        for w in workers {
            let _ = w.await;
        }
    });
    let elapsed = start.elapsed();
    let process_cpu = process_cpu().saturating_sub(process_start);
    let clock_cpu = thread_cpu().saturating_sub(clock_cpu);
    drop(rt); // joins the worker thread, which adds its CPU time
    let generator_cpu =
        clock_cpu + Duration::from_nanos(worker_cpu.load(std::sync::atomic::Ordering::Relaxed));
    let tenants = tallies
        .iter()
        .zip(sent)
        .map(|(t, sent)| {
            let t = t.lock().expect("tally");
            LoadResult {
                sent,
                ok: t.ok,
                shed: t.shed,
                failed: t.failed,
                failures: t.failures.clone(),
                latency_us: t.latency_us.clone(),
                elapsed,
            }
        })
        .collect();
    Ok(LoadRun {
        tenants,
        generator_cpu,
        process_cpu,
        elapsed,
    })
}
