//! The serving service's own metrics and their Prometheus text: request latency histograms
//! per route (HDR, rendered as cumulative buckets), answers per route and status, the
//! engine's batch sizes, queue depth, batch target, shed requests and model version.
use hdrhistogram::Histogram;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;
use trellis_actors::serving::engine::EngineStats;

/// Latency bucket bounds, seconds.
const BUCKETS_S: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Per-route request metrics.
#[derive(Default)]
pub struct HttpMetrics {
    latency: Mutex<BTreeMap<&'static str, Histogram<u64>>>,
    answers: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

impl HttpMetrics {
    /// Records one answered request.
    pub fn record(&self, route: &'static str, status: u16, took: Duration) {
        let mut l = self.latency.lock().expect("metrics lock");
        let h = l.entry(route).or_insert_with(|| {
            Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
        });
        let _ = h.record((took.as_micros() as u64).max(1));
        *self
            .answers
            .lock()
            .expect("metrics lock")
            .entry((route, status))
            .or_default() += 1;
    }

    /// The latency quantile `q` of a route, if it has answered anything.
    pub fn quantile_ms(&self, route: &str, q: f64) -> Option<f64> {
        let l = self.latency.lock().expect("metrics lock");
        l.get(route).map(|h| h.value_at_quantile(q) as f64 / 1000.0)
    }

    /// Prometheus text of these metrics and the engine's.
    pub fn render(&self, engine: &EngineStats) -> String {
        let mut out = String::new();
        out.push_str("# HELP trellis_serve_request_seconds Time from a request's arrival to its answer, by route.\n");
        out.push_str("# TYPE trellis_serve_request_seconds histogram\n");
        for (route, h) in self.latency.lock().expect("metrics lock").iter() {
            for b in BUCKETS_S {
                let n = h.count_between(0, (b * 1e6) as u64);
                let _ = writeln!(
                    out,
                    "trellis_serve_request_seconds_bucket{{route=\"{route}\",le=\"{b}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "trellis_serve_request_seconds_bucket{{route=\"{route}\",le=\"+Inf\"}} {}",
                h.len()
            );
            let sum: f64 = h.mean() * h.len() as f64 / 1e6;
            let _ = writeln!(
                out,
                "trellis_serve_request_seconds_sum{{route=\"{route}\"}} {sum}"
            );
            let _ = writeln!(
                out,
                "trellis_serve_request_seconds_count{{route=\"{route}\"}} {}",
                h.len()
            );
        }
        out.push_str("# HELP trellis_serve_requests_total Answers by route and HTTP status.\n");
        out.push_str("# TYPE trellis_serve_requests_total counter\n");
        for ((route, status), n) in self.answers.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "trellis_serve_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str(
            "# HELP trellis_serve_batch_size Queries per engine step (embedding queries; other predictions read the published rows).\n",
        );
        out.push_str("# TYPE trellis_serve_batch_size histogram\n");
        {
            let batches = engine.batches.lock().expect("stats lock");
            let empty;
            let h = match batches.as_ref() {
                Some(h) => h,
                None => {
                    empty = hdrhistogram::Histogram::<u64>::new(3).expect("valid precision");
                    &empty
                }
            };
            for b in [1u64, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096] {
                let _ = writeln!(
                    out,
                    "trellis_serve_batch_size_bucket{{le=\"{b}\"}} {}",
                    h.count_between(0, b)
                );
            }
            let _ = writeln!(
                out,
                "trellis_serve_batch_size_bucket{{le=\"+Inf\"}} {}",
                h.len()
            );
            let _ = writeln!(
                out,
                "trellis_serve_batch_size_sum {}",
                (h.mean() * h.len() as f64).round()
            );
            let _ = writeln!(out, "trellis_serve_batch_size_count {}", h.len());
        }
        out.push_str("# HELP trellis_serve_queue_depth Queries waiting for the engine.\n");
        out.push_str("# TYPE trellis_serve_queue_depth gauge\n");
        let _ = writeln!(
            out,
            "trellis_serve_queue_depth {}",
            engine.queue_depth.load(Ordering::Relaxed)
        );
        out.push_str(
            "# HELP trellis_serve_batch_target Current adaptive batch size target (nodes).\n",
        );
        out.push_str("# TYPE trellis_serve_batch_target gauge\n");
        let _ = writeln!(
            out,
            "trellis_serve_batch_target {}",
            engine.batch_target.load(Ordering::Relaxed)
        );
        out.push_str(
            "# HELP trellis_serve_shed_total Requests refused by the scheduler, by reason.\n",
        );
        out.push_str("# TYPE trellis_serve_shed_total counter\n");
        for reason in ["overloaded", "quota", "deadline"] {
            let n = engine
                .shed
                .lock()
                .expect("stats lock")
                .get(reason)
                .copied()
                .unwrap_or(0);
            let _ = writeln!(out, "trellis_serve_shed_total{{reason=\"{reason}\"}} {n}");
        }
        let recoveries = engine.recoveries.load(Ordering::Relaxed) as u64;
        let nodes = engine.nodes.load(Ordering::Relaxed);
        let scalars = [
            (
                "trellis_serve_recoveries_total",
                "counter",
                "Engine failures recovered.",
                recoveries,
            ),
            (
                "trellis_serve_rebuilds_total",
                "counter",
                "Times every serving partition was started again from the engine's store.",
                engine.rebuilds.load(Ordering::Relaxed) as u64,
            ),
            (
                "trellis_serve_addition_updates_total",
                "counter",
                "Graph updates that added new nodes (node additions that arrive together are one).",
                engine.addition_updates.load(Ordering::Relaxed) as u64,
            ),
            (
                "trellis_serve_added_nodes_total",
                "counter",
                "New nodes those updates added (POST /v1/nodes requests that took effect).",
                engine.added_nodes.load(Ordering::Relaxed) as u64,
            ),
            (
                "trellis_serve_nodes",
                "gauge",
                "Nodes of the served graph.",
                nodes as u64,
            ),
            (
                "trellis_serve_cluster_nodes_lost",
                "gauge",
                "Nodes of the serving cluster lost and not taken back.",
                engine.lost_nodes.lock().expect("stats lock").len() as u64,
            ),
        ];
        for (name, kind, help, value) in scalars {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out.push_str("# HELP trellis_serve_model_info The model version being served.\n");
        out.push_str("# TYPE trellis_serve_model_info gauge\n");
        let _ = writeln!(
            out,
            "trellis_serve_model_info{{version=\"{}\"}} 1",
            engine.version.lock().expect("stats lock")
        );
        out
    }
}
