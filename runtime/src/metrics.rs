//! Process-wide run metrics: HDR latency histograms (training step, halo exchange per peer,
//! all-reduce, recovery) and counters (halo bytes and messages per peer, restarts).
//!
//! Recording is a short lock and an array increment, cheap next to the layer steps it measures,
//! and always on: exporters (Prometheus text, OTLP) read [`Metrics::snapshot`], and a run report
//! summarises the difference between the snapshots at its start and end
//! ([`MetricsSnapshot::since`]). Runs that overlap in one process share the registry.
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Names of the histograms and counters Trellis records.
pub mod names {
    /// Training step (forward, backward, all-reduce, optimizer) of one epoch over all partitions.
    pub const STEP: &str = "step";
    /// How long a partition's step waited for one peer's halo block (0 if it came first).
    pub const HALO_EXCHANGE: &str = "halo_exchange";
    /// Summing weight gradients and applying them on every partition.
    pub const ALL_REDUCE: &str = "all_reduce";
    /// From a failure's report to the replayed step completing.
    pub const RECOVERY: &str = "recovery";
    /// Storing a partition's state in its node's replica store after a step.
    pub const REPLICATE: &str = "replicate";
    /// Halo payload bytes sent, per sender and peer.
    pub const HALO_BYTES: &str = "halo_bytes";
    /// Halo blocks sent, per sender and peer.
    pub const HALO_MESSAGES: &str = "halo_messages";
    /// Partition restarts.
    pub const RESTARTS: &str = "restarts";
    /// Bytes of committed partition state replicated after each step (the state a replica
    /// node holds, once per step whatever the number of replica nodes), per partition.
    pub const REPLICA_BYTES: &str = "replica_bytes";
    /// Bytes of replica messages put on the wire, summed over the replica nodes: the whole
    /// state, or after a node acknowledged one the bytes that changed since, per partition.
    pub const REPLICA_WIRE_BYTES: &str = "replica_wire_bytes";
    /// Of those, the payload bytes of the halo blocks a partition holds for its next epoch
    /// (`--staleness 1`), per partition.
    pub const REPLICA_HALO_BYTES: &str = "replica_halo_bytes";
    /// Of the state replicated, the bytes a replica left out because partitions on other
    /// nodes hold them byte for byte (skip records and held halo rows), per partition.
    pub const REPLICA_MIRRORED_BYTES: &str = "replica_mirrored_bytes";
    /// Of those, the bytes a node adopting the partition fetched from a third node (per
    /// adopted partition).
    pub const REPLICA_FETCHED_BYTES: &str = "replica_fetched_bytes";
    /// From shipping a partition's state to a replica node until that node acknowledged
    /// storing it (QUIC transfer, queueing behind other traffic included), per partition.
    pub const REPLICA_TRANSFER: &str = "replica_transfer";
    /// Connections a node refused (foreign or missing certificate, wrong node id, bad hello).
    pub const REFUSED_CONNECTIONS: &str = "refused_connections";
    /// Every histogram name.
    pub const HISTOGRAMS: [&str; 6] = [
        STEP,
        HALO_EXCHANGE,
        ALL_REDUCE,
        RECOVERY,
        REPLICATE,
        REPLICA_TRANSFER,
    ];
    /// Every counter name.
    pub const COUNTERS: [&str; 9] = [
        HALO_BYTES,
        HALO_MESSAGES,
        RESTARTS,
        REPLICA_BYTES,
        REPLICA_WIRE_BYTES,
        REPLICA_HALO_BYTES,
        REPLICA_MIRRORED_BYTES,
        REPLICA_FETCHED_BYTES,
        REFUSED_CONNECTIONS,
    ];
    /// Every label name.
    pub const LABELS: [&str; 3] = ["partition", "peer", "node"];
}

/// A metric name with its labels (e.g. `halo_exchange{partition=0,peer=1}`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub name: &'static str,
    pub labels: Vec<(&'static str, u32)>,
}

impl Key {
    /// A key without labels.
    pub fn new(name: &'static str) -> Self {
        Key {
            name,
            labels: Vec::new(),
        }
    }

    /// Adds a label.
    pub fn with(mut self, label: &'static str, value: u32) -> Self {
        self.labels.push((label, value));
        self
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)?;
        if !self.labels.is_empty() {
            let labels: Vec<String> = self
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            write!(f, "{{{}}}", labels.join(","))?;
        }
        Ok(())
    }
}

/// Histograms hold microseconds from 1 µs to one hour with 3 significant digits.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// The registry.
#[derive(Default)]
pub struct Metrics {
    hists: Mutex<BTreeMap<Key, Histogram<u64>>>,
    counters: Mutex<BTreeMap<Key, u64>>,
}

