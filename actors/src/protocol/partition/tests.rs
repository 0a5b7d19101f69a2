//! The partition machine driven by hand on a real partition of a small graph (the simulator's),
//! without actors, threads or sockets.
use super::*;
use crate::sim::SimGraph;
use trellis_runtime::ModelKind;
use trellis_transport::{HaloBlock, MsgHeader};

const RUN: u128 = 42;

fn machine(g: &SimGraph, parts: u32, part: u32, faults: FaultPlan) -> PartitionMachine {
    let state = g.state(parts, part, ModelKind::Gcn).unwrap();
    PartitionMachine::new(state, RunId::from_u128(RUN), Arc::new(faults), true)
}

fn step(epoch: u32, layer: u16, phase: Phase) -> Step {
    Step {
        run: RunId::from_u128(RUN),
        epoch,
        layer,
        phase,
        trace: None,
    }
}

fn drain(m: &mut PartitionMachine) -> Vec<PartitionAction> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn answers(actions: &[PartitionAction]) -> Vec<(RequestId, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            PartitionAction::Answer { id, result } => Some((*id, result.is_ok())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_step_parks_until_its_halo_blocks_are_in_and_stale_blocks_are_dropped() {
    let g = SimGraph::new().unwrap();
    let mut p0 = machine(&g, 2, 0, FaultPlan::none());
    let mut p1 = machine(&g, 2, 1, FaultPlan::none());
    let now = Instant::now();
    // Layer 0 needs no blocks: both answer at once and send their layer-1 input rows.
    p0.handle_step(RequestId(1), step(1, 0, Phase::Forward), now);
    p1.handle_step(RequestId(1), step(1, 0, Phase::Forward), now);
    let (a0, a1) = (drain(&mut p0), drain(&mut p1));
    assert_eq!(answers(&a0), [(RequestId(1), true)]);
    assert_eq!(answers(&a1), [(RequestId(1), true)]);
    // GCN's layer 1 (16 -> classes) is split: its step runs a first stage, sends its
    // transformed rows and parks for partition 1's.
    p0.handle_step(RequestId(2), step(1, 1, Phase::Forward), now);
    let sent = drain(&mut p0);
    assert!(answers(&sent).is_empty(), "parked");
    assert!(sent.iter().any(|a| matches!(a, PartitionAction::Send(_))));
    p1.handle_step(RequestId(2), step(1, 1, Phase::Forward), now);
    let from_1: Vec<HaloBlock> = drain(&mut p1)
        .into_iter()
        .filter_map(|a| match a {
            PartitionAction::Send(b) => Some(b),
            _ => None,
        })
        .collect();
    assert!(!from_1.is_empty());
    // A block of another run and one of an epoch already committed are dropped.
    let mut foreign = from_1[0].clone();
    foreign.header = MsgHeader {
        run: RunId::from_u128(7),
        ..foreign.header
    };
    p0.handle_halo(foreign.clone(), now);
    foreign.header.run = RunId::from_u128(RUN);
    foreign.header.epoch = 0;
    p0.handle_halo(foreign, now);
    assert_eq!(p0.dropped_blocks(), 2);
    assert!(drain(&mut p0).is_empty());
    // Partition 1's rows arrive (twice: a duplicate replaces an identical block): the step
    // completes once.
    for b in from_1.iter().chain(&from_1) {
        p0.handle_halo(b.clone(), now);
    }
    assert_eq!(answers(&drain(&mut p0)), [(RequestId(2), true)]);
}

#[test]
fn a_panic_asks_for_a_restart_and_the_restore_reports_the_state_it_restored() {
    let g = SimGraph::new().unwrap();
    let faults = FaultPlan::none().panic_at(0, 1, 0, Phase::Forward);
    let mut m = machine(&g, 1, 0, faults);
    let initial = m.snapshot().unwrap();
    let now = Instant::now();
    m.handle_step(RequestId(1), step(1, 0, Phase::Forward), now);
    let actions = drain(&mut m);
    assert!(matches!(
        &actions[0],
        PartitionAction::Answer {
            id: RequestId(1),
            result: Err(ActorError::Panicked { part: 0, .. })
        }
    ));
    assert!(matches!(actions[1], PartitionAction::Restart));
    // The injected fault overwrote part of the weights, as a kernel interrupted half-way would.
    let clobbered = m
        .state()
        .model()
        .weights_digest(m.state().stream())
        .unwrap();
    assert_ne!(clobbered, initial.digest);
    let report = m.restore(Some(&initial)).unwrap();
    assert_eq!(
        (report.epoch, report.digest.as_str()),
        (0, initial.digest.as_str())
    );
    // The next step reply carries the restore report to the coordinator.
    m.handle_step(RequestId(2), step(1, 0, Phase::Forward), now);
    match drain(&mut m).remove(0) {
        PartitionAction::Answer {
            result: Ok(Response::Step(r)),
            ..
        } => assert_eq!(r.restored, Some(report)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_optimizer_step_is_applied_once_and_replicated() {
    let g = SimGraph::new().unwrap();
    let mut m = machine(&g, 1, 0, FaultPlan::none());
    let n = m.state().model().num_parameters();
    let grads = vec![0.01f32; n];
    let run = RunId::from_u128(RUN);
    m.handle_apply(RequestId(1), run, 1, &grads, None);
    let first = drain(&mut m);
    assert!(
        matches!(&first[0], PartitionAction::Replicate { snapshot, .. } if snapshot.epoch == 1)
    );
    let digest = match &first[1] {
        PartitionAction::Answer {
            result: Ok(Response::Applied(a)),
            ..
        } => a.digest.clone(),
        other => panic!("{other:?}"),
    };
    // A retried apply of the same epoch changes nothing and answers the same digest.
    m.handle_apply(RequestId(2), run, 1, &grads, None);
    match drain(&mut m).as_slice() {
        [PartitionAction::Answer {
            result: Ok(Response::Applied(a)),
            ..
        }] => assert_eq!(a.digest, digest),
        other => panic!("{other:?}"),
    }
    // The wrong number of gradients is a clear error, not a panic.
    m.handle_apply(RequestId(3), run, 2, &grads[1..], None);
    assert_eq!(answers(&drain(&mut m)), [(RequestId(3), false)]);
}

#[test]
fn regression_a_cancel_during_the_optimizer_step_does_not_step_twice() {
    // A rollback elsewhere cancels this partition's stream while its optimizer step runs;
    // the step must complete (and the epoch count with it), so that the retried apply of the
    // same epoch is a no-op instead of a second step.
    let g = SimGraph::new().unwrap();
    let (mut clean, mut cancelled) = (
        machine(&g, 1, 0, FaultPlan::none()),
        machine(&g, 1, 0, FaultPlan::none()),
    );
    let token = trellis_gpu::CancelToken::default();
    cancelled.state_mut().set_cancel(token.clone());
    let grads = vec![0.01f32; clean.state().model().num_parameters()];
    let run = RunId::from_u128(RUN);
    clean.handle_apply(RequestId(1), run, 1, &grads, None);
    token.cancel();
    cancelled.handle_apply(RequestId(1), run, 1, &grads, None);
    token.clear();
    cancelled.handle_apply(RequestId(2), run, 1, &grads, None);
    let digest = |acts: Vec<PartitionAction>| {
        acts.into_iter()
            .filter_map(|a| match a {
                PartitionAction::Answer {
                    result: Ok(Response::Applied(a)),
                    ..
                } => Some(a.digest),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let want = digest(drain(&mut clean));
    let got = digest(drain(&mut cancelled));
    assert_eq!(got, [want[0].clone(), want[0].clone()]);
}
