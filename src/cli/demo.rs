//! `trellis demo`: the main job on a built-in synthetic graph. Trains single-process, with four
//! partition actors in one process, and on a local 3-node cluster (node processes on
//! loopback), then on that cluster again while a partition panics (its supervisor restarts it
//! from the replicated state) and a node's process is SIGKILLed (its partition is re-placed on
//! the node holding its replica); each interrupted epoch is replayed and every run ends with
//! the same weights. Last, it serves the trained model over HTTP on serving partition actors,
//! as `trellis serve` does, and checks the answers against layer-wise inference.
use super::launch::{launch_cluster, ClusterOptions};
use super::predict;
use super::train::{print_summary, train_single_saving, SaveAt};
use crate::serve::api::Limits;
use crate::serve::{run_http_stoppable, HttpConfig};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use trellis_actors::serving::engine::{self, EngineConfig};
use trellis_actors::serving::scheduler::SchedulerConfig;
use trellis_actors::{Recovery, Topology};
use trellis_runtime::inference::softmax_row;
use trellis_runtime::model_file;
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{DataSource, Dataset, ModelKind, RunReport, TrainConfig};

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The synthetic graph to train on.
    #[arg(
        long,
        default_value = "synthetic:nodes=20000,degree=10,features=64,classes=8,seed=0"
    )]
    pub data: String,
    /// Partition actors (METIS), spread over the 3 node processes of the cluster runs.
    #[arg(long, value_name = "P", default_value_t = 4, value_parser = super::validate::partitions)]
    pub partitions: usize,
    /// Epochs of every run (the faults fire in epochs 10 and 20 when there are that many).
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = super::validate::positive_u32)]
    pub epochs: u32,
}

pub fn run(a: DemoArgs) -> Result<()> {
    let ds = DataSource::parse(&a.data)?.load()?;
    println!(
        "data: {} ({} nodes, {} edges, {} features, {} classes)",
        ds.name,
        ds.num_nodes,
        ds.edge_src.len(),
        ds.num_features,
        ds.num_classes
    );
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    cfg.epochs = a.epochs;

    let tmp = tempfile::Builder::new().prefix("trellis-demo-").tempdir()?;
    // Served in step 5.
    let model = tmp.path().join("gcn.safetensors");

    println!("\n1. single process");
    let single = train_single_saving(ds.clone(), cfg.clone(), false, Some((&model, SaveAt::Best)))?;
    print_summary(&single);

    println!("\n2. {} partition actors (METIS), no faults", a.partitions);
    let clean = Topology::partition(&ds, a.partitions, PartitionMethod::Metis, None, cfg.clone())?
        .spawn()?
        .wait()?;
    print_summary(&clean);

    let cluster_run = |name: &str, chaos: &str| -> Result<RunReport> {
        let dir = tmp.path().join(name);
        let report = dir.join("report.json");
        let opts = ClusterOptions {
            nodes: 3,
            heartbeat_ms: 500,
            idle_timeout_ms: 1500,
            replicas: 1,
            max_restarts: 8,
            step_deadline_ms: 120_000,
        };
        let mut args: Vec<String> = vec![
            "--data".into(),
            a.data.clone(),
            "--partitions".into(),
            a.partitions.to_string(),
            "--epochs".into(),
            a.epochs.to_string(),
            "--partition-dir".into(),
            tmp.path().join("parts").display().to_string(),
            "--report".into(),
            report.display().to_string(),
        ];
        if !chaos.is_empty() {
            args.extend(["--chaos".into(), chaos.into()]);
        }
        // The nodes' own output is not shown: the summary and the recoveries below are
        // printed once each, from the report (whose temporary path is not printed).
        launch_cluster(&opts, &dir, Some(&tmp.path().join("parts")), &args, true)?;
        Ok(RunReport::read(&report)?)
    };

    println!(
        "\n3. a local cluster: 3 node processes on loopback (QUIC, mutual TLS), {} partitions, no faults",
        a.partitions
    );
    let cluster = cluster_run("clean", "")?;
    print_summary(&cluster);

    let (panic_epoch, kill_epoch) = (a.epochs / 3, 2 * a.epochs / 3);
    println!(
        "\n4. the same cluster; partition 1 panics in the backward pass of epoch {panic_epoch}, and node 2's process is SIGKILLed as epoch {kill_epoch} starts"
    );
    let chaos = format!(
        "panic:part=1:epoch={panic_epoch}:layer=0:phase=backward,kill-node:node=2:epoch={kill_epoch}"
    );
    let faulty = cluster_run("faults", &chaos)?;
    print_summary(&faulty);
    let recoveries: Vec<Recovery> =
        serde_json::from_value(faulty.recoveries.clone()).unwrap_or_default();
    for r in &recoveries {
        let what = match r.node {
            Some(n) => {
                let moved: Vec<String> = r
                    .replaced
                    .iter()
                    .map(|(p, to)| format!("partition {p} to node {to}"))
                    .collect();
                format!("node {n} lost, re-placed {}", moved.join(", "))
            }
            None => format!("partition {} panicked and was restarted", r.partition),
        };
        println!(
            "   recovery in epoch {}: {what}; detected {:.1} ms after the failure, ready to replay {:.1} ms after detection, step done again {:.1} ms after detection; restored state matched its digest: {}",
            r.epoch,
            r.detected_ms,
            r.ready_ms,
            r.resumed_ms,
            r.digest_ok.map_or("n/a".to_string(), |b| b.to_string())
        );
    }
    let max_diff = single
        .epochs_log
        .iter()
        .zip(&clean.epochs_log)
        .map(|(x, y)| (x.loss - y.loss).abs() / x.loss.abs().max(1e-12))
        .fold(0.0, f64::max);
    println!("\nsingle process vs {} partitions: max relative loss difference {max_diff:.2e}, test accuracy {:.2}% vs {:.2}%", a.partitions, 100.0 * single.test_acc, 100.0 * clean.test_acc);
    println!(
        "weights digest, {} partition actors in one process: {}",
        a.partitions, clean.weights_digest
    );
    println!(
        "weights digest, 3-node cluster without faults:      {}",
        cluster.weights_digest
    );
    println!(
        "weights digest, 3-node cluster with 2 faults:       {}",
        faulty.weights_digest
    );
    if max_diff > 1e-5 {
        bail!("partitioned training diverged from the single-process run");
    }
    if recoveries.len() != 2 {
        bail!(
            "expected 2 recoveries, the report lists {}",
            recoveries.len()
        );
    }
    if clean.weights_digest != cluster.weights_digest
        || cluster.weights_digest != faulty.weights_digest
    {
        bail!("the runs ended with different weights");
    }
    println!("recovery verified: identical weights");

    println!(
        "\n5. serving: the single-process model (best validation epoch) on {} serving partition actors, HTTP on loopback",
        a.partitions
    );
    serve_demo(&ds, a.partitions, &model)
}

