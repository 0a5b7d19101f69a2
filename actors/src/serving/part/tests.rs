//! The serving machines of several partitions driven by hand (blocks delivered at once):
//! passes planned by [`plan_pass`] give the bits of a whole-graph [`Inference::run`], after
//! updates, after a restart and its recovery pass, and for a staged model.
use super::*;
use crate::serving::plan::{plan_incremental_update, plan_pass, Coverage, LayerPlan};
use trellis_runtime::inference::{parts_of, NodeGraph};
use trellis_runtime::{DataSource, Graph, ModelKind};

const PARTS: usize = 3;

struct Harness {
    graph: NodeGraph,
    features: Rows,
    owner: Vec<u32>,
    model: Arc<ModelValues>,
    sparse: bool,
    machines: Vec<ServePartMachine>,
    faults: Arc<FaultPlan>,
    run: RunId,
    seq: u32,
    restarts: usize,
    /// Plan the last layer as read from its transformed rows.
    read_last: bool,
}

fn config(kind: ModelKind, deep: bool) -> ModelConfig {
    let mut cfg = ModelConfig::paper_defaults(kind, 12, 4, 5);
    cfg.hidden = 8;
    cfg.heads = 2;
    if deep {
        cfg.layers = 4;
        cfg.hidden_sizes = vec![8, 8, 6];
        cfg.residual = true;
    }
    cfg
}

impl Harness {
    fn new(cfg: ModelConfig, faults: FaultPlan) -> Self {
        let ds = DataSource::parse("synthetic:nodes=400,degree=6,features=12,classes=4,seed=3")
            .unwrap()
            .load()
            .unwrap();
        let graph = NodeGraph::from_graph(&Graph::from_dataset(&ds).unwrap());
        let model = Model::new(cfg).unwrap();
        let values = Arc::new(ModelValues::of(&model, true).unwrap());
        let inf = values.build(Stream::cpu(0).unwrap()).unwrap();
        let features = inf.prepare_features(ds.features.clone()).unwrap();
        let sparse = trellis_runtime::model::LayerInput::would_be_sparse(&features.data);
        let owner: Vec<u32> = (0..400u32).map(|v| v * 7 % 3).collect();
        let mut h = Harness {
            graph,
            features,
            owner,
            model: values,
            sparse,
            machines: Vec::new(),
            faults: Arc::new(faults),
            run: uuid::Uuid::new_v4(),
            seq: 0,
            restarts: 0,
            read_last: false,
        };
        h.machines = (0..PARTS as u32)
            .map(|p| ServePartMachine::new(h.data(p), h.run, h.faults.clone(), 0).unwrap())
            .collect();
        h
    }

    fn data(&self, p: u32) -> PartData {
        let graph = PartGraph::from_graph(&self.graph, &self.owner, p).unwrap();
        let features = Rows {
            width: self.features.width,
            data: self.features.gather(graph.inner()),
        };
        PartData {
            graph,
            features,
            model: self.model.clone(),
            sparse_input: self.sparse,
        }
    }

    fn split(&self) -> Vec<bool> {
        let inf = self.model.build(Stream::cpu(0).unwrap()).unwrap();
        (0..inf.model().num_layers())
            .map(|l| inf.model().reads_transformed_only(l))
            .collect()
    }

