//! [`EmulatedNet`]: the namespaces, bridge, veth pairs and qdiscs of one emulated network, and
//! their removal.
//!
//! Layout (names for the first network of launcher pid 4242, node 1):
//! - namespace `trellis-4242-0-br` holds bridge `br0` and the bridge end `n1` of each pair;
//! - namespace `trellis-4242-0-n1` holds `lo` (up) and `eth0` with address `10.77.0.2/24`;
//! - `tbf` at RATE is the root qdisc of `eth0` (what node 1 sends) and of `n1` (what it
//!   receives), so every node's link is limited in both directions, like a switch port;
//! - with a delay, `netem` sits under the node side's `tbf` (one-way delay on what it sends).
//!
//! Everything lives inside namespaces this module creates, so the host's interfaces, routes
//! and firewall are never changed, and deleting the namespaces deletes every link with them.
use super::command::run;
use super::{check_privileges, LinkRate, NetError, Subnet};
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, RawFd};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Most nodes one network holds (a /24 less the network and broadcast addresses and one
/// spare).
pub const MAX_NODES: u32 = 253;

/// Where `ip netns add` mounts namespaces.
const NETNS_DIR: &str = "/run/netns";

/// Every namespace this module creates starts with this.
const NAME_PREFIX: &str = "trellis-";

/// Networks created by this process so far (the second part of their names).
static CREATED: AtomicU32 = AtomicU32::new(0);

/// What to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetSpec {
    /// Nodes (namespaces), at most [`MAX_NODES`].
    pub nodes: u32,
    /// Rate of every node's link, each direction.
    pub rate: LinkRate,
    /// One-way delay added to what every node sends, ms (needs netem).
    pub delay_ms: Option<u32>,
    /// MTU of every link, bytes.
    pub mtu: u32,
}

impl NetSpec {
    fn check(&self) -> Result<(), NetError> {
        if self.nodes == 0 || self.nodes > MAX_NODES {
            return Err(NetError::TooManyNodes {
                nodes: self.nodes,
                max: MAX_NODES,
            });
        }
        if !(576..=65_535).contains(&self.mtu) {
            return Err(NetError::BadValue {
                option: "--link-mtu",
                value: self.mtu.to_string(),
                reason: "an MTU must be between 576 and 65535 bytes".into(),
            });
        }
        if let Some(d) = self.delay_ms {
            if !(1..=10_000).contains(&d) {
                return Err(NetError::BadValue {
                    option: "--link-delay",
                    value: d.to_string(),
                    reason: "the delay must be between 1 and 10000 ms".into(),
                });
            }
        }
        Ok(())
    }
}

/// A node's namespace, held open so processes and threads can enter it.
#[derive(Debug)]
struct NodeNs {
    name: String,
    handle: File,
}

/// One emulated network; dropping it removes every namespace (and so every link and qdisc)
/// it created, also when creation failed half-way. Processes inside must have exited first
/// (a namespace lives on while a process is in it).
#[derive(Debug)]
pub struct EmulatedNet {
    spec: NetSpec,
    prefix: String,
    subnet: Subnet,
    bridge: String,
    nodes: Vec<NodeNs>,
    /// Namespaces created, in order (removed in reverse).
    created: Vec<String>,
}

impl EmulatedNet {
    /// Checks privileges and the spec, then builds the network. On failure whatever was
    /// built is removed again.
    pub fn create(spec: NetSpec) -> Result<Self, NetError> {
        spec.check()?;
        check_privileges()?;
        let subnet = Subnet::choose()?;
        let k = CREATED.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("{NAME_PREFIX}{}-{k}", std::process::id());
        let mut net = EmulatedNet {
            spec,
            bridge: format!("{prefix}-br"),
            prefix,
            subnet,
            nodes: Vec::new(),
            created: Vec::new(),
        };
        net.build()?;
        Ok(net)
    }

