//! Clean shutdown: the end of a run, or a cancel, stops every actor and joins every thread.
use std::time::{Duration, Instant};
use trellis::actors::{ActorError, RunEvent, Topology};
use trellis::runtime::partition::PartitionMethod;
use trellis::runtime::train::TrainConfig;
use trellis::runtime::{DataSource, ModelKind};

fn threads_of_this_process() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn topology(epochs: u32) -> Topology {
    let ds = DataSource::parse("synthetic:nodes=800,degree=6,features=8,classes=3,seed=2")
        .unwrap()
        .load()
        .unwrap();
    let mut cfg = TrainConfig::paper_defaults(ModelKind::Gcn, ds.num_features, ds.num_classes, 0);
    cfg.epochs = epochs;
    cfg.threads = 2;
    Topology::partition(&ds, 4, PartitionMethod::Random, None, cfg).unwrap()
}

#[test]
fn end_of_run_and_cancel_leave_no_thread_behind() {
    // Warm up the process-wide kernel thread pool, which lives as long as the process.
    topology(1).spawn().unwrap().wait().unwrap();
    let before = threads_of_this_process();

    let report = topology(3).spawn().unwrap().wait().unwrap();
    assert_eq!(report.epochs_log.len(), 3);
    assert_eq!(
        threads_of_this_process(),
        before,
        "threads left after a finished run"
    );

    // Cancel after the first epoch, as Ctrl-C does in the CLI.
    let run = topology(10_000).spawn().unwrap();
    let t = Instant::now();
    for ev in run.events() {
        if let RunEvent::Epoch(_) = ev {
            run.cancel();
            break;
        }
    }
    let err = run.wait().unwrap_err();
    assert!(matches!(err, ActorError::Cancelled), "{err}");
    assert!(t.elapsed() < Duration::from_secs(60));
    assert_eq!(
        threads_of_this_process(),
        before,
        "threads left after a cancelled run"
    );
}
