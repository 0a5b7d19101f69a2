//! `trellis bench serve`: the serving service under open-loop Poisson load over real HTTP on
//! loopback, for (a) predictions of existing nodes and (b) new-node inductive queries, with
//! latency quantiles, the achieved rate and this machine's memory bandwidth.
use super::train::load_data;
use crate::serve::api::Limits;
use crate::serve::loadgen::{run_open_loop, LoadResult, LoadSpec};
use crate::serve::{run_http, HttpConfig};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use trellis_actors::serving::engine::{self, EngineConfig};
use trellis_actors::serving::scheduler::SchedulerConfig;
use trellis_gpu::{bench, Stream};
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
    /// Arrival rate of (a), existing-node predictions, per second.
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
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    let ds = load_data(&a.data)?;
    let stream = Stream::cpu(a.threads)?;
    let triad = bench::triad_bandwidth_gbs(256 << 20, stream.budget());
    let saved = match &a.model {
        Some(p) => model_file::load(p)?,
        None => {
            let mut cfg =
                TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
            cfg.model.hidden = a.hidden;
            cfg.epochs = a.train_epochs;
            cfg.threads = a.threads;
            let t = Instant::now();
            let mut trainer = Trainer::new(&ds, cfg.clone())?;
            trainer.run(|_| {})?;
            eprintln!(
                "trained GCN hidden {} for {} epoch(s) in {:.1} s",
                a.hidden,
                a.train_epochs,
                t.elapsed().as_secs_f64()
            );
            let meta = ModelMeta {
                config: cfg.model.clone(),
                train_config: None,
                normalize_features: cfg.normalize_features,
                data_digest: trainer.data_digest().to_string(),
                weights_digest: String::new(),
                epoch: cfg.epochs,
                code_version: env!("CARGO_PKG_VERSION").to_string(),
            };
            let bytes = model_file::to_bytes(trainer.model(), trainer.stream(), &meta)?;
            model_file::from_bytes(&bytes, std::path::Path::new("trained model"))?
        }
    };
    saved.check_fits(ds.num_features, ds.num_classes)?;
    let (n, width) = (ds.num_nodes, ds.num_features);
    let graph = Graph::from_dataset(&ds)?;
    let parts = a.partitions.max(1);
    let owner = assign(&graph, &ds, parts, PartitionMethod::Metis, 0)?;
    let t = Instant::now();
    let handle = start_engine(saved, &graph, ds.features, owner, &a)?;
    drop(graph);
    eprintln!(
        "layer-wise inference over {n} nodes: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let cfg = HttpConfig {
        limits: Limits {
            max_batch: 10_000,
            max_body: 4 << 20,
            max_model_body: 1 << 30,
        },
        deadline: Duration::from_secs(1),
        client_timeout: Duration::from_secs(5),
        features: width,
        classes: ds.num_classes,
        workers: 1,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = run_http(
            handle,
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
    let spec = |rate: f64, seed: u64| LoadSpec {
        addr,
        rate,
        duration: Duration::from_secs(a.seconds),
        connections: a.connections,
        seed,
        api_key: None,
    };
    println!(
        "trellis bench serve: {} ({n} nodes), GCN hidden {}, {parts} part(s), SLO {} ms, {} s per workload, memory bandwidth (STREAM triad) {triad:.1} GB/s",
        ds.name, a.hidden, a.slo_ms, a.seconds
    );
    let existing = run_open_loop(&spec(a.rate_predict, 1), |rng| {
        let v = rng.below(n as u64);
        ("/v1/predict", format!("{{\"nodes\":[{v}]}}").into_bytes())
    })?;
    line("(a) existing-node predict", a.rate_predict, &existing);
    let k = a.new_edges;
    let new = run_open_loop(&spec(a.rate_new, 2), |rng| {
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
    line("(b) new-node inductive", a.rate_new, &new);
    if a.rate_light > 0.0 {
        let query = move |rng: &mut crate::serve::loadgen::Rng| {
            let v = rng.below(n as u64);
            ("/v1/predict", format!("{{\"nodes\":[{v}]}}").into_bytes())
        };
        let light = |seed| LoadSpec {
            api_key: Some("light".into()),
            ..spec(a.rate_light, seed)
        };
        let alone = run_open_loop(&light(3), query)?;
        line("(d) light tenant alone", a.rate_light, &alone);
        let heavy_spec = LoadSpec {
            api_key: Some("heavy".into()),
            ..spec(10.0 * a.rate_light, 4)
        };
        let heavy = std::thread::spawn(move || run_open_loop(&heavy_spec, query));
        let beside = run_open_loop(&light(5), query)?;
        let heavy = heavy
            .join()
            .map_err(|_| anyhow::anyhow!("the heavy tenant's load thread panicked"))??;
        line("(d) light beside 10x heavy", a.rate_light, &beside);
        line("(d) the heavy tenant", 10.0 * a.rate_light, &heavy);
        println!(
            "light tenant p99 beside the heavy one: {:.2}x alone (goal <= 1.2x)",
            beside.ms(0.99) / alone.ms(0.99).max(1e-3)
        );
    }
    Ok(())
}

fn start_engine(
    saved: SavedModel,
    graph: &Graph,
    features: Vec<f32>,
    owner: Vec<u32>,
    a: &ServeBenchArgs,
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
            panic_on_updates: Vec::new(),
        },
    )
    .map_err(|e| anyhow::anyhow!("cannot start the engine: {e}"))
}
