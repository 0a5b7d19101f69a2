//! `trellis bench comm`: what communication costs, side by side in one command. Node
//! processes run on an emulated rate-limited network (`crate::netns`, default 1 Gbit/s per
//! node link) for each configuration of [`CONFIGS`], and the exact configuration also on
//! loopback as the reference; runs alternate (every configuration per seed before the next
//! seed), so drift during the command weighs on all alike. Numbers come from the run
//! reports (halo bytes from the counters, epoch times from the epoch log, test accuracy as the mean over
//! `--seeds`) and from the links themselves: the bytes each node's link carried (kernel
//! counters: every frame, headers included) and the packets its token buckets dropped. The
//! link's achieved rate is measured on the same network before the runs.
use super::launch::{create_net, launch_cluster_on, stopped, ClusterOptions, CoordinatorRun};
use crate::netns::{EmulatedNet, LinkCounters, LinkRate, NetSpec};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::Path;
use std::time::Duration;
use trellis_runtime::metrics::names;
use trellis_runtime::{report::median, RunReport};

/// One row of the table: a name and the `train` options it adds to the common ones.
#[derive(Debug)]
pub struct Config {
    pub name: &'static str,
    pub args: &'static [&'static str],
}

/// The configurations compared on the emulated network (each is one line; the exact one
/// also runs on loopback as the reference).
pub const CONFIGS: &[Config] = &[
    Config {
        name: "exact",
        args: &[],
    },
    Config {
        name: "fp16",
        args: &["--halo-codec", "fp16"],
    },
    Config {
        name: "int8",
        args: &["--halo-codec", "int8"],
    },
    Config {
        name: "adaptive",
        args: &["--halo-codec", "adaptive"],
    },
    Config {
        name: "grad-int8",
        args: &["--grad-codec", "int8"],
    },
    Config {
        name: "efficient",
        args: &["--comm", "efficient"],
    },
    Config {
        name: "staleness",
        args: &["--staleness", "1"],
    },
    Config {
        name: "skip",
        args: &["--skip-threshold", "2", "--max-staleness", "8"],
    },
    Config {
        name: "eval-skip",
        args: &["--eval-skip-threshold", "0.1", "--max-staleness", "8"],
    },
    // `--comm efficient` spelled out.
    Config {
        name: "combined",
        args: &[
            "--halo-codec",
            "int4",
            "--staleness",
            "1",
            "--skip-threshold",
            "2",
            "--eval-skip-threshold",
            "0.1",
            "--max-staleness",
            "8",
        ],
    },
];

#[derive(Debug, Clone, Args)]
pub struct CommBenchArgs {
    /// The data set (same forms as `train --data`), e.g. `../shared/datasets/cora` or
    /// `synthetic:nodes=1000000,degree=20,features=128,classes=16,seed=0`.
    #[arg(
        long,
        default_value = "synthetic:nodes=100000,degree=20,features=128,classes=16,seed=0"
    )]
    pub data: String,
    /// The architecture: gcn, sage or gat.
    #[arg(long, default_value = "gcn")]
    pub model: String,
    /// Hidden layer width (default: the model's paper setting).
    #[arg(long, value_parser = super::validate::width)]
    pub hidden: Option<usize>,
    /// Node processes (at least 2).
    #[arg(long, default_value_t = 3, value_parser = super::validate::positive_u32)]
    pub nodes: u32,
    /// Partitions (default: one per node, so every halo row crosses the network).
    #[arg(long, value_name = "P", value_parser = super::validate::partitions)]
    pub partitions: Option<usize>,
    /// Epochs per run (the first is not timed when there are more).
    #[arg(long, default_value_t = 5, value_parser = super::validate::positive_u32)]
    pub epochs: u32,
    /// Runs per configuration with seeds 0..N: accuracy is their mean.
    #[arg(long, default_value_t = 1, value_parser = super::validate::positive_u32)]
    pub seeds: u32,
    /// Rate of every node's link, each direction.
    #[arg(long, value_name = "RATE", default_value = "1gbit", value_parser = parse_rate)]
    pub link_rate: LinkRate,
    /// MTU of the emulated links, bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 1500)]
    pub link_mtu: u32,
    /// One-way delay added to what every node sends, ms (needs the kernel's netem qdisc).
    #[arg(long, value_name = "MS")]
    pub link_delay: Option<u32>,
    /// How long the link probe sends, ms.
    #[arg(long, default_value_t = 2000)]
    pub probe_ms: u64,
    /// Nodes that keep a replica of each partition (shipped over the same links).
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// Also run every configuration on the emulated network with `--replicas 0`, beside the
    /// one with replicas: what replication costs the epoch, measured side by side.
    #[arg(long)]
    pub without_replicas: bool,
    /// CPU threads per node process (0: one per CPU).
    #[arg(long, default_value_t = 0, value_parser = super::validate::threads)]
    pub threads: usize,
    /// The configurations to compare, comma separated (`exact` always runs, on loopback
    /// too) [default: every one: exact, fp16, int8, adaptive, grad-int8, efficient,
    /// staleness, skip, eval-skip, combined].
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub configs: Vec<String>,
    /// More `train` options for every run, after `--` (e.g. `-- --dropout 0.3`).
    #[arg(last = true, value_name = "TRAIN_OPTIONS")]
    pub train_options: Vec<String>,
}

