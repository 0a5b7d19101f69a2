//! Deeper models (`--layers N`, `--residual`, per-layer `--hidden`): partitioned training of
//! 3- and 4-layer models equals single-process training as the 2-layer models do (loss within
//! 1e-5 relative, same test accuracy, a fixed P repeats bit for bit). (The binary's side is in
//! `tests/model_cli.rs`: a test binary that spawns processes while others partition in-process
//! can hand a partition folder's lock to a child between fork and exec.)
use trellis::actors::{RunEvent, Topology};
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, Dataset, ModelKind, RunReport, Trainer};

fn synthetic() -> Dataset {
    DataSource::parse("synthetic:nodes=1200,degree=8,features=24,classes=4,seed=3")
        .unwrap()
        .load()
        .unwrap()
}

/// `kind` with hidden layers of `widths` (per head), residual or not.
fn deep(ds: &Dataset, kind: ModelKind, widths: &[usize], residual: bool) -> TrainConfig {
    let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, 7);
    cfg.epochs = 10;
    cfg.threads = 2;
    cfg.model.layers = widths.len() + 1;
    cfg.model.hidden = widths[0];
    cfg.model.hidden_sizes = widths.to_vec();
    cfg.model.residual = residual;
    cfg
}

fn partitioned(ds: &Dataset, cfg: &TrainConfig, parts: usize) -> RunReport {
    let topo = Topology::partition(ds, parts, PartitionMethod::Metis, None, cfg.clone()).unwrap();
    let run = topo.spawn().unwrap();
    let epochs = run
        .events()
        .iter()
        .filter(|ev| matches!(ev, RunEvent::Epoch(_)))
        .count();
    let report = run.wait().unwrap();
    assert_eq!(epochs as u32, cfg.epochs, "one event per epoch");
    report
}

fn max_rel_loss_diff(a: &RunReport, b: &RunReport) -> f64 {
    a.epochs_log
        .iter()
        .zip(&b.epochs_log)
        .map(|(x, y)| (x.loss - y.loss).abs() / x.loss.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// P = 2 and 4 against one process, and P = 2 twice (bit-identical).
fn check_exact(ds: &Dataset, cfg: &TrainConfig) {
    let m = &cfg.model;
    let name = format!(
        "{} {} layers {:?}{}",
        m.kind,
        m.layers,
        m.hidden_sizes,
        if m.residual { " residual" } else { "" }
    );
    let single = Trainer::new(ds, cfg.clone()).unwrap().run(|_| {}).unwrap();
    let two = partitioned(ds, cfg, 2);
    for (p, rep) in [(2, &two), (4, &partitioned(ds, cfg, 4))] {
        let d = max_rel_loss_diff(&single, rep);
        eprintln!("{name} P={p}: max relative loss difference {d:.3e}");
        assert!(d <= 1e-5, "{name} P={p}: loss differs by {d:e}");
        assert_eq!(rep.test_acc, single.test_acc, "{name} P={p}: test accuracy");
        assert_eq!(rep.epochs_log.len(), single.epochs_log.len());
    }
    let again = partitioned(ds, cfg, 2);
    assert_eq!(
        two.weights_digest, again.weights_digest,
        "{name}: P=2 repeat"
    );
}

#[test]
fn gcn_three_and_four_layers_partitioned_match_single() {
    let ds = synthetic();
    check_exact(&ds, &deep(&ds, ModelKind::Gcn, &[32, 32], false));
    // Layer 1 identity residual, layer 2 (32 -> 16) projected, layer 3 split (16 -> 4).
    check_exact(&ds, &deep(&ds, ModelKind::Gcn, &[32, 32, 16], true));
}

#[test]
fn sage_three_and_four_layers_partitioned_match_single() {
    let ds = synthetic();
    check_exact(&ds, &deep(&ds, ModelKind::Sage, &[32, 16], true));
    check_exact(&ds, &deep(&ds, ModelKind::Sage, &[16, 16, 16], false));
}

#[test]
fn gat_three_and_four_layers_partitioned_match_single() {
    let ds = synthetic();
    check_exact(&ds, &deep(&ds, ModelKind::Gat, &[4, 4], false));
    check_exact(&ds, &deep(&ds, ModelKind::Gat, &[4, 4, 2], true));
}
