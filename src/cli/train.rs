//! `trellis train`.
use super::halo::HaloArgs;
use super::telemetry::TelemetryArgs;
use super::validate;
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use trellis_actors::checkpoint::CheckpointPolicy;
use trellis_actors::{FaultPlan, KeptModels, RunEvent, Topology, TrainingRun};
use trellis_gpu::Device;
use trellis_runtime::grad_codec::GradCodec;
use trellis_runtime::model_file::{self, ModelMeta};
use trellis_runtime::partition::PartitionMethod;
use trellis_runtime::{progress, DataSource, Dataset, ModelKind, RunReport, TrainConfig, Trainer};

/// Options of `trellis train`. Unset hyper-parameters take each paper's Cora settings, which
/// depend on the model (listed with each option).
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// A PyG export folder, an .npz, an OGB folder, or `synthetic:nodes=N,degree=D,...`.
    #[arg(long, default_value = "synthetic")]
    pub data: String,
    /// The architecture: gcn, sage (GraphSAGE, mean aggregator) or gat.
    #[arg(long, default_value = "gcn")]
    pub model: ModelKind,
    /// Training epochs (at least 1) [default: 200, every model].
    #[arg(long, value_name = "N", value_parser = validate::positive_u32)]
    pub epochs: Option<u32>,
    /// Adam learning rate (finite, above 0) [default: gcn and sage 0.01, gat 0.005].
    #[arg(long, value_name = "RATE", value_parser = validate::learning_rate)]
    pub lr: Option<f32>,
    /// Hidden layer width (per head for GAT), or one width per hidden layer, comma separated
    /// (`256,256,128`: --layers minus 1 of them) [default: gcn and sage 16, gat 8].
    #[arg(long, value_name = "WIDTH[,WIDTH...]", value_parser = super::shape::hidden_widths)]
    pub hidden: Option<super::shape::HiddenWidths>,
    #[command(flatten)]
    pub shape: super::shape::ShapeArgs,
    /// How partitions compress the weight gradients they send to the all-reduce, with error
    /// feedback (what was dropped is added to the next step's gradient): `none` (exact f32),
    /// `int8` (blocks of 256 with one scale, stochastic rounding from the seeded counter-based
    /// RNG: ~4x fewer bytes) or `topk:F` (the fraction F of largest magnitude, e.g. topk:0.01).
    /// Partitioned runs only.
    #[arg(long, value_name = "CODEC", default_value = "none")]
    pub grad_codec: GradCodec,
    /// Communication of partitioned runs: `exact` (bit-exact fp32 halo rows and gradients) or
    /// `efficient`, the setting `trellis bench comm` measured best: --halo-codec int4
    /// --staleness 1 --skip-threshold 2 --eval-skip-threshold 0.1 --max-staleness 8, exact
    /// gradients. Not together with those options or --grad-codec.
    #[arg(long, value_enum, default_value_t = CommMode::Exact, conflicts_with_all = ["halo_codec", "grad_codec", "staleness", "skip_threshold", "eval_skip_threshold", "max_staleness"])]
    pub comm: CommMode,
    /// GAT attention heads of the hidden layer (the output layer has 1) [default: 8; GAT only].
    #[arg(long, value_name = "N", value_parser = validate::heads)]
    pub heads: Option<usize>,
    /// Dropout probability, in [0, 1) [default: gcn and sage 0.5, gat 0.6 on features and
    /// attention alike].
    #[arg(long, value_name = "P", value_parser = validate::dropout)]
    pub dropout: Option<f32>,
    /// L2 weight decay of Adam (at least 0) [default: 5e-4, every model].
    #[arg(long, value_name = "DECAY", value_parser = validate::weight_decay)]
    pub weight_decay: Option<f32>,
    /// Seed of every random draw (initialisation, dropout); same seed, same weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads for kernels (0 = one per CPU; at most 4 per CPU).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = validate::threads)]
    pub threads: usize,
    /// Do not row-normalise the input features.
    #[arg(long)]
    pub no_normalize_features: bool,
    /// Partition actors (halo exchange between them) [default: train 1 (single process);
    /// launch and node 2 per node].
    #[arg(long, value_name = "P", value_parser = validate::partitions)]
    pub partitions: Option<usize>,
    /// How to partition: metis (few cut edges) or random.
    #[arg(long, default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// Use (or write) partition files in this folder instead of a temporary one.
    #[arg(long, value_name = "DIR")]
    pub partition_dir: Option<PathBuf>,
    /// Seed of the partitioner (its own: a new --seed reuses the partition files).
    #[arg(long, default_value_t = 0)]
    pub partition_seed: u64,
    /// Replace the partitioning in --partition-dir when it is another one (or corrupt)
    /// instead of stopping with an error.
    #[arg(long)]
    pub repartition: bool,
    /// Inject faults (comma separated); the run recovers and ends with the fault-free weights:
    /// `panic:part=P:epoch=E[:layer=L][:phase=forward|backward|eval|apply][:stage=2]` (partition P panics),
    /// `kill-node:node=N:epoch=E[:phase=apply]` (SIGKILL of node N's process as epoch E starts,
    /// or in its optimizer step),
    /// `cut-link:a=N:b=M:epoch=E:ms=T` (messages between nodes N and M dropped for T ms),
    /// `delay:a=N:b=M:ms=T` (messages between them wait T ms),
    /// `corrupt:a=N:b=M:epoch=E` (node N's next halo frame to M has a corrupted header).
    /// Node faults need a cluster (`launch`, `node`).
    #[arg(long, value_name = "FAULTS")]
    pub chaos: Option<String>,
    /// Write durable checkpoints (atomic: temporary file, fsync, rename) into this folder.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after every N epochs (and after the last); at least 1.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = validate::positive_u32)]
    pub checkpoint_every: u32,
    /// Keep the newest K checkpoints; a resume whose newest checkpoint fails its integrity
    /// check falls back to the one before.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub keep_checkpoints: u32,
    /// Resume from the checkpoint in --checkpoint-dir (if there is one) instead of starting
    /// over; the configuration must match, --epochs may be larger.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Write the JSON run report to this file (its folder must exist; checked before training).
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Write the trained model to this file (safetensors with PyTorch Geometric's tensor
    /// names and layouts, and metadata: model kind, layer sizes, config, digests).
    #[arg(long)]
    pub save_model: Option<PathBuf>,
    /// Which parameters --save-model writes: `best` (the epoch of best validation accuracy,
    /// which the report's test accuracy comes from) or `last`.
    #[arg(long, value_enum, default_value_t = SaveAt::Best, requires = "save_model")]
    pub save_model_at: SaveAt,
    /// Serve the model while it trains (HTTP/JSON API of `trellis serve`; port 0: any free
    /// port, printed as `listening on http://HOST:PORT`): answers come from the last
    /// published weights; after training the service keeps running until stopped. On a
    /// cluster (`launch`, the coordinator's `node`) the coordinator runs the service, with a
    /// serving partition beside each training partition on its node; another `node` given
    /// it takes queries at ADDR and forwards them to the coordinator's service.
    #[arg(long, value_name = "ADDR")]
    pub serve: Option<std::net::SocketAddr>,
    /// With --serve: publish the trainer's weights every K epochs (and after the last).
    #[arg(long, value_name = "K", default_value_t = 10, requires = "serve", value_parser = clap::value_parser!(u32).range(1..))]
    pub publish_every: u32,
    /// Print one line per epoch.
    #[arg(long)]
    pub verbose: bool,
    /// Where kernels run: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`);
    /// each partition actor gets its own stream there.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[command(flatten)]
    pub halo: HaloArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl TrainArgs {
    /// The checkpoint policy of `--checkpoint-dir`, `--checkpoint-every` and `--resume`.
    pub fn checkpoints(&self) -> Option<CheckpointPolicy> {
        self.checkpoint_dir.as_ref().map(|dir| CheckpointPolicy {
            dir: dir.clone(),
            every: self.checkpoint_every,
            keep: self.keep_checkpoints as usize,
            resume: self.resume,
        })
    }

    /// The training configuration for a loaded data set.
    /// Refuses a model that cannot fit this machine's memory on `ds`.
    pub fn config(&self, ds: &Dataset) -> Result<TrainConfig> {
        let cfg = self.config_for(ds.num_features, ds.num_classes)?;
        validate::check_fits(&cfg, ds)?;
        Ok(cfg)
    }

    /// The training configuration for `features` inputs and `classes` outputs.
    pub fn config_for(&self, features: usize, classes: usize) -> Result<TrainConfig> {
        let mut cfg = TrainConfig::paper_defaults(self.model, features, classes, self.seed);
        if let Some(e) = self.epochs {
            cfg.epochs = e;
        }
        if let Some(v) = self.lr {
            cfg.lr = v;
        }
        self.shape.apply(&mut cfg.model, self.hidden.as_ref())?;
        if let Some(v) = self.heads {
            cfg.model.heads = v;
        }
        if let Some(v) = self.dropout {
            cfg.model.dropout = v;
            if self.model == ModelKind::Gat {
                cfg.model.attn_dropout = v;
            }
        }
        if let Some(v) = self.weight_decay {
            cfg.weight_decay = v;
        }
        cfg.grad_codec = self.grad_codec();
        cfg.threads = self.threads;
        cfg.partition_seed = self.partition_seed;
        cfg.halo = self.halo_config();
        cfg.normalize_features = !self.no_normalize_features;
        cfg.device = self
            .device
            .parse()
            .with_context(|| format!("cannot use --device {}", self.device))?;
        Ok(cfg)
    }
}

/// How partitions communicate (`--comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CommMode {
    /// Bit-exact: fp32 halo rows, f32 gradients.
    Exact,
    /// int4 halo rows of the previous epoch, rows that barely changed skipped (at most 8
    /// epochs old); exact gradients.
    Efficient,
}