    fn build(&mut self) -> Result<(), NetError> {
        let br = self.bridge.clone();
        self.add_namespace(&br)?;
        if self.spec.delay_ms.is_some() {
            check_netem(&br)?;
        }
        let mtu = self.spec.mtu.to_string();
        ip(&br, &["link", "add", "br0", "type", "bridge"])?;
        ip(&br, &["link", "set", "br0", "up"])?;
        ip(&br, &["link", "set", "lo", "up"])?;
        let tbf = self.spec.rate.tbf(self.spec.mtu).tc_args();
        for i in 0..self.spec.nodes {
            let ns = format!("{}-n{i}", self.prefix);
            self.add_namespace(&ns)?;
            let port = format!("n{i}");
            ip(
                &br,
                &[
                    "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
                ],
            )?;
            ip(&br, &["link", "set", &port, "mtu", &mtu, "master", "br0"])?;
            ip(&ns, &["link", "set", "eth0", "mtu", &mtu])?;
            let addr = format!("{}/24", self.subnet.node_addr(i));
            ip(&ns, &["addr", "add", &addr, "dev", "eth0"])?;
            ip(&ns, &["link", "set", "lo", "up"])?;
            ip(&ns, &["link", "set", "eth0", "up"])?;
            ip(&br, &["link", "set", &port, "up"])?;
            // What the node sends (its eth0) and what it receives (the bridge's port).
            let mut node_side = vec!["qdisc", "add", "dev", "eth0", "root", "handle", "1:"];
            node_side.extend(tbf.iter().map(String::as_str));
            tc(&ns, &node_side)?;
            let mut bridge_side = vec!["qdisc", "add", "dev", &port, "root", "handle", "1:"];
            bridge_side.extend(tbf.iter().map(String::as_str));
            tc(&br, &bridge_side)?;
            if let Some(delay) = self.spec.delay_ms {
                // Room for everything in flight during the delay at the link's rate.
                let packets = (self.spec.rate.bytes_per_sec() * f64::from(delay)
                    / 1000.0
                    / f64::from(self.spec.mtu)) as u64
                    + 1000;
                tc(
                    &ns,
                    &[
                        "qdisc",
                        "add",
                        "dev",
                        "eth0",
                        "parent",
                        "1:1",
                        "handle",
                        "10:",
                        "netem",
                        "delay",
                        &format!("{delay}ms"),
                        "limit",
                        &packets.to_string(),
                    ],
                )?;
            }
            let path = format!("{NETNS_DIR}/{ns}");
            let handle = File::open(&path).map_err(|source| NetError::Namespace {
                name: ns.clone(),
                source,
            })?;
            self.nodes.push(NodeNs { name: ns, handle });
        }
        Ok(())
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), NetError> {
        run("ip", &["netns", "add", name])?;
        self.created.push(name.to_string());
        Ok(())
    }

    pub fn spec(&self) -> &NetSpec {
        &self.spec
    }

    pub fn nodes(&self) -> u32 {
        self.spec.nodes
    }

