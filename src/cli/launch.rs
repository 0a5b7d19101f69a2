//! `trellis launch --nodes K ...`: a local cluster in one command. Creates a fresh cluster CA
//! and node certificates, writes a cluster file on loopback with ephemeral ports, starts K
//! `trellis node` processes (the coordinator first, the others once it listens), and waits
//! for them. Every child dies with the launcher (PR_SET_PDEATHSIG) and is killed and reaped
//! when any node fails or on Ctrl-C / SIGTERM / SIGHUP. With `--link-rate` the nodes run in
//! an emulated rate-limited network instead of loopback (`crate::netns`), removed on exit.
//! With `--serve ADDR` (passed to the coordinator) the coordinator serves the model while the
//! cluster trains it and after, until the launcher is stopped.
use super::train::TrainArgs;
use crate::netns::{remove_leftovers, EmulatedNet, LinkRate, NetSpec};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};
use trellis_transport::certs::ClusterCa;

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Keep the cluster's files (certificates, cluster file, partitions) in this folder
    /// instead of a temporary one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    #[command(flatten)]
    pub cluster: ClusterOptions,
    #[command(flatten)]
    pub link: LinkOptions,
    /// Training options, passed to the coordinator node.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The cluster file's settings that `launch` exposes.
#[derive(Debug, Clone, Args)]
pub struct ClusterOptions {
    /// Number of node processes (node 0 coordinates).
    #[arg(long, default_value_t = 3, value_parser = super::validate::positive_u32)]
    pub nodes: u32,
    /// QUIC keep-alive (heartbeat) interval, ms.
    #[arg(long, default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// A peer silent this long is dead, ms.
    #[arg(long, default_value_t = 3000)]
    pub idle_timeout_ms: u64,
    /// Other nodes that keep a replica of each partition (0: replication off; a lost node
    /// then fails the run).
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// Recoveries (partition restarts, node losses) a run may perform before it fails.
    #[arg(long, default_value_t = 8)]
    pub max_restarts: u32,
    /// Longest wait for one partition's step before it is replayed (lost message), ms.
    #[arg(long, default_value_t = 120_000)]
    pub step_deadline_ms: u64,
}

/// The emulated network (`--link-rate`): each node in its own network namespace.
#[derive(Debug, Clone, Args)]
pub struct LinkOptions {
    /// Run every node in its own network namespace, its link limited to RATE in each
    /// direction by a token bucket (tc tbf): e.g. 100mbit, 1gbit, 10gbit. Needs root
    /// (CAP_NET_ADMIN and CAP_SYS_ADMIN).
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub link_rate: Option<LinkRate>,
    /// One-way delay added to what every node sends, ms (needs the kernel's netem qdisc).
    #[arg(long, value_name = "MS", requires = "link_rate")]
    pub link_delay: Option<u32>,
    /// MTU of the emulated links, bytes.
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 1500,
        requires = "link_rate"
    )]
    pub link_mtu: u32,
    /// Measure the rate node 0 -> node 1 achieves (TCP, 2 s) before training, and print it.
    #[arg(long, requires = "link_rate")]
    pub probe_link: bool,
}

impl LinkOptions {
    /// The network to build for `nodes` nodes, if `--link-rate` was given.
    pub fn spec(&self, nodes: u32) -> Option<NetSpec> {
        self.link_rate.map(|rate| NetSpec {
            nodes,
            rate,
            delay_ms: self.link_delay,
            mtu: self.link_mtu,
        })
    }
}

fn parse_rate(s: &str) -> Result<LinkRate, String> {
    s.parse().map_err(|e: crate::netns::NetError| e.to_string())
}

/// Options of `launch` itself, which are not passed on to the coordinator.
const OWN_OPTIONS: [&str; 10] = [
    "--step-deadline-ms",
    "--nodes",
    "--dir",
    "--heartbeat-ms",
    "--idle-timeout-ms",
    "--replicas",
    "--max-restarts",
    "--link-rate",
    "--link-delay",
    "--link-mtu",
];

