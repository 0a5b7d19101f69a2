//! The epoch machine driven by hand, without threads, sockets or clocks.
use super::*;
use crate::RestoreReport;
use trellis_gpu::KernelTimes;

const P: u32 = 3;
const L: u16 = 2;

fn cfg(epochs: u32) -> EpochConfig {
    EpochConfig {
        parts: P,
        layers: L,
        epochs,
        deadline: Duration::from_secs(1),
        max_recoveries: 3,
        policy: RestartPolicy::default(),
        retry_timeouts: false,
        node_recovery: false,
        checkpoint_every: None,
        gated: false,
        totals: SplitTotals {
            train: 30,
            val: 30,
            test: 30,
        },
        replays_eval: false,
    }
}

/// A test harness: the machine, the time, and the actions seen.
struct Drive {
    m: EpochMachine,
    now: Instant,
    /// Requests sent and not answered yet.
    sent: Vec<Outgoing>,
    events: Vec<EpochAction>,
}

impl Drive {
    fn new(cfg: EpochConfig) -> Self {
        let mut m = EpochMachine::new(cfg, Committed::default(), Vec::new())
            .with_initial_digest("init".into());
        let now = Instant::now();
        m.start(now);
        let mut d = Drive {
            m,
            now,
            sent: Vec::new(),
            events: Vec::new(),
        };
        d.collect();
        d
    }

    fn collect(&mut self) {
        while let Some(a) = self.m.poll_action() {
            match a {
                EpochAction::Send(o) => self.sent.push(o),
                other => self.events.push(other),
            }
        }
    }

    /// The answer a healthy partition gives.
    fn healthy(o: &Outgoing) -> Response {
        match &o.request {
            Request::Step { phase, layer } => Response::Step(reply(o.part, *phase, *layer)),
            Request::Apply { .. } => applied(&format!("digest-{}", o.epoch)),
            Request::Reset { .. } => Response::ResetDone,
        }
    }

    /// Answers every outstanding request with `f` (healthy by default), in partition order.
    fn answer_round(
        &mut self,
        mut f: impl FnMut(&Outgoing) -> Option<Result<Response, ActorError>>,
    ) {
        let round = std::mem::take(&mut self.sent);
        for o in &round {
            let r = f(o).unwrap_or_else(|| Ok(Self::healthy(o)));
            self.now += Duration::from_millis(1);
            self.m.handle_response(o.id, o.part, r, self.now);
        }
        self.collect();
    }

    fn answer_all_healthy(&mut self) {
        while !self.sent.is_empty() {
            self.answer_round(|_| None);
        }
    }

    fn requests(&self) -> Vec<String> {
        self.sent.iter().map(|o| describe(&o.request)).collect()
    }

    fn finished(&self) -> Option<&EpochsDone> {
        self.events.iter().find_map(|e| match e {
            EpochAction::Finished(d) => Some(d),
            _ => None,
        })
    }

    fn failed(&self) -> Option<&ActorError> {
        self.events.iter().find_map(|e| match e {
            EpochAction::Failed(e) => Some(e),
            _ => None,
        })
    }

    fn recovered(&self) -> Vec<&Recovery> {
        self.events
            .iter()
            .filter_map(|e| match e {
                EpochAction::Recovered(r) => Some(r),
                _ => None,
            })
            .collect()
    }
}

fn describe(r: &Request) -> String {
    match r {
        Request::Step { phase, layer } => format!("{phase:?}{layer}"),
        Request::Apply { .. } => "Apply".into(),
        Request::Reset { .. } => "Reset".into(),
    }
}

fn reply(part: u32, phase: Phase, layer: u16) -> StepReply {
    let outcome = match (phase, layer) {
        (Phase::Forward, l) if l == L - 1 => Outcome::Loss {
            loss_sum: 1.0,
            count: 10,
            correct: 5,
        },
        (Phase::Backward, 0) => Outcome::Grads(Arc::from(vec![part as f32, 1.0])),
        (Phase::Eval, l) if l == L - 1 => Outcome::Eval {
            train: 5,
            val: 4,
            test: 3,
        },
        _ => Outcome::LayerDone,
    };
    StepReply {
        part,
        compute_ms: 1.0,
        halo_bytes: 100,
        halo_fp32_bytes: 400,
        kernels: KernelTimes::default(),
        outcome,
        restored: None,
    }
}

fn applied(digest: &str) -> Response {
    Response::Applied(Applied {
        digest: digest.into(),
        restored: None,
        replica: Default::default(),
    })
}

fn panicked(part: u32) -> ActorError {
    ActorError::Panicked {
        part,
        message: "injected fault: test".into(),
    }
}

