//! The `trellis` command line as a new user meets it: help that documents every option and
//! its default, one name per concept, values refused with a clear message before any work,
//! report paths checked before training (and the report kept when writing fails anyway), and
//! errors that say each thing once.
mod binary;

use binary::{assert_ok, read_report, trellis};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

const DATA: &str = "synthetic:nodes=400,degree=5,features=8,classes=3,seed=1";

fn run(args: &[&str]) -> Output {
    trellis().args(args).output().expect("run trellis")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every option of `trellis <command> --help` has a description (same line or the next).
fn undocumented_options(help: &str) -> Vec<String> {
    let lines: Vec<&str> = help.lines().collect();
    let mut missing = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if !(t.starts_with("--") || t.starts_with("-h") || t.starts_with("-V")) {
            continue;
        }
        // `--name <VALUE>  description` on one line, or the description indented below.
        let same_line = t.find("  ").is_some_and(|at| !t[at..].trim().is_empty());
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        let below = !next.is_empty() && !next.starts_with('-');
        if !same_line && !below {
            missing.push(t.to_string());
        }
    }
    missing
}

#[test]
fn every_option_of_every_command_has_help() {
    let commands: [&[&str]; 11] = [
        &["train"],
        &["partition"],
        &["accuracy"],
        &["bench"],
        &["bench", "partitions"],
        &["bench", "recovery"],
        &["bench", "comm"],
        &["report"],
        &["node"],
        &["launch"],
        &["demo"],
    ];
    for cmd in commands {
        let mut args = cmd.to_vec();
        args.push("--help");
        let help = assert_ok(&run(&args));
        let missing = undocumented_options(&help);
        assert!(
            missing.is_empty(),
            "{cmd:?}: options without help: {missing:?}"
        );
    }
}

#[test]
fn train_help_shows_each_default_and_how_it_depends_on_the_model() {
    let help = assert_ok(&run(&["train", "--help"]));
    let section = |opt: &str| -> String {
        let start = help
            .find(&format!("      {opt} "))
            .unwrap_or_else(|| panic!("{opt} missing from help"));
        let rest = &help[start + opt.len() + 6..];
        let end = rest.find("\n      --").unwrap_or(rest.len());
        rest[..end].to_string()
    };
    for (opt, needles) in [
        ("--epochs", &["default: 200"][..]),
        ("--lr", &["0.01", "gat 0.005"][..]),
        ("--hidden", &["16", "gat 8"][..]),
        ("--dropout", &["0.5", "gat 0.6"][..]),
        ("--weight-decay", &["5e-4"][..]),
        ("--heads", &["default: 8"][..]),
        ("--partitions", &["train 1", "2 per node"][..]),
    ] {
        let text = section(opt);
        for n in needles {
            assert!(text.contains(n), "{opt} help lacks {n:?}: {text}");
        }
    }
    let chaos = section("--chaos");
    for kind in ["panic:", "kill-node:", "cut-link:", "delay:", "corrupt:"] {
        assert!(chaos.contains(kind), "--chaos help lacks {kind}: {chaos}");
    }
    // `launch` forwards the training options and says what its partition count really is.
    let launch = assert_ok(&run(&["launch", "--help"]));
    assert!(launch.contains("2 per node"), "{launch}");
}

