//! The session machines driven by hand: no sockets, no threads, time passed in.
use super::*;

const S: Duration = Duration::from_secs(1);

fn coordinator(workers: &[u32], now: Instant) -> CoordinatorSession {
    CoordinatorSession::new(
        CoordinatorConfig {
            me: 0,
            workers: workers.to_vec(),
            addr: "127.0.0.1:4000".into(),
            join_within: 30 * S,
            setup_within: 120 * S,
        },
        now,
    )
}

fn drain<A>(mut next: impl FnMut() -> Option<A>) -> Vec<A> {
    std::iter::from_fn(&mut next).collect()
}

fn join(addr: &str) -> SessionMsg {
    SessionMsg::Join { addr: addr.into() }
}

#[test]
fn the_coordinator_sets_up_once_every_node_joined_and_trains_once_all_are_ready() {
    let t0 = Instant::now();
    let mut c = coordinator(&[1, 2], t0);
    assert!(drain(|| c.poll_action()).is_empty());
    assert_eq!(c.handle_message(2, join("a2"), t0), Verdict::Accept);
    assert!(drain(|| c.poll_action()).is_empty());
    c.handle_message(1, join("a1"), t0 + S);
    let acts = drain(|| c.poll_action());
    let [CoordAction::SendSetups { peers }] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert_eq!(peers.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(peers[&1], "a1");
    c.handle_message(1, SessionMsg::FetchPart { part: 3 }, t0 + 2 * S);
    c.handle_message(1, SessionMsg::Ready, t0 + 2 * S);
    let acts = drain(|| c.poll_action());
    assert!(
        matches!(acts[..], [CoordAction::ShipPart { to: 1, part: 3 }]),
        "{acts:?}"
    );
    c.handle_message(2, SessionMsg::Ready, t0 + 3 * S);
    assert!(matches!(
        drain(|| c.poll_action())[..],
        [CoordAction::StartTraining]
    ));
    assert_eq!(c.state(), &CoordState::Training);
    assert_eq!(c.poll_timeout(), None);
}

#[test]
fn a_coordinator_alone_trains_at_once() {
    let t0 = Instant::now();
    let mut c = coordinator(&[], t0);
    let acts = drain(|| c.poll_action());
    assert!(matches!(
        acts[..],
        [CoordAction::SendSetups { .. }, CoordAction::StartTraining]
    ));
    c.handle_training_over(Ok(()), t0);
    let acts = drain(|| c.poll_action());
    assert!(
        matches!(&acts[..], [CoordAction::SendFinish { nodes }, CoordAction::Done { missing_byes }] if nodes.is_empty() && missing_byes.is_empty()),
        "{acts:?}"
    );
}

#[test]
fn the_waiting_line_comes_once_then_missing_nodes_abort_the_ones_that_joined() {
    let t0 = Instant::now();
    let mut c = coordinator(&[1, 2], t0);
    c.handle_message(1, join("a1"), t0);
    assert_eq!(c.poll_timeout(), Some(t0 + JOIN_NOTICE_AFTER));
    c.handle_timeout(t0 + JOIN_NOTICE_AFTER);
    let acts = drain(|| c.poll_action());
    let [CoordAction::Say(line)] = &acts[..] else {
        panic!("{acts:?}")
    };
    assert!(
        line.contains("waiting up to 30 s") && line.contains("[2]"),
        "{line}"
    );
    assert_eq!(c.poll_timeout(), Some(t0 + 30 * S));
    c.handle_timeout(t0 + 10 * S);
    assert!(drain(|| c.poll_action()).is_empty(), "early timeout acted");
    c.handle_timeout(t0 + 30 * S);
    let acts = drain(|| c.poll_action());
    match &acts[..] {
        [CoordAction::SendAbort { nodes, reason }, CoordAction::Failed(e)] => {
            assert_eq!(nodes, &[1]);
            assert!(
                reason.contains("node(s) [2] did not join within 30 s"),
                "{reason}"
            );
            assert!(e.to_string().contains("127.0.0.1:4000"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.state(), &CoordState::Over);
}

#[test]
fn a_node_that_leaves_before_the_setup_may_join_again() {
    let t0 = Instant::now();
    let mut c = coordinator(&[1, 2], t0);
    c.handle_message(1, join("old"), t0);
    c.handle_peer_down(1, "connection lost", t0 + S);
    let acts = drain(|| c.poll_action());
    assert!(
        matches!(&acts[..], [CoordAction::Say(l), CoordAction::ResetPeer(1)] if l.contains("join again")),
        "{acts:?}"
    );
    c.handle_message(2, join("a2"), t0 + S);
    assert!(
        drain(|| c.poll_action()).is_empty(),
        "set up without node 1"
    );
    c.handle_message(1, join("new"), t0 + 2 * S);
    match &drain(|| c.poll_action())[..] {
        [CoordAction::SendSetups { peers }] => assert_eq!(peers[&1], "new"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_failed_or_late_setup_aborts_every_node() {
    let t0 = Instant::now();
    let mut c = coordinator(&[1, 2], t0);
    c.handle_message(1, join("a1"), t0);
    c.handle_message(2, join("a2"), t0);
    drain(|| c.poll_action());
    let err = "partition 1: no such file".to_string();
    c.handle_message(2, SessionMsg::SetupFailed { error: err }, t0 + S);
    match &drain(|| c.poll_action())[..] {
        [CoordAction::SendAbort { nodes, .. }, CoordAction::Failed(e)] => {
            assert_eq!(nodes, &[1, 2]);
            assert!(e.to_string().contains("setup failed: partition 1"), "{e}");
        }
        other => panic!("{other:?}"),
    }

    let mut c = coordinator(&[1, 2], t0);
    c.handle_message(1, join("a1"), t0);
    c.handle_message(2, join("a2"), t0);
    c.handle_message(1, SessionMsg::Ready, t0);
    drain(|| c.poll_action());
    assert_eq!(c.poll_timeout(), Some(t0 + 120 * S));
    c.handle_timeout(t0 + 120 * S);
    match &drain(|| c.poll_action())[..] {
        [CoordAction::SendAbort { .. }, CoordAction::Failed(e)] => {
            assert!(
                e.to_string()
                    .contains("node(s) [2] did not finish their setup"),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// Brings a coordinator of workers 1, 2, 3 to training.
fn training(t0: Instant) -> CoordinatorSession {
    let mut c = coordinator(&[1, 2, 3], t0);
    for n in 1..=3 {
        c.handle_message(n, join("a"), t0);
    }
    for n in 1..=3 {
        c.handle_message(n, SessionMsg::Ready, t0);
    }
    drain(|| c.poll_action());
    assert_eq!(c.state(), &CoordState::Training);
    c
}

#[test]
fn regression_a_fenced_node_is_neither_heard_nor_finished_nor_waited_for() {
    let t0 = Instant::now();
    let mut c = training(t0);
    c.handle_fenced(2);
    // The stale node wakes up and talks: nothing it says is accepted, in any phase.
    for msg in [SessionMsg::Replica, join("again"), SessionMsg::Ready] {
        assert_eq!(c.handle_message(2, msg, t0 + S), Verdict::Drop);
    }
    assert_eq!(c.stale_dropped(), 3);
    c.handle_training_over(Ok(()), t0 + 2 * S);
    let acts = drain(|| c.poll_action());
    let ignored = acts
        .iter()
        .filter(|a| matches!(a, CoordAction::Ignored { from: 2, .. }))
        .count();
    assert_eq!(ignored, 3);
    assert!(
        acts.iter()
            .any(|a| matches!(a, CoordAction::SendFinish { nodes } if nodes == &[1, 3])),
        "{acts:?}"
    );
    assert_eq!(
        c.handle_message(2, SessionMsg::Bye, t0 + 3 * S),
        Verdict::Drop
    );
    assert_eq!(
        c.handle_message(1, SessionMsg::Bye, t0 + 3 * S),
        Verdict::Accept
    );
    assert_eq!(
        c.handle_message(1, SessionMsg::Bye, t0 + 3 * S),
        Verdict::Drop
    );
    assert_eq!(
        c.handle_message(3, SessionMsg::Bye, t0 + 3 * S),
        Verdict::Accept
    );
    let acts = drain(|| c.poll_action());
    assert!(
        matches!(&acts[..], [CoordAction::Ignored { .. }, CoordAction::Ignored { .. }, CoordAction::Done { missing_byes }] if missing_byes.is_empty()),
        "{acts:?}"
    );
}

#[test]
fn byes_that_do_not_come_end_the_session_without_them() {
    let t0 = Instant::now();
    let mut c = training(t0);
    c.handle_training_over(Ok(()), t0);
    drain(|| c.poll_action());
    c.handle_message(1, SessionMsg::Bye, t0 + S);
    c.handle_peer_down(3, "closed", t0 + S);
    assert!(drain(|| c.poll_action()).is_empty());
    assert_eq!(c.poll_timeout(), Some(t0 + BYE_WITHIN));
    c.handle_timeout(t0 + BYE_WITHIN);
    match &drain(|| c.poll_action())[..] {
        [CoordAction::Done { missing_byes }] => assert_eq!(missing_byes, &[2]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_failed_run_aborts_every_live_node() {
    let t0 = Instant::now();
    let mut c = training(t0);
    c.handle_fenced(3);
    c.handle_training_over(Err("partition 1 did not answer".into()), t0);
    match &drain(|| c.poll_action())[..] {
        [CoordAction::SendAbort { nodes, reason }] => {
            assert_eq!(nodes, &[1, 2]);
            assert!(reason.contains("partition 1"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.state(), &CoordState::Over);
}

#[test]
fn messages_from_outside_the_cluster_are_dropped() {
    let t0 = Instant::now();
    let mut c = coordinator(&[1], t0);
    assert_eq!(c.handle_message(7, join("x"), t0), Verdict::Drop);
    assert!(matches!(
        drain(|| c.poll_action())[..],
        [CoordAction::Ignored { from: 7, .. }]
    ));
    assert!(matches!(c.state(), CoordState::Joining { .. }));
}

fn worker(now: Instant) -> WorkerSession {
    WorkerSession::new(
        WorkerConfig {
            me: 1,
            coord: 0,
            coord_addr: "127.0.0.1:4000".into(),
            join_within: 30 * S,
        },
        now,
    )
}

fn down(detail: &str) -> LinkDown {
    LinkDown {
        detail: detail.into(),
        still_connected: false,
        refused: None,
        was_up: false,
    }
}

#[test]
fn a_worker_joins_sets_up_serves_and_says_bye() {
    let t0 = Instant::now();
    let mut w = worker(t0);
    assert!(matches!(
        drain(|| w.poll_action())[..],
        [WorkerAction::SendJoin { reset: false }]
    ));
    let setup = SessionMsg::Setup { deadline_ms: 1000 };
    assert_eq!(w.handle_message(0, setup, t0 + S), Verdict::Accept);
    assert!(matches!(
        drain(|| w.poll_action())[..],
        [WorkerAction::StartSetup]
    ));
    w.handle_setup_done(Ok(()), t0 + 2 * S);
    assert!(matches!(
        drain(|| w.poll_action())[..],
        [WorkerAction::SendReady]
    ));
    // Silent for two deadlines (at least 10 s) is a failure; requests keep it alive.
    assert_eq!(w.poll_timeout(), Some(t0 + 12 * S));
    let step = |e| SessionMsg::Request {
        step_epoch: Some(e),
    };
    w.handle_message(0, step(0), t0 + 3 * S);
    w.handle_message(0, step(1), t0 + 3 * S);
    w.handle_message(0, step(1), t0 + 3 * S);
    w.handle_message(0, step(0), t0 + 3 * S);
    w.handle_message(0, SessionMsg::Request { step_epoch: None }, t0 + 3 * S);
    w.handle_message(0, step(2), t0 + 4 * S);
    let acts = drain(|| w.poll_action());
    assert!(
        matches!(
            acts[..],
            [
                WorkerAction::EpochStarted(0),
                WorkerAction::EpochStarted(1),
                WorkerAction::EpochStarted(2)
            ]
        ),
        "each epoch starts once: {acts:?}"
    );
    assert_eq!(w.poll_timeout(), Some(t0 + 14 * S));
    w.handle_message(0, SessionMsg::Finish, t0 + 5 * S);
    assert!(matches!(
        drain(|| w.poll_action())[..],
        [WorkerAction::SendBye]
    ));
    w.handle_link_down(down("closed by the peer"), t0 + 6 * S);
    assert!(matches!(
        drain(|| w.poll_action())[..],
        [WorkerAction::Done]
    ));
}

#[test]
fn a_worker_retries_its_join_with_backoff_until_the_join_timeout() {
    let t0 = Instant::now();
    let mut w = worker(t0);
    drain(|| w.poll_action());
    let (mut now, mut waits, mut says) = (t0, Vec::new(), 0);
    let failure = loop {
        w.handle_link_down(down("connection refused"), now);
        let mut failed = None;
        for a in drain(|| w.poll_action()) {
            match a {
                WorkerAction::Say(l) => {
                    assert!(l.contains("retrying for up to 30 s"), "{l}");
                    says += 1;
                }
                WorkerAction::Failed(e) => failed = Some(e),
                other => panic!("{other:?}"),
            }
        }
        if let Some(e) = failed {
            break e.to_string();
        }
        let at = w.poll_timeout().expect("a retry is due");
        waits.push(at - now);
        now = at;
        w.handle_timeout(now);
        assert!(matches!(
            drain(|| w.poll_action())[..],
            [WorkerAction::SendJoin { reset: true }]
        ));
    };
    assert!(failure.contains("did not answer within 30 s"), "{failure}");
    assert!(
        failure.contains("attempt(s)), last: connection refused"),
        "{failure}"
    );
    assert_eq!(says, 1, "the retry line is printed once");
    let first: Vec<Duration> = (0..5).map(|k| FIRST_BACKOFF * (1 << k)).collect();
    assert_eq!(&waits[..5], &first[..]);
    assert!(waits.iter().all(|&d| d <= MAX_BACKOFF), "{waits:?}");
    assert_eq!(now - t0, 30 * S, "gave up exactly at the join timeout");
}

#[test]
fn a_worker_refused_by_the_coordinator_stops_at_once() {
    let t0 = Instant::now();
    let mut w = worker(t0);
    drain(|| w.poll_action());
    let mut d = down("closed");
    d.refused = Some("refused by the peer: node 1 is already connected".into());
    w.handle_link_down(d, t0);
    match &drain(|| w.poll_action())[..] {
        [WorkerAction::Failed(e)] => assert!(e.to_string().contains("already connected")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_worker_connected_to_a_waiting_coordinator_keeps_waiting() {
    let t0 = Instant::now();
    let mut w = worker(t0);
    drain(|| w.poll_action());
    assert_eq!(w.poll_timeout(), Some(t0 + 30 * S));
    w.handle_coordinator_up(t0 + 30 * S);
    w.handle_timeout(t0 + 30 * S);
    assert!(drain(|| w.poll_action()).is_empty());
    assert_eq!(w.poll_timeout(), Some(t0 + 60 * S));
    w.handle_timeout(t0 + 60 * S);
    assert!(matches!(
        drain(|| w.poll_action())[..],
        [WorkerAction::Failed(_)]
    ));
}

#[test]
fn a_worker_drops_what_is_not_the_coordinators_and_obeys_an_abort() {
    let t0 = Instant::now();
    let mut w = worker(t0);
    drain(|| w.poll_action());
    let fake = SessionMsg::Setup { deadline_ms: 1 };
    assert_eq!(w.handle_message(5, fake, t0), Verdict::Drop);
    assert_eq!(
        w.handle_message(5, SessionMsg::Replica, t0),
        Verdict::Accept
    );
    assert_eq!(w.handle_message(0, SessionMsg::Finish, t0), Verdict::Drop);
    let reason = "node(s) [2] did not join".to_string();
    w.handle_message(0, SessionMsg::Abort { reason }, t0);
    let acts = drain(|| w.poll_action());
    assert!(
        matches!(
            &acts[..],
            [WorkerAction::Ignored { from: 5, .. }, WorkerAction::Ignored { from: 0, .. }, WorkerAction::Failed(e)]
                if e.to_string().contains("aborted the run: node(s) [2]")
        ),
        "{acts:?}"
    );
}

#[test]
fn a_failed_setup_is_reported_to_the_coordinator() {
    let t0 = Instant::now();
    let mut w = worker(t0);
    drain(|| w.poll_action());
    w.handle_message(0, SessionMsg::Setup { deadline_ms: 1 }, t0);
    drain(|| w.poll_action());
    w.handle_setup_done(Err("setup: bad partition book".into()), t0);
    assert!(matches!(
        &drain(|| w.poll_action())[..],
        [WorkerAction::SendSetupFailed { error }, WorkerAction::Failed(_)] if error.contains("book")
    ));
}

#[test]
fn a_silent_coordinator_or_a_lost_link_fails_a_serving_worker() {
    let t0 = Instant::now();
    for lost in [false, true] {
        let mut w = worker(t0);
        w.handle_message(
            0,
            SessionMsg::Setup {
                deadline_ms: 20_000,
            },
            t0,
        );
        w.handle_setup_done(Ok(()), t0);
        drain(|| w.poll_action());
        if lost {
            w.handle_link_down(down("timed out"), t0 + S);
        } else {
            assert_eq!(w.poll_timeout(), Some(t0 + 40 * S));
            w.handle_timeout(t0 + 40 * S);
        }
        match &drain(|| w.poll_action())[..] {
            [WorkerAction::Failed(e)] => {
                let m = e.to_string();
                assert!(m.contains("node 0"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }
}
