//! The partition machine with `--staleness 1`, driven by hand on real partitions of the
//! simulator's graph: a training pass uses the previous epoch's halo blocks (the first epoch
//! runs exact), its last step waits for the whole epoch's exchange, the optimizer step holds
//! the blocks for the next epoch, and a restored replica resumes with them.
use super::*;
use crate::replica::ReplicaBytes;
use crate::sim::SimGraph;
use trellis_runtime::comm::HaloConfig;
use trellis_runtime::ModelKind;
use trellis_transport::{codec, HaloPayload};

const RUN: u128 = 43;

/// A machine of partition `part` of `parts`, with or without staleness.
fn machine(g: &SimGraph, kind: ModelKind, parts: u32, part: u32, stale: bool) -> PartitionMachine {
    let halo = HaloConfig {
        staleness: u32::from(stale),
        ..HaloConfig::default()
    };
    machine_with(g, kind, parts, part, halo)
}

fn machine_with(
    g: &SimGraph,
    kind: ModelKind,
    parts: u32,
    part: u32,
    halo: HaloConfig,
) -> PartitionMachine {
    let mut cfg = g.config(kind).clone();
    cfg.halo = halo;
    let state = g.state_with(parts, part, &cfg).unwrap();
    PartitionMachine::new(
        state,
        RunId::from_u128(RUN),
        Arc::new(FaultPlan::none()),
        true,
    )
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

/// What a machine did: its answers (in order) and the blocks it sent.
#[derive(Default)]
struct Done {
    answers: Vec<(RequestId, Result<Response, ActorError>)>,
    sent: Vec<HaloBlock>,
    snapshots: Vec<Snapshot>,
}

fn drain(m: &mut PartitionMachine) -> Done {
    let mut d = Done::default();
    while let Some(a) = m.poll_action() {
        match a {
            PartitionAction::Answer { id, result } => d.answers.push((id, result)),
            PartitionAction::Send(b) => d.sent.push(b),
            PartitionAction::Replicate { snapshot, .. } => d.snapshots.push((*snapshot).clone()),
            PartitionAction::RolledBack(_) => {}
            PartitionAction::HoldResidual(_) => {}
            PartitionAction::Restart => panic!("unexpected restart"),
        }
    }
    d
}

/// A hand-driven cluster: every machine gets each request, and every block sent is delivered
/// (unless held back) until nothing moves.
struct Cluster {
    ms: Vec<PartitionMachine>,
    next: u64,
    /// Every block sent so far.
    sent: Vec<HaloBlock>,
}

impl Cluster {
    fn new(g: &SimGraph, kind: ModelKind, parts: u32, stale: bool) -> Self {
        let halo = HaloConfig {
            staleness: u32::from(stale),
            ..HaloConfig::default()
        };
        Self::with(g, kind, parts, halo)
    }

    fn with(g: &SimGraph, kind: ModelKind, parts: u32, halo: HaloConfig) -> Self {
        Cluster {
            ms: (0..parts)
                .map(|p| machine_with(g, kind, parts, p, halo))
                .collect(),
            next: 1,
            sent: Vec::new(),
        }
    }

    fn id(&mut self) -> RequestId {
        self.next += 1;
        RequestId(self.next)
    }

    /// Delivers `blocks` and everything they cause; returns the answers per machine.
    fn deliver(&mut self, mut blocks: Vec<HaloBlock>, answers: &mut [Vec<Response>]) {
        let now = Instant::now();
        while let Some(b) = blocks.pop() {
            let to = b.header.to.0 as usize;
            self.ms[to].handle_halo(b, now);
            let d = drain(&mut self.ms[to]);
            for (_, r) in d.answers {
                answers[to].push(r.unwrap());
            }
            self.sent.extend(d.sent.iter().cloned());
            blocks.extend(d.sent);
        }
    }

    /// One round: `s` to every machine, blocks delivered; the responses by machine.
    fn round(&mut self, s: Step) -> Vec<Response> {
        let id = self.id();
        let mut answers = vec![Vec::new(); self.ms.len()];
        let mut out = Vec::new();
        for (p, m) in self.ms.iter_mut().enumerate() {
            m.handle_step(id, s, Instant::now());
            let d = drain(m);
            for (_, r) in d.answers {
                answers[p].push(r.unwrap());
            }
            out.extend(d.sent);
        }
        self.sent.extend(out.iter().cloned());
        self.deliver(out, &mut answers);
        answers
            .into_iter()
            .enumerate()
            .map(|(p, mut a)| {
                assert_eq!(a.len(), 1, "partition {p}: {a:?}");
                a.remove(0)
            })
            .collect()
    }

    /// A whole training pass and the optimizer step of `epoch` (the same fixed gradients
    /// everywhere); returns the losses of the last forward layer and the snapshots.
    fn epoch(&mut self, epoch: u32) -> (Vec<f64>, Vec<Snapshot>) {
        let layers = self.ms[0].state().num_layers() as u16;
        let mut losses = Vec::new();
        for l in 0..layers {
            for r in self.round(step(epoch, l, Phase::Forward)) {
                if let Response::Step(StepReply {
                    outcome: crate::protocol::messages::Outcome::Loss { loss_sum, .. },
                    ..
                }) = r
                {
                    losses.push(loss_sum);
                }
            }
        }
        for l in (0..layers).rev() {
            self.round(step(epoch, l, Phase::Backward));
        }
        let n = self.ms[0].state().model().num_parameters();
        let grads = vec![0.01f32; n];
        let id = self.id();
        let mut snaps = Vec::new();
        for m in &mut self.ms {
            m.handle_apply(id, RunId::from_u128(RUN), epoch, &grads, None);
            let d = drain(m);
            assert!(matches!(d.answers[..], [(_, Ok(Response::Applied(_)))]));
            snaps.extend(d.snapshots);
        }
        (losses, snaps)
    }
}

impl Cluster {
    /// The evaluation of `epoch`: the correct counts (train, val, test) summed over the
    /// partitions.
    fn eval(&mut self, epoch: u32) -> (usize, usize, usize) {
        let layers = self.ms[0].state().num_layers() as u16;
        let mut counts = (0, 0, 0);
        for l in 0..layers {
            for r in self.round(step(epoch, l, Phase::Eval)) {
                if let Response::Step(StepReply {
                    outcome: crate::protocol::messages::Outcome::Eval { train, val, test },
                    ..
                }) = r
                {
                    counts = (counts.0 + train, counts.1 + val, counts.2 + test);
                }
            }
        }
        counts
    }
}

fn loss_of(r: &Response) -> f64 {
    match r {
        Response::Step(StepReply {
            outcome: crate::protocol::messages::Outcome::Loss { loss_sum, .. },
            ..
        }) => *loss_sum,
        other => panic!("not a loss: {other:?}"),
    }
}

#[test]
fn epoch_one_runs_exact_and_epoch_two_uses_the_rows_of_epoch_one() {
    let g = SimGraph::new().unwrap();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        let mut stale = Cluster::new(&g, kind, 2, true);
        let mut exact = Cluster::new(&g, kind, 2, false);
        let (ls, _) = stale.epoch(1);
        let (le, _) = exact.epoch(1);
        assert_eq!(ls, le, "{kind}: epoch 1 runs exact");
        let from_1: Vec<HaloBlock> = exact
            .sent
            .iter()
            .filter(|b| b.header.from.0 == 1 && b.header.phase == Phase::Forward)
            .cloned()
            .collect();
        assert!(!from_1.is_empty(), "{kind}");
        // Epoch 2, partition 0 alone: with staleness every forward layer answers at once,
        // without a single block of epoch 2.
        let last = stale.ms[0].state().num_layers() as u16 - 1;
        let mut stale_loss = None;
        for l in 0..=last {
            let id = stale.id();
            stale.ms[0].handle_step(id, step(2, l, Phase::Forward), Instant::now());
            let d = drain(&mut stale.ms[0]);
            match &d.answers[..] {
                [(got, Ok(r))] if *got == id => {
                    if l == last {
                        stale_loss = Some(loss_of(r));
                    }
                }
                other => panic!("{kind} layer {l}: {other:?}"),
            }
        }
        // The exact run computes the same loss from partition 1's rows of epoch 1 labelled
        // epoch 2, and another from its rows of epoch 2.
        let exact_with = |cluster: &mut Cluster, rows: &[HaloBlock]| {
            let m = &mut cluster.ms[0];
            let mut loss = None;
            for l in 0..=last {
                let id = RequestId(1000 + l as u64);
                m.handle_step(id, step(2, l, Phase::Forward), Instant::now());
                for b in rows {
                    let mut b = b.clone();
                    b.header.epoch = 2;
                    m.handle_halo(b, Instant::now());
                }
                let d = drain(m);
                if l == last {
                    loss = Some(loss_of(d.answers.last().unwrap().1.as_ref().unwrap()));
                }
            }
            loss.unwrap()
        };
        assert_eq!(
            exact_with(&mut exact, &from_1),
            stale_loss.unwrap(),
            "{kind}: the stale step used epoch 1's rows"
        );
        // ...which are not epoch 2's: the exact epoch 2 gives another loss.
        let mut fresh = Cluster::new(&g, kind, 2, false);
        fresh.epoch(1);
        let exact_loss = (0..=last)
            .map(|l| fresh.round(step(2, l, Phase::Forward)))
            .last()
            .map(|r| loss_of(&r[0]))
            .unwrap();
        assert_ne!(exact_loss, stale_loss.unwrap(), "{kind}");
    }
}

