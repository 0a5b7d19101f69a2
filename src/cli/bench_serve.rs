//! `trellis bench serve`: the serving service under open-loop Poisson load over real HTTP on
//! loopback, for (a) predictions of existing nodes, (b) new-node inductive queries, (d) a
//! light tenant alone and beside a 10x heavier one, and (c) (a) while a trainer trains
//! beside the service and publishes its weights; latency quantiles, achieved rates, the
//! load generator's own CPU use and this machine's memory bandwidth.
use super::train::load_data;
use crate::serve::api::Limits;
use crate::serve::beside::Publisher;
use crate::serve::loadgen::{run_open_loop, LoadResult, LoadRun, LoadSpec, TenantLoad};
use crate::serve::{run_http, HttpConfig};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use trellis_actors::priority::{Class, CpuSet};
use trellis_actors::serving::engine::{self, EngineConfig};
use trellis_actors::serving::scheduler::SchedulerConfig;
use trellis_actors::{RunEvent, Topology, TrainingRun};
use trellis_gpu::{bench, PriorityGate, Stream};
use trellis_runtime::inference::NodeGraph;
use trellis_runtime::model_file::{self, ModelMeta, SavedModel};
use trellis_runtime::partition::{assign, PartitionMethod};
use trellis_runtime::{Graph, ModelKind, TrainConfig, Trainer};

#[derive(Debug, Clone, Args)]
pub struct ServeBenchArgs {
    #[arg(
        long,
        default_value = "synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0"
    )]
    pub data: String,
    /// A model file to serve; without one a GCN is trained for --train-epochs.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 1)]
    pub train_epochs: u32,
    /// Arrival rate of (a), existing-node predictions, per second (0 skips (a), and then
    /// needs --beside-epochs 0: (c) is compared with it).
    #[arg(long, default_value_t = 10_000.0)]
    pub rate_predict: f64,
    /// Arrival rate of (b), new-node inductive queries, per second.
    #[arg(long, default_value_t = 1_000.0)]
    pub rate_new: f64,
    /// Seconds of load per workload.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Fairness check: a light tenant's rate alone and beside a tenant sending 10x as much
    /// (0 skips it).
    #[arg(long, default_value_t = 500.0)]
    pub rate_light: f64,
    /// Edges of each new node.
    #[arg(long, default_value_t = 10)]
    pub new_edges: usize,
    #[arg(long, default_value_t = 64)]
    pub connections: usize,
    #[arg(long, default_value_t = 5)]
    pub slo_ms: u64,
    #[arg(long, default_value_t = 1)]
    pub partitions: usize,
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// HTTP worker threads of the service.
    #[arg(long, default_value_t = 1)]
    pub http_workers: usize,
    /// (c): epochs timed alone, then training beside (a)'s load for --beside-seconds
    /// (0 skips (c)).
    #[arg(long, default_value_t = 2)]
    pub beside_epochs: u32,
    /// (c): publish the trainer's weights every K epochs.
    #[arg(long, default_value_t = 2)]
    pub publish_every: u32,
    /// (c): the training threads' CPU class beside the service: `idle` (SCHED_IDLE) or a
    /// nice value 1-19 in the normal class.
    #[arg(long, default_value = "idle", value_parser = parse_class)]
    pub beside_priority: Class,
    /// (c): seconds of (a)'s load beside training (long enough for epochs and a publish).
    #[arg(long, default_value_t = 40)]
    pub beside_seconds: u64,
    /// (c): train beside the service on this many partition actors (METIS) instead of one
    /// trainer (1); their streams yield to the service's update steps, as `trellis train
    /// --partitions P --serve` does.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub beside_partitions: u32,
    /// Where the load generator runs: `auto` (on the last CPU, the HTTP workers on the
    /// others, where the process has two or more), `off` (both wherever the kernel puts
    /// them), or a CPU list such as `3` (the HTTP workers on the other CPUs). On one
    /// machine a generator on its own CPUs stands in for one on another machine; training
    /// beside (c) runs on every CPU either way.
    #[arg(long, default_value = "off", value_parser = parse_pin)]
    pub pin_generator: Pin,
}

