//! A deterministic simulator of a whole cluster, FoundationDB/TigerBeetle style: N node
//! processes (up to 256) hosting P partitions, run in one thread with virtual time and a
//! seeded network, over the **real** protocol machines ([`EpochMachine`] for the coordinator,
//! [`PartitionMachine`] per partition) and the real model math on a small graph.
//!
//! What the simulated nodes do is what the cluster shells do: route requests and halo blocks
//! by the current placement, replicate each partition's committed state to its replica nodes
//! as bytes with the sender's digest ([`ReplicaBytes`]), restart a panicked partition from its
//! node's copy, detect a silent node after the idle timeout, fence it and re-place its
//! partitions on replica nodes, refuse everything a fenced node sends, and resume from the last
//! checkpoint after the coordinator's loss.
//!
//! After each schedule [`check`] verifies the invariants: the run ends with the fault-free
//! run's weights digest, or with an error the schedule makes unavoidable (every replica of a
//! partition lost); no message from a fenced node was accepted; every recovery record is true
//! (its kind matches a fault that fired, its restored state had the committed digest); the
//! run finished in bounded virtual time. A failing seed replays exactly: `trellis sim
//! --schedules 1 --seed S`.
mod net;
mod schedule;
mod world;

pub use net::{NetSpec, SimRng};
pub use schedule::{Schedule, SimFault, TimedFault, EPOCHS, LAYERS, MODELS, PART_COUNTS};
pub use world::{Reference, SimGraph, SimOutcome, SimRun};

use crate::protocol::epoch::EpochMachine;
use crate::protocol::partition::PartitionMachine;
use crate::replica::ReplicaBytes;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// What one schedule did, and whether it broke an invariant.
#[derive(Debug, Clone)]
pub struct ScheduleReport {
    pub seed: u64,
    pub nodes: u32,
    pub parts: u32,
    /// Halo staleness of the run, and whether rows were skipped.
    pub staleness: u32,
    pub skip: bool,
    pub outcome: SimOutcome,
    /// Faults that fired, by kind.
    pub fired: BTreeMap<SimFault, u32>,
    pub virtual_ms: f64,
    pub recoveries: usize,
    /// Partitions rolled back before a replayed training step (a node lost during the
    /// optimizer step).
    pub rollbacks: u32,
    /// Evaluation steps replayed before a training step, and evaluation blocks sent as only
    /// their changed rows (evaluation rows skipped).
    pub eval_replay_steps: u32,
    pub sparse_eval_blocks: u64,
    /// The broken invariant, if any.
    pub violation: Option<String>,
}

/// A sweep over many schedules.
#[derive(Debug, Default, Clone)]
pub struct SweepReport {
    pub schedules: u64,
    /// Schedules that ran with halo staleness 1, and the faults that fired in them; the same
    /// for skipped rows.
    pub stale: u64,
    pub stale_fired: u64,
    pub skip: u64,
    pub skip_fired: u64,
    pub fired: BTreeMap<SimFault, u64>,
    /// Outcomes by name (`finished`, `no-live-replica`, ...).
    pub outcomes: BTreeMap<String, u64>,
    pub recoveries: u64,
    /// Partitions rolled back, and the schedules with staleness or skipping whose runs rolled
    /// one back and finished.
    pub rollbacks: u64,
    pub held_rollbacks_finished: u64,
    /// Over the schedules that skip rows: evaluation steps replayed, in schedules that then
    /// finished, and sparse evaluation blocks sent.
    pub eval_replays_finished: u64,
    pub sparse_eval_blocks: u64,
    pub longest_virtual_ms: f64,
    /// (seed, violation) of every schedule that broke an invariant.
    pub failures: Vec<(u64, String)>,
}