impl TrainArgs {
    /// The gradient codec `--grad-codec` chose (`--comm efficient` keeps gradients exact: on
    /// Cora their error-feedback residual, replicated with every step, cost more link bytes
    /// and epoch time than the compression saved).
    pub fn grad_codec(&self) -> GradCodec {
        self.grad_codec
    }

    /// The halo settings the halo options or `--comm` chose.
    pub fn halo_config(&self) -> trellis_runtime::comm::HaloConfig {
        match self.comm {
            CommMode::Exact => self.halo.config(),
            CommMode::Efficient => trellis_runtime::comm::HaloConfig::efficient(),
        }
    }
}

/// Which epoch's parameters `--save-model` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SaveAt {
    /// The epoch of best validation accuracy.
    Best,
    /// The last epoch.
    Last,
}

/// Writes the trainer's model (the epoch `at` says) to `path`.
pub fn save_model(trainer: &Trainer, at: SaveAt, path: &Path) -> Result<()> {
    let best = match at {
        SaveAt::Best => trainer.best_model()?,
        SaveAt::Last => None,
    };
    match &best {
        Some((epoch, model)) => {
            // A host copy: its values are read on a host stream.
            let host = trellis_gpu::Stream::cpu(0)?;
            write_model(
                path,
                model,
                &host,
                *epoch,
                trainer.config(),
                trainer.data_digest(),
            )
        }
        None => write_model(
            path,
            trainer.model(),
            trainer.stream(),
            trainer.config().epochs,
            trainer.config(),
            trainer.data_digest(),
        ),
    }
}

