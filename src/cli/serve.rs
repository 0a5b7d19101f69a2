//! `trellis serve`: a long-running inference service over HTTP/JSON.
use super::telemetry::TelemetryArgs;
use super::train::load_data;
use crate::serve::api::Limits;
use crate::serve::forward::{engine_forwarder, spawn_forwarding_http, ForwardConfig};
use crate::serve::{run_http_stoppable, HttpConfig};
use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use trellis_actors::cluster::serving::node::{run_serve_node, ServeNodeEnd};
use trellis_actors::cluster::serving::ClusterServing;
use trellis_actors::cluster::ClusterFile;
use trellis_actors::faults::FaultPlan;
use trellis_actors::priority::CpuSet;
use trellis_actors::serving::engine::{self, EngineConfig, EngineHandle};
use trellis_actors::serving::scheduler::SchedulerConfig;
use trellis_runtime::inference::NodeGraph;
use trellis_runtime::model_file;
use trellis_runtime::partition::{assign, PartitionMethod};
use trellis_runtime::Graph;

/// Options of `trellis serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A model file written by `trellis train --save-model` (the engine node's).
    #[arg(long, required_unless_present = "id")]
    pub model: Option<PathBuf>,
    /// The graph to serve (same forms as `trellis train --data`; the engine node's).
    #[arg(long, required_unless_present = "id")]
    pub data: Option<String>,
    /// Compute the graph's rows in this many parts (METIS); updates recompute only the
    /// affected rows, each part its own. Default: 1, on a cluster one per node.
    #[arg(long)]
    pub partitions: Option<usize>,
    /// Serve on the cluster of this cluster file (TOML, as `trellis node`): its coordinator
    /// runs the engine (with --model and --data); every other node is started with
    /// `--cluster FILE --id N` and hosts the partitions placed on it. Should the engine
    /// node be lost, the lowest-numbered surviving node takes over as the engine node, with
    /// its own serving options (start every node with the same ones), if more than half of
    /// the file's nodes reach it (the file's `takeover = "majority"`, the default; "any":
    /// whatever survives).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// This node's id in the cluster file (default: its coordinator, the engine node).
    #[arg(long, requires = "cluster")]
    pub id: Option<u32>,
    /// Join the running service of the cluster as a serving node after this node's process
    /// was lost and started again, wherever its engine node now is (also the lost engine
    /// node, started with its own id): the engine node takes it back and moves its
    /// partitions back to it. Without it, a node other than the engine node joins the
    /// cluster file's coordinator.
    #[arg(long, requires = "id", conflicts_with_all = ["model", "data"])]
    pub rejoin: bool,
    /// Write the address this node's QUIC endpoint listens on to this file (launchers).
    #[arg(long, requires = "cluster")]
    pub addr_file: Option<PathBuf>,
    /// How to partition: metis or random.
    #[arg(long, default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// Address to listen on (port 0: any free port; the chosen one is printed). On a
    /// cluster's other nodes: optional, and requests are forwarded to the engine node.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Latency objective of a query: batching adapts to it.
    #[arg(long, default_value_t = 5)]
    pub slo_ms: u64,
    /// Longest a query waits for its answer before a 503.
    #[arg(long, default_value_t = 1000)]
    pub deadline_ms: u64,
    /// Most nodes (or edges) one request may name.
    #[arg(long, default_value_t = Limits::DEFAULT.max_batch)]
    pub max_batch: usize,
    /// Most queued nodes before requests are shed (503).
    #[arg(long, default_value_t = 200_000)]
    pub max_queue: usize,
    /// Largest JSON body, bytes.
    #[arg(long, default_value_t = Limits::DEFAULT.max_body)]
    pub max_body_bytes: usize,
    /// Largest model body of PUT /v1/model, bytes.
    #[arg(long, default_value_t = Limits::DEFAULT.max_model_body)]
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
    /// The CPUs this node's HTTP workers run on (the engine node's front end, or another
    /// node's forwarding one), as `0` or `0,2-3` (default: every CPU the process may use).
    /// Keeps them off cores where another busy thread would make a woken worker wait.
    #[arg(long, value_parser = CpuSet::parse)]
    pub http_cpus: Option<CpuSet>,
    /// CPU threads for kernels (0 = all CPUs).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Fault injection into the partition actors:
    /// `serve-panic:part=P:update=U[:layer=L]` (comma separated) panics partition P when it
    /// starts layer L of the U-th graph update; it is restarted and recomputed. With
    /// `--cluster`, given to the engine node: a partition of another node fails there.
    #[arg(long)]
    pub chaos: Option<String>,
    /// Longest one layer of a pass may take on every partition, ms; once the start-up pass
    /// has run, a pass other than a full one (start-up, rebuild) gets at most ten times as
    /// long as that pass took (at least 5 s).
    #[arg(long, default_value_t = 120_000)]
    pub step_timeout_ms: u64,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// The default `--listen` of the engine node.