#[test]
fn an_epoch_runs_its_rounds_in_order_and_sums_gradients_in_partition_order() {
    let mut d = Drive::new(cfg(1));
    let mut order = Vec::new();
    while !d.sent.is_empty() {
        let reqs = d.requests();
        assert_eq!(reqs.len(), P as usize, "one request per partition");
        assert!(reqs.iter().all(|r| *r == reqs[0]));
        if let Request::Apply { grads } = &d.sent[0].request {
            // 0 + 1 + 2 in partition order, and 1 + 1 + 1.
            assert_eq!(&grads[..], &[3.0, 3.0]);
        }
        order.push(reqs[0].clone());
        // Answer in reverse partition order: the result must not depend on it.
        d.sent.reverse();
        d.answer_round(|_| None);
    }
    assert_eq!(
        order,
        [
            "Forward0",
            "Forward1",
            "Backward1",
            "Backward0",
            "Apply",
            "Eval0",
            "Eval1"
        ]
    );
    let done = d.finished().expect("finished");
    assert_eq!(done.digest, "digest-1");
    let log = &done.logs[0];
    assert_eq!(log.epoch, 1);
    assert!(
        (log.loss - 0.1).abs() < 1e-12,
        "loss sum / count: {}",
        log.loss
    );
    assert!((log.val_acc - 12.0 / 30.0).abs() < 1e-12);
    assert_eq!(log.halo_bytes, 100 * P as u64 * 2 * L as u64);
    assert_eq!(log.halo_fp32_bytes, 4 * log.halo_bytes);
    assert!(d
        .events
        .iter()
        .any(|e| matches!(e, EpochAction::Profile(_))));
}

#[test]
fn replies_to_requests_no_longer_outstanding_are_dropped() {
    let mut d = Drive::new(cfg(1));
    let first = d.sent[0].clone();
    d.answer_round(|_| None);
    // The same reply again (a duplicate), and a reply to a request never sent.
    d.m.handle_response(first.id, first.part, Ok(Drive::healthy(&first)), d.now);
    d.m.handle_response(RequestId(9999), 0, Ok(Response::ResetDone), d.now);
    assert_eq!(d.m.stale_replies(), 2);
    d.collect();
    assert_eq!(
        d.requests()[0],
        "Forward1",
        "the machine did not move on twice"
    );
    d.answer_all_healthy();
    assert!(d.finished().is_some());
}

#[test]
fn a_panic_resets_everyone_and_replays_the_training_step() {
    let mut d = Drive::new(cfg(2));
    d.answer_all_healthy_until_epoch(2);
    // Epoch 2: partition 1 panics in Backward1.
    d.answer_round(|_| None); // Forward0
    d.answer_round(|_| None); // Forward1
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    assert!(d
        .events
        .iter()
        .any(|e| matches!(e, EpochAction::CancelRunning)));
    assert!(
        d.requests().iter().all(|r| r == "Reset"),
        "{:?}",
        d.requests()
    );
    d.answer_round(|_| None);
    assert_eq!(
        d.requests()[0],
        "Forward0",
        "the training step replays from its start"
    );
    // The restarted partition reports the committed state it restored.
    d.answer_round(|o| {
        (o.part == 1).then(|| {
            let mut r = reply(1, Phase::Forward, 0);
            r.restored = Some(RestoreReport {
                epoch: 1,
                digest: "digest-1".into(),
            });
            Ok(Response::Step(r))
        })
    });
    d.answer_all_healthy();
    let rec = d.recovered();
    assert_eq!(rec.len(), 1);
    assert_eq!(
        (rec[0].kind.as_str(), rec[0].partition, rec[0].epoch),
        ("actor-panic", 1, 2)
    );
    assert_eq!(rec[0].digest_ok, Some(true));
    assert_eq!(rec[0].steps_replayed, 1);
    assert_eq!(d.finished().expect("finished").digest, "digest-2");
}

impl Drive {
    /// Answers everything healthily until epoch `e` has started.
    fn answer_all_healthy_until_epoch(&mut self, e: u32) {
        while self.m.epoch() < e {
            self.answer_round(|_| None);
        }
    }
}