/// Writes the model a partitioned run kept (the epoch `at` says) to `path`. A best epoch
/// trained before the run resumed from a checkpoint is not kept (checkpoints hold the last
/// state only): the last epoch's model is written instead, saying so.
pub fn save_kept_model(
    kept: &KeptModels,
    at: SaveAt,
    cfg: &TrainConfig,
    data_digest: &str,
    best_epoch: u32,
    path: &Path,
) -> Result<()> {
    let chosen = match (at, &kept.best) {
        (SaveAt::Best, Some(b)) => b,
        (SaveAt::Best, None) => {
            eprintln!(
                "warning: --save-model: the best validation epoch ({best_epoch}) was trained \
                 before this run resumed from its checkpoint, and its parameters are not kept; \
                 writing the last epoch's"
            );
            kept.last
                .as_ref()
                .ok_or_else(|| anyhow!("the run kept no model"))?
        }
        (SaveAt::Last, _) => kept
            .last
            .as_ref()
            .ok_or_else(|| anyhow!("the run kept no model"))?,
    };
    let model =
        trellis_runtime::Model::with_values(cfg.model.clone(), chosen.snapshot.params.clone())?;
    let host = trellis_gpu::Stream::cpu(0)?;
    write_model(path, &model, &host, chosen.epoch, cfg, data_digest)
}

