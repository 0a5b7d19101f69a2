//! The Trellis registry ([`trellis_runtime::metrics`]) as OTLP metrics: per histogram a gauge
//! `trellis.<name>.duration` (ms) with a `quantile` attribute (0.5, 0.9, 0.99, 1) and per counter
//! a cumulative counter `trellis.<name>`, each with the registry key's labels as attributes.
//! They are observed from a registry snapshot when the meter provider collects.
use opentelemetry::metrics::{Meter, ObservableCounter, ObservableGauge};
use opentelemetry::KeyValue;
use trellis_runtime::metrics::{names, Key, LatencySummary, Metrics};

/// Handles of the registered instruments (kept for the life of the pipeline).
pub(super) struct Instruments {
    _gauges: Vec<ObservableGauge<f64>>,
    _counters: Vec<ObservableCounter<u64>>,
}

fn attributes(key: &Key) -> Vec<KeyValue> {
    key.labels
        .iter()
        .map(|(k, v)| KeyValue::new(*k, *v as i64))
        .collect()
}

/// Registers one instrument per histogram and counter name.
pub(super) fn register(meter: &Meter) -> Instruments {
    let gauges = names::HISTOGRAMS
        .iter()
        .map(|&name| {
            meter
                .f64_observable_gauge(format!("trellis.{name}.duration"))
                .with_unit("ms")
                .with_description(super::prometheus::help(name))
                .with_callback(move |obs| {
                    let snap = Metrics::global().snapshot();
                    for (key, h) in snap.hists.iter().filter(|(k, _)| k.name == name) {
                        let s = LatencySummary::of(h);
                        for (q, v) in [
                            ("0.5", s.p50_ms),
                            ("0.9", s.p90_ms),
                            ("0.99", s.p99_ms),
                            ("1", s.max_ms),
                        ] {
                            let mut attrs = attributes(key);
                            attrs.push(KeyValue::new("quantile", q));
                            obs.observe(v, &attrs);
                        }
                    }
                })
                .build()
        })
        .collect();
    let counters = names::COUNTERS
        .iter()
        .map(|&name| {
            let b = meter
                .u64_observable_counter(format!("trellis.{name}"))
                .with_description(super::prometheus::help(name));
            let b = if name == names::HALO_BYTES {
                b.with_unit("By")
            } else {
                b
            };
            b.with_callback(move |obs| {
                let snap = Metrics::global().snapshot();
                for (key, v) in snap.counters.iter().filter(|(k, _)| k.name == name) {
                    obs.observe(*v, &attributes(key));
                }
            })
            .build()
        })
        .collect();
    Instruments {
        _gauges: gauges,
        _counters: counters,
    }
}