    #[allow(clippy::needless_range_loop)]
    /// Runs the planned layers; returns the failed partitions (restarted and restored), or
    /// the last layer's rows as a whole table.
    fn pass(
        &mut self,
        plans: &[LayerPlan],
        target: Target,
        update: Option<u64>,
        full: &[bool],
    ) -> Result<Rows, Vec<u32>> {
        self.seq += 1;
        let mut logits = Rows::zeros(self.graph.num_nodes(), 4);
        for plan in plans {
            let last = plan.layer + 1 == plans.len();
            for p in 0..PARTS {
                let step = PassStep {
                    trace: None,
                    seq: self.seq,
                    layer: plan.layer as u16,
                    target,
                    update,
                    transform: plan.transform[p].clone(),
                    compute: plan.compute[p].clone(),
                    send: plan.send[p].clone(),
                    recv: plan.recv[p].clone(),
                    increment: plan.increment[p].clone(),
                    increment_send: plan.increment_send[p].clone(),
                    increment_recv: plan.increment_recv[p].clone(),
                    return_rows: last,
                    return_transformed: plan.returns_transformed,
                    full: full[p],
                };
                self.machines[p].handle_step(p as u64, step);
            }
            let mut failed = Vec::new();
            let mut answered = 0;
            while answered < PARTS {
                let mut progressed = false;
                for p in 0..PARTS {
                    while let Some(a) = self.machines[p].poll_action() {
                        progressed = true;
                        match a {
                            ServeAction::Send(b) => {
                                let to = b.header.to.0 as usize;
                                self.machines[to].handle_halo(b);
                            }
                            ServeAction::Answer { result, .. } => {
                                answered += 1;
                                match result {
                                    Ok(done) => {
                                        if let Some(r) = done.rows {
                                            logits.width = r.width;
                                            logits.scatter(&r.ids, &r.data);
                                        }
                                    }
                                    Err(ActorError::Panicked { part, .. }) => {
                                        failed.push(part);
                                        for m in &mut self.machines {
                                            m.handle_abort(self.seq);
                                        }
                                    }
                                    Err(e) => assert!(!failed.is_empty(), "{e}"),
                                }
                            }
                            ServeAction::Restart => {
                                self.restarts += 1;
                                let d = self.data(p as u32);
                                self.machines[p].restore(Ok(d));
                            }
                        }
                    }
                }
                assert!(progressed || answered == PARTS, "a step is stuck");
            }
            if !failed.is_empty() {
                return Err(failed);
            }
        }
        Ok(logits)
    }

    fn full_pass(&mut self, target: Target) -> Rows {
        let plans = plan_pass(
            &self.graph,
            &self.owner,
            PARTS,
            &self.split(),
            self.read_last,
            Coverage::Full,
        );
        self.pass(&plans, target, None, &[true; PARTS]).unwrap()
    }

    /// Applies node and edge changes to the whole graph and every machine; returns the
    /// changed nodes.
    fn change(&mut self, update: u64) -> Vec<u32> {
        let v = self.graph.add_node();
        let feats: Vec<f32> = (0..12).map(|i| (i * update as usize % 5) as f32).collect();
        let prepared = self
            .model
            .build(Stream::cpu(0).unwrap())
            .unwrap()
            .prepare_features(feats)
            .unwrap();
        self.features.data.extend_from_slice(&prepared.data);
        let owner = (update % 3) as u32;
        self.owner.push(owner);
        let mut ops = vec![DeltaOp::AddNode {
            id: v,
            owner,
            features: prepared.data,
        }];
        let mut changed = vec![v];
        // Any number of updates: the ends stay among the existing nodes, and the removed edge
        // is one of a node that still has some.
        let n = v;
        for (a, b) in [(v, 7 * update as u32 % n), (v, (100 + update as u32) % n)] {
            if self.graph.add_edge(a, b).unwrap() {
                ops.push(DeltaOp::AddEdge { a, b });
                changed.extend([a, b]);
            }
        }
        let from = (3..n)
            .find(|&x| !self.graph.neighbors(x).is_empty())
            .expect("a node with an edge");
        let cut = self.graph.neighbors(from)[0];
        self.graph.remove_edge(from, cut).unwrap();
        ops.push(DeltaOp::RemoveEdge { a: from, b: cut });
        changed.extend([from, cut]);
        for m in &mut self.machines {
            m.handle_delta(&ops).unwrap();
        }
        changed
    }

    fn update(&mut self, update: u64, changed: &[u32]) -> Result<Rows, Vec<u32>> {
        let full = [false; PARTS];
        let plans = plan_pass(
            &self.graph,
            &self.owner,
            PARTS,
            &self.split(),
            self.read_last,
            Coverage::Changed {
                nodes: changed,
                full: &full,
            },
        );
        self.pass(&plans, Target::Live, Some(update), &full)
    }

