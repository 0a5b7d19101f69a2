//! Supervision: a partition whose kernel panics is restarted by its supervisor from the node's
//! replica store, the interrupted epoch is replayed, and the run ends with the same weights as
//! the run without faults.
use trellis::actors::{ActorError, FaultPlan, Topology};
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, Dataset, ModelKind, RunReport};
use trellis::transport::Phase;

fn data() -> Dataset {
    DataSource::parse("synthetic:nodes=1200,degree=8,features=16,classes=4,seed=5")
        .unwrap()
        .load()
        .unwrap()
}

fn cfg(ds: &Dataset, kind: ModelKind) -> TrainConfig {
    let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, 1);
    cfg.epochs = 6;
    cfg.threads = 2;
    cfg
}

fn run(ds: &Dataset, cfg: &TrainConfig, faults: FaultPlan) -> Result<RunReport, ActorError> {
    Topology::partition(ds, 3, PartitionMethod::Metis, None, cfg.clone())?
        .with_faults(faults)
        .spawn()?
        .wait()
}

fn recoveries(r: &RunReport) -> usize {
    r.recoveries.as_array().map_or(0, |a| a.len())
}

#[test]
fn panics_in_every_phase_recover_to_identical_weights() {
    let ds = data();
    for kind in [ModelKind::Gcn, ModelKind::Gat] {
        let cfg = cfg(&ds, kind);
        let clean = run(&ds, &cfg, FaultPlan::none()).unwrap();
        assert_eq!(recoveries(&clean), 0);
        for (phase, layer) in [
            (Phase::Forward, 0),
            (Phase::Forward, 1),
            (Phase::Backward, 1),
            (Phase::Backward, 0),
            (Phase::Eval, 1),
        ] {
            let faults = FaultPlan::none().panic_at(2, 3, layer, phase);
            let faulty = run(&ds, &cfg, faults).unwrap();
            assert_eq!(
                faulty.weights_digest, clean.weights_digest,
                "{kind}: fault in {phase:?} layer {layer}"
            );
            assert_eq!(recoveries(&faulty), 1, "{kind}: {phase:?} layer {layer}");
            let losses = |r: &RunReport| {
                r.epochs_log
                    .iter()
                    .map(|l| l.loss.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(losses(&faulty), losses(&clean));
            assert_eq!(faulty.test_acc, clean.test_acc);
        }
    }
}

#[test]
fn panics_between_the_stages_of_a_split_layer_recover_to_identical_weights() {
    // GCN layer 1 (16 -> 4) runs split: its first stage sends transformed rows, the failed
    // partition dies before its second stage while the others wait for its blocks.
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Gcn);
    let clean = run(&ds, &cfg, FaultPlan::none()).unwrap();
    for phase in [Phase::Forward, Phase::Backward, Phase::Eval] {
        let faults = FaultPlan::none().panic_in_second_stage(1, 4, 1, phase);
        let faulty = run(&ds, &cfg, faults).unwrap();
        assert_eq!(faulty.weights_digest, clean.weights_digest, "{phase:?}");
        assert_eq!(recoveries(&faulty), 1, "{phase:?}");
        assert_eq!(faulty.test_acc, clean.test_acc, "{phase:?}");
    }
    // A split layer's first stage failing leaves the others parked for its blocks.
    let faults = FaultPlan::none()
        .panic_at(0, 2, 1, Phase::Forward)
        .panic_at(2, 5, 1, Phase::Backward);
    let faulty = run(&ds, &cfg, faults).unwrap();
    assert_eq!(faulty.weights_digest, clean.weights_digest);
    assert_eq!(recoveries(&faulty), 2);
}

#[test]
fn two_failures_in_a_row_and_a_failure_during_replay() {
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Sage);
    let clean = run(&ds, &cfg, FaultPlan::none()).unwrap();
    // Epoch 2 fails on partition 0; its replay then fails on partition 1; epoch 3 fails again.
    let faults = FaultPlan::none()
        .panic_at(0, 2, 0, Phase::Forward)
        .panic_at(1, 2, 1, Phase::Backward)
        .panic_at(1, 3, 0, Phase::Backward);
    let faulty = run(&ds, &cfg, faults).unwrap();
    assert_eq!(faulty.weights_digest, clean.weights_digest);
    assert_eq!(recoveries(&faulty), 3);
}