#[test]
fn the_last_step_waits_for_the_epochs_blocks_which_the_optimizer_step_holds_and_replicates() {
    let g = SimGraph::new().unwrap();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        let mut c = Cluster::new(&g, kind, 2, true);
        c.epoch(1);
        let layers = c.ms[0].state().num_layers() as u16;
        // Epoch 2 on partition 0 alone: every step but the last answers at once; the last
        // waits for partition 1's blocks of epoch 2.
        let mut mine = Vec::new();
        let steps: Vec<Step> = (0..layers)
            .map(|l| step(2, l, Phase::Forward))
            .chain((0..layers).rev().map(|l| step(2, l, Phase::Backward)))
            .collect();
        for (k, s) in steps.iter().enumerate() {
            let id = c.id();
            c.ms[0].handle_step(id, *s, Instant::now());
            let d = drain(&mut c.ms[0]);
            mine.extend(d.sent);
            let last = k + 1 == steps.len();
            assert_eq!(d.answers.len(), usize::from(!last), "{kind} step {s:?}");
        }
        // Partition 1 runs its pass the same way; the blocks of each reach the other, whose
        // last step answers with the last of them.
        let mut theirs = Vec::new();
        for (k, s) in steps.iter().enumerate() {
            let id = c.id();
            c.ms[1].handle_step(id, *s, Instant::now());
            let d = drain(&mut c.ms[1]);
            let last = k + 1 == steps.len();
            assert_eq!(d.answers.len(), usize::from(!last), "{kind} step {s:?}");
            theirs.extend(d.sent);
        }
        let now = Instant::now();
        let (n0, n1) = (theirs.len(), mine.len());
        assert!(n0 > 0 && n1 > 0);
        for (to, blocks) in [(0, theirs), (1, mine)] {
            let n = blocks.len();
            for (k, b) in blocks.into_iter().enumerate() {
                c.ms[to].handle_halo(b, now);
                let d = drain(&mut c.ms[to]);
                assert_eq!(d.answers.len(), usize::from(k + 1 == n), "{kind} block {k}");
            }
        }
        // The optimizer step holds epoch 2's blocks: the replica carries them, and survives
        // the trip through its wire form.
        let grads = vec![0.01f32; c.ms[0].state().model().num_parameters()];
        let id = c.id();
        c.ms[0].handle_apply(id, RunId::from_u128(RUN), 2, &grads, None);
        let d = drain(&mut c.ms[0]);
        let snap = d.snapshots.into_iter().next().unwrap();
        assert_eq!(snap.held_halo.len(), n0, "{kind}");
        assert!(snap.held_halo.iter().all(|b| b.header.epoch == 2));
        assert!(snap.held_halo_bytes() > 0);
        let back = ReplicaBytes::encode(0, &snap).decode().unwrap();
        assert_eq!(back.held_halo.len(), n0);
        for (a, b) in back.held_halo.iter().zip(&snap.held_halo) {
            assert_eq!(a.values().unwrap(), b.values().unwrap());
            assert_eq!(
                (a.header.layer, a.header.from),
                (b.header.layer, b.header.from)
            );
        }
    }
}