impl Metrics {
    /// The process-wide registry.
    pub fn global() -> &'static Metrics {
        static GLOBAL: OnceLock<Metrics> = OnceLock::new();
        GLOBAL.get_or_init(Metrics::default)
    }

    /// Records one latency.
    pub fn record(&self, key: Key, d: Duration) {
        let us = (d.as_micros() as u64).max(1);
        if let Ok(mut h) = self.hists.lock() {
            h.entry(key)
                .or_insert_with(new_histogram)
                .saturating_record(us);
        }
    }

    /// Records one latency given in milliseconds.
    pub fn record_ms(&self, key: Key, ms: f64) {
        self.record(key, Duration::from_secs_f64(ms.max(0.0) / 1e3));
    }

    /// Adds `n` to a counter.
    pub fn add(&self, key: Key, n: u64) {
        if let Ok(mut c) = self.counters.lock() {
            *c.entry(key).or_default() += n;
        }
    }

    /// A copy of every histogram and counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            hists: self.hists.lock().map(|h| h.clone()).unwrap_or_default(),
            counters: self.counters.lock().map(|c| c.clone()).unwrap_or_default(),
        }
    }
}

/// The registry's content at one moment.
#[derive(Debug, Clone, Default)]
pub struct MetricsSnapshot {
    pub hists: BTreeMap<Key, Histogram<u64>>,
    pub counters: BTreeMap<Key, u64>,
}

/// [`MetricsSnapshot`] on the wire.
#[derive(Serialize, Deserialize)]
struct WireMetrics {
    hists: Vec<(WireKey, Vec<(u64, u64)>)>,
    counters: Vec<(WireKey, u64)>,
}

/// A [`Key`] on the wire: its name and labels as strings.
#[derive(Serialize, Deserialize)]
struct WireKey {
    name: String,
    labels: Vec<(String, u32)>,
}

impl WireKey {
    fn of(k: &Key) -> Self {
        WireKey {
            name: k.name.to_string(),
            labels: k.labels.iter().map(|(l, v)| (l.to_string(), *v)).collect(),
        }
    }

    /// The key, with its names mapped back to this process's (`known` names for the metric).
    fn key(&self, known: &[&'static str]) -> Result<Key, String> {
        let stat = |s: &str, list: &[&'static str]| {
            list.iter()
                .copied()
                .find(|n| *n == s)
                .ok_or_else(|| format!("metrics snapshot: unknown name {s:?}"))
        };
        let mut key = Key::new(stat(&self.name, known)?);
        for (l, v) in &self.labels {
            key = key.with(stat(l, &names::LABELS)?, *v);
        }
        Ok(key)
    }
}

/// Quantiles of one histogram, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl LatencySummary {
    /// The summary of a histogram of microseconds.
    pub fn of(h: &Histogram<u64>) -> Self {
        let ms = |us: u64| us as f64 / 1e3;
        LatencySummary {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
            mean_ms: h.mean() / 1e3,
        }
    }
}

impl MetricsSnapshot {
    /// What was recorded after `earlier` (a snapshot of the same registry).
    pub fn since(&self, earlier: &MetricsSnapshot) -> MetricsSnapshot {
        let hists = self
            .hists
            .iter()
            .filter_map(|(k, h)| {
                let mut h = h.clone();
                if let Some(e) = earlier.hists.get(k) {
                    // Counts only grow, so subtracting an earlier copy cannot underflow.
                    h.subtract(e).ok()?;
                }
                (!h.is_empty()).then(|| (k.clone(), h))
            })
            .collect();
        let counters = self
            .counters
            .iter()
            .filter_map(|(k, &v)| {
                let d = v.saturating_sub(earlier.counters.get(k).copied().unwrap_or(0));
                (d > 0).then(|| (k.clone(), d))
            })
            .collect();
        MetricsSnapshot { hists, counters }
    }

    /// Every histogram's summary, keyed by `name{labels}`.
    pub fn summaries(&self) -> BTreeMap<String, LatencySummary> {
        self.hists
            .iter()
            .map(|(k, h)| (k.to_string(), LatencySummary::of(h)))
            .collect()
    }

    /// Every counter, keyed by `name{labels}`.
    pub fn counter_values(&self) -> BTreeMap<String, u64> {
        self.counters
            .iter()
            .map(|(k, &v)| (k.to_string(), v))
            .collect()
    }

    /// Adds `other`'s histograms and counters to these (another process's metrics of the same
    /// run: keys carry global partition ids, so equal keys are the same series).
    pub fn merge(&mut self, other: &MetricsSnapshot) {
        for (k, h) in &other.hists {
            match self.hists.get_mut(k) {
                // Both come from `new_histogram`, so their bounds match and adding succeeds.
                Some(mine) => mine.add(h).unwrap_or_default(),
                None => {
                    self.hists.insert(k.clone(), h.clone());
                }
            }
        }
        for (k, v) in &other.counters {
            *self.counters.entry(k.clone()).or_default() += v;
        }
    }

