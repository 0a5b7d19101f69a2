//! An emulated network that costs something: one Linux network namespace per node, joined by
//! veth pairs to a bridge (in a namespace of its own, so the host's network is never touched),
//! each node's link limited to a rate by a token bucket (tc `tbf`) in both directions, and,
//! where the kernel has `netem`, a one-way delay.
//!
//! This module owns the namespaces, links and qdiscs of one emulated network: it creates them
//! ([`EmulatedNet::create`]), runs processes inside them ([`EmulatedNet::enter`]), measures the
//! rate the links achieve ([`EmulatedNet::probe`]), reads what crossed each link
//! ([`EmulatedNet::counters`]) and removes everything when dropped (and
//! removes what a killed launcher left behind: [`remove_leftovers`]). `trellis launch
//! --link-rate` and `trellis bench comm` use it.
//!
//! Names carry the creating process's pid (`trellis-<pid>-n<i>`, `trellis-<pid>-br`), so
//! concurrent launchers never collide and leftovers are recognised by their prefix.
mod command;
mod counters;
mod net;
mod probe;
mod rate;
mod subnet;

pub use command::check_privileges;
pub use counters::LinkCounters;
pub use net::{remove_leftovers, EmulatedNet, NetSpec, MAX_NODES};
pub use probe::ProbeResult;
pub use rate::{LinkRate, TbfParams};
pub use subnet::Subnet;

/// What can go wrong building, using or removing an emulated network.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A `--link-rate` value that is not a rate.
    #[error("bad link rate {value:?}: {reason}")]
    BadRate { value: String, reason: String },
    /// A `--link-delay` or `--link-mtu` value out of range.
    #[error("bad {option} {value}: {reason}")]
    BadValue {
        option: &'static str,
        value: String,
        reason: String,
    },
    /// The process lacks the capabilities that namespaces, links and qdiscs need.
    #[error(
        "the emulated network (--link-rate) needs root: capabilities {missing} are missing \
         (it creates network namespaces, veth links and tc qdiscs); run as root (sudo) or \
         without --link-rate"
    )]
    NotPermitted { missing: String },
    /// `ip` or `tc` could not be started.
    #[error(
        "cannot run `{program}`: {source} (the emulated network needs iproute2's `ip` and `tc`)"
    )]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// `ip` or `tc` ran and failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    /// `--link-delay` on a kernel without the netem qdisc.
    #[error(
        "--link-delay needs the netem qdisc, which this kernel lacks (tc said: {detail}); \
         rate limits (tbf) work here: drop --link-delay"
    )]
    NetemMissing { detail: String },
    /// Every candidate subnet overlaps an address or route of the host.
    #[error(
        "no free /24 for the emulated network: {tried} all overlap the host's addresses or routes"
    )]
    NoSubnet { tried: String },
    /// More nodes than one /24 holds.
    #[error("an emulated network holds at most {max} nodes, not {nodes}")]
    TooManyNodes { nodes: u32, max: u32 },
    /// A namespace that cannot be opened or entered.
    #[error("network namespace {name}: {source}")]
    Namespace {
        name: String,
        source: std::io::Error,
    },
    /// The rate probe between two nodes failed.
    #[error("link probe from node {from} to node {to}: {detail}")]
    Probe { from: u32, to: u32, detail: String },
}