#[test]
fn a_restore_of_the_wrong_state_is_reported_as_such() {
    for (restored_epoch, digest, want) in [
        (0, "init", Some(true)),
        (0, "garbage", Some(false)),
        (1, "init", Some(false)),
    ] {
        let mut d = Drive::new(cfg(1));
        d.answer_round(|o| (o.part == 2).then(|| Err(panicked(2))));
        d.answer_round(|_| None); // resets
        d.answer_round(|o| {
            (o.part == 2).then(|| {
                let mut r = reply(2, Phase::Forward, 0);
                r.restored = Some(RestoreReport {
                    epoch: restored_epoch,
                    digest: digest.into(),
                });
                Ok(Response::Step(r))
            })
        });
        d.answer_all_healthy();
        assert_eq!(
            d.recovered()[0].digest_ok,
            want,
            "{restored_epoch} {digest}"
        );
    }
}

#[test]
fn a_missed_deadline_fails_the_run_unless_timeouts_are_retried() {
    let mut d = Drive::new(cfg(1));
    let deadline = d.m.poll_timeout().expect("a round is in flight");
    d.m.handle_timeout(deadline - Duration::from_millis(1));
    d.collect();
    assert!(d.failed().is_none(), "not before the deadline");
    d.m.handle_timeout(deadline);
    d.collect();
    assert!(matches!(
        d.failed(),
        Some(ActorError::Timeout { part: 0, .. })
    ));

    let mut d = Drive::new(EpochConfig {
        retry_timeouts: true,
        ..cfg(1)
    });
    // Partition 2's reply is lost: the others answer, then the deadline passes.
    let round = std::mem::take(&mut d.sent);
    for o in round.iter().filter(|o| o.part != 2) {
        d.m.handle_response(o.id, o.part, Ok(Drive::healthy(o)), d.now);
    }
    let deadline = d.m.poll_timeout().expect("waiting for partition 2");
    d.m.handle_timeout(deadline);
    d.collect();
    assert!(d.requests().iter().all(|r| r == "Reset"));
    // The late reply of the lost round arrives during the reset: dropped.
    let late = round.iter().find(|o| o.part == 2).unwrap();
    d.m.handle_response(late.id, 2, Ok(Drive::healthy(late)), deadline);
    d.answer_all_healthy();
    let rec = d.recovered();
    assert_eq!((rec[0].kind.as_str(), rec[0].partition), ("timeout", 2));
    assert_eq!(rec[0].digest_ok, None, "nothing was restored");
    assert!(d.finished().is_some());
}