    /// [`Harness::update`] with the layers marked in `incremental` updated incrementally
    /// (`increments` as the engine keeps it); returns the plans beside the rows.
    fn update_incremental(
        &mut self,
        update: u64,
        changed: &[u32],
        incremental: &[bool],
        increments: &mut Vec<Vec<u8>>,
        max: u8,
    ) -> (Vec<LayerPlan>, Rows) {
        let full = [false; PARTS];
        let plans = plan_incremental_update(
            &self.graph,
            &self.owner,
            PARTS,
            &self.split(),
            self.read_last,
            incremental,
            changed,
            increments,
            max,
        );
        let rows = self
            .pass(&plans, Target::Live, Some(update), &full)
            .unwrap();
        (plans, rows)
    }

    /// Every node's live row of layer `l`, looked up from its owner.
    fn served_layer(&mut self, l: usize) -> Rows {
        let n = self.graph.num_nodes();
        let mut out = Rows::zeros(n, 8);
        let parts = parts_of(&self.owner, PARTS);
        for (p, ids) in parts.iter().enumerate() {
            let rows = self.machines[p].lookup(ids, Some(l)).unwrap();
            let flat: Vec<f32> = rows
                .into_iter()
                .flat_map(|r| r.embedding.unwrap())
                .collect();
            out.scatter(ids, &flat);
        }
        out
    }

    /// Every node's live last-layer row, looked up from its owner.
    fn served(&mut self) -> Rows {
        let n = self.graph.num_nodes();
        let mut out = Rows::zeros(n, 4);
        let parts = parts_of(&self.owner, PARTS);
        for (p, ids) in parts.iter().enumerate() {
            let rows = self.machines[p].lookup(ids, None).unwrap();
            let flat: Vec<f32> = rows.into_iter().flat_map(|r| r.logits).collect();
            out.scatter(ids, &flat);
        }
        out
    }

    fn reference(&self, values: &ModelValues) -> Rows {
        let mut inf = values.build(Stream::cpu(0).unwrap()).unwrap();
        let out = inf
            .run(&self.graph, &self.features, &parts_of(&self.owner, PARTS))
            .unwrap();
        out.logits().clone()
    }
}

#[test]
fn partitions_compute_the_bits_of_the_whole_graph_before_and_after_updates() {
    for kind in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat] {
        for deep in [false, true] {
            let mut h = Harness::new(config(kind, deep), FaultPlan::none());
            let logits = h.full_pass(Target::Live);
            let want = h.reference(&h.model.clone());
            assert_eq!(logits, want, "{kind} deep={deep}: start-up pass");
            assert_eq!(h.served(), want);
            for u in 1..=3 {
                let changed = h.change(u);
                let rows = h.update(u, &changed).unwrap();
                let want = h.reference(&h.model.clone());
                // Every row the update returned equals the whole graph's.
                let ids: Vec<u32> = (0..h.graph.num_nodes() as u32)
                    .filter(|&v| rows.row(v).iter().any(|&x| x != 0.0))
                    .collect();
                assert!(!ids.is_empty());
                for &v in &ids {
                    assert_eq!(
                        rows.row(v),
                        want.row(v),
                        "{kind} deep={deep} update {u} node {v}"
                    );
                }
                assert_eq!(h.served(), want, "{kind} deep={deep} after update {u}");
            }
        }
    }
}

#[test]
fn a_panicking_partition_is_restored_and_recomputed_and_lookups_wait_for_it() {
    let faults = FaultPlan::none().serve_panic_at(1, 2, 1);
    let mut h = Harness::new(config(ModelKind::Gcn, true), faults);
    h.full_pass(Target::Live);
    let c1 = h.change(1);
    h.update(1, &c1).unwrap();
    let c2 = h.change(2);
    let failed = h.update(2, &c2).unwrap_err();
    assert_eq!(failed, vec![1]);
    assert_eq!(h.restarts, 1);
    assert_eq!(
        h.faults.fired().get(&crate::faults::FaultKind::ServePanic),
        Some(&1)
    );
    assert!(h.machines[1].is_stale());
    let mine = h.owner.iter().position(|&o| o == 1).unwrap() as u32;
    let e = h.machines[1].lookup(&[mine], None);
    assert!(e.unwrap_err().to_string().contains("recomputed"));
    // The recovery pass: the same change, partition 1 computing every row.
    let full = [false, true, false];
    let plans = plan_pass(
        &h.graph,
        &h.owner,
        PARTS,
        &h.split(),
        false,
        Coverage::Changed {
            nodes: &c2,
            full: &full,
        },
    );
    h.pass(&plans, Target::Live, Some(2), &full).unwrap();
    assert!(!h.machines[1].is_stale());
    let want = h.reference(&h.model.clone());
    assert_eq!(h.served(), want, "after the recovery");
}

