//! When partition failures happened, so that a recovery's detection time runs from the
//! failure itself rather than from the start of the interrupted step. The partition actor
//! that catches a panic records the instant, keyed by run and partition; the coordinator
//! takes it when the failure reaches it. For a partition on another node, that node takes
//! its own record when it replies and sends how long ago the panic was; the coordinator
//! records the failure that long before the reply arrived (the network transit is not
//! counted).
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use trellis_transport::RunId;

static FAILURES: Mutex<Option<HashMap<(RunId, u32), Instant>>> = Mutex::new(None);

/// Partition `part` of run `run` failed at `at` (a later record replaces an earlier one).
pub(crate) fn record(run: RunId, part: u32, at: Instant) {
    if let Ok(mut m) = FAILURES.lock() {
        m.get_or_insert_with(HashMap::new).insert((run, part), at);
    }
}

/// Partition `part` of run `run` failed `ago` before now.
pub(crate) fn record_ago(run: RunId, part: u32, ago: Duration) {
    let now = Instant::now();
    record(run, part, now.checked_sub(ago).unwrap_or(now));
}

/// When partition `part` of run `run` last failed, if recorded (and not taken yet).
pub(crate) fn take(run: RunId, part: u32) -> Option<Instant> {
    FAILURES.lock().ok()?.as_mut()?.remove(&(run, part))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_taken_once_for_its_own_run_and_partition() {
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let at = Instant::now();
        record(a, 1, at);
        record_ago(b, 1, Duration::from_millis(40));
        assert_eq!(take(a, 2), None);
        assert_eq!(take(a, 1), Some(at));
        assert_eq!(take(a, 1), None);
        let b_at = take(b, 1).expect("recorded");
        assert!(b_at.elapsed() >= Duration::from_millis(40));
    }
}
