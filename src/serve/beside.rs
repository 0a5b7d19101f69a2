//! Serving beside training (`trellis train --serve ADDR --publish-every K`): the service
//! starts with the model's initial weights before the first epoch and answers from the last
//! weights training committed, while training goes on in the same process. Every K epochs
//! (and after the last) the trainer's weights are published through the engine's model-swap
//! path (what `PUT /v1/model` does): the new version's tables are computed in the
//! background and replace the old ones between two answers, so no answer fails or mixes
//! versions, and each names the version it came from.
//!
//! Partitioned training (`--partitions P`) serves on P serving partition actors that own the
//! same nodes as the training partitions; the weights of every committed epoch come from
//! the run's replica store ([`Topology::publishing_models`]) to a publishing thread, which
//! publishes every K-th and the last.
//!
//! A cluster's training (`trellis launch --serve`, or the coordinator's `trellis node
//! --serve`) is served by an engine in its coordinator's process, on the training's own
//! QUIC endpoint, with one serving partition beside each training partition, on the same
//! node: every training node joins the service once its training is set up and hosts the
//! serving partitions of its training partitions, their update steps ahead of its training
//! (the node's training streams yield to them, its kernel pool runs in the background
//! class). The committed models come from the coordinator's own partitions' snapshots and
//! are published to every node's serving partitions ([`Beside::prepare_cluster`],
//! [`PendingBeside::start`]).
//!
//! Training runs at a lower CPU priority than the query threads
//! ([`trellis_actors::priority`]) and its streams yield to the service's update
//! steps between kernel pieces (the single trainer's, or every training partition's); a
//! publish that comes while the previous one is still being computed is skipped (the next
//! one carries newer weights anyway), except the last, which waits for it.
use super::api::Limits;
use super::forward::engine_forwarder;
use super::{run_http_stoppable, HttpConfig};
use anyhow::{anyhow, Context, Result};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;
use trellis_actors::cluster::node::{NodeEndpoint, SharedEndpoint};
use trellis_actors::cluster::serving::ClusterServing;
use trellis_actors::cluster::{ClusterJob, ServingBeside};
use trellis_actors::serving::engine::{
    self, Answer, Command, EngineConfig, EngineHandle, EngineStopped,
};
use trellis_actors::serving::scheduler::SchedulerConfig;
use trellis_actors::serving::ServeError;
use trellis_actors::{KeptModel, Topology};
use trellis_gpu::{PriorityGate, Stream};
use trellis_runtime::inference::NodeGraph;
use trellis_runtime::model_file::{self, ModelMeta, SavedModel};
use trellis_runtime::{Dataset, Graph, Model, TrainConfig, Trainer};

type Pending = oneshot::Receiver<Result<Answer, ServeError>>;

/// Publishes a trainer's weights to a serving engine every K epochs and after the last.
pub struct Publisher {
    engine: EngineHandle,
    every: u32,
    meta: ModelMeta,
    in_flight: Option<(u32, Pending)>,
    /// Publishes done, and skipped because the previous one was still loading.
    pub published: u32,
    pub skipped: u32,
}

/// What a service beside training serves, and how.
#[derive(Debug, Clone)]
pub struct BesideOptions {
    /// Where it listens (port 0: any free one).
    pub listen: SocketAddr,
    /// Publish the weights every this many epochs (and after the last).
    pub publish_every: u32,
    /// The serving partition of every node (all 0: one part); the service runs
    /// `max + 1` serving partition actors.
    pub owner: Vec<u32>,
    /// Lower the calling thread's CPU class once the service is up, so the training it then
    /// starts inherits it (in one process). A cluster's coordinator keeps its own (its
    /// control and transport threads answer the other nodes); only its kernel pool is
    /// lowered ([`Beside::prepare_cluster`]).
    pub lower_this_thread: bool,
}