/// The configurations `names` selects (all when empty), `exact` first.
fn select(names: &[String]) -> Result<Vec<&'static Config>> {
    if names.is_empty() {
        return Ok(CONFIGS.iter().collect());
    }
    let mut chosen = vec![&CONFIGS[0]];
    for n in names {
        let Some(c) = CONFIGS.iter().find(|c| c.name == n.as_str()) else {
            let known: Vec<&str> = CONFIGS.iter().map(|c| c.name).collect();
            bail!(
                "--configs: unknown configuration `{n}` (expected {})",
                known.join(", ")
            );
        };
        if !chosen.iter().any(|k| std::ptr::eq(*k, c)) {
            chosen.push(c);
        }
    }
    Ok(chosen)
}

fn parse_rate(s: &str) -> Result<LinkRate, String> {
    s.parse().map_err(|e: crate::netns::NetError| e.to_string())
}

/// Where a row ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Network {
    Loopback,
    Emulated,
}

/// A configuration on a network, and what its runs measured.
struct Row {
    config: &'static Config,
    network: Network,
    /// `replicas` of the cluster file for this row's runs.
    replicas: u32,
    runs: Vec<RunNumbers>,
    /// Why a run of this configuration failed (its later seeds are not run); the others go on,
    /// so an hour of measurements is not lost to one configuration (e.g. killed for memory).
    failed: Option<String>,
}

/// The order the rows run in for `seed`: as listed, except that on odd seeds each
/// configuration's run without replicas goes before its run with them (ABBA), so that a
/// drift in the shared machine's speed does not fall on one side of the comparison.
fn run_order(rows: &[Row], seed: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    if seed % 2 == 1 {
        let mut k = 0;
        while k + 1 < rows.len() {
            let (with, without) = (&rows[k], &rows[k + 1]);
            if std::ptr::eq(with.config, without.config)
                && with.network == without.network
                && with.replicas > 0
                && without.replicas == 0
            {
                order.swap(k, k + 1);
                k += 2;
            } else {
                k += 1;
            }
        }
    }
    order
}

/// What one run's report says, per epoch.
struct RunNumbers {
    seed: u32,
    /// Halo bytes moved between partitions per epoch (forward, backward and evaluation: the
    /// report's `halo_bytes` counters over the run, per epoch).
    halo_bytes: f64,
    /// What the emulated links carried (none on loopback).
    link: Option<LinkNumbers>,
    /// Whole epochs (training step and evaluation), ms, the first left out when there are more.
    epoch_ms: Vec<f64>,
    /// Replica bytes put on the wire per epoch, whole states or the bytes that changed (the
    /// report's `replica_wire_bytes` counters)...
    replica_bytes: f64,
    /// ...the state they replicate, per epoch (the epoch log's `replica_bytes`)...
    replica_state_bytes: f64,
    /// ...and the time replication held up each training step (`replica_ms`), ms, the first
    /// epoch left out as for `epoch_ms`.
    replica_ms: Vec<f64>,
    test_acc: f64,
    digest: String,
}

/// What the links carried during one run, per epoch.
struct LinkNumbers {
    /// Bytes all nodes sent.
    bytes: f64,
    /// The busiest node link's bytes: the larger of what one node sent and received.
    busiest: f64,
    /// Packets the token buckets dropped (whole run).
    drops: u64,
}