#[test]
fn one_name_per_concept_across_commands() {
    for cmd in [
        &["partition"][..],
        &["bench", "partitions"][..],
        &["train"][..],
    ] {
        let mut args = cmd.to_vec();
        args.push("--help");
        let help = assert_ok(&run(&args));
        assert!(help.contains("--partitions <P>"), "{cmd:?}: {help}");
        assert!(help.contains("--partition-method"), "{cmd:?}: {help}");
        assert!(
            !help.contains("--parts "),
            "{cmd:?} still says --parts: {help}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("parts");
    let text = assert_ok(&run(&[
        "partition",
        "--data",
        DATA,
        "--partitions",
        "2",
        "--partition-method",
        "random",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(text.contains("2 parts of"), "{text}");
    assert!(out.join("partition.json").is_file());
}

#[test]
fn absurd_values_are_refused_before_any_work() {
    let cases: [(&[&str], &str); 14] = [
        (&["--epochs", "0"], "'--epochs <N>': must be at least 1"),
        (
            &["--partitions", "0"],
            "'--partitions <P>': must be between 1",
        ),
        (
            &["--hidden", "0"],
            "'--hidden <WIDTH[,WIDTH...]>': `0`: must be between 1",
        ),
        (
            &["--layers", "0"],
            "'--layers <N>': must be between 1 and 128",
        ),
        (&["--grad-codec", "int4"], "unknown gradient codec `int4`"),
        (
            &["--hidden", "100000000"],
            "'--hidden <WIDTH[,WIDTH...]>': `100000000`: must be between 1",
        ),
        (
            &["--hidden", "4294967295"],
            "'--hidden <WIDTH[,WIDTH...]>': `4294967295`: must be between 1",
        ),
        (
            &["--model", "gat", "--heads", "1000000"],
            "'--heads <N>': must be between 1",
        ),
        (
            &["--lr", "nan"],
            "'--lr <RATE>': must be a finite number above 0",
        ),
        (
            &["--lr=-0.1"],
            "'--lr <RATE>': must be a finite number above 0",
        ),
        (
            &["--dropout", "1.5"],
            "'--dropout <P>': must be at least 0 and below 1",
        ),
        (&["--weight-decay", "inf"], "'--weight-decay <DECAY>'"),
        (&["--threads", "100000"], "'--threads <N>': must be at most"),
        (
            &["--checkpoint-dir", "ck", "--checkpoint-every", "0"],
            "'--checkpoint-every <N>': must be at least 1",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["train", "--data", DATA];
        args.extend(extra);
        let t = Instant::now();
        let out = run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{extra:?} was accepted: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{extra:?} did work first"
        );
    }
    // Within the per-option limits but far beyond this machine's memory for the data set:
    // refused with the estimate, after loading the (small) data, before allocating.
    let big = "synthetic:nodes=3000000,degree=1,features=4,classes=2,seed=0";
    let out = run(&["train", "--data", big, "--hidden", "65536", "--epochs", "1"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the model needs at least") && err.contains("use a smaller --hidden"),
        "{err}"
    );
}

#[test]
fn a_report_path_that_cannot_be_written_fails_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-folder").join("run.json");
    for report in [missing.as_path(), dir.path()] {
        let t = Instant::now();
        let out = run(&[
            "train",
            "--data",
            DATA,
            "--epochs",
            "500",
            "--report",
            report.to_str().unwrap(),
        ]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("--report"), "{err}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("weights_digest"),
            "it trained first"
        );
        assert!(t.elapsed() < Duration::from_secs(10));
    }
    let err = stderr(&run(&[
        "train",
        "--data",
        DATA,
        "--report",
        missing.to_str().unwrap(),
    ]));
    assert!(
        err.contains("no-such-folder") && err.contains("does not exist"),
        "{err}"
    );
}

#[test]
fn a_report_that_cannot_be_written_after_training_is_printed_instead() {
    // /dev/full accepts opening and refuses every write (ENOSPC).
    let full = Path::new("/dev/full");
    if !full.exists() || tempfile::NamedTempFile::new_in("/dev").is_err() {
        eprintln!("SKIPPED: needs /dev/full and a writable /dev (root)");
        return;
    }
    let out = run(&[
        "train",
        "--data",
        DATA,
        "--epochs",
        "3",
        "--report",
        "/dev/full",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let json_start = err.find("here it is:\n").expect("the report on stderr") + 12;
    let json_end = err.rfind("\n}").expect("the end of the report") + 2;
    let report: serde_json::Value =
        serde_json::from_str(&err[json_start..json_end]).expect("the report is JSON");
    assert_eq!(report["epochs"], 3);
    assert!(report["weights_digest"]
        .as_str()
        .is_some_and(|d| d.len() == 64));
    assert!(err.contains("error: --report /dev/full"), "{err}");
}

#[test]
fn a_checkpoint_error_in_one_process_says_what_failed_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a folder").unwrap();
    let ck = file.join("ck");
    let out = run(&[
        "train",
        "--data",
        DATA,
        "--epochs",
        "2",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let line = err.lines().find(|l| l.starts_with("error: ")).expect(&err);
    assert!(line.starts_with("error: checkpoint "), "{line}");
    assert!(!line.contains("cluster"), "{line}");
    let os = "Not a directory (os error 20)";
    assert_eq!(line.matches(os).count(), 1, "the OS text once: {line}");
    // The same for a missing data folder.
    let line = stderr(&run(&[
        "train",
        "--data",
        dir.path().join("none").to_str().unwrap(),
    ]));
    assert_eq!(
        line.matches("no such file or directory").count(),
        1,
        "{line}"
    );
}

#[test]
fn accuracy_without_data_finds_cora_or_says_what_to_pass() {
    let elsewhere = tempfile::tempdir().unwrap();
    let cora = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/datasets/cora");
    let out = trellis()
        .args([
            "accuracy",
            "--seeds",
            "1",
            "--models",
            "gcn",
            "--threads",
            "1",
        ])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    if cora.is_dir() {
        let text = assert_ok(&out);
        assert!(text.contains("| gcn | 1 |"), "{text}");
    } else {
        eprintln!("SKIPPED the Cora half: no export at {}", cora.display());
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("pass --data"), "{err}");
    }
}

#[test]
fn an_injected_panic_is_one_line_even_with_backtraces_on() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("run.json");
    let out = trellis()
        .env("RUST_BACKTRACE", "1")
        .args([
            "train",
            "--data",
            DATA,
            "--epochs",
            "4",
            "--partitions",
            "2",
            "--chaos",
            "panic:part=1:epoch=2",
            "--report",
            report.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = assert_ok(&out);
    let err = stderr(&out);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("injected fault"))
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with("chaos: injected fault: partition 1"),
        "{err}"
    );
    assert!(!err.contains("stack backtrace"), "{err}");
    assert!(!err.contains("panicked at"), "{err}");
    assert_eq!(text.matches("recovered: ").count(), 1, "{text}");
    assert_eq!(
        read_report(&report)["recoveries"].as_array().unwrap().len(),
        1
    );
}

#[test]
fn a_recovery_is_timed_from_the_panic_not_from_the_start_of_the_step() {
    // The panic fires in the last stage of the step (backward, layer 0): timed from the start
    // of the step, detection would include the whole forward pass.
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("run.json");
    let data = "synthetic:nodes=50000,degree=10,features=64,classes=8,seed=3";
    assert_ok(&run(&[
        "train",
        "--data",
        data,
        "--epochs",
        "5",
        "--partitions",
        "2",
        "--hidden",
        "64",
        "--chaos",
        "panic:part=1:epoch=3:layer=0:phase=backward",
        "--report",
        report.to_str().unwrap(),
    ]));
    let r = read_report(&report);
    let rec = &r["recoveries"][0];
    let detected = rec["detected_ms"].as_f64().expect("detected_ms");
    let step = r["step_ms_median"].as_f64().expect("step_ms_median");
    assert!(
        detected >= 0.0 && detected < 0.25 * step,
        "detected {detected} ms after the panic, a step takes {step} ms: {rec}"
    );
}

/// `RUST_LOG` chooses what the log on stderr shows; one that is not a log filter is refused
/// before any work, by a command that trains and by one that does not, naming it; a clean
/// run logs nothing at the default level (warnings and errors).
#[test]
fn a_bad_rust_log_is_refused_naming_it_and_a_clean_run_logs_nothing() {
    for args in [
        &["train", "--data", DATA, "--epochs", "1"][..],
        &[
            "partition",
            "--data",
            DATA,
            "--partitions",
            "2",
            "--out",
            "/nonexistent/p",
        ][..],
    ] {
        let out = trellis()
            .args(args)
            .env("RUST_LOG", "trellis=loud")
            .output()
            .unwrap();
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(
            err.contains("RUST_LOG `trellis=loud` is not a log filter"),
            "{args:?}: {err}"
        );
    }
    let out = trellis()
        .args([
            "train",
            "--data",
            DATA,
            "--epochs",
            "2",
            "--partitions",
            "2",
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains(" WARN ") && !err.contains(" ERROR "), "{err}");
}
