//! `trellis sim` as a user runs it: a sweep of seeded fault schedules that reports the faults
//! that fired and the outcomes, the same for the same seeds, and a replay of one seed.
mod binary;
use binary::{assert_ok, trellis};

fn sim(args: &[&str]) -> String {
    assert_ok(&trellis().arg("sim").args(args).output().unwrap())
}

/// The report without its wall-clock time.
fn counts(out: &str) -> String {
    out.lines()
        .map(|l| match l.split_once(" in ") {
            Some((head, tail)) if l.contains("schedules (seeds") => {
                format!("{head}{}", tail.split_once(':').map_or("", |t| t.1))
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_sweep_reports_fired_faults_and_outcomes_and_replays_the_same() {
    let a = sim(&["--schedules", "120", "--seed", "40"]);
    assert!(a.contains("120 schedules (seeds 40..=159)"), "{a}");
    assert!(a.contains("faults fired, by kind:"), "{a}");
    assert!(a.contains("actor-panic"), "{a}");
    assert!(a.contains("finished"), "{a}");
    assert!(a.contains("every invariant held"), "{a}");
    let b = sim(&["--schedules", "120", "--seed", "40", "--threads", "1"]);
    assert_eq!(
        counts(&a),
        counts(&b),
        "same seeds, same counts, whatever the threads"
    );
    let one = sim(&["--schedules", "1", "--seed", "77"]);
    assert!(one.contains("1 schedules (seeds 77..=77)"), "{one}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = trellis()
        .args(["sim", "--schedules", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--schedules"));
}
