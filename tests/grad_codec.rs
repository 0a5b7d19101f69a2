//! Gradient compression of the all-reduce (`--grad-codec`): deterministic (same seed, same
//! weights), close to exact training, fewer gradient bytes in the report, and recoverable: a
//! run with an injected panic ends with the weights of the same run without it, because each
//! partition's error-feedback residual is part of its replicated snapshot.
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

fn cfg(ds: &Dataset, kind: ModelKind, codec: &str) -> TrainConfig {
    let mut cfg = TrainConfig::paper_defaults(kind, ds.num_features, ds.num_classes, 1);
    cfg.epochs = 8;
    cfg.threads = 2;
    cfg.grad_codec = codec.parse().unwrap();
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
fn compressed_runs_repeat_bit_for_bit_and_report_fewer_gradient_bytes() {
    let ds = data();
    let exact = run(&ds, &cfg(&ds, ModelKind::Gcn, "none"), FaultPlan::none()).unwrap();
    for codec in ["int8", "topk:0.05"] {
        let c = cfg(&ds, ModelKind::Gcn, codec);
        let a = run(&ds, &c, FaultPlan::none()).unwrap();
        let b = run(&ds, &c, FaultPlan::none()).unwrap();
        assert_eq!(a.weights_digest, b.weights_digest, "{codec}: repeat");
        assert_ne!(
            a.weights_digest, exact.weights_digest,
            "{codec}: compressed"
        );
        for (l, e) in a.epochs_log.iter().zip(&exact.epochs_log) {
            assert_eq!(l.grad_bytes_exact, e.grad_bytes_exact, "{codec}");
            assert!(l.grad_bytes * 3 < l.grad_bytes_exact, "{codec}: {l:?}");
            // Error feedback keeps the loss curve close to the exact one.
            assert!(
                (l.loss - e.loss).abs() < 0.05 * e.loss,
                "{codec}: {l:?} vs {e:?}"
            );
        }
        assert_eq!(a.config["grad_codec"], codec);
    }
    let e = &exact.epochs_log[0];
    assert_eq!(e.grad_bytes, e.grad_bytes_exact);
    assert!(
        exact.config.get("grad_codec").is_none(),
        "exact configs stay as they were"
    );
}

#[test]
fn panics_with_compressed_gradients_recover_to_identical_weights() {
    let ds = data();
    for (kind, codec) in [(ModelKind::Gcn, "int8"), (ModelKind::Sage, "topk:0.05")] {
        let cfg = cfg(&ds, kind, codec);
        let clean = run(&ds, &cfg, FaultPlan::none()).unwrap();
        for (phase, layer) in [(Phase::Forward, 1), (Phase::Backward, 0), (Phase::Eval, 1)] {
            let faults = FaultPlan::none().panic_at(2, 4, layer, phase);
            let faulty = run(&ds, &cfg, faults).unwrap();
            assert_eq!(recoveries(&faulty), 1, "{kind} {codec}: {phase:?} {layer}");
            assert_eq!(
                faulty.weights_digest, clean.weights_digest,
                "{kind} {codec}: fault in {phase:?} layer {layer}"
            );
        }
        // A panic inside the optimizer step: the step is replayed from the all-reduced sum,
        // with the new residual the node held for it (computed by the step's backward pass).
        let apply = FaultPlan::parse("panic:part=1:epoch=3:phase=apply").unwrap();
        let faulty = run(&ds, &cfg, apply).unwrap();
        assert_eq!(recoveries(&faulty), 1, "{kind} {codec}: optimizer step");
        assert_eq!(
            faulty.weights_digest, clean.weights_digest,
            "{kind} {codec}: fault in the optimizer step"
        );
    }
}