const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

pub fn run(a: ServeArgs) -> Result<()> {
    // Checked before the data and model are loaded (which can take minutes), not only
    // when the HTTP server starts.
    if let Some(cpus) = &a.http_cpus {
        crate::serve::check_http_cpus(cpus).map_err(|e| anyhow::anyhow!("--http-cpus: {e}"))?;
    }
    let cluster = match &a.cluster {
        Some(path) => Some(ClusterFile::load(path)?),
        None => None,
    };
    let id = match (&cluster, a.id) {
        (Some(c), Some(id)) => {
            c.node(id)?;
            id
        }
        (Some(c), None) => c.coordinator,
        (None, _) => 0,
    };
    let telemetry = a.telemetry.start(id)?;
    let result = match cluster {
        Some(c) if id != c.coordinator || a.rejoin => serve_node(&a, &c, id).map(|()| None),
        cluster => serve_engine(&a, cluster.map(|c| (c, id))),
    };
    a.telemetry.finish(telemetry);
    match result? {
        Some(id) => rejoin_in_place(id, a.listen.unwrap_or_else(default_listen)),
        None => Ok(()),
    }
}

/// A node of a serving cluster other than the engine node: hosts its partitions until the
/// engine node stops the service.
fn serve_node(a: &ServeArgs, cluster: &ClusterFile, id: u32) -> Result<()> {
    if a.model.is_some() || a.data.is_some() {
        anyhow::bail!(
            "node {id} is not the cluster's engine node (node {}): only the engine node takes --model and --data",
            cluster.coordinator
        );
    }
    let forward = ForwardConfig {
        max_body: a.max_model_bytes,
        client_timeout: Duration::from_millis(a.client_timeout_ms.max(1)),
        answer_timeout: Duration::from_millis(a.step_timeout_ms.max(1)),
        workers: a.http_workers,
        cpus: a.http_cpus,
    };
    let listen = a.listen;
    // Should the engine node be lost and this node succeed it, its engine runs with this
    // node's serving options.
    let takeover = engine_config(a, 1, Arc::default());
    // A prediction the lost engine node did not answer waits for its successor as long as
    // a query waits for its answer.
    let patience = Duration::from_millis(a.deadline_ms);
    let end = run_serve_node(
        cluster,
        id,
        a.addr_file.as_deref(),
        takeover,
        patience,
        a.rejoin,
        |parts, uplink| {
            eprintln!("node {id} serves partitions {parts:?}");
            let Some(listen) = listen else {
                return;
            };
            // This node's HTTP front end forwards to the engine node, on its own thread.
            let announce = uplink.clone();
            spawn_forwarding_http(id, uplink, forward, listen, move |addr| {
                announce.announce(addr)
            });
        },
    )
    .with_context(|| format!("serving node {id}"))?;
    match end {
        ServeNodeEnd::Finished => {
            println!("node {id} done");
            Ok(())
        }
        ServeNodeEnd::Engine {
            handle,
            uplink,
            succession,
        } => {
            println!(
                "node {id} took over as the engine node from node {}",
                succession.lost
            );
            let _ = std::io::stdout().flush();
            // The API is served on a loopback port of its own; this node's --listen front
            // end (which has forwarded to the lost engine node) now forwards to it, so its
            // clients keep their address.
            let internal: SocketAddr = "127.0.0.1:0".parse().expect("a valid address");
            let within = Duration::from_millis(a.step_timeout_ms.max(1));
            serve_api(handle, a, internal, true, move |addr, _| {
                match engine_forwarder(addr, within) {
                    Ok(f) => uplink.serve_locally(f),
                    Err(e) => {
                        eprintln!("warning: this node's front end cannot reach its engine: {e}")
                    }
                }
                eprintln!("node {id} answers as the engine node on http://{addr}");
            })
        }
    }
}

