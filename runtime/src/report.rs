//! Run reports: the JSON record of a training run (schema documented in docs/observability.md).
use crate::metrics::LatencySummary;
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// One epoch of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochLog {
    pub epoch: u32,
    /// Mean training loss of the step.
    pub loss: f64,
    pub train_acc: f64,
    pub val_acc: f64,
    pub test_acc: f64,
    /// Wall time of the training step (forward, backward, all-reduce, optimizer), ms.
    pub ms: f64,
    /// Wall time of the evaluation forward pass, ms.
    pub eval_ms: f64,
    /// Time spent computing (max over partitions), ms.
    pub compute_ms: f64,
    /// Time spent waiting for halo exchange and all-reduce (max over partitions), ms.
    pub comm_ms: f64,
    /// Bytes of halo embeddings and gradients moved between partitions in this epoch, as sent
    /// (encoded when a halo codec is on).
    pub halo_bytes: u64,
    /// Bytes of weight gradients the partitions sent to the all-reduce in this epoch, as
    /// sent (compressed with `grad_codec`)...
    #[serde(default)]
    pub grad_bytes: u64,
    /// ...and as they would have been exact (f32). Both 0 for one process.
    #[serde(default)]
    pub grad_bytes_exact: u64,
    /// What the same halo rows would have taken as exact fp32 (`halo_bytes` without a codec).
    #[serde(default)]
    pub halo_fp32_bytes: u64,
    /// Bytes of halo rows the evaluation of this epoch moved between partitions, as sent
    /// (fewer rows with `--eval-skip-threshold`)...
    #[serde(default)]
    pub eval_halo_bytes: u64,
    /// ...and as exact fp32 rows, every row.
    #[serde(default)]
    pub eval_halo_fp32_bytes: u64,
    /// Hex BLAKE3 digest of the parameters after this epoch's step (every partition's replica
    /// had it: the coordinator checks).
    #[serde(default)]
    pub weights_digest: String,
    /// Per partition (by id), its compute time in the training step, ms; the rest of `ms` is
    /// its communication and waiting.
    #[serde(default)]
    pub part_compute_ms: Vec<f64>,
    /// Bytes of the partitions' snapshots replicated after this epoch's step: the state a
    /// replica node holds (0 without replication or in one process; what crossed the wire,
    /// whole or as the bytes that changed, is the `replica_wire_bytes` counter)...
    #[serde(default)]
    pub replica_bytes: u64,
    /// ...and the time replicating them held up the step: the slowest partition's copy-out,
    /// encoding, digest and queueing before its optimizer step answered, ms (the transfer
    /// itself overlaps the next epoch).
    #[serde(default)]
    pub replica_ms: f64,
}

/// The record of a whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub model: String,
    pub dataset: String,
    pub data_digest: String,
    pub seed: u64,
    pub epochs: u32,
    pub partitions: usize,
    /// Undirected edges cut by the partitioning (0 for one partition).
    pub edge_cut: u64,
    pub threads: usize,
    /// Test accuracy at the epoch of best validation accuracy.
    pub test_acc: f64,
    pub best_val_acc: f64,
    pub best_epoch: u32,
    /// Median wall time of a training step (`EpochLog::ms`: forward, backward, all-reduce,
    /// optimizer; evaluation not included), ms. Reports written before it was named so
    /// call it `epoch_ms_median`.
    #[serde(alias = "epoch_ms_median")]
    pub step_ms_median: f64,
    pub peak_rss_bytes: u64,
    /// Hex BLAKE3 digest of the final parameters' bytes.
    pub weights_digest: String,
    /// The configuration that reproduces the run.
    pub config: serde_json::Value,
    /// `trellis` version that produced the report.
    pub code_version: String,
    /// Git commit of the code (`-dirty` when the tree had changes), when built from a checkout.
    #[serde(default)]
    pub code_commit: Option<String>,
    /// The run's OpenTelemetry trace id (hex), when it was traced.
    #[serde(default)]
    pub trace_id: Option<String>,
    /// Latency summaries (ms) by `name{labels}`: step, halo exchange per peer, all-reduce,
    /// recovery.
    #[serde(default)]
    pub latency: BTreeMap<String, LatencySummary>,
    /// Counters by `name{labels}`: halo bytes and messages per peer, restarts.
    #[serde(default)]
    pub counters: BTreeMap<String, u64>,
    /// Recoveries performed during the run (empty without faults).
    #[serde(default)]
    pub recoveries: serde_json::Value,
    /// The nodes of a multi-process run and what each moved over QUIC (empty in one process).
    #[serde(default)]
    pub nodes: Vec<NodeTraffic>,
    pub epochs_log: Vec<EpochLog>,
}

/// One node of a cluster run: where it ran, what it hosted, and its QUIC traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeTraffic {
    pub node: u32,
    pub addr: String,
    pub partitions: Vec<u32>,
    /// Halo payload bytes this node sent to other nodes (control messages — requests,
    /// gradients, replicas — are not counted here; replicas are `replica_bytes`).
    pub bytes_sent: u64,
    /// Halo payload bytes this node received from other nodes.
    pub bytes_received: u64,
}

impl RunReport {
    /// The sum of counter `name` over all its labels (`name{...}` keys; 0 when absent).
    pub fn counter_total(&self, name: &str) -> u64 {
        let prefix = format!("{name}{{");
        self.counters
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v)
            .sum()
    }

    /// Writes the report as pretty JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self)
            .map_err(|e| RuntimeError::bad_file(path, e.to_string()))?;
        std::fs::write(path, json).map_err(|e| RuntimeError::io(path, e))
    }

    /// Reads a report.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| RuntimeError::io(path, e))?;
        serde_json::from_str(&text)
            .map_err(|e| RuntimeError::bad_file(path, format!("not a run report: {e}")))
    }
}

/// Median of a list of values (0 when empty).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Peak resident set size of this process in bytes (VmHWM), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// Tracks the best validation epoch: test accuracy is reported at the epoch of best validation
/// accuracy (first such epoch on ties).
#[derive(Debug, Clone, Default)]
pub struct BestTracker {
    pub best_val_acc: f64,
    pub best_epoch: u32,
    pub test_at_best: f64,
    seen: bool,
}

impl BestTracker {
    /// Records an epoch.
    pub fn update(&mut self, log: &EpochLog) {
        if !self.seen || log.val_acc > self.best_val_acc {
            self.seen = true;
            self.best_val_acc = log.val_acc;
            self.best_epoch = log.epoch;
            self.test_at_best = log.test_acc;
        }
    }
}