impl LinkNumbers {
    fn of(counters: &[LinkCounters], epochs: usize) -> Self {
        let per_epoch = |b: u64| b as f64 / epochs.max(1) as f64;
        LinkNumbers {
            bytes: per_epoch(counters.iter().map(|c| c.tx_bytes).sum()),
            busiest: per_epoch(
                counters
                    .iter()
                    .map(|c| c.tx_bytes.max(c.rx_bytes))
                    .max()
                    .unwrap_or(0),
            ),
            drops: counters.iter().map(|c| c.drops).sum(),
        }
    }
}

impl RunNumbers {
    fn of(seed: u32, r: &RunReport, link: Option<&[LinkCounters]>) -> Result<Self> {
        let epochs = r.epochs_log.len();
        if epochs == 0 {
            bail!("the run's report has no epochs");
        }
        let per_epoch = |b: u64| b as f64 / epochs as f64;
        let skip = usize::from(epochs > 1);
        Ok(Self {
            seed,
            // The counters cover the whole epoch; the epoch log's `halo_bytes` only the
            // training step (evaluation moves rows too).
            halo_bytes: per_epoch(r.counter_total(names::HALO_BYTES)),
            link: link.map(|c| LinkNumbers::of(c, epochs)),
            epoch_ms: r
                .epochs_log
                .iter()
                .skip(skip)
                .map(|l| l.ms + l.eval_ms)
                .collect(),
            replica_bytes: per_epoch(r.counter_total(names::REPLICA_WIRE_BYTES)),
            replica_state_bytes: per_epoch(r.epochs_log.iter().map(|l| l.replica_bytes).sum()),
            replica_ms: r
                .epochs_log
                .iter()
                .skip(skip)
                .map(|l| l.replica_ms)
                .collect(),
            test_acc: r.test_acc,
            digest: r.weights_digest.clone(),
        })
    }
}

impl Row {
    fn label(&self, rate: LinkRate) -> String {
        match self.network {
            Network::Loopback => format!("{} (loopback, reference)", self.config.name),
            Network::Emulated if self.replicas == 0 => {
                format!("{} ({rate}, replicas 0)", self.config.name)
            }
            Network::Emulated => format!("{} ({rate})", self.config.name),
        }
    }

    /// Median time replication held up a training step, ms.
    fn replica_ms(&self) -> f64 {
        let all: Vec<f64> = self
            .runs
            .iter()
            .flat_map(|r| r.replica_ms.clone())
            .collect();
        median(&all)
    }

    fn mean(&self, f: impl Fn(&RunNumbers) -> f64) -> f64 {
        self.runs.iter().map(f).sum::<f64>() / self.runs.len() as f64
    }

    /// The mean of `f` over the runs' link numbers; `None` on loopback.
    fn link_mean(&self, f: impl Fn(&LinkNumbers) -> f64) -> Option<f64> {
        let values: Vec<f64> = self
            .runs
            .iter()
            .filter_map(|r| r.link.as_ref())
            .map(f)
            .collect();
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    }

    fn epoch_ms(&self) -> f64 {
        let all: Vec<f64> = self.runs.iter().flat_map(|r| r.epoch_ms.clone()).collect();
        median(&all)
    }

    /// Mean and sample standard deviation of the test accuracy, in percent.
    fn accuracy(&self) -> (f64, f64) {
        let mean = self.mean(|r| r.test_acc);
        let n = self.runs.len() as f64;
        let var = if n > 1.0 {
            self.runs
                .iter()
                .map(|r| (r.test_acc - mean).powi(2))
                .sum::<f64>()
                / (n - 1.0)
        } else {
            0.0
        };
        (100.0 * mean, 100.0 * var.sqrt())
    }
}

/// What a perfect overlap of communication with computation would hide per epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlap {
    /// Time the busiest node link needs for its bytes at the configured rate, ms.
    pub link_ms: f64,
    /// Of those bytes, the ones that fit in the compute time.
    pub hidden_bytes: f64,
}

/// `busiest_bytes` per epoch on a link of `rate`, beside `compute_ms` of computation.
pub fn overlap(busiest_bytes: f64, rate: LinkRate, compute_ms: f64) -> Overlap {
    Overlap {
        link_ms: 1000.0 * busiest_bytes / rate.bytes_per_sec(),
        hidden_bytes: busiest_bytes.min(rate.bytes_per_sec() * compute_ms / 1000.0),
    }
}