/// Writes `model` (its values read on `stream`), trained for `epoch` epochs with `cfg` on
/// data `data_digest`, to `path` as a model file.
fn write_model(
    path: &Path,
    model: &trellis_runtime::Model,
    stream: &trellis_gpu::Stream,
    epoch: u32,
    cfg: &TrainConfig,
    data_digest: &str,
) -> Result<()> {
    let meta = ModelMeta::of_training(cfg, data_digest, epoch);
    model_file::save(path, model, stream, &meta)
        .with_context(|| format!("cannot write the model to {}", path.display()))?;
    println!(
        "model (epoch {epoch}) written to {} ({} parameters)",
        path.display(),
        model.num_parameters()
    );
    Ok(())
}

/// Loads the data named by `--data`.
pub fn load_data(spec: &str) -> Result<Dataset> {
    let src = DataSource::parse(spec).with_context(|| format!("cannot use --data {spec}"))?;
    let sp = progress::spinner("loading");
    let ds = src.load().with_context(|| format!("cannot load {spec}"))?;
    sp.finish_and_clear();
    for w in ds.split_warnings() {
        eprintln!("warning: {spec}: {w}");
    }
    Ok(ds)
}

/// Trains single-process and returns the report.
pub fn train_single(ds: Dataset, cfg: TrainConfig, verbose: bool) -> Result<RunReport> {
    train_single_saving(ds, cfg, verbose, None)
}

/// As [`train_single`], writing the model to `save.0` afterwards when asked.
pub fn train_single_saving(
    ds: Dataset,
    cfg: TrainConfig,
    verbose: bool,
    save: Option<(&Path, SaveAt)>,
) -> Result<RunReport> {
    let pb = progress::bar(cfg.epochs as u64, "training");
    let mut trainer = Trainer::from_dataset(ds, cfg)?;
    let report = trainer.run(|log| {
        pb.inc(1);
        if verbose {
            pb.suspend(|| {
                println!(
                    "epoch {:>4}  loss {:.4}  train {:.3}  val {:.3}  test {:.3}  {:.1} ms",
                    log.epoch, log.loss, log.train_acc, log.val_acc, log.test_acc, log.ms
                )
            });
        }
    })?;
    pb.finish_and_clear();
    if let Some((path, at)) = save {
        save_model(&trainer, at, path)?;
    }
    Ok(report)
}