/// A service running beside a training run.
pub struct Beside {
    /// The publisher, on the training thread (single-process training calls
    /// [`Beside::after_epoch`]); `None` once it moved to `publishing`.
    publisher: Option<Publisher>,
    /// The thread that publishes a partitioned run's models, handing the publisher back.
    publishing: Option<JoinHandle<Publisher>>,
    /// The service's update steps are urgent work of this gate; the trainer's stream yields
    /// to it between kernel pieces.
    pub gate: PriorityGate,
    http: std::thread::JoinHandle<()>,
    /// Stops the HTTP server.
    server: actix_web::dev::ServerHandle,
    /// Where it listens.
    pub addr: SocketAddr,
    /// On a cluster's coordinator: its QUIC endpoint once the run ended (the engine serves
    /// on it while it lives), and what says the engine stopped (it is closed after).
    endpoint: Arc<Mutex<Option<NodeEndpoint>>>,
    engine_stopped: Option<Arc<EngineStopped>>,
}

/// A service beside a cluster's training before the run's endpoint exists (see
/// [`Beside::prepare_cluster`]).
pub struct PendingBeside {
    opts: BesideOptions,
    gate: PriorityGate,
    committed: mpsc::Receiver<KeptModel>,
    handoff: mpsc::Receiver<SharedEndpoint>,
    endpoint: Arc<Mutex<Option<NodeEndpoint>>>,
    serving: ClusterServing,
}

/// The engine and HTTP front end of a service beside training, as they start.
struct Started {
    engine: EngineHandle,
    meta: ModelMeta,
    gate: PriorityGate,
    http: JoinHandle<()>,
    server: actix_web::dev::ServerHandle,
    addr: SocketAddr,
}

/// Longest a request another node forwards waits for this service's answer.
const FORWARDED_WITHIN: Duration = Duration::from_secs(120);

/// The model file bytes of `model` (`epoch`'s weights) read back as a served model.
fn saved(model: &Model, stream: &Stream, meta: &ModelMeta) -> Result<SavedModel> {
    let bytes = model_file::to_bytes(model, stream, meta)?;
    Ok(model_file::from_bytes(
        &bytes,
        Path::new(&format!("the weights of epoch {}", meta.epoch)),
    )?)
}

impl Beside {
    /// Computes every layer of `ds` with the initial weights of `cfg`'s model on the serving
    /// partitions `opts.owner` names, starts the engine and the HTTP front end on
    /// `opts.listen`, prints `listening on http://HOST:PORT`, and lowers the calling thread's
    /// priority (the trainer or partition actors it then starts inherit it).
    pub fn start(
        ds: &Dataset,
        cfg: &TrainConfig,
        data_digest: &str,
        opts: BesideOptions,
    ) -> Result<Beside> {
        let s = start_service(ds, cfg, data_digest, &opts, PriorityGate::new(), None)?;
        if opts.lower_this_thread {
            trellis_actors::priority::background_this_thread();
        }
        Ok(Beside {
            publisher: Some(Publisher::new(s.engine, s.meta, opts.publish_every)),
            publishing: None,
            gate: s.gate,
            http: s.http,
            server: s.server,
            addr: s.addr,
            endpoint: Arc::default(),
            engine_stopped: None,
        })
    }

    /// Serving beside the cluster's training `job`, driven from this process (its
    /// coordinator): the coordinator's own partitions' streams, and those of partitions it
    /// adopts, yield to the service's update steps, this process's kernel thread pool runs
    /// in the background class, and every epoch the cluster commits reaches the service
    /// from the coordinator's partitions' snapshots. Call before [`ClusterJob::spawn`], then
    /// [`PendingBeside::start`] with the run going: the engine starts on the run's endpoint
    /// once it is bound, and its partitions on the training nodes once they are set up.
    pub fn prepare_cluster(
        mut job: ClusterJob,
        opts: BesideOptions,
    ) -> Result<(ClusterJob, PendingBeside)> {
        let gate = PriorityGate::new();
        let budget = trellis_gpu::ThreadBudget::global(job.cfg.threads)?;
        trellis_actors::priority::background_pool(&budget);
        let (publish, committed) = mpsc::channel();
        let (to_service, handoff) = mpsc::channel();
        let endpoint: Arc<Mutex<Option<NodeEndpoint>>> = Arc::default();
        job.publish = Some(publish);
        job.yield_to = Some(gate.clone());
        job.serving = Some(ServingBeside {
            handoff: to_service,
            endpoint: endpoint.clone(),
        });
        let serving = ClusterServing {
            cluster: job.cluster.clone(),
            id: job.id,
            addr_file: None,
            home: None,
            lost: Vec::new(),
            // Beside a training nobody takes over (the coordinator's loss ends both), so
            // its engine goes on with any number of nodes lost.
            quorum: None,
        };
        let pending = PendingBeside {
            opts,
            gate,
            committed,
            handoff,
            endpoint,
            serving,
        };
        Ok((job, pending))
    }