pub fn run(a: CommBenchArgs) -> Result<()> {
    if a.nodes < 2 {
        bail!("bench comm needs at least 2 nodes (a network between them)");
    }
    super::launch::install_stop_handler()?;
    let chosen = select(&a.configs)?;
    let net = create_net(NetSpec {
        nodes: a.nodes,
        rate: a.link_rate,
        delay_ms: a.link_delay,
        mtu: a.link_mtu,
    })?;
    eprintln!("bench comm: network {}", net.describe());
    let probe = net.probe(0, 1, Duration::from_millis(a.probe_ms))?;
    let tmp = tempfile::Builder::new()
        .prefix("trellis-bench-comm-")
        .tempdir()?;
    let mut rows = vec![Row {
        config: &CONFIGS[0],
        network: Network::Loopback,
        replicas: a.replicas,
        runs: Vec::new(),
        failed: None,
    }];
    for config in chosen {
        let mut replicas = vec![a.replicas];
        if a.without_replicas && a.replicas > 0 {
            replicas.push(0);
        }
        rows.extend(replicas.into_iter().map(|replicas| Row {
            config,
            network: Network::Emulated,
            replicas,
            runs: Vec::new(),
            failed: None,
        }));
    }
    for seed in 0..a.seeds {
        for i in run_order(&rows, seed) {
            let row = &mut rows[i];
            if stopped() {
                bail!("interrupted");
            }
            if row.failed.is_some() {
                continue;
            }
            let config = row.config;
            let on = (row.network == Network::Emulated).then_some(&net);
            eprintln!("bench comm: {} seed {seed} ...", row.label(a.link_rate));
            let name = format!("run-{i}-{seed}");
            let before = on.map(EmulatedNet::counters).transpose()?;
            let report = match run_one(&a, on, tmp.path(), &name, seed, row.replicas, config.args) {
                Ok(r) => r,
                // Without the reference no ratio means anything.
                Err(e) if i == 0 => {
                    return Err(e.context(format!("{} seed {seed}", row.label(a.link_rate))))
                }
                Err(e) => {
                    eprintln!(
                        "bench comm: {} seed {seed} failed: {e:#}; going on without it",
                        row.label(a.link_rate)
                    );
                    row.failed = Some(format!("seed {seed}: {e:#}"));
                    continue;
                }
            };
            let link = match (on, before) {
                (Some(net), Some(before)) => Some(
                    net.counters()?
                        .iter()
                        .zip(&before)
                        .map(|(after, before)| after.since(before))
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            };
            row.runs
                .push(RunNumbers::of(seed, &report, link.as_deref())?);
        }
    }
    drop(net);
    print_table(&a, &rows, &probe.summary());
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| r.failed.is_some())
        .map(|r| r.label(a.link_rate))
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} configuration(s) failed: {} (see the table)",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// One cluster run of `config_args` with `seed`; its report.
fn run_one(
    a: &CommBenchArgs,
    net: Option<&EmulatedNet>,
    tmp: &Path,
    name: &str,
    seed: u32,
    replicas: u32,
    config_args: &[&str],
) -> Result<RunReport> {
    let dir = tmp.join(name);
    let parts = tmp.join("parts");
    let report = dir.join("report.json");
    let path = |p: &Path| -> Result<String> {
        Ok(p.to_str()
            .context("temporary path is not UTF-8")?
            .to_string())
    };
    let mut args: Vec<String> = vec![
        "--data".into(),
        a.data.clone(),
        "--model".into(),
        a.model.clone(),
        "--partitions".into(),
        a.partitions.unwrap_or(a.nodes as usize).to_string(),
        "--epochs".into(),
        a.epochs.to_string(),
        "--seed".into(),
        seed.to_string(),
        "--threads".into(),
        a.threads.to_string(),
        "--partition-dir".into(),
        path(&parts)?,
        "--report".into(),
        path(&report)?,
    ];
    if let Some(h) = a.hidden {
        args.extend(["--hidden".into(), h.to_string()]);
    }
    args.extend(a.train_options.iter().cloned());
    args.extend(config_args.iter().map(|s| s.to_string()));
    let opts = ClusterOptions {
        nodes: a.nodes,
        heartbeat_ms: 500,
        idle_timeout_ms: 10_000,
        replicas,
        max_restarts: 0,
        step_deadline_ms: 600_000,
    };
    let coordinator = CoordinatorRun {
        train_args: &args,
        quiet: true,
        serving: false,
    };
    launch_cluster_on(&opts, net, &dir, Some(&parts), coordinator)?;
    Ok(RunReport::read(&report)?)
}

