//! The cluster file (TOML): the nodes (id, address), where partition files and certificates
//! live, the partition placement (explicit or `auto`), and the failure-detection settings.
//!
//! ```toml
//! certs = "certs"            # ca.pem, node-N.pem, node-N.key (trellis cert init / issue)
//! partitions = "parts"       # partition folder (trellis partition --out)
//! coordinator = 0            # the node that drives training
//! heartbeat_ms = 500         # QUIC keep-alive on idle connections
//! idle_timeout_ms = 3000     # a peer silent this long is dead
//! takeover = "majority"      # serving: who may succeed a lost engine node ("any": anyone)
//! [[node]]
//! id = 0
//! addr = "10.0.0.1:7000"
//! [[node]]
//! id = 1
//! addr = "10.0.0.2:7000"
//! parts = [2, 3]             # optional: explicit placement (then on every node)
//! partitions = "/scratch/p"  # optional: this node's own partition folder
//! ```
//! Relative paths are relative to the cluster file. Port 0 picks an ephemeral port (the node
//! then tells the coordinator where it listens).
use crate::ActorError;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use trellis_transport::quic::QuicConfig;

/// A parsed, validated cluster file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    pub certs: PathBuf,
    pub partitions: PathBuf,
    #[serde(default)]
    pub coordinator: u32,
    #[serde(default = "default_heartbeat")]
    pub heartbeat_ms: u64,
    #[serde(default = "default_idle")]
    pub idle_timeout_ms: u64,
    /// How long the coordinator waits for one step of one partition.
    #[serde(default = "default_deadline")]
    pub step_deadline_ms: u64,
    /// How long the coordinator waits for every node to join, and a node started before the
    /// coordinator keeps trying to reach it (with backoff).
    #[serde(default = "default_join")]
    pub join_timeout_ms: u64,
    /// R: other nodes that keep a replica of each partition (its file, and the model state
    /// every node holds), ready to adopt it when its node is lost.
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    /// Recoveries (partition restarts and node losses) a run may perform before it fails.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// A partition restarted more than `max_restarts_per_partition` times within
    /// `restart_window_epochs` epochs is moved to a node holding its replica.
    #[serde(default = "default_part_restarts")]
    pub max_restarts_per_partition: u32,
    #[serde(default = "default_window")]
    pub restart_window_epochs: u32,
    /// The MTU of the network between the nodes, when known (e.g. 1500): QUIC then sends
    /// datagrams of at most MTU - 48 bytes (IPv6 and UDP headers) from the start, without MTU
    /// discovery, batched with segmentation offload (GSO). Unset: discovery (on loopback, one
    /// probe at its MTU) and no GSO (`QuicConfig`'s defaults).
    #[serde(default)]
    pub link_mtu: Option<u16>,
    /// Serving (`trellis serve --cluster`): which survivors of the engine node's loss may
    /// take over (see [`Takeover`]).
    #[serde(default)]
    pub takeover: Takeover,
    #[serde(rename = "node")]
    pub nodes: Vec<NodeEntry>,
}

/// Who may succeed a serving cluster's lost engine node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Takeover {
    /// Only nodes that reach more than half of the cluster file's nodes (themselves among
    /// them) take over, and an engine node cut off from more than half stops answering: a
    /// network partition never leaves two engine nodes serving (the side with the majority
    /// serves; with exactly half, the engine node's side). A two-node cluster therefore has
    /// no take-over.
    #[default]
    Majority,
    /// Any survivor takes over, even alone: the service outlives every node but one, and a
    /// network partition can split it in two.
    Any,
}

/// One `[[node]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub id: u32,
    pub addr: SocketAddr,
    /// Partitions this node hosts (explicit placement).
    #[serde(default)]
    pub parts: Option<Vec<u32>>,
    /// This node's partition folder, if not the cluster's.
    #[serde(default)]
    pub partitions: Option<PathBuf>,
}

fn default_heartbeat() -> u64 {
    500
}
fn default_idle() -> u64 {
    3000
}
fn default_deadline() -> u64 {
    120_000
}
fn default_join() -> u64 {
    300_000
}
fn default_replicas() -> u32 {
    1
}
fn default_max_restarts() -> u32 {
    8
}
fn default_part_restarts() -> u32 {
    3
}
fn default_window() -> u32 {
    10
}

fn bad(path: &Path, m: impl std::fmt::Display) -> ActorError {
    ActorError::Cluster(format!("{}: {m}", path.display()))
}

