//! The request scheduler of a serving engine, sans I/O: requests and completions come in with
//! the time, decisions come out.
//!
//! - **Dynamic batching** (as Clipper does): queued queries run together as one engine step.
//!   The batch's size target adapts to the latency objective by AIMD: a batch whose oldest
//!   request finished within the SLO raises it by one step, one that missed lowers it by a
//!   quarter. A batch starts when the engine is idle and either the queue holds a full batch
//!   or the oldest request has waited the batching window (a quarter of the SLO less the time
//!   the batch is expected to take, never negative).
//! - **Load shedding**: a request that would wait longer than its deadline allows (queue
//!   cost over the measured throughput), or that finds the queue full, is refused at once
//!   (`503` with `Retry-After`) instead of queueing without bound; a queued request whose
//!   deadline passes is refused when found.
//! - **Fair shares and quotas**: each tenant (API key) has its own queue; batches take from
//!   the queues in turn, by cost (deficit round robin), so a tenant sending ten times the
//!   traffic gets the same share as the others while they are active, and its excess waits
//!   or is shed in its own queue. A per-tenant quota (requests/s, token bucket) refuses the
//!   excess with `429`.
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Settings of a scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Latency objective of one query.
    pub slo: Duration,
    /// Upper bound of a batch's cost (nodes).
    pub max_batch: usize,
    /// Upper bound of all queued cost (nodes); beyond it requests are shed.
    pub max_queue: usize,
    /// Requests per second each tenant may send (`None`: unlimited); bursts of up to one
    /// second's worth pass.
    pub quota_rps: Option<f64>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            slo: Duration::from_millis(5),
            max_batch: 4096,
            max_queue: 65_536,
            quota_rps: None,
        }
    }
}

/// One query waiting for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    pub id: u64,
    pub tenant: String,
    /// Work it needs (nodes it asks about, at least 1).
    pub cost: usize,
    pub arrived: Instant,
    pub deadline: Instant,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The service is over capacity (HTTP 503).
    Overloaded,
    /// The tenant is over its quota (HTTP 429).
    Quota,
    /// Its deadline passed while it waited (HTTP 503).
    Expired,
}

/// What the engine should do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Run these queued requests together as one step.
    Run(Vec<u64>),
    /// Answer this request with a refusal; retry after the given time.
    Refuse {
        id: u64,
        why: Refusal,
        retry_after: Duration,
    },
}

/// Token bucket of one tenant's quota.
#[derive(Debug, Clone)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Per-tenant quotas: a token bucket of `rps` requests per second per tenant, bursts of up
/// to one second's worth (sans-I/O: the time comes in).
#[derive(Debug, Clone, Default)]
pub struct Quotas {
    rps: Option<f64>,
    buckets: BTreeMap<String, Bucket>,
}

impl Quotas {
    /// `rps` requests per second per tenant (`None`: unlimited).
    pub fn new(rps: Option<f64>) -> Self {
        Quotas {
            rps,
            buckets: BTreeMap::new(),
        }
    }

    /// Takes a token of `tenant`'s bucket, or says how long until one is there.
    pub fn admit(&mut self, tenant: &str, now: Instant) -> Result<(), Duration> {
        let Some(rps) = self.rps else {
            return Ok(());
        };
        let burst = rps.max(1.0);
        let b = match self.buckets.get_mut(tenant) {
            Some(b) => b,
            None => self.buckets.entry(tenant.to_string()).or_insert(Bucket {
                tokens: burst,
                at: now,
            }),
        };
        let dt = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * rps).min(burst);
        b.at = now;
        if b.tokens < 1.0 {
            let wait = (1.0 - b.tokens) / rps;
            return Err(Duration::from_secs_f64(wait.max(1.0).ceil()));
        }
        b.tokens -= 1.0;
        Ok(())
    }
}

#[derive(Debug, Default)]
struct TenantQueue {
    queue: VecDeque<Pending>,
    /// Deficit round robin credit (cost units).
    credit: usize,
}

/// The scheduler's state.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    tenants: BTreeMap<String, TenantQueue>,
    quotas: Quotas,
    /// Round-robin position: the tenant after which the next batch starts.
    cursor: Option<String>,
    queued_cost: usize,
    /// Current batch size target (cost).
    target: usize,
    /// Estimated step time: fixed part and per cost unit (EWMA), seconds.
    fixed_s: f64,
    per_cost_s: f64,
    busy: bool,
}