    /// The snapshot as bytes, to send to another process ([`MetricsSnapshot::from_bytes`]):
    /// every histogram as its (value, count) pairs, which rebuild it exactly.
    pub fn to_bytes(&self) -> Vec<u8> {
        let wire = WireMetrics {
            hists: self
                .hists
                .iter()
                .map(|(k, h)| {
                    let counts = h
                        .iter_recorded()
                        .map(|v| (v.value_iterated_to(), v.count_at_value()))
                        .collect();
                    (WireKey::of(k), counts)
                })
                .collect(),
            counters: self
                .counters
                .iter()
                .map(|(k, &v)| (WireKey::of(k), v))
                .collect(),
        };
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// Reads [`MetricsSnapshot::to_bytes`]; names this process does not know are an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<MetricsSnapshot, String> {
        let wire: WireMetrics =
            serde_json::from_slice(bytes).map_err(|e| format!("metrics snapshot: {e}"))?;
        let mut out = MetricsSnapshot::default();
        for (k, counts) in wire.hists {
            let key = k.key(&names::HISTOGRAMS)?;
            let mut h = new_histogram();
            for (value, n) in counts {
                h.record_n(value, n)
                    .map_err(|e| format!("metrics snapshot: {key}: {e}"))?;
            }
            out.hists.insert(key, h);
        }
        for (k, v) in wire.counters {
            out.counters.insert(k.key(&names::COUNTERS)?, v);
        }
        Ok(out)
    }

    /// One histogram over all label values of `name` (e.g. halo exchange over every peer).
    pub fn merged(&self, name: &str) -> Option<Histogram<u64>> {
        let mut out: Option<Histogram<u64>> = None;
        for (_, h) in self.hists.iter().filter(|(k, _)| k.name == name) {
            match &mut out {
                Some(o) => o.add(h).ok()?,
                None => out = Some(h.clone()),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_travel_as_bytes_and_merge() {
        let (a, b) = (Metrics::default(), Metrics::default());
        let halo = |p| {
            Key::new(names::HALO_BYTES)
                .with("partition", p)
                .with("peer", 0)
        };
        for ms in [1.0, 2.5, 40.0] {
            a.record_ms(Key::new(names::REPLICATE).with("partition", 0), ms);
            b.record_ms(Key::new(names::REPLICATE).with("partition", 1), ms * 2.0);
        }
        b.record_ms(Key::new(names::REPLICATE).with("partition", 0), 7.0);
        a.add(halo(1), 10);
        b.add(halo(1), 5);
        let sent = b.snapshot();
        let got = MetricsSnapshot::from_bytes(&sent.to_bytes()).unwrap();
        assert_eq!(got.summaries(), sent.summaries());
        assert_eq!(got.counter_values(), sent.counter_values());
        let mut all = a.snapshot();
        all.merge(&got);
        let s = all.summaries();
        assert_eq!(s["replicate{partition=0}"].count, 4);
        assert_eq!(s["replicate{partition=1}"].count, 3);
        assert_eq!(all.counter_values()["halo_bytes{partition=1,peer=0}"], 15);
        assert!(MetricsSnapshot::from_bytes(b"{").is_err());
        let unknown = br#"{"hists":[],"counters":[[{"name":"nope","labels":[]},1]]}"#;
        let err = MetricsSnapshot::from_bytes(unknown).unwrap_err();
        assert!(err.contains("\"nope\""), "{err}");
    }

    #[test]
    fn records_summarises_and_diffs() {
        let m = Metrics::default();
        let peer = |p| {
            Key::new(names::HALO_EXCHANGE)
                .with("partition", 0)
                .with("peer", p)
        };
        m.record_ms(Key::new(names::STEP), 10.0);
        let before = m.snapshot();
        for ms in 1..=100 {
            m.record_ms(Key::new(names::STEP), ms as f64);
        }
        m.record(peer(1), Duration::from_millis(3));
        m.record(peer(2), Duration::from_millis(5));
        m.add(Key::new(names::RESTARTS), 2);
        let run = m.snapshot().since(&before);
        let s = run.summaries();
        let step = s["step"];
        assert_eq!(step.count, 100, "the record before the run is not counted");
        assert!((step.p50_ms - 50.0).abs() < 0.1, "{step:?}");
        assert!((step.p99_ms - 99.0).abs() < 0.1, "{step:?}");
        assert!((step.max_ms - 100.0).abs() < 0.1, "{step:?}");
        assert!(s.contains_key("halo_exchange{partition=0,peer=1}"));
        assert_eq!(run.counter_values()["restarts"], 2);
        let all = run.merged(names::HALO_EXCHANGE).unwrap();
        assert_eq!(all.len(), 2);
        assert!(all.max() >= 4_990, "{}", all.max());
    }
}