/// Where `bench serve` runs its load generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    Auto,
    Off,
    On(CpuSet),
}

fn parse_pin(s: &str) -> std::result::Result<Pin, String> {
    match s {
        "auto" => Ok(Pin::Auto),
        "off" => Ok(Pin::Off),
        list => CpuSet::parse(list).map(Pin::On),
    }
}

/// The CPUs of the load generator and of the HTTP workers (`None`: unpinned).
#[derive(Debug, Clone, Copy)]
struct Placement {
    generator: CpuSet,
    http: CpuSet,
}

fn placement(pin: Pin) -> Result<Option<Placement>> {
    let all = CpuSet::of_this_thread()?;
    match pin {
        Pin::Off => Ok(None),
        Pin::Auto => Ok(all
            .split_last()
            .map(|(http, generator)| Placement { generator, http })),
        Pin::On(generator) => {
            let http = CpuSet::of(all.cpus().into_iter().filter(|&c| !generator.contains(c)))
                .expect("CPUs of this process are below CPU_SETSIZE");
            if generator.is_empty() || !generator.is_subset_of(&all) || http.is_empty() {
                anyhow::bail!(
                    "--pin-generator {generator}: the generator's CPUs must be some of this process's CPUs ({all}) and leave at least one to the HTTP workers"
                );
            }
            Ok(Some(Placement { generator, http }))
        }
    }
}

fn parse_class(s: &str) -> std::result::Result<Class, String> {
    if s == "idle" {
        return Ok(Class::Idle);
    }
    match s.parse::<i32>() {
        Ok(n) if (1..=19).contains(&n) => Ok(Class::Nice(n)),
        _ => Err(format!("`{s}` is neither `idle` nor a nice value 1-19")),
    }
}

fn line(name: &str, rate: f64, r: &LoadResult) {
    println!(
        "{name:<28} offered {rate:>7.0}/s  achieved {:>7.0}/s  p50 {:>7.2} ms  p99 {:>7.2} ms  p99.9 {:>7.2} ms  (sent {}, ok {}, shed {}, failed {})",
        r.achieved_rps(),
        r.ms(0.5),
        r.ms(0.99),
        r.ms(0.999),
        r.sent,
        r.ok,
        r.shed,
        r.failed
    );
    if !r.failures.is_empty() {
        let why: Vec<String> = r.failures.iter().map(|(w, n)| format!("{n} {w}")).collect();
        println!("{:<28} failed: {}", "", why.join(", "));
    }
}

fn generator(run: &LoadRun) {
    println!(
        "{:<28} CPU: load generator {:.2} cores, the rest of the process {:.2} cores, of {} on this machine",
        "",
        run.generator_cores(),
        run.server_cores(),
        machine_cores()
    );
}