impl ClusterFile {
    /// Reads and validates `path`; relative paths become relative to its folder.
    pub fn load(path: &Path) -> Result<Self, ActorError> {
        let text = std::fs::read_to_string(path).map_err(|e| bad(path, e))?;
        let mut c = Self::parse(&text).map_err(|e| bad(path, e))?;
        let base = path.parent().unwrap_or(Path::new("."));
        c.certs = base.join(&c.certs);
        c.partitions = base.join(&c.partitions);
        for n in &mut c.nodes {
            if let Some(p) = &n.partitions {
                n.partitions = Some(base.join(p));
            }
        }
        Ok(c)
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let c: ClusterFile = toml::from_str(text).map_err(|e| e.to_string())?;
        if c.nodes.is_empty() {
            return Err("no [[node]] entries".into());
        }
        let mut ids: Vec<u32> = c.nodes.iter().map(|n| n.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err("two [[node]] entries have the same id".into());
        }
        if !ids.contains(&c.coordinator) {
            return Err(format!(
                "coordinator = {} is not a [[node]] id",
                c.coordinator
            ));
        }
        let explicit = c.nodes.iter().filter(|n| n.parts.is_some()).count();
        if explicit != 0 && explicit != c.nodes.len() {
            return Err("either every [[node]] lists `parts` or none does (auto placement)".into());
        }
        if let Some(mtu) = c.link_mtu.filter(|&m| m < 1248) {
            return Err(format!(
                "link_mtu = {mtu}: QUIC needs 1200-byte datagrams, so an MTU of at least 1248"
            ));
        }
        if c.heartbeat_ms == 0 || c.heartbeat_ms >= c.idle_timeout_ms {
            return Err(format!(
                "heartbeat_ms ({}) must be above 0 and below idle_timeout_ms ({})",
                c.heartbeat_ms, c.idle_timeout_ms
            ));
        }
        Ok(c)
    }

    /// The entry of node `id`.
    pub fn node(&self, id: u32) -> Result<&NodeEntry, ActorError> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(|| ActorError::Cluster(format!("node {id} is not in the cluster file")))
    }

    /// Node ids other than the coordinator, ascending.
    pub fn workers(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .nodes
            .iter()
            .map(|n| n.id)
            .filter(|&n| n != self.coordinator)
            .collect();
        v.sort_unstable();
        v
    }

    /// The partition folder of node `id`.
    pub fn partitions_of(&self, id: u32) -> PathBuf {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .and_then(|n| n.partitions.clone())
            .unwrap_or_else(|| self.partitions.clone())
    }

    /// `placement[p]`: the node hosting partition `p` of `parts`. Auto placement gives node i
    /// (in ascending id order) a contiguous range of partitions, sizes differing by at most 1.
    pub fn placement(&self, parts: usize) -> Result<Vec<u32>, ActorError> {
        let mut ids: Vec<u32> = self.nodes.iter().map(|n| n.id).collect();
        ids.sort_unstable();
        if self.nodes[0].parts.is_none() {
            if parts < ids.len() {
                return Err(ActorError::Cluster(format!(
                    "{parts} partitions cannot fill {} nodes",
                    ids.len()
                )));
            }
            return Ok((0..parts).map(|p| ids[p * ids.len() / parts]).collect());
        }
        let mut placement = vec![None; parts];
        for n in &self.nodes {
            for &p in n.parts.as_deref().unwrap_or_default() {
                let slot = placement.get_mut(p as usize).ok_or_else(|| {
                    ActorError::Cluster(format!(
                        "node {} lists partition {p}, but there are only {parts}",
                        n.id
                    ))
                })?;
                if let Some(other) = slot.replace(n.id) {
                    return Err(ActorError::Cluster(format!(
                        "partition {p} is placed on both node {other} and node {}",
                        n.id
                    )));
                }
            }
        }
        placement
            .into_iter()
            .enumerate()
            .map(|(p, n)| {
                n.ok_or_else(|| ActorError::Cluster(format!("partition {p} is placed on no node")))
            })
            .collect()
    }

    /// The rule that decides who serves after losses: `None` with `takeover = "any"`.
    pub fn quorum(&self) -> Option<crate::cluster::serving::succession::Quorum> {
        (self.takeover == Takeover::Majority).then_some(
            crate::cluster::serving::succession::Quorum {
                members: self.nodes.len(),
            },
        )
    }

    /// Node ids, ascending.
    pub fn ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.nodes.iter().map(|n| n.id).collect();
        ids.sort_unstable();
        ids
    }

    /// The QUIC settings of node `id`: its address, keep-alive and idle timeout.
    pub fn quic(&self, id: u32) -> Result<QuicConfig, ActorError> {
        let n = self.node(id)?;
        let mut cfg = QuicConfig {
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            keep_alive: Duration::from_millis(self.heartbeat_ms),
            // Not the idle timeout: a node's first halo exchange dials all its neighbours at
            // once, and on a machine shared by many nodes their handshakes queue for the CPU.
            connect_timeout: Duration::from_millis(self.idle_timeout_ms.max(10_000)),
            ..QuicConfig::with_bind(n.addr)
        };
        if let Some(mtu) = self.link_mtu {
            let payload = mtu.saturating_sub(48);
            cfg.max_udp_payload = payload;
            cfg.known_mtu = Some(payload);
            cfg.gso = true;
        }
        Ok(cfg)
    }
}