#[test]
fn a_restored_replica_resumes_with_the_held_rows_and_missing_ones_are_clear_errors() {
    let g = SimGraph::new().unwrap();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        let mut c = Cluster::new(&g, kind, 2, true);
        let (_, snaps) = c.epoch(1);
        let last = c.ms[0].state().num_layers() as u16 - 1;
        let reference = {
            let mut twin = Cluster::new(&g, kind, 2, true);
            twin.epoch(1);
            let mut loss = 0.0;
            for l in 0..=last {
                let r = twin.round(step(2, l, Phase::Forward));
                if l == last {
                    loss = loss_of(&r[0]);
                }
            }
            loss
        };
        // A partition adopted elsewhere: a new machine restored from the replica's bytes.
        let bytes = ReplicaBytes::encode(0, &snaps[0]);
        let mut adopted = machine(&g, kind, 2, 0, true);
        adopted.restore(Some(&bytes.decode().unwrap())).unwrap();
        let mut loss = None;
        for l in 0..=last {
            adopted.handle_step(
                RequestId(10 + l as u64),
                step(2, l, Phase::Forward),
                Instant::now(),
            );
            let d = drain(&mut adopted);
            if l == last {
                loss = Some(loss_of(d.answers[0].1.as_ref().unwrap()));
            }
        }
        assert_eq!(loss, Some(reference), "{kind}");
        // The same replica without its held rows: the stale step is a clear error naming the
        // missing sender, not a hang.
        let mut bare = snaps[0].clone();
        bare.held_halo.clear();
        let mut m = machine(&g, kind, 2, 0, true);
        m.restore(Some(&bare)).unwrap();
        let mut error = None;
        for l in 0..=last {
            m.handle_step(
                RequestId(10 + l as u64),
                step(2, l, Phase::Forward),
                Instant::now(),
            );
            if let Some((_, Err(e))) = drain(&mut m).answers.into_iter().next() {
                error = Some(e.to_string());
                break;
            }
        }
        let e = error.unwrap_or_else(|| panic!("{kind}: ran without held rows"));
        assert!(
            e.contains("from partition 1") && e.contains("epoch 1"),
            "{e}"
        );
        // An optimizer step without the epoch's blocks (they were lost with a node) is refused
        // instead of holding nothing for the next epoch.
        let grads = vec![0.01f32; m.state().model().num_parameters()];
        m.handle_apply(RequestId(99), RunId::from_u128(RUN), 2, &grads, None);
        match &drain(&mut m).answers[..] {
            [(_, Err(e @ ActorError::HeldRowsLost { part: 0, epoch: 2 }))] => {
                assert!(e.to_string().contains("--staleness 1"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_reset_keeps_the_held_rows_and_the_replay_gives_the_same_losses() {
    let g = SimGraph::new().unwrap();
    let mut c = Cluster::new(&g, ModelKind::Sage, 3, true);
    let mut twin = Cluster::new(&g, ModelKind::Sage, 3, true);
    c.epoch(1);
    twin.epoch(1);
    // Epoch 2 half-way (forward layer 0), then every partition resets it; the replayed epoch
    // equals the twin's uninterrupted one.
    c.round(step(2, 0, Phase::Forward));
    let id = c.id();
    for m in &mut c.ms {
        m.handle_reset(id, 2, false);
        assert!(matches!(
            drain(m).answers[..],
            [(_, Ok(Response::ResetDone))]
        ));
    }
    let (a, sa) = c.epoch(2);
    let (b, sb) = twin.epoch(2);
    assert_eq!(a, b);
    let digests = |s: &[Snapshot]| s.iter().map(|s| s.digest.clone()).collect::<Vec<_>>();
    assert_eq!(digests(&sa), digests(&sb));
    assert!(sa.iter().all(|s| !s.held_halo.is_empty()));
}

/// The rows a training block carries: every one (dense) or the changed ones (sparse).
fn carried(b: &HaloBlock) -> Option<usize> {
    match &b.payload {
        HaloPayload::Encoded(bytes) if codec::is_sparse(bytes) => Some(
            codec::decode_sparse(bytes, b.rows as usize, b.cols as usize)
                .unwrap()
                .index
                .len(),
        ),
        _ => None,
    }
}

#[test]
fn skipped_rows_are_kept_by_the_receiver_and_max_staleness_forces_a_resend() {
    let g = SimGraph::new().unwrap();
    for (kind, staleness) in [
        (ModelKind::Gcn, 0),
        (ModelKind::Sage, 0),
        (ModelKind::Sage, 1),
    ] {
        // A threshold no change reaches: rows are resent only when max-staleness says so.
        let halo = HaloConfig {
            skip_threshold: 1e9,
            max_staleness: Some(2),
            staleness,
            ..HaloConfig::default()
        };
        let mut c = Cluster::with(&g, kind, 3, halo);
        let mut losses = Vec::new();
        for e in 1..=5 {
            losses.push(c.epoch(e).0);
        }
        let training = |e: u32| -> Vec<Option<usize>> {
            c.sent
                .iter()
                .filter(|b| b.header.epoch == e && b.header.phase != Phase::Eval)
                .map(carried)
                .collect()
        };
        let rows = |e: u32| -> usize {
            c.sent
                .iter()
                .filter(|b| b.header.epoch == e && b.header.phase != Phase::Eval)
                .map(|b| b.rows as usize)
                .sum()
        };
        // Epoch 1 sends every row (nothing was sent before): dense blocks.
        assert!(training(1).iter().all(Option::is_none), "{kind}");
        // Rows sent in epoch s are used in epoch s + staleness; at most 2 epochs old means
        // they are resent when the next use would be 3 epochs after s.
        let resend = 3 - staleness;
        for e in 2..=5 {
            let blocks = training(e);
            assert!(!blocks.is_empty());
            // Rows whose last sent value was all zeros go whenever they change (a relative
            // change without bound), which moves their send epoch: so a forced epoch resends
            // most rows, and the others few.
            let sent: usize = c
                .sent
                .iter()
                .filter(|b| b.header.epoch == e && b.header.phase != Phase::Eval)
                .map(|b| carried(b).unwrap_or(b.rows as usize))
                .sum();
            if (e - 1) % resend == 0 {
                assert!(2 * sent > rows(e), "{kind} epoch {e}: {blocks:?}");
            } else {
                assert!(
                    blocks.iter().all(Option::is_some),
                    "{kind} epoch {e}: {blocks:?}"
                );
                assert!(
                    10 * sent < rows(e),
                    "{kind} epoch {e}: {sent} of {} rows",
                    rows(e)
                );
            }
        }
        // The skipped rows were replaced by the receivers' copies: the losses differ from a
        // run without skipping after the first skipped epoch, and the run repeats exactly.
        let mut exact = Cluster::with(
            &g,
            kind,
            3,
            HaloConfig {
                staleness,
                ..HaloConfig::default()
            },
        );
        let plain: Vec<_> = (1..=5).map(|e| exact.epoch(e).0).collect();
        assert_eq!(losses[0], plain[0], "{kind}");
        assert_ne!(losses[2], plain[2], "{kind}");
        let mut again = Cluster::with(&g, kind, 3, halo);
        let repeat: Vec<_> = (1..=5).map(|e| again.epoch(e).0).collect();
        assert_eq!(losses, repeat, "{kind}");
    }
}

#[test]
fn skipping_only_unchanged_rows_gives_the_exact_weights_and_restores_with_its_records() {
    let g = SimGraph::new().unwrap();
    // The smallest threshold skips only rows that did not change at all (e.g. zero gradient
    // rows): the receivers' copies are those rows, bit for bit.
    let halo = HaloConfig {
        skip_threshold: f32::MIN_POSITIVE,
        ..HaloConfig::default()
    };
    let mut c = Cluster::with(&g, ModelKind::Sage, 3, halo);
    let mut exact = Cluster::new(&g, ModelKind::Sage, 3, false);
    let digests = |s: &[Snapshot]| s.iter().map(|s| s.digest.clone()).collect::<Vec<_>>();
    let mut last = Vec::new();
    for e in 1..=4 {
        let (la, sa) = c.epoch(e);
        let (lb, sb) = exact.epoch(e);
        assert_eq!(la, lb, "epoch {e}");
        assert_eq!(digests(&sa), digests(&sb), "epoch {e}");
        last = sa;
    }
    assert!(last.iter().all(|s| !s.skip_sent.is_empty()));
    let sparse: Vec<usize> = c.sent.iter().filter_map(carried).collect();
    let skipped: usize = c
        .sent
        .iter()
        .filter_map(|b| Some(b.rows as usize - carried(b)?))
        .sum();
    assert!(skipped > 0, "nothing skipped: {sparse:?}");
    // A partition adopted elsewhere from its replica's bytes resumes with its records and
    // held rows: epoch 5 goes on exactly as in the uninterrupted run.
    let bytes = ReplicaBytes::encode(1, &last[1]);
    let mut adopted = machine_with(&g, ModelKind::Sage, 3, 1, halo);
    adopted.restore(Some(&bytes.decode().unwrap())).unwrap();
    c.ms[1] = adopted;
    let (la, sa) = c.epoch(5);
    let (lb, sb) = exact.epoch(5);
    assert_eq!(la, lb);
    assert_eq!(digests(&sa), digests(&sb));
}

/// A node lost during the optimizer step of epoch 3 (the other partitions applied it): the
/// partition adopted elsewhere resumes from its replica of step 2, which lacks the rows it
/// received in epoch 3 and its skip records of epoch 3. A reset with rollback takes every
/// partition back to step 2 and the replayed epoch 3 (training pass and optimizer step) ends
/// where the uninterrupted run does, then goes on identically.
#[test]
fn a_rollback_replays_an_optimizer_step_whose_node_was_lost() {
    let g = SimGraph::new().unwrap();
    let halo = HaloConfig {
        staleness: 1,
        skip_threshold: 0.3,
        max_staleness: Some(3),
        ..HaloConfig::default()
    };
    let digests = |s: &[Snapshot]| s.iter().map(|s| s.digest.clone()).collect::<Vec<_>>();
    let mut c = Cluster::with(&g, ModelKind::Sage, 3, halo);
    let mut twin = Cluster::with(&g, ModelKind::Sage, 3, halo);
    let mut step2 = Vec::new();
    for e in 1..=2 {
        c.epoch(e);
        step2 = twin.epoch(e).1;
    }
    c.epoch(3);
    // Partition 1 adopted from its replica of step 2 (the committed step).
    let bytes = ReplicaBytes::encode(1, &step2[1]);
    let mut adopted = machine_with(&g, ModelKind::Sage, 3, 1, halo);
    adopted.restore(Some(&bytes.decode().unwrap())).unwrap();
    c.ms[1] = adopted;
    // Without the rollback its optimizer step cannot be replayed.
    let grads = vec![0.01f32; c.ms[1].state().model().num_parameters()];
    let id = c.id();
    c.ms[1].handle_apply(id, RunId::from_u128(RUN), 3, &grads, None);
    assert!(matches!(
        drain(&mut c.ms[1]).answers[..],
        [(_, Err(ActorError::HeldRowsLost { part: 1, epoch: 3 }))]
    ));
    let id = c.id();
    let mut rolled = Vec::new();
    for m in &mut c.ms {
        m.handle_reset(id, 3, true);
        let mut back = None;
        let mut answers = Vec::new();
        while let Some(a) = m.poll_action() {
            match a {
                PartitionAction::RolledBack(s) => back = Some(s.epoch),
                PartitionAction::Answer { result, .. } => answers.push(result),
                other => panic!("{other:?}"),
            }
        }
        assert!(
            matches!(answers[..], [Ok(Response::ResetDone)]),
            "{answers:?}"
        );
        assert_eq!(m.state().epoch_done(), 2);
        rolled.push(back);
    }
    assert_eq!(
        rolled,
        [Some(2), None, Some(2)],
        "the adopted one is at step 2"
    );
    for e in 3..=4 {
        let (la, sa) = c.epoch(e);
        let (lb, sb) = twin.epoch(e);
        assert_eq!(la, lb, "epoch {e}");
        assert_eq!(digests(&sa), digests(&sb), "epoch {e}");
        for (a, b) in sa.iter().zip(&sb) {
            let bytes = |s: &Snapshot| ReplicaBytes::encode(0, s).bytes;
            assert_eq!(bytes(a), bytes(b), "epoch {e}: held rows and skip records");
        }
    }
    // Once the next epoch started, the step before is no longer kept: a rollback past the
    // committed step is a clear error, not a silent divergence.
    c.round(step(5, 0, Phase::Forward));
    let id = c.id();
    c.ms[0].handle_reset(id, 4, true);
    match &drain(&mut c.ms[0]).answers[..] {
        [(_, Err(e))] => assert!(e.to_string().contains("roll back to step 3"), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// Evaluation rows skipped (`--eval-skip-threshold`): an evaluation sends only the rows
/// that changed, the receivers keep the others until the next optimizer step holds them, and
/// a partition adopted from its replica (which predates the evaluation) gets them back from
/// a replay of that evaluation, after which the run goes on exactly as without the fault.
#[test]
fn skipped_evaluation_rows_are_held_until_the_next_step_and_an_adopted_partition_replays_them() {
    let g = SimGraph::new().unwrap();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        // A threshold no change reaches: rows are resent only when max-staleness says so.
        let halo = HaloConfig {
            eval_skip_threshold: 1e9,
            max_staleness: Some(2),
            ..HaloConfig::default()
        };
        let digests = |s: &[Snapshot]| s.iter().map(|s| s.digest.clone()).collect::<Vec<_>>();
        let mut c = Cluster::with(&g, kind, 3, halo);
        let mut exact = Cluster::new(&g, kind, 3, false);
        let mut counts = Vec::new();
        let mut exact_counts = Vec::new();
        let mut step3 = Vec::new();
        for e in 1..=4 {
            let (la, sa) = c.epoch(e);
            let (lb, sb) = exact.epoch(e);
            // Training is untouched: the same losses and weights as the exact run.
            assert_eq!((la, digests(&sa)), (lb, digests(&sb)), "{kind} epoch {e}");
            counts.push(c.eval(e));
            exact_counts.push(exact.eval(e));
            if e == 3 {
                step3 = sa;
            }
        }
        let eval_blocks = |e: u32| -> Vec<Option<usize>> {
            c.sent
                .iter()
                .filter(|b| b.header.epoch == e && b.header.phase == Phase::Eval)
                .map(carried)
                .collect()
        };
        // Evaluation 1 sends every row; 2 and 3 none (sparse blocks of no rows); 4, when the
        // rows of 1 would be 3 epochs old, every row again, as a sparse block of all its rows
        // (forced by age, not moved: the records stay).
        assert!(!eval_blocks(1).is_empty() && eval_blocks(1).iter().all(Option::is_none));
        for e in [2, 3] {
            assert!(eval_blocks(e).iter().all(|b| *b == Some(0)), "{kind} {e}");
        }
        let all_rows: Vec<Option<usize>> = c
            .sent
            .iter()
            .filter(|b| b.header.epoch == 4 && b.header.phase == Phase::Eval)
            .map(|b| Some(b.rows as usize))
            .collect();
        assert_eq!(eval_blocks(4), all_rows, "{kind}");
        assert_eq!(counts[0], exact_counts[0], "{kind}");
        // The held rows and the records of evaluation 3 were committed by step 4.
        let held_eval = |s: &Snapshot| {
            s.held_halo
                .iter()
                .filter(|b| b.header.phase == Phase::Eval)
                .count()
        };
        assert!(step3.iter().all(|s| held_eval(s) > 0), "{kind}");
        // Partition 1 adopted elsewhere after evaluation 3, from its replica of step 3: it
        // lacks what evaluation 3 sent and received.
        let mut twin = Cluster::with(&g, kind, 3, halo);
        for e in 1..=3 {
            twin.epoch(e);
            twin.eval(e);
        }
        let bytes = ReplicaBytes::encode(1, &step3[1]);
        let adopted = || {
            let mut m = machine_with(&g, kind, 3, 1, halo);
            m.restore(Some(&bytes.decode().unwrap())).unwrap();
            m
        };
        let mut lost = Cluster::with(&g, kind, 3, halo);
        for e in 1..=3 {
            lost.epoch(e);
            lost.eval(e);
        }
        lost.ms[1] = adopted();
        for l in 0..2 {
            lost.round(step(4, l, Phase::Forward));
        }
        for l in (0..2).rev() {
            lost.round(step(4, l, Phase::Backward));
        }
        let grads = vec![0.01f32; lost.ms[1].state().model().num_parameters()];
        let id = lost.id();
        lost.ms[1].handle_apply(id, RunId::from_u128(RUN), 4, &grads, None);
        match &drain(&mut lost.ms[1]).answers[..] {
            [(_, Err(e))] => assert!(
                e.to_string().contains("evaluation of epoch 3"),
                "{kind}: {e}"
            ),
            other => panic!("{kind}: {other:?}"),
        }
        // With the coordinator's replay of evaluation 3 first (as after a re-placement), the
        // run goes on as the uninterrupted one: the same counts, weights and replica bytes.
        twin.ms[1] = adopted();
        assert_eq!(
            twin.eval(3),
            counts[2],
            "{kind}: the replay counts what the first run did"
        );
        let (_, sa) = twin.epoch(4);
        let mut uninterrupted = Cluster::with(&g, kind, 3, halo);
        let mut sb = Vec::new();
        for e in 1..=4 {
            sb = uninterrupted.epoch(e).1;
            if e < 4 {
                uninterrupted.eval(e);
            }
        }
        for (a, b) in sa.iter().zip(&sb) {
            let bytes = |s: &Snapshot| ReplicaBytes::encode(0, s).bytes;
            assert_eq!(
                bytes(a),
                bytes(b),
                "{kind}: held rows and skip records of step 4"
            );
        }
        assert_eq!(twin.eval(4), counts[3], "{kind}");
        let mut again = Cluster::with(&g, kind, 3, halo);
        let repeat: Vec<_> = (1..=4)
            .map(|e| {
                again.epoch(e);
                again.eval(e)
            })
            .collect();
        assert_eq!(counts, repeat, "{kind}: a run repeats exactly");
    }
}

/// The smallest evaluation threshold skips only rows that did not change at all: the
/// evaluations count exactly what the exact run's do. (On this small graph nearly every
/// evaluation row moves, so most blocks go whole and neither side keeps them, see
/// `skip::keeps_eval_rows`; the held-and-merged path is the test above's.)
#[test]
fn skipping_only_unchanged_evaluation_rows_counts_what_the_exact_run_counts() {
    let g = SimGraph::new().unwrap();
    let halo = HaloConfig {
        eval_skip_threshold: f32::MIN_POSITIVE,
        ..HaloConfig::default()
    };
    for kind in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat] {
        let mut c = Cluster::with(&g, kind, 3, halo);
        let mut exact = Cluster::new(&g, kind, 3, false);
        for e in 1..=4 {
            c.epoch(e);
            exact.epoch(e);
            assert_eq!(c.eval(e), exact.eval(e), "{kind}: epoch {e}");
        }
    }
}

/// The payload's bytes, whatever its form (f32 values little endian).
fn payload_bytes(p: &HaloPayload) -> Vec<u8> {
    match p {
        HaloPayload::Encoded(b) => b.to_vec(),
        HaloPayload::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Halo settings whose partitions hold rows or keep records, each with what a replica may
/// leave out under it.
fn holding_configs() -> Vec<(&'static str, HaloConfig)> {
    use trellis_runtime::comm::HaloCodec;
    vec![
        ("efficient", HaloConfig::efficient()),
        (
            "int8, skip only",
            HaloConfig {
                codec: HaloCodec::Int8,
                skip_threshold: 0.5,
                max_staleness: Some(3),
                ..HaloConfig::default()
            },
        ),
        (
            "fp16, staleness, evaluation skip only",
            HaloConfig {
                codec: HaloCodec::Fp16,
                staleness: 1,
                eval_skip_threshold: 0.1,
                max_staleness: Some(3),
                ..HaloConfig::default()
            },
        ),
        (
            "fp32, skip and staleness",
            HaloConfig {
                staleness: 1,
                skip_threshold: 0.5,
                max_staleness: Some(3),
                ..HaloConfig::default()
            },
        ),
    ]
}

/// What [`crate::replica::Mirrors`] relies on, after every step of runs with each setting:
/// every skip record kept as encoded rows is, byte for byte, the block its receiver holds
/// (same phase and layer tag), and every held block of a fixed-width codec is its sender's
/// record wherever the sender keeps records of that phase (training rows with
/// `--skip-threshold`, evaluation rows always).
#[test]
fn skip_records_and_held_blocks_mirror_each_other_byte_for_byte() {
    use crate::protocol::skip::SentValues;
    let g = SimGraph::new().unwrap();
    for kind in [ModelKind::Gcn, ModelKind::Sage] {
        for (name, halo) in holding_configs() {
            let mut c = Cluster::with(&g, kind, 3, halo);
            let mut mirrored = 0;
            for e in 1..=6 {
                let (_, snaps) = c.epoch(e);
                c.eval(e);
                for (l, s) in snaps.iter().enumerate() {
                    for r in &s.skip_sent {
                        let SentValues::Encoded(v) = &r.values else {
                            continue;
                        };
                        let held = snaps[r.to.0 as usize].held_halo.iter().find(|b| {
                            b.header.from.0 as usize == l
                                && (b.header.phase, b.header.layer) == (r.phase, r.layer)
                        });
                        let held = held.map(|b| payload_bytes(&b.payload));
                        assert_eq!(held.as_deref(), Some(&v[..]), "{kind:?} {name} e{e}");
                        mirrored += 1;
                    }
                    for b in &s.held_halo {
                        let fixed = matches!(&b.payload,
                            HaloPayload::Encoded(p) if codec::is_fixed_width(p));
                        let recorded = b.header.phase == Phase::Eval || halo.skip_threshold > 0.0;
                        if !(fixed && recorded) {
                            continue;
                        }
                        let record = snaps[b.header.from.0 as usize].skip_sent.iter().find(|r| {
                            r.to.0 as usize == l
                                && (r.phase, r.layer) == (b.header.phase, b.header.layer)
                        });
                        let Some(SentValues::Encoded(v)) = record.map(|r| &r.values) else {
                            panic!("{kind:?} {name} e{e}: no encoded record of {:?}", b.header);
                        };
                        assert_eq!(payload_bytes(&b.payload), v.to_vec(), "{kind:?} {name}");
                        mirrored += 1;
                    }
                }
            }
            let fp32 = halo.codec == trellis_runtime::comm::HaloCodec::Fp32;
            assert_eq!(mirrored == 0, fp32, "{kind:?} {name}: {mirrored} mirrors");
        }
    }
}

/// A replica that leaves out the rows its receiver's partitions hold is smaller, decodes
/// only on a node that holds them at its step, and there decodes to the whole snapshot;
/// rows there that differ from the sender's are refused, naming them.
#[test]
fn a_replica_leaves_out_the_rows_its_receiver_holds_and_is_completed_from_them() {
    use crate::replica::{Mirrors, ReplicaStore};
    let g = SimGraph::new().unwrap();
    for (name, halo) in holding_configs() {
        let mut c = Cluster::with(&g, ModelKind::Gcn, 3, halo);
        let mut snaps = Vec::new();
        for e in 1..=4 {
            snaps = c.epoch(e).1;
            c.eval(e);
        }
        // Partition 0's replica goes to the node that hosts partitions 1 and 2.
        let mirrors = Mirrors {
            peers: vec![1, 2],
            training_records: halo.skip_threshold > 0.0,
        };
        let whole = ReplicaBytes::encode_without_model(0, &snaps[0]);
        let thin = ReplicaBytes::encode_for(0, &snaps[0], &mirrors);
        // Fp32 rows are recorded in int8, and this setting's evaluation blocks all moved
        // (neither side keeps them): nothing to leave out. Elsewhere the records and held
        // blocks of partitions 1 and 2 (on this small graph, a small part of a replica).
        let fp32 = halo.codec == trellis_runtime::comm::HaloCodec::Fp32;
        let leaves_out = !fp32 && halo.skip_threshold > 0.0;
        assert_eq!(thin.bytes.len() < whole.bytes.len(), leaves_out, "{name}");
        if leaves_out {
            let e = thin.decode().unwrap_err();
            assert!(
                e.contains("completed only on the node that hosts partition"),
                "{e}"
            );
        }
        let receiver = ReplicaStore::new();
        receiver.set_sender(Arc::new(|_| {}), true);
        receiver.set_mirrors(Arc::new(|_| Mirrors::default()));
        let full = |store: &ReplicaStore| {
            let mut s = thin.decode_in(store)?;
            s.params = snaps[0].params.clone();
            s.opt_state = snaps[0].opt_state.clone();
            Ok::<_, String>(s)
        };
        // The model of the step is there, the rows not yet.
        receiver.put(
            1,
            Arc::new(Snapshot {
                held_halo: Vec::new(),
                skip_sent: Vec::new(),
                ..snaps[1].clone()
            }),
        );
        if leaves_out {
            let e = full(&receiver).unwrap_err();
            assert!(
                e.contains("which this node neither holds nor fetched")
                    || e.contains("another digest"),
                "{e}"
            );
        }
        receiver.put(1, Arc::new(snaps[1].clone()));
        receiver.put(2, Arc::new(snaps[2].clone()));
        let back = full(&receiver).unwrap();
        assert_eq!(back.skip_sent, snaps[0].skip_sent, "{name}");
        assert_eq!(back.held_halo.len(), snaps[0].held_halo.len());
        let header = |b: &HaloBlock| {
            let h = &b.header;
            (h.epoch, h.phase, h.layer, h.from, b.rows)
        };
        for (a, b) in back.held_halo.iter().zip(&snaps[0].held_halo) {
            let bytes = (payload_bytes(&a.payload), payload_bytes(&b.payload));
            assert_eq!(bytes.0, bytes.1, "{name}");
            assert_eq!(header(a), header(b));
        }
        if !leaves_out {
            continue;
        }
        // A held block of partition 2 that is not what partition 0 recorded: refused.
        let mut other = snaps[2].clone();
        let b = other
            .held_halo
            .iter_mut()
            .find(|b| b.header.from.0 == 0 && matches!(b.payload, HaloPayload::Encoded(_)))
            .unwrap();
        let HaloPayload::Encoded(p) = &b.payload else {
            unreachable!()
        };
        let mut p = p.to_vec();
        *p.last_mut().unwrap() ^= 1;
        b.payload = HaloPayload::Encoded(Arc::from(p));
        receiver.put(2, Arc::new(other));
        let e = full(&receiver).unwrap_err();
        assert!(
            e.contains("another digest than the sender's") && e.contains("partition 2"),
            "{e}"
        );
    }
}

/// A block or record no row of which was resent keeps its buffer from one step to the next
/// (no copy on the partition's thread), and a replica whose left-out payloads' digests are
/// taken from the last replica's where the buffer is the same has the bytes of one that
/// hashes every payload.
#[test]
fn unchanged_rows_keep_their_buffer_and_replicas_reuse_their_digests() {
    use crate::protocol::skip::SentValues;
    use crate::replica::{Encoding, MirrorDigests, Mirrors};
    let g = SimGraph::new().unwrap();
    let mut c = Cluster::with(&g, ModelKind::Gcn, 3, HaloConfig::efficient());
    let mirrors = Mirrors {
        peers: vec![1, 2],
        training_records: true,
    };
    let mut digests = MirrorDigests::default();
    let (mut kept_records, mut kept_blocks) = (0, 0);
    let mut last: Option<Snapshot> = None;
    for e in 1..=6 {
        let snap = c.epoch(e).1.remove(0);
        c.eval(e);
        let cached = Encoding::start(0, &snap, false, &mirrors).finish_with(&snap, &mut digests);
        assert_eq!(cached, ReplicaBytes::encode_for(0, &snap, &mirrors), "e{e}");
        if let Some(prev) = &last {
            for (a, b) in snap.skip_sent.iter().zip(&prev.skip_sent) {
                if let (SentValues::Encoded(a), SentValues::Encoded(b)) = (&a.values, &b.values) {
                    kept_records += usize::from(Arc::ptr_eq(a, b));
                }
            }
            for (a, b) in snap.held_halo.iter().zip(&prev.held_halo) {
                if let (HaloPayload::Encoded(a), HaloPayload::Encoded(b)) = (&a.payload, &b.payload)
                {
                    kept_blocks += usize::from(Arc::ptr_eq(a, b));
                }
            }
        }
        last = Some(snap);
    }
    assert!(
        kept_records > 0 && kept_blocks > 0,
        "{kept_records} {kept_blocks}"
    );
}

/// With partitions on three nodes, a replica also leaves out the rows it shares with a
/// partition on a third node: the receiver lists them as missing, takes them as fetched
/// from that node (in pieces, any order; pieces from another node or of payloads not asked
/// for are dropped), and then decodes the whole snapshot; a payload the third node does not
/// keep, a piece that does not fit, or fetched rows with another digest are refused, naming
/// them.
#[test]
fn rows_shared_with_a_third_nodes_partition_are_fetched_at_adoption() {
    use crate::replica::{FetchProgress, MirrorKey, Mirrors, ReplicaStore};
    let g = SimGraph::new().unwrap();
    let mut c = Cluster::with(&g, ModelKind::Gcn, 3, HaloConfig::efficient());
    let mut snaps = Vec::new();
    for e in 1..=4 {
        snaps = c.epoch(e).1;
        c.eval(e);
    }
    let epoch = snaps[0].epoch;
    // Partition 0 on node 0, its replica on node 1 (partition 1), partition 2 on node 2.
    let mirrors = Mirrors {
        peers: vec![1, 2],
        training_records: true,
    };
    let thin = ReplicaBytes::encode_for(0, &snaps[0], &mirrors);
    let setup = || {
        let receiver = ReplicaStore::new();
        receiver.set_sender(Arc::new(|_| {}), true);
        receiver.set_mirrors(Arc::new(|_| Mirrors::default()));
        receiver.put(1, Arc::new(snaps[1].clone()));
        receiver.put_remote(thin.clone());
        receiver
    };
    let third = ReplicaStore::new();
    third.set_mirrors(Arc::new(|_| Mirrors::default()));
    third.put(2, Arc::new(snaps[2].clone()));
    let receiver = setup();
    let keys = receiver.missing_mirrors(0, epoch).unwrap();
    assert!(!keys.is_empty());
    assert!(
        keys.iter().all(|k| k.holder == 2 && k.peer == 0),
        "{keys:?}"
    );
    assert_eq!(
        thin.left_out().unwrap().len(),
        keys.len() + keys_held_by(&thin, 1),
        "the rest are partition 1's, held here"
    );
    let e = thin.decode_in(&receiver).unwrap_err();
    assert!(e.contains("neither holds nor fetched"), "{e}");
    assert_eq!(
        receiver.fetch_progress(epoch, &keys),
        FetchProgress::Waiting(keys.len())
    );
    // Asked of node 2 (the third node): pieces from another node, or of payloads not
    // asked for, are dropped.
    receiver.expect_fetched(epoch, &keys, 2);
    let first = third
        .mirror_at(epoch, keys[0])
        .expect("the third node keeps it");
    receiver.put_fetched(
        1,
        epoch,
        keys[0],
        true,
        0,
        first.len() as u64,
        first.to_vec(),
    );
    let other = MirrorKey {
        layer: 99,
        ..keys[0]
    };
    receiver.put_fetched(2, epoch, other, true, 0, 3, vec![1, 2, 3]);
    assert_eq!(
        receiver.fetch_progress(epoch, &keys),
        FetchProgress::Waiting(keys.len())
    );
    assert_eq!(
        receiver.fetch_progress(epoch, &[other]),
        FetchProgress::Waiting(1)
    );
    // The answers, in any order.
    for &k in keys.iter().rev() {
        let payload = third.mirror_at(epoch, k).expect("the third node keeps it");
        receiver.put_fetched(2, epoch, k, true, 0, payload.len() as u64, payload.to_vec());
    }
    assert_eq!(receiver.fetch_progress(epoch, &keys), FetchProgress::Done);
    assert!(receiver.missing_mirrors(0, epoch).unwrap().is_empty());
    let back = thin.decode_in(&receiver).unwrap();
    assert_eq!(back.skip_sent, snaps[0].skip_sent);
    for (a, b) in back.held_halo.iter().zip(&snaps[0].held_halo) {
        assert_eq!(payload_bytes(&a.payload), payload_bytes(&b.payload));
    }
    receiver.clear_fetched();
    assert_eq!(receiver.missing_mirrors(0, epoch).unwrap(), keys);

    // Not kept on the third node: a clear failure naming the payload.
    let k = keys[0];
    receiver.expect_fetched(epoch, &keys, 2);
    receiver.put_fetched(2, epoch, k, false, 0, 0, Vec::new());
    let FetchProgress::Failed(why) = receiver.fetch_progress(epoch, &keys) else {
        panic!("a refusal is a failure");
    };
    assert!(
        why.contains("partition 2") && why.contains("node 2") && why.contains("does not hold"),
        "{why}"
    );
    // A piece past its end.
    let receiver = setup();
    receiver.expect_fetched(epoch, &[k], 2);
    receiver.put_fetched(2, epoch, k, true, 0, 4, vec![0; 8]);
    let FetchProgress::Failed(why) = receiver.fetch_progress(epoch, &[k]) else {
        panic!("a misfit piece is a failure");
    };
    assert!(why.contains("does not fit"), "{why}");
    // Rows that are not the sender's: refused by digest when decoded.
    let receiver = setup();
    receiver.expect_fetched(epoch, &keys, 2);
    for &k in &keys {
        let mut payload = third.mirror_at(epoch, k).unwrap().to_vec();
        *payload.last_mut().unwrap() ^= 1;
        receiver.put_fetched(2, epoch, k, true, 0, payload.len() as u64, payload);
    }
    let e = thin.decode_in(&receiver).unwrap_err();
    assert!(
        e.contains("another digest") && e.contains("partition 2"),
        "{e}"
    );
    // A key nobody left out is not kept anywhere.
    let none = MirrorKey { layer: 99, ..k };
    assert!(third.mirror_at(epoch, none).is_none());
    // A payload larger than a piece arrives in pieces, in any order, and is whole once all
    // are in.
    let big = crate::replica::REPLICA_PIECE as u64 + 10;
    receiver.expect_fetched(epoch, &[none], 2);
    receiver.put_fetched(2, epoch, none, true, big - 10, big, vec![7; 10]);
    assert_eq!(
        receiver.fetch_progress(epoch, &[none]),
        FetchProgress::Waiting(1)
    );
    receiver.put_fetched(2, epoch, none, true, 0, big, vec![7; big as usize - 10]);
    assert_eq!(receiver.fetch_progress(epoch, &[none]), FetchProgress::Done);
}

/// How many payloads `r` left out that partition `holder` holds.
fn keys_held_by(r: &ReplicaBytes, holder: u32) -> usize {
    r.left_out()
        .unwrap()
        .iter()
        .filter(|k| k.holder == holder)
        .count()
}