/// Serves the model file `model` (run 1's) on `parts` serving partition actors over HTTP,
/// and checks a prediction and an inductive query (a new node) against layer-wise inference.
fn serve_demo(ds: &Dataset, parts: usize, model: &Path) -> Result<()> {
    let mut prepared = predict::prepare(model, ds, parts, PartitionMethod::Metis, 0)?;
    let logits = predict::predict(&mut prepared, ds)?
        .layers
        .pop()
        .context("a model has layers")?;
    let handle = engine::start(
        model_file::load(model)?,
        prepared.graph.clone(),
        ds.features.clone(),
        prepared.owner.clone(),
        EngineConfig {
            scheduler: SchedulerConfig {
                slo: Duration::from_millis(5),
                max_batch: 10_000,
                max_queue: 10_000,
                quota_rps: None,
            },
            parts,
            threads: 0,
            faults: Default::default(),
            step_timeout: engine::STEP_TIMEOUT,
            priority: None,
        },
    )
    .map_err(|e| anyhow::anyhow!("cannot start the service: {e}"))?;
    let http = HttpConfig {
        limits: Limits::DEFAULT,
        deadline: Duration::from_secs(5),
        client_timeout: Duration::from_secs(5),
        features: ds.num_features,
        classes: ds.num_classes,
        workers: 1,
        cpus: None,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        run_http_stoppable(handle, http, ([127, 0, 0, 1], 0).into(), |addr, stop| {
            let _ = tx.send((addr, stop));
        })
    });
    let (addr, stop) = rx
        .recv_timeout(Duration::from_secs(30))
        .context("the HTTP server did not start")?;
    let url = format!("http://{addr}");
    println!("listening on {url}");
    let asked = ask_service(&url, ds, &logits);
    // The stop is sent at once (its future only waits for it); the join waits for the server.
    drop(stop.stop(true));
    let _ = server.join();
    asked
}

/// The requests of [`serve_demo`] to the service at `url`.
fn ask_service(url: &str, ds: &Dataset, logits: &trellis_runtime::inference::Rows) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let post = |path: &str, body: Value| {
        let req = client.post(format!("{url}{path}")).body(body.to_string());
        rt.block_on(async {
            let resp = req.send().await?;
            let status = resp.status();
            let text = resp.text().await?;
            anyhow::ensure!(status.is_success(), "POST {path}: {status}: {text}");
            Ok::<Value, anyhow::Error>(serde_json::from_str(&text)?)
        })
    };
    let probs = |p: &Value| -> Vec<f64> {
        p["probabilities"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    };
    let nodes: Vec<u32> = (0..5).collect();
    let answer = post("/v1/predict", json!({ "nodes": nodes }))?;
    let mut worst = 0f64;
    for (p, &v) in answer["predictions"]
        .as_array()
        .context("no predictions")?
        .iter()
        .zip(&nodes)
    {
        let want = softmax_row(logits.row(v));
        let got = probs(p);
        anyhow::ensure!(got.len() == want.len(), "node {v}: {p}");
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - f64::from(*w)).abs());
        }
    }
    let classes: Vec<String> = answer["predictions"]
        .as_array()
        .map(|a| a.iter().map(|p| p["class"].to_string()).collect())
        .unwrap_or_default();
    println!(
        "POST /v1/predict {{\"nodes\": [0, 1, 2, 3, 4]}}: classes [{}] (model {}); probabilities equal layer-wise inference's (max difference {worst:.1e})",
        classes.join(", "),
        answer["model_version"].as_str().unwrap_or("?")
    );
    if worst > 1e-5 {
        bail!("the service's probabilities differ from layer-wise inference by {worst}");
    }
    // An inductive query: a new node with node 0's features and edges to nodes 1 and 2.
    let width = ds.num_features;
    let features = &ds.features[..width];
    let added = post(
        "/v1/nodes",
        json!({ "nodes": [{ "features": features, "edges": [1, 2] }] }),
    )?;
    let new = &added["predictions"][0];
    println!(
        "POST /v1/nodes (node 0's features, edges to 1 and 2): node {} class {}; rows recomputed per layer {} of {} (only its 2-hop region)",
        new["node"],
        new["class"],
        added["recomputed_rows"],
        ds.num_nodes + 1
    );
    let again = post("/v1/predict", json!({ "nodes": [new["node"].clone()] }))?;
    if probs(&again["predictions"][0]) != probs(new) {
        bail!("the new node's prediction changed between two answers: {new} vs {again}");
    }
    println!("serving verified: answers equal layer-wise inference, the new node is served");
    Ok(())
}