/// The cores this process may run on.
fn machine_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPU limit beside (c)'s training share: the cores (a)'s load took alone (the
/// service and the generator), taken from every core. Training that scales with its cores
/// keeps at most the rest's share of its epoch rate beside the load.
fn ceiling_line(alone_load: &LoadRun) {
    let cores = machine_cores() as f64;
    let taken = alone_load.server_cores() + alone_load.generator_cores();
    println!(
        "(c) CPU limit: (a) alone took {taken:.2} cores (service {:.2}, load generator {:.2}) of {cores}, leaving training at most {:.0}% of the CPU it has alone",
        alone_load.server_cores(),
        alone_load.generator_cores(),
        100.0 * ((cores - taken) / cores).clamp(0.0, 1.0)
    );
}

/// Median of some epoch times, ms.
fn median_ms(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    if a.rate_predict <= 0.0 && a.beside_epochs > 0 {
        anyhow::bail!(
            "(c) is compared with (a): --rate-predict 0 needs --beside-epochs 0 (no (c))"
        );
    }
    let pinned = placement(a.pin_generator)?;
    let ds = load_data(&a.data)?;
    let stream = Stream::cpu(a.threads)?;
    let triad = bench::triad_bandwidth_gbs(256 << 20, stream.budget());
    let mut train_cfg =
        TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    train_cfg.model.hidden = a.hidden;
    train_cfg.epochs = a.train_epochs;
    train_cfg.threads = a.threads;
    let mut trainer = None;
    let saved = match &a.model {
        Some(p) => model_file::load(p)?,
        None => {
            let t = Instant::now();
            let mut tr = Trainer::new(&ds, train_cfg.clone())?;
            tr.run(|_| {})?;
            eprintln!(
                "trained GCN hidden {} for {} epoch(s) in {:.1} s",
                a.hidden,
                a.train_epochs,
                t.elapsed().as_secs_f64()
            );
            let bytes = model_file::to_bytes(tr.model(), tr.stream(), &meta(&train_cfg, &tr))?;
            let m = model_file::from_bytes(&bytes, std::path::Path::new("trained model"))?;
            trainer = Some(tr);
            m
        }
    };
    saved.check_fits(ds.num_features, ds.num_classes)?;
    let (n, width) = (ds.num_nodes, ds.num_features);
    let graph = Graph::from_dataset(&ds)?;
    let parts = a.partitions.max(1);
    let owner = assign(&graph, &ds, parts, PartitionMethod::Metis, 0)?;
    let t = Instant::now();
    // The service's update steps are urgent work of this gate; training beside (c) yields.
    let gate = PriorityGate::new();
    let handle = start_engine(saved, &graph, ds.features.clone(), owner, &a, &gate)?;
    drop(graph);
    eprintln!(
        "layer-wise inference over {n} nodes: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let cfg = HttpConfig {
        limits: Limits::DEFAULT,
        deadline: Duration::from_secs(1),
        client_timeout: Duration::from_secs(5),
        features: width,
        classes: ds.num_classes,
        workers: a.http_workers.max(1),
        cpus: pinned.map(|p| p.http),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let server = handle.clone();
    std::thread::spawn(move || {
        let _ = run_http(
            server,
            cfg,
            "127.0.0.1:0".parse().expect("an address"),
            |addr| {
                let _ = tx.send(addr);
            },
        );
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .context("the HTTP server did not start")?;
    let spec = |tenants: Vec<TenantLoad>, seed: u64| LoadSpec {
        addr,
        tenants,
        duration: Duration::from_secs(a.seconds),
        connections: a.connections,
        seed,
        cpus: pinned.map(|p| p.generator),
    };
    let one = |rate: f64| {
        vec![TenantLoad {
            api_key: None,
            rate,
        }]
    };
    println!(
        "trellis bench serve: {} ({n} nodes), GCN hidden {}, {parts} part(s), SLO {} ms, {} s per workload, {} HTTP worker(s), memory bandwidth (STREAM triad) {triad:.1} GB/s",
        ds.name, a.hidden, a.slo_ms, a.seconds, a.http_workers.max(1)
    );
    match pinned {
        Some(p) => println!(
            "load generator on CPU {}, HTTP workers on CPU {} (--pin-generator off: both anywhere); training beside (c) on every CPU",
            p.generator, p.http
        ),
        None => println!("load generator and HTTP workers on any CPU (not pinned)"),
    }
    let query = move |_: usize, rng: &mut crate::serve::loadgen::Rng| {
        let v = rng.below(n as u64);
        ("/v1/predict", format!("{{\"nodes\":[{v}]}}").into_bytes())
    };
    // (a), unless skipped (--rate-predict 0); (c) is compared with it.
    let existing = if a.rate_predict > 0.0 {
        let run = run_open_loop(&spec(one(a.rate_predict), 1), query)?;
        line("(a) existing-node predict", a.rate_predict, &run.tenants[0]);
        generator(&run);
        Some(run)
    } else {
        None
    };
    if a.rate_new > 0.0 {
        let k = a.new_edges;
        let new = run_open_loop(&spec(one(a.rate_new), 2), |_, rng| {
            let feats: Vec<String> = (0..width).map(|_| format!("{:.3}", rng.unit())).collect();
            let edges: Vec<String> = (0..k).map(|_| rng.below(n as u64).to_string()).collect();
            (
                "/v1/nodes",
                format!(
                    "{{\"nodes\":[{{\"features\":[{}],\"edges\":[{}]}}]}}",
                    feats.join(","),
                    edges.join(",")
                )
                .into_bytes(),
            )
        })?;
        line("(b) new-node inductive", a.rate_new, &new.tenants[0]);
        generator(&new);
    }
    if a.rate_light > 0.0 {
        let light = TenantLoad {
            api_key: Some("light".into()),
            rate: a.rate_light,
        };
        let heavy = TenantLoad {
            api_key: Some("heavy".into()),
            rate: 10.0 * a.rate_light,
        };
        let alone = run_open_loop(&spec(vec![light.clone()], 3), query)?;
        line("(d) light tenant alone", a.rate_light, &alone.tenants[0]);
        let both = run_open_loop(&spec(vec![light, heavy], 5), query)?;
        line("(d) light beside 10x heavy", a.rate_light, &both.tenants[0]);
        line(
            "(d) the heavy tenant",
            10.0 * a.rate_light,
            &both.tenants[1],
        );
        generator(&both);
        println!(
            "light tenant p99 beside the heavy one: {:.2}x alone (goal <= 1.2x)",
            both.tenants[0].ms(0.99) / alone.tenants[0].ms(0.99).max(1e-3)
        );
    }
    if a.beside_epochs > 0 && a.beside_partitions > 1 {
        let beside_spec = LoadSpec {
            duration: Duration::from_secs(a.beside_seconds.max(1)),
            ..spec(one(a.rate_predict), 6)
        };
        drop(trainer);
        let existing = existing.as_ref().expect("(a) ran: checked at the start");
        beside_partitioned(&ds, &train_cfg, handle, &gate, &a, existing, || {
            run_open_loop(&beside_spec, query)
        })?;
    } else if a.beside_epochs > 0 {
        let mut tr = match trainer {
            Some(t) => t,
            None => Trainer::new(&ds, train_cfg.clone())?,
        };
        let beside_spec = LoadSpec {
            duration: Duration::from_secs(a.beside_seconds.max(1)),
            ..spec(one(a.rate_predict), 6)
        };
        tr.yield_to(gate.clone());
        let existing = existing.as_ref().expect("(a) ran: checked at the start");
        beside_training(&mut tr, &train_cfg, handle, &a, existing, || {
            run_open_loop(&beside_spec, query)
        })?;
    }
    Ok(())
}

/// The model metadata of the trainer's weights.
fn meta(cfg: &TrainConfig, tr: &Trainer) -> ModelMeta {
    ModelMeta::of_training(cfg, tr.data_digest(), cfg.epochs)
}

/// An epoch trained beside the load: its wall time, and whether it ended while the load
/// still ran.
struct BesideEpoch {
    ms: f64,
    during_load: bool,
}

/// One gated epoch of a partitioned run: sends its token, waits for its log; wall ms.
fn gated_epoch(gate: &mpsc::Sender<()>, run: &TrainingRun) -> Result<f64> {
    let t = Instant::now();
    gate.send(()).context("the partitioned run stopped early")?;
    loop {
        match run.events().recv() {
            Ok(RunEvent::Epoch(_)) => return Ok(t.elapsed().as_secs_f64() * 1e3),
            Ok(_) => {}
            Err(_) => anyhow::bail!("the partitioned run stopped early"),
        }
    }
}

/// (c) on partitions: `--beside-partitions` partition actors train `cfg`'s GCN (their
/// threads in the background class, their streams yielding to the service's gate), first
/// `--beside-epochs` epochs alone, then for as long as (a)'s load runs beside them; every
/// committed epoch's model goes to a publisher, which publishes every `--publish-every`.
fn beside_partitioned(
    ds: &trellis_runtime::Dataset,
    cfg: &TrainConfig,
    handle: engine::EngineHandle,
    gate: &PriorityGate,
    a: &ServeBenchArgs,
    alone_load: &LoadRun,
    load: impl FnOnce() -> std::io::Result<LoadRun>,
) -> Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let parts = a.beside_partitions as usize;
    let mut cfg = cfg.clone();
    // The gate ends the run (cleanly) when the load is over.
    cfg.epochs = u32::MAX / 2;
    let t = Instant::now();
    let (models_tx, models_rx) = mpsc::channel();
    let topo = Topology::partition(ds, parts, PartitionMethod::Metis, None, cfg.clone())?
        .yielding_to(gate.clone())
        .publishing_models(models_tx);
    eprintln!(
        "(c) {parts} training partitions (METIS) in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let meta = ModelMeta::of_training(&cfg, &ds.digest(), 0);
    let mut publisher = Publisher::new(handle.clone(), meta, a.publish_every);
    let v0 = handle.published.version();
    let stop = AtomicBool::new(false);
    let (alone_tx, alone_rx) = mpsc::channel();
    let (run, trained, publisher) = std::thread::scope(|sc| {
        let publishing = sc.spawn(move || -> Result<Publisher> {
            let host = Stream::cpu(0)?;
            // Until the run ends (its keeper drops the sender).
            for kept in models_rx {
                let m = trellis_runtime::Model::with_values(
                    cfg.model.clone(),
                    kept.snapshot.params.clone(),
                )?;
                publisher.after_epoch(kept.epoch, false, &m, &host)?;
            }
            Ok(publisher)
        });
        let training = sc.spawn(|| -> Result<(Vec<f64>, Vec<BesideEpoch>)> {
            // The partition actors' threads inherit this thread's class.
            trellis_actors::priority::background_this_thread_as(a.beside_priority);
            let (gate, gate_rx) = mpsc::channel();
            let run = topo.with_epoch_gate(gate_rx).spawn()?;
            let mut alone = Vec::new();
            for _ in 0..a.beside_epochs {
                alone.push(gated_epoch(&gate, &run)?);
            }
            let _ = alone_tx.send(());
            let mut beside = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let ms = gated_epoch(&gate, &run)?;
                beside.push(BesideEpoch {
                    ms,
                    during_load: !stop.load(Ordering::Relaxed),
                });
            }
            drop(gate);
            run.wait()?;
            Ok((alone, beside))
        });
        // (a)'s load starts once the epochs alone are timed.
        let run = match alone_rx.recv() {
            Ok(()) => {
                let budget = trellis_gpu::ThreadBudget::global(a.threads);
                if let Ok(b) = &budget {
                    trellis_actors::priority::background_pool_as(b, a.beside_priority);
                }
                load()
            }
            Err(_) => Err(std::io::Error::other("training stopped before the load")),
        };
        stop.store(true, Ordering::Relaxed);
        let trained = training
            .join()
            .map_err(|_| anyhow::anyhow!("the training thread panicked"));
        let publisher = publishing
            .join()
            .map_err(|_| anyhow::anyhow!("the publishing thread panicked"));
        (run, trained, publisher)
    });
    let (alone, epochs) = trained??;
    let run = run?;
    let publisher = publisher??;
    let alone_ms = median_ms(alone);
    // Epochs that ended after the load did not run beside it all along.
    let times: Vec<f64> = epochs
        .iter()
        .filter(|e| e.during_load)
        .map(|e| e.ms)
        .collect();
    if times.is_empty() {
        anyhow::bail!(
            "(c): no training epoch ended within the {} s of load beside it; pass a longer --beside-seconds",
            a.beside_seconds
        );
    }
    let beside_ms = median_ms(times.clone());
    let r = &run.tenants[0];
    line("(c) (a) beside training", a.rate_predict, r);
    generator(&run);
    let versions = if handle.published.version() != v0 {
        "the served version advanced"
    } else {
        "the served version did not advance"
    };
    println!(
        "(c) training on {parts} partition actors, threads in the background as {:?}, streams yielding to the service's gate",
        a.beside_priority
    );
    println!(
        "(c) p99 {:.2}x (a)'s (goal <= 1.2x); training {} epoch(s) beside (ended within the load) at {:.0} ms median vs {:.0} ms alone: {:.0}% of its epoch rate (goal >= 80%); {} publishes, {} skipped while one loaded, {versions}",
        r.ms(0.99) / alone_load.tenants[0].ms(0.99).max(1e-3),
        times.len(),
        beside_ms,
        alone_ms,
        100.0 * alone_ms / beside_ms,
        publisher.published,
        publisher.skipped,
    );
    ceiling_line(alone_load);
    Ok(())
}

/// (c): the epoch time of `tr` alone, then (a)'s load while `tr` trains beside the service
/// at a lower priority, publishing its weights every `--publish-every` epochs.
fn beside_training(
    tr: &mut Trainer,
    cfg: &TrainConfig,
    handle: engine::EngineHandle,
    a: &ServeBenchArgs,
    alone_load: &LoadRun,
    load: impl FnOnce() -> std::io::Result<LoadRun>,
) -> Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let start_epoch = cfg.epochs + 1;
    let mut alone = Vec::new();
    for e in start_epoch..start_epoch + a.beside_epochs {
        let t = Instant::now();
        tr.epoch(e)?;
        alone.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let alone_ms = median_ms(alone);
    trellis_actors::priority::background_pool_as(tr.stream().budget(), a.beside_priority);
    let stop = AtomicBool::new(false);
    let first = start_epoch + a.beside_epochs;
    let mut publisher = Publisher::new(handle.clone(), meta(cfg, tr), a.publish_every);
    let v0 = handle.published.version();
    let (run, times) = std::thread::scope(|sc| {
        let trainer = sc.spawn(|| -> Result<Vec<f64>> {
            trellis_actors::priority::background_this_thread_as(a.beside_priority);
            let mut times = Vec::new();
            let mut e = first;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                tr.epoch(e)?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
                publisher.after_epoch(e, false, tr.model(), tr.stream())?;
                e += 1;
            }
            Ok(times)
        });
        let run = load();
        stop.store(true, Ordering::Relaxed);
        let times = trainer
            .join()
            .map_err(|_| anyhow::anyhow!("the training thread panicked"));
        (run, times)
    });
    let run = run?;
    let times = times??;
    let beside_ms = median_ms(times.clone());
    let r = &run.tenants[0];
    line("(c) (a) beside training", a.rate_predict, r);
    generator(&run);
    let versions = if handle.published.version() != v0 {
        "the served version advanced"
    } else {
        "the served version did not advance"
    };
    println!(
        "(c) training threads in the background as {:?}",
        a.beside_priority
    );
    println!(
        "(c) p99 {:.2}x (a)'s (goal <= 1.2x); training {} epoch(s) beside at {:.0} ms median vs {:.0} ms alone: {:.0}% of its epoch rate (goal >= 80%); {} publishes, {} skipped while one loaded, {versions}",
        r.ms(0.99) / alone_load.tenants[0].ms(0.99).max(1e-3),
        times.len(),
        beside_ms,
        alone_ms,
        100.0 * alone_ms / beside_ms,
        publisher.published,
        publisher.skipped,
    );
    ceiling_line(alone_load);
    Ok(())
}

fn start_engine(
    saved: SavedModel,
    graph: &Graph,
    features: Vec<f32>,
    owner: Vec<u32>,
    a: &ServeBenchArgs,
    gate: &PriorityGate,
) -> Result<engine::EngineHandle> {
    engine::start(
        saved,
        NodeGraph::from_graph(graph),
        features,
        owner,
        EngineConfig {
            scheduler: SchedulerConfig {
                slo: Duration::from_millis(a.slo_ms.max(1)),
                max_batch: 10_000,
                max_queue: 200_000,
                quota_rps: None,
            },
            parts: a.partitions.max(1),
            threads: a.threads,
            faults: Default::default(),
            step_timeout: engine::STEP_TIMEOUT,
            priority: Some(gate.clone()),
        },
    )
    .map_err(|e| anyhow::anyhow!("cannot start the engine: {e}"))
}