#[test]
fn the_recovery_budget_is_for_the_whole_run() {
    let mut d = Drive::new(EpochConfig {
        max_recoveries: 2,
        ..cfg(1)
    });
    for _ in 0..2 {
        d.answer_round(|o| (o.part == 0).then(|| Err(panicked(0))));
        d.answer_round(|_| None); // resets
    }
    d.answer_round(|o| (o.part == 0).then(|| Err(panicked(0))));
    match d.failed() {
        Some(ActorError::RestartsExhausted {
            part: 0,
            restarts: 2,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(d.m.is_over());
    assert!(d.m.poll_action().is_none());
}

#[test]
fn a_partition_that_keeps_failing_is_moved_or_the_run_fails() {
    let policy = RestartPolicy {
        max_restarts: 1,
        window_epochs: 10,
    };
    // Without node recovery: the second panic within the window ends the run.
    let mut d = Drive::new(EpochConfig { policy, ..cfg(1) });
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    d.answer_round(|_| None);
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    assert!(matches!(
        d.failed(),
        Some(ActorError::RestartsExhausted { part: 1, .. })
    ));
    // With node recovery: it is moved, then the unit replays.
    let mut d = Drive::new(EpochConfig {
        policy,
        node_recovery: true,
        max_recoveries: 5,
        ..cfg(1)
    });
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    d.answer_round(|_| None);
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    assert!(d
        .events
        .iter()
        .any(|e| matches!(e, EpochAction::MovePartition { part: 1, .. })));
    assert!(
        d.sent.is_empty(),
        "nothing is sent while the partition moves"
    );
    d.m.handle_placement(
        Ok(Placement {
            moves: vec![(1, 4)],
            digest_ok: true,
        }),
        d.now,
    );
    d.collect();
    d.answer_all_healthy();
    let rec = d.recovered();
    assert_eq!(
        rec.len(),
        2,
        "both recoveries close when the replay completes"
    );
    assert_eq!(rec[1].kind, "escalated-move");
    assert_eq!(rec[1].replaced, vec![(1, 4)]);
    assert!(d.finished().is_some());
}

#[test]
fn a_lost_node_is_replaced_and_a_loss_during_replacement_is_recovered_too() {
    let mut d = Drive::new(EpochConfig {
        node_recovery: true,
        ..cfg(1)
    });
    let node_err = |node| ActorError::Node {
        node,
        detail: "connection lost".into(),
    };
    d.answer_round(|o| (o.part == 2).then(|| Err(node_err(5))));
    assert!(d
        .events
        .iter()
        .any(|e| matches!(e, EpochAction::ReplaceNode { node: 5, .. })));
    // The node chosen to adopt dies too.
    d.m.handle_placement(Err(node_err(6)), d.now);
    d.collect();
    assert_eq!(
        d.events
            .iter()
            .filter(|e| matches!(e, EpochAction::ReplaceNode { .. }))
            .count(),
        2
    );
    d.m.handle_placement(
        Ok(Placement {
            moves: vec![(2, 7)],
            digest_ok: true,
        }),
        d.now,
    );
    d.collect();
    d.answer_all_healthy();
    let rec = d.recovered();
    assert_eq!(rec.len(), 1);
    assert_eq!(
        (rec[0].kind.as_str(), rec[0].node, rec[0].partition),
        ("node-loss", Some(6), 2)
    );
    assert!(d.finished().is_some());
    // Without node recovery the loss ends the run, naming the node.
    let mut d = Drive::new(cfg(1));
    d.answer_round(|o| (o.part == 0).then(|| Err(node_err(3))));
    assert!(matches!(d.failed(), Some(ActorError::Node { node: 3, .. })));
}

#[test]
fn replicas_that_disagree_fail_the_run() {
    let mut d = Drive::new(cfg(1));
    for _ in 0..4 {
        d.answer_round(|_| None);
    }
    assert_eq!(d.requests()[0], "Apply");
    d.answer_round(|o| (o.part == 2).then(|| Ok(applied("other"))));
    assert!(matches!(
        d.failed(),
        Some(ActorError::Diverged { part: 2, .. })
    ));
}

#[test]
fn the_gate_paces_epochs_and_checkpoints_are_due_every_k() {
    let mut d = Drive::new(EpochConfig {
        gated: true,
        checkpoint_every: Some(2),
        ..cfg(5)
    });
    let mut checkpoints = Vec::new();
    for epoch in 1..=3 {
        assert!(matches!(d.events.pop(), Some(EpochAction::WaitGate { epoch: e }) if e == epoch));
        d.m.handle_gate(true, d.now);
        d.collect();
        d.answer_all_healthy();
        for e in &d.events {
            if let EpochAction::Checkpoint { epoch, logs, .. } = e {
                checkpoints.push((*epoch, logs.len()));
            }
        }
        d.events
            .retain(|e| !matches!(e, EpochAction::Checkpoint { .. }));
    }
    assert!(matches!(
        d.events.pop(),
        Some(EpochAction::WaitGate { epoch: 4 })
    ));
    d.m.handle_gate(false, d.now);
    d.collect();
    assert_eq!(checkpoints, vec![(2, 2)]);
    assert_eq!(
        d.finished().expect("closed gate ends the run").logs.len(),
        3
    );
}

#[test]
fn a_resumed_run_continues_after_the_committed_epoch() {
    let committed = Committed {
        epoch: 4,
        digest: "digest-4".into(),
    };
    let mut m = EpochMachine::new(cfg(5), committed, Vec::new());
    m.start(Instant::now());
    let mut first = None;
    while let Some(a) = m.poll_action() {
        if let EpochAction::Send(o) = a {
            first.get_or_insert(o.epoch);
        }
    }
    assert_eq!(first, Some(5));
    let mut m = EpochMachine::new(
        cfg(4),
        Committed {
            epoch: 4,
            digest: "d".into(),
        },
        Vec::new(),
    );
    m.start(Instant::now());
    assert!(matches!(m.poll_action(), Some(EpochAction::Finished(d)) if d.digest == "d"));
}

#[test]
fn a_panic_in_the_optimizer_step_is_checked_by_the_restore_its_replay_reports() {
    let mut d = Drive::new(cfg(1));
    for _ in 0..4 {
        d.answer_round(|_| None);
    }
    assert_eq!(d.requests()[0], "Apply");
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    d.answer_round(|_| None); // resets
    assert_eq!(
        d.requests()[0],
        "Apply",
        "the same summed gradients are applied again"
    );
    d.answer_round(|o| {
        (o.part == 1).then(|| {
            Ok(Response::Applied(Applied {
                digest: "digest-1".into(),
                restored: Some(RestoreReport {
                    epoch: 0,
                    digest: "init".into(),
                }),
                replica: Default::default(),
            }))
        })
    });
    d.answer_all_healthy();
    assert_eq!(d.recovered()[0].digest_ok, Some(true));
}

#[test]
fn a_panic_is_detected_from_when_it_happened_not_from_the_round_start() {
    let mut d = Drive::new(cfg(1));
    let start = d.now;
    d.now += Duration::from_millis(500);
    d.m.handle_failure_time(1, start + Duration::from_millis(480));
    d.answer_round(|o| (o.part == 1).then(|| Err(panicked(1))));
    d.answer_all_healthy();
    let ms = d.recovered()[0].detected_ms;
    assert!(
        (20.0..=25.0).contains(&ms),
        "detected {ms} ms after the panic"
    );
}

/// The evaluation log a previous process wrote for `epoch` (a resume's prior logs), with the
/// accuracies [`reply`]'s counts give over [`cfg`]'s totals.
fn prior_log(epoch: u32, test_correct: usize) -> EpochLog {
    EpochLog {
        epoch,
        train_acc: 15.0 / 30.0,
        val_acc: 12.0 / 30.0,
        test_acc: test_correct as f64 * 3.0 / 30.0,
        ..EpochLog::default()
    }
}

#[test]
fn with_evaluation_rows_skipped_a_replaced_partition_gets_the_last_evaluation_replayed() {
    let mut d = Drive::new(EpochConfig {
        node_recovery: true,
        replays_eval: true,
        ..cfg(2)
    });
    // Epoch 1 as usual: no evaluation before it to replay.
    for _ in 0..7 {
        d.answer_round(|_| None);
    }
    assert_eq!(d.requests()[0], "Forward0");
    assert!(d.sent.iter().all(|o| o.epoch == 2));
    // Epoch 2's training pass loses partition 1's node; it is placed on node 5.
    let lose_partition_1 = |d: &mut Drive| {
        let lost = || ActorError::Node {
            node: 4,
            detail: "connection lost".into(),
        };
        d.answer_round(|o| (o.part == 1).then(|| Err(lost())));
        d.m.handle_placement(
            Ok(Placement {
                moves: vec![(1, 5)],
                digest_ok: true,
            }),
            d.now,
        );
        d.collect();
    };
    lose_partition_1(&mut d);
    assert_eq!(d.requests()[0], "Reset");
    d.answer_round(|_| None);
    // Epoch 1's evaluation is replayed (requests of epoch 1), then epoch 2's training pass.
    let mut order = Vec::new();
    while let Some(o) = d.sent.first() {
        order.push((describe(&o.request), o.epoch));
        d.answer_round(|_| None);
    }
    assert_eq!(
        order[..4],
        [
            ("Eval0".to_string(), 1),
            ("Eval1".to_string(), 1),
            ("Forward0".to_string(), 2),
            ("Forward1".to_string(), 2)
        ]
    );
    // The replay is no epoch of its own: two epoch logs, and the recovery closed once.
    let done = d.finished().expect("finished");
    assert_eq!(done.logs.len(), 2);
    assert_eq!(d.recovered().len(), 1);
    // Without evaluation rows skipped nothing is replayed.
    let mut d = Drive::new(EpochConfig {
        node_recovery: true,
        ..cfg(2)
    });
    for _ in 0..7 {
        d.answer_round(|_| None);
    }
    lose_partition_1(&mut d);
    d.answer_round(|_| None);
    assert_eq!(d.requests()[0], "Forward0");
}

#[test]
fn a_resume_replays_the_last_evaluation_and_checks_its_counts() {
    let committed = Committed {
        epoch: 4,
        digest: "digest-4".into(),
    };
    let cfg = EpochConfig {
        replays_eval: true,
        ..cfg(5)
    };
    // The replay counts what the first run counted: the run goes on with epoch 5.
    let mut d = Drive {
        m: EpochMachine::new(cfg.clone(), committed.clone(), vec![prior_log(4, 3)]),
        now: Instant::now(),
        sent: Vec::new(),
        events: Vec::new(),
    };
    d.m.start(d.now);
    d.collect();
    assert_eq!(d.requests()[0], "Eval0");
    assert!(d.sent.iter().all(|o| o.epoch == 4));
    d.answer_all_healthy();
    let done = d.finished().expect("finished");
    assert_eq!(
        done.logs.iter().map(|l| l.epoch).collect::<Vec<_>>(),
        [4, 5]
    );
    // Other counts than the first run's fail the run, naming the epoch.
    let mut d = Drive {
        m: EpochMachine::new(cfg, committed, vec![prior_log(4, 2)]),
        now: Instant::now(),
        sent: Vec::new(),
        events: Vec::new(),
    };
    d.m.start(d.now);
    d.collect();
    d.answer_all_healthy();
    let e = d.failed().expect("the replay's counts differ").to_string();
    assert!(
        e.contains("evaluation of epoch 4") && e.contains("replayed"),
        "{e}"
    );
}
