//! `trellis serve`: a long-running inference service over HTTP/JSON.
use super::telemetry::TelemetryArgs;
use super::train::load_data;
use crate::serve::api::Limits;
use crate::serve::{run_http, HttpConfig};
use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use trellis_actors::faults::FaultPlan;
use trellis_actors::serving::engine::{self, EngineConfig};
use trellis_actors::serving::scheduler::SchedulerConfig;
use trellis_runtime::inference::NodeGraph;
use trellis_runtime::model_file;
use trellis_runtime::partition::{assign, PartitionMethod};
use trellis_runtime::Graph;

/// Options of `trellis serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A model file written by `trellis train --save-model`.
    #[arg(long)]
    pub model: PathBuf,
    /// The graph to serve (same forms as `trellis train --data`).
    #[arg(long)]
    pub data: String,
    /// Compute the graph's rows in this many parts (METIS); updates recompute only the
    /// affected rows, each part its own.
    #[arg(long, default_value_t = 1)]
    pub partitions: usize,
    /// How to partition: metis or random.
    #[arg(long, default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// Address to listen on (port 0: any free port; the chosen one is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Latency objective of a query: batching adapts to it.
    #[arg(long, default_value_t = 5)]
    pub slo_ms: u64,
    /// Longest a query waits for its answer before a 503.
    #[arg(long, default_value_t = 1000)]
    pub deadline_ms: u64,
    /// Most nodes (or edges) one request may name.
    #[arg(long, default_value_t = 10_000)]
    pub max_batch: usize,
    /// Most queued nodes before requests are shed (503).
    #[arg(long, default_value_t = 200_000)]
    pub max_queue: usize,
    /// Largest JSON body, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Largest model body of PUT /v1/model, bytes.
    #[arg(long, default_value_t = 1 << 30)]
    pub max_model_bytes: usize,
    /// Requests per second each API key may send (unset: unlimited).
    #[arg(long)]
    pub quota_rps: Option<f64>,
    /// Longest a client may take to send a request's head, then its body.
    #[arg(long, default_value_t = 2000)]
    pub client_timeout_ms: u64,
    /// HTTP worker threads.
    #[arg(long, default_value_t = 2)]
    pub http_workers: usize,
    /// CPU threads for kernels (0 = all CPUs).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Fault injection into the partition actors:
    /// `serve-panic:part=P:update=U[:layer=L]` (comma separated) panics partition P when it
    /// starts layer L of the U-th graph update; it is restarted and recomputed.
    #[arg(long)]
    pub chaos: Option<String>,
    /// Longest one layer of a pass may take on every partition, ms.
    #[arg(long, default_value_t = 120_000)]
    pub step_timeout_ms: u64,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let telemetry = a.telemetry.start(0)?;
    let ds = load_data(&a.data)?;
    let saved = model_file::load(&a.model)?;
    saved.check_fits(ds.num_features, ds.num_classes)?;
    let graph = Graph::from_dataset(&ds)?;
    let parts = a.partitions.max(1);
    let owner = assign(
        &graph,
        &ds,
        parts,
        a.partition_method,
        saved.meta.config.seed,
    )
    .with_context(|| format!("cannot split the graph into {parts} parts"))?;
    let faults = match &a.chaos {
        Some(spec) => {
            let plan = FaultPlan::parse(spec)?;
            plan.check_serving(parts as u32, saved.meta.config.layers as u16)?;
            trellis_actors::faults::quiet_injected_panics(true);
            Arc::new(plan)
        }
        None => Arc::default(),
    };
    let version = saved.version();
    let t = std::time::Instant::now();
    let handle = engine::start(
        saved,
        NodeGraph::from_graph(&graph),
        ds.features,
        owner,
        EngineConfig {
            scheduler: SchedulerConfig {
                slo: Duration::from_millis(a.slo_ms.max(1)),
                max_batch: a.max_batch.max(1),
                max_queue: a.max_queue.max(a.max_batch),
                quota_rps: a.quota_rps,
            },
            parts,
            threads: a.threads,
            faults,
            step_timeout: Duration::from_millis(a.step_timeout_ms.max(1)),
            priority: None,
        },
    )
    .map_err(|e| anyhow::anyhow!("cannot start serving {}: {e}", a.model.display()))?;
    eprintln!(
        "model {version}: every layer of {} nodes computed in {:.0} ms ({parts} part{})",
        ds.num_nodes,
        t.elapsed().as_secs_f64() * 1e3,
        if parts == 1 { "" } else { "s" }
    );
    let cfg = HttpConfig {
        limits: Limits {
            max_batch: a.max_batch.max(1),
            max_body: a.max_body_bytes,
            max_model_body: a.max_model_bytes,
        },
        deadline: Duration::from_millis(a.deadline_ms.max(1)),
        client_timeout: Duration::from_millis(a.client_timeout_ms.max(1)),
        features: ds.num_features,
        classes: ds.num_classes,
        workers: a.http_workers,
    };
    run_http(handle, cfg, a.listen, |addr| {
        println!("listening on http://{addr}");
        let _ = std::io::stdout().flush();
    })
    .with_context(|| format!("cannot serve on {}", a.listen))?;
    a.telemetry.finish(telemetry);
    Ok(())
}