impl Scheduler {
    /// Its settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn new(cfg: SchedulerConfig) -> Self {
        let target = (cfg.max_batch / 8).max(1);
        let quotas = Quotas::new(cfg.quota_rps);
        Scheduler {
            cfg,
            quotas,
            tenants: BTreeMap::new(),
            cursor: None,
            queued_cost: 0,
            target,
            fixed_s: 50e-6,
            per_cost_s: 2e-6,
            busy: false,
        }
    }

    /// Cost queued now.
    pub fn queued_cost(&self) -> usize {
        self.queued_cost
    }
    /// Requests queued now.
    pub fn queued(&self) -> usize {
        self.tenants.values().map(|t| t.queue.len()).sum()
    }
    /// The current batch size target.
    pub fn batch_target(&self) -> usize {
        self.target
    }
    /// Whether a batch is running.
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    fn expected(&self, cost: usize) -> Duration {
        Duration::from_secs_f64(self.fixed_s + self.per_cost_s * cost as f64)
    }

    fn retry_after(&self) -> Duration {
        // Time to drain what is queued, at least a second (HTTP's unit).
        let drain = self.per_cost_s * self.queued_cost as f64 + self.fixed_s;
        Duration::from_secs_f64(drain.max(1.0).ceil())
    }

    /// A request arrives: queued, or refused at once.
    pub fn arrive(&mut self, req: Pending, now: Instant) -> Vec<Action> {
        let cost = req.cost.max(1);
        if let Err(retry_after) = self.quotas.admit(&req.tenant, now) {
            return vec![Action::Refuse {
                id: req.id,
                why: Refusal::Quota,
                retry_after,
            }];
        }
        let wait = self.expected(self.queued_cost + cost);
        let budget = req.deadline.saturating_duration_since(now);
        if self.queued_cost + cost > self.cfg.max_queue || (self.queued_cost > 0 && wait > budget) {
            return vec![Action::Refuse {
                id: req.id,
                why: Refusal::Overloaded,
                retry_after: self.retry_after(),
            }];
        }
        self.queued_cost += cost;
        let t = self.tenants.entry(req.tenant.clone()).or_default();
        t.queue.push_back(Pending { cost, ..req });
        self.poll(now)
    }

    /// When the engine should be woken next (the oldest request's batching window), if
    /// anything waits.
    pub fn next_wake(&self) -> Option<Instant> {
        let oldest = self
            .tenants
            .values()
            .filter_map(|t| t.queue.front())
            .map(|p| p.arrived)
            .min()?;
        Some(oldest + self.window())
    }

    fn window(&self) -> Duration {
        (self.cfg.slo / 4).saturating_sub(self.expected(self.target))
    }

    /// Decides what to do now: refuse expired requests, start a batch if it is time.
    pub fn poll(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        for t in self.tenants.values_mut() {
            t.queue.retain(|p| {
                if p.deadline <= now {
                    out.push(Action::Refuse {
                        id: p.id,
                        why: Refusal::Expired,
                        retry_after: Duration::from_secs(1),
                    });
                    self.queued_cost -= p.cost;
                    false
                } else {
                    true
                }
            });
        }
        if self.busy || self.queued_cost == 0 {
            return out;
        }
        let due = self.next_wake().is_some_and(|w| w <= now);
        if self.queued_cost >= self.target || due {
            out.push(Action::Run(self.take_batch()));
            self.busy = true;
        }
        out
    }

    /// Takes up to a batch target of cost from the tenants' queues in turn.
    fn take_batch(&mut self) -> Vec<u64> {
        let limit = self.target.min(self.cfg.max_batch).max(1);
        let mut ids = Vec::new();
        let mut cost = 0;
        let names: Vec<String> = self.tenants.keys().cloned().collect();
        let start = match &self.cursor {
            Some(c) => names.iter().position(|n| n > c).unwrap_or(0),
            None => 0,
        };
        let order: Vec<&String> = names[start..].iter().chain(&names[..start]).collect();
        // Deficit round robin: each turn adds a quantum of half a fair share.
        let quantum = (limit / (2 * order.len().max(1))).max(1);
        let mut progressed = true;
        while cost < limit && progressed {
            progressed = false;
            for name in &order {
                let t = self.tenants.get_mut(*name).expect("listed");
                if t.queue.is_empty() {
                    t.credit = 0;
                    continue;
                }
                t.credit += quantum;
                while let Some(p) = t.queue.front() {
                    if p.cost > t.credit || (cost > 0 && cost + p.cost > limit) {
                        break;
                    }
                    let p = t.queue.pop_front().expect("front exists");
                    t.credit -= p.cost;
                    cost += p.cost;
                    ids.push(p.id);
                    progressed = true;
                    self.cursor = Some((*name).clone());
                }
                if cost >= limit {
                    break;
                }
            }
            if !progressed && cost == 0 && self.tenants.values().any(|t| !t.queue.is_empty()) {
                // Every head costs more than the credit so far: keep adding credit.
                progressed = true;
            }
        }
        self.queued_cost -= cost;
        self.tenants.retain(|_, t| !t.queue.is_empty());
        ids
    }

    /// The running batch finished: `cost` units in `took`; `oldest_latency` is the time its
    /// oldest request spent from arrival to answer. Adapts the estimates and the target.
    pub fn finished(&mut self, cost: usize, took: Duration, oldest_latency: Duration) {
        self.busy = false;
        let per = took.as_secs_f64() / cost.max(1) as f64;
        const A: f64 = 0.2;
        self.per_cost_s = (1.0 - A) * self.per_cost_s + A * per;
        if oldest_latency <= self.cfg.slo {
            self.target = (self.target + (self.cfg.max_batch / 32).max(1)).min(self.cfg.max_batch);
        } else {
            self.target = (self.target * 3 / 4).max(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u64, tenant: &str, cost: usize, now: Instant) -> Pending {
        Pending {
            id,
            tenant: tenant.into(),
            cost,
            arrived: now,
            deadline: now + Duration::from_millis(100),
        }
    }

    fn runs(actions: &[Action]) -> Vec<Vec<u64>> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Run(ids) => Some(ids.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn requests_arriving_together_run_as_one_batch() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig {
            slo: Duration::from_millis(8),
            max_batch: 64,
            ..Default::default()
        });
        for i in 0..5 {
            assert!(runs(&s.arrive(req(i, "a", 1, t0), t0)).is_empty());
        }
        // Nothing runs before the window; everything runs as one batch after it.
        assert!(runs(&s.poll(t0)).is_empty());
        let wake = s.next_wake().unwrap();
        assert!(wake > t0 && wake <= t0 + Duration::from_millis(2));
        assert_eq!(runs(&s.poll(wake)), vec![vec![0, 1, 2, 3, 4]]);
        // While busy nothing else starts.
        s.arrive(req(9, "a", 1, wake), wake);
        assert!(runs(&s.poll(wake + Duration::from_millis(5))).is_empty());
        s.finished(5, Duration::from_micros(100), Duration::from_millis(2));
        assert_eq!(
            runs(&s.poll(wake + Duration::from_millis(5))),
            vec![vec![9]]
        );
    }

    #[test]
    fn batch_target_adapts_to_the_slo() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch: 320,
            ..Default::default()
        });
        let t = s.batch_target();
        s.finished(10, Duration::from_micros(10), Duration::from_millis(1));
        assert_eq!(s.batch_target(), t + 10);
        s.finished(10, Duration::from_micros(10), Duration::from_millis(50));
        assert_eq!(s.batch_target(), (t + 10) * 3 / 4);
    }

    #[test]
    fn a_full_queue_sheds_with_retry_after() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch: 4,
            max_queue: 10,
            ..Default::default()
        });
        s.arrive(req(0, "a", 4, t0), t0); // runs at once (a full batch)
        for i in 1..=2 {
            s.arrive(req(i, "a", 4, t0), t0);
        }
        let out = s.arrive(req(3, "a", 4, t0), t0);
        assert!(matches!(
            out[..],
            [Action::Refuse { id: 3, why: Refusal::Overloaded, retry_after }] if retry_after >= Duration::from_secs(1)
        ));
        assert_eq!(s.queued_cost(), 8);
    }

    #[test]
    fn expired_requests_are_refused_not_run() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig::default());
        s.arrive(req(0, "a", 5000, t0), t0); // a full batch: runs
        s.arrive(req(1, "a", 1, t0), t0);
        let late = t0 + Duration::from_millis(200);
        let out = s.poll(late);
        assert!(out.contains(&Action::Refuse {
            id: 1,
            why: Refusal::Expired,
            retry_after: Duration::from_secs(1)
        }));
        assert_eq!(s.queued(), 0);
    }

    #[test]
    fn tenants_get_fair_shares_of_a_batch() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch: 256,
            ..Default::default()
        });
        s.busy = true; // hold batches while the queues fill
        let mut id = 0;
        for _ in 0..100 {
            s.arrive(req(id, "heavy", 8, t0), t0);
            id += 1;
        }
        for _ in 0..10 {
            s.arrive(req(id, "light", 8, t0), t0);
            id += 1;
        }
        s.busy = false;
        s.target = 64;
        let batch = &runs(&s.poll(t0 + Duration::from_millis(5)))[0];
        let light = batch.iter().filter(|&&i| i >= 100).count();
        let heavy = batch.len() - light;
        assert_eq!(batch.len(), 8);
        assert_eq!(light, heavy, "{batch:?}");
    }

    #[test]
    fn quotas_refuse_the_excess_with_429() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(SchedulerConfig {
            quota_rps: Some(2.0),
            ..Default::default()
        });
        let mut refused = 0;
        for i in 0..5 {
            let out = s.arrive(req(i, "a", 1, t0), t0);
            refused += out
                .iter()
                .filter(|a| {
                    matches!(
                        a,
                        Action::Refuse {
                            why: Refusal::Quota,
                            ..
                        }
                    )
                })
                .count();
        }
        assert_eq!(refused, 3);
        // Another tenant is not affected; a second later the first may send again.
        assert!(s
            .arrive(req(10, "b", 1, t0), t0)
            .iter()
            .all(|a| !matches!(a, Action::Refuse { .. })));
        let later = t0 + Duration::from_secs(1);
        assert!(s
            .arrive(req(11, "a", 1, later), later)
            .iter()
            .all(|a| !matches!(a, Action::Refuse { id: 11, .. })));
    }
}