    /// Called after each epoch of single-process training (see [`Publisher::after_epoch`]).
    pub fn after_epoch(
        &mut self,
        epoch: u32,
        last: bool,
        model: &Model,
        stream: &Stream,
    ) -> Result<()> {
        match &mut self.publisher {
            Some(p) => p.after_epoch(epoch, last, model, stream),
            None => Err(anyhow!(
                "the weights are published from the partitioned run's models"
            )),
        }
    }

    /// Makes partitioned training background work of the service: the partitions' streams
    /// yield to its update steps, its kernel thread pool runs in the background class, and
    /// every committed epoch's model goes to a publishing thread (every K-th epoch and the
    /// last one, `cfg.epochs`, or the last the run committed when it stopped early, are
    /// published). Call before [`Topology::spawn`].
    pub fn lower_partitions(&mut self, topo: Topology, cfg: &TrainConfig) -> Result<Topology> {
        let publisher = self
            .publisher
            .take()
            .ok_or_else(|| anyhow!("the partitioned run is already publishing"))?;
        let budget = trellis_gpu::ThreadBudget::global(cfg.threads)?;
        trellis_actors::priority::background_pool(&budget);
        let (tx, rx) = mpsc::channel::<KeptModel>();
        self.publishing = Some(publish_committed(publisher, rx, cfg)?);
        Ok(topo.yielding_to(self.gate.clone()).publishing_models(tx))
    }

    /// Lowers the trainer's kernel threads (the process's thread pool) below the query
    /// threads, and makes its stream yield to the service's update steps between kernel
    /// pieces.
    pub fn lower_training(&self, trainer: &mut Trainer) {
        trellis_actors::priority::background_pool(trainer.stream().budget());
        trainer.yield_to(self.gate.clone());
    }