#[test]
fn a_staged_model_is_computed_beside_the_live_one_and_installed() {
    let mut h = Harness::new(config(ModelKind::Sage, false), FaultPlan::none());
    h.full_pass(Target::Live);
    let mut cfg = config(ModelKind::Sage, false);
    cfg.seed = 99;
    let other = Arc::new(ModelValues::of(&Model::new(cfg).unwrap(), true).unwrap());
    for m in &mut h.machines {
        m.stage(other.clone()).unwrap();
    }
    let staged = h.full_pass(Target::Staged);
    assert_eq!(staged, h.reference(&other));
    let old = h.reference(&h.model.clone());
    assert_eq!(h.served(), old, "the live tables still serve the old model");
    for m in &mut h.machines {
        assert!(m.install().unwrap());
    }
    assert_eq!(h.served(), staged);
    // An aborted pass: a step of it is refused, its blocks dropped.
    h.machines[0].handle_abort(h.seq + 1);
    h.machines[0].handle_step(
        7,
        PassStep {
            trace: None,
            seq: h.seq + 1,
            layer: 0,
            target: Target::Live,
            update: None,
            transform: Arc::new(vec![]),
            compute: Arc::new(vec![]),
            send: vec![],
            recv: vec![],
            increment: Arc::new(vec![]),
            increment_send: vec![],
            increment_recv: vec![],
            return_rows: false,
            return_transformed: false,
            full: false,
        },
    );
    match h.machines[0].poll_action() {
        Some(ServeAction::Answer {
            id: 7,
            result: Err(e),
        }) => {
            assert!(e.to_string().contains("aborted"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

/// Live steps are urgent work of the priority gate, staged ones are not: a training GEMM
/// on a stream yielding to the gate waits between its pieces while updates compute, never
/// for a new model's tables; the answers stay those of the whole graph.
#[test]
fn live_steps_run_between_the_pieces_of_a_training_kernel() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let gate = trellis_gpu::PriorityGate::new();
    let mut h = Harness::new(config(ModelKind::Gcn, false), FaultPlan::none());
    h.machines = std::mem::take(&mut h.machines)
        .into_iter()
        .map(|m| m.with_priority(Some(gate.clone())))
        .collect();
    h.full_pass(Target::Live);
    let stop = AtomicBool::new(false);
    let training = Stream::cpu(0)
        .unwrap()
        .yielding_to(gate.clone())
        .with_piece_divisor(512);
    let a = Tensor::from_vec(512, 64, vec![0.5; 512 * 64]).unwrap();
    let b = Tensor::from_vec(64, 64, vec![0.25; 64 * 64]).unwrap();
    /// Stops the training thread however the scope ends (a failed assertion too: the scope
    /// would otherwise wait for it forever).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                training.matmul(&a, false, &b, false).unwrap();
            }
        });
        let _stop = StopOnDrop(&stop);
        // A new model's tables: background work, the trainer never waits for them.
        let mut cfg = config(ModelKind::Gcn, false);
        cfg.seed = 11;
        let other = Arc::new(ModelValues::of(&Model::new(cfg).unwrap(), true).unwrap());
        for m in &mut h.machines {
            m.stage(other.clone()).unwrap();
        }
        let before = gate.yields();
        h.full_pass(Target::Staged);
        assert_eq!(gate.yields(), before, "staged steps never hold the gate");
        let t = Instant::now();
        let mut u = 0;
        while gate.yields() == 0 && t.elapsed() < std::time::Duration::from_secs(20) {
            u += 1;
            let changed = h.change(u);
            h.update(u, &changed).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        assert!(gate.yields() > 0, "no training piece waited in {u} updates");
    });
    assert!(!gate.is_urgent());
    assert_eq!(h.served(), h.reference(&h.model.clone()));
}

