//! Times incremental inference updates (new nodes with random edges) on a synthetic graph.
use std::time::Instant;
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
    let mut inf = Inference::new(Model::new(cfg).unwrap(), Stream::cpu(2).unwrap(), true).unwrap();
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
}