/// Flags (no value) of `launch` itself.
const OWN_FLAGS: [&str; 1] = ["--probe-link"];

pub fn run(a: LaunchArgs) -> Result<()> {
    if a.train.serve.is_some() && a.link.spec(a.cluster.nodes).is_some() {
        bail!(
            "--serve with --link-rate: the coordinator runs in a network namespace of its own, \
             where the service would not be reachable from this machine; serve without \
             --link-rate"
        );
    }
    if let Some(path) = &a.train.report {
        super::train::check_report_path(path)?;
    }
    install_stop_handler()?;
    let net = match a.link.spec(a.cluster.nodes) {
        Some(spec) => Some(create_net(spec)?),
        None => None,
    };
    if let Some(net) = &net {
        println!("network: {}", net.describe());
        if a.link.probe_link && net.nodes() >= 2 {
            println!(
                "link: {}",
                net.probe(0, 1, Duration::from_secs(2))?.summary()
            );
        }
    }
    let (dir, _tmp) = match &a.dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("trellis-launch-")
                .tempdir()?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let parts = a.train.partition_dir.as_deref();
    let coordinator = CoordinatorRun {
        train_args: &forwarded_args(),
        quiet: false,
        serving: a.train.serve.is_some(),
    };
    launch_cluster_on(&a.cluster, net.as_ref(), &dir, parts, coordinator)
}

/// Removes what killed launchers left behind, then builds the network of `spec`.
pub fn create_net(spec: NetSpec) -> Result<EmulatedNet> {
    crate::netns::check_privileges()?;
    for name in remove_leftovers()? {
        eprintln!("removed network namespace {name}, left behind by a launcher that is gone");
    }
    Ok(EmulatedNet::create(spec)?)
}

/// Set by Ctrl-C, SIGTERM or SIGHUP: every launched cluster stops (its nodes are killed and
/// reaped, then its network removed).
static STOP: LazyLock<Arc<AtomicBool>> = LazyLock::new(|| Arc::new(AtomicBool::new(false)));

/// Makes SIGINT, SIGTERM and SIGHUP set [`STOP`] instead of killing the launcher, so that it
/// can clean up (once per process).
pub fn install_stop_handler() -> Result<()> {
    static INSTALLED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
            for sig in [SIGINT, SIGTERM, SIGHUP] {
                signal_hook::flag::register(sig, Arc::clone(&STOP))
                    .map_err(|e| format!("cannot handle signal {sig}: {e}"))?;
            }
            Ok(())
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Whether a stop signal arrived.
pub fn stopped() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Starts `opts.nodes` node processes on loopback with fresh certificates in `dir`, passes
/// `train_args` to the coordinator, and waits for the run to end. Partition files are read
/// from `parts` (default `dir/parts`) by every node. The coordinator's stdout is shown unless
/// `quiet`; the other nodes' stdout (their traffic, also in the coordinator's summary) never.
pub fn launch_cluster(
    opts: &ClusterOptions,
    dir: &Path,
    parts: Option<&Path>,
    train_args: &[String],
    quiet: bool,
) -> Result<()> {
    let coordinator = CoordinatorRun {
        train_args,
        quiet,
        serving: false,
    };
    launch_cluster_on(opts, None, dir, parts, coordinator)
}

/// What the coordinator node of a launched cluster runs.
pub struct CoordinatorRun<'a> {
    /// The training options it is given.
    pub train_args: &'a [String],
    /// Its stdout is not shown.
    pub quiet: bool,
    /// It serves beside the training (`--serve`) and then until it is stopped: a stop is
    /// then its end, passed on as Ctrl-C.
    pub serving: bool,
}