    /// A function that stops `service`, if there is one (what SIGINT does where no other
    /// handler took it: partitioned and cluster training's Ctrl-C handler stops the run and
    /// calls this); without a service it does nothing.
    pub fn stopper(service: Option<&Beside>) -> impl Fn() + Send + 'static {
        let server = service.map(|s| s.server.clone());
        move || {
            if let Some(server) = &server {
                // The command is sent at once; nothing needs to wait for the stop here.
                drop(server.stop(true));
            }
        }
    }

    /// After training: keeps serving the last weights until the process is stopped (the
    /// HTTP server stops on SIGINT or SIGTERM, or through [`Beside::stopper`]).
    pub fn serve_until_stopped(self) -> Result<()> {
        let mut publisher = match (self.publisher, self.publishing) {
            (Some(p), _) => p,
            (None, Some(t)) => t
                .join()
                .map_err(|_| anyhow!("the publishing thread panicked"))?,
            (None, None) => return Err(anyhow!("the service has no publisher")),
        };
        publisher.settle(true);
        println!(
            "training finished ({} publishes, {} skipped while one was loading); still serving on http://{} until stopped",
            publisher.published, publisher.skipped, self.addr
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let served = self
            .http
            .join()
            .map_err(|_| anyhow!("the HTTP thread panicked"));
        // The engine stops once its last handle is gone, telling the other nodes' serving
        // partitions to finish; then the cluster's connections close, and the other
        // nodes' front ends stop with them.
        drop(publisher);
        if let Some(stopped) = &self.engine_stopped {
            if !stopped.wait(Duration::from_secs(10)) {
                eprintln!("warning: the serving engine did not stop within 10 s");
            }
        }
        drop(
            self.endpoint
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        served
    }
}

/// Computes every layer of `ds` with the initial weights of `cfg`'s model on the serving
/// partitions `opts.owner` names (in this process, or `on_cluster` over the training
/// nodes), their update steps holding `gate`; starts the engine and the HTTP front end on
/// `opts.listen` and prints `listening on http://HOST:PORT`.
fn start_service(
    ds: &Dataset,
    cfg: &TrainConfig,
    data_digest: &str,
    opts: &BesideOptions,
    gate: PriorityGate,
    on_cluster: Option<(ClusterServing, SharedEndpoint)>,
) -> Result<Started> {
    let (listen, owner) = (opts.listen, opts.owner.clone());
    if owner.len() != ds.num_nodes {
        return Err(anyhow!(
            "cannot serve beside training: {} nodes have a serving partition, the data has {}",
            owner.len(),
            ds.num_nodes
        ));
    }
    let parts = owner.iter().max().map_or(1, |&m| m as usize + 1);
    let meta = ModelMeta::of_training(cfg, data_digest, 0);
    // The trainer builds the same initial model from the same seed.
    let initial = Model::new(cfg.model.clone())?;
    let first = saved(&initial, &Stream::cpu(cfg.threads)?, &meta)?;
    let graph = Graph::from_dataset(ds)?;
    let engine_cfg = EngineConfig {
        scheduler: SchedulerConfig::default(),
        parts,
        threads: cfg.threads,
        faults: Default::default(),
        step_timeout: engine::STEP_TIMEOUT,
        priority: Some(gate.clone()),
    };
    let (graph_rows, features) = (NodeGraph::from_graph(&graph), ds.features.clone());
    let engine = match on_cluster {
        None => engine::start(first, graph_rows, features, owner, engine_cfg),
        Some((serving, shared)) => engine::start_on_cluster(
            first,
            graph_rows,
            features,
            owner,
            engine_cfg,
            serving,
            Some(shared),
        ),
    }
    .map_err(|e| anyhow!("cannot start serving beside training: {e}"))?;
    drop(graph);
    let http_cfg = HttpConfig {
        limits: Limits::DEFAULT,
        deadline: Duration::from_secs(1),
        client_timeout: Duration::from_secs(2),
        features: ds.num_features,
        classes: ds.num_classes,
        workers: 2,
        cpus: None,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = engine.clone();
    let http = std::thread::Builder::new()
        .name("trellis-serve-http".into())
        .spawn(move || {
            let bound = tx.clone();
            if let Err(e) = run_http_stoppable(handle, http_cfg, listen, move |addr, server| {
                let _ = bound.send(Ok((addr, server)));
            }) {
                let _ = tx.send(Err(e));
            }
        })
        .context("cannot start the HTTP thread")?;
    let (addr, server) = rx
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| anyhow!("the HTTP server did not start within 60 s"))?
        .with_context(|| format!("cannot serve on {listen}"))?;
    println!("listening on http://{addr}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    Ok(Started {
        engine,
        meta,
        gate,
        http,
        server,
        addr,
    })
}

impl PendingBeside {
    /// Starts the service once the run `cancel` belongs to has bound its endpoint: the
    /// engine on the endpoint, its partitions on the training nodes as they join (after
    /// their training's setup), the front end on `opts.listen`, which also answers the HTTP
    /// requests the other nodes forward, and the thread that publishes the committed
    /// models. On failure the run is cancelled.
    pub fn start(
        self,
        ds: &Dataset,
        cfg: &TrainConfig,
        data_digest: &str,
        cancel: &std::sync::atomic::AtomicBool,
    ) -> Result<Beside> {
        let started = self.start_engine(ds, cfg, data_digest);
        let s = match started {
            Ok(s) => s,
            Err(e) => {
                cancel.store(true, std::sync::atomic::Ordering::SeqCst);
                return Err(e);
            }
        };
        // Requests other nodes' front ends forward are answered through this one.
        let front_end = engine_forwarder(s.addr, FORWARDED_WITHIN)
            .context("cannot answer other nodes' HTTP requests")?;
        s.engine.http_forward.set(front_end);
        let engine_stopped = Some(s.engine.stopped());
        let publisher = Publisher::new(s.engine, s.meta, self.opts.publish_every);
        Ok(Beside {
            publisher: None,
            publishing: Some(publish_committed(publisher, self.committed, cfg)?),
            gate: s.gate,
            http: s.http,
            server: s.server,
            addr: s.addr,
            endpoint: self.endpoint,
            engine_stopped,
        })
    }