impl SweepReport {
    fn add(&mut self, r: &ScheduleReport) {
        self.schedules += 1;
        let fired = r.fired.values().map(|&n| u64::from(n)).sum::<u64>();
        if r.staleness > 0 {
            self.stale += 1;
            self.stale_fired += fired;
        }
        if r.skip {
            self.skip += 1;
            self.skip_fired += fired;
        }
        for (k, n) in &r.fired {
            *self.fired.entry(*k).or_default() += u64::from(*n);
        }
        *self.outcomes.entry(r.outcome.name().into()).or_default() += 1;
        self.recoveries += r.recoveries as u64;
        self.rollbacks += u64::from(r.rollbacks);
        if r.rollbacks > 0
            && (r.staleness > 0 || r.skip)
            && matches!(r.outcome, SimOutcome::Finished { .. })
        {
            self.held_rollbacks_finished += 1;
        }
        if matches!(r.outcome, SimOutcome::Finished { .. }) {
            self.eval_replays_finished += u64::from(r.eval_replay_steps);
        }
        self.sparse_eval_blocks += r.sparse_eval_blocks;
        self.longest_virtual_ms = self.longest_virtual_ms.max(r.virtual_ms);
        if let Some(v) = &r.violation {
            self.failures.push((r.seed, v.clone()));
        }
    }

    /// Faults fired in all.
    pub fn fired_total(&self) -> u64 {
        self.fired.values().sum()
    }
}

/// Runs schedule `seed` and checks its invariants against the fault-free reference.
pub fn run_schedule(graph: &SimGraph, seed: u64) -> ScheduleReport {
    crate::faults::quiet_injected_panics(false);
    let schedule = Schedule::generate(seed, true);
    let run = SimRun::new(graph, schedule).run();
    let reference = graph.reference(run.parts, run.model, run.staleness, run.skip);
    check(run, reference.as_ref())
}

/// Every epoch's evaluation (`epoch:train/val/test` accuracies, `;`-separated): a run with
/// faults must evaluate as the fault-free run did, also where evaluation rows are skipped.
pub fn eval_fingerprint(logs: &[trellis_runtime::EpochLog]) -> String {
    logs.iter()
        .map(|l| format!("{}:{}/{}/{}", l.epoch, l.train_acc, l.val_acc, l.test_acc))
        .collect::<Vec<_>>()
        .join(";")
}

/// Checks one finished simulation's invariants; `reference`: the fault-free run's.
pub fn check(run: world::SimResult, reference: Option<&Reference>) -> ScheduleReport {
    let mut violation = run.violation.clone();
    match (&run.outcome, reference) {
        (SimOutcome::Finished { digest, .. }, Some(want)) if *digest != want.digest => {
            violation.get_or_insert(format!(
                "final weights digest {digest} differs from the fault-free run's {}",
                want.digest
            ));
        }
        (SimOutcome::Finished { evals, .. }, Some(want)) if *evals != want.evals => {
            violation.get_or_insert(format!(
                "the evaluations {evals} differ from the fault-free run's {}",
                want.evals
            ));
        }
        (SimOutcome::Finished { .. }, None) => {
            violation.get_or_insert("no fault-free reference digest".into());
        }
        (
            SimOutcome::Failed {
                error,
                expected: false,
            },
            _,
        ) => {
            violation.get_or_insert(format!("unexpected error: {error}"));
        }
        _ => {}
    }
    ScheduleReport {
        seed: run.seed,
        nodes: run.nodes,
        parts: run.parts,
        staleness: run.staleness,
        skip: run.skip,
        outcome: run.outcome,
        fired: run.fired,
        virtual_ms: run.virtual_us as f64 / 1e3,
        recoveries: run.recoveries,
        rollbacks: run.rollbacks,
        eval_replay_steps: run.eval_replay_steps,
        sparse_eval_blocks: run.sparse_eval_blocks,
        violation,
    }
}

/// Runs `schedules` schedules with seeds `seed, seed+1, ...` on `threads` threads; calls
/// `progress` after each with the number done. The report does not depend on `threads`.
pub fn sweep(
    graph: &SimGraph,
    seed: u64,
    schedules: u64,
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> SweepReport {
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let reports = Mutex::new(Vec::with_capacity(schedules as usize));
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= schedules {
                    break;
                }
                let r = run_schedule(graph, seed.wrapping_add(i));
                reports.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                progress(done.fetch_add(1, Ordering::Relaxed) + 1);
            });
        }
    });
    let mut reports = reports.into_inner().unwrap_or_else(|p| p.into_inner());
    reports.sort_by_key(|r| r.seed);
    let mut out = SweepReport::default();
    for r in &reports {
        out.add(r);
    }
    out
}

#[cfg(test)]
mod tests;