/// `37.2 kB`, `1.32 MB`, `200 MB`: three significant digits in decimal units.
fn size(bytes: f64) -> String {
    let (v, unit) = if bytes >= 1e9 {
        (bytes / 1e9, "GB")
    } else if bytes >= 1e6 {
        (bytes / 1e6, "MB")
    } else if bytes >= 1e3 {
        (bytes / 1e3, "kB")
    } else {
        (bytes, "B")
    };
    let decimals = if unit == "B" || v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.decimals$} {unit}")
}

fn print_table(a: &CommBenchArgs, rows: &[Row], probe: &str) {
    let partitions = a.partitions.unwrap_or(a.nodes as usize);
    let extra = if a.train_options.is_empty() {
        String::new()
    } else {
        format!(" ({})", a.train_options.join(" "))
    };
    println!(
        "{}{extra} on {}: {partitions} partitions on {} node processes, {} epochs, seeds 0..{}",
        a.model, a.data, a.nodes, a.epochs, a.seeds
    );
    println!("link: {probe}");
    println!(
        "| configuration | halo/epoch | link/epoch | tbf drops | epoch ms | vs reference | replica sent/epoch (state) | replica ms (% of epoch) | test acc % | weights |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let reference = &rows[0];
    let ref_ms = reference.epoch_ms();
    for row in rows {
        if let Some(why) = &row.failed {
            if row.runs.is_empty() {
                println!(
                    "| {} | failed: {why} | | | | | | | | |",
                    row.label(a.link_rate)
                );
                continue;
            }
        }
        let (acc, sd) = row.accuracy();
        let same = row
            .runs
            .iter()
            .zip(&reference.runs)
            .all(|(r, base)| r.seed == base.seed && r.digest == base.digest);
        let (link, drops) = match row.link_mean(|l| l.bytes) {
            Some(bytes) => (
                size(bytes),
                row.runs
                    .iter()
                    .filter_map(|r| r.link.as_ref().map(|l| l.drops))
                    .sum::<u64>()
                    .to_string(),
            ),
            None => ("-".to_string(), "-".to_string()),
        };
        println!(
            "| {} | {} | {link} | {drops} | {:.1} | {:.2}x | {} ({}) | {:.3} ({:.2}%) | {acc:.2} ± {sd:.2} | {} |",
            row.label(a.link_rate),
            size(row.mean(|r| r.halo_bytes)),
            row.epoch_ms(),
            row.epoch_ms() / ref_ms,
            size(row.mean(|r| r.replica_bytes)),
            size(row.mean(|r| r.replica_state_bytes)),
            row.replica_ms(),
            100.0 * row.replica_ms() / row.epoch_ms().max(f64::MIN_POSITIVE),
            if same { "= reference" } else { "differ" }
        );
    }
    // With and without replicas, side by side.
    for pair in rows.windows(2) {
        let [with, without] = pair else { continue };
        if !std::ptr::eq(with.config, without.config)
            || without.replicas != 0
            || with.replicas == 0
            || with.runs.is_empty()
            || without.runs.is_empty()
        {
            continue;
        }
        let (w, wo) = (with.epoch_ms(), without.epoch_ms());
        // Each seed's pair ran one after the other: their spread is the comparison's noise.
        let per_seed: Vec<String> = with
            .runs
            .iter()
            .zip(&without.runs)
            .map(|(a, b)| {
                let (x, y) = (median(&a.epoch_ms), median(&b.epoch_ms));
                format!("{:+.1}%", 100.0 * (x - y) / y.max(f64::MIN_POSITIVE))
            })
            .collect();
        println!(
            "{}: replication ({} replica(s)) sends {}/epoch (of {} of state) and holds each \
             training step up {:.3} ms ({:.2}% of the epoch); epoch {w:.1} ms with, {wo:.1} ms \
             without ({:+.1}%; per seed, each pair run back to back: {}; run-to-run noise \
             included, the two alternate their order from seed to seed)",
            with.config.name,
            with.replicas,
            size(with.mean(|r| r.replica_bytes)),
            size(with.mean(|r| r.replica_state_bytes)),
            with.replica_ms(),
            100.0 * with.replica_ms() / w.max(f64::MIN_POSITIVE),
            100.0 * (w - wo) / wo.max(f64::MIN_POSITIVE),
            per_seed.join(", ")
        );
    }
    println!(
        "epoch = training step + evaluation (median over runs, the first epoch of each left out); \
         halo = rows and gradients moved between partitions in training and evaluation (run report's counters); link = bytes all \
         nodes' links sent (kernel counters: halo, gradients, replicas, control, all headers); \
         tbf drops = packets the token buckets dropped (all runs); replica = bytes sent to the \
         replica nodes (whole snapshots, or the bytes that changed since one a node \
         acknowledged), the snapshots' size in brackets, and the time their copy-out, encoding and digest held \
         up the training step (slowest partition, median)"
    );
    for row in rows.iter().filter(|r| !r.runs.is_empty()) {
        if let Some(why) = &row.failed {
            let done = row.runs.len();
            println!(
                "{}: FAILED at {why} (its row shows the {done} seed(s) before the failure)",
                row.label(a.link_rate)
            );
        }
    }
    for row in rows
        .iter()
        .filter(|r| r.network == Network::Emulated && !r.runs.is_empty())
    {
        let busiest = row.link_mean(|l| l.busiest).unwrap_or(0.0);
        let o = overlap(busiest, a.link_rate, ref_ms);
        println!(
            "{}: the busiest node link carries {}/epoch = {:.1} ms at {}; beside {:.1} ms of \
             computation (the loopback epoch) a perfect overlap would hide {} of it ({:.0}%), \
             and the epoch would take {:.1} ms",
            row.label(a.link_rate),
            size(busiest),
            o.link_ms,
            a.link_rate,
            ref_ms,
            size(o.hidden_bytes),
            if busiest > 0.0 {
                100.0 * o.hidden_bytes / busiest
            } else {
                100.0
            },
            o.link_ms.max(ref_ms)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_perfect_overlap_hides_what_fits_in_the_compute_time() {
        let gbit: LinkRate = "1gbit".parse().unwrap();
        // 250 MB take 2 s at 125 MB/s; 1 s of compute hides half.
        let o = overlap(250e6, gbit, 1000.0);
        assert!((o.link_ms - 2000.0).abs() < 1e-9);
        assert!((o.hidden_bytes - 125e6).abs() < 1e-3);
        // Less traffic than the compute time carries: all of it is hidden.
        assert_eq!(overlap(1e6, gbit, 1000.0).hidden_bytes, 1e6);
    }

    /// With and without replicas swap places on odd seeds; the rest keeps its order.
    #[test]
    fn runs_with_and_without_replicas_alternate_from_seed_to_seed() {
        let row = |config: &'static Config, network, replicas| Row {
            config,
            network,
            replicas,
            runs: Vec::new(),
            failed: None,
        };
        let (exact, other) = (&CONFIGS[0], &CONFIGS[1]);
        let rows = [
            row(exact, Network::Loopback, 1),
            row(exact, Network::Emulated, 1),
            row(exact, Network::Emulated, 0),
            row(other, Network::Emulated, 1),
            row(other, Network::Emulated, 0),
            row(other, Network::Emulated, 1),
        ];
        assert_eq!(run_order(&rows, 0), [0, 1, 2, 3, 4, 5]);
        assert_eq!(run_order(&rows, 1), [0, 2, 1, 4, 3, 5]);
        assert_eq!(run_order(&rows, 2), [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn sizes_keep_three_significant_digits() {
        assert_eq!(size(37_215.0), "37.2 kB");
        assert_eq!(size(1_320_000.0), "1.32 MB");
        assert_eq!(size(200_004_000.0), "200 MB");
        assert_eq!(size(12.0), "12 B");
        assert_eq!(size(3.2e9), "3.20 GB");
    }

    #[test]
    fn the_reference_is_the_first_configuration_and_exact() {
        assert_eq!(CONFIGS[0].name, "exact");
        let names = |v: Vec<&Config>| v.iter().map(|c| c.name).collect::<Vec<_>>();
        let pick = |l: &[&str]| select(&l.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(names(pick(&[]).unwrap()).len(), CONFIGS.len());
        assert_eq!(
            names(pick(&["efficient", "int8", "efficient"]).unwrap()),
            ["exact", "efficient", "int8"]
        );
        let e = pick(&["zstd"]).unwrap_err().to_string();
        assert!(
            e.contains("unknown configuration `zstd`") && e.contains("adaptive"),
            "{e}"
        );
        assert!(CONFIGS[0].args.is_empty());
    }
}