/// [`launch_cluster`] on the emulated network `net` when given (node `i` in its namespace,
/// at its address), else on loopback.
pub fn launch_cluster_on(
    opts: &ClusterOptions,
    net: Option<&EmulatedNet>,
    dir: &Path,
    parts: Option<&Path>,
    coordinator: CoordinatorRun<'_>,
) -> Result<()> {
    let CoordinatorRun {
        train_args,
        quiet,
        serving,
    } = coordinator;
    if opts.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    if let Some(net) = net {
        if net.nodes() != opts.nodes {
            bail!(
                "the emulated network has {} nodes, the cluster {}",
                net.nodes(),
                opts.nodes
            );
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs)?;
    // The cluster's keys live here: readable by this user only.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&certs, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot restrict {}", certs.display()))?;
    }
    let ca = ClusterCa::generate()?;
    std::fs::write(certs.join(trellis_transport::certs::CA_CERT), ca.cert_pem())?;
    for n in 0..opts.nodes {
        for f in [format!("node-{n}.pem"), format!("node-{n}.key")] {
            let _ = std::fs::remove_file(certs.join(f));
        }
        ca.issue(&certs, n)?;
    }
    let cluster = dir.join("cluster.toml");
    let parts = match parts {
        Some(p) => std::path::absolute(p)?,
        None => dir.join("parts"),
    };
    let host = |n: u32| match net {
        Some(net) => net.addr(n).to_string(),
        None => "127.0.0.1".to_string(),
    };
    let link_mtu = net.map(|net| net.spec().mtu);
    std::fs::write(&cluster, cluster_file(opts, &parts, &host, None, link_mtu))?;
    let exe = std::env::current_exe()?;
    install_stop_handler()?;
    let stop: &AtomicBool = &STOP;

    let mut nodes = Nodes::default();
    let addr_file = dir.join("node-0.addr");
    let _ = std::fs::remove_file(&addr_file);
    let mut coord = node_command(&exe, &cluster, 0, quiet, net);
    coord.arg("--addr-file").arg(&addr_file).args(train_args);
    nodes.spawn(0, coord)?;
    // The coordinator loads and partitions the data before it listens.
    let coord_addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a;
        }
        nodes.check_running(stop)?;
        std::thread::sleep(Duration::from_millis(50));
    };
    std::fs::write(
        &cluster,
        cluster_file(opts, &parts, &host, Some(coord_addr.trim()), link_mtu),
    )?;
    // The other nodes' stdout is only their traffic, which the coordinator's summary lists:
    // each node's traffic is printed once. Their errors (stderr) are shown.
    for n in 1..opts.nodes {
        nodes.spawn(n, node_command(&exe, &cluster, n, true, net))?;
    }
    nodes.wait_all(stop, serving)
}

fn node_command(
    exe: &Path,
    cluster: &Path,
    id: u32,
    quiet: bool,
    net: Option<&EmulatedNet>,
) -> Command {
    let mut c = Command::new(exe);
    if let Some(net) = net {
        net.enter(id, &mut c);
    }
    if quiet {
        c.stdout(std::process::Stdio::null());
    }
    c.arg("node")
        .arg("--cluster")
        .arg(cluster)
        .arg("--id")
        .arg(id.to_string());
    die_with_parent(&mut c);
    c
}

/// The cluster file of `a.nodes` nodes, node `n` at address `host(n)`; node 0 at
/// `coord_addr` once known, the others on ephemeral ports (they tell the coordinator theirs);
/// on an emulated network, its links' MTU.
fn cluster_file(
    a: &ClusterOptions,
    parts: &Path,
    host: &dyn Fn(u32) -> String,
    coord_addr: Option<&str>,
    link_mtu: Option<u32>,
) -> String {
    let mut s = format!(
        "certs = \"certs\"\npartitions = {:?}\ncoordinator = 0\nheartbeat_ms = {}\nidle_timeout_ms = {}\nreplicas = {}\nmax_restarts = {}\nstep_deadline_ms = {}\n",
        parts.display().to_string(),
        a.heartbeat_ms,
        a.idle_timeout_ms,
        a.replicas,
        a.max_restarts,
        a.step_deadline_ms
    );
    if let Some(mtu) = link_mtu {
        s += &format!("link_mtu = {mtu}\n");
    }
    for n in 0..a.nodes {
        let addr = match coord_addr {
            Some(addr) if n == 0 => addr.to_string(),
            _ => format!("{}:0", host(n)),
        };
        s += &format!("\n[[node]]\nid = {n}\naddr = \"{addr}\"\n");
    }
    s
}