/// The `r` nodes that keep replicas of a partition owned by `owner`: the next `r` nodes after
/// it in ascending-id ring order (never the owner itself).
pub fn replica_nodes(ids: &[u32], owner: u32, r: usize) -> Vec<u32> {
    let start = ids.iter().position(|&n| n == owner).unwrap_or(0);
    (1..ids.len())
        .map(|i| ids[(start + i) % ids.len()])
        .take(r)
        .collect()
}

/// The partitions (placed on other nodes) whose replicas node `me` keeps.
pub fn replicated_by(placement: &[u32], ids: &[u32], r: usize, me: u32) -> Vec<u32> {
    (0..placement.len() as u32)
        .filter(|&p| {
            let owner = placement[p as usize];
            owner != me && replica_nodes(ids, owner, r).contains(&me)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn replicas_follow_the_owner_in_ring_order() {
        assert_eq!(super::replica_nodes(&[0, 1, 2], 1, 1), vec![2]);
        assert_eq!(super::replica_nodes(&[0, 1, 2], 2, 2), vec![0, 1]);
        assert_eq!(super::replica_nodes(&[0, 1, 2], 0, 5), vec![1, 2]);
        assert!(super::replica_nodes(&[4], 4, 1).is_empty());
    }

    use super::*;

    const BASE: &str = "certs = \"c\"\npartitions = \"p\"\n";

    fn nodes(extra: &[&str]) -> String {
        let mut s = BASE.to_string();
        for (i, e) in extra.iter().enumerate() {
            s += &format!("[[node]]\nid = {i}\naddr = \"127.0.0.1:0\"\n{e}\n");
        }
        s
    }

    #[test]
    fn a_known_link_mtu_sets_the_datagram_size_and_gso() {
        let c = ClusterFile::parse(&nodes(&["", ""])).unwrap();
        let q = c.quic(1).unwrap();
        assert!(!q.gso && q.known_mtu.is_none(), "{q:?}");
        let c = ClusterFile::parse(&format!("link_mtu = 1500\n{}", nodes(&["", ""]))).unwrap();
        let q = c.quic(1).unwrap();
        assert_eq!(
            (q.max_udp_payload, q.known_mtu, q.gso),
            (1452, Some(1452), true)
        );
        let e = ClusterFile::parse(&format!("link_mtu = 1000\n{}", nodes(&[""]))).unwrap_err();
        assert!(
            e.contains("link_mtu = 1000") && e.contains("at least 1248"),
            "{e}"
        );
    }

    #[test]
    fn a_majority_takes_over_unless_the_file_says_any() {
        let c = ClusterFile::parse(&nodes(&["", "", ""])).unwrap();
        assert_eq!(c.takeover, Takeover::Majority);
        assert_eq!(
            c.quorum(),
            Some(crate::cluster::serving::succession::Quorum { members: 3 })
        );
        let any = ClusterFile::parse(&format!("takeover = \"any\"\n{}", nodes(&["", ""])));
        assert_eq!(any.unwrap().quorum(), None);
        let e = ClusterFile::parse(&format!("takeover = \"some\"\n{}", nodes(&[""]))).unwrap_err();
        assert!(e.contains("majority") && e.contains("any"), "{e}");
    }

    #[test]
    fn auto_placement_is_contiguous_and_balanced() {
        let c = ClusterFile::parse(&nodes(&["", "", ""])).unwrap();
        assert_eq!(c.placement(6).unwrap(), vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(c.placement(4).unwrap(), vec![0, 0, 1, 2]);
        assert!(c.placement(2).is_err());
        assert_eq!(c.workers(), vec![1, 2]);
    }

    #[test]
    fn explicit_placement_is_checked() {
        let c = ClusterFile::parse(&nodes(&["parts = [1]", "parts = [0, 2]"])).unwrap();
        assert_eq!(c.placement(3).unwrap(), vec![1, 0, 1]);
        let e = c.placement(4).unwrap_err().to_string();
        assert!(e.contains("partition 3 is placed on no node"), "{e}");
        let c = ClusterFile::parse(&nodes(&["parts = [0]", "parts = [0]"])).unwrap();
        assert!(c.placement(1).unwrap_err().to_string().contains("both"));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        for (text, needle) in [
            (BASE.to_string(), "node"),
            (nodes(&["", "parts = [0]"]), "every [[node]]"),
            (nodes(&["colour = 1"]), "colour"),
            (
                format!("{BASE}coordinator = 5\n{}", &nodes(&[""])[BASE.len()..]),
                "coordinator",
            ),
            ("certs = 1".to_string(), "certs"),
        ] {
            let e = ClusterFile::parse(&text).unwrap_err();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let e = ClusterFile::load(Path::new("/nonexistent/cluster.toml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cluster.toml"));
    }
}
