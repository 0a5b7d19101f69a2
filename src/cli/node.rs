//! `trellis node`: runs one node of a cluster described by a cluster file. The coordinator
//! node takes the training options (`--data`, `--model`, ...), partitions the data into the
//! cluster's partition folder if it does not hold a matching partitioning yet, and drives the
//! run; every other node only needs `--cluster` and `--id`. With `--serve ADDR` the
//! coordinator also serves the model while the cluster trains it, every node hosting the
//! serving partitions beside its training partitions ([`crate::serve::beside`]), and goes
//! on serving the last weights after the run; another
//! node given `--serve ADDR` takes the same HTTP API there and forwards every request to
//! the coordinator's service over QUIC, until the coordinator stops serving.
use super::train::{
    check_report_path, follow, load_data, print_summary, save_kept_model, write_report, TrainArgs,
};
use crate::serve::beside::{Beside, BesideOptions};
use crate::serve::forward::{spawn_forwarding_http, ForwardConfig};
use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use trellis_actors::cluster::worker::OnUplink;
use trellis_actors::cluster::{run_worker, ClusterFile, ClusterJob};
use trellis_runtime::partition::open_or_partition;

#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// The cluster file (TOML): nodes, placement, certificates, partition folder, timeouts.
    #[arg(long)]
    pub cluster: PathBuf,
    /// This node's id in the cluster file.
    #[arg(long)]
    pub id: u32,
    /// Write the address this node listens on to this file (for launchers; ephemeral ports).
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
    /// Training options (used by the coordinator node; `--partitions` defaults to 2 per node).
    #[command(flatten)]
    pub train: TrainArgs,
}

pub fn run(a: NodeArgs) -> Result<()> {
    let cluster = ClusterFile::load(&a.cluster)?;
    // Every node exports its own spans (with its node id); they join the coordinator's trace
    // through the trace context carried in control messages and halo blocks.
    let telemetry = a.train.telemetry.start(a.id)?;
    let result = run_node(&a, cluster);
    // The service's spans are exported for as long as it serves.
    let result = result.and_then(|service| service.map_or(Ok(()), |s| s.serve_until_stopped()));
    a.train.telemetry.finish(telemetry);
    result
}

/// Runs this node's part of the training; the coordinator returns the service of `--serve`,
/// still running.
fn run_node(a: &NodeArgs, cluster: ClusterFile) -> Result<Option<Beside>> {
    if a.id != cluster.coordinator {
        cluster.node(a.id)?;
        let threads = (a.train.threads != 0).then_some(a.train.threads);
        let http = a
            .train
            .serve
            .map(|listen| forward_to_coordinator(a.id, listen));
        let traffic = run_worker(&cluster, a.id, a.addr_file.as_deref(), threads, http)?;
        println!(
            "node {} done: partitions {:?}, sent {} bytes, received {} bytes",
            traffic.node, traffic.partitions, traffic.bytes_sent, traffic.bytes_received
        );
        return Ok(None);
    }
    let t = &a.train;
    if let Some(path) = &t.report {
        check_report_path(path)?;
    }
    let parts = t.partitions.unwrap_or(2 * cluster.nodes.len());
    let ds = load_data(&t.data)?;
    let cfg = t.config(&ds)?;
    let dir = t
        .partition_dir
        .clone()
        .unwrap_or_else(|| cluster.partitions_of(a.id));
    if t.repartition {
        trellis_runtime::partition::remove_partitions(&dir)?;
    }
    let set = open_or_partition(&ds, parts, t.partition_method, cfg.partition_seed, &dir)
        .with_context(|| format!("cannot partition into {}", dir.display()))?;
    let epochs = cfg.epochs as u64;
    let (cfg_saved, data_digest) = (cfg.clone(), set.book().data_digest.clone());
    let mut job = ClusterJob {
        cluster,
        id: a.id,
        set,
        cfg,
        chaos: t.chaos.clone().unwrap_or_default(),
        addr_file: a.addr_file.clone(),
        checkpoints: t.checkpoints(),
        keep_models: t.save_model.is_some(),
        publish: None,
        yield_to: None,
        serving: None,
    };
    let mut pending = None;
    if let Some(listen) = t.serve {
        let opts = BesideOptions {
            listen,
            publish_every: t.publish_every,
            owner: job.set.owners()?,
            lower_this_thread: false,
        };
        let (prepared, p) = Beside::prepare_cluster(job, opts)?;
        job = prepared;
        pending = Some(p);
    }
    let run = job.spawn()?;
    // The service starts with the run: its engine on the run's endpoint, its partitions on
    // the training nodes once they are set up.
    let service = match pending {
        Some(p) => Some(p.start(&ds, &cfg_saved, &data_digest, &run.canceller())?),
        None => None,
    };
    drop(ds);
    let (mut report, kept) = follow(run, epochs, t.verbose, Beside::stopper(service.as_ref()))?;
    if let Some(path) = &t.save_model {
        save_kept_model(
            &kept,
            t.save_model_at,
            &cfg_saved,
            &data_digest,
            report.best_epoch,
            path,
        )?;
    }
    report.code_commit = crate::build_info::commit().map(str::to_string);
    print_summary(&report);
    if let Some(path) = &t.report {
        write_report(&report, path)?;
    }
    Ok(service)
}

/// Node `id`'s HTTP front end on `listen` (serving beside a cluster's training): every
/// request goes over QUIC to the coordinator's service and is answered with its answer.
fn forward_to_coordinator(id: u32, listen: SocketAddr) -> OnUplink {
    let cfg = ForwardConfig {
        max_body: 1 << 30,
        client_timeout: Duration::from_secs(2),
        answer_timeout: Duration::from_secs(120),
        workers: 2,
        cpus: None,
    };
    Box::new(move |uplink| {
        spawn_forwarding_http(id, uplink, cfg, listen, move |_| {
            eprintln!("node {id} forwards HTTP requests to the coordinator's service");
        });
    })
}