/// This command line's training options, without `launch`'s own.
fn forwarded_args() -> Vec<String> {
    let args = std::env::args()
        .skip(1)
        .skip_while(|a| a != "launch")
        .skip(1);
    super::without_options(args, &OWN_FLAGS, &OWN_OPTIONS)
}

#[cfg(target_os = "linux")]
fn die_with_parent(c: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls prctl, which
    // is async-signal-safe; it touches no memory of the parent.
    unsafe {
        c.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_c: &mut Command) {}

/// The node processes; killed and reaped on drop.
#[derive(Default)]
struct Nodes {
    children: Vec<(u32, Child)>,
    reported: std::collections::BTreeSet<u32>,
}

impl Nodes {
    fn spawn(&mut self, id: u32, mut c: Command) -> Result<()> {
        let child = c
            .spawn()
            .with_context(|| format!("cannot start node {id}"))?;
        self.children.push((id, child));
        Ok(())
    }

    /// Fails if the coordinator exited with an error, or on Ctrl-C. Another node's death is
    /// reported once: the coordinator detects it and recovers or fails the run, in bounded time.
    fn check_running(&mut self, stop: &AtomicBool) -> Result<()> {
        if stop.load(Ordering::SeqCst) {
            bail!("interrupted");
        }
        for (id, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                if status.success() {
                    continue;
                }
                if *id == 0 {
                    bail!("the coordinator (node 0) failed ({})", describe(status));
                }
                if self.reported.insert(*id) {
                    eprintln!("node {id} exited ({})", describe(status));
                }
            }
        }
        Ok(())
    }

    /// Waits for every node: done when the coordinator and then all others exit cleanly.
    /// `serving`: a stop signal is passed to the coordinator as Ctrl-C (it stops the run if
    /// one is in progress, and its service), and the launch ends as the nodes do.
    fn wait_all(&mut self, stop: &AtomicBool, serving: bool) -> Result<()> {
        let mut coordinator_done: Option<Instant> = None;
        loop {
            if serving && stop.load(Ordering::SeqCst) {
                return self.stop_serving();
            }
            self.check_running(stop)?;
            let mut running = 0;
            for (id, child) in &mut self.children {
                match child.try_wait()? {
                    Some(_) if *id == 0 => {
                        coordinator_done.get_or_insert_with(Instant::now);
                    }
                    Some(_) => {}
                    None => running += 1,
                }
            }
            if running == 0 {
                return Ok(());
            }
            if coordinator_done.is_some_and(|t| t.elapsed() > Duration::from_secs(15)) {
                bail!("{running} node(s) did not exit within 15 s of the coordinator");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends Ctrl-C to the coordinator and waits (bounded) for every node to exit: fine when
    /// the coordinator exits cleanly.
    fn stop_serving(&mut self) -> Result<()> {
        let end = Instant::now() + Duration::from_secs(30);
        for (id, child) in &mut self.children {
            if *id == 0 {
                // SAFETY: a signal to a child this launcher started and has not reaped
                // (`try_wait` reaps; a reaped child is not signalled).
                if let Ok(None) = child.try_wait() {
                    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
                }
            }
        }
        let mut coordinator = None;
        while Instant::now() < end {
            let mut running = 0;
            for (id, child) in &mut self.children {
                match child.try_wait()? {
                    Some(status) if *id == 0 => coordinator = Some(status),
                    Some(_) => {}
                    None => running += 1,
                }
            }
            if running == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        match coordinator {
            Some(status) if status.success() => Ok(()),
            Some(status) => bail!("the coordinator (node 0) failed ({})", describe(status)),
            None => bail!("the coordinator (node 0) did not stop within 30 s of the stop signal"),
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn describe(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => s.to_string(),
    }
}
