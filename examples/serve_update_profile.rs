//! Times incremental inference updates (new nodes with random edges) on a synthetic graph:
//! first `Inference::update` over the whole graph on one thread (the computation alone),
//! then the same kind of updates through the serving engine on 1 and 2 partition actors
//! (`engine::start`, `Command::AddNodes`: planning, the delta to every partition, the
//! per-layer steps and their halo exchange, publishing), side by side in one run.
//! `cargo run --release --example serve_update_profile -- [NODES]`
use std::sync::Arc;
use std::time::{Duration, Instant};
use trellis::actors::serving::engine::{self, Command, EngineConfig, NewNode};
use trellis::gpu::Stream;
use trellis::runtime::inference::{parts_of, Inference, NodeGraph};
use trellis::runtime::{DataSource, Graph, Model, ModelConfig, ModelKind};

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
    let meta = trellis::runtime::model_file::ModelMeta {
        config: cfg.clone(),
        train_config: None,
        normalize_features: true,
        data_digest: String::new(),
        weights_digest: String::new(),
        epoch: 0,
        code_version: String::new(),
    };
    let bytes = trellis::runtime::model_file::to_bytes(&model, &stream, &meta).unwrap();
    let saved = || {
        trellis::runtime::model_file::from_bytes(&bytes, std::path::Path::new("profile")).unwrap()
    };
    let graph0 = g.clone();
    let mut inf = Inference::new(model, stream, true).unwrap();
    let mut x = inf.prepare_features(ds.features.clone()).unwrap();
    let mut owner = vec![0u32; nodes];
    let t = Instant::now();
    let mut out = inf.run(&g, &x, &parts_of(&owner, 1)).unwrap();
    eprintln!(
        "updates start\nfull run {:.1} ms",
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
        let reps = (256 / batch).max(16);
        let t = Instant::now();
        let mut rows = 0;
        for _ in 0..reps {
            let mut changed = Vec::new();
            for _ in 0..batch {
                let v = g.add_node();
                let f: Vec<f32> = (0..128).map(|_| rnd(1000) as f32 / 1000.0).collect();
                x.data.extend(inf.prepare_features(f).unwrap().data);
                owner.push(0);
                for _ in 0..10 {
                    let e = rnd(nodes as u64) as u32;
                    g.add_edge(v, e).unwrap();
                    changed.push(e);
                }
                changed.push(v);
            }
            let s = inf.update(&g, &x, &mut out, &changed, &owner, 1).unwrap();
            rows += s.rows_per_layer.iter().sum::<usize>();
        }
        let per = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
        eprintln!(
            "batch {batch:>3}: {per:.2} ms per update, {:.3} ms per node, {} rows per update",
            per / batch as f64,
            rows / reps
        );
    }
    drop(out);
    drop(inf);
    // The same kind of updates through the serving engine and its partition actors.
    for parts in [1usize, 2] {
        let owner: Vec<u32> = (0..nodes as u32).map(|v| v % parts as u32).collect();
        let t = Instant::now();
        let handle = engine::start(
            saved(),
            graph0.clone(),
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
        for batch in [1usize, 1, 4, 16, 64] {
            let reps = (256 / batch).max(16);
            let t = Instant::now();
            let mut rows = 0;
            for _ in 0..reps {
                let nodes_now: Vec<NewNode> = (0..batch)
                    .map(|_| NewNode {
                        features: (0..128).map(|_| rnd(1000) as f32 / 1000.0).collect(),
                        edges: (0..10).map(|_| rnd(nodes as u64) as u32).collect(),
                    })
                    .collect();
                let (tx, rx) = tokio::sync::oneshot::channel();
                assert!(handle.send(Command::AddNodes {
                    nodes: nodes_now,
                    deadline: Instant::now() + Duration::from_secs(600),
                    reply: tx,
                }));
                let answer = rx.blocking_recv().unwrap().unwrap();
                rows += answer.recomputed_rows.iter().sum::<usize>();
            }
            let per = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            eprintln!(
                "  batch {batch:>3}: {per:.2} ms per update, {:.3} ms per node, {} rows per update",
                per / batch as f64,
                rows / reps
            );
        }
    }
}