/// The engine's settings from the serving options.
fn engine_config(a: &ServeArgs, parts: usize, faults: Arc<FaultPlan>) -> EngineConfig {
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
    }
}

/// Runs the engine node (or the single process) until it is stopped; `Some(id)` when it
/// stepped down for another engine node (node `id` of a cluster goes on as a serving node).
fn serve_engine(a: &ServeArgs, cluster: Option<(ClusterFile, u32)>) -> Result<Option<u32>> {
    let (Some(model), Some(data)) = (&a.model, &a.data) else {
        anyhow::bail!("the engine node needs --model and --data");
    };
    let listen = a.listen.unwrap_or_else(default_listen);
    let ds = load_data(data)?;
    let saved = model_file::load(model)?;
    saved.check_fits(ds.num_features, ds.num_classes)?;
    let graph = Graph::from_dataset(&ds)?;
    let default_parts = cluster.as_ref().map_or(1, |(c, _)| c.nodes.len());
    let parts = a.partitions.unwrap_or(default_parts).max(1);
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
    let cfg = engine_config(a, parts, faults);
    let (graph, features) = (NodeGraph::from_graph(&graph), ds.features);
    let on_cluster = cluster.is_some();
    // Where this node would go on as a serving node, should its engine step down.
    let step_down = cluster.as_ref().map(|(_, id)| *id);
    let handle = match cluster {
        None => engine::start(saved, graph, features, owner, cfg),
        Some((cluster, id)) => {
            let c = ClusterServing {
                quorum: cluster.quorum(),
                cluster,
                id,
                addr_file: a.addr_file.clone(),
                home: None,
                lost: Vec::new(),
            };
            engine::start_on_cluster(saved, graph, features, owner, cfg, c, None)
        }
    }
    .map_err(|e| anyhow::anyhow!("cannot start serving {}: {e}", model.display()))?;
    eprintln!(
        "model {version}: every layer of {} nodes computed in {:.0} ms ({parts} part{})",
        ds.num_nodes,
        t.elapsed().as_secs_f64() * 1e3,
        if parts == 1 { "" } else { "s" }
    );
    let (stats, stopped) = (handle.stats.clone(), handle.stopped());
    serve_api(handle, a, listen, on_cluster, |addr, server| {
        println!("listening on http://{addr}");
        let _ = std::io::stdout().flush();
        if on_cluster {
            // The engine stops by itself only when it steps down for a successor (cut off
            // from the majority while another node took over): then the API goes too.
            std::thread::spawn(move || {
                while !stopped.wait(Duration::from_secs(3600)) {}
                drop(server.stop(true));
            });
        }
    })?;
    let (Some(engine), Some(id)) = (stats.deposed_by(), step_down) else {
        return Ok(None);
    };
    eprintln!("node {id} stepped down for node {engine}, the engine node now: it joins it as a serving node");
    Ok(Some(id))
}

fn default_listen() -> SocketAddr {
    DEFAULT_LISTEN.parse().expect("a valid address")
}

/// Runs this process again as serving node `id` that rejoins its cluster (an engine node
/// that stepped down), its front end on the engine's `listen` address: a fresh process
/// image (same pid, stdout and stderr; every socket is closed on exec, so its QUIC and
/// HTTP addresses are free), with nothing of the engine's threads or state left to get in
/// its way. Returns only if that fails.
fn rejoin_in_place(id: u32, listen: SocketAddr) -> Result<()> {
    let _ = std::io::stdout().flush();
    let exe = std::env::current_exe().context("cannot find this program to run it again")?;
    let args = rejoin_args(std::env::args_os().skip(1), id, listen);
    use std::os::unix::process::CommandExt;
    let e = std::process::Command::new(exe).args(args).exec();
    Err(e).with_context(|| format!("cannot run node {id} again as a serving node"))
}