    /// `trellis-<pid>-<k>`: every namespace of this network starts with it.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn subnet(&self) -> Subnet {
        self.subnet
    }

    /// Node `i`'s address.
    pub fn addr(&self, i: u32) -> Ipv4Addr {
        self.subnet.node_addr(i)
    }

    /// The bridge's namespace name.
    pub fn bridge_namespace(&self) -> &str {
        &self.bridge
    }

    /// Node `i`'s namespace name.
    pub fn namespace(&self, i: u32) -> &str {
        &self.nodes[i as usize].name
    }

    /// Makes `cmd` run in node `i`'s namespace: the child joins it (`setns`) after the fork,
    /// before exec. Chosen over `ip netns exec NAME ...`: the spawned process is the node
    /// itself (its pid is the one the launcher kills and reaps, and its parent-death signal
    /// applies to it), it needs no extra mount namespace, and the namespace is opened here
    /// once, so a missing one fails before anything is spawned.
    pub fn enter(&self, i: u32, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        let fd = self.fd(i);
        // SAFETY: the closure runs in the forked child before exec and only calls setns, a
        // plain system call (async-signal-safe) on a descriptor the parent keeps open until
        // the spawn returns; it touches no memory of the parent.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// Moves the calling thread into node `i`'s namespace (sockets it opens afterwards live
    /// there). Only for threads made for that purpose: the change is per thread and permanent.
    pub fn join_current_thread(&self, i: u32) -> Result<(), NetError> {
        // SAFETY: setns on a valid open descriptor; it changes only this thread's network
        // namespace and touches no memory.
        if unsafe { libc::setns(self.fd(i), libc::CLONE_NEWNET) } != 0 {
            return Err(NetError::Namespace {
                name: self.namespace(i).to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Cuts node `i` off the network, as a pulled cable would: its port on the bridge goes
    /// down, so nothing it sends arrives and nothing reaches it, until
    /// [`EmulatedNet::mend`]. (Disabling the port's forwarding state instead has no effect
    /// on a bridge without STP, and tc's drop actions need modules not every kernel has.)
    pub fn cut(&self, i: u32) -> Result<(), NetError> {
        ip(&self.bridge, &["link", "set", &format!("n{i}"), "down"]).map(|_| ())
    }

    /// Lets node `i` back onto the network after [`EmulatedNet::cut`].
    pub fn mend(&self, i: u32) -> Result<(), NetError> {
        ip(&self.bridge, &["link", "set", &format!("n{i}"), "up"]).map(|_| ())
    }

    /// Cuts the path between nodes `a` and `b` only (each drops what it would send to the
    /// other: a blackhole route in each namespace); both still reach every other node.
    pub fn cut_between(&self, a: u32, b: u32) -> Result<(), NetError> {
        self.blackhole("add", a, b)?;
        self.blackhole("add", b, a)
    }

    /// Restores the path between nodes `a` and `b` after [`EmulatedNet::cut_between`].
    pub fn mend_between(&self, a: u32, b: u32) -> Result<(), NetError> {
        self.blackhole("del", a, b)?;
        self.blackhole("del", b, a)
    }

    fn blackhole(&self, op: &str, from: u32, to: u32) -> Result<(), NetError> {
        let dst = format!("{}/32", self.addr(to));
        ip(self.namespace(from), &["route", op, "blackhole", &dst]).map(|_| ())
    }

    fn fd(&self, i: u32) -> RawFd {
        self.nodes[i as usize].handle.as_raw_fd()
    }

    /// One line: rate, delay, MTU, subnet, namespaces.
    pub fn describe(&self) -> String {
        let delay = match self.spec.delay_ms {
            Some(d) => format!(", {d} ms one-way delay"),
            None => String::new(),
        };
        format!(
            "{} per node link each way (tbf){delay}, MTU {}, {} nodes in namespaces {}-n0..n{} on {}",
            self.spec.rate,
            self.spec.mtu,
            self.spec.nodes,
            self.prefix,
            self.spec.nodes - 1,
            self.subnet
        )
    }
}

impl Drop for EmulatedNet {
    fn drop(&mut self) {
        // Our open handles would keep the namespaces (and their links) alive.
        self.nodes.clear();
        for name in self.created.drain(..).rev() {
            if let Err(e) = run("ip", &["netns", "del", &name]) {
                eprintln!("warning: could not remove network namespace {name}: {e}");
            }
        }
    }
}

fn ip(ns: &str, args: &[&str]) -> Result<String, NetError> {
    let mut all = vec!["-n", ns];
    all.extend_from_slice(args);
    run("ip", &all)
}

fn tc(ns: &str, args: &[&str]) -> Result<String, NetError> {
    let mut all = vec!["-n", ns];
    all.extend_from_slice(args);
    run("tc", &all)
}

/// Fails with [`NetError::NetemMissing`] unless a netem qdisc can be added (tried on `lo` of
/// namespace `ns`, then removed).
fn check_netem(ns: &str) -> Result<(), NetError> {
    match tc(
        ns,
        &["qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
    ) {
        Ok(_) => {
            tc(ns, &["qdisc", "del", "dev", "lo", "root"])?;
            Ok(())
        }
        Err(NetError::Command { stderr, .. }) => Err(NetError::NetemMissing { detail: stderr }),
        Err(e) => Err(e),
    }
}

/// Removes the namespaces earlier launchers left behind (a launcher killed with SIGKILL
/// cannot clean up): those named after this process's pid (a recycled pid) while this
/// process has created none, and those of a pid that no longer runs and with no process
/// inside. Returns the names removed.
pub fn remove_leftovers() -> Result<Vec<String>, NetError> {
    let own = std::process::id();
    let mut removed = Vec::new();
    for name in namespaces_named(&run("ip", &["netns", "list"])?) {
        let Some(pid) = creator_pid(&name) else {
            continue;
        };
        // Our own pid's are an earlier process's until this one creates networks itself.
        let abandoned = (pid == own && CREATED.load(Ordering::SeqCst) == 0)
            || (pid != own
                && !std::path::Path::new(&format!("/proc/{pid}")).exists()
                && run("ip", &["netns", "pids", &name])?.trim().is_empty());
        if abandoned {
            run("ip", &["netns", "del", &name])?;
            removed.push(name);
        }
    }
    Ok(removed)
}

/// The namespace names in `ip netns list` output (`NAME` or `NAME (id: 3)` per line).
fn namespaces_named(list: &str) -> Vec<String> {
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// The pid in `trellis-<pid>-...`, for names this module makes.
fn creator_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let (pid, tail) = rest.split_once('-')?;
    (!tail.is_empty()).then_some(())?;
    pid.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_trellis_namespaces_have_a_creator() {
        let list = "trellis-4242-0-n1 (id: 3)\ntrellis-4242-0-br\nother-ns\ntrellis-x-n0\n";
        let names = namespaces_named(list);
        assert_eq!(names.len(), 4);
        let pids: Vec<Option<u32>> = names.iter().map(|n| creator_pid(n)).collect();
        assert_eq!(pids, [Some(4242), Some(4242), None, None]);
        assert_eq!(creator_pid("trellis-17"), None);
    }

    #[test]
    fn bad_specs_are_refused_before_anything_is_built() {
        let rate: LinkRate = "1gbit".parse().unwrap();
        let spec = |nodes, mtu, delay_ms| NetSpec {
            nodes,
            rate,
            delay_ms,
            mtu,
        };
        for (s, says) in [
            (spec(0, 1500, None), "at most 253 nodes, not 0"),
            (spec(254, 1500, None), "not 254"),
            (spec(2, 100, None), "--link-mtu 100"),
            (spec(2, 1500, Some(0)), "--link-delay 0"),
        ] {
            let e = EmulatedNet::create(s).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