/// `served` within rounding of `want` (rows of order 1).
fn assert_close(served: &Rows, want: &Rows, what: &str) {
    for v in 0..want.len() as u32 {
        for (a, b) in served.row(v).iter().zip(want.row(v)) {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{what} node {v}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn incremental_updates_stay_within_rounding_of_the_whole_graph_and_are_computed_again_in_time() {
    // The last layer alone (its computed rows read exact inputs: their bits are the whole
    // graph's), then both layers.
    for incremental in [[false, true], [true, true]] {
        let mut h = Harness::new(config(ModelKind::Gcn, false), FaultPlan::none());
        let model = h.model.build(Stream::cpu(0).unwrap()).unwrap();
        assert!(model.model().takes_increments(0) && model.model().takes_increments(1));
        h.full_pass(Target::Live);
        let mut increments = Vec::new();
        let mut incremented = [0; 2];
        let mut computed_again = [0; 2];
        for u in 1..=40 {
            let before = h.served();
            let changed = h.change(u);
            let (plans, rows) = h.update_incremental(u, &changed, &incremental, &mut increments, 3);
            let mut inf = h.model.build(Stream::cpu(0).unwrap()).unwrap();
            let want = inf
                .run(&h.graph, &h.features, &parts_of(&h.owner, PARTS))
                .unwrap();
            let served = h.served();
            for (l, plan) in plans.iter().enumerate() {
                incremented[l] += plan.increment.iter().map(|r| r.len()).sum::<usize>();
                computed_again[l] += plan
                    .compute
                    .iter()
                    .flat_map(|r| r.iter())
                    .filter(|&&v| !changed.contains(&v))
                    .count();
            }
            let plan = plans.last().unwrap();
            // Rows the update did not reach keep their bits; every row stays within rounding
            // of the whole graph's (the model's rows here are of order 1).
            let reached: std::collections::BTreeSet<u32> = plan
                .compute
                .iter()
                .chain(&plan.increment)
                .flat_map(|r| r.iter().copied())
                .collect();
            for v in 0..before.len() as u32 {
                if !reached.contains(&v) {
                    assert_eq!(
                        served.row(v),
                        before.row(v),
                        "update {u}: node {v} not reached"
                    );
                }
            }
            assert_close(
                &served,
                want.logits(),
                &format!("{incremental:?} update {u}"),
            );
            let hidden = h.served_layer(0);
            assert_close(
                &hidden,
                &want.layers[0],
                &format!("{incremental:?} layer 0 {u}"),
            );
            for &v in &reached {
                assert_eq!(rows.row(v), served.row(v), "update {u}: returned row {v}");
            }
            if !incremental[0] {
                for &v in plan.compute.iter().flat_map(|r| r.iter()) {
                    assert_eq!(
                        served.row(v),
                        want.logits().row(v),
                        "update {u}: computed row {v} is exact"
                    );
                }
            }
        }
        for l in 0..2 {
            if incremental[l] {
                assert!(
                    incremented[l] > 100,
                    "{incremental:?}: {} rows of layer {l} updated incrementally",
                    incremented[l]
                );
                assert!(
                    computed_again[l] > 0,
                    "{incremental:?}: no row of layer {l} reached its increment limit"
                );
            }
        }
        // An incremental update exchanged changes between the partitions, at each
        // incremental layer.
        let changed = h.change(41);
        let (plans, _) = h.update_incremental(41, &changed, &incremental, &mut increments, 3);
        for (l, plan) in plans.iter().enumerate() {
            assert_eq!(
                plan.increment_send.iter().any(|s| !s.is_empty()),
                incremental[l],
                "{incremental:?}: layer {l}"
            );
        }
    }
}

/// With the last layer read from its transformed rows, the partitions answer `Z` rows (every
/// node's at start-up, the re-transformed ones after an update), and aggregating them over
/// the updated graph gives the whole graph's logits, over a sequence of updates with layer 0
/// taking increments.
#[test]
fn a_last_layer_read_from_transformed_rows_aggregates_to_the_whole_graphs_logits() {
    let mut h = Harness::new(config(ModelKind::Gcn, false), FaultPlan::none());
    h.read_last = true;
    let stream = Stream::cpu(0).unwrap();
    let inf = h.model.build(Stream::cpu(0).unwrap()).unwrap();
    assert!(inf.model().last_layer_reads_transformed());
    let bias = inf.model().last_layer_bias(&stream).unwrap();
    let mut z = h.full_pass(Target::Live);
    let n = h.graph.num_nodes();
    assert_eq!(z.len(), n);
    let check = |h: &Harness, z: &Rows, what: &str| {
        let want = h.reference(&h.model.clone());
        let mut row = vec![0.0; 4];
        for v in 0..h.graph.num_nodes() as u32 {
            trellis_runtime::inference::aggregate_gcn_row(&h.graph, z, &bias, v, &mut row);
            for (a, b) in row.iter().zip(want.row(v)) {
                assert!((a - b).abs() <= 1e-5, "{what}: node {v}: {a} vs {b}");
            }
        }
    };
    check(&h, &z, "start-up");
    let mut increments = Vec::new();
    for u in 1..=20 {
        let changed = h.change(u);
        let (plans, rows) = h.update_incremental(u, &changed, &[true, false], &mut increments, 64);
        let last = plans.last().unwrap();
        assert!(last.returns_transformed);
        assert!(last
            .compute
            .iter()
            .chain(&last.increment)
            .all(|c| c.is_empty()));
        assert!(last.send.iter().chain(&last.recv).all(|c| c.is_empty()));
        // Only the re-transformed rows came back, and they are far fewer than the graph's.
        let back: usize = last.transform.iter().map(|t| t.len()).sum();
        assert!(back > 0 && back < h.graph.num_nodes() / 4, "{back}");
        z.grow(h.graph.num_nodes());
        for t in &last.transform {
            let ids: Vec<u32> = t.to_vec();
            z.scatter(&ids, &rows.gather(&ids));
        }
        check(&h, &z, &format!("update {u}"));
    }
}

/// Deterministic test values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `add_changes` visits each updated row once, in memory order: its sums are bit for bit
/// those of adding each change from its own side in the changes' order (own changes, then
/// received ones), rows it does not update keep their bits, and it returns the updated rows
/// in the order of `locals`.
#[test]
fn added_changes_equal_a_visit_per_change_and_come_back_in_the_order_asked() {
    let h = Harness::new(config(ModelKind::Gcn, false), FaultPlan::none());
    let data = h.data(0);
    let graph = &data.graph;
    let inner = graph.inner().to_vec();
    let w = 5;
    let table = Rows {
        width: w,
        data: values(inner.len() * w, 1),
    };
    // Changes of a few own nodes; the updated rows are those they reach, listed ascending
    // (the usual order) and descending.
    let changed: Vec<u32> = inner.iter().copied().step_by(37).collect();
    let dy = values(changed.len() * w, 2);
    let mut updated: Vec<u32> = changed
        .iter()
        .flat_map(|&u| std::iter::once(u).chain(graph.neighbors(u).iter().copied()))
        .filter_map(|v| graph.local(v))
        .collect();
    updated.sort_unstable();
    updated.dedup();
    // Leave one reached row out (a row computed in full takes no increments).
    let left_out = updated.remove(updated.len() / 2);
    for ascending in [true, false] {
        let mut table = table.clone();
        let mut updated = updated.clone();
        if !ascending {
            updated.reverse();
        }
        // Received changes of halo nodes, added from the updated rows' side.
        let halo: Vec<u32> = (0..h.graph.num_nodes() as u32)
            .filter(|&v| graph.local(v).is_none())
            .take(40)
            .collect();
        let mut received = HaloRows::new(w);
        received.extend(&halo, &values(halo.len() * w, 3)).unwrap();
        let scale = |r: u32| 1.0 / (graph.degree(inner[r as usize]) as f32 + 1.0).sqrt();
        let mut want = table.clone();
        for (k, &u) in changed.iter().enumerate() {
            for v in std::iter::once(u).chain(graph.neighbors(u).iter().copied()) {
                if let Some(r) = graph.local(v).filter(|r| updated.contains(r)) {
                    let s = scale(r);
                    let row = &mut want.data[r as usize * w..(r as usize + 1) * w];
                    for (y, d) in row.iter_mut().zip(&dy[k * w..(k + 1) * w]) {
                        *y += d * s;
                    }
                }
            }
        }
        for &r in &updated {
            let s = scale(r);
            for &u in graph.neighbors(inner[r as usize]) {
                if let Some(d) = received.get(u) {
                    let row = &mut want.data[r as usize * w..(r as usize + 1) * w];
                    row.iter_mut().zip(d).for_each(|(y, &d)| *y += d * s);
                }
            }
        }
        let mut scales = Vec::new();
        let own = OwnChanges {
            ids: &changed,
            values: &dy,
        };
        let rows = add_changes(
            graph,
            &updated,
            own,
            Some(&received),
            &mut table,
            &mut scales,
        );
        assert_eq!(table, want, "the updated table");
        assert_eq!(table.row(left_out), want.row(left_out));
        assert_eq!(rows, table.gather(&updated), "the returned rows, in order");
        assert!(scales.iter().all(|&s| s == 0.0), "the scales are reset");
    }
}

/// Carried rows are the input only of the next layer of their pass on the same tables and
/// of exactly their rows; taken, their transform equals the transform of the same rows
/// gathered from the table, in the step's order.
#[test]
fn carried_rows_feed_only_the_next_layer_of_their_pass_in_its_order() {
    let h = Harness::new(config(ModelKind::Gcn, false), FaultPlan::none());
    let data = h.data(0);
    let graph = &data.graph;
    let mut inference = h.model.build(Stream::cpu(0).unwrap()).unwrap();
    assert!(inference.model().reads_transformed_only(1));
    let w = inference.layer_width(0);
    let table = Rows {
        width: w,
        data: values(graph.inner().len() * w, 4),
    };
    let inner = graph.inner();
    let computed: Vec<u32> = inner.iter().copied().step_by(5).collect();
    let incremented: Vec<u32> = inner
        .iter()
        .copied()
        .enumerate()
        .filter(|(i, _)| i % 5 == 2 || i % 5 == 3)
        .map(|(_, v)| v)
        .collect();
    let rows_of = |ids: &[u32]| {
        let locals = graph.locals(ids).unwrap();
        table.gather(&locals)
    };
    let mut transform: Vec<u32> = computed.iter().chain(&incremented).copied().collect();
    transform.sort_unstable();
    let ids = |v: &[u32]| Arc::new(v.to_vec());
    let step = |seq: u32, layer: u16, target: Target, transform: &[u32]| PassStep {
        trace: None,
        seq,
        layer,
        target,
        update: Some(1),
        transform: ids(transform),
        compute: ids(&[]),
        send: Vec::new(),
        recv: Vec::new(),
        increment: ids(&[]),
        increment_send: Vec::new(),
        increment_recv: Vec::new(),
        return_rows: true,
        return_transformed: true,
        full: false,
    };
    let carried = || {
        CarriedRows::new(
            (7, 0, Target::Live),
            (&computed, rows_of(&computed)),
            (&incremented, rows_of(&incremented)),
        )
    };
    let mut fewer = transform.clone();
    fewer.pop();
    for (what, other) in [
        ("another pass", step(8, 1, Target::Live, &transform)),
        ("another layer", step(7, 0, Target::Live, &transform)),
        ("other tables", step(7, 1, Target::Staged, &transform)),
        ("other rows", step(7, 1, Target::Live, &fewer)),
    ] {
        assert!(carried().input_of(&other).is_none(), "{what}");
    }
    let next = step(7, 1, Target::Live, &transform);
    let input = carried().input_of(&next).expect("the next layer's input");
    let got = input.transform(&mut inference, 1, graph).unwrap();
    let want = inference
        .transform_rows(1, graph, &transform, &local_table(graph, &table))
        .unwrap();
    assert_eq!(got, want);
}