#[test]
fn restart_budget_exhausted_is_a_clear_error() {
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Gcn);
    let mut faults = FaultPlan::none();
    for e in 1..=5 {
        faults = faults.panic_at(1, e, 0, Phase::Forward);
    }
    let err = run(&ds, &cfg, faults).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ActorError::RestartsExhausted { part: 1, .. }),
        "{msg}"
    );
    assert!(msg.contains("partition 1"), "{msg}");
}

#[test]
fn a_partition_that_stops_answering_fails_the_run_by_name_without_hanging() {
    use std::time::{Duration, Instant};
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Gcn);
    let faults = FaultPlan::none().stall_at(2, 2, Duration::from_secs(3));
    let t = Instant::now();
    let err = Topology::partition(&ds, 3, PartitionMethod::Metis, None, cfg)
        .unwrap()
        .with_faults(faults)
        .with_deadline(Duration::from_millis(500))
        .spawn()
        .unwrap()
        .wait()
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ActorError::Timeout { part: 2, .. }), "{msg}");
    assert!(
        msg.contains("partition 2") && msg.contains("500 ms"),
        "{msg}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

/// A failure does not wait for the layers running on the other partitions: the reset cancels
/// their kernels between pieces, so the replay is ready in a small fraction of a layer's time
/// (without cancellation it waits for partition 0's first layer, a third of an epoch or more).
#[test]
fn a_panic_cancels_the_layers_running_on_other_partitions() {
    // Wide inputs make the first layer most of the epoch.
    let ds = DataSource::parse("synthetic:nodes=100000,degree=10,features=256,classes=4,seed=6")
        .unwrap()
        .load()
        .unwrap();
    let mut cfg = cfg(&ds, ModelKind::Gcn);
    cfg.model.hidden = 256;
    cfg.epochs = 4;
    let run = |faults: FaultPlan| {
        Topology::partition(&ds, 2, PartitionMethod::Metis, None, cfg.clone())
            .unwrap()
            .with_faults(faults)
            .spawn()
            .unwrap()
            .wait()
            .unwrap()
    };
    let clean = run(FaultPlan::none());
    // Partition 1 fails as the first layer starts, while partition 0 computes it.
    let faulty = run(FaultPlan::none().panic_at(1, 2, 0, Phase::Forward));
    assert_eq!(faulty.weights_digest, clean.weights_digest);
    let rec = &faulty.recoveries[0];
    let ready_ms = rec["ready_ms"].as_f64().unwrap();
    let mut epochs: Vec<f64> = clean.epochs_log.iter().map(|l| l.ms).collect();
    epochs.sort_by(f64::total_cmp);
    let epoch_ms = epochs[epochs.len() / 2];
    assert!(
        ready_ms < 0.05 * epoch_ms,
        "ready to replay after {ready_ms:.1} ms; an epoch takes {epoch_ms:.1} ms"
    );
}

#[test]
fn a_panic_in_the_optimizer_step_recovers_to_identical_weights() {
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Gcn);
    let clean = run(&ds, &cfg, FaultPlan::none()).unwrap();
    let faults = FaultPlan::parse("panic:part=1:epoch=3:phase=apply").unwrap();
    let faulty = run(&ds, &cfg, faults).unwrap();
    assert_eq!(faulty.weights_digest, clean.weights_digest);
    let rec = faulty.recoveries.as_array().unwrap();
    assert_eq!(rec.len(), 1, "{rec:?}");
    assert_eq!(rec[0]["kind"], "actor-panic");
    assert_eq!(rec[0]["digest_ok"], true);
}

#[test]
fn faults_that_could_never_fire_are_refused_before_training() {
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Gcn);
    for (spec, needle) in [
        ("panic:part=3:epoch=1", "partition 3 does not exist"),
        ("panic:part=0:epoch=7", "epoch 7 is past"),
        ("panic:part=0:epoch=1:layer=2", "layer 2 does not exist"),
    ] {
        let e = run(&ds, &cfg, FaultPlan::parse(spec).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(needle) && e.contains("never fire"),
            "{spec}: {e}"
        );
    }
}

#[test]
fn node_faults_in_one_process_are_refused_without_a_cluster_prefix() {
    let ds = data();
    let cfg = cfg(&ds, ModelKind::Gcn);
    let e = run(
        &ds,
        &cfg,
        FaultPlan::parse("kill-node:node=1:epoch=2").unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("need a cluster of node processes"), "{e}");
    assert!(!e.starts_with("cluster:"), "{e}");
}