/// Trains with `a.partitions` partition actors (partitioning, faults and checkpoints as `a`
/// says) through the topology API, with the service of `--serve` beside it when asked (on
/// serving partition actors owning the same nodes as the training partitions, see
/// [`crate::serve::beside`]); returns the report and the service, still running.
pub fn train_partitioned(
    ds: &Dataset,
    cfg: TrainConfig,
    a: &TrainArgs,
) -> Result<(RunReport, Option<crate::serve::beside::Beside>)> {
    let epochs = cfg.epochs as u64;
    let faults = a
        .chaos
        .as_deref()
        .map(FaultPlan::parse)
        .transpose()?
        .unwrap_or_default();
    let parts = a.partitions.unwrap_or(1);
    let dir = a.partition_dir.as_deref();
    if let (true, Some(d)) = (a.repartition, dir) {
        trellis_runtime::partition::remove_partitions(d)?;
    }
    let mut topo =
        Topology::partition(ds, parts, a.partition_method, dir, cfg.clone())?.with_faults(faults);
    if let Some(pol) = a.checkpoints() {
        topo = topo.with_checkpoints(pol);
    }
    if a.save_model.is_some() {
        topo = topo.keeping_models();
    }
    let data_digest = topo.book().data_digest.clone();
    let mut service = None;
    if let Some(listen) = a.serve {
        let opts = crate::serve::beside::BesideOptions {
            listen,
            publish_every: a.publish_every,
            owner: topo.owners()?,
            lower_this_thread: true,
        };
        let mut s = crate::serve::beside::Beside::start(ds, &cfg, &data_digest, opts)?;
        topo = s.lower_partitions(topo, &cfg)?;
        service = Some(s);
    }
    let (report, kept) = follow(
        topo.spawn()?,
        epochs,
        a.verbose,
        crate::serve::beside::Beside::stopper(service.as_ref()),
    )?;
    if let Some(path) = &a.save_model {
        save_kept_model(
            &kept,
            a.save_model_at,
            &cfg,
            &data_digest,
            report.best_epoch,
            path,
        )?;
    }
    Ok((report, service))
}

/// Shows a run's progress (a bar on a terminal, per-epoch lines with `verbose`, every
/// recovery), stops it on Ctrl-C, and returns its report and the models it kept; calls
/// `on_ctrl_c` too on every Ctrl-C (this process's SIGINT handler from now on: `--serve`
/// stops its service there).
pub fn follow(
    run: TrainingRun,
    epochs: u64,
    verbose: bool,
    on_ctrl_c: impl Fn() + Send + 'static,
) -> Result<(RunReport, KeptModels)> {
    let cancel = run.canceller();
    // Ctrl-C stops the run after the step in progress; actors and threads are joined.
    let _ = ctrlc::set_handler(move || {
        cancel.store(true, std::sync::atomic::Ordering::SeqCst);
        on_ctrl_c();
    });
    let pb = progress::bar(epochs, "training");
    for ev in run.events() {
        match ev {
            RunEvent::Epoch(log) => {
                pb.inc(1);
                if verbose {
                    pb.suspend(|| {
                        println!(
                            "epoch {:>4}  loss {:.4}  val {:.3}  test {:.3}  {:.1} ms (compute {:.1}, comm {:.1}, halo {} KiB, fp32 {} KiB)",
                            log.epoch, log.loss, log.val_acc, log.test_acc, log.ms, log.compute_ms, log.comm_ms, log.halo_bytes / 1024, log.halo_fp32_bytes / 1024
                        )
                    });
                }
            }
            RunEvent::Recovered(r) => pb.suspend(|| {
                let what = match r.node {
                    Some(n) => {
                        let moved: Vec<String> = r
                            .replaced
                            .iter()
                            .map(|(p, to)| format!("{p}->node {to}"))
                            .collect();
                        format!("loss of node {n} (partitions {})", moved.join(", "))
                    }
                    None => format!("{} of partition {}", r.kind, r.partition),
                };
                let check = match r.digest_ok {
                    Some(true) => ", restored state matched its digest",
                    Some(false) => ", RESTORED STATE DID NOT MATCH ITS DIGEST",
                    None => "",
                };
                println!(
                    "recovered: {what} in epoch {}: detected {:.1} ms after the failure, ready to replay {:.1} ms and resumed {:.1} ms after detection, {} step(s) replayed{check}",
                    r.epoch, r.detected_ms, r.ready_ms, r.resumed_ms, r.steps_replayed
                )
            }),
            RunEvent::Profile(_) => {}
        }
    }
    pb.finish_and_clear();
    Ok(run.wait_with_models()?)
}