    fn start_engine(&self, ds: &Dataset, cfg: &TrainConfig, data_digest: &str) -> Result<Started> {
        let shared = self
            .handoff
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| anyhow!("the cluster's training did not start"))?;
        let on_cluster = Some((self.serving.clone(), shared));
        start_service(
            ds,
            cfg,
            data_digest,
            &self.opts,
            self.gate.clone(),
            on_cluster,
        )
    }
}

impl Publisher {
    /// Publishes to `engine`; `meta` describes the weights (its epoch is set per publish).
    pub fn new(engine: EngineHandle, meta: ModelMeta, every: u32) -> Self {
        Publisher {
            engine,
            every: every.max(1),
            meta,
            in_flight: None,
            published: 0,
            skipped: 0,
        }
    }

    /// Looks at the publish in flight: true if none is (any more).
    fn settle(&mut self, wait: bool) -> bool {
        let Some((epoch, mut rx)) = self.in_flight.take() else {
            return true;
        };
        let r = if wait {
            rx.blocking_recv().map_err(|_| ())
        } else {
            match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => {
                    self.in_flight = Some((epoch, rx));
                    return false;
                }
                Err(oneshot::error::TryRecvError::Closed) => Err(()),
                Ok(r) => Ok(r),
            }
        };
        match r {
            Ok(Ok(a)) => eprintln!(
                "serving the weights of epoch {epoch} (version {})",
                a.model_version
            ),
            Ok(Err(e)) => eprintln!("warning: the weights of epoch {epoch} were not served: {e}"),
            Err(()) => eprintln!("warning: the serving engine stopped"),
        }
        true
    }

    /// Called after each epoch: publishes the weights every K epochs and after the last
    /// (without waiting for the engine to compute them, except after the last).
    pub fn after_epoch(
        &mut self,
        epoch: u32,
        last: bool,
        model: &Model,
        stream: &Stream,
    ) -> Result<()> {
        if !last && !epoch.is_multiple_of(self.every) {
            return Ok(());
        }
        if !self.settle(last) {
            self.skipped += 1;
            return Ok(());
        }
        let meta = ModelMeta {
            epoch,
            ..self.meta.clone()
        };
        let model = saved(model, stream, &meta)?;
        let (tx, rx) = oneshot::channel();
        if !self.engine.send(Command::SwapModel {
            model: Box::new(model),
            reply: tx,
            trace: None,
        }) {
            return Err(anyhow!("the serving engine has stopped"));
        }
        self.published += 1;
        self.in_flight = Some((epoch, rx));
        if last {
            self.settle(true);
        }
        Ok(())
    }
}

/// Starts the thread that publishes through `publisher` every K-th committed model that
/// comes down `rx`, and the last one (`cfg.epochs`, or the last the run committed when it
/// stopped early); it hands the publisher back when `rx` closes.
fn publish_committed(
    mut publisher: Publisher,
    rx: mpsc::Receiver<KeptModel>,
    cfg: &TrainConfig,
) -> Result<JoinHandle<Publisher>> {
    let model_cfg = cfg.model.clone();
    let epochs = cfg.epochs;
    std::thread::Builder::new()
        .name("trellis-serve-publish".into())
        .spawn(move || {
            let host = match Stream::cpu(0) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("warning: --serve: no host stream to read the weights on: {e}");
                    return publisher;
                }
            };
            let publish = |p: &mut Publisher, kept: &KeptModel, last: bool| {
                let r = Model::with_values(model_cfg.clone(), kept.snapshot.params.clone())
                    .map_err(anyhow::Error::from)
                    .and_then(|m| p.after_epoch(kept.epoch, last, &m, &host));
                if let Err(e) = r {
                    eprintln!(
                        "warning: --serve: the weights of epoch {} were not published: {e:#}",
                        kept.epoch
                    );
                }
            };
            let mut newest: Option<KeptModel> = None;
            for kept in rx {
                let last = kept.epoch >= epochs;
                publish(&mut publisher, &kept, last);
                newest = (!last).then_some(kept);
            }
            // A run that stopped before its last epoch: serve what it committed last.
            if let Some(kept) = newest {
                publish(&mut publisher, &kept, true);
            }
            publisher
        })
        .context("cannot start the publishing thread")
}