/// The arguments that run an engine node's `trellis serve` (`args`, after the program) as
/// serving node `id` rejoining its cluster, its front end on `listen` (the engine's API
/// address, the default one too): the engine's own options (`--model`, `--data`,
/// `--partitions`, `--partition-method`, `--chaos`) and any `--id`, `--listen` or
/// `--rejoin` dropped, `--id ID --rejoin --listen LISTEN` added; everything else (the
/// cluster file, serving and telemetry options) kept.
fn rejoin_args(
    args: impl IntoIterator<Item = std::ffi::OsString>,
    id: u32,
    listen: SocketAddr,
) -> Vec<std::ffi::OsString> {
    const DROPPED: [&str; 7] = [
        "--model",
        "--data",
        "--partitions",
        "--partition-method",
        "--chaos",
        "--id",
        "--listen",
    ];
    let mut out = super::without_options(args, &["--rejoin"], &DROPPED);
    out.extend(["--id".into(), id.to_string().into(), "--rejoin".into()]);
    out.extend(["--listen".into(), listen.to_string().into()]);
    out
}

/// Serves the HTTP API of `handle` on `listen` until the process is stopped (or the
/// server, whose handle `on_bound` gets with the bound address); on a cluster it also
/// answers the requests other nodes forward.
fn serve_api(
    handle: EngineHandle,
    a: &ServeArgs,
    listen: SocketAddr,
    on_cluster: bool,
    on_bound: impl FnOnce(SocketAddr, actix_web::dev::ServerHandle),
) -> Result<()> {
    let cfg = HttpConfig {
        limits: Limits {
            max_batch: a.max_batch.max(1),
            max_body: a.max_body_bytes,
            max_model_body: a.max_model_bytes,
        },
        deadline: Duration::from_millis(a.deadline_ms.max(1)),
        client_timeout: Duration::from_millis(a.client_timeout_ms.max(1)),
        features: handle.features,
        classes: handle.classes,
        workers: a.http_workers,
        cpus: a.http_cpus,
    };
    let (forward_slot, answer_within) = (
        handle.http_forward.clone(),
        Duration::from_millis(a.step_timeout_ms.max(1)),
    );
    run_http_stoppable(handle, cfg, listen, |addr, server| {
        // Requests other nodes of a cluster forward are answered by this front end.
        if on_cluster {
            match engine_forwarder(addr, answer_within) {
                Ok(f) => forward_slot.set(f),
                Err(e) => {
                    eprintln!("warning: other nodes' HTTP requests cannot be answered: {e}")
                }
            }
        }
        on_bound(addr, server);
    })
    .with_context(|| format!("cannot serve on {listen}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::rejoin_args;

    #[test]
    fn an_engine_node_rejoins_as_a_serving_node_with_its_other_options() {
        let args = [
            "serve",
            "--cluster",
            "c.toml",
            "--model",
            "m.safetensors",
            "--data=synthetic:nodes=9",
            "--partitions",
            "3",
            "--listen",
            "0.0.0.0:8080",
            "--chaos",
            "x",
            "--deadline-ms",
            "3000",
        ];
        let listen = "0.0.0.0:8080".parse().unwrap();
        let out = rejoin_args(args.iter().map(Into::into), 0, listen);
        let out: Vec<&str> = out.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            out,
            [
                "serve",
                "--cluster",
                "c.toml",
                "--deadline-ms",
                "3000",
                "--id",
                "0",
                "--rejoin",
                "--listen",
                "0.0.0.0:8080"
            ]
        );
        // An engine node started without --listen served the default address: so does the
        // serving node it becomes.
        let out = rejoin_args(["serve", "--id=0"].iter().map(Into::into), 0, listen);
        assert_eq!(out.len(), 6, "{out:?}");
        assert_eq!(out[0], "serve");
    }
}