pub fn run(a: TrainArgs) -> Result<()> {
    let device: Device = a
        .device
        .parse()
        .with_context(|| format!("cannot use --device {}", a.device))?;
    // Clear errors (what is missing, where the report cannot go) before any data is loaded.
    device.check_available()?;
    let partitioned = a.partitions.is_some_and(|p| p > 1)
        || a.partition_dir.is_some()
        || a.chaos.is_some()
        || a.checkpoint_dir.is_some();
    if !partitioned && a.comm == CommMode::Efficient {
        bail!("--comm efficient sets how partition actors communicate: use it with --partitions P (P >= 2)");
    }
    if !partitioned && !a.grad_codec.is_none() {
        bail!(
            "--grad-codec {} compresses what partition actors send to the all-reduce: use it \
             with --partitions P (P >= 2)",
            a.grad_codec
        );
    }
    a.halo.check_partitioned(partitioned)?;
    if let Some(path) = &a.report {
        check_report_path(path)?;
    }
    let telemetry = a.telemetry.start(0)?;
    let ds = load_data(&a.data)?;
    let cfg = a.config(&ds)?;
    let mut beside = None;
    let report = if partitioned {
        let (report, service) = train_partitioned(&ds, cfg, &a)?;
        beside = service;
        report
    } else if let Some(listen) = a.serve {
        let save = a.save_model.as_deref().map(|p| (p, a.save_model_at));
        let (report, service) = train_serving(ds, cfg, listen, a.publish_every, a.verbose, save)?;
        beside = Some(service);
        report
    } else {
        let save = a.save_model.as_deref().map(|p| (p, a.save_model_at));
        train_single_saving(ds, cfg, a.verbose, save)?
    };
    let mut report = report;
    report.code_commit = crate::build_info::commit().map(str::to_string);
    print_summary(&report);
    if let Some(path) = &a.report {
        write_report(&report, path)?;
    }
    // The service's spans are exported for as long as it serves.
    let served = beside.map(|s| s.serve_until_stopped());
    a.telemetry.finish(telemetry);
    served.transpose()?;
    Ok(())
}

/// Trains single-process with the service of `--serve` beside it (see
/// [`crate::serve::beside`]); returns the report and the service, still running.
fn train_serving(
    ds: Dataset,
    cfg: TrainConfig,
    listen: std::net::SocketAddr,
    every: u32,
    verbose: bool,
    save: Option<(&Path, SaveAt)>,
) -> Result<(RunReport, crate::serve::beside::Beside)> {
    let opts = crate::serve::beside::BesideOptions {
        listen,
        publish_every: every,
        owner: vec![0; ds.num_nodes],
        lower_this_thread: true,
    };
    let mut service = crate::serve::beside::Beside::start(&ds, &cfg, &ds.digest(), opts)?;
    let epochs = cfg.epochs;
    let mut trainer = Trainer::from_dataset(ds, cfg)?;
    service.lower_training(&mut trainer);
    let report = trainer.run_with_model(|log, model, stream| {
        if verbose {
            println!(
                "epoch {:>4}  loss {:.4}  train {:.3}  val {:.3}  test {:.3}  {:.1} ms",
                log.epoch, log.loss, log.train_acc, log.val_acc, log.test_acc, log.ms
            );
        }
        service
            .after_epoch(log.epoch, log.epoch == epochs, model, stream)
            .map_err(|e| trellis_runtime::RuntimeError::Config(format!("--serve: {e:#}")))
    })?;
    if let Some((path, at)) = save {
        save_model(&trainer, at, path)?;
    }
    Ok((report, service))
}

