//! Times incremental inference updates (new nodes with 10 random edges each) on a synthetic
//! graph three ways, side by side in one run, each update given to all three in turn (so
//! the machine's load falls on all three alike): `Inference::update` over the whole graph on
//! one thread (the computation alone), and the serving engine on 1 and on 2 partition actors
//! (`engine::start`, `Command::AddNodes`: planning, the delta to every partition, the
//! per-layer steps with their halo exchange, publishing). The 2 partitions split the nodes
//! by id parity, so nearly every edge is cut (the most halo rows).
//! `cargo run --release --example serve_update_profile -- [NODES [PARTITIONS...]]` (partition
//! counts of the engines, default 1 2).
use std::sync::Arc;
use std::time::{Duration, Instant};
use trellis::actors::serving::engine::{self, Command, EngineConfig, EngineHandle, NewNode};
use trellis::gpu::Stream;
use trellis::runtime::inference::{parts_of, Inference, NodeGraph};
use trellis::runtime::model_file::{self, ModelMeta};
use trellis::runtime::{DataSource, Graph, Model, ModelConfig, ModelKind};

/// Sends one update of new nodes and waits for its answer: the rows it recomputed.
fn add(handle: &EngineHandle, nodes: Vec<NewNode>) -> usize {
    let (tx, rx) = tokio::sync::oneshot::channel();
    assert!(handle.send(Command::AddNodes {
        nodes,
        deadline: Instant::now() + Duration::from_secs(600),
        reply: tx,
        trace: None,
    }));
    let answer = rx.blocking_recv().unwrap().unwrap();
    answer.recomputed_rows.iter().sum()
}

fn main() {
    trellis::tune_allocator();
    let nodes: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1_000_000);
    let ds = DataSource::parse(&format!(
        "synthetic:nodes={nodes},degree=20,features=128,classes=16,seed=0"
    ))
    .unwrap()
    .load()
    .unwrap();
    let mut g = NodeGraph::from_graph(&Graph::from_dataset(&ds).unwrap());
    let mut cfg = ModelConfig::paper_defaults(ModelKind::Gcn, 128, 16, 0);
    cfg.hidden = 256;
    let model = Model::new(cfg.clone()).unwrap();
    let stream = Stream::cpu(2).unwrap();
    let meta = ModelMeta {
        config: cfg.clone(),
        train_config: None,
        normalize_features: true,
        data_digest: String::new(),
        weights_digest: String::new(),
        epoch: 0,
        code_version: String::new(),
    };
    let bytes = model_file::to_bytes(&model, &stream, &meta).unwrap();
    let mut counts: Vec<usize> = std::env::args()
        .skip(2)
        .map(|s| s.parse().unwrap())
        .collect();
    if counts.is_empty() {
        counts = vec![1, 2];
    }
    let engines: Vec<(usize, EngineHandle)> = counts
        .into_iter()
        .map(|parts| {
            let owner: Vec<u32> = (0..nodes as u32).map(|v| v % parts as u32).collect();
            let t = Instant::now();
            let saved = model_file::from_bytes(&bytes, std::path::Path::new("profile")).unwrap();
            let handle = engine::start(
                saved,
                g.clone(),
                ds.features.clone(),
                owner,
                EngineConfig {
                    scheduler: Default::default(),
                    parts,
                    threads: 2,
                    faults: Arc::default(),
                    step_timeout: engine::STEP_TIMEOUT,
                    priority: None,
                },
            )
            .unwrap();
            eprintln!(
                "engine on {parts} partition actor(s): start-up pass {:.1} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
            (parts, handle)
        })
        .collect();
    let mut inf = Inference::new(model, stream, true).unwrap();
    let mut x = inf.prepare_features(ds.features.clone()).unwrap();
    let mut owner = vec![0u32; nodes];
    let t = Instant::now();
    let mut out = inf.run(&g, &x, &parts_of(&owner, 1)).unwrap();
    eprintln!(
        "whole graph, one thread: full run {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut state = 12345u64;
    let mut rnd = |m: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % m
    };
    for batch in [1usize, 1, 4, 16, 64] {
        let reps = (128 / batch).max(8);
        let mut ms = vec![0f64; engines.len() + 1];
        let mut rows = vec![0usize; engines.len() + 1];
        for _ in 0..reps {
            let new: Vec<NewNode> = (0..batch)
                .map(|_| NewNode {
                    features: (0..128).map(|_| rnd(1000) as f32 / 1000.0).collect(),
                    edges: (0..10).map(|_| rnd(nodes as u64) as u32).collect(),
                })
                .collect();
            let t = Instant::now();
            let mut changed = Vec::new();
            for n in &new {
                let v = g.add_node();
                x.data
                    .extend(inf.prepare_features(n.features.clone()).unwrap().data);
                owner.push(0);
                for &e in &n.edges {
                    if g.add_edge(v, e).unwrap() {
                        changed.push(e);
                    }
                }
                changed.push(v);
            }
            let s = inf.update(&g, &x, &mut out, &changed, &owner, 1).unwrap();
            ms[0] += t.elapsed().as_secs_f64() * 1e3;
            rows[0] += s.rows_per_layer.iter().sum::<usize>();
            for (k, (_, handle)) in engines.iter().enumerate() {
                let t = Instant::now();
                rows[k + 1] += add(handle, new.clone());
                ms[k + 1] += t.elapsed().as_secs_f64() * 1e3;
            }
        }
        let names: Vec<String> = std::iter::once("whole graph, one thread".to_string())
            .chain(
                engines
                    .iter()
                    .map(|(p, _)| format!("engine, {p} partition actor(s)")),
            )
            .collect();
        for k in 0..names.len() {
            let per = ms[k] / reps as f64;
            eprintln!(
                "batch {batch:>3} {:<28} {per:8.2} ms per update, {:.3} ms per node, {} rows per update ({:.2}x the whole-graph time)",
                names[k],
                per / batch as f64,
                rows[k] / reps,
                ms[k] / ms[0]
            );
        }
    }
}