/// Fails unless a report can be created at `path`: its folder exists and is writable, and
/// the path is not a folder. Called before training, so that a bad path costs no run.
pub fn check_report_path(path: &Path) -> Result<()> {
    if path.is_dir() {
        bail!(
            "--report {}: is a folder; name a file in it",
            path.display()
        );
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !folder.is_dir() {
        bail!(
            "--report {}: folder {} does not exist (create it first)",
            path.display(),
            folder.display()
        );
    }
    tempfile::NamedTempFile::new_in(folder).map_err(|e| {
        anyhow!(
            "--report {}: cannot write into folder {}: {e}",
            path.display(),
            folder.display()
        )
    })?;
    Ok(())
}

/// Writes `report` to `path`; if that fails after all, prints the report (JSON) to stderr so
/// that the run's results are not lost, and returns the error.
pub fn write_report(report: &RunReport, path: &Path) -> Result<()> {
    match report.write(path) {
        Ok(()) => {
            println!("report written to {}", path.display());
            Ok(())
        }
        Err(e) => {
            if let Ok(json) = serde_json::to_string_pretty(report) {
                eprintln!("the report could not be written; here it is:\n{json}");
            }
            Err(anyhow!("--report {}: {e}", path.display()))
        }
    }
}

/// What replicating the partitions' state cost, per epoch: the state replicated, the bytes
/// sent for it, and the time it held up the training step (None without replication).
pub fn replication_summary(r: &RunReport) -> Option<String> {
    let logs = &r.epochs_log;
    let bytes: u64 = logs.iter().map(|l| l.replica_bytes).sum();
    let ms: f64 = logs.iter().map(|l| l.replica_ms).sum();
    if logs.is_empty() || (bytes == 0 && ms == 0.0) {
        return None;
    }
    let wire = r.counter_total(trellis_runtime::metrics::names::REPLICA_WIRE_BYTES);
    let mirrored = r.counter_total(trellis_runtime::metrics::names::REPLICA_MIRRORED_BYTES);
    let step_ms: f64 = logs.iter().map(|l| l.ms).sum();
    let n = logs.len() as f64;
    let kib = |b: u64| b as f64 / n / 1024.0;
    // A clause about `b` bytes per epoch, only where there were any.
    let clause = |b: u64, text: &dyn Fn(f64) -> String| {
        if b > 0 {
            text(kib(b))
        } else {
            String::new()
        }
    };
    let left_out = clause(mirrored, &|k| {
        format!(
            "; {k:.1} KiB per epoch of the state left out, which partitions on other nodes hold"
        )
    });
    let sent = clause(wire, &|k| {
        format!(" ({k:.1} KiB per epoch sent to the replica nodes: whole, or the bytes that changed{left_out})")
    });
    Some(format!(
        "replication: {:.1} KiB per epoch of state{sent}, {:.3} ms per epoch on the step's \
         critical path ({:.2}% of the training step)",
        kib(bytes),
        ms / n,
        100.0 * ms / step_ms.max(f64::MIN_POSITIVE)
    ))
}

/// One paragraph describing a finished run.
pub fn print_summary(r: &RunReport) {
    println!(
        "{} on {} ({} partition{}): test accuracy {:.2}% at best validation epoch {} (val {:.2}%), \
         median training step {:.1} ms, peak RSS {:.1} MiB\nweights_digest {}",
        r.model,
        r.dataset,
        r.partitions,
        if r.partitions == 1 { "" } else { "s" },
        100.0 * r.test_acc,
        r.best_epoch,
        100.0 * r.best_val_acc,
        r.step_ms_median,
        r.peak_rss_bytes as f64 / (1 << 20) as f64,
        r.weights_digest
    );
    let (sent, exact) = r.epochs_log.iter().fold((0u64, 0u64), |(s, e), l| {
        (s + l.grad_bytes, e + l.grad_bytes_exact)
    });
    if sent != exact && !r.epochs_log.is_empty() {
        let per_epoch = |b: u64| b as f64 / r.epochs_log.len() as f64 / 1024.0;
        println!(
            "gradients to the all-reduce: {:.1} KiB per epoch sent, {:.1} KiB exact ({:.1}x fewer bytes)",
            per_epoch(sent),
            per_epoch(exact),
            exact as f64 / sent.max(1) as f64
        );
    }
    for n in &r.nodes {
        println!(
            "node {} at {}: partitions {:?}, sent {:.1} MiB, received {:.1} MiB",
            n.node,
            n.addr,
            n.partitions,
            n.bytes_sent as f64 / (1 << 20) as f64,
            n.bytes_received as f64 / (1 << 20) as f64
        );
    }
    if let Some(line) = super::halo::summary(r) {
        println!("{line}");
    }
    if let Some(line) = replication_summary(r) {
        println!("{line}");
    }
    if let Some(t) = &r.trace_id {
        println!("trace_id {t}");
    }
}
